
  constexpr int WARPS = 8;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  __shared__ bool is_last;
  unsigned int* done = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(counter));
  // The input's chunk sums, for 4-bit rows (BITS 4; see chunk_sums).
  __shared__ float sums[BITS != 0 ? K / 32 : 1];
  // INT_DOTS: the input's scales for integer dots over 4-bit rows (see chunk_integers).
  __shared__ float xscale[INT_DOTS ? K / 32 : 1];
  // A warp computes RPW consecutive rows (past the end: the last row again, not written).
  const int first = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * RPW;
  if constexpr (TOUCH) {
    const decltype(w) ws[1] = {w};
    const T* const ss[1] = {w_s};
    const T* const bs[1] = {w_b};
    touch_rows<T, K, RPW, BITS, G, 1, LOADS>(ws, ss, bs, first, N);
  }
  stage_input<T, K, false>(a, a, xs, red);
  chunk_sums<T, K, BITS>(xs, sums);
  if constexpr (INT_DOTS) chunk_integers<T, K>(xs, xscale);
  if (first < N) {
    float d[RPW];
    const decltype(w) ws[1] = {w};
    const T* const ss[1] = {w_s};
    const T* const bs[1] = {w_b};
    weight_rows<T, K, RPW, BITS, G, 1, LOADS, INT_DOTS>(ws, ss, bs, first, N, xs, sums, d, xscale);
    // The product as MLX rounds it, kept in float32 for the last block.
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int i = 0; i < RPW; i++) {
        if (first + i < N) o[first + i] = static_cast<float>(static_cast<T>(d[i]));
      }
    }
  }
  // Publish this block's rows, then count it; the last block to arrive sees all rows.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Every load of the product, the norm weight and the residual is issued before any is
  // used: the last block waits for one memory round trip per pass, not one per element.
  constexpr int PER = (N + BLOCK_THREADS - 1) / BLOCK_THREADS;
  float v[PER];
  T pv[PER], hv[PER];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int i = threadIdx.x + j * BLOCK_THREADS;
    v[j] = i < N ? __ldcg(o + i) : 0.f;
    pv[j] = i < N ? pw[i] : static_cast<T>(0.f);
    hv[j] = i < N ? h[i] : static_cast<T>(0.f);
  }
#pragma unroll
  for (int j = 0; j < PER; j++) ss += v[j] * v[j];
  const float r = rsqrtf(block_sum(ss, red) / N + EPS);
  const float s = SCALED ? static_cast<float>(scale[0]) : 1.f;
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int i = threadIdx.x + j * BLOCK_THREADS;
    if (i < N) {
      const T n = static_cast<T>(v[j] * r);
      const T weighted = static_cast<T>(static_cast<float>(pv[j]) * static_cast<float>(n));
      T sum = static_cast<T>(static_cast<float>(hv[j]) + static_cast<float>(weighted));
      if (SCALED) sum = static_cast<T>(static_cast<float>(sum) * s);
      out[i] = sum;
    }
  }
  // Ready for this call site's next step.
  if (threadIdx.x == 0) *done = 0u;
