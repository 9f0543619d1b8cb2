//! Plain (non-speculative) generation: chunked prefill, then one token per target forward.

use std::time::Instant;

use anyhow::{bail, Result};
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::transforms::async_eval;
use mlx_rs::Array;
use serde::Serialize;

use crate::model::gemma4::{Capture, ForwardOutput, Gemma4Model, LogitsFor, ModelCache};
use crate::sampler::{draw_tokens, SamplingParams};

/// Prompts longer than this are prefilled in chunks, bounding activation memory.
pub const PREFILL_CHUNK: usize = 512;

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends (without emitting it) at any of these tokens…
    pub stop_ids: Vec<u32>,
    /// …unless this is set (benchmarks, oracle comparisons).
    pub ignore_eos: bool,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token was sampled.
    Stop,
    /// `max_tokens` were generated.
    Length,
}

/// Counts and timings of one generation, as printed by `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt processing up to and including the first generated token.
    pub prefill_seconds: f64,
    pub prefill_tokens_per_s: f64,
    /// Every later token.
    pub decode_seconds: f64,
    pub decode_tokens_per_s: f64,
    pub stop_reason: StopReason,
    /// The stop token that ended generation, if any.
    pub stop_token: Option<u32>,
}

impl GenerateStats {
    /// Stats of a finished request: `decoded` tokens took `decode_seconds` after the
    /// `prefill_seconds` that produced the first one.
    pub fn new(
        prompt_tokens: usize,
        generated_tokens: usize,
        prefill_seconds: f64,
        decode_seconds: f64,
        decoded: usize,
        stop_token: Option<u32>,
    ) -> Self {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        GenerateStats {
            prompt_tokens,
            generated_tokens,
            prefill_seconds,
            prefill_tokens_per_s: rate(prompt_tokens, prefill_seconds),
            decode_seconds,
            decode_tokens_per_s: rate(decoded, decode_seconds),
            stop_reason: if stop_token.is_some() {
                StopReason::Stop
            } else {
                StopReason::Length
            },
            stop_token,
        }
    }
}

/// The argmax of `[1, vocab]` logits, computed on the device (only the id is copied back).
pub fn greedy_token(logits: &Array) -> Result<u32> {
    read_token(&argmax_axis(logits, -1, false)?)
}

/// The token id in the one-element array `token`, evaluating it first. A failure of the
/// device while computing it (a CUDA error, say) is an error here, not a panic.
pub fn read_token(token: &Array) -> Result<u32> {
    token
        .try_item_cast::<u32>()
        .map_err(|e| anyhow::anyhow!("computing the next token on the device failed: {e}"))
}

/// Builds the forward of `token` (a `[1]` id still on the device, possibly not yet computed)
/// and returns its greedy successor, not yet evaluated.
pub fn greedy_step(model: &Gemma4Model, cache: &mut ModelCache, token: &Array) -> Result<Array> {
    Ok(argmax_axis(&step_logits(model, cache, token)?, -1, false)?)
}

/// The logits of the forward of `token` (a `[1]` id on the device), not yet evaluated.
fn step_logits(model: &Gemma4Model, cache: &mut ModelCache, token: &Array) -> Result<Array> {
    Ok(step_forward(model, cache, token, Capture::Nothing)?.logits)
}

/// The forward of `token` (a `[1]` id on the device), keeping the states `capture` asks for.
fn step_forward(
    model: &Gemma4Model,
    cache: &mut ModelCache,
    token: &Array,
    capture: Capture,
) -> Result<ForwardOutput> {
    let ids = token.reshape(&[1, 1])?;
    model.forward_ids(&ids, cache, LogitsFor::Last, capture)
}

/// [`greedy_step`], then starts evaluating the successor without waiting for it.
pub fn queue_greedy_step(
    model: &Gemma4Model,
    cache: &mut ModelCache,
    token: &Array,
) -> Result<Array> {
    let next = greedy_step(model, cache, token)?;
    async_eval([&next])?;
    Ok(next)
}

/// [`queue_greedy_step`] for any sampling: the successor of `token` is the token at emitted
/// index `index`, drawn on the device ([`draw_tokens`]), so sampled decoding queues its
/// steps as greedy decoding does.
pub fn queue_step(
    model: &Gemma4Model,
    cache: &mut ModelCache,
    token: &Array,
    sampling: &SamplingParams,
    index: u64,
) -> Result<Array> {
    if sampling.is_greedy() {
        return queue_greedy_step(model, cache, token);
    }
    let next = draw_tokens(&step_logits(model, cache, token)?, sampling, index)?;
    async_eval([&next])?;
    Ok(next)
}

/// [`queue_step`], also keeping the hidden states at the tap points `taps` (`[1, hidden]`
/// each) of the step's forward, for a drafter that reads them; the token is the same.
pub fn queue_step_capturing(
    model: &Gemma4Model,
    cache: &mut ModelCache,
    token: &Array,
    sampling: &SamplingParams,
    index: u64,
    taps: &[i32],
) -> Result<(Array, Vec<Array>)> {
    if taps.is_empty() {
        return Ok((
            queue_step(model, cache, token, sampling, index)?,
            Vec::new(),
        ));
    }
    let out = step_forward(model, cache, token, Capture::Taps(taps))?;
    let next = if sampling.is_greedy() {
        argmax_axis(&out.logits, -1, false)?
    } else {
        draw_tokens(&out.logits, sampling, index)?
    };
    let mut queued = vec![&next];
    queued.extend(&out.hidden);
    async_eval(queued)?;
    Ok((next, out.hidden))
}

/// Picks the token at emitted index `index` from `[1, vocab]` logits: the argmax, or a draw on
/// the device ([`draw_tokens`]), as every sampled step draws.
pub fn pick_token(logits: &Array, sampling: &SamplingParams, index: u64) -> Result<u32> {
    if sampling.is_greedy() {
        return greedy_token(logits);
    }
    read_token(&draw_tokens(logits, sampling, index)?)
}

/// Runs `ids` through the model in chunks; returns the last position's logits.
pub fn prefill(model: &Gemma4Model, cache: &mut ModelCache, ids: &[u32]) -> Result<Array> {
    Ok(prefill_capturing(model, cache, ids, &[])?.0)
}

/// [`prefill`], also keeping the hidden states at the tap points `taps` for every prompt
/// position (`[ids.len(), hidden]` each), for a drafter that reads them.
pub fn prefill_capturing(
    model: &Gemma4Model,
    cache: &mut ModelCache,
    ids: &[u32],
    taps: &[i32],
) -> Result<(Array, Vec<Array>)> {
    let mut last = None;
    let mut parts: Vec<Vec<Array>> = vec![Vec::new(); taps.len()];
    for chunk in ids.chunks(PREFILL_CHUNK) {
        let out = model.forward(chunk, cache, LogitsFor::Last, Capture::Taps(taps))?;
        let mut evaluated = vec![&out.logits];
        evaluated.extend(&out.hidden);
        mlx_rs::transforms::eval(evaluated)?;
        for (part, h) in parts.iter_mut().zip(out.hidden) {
            part.push(h);
        }
        last = Some(out.logits);
    }
    let logits = last.ok_or_else(|| anyhow::anyhow!("empty prompt"))?;
    Ok((logits, join_rows(parts)?))
}

/// Per tap point, the hidden states of consecutive forwards joined along the positions (one
/// forward's are taken as they are).
pub fn join_rows(parts: Vec<Vec<Array>>) -> Result<Vec<Array>> {
    parts
        .into_iter()
        .map(|mut p| {
            Ok(if p.len() == 1 {
                p.pop().expect("one part")
            } else {
                concatenate(&p, 0)?
            })
        })
        .collect()
}

/// Generates up to `max_tokens` tokens, calling `on_token` with each as soon as it is known.
pub fn generate(
    model: &Gemma4Model,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerateStats)> {
    if req.prompt_ids.is_empty() {
        bail!("the prompt is empty: give at least one token");
    }
    req.sampling.validate()?;
    let mut cache = model.new_cache();
    let mut tokens = Vec::new();
    let mut stop_token = None;

    let start = Instant::now();
    let logits = prefill(model, &mut cache, &req.prompt_ids)?;
    crate::device::start_profiler_capture_if_asked();
    let mut prefill_seconds = 0.0;
    let mut decode_start = start;
    // The next token stays on the device (the argmax, or a draw keyed by its index), and the
    // forward that consumes it is queued before it is read, so the host builds step n+1 while
    // the device still runs step n.
    let mut pending = if req.max_tokens > 0 {
        Some(draw_tokens(&logits, &req.sampling, 0)?)
    } else {
        None
    };

    let decoding = (|| -> Result<()> {
        while let Some(next) = pending.take() {
            if tokens.len() + 1 < req.max_tokens {
                let index = tokens.len() as u64 + 1;
                pending = Some(queue_step(model, &mut cache, &next, &req.sampling, index)?);
            }
            let token = read_token(&next)?;
            if tokens.is_empty() {
                prefill_seconds = start.elapsed().as_secs_f64();
                decode_start = Instant::now();
            }
            if !req.ignore_eos && req.stop_ids.contains(&token) {
                stop_token = Some(token);
                break;
            }
            tokens.push(token);
            on_token(token)?;
            if tokens.len() == req.max_tokens {
                break;
            }
        }
        Ok(())
    })();
    // A stop token (or an error) leaves the step after it queued on the device. Waiting for
    // it (at most one step) leaves no work in flight behind the call, so a process that exits
    // right after does not tear MLX down under a running step.
    let drained = pending.take().map(|queued| queued.eval());
    decoding?;
    if let Some(result) = drained {
        result?;
    }

    let decode_seconds = if tokens.len() > 1 || stop_token.is_some() {
        decode_start.elapsed().as_secs_f64()
    } else {
        0.0
    };
    let decoded =
        tokens.len().saturating_sub(1) + usize::from(stop_token.is_some() && !tokens.is_empty());
    let stats = GenerateStats::new(
        req.prompt_ids.len(),
        tokens.len(),
        prefill_seconds,
        decode_seconds,
        decoded,
        stop_token,
    );
    Ok((tokens, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_that_cannot_be_read_is_an_error_not_a_panic() {
        assert_eq!(read_token(&Array::from_slice(&[7u32], &[1])).unwrap(), 7);
        let err = read_token(&Array::from_slice(&[1u32, 2], &[2])).unwrap_err();
        assert!(err.to_string().contains("next token"), "{err}");
    }
}
