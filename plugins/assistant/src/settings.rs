//! The plugin's configuration: `plugin.toml` `[defaults]` merged with `--drafter-set` keys.
//!
//! | key | values | default |
//! |---|---|---|
//! | `checkpoint` | assistant checkpoint folder, relative to the plugin's folder | `checkpoint` |
//! | `position` | query position of a round: `anchor` (P, the anchor token's index, as transformers and mlx-vlm) or `previous` (P − 1, as vLLM) | `anchor` |
//! | `sliding_keys` | sliding layers see the last `window+1` positions before P (transformers) or the last `window` (a W-entry ring, vLLM) | `window+1` |
//! | `dtype` | compute dtype: `auto` (the target's activation dtype), `checkpoint` (the checkpoint's float dtype), `float32`, `bfloat16`, `float16` | `auto` |
//! | `sample_drafts` | at temperature > 0, draw drafts from `softmax(logits / T)` and hand the host those distributions (rejection sampling) instead of greedy drafts verified by token match | `false` |
//!
//! The implementations disagree on `position` and `sliding_keys` and Google's training code
//! is not public; acceptance on real weights is the judge, hence the switches.

use std::path::{Path, PathBuf};

use mlx_spec_plugin_api::mlx_rs::Dtype;
use serde::Deserialize;

/// Which position the query is rotated to for the whole round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryPosition {
    /// P: the anchor token's own index (not yet processed by the target).
    Anchor,
    /// P − 1: the last position the target processed.
    Previous,
}

/// How many sliding-window positions before P the sliding layers see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlidingKeys {
    WindowPlusOne,
    Window,
}

/// The dtype the drafter computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDtype {
    /// The target's activation dtype, known at `open` (float32 for a target dequantized on
    /// the CPU, bfloat16 on a GPU): the drafter's inputs come in it, and a bf16 checkpoint
    /// runs slowly on a CPU.
    Target,
    /// The checkpoint's own float dtype.
    Checkpoint,
    Fixed(Dtype),
}

impl ComputeDtype {
    /// The dtype to load the weights in before the target is known (`None`: as stored).
    pub fn fixed(self) -> Option<Dtype> {
        match self {
            ComputeDtype::Fixed(dtype) => Some(dtype),
            ComputeDtype::Target | ComputeDtype::Checkpoint => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub checkpoint: PathBuf,
    pub position: QueryPosition,
    pub sliding_keys: SlidingKeys,
    pub dtype: ComputeDtype,
    pub sample_drafts: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    checkpoint: Option<String>,
    position: Option<String>,
    sliding_keys: Option<String>,
    dtype: Option<String>,
    sample_drafts: Option<bool>,
}

impl Settings {
    /// Reads the configuration; relative checkpoint paths resolve against `plugin_dir`.
    pub fn parse(config: &serde_json::Value, plugin_dir: &Path) -> Result<Self, String> {
        let raw: Raw = serde_json::from_value(config.clone())
            .map_err(|e| format!("assistant drafter configuration: {e}"))?;
        let checkpoint = PathBuf::from(raw.checkpoint.as_deref().unwrap_or("checkpoint"));
        let checkpoint = if checkpoint.is_absolute() {
            checkpoint
        } else {
            plugin_dir.join(checkpoint)
        };
        let position = match raw.position.as_deref().unwrap_or("anchor") {
            "anchor" => QueryPosition::Anchor,
            "previous" => QueryPosition::Previous,
            other => {
                return Err(format!(
                "assistant drafter: `position` must be \"anchor\" or \"previous\", got {other:?}"
            ))
            }
        };
        let sliding_keys = match raw.sliding_keys.as_deref().unwrap_or("window+1") {
            "window+1" => SlidingKeys::WindowPlusOne,
            "window" => SlidingKeys::Window,
            other => {
                return Err(format!(
                    "assistant drafter: `sliding_keys` must be \"window+1\" or \"window\", got {other:?}"
                ))
            }
        };
        let dtype = match raw.dtype.as_deref().unwrap_or("auto") {
            "auto" => ComputeDtype::Target,
            "checkpoint" => ComputeDtype::Checkpoint,
            "float32" => ComputeDtype::Fixed(Dtype::Float32),
            "bfloat16" => ComputeDtype::Fixed(Dtype::Bfloat16),
            "float16" => ComputeDtype::Fixed(Dtype::Float16),
            other => {
                return Err(format!(
                    "assistant drafter: `dtype` must be auto, checkpoint, float32, bfloat16 or float16, got {other:?}"
                ))
            }
        };
        Ok(Settings {
            checkpoint,
            position,
            sliding_keys,
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
    fn defaults_and_relative_checkpoint() {
        let s = Settings::parse(&json!({}), Path::new("/plugins/assistant")).unwrap();
        assert_eq!(s.checkpoint, Path::new("/plugins/assistant/checkpoint"));
        assert_eq!(s.position, QueryPosition::Anchor);
        assert_eq!(s.sliding_keys, SlidingKeys::WindowPlusOne);
        assert_eq!(s.dtype, ComputeDtype::Target);
        let s = Settings::parse(
            &json!({"checkpoint": "/x/y", "position": "previous", "sliding_keys": "window", "dtype": "bfloat16"}),
            Path::new("/p"),
        )
        .unwrap();
        assert_eq!(s.checkpoint, Path::new("/x/y"));
        assert_eq!(s.position, QueryPosition::Previous);
        assert_eq!(s.sliding_keys, SlidingKeys::Window);
        assert_eq!(s.dtype, ComputeDtype::Fixed(Dtype::Bfloat16));
        let s = Settings::parse(&json!({"dtype": "checkpoint"}), Path::new("/p")).unwrap();
        assert_eq!(s.dtype, ComputeDtype::Checkpoint);
    }

    #[test]
    fn unknown_keys_and_values_are_named() {
        let e = Settings::parse(&json!({"checkpont": "x"}), Path::new("/p")).unwrap_err();
        assert!(e.contains("checkpont"), "{e}");
        let e = Settings::parse(&json!({"position": "next"}), Path::new("/p")).unwrap_err();
        assert!(e.contains("position") && e.contains("next"), "{e}");
        let e = Settings::parse(&json!({"sliding_keys": 3}), Path::new("/p")).unwrap_err();
        assert!(e.contains("sliding_keys") || e.contains("string"), "{e}");
    }
}
