//! Helpers shared by the integration tests: fixture paths and golden tensors.
#![allow(dead_code)]

pub mod sampling;

use std::path::PathBuf;
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;

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

/// The default model shipped in the repo (trained on code; its model card beside it), the one
/// the shipped drafters are trained for.
pub fn default_model() -> PathBuf {
    repo_root().join(mlx_spec::DEFAULT_MODEL_DIR)
}

/// The default model's folder name, which the host reports as the model's name.
pub fn default_model_name() -> String {
    default_model()
        .file_name()
        .and_then(|n| n.to_str())
        .expect("the default model's folder has a UTF-8 name")
        .to_owned()
}

pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

/// The golden tensors of one oracle run (float32 values, int64 token ids).
pub struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    /// The goldens of a fixture model.
    pub fn load(name: &str) -> Self {
        Self::from_file(&fixture(name).join("golden.safetensors"))
    }

    pub fn from_file(path: &std::path::Path) -> Self {
        Golden {
            bytes: std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
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

/// One `mlx-spec` process at a time per test binary. MLX compiles its fused CPU kernels into
/// a shared cache folder (under the system's temporary folder) at first use, writing each
/// library in place: a second process that finds a library still being written fails to load
/// it ("file too short"), which the tests, run in parallel threads on a fresh machine, hit.
static ONE_PROCESS_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs the built `mlx-spec` binary.
pub fn mlx_spec(args: &[&str]) -> Output {
    // A test that failed while holding the lock leaves it poisoned; the next may still run.
    let _one = ONE_PROCESS_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(args)
        .env_remove("MLX_SPEC_MODEL")
        .output()
        .expect("run mlx-spec")
}

pub fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "mlx-spec failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(
        stdout.lines().count(),
        1,
        "--json prints exactly one line: {stdout}"
    );
    serde_json::from_str(&stdout).expect("stdout is one JSON object")
}

pub fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Runs a command expected to fail; returns its stderr after checking the failure is clean.
pub fn expect_error(args: &[&str]) -> String {
    let out = mlx_spec(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected failure for {args:?}");
    assert!(!stderr.contains("panicked"), "mlx-spec panicked: {stderr}");
    assert!(
        stderr.starts_with("error: "),
        "expected one error line, got: {stderr}"
    );
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "error should be one line: {stderr}"
    );
    stderr
}

/// Compiles the C++ `source` (device helpers of the CUDA kernels with host stand-ins for
/// the CUDA built-ins) in `dir` and returns what the program prints. Uses `$CXX`, else the
/// first of `c++`, `clang++`, `g++` that runs (`scripts/setup.sh` installs clang).
pub fn compile_and_run(dir: &std::path::Path, source: &str) -> String {
    let cpp = dir.join("kernel_math.cpp");
    let exe = dir.join("kernel_math");
    std::fs::write(&cpp, source).unwrap();
    let candidates: Vec<String> = std::env::var("CXX")
        .into_iter()
        .chain(["c++", "clang++", "g++"].map(String::from))
        .collect();
    let (compiler, build) = candidates
        .iter()
        .find_map(|c| {
            Command::new(c)
                // The CUDA source reads arrays through other pointer types, as CUDA allows.
                .args(["-std=c++17", "-O1", "-fno-strict-aliasing", "-w", "-o"])
                .arg(&exe)
                .arg(&cpp)
                .output()
                .ok()
                .map(|out| (c.clone(), out))
        })
        .unwrap_or_else(|| panic!("a C++17 compiler is needed, none of {candidates:?} runs"));
    assert!(
        build.status.success(),
        "{compiler} could not compile the kernel helpers:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    String::from_utf8(run.stdout).unwrap()
}

/// Host stand-ins for the CUDA built-ins the kernels' device helpers use, for a host C++
/// compiler: `threadIdx.x` is the lane (or thread) being run, `warp_sum` returns the lane's
/// own value (the driver adds the lanes), and `bf16` is bfloat16 as the kernels see it (the
/// high half of a float). Each test adds what its helpers need besides.
pub const CUDA_HOST_SHIM: &str = r#"
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>
#define __device__
struct uint4 { unsigned int x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
template <typename T> inline T __ldg(const T* p) { return *p; }
struct ThreadIndex { int x; };
static ThreadIndex threadIdx;
inline float warp_sum(float v) { return v; }
inline void __syncthreads() {}
struct bf16 {
  uint16_t bits;
  explicit operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
"#;
