//! mlx-spec: a speculative-decoding host for Gemma 4 on MLX.
//!
//! The library holds everything the `mlx-spec` binary runs: the Gemma 4 target
//! ([`model::gemma4`]), checkpoint loading ([`weights`]), the tokenizer and chat format
//! ([`tokenizer`]), the sampler ([`sampler`]), device selection ([`device`]), plain
//! generation ([`generate`]), drafter plugins ([`plugins`]), the verify loop ([`speculative`]) and
//! mlx-spec's own CUDA kernels for the decode step ([`kernels`]).

pub mod deploy;
pub mod device;
pub mod diagnostics;
pub mod generate;
pub mod kernels;
pub mod model;
pub mod plugins;
pub mod sampler;
pub mod speculative;
pub mod tokenizer;
pub mod weights;

/// Where the repo keeps the default model: a small Gemma 4 trained on Python code
/// (`models/gemma4-code-7m/README.md`).
pub const DEFAULT_MODEL_DIR: &str = "models/gemma4-code-7m";

/// The default model folder: next to the binary's repository checkout (`target/release/..`)
/// when there is one, else relative to the working directory.
pub fn default_model_path() -> std::path::PathBuf {
    let beside_binary = std::env::current_exe().ok().and_then(|exe| {
        exe.parent()?
            .parent()?
            .parent()
            .map(|root| root.join(DEFAULT_MODEL_DIR))
    });
    match beside_binary {
        Some(p) if p.join("config.json").is_file() => p,
        _ => std::path::PathBuf::from(DEFAULT_MODEL_DIR),
    }
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
