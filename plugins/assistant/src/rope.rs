//! RoPE of the drafter's query, rotate-half layout (pairs `j` and `j + head_dim/2`).
//!
//! The donor keys were rotated by the target, so the query must turn exactly as the target
//! turns it: the same periods (`theta^(2j/d)` in float32; "proportional": the first
//! `floor(partial * d) / 2` pairs at `factor * theta^(2j/d)`, the denominator the whole head,
//! the rest not at all) and the same float32 angle `position * (1 / period)` as the host's
//! RoPE and transformers. The query position is constant over a round, so its cosines and
//! sines are made once per round on the host and reused by every step.

use mlx_spec_plugin_api::mlx_rs::ops::concatenate;
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::config::RopeKind;
use crate::linear::mlx_err;

/// Every pair's period (`1 / inverse frequency`; infinite for pairs that do not turn).
pub fn periods(kind: RopeKind, head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    match kind {
        RopeKind::Default { theta } => (0..half)
            .map(|j| theta.powf(2.0 * j as f32 / head_dim as f32))
            .collect(),
        RopeKind::Proportional {
            theta,
            partial_factor,
            factor,
        } => {
            let turning = ((partial_factor * head_dim as f32) as usize / 2).min(half);
            (0..half)
                .map(|j| {
                    if j < turning {
                        factor * theta.powf(2.0 * j as f32 / head_dim as f32)
                    } else {
                        f32::INFINITY
                    }
                })
                .collect()
        }
    }
}

/// Cosines and sines of one position, `[head_dim]` each (each half repeated).
pub struct QueryAngles {
    pub cos: Array,
    pub sin: Array,
}

impl QueryAngles {
    pub fn new(
        kind: RopeKind,
        head_dim: usize,
        position: u64,
        dtype: Dtype,
    ) -> Result<Self, String> {
        let half = head_dim / 2;
        let (mut cos, mut sin) = (vec![0f32; head_dim], vec![0f32; head_dim]);
        for (j, period) in periods(kind, head_dim).into_iter().enumerate() {
            let angle = position as f32 * (1.0 / period);
            let (s, c) = angle.sin_cos();
            for k in [j, j + half] {
                cos[k] = c;
                sin[k] = s;
            }
        }
        let make = |v: &[f32]| {
            Array::from_slice(v, &[head_dim as i32])
                .as_dtype(dtype)
                .map_err(mlx_err("RoPE angles"))
        };
        Ok(QueryAngles {
            cos: make(&cos)?,
            sin: make(&sin)?,
        })
    }

    /// Rotates `x` (`[.., head_dim]`): `x * cos + rotate_half(x) * sin`, where
    /// `rotate_half([a, b]) = [-b, a]`.
    pub fn apply(&self, x: &Array) -> Result<Array, String> {
        let e = mlx_err("query RoPE");
        let halves = x.split_equal(2, -1).map_err(&e)?;
        let partner =
            concatenate(&[halves[1].negative().map_err(&e)?, halves[0].clone()], -1).map_err(&e)?;
        x.multiply(&self.cos)
            .and_then(|a| a.add(partner.multiply(&self.sin)?))
            .map_err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rotation written out pair by pair in float64 from float32 angles.
    fn reference(x: &[f32], kind: RopeKind, position: u64) -> Vec<f32> {
        let d = x.len();
        let half = d / 2;
        let p = periods(kind, d);
        let mut out = vec![0f32; d];
        for j in 0..half {
            let angle = (position as f32 * (1.0 / p[j])) as f64;
            let (s, c) = angle.sin_cos();
            let (a, b) = (x[j] as f64, x[j + half] as f64);
            out[j] = (a * c - b * s) as f32;
            out[j + half] = (a * s + b * c) as f32;
        }
        out
    }

    #[test]
    fn rotates_pairs_and_leaves_still_pairs_alone() {
        let kinds = [
            RopeKind::Default { theta: 10_000.0 },
            RopeKind::Proportional {
                theta: 1e6,
                partial_factor: 0.25,
                factor: 1.0,
            },
        ];
        let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.7).sin()).collect();
        for kind in kinds {
            for position in [0u64, 1, 12, 4097] {
                let angles = QueryAngles::new(kind, 32, position, Dtype::Float32).unwrap();
                let got = angles.apply(&Array::from_slice(&x, &[1, 32])).unwrap();
                let want = reference(&x, kind, position);
                for (g, w) in got.as_slice::<f32>().iter().zip(&want) {
                    assert!((g - w).abs() < 1e-6, "{kind:?} at {position}: {g} vs {w}");
                }
            }
        }
        // Proportional, quarter of 32: pairs 0..4 turn, 4..16 stay.
        let p = periods(kinds[1], 32);
        assert!(p[..4].iter().all(|x| x.is_finite()) && p[4..].iter().all(|x| x.is_infinite()));
    }
}
