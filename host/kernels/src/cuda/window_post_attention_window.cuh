
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
