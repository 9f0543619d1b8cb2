//! `plugin.toml`: what a drafter library is, what it needs from the host, and its defaults.
//!
//! ```toml
//! [plugin]
//! name = "ngram"
//! version = "0.1.0"
//! kind = "ngram"                       # ngram | assistant | dflash | deepspec | mtp | draft-model | other
//! api = 1                              # plugin ABI major
//! library = "libmlx_spec_ngram.so"     # or { linux = "….so", macos = "….dylib" }
//! # sha256 = "…"                       # optional pin of the library file
//!
//! [needs]
//! capabilities = []                    # of: embeddings, lm_head, hidden_taps, donor_kv, target_spec
//! target_families = ["gemma4"]
//!
//! [defaults]                           # the drafter's configuration; a run may override keys
//! max_ngram = 3
//! ```

use std::collections::BTreeMap;

use serde::Deserialize;

/// Target capabilities a host offers drafters today: scaled embeddings, logits from hidden
/// states, hidden-state taps, donor K/V, and the target's description.
pub const KNOWN_CAPABILITIES: [&str; 5] = [
    "embeddings",
    "lm_head",
    "hidden_taps",
    "donor_kv",
    "target_spec",
];

/// Drafter kinds.
pub const KNOWN_KINDS: [&str; 7] = [
    "ngram",
    "assistant",
    "dflash",
    "deepspec",
    "mtp",
    "draft-model",
    "other",
];

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub plugin: PluginSection,
    #[serde(default)]
    pub needs: NeedsSection,
    #[serde(default)]
    pub defaults: toml::Table,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSection {
    pub name: String,
    pub version: String,
    pub kind: String,
    pub api: u32,
    pub library: LibraryName,
    #[serde(default)]
    pub sha256: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
}

/// One file name for every OS, or one per OS.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum LibraryName {
    Same(String),
    PerOs(BTreeMap<String, String>),
}

impl LibraryName {
    /// The file name for the OS this code runs on (`linux`, `macos`, `windows`).
    pub fn for_this_os(&self) -> Option<&str> {
        match self {
            LibraryName::Same(name) => Some(name),
            LibraryName::PerOs(map) => map.get(std::env::consts::OS).map(String::as_str),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NeedsSection {
    #[serde(default)]
    pub capabilities: Vec<String>,
    #[serde(default)]
    pub target_families: Vec<String>,
}

impl Manifest {
    /// Parses and checks a manifest; errors carry the line and key.
    pub fn parse(text: &str) -> Result<Self, String> {
        let m: Manifest =
            toml::from_str(text).map_err(|e| e.to_string().trim_end().replace('\n', " "))?;
        if m.plugin.name.is_empty()
            || !m
                .plugin
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(format!(
                "[plugin] name {:?} must be non-empty ASCII letters, digits, '-' or '_'",
                m.plugin.name
            ));
        }
        if !KNOWN_KINDS.contains(&m.plugin.kind.as_str()) {
            return Err(format!(
                "[plugin] kind {:?} is not one of {}",
                m.plugin.kind,
                KNOWN_KINDS.join(", ")
            ));
        }
        for cap in &m.needs.capabilities {
            if !KNOWN_CAPABILITIES.contains(&cap.as_str()) {
                return Err(format!(
                    "[needs] capability {cap:?} is not offered by this host (it offers: {})",
                    KNOWN_CAPABILITIES.join(", ")
                ));
            }
        }
        if let Some(hash) = &m.plugin.sha256 {
            if hash.len() != 64 || !hash.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err("[plugin] sha256 must be 64 hexadecimal digits".to_owned());
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[plugin]
name = "ngram"
version = "0.1.0"
kind = "ngram"
api = 1
library = { linux = "libx.so", macos = "libx.dylib" }
[needs]
target_families = ["gemma4"]
[defaults]
max_ngram = 3
"#;

    #[test]
    fn parses_a_manifest_with_per_os_library_names() {
        let m = Manifest::parse(GOOD).unwrap();
        assert_eq!(m.plugin.name, "ngram");
        assert_eq!(m.defaults["max_ngram"].as_integer(), Some(3));
        if cfg!(target_os = "linux") {
            assert_eq!(m.plugin.library.for_this_os(), Some("libx.so"));
        }
    }

    #[test]
    fn wrong_fields_are_named_with_their_line() {
        let err = Manifest::parse(&GOOD.replace("api = 1", "api = \"one\"")).unwrap_err();
        assert!(err.contains("api") && err.contains("line"), "{err}");
        let err =
            Manifest::parse(&GOOD.replace("kind = \"ngram\"", "kind = \"ngram\"\nflavour = 2"))
                .unwrap_err();
        assert!(err.contains("flavour"), "{err}");
        let err =
            Manifest::parse(&GOOD.replace("kind = \"ngram\"", "kind = \"magic\"")).unwrap_err();
        assert!(err.contains("magic"), "{err}");
        let err =
            Manifest::parse(&GOOD.replace("[needs]", "[needs]\ncapabilities = [\"telepathy\"]"))
                .unwrap_err();
        assert!(err.contains("telepathy"), "{err}");
    }
}
