
// One head of a token from its raw product row `src` (D values rounded to T), a warp's job:
// lane l holds the rotate-half pairs (p, p + D/2) for p = l, l + 32, ..., so norm and rotation
// need no shared memory. The head is RMS-normed, a query or key head (kind 0, 1) then weighted
// by `w` and rotated at `pos` (RoPE periods in `periods`); a value head (kind 2) is normed
// without weight. Written to `dst`.
template <typename T, int D>
__device__ inline void finish_head(const T* src, const T* w, const float* periods, float pos,
                                   int kind, T* dst) {
  constexpr int HALF = D / 2;
  constexpr int PAIRS = HALF / 32;
  const int lane = threadIdx.x & 31;
  float a[PAIRS], c[PAIRS];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PAIRS; j++) {
    a[j] = static_cast<float>(__ldcg(src + lane + 32 * j));
    c[j] = static_cast<float>(__ldcg(src + lane + 32 * j + HALF));
    ss += a[j] * a[j] + c[j] * c[j];
  }
  const float r = rsqrtf(warp_sum(ss) / D + EPS);
#pragma unroll
  for (int j = 0; j < PAIRS; j++) {
    const int p = lane + 32 * j;
    T n1 = static_cast<T>(a[j] * r);
    T n2 = static_cast<T>(c[j] * r);
    if (kind == 2) {
      dst[p] = n1;
      dst[p + HALF] = n2;
      continue;
    }
    n1 = static_cast<T>(static_cast<float>(w[p]) * static_cast<float>(n1));
    n2 = static_cast<T>(static_cast<float>(w[p + HALF]) * static_cast<float>(n2));
    const float inv_freq = 1.0 / periods[p];
    const float theta = pos * inv_freq;
    const float cs = cos(theta);
    const float sn = sin(theta);
    const float x1 = static_cast<float>(n1);
    const float x2 = static_cast<float>(n2);
    dst[p] = static_cast<T>(x1 * cs - x2 * sn);
    dst[p + HALF] = static_cast<T>(x1 * sn + x2 * cs);
  }
}
