//! Rotary position embedding in the rotate-half layout (pairs `j` and `j + head_dim/2`).
//!
//! On the CPU MLX has no RoPE kernel and writes each one out as ~15 operations (positions,
//! angles, cosines and sines, slices, products, a concatenation), each costing host time in a
//! decode step. There, for float32 windows of up to `HOST_ANGLE_MAX_TOKENS` (16) tokens (decode
//! steps and verify windows, which thus compute the same function), the angles' cosines and
//! sines are computed on the host (float32, `position * (1 / period)` as transformers computes
//! them), the rotate-half partner of every element comes from one product with a fixed signed
//! permutation, and the rest is one compiled element-wise kernel: two operations instead of
//! fifteen. Longer windows (prefill chunks) keep MLX's RoPE: the angles round differently in
//! the last bit, and over a whole 20-token prompt that moved one oracle fixture's logits from
//! 9.6e-5 to 1.03e-4 of transformers', past the 1e-4 the tests allow; prefill's cost is its
//! arithmetic anyway.

use std::cell::RefCell;

use anyhow::Result;
use mlx_rs::error::Exception;
use mlx_rs::ops::matmul;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{fast, Array, DeviceType};

use crate::device::default_is;

/// Windows up to this many tokens take the two-operation CPU path.
const HOST_ANGLE_MAX_TOKENS: i32 = 16;

type Rotate = Box<dyn for<'a> FnMut(&'a [Array]) -> Result<Vec<Array>, Exception>>;

thread_local! {
    /// `x * cos + partner * sin` (the arguments in that order), compiled once per thread
    /// (one trace per shape).
    static ROTATE: RefCell<Rotate> = RefCell::new(Box::new(compile(
        |args: &[Array]| -> Result<Vec<Array>, Exception> {
            let [x, partner, cos, sin] = args else {
                return Err(Exception::custom("RoPE takes x, partner, cos and sin"));
            };
            Ok(vec![x.multiply(cos)?.add(&partner.multiply(sin)?)?])
        },
        false,
    )));
}

use super::config::RopeKind;

/// RoPE for one layer kind, ready to apply to `[batch, heads, tokens, head_dim]`.
pub struct Rope {
    head_dim: i32,
    /// The base of a plain `base^(2j/d)` schedule; `None`: MLX's RoPE takes `periods`.
    base: Option<f32>,
    /// Every pair's period (`1 / inverse frequency`, float32 `[head_dim / 2]`), also read by
    /// the fused decode kernels.
    periods: Array,
    /// `[head_dim, head_dim]` float32: `x @ partner_map` puts `-x[j + D/2]` at `j` and
    /// `x[j - D/2]` at `j + D/2` (the rotate-half partners), for the CPU path.
    partner_map: Array,
    /// The CPU path's cosines and sines of the last window it rotated, by (first position,
    /// tokens): a layer's q and k rotate the same positions, so they are made once per step.
    angles: RefCell<Option<(usize, usize, Array, Array)>>,
}

/// The signed permutation of [`Rope::partner_map`].
fn partner_map(head_dim: usize) -> Array {
    let half = head_dim / 2;
    let mut m = vec![0f32; head_dim * head_dim];
    for j in 0..half {
        m[(j + half) * head_dim + j] = -1.0;
        m[j * head_dim + j + half] = 1.0;
    }
    Array::from_slice(&m, &[head_dim as i32, head_dim as i32])
}

impl Rope {
    pub fn new(kind: &RopeKind, head_dim: usize) -> Self {
        match *kind {
            RopeKind::Default { theta } => {
                let periods: Vec<f32> = (0..head_dim / 2)
                    .map(|j| theta.powf(2.0 * j as f32 / head_dim as f32))
                    .collect();
                Rope {
                    head_dim: head_dim as i32,
                    base: Some(theta),
                    periods: Array::from_slice(&periods, &[periods.len() as i32]),
                    partner_map: partner_map(head_dim),
                    angles: RefCell::new(None),
                }
            }
            RopeKind::Proportional {
                theta,
                partial_factor,
                factor,
            } => {
                // The rotated pairs use the frequencies of a full head_dim RoPE (denominator
                // head_dim, not the rotated width); the remaining pairs get an infinite period,
                // i.e. angle 0, so they pass through unchanged.
                let half = head_dim / 2;
                let rotated = ((partial_factor * head_dim as f32) as usize / 2).min(half);
                let periods: Vec<f32> = (0..half)
                    .map(|j| {
                        if j < rotated {
                            factor * theta.powf(2.0 * j as f32 / head_dim as f32)
                        } else {
                            f32::INFINITY
                        }
                    })
                    .collect();
                Rope {
                    head_dim: head_dim as i32,
                    base: None,
                    periods: Array::from_slice(&periods, &[half as i32]),
                    partner_map: partner_map(head_dim),
                    angles: RefCell::new(None),
                }
            }
        }
    }

    /// Every pair's period (float32 `[head_dim / 2]`).
    pub fn periods(&self) -> &Array {
        &self.periods
    }

    /// Rotates `x` (`[batch, heads, tokens, head_dim]`) whose first token sits at `offset`.
    pub fn apply(&self, x: &Array, offset: usize) -> Result<Array> {
        let tokens = x.shape()[x.ndim() - 2];
        if tokens <= HOST_ANGLE_MAX_TOKENS
            && x.dtype() == mlx_rs::Dtype::Float32
            && default_is(DeviceType::Cpu)
        {
            return self.apply_on_cpu(x, offset, tokens as usize);
        }
        Ok(fast::rope(
            x,
            self.head_dim,
            false,
            self.base,
            1.0,
            offset as i32,
            // MLX takes either a base or the periods, not both.
            self.base.is_none().then_some(&self.periods),
        )?)
    }

    /// [`Rope::apply`] in two operations: the partners from one product with
    /// [`Rope::partner_map`], then one compiled element-wise kernel with host-made cosines and
    /// sines (`[tokens, head_dim]`, each half repeated).
    fn apply_on_cpu(&self, x: &Array, offset: usize, tokens: usize) -> Result<Array> {
        let (cos, sin) = self.angles(offset, tokens);
        let partner = matmul(x, &self.partner_map)?;
        let mut out = ROTATE.with(|f| (f.borrow_mut())(&[x.clone(), partner, cos, sin]))?;
        Ok(out.remove(0))
    }

    /// Cosines and sines `[tokens, head_dim]` (each half repeated) of positions `offset..`,
    /// float32 angles `position * (1 / period)`; remembered for the step's next call.
    fn angles(&self, offset: usize, tokens: usize) -> (Array, Array) {
        if let Some((o, t, cos, sin)) = self.angles.borrow().as_ref() {
            if (*o, *t) == (offset, tokens) {
                return (cos.clone(), sin.clone());
            }
        }
        let d = self.head_dim as usize;
        let half = d / 2;
        let periods = self.periods.as_slice::<f32>();
        let (mut cos, mut sin) = (vec![0f32; tokens * d], vec![0f32; tokens * d]);
        for t in 0..tokens {
            let position = (offset + t) as f32;
            for (j, period) in periods.iter().enumerate() {
                let angle = position * (1.0 / period);
                let (s, c) = angle.sin_cos();
                for k in [j, j + half] {
                    cos[t * d + k] = c;
                    sin[t * d + k] = s;
                }
            }
        }
        let shape = [tokens as i32, d as i32];
        let (cos, sin) = (
            Array::from_slice(&cos, &shape),
            Array::from_slice(&sin, &shape),
        );
        *self.angles.borrow_mut() = Some((offset, tokens, cos.clone(), sin.clone()));
        (cos, sin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' rotate-half RoPE of `[heads, tokens, D]` rows, the first token at
    /// `position`: float32 angles `position * (1 / period)`, then the rotation in float64.
    fn reference(x: &[f32], periods: &[f32], position: usize, tokens: usize) -> Vec<f32> {
        let half = periods.len();
        let mut out = vec![0f32; x.len()];
        for (head, row) in x.chunks(2 * half).enumerate() {
            let position = position + head % tokens;
            for j in 0..half {
                let angle = (position as f32 * (1.0 / periods[j])) as f64;
                let (s, c) = angle.sin_cos();
                let (a, b) = (row[j] as f64, row[j + half] as f64);
                out[head * 2 * half + j] = (a * c - b * s) as f32;
                out[head * 2 * half + j + half] = (a * s + b * c) as f32;
            }
        }
        out
    }

    #[test]
    fn short_cpu_windows_rotate_as_transformers_does_at_any_position() {
        let kinds = [
            RopeKind::Default { theta: 10_000.0 },
            RopeKind::Proportional {
                theta: 1_000_000.0,
                partial_factor: 0.25,
                factor: 1.0,
            },
        ];
        // A decode token (three heads) and a verify window (two heads of five tokens).
        for (heads, tokens) in [(3usize, 1usize), (2, 5)] {
            let data: Vec<f32> = (0..heads * tokens * 16)
                .map(|i| (i as f32 * 0.61).cos())
                .collect();
            let x = Array::from_slice(&data, &[1, heads as i32, tokens as i32, 16]);
            for kind in &kinds {
                let rope = Rope::new(kind, 16);
                for position in [0usize, 1, 37, 5000, 120_000] {
                    let got = rope.apply(&x, position).unwrap();
                    assert_eq!(got.shape(), x.shape());
                    let want = reference(&data, rope.periods().as_slice::<f32>(), position, tokens);
                    let diff = got
                        .as_slice::<f32>()
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(diff < 1e-6, "position {position}: differs by {diff}");
                }
            }
        }
    }

    #[test]
    fn periods_cover_every_pair_for_both_kinds() {
        let plain = Rope::new(&RopeKind::Default { theta: 10_000.0 }, 8);
        let p = plain.periods().as_slice::<f32>().to_vec();
        let want: Vec<f32> = (0..4).map(|j| 10_000f32.powf(j as f32 / 4.0)).collect();
        assert_eq!(p.len(), 4);
        for (got, want) in p.iter().zip(&want) {
            assert!((got / want - 1.0).abs() < 1e-6, "{got} vs {want}");
        }
        // Proportional with a quarter of the head rotated: 1 of 4 pairs, the rest pass through.
        let partial = Rope::new(
            &RopeKind::Proportional {
                theta: 10_000.0,
                partial_factor: 0.25,
                factor: 1.0,
            },
            8,
        );
        let p = partial.periods().as_slice::<f32>().to_vec();
        assert_eq!(p[0], 1.0);
        assert!(p[1..].iter().all(|x| x.is_infinite()));
    }
}
