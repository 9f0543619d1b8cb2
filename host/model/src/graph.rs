//! A computation's lazy graph as Graphviz DOT, and its operations counted by kind: how the
//! model's tests check that a block builds the operations it should (one slice update for a
//! cache write, one fused kernel for an activation), and how the host's diagnostics count a
//! decode step's operations.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::Path;

use anyhow::{bail, Context, Result};
use mlx_rs::Array;

/// Writes the graph that computes `output` (not yet evaluated) to `path` in DOT format.
pub fn export_dot(output: &Array, path: &Path) -> Result<()> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .with_context(|| format!("{} contains a NUL byte", path.display()))?;
    // SAFETY: the FILE, the vector and the namer are created, used and released here; the
    // output array outlives the call.
    let rc = unsafe {
        let file = mlx_sys::fopen(c_path.as_ptr(), c"w".as_ptr());
        if file.is_null() {
            bail!("cannot open {} for writing", path.display());
        }
        let outputs = mlx_sys::mlx_vector_array_new_value(output.as_ptr());
        let namer = mlx_sys::mlx_node_namer_new();
        let rc = mlx_sys::mlx_export_to_dot(file, namer, outputs);
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(outputs);
        mlx_sys::fclose(file);
        rc
    };
    if rc != 0 {
        bail!("libmlx could not export the graph to {}", path.display());
    }
    Ok(())
}

/// Operations of a DOT graph written by [`export_dot`], counted by primitive name.
pub fn count_operations(dot: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in dot.lines() {
        // Operation nodes look like `{ 1403 [label ="Matmul", shape=rectangle]; }`.
        if !line.contains("shape=rectangle") {
            continue;
        }
        if let Some(label) = line
            .split("label =\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
        {
            *counts.entry(label.to_owned()).or_insert(0) += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_operations_of_a_small_graph() {
        let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
        let b = a.matmul(&a).unwrap().add(&a).unwrap().exp().unwrap();
        let path = std::env::temp_dir().join(format!("mlx-spec-dot-{}.dot", std::process::id()));
        export_dot(&b, &path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        let counts = count_operations(&text);
        assert_eq!(counts.get("Matmul"), Some(&1), "{counts:?}");
        assert_eq!(counts.get("Add"), Some(&1), "{counts:?}");
        assert_eq!(counts.get("Exp"), Some(&1), "{counts:?}");
        assert_eq!(counts.values().sum::<usize>(), 3, "{counts:?}");
    }
}
