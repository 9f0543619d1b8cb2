
// Bytes of one row of a [rows, K] weight: dense T (BITS 0), or BITS-bit affine values packed
// into 32-bit words, lowest bits first (MLX's layout), with a scale and a bias per G values.
template <typename T, int K, int BITS>
__device__ constexpr size_t row_bytes() {
  return BITS == 0 ? (size_t)K * sizeof(T) : (size_t)K * BITS / 8;
}

// Which 16-byte piece (of the four) of a 32-value chunk of the input a lane reads at step j:
// a chunk's inputs are 64 bytes in half precision, so neighbouring lanes reading the same
// piece of neighbouring chunks would meet in one bank group of shared memory (a four-way
// conflict); turning each pair of lanes by one piece puts a quarter-warp's eight reads on
// eight different groups.
__device__ inline int piece_at(int j, int lane) { return (j + (lane >> 1)) & 3; }

// Inputs 8p ... 8p + 7 of chunk c of the staged input, as floats.
template <typename T>
__device__ inline void load_piece(const T* xs, int c, int p, float (&x)[8]) {
  constexpr int PER_VEC = 16 / sizeof(T);
  const uint4* v = reinterpret_cast<const uint4*>(xs + c * 32 + p * 8);
#pragma unroll
  for (int i = 0; i < 8 / PER_VEC; i++) {
    const uint4 u = v[i];
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int k = 0; k < PER_VEC; k++) x[i * PER_VEC + k] = static_cast<float>(e[k]);
  }
}

// Word p of a 16-byte chunk, picked with selects (indexing registers by a variable would put
// them in local memory).
__device__ inline unsigned int word_at(const uint4& w, int p) {
  const unsigned int low = (p & 1) ? w.y : w.x;
  const unsigned int high = (p & 1) ? w.w : w.z;
  return (p & 2) ? high : low;
}

// acc += q . x over the eight 4-bit values q of `word` (value n at bits 4n) and their inputs
// x[n]. A value shifted down and or-ed into the bits of the float 2^23, whose last bit is
// worth 1, is the float 2^23 + q exactly: one subtraction leaves q, with no integer-to-float
// conversion (a quarter-rate instruction).
__device__ inline float nibbles_dot(unsigned int word, const float (&x)[8], float acc) {
#pragma unroll
  for (int n = 0; n < 8; n++) {
    const float q = __uint_as_float(((word >> (4 * n)) & 0xFu) | 0x4B000000u) - 8388608.f;
    acc = fmaf(q, x[n], acc);
  }
  return acc;
}

// The same sum with one operation less a value (IN_PLACE): value k or k + 4 is masked where
// it lies (16^k q, k < 4) and or-ed into the bits of 2^23, so no shift is needed; acc[k]
// then sums 16^k q x, which rows_dot_affine4 scales back by 16^-k. Products and sums scaled
// by a power of two round as unscaled ones do, but the four partial sums are added last, so
// the order of the sum differs from nibbles_dot's.
__device__ inline void nibbles_dot_in_place(unsigned int word, const float (&x)[8],
                                            float (&acc)[4]) {
  const unsigned int high = word >> 16;
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const unsigned int mask = 0xFu << (4 * k);
    const float low_q = __uint_as_float((word & mask) | 0x4B000000u) - 8388608.f;
    const float high_q = __uint_as_float((high & mask) | 0x4B000000u) - 8388608.f;
    acc[k] = fmaf(low_q, x[k], acc[k]);
    acc[k] = fmaf(high_q, x[k + 4], acc[k]);
  }
}

// sums[c] = the sum of the staged input's values 32 c ... 32 c + 31, the bias term of every
// 4-bit row's chunk c: once a stage rather than once a row. A thread a chunk, its pieces read
// in the turned order of piece_at. Nothing for dense weights (BITS 0).
template <typename T, int K, int BITS>
__device__ inline void chunk_sums(const T* xs, float* sums) {
  if constexpr (BITS != 0) {
    for (int c = threadIdx.x; c < K / 32; c += BLOCK_THREADS) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        float x[8];
        load_piece<T>(xs, c, piece_at(j, c), x);
#pragma unroll
        for (int k = 0; k < 8; k++) s += x[k];
      }
      sums[c] = s;
    }
    __syncthreads();
  }
}

// acc + scale (q . x) + bias (sum of x) for one chunk, as explicit fused operations: the
// compiler may not contract it otherwise, so a row's sum is the same whatever the call
// around it (rows a call, tokens a call: the window kernels rely on it).
__device__ inline float chunk_step(float acc, float scale, float qx, float bias, float xsum) {
  return fmaf(scale, qx, fmaf(bias, xsum, acc));
}

// One batch of a lane's loads over R rows of 4-bit weights, all in flight together: the
// 16-byte chunks lane + 32 (base + b), b < BATCH, of each row with their scales and biases
// (zeros past the row, which is not read there).
template <typename T, int K, int R, int G, int BATCH>
__device__ inline void load_affine4_batch(const void* const* rows, const T* const* scales,
                                          const T* const* biases, int base,
                                          uint4 (&wc)[BATCH][R], float (&sc)[BATCH][R],
                                          float (&bi)[BATCH][R]) {
  constexpr int CHUNKS = K / 32;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int b = 0; b < BATCH; b++) {
    const int c = lane + 32 * (base + b);
#pragma unroll
    for (int r = 0; r < R; r++) {
      if (c < CHUNKS) {
        wc[b][r] = __ldg(reinterpret_cast<const uint4*>(rows[r]) + c);
        sc[b][r] = static_cast<float>(__ldg(scales[r] + c * 32 / G));
        bi[b][r] = static_cast<float>(__ldg(biases[r] + c * 32 / G));
      } else {
        wc[b][r] = make_uint4(0, 0, 0, 0);
        sc[b][r] = 0.f;
        bi[b][r] = 0.f;
      }
    }
  }
}

// Dots of R rows of 4-bit affine weights with TOKENS staged inputs, summed over the warp:
// out[r * TOKENS + t]. Token t's input is at xs + t * STRIDE, its chunk sums (chunk_sums) at
// sums + t * (STRIDE / 32). A lane takes 16 bytes of a row at a time (32 values, within one
// group as G is a multiple of 32), about eight such loads in flight across its rows and
// chunks, each loaded once for all the tokens: per chunk and token, scale (q . x) + bias (sum
// of x) in float32. One token is a decode step (rows_dot_affine4); several are a verify window,
// each token's sum made of the same operations in the same order as that token's alone.
template <typename T, int K, int R, int G, int TOKENS, int STRIDE, bool IN_PLACE>
__device__ inline void rows_dot_affine4_tokens(const void* const* rows, const T* const* scales,
                                               const T* const* biases, const T* xs,
                                               const float* sums, float* out) {
  constexpr int CHUNKS = K / 32;
  constexpr int PER_LANE = (CHUNKS + 31) / 32;
  constexpr int WANT = 8 / R > 0 ? 8 / R : 1;
  constexpr int BATCH = PER_LANE < WANT ? PER_LANE : WANT;
  constexpr int SUMS = STRIDE / 32;
  const int lane = threadIdx.x & 31;
  float acc[R][TOKENS];
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int t = 0; t < TOKENS; t++) acc[r][t] = 0.f;
  }
  for (int base = 0; base < PER_LANE; base += BATCH) {
    // The batch's loads first, all in flight together; chunks past the row are not read.
    uint4 wc[BATCH][R];
    float sc[BATCH][R], bi[BATCH][R];
    load_affine4_batch<T, K, R, G, BATCH>(rows, scales, biases, base, wc, sc, bi);
#pragma unroll
    for (int b = 0; b < BATCH; b++) {
      const int c = lane + 32 * (base + b);
      if (c < CHUNKS) {
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
          float qx[R];
          float part[IN_PLACE ? R : 1][4];
#pragma unroll
          for (int r = 0; r < R; r++) qx[r] = 0.f;
#pragma unroll
          for (int r = 0; r < (IN_PLACE ? R : 1); r++) {
#pragma unroll
            for (int k = 0; k < 4; k++) part[r][k] = 0.f;
          }
#pragma unroll
          for (int j = 0; j < 4; j++) {
            const int p = piece_at(j, lane);
            float x[8];
            load_piece<T>(xs + t * STRIDE, c, p, x);
#pragma unroll
            for (int r = 0; r < R; r++) {
              if constexpr (IN_PLACE) {
                nibbles_dot_in_place(word_at(wc[b][r], p), x, part[r]);
              } else {
                qx[r] = nibbles_dot(word_at(wc[b][r], p), x, qx[r]);
              }
            }
          }
          if constexpr (IN_PLACE) {
#pragma unroll
            for (int r = 0; r < R; r++) {
              qx[r] = part[r][0] + part[r][1] * 0.0625f + part[r][2] * 0.00390625f +
                      part[r][3] * 0.000244140625f;
            }
          }
          const float xsum = sums[t * SUMS + c];
#pragma unroll
          for (int r = 0; r < R; r++) acc[r][t] = chunk_step(acc[r][t], sc[b][r], qx[r], bi[b][r], xsum);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int t = 0; t < TOKENS; t++) out[r * TOKENS + t] = warp_sum(acc[r][t]);
  }
}

// rows_dot_affine4_tokens for one staged input (a decode step): out[r].
template <typename T, int K, int R, int G, bool IN_PLACE>
__device__ inline void rows_dot_affine4(const void* const* rows, const T* const* scales,
                                        const T* const* biases, const T* xs, const float* sums,
                                        float* out) {
  rows_dot_affine4_tokens<T, K, R, G, 1, K, IN_PLACE>(rows, scales, biases, xs, sums, out);
}


// Dots of rows r[0], r[1], ... (R of them) of weights w[0..R) with the staged input, summed
// over the warp: dense rows (BITS 0) through the products' rows_dot, 4-bit ones through
// rows_dot_affine4. s and b: each weight's scales and biases, [rows, K / G], and sums the
// input's chunk sums (unused for dense weights). LOADS: the dense rows' 16-byte loads in
// flight a lane (rows_dot; the sums do not depend on it).
// The integer form of the staged input for rows_dot_affine4_int, made in place of `xs` (half
// precision only: an int16 per value takes the value's two bytes). Chunk c's 32 values become
// round(x 2^(15 - e)), held within +-32767, where 2^e is the power of two above the chunk's
// largest |x|; xscale[c] = 2^(e - 15) takes them back. A value keeps at least 15 bits below
// the chunk's largest (a bf16 value has 8), so the integer dots lose nothing that matters
// next to a float32 sum. Layout: piece-major (piece p, the inputs of word p of a 4-bit
// chunk, of chunk c at 16-byte slot p CHUNKS + c: a warp's lanes reading one piece of
// consecutive chunks read consecutive slots, no bank conflicts), and within a piece, inputs
// v0 ... v7 as the int16 pairs (v0, v2), (v4, v6), (v1, v3), (v5, v7): the order in which a
// word's low and high nibbles sit in its bytes. A NaN or infinite input is dropped here, but
// the chunk sums (made before, from xs) carry it into every row's result.
template <typename T, int K>
__device__ inline void chunk_integers(T* xs, float* xscale) {
  static_assert(sizeof(T) == 2, "integer dots take half-precision inputs");
  constexpr int CHUNKS = K / 32;
  constexpr int ITEMS = (CHUNKS + BLOCK_THREADS - 1) / BLOCK_THREADS;
  // Every chunk is read before any is written over: slots belong to other chunks' bytes.
  uint4 packed[ITEMS][4];
#pragma unroll
  for (int j = 0; j < ITEMS; j++) {
    const int c = threadIdx.x + j * BLOCK_THREADS;
    if (c >= CHUNKS) continue;
    float v[32];
    float largest = 0.f;
#pragma unroll
    for (int i = 0; i < 32; i++) {
      v[i] = static_cast<float>(xs[c * 32 + i]);
      largest = fmaxf(largest, fabsf(v[i]));
    }
    int e = 0;
    frexpf(largest, &e);
    const float up = ldexpf(1.f, 15 - e);
    xscale[c] = ldexpf(1.f, e - 15);
    auto integer = [&](int i) -> unsigned int {
      const float q = fminf(fmaxf(rintf(v[i] * up), -32767.f), 32767.f);
      return static_cast<unsigned int>(static_cast<int>(q)) & 0xFFFFu;
    };
#pragma unroll
    for (int p = 0; p < 4; p++) {
      const int b = 8 * p;
      packed[j][p] = make_uint4(integer(b) | integer(b + 2) << 16, integer(b + 4) | integer(b + 6) << 16,
                                integer(b + 1) | integer(b + 3) << 16, integer(b + 5) | integer(b + 7) << 16);
    }
  }
  __syncthreads();
  uint4* slots = reinterpret_cast<uint4*>(xs);
#pragma unroll
  for (int j = 0; j < ITEMS; j++) {
    const int c = threadIdx.x + j * BLOCK_THREADS;
    if (c >= CHUNKS) continue;
#pragma unroll
    for (int p = 0; p < 4; p++) slots[p * CHUNKS + c] = packed[j][p];
  }
  __syncthreads();
}

// rows_dot_affine4_tokens with integer dots: per chunk, the 4-bit values (bytes of a word's
// low or high nibbles) times the int16 inputs of chunk_integers, summed exactly in int32 by
// dp2a (two products a lane and instruction: |sum| <= 32 * 15 * 32767 < 2^24, so the
// conversion to float is exact too), then scale (q . x) + bias (sum of x) in float32. About a
// sixth of the instructions of the float unpacking, which bounds that path. Token t's
// integers are at xs + t * STRIDE, their scales at xscale + t * (STRIDE / 32) and its chunk
// sums at sums + t * (STRIDE / 32); out[r * TOKENS + t].
template <typename T, int K, int R, int G, int TOKENS, int STRIDE>
__device__ inline void rows_dot_affine4_int_tokens(const void* const* rows,
                                                   const T* const* scales,
                                                   const T* const* biases, const T* xs,
                                                   const float* xscale, const float* sums,
                                                   float* out) {
  constexpr int CHUNKS = K / 32;
  constexpr int PER_LANE = (CHUNKS + 31) / 32;
  constexpr int WANT = 8 / R > 0 ? 8 / R : 1;
  constexpr int BATCH = PER_LANE < WANT ? PER_LANE : WANT;
  constexpr int SUMS = STRIDE / 32;
  const int lane = threadIdx.x & 31;
  float acc[R][TOKENS];
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int t = 0; t < TOKENS; t++) acc[r][t] = 0.f;
  }
  for (int base = 0; base < PER_LANE; base += BATCH) {
    uint4 wc[BATCH][R];
    float sc[BATCH][R], bi[BATCH][R];
    load_affine4_batch<T, K, R, G, BATCH>(rows, scales, biases, base, wc, sc, bi);
#pragma unroll
    for (int b = 0; b < BATCH; b++) {
      const int c = lane + 32 * (base + b);
      if (c < CHUNKS) {
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
          const uint4* slots = reinterpret_cast<const uint4*>(xs + t * STRIDE);
          int dots[R];
#pragma unroll
          for (int r = 0; r < R; r++) dots[r] = 0;
#pragma unroll
          for (int p = 0; p < 4; p++) {
            const uint4 x = slots[p * CHUNKS + c];
#pragma unroll
            for (int r = 0; r < R; r++) {
              const unsigned int word = p == 0 ? wc[b][r].x : p == 1 ? wc[b][r].y : p == 2 ? wc[b][r].z : wc[b][r].w;
              const int low = static_cast<int>(word & 0x0F0F0F0Fu);
              const int high = static_cast<int>((word >> 4) & 0x0F0F0F0Fu);
              dots[r] = __dp2a_lo(static_cast<int>(x.x), low, dots[r]);
              dots[r] = __dp2a_hi(static_cast<int>(x.y), low, dots[r]);
              dots[r] = __dp2a_lo(static_cast<int>(x.z), high, dots[r]);
              dots[r] = __dp2a_hi(static_cast<int>(x.w), high, dots[r]);
            }
          }
          const float xsum = sums[t * SUMS + c];
          const float down = xscale[t * SUMS + c];
          // The product by a power of two is exact; chunk_step's fused operations keep a
          // row's result the same however many rows (or tokens) a call takes.
#pragma unroll
          for (int r = 0; r < R; r++) {
            const float qx = __fmul_rn(static_cast<float>(dots[r]), down);
            acc[r][t] = chunk_step(acc[r][t], sc[b][r], qx, bi[b][r], xsum);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int t = 0; t < TOKENS; t++) out[r * TOKENS + t] = warp_sum(acc[r][t]);
  }
}

// rows_dot_affine4_int_tokens for one staged input (a decode step): out[r].
template <typename T, int K, int R, int G>
__device__ inline void rows_dot_affine4_int(const void* const* rows, const T* const* scales,
                                            const T* const* biases, const T* xs,
                                            const float* xscale, const float* sums, float* out) {
  rows_dot_affine4_int_tokens<T, K, R, G, 1, K>(rows, scales, biases, xs, xscale, sums, out);
}

// Asks for the lines of a row a warp reads first (each lane's first BATCH 16-byte chunks, and
// for 4-bit rows the row's scales and biases, one lane's request a line) to be brought into
// L1 without waiting for them: issued before a block stages its input, the weights' trip to
// memory overlaps the input's, and the row's loads then find them close. Changes no value.
template <typename T, int K, int BITS, int G, int BATCH>
__device__ inline void touch_row(const void* row, const T* scales, const T* biases) {
  constexpr int CHUNKS = static_cast<int>(row_bytes<T, K, BITS>() / 16);
  constexpr int PER_LANE = (CHUNKS + 31) / 32;
  constexpr int FIRST = PER_LANE < BATCH ? PER_LANE : BATCH;
  const int lane = threadIdx.x & 31;
  const char* bytes = static_cast<const char*>(row);
#pragma unroll
  for (int b = 0; b < FIRST; b++) {
    const int c = lane + 32 * b;
    if (c < CHUNKS) asm volatile("prefetch.global.L1 [%0];" ::"l"(bytes + 16 * (size_t)c));
  }
  if constexpr (BITS != 0) {
    constexpr int GROUPS = K / G;
    constexpr int LINE = 128 / sizeof(T);
    if (lane * LINE < GROUPS) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(scales + lane * LINE));
      asm volatile("prefetch.global.L1 [%0];" ::"l"(biases + lane * LINE));
    }
  }
}

// Where rows r[0], r[1], ... of 4-bit weights w[0..R) start, with their first scale and bias
// (s and b: each weight's scales and biases, [rows, K / G]).
template <typename T, int K, int R, int BITS, int G>
__device__ inline void affine4_rows(const void* const* w, const T* const* s, const T* const* b,
                                    const int* r, const void* (&rows)[R], const T* (&sr)[R],
                                    const T* (&br)[R]) {
  constexpr int GROUPS = K / (G > 0 ? G : 1);
#pragma unroll
  for (int i = 0; i < R; i++) {
    rows[i] = static_cast<const char*>(w[i]) + (size_t)r[i] * row_bytes<T, K, BITS>();
    sr[i] = s[i] + (size_t)r[i] * GROUPS;
    br[i] = b[i] + (size_t)r[i] * GROUPS;
  }
}

// INT: 4-bit rows by integer dots (rows_dot_affine4_int) over the input chunk_integers made,
// with its scales in xscale.
template <typename T, int K, int R, int BITS, int G, bool IN_PLACE, int LOADS = 8, bool INT = false>
__device__ inline void weight_dot(const void* const* w, const T* const* s, const T* const* b,
                                  const int* r, const T* xs, const float* sums, float* out,
                                  const float* xscale = nullptr) {
  if constexpr (BITS == 0) {
    const T* rows[R];
#pragma unroll
    for (int i = 0; i < R; i++) rows[i] = static_cast<const T*>(w[i]) + (size_t)r[i] * K;
    rows_dot<T, K, R, LOADS>(rows, xs, out);
  } else {
    const void* rows[R];
    const T* sr[R];
    const T* br[R];
    affine4_rows<T, K, R, BITS, G>(w, s, b, r, rows, sr, br);
    if constexpr (INT) {
      rows_dot_affine4_int<T, K, R, G>(rows, sr, br, xs, xscale, sums, out);
    } else {
      rows_dot_affine4<T, K, R, G, IN_PLACE>(rows, sr, br, xs, sums, out);
    }
  }
}
