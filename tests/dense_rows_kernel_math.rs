//! The dense row arithmetic of the CUDA product kernels (`kernels::products::HEADER`'s
//! `rows_dot`, which every dense product, the output head and the post-attention kernel use),
//! checked without a GPU: compiled for the host with stand-ins for the CUDA built-ins, run
//! lane by lane, and compared with a plain dot product in double precision. Both ways of
//! issuing loads (up to 8 in flight, the default, and batches of 16) must give the same sums
//! bit for bit, as `bench --compare-fused` assumes when it requires their tokens to match.
//! Needs a C++17 compiler, like `affine4_kernel_math`.

mod common;

use common::{compile_and_run, CUDA_HOST_SHIM};
use mlx_spec::kernels::products::HEADER;

/// What the products' header needs besides the common stand-ins (`common::CUDA_HOST_SHIM`).
const HOST_SHIM: &str = r#"
inline float block_sum(float v, float*) { return v; }
inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
constexpr float EPS = 1e-6f;
"#;

/// The driver: a pseudo-random matrix and input (values exact in bfloat16), each case's rows
/// R at a time through rows_dot with 8 and with 16 loads, lane by lane; prints
/// "case row sum8 sum16 reference magnitude".
const DRIVER: &str = r#"
template <typename T> T from_float(float f);
template <> float from_float<float>(float f) { return f; }
template <> bf16 from_float<bf16>(float f) { uint32_t u; std::memcpy(&u, &f, 4); return bf16{uint16_t(u >> 16)}; }

// Values k / 64 for k in [-128, 128): exact in bfloat16, varied enough to catch a chunk read
// twice or skipped.
struct Lcg {
  uint64_t s;
  float next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return float(int((s >> 33) % 256) - 128) / 64.f;
  }
};

template <typename T, int K, int R, int LOADS>
void rows_sums(const std::vector<uint4>& w, const std::vector<uint4>& x, int rows, std::vector<float>& out) {
  const T* base = reinterpret_cast<const T*>(w.data());
  const T* xs = reinterpret_cast<const T*>(x.data());
  out.assign(rows, 0.f);
  for (int r0 = 0; r0 < rows; r0 += R) {
    const T* ptr[R];
    for (int i = 0; i < R; i++) ptr[i] = base + size_t(r0 + i) * K;
    for (int lane = 0; lane < 32; lane++) {
      threadIdx.x = lane;
      float part[R];
      rows_dot<T, K, R, LOADS>(ptr, xs, part);
      for (int i = 0; i < R; i++) out[r0 + i] += part[i];
    }
  }
}

template <typename T, int K, int R>
void run(int index, int rows, uint64_t seed) {
  Lcg g{seed};
  std::vector<float> wf(size_t(rows) * K), xf(K);
  for (auto& v : wf) v = g.next();
  for (auto& v : xf) v = g.next();
  // 16-byte aligned storage, as the kernels' rows and staged inputs are.
  std::vector<uint4> w(wf.size() * sizeof(T) / 16 + 1), x(K * sizeof(T) / 16 + 1);
  T* wt = reinterpret_cast<T*>(w.data());
  T* xt = reinterpret_cast<T*>(x.data());
  for (size_t i = 0; i < wf.size(); i++) wt[i] = from_float<T>(wf[i]);
  for (int i = 0; i < K; i++) xt[i] = from_float<T>(xf[i]);
  std::vector<float> s8, s16;
  rows_sums<T, K, R, 8>(w, x, rows, s8);
  rows_sums<T, K, R, 16>(w, x, rows, s16);
  for (int r = 0; r < rows; r++) {
    double want = 0, magnitude = 0;
    for (int k = 0; k < K; k++) {
      want += double(wf[size_t(r) * K + k]) * xf[k];
      magnitude += std::fabs(double(wf[size_t(r) * K + k]) * xf[k]);
    }
    std::printf("%d %d %.9g %.9g %.17g %.17g\n", index, r, s8[r], s16[r], want, magnitude);
  }
}
"#;

#[test]
fn dense_rows_give_plain_dot_products_with_any_loads_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    // (element type, K, rows a call, rows): a row shorter than a warp's chunks, uneven lanes,
    // E4B's widths, several rows a call.
    let cases = [
        ("float", 64, 1, 3),
        ("float", 2560, 2, 4),
        ("bf16", 2560, 1, 3),
        ("bf16", 2600, 2, 4),
        ("bf16", 10240, 1, 2),
        ("bf16", 10240, 4, 4),
    ];
    let mut source = format!("{CUDA_HOST_SHIM}{HOST_SHIM}{HEADER}{DRIVER}\nint main() {{\n");
    for (i, (t, k, r, rows)) in cases.iter().enumerate() {
        source += &format!("  run<{t}, {k}, {r}>({i}, {rows}, {});\n", 17 + i);
    }
    source += "  return 0;\n}\n";
    let printed = compile_and_run(dir.path(), &source);
    let mut seen = vec![0; cases.len()];
    for line in printed.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 6, "unexpected line {line:?}");
        let case: usize = f[0].parse().unwrap();
        let (s8, s16): (f32, f32) = (f[2].parse().unwrap(), f[3].parse().unwrap());
        let (want, magnitude): (f64, f64) = (f[4].parse().unwrap(), f[5].parse().unwrap());
        assert_eq!(
            s8.to_bits(),
            s16.to_bits(),
            "case {case} row {}: 8 and 16 loads in flight sum differently",
            f[1]
        );
        // float32 sums of at most 10 240 products: well within 1e-5 of their magnitude.
        assert!(
            (f64::from(s8) - want).abs() <= 1e-5 * magnitude.max(1.0),
            "case {case} row {}: {s8} vs {want}",
            f[1]
        );
        seen[case] += 1;
    }
    for (i, (_, _, _, rows)) in cases.iter().enumerate() {
        assert_eq!(seen[i], *rows, "case {i} printed {} rows", seen[i]);
    }
}

/// The driver of the window check: for each case, TOKENS inputs staged K apart, rows R at a
/// time through rows_dot_window and each token alone through rows_dot, lane by lane; prints
/// "case token row single window" with the sums' bits.
const WINDOW_DRIVER: &str = r#"
template <typename T, int K, int R, int TOKENS>
void run_window(int index, int rows, uint64_t seed) {
  Lcg g{seed};
  const size_t w_chunks = size_t(rows) * K * sizeof(T) / 16 + 1, x_chunks = size_t(TOKENS) * K * sizeof(T) / 16 + 1;
  std::vector<uint4> w(w_chunks), x(x_chunks);
  T* wt = reinterpret_cast<T*>(w.data());
  T* xt = reinterpret_cast<T*>(x.data());
  for (size_t i = 0; i < size_t(rows) * K; i++) wt[i] = from_float<T>(g.next());
  for (size_t i = 0; i < size_t(TOKENS) * K; i++) xt[i] = from_float<T>(g.next());
  for (int r0 = 0; r0 < rows; r0 += R) {
    const T* ptr[R];
    for (int i = 0; i < R; i++) ptr[i] = wt + size_t(r0 + i) * K;
    float single[R * TOKENS] = {}, window[R * TOKENS] = {};
    for (int lane = 0; lane < 32; lane++) {
      threadIdx.x = lane;
      for (int t = 0; t < TOKENS; t++) {
        float part[R];
        rows_dot<T, K, R, 8>(ptr, xt + size_t(t) * K, part);
        for (int i = 0; i < R; i++) single[i * TOKENS + t] += part[i];
      }
      float part[R * TOKENS];
      rows_dot_window<T, K, R, TOKENS, K>(ptr, xt, part);
      for (int i = 0; i < R * TOKENS; i++) window[i] += part[i];
    }
    for (int i = 0; i < R; i++)
      for (int t = 0; t < TOKENS; t++) {
        uint32_t a, b;
        std::memcpy(&a, &single[i * TOKENS + t], 4);
        std::memcpy(&b, &window[i * TOKENS + t], 4);
        std::printf("%d %d %d %u %u\n", index, t, r0 + i, a, b);
      }
  }
}
"#;

/// A verify window scores each token as a decode step would only if every (row, token) sum of
/// `rows_dot_window` (the window kernels' dense row dots, the window products' included) is
/// `rows_dot`'s for that token alone, bit for bit: checked here for the default model's and
/// the 31B's widths, with as many tokens as the kernels stage.
#[test]
fn window_row_dots_equal_each_tokens_own_row_dots_bit_for_bit() {
    use mlx_spec::kernels::window_post_attention::ROWS_DOT_WINDOW;
    let dir = tempfile::tempdir().unwrap();
    // (element type, K, rows a call, tokens, rows): the 31B's feed-forward input (5 tokens
    // fit a block) and hidden size, E4B's width, float32.
    let cases = [
        ("bf16", 21504, 1, 5, 2),
        ("bf16", 5376, 2, 8, 4),
        ("bf16", 2560, 1, 3, 3),
        ("float", 1024, 2, 4, 4),
    ];
    let mut source =
        format!("{CUDA_HOST_SHIM}{HOST_SHIM}{HEADER}{ROWS_DOT_WINDOW}{DRIVER}{WINDOW_DRIVER}\nint main() {{\n");
    for (i, (t, k, r, tokens, rows)) in cases.iter().enumerate() {
        source += &format!(
            "  run_window<{t}, {k}, {r}, {tokens}>({i}, {rows}, {});\n",
            41 + i
        );
    }
    source += "  return 0;\n}\n";
    let printed = compile_and_run(dir.path(), &source);
    let mut seen = vec![0; cases.len()];
    for line in printed.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 5, "unexpected line {line:?}");
        let case: usize = f[0].parse().unwrap();
        assert_eq!(
            f[3], f[4],
            "case {case} token {} row {}: the window's sum differs from the token's own",
            f[1], f[2]
        );
        seen[case] += 1;
    }
    for (i, (_, _, _, tokens, rows)) in cases.iter().enumerate() {
        assert_eq!(seen[i], tokens * rows, "case {i} printed {} sums", seen[i]);
    }
}
