//! Link-time wiring for MLX on Linux.
//!
//! * rpath: the patched mlx-sys reports where the prebuilt libmlx lives (`DEP_MLX_LIBDIR`);
//!   a dependency's own link args never reach this binary, so the rpath is added here. It is a
//!   RUNPATH, so `LD_LIBRARY_PATH` still wins (that is how the GPU build of libmlx is swapped in).
//!   A second entry, `$ORIGIN/../lib/mlx-spec`, is where `scripts/install.sh` puts libmlx, so an
//!   installed binary runs once the build tree is gone.
//! * BLAS: the wheel's libmlx uses a reference BLAS for f32 matmul. Making this executable
//!   depend on OpenBLAS first lets its `cblas_sgemm` win symbol lookup (about 10x faster).
//!   `MLX_SPEC_BLAS=none` opts out; `MLX_SPEC_BLAS=/path/lib.so` picks another library.
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_SPEC_BLAS");
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        if target_os == "linux" {
            println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../lib/mlx-spec");
        }
    }
    if target_os != "linux" || std::env::var_os("DEP_MLX_LIBDIR").is_none() {
        return;
    }
    let blas = match std::env::var("MLX_SPEC_BLAS") {
        Ok(v) if v == "none" => None,
        Ok(v) => Some(v),
        Err(_) => [
            "/usr/lib/x86_64-linux-gnu/libopenblas.so",
            "/usr/lib/aarch64-linux-gnu/libopenblas.so",
        ]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .map(str::to_owned),
    };
    match blas {
        Some(lib) => {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg={lib}");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
        None => println!(
            "cargo:warning=no OpenBLAS found: f32 matmul on CPU will use the slow reference BLAS"
        ),
    }
}
