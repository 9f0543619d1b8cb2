
  // product_residual for a window of TOKENS tokens over dense rows: each token's row equals
  // what products_residual.cu computes for that token alone (the same per-lane order of every
  // dot through rows_dot_window, the same norm by the same threads, the same roundings).
  constexpr int WARPS = 8;
  // Token t's staged input at xs + t * K (TOKENS * K elements, sized by the host).
  extern __shared__ __align__(16) unsigned char window_shared[];
  T* const xs = reinterpret_cast<T*>(window_shared);
  __shared__ float red[32];
  __shared__ bool is_last;
  unsigned int* done = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(counter));
  const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
  for (int t = 0; t < TOKENS; t++) stage_input<T, K, false>(a + t * K, a, xs + t * K, red);
  if (row < N) {
    const T* rows[1] = {w + static_cast<size_t>(row) * K};
    float d[TOKENS];
    rows_dot_window<T, K, 1, TOKENS, K>(rows, xs, d);
    // Each product as MLX rounds it, kept in float32 for the last block.
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int t = 0; t < TOKENS; t++) o[t * N + row] = static_cast<float>(static_cast<T>(d[t]));
    }
  }
  // Publish this block's rows, then count it; the last block to arrive sees all rows.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  constexpr int PER = (N + BLOCK_THREADS - 1) / BLOCK_THREADS;
  const float s = SCALED ? static_cast<float>(scale[0]) : 1.f;
#pragma unroll 1
  for (int t = 0; t < TOKENS; t++) {
    const float* ot = o + t * N;
    const T* ht = h + t * N;
    float v[PER];
    T pv[PER], hv[PER];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const int i = threadIdx.x + j * BLOCK_THREADS;
      v[j] = i < N ? __ldcg(ot + i) : 0.f;
      pv[j] = i < N ? pw[i] : static_cast<T>(0.f);
      hv[j] = i < N ? ht[i] : static_cast<T>(0.f);
    }
#pragma unroll
    for (int j = 0; j < PER; j++) ss += v[j] * v[j];
    const float r = rsqrtf(block_sum(ss, red) / N + EPS);
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const int i = threadIdx.x + j * BLOCK_THREADS;
      if (i < N) {
        const T n = static_cast<T>(v[j] * r);
        const T weighted = static_cast<T>(static_cast<float>(pv[j]) * static_cast<float>(n));
        T sum = static_cast<T>(static_cast<float>(hv[j]) + static_cast<float>(weighted));
        if (SCALED) sum = static_cast<T>(static_cast<float>(sum) * s);
        out[t * N + i] = sum;
      }
    }
  }
  // Ready for this call site's next step.
  if (threadIdx.x == 0) *done = 0u;
