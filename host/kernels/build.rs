//! Lets this crate's own test binaries find libmlx: the patched mlx-sys reports where the
//! prebuilt library lives (`DEP_MLX_LIBDIR`), and a dependency's link arguments never reach a
//! dependent's executables, so the rpath is added here. The library itself is an rlib and
//! links nothing; the host's and the plugins' build scripts do the same for their binaries.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
