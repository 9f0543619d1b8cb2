//! RMSNorm, with or without a weight, on every device.
//!
//! On a GPU MLX runs its own fused kernel. On the CPU it has none and writes the norm out as
//! separate operations (square, mean, add, reciprocal square root, two products and the
//! broadcasts between them), each costing host time in a decode step, where the vectors are
//! tiny: on the default model that is most of a step's ~1 000 operations. There the same
//! function goes through MLX's compiler, built once per thread and epsilon, which fuses the
//! element-wise parts. Small inputs (decode, verification) get a trace per shape; larger ones
//! keep MLX's plain operations, as their cost is the arithmetic.

use std::cell::RefCell;
use std::collections::HashMap;

use anyhow::Result;
use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, DeviceType};

use super::activation::is_small;
use crate::device::default_is;

type Weighted = Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> Result<Array, Exception>>;
type Plain = Box<dyn for<'a> FnMut(&'a Array) -> Result<Array, Exception>>;

thread_local! {
    static WEIGHTED: RefCell<HashMap<u32, Weighted>> = RefCell::new(HashMap::new());
    static PLAIN: RefCell<HashMap<u32, Plain>> = RefCell::new(HashMap::new());
}

/// `x / rms(x) * w` over the last axis (`w` absent: no weight).
pub fn rms_norm(x: &Array, w: Option<&Array>, eps: f32) -> Result<Array> {
    if !(is_small(x) && default_is(DeviceType::Cpu)) {
        return Ok(fast::rms_norm(x, w, eps)?);
    }
    let key = eps.to_bits();
    Ok(match w {
        Some(w) => WEIGHTED.with(|cell| {
            let mut fns = cell.borrow_mut();
            let f = fns.entry(key).or_insert_with(|| {
                Box::new(compile(
                    move |(x, w): (&Array, &Array)| fast::rms_norm(x, Some(w), eps),
                    false,
                ))
            });
            f((x, w))
        })?,
        None => PLAIN.with(|cell| {
            let mut fns = cell.borrow_mut();
            let f = fns.entry(key).or_insert_with(|| {
                Box::new(compile(
                    move |x: &Array| fast::rms_norm(x, None, eps),
                    false,
                ))
            });
            f(x)
        })?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Dtype;

    fn values(a: &Array) -> Vec<f32> {
        a.as_dtype(Dtype::Float32)
            .unwrap()
            .as_slice::<f32>()
            .to_vec()
    }

    #[test]
    fn equals_mlx_rms_norm_with_and_without_weight() {
        for (dtype, shape) in [
            (Dtype::Float32, vec![1, 16]),
            (Dtype::Bfloat16, vec![1, 2, 1, 8]),
            (Dtype::Float16, vec![3, 8]),
            (Dtype::Float32, vec![100, 8]), // more rows than the compiled path takes
        ] {
            let n: i32 = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let x = Array::from_slice(&data, &shape).as_dtype(dtype).unwrap();
            let width = *shape.last().unwrap();
            let w: Vec<f32> = (0..width).map(|i| 0.5 + i as f32 * 0.1).collect();
            let w = Array::from_slice(&w, &[width]).as_dtype(dtype).unwrap();
            let ours = rms_norm(&x, Some(&w), 1e-6).unwrap();
            let mlx = fast::rms_norm(&x, Some(&w), 1e-6).unwrap();
            assert_eq!(ours.dtype(), dtype);
            assert_eq!(ours.shape(), &shape[..]);
            assert_eq!(values(&ours), values(&mlx), "{dtype:?} {shape:?}");
            let ours = rms_norm(&x, None, 1e-5).unwrap();
            let mlx = fast::rms_norm(&x, None, 1e-5).unwrap();
            assert_eq!(
                values(&ours),
                values(&mlx),
                "{dtype:?} {shape:?}, no weight"
            );
        }
    }

    #[test]
    fn a_decode_sized_norm_on_the_cpu_is_at_most_three_operations() {
        let x = Array::from_slice(&[1f32, -2.0, 3.0, 0.5, 4.0, -1.0, 2.0, 0.25], &[1, 8]);
        let w = Array::from_slice(&[1f32; 8], &[8]);
        let out = rms_norm(&x, Some(&w), 1e-6).unwrap();
        let path = std::env::temp_dir().join(format!("mlx-spec-norm-{}.dot", std::process::id()));
        crate::graph::export_dot(&out, &path).unwrap();
        let dot = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        let ops = crate::graph::count_operations(&dot);
        // MLX's own form: square, mean, add, rsqrt, two products and their broadcasts.
        assert!(ops.values().sum::<usize>() <= 3, "{ops:?}");
        assert!(ops.keys().any(|k| k.starts_with("Compiled")), "{ops:?}");
    }
}
