//! `config.json` of a z-lab DFlash drafter (`DFlashDraftModel`): a Qwen3 config with the
//! drafter's own keys (`block_size`, `num_target_layers`, `dflash_config`).
//!
//! Only the keys the forward reads are taken; what this plugin does not implement (another
//! RoPE, another activation, another attention scale) is refused by name rather than computed
//! wrongly.

use mlx_spec_plugin_api::quant::QuantConfig;
use serde_json::Value;

/// The MLP's gate activation (`hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu`, Qwen3's and every published DFlash drafter's.
    Silu,
    /// `gelu_pytorch_tanh`.
    GeluTanh,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DFlashConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    /// The target's layer count the drafter was trained against.
    pub num_target_layers: usize,
    /// Tapped target layers, in the order `fc` reads them (`-1`: the scaled embedding).
    pub target_layer_ids: Vec<i32>,
    /// B: the block is the anchor and B-1 masks; it drafts B-1 tokens.
    pub block_size: usize,
    pub mask_token_id: u32,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub attention_bias: bool,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// The scale of `q kᵀ` (`head_dim^-1/2`, as z-lab's attention hard-codes it).
    pub attention_scale: f32,
    pub activation: Activation,
    /// Per draft layer: `Some(w)` for `sliding_attention` (causal, each row sees the `w`
    /// positions ending at its own), `None` for `full_attention` (every context and block row).
    pub layer_windows: Vec<Option<usize>>,
    /// The `quantization` block (empty for a float checkpoint): which matrices are packed.
    pub quantization: QuantConfig,
}

fn usize_of(v: &Value, key: &str, whence: &str) -> Result<usize, String> {
    match v.get(key) {
        Some(x) => x
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| format!("{whence}: `{key}` must be a non-negative integer, got {x}")),
        None => Err(format!("{whence}: `{key}` is missing")),
    }
}

fn optional_usize(v: &Value, key: &str, whence: &str) -> Result<Option<usize>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => usize_of(v, key, whence).map(Some),
    }
}

fn f32_of(v: &Value, key: &str, whence: &str) -> Result<f32, String> {
    match v.get(key) {
        Some(x) => x
            .as_f64()
            .map(|n| n as f32)
            .ok_or_else(|| format!("{whence}: `{key}` must be a number, got {x}")),
        None => Err(format!("{whence}: `{key}` is missing")),
    }
}

fn bool_of(v: &Value, key: &str, default: bool, whence: &str) -> Result<bool, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| format!("{whence}: `{key}` must be true or false, got {x}")),
    }
}

/// z-lab's `build_target_layer_ids`: `n` taps spread evenly over target layers `1..=N-3`
/// (the middle layer for one draft layer). Python's `round` breaks ties to even.
pub fn default_target_layer_ids(num_target_layers: usize, num_draft_layers: usize) -> Vec<i32> {
    if num_draft_layers == 1 {
        return vec![(num_target_layers / 2) as i32];
    }
    let span = num_target_layers as f64 - 4.0;
    (0..num_draft_layers)
        .map(|i| (1.0 + i as f64 * span / (num_draft_layers - 1) as f64).round_ties_even() as i32)
        .collect()
}

/// RoPE's base frequency: transformers 5 keeps it in `rope_parameters`, 4.x at the top level
/// (with `rope_scaling` beside it). Only the plain rotation is implemented.
fn rope_theta(v: &Value, whence: &str) -> Result<f32, String> {
    let (params, key) = match v.get("rope_parameters") {
        Some(p) if !p.is_null() => (p, "rope_parameters"),
        _ => match v.get("rope_scaling") {
            Some(s) if !s.is_null() => (s, "rope_scaling"),
            _ => return f32_of(v, "rope_theta", whence),
        },
    };
    let kind = params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    if kind != "default" {
        return Err(format!(
            "{whence}: `{key}.rope_type` {kind:?} is not supported (this plugin implements the default rotation)"
        ));
    }
    match params.get("rope_theta") {
        Some(_) => f32_of(params, "rope_theta", &format!("{whence}: `{key}`")),
        None => f32_of(v, "rope_theta", whence),
    }
}

impl DFlashConfig {
    /// Parses `config.json`; `whence` (the file's path) prefixes every error.
    pub fn parse(text: &str, whence: &str) -> Result<Self, String> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("{whence}: not valid JSON: {e}"))?;
        let arch = v
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str())
            .unwrap_or("");
        if arch != "DFlashDraftModel" {
            return Err(format!(
                "{whence}: architectures is {arch:?}; the dflash drafter reads z-lab's DFlashDraftModel checkpoints"
            ));
        }
        let dflash = match v.get("dflash_config") {
            Some(d) if d.is_object() => d,
            _ => return Err(format!("{whence}: `dflash_config` is missing")),
        };
        let sub = format!("{whence}: `dflash_config`");
        let mask_token_id = usize_of(dflash, "mask_token_id", &sub)? as u32;
        let block_size = match (
            optional_usize(&v, "block_size", whence)?,
            optional_usize(dflash, "block_size", &sub)?,
        ) {
            (Some(a), Some(b)) if a != b => {
                return Err(format!(
                    "{whence}: `block_size` {a} and `dflash_config.block_size` {b} disagree"
                ))
            }
            (Some(b), _) | (None, Some(b)) => b,
            (None, None) => return Err(format!("{whence}: `block_size` is missing")),
        };
        if block_size < 2 {
            return Err(format!(
                "{whence}: `block_size` {block_size}: a block needs the anchor and at least one mask"
            ));
        }
        let num_layers = usize_of(&v, "num_hidden_layers", whence)?;
        let num_target_layers = usize_of(&v, "num_target_layers", whence)?;
        if num_layers == 0 || num_target_layers < 2 {
            return Err(format!(
                "{whence}: {num_layers} draft layers for a target of {num_target_layers}: not a drafter"
            ));
        }
        let target_layer_ids: Vec<i32> = match dflash.get("target_layer_ids") {
            None | Some(Value::Null) => default_target_layer_ids(num_target_layers, num_layers),
            Some(ids) => ids
                .as_array()
                .and_then(|l| {
                    l.iter()
                        .map(|x| x.as_i64().map(|n| n as i32))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| {
                    format!("{whence}: `dflash_config.target_layer_ids` must be a list of integers")
                })?,
        };
        let last = num_target_layers as i32 - 1;
        if target_layer_ids.is_empty() || target_layer_ids.iter().any(|&i| i < -1 || i >= last) {
            return Err(format!(
                "{whence}: `dflash_config.target_layer_ids` {target_layer_ids:?} must be ids in -1..{} of the target's {num_target_layers} layers (never the last, whose state transformers replaces by the normed one)",
                last - 1
            ));
        }
        let activation = match v.get("hidden_act").and_then(|a| a.as_str()) {
            Some("silu") | None => Activation::Silu,
            Some("gelu_pytorch_tanh") => Activation::GeluTanh,
            Some(other) => {
                return Err(format!(
                    "{whence}: `hidden_act` {other:?} is not supported (silu or gelu_pytorch_tanh)"
                ))
            }
        };
        let hidden_size = usize_of(&v, "hidden_size", whence)?;
        let num_attention_heads = usize_of(&v, "num_attention_heads", whence)?;
        let num_kv_heads =
            optional_usize(&v, "num_key_value_heads", whence)?.unwrap_or(num_attention_heads);
        // Qwen3Config's own default is 128, whatever the width: a config without it is ambiguous.
        let head_dim = usize_of(&v, "head_dim", whence)?;
        if let Some(s) = v.get("query_pre_attn_scalar").filter(|s| !s.is_null()) {
            if s.as_f64() != Some(head_dim as f64) {
                return Err(format!(
                    "{whence}: `query_pre_attn_scalar` {s} differs from head_dim {head_dim}; z-lab's attention scales by head_dim^-1/2"
                ));
            }
        }
        // Qwen3Config's rule when `layer_types` is left out.
        let sliding_window = optional_usize(&v, "sliding_window", whence)?;
        let kinds: Vec<String> = match v.get("layer_types") {
            None | Some(Value::Null) => {
                let sliding =
                    bool_of(&v, "use_sliding_window", false, whence)? && sliding_window.is_some();
                let from = optional_usize(&v, "max_window_layers", whence)?.unwrap_or(28);
                (0..num_layers)
                    .map(|i| {
                        if sliding && i >= from {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                        .to_owned()
                    })
                    .collect()
            }
            Some(l) => l
                .as_array()
                .and_then(|l| {
                    l.iter()
                        .map(|t| t.as_str().map(str::to_owned))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| format!("{whence}: `layer_types` must be a list of strings"))?,
        };
        if kinds.len() != num_layers {
            return Err(format!(
                "{whence}: {} layer_types for {num_layers} layers",
                kinds.len()
            ));
        }
        let layer_windows = kinds
            .iter()
            .map(|k| match k.as_str() {
                "full_attention" => Ok(None),
                "sliding_attention" => match sliding_window {
                    Some(w) if w > 0 => Ok(Some(w)),
                    _ => Err(format!(
                        "{whence}: a sliding_attention layer needs a positive `sliding_window`"
                    )),
                },
                other => Err(format!(
                    "{whence}: layer type {other:?} in `layer_types` is not supported (sliding_attention or full_attention)"
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let config = DFlashConfig {
            hidden_size,
            num_layers,
            num_target_layers,
            target_layer_ids,
            block_size,
            mask_token_id,
            num_attention_heads,
            num_kv_heads,
            head_dim,
            attention_bias: bool_of(&v, "attention_bias", false, whence)?,
            intermediate_size: usize_of(&v, "intermediate_size", whence)?,
            rms_norm_eps: f32_of(&v, "rms_norm_eps", whence)?,
            rope_theta: rope_theta(&v, whence)?,
            attention_scale: (head_dim as f32).powf(-0.5),
            activation,
            layer_windows,
            quantization: QuantConfig::from_config(&v, whence)?,
        };
        let c = &config;
        if c.num_kv_heads == 0
            || c.num_attention_heads % c.num_kv_heads != 0
            || c.head_dim == 0
            || c.head_dim % 2 != 0
        {
            return Err(format!(
                "{whence}: {} heads over {} key/value heads of size {}: not a valid drafter",
                c.num_attention_heads, c.num_kv_heads, c.head_dim
            ));
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": true,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": 6, "use_sliding_window": true,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "block_size": 6, "num_target_layers": 7, "dflash_config": {"mask_token_id": 4}
        })
    }

    fn parse(v: &Value) -> Result<DFlashConfig, String> {
        DFlashConfig::parse(&v.to_string(), "config.json")
    }

    #[test]
    fn zlabs_default_taps_round_ties_to_even() {
        // The published Gemma 4 drafters' taps are this formula with 6 draft taps.
        assert_eq!(default_target_layer_ids(60, 6), vec![1, 12, 23, 35, 46, 57]);
        assert_eq!(default_target_layer_ids(30, 6), vec![1, 6, 11, 17, 22, 27]);
        // 1 + 3/2 = 2.5 rounds to 2 as Python's round does (3 away from zero).
        assert_eq!(default_target_layer_ids(7, 3), vec![1, 2, 4]);
        assert_eq!(default_target_layer_ids(8, 1), vec![4]);
    }

    #[test]
    fn reads_the_published_keys() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.target_layer_ids, vec![1, 2, 4]);
        assert_eq!(c.layer_windows, vec![Some(6), None, Some(6)]);
        assert_eq!((c.block_size, c.mask_token_id, c.head_dim), (6, 4, 16));
        assert_eq!(c.attention_scale, 0.25);
        let mut v = base();
        v["dflash_config"] =
            json!({"mask_token_id": 4, "target_layer_ids": [0, 3], "block_size": 6});
        v.as_object_mut().unwrap().remove("block_size");
        v.as_object_mut().unwrap().remove("layer_types");
        v["rope_theta"] = json!(1e6);
        v.as_object_mut().unwrap().remove("rope_parameters");
        let c = parse(&v).unwrap();
        assert_eq!(c.target_layer_ids, vec![0, 3]);
        assert_eq!(c.block_size, 6);
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(
            c.layer_windows,
            vec![None; 3],
            "Qwen3's max_window_layers 28"
        );
    }

    #[test]
    fn refusals_name_the_key() {
        type Mutation = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Mutation)> = vec![
            (
                "DFlashDraftModel",
                Box::new(|v| v["architectures"] = json!(["Gemma4DSparkModel"])),
            ),
            (
                "mask_token_id",
                Box::new(|v| v["dflash_config"] = json!({})),
            ),
            (
                "never the last",
                Box::new(|v| v["dflash_config"]["target_layer_ids"] = json!([1, 6])),
            ),
            (
                "disagree",
                Box::new(|v| v["dflash_config"]["block_size"] = json!(8)),
            ),
            ("hidden_act", Box::new(|v| v["hidden_act"] = json!("relu"))),
            (
                "rope_type",
                Box::new(|v| v["rope_parameters"]["rope_type"] = json!("yarn")),
            ),
            (
                "sliding_window",
                Box::new(|v| v["sliding_window"] = Value::Null),
            ),
            (
                "layer_types",
                Box::new(|v| v["layer_types"] = json!(["full_attention"])),
            ),
            (
                "query_pre_attn_scalar",
                Box::new(|v| v["query_pre_attn_scalar"] = json!(256)),
            ),
            ("head_dim", Box::new(|v| v["head_dim"] = Value::Null)),
            ("block_size", Box::new(|v| v["block_size"] = json!(1))),
        ];
        for (needle, mutate) in cases {
            let mut v = base();
            mutate(&mut v);
            let e = parse(&v).unwrap_err();
            assert!(
                e.contains(needle) && e.contains("config.json"),
                "{needle}: {e}"
            );
        }
    }
}
