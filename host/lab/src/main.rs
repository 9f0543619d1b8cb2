//! `mlx-spec-lab`: the developer's instruments behind BENCHMARKS.md and `bench/gpu/run.sh`,
//! kept out of the product. It takes every option of `mlx-spec bench` (the same measurements,
//! built from the library's [`mlx_spec::bench`]) and adds comparisons of the fused CUDA
//! kernels, checks of the decode path against the CPU and against itself, replayed drafts,
//! sampling costs, host costs per operation and kernel source dumps (bench/gpu/README.md).

mod checks;
mod costs;
mod diagnostics;
mod fused;
mod kernel_sources;
mod replay;
mod sampling;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser};
use serde_json::json;

use mlx_spec::bench::verify_curve::verify_curve;
use mlx_spec::bench::{check_counts, measure_plain, plain_json, print_plain, synthetic_prompt};
use mlx_spec::command_line::{init_logging, load_model, BenchArgs};
use mlx_spec::model::gemma4::LogitsFor;

#[derive(Parser)]
#[command(
    name = "mlx-spec-lab",
    version,
    about = "Developer measurements and checks of mlx-spec's decode path (bench/gpu/README.md)"
)]
pub struct Cli {
    /// More logging on stderr (-v info, -vv debug).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(flatten)]
    common: BenchArgs,
    #[command(flatten)]
    lab: LabArgs,
}

impl std::ops::Deref for Cli {
    type Target = BenchArgs;
    fn deref(&self) -> &BenchArgs {
        &self.common
    }
}

/// The instruments: each either adds to the plain measurement ("Also") or replaces it
/// ("Instead").
#[derive(Args)]
pub struct LabArgs {
    /// Also compare pipelined decode with the default set of fused CUDA kernels and with none,
    /// alternating between them round by round in this process.
    #[arg(long)]
    pub compare_fused: bool,
    /// Also decode this many greedy tokens after a 16-token prompt on the chosen device and on
    /// the CPU, with the same weights in one process, and fail unless the tokens agree (use
    /// `--dtype f32`, and `MLX_ENABLE_TF32=0` on CUDA).
    #[arg(long, value_name = "N", conflicts_with = "drafter")]
    pub check_cpu: Option<usize>,
    /// Write the graph of one decode step (after the prompt) to this file in Graphviz DOT
    /// format and print its operations by kind: on a GPU a step costs roughly a fixed host
    /// time per operation.
    #[arg(long, value_name = "PATH", conflicts_with = "drafter")]
    pub dump_step_graph: Option<PathBuf>,
    /// Instead of a model: the host time one operation of each kind costs (MLX's addition,
    /// RMSNorm and matrix product, and on a CUDA GPU each fused product kernel), from chains
    /// of 400 operations on a 1024-wide bf16 vector. Says which operations to fuse next.
    #[arg(long, conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph"])]
    pub op_cost: bool,
    /// Instead of decoding: how fast a decode token's feed-forward block streams its weights
    /// (GB/s), with MLX's operations and, on a CUDA GPU, with the fused product kernels at
    /// each row count per warp; then the attention output product and the feed-forward block
    /// as three fused products and as one post-attention kernel (with `--fused-kernels
    /// ...,post-attention`); shapes from the --model config, 16 layers of bf16 weights.
    #[arg(long, conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph", "op_cost"])]
    pub feed_forward_speed: bool,
    /// Instead of a model: check fused CUDA kernels on random bf16 data. Decode attention
    /// against MLX's operations in float32 (heads of 256 and 512, buffers of 40 to 4 096 slots;
    /// fails beyond 1e-2); the window post-attention kernel against the single-token one
    /// (fails on any difference).
    #[arg(long, conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph", "op_cost", "feed_forward_speed"])]
    pub check_kernels: bool,
    /// Also decode greedily this many times from fresh caches and report whether the logits
    /// repeat bit for bit: the prefill's last logits, each step-by-step step fed the first
    /// run's tokens, and the tokens of pipelined runs. Tells a non-deterministic operation
    /// from a pipelining fault when pipelined and step-by-step decoding disagree.
    #[arg(long, value_name = "RUNS", conflicts_with = "drafter")]
    pub repeatability: Option<usize>,
    /// Instead of the decode measurements: write the full CUDA source of every fused kernel a
    /// decode step and verify window of this model calls, with the default kernels (and the
    /// product and attention-input kernels that serve the layers they do not), into this folder
    /// as MLX 0.32 would compile it (`<kernel>-<hash>.cu`, listed in `kernels.tsv` with block
    /// and grid sizes). Runs on the CPU: the calls are recorded, not run.
    /// `bench/gpu/compile_check.py` then compiles them with NVRTC for sm_90a, with no GPU.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph", "op_cost", "feed_forward_speed", "check_kernels", "repeatability"])]
    pub dump_kernel_sources: Option<PathBuf>,
    /// Instead of the decode measurements: time forwards over this many new tokens after the
    /// prompt (a verify window; one warm-up, then --repeats), each split into the host's graph
    /// building and the rest. With MLX_SPEC_PROFILE_DECODE set, a CUDA profiler's capture
    /// starts after the warm-up (`bench/gpu/run.sh verify-profile`).
    #[arg(long, value_name = "K", conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph", "op_cost", "feed_forward_speed", "check_kernels", "repeatability", "dump_kernel_sources"])]
    pub verify_window: Option<usize>,
    /// Instead of the decode measurements: speculative against plain greedy decoding with
    /// drafts replayed from the plain run's own output, each draft right with this probability
    /// (a list, one measurement each: `1,0.8,0.5,0`), for each draft length, way of sizing
    /// rounds and hand-off (`--replay-draft-lengths`, `--replay-sizings`, `--replay-handoffs`).
    /// A measuring instrument for shapes no drafter can accept on (random weights): what the
    /// verify loop gives at a known acceptance. The outputs are checked equal, as with a
    /// drafter.
    #[arg(long, value_name = "P", value_delimiter = ',', conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph", "op_cost", "feed_forward_speed", "check_kernels", "repeatability", "dump_kernel_sources", "verify_window"])]
    pub replay_drafts: Vec<f64>,
    /// Instead of the decode measurements: plain decoding greedy and with four sampling
    /// settings (temperature 0.8; with top-p 0.95; with top-k 64, top-p 0.95 and min-p 0.05;
    /// temperature 1.0), each drawn on the device and on the host (`--sampler`),
    /// alternated in one process, `--repeats` rounds each: what drawing tokens costs a step.
    #[arg(long, conflicts_with_all = ["drafter", "verify_curve", "compare_fused", "check_cpu", "dump_step_graph", "op_cost", "feed_forward_speed", "check_kernels", "repeatability", "dump_kernel_sources", "verify_window", "replay_drafts"])]
    pub compare_sampling: bool,
    /// With --replay-drafts: the most drafts a round, a list (one measurement each).
    #[arg(long, value_name = "K", value_delimiter = ',', default_value = "3,7")]
    pub replay_draft_lengths: Vec<usize>,
    /// With --replay-drafts: how rounds are sized, a list (one measurement each): `recent`
    /// (about twice the recent accepted tokens, plus one) and/or `fitted` (by the measured
    /// window costs and the acceptance at each draft position).
    #[arg(long, value_name = "WAY", value_delimiter = ',', default_value = "recent,fitted", value_parser = ["recent", "fitted"])]
    pub replay_sizings: Vec<String>,
    /// With --replay-drafts: layers a group when a verify window goes to the device, a list
    /// (one measurement each; 0: whole). Default: the process's `--handoff-layers`.
    #[arg(long, value_name = "N", value_delimiter = ',')]
    pub replay_handoffs: Vec<usize>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Whether MLX's default device is a CUDA GPU, where the fused kernels run.
fn on_cuda() -> bool {
    mlx_spec::kernels::on_cuda_gpu()
}

fn run(args: &Cli) -> Result<()> {
    check_counts(args)?;
    if let Some(drafter) = &args.spec.drafter {
        return mlx_spec::bench::speculative::run(args, drafter);
    }
    if args.lab.op_cost {
        return costs::run_op_cost(args);
    }
    if args.lab.feed_forward_speed {
        return costs::run_feed_forward_speed(args);
    }
    if args.lab.check_kernels {
        return checks::run_check_kernels(args);
    }
    let mut loaded = load_model(&args.model, &args.random)?;
    let weight_bytes = mlx_rs::memory::active_memory().unwrap_or(0);
    let prompt = synthetic_prompt(loaded.model.config.vocab_size, args.prompt_tokens);
    let model = &mut loaded.model;
    if !args.lab.replay_drafts.is_empty() {
        return replay::report_replayed_drafts(model, &prompt, args);
    }
    if let Some(runs) = args.lab.repeatability {
        return checks::report_repeatability(model, &prompt, runs, args.gen_tokens);
    }
    if let Some(dir) = &args.lab.dump_kernel_sources {
        return kernel_sources::dump_kernel_sources(model, &prompt, dir);
    }
    if let Some(k) = args.lab.verify_window {
        // The check is whether a whole window computes what steps compute, MLX's operations
        // included: let them take the window whole even where the loop does not trust them.
        model.set_settings(mlx_spec::model::gemma4::RunSettings {
            operation_windows_match_steps: true,
            ..model.settings()
        });
        return checks::report_verify_window(model, &prompt, k, args);
    }
    if args.lab.compare_sampling {
        return sampling::report_sampling(model, &prompt, args);
    }

    let speed = measure_plain(model, &prompt, args.gen_tokens, args.repeats, weight_bytes)?;
    let curve = if args.verify_curve {
        verify_curve(model, &prompt, args.repeats)?
    } else {
        Vec::new()
    };
    let step_ops = match &args.lab.dump_step_graph {
        Some(path) => Some(step_operations(model, &prompt, path)?),
        None => None,
    };
    let fused_comparison = if args.lab.compare_fused {
        if !on_cuda() {
            tracing::warn!(
                "--compare-fused: the fused kernels run on a CUDA GPU only; here every set runs \
                 MLX's operations, and their rates differ by noise alone"
            );
        }
        fused::compare_fused(model, &prompt, args)?
    } else {
        Vec::new()
    };
    let check = match args.lab.check_cpu {
        Some(n) => {
            let short = &prompt[..prompt.len().min(16)];
            Some(checks::check_against_cpu(
                model,
                short,
                n.max(1),
                args.model.device,
            )?)
        }
        None => None,
    };
    if args.json {
        let mut out = plain_json(args, model, &speed, &curve);
        out.insert(
            "fused_comparison".into(),
            json!(fused_comparison.iter().map(|f| json!({"kernels": f.name, "decode_tokens_per_s": f.tokens_per_s, "slowest_round_tokens_per_s": f.slowest_tokens_per_s, "fastest_round_tokens_per_s": f.fastest_tokens_per_s, "same_tokens_as_none": f.same_as_none, "first_step_logit_gap": f.logit_gap, "host_ms": {"build": f.host.build_ms, "submit": f.host.submit_ms, "wait": f.host.wait_ms}})).collect::<Vec<_>>()),
        );
        out.insert(
            "step_operations".into(),
            json!(step_ops
                .as_ref()
                .map(|c| json!({"total": c.values().sum::<usize>(), "by_kind": c}))),
        );
        out.insert(
            "cpu_check".into(),
            json!(check.as_ref().map(|c| json!({
                "same_tokens": c.device_tokens == c.cpu_tokens,
                "device_tokens": c.device_tokens,
                "cpu_tokens": c.cpu_tokens, "max_logit_diff": c.max_logit_diff, "top2_margin": c.top2_margin,
            }))),
        );
        println!("{}", serde_json::Value::Object(out));
    } else {
        print_plain(args, model, &speed, &curve);
        if !fused_comparison.is_empty() {
            println!();
            println!("| fused kernels | decode (tok/s): median (slowest-fastest round) | host ms a step: build, submit, waiting | tokens as with none | first step's logits vs none: largest difference |");
            println!("|---|---|---|---|---|");
            for f in &fused_comparison {
                println!(
                    "| {} | {:.1} ({:.1}-{:.1}) | {:.2}, {:.2}, {:.2} | {} | {:.3e} |",
                    f.name,
                    f.tokens_per_s,
                    f.slowest_tokens_per_s,
                    f.fastest_tokens_per_s,
                    f.host.build_ms,
                    f.host.submit_ms,
                    f.host.wait_ms,
                    if f.same_as_none { "same" } else { "differ" },
                    f.logit_gap
                );
            }
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
                "{} vs CPU, same weights: {} greedy tokens {}; logits after the prompt differ by at most {:.3e} (top-2 margin {:.3e})",
                format!("{:?}", args.model.device).to_uppercase(),
                c.cpu_tokens.len(),
                if c.device_tokens == c.cpu_tokens { "identical" } else { "DIFFER" },
                c.max_logit_diff,
                c.top2_margin
            );
        }
    }
    if let Some(c) = &check {
        if c.device_tokens != c.cpu_tokens {
            bail!(
                "greedy tokens differ between {:?} and CPU: {:?} vs {:?}",
                args.model.device,
                c.device_tokens,
                c.cpu_tokens
            );
        }
    }
    Ok(())
}

/// The graph of one decode step after `prompt`, written to `path` as Graphviz DOT, and its
/// operations counted by kind.
fn step_operations(
    model: &mlx_spec::model::gemma4::Gemma4Model,
    prompt: &[u32],
    path: &PathBuf,
) -> Result<std::collections::BTreeMap<String, usize>> {
    let mut cache = model.new_cache();
    let logits = mlx_spec::generate::prefill(model, &mut cache, prompt)?;
    let token = mlx_rs::ops::indexing::argmax_axis(&logits, -1, false)?;
    let out = model.forward_ids(&token.reshape(&[1, 1])?, &mut cache, LogitsFor::Last, false)?;
    let next = mlx_rs::ops::indexing::argmax_axis(&out.logits, -1, false)?;
    diagnostics::export_dot(&next, path)?;
    let dot = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read back {}", path.display()))?;
    Ok(diagnostics::count_operations(&dot))
}
