//! The gated GELU of every Gemma 4 feed-forward path, `gelu_tanh(gate) * up`, as one fused
//! kernel that keeps the compute dtype.
//!
//! Two reasons not to use `mlx_rs::nn::gelu_approximate`:
//! * its constants are float32 arrays, so a bf16/f16 input comes back as float32, and every
//!   later matrix product then upcasts its weight to float32 (a full copy of the weight per
//!   token, several times the bytes of the weight itself);
//! * it builds a new compiled function on every call, so MLX traces, simplifies and caches
//!   the graph again each time (about 10 µs of host time per call, and a cache that grows).
//!
//! Here the compiled functions are built once per thread and reused, so MLX's compile cache is
//! hit after the first call; the GELU itself runs in float32 (as PyTorch computes it for half
//! inputs) and is rounded to the input dtype before the gating product, as transformers does.
//!
//! Two compiled forms, by input size. A shapeless trace serves every shape, but MLX then puts
//! an explicit broadcast in front of every operand of every operation, which doubles the depth
//! of the graph, so its fuser (at most 11 levels deep) leaves the first operations outside
//! the fused kernel: one gated GELU became five operations. A trace per shape has no such
//! broadcasts and fuses into one kernel. Decode and verification (a few rows) run it on every
//! layer of every step, where each operation costs host time, so small inputs use the
//! per-shape trace (few distinct shapes: rows <= [`PER_SHAPE_MAX_ROWS`]); prefill chunks,
//! whose row counts vary, keep the shapeless one.

use std::cell::RefCell;

use anyhow::Result;
use mlx_rs::error::Exception;
use mlx_rs::ops::sigmoid;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, Dtype};

type GatedFn = Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> Result<Array, Exception>>;

/// `gelu_tanh(gate) * up` without fusion: the definition the compiled kernel is traced from.
fn gated_gelu_eager((gate, up): (&Array, &Array)) -> Result<Array, Exception> {
    // 0.5 * (1 + tanh(z)) == sigmoid(2z): the same function in fewer operations, so MLX
    // fuses all of it into one kernel.
    let c = 2.0 * (2.0 / std::f32::consts::PI).sqrt();
    let x = gate.as_dtype(Dtype::Float32)?;
    let z2 = x.multiply(
        x.square()?
            .multiply(Array::from_f32(c * 0.044_715))?
            .add(Array::from_f32(c))?,
    )?;
    let gelu = x.multiply(sigmoid(&z2)?)?;
    gelu.as_dtype(up.dtype())?.multiply(up)
}

/// Inputs with at most this many rows (all axes but the last) use the per-shape trace.
pub const PER_SHAPE_MAX_ROWS: i32 = 64;

thread_local! {
    static GATED_GELU_SHAPELESS: RefCell<GatedFn> =
        RefCell::new(Box::new(compile(gated_gelu_eager, true)));
    static GATED_GELU_PER_SHAPE: RefCell<GatedFn> =
        RefCell::new(Box::new(compile(gated_gelu_eager, false)));
}

/// Whether `x` has at most [`PER_SHAPE_MAX_ROWS`] rows (all axes but the last): a decode or
/// verification sized input, which the compiled functions of this model trace per shape.
pub(crate) fn is_small(x: &Array) -> bool {
    let width = x.shape().last().copied().unwrap_or(1).max(1);
    x.size() as i32 / width <= PER_SHAPE_MAX_ROWS
}

/// `gelu_tanh(gate) * up`, elementwise, in `up`'s dtype. `gate` and `up` have equal shapes.
pub fn gated_gelu(gate: &Array, up: &Array) -> Result<Array> {
    let compiled = if is_small(gate) {
        &GATED_GELU_PER_SHAPE
    } else {
        &GATED_GELU_SHAPELESS
    };
    Ok(compiled.with(|f| (f.borrow_mut())((gate, up)))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(a: &Array) -> Vec<f32> {
        a.as_dtype(Dtype::Float32)
            .unwrap()
            .as_slice::<f32>()
            .to_vec()
    }

    #[test]
    fn matches_the_tanh_gelu_formula() {
        let xs = [-4.0f32, -1.5, -0.3, 0.0, 0.2, 1.0, 2.5, 6.0];
        let ups = [1.0f32, 2.0, -1.0, 3.0, 0.5, -2.0, 1.5, 0.25];
        let gate = Array::from_slice(&xs, &[2, 4]);
        let up = Array::from_slice(&ups, &[2, 4]);
        let got = values(&gated_gelu(&gate, &up).unwrap());
        for i in 0..xs.len() {
            let x = xs[i] as f64;
            let gelu = 0.5
                * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
            let want = (gelu * ups[i] as f64) as f32;
            assert!((got[i] - want).abs() < 1e-5, "x={x}: {} vs {want}", got[i]);
        }
    }

    #[test]
    fn keeps_half_precision_and_serves_any_shape() {
        for (dtype, shape) in [
            (Dtype::Bfloat16, vec![1, 3, 8]),
            (Dtype::Float16, vec![5, 2]),
            (Dtype::Bfloat16, vec![7]),
            (Dtype::Bfloat16, vec![100, 3]), // more rows than the per-shape limit
        ] {
            let n: i32 = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 1.2).collect();
            let gate = Array::from_slice(&data, &shape).as_dtype(dtype).unwrap();
            let up = Array::from_slice(&data, &shape).as_dtype(dtype).unwrap();
            let out = gated_gelu(&gate, &up).unwrap();
            assert_eq!(out.dtype(), dtype);
            assert_eq!(out.shape(), &shape[..]);
            // Same as the unfused definition, bit for bit after rounding to the dtype.
            let eager = gated_gelu_eager((&gate, &up)).unwrap();
            assert_eq!(values(&out), values(&eager));
        }
    }

    /// Operations MLX would run for `out`, by kind (its graph written out and counted).
    fn operations(out: &Array, tag: &str) -> std::collections::BTreeMap<String, usize> {
        let path =
            std::env::temp_dir().join(format!("mlx-spec-gelu-{tag}-{}.dot", std::process::id()));
        crate::graph::export_dot(out, &path).unwrap();
        let dot = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        crate::graph::count_operations(&dot)
    }

    #[test]
    fn a_decode_sized_call_is_one_fused_operation() {
        let data: Vec<f32> = (0..48).map(|i| i as f32 * 0.1 - 2.0).collect();
        let gate = Array::from_slice(&data, &[3, 16])
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let up = gate
            .multiply(Array::from_f32(0.5).as_dtype(Dtype::Bfloat16).unwrap())
            .unwrap();
        mlx_rs::transforms::eval([&gate, &up]).unwrap();
        let ops = operations(&gated_gelu(&gate, &up).unwrap(), "small");
        assert_eq!(ops.values().sum::<usize>(), 1, "{ops:?}");
        assert!(ops.keys().all(|k| k.starts_with("Compiled")), "{ops:?}");
    }
}
