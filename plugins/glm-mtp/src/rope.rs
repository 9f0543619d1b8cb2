//! The row's RoPE: GLM's partial rotate-half rotation. The first `rotary_dim` dimensions of a
//! head turn in pairs `(j, j + rotary_dim/2)` with inverse frequency
//! `theta^(-2j / rotary_dim)` (the denominator is the rotated width, not the head), the rest
//! pass through. Angles are `position * inverse frequency` in float32, as transformers makes
//! them.

use mlx_spec_plugin_api::mlx_rs::ops::concatenate;
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::linear::mlx_err;

/// Cosines and sines of consecutive positions, `[rows, rotary_dim]` each.
pub struct RowAngles {
    cos: Array,
    sin: Array,
    rotary_dim: usize,
}

impl RowAngles {
    pub fn new(
        theta: f32,
        rotary_dim: usize,
        first_position: u64,
        rows: usize,
        dtype: Dtype,
    ) -> Result<Self, String> {
        let half = rotary_dim / 2;
        let inverse: Vec<f32> = (0..half)
            .map(|j| 1.0 / theta.powf((2 * j) as f32 / rotary_dim as f32))
            .collect();
        let (mut cos, mut sin) = (
            Vec::with_capacity(rows * rotary_dim),
            Vec::with_capacity(rows * rotary_dim),
        );
        for r in 0..rows {
            let position = (first_position + r as u64) as f32;
            let (mut c, mut s) = (vec![0f32; rotary_dim], vec![0f32; rotary_dim]);
            for (j, inv) in inverse.iter().enumerate() {
                let (sj, cj) = (position * inv).sin_cos();
                for k in [j, j + half] {
                    c[k] = cj;
                    s[k] = sj;
                }
            }
            cos.extend(c);
            sin.extend(s);
        }
        let make = |v: &[f32]| {
            Array::from_slice(v, &[rows as i32, rotary_dim as i32])
                .as_dtype(dtype)
                .map_err(mlx_err("RoPE angles"))
        };
        Ok(RowAngles {
            cos: make(&cos)?,
            sin: make(&sin)?,
            rotary_dim,
        })
    }

    /// Rotates `x` `[1, heads, rows, head_dim]`.
    pub fn apply(&self, x: &Array) -> Result<Array, String> {
        let e = mlx_err("RoPE");
        let head_dim = *x.shape().last().unwrap_or(&0) as usize;
        let parts = if self.rotary_dim < head_dim {
            x.split_at_indices(&[self.rotary_dim as i32], -1)
                .map_err(&e)?
        } else {
            vec![x.clone()]
        };
        let turning = &parts[0];
        let halves = turning.split_equal(2, -1).map_err(&e)?;
        let partner =
            concatenate(&[halves[1].negative().map_err(&e)?, halves[0].clone()], -1).map_err(&e)?;
        let turned = turning
            .multiply(&self.cos)
            .and_then(|a| a.add(partner.multiply(&self.sin)?))
            .map_err(&e)?;
        match parts.get(1) {
            Some(still) => concatenate(&[turned, still.clone()], -1).map_err(e),
            None => Ok(turned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_the_leading_pairs_and_passes_the_rest() {
        // head_dim 8, rotary 4 (pairs (0,2), (1,3)), theta 100, positions 3 and 4.
        let x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).cos()).collect();
        let angles = RowAngles::new(100.0, 4, 3, 2, Dtype::Float32).unwrap();
        let got = angles.apply(&Array::from_slice(&x, &[1, 1, 2, 8])).unwrap();
        let got = got.as_slice::<f32>();
        for row in 0..2 {
            let p = (3 + row) as f64;
            let v = &x[row * 8..row * 8 + 8];
            for j in 0..2 {
                let inv = 1.0 / 100f64.powf(2.0 * j as f64 / 4.0);
                let (s, c) = (p * inv).sin_cos();
                let (a, b) = (v[j] as f64, v[j + 2] as f64);
                assert!((got[row * 8 + j] as f64 - (a * c - b * s)).abs() < 1e-5);
                assert!((got[row * 8 + j + 2] as f64 - (a * s + b * c)).abs() < 1e-5);
            }
            assert_eq!(&got[row * 8 + 4..row * 8 + 8], &v[4..8]);
        }
    }
}
