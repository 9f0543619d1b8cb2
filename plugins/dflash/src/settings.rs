//! The plugin's configuration: `plugin.toml` `[defaults]` merged with `--drafter-set` keys.
//!
//! | key | values | default |
//! |---|---|---|
//! | `checkpoint` | z-lab DFlash checkpoint folder, relative to the plugin's folder | `checkpoint` |
//! | `dtype` | compute dtype: `auto` (the target's activation dtype), `checkpoint`, `float32`, `bfloat16`, `float16` | `auto` |
//! | `sample_drafts` | at temperature > 0, draw the block from `softmax(logits / T)` and hand the host those distributions (rejection sampling) | `false` |

use std::path::{Path, PathBuf};

use mlx_spec_plugin_api::mlx_rs::Dtype;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDtype {
    /// The target's activation dtype, known at `open`: the taps come in it.
    Target,
    Checkpoint,
    Fixed(Dtype),
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub checkpoint: PathBuf,
    pub dtype: ComputeDtype,
    pub sample_drafts: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    checkpoint: Option<String>,
    dtype: Option<String>,
    sample_drafts: Option<bool>,
}

impl Settings {
    pub fn parse(config: &serde_json::Value, plugin_dir: &Path) -> Result<Self, String> {
        let raw: Raw = mlx_spec_plugin_api::parse_settings(config, "dflash")?;
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
                    "dflash drafter: `dtype` must be auto, checkpoint, float32, bfloat16 or float16, got {other:?}"
                ))
            }
        };
        Ok(Settings {
            checkpoint,
            dtype,
            sample_drafts: raw.sample_drafts.unwrap_or(false),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_and_refusals() {
        let s = Settings::parse(&json!({}), Path::new("/p/dflash")).unwrap();
        assert_eq!(s.checkpoint, Path::new("/p/dflash/checkpoint"));
        assert_eq!((s.dtype, s.sample_drafts), (ComputeDtype::Target, false));
        let s = Settings::parse(
            &json!({"checkpoint": "/c", "dtype": "bfloat16", "sample_drafts": true}),
            Path::new("/p"),
        )
        .unwrap();
        assert_eq!(s.checkpoint, Path::new("/c"));
        assert_eq!(s.dtype, ComputeDtype::Fixed(Dtype::Bfloat16));
        assert!(s.sample_drafts);
        for (bad, needle) in [
            (json!({"dtype": "f8"}), "f8"),
            (json!({"confidence_threshold": 0.2}), "confidence_threshold"),
        ] {
            let e = Settings::parse(&bad, Path::new("/p")).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
