//! The plugin's configuration: `plugin.toml` `[defaults]` merged with `--drafter-set` keys.
//!
//! | key | values | default |
//! |---|---|---|
//! | `checkpoint` | assistant checkpoint folder, relative to the plugin's folder | `checkpoint` |
//! | `position` | query position of a round: `anchor` (P, the anchor token's index, as transformers and mlx-vlm) or `previous` (P − 1, as vLLM) | `anchor` |
//! | `sliding_keys` | sliding layers see the last `window+1` positions before P (transformers) or the last `window` (a W-entry ring, vLLM) | `window+1` |
//! | `dtype` | compute dtype: `auto` (the target's activation dtype), `checkpoint` (the checkpoint's float dtype), `float32`, `bfloat16`, `float16` | `auto` |
//! | `min_draft_probability` | greedy rounds end at the first draft whose probability under the drafter is below this | the checkpoint's `assistant_confidence_threshold` (`generation_config.json`), else `0` (never) |
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
    /// `None`: the checkpoint's `generation_config.json` decides (see [`confidence_floor`]).
    pub min_draft_probability: Option<f32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    checkpoint: Option<String>,
    position: Option<String>,
    sliding_keys: Option<String>,
    dtype: Option<String>,
    sample_drafts: Option<bool>,
    min_draft_probability: Option<f64>,
}

impl Settings {
    /// Reads the configuration; relative checkpoint paths resolve against `plugin_dir`.
    pub fn parse(config: &serde_json::Value, plugin_dir: &Path) -> Result<Self, String> {
        let raw: Raw = mlx_spec_plugin_api::parse_settings(config, "assistant")?;
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
        let min_draft_probability = match raw.min_draft_probability {
            Some(p) if !(0.0..1.0).contains(&p) => {
                return Err(format!(
                    "assistant drafter: `min_draft_probability` must be in [0, 1), got {p}"
                ))
            }
            p => p.map(|p| p as f32),
        };
        Ok(Settings {
            checkpoint,
            position,
            sliding_keys,
            dtype,
            sample_drafts: raw.sample_drafts.unwrap_or(false),
            min_draft_probability,
        })
    }
}

/// The confidence floor of greedy rounds when the settings give none: the checkpoint's
/// `assistant_confidence_threshold` in `generation_config.json` (transformers' assisted
/// decoding ends a round the same way), else 0. A file that is there but unreadable is an
/// error, not a silent 0.
pub fn confidence_floor(checkpoint: &Path) -> Result<f32, String> {
    let path = checkpoint.join("generation_config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(0.0);
    };
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    match config.get("assistant_confidence_threshold") {
        None | Some(serde_json::Value::Null) => Ok(0.0),
        Some(v) => match v.as_f64() {
            Some(p) if (0.0..1.0).contains(&p) => Ok(p as f32),
            _ => Err(format!(
                "{}: `assistant_confidence_threshold` must be a number in [0, 1), got {v}",
                path.display()
            )),
        },
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
    fn the_checkpoint_may_set_the_confidence_floor() {
        let dir = std::env::temp_dir().join(format!("assistant-floor-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(
            confidence_floor(&dir).unwrap(),
            0.0,
            "no generation_config.json"
        );
        let file = dir.join("generation_config.json");
        std::fs::write(&file, r#"{"num_assistant_tokens": 6}"#).unwrap();
        assert_eq!(confidence_floor(&dir).unwrap(), 0.0);
        std::fs::write(&file, r#"{"assistant_confidence_threshold": 0.4}"#).unwrap();
        assert_eq!(confidence_floor(&dir).unwrap(), 0.4);
        std::fs::write(&file, r#"{"assistant_confidence_threshold": 2}"#).unwrap();
        let e = confidence_floor(&dir).unwrap_err();
        assert!(
            e.contains("assistant_confidence_threshold") && e.contains("generation_config.json"),
            "{e}"
        );
        std::fs::write(&file, "{").unwrap();
        assert!(confidence_floor(&dir).unwrap_err().contains("not JSON"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_keys_and_values_are_named() {
        let e = Settings::parse(&json!({"checkpont": "x"}), Path::new("/p")).unwrap_err();
        assert!(e.contains("checkpont"), "{e}");
        let e = Settings::parse(&json!({"position": "next"}), Path::new("/p")).unwrap_err();
        assert!(e.contains("position") && e.contains("next"), "{e}");
        let e =
            Settings::parse(&json!({"min_draft_probability": 1.5}), Path::new("/p")).unwrap_err();
        assert!(
            e.contains("min_draft_probability") && e.contains("1.5"),
            "{e}"
        );
        let s = Settings::parse(&json!({"min_draft_probability": 0.25}), Path::new("/p")).unwrap();
        assert_eq!(s.min_draft_probability, Some(0.25));
        let e = Settings::parse(&json!({"sliding_keys": 3}), Path::new("/p")).unwrap_err();
        assert!(e.contains("sliding_keys") || e.contains("string"), "{e}");
    }
}
