//! The assistant checkpoint's `config.json`: the released flat form of
//! `Gemma4AssistantForCausalLM` (`model_type: gemma4_assistant`, text config `gemma4_text`)
//! and of the 12B's `gemma4_unified_assistant` (text config `gemma4_unified_text`), which
//! only renames.
//!
//! Sizes that shape tensors are read here once; the architecture rules transformers enforces
//! for this class (no per-layer inputs, no MoE, every layer a K/V reader) are checked, since a
//! checkpoint breaking them is not one this forward computes.

use std::collections::BTreeMap;

use serde_json::Value;

/// Attention kind of one drafter layer (each reads the target's donor of the same kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sliding,
    Full,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Sliding => "sliding_attention",
            Kind::Full => "full_attention",
        }
    }
}

/// RoPE of one layer kind (it must equal the target's: the donor keys were rotated by it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeKind {
    /// Every rotate-half pair `j` turns with period `theta^(2j/d)`.
    Default { theta: f32 },
    /// The first `floor(partial * d) / 2` pairs turn with period `factor * theta^(2j/d)`
    /// (denominator the whole head), the others not at all.
    Proportional {
        theta: f32,
        partial_factor: f32,
        factor: f32,
    },
}

/// Group size and bits of an affine-quantized matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub group_size: i32,
    pub bits: i32,
}

/// The config's `quantization` block: a default plus per-module overrides (`false`: left in
/// float).
#[derive(Debug, Clone, Default)]
pub struct QuantConfig {
    pub default: Option<QuantSpec>,
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl QuantConfig {
    /// Parameters for the module at `path` (its name without `.weight`).
    pub fn for_module(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(spec) => *spec,
            None => self.default,
        }
    }
}

/// Everything the forward needs from `config.json`.
#[derive(Debug, Clone)]
pub struct AssistantConfig {
    /// The target's hidden size H_b (sizes the input and output projections).
    pub backbone_hidden_size: usize,
    /// The drafter's own width d.
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_heads: usize,
    pub layer_kinds: Vec<Kind>,
    pub sliding_head_dim: usize,
    pub full_head_dim: usize,
    pub sliding_kv_heads: usize,
    pub full_kv_heads: usize,
    pub sliding_window: usize,
    pub rope_sliding: RopeKind,
    pub rope_full: RopeKind,
    pub rms_norm_eps: f32,
    /// `use_ordered_embeddings` as declared (the loader decides by the tensors' presence).
    pub declares_centroid_head: bool,
    pub num_centroids: usize,
    pub centroid_top_k: usize,
    pub quantization: QuantConfig,
    /// `dtype` / `torch_dtype`, if declared.
    pub declared_dtype: Option<String>,
}

impl AssistantConfig {
    pub fn head_dim(&self, kind: Kind) -> usize {
        match kind {
            Kind::Sliding => self.sliding_head_dim,
            Kind::Full => self.full_head_dim,
        }
    }

    pub fn kv_heads(&self, kind: Kind) -> usize {
        match kind {
            Kind::Sliding => self.sliding_kv_heads,
            Kind::Full => self.full_kv_heads,
        }
    }

    pub fn rope(&self, kind: Kind) -> RopeKind {
        match kind {
            Kind::Sliding => self.rope_sliding,
            Kind::Full => self.rope_full,
        }
    }

    pub fn uses(&self, kind: Kind) -> bool {
        self.layer_kinds.contains(&kind)
    }

    /// Reads `config.json` text; `origin` names the file in messages.
    pub fn parse(text: &str, origin: &str) -> Result<Self, String> {
        let outer: Value =
            serde_json::from_str(text).map_err(|e| format!("{origin} is not valid JSON: {e}"))?;
        let err = |msg: String| format!("{origin}: {msg}");
        let model_type = outer
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !matches!(model_type, "gemma4_assistant" | "gemma4_unified_assistant") {
            return Err(err(format!(
                "model_type {model_type:?} is not a Gemma 4 assistant (expected gemma4_assistant or gemma4_unified_assistant)"
            )));
        }
        let text_cfg = outer
            .get("text_config")
            .filter(|v| v.is_object())
            .ok_or_else(|| err("`text_config` is missing".into()))?;
        let usize_in = |v: &Value, key: &str| -> Result<usize, String> {
            v.get(key)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| err(format!("`{key}` is missing or not a non-negative integer")))
        };
        let opt_usize =
            |v: &Value, key: &str| v.get(key).and_then(Value::as_u64).map(|x| x as usize);
        let flag = |v: &Value, key: &str| v.get(key).and_then(Value::as_bool).unwrap_or(false);

        // The rules transformers' config class enforces for an assistant.
        if opt_usize(text_cfg, "hidden_size_per_layer_input").unwrap_or(0) != 0 {
            return Err(err(
                "an assistant has no per-layer inputs (`hidden_size_per_layer_input` must be 0)"
                    .into(),
            ));
        }
        for key in ["enable_moe_block", "use_double_wide_mlp"] {
            if flag(text_cfg, key) {
                return Err(err(format!("an assistant does not support `{key}: true`")));
            }
        }
        let num_layers = usize_in(text_cfg, "num_hidden_layers")?;
        if let Some(shared) = opt_usize(text_cfg, "num_kv_shared_layers") {
            if shared != num_layers {
                return Err(err(format!(
                    "every assistant layer reads the target's K/V: `num_kv_shared_layers` ({shared}) must equal `num_hidden_layers` ({num_layers})"
                )));
            }
        }
        let activation = text_cfg
            .get("hidden_activation")
            .and_then(Value::as_str)
            .unwrap_or("gelu_pytorch_tanh");
        if activation != "gelu_pytorch_tanh" {
            return Err(err(format!(
                "hidden_activation {activation:?} is not supported (gelu_pytorch_tanh)"
            )));
        }

        let layer_types = text_cfg
            .get("layer_types")
            .and_then(Value::as_array)
            .ok_or_else(|| err("`text_config.layer_types` is missing".into()))?;
        let layer_kinds = layer_types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(Kind::Sliding),
                Some("full_attention") => Ok(Kind::Full),
                other => Err(err(format!("unknown layer type {other:?}"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if layer_kinds.len() != num_layers {
            return Err(err(format!(
                "`layer_types` has {} entries for {num_layers} layers",
                layer_kinds.len()
            )));
        }

        let num_heads = usize_in(text_cfg, "num_attention_heads")?;
        let sliding_head_dim = usize_in(text_cfg, "head_dim")?;
        let full_head_dim = opt_usize(text_cfg, "global_head_dim").unwrap_or(sliding_head_dim);
        let sliding_kv_heads = usize_in(text_cfg, "num_key_value_heads")?;
        // K=V full layers (12B/26B/31B) have their own kv head count.
        let full_kv_heads = if flag(text_cfg, "attention_k_eq_v") {
            opt_usize(text_cfg, "num_global_key_value_heads").unwrap_or(sliding_kv_heads)
        } else {
            sliding_kv_heads
        };
        for (what, kv) in [("sliding", sliding_kv_heads), ("full", full_kv_heads)] {
            if kv == 0 || num_heads % kv != 0 {
                return Err(err(format!(
                    "{num_heads} attention heads do not split over {kv} {what} kv heads"
                )));
            }
        }
        for (what, hd) in [
            ("head_dim", sliding_head_dim),
            ("global_head_dim", full_head_dim),
        ] {
            if hd == 0 || hd % 2 != 0 {
                return Err(err(format!("`{what}` must be even and positive, got {hd}")));
            }
        }

        let rope = text_cfg.get("rope_parameters");
        let rope_of = |kind: Kind| -> Result<RopeKind, String> {
            let p = rope
                .and_then(|r| r.get(kind.name()))
                .ok_or_else(|| err(format!("`rope_parameters.{}` is missing", kind.name())))?;
            parse_rope(p).map_err(|m| err(format!("rope_parameters.{}: {m}", kind.name())))
        };

        let quantization = parse_quantization(&outer).map_err(err)?;
        let declared_dtype = outer
            .get("dtype")
            .or_else(|| outer.get("torch_dtype"))
            .or_else(|| text_cfg.get("dtype"))
            .and_then(Value::as_str)
            .map(str::to_owned);

        let cfg = AssistantConfig {
            backbone_hidden_size: usize_in(&outer, "backbone_hidden_size")?,
            hidden_size: usize_in(text_cfg, "hidden_size")?,
            intermediate_size: usize_in(text_cfg, "intermediate_size")?,
            vocab_size: usize_in(text_cfg, "vocab_size")?,
            num_heads,
            rope_sliding: if layer_kinds.contains(&Kind::Sliding) {
                rope_of(Kind::Sliding)?
            } else {
                RopeKind::Default { theta: 10_000.0 }
            },
            rope_full: if layer_kinds.contains(&Kind::Full) {
                rope_of(Kind::Full)?
            } else {
                RopeKind::Default { theta: 10_000.0 }
            },
            layer_kinds,
            sliding_head_dim,
            full_head_dim,
            sliding_kv_heads,
            full_kv_heads,
            sliding_window: usize_in(text_cfg, "sliding_window")?,
            rms_norm_eps: text_cfg
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6) as f32,
            declares_centroid_head: flag(&outer, "use_ordered_embeddings"),
            num_centroids: opt_usize(&outer, "num_centroids").unwrap_or(2048),
            centroid_top_k: opt_usize(&outer, "centroid_intermediate_top_k").unwrap_or(32),
            quantization,
            declared_dtype,
        };
        if cfg.hidden_size == 0 || cfg.vocab_size == 0 || cfg.backbone_hidden_size == 0 {
            return Err(err("hidden sizes and vocabulary must be positive".into()));
        }
        Ok(cfg)
    }
}

fn parse_rope(p: &Value) -> Result<RopeKind, String> {
    let theta = p
        .get("rope_theta")
        .and_then(Value::as_f64)
        .ok_or("`rope_theta` is missing")? as f32;
    match p
        .get("rope_type")
        .and_then(Value::as_str)
        .unwrap_or("default")
    {
        "default" => Ok(RopeKind::Default { theta }),
        "proportional" => Ok(RopeKind::Proportional {
            theta,
            partial_factor: p
                .get("partial_rotary_factor")
                .and_then(Value::as_f64)
                .unwrap_or(1.0) as f32,
            factor: p.get("factor").and_then(Value::as_f64).unwrap_or(1.0) as f32,
        }),
        other => Err(format!("rope_type {other:?} is not supported")),
    }
}

fn parse_quant_spec(v: &Value, what: &str) -> Result<Option<QuantSpec>, String> {
    match v {
        Value::Bool(false) => Ok(None),
        Value::Object(o) => {
            if let Some(mode) = o.get("mode").and_then(Value::as_str) {
                if mode != "affine" {
                    return Err(format!(
                        "{what}: quantization mode {mode:?} is not supported (only affine)"
                    ));
                }
            }
            let group_size = o.get("group_size").and_then(Value::as_i64).unwrap_or(64) as i32;
            let bits = o
                .get("bits")
                .and_then(Value::as_i64)
                .ok_or_else(|| format!("{what}: `bits` is missing"))? as i32;
            if ![2, 3, 4, 5, 6, 8].contains(&bits) {
                return Err(format!("{what}: {bits}-bit quantization is not supported"));
            }
            if ![32, 64, 128].contains(&group_size) {
                return Err(format!(
                    "{what}: group size {group_size} is not supported (32, 64 or 128)"
                ));
            }
            Ok(Some(QuantSpec { group_size, bits }))
        }
        other => Err(format!(
            "{what}: expected an object or false, found {other}"
        )),
    }
}

/// mlx-community writes `quantization` (older converters `quantization_config`): the default
/// group size and bits, plus per-module entries keyed by the module's path.
fn parse_quantization(outer: &Value) -> Result<QuantConfig, String> {
    let Some(q) = outer
        .get("quantization")
        .or_else(|| outer.get("quantization_config"))
    else {
        return Ok(QuantConfig::default());
    };
    let obj = q.as_object().ok_or("`quantization` must be an object")?;
    let mut cfg = QuantConfig {
        default: parse_quant_spec(q, "`quantization`")?,
        ..Default::default()
    };
    for (key, value) in obj {
        if value.is_object() || value.is_boolean() {
            let spec = parse_quant_spec(value, &format!("`quantization.{key}`"))?;
            cfg.overrides.insert(key.clone(), spec);
        }
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "model_type": "gemma4_assistant",
            "backbone_hidden_size": 64,
            "use_ordered_embeddings": true,
            "num_centroids": 16,
            "centroid_intermediate_top_k": 4,
            "text_config": {
                "hidden_size": 32, "intermediate_size": 48, "vocab_size": 256,
                "num_hidden_layers": 2, "num_kv_shared_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"],
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "attention_k_eq_v": true, "num_global_key_value_heads": 1,
                "head_dim": 16, "global_head_dim": 32, "sliding_window": 4,
                "rope_parameters": {
                    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                    "full_attention": {"rope_theta": 1000000.0, "rope_type": "proportional",
                                       "partial_rotary_factor": 0.25}
                }
            }
        })
    }

    #[test]
    fn reads_the_released_flat_form() {
        let c = AssistantConfig::parse(&base().to_string(), "config.json").unwrap();
        assert_eq!(c.layer_kinds, vec![Kind::Sliding, Kind::Full]);
        assert_eq!((c.sliding_kv_heads, c.full_kv_heads), (2, 1));
        assert_eq!(
            (c.head_dim(Kind::Sliding), c.head_dim(Kind::Full)),
            (16, 32)
        );
        assert_eq!(
            c.rope_full,
            RopeKind::Proportional {
                theta: 1e6,
                partial_factor: 0.25,
                factor: 1.0
            }
        );
        assert!(c.declares_centroid_head);
        assert!(c.quantization.default.is_none());
    }

    /// The 12B's class only renames; older converters write `quantization_config`.
    #[test]
    fn reads_the_unified_class_and_quantization_config() {
        let mut v = base();
        v["model_type"] = Value::from("gemma4_unified_assistant");
        v["text_config"]["model_type"] = Value::from("gemma4_unified_text");
        v["quantization_config"] = serde_json::json!({"group_size": 64, "bits": 4});
        let c = AssistantConfig::parse(&v.to_string(), "config.json").unwrap();
        assert_eq!(
            c.quantization.default,
            Some(QuantSpec {
                group_size: 64,
                bits: 4
            })
        );
        assert_eq!(c.backbone_hidden_size, 64);
    }

    #[test]
    fn refuses_what_this_forward_does_not_compute() {
        let cases: [(&str, Value, &str); 5] = [
            (
                "model_type",
                Value::from("gemma4_text"),
                "not a Gemma 4 assistant",
            ),
            (
                "text_config.num_kv_shared_layers",
                Value::from(1),
                "num_kv_shared_layers",
            ),
            (
                "text_config.use_double_wide_mlp",
                Value::from(true),
                "use_double_wide_mlp",
            ),
            (
                "text_config.num_key_value_heads",
                Value::from(3),
                "do not split",
            ),
            (
                "text_config.layer_types",
                serde_json::json!(["sliding_attention"]),
                "entries",
            ),
        ];
        for (path, value, want) in cases {
            let mut v = base();
            let mut slot = &mut v;
            let parts: Vec<&str> = path.split('.').collect();
            for p in &parts[..parts.len() - 1] {
                slot = slot.get_mut(*p).unwrap();
            }
            slot[parts[parts.len() - 1]] = value;
            let e = AssistantConfig::parse(&v.to_string(), "config.json").unwrap_err();
            assert!(e.contains(want), "{path}: {e}");
            assert!(e.starts_with("config.json"), "{e}");
        }
    }

    #[test]
    fn quantization_default_and_overrides() {
        let mut v = base();
        v["quantization"] = serde_json::json!({
            "group_size": 32, "bits": 4,
            "model.layers.0.mlp.down_proj": false,
            "pre_projection": {"group_size": 64, "bits": 8}
        });
        let c = AssistantConfig::parse(&v.to_string(), "config.json").unwrap();
        let q = &c.quantization;
        assert_eq!(
            q.for_module("model.layers.0.self_attn.q_proj"),
            Some(QuantSpec {
                group_size: 32,
                bits: 4
            })
        );
        assert_eq!(q.for_module("model.layers.0.mlp.down_proj"), None);
        assert_eq!(
            q.for_module("pre_projection"),
            Some(QuantSpec {
                group_size: 64,
                bits: 8
            })
        );
        v["quantization"] = serde_json::json!({"group_size": 48, "bits": 4});
        let e = AssistantConfig::parse(&v.to_string(), "config.json").unwrap_err();
        assert!(e.contains("group size 48"), "{e}");
    }
}
