//! What mlx-spec's kernels ask of the CUDA runtime that the CUDA libmlx loaded (device 0's
//! multiprocessors, compute capability, whether MPS shares it), and the variable naming where
//! MLX's CUDA backend keeps the kernels it compiles. Every answer is `None` or `false` where
//! there is no CUDA runtime (a CPU libmlx, macOS).

use anyhow::Result;

/// MLX's variable naming where its CUDA backend keeps the kernels it compiles.
pub const KERNEL_CACHE_VAR: &str = "MLX_PTX_CACHE_DIR";

/// The CUDA runtime library that the CUDA libmlx loaded (opening it again only takes a
/// reference), with its name.
pub fn cuda_runtime() -> Result<(&'static str, abi_stable::library::RawLibrary)> {
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

/// The compute capability (major, minor) of CUDA device 0, asked once of the CUDA runtime;
/// `None` where there is none. The kernel cache compiles for it, as MLX does.
pub fn cuda_compute_capability() -> Option<(i32, i32)> {
    static CAPABILITY: std::sync::OnceLock<Option<(i32, i32)>> = std::sync::OnceLock::new();
    // cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor
    *CAPABILITY.get_or_init(|| Some((cuda_device_attribute(75)?, cuda_device_attribute(76)?)))
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
