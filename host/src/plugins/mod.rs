//! Finding, checking and loading drafter plugins.
//!
//! A plugin is a folder holding `plugin.toml` and the library it names. The host scans each
//! `--plugins-dir` for such folders (and for a `plugin.toml` directly in the directory), and
//! loads each library only after every check a file can fail without running code: the
//! manifest's fields, the library's presence, its sha256 pin. Then abi_stable compares the
//! library's interface layout with the host's, and the host checks what layouts cannot show:
//! the ABI major and the MLX headers the plugin's mlx-c was built against. Libraries are
//! never unloaded (abi_stable's rule: code a drafter handed out may still be referenced).

use std::fs;
use std::path::{Path, PathBuf};

use abi_stable::library::{lib_header_from_path, LibraryError, RawLibrary};
use abi_stable::std_types::RStr;
use anyhow::{bail, Context, Result};
use mlx_spec_plugin_api::abi::{r1, DraftProviderBox, PluginModuleRef, REVISION_SYMBOL};
use mlx_spec_plugin_api::manifest::Manifest;
use mlx_spec_plugin_api::target_spec::TargetSpec;
use mlx_spec_plugin_api::{ABI_MAJOR, INTERFACE_REVISION, MLX_HEADERS};
use sha2::{Digest, Sha256};

/// One plugin folder found on disk, loaded or not.
pub struct Discovered {
    pub manifest_path: PathBuf,
    /// The manifest, when it parsed.
    pub manifest: Option<Manifest>,
    /// The loaded library, or why it could not be used.
    pub status: Result<Library, String>,
}

impl Discovered {
    pub fn name(&self) -> String {
        match &self.manifest {
            Some(m) => m.plugin.name.clone(),
            None => self
                .manifest_path
                .parent()
                .and_then(|p| p.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "?".to_owned()),
        }
    }
}

/// All plugins of some directories.
pub struct Registry {
    pub plugins: Vec<Discovered>,
}

/// Manifests directly in `dir` or one level below it.
fn manifests_in(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        bail!("plugins directory {} does not exist", dir.display());
    }
    let mut found = Vec::new();
    if dir.join("plugin.toml").is_file() {
        found.push(dir.join("plugin.toml"));
    }
    let mut subdirs: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("plugin.toml").is_file())
        .collect();
    subdirs.sort();
    found.extend(subdirs.into_iter().map(|p| p.join("plugin.toml")));
    Ok(found)
}

/// The readable end of abi_stable's (very long) layout report.
fn condense(err: &LibraryError) -> String {
    let text = err.to_string();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    if lines.len() <= 4 {
        return lines.join(" ");
    }
    let tail = lines
        .iter()
        .rposition(|l| l.starts_with("Error:"))
        .map(|i| lines[i..].join(" "));
    format!(
        "incompatible interface layout: {}",
        tail.unwrap_or_else(|| lines[lines.len() - 3..].join(" "))
    )
}

fn sha256_hex(path: &Path) -> Result<String> {
    let bytes = fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Parses a manifest file.
pub fn read_manifest(path: &Path) -> Result<Manifest, String> {
    let text =
        fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Manifest::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

mod revision1;
pub mod trained_for;

/// A loaded plugin library: its root module, of the interface revision it was built with.
#[derive(Clone, Copy)]
pub enum Module {
    Current(PluginModuleRef),
    Revision1(r1::PluginModuleRef),
}

/// A loaded plugin library.
#[derive(Clone, Copy)]
pub struct Library {
    pub module: Module,
    /// The interface revision it was built with.
    pub revision: u32,
}

/// The interface revision a library exports (`REVISION_SYMBOL`; absent: 1). Opening the file
/// again only finds its handle: the library is never unloaded.
fn exported_revision(path: &Path) -> Result<u32, String> {
    let library = RawLibrary::load_at(path).map_err(|e| e.to_string())?;
    // SAFETY: the SDK's macro exports this symbol as a `u32` static; the symbol's value is
    // its address, read while the library stays loaded.
    let revision = unsafe {
        library
            .get::<*const u32>(REVISION_SYMBOL)
            .map(|address| **address)
            .unwrap_or(1)
    };
    // Never unloaded, like every plugin library.
    std::mem::forget(library);
    Ok(revision)
}

/// The root module's fields every revision has.
struct RootFacts<'a> {
    abi_major: u32,
    mlx_headers: &'a str,
    name: &'a str,
    version: &'a str,
}

/// Runs every check on the plugin described by `manifest_path` and loads its library.
pub fn load(manifest_path: &Path, manifest: &Manifest) -> Result<Library, String> {
    let where_ = manifest_path.display();
    let p = &manifest.plugin;
    if p.api != ABI_MAJOR {
        return Err(format!(
            "{where_}: built for plugin ABI {} but this host speaks ABI {ABI_MAJOR}",
            p.api
        ));
    }
    let file = p.library.for_this_os().ok_or_else(|| {
        format!(
            "{where_}: [plugin] library names no file for {}",
            std::env::consts::OS
        )
    })?;
    let dir = manifest_path.parent().unwrap_or(Path::new("."));
    let library = dir.join(file);
    if !library.is_file() {
        return Err(format!(
            "{where_}: library {} is missing (build the plugin and copy it next to its manifest)",
            library.display()
        ));
    }
    if let Some(want) = &p.sha256 {
        let got = sha256_hex(&library).map_err(|e| format!("{where_}: {e:#}"))?;
        if !got.eq_ignore_ascii_case(want) {
            return Err(format!(
                "{}: sha256 is {got} but {where_} pins {want}",
                library.display()
            ));
        }
    }
    let header = lib_header_from_path(&library)
        .map_err(|e| format!("{}: {}", library.display(), condense(&e)))?;
    let revision = exported_revision(&library).map_err(|e| {
        let first = e.lines().next().unwrap_or_default().to_owned();
        format!("{}: cannot be opened: {first}", library.display())
    })?;
    let module = match revision {
        1 => header
            .init_root_module::<r1::PluginModuleRef>()
            .map(Module::Revision1),
        r if r == INTERFACE_REVISION => header
            .init_root_module::<PluginModuleRef>()
            .map(Module::Current),
        r => {
            return Err(format!(
                "{}: the library was built for plugin interface revision {r}, which this host does not know (it knows 1..={INTERFACE_REVISION}); update mlx-spec",
                library.display()
            ))
        }
    }
    .map_err(|e| format!("{}: {}", library.display(), condense(&e)))?;
    let facts = match module {
        Module::Current(m) => RootFacts {
            abi_major: m.abi_major(),
            mlx_headers: m.mlx_headers().as_str(),
            name: m.name().as_str(),
            version: m.version().as_str(),
        },
        Module::Revision1(m) => RootFacts {
            abi_major: m.abi_major(),
            mlx_headers: m.mlx_headers().as_str(),
            name: m.name().as_str(),
            version: m.version().as_str(),
        },
    };
    if facts.abi_major != ABI_MAJOR {
        return Err(format!(
            "{}: the library was built for plugin ABI {} but this host speaks ABI {ABI_MAJOR}",
            library.display(),
            facts.abi_major
        ));
    }
    check_mlx_headers(MLX_HEADERS, facts.mlx_headers)
        .map_err(|e| format!("{}: {e}", library.display()))?;
    if facts.name != p.name {
        return Err(format!(
            "{}: the library calls itself {:?} but {where_} says {:?}",
            library.display(),
            facts.name,
            p.name
        ));
    }
    if facts.version != p.version {
        return Err(format!(
            "{}: the library is version {} but {where_} says {} (a manifest left beside another build of the library?)",
            library.display(),
            facts.version,
            p.version
        ));
    }
    Ok(Library { module, revision })
}

/// The MLX version a plugin's mlx-c copy was built against must be the host's. "unknown" (a
/// build that found no MLX version header) on either side is refused: two such builds would
/// compare equal without saying anything about the MLX behind their handles.
fn check_mlx_headers(host: &str, plugin: &str) -> Result<(), String> {
    if host == "unknown" {
        return Err("this host was built without knowing its MLX version, so no plugin can be checked against it; rebuild the host with scripts/setup.sh".to_owned());
    }
    if plugin == "unknown" {
        return Err("the library does not know which MLX headers it was built against (its mlx-sys build found no mlx/version.h); rebuild it against the host's patched mlx-sys".to_owned());
    }
    if plugin != host {
        return Err(format!(
            "the library was built against MLX {plugin} but this host uses MLX {host}; rebuild it against the same mlx-sys"
        ));
    }
    Ok(())
}

/// Refuses a plugin whose `[needs]` this target cannot meet: a target family it does not
/// name, or a capability the target lacks (donor K/V needs a KV-owning layer of some kind).
pub fn check_needs(manifest: &Manifest, target: &TargetSpec) -> Result<()> {
    let name = &manifest.plugin.name;
    let families = &manifest.needs.target_families;
    if !families.is_empty() && !families.contains(&target.family) {
        bail!(
            "drafter {name:?} serves targets of family {} but this target is {:?}",
            families.join(", "),
            target.family
        );
    }
    for capability in &manifest.needs.capabilities {
        let offered = match capability.as_str() {
            "donor_kv" => {
                target.donor_layers.sliding.is_some() || target.donor_layers.full.is_some()
            }
            _ => true,
        };
        if !offered {
            bail!("drafter {name:?} needs {capability:?}, which this target does not offer");
        }
    }
    Ok(())
}

/// Marks every plugin whose manifest name another one also has as unusable, naming the other
/// manifests: `--drafter NAME` would otherwise load whichever folder sorts first, silently.
fn refuse_duplicate_names(plugins: &mut [Discovered]) {
    let named: Vec<(Option<String>, PathBuf)> = plugins
        .iter()
        .map(|d| {
            let name = d.manifest.as_ref().map(|m| m.plugin.name.clone());
            (name, d.manifest_path.clone())
        })
        .collect();
    for (i, plugin) in plugins.iter_mut().enumerate() {
        let (Some(name), path) = &named[i] else {
            continue;
        };
        let others: Vec<String> = named
            .iter()
            .enumerate()
            .filter(|(j, (n, _))| *j != i && n.as_ref() == Some(name))
            .map(|(_, (_, p))| p.display().to_string())
            .collect();
        if !others.is_empty() {
            plugin.status = Err(format!(
                "{}: another plugin is also named {name:?} ({}); rename one or remove it from the plugins directories",
                path.display(),
                others.join(", ")
            ));
        }
    }
}

impl Registry {
    /// Discovers (and loads) every plugin in `dirs`. A bad plugin is recorded with its reason;
    /// a missing directory is an error.
    pub fn scan(dirs: &[PathBuf]) -> Result<Self> {
        let mut plugins = Vec::new();
        for dir in dirs {
            for manifest_path in manifests_in(dir)? {
                let (manifest, status) = match read_manifest(&manifest_path) {
                    Ok(m) => {
                        let status = load(&manifest_path, &m);
                        (Some(m), status)
                    }
                    Err(e) => (None, Err(e)),
                };
                if let Err(reason) = &status {
                    tracing::debug!("plugin {} unusable: {reason}", manifest_path.display());
                }
                plugins.push(Discovered {
                    manifest_path,
                    manifest,
                    status,
                });
            }
        }
        refuse_duplicate_names(&mut plugins);
        Ok(Registry { plugins })
    }

    /// The usable plugin called `name`, or an error listing what there is.
    pub fn get(&self, name: &str) -> Result<Plugin<'_>> {
        let found = self.plugins.iter().find(|d| d.name() == name);
        match found {
            Some(Discovered {
                manifest: Some(m),
                status: Ok(library),
                manifest_path,
            }) => Ok(Plugin {
                manifest: m,
                library: *library,
                dir: manifest_path.parent().unwrap_or(Path::new(".")),
            }),
            Some(Discovered {
                status: Err(reason),
                ..
            }) => bail!("drafter {name:?} cannot be used: {reason}"),
            _ => {
                let names: Vec<String> = self.plugins.iter().map(Discovered::name).collect();
                bail!(
                    "no drafter named {name:?} in the plugins directories (found: {})",
                    if names.is_empty() {
                        "none".to_owned()
                    } else {
                        names.join(", ")
                    }
                )
            }
        }
    }
}

/// `[defaults]` key read by the host (tokens asked per round), not passed to the drafter.
pub const HOST_KEY_NUM_DRAFT_TOKENS: &str = "num_draft_tokens";

/// A usable plugin: its manifest, its loaded library and the folder holding both.
#[derive(Clone, Copy)]
pub struct Plugin<'a> {
    pub manifest: &'a Manifest,
    pub library: Library,
    pub dir: &'a Path,
}

/// A drafter's configuration: its manifest's defaults overridden by `overrides`.
fn configuration(manifest: &Manifest, overrides: &toml::Table) -> toml::Table {
    let mut config = manifest.defaults.clone();
    for (k, v) in overrides {
        config.insert(k.clone(), v.clone());
    }
    config
}

/// Builds a drafter from a plugin with its manifest defaults overridden by `overrides`. The
/// drafter resolves relative paths of its configuration against the plugin's folder.
pub fn instantiate(plugin: Plugin<'_>, overrides: &toml::Table) -> Result<DraftProviderBox> {
    let Plugin {
        manifest,
        library,
        dir,
    } = plugin;
    let mut config = configuration(manifest, overrides);
    // A host setting that manifests may carry as a default; the drafter never sees it.
    config.remove(HOST_KEY_NUM_DRAFT_TOKENS);
    let json = serde_json::to_string(&config)
        .context("drafter configuration cannot be expressed as JSON")?;
    let dir = dir
        .canonicalize()
        .unwrap_or_else(|_| dir.to_path_buf())
        .to_string_lossy()
        .into_owned();
    let built = match library.module {
        Module::Current(m) => (m.new_provider())(RStr::from_str(&json), RStr::from_str(&dir)),
        // Revision 1 takes no folder; its provider is adapted to the current interface.
        Module::Revision1(m) => match (m.new_provider())(RStr::from_str(&json)) {
            abi_stable::std_types::ROk(old) => abi_stable::std_types::ROk(revision1::adapt(old)),
            abi_stable::std_types::RErr(e) => abi_stable::std_types::RErr(e),
        },
    };
    match built {
        abi_stable::std_types::ROk(provider) => Ok(provider),
        abi_stable::std_types::RErr(e) => bail!(
            "drafter {:?} refused its configuration: {e}",
            manifest.plugin.name
        ),
    }
}

/// The `trained_for.json` record of the checkpoint a drafter is configured with (the manifest's
/// defaults overridden by `overrides`), when that checkpoint has one.
pub fn trained_for(
    plugin: Plugin<'_>,
    overrides: &toml::Table,
) -> Result<Option<trained_for::TrainedFor>> {
    let config = configuration(plugin.manifest, overrides);
    match trained_for::checkpoint_dir(plugin.dir, &config) {
        Some(dir) => trained_for::TrainedFor::read(&dir)
            .with_context(|| format!("drafter {:?}", plugin.manifest.plugin.name)),
        None => Ok(None),
    }
}

/// Warns on stderr when the drafter `name` was trained for another target than `model`.
pub fn warn_if_trained_for_another_target(
    record: Option<&trained_for::TrainedFor>,
    name: &str,
    model: &crate::model::gemma4::Gemma4Model,
    model_dir: &Path,
) -> Result<()> {
    if let Some(record) = record {
        if let Some(warning) = record.mismatch(model, model_dir)? {
            tracing::warn!("drafter {name:?}: {warning}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_spec_plugin_api::target_spec::{AttentionSpec, DonorLayers, RopeSpec};

    #[test]
    fn mlx_versions_must_be_known_and_equal() {
        assert!(check_mlx_headers("0.32.2", "0.32.2").is_ok());
        let err = check_mlx_headers("0.32.2", "0.32.4").unwrap_err();
        assert!(err.contains("0.32.4") && err.contains("0.32.2"), "{err}");
        // Equal, but saying nothing: refused.
        assert!(check_mlx_headers("unknown", "unknown")
            .unwrap_err()
            .contains("this host"));
        assert!(check_mlx_headers("0.32.2", "unknown")
            .unwrap_err()
            .contains("does not know"));
    }

    fn spec(donors: DonorLayers) -> TargetSpec {
        let attention = AttentionSpec {
            head_dim: 16,
            num_kv_heads: 1,
            k_eq_v: false,
            rope: RopeSpec::Default { theta: 1e4 },
        };
        TargetSpec {
            family: "gemma4".into(),
            fingerprint: 0,
            vocab_size: 256,
            hidden_size: 64,
            num_layers: 2,
            num_attention_heads: 2,
            layer_types: Vec::new(),
            kv_source: vec![0, 1],
            sliding: attention.clone(),
            full: attention,
            sliding_window: 4,
            donor_layers: donors,
            rms_norm_eps: 1e-6,
            final_logit_softcapping: None,
            embed_scale: 8.0,
            dtype: "float32".into(),
            per_layer_input_size: 0,
            config: serde_json::Value::Null,
        }
    }

    #[test]
    fn needs_are_checked_against_the_target() {
        let manifest = |needs: &str| {
            Manifest::parse(&format!(
                "[plugin]\nname = \"x\"\nversion = \"0.1.0\"\nkind = \"other\"\napi = 1\nlibrary = \"libx.so\"\n[needs]\n{needs}\n"
            ))
            .unwrap()
        };
        let with_donors = spec(DonorLayers {
            sliding: Some(0),
            full: Some(1),
        });
        let without = spec(DonorLayers {
            sliding: None,
            full: None,
        });
        let kv = manifest("capabilities = [\"donor_kv\", \"hidden_taps\"]");
        assert!(check_needs(&kv, &with_donors).is_ok());
        let err = check_needs(&kv, &without).unwrap_err().to_string();
        assert!(err.contains("donor_kv"), "{err}");
        let other = manifest("target_families = [\"glm4_moe\"]");
        let err = check_needs(&other, &with_donors).unwrap_err().to_string();
        assert!(err.contains("glm4_moe") && err.contains("gemma4"), "{err}");
        // No families named: any target.
        assert!(check_needs(&manifest(""), &without).is_ok());
    }
}
