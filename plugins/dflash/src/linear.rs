//! Float weight matrices (with an optional bias) and the loader that reads them, shapes
//! checked, from the drafter's checkpoint.

use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::ops::matmul;
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

/// An MLX error as a message naming what was being computed.
pub fn mlx_err(
    what: &str,
) -> impl Fn(mlx_spec_plugin_api::mlx_rs::error::Exception) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// `x @ W.T (+ b)` for a torch-layout `[out, in]` weight.
pub struct Linear {
    /// `W.T`, made once so that a forward is one product.
    transposed: Array,
    bias: Option<Array>,
}

impl Linear {
    pub fn forward(&self, x: &Array) -> Result<Array, String> {
        let y = matmul(x, &self.transposed).map_err(mlx_err("matrix product"))?;
        match &self.bias {
            Some(b) => y.add(b).map_err(mlx_err("adding a bias")),
            None => Ok(y),
        }
    }

    pub fn nbytes(&self) -> usize {
        self.transposed.nbytes() + self.bias.as_ref().map_or(0, Array::nbytes)
    }
}

/// Reads the checkpoint's tensors, cast to the compute dtype.
pub struct Loader<'a> {
    pub checkpoint: &'a Checkpoint,
    pub dtype: Dtype,
}

impl Loader<'_> {
    /// A float tensor of the given shape, in the compute dtype.
    pub fn float(&self, name: &str, shape: &[usize]) -> Result<Array, String> {
        let a = self.checkpoint.tensor(name, shape)?;
        if !is_float(a.dtype()) {
            return Err(format!(
                "tensor {name} in {}: expected a float tensor, found {:?} (quantized drafters are not supported yet)",
                self.checkpoint.file_of(name),
                a.dtype()
            ));
        }
        a.as_dtype(self.dtype)
            .map_err(mlx_err(&format!("casting {name}")))
    }

    /// The `[out, in]` matrix `<module>.weight`, with `<module>.bias` when `bias`.
    pub fn linear(
        &self,
        module: &str,
        out_dim: usize,
        in_dim: usize,
        bias: bool,
    ) -> Result<Linear, String> {
        let weight = self.float(&format!("{module}.weight"), &[out_dim, in_dim])?;
        let transposed = weight
            .swap_axes(-1, -2)
            .map_err(mlx_err("transposing a weight"))?;
        let bias = if bias {
            Some(self.float(&format!("{module}.bias"), &[out_dim])?)
        } else {
            None
        };
        Ok(Linear { transposed, bias })
    }
}

pub fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}
