
// Grid-wide barrier of a grid whose blocks are all resident. bar[0] counts the blocks that
// arrived, bar[1] is the barrier's generation: the last block to arrive resets the count and
// opens the next generation, which the others wait for, reading it atomically every 64 ns.
__device__ inline void grid_barrier(unsigned int* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* generation = bar + 1;
    const unsigned int mine = atomicAdd(generation, 0u);
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(generation, 1u);
    } else {
      const long long start = clock64();
      while (atomicAdd(generation, 0u) == mine) {
        __nanosleep(64);
        // About a second at the H200's clock: some block never ran, abort rather than hang.
        if (clock64() - start > (1ll << 31)) __trap();
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// Copies K elements that other blocks wrote in this kernel into shared memory, reading
// through L2 (the L1 of this multiprocessor may hold older lines).
template <typename T, int K>
__device__ inline void stage_written(const T* src, T* xs) {
  constexpr int CHUNKS = K * sizeof(T) / 16;
  // At least one (unused when K is 0: no per-layer input).
  constexpr int ITEMS = CHUNKS > 0 ? (CHUNKS + BLOCK_THREADS - 1) / BLOCK_THREADS : 1;
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  uint4* x4 = reinterpret_cast<uint4*>(xs);
  uint4 v[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; j++) {
    const int c = threadIdx.x + j * BLOCK_THREADS;
    if (c < CHUNKS) v[j] = __ldcg(s4 + c);
  }
#pragma unroll
  for (int j = 0; j < ITEMS; j++) {
    const int c = threadIdx.x + j * BLOCK_THREADS;
    if (c < CHUNKS) x4[c] = v[j];
  }
  __syncthreads();
}

// rsqrt(mean(o^2) + EPS) over the N floats of a product other blocks wrote, summed in the
// order of the closing product's last block.
template <int N>
__device__ inline float product_rms(const float* o, float* red) {
  constexpr int PER = N > 0 ? (N + BLOCK_THREADS - 1) / BLOCK_THREADS : 1;
  float v[PER];
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int i = threadIdx.x + j * BLOCK_THREADS;
    v[j] = i < N ? __ldcg(o + i) : 0.f;
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PER; j++) ss += v[j] * v[j];
  return rsqrtf(block_sum(ss, red) / N + EPS);
}

// o[r] = W[r] . xs, rounded to T as MLX's product rounds it and kept in float32, for the
// rows r this warp takes (every `warps`-th from `first`); W is [rows, K]. With PAIRS a warp
// takes two of its rows at a time (twice the loads in flight, and the input read once for
// both); each row's sum is the same.
template <typename T, int K, int BITS, int G, bool IN_PLACE, bool PAIRS>
__device__ inline void product_rows(const void* w, const T* s, const T* b, const T* xs,
                                    const float* sums, float* o, int rows, int first, int warps) {
  const bool lane0 = (threadIdx.x & 31) == 0;
  if constexpr (PAIRS) {
    for (int r = first; r < rows; r += 2 * warps) {
      // A last row without a partner is paired with itself and written once.
      const int r2 = r + warps < rows ? r + warps : r;
      const void* ws[2] = {w, w};
      const T* ss[2] = {s, s};
      const T* bs[2] = {b, b};
      const int rs[2] = {r, r2};
      float d[2];
      weight_dot<T, K, 2, BITS, G, IN_PLACE>(ws, ss, bs, rs, xs, sums, d);
      if (lane0) {
        o[r] = static_cast<float>(static_cast<T>(d[0]));
        if (r2 != r) o[r2] = static_cast<float>(static_cast<T>(d[1]));
      }
    }
  } else {
    for (int r = first; r < rows; r += warps) {
      float d;
      weight_dot<T, K, 1, BITS, G, IN_PLACE>(&w, &s, &b, &r, xs, sums, &d);
      if (lane0) o[r] = static_cast<float>(static_cast<T>(d));
    }
  }
}

// h + rms_norm(o) with norm weight pw, times s when SCALED, rounded as the closing product.
template <typename T, bool SCALED>
__device__ inline T closed(float o, float r, T h, T pw, float s) {
  const T n = static_cast<T>(o * r);
  const T weighted = static_cast<T>(static_cast<float>(pw) * static_cast<float>(n));
  T sum = static_cast<T>(static_cast<float>(h) + static_cast<float>(weighted));
  if (SCALED) sum = static_cast<T>(static_cast<float>(sum) * s);
  return sum;
}

// 16-byte pieces of a dense row of K values each lane reads in `rows_dot` (lane l: pieces
// l, l + 32, ...).
template <typename T, int K>
constexpr int lane_pieces() { return (K * (int)sizeof(T) / 16 + 31) / 32; }

// rows_dot over rows already loaded (`piece(i, r)`: lane piece i of row r): the same sums
// in the same order, so the same result bit for bit.
template <typename T, int K, int R, typename Piece>
__device__ inline void rows_dot_loaded(Piece piece, const T* xs, float* out) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNKS = K / VEC;
  const int lane = threadIdx.x & 31;
  const uint4* x4 = reinterpret_cast<const uint4*>(xs);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < lane_pieces<T, K>(); i++) {
    const int c = lane + 32 * i;
    if (c < CHUNKS) {
      const uint4 xc = x4[c];
#pragma unroll
      for (int r = 0; r < R; r++) acc[r] = piece_dot<T>(piece(i, r), xc, acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) out[r] = warp_sum(acc[r]);
}

// EARLY (dense weights, `set_per_layer_rows_early`): the per-layer-input block's rows, copied
// into shared memory before the barrier that ends the down product (their weights do not
// depend on the hidden state, and those stages are bound by the latency of each load after
// its barrier). The block's gate rows 4 b ... 4 b + 3 go into `gate` (the staging buffer,
// free once the down product has read it), which warps 4-7 then take; each warp's pair of
// projection rows (first, first + warps) into `proj`. The copies are asynchronous
// (cp.async) and issued after the fence that publishes the down product, by every thread
// but those of warp 0: thread 0 arrives at the barrier, and its fence must not wait for
// them. Only where the rows fit (`fits`); elsewhere the block loads as it goes.
constexpr int EARLY_GATE_ROWS = 4;

__device__ inline void copy_async_16(void* to, const void* from) {
  const unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(from) : "memory");
}

template <typename T, int H, int P, int STAGED>
__device__ inline bool early_rows_fit() {
  const int warps = gridDim.x * (BLOCK_THREADS / 32);
  return P > 0 && P <= EARLY_GATE_ROWS * (int)gridDim.x && H <= 2 * warps &&
         EARLY_GATE_ROWS * H <= STAGED && (H * (int)sizeof(T)) % 16 == 0 &&
         (P * (int)sizeof(T)) % 16 == 0;
}

template <typename T, int H, int P>
__device__ inline void copy_early_rows(T* gate, T* proj, const T* pg, const T* pp) {
  const int warps = gridDim.x * (BLOCK_THREADS / 32);
  constexpr int GATE_PIECES = H * (int)sizeof(T) / 16;
  constexpr int PROJ_PIECES = P * (int)sizeof(T) / 16;
  constexpr int ALL = EARLY_GATE_ROWS * GATE_PIECES + 2 * (BLOCK_THREADS / 32) * PROJ_PIECES;
  for (int i = threadIdx.x - 32; i >= 0 && i < ALL; i += BLOCK_THREADS - 32) {
    if (i < EARLY_GATE_ROWS * GATE_PIECES) {
      const int j = i / GATE_PIECES;
      const int r = blockIdx.x * EARLY_GATE_ROWS + j;
      if (r < P) {
        const int c = i % GATE_PIECES;
        copy_async_16(reinterpret_cast<uint4*>(gate + (size_t)j * H) + c,
                      reinterpret_cast<const uint4*>(pg + (size_t)r * H) + c);
      }
    } else {
      const int k = i - EARLY_GATE_ROWS * GATE_PIECES;
      const int slot = k / PROJ_PIECES;  // 2 w + (0: first row, 1: second)
      const int c = k % PROJ_PIECES;
      const int first = blockIdx.x * (BLOCK_THREADS / 32) + slot / 2;
      const int second = first + warps < H ? first + warps : first;
      const int r = slot % 2 == 0 ? first : second;
      if (first < H) {
        copy_async_16(reinterpret_cast<uint4*>(proj + (size_t)slot * P) + c,
                      reinterpret_cast<const uint4*>(pp + (size_t)r * P) + c);
      }
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// A layer's per-layer-input block, every block of the grid resident: g = gelu_tanh(W_in h) *
// v (v: this layer's P values, per_layer[v0 ...]), a grid-wide barrier, o2 = W_proj g, a
// barrier, then out = (h + rms_norm(o2, pn)) * s, the blocks writing it in turns. hs: h
// staged in shared memory, its chunk sums in `sums`; `buf` (P elements) and `sums` then hold
// g's. g and o2: device scratch. Rounds as the gated and closing products do.
template <typename T, int H, int P, int BITS, int G, bool IN_PLACE, bool PAIRS, typename WI,
          typename WP>
__device__ inline void per_layer_block(const T* hs, T* buf, float* sums, float* red,
                                       const WI* pg, const T* pg_s, const T* pg_b,
                                       const T* per_layer, int v0, const WP* pp,
                                       const T* pp_s, const T* pp_b, const T* pn, float s,
                                       unsigned int* bar, T* g, float* o2, T* out,
                                       bool loaded, const T* early_gate,
                                       const T* early_proj) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (BLOCK_THREADS / 32);
  const int first = blockIdx.x * (BLOCK_THREADS / 32) + (threadIdx.x >> 5);
  // g[r] from the gate row's dot d.
  auto gate_out = [&](int r, float d) {
    if (lane == 0) {
      const T act = static_cast<T>(gelu_tanh(static_cast<float>(static_cast<T>(d))));
      g[r] = static_cast<T>(static_cast<float>(act) * static_cast<float>(per_layer[v0 + r]));
    }
  };
  if (loaded) {
    // Every thread's copies, then the block's: a row's pieces came from several threads.
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    const int j = (threadIdx.x >> 5) - (BLOCK_THREADS / 32 - EARLY_GATE_ROWS);
    const int r = blockIdx.x * EARLY_GATE_ROWS + j;
    if (j >= 0 && r < P) {
      const uint4* row = reinterpret_cast<const uint4*>(early_gate + (size_t)j * H);
      float d;
      rows_dot_loaded<T, H, 1>([&](int i, int) { return row[lane + 32 * i]; }, hs, &d);
      gate_out(r, d);
    }
  } else {
    for (int r = first; r < P; r += warps) {
      const void* w = pg;
      float d;
      weight_dot<T, H, 1, BITS, G, IN_PLACE>(&w, &pg_s, &pg_b, &r, hs, sums, &d);
      gate_out(r, d);
    }
  }
  __threadfence();
  grid_barrier(bar);

  stage_written<T, P>(g, buf);
  chunk_sums<T, P, BITS>(buf, sums);
  if (loaded) {
    if (first < H) {
      const int r2 = first + warps < H ? first + warps : first;
      float d[2];
      const uint4* rows = reinterpret_cast<const uint4*>(early_proj + (size_t)(threadIdx.x >> 5) * 2 * P);
      rows_dot_loaded<T, P, 2>(
          [&](int i, int r) { return rows[r * (P * (int)sizeof(T) / 16) + lane + 32 * i]; }, buf, d);
      if (lane == 0) {
        o2[first] = static_cast<float>(static_cast<T>(d[0]));
        if (r2 != first) o2[r2] = static_cast<float>(static_cast<T>(d[1]));
      }
    }
  } else {
    product_rows<T, P, BITS, G, IN_PLACE, PAIRS>(pp, pp_s, pp_b, buf, sums, o2, H, first, warps);
  }
  __threadfence();
  grid_barrier(bar);

  if (blockIdx.x * BLOCK_THREADS >= H) return;
  const float r2 = product_rms<H>(o2, red);
  for (int i = blockIdx.x * BLOCK_THREADS + threadIdx.x; i < H; i += gridDim.x * BLOCK_THREADS) {
    out[i] = closed<T, true>(__ldcg(o2 + i), r2, hs[i], pn[i], s);
  }
}
