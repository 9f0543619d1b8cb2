//! Attention of one query token over the target's donor K/V.
//!
//! The drafter has no key or value projections and no cache: every layer of a kind reads the
//! same donor tensors, exactly as the target's attention consumed them (K normed and rotated,
//! V normed). What it may see is decided per round by the caller, either by slicing the donor
//! to the visible entries (the session does that) or with an explicit mask (the oracle's
//! recorded rounds, whose visible entries transformers chose by its own rules).

use mlx_spec_plugin_api::mlx_rs::ops::{matmul, softmax_axis};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::linear::mlx_err;

/// The donor entries of one kind for one round.
pub struct DonorView {
    /// `[1, kv_heads, n, head_dim]`, in the compute dtype.
    pub keys: Array,
    pub values: Array,
    /// Additive `[n]` (0 visible, −inf hidden); `None`: every entry is visible.
    pub mask: Option<Array>,
}

impl DonorView {
    /// A view of which `visible[i]` says whether entry `i` takes part (at least one must).
    pub fn masked(keys: Array, values: Array, visible: &[bool]) -> Result<Self, String> {
        let n = keys.shape().get(2).copied().unwrap_or(0) as usize;
        if visible.len() != n {
            return Err(format!(
                "a mask of {} entries for a donor of {n}",
                visible.len()
            ));
        }
        if !visible.iter().any(|&v| v) {
            return Err("no donor entry is visible".to_owned());
        }
        let bias: Vec<f32> = visible
            .iter()
            .map(|&v| if v { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        let mask = Array::from_slice(&bias, &[n as i32])
            .as_dtype(keys.dtype())
            .map_err(mlx_err("donor mask"))?;
        Ok(DonorView {
            keys,
            values,
            mask: Some(mask),
        })
    }

    pub fn entries(&self) -> usize {
        self.keys.shape().get(2).copied().unwrap_or(0) as usize
    }
}

/// How scores are scaled. Gemma 4 uses 1.0 (q_norm and the target's k_norm play the part of
/// `1/sqrt(d)`); the other value exists to show that the oracle tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionScale {
    #[default]
    One,
    InverseSqrtHeadDim,
}

/// `softmax(q K^T · scale + mask) V` for the query heads `q` (`[num_heads, head_dim]`), with
/// grouped K/V: query head `h` reads kv head `h / (num_heads / kv_heads)`. Returns
/// `[1, num_heads * head_dim]`.
pub fn attend(q: &Array, donor: &DonorView, scale: AttentionScale) -> Result<Array, String> {
    let e = mlx_err("donor attention");
    let (num_heads, head_dim) = (q.shape()[0], q.shape()[1]);
    let kv_heads = donor.keys.shape()[1];
    if kv_heads == 0 || num_heads % kv_heads != 0 {
        return Err(format!(
            "{num_heads} query heads do not split over {kv_heads} donor kv heads"
        ));
    }
    // [1, kv, group, d] against [1, kv, n, d]: consecutive query heads share a kv head.
    let q = q
        .reshape(&[1, kv_heads, num_heads / kv_heads, head_dim])
        .map_err(&e)?;
    let mut scores = matmul(&q, donor.keys.swap_axes(-1, -2).map_err(&e)?).map_err(&e)?;
    if scale == AttentionScale::InverseSqrtHeadDim {
        let s = Array::from_f32(1.0 / (head_dim as f32).sqrt())
            .as_dtype(scores.dtype())
            .map_err(&e)?;
        scores = scores.multiply(&s).map_err(&e)?;
    }
    if let Some(mask) = &donor.mask {
        scores = scores.add(mask).map_err(&e)?;
    }
    // Softmax in float32 whatever the compute dtype, as transformers does.
    let probs = softmax_axis(&scores, -1, true).map_err(&e)?;
    let probs = if probs.dtype() != donor.values.dtype() {
        probs.as_dtype(donor.values.dtype()).map_err(&e)?
    } else {
        probs
    };
    matmul(&probs, &donor.values)
        .and_then(|o| o.reshape(&[1, num_heads * head_dim]))
        .map_err(e)
}

/// Float32 copy of `a` (for comparisons in tests and for reading tokens).
pub fn to_f32(a: &Array) -> Result<Array, String> {
    a.as_dtype(Dtype::Float32)
        .map_err(mlx_err("cast to float32"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two query heads over one kv head of three entries; the middle entry hidden.
    #[test]
    fn grouped_heads_mask_and_scale() {
        let keys = Array::from_slice(&[1f32, 0., 0., 1., 1., 1.], &[1, 1, 3, 2]);
        let values = Array::from_slice(&[1f32, 2., 3., 4., 5., 6.], &[1, 1, 3, 2]);
        let q = Array::from_slice(&[2f32, 0., 0., 2.], &[2, 2]);
        let view = DonorView::masked(keys, values, &[true, false, true]).unwrap();
        let out = attend(&q, &view, AttentionScale::One).unwrap();
        // Head 0: scores 2, (0), 2 -> equal weights on entries 0 and 2 -> (3, 4).
        // Head 1: scores 0, (2), 2 -> weights e^0, e^2 on entries 0 and 2.
        let w = 1.0 / (1.0 + 2f32.exp());
        let want = [3., 4., w * 1. + (1. - w) * 5., w * 2. + (1. - w) * 6.];
        let got = out.as_slice::<f32>();
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        let scaled = attend(&q, &view, AttentionScale::InverseSqrtHeadDim).unwrap();
        assert!((scaled.as_slice::<f32>()[2] - got[2]).abs() > 1e-3);
    }

    #[test]
    fn an_empty_or_mis_sized_mask_is_an_error() {
        let k = || Array::from_slice(&[1f32, 0.], &[1, 1, 1, 2]);
        assert!(DonorView::masked(k(), k(), &[false]).is_err());
        assert!(DonorView::masked(k(), k(), &[true, true]).is_err());
    }
}
