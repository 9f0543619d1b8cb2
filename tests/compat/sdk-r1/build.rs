//! Records the MLX version whose headers this build's mlx-c copy was compiled against. Every
//! plugin carries its own mlx-c; the host refuses a plugin whose headers differ from its own,
//! because a tensor handle is an opaque pointer that abi_stable's layout check cannot see into.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_INCLUDE");
    let mut version = String::from("unknown");
    if let Some(include) = std::env::var_os("DEP_MLX_INCLUDE") {
        for dir in std::env::split_paths(&include) {
            let header: PathBuf = dir.join("mlx").join("version.h");
            let Ok(text) = std::fs::read_to_string(&header) else {
                continue;
            };
            println!("cargo:rerun-if-changed={}", header.display());
            let field = |name: &str| {
                text.lines()
                    .find_map(|l| l.trim().strip_prefix(&format!("#define {name} ")))
                    .map(|v| v.trim().to_owned())
                    .unwrap_or_else(|| "?".to_owned())
            };
            version = format!(
                "{}.{}.{}",
                field("MLX_VERSION_MAJOR"),
                field("MLX_VERSION_MINOR"),
                field("MLX_VERSION_PATCH")
            );
            break;
        }
    }
    println!("cargo:rustc-env=MLX_SPEC_MLX_HEADERS={version}");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        // For this crate's own test binaries.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
