
  constexpr int WARPS = 8;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  // The input's chunk sums, for 4-bit rows (BITS 4; see chunk_sums).
  __shared__ float sums[BITS != 0 ? K / 32 : 1];
  // INT_DOTS: the input's scales for integer dots over 4-bit rows (see chunk_integers).
  __shared__ float xscale[INT_DOTS ? K / 32 : 1];
  stage_input<T, K, true>(x, nw, xs, red);
  chunk_sums<T, K, BITS>(xs, sums);
  if constexpr (INT_DOTS) chunk_integers<T, K>(xs, xscale);
  const decltype(w) ws[1] = {w};
  const T* const ss[1] = {w_s};
  const T* const bs[1] = {w_b};
  // The soft-cap, its float32 bits passed as an integer (0: none).
  const float cap = __int_as_float(CAP_BITS);
  const int stride = gridDim.x * WARPS * RPW;
  for (int first = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * RPW; first < N; first += stride) {
    float d[RPW];
    weight_rows<T, K, RPW, BITS, G, 1, 8, INT_DOTS>(ws, ss, bs, first, N, xs, sums, d, xscale);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int i = 0; i < RPW; i++) {
        if (first + i < N) {
          float l = static_cast<float>(static_cast<T>(d[i]));
          if (CAP_BITS != 0) l = tanhf(l / cap) * cap;
          logits[first + i] = l;
        }
      }
    }
  }
