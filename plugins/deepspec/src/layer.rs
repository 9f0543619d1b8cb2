//! One draft layer (DeepSpec's Gemma 4 decoder layer, all of them "full attention").
//!
//! ```text
//! x = rms(h, input_layernorm)
//! q = rope(rms(q_proj x, q_norm))                        block positions P..P+B-1
//! k = k_proj x;  K = rope(rms(k, k_norm));  V = rms(k)   K = V: values come from k_proj
//! o = softmax(q [Kc; K]ᵀ) [Vc; V]                        scale 1, no mask: the block sees
//!                                                         every context row and itself
//! h = h + rms(o_proj o, post_attention_layernorm)
//! h = h + rms(mlp(rms(h, pre_feedforward_layernorm)), post_feedforward_layernorm)
//! h = h * layer_scalar                                    the whole stream
//! ```
//!
//! Context rows (`Kc`, `Vc`) are made once per verified position from the projected taps with
//! the same `k_proj`, norms and RoPE, and kept (see [`crate::model::Context`]).

use mlx_spec_plugin_api::mlx_rs::fast::{rms_norm, scaled_dot_product_attention};
use mlx_spec_plugin_api::mlx_rs::ops::{concatenate, sigmoid};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::config::DSparkConfig;
use crate::linear::{mlx_err, Linear, Loader};
use crate::rope::Angles;

pub struct DraftLayer {
    q_proj: Linear,
    k_proj: Linear,
    o_proj: Linear,
    q_norm: Array,
    k_norm: Array,
    input_layernorm: Array,
    post_attention_layernorm: Array,
    pre_feedforward_layernorm: Array,
    post_feedforward_layernorm: Array,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    layer_scalar: Array,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    eps: f32,
}

impl DraftLayer {
    pub fn load(config: &DSparkConfig, i: usize, loader: &Loader<'_>) -> Result<Self, String> {
        let (h, d) = (config.hidden_size, config.head_dim);
        let (nh, nkv) = (config.num_attention_heads, config.num_kv_heads);
        let bias = config.attention_bias;
        let p = format!("layers.{i}.");
        let norm = |name: &str, width: usize| loader.float(&format!("{p}{name}.weight"), &[width]);
        let inter = config.intermediate_size;
        Ok(DraftLayer {
            q_proj: loader.linear(&format!("{p}self_attn.q_proj"), nh * d, h, bias)?,
            k_proj: loader.linear(&format!("{p}self_attn.k_proj"), nkv * d, h, bias)?,
            o_proj: loader.linear(&format!("{p}self_attn.o_proj"), h, nh * d, bias)?,
            q_norm: norm("self_attn.q_norm", d)?,
            k_norm: norm("self_attn.k_norm", d)?,
            input_layernorm: norm("input_layernorm", h)?,
            post_attention_layernorm: norm("post_attention_layernorm", h)?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm", h)?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm", h)?,
            gate_proj: loader.linear(&format!("{p}mlp.gate_proj"), inter, h, false)?,
            up_proj: loader.linear(&format!("{p}mlp.up_proj"), inter, h, false)?,
            down_proj: loader.linear(&format!("{p}mlp.down_proj"), h, inter, false)?,
            layer_scalar: loader.float(&format!("{p}layer_scalar"), &[1])?,
            heads: nh as i32,
            kv_heads: nkv as i32,
            head_dim: d as i32,
            eps: config.rms_norm_eps,
        })
    }

    /// `[rows, heads * D]` to `[1, heads, rows, D]`.
    fn heads_of(&self, y: &Array, heads: i32) -> Result<Array, String> {
        let rows = y.shape()[0];
        y.reshape(&[1, rows, heads, self.head_dim])
            .and_then(|y| y.transpose_axes(&[0, 2, 1, 3]))
            .map_err(mlx_err("splitting heads"))
    }

    /// Keys and values `[1, kv_heads, rows, D]` of rows `x` (already normed for the block;
    /// the projected context for context rows) at the positions of `angles`.
    pub fn keys_values(&self, x: &Array, angles: &Angles) -> Result<(Array, Array), String> {
        let e = mlx_err("draft keys and values");
        let k = self.heads_of(&self.k_proj.forward(x)?, self.kv_heads)?;
        let values = rms_norm(&k, None, self.eps).map_err(&e)?;
        let keys = angles.apply(&rms_norm(&k, Some(&self.k_norm), self.eps).map_err(&e)?)?;
        Ok((keys, values))
    }

    /// The block's rows `h` `[B, H]` at the positions of `angles`, attending to the context's
    /// keys and values of this layer (`None` before any context row exists).
    pub fn forward(
        &self,
        h: &Array,
        context: Option<&(Array, Array)>,
        angles: &Angles,
    ) -> Result<Array, String> {
        let e = mlx_err("draft layer");
        let rows = h.shape()[0];
        let x = rms_norm(h, Some(&self.input_layernorm), self.eps).map_err(&e)?;
        let q = self.heads_of(&self.q_proj.forward(&x)?, self.heads)?;
        let q = angles.apply(&rms_norm(&q, Some(&self.q_norm), self.eps).map_err(&e)?)?;
        let (keys, values) = self.keys_values(&x, angles)?;
        let (keys, values) = match context {
            Some((kc, vc)) => (
                concatenate(&[kc.clone(), keys], 2).map_err(&e)?,
                concatenate(&[vc.clone(), values], 2).map_err(&e)?,
            ),
            None => (keys, values),
        };
        let o = scaled_dot_product_attention(&q, &keys, &values, 1.0, None, None)
            .and_then(|o| o.transpose_axes(&[0, 2, 1, 3]))
            .and_then(|o| o.reshape(&[rows, self.heads * self.head_dim]))
            .map_err(&e)?;
        let attended = rms_norm(
            &self.o_proj.forward(&o)?,
            Some(&self.post_attention_layernorm),
            self.eps,
        )
        .map_err(&e)?;
        let h = h.add(attended).map_err(&e)?;
        let m = rms_norm(&h, Some(&self.pre_feedforward_layernorm), self.eps).map_err(&e)?;
        let fed = rms_norm(
            &self.down_proj.forward(&gelu_tanh_gated(
                &self.gate_proj.forward(&m)?,
                &self.up_proj.forward(&m)?,
            )?)?,
            Some(&self.post_feedforward_layernorm),
            self.eps,
        )
        .map_err(&e)?;
        h.add(fed)
            .and_then(|h| h.multiply(&self.layer_scalar))
            .map_err(e)
    }

    pub fn nbytes(&self) -> usize {
        [
            &self.q_norm,
            &self.k_norm,
            &self.input_layernorm,
            &self.post_attention_layernorm,
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
            &self.layer_scalar,
        ]
        .iter()
        .map(|a| a.nbytes())
        .sum::<usize>()
            + [
                &self.q_proj,
                &self.k_proj,
                &self.o_proj,
                &self.gate_proj,
                &self.up_proj,
                &self.down_proj,
            ]
            .iter()
            .map(|l| l.nbytes())
            .sum::<usize>()
    }
}

/// `gelu_tanh(gate) * up`, in float32 for the activation: `0.5 x (1 + tanh(z))` is
/// `x sigmoid(2z)` with `z = sqrt(2/pi) (x + 0.044715 x^3)`.
fn gelu_tanh_gated(gate: &Array, up: &Array) -> Result<Array, String> {
    let e = mlx_err("GELU");
    let c = 2.0 * (2.0 / std::f32::consts::PI).sqrt();
    let x = gate.as_dtype(Dtype::Float32).map_err(&e)?;
    let z2 = x
        .square()
        .and_then(|s| s.multiply(Array::from_f32(c * 0.044_715)))
        .and_then(|s| s.add(Array::from_f32(c)))
        .and_then(|s| x.multiply(s))
        .map_err(&e)?;
    x.multiply(sigmoid(&z2).map_err(&e)?)
        .and_then(|g| g.as_dtype(up.dtype()))
        .and_then(|g| g.multiply(up))
        .map_err(e)
}
