
  constexpr int WARPS = 8;
  // Token t's normed input at xs + t * K (TOKENS * K elements), then, for 4-bit rows, each
  // token's chunk sums and (INT_DOTS) integer scales at t * (K / 32) (sizes set by the host).
  extern __shared__ __align__(16) unsigned char heads_shared[];
  T* const xs = reinterpret_cast<T*>(heads_shared);
  float* const sums = reinterpret_cast<float*>(xs + TOKENS * K);
  float* const xscale = sums + TOKENS * (K / 32);
  __shared__ float red[32];
  __shared__ bool is_last;
  constexpr int NQ = NH * D;
  constexpr int NK = NKV * D;
  constexpr int NV = K_EQ_V ? 0 : NK;
  constexpr int ROWS = NQ + NK + NV;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // A block makes RPW rounds of eight rows, all in one head when PER_HEAD (as in the
  // single-token kernel: see attention_heads::rows_per_warp).
  constexpr int BLOCK_ROWS = WARPS * RPW;
  const int first_row = blockIdx.x * BLOCK_ROWS;
  for (int t = 0; t < TOKENS; t++) stage_input<T, K, true>(x + t * K, nw, xs + t * K, red);
  window_chunk_sums<T, K, BITS, TOKENS, K>(xs, sums);
  if constexpr (INT_DOTS) {
    for (int t = 0; t < TOKENS; t++) chunk_integers<T, K>(xs + t * K, xscale + t * (K / 32));
  }
  for (int round = 0; round < RPW; round++) {
    const int row = first_row + round * WARPS + warp;
    if (row >= ROWS) break;
    // Row `row` of the q, k and v rows stacked: its weight and its index there.
    const int i = row < NQ ? row : row < NQ + NK ? row - NQ : row - NQ - NK;
    const void* w = row < NQ ? (const void*)wq : row < NQ + NK ? (const void*)wk : (const void*)wv;
    const T* s = row < NQ ? wq_s : row < NQ + NK ? wk_s : wv_s;
    const T* b = row < NQ ? wq_b : row < NQ + NK ? wk_b : wv_b;
    float d[TOKENS];
    weight_dot_window<T, K, 1, BITS, G, TOKENS, K, INT_DOTS>(&w, &s, &b, &i, xs, sums, d, xscale);
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < TOKENS; t++) raw[t * ROWS + row] = static_cast<T>(d[t]);
    }
  }

  // The last block to finish takes every head of every token; PER_HEAD: the last of a head's
  // blocks takes that head of every token (and on a K = V layer the value head made of it).
  unsigned int* done = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(counter));
  const int group = PER_HEAD ? first_row / D : 0;
  const unsigned int arrivals = PER_HEAD ? D / BLOCK_ROWS : gridDim.x;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(done + group, 1u) == arrivals - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  constexpr int HEADS = NH + 2 * NKV;
  const int heads_here = !PER_HEAD ? HEADS : (K_EQ_V && group >= NH) ? 2 : 1;
  const int first_position = position[0];
  const int first_slot = cache_slot[0];
  const int capacity = cache_slot[1];
  for (int i = warp; i < TOKENS * heads_here; i += WARPS) {
    const int t = i / heads_here;
    const int h = !PER_HEAD ? i % heads_here : i % heads_here == 0 ? group : group + NKV;
    const float pos = static_cast<float>(first_position + t);
    const int slot = first_slot + t;
    const T* token_raw = raw + (size_t)t * ROWS;
    // Kind of head: 0 query, 1 key, 2 value (K = V: the value is the raw key, normed
    // without weight).
    const int kind = h < NH ? 0 : h < NH + NKV ? 1 : 2;
    const T* src = kind == 0 ? token_raw + (size_t)h * D
        : kind == 1 ? token_raw + NQ + (size_t)(h - NH) * D
        : token_raw + NQ + (K_EQ_V ? 0 : NK) + (size_t)(h - NH - NKV) * D;
    T* dst = kind == 0 ? q + ((size_t)t * NH + h) * D
        : kind == 1 ? const_cast<T*>(k_cache) + ((size_t)(h - NH) * capacity + slot) * D
        : const_cast<T*>(v_cache) + ((size_t)(h - NH - NKV) * capacity + slot) * D;
    finish_head<T, D>(src, kind == 0 ? q_w : k_w, periods, pos, kind, dst);
  }
  // Ready for this call site's next call.
  if (threadIdx.x == 0) done[group] = 0u;
