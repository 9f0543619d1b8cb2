//! The 4-bit row arithmetic of the CUDA kernels (`kernels::affine4::HEADER`: unpacking, the
//! turned input pieces, the chunk sums, the batches of loads), checked without a GPU against
//! MLX's own quantization.
//!
//! MLX packs a random matrix (`quantize`); MLX's `dequantize` then gives the reference product
//! with a random input. The device helpers are compiled for the host with stand-ins for the
//! few CUDA built-ins they use, and run lane by lane (a warp's sum is the lanes' partial sums
//! added). Needs a C++17 compiler (`$CXX`, `c++`, `clang++` or `g++`); `scripts/setup.sh`
//! installs clang.

mod common;

use std::fmt::Write as _;
use std::path::Path;

use common::{compile_and_run, CUDA_HOST_SHIM};

use mlx_rs::ops::{dequantize, quantize};
use mlx_rs::{Array, Dtype};
use mlx_spec::kernels::affine4::HEADER;
use mlx_spec::kernels::products::WEIGHT_ROWS_HEADER;

/// What the 4-bit helpers need besides the common stand-ins (`common::CUDA_HOST_SHIM`).
const HOST_SHIM: &str = r#"
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
// dp2a: c + the int16 halves of a times bytes 0 and 1 (lo) or 2 and 3 (hi) of b, signed.
inline int dp2a(int a, int b, int c, int first_byte) {
  const int a0 = int16_t(uint32_t(a) & 0xFFFFu), a1 = int16_t(uint32_t(a) >> 16);
  const int b0 = int8_t(uint32_t(b) >> (8 * first_byte)), b1 = int8_t(uint32_t(b) >> (8 * first_byte + 8));
  return c + a0 * b0 + a1 * b1;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline int __dp2a_lo(int a, int b, int c) { return dp2a(a, b, c, 0); }
inline int __dp2a_hi(int a, int b, int c) { return dp2a(a, b, c, 2); }
constexpr int BLOCK_THREADS = 256;
inline int min(int a, int b) { return a < b ? a : b; }
// The products' dense row helper, declared so that weight_rows parses; 4-bit rows never
// call it.
template <typename T, int K, int R, int LOADS = 8> void rows_dot(const T* const*, const T*, float*) {}
"#;

/// The driver: reads a case's packed rows, scales, biases and input, stages the input as
/// `T`, makes the chunk sums thread by thread, then runs rows_dot_affine4 R rows at a time,
/// lane by lane, and prints each row's result.
const DRIVER: &str = r#"
template <typename T> T from_float(float f);
template <> float from_float<float>(float f) { return f; }
template <> bf16 from_float<bf16>(float f) { uint32_t u; std::memcpy(&u, &f, 4); return bf16{uint16_t(u >> 16)}; }

// One case file: the rows of a 4-bit matrix, its scales and biases as T, and the input.
template <typename T, int K, int G>
struct Loaded {
  uint32_t rows = 0;
  std::vector<uint4> packed;
  std::vector<T> s, b;
  std::vector<float> x;
  bool ok = false;
  explicit Loaded(const char* path) {
    FILE* f = std::fopen(path, "rb");
    if (!f || std::fread(&rows, 4, 1, f) != 1) { std::printf("error cannot read %s\n", path); return; }
    packed.resize(rows * K / 32);
    std::vector<float> scales(rows * K / G), biases(rows * K / G);
    x.resize(K);
    size_t got = std::fread(packed.data(), 16, packed.size(), f);
    got += std::fread(scales.data(), 4, scales.size(), f);
    got += std::fread(biases.data(), 4, biases.size(), f);
    got += std::fread(x.data(), 4, x.size(), f);
    std::fclose(f);
    if (got != packed.size() + scales.size() + biases.size() + x.size()) { std::printf("error short %s\n", path); return; }
    for (size_t i = 0; i < scales.size(); i++) { s.push_back(from_float<T>(scales[i])); b.push_back(from_float<T>(biases[i])); }
    ok = true;
  }
  const void* row(int r) const { return packed.data() + r * (K / 32); }
  const T* scales(int r) const { return s.data() + r * (K / G); }
  const T* biases(int r) const { return b.data() + r * (K / G); }
};

// The input staged as T, and its chunk sums made thread by thread.
template <typename T, int K>
struct Staged {
  alignas(16) T xs[K];
  float sums[K / 32];
  explicit Staged(const std::vector<float>& x) {
    for (int i = 0; i < K; i++) xs[i] = from_float<T>(x[i]);
    for (int t = 0; t < BLOCK_THREADS; t++) { threadIdx.x = t; chunk_sums<T, K, 4>(xs, sums); }
  }
};

// rows_dot_affine4 over all rows of a case, R at a time; prints "case row value".
template <typename T, int K, int G, int R, bool IN_PLACE>
void run(int index, const char* path) {
  const Loaded<T, K, G> m(path);
  if (!m.ok) return;
  const auto in = std::make_unique<Staged<T, K>>(m.x);
  for (uint32_t r0 = 0; r0 < m.rows; r0 += R) {
    const void* row_ptr[R];
    const T* scale_ptr[R];
    const T* bias_ptr[R];
    for (int i = 0; i < R; i++) {
      row_ptr[i] = m.row(r0 + i);
      scale_ptr[i] = m.scales(r0 + i);
      bias_ptr[i] = m.biases(r0 + i);
    }
    float total[R] = {};
    for (int lane = 0; lane < 32; lane++) {
      threadIdx.x = lane;
      float out[R];
      rows_dot_affine4<T, K, R, G, IN_PLACE>(row_ptr, scale_ptr, bias_ptr, in->xs, in->sums, out);
      for (int i = 0; i < R; i++) total[i] += out[i];
    }
    for (int i = 0; i < R; i++) std::printf("%d %u %.9g\n", index, r0 + i, total[i]);
  }
}

// The input of the integer dots: chunk_integers run thread by thread, each thread on its own
// copy of the staged input, keeping only the slots that thread writes (its chunks' pieces):
// what the kernel's barrier between reading and writing gives on the device.
template <typename T, int K>
struct Integers {
  alignas(16) T xi[K];
  float xscale[K / 32];
  explicit Integers(const T* staged) {
    constexpr int CHUNKS = K / 32;
    auto copy = std::make_unique<Staged<T, K>>(std::vector<float>(K, 0.f));
    for (int t = 0; t < BLOCK_THREADS; t++) {
      std::memcpy(copy->xs, staged, sizeof(copy->xs));
      threadIdx.x = t;
      chunk_integers<T, K>(copy->xs, xscale);
      const uint4* from = reinterpret_cast<const uint4*>(copy->xs);
      uint4* to = reinterpret_cast<uint4*>(xi);
      for (int c = t; c < CHUNKS; c += BLOCK_THREADS) {
        for (int p = 0; p < 4; p++) to[p * CHUNKS + c] = from[p * CHUNKS + c];
      }
    }
  }
};

// rows_dot_affine4_int over all rows of a case, R at a time; prints "case row value".
template <typename T, int K, int G, int R>
void run_int(int index, const char* path) {
  const Loaded<T, K, G> m(path);
  if (!m.ok) return;
  const auto in = std::make_unique<Staged<T, K>>(m.x);
  const auto ints = std::make_unique<Integers<T, K>>(in->xs);
  for (uint32_t r0 = 0; r0 < m.rows; r0 += R) {
    const void* row_ptr[R];
    const T* scale_ptr[R];
    const T* bias_ptr[R];
    for (int i = 0; i < R; i++) {
      row_ptr[i] = m.row(r0 + i);
      scale_ptr[i] = m.scales(r0 + i);
      bias_ptr[i] = m.biases(r0 + i);
    }
    float total[R] = {};
    for (int lane = 0; lane < 32; lane++) {
      threadIdx.x = lane;
      float out[R];
      rows_dot_affine4_int<T, K, R, G>(row_ptr, scale_ptr, bias_ptr, ints->xi, ints->xscale, in->sums, out);
      for (int i = 0; i < R; i++) total[i] += out[i];
    }
    for (int i = 0; i < R; i++) std::printf("%d %u %.9g\n", index, r0 + i, total[i]);
  }
}

// The products' weight_rows over two 4-bit weights (gate and up, one input), R rows from
// `first`, lane by lane; prints "index weight row value", rows past the end read as the
// last one.
template <typename T, int K, int G, int R>
void run_pair(int index, const char* gate_path, const char* up_path, int first) {
  const Loaded<T, K, G> g(gate_path), u(up_path);
  if (!g.ok || !u.ok) return;
  const auto in = std::make_unique<Staged<T, K>>(g.x);
  const int n = int(g.rows);
  const uint32_t* const ws[2] = {reinterpret_cast<const uint32_t*>(g.packed.data()),
                                 reinterpret_cast<const uint32_t*>(u.packed.data())};
  const T* const ss[2] = {g.s.data(), u.s.data()};
  const T* const bs[2] = {g.b.data(), u.b.data()};
  float total[2 * R] = {};
  for (int lane = 0; lane < 32; lane++) {
    threadIdx.x = lane;
    float out[2 * R];
    weight_rows<T, K, R, 4, G, 2>(ws, ss, bs, first, n, in->xs, in->sums, out);
    for (int i = 0; i < 2 * R; i++) total[i] += out[i];
  }
  for (int m = 0; m < 2; m++) {
    for (int i = 0; i < R; i++) {
      std::printf("%d %d %d %.9g\n", index, m, min(first + i, n - 1), total[m * R + i]);
    }
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

const CASES: [Case; 7] = [
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
    // Two rows at once over ten chunks a lane: batches of four, where one row a call takes
    // batches of eight (the rows' sums must not change).
    Case {
        bf16: true,
        k: 10240,
        group: 64,
        rows_per_call: 2,
        in_place: false,
        rows: 2,
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
fn write_case(case: &Case, seed: u64, x_seed: u64, path: &Path) -> (Vec<f64>, Vec<f64>) {
    write_scaled_case(case, seed, x_seed, 1.0, path)
}

/// [`write_case`] with the input multiplied by `x_scale` (before any rounding to bf16).
fn write_scaled_case(
    case: &Case,
    seed: u64,
    x_seed: u64,
    x_scale: f32,
    path: &Path,
) -> (Vec<f64>, Vec<f64>) {
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
    let mut x: Vec<f32> = pseudo_random(x_seed, k as usize)
        .into_iter()
        .map(|v| v * x_scale)
        .collect();
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
    let mut source =
        format!("{CUDA_HOST_SHIM}{HOST_SHIM}{HEADER}{WEIGHT_ROWS_HEADER}{DRIVER}\nint main() {{\n");
    let mut expected = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        assert_eq!(case.rows % case.rows_per_call, 0);
        let path = dir.path().join(format!("case-{i}.bin"));
        expected.push(write_case(case, 17 + i as u64, 100 + i as u64, &path));
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
        // The same rows one a call (numbered ONE_ROW + i): each row's sum must not depend on
        // how many rows a call takes (the products' rows a warp, the post-attention kernel's
        // row pairs), bit for bit.
        if case.rows_per_call > 1 && !case.in_place {
            writeln!(
                source,
                "  run<{t}, {}, {}, 1, false>({}, \"{}\");",
                case.k,
                case.group,
                ONE_ROW + i,
                path.display()
            )
            .unwrap();
        }
    }
    source.push_str("  return 0;\n}\n");
    let printed = compile_and_run(dir.path(), &source);
    check_printed(
        &printed,
        &CASES,
        &expected,
        |c| c.rows_per_call > 1 && !c.in_place,
        "",
    );
}

/// Checks the driver's "case row value" lines: each row within a float32 sum's rounding of
/// MLX's dequantized product (`expected[case]`: the products and the sums of |w x|), every
/// row of every case present, and each row that `again` ran a second time one a call (case
/// numbers from [`ONE_ROW`]) summed to the same bits. `what` names the path in messages.
fn check_printed(
    printed: &str,
    cases: &[Case],
    expected: &[(Vec<f64>, Vec<f64>)],
    again: impl Fn(&Case) -> bool,
    what: &str,
) {
    let mut checked = 0;
    let mut sums = std::collections::HashMap::new();
    let mut one_row_sums = Vec::new();
    for line in printed.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(parts.len(), 3, "unexpected driver output: {line}");
        let (case, row): (usize, usize) = (parts[0].parse().unwrap(), parts[1].parse().unwrap());
        let bits = parts[2].parse::<f32>().unwrap().to_bits();
        if case >= ONE_ROW {
            one_row_sums.push((case - ONE_ROW, row, bits));
            continue;
        }
        sums.insert((case, row), bits);
        let got: f64 = parts[2].parse().unwrap();
        let (want, magnitude) = (&expected[case].0, &expected[case].1);
        // A float32 sum's rounding, relative to the terms' size; a wrong nibble, piece,
        // group, chunk sum, pair order or slot moves the result by a sizeable part of it.
        let tolerance = 1e-5 * magnitude[row];
        assert!(
            (got - want[row]).abs() <= tolerance,
            "{what}case {case} row {row}: {got} vs MLX's {} (tolerance {tolerance})",
            want[row]
        );
        assert!(magnitude[row] > 1.0, "{what}case {case}: a trivial product");
        checked += 1;
    }
    let rows: i32 = cases.iter().map(|c| c.rows).sum();
    assert_eq!(checked, rows as usize, "every row of every case: {printed}");
    let several: i32 = cases.iter().filter(|c| again(c)).map(|c| c.rows).sum();
    assert_eq!(one_row_sums.len(), several as usize, "{printed}");
    for (case, row, bits) in one_row_sums {
        assert_eq!(
            Some(&bits),
            sums.get(&(case, row)),
            "{what}case {case} row {row}: one row a call sums otherwise than {} a call",
            cases[case].rows_per_call
        );
    }
}

/// Driver case numbers from here on: a case's rows again, one a call.
const ONE_ROW: usize = 1000;

#[test]
fn the_products_read_gate_and_up_rows_of_4bit_weights_and_repeat_the_last_past_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Case {
        bf16: true,
        k: 2560,
        group: 64,
        rows_per_call: 2,
        in_place: false,
        rows: 6,
    };
    let (gate_path, up_path) = (dir.path().join("gate.bin"), dir.path().join("up.bin"));
    // Two matrices, one input.
    let gate = write_case(&shape, 41, 7, &gate_path);
    let up = write_case(&shape, 42, 7, &up_path);
    let mut source =
        format!("{CUDA_HOST_SHIM}{HOST_SHIM}{HEADER}{WEIGHT_ROWS_HEADER}{DRIVER}\nint main() {{\n");
    // Rows 0-1, rows 4-5, and row 5 twice (the second past the end).
    for (index, first) in [0, 4, 5].into_iter().enumerate() {
        writeln!(
            source,
            "  run_pair<bf16, 2560, 64, 2>({index}, \"{}\", \"{}\", {first});",
            gate_path.display(),
            up_path.display()
        )
        .unwrap();
    }
    source.push_str("  return 0;\n}\n");
    let printed = compile_and_run(dir.path(), &source);
    let mut seen = Vec::new();
    for line in printed.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(parts.len(), 4, "unexpected driver output: {line}");
        let index: usize = parts[0].parse().unwrap();
        let weight: usize = parts[1].parse().unwrap();
        let row: usize = parts[2].parse().unwrap();
        let got: f64 = parts[3].parse().unwrap();
        let (want, magnitude) = if weight == 0 { &gate } else { &up };
        let tolerance = 1e-5 * magnitude[row];
        assert!(
            (got - want[row]).abs() <= tolerance,
            "call {index}, weight {weight}, row {row}: {got} vs MLX's {}",
            want[row]
        );
        seen.push((index, weight, row));
    }
    let expected: Vec<(usize, usize, usize)> = [(0, [0, 1]), (1, [4, 5]), (2, [5, 5])]
        .into_iter()
        .flat_map(|(index, rows)| {
            (0..2).flat_map(move |weight| rows.map(|row| (index, weight, row)))
        })
        .collect();
    assert_eq!(seen, expected, "{printed}");
}

/// Shapes of the integer dots (half-precision inputs only): short and long rows, each group
/// size, one to eight rows a call.
const INTEGER_CASES: [Case; 5] = [
    Case {
        bf16: true,
        k: 256,
        group: 64,
        rows_per_call: 1,
        in_place: false,
        rows: 6,
    },
    Case {
        bf16: true,
        k: 2560,
        group: 64,
        rows_per_call: 2,
        in_place: false,
        rows: 4,
    },
    Case {
        bf16: true,
        k: 10240,
        group: 128,
        rows_per_call: 1,
        in_place: false,
        rows: 3,
    },
    Case {
        bf16: true,
        k: 10240,
        group: 64,
        rows_per_call: 2,
        in_place: false,
        rows: 2,
    },
    Case {
        bf16: true,
        k: 2048,
        group: 32,
        rows_per_call: 8,
        in_place: false,
        rows: 8,
    },
];

#[test]
fn integer_dots_over_4bit_rows_give_the_products_of_mlx_dequantized_weights() {
    let dir = tempfile::tempdir().unwrap();
    let mut source =
        format!("{CUDA_HOST_SHIM}{HOST_SHIM}{HEADER}{WEIGHT_ROWS_HEADER}{DRIVER}\nint main() {{\n");
    let mut expected = Vec::new();
    for (i, case) in INTEGER_CASES.iter().enumerate() {
        assert_eq!(case.rows % case.rows_per_call, 0);
        let path = dir.path().join(format!("case-{i}.bin"));
        expected.push(write_case(case, 61 + i as u64, 200 + i as u64, &path));
        writeln!(
            source,
            "  run_int<bf16, {}, {}, {}>({i}, \"{}\");",
            case.k,
            case.group,
            case.rows_per_call,
            path.display()
        )
        .unwrap();
        // The same rows one a call: bit for bit the same sums (the products' rows a warp).
        if case.rows_per_call > 1 {
            writeln!(
                source,
                "  run_int<bf16, {}, {}, 1>({}, \"{}\");",
                case.k,
                case.group,
                ONE_ROW + i,
                path.display()
            )
            .unwrap();
        }
    }
    source.push_str("  return 0;\n}\n");
    let printed = compile_and_run(dir.path(), &source);
    check_printed(
        &printed,
        &INTEGER_CASES,
        &expected,
        |c| c.rows_per_call > 1,
        "integer dots, ",
    );
}

#[test]
fn integer_dots_scale_inputs_of_any_magnitude() {
    // Inputs far below and above 1: each 32 values' power-of-two scale must follow them (the
    // other tests' inputs lie in [-1, 1)).
    let dir = tempfile::tempdir().unwrap();
    let case = Case {
        bf16: true,
        k: 2560,
        group: 64,
        rows_per_call: 2,
        in_place: false,
        rows: 4,
    };
    let mut source =
        format!("{CUDA_HOST_SHIM}{HOST_SHIM}{HEADER}{WEIGHT_ROWS_HEADER}{DRIVER}\nint main() {{\n");
    let scales = [
        2f32.powi(-40),
        2f32.powi(-9),
        3.0,
        2f32.powi(20),
        2f32.powi(60),
    ];
    let mut expected = Vec::new();
    for (i, x_scale) in scales.iter().enumerate() {
        let path = dir.path().join(format!("scaled-{i}.bin"));
        expected.push(write_scaled_case(
            &case,
            81 + i as u64,
            300,
            *x_scale,
            &path,
        ));
        writeln!(
            source,
            "  run_int<bf16, 2560, 64, 2>({i}, \"{}\");",
            path.display()
        )
        .unwrap();
    }
    source.push_str("  return 0;\n}\n");
    let printed = compile_and_run(dir.path(), &source);
    let mut checked = 0;
    for line in printed.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(parts.len(), 3, "unexpected driver output: {line}");
        let (i, row): (usize, usize) = (parts[0].parse().unwrap(), parts[1].parse().unwrap());
        let got: f64 = parts[2].parse().unwrap();
        let (want, magnitude) = (&expected[i].0, &expected[i].1);
        let tolerance = 1e-5 * magnitude[row];
        assert!(
            got.is_finite() && (got - want[row]).abs() <= tolerance,
            "inputs scaled by {}: row {row} gave {got}, MLX's dequantized product {} (tolerance {tolerance})",
            scales[i],
            want[row]
        );
        checked += 1;
    }
    assert_eq!(checked, scales.len() * case.rows as usize, "{printed}");
}

/// The 4-bit row dots over several tokens (`rows_dot_affine4_tokens` and
/// `rows_dot_affine4_int_tokens`, which `kernels::affine4::WINDOW_HEADER`'s `weight_dot_window`
/// calls): what the verify window's heads, post-attention and output head kernels compute for
/// each of its tokens must be the single-token helper's sum for that token alone, bit for bit, both ways of
/// unpacking (floats, integer dots), or a verify window would score a drafted token otherwise
/// than the decode step it stands for.
const WINDOW_DRIVER: &str = r#"
// The window row dots' dense branch, declared so that weight_dot_window parses; 4-bit rows
// never call it.
template <typename T, int K, int R, int TOKENS, int STRIDE>
void rows_dot_window(const T* const*, const T*, float*) {}
"#;

const WINDOW_RUN: &str = r#"
// Token t's input: the case's input turned by 37 t places and scaled by 1 + t / 8, as T.
template <typename T, int K>
std::vector<float> token_input(const std::vector<float>& x, int t) {
  std::vector<float> v(K);
  for (int i = 0; i < K; i++) v[i] = float(from_float<T>(x[(i + 37 * t) % K] * (1.f + t / 8.f)));
  return v;
}

// Every row of a case, R at a time, for TOKENS inputs: the single-token dot of each token
// and the window dot of all, float and integer ways, lane by lane; prints
// "case way token row single window" with the sums' bits.
template <typename T, int K, int G, int R, int TOKENS>
void run_window(int index, const char* path) {
  const Loaded<T, K, G> m(path);
  if (!m.ok) return;
  std::vector<std::unique_ptr<Staged<T, K>>> staged;
  std::vector<std::unique_ptr<Integers<T, K>>> ints;
  auto xs = std::make_unique<T[]>(TOKENS * K);
  auto xi = std::make_unique<T[]>(TOKENS * K);
  std::vector<float> sums(TOKENS * K / 32), xscale(TOKENS * K / 32);
  for (int t = 0; t < TOKENS; t++) {
    staged.push_back(std::make_unique<Staged<T, K>>(token_input<T, K>(m.x, t)));
    ints.push_back(std::make_unique<Integers<T, K>>(staged[t]->xs));
    std::memcpy(xs.get() + t * K, staged[t]->xs, sizeof(T) * K);
    std::memcpy(xi.get() + t * K, ints[t]->xi, sizeof(T) * K);
    std::memcpy(sums.data() + t * K / 32, staged[t]->sums, sizeof(float) * K / 32);
    std::memcpy(xscale.data() + t * K / 32, ints[t]->xscale, sizeof(float) * K / 32);
  }
  auto bits = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; };
  for (uint32_t r0 = 0; r0 < m.rows; r0 += R) {
    const void* row_ptr[R];
    const T* scale_ptr[R];
    const T* bias_ptr[R];
    for (int i = 0; i < R; i++) {
      row_ptr[i] = m.row(r0 + i);
      scale_ptr[i] = m.scales(r0 + i);
      bias_ptr[i] = m.biases(r0 + i);
    }
    for (int way = 0; way < 2; way++) {
      float single[TOKENS][R] = {};
      float window[R * TOKENS] = {};
      for (int lane = 0; lane < 32; lane++) {
        threadIdx.x = lane;
        for (int t = 0; t < TOKENS; t++) {
          float out[R];
          if (way == 0) {
            rows_dot_affine4<T, K, R, G, false>(row_ptr, scale_ptr, bias_ptr, staged[t]->xs, staged[t]->sums, out);
          } else {
            rows_dot_affine4_int<T, K, R, G>(row_ptr, scale_ptr, bias_ptr, ints[t]->xi, ints[t]->xscale, staged[t]->sums, out);
          }
          for (int i = 0; i < R; i++) single[t][i] += out[i];
        }
        float out[R * TOKENS];
        if (way == 0) {
          rows_dot_affine4_tokens<T, K, R, G, TOKENS, K, false>(row_ptr, scale_ptr, bias_ptr, xs.get(), sums.data(), out);
        } else {
          rows_dot_affine4_int_tokens<T, K, R, G, TOKENS, K>(row_ptr, scale_ptr, bias_ptr, xi.get(), xscale.data(), sums.data(), out);
        }
        for (int i = 0; i < R * TOKENS; i++) window[i] += out[i];
      }
      for (int t = 0; t < TOKENS; t++) {
        for (int i = 0; i < R; i++) {
          std::printf("%d %d %d %u %08x %08x\n", index, way, t, r0 + i, bits(single[t][i]), bits(window[i * TOKENS + t]));
        }
      }
    }
  }
}
"#;

#[test]
fn window_dots_of_4bit_rows_give_each_token_its_single_token_sum_bit_for_bit() {
    use mlx_spec::kernels::affine4::WINDOW_HEADER;
    let dir = tempfile::tempdir().unwrap();
    // E4B's hidden width (three and two chunks a lane), one and two rows a call; its
    // feed-forward width (batches of eight and two); the window sizes of a verify round.
    let cases = [
        (2560, 64, 1, 3, 4),
        (2560, 64, 2, 8, 4),
        (10240, 128, 2, 5, 2),
        (256, 32, 1, 2, 2),
    ];
    let mut source = format!(
        "{CUDA_HOST_SHIM}{HOST_SHIM}{HEADER}{WEIGHT_ROWS_HEADER}{DRIVER}{WINDOW_DRIVER}{WINDOW_HEADER}{WINDOW_RUN}\nint main() {{\n"
    );
    let mut expected_lines = 0;
    for (i, &(k, group, rows_per_call, tokens, rows)) in cases.iter().enumerate() {
        let case = Case {
            bf16: true,
            k,
            group,
            rows_per_call,
            in_place: false,
            rows,
        };
        let path = dir.path().join(format!("window-{i}.bin"));
        write_case(&case, 60 + i as u64, 90 + i as u64, &path);
        writeln!(
            source,
            "  run_window<bf16, {k}, {group}, {rows_per_call}, {tokens}>({i}, \"{}\");",
            path.display()
        )
        .unwrap();
        expected_lines += 2 * tokens * rows;
    }
    source.push_str("  return 0;\n}\n");
    let printed = compile_and_run(dir.path(), &source);
    let mut lines = 0;
    let mut tokens_differ = false;
    let mut first_of_row = std::collections::HashMap::new();
    for line in printed.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(parts.len(), 6, "unexpected driver output: {line}");
        let (case, way, token, row) = (parts[0], parts[1], parts[2], parts[3]);
        assert_eq!(
            parts[4], parts[5],
            "case {case}, way {way} (0 floats, 1 integers), token {token}, row {row}: the window's sum differs from the token's own"
        );
        // The tokens' inputs differ, so their sums must too (a window reading one token's
        // input for all would pass the equality above only if the single sums agreed).
        match first_of_row.get(&(case, way, row)) {
            None => {
                first_of_row.insert((case, way, row), parts[4]);
            }
            Some(first) if *first != parts[4] => tokens_differ = true,
            Some(_) => {}
        }
        lines += 1;
    }
    assert_eq!(lines, expected_lines as usize, "{printed}");
    assert!(tokens_differ, "the tokens' sums should differ: {printed}");
}
