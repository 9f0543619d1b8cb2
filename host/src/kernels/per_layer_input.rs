//! The per-layer-input block of a decode token's layer as one kernel (`--fused-kernels
//! ...,per-layer-input`), from the hidden state `h` after the feed-forward block:
//!
//! 1. `g = gelu_tanh(W_in h) * v`, `v` this layer's per-layer input;
//! 2. output `(h + rms_norm(W_proj g, post_norm)) * layer_scalar`.
//!
//! Why: with [`super::products`] these are two launches (a gated product and a closing
//! product) of a few microseconds of device time each, over 2.6 MB of bf16 weights, while
//! each costs the host 10-15 µs on the H200 machines measured: at 42 layers a step, about
//! 0.5 ms of host time, which bounds the step on a machine whose host is slow. Here the grid
//! stays resident and the two products meet at one grid-wide barrier (the post-attention
//! kernel's, [`super::post_attention`], whose last stages this kernel runs: the same device
//! code), a layer one operation shorter.
//!
//! Both stages round as the gated and closing products round, with the same summation order,
//! so the result equals theirs bit for bit (`bench --compare-fused` checks the tokens), over
//! dense or 4-bit affine weights alike.

use std::cell::RefCell;

use anyhow::{anyhow, bail, Result};
use mlx_rs::{Array, Dtype};

use super::affine4::HEADER as AFFINE4_HEADER;
use super::post_attention::{grid_blocks, Weight, BARRIER_HEADER};
use super::products::{element_bytes, HEADER as PRODUCTS_HEADER, THREADS};
use super::{PerEpsilon, TemplateArg};

const SOURCE: &str = r#"
  constexpr int STAGED = H > P ? H : P;
  __shared__ __align__(16) T hs[H];
  __shared__ __align__(16) T buf[P];
  __shared__ float red[32];
  // Chunk sums of the staged input for 4-bit weights (chunk_sums).
  __shared__ float sums[BITS != 0 ? STAGED / 32 : 1];
  unsigned int* bar = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(barrier));
  stage_input<T, H, false>(h, h, hs, red);
  chunk_sums<T, H, BITS>(hs, sums);
  // The post-attention kernel's last stages, as the products round them.
  // (No rows loaded early: this kernel starts at the block.)
  per_layer_block<T, H, P, BITS, G, false, false>(
      hs, buf, sums, red, pg, pg_s, pg_b, per_layer, ple_offset[0], pp, pp_s, pp_b, post_norm,
      static_cast<float>(scale[0]), bar, g, o2, out, false, buf, buf);
"#;

/// The staged vectors must fit a block's static shared memory, twice per multiprocessor
/// (the grid is two resident blocks a multiprocessor), with room to spare.
const MAX_SHARED_BYTES: usize = 44 * 1024;

thread_local! {
    static KERNELS: RefCell<PerEpsilon> = RefCell::new(PerEpsilon::new(
        "per_layer_input",
        &[
            "h", "pg", "per_layer", "ple_offset", "pp", "post_norm", "scale", "barrier", "pg_s",
            "pg_b", "pp_s", "pp_b",
        ],
        &["out", "g", "o2"],
        SOURCE,
    ).with_header(Box::leak(
        format!("{PRODUCTS_HEADER}{AFFINE4_HEADER}{BARRIER_HEADER}").into_boxed_str()
    )));
}

/// Whether the kernel serves hidden size `h` and per-layer width `p` in `dtype`: whole
/// 16-byte loads, and the staged vectors (h and g) and the chunk sums fit shared memory.
pub fn serves(h: usize, p: usize, dtype: Dtype) -> bool {
    let Some(e) = element_bytes(dtype) else {
        return false;
    };
    let sums = h.max(p) / 32 * 4;
    h > 0
        && p > 0
        && (h * e) % 16 == 0
        && (p * e) % 16 == 0
        && (h + p) * e + sums <= MAX_SHARED_BYTES
}

/// `(h + rms_norm(W_proj (gelu_tanh(W_in h) * v), post_norm)) * scale` for one token `h`
/// (`[1, H]`): `gate` `[P, H]` and `projection` `[H, P]` (both dense, or both 4-bit affine in
/// one group size), `v` the `P` values of `values` from `offset` (int32 in device memory),
/// `scale` a device array whose first element is the layer scalar, `barrier` from
/// [`super::post_attention::new_barrier`], one per call site. Check [`serves`] and
/// [`grid_blocks`].
#[allow(clippy::too_many_arguments)]
pub fn per_layer_input(
    h: &Array,
    eps: f32,
    gate: Weight,
    values: &Array,
    offset: &Array,
    projection: Weight,
    post_norm: &Array,
    scale: &Array,
    barrier: &Array,
) -> Result<Array> {
    let dtype = h.dtype();
    let width = h.shape()[h.ndim() - 1];
    if h.shape() != [1, width] {
        bail!(
            "per_layer_input: the hidden state is {:?}, expected one token [1, {width}]",
            h.shape()
        );
    }
    let p = gate.rows();
    let layout = |w: &Weight, rows: i32, k: i32, what: &str| -> Result<(i32, i32)> {
        w.layout(rows, k, dtype, what)
            .map_err(|e| anyhow!("per_layer_input: {e}"))
    };
    let (bits, group) = layout(&gate, p, width, "the per-layer input gate")?;
    if layout(&projection, width, p, "the per-layer projection")? != (bits, group) {
        bail!("per_layer_input: the gate and the projection differ in layout (dense, or 4-bit in groups)");
    }
    if offset.dtype() != Dtype::Int32 {
        bail!("per_layer_input: the per-layer input offset must be int32");
    }
    if post_norm.shape() != [width] || post_norm.dtype() != dtype {
        bail!(
            "per_layer_input: the norm weight is {:?} {:?}, expected [{width}] {dtype:?}",
            post_norm.shape(),
            post_norm.dtype()
        );
    }
    if !serves(width as usize, p as usize, dtype) {
        bail!("per_layer_input does not serve hidden {width}, per-layer {p} in {dtype:?}");
    }
    let Some(blocks) = grid_blocks() else {
        bail!("per_layer_input needs the CUDA device's multiprocessor count");
    };
    let [pg, pg_s, pg_b] = gate.inputs();
    let [pp, pp_s, pp_b] = projection.inputs();
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        let mut out = kernel.apply(
            &[
                h, pg, values, offset, pp, post_norm, scale, barrier, pg_s, pg_b, pp_s, pp_b,
            ],
            &[
                (&[1, width], dtype),
                (&[p], dtype),
                (&[width], Dtype::Float32),
            ],
            (blocks * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"H", TemplateArg::Int(width)),
                (c"P", TemplateArg::Int(p)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
            ],
        )?;
        Ok(out.remove(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_whole_loads_that_fit_shared_memory() {
        assert!(serves(2560, 256, Dtype::Bfloat16), "E4B");
        assert!(serves(64, 32, Dtype::Float32), "a fixture");
        assert!(!serves(2560, 0, Dtype::Bfloat16), "no per-layer input");
        assert!(!serves(2562, 256, Dtype::Bfloat16), "a partial load");
        assert!(!serves(16384, 256, Dtype::Float32), "64 KB staged");
        assert!(!serves(2560, 256, Dtype::Int32));
    }

    #[test]
    fn mismatched_inputs_are_refused_before_any_kernel() {
        let h = Array::zeros::<f32>(&[1, 64]).unwrap();
        let gate = Array::zeros::<f32>(&[32, 64]).unwrap();
        let projection = Array::zeros::<f32>(&[64, 32]).unwrap();
        let values = Array::zeros::<f32>(&[1, 4, 32]).unwrap();
        let offset = Array::from_slice(&[0i32], &[1]);
        let norm = Array::zeros::<f32>(&[64]).unwrap();
        let barrier = Array::from_slice(&[0u32, 0, 0, 0], &[4]);
        let call = |h: &Array, proj: &Array, offset: &Array, norm: &Array| {
            per_layer_input(
                h,
                1e-6,
                Weight::Dense(&gate),
                &values,
                offset,
                Weight::Dense(proj),
                norm,
                &norm.clone(),
                &barrier,
            )
            .unwrap_err()
            .to_string()
        };
        let two = Array::zeros::<f32>(&[2, 64]).unwrap();
        assert!(call(&two, &projection, &offset, &norm).contains("one token"));
        let wrong = Array::zeros::<f32>(&[64, 16]).unwrap();
        assert!(call(&h, &wrong, &offset, &norm).contains("per-layer projection"));
        let float_offset = Array::from_slice(&[0f32], &[1]);
        assert!(call(&h, &projection, &float_offset, &norm).contains("int32"));
        let short = Array::zeros::<f32>(&[8]).unwrap();
        assert!(call(&h, &projection, &offset, &short).contains("norm weight"));
    }
}
