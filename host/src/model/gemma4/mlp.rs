//! The gated feed-forward block: `down(gelu_tanh(gate(x)) * up(x))`.

use super::norm::rms_norm;
use anyhow::Result;
use mlx_rs::Array;

use super::activation::gated_gelu;
use super::linear::{Linear, Loader};
use crate::kernels::post_attention::Weight;
use crate::kernels::products::{gated_product, serves_token, GateUp};
use crate::kernels::Fused;

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

    /// `gelu_tanh(gate(x')) * up(x')` with `x' = rms_norm(x, pre_norm)`: the input of the
    /// down projection. One CUDA kernel for a single token with `fused.products` (dense
    /// weights, or 4-bit ones in one layout with `fused.affine4_products`).
    pub fn activation(&self, x: &Array, pre_norm: &Array, eps: f32, fused: Fused) -> Result<Array> {
        if serves_token(fused, x) {
            if let (Some(gate), Some(up)) = (
                self.gate_proj.product_weight(x, fused),
                self.up_proj.product_weight(x, fused),
            ) {
                let k = x.shape()[x.ndim() - 1];
                if gate.is_dense() == up.is_dense() && gate.group(k) == up.group(k) {
                    return gated_product(x, Some(pre_norm), eps, gate, GateUp::Product(up));
                }
            }
        }
        let x = rms_norm(x, Some(pre_norm), eps)?;
        let gate = self.gate_proj.forward(&x)?;
        let up = self.up_proj.forward(&x)?;
        gated_gelu(&gate, &up)
    }

    pub fn down_proj(&self) -> &Linear {
        &self.down_proj
    }

    /// Gate, up and down as the fused post-attention kernel reads them.
    pub fn kernel_weights(&self) -> Option<(Weight<'_>, Weight<'_>, Weight<'_>)> {
        Some((
            self.gate_proj.kernel_weight()?,
            self.up_proj.kernel_weight()?,
            self.down_proj.kernel_weight()?,
        ))
    }
}
