//! Which target a drafter checkpoint was trained for.
//!
//! A drafter that reads the target's hidden states learns one target's representations. Run
//! with another target of the same shape it loads and runs, and every output stays exact (the
//! target verifies every token), but its drafts are rarely accepted: the run is slower than
//! plain decoding and nothing says why. So the training scripts write `trained_for.json` into
//! the checkpoint folder: the target's name and a fingerprint of its weights. The host reads
//! it when it builds the drafter and warns when the target in use has another fingerprint.
//!
//! The fingerprint is the sha256 of the final norm's weights, each rounded to bfloat16 and
//! written as little-endian bytes: trained weights, small, and left as they are by
//! quantization (norms are never quantized) and by a change of float dtype (a bfloat16
//! checkpoint read as float32 rounds back to the same values).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use mlx_rs::Dtype;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::model::gemma4::Gemma4Model;

/// The file's name inside a checkpoint folder.
pub const FILE_NAME: &str = "trained_for.json";

/// What `trained_for.json` holds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainedFor {
    /// The target's name, for the message (e.g. `gemma4-code-25m-v2`).
    pub target: String,
    /// [`target_fingerprint`] of that target, 64 hex digits.
    pub final_norm_sha256: String,
    /// Where it was read, for messages.
    #[serde(skip)]
    pub path: PathBuf,
}

impl TrainedFor {
    /// Reads `trained_for.json` from a checkpoint folder; `None` when the folder has none
    /// (drafters trained elsewhere, released checkpoints).
    pub fn read(checkpoint_dir: &Path) -> Result<Option<TrainedFor>> {
        let path = checkpoint_dir.join(FILE_NAME);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let mut record: TrainedFor = serde_json::from_str(&text).with_context(|| {
            format!(
                "{}: expected {{\"target\": NAME, \"final_norm_sha256\": 64 hex digits}}",
                path.display()
            )
        })?;
        let digest = &record.final_norm_sha256;
        if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!(
                "{}: final_norm_sha256 must be 64 hex digits, got {digest:?}",
                path.display()
            );
        }
        record.final_norm_sha256 = digest.to_ascii_lowercase();
        record.path = path;
        Ok(Some(record))
    }

    /// The warning to give when `model` (loaded from `model_dir`) is not the target this
    /// checkpoint was trained for; `None` when it is.
    pub fn mismatch(&self, model: &Gemma4Model, model_dir: &Path) -> Result<Option<String>> {
        let fingerprint = target_fingerprint(model)?;
        if fingerprint == self.final_norm_sha256 {
            return Ok(None);
        }
        Ok(Some(format!(
            "the drafter's checkpoint was trained for the target {:?} ({}), not for {}: its \
             drafts will rarely be accepted, so speculation will likely be slower than plain \
             decoding (the output is unchanged). Run the target it was trained for, or retrain \
             the drafter for this one (train/README.md).",
            self.target,
            self.path.display(),
            model_dir.display()
        )))
    }
}

/// The checkpoint folder a drafter's configuration names (`checkpoint`, relative to the
/// plugin's folder), if any.
pub fn checkpoint_dir(plugin_dir: &Path, config: &toml::Table) -> Option<PathBuf> {
    let name = config.get("checkpoint")?.as_str()?;
    Some(plugin_dir.join(name))
}

/// The sha256 (hex) of the target's final norm weights rounded to bfloat16.
pub fn target_fingerprint(model: &Gemma4Model) -> Result<String> {
    let weights = model
        .final_norm()
        .as_dtype(Dtype::Float32)
        .context("reading the target's final norm")?;
    weights.eval().context("reading the target's final norm")?;
    let mut hasher = Sha256::new();
    for v in weights.as_slice::<f32>() {
        hasher.update(half::bf16::from_f32(*v).to_bits().to_le_bytes());
    }
    Ok(format!("{:x}", hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) {
        std::fs::write(dir.join(FILE_NAME), text).unwrap();
    }

    #[test]
    fn a_checkpoint_without_the_file_names_no_target() {
        let dir = tempfile::tempdir().unwrap();
        assert!(TrainedFor::read(dir.path()).unwrap().is_none());
    }

    #[test]
    fn a_well_formed_file_is_read_and_its_digest_lowercased() {
        let dir = tempfile::tempdir().unwrap();
        let digest = "AB".repeat(32);
        write(
            dir.path(),
            &format!(r#"{{"target": "t", "final_norm_sha256": "{digest}"}}"#),
        );
        let record = TrainedFor::read(dir.path()).unwrap().unwrap();
        assert_eq!(record.target, "t");
        assert_eq!(record.final_norm_sha256, "ab".repeat(32));
        assert_eq!(record.path, dir.path().join(FILE_NAME));
    }

    #[test]
    fn a_malformed_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        for (text, says) in [
            ("{not json", "expected"),
            (r#"{"target": "t"}"#, "expected"),
            (
                r#"{"target": "t", "final_norm_sha256": "00", "extra": 1}"#,
                "expected",
            ),
            (
                r#"{"target": "t", "final_norm_sha256": "zz"}"#,
                "64 hex digits",
            ),
        ] {
            write(dir.path(), text);
            let err = format!("{:#}", TrainedFor::read(dir.path()).unwrap_err());
            assert!(
                err.contains(FILE_NAME) && err.contains(says),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn the_checkpoint_folder_is_the_configured_one_under_the_plugin() {
        let mut config = toml::Table::new();
        assert_eq!(checkpoint_dir(Path::new("/p"), &config), None);
        config.insert("checkpoint".into(), toml::Value::String("ckpt".into()));
        assert_eq!(
            checkpoint_dir(Path::new("/p"), &config),
            Some(PathBuf::from("/p/ckpt"))
        );
    }
}
