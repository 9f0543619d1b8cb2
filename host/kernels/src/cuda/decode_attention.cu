
  // A lane loads 16 bytes (VEC elements) at a time; a row of D elements is CH such chunks
  // per lane. A warp takes UNROLL slots at a time, so their loads overlap the reductions.
  // WIDE: a warp takes as many slots at once as its share of the block's slots (at most 16
  // 16-byte pieces of a row a lane, for keys and for values alike), so that a share of up to
  // 128 slots of a head of 256 is one round: one trip to memory instead of one per 32 slots
  // for keys and again for values.
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CH = D / (32 * VEC);
  // FIXED_CHUNK (`set_aligned_shares`): shares of that many slots at multiples of it, so that
  // a query's grouping of its slots does not change when its buffer grows.
  constexpr int CHUNK = FIXED_CHUNK > 0 ? FIXED_CHUNK : (SLOTS + SPLITS - 1) / SPLITS;
  constexpr int NARROW_UNROLL = CH > 2 ? 2 : 4;
  constexpr int WIDEST_UNROLL = 16 / CH > NARROW_UNROLL ? 16 / CH : NARROW_UNROLL;
  constexpr int WARP_SHARE = (CHUNK + WARPS - 1) / WARPS;
  constexpr int UNROLL = !WIDE || WARP_SHARE <= NARROW_UNROLL ? NARROW_UNROLL
                         : WARP_SHARE < WIDEST_UNROLL       ? WARP_SHARE
                                                             : WIDEST_UNROLL;
  // A block whose share is one round of its warps loads keys and values together (one trip
  // to memory), and before it knows which slots are visible: the visible range lives in
  // host-visible memory, a bus crossing slower than a trip to device memory.
  constexpr bool ONE_ROUND = CHUNK <= WARPS * UNROLL;
  __shared__ float scores[MAX_CHUNK];
  __shared__ float sums[WARPS * D];
  __shared__ float red[32];
  __shared__ int seen[2];
  // A window of queries (`window_attention`): query `token` of the window, each with its own
  // visible slots, counters, shares and output row; one query is token 0.
  const int token = blockIdx.y;
  const int heads = gridDim.x / SPLITS;
  const int head = blockIdx.x / SPLITS;
  const int split = blockIdx.x % SPLITS;
  const int kv_head = head / GROUP;
  const int lo = split * CHUNK;
  const int hi = min(SLOTS, lo + CHUNK);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const T* kb = k + (size_t)kv_head * SLOTS * D;
  const T* vb = v + (size_t)kv_head * SLOTS * D;

  // The slots this query sees, [first, last + 1): requested first, used last.
  int first_seen = 0, end_seen = 0;
  if (threadIdx.x == 0) {
    if constexpr (SLIDE == 0) {
      first_seen = visible[0];
      end_seen = visible[1];
    } else {
      // A window's query `token`: `visible` holds the first kept slot and the end of query
      // 0's slots; each later query sees one slot more, from SLIDE slots before its end.
      end_seen = visible[1] + token;
      first_seen = max(end_seen - SLIDE, visible[0]);
    }
  }

  // This lane's elements of q: chunk j covers elements (lane + 32 j) * VEC ... + VEC - 1.
  float qr[CH * VEC];
  {
    const uint4* q4 = reinterpret_cast<const uint4*>(q + ((size_t)token * heads + head) * D);
#pragma unroll
    for (int j = 0; j < CH; j++) {
      uint4 c = q4[lane + 32 * j];
      const T* e = reinterpret_cast<const T*>(&c);
#pragma unroll
      for (int x = 0; x < VEC; x++) qr[j * VEC + x] = static_cast<float>(e[x]);
    }
  }

  // One round: this warp's slots' key and value rows, in flight together (rows past the
  // share are not read; rows the mask hides are read and then ignored, never multiplied).
  uint4 vrows[UNROLL][CH];
  uint4 krows[UNROLL][CH];
  const int round_base = lo + warp * UNROLL;
  if constexpr (ONE_ROUND) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int s = round_base + u;
      const uint4* k4 = reinterpret_cast<const uint4*>(kb + (size_t)s * D);
      const uint4* v4 = reinterpret_cast<const uint4*>(vb + (size_t)s * D);
#pragma unroll
      for (int j = 0; j < CH; j++) {
        krows[u][j] = s < hi ? k4[lane + 32 * j] : make_uint4(0, 0, 0, 0);
        vrows[u][j] = s < hi ? v4[lane + 32 * j] : make_uint4(0, 0, 0, 0);
      }
    }
  }
  if (threadIdx.x == 0) {
    seen[0] = first_seen;
    seen[1] = end_seen;
  }
  __syncthreads();
  const int seen_lo = seen[0];
  const int seen_hi = seen[1];

  // Scores of a warp's UNROLL slots `base`... from their key rows, written by lane 0; a hidden
  // slot scores -inf. Rounded as MLX rounds the product (adding the mask's 0 changes nothing).
  auto score = [&](const uint4 (*rows)[CH], int base) {
    float dot[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      dot[u] = 0.f;
#pragma unroll
      for (int j = 0; j < CH; j++) {
        const T* e = reinterpret_cast<const T*>(&rows[u][j]);
#pragma unroll
        for (int x = 0; x < VEC; x++) dot[u] += qr[j * VEC + x] * static_cast<float>(e[x]);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < UNROLL; u++) dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int s = base + u;
        if (s < hi) {
          const bool shown = s >= seen_lo && s < seen_hi;
          scores[s - lo] = shown ? static_cast<float>(static_cast<T>(dot[u])) : -INFINITY;
        }
      }
    }
  };

  if constexpr (ONE_ROUND) {
    score(krows, round_base);
  } else {
    // Several rounds (long caches): each loads only the rows the mask shows.
    for (int base = round_base; base < hi; base += WARPS * UNROLL) {
      uint4 rows[UNROLL][CH];
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int s = base + u;
        const bool shown = s < hi && s >= seen_lo && s < seen_hi;
        const uint4* r4 = reinterpret_cast<const uint4*>(kb + (size_t)s * D);
#pragma unroll
        for (int j = 0; j < CH; j++) rows[u][j] = shown ? r4[lane + 32 * j] : make_uint4(0, 0, 0, 0);
      }
      score(rows, base);
    }
  }
  __syncthreads();

  float mx = -INFINITY;
  for (int s = lo + threadIdx.x; s < hi; s += blockDim.x) mx = fmaxf(mx, scores[s - lo]);
  mx = block_max(mx, red);
  float total = 0.f;
  for (int s = lo + threadIdx.x; s < hi; s += blockDim.x) {
    const float e = scores[s - lo] == -INFINITY ? 0.f : __expf(scores[s - lo] - mx);
    scores[s - lo] = e;
    total += e;
  }
  total = block_sum(total, red);

  // Weighted values; a slot of weight 0 (hidden, or past the share) adds nothing, whatever
  // its row holds.
  float acc[CH * VEC];
#pragma unroll
  for (int i = 0; i < CH * VEC; i++) acc[i] = 0.f;
  auto weigh = [&](const uint4* row, float p) {
#pragma unroll
    for (int j = 0; j < CH; j++) {
      const T* e = reinterpret_cast<const T*>(&row[j]);
#pragma unroll
      for (int x = 0; x < VEC; x++) acc[j * VEC + x] += p * static_cast<float>(e[x]);
    }
  };
  if constexpr (ONE_ROUND) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int s = round_base + u;
      const float p = s < hi ? scores[s - lo] : 0.f;
      if (p != 0.f) weigh(vrows[u], p);
    }
  } else {
    for (int base = round_base; base < hi; base += WARPS * UNROLL) {
      uint4 rows[UNROLL][CH];
      float p[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int s = base + u;
        p[u] = s < hi ? scores[s - lo] : 0.f;
        const uint4* r4 = reinterpret_cast<const uint4*>(vb + (size_t)s * D);
#pragma unroll
        for (int j = 0; j < CH; j++) rows[u][j] = p[u] != 0.f ? r4[lane + 32 * j] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        if (p[u] != 0.f) weigh(rows[u], p[u]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < CH; j++) {
#pragma unroll
    for (int x = 0; x < VEC; x++) sums[warp * D + (lane + 32 * j) * VEC + x] = acc[j * VEC + x];
  }
  __syncthreads();
  float* mine = partial + ((size_t)token * gridDim.x + blockIdx.x) * (D + 2);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) o += sums[w * D + i];
    mine[i] = o;
  }
  if (threadIdx.x == 0) {
    mine[D] = mx;
    mine[D + 1] = total;
  }

  // The last of a head's blocks to finish merges the head's shares. Blocks are counted per
  // head in `counter`, which that block resets for the call site's next step.
  __shared__ bool is_last;
  __shared__ float weight[SPLITS];
  unsigned int* done = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(counter)) + token * heads;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = SPLITS == 1 || atomicAdd(done + head, 1u) == SPLITS - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Thread b reads share b's maximum and sum; every share is then weighted by
  // exp(its maximum - the head's), 0 for a share with nothing visible.
  const float* ph = partial + ((size_t)token * gridDim.x + (size_t)head * SPLITS) * (D + 2);
  const int b = threadIdx.x;
  const float share_max = b < SPLITS ? __ldcg(ph + b * (D + 2) + D) : -INFINITY;
  const float share_total = b < SPLITS ? __ldcg(ph + b * (D + 2) + D + 1) : 0.f;
  const float head_max = block_max(share_max, red);
  const float w = share_max == -INFINITY ? 0.f : expf(share_max - head_max);
  if (b < SPLITS) weight[b] = w;
  const float inv = 1.f / block_sum(w * share_total, red);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float o = 0.f;
#pragma unroll
    for (int s = 0; s < SPLITS; s++) o += weight[s] * __ldcg(ph + s * (D + 2) + i);
    out[((size_t)token * heads + head) * D + i] = static_cast<T>(o * inv);
  }
  if (SPLITS > 1 && threadIdx.x == 0) done[head] = 0u;
