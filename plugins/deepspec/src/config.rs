//! `config.json` of a DeepSpec block drafter (`Gemma4DSparkModel`): the target's Gemma 4 text
//! config copied by DeepSpec's trainer and overwritten with the drafter's own keys.
//!
//! One class serves DSpark (a Markov head of rank r and a confidence head) and DeepSpec's
//! DFlash (`markov_rank` 0, no confidence head). Only the keys the forward reads are taken;
//! everything this plugin does not implement is refused by name rather than computed wrongly.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct DSparkConfig {
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub num_layers: usize,
    /// The target's layer count the drafter was trained against.
    pub num_target_layers: usize,
    /// Tapped target layers, in the order `fc` reads them (`-1`: the scaled embedding).
    pub target_layer_ids: Vec<i32>,
    /// B: tokens a block drafts.
    pub block_size: usize,
    pub mask_token_id: u32,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    /// D, every draft layer's head size (`global_head_dim`).
    pub head_dim: usize,
    pub attention_bias: bool,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub softcap: Option<f32>,
    pub rope_theta: f32,
    pub partial_rotary_factor: f32,
    /// 0: no Markov head (DeepSpec's DFlash).
    pub markov_rank: usize,
    pub confidence_head: bool,
    pub confidence_with_markov: bool,
    /// `mlx_spec_shared_vocab`: the checkpoint stores no `embed_tokens`/`lm_head`; the block
    /// reads the target's embedding and LM head through its ports.
    pub shared_vocab: bool,
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

impl DSparkConfig {
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
        if arch != "Gemma4DSparkModel" {
            return Err(format!(
                "{whence}: architectures is {arch:?}; the deepspec drafter reads DeepSpec's Gemma4DSparkModel checkpoints (DSpark and DeepSpec DFlash)"
            ));
        }
        if bool_of(&v, "enable_moe_block", false, whence)?
            || v.get("hidden_size_per_layer_input")
                .and_then(|x| x.as_u64())
                .unwrap_or(0)
                != 0
        {
            return Err(format!(
                "{whence}: a drafter config with MoE blocks or per-layer inputs; DeepSpec's draft layers have neither"
            ));
        }
        if !bool_of(&v, "attention_k_eq_v", false, whence)? {
            return Err(format!(
                "{whence}: `attention_k_eq_v` is false; this plugin implements the released K=V draft layers only"
            ));
        }
        if let Some(act) = v.get("hidden_activation").and_then(|a| a.as_str()) {
            if act != "gelu_pytorch_tanh" {
                return Err(format!(
                    "{whence}: hidden_activation {act:?}; DeepSpec's Gemma 4 layers use gelu_pytorch_tanh"
                ));
            }
        }
        let layer_types = v
            .get("layer_types")
            .and_then(|l| l.as_array())
            .ok_or_else(|| format!("{whence}: `layer_types` is missing"))?;
        if layer_types
            .iter()
            .any(|t| t.as_str() != Some("full_attention"))
        {
            return Err(format!(
                "{whence}: every draft layer must be full_attention, got {}",
                Value::Array(layer_types.clone())
            ));
        }
        let num_layers = usize_of(&v, "num_hidden_layers", whence)?;
        if layer_types.len() != num_layers {
            return Err(format!(
                "{whence}: {} layer_types for {num_layers} layers",
                layer_types.len()
            ));
        }
        let num_target_layers = usize_of(&v, "num_target_layers", whence)?;
        let target_layer_ids: Vec<i32> = v
            .get("target_layer_ids")
            .and_then(|l| l.as_array())
            .ok_or_else(|| format!("{whence}: `target_layer_ids` is missing"))?
            .iter()
            .map(|x| x.as_i64().map(|n| n as i32))
            .collect::<Option<_>>()
            .ok_or_else(|| format!("{whence}: `target_layer_ids` must be integers"))?;
        let increasing = target_layer_ids.windows(2).all(|w| w[0] < w[1]);
        let in_range = target_layer_ids
            .iter()
            .all(|&i| i >= -1 && i < num_target_layers as i32 - 1);
        if target_layer_ids.is_empty() || !increasing || !in_range {
            return Err(format!(
                "{whence}: target_layer_ids {target_layer_ids:?} must be increasing ids in -1..{} (never the target's last layer, whose state transformers replaces by the normed one)",
                num_target_layers as i32 - 2
            ));
        }
        // Full-attention RoPE: transformers 5 nests it per layer kind.
        let rope = v
            .get("rope_parameters")
            .and_then(|r| r.get("full_attention"))
            .ok_or_else(|| format!("{whence}: `rope_parameters.full_attention` is missing"))?;
        let rope_type = rope.get("rope_type").and_then(|t| t.as_str()).unwrap_or("");
        if rope_type != "proportional" && rope_type != "default" {
            return Err(format!(
                "{whence}: full-attention rope_type {rope_type:?} is not supported (proportional or default)"
            ));
        }
        let partial_rotary_factor = match rope.get("partial_rotary_factor") {
            None | Some(Value::Null) => 1.0,
            Some(_) => f32_of(rope, "partial_rotary_factor", whence)?,
        };
        let markov_rank = usize_of(&v, "markov_rank", whence).unwrap_or(0);
        if markov_rank > 0 {
            let kind = v
                .get("markov_head_type")
                .and_then(|t| t.as_str())
                .unwrap_or("vanilla");
            if kind != "vanilla" {
                return Err(format!(
                    "{whence}: markov_head_type {kind:?} is not supported (the released checkpoints use \"vanilla\")"
                ));
            }
        }
        let confidence_head = bool_of(&v, "enable_confidence_head", false, whence)?;
        let confidence_with_markov =
            confidence_head && bool_of(&v, "confidence_head_with_markov", false, whence)?;
        if confidence_with_markov && markov_rank == 0 {
            return Err(format!(
                "{whence}: the confidence head reads the Markov table, but markov_rank is 0"
            ));
        }
        let config = DSparkConfig {
            hidden_size: usize_of(&v, "hidden_size", whence)?,
            vocab_size: usize_of(&v, "vocab_size", whence)?,
            num_layers,
            num_target_layers,
            target_layer_ids,
            block_size: usize_of(&v, "block_size", whence)?,
            mask_token_id: usize_of(&v, "mask_token_id", whence)? as u32,
            num_attention_heads: usize_of(&v, "num_attention_heads", whence)?,
            num_kv_heads: usize_of(&v, "num_global_key_value_heads", whence)?,
            head_dim: usize_of(&v, "global_head_dim", whence)?,
            attention_bias: bool_of(&v, "attention_bias", false, whence)?,
            intermediate_size: usize_of(&v, "intermediate_size", whence)?,
            rms_norm_eps: f32_of(&v, "rms_norm_eps", whence)?,
            softcap: match v.get("final_logit_softcapping") {
                None | Some(Value::Null) => None,
                Some(_) => Some(f32_of(&v, "final_logit_softcapping", whence)?),
            },
            rope_theta: f32_of(rope, "rope_theta", whence)?,
            partial_rotary_factor,
            markov_rank,
            confidence_head,
            confidence_with_markov,
            shared_vocab: bool_of(&v, "mlx_spec_shared_vocab", false, whence)?,
        };
        let c = &config;
        if c.block_size == 0
            || c.num_kv_heads == 0
            || c.num_attention_heads % c.num_kv_heads != 0
            || c.head_dim % 2 != 0
        {
            return Err(format!(
                "{whence}: block_size {}, {} heads over {} key/value heads, head dim {}: not a valid drafter",
                c.block_size, c.num_attention_heads, c.num_kv_heads, c.head_dim
            ));
        }
        if c.mask_token_id as usize >= c.vocab_size {
            return Err(format!(
                "{whence}: mask_token_id {} is outside the vocabulary of {}",
                c.mask_token_id, c.vocab_size
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
            "architectures": ["Gemma4DSparkModel"], "attention_k_eq_v": true,
            "hidden_size": 48, "vocab_size": 300, "num_hidden_layers": 2,
            "layer_types": ["full_attention", "full_attention"], "num_target_layers": 6,
            "target_layer_ids": [1, 3, 4], "block_size": 5, "mask_token_id": 4,
            "num_attention_heads": 4, "num_global_key_value_heads": 1, "global_head_dim": 32,
            "intermediate_size": 80, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
            "rope_parameters": {"full_attention": {"rope_type": "proportional",
                "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
            "markov_rank": 16, "markov_head_type": "vanilla", "enable_confidence_head": true,
            "confidence_head_with_markov": true, "hidden_activation": "gelu_pytorch_tanh"
        })
    }

    fn parse(v: &Value) -> Result<DSparkConfig, String> {
        DSparkConfig::parse(&v.to_string(), "config.json")
    }

    #[test]
    fn reads_dspark_and_dflash() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.target_layer_ids, vec![1, 3, 4]);
        assert_eq!((c.block_size, c.head_dim, c.num_kv_heads), (5, 32, 1));
        assert!(c.confidence_with_markov);
        let mut v = base();
        v["markov_rank"] = json!(0);
        v["enable_confidence_head"] = json!(false);
        let c = parse(&v).unwrap();
        assert_eq!((c.markov_rank, c.confidence_head), (0, false));
    }

    #[test]
    fn refusals_name_the_key() {
        type Mutation = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Mutation)> = vec![
            (
                "Gemma4DSparkModel",
                Box::new(|v| v["architectures"] = json!(["DFlashDraftModel"])),
            ),
            (
                "attention_k_eq_v",
                Box::new(|v| v["attention_k_eq_v"] = json!(false)),
            ),
            (
                "last layer",
                Box::new(|v| v["target_layer_ids"] = json!([1, 3, 5])),
            ),
            (
                "target_layer_ids",
                Box::new(|v| v["target_layer_ids"] = json!([3, 1])),
            ),
            (
                "markov_head_type",
                Box::new(|v| v["markov_head_type"] = json!("gated")),
            ),
            (
                "full_attention",
                Box::new(|v| v["layer_types"] = json!(["sliding_attention", "full_attention"])),
            ),
            (
                "mask_token_id",
                Box::new(|v| v["mask_token_id"] = json!(300)),
            ),
            (
                "per-layer inputs",
                Box::new(|v| v["hidden_size_per_layer_input"] = json!(8)),
            ),
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
