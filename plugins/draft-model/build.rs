//! Lets `ldd` resolve libmlx for this library on its own; in the host the already-loaded
//! libmlx is reused by SONAME.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
