
  constexpr int WARPS = 8;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  // The input's chunk sums, for 4-bit rows (BITS 4; see chunk_sums).
  __shared__ float sums[BITS != 0 ? K / 32 : 1];
  // INT_DOTS: the input's scales for integer dots over 4-bit rows (see chunk_integers).
  __shared__ float xscale[INT_DOTS ? K / 32 : 1];
  __shared__ bool is_last;
  constexpr int NQ = NH * D;
  constexpr int NK = NKV * D;
  constexpr int NV = K_EQ_V ? 0 : NK;
  constexpr size_t ROW_BYTES = row_bytes<T, K, BITS>();
  constexpr int GROUPS = BITS != 0 ? K / G : 1;
  // Row r of the q, k and v rows stacked: where its values start, and (4-bit) its first
  // scale and bias.
  auto row_of = [&](int r, const T*& scale, const T*& bias) -> const void* {
    const int i = r < NQ ? r : r < NQ + NK ? r - NQ : r - NQ - NK;
    const void* w = r < NQ ? (const void*)wq : r < NQ + NK ? (const void*)wk : (const void*)wv;
    scale = (r < NQ ? wq_s : r < NQ + NK ? wk_s : wv_s) + (size_t)i * GROUPS;
    bias = (r < NQ ? wq_b : r < NQ + NK ? wk_b : wv_b) + (size_t)i * GROUPS;
    return static_cast<const char*>(w) + (size_t)i * ROW_BYTES;
  };
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // A block makes RPW rounds of eight rows (a row a warp each round), all in one head when
  // PER_HEAD: RPW > 1 keeps the grid to one wave of resident blocks (see rows_per_warp).
  constexpr int BLOCK_ROWS = WARPS * RPW;
  const int first_row = blockIdx.x * BLOCK_ROWS;
#if STEP_INTS_FROM_HEADS
  // The step's integers (position, cache slot, the visible slots) live in host-visible
  // memory, a bus crossing away. The first block of each group the finishing block waits for
  // requests them now, one thread, and publishes them in `step_copy` (device memory) with its
  // rows, so that the finishing block, and decode attention after it, read them there instead
  // of crossing the bus on their critical path. Layout: the visible range at 0 and 1, then
  // position, slot and capacity at 4 + 4 g for group g.
  const bool first_of_group = PER_HEAD ? first_row % D == 0 : blockIdx.x == 0;
  int early[5] = {0, 0, 0, 0, 0};
  if (first_of_group && threadIdx.x == 0) {
    early[0] = position[0];
    early[1] = cache_slot[0];
    early[2] = cache_slot[1];
    if (blockIdx.x == 0) {
      early[3] = visible[0];
      early[4] = visible[1];
    }
  }
#endif
  if constexpr (TOUCH) {
    for (int i = 0; i < RPW; i++) {
      const int row = first_row + i * WARPS + warp;
      if (row < NQ + NK + NV) {
        const T* s;
        const T* b;
        const void* wrow = row_of(row, s, b);
        touch_row<T, K, BITS, G, 8>(wrow, s, b);
      }
    }
  }
  stage_input<T, K, true>(x, nw, xs, red);
  chunk_sums<T, K, BITS>(xs, sums);
  if constexpr (INT_DOTS) chunk_integers<T, K>(xs, xscale);
  for (int i = 0; i < RPW; i++) {
    const int row = first_row + i * WARPS + warp;
    if (row >= NQ + NK + NV) break;
    const T* s;
    const T* b;
    const void* wrow = row_of(row, s, b);
    float d;
    if constexpr (BITS == 0) {
      const T* dense = static_cast<const T*>(wrow);
      rows_dot<T, K, 1>(&dense, xs, &d);
    } else if constexpr (INT_DOTS) {
      rows_dot_affine4_int<T, K, 1, G>(&wrow, &s, &b, xs, xscale, sums, &d);
    } else {
      rows_dot_affine4<T, K, 1, G, false>(&wrow, &s, &b, xs, sums, &d);
    }
    if (lane == 0) raw[row] = static_cast<T>(d);
  }

  // Publish this block's rows, then count it. PER_HEAD: a block's rows lie in one head
  // (D is a multiple of BLOCK_ROWS), counted per head; the last of a head's blocks takes that head (and
  // on a K = V layer the value head made of it), so the heads are finished in parallel, each as
  // soon as its rows are done. Otherwise the last block of all sees all rows and takes every
  // head.
  unsigned int* done = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(counter));
  const int group = PER_HEAD ? first_row / D : 0;
  const unsigned int arrivals = PER_HEAD ? D / BLOCK_ROWS : gridDim.x;
#if STEP_INTS_FROM_HEADS
  if (first_of_group && threadIdx.x == 0) {
    step_copy[4 + 4 * group] = early[0];
    step_copy[5 + 4 * group] = early[1];
    step_copy[6 + 4 * group] = early[2];
    if (blockIdx.x == 0) {
      step_copy[0] = early[3];
      step_copy[1] = early[4];
    }
  }
#endif
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(done + group, 1u) == arrivals - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();

#if STEP_INTS_FROM_HEADS
  const float pos = static_cast<float>(__ldcg(step_copy + 4 + 4 * group));
  const int slot = __ldcg(step_copy + 5 + 4 * group);
  const int capacity = __ldcg(step_copy + 6 + 4 * group);
#else
  const float pos = static_cast<float>(position[0]);
  const int slot = cache_slot[0];
  const int capacity = cache_slot[1];
#endif
  // Heads this block takes: all of them, or its own (then a key head's value head too, K = V).
  const int heads_here = !PER_HEAD ? NH + 2 * NKV : (K_EQ_V && group >= NH) ? 2 : 1;
  for (int i = warp; i < heads_here; i += WARPS) {
    const int h = !PER_HEAD ? i : i == 0 ? group : group + NKV;
    // Kind of head: 0 query, 1 key, 2 value (K = V: the value is the raw key, normed
    // without weight).
    const int kind = h < NH ? 0 : h < NH + NKV ? 1 : 2;
    const T* src = kind == 0 ? raw + (size_t)h * D
        : kind == 1 ? raw + NQ + (size_t)(h - NH) * D
        : raw + NQ + (K_EQ_V ? 0 : NK) + (size_t)(h - NH - NKV) * D;
    T* dst = kind == 0 ? q + (size_t)h * D
        : kind == 1 ? const_cast<T*>(k_cache) + ((size_t)(h - NH) * capacity + slot) * D
        : const_cast<T*>(v_cache) + ((size_t)(h - NH - NKV) * capacity + slot) * D;
    finish_head<T, D>(src, kind == 0 ? q_w : k_w, periods, pos, kind, dst);
  }
  // Ready for this call site's next step.
  if (threadIdx.x == 0) done[group] = 0u;
