
  constexpr int WARPS = 8;
  constexpr int NH = N > H ? N : H;
  constexpr int PZ = P > Z ? P : Z;
  constexpr int STAGED = NH > PZ ? NH : PZ;
  // Token t's staged input at buf + t * STAGED (TOKENS * STAGED elements), then, for 4-bit
  // weights, its chunk sums at sums + t * (STAGED / 32) (sizes set by the host).
  extern __shared__ __align__(16) unsigned char window_shared[];
  T* const buf = reinterpret_cast<T*>(window_shared);
  float* const sums = BITS != 0 ? reinterpret_cast<float*>(buf + TOKENS * STAGED) : nullptr;
  __shared__ float red[32];
  unsigned int* bar = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(barrier));
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * WARPS;
  const int first = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const float s = static_cast<float>(scale[0]);
  // This block's share of a [TOKENS, H] output the grid writes once: the elements i with
  // i / BLOCK_THREADS = blockIdx.x (mod the grid), as the output loops below take them.
  const int share = blockIdx.x * BLOCK_THREADS + threadIdx.x;
  const int share_step = gridDim.x * BLOCK_THREADS;

  // 0. o0 = W_o z, every token.
  for (int t = 0; t < TOKENS; t++) stage_input<T, Z, false>(z + t * Z, z, buf + t * STAGED, red);
  window_chunk_sums<T, Z, BITS, TOKENS, STAGED>(buf, sums);
  window_product_rows<T, Z, BITS, G, TOKENS, STAGED>(wo, wo_s, wo_b, buf, sums, o0, H, first, warps);
  __threadfence();
  grid_barrier(bar);

  // x1 = x + rms_norm(o0, post_attention_norm), whole in every block (and this block's share
  // kept in x1 for the later stages), then x' = rms_norm(x1, pre_norm) staged in place.
  for (int t = 0; t < TOKENS; t++) {
    const float r0 = product_rms<H>(o0 + t * H, red);
    T* xt = buf + t * STAGED;
    for (int i = threadIdx.x; i < H; i += BLOCK_THREADS) {
      const T v = closed<T, false>(__ldcg(o0 + t * H + i), r0, x[t * H + i], post_attention_norm[i], s);
      xt[i] = v;
      if ((i / BLOCK_THREADS) % gridDim.x == blockIdx.x) x1[t * H + i] = v;
    }
  }
  __syncthreads();
  for (int t = 0; t < TOKENS; t++) {
    stage_input<T, H, true>(buf + t * STAGED, pre_norm, buf + t * STAGED, red);
  }
  window_chunk_sums<T, H, BITS, TOKENS, STAGED>(buf, sums);

  // 1. a = gelu_tanh(W_gate x') * (W_up x').
  {
    const void* ws[2] = {wg, wu};
    const T* ss[2] = {wg_s, wu_s};
    const T* bs[2] = {wg_b, wu_b};
    for (int r = first; r < N; r += warps) {
      const int rs[2] = {r, r};
      float d[2 * TOKENS];
      weight_dot_window<T, H, 2, BITS, G, TOKENS, STAGED>(ws, ss, bs, rs, buf, sums, d);
      if (lane == 0) {
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
          const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d[t]))));
          a[t * N + r] = static_cast<T>(static_cast<float>(act) *
                                        static_cast<float>(static_cast<T>(d[TOKENS + t])));
        }
      }
    }
  }
  __threadfence();
  grid_barrier(bar);

  // 2. o = W_down a.
  for (int t = 0; t < TOKENS; t++) stage_written<T, N>(a + t * N, buf + t * STAGED);
  window_chunk_sums<T, N, BITS, TOKENS, STAGED>(buf, sums);
  window_product_rows<T, N, BITS, G, TOKENS, STAGED>(wd, wd_s, wd_b, buf, sums, o, H, first, warps);
  __threadfence();
  grid_barrier(bar);

  // 3. h = x1 + rms_norm(o, post_norm): the output without a per-layer input (times the
  // layer scalar, each block its share), else staged whole in every block.
  if constexpr (P == 0) {
    if (blockIdx.x * BLOCK_THREADS >= H) return;
    for (int t = 0; t < TOKENS; t++) {
      const float r1 = product_rms<H>(o + t * H, red);
      for (int i = share; i < H; i += share_step) {
        out[t * H + i] = closed<T, true>(__ldcg(o + t * H + i), r1, x1[t * H + i], post_norm[i], s);
      }
    }
  } else {
    for (int t = 0; t < TOKENS; t++) {
      const float r1 = product_rms<H>(o + t * H, red);
      T* ht = buf + t * STAGED;
      for (int i = threadIdx.x; i < H; i += BLOCK_THREADS) {
        ht[i] = closed<T, false>(__ldcg(o + t * H + i), r1, __ldcg(x1 + t * H + i), post_norm[i], s);
      }
    }
    __syncthreads();
    window_chunk_sums<T, H, BITS, TOKENS, STAGED>(buf, sums);

    // 4. g = gelu_tanh(W_in h) * v, v token t's P values of this layer.
    const int v0 = ple_offset[0];
    {
      const void* ws[1] = {pg};
      const T* ss[1] = {pg_s};
      const T* bs[1] = {pg_b};
      for (int r = first; r < P; r += warps) {
        float d[TOKENS];
        weight_dot_window<T, H, 1, BITS, G, TOKENS, STAGED>(ws, ss, bs, &r, buf, sums, d);
        if (lane == 0) {
#pragma unroll
          for (int t = 0; t < TOKENS; t++) {
            const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d[t]))));
            g[t * P + r] = static_cast<T>(static_cast<float>(act) *
                                          static_cast<float>(per_layer[t * VSTRIDE + v0 + r]));
          }
        }
      }
    }
    __threadfence();
    grid_barrier(bar);

    // 5. o2 = W_proj g.
    for (int t = 0; t < TOKENS; t++) stage_written<T, P>(g + t * P, buf + t * STAGED);
    window_chunk_sums<T, P, BITS, TOKENS, STAGED>(buf, sums);
    window_product_rows<T, P, BITS, G, TOKENS, STAGED>(pp, pp_s, pp_b, buf, sums, o2, H, first, warps);
    __threadfence();
    grid_barrier(bar);

    // 6. out = (h + rms_norm(o2, post_norm_2)) * layer scalar, h computed again as in 3.
    if (blockIdx.x * BLOCK_THREADS >= H) return;
    for (int t = 0; t < TOKENS; t++) {
      const float r1 = product_rms<H>(o + t * H, red);
      const float r2 = product_rms<H>(o2 + t * H, red);
      for (int i = share; i < H; i += share_step) {
        const T h = closed<T, false>(__ldcg(o + t * H + i), r1, x1[t * H + i], post_norm[i], s);
        out[t * H + i] = closed<T, true>(__ldcg(o2 + t * H + i), r2, h, post_norm_2[i], s);
      }
    }
  }
