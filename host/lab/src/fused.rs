//! `--compare-fused`: pipelined decode with the default fused CUDA kernels and with none,
//! alternated round by round in one process.

use anyhow::Result;

use crate::checks::stepwise_logits;
use crate::{on_cuda, Cli};
use mlx_spec::bench::{decode_pipelined, median, HostSplit};
use mlx_spec::generate::prefill;
use mlx_spec::model::gemma4::Gemma4Model;

/// One set of `mlx-spec-lab --compare-fused`: its median decode rate and host split over the rounds.
pub(crate) struct FusedSetResult {
    pub(crate) name: String,
    pub(crate) tokens_per_s: f64,
    /// Its slowest and fastest rounds: a set bound by the host swings between rounds (on the
    /// H200 from ~150 to ~230 tok/s within one process), which its median hides.
    pub(crate) slowest_tokens_per_s: f64,
    pub(crate) fastest_tokens_per_s: f64,
    /// Whether its tokens equal those of MLX's operations alone.
    pub(crate) same_as_none: bool,
    /// Where the host spent a step (medians of each part): tells a host-bound set from a
    /// device-bound one (waiting near 0: the host is the bound).
    pub(crate) host: HostSplit,
    /// Largest |difference| between the logits of its first decode step and those of MLX's
    /// operations alone (the same prompt and first token): sets that round otherwise differ
    /// a little; a fault in a kernel shows as a large gap.
    pub(crate) logit_gap: f32,
}

/// Pipelined greedy decode with each set of fused kernels, the sets alternating round by
/// round so that drifts of the machine's speed hit them alike.
pub(crate) fn compare_fused(
    model: &mut Gemma4Model,
    prompt: &[u32],
    args: &Cli,
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
