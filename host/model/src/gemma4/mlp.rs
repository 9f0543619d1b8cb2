//! The gated feed-forward block: `down(gelu_tanh(gate(x)) * up(x))`.

use super::norm::rms_norm;
use anyhow::Result;
use mlx_rs::Array;

use super::activation::gated_gelu;
use super::linear::{Linear, Loader};

pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    pub fn load(w: &Loader, prefix: &str, hidden: usize, width: usize) -> Result<Self> {
        Ok(Mlp {
            gate_proj: w.linear(&format!("{prefix}gate_proj"), width, hidden)?,
            up_proj: w.linear(&format!("{prefix}up_proj"), width, hidden)?,
            down_proj: w.linear(&format!("{prefix}down_proj"), hidden, width)?,
        })
    }

    /// `gelu_tanh(gate(x')) * up(x')` with `x' = rms_norm(x, pre_norm)`: the input of the
    /// down projection.
    pub fn activation(&self, x: &Array, pre_norm: &Array, eps: f32) -> Result<Array> {
        let x = rms_norm(x, Some(pre_norm), eps)?;
        let gate = self.gate_proj.forward(&x)?;
        let up = self.up_proj.forward(&x)?;
        gated_gelu(&gate, &up)
    }

    pub fn down_proj(&self) -> &Linear {
        &self.down_proj
    }
}
