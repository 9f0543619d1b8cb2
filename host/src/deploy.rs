//! Deployment config (`mlx-spec run --config deploy.toml`, `mlx-spec serve --config
//! deploy.toml`): the target model, device, plugin directories, drafters and their overrides,
//! sampling defaults, and the server's address, key and limits in one TOML file.
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
//!
//! [drafters.ngram-short]          # more drafters a server request may name (`serve`)
//! plugin = "ngram"                # default: the table's name
//! num_draft_tokens = 4
//! [drafters.ngram-short.config]
//! max_ngram = 2
//!
//! [server]                        # `mlx-spec serve` only
//! host = "127.0.0.1"
//! port = 8000
//! api_key_env = "MLX_SPEC_API_KEY"  # or api_key = "..."; unset: no key
//! default_drafter = "ngram"       # a drafter's name, or "off"; default: [drafter]'s
//! max_active = 8                  # requests generating at once, taking turns by rounds
//! queue_length = 64               # requests waiting beyond those (more: 503)
//! max_prompt_tokens = 8192
//! max_new_tokens = 4096
//! max_body_bytes = 1048576
//! request_timeout_s = 600
//! ```

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;

use crate::device::DeviceKind;

#[derive(Debug, Clone, Default, Deserialize)]
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
    /// More drafters, by the name requests give them (`mlx-spec serve`).
    #[serde(default)]
    pub drafters: std::collections::BTreeMap<String, NamedDrafter>,
    #[serde(default)]
    pub server: ServerSection,
    /// The file and its text, for errors that name a line.
    #[serde(skip)]
    origin: Option<(PathBuf, String)>,
}

/// A `[drafters.NAME]` table: a drafter a server request may ask for by `NAME`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedDrafter {
    /// The plugin's manifest name; default: the table's name.
    pub plugin: Option<String>,
    pub num_draft_tokens: Option<usize>,
    #[serde(default = "default_true")]
    pub auto_off: bool,
    #[serde(default = "default_true")]
    pub fitted_draft_length: bool,
    #[serde(default)]
    pub config: toml::Table,
}

/// `[server]`: where `mlx-spec serve` listens, its key and its limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    #[serde(default = "default_host")]
    pub host: String,
    #[serde(default = "default_port")]
    pub port: u16,
    /// The key clients must send as `Authorization: Bearer KEY`.
    #[serde(default)]
    pub api_key: Option<String>,
    /// The environment variable holding that key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The model id clients send and `/v1/models` lists; default: the model folder's name.
    #[serde(default)]
    pub model_name: Option<String>,
    /// The drafter of requests that do not choose: a drafter's name or `off`; default:
    /// `[drafter]`'s, else off.
    #[serde(default)]
    pub default_drafter: Option<String>,
    #[serde(default = "default_max_active")]
    pub max_active: usize,
    #[serde(default = "default_queue_length")]
    pub queue_length: usize,
    #[serde(default = "default_max_prompt_tokens")]
    pub max_prompt_tokens: usize,
    #[serde(default = "default_max_new_tokens")]
    pub max_new_tokens: usize,
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    #[serde(default = "default_request_timeout_s")]
    pub request_timeout_s: f64,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            host: default_host(),
            port: default_port(),
            api_key: None,
            api_key_env: None,
            model_name: None,
            default_drafter: None,
            max_active: default_max_active(),
            queue_length: default_queue_length(),
            max_prompt_tokens: default_max_prompt_tokens(),
            max_new_tokens: default_max_new_tokens(),
            max_body_bytes: default_max_body_bytes(),
            request_timeout_s: default_request_timeout_s(),
        }
    }
}

fn default_host() -> String {
    "127.0.0.1".to_owned()
}
fn default_port() -> u16 {
    8000
}
fn default_max_active() -> usize {
    8
}
fn default_queue_length() -> usize {
    64
}
fn default_max_prompt_tokens() -> usize {
    8192
}
fn default_max_new_tokens() -> usize {
    4096
}
fn default_max_body_bytes() -> usize {
    1 << 20
}
fn default_request_timeout_s() -> f64 {
    600.0
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
    /// `false` sizes them by recent acceptance alone).
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
        Self::from_text(&text, path)
    }

    /// Parses and checks a deploy file's `text` as if read from `path` (errors name it;
    /// relative paths are resolved against its folder).
    pub fn from_text(text: &str, path: &Path) -> Result<Self> {
        let text = text.to_owned();
        let mut cfg: DeployConfig = toml::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "{}: {}",
                path.display(),
                e.to_string().trim_end().replace('\n', " ")
            )
        })?;
        cfg.origin = Some((path.to_path_buf(), text.clone()));
        let base = path.parent().unwrap_or(Path::new("."));
        // `join` keeps absolute paths as they are.
        cfg.model.path = cfg.model.path.map(|p| base.join(p));
        cfg.plugins.dirs = cfg.plugins.dirs.iter().map(|d| base.join(d)).collect();
        let at = |table: &str, key: &str| at_key(path, &text, table, key);
        if !["auto", "f32", "bf16", "f16"].contains(&cfg.model.dtype.as_str()) {
            anyhow::bail!(
                "{}: [model] dtype {:?} must be auto, f32, bf16 or f16",
                at("model", "dtype"),
                cfg.model.dtype
            );
        }
        let sv = &cfg.server;
        if sv.host.parse::<std::net::IpAddr>().is_err() {
            anyhow::bail!(
                "{}: [server] host {:?} is not an IP address (127.0.0.1, 0.0.0.0, ::1, ...)",
                at("server", "host"),
                sv.host
            );
        }
        if sv.api_key.is_some() && sv.api_key_env.is_some() {
            anyhow::bail!(
                "{}: [server] sets both api_key and api_key_env; keep one",
                at("server", "api_key_env")
            );
        }
        if sv.api_key.as_deref() == Some("") {
            anyhow::bail!("{}: [server] api_key is empty", at("server", "api_key"));
        }
        let positive = [
            ("max_active", sv.max_active),
            ("max_prompt_tokens", sv.max_prompt_tokens),
            ("max_new_tokens", sv.max_new_tokens),
            ("max_body_bytes", sv.max_body_bytes),
        ];
        for (key, value) in positive {
            if value == 0 {
                anyhow::bail!("{}: [server] {key} must be at least 1", at("server", key));
            }
        }
        if !(sv.request_timeout_s.is_finite() && sv.request_timeout_s > 0.0) {
            anyhow::bail!(
                "{}: [server] request_timeout_s must be a positive number of seconds, got {}",
                at("server", "request_timeout_s"),
                sv.request_timeout_s
            );
        }
        for (name, d) in &cfg.drafters {
            let table = format!("drafters.{name}");
            if name == "off" || name.is_empty() {
                anyhow::bail!(
                    "{}: a drafter cannot be named {name:?}",
                    at_table(path, &text, &table)
                );
            }
            if cfg.drafter.as_ref().is_some_and(|main| &main.name == name) {
                anyhow::bail!(
                    "{}: [drafters.{name}] has the name of [drafter]; give it another",
                    at_table(path, &text, &table)
                );
            }
            if matches!(d.num_draft_tokens, Some(k) if k == 0 || k > 64) {
                anyhow::bail!(
                    "{}: [{table}] num_draft_tokens must be between 1 and 64",
                    at(&table, "num_draft_tokens")
                );
            }
        }
        if let Some(main) = &cfg.drafter {
            if matches!(main.num_draft_tokens, Some(k) if k == 0 || k > 64) {
                anyhow::bail!(
                    "{}: [drafter] num_draft_tokens must be between 1 and 64",
                    at("drafter", "num_draft_tokens")
                );
            }
        }
        if let Some(default) = &sv.default_drafter {
            let known = default == "off"
                || cfg.drafters.contains_key(default)
                || cfg.drafter.as_ref().is_some_and(|d| &d.name == default);
            if !known {
                anyhow::bail!(
                    "{}: [server] default_drafter {default:?} is neither \"off\" nor a drafter of this file ({})",
                    at("server", "default_drafter"),
                    cfg.drafter_names().join(", ")
                );
            }
        }
        Ok(cfg)
    }

    /// Where `[table]` (and `key` in it) is written: `FILE line N (key)`, or a note that the
    /// setting is a default when no file was read or it leaves the key out.
    pub fn locate(&self, table: &str, key: Option<&str>) -> String {
        match (&self.origin, key) {
            (Some((path, text)), Some(key)) => at_key(path, text, table, key),
            (Some((path, text)), None) => format!("{} ([{table}])", at_table(path, text, table)),
            (None, _) => format!("[{table}] (default settings)"),
        }
    }

    /// The drafters this file configures, by the names requests give them: `[drafter]`'s
    /// first, then the `[drafters.NAME]` tables.
    pub fn drafter_names(&self) -> Vec<String> {
        self.drafter
            .iter()
            .map(|d| d.name.clone())
            .chain(self.drafters.keys().cloned())
            .collect()
    }
}

/// `FILE:LINE` of `key` in `[table]` of a deploy file's `text` (`FILE` alone when the key is
/// not written there: a default).
fn at_key(path: &Path, text: &str, table: &str, key: &str) -> String {
    match line_of(text, table, Some(key)) {
        Some(line) => format!("{} line {line} ({key})", path.display()),
        None => path.display().to_string(),
    }
}

/// `FILE:LINE` of the header of `[table]`.
fn at_table(path: &Path, text: &str, table: &str) -> String {
    match line_of(text, table, None) {
        Some(line) => format!("{} line {line}", path.display()),
        None => path.display().to_string(),
    }
}

/// The 1-based line of `key` inside `[table]` (or of the table's header, without a key).
/// Tables are matched by their header text with spaces and quotes removed.
fn line_of(text: &str, table: &str, key: Option<&str>) -> Option<usize> {
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.starts_with('[') {
            current = t
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or_default()
                .chars()
                .filter(|c| !c.is_whitespace() && *c != '"' && *c != '\'')
                .collect();
            if key.is_none() && current == table {
                return Some(i + 1);
            }
            continue;
        }
        if let Some(key) = key {
            if current == table {
                let name = t.split('=').next().unwrap_or_default().trim();
                if name.trim_matches('"') == key && t.contains('=') {
                    return Some(i + 1);
                }
            }
        }
    }
    None
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
    fn the_server_table_has_loopback_defaults_and_named_drafters() {
        let (_dir, path) = write(
            "[drafter]\nname = \"ngram\"\n[drafters.short]\nplugin = \"ngram\"\nnum_draft_tokens = 2\n[drafters.short.config]\nmax_ngram = 2\n[server]\nport = 9001\nmax_active = 2\n",
        );
        let cfg = DeployConfig::load(&path).unwrap();
        assert_eq!(cfg.server.host, "127.0.0.1");
        assert_eq!(cfg.server.port, 9001);
        assert_eq!(cfg.server.max_active, 2);
        assert_eq!(cfg.drafter_names(), vec!["ngram", "short"]);
        let short = &cfg.drafters["short"];
        assert_eq!(short.plugin.as_deref(), Some("ngram"));
        assert_eq!(short.num_draft_tokens, Some(2));
        assert_eq!(short.config["max_ngram"].as_integer(), Some(2));
        // Nothing written: the defaults, bound to loopback.
        let (_dir, path) = write("");
        let cfg = DeployConfig::load(&path).unwrap();
        assert_eq!(cfg.server.host, "127.0.0.1");
        assert!(cfg.server.api_key.is_none() && cfg.drafters.is_empty());
    }

    #[test]
    fn the_shipped_server_deployment_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/serve.toml");
        let cfg = DeployConfig::load(&path).unwrap();
        assert_eq!(cfg.server.host, "127.0.0.1");
        assert_eq!(
            cfg.drafter_names(),
            vec!["ngram", "assistant", "ngram-short"]
        );
        assert_eq!(cfg.drafters["assistant"].plugin, None);
        assert_eq!(cfg.drafters["ngram-short"].plugin.as_deref(), Some("ngram"));
    }

    #[test]
    fn bad_server_settings_name_their_line_and_key() {
        let cases = [
            (
                "[model]\n\n[server]\nhost = \"localhost:80\"\n",
                "line 4 (host)",
            ),
            ("[server]\nport = 70000\n", "line 2"),
            ("[server]\nmax_active = 0\n", "line 2 (max_active)"),
            (
                "[server]\n\nrequest_timeout_s = -1.0\n",
                "line 3 (request_timeout_s)",
            ),
            (
                "[server]\napi_key = \"a\"\napi_key_env = \"B\"\n",
                "line 3 (api_key_env)",
            ),
            ("[server]\nqueue = 3\n", "line 2"),
            (
                "[drafter]\nname = \"ngram\"\n[server]\ndefault_drafter = \"ngarm\"\n",
                "line 4 (default_drafter)",
            ),
            (
                "[drafters.short]\nplugin = \"ngram\"\nnum_draft_tokens = 0\n",
                "line 3 (num_draft_tokens)",
            ),
            ("[drafter]\nname = \"x\"\n[drafters.x]\n", "line 3"),
        ];
        for (text, want) in cases {
            let (_dir, path) = write(text);
            let err = format!("{:#}", DeployConfig::load(&path).unwrap_err());
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(err.contains("deploy.toml"), "{err}");
        }
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
