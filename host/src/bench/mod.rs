//! `mlx-spec bench`: prefill and decode speed, plain or speculative side by side, and the
//! verify cost curve. The measuring pieces are public: the developer lab (`host/lab`) builds
//! its instruments from them.

pub mod speculative;
pub mod verify_curve;

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::command_line::{load_model, BenchArgs};
use crate::device;
use crate::generate::{greedy_step, greedy_token, prefill};
use crate::model::gemma4::{Gemma4Model, LogitsFor, ModelCache};
use crate::tokenizer::{ChatMessage, Tokenizer};
use verify_curve::{verify_curve, CurvePoint};

/// `mlx-spec bench`: speculative against plain decoding with `--drafter`, else plain prefill
/// and decode speed (and the verify cost curve with `--verify-curve`).
pub fn run(args: &BenchArgs) -> Result<()> {
    check_counts(args)?;
    if let Some(drafter) = &args.spec.drafter {
        return speculative::run(args, drafter);
    }
    let loaded = load_model(&args.model, &args.random)?;
    let weight_bytes = mlx_rs::memory::active_memory().unwrap_or(0);
    let model = &loaded.model;
    let prompt = synthetic_prompt(model.config.vocab_size, args.prompt_tokens);
    let speed = measure_plain(model, &prompt, args.gen_tokens, args.repeats, weight_bytes)?;
    let curve = if args.verify_curve {
        verify_curve(model, &prompt, args.repeats)?
    } else {
        Vec::new()
    };
    if args.json {
        println!(
            "{}",
            serde_json::Value::Object(plain_json(args, model, &speed, &curve))
        );
    } else {
        print_plain(args, model, &speed, &curve);
    }
    Ok(())
}

/// Refuses measurement sizes of zero.
pub fn check_counts(args: &BenchArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens == 0 || args.repeats == 0 {
        bail!("--prompt-tokens, --gen-tokens and --repeats must be at least 1");
    }
    Ok(())
}

/// Plain decode speed, medians over the measured rounds.
pub struct PlainSpeed {
    /// Bytes of memory the loaded weights take (MLX's active memory after the load).
    pub weight_bytes: usize,
    pub prefill_tokens_per_s: f64,
    /// Pipelined decode: each step queued before the token it consumes is read.
    pub decode_tokens_per_s: f64,
    /// One synchronised step at a time.
    pub stepwise_tokens_per_s: f64,
    /// Of a synchronised step, the milliseconds spent building its graph on the host.
    pub stepwise_build_ms: f64,
    /// Where the host spends a pipelined step.
    pub host: HostSplit,
}

/// Prefill of `prompt`, then `gen_tokens` greedy tokens pipelined and again one step at a
/// time, one warm-up round and `repeats` measured. Fails if the two decodes disagree: they
/// compute the same function, so a difference is a fault of the pipelining.
pub fn measure_plain(
    model: &Gemma4Model,
    prompt: &[u32],
    gen_tokens: usize,
    repeats: usize,
    weight_bytes: usize,
) -> Result<PlainSpeed> {
    let mut prefill_rates = Vec::new();
    let mut decode_rates = Vec::new();
    let mut stepwise_rates = Vec::new();
    let mut build_ms = Vec::new();
    let mut splits = Vec::new();
    for round in 0..=repeats {
        let mut cache = model.new_cache();
        let start = Instant::now();
        let logits = prefill(model, &mut cache, prompt)?;
        let prefill_s = start.elapsed().as_secs_f64();
        let (pipelined, decode_s, split) =
            decode_pipelined(model, &mut cache, &logits, gen_tokens)?;

        // The same decode, one synchronised step at a time, from a fresh cache.
        let mut cache = model.new_cache();
        let logits = prefill(model, &mut cache, prompt)?;
        let (stepwise, stepwise_s, build_s) =
            decode_step_by_step(model, &mut cache, &logits, gen_tokens)?;
        if pipelined != stepwise {
            let first = pipelined.iter().zip(&stepwise).position(|(a, b)| a != b);
            bail!(
                "pipelined and step-by-step greedy decoding disagree in round {round} ({}), from token {first:?}: {pipelined:?} vs {stepwise:?}",
                if round == 0 { "the warm-up, the process's first decode" } else { "measured" }
            );
        }
        if round > 0 {
            prefill_rates.push(prompt.len() as f64 / prefill_s);
            decode_rates.push(gen_tokens as f64 / decode_s);
            stepwise_rates.push(gen_tokens as f64 / stepwise_s);
            build_ms.push(build_s * 1e3 / gen_tokens as f64);
            splits.push(split);
        }
    }
    Ok(PlainSpeed {
        weight_bytes,
        prefill_tokens_per_s: median(prefill_rates),
        decode_tokens_per_s: median(decode_rates),
        stepwise_tokens_per_s: median(stepwise_rates),
        stepwise_build_ms: median(build_ms),
        host: HostSplit {
            build_ms: median(splits.iter().map(|s| s.build_ms).collect()),
            submit_ms: median(splits.iter().map(|s| s.submit_ms).collect()),
            wait_ms: median(splits.iter().map(|s| s.wait_ms).collect()),
        },
    })
}

/// The plain measurement as the fields of `bench --json`'s object (the lab adds its own).
pub fn plain_json(
    args: &BenchArgs,
    model: &Gemma4Model,
    speed: &PlainSpeed,
    curve: &[CurvePoint],
) -> serde_json::Map<String, serde_json::Value> {
    let step_ms = 1e3 / speed.stepwise_tokens_per_s;
    let value = json!({
        "model": args.model.model.display().to_string(), "random_weights": args.random.random_weights,
        "dtype": format!("{:?}", model.dtype), "device": args.model.device,
        "mlx_version": device::mlx_version(), "weight_bytes": speed.weight_bytes,
        "weight_bytes_read_per_token": model.weight_bytes_read_per_token(speed.weight_bytes),
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
        "prefill_tokens_per_s": speed.prefill_tokens_per_s, "decode_tokens_per_s": speed.decode_tokens_per_s,
        "stepwise_decode_tokens_per_s": speed.stepwise_tokens_per_s, "stepwise_step_ms": step_ms,
        "stepwise_graph_build_ms": speed.stepwise_build_ms,
        "pipelined_host_ms": json!({"build": speed.host.build_ms, "submit": speed.host.submit_ms, "wait": speed.host.wait_ms}),
        "handoff_layers": model.settings().handoff_layers,
        "verify_curve": curve.iter().map(|c| json!({"k": c.k, "ms": c.whole.total_ms, "build_ms": c.whole.build_ms,
            "handed_over_ms": c.handed_over.total_ms, "handed_over_build_ms": c.handed_over.build_ms})).collect::<Vec<_>>(),
    });
    match value {
        serde_json::Value::Object(map) => map,
        _ => unreachable!("json! of an object literal is an object"),
    }
}

/// The plain measurement as a table and two lines, then the verify cost curve if measured.
pub fn print_plain(
    args: &BenchArgs,
    model: &Gemma4Model,
    speed: &PlainSpeed,
    curve: &[CurvePoint],
) {
    let name = args.model.model.display().to_string();
    let (prefill_rate, decode_rate) = (speed.prefill_tokens_per_s, speed.decode_tokens_per_s);
    let stepwise_rate = speed.stepwise_tokens_per_s;
    let build_ms = speed.stepwise_build_ms;
    let step_ms = 1e3 / stepwise_rate;
    let host = speed.host;
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
        speed.weight_bytes as f64 / 1e6
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
    if !curve.is_empty() {
        println!();
        println!("| verify window k | 1 | 2 | 4 | 8 | 16 | 32 |");
        println!("|---|---|---|---|---|---|---|");
        let row = |label: &str, cell: &dyn Fn(&CurvePoint) -> f64| {
            let cells: Vec<String> = curve.iter().map(|c| format!("{:.2} ms", cell(c))).collect();
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
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 0 {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// Deterministic prompt ids away from the special-token range.
pub fn synthetic_prompt(vocab: usize, len: usize) -> Vec<u32> {
    let vocab = vocab as u64;
    let low = 3.min(vocab - 1);
    (0..len as u64)
        .map(|i| (low + (i * 2_654_435_761) % (vocab - low)) as u32)
        .collect()
}

/// The chat turns of a prompt set (JSON lines of `{"messages": [{"role", "content"}, ...]}`,
/// as `bench/prompts/*.jsonl`), each encoded as Gemma 4 chat.
pub fn read_prompt_set(path: &Path, tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>> {
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

/// Where the host spends a pipelined decode step, in milliseconds per step.
#[derive(Default, Clone, Copy)]
pub struct HostSplit {
    /// Building the step's lazy graph (our model code).
    pub build_ms: f64,
    /// Handing the graph to MLX (`async_eval`: MLX walks it and encodes its kernels).
    pub submit_ms: f64,
    /// Blocked reading the previous token while the device finishes it.
    pub wait_ms: f64,
}

/// Greedy decode of `n` forwards after `logits` (`n + 1` tokens), the host queueing each step
/// before reading the token it consumes (as `generate` does). Returns the tokens, the
/// seconds taken and where the host spent them.
pub fn decode_pipelined(
    model: &Gemma4Model,
    cache: &mut ModelCache,
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
        tokens.push(crate::generate::read_token(&next)?);
        let t3 = Instant::now();
        split.build_ms += (t1 - t0).as_secs_f64();
        split.submit_ms += (t2 - t1).as_secs_f64();
        split.wait_ms += (t3 - t2).as_secs_f64();
        next = following;
    }
    tokens.push(crate::generate::read_token(&next)?);
    let per_step = 1e3 / n as f64;
    split.build_ms *= per_step;
    split.submit_ms *= per_step;
    split.wait_ms *= per_step;
    Ok((tokens, start.elapsed().as_secs_f64(), split))
}

/// Greedy decode of `n` forwards after `logits`, building and evaluating one step at a time.
/// Returns the tokens, the seconds taken, and the seconds spent building graphs.
pub fn decode_step_by_step(
    model: &Gemma4Model,
    cache: &mut ModelCache,
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
