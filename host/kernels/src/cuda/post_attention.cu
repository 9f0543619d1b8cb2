
  constexpr int WARPS = 8;
  constexpr int NH = N > H ? N : H;
  constexpr int PZ = P > Z ? P : Z;
  constexpr int STAGED = NH > PZ ? NH : PZ;
  __shared__ __align__(16) T buf[STAGED];
  __shared__ __align__(16) T x1s[H];
  __shared__ __align__(16) T hs[P > 0 ? H : 8];
  __shared__ float red[32];
  // EARLY: each warp's pair of per-layer projection rows (copy_early_rows).
  __shared__ __align__(16) T early_proj[EARLY && BITS == 0 && P > 0 ? 2 * WARPS * P : 8];
  // Chunk sums of the staged input for 4-bit weights (chunk_sums).
  __shared__ float sums[BITS != 0 ? STAGED / 32 : 1];
  unsigned int* bar = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(barrier));
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * WARPS;
  const int first = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const float s = static_cast<float>(scale[0]);

  // 0. x1 = x + rms_norm(W_o z, post_attention_norm), kept whole by every block.
  stage_input<T, Z, false>(z, z, buf, red);
  chunk_sums<T, Z, BITS>(buf, sums);
  product_rows<T, Z, BITS, G, IN_PLACE, PAIRS>(wo, wo_s, wo_b, buf, sums, o0, H, first, warps);
  __threadfence();
  grid_barrier(bar);
  const float r0 = product_rms<H>(o0, red);
  for (int i = threadIdx.x; i < H; i += BLOCK_THREADS) {
    x1s[i] = closed<T, false>(__ldcg(o0 + i), r0, x[i], post_attention_norm[i], s);
  }
  __syncthreads();

  // 1. a = gelu_tanh(W_gate x') * (W_up x'), x' = rms_norm(x1, pre_norm).
  stage_input<T, H, true>(x1s, pre_norm, buf, red);
  chunk_sums<T, H, BITS>(buf, sums);
  for (int r = first; r < N; r += warps) {
    const void* ws[2] = {wg, wu};
    const T* ss[2] = {wg_s, wu_s};
    const T* bs[2] = {wg_b, wu_b};
    const int rs[2] = {r, r};
    float d[2];
    weight_dot<T, H, 2, BITS, G, IN_PLACE>(ws, ss, bs, rs, buf, sums, d);
    if (lane == 0) {
      const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d[0]))));
      a[r] = static_cast<T>(static_cast<float>(act) * static_cast<float>(static_cast<T>(d[1])));
    }
  }
  __threadfence();
  grid_barrier(bar);

  // 2. o = W_down a.
  stage_written<T, N>(a, buf);
  chunk_sums<T, N, BITS>(buf, sums);
  product_rows<T, N, BITS, G, IN_PLACE, PAIRS>(wd, wd_s, wd_b, buf, sums, o, H, first, warps);
  __threadfence();
  // EARLY: the per-layer-input rows, copied while the grid meets (see copy_early_rows).
  bool early = false;
  if constexpr (EARLY && BITS == 0 && P > 0) {
    early = early_rows_fit<T, H, P, STAGED>();
    if (early) {
      // Every warp of the block is done reading `buf`, which takes the gate rows.
      __syncthreads();
      copy_early_rows<T, H, P>(buf, early_proj, reinterpret_cast<const T*>(pg),
                               reinterpret_cast<const T*>(pp));
    }
  }
  grid_barrier(bar);

  // 3. h = x1 + rms_norm(o, post_norm): the output without a per-layer input (times the
  // layer scalar; the blocks write it in turns), else every block keeps all of h.
  const float r1 = product_rms<H>(o, red);
  if constexpr (P == 0) {
    for (int i = blockIdx.x * BLOCK_THREADS + threadIdx.x; i < H; i += gridDim.x * BLOCK_THREADS) {
      out[i] = closed<T, true>(__ldcg(o + i), r1, x1s[i], post_norm[i], s);
    }
  } else {
    for (int i = threadIdx.x; i < H; i += BLOCK_THREADS) {
      hs[i] = closed<T, false>(__ldcg(o + i), r1, x1s[i], post_norm[i], s);
    }
    __syncthreads();
    chunk_sums<T, H, BITS>(hs, sums);

    // 4.-6. g = gelu_tanh(W_in h) * v, o2 = W_proj g, out = (h + rms_norm(o2, post_norm_2))
    // times the layer scalar.
    per_layer_block<T, H, P, BITS, G, IN_PLACE, PAIRS>(
        hs, buf, sums, red, pg, pg_s, pg_b, per_layer, ple_offset[0], pp, pp_s, pp_b,
        post_norm_2, s, bar, g, o2, out, early, buf, early_proj);
  }
