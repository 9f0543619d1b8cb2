//! The 4-bit row arithmetic of the CUDA kernels (`kernels::affine4::HEADER`: unpacking, the
//! turned input pieces, the chunk sums, the batches of loads), checked without a GPU against
//! MLX's own quantization.
//!
//! MLX packs a random matrix (`quantize`); MLX's `dequantize` then gives the reference product
//! with a random input. The device helpers are compiled for the host with stand-ins for the
//! few CUDA built-ins they use, and run lane by lane (a warp's sum is the lanes' partial sums
//! added). Needs a C++17 compiler (`$CXX`, `c++`, `clang++` or `g++`); `scripts/setup.sh`
//! installs clang.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use mlx_rs::ops::{dequantize, quantize};
use mlx_rs::{Array, Dtype};
use mlx_spec::kernels::affine4::HEADER;

/// CUDA built-ins the helpers use, for a host compiler. `threadIdx.x` is the lane (or thread)
/// being run; `warp_sum` returns the lane's own value, and the driver adds the lanes.
const HOST_SHIM: &str = r#"
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#define __device__
struct uint4 { unsigned int x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
template <typename T> inline T __ldg(const T* p) { return *p; }
struct ThreadIndex { int x; };
static ThreadIndex threadIdx;
constexpr int BLOCK_THREADS = 256;
inline float warp_sum(float v) { return v; }
inline void __syncthreads() {}
// bfloat16 as the kernels see it: the high half of a float.
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

/// The driver: reads a case's packed rows, scales, biases and input, stages the input as
/// `T`, makes the chunk sums thread by thread, then runs rows_dot_affine4 R rows at a time,
/// lane by lane, and prints each row's result.
const DRIVER: &str = r#"
template <typename T> T from_float(float f);
template <> float from_float<float>(float f) { return f; }
template <> bf16 from_float<bf16>(float f) { uint32_t u; std::memcpy(&u, &f, 4); return bf16{uint16_t(u >> 16)}; }

template <typename T, int K, int G, int R, bool IN_PLACE>
void run(int index, const char* path) {
  FILE* f = std::fopen(path, "rb");
  if (!f) { std::printf("error cannot open %s\n", path); return; }
  uint32_t rows;
  if (std::fread(&rows, 4, 1, f) != 1) return;
  std::vector<uint4> packed(rows * K / 32);
  std::vector<float> scales(rows * K / G), biases(rows * K / G), x(K);
  size_t got = std::fread(packed.data(), 16, packed.size(), f);
  got += std::fread(scales.data(), 4, scales.size(), f);
  got += std::fread(biases.data(), 4, biases.size(), f);
  got += std::fread(x.data(), 4, x.size(), f);
  std::fclose(f);
  if (got != packed.size() + scales.size() + biases.size() + x.size()) { std::printf("error short %s\n", path); return; }
  std::vector<T> s(scales.size()), b(biases.size());
  for (size_t i = 0; i < s.size(); i++) { s[i] = from_float<T>(scales[i]); b[i] = from_float<T>(biases[i]); }
  alignas(16) static T xs[K];
  for (int i = 0; i < K; i++) xs[i] = from_float<T>(x[i]);
  static float sums[K / 32];
  for (int t = 0; t < BLOCK_THREADS; t++) { threadIdx.x = t; chunk_sums<T, K, 4>(xs, sums); }
  for (uint32_t r0 = 0; r0 < rows; r0 += R) {
    const void* row_ptr[R];
    const T* scale_ptr[R];
    const T* bias_ptr[R];
    for (int i = 0; i < R; i++) {
      row_ptr[i] = packed.data() + (r0 + i) * (K / 32);
      scale_ptr[i] = s.data() + (r0 + i) * (K / G);
      bias_ptr[i] = b.data() + (r0 + i) * (K / G);
    }
    float total[R] = {};
    for (int lane = 0; lane < 32; lane++) {
      threadIdx.x = lane;
      float out[R];
      rows_dot_affine4<T, K, R, G, IN_PLACE>(row_ptr, scale_ptr, bias_ptr, xs, sums, out);
      for (int i = 0; i < R; i++) total[i] += out[i];
    }
    for (int i = 0; i < R; i++) std::printf("%d %u %.9g\n", index, r0 + i, total[i]);
  }
}
"#;

/// One checked shape: the kernel's element type, input width, group size, rows a call, and
/// way of unpacking, with the number of rows of the random matrix.
struct Case {
    bf16: bool,
    k: i32,
    group: i32,
    rows_per_call: i32,
    in_place: bool,
    rows: i32,
}

const CASES: [Case; 6] = [
    // A short row: a quarter of the lanes have a chunk.
    Case {
        bf16: false,
        k: 256,
        group: 64,
        rows_per_call: 1,
        in_place: false,
        rows: 6,
    },
    // E4B's hidden width: lanes with three chunks and lanes with two, two rows at once.
    Case {
        bf16: false,
        k: 2560,
        group: 64,
        rows_per_call: 2,
        in_place: false,
        rows: 4,
    },
    Case {
        bf16: true,
        k: 2560,
        group: 64,
        rows_per_call: 2,
        in_place: true,
        rows: 4,
    },
    // E4B's feed-forward width: ten chunks a lane, in a batch of eight and one of two.
    Case {
        bf16: true,
        k: 10240,
        group: 128,
        rows_per_call: 1,
        in_place: false,
        rows: 3,
    },
    // Eight rows at once (the products' four rows a warp, gate and up): one chunk a batch.
    Case {
        bf16: true,
        k: 2048,
        group: 32,
        rows_per_call: 8,
        in_place: false,
        rows: 8,
    },
    Case {
        bf16: true,
        k: 256,
        group: 64,
        rows_per_call: 2,
        in_place: true,
        rows: 2,
    },
];

/// Deterministic values in [-1, 1).
fn pseudo_random(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `values` rounded to bfloat16 (to nearest, ties to even), kept as float32.
fn round_to_bf16(values: &[f32]) -> Vec<f32> {
    let a = Array::from_slice(values, &[values.len() as i32])
        .as_dtype(Dtype::Bfloat16)
        .unwrap()
        .as_dtype(Dtype::Float32)
        .unwrap();
    a.as_slice::<f32>().to_vec()
}

/// Writes the case's inputs; returns the reference products and the sums of |w x| per row
/// (the scale of a float32 rounding error).
fn write_case(case: &Case, seed: u64, path: &Path) -> (Vec<f64>, Vec<f64>) {
    let (rows, k, g) = (case.rows, case.k, case.group);
    let w = Array::from_slice(&pseudo_random(seed, (rows * k) as usize), &[rows, k]);
    let (packed, scales, biases) = quantize(&w, g, 4).unwrap();
    let mut scales_f = scales
        .as_dtype(Dtype::Float32)
        .unwrap()
        .as_slice::<f32>()
        .to_vec();
    let mut biases_f = biases
        .as_dtype(Dtype::Float32)
        .unwrap()
        .as_slice::<f32>()
        .to_vec();
    let mut x = pseudo_random(seed + 1, k as usize);
    if case.bf16 {
        scales_f = round_to_bf16(&scales_f);
        biases_f = round_to_bf16(&biases_f);
        x = round_to_bf16(&x);
    }
    // The reference: MLX's dequantization with the scales and biases the kernel sees.
    let shape = scales.shape().to_vec();
    let deq = dequantize(
        &packed,
        Array::from_slice(&scales_f, &shape),
        &Array::from_slice(&biases_f, &shape),
        g,
        4,
    )
    .unwrap()
    .as_dtype(Dtype::Float32)
    .unwrap();
    let deq = deq.as_slice::<f32>();
    let mut want = Vec::new();
    let mut magnitude = Vec::new();
    for r in 0..rows as usize {
        let row = &deq[r * k as usize..(r + 1) * k as usize];
        want.push(row.iter().zip(&x).map(|(w, x)| *w as f64 * *x as f64).sum());
        magnitude.push(
            row.iter()
                .zip(&x)
                .map(|(w, x)| (*w as f64 * *x as f64).abs())
                .sum(),
        );
    }
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&(rows as u32).to_le_bytes());
    for v in packed.as_slice::<u32>() {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    for v in scales_f.iter().chain(&biases_f).chain(&x) {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
    (want, magnitude)
}

#[test]
fn the_kernels_4bit_rows_give_the_products_of_mlx_dequantized_weights() {
    let dir = tempfile::tempdir().unwrap();
    let mut source = format!("{HOST_SHIM}{HEADER}{DRIVER}\nint main() {{\n");
    let mut expected = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        assert_eq!(case.rows % case.rows_per_call, 0);
        let path = dir.path().join(format!("case-{i}.bin"));
        expected.push(write_case(case, 17 + i as u64, &path));
        let t = if case.bf16 { "bf16" } else { "float" };
        writeln!(
            source,
            "  run<{t}, {}, {}, {}, {}>({i}, \"{}\");",
            case.k,
            case.group,
            case.rows_per_call,
            case.in_place,
            path.display()
        )
        .unwrap();
    }
    source.push_str("  return 0;\n}\n");
    let cpp = dir.path().join("affine4.cpp");
    let exe = dir.path().join("affine4");
    std::fs::write(&cpp, &source).unwrap();
    // $CXX, else the first of the usual names that runs (setup.sh installs clang).
    let candidates: Vec<String> = std::env::var("CXX")
        .into_iter()
        .chain(["c++", "clang++", "g++"].map(String::from))
        .collect();
    let (compiler, build) = candidates
        .iter()
        .find_map(|c| {
            Command::new(c)
                .args(["-std=c++17", "-O1", "-w", "-o"])
                .arg(&exe)
                .arg(&cpp)
                .output()
                .ok()
                .map(|out| (c.clone(), out))
        })
        .unwrap_or_else(|| panic!("a C++17 compiler is needed, none of {candidates:?} runs"));
    assert!(
        build.status.success(),
        "{compiler} could not compile the 4-bit helpers:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let printed = String::from_utf8(run.stdout).unwrap();
    let mut checked = 0;
    for line in printed.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(parts.len(), 3, "unexpected driver output: {line}");
        let (case, row): (usize, usize) = (parts[0].parse().unwrap(), parts[1].parse().unwrap());
        let got: f64 = parts[2].parse().unwrap();
        let (want, magnitude) = (&expected[case].0, &expected[case].1);
        // A float32 sum's rounding, relative to the terms' size; a wrong nibble, piece,
        // group or chunk sum moves the result by a sizeable part of it.
        let tolerance = 1e-5 * magnitude[row];
        assert!(
            (got - want[row]).abs() <= tolerance,
            "case {case} row {row}: {got} vs MLX's {} (tolerance {tolerance})",
            want[row]
        );
        assert!(magnitude[row] > 1.0, "case {case}: a trivial product");
        checked += 1;
    }
    let rows: i32 = CASES.iter().map(|c| c.rows).sum();
    assert_eq!(checked, rows as usize, "every row of every case: {printed}");
}
