//! The target capabilities the host lends a drafter during each call.
//!
//! Every port catches panics: a panic inside a port would unwind into abi_stable's shim and
//! end the process, so it becomes an error value the drafter sees (and the host then switches
//! the drafter off for the request, as for any drafter error).

use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::std_types::{RErr, ROk, RResult, RSlice, RString};
use mlx_rs::Dtype;
use mlx_spec_plugin_api::abi::{DonorKv, TargetInfo, TargetPort};
use mlx_spec_plugin_api::sdk::panic_text;
use mlx_spec_plugin_api::target_spec::{
    AttentionSpec, DonorLayers, LayerKind, RopeSpec, TargetSpec,
};
use mlx_spec_plugin_api::tensor::{Tensor, TensorRef};

use crate::model::gemma4::config::RopeKind;
use crate::model::gemma4::{AttentionKind, Gemma4Model, ModelCache};

/// A read-only view of the target at one point of a request.
pub struct HostTarget<'a> {
    pub model: &'a Gemma4Model,
    /// The request's KV state (absent where a call has none to lend, such as `open`).
    pub cache: Option<&'a ModelCache>,
    pub position: u64,
}

/// Runs a port's body, turning its error and any panic into an error value.
fn guarded<T>(what: &str, body: impl FnOnce() -> anyhow::Result<T>) -> RResult<T, RString> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => ROk(v),
        Ok(Err(e)) => RErr(RString::from(format!("{what}: {e:#}"))),
        Err(payload) => {
            let text = panic_text(&*payload);
            RErr(RString::from(format!("{what}: the host failed ({text})")))
        }
    }
}

impl TargetPort for HostTarget<'_> {
    fn position(&self) -> u64 {
        self.position
    }

    fn embed(&self, ids: RSlice<'_, u32>) -> RResult<Tensor, RString> {
        guarded("embed", || {
            Ok(Tensor::from_array(self.model.embed(ids.as_slice())?))
        })
    }

    fn logits_from_hidden(&self, hidden: TensorRef<'_>) -> RResult<Tensor, RString> {
        guarded("logits_from_hidden", || {
            let hidden = hidden.view();
            let width = *hidden.shape().last().unwrap_or(&0) as usize;
            if width != self.model.config.hidden_size {
                anyhow::bail!(
                    "hidden states of width {width} given, the target's are {}",
                    self.model.config.hidden_size
                );
            }
            Ok(Tensor::from_array(self.model.logits_from_hidden(&hidden)?))
        })
    }

    fn describe(&self) -> RResult<RString, RString> {
        guarded("describe", || {
            Ok(RString::from(serde_json::to_string(&target_spec(
                self.model,
            ))?))
        })
    }

    fn donor_kv(&self, layer: u32) -> RResult<DonorKv, RString> {
        guarded("donor_kv", || {
            let layer = layer as usize;
            let layers = self.model.config.num_layers;
            if layer >= layers {
                anyhow::bail!("layer {layer} does not exist (the target has {layers})");
            }
            let cache = self
                .cache
                .ok_or_else(|| anyhow::anyhow!("no K/V exists before the prompt is processed"))?;
            let kv = cache.layer(layer).ok_or_else(|| {
                anyhow::anyhow!(
                    "layer {layer} keeps no K/V of its own (it reads layer {}'s)",
                    self.model.config.layers[layer].kv_source
                )
            })?;
            let (keys, values, first) = kv
                .kept()
                .ok_or_else(|| anyhow::anyhow!("layer {layer} holds no K/V yet"))?;
            Ok(DonorKv {
                keys: Tensor::from_array(keys),
                values: Tensor::from_array(values),
                first_position: first as u64,
            })
        })
    }
}

/// FNV-1a over the shape-defining fields: equal for the same architecture and vocabulary.
fn fingerprint(model: &Gemma4Model) -> u64 {
    let c = &model.config;
    let fields = [
        c.vocab_size,
        c.hidden_size,
        c.num_layers,
        c.num_heads,
        c.intermediate_size,
        c.sliding_window,
    ];
    fields
        .iter()
        .flat_map(|f| (*f as u64).to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        })
}

/// What a drafter is told about the target when a request opens.
pub fn target_info(model: &Gemma4Model) -> TargetInfo {
    let c = &model.config;
    TargetInfo {
        family: "gemma4".into(),
        fingerprint: fingerprint(model),
        vocab_size: c.vocab_size as u32,
        hidden_size: c.hidden_size as u32,
        num_layers: c.num_layers as u32,
    }
}

fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
        _ => "float32",
    }
}

/// `value` rounded to `dtype`, as a scalar of that dtype holds it.
fn rounded(value: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Bfloat16 => half::bf16::from_f32(value).to_f32(),
        Dtype::Float16 => half::f16::from_f32(value).to_f32(),
        _ => value,
    }
}

/// The target's description for [`TargetPort::describe`].
pub fn target_spec(model: &Gemma4Model) -> TargetSpec {
    let c = &model.config;
    let attention = |kind: AttentionKind| {
        let plan = c.layers.iter().find(|l| l.kind == kind);
        AttentionSpec {
            head_dim: plan.map_or(0, |l| l.head_dim),
            num_kv_heads: plan.map_or(0, |l| l.num_kv_heads),
            k_eq_v: plan.is_some_and(|l| l.k_eq_v),
            rope: match c.rope(kind) {
                RopeKind::Default { theta } => RopeSpec::Default { theta: *theta },
                RopeKind::Proportional {
                    theta,
                    partial_factor,
                    factor,
                } => RopeSpec::Proportional {
                    theta: *theta,
                    partial_rotary_factor: *partial_factor,
                    factor: *factor,
                },
            },
        }
    };
    TargetSpec {
        family: "gemma4".to_owned(),
        fingerprint: fingerprint(model),
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        num_layers: c.num_layers,
        num_attention_heads: c.num_heads,
        layer_types: c
            .layers
            .iter()
            .map(|l| match l.kind {
                AttentionKind::Sliding => LayerKind::SlidingAttention,
                AttentionKind::Full => LayerKind::FullAttention,
            })
            .collect(),
        kv_source: c.layers.iter().map(|l| l.kv_source).collect(),
        sliding: attention(AttentionKind::Sliding),
        full: attention(AttentionKind::Full),
        sliding_window: c.sliding_window,
        donor_layers: DonorLayers {
            sliding: c.last_kv_owner(AttentionKind::Sliding),
            full: c.last_kv_owner(AttentionKind::Full),
        },
        rms_norm_eps: c.rms_norm_eps,
        final_logit_softcapping: c.final_logit_softcapping,
        embed_scale: rounded((c.hidden_size as f32).sqrt(), model.dtype),
        dtype: dtype_name(model.dtype).to_owned(),
        per_layer_input_size: c.per_layer_input_size,
        config: c.raw.clone(),
    }
}
