//! The command-line vocabulary `mlx-spec` and the developer lab (`mlx-spec-lab`) share: how a
//! model is chosen and loaded, random weights of a config's shapes, a drafter and its
//! settings, and the options of a speed measurement. Each becomes a value (a [`LoadOptions`],
//! a [`SpecOptions`](crate::speculative::SpecOptions)) before any work starts.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use mlx_rs::Dtype;

use crate::device::DeviceKind;
use crate::load::{LoadOptions, LoadedModel, RandomWeights};
use crate::model::gemma4::config::QuantSpec;
use crate::model::gemma4::DtypeChoice;

#[derive(Args)]
pub struct SpecArgs {
    /// Speculate with this drafter plugin (by its manifest name).
    #[arg(long)]
    pub drafter: Option<String>,
    /// Directory holding drafter plugin folders (repeatable).
    #[arg(long = "plugins-dir", value_name = "DIR", default_values_os_t = vec![crate::default_plugins_dir()])]
    pub plugins_dirs: Vec<PathBuf>,
    /// Most tokens drafted per round (default: the drafter's `num_draft_tokens`, else 10).
    #[arg(long, requires = "drafter")]
    pub num_draft_tokens: Option<usize>,
    /// Override a setting of the drafter's manifest [defaults] (TOML value; repeatable).
    #[arg(long = "drafter-set", value_name = "KEY=VALUE", requires = "drafter")]
    pub drafter_set: Vec<String>,
    /// Keep drafting even when acceptance stays near zero.
    #[arg(long, requires = "drafter")]
    pub no_auto_off: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    Auto,
    F32,
    Bf16,
    F16,
}

impl DtypeArg {
    pub fn choice(self) -> DtypeChoice {
        match self {
            DtypeArg::Auto => DtypeChoice::Auto,
            DtypeArg::F32 => DtypeChoice::Fixed(Dtype::Float32),
            DtypeArg::Bf16 => DtypeChoice::Fixed(Dtype::Bfloat16),
            DtypeArg::F16 => DtypeChoice::Fixed(Dtype::Float16),
        }
    }
}

#[derive(Args)]
pub struct ModelArgs {
    /// Model folder (config.json + safetensors [+ tokenizer.json]).
    #[arg(long, env = "MLX_SPEC_MODEL", value_name = "PATH", default_value_os_t = crate::default_model_path())]
    pub model: PathBuf,
    /// Device: `gpu` needs a GPU build of libmlx (CUDA on Linux, Metal on macOS).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Compute dtype (`auto`: the checkpoint's).
    #[arg(long, value_enum, default_value = "auto")]
    pub dtype: DtypeArg,
    /// mlx-spec's fused CUDA kernels on a CUDA GPU, or `none` for MLX's operations alone.
    #[arg(long, value_enum, default_value = "default")]
    pub fused_kernels: FusedKernelsArg,
    /// Layers a group when a verify window goes to the device (0: whole; default 3 on a GPU).
    #[arg(long, value_name = "N", hide = true)]
    pub handoff_layers: Option<usize>,
}

/// Seeded random weights of a config's shapes, for measuring released sizes without their
/// checkpoints.
#[derive(Args)]
pub struct RandomArgs {
    /// Ignore the checkpoint: seeded random weights of the --model config's shapes.
    #[arg(long)]
    pub random_weights: bool,
    /// Seed of --random-weights.
    #[arg(long, default_value_t = 0, requires = "random_weights")]
    pub weights_seed: u64,
    /// Quantize --random-weights to this many bits (affine, mlx-community layout).
    #[arg(long, value_parser = ["4", "8"], requires = "random_weights")]
    pub random_bits: Option<String>,
    /// Group size of --random-bits.
    #[arg(long, default_value_t = 64, requires = "random_bits")]
    pub random_group_size: i32,
}

impl RandomArgs {
    pub fn none() -> RandomArgs {
        RandomArgs {
            random_weights: false,
            weights_seed: 0,
            random_bits: None,
            random_group_size: 64,
        }
    }
}

/// `--fused-kernels`: the default set (also that of config-driven runs, `mlx-spec run`) or
/// none.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum FusedKernelsArg {
    Default,
    None,
}

impl ModelArgs {
    pub fn fused(&self) -> crate::kernels::Fused {
        match self.fused_kernels {
            FusedKernelsArg::Default => crate::kernels::Fused::every(),
            FusedKernelsArg::None => crate::kernels::Fused::default(),
        }
    }

    /// The kernels `--fused-kernels` allows where they can run (a CUDA GPU), none elsewhere:
    /// for the lab's measurements outside a model.
    pub fn fused_here(&self) -> crate::kernels::Fused {
        if crate::kernels::on_cuda_gpu() {
            self.fused()
        } else {
            crate::kernels::Fused::default()
        }
    }
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub random: RandomArgs,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated in the decode measurement.
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Measured repetitions (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// With --drafter: measure speculative against plain decoding side by side.
    #[command(flatten)]
    pub spec: SpecArgs,
    /// With --drafter: the prompt, from a text file (default: synthetic ids).
    #[arg(long, value_name = "FILE", requires = "drafter")]
    pub prompt_file: Option<PathBuf>,
    /// With --prompt-file: wrap the text as a chat turn.
    #[arg(long, requires = "prompt_file")]
    pub chat: bool,
    /// With --drafter: a JSONL prompt set of chat turns (e.g. bench/prompts/code_edit.jsonl).
    #[arg(
        long,
        value_name = "FILE",
        requires = "drafter",
        conflicts_with = "prompt_file"
    )]
    pub prompt_set: Option<PathBuf>,
    /// Also time one forward over k = 1 ... 32 tokens: the verify cost curve.
    #[arg(long, conflicts_with = "drafter")]
    pub verify_curve: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

impl ModelArgs {
    /// The load these flags describe.
    pub fn load_options(&self, random: &RandomArgs) -> Result<LoadOptions> {
        let random_weights = if random.random_weights {
            Some(RandomWeights {
                seed: random.weights_seed,
                quant: match &random.random_bits {
                    Some(bits) => Some(QuantSpec {
                        bits: bits.parse()?,
                        group_size: random.random_group_size,
                    }),
                    None => None,
                },
            })
        } else {
            None
        };
        Ok(LoadOptions {
            path: self.model.clone(),
            device: self.device,
            dtype: self.dtype.choice(),
            random_weights,
            kernels: self.fused(),
            handoff_layers: self.handoff_layers,
        })
    }
}

/// Loads the model `args` describe (the library's [`crate::load::load`]).
pub fn load_model(args: &ModelArgs, random: &RandomArgs) -> Result<LoadedModel> {
    crate::load::load(&args.load_options(random)?)
}

/// Parses `KEY=VALUE` pairs, each VALUE a TOML value (bare words are taken as strings).
pub fn parse_overrides(pairs: &[String]) -> Result<toml::Table> {
    let mut table = toml::Table::new();
    for pair in pairs {
        let (key, value) = pair
            .split_once('=')
            .with_context(|| format!("--drafter-set {pair:?}: expected KEY=VALUE"))?;
        let parsed: toml::Table = toml::from_str(&format!("v = {value}")).unwrap_or_else(|_| {
            toml::Table::from_iter([("v".to_owned(), toml::Value::String(value.to_owned()))])
        });
        table.insert(key.trim().to_owned(), parsed["v"].clone());
    }
    Ok(table)
}
