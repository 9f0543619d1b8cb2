//! Checks of the decode path: the device against the CPU (`--check-cpu`), bitwise
//! repeatability (`--repeatability`), a verify window against single steps
//! (`--verify-window`), and the fused CUDA kernels on random data (`--check-kernels`).

use anyhow::{bail, Result};
use mlx_rs::Dtype;
use serde_json::json;

use crate::{on_cuda, Cli};
use mlx_spec::bench::verify_curve::{time_window, window_of};
use mlx_spec::bench::{decode_pipelined, decode_step_by_step, median};
use mlx_spec::device::{self, DeviceKind};
use mlx_spec::generate::{greedy_token, prefill};
use mlx_spec::model::gemma4::{Gemma4Model, LogitsFor};

/// What [`check_against_cpu`] found.
pub(crate) struct CpuCheck {
    pub(crate) device_tokens: Vec<u32>,
    pub(crate) cpu_tokens: Vec<u32>,
    /// Largest |difference| between the two devices' logits after the prompt.
    pub(crate) max_logit_diff: f32,
    /// Gap between the best and second-best logit there (how far from a tie the first pick was).
    pub(crate) top2_margin: f32,
}

/// Greedy decode of `n` tokens after `prompt` on the default device, then on the CPU with the
/// same weight arrays, so both runs compute the same function on the same values.
pub(crate) fn check_against_cpu(
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
pub(crate) fn stepwise_logits(
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
pub(crate) fn top2_margin(logits: &[f32]) -> f32 {
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

/// `mlx-spec-lab --repeatability RUNS`: decodes `n` greedy tokens `runs` times pipelined, first
/// thing in the process (the condition of the one 4-bit disagreement seen on CUDA), then
/// `runs` times step by step from fresh caches. Prints where each pipelined run's tokens first
/// differ from the first step-by-step run's, and where each later step-by-step run's logits
/// first differ from the first's (every run fed the first run's tokens). A bitwise-repeatable
/// device gives identical logits everywhere; then a pipelined run that departs points at the
/// pipelining, not at an operation.
pub(crate) fn report_repeatability(
    model: &Gemma4Model,
    prompt: &[u32],
    runs: usize,
    n: usize,
) -> Result<()> {
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
pub(crate) fn logits_digest(steps: &[Vec<f32>]) -> u64 {
    steps
        .iter()
        .flatten()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

/// `mlx-spec-lab --verify-window K`: forwards over K new tokens after the prompt, one warm-up then
/// `--repeats` timed, each split into the host's graph building and the rest. With
/// `MLX_SPEC_PROFILE_DECODE` set the profiler's capture starts after the warm-up, so a
/// profile (`run.sh verify-profile`) holds the timed windows only.
pub(crate) fn report_verify_window(
    model: &Gemma4Model,
    prompt: &[u32],
    k: usize,
    args: &Cli,
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
pub(crate) fn window_against_steps(
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

/// `mlx-spec-lab --check-kernels`: fused kernels against references on random data.
pub(crate) fn run_check_kernels(args: &Cli) -> Result<()> {
    device::select(args.model.device)?;
    if !on_cuda() {
        bail!("--check-kernels needs a CUDA GPU (--device gpu with the CUDA libmlx)");
    }
    let attention = crate::diagnostics::decode_attention_errors(Dtype::Bfloat16, 1e-2)?;
    let windows = crate::diagnostics::window_post_attention_differences()?;
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

#[cfg(test)]
mod tests {
    use super::logits_digest;

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
}
