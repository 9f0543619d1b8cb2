
  // gated_product for a window of TOKENS tokens over dense rows: each token's row equals what
  // products_gated.cu computes for that token alone (the same staging, the same per-lane
  // order of every dot through rows_dot_window, the same roundings).
  constexpr int WARPS = 8;
  // Token t's staged input at xs + t * K (TOKENS * K elements, sized by the host).
  extern __shared__ __align__(16) unsigned char window_shared[];
  T* const xs = reinterpret_cast<T*>(window_shared);
  __shared__ float red[32];
  const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
  for (int t = 0; t < TOKENS; t++) stage_input<T, K, NORM>(x + t * K, nw, xs + t * K, red);
  if (row >= N) return;
  const T* rows[2] = {wg + static_cast<size_t>(row) * K, wu + static_cast<size_t>(row) * K};
  float d[2 * TOKENS];
  rows_dot_window<T, K, 2, TOKENS, K>(rows, xs, d);
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int t = 0; t < TOKENS; t++) {
      const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d[t]))));
      y[t * N + row] = static_cast<T>(static_cast<float>(act) *
                                      static_cast<float>(static_cast<T>(d[TOKENS + t])));
    }
  }
