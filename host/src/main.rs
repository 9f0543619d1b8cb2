//! The `mlx-spec` command line: argument parsing and output only; the work lives in the library.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mlx_rs::Dtype;
use serde_json::json;

use mlx_spec::deploy::DeployConfig;
use mlx_spec::device::{self, DeviceKind};
use mlx_spec::generate::{generate, greedy_step, greedy_token, prefill, GenerateRequest};
use mlx_spec::model::gemma4::config::{Gemma4Config, QuantSpec};
use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model, LogitsFor};
use mlx_spec::plugins::{self, instantiate, read_manifest, Registry};
use mlx_spec::sampler::SamplingParams;
use mlx_spec::spec::{generate_speculative, SpecOptions};
use mlx_spec::tokenizer::{stop_ids, ChatMessage, StreamDecoder, Tokenizer};

#[derive(Parser)]
#[command(
    name = "mlx-spec",
    version,
    about = "Speculative decoding host for Gemma 4 on MLX",
    long_about = "Runs a Gemma 4 text decoder on MLX (CPU, CUDA or Metal) and generates text.\n\
                  Logs go to stderr (-v for more, or RUST_LOG); results go to stdout."
)]
struct Cli {
    /// More logging on stderr (-v info, -vv debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Generate as a deploy config (TOML) says: model, device, plugins, drafter, sampling.
    Run(RunArgs),
    /// Measure prefill and decode speed (tokens/s) of a model.
    Bench(BenchArgs),
    /// Inspect drafter plugins.
    #[command(subcommand)]
    Plugins(PluginsCommand),
}

#[derive(Subcommand)]
enum PluginsCommand {
    /// List the plugins of some directories with their status.
    List {
        /// Directory holding plugin folders (repeatable).
        #[arg(long = "plugins-dir", value_name = "DIR", required = true)]
        plugins_dirs: Vec<PathBuf>,
    },
    /// Check one plugin: a plugin.toml, or a folder holding one. Prints OK or why not.
    Check { path: PathBuf },
}

#[derive(Args)]
struct SpecArgs {
    /// Speculate with this drafter plugin (by its manifest name).
    #[arg(long)]
    drafter: Option<String>,
    /// Directory holding drafter plugin folders (repeatable).
    #[arg(long = "plugins-dir", value_name = "DIR", default_value = "plugins")]
    plugins_dirs: Vec<PathBuf>,
    /// Most tokens drafted per round (default: the drafter's `num_draft_tokens`, else 10).
    #[arg(long, requires = "drafter")]
    num_draft_tokens: Option<usize>,
    /// Override a drafter setting of the manifest's [defaults] (KEY=VALUE, TOML value; repeatable).
    #[arg(long = "drafter-set", value_name = "KEY=VALUE", requires = "drafter")]
    drafter_set: Vec<String>,
    /// Keep drafting even when acceptance stays near zero.
    #[arg(long, requires = "drafter")]
    no_auto_off: bool,
}

#[derive(Args)]
struct RunArgs {
    /// The deploy config.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    #[command(flatten)]
    input: PromptArgs,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    /// The checkpoint's own float dtype.
    Auto,
    F32,
    Bf16,
    F16,
}

impl DtypeArg {
    fn choice(self) -> DtypeChoice {
        match self {
            DtypeArg::Auto => DtypeChoice::Auto,
            DtypeArg::F32 => DtypeChoice::Fixed(Dtype::Float32),
            DtypeArg::Bf16 => DtypeChoice::Fixed(Dtype::Bfloat16),
            DtypeArg::F16 => DtypeChoice::Fixed(Dtype::Float16),
        }
    }
}

#[derive(Args)]
struct ModelArgs {
    /// Model folder (config.json + safetensors [+ tokenizer.json]); default: the small code
    /// model shipped in the repo. With --random-weights, a config.json file or a folder
    /// holding one.
    #[arg(long, env = "MLX_SPEC_MODEL", value_name = "PATH", default_value_os_t = mlx_spec::default_model_path())]
    model: PathBuf,
    /// Device to run on. `gpu` needs a GPU build of libmlx (CUDA on Linux, Metal on macOS).
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceKind,
    /// Compute dtype.
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DtypeArg,
    /// Ignore the checkpoint's weights: build the config's shapes with seeded random weights.
    #[arg(long)]
    random_weights: bool,
    /// Seed of --random-weights.
    #[arg(long, default_value_t = 0, requires = "random_weights")]
    weights_seed: u64,
    /// Quantize --random-weights to this many bits (affine, mlx-community layout).
    #[arg(long, value_parser = ["4", "8"], requires = "random_weights")]
    random_bits: Option<String>,
    /// Group size of --random-bits.
    #[arg(long, default_value_t = 64, requires = "random_bits")]
    random_group_size: i32,
    /// mlx-spec's own CUDA kernels to use on a CUDA GPU (elsewhere MLX's operations run):
    /// `attention` (one decode token's attention and its q/k/v norms and RoPE), `products`
    /// (a decode token's matrix-vector products fused with the norms, gates and residual
    /// updates around them), `post-attention` (everything of a layer after its attention heads
    /// as one kernel, over dense weights), `affine4` (that kernel over 4-bit affine weights),
    /// `affine4-heads` and `affine4-products` (the q/k/v products of `attention` and the
    /// products of `products` over 4-bit weights too), `output-head` (the final norm, the
    /// output head's product and the logit soft-cap as one kernel), `per-layer-input` (a
    /// layer's per-layer-input block as one kernel), or `none` (MLX's operations only).
    /// Default: the fastest measured on an H200 for each kind of weight:
    /// `attention,products,affine4-heads,affine4-products,output-head`.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = DEFAULT_FUSED_KERNELS
    )]
    fused_kernels: Vec<FusedKernelArg>,
    /// Variants of the fused kernels that are being measured (BENCHMARKS.md), none by default:
    /// `narrow-attention-rounds` (decode attention four slots a warp at a time, as first
    /// written), `heads-finished-apart` (each attention head normed, rotated and cached by the
    /// last block that made its rows), `integer-dots` (4-bit feed-forward products by int16
    /// inputs and dp2a; half-precision inputs only), `rows-touched-first` (the product
    /// kernels ask for their first weight lines before staging their input),
    /// `step-ints-on-device` (the step's position, cache slots and visible ranges copied to
    /// device memory by an operation each, instead of read across the bus).
    #[arg(long, value_enum, value_delimiter = ',')]
    kernel_variants: Vec<KernelVariantArg>,
}

/// `--fused-kernels`' default, also that of config-driven runs (`mlx-spec run`).
const DEFAULT_FUSED_KERNELS: &str = "attention,products,affine4-heads,affine4-products,output-head";

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum KernelVariantArg {
    NarrowAttentionRounds,
    HeadsFinishedApart,
    IntegerDots,
    RowsTouchedFirst,
    StepIntsOnDevice,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FusedKernelArg {
    Attention,
    Products,
    /// Everything of a layer after its attention heads as one kernel, over dense weights.
    PostAttention,
    /// Everything of a layer after its attention heads as one kernel, over 4-bit weights.
    Affine4,
    /// The attention-heads kernel over 4-bit projection weights.
    Affine4Heads,
    /// The product kernels over 4-bit weights.
    Affine4Products,
    /// The final norm, the output head and the soft-cap of a decode token as one kernel.
    OutputHead,
    /// A layer's per-layer-input block (gate and projection) as one kernel (its grid-wide
    /// barrier needs all its blocks resident: not for a GPU shared with other processes).
    PerLayerInput,
    None,
}

/// [`DEFAULT_FUSED_KERNELS`] as values.
fn default_fused_kernels() -> Vec<FusedKernelArg> {
    DEFAULT_FUSED_KERNELS
        .split(',')
        .filter_map(|name| FusedKernelArg::from_str(name, false).ok())
        .collect()
}

impl ModelArgs {
    fn fused(&self) -> mlx_spec::kernels::Fused {
        mlx_spec::kernels::Fused {
            attention: self.fused_kernels.contains(&FusedKernelArg::Attention),
            products: self.fused_kernels.contains(&FusedKernelArg::Products),
            post_attention: self.fused_kernels.contains(&FusedKernelArg::PostAttention),
            affine4: self.fused_kernels.contains(&FusedKernelArg::Affine4),
            affine4_heads: self.fused_kernels.contains(&FusedKernelArg::Affine4Heads),
            affine4_products: self
                .fused_kernels
                .contains(&FusedKernelArg::Affine4Products),
            output_head: self.fused_kernels.contains(&FusedKernelArg::OutputHead),
            per_layer_input: self.fused_kernels.contains(&FusedKernelArg::PerLayerInput),
        }
    }

    /// Puts `--fused-kernels` in force for the rest of the process.
    /// Puts `--fused-kernels` and `--kernel-variants` in force for the process.
    fn allow_fused_kernels(&self) {
        mlx_spec::kernels::set_allowed(self.fused());
        let variants = &self.kernel_variants;
        let tuning = mlx_spec::kernels::Tuning {
            attention_wide_rounds: !variants.contains(&KernelVariantArg::NarrowAttentionRounds),
            heads_finished_apart: variants.contains(&KernelVariantArg::HeadsFinishedApart),
            affine4_integer_dots: variants.contains(&KernelVariantArg::IntegerDots),
            rows_touched_first: variants.contains(&KernelVariantArg::RowsTouchedFirst),
            step_ints_on_device: variants.contains(&KernelVariantArg::StepIntsOnDevice),
            ..mlx_spec::kernels::Tuning::current()
        };
        // Only the row count per warp and the loads in flight can be refused, and these keep
        // their current, valid values.
        if let Err(e) = tuning.apply() {
            tracing::warn!("kernel variants not applied: {e}");
        }
    }
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "chat", "prompt_ids"])))]
struct PromptArgs {
    /// Plain completion prompt (BOS is added).
    #[arg(long)]
    prompt: Option<String>,
    /// A user message, wrapped in Gemma 4's chat turn format.
    #[arg(long)]
    chat: Option<String>,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Prompt as comma-separated token ids (for models without a tokenizer).
    #[arg(long, value_delimiter = ',', value_name = "ID,ID,...")]
    prompt_ids: Option<Vec<u32>>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: PromptArgs,
    #[command(flatten)]
    spec: SpecArgs,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens below this fraction of the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Sampling seed: the same seed, prompt and settings give the same output.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating through end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object {"tokens", "text", "stats"} instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens generated in the decode measurement.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Measured repetitions (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// With --drafter: measure speculative against plain decoding side by side.
    #[command(flatten)]
    spec: SpecArgs,
    /// With --drafter: the prompt, from a text file (default: synthetic ids).
    #[arg(long, value_name = "FILE", requires = "drafter")]
    prompt_file: Option<PathBuf>,
    /// With --prompt-file: wrap the text as a chat turn.
    #[arg(long, requires = "prompt_file")]
    chat: bool,
    /// With --drafter: a JSONL prompt set (one object per line with `messages`: chat turns of
    /// `role`/`content`), e.g. bench/prompts/code_edit.jsonl; results are summed over it.
    #[arg(
        long,
        value_name = "FILE",
        requires = "drafter",
        conflicts_with = "prompt_file"
    )]
    prompt_set: Option<PathBuf>,
    /// Also time one target forward over k = 1, 2, 4, 8, 16, 32 tokens after the prompt (the
    /// verify cost curve: how many drafted tokens a verify window absorbs nearly for free).
    #[arg(long, conflicts_with = "drafter")]
    verify_curve: bool,
    /// Also compare pipelined decode with each set of fused CUDA kernels (none, attention,
    /// products, both, with post-attention; on a 4-bit model, each set of 4-bit kernels) and
    /// variants (decode attention in 32-slot shares, the post-attention kernel with row pairs,
    /// 4-bit values unpacked in place), alternating between them round by round in this
    /// process; fails if the post-attention kernel changes the greedy tokens of its twin.
    #[arg(long)]
    compare_fused: bool,
    /// Also decode this many greedy tokens after a 16-token prompt on the chosen device and on
    /// the CPU, with the same weights in one process, and fail unless the tokens agree (use
    /// `--dtype f32`, and `MLX_ENABLE_TF32=0` on CUDA).
    #[arg(long, value_name = "N", conflicts_with = "drafter")]
    check_cpu: Option<usize>,
    /// Write the graph of one decode step (after the prompt) to this file in Graphviz DOT
    /// format and print its operations by kind: on a GPU a step costs roughly a fixed host
    /// time per operation.
    #[arg(long, value_name = "PATH", conflicts_with = "drafter")]
    dump_step_graph: Option<PathBuf>,
    /// Instead of a model: the host time one operation of each kind costs (MLX's addition,
    /// RMSNorm and matrix product, and on a CUDA GPU each fused product kernel), from chains
    /// of 400 operations on a 1024-wide bf16 vector. Says which operations to fuse next.
    #[arg(long, conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph"])]
    op_cost: bool,
    /// Instead of decoding: how fast a decode token's feed-forward block streams its weights
    /// (GB/s), with MLX's operations and, on a CUDA GPU, with the fused product kernels at
    /// each row count per warp; then the attention output product and the feed-forward block
    /// as three fused products and as one post-attention kernel (with `--fused-kernels
    /// ...,post-attention`); shapes from the --model config, 16 layers of bf16 weights.
    #[arg(long, conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph", "op_cost"])]
    feed_forward_speed: bool,
    /// Instead of a model: check fused CUDA kernels on random bf16 data. Decode attention
    /// against MLX's operations in float32 (heads of 256 and 512, buffers of 40 to 4 096 slots,
    /// a warp's whole share of slots at once and four at a time; fails beyond 1e-2); the
    /// feed-forward products over 4-bit rows with integer dots against float unpacking (fails
    /// beyond 1/64 of the largest output).
    #[arg(long, conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph", "op_cost", "feed_forward_speed"])]
    check_kernels: bool,
    /// Also decode greedily this many times from fresh caches and report whether the logits
    /// repeat bit for bit: the prefill's last logits, each step-by-step step fed the first
    /// run's tokens, and the tokens of pipelined runs. Tells a non-deterministic operation
    /// from a pipelining fault when pipelined and step-by-step decoding disagree.
    #[arg(long, value_name = "RUNS", conflicts_with = "drafter")]
    repeatability: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn init_logging(verbose: u8) {
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

/// A loaded model plus what came with it.
struct Loaded {
    model: Gemma4Model,
    tokenizer: Option<Tokenizer>,
    stop_ids: Vec<u32>,
    load_seconds: f64,
}

/// The config of `path` (a config.json file, or a folder holding one): the folder, the
/// file and the parsed config.
fn read_config(path: &Path) -> Result<(PathBuf, PathBuf, Gemma4Config)> {
    let (dir, config_path) = if path.is_file() {
        (
            path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            path.to_path_buf(),
        )
    } else {
        (path.to_path_buf(), path.join("config.json"))
    };
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("cannot read {}", config_path.display()))?;
    let raw: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", config_path.display()))?;
    let config = Gemma4Config::from_json(&raw)
        .with_context(|| format!("invalid config {}", config_path.display()))?;
    Ok((dir, config_path, config))
}

fn load_model(args: &ModelArgs) -> Result<Loaded> {
    device::select(args.device)?;
    args.allow_fused_kernels();
    let start = Instant::now();
    let path = &args.model;
    if args.random_weights {
        let (dir, config_path, config) = read_config(path)?;
        let dtype = match args.dtype.choice() {
            DtypeChoice::Fixed(d) => d,
            DtypeChoice::Auto => Dtype::Bfloat16,
        };
        let quant = match &args.random_bits {
            Some(bits) => Some(QuantSpec {
                bits: bits.parse()?,
                group_size: args.random_group_size,
            }),
            None => None,
        };
        tracing::info!(
            "building random weights for {} ({dtype:?}, quant {quant:?})",
            config_path.display()
        );
        let stops = config.eos_token_ids.clone();
        let model = Gemma4Model::random(config, args.weights_seed, dtype, quant)?;
        return Ok(Loaded {
            tokenizer: Tokenizer::from_dir(&dir, model.config.bos_token_id)?,
            model,
            stop_ids: stops,
            load_seconds: start.elapsed().as_secs_f64(),
        });
    }

    if !path.is_dir() {
        bail!(
            "model folder {} does not exist (pass --model DIR)",
            path.display()
        );
    }
    let bar = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "loading weights {bar:30} {bytes}/{total_bytes} {elapsed}",
            )
            .expect("static template"),
        );
        Some(bar)
    } else {
        None
    };
    let model = Gemma4Model::load(path, args.dtype.choice(), bar.clone())?;
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
    let stop_ids = stop_ids(path, &model.config.eos_token_ids)?;
    tracing::info!(
        "loaded {} ({} layers, {:?}) in {:.2}s",
        path.display(),
        model.config.num_layers,
        model.dtype,
        start.elapsed().as_secs_f64()
    );
    Ok(Loaded {
        model,
        tokenizer,
        stop_ids,
        load_seconds: start.elapsed().as_secs_f64(),
    })
}

/// Which drafter to use and how.
struct DrafterChoice {
    name: String,
    plugins_dirs: Vec<PathBuf>,
    num_draft_tokens: Option<usize>,
    overrides: toml::Table,
    auto_off: bool,
}

/// Everything one generation needs, from flags or from a deploy config.
struct Job<'a> {
    model: ModelArgs,
    input: &'a PromptArgs,
    max_tokens: usize,
    sampling: SamplingParams,
    ignore_eos: bool,
    drafter: Option<DrafterChoice>,
    json: bool,
}

/// Parses `KEY=VALUE` pairs, each VALUE a TOML value (bare words are taken as strings).
fn parse_overrides(pairs: &[String]) -> Result<toml::Table> {
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

fn prompt_ids(input: &PromptArgs, tok: Option<&Tokenizer>, model_path: &Path) -> Result<Vec<u32>> {
    let need_tokenizer = || {
        tok.with_context(|| {
            format!("{} has no tokenizer.json, so --prompt/--chat cannot be tokenized; pass --prompt-ids", model_path.display())
        })
    };
    if let Some(ids) = &input.prompt_ids {
        Ok(ids.clone())
    } else if let Some(text) = &input.chat {
        let mut messages = Vec::new();
        if let Some(system) = &input.system {
            messages.push(ChatMessage {
                role: "system".into(),
                content: system.clone(),
            });
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: text.clone(),
        });
        need_tokenizer()?.encode_chat(&messages)
    } else {
        need_tokenizer()?.encode_prompt(input.prompt.as_deref().unwrap_or_default())
    }
}

fn run_job(job: Job) -> Result<()> {
    job.sampling.validate()?;
    // Plugins are checked before the (slow) model load, so a wrong name fails fast.
    let provider = match &job.drafter {
        Some(choice) => {
            let registry = Registry::scan(&choice.plugins_dirs)?;
            let (manifest, module) = registry.get(&choice.name)?;
            let k = choice
                .num_draft_tokens
                .or_else(|| {
                    manifest
                        .defaults
                        .get("num_draft_tokens")
                        .and_then(|v| v.as_integer())
                        .map(|v| v as usize)
                })
                .unwrap_or(10);
            if k == 0 || k > 64 {
                bail!("--num-draft-tokens must be between 1 and 64, got {k}");
            }
            Some((instantiate(manifest, module, &choice.overrides)?, k))
        }
        None => None,
    };

    let loaded = load_model(&job.model)?;
    let tok = loaded.tokenizer.as_ref();
    let request = GenerateRequest {
        prompt_ids: prompt_ids(job.input, tok, &job.model.model)?,
        max_tokens: job.max_tokens,
        sampling: job.sampling,
        stop_ids: loaded.stop_ids.clone(),
        ignore_eos: job.ignore_eos,
    };

    let mut stdout = std::io::stdout().lock();
    let mut stream = StreamDecoder::new();
    let json = job.json;
    let mut print = |id: u32| -> Result<()> {
        if json {
            return Ok(());
        }
        match tok {
            Some(t) => write!(stdout, "{}", stream.push(t, id)?)?,
            None => write!(stdout, "{id} ")?,
        }
        stdout.flush()?;
        Ok(())
    };
    let (tokens, stats, spec) = match &provider {
        Some((provider, k)) => {
            let options = SpecOptions {
                num_draft_tokens: *k,
                auto_off: job.drafter.as_ref().is_some_and(|d| d.auto_off),
            };
            let (t, s, spec) =
                generate_speculative(&loaded.model, &request, Some(provider), options, &mut print)?;
            (t, s, Some(spec))
        }
        None => {
            let (t, s) = generate(&loaded.model, &request, &mut print)?;
            (t, s, None)
        }
    };

    let text = match tok {
        Some(t) => t.decode(&tokens)?,
        None => String::new(),
    };
    if json {
        let mut stats_json = json!({
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "prefill_tokens_per_s": stats.prefill_tokens_per_s,
            "decode_tokens_per_s": stats.decode_tokens_per_s,
            "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds,
            "load_seconds": loaded.load_seconds,
            "stop_reason": stats.stop_reason,
            "stop_token": stats.stop_token,
            "device": job.model.device,
            "dtype": format!("{:?}", loaded.model.dtype),
        });
        if let (Some(spec), Some(choice)) = (&spec, &job.drafter) {
            let extra = serde_json::to_value(spec)?;
            let obj = stats_json.as_object_mut().expect("object");
            obj.insert("drafter".into(), json!(choice.name));
            for (k, v) in extra.as_object().expect("object") {
                obj.insert(k.clone(), v.clone());
            }
        }
        writeln!(
            stdout,
            "{}",
            json!({"tokens": tokens, "text": text, "stats": stats_json})
        )?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "prompt: {} tokens, {:.1} tokens/s | generation: {} tokens, {:.1} tokens/s",
            stats.prompt_tokens,
            stats.prefill_tokens_per_s,
            stats.generated_tokens,
            stats.decode_tokens_per_s
        );
        if let Some(spec) = &spec {
            eprintln!(
                "speculation: {} drafts, {} drafted, {} accepted, mean acceptance length {:.2}{}",
                spec.num_drafts,
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
                spec.mean_acceptance_length,
                spec.drafter_error
                    .as_ref()
                    .map(|e| format!(" (drafter switched off: {e})"))
                    .unwrap_or_default()
            );
        }
    }
    Ok(())
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    let drafter = match &args.spec.drafter {
        Some(name) => Some(DrafterChoice {
            name: name.clone(),
            plugins_dirs: args.spec.plugins_dirs.clone(),
            num_draft_tokens: args.spec.num_draft_tokens,
            overrides: parse_overrides(&args.spec.drafter_set)?,
            auto_off: !args.spec.no_auto_off,
        }),
        None => None,
    };
    run_job(Job {
        model: args.model,
        input: &args.input,
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            seed: args.seed,
        },
        ignore_eos: args.ignore_eos,
        drafter,
        json: args.json,
    })
}

fn run_deploy(args: RunArgs) -> Result<()> {
    let cfg = DeployConfig::load(&args.config)?;
    let dtype = match cfg.model.dtype.as_str() {
        "f32" => DtypeArg::F32,
        "bf16" => DtypeArg::Bf16,
        "f16" => DtypeArg::F16,
        _ => DtypeArg::Auto,
    };
    let s = &cfg.sampling;
    run_job(Job {
        model: ModelArgs {
            model: cfg
                .model
                .path
                .clone()
                .unwrap_or_else(mlx_spec::default_model_path),
            device: cfg.model.device,
            dtype,
            random_weights: false,
            weights_seed: 0,
            random_bits: None,
            random_group_size: 64,
            fused_kernels: default_fused_kernels(),
            kernel_variants: Vec::new(),
        },
        input: &args.input,
        max_tokens: s.max_tokens,
        sampling: SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            seed: s.seed,
        },
        ignore_eos: false,
        drafter: cfg.drafter.as_ref().map(|d| DrafterChoice {
            name: d.name.clone(),
            plugins_dirs: cfg.plugins.dirs.clone(),
            num_draft_tokens: d.num_draft_tokens,
            overrides: d.config.clone(),
            auto_off: d.auto_off,
        }),
        json: args.json,
    })
}

fn run_plugins(cmd: PluginsCommand) -> Result<()> {
    match cmd {
        PluginsCommand::List { plugins_dirs } => {
            let registry = Registry::scan(&plugins_dirs)?;
            if registry.plugins.is_empty() {
                println!("no plugins found");
            }
            for p in &registry.plugins {
                let (version, kind) = match &p.manifest {
                    Some(m) => (m.plugin.version.as_str(), m.plugin.kind.as_str()),
                    None => ("?", "?"),
                };
                let status = match &p.status {
                    Ok(_) => "ok".to_owned(),
                    Err(e) => format!("unusable: {e}"),
                };
                println!("{:<16} {:<10} {:<12} {}", p.name(), version, kind, status);
            }
            Ok(())
        }
        PluginsCommand::Check { path } => {
            let manifest_path = if path.is_dir() {
                path.join("plugin.toml")
            } else {
                path.clone()
            };
            let manifest = read_manifest(&manifest_path).map_err(anyhow::Error::msg)?;
            plugins::load(&manifest_path, &manifest).map_err(anyhow::Error::msg)?;
            println!(
                "OK {} {} ({})",
                manifest.plugin.name,
                manifest.plugin.version,
                manifest_path.display()
            );
            Ok(())
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 0 {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// Plain and speculative greedy decoding of the same prompt, alternated, in one process.
fn run_bench_spec(args: &BenchArgs, drafter: &str) -> Result<()> {
    let registry = Registry::scan(&args.spec.plugins_dirs)?;
    let (manifest, module) = registry.get(drafter)?;
    let provider = instantiate(manifest, module, &parse_overrides(&args.spec.drafter_set)?)?;
    let k = args
        .spec
        .num_draft_tokens
        .or_else(|| {
            manifest
                .defaults
                .get(plugins::HOST_KEY_NUM_DRAFT_TOKENS)
                .and_then(|v| v.as_integer())
                .map(|v| v as usize)
        })
        .unwrap_or(10);
    let loaded = load_model(&args.model)?;
    let model = &loaded.model;
    let need_tokenizer = || {
        loaded
            .tokenizer
            .as_ref()
            .context("--prompt-file/--prompt-set need a model with tokenizer.json")
    };
    let prompts: Vec<Vec<u32>> = if let Some(path) = &args.prompt_set {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let mut prompts = Vec::new();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{} line {}: not JSON", path.display(), i + 1))?;
            let messages = v["messages"]
                .as_array()
                .with_context(|| format!("{} line {}: no `messages` list", path.display(), i + 1))?
                .iter()
                .map(|m| ChatMessage {
                    role: m["role"].as_str().unwrap_or("user").to_owned(),
                    content: m["content"].as_str().unwrap_or_default().to_owned(),
                })
                .collect::<Vec<_>>();
            prompts.push(need_tokenizer()?.encode_chat(&messages)?);
        }
        prompts
    } else if let Some(path) = &args.prompt_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if args.chat {
            vec![need_tokenizer()?.encode_chat(&[ChatMessage {
                role: "user".into(),
                content: text,
            }])?]
        } else {
            vec![need_tokenizer()?.encode_prompt(&text)?]
        }
    } else {
        vec![synthetic_prompt(
            model.config.vocab_size,
            args.prompt_tokens,
        )]
    };
    if prompts.is_empty() {
        bail!("the prompt set is empty");
    }
    let options = SpecOptions {
        num_draft_tokens: k,
        auto_off: !args.spec.no_auto_off,
    };
    let (mut plain_rates, mut spec_rates) = (Vec::new(), Vec::new());
    let mut totals = mlx_spec::spec::SpecStats::default();
    for round in 0..=args.repeats {
        let (mut plain_s, mut spec_s, mut generated) = (0.0, 0.0, 0usize);
        for prompt in &prompts {
            let request = GenerateRequest {
                prompt_ids: prompt.clone(),
                max_tokens: args.gen_tokens,
                sampling: SamplingParams::default(),
                stop_ids: Vec::new(),
                ignore_eos: true,
            };
            // Whole requests, prefill included: both paths prefill the same prompt.
            let start = Instant::now();
            let (plain_tokens, _) = generate(model, &request, |_| Ok(()))?;
            plain_s += start.elapsed().as_secs_f64();
            let start = Instant::now();
            let (spec_tokens, _, stats) =
                generate_speculative(model, &request, Some(&provider), options, |_| Ok(()))?;
            spec_s += start.elapsed().as_secs_f64();
            if spec_tokens != plain_tokens {
                bail!("speculative output differs from plain output (round {round}): this is a bug, please report it");
            }
            generated += spec_tokens.len();
            if round == args.repeats {
                totals.num_drafts += stats.num_drafts;
                totals.num_draft_tokens += stats.num_draft_tokens;
                totals.num_accepted_tokens += stats.num_accepted_tokens;
                totals.target_forwards += stats.target_forwards;
                totals.drafter_seconds += stats.drafter_seconds;
            }
        }
        if round > 0 {
            plain_rates.push(generated as f64 / plain_s);
            spec_rates.push(generated as f64 / spec_s);
        }
    }
    totals.mean_acceptance_length = if totals.num_drafts > 0 {
        1.0 + totals.num_accepted_tokens as f64 / totals.num_drafts as f64
    } else {
        0.0
    };
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let stats = totals;
    let (plain, spec) = (median(plain_rates), median(spec_rates));
    if args.json {
        println!(
            "{}",
            json!({"model": args.model.model.display().to_string(), "drafter": drafter, "num_draft_tokens": k,
                   "prompts": prompts.len(), "prompt_tokens": prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
                   "plain_tokens_per_s": plain, "spec_tokens_per_s": spec, "speedup": spec / plain,
                   "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                   "num_accepted_tokens": stats.num_accepted_tokens, "mean_acceptance_length": stats.mean_acceptance_length,
                   "target_forwards": stats.target_forwards, "drafter_seconds": stats.drafter_seconds,
                   "drafter_us_per_forward": 1e6 * stats.drafter_seconds / stats.target_forwards.max(1) as f64})
        );
    } else {
        println!("| model | drafter (k) | prompts (tokens) | generated each | plain tok/s | spec tok/s | speedup | acceptance length | forwards | drafter µs/forward |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        println!(
            "| {} | {drafter} ({k}) | {} ({prompt_tokens}) | {} | {plain:.1} | {spec:.1} | {:.2}x | {:.2} | {} | {:.1} |",
            args.model.model.file_name().unwrap_or_default().to_string_lossy(),
            prompts.len(),
            args.gen_tokens,
            spec / plain,
            stats.mean_acceptance_length,
            stats.target_forwards,
            1e6 * stats.drafter_seconds / stats.target_forwards.max(1) as f64
        );
    }
    Ok(())
}

/// Deterministic prompt ids away from the special-token range.
fn synthetic_prompt(vocab: usize, len: usize) -> Vec<u32> {
    let vocab = vocab as u64;
    let low = 3.min(vocab - 1);
    (0..len as u64)
        .map(|i| (low + (i * 2_654_435_761) % (vocab - low)) as u32)
        .collect()
}

/// What [`check_against_cpu`] found.
struct CpuCheck {
    device_tokens: Vec<u32>,
    /// The device's tokens again with decode attention in 32-slot shares, so that both of the
    /// kernel's paths (one round, several rounds) are checked (on CUDA; elsewhere the same
    /// operations run again).
    device_tokens_other_shares: Vec<u32>,
    cpu_tokens: Vec<u32>,
    /// Largest |difference| between the two devices' logits after the prompt.
    max_logit_diff: f32,
    /// Gap between the best and second-best logit there (how far from a tie the first pick was).
    top2_margin: f32,
}

/// Greedy decode of `n` tokens after `prompt` on the default device, then on the CPU with the
/// same weight arrays, so both runs compute the same function on the same values.
fn check_against_cpu(
    model: &Gemma4Model,
    prompt: &[u32],
    n: usize,
    device: DeviceKind,
) -> Result<CpuCheck> {
    let run = || -> Result<(Vec<u32>, Vec<f32>)> {
        let mut cache = model.new_cache();
        let logits = prefill(model, &mut cache, prompt)?;
        let first = logits.as_dtype(Dtype::Float32)?;
        first.eval()?;
        let first = first.as_slice::<f32>().to_vec();
        let (tokens, _, _) = decode_step_by_step(model, &mut cache, &logits, n.saturating_sub(1))?;
        Ok((tokens, first))
    };
    let (device_tokens, device_logits) = run()?;
    use mlx_spec::kernels::{decode_attention::ONE_ROUND_SHARE_SLOTS, Tuning};
    let tuning = Tuning::current();
    Tuning {
        attention_share: ONE_ROUND_SHARE_SLOTS,
        ..tuning
    }
    .apply()?;
    let other_shares = run();
    tuning.apply()?;
    let (device_tokens_other_shares, _) = other_shares?;
    // A CUDA build of libmlx cannot JIT-compile fused CPU kernels (it has no host compiler
    // setup), so the CPU reference runs every operation unfused.
    // SAFETY: plain global switches of libmlx, called between evaluations.
    unsafe { mlx_sys::mlx_disable_compile() };
    device::select(DeviceKind::Cpu)?;
    let cpu = run();
    unsafe { mlx_sys::mlx_enable_compile() };
    device::select(device)?;
    let (cpu_tokens, cpu_logits) = cpu?;
    let max_logit_diff = device_logits
        .iter()
        .zip(&cpu_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    Ok(CpuCheck {
        device_tokens,
        device_tokens_other_shares,
        cpu_tokens,
        max_logit_diff,
        top2_margin: top2_margin(&cpu_logits),
    })
}

/// Greedy tokens and the float32 logits behind each (`logits[0]`: the prefill's last), one
/// synchronised step at a time from a fresh cache. With `forced`, step `i` is fed `forced[i]`
/// instead of its own pick, so the logits of two runs stay comparable after a pick differs.
fn stepwise_logits(
    model: &Gemma4Model,
    prompt: &[u32],
    n: usize,
    forced: Option<&[u32]>,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let to_host = |logits: &mlx_rs::Array| -> Result<Vec<f32>> {
        let logits = logits.as_dtype(Dtype::Float32)?;
        logits.eval()?;
        Ok(logits.as_slice::<f32>().to_vec())
    };
    let mut cache = model.new_cache();
    let mut logits = prefill(model, &mut cache, prompt)?;
    let mut tokens = Vec::with_capacity(n + 1);
    let mut all = Vec::with_capacity(n + 1);
    for step in 0..=n {
        tokens.push(greedy_token(&logits)?);
        all.push(to_host(&logits)?);
        if step == n {
            break;
        }
        let fed = forced.map_or(tokens[step], |f| f[step]);
        logits = model
            .forward(&[fed], &mut cache, LogitsFor::Last, false)?
            .logits;
    }
    Ok((tokens, all))
}

/// Gap between the best and the second-best of `logits`.
fn top2_margin(logits: &[f32]) -> f32 {
    let (mut best, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in logits {
        if v > best {
            (best, second) = (v, best);
        } else if v > second {
            second = v;
        }
    }
    best - second
}

/// `bench --repeatability RUNS`: decodes `n` greedy tokens `runs` times pipelined, first
/// thing in the process (the condition of the one 4-bit disagreement seen on CUDA), then
/// `runs` times step by step from fresh caches. Prints where each pipelined run's tokens first
/// differ from the first step-by-step run's, and where each later step-by-step run's logits
/// first differ from the first's (every run fed the first run's tokens). A bitwise-repeatable
/// device gives identical logits everywhere; then a pipelined run that departs points at the
/// pipelining, not at an operation.
fn report_repeatability(model: &Gemma4Model, prompt: &[u32], runs: usize, n: usize) -> Result<()> {
    let runs = runs.max(2);
    let mut pipelined = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut cache = model.new_cache();
        let logits = prefill(model, &mut cache, prompt)?;
        pipelined.push(decode_pipelined(model, &mut cache, &logits, n)?.0);
    }
    let (reference, reference_logits) = stepwise_logits(model, prompt, n, None)?;
    println!("repeatability: reference tokens {reference:?}");
    for run in 1..runs {
        let (picks, logits) = stepwise_logits(model, prompt, n, Some(&reference))?;
        let diffs: Vec<f32> = logits
            .iter()
            .zip(&reference_logits)
            .map(|(a, b)| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max)
            })
            .collect();
        let first_diff = diffs.iter().position(|d| *d > 0.0);
        let first_pick = picks.iter().zip(&reference).position(|(a, b)| a != b);
        let worst = diffs.iter().copied().fold(0.0, f32::max);
        match first_diff {
            None => println!(
                "repeatability: step-by-step run {run}: logits identical at all {} steps",
                diffs.len()
            ),
            Some(step) => println!(
                "repeatability: step-by-step run {run}: logits first differ at step {step} (0 = prefill) by {:.3e}, at most {worst:.3e}; picks first differ at {first_pick:?} (reference top-2 margin there {:.3e})",
                diffs[step],
                first_pick.map_or(f32::NAN, |i| top2_margin(&reference_logits[i])),
            ),
        }
    }
    for (run, tokens) in pipelined.iter().enumerate() {
        match tokens.iter().zip(&reference).position(|(a, b)| a != b) {
            None => println!("repeatability: pipelined run {run}: tokens identical"),
            Some(i) => println!(
                "repeatability: pipelined run {run}: tokens first differ at {i} (reference top-2 margin there {:.3e}): {tokens:?}",
                top2_margin(&reference_logits[i])
            ),
        }
    }
    Ok(())
}

/// Milliseconds of one forward over `k` new tokens after `prompt`, for k = 1, 2, 4, … 32
/// (median over `repeats`, the cache rolled back after each).
fn verify_curve(model: &Gemma4Model, prompt: &[u32], repeats: usize) -> Result<Vec<(usize, f64)>> {
    let mut cache = mlx_spec::model::gemma4::ModelCache::with_reserve(&model.config, 64);
    prefill(model, &mut cache, prompt)?;
    let vocab = model.config.vocab_size as u32;
    let mut curve = Vec::new();
    for k in [1usize, 2, 4, 8, 16, 32] {
        let window: Vec<u32> = (0..k as u32)
            .map(|i| 3 + (i * 7919) % (vocab - 3))
            .collect();
        let mut times = Vec::new();
        for round in 0..=repeats {
            let start = Instant::now();
            let logits = model
                .forward(&window, &mut cache, LogitsFor::All, false)?
                .logits;
            let picks = mlx_rs::ops::indexing::argmax_axis(&logits, -1, false)?;
            picks.eval()?;
            if round > 0 {
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
            cache.trim(k)?;
        }
        curve.push((k, median(times)));
    }
    Ok(curve)
}

/// Where the host spends a pipelined decode step, in milliseconds per step.
#[derive(Default, Clone, Copy)]
struct HostSplit {
    /// Building the step's lazy graph (our model code).
    build_ms: f64,
    /// Handing the graph to MLX (`async_eval`: MLX walks it and encodes its kernels).
    submit_ms: f64,
    /// Blocked reading the previous token while the device finishes it.
    wait_ms: f64,
}

/// Greedy decode of `n` forwards after `logits` (`n + 1` tokens), the host queueing each step
/// before reading the token it consumes (as `generate` does). Returns the tokens, the
/// seconds taken and where the host spent them.
fn decode_pipelined(
    model: &Gemma4Model,
    cache: &mut mlx_spec::model::gemma4::ModelCache,
    logits: &mlx_rs::Array,
    n: usize,
) -> Result<(Vec<u32>, f64, HostSplit)> {
    let start = Instant::now();
    let mut next = mlx_rs::ops::indexing::argmax_axis(logits, -1, false)?;
    let mut tokens = Vec::with_capacity(n + 1);
    let mut split = HostSplit::default();
    for _ in 0..n {
        // `queue_greedy_step`, timed in its two halves.
        let t0 = Instant::now();
        let following = greedy_step(model, cache, &next)?;
        let t1 = Instant::now();
        mlx_rs::transforms::async_eval([&following])?;
        let t2 = Instant::now();
        tokens.push(mlx_spec::generate::read_token(&next)?);
        let t3 = Instant::now();
        split.build_ms += (t1 - t0).as_secs_f64();
        split.submit_ms += (t2 - t1).as_secs_f64();
        split.wait_ms += (t3 - t2).as_secs_f64();
        next = following;
    }
    tokens.push(mlx_spec::generate::read_token(&next)?);
    let per_step = 1e3 / n as f64;
    split.build_ms *= per_step;
    split.submit_ms *= per_step;
    split.wait_ms *= per_step;
    Ok((tokens, start.elapsed().as_secs_f64(), split))
}

/// One set of `bench --compare-fused`: its median decode rate and host split over the rounds.
struct FusedSetResult {
    name: String,
    tokens_per_s: f64,
    /// Whether its tokens equal those of MLX's operations alone.
    same_as_none: bool,
    /// Where the host spent a step (medians of each part): tells a host-bound set from a
    /// device-bound one (waiting near 0: the host is the bound).
    host: HostSplit,
    /// Largest |difference| between the logits of its first decode step and those of MLX's
    /// operations alone (the same prompt and first token): sets that round otherwise differ
    /// a little; a fault in a kernel shows as a large gap.
    logit_gap: f32,
}

/// Pipelined greedy decode with each set of fused kernels, the sets alternating round by
/// round so that drifts of the machine's speed hit them alike.
fn compare_fused(
    model: &Gemma4Model,
    prompt: &[u32],
    args: &BenchArgs,
) -> Result<Vec<FusedSetResult>> {
    use mlx_spec::kernels::{set_allowed, Fused, Tuning};
    let fused = |attention, products| Fused {
        attention,
        products,
        ..Fused::default()
    };
    let all_three = Fused {
        post_attention: true,
        ..fused(true, true)
    };
    let with_head = |kernels: Fused| Fused {
        output_head: true,
        ..kernels
    };
    let with_ple = |kernels: Fused| Fused {
        per_layer_input: true,
        ..kernels
    };
    /// One configuration: which kernels run, and how.
    struct Set {
        name: String,
        kernels: Fused,
        tuning: Tuning,
    }
    let default = Tuning::current();
    let set = |name: &str, kernels| Set {
        name: name.to_string(),
        kernels,
        tuning: default,
    };
    let on_off = |on: bool| if on { "on" } else { "off" };
    let row_pairs = Tuning {
        row_pairs: !default.row_pairs,
        ..default
    };
    // Decode attention as first written: four slots a warp at a time.
    let narrow = Tuning {
        attention_wide_rounds: false,
        ..default
    };
    let four_bit = model.config.quantization.default.map(|q| q.bits) == Some(4);
    let sets: Vec<Set> = if four_bit {
        // A 4-bit model: MLX's quantized products, the post-attention kernel over 4-bit rows,
        // and the attention-heads and product kernels over 4-bit rows at one and two rows a
        // warp (four lost in lease 2 of 2026-12-01), with and without the output head kernel,
        // the per-layer-input kernel, integer dots over 4-bit rows, the attention heads
        // finished apart, weight lines requested before staging, the step's integers in device
        // memory, and decode attention's first (narrow) rounds.
        let post_attention = Fused {
            affine4: true,
            ..fused(true, true)
        };
        let products = Fused {
            affine4_heads: true,
            affine4_products: true,
            ..fused(true, true)
        };
        let rows = |n: i32, kernels: Fused, name: &str| Set {
            name: format!("{name}, {n} rows a warp"),
            kernels,
            tuning: Tuning {
                affine4_rows_per_warp: n,
                ..default
            },
        };
        let products_name = "attention,products,affine4-heads,affine4-products";
        let head_name = "attention,products,affine4-heads,affine4-products,output-head";
        vec![
            set("none", fused(false, false)),
            set("attention,products", fused(true, true)),
            set("attention,products,affine4", post_attention),
            set(
                "attention,products,affine4,affine4-heads",
                Fused {
                    affine4_heads: true,
                    ..post_attention
                },
            ),
            rows(1, products, products_name),
            rows(2, products, products_name),
            rows(1, with_head(products), head_name),
            rows(2, with_head(products), head_name),
            Set {
                name: format!("{head_name}, 2 rows a warp, integer dots"),
                kernels: with_head(products),
                tuning: Tuning {
                    affine4_rows_per_warp: 2,
                    affine4_integer_dots: true,
                    ..default
                },
            },
            Set {
                name: format!("{head_name}, 1 rows a warp, integer dots"),
                kernels: with_head(products),
                tuning: Tuning {
                    affine4_rows_per_warp: 1,
                    affine4_integer_dots: true,
                    ..default
                },
            },
            Set {
                name: format!("{head_name}, 2 rows a warp, heads finished apart"),
                kernels: with_head(products),
                tuning: Tuning {
                    affine4_rows_per_warp: 2,
                    heads_finished_apart: true,
                    ..default
                },
            },
            Set {
                name: format!("{head_name}, 2 rows a warp, rows touched first"),
                kernels: with_head(products),
                tuning: Tuning {
                    affine4_rows_per_warp: 2,
                    rows_touched_first: true,
                    ..default
                },
            },
            Set {
                name: format!("{head_name}, 2 rows a warp, step integers on the device"),
                kernels: with_head(products),
                tuning: Tuning {
                    affine4_rows_per_warp: 2,
                    step_ints_on_device: true,
                    ..default
                },
            },
            Set {
                name: format!("{head_name}, 2 rows a warp, narrow attention rounds"),
                kernels: with_head(products),
                tuning: Tuning {
                    affine4_rows_per_warp: 2,
                    ..narrow
                },
            },
            rows(
                1,
                with_ple(with_head(products)),
                &format!("{head_name},per-layer-input"),
            ),
            rows(
                2,
                with_ple(with_head(products)),
                &format!("{head_name},per-layer-input"),
            ),
        ]
    } else {
        // Variants that lost in several leases (barriers polling with acquire loads, L2
        // prefetch, 16 loads in flight in the post-attention kernel, three blocks a
        // multiprocessor, 32-slot attention shares) are no longer measured; their figures
        // are in BENCHMARKS.md.
        vec![
            set("none", fused(false, false)),
            set("attention", fused(true, false)),
            set("products", fused(false, true)),
            set("attention,products", fused(true, true)),
            set(
                "attention,products,output-head",
                with_head(fused(true, true)),
            ),
            Set {
                name: "attention,products,output-head, heads finished apart".into(),
                kernels: with_head(fused(true, true)),
                tuning: Tuning {
                    heads_finished_apart: true,
                    ..default
                },
            },
            Set {
                name: "attention,products,output-head, rows touched first".into(),
                kernels: with_head(fused(true, true)),
                tuning: Tuning {
                    rows_touched_first: true,
                    ..default
                },
            },
            Set {
                name: "attention,products,output-head, step integers on the device".into(),
                kernels: with_head(fused(true, true)),
                tuning: Tuning {
                    step_ints_on_device: true,
                    ..default
                },
            },
            Set {
                name: "attention,products,output-head, narrow attention rounds".into(),
                kernels: with_head(fused(true, true)),
                tuning: narrow,
            },
            Set {
                name: "attention,products,output-head, 16 loads in flight over dense rows".into(),
                kernels: with_head(fused(true, true)),
                tuning: Tuning {
                    dense_loads: 16,
                    ..default
                },
            },
            set("attention,products,post-attention", all_three),
            Set {
                name: format!(
                    "attention,products,post-attention, row pairs {}",
                    on_off(row_pairs.row_pairs)
                ),
                kernels: all_three,
                tuning: row_pairs,
            },
            set(
                "attention,products,output-head,per-layer-input",
                with_ple(with_head(fused(true, true))),
            ),
        ]
    };
    let mut rates = vec![Vec::new(); sets.len()];
    let mut splits = vec![Vec::new(); sets.len()];
    let mut tokens = vec![Vec::new(); sets.len()];
    let mut first_step_logits = vec![Vec::new(); sets.len()];
    let repeats = args.repeats.max(3);
    let mut run_all = || -> Result<()> {
        for round in 0..=repeats {
            for (i, s) in sets.iter().enumerate() {
                set_allowed(s.kernels);
                s.tuning.apply()?;
                if round == 0 {
                    let (_, mut logits) = stepwise_logits(model, prompt, 1, None)?;
                    first_step_logits[i] = logits.pop().unwrap_or_default();
                }
                let mut cache = model.new_cache();
                let logits = prefill(model, &mut cache, prompt)?;
                let (got, seconds, split) =
                    decode_pipelined(model, &mut cache, &logits, args.gen_tokens)?;
                let rate = args.gen_tokens as f64 / seconds;
                // Logged as it comes, so that a set that ends the process (a kernel trap)
                // leaves the others' figures behind.
                tracing::info!(round, set = %s.name, "compare-fused: {rate:.1} tok/s");
                if round > 0 {
                    rates[i].push(rate);
                    splits[i].push(split);
                }
                tokens[i] = got;
            }
        }
        Ok(())
    };
    let result = run_all();
    args.model.allow_fused_kernels();
    default.apply()?;
    result?;
    // Twins must decode the same tokens:
    // * the one post-attention kernel and the per-layer-input kernel regroup the arithmetic
    //   of their plain twin (the same kernels without them, the same attention shares);
    // * the rows a warp takes, the loads a lane keeps in flight, which block finishes the
    //   attention heads, early requests for weight lines and where the step's integers live
    //   change no value: sets that differ only in them.
    // Other share sizes, and decode attention's narrow rounds, add softmax terms in another
    // order, and integer dots round the input's small values otherwise, which may move a
    // rounding; the 4-bit kernels sum otherwise than MLX's quantized products, and the output
    // head otherwise than MLX's product.
    for (i, s) in sets.iter().enumerate() {
        let plain = Fused {
            post_attention: false,
            per_layer_input: false,
            ..s.kernels
        };
        let mlx_sums = !(s.kernels.affine4
            || s.kernels.affine4_heads
            || s.kernels.affine4_products
            || s.kernels.output_head);
        let Some(twin) = sets.iter().position(|t| {
            t.tuning.attention_share == s.tuning.attention_share
                && t.tuning.attention_wide_rounds == s.tuning.attention_wide_rounds
                && ((mlx_sums && t.kernels == plain)
                    || (s.kernels.per_layer_input
                        && t.kernels == plain
                        && t.tuning.affine4_rows_per_warp == s.tuning.affine4_rows_per_warp)
                    || (t.kernels == s.kernels
                        && t.tuning != s.tuning
                        && Tuning {
                            affine4_rows_per_warp: s.tuning.affine4_rows_per_warp,
                            dense_loads: s.tuning.dense_loads,
                            heads_finished_apart: s.tuning.heads_finished_apart,
                            rows_touched_first: s.tuning.rows_touched_first,
                            step_ints_on_device: s.tuning.step_ints_on_device,
                            ..t.tuning
                        } == s.tuning))
        }) else {
            continue;
        };
        if i != twin && tokens[i] != tokens[twin] {
            bail!(
                "{} changed the greedy tokens of {}: {:?} vs {:?}; this is a bug",
                s.name,
                sets[twin].name,
                tokens[i],
                tokens[twin]
            );
        }
    }
    let median_split = |v: &[HostSplit]| HostSplit {
        build_ms: median(v.iter().map(|h| h.build_ms).collect()),
        submit_ms: median(v.iter().map(|h| h.submit_ms).collect()),
        wait_ms: median(v.iter().map(|h| h.wait_ms).collect()),
    };
    Ok(sets
        .iter()
        .zip(rates)
        .zip(&splits)
        .zip(&tokens)
        .zip(&first_step_logits)
        .map(|((((s, r), h), t), l)| FusedSetResult {
            name: s.name.clone(),
            tokens_per_s: median(r),
            same_as_none: *t == tokens[0],
            host: median_split(h),
            logit_gap: l
                .iter()
                .zip(&first_step_logits[0])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m }),
        })
        .collect())
}

/// Greedy decode of `n` forwards after `logits`, building and evaluating one step at a time.
/// Returns the tokens, the seconds taken, and the seconds spent building graphs.
fn decode_step_by_step(
    model: &Gemma4Model,
    cache: &mut mlx_spec::model::gemma4::ModelCache,
    logits: &mlx_rs::Array,
    n: usize,
) -> Result<(Vec<u32>, f64, f64)> {
    let start = Instant::now();
    let mut token = greedy_token(logits)?;
    let mut tokens = vec![token];
    let mut build_s = 0.0;
    for _ in 0..n {
        let build_start = Instant::now();
        let logits = model
            .forward(&[token], cache, LogitsFor::Last, false)?
            .logits;
        build_s += build_start.elapsed().as_secs_f64();
        token = greedy_token(&logits)?;
        tokens.push(token);
    }
    Ok((tokens, start.elapsed().as_secs_f64(), build_s))
}

/// `bench --op-cost`: host time per operation, by kind.
fn run_op_cost(args: &BenchArgs) -> Result<()> {
    device::select(args.model.device)?;
    args.model.allow_fused_kernels();
    let costs = mlx_spec::diagnostics::operation_costs(400, 1024, args.repeats)?;
    if args.json {
        let rows: Vec<_> = costs
            .iter()
            .map(|c| {
                json!({"kind": c.kind, "build_us": c.build_us, "submit_us": c.submit_us,
                       "total_us": c.total_us})
            })
            .collect();
        println!("{}", json!({ "op_cost": rows }));
        return Ok(());
    }
    println!("| operation | build µs/op | async_eval µs/op | total µs/op |");
    println!("|---|---|---|---|");
    for c in &costs {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} |",
            c.kind, c.build_us, c.submit_us, c.total_us
        );
    }
    Ok(())
}

/// `bench --check-kernels`: fused kernels against references on random data.
fn run_check_kernels(args: &BenchArgs) -> Result<()> {
    device::select(args.model.device)?;
    if !(cfg!(target_os = "linux") && device::default_is(mlx_rs::DeviceType::Gpu)) {
        bail!("--check-kernels needs a CUDA GPU (--device gpu with the CUDA libmlx)");
    }
    args.model.allow_fused_kernels();
    let attention = mlx_spec::diagnostics::decode_attention_errors(Dtype::Bfloat16, 1e-2)?;
    let products = mlx_spec::diagnostics::affine4_integer_dot_errors(1.0 / 64.0)?;
    if args.json {
        let attention: Vec<_> = attention
            .iter()
            .map(|r| {
                json!({"case": r.case, "wide_error": r.wide_error, "narrow_error": r.narrow_error,
                       "wide_vs_narrow": r.wide_vs_narrow})
            })
            .collect();
        let products: Vec<_> = products
            .iter()
            .map(|r| json!({"case": r.case, "difference": r.difference, "largest_output": r.largest_output}))
            .collect();
        println!(
            "{}",
            json!({ "decode_attention": attention, "affine4_integer_dots": products })
        );
        return Ok(());
    }
    println!("| decode attention (bf16, 8 query heads, 2 KV heads) | wide rounds: largest error | narrow rounds | wide vs narrow |");
    println!("|---|---|---|---|");
    for r in &attention {
        println!(
            "| {} | {:.2e} | {:.2e} | {:.2e} |",
            r.case, r.wide_error, r.narrow_error, r.wide_vs_narrow
        );
    }
    println!();
    println!("| 4-bit product (bf16, groups of 64) | integer dots vs float unpacking: largest difference | largest output |");
    println!("|---|---|---|");
    for r in &products {
        println!(
            "| {} | {:.2e} | {:.2e} |",
            r.case, r.difference, r.largest_output
        );
    }
    println!("kernel checks passed: decode attention within 1e-2 of MLX's operations, integer dots within 1/64 of the largest output of float unpacking");
    Ok(())
}

/// `bench --feed-forward-speed`: the feed-forward block's weight streaming rate, by method.
fn run_feed_forward_speed(args: &BenchArgs) -> Result<()> {
    device::select(args.model.device)?;
    args.model.allow_fused_kernels();
    let (_, _, config) = read_config(&args.model.model)?;
    let (hidden, intermediate) = (config.hidden_size as i32, config.intermediate_size as i32);
    // The first layer's heads (a sliding-window layer in every released size).
    let head_dim = config.layers.first().map_or(0, |l| l.head_dim);
    let attention_width = (config.num_heads * head_dim) as i32;
    let speeds = mlx_spec::diagnostics::feed_forward_speed(
        hidden,
        intermediate,
        attention_width,
        16,
        args.repeats,
    )?;
    if args.json {
        let rows: Vec<_> = speeds
            .iter()
            .map(|s| {
                json!({"kind": s.kind, "build_us": s.build_us, "submit_us": s.submit_us,
                       "total_us": s.total_us, "gb_per_s": s.gb_per_s})
            })
            .collect();
        println!(
            "{}",
            json!({ "feed_forward_speed": rows, "hidden": hidden, "intermediate": intermediate })
        );
        return Ok(());
    }
    println!(
        "feed-forward block, hidden {hidden}, intermediate {intermediate} (attention output \
         {attention_width} wide in the last rows), bf16, 16 layers:"
    );
    println!("| method | build µs/layer | async_eval µs/layer | total µs/layer | GB/s |");
    println!("|---|---|---|---|---|");
    for s in &speeds {
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            s.kind, s.build_us, s.submit_us, s.total_us, s.gb_per_s
        );
    }
    Ok(())
}

fn run_bench(args: BenchArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens == 0 || args.repeats == 0 {
        bail!("--prompt-tokens, --gen-tokens and --repeats must be at least 1");
    }
    if let Some(drafter) = args.spec.drafter.clone() {
        return run_bench_spec(&args, &drafter);
    }
    if args.op_cost {
        return run_op_cost(&args);
    }
    if args.feed_forward_speed {
        return run_feed_forward_speed(&args);
    }
    if args.check_kernels {
        return run_check_kernels(&args);
    }
    let loaded = load_model(&args.model)?;
    let model = &loaded.model;
    let weight_bytes = mlx_rs::memory::active_memory().unwrap_or(0);
    let prompt = synthetic_prompt(model.config.vocab_size, args.prompt_tokens);
    if let Some(runs) = args.repeatability {
        return report_repeatability(model, &prompt, runs, args.gen_tokens);
    }

    let mut prefill_rates = Vec::new();
    let mut decode_rates = Vec::new();
    let mut stepwise_rates = Vec::new();
    // Time a step-by-step decode step spends building its lazy graph on the host.
    let mut build_ms = Vec::new();
    let mut splits = Vec::new();
    for round in 0..=args.repeats {
        let mut cache = model.new_cache();
        let start = Instant::now();
        let logits = prefill(model, &mut cache, &prompt)?;
        let prefill_s = start.elapsed().as_secs_f64();
        let (pipelined, decode_s, split) =
            decode_pipelined(model, &mut cache, &logits, args.gen_tokens)?;

        // The same decode, one synchronised step at a time, from a fresh cache.
        let mut cache = model.new_cache();
        let logits = prefill(model, &mut cache, &prompt)?;
        let (stepwise, stepwise_s, build_s) =
            decode_step_by_step(model, &mut cache, &logits, args.gen_tokens)?;
        if pipelined != stepwise {
            let first = pipelined.iter().zip(&stepwise).position(|(a, b)| a != b);
            bail!(
                "pipelined and step-by-step greedy decoding disagree in round {round} ({}), from token {first:?}: {pipelined:?} vs {stepwise:?}",
                if round == 0 { "the warm-up, the process's first decode" } else { "measured" }
            );
        }
        if round > 0 {
            prefill_rates.push(args.prompt_tokens as f64 / prefill_s);
            decode_rates.push(args.gen_tokens as f64 / decode_s);
            stepwise_rates.push(args.gen_tokens as f64 / stepwise_s);
            build_ms.push(build_s * 1e3 / args.gen_tokens as f64);
            splits.push(split);
        }
    }
    let (prefill_rate, decode_rate) = (median(prefill_rates), median(decode_rates));
    let stepwise_rate = median(stepwise_rates);
    let build_ms = median(build_ms);
    let host = HostSplit {
        build_ms: median(splits.iter().map(|s| s.build_ms).collect()),
        submit_ms: median(splits.iter().map(|s| s.submit_ms).collect()),
        wait_ms: median(splits.iter().map(|s| s.wait_ms).collect()),
    };
    let step_ms = 1e3 / stepwise_rate;
    let curve = if args.verify_curve {
        verify_curve(model, &prompt, args.repeats)?
    } else {
        Vec::new()
    };
    let step_ops = match &args.dump_step_graph {
        Some(path) => {
            let mut cache = model.new_cache();
            let logits = prefill(model, &mut cache, &prompt)?;
            let token = mlx_rs::ops::indexing::argmax_axis(&logits, -1, false)?;
            let out =
                model.forward_ids(&token.reshape(&[1, 1])?, &mut cache, LogitsFor::Last, false)?;
            let next = mlx_rs::ops::indexing::argmax_axis(&out.logits, -1, false)?;
            mlx_spec::diagnostics::export_dot(&next, path)?;
            let dot = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read back {}", path.display()))?;
            Some(mlx_spec::diagnostics::count_operations(&dot))
        }
        None => None,
    };
    let fused_comparison = if args.compare_fused {
        let cuda =
            cfg!(target_os = "linux") && mlx_spec::device::default_is(mlx_rs::DeviceType::Gpu);
        if !cuda {
            tracing::warn!(
                "--compare-fused: the fused kernels run on a CUDA GPU only; here every set runs \
                 MLX's operations, and their rates differ by noise alone"
            );
        }
        compare_fused(model, &prompt, &args)?
    } else {
        Vec::new()
    };
    let check = match args.check_cpu {
        Some(n) => {
            let short = &prompt[..prompt.len().min(16)];
            Some(check_against_cpu(
                model,
                short,
                n.max(1),
                args.model.device,
            )?)
        }
        None => None,
    };
    let name = args.model.model.display().to_string();
    if args.json {
        println!(
            "{}",
            json!({
                "model": name, "random_weights": args.model.random_weights, "dtype": format!("{:?}", model.dtype),
                "device": args.model.device, "mlx_version": device::mlx_version(), "weight_bytes": weight_bytes,
                "weight_bytes_read_per_token": model.weight_bytes_read_per_token(weight_bytes),
                "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
                "prefill_tokens_per_s": prefill_rate, "decode_tokens_per_s": decode_rate,
                "stepwise_decode_tokens_per_s": stepwise_rate, "stepwise_step_ms": step_ms,
                "stepwise_graph_build_ms": build_ms,
                "pipelined_host_ms": json!({"build": host.build_ms, "submit": host.submit_ms, "wait": host.wait_ms}),
                "fused_comparison": fused_comparison.iter().map(|f| json!({"kernels": f.name, "decode_tokens_per_s": f.tokens_per_s, "same_tokens_as_none": f.same_as_none, "first_step_logit_gap": f.logit_gap, "host_ms": {"build": f.host.build_ms, "submit": f.host.submit_ms, "wait": f.host.wait_ms}})).collect::<Vec<_>>(),
                "verify_curve": curve.iter().map(|(k, ms)| json!({"k": k, "ms": ms})).collect::<Vec<_>>(),
                "step_operations": step_ops.as_ref().map(|c| json!({"total": c.values().sum::<usize>(), "by_kind": c})),
                "cpu_check": check.as_ref().map(|c| json!({
                    "same_tokens": c.device_tokens == c.cpu_tokens && c.device_tokens_other_shares == c.cpu_tokens,
                    "device_tokens": c.device_tokens, "device_tokens_other_shares": c.device_tokens_other_shares,
                    "cpu_tokens": c.cpu_tokens, "max_logit_diff": c.max_logit_diff, "top2_margin": c.top2_margin,
                })),
            })
        );
    } else {
        println!("| model | dtype | device | weights (MB) | prefill {} tok (tok/s) | decode {} tok (tok/s) |", args.prompt_tokens, args.gen_tokens);
        println!("|---|---|---|---|---|---|");
        println!(
            "| {name}{} | {:?} | {:?} | {:.1} | {prefill_rate:.1} | {decode_rate:.1} |",
            if args.model.random_weights {
                " (random)"
            } else {
                ""
            },
            model.dtype,
            args.model.device,
            weight_bytes as f64 / 1e6
        );
        println!();
        println!(
            "decode: {decode_rate:.1} tok/s with the next step queued before each token is read; \
             {stepwise_rate:.1} tok/s one synchronised step at a time ({step_ms:.2} ms a step: \
             {build_ms:.2} ms building the graph on the host, {:.2} ms evaluating it)",
            step_ms - build_ms
        );
        println!(
            "pipelined host time per step: {:.2} ms building the graph, {:.2} ms handing it to \
             MLX (async_eval), {:.2} ms waiting for the device",
            host.build_ms, host.submit_ms, host.wait_ms
        );
        if !fused_comparison.is_empty() {
            println!();
            println!("| fused kernels | decode (tok/s) | host ms a step: build, submit, waiting | tokens as with none | first step's logits vs none: largest difference |");
            println!("|---|---|---|---|---|");
            for f in &fused_comparison {
                println!(
                    "| {} | {:.1} | {:.2}, {:.2}, {:.2} | {} | {:.3e} |",
                    f.name,
                    f.tokens_per_s,
                    f.host.build_ms,
                    f.host.submit_ms,
                    f.host.wait_ms,
                    if f.same_as_none { "same" } else { "differ" },
                    f.logit_gap
                );
            }
        }
        if !curve.is_empty() {
            println!();
            println!("| verify window k | 1 | 2 | 4 | 8 | 16 | 32 |");
            println!("|---|---|---|---|---|---|---|");
            let cells: Vec<String> = curve.iter().map(|(_, ms)| format!("{ms:.2} ms")).collect();
            println!("| one forward | {} |", cells.join(" | "));
        }
        if let Some(ops) = &step_ops {
            let mut by_count: Vec<_> = ops.iter().collect();
            by_count.sort_by(|a, b| b.1.cmp(a.1));
            let list: Vec<String> = by_count.iter().map(|(k, n)| format!("{k} {n}")).collect();
            println!();
            println!(
                "one decode step: {} operations ({})",
                ops.values().sum::<usize>(),
                list.join(", ")
            );
        }
        if let Some(c) = &check {
            println!();
            println!(
                "{} vs CPU, same weights: {} greedy tokens {} (again with 32-slot attention shares: {}); logits after the prompt differ by at most {:.3e} (top-2 margin {:.3e})",
                format!("{:?}", args.model.device).to_uppercase(),
                c.cpu_tokens.len(),
                if c.device_tokens == c.cpu_tokens { "identical" } else { "DIFFER" },
                if c.device_tokens_other_shares == c.cpu_tokens { "identical" } else { "DIFFER" },
                c.max_logit_diff,
                c.top2_margin
            );
        }
    }
    if let Some(c) = &check {
        for (tokens, how) in [
            (&c.device_tokens, ""),
            (&c.device_tokens_other_shares, " (32-slot attention shares)"),
        ] {
            if *tokens != c.cpu_tokens {
                bail!(
                    "greedy tokens differ between {:?}{how} and CPU: {:?} vs {:?}",
                    args.model.device,
                    tokens,
                    c.cpu_tokens
                );
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Generate(args) => run_generate(args),
        Command::Run(args) => run_deploy(args),
        Command::Bench(args) => run_bench(args),
        Command::Plugins(cmd) => run_plugins(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed stdout (e.g. `| head`) is not an error worth reporting.
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_driven_runs_take_every_default_fused_kernel() {
        let defaults = default_fused_kernels();
        assert_eq!(
            defaults.len(),
            DEFAULT_FUSED_KERNELS.split(',').count(),
            "every default name parses"
        );
        assert!(defaults.contains(&FusedKernelArg::OutputHead));
        // The command line's default is the same list.
        let cli = Cli::try_parse_from(["mlx-spec", "generate", "--prompt", "x"]).unwrap();
        let Command::Generate(args) = cli.command else {
            panic!("parsed another command")
        };
        assert!(args.model.fused_kernels == defaults);
        assert!(args.model.kernel_variants.is_empty());
    }

    #[test]
    fn kernel_variants_parse_as_a_list_and_refuse_unknown_names() {
        let cli = Cli::try_parse_from([
            "mlx-spec",
            "bench",
            "--kernel-variants",
            "integer-dots,heads-finished-apart",
        ])
        .unwrap();
        let Command::Bench(args) = cli.command else {
            panic!("parsed another command")
        };
        assert!(
            args.model.kernel_variants
                == [
                    KernelVariantArg::IntegerDots,
                    KernelVariantArg::HeadsFinishedApart
                ]
        );
        assert!(Cli::try_parse_from(["mlx-spec", "bench", "--kernel-variants", "faster"]).is_err());
    }
}
