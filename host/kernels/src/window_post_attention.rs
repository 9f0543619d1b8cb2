//! Everything of a layer after its attention heads for a window of 2 to 8 tokens (a verify
//! window, or a short prompt) as one kernel (`--fused-kernels ...,window`), over dense
//! weights: the stages of [`super::post_attention`] with each weight row read once for all
//! the window's tokens.
//!
//! Why: a window of k tokens ran MLX's operations, about 25 a layer after the heads (cuBLAS
//! products at ~13 µs of host time each, norms, adds, the GELU), and on an H200 a window of
//! four cost as much as four decode steps, bound by that host work (BENCHMARKS.md, "why a
//! verify window costs four decode steps"). One kernel a layer leaves the weights' bytes,
//! read once, as its cost.
//!
//! Each token's result equals what [`super::post_attention`] computes for that token alone,
//! bit for bit: the same stages with the same roundings, every row's dot summed over the same
//! pieces in the same order (`weight_dot_window`: `rows_dot_window` for dense rows, the 4-bit
//! window helpers of [`super::affine4`] over each token's own chunk sums for 4-bit ones),
//! every norm by the same threads in the same order. So, with the other window kernels
//! ([`super::window_attention_heads`], decode attention over a window,
//! [`super::window_output_head`]), a verify window scores each drafted token exactly as the
//! plain decode step would.
//!
//! The tokens' staged inputs live in dynamic shared memory (`TOKENS` vectors of the widest
//! stage, 20 KB each for E4B in bf16, with 1.25 KB of chunk sums over 4-bit weights), which
//! decides how many blocks fit a multiprocessor: two up to [`TWO_BLOCKS_SHARED_BYTES`] (dense
//! weights; over 4-bit ones the registers allow one), one up to [`ONE_BLOCK_SHARED_BYTES`];
//! longer windows run in parts (`Gemma4Model::forward_in_windows`). The hidden state after
//! the attention block (`x1`) is kept in a device output, each block writing its share,
//! instead of in every block's shared memory as the single-token kernel keeps it.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::affine4::{HEADER as AFFINE4_HEADER, WINDOW_HEADER as AFFINE4_WINDOW_HEADER};
use super::post_attention::{header, PerLayerInput, PostAttention};
use super::products::{element_bytes, HEADER as PRODUCTS_HEADER, THREADS};
use super::{PerSharedMemory, TemplateArg};

/// `rows_dot_window`, the row dots of every window kernel (after the products' header).
pub(crate) const ROWS_DOT_WINDOW: &str = r#"
// Dots of R rows (K elements of T each, 16-byte aligned) with each of the TOKENS inputs
// staged at xs + t * STRIDE, summed over the warp: out[r * TOKENS + t]. A lane adds pieces
// lane, lane + 32, ... of a row in that order for every token, as rows_dot does for one
// input, so each (row, token) sum is the single-token kernels' bit for bit.
template <typename T, int K, int R, int TOKENS, int STRIDE>
__device__ inline void rows_dot_window(const T* const* rows, const T* xs, float* out) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNKS = K / VEC;
  constexpr int UNROLL = R >= 8 ? 1 : 8 / R;
  const int lane = threadIdx.x & 31;
  const uint4* x4 = reinterpret_cast<const uint4*>(xs);
  float acc[R][TOKENS];
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int t = 0; t < TOKENS; t++) acc[r][t] = 0.f;
  }
#pragma unroll UNROLL
  for (int c = lane; c < CHUNKS; c += 32) {
    uint4 wc[R];
#pragma unroll
    for (int r = 0; r < R; r++) wc[r] = __ldg(reinterpret_cast<const uint4*>(rows[r]) + c);
#pragma unroll
    for (int t = 0; t < TOKENS; t++) {
      const uint4 xc = x4[t * (STRIDE / VEC) + c];
#pragma unroll
      for (int r = 0; r < R; r++) acc[r][t] = piece_dot<T>(wc[r], xc, acc[r][t]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int t = 0; t < TOKENS; t++) out[r * TOKENS + t] = warp_sum(acc[r][t]);
  }
}
"#;

/// Device helpers added to the post-attention kernel's ones, after [`ROWS_DOT_WINDOW`] and the
/// 4-bit window helpers ([`super::affine4::WINDOW_HEADER`]).
const WINDOW_HEADER: &str = r#"
// o[t * rows + r] = W[r] . (input t), rounded to T as MLX's product rounds it and kept in
// float32, two of the warp's rows at a time (every `warps`-th from `first`); W is [rows, K],
// dense (BITS 0) or 4-bit with scales s and biases b, each token's chunk sums in `sums`.
template <typename T, int K, int BITS, int G, int TOKENS, int STRIDE>
__device__ inline void window_product_rows(const void* w, const T* s, const T* b, const T* xs,
                                           const float* sums, float* o, int rows, int first,
                                           int warps) {
  const bool lane0 = (threadIdx.x & 31) == 0;
  const void* ws[2] = {w, w};
  const T* ss[2] = {s, s};
  const T* bs[2] = {b, b};
  for (int r = first; r < rows; r += 2 * warps) {
    // A last row without a partner is paired with itself and written once.
    const int r2 = r + warps < rows ? r + warps : r;
    const int rs[2] = {r, r2};
    float d[2 * TOKENS];
    weight_dot_window<T, K, 2, BITS, G, TOKENS, STRIDE>(ws, ss, bs, rs, xs, sums, d);
    if (lane0) {
#pragma unroll
      for (int t = 0; t < TOKENS; t++) {
        o[t * rows + r] = static_cast<float>(static_cast<T>(d[t]));
        if (r2 != r) o[t * rows + r2] = static_cast<float>(static_cast<T>(d[TOKENS + t]));
      }
    }
  }
}
"#;

const SOURCE: &str = r#"
  constexpr int WARPS = 8;
  constexpr int NH = N > H ? N : H;
  constexpr int PZ = P > Z ? P : Z;
  constexpr int STAGED = NH > PZ ? NH : PZ;
  // Token t's staged input at buf + t * STAGED (TOKENS * STAGED elements), then, for 4-bit
  // weights, its chunk sums at sums + t * (STAGED / 32) (sizes set by the host).
  extern __shared__ __align__(16) unsigned char window_shared[];
  T* const buf = reinterpret_cast<T*>(window_shared);
  float* const sums = BITS != 0 ? reinterpret_cast<float*>(buf + TOKENS * STAGED) : nullptr;
  __shared__ float red[32];
  unsigned int* bar = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(barrier));
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * WARPS;
  const int first = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const float s = static_cast<float>(scale[0]);
  // This block's share of a [TOKENS, H] output the grid writes once: the elements i with
  // i / BLOCK_THREADS = blockIdx.x (mod the grid), as the output loops below take them.
  const int share = blockIdx.x * BLOCK_THREADS + threadIdx.x;
  const int share_step = gridDim.x * BLOCK_THREADS;

  // 0. o0 = W_o z, every token.
  for (int t = 0; t < TOKENS; t++) stage_input<T, Z, false>(z + t * Z, z, buf + t * STAGED, red);
  window_chunk_sums<T, Z, BITS, TOKENS, STAGED>(buf, sums);
  window_product_rows<T, Z, BITS, G, TOKENS, STAGED>(wo, wo_s, wo_b, buf, sums, o0, H, first, warps);
  __threadfence();
  grid_barrier(bar);

  // x1 = x + rms_norm(o0, post_attention_norm), whole in every block (and this block's share
  // kept in x1 for the later stages), then x' = rms_norm(x1, pre_norm) staged in place.
  for (int t = 0; t < TOKENS; t++) {
    const float r0 = product_rms<H>(o0 + t * H, red);
    T* xt = buf + t * STAGED;
    for (int i = threadIdx.x; i < H; i += BLOCK_THREADS) {
      const T v = closed<T, false>(__ldcg(o0 + t * H + i), r0, x[t * H + i], post_attention_norm[i], s);
      xt[i] = v;
      if ((i / BLOCK_THREADS) % gridDim.x == blockIdx.x) x1[t * H + i] = v;
    }
  }
  __syncthreads();
  for (int t = 0; t < TOKENS; t++) {
    stage_input<T, H, true>(buf + t * STAGED, pre_norm, buf + t * STAGED, red);
  }
  window_chunk_sums<T, H, BITS, TOKENS, STAGED>(buf, sums);

  // 1. a = gelu_tanh(W_gate x') * (W_up x').
  {
    const void* ws[2] = {wg, wu};
    const T* ss[2] = {wg_s, wu_s};
    const T* bs[2] = {wg_b, wu_b};
    for (int r = first; r < N; r += warps) {
      const int rs[2] = {r, r};
      float d[2 * TOKENS];
      weight_dot_window<T, H, 2, BITS, G, TOKENS, STAGED>(ws, ss, bs, rs, buf, sums, d);
      if (lane == 0) {
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
          const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d[t]))));
          a[t * N + r] = static_cast<T>(static_cast<float>(act) *
                                        static_cast<float>(static_cast<T>(d[TOKENS + t])));
        }
      }
    }
  }
  __threadfence();
  grid_barrier(bar);

  // 2. o = W_down a.
  for (int t = 0; t < TOKENS; t++) stage_written<T, N>(a + t * N, buf + t * STAGED);
  window_chunk_sums<T, N, BITS, TOKENS, STAGED>(buf, sums);
  window_product_rows<T, N, BITS, G, TOKENS, STAGED>(wd, wd_s, wd_b, buf, sums, o, H, first, warps);
  __threadfence();
  grid_barrier(bar);

  // 3. h = x1 + rms_norm(o, post_norm): the output without a per-layer input (times the
  // layer scalar, each block its share), else staged whole in every block.
  if constexpr (P == 0) {
    if (blockIdx.x * BLOCK_THREADS >= H) return;
    for (int t = 0; t < TOKENS; t++) {
      const float r1 = product_rms<H>(o + t * H, red);
      for (int i = share; i < H; i += share_step) {
        out[t * H + i] = closed<T, true>(__ldcg(o + t * H + i), r1, x1[t * H + i], post_norm[i], s);
      }
    }
  } else {
    for (int t = 0; t < TOKENS; t++) {
      const float r1 = product_rms<H>(o + t * H, red);
      T* ht = buf + t * STAGED;
      for (int i = threadIdx.x; i < H; i += BLOCK_THREADS) {
        ht[i] = closed<T, false>(__ldcg(o + t * H + i), r1, __ldcg(x1 + t * H + i), post_norm[i], s);
      }
    }
    __syncthreads();
    window_chunk_sums<T, H, BITS, TOKENS, STAGED>(buf, sums);

    // 4. g = gelu_tanh(W_in h) * v, v token t's P values of this layer.
    const int v0 = ple_offset[0];
    {
      const void* ws[1] = {pg};
      const T* ss[1] = {pg_s};
      const T* bs[1] = {pg_b};
      for (int r = first; r < P; r += warps) {
        float d[TOKENS];
        weight_dot_window<T, H, 1, BITS, G, TOKENS, STAGED>(ws, ss, bs, &r, buf, sums, d);
        if (lane == 0) {
#pragma unroll
          for (int t = 0; t < TOKENS; t++) {
            const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d[t]))));
            g[t * P + r] = static_cast<T>(static_cast<float>(act) *
                                          static_cast<float>(per_layer[t * VSTRIDE + v0 + r]));
          }
        }
      }
    }
    __threadfence();
    grid_barrier(bar);

    // 5. o2 = W_proj g.
    for (int t = 0; t < TOKENS; t++) stage_written<T, P>(g + t * P, buf + t * STAGED);
    window_chunk_sums<T, P, BITS, TOKENS, STAGED>(buf, sums);
    window_product_rows<T, P, BITS, G, TOKENS, STAGED>(pp, pp_s, pp_b, buf, sums, o2, H, first, warps);
    __threadfence();
    grid_barrier(bar);

    // 6. out = (h + rms_norm(o2, post_norm_2)) * layer scalar, h computed again as in 3.
    if (blockIdx.x * BLOCK_THREADS >= H) return;
    for (int t = 0; t < TOKENS; t++) {
      const float r1 = product_rms<H>(o + t * H, red);
      const float r2 = product_rms<H>(o2 + t * H, red);
      for (int i = share; i < H; i += share_step) {
        const T h = closed<T, false>(__ldcg(o + t * H + i), r1, x1[t * H + i], post_norm[i], s);
        out[t * H + i] = closed<T, true>(__ldcg(o2 + t * H + i), r2, h, post_norm_2[i], s);
      }
    }
  }
"#;

const OUTPUTS: &[&str] = &["out", "o0", "a", "o", "x1", "g", "o2"];

/// Tokens a call takes at most (and at least 2: one token is [`super::post_attention`]'s).
pub const MAX_TOKENS: usize = 8;

/// Dynamic shared memory a block may use with two blocks a multiprocessor (an H200 has
/// 228 KB a multiprocessor, 1 KB of it reserved per block).
const TWO_BLOCKS_SHARED_BYTES: usize = 108 * 1024;

/// Dynamic shared memory a block may use alone on a multiprocessor.
const ONE_BLOCK_SHARED_BYTES: usize = 216 * 1024;

/// Bytes of dynamic shared memory a call over `tokens` tokens needs: each token's input to
/// the widest stage, and over 4-bit weights (`bits` 4) its chunk sums, a float per 32 values.
fn shared_bytes(
    h: usize,
    z: usize,
    n: usize,
    p: usize,
    tokens: usize,
    element: usize,
    bits: i32,
) -> usize {
    let staged = h.max(z).max(n).max(p);
    let sums = if bits == 0 { 0 } else { staged / 32 * 4 };
    tokens * (staged * element + sums)
}

/// Blocks a multiprocessor holds for a call needing `shared` bytes over weights of `bits`
/// (0 dense, 4), `None` if none fits. Over 4-bit weights one: each (row, token) sum of the
/// window holds a batch of packed chunks with their scales and biases, and NVRTC for sm_90a
/// gives the kernel 138-168 registers a thread for E4B's shapes (`compile_check.sh`), more
/// than two blocks of 256 threads may hold (128); a grid-wide barrier needs every block
/// resident.
fn blocks_per_multiprocessor(shared: usize, bits: i32) -> Option<i32> {
    if shared <= TWO_BLOCKS_SHARED_BYTES && bits == 0 {
        Some(2)
    } else if shared <= ONE_BLOCK_SHARED_BYTES {
        Some(1)
    } else {
        None
    }
}

/// Whether the kernel serves `tokens` tokens of hidden size `h`, attention width `z`,
/// feed-forward width `n` and per-layer width `p` (0: none) in `dtype`, over dense weights
/// (`bits` 0) or 4-bit ones (4): 2 to [`MAX_TOKENS`] tokens, whole 16-byte loads (4-bit rows:
/// whole 32-value chunks), and the staged inputs fit a block's shared memory.
pub fn serves(
    h: usize,
    z: usize,
    n: usize,
    p: usize,
    tokens: usize,
    dtype: Dtype,
    bits: i32,
) -> bool {
    let Some(e) = element_bytes(dtype) else {
        return false;
    };
    let whole = |k: usize| (k * e) % 16 == 0 && (bits == 0 || k % 32 == 0);
    (2..=MAX_TOKENS).contains(&tokens)
        && (bits == 0 || bits == 4)
        && h > 0
        && z > 0
        && n > 0
        && [h, z, n, p].into_iter().all(whole)
        && blocks_per_multiprocessor(shared_bytes(h, z, n, p, tokens, e, bits), bits).is_some()
}

thread_local! {
    static KERNELS: RefCell<PerSharedMemory> = RefCell::new(PerSharedMemory::new(
        "window_post_attention",
        super::post_attention::INPUTS,
        OUTPUTS,
        SOURCE,
        Box::leak(
            format!(
                "{}{ROWS_DOT_WINDOW}{AFFINE4_WINDOW_HEADER}{WINDOW_HEADER}",
                header(false)
            )
            .into_boxed_str()
        ),
    ));
}

/// The layer's output for the window's tokens `x` (`[T, H]`, the layer's input) and their
/// attention heads' output `z` (`[T, Z]`), with dense weights or 4-bit ones of one group size
/// (values unpacked as floats):
/// the attention's output product and residual, the feed-forward block, then the
/// per-layer-input block when given (`values` `[T, layers, P]`), the result times `scale`
/// (the layer scalar, first element of a device array). Each token's row equals
/// [`super::post_attention`]'s for that token. `barrier` is the call site's
/// ([`super::post_attention::new_barrier`]). Check [`serves`].
pub fn window_post_attention(
    x: &Array,
    z: &Array,
    eps: f32,
    w: &PostAttention,
    ple: Option<&PerLayerInput>,
    scale: &Array,
    barrier: &Array,
) -> Result<Array> {
    let dtype = x.dtype();
    let tokens = x.shape()[0];
    let h = x.shape()[x.ndim() - 1];
    let zw = z.shape()[z.ndim() - 1];
    let n = w.gate.rows();
    for (a, what) in [(x, "the hidden states"), (z, "the attention outputs")] {
        let width = a.shape()[a.ndim() - 1];
        if a.shape() != [tokens, width] || a.dtype() != dtype {
            bail!(
                "window_post_attention: {what} are {:?} {:?}, expected [{tokens}, {width}] {dtype:?}",
                a.shape(),
                a.dtype()
            );
        }
    }
    let (bits, group, p) =
        super::post_attention::layer_layout("window_post_attention", w, ple, h, zw, dtype)?;
    if let Some(v) = ple {
        if v.values.dtype() != dtype || v.values.size() % (tokens.max(1) as usize) != 0 {
            bail!(
                "window_post_attention: the per-layer inputs are {:?} {:?}, expected [{tokens}, layers, {p}] {dtype:?}",
                v.values.shape(),
                v.values.dtype()
            );
        }
    }
    let (tk, hu, zu, nu, pu) = (
        tokens as usize,
        h as usize,
        zw as usize,
        n as usize,
        p as usize,
    );
    if !serves(hu, zu, nu, pu, tk, dtype, bits) {
        bail!(
            "window_post_attention does not serve {tokens} tokens of hidden {h}, attention {zw}, width {n}, per-layer {p} in {dtype:?} ({bits}-bit weights)"
        );
    }
    let element = element_bytes(dtype).unwrap_or(2);
    let shared = shared_bytes(hu, zu, nu, pu, tk, element, bits);
    let per_multiprocessor = blocks_per_multiprocessor(shared, bits).unwrap_or(1);
    let Some(multiprocessors) = super::post_attention::grid_blocks()
        .map(|blocks| blocks / super::post_attention::BLOCKS_PER_MULTIPROCESSOR)
    else {
        bail!("window_post_attention needs the CUDA device's multiprocessor count");
    };
    let blocks = multiprocessors * per_multiprocessor;
    // Without a per-layer input its inputs are never read: one-element stand-ins (the kernel
    // takes a weight's values as untyped rows, its scales and biases as the dtype's).
    let unread = super::post_attention::unread_input(dtype);
    let (pg, values, offset, pp, post_norm_2, vstride) = match ple {
        Some(v) => {
            let vstride = (v.values.size() / tk) as i32;
            (
                v.gate.inputs(),
                v.values,
                v.offset,
                v.projection.inputs(),
                v.post_norm,
                vstride,
            )
        }
        None => ([unread; 3], unread, barrier, [unread; 3], unread, 0),
    };
    let [wo, wo_s, wo_b] = w.output.inputs();
    let [wg, wg_s, wg_b] = w.gate.inputs();
    let [wu, wu_s, wu_b] = w.up.inputs();
    let [wd, wd_s, wd_b] = w.down.inputs();
    let [pg, pg_s, pg_b] = pg;
    let [pp, pp_s, pp_b] = pp;
    let (rows, width, per_layer_width) = ([tokens, h], [tokens, n], [tokens, p.max(1)]);
    let outputs = [
        (&rows[..], dtype),
        (&rows[..], Dtype::Float32),
        (&width[..], dtype),
        (&rows[..], Dtype::Float32),
        (&rows[..], dtype),
        (&per_layer_width[..], dtype),
        (&rows[..], Dtype::Float32),
    ];
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(shared, eps)?;
        let mut out = kernel.apply(
            &[
                x,
                z,
                wo,
                w.post_attention_norm,
                w.pre_norm,
                wg,
                wu,
                wd,
                w.post_norm,
                pg,
                values,
                offset,
                pp,
                post_norm_2,
                scale,
                barrier,
                wo_s,
                wo_b,
                wg_s,
                wg_b,
                wu_s,
                wu_b,
                wd_s,
                wd_b,
                pg_s,
                pg_b,
                pp_s,
                pp_b,
            ],
            &outputs,
            (blocks * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"H", TemplateArg::Int(h)),
                (c"Z", TemplateArg::Int(zw)),
                (c"N", TemplateArg::Int(n)),
                (c"P", TemplateArg::Int(p)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
                (c"TOKENS", TemplateArg::Int(tokens)),
                (c"VSTRIDE", TemplateArg::Int(vstride)),
            ],
        )?;
        Ok(out.swap_remove(0))
    })
}

/// The products' and 4-bit helpers, [`ROWS_DOT_WINDOW`] and the 4-bit window helpers, for the
/// window kernels without barriers.
pub(crate) fn rows_window_header(more: &str) -> &'static str {
    Box::leak(
        format!("{PRODUCTS_HEADER}{AFFINE4_HEADER}{ROWS_DOT_WINDOW}{AFFINE4_WINDOW_HEADER}{more}")
            .into_boxed_str(),
    )
}

#[cfg(test)]
mod tests {
    use super::super::post_attention::Weight;
    use super::*;

    #[test]
    fn windows_are_served_while_their_inputs_fit_shared_memory() {
        // E4B in bf16: 20 KB a token for the feed-forward width of 10 240.
        let e4b = |tokens| serves(2560, 2048, 10240, 256, tokens, Dtype::Bfloat16, 0);
        assert!(!e4b(1), "one token is the single-token kernel's");
        assert!(e4b(2) && e4b(5) && e4b(8));
        assert!(!e4b(9), "past MAX_TOKENS");
        assert_eq!(
            blocks_per_multiprocessor(shared_bytes(2560, 2048, 10240, 256, 5, 2, 0), 0),
            Some(2)
        );
        assert_eq!(
            blocks_per_multiprocessor(shared_bytes(2560, 2048, 10240, 256, 6, 2, 0), 0),
            Some(1)
        );
        // 12B (15 360 wide): seven tokens fit one block a multiprocessor, eight do not.
        assert!(serves(3840, 4096, 15360, 0, 7, Dtype::Bfloat16, 0));
        assert!(!serves(3840, 4096, 15360, 0, 8, Dtype::Bfloat16, 0));
        // Rows that are not whole 16-byte loads, and dtypes the kernel has no type for.
        assert!(!serves(2564, 2048, 10240, 256, 4, Dtype::Bfloat16, 0));
        assert!(!serves(2560, 2048, 10240, 256, 4, Dtype::Int32, 0));
        // The float32 fixtures: small widths, four bytes a value.
        assert!(serves(64, 128, 256, 16, 8, Dtype::Float32, 0));
        // 4-bit weights add each token's chunk sums (1.25 KB for E4B), and their registers
        // leave room for one block a multiprocessor, whatever the window.
        let e4b_q4 = |tokens| serves(2560, 2048, 10240, 256, tokens, Dtype::Bfloat16, 4);
        assert!(e4b_q4(2) && e4b_q4(8) && !e4b_q4(9));
        assert_eq!(
            shared_bytes(2560, 2048, 10240, 256, 5, 2, 4),
            5 * (10240 * 2 + 320 * 4)
        );
        assert_eq!(
            blocks_per_multiprocessor(shared_bytes(2560, 2048, 10240, 256, 2, 2, 4), 4),
            Some(1)
        );
        // 4-bit rows are read in whole chunks of 32 values; other bit widths are not served.
        assert!(!serves(2560, 2048, 10240, 272, 4, Dtype::Bfloat16, 4));
        assert!(serves(2560, 2048, 10240, 272, 4, Dtype::Bfloat16, 0));
        assert!(!serves(2560, 2048, 10240, 256, 4, Dtype::Bfloat16, 8));
    }

    #[test]
    fn mismatched_windows_and_packed_weights_are_refused_before_any_kernel() {
        let (h, z, n) = (64, 128, 256);
        let zeros = |shape: &[i32]| Array::zeros::<f32>(shape).unwrap();
        let (wo, wg, wu, wd) = (
            zeros(&[h, z]),
            zeros(&[n, h]),
            zeros(&[n, h]),
            zeros(&[h, n]),
        );
        let norm = zeros(&[h]);
        let weights = PostAttention {
            output: Weight::Dense(&wo),
            post_attention_norm: &norm,
            pre_norm: &norm,
            gate: Weight::Dense(&wg),
            up: Weight::Dense(&wu),
            down: Weight::Dense(&wd),
            post_norm: &norm,
        };
        let scale = zeros(&[1]);
        let barrier = Array::zeros::<u32>(&[4]).unwrap();
        // Three hidden states for two attention outputs.
        let err = window_post_attention(
            &zeros(&[3, h]),
            &zeros(&[2, z]),
            1e-6,
            &weights,
            None,
            &scale,
            &barrier,
        )
        .unwrap_err();
        assert!(err.to_string().contains("attention outputs"), "{err}");
        // A 4-bit down weight among dense ones.
        let packed = Array::zeros::<u32>(&[h, n / 8]).unwrap();
        let (scales, biases) = (zeros(&[h, n / 32]), zeros(&[h, n / 32]));
        let mixed = PostAttention {
            down: Weight::Affine4 {
                packed: &packed,
                scales: &scales,
                biases: &biases,
            },
            ..weights
        };
        let err = window_post_attention(
            &zeros(&[2, h]),
            &zeros(&[2, z]),
            1e-6,
            &mixed,
            None,
            &scale,
            &barrier,
        )
        .unwrap_err();
        assert!(err.to_string().contains("mix layouts"), "{err}");
    }
}
