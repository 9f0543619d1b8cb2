//! Loading a target model with everything that comes with it, from one value of options.
//!
//! The command line, the deploy config and the lab all describe a load as a [`LoadOptions`];
//! [`load`] selects the device, reads the checkpoint (or builds seeded random weights of a
//! config's shapes), the tokenizer and the stop tokens, and fixes how the model's forwards run
//! on that device ([`RunSettings`]) once, at load.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use mlx_rs::Dtype;

use crate::device::{self, DeviceKind};
use crate::kernels::{CudaDecode, Fused};
use crate::model::gemma4::config::{Gemma4Config, QuantSpec};
use crate::model::gemma4::handoff::DEFAULT_GPU_HANDOFF_LAYERS;
use crate::model::gemma4::{DtypeChoice, Gemma4Model, RunSettings};
use crate::tokenizer::{stop_ids, Tokenizer};

/// Seeded random weights of a config's shapes, in place of a checkpoint's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomWeights {
    pub seed: u64,
    /// Quantize them (affine, mlx-community layout).
    pub quant: Option<QuantSpec>,
}

/// What to load and how it runs.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// A model folder (config.json + safetensors [+ tokenizer.json]); with `random_weights`,
    /// a config.json file or a folder holding one.
    pub path: PathBuf,
    pub device: DeviceKind,
    pub dtype: DtypeChoice,
    pub random_weights: Option<RandomWeights>,
    /// The fused CUDA kernels to use; they run only on a CUDA GPU.
    pub kernels: Fused,
    /// Layers a group when a verify window goes to the device (0: whole); `None`: the
    /// device's default.
    pub handoff_layers: Option<usize>,
}

impl LoadOptions {
    /// The defaults for the model at `path`: the CPU, the checkpoint's dtype, the default
    /// kernel set, the device's hand-off.
    pub fn new(path: impl Into<PathBuf>) -> LoadOptions {
        LoadOptions {
            path: path.into(),
            device: DeviceKind::Cpu,
            dtype: DtypeChoice::Auto,
            random_weights: None,
            kernels: Fused::every(),
            handoff_layers: None,
        }
    }
}

/// Quantized checkpoints up to this size on disk may be dequantized at load
/// ([`dequantize_here`]): their dense copy stays within a few GB (8× the file at most, 4-bit
/// weights in float32).
pub const DEQUANTIZE_MAX_BYTES: u64 = 256 << 20;

/// Whether a quantized checkpoint at `dir` loads dense, when it is small enough that its
/// dense copy fits easily:
/// - on the CPU, where MLX's quantized products are several times slower than its dense
///   ones (the 8-bit default model decoded 33 tokens/s quantized);
/// - on a GPU running the fused kernels, when some of its matrices have a bit width the
///   kernels do not read (they read dense and 4-bit weights): only the window kernels
///   compute a verify window as decode steps there, so without them every window would
///   verify a token at a time and no drafter could gain (the 8-bit default model).
fn dequantize_here(options: &LoadOptions, dir: &Path) -> Result<bool> {
    let config = Gemma4Config::from_dir(dir)?;
    let quant = &config.quantization;
    let specs: Vec<QuantSpec> = quant
        .default
        .iter()
        .chain(quant.overrides.values().flatten())
        .copied()
        .collect();
    let wanted = match options.device {
        DeviceKind::Cpu => !specs.is_empty(),
        DeviceKind::Gpu => uses_kernels(options) && specs.iter().any(|q| q.bits != 4),
    };
    if !wanted {
        return Ok(false);
    }
    let mut bytes = 0u64;
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            bytes += path.metadata()?.len();
        }
    }
    Ok(bytes <= DEQUANTIZE_MAX_BYTES)
}

/// A loaded model plus what came with it.
pub struct LoadedModel {
    pub model: Gemma4Model,
    /// `None` when the folder has no tokenizer.json (prompts then go in as ids).
    pub tokenizer: Option<Tokenizer>,
    /// Token ids that end a generation (config.json and generation_config.json).
    pub stop_ids: Vec<u32>,
    pub load_seconds: f64,
}

/// The config of `path` (a config.json file, or a folder holding one): the folder, the file
/// and the parsed config.
pub fn read_config(path: &Path) -> Result<(PathBuf, PathBuf, Gemma4Config)> {
    let (dir, config_path) = if path.is_file() {
        (
            path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            path.to_path_buf(),
        )
    } else {
        (path.to_path_buf(), path.join("config.json"))
    };
    let config = Gemma4Config::from_file(&config_path)?;
    Ok((dir, config_path, config))
}

/// Selects the device, loads the model as `options` say, and fixes how it runs there: its
/// [`RunSettings`] and, on a CUDA GPU, the fused kernels as its fast path.
/// A progress bar shows the weights' bytes on a terminal.
pub fn load(options: &LoadOptions) -> Result<LoadedModel> {
    device::select(options.device)?;
    let start = Instant::now();
    let path = &options.path;
    let (mut model, tokenizer, stop_ids) = match options.random_weights {
        Some(random) => {
            let (dir, config_path, config) = read_config(path)?;
            let dtype = match options.dtype {
                DtypeChoice::Fixed(d) => d,
                DtypeChoice::Auto => Dtype::Bfloat16,
            };
            tracing::info!(
                "building random weights for {} ({dtype:?}, quant {:?})",
                config_path.display(),
                random.quant
            );
            let stops = config.eos_token_ids.clone();
            let model = Gemma4Model::random(config, random.seed, dtype, random.quant)?;
            let tokenizer = Tokenizer::from_dir(&dir, model.config.bos_token_id)?;
            (model, tokenizer, stops)
        }
        None => {
            if !path.is_dir() {
                bail!(
                    "model folder {} does not exist (pass --model DIR)",
                    path.display()
                );
            }
            let bar = weights_progress_bar();
            let model = if dequantize_here(options, path)? {
                tracing::info!(
                    "dequantizing the weights once at load: {}",
                    match options.device {
                        DeviceKind::Cpu => "MLX's CPU quantized products are several times slower than its dense ones",
                        DeviceKind::Gpu => "the fused window kernels read dense and 4-bit weights, and only they verify a window as decode steps compute it",
                    }
                );
                Gemma4Model::load_dequantized(path, options.dtype, bar.clone())?
            } else {
                Gemma4Model::load(path, options.dtype, bar.clone())?
            };
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            let tokenizer = Tokenizer::from_dir(path, model.config.bos_token_id)?;
            if let Some(tok) = &tokenizer {
                if tok.vocab_size() > model.config.vocab_size {
                    tracing::warn!(
                        "tokenizer has {} tokens but the model only {}: ids past the model's vocabulary will be rejected",
                        tok.vocab_size(),
                        model.config.vocab_size
                    );
                }
            }
            let stops = stop_ids(path, &model.config.eos_token_ids)?;
            (model, tokenizer, stops)
        }
    };
    model.set_settings(settings_for(options));
    if uses_kernels(options) {
        let fast = CudaDecode::new(&model, options.kernels)?;
        model.set_fast_path(Some(Box::new(fast)));
    }
    tracing::info!(
        "loaded {} ({} layers, {:?}) in {:.2}s",
        path.display(),
        model.config.num_layers,
        model.dtype,
        start.elapsed().as_secs_f64()
    );
    Ok(LoadedModel {
        model,
        tokenizer,
        stop_ids,
        load_seconds: start.elapsed().as_secs_f64(),
    })
}

/// Whether a model loaded with `options` runs mlx-spec's fused kernels: where they can run (a
/// CUDA GPU: a Linux build on the GPU) and some are asked for.
fn uses_kernels(options: &LoadOptions) -> bool {
    options.device == DeviceKind::Gpu
        && cfg!(target_os = "linux")
        && options.kernels != Fused::default()
}

/// How a model loaded with `options` runs on its device: the hand-off asked for, else the
/// device's; and whether a verify window may run whole through MLX's operations (the CPU's
/// agree with decode steps; a GPU's do not, there only window kernels are trusted).
fn settings_for(options: &LoadOptions) -> RunSettings {
    let gpu = options.device == DeviceKind::Gpu;
    RunSettings {
        handoff_layers: options.handoff_layers.unwrap_or(if gpu {
            DEFAULT_GPU_HANDOFF_LAYERS
        } else {
            0
        }),
        operation_windows_match_steps: !gpu,
    }
}

/// A bar of the weights' bytes, on a terminal only (logs and pipes get none).
fn weights_progress_bar() -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading weights {bar:30} {bytes}/{total_bytes} {elapsed}")
            .expect("static template"),
    );
    Some(bar)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_run_only_on_a_gpu_and_hand_off_follows_the_device() {
        let mut options = LoadOptions::new("unused");
        options.kernels = Fused::every();
        assert!(!uses_kernels(&options), "no fused kernel on the CPU");
        assert_eq!(settings_for(&options).handoff_layers, 0);
        options.device = DeviceKind::Gpu;
        assert_eq!(
            settings_for(&options).handoff_layers,
            DEFAULT_GPU_HANDOFF_LAYERS
        );
        // Metal has no CUDA kernels.
        assert_eq!(uses_kernels(&options), cfg!(target_os = "linux"));
        options.kernels = Fused::default();
        assert!(!uses_kernels(&options), "none asked for");
        options.handoff_layers = Some(0);
        assert_eq!(settings_for(&options).handoff_layers, 0);
    }

    /// The CPU trusts a window run whole through MLX's operations; a GPU does not (there
    /// only window kernels verify a window as decode steps compute it).
    #[test]
    fn only_the_cpu_trusts_windows_through_mlx_operations() {
        let mut options = LoadOptions::new("unused");
        assert!(settings_for(&options).operation_windows_match_steps);
        options.device = DeviceKind::Gpu;
        assert!(!settings_for(&options).operation_windows_match_steps);
    }

    /// Small quantized checkpoints load dense on the CPU, and on a GPU running the fused
    /// kernels when a bit width is one the kernels do not read (8-bit), never for 4-bit ones
    /// there, nor without the kernels.
    #[test]
    fn small_checkpoints_load_dense_where_their_quantized_form_would_cost_or_block_drafting() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let eight_bit = root.join(crate::DEFAULT_MODEL_DIR);
        let text = std::fs::read_to_string(eight_bit.join("config.json")).unwrap();
        assert!(text.contains("\"bits\": 8"), "the default model is 8-bit");
        let four_bit = tempfile::tempdir().unwrap();
        std::fs::write(
            four_bit.path().join("config.json"),
            text.replace("\"bits\": 8", "\"bits\": 4"),
        )
        .unwrap();

        let mut options = LoadOptions::new("unused");
        assert!(dequantize_here(&options, &eight_bit).unwrap(), "CPU, 8-bit");
        assert!(
            dequantize_here(&options, four_bit.path()).unwrap(),
            "CPU, 4-bit"
        );
        options.device = DeviceKind::Gpu;
        options.kernels = Fused::every();
        // The kernels run on a Linux build only (Metal has none).
        let kernels = cfg!(target_os = "linux");
        assert_eq!(dequantize_here(&options, &eight_bit).unwrap(), kernels);
        assert!(
            !dequantize_here(&options, four_bit.path()).unwrap(),
            "the kernels read 4-bit"
        );
        options.kernels = Fused::default();
        assert!(
            !dequantize_here(&options, &eight_bit).unwrap(),
            "no kernels asked for"
        );
    }
}
