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
pub mod source;
pub mod target_port;

use std::time::Instant;

use anyhow::{bail, Result};
use mlx_rs::Array;
use mlx_spec_plugin_api::abi::{DraftProviderBox, SamplingInfo};
use serde::Serialize;

use crate::generate::{
    join_rows, pick_token, prefill_capturing, queue_step_capturing, GenerateRequest, GenerateStats,
};
use crate::model::gemma4::cache::DEFAULT_ROLLBACK_RESERVE;
use crate::model::gemma4::{Capture, Gemma4Model, LogitsFor, ModelCache};
use crate::sampler::{draw, draw_tokens, uniform, SamplingParams, Stream};
use gate::DraftGate;
pub use gate::GateMemory;
use source::{ActiveSource, Proposal};
use target_port::HostTarget;

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

/// The most drafts a round asks for: `requested` (at least one), or `None` where windows run
/// a token at a time (`window_limit` 1, [`Gemma4Model::verify_window_limit`]): a round would
/// then cost a decode step per token it could emit, and drafting cannot pay. Windows longer
/// than the limit are verified in parts that stop at the first rejection (see
/// [`verify_in_parts`]), so a long proposal costs a later part only when every draft before it
/// was accepted.
pub fn most_drafts(requested: usize, window_limit: Option<usize>) -> Option<usize> {
    match window_limit {
        Some(0 | 1) => None,
        _ => Some(requested.max(1)),
    }
}

/// Runs one verify window of every length the window kernels take (2 to the model's limit;
/// longer proposals are verified in parts of those lengths) on a scratch cache, so that
/// kernels met for the first time compile now rather than inside a request's first rounds of
/// each length: on an H200 a window kernel's first compile costs seconds, and a bench or a
/// server's first requests would pay it. Nothing to do where windows run through MLX's
/// operations (the CPU).
pub fn warm_up_windows(model: &Gemma4Model) -> Result<()> {
    let Some(limit) = model.verify_window_limit() else {
        return Ok(());
    };
    let bos = model.config.bos_token_id.unwrap_or(0);
    for len in 2..=limit {
        let mut cache = model.new_cache();
        model.forward(&[bos], &mut cache, LogitsFor::Last, false)?;
        let window = vec![bos; len];
        let out = model.forward(&window, &mut cache, LogitsFor::All, false)?;
        out.logits.eval()?;
    }
    Ok(())
}

/// Generates with speculative decoding. The drafter comes from `provider`; without one (or
/// once it faults, or where drafting cannot pay: [`most_drafts`]) this is plain decoding
/// through the same loop. A loop over [`SpecStepper`] to the end. The gate starts from
/// `memory`, what earlier requests of the same drafter learned, and leaves there what this
/// one learned (a fresh [`GateMemory`] for a request on its own).
pub fn generate_speculative(
    model: &Gemma4Model,
    req: &GenerateRequest,
    provider: Option<&DraftProviderBox>,
    options: SpecOptions,
    memory: &mut GateMemory,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerateStats, SpecStats)> {
    let mut stepper = SpecStepper::new(model, req, provider, options)?;
    stepper.resume_gate(memory);
    while !stepper.is_done() {
        for t in stepper.step()? {
            on_token(t)?;
        }
    }
    stepper.remember_gate(memory);
    Ok(stepper.finish())
}

/// What `mlx-spec draft` reports: the target's greedy token after the prompt (the anchor) and
/// the drafter's first proposal after it.
#[derive(Debug, Clone, Serialize)]
pub struct FirstDrafts {
    pub anchor: u32,
    pub drafts: Vec<u32>,
}

/// Prefills `prompt` exactly as a greedy speculative request does (the drafter receives the
/// prompt's taps and its prefill call), takes the target's greedy next token, then asks the
/// drafter once for `n` drafts after it. A drafter fault is an error here, not a fallback.
pub fn first_drafts(
    model: &Gemma4Model,
    provider: &DraftProviderBox,
    prompt: &[u32],
    n: usize,
) -> Result<FirstDrafts> {
    let req = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens: n + 1,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        ignore_eos: true,
    };
    let options = SpecOptions {
        num_draft_tokens: n,
        auto_off: false,
        fitted_draft_length: false,
    };
    let mut stepper = SpecStepper::new(model, &req, Some(provider), options)?;
    let opened = stepper.source.is_some();
    let first = stepper.step()?;
    if let Some(why) = &stepper.stats.drafting_skipped {
        bail!("drafting is off for this target here: {why}");
    }
    let Some(s) = stepper.source.as_mut() else {
        let why = stepper.stats.drafter_error.clone().unwrap_or_default();
        bail!(
            "the drafter failed {}: {why}",
            if opened { "in prefill" } else { "to open" }
        );
    };
    let anchor = *first
        .first()
        .expect("a request of n + 1 tokens emits its first");
    let target = HostTarget {
        model,
        cache: Some(&stepper.cache),
        position: stepper.cache.offset() as u64,
    };
    let proposal = s
        .draft(&stepper.history, n, 1, &target, false)
        .map_err(|e| anyhow::anyhow!("the drafter failed to draft: {e}"))?;
    Ok(FirstDrafts {
        anchor,
        drafts: proposal.tokens,
    })
}

/// One request's speculative generation as a value: its cache, sampler settings, drafter
/// session, gate and counters. [`SpecStepper::step`] advances it one round (the prefill and
/// first token, a drafted round, or a burst of plain rounds) and returns what that round
/// emitted, so a caller can interleave several requests round by round; each request's
/// tokens are those [`generate_speculative`] gives it alone.
pub struct SpecStepper<'m> {
    model: &'m Gemma4Model,
    req: GenerateRequest,
    vocab: usize,
    k_max: usize,
    stats: SpecStats,
    gate: DraftGate,
    cache: ModelCache,
    source: Option<ActiveSource>,
    tokens: Vec<u32>,
    history: Vec<u32>,
    stop_token: Option<u32>,
    /// The last emitted token, not yet in the cache (valid once prefilled).
    pending: u32,
    /// Set by the first step (the prefill).
    prefilled: bool,
    prefill_seconds: f64,
    decode_start: Instant,
    /// Most plain rounds one step runs.
    plain_burst_limit: usize,
}

impl<'m> SpecStepper<'m> {
    /// Checks the request and opens the drafter's session (a drafter that cannot open is
    /// recorded in the stats and the request decodes plainly); nothing runs on the model yet.
    pub fn new(
        model: &'m Gemma4Model,
        req: &GenerateRequest,
        provider: Option<&DraftProviderBox>,
        options: SpecOptions,
    ) -> Result<Self> {
        if req.prompt_ids.is_empty() {
            bail!("the prompt is empty: give at least one token");
        }
        req.sampling.validate()?;
        let sampling: SamplingParams = req.sampling;
        let mut stats = SpecStats::default();
        let (k_max, provider) = match most_drafts(
            options.num_draft_tokens,
            model.verify_window_limit(),
        ) {
            Some(k) => (k, provider),
            None => {
                let why = "this target's verify windows run a token at a time on this device (no window kernels run: MLX's operations would compute a window otherwise than decode steps on a GPU; its weights have no window kernels, the kernel set lacks the single-token kernels they match, or no grid-wide barrier is safe here), so a drafted round costs as many steps as it could emit: decoding plainly";
                tracing::info!("{why}");
                stats.drafting_skipped = Some(why.to_owned());
                (1, None)
            }
        };
        let gate = DraftGate::new(options.auto_off).with_fitted_length(options.fitted_draft_length);
        let cache =
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
            let target = HostTarget {
                model,
                cache: Some(&cache),
                position: 0,
            };
            match ActiveSource::open(p, &target, sampling_info) {
                Ok(s) => source = Some(s),
                Err(e) => {
                    tracing::warn!("drafter could not open this request, decoding plainly: {e}");
                    stats.drafter_error = Some(e);
                }
            }
        }
        Ok(SpecStepper {
            model,
            req: req.clone(),
            vocab: model.config.vocab_size,
            k_max,
            stats,
            gate,
            cache,
            source,
            tokens: Vec::new(),
            history: req.prompt_ids.clone(),
            stop_token: None,
            pending: 0,
            prefilled: false,
            prefill_seconds: 0.0,
            decode_start: Instant::now(),
            plain_burst_limit: usize::MAX,
        })
    }

    /// Caps the plain rounds one [`SpecStepper::step`] runs (unlimited by default), so a
    /// request without a drafter still yields its turn; the tokens are the same.
    pub fn limit_plain_burst(&mut self, rounds: usize) {
        self.plain_burst_limit = rounds.max(2);
    }

    /// Starts this request's gate from what earlier requests of the same drafter learned
    /// ([`GateMemory`]); call it before the first step.
    pub fn resume_gate(&mut self, memory: &GateMemory) {
        self.gate.resume(memory);
    }

    /// Leaves in `memory` what this request's gate learned, for the next request of the same
    /// drafter.
    pub fn remember_gate(&self, memory: &mut GateMemory) {
        memory.remember(&self.gate);
    }

    /// Whether generation has ended (a stop token or the budget).
    pub fn is_done(&self) -> bool {
        self.prefilled && (self.stop_token.is_some() || self.tokens.len() >= self.req.max_tokens)
    }

    /// The tokens emitted so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The speculation counters so far.
    pub fn spec_stats(&self) -> &SpecStats {
        &self.stats
    }

    /// Whether the request still has its drafter (it has not faulted).
    pub fn drafting(&self) -> bool {
        self.source.is_some()
    }

    /// Runs one round and returns the tokens it emitted (none once done).
    pub fn step(&mut self) -> Result<Vec<u32>> {
        if !self.prefilled {
            return self.prefill();
        }
        if self.is_done() {
            return Ok(Vec::new());
        }
        let model = self.model;
        let sampling = self.req.sampling;
        let req = &self.req;
        let remaining = req.max_tokens - self.tokens.len();
        // Rounds known not to draft (no drafter, or a pause) run as plain greedy decoding
        // does, each step queued before the previous token is read: a round that synchronises
        // costs a plain step its overlap of host and device, which is most of a CPU step.
        let plain_rounds = match &self.source {
            None => remaining,
            Some(_) => (self.gate.paused_remaining() as usize).min(remaining),
        };
        // A capped burst never leaves a single plain round behind, which would run as a
        // window of one instead of a queued step.
        let plain_rounds = match plain_rounds.checked_sub(self.plain_burst_limit) {
            None | Some(0) | Some(1) => plain_rounds,
            Some(_) => self.plain_burst_limit,
        };
        if plain_rounds >= 2 {
            self.gate.spend_pause(plain_rounds);
            let stop_ids: &[u32] = if req.ignore_eos { &[] } else { &req.stop_ids };
            let began = Instant::now();
            let steps = PlainSteps {
                rounds: plain_rounds,
                stop_ids,
                sampling: &sampling,
                first_index: self.tokens.len() as u64,
            };
            let first_position = self.cache.offset() as u64;
            let taps = self.source.as_ref().map_or(&[][..], ActiveSource::taps);
            let burst = plain_burst(model, &mut self.cache, self.pending, steps, taps)?;
            self.gate
                .observe_plain_time(began.elapsed().as_secs_f64(), burst.emitted.len());
            self.stats.target_forwards += burst.forwards;
            self.stop_token = burst.stop_token;
            self.tokens.extend_from_slice(&burst.emitted);
            self.history.extend_from_slice(&burst.emitted);
            if self.is_done() {
                return Ok(burst.emitted);
            }
            self.pending = *burst
                .emitted
                .last()
                .expect("a burst that does not stop emits");
            // One plain round per token, as the drafter would have seen them: the position
            // each step processed, then the token it emitted.
            for (i, t) in burst.emitted.iter().enumerate() {
                let hidden = burst.taps.get(i).map_or(&[][..], Vec::as_slice);
                commit_round(
                    &mut self.source,
                    &mut self.stats,
                    RoundEnd {
                        hidden,
                        first_position: first_position + i as u64,
                        drafted: 0,
                        accepted: 0,
                        emitted: std::slice::from_ref(t),
                    },
                );
            }
            return Ok(burst.emitted);
        }
        // A round emits up to drafts + 1 tokens; never ask for more than the budget allows.
        let n = self.gate.draft_len(self.k_max).min(remaining - 1);
        let mut proposal = Proposal::none();
        // The round's time, drafting and verifying, tells the gate what drafting costs.
        let round_began = Instant::now();
        if n > 0 && self.source.is_some() && self.gate.should_draft() {
            let target = HostTarget {
                model,
                cache: Some(&self.cache),
                position: self.cache.offset() as u64,
            };
            let began = Instant::now();
            let result = self.source.as_mut().unwrap().draft(
                &self.history,
                n,
                self.tokens.len() as u64,
                &target,
                !sampling.is_greedy(),
            );
            self.stats.drafter_seconds += began.elapsed().as_secs_f64();
            match result {
                Ok(p) => proposal = p,
                Err(e) => {
                    tracing::warn!(
                        "drafter failed, finishing this request with plain decoding: {e}"
                    );
                    self.stats.drafter_error = Some(e);
                    self.source = None;
                }
            }
        }
        let drafts = &proposal.tokens;
        let d = drafts.len();

        let mut window = Vec::with_capacity(d + 1);
        window.push(self.pending);
        window.extend_from_slice(drafts);
        // The round reads the picks at once: the window goes to the device a few layers at a
        // time as they are built, so the device does not wait for the whole graph. The
        // drafter's tap points come out of this same forward.
        let first_position = self.cache.offset() as u64;
        let taps = self.source.as_ref().map_or(&[][..], ActiveSource::taps);
        // The target's own token at every window position, drawn on the device as plain
        // decoding draws it, so the round reads a few ids, not rows of logits; rejection
        // sampling needs the rows themselves.
        let rejection = !sampling.is_greedy() && proposal.probs.is_some();
        let verified = if rejection {
            let out = model.forward_to_read(
                &window,
                &mut self.cache,
                LogitsFor::All,
                Capture::Taps(taps),
            )?;
            out.logits.eval()?;
            VerifiedWindow {
                picks: Vec::new(),
                rows: Some(out.logits),
                hidden: out.hidden,
                processed: window.len(),
                forwards: 1,
            }
        } else {
            verify_in_parts(
                model,
                &mut self.cache,
                &window,
                &sampling,
                self.tokens.len() as u64,
                taps,
            )?
        };
        self.stats.target_forwards += verified.forwards;
        let rows: &[f32] = match &verified.rows {
            Some(logits) => logits.as_slice::<f32>(),
            None => &[],
        };
        let (picks, hidden) = (&verified.picks, &verified.hidden);
        let walk = accept_walk(
            &Verified {
                picks,
                rows,
                vocab: self.vocab,
            },
            drafts,
            proposal.probs.as_deref(),
            &sampling,
            WalkLimits {
                first_index: self.tokens.len() as u64,
                budget: req.max_tokens - self.tokens.len(),
                stop_ids: if req.ignore_eos { &[] } else { &req.stop_ids },
            },
        );
        self.stop_token = walk.stop_token;
        let (emitted, accepted) = (walk.emitted, walk.accepted);

        // Only drafted rounds are timed here: an undrafted one waited for its token, and plain
        // rounds are timed in bursts, where they queue as plain decoding does, greedy or
        // sampled.
        if d > 0 {
            let stats = &mut self.stats;
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
            self.gate.observe_round_time(round_seconds, d);
            self.gate.observe(d, accepted);
        }
        self.tokens.extend_from_slice(&emitted);
        self.history.extend_from_slice(&emitted);
        if self.is_done() {
            return Ok(emitted);
        }

        // Keep `pending` and the accepted drafts in the cache; the last emitted token is the
        // next pending one.
        self.cache.trim(verified.processed - (accepted + 1))?;
        self.pending = *emitted
            .last()
            .expect("a round that does not stop emits a token");
        // The verified positions: the round's first token and the accepted drafts.
        commit_round(
            &mut self.source,
            &mut self.stats,
            RoundEnd {
                hidden,
                first_position,
                drafted: d,
                accepted,
                emitted: &emitted,
            },
        );
        Ok(emitted)
    }

    /// The first round: the prompt's prefill, the first token, and the drafter's prefill.
    fn prefill(&mut self) -> Result<Vec<u32>> {
        let model = self.model;
        let sampling = self.req.sampling;
        let start = Instant::now();
        let prompt = &self.req.prompt_ids;
        let mut emitted = Vec::new();
        // Prefill: the whole prompt, as plain decoding prefills it, whatever prefill mode the
        // drafter names. The first token is then plain decoding's own, and every later token is
        // made by windows that compute what decode steps compute. Leaving the last prompt token
        // to head the first window (a "tail split") made the cache of the prompt and the first
        // token come out of other operations than plain decoding's (a prompt of one token less,
        // then a window instead of the prompt's last row), and on random E4B weights on an H200
        // that was enough to change the greedy tokens.
        let taps = self.source.as_ref().map_or(&[][..], ActiveSource::taps);
        let (logits, hidden) = prefill_capturing(model, &mut self.cache, prompt, taps)?;
        let first = pick_token(&logits, &sampling, 0)?;
        if !self.req.ignore_eos && self.req.stop_ids.contains(&first) {
            self.stop_token = Some(first);
        } else if self.req.max_tokens > 0 {
            self.tokens.push(first);
            self.history.push(first);
            emitted.push(first);
        }
        self.pending = first;
        self.prefilled = true;
        self.prefill_seconds = start.elapsed().as_secs_f64();
        self.decode_start = Instant::now();
        if let Some(s) = self.source.as_mut() {
            let target = HostTarget {
                model,
                cache: Some(&self.cache),
                position: self.cache.offset() as u64,
            };
            let began = Instant::now();
            // The prompt's tapped states first, then the prefill call.
            let result = s
                .deliver(&hidden, 0..prompt.len(), 0)
                .and_then(|()| s.prefill(prompt, &target));
            self.stats.drafter_seconds += began.elapsed().as_secs_f64();
            if let Err(e) = result {
                tracing::warn!("drafter failed in prefill, decoding plainly: {e}");
                self.stats.drafter_error = Some(e);
                self.source = None;
            }
        }
        Ok(emitted)
    }

    /// The tokens and the counters of the request, as [`generate_speculative`] returns them.
    pub fn finish(mut self) -> (Vec<u32>, GenerateStats, SpecStats) {
        let mut stats = std::mem::take(&mut self.stats);
        stats.paused_rounds = self.gate.paused_rounds;
        stats.mean_acceptance_length = if stats.num_drafts > 0 {
            1.0 + stats.num_accepted_tokens as f64 / stats.num_drafts as f64
        } else {
            0.0
        };
        let decode_seconds = self.decode_start.elapsed().as_secs_f64();
        let decoded = self.tokens.len().saturating_sub(1);
        let generate_stats = GenerateStats::new(
            self.req.prompt_ids.len(),
            self.tokens.len(),
            self.prefill_seconds,
            decode_seconds,
            decoded,
            self.stop_token,
        );
        (std::mem::take(&mut self.tokens), generate_stats, stats)
    }
}

/// What the target computed over a verify window.
struct VerifiedWindow {
    /// The target's own token at each position it processed (token-match verification).
    picks: Vec<u32>,
    /// Rejection sampling: `[window, vocab]` float32 logits, evaluated.
    rows: Option<Array>,
    /// The drafter's tap points over the processed positions (`[processed, hidden]` each).
    hidden: Vec<Array>,
    /// Window positions processed (now in the cache).
    processed: usize,
    forwards: u64,
}

/// Verifies `window` (`[pending, drafts...]`) by token match. Where the fast path computes
/// windows exactly only up to a length (a GPU's window kernels), a longer window runs in parts
/// of that length, each read before the next is built, and stops at the first part that
/// rejects a draft: a later part only runs when every draft before it was accepted, so it
/// costs one window's forward for at least one more emitted token, never a wasted one. Where
/// any length runs whole (the CPU), this is one forward.
fn verify_in_parts(
    model: &Gemma4Model,
    cache: &mut ModelCache,
    window: &[u32],
    sampling: &SamplingParams,
    first_index: u64,
    taps: &[i32],
) -> Result<VerifiedWindow> {
    let part = match model.verify_window_limit() {
        Some(limit) if limit >= 2 => limit,
        _ => window.len(),
    };
    let drafts = &window[1..];
    let mut verified = VerifiedWindow {
        picks: Vec::with_capacity(window.len()),
        rows: None,
        hidden: Vec::new(),
        processed: 0,
        forwards: 0,
    };
    let mut hidden_parts: Vec<Vec<Array>> = vec![Vec::new(); taps.len()];
    for start in (0..window.len()).step_by(part) {
        let ids = &window[start..(start + part).min(window.len())];
        let out = model.forward_to_read(ids, cache, LogitsFor::All, Capture::Taps(taps))?;
        let picks = draw_tokens(&out.logits, sampling, first_index + start as u64)?;
        picks.eval()?;
        verified.picks.extend_from_slice(picks.as_slice::<u32>());
        verified.processed += ids.len();
        verified.forwards += 1;
        for (parts, h) in hidden_parts.iter_mut().zip(out.hidden) {
            parts.push(h);
        }
        // Pick `i` verifies draft `i`: stop once a draft the picks reach is rejected.
        let reached = verified.picks.len().min(drafts.len());
        if (0..reached).any(|i| verified.picks[i] != drafts[i]) {
            break;
        }
    }
    verified.hidden = join_rows(hidden_parts)?;
    Ok(verified)
}

/// How a round ended, as the drafter is told.
struct RoundEnd<'a> {
    /// The tapped states of the round's forward (`[T, hidden]` per tap point): rows
    /// `0..=accepted` are the verified positions.
    hidden: &'a [Array],
    /// Position of the round's first token.
    first_position: u64,
    drafted: usize,
    accepted: usize,
    emitted: &'a [u32],
}

/// Tells the drafter (if still active) how a round ended: the verified positions' tapped
/// states, then the commit. A drafter that fails here is dropped for the rest of the request,
/// which finishes with plain decoding.
fn commit_round(source: &mut Option<ActiveSource>, stats: &mut SpecStats, end: RoundEnd) {
    let Some(s) = source.as_mut() else {
        return;
    };
    let began = Instant::now();
    let committed = s
        .deliver(end.hidden, 0..end.accepted + 1, end.first_position)
        .and_then(|()| s.commit(end.drafted, end.accepted, end.emitted));
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
    /// For each emitted token, the tapped states (`[1, hidden]` per tap point) of the step
    /// that made it, i.e. of the position it processed.
    taps: Vec<Vec<Array>>,
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
    taps: &[i32],
) -> Result<PlainBurst> {
    let PlainSteps {
        rounds,
        stop_ids,
        sampling,
        first_index,
    } = steps;
    let mut burst = PlainBurst {
        emitted: Vec::with_capacity(rounds),
        taps: Vec::new(),
        stop_token: None,
        forwards: 1,
    };
    let pending = Array::from_slice(&[pending], &[1]);
    let (mut next, mut hidden) =
        queue_step_capturing(model, cache, &pending, sampling, first_index, taps)?;
    for i in 0..rounds {
        // The successor's forward goes in before this token is read, except after the last.
        let queued = if i + 1 < rounds {
            burst.forwards += 1;
            let index = first_index + i as u64 + 1;
            Some(queue_step_capturing(
                model, cache, &next, sampling, index, taps,
            )?)
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
        if !taps.is_empty() {
            burst.taps.push(std::mem::take(&mut hidden));
        }
        match queued {
            Some((q, h)) => (next, hidden) = (q, h),
            None => break,
        }
    }
    Ok(burst)
}

#[cfg(test)]
mod tests {
    use super::most_drafts;

    #[test]
    fn rounds_take_what_is_asked_and_skip_drafting_a_token_at_a_time() {
        // Windows of any length run whole (the CPU): as many drafts as asked.
        assert_eq!(most_drafts(10, None), Some(10));
        // Window kernels that take 8 tokens: longer windows are verified in parts.
        assert_eq!(most_drafts(15, Some(8)), Some(15));
        assert_eq!(most_drafts(3, Some(8)), Some(3));
        // A token at a time: drafting cannot pay.
        assert_eq!(most_drafts(10, Some(1)), None);
        // At least one draft is asked for.
        assert_eq!(most_drafts(0, None), Some(1));
    }
}
