//! The engine: the one thread that owns the model, the drafters and every request's state.
//!
//! MLX's evaluation is not safe from two threads at once, so everything that touches MLX
//! (loading, prefill, verify rounds, drafters) runs here; the HTTP side only tokenizes,
//! validates and formats. Requests arrive as [`Job`]s on a channel. Up to `max_active` of
//! them generate at once, taking turns one round each ([`SpecStepper::step`]); the rest wait
//! in arrival order. Each request keeps its own cache, sampler key and drafter session, so its
//! tokens are those it would get alone. A request whose client has gone (its event receiver
//! dropped) or whose deadline passed is dropped before its next round.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use mlx_spec_plugin_api::abi::DraftProviderBox;
use mlx_spec_plugin_api::manifest::Manifest;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use crate::generate::{GenerateRequest, StopReason};
use crate::load::LoadOptions;
use crate::plugins::trained_for::TrainedFor;
use crate::plugins::{
    check_needs, instantiate, trained_for, warn_if_trained_for_another_target, Registry,
    HOST_KEY_NUM_DRAFT_TOKENS,
};
use crate::sampler::SamplingParams;
use crate::speculative::target_port::target_spec;
use crate::speculative::{warm_up_windows, GateMemory, SpecOptions, SpecStats, SpecStepper};
use crate::tokenizer::Tokenizer;

use super::metrics::Metrics;

/// Most plain rounds a request runs in one turn: a request without a drafter yields after
/// this many tokens (its tokens are the same as one long burst's).
const PLAIN_TURN: usize = 16;

/// A drafter the server offers, as configured.
#[derive(Debug, Clone)]
pub struct DrafterSpec {
    /// The name requests give it.
    pub name: String,
    /// The plugin's manifest name.
    pub plugin: String,
    pub num_draft_tokens: Option<usize>,
    pub overrides: toml::Table,
    pub auto_off: bool,
    pub fitted_draft_length: bool,
    /// Where it is configured (file and line), for errors.
    pub origin: String,
}

/// What the engine loads.
pub struct EngineConfig {
    pub load: LoadOptions,
    pub plugins_dirs: Vec<PathBuf>,
    pub drafters: Vec<DrafterSpec>,
    pub max_active: usize,
}

/// A loaded drafter, as the HTTP side sees it.
#[derive(Debug, Clone, Serialize)]
pub struct DrafterInfo {
    pub name: String,
    pub plugin: String,
    pub version: String,
    /// Most tokens drafted per round unless a request asks for fewer or more.
    pub num_draft_tokens: usize,
}

/// What the HTTP side needs of the loaded model.
pub struct ModelInfo {
    pub tokenizer: Arc<Tokenizer>,
    pub stop_ids: Vec<u32>,
    pub vocab_size: usize,
    pub drafters: Vec<DrafterInfo>,
}

/// How a token came to be emitted: a draft the target accepted, the target's token after an
/// accepted run of every draft (the bonus), its token where it rejected a draft (the
/// correction), or a plain step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenKind {
    Accepted,
    Bonus,
    Correction,
    Target,
}

/// The speculation a request runs with.
#[derive(Debug, Clone, Copy)]
pub struct Speculation {
    /// Index into [`ModelInfo::drafters`].
    pub drafter: usize,
    pub num_draft_tokens: usize,
}

/// One request, validated and tokenized.
pub struct Job {
    pub request: GenerateRequest,
    pub speculation: Option<Speculation>,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
    pub deadline: Instant,
    /// Set by the handler to end the request after its current round (a stop string).
    pub stop: Arc<AtomicBool>,
    /// Held while the job exists anywhere (channel, queue, engine): counts admitted requests.
    pub ticket: Ticket,
}

/// A place among the admitted requests, given back when dropped.
pub struct Ticket(Arc<AtomicUsize>);

impl Ticket {
    /// Takes a place if fewer than `limit` are taken.
    pub fn take(count: &Arc<AtomicUsize>, limit: usize) -> Option<Ticket> {
        count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Ticket(count.clone()))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request's speculation counters, as responses carry them.
#[derive(Debug, Clone, Serialize)]
pub struct SpecReport {
    pub drafter: Option<String>,
    /// Most tokens drafted per round (0: off).
    pub max_draft_tokens: usize,
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    pub mean_acceptance_length: f64,
    /// Accepted drafts over drafted tokens (0 when nothing was drafted).
    pub draft_acceptance_rate: f64,
    pub accepted_per_position: Vec<u64>,
    pub drafted_per_position: Vec<u64>,
    pub target_forwards: u64,
    /// Why the drafter was switched off for the rest of the request, if it was.
    pub drafter_error: Option<String>,
}

impl SpecReport {
    fn new(drafter: Option<&DrafterInfo>, k: usize, s: &SpecStats) -> SpecReport {
        let rate = |a: u64, b: u64| if b > 0 { a as f64 / b as f64 } else { 0.0 };
        SpecReport {
            drafter: drafter.map(|d| d.name.clone()),
            max_draft_tokens: k,
            num_drafts: s.num_drafts,
            num_draft_tokens: s.num_draft_tokens,
            num_accepted_tokens: s.num_accepted_tokens,
            mean_acceptance_length: if s.num_drafts > 0 {
                1.0 + rate(s.num_accepted_tokens, s.num_drafts)
            } else {
                0.0
            },
            draft_acceptance_rate: rate(s.num_accepted_tokens, s.num_draft_tokens),
            accepted_per_position: s.accepted_per_position.clone(),
            drafted_per_position: s.drafted_per_position.clone(),
            target_forwards: s.target_forwards,
            drafter_error: s.drafter_error.clone(),
        }
    }
}

/// How a request ended.
#[derive(Debug, Clone)]
pub struct Finished {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub stop_reason: StopReason,
    pub speculation: SpecReport,
}

/// What the engine tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Tokens of one round, in order.
    Tokens(Vec<(u32, TokenKind)>),
    Done(Finished),
    /// The request failed (after its headers may have gone out).
    Failed {
        timeout: bool,
        message: String,
    },
}

/// The running engine.
pub struct Engine {
    jobs: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

/// A handle to submit jobs, cheap to clone.
#[derive(Clone)]
pub struct Submitter(SyncSender<Job>);

impl Submitter {
    /// Hands a job to the engine; `false` when the engine has stopped (the job is dropped,
    /// giving back its place).
    pub fn submit(&self, job: Job) -> bool {
        self.0.send(job).is_ok()
    }
}

impl Engine {
    /// Starts the engine thread: it loads the plugins (each drafter built and opened once
    /// against the model) and the model, then serves jobs. Returns once loading is done, with
    /// the loading error if it failed.
    pub fn start(config: EngineConfig, metrics: Arc<Metrics>) -> Result<(Engine, ModelInfo)> {
        // Admission is bounded by tickets; the channel only needs to hold what is admitted.
        let (jobs_tx, jobs_rx) = std::sync::mpsc::sync_channel::<Job>(4096);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<ModelInfo>>();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("mlx-engine".into())
            .spawn(move || run(config, jobs_rx, ready_tx, stop_flag, metrics))
            .context("cannot start the engine thread")?;
        let info = match ready_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                bail!("the engine thread ended while loading");
            }
        };
        Ok((
            Engine {
                jobs: Some(jobs_tx),
                thread: Some(thread),
                stop,
            },
            info,
        ))
    }

    pub fn submitter(&self) -> Submitter {
        Submitter(self.jobs.clone().expect("engine running"))
    }

    /// Lets every admitted request finish, then stops the thread.
    pub fn shutdown(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }
}

/// A loaded drafter.
struct Loaded {
    info: DrafterInfo,
    origin: String,
    manifest: Manifest,
    /// The target its checkpoint was trained for, when the checkpoint says.
    trained_for: Option<TrainedFor>,
    provider: DraftProviderBox,
    auto_off: bool,
    fitted_draft_length: bool,
}

/// Loads and builds every configured drafter. The registry is returned too: it holds the
/// plugins' libraries, kept for as long as the drafters run.
fn load_drafters(config: &EngineConfig) -> Result<(Option<Registry>, Vec<Loaded>)> {
    if config.drafters.is_empty() {
        return Ok((None, Vec::new()));
    }
    let registry = Registry::scan(&config.plugins_dirs)?;
    let mut out = Vec::new();
    for spec in &config.drafters {
        let plugin = registry
            .get(&spec.plugin)
            .with_context(|| format!("{}: drafter {:?}", spec.origin, spec.name))?;
        let manifest = plugin.manifest.clone();
        let k = spec
            .num_draft_tokens
            .or_else(|| {
                manifest
                    .defaults
                    .get(HOST_KEY_NUM_DRAFT_TOKENS)
                    .and_then(|v| v.as_integer())
                    .map(|v| v.max(0) as usize)
            })
            .unwrap_or(10);
        if k == 0 || k > 64 {
            bail!(
                "{}: drafter {:?}: num_draft_tokens must be between 1 and 64, got {k}",
                spec.origin,
                spec.name
            );
        }
        let trained_for = trained_for(plugin, &spec.overrides)
            .with_context(|| format!("{}: drafter {:?}", spec.origin, spec.name))?;
        let provider = instantiate(plugin, &spec.overrides)
            .with_context(|| format!("{}: drafter {:?}", spec.origin, spec.name))?;
        out.push(Loaded {
            info: DrafterInfo {
                name: spec.name.clone(),
                plugin: spec.plugin.clone(),
                version: manifest.plugin.version.clone(),
                num_draft_tokens: k,
            },
            origin: spec.origin.clone(),
            manifest,
            trained_for,
            provider,
            auto_off: spec.auto_off,
            fitted_draft_length: spec.fitted_draft_length,
        });
    }
    Ok((Some(registry), out))
}

/// One request being generated.
struct Active<'m> {
    job: Job,
    stepper: SpecStepper<'m>,
    drafter: Option<usize>,
    k: usize,
    first_token: Option<Instant>,
    /// The speculation counters already added to the metrics.
    reported: SpecStats,
}

fn run(
    config: EngineConfig,
    jobs: Receiver<Job>,
    ready: std::sync::mpsc::Sender<Result<ModelInfo>>,
    stop: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
) {
    let setup = (|| -> Result<_> {
        let (registry, drafters) = load_drafters(&config)?;
        let mut loaded = crate::load::load(&config.load)?;
        let tokenizer = loaded.tokenizer.take().ok_or_else(|| {
            anyhow!(
                "{} has no tokenizer.json; the server needs one to read prompts",
                config.load.path.display()
            )
        })?;
        // The window kernels compile before the first request, which would otherwise wait
        // for them (once for every drafter: the lengths are the model's, not a drafter's).
        if !drafters.is_empty() {
            warm_up_windows(&loaded.model)?;
        }
        // Every drafter is checked against this target and opens a session on it once, so
        // one that cannot serve it stops the start rather than every request.
        for d in &drafters {
            check_needs(&d.manifest, &target_spec(&loaded.model))
                .with_context(|| format!("{}: drafter {:?}", d.origin, d.info.name))?;
            warn_if_trained_for_another_target(
                d.trained_for.as_ref(),
                &d.info.name,
                &loaded.model,
                &config.load.path,
            )?;
            let probe = GenerateRequest {
                prompt_ids: vec![loaded.model.config.bos_token_id.unwrap_or(0)],
                max_tokens: 1,
                sampling: SamplingParams::default(),
                stop_ids: Vec::new(),
                ignore_eos: true,
            };
            let options = SpecOptions {
                num_draft_tokens: d.info.num_draft_tokens,
                auto_off: false,
                fitted_draft_length: false,
            };
            let stepper = SpecStepper::new(&loaded.model, &probe, Some(&d.provider), options)?;
            if let Some(e) = &stepper.spec_stats().drafter_error {
                bail!(
                    "{}: drafter {:?} (plugin {:?}) cannot draft for this model: {e}",
                    d.origin,
                    d.info.name,
                    d.info.plugin
                );
            }
        }
        Ok((registry, drafters, loaded, tokenizer))
    })();
    let (_registry, drafters, loaded, tokenizer) = match setup {
        Ok(v) => v,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let info = ModelInfo {
        tokenizer: Arc::new(tokenizer),
        stop_ids: loaded.stop_ids.clone(),
        vocab_size: loaded.model.config.vocab_size,
        drafters: drafters.iter().map(|d| d.info.clone()).collect(),
    };
    if ready.send(Ok(info)).is_err() {
        return;
    }
    let model = &loaded.model;
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut active: Vec<Active> = Vec::new();
    // Per drafter, what auto-off learned from its requests so far.
    let mut gate_memories = vec![GateMemory::default(); drafters.len()];
    let mut open = true;
    loop {
        if active.is_empty() && waiting.is_empty() {
            if !open || stop.load(Ordering::SeqCst) {
                // Stopping: take what is still in the channel, then end when nothing is left.
                match jobs.try_recv() {
                    Ok(job) => waiting.push_back(job),
                    Err(_) => break,
                }
            } else {
                match jobs.recv_timeout(Duration::from_millis(50)) {
                    Ok(job) => waiting.push_back(job),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => open = false,
                }
            }
        }
        while let Ok(job) = jobs.try_recv() {
            waiting.push_back(job);
        }
        // Clients that left while waiting.
        waiting.retain(|job| {
            let gone = job.events.is_closed();
            if gone {
                metrics.finished("abort");
            }
            !gone
        });
        while active.len() < config.max_active {
            let Some(job) = waiting.pop_front() else {
                break;
            };
            if Instant::now() >= job.deadline {
                fail(
                    &job,
                    &metrics,
                    true,
                    "the request timed out while waiting in the queue",
                );
                continue;
            }
            let (provider, options, drafter, k) = match job.speculation {
                Some(s) => {
                    let d = &drafters[s.drafter];
                    (
                        Some(&d.provider),
                        SpecOptions {
                            num_draft_tokens: s.num_draft_tokens,
                            auto_off: d.auto_off,
                            fitted_draft_length: d.fitted_draft_length,
                        },
                        Some(s.drafter),
                        s.num_draft_tokens,
                    )
                }
                None => (
                    None,
                    SpecOptions {
                        num_draft_tokens: 1,
                        auto_off: false,
                        fitted_draft_length: false,
                    },
                    None,
                    0,
                ),
            };
            match SpecStepper::new(model, &job.request, provider, options) {
                Ok(mut stepper) => {
                    stepper.limit_plain_burst(PLAIN_TURN);
                    if let Some(d) = drafter {
                        stepper.resume_gate(&gate_memories[d]);
                    }
                    active.push(Active {
                        job,
                        stepper,
                        drafter,
                        k,
                        first_token: None,
                        reported: SpecStats::default(),
                    });
                }
                Err(e) => fail(&job, &metrics, false, &format!("{e:#}")),
            }
        }
        metrics.set_queue(active.len(), waiting.len());
        if active.is_empty() {
            continue;
        }

        // One round for each active request, in turn.
        let mut ended = vec![false; active.len()];
        for (i, a) in active.iter_mut().enumerate() {
            if a.job.events.is_closed() {
                metrics.finished("abort");
                record_spec(&metrics, &drafters, a);
                ended[i] = true;
                continue;
            }
            if Instant::now() >= a.job.deadline {
                fail(&a.job, &metrics, true, "the request timed out");
                record_spec(&metrics, &drafters, a);
                ended[i] = true;
                continue;
            }
            if a.job.stop.load(Ordering::SeqCst) {
                ended[i] = true;
                finish(a, &drafters, &metrics);
                continue;
            }
            let before = counts(a.stepper.spec_stats());
            let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| a.stepper.step()));
            let emitted = match stepped {
                Ok(Ok(tokens)) => tokens,
                Ok(Err(e)) => {
                    tracing::error!("a request failed: {e:#}");
                    fail(
                        &a.job,
                        &metrics,
                        false,
                        &format!("generation failed: {e:#}"),
                    );
                    record_spec(&metrics, &drafters, a);
                    ended[i] = true;
                    continue;
                }
                Err(_) => {
                    tracing::error!("a request's round panicked; the request is dropped");
                    fail(&a.job, &metrics, false, "generation failed: internal error");
                    ended[i] = true;
                    continue;
                }
            };
            let after = counts(a.stepper.spec_stats());
            record_spec(&metrics, &drafters, a);
            if !emitted.is_empty() {
                if a.first_token.is_none() {
                    let now = Instant::now();
                    a.first_token = Some(now);
                    metrics.time_to_first_token((now - a.job.received).as_secs_f64());
                }
                let kinds = kinds(emitted.len(), after.0 - before.0, after.1 - before.1);
                let _ = a
                    .job
                    .events
                    .send(Event::Tokens(emitted.into_iter().zip(kinds).collect()));
            }
            if a.stepper.is_done() {
                ended[i] = true;
                finish(a, &drafters, &metrics);
            }
        }
        // What each finished request's gate learned starts the next request of its drafter.
        for (a, _) in active.iter().zip(&ended).filter(|(_, &e)| e) {
            if let Some(d) = a.drafter {
                a.stepper.remember_gate(&mut gate_memories[d]);
            }
        }
        let mut i = 0;
        active.retain(|_| {
            i += 1;
            !ended[i - 1]
        });
        metrics.set_queue(active.len(), waiting.len());
    }
    metrics.set_queue(0, 0);
    tracing::info!("engine stopped");
}

/// Drafted tokens and accepted drafts so far.
fn counts(s: &SpecStats) -> (u64, u64) {
    (s.num_draft_tokens, s.num_accepted_tokens)
}

/// How each of a round's `n` emitted tokens came about, from the drafts the round added and
/// those accepted: the leading accepted drafts, then the target's own token (a bonus when
/// every draft was accepted, else a correction); rounds without drafts are plain.
fn kinds(n: usize, drafted: u64, accepted: u64) -> Vec<TokenKind> {
    if drafted == 0 {
        return vec![TokenKind::Target; n];
    }
    (0..n)
        .map(|i| {
            if (i as u64) < accepted {
                TokenKind::Accepted
            } else if accepted == drafted {
                TokenKind::Bonus
            } else {
                TokenKind::Correction
            }
        })
        .collect()
}

fn fail(job: &Job, metrics: &Metrics, timeout: bool, message: &str) {
    metrics.finished(if timeout { "timeout" } else { "error" });
    let _ = job.events.send(Event::Failed {
        timeout,
        message: message.to_owned(),
    });
}

/// Adds to the drafter's counters what the request drafted since they were last added: each
/// round, so a scrape during a long request sees its progress.
fn record_spec(metrics: &Metrics, drafters: &[Loaded], a: &mut Active) {
    let Some(d) = a.drafter else {
        return;
    };
    let now = a.stepper.spec_stats();
    let was = &a.reported;
    if now.num_draft_tokens == was.num_draft_tokens
        && now.num_drafts == was.num_drafts
        && now.drafter_error.is_some() == was.drafter_error.is_some()
    {
        return;
    }
    let per_position = |now: &[u64], was: &[u64]| -> Vec<u64> {
        now.iter()
            .enumerate()
            .map(|(i, n)| n.saturating_sub(was.get(i).copied().unwrap_or(0)))
            .collect()
    };
    let delta = SpecStats {
        num_drafts: now.num_drafts.saturating_sub(was.num_drafts),
        num_draft_tokens: now.num_draft_tokens.saturating_sub(was.num_draft_tokens),
        num_accepted_tokens: now
            .num_accepted_tokens
            .saturating_sub(was.num_accepted_tokens),
        accepted_per_position: per_position(&now.accepted_per_position, &was.accepted_per_position),
        drafted_per_position: per_position(&now.drafted_per_position, &was.drafted_per_position),
        // Counted once, in the round the drafter was switched off.
        drafter_error: now
            .drafter_error
            .clone()
            .filter(|_| was.drafter_error.is_none()),
        ..SpecStats::default()
    };
    metrics.speculation(&drafters[d].info.name, &delta);
    a.reported = now.clone();
}

fn finish(a: &mut Active, drafters: &[Loaded], metrics: &Metrics) {
    record_spec(metrics, drafters, a);
    let stats = a.stepper.spec_stats();
    let tokens = a.stepper.tokens().len();
    let stop_reason = if a.job.stop.load(Ordering::SeqCst) || tokens < a.job.request.max_tokens {
        StopReason::Stop
    } else {
        StopReason::Length
    };
    if let Some(first) = a.first_token {
        let seconds = first.elapsed().as_secs_f64();
        if tokens > 1 && seconds > 0.0 {
            metrics.tokens_per_second((tokens - 1) as f64 / seconds);
        }
    }
    metrics.finished(match stop_reason {
        StopReason::Stop => "stop",
        StopReason::Length => "length",
    });
    metrics.tokens(a.job.request.prompt_ids.len(), tokens);
    let info = a.drafter.map(|d| &drafters[d].info);
    let _ = a.job.events.send(Event::Done(Finished {
        prompt_tokens: a.job.request.prompt_ids.len(),
        completion_tokens: tokens,
        stop_reason,
        speculation: SpecReport::new(info, a.k, stats),
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_kinds_follow_the_round() {
        use TokenKind::*;
        assert_eq!(kinds(2, 0, 0), vec![Target, Target]);
        assert_eq!(kinds(3, 2, 2), vec![Accepted, Accepted, Bonus]);
        assert_eq!(kinds(2, 4, 1), vec![Accepted, Correction]);
        assert_eq!(kinds(1, 3, 0), vec![Correction]);
    }

    #[test]
    fn tickets_bound_the_admitted_requests() {
        let count = Arc::new(AtomicUsize::new(0));
        let a = Ticket::take(&count, 2).unwrap();
        let b = Ticket::take(&count, 2).unwrap();
        assert!(Ticket::take(&count, 2).is_none());
        drop(a);
        let c = Ticket::take(&count, 2).unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 2);
        drop((b, c));
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }
}
