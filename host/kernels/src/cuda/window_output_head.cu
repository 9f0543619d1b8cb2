
  constexpr int WARPS = 8;
  // Token t's normed input at xs + t * K (TOKENS * K elements), then, for a 4-bit head, each
  // token's chunk sums and (INT_DOTS) integer scales at t * (K / 32) (sizes set by the host).
  extern __shared__ __align__(16) unsigned char head_shared[];
  T* const xs = reinterpret_cast<T*>(head_shared);
  float* const sums = reinterpret_cast<float*>(xs + TOKENS * K);
  float* const xscale = sums + TOKENS * (K / 32);
  __shared__ float red[32];
  for (int t = 0; t < TOKENS; t++) stage_input<T, K, true>(x + t * K, nw, xs + t * K, red);
  window_chunk_sums<T, K, BITS, TOKENS, K>(xs, sums);
  if constexpr (INT_DOTS) {
    for (int t = 0; t < TOKENS; t++) chunk_integers<T, K>(xs + t * K, xscale + t * (K / 32));
  }
  const void* const ws[2] = {w, w};
  const T* const ss[2] = {w_s, w_s};
  const T* const bs[2] = {w_b, w_b};
  // The soft-cap, its float32 bits passed as an integer (0: none).
  const float cap = __int_as_float(CAP_BITS);
  const int stride = gridDim.x * WARPS * 2;
  for (int first = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * 2; first < N; first += stride) {
    // Two rows a warp (the last row again past N).
    const int rows[2] = {first, min(first + 1, N - 1)};
    float d[2 * TOKENS];
    weight_dot_window<T, K, 2, BITS, G, TOKENS, K, INT_DOTS>(ws, ss, bs, rows, xs, sums, d, xscale);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int i = 0; i < 2; i++) {
        if (first + i < N) {
#pragma unroll
          for (int t = 0; t < TOKENS; t++) {
            float l = static_cast<float>(static_cast<T>(d[i * TOKENS + t]));
            if (CAP_BITS != 0) l = tanhf(l / cap) * cap;
            logits[(size_t)t * N + first + i] = l;
          }
        }
      }
    }
  }
