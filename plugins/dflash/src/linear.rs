//! Weight matrices (with an optional bias), float or affine-quantized in MLX's layout
//! (`mlx-spec quantize-drafter`, mlx-community), and the loader that reads them, shapes
//! checked, from the drafter's checkpoint.

use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::ops::matmul;
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};
use mlx_spec_plugin_api::quant::{Packed, QuantConfig};

/// An MLX error as a message naming what was being computed.
pub fn mlx_err(
    what: &str,
) -> impl Fn(mlx_spec_plugin_api::mlx_rs::error::Exception) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// A torch-layout `[out, in]` weight.
enum Weight {
    /// `W.T`, made once so that a forward is one product.
    Dense(Array),
    /// Packed values, scales and biases; multiplied without dequantizing.
    Packed(Packed),
}

/// `x @ W.T (+ b)`.
pub struct Linear {
    weight: Weight,
    bias: Option<Array>,
}

impl Linear {
    pub fn forward(&self, x: &Array) -> Result<Array, String> {
        let y = match &self.weight {
            Weight::Dense(transposed) => {
                matmul(x, transposed).map_err(mlx_err("matrix product"))?
            }
            Weight::Packed(p) => p.forward(x)?,
        };
        match &self.bias {
            Some(b) => y.add(b).map_err(mlx_err("adding a bias")),
            None => Ok(y),
        }
    }

    /// Whether the weight is held packed.
    pub fn is_quantized(&self) -> bool {
        matches!(self.weight, Weight::Packed(_))
    }

    pub fn nbytes(&self) -> usize {
        let weight = match &self.weight {
            Weight::Dense(transposed) => transposed.nbytes(),
            Weight::Packed(p) => p.nbytes(),
        };
        weight + self.bias.as_ref().map_or(0, Array::nbytes)
    }
}

/// Reads the checkpoint's tensors, cast to the compute dtype.
pub struct Loader<'a> {
    pub checkpoint: &'a Checkpoint,
    pub dtype: Dtype,
    /// config.json's `quantization` block (empty for a float checkpoint).
    pub quant: &'a QuantConfig,
}

impl Loader<'_> {
    /// A float tensor of the given shape, in the compute dtype.
    pub fn float(&self, name: &str, shape: &[usize]) -> Result<Array, String> {
        let a = self.checkpoint.tensor(name, shape)?;
        if !is_float(a.dtype()) {
            return Err(format!(
                "tensor {name} in {}: expected a float tensor, found {:?}",
                self.checkpoint.file_of(name),
                a.dtype()
            ));
        }
        a.as_dtype(self.dtype)
            .map_err(mlx_err(&format!("casting {name}")))
    }

    /// The `[out, in]` matrix `<module>.weight` (packed when `<module>.scales` exists), with
    /// `<module>.bias` (float) when `bias`.
    pub fn linear(
        &self,
        module: &str,
        out_dim: usize,
        in_dim: usize,
        bias: bool,
    ) -> Result<Linear, String> {
        let weight = match Packed::load(
            self.checkpoint,
            self.quant,
            module,
            (out_dim, in_dim),
            self.dtype,
        )? {
            Some(p) => Weight::Packed(p),
            None => {
                let w = self.float(&format!("{module}.weight"), &[out_dim, in_dim])?;
                Weight::Dense(
                    w.swap_axes(-1, -2)
                        .map_err(mlx_err("transposing a weight"))?,
                )
            }
        };
        let bias = if bias {
            Some(self.float(&format!("{module}.bias"), &[out_dim])?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
}

pub fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}
