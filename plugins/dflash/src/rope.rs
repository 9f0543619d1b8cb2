//! RoPE of the draft layers: Qwen3's default rotation over the whole head. Pairs
//! `(j, j + D/2)` of a head of size D turn with inverse frequency `theta^(-2j / D)`; angles
//! are `position * inverse frequency` in float32, as transformers computes them.

use mlx_spec_plugin_api::mlx_rs::ops::concatenate;
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::linear::mlx_err;

/// Cosines and sines of consecutive positions, `[rows, D]` each.
pub struct Angles {
    cos: Array,
    sin: Array,
}

impl Angles {
    pub fn new(
        theta: f32,
        head_dim: usize,
        first_position: u64,
        rows: usize,
        dtype: Dtype,
    ) -> Result<Self, String> {
        let half = head_dim / 2;
        let inverse: Vec<f32> = (0..half)
            .map(|j| 1.0 / theta.powf((2 * j) as f32 / head_dim as f32))
            .collect();
        let (mut cos, mut sin) = (vec![0f32; rows * head_dim], vec![0f32; rows * head_dim]);
        for r in 0..rows {
            let position = (first_position + r as u64) as f32;
            for (j, inv) in inverse.iter().enumerate() {
                let (s, c) = (position * inv).sin_cos();
                for k in [j, j + half] {
                    cos[r * head_dim + k] = c;
                    sin[r * head_dim + k] = s;
                }
            }
        }
        let make = |v: &[f32]| {
            Array::from_slice(v, &[rows as i32, head_dim as i32])
                .as_dtype(dtype)
                .map_err(mlx_err("RoPE angles"))
        };
        Ok(Angles {
            cos: make(&cos)?,
            sin: make(&sin)?,
        })
    }

    /// Rotates `x` `[1, heads, rows, D]`: `x * cos + rotate_half(x) * sin`.
    pub fn apply(&self, x: &Array) -> Result<Array, String> {
        let e = mlx_err("RoPE");
        let halves = x.split_equal(2, -1).map_err(&e)?;
        let partner =
            concatenate(&[halves[1].negative().map_err(&e)?, halves[0].clone()], -1).map_err(&e)?;
        x.multiply(&self.cos)
            .and_then(|a| a.add(partner.multiply(&self.sin)?))
            .map_err(e)
    }
}
