//! The plugin's configuration: `plugin.toml` `[defaults]` merged with `--drafter-set` keys.
//!
//! | key | values | default |
//! |---|---|---|
//! | `checkpoint` | DeepSpec checkpoint folder, relative to the plugin's folder | `checkpoint` |
//! | `dtype` | compute dtype: `auto` (the target's activation dtype), `checkpoint`, `float32`, `bfloat16`, `float16` | `auto` |
//! | `confidence_threshold` | a number, or one per block row (the last repeating): a block is proposed up to its first row whose confidence is below it | the checkpoint's `confidence_thresholds.json`, else none (the whole block) |
//! | `sample_drafts` | at temperature > 0, draw the block from `softmax(Z / T)` and hand the host those distributions (rejection sampling) | `false` |
//! | `calibration_log` | an absolute path: each verified round appends a JSON line, its block's confidences and how many drafts were proposed and accepted (what `mlx-spec calibrate` fits thresholds from) | none |

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
    /// `None`: as the checkpoint's calibration file says (see [`calibrated_thresholds`]).
    pub thresholds: Option<Vec<f32>>,
    pub sample_drafts: bool,
    pub calibration_log: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Thresholds {
    One(f64),
    PerRow(Vec<f64>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    checkpoint: Option<String>,
    dtype: Option<String>,
    confidence_threshold: Option<Thresholds>,
    sample_drafts: Option<bool>,
    calibration_log: Option<String>,
}

fn check_thresholds(values: Vec<f64>, whence: &str) -> Result<Vec<f32>, String> {
    if values.is_empty() {
        return Err(format!("{whence}: give at least one confidence threshold"));
    }
    match values.iter().find(|t| !(0.0..1.0).contains(*t)) {
        Some(bad) => Err(format!(
            "{whence}: a confidence threshold must be in [0, 1), got {bad}"
        )),
        None => Ok(values.into_iter().map(|t| t as f32).collect()),
    }
}

impl Settings {
    pub fn parse(config: &serde_json::Value, plugin_dir: &Path) -> Result<Self, String> {
        let raw: Raw = mlx_spec_plugin_api::parse_settings(config, "deepspec")?;
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
                    "deepspec drafter: `dtype` must be auto, checkpoint, float32, bfloat16 or float16, got {other:?}"
                ))
            }
        };
        let whence = "deepspec drafter: `confidence_threshold`";
        let thresholds = match raw.confidence_threshold {
            None => None,
            Some(Thresholds::One(t)) => Some(check_thresholds(vec![t], whence)?),
            Some(Thresholds::PerRow(v)) => Some(check_thresholds(v, whence)?),
        };
        let calibration_log = match raw.calibration_log.map(PathBuf::from) {
            Some(path) if !path.is_absolute() => {
                return Err(format!(
                    "deepspec drafter: `calibration_log` must be an absolute path, got {}",
                    path.display()
                ))
            }
            other => other,
        };
        Ok(Settings {
            checkpoint,
            dtype,
            thresholds,
            sample_drafts: raw.sample_drafts.unwrap_or(false),
            calibration_log,
        })
    }
}

/// The thresholds `mlx-spec calibrate` wrote beside a checkpoint
/// (`confidence_thresholds.json`: `{"thresholds": [..]}`), or none. A file that is there but
/// unreadable is an error, not a silent "no pruning".
pub fn calibrated_thresholds(checkpoint: &Path) -> Result<Vec<f32>, String> {
    let path = checkpoint.join("confidence_thresholds.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Vec::new());
    };
    let whence = path.display().to_string();
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{whence}: not JSON: {e}"))?;
    let values: Vec<f64> = v
        .get("thresholds")
        .and_then(|t| t.as_array())
        .and_then(|t| t.iter().map(|x| x.as_f64()).collect())
        .ok_or_else(|| format!("{whence}: expected {{\"thresholds\": [numbers]}}"))?;
    check_thresholds(values, &whence)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn thresholds_one_or_per_row_and_refusals() {
        let s = Settings::parse(&json!({}), Path::new("/p/deepspec")).unwrap();
        assert_eq!(s.checkpoint, Path::new("/p/deepspec/checkpoint"));
        assert_eq!(s.thresholds, None);
        let s = Settings::parse(&json!({"confidence_threshold": 0.3}), Path::new("/p")).unwrap();
        assert_eq!(s.thresholds, Some(vec![0.3]));
        let s = Settings::parse(
            &json!({"confidence_threshold": [0.1, 0.2]}),
            Path::new("/p"),
        )
        .unwrap();
        assert_eq!(s.thresholds, Some(vec![0.1, 0.2]));
        for (bad, needle) in [
            (json!({"confidence_threshold": 1.5}), "[0, 1)"),
            (json!({"confidence_threshold": []}), "at least one"),
            (json!({"threshold": 0.2}), "threshold"),
            (json!({"dtype": "f8"}), "f8"),
            (json!({"calibration_log": "rounds.jsonl"}), "absolute"),
        ] {
            let e = Settings::parse(&bad, Path::new("/p")).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn calibration_file_is_read_or_refused() {
        let dir = std::env::temp_dir().join(format!("deepspec-cal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(calibrated_thresholds(&dir).unwrap().is_empty());
        let file = dir.join("confidence_thresholds.json");
        std::fs::write(&file, r#"{"thresholds": [0.4, 0.3]}"#).unwrap();
        assert_eq!(calibrated_thresholds(&dir).unwrap(), vec![0.4, 0.3]);
        std::fs::write(&file, r#"{"thresholds": 2}"#).unwrap();
        assert!(calibrated_thresholds(&dir)
            .unwrap_err()
            .contains("confidence_thresholds.json"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
