//! The plugin's configuration: `plugin.toml` `[defaults]` merged with `--drafter-set` keys.
//!
//! | key | values | default |
//! |---|---|---|
//! | `checkpoint` | the draft model's folder (a Gemma 4 checkpoint), relative to the plugin's folder | `checkpoint` |
//! | `dtype` | compute dtype: `auto` (the target's activation dtype), `checkpoint`, `float32`, `bfloat16`, `float16` | `auto` |
//! | `min_draft_probability` | greedy rounds end at the first draft whose probability under the draft model is below this | `0` (never) |
//! | `sample_drafts` | at temperature > 0, draw drafts from `softmax(logits / T)` and hand the host those distributions (rejection sampling) | `false` |
//! | `random_weights_seed` | build the draft model from `checkpoint`'s `config.json` (or a config file named by `checkpoint`) with seeded random weights, for measuring what a round costs at a released model's size without downloading it | unset |

use std::path::{Path, PathBuf};

use mlx_rs::Dtype;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDtype {
    /// The target's activation dtype, known at `open`.
    Target,
    Checkpoint,
    Fixed(Dtype),
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub checkpoint: PathBuf,
    pub dtype: ComputeDtype,
    pub min_draft_probability: f32,
    pub sample_drafts: bool,
    /// Set: random weights of this seed for `checkpoint`'s config, no weight files read.
    pub random_weights_seed: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    checkpoint: Option<String>,
    dtype: Option<String>,
    min_draft_probability: Option<f64>,
    sample_drafts: Option<bool>,
    random_weights_seed: Option<u64>,
}

impl Settings {
    pub fn parse(config: &serde_json::Value, plugin_dir: &Path) -> Result<Self, String> {
        let raw: Raw = mlx_spec_plugin_api::parse_settings(config, "draft-model")?;
        let checkpoint = PathBuf::from(raw.checkpoint.as_deref().unwrap_or("checkpoint"));
        let checkpoint = if checkpoint.is_absolute() {
            checkpoint
        } else {
            plugin_dir.join(checkpoint)
        };
        let dtype = match raw.dtype.as_deref().unwrap_or("auto") {
            "auto" => ComputeDtype::Target,
            "checkpoint" => ComputeDtype::Checkpoint,
            "float32" => ComputeDtype::Fixed(Dtype::Float32),
            "bfloat16" => ComputeDtype::Fixed(Dtype::Bfloat16),
            "float16" => ComputeDtype::Fixed(Dtype::Float16),
            other => {
                return Err(format!(
                    "draft-model drafter: `dtype` must be auto, checkpoint, float32, bfloat16 or float16, got {other:?}"
                ))
            }
        };
        let min_draft_probability = match raw.min_draft_probability.unwrap_or(0.0) {
            p if (0.0..1.0).contains(&p) => p as f32,
            p => {
                return Err(format!(
                    "draft-model drafter: `min_draft_probability` must be in [0, 1), got {p}"
                ))
            }
        };
        Ok(Settings {
            checkpoint,
            dtype,
            min_draft_probability,
            sample_drafts: raw.sample_drafts.unwrap_or(false),
            random_weights_seed: raw.random_weights_seed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_and_refusals() {
        let s = Settings::parse(&json!({}), Path::new("/p/draft-model")).unwrap();
        assert_eq!(s.checkpoint, Path::new("/p/draft-model/checkpoint"));
        assert_eq!(s.dtype, ComputeDtype::Target);
        for (bad, needle) in [
            (json!({"model": "x"}), "model"),
            (json!({"dtype": "int4"}), "int4"),
            (
                json!({"random_weights_seed": "seven"}),
                "random_weights_seed",
            ),
            (
                json!({"min_draft_probability": -0.5}),
                "min_draft_probability",
            ),
        ] {
            let e = Settings::parse(&bad, Path::new("/p")).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
