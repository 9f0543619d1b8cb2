
  __shared__ float red[32];
  constexpr int HALF = D / 2;
  const int i = threadIdx.x;
  const int b = blockIdx.x;
  const T* src;
  const T* w = nullptr;
  T* dst;
  if (b < NH) {
    src = q_raw + (size_t)b * D; w = q_w; dst = q + (size_t)b * D;
  } else if (b < NH + NKV) {
    src = k_raw + (size_t)(b - NH) * D; w = k_w; dst = k + (size_t)(b - NH) * D;
  } else {
    src = v_raw + (size_t)(b - NH - NKV) * D; dst = v + (size_t)(b - NH - NKV) * D;
  }
  const float a = static_cast<float>(src[i]);
  const float c = static_cast<float>(src[i + HALF]);
  const float r = rsqrtf(block_sum(a * a + c * c, red) / D + EPS);
  T n1 = static_cast<T>(a * r);
  T n2 = static_cast<T>(c * r);
  if (w == nullptr) {
    dst[i] = n1;
    dst[i + HALF] = n2;
    return;
  }
  n1 = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(n1));
  n2 = static_cast<T>(static_cast<float>(w[i + HALF]) * static_cast<float>(n2));
  const float inv_freq = 1.0 / periods[i];
  const float theta = static_cast<float>(position[0]) * inv_freq;
  const float cs = cos(theta);
  const float sn = sin(theta);
  const float x1 = static_cast<float>(n1);
  const float x2 = static_cast<float>(n2);
  dst[i] = static_cast<T>(x1 * cs - x2 * sn);
  dst[i + HALF] = static_cast<T>(x1 * sn + x2 * cs);
