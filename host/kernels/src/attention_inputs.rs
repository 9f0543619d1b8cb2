//! The inputs of one decode token's attention, as one kernel: q and k RMSNorm (with their
//! weights) then RoPE, and the weightless RMSNorm of v, from the raw projections.
//!
//! On the MLX path these are eight operations on a KV-owning layer (three reshapes, three
//! RMSNorms, two RoPEs) and three on a KV-sharing one; on a GPU each operation costs host
//! time whatever its size (BENCHMARKS.md), so one launch replaces them.
//!
//! One block per head (query heads, then key heads, then value heads); thread `i` holds the
//! rotate-half pair `(i, i + D/2)`. It rounds where MLX's operations round: the normalised
//! vector to the activation dtype, then its product with the weight, then each rotated
//! element; the angle is `position / period` in float32, as MLX's RoPE computes it.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::{step_ints, PerEpsilon, TemplateArg};

const SOURCE: &str = include_str!("cuda/attention_inputs.cu");

thread_local! {
    static KERNELS: RefCell<PerEpsilon> = RefCell::new(PerEpsilon::new(
        "attention_inputs",
        &["q_raw", "k_raw", "v_raw", "q_w", "k_w", "periods", "position"],
        &["q", "k", "v"],
        SOURCE,
    ));
}

/// Whether the kernel serves heads of `head_dim` in `dtype`: a block holds half a head.
pub fn serves(head_dim: usize, dtype: Dtype) -> bool {
    head_dim >= 64
        && head_dim % 64 == 0
        && head_dim / 2 <= 1024
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
}

/// The raw projections of one token and the weights of its attention.
pub struct RawHeads<'a> {
    /// `[1, heads * D]`.
    pub q: &'a Array,
    pub q_norm: &'a Array,
    /// `[1, kv_heads * D]` key and value projections with the key norm, on a KV-owning layer
    /// (for K = V layers `v` is the key projection itself).
    pub kv: Option<(&'a Array, &'a Array, &'a Array)>,
    /// RoPE periods `[D / 2]` (float32; infinite for pairs that are not rotated).
    pub periods: &'a Array,
}

/// Returns q `[1, heads, 1, D]` and, on a KV-owning layer, k and v `[1, kv_heads, 1, D]`,
/// for a token at `position`. Check [`serves`] first.
pub fn attention_inputs(
    raw: &RawHeads,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    eps: f32,
    position: usize,
) -> Result<(Array, Option<(Array, Array)>)> {
    let dtype = raw.q.dtype();
    let position = step_ints(&[position as i32])?;
    let nkv = if raw.kv.is_some() { kv_heads } else { 0 };
    // A sharing layer has no k/v: the query's arrays stand in for the unused inputs.
    let (k_raw, v_raw, k_norm) = raw.kv.unwrap_or((raw.q, raw.q, raw.q_norm));
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        let q_shape = [1, heads, 1, head_dim];
        // Outputs of a sharing layer's k and v hold one element each and are dropped.
        let kv_shape = if nkv > 0 {
            [1, nkv, 1, head_dim]
        } else {
            [1, 1, 1, 1]
        };
        let threads = head_dim / 2;
        let mut out = kernel.apply(
            &[
                raw.q,
                k_raw,
                v_raw,
                raw.q_norm,
                k_norm,
                raw.periods,
                &position,
            ],
            &[(&q_shape, dtype), (&kv_shape, dtype), (&kv_shape, dtype)],
            ((heads + 2 * nkv) * threads, 1, 1),
            (threads, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"D", TemplateArg::Int(head_dim)),
                (c"NH", TemplateArg::Int(heads)),
                (c"NKV", TemplateArg::Int(nkv)),
            ],
        )?;
        let (Some(v), Some(k), Some(q)) = (out.pop(), out.pop(), out.pop()) else {
            bail!(
                "the attention-inputs kernel returned {} arrays, not 3",
                out.len()
            );
        };
        Ok((q, (nkv > 0).then_some((k, v))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_gemma_head_sizes_in_float_dtypes_only() {
        assert!(serves(256, Dtype::Bfloat16));
        assert!(serves(512, Dtype::Float32));
        assert!(serves(64, Dtype::Float16));
        // A block holds half a head as whole warps, at most 1024 threads.
        assert!(!serves(32, Dtype::Float32));
        assert!(!serves(96, Dtype::Float32));
        assert!(!serves(4096, Dtype::Bfloat16));
        assert!(!serves(256, Dtype::Int32));
    }
}
