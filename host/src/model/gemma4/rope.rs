//! Rotary position embedding in the rotate-half layout (pairs `j` and `j + head_dim/2`).

use anyhow::Result;
use mlx_rs::{fast, Array};

use super::config::RopeKind;

/// RoPE for one layer kind, ready to apply to `[batch, heads, tokens, head_dim]`.
pub struct Rope {
    head_dim: i32,
    /// The base of a plain `base^(2j/d)` schedule; `None`: MLX's RoPE takes `periods`.
    base: Option<f32>,
    /// Every pair's period (`1 / inverse frequency`, float32 `[head_dim / 2]`), also read by
    /// the fused decode kernel (`crate::kernels::attention_inputs`).
    periods: Array,
}

impl Rope {
    pub fn new(kind: &RopeKind, head_dim: usize) -> Self {
        match *kind {
            RopeKind::Default { theta } => {
                let periods: Vec<f32> = (0..head_dim / 2)
                    .map(|j| theta.powf(2.0 * j as f32 / head_dim as f32))
                    .collect();
                Rope {
                    head_dim: head_dim as i32,
                    base: Some(theta),
                    periods: Array::from_slice(&periods, &[periods.len() as i32]),
                }
            }
            RopeKind::Proportional {
                theta,
                partial_factor,
                factor,
            } => {
                // The rotated pairs use the frequencies of a full head_dim RoPE (denominator
                // head_dim, not the rotated width); the remaining pairs get an infinite period,
                // i.e. angle 0, so they pass through unchanged.
                let half = head_dim / 2;
                let rotated = ((partial_factor * head_dim as f32) as usize / 2).min(half);
                let periods: Vec<f32> = (0..half)
                    .map(|j| {
                        if j < rotated {
                            factor * theta.powf(2.0 * j as f32 / head_dim as f32)
                        } else {
                            f32::INFINITY
                        }
                    })
                    .collect();
                Rope {
                    head_dim: head_dim as i32,
                    base: None,
                    periods: Array::from_slice(&periods, &[half as i32]),
                }
            }
        }
    }

    /// Every pair's period (float32 `[head_dim / 2]`).
    pub fn periods(&self) -> &Array {
        &self.periods
    }

    /// Rotates `x` (`[batch, heads, tokens, head_dim]`) whose first token sits at `offset`.
    pub fn apply(&self, x: &Array, offset: usize) -> Result<Array> {
        Ok(fast::rope(
            x,
            self.head_dim,
            false,
            self.base,
            1.0,
            offset as i32,
            // MLX takes either a base or the periods, not both.
            self.base.is_none().then_some(&self.periods),
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_cover_every_pair_for_both_kinds() {
        let plain = Rope::new(&RopeKind::Default { theta: 10_000.0 }, 8);
        let p = plain.periods().as_slice::<f32>().to_vec();
        let want: Vec<f32> = (0..4).map(|j| 10_000f32.powf(j as f32 / 4.0)).collect();
        assert_eq!(p.len(), 4);
        for (got, want) in p.iter().zip(&want) {
            assert!((got / want - 1.0).abs() < 1e-6, "{got} vs {want}");
        }
        // Proportional with a quarter of the head rotated: 1 of 4 pairs, the rest pass through.
        let partial = Rope::new(
            &RopeKind::Proportional {
                theta: 10_000.0,
                partial_factor: 0.25,
                factor: 1.0,
            },
            8,
        );
        let p = partial.periods().as_slice::<f32>().to_vec();
        assert_eq!(p[0], 1.0);
        assert!(p[1..].iter().all(|x| x.is_infinite()));
    }
}
