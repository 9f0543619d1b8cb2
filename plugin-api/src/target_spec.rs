//! The target's description, as the host writes it for [`crate::abi::TargetPort::describe`]
//! and a drafter reads it through [`crate::Target::spec`].
//!
//! It crosses the boundary as JSON so that it can grow: fields added later carry defaults, and
//! a drafter built against an older SDK ignores what it does not know.

use serde::{Deserialize, Serialize};

/// The kind of one target layer's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Local attention over the last `sliding_window` positions (`sliding_attention`).
    SlidingAttention,
    /// Global causal attention (`full_attention`).
    FullAttention,
}

/// RoPE of one layer kind, as the target applies it to queries and keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeSpec {
    /// Every rotate-half pair `(j, j + d/2)` turns at inverse frequency `theta^(-2j/d)`.
    Default { theta: f32 },
    /// Only the first `floor(partial_rotary_factor * d) / 2` pairs turn, at the frequencies of
    /// a full-width RoPE divided by `factor`; the other pairs pass through unchanged.
    Proportional {
        theta: f32,
        partial_rotary_factor: f32,
        factor: f32,
    },
}

/// Attention facts of one layer kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    pub head_dim: usize,
    pub num_kv_heads: usize,
    /// Values are made from the key projection (no `v_proj`).
    pub k_eq_v: bool,
    pub rope: RopeSpec,
}

/// The last KV-owning layer of each kind: the K/V a drafter borrows by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DonorLayers {
    pub sliding: Option<usize>,
    pub full: Option<usize>,
}

/// What a drafter may know about the target it serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetSpec {
    /// Model family, e.g. `gemma4`.
    pub family: String,
    /// Same value as [`crate::TargetInfo::fingerprint`].
    pub fingerprint: u64,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    /// One entry per layer.
    pub layer_types: Vec<LayerKind>,
    /// `kv_source[i]`: the layer whose K/V layer `i` attends over (`i` itself when it owns
    /// its K/V; an earlier layer when it shares, as E2B/E4B's last layers do).
    pub kv_source: Vec<usize>,
    pub sliding: AttentionSpec,
    pub full: AttentionSpec,
    pub sliding_window: usize,
    pub donor_layers: DonorLayers,
    pub rms_norm_eps: f32,
    /// `tanh(z / c) * c` on the logits, when set.
    pub final_logit_softcapping: Option<f32>,
    /// Multiplier of the embedding rows (`sqrt(hidden_size)`, rounded to the embedding's
    /// dtype as the target rounds it).
    pub embed_scale: f32,
    /// The activation dtype: `float32`, `bfloat16` or `float16`.
    pub dtype: String,
    /// Width of the per-layer embeddings (0: the target has none).
    #[serde(default)]
    pub per_layer_input_size: usize,
    /// The target's `config.json` as read, for anything not listed above.
    #[serde(default)]
    pub config: serde_json::Value,
}

impl TargetSpec {
    /// The tap point of the final-norm hidden state (the LM head's input).
    pub fn final_hidden_tap(&self) -> i32 {
        self.num_layers as i32
    }

    /// The MLX dtype of [`TargetSpec::dtype`], the dtype the target's activations (taps,
    /// embeddings) come in: a drafter computing in it needs no casts.
    pub fn activation_dtype(&self) -> Result<mlx_rs::Dtype, String> {
        match self.dtype.as_str() {
            "float32" => Ok(mlx_rs::Dtype::Float32),
            "bfloat16" => Ok(mlx_rs::Dtype::Bfloat16),
            "float16" => Ok(mlx_rs::Dtype::Float16),
            other => Err(format!(
                "the target describes its activation dtype as {other:?}; drafters know float32, bfloat16 and float16"
            )),
        }
    }

    /// Attention facts of a layer kind.
    pub fn attention(&self, kind: LayerKind) -> &AttentionSpec {
        match kind {
            LayerKind::SlidingAttention => &self.sliding,
            LayerKind::FullAttention => &self.full,
        }
    }
}
