//! Seeded random weights for any Gemma 4 config (`--random-weights`), dense or affine-quantized,
//! so real model shapes can be measured without downloading a checkpoint.
//!
//! Matrices are drawn from N(0, 0.02²); norm weights, `layer_scalar` and router scales are
//! ones, as a freshly initialised model has them. Every tensor's values depend only on the
//! seed and the tensor's name. Quantized mode serves mlx-community's layout: packed `.weight`
//! plus `.scales`/`.biases` for every matrix whose input width splits into groups.

use std::cell::RefCell;
use std::collections::HashMap;

use anyhow::{bail, Result};
use mlx_rs::ops::{ones_dtype, quantize};
use mlx_rs::{random, Array, Dtype};

use super::config::QuantSpec;
use crate::weights::TensorSource;

/// Generates tensors on request.
pub struct RandomWeights {
    seed: u64,
    dtype: Dtype,
    quant: Option<QuantSpec>,
    /// Quantized modules already drawn: `(scales, biases)` wait here until the loader asks.
    pending: RefCell<HashMap<String, (Array, Array)>>,
}

/// Matrix-valued modules (`<module>.weight` is `[out, in]` or stacked `[E, out, in]`).
fn is_matrix_module(module: &str) -> bool {
    let leaf = module.rsplit('.').next().unwrap_or(module);
    leaf.ends_with("_proj")
        || matches!(
            leaf,
            "embed_tokens"
                | "embed_tokens_per_layer"
                | "per_layer_input_gate"
                | "per_layer_projection"
                | "proj"
                | "lm_head"
        )
}

fn name_hash(name: &str) -> u64 {
    // FNV-1a: stable across runs and platforms.
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl RandomWeights {
    /// `quant`: quantize matrices with these parameters (mlx-community layout).
    pub fn new(seed: u64, dtype: Dtype, quant: Option<QuantSpec>) -> Self {
        RandomWeights {
            seed,
            dtype,
            quant,
            pending: RefCell::new(HashMap::new()),
        }
    }

    /// The quantization config the loader should see for these weights.
    pub fn quant_config(&self) -> super::config::QuantConfig {
        super::config::QuantConfig {
            default: self.quant,
            overrides: Default::default(),
        }
    }

    fn normal(&self, name: &str, shape: &[usize]) -> Result<Array> {
        let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let key = random::key(self.seed ^ name_hash(name))?;
        // Drawn directly in the compute dtype: a float32 detour would double peak memory on
        // the largest tables (E2B's per-layer embeddings hold 2.3 G values).
        Ok(match self.dtype {
            Dtype::Bfloat16 => random::normal::<half::bf16>(&shape[..], 0.0, 0.02, &key)?,
            Dtype::Float16 => random::normal::<half::f16>(&shape[..], 0.0, 0.02, &key)?,
            _ => random::normal::<f32>(&shape[..], 0.0, 0.02, &key)?.as_dtype(self.dtype)?,
        })
    }

    fn quantizable(&self, module: &str) -> Option<QuantSpec> {
        self.quant.filter(|_| is_matrix_module(module))
    }
}

impl TensorSource for RandomWeights {
    fn contains(&self, name: &str) -> bool {
        if let Some(module) = name
            .strip_suffix(".scales")
            .or_else(|| name.strip_suffix(".biases"))
        {
            return self.quantizable(module).is_some();
        }
        // Quantized MoE weights come in mlx-community's split layout, dense ones in HF's fused one.
        if name.ends_with("experts.gate_up_proj") {
            return self.quant.is_none();
        }
        true
    }

    fn array(&self, name: &str, shape: &[usize]) -> Result<Array> {
        if let Some(module) = name
            .strip_suffix(".scales")
            .or_else(|| name.strip_suffix(".biases"))
        {
            let pending = self.pending.borrow();
            let Some((scales, biases)) = pending.get(module) else {
                bail!("random weights: {name} requested before {module}.weight");
            };
            return Ok(if name.ends_with(".scales") {
                scales.clone()
            } else {
                biases.clone()
            });
        }
        let leaf = name.rsplit('.').next().unwrap_or(name);
        let is_scale = name.ends_with("norm.weight")
            || leaf == "layer_scalar"
            || leaf == "scale"
            || leaf == "per_expert_scale";
        if is_scale {
            return Ok(ones_dtype(
                &shape.iter().map(|&d| d as i32).collect::<Vec<_>>(),
                self.dtype,
            )?);
        }
        let module = name.strip_suffix(".weight").unwrap_or(name);
        match self.quantizable(module) {
            Some(spec) if shape.last().is_some() => {
                // The loader asks for the packed shape; draw the float matrix it encodes.
                let mut dense = shape.to_vec();
                let last = dense.len() - 1;
                dense[last] = shape[last] * 32 / spec.bits as usize;
                let w = self.normal(name, &dense)?;
                let (packed, scales, biases) = quantize(&w, spec.group_size, spec.bits)?;
                mlx_rs::transforms::eval([&packed, &scales, &biases])?;
                self.pending
                    .borrow_mut()
                    .insert(module.to_owned(), (scales, biases));
                Ok(packed)
            }
            _ => {
                let w = self.normal(name, shape)?;
                w.eval()?;
                Ok(w)
            }
        }
    }

    fn dtype_of(&self, name: &str) -> Option<Dtype> {
        if name.ends_with(".weight") && self.quantizable(name.trim_end_matches(".weight")).is_some()
        {
            Some(Dtype::Uint32)
        } else {
            Some(self.dtype)
        }
    }
}
