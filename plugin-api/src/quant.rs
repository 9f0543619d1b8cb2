//! Affine-quantized matrices in MLX's layout, for drafters that load their own weights.
//!
//! A quantized `[out, in]` matrix is stored as mlx-community stores it (and as
//! `mlx-spec quantize-drafter` writes it): `<module>.weight` (the values packed into uint32,
//! `[out, in * bits / 32]`), `<module>.scales` and `<module>.biases` (`[out, in / group_size]`,
//! float), so `w = scales * q + biases` per group of `group_size` inputs. `config.json` carries
//! the default `{group_size, bits}` in its `quantization` block (older converters:
//! `quantization_config`), with per-module entries keyed by the module's path: an object for
//! other parameters, `false` for a module left in float. Which modules are packed is told by
//! the tensors (`<module>.scales` present), as mlx-lm decides it.

use std::collections::BTreeMap;

use mlx_rs::ops::{dequantize, quantized_matmul};
use mlx_rs::{Array, Dtype};
use serde_json::Value;

use crate::checkpoint::Checkpoint;

/// Group size and bits of a quantized matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub group_size: i32,
    pub bits: i32,
}

/// The `quantization` block of a `config.json`: a default plus per-module overrides
/// (`None`: left in float).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuantConfig {
    pub default: Option<QuantSpec>,
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl QuantConfig {
    /// Reads the block of a parsed `config.json` (none: nothing quantized); `whence` names the
    /// file in errors.
    pub fn from_config(config: &Value, whence: &str) -> Result<Self, String> {
        let Some(q) = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))
        else {
            return Ok(QuantConfig::default());
        };
        let obj = q
            .as_object()
            .ok_or_else(|| format!("{whence}: `quantization` must be an object"))?;
        let mut cfg = QuantConfig {
            default: parse_spec(q, &format!("{whence}: `quantization`"))?,
            ..Default::default()
        };
        for (key, value) in obj {
            if value.is_object() || value.is_boolean() {
                let spec = parse_spec(value, &format!("{whence}: `quantization.{key}`"))?;
                cfg.overrides.insert(key.clone(), spec);
            }
        }
        Ok(cfg)
    }

    /// Parameters for the module at `path` (its full name without `.weight`).
    pub fn for_module(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(spec) => *spec,
            None => self.default,
        }
    }
}

fn parse_spec(v: &Value, what: &str) -> Result<Option<QuantSpec>, String> {
    match v {
        Value::Bool(false) => Ok(None),
        Value::Object(o) => {
            if let Some(mode) = o.get("mode").and_then(Value::as_str) {
                if mode != "affine" {
                    return Err(format!(
                        "{what}: quantization mode {mode:?} is not supported (only affine)"
                    ));
                }
            }
            let group_size = o.get("group_size").and_then(Value::as_i64).unwrap_or(64) as i32;
            let bits = o
                .get("bits")
                .and_then(Value::as_i64)
                .ok_or_else(|| format!("{what}: `bits` is missing"))? as i32;
            if ![2, 3, 4, 5, 6, 8].contains(&bits) {
                return Err(format!("{what}: {bits}-bit quantization is not supported"));
            }
            if ![32, 64, 128].contains(&group_size) {
                return Err(format!(
                    "{what}: group size {group_size} is not supported (32, 64 or 128)"
                ));
            }
            Ok(Some(QuantSpec { group_size, bits }))
        }
        other => Err(format!(
            "{what}: expected an object or false, found {other}"
        )),
    }
}

/// A packed matrix: the quantized values, their scales and biases.
pub struct Packed {
    pub packed: Array,
    pub scales: Array,
    pub biases: Array,
    pub spec: QuantSpec,
}

impl Packed {
    /// The packed `[out, in]` matrix of `module` (a full tensor-name prefix), or `None` when the
    /// checkpoint holds it in float (no `<module>.scales`). Scales and biases are cast to
    /// `dtype`; shapes and the packed dtype are checked against `out_dim`, `in_dim` and the
    /// config's parameters for the module.
    pub fn load(
        checkpoint: &Checkpoint,
        quant: &QuantConfig,
        module: &str,
        (out_dim, in_dim): (usize, usize),
        dtype: Dtype,
    ) -> Result<Option<Self>, String> {
        let weight_name = format!("{module}.weight");
        let scales_name = format!("{module}.scales");
        if !checkpoint.contains(&scales_name) {
            return Ok(None);
        }
        let spec = quant.for_module(module).ok_or_else(|| {
            format!(
                "{module} is quantized ({scales_name} exists in {}) but config.json has no `quantization` entry for it",
                checkpoint.file_of(&scales_name)
            )
        })?;
        let (g, b) = (spec.group_size as usize, spec.bits as usize);
        if in_dim % g != 0 || (in_dim * b) % 32 != 0 {
            return Err(format!(
                "{module}: input width {in_dim} does not split into groups of {g} at {b} bits"
            ));
        }
        let packed = checkpoint
            .tensor(&weight_name, &[out_dim, in_dim * b / 32])
            .map_err(|e| format!("{e} ({module}: {b}-bit, group {g} quantization)"))?;
        if packed.dtype() != Dtype::Uint32 {
            return Err(format!(
                "tensor {weight_name} in {}: a quantized weight must be U32, found {:?}",
                checkpoint.file_of(&weight_name),
                packed.dtype()
            ));
        }
        let groups = [out_dim, in_dim / g];
        let float = |name: &str| -> Result<Array, String> {
            let a = checkpoint.tensor(name, &groups)?;
            if !matches!(a.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
                return Err(format!(
                    "tensor {name} in {}: expected float, found {:?}",
                    checkpoint.file_of(name),
                    a.dtype()
                ));
            }
            a.as_dtype(dtype)
                .map_err(|e| format!("casting {name}: {e}"))
        };
        let scales = float(&scales_name)?;
        let biases = float(&format!("{module}.biases"))
            .map_err(|e| format!("{e} (affine quantization needs biases)"))?;
        Ok(Some(Packed {
            packed,
            scales,
            biases,
            spec,
        }))
    }

    /// `x @ W.T`.
    pub fn forward(&self, x: &Array) -> Result<Array, String> {
        quantized_matmul(
            x,
            &self.packed,
            &self.scales,
            &self.biases,
            true,
            self.spec.group_size,
            self.spec.bits,
        )
        .map_err(|e| format!("quantized matrix product: {e}"))
    }

    /// Rows `ids` of the matrix, dequantized (an embedding lookup).
    pub fn rows(&self, ids: &Array) -> Result<Array, String> {
        let take = |a: &Array| a.take_axis(ids, 0).map_err(|e| format!("row lookup: {e}"));
        dequantize(
            take(&self.packed)?,
            take(&self.scales)?,
            &take(&self.biases)?,
            self.spec.group_size,
            self.spec.bits,
        )
        .map_err(|e| format!("dequantizing rows: {e}"))
    }

    pub fn nbytes(&self) -> usize {
        self.packed.nbytes() + self.scales.nbytes() + self.biases.nbytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_overrides_and_refusals() {
        let v = serde_json::json!({"quantization": {
            "group_size": 32, "bits": 8, "mode": "affine",
            "a.gate": false, "b.proj": {"group_size": 64, "bits": 4}
        }});
        let q = QuantConfig::from_config(&v, "config.json").unwrap();
        let spec = |g, b| {
            Some(QuantSpec {
                group_size: g,
                bits: b,
            })
        };
        assert_eq!(q.for_module("c.proj"), spec(32, 8));
        assert_eq!(q.for_module("a.gate"), None);
        assert_eq!(q.for_module("b.proj"), spec(64, 4));
        assert_eq!(
            QuantConfig::from_config(&serde_json::json!({}), "x").unwrap(),
            QuantConfig::default()
        );
        for (bad, want) in [
            (serde_json::json!({"bits": 7}), "7-bit"),
            (
                serde_json::json!({"bits": 8, "group_size": 48}),
                "group size 48",
            ),
            (serde_json::json!({"bits": 8, "mode": "mxfp4"}), "mxfp4"),
            (serde_json::json!(4), "must be an object"),
        ] {
            let e = QuantConfig::from_config(&serde_json::json!({ "quantization": bad }), "c.json")
                .unwrap_err();
            assert!(e.contains(want) && e.starts_with("c.json"), "{e}");
        }
    }
}
