//! One drafter decoder layer: Gemma 4's block without key/value projections.
//!
//! `x` is the residual stream `[1, d]` of the single query token:
//! 1. attention: `q = RoPE(q_norm(q_proj(input_norm(x))))` per head, attend over the donor of
//!    the layer's kind, `x += post_attention_norm(o_proj(o))`;
//! 2. feed-forward: `f = pre_feedforward_norm(x)`,
//!    `x += post_feedforward_norm(down(gelu_tanh(gate(f)) * up(f)))`;
//! 3. `x *= layer_scalar` (the whole stream, as transformers does).
//!
//! Norms are RMSNorm with a plain weight (`x / rms(x) * w`, not `1 + w`).

use mlx_spec_plugin_api::mlx_rs::fast::rms_norm;
use mlx_spec_plugin_api::mlx_rs::ops::tanh;
use mlx_spec_plugin_api::mlx_rs::Array;

use crate::attention::{attend, AttentionScale, DonorView};
use crate::config::{AssistantConfig, Kind};
use crate::linear::{mlx_err, Linear, Loader};
use crate::rope::QueryAngles;

pub struct Layer {
    pub kind: Kind,
    num_heads: usize,
    head_dim: usize,
    eps: f32,
    input_norm: Array,
    q_proj: Linear,
    q_norm: Array,
    o_proj: Linear,
    post_attention_norm: Array,
    pre_feedforward_norm: Array,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    post_feedforward_norm: Array,
    layer_scalar: Array,
}

impl Layer {
    pub fn load(cfg: &AssistantConfig, index: usize, w: &Loader) -> Result<Self, String> {
        let kind = cfg.layer_kinds[index];
        let (d, ffn, nh) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads);
        let hd = cfg.head_dim(kind);
        let p = format!("model.layers.{index}.");
        let norm = |name: &str, width: usize| w.float(&format!("{p}{name}.weight"), &[width]);
        Ok(Layer {
            kind,
            num_heads: nh,
            head_dim: hd,
            eps: cfg.rms_norm_eps,
            input_norm: norm("input_layernorm", d)?,
            q_proj: w.linear(&format!("{p}self_attn.q_proj"), nh * hd, d)?,
            q_norm: norm("self_attn.q_norm", hd)?,
            o_proj: w.linear(&format!("{p}self_attn.o_proj"), d, nh * hd)?,
            post_attention_norm: norm("post_attention_layernorm", d)?,
            pre_feedforward_norm: norm("pre_feedforward_layernorm", d)?,
            gate_proj: w.linear(&format!("{p}mlp.gate_proj"), ffn, d)?,
            up_proj: w.linear(&format!("{p}mlp.up_proj"), ffn, d)?,
            down_proj: w.linear(&format!("{p}mlp.down_proj"), d, ffn)?,
            post_feedforward_norm: norm("post_feedforward_layernorm", d)?,
            layer_scalar: w.float(&format!("{p}layer_scalar"), &[1])?,
        })
    }

    pub fn forward(
        &self,
        x: &Array,
        donor: &DonorView,
        angles: &QueryAngles,
        scale: AttentionScale,
    ) -> Result<Array, String> {
        let e = mlx_err("drafter layer");
        let norm = |v: &Array, w: &Array| rms_norm(v, Some(w), self.eps).map_err(&e);

        let y = norm(x, &self.input_norm)?;
        let q = self
            .q_proj
            .forward(&y)?
            .reshape(&[self.num_heads as i32, self.head_dim as i32])
            .map_err(&e)?;
        let q = angles.apply(&norm(&q, &self.q_norm)?)?;
        let o = attend(&q, donor, scale)?;
        let x = x
            .add(norm(&self.o_proj.forward(&o)?, &self.post_attention_norm)?)
            .map_err(&e)?;

        let f = norm(&x, &self.pre_feedforward_norm)?;
        let gated = gelu_tanh(&self.gate_proj.forward(&f)?)?
            .multiply(self.up_proj.forward(&f)?)
            .map_err(&e)?;
        let m = self.down_proj.forward(&gated)?;
        let x = x.add(norm(&m, &self.post_feedforward_norm)?).map_err(&e)?;
        x.multiply(&self.layer_scalar).map_err(e)
    }

    pub fn nbytes(&self) -> usize {
        let norms = [
            &self.input_norm,
            &self.q_norm,
            &self.post_attention_norm,
            &self.pre_feedforward_norm,
            &self.post_feedforward_norm,
            &self.layer_scalar,
        ];
        let mats = [
            &self.q_proj,
            &self.o_proj,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ];
        norms.iter().map(|a| a.nbytes()).sum::<usize>()
            + mats.iter().map(|m| m.nbytes()).sum::<usize>()
    }
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, in float32 and rounded back to the
/// input dtype (PyTorch's `gelu(approximate="tanh")` on half inputs).
pub fn gelu_tanh(x: &Array) -> Result<Array, String> {
    let e = mlx_err("gelu");
    let dtype = x.dtype();
    let v = x
        .as_dtype(mlx_spec_plugin_api::mlx_rs::Dtype::Float32)
        .map_err(&e)?;
    let c = Array::from_f32((2.0 / std::f32::consts::PI).sqrt());
    let cube = v.multiply(&v).and_then(|s| s.multiply(&v)).map_err(&e)?;
    let inner = v
        .add(cube.multiply(Array::from_f32(0.044715)).map_err(&e)?)
        .and_then(|s| s.multiply(&c))
        .map_err(&e)?;
    let out = tanh(&inner)
        .and_then(|t| t.add(Array::from_f32(1.0)))
        .and_then(|t| t.multiply(&v))
        .and_then(|t| t.multiply(Array::from_f32(0.5)))
        .map_err(&e)?;
    out.as_dtype(dtype).map_err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_matches_the_formula() {
        let xs = [-3f32, -1.0, -0.1, 0.0, 0.5, 2.0, 6.0];
        let got = gelu_tanh(&Array::from_slice(&xs, &[xs.len() as i32])).unwrap();
        for (g, x) in got.as_slice::<f32>().iter().zip(xs) {
            let x = x as f64;
            let want = 0.5
                * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
            assert!((*g as f64 - want).abs() < 1e-6, "{x}: {g} vs {want}");
        }
    }
}
