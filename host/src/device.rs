//! Device selection at run time (`--device cpu|gpu`), never at build time: the same binary
//! runs on the CPU libmlx, on a CUDA libmlx swapped in by library path, or on Metal.

use anyhow::{bail, Result};
use mlx_rs::{Device, DeviceType};
pub use mlx_spec_kernels::cuda::{
    cuda_compute_capability, cuda_multiprocessor_count, cuda_runtime, cuda_shared_through_mps,
    KERNEL_CACHE_VAR,
};
pub use mlx_spec_model::device::{default_is, mlx_version};

/// Where the model runs.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

/// Whether the loaded libmlx can run on `kind`.
pub fn is_available(kind: DeviceKind) -> bool {
    let device_type = match kind {
        DeviceKind::Cpu => mlx_sys::mlx_device_type__MLX_CPU,
        DeviceKind::Gpu => mlx_sys::mlx_device_type__MLX_GPU,
    };
    let mut available = false;
    // SAFETY: the probe handle is created, queried and freed here.
    unsafe {
        let device = mlx_sys::mlx_device_new_type(device_type, 0);
        let rc = mlx_sys::mlx_device_is_available(&mut available, device);
        mlx_sys::mlx_device_free(device);
        rc == 0 && available
    }
}

/// Makes `kind` the default device of this process, or explains why it cannot be used.
pub fn select(kind: DeviceKind) -> Result<()> {
    if !is_available(kind) {
        match kind {
            DeviceKind::Gpu => bail!(
                "--device gpu: the loaded libmlx {} has no GPU backend (it is a CPU build, or no GPU is visible). \
                 On Linux, point LD_LIBRARY_PATH at the libmlx of mlx-cuda-13=={} (see bench/gpu/README.md)",
                mlx_version(),
                mlx_version()
            ),
            DeviceKind::Cpu => bail!("--device cpu: the loaded libmlx reports no CPU device"),
        }
    }
    if kind == DeviceKind::Gpu {
        keep_kernels_across_runs();
        cut_graphs_at_measured_budget();
    }
    let device = match kind {
        DeviceKind::Cpu => Device::new(DeviceType::Cpu, 0),
        DeviceKind::Gpu => Device::new(DeviceType::Gpu, 0),
    };
    Device::set_default(&device);
    Ok(())
}

/// Where compiled kernels are kept when [`KERNEL_CACHE_VAR`] is unset: under the user's cache
/// directory (`$XDG_CACHE_HOME`, else `$HOME/.cache`), one folder per libmlx version, since a
/// kernel compiled against one version's headers may not suit another. `None` without either
/// variable.
pub fn default_kernel_cache(
    xdg_cache_home: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
    mlx_version: &str,
) -> Option<std::path::PathBuf> {
    let base = match (xdg_cache_home.filter(|v| !v.is_empty()), home) {
        (Some(xdg), _) => std::path::PathBuf::from(xdg),
        (None, Some(home)) if !home.is_empty() => std::path::PathBuf::from(home).join(".cache"),
        _ => return None,
    };
    Some(
        base.join("mlx-spec")
            .join(format!("mlx-{mlx_version}"))
            .join("kernels"),
    )
}

/// Points MLX's CUDA kernel cache at [`default_kernel_cache`] unless the user chose one.
/// MLX's own default is a folder of the system's temporary directory: emptied at reboot on
/// many machines, and unwritable for a second user once a first one made it, so every run
/// would compile every kernel again, the window kernels of speculative decoding among them
/// (about 20 s on an H200 for the first verify window of a size, BENCHMARKS.md). Must run
/// before MLX compiles its first kernel, which reads the variable once.
fn keep_kernels_across_runs() {
    if std::env::var_os(KERNEL_CACHE_VAR).is_some() {
        return;
    }
    let Some(dir) = default_kernel_cache(
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
        &mlx_version(),
    ) else {
        return;
    };
    match std::fs::create_dir_all(&dir) {
        Ok(()) => {
            tracing::info!("compiled kernels are kept in {}", dir.display());
            std::env::set_var(KERNEL_CACHE_VAR, &dir);
        }
        Err(e) => tracing::warn!(
            "cannot create the kernel cache {} ({e}); MLX keeps compiled kernels in its \
             temporary folder (set {KERNEL_CACHE_VAR} to choose one)",
            dir.display()
        ),
    }
}

/// MLX's variable naming how many megabytes of inputs one of its CUDA graphs (a Metal command
/// buffer on macOS) may hold before MLX commits it.
pub const GRAPH_BUDGET_VAR: &str = "MLX_MAX_MB_PER_BUFFER";

/// The budget mlx-spec gives MLX's CUDA graphs where the user set none, in MB. A decode step
/// reads every weight once, so the budget decides how many graphs a step is cut into: MLX's
/// own 1 000 MB cuts a 12B step into about 24 and a 31B step into about 61, each with its
/// update and launch on the host and a gap on the device. On an H200 (BENCHMARKS.md, "graphs
/// of 4 000 MB") 4 000 MB decoded faster than 1 000 for E4B, 12B and 31B alike (by 0.4-1.5
/// %), while 16 000 and 100 000 lost up to 14 % on E4B, whose host then hands the device its
/// work too late.
pub const GRAPH_BUDGET_MB: &str = "4000";

/// The budget to set, given the variable's current value: none where the user chose one.
pub fn graph_budget_to_set(current: Option<std::ffi::OsString>) -> Option<&'static str> {
    match current {
        Some(_) => None,
        None => Some(GRAPH_BUDGET_MB),
    }
}

/// Sets [`GRAPH_BUDGET_VAR`] to [`GRAPH_BUDGET_MB`] unless the user chose a budget, on Linux,
/// where MLX's GPU back end is CUDA (on macOS its Metal command buffers keep MLX's own
/// budget, not measured here). Must run before MLX records its first graph, which reads the
/// variable once.
fn cut_graphs_at_measured_budget() {
    if !cfg!(target_os = "linux") {
        return;
    }
    if let Some(mb) = graph_budget_to_set(std::env::var_os(GRAPH_BUDGET_VAR)) {
        tracing::debug!("MLX's CUDA graphs hold up to {mb} MB of inputs ({GRAPH_BUDGET_VAR})");
        std::env::set_var(GRAPH_BUDGET_VAR, mb);
    }
}

/// Environment variable: when set, [`start_profiler_capture_if_asked`] starts the CUDA
/// profiler's capture once the prompt is prefilled.
pub const PROFILE_DECODE_VAR: &str = "MLX_SPEC_PROFILE_DECODE";

/// With [`PROFILE_DECODE_VAR`] set, calls `cudaProfilerStart` of the CUDA runtime the CUDA
/// libmlx loaded, so a profiler launched with `--profile-from-start off` (Nsight Compute or
/// Nsight Systems) records the decode steps only, not the weight load and the prefill, which
/// are thousands of kernels more. A no-op without the variable; a warning where there is no
/// CUDA runtime to call.
pub fn start_profiler_capture_if_asked() {
    if std::env::var_os(PROFILE_DECODE_VAR).is_none() {
        return;
    }
    match cuda_profiler_start() {
        Ok(library) => tracing::info!("profiler capture started through {library}"),
        Err(e) => tracing::warn!("{PROFILE_DECODE_VAR} is set but no capture started: {e:#}"),
    }
}

fn cuda_profiler_start() -> Result<&'static str> {
    let (name, library) = cuda_runtime()?;
    // SAFETY: cudaProfilerStart takes no arguments and returns a cudaError_t (an int).
    let code = unsafe {
        let start = library
            .get::<unsafe extern "C" fn() -> i32>(b"cudaProfilerStart\0")
            .map_err(|e| anyhow::anyhow!("{name} has no cudaProfilerStart: {e}"))?;
        start()
    };
    if code != 0 {
        bail!("cudaProfilerStart returned CUDA error {code}");
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;
    use std::path::PathBuf;

    #[test]
    fn a_graph_budget_the_user_set_is_kept() {
        assert_eq!(graph_budget_to_set(None), Some(GRAPH_BUDGET_MB));
        assert_eq!(graph_budget_to_set(Some(OsString::from("1000"))), None);
        // An empty value is the user's too: left as it is.
        assert_eq!(graph_budget_to_set(Some(OsString::new())), None);
        assert!(GRAPH_BUDGET_MB.parse::<u32>().unwrap() > 1000);
    }

    #[test]
    fn the_kernel_cache_goes_under_the_users_cache_directory_by_libmlx_version() {
        let xdg = Some(OsString::from("/var/cache/someone"));
        let home = Some(OsString::from("/home/someone"));
        assert_eq!(
            default_kernel_cache(xdg.clone(), home.clone(), "0.32.2"),
            Some(PathBuf::from(
                "/var/cache/someone/mlx-spec/mlx-0.32.2/kernels"
            ))
        );
        // Without XDG_CACHE_HOME (or with it empty), $HOME/.cache.
        for no_xdg in [None, Some(OsString::new())] {
            assert_eq!(
                default_kernel_cache(no_xdg, home.clone(), "0.32.2"),
                Some(PathBuf::from(
                    "/home/someone/.cache/mlx-spec/mlx-0.32.2/kernels"
                ))
            );
        }
        // Another libmlx, another folder.
        assert_ne!(
            default_kernel_cache(xdg.clone(), None, "0.32.2"),
            default_kernel_cache(xdg, None, "0.33.0")
        );
        // Neither: MLX's own default stays.
        assert_eq!(default_kernel_cache(None, None, "0.32.2"), None);
        assert_eq!(
            default_kernel_cache(None, Some(OsString::new()), "0.32.2"),
            None
        );
    }
}
