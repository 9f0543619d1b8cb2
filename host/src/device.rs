//! Device selection at run time (`--device cpu|gpu`), never at build time: the same binary
//! runs on the CPU libmlx, on a CUDA libmlx swapped in by library path, or on Metal.

use std::ffi::CStr;

use anyhow::{bail, Result};
use mlx_rs::{Device, DeviceType};

/// Where the model runs.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

/// Whether MLX's default device, where the next operations will run, is of this type.
pub fn default_is(kind: DeviceType) -> bool {
    Device::default()
        .get_type()
        .is_ok_and(|t| t as u32 == kind as u32)
}

/// The version string of the libmlx this process loaded (e.g. `0.32.2`).
pub fn mlx_version() -> String {
    // SAFETY: mlx_string is created, read and freed here; mlx_version only writes into it.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let out = if mlx_sys::mlx_version(&mut s) == 0 {
            CStr::from_ptr(mlx_sys::mlx_string_data(s))
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown".to_owned()
        };
        mlx_sys::mlx_string_free(s);
        out
    }
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
    let device = match kind {
        DeviceKind::Cpu => Device::new(DeviceType::Cpu, 0),
        DeviceKind::Gpu => Device::new(DeviceType::Gpu, 0),
    };
    Device::set_default(&device);
    Ok(())
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

/// The CUDA runtime library that the CUDA libmlx loaded (opening it again only takes a
/// reference), with its name.
fn cuda_runtime() -> Result<(&'static str, abi_stable::library::RawLibrary)> {
    use abi_stable::library::RawLibrary;
    let names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"];
    names
        .iter()
        .find_map(|name| {
            RawLibrary::load_at(std::path::Path::new(name))
                .ok()
                .map(|l| (*name, l))
        })
        .ok_or_else(|| anyhow::anyhow!("no CUDA runtime library ({}) loads", names.join(", ")))
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

/// An attribute of CUDA device 0 (`cudaDeviceAttr`), asked of the CUDA runtime the CUDA
/// libmlx loaded; `None` where there is no runtime, or it refuses the attribute.
fn cuda_device_attribute(attribute: i32) -> Option<i32> {
    let (_, library) = cuda_runtime().ok()?;
    let mut value = 0i32;
    // SAFETY: cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) writes one
    // int and returns a cudaError_t.
    let code = unsafe {
        let get = library
            .get::<unsafe extern "C" fn(*mut i32, i32, i32) -> i32>(b"cudaDeviceGetAttribute\0")
            .ok()?;
        get(&mut value, attribute, 0)
    };
    (code == 0).then_some(value)
}

/// Streaming multiprocessors of CUDA device 0, asked once of the CUDA runtime; `None` where
/// there is none (a CPU libmlx, macOS). Kernels whose blocks must all be resident at once
/// (grid-wide barriers) size their grid from it.
pub fn cuda_multiprocessor_count() -> Option<i32> {
    static COUNT: std::sync::OnceLock<Option<i32>> = std::sync::OnceLock::new();
    // cudaDevAttrMultiProcessorCount
    *COUNT.get_or_init(|| cuda_device_attribute(16).filter(|&count| count > 0))
}

/// Whether contexts on CUDA device 0 are shared with other processes through MPS (the
/// Multi-Process Service), asked once of the CUDA runtime; `false` where there is no CUDA
/// runtime, or one too old to know the attribute. Under MPS the multiprocessors are shared,
/// so a kernel whose blocks must all be resident at once (a grid-wide barrier) may never see
/// them all start.
pub fn cuda_shared_through_mps() -> bool {
    static SHARED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // cudaDevAttrMpsEnabled (CUDA 12.3 and later; older runtimes refuse it).
    *SHARED.get_or_init(|| cuda_device_attribute(133).is_some_and(|enabled| enabled != 0))
}
