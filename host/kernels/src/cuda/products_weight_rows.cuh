
// Dots of rows first ... first + R - 1 (the last row again past N) of each of the M weights
// ws with the staged input: out[m R + i] for weight m, row first + i, through weight_dot
// (LOADS: dense loads in flight a lane; INT: 4-bit rows by integer dots, `xs` then holding
// what chunk_integers made of the input and xscale its scales).
template <typename T, int K, int R, int BITS, int G, int M, int LOADS = 8, bool INT = false,
          typename W>
__device__ inline void weight_rows(const W* const (&ws)[M], const T* const (&ss)[M],
                                   const T* const (&bs)[M], int first, int N, const T* xs,
                                   const float* sums, float* out, const float* xscale = nullptr) {
  const void* w[M * R];
  const T* s[M * R];
  const T* b[M * R];
  int r[M * R];
#pragma unroll
  for (int i = 0; i < M * R; i++) {
    w[i] = ws[i / R];
    s[i] = ss[i / R];
    b[i] = bs[i / R];
    r[i] = min(first + i % R, N - 1);
  }
  weight_dot<T, K, M * R, BITS, G, false, LOADS, INT>(w, s, b, r, xs, sums, out, xscale);
}

// touch_row (affine4's header) for the rows weight_rows reads: each lane's first batch of its
// M R rows, before the block stages its input. Changes no value.
template <typename T, int K, int R, int BITS, int G, int M, int LOADS = 8, typename W>
__device__ inline void touch_rows(const W* const (&ws)[M], const T* const (&ss)[M],
                                  const T* const (&bs)[M], int first, int N) {
  if (first >= N) return;
  constexpr int WANT = (BITS == 0 ? LOADS : 8) / (M * R) > 0 ? (BITS == 0 ? LOADS : 8) / (M * R) : 1;
  constexpr int GROUPS = BITS != 0 ? K / (G > 0 ? G : 1) : 1;
#pragma unroll
  for (int i = 0; i < M * R; i++) {
    const size_t r = static_cast<size_t>(min(first + i % R, N - 1));
    touch_row<T, K, BITS, G, WANT>(reinterpret_cast<const char*>(ws[i / R]) + r * row_bytes<T, K, BITS>(),
                                   ss[i / R] + r * GROUPS, bs[i / R] + r * GROUPS);
  }
}
