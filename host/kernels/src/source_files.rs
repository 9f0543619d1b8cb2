//! Kernel source text kept in files and pulled into MLX's custom kernels by `#include`.
//!
//! Why: MLX 0.32 rebuilds a custom kernel's full source string at every call (header, the
//! generated signature and the body are concatenated), copies it into the new operation, and
//! hashes it again when the operation runs, to find the compiled module. That costs host time
//! per call in proportion to the source's length: measured on an H200 (`bench --op-cost`), a
//! trivial kernel cost 5.0 µs a call with 0.1 KB of source and 21.0 µs with 33 KB, and our
//! product kernels (~7 KB with their helpers) 10.5–12.8 µs. A decode step calls them ~380
//! times. With the text in a file, what MLX handles per call is one `#include` line; NVRTC
//! reads the file once, when the module is compiled.
//!
//! Files are named by a hash of their content, in the user's cache folder, written atomically
//! and read back before use, so a stale or foreign file is never included. Where none can be
//! written, the text goes inline as before (slower, same result).

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Names MLX looks for in a kernel body to add shape, stride or rank arguments to the
/// signature: a body that mentions one must stay inline for MLX to see it.
const SIGNATURE_MARKERS: [&str; 3] = ["_shape", "_strides", "_ndim"];

static WARNED: AtomicBool = AtomicBool::new(false);

/// `text` as an `#include` of a file holding it, or `text` itself where no such file can be
/// placed. A body that uses MLX's shape, stride or rank arguments stays inline.
pub(crate) fn included(text: &str) -> Cow<'_, str> {
    if text.trim().is_empty() || SIGNATURE_MARKERS.iter().any(|m| text.contains(m)) {
        return Cow::Borrowed(text);
    }
    match place(&source_folder(), text) {
        Ok(path) => Cow::Owned(format!("#include \"{}\"\n", path.display())),
        Err(err) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "CUDA kernel sources stay inline (each kernel call then costs more host time): {err}"
                );
            }
            Cow::Borrowed(text)
        }
    }
}

/// Where the files go: `$XDG_CACHE_HOME/mlx-spec/cuda-sources`, else `~/.cache/…`, else the
/// temporary folder.
fn source_folder() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })
        .unwrap_or_else(std::env::temp_dir);
    base.join("mlx-spec").join("cuda-sources")
}

/// Writes `text` to `folder/<hash>.cuh` unless that file already holds exactly `text`, then
/// reads it back; returns the file's path.
pub(crate) fn place(folder: &Path, text: &str) -> Result<PathBuf, String> {
    let path = folder.join(format!("{:016x}.cuh", content_hash(text.as_bytes())));
    // The path goes between quotes in an #include line.
    let printable = path.to_str().ok_or("the cache path is not UTF-8")?;
    if printable.contains(['"', '\\', '\n', '\r']) || !path.is_absolute() {
        return Err(format!("{printable}: not usable in an #include line"));
    }
    if std::fs::read(&path).is_ok_and(|held| held == text.as_bytes()) {
        return Ok(path);
    }
    std::fs::create_dir_all(folder).map_err(|e| format!("{}: {e}", folder.display()))?;
    // Another process may be writing the same file: write under a private name, then rename.
    let temporary = folder.join(format!(
        ".{:016x}.{}.tmp",
        content_hash(text.as_bytes()),
        std::process::id()
    ));
    std::fs::write(&temporary, text).map_err(|e| format!("{}: {e}", temporary.display()))?;
    std::fs::rename(&temporary, &path).map_err(|e| {
        std::fs::remove_file(&temporary).ok();
        format!("{}: {e}", path.display())
    })?;
    match std::fs::read(&path) {
        Ok(held) if held == text.as_bytes() => Ok(path),
        _ => Err(format!(
            "{}: does not hold what was written",
            path.display()
        )),
    }
}

/// 64-bit FNV-1a: stable across builds and platforms, unlike the standard library's hasher.
fn content_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("mlx-spec-sources-{name}-{}", std::process::id()))
    }

    #[test]
    fn a_text_goes_to_a_file_named_by_its_content() {
        let folder = scratch("content");
        let a = place(&folder, "__device__ int one() { return 1; }").unwrap();
        let again = place(&folder, "__device__ int one() { return 1; }").unwrap();
        let b = place(&folder, "__device__ int two() { return 2; }").unwrap();
        assert_eq!(a, again);
        assert_ne!(a, b);
        assert_eq!(
            std::fs::read_to_string(&a).unwrap(),
            "__device__ int one() { return 1; }"
        );
        std::fs::remove_dir_all(&folder).ok();
    }

    #[test]
    fn a_file_that_no_longer_holds_its_text_is_written_again() {
        let folder = scratch("stale");
        let path = place(&folder, "int x;").unwrap();
        std::fs::write(&path, "int y; // changed by someone else").unwrap();
        assert_eq!(place(&folder, "int x;").unwrap(), path);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "int x;");
        std::fs::remove_dir_all(&folder).ok();
    }

    #[test]
    fn bodies_using_signature_arguments_and_empty_texts_stay_inline() {
        let body = "out[0] = x[x_shape[0] - 1];";
        assert!(matches!(included(body), Cow::Borrowed(b) if b == body));
        assert!(matches!(included(""), Cow::Borrowed("")));
    }

    #[test]
    fn an_included_text_is_one_include_line_naming_an_absolute_path() {
        let text = "__device__ float three() { return 3.f; }\n";
        let line = included(text);
        // Where the cache folder cannot be written the text stays inline, which is allowed.
        if line != text {
            let path = line
                .strip_prefix("#include \"")
                .and_then(|l| l.strip_suffix("\"\n"))
                .expect("one include line");
            assert!(Path::new(path).is_absolute());
            assert_eq!(std::fs::read_to_string(path).unwrap(), text);
        }
    }

    #[test]
    fn the_content_hash_is_fixed() {
        // FNV-1a's published test value for "a".
        assert_eq!(content_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(content_hash(b""), 0xcbf2_9ce4_8422_2325);
    }
}
