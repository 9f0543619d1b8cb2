//! A decode token's feed-forward block and per-layer-input block as one kernel, from the
//! hidden state after attention to the layer's output (`--fused-kernels feed-forward`):
//!
//! 1. `a = gelu_tanh(W_gate x') * (W_up x')`, `x' = rms_norm(x, pre_norm)`;
//! 2. `o = W_down a`;
//! 3. `h = x + rms_norm(o, post_norm)` (times the layer scalar when there is no per-layer
//!    input: then `h` is the output);
//! 4. with a per-layer input `v`: `g = gelu_tanh(W_in h) * v`;
//! 5. `o2 = W_proj g`;
//! 6. output `(h + rms_norm(o2, post_norm_2)) * layer_scalar`.
//!
//! Why: these are four launches with [`super::products`] (a gated product and a closing
//! product per block), each paying the host's cost of an operation, a ramp-up and a drain on
//! the device, and a last-block epilogue. Here the grid stays resident from the first stage to
//! the last, and the stages meet at grid-wide barriers.
//!
//! A grid-wide barrier needs every block resident at once: the grid is two blocks per
//! streaming multiprocessor (the kernel's registers and shared memory allow at least that
//! many), and kernels of one stream do not overlap. A barrier that waits about a second
//! aborts the kernel (a CUDA error, not a hang).
//!
//! Every stage rounds as the kernels of [`super::products`] round, with the same summation
//! order, so the result equals theirs bit for bit (`bench --compare-fused` checks the tokens).
//! Each block computes the norm of a whole product itself (a few kilobytes from L2), which
//! saves a barrier per norm.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::products::{device_array, HEADER as PRODUCTS_HEADER, THREADS};
use super::{PerEpsilon, TemplateArg};

/// Device helpers added to the products' ones.
const BARRIER_HEADER: &str = r#"
// Grid-wide barrier of a grid whose blocks are all resident. bar[0] counts the blocks that
// arrived, bar[1] is the barrier's generation: the last block to arrive resets the count and
// opens the next generation, which the others wait for.
__device__ inline void grid_barrier(unsigned int* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* generation = bar + 1;
    const unsigned int mine = atomicAdd(generation, 0u);
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(generation, 1u);
    } else {
      const long long start = clock64();
      while (atomicAdd(generation, 0u) == mine) {
        __nanosleep(64);
        // About a second at the H200's clock: some block never ran, abort rather than hang.
        if (clock64() - start > (1ll << 31)) __trap();
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// Copies K elements that other blocks wrote in this kernel into shared memory, reading
// through L2 (the L1 of this multiprocessor may hold older lines).
template <typename T, int K>
__device__ inline void stage_written(const T* src, T* xs) {
  constexpr int CHUNKS = K * sizeof(T) / 16;
  // At least one (unused when K is 0: no per-layer input).
  constexpr int ITEMS = CHUNKS > 0 ? (CHUNKS + BLOCK_THREADS - 1) / BLOCK_THREADS : 1;
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  uint4* x4 = reinterpret_cast<uint4*>(xs);
  uint4 v[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; j++) {
    const int c = threadIdx.x + j * BLOCK_THREADS;
    if (c < CHUNKS) v[j] = __ldcg(s4 + c);
  }
#pragma unroll
  for (int j = 0; j < ITEMS; j++) {
    const int c = threadIdx.x + j * BLOCK_THREADS;
    if (c < CHUNKS) x4[c] = v[j];
  }
  __syncthreads();
}

// rsqrt(mean(o^2) + EPS) over the N floats of a product other blocks wrote, summed in the
// order of the closing product's last block.
template <int N>
__device__ inline float product_rms(const float* o, float* red) {
  constexpr int PER = N > 0 ? (N + BLOCK_THREADS - 1) / BLOCK_THREADS : 1;
  float v[PER];
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int i = threadIdx.x + j * BLOCK_THREADS;
    v[j] = i < N ? __ldcg(o + i) : 0.f;
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PER; j++) ss += v[j] * v[j];
  return rsqrtf(block_sum(ss, red) / N + EPS);
}

// h + rms_norm(o) with norm weight pw, times s when SCALED, rounded as the closing product.
template <typename T, bool SCALED>
__device__ inline T closed(float o, float r, T h, T pw, float s) {
  const T n = static_cast<T>(o * r);
  const T weighted = static_cast<T>(static_cast<float>(pw) * static_cast<float>(n));
  T sum = static_cast<T>(static_cast<float>(h) + static_cast<float>(weighted));
  if (SCALED) sum = static_cast<T>(static_cast<float>(sum) * s);
  return sum;
}
"#;

const SOURCE: &str = r#"
  constexpr int WARPS = 8;
  constexpr int STAGED = N > H ? (N > P ? N : P) : (H > P ? H : P);
  __shared__ __align__(16) T buf[STAGED];
  __shared__ __align__(16) T hs[P > 0 ? H : 8];
  __shared__ float red[32];
  unsigned int* bar = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(barrier));
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * WARPS;
  const int first = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const float s = static_cast<float>(scale[0]);

  // 1. a = gelu_tanh(W_gate x') * (W_up x'), x' = rms_norm(x, pre_norm).
  stage_input<T, H, true>(x, pre_norm, buf, red);
  for (int r = first; r < N; r += warps) {
    const T* rows[2] = {wg + (size_t)r * H, wu + (size_t)r * H};
    float d[2];
    rows_dot<T, H, 2>(rows, buf, d);
    if (lane == 0) {
      const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d[0]))));
      a[r] = static_cast<T>(static_cast<float>(act) * static_cast<float>(static_cast<T>(d[1])));
    }
  }
  __threadfence();
  grid_barrier(bar);

  // 2. o = W_down a, rounded to T as MLX's product rounds it, kept in float32.
  stage_written<T, N>(a, buf);
  for (int r = first; r < H; r += warps) {
    const T* row = wd + (size_t)r * N;
    float d;
    rows_dot<T, N, 1>(&row, buf, &d);
    if (lane == 0) o[r] = static_cast<float>(static_cast<T>(d));
  }
  __threadfence();
  grid_barrier(bar);

  // 3. h = x + rms_norm(o, post_norm): the output without a per-layer input (times the
  // layer scalar; the blocks write it in turns), else every block keeps all of h.
  const float r1 = product_rms<H>(o, red);
  if constexpr (P == 0) {
    for (int i = blockIdx.x * BLOCK_THREADS + threadIdx.x; i < H; i += gridDim.x * BLOCK_THREADS) {
      out[i] = closed<T, true>(__ldcg(o + i), r1, x[i], post_norm[i], s);
    }
  } else {
    for (int i = threadIdx.x; i < H; i += BLOCK_THREADS) {
      hs[i] = closed<T, false>(__ldcg(o + i), r1, x[i], post_norm[i], s);
    }
    __syncthreads();

    // 4. g = gelu_tanh(W_in h) * v, v this layer's per-layer input.
    const int v0 = ple_offset[0];
    for (int r = first; r < P; r += warps) {
      const T* row = pg + (size_t)r * H;
      float d;
      rows_dot<T, H, 1>(&row, hs, &d);
      if (lane == 0) {
        const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d))));
        g[r] = static_cast<T>(static_cast<float>(act) * static_cast<float>(per_layer[v0 + r]));
      }
    }
    __threadfence();
    grid_barrier(bar);

    // 5. o2 = W_proj g.
    stage_written<T, P>(g, buf);
    for (int r = first; r < H; r += warps) {
      const T* row = pp + (size_t)r * P;
      float d;
      rows_dot<T, P, 1>(&row, buf, &d);
      if (lane == 0) o2[r] = static_cast<float>(static_cast<T>(d));
    }
    __threadfence();
    grid_barrier(bar);

    // 6. out = (h + rms_norm(o2, post_norm_2)) * layer scalar, written in turns.
    if (blockIdx.x * BLOCK_THREADS >= H) return;
    const float r2 = product_rms<H>(o2, red);
    for (int i = blockIdx.x * BLOCK_THREADS + threadIdx.x; i < H; i += gridDim.x * BLOCK_THREADS) {
      out[i] = closed<T, true>(__ldcg(o2 + i), r2, hs[i], post_norm_2[i], s);
    }
  }
"#;

/// Blocks per streaming multiprocessor. The kernel's shared memory (at most
/// [`MAX_SHARED_BYTES`]) and registers (NVRTC for sm_90a: 78 a thread for E4B's shapes; 128
/// would still fit two blocks of 256 threads) let at least this many be resident.
const BLOCKS_PER_MULTIPROCESSOR: i32 = 2;

/// The staged vectors must fit a block's static shared memory (48 KB), twice per
/// multiprocessor with room to spare.
const MAX_SHARED_BYTES: usize = 44 * 1024;

thread_local! {
    static KERNELS: RefCell<PerEpsilon> = RefCell::new(PerEpsilon::new(
        "feed_forward_block",
        &[
            "x", "pre_norm", "wg", "wu", "wd", "post_norm", "pg", "per_layer", "ple_offset", "pp",
            "post_norm_2", "scale", "barrier",
        ],
        &["out", "a", "o", "g", "o2"],
        SOURCE,
    ).with_header(Box::leak(format!("{PRODUCTS_HEADER}{BARRIER_HEADER}").into_boxed_str())));
}

/// The per-layer-input block's weights and this layer's inputs.
pub struct PerLayerInput<'a> {
    /// `[P, H]`, the per-layer input gate.
    pub gate: &'a Array,
    /// The per-layer inputs of every layer, contiguous; this layer's `P` start at `offset`.
    pub values: &'a Array,
    /// int32 in device memory ([`device_array`]): where this layer's inputs start.
    pub offset: &'a Array,
    /// `[H, P]`, the projection back to the hidden size.
    pub projection: &'a Array,
    pub post_norm: &'a Array,
}

/// Dense weights of one layer's feed-forward block (`[N, H]` gate and up, `[H, N]` down) and
/// its norms.
pub struct FeedForward<'a> {
    pub pre_norm: &'a Array,
    pub gate: &'a Array,
    pub up: &'a Array,
    pub down: &'a Array,
    pub post_norm: &'a Array,
}

/// Whether the kernel serves hidden size `h`, feed-forward width `n` and per-layer width `p`
/// (0: none) in `dtype`: whole 16-byte loads, and the staged vectors fit shared memory.
pub fn serves(h: usize, n: usize, p: usize, dtype: Dtype) -> bool {
    let e = match dtype {
        Dtype::Float32 => 4,
        Dtype::Bfloat16 | Dtype::Float16 => 2,
        _ => return false,
    };
    let whole = |k: usize| (k * e) % 16 == 0;
    let staged = h.max(n).max(p) + if p > 0 { h } else { 0 };
    h > 0 && n > 0 && whole(h) && whole(n) && whole(p) && staged * e <= MAX_SHARED_BYTES
}

/// The barrier state a call site owns (two counters in device memory). Calls of one site
/// never overlap: each step's depends on the previous step's token.
pub fn new_barrier() -> Result<Array> {
    device_array(&Array::from_slice(&[0u32], &[1]), 16)
}

/// Blocks of the grid, or `None` where the device's multiprocessors are unknown.
pub fn grid_blocks() -> Option<i32> {
    crate::device::cuda_multiprocessor_count().map(|sms| sms * BLOCKS_PER_MULTIPROCESSOR)
}

/// The layer's output for the token `x` (`[1, H]`, the hidden state after attention): the
/// feed-forward block, then the per-layer-input block when given, the result times `scale`
/// (the layer scalar, first element of a device array). Check [`serves`] and [`grid_blocks`].
pub fn feed_forward_block(
    x: &Array,
    eps: f32,
    ff: &FeedForward,
    ple: Option<&PerLayerInput>,
    scale: &Array,
    barrier: &Array,
) -> Result<Array> {
    let dtype = x.dtype();
    let h = x.shape()[x.ndim() - 1];
    let n = ff.gate.shape()[0];
    let expect = |w: &Array, shape: [i32; 2], what: &str| -> Result<()> {
        if w.shape() != shape || w.dtype() != dtype {
            bail!(
                "feed_forward_block: {what} weight is {:?} {:?}, expected {shape:?} {dtype:?}",
                w.shape(),
                w.dtype()
            );
        }
        Ok(())
    };
    expect(ff.gate, [n, h], "gate")?;
    expect(ff.up, [n, h], "up")?;
    expect(ff.down, [h, n], "down")?;
    let p = match ple {
        Some(v) => {
            let p = v.gate.shape()[0];
            expect(v.gate, [p, h], "per-layer input gate")?;
            expect(v.projection, [h, p], "per-layer projection")?;
            if v.offset.dtype() != Dtype::Int32 {
                bail!("feed_forward_block: the per-layer input offset must be int32");
            }
            p
        }
        None => 0,
    };
    if !serves(h as usize, n as usize, p as usize, dtype) {
        bail!(
            "feed_forward_block does not serve hidden {h}, width {n}, per-layer {p} in {dtype:?}"
        );
    }
    let Some(blocks) = grid_blocks() else {
        bail!("feed_forward_block needs the CUDA device's multiprocessor count");
    };
    // Without a per-layer input its inputs are never read: the hidden state stands in.
    let (pg, values, offset, pp, post_norm_2) = match ple {
        Some(v) => (v.gate, v.values, v.offset, v.projection, v.post_norm),
        None => (x, x, barrier, x, x),
    };
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        let mut out = kernel.apply(
            &[
                x,
                ff.pre_norm,
                ff.gate,
                ff.up,
                ff.down,
                ff.post_norm,
                pg,
                values,
                offset,
                pp,
                post_norm_2,
                scale,
                barrier,
            ],
            &[
                (&[1, h], dtype),
                (&[n], dtype),
                (&[h], Dtype::Float32),
                (&[p.max(1)], dtype),
                (&[h], Dtype::Float32),
            ],
            (blocks * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"H", TemplateArg::Int(h)),
                (c"N", TemplateArg::Int(n)),
                (c"P", TemplateArg::Int(p)),
            ],
        )?;
        Ok(out.remove(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_whole_loads_that_fit_shared_memory() {
        assert!(serves(2560, 10240, 256, Dtype::Bfloat16), "E4B");
        assert!(serves(3840, 15360, 0, Dtype::Bfloat16), "12B");
        assert!(serves(64, 256, 32, Dtype::Float32), "a fixture");
        assert!(!serves(2560, 10240, 256, Dtype::Float32), "50 KB staged");
        assert!(!serves(2560, 10244, 256, Dtype::Bfloat16), "a partial load");
        assert!(
            !serves(2560, 10240, 4, Dtype::Bfloat16),
            "a partial per-layer load"
        );
        assert!(!serves(2560, 10240, 256, Dtype::Int32));
    }

    #[test]
    fn a_barrier_starts_at_zero() {
        assert_eq!(new_barrier().unwrap().as_slice::<u32>(), &[0; 16]);
    }

    #[test]
    fn mismatched_weights_are_refused_before_any_kernel() {
        let x = Array::zeros::<f32>(&[1, 8]).unwrap();
        let w = Array::zeros::<f32>(&[16, 8]).unwrap();
        let wrong = Array::zeros::<f32>(&[8, 8]).unwrap();
        let ff = FeedForward {
            pre_norm: &x,
            gate: &w,
            up: &w,
            down: &wrong,
            post_norm: &x,
        };
        let barrier = new_barrier().unwrap();
        let err = feed_forward_block(&x, 1e-6, &ff, None, &x, &barrier).unwrap_err();
        assert!(err.to_string().contains("down weight"), "{err}");
    }
}
