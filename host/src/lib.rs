//! mlx-spec: a speculative-decoding host for Gemma 4 on MLX.
//!
//! The library holds everything the `mlx-spec` binary runs: the Gemma 4 target
//! ([`model::gemma4`]) and checkpoint loading ([`weights`]), from the `mlx-spec-model` crate;
//! the tokenizer and chat format ([`tokenizer`]), the sampler ([`sampler`]), device selection
//! ([`device`]), plain generation ([`generate`]), drafter plugins ([`plugins`]), the verify
//! loop ([`speculative`]), mlx-spec's own CUDA kernels for the decode step ([`kernels`], from
//! the `mlx-spec-kernels` crate), and the OpenAI-compatible server ([`server`]).

pub mod bench;
pub mod calibrate;
pub mod command_line;
pub mod deploy;
pub mod device;
pub mod generate;
pub mod load;
pub mod perplexity;
pub mod plugins;
pub mod quantize_drafter;
pub mod sampler;
pub mod scaffold;
pub mod server;
pub mod speculative;
pub mod tokenizer;

/// The Gemma 4 model, its checkpoint loading and device helpers live in their own crate,
/// shared with plugins that run a Gemma 4 of their own; re-exported under their old paths.
pub use mlx_spec_model as model;
pub use mlx_spec_model::weights;

/// The fused CUDA kernels, the model's fast path on a CUDA GPU, live in their own crate too.
pub use mlx_spec_kernels as kernels;

/// The default model's folder under [`home`]: a small Gemma 4 trained on Python code
/// (`models/gemma4-code-25m-v2/README.md`).
pub const DEFAULT_MODEL_DIR: &str = "models/gemma4-code-25m-v2";

/// The variable that names mlx-spec's home folder, overriding where the binary looks.
pub const HOME_VAR: &str = "MLX_SPEC_HOME";

/// The folder holding mlx-spec's default model (`models/`) and drafter plugins (`plugins/`):
/// `$MLX_SPEC_HOME` when set; else found from the executable: `PREFIX/share/mlx-spec` for a
/// binary installed as `PREFIX/bin/mlx-spec` (`scripts/install.sh`), the checkout for a binary
/// built in one (`target/<profile>/mlx-spec`); else the working directory. So the default
/// model and plugins are found from any working directory.
pub fn home() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os(HOME_VAR).filter(|v| !v.is_empty()) {
        return dir.into();
    }
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| std::fs::canonicalize(p).ok());
    exe.as_deref()
        .and_then(home_beside_executable)
        .unwrap_or_else(|| std::path::PathBuf::from("."))
}

/// The home of an executable at `exe`, if one of the known layouts holds a `models` or
/// `plugins` folder.
pub fn home_beside_executable(exe: &std::path::Path) -> Option<std::path::PathBuf> {
    let bin = exe.parent()?;
    let installed = bin
        .parent()
        .map(|prefix| prefix.join("share").join("mlx-spec"));
    // target/<profile>/mlx-spec, or target/<profile>/deps/<test binary> for the tests.
    let checkout = bin.ancestors().find_map(|dir| {
        (dir.file_name()? == "target")
            .then(|| dir.parent())
            .flatten()
            .map(std::path::Path::to_path_buf)
    });
    [installed, checkout]
        .into_iter()
        .flatten()
        .find(|dir| dir.join("models").is_dir() || dir.join("plugins").is_dir())
}

/// The default model folder: [`DEFAULT_MODEL_DIR`] under [`home`].
pub fn default_model_path() -> std::path::PathBuf {
    home().join(DEFAULT_MODEL_DIR)
}

/// The default plugins directory: `plugins` under [`home`].
pub fn default_plugins_dir() -> std::path::PathBuf {
    home().join("plugins")
}

/// mlx-rs seeds its implicit random state from `mach_approximate_time`, a macOS-only symbol.
/// Linux builds provide it here so that the binary links; the value only seeds a default
/// RNG that mlx-spec never relies on (sampling keys are explicit).
#[cfg(not(target_vendor = "apple"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::home_beside_executable;

    #[test]
    fn home_is_found_beside_an_installed_or_a_built_binary() {
        let root = tempfile::tempdir().unwrap();
        let prefix = root.path().join("prefix");
        std::fs::create_dir_all(prefix.join("bin")).unwrap();
        std::fs::create_dir_all(prefix.join("share/mlx-spec/plugins")).unwrap();
        assert_eq!(
            home_beside_executable(&prefix.join("bin/mlx-spec")),
            Some(prefix.join("share/mlx-spec"))
        );
        let checkout = root.path().join("checkout");
        std::fs::create_dir_all(checkout.join("target/release/deps")).unwrap();
        std::fs::create_dir_all(checkout.join("models")).unwrap();
        assert_eq!(
            home_beside_executable(&checkout.join("target/release/mlx-spec")),
            Some(checkout.clone())
        );
        assert_eq!(
            home_beside_executable(&checkout.join("target/release/deps/cli-0123")),
            Some(checkout)
        );
        // A binary elsewhere, with neither folder beside it: no home.
        let lone = root.path().join("lone/bin");
        std::fs::create_dir_all(&lone).unwrap();
        assert_eq!(home_beside_executable(&lone.join("mlx-spec")), None);
    }
}
