//! `mlx-spec bench`: prefill and decode speed, plain and speculative, and the diagnostics of
//! the decode path (fused-kernel comparisons, CPU cross-checks, repeatability, host time per
//! operation, kernel checks). Part of the command line; the measured work lives in the library.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mlx_rs::Dtype;
use serde_json::json;

use mlx_spec::device::{self, DeviceKind};
use mlx_spec::generate::{generate, greedy_step, greedy_token, prefill, GenerateRequest};
use mlx_spec::model::gemma4::{Gemma4Model, LogitsFor};
use mlx_spec::plugins::{self, instantiate, Registry};
use mlx_spec::sampler::SamplingParams;
use mlx_spec::speculative::{generate_speculative, GateMemory, SpecOptions};
use mlx_spec::tokenizer::{ChatMessage, Tokenizer};

use crate::{load_model, parse_overrides, BenchArgs};
use mlx_spec::load::read_config;

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
/// The chat turns of a prompt set (JSON lines of `{"messages": [{"role", "content"}, ...]}`,
/// as `bench/prompts/*.jsonl`), each encoded as Gemma 4 chat.
pub(crate) fn read_prompt_set(path: &Path, tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
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
        prompts.push(tokenizer.encode_chat(&messages)?);
    }
    if prompts.is_empty() {
        bail!("the prompt set {} is empty", path.display());
    }
    Ok(prompts)
}

fn run_bench_spec(args: &BenchArgs, drafter: &str) -> Result<()> {
    let registry = Registry::scan(&args.spec.plugins_dirs)?;
    let plugin = registry.get(drafter)?;
    let manifest = plugin.manifest;
    let provider = instantiate(plugin, &parse_overrides(&args.spec.drafter_set)?)?;
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
    let loaded = load_model(&args.model, &args.random)?;
    let model = &loaded.model;
    plugins::check_needs(
        manifest,
        &mlx_spec::speculative::target_port::target_spec(model),
    )?;
    let need_tokenizer = || {
        loaded
            .tokenizer
            .as_ref()
            .context("--prompt-file/--prompt-set need a model with tokenizer.json")
    };
    let prompts: Vec<Vec<u32>> = if let Some(path) = &args.prompt_set {
        read_prompt_set(path, need_tokenizer()?)?
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
        fitted_draft_length: !args.spec.recent_draft_length,
    };
    let (mut plain_rates, mut spec_rates) = (Vec::new(), Vec::new());
    // Decode alone (after the prefill, which speculation does not change): on long prompts
    // the prefill bounds what any drafter can do for a whole request.
    let (mut plain_decode_rates, mut spec_decode_rates) = (Vec::new(), Vec::new());
    let mut totals = mlx_spec::speculative::SpecStats::default();
    // The measured round's drafts and accepted tokens of each prompt (`--json`: a paired
    // comparison of two drafters takes prompts as its unit).
    let mut per_prompt = Vec::new();
    // What auto-off learned carries from each request to the next, as in a server: the
    // warm-up round teaches it, the measured rounds start from it.
    let mut gate_memory = GateMemory::default();
    // The window kernels compile before anything is timed (the warm-up round below may not
    // meet every window length the measured rounds run).
    mlx_spec::speculative::warm_up_windows(model)?;
    for round in 0..=args.repeats {
        let (mut plain_s, mut spec_s, mut generated) = (0.0, 0.0, 0usize);
        let (mut plain_decode_s, mut spec_decode_s) = (0.0, 0.0);
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
            let (plain_tokens, plain_stats) = generate(model, &request, |_| Ok(()))?;
            let plain_s_prompt = start.elapsed().as_secs_f64();
            plain_s += plain_s_prompt;
            plain_decode_s += plain_stats.decode_seconds;
            let start = Instant::now();
            let (spec_tokens, spec_stats, stats) = generate_speculative(
                model,
                &request,
                Some(&provider),
                options,
                &mut gate_memory,
                |_| Ok(()),
            )?;
            let spec_s_prompt = start.elapsed().as_secs_f64();
            spec_s += spec_s_prompt;
            spec_decode_s += spec_stats.decode_seconds;
            if spec_tokens != plain_tokens {
                bail!(
                    "speculative output differs from plain output (round {round}; {}): this is a bug, please report it",
                    explain_mismatch(model, &request, &plain_tokens, &spec_tokens)
                );
            }
            generated += spec_tokens.len();
            if round == args.repeats {
                totals.num_drafts += stats.num_drafts;
                totals.num_draft_tokens += stats.num_draft_tokens;
                totals.num_accepted_tokens += stats.num_accepted_tokens;
                totals.target_forwards += stats.target_forwards;
                totals.drafter_seconds += stats.drafter_seconds;
                per_prompt.push(json!({"num_drafts": stats.num_drafts,
                    "num_accepted_tokens": stats.num_accepted_tokens,
                    "spec_seconds": spec_s_prompt, "plain_seconds": plain_s_prompt}));
            }
        }
        if round > 0 {
            plain_rates.push(generated as f64 / plain_s);
            spec_rates.push(generated as f64 / spec_s);
            plain_decode_rates.push(generated as f64 / plain_decode_s);
            spec_decode_rates.push(generated as f64 / spec_decode_s);
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
    let (plain_decode, spec_decode) = (median(plain_decode_rates), median(spec_decode_rates));
    if args.json {
        println!(
            "{}",
            json!({"model": args.model.model.display().to_string(), "drafter": drafter, "num_draft_tokens": k,
                   "prompts": prompts.len(), "prompt_tokens": prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
                   "plain_tokens_per_s": plain, "spec_tokens_per_s": spec, "speedup": spec / plain,
                   "plain_decode_tokens_per_s": plain_decode, "spec_decode_tokens_per_s": spec_decode,
                   "decode_speedup": spec_decode / plain_decode,
                   "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                   "num_accepted_tokens": stats.num_accepted_tokens, "mean_acceptance_length": stats.mean_acceptance_length,
                   "target_forwards": stats.target_forwards, "drafter_seconds": stats.drafter_seconds,
                   "drafter_us_per_forward": 1e6 * stats.drafter_seconds / stats.target_forwards.max(1) as f64,
                   "per_prompt": per_prompt})
        );
    } else {
        println!("| model | drafter (k) | prompts (tokens) | generated each | plain tok/s | spec tok/s | speedup | decode alone: plain / spec tok/s, speedup | acceptance length | forwards | drafter µs/forward |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        println!(
            "| {} | {drafter} ({k}) | {} ({prompt_tokens}) | {} | {plain:.1} | {spec:.1} | {:.2}x | {plain_decode:.1} / {spec_decode:.1}, {:.2}x | {:.2} | {} | {:.1} |",
            args.model.model.file_name().unwrap_or_default().to_string_lossy(),
            prompts.len(),
            args.gen_tokens,
            spec / plain,
            spec_decode / plain_decode,
            stats.mean_acceptance_length,
            stats.target_forwards,
            1e6 * stats.drafter_seconds / stats.target_forwards.max(1) as f64
        );
    }
    Ok(())
}

/// One replayed case: drafts a round, the chance each is right, how rounds are sized and how
/// many layers a group the verify window goes to the device in (0: whole).
#[derive(Clone, Copy)]
struct ReplayCase {
    k: usize,
    p: f64,
    fitted: bool,
    handoff: usize,
}

impl ReplayCase {
    fn sizing(&self) -> &'static str {
        if self.fitted {
            "fitted"
        } else {
            "recent"
        }
    }

    fn handoff(&self) -> String {
        match self.handoff {
            0 => "whole".to_owned(),
            n => format!("{n} layers"),
        }
    }
}

/// Why a speculative output differed from a plain one, for the error: each compared with a
/// greedy decode made one synchronised step at a time (the reference the window kernels are
/// checked against, `bench --verify-window`), and a second pipelined plain run, so that a
/// fault of the pipelined plain run (seen intermittently with 4-bit weights on CUDA, in the
/// first pipelined decode of a process) is told from one of the verify loop.
fn explain_mismatch(
    model: &Gemma4Model,
    request: &GenerateRequest,
    plain: &[u32],
    spec: &[u32],
) -> String {
    let first_difference = |a: &[u32], b: &[u32]| {
        a.iter()
            .zip(b)
            .position(|(x, y)| x != y)
            .or((a.len() != b.len()).then_some(a.len().min(b.len())))
    };
    let describe = |tokens: &[u32], reference: &[u32]| match first_difference(tokens, reference) {
        None => "equals it".to_owned(),
        Some(i) => format!("first differs at token {i}"),
    };
    let stepwise = (|| -> Result<Vec<u32>> {
        let mut cache = model.new_cache();
        let logits = prefill(model, &mut cache, &request.prompt_ids)?;
        let n = request.max_tokens.saturating_sub(1);
        Ok(decode_step_by_step(model, &mut cache, &logits, n)?.0)
    })();
    let again = generate(model, request, |_| Ok(())).map(|(tokens, _)| tokens);
    match (stepwise, again) {
        (Ok(reference), Ok(again)) => format!(
            "against a step-by-step greedy decode: pipelined plain decoding {}, speculative {}, a second pipelined plain run {}",
            describe(plain, &reference),
            describe(spec, &reference),
            describe(&again, &reference),
        ),
        (Err(e), _) | (_, Err(e)) => format!("(the step-by-step check failed too: {e})"),
    }
}

/// Plain greedy decoding against speculation with replayed drafts (`--replay-drafts`): for
/// each draft length, hit rate, way of sizing rounds (recent acceptance, or fitted to the
/// measured costs) and hand-off of the verify window, side by side in every round, the
/// outputs checked equal.
fn report_replayed_drafts(model: &mut Gemma4Model, prompt: &[u32], args: &BenchArgs) -> Result<()> {
    use mlx_spec::model::gemma4::RunSettings;
    use mlx_spec::speculative::replay::{expected_acceptance_length, ReplayDrafter};
    if args.lab.replay_draft_lengths.contains(&0) {
        bail!("--replay-draft-lengths: every length must be at least 1");
    }
    let request = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens: args.gen_tokens,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        ignore_eos: true,
    };
    let configured = model.settings();
    let handoffs = if args.lab.replay_handoffs.is_empty() {
        vec![configured.handoff_layers]
    } else {
        args.lab.replay_handoffs.clone()
    };
    let mut cases = Vec::new();
    for &k in &args.lab.replay_draft_lengths {
        for &p in &args.lab.replay_drafts {
            for sizing in &args.lab.replay_sizings {
                for &handoff in &handoffs {
                    let fitted = sizing == "fitted";
                    cases.push(ReplayCase {
                        k,
                        p,
                        fitted,
                        handoff,
                    });
                }
            }
        }
    }
    // Per case: spec rates, then the last round's counters.
    let mut spec_rates = vec![Vec::new(); cases.len()];
    let mut last_stats = vec![mlx_spec::speculative::SpecStats::default(); cases.len()];
    // Per case: the slowest drafted round of the measured rounds, seconds.
    let mut slowest = vec![0.0f64; cases.len()];
    let mut plain_rates = Vec::new();
    let most_drafts = args
        .lab
        .replay_draft_lengths
        .iter()
        .copied()
        .max()
        .unwrap_or(1);
    prime_windows(model, prompt, most_drafts + 1, args.gen_tokens)?;
    for round in 0..=args.repeats {
        let start = Instant::now();
        let (plain_tokens, _) = generate(model, &request, |_| Ok(()))?;
        let plain_s = start.elapsed().as_secs_f64();
        if round > 0 {
            plain_rates.push(plain_tokens.len() as f64 / plain_s);
        }
        for (i, case) in cases.iter().enumerate() {
            let provider = ReplayDrafter::new(plain_tokens.clone(), case.p, 0x5eed)
                .map_err(anyhow::Error::msg)?
                .into_provider();
            let options = SpecOptions {
                num_draft_tokens: case.k,
                auto_off: true,
                fitted_draft_length: case.fitted,
            };
            model.set_settings(RunSettings {
                handoff_layers: case.handoff,
                ..model.settings()
            });
            let start = Instant::now();
            let spec = generate_speculative(
                model,
                &request,
                Some(&provider),
                options,
                &mut GateMemory::default(),
                |_| Ok(()),
            );
            let spec_s = start.elapsed().as_secs_f64();
            model.set_settings(configured);
            let (spec_tokens, _, stats) = spec?;
            if spec_tokens != plain_tokens {
                bail!(
                    "speculative output differs from plain output ({} replayed drafts right with probability {}, rounds sized by {}, handed over {}, round {round}; {}): this is a bug, please report it",
                    case.k,
                    case.p,
                    case.sizing(),
                    case.handoff(),
                    explain_mismatch(model, &request, &plain_tokens, &spec_tokens)
                );
            }
            let rate = spec_tokens.len() as f64 / spec_s;
            // Every round on stderr: a median of two hides which round was slow, and why.
            eprintln!(
                "replay {} drafts, right with {}, sized by {}, handed over {}, round {round}{}: {rate:.1} tok/s, {} drafted rounds in {:.0} ms (slowest {:.1} ms, window of {}), {} forwards",
                case.k,
                case.p,
                case.sizing(),
                case.handoff(),
                if round == 0 { " (warm-up)" } else { "" },
                stats.num_drafts,
                stats.drafted_round_seconds * 1e3,
                stats.slowest_round_seconds * 1e3,
                stats.slowest_round_window,
                stats.target_forwards
            );
            if round > 0 {
                spec_rates[i].push(rate);
                slowest[i] = slowest[i].max(stats.slowest_round_seconds);
            }
            last_stats[i] = stats;
        }
    }
    let plain = median(plain_rates);
    let rows: Vec<_> = cases
        .iter()
        .zip(spec_rates)
        .zip(&last_stats)
        .zip(&slowest)
        .map(|(((case, rates), stats), &slow)| (case, median(rates), stats, slow))
        .collect();
    if args.json {
        let cases: Vec<_> = rows
            .iter()
            .map(|(c, spec, s, slow)| {
                json!({"num_draft_tokens": c.k, "hit_rate": c.p, "draft_length": c.sizing(),
                       "handoff_layers": c.handoff,
                       "spec_tokens_per_s": spec, "speedup": spec / plain,
                       "mean_acceptance_length": s.mean_acceptance_length,
                       "expected_acceptance_length": expected_acceptance_length(c.p, c.k),
                       "num_drafts": s.num_drafts, "num_draft_tokens_total": s.num_draft_tokens,
                       "num_accepted_tokens": s.num_accepted_tokens, "target_forwards": s.target_forwards,
                       "slowest_round_ms": slow * 1e3})
            })
            .collect();
        println!(
            "{}",
            json!({"model": args.model.model.display().to_string(), "prompt_tokens": prompt.len(),
                   "gen_tokens": args.gen_tokens, "repeats": args.repeats, "plain_tokens_per_s": plain, "cases": cases})
        );
    } else {
        println!("| drafts a round (k) | each right with | rounds sized by | window handed over | plain tok/s | spec tok/s | speedup | acceptance length (expected) | drafted rounds | forwards | slowest round |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for (c, spec, s, slow) in &rows {
            println!(
                "| {} | {} | {} | {} | {plain:.1} | {spec:.1} | {:.2}x | {:.2} ({:.2}) | {} | {} | {:.1} ms |",
                c.k,
                c.p,
                c.sizing(),
                c.handoff(),
                spec / plain,
                s.mean_acceptance_length,
                expected_acceptance_length(c.p, c.k),
                s.num_drafts,
                s.target_forwards,
                slow * 1e3
            );
        }
    }
    Ok(())
}

/// Plain decoding greedy and with several sampling settings (`--compare-sampling`), each
/// drawn on the device and on the host, alternated in one process: decode tokens a second,
/// median over `--repeats` rounds after one warm-up round.
fn report_sampling(model: &Gemma4Model, prompt: &[u32], args: &BenchArgs) -> Result<()> {
    use mlx_spec::sampler::DrawPlace;
    let sampled = |temperature, top_k, top_p, min_p| SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: 11,
        draw: DrawPlace::Device,
    };
    let settings = [
        ("greedy", SamplingParams::default()),
        ("temperature 0.8", sampled(0.8, 0, 1.0, 0.0)),
        ("temperature 0.8, top-p 0.95", sampled(0.8, 0, 0.95, 0.0)),
        (
            "temperature 1.0, top-k 64, top-p 0.95 (Gemma 4's own)",
            sampled(1.0, 64, 0.95, 0.0),
        ),
        (
            "temperature 0.8, top-k 64, top-p 0.95, min-p 0.05",
            sampled(0.8, 64, 0.95, 0.05),
        ),
    ];
    // (setting, drawn on the host): greedy draws nowhere but the device.
    let cases: Vec<(usize, bool)> = (0..settings.len())
        .flat_map(|i| {
            let ways: &[bool] = if i == 0 { &[false] } else { &[false, true] };
            ways.iter().map(move |&host| (i, host))
        })
        .collect();
    let mut rates = vec![Vec::new(); cases.len()];
    for round in 0..=args.repeats {
        for (c, &(i, host)) in cases.iter().enumerate() {
            let request = GenerateRequest {
                prompt_ids: prompt.to_vec(),
                max_tokens: args.gen_tokens,
                sampling: SamplingParams {
                    draw: if host {
                        DrawPlace::Host
                    } else {
                        DrawPlace::Device
                    },
                    ..settings[i].1
                },
                stop_ids: Vec::new(),
                ignore_eos: true,
            };
            let (_, stats) = generate(model, &request, |_| Ok(()))?;
            if round > 0 {
                rates[c].push(stats.decode_tokens_per_s);
            }
        }
    }
    let rates: Vec<f64> = rates.into_iter().map(median).collect();
    let greedy = rates[0];
    let drawn = |host: bool| if host { "host" } else { "device" };
    if args.json {
        let rows: Vec<_> = cases
            .iter()
            .zip(&rates)
            .map(|(&(i, host), rate)| json!({"sampling": settings[i].0, "drawn_on": drawn(host),
                                             "decode_tokens_per_s": rate, "of_greedy": rate / greedy}))
            .collect();
        println!(
            "{}",
            json!({"model": args.model.model.display().to_string(), "prompt_tokens": prompt.len(),
                   "gen_tokens": args.gen_tokens, "repeats": args.repeats, "sampling": rows})
        );
    } else {
        println!("| sampling | drawn on | decode tok/s | of greedy |");
        println!("|---|---|---|---|");
        for (&(i, host), rate) in cases.iter().zip(&rates) {
            println!(
                "| {} | {} | {rate:.1} | {:.2}x |",
                settings[i].0,
                drawn(host),
                rate / greedy
            );
        }
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
    cpu_tokens: Vec<u32>,
    /// Largest |difference| between the two devices' logits after the prompt.
    max_logit_diff: f32,
    /// Gap between the best and second-best logit there (how far from a tie the first pick was).
    top2_margin: f32,
}

/// Greedy decode of `n` tokens after `prompt` on the default device, then on the CPU with the
/// same weight arrays, so both runs compute the same function on the same values.
fn check_against_cpu(
    model: &mut Gemma4Model,
    prompt: &[u32],
    n: usize,
    device: DeviceKind,
) -> Result<CpuCheck> {
    let run = |model: &Gemma4Model| -> Result<(Vec<u32>, Vec<f32>)> {
        let mut cache = model.new_cache();
        let logits = prefill(model, &mut cache, prompt)?;
        let first = logits.as_dtype(Dtype::Float32)?;
        first.eval()?;
        let first = first.as_slice::<f32>().to_vec();
        let (tokens, _, _) = decode_step_by_step(model, &mut cache, &logits, n.saturating_sub(1))?;
        Ok((tokens, first))
    };
    let (device_tokens, device_logits) = run(model)?;
    // A CUDA build of libmlx cannot JIT-compile fused CPU kernels (it has no host compiler
    // setup), so the CPU reference runs every operation unfused.
    // SAFETY: plain global switches of libmlx, called between evaluations.
    unsafe { mlx_sys::mlx_disable_compile() };
    device::select(DeviceKind::Cpu)?;
    // The model's way of running was fixed for the device at load: the CPU runs MLX's
    // operations only (no fast path), handed over whole.
    let device_settings = model.settings();
    model.set_settings(mlx_spec::model::gemma4::RunSettings::default());
    let fast_path = model.set_fast_path(None);
    let cpu = run(model);
    model.set_fast_path(fast_path);
    model.set_settings(device_settings);
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
    // Compared across processes (`bench/gpu/run.sh kernel-cache`: kernels compiled by MLX
    // against those from mlx-spec's kernel cache).
    println!(
        "repeatability: reference logits digest {:016x} ({} steps)",
        logits_digest(&reference_logits),
        reference_logits.len()
    );
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

/// 64-bit FNV-1a over the bits of every logit of every step, in order: equal digests mean
/// bitwise-equal logits (to a chance of 2^-64).
fn logits_digest(steps: &[Vec<f32>]) -> u64 {
    steps
        .iter()
        .flatten()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

/// One verify window timed: the whole forward, and the part of it the host spent building
/// the lazy graph before evaluation began (milliseconds).
#[derive(Clone, Copy)]
struct WindowTime {
    total_ms: f64,
    build_ms: f64,
}

/// One forward over `window` after the cache's tokens, evaluated to its greedy picks and
/// timed, then rolled back so the next call sees the same cache. `handed_over`: as a verify
/// round runs it, its layers handed to the device in groups as they are built
/// (`--handoff-layers`); otherwise handed over whole when the picks are read.
fn time_window(
    model: &Gemma4Model,
    cache: &mut mlx_spec::model::gemma4::ModelCache,
    window: &[u32],
    handed_over: bool,
) -> Result<WindowTime> {
    let start = Instant::now();
    let logits = if handed_over {
        model.forward_to_read(window, cache, LogitsFor::All, false)?
    } else {
        model.forward(window, cache, LogitsFor::All, false)?
    }
    .logits;
    let picks = mlx_rs::ops::indexing::argmax_axis(&logits, -1, false)?;
    let built = start.elapsed();
    picks.eval()?;
    let total = start.elapsed();
    cache.trim(window.len())?;
    Ok(WindowTime {
        total_ms: total.as_secs_f64() * 1e3,
        build_ms: built.as_secs_f64() * 1e3,
    })
}

/// Runs a verify window of every size from 1 to `largest` after `prompt`, and again after
/// `prompt` and `generated` more tokens (the cache's buffers as a request's start and end
/// size them), so that every kernel a request's rounds can need is compiled before any round
/// is timed: a kernel compiled on its first use (about 20 s for a window size new to an
/// H200, BENCHMARKS.md) would otherwise make one round, and its case's median, slow.
fn prime_windows(
    model: &Gemma4Model,
    prompt: &[u32],
    largest: usize,
    generated: usize,
) -> Result<()> {
    let filler = window_of(model, generated);
    let later: Vec<u32> = prompt.iter().chain(&filler).copied().collect();
    for context in [prompt, &later[..]] {
        // Reserved as a speculative request reserves it, so the buffers take its sizes.
        let reserve = mlx_spec::model::gemma4::cache::DEFAULT_ROLLBACK_RESERVE.max(largest);
        let mut cache = mlx_spec::model::gemma4::ModelCache::with_reserve(&model.config, reserve);
        prefill(model, &mut cache, context)?;
        for size in 1..=largest {
            time_window(model, &mut cache, &window_of(model, size), true)?;
        }
    }
    Ok(())
}

/// `k` draft-like tokens (spread over the vocabulary, away from the special ids).
fn window_of(model: &Gemma4Model, k: usize) -> Vec<u32> {
    let vocab = model.config.vocab_size as u32;
    (0..k as u32)
        .map(|i| 3 + (i * 7919) % (vocab - 3))
        .collect()
}

/// One point of the verify cost curve: a window of `k` tokens handed to the device whole,
/// and handed over in groups of layers as a verify round hands it (`--handoff-layers`).
struct CurvePoint {
    k: usize,
    whole: WindowTime,
    handed_over: WindowTime,
}

/// Milliseconds of one forward over `k` new tokens after `prompt`, for k = 1, 2, 4, … 32
/// (median over `repeats`, the cache rolled back after each), with the host's share; each
/// window both ways, alternated.
fn verify_curve(model: &Gemma4Model, prompt: &[u32], repeats: usize) -> Result<Vec<CurvePoint>> {
    let mut cache = mlx_spec::model::gemma4::ModelCache::with_reserve(&model.config, 64);
    prefill(model, &mut cache, prompt)?;
    let medians = |times: &[WindowTime]| WindowTime {
        total_ms: median(times.iter().map(|t| t.total_ms).collect()),
        build_ms: median(times.iter().map(|t| t.build_ms).collect()),
    };
    let mut curve = Vec::new();
    for k in [1usize, 2, 4, 8, 16, 32] {
        let window = window_of(model, k);
        let (mut whole, mut handed_over) = (Vec::new(), Vec::new());
        for round in 0..=repeats {
            let times = (
                time_window(model, &mut cache, &window, false)?,
                time_window(model, &mut cache, &window, true)?,
            );
            if round > 0 {
                whole.push(times.0);
                handed_over.push(times.1);
            }
        }
        curve.push(CurvePoint {
            k,
            whole: medians(&whole),
            handed_over: medians(&handed_over),
        });
    }
    Ok(curve)
}

/// `bench --verify-window K`: forwards over K new tokens after the prompt, one warm-up then
/// `--repeats` timed, each split into the host's graph building and the rest. With
/// `MLX_SPEC_PROFILE_DECODE` set the profiler's capture starts after the warm-up, so a
/// profile (`run.sh verify-profile`) holds the timed windows only.
fn report_verify_window(
    model: &Gemma4Model,
    prompt: &[u32],
    k: usize,
    args: &BenchArgs,
) -> Result<()> {
    if k == 0 {
        bail!("--verify-window must be at least 1");
    }
    let mut cache = mlx_spec::model::gemma4::ModelCache::with_reserve(&model.config, k.max(64));
    prefill(model, &mut cache, prompt)?;
    let window = window_of(model, k);
    time_window(model, &mut cache, &window, true)?;
    mlx_spec::device::start_profiler_capture_if_asked();
    let mut times = Vec::new();
    for _ in 0..args.repeats {
        times.push(time_window(model, &mut cache, &window, true)?);
    }
    let total = median(times.iter().map(|t| t.total_ms).collect());
    let build = median(times.iter().map(|t| t.build_ms).collect());
    let (differing, values, largest) = window_against_steps(model, prompt, &window)?;
    if args.json {
        println!(
            "{}",
            json!({ "verify_window": { "k": k, "ms": total, "build_ms": build, "repeats": args.repeats,
                    "logits_unlike_steps": differing, "logits": values, "largest_difference": largest } })
        );
    } else {
        println!(
            "verify window of {k} tokens after {} prompt tokens: {total:.2} ms a forward (median of {}), \
             {build:.2} ms of it building the graph on the host; its logits against {k} single-token \
             steps: {}",
            prompt.len(),
            args.repeats,
            if differing == 0 {
                format!("identical ({values} values)")
            } else {
                format!("{differing} of {values} differ, by up to {largest:.3e}")
            }
        );
    }
    Ok(())
}

/// The logits of one forward over `window` after `prompt` against those of `window.len()`
/// single-token forwards over the same tokens, each from its own freshly filled cache (so
/// that each grows its buffers where it would in a request): how many values differ, of how
/// many, and the largest difference. A window computes what decode steps compute when this
/// is 0.
fn window_against_steps(
    model: &Gemma4Model,
    prompt: &[u32],
    window: &[u32],
) -> Result<(usize, usize, f32)> {
    let reserve = window.len().max(64);
    let mut cache = mlx_spec::model::gemma4::ModelCache::with_reserve(&model.config, reserve);
    prefill(model, &mut cache, prompt)?;
    let together = model
        .forward(window, &mut cache, LogitsFor::All, false)?
        .logits;
    together.eval()?;
    let mut cache = mlx_spec::model::gemma4::ModelCache::with_reserve(&model.config, reserve);
    prefill(model, &mut cache, prompt)?;
    let mut steps = Vec::new();
    for &token in window {
        let logits = model
            .forward(&[token], &mut cache, LogitsFor::All, false)?
            .logits;
        logits.eval()?;
        steps.push(logits);
    }
    let steps = mlx_rs::ops::concatenate(&steps, 0)?;
    let differing = steps
        .ne(&together)?
        .as_dtype(Dtype::Int32)?
        .sum(None)?
        .try_item_exact::<i32>()? as usize;
    let largest = steps
        .subtract(&together)?
        .abs()?
        .max(None)?
        .try_item_exact::<f32>()?;
    Ok((differing, steps.size(), largest))
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
    /// Its slowest and fastest rounds: a set bound by the host swings between rounds (on the
    /// H200 from ~150 to ~230 tok/s within one process), which its median hides.
    slowest_tokens_per_s: f64,
    fastest_tokens_per_s: f64,
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
    model: &mut Gemma4Model,
    prompt: &[u32],
    args: &BenchArgs,
) -> Result<Vec<FusedSetResult>> {
    use mlx_spec::kernels::{CudaDecode, Fused};
    /// One configuration: which kernels run.
    struct Set {
        name: String,
        kernels: Fused,
    }
    let sets = [
        Set {
            name: "none".to_string(),
            kernels: Fused::default(),
        },
        Set {
            name: "default".to_string(),
            kernels: Fused::every(),
        },
    ];
    let mut rates = vec![Vec::new(); sets.len()];
    let mut splits = vec![Vec::new(); sets.len()];
    let mut tokens = vec![Vec::new(); sets.len()];
    let mut first_step_logits = vec![Vec::new(); sets.len()];
    let repeats = args.repeats.max(3);
    // The path the model was loaded with, put back after the comparison.
    let configured = model.set_fast_path(None);
    let on_cuda = on_cuda();
    let mut run_all = || -> Result<()> {
        for round in 0..=repeats {
            for (i, s) in sets.iter().enumerate() {
                // Off a CUDA GPU every set runs MLX's operations, as the loader would.
                let fast = if on_cuda {
                    Some(Box::new(CudaDecode::new(model, s.kernels)?) as Box<_>)
                } else {
                    None
                };
                model.set_fast_path(fast);
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
    model.set_fast_path(configured);
    result?;
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
            tokens_per_s: median(r.clone()),
            slowest_tokens_per_s: r.iter().copied().fold(f64::INFINITY, f64::min),
            fastest_tokens_per_s: r.iter().copied().fold(0.0, f64::max),
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

/// `bench --dump-kernel-sources`: one decode forward of `model` per kernel set, and verify
/// windows of 2, 4 and 8 tokens, their fused-kernel calls recorded ([`mlx_spec::kernels::capture_kernels`]); each distinct
/// source written once.
fn dump_kernel_sources(
    model: &mut Gemma4Model,
    prompt: &[u32],
    dir: &std::path::Path,
) -> Result<()> {
    use mlx_spec::kernels::{capture_kernels, CudaDecode, Fused};
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut cache = model.new_cache();
    let logits = prefill(model, &mut cache, prompt)?;
    let token = mlx_rs::ops::indexing::argmax_axis(&logits, -1, false)?.reshape(&[1, 1])?;
    let every = Fused::every();
    let install = |model: &mut Gemma4Model, kernels: Fused| -> Result<()> {
        let fast = CudaDecode::new(model, kernels)?;
        model.set_fast_path(Some(Box::new(fast)));
        Ok(())
    };
    // Kernel sets: the default (the post-attention kernel serves every layer it can), the
    // product kernels in its place (as for layers it does not serve), attention alone (the
    // attention-inputs kernel, as for layers the attention-heads kernel does not serve).
    let sets = [
        every,
        Fused {
            post_attention: false,
            affine4: false,
            ..every
        },
        Fused {
            attention: true,
            ..Fused::default()
        },
    ];
    let mut written: Vec<mlx_spec::kernels::CapturedKernel> = Vec::new();
    let mut run = || -> Result<()> {
        for kernels in sets {
            install(model, kernels)?;
            let (_, calls) =
                capture_kernels(|| model.forward_ids(&token, &mut cache, LogitsFor::Last, false))?;
            cache
                .trim(1)
                .map_err(|e| anyhow::anyhow!("cannot rewind the cache: {e:?}"))?;
            for call in calls {
                if !written.iter().any(|w| w.source == call.source) {
                    written.push(call);
                }
            }
        }
        // Verify windows of 2, 4 and 8 tokens (the window kernels).
        install(model, every)?;
        for tokens in [2, 4, 8] {
            let ids = mlx_rs::ops::broadcast_to(&token, &[1, tokens])?;
            let (_, calls) =
                capture_kernels(|| model.forward_ids(&ids, &mut cache, LogitsFor::All, false))?;
            cache
                .trim(tokens as usize)
                .map_err(|e| anyhow::anyhow!("cannot rewind the cache: {e:?}"))?;
            for call in calls {
                if !written.iter().any(|w| w.source == call.source) {
                    written.push(call);
                }
            }
        }
        Ok(())
    };
    let result = run();
    model.set_fast_path(None);
    result?;
    let mut list = String::from("file\tkernel\tblock\tblocks\tdynamic_shared\n");
    for k in &written {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        k.source.hash(&mut hasher);
        let file = format!("{}-{:016x}.cu", k.name, hasher.finish());
        std::fs::write(dir.join(&file), &k.source)
            .with_context(|| format!("cannot write {}", dir.join(&file).display()))?;
        list += &format!(
            "{file}\t{}\t{}\t{}\t{}\n",
            k.name, k.block, k.blocks, k.shared_bytes
        );
    }
    std::fs::write(dir.join("kernels.tsv"), list)?;
    println!(
        "{} distinct kernel sources in {} (kernels.tsv lists them)",
        written.len(),
        dir.display()
    );
    Ok(())
}

fn run_op_cost(args: &BenchArgs) -> Result<()> {
    device::select(args.model.device)?;
    let costs =
        mlx_spec::diagnostics::operation_costs(400, 1024, args.repeats, args.model.fused_here())?;
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

/// Whether MLX's default device is a CUDA GPU, where the fused kernels run.
fn on_cuda() -> bool {
    mlx_spec::kernels::on_cuda_gpu()
}

/// `bench --check-kernels`: fused kernels against references on random data.
fn run_check_kernels(args: &BenchArgs) -> Result<()> {
    device::select(args.model.device)?;
    if !on_cuda() {
        bail!("--check-kernels needs a CUDA GPU (--device gpu with the CUDA libmlx)");
    }
    let attention = mlx_spec::diagnostics::decode_attention_errors(Dtype::Bfloat16, 1e-2)?;
    let windows = mlx_spec::diagnostics::window_post_attention_differences()?;
    if args.json {
        let attention: Vec<_> = attention
            .iter()
            .map(|r| json!({"case": r.case, "error": r.error}))
            .collect();
        let windows: Vec<_> = windows
            .iter()
            .map(|r| json!({"case": r.case, "differing": r.differing, "elements": r.elements}))
            .collect();
        println!(
            "{}",
            json!({ "decode_attention": attention,
                    "window_post_attention": windows })
        );
        return Ok(());
    }
    println!("| decode attention (bf16, 8 query heads, 2 KV heads) | largest error |");
    println!("|---|---|");
    for r in &attention {
        println!("| {} | {:.2e} |", r.case, r.error);
    }
    println!();
    println!("| window post-attention kernel (bf16, E4B shapes) | values unlike the single-token kernel's |");
    println!("|---|---|");
    for r in &windows {
        println!("| {} | {} of {} |", r.case, r.differing, r.elements);
    }
    println!("kernel checks passed: decode attention within 1e-2 of MLX's operations, windows bit for bit the single-token kernel's");
    Ok(())
}

/// `bench --feed-forward-speed`: the feed-forward block's weight streaming rate, by method.
fn run_feed_forward_speed(args: &BenchArgs) -> Result<()> {
    device::select(args.model.device)?;
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
        args.model.fused_here(),
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

pub(crate) fn run_bench(args: BenchArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens == 0 || args.repeats == 0 {
        bail!("--prompt-tokens, --gen-tokens and --repeats must be at least 1");
    }
    if let Some(drafter) = args.spec.drafter.clone() {
        return run_bench_spec(&args, &drafter);
    }
    if args.lab.op_cost {
        return run_op_cost(&args);
    }
    if args.lab.feed_forward_speed {
        return run_feed_forward_speed(&args);
    }
    if args.lab.check_kernels {
        return run_check_kernels(&args);
    }
    let mut loaded = load_model(&args.model, &args.random)?;
    let weight_bytes = mlx_rs::memory::active_memory().unwrap_or(0);
    let prompt = synthetic_prompt(loaded.model.config.vocab_size, args.prompt_tokens);
    if !args.lab.replay_drafts.is_empty() {
        return report_replayed_drafts(&mut loaded.model, &prompt, &args);
    }
    let model = &mut loaded.model;
    if let Some(runs) = args.lab.repeatability {
        return report_repeatability(model, &prompt, runs, args.gen_tokens);
    }
    if let Some(dir) = &args.lab.dump_kernel_sources {
        return dump_kernel_sources(model, &prompt, dir);
    }
    if let Some(k) = args.lab.verify_window {
        // The check is whether a whole window computes what steps compute, MLX's operations
        // included: let them take the window whole even where the loop does not trust them.
        model.set_settings(mlx_spec::model::gemma4::RunSettings {
            operation_windows_match_steps: true,
            ..model.settings()
        });
        return report_verify_window(model, &prompt, k, &args);
    }
    if args.lab.compare_sampling {
        return report_sampling(model, &prompt, &args);
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
    let step_ops = match &args.lab.dump_step_graph {
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
    let fused_comparison = if args.lab.compare_fused {
        if !on_cuda() {
            tracing::warn!(
                "--compare-fused: the fused kernels run on a CUDA GPU only; here every set runs \
                 MLX's operations, and their rates differ by noise alone"
            );
        }
        compare_fused(model, &prompt, &args)?
    } else {
        Vec::new()
    };
    let check = match args.lab.check_cpu {
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
                "model": name, "random_weights": args.random.random_weights, "dtype": format!("{:?}", model.dtype),
                "device": args.model.device, "mlx_version": device::mlx_version(), "weight_bytes": weight_bytes,
                "weight_bytes_read_per_token": model.weight_bytes_read_per_token(weight_bytes),
                "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
                "prefill_tokens_per_s": prefill_rate, "decode_tokens_per_s": decode_rate,
                "stepwise_decode_tokens_per_s": stepwise_rate, "stepwise_step_ms": step_ms,
                "stepwise_graph_build_ms": build_ms,
                "pipelined_host_ms": json!({"build": host.build_ms, "submit": host.submit_ms, "wait": host.wait_ms}),
                "fused_comparison": fused_comparison.iter().map(|f| json!({"kernels": f.name, "decode_tokens_per_s": f.tokens_per_s, "slowest_round_tokens_per_s": f.slowest_tokens_per_s, "fastest_round_tokens_per_s": f.fastest_tokens_per_s, "same_tokens_as_none": f.same_as_none, "first_step_logit_gap": f.logit_gap, "host_ms": {"build": f.host.build_ms, "submit": f.host.submit_ms, "wait": f.host.wait_ms}})).collect::<Vec<_>>(),
                "handoff_layers": model.settings().handoff_layers,
                "verify_curve": curve.iter().map(|c| json!({"k": c.k, "ms": c.whole.total_ms, "build_ms": c.whole.build_ms,
                    "handed_over_ms": c.handed_over.total_ms, "handed_over_build_ms": c.handed_over.build_ms})).collect::<Vec<_>>(),
                "step_operations": step_ops.as_ref().map(|c| json!({"total": c.values().sum::<usize>(), "by_kind": c})),
                "cpu_check": check.as_ref().map(|c| json!({
                    "same_tokens": c.device_tokens == c.cpu_tokens,
                    "device_tokens": c.device_tokens,
                    "cpu_tokens": c.cpu_tokens, "max_logit_diff": c.max_logit_diff, "top2_margin": c.top2_margin,
                })),
            })
        );
    } else {
        println!("| model | dtype | device | weights (MB) | prefill {} tok (tok/s) | decode {} tok (tok/s) |", args.prompt_tokens, args.gen_tokens);
        println!("|---|---|---|---|---|---|");
        println!(
            "| {name}{} | {:?} | {:?} | {:.1} | {prefill_rate:.1} | {decode_rate:.1} |",
            if args.random.random_weights {
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
        if !curve.is_empty() {
            println!();
            println!("| verify window k | 1 | 2 | 4 | 8 | 16 | 32 |");
            println!("|---|---|---|---|---|---|---|");
            let row = |label: &str, cell: &dyn Fn(&CurvePoint) -> f64| {
                let cells: Vec<String> =
                    curve.iter().map(|c| format!("{:.2} ms", cell(c))).collect();
                println!("| {label} | {} |", cells.join(" | "));
            };
            row("one forward, handed over whole", &|c| c.whole.total_ms);
            row("of it, building the graph", &|c| c.whole.build_ms);
            let group = model.settings().handoff_layers;
            row(
                &format!("one forward, handed over {group} layers at a time"),
                &|c| c.handed_over.total_ms,
            );
            row("of it, building and handing over", &|c| {
                c.handed_over.build_ms
            });
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

#[cfg(test)]
mod tests {
    use super::{explain_mismatch, logits_digest};
    use mlx_spec::generate::{generate, GenerateRequest};
    use mlx_spec::model::gemma4::{Gemma4Config, Gemma4Model};
    use mlx_spec::sampler::SamplingParams;

    #[test]
    fn the_logits_digest_tells_any_changed_bit() {
        let steps = vec![vec![1.0f32, -2.5], vec![0.0]];
        let same = logits_digest(&steps.clone());
        assert_eq!(logits_digest(&steps), same);
        // -0.0 differs from 0.0 by one bit only.
        assert_ne!(logits_digest(&[vec![1.0, -2.5], vec![-0.0]]), same);
        // The same values split into other steps are the same logits in order.
        assert_eq!(logits_digest(&[vec![1.0], vec![-2.5, 0.0]]), same);
        assert_ne!(logits_digest(&[vec![-2.5, 1.0], vec![0.0]]), same);
    }

    #[test]
    fn a_mismatch_is_explained_against_a_step_by_step_decode() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-ple-kvshare/config.json"
        );
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let config = Gemma4Config::from_json(&json).unwrap();
        let model = Gemma4Model::random(config, 7, mlx_rs::Dtype::Float32, None).unwrap();
        let request = GenerateRequest {
            prompt_ids: vec![2, 5, 9, 14],
            max_tokens: 6,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            ignore_eos: true,
        };
        let (plain, _) = generate(&model, &request, |_| Ok(())).unwrap();
        let mut spec = plain.clone();
        spec[3] ^= 1;
        let why = explain_mismatch(&model, &request, &plain, &spec);
        assert_eq!(
            why,
            "against a step-by-step greedy decode: pipelined plain decoding equals it, \
             speculative first differs at token 3, a second pipelined plain run equals it"
        );
        // A shorter output differs where it ends.
        let why = explain_mismatch(&model, &request, &plain[..4], &plain);
        assert!(
            why.contains("pipelined plain decoding first differs at token 4"),
            "{why}"
        );
    }
}
