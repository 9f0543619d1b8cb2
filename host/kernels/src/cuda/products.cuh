
// Threads of every block of these kernels (`THREADS` on the host side).
constexpr int BLOCK_THREADS = 256;

// Stages the input row in shared memory as T: RMS-normed with weight `nw` when NORM, rounded
// as MLX's RMSNorm rounds; every thread of the block takes part. Each thread issues all its
// 16-byte loads before using any, so the block waits for one memory round trip, not one per
// element (inputs that are not 16-byte aligned take the element-wise path).
template <typename T, int K, bool NORM>
__device__ inline void stage_input(const T* x, const T* nw, T* xs, float* red) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNKS = K / VEC;
  constexpr int ITEMS = (CHUNKS + BLOCK_THREADS - 1) / BLOCK_THREADS;
  const bool aligned = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(nw)) & 15) == 0;
  if (!aligned) {
    float ss = 0.f;
    if (NORM) {
      for (int i = threadIdx.x; i < K; i += BLOCK_THREADS) {
        const float a = static_cast<float>(x[i]);
        ss += a * a;
      }
    }
    const float r = NORM ? rsqrtf(block_sum(ss, red) / K + EPS) : 1.f;
    for (int i = threadIdx.x; i < K; i += BLOCK_THREADS) {
      if (NORM) {
        const T n = static_cast<T>(static_cast<float>(x[i]) * r);
        xs[i] = static_cast<T>(static_cast<float>(nw[i]) * static_cast<float>(n));
      } else {
        xs[i] = x[i];
      }
    }
    __syncthreads();
    return;
  }
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  uint4* xs4 = reinterpret_cast<uint4*>(xs);
  uint4 v[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; j++) {
    const int c = threadIdx.x + j * BLOCK_THREADS;
    if (c < CHUNKS) v[j] = x4[c];
  }
  if (NORM) {
    const uint4* w4 = reinterpret_cast<const uint4*>(nw);
    uint4 w[ITEMS];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
      const int c = threadIdx.x + j * BLOCK_THREADS;
      if (c < CHUNKS) {
        w[j] = w4[c];
        const T* e = reinterpret_cast<const T*>(&v[j]);
#pragma unroll
        for (int q = 0; q < VEC; q++) ss += static_cast<float>(e[q]) * static_cast<float>(e[q]);
      }
    }
    const float r = rsqrtf(block_sum(ss, red) / K + EPS);
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
      const int c = threadIdx.x + j * BLOCK_THREADS;
      if (c < CHUNKS) {
        T* e = reinterpret_cast<T*>(&v[j]);
        const T* we = reinterpret_cast<const T*>(&w[j]);
#pragma unroll
        for (int q = 0; q < VEC; q++) {
          const T n = static_cast<T>(static_cast<float>(e[q]) * r);
          e[q] = static_cast<T>(static_cast<float>(we[q]) * static_cast<float>(n));
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < ITEMS; j++) {
    const int c = threadIdx.x + j * BLOCK_THREADS;
    if (c < CHUNKS) xs4[c] = v[j];
  }
  __syncthreads();
}

// acc + w . x over one 16-byte piece of a row and of the input, element by element in order
// (every dense dot adds its pieces through this, so they all round alike).
template <typename T>
__device__ inline float piece_dot(const uint4& w, const uint4& x, float acc) {
  const T* we = reinterpret_cast<const T*>(&w);
  const T* xe = reinterpret_cast<const T*>(&x);
#pragma unroll
  for (int e = 0; e < 16 / (int)sizeof(T); e++) {
    acc += static_cast<float>(we[e]) * static_cast<float>(xe[e]);
  }
  return acc;
}

// Dots of R rows (each K elements of T, 16-byte aligned) with the staged input, summed over
// the warp: every lane gets the results. A lane takes chunks lane, lane + 32, ... of each
// row, and adds them in that order whatever LOADS is, so the sums do not depend on it.
// LOADS <= 8: an unrolled loop, from which the compiler keeps up to about eight 16-byte loads
// in flight (the measured default). LOADS > 8: explicit batches of about LOADS loads across
// the rows, each batch issued before any of it is used (NVRTC keeps them in flight: 117
// registers for gate and up at 16, against 44).
template <typename T, int K, int R, int LOADS = 8>
__device__ inline void rows_dot(const T* const* rows, const T* xs, float* out) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNKS = K / VEC;
  const int lane = threadIdx.x & 31;
  const uint4* x4 = reinterpret_cast<const uint4*>(xs);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.f;
  if constexpr (LOADS <= 8) {
    constexpr int UNROLL = R >= LOADS ? 1 : LOADS / R;
#pragma unroll UNROLL
    for (int c = lane; c < CHUNKS; c += 32) {
      uint4 wc[R];
#pragma unroll
      for (int r = 0; r < R; r++) wc[r] = __ldg(reinterpret_cast<const uint4*>(rows[r]) + c);
      const uint4 xc = x4[c];
#pragma unroll
      for (int r = 0; r < R; r++) acc[r] = piece_dot<T>(wc[r], xc, acc[r]);
    }
  } else {
    constexpr int PER_LANE = (CHUNKS + 31) / 32;
    constexpr int WANT = LOADS / R > 0 ? LOADS / R : 1;
    constexpr int BATCH = PER_LANE < WANT ? PER_LANE : WANT;
    for (int base = 0; base < PER_LANE; base += BATCH) {
      uint4 wc[BATCH][R];
#pragma unroll
      for (int b = 0; b < BATCH; b++) {
        const int c = lane + 32 * (base + b);
#pragma unroll
        for (int r = 0; r < R; r++) {
          wc[b][r] = c < CHUNKS ? __ldg(reinterpret_cast<const uint4*>(rows[r]) + c)
                                : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int b = 0; b < BATCH; b++) {
        const int c = lane + 32 * (base + b);
        if (c < CHUNKS) {
          const uint4 xc = x4[c];
#pragma unroll
          for (int r = 0; r < R; r++) acc[r] = piece_dot<T>(wc[b][r], xc, acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) out[r] = warp_sum(acc[r]);
}

// gelu_tanh(g) in float32, written as g * sigmoid(2z) like the MLX path.
__device__ inline float gelu_tanh(float g) {
  const float c = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
  const float z2 = g * (g * g * (c * 0.044715f) + c);
  return g / (1.f + expf(-z2));
}
