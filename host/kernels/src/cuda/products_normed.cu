
  constexpr int WARPS = 8;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  stage_input<T, K, NORM>(x, nw, xs, red);
  const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const T* wrow;
  T* dst;
  if (row < N0) {
    wrow = w0 + (size_t)row * K; dst = y0 + row;
  } else if (row < N0 + N1) {
    wrow = w1 + (size_t)(row - N0) * K; dst = y1 + (row - N0);
  } else if (row < N0 + N1 + N2) {
    wrow = w2 + (size_t)(row - N0 - N1) * K; dst = y2 + (row - N0 - N1);
  } else {
    return;
  }
  float d;
  rows_dot<T, K, 1>(&wrow, xs, &d);
  if ((threadIdx.x & 31) == 0) *dst = static_cast<T>(d);
