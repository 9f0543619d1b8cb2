//! The `mlx-spec` command line: argument parsing and output only; the work lives in the library.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::json;

use mlx_spec::command_line::{
    init_logging, load_model, parse_overrides, BenchArgs, DtypeArg, FusedKernelsArg, ModelArgs,
    RandomArgs, SpecArgs,
};
use mlx_spec::deploy::{DeployConfig, DrawnOn};
use mlx_spec::generate::{generate, GenerateRequest};
use mlx_spec::plugins::{self, instantiate, read_manifest, Registry};
use mlx_spec::sampler::{DrawPlace, SamplingParams};
use mlx_spec::server::engine::{DrafterSpec, EngineConfig};
use mlx_spec::server::{Defaults, Limits, ServeOptions};
use mlx_spec::speculative::target_port::target_spec;
use mlx_spec::speculative::{generate_speculative, GateMemory, SpecOptions};
use mlx_spec::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};

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
    /// Serve the OpenAI HTTP API (completions, chat, streaming) as a deploy config says.
    Serve(ServeArgs),
    /// Measure prefill and decode speed (tokens/s), plain or speculative side by side.
    Bench(BenchArgs),
    /// Show a drafter's first proposal after a prompt (for drafter authors and tests).
    Draft(DraftArgs),
    /// Inspect drafter plugins, or start a new one.
    #[command(subcommand)]
    Plugins(PluginsCommand),
    /// Perplexity of text files: nats per token, BOS first, in chunks of the model's context.
    Perplexity(PerplexityArgs),
    /// Quantize a drafter checkpoint (assistant, glm-mtp, deepspec, dflash) to affine 4 or 8 bits.
    QuantizeDrafter(mlx_spec::quantize_drafter::QuantizeDrafterArgs),
    /// Fit a block drafter's confidence thresholds from its rounds over a prompt set.
    Calibrate(CalibrateArgs),
}

/// `mlx-spec calibrate`: runs the drafter with its whole block every round over a prompt set,
/// records each round's confidences and outcome, and writes the fitted per-row thresholds
/// beside its checkpoint (`confidence_thresholds.json`), where the plugin reads them.
#[derive(Args)]
struct CalibrateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The drafter plugin (one with a confidence head and a `calibration_log` setting:
    /// `deepspec`).
    #[arg(long)]
    drafter: String,
    /// Directory holding drafter plugin folders (repeatable).
    #[arg(long = "plugins-dir", value_name = "DIR", default_values_os_t = vec![mlx_spec::default_plugins_dir()])]
    plugins_dirs: Vec<PathBuf>,
    /// Override a setting of the drafter's manifest [defaults] (TOML value; repeatable).
    #[arg(long = "drafter-set", value_name = "KEY=VALUE")]
    drafter_set: Vec<String>,
    /// Chat prompts to calibrate on, one JSON object a line (`bench/prompts/*.jsonl`).
    #[arg(long, value_name = "FILE")]
    prompt_set: PathBuf,
    /// Tokens generated a prompt (greedy).
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// The least chance of being accepted a draft needs to be proposed: rows whose drafts are
    /// less likely than this at their confidence are cut. Higher suits devices where a verify
    /// window's extra token costs more.
    #[arg(long, default_value_t = 0.2)]
    min_acceptance: f64,
    /// Where to write the thresholds (default: confidence_thresholds.json in the drafter's
    /// checkpoint folder).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text files to score (UTF-8), each on its own from BOS.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Tokens predicted per chunk (default: the model's max_position_embeddings, else 8192).
    #[arg(long, value_name = "N")]
    context: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// `mlx-spec draft`: prefill, the target's greedy next token, one proposal of the drafter.
#[derive(Args)]
#[command(
    mut_arg("random_weights", |a| a.hide(true)),
    mut_arg("weights_seed", |a| a.hide(true)),
    mut_arg("random_bits", |a| a.hide(true)),
    mut_arg("random_group_size", |a| a.hide(true))
)]
struct DraftArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    random: RandomArgs,
    #[command(flatten)]
    input: PromptArgs,
    /// The drafter plugin (by its manifest name).
    #[arg(long)]
    drafter: String,
    /// Directory holding drafter plugin folders (repeatable).
    #[arg(long = "plugins-dir", value_name = "DIR", default_values_os_t = vec![mlx_spec::default_plugins_dir()])]
    plugins_dirs: Vec<PathBuf>,
    /// Override a setting of the drafter's manifest [defaults] (TOML value; repeatable).
    #[arg(long = "drafter-set", value_name = "KEY=VALUE")]
    drafter_set: Vec<String>,
    /// Drafts to ask for.
    #[arg(long, default_value_t = 4)]
    num_draft_tokens: usize,
    /// Print one JSON object {"anchor", "drafts"}.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum PluginsCommand {
    /// List the plugins of some directories with their status.
    List {
        /// Directory holding plugin folders (repeatable; default: the plugins beside the binary,
        /// or under $MLX_SPEC_HOME).
        #[arg(long = "plugins-dir", value_name = "DIR", default_values_os_t = vec![mlx_spec::default_plugins_dir()])]
        plugins_dirs: Vec<PathBuf>,
    },
    /// Check one plugin: a plugin.toml, or a folder holding one. Prints OK or why not.
    Check { path: PathBuf },
    /// Write a new drafter crate (Cargo.toml, plugin.toml, a drafter that reads a tap, tests).
    New {
        /// The drafter's name (also the folder's, unless --dir).
        name: String,
        /// Manifest kind.
        #[arg(long, default_value = "other", value_parser = clap::builder::PossibleValuesParser::new(mlx_spec_plugin_api::manifest::KNOWN_KINDS))]
        kind: String,
        /// Folder to create (default: ./NAME).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// The plugin SDK to depend on (default: plugin-api of the checkout this binary was built in).
        #[arg(long, value_name = "DIR")]
        sdk: Option<PathBuf>,
    },
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

#[derive(Args)]
struct ServeArgs {
    /// The deploy config: model, plugins, drafters, sampling defaults, [server] (optional).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address to listen on (default: the file's, else 127.0.0.1).
    #[arg(long)]
    host: Option<String>,
    /// Port (default: the file's, else 8000; 0 picks a free one).
    #[arg(long)]
    port: Option<u16>,
    /// Model folder (overrides the file's).
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
    /// Directory of drafter plugins (repeatable; overrides the file's).
    #[arg(long = "plugins-dir", value_name = "DIR")]
    plugins_dirs: Vec<PathBuf>,
    /// Default drafter of requests: a drafter of the file, a plugin's name, or `off`.
    #[arg(long)]
    drafter: Option<String>,
}

/// Where sampled tokens are drawn (hidden `--sampler`; the deploy config's `drawn_on`).
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SamplerArg {
    Auto,
    Device,
    Host,
}

impl SamplerArg {
    fn place(self) -> DrawPlace {
        match self {
            SamplerArg::Auto => DrawPlace::Auto,
            SamplerArg::Device => DrawPlace::Device,
            SamplerArg::Host => DrawPlace::Host,
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

// Random weights generate nothing a user reads; the lab's GPU runs use them (hidden here).
#[derive(Args)]
#[command(
    mut_arg("random_weights", |a| a.hide(true)),
    mut_arg("weights_seed", |a| a.hide(true)),
    mut_arg("random_bits", |a| a.hide(true)),
    mut_arg("random_group_size", |a| a.hide(true))
)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    random: RandomArgs,
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
    /// Where sampled tokens are drawn: `auto` (the device, except top-p alone on the CPU),
    /// `device`, or `host` (float64); the same distribution, other tokens for a seed.
    #[arg(long, value_enum, default_value = "auto", hide = true)]
    sampler: SamplerArg,
    /// Print one JSON object {"tokens", "text", "stats"} instead of streaming text.
    #[arg(long)]
    json: bool,
}

/// Which drafter to use and how.
struct DrafterChoice {
    name: String,
    plugins_dirs: Vec<PathBuf>,
    num_draft_tokens: Option<usize>,
    overrides: toml::Table,
    auto_off: bool,
    fitted_draft_length: bool,
}

/// Everything one generation needs, from flags or from a deploy config.
struct Job<'a> {
    model: ModelArgs,
    random: RandomArgs,
    input: &'a PromptArgs,
    max_tokens: usize,
    sampling: SamplingParams,
    ignore_eos: bool,
    drafter: Option<DrafterChoice>,
    json: bool,
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
    let registry = match &job.drafter {
        Some(choice) => Some(Registry::scan(&choice.plugins_dirs)?),
        None => None,
    };
    let provider = match (&job.drafter, &registry) {
        (Some(choice), Some(registry)) => {
            let plugin = registry.get(&choice.name)?;
            let manifest = plugin.manifest;
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
            let trained_for = plugins::trained_for(plugin, &choice.overrides)?;
            let provider = instantiate(plugin, &choice.overrides)?;
            Some((provider, k, manifest, trained_for, &choice.name))
        }
        _ => None,
    };

    let loaded = load_model(&job.model, &job.random)?;
    if let Some((_, _, manifest, trained_for, name)) = &provider {
        plugins::check_needs(manifest, &target_spec(&loaded.model))?;
        plugins::warn_if_trained_for_another_target(
            trained_for.as_ref(),
            name,
            &loaded.model,
            &job.model.model,
        )?;
    }
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
        Some((provider, k, ..)) => {
            let options = SpecOptions {
                num_draft_tokens: *k,
                auto_off: job.drafter.as_ref().is_some_and(|d| d.auto_off),
                fitted_draft_length: job.drafter.as_ref().is_some_and(|d| d.fitted_draft_length),
            };
            let (t, s, spec) = generate_speculative(
                &loaded.model,
                &request,
                Some(provider),
                options,
                &mut GateMemory::default(),
                &mut print,
            )?;
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
        // Bytes of an incomplete character held back at the end: as the decoded text has them.
        if let Some(t) = tok {
            write!(stdout, "{}", stream.finish(t)?)?;
        }
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
                    .or_else(|| spec
                        .drafting_skipped
                        .as_ref()
                        .map(|why| format!(" (drafter not asked: {why})")))
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
            fitted_draft_length: true,
        }),
        None => None,
    };
    run_job(Job {
        model: args.model,
        random: args.random,
        input: &args.input,
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            seed: args.seed,
            draw: args.sampler.place(),
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
            fused_kernels: FusedKernelsArg::Default,
            handoff_layers: cfg.model.handoff_layers,
        },
        random: RandomArgs::none(),
        input: &args.input,
        max_tokens: s.max_tokens,
        sampling: SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            seed: s.seed,
            draw: match s.drawn_on {
                DrawnOn::Auto => DrawPlace::Auto,
                DrawnOn::Device => DrawPlace::Device,
                DrawnOn::Host => DrawPlace::Host,
            },
        },
        ignore_eos: false,
        drafter: cfg.drafter.as_ref().map(|d| DrafterChoice {
            name: d.name.clone(),
            plugins_dirs: if cfg.plugins.dirs.is_empty() {
                vec![mlx_spec::default_plugins_dir()]
            } else {
                cfg.plugins.dirs.clone()
            },
            num_draft_tokens: d.num_draft_tokens,
            overrides: d.config.clone(),
            auto_off: d.auto_off,
            fitted_draft_length: d.fitted_draft_length,
        }),
        json: args.json,
    })
}

fn dtype_of(text: &str) -> DtypeArg {
    match text {
        "f32" => DtypeArg::F32,
        "bf16" => DtypeArg::Bf16,
        "f16" => DtypeArg::F16,
        _ => DtypeArg::Auto,
    }
}

fn draw_place(d: DrawnOn) -> DrawPlace {
    match d {
        DrawnOn::Auto => DrawPlace::Auto,
        DrawnOn::Device => DrawPlace::Device,
        DrawnOn::Host => DrawPlace::Host,
    }
}

/// The server's settings: the deploy file (if any), then the flags over it.
fn serve_options(args: ServeArgs) -> Result<ServeOptions> {
    let cfg = match &args.config {
        Some(path) => DeployConfig::load(path)?,
        None => DeployConfig::default(),
    };
    let sv = &cfg.server;
    let model_path = args
        .model
        .clone()
        .or_else(|| cfg.model.path.clone())
        .unwrap_or_else(mlx_spec::default_model_path);
    let plugins_dirs = if !args.plugins_dirs.is_empty() {
        args.plugins_dirs.clone()
    } else if !cfg.plugins.dirs.is_empty() {
        cfg.plugins.dirs.clone()
    } else {
        vec![mlx_spec::default_plugins_dir()]
    };
    let mut drafters = Vec::new();
    if let Some(d) = &cfg.drafter {
        drafters.push(DrafterSpec {
            name: d.name.clone(),
            plugin: d.name.clone(),
            num_draft_tokens: d.num_draft_tokens,
            overrides: d.config.clone(),
            auto_off: d.auto_off,
            fitted_draft_length: d.fitted_draft_length,
            origin: cfg.locate("drafter", None),
        });
    }
    for (name, d) in &cfg.drafters {
        drafters.push(DrafterSpec {
            name: name.clone(),
            plugin: d.plugin.clone().unwrap_or_else(|| name.clone()),
            num_draft_tokens: d.num_draft_tokens,
            overrides: d.config.clone(),
            auto_off: d.auto_off,
            fitted_draft_length: d.fitted_draft_length,
            origin: cfg.locate(&format!("drafters.{name}"), None),
        });
    }
    let default_drafter = match (&args.drafter, &sv.default_drafter) {
        (Some(name), _) if name == "off" => None,
        (Some(name), _) => {
            if !drafters.iter().any(|d| &d.name == name) {
                // A plugin by its name, with its manifest's defaults.
                drafters.push(DrafterSpec {
                    name: name.clone(),
                    plugin: name.clone(),
                    num_draft_tokens: None,
                    overrides: toml::Table::new(),
                    auto_off: true,
                    fitted_draft_length: true,
                    origin: "--drafter".to_owned(),
                });
            }
            Some(name.clone())
        }
        (None, Some(name)) if name == "off" => None,
        (None, Some(name)) => Some(name.clone()),
        (None, None) => cfg.drafter.as_ref().map(|d| d.name.clone()),
    };
    let host = args.host.clone().unwrap_or_else(|| sv.host.clone());
    let ip: std::net::IpAddr = host.parse().with_context(|| {
        format!("--host {host:?} is not an IP address (127.0.0.1, 0.0.0.0, ::1, ...)")
    })?;
    let api_key = match (&sv.api_key, &sv.api_key_env) {
        (Some(key), _) => Some(key.clone()),
        (None, Some(var)) => match std::env::var(var) {
            Ok(key) if !key.is_empty() => Some(key),
            _ => bail!(
                "{}: the environment variable {var} holding the API key is not set",
                cfg.locate("server", Some("api_key_env"))
            ),
        },
        (None, None) => None,
    };
    let model_name = sv.model_name.clone().unwrap_or_else(|| {
        model_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".to_owned())
    });
    let s = &cfg.sampling;
    let defaults = Defaults {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        max_tokens: s.max_tokens.max(1),
        draw: draw_place(s.drawn_on),
    };
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        seed: 0,
        draw: DrawPlace::Auto,
    }
    .validate()
    .with_context(|| format!("{}: [sampling]", cfg.locate("sampling", None)))?;
    let model_args = ModelArgs {
        model: model_path,
        device: cfg.model.device,
        dtype: dtype_of(&cfg.model.dtype),
        fused_kernels: FusedKernelsArg::Default,
        handoff_layers: cfg.model.handoff_layers,
    };
    Ok(ServeOptions {
        engine: EngineConfig {
            load: model_args.load_options(&RandomArgs::none())?,
            plugins_dirs,
            drafters,
            max_active: sv.max_active,
        },
        addr: std::net::SocketAddr::new(ip, args.port.unwrap_or(sv.port)),
        api_key,
        model_name,
        default_drafter,
        defaults,
        limits: Limits {
            max_active: sv.max_active,
            queue_length: sv.queue_length,
            max_prompt_tokens: sv.max_prompt_tokens,
            max_new_tokens: sv.max_new_tokens,
            max_body_bytes: sv.max_body_bytes,
            request_timeout: std::time::Duration::from_secs_f64(sv.request_timeout_s),
        },
    })
}

fn run_draft(args: DraftArgs) -> Result<()> {
    if args.num_draft_tokens == 0 || args.num_draft_tokens > 64 {
        bail!(
            "--num-draft-tokens must be between 1 and 64, got {}",
            args.num_draft_tokens
        );
    }
    let registry = Registry::scan(&args.plugins_dirs)?;
    let plugin = registry.get(&args.drafter)?;
    let overrides = parse_overrides(&args.drafter_set)?;
    let trained_for = plugins::trained_for(plugin, &overrides)?;
    let provider = instantiate(plugin, &overrides)?;
    let loaded = load_model(&args.model, &args.random)?;
    plugins::check_needs(plugin.manifest, &target_spec(&loaded.model))?;
    plugins::warn_if_trained_for_another_target(
        trained_for.as_ref(),
        &args.drafter,
        &loaded.model,
        &args.model.model,
    )?;
    let ids = prompt_ids(&args.input, loaded.tokenizer.as_ref(), &args.model.model)?;
    let result =
        mlx_spec::speculative::first_drafts(&loaded.model, &provider, &ids, args.num_draft_tokens)?;
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
        return Ok(());
    }
    let show = |ids: &[u32]| match &loaded.tokenizer {
        Some(t) => t
            .decode(ids)
            .map(|text| format!("{ids:?} {text:?}"))
            .unwrap_or_else(|_| format!("{ids:?}")),
        None => format!("{ids:?}"),
    };
    println!("anchor: {}", show(&[result.anchor]));
    println!("drafts: {}", show(&result.drafts));
    Ok(())
}

/// Rows with fewer samples than this take the threshold of the row before them.
const CALIBRATION_MIN_SAMPLES: usize = 30;

fn run_calibrate(args: CalibrateArgs) -> Result<()> {
    use mlx_spec::calibrate::{fit_thresholds, read_rounds, replay};

    let registry = Registry::scan(&args.plugins_dirs)?;
    let plugin = registry.get(&args.drafter)?;
    let mut overrides = parse_overrides(&args.drafter_set)?;
    // Where the thresholds go: beside the checkpoint the drafter will load.
    let out = match &args.out {
        Some(path) => path.clone(),
        None => {
            let checkpoint = overrides
                .get("checkpoint")
                .or_else(|| plugin.manifest.defaults.get("checkpoint"))
                .and_then(|v| v.as_str())
                .with_context(|| {
                    format!(
                        "the {} drafter names no checkpoint folder; pass --out",
                        args.drafter
                    )
                })?;
            plugin
                .dir
                .join(checkpoint)
                .join("confidence_thresholds.json")
        }
    };
    let log = std::env::temp_dir().join(format!(
        "mlx-spec-calibration-{}-{}.jsonl",
        args.drafter,
        std::process::id()
    ));
    let _ = std::fs::remove_file(&log);
    // The whole block every round, its rounds logged: what the fit needs to see.
    overrides.insert("confidence_threshold".into(), toml::Value::Float(0.0));
    overrides.insert(
        "calibration_log".into(),
        toml::Value::String(log.to_string_lossy().into_owned()),
    );
    let trained_for = plugins::trained_for(plugin, &overrides)?;
    let provider = instantiate(plugin, &overrides)?;
    let loaded = load_model(&args.model, &RandomArgs::none())?;
    plugins::check_needs(plugin.manifest, &target_spec(&loaded.model))?;
    plugins::warn_if_trained_for_another_target(
        trained_for.as_ref(),
        &args.drafter,
        &loaded.model,
        &args.model.model,
    )?;
    let tokenizer = loaded.tokenizer.as_ref().with_context(|| {
        format!(
            "{} has no tokenizer.json to encode the prompt set",
            args.model.model.display()
        )
    })?;
    let prompts = mlx_spec::bench::read_prompt_set(&args.prompt_set, tokenizer)?;
    let options = SpecOptions {
        num_draft_tokens: 64,
        auto_off: false,
        fitted_draft_length: false,
    };
    let bar = indicatif::ProgressBar::new(prompts.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "calibrating {bar:30} {pos}/{len} prompts {elapsed}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let run = (|| -> Result<()> {
        for prompt in &prompts {
            let request = GenerateRequest {
                prompt_ids: prompt.clone(),
                max_tokens: args.gen_tokens,
                sampling: SamplingParams::default(),
                stop_ids: Vec::new(),
                ignore_eos: true,
            };
            let (_, _, stats) = generate_speculative(
                &loaded.model,
                &request,
                Some(&provider),
                options,
                &mut GateMemory::default(),
                |_| Ok(()),
            )?;
            if let Some(e) = stats.drafter_error {
                bail!("the {} drafter failed: {e}", args.drafter);
            }
            bar.inc(1);
        }
        Ok(())
    })();
    bar.finish_and_clear();
    drop(provider);
    let rounds = run.and_then(|()| {
        read_rounds(&log).with_context(|| {
            format!(
                "the {} drafter wrote no calibration log: does it take a `calibration_log` setting?",
                args.drafter
            )
        })
    });
    let _ = std::fs::remove_file(&log);
    let rounds = rounds?;
    let fit = fit_thresholds(&rounds, args.min_acceptance, CALIBRATION_MIN_SAMPLES)?;
    let (before, after) = (replay(&rounds, &[]), replay(&rounds, &fit.thresholds));
    let file = json!({
        "thresholds": fit.thresholds,
        "min_acceptance": args.min_acceptance,
        "prompt_set": args.prompt_set.file_name().map(|n| n.to_string_lossy().into_owned()),
        "rounds": rounds.len(),
        "rows": fit.rows,
        "uncut": before,
        "cut": after,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&file)? + "\n")
        .with_context(|| format!("cannot write {}", out.display()))?;
    println!("row  samples  accepted  threshold");
    for r in &fit.rows {
        let note = if r.inherited {
            " (too few samples: the row before's)"
        } else {
            ""
        };
        println!(
            "{:>3}  {:>7}  {:>8}  {:>9.3}{note}",
            r.row, r.samples, r.accepted, r.threshold
        );
    }
    let per_round = |r: mlx_spec::calibrate::Replayed| {
        (
            r.proposed as f64 / r.rounds as f64,
            r.accepted as f64 / r.rounds as f64,
        )
    };
    let ((p0, a0), (p1, a1)) = (per_round(before), per_round(after));
    println!(
        "{} rounds: uncut {p0:.2} drafts proposed, {a0:.2} accepted a round; with these thresholds {p1:.2} proposed, {a1:.2} accepted",
        rounds.len()
    );
    println!("wrote {}", out.display());
    Ok(())
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
                    Ok(library) => format!("ok (interface revision {})", library.revision),
                    Err(e) => format!("unusable: {e}"),
                };
                println!("{:<16} {:<10} {:<12} {}", p.name(), version, kind, status);
            }
            Ok(())
        }
        PluginsCommand::New {
            name,
            kind,
            dir,
            sdk,
        } => {
            let home = mlx_spec::home();
            let mlx_sys = home.join(".mlx/mlx-sys");
            let scaffold = mlx_spec::scaffold::Scaffold {
                dir: dir.unwrap_or_else(|| PathBuf::from(&name)),
                name,
                kind,
                sdk: sdk.unwrap_or_else(|| home.join("plugin-api")),
                mlx_sys: mlx_sys.is_dir().then_some(mlx_sys),
            };
            scaffold.write()?;
            println!(
                "wrote {}: build it with `cargo build --release`, copy the library next to plugin.toml, then `mlx-spec plugins check {}`",
                scaffold.dir.display(),
                scaffold.dir.display()
            );
            Ok(())
        }
        PluginsCommand::Check { path } => {
            let manifest_path = if path.is_dir() {
                path.join("plugin.toml")
            } else {
                path.clone()
            };
            let manifest = read_manifest(&manifest_path).map_err(anyhow::Error::msg)?;
            let library = plugins::load(&manifest_path, &manifest).map_err(anyhow::Error::msg)?;
            println!(
                "OK {} {} ({}), interface revision {}",
                manifest.plugin.name,
                manifest.plugin.version,
                manifest_path.display(),
                library.revision
            );
            Ok(())
        }
    }
}

/// Context used by `perplexity`: `--context`, else the model's, else 8192.
fn perplexity_context(args: &PerplexityArgs) -> Result<usize> {
    if let Some(n) = args.context {
        if n == 0 {
            bail!("--context must be at least 1");
        }
        return Ok(n);
    }
    let (_, config_path, _) = mlx_spec::load::read_config(&args.model.model)?;
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("cannot read {}", config_path.display()))?;
    let raw: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", config_path.display()))?;
    Ok(mlx_spec::perplexity::served_context(&raw).unwrap_or(8192))
}

fn run_perplexity(args: PerplexityArgs) -> Result<()> {
    use mlx_spec::perplexity::{text_nll, Nll};
    let context = perplexity_context(&args)?;
    // Read every file first: a missing one fails before the model loads.
    let mut texts = Vec::with_capacity(args.files.len());
    for path in &args.files {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
        texts.push(text);
    }
    let loaded = load_model(&args.model, &RandomArgs::none())?;
    let tokenizer = loaded.tokenizer.as_ref().with_context(|| {
        format!(
            "{} has no tokenizer.json: perplexity needs one to read text",
            args.model.model.display()
        )
    })?;
    let bar = (!args.json && std::io::stderr().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new(texts.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("scoring {bar:30} {pos}/{len} files {elapsed}")
                .expect("static template"),
        );
        bar
    });
    let mut total = Nll {
        nats: 0.0,
        tokens: 0,
    };
    let mut rows = Vec::with_capacity(texts.len());
    for (path, text) in args.files.iter().zip(&texts) {
        let what = path.display().to_string();
        let nll = text_nll(&loaded.model, tokenizer, text, context, &what)?;
        total.add(nll);
        rows.push((what, nll));
        if let Some(bar) = &bar {
            bar.inc(1);
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        let files: Vec<_> = rows
            .iter()
            .map(|(path, nll)| {
                json!({
                    "path": path,
                    "tokens": nll.tokens,
                    "nats": nll.nats,
                    "nats_per_token": nll.per_token(),
                    "perplexity": nll.perplexity(),
                })
            })
            .collect();
        let report = json!({
            "model": args.model.model.display().to_string(),
            "context": context,
            "files": files,
            "tokens": total.tokens,
            "nats": total.nats,
            "nats_per_token": total.per_token(),
            "perplexity": total.perplexity(),
        });
        writeln!(out, "{report}")?;
    } else {
        for (path, nll) in &rows {
            writeln!(
                out,
                "{path}: {} tokens, {:.4} nats/token, perplexity {:.3}",
                nll.tokens,
                nll.per_token(),
                nll.perplexity()
            )?;
        }
        writeln!(
            out,
            "total: {} files, {} tokens, {:.4} nats/token, perplexity {:.3} (context {context})",
            rows.len(),
            total.tokens,
            total.per_token(),
            total.perplexity()
        )?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Generate(args) => run_generate(args),
        Command::Run(args) => run_deploy(args),
        Command::Serve(args) => serve_options(args).and_then(mlx_spec::server::serve),
        Command::Bench(args) => mlx_spec::bench::run(&args),
        Command::Draft(args) => run_draft(args),
        Command::Plugins(cmd) => run_plugins(cmd),
        Command::Perplexity(args) => run_perplexity(args),
        Command::QuantizeDrafter(args) => mlx_spec::quantize_drafter::run(&args),
        Command::Calibrate(args) => run_calibrate(args),
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
    fn config_driven_runs_take_the_default_fused_kernels() {
        // The command line's default is the default set, as for config-driven runs.
        let cli = Cli::try_parse_from(["mlx-spec", "generate", "--prompt", "x"]).unwrap();
        let Command::Generate(args) = cli.command else {
            panic!("parsed another command")
        };
        assert_eq!(args.model.fused_kernels, FusedKernelsArg::Default);
        // And the loader's own default.
        assert_eq!(
            args.model.fused(),
            mlx_spec::load::LoadOptions::new("m").kernels
        );
    }

    #[test]
    fn fused_kernels_are_the_default_set_or_none() {
        let parse = |value: &str| {
            Cli::try_parse_from(["mlx-spec", "bench", "--fused-kernels", value]).map(|cli| {
                let Command::Bench(args) = cli.command else {
                    panic!("parsed another command")
                };
                args.model.fused()
            })
        };
        assert_eq!(parse("none").unwrap(), mlx_spec::kernels::Fused::default());
        assert_eq!(parse("default").unwrap(), mlx_spec::kernels::Fused::every());
        // Sets of single kernels and the removed variants are refused.
        assert!(parse("attention,products").is_err());
        assert!(parse("per-layer-input").is_err());
        assert!(
            Cli::try_parse_from(["mlx-spec", "bench", "--kernel-variants", "integer-dots"])
                .is_err()
        );
    }
}
