
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
