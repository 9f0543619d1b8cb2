//! Linear layers and embedding tables, dense or affine-quantized (mlx-community layout), and
//! the loader that reads them from a checkpoint with shape checks.

use anyhow::{bail, Context, Result};
use mlx_rs::ops::{dequantize, matmul, quantized_matmul};
use mlx_rs::{Array, Dtype};

use super::config::{QuantConfig, QuantSpec};
use crate::weights::TensorSource;

/// Packed affine-quantized weight: `w = scales * q + biases` per group of input elements.
pub struct Quantized {
    pub packed: Array,
    pub scales: Array,
    pub biases: Array,
    pub spec: QuantSpec,
}

/// A dense weight in torch layout `[.., out, in]`, with its transposed view made once at load
/// so a forward adds one matrix product to the graph, not a transpose and a product.
pub struct Dense {
    pub weight: Array,
    /// `weight` with its last two axes swapped: a strided view of the same buffer.
    pub transposed: Array,
}

impl Dense {
    pub fn new(weight: Array) -> Result<Self> {
        let transposed = weight.swap_axes(-1, -2)?;
        transposed.eval()?;
        Ok(Dense { weight, transposed })
    }
}

/// A weight matrix in torch layout `[out, in]`.
pub enum Linear {
    Dense(Dense),
    Quantized(Quantized),
}

impl Linear {
    pub fn dense(weight: Array) -> Result<Self> {
        Ok(Linear::Dense(Dense::new(weight)?))
    }

    /// Bytes of the stored weight (packed values, scales and biases when quantized).
    pub fn nbytes(&self) -> usize {
        match self {
            Linear::Dense(d) => d.weight.nbytes(),
            Linear::Quantized(q) => q.packed.nbytes() + q.scales.nbytes() + q.biases.nbytes(),
        }
    }

    /// `x @ W.T`
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Linear::Dense(d) => matmul(x, &d.transposed)?,
            Linear::Quantized(q) => quantized_matmul(
                x,
                &q.packed,
                &q.scales,
                &q.biases,
                true,
                q.spec.group_size,
                q.spec.bits,
            )?,
        })
    }
}

/// An embedding table `[rows, dim]`; when tied it doubles as the output head.
pub struct Embedding(pub Linear);

impl Embedding {
    /// Rows of the table for `ids` (any shape), in the table's float dtype.
    pub fn lookup(&self, ids: &Array) -> Result<Array> {
        Ok(match &self.0 {
            Linear::Dense(d) => d.weight.take_axis(ids, 0)?,
            Linear::Quantized(q) => {
                let packed = q.packed.take_axis(ids, 0)?;
                let scales = q.scales.take_axis(ids, 0)?;
                let biases = q.biases.take_axis(ids, 0)?;
                dequantize(&packed, &scales, &biases, q.spec.group_size, q.spec.bits)?
            }
        })
    }

    /// `x @ table.T`: logits from hidden states for a tied head.
    pub fn as_head(&self, x: &Array) -> Result<Array> {
        self.0.forward(x)
    }
}

/// Reads modules of one checkpoint, casting float weights to the compute dtype.
pub struct Loader<'a> {
    pub store: &'a dyn TensorSource,
    /// Name prefix of the decoder's tensors, e.g. `model.` or `model.language_model.`.
    pub prefix: String,
    pub dtype: Dtype,
    pub quant: &'a QuantConfig,
    /// Quantized matrices become dense ones in `dtype` as they load (see
    /// [`super::Gemma4Model::load_dequantized`]).
    pub dequantize: bool,
}

impl Loader<'_> {
    pub fn name(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    pub fn has(&self, suffix: &str) -> bool {
        self.store.contains(&self.name(suffix))
    }

    /// A float tensor (norm weight, scalar, router scale…) of the given shape.
    pub fn tensor(&self, suffix: &str, shape: &[usize]) -> Result<Array> {
        let a = self.store.array(&self.name(suffix), shape)?;
        Ok(a.as_dtype(self.dtype)?)
    }

    /// A float tensor kept in float32 whatever the compute dtype (e.g. routing scales).
    pub fn tensor_f32(&self, suffix: &str, shape: &[usize]) -> Result<Array> {
        let a = self.store.array(&self.name(suffix), shape)?;
        Ok(a.as_dtype(Dtype::Float32)?)
    }

    /// A `[out, in]` matrix stored as `<module>.weight` (dense) or as packed
    /// `.weight` + `.scales` + `.biases` (quantized).
    pub fn linear(&self, module: &str, out_dim: usize, in_dim: usize) -> Result<Linear> {
        self.matrix(module, &format!("{module}.weight"), &[], out_dim, in_dim)
    }

    /// Like [`Loader::linear`] with leading dims (stacked experts `[E, out, in]`) and an
    /// explicit weight tensor name (HF stores experts without the `.weight` suffix).
    pub fn matrix(
        &self,
        module: &str,
        weight: &str,
        lead: &[usize],
        out_dim: usize,
        in_dim: usize,
    ) -> Result<Linear> {
        let scales_name = format!("{module}.scales");
        if !self.has(&scales_name) {
            let shape: Vec<usize> = lead.iter().copied().chain([out_dim, in_dim]).collect();
            return Linear::dense(self.tensor(weight, &shape)?);
        }
        let full_module = self.name(module);
        let spec = self.quant.for_module(&full_module).with_context(|| {
            format!(
                "{full_module} is quantized ({} exists) but config.json has no `quantization` entry for it",
                self.name(&scales_name)
            )
        })?;
        let QuantSpec { group_size, bits } = spec;
        let (g, b) = (group_size as usize, bits as usize);
        if in_dim % g != 0 || (in_dim * b) % 32 != 0 {
            bail!(
                "{full_module}: input width {in_dim} does not split into groups of {g} at {b} bits"
            );
        }
        let packed_shape: Vec<usize> = lead
            .iter()
            .copied()
            .chain([out_dim, in_dim * b / 32])
            .collect();
        let group_shape: Vec<usize> = lead.iter().copied().chain([out_dim, in_dim / g]).collect();
        let packed = self
            .store
            .array(&self.name(weight), &packed_shape)
            .with_context(|| {
                format!(
                    "{full_module}: packed weight does not match {b}-bit, group {g} quantization"
                )
            })?;
        if packed.dtype() != Dtype::Uint32 {
            bail!(
                "{}: quantized weight must be U32, found {:?}",
                self.name(weight),
                packed.dtype()
            );
        }
        let scales = self.tensor(&scales_name, &group_shape)?;
        let biases = self
            .tensor(&format!("{module}.biases"), &group_shape)
            .with_context(|| format!("{full_module}: affine quantization needs `.biases`"))?;
        if self.dequantize {
            // One dense copy, made once: the products then run as dense ones.
            let weight =
                dequantize(&packed, &scales, &biases, group_size, bits)?.as_dtype(self.dtype)?;
            return Linear::dense(weight);
        }
        Ok(Linear::Quantized(Quantized {
            packed,
            scales,
            biases,
            spec,
        }))
    }

    pub fn embedding(&self, module: &str, rows: usize, dim: usize) -> Result<Embedding> {
        Ok(Embedding(self.linear(module, rows, dim)?))
    }
}
