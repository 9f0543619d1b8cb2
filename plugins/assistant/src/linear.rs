//! Weight matrices, dense or affine-quantized in mlx-community's layout (`<module>.weight`
//! packed into uint32, `<module>.scales`, `<module>.biases`, one scale and bias per group of
//! input elements), and the loader that reads them from a [`Checkpoint`] with shape checks.

use mlx_spec_plugin_api::mlx_rs::ops::{dequantize, matmul, quantized_matmul};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::checkpoint::Checkpoint;
use crate::config::{QuantConfig, QuantSpec};

/// An MLX error as a message naming what was being computed.
pub fn mlx_err(
    what: &str,
) -> impl Fn(mlx_spec_plugin_api::mlx_rs::error::Exception) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// A packed affine-quantized matrix: `w = scales * q + biases` per group.
pub struct Quantized {
    pub packed: Array,
    pub scales: Array,
    pub biases: Array,
    pub spec: QuantSpec,
}

/// A matrix in torch layout `[out, in]`.
pub enum Linear {
    /// The weight and its transposed view (made once, so a forward is one product).
    Dense {
        weight: Array,
        transposed: Array,
    },
    Quantized(Quantized),
}

impl Linear {
    pub fn dense(weight: Array) -> Result<Self, String> {
        let transposed = weight
            .swap_axes(-1, -2)
            .map_err(mlx_err("transposing a weight"))?;
        Ok(Linear::Dense { weight, transposed })
    }

    /// `x @ W.T`.
    pub fn forward(&self, x: &Array) -> Result<Array, String> {
        match self {
            Linear::Dense { transposed, .. } => {
                matmul(x, transposed).map_err(mlx_err("matrix product"))
            }
            Linear::Quantized(q) => quantized_matmul(
                x,
                &q.packed,
                &q.scales,
                &q.biases,
                true,
                q.spec.group_size,
                q.spec.bits,
            )
            .map_err(mlx_err("quantized matrix product")),
        }
    }

    /// Rows `ids` of the matrix in float (an embedding lookup; dequantized when packed).
    pub fn rows(&self, ids: &Array) -> Result<Array, String> {
        match self {
            Linear::Dense { weight, .. } => weight.take_axis(ids, 0).map_err(mlx_err("row lookup")),
            Linear::Quantized(q) => {
                let take = |a: &Array| a.take_axis(ids, 0).map_err(mlx_err("row lookup"));
                dequantize(
                    take(&q.packed)?,
                    take(&q.scales)?,
                    &take(&q.biases)?,
                    q.spec.group_size,
                    q.spec.bits,
                )
                .map_err(mlx_err("dequantizing rows"))
            }
        }
    }

    /// Bytes held (packed values, scales and biases when quantized).
    pub fn nbytes(&self) -> usize {
        match self {
            Linear::Dense { weight, .. } => weight.nbytes(),
            Linear::Quantized(q) => q.packed.nbytes() + q.scales.nbytes() + q.biases.nbytes(),
        }
    }
}

/// Reads float tensors and matrices of one checkpoint, cast to the compute dtype.
pub struct Loader<'a> {
    pub checkpoint: &'a Checkpoint,
    pub quant: &'a QuantConfig,
    pub dtype: Dtype,
}

impl Loader<'_> {
    /// A float tensor (norm weight, layer scalar) of the given shape, in the compute dtype.
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

    /// The `[out, in]` matrix of `module`: `<module>.weight` in float, or packed with
    /// `.scales` and `.biases` when the checkpoint has them.
    pub fn linear(&self, module: &str, out_dim: usize, in_dim: usize) -> Result<Linear, String> {
        let weight_name = format!("{module}.weight");
        let scales_name = format!("{module}.scales");
        if !self.checkpoint.contains(&scales_name) {
            return Linear::dense(self.float(&weight_name, &[out_dim, in_dim])?);
        }
        let spec = self.quant.for_module(module).ok_or_else(|| {
            format!(
                "{module} is quantized ({scales_name} exists in {}) but config.json has no `quantization` entry for it",
                self.checkpoint.file_of(&scales_name)
            )
        })?;
        let (g, b) = (spec.group_size as usize, spec.bits as usize);
        if in_dim % g != 0 || (in_dim * b) % 32 != 0 {
            return Err(format!(
                "{module}: input width {in_dim} does not split into groups of {g} at {b} bits"
            ));
        }
        let packed = self
            .checkpoint
            .tensor(&weight_name, &[out_dim, in_dim * b / 32])
            .map_err(|e| format!("{e} ({module}: {b}-bit, group {g} quantization)"))?;
        if packed.dtype() != Dtype::Uint32 {
            return Err(format!(
                "tensor {weight_name} in {}: a quantized weight must be U32, found {:?}",
                self.checkpoint.file_of(&weight_name),
                packed.dtype()
            ));
        }
        let groups = [out_dim, in_dim / g];
        let scales = self.float(&scales_name, &groups)?;
        let biases = self
            .float(&format!("{module}.biases"), &groups)
            .map_err(|e| format!("{e} (affine quantization needs biases)"))?;
        Ok(Linear::Quantized(Quantized {
            packed,
            scales,
            biases,
            spec,
        }))
    }
}

pub fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}
