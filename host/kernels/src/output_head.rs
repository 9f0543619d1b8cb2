//! The output head of one decode token as one kernel: the final RMSNorm, the product with the
//! head (the tied embedding table or `lm_head`, dense or 4-bit affine), the float32 cast and
//! the logit soft-cap `cap tanh(l / cap)`.
//!
//! Why: MLX runs these as six operations (norm, product, cast, divide, tanh, multiply), and
//! over a 4-bit table its quantized product streams the largest matrix of a step at about
//! 1 TB/s (Nsight Compute, E4B 4-bit: 370 µs of a 4.8 ms step). Here every warp walks rows of
//! the table (a grid of a fixed number of blocks, so each block stages the normed input once
//! for many rows), through the same row helpers as the gated and closing products
//! ([`super::products`], [`super::affine4`]).
//!
//! Roundings follow MLX's operations: the normed input to the activation dtype, then its
//! product with the norm weight; each logit rounded to the dtype, then soft-capped in float32.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::post_attention::Weight;
use super::products::{
    blocks_for_rows_per_warp, rows_per_warp_for, serves, weight_rows_header, THREADS,
};
use super::{PerEpsilon, TemplateArg};

const SOURCE: &str = include_str!("cuda/output_head.cu");

/// Blocks of the kernel at most: about eight a multiprocessor of an H200, enough to keep the
/// memory busy, few enough that each block's staging of the input serves many rows.
const MAX_BLOCKS: i32 = 1056;

thread_local! {
    // One compiled kernel per epsilon; the soft-cap is a template argument.
    static KERNELS: RefCell<PerEpsilon> = RefCell::new(PerEpsilon::new(
        "output_head",
        &["x", "nw", "w", "w_s", "w_b"],
        &["logits"],
        SOURCE,
    ).with_header(weight_rows_header()));
}

/// Float32 logits `[1, N]` of one token: `cap tanh((W rms_norm(x, norm)) / cap)` (without
/// `softcap`, no cap), `x` `[1, K]`, `W` `[N, K]` dense or 4-bit affine in `x`'s dtype.
/// Check [`serves_head`] first.
pub fn output_head(
    x: &Array,
    norm: &Array,
    eps: f32,
    head: Weight,
    softcap: Option<f32>,
) -> Result<Array> {
    if x.ndim() != 2 || x.shape()[0] != 1 {
        bail!(
            "output_head: the input must be one token [1, K], got {:?}",
            x.shape()
        );
    }
    let k = x.shape()[1];
    let dtype = x.dtype();
    if !serves(k as usize, dtype) {
        bail!("output_head: rows of {k} {dtype:?} values are not served");
    }
    if norm.shape() != [k] || norm.dtype() != dtype {
        bail!(
            "output_head: the norm weight is {:?} {:?}, expected [{k}] {dtype:?}",
            norm.shape(),
            norm.dtype()
        );
    }
    let n = head.rows();
    let (bits, group) = head.layout(n, k, dtype, "output_head: the head weight")?;
    let cap_bits = softcap_bits(softcap, "output_head")?;
    let rows_per_warp = rows_per_warp_for(&head);
    let blocks = blocks_for_rows_per_warp(n, rows_per_warp).min(MAX_BLOCKS);
    let [w, w_s, w_b] = head.inputs();
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        let mut out = kernel.apply(
            &[x, norm, w, w_s, w_b],
            &[(&[1, n], Dtype::Float32)],
            (blocks * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"N", TemplateArg::Int(n)),
                (c"RPW", TemplateArg::Int(rows_per_warp)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
                (c"CAP_BITS", TemplateArg::Int(cap_bits as i32)),
                (c"INT_DOTS", TemplateArg::Bool(false)),
            ],
        )?;
        Ok(out.remove(0))
    })
}

/// The soft-cap as the kernels take it: its float32 bits (0: none). `what` names the caller
/// in the error for a cap that is not a positive number.
pub(crate) fn softcap_bits(softcap: Option<f32>, what: &str) -> Result<u32> {
    Ok(match softcap {
        Some(c) if c.is_finite() && c > 0.0 => c.to_bits(),
        Some(c) => bail!("{what}: the soft-cap must be a positive number, got {c}"),
        None => 0,
    })
}

/// Whether [`output_head`] takes a token `x` with this head: one token whose width the
/// product kernels serve, and a dense head or a 4-bit one in a group size they take.
pub fn serves_head(x: &Array, head: &Weight) -> bool {
    x.ndim() == 2
        && x.shape()[0] == 1
        && serves(x.shape()[1] as usize, x.dtype())
        && head
            .layout(head.rows(), x.shape()[1], x.dtype(), "")
            .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_of_tokens_or_a_wrong_norm_is_refused_before_any_kernel() {
        let w = Array::zeros::<f32>(&[16, 8]).unwrap();
        let head = Weight::Dense(&w);
        let norm = Array::zeros::<f32>(&[8]).unwrap();
        let two = Array::zeros::<f32>(&[2, 8]).unwrap();
        let err = output_head(&two, &norm, 1e-6, head, None).unwrap_err();
        assert!(err.to_string().contains("one token"), "{err}");
        assert!(!serves_head(&two, &head));
        let one = Array::zeros::<f32>(&[1, 8]).unwrap();
        let short = Array::zeros::<f32>(&[4]).unwrap();
        let err = output_head(&one, &short, 1e-6, head, None).unwrap_err();
        assert!(err.to_string().contains("norm weight"), "{err}");
        let err = output_head(&one, &norm, 1e-6, head, Some(-1.0)).unwrap_err();
        assert!(err.to_string().contains("soft-cap"), "{err}");
        assert!(serves_head(&one, &head));
    }

    #[test]
    fn a_head_of_another_width_is_not_served() {
        let w = Array::zeros::<f32>(&[16, 12]).unwrap();
        let one = Array::zeros::<f32>(&[1, 8]).unwrap();
        assert!(!serves_head(&one, &Weight::Dense(&w)));
    }
}
