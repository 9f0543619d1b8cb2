//! `x + rms_norm(y, w)`, optionally times a per-layer scalar: the residual update that closes
//! every attention, feed-forward and per-layer-input block of a Gemma 4 layer.
//!
//! One block per row. It rounds where MLX's operations round: the normalised `y` to the
//! activation dtype before the weight (MLX's RMSNorm multiplies the weight in that dtype),
//! the weighted value, the sum, and the scaled sum.

use std::cell::RefCell;

use anyhow::Result;
use mlx_rs::Array;

use super::{PerEpsilon, TemplateArg};

const SOURCE: &str = r#"
  __shared__ float red[32];
  const size_t row = blockIdx.x;
  const T* yr = y + row * H;
  const T* xr = x + row * H;
  T* o = out + row * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float a = static_cast<float>(yr[i]);
    ss += a * a;
  }
  ss = block_sum(ss, red);
  const float r = rsqrtf(ss / H + EPS);
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    T normed = static_cast<T>(static_cast<float>(yr[i]) * r);
    T weighted = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
    T sum = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(weighted));
    if (SCALED) {
      sum = static_cast<T>(static_cast<float>(sum) * static_cast<float>(scale[0]));
    }
    o[i] = sum;
  }
"#;

const THREADS: i32 = 256;

thread_local! {
    static KERNELS: RefCell<PerEpsilon> = RefCell::new(PerEpsilon::new(
        "residual_norm",
        &["x", "y", "w", "scale"],
        &["out"],
        SOURCE,
    ));
}

/// `x + rms_norm(y, w, eps)`, times `scale` (a one-element array) when given. `x` and `y`
/// are `[rows, H]` in one dtype, `w` is `[H]`.
pub fn residual_norm(
    x: &Array,
    y: &Array,
    w: &Array,
    eps: f32,
    scale: Option<&Array>,
) -> Result<Array> {
    let shape = y.shape().to_vec();
    let h = *shape.last().unwrap_or(&1);
    let rows = (y.size() as i32) / h.max(1);
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        // Without a scale, `w` stands in for the unused input (never read: SCALED is false).
        let scale_input = scale.unwrap_or(w);
        let mut out = kernel.apply(
            &[x, y, w, scale_input],
            &[(&shape, y.dtype())],
            (rows * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                ("T", TemplateArg::Dtype(y.dtype())),
                ("H", TemplateArg::Int(h)),
                ("SCALED", TemplateArg::Bool(scale.is_some())),
            ],
        )?;
        Ok(out.remove(0))
    })
}
