//! The plugin's configuration: `plugin.toml` `[defaults]` merged with `--drafter-set` keys.
//!
//! | key | values | default |
//! |---|---|---|
//! | `checkpoint` | MTP checkpoint folder (`config.json` + safetensors), relative to the plugin's folder | `checkpoint` |
//! | `chain_hidden` | what a chained step reads: `pre_norm` (the block's output, vLLM) or `post_norm` (after `shared_head.norm`, SGLang) | the checkpoint's `mlx_spec_mtp.chain_hidden` |
//! | `kv_prefill` | build the prompt's rows into the row's cache (`true`), or start it at the prompt's last position (`false`) | the checkpoint's `mlx_spec_mtp.mtp_kv_prefill` |
//! | `dtype` | compute dtype: `auto` (the target's activation dtype), `checkpoint`, `float32`, `bfloat16`, `float16` | `auto` |
//! | `min_draft_probability` | greedy rounds end at the first draft whose probability under the row is below this | `0` (never) |
//! | `sample_drafts` | at temperature > 0, draw drafts from `softmax(logits / T)` and hand the host those distributions (rejection sampling) | `false` |

use std::path::{Path, PathBuf};

use mlx_spec_plugin_api::mlx_rs::Dtype;
use serde::Deserialize;

use crate::config::ChainHidden;

/// The dtype the row computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDtype {
    /// The target's activation dtype, known at `open`: the row's inputs come in it.
    Target,
    Checkpoint,
    Fixed(Dtype),
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub checkpoint: PathBuf,
    /// `None`: as the checkpoint says.
    pub chain_hidden: Option<ChainHidden>,
    pub kv_prefill: Option<bool>,
    pub dtype: ComputeDtype,
    pub min_draft_probability: f32,
    pub sample_drafts: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    checkpoint: Option<String>,
    chain_hidden: Option<String>,
    kv_prefill: Option<bool>,
    dtype: Option<String>,
    min_draft_probability: Option<f64>,
    sample_drafts: Option<bool>,
}

impl Settings {
    /// Reads the configuration; a relative checkpoint resolves against `plugin_dir`.
    pub fn parse(config: &serde_json::Value, plugin_dir: &Path) -> Result<Self, String> {
        let raw: Raw = mlx_spec_plugin_api::parse_settings(config, "glm-mtp")?;
        let checkpoint = PathBuf::from(raw.checkpoint.as_deref().unwrap_or("checkpoint"));
        let checkpoint = if checkpoint.is_absolute() {
            checkpoint
        } else {
            plugin_dir.join(checkpoint)
        };
        let chain_hidden = raw
            .chain_hidden
            .as_deref()
            .map(|c| ChainHidden::parse(c, "glm-mtp drafter"))
            .transpose()?;
        let dtype = match raw.dtype.as_deref().unwrap_or("auto") {
            "auto" => ComputeDtype::Target,
            "checkpoint" => ComputeDtype::Checkpoint,
            "float32" => ComputeDtype::Fixed(Dtype::Float32),
            "bfloat16" => ComputeDtype::Fixed(Dtype::Bfloat16),
            "float16" => ComputeDtype::Fixed(Dtype::Float16),
            other => {
                return Err(format!(
                    "glm-mtp drafter: `dtype` must be auto, checkpoint, float32, bfloat16 or float16, got {other:?}"
                ))
            }
        };
        let min_draft_probability = match raw.min_draft_probability.unwrap_or(0.0) {
            p if (0.0..1.0).contains(&p) => p as f32,
            p => {
                return Err(format!(
                    "glm-mtp drafter: `min_draft_probability` must be in [0, 1), got {p}"
                ))
            }
        };
        Ok(Settings {
            checkpoint,
            chain_hidden,
            kv_prefill: raw.kv_prefill,
            dtype,
            min_draft_probability,
            sample_drafts: raw.sample_drafts.unwrap_or(false),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_overrides_and_refusals() {
        let s = Settings::parse(&json!({}), Path::new("/plugins/glm-mtp")).unwrap();
        assert_eq!(s.checkpoint, Path::new("/plugins/glm-mtp/checkpoint"));
        assert_eq!((s.chain_hidden, s.kv_prefill), (None, None));
        assert_eq!(s.dtype, ComputeDtype::Target);
        let s = Settings::parse(
            &json!({"checkpoint": "/w", "chain_hidden": "post_norm", "kv_prefill": false, "dtype": "float32"}),
            Path::new("/p"),
        )
        .unwrap();
        assert_eq!(s.checkpoint, Path::new("/w"));
        assert_eq!(s.chain_hidden, Some(ChainHidden::PostNorm));
        assert_eq!(s.kv_prefill, Some(false));
        assert_eq!(s.dtype, ComputeDtype::Fixed(Dtype::Float32));
        for (bad, needle) in [
            (json!({"chain": "pre_norm"}), "chain"),
            (json!({"chain_hidden": "middle"}), "middle"),
            (
                json!({"min_draft_probability": 1.0}),
                "min_draft_probability",
            ),
            (json!({"dtype": "int8"}), "int8"),
        ] {
            let e = Settings::parse(&bad, Path::new("/p")).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
