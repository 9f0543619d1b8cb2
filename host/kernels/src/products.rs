//! Matrix-vector products of one decode token with what surrounds them in a Gemma 4 layer,
//! one kernel each:
//! * [`normed_products`]: RMSNorm of the input, then up to three products sharing it (the
//!   layer's input norm with q, k and v);
//! * [`gated_product`]: RMSNorm of the input (optional), then `gelu_tanh(W_g x) * u`, where
//!   `u` is a second product (the feed-forward's up) or a slice of a given vector (the
//!   per-layer input);
//! * [`product_residual`]: `h + rms_norm(W a)` (times the layer scalar at a layer's end), the
//!   product that closes an attention, feed-forward or per-layer-input block.
//!
//! Why: on CUDA, MLX's host time per operation, not the weights, bounds a decode step
//! (BENCHMARKS.md). With these and [`super::attention_heads`] a layer is about seven
//! operations instead of ~28. (`normed_products` serves layers whose attention heads go
//! through [`super::attention_inputs`]: the product kernels without the attention kernels.)
//!
//! A warp computes one output row (two, gate and up, in [`gated_product`]; over 4-bit weights
//! the feed-forward kernels take two consecutive rows per warp, streamed together): its
//! lanes stream the row in 16-byte loads and dot it with the input, staged once per block in
//! shared memory.
//! The staging recomputes the input's RMSNorm in every block, which costs a read of the input
//! from L2 and saves a launch. [`product_residual`] needs the norm of the whole product: the
//! last block to finish (counted by an atomic counter the caller owns, reset by that block)
//! reads every row and writes the residual.
//!
//! Roundings follow MLX's operations: the normed input to the activation dtype, then its
//! product with the norm weight; each product rounded to the dtype; the GELU in float32,
//! rounded before the gating product.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::{Array, Dtype};

use super::post_attention::Weight;
use super::{Fused, PerEpsilon, TemplateArg};

/// Device helpers of the three kernels (placed after the reduction helpers and `EPS`; public
/// for `tests/dense_rows_kernel_math.rs`, which runs `rows_dot` on the host).
pub const HEADER: &str = include_str!("cuda/products.cuh");

const NORMED_SOURCE: &str = include_str!("cuda/products_normed.cu");

const GATED_SOURCE: &str = include_str!("cuda/products_gated.cu");

const RESIDUAL_SOURCE: &str = include_str!("cuda/products_residual.cu");

/// Rows of a dense or 4-bit weight for the gated and closing products, after this module's
/// device helpers and [`super::affine4::HEADER`] (public for `tests/affine4_kernel_math.rs`, which runs it on the
/// host).
pub const WEIGHT_ROWS_HEADER: &str = include_str!("cuda/products_weight_rows.cuh");

/// Threads per block of these kernels; the device code's `BLOCK_THREADS` (in [`HEADER`]) says
/// the same.
pub(crate) const THREADS: i32 = 256;
pub(crate) const WARPS: i32 = THREADS / 32;
/// The staged input must fit a block's static shared memory (48 KB) beside the reduction
/// scratch and, over 4-bit rows, the chunk sums: 42 KB takes the 31B's 21 504-wide
/// feed-forward input in bf16 (with its 2.6 KB of chunk sums, 45.2 KB in all).
const MAX_STAGED_BYTES: usize = 42 * 1024;

thread_local! {
    static NO_OFFSET: Array = Array::from_slice(&[0i32], &[1]);
    static NORMED: RefCell<PerEpsilon> = RefCell::new(PerEpsilon::new(
        "normed_products",
        &["x", "nw", "w0", "w1", "w2"],
        &["y0", "y1", "y2"],
        NORMED_SOURCE,
    ).with_header(HEADER));
    static GATED: RefCell<PerEpsilon> = RefCell::new(PerEpsilon::new(
        "gated_product",
        &["x", "nw", "wg", "wu", "mul", "mul_offset", "wg_s", "wg_b", "wu_s", "wu_b"],
        &["y"],
        GATED_SOURCE,
    ).with_header(weight_rows_header()));
    static RESIDUAL: RefCell<PerEpsilon> = RefCell::new(PerEpsilon::new(
        "product_residual",
        &["a", "w", "h", "pw", "scale", "counter", "w_s", "w_b"],
        &["out", "o"],
        RESIDUAL_SOURCE,
    ).with_header(weight_rows_header()));
}

/// The header of the gated and closing products: the products' helpers, the 4-bit ones and
/// `weight_rows`, joined once for the process.
pub(crate) fn weight_rows_header() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| format!("{HEADER}{}{WEIGHT_ROWS_HEADER}", super::affine4::HEADER))
}

/// A weight's rows, or an error naming the kernel and the weight: a dense `[rows, k]` matrix
/// or a 4-bit affine one ([`Weight`]). Returns (rows, BITS, G).
fn weight_layout(w: &Weight, k: i32, dtype: Dtype, what: &str) -> Result<(i32, i32, i32)> {
    let rows = w.rows();
    let (bits, group) = w.layout(rows, k, dtype, what)?;
    Ok((rows, bits, group))
}

pub(crate) fn element_bytes(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::Float32 => Some(4),
        Dtype::Bfloat16 | Dtype::Float16 => Some(2),
        _ => None,
    }
}

/// Whether these kernels serve products with `k` inputs per row in `dtype`: rows split into
/// 16-byte loads, and the input fits a block's shared memory.
pub fn serves(k: usize, dtype: Dtype) -> bool {
    match element_bytes(dtype) {
        Some(e) => k > 0 && (k * e) % 16 == 0 && k * e <= MAX_STAGED_BYTES,
        None => false,
    }
}

/// `values` (a few elements) followed by zeros, `len` elements in all, made by an operation
/// on the default device and evaluated: on CUDA it then lives in device memory. MLX keeps
/// arrays made from host data, and any array of 8 bytes or less, in host-visible memory
/// that a kernel reads (and updates atomically) across the bus, about a microsecond per
/// access: measured on an H200, a counter kept there made the fused products ~8x slower
/// than MLX's own operations.
pub fn device_array(values: &Array, len: i32) -> Result<Array> {
    let padded = padded(values, len)?;
    padded.eval()?;
    Ok(padded)
}

/// [`device_array`]'s operation, not evaluated (a lazy part of a step's graph).
pub fn padded(values: &Array, len: i32) -> Result<Array> {
    let values = values.flatten(None, None)?;
    let pad = len - values.size() as i32;
    if pad < 0 {
        bail!("device_array: {} values do not fit {len}", values.size());
    }
    Ok(concatenate(
        &[values.clone(), zeros_dtype(&[pad], values.dtype())?],
        0,
    )?)
}

/// Whether a forward with `fused` runs these kernels on `x`: one token (`[1, K]`) whose width
/// they [`serves`].
pub fn serves_token(fused: Fused, x: &Array) -> bool {
    fused.products && x.ndim() == 2 && x.shape()[0] == 1 && serves(x.shape()[1] as usize, x.dtype())
}

/// The counter a [`product_residual`] call site owns, in device memory: one per site,
/// because the last block of a call resets it for the site's next call, and calls of one
/// site never overlap (each step's depends on the previous step's token).
pub fn new_counter() -> Result<Array> {
    new_counters(1)
}

/// `n` such counters (at least 16), for kernels that count per head: decode attention's
/// blocks of each query head, the attention heads finished apart.
pub fn new_counters(n: usize) -> Result<Array> {
    device_array(&Array::from_slice(&[0u32], &[1]), n.max(16) as i32)
}

fn rows_of(w: &Array, k: i32) -> Result<i32> {
    match w.shape() {
        [n, kk] if *kk == k => Ok(*n),
        other => bail!("a fused product expects a [rows, {k}] weight, got {other:?}"),
    }
}

fn blocks_for(rows: i32) -> i32 {
    blocks_for_rows_per_warp(rows, 1)
}

pub(crate) fn blocks_for_rows_per_warp(rows: i32, rows_per_warp: i32) -> i32 {
    let per_block = WARPS * rows_per_warp;
    (rows + per_block - 1) / per_block
}

/// Rows one warp computes in [`gated_product`] and [`product_residual`] (the feed-forward
/// and closing products) over dense weights.
const ROWS_PER_WARP: i32 = 1;

/// The same over 4-bit weights. A 4-bit row of E4B's width is 1.25 KB, two or three 16-byte
/// loads a lane: one row a warp leaves most of a lane's eight loads in flight unused. Two rows
/// were the fastest on an H200 (E4B 4-bit, side by side: 190.8 tok/s against 182.4 for one
/// row and 181.7 for four; BENCHMARKS.md).
const AFFINE4_ROWS_PER_WARP: i32 = 2;

/// 16-byte loads a lane keeps in flight over dense rows in [`gated_product`] and
/// [`product_residual`] (4-bit rows batch their own: 8 too). 16 was measured no faster and
/// removed.
const LOADS: i32 = 8;

/// Row counts per warp the kernels accept (each is a compiled variant).
pub const ROWS_PER_WARP_CHOICES: [i32; 3] = [1, 2, 4];

/// The row count per warp for a weight of this kind. The results are the same whatever the
/// count (each row's arithmetic is unchanged); only the work per block, and so the device's
/// streaming rate, changes (`bench --feed-forward-speed` measures it).
pub(crate) fn rows_per_warp_for(w: &Weight) -> i32 {
    if w.is_dense() {
        ROWS_PER_WARP
    } else {
        AFFINE4_ROWS_PER_WARP
    }
}

fn check_rows_per_warp(rows_per_warp: i32) -> Result<()> {
    if !ROWS_PER_WARP_CHOICES.contains(&rows_per_warp) {
        bail!("rows per warp must be one of {ROWS_PER_WARP_CHOICES:?}, got {rows_per_warp}");
    }
    Ok(())
}

/// `W_i · rms_norm(x, norm)` for up to three weights `[N_i, K]` sharing the input `x`
/// (`[1, K]`); without `norm`, `W_i · x`. Returns `[1, N_i]` per weight. Check [`serves`].
pub fn normed_products(
    x: &Array,
    norm: Option<&Array>,
    eps: f32,
    weights: &[&Array],
) -> Result<Vec<Array>> {
    if weights.is_empty() || weights.len() > 3 {
        bail!("normed_products takes one to three weights");
    }
    let k = x.shape()[x.ndim() - 1];
    let rows: Vec<i32> = weights
        .iter()
        .map(|w| rows_of(w, k))
        .collect::<Result<_>>()?;
    let n = |i: usize| rows.get(i).copied().unwrap_or(0);
    let dtype = x.dtype();
    // Absent weights: the first stands in (never read: its rows are past N0 + N1 + N2).
    let w = |i: usize| weights.get(i).copied().unwrap_or(weights[0]);
    let shapes: Vec<[i32; 2]> = (0..3).map(|i| [1, n(i).max(1)]).collect();
    NORMED.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        let mut out = kernel.apply(
            &[x, norm.unwrap_or(x), w(0), w(1), w(2)],
            &[
                (&shapes[0], dtype),
                (&shapes[1], dtype),
                (&shapes[2], dtype),
            ],
            (blocks_for(n(0) + n(1) + n(2)) * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"N0", TemplateArg::Int(n(0))),
                (c"N1", TemplateArg::Int(n(1))),
                (c"N2", TemplateArg::Int(n(2))),
                (c"NORM", TemplateArg::Bool(norm.is_some())),
            ],
        )?;
        out.truncate(weights.len());
        Ok(out)
    })
}

/// What multiplies the GELU of the gate product in [`gated_product`].
pub enum GateUp<'a> {
    /// A second product with the same input (the feed-forward's up projection, `[N, K]`),
    /// in the gate's layout.
    Product(Weight<'a>),
    /// `values[offset .. offset + N]` of a contiguous array (the per-layer input of one
    /// layer), `offset` held by an int32 array from [`device_array`] (a template constant
    /// would compile one kernel per layer).
    Slice {
        values: &'a Array,
        offset: &'a Array,
    },
}

/// `gelu_tanh(W_g · x') * up`, `x'` = `rms_norm(x, norm)` or `x` (`[1, K]`), `W_g`: `[N, K]`,
/// dense or 4-bit affine. Returns `[1, N]`. Check [`serves`].
pub fn gated_product(
    x: &Array,
    norm: Option<&Array>,
    eps: f32,
    gate: Weight,
    up: GateUp,
) -> Result<Array> {
    let rows = rows_per_warp_for(&gate);
    gated_product_rows(x, norm, eps, gate, up, rows)
}

/// [`gated_product`] with `rows_per_warp` rows per warp (one of [`ROWS_PER_WARP_CHOICES`]).
pub fn gated_product_rows(
    x: &Array,
    norm: Option<&Array>,
    eps: f32,
    gate: Weight,
    up: GateUp,
    rows_per_warp: i32,
) -> Result<Array> {
    check_rows_per_warp(rows_per_warp)?;
    let k = x.shape()[x.ndim() - 1];
    let dtype = x.dtype();
    let (n, bits, group) = weight_layout(&gate, k, dtype, "gated_product: the gate weight")?;
    let (up_weight, mul, offset, by_vector) = match up {
        GateUp::Product(w) => {
            if weight_layout(&w, k, dtype, "gated_product: the up weight")? != (n, bits, group) {
                bail!("gated_product: the gate and up weights differ in rows or layout");
            }
            // The offset is not read; it must still be int32 for the kernel's signature.
            (w, x, NO_OFFSET.with(Array::clone), false)
        }
        GateUp::Slice { values, offset } => {
            if offset.dtype() != Dtype::Int32 {
                bail!("the gate's slice offset must be int32");
            }
            (gate, values, offset.clone(), true)
        }
    };
    let [wg, wg_s, wg_b] = gate.inputs();
    let [wu, wu_s, wu_b] = up_weight.inputs();
    GATED.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        let mut out = kernel.apply(
            &[
                x,
                norm.unwrap_or(x),
                wg,
                wu,
                mul,
                &offset,
                wg_s,
                wg_b,
                wu_s,
                wu_b,
            ],
            &[(&[1, n], dtype)],
            (blocks_for_rows_per_warp(n, rows_per_warp) * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"N", TemplateArg::Int(n)),
                (c"NORM", TemplateArg::Bool(norm.is_some())),
                (c"BY_VECTOR", TemplateArg::Bool(by_vector)),
                (c"RPW", TemplateArg::Int(rows_per_warp)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
                (c"LOADS", TemplateArg::Int(LOADS)),
                (c"INT_DOTS", TemplateArg::Bool(false)),
                (c"TOUCH", TemplateArg::Bool(false)),
            ],
        )?;
        Ok(out.remove(0))
    })
}

/// `h + rms_norm(W · a, post_norm)`, times `scale` (a one-element array) when given: `a` is
/// `[1, K]`, `W` `[N, K]` (dense or 4-bit affine), `h` `[1, N]`. `counter` comes from
/// [`new_counter`], one per call site. Check [`serves`].
pub fn product_residual(
    a: &Array,
    w: Weight,
    h: &Array,
    post_norm: &Array,
    eps: f32,
    scale: Option<&Array>,
    counter: &Array,
) -> Result<Array> {
    let rows = rows_per_warp_for(&w);
    product_residual_rows(a, w, h, post_norm, eps, scale, counter, rows)
}

/// [`product_residual`] with `rows_per_warp` rows per warp (one of
/// [`ROWS_PER_WARP_CHOICES`]).
#[allow(clippy::too_many_arguments)]
pub fn product_residual_rows(
    a: &Array,
    w: Weight,
    h: &Array,
    post_norm: &Array,
    eps: f32,
    scale: Option<&Array>,
    counter: &Array,
    rows_per_warp: i32,
) -> Result<Array> {
    check_rows_per_warp(rows_per_warp)?;
    let k = a.shape()[a.ndim() - 1];
    let dtype = a.dtype();
    let (n, bits, group) = weight_layout(&w, k, dtype, "product_residual: the weight")?;
    let [w, w_s, w_b] = w.inputs();
    RESIDUAL.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        let mut out = kernel.apply(
            &[
                a,
                w,
                h,
                post_norm,
                scale.unwrap_or(post_norm),
                counter,
                w_s,
                w_b,
            ],
            &[(&[1, n], dtype), (&[n], Dtype::Float32)],
            (blocks_for_rows_per_warp(n, rows_per_warp) * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"N", TemplateArg::Int(n)),
                (c"SCALED", TemplateArg::Bool(scale.is_some())),
                (c"RPW", TemplateArg::Int(rows_per_warp)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
                (c"LOADS", TemplateArg::Int(LOADS)),
                (c"INT_DOTS", TemplateArg::Bool(false)),
                (c"TOUCH", TemplateArg::Bool(false)),
            ],
        )?;
        Ok(out.remove(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_rows_of_whole_16_byte_loads_that_fit_shared_memory() {
        assert!(serves(2560, Dtype::Bfloat16));
        assert!(serves(10240, Dtype::Float32));
        assert!(serves(15360, Dtype::Bfloat16));
        assert!(
            serves(21504, Dtype::Bfloat16),
            "the 31B's feed-forward input"
        );
        assert!(serves(8, Dtype::Bfloat16));
        assert!(!serves(4, Dtype::Bfloat16), "half a 16-byte load");
        assert!(!serves(15360, Dtype::Float32), "60 KB of input");
        assert!(!serves(0, Dtype::Float32));
        assert!(!serves(256, Dtype::Int32));
    }

    #[test]
    fn a_weight_of_the_wrong_width_is_refused_before_any_kernel() {
        let x = Array::zeros::<f32>(&[1, 8]).unwrap();
        let w = Array::zeros::<f32>(&[4, 16]).unwrap();
        let err = normed_products(&x, None, 1e-6, &[&w]).unwrap_err();
        assert!(err.to_string().contains("[rows, 8]"), "{err}");
        let err = normed_products(&x, None, 1e-6, &[]).unwrap_err();
        assert!(err.to_string().contains("one to three"), "{err}");
    }

    #[test]
    fn rows_per_warp_takes_the_compiled_choices_only() {
        let x = Array::zeros::<f32>(&[1, 8]).unwrap();
        let w = Array::zeros::<f32>(&[4, 8]).unwrap();
        let dense = Weight::Dense(&w);
        let err = gated_product_rows(&x, None, 1e-6, dense, GateUp::Product(dense), 8).unwrap_err();
        assert!(err.to_string().contains("rows per warp"), "{err}");
    }

    #[test]
    fn the_device_code_knows_the_block_size() {
        assert!(HEADER.contains(&format!("constexpr int BLOCK_THREADS = {THREADS};")));
    }

    #[test]
    fn a_counter_starts_at_zero() {
        let counter = new_counter().unwrap();
        assert_eq!(counter.as_slice::<u32>(), &[0; 16]);
    }

    #[test]
    fn a_device_array_keeps_its_values_then_zeros() {
        let a = device_array(&Array::from_slice(&[7i32, 9], &[2]), 4).unwrap();
        assert_eq!(a.as_slice::<i32>(), &[7, 9, 0, 0]);
        assert_eq!(a.dtype(), Dtype::Int32);
        assert!(device_array(&Array::from_slice(&[1i32; 5], &[5]), 4).is_err());
    }

    #[test]
    fn gate_and_up_weights_of_different_layouts_are_refused() {
        let x = Array::zeros::<f32>(&[1, 64]).unwrap();
        let dense = Array::zeros::<f32>(&[16, 64]).unwrap();
        // [16, 64] in 4 bits, groups of 32: 8 words and 2 scales a row.
        let packed = Array::zeros::<u32>(&[16, 8]).unwrap();
        let scales = Array::zeros::<f32>(&[16, 2]).unwrap();
        let quantized = Weight::Affine4 {
            packed: &packed,
            scales: &scales,
            biases: &scales,
        };
        let err = gated_product(
            &x,
            None,
            1e-6,
            Weight::Dense(&dense),
            GateUp::Product(quantized),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("differ in rows or layout"),
            "{err}"
        );
        // A 4-bit weight of the wrong input width is named.
        let wide = Array::zeros::<f32>(&[1, 128]).unwrap();
        let counter = new_counter().unwrap();
        let err =
            product_residual(&wide, quantized, &wide, &wide, 1e-6, None, &counter).unwrap_err();
        assert!(
            err.to_string().contains("product_residual: the weight"),
            "{err}"
        );
    }
}
