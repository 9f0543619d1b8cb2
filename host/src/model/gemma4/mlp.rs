//! The gated feed-forward block: `down(gelu_tanh(gate(x)) * up(x))`.

use anyhow::Result;
use mlx_rs::Array;

use super::activation::gated_gelu;
use super::linear::{Linear, Loader};

pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    pub fn load(w: &Loader, prefix: &str, hidden: usize, width: usize) -> Result<Self> {
        Ok(Mlp {
            gate_proj: w.linear(&format!("{prefix}gate_proj"), width, hidden)?,
            up_proj: w.linear(&format!("{prefix}up_proj"), width, hidden)?,
            down_proj: w.linear(&format!("{prefix}down_proj"), hidden, width)?,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let gate = self.gate_proj.forward(x)?;
        let up = self.up_proj.forward(x)?;
        self.down_proj.forward(&gated_gelu(&gate, &up)?)
    }
}
