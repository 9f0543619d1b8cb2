//! One draft layer (z-lab's `Qwen3DFlashDecoderLayer`): a Qwen3 pre-norm layer whose keys
//! and values are the context rows' followed by the block's own.
//!
//! ```text
//! x = rms(h, input_layernorm)
//! q = rope(rms(q_proj x, q_norm))                      block positions P..P+B-1
//! K = rope(rms(k_proj x, k_norm));  V = v_proj x       no norm on the values
//! o = softmax(scale q [Kc; K]ᵀ + mask) [Vc; V]         scale head_dim^-1/2
//! h = h + o_proj o
//! h = h + down_proj(act(gate_proj m) * up_proj m)      m = rms(h, post_attention_layernorm)
//! ```
//!
//! The mask is the layer's kind: a full layer sees every context row and the whole block
//! (non-causal); a sliding layer of window w is causal, and the row at position p sees the
//! positions p-w+1..p of context and block alike.
//!
//! Context rows (`Kc`, `Vc`) are made once per verified position from the projected taps with
//! the same `k_proj`, `v_proj`, `k_norm` and RoPE, and kept (see [`crate::model::Context`]).

use mlx_spec_plugin_api::mlx_rs::fast::{
    rms_norm, scaled_dot_product_attention, ScaledDotProductAttentionMask,
};
use mlx_spec_plugin_api::mlx_rs::ops::indexing::IndexOp;
use mlx_spec_plugin_api::mlx_rs::ops::{concatenate, sigmoid};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::config::{Activation, DFlashConfig};
use crate::linear::{mlx_err, Linear, Loader};
use crate::rope::Angles;

pub struct DraftLayer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Array,
    k_norm: Array,
    input_layernorm: Array,
    post_attention_layernorm: Array,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    eps: f32,
    scale: f32,
    activation: Activation,
    /// `Some(w)`: sliding (causal, window w); `None`: full (non-causal).
    window: Option<usize>,
}

impl DraftLayer {
    pub fn load(config: &DFlashConfig, i: usize, loader: &Loader<'_>) -> Result<Self, String> {
        let (h, d) = (config.hidden_size, config.head_dim);
        let (nh, nkv) = (config.num_attention_heads, config.num_kv_heads);
        let bias = config.attention_bias;
        let p = format!("layers.{i}.");
        let norm = |name: &str, width: usize| loader.float(&format!("{p}{name}.weight"), &[width]);
        let inter = config.intermediate_size;
        Ok(DraftLayer {
            q_proj: loader.linear(&format!("{p}self_attn.q_proj"), nh * d, h, bias)?,
            k_proj: loader.linear(&format!("{p}self_attn.k_proj"), nkv * d, h, bias)?,
            v_proj: loader.linear(&format!("{p}self_attn.v_proj"), nkv * d, h, bias)?,
            o_proj: loader.linear(&format!("{p}self_attn.o_proj"), h, nh * d, bias)?,
            q_norm: norm("self_attn.q_norm", d)?,
            k_norm: norm("self_attn.k_norm", d)?,
            input_layernorm: norm("input_layernorm", h)?,
            post_attention_layernorm: norm("post_attention_layernorm", h)?,
            gate_proj: loader.linear(&format!("{p}mlp.gate_proj"), inter, h, false)?,
            up_proj: loader.linear(&format!("{p}mlp.up_proj"), inter, h, false)?,
            down_proj: loader.linear(&format!("{p}mlp.down_proj"), h, inter, false)?,
            heads: nh as i32,
            kv_heads: nkv as i32,
            head_dim: d as i32,
            eps: config.rms_norm_eps,
            scale: config.attention_scale,
            activation: config.activation,
            window: config.layer_windows[i],
        })
    }

    /// `[rows, heads * D]` to `[1, heads, rows, D]`.
    fn heads_of(&self, y: &Array, heads: i32) -> Result<Array, String> {
        let rows = y.shape()[0];
        y.reshape(&[1, rows, heads, self.head_dim])
            .and_then(|y| y.transpose_axes(&[0, 2, 1, 3]))
            .map_err(mlx_err("splitting heads"))
    }

    /// Keys and values `[1, kv_heads, rows, D]` of rows `x` (the block's normed rows, or the
    /// projected context) at the positions of `angles`.
    pub fn keys_values(&self, x: &Array, angles: &Angles) -> Result<(Array, Array), String> {
        let e = mlx_err("draft keys and values");
        let k = self.heads_of(&self.k_proj.forward(x)?, self.kv_heads)?;
        let keys = angles.apply(&rms_norm(&k, Some(&self.k_norm), self.eps).map_err(&e)?)?;
        let values = self.heads_of(&self.v_proj.forward(x)?, self.kv_heads)?;
        Ok((keys, values))
    }

    /// The context rows this layer reads for a block at position `p`: all of them for a full
    /// layer; for a sliding one only the rows the block's first row still sees
    /// (`p-w+1..p`; later rows see fewer). Returns the first kept position too.
    fn visible_context(
        &self,
        context: Option<&(Array, Array)>,
        p: usize,
    ) -> Result<(usize, Option<(Array, Array)>), String> {
        let Some((kc, vc)) = context else {
            return Ok((p, None));
        };
        let first = match self.window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        };
        if first == 0 {
            return Ok((0, Some((kc.clone(), vc.clone()))));
        }
        if first >= p {
            return Ok((p, None));
        }
        let keep = |a: &Array| a.index((.., .., first as i32..));
        Ok((first, Some((keep(kc), keep(vc)))))
    }

    /// The additive mask `[B, keys]` of a sliding layer over keys at positions `first..p+B`
    /// (none for a full layer: it sees everything).
    fn mask(
        &self,
        first: usize,
        p: usize,
        rows: usize,
        dtype: Dtype,
    ) -> Result<Option<Array>, String> {
        let Some(w) = self.window else {
            return Ok(None);
        };
        let keys = p + rows - first;
        let mut m = vec![0f32; rows * keys];
        for j in 0..rows {
            let q = p + j;
            for (i, cell) in m[j * keys..(j + 1) * keys].iter_mut().enumerate() {
                let k = first + i;
                if k > q || q - k >= w {
                    *cell = f32::NEG_INFINITY;
                }
            }
        }
        Array::from_slice(&m, &[rows as i32, keys as i32])
            .as_dtype(dtype)
            .map(Some)
            .map_err(mlx_err("attention mask"))
    }

    /// The block's rows `h` `[B, H]` at positions `p..p+B` (those of `angles`), attending to
    /// this layer's context keys and values (`None` before any context row exists).
    pub fn forward(
        &self,
        h: &Array,
        context: Option<&(Array, Array)>,
        p: usize,
        angles: &Angles,
    ) -> Result<Array, String> {
        let e = mlx_err("draft layer");
        let rows = h.shape()[0];
        let x = rms_norm(h, Some(&self.input_layernorm), self.eps).map_err(&e)?;
        let q = self.heads_of(&self.q_proj.forward(&x)?, self.heads)?;
        let q = angles.apply(&rms_norm(&q, Some(&self.q_norm), self.eps).map_err(&e)?)?;
        let (keys, values) = self.keys_values(&x, angles)?;
        let (first, visible) = self.visible_context(context, p)?;
        let (keys, values) = match visible {
            Some((kc, vc)) => (
                concatenate(&[kc, keys], 2).map_err(&e)?,
                concatenate(&[vc, values], 2).map_err(&e)?,
            ),
            None => (keys, values),
        };
        let mask = self.mask(first, p, rows as usize, q.dtype())?;
        let mask = mask.as_ref().map(ScaledDotProductAttentionMask::Array);
        let o = scaled_dot_product_attention(&q, &keys, &values, self.scale, mask, None)
            .and_then(|o| o.transpose_axes(&[0, 2, 1, 3]))
            .and_then(|o| o.reshape(&[rows, self.heads * self.head_dim]))
            .map_err(&e)?;
        let h = h.add(self.o_proj.forward(&o)?).map_err(&e)?;
        let m = rms_norm(&h, Some(&self.post_attention_layernorm), self.eps).map_err(&e)?;
        let gated = activate(self.activation, &self.gate_proj.forward(&m)?)?
            .multiply(self.up_proj.forward(&m)?)
            .map_err(&e)?;
        h.add(self.down_proj.forward(&gated)?).map_err(e)
    }

    pub fn nbytes(&self) -> usize {
        [
            &self.q_norm,
            &self.k_norm,
            &self.input_layernorm,
            &self.post_attention_layernorm,
        ]
        .iter()
        .map(|a| a.nbytes())
        .sum::<usize>()
            + [
                &self.q_proj,
                &self.k_proj,
                &self.v_proj,
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

/// The MLP gate's activation, in float32 (`silu(x) = x sigmoid(x)`; the tanh GELU is
/// `x sigmoid(2z)` with `z = sqrt(2/pi) (x + 0.044715 x^3)`).
fn activate(activation: Activation, gate: &Array) -> Result<Array, String> {
    let e = mlx_err("MLP activation");
    let x = gate.as_dtype(Dtype::Float32).map_err(&e)?;
    let inner = match activation {
        Activation::Silu => x.clone(),
        Activation::GeluTanh => {
            let c = 2.0 * (2.0 / std::f32::consts::PI).sqrt();
            x.square()
                .and_then(|s| s.multiply(Array::from_f32(c * 0.044_715)))
                .and_then(|s| s.add(Array::from_f32(c)))
                .and_then(|s| x.multiply(s))
                .map_err(&e)?
        }
    };
    x.multiply(sigmoid(&inner).map_err(&e)?)
        .and_then(|g| g.as_dtype(gate.dtype()))
        .map_err(e)
}
