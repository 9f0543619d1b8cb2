//! Everything of a decode token's layer after attention, as one kernel (`--fused-kernels
//! ...,post-attention`), from the layer's input `x` and the attention heads' output `z`:
//!
//! 0. `x1 = x + rms_norm(W_o z, post_attention_norm)`;
//! 1. `a = gelu_tanh(W_gate x') * (W_up x')`, `x' = rms_norm(x1, pre_norm)`;
//! 2. `o = W_down a`;
//! 3. `h = x1 + rms_norm(o, post_norm)` (times the layer scalar when there is no per-layer
//!    input: then `h` is the output);
//! 4. with a per-layer input `v`: `g = gelu_tanh(W_in h) * v`;
//! 5. `o2 = W_proj g`;
//! 6. output `(h + rms_norm(o2, post_norm_2)) * layer_scalar`.
//!
//! Why: these are five launches with [`super::products`] (the attention's closing product,
//! then a gated and a closing product per block), each paying the host's cost of an
//! operation, a ramp-up and a drain on the device, and a last-block epilogue. Here the grid
//! stays resident from the first stage to the last, and the stages meet at grid-wide
//! barriers; a layer is three operations (with [`super::attention_heads`] and
//! [`super::decode_attention`]).
//!
//! A grid-wide barrier needs every block resident at once: the grid is two blocks per
//! streaming multiprocessor (the kernel's registers and shared memory allow at least that
//! many), and a block of another kernel that holds a multiprocessor finishes without waiting
//! for this one. A barrier that waits about a second aborts the kernel (a CUDA error, not a
//! hang).
//!
//! Every stage rounds as the kernels of [`super::products`] round, with the same summation
//! order, so the result equals theirs bit for bit (`bench --compare-fused` checks the tokens).
//! Each block computes the norm of a whole product itself (a few kilobytes from L2) and keeps
//! the hidden states it needs in shared memory, which saves a barrier per norm.
//!
//! Over 4-bit affine weights (`affine4`, MLX's layout: eight values a 32-bit word, a scale and
//! a bias per group) each lane reads 16 bytes (32 values) of a row at a time and sums
//! `scale (q . x) + bias (sum of x)` in float32. The values are unpacked without
//! integer-to-float conversions, the input is read from shared memory in turned 16-byte
//! pieces (no bank conflicts), and each stage's chunk sums of the input are computed once.
//!
//! Where it pays, measured on the H200 (BENCHMARKS.md): its device time equals that of the
//! five product kernels it replaces, so what it buys is host time, and the host is what
//! bounds a step on many machines: there it keeps its rate (213-226 tok/s on E4B) where the
//! five kernels fall to 150-180. On the fastest hosts the five kernels were ahead by 3-12 %.
//! It is the default for dense (`post-attention`) and 4-bit weights (`affine4`).
//!
//! It takes two rows a warp in the single-product stages (the kernel's `PAIRS`: about 1 %
//! faster in three leases), and, over dense weights, copies each block's rows of the
//! per-layer-input block into shared memory while the grid meets at the barrier that ends
//! the down product (`EARLY`: 1.4 µs a layer faster on the H200). Other ways lost on the H200
//! in several leases and were removed (BENCHMARKS.md): one row a warp, the per-layer rows
//! loaded after that barrier, 4-bit values unpacked where they lie in the word (`IN_PLACE`),
//! barriers polling with acquire loads, the next stage's weights prefetched into L2, 16 loads
//! in flight a lane, three blocks a multiprocessor.

use std::cell::RefCell;

use anyhow::{anyhow, bail, Result};
use mlx_rs::{Array, Dtype};

use super::affine4::HEADER as AFFINE4_HEADER;
use super::products::{device_array, element_bytes, HEADER as PRODUCTS_HEADER, THREADS};
use super::{PerEpsilon, TemplateArg};

/// Device helpers added to the products' ones.
pub(crate) const BARRIER_HEADER: &str = include_str!("cuda/post_attention_barrier.cuh");

const SOURCE: &str = include_str!("cuda/post_attention.cu");

/// Blocks per streaming multiprocessor, by default. The kernel's shared memory (at most
/// [`MAX_SHARED_BYTES`]) and registers (NVRTC for sm_90a: under 90 a thread for E4B's and
/// 12B's shapes; 128 would still fit two blocks of 256 threads) let at least this many be
/// resident.
pub(crate) const BLOCKS_PER_MULTIPROCESSOR: i32 = 2;

/// Warps of a block (the kernel's `WARPS`).
const WARPS_PER_BLOCK: usize = 8;

/// The staged vectors must fit a block's static shared memory (48 KB), twice per
/// multiprocessor with room to spare.
const MAX_SHARED_BYTES: usize = 44 * 1024;

/// The kernel's inputs, which [`super::window_post_attention`] takes too.
pub(crate) const INPUTS: &[&str] = &[
    "x",
    "z",
    "wo",
    "post_attention_norm",
    "pre_norm",
    "wg",
    "wu",
    "wd",
    "post_norm",
    "pg",
    "per_layer",
    "ple_offset",
    "pp",
    "post_norm_2",
    "scale",
    "barrier",
    "wo_s",
    "wo_b",
    "wg_s",
    "wg_b",
    "wu_s",
    "wu_b",
    "wd_s",
    "wd_b",
    "pg_s",
    "pg_b",
    "pp_s",
    "pp_b",
];

/// The kernel's header: the product helpers, the 4-bit dots and the grid-wide barrier.
pub(crate) fn header() -> &'static str {
    static HEADER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HEADER.get_or_init(|| format!("{PRODUCTS_HEADER}{AFFINE4_HEADER}{BARRIER_HEADER}"))
}

thread_local! {
    static KERNELS: RefCell<PerEpsilon> = RefCell::new(
        PerEpsilon::new("post_attention", INPUTS, &["out", "o0", "a", "o", "g", "o2"], SOURCE)
            .with_header(header()),
    );
}

/// A weight matrix `[rows, K]` as the kernel reads it.
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    /// In the activation dtype.
    Dense(&'a Array),
    /// 4-bit affine in MLX's layout: `packed` `[rows, K / 8]` uint32 (lowest bits first),
    /// `scales` and `biases` `[rows, K / group]` in the activation dtype; `w = scale q + bias`.
    Affine4 {
        packed: &'a Array,
        scales: &'a Array,
        biases: &'a Array,
    },
}

impl<'a> Weight<'a> {
    pub fn is_dense(&self) -> bool {
        matches!(self, Weight::Dense(_))
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> i32 {
        match self {
            Weight::Dense(w) => w.shape()[0],
            Weight::Affine4 { packed, .. } => packed.shape()[0],
        }
    }

    /// Values per scale of a 4-bit weight of input width `k` (0 for a dense one).
    pub fn group(&self, k: i32) -> i32 {
        match self {
            Weight::Dense(_) => 0,
            Weight::Affine4 { scales, .. } => {
                let groups = scales.shape().get(1).copied().unwrap_or(0);
                if groups > 0 && k % groups == 0 {
                    k / groups
                } else {
                    0
                }
            }
        }
    }

    /// Checks the matrix is `[rows, k]` of `dtype` (the scales and biases too when 4-bit,
    /// in groups of a multiple of 32 values); returns the kernel's (BITS, G).
    pub(crate) fn layout(&self, rows: i32, k: i32, dtype: Dtype, what: &str) -> Result<(i32, i32)> {
        match self {
            Weight::Dense(w) => {
                if w.shape() != [rows, k] || w.dtype() != dtype {
                    bail!(
                        "{what} is {:?} {:?}, expected [{rows}, {k}] {dtype:?}",
                        w.shape(),
                        w.dtype()
                    );
                }
                Ok((0, 0))
            }
            Weight::Affine4 {
                packed,
                scales,
                biases,
            } => {
                let group = self.group(k);
                if k % 8 != 0
                    || packed.shape() != [rows, k / 8]
                    || packed.dtype() != Dtype::Uint32
                    || group == 0
                    || group % 32 != 0
                    || scales.shape() != [rows, k / group.max(1)]
                    || biases.shape() != scales.shape()
                    || scales.dtype() != dtype
                    || biases.dtype() != dtype
                {
                    bail!(
                        "{what} is not a 4-bit affine [{rows}, {k}] weight with {dtype:?} scales in groups of a multiple of 32: packed {:?} {:?}, scales {:?} {:?}, biases {:?} {:?}",
                        packed.shape(),
                        packed.dtype(),
                        scales.shape(),
                        scales.dtype(),
                        biases.shape(),
                        biases.dtype()
                    );
                }
                Ok((4, group))
            }
        }
    }

    /// The kernel's three inputs for this matrix: values, scales, biases. A dense matrix has
    /// none of the last two, which the kernel then never reads: a one-element [`unread_input`]
    /// stands in for them. (It stood in for them itself until 2026-12-01: MLX counts every
    /// input's bytes towards the 1 000 MB after which it commits a CUDA graph on an H200,
    /// so a dense step counted its weights three times and committed three times as often.)
    pub(crate) fn inputs(&self) -> [&'a Array; 3] {
        match *self {
            Weight::Dense(w) => {
                let unread = unread_input(w.dtype());
                [w, unread, unread]
            }
            Weight::Affine4 {
                packed,
                scales,
                biases,
            } => [packed, scales, biases],
        }
    }
}

thread_local! {
    // One per thread and dtype, alive for the process: kernels take them on every call.
    static UNREAD_INPUTS: RefCell<Vec<&'static Array>> = const { RefCell::new(Vec::new()) };
}

/// A one-element array of `dtype` for kernel inputs the kernel does not read (a dense
/// weight's scales and biases, a KV-sharing layer's key and value weights and buffers), so
/// that MLX counts a few bytes for them towards its per-graph input budget, not a weight's
/// size. Of the dtype the input's parameter has: MLX writes each parameter's type from its
/// array's dtype (an int32 stand-in for bf16 scales does not compile). Not `Send` (`&Array`),
/// so it stays on the thread that made it, as MLX arrays of a stream do.
pub(crate) fn unread_input(dtype: Dtype) -> &'static Array {
    UNREAD_INPUTS.with(|cell| {
        let mut made = cell.borrow_mut();
        if let Some(a) = made.iter().find(|a| a.dtype() == dtype) {
            return *a;
        }
        let zero = Array::from_slice(&[0i32], &[1]);
        let a = zero.as_dtype(dtype).unwrap_or(zero);
        // Evaluated here, once, so that no step carries its conversion.
        let _ = a.eval();
        let a: &'static Array = Box::leak(Box::new(a));
        made.push(a);
        a
    })
}

/// The weights of a layer after its attention heads, all dense or all 4-bit affine with one
/// group size: `[H, Z]` attention output, `[N, H]` gate and up, `[H, N]` down, and the norms
/// around them.
pub struct PostAttention<'a> {
    pub output: Weight<'a>,
    pub post_attention_norm: &'a Array,
    pub pre_norm: &'a Array,
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
    pub post_norm: &'a Array,
}

/// The per-layer-input block's weights and this layer's inputs.
pub struct PerLayerInput<'a> {
    /// `[P, H]`, the per-layer input gate.
    pub gate: Weight<'a>,
    /// The per-layer inputs of every layer, contiguous; this layer's `P` start at `offset`.
    pub values: &'a Array,
    /// int32 in device memory ([`super::products::device_array`]): where this layer's
    /// inputs start.
    pub offset: &'a Array,
    /// `[H, P]`, the projection back to the hidden size.
    pub projection: Weight<'a>,
    pub post_norm: &'a Array,
}

/// Whether the kernel serves hidden size `h`, attention width `z`, feed-forward width `n`
/// and per-layer width `p` (0: none) in `dtype`: whole 16-byte loads, and the vectors each
/// block keeps fit its shared memory.
pub fn serves(h: usize, z: usize, n: usize, p: usize, dtype: Dtype) -> bool {
    let Some(e) = element_bytes(dtype) else {
        return false;
    };
    let whole = |k: usize| (k * e) % 16 == 0;
    let staged = h.max(z).max(n).max(p);
    // With its per-layer rows loaded early, each warp's two projection rows too.
    let early = if p > 0 { 2 * WARPS_PER_BLOCK * p } else { 0 };
    let kept = staged + h + if p > 0 { h } else { 0 } + early;
    // The chunk sums of 4-bit weights: a float per 32 staged values.
    let sums = staged / 32 * 4;
    h > 0
        && z > 0
        && n > 0
        && [h, z, n, p].into_iter().all(whole)
        && kept * e + sums <= MAX_SHARED_BYTES
}

/// The barrier state a call site owns (the arrival count and the generation, in device
/// memory: [`device_array`] pads it past the 8 bytes MLX would keep in host-visible memory).
/// Calls of one site never overlap: each step's depends on the previous step's token.
pub fn new_barrier() -> Result<Array> {
    device_array(&Array::from_slice(&[0u32], &[1]), 16)
}

/// Blocks of the grid, or `None` where the device's multiprocessors are unknown, or shared
/// with other processes through MPS: then no grid-wide barrier is safe, and the layers run the
/// product kernels instead (this kernel and `affine4` give way).
pub fn grid_blocks() -> Option<i32> {
    if super::capturing() {
        // An H200's 132 multiprocessors.
        return Some(132 * BLOCKS_PER_MULTIPROCESSOR);
    }
    if crate::cuda::cuda_shared_through_mps() {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::info!(
                "the GPU is shared through MPS: the kernels with grid-wide barriers \
                 (post-attention, affine4) give way to the product kernels"
            )
        });
        return None;
    }
    crate::cuda::cuda_multiprocessor_count().map(|sms| sms * BLOCKS_PER_MULTIPROCESSOR)
}

/// The layer's output for the token `x` (`[1, H]`, the layer's input) and its attention
/// heads' output `z` (`[1, Z]`): the attention's output product and residual, the
/// feed-forward block, then the per-layer-input block when given, the result times `scale`
/// (the layer scalar, first element of a device array). Check [`serves`] and [`grid_blocks`].
/// The one layout `(BITS, G)` of a layer's weights after its attention heads (attention width
/// `zw`, hidden size `h`), all dense or all 4-bit in one group size, and the per-layer width
/// (0 without a per-layer input); else an error naming `kernel` and the weight.
pub(crate) fn layer_layout(
    kernel: &str,
    w: &PostAttention,
    ple: Option<&PerLayerInput>,
    h: i32,
    zw: i32,
    dtype: Dtype,
) -> Result<(i32, i32, i32)> {
    let n = w.gate.rows();
    let layout = |w: &Weight, rows: i32, k: i32, what: &str| -> Result<(i32, i32)> {
        w.layout(rows, k, dtype, what)
            .map_err(|e| anyhow!("{kernel}: {e}"))
    };
    let mut layouts = vec![
        layout(&w.output, h, zw, "the attention output weight")?,
        layout(&w.gate, n, h, "the gate weight")?,
        layout(&w.up, n, h, "the up weight")?,
        layout(&w.down, h, n, "the down weight")?,
    ];
    let p = match ple {
        Some(v) => {
            let p = v.gate.rows();
            layouts.push(layout(&v.gate, p, h, "the per-layer input gate")?);
            layouts.push(layout(&v.projection, h, p, "the per-layer projection")?);
            if v.offset.dtype() != Dtype::Int32 {
                bail!("{kernel}: the per-layer input offset must be int32");
            }
            p
        }
        None => 0,
    };
    let (bits, group) = layouts[0];
    if layouts.iter().any(|l| *l != (bits, group)) {
        bail!("{kernel}: the weights mix layouts (dense, or 4-bit in groups): {layouts:?}");
    }
    Ok((bits, group, p))
}

pub fn post_attention(
    x: &Array,
    z: &Array,
    eps: f32,
    w: &PostAttention,
    ple: Option<&PerLayerInput>,
    scale: &Array,
    barrier: &Array,
) -> Result<Array> {
    let dtype = x.dtype();
    let h = x.shape()[x.ndim() - 1];
    let zw = z.shape()[z.ndim() - 1];
    let n = w.gate.rows();
    for (a, what) in [(x, "the hidden state"), (z, "the attention output")] {
        let width = a.shape()[a.ndim() - 1];
        if a.shape() != [1, width] || a.dtype() != dtype {
            bail!(
                "post_attention: {what} is {:?} {:?}, expected [1, {width}] {dtype:?}",
                a.shape(),
                a.dtype()
            );
        }
    }
    let (bits, group, p) = layer_layout("post_attention", w, ple, h, zw, dtype)?;
    if !serves(h as usize, zw as usize, n as usize, p as usize, dtype) {
        bail!(
            "post_attention does not serve hidden {h}, attention {zw}, width {n}, per-layer {p} in {dtype:?}"
        );
    }
    let Some(blocks) = grid_blocks() else {
        bail!("post_attention needs the CUDA device's multiprocessor count");
    };
    // Without a per-layer input its inputs are never read: the hidden state stands in.
    let stand_in = Weight::Dense(x);
    let (pg, values, offset, pp, post_norm_2) = match ple {
        Some(v) => (v.gate, v.values, v.offset, v.projection, v.post_norm),
        None => (stand_in, x, barrier, stand_in, x),
    };
    let [wo, wo_s, wo_b] = w.output.inputs();
    let [wg, wg_s, wg_b] = w.gate.inputs();
    let [wu, wu_s, wu_b] = w.up.inputs();
    let [wd, wd_s, wd_b] = w.down.inputs();
    let [pg, pg_s, pg_b] = pg.inputs();
    let [pp, pp_s, pp_b] = pp.inputs();
    let (row, hidden, width, per_layer_width) = ([1, h], [h], [n], [p.max(1)]);
    let outputs = [
        (&row[..], dtype),
        (&hidden[..], Dtype::Float32),
        (&width[..], dtype),
        (&hidden[..], Dtype::Float32),
        (&per_layer_width[..], dtype),
        (&hidden[..], Dtype::Float32),
    ];
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
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
                (c"IN_PLACE", TemplateArg::Bool(false)),
                (c"PAIRS", TemplateArg::Bool(true)),
                (c"EARLY", TemplateArg::Bool(true)),
            ],
        )?;
        Ok(out.swap_remove(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dense_weight_hands_its_kernel_4_bytes_for_the_scales_it_has_not() {
        let w = Array::zeros::<f32>(&[64, 32]).unwrap();
        let [values, scales, biases] = Weight::Dense(&w).inputs();
        assert_eq!(values.nbytes(), 64 * 32 * 4);
        assert_eq!((scales.nbytes(), biases.nbytes()), (4, 4));
        // Of the weight's dtype: MLX types each kernel parameter by its array.
        assert_eq!(
            (scales.dtype(), biases.dtype()),
            (Dtype::Float32, Dtype::Float32)
        );
        let b = Array::zeros::<f32>(&[8, 8])
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let [_, b_scales, _] = Weight::Dense(&b).inputs();
        assert_eq!((b_scales.dtype(), b_scales.nbytes()), (Dtype::Bfloat16, 2));
        // A 4-bit weight hands on its own three arrays.
        let packed = Array::zeros::<u32>(&[64, 4]).unwrap();
        let group_scales = Array::zeros::<f32>(&[64, 1]).unwrap();
        let q = Weight::Affine4 {
            packed: &packed,
            scales: &group_scales,
            biases: &group_scales,
        };
        let [p, s, _] = q.inputs();
        assert_eq!((p.nbytes(), s.nbytes()), (64 * 4 * 4, 64 * 4));
    }

    #[test]
    fn serves_whole_loads_that_fit_shared_memory() {
        assert!(
            serves(2560, 2048, 10240, 256, Dtype::Bfloat16),
            "E4B sliding"
        );
        assert!(serves(2560, 4096, 10240, 256, Dtype::Bfloat16), "E4B full");
        assert!(serves(3840, 4096, 15360, 0, Dtype::Bfloat16), "12B");
        assert!(serves(64, 64, 256, 32, Dtype::Float32), "a fixture");
        assert!(
            !serves(2560, 2048, 10240, 256, Dtype::Float32),
            "60 KB kept"
        );
        assert!(
            !serves(2560, 2048, 10244, 256, Dtype::Bfloat16),
            "a partial load"
        );
        assert!(
            !serves(2560, 2048, 10240, 4, Dtype::Bfloat16),
            "a partial per-layer load"
        );
        assert!(!serves(2560, 2048, 10240, 256, Dtype::Int32));
    }

    #[test]
    fn a_barrier_starts_at_zero_in_device_memory_sized() {
        // The arrival count and the generation at 0, padded to more than 8 bytes.
        assert_eq!(new_barrier().unwrap().as_slice::<u32>(), &[0; 16]);
    }

    #[test]
    fn mismatched_weights_are_refused_before_any_kernel() {
        let x = Array::zeros::<f32>(&[1, 8]).unwrap();
        let norm = Array::zeros::<f32>(&[8]).unwrap();
        let square = Array::zeros::<f32>(&[8, 8]).unwrap();
        let wide = Array::zeros::<f32>(&[16, 8]).unwrap();
        let w = PostAttention {
            output: Weight::Dense(&square),
            post_attention_norm: &norm,
            pre_norm: &norm,
            gate: Weight::Dense(&wide),
            up: Weight::Dense(&wide),
            down: Weight::Dense(&square),
            post_norm: &norm,
        };
        let barrier = new_barrier().unwrap();
        let err = post_attention(&x, &x, 1e-6, &w, None, &x, &barrier).unwrap_err();
        assert!(err.to_string().contains("down weight"), "{err}");
    }

    #[test]
    fn a_4bit_weight_is_read_as_packed_words_with_a_scale_and_bias_per_group() {
        // [16, 128] in groups of 64: 16 words of eight values a row, two scales a row.
        let packed = Array::zeros::<u32>(&[16, 16]).unwrap();
        let scales = Array::zeros::<f32>(&[16, 2]).unwrap();
        let weight = Weight::Affine4 {
            packed: &packed,
            scales: &scales,
            biases: &scales,
        };
        assert_eq!(weight.rows(), 16);
        assert_eq!(weight.group(128), 64);
        assert_eq!(
            weight.layout(16, 128, Dtype::Float32, "w").unwrap(),
            (4, 64)
        );
        // The wrong input width, scales of another dtype, groups not a multiple of 32.
        assert!(weight.layout(16, 96, Dtype::Float32, "w").is_err());
        assert!(weight.layout(16, 128, Dtype::Bfloat16, "w").is_err());
        let narrow = Array::zeros::<u32>(&[16, 4]).unwrap();
        let fine = Array::zeros::<f32>(&[16, 2]).unwrap();
        let small_groups = Weight::Affine4 {
            packed: &narrow,
            scales: &fine,
            biases: &fine,
        };
        let err = small_groups
            .layout(16, 32, Dtype::Float32, "the gate weight")
            .unwrap_err();
        assert!(err.to_string().contains("the gate weight"), "{err}");
        // A dense weight has no groups and reads as itself.
        let dense = Array::zeros::<f32>(&[16, 128]).unwrap();
        assert_eq!(Weight::Dense(&dense).group(128), 0);
        assert_eq!(
            Weight::Dense(&dense)
                .layout(16, 128, Dtype::Float32, "w")
                .unwrap(),
            (0, 0)
        );
    }

    #[test]
    fn dense_and_4bit_weights_are_not_mixed_in_one_call() {
        let x = Array::zeros::<f32>(&[1, 64]).unwrap();
        let norm = Array::zeros::<f32>(&[64]).unwrap();
        let dense = Array::zeros::<f32>(&[64, 64]).unwrap();
        let packed = Array::zeros::<u32>(&[64, 8]).unwrap();
        let scales = Array::zeros::<f32>(&[64, 2]).unwrap();
        let quantized = Weight::Affine4 {
            packed: &packed,
            scales: &scales,
            biases: &scales,
        };
        let w = PostAttention {
            output: Weight::Dense(&dense),
            post_attention_norm: &norm,
            pre_norm: &norm,
            gate: quantized,
            up: quantized,
            down: quantized,
            post_norm: &norm,
        };
        let barrier = new_barrier().unwrap();
        let err = post_attention(&x, &x, 1e-6, &w, None, &x, &barrier).unwrap_err();
        assert!(err.to_string().contains("mix layouts"), "{err}");
    }
}
