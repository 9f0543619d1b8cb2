//! `config.json` of an MTP row: a GLM-4.5 (`glm4_moe`) config as GLM checkpoints ship it, plus
//! the `mlx_spec_mtp` block that names the target the row was trained for and the conventions
//! it was trained with.
//!
//! The row is "layer N" of its model (`model.layers.{N}.*`, N = `num_hidden_layers`, or
//! `mlx_spec_mtp.mtp_layer_index`). Its MLP is dense when N < `first_k_dense_replace`
//! (GLM's own rule), routed experts otherwise. Every value the math needs is read, never
//! derived: `head_dim` in particular (GLM-4.5 has 128 with hidden 5120 and 96 heads).

use mlx_spec_plugin_api::quant::QuantConfig;
use serde_json::Value;

/// What the next chained step reads as its hidden state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainHidden {
    /// The block's output before `shared_head.norm` (vLLM, mlx-bun).
    PreNorm,
    /// The normed output, the head's input (SGLang, Megatron's multi-depth training).
    PostNorm,
}

impl ChainHidden {
    pub fn parse(text: &str, whence: &str) -> Result<Self, String> {
        match text {
            "pre_norm" => Ok(ChainHidden::PreNorm),
            "post_norm" => Ok(ChainHidden::PostNorm),
            other => Err(format!(
                "{whence}: `chain_hidden` must be \"pre_norm\" or \"post_norm\", got {other:?}"
            )),
        }
    }
}

/// The row's MLP.
#[derive(Debug, Clone, PartialEq)]
pub enum MlpConfig {
    /// One SwiGLU `mlp.{gate,up,down}_proj`.
    Dense { intermediate: usize },
    /// Sigmoid-routed experts with a correction bias, plus shared experts.
    Experts(ExpertsConfig),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExpertsConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    /// Width of the shared expert: `moe_intermediate_size * n_shared_experts`.
    pub shared_intermediate: usize,
    pub routed_scaling_factor: f32,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
}

/// The target a row was trained for, as its `mlx_spec_mtp` block declares it.
#[derive(Debug, Clone, PartialEq)]
pub struct Pairing {
    pub model_type: String,
    pub num_hidden_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MtpConfig {
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// N: the row's tensors are `model.layers.{N}.*`.
    pub layer_index: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub attention_bias: bool,
    pub use_qk_norm: bool,
    pub rope_theta: f32,
    /// Leading dimensions of each head that turn (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
    pub mlp: MlpConfig,
    /// `[hidden; embedding]` instead of GLM's `[embedding; hidden]` into `eh_proj`.
    pub hidden_first: bool,
    pub pairing: Pairing,
    pub chain_hidden: ChainHidden,
    /// Prompt rows go into the row's cache at prefill (`false`: the cache starts at the
    /// prompt's last position, mlx-bun's "no prefill").
    pub kv_prefill: bool,
    /// The `quantization` block (`mlx-spec quantize-drafter`); empty for a float row.
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

fn f32_of(v: &Value, key: &str, whence: &str) -> Result<f32, String> {
    match v.get(key) {
        Some(x) => x
            .as_f64()
            .map(|n| n as f32)
            .ok_or_else(|| format!("{whence}: `{key}` must be a number, got {x}")),
        None => Err(format!("{whence}: `{key}` is missing")),
    }
}

fn bool_or(v: &Value, key: &str, default: bool, whence: &str) -> Result<bool, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| format!("{whence}: `{key}` must be true or false, got {x}")),
    }
}

fn str_or<'a>(v: &'a Value, key: &str, default: &'a str, whence: &str) -> Result<&'a str, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_str()
            .ok_or_else(|| format!("{whence}: `{key}` must be a string, got {x}")),
    }
}

impl MtpConfig {
    /// Parses `config.json`; `whence` (the file's path) prefixes every error.
    pub fn parse(text: &str, whence: &str) -> Result<Self, String> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("{whence}: not valid JSON: {e}"))?;
        let model_type = str_or(&v, "model_type", "", whence)?;
        match model_type {
            "glm4_moe" => {}
            "deepseek_v3" | "glm4_moe_lite" | "glm_moe_dsa" | "glm5_next" => {
                return Err(format!(
                    "{whence}: a {model_type} MTP row uses multi-head latent attention, which this plugin does not implement yet (it serves the GQA rows of glm4_moe)"
                ))
            }
            other => {
                return Err(format!(
                    "{whence}: `model_type` is {other:?}; the glm-mtp drafter reads glm4_moe MTP rows"
                ))
            }
        }
        let quantization = QuantConfig::from_config(&v, whence)?;
        let act = str_or(&v, "hidden_act", "silu", whence)?;
        if act != "silu" {
            return Err(format!(
                "{whence}: `hidden_act` is {act:?}; GLM rows use silu"
            ));
        }
        let block = v.get("mlx_spec_mtp").ok_or_else(|| {
            format!(
                "{whence}: no `mlx_spec_mtp` block, so the row declares no target; a GLM model's own MTP row needs its GLM target, and this host serves Gemma 4 (train a row for your target with train/train_mtp.py)"
            )
        })?;
        let inner = format!("{whence}: mlx_spec_mtp");
        for (key, want) in [
            ("embedding", "target_input_embedding"),
            ("lm_head", "target_logits_from_hidden"),
            ("hidden_in", "target_final_norm_output"),
            ("rope_position", "position_of_hidden"),
        ] {
            let got = str_or(block, key, want, &inner)?;
            if got != want {
                return Err(format!(
                    "{inner}: `{key}` is {got:?}; this plugin implements {want:?}"
                ));
            }
        }
        let hidden_first = match str_or(block, "concat_order", "embed_first", &inner)? {
            "embed_first" => false,
            "hidden_first" => true,
            other => {
                return Err(format!(
                    "{inner}: `concat_order` must be \"embed_first\" or \"hidden_first\", got {other:?}"
                ))
            }
        };
        if bool_or(&v, "mtp_hidden_states_first", false, whence)? != hidden_first {
            return Err(format!(
                "{whence}: `mtp_hidden_states_first` and mlx_spec_mtp.concat_order disagree"
            ));
        }
        let num_hidden_layers = usize_of(&v, "num_hidden_layers", whence)?;
        let layer_index = match block.get("mtp_layer_index") {
            Some(_) => usize_of(block, "mtp_layer_index", &inner)?,
            None => num_hidden_layers,
        };
        let pairing = Pairing {
            model_type: str_or(block, "target_model_type", "", &inner)?.to_owned(),
            num_hidden_layers: usize_of(block, "target_num_hidden_layers", &inner)?,
            hidden_size: usize_of(block, "target_hidden_size", &inner)?,
            vocab_size: usize_of(block, "target_vocab_size", &inner)?,
        };
        let chain_hidden =
            ChainHidden::parse(str_or(block, "chain_hidden", "pre_norm", &inner)?, &inner)?;
        let kv_prefill = bool_or(block, "mtp_kv_prefill", true, &inner)?;

        let head_dim = usize_of(&v, "head_dim", whence).map_err(|e| {
            format!("{e} (GLM rows give it explicitly; it is not hidden_size / heads)")
        })?;
        // RoPE: `rope_parameters` (transformers 5) or the older top-level keys.
        let rope = v.get("rope_parameters").unwrap_or(&v);
        let rope_type = str_or(rope, "rope_type", "default", whence)?;
        if rope_type != "default" {
            return Err(format!(
                "{whence}: rope_type {rope_type:?} is not supported (GLM rows use \"default\")"
            ));
        }
        let rope_theta = f32_of(rope, "rope_theta", whence)?;
        let partial = match rope.get("partial_rotary_factor") {
            None | Some(Value::Null) => 1.0,
            Some(_) => f32_of(rope, "partial_rotary_factor", whence)?,
        };
        let rotary_dim = (head_dim as f32 * partial) as usize;
        if rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim {
            return Err(format!(
                "{whence}: partial_rotary_factor {partial} of head_dim {head_dim} gives {rotary_dim} rotated dimensions; it must be even and non-zero"
            ));
        }
        let dense = layer_index < usize_of(&v, "first_k_dense_replace", whence).unwrap_or(0);
        let mlp = if dense {
            MlpConfig::Dense {
                intermediate: usize_of(&v, "intermediate_size", whence)?,
            }
        } else {
            let experts = ExpertsConfig {
                num_experts: usize_of(&v, "n_routed_experts", whence)?,
                top_k: usize_of(&v, "num_experts_per_tok", whence)?,
                intermediate: usize_of(&v, "moe_intermediate_size", whence)?,
                shared_intermediate: usize_of(&v, "moe_intermediate_size", whence)?
                    * usize_of(&v, "n_shared_experts", whence).unwrap_or(0),
                routed_scaling_factor: f32_of(&v, "routed_scaling_factor", whence).unwrap_or(1.0),
                n_group: usize_of(&v, "n_group", whence).unwrap_or(1).max(1),
                topk_group: usize_of(&v, "topk_group", whence).unwrap_or(1).max(1),
                norm_topk_prob: bool_or(&v, "norm_topk_prob", true, whence)?,
            };
            let e = &experts;
            if e.top_k == 0
                || e.num_experts % e.n_group != 0
                || e.topk_group > e.n_group
                || e.top_k > e.topk_group * (e.num_experts / e.n_group)
            {
                return Err(format!(
                    "{whence}: {} experts in {} groups, {} groups kept, top {}: not a valid routing",
                    e.num_experts, e.n_group, e.topk_group, e.top_k
                ));
            }
            MlpConfig::Experts(experts)
        };
        let config = MtpConfig {
            hidden_size: usize_of(&v, "hidden_size", whence)?,
            vocab_size: usize_of(&v, "vocab_size", whence)?,
            layer_index,
            num_attention_heads: usize_of(&v, "num_attention_heads", whence)?,
            num_key_value_heads: usize_of(&v, "num_key_value_heads", whence)?,
            head_dim,
            rms_norm_eps: f32_of(&v, "rms_norm_eps", whence)?,
            attention_bias: bool_or(&v, "attention_bias", false, whence)?,
            use_qk_norm: bool_or(&v, "use_qk_norm", false, whence)?,
            rope_theta,
            rotary_dim,
            mlp,
            hidden_first,
            pairing,
            chain_hidden,
            kv_prefill,
            quantization,
        };
        let c = &config;
        if c.hidden_size == 0
            || c.num_key_value_heads == 0
            || c.num_attention_heads % c.num_key_value_heads != 0
        {
            return Err(format!(
                "{whence}: {} attention heads do not share {} key/value heads evenly",
                c.num_attention_heads, c.num_key_value_heads
            ));
        }
        if c.pairing.hidden_size != c.hidden_size {
            return Err(format!(
                "{whence}: the row's hidden_size {} differs from the target_hidden_size {} it declares; eh_proj reads the target's hidden",
                c.hidden_size, c.pairing.hidden_size
            ));
        }
        Ok(config)
    }

    /// The tensor name prefix of the row.
    pub fn prefix(&self) -> String {
        format!("model.layers.{}.", self.layer_index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "glm4_moe", "hidden_size": 64, "vocab_size": 256,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 24, "rms_norm_eps": 1e-5, "attention_bias": true, "use_qk_norm": true,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "first_k_dense_replace": 1, "intermediate_size": 96, "moe_intermediate_size": 24,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
            "mlx_spec_mtp": {"target_model_type": "gemma4_text", "target_num_hidden_layers": 6,
                "target_hidden_size": 64, "target_vocab_size": 256, "chain_hidden": "pre_norm",
                "mtp_kv_prefill": true}
        })
    }

    fn parse(v: &Value) -> Result<MtpConfig, String> {
        MtpConfig::parse(&v.to_string(), "config.json")
    }

    #[test]
    fn reads_the_oracle_shape() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.layer_index, 6);
        assert_eq!(c.prefix(), "model.layers.6.");
        assert_eq!(c.rotary_dim, 12);
        assert!(
            matches!(c.mlp, MlpConfig::Experts(ref e) if e.shared_intermediate == 24 && e.top_k == 2)
        );
        assert_eq!(c.chain_hidden, ChainHidden::PreNorm);
        // Row index below first_k_dense_replace: a dense MLP.
        let mut v = base();
        v["first_k_dense_replace"] = json!(7);
        assert_eq!(
            parse(&v).unwrap().mlp,
            MlpConfig::Dense { intermediate: 96 }
        );
    }

    #[test]
    fn refusals_name_the_key() {
        type Mutation = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Mutation)> = vec![
            (
                "multi-head latent",
                Box::new(|v| v["model_type"] = json!("glm_moe_dsa")),
            ),
            (
                "mlx_spec_mtp",
                Box::new(|v| {
                    v.as_object_mut().unwrap().remove("mlx_spec_mtp");
                }),
            ),
            (
                "head_dim",
                Box::new(|v| {
                    v.as_object_mut().unwrap().remove("head_dim");
                }),
            ),
            (
                "chain_hidden",
                Box::new(|v| v["mlx_spec_mtp"]["chain_hidden"] = json!("both")),
            ),
            (
                "rope_type",
                Box::new(|v| v["rope_parameters"]["rope_type"] = json!("yarn")),
            ),
            (
                "7-bit",
                Box::new(|v| v["quantization"] = json!({"bits": 7})),
            ),
            (
                "target_hidden_size",
                Box::new(|v| v["mlx_spec_mtp"]["target_hidden_size"] = json!(32)),
            ),
            (
                "lm_head",
                Box::new(|v| v["mlx_spec_mtp"]["lm_head"] = json!("own_head")),
            ),
            ("routing", Box::new(|v| v["num_experts_per_tok"] = json!(9))),
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
        assert!(MtpConfig::parse("{", "x.json")
            .unwrap_err()
            .contains("x.json"));
    }
}
