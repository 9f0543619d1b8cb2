//! Helpers shared by the integration tests: fixture paths and golden tensors.
#![allow(dead_code)]

use std::path::PathBuf;

use safetensors::tensor::{Dtype, SafeTensors};

/// The committed oracle fixtures (tests/oracle/make_fixtures.py writes them).
pub const FIXTURES: [&str; 4] = [
    "tiny-ple-kvshare",
    "tiny-moe-keqv",
    "tiny-wrapped-bf16",
    "tiny-ple-q4",
];

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

/// A golden tensor: shape and values (float32 or int64 widened to f64-free forms).
pub struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    pub fn load(name: &str) -> Self {
        let path = fixture(name).join("golden.safetensors");
        Golden {
            bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        }
    }

    fn view(&self, key: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("golden.safetensors parses");
        let t = st
            .tensor(key)
            .unwrap_or_else(|_| panic!("golden has no {key}"));
        (t.dtype(), t.shape().to_vec(), t.data().to_vec())
    }

    pub fn f32(&self, key: &str) -> (Vec<usize>, Vec<f32>) {
        let (dtype, shape, data) = self.view(key);
        assert_eq!(dtype, Dtype::F32, "{key} is not f32");
        let values = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        (shape, values)
    }

    pub fn ids(&self, key: &str) -> Vec<u32> {
        let (dtype, _, data) = self.view(key);
        assert_eq!(dtype, Dtype::I64, "{key} is not i64");
        data.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
