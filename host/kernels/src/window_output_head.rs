//! The output head of a window of 2 to 8 tokens as one kernel, over a dense or 4-bit head: what
//! [`super::output_head`] does for one token (the final RMSNorm, the product with the head,
//! the soft-cap), each row of the head (the largest matrix of a step) read once for all the
//! window's tokens. Each token's logits are the single-token kernel's bit for bit: the same
//! staging and norm, each row's dot over the same pieces in the same order (for a 4-bit head
//! the single-token kernel's float or integer dots, over each token's own chunk sums and
//! integers).

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::post_attention::Weight;
use super::products::{element_bytes, serves as row_width_served, THREADS};
use super::{PerSharedMemory, TemplateArg};

const SOURCE: &str = include_str!("cuda/window_output_head.cu");

/// Blocks of the kernel at most (as [`super::output_head`]'s).
const MAX_BLOCKS: i32 = 1056;

thread_local! {
    static KERNELS: RefCell<PerSharedMemory> = RefCell::new(PerSharedMemory::new(
        "window_output_head",
        &["x", "nw", "w", "w_s", "w_b"],
        &["logits"],
        SOURCE,
        super::window_post_attention::rows_window_header(""),
    ));
}

/// Whether [`window_output_head`] takes the window `x` (`[T, K]`) with this head: 2 to 8
/// tokens of a width the product kernels serve, and a head of that width, dense or 4-bit in
/// a group size the kernels take.
pub fn serves_head(x: &Array, head: &Weight) -> bool {
    let tokens = x.shape().first().copied().unwrap_or(0) as usize;
    x.ndim() == 2
        && (2..=super::window_post_attention::MAX_TOKENS).contains(&tokens)
        && row_width_served(x.shape()[1] as usize, x.dtype())
        && head
            .layout(head.rows(), x.shape()[1], x.dtype(), "")
            .is_ok()
}

/// Bytes of dynamic shared memory for `tokens` staged inputs of `k` values, and for a 4-bit
/// head (`bits` 4) each token's chunk sums and integer scales, a float each per 32 values.
fn shared_bytes(tokens: usize, k: usize, element: usize, bits: i32) -> usize {
    let per_chunk = if bits == 0 { 0 } else { 2 * 4 };
    tokens * (k * element + k / 32 * per_chunk)
}

/// Float32 logits `[T, N]` of the window `x` (`[T, K]`): for each token what
/// [`super::output_head::output_head`] gives for it alone, `W` `[N, K]` dense in `x`'s
/// dtype or 4-bit affine. Check [`serves_head`] first.
pub fn window_output_head(
    x: &Array,
    norm: &Array,
    eps: f32,
    head: Weight,
    softcap: Option<f32>,
) -> Result<Array> {
    if !serves_head(x, &head) {
        bail!(
            "window_output_head: a window {:?} {:?} with this head is not served",
            x.shape(),
            x.dtype()
        );
    }
    let (tokens, k) = (x.shape()[0], x.shape()[1]);
    let dtype = x.dtype();
    if norm.shape() != [k] || norm.dtype() != dtype {
        bail!(
            "window_output_head: the norm weight is {:?} {:?}, expected [{k}] {dtype:?}",
            norm.shape(),
            norm.dtype()
        );
    }
    let cap_bits = super::output_head::softcap_bits(softcap, "window_output_head")?;
    let n = head.rows();
    let (bits, group) = head.layout(n, k, dtype, "window_output_head: the head weight")?;
    let warps_needed = (n + 1) / 2;
    let blocks = ((warps_needed + 7) / 8).clamp(1, MAX_BLOCKS);
    let element = element_bytes(dtype).unwrap_or(2);
    let shared = shared_bytes(tokens as usize, k as usize, element, bits);
    let [w, w_s, w_b] = head.inputs();
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(shared, eps)?;
        let mut out = kernel.apply(
            &[x, norm, w, w_s, w_b],
            &[(&[tokens, n], Dtype::Float32)],
            (blocks * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"N", TemplateArg::Int(n)),
                (c"TOKENS", TemplateArg::Int(tokens)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
                (c"INT_DOTS", TemplateArg::Bool(false)),
                (c"CAP_BITS", TemplateArg::Int(cap_bits as i32)),
            ],
        )?;
        Ok(out.remove(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_with_a_dense_head_of_their_width_are_served() {
        let w = Array::zeros::<f32>(&[16, 64]).unwrap();
        let head = Weight::Dense(&w);
        let window = |t| Array::zeros::<f32>(&[t, 64]).unwrap();
        assert!(serves_head(&window(2), &head));
        assert!(serves_head(&window(8), &head));
        assert!(
            !serves_head(&window(1), &head),
            "one token is the single-token kernel's"
        );
        assert!(!serves_head(&window(9), &head));
        let narrow = Array::zeros::<f32>(&[16, 32]).unwrap();
        assert!(!serves_head(&window(4), &Weight::Dense(&narrow)));
        let norm = Array::zeros::<f32>(&[64]).unwrap();
        let err = window_output_head(&window(4), &norm, 1e-6, head, Some(-1.0)).unwrap_err();
        assert!(err.to_string().contains("soft-cap"), "{err}");
    }
}
