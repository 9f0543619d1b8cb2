//! One Gemma 4 decoder layer: sandwich-normed attention and feed-forward blocks, the optional
//! MoE branch, the optional per-layer-embedding gate, and the learned `layer_scalar`.

use super::norm::rms_norm;
use anyhow::Result;
use mlx_rs::ops::broadcast_to;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::activation::gated_gelu;
use super::attention::Attention;
use super::cache::{KvView, LayerKv};
use super::config::Gemma4Config;
use super::linear::{Linear, Loader};
use super::mlp::Mlp;
use super::moe::Experts;

/// The MoE branch and its three extra norms.
pub struct MoeBranch {
    pub experts: Experts,
    pub pre_norm: Array,
    pub post_norm_dense: Array,
    pub post_norm_experts: Array,
}

/// The per-layer-embedding gate.
pub struct PleGate {
    pub input_gate: Linear,
    pub projection: Linear,
    pub post_norm: Array,
}

pub struct DecoderLayer {
    pub index: usize,
    pub eps: f32,
    pub window: usize,
    pub input_norm: Array,
    pub attention: Attention,
    pub post_attention_norm: Array,
    pub pre_feedforward_norm: Array,
    pub mlp: Mlp,
    pub moe: Option<MoeBranch>,
    pub post_feedforward_norm: Array,
    pub ple: Option<PleGate>,
    /// The learned scalar as stored (`[1]`).
    pub layer_scalar_value: Array,
    /// The learned scalar broadcast to `[1, H]` (a view, evaluated once) so a single-token
    /// step multiplies equal shapes and MLX adds no broadcast node per layer.
    layer_scalar: Array,
}

impl DecoderLayer {
    pub fn load(cfg: &Gemma4Config, index: usize, w: &Loader) -> Result<Self> {
        let h = cfg.hidden_size;
        let p = format!("layers.{index}.");
        let norm = |name: &str| w.tensor(&format!("{p}{name}.weight"), &[h]);
        let moe = match cfg.moe {
            Some(m) => Some(MoeBranch {
                experts: Experts::load(w, index, m, h, cfg.rms_norm_eps)?,
                pre_norm: norm("pre_feedforward_layernorm_2")?,
                post_norm_dense: norm("post_feedforward_layernorm_1")?,
                post_norm_experts: norm("post_feedforward_layernorm_2")?,
            }),
            None => None,
        };
        let ple = if cfg.per_layer_input_size > 0 {
            let pw = cfg.per_layer_input_size;
            Some(PleGate {
                input_gate: w.linear(&format!("{p}per_layer_input_gate"), pw, h)?,
                projection: w.linear(&format!("{p}per_layer_projection"), h, pw)?,
                post_norm: norm("post_per_layer_input_norm")?,
            })
        } else {
            None
        };
        let layer_scalar_value = w.tensor(&format!("{p}layer_scalar"), &[1])?;
        layer_scalar_value.eval()?;
        Ok(DecoderLayer {
            index,
            eps: cfg.rms_norm_eps,
            window: cfg.sliding_window,
            input_norm: norm("input_layernorm")?,
            attention: Attention::load(cfg, index, w)?,
            post_attention_norm: norm("post_attention_layernorm")?,
            pre_feedforward_norm: norm("pre_feedforward_layernorm")?,
            mlp: Mlp::load(w, &format!("{p}mlp."), h, cfg.layers[index].mlp_width)?,
            moe,
            post_feedforward_norm: norm("post_feedforward_layernorm")?,
            ple,
            layer_scalar: {
                let s = broadcast_to(&layer_scalar_value, &[1, h as i32])?;
                s.eval()?;
                s
            },
            layer_scalar_value,
        })
    }

    /// Bytes of this layer's weights a single token does not read (unrouted experts).
    pub fn unread_nbytes_per_token(&self) -> usize {
        self.moe
            .as_ref()
            .map_or(0, |m| m.experts.unread_nbytes_per_token())
    }

    fn norm(&self, x: &Array, w: &Array) -> Result<Array> {
        rms_norm(x, Some(w), self.eps)
    }

    /// `x + rms_norm(y, w)`, then times the layer scalar when `last` (the layer's output).
    pub fn residual(&self, x: &Array, y: &Array, w: &Array, last: bool) -> Result<Array> {
        let sum = x.add(&self.norm(y, w)?)?;
        Ok(if last {
            sum.multiply(&self.layer_scalar)?
        } else {
            sum
        })
    }

    /// The feed-forward block with the MoE branch (`x` after attention, `act` the dense
    /// MLP's activation): the dense and routed outputs, each normed, summed, normed and added
    /// to `x` (times the layer scalar when `last`).
    pub fn moe_feed_forward(
        &self,
        moe: &MoeBranch,
        x: &Array,
        act: &Array,
        last: bool,
    ) -> Result<Array> {
        let dense = self.norm(&self.mlp.down_proj().forward(act)?, &moe.post_norm_dense)?;
        let routed = moe.experts.forward(x, &self.norm(x, &moe.pre_norm)?)?;
        let ff = dense.add(&self.norm(&routed, &moe.post_norm_experts)?)?;
        self.residual(x, &ff, &self.post_feedforward_norm, last)
    }

    /// `gelu_tanh(input_gate(x)) * per_layer[:, index]`, the per-layer input's gate.
    pub fn per_layer_gate(&self, gate: &PleGate, x: &Array, per_layer: &Array) -> Result<Array> {
        let input = per_layer.index((.., self.index as i32, ..));
        gated_gelu(&gate.input_gate.forward(x)?, &input)
    }

    /// Runs the layer on `x` (`[T, H]`). `per_layer` is the per-layer embeddings of every
    /// layer (`[T, layers, P]`). Returns the new hidden state and, for KV-owning layers, the
    /// K/V view sharers of this layer read.
    pub fn forward(
        &self,
        x: &Array,
        offset: usize,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
        per_layer: Option<&Array>,
    ) -> Result<(Array, Option<KvView>)> {
        let (attended, view) =
            self.attention
                .forward(x, &self.input_norm, offset, cache, shared, self.window)?;
        let x = self.residual(
            x,
            &self.attention.o_proj().forward(&attended)?,
            &self.post_attention_norm,
            false,
        )?;

        let gated = self.ple.as_ref().zip(per_layer);
        let act = self
            .mlp
            .activation(&x, &self.pre_feedforward_norm, self.eps)?;
        let x = match &self.moe {
            None => self.residual(
                &x,
                &self.mlp.down_proj().forward(&act)?,
                &self.post_feedforward_norm,
                gated.is_none(),
            )?,
            Some(moe) => self.moe_feed_forward(moe, &x, &act, gated.is_none())?,
        };

        if let Some((gate, per_layer)) = gated {
            let g = self.per_layer_gate(gate, &x, per_layer)?;
            let out = self.residual(&x, &gate.projection.forward(&g)?, &gate.post_norm, true)?;
            return Ok((out, view));
        }
        Ok((x, view))
    }
}
