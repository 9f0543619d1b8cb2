//! Verify windows timed: one forward over k new tokens, as a verify round runs it, and the
//! verify cost curve (k = 1 ... 32).

use std::time::Instant;

use anyhow::Result;

use super::median;
use crate::generate::prefill;
use crate::model::gemma4::{Gemma4Model, LogitsFor};

/// One verify window timed: the whole forward, and the part of it the host spent building
/// the lazy graph before evaluation began (milliseconds).
#[derive(Clone, Copy)]
pub struct WindowTime {
    pub total_ms: f64,
    pub build_ms: f64,
}

/// One forward over `window` after the cache's tokens, evaluated to its greedy picks and
/// timed, then rolled back so the next call sees the same cache. `handed_over`: as a verify
/// round runs it, its layers handed to the device in groups as they are built
/// (`--handoff-layers`); otherwise handed over whole when the picks are read.
pub fn time_window(
    model: &Gemma4Model,
    cache: &mut crate::model::gemma4::ModelCache,
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
pub fn prime_windows(
    model: &Gemma4Model,
    prompt: &[u32],
    largest: usize,
    generated: usize,
) -> Result<()> {
    let filler = window_of(model, generated);
    let later: Vec<u32> = prompt.iter().chain(&filler).copied().collect();
    for context in [prompt, &later[..]] {
        // Reserved as a speculative request reserves it, so the buffers take its sizes.
        let reserve = crate::model::gemma4::cache::DEFAULT_ROLLBACK_RESERVE.max(largest);
        let mut cache = crate::model::gemma4::ModelCache::with_reserve(&model.config, reserve);
        prefill(model, &mut cache, context)?;
        for size in 1..=largest {
            time_window(model, &mut cache, &window_of(model, size), true)?;
        }
    }
    Ok(())
}

/// `k` draft-like tokens (spread over the vocabulary, away from the special ids).
pub fn window_of(model: &Gemma4Model, k: usize) -> Vec<u32> {
    let vocab = model.config.vocab_size as u32;
    (0..k as u32)
        .map(|i| 3 + (i * 7919) % (vocab - 3))
        .collect()
}

/// One point of the verify cost curve: a window of `k` tokens handed to the device whole,
/// and handed over in groups of layers as a verify round hands it (`--handoff-layers`).
pub struct CurvePoint {
    pub k: usize,
    pub whole: WindowTime,
    pub handed_over: WindowTime,
}

/// Milliseconds of one forward over `k` new tokens after `prompt`, for k = 1, 2, 4, … 32
/// (median over `repeats`, the cache rolled back after each), with the host's share; each
/// window both ways, alternated.
pub fn verify_curve(
    model: &Gemma4Model,
    prompt: &[u32],
    repeats: usize,
) -> Result<Vec<CurvePoint>> {
    let mut cache = crate::model::gemma4::ModelCache::with_reserve(&model.config, 64);
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
