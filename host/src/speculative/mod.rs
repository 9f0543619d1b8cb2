//! The one draft/verify loop every drafter runs through.
//!
//! Each round: the drafter proposes up to `n` tokens after the history; the target verifies
//! `[pending, drafts…]` in one forward; the accept walk keeps the longest prefix of drafts
//! that equal what the target itself emits at those positions, then emits the target's own
//! token (the correction, or a bonus when every draft was accepted); the target's KV cache is
//! rolled back over the rejected drafts. Every emitted token is the target's:
//!
//! * greedy: the target's argmax at that position, so the output equals plain greedy decode;
//! * sampling, drafter without probabilities: the target's own sample keyed by
//!   `(seed, emitted index)` — exactly what plain decode draws at that index;
//! * sampling, drafter with its distributions `q`: rejection sampling — accept draft `x` with
//!   probability `min(1, p(x)/q(x))`, else draw from `norm(max(p − q, 0))` — which leaves the
//!   output distributed exactly as the target's `p`.
//!
//! A drafter that errors, panics (caught in the plugin), or returns too many or out-of-vocabulary
//! tokens is switched off for the rest of the request, which finishes with plain steps: the
//! request still succeeds with correct output. [`gate`] pauses a drafter that keeps missing.

pub mod gate;
pub mod replay;
pub mod target_port;

use std::time::Instant;

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{RErr, ROk, RResult, RSlice, RString};
use anyhow::{bail, Result};
use mlx_rs::Dtype;
use mlx_spec_plugin_api::abi::{DraftProviderBox, DraftSourceBox, SamplingInfo, TargetPort_TO};
use serde::Serialize;

use crate::generate::{pick_token, prefill, queue_step, GenerateRequest, GenerateStats};
use crate::model::gemma4::cache::DEFAULT_ROLLBACK_RESERVE;
use crate::model::gemma4::{Gemma4Model, LogitsFor, ModelCache};
use crate::sampler::{draw, draw_tokens, uniform, SamplingParams, Stream};
use gate::DraftGate;
use target_port::{target_info, HostTarget};

/// Speculation settings of one request.
#[derive(Debug, Clone, Copy)]
pub struct SpecOptions {
    /// Most tokens asked of the drafter per round.
    pub num_draft_tokens: usize,
    /// Pause drafting while acceptance stays near zero.
    pub auto_off: bool,
    /// Size each round from the measured cost of its window and the acceptance rate by draft
    /// position ([`gate::DraftGate::fastest_draft_len`]), once rounds of two lengths have been
    /// timed, instead of from recent acceptance alone.
    pub fitted_draft_length: bool,
}

/// Speculation counters, named as vLLM names them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SpecStats {
    /// Rounds in which the drafter proposed at least one token.
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    /// `1 + accepted / drafts`: tokens emitted per drafted round.
    pub mean_acceptance_length: f64,
    /// `accepted_per_position[i]`: rounds whose draft `i` was accepted.
    pub accepted_per_position: Vec<u64>,
    /// `drafted_per_position[i]`: rounds that proposed a draft at position `i`.
    pub drafted_per_position: Vec<u64>,
    /// Target forward passes after the prefill (verify rounds and plain steps).
    pub target_forwards: u64,
    /// Rounds decoded plainly because auto-off paused the drafter.
    pub paused_rounds: u64,
    /// Why the drafter was switched off for the rest of the request, if it was.
    pub drafter_error: Option<String>,
    /// Why the drafter was not asked at all, if it was not (a target whose verify windows
    /// run a token at a time on this device, where drafting cannot pay).
    pub drafting_skipped: Option<String>,
    /// Wall time spent inside the drafter's calls (draft and commit, across the plugin
    /// boundary), seconds.
    pub drafter_seconds: f64,
    /// Wall time of the drafted rounds (drafting, the verify window, reading its picks),
    /// seconds.
    pub drafted_round_seconds: f64,
    /// The slowest drafted round: its seconds and its window's tokens (the round's own token
    /// and its drafts). One slow round among many shows a stall, not a slow window.
    pub slowest_round_seconds: f64,
    pub slowest_round_window: u64,
}

fn ffi<T>(r: RResult<T, RString>) -> Result<T, String> {
    match r {
        ROk(v) => Ok(v),
        RErr(e) => Err(e.into_string()),
    }
}

/// A drafted round's proposal, validated.
struct Proposal {
    tokens: Vec<u32>,
    /// `[tokens.len(), vocab]` float32 draft distributions, as host vectors.
    probs: Option<Vec<f32>>,
}

/// The live drafter of a request, dropped at its first fault.
struct ActiveSource {
    source: DraftSourceBox,
}

impl ActiveSource {
    fn port<'a>(
        target: &'a HostTarget<'a>,
    ) -> TargetPort_TO<'a, abi_stable::sabi_types::RRef<'a, ()>> {
        TargetPort_TO::from_ptr(target, TD_Opaque)
    }

    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        step_base: u64,
        target: &HostTarget,
        vocab: usize,
    ) -> Result<Proposal, String> {
        let d = ffi(self.source.draft(
            RSlice::from_slice(history),
            n as u32,
            step_base,
            Self::port(target),
        ))?;
        let tokens = d.tokens.into_vec();
        if tokens.len() > n {
            return Err(format!(
                "the drafter returned {} tokens when asked for at most {n}",
                tokens.len()
            ));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "the drafter proposed token {bad}, outside the vocabulary (size {vocab})"
            ));
        }
        let probs = match d.probs.into_option() {
            None => None,
            Some(t) => {
                let q = t.into_array();
                if q.shape() != [tokens.len() as i32, vocab as i32] {
                    return Err(format!(
                        "draft probabilities have shape {:?}, expected [{}, {vocab}]",
                        q.shape(),
                        tokens.len()
                    ));
                }
                let q = q.as_dtype(Dtype::Float32).map_err(|e| e.to_string())?;
                q.eval().map_err(|e| e.to_string())?;
                let values = q.as_slice::<f32>().to_vec();
                if values.iter().any(|v| !v.is_finite() || *v < 0.0) {
                    return Err(
                        "draft probabilities contain negative or non-finite values".to_owned()
                    );
                }
                Some(values)
            }
        };
        Ok(Proposal { tokens, probs })
    }
}

/// Rejection-sampling step at one position: returns `(token, accepted)`.
fn rejection_step(
    p: &[(u32, f64)],
    q_row: &[f32],
    draft: u32,
    seed: u64,
    index: u64,
) -> (u32, bool) {
    let p_x = p.iter().find(|e| e.0 == draft).map_or(0.0, |e| e.1);
    let q_x = q_row[draft as usize] as f64;
    if q_x > 0.0 && uniform(seed, index, Stream::Accept) < (p_x / q_x).min(1.0) {
        return (draft, true);
    }
    // Residual max(p - q, 0), renormalised; p is zero outside its support, so is the residual.
    let mut residual: Vec<(u32, f64)> = p
        .iter()
        .map(|&(t, pt)| (t, (pt - q_row[t as usize] as f64).max(0.0)))
        .filter(|e| e.1 > 0.0)
        .collect();
    let total: f64 = residual.iter().map(|e| e.1).sum();
    if total <= 0.0 {
        // p == q on p's support: any rejection is measure-zero; fall back to p itself.
        return (draw(p, uniform(seed, index, Stream::Residual)), false);
    }
    for e in &mut residual {
        e.1 /= total;
    }
    (
        draw(&residual, uniform(seed, index, Stream::Residual)),
        false,
    )
}

/// The target's verdicts over one verify window: its own token at each position, or its
/// logits rows (rejection sampling).
pub struct Verified<'a> {
    /// Greedy, and sampling for a drafter without distributions: the target's own token at
    /// each window position, the argmax or its draw keyed by `(seed, emitted index)`
    /// ([`crate::sampler::draw_tokens`], as plain decoding draws).
    pub picks: &'a [u32],
    /// Sampling for a drafter with distributions: `[window, vocab]` float32 logits,
    /// row-major.
    pub rows: &'a [f32],
    pub vocab: usize,
}

/// Where a round's emissions must stop.
pub struct WalkLimits<'a> {
    /// Emitted index of the round's first token (the sampler's key).
    pub first_index: u64,
    /// Tokens the request may still emit.
    pub budget: usize,
    /// Tokens that end generation (not emitted).
    pub stop_ids: &'a [u32],
}

/// What one round emits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walk {
    pub emitted: Vec<u32>,
    /// Drafts accepted (the leading `accepted` emitted tokens are drafts).
    pub accepted: usize,
    pub stop_token: Option<u32>,
}

/// The accept walk over one verify window: keep drafts while the target agrees, then emit
/// the target's own token (correction or bonus); stop at a stop token or the budget.
pub fn accept_walk(
    target: &Verified,
    drafts: &[u32],
    probs: Option<&[f32]>,
    sampling: &SamplingParams,
    limits: WalkLimits,
) -> Walk {
    let d = drafts.len();
    let vocab = target.vocab;
    let mut walk = Walk {
        emitted: Vec::with_capacity(d + 1),
        accepted: 0,
        stop_token: None,
    };
    for i in 0..=d {
        let index = limits.first_index + walk.emitted.len() as u64;
        let (token, is_accepted_draft) = match probs {
            Some(q) if !sampling.is_greedy() => {
                let row = &target.rows[i * vocab..(i + 1) * vocab];
                if i < d {
                    let p = sampling.distribution(row);
                    rejection_step(
                        &p,
                        &q[i * vocab..(i + 1) * vocab],
                        drafts[i],
                        sampling.seed,
                        index,
                    )
                } else {
                    (sampling.sample(row, index), false)
                }
            }
            _ => {
                let pick = target.picks[i];
                (pick, i < d && pick == drafts[i])
            }
        };
        if limits.stop_ids.contains(&token) {
            walk.stop_token = Some(token);
            break;
        }
        walk.emitted.push(token);
        if is_accepted_draft {
            walk.accepted += 1;
        }
        if walk.emitted.len() >= limits.budget || !is_accepted_draft {
            break;
        }
    }
    walk
}

/// The most drafts a round asks for, `requested` at most: a round verifies its drafts and the
/// pending token in one window, so where windows longer than `window_limit` would run in parts
/// ([`Gemma4Model::verify_window_limit`]), a round keeps to one part; a later part only costs
/// more when an earlier draft is rejected. `None` where windows run a token at a time: a round
/// then costs a decode step per token it could emit, and drafting cannot pay.
pub fn most_drafts(requested: usize, window_limit: Option<usize>) -> Option<usize> {
    let requested = requested.max(1);
    match window_limit {
        None => Some(requested),
        Some(0 | 1) => None,
        Some(limit) => Some(requested.min(limit - 1)),
    }
}

/// Generates with speculative decoding. The drafter comes from `provider`; without one (or
/// once it faults, or where drafting cannot pay: [`most_drafts`]) this is plain decoding
/// through the same loop.
pub fn generate_speculative(
    model: &Gemma4Model,
    req: &GenerateRequest,
    provider: Option<&DraftProviderBox>,
    options: SpecOptions,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerateStats, SpecStats)> {
    if req.prompt_ids.is_empty() {
        bail!("the prompt is empty: give at least one token");
    }
    req.sampling.validate()?;
    let sampling: SamplingParams = req.sampling;
    let vocab = model.config.vocab_size;
    let mut stats = SpecStats::default();
    let (k_max, provider) = match most_drafts(options.num_draft_tokens, model.verify_window_limit())
    {
        Some(k) => (k, provider),
        None => {
            let why = "this target's verify windows run a token at a time on this device (its weights have no window kernels, the kernel set lacks the single-token kernels they match, or no grid-wide barrier is safe here), so a drafted round costs as many steps as it could emit: decoding plainly";
            tracing::info!("{why}");
            stats.drafting_skipped = Some(why.to_owned());
            (1, None)
        }
    };
    let mut gate = DraftGate::new(options.auto_off).with_fitted_length(options.fitted_draft_length);
    let mut cache =
        ModelCache::with_reserve(&model.config, DEFAULT_ROLLBACK_RESERVE.max(k_max + 1));

    let sampling_info = SamplingInfo {
        temperature: sampling.temperature,
        top_k: sampling.top_k as u32,
        top_p: sampling.top_p,
        min_p: sampling.min_p,
        seed: sampling.seed,
    };
    let mut source = None;
    if let Some(p) = provider {
        match ffi(p.open(target_info(model), sampling_info)) {
            Ok(s) => source = Some(ActiveSource { source: s }),
            Err(e) => {
                tracing::warn!("drafter could not open this request, decoding plainly: {e}");
                stats.drafter_error = Some(e);
            }
        }
    }
    let start = Instant::now();
    let prompt = &req.prompt_ids;
    let mut tokens: Vec<u32> = Vec::new();
    let mut history: Vec<u32> = prompt.clone();
    let mut stop_token = None;

    // Prefill: the whole prompt, as plain decoding prefills it, whatever prefill mode the
    // drafter names. The first token is then plain decoding's own, and every later token is
    // made by windows that compute what decode steps compute. Leaving the last prompt token to
    // head the first window (a "tail split") made the cache of the prompt and the first token
    // come out of other operations than plain decoding's (a prompt of one token less, then a
    // window instead of the prompt's last row), and on random E4B weights on an H200 that was
    // enough to change the greedy tokens.
    let mut pending = {
        let logits = prefill(model, &mut cache, prompt)?;
        let first = pick_token(&logits, &sampling, 0)?;
        if !req.ignore_eos && req.stop_ids.contains(&first) {
            stop_token = Some(first);
        } else if req.max_tokens > 0 {
            tokens.push(first);
            history.push(first);
            on_token(first)?;
        }
        first
    };
    let prefill_seconds = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();
    if let Some(s) = source.as_mut() {
        let target = HostTarget {
            model,
            cache: Some(&cache),
            position: cache.offset() as u64,
        };
        if let Err(e) = ffi(s
            .source
            .prefill(RSlice::from_slice(prompt), ActiveSource::port(&target)))
        {
            tracing::warn!("drafter failed in prefill, decoding plainly: {e}");
            stats.drafter_error = Some(e);
            source = None;
        }
    }

    while stop_token.is_none() && tokens.len() < req.max_tokens {
        let remaining = req.max_tokens - tokens.len();
        // Rounds known not to draft (no drafter, or a pause) run as plain greedy decoding
        // does, each step queued before the previous token is read: a round that synchronises
        // costs a plain step its overlap of host and device, which is most of a CPU step.
        let plain_rounds = match &source {
            None => remaining,
            Some(_) => (gate.paused_remaining() as usize).min(remaining),
        };
        if plain_rounds >= 2 {
            gate.spend_pause(plain_rounds);
            let stop_ids: &[u32] = if req.ignore_eos { &[] } else { &req.stop_ids };
            let began = Instant::now();
            let steps = PlainSteps {
                rounds: plain_rounds,
                stop_ids,
                sampling: &sampling,
                first_index: tokens.len() as u64,
            };
            let burst = plain_burst(model, &mut cache, pending, steps)?;
            gate.observe_plain_time(began.elapsed().as_secs_f64(), burst.emitted.len());
            stats.target_forwards += burst.forwards;
            for &t in &burst.emitted {
                on_token(t)?;
            }
            stop_token = burst.stop_token;
            tokens.extend_from_slice(&burst.emitted);
            history.extend_from_slice(&burst.emitted);
            if stop_token.is_some() || tokens.len() >= req.max_tokens {
                break;
            }
            pending = *burst
                .emitted
                .last()
                .expect("a burst that does not stop emits");
            // One plain round per token, as the drafter would have seen them.
            for t in &burst.emitted {
                commit_round(&mut source, &mut stats, 0, 0, std::slice::from_ref(t));
            }
            continue;
        }
        // A round emits up to drafts + 1 tokens; never ask for more than the budget allows.
        let n = gate.draft_len(k_max).min(remaining - 1);
        let mut proposal = Proposal {
            tokens: Vec::new(),
            probs: None,
        };
        // The round's time, drafting and verifying, tells the gate what drafting costs.
        let round_began = Instant::now();
        if n > 0 && source.is_some() && gate.should_draft() {
            let target = HostTarget {
                model,
                cache: Some(&cache),
                position: cache.offset() as u64,
            };
            let began = Instant::now();
            let result =
                source
                    .as_mut()
                    .unwrap()
                    .draft(&history, n, tokens.len() as u64, &target, vocab);
            stats.drafter_seconds += began.elapsed().as_secs_f64();
            match result {
                Ok(p) => proposal = p,
                Err(e) => {
                    tracing::warn!(
                        "drafter failed, finishing this request with plain decoding: {e}"
                    );
                    stats.drafter_error = Some(e);
                    source = None;
                }
            }
        }
        let drafts = &proposal.tokens;
        let d = drafts.len();

        let mut window = Vec::with_capacity(d + 1);
        window.push(pending);
        window.extend_from_slice(drafts);
        // The round reads the picks at once: the window goes to the device a few layers at a
        // time as they are built, so the device does not wait for the whole graph.
        let logits = model
            .forward_to_read(&window, &mut cache, LogitsFor::All, false)?
            .logits;
        stats.target_forwards += 1;

        // The target's own token at every window position, drawn on the device as plain
        // decoding draws it, so the round reads a few ids, not rows of logits; rejection
        // sampling needs the rows themselves.
        let rejection = !sampling.is_greedy() && proposal.probs.is_some();
        let picks: Vec<u32> = if rejection {
            logits.eval()?;
            Vec::new()
        } else {
            let picks = draw_tokens(&logits, &sampling, tokens.len() as u64)?;
            picks.eval()?;
            picks.as_slice::<u32>().to_vec()
        };
        let rows: &[f32] = if rejection {
            logits.as_slice::<f32>()
        } else {
            &[]
        };
        let walk = accept_walk(
            &Verified {
                picks: &picks,
                rows,
                vocab,
            },
            drafts,
            proposal.probs.as_deref(),
            &sampling,
            WalkLimits {
                first_index: tokens.len() as u64,
                budget: req.max_tokens - tokens.len(),
                stop_ids: if req.ignore_eos { &[] } else { &req.stop_ids },
            },
        );
        for &t in &walk.emitted {
            on_token(t)?;
        }
        stop_token = walk.stop_token;
        let (emitted, accepted) = (walk.emitted, walk.accepted);

        // Only drafted rounds are timed here: an undrafted one waited for its token, and plain
        // rounds are timed in bursts, where they queue as plain decoding does, greedy or
        // sampled.
        if d > 0 {
            stats.num_drafts += 1;
            stats.num_draft_tokens += d as u64;
            stats.num_accepted_tokens += accepted as u64;
            if stats.drafted_per_position.len() < d {
                stats.drafted_per_position.resize(d, 0);
                stats.accepted_per_position.resize(d, 0);
            }
            for i in 0..d {
                stats.drafted_per_position[i] += 1;
                if i < accepted {
                    stats.accepted_per_position[i] += 1;
                }
            }
            let round_seconds = round_began.elapsed().as_secs_f64();
            stats.drafted_round_seconds += round_seconds;
            if round_seconds > stats.slowest_round_seconds {
                stats.slowest_round_seconds = round_seconds;
                stats.slowest_round_window = d as u64 + 1;
            }
            gate.observe_round_time(round_seconds, d);
            gate.observe(d, accepted);
        }
        tokens.extend_from_slice(&emitted);
        history.extend_from_slice(&emitted);
        if stop_token.is_some() || tokens.len() >= req.max_tokens {
            break;
        }

        // Keep `pending` and the accepted drafts in the cache; the last emitted token is the
        // next pending one.
        cache.trim(d - accepted)?;
        pending = *emitted
            .last()
            .expect("a round that does not stop emits a token");
        commit_round(&mut source, &mut stats, d, accepted, &emitted);
    }

    stats.paused_rounds = gate.paused_rounds;
    stats.mean_acceptance_length = if stats.num_drafts > 0 {
        1.0 + stats.num_accepted_tokens as f64 / stats.num_drafts as f64
    } else {
        0.0
    };
    let decode_seconds = decode_start.elapsed().as_secs_f64();
    let decoded = tokens.len().saturating_sub(1);
    let generate_stats = GenerateStats::new(
        prompt.len(),
        tokens.len(),
        prefill_seconds,
        decode_seconds,
        decoded,
        stop_token,
    );
    Ok((tokens, generate_stats, stats))
}

/// Tells the drafter (if still active) how a round ended; a drafter that fails here is
/// dropped for the rest of the request, which finishes with plain decoding.
fn commit_round(
    source: &mut Option<ActiveSource>,
    stats: &mut SpecStats,
    drafted: usize,
    accepted: usize,
    emitted: &[u32],
) {
    let Some(s) = source.as_mut() else {
        return;
    };
    let began = Instant::now();
    let committed =
        ffi(s
            .source
            .commit(drafted as u32, accepted as u32, RSlice::from_slice(emitted)));
    stats.drafter_seconds += began.elapsed().as_secs_f64();
    if let Err(e) = committed {
        tracing::warn!("drafter failed in commit, finishing this request with plain decoding: {e}");
        stats.drafter_error = Some(e);
        *source = None;
    }
}

/// What a run of plain greedy rounds produced.
struct PlainBurst {
    emitted: Vec<u32>,
    stop_token: Option<u32>,
    forwards: u64,
}

/// What a run of plain rounds may do.
struct PlainSteps<'a> {
    /// Rounds at most.
    rounds: usize,
    /// Tokens that end generation (not emitted).
    stop_ids: &'a [u32],
    sampling: &'a SamplingParams,
    /// Emitted index of the burst's first token (the sampler's key).
    first_index: u64,
}

/// Up to `steps.rounds` plain rounds from `pending` (not yet in the cache), each forward
/// queued before the previous token is read, each token drawn on the device as plain
/// decoding draws it. On return the cache holds `pending` and every emitted token but the
/// last, which is the next pending one (or the stop token).
fn plain_burst(
    model: &Gemma4Model,
    cache: &mut ModelCache,
    pending: u32,
    steps: PlainSteps,
) -> Result<PlainBurst> {
    let PlainSteps {
        rounds,
        stop_ids,
        sampling,
        first_index,
    } = steps;
    let mut burst = PlainBurst {
        emitted: Vec::with_capacity(rounds),
        stop_token: None,
        forwards: 1,
    };
    let pending = mlx_rs::Array::from_slice(&[pending], &[1]);
    let mut next = queue_step(model, cache, &pending, sampling, first_index)?;
    for i in 0..rounds {
        // The successor's forward goes in before this token is read, except after the last.
        let queued = if i + 1 < rounds {
            burst.forwards += 1;
            let index = first_index + i as u64 + 1;
            Some(queue_step(model, cache, &next, sampling, index)?)
        } else {
            None
        };
        let token = crate::generate::read_token(&next)?;
        if stop_ids.contains(&token) {
            burst.stop_token = Some(token);
            if queued.is_some() {
                // The stop token's own forward was queued: take it back out of the cache.
                cache.trim(1)?;
            }
            break;
        }
        burst.emitted.push(token);
        match queued {
            Some(q) => next = q,
            None => break,
        }
    }
    Ok(burst)
}

#[cfg(test)]
mod tests {
    use super::most_drafts;

    #[test]
    fn rounds_keep_to_one_window_of_the_kernels_and_skip_drafting_a_token_at_a_time() {
        // Windows of any length run whole (the CPU): as many drafts as asked.
        assert_eq!(most_drafts(10, None), Some(10));
        // Window kernels that take 8 tokens: 7 drafts and the pending token.
        assert_eq!(most_drafts(10, Some(8)), Some(7));
        assert_eq!(most_drafts(3, Some(8)), Some(3));
        // A token at a time: drafting cannot pay.
        assert_eq!(most_drafts(10, Some(1)), None);
        // At least one draft is asked for.
        assert_eq!(most_drafts(0, None), Some(1));
    }
}
