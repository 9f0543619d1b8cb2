//! `mlx-spec quantize-drafter`: a drafter checkpoint folder to MLX's affine 4- or 8-bit layout,
//! the one mlx-community publishes and the drafter plugins load.
//!
//! Every 2-D float matrix `<module>.weight` whose input width splits into groups becomes
//! `<module>.weight` (the quantized values packed into uint32), `<module>.scales` and
//! `<module>.biases` (one scale and bias per group of `group_size` inputs, in the matrix's own
//! float dtype): MLX's own `quantize`, so `w ≈ scales * q + biases` exactly as MLX's
//! `quantized_matmul` and `dequantize` read it. The gather tables (embedding tables, the
//! assistant's centroids, DeepSpec's Markov table) are matrices like the others; their rows are
//! dequantized when looked up. Left in their float dtype: norms, biases, layer scalars and every
//! other tensor that is not a 2-D `.weight`, DeepSpec's confidence head (one row deciding how
//! many drafts to propose), a GLM row's expert router (its scores pick experts), and any
//! matrix whose width does not split into groups; each matrix left in float is listed with
//! `false` in `config.json`'s `quantization` block (mlx-lm's per-module convention).
//!
//! The format is recognised from `config.json`: the Gemma 4 assistant
//! (`gemma4_assistant` / `gemma4_unified_assistant`), a GLM-style MTP row (`glm4_moe` with an
//! `mlx_spec_mtp` block), DeepSpec's `Gemma4DSparkModel` and z-lab's `DFlashDraftModel`. Other files of the source folder
//! are copied, except the model card (`README.md`: a quantized checkpoint needs its own) and
//! safetensors files (the weights are written anew as one `model.safetensors`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::builder::TypedValueParser as _;
use mlx_rs::ops::quantize;
use mlx_rs::{Array, Dtype};
use mlx_spec_plugin_api::checkpoint::Checkpoint;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use serde_json::Value;

/// `mlx-spec quantize-drafter`.
#[derive(clap::Args, Debug)]
pub struct QuantizeDrafterArgs {
    /// Bits per weight.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["4", "8"]).map(|s| s.parse::<i32>().unwrap()))]
    pub bits: i32,
    /// Inputs sharing one scale and bias.
    #[arg(long = "group-size", default_value = "64", value_parser = clap::builder::PossibleValuesParser::new(["32", "64"]).map(|s| s.parse::<i32>().unwrap()))]
    pub group_size: i32,
    /// The float checkpoint folder (config.json and safetensors).
    #[arg(value_name = "SRC")]
    pub src: PathBuf,
    /// The folder to write (must not exist, or be empty).
    #[arg(value_name = "DST")]
    pub dst: PathBuf,
}

/// The drafter formats this command knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Gemma 4's assistant (`Gemma4AssistantForCausalLM`, and the 12B's unified class).
    Assistant,
    /// A GLM-style MTP row (`glm4_moe` with `mlx_spec_mtp`).
    GlmMtp,
    /// DeepSpec's `Gemma4DSparkModel` (DSpark, DeepSpec DFlash).
    DeepSpec,
    /// z-lab's `DFlashDraftModel` (no embedding or head of its own: the target's are used).
    DFlash,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Assistant => "Gemma 4 assistant",
            Format::GlmMtp => "GLM MTP row",
            Format::DeepSpec => "DeepSpec Gemma4DSparkModel",
            Format::DFlash => "z-lab DFlashDraftModel",
        }
    }

    /// Recognises the format of a parsed `config.json`.
    pub fn detect(config: &Value) -> Option<Format> {
        let model_type = config.get("model_type").and_then(Value::as_str);
        let architectures: Vec<&str> = config
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let has_arch = |name: &str| architectures.contains(&name);
        if has_arch("Gemma4DSparkModel") {
            Some(Format::DeepSpec)
        } else if has_arch("DFlashDraftModel") {
            Some(Format::DFlash)
        } else if matches!(
            model_type,
            Some("gemma4_assistant" | "gemma4_unified_assistant")
        ) || has_arch("Gemma4AssistantForCausalLM")
            || has_arch("Gemma4UnifiedAssistantForCausalLM")
        {
            Some(Format::Assistant)
        } else if model_type == Some("glm4_moe") && config.get("mlx_spec_mtp").is_some() {
            Some(Format::GlmMtp)
        } else {
            None
        }
    }

    /// Why a matrix of this format stays in float whatever its width (`None`: it is quantized
    /// when its width splits into groups).
    fn keeps_float(self, module: &str) -> Option<&'static str> {
        match self {
            Format::DeepSpec if module.starts_with("confidence_head.") => {
                Some("the confidence head")
            }
            Format::GlmMtp if module.ends_with("mlp.gate") => Some("the expert router"),
            _ => None,
        }
    }
}

/// What [`quantize_drafter`] did.
#[derive(Debug, Clone)]
pub struct Summary {
    pub format: Format,
    /// Modules quantized.
    pub quantized: Vec<String>,
    /// Matrices left in float, with why.
    pub kept: Vec<(String, String)>,
    /// Bytes of the source weights and of the written ones.
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Files copied beside the weights.
    pub copied: Vec<String>,
}

/// Runs the command and prints what it did.
pub fn run(args: &QuantizeDrafterArgs) -> Result<()> {
    let s = quantize_drafter(&args.src, &args.dst, args.bits, args.group_size)?;
    println!(
        "{}: {} matrices quantized to {}-bit affine, groups of {}; {} left in float",
        s.format.name(),
        s.quantized.len(),
        args.bits,
        args.group_size,
        s.kept.len()
    );
    for (module, why) in &s.kept {
        println!("  float: {module} ({why})");
    }
    println!(
        "wrote {} ({:.1} MB; the source weights {:.1} MB){}",
        args.dst.join("model.safetensors").display(),
        s.bytes_after as f64 / 1e6,
        s.bytes_before as f64 / 1e6,
        if s.copied.is_empty() {
            String::new()
        } else {
            format!(" and copied {}", s.copied.join(", "))
        }
    );
    Ok(())
}

/// Quantizes the checkpoint folder `src` into the new folder `dst`.
pub fn quantize_drafter(src: &Path, dst: &Path, bits: i32, group_size: i32) -> Result<Summary> {
    if ![4, 8].contains(&bits) {
        bail!("--bits must be 4 or 8, got {bits}");
    }
    if ![32, 64].contains(&group_size) {
        bail!("--group-size must be 32 or 64, got {group_size}");
    }
    let config_path = src.join("config.json");
    let config_text = std::fs::read_to_string(&config_path).with_context(|| {
        format!(
            "cannot read {} (SRC must be a drafter checkpoint folder)",
            config_path.display()
        )
    })?;
    let config: Value = serde_json::from_str(&config_text)
        .with_context(|| format!("{} is not valid JSON", config_path.display()))?;
    if !config.is_object() {
        bail!("{} is not a JSON object", config_path.display());
    }
    let format = Format::detect(&config).with_context(|| {
        format!(
            "{}: not a drafter format quantize-drafter knows (model_type {}, architectures {}); it reads the Gemma 4 assistant (gemma4_assistant, gemma4_unified_assistant), a GLM MTP row (glm4_moe with mlx_spec_mtp), DeepSpec's Gemma4DSparkModel and z-lab's DFlashDraftModel",
            config_path.display(),
            config.get("model_type").unwrap_or(&Value::Null),
            config.get("architectures").unwrap_or(&Value::Null)
        )
    })?;
    for key in ["quantization", "quantization_config"] {
        if config.get(key).is_some() {
            bail!(
                "{}: already quantized (it has a `{key}` block); quantize the float checkpoint",
                config_path.display()
            );
        }
    }
    check_destination(dst)?;

    let checkpoint = Checkpoint::open_dir(src).map_err(anyhow::Error::msg)?;
    let names: Vec<String> = checkpoint.names().map(str::to_owned).collect();
    if let Some(packed) = names.iter().find(|n| n.ends_with(".scales")) {
        bail!(
            "tensor {packed} in {}: the checkpoint is already quantized; quantize the float checkpoint",
            checkpoint.file_of(packed)
        );
    }

    let mut out: BTreeMap<String, Array> = BTreeMap::new();
    let mut overrides = serde_json::Map::new();
    let (mut quantized, mut kept) = (Vec::new(), Vec::new());
    let mut bytes_before = 0u64;
    for name in &names {
        let a = checkpoint
            .tensor_any_shape(name)
            .map_err(anyhow::Error::msg)?;
        bytes_before += a.nbytes() as u64;
        let is_matrix = a.ndim() == 2 && is_float(a.dtype()) && name.ends_with(".weight");
        if !is_matrix {
            out.insert(name.clone(), a);
            continue;
        }
        let module = name.trim_end_matches(".weight").to_owned();
        let width = a.shape()[1];
        let why = format.keeps_float(&module).map(str::to_owned).or_else(|| {
            (width % group_size != 0)
                .then(|| format!("input width {width} does not split into groups of {group_size}"))
        });
        if let Some(why) = why {
            overrides.insert(module.clone(), Value::Bool(false));
            kept.push((module, why));
            out.insert(name.clone(), a);
            continue;
        }
        let (packed, scales, biases) = quantize(&a, group_size, bits)
            .with_context(|| format!("quantizing {name} of {}", checkpoint.file_of(name)))?;
        out.insert(name.clone(), packed);
        out.insert(format!("{module}.scales"), scales);
        out.insert(format!("{module}.biases"), biases);
        quantized.push(module);
    }
    if quantized.is_empty() {
        bail!(
            "{}: no matrix has an input width that splits into groups of {group_size}; nothing to quantize",
            checkpoint.file_of("")
        );
    }

    std::fs::create_dir_all(dst).with_context(|| format!("cannot create {}", dst.display()))?;
    let weights = dst.join("model.safetensors");
    let bytes_after = write_safetensors(&out, &weights)?;

    let mut block = serde_json::Map::new();
    block.insert("group_size".into(), Value::from(group_size));
    block.insert("bits".into(), Value::from(bits));
    block.insert("mode".into(), Value::from("affine"));
    block.extend(overrides);
    let config_out = with_quantization_block(&config_text, &Value::Object(block))
        .with_context(|| format!("{}: cannot add the block", config_path.display()))?;
    std::fs::write(dst.join("config.json"), config_out)
        .with_context(|| format!("cannot write {}", dst.join("config.json").display()))?;

    let mut copied = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(src)
        .with_context(|| format!("cannot list {}", src.display()))?
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("cannot list {}", src.display()))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let skip = file_name == "config.json"
            || file_name == "README.md"
            || file_name.ends_with(".safetensors")
            || file_name == "model.safetensors.index.json";
        if skip || !entry.path().is_file() {
            continue;
        }
        std::fs::copy(entry.path(), dst.join(&file_name)).with_context(|| {
            format!(
                "cannot copy {} to {}",
                entry.path().display(),
                dst.display()
            )
        })?;
        copied.push(file_name);
    }
    Ok(Summary {
        format,
        quantized,
        kept,
        bytes_before,
        bytes_after,
        copied,
    })
}

/// DST must not exist, or be an empty folder.
fn check_destination(dst: &Path) -> Result<()> {
    if !dst.exists() {
        return Ok(());
    }
    if !dst.is_dir() {
        bail!("{} exists and is not a folder", dst.display());
    }
    let mut entries =
        std::fs::read_dir(dst).with_context(|| format!("cannot list {}", dst.display()))?;
    if entries.next().is_some() {
        bail!(
            "{} exists and is not empty; give a new or empty folder",
            dst.display()
        );
    }
    Ok(())
}

/// The config text with `"quantization": block` added as its last key, the rest of the text
/// (key order, formatting) as it was.
fn with_quantization_block(text: &str, block: &Value) -> Result<String> {
    let end = text.rfind('}').context("no closing brace")?;
    let head = text[..end].trim_end();
    let separator = if head.ends_with('{') { "" } else { "," };
    let mut pretty = String::new();
    for (i, line) in serde_json::to_string_pretty(block)?.lines().enumerate() {
        if i > 0 {
            pretty.push_str("\n  ");
        }
        pretty.push_str(line);
    }
    let mut out = String::with_capacity(text.len() + pretty.len() + 32);
    write!(out, "{head}{separator}\n  \"quantization\": {pretty}\n}}\n")?;
    let check: Value = serde_json::from_str(&out)?;
    if check.get("quantization") != Some(block) {
        bail!("the written block does not read back");
    }
    Ok(out)
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

/// The little-endian bytes of an array and its safetensors dtype.
fn raw(name: &str, a: &Array) -> Result<(StDtype, Vec<u8>)> {
    a.eval().with_context(|| format!("computing {name}"))?;
    macro_rules! bytes {
        ($t:ty, $st:expr) => {
            (
                $st,
                a.try_as_slice::<$t>()
                    .with_context(|| format!("reading {name}"))?
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            )
        };
    }
    Ok(match a.dtype() {
        Dtype::Float32 => bytes!(f32, StDtype::F32),
        Dtype::Float16 => bytes!(half::f16, StDtype::F16),
        Dtype::Bfloat16 => bytes!(half::bf16, StDtype::BF16),
        Dtype::Float64 => bytes!(f64, StDtype::F64),
        Dtype::Uint8 => bytes!(u8, StDtype::U8),
        Dtype::Uint16 => bytes!(u16, StDtype::U16),
        Dtype::Uint32 => bytes!(u32, StDtype::U32),
        Dtype::Uint64 => bytes!(u64, StDtype::U64),
        Dtype::Int8 => bytes!(i8, StDtype::I8),
        Dtype::Int16 => bytes!(i16, StDtype::I16),
        Dtype::Int32 => bytes!(i32, StDtype::I32),
        Dtype::Int64 => bytes!(i64, StDtype::I64),
        Dtype::Bool => (
            StDtype::BOOL,
            a.try_as_slice::<bool>()
                .with_context(|| format!("reading {name}"))?
                .iter()
                .map(|&b| b as u8)
                .collect(),
        ),
        other => bail!("tensor {name}: dtype {other:?} cannot be written"),
    })
}

/// Writes the tensors as one safetensors file (names sorted, so the same input gives the same
/// bytes); returns the bytes of tensor data written.
fn write_safetensors(tensors: &BTreeMap<String, Array>, path: &Path) -> Result<u64> {
    let owned = tensors
        .iter()
        .map(|(name, a)| {
            let (dtype, bytes) = raw(name, a)?;
            let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
            Ok((name.clone(), dtype, shape, bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    let total = owned.iter().map(|t| t.3.len() as u64).sum();
    let views = owned
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .with_context(|| format!("tensor {name}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_owned(),
        "mlx".to_owned(),
    )]));
    safetensors::serialize_to_file(views, metadata, path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_recognised_from_the_config() {
        let json = |s: &str| serde_json::from_str::<Value>(s).unwrap();
        assert_eq!(
            Format::detect(&json(r#"{"model_type": "gemma4_unified_assistant"}"#)),
            Some(Format::Assistant)
        );
        assert_eq!(
            Format::detect(&json(
                r#"{"model_type": "glm4_moe", "mlx_spec_mtp": {"target_hidden_size": 8}}"#
            )),
            Some(Format::GlmMtp)
        );
        // A GLM model without the row's block is a target, not a drafter of ours.
        assert_eq!(Format::detect(&json(r#"{"model_type": "glm4_moe"}"#)), None);
        assert_eq!(
            Format::detect(&json(
                r#"{"model_type": "gemma4_text", "architectures": ["Gemma4DSparkModel"]}"#
            )),
            Some(Format::DeepSpec)
        );
        assert_eq!(
            Format::detect(&json(
                r#"{"model_type": "qwen3", "architectures": ["DFlashDraftModel"]}"#
            )),
            Some(Format::DFlash)
        );
        assert_eq!(
            Format::detect(&json(r#"{"model_type": "gemma4_text"}"#)),
            None
        );
    }

    #[test]
    fn the_block_is_added_without_reformatting() {
        let text = "{\n  \"b\": 1,\n  \"a\": [1,\n 2]\n}\n";
        let block = serde_json::json!({"group_size": 64, "bits": 8, "x.proj": false});
        let out = with_quantization_block(text, &block).unwrap();
        assert!(
            out.starts_with(
                "{\n  \"b\": 1,\n  \"a\": [1,\n 2],\n  \"quantization\": {\n    \"bits\": 8,"
            ),
            "{out}"
        );
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["quantization"], block);
        assert_eq!(v["b"], 1);
    }
}
