//! Gemma 4 text config: parsing both on-disk forms and deriving the per-layer plan.
//!
//! Released checkpoints nest the decoder config under `text_config` and write
//! `global_head_dim` / `num_global_key_value_heads` as plain keys; transformers 5.24 writes a
//! flat config with those folded into `per_layer_config`. Both are accepted. Defaults differ
//! between reference implementations, so keys a variant depends on are required, not guessed.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

/// The kind of attention a layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Local attention over the last `sliding_window` tokens.
    Sliding,
    /// Global causal attention.
    Full,
}

/// RoPE for one layer type.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeKind {
    /// Every pair rotates: inverse frequency `theta^(-2j/head_dim)`.
    Default { theta: f32 },
    /// Only the first `partial_factor * head_dim / 2` pairs rotate, at the frequencies of a full
    /// `head_dim` RoPE (divided by `factor`); the rest pass through.
    Proportional {
        theta: f32,
        partial_factor: f32,
        factor: f32,
    },
}

/// Affine quantization parameters of one module (mlx-community checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub group_size: i32,
    pub bits: i32,
}

/// The `quantization` block: a default plus per-module overrides (`false` = left in float).
#[derive(Debug, Clone, Default)]
pub struct QuantConfig {
    pub default: Option<QuantSpec>,
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl QuantConfig {
    /// Quantization parameters for the module at `path` (without `.weight`).
    pub fn for_module(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(spec) => *spec,
            None => self.default,
        }
    }
}

/// The decoder config with everything derived that the forward pass needs.
#[derive(Debug, Clone)]
pub struct Gemma4Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub sliding_window: usize,
    pub final_logit_softcapping: Option<f32>,
    /// PLE width P (0 = no per-layer embeddings).
    pub per_layer_input_size: usize,
    pub per_layer_vocab_size: usize,
    pub moe: Option<MoeConfig>,
    pub tie_word_embeddings: bool,
    pub layers: Vec<LayerPlan>,
    pub rope_sliding: RopeKind,
    pub rope_full: RopeKind,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub quantization: QuantConfig,
    /// Dtype the checkpoint declares (`dtype` / `torch_dtype`), if any.
    pub declared_dtype: Option<String>,
    /// The config as read, for drafters that check their pairing against fields not listed
    /// here.
    pub raw: Value,
}

/// Mixture-of-experts block sizes (26B-A4B style).
#[derive(Debug, Clone, Copy)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate_size: usize,
}

/// Everything about one decoder layer that follows from the config.
#[derive(Debug, Clone)]
pub struct LayerPlan {
    pub kind: AttentionKind,
    pub head_dim: usize,
    pub num_kv_heads: usize,
    /// Full layers with `attention_k_eq_v`: V is the k_proj output (no v_proj).
    pub k_eq_v: bool,
    /// The layer whose K/V this layer attends over: itself for a KV-owning layer, the last
    /// earlier owner of the same kind for a KV-sharing layer.
    pub kv_source: usize,
    pub mlp_width: usize,
}

impl LayerPlan {
    /// Whether this layer computes and caches its own K/V.
    pub fn owns_kv(&self, index: usize) -> bool {
        self.kv_source == index
    }
}

#[derive(Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    factor: Option<f64>,
}

fn get<'a>(t: &'a Value, key: &str) -> Option<&'a Value> {
    t.get(key).filter(|v| !v.is_null())
}

fn req_usize(t: &Value, key: &str) -> Result<usize> {
    let v = get(t, key).with_context(|| format!("missing required key `{key}`"))?;
    v.as_u64()
        .map(|n| n as usize)
        .with_context(|| format!("key `{key}` must be a non-negative integer, found {v}"))
}

fn opt_usize(t: &Value, key: &str) -> Result<Option<usize>> {
    match get(t, key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .with_context(|| format!("key `{key}` must be a non-negative integer, found {v}")),
    }
}

fn opt_bool(t: &Value, key: &str) -> Result<bool> {
    match get(t, key) {
        None => Ok(false),
        Some(v) => v
            .as_bool()
            .with_context(|| format!("key `{key}` must be true or false, found {v}")),
    }
}

/// Token ids given as a number or a list of numbers.
fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    }
}

fn parse_rope(t: &Value, key: &str) -> Result<RopeKind> {
    let params = get(t, "rope_parameters").context("missing required key `rope_parameters`")?;
    let entry =
        get(params, key).with_context(|| format!("`rope_parameters` has no `{key}` entry"))?;
    let raw: RawRope = serde_json::from_value(entry.clone())
        .with_context(|| format!("`rope_parameters.{key}` is malformed"))?;
    let theta = raw
        .rope_theta
        .with_context(|| format!("`rope_parameters.{key}.rope_theta` is missing"))?
        as f32;
    match raw.rope_type.as_deref().unwrap_or("default") {
        "default" => Ok(RopeKind::Default { theta }),
        "proportional" => Ok(RopeKind::Proportional {
            theta,
            partial_factor: raw.partial_rotary_factor.unwrap_or(1.0) as f32,
            factor: raw.factor.unwrap_or(1.0) as f32,
        }),
        other => bail!("`rope_parameters.{key}.rope_type` = {other:?} is not supported (expected default or proportional)"),
    }
}

fn parse_quant_spec(v: &Value, what: &str) -> Result<Option<QuantSpec>> {
    match v {
        Value::Bool(false) => Ok(None),
        Value::Object(o) => {
            if let Some(mode) = o.get("mode").and_then(Value::as_str) {
                if mode != "affine" {
                    bail!("{what}: quantization mode {mode:?} is not supported (only affine)");
                }
            }
            let group_size = o.get("group_size").and_then(Value::as_i64).unwrap_or(64) as i32;
            let bits =
                o.get("bits")
                    .and_then(Value::as_i64)
                    .with_context(|| format!("{what}: `bits` is missing"))? as i32;
            if ![2, 3, 4, 5, 6, 8].contains(&bits) {
                bail!("{what}: {bits}-bit quantization is not supported");
            }
            if ![32, 64, 128].contains(&group_size) {
                bail!("{what}: group size {group_size} is not supported (32, 64 or 128)");
            }
            Ok(Some(QuantSpec { group_size, bits }))
        }
        other => bail!("{what}: expected an object or false, found {other}"),
    }
}

fn parse_quantization(outer: &Value) -> Result<QuantConfig> {
    let Some(q) = get(outer, "quantization").or_else(|| get(outer, "quantization_config")) else {
        return Ok(QuantConfig::default());
    };
    let obj = q.as_object().context("`quantization` must be an object")?;
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

impl Gemma4Config {
    /// Reads `config.json` in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("config.json"))
    }

    /// Reads a config file (`config.json` or one of `configs/`).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let raw: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&raw).with_context(|| format!("invalid config {}", path.display()))
    }

    /// Parses a config (flat text config or a multimodal one with `text_config`).
    pub fn from_json(outer: &Value) -> Result<Self> {
        let t = get(outer, "text_config").unwrap_or(outer);
        let model_type = get(t, "model_type").and_then(Value::as_str).unwrap_or("");
        const KNOWN: [&str; 4] = [
            "gemma4_text",
            "gemma4",
            "gemma4_unified_text",
            "gemma4_unified",
        ];
        if !KNOWN.contains(&model_type) {
            bail!(
                "model_type {model_type:?} is not supported: mlx-spec runs Gemma 4 text decoders ({})",
                KNOWN.join(", ")
            );
        }

        let hidden_size = req_usize(t, "hidden_size")?;
        let num_layers = req_usize(t, "num_hidden_layers")?;
        let num_heads = req_usize(t, "num_attention_heads")?;
        let num_kv_heads = req_usize(t, "num_key_value_heads")?;
        let head_dim = req_usize(t, "head_dim")?;
        let vocab_size = req_usize(t, "vocab_size")?;
        let intermediate_size = req_usize(t, "intermediate_size")?;
        let sliding_window = req_usize(t, "sliding_window")?;
        if hidden_size == 0
            || num_layers == 0
            || num_heads == 0
            || num_kv_heads == 0
            || head_dim == 0
        {
            bail!("hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads and head_dim must be positive");
        }
        let rms_norm_eps = get(t, "rms_norm_eps")
            .and_then(Value::as_f64)
            .unwrap_or(1e-6) as f32;

        let layer_types: Vec<String> = match get(t, "layer_types") {
            Some(v) => serde_json::from_value(v.clone())
                .context("`layer_types` must be a list of strings")?,
            None => bail!("missing required key `layer_types`"),
        };
        if layer_types.len() != num_layers {
            bail!(
                "`layer_types` has {} entries but num_hidden_layers is {num_layers}",
                layer_types.len()
            );
        }
        let kinds = layer_types
            .iter()
            .enumerate()
            .map(|(i, s)| match s.as_str() {
                "sliding_attention" => Ok(AttentionKind::Sliding),
                "full_attention" => Ok(AttentionKind::Full),
                other => bail!(
                    "`layer_types[{i}]` = {other:?} (expected sliding_attention or full_attention)"
                ),
            })
            .collect::<Result<Vec<_>>>()?;

        // Full-layer head dim and KV heads: released form first, then transformers' per_layer_config.
        let per_layer: BTreeMap<String, Value> = match get(t, "per_layer_config") {
            Some(v) => {
                serde_json::from_value(v.clone()).context("`per_layer_config` must be an object")?
            }
            None => BTreeMap::new(),
        };
        let first_full_entry = kinds
            .iter()
            .position(|k| *k == AttentionKind::Full)
            .and_then(|i| per_layer.get(&i.to_string()));
        let global_head_dim = match opt_usize(t, "global_head_dim")? {
            Some(d) if d > 0 => d,
            _ => match first_full_entry
                .and_then(|e| e.get("head_dim"))
                .and_then(Value::as_u64)
            {
                Some(d) => d as usize,
                None => head_dim,
            },
        };
        let k_eq_v = opt_bool(t, "attention_k_eq_v")?;
        let global_kv_heads = match opt_usize(t, "num_global_key_value_heads")? {
            Some(n) => Some(n),
            None => first_full_entry
                .and_then(|e| e.get("num_key_value_heads"))
                .and_then(Value::as_u64)
                .map(|n| n as usize),
        };

        let per_layer_input_size = opt_usize(t, "hidden_size_per_layer_input")?.unwrap_or(0);
        let per_layer_vocab_size = if per_layer_input_size > 0 {
            req_usize(t, "vocab_size_per_layer_input")?
        } else {
            0
        };
        let num_kv_shared = opt_usize(t, "num_kv_shared_layers")?.unwrap_or(0);
        if num_kv_shared >= num_layers {
            bail!("num_kv_shared_layers ({num_kv_shared}) must be smaller than num_hidden_layers ({num_layers})");
        }
        let double_wide = opt_bool(t, "use_double_wide_mlp")?;

        let moe = if opt_bool(t, "enable_moe_block")? {
            let m = MoeConfig {
                num_experts: req_usize(t, "num_experts")?,
                top_k: req_usize(t, "top_k_experts")?,
                expert_intermediate_size: req_usize(t, "moe_intermediate_size")?,
            };
            if m.top_k == 0 || m.top_k > m.num_experts {
                bail!(
                    "top_k_experts ({}) must be between 1 and num_experts ({})",
                    m.top_k,
                    m.num_experts
                );
            }
            Some(m)
        } else {
            None
        };

        // KV sharing: layers at or past `first_shared` reuse the last earlier owner of their kind.
        let first_shared = num_layers - num_kv_shared;
        let mut layers = Vec::with_capacity(num_layers);
        for (i, &kind) in kinds.iter().enumerate() {
            let full = kind == AttentionKind::Full;
            let layer_k_eq_v = k_eq_v && full;
            let kv_source = if i < first_shared {
                i
            } else {
                (0..first_shared)
                    .rev()
                    .find(|&j| kinds[j] == kind)
                    .with_context(|| format!("layer {i} shares KV but no earlier layer of its kind ({kind:?}) owns any"))?
            };
            let mlp_width = if double_wide && i >= first_shared && num_kv_shared > 0 {
                2 * intermediate_size
            } else {
                intermediate_size
            };
            let num_kv = match (layer_k_eq_v, global_kv_heads) {
                (true, Some(n)) => n,
                _ => num_kv_heads,
            };
            if num_kv == 0 || num_heads % num_kv != 0 {
                bail!("layer {i}: num_attention_heads ({num_heads}) is not a multiple of its KV heads ({num_kv})");
            }
            layers.push(LayerPlan {
                kind,
                head_dim: if full { global_head_dim } else { head_dim },
                num_kv_heads: num_kv,
                k_eq_v: layer_k_eq_v,
                kv_source,
                mlp_width,
            });
        }

        let mut eos_token_ids = token_ids(get(outer, "eos_token_id"));
        for id in token_ids(get(t, "eos_token_id")) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let first_id = |key: &str| {
            token_ids(get(outer, key))
                .first()
                .copied()
                .or_else(|| token_ids(get(t, key)).first().copied())
        };

        Ok(Self {
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            intermediate_size,
            rms_norm_eps,
            sliding_window,
            final_logit_softcapping: get(t, "final_logit_softcapping")
                .and_then(Value::as_f64)
                .map(|v| v as f32),
            per_layer_input_size,
            per_layer_vocab_size,
            moe,
            tie_word_embeddings: get(t, "tie_word_embeddings")
                .or_else(|| get(outer, "tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(true),
            layers,
            rope_sliding: parse_rope(t, "sliding_attention")?,
            rope_full: parse_rope(t, "full_attention")?,
            eos_token_ids,
            bos_token_id: first_id("bos_token_id"),
            pad_token_id: first_id("pad_token_id"),
            quantization: parse_quantization(outer)?,
            declared_dtype: get(t, "dtype")
                .or_else(|| get(t, "torch_dtype"))
                .or_else(|| get(outer, "torch_dtype"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            raw: outer.clone(),
        })
    }

    /// RoPE settings of a layer kind.
    pub fn rope(&self, kind: AttentionKind) -> &RopeKind {
        match kind {
            AttentionKind::Sliding => &self.rope_sliding,
            AttentionKind::Full => &self.rope_full,
        }
    }

    /// Index of the last KV-owning layer of each kind: the K/V that drafters borrow.
    pub fn last_kv_owner(&self, kind: AttentionKind) -> Option<usize> {
        (0..self.num_layers)
            .rev()
            .find(|&i| self.layers[i].kind == kind && self.layers[i].owns_kv(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> Value {
        json!({
            "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "global_head_dim": 32, "vocab_size": 256, "intermediate_size": 96,
            "sliding_window": 4, "num_kv_shared_layers": 3, "use_double_wide_mlp": true,
            "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                            "sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}
            },
            "eos_token_id": 1
        })
    }

    #[test]
    fn kv_sharing_map_and_double_wide_mlp() {
        let c = Gemma4Config::from_json(&tiny()).unwrap();
        let sources: Vec<usize> = c.layers.iter().map(|l| l.kv_source).collect();
        assert_eq!(sources, [0, 1, 2, 1, 1, 2]);
        let widths: Vec<usize> = c.layers.iter().map(|l| l.mlp_width).collect();
        assert_eq!(widths, [96, 96, 96, 192, 192, 192]);
        assert_eq!(c.layers[2].head_dim, 32);
        assert_eq!(c.layers[1].head_dim, 16);
        assert_eq!(c.last_kv_owner(AttentionKind::Sliding), Some(1));
        assert_eq!(c.last_kv_owner(AttentionKind::Full), Some(2));
    }

    #[test]
    fn nested_text_config_and_per_layer_config_form() {
        let mut t = tiny();
        t.as_object_mut().unwrap().remove("global_head_dim");
        t["per_layer_config"] = json!({"2": {"head_dim": 32, "num_key_value_heads": 1}});
        t["attention_k_eq_v"] = json!(true);
        let outer = json!({"model_type": "gemma4", "text_config": t, "eos_token_id": [1, 106]});
        let c = Gemma4Config::from_json(&outer).unwrap();
        assert_eq!(c.layers[2].head_dim, 32);
        assert_eq!(c.layers[2].num_kv_heads, 1);
        assert!(c.layers[2].k_eq_v);
        assert!(!c.layers[1].k_eq_v);
        assert_eq!(c.layers[1].num_kv_heads, 2);
        assert_eq!(c.eos_token_ids, [1, 106]);
    }

    #[test]
    fn rejects_unknown_model_type_and_missing_keys() {
        let mut t = tiny();
        t["model_type"] = json!("llama");
        let err = Gemma4Config::from_json(&t).unwrap_err().to_string();
        assert!(err.contains("llama"), "{err}");
        let mut t = tiny();
        t.as_object_mut().unwrap().remove("hidden_size");
        let err = Gemma4Config::from_json(&t).unwrap_err().to_string();
        assert!(err.contains("hidden_size"), "{err}");
    }

    #[test]
    fn quantization_overrides() {
        let mut t = tiny();
        t["quantization"] = json!({"group_size": 32, "bits": 4, "mode": "affine",
            "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 8},
            "model.layers.0.router.proj": false});
        let c = Gemma4Config::from_json(&t).unwrap();
        let q = &c.quantization;
        assert_eq!(
            q.for_module("model.layers.0.mlp.up_proj"),
            Some(QuantSpec {
                group_size: 32,
                bits: 4
            })
        );
        assert_eq!(
            q.for_module("model.layers.1.mlp.down_proj"),
            Some(QuantSpec {
                group_size: 64,
                bits: 8
            })
        );
        assert_eq!(q.for_module("model.layers.0.router.proj"), None);
    }
}
