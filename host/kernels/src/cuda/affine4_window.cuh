
// Each token's chunk sums of its staged input (token t at xs + t * STRIDE, its sums at
// sums + t * (STRIDE / 32)) for 4-bit rows, as chunk_sums makes one token's; nothing for dense
// rows (BITS 0).
template <typename T, int K, int BITS, int TOKENS, int STRIDE>
__device__ inline void window_chunk_sums(const T* xs, float* sums) {
  if constexpr (BITS != 0) {
    for (int t = 0; t < TOKENS; t++) chunk_sums<T, K, BITS>(xs + t * STRIDE, sums + t * (STRIDE / 32));
  }
}

// Rows r[0], r[1], ... (R of them) of weights w[0..R) with each of the window's TOKENS staged
// inputs (token t at xs + t * STRIDE), summed over the warp: out[i * TOKENS + t]. Dense rows
// (BITS 0) through rows_dot_window; 4-bit ones through the *_tokens helpers, with each token's
// chunk sums (and, INT, integers and scales) at t * (STRIDE / 32). Each (row, token) sum is
// weight_dot's for that token alone.
template <typename T, int K, int R, int BITS, int G, int TOKENS, int STRIDE, bool INT = false>
__device__ inline void weight_dot_window(const void* const* w, const T* const* s,
                                         const T* const* b, const int* r, const T* xs,
                                         const float* sums, float* out,
                                         const float* xscale = nullptr) {
  if constexpr (BITS == 0) {
    const T* rows[R];
#pragma unroll
    for (int i = 0; i < R; i++) rows[i] = static_cast<const T*>(w[i]) + (size_t)r[i] * K;
    rows_dot_window<T, K, R, TOKENS, STRIDE>(rows, xs, out);
  } else {
    const void* rows[R];
    const T* sr[R];
    const T* br[R];
    affine4_rows<T, K, R, BITS, G>(w, s, b, r, rows, sr, br);
    if constexpr (INT) {
      rows_dot_affine4_int_tokens<T, K, R, G, TOKENS, STRIDE>(rows, sr, br, xs, xscale, sums, out);
    } else {
      rows_dot_affine4_tokens<T, K, R, G, TOKENS, STRIDE, false>(rows, sr, br, xs, sums, out);
    }
  }
}
