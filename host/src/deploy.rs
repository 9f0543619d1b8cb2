//! Deployment config (`mlx-spec run --config deploy.toml`): the target model, device, plugin
//! directories, drafter and its overrides, and sampling defaults in one TOML file.
//!
//! ```toml
//! [model]
//! path = "models/my-gemma"        # relative to this file; default: mlx-spec's default model
//! device = "cpu"                  # cpu | gpu
//! dtype = "auto"                  # auto | f32 | bf16 | f16
//! handoff_layers = 3              # optional: --handoff-layers (default: the device's)
//!
//! [plugins]
//! dirs = ["plugins"]              # relative to this file; default: mlx-spec's plugins folder
//!
//! [drafter]                       # optional: omit for plain decoding
//! name = "ngram"
//! num_draft_tokens = 8
//! auto_off = true
//! fitted_draft_length = true      # false: size rounds by recent acceptance alone
//! [drafter.config]                # overrides of the plugin manifest's [defaults]
//! max_ngram = 4
//!
//! [sampling]
//! temperature = 0.0
//! top_p = 1.0
//! top_k = 0
//! min_p = 0.0
//! seed = 0
//! max_tokens = 256
//! drawn_on = "auto"               # auto | device | host (--sampler)
//! ```

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;

use crate::device::DeviceKind;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeployConfig {
    #[serde(default)]
    pub model: ModelSection,
    #[serde(default)]
    pub plugins: PluginsSection,
    #[serde(default)]
    pub drafter: Option<DrafterSection>,
    #[serde(default)]
    pub sampling: SamplingSection,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Default: the model shipped in the repo.
    #[serde(default)]
    pub path: Option<PathBuf>,
    #[serde(default = "default_device")]
    pub device: DeviceKind,
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// Layers a group when a forward read at once goes to the device (`--handoff-layers`);
    /// default: the device's.
    #[serde(default)]
    pub handoff_layers: Option<usize>,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            path: None,
            device: default_device(),
            dtype: default_dtype(),
            handoff_layers: None,
        }
    }
}

fn default_device() -> DeviceKind {
    DeviceKind::Cpu
}

fn default_dtype() -> String {
    "auto".to_owned()
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsSection {
    #[serde(default)]
    pub dirs: Vec<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterSection {
    pub name: String,
    pub num_draft_tokens: Option<usize>,
    #[serde(default = "default_true")]
    pub auto_off: bool,
    /// Size rounds by measured window costs and acceptance by draft position (the default;
    /// `false` is `--recent-draft-length`).
    #[serde(default = "default_true")]
    pub fitted_draft_length: bool,
    #[serde(default)]
    pub config: toml::Table,
}

fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingSection {
    #[serde(default)]
    pub temperature: f32,
    #[serde(default = "default_top_p")]
    pub top_p: f32,
    #[serde(default)]
    pub top_k: usize,
    #[serde(default)]
    pub min_p: f32,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    /// Where sampled tokens are drawn (`--sampler`).
    #[serde(default)]
    pub drawn_on: DrawnOn,
}

/// `[sampling] drawn_on`: `auto`, `device` or `host`, as `--sampler` takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DrawnOn {
    #[default]
    Auto,
    Device,
    Host,
}

impl Default for SamplingSection {
    fn default() -> Self {
        SamplingSection {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
            max_tokens: 128,
            drawn_on: DrawnOn::Auto,
        }
    }
}

fn default_top_p() -> f32 {
    1.0
}

fn default_max_tokens() -> usize {
    128
}

impl DeployConfig {
    /// Reads a deploy file; errors name the file, line and key. Relative paths are resolved
    /// against the file's folder.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let mut cfg: DeployConfig = toml::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "{}: {}",
                path.display(),
                e.to_string().trim_end().replace('\n', " ")
            )
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        // `join` keeps absolute paths as they are.
        cfg.model.path = cfg.model.path.map(|p| base.join(p));
        cfg.plugins.dirs = cfg.plugins.dirs.iter().map(|d| base.join(d)).collect();
        if !["auto", "f32", "bf16", "f16"].contains(&cfg.model.dtype.as_str()) {
            anyhow::bail!(
                "{}: [model] dtype {:?} must be auto, f32, bf16 or f16",
                path.display(),
                cfg.model.dtype
            );
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("deploy.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn parses_and_resolves_relative_paths() {
        let (dir, path) = write(
            "[model]\npath = \"m\"\n[plugins]\ndirs = [\"p\"]\n[drafter]\nname = \"ngram\"\n[drafter.config]\nmax_ngram = 4\n[sampling]\nmax_tokens = 9\n",
        );
        let cfg = DeployConfig::load(&path).unwrap();
        assert_eq!(cfg.model.path, Some(dir.path().join("m")));
        assert_eq!(cfg.plugins.dirs, vec![dir.path().join("p")]);
        let drafter = cfg.drafter.unwrap();
        assert_eq!(drafter.config["max_ngram"].as_integer(), Some(4));
        assert!(drafter.auto_off);
        // Rounds are sized by measured costs unless the file says otherwise.
        assert!(drafter.fitted_draft_length);
        assert_eq!(cfg.sampling.max_tokens, 9);
        assert_eq!(cfg.sampling.top_p, 1.0);
        assert_eq!(cfg.sampling.drawn_on, DrawnOn::Auto);
        assert_eq!(cfg.model.handoff_layers, None);
    }

    #[test]
    fn the_sampler_place_and_the_hand_off_are_read_and_checked() {
        let (_dir, path) = write(
            "[model]\nhandoff_layers = 3\n[sampling]\ntemperature = 0.8\ndrawn_on = \"host\"\n",
        );
        let cfg = DeployConfig::load(&path).unwrap();
        assert_eq!(cfg.model.handoff_layers, Some(3));
        assert_eq!(cfg.sampling.drawn_on, DrawnOn::Host);
        let (_dir, path) = write("[sampling]\ndrawn_on = \"gpu\"\n");
        let err = format!("{:#}", DeployConfig::load(&path).unwrap_err());
        assert!(
            err.contains("drawn_on") || err.contains("unknown variant"),
            "{err}"
        );
        assert!(err.contains("device"), "the error lists the places: {err}");
    }

    #[test]
    fn errors_name_the_line_and_key() {
        let (_dir, path) = write("[model]\npath = \"m\"\n\n[sampling]\ntemprature = 0.5\n");
        let err = DeployConfig::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("temprature") && err.contains("line 5"),
            "{err}"
        );
        let (_dir, path) = write("[model]\npath = \"m\"\ndevice = \"tpu\"\n");
        let err = DeployConfig::load(&path).unwrap_err().to_string();
        assert!(err.contains("tpu") && err.contains("line 3"), "{err}");
    }
}
