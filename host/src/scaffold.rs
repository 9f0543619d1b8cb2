//! `mlx-spec plugins new`: writes a drafter crate an author builds outside the mlx-spec tree.
//!
//! The crate it writes builds as it comes and loads with `plugins check`: a manifest, a
//! `Cargo.toml` that depends on this host's SDK (its interface revision recorded), and a
//! drafter that reads the target through the ports of a neural drafter (its description and a
//! hidden-state tap) while proposing the simplest thing (the last token again), with a test.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use mlx_spec_plugin_api::manifest::KNOWN_KINDS;
use mlx_spec_plugin_api::{ABI_MAJOR, INTERFACE_REVISION};

/// What to write and where.
pub struct Scaffold {
    /// The drafter's name (manifest `name`, `--drafter NAME`).
    pub name: String,
    /// Manifest `kind`.
    pub kind: String,
    /// The folder to create (must not exist).
    pub dir: PathBuf,
    /// The SDK crate (`plugin-api` of an mlx-spec checkout).
    pub sdk: PathBuf,
    /// The patched mlx-sys the host was built with (Linux), if any.
    pub mlx_sys: Option<PathBuf>,
}

/// `name` as a Rust identifier stem: `my-drafter` -> `my_drafter`.
fn crate_stem(name: &str) -> String {
    name.replace('-', "_")
}

/// `name` in upper camel case for the drafter's type: `my-drafter` -> `MyDrafter`.
fn type_name(name: &str) -> String {
    name.split(['-', '_'])
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            match c.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + c.as_str(),
                None => String::new(),
            }
        })
        .collect()
}

/// A path as TOML writes it (forward slashes, quoted).
fn toml_path(p: &Path) -> String {
    format!("{:?}", p.to_string_lossy().replace('\\', "/"))
}

impl Scaffold {
    /// Checks the inputs and writes the crate.
    pub fn write(&self) -> Result<()> {
        let name = &self.name;
        let valid = !name.is_empty()
            && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !valid {
            bail!("plugin name {name:?} must start with a letter and hold only ASCII letters, digits, '-' or '_'");
        }
        if !KNOWN_KINDS.contains(&self.kind.as_str()) {
            bail!(
                "kind {:?} is not one of {}",
                self.kind,
                KNOWN_KINDS.join(", ")
            );
        }
        if self.dir.exists() {
            bail!("{} already exists: choose a new folder", self.dir.display());
        }
        if !self.sdk.join("Cargo.toml").is_file() || !self.sdk.join("src/sdk.rs").is_file() {
            bail!(
                "{} is not the mlx-spec plugin SDK (plugin-api of an mlx-spec checkout); give it with --sdk",
                self.sdk.display()
            );
        }
        let sdk = fs::canonicalize(&self.sdk)
            .with_context(|| format!("cannot resolve {}", self.sdk.display()))?;
        let mlx_sys = match &self.mlx_sys {
            Some(p) => Some(
                fs::canonicalize(p).with_context(|| format!("cannot resolve {}", p.display()))?,
            ),
            None => None,
        };
        fs::create_dir_all(self.dir.join("src"))
            .with_context(|| format!("cannot create {}", self.dir.display()))?;
        let files = [
            ("Cargo.toml", self.cargo_toml(&sdk, mlx_sys.as_deref())),
            ("plugin.toml", self.manifest()),
            ("src/lib.rs", self.lib_rs()),
            (
                ".gitignore",
                "/target\nCargo.lock\n*.so\n*.dylib\n".to_owned(),
            ),
        ];
        for (file, text) in files {
            let path = self.dir.join(file);
            fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    }

    fn cargo_toml(&self, sdk: &Path, mlx_sys: Option<&Path>) -> String {
        let sdk_version = env!("CARGO_PKG_VERSION");
        let patch = match mlx_sys {
            Some(p) => format!(
                "\n# The patched mlx-sys the host was built with: host and plugin must share one MLX,\n\
                 # which the host checks when it loads the library.\n\
                 [patch.crates-io]\nmlx-sys = {{ path = {} }}\n",
                toml_path(p)
            ),
            None => String::new(),
        };
        format!(
            "# A drafter plugin for mlx-spec (made by `mlx-spec plugins new`).\n\
             [package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n\
             [lib]\ncrate-type = [\"cdylib\"]\n\n\
             [dependencies]\n\
             # The SDK of the host you target: interface revision {INTERFACE_REVISION}, plugin ABI {ABI_MAJOR}.\n\
             mlx-spec-plugin-api = {{ path = {sdk}, version = \"={sdk_version}\" }}\n\
             abi_stable = \"0.11\"\n\n\
             # Not part of another workspace.\n[workspace]\n{patch}",
            name = self.name,
            sdk = toml_path(sdk),
        )
    }

    fn manifest(&self) -> String {
        let stem = crate_stem(&self.name);
        format!(
            "[plugin]\nname = \"{name}\"\nversion = \"0.1.0\"\nkind = \"{kind}\"\napi = {ABI_MAJOR}\n\
             library = {{ linux = \"lib{stem}.so\", macos = \"lib{stem}.dylib\" }}\n\
             description = \"Proposes the last token again; checks it sees every verified position\"\n\n\
             [needs]\ncapabilities = [\"hidden_taps\", \"target_spec\"]\ntarget_families = [\"gemma4\"]\n\n\
             [defaults]\nrepeat = 2\nnum_draft_tokens = 4\n",
            name = self.name,
            kind = self.kind,
        )
    }

    fn lib_rs(&self) -> String {
        TEMPLATE
            .replace("__NAME__", &self.name)
            .replace("__TYPE__", &type_name(&self.name))
    }
}

/// The drafter's source; `__NAME__` and `__TYPE__` are replaced.
const TEMPLATE: &str = r#"//! The `__NAME__` drafter: a starting point. It proposes the history's last token again (at
//! most `repeat` times), and reads the target as a neural drafter does: it checks the pairing
//! against the target's description when a request opens, and asks for the final-norm hidden
//! state of every verified position, refusing to go on if a position is missing.
//!
//! Build: `cargo build --release`; copy `target/release/lib<name>.so` next to `plugin.toml`;
//! `mlx-spec plugins check .`; run with `--drafter __NAME__ --plugins-dir <parent folder>`.

use mlx_spec_plugin_api::serde_json::Value;
use mlx_spec_plugin_api::{
    declare_drafter_plugin, Drafter, DrafterSession, Proposal, SamplingInfo, Target, TargetInfo,
    Taps,
};

pub struct __TYPE__ {
    repeat: usize,
}

impl Drafter for __TYPE__ {
    type Session = __TYPE__Session;

    fn from_config(config: &Value) -> Result<Self, String> {
        let mut repeat = 2;
        for (key, value) in config.as_object().ok_or("the configuration must be a table")? {
            match key.as_str() {
                "repeat" => {
                    repeat = value
                        .as_u64()
                        .filter(|&r| r > 0)
                        .ok_or("`repeat` must be a positive integer")?
                        as usize
                }
                other => return Err(format!("unknown setting `{other}` (known: repeat)")),
            }
        }
        Ok(__TYPE__ { repeat })
    }

    fn open_for(
        &self,
        info: &TargetInfo,
        target: &Target<'_>,
        _sampling: &SamplingInfo,
    ) -> Result<__TYPE__Session, String> {
        let spec = target.spec()?;
        if spec.vocab_size != info.vocab_size as usize {
            return Err(format!(
                "the target's description says vocabulary {} but its info says {}",
                spec.vocab_size, info.vocab_size
            ));
        }
        Ok(__TYPE__Session {
            repeat: self.repeat,
            tap: spec.final_hidden_tap(),
            hidden_size: spec.hidden_size,
            next_position: 0,
        })
    }
}

pub struct __TYPE__Session {
    repeat: usize,
    /// The tap point of the final-norm hidden state.
    tap: i32,
    hidden_size: usize,
    /// The position the next delivered row must hold.
    next_position: u64,
}

impl __TYPE__Session {
    /// Checks a delivery continues the previous one with rows of the target's width.
    fn check(&mut self, first_position: u64, rows: usize, width: usize) -> Result<(), String> {
        if first_position != self.next_position {
            return Err(format!(
                "taps start at position {first_position}, expected {}",
                self.next_position
            ));
        }
        if width != self.hidden_size {
            return Err(format!(
                "tapped rows are {width} wide, the target's hidden size is {}",
                self.hidden_size
            ));
        }
        self.next_position += rows as u64;
        Ok(())
    }
}

impl DrafterSession for __TYPE__Session {
    fn tap_layers(&self) -> Vec<i32> {
        vec![self.tap]
    }

    fn receive_taps(&mut self, taps: Taps) -> Result<(), String> {
        let rows = taps.layers.first().ok_or("no tapped layer delivered")?;
        let width = rows.shape()[1] as usize;
        self.check(taps.first_position, taps.rows(), width)
    }

    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        _step_base: u64,
        target: &Target<'_>,
    ) -> Result<Proposal, String> {
        // Every position before the anchor (the history's last token) has been delivered.
        if self.next_position != target.position() {
            return Err(format!(
                "taps reached position {}, the target is at {}",
                self.next_position,
                target.position()
            ));
        }
        let last = *history.last().ok_or("empty history")?;
        Ok(Proposal::tokens(vec![last; n.min(self.repeat)]))
    }
}

declare_drafter_plugin!("__NAME__", __TYPE__);

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> __TYPE__Session {
        __TYPE__Session {
            repeat: 2,
            tap: 4,
            hidden_size: 8,
            next_position: 0,
        }
    }

    #[test]
    fn deliveries_must_continue_each_other() {
        let mut s = session();
        s.check(0, 5, 8).unwrap();
        s.check(5, 1, 8).unwrap();
        assert!(s.check(7, 1, 8).unwrap_err().contains("expected 6"));
    }

    #[test]
    fn rows_must_be_as_wide_as_the_target() {
        assert!(session().check(0, 1, 7).unwrap_err().contains("hidden size is 8"));
    }

    #[test]
    fn settings_are_checked_by_name() {
        let bad = mlx_spec_plugin_api::serde_json::json!({"repeats": 3});
        assert!(__TYPE__::from_config(&bad).err().unwrap().contains("repeats"));
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_a_type_and_a_library_stem() {
        assert_eq!(type_name("my-first_drafter"), "MyFirstDrafter");
        assert_eq!(crate_stem("my-drafter"), "my_drafter");
    }

    #[test]
    fn bad_names_kinds_and_existing_folders_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugin-api");
        let make = |name: &str, kind: &str, dir: &Path| Scaffold {
            name: name.into(),
            kind: kind.into(),
            dir: dir.to_path_buf(),
            sdk: sdk.clone(),
            mlx_sys: None,
        };
        let err = make("9lives", "other", &root.path().join("a"))
            .write()
            .unwrap_err();
        assert!(err.to_string().contains("9lives"), "{err}");
        let err = make("ok", "magic", &root.path().join("b"))
            .write()
            .unwrap_err();
        assert!(err.to_string().contains("magic"), "{err}");
        let err = make("ok", "other", root.path()).write().unwrap_err();
        assert!(err.to_string().contains("already exists"), "{err}");
        make("fine-one", "other", &root.path().join("c"))
            .write()
            .unwrap();
        let lib = std::fs::read_to_string(root.path().join("c/src/lib.rs")).unwrap();
        assert!(
            lib.contains("pub struct FineOne") && !lib.contains("__"),
            "{lib}"
        );
    }
}
