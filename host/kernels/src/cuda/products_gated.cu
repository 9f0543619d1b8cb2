
  constexpr int WARPS = 8;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  // The input's chunk sums, for 4-bit rows (BITS 4; see chunk_sums).
  __shared__ float sums[BITS != 0 ? K / 32 : 1];
  // INT_DOTS: the input's scales for integer dots over 4-bit rows (see chunk_integers).
  __shared__ float xscale[INT_DOTS ? K / 32 : 1];
  // A warp computes RPW consecutive rows (past the end: the last row again, not written).
  const int first = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * RPW;
  if constexpr (TOUCH) {
    if (BY_VECTOR) {
      const decltype(wg) ws[1] = {wg};
      const T* const ss[1] = {wg_s};
      const T* const bs[1] = {wg_b};
      touch_rows<T, K, RPW, BITS, G, 1, LOADS>(ws, ss, bs, first, N);
    } else {
      const decltype(wg) ws[2] = {wg, wu};
      const T* const ss[2] = {wg_s, wu_s};
      const T* const bs[2] = {wg_b, wu_b};
      touch_rows<T, K, RPW, BITS, G, 2, LOADS>(ws, ss, bs, first, N);
    }
  }
  stage_input<T, K, NORM>(x, nw, xs, red);
  chunk_sums<T, K, BITS>(xs, sums);
  if constexpr (INT_DOTS) chunk_integers<T, K>(xs, xscale);
  if (first >= N) return;
  float g[RPW];
  T u[RPW];
  if (BY_VECTOR) {
    const decltype(wg) ws[1] = {wg};
    const T* const ss[1] = {wg_s};
    const T* const bs[1] = {wg_b};
    weight_rows<T, K, RPW, BITS, G, 1, LOADS, INT_DOTS>(ws, ss, bs, first, N, xs, sums, g, xscale);
#pragma unroll
    for (int i = 0; i < RPW; i++) u[i] = mul[mul_offset[0] + min(first + i, N - 1)];
  } else {
    float d[2 * RPW];
    const decltype(wg) ws[2] = {wg, wu};
    const T* const ss[2] = {wg_s, wu_s};
    const T* const bs[2] = {wg_b, wu_b};
    weight_rows<T, K, RPW, BITS, G, 2, LOADS, INT_DOTS>(ws, ss, bs, first, N, xs, sums, d, xscale);
#pragma unroll
    for (int i = 0; i < RPW; i++) {
      g[i] = d[i];
      u[i] = static_cast<T>(d[RPW + i]);
    }
  }
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int i = 0; i < RPW; i++) {
      if (first + i < N) {
        const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(g[i]))));
        y[first + i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  }
