//! Everything of a layer after its attention heads for a window of 2 to 8 tokens (a verify
//! window, or a short prompt) as one kernel (`--fused-kernels ...,window`), over dense
//! weights: the stages of [`super::post_attention`] with each weight row read once for all
//! the window's tokens.
//!
//! Why: a window of k tokens ran MLX's operations, about 25 a layer after the heads (cuBLAS
//! products at ~13 µs of host time each, norms, adds, the GELU), and on an H200 a window of
//! four cost as much as four decode steps, bound by that host work (BENCHMARKS.md, "why a
//! verify window costs four decode steps"). One kernel a layer leaves the weights' bytes,
//! read once, as its cost.
//!
//! Each token's result equals what [`super::post_attention`] computes for that token alone,
//! bit for bit: the same stages with the same roundings, every row's dot summed over the same
//! pieces in the same order (`weight_dot_window`: `rows_dot_window` for dense rows, the 4-bit
//! window helpers of [`super::affine4`] over each token's own chunk sums for 4-bit ones),
//! every norm by the same threads in the same order. So, with the other window kernels
//! ([`super::window_attention_heads`], decode attention over a window,
//! [`super::window_output_head`]), a verify window scores each drafted token exactly as the
//! plain decode step would.
//!
//! The tokens' staged inputs live in dynamic shared memory (`TOKENS` vectors of the widest
//! stage, 20 KB each for E4B in bf16, with 1.25 KB of chunk sums over 4-bit weights), which
//! decides how many blocks fit a multiprocessor: two up to [`TWO_BLOCKS_SHARED_BYTES`] (dense
//! weights; over 4-bit ones the registers allow one), one up to [`ONE_BLOCK_SHARED_BYTES`];
//! longer windows run in parts (`Gemma4Model::forward_in_windows`). The hidden state after
//! the attention block (`x1`) is kept in a device output, each block writing its share,
//! instead of in every block's shared memory as the single-token kernel keeps it.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::affine4::{HEADER as AFFINE4_HEADER, WINDOW_HEADER as AFFINE4_WINDOW_HEADER};
use super::post_attention::{header, PerLayerInput, PostAttention};
use super::products::{element_bytes, HEADER as PRODUCTS_HEADER, THREADS};
use super::{PerSharedMemory, TemplateArg};

/// `rows_dot_window`, the row dots of every window kernel (after the products' header).
pub const ROWS_DOT_WINDOW: &str = include_str!("cuda/rows_dot_window.cuh");

/// Device helpers added to the post-attention kernel's ones, after [`ROWS_DOT_WINDOW`] and the
/// 4-bit window helpers ([`super::affine4::WINDOW_HEADER`]).
const WINDOW_HEADER: &str = include_str!("cuda/window_post_attention_window.cuh");

const SOURCE: &str = include_str!("cuda/window_post_attention.cu");

const OUTPUTS: &[&str] = &["out", "o0", "a", "o", "x1", "g", "o2"];

/// Tokens a call takes at most (and at least 2: one token is [`super::post_attention`]'s).
pub const MAX_TOKENS: usize = 8;

/// Dynamic shared memory a block may use with two blocks a multiprocessor (an H200 has
/// 228 KB a multiprocessor, 1 KB of it reserved per block).
const TWO_BLOCKS_SHARED_BYTES: usize = 108 * 1024;

/// Dynamic shared memory a block may use alone on a multiprocessor.
const ONE_BLOCK_SHARED_BYTES: usize = 216 * 1024;

/// Bytes of dynamic shared memory a call over `tokens` tokens needs: each token's input to
/// the widest stage, and over 4-bit weights (`bits` 4) its chunk sums, a float per 32 values.
fn shared_bytes(
    h: usize,
    z: usize,
    n: usize,
    p: usize,
    tokens: usize,
    element: usize,
    bits: i32,
) -> usize {
    let staged = h.max(z).max(n).max(p);
    let sums = if bits == 0 { 0 } else { staged / 32 * 4 };
    tokens * (staged * element + sums)
}

/// Blocks a multiprocessor holds for a call needing `shared` bytes over weights of `bits`
/// (0 dense, 4), `None` if none fits. Over 4-bit weights one: each (row, token) sum of the
/// window holds a batch of packed chunks with their scales and biases, and NVRTC for sm_90a
/// gives the kernel 138-168 registers a thread for E4B's shapes (`compile_check.sh`), more
/// than two blocks of 256 threads may hold (128); a grid-wide barrier needs every block
/// resident.
fn blocks_per_multiprocessor(shared: usize, bits: i32) -> Option<i32> {
    if shared <= TWO_BLOCKS_SHARED_BYTES && bits == 0 {
        Some(2)
    } else if shared <= ONE_BLOCK_SHARED_BYTES {
        Some(1)
    } else {
        None
    }
}

/// Whether the kernel serves `tokens` tokens of hidden size `h`, attention width `z`,
/// feed-forward width `n` and per-layer width `p` (0: none) in `dtype`, over dense weights
/// (`bits` 0) or 4-bit ones (4): 2 to [`MAX_TOKENS`] tokens, whole 16-byte loads (4-bit rows:
/// whole 32-value chunks), and the staged inputs fit a block's shared memory.
pub fn serves(
    h: usize,
    z: usize,
    n: usize,
    p: usize,
    tokens: usize,
    dtype: Dtype,
    bits: i32,
) -> bool {
    let Some(e) = element_bytes(dtype) else {
        return false;
    };
    let whole = |k: usize| (k * e) % 16 == 0 && (bits == 0 || k % 32 == 0);
    (2..=MAX_TOKENS).contains(&tokens)
        && (bits == 0 || bits == 4)
        && h > 0
        && z > 0
        && n > 0
        && [h, z, n, p].into_iter().all(whole)
        && blocks_per_multiprocessor(shared_bytes(h, z, n, p, tokens, e, bits), bits).is_some()
}

thread_local! {
    static KERNELS: RefCell<PerSharedMemory> = RefCell::new(PerSharedMemory::new(
        "window_post_attention",
        super::post_attention::INPUTS,
        OUTPUTS,
        SOURCE,
        Box::leak(
            format!(
                "{}{ROWS_DOT_WINDOW}{AFFINE4_WINDOW_HEADER}{WINDOW_HEADER}",
                header()
            )
            .into_boxed_str()
        ),
    ));
}

/// The layer's output for the window's tokens `x` (`[T, H]`, the layer's input) and their
/// attention heads' output `z` (`[T, Z]`), with dense weights or 4-bit ones of one group size
/// (values unpacked as floats):
/// the attention's output product and residual, the feed-forward block, then the
/// per-layer-input block when given (`values` `[T, layers, P]`), the result times `scale`
/// (the layer scalar, first element of a device array). Each token's row equals
/// [`super::post_attention`]'s for that token. `barrier` is the call site's
/// ([`super::post_attention::new_barrier`]). Check [`serves`].
pub fn window_post_attention(
    x: &Array,
    z: &Array,
    eps: f32,
    w: &PostAttention,
    ple: Option<&PerLayerInput>,
    scale: &Array,
    barrier: &Array,
) -> Result<Array> {
    let dtype = x.dtype();
    let tokens = x.shape()[0];
    let h = x.shape()[x.ndim() - 1];
    let zw = z.shape()[z.ndim() - 1];
    let n = w.gate.rows();
    for (a, what) in [(x, "the hidden states"), (z, "the attention outputs")] {
        let width = a.shape()[a.ndim() - 1];
        if a.shape() != [tokens, width] || a.dtype() != dtype {
            bail!(
                "window_post_attention: {what} are {:?} {:?}, expected [{tokens}, {width}] {dtype:?}",
                a.shape(),
                a.dtype()
            );
        }
    }
    let (bits, group, p) =
        super::post_attention::layer_layout("window_post_attention", w, ple, h, zw, dtype)?;
    if let Some(v) = ple {
        if v.values.dtype() != dtype || v.values.size() % (tokens.max(1) as usize) != 0 {
            bail!(
                "window_post_attention: the per-layer inputs are {:?} {:?}, expected [{tokens}, layers, {p}] {dtype:?}",
                v.values.shape(),
                v.values.dtype()
            );
        }
    }
    let (tk, hu, zu, nu, pu) = (
        tokens as usize,
        h as usize,
        zw as usize,
        n as usize,
        p as usize,
    );
    if !serves(hu, zu, nu, pu, tk, dtype, bits) {
        bail!(
            "window_post_attention does not serve {tokens} tokens of hidden {h}, attention {zw}, width {n}, per-layer {p} in {dtype:?} ({bits}-bit weights)"
        );
    }
    let element = element_bytes(dtype).unwrap_or(2);
    let shared = shared_bytes(hu, zu, nu, pu, tk, element, bits);
    let per_multiprocessor = blocks_per_multiprocessor(shared, bits).unwrap_or(1);
    let Some(multiprocessors) = super::post_attention::grid_blocks()
        .map(|blocks| blocks / super::post_attention::BLOCKS_PER_MULTIPROCESSOR)
    else {
        bail!("window_post_attention needs the CUDA device's multiprocessor count");
    };
    let blocks = multiprocessors * per_multiprocessor;
    // Without a per-layer input its inputs are never read: one-element stand-ins (the kernel
    // takes a weight's values as untyped rows, its scales and biases as the dtype's).
    let unread = super::post_attention::unread_input(dtype);
    let (pg, values, offset, pp, post_norm_2, vstride) = match ple {
        Some(v) => {
            let vstride = (v.values.size() / tk) as i32;
            (
                v.gate.inputs(),
                v.values,
                v.offset,
                v.projection.inputs(),
                v.post_norm,
                vstride,
            )
        }
        None => ([unread; 3], unread, barrier, [unread; 3], unread, 0),
    };
    let [wo, wo_s, wo_b] = w.output.inputs();
    let [wg, wg_s, wg_b] = w.gate.inputs();
    let [wu, wu_s, wu_b] = w.up.inputs();
    let [wd, wd_s, wd_b] = w.down.inputs();
    let [pg, pg_s, pg_b] = pg;
    let [pp, pp_s, pp_b] = pp;
    let (rows, width, per_layer_width) = ([tokens, h], [tokens, n], [tokens, p.max(1)]);
    let outputs = [
        (&rows[..], dtype),
        (&rows[..], Dtype::Float32),
        (&width[..], dtype),
        (&rows[..], Dtype::Float32),
        (&rows[..], dtype),
        (&per_layer_width[..], dtype),
        (&rows[..], Dtype::Float32),
    ];
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(shared, eps)?;
        let mut out = kernel.apply(
            &[
                x,
                z,
                wo,
                w.post_attention_norm,
                w.pre_norm,
                wg,
                wu,
                wd,
                w.post_norm,
                pg,
                values,
                offset,
                pp,
                post_norm_2,
                scale,
                barrier,
                wo_s,
                wo_b,
                wg_s,
                wg_b,
                wu_s,
                wu_b,
                wd_s,
                wd_b,
                pg_s,
                pg_b,
                pp_s,
                pp_b,
            ],
            &outputs,
            (blocks * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"H", TemplateArg::Int(h)),
                (c"Z", TemplateArg::Int(zw)),
                (c"N", TemplateArg::Int(n)),
                (c"P", TemplateArg::Int(p)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
                (c"TOKENS", TemplateArg::Int(tokens)),
                (c"VSTRIDE", TemplateArg::Int(vstride)),
            ],
        )?;
        Ok(out.swap_remove(0))
    })
}

/// The products' and 4-bit helpers, [`ROWS_DOT_WINDOW`] and the 4-bit window helpers, for the
/// window kernels without barriers.
pub(crate) fn rows_window_header(more: &str) -> &'static str {
    Box::leak(
        format!("{PRODUCTS_HEADER}{AFFINE4_HEADER}{ROWS_DOT_WINDOW}{AFFINE4_WINDOW_HEADER}{more}")
            .into_boxed_str(),
    )
}

#[cfg(test)]
mod tests {
    use super::super::post_attention::Weight;
    use super::*;

    #[test]
    fn windows_are_served_while_their_inputs_fit_shared_memory() {
        // E4B in bf16: 20 KB a token for the feed-forward width of 10 240.
        let e4b = |tokens| serves(2560, 2048, 10240, 256, tokens, Dtype::Bfloat16, 0);
        assert!(!e4b(1), "one token is the single-token kernel's");
        assert!(e4b(2) && e4b(5) && e4b(8));
        assert!(!e4b(9), "past MAX_TOKENS");
        assert_eq!(
            blocks_per_multiprocessor(shared_bytes(2560, 2048, 10240, 256, 5, 2, 0), 0),
            Some(2)
        );
        assert_eq!(
            blocks_per_multiprocessor(shared_bytes(2560, 2048, 10240, 256, 6, 2, 0), 0),
            Some(1)
        );
        // 12B (15 360 wide): seven tokens fit one block a multiprocessor, eight do not.
        assert!(serves(3840, 4096, 15360, 0, 7, Dtype::Bfloat16, 0));
        assert!(!serves(3840, 4096, 15360, 0, 8, Dtype::Bfloat16, 0));
        // Rows that are not whole 16-byte loads, and dtypes the kernel has no type for.
        assert!(!serves(2564, 2048, 10240, 256, 4, Dtype::Bfloat16, 0));
        assert!(!serves(2560, 2048, 10240, 256, 4, Dtype::Int32, 0));
        // The float32 fixtures: small widths, four bytes a value.
        assert!(serves(64, 128, 256, 16, 8, Dtype::Float32, 0));
        // 4-bit weights add each token's chunk sums (1.25 KB for E4B), and their registers
        // leave room for one block a multiprocessor, whatever the window.
        let e4b_q4 = |tokens| serves(2560, 2048, 10240, 256, tokens, Dtype::Bfloat16, 4);
        assert!(e4b_q4(2) && e4b_q4(8) && !e4b_q4(9));
        assert_eq!(
            shared_bytes(2560, 2048, 10240, 256, 5, 2, 4),
            5 * (10240 * 2 + 320 * 4)
        );
        assert_eq!(
            blocks_per_multiprocessor(shared_bytes(2560, 2048, 10240, 256, 2, 2, 4), 4),
            Some(1)
        );
        // 4-bit rows are read in whole chunks of 32 values; other bit widths are not served.
        assert!(!serves(2560, 2048, 10240, 272, 4, Dtype::Bfloat16, 4));
        assert!(serves(2560, 2048, 10240, 272, 4, Dtype::Bfloat16, 0));
        assert!(!serves(2560, 2048, 10240, 256, 4, Dtype::Bfloat16, 8));
    }

    #[test]
    fn mismatched_windows_and_packed_weights_are_refused_before_any_kernel() {
        let (h, z, n) = (64, 128, 256);
        let zeros = |shape: &[i32]| Array::zeros::<f32>(shape).unwrap();
        let (wo, wg, wu, wd) = (
            zeros(&[h, z]),
            zeros(&[n, h]),
            zeros(&[n, h]),
            zeros(&[h, n]),
        );
        let norm = zeros(&[h]);
        let weights = PostAttention {
            output: Weight::Dense(&wo),
            post_attention_norm: &norm,
            pre_norm: &norm,
            gate: Weight::Dense(&wg),
            up: Weight::Dense(&wu),
            down: Weight::Dense(&wd),
            post_norm: &norm,
        };
        let scale = zeros(&[1]);
        let barrier = Array::zeros::<u32>(&[4]).unwrap();
        // Three hidden states for two attention outputs.
        let err = window_post_attention(
            &zeros(&[3, h]),
            &zeros(&[2, z]),
            1e-6,
            &weights,
            None,
            &scale,
            &barrier,
        )
        .unwrap_err();
        assert!(err.to_string().contains("attention outputs"), "{err}");
        // A 4-bit down weight among dense ones.
        let packed = Array::zeros::<u32>(&[h, n / 8]).unwrap();
        let (scales, biases) = (zeros(&[h, n / 32]), zeros(&[h, n / 32]));
        let mixed = PostAttention {
            down: Weight::Affine4 {
                packed: &packed,
                scales: &scales,
                biases: &biases,
            },
            ..weights
        };
        let err = window_post_attention(
            &zeros(&[2, h]),
            &zeros(&[2, z]),
            1e-6,
            &mixed,
            None,
            &scale,
            &barrier,
        )
        .unwrap_err();
        assert!(err.to_string().contains("mix layouts"), "{err}");
    }
}
