//! Replayed drafts (`bench --replay-drafts`): drafts taken from the plain output with a set hit
//! rate go through the real verify loop, which must accept exactly the right ones and still
//! emit the plain output. The expectations are computed independently of the loop: the output
//! is transformers' greedy continuation (the fixture's golden), and which drafts are accepted,
//! round by round, follows from the replay's coins (SplitMix64 of `(seed, emitted index)`, as
//! `speculative::replay` documents them) and the loop's rule (a round keeps its leading right
//! drafts and adds the target's own token), simulated here.
//!
//! The same drafter forces the loop's edge cases: a stop token inside an accepted window, and
//! rollbacks deeper than the sliding window after the buffers have passed 512 positions.

mod common;

use common::{fixture, Golden};
use mlx_rs::{Array, Dtype};
use mlx_spec::generate::{generate, GenerateRequest, StopReason};
use mlx_spec::model::gemma4::layer::DecoderLayer;
use mlx_spec::model::gemma4::{DtypeChoice, FastPath, Gemma4Model, KvView, LayerCall};
use mlx_spec::sampler::SamplingParams;
use mlx_spec::speculative::replay::{coin, ReplayDrafter};
use mlx_spec::speculative::{generate_speculative, GateMemory, SpecOptions, SpecStats};

const SEED: u64 = 11;

fn load(name: &str) -> Gemma4Model {
    Gemma4Model::load(&fixture(name), DtypeChoice::Fixed(Dtype::Float32), None).unwrap()
}

fn request(prompt_ids: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        ignore_eos: true,
    }
}

/// Speculates with `continuation` replayed at `hit_rate`, `k` drafts a round (auto-off off,
/// so every round asks for `min(k, budget - 1)`); returns the tokens, the tokens streamed to
/// the callback, and the counters.
fn speculate(
    model: &Gemma4Model,
    req: &GenerateRequest,
    continuation: &[u32],
    hit_rate: f64,
    k: usize,
) -> (Vec<u32>, Vec<u32>, StopReason, SpecStats) {
    let provider = ReplayDrafter::new(continuation.to_vec(), hit_rate, SEED)
        .unwrap()
        .into_provider();
    let options = SpecOptions {
        num_draft_tokens: k,
        auto_off: false,
        fitted_draft_length: false,
    };
    let mut streamed = Vec::new();
    let (tokens, stats, spec) = generate_speculative(
        model,
        req,
        Some(&provider),
        options,
        &mut GateMemory::default(),
        |t| {
            streamed.push(t);
            Ok(())
        },
    )
    .unwrap();
    (tokens, streamed, stats.stop_reason, spec)
}

/// The counters the loop must report, simulated from the coins.
#[derive(Debug, Default, PartialEq)]
struct Expected {
    num_drafts: u64,
    num_draft_tokens: u64,
    num_accepted_tokens: u64,
    target_forwards: u64,
    accepted_per_position: Vec<u64>,
    drafted_per_position: Vec<u64>,
    /// Rounds that rolled back more drafts than `deeper_than`.
    deep_rollbacks: u64,
}

/// The rounds of a greedy request of `n` tokens: the prefill emits index 0; each round drafts
/// `min(k, remaining - 1)` tokens for the next indices, keeps the leading right ones, emits
/// the target's token after them, and rolls back the rest.
fn simulate(n: usize, k: usize, hit_rate: f64, deeper_than: usize) -> Expected {
    simulate_in_parts(n, k, hit_rate, deeper_than, usize::MAX)
}

/// [`simulate`] where windows run in parts of at most `part` tokens, each part only when every
/// draft before it was accepted: a round whose draft `m` is rejected runs `m / part + 1` parts,
/// one that accepts all runs every part of its window.
fn simulate_in_parts(
    n: usize,
    k: usize,
    hit_rate: f64,
    deeper_than: usize,
    part: usize,
) -> Expected {
    let mut e = Expected::default();
    let mut emitted = 1;
    while emitted < n {
        let drafts = k.min(n - emitted - 1);
        if drafts == 0 {
            e.target_forwards += 1;
            emitted += 1;
            continue;
        }
        let accepted = (0..drafts)
            .take_while(|&j| coin(SEED, (emitted + j) as u64) < hit_rate)
            .count();
        e.target_forwards += if accepted == drafts {
            (drafts + 1).div_ceil(part) as u64
        } else {
            (accepted / part + 1) as u64
        };
        e.num_drafts += 1;
        e.num_draft_tokens += drafts as u64;
        e.num_accepted_tokens += accepted as u64;
        if e.drafted_per_position.len() < drafts {
            e.drafted_per_position.resize(drafts, 0);
            e.accepted_per_position.resize(drafts, 0);
        }
        for j in 0..drafts {
            e.drafted_per_position[j] += 1;
            e.accepted_per_position[j] += (j < accepted) as u64;
        }
        if drafts - accepted > deeper_than {
            e.deep_rollbacks += 1;
        }
        emitted += accepted + 1;
    }
    e
}

fn counters(s: &SpecStats) -> Expected {
    Expected {
        num_drafts: s.num_drafts,
        num_draft_tokens: s.num_draft_tokens,
        num_accepted_tokens: s.num_accepted_tokens,
        target_forwards: s.target_forwards,
        accepted_per_position: s.accepted_per_position.clone(),
        drafted_per_position: s.drafted_per_position.clone(),
        deep_rollbacks: 0,
    }
}

#[test]
fn replayed_drafts_are_accepted_exactly_when_right() {
    let model = load("tiny-ple-kvshare");
    let golden = Golden::load("tiny-ple-kvshare");
    // transformers' greedy continuation: the output every run below must give.
    let want = golden.ids("greedy_ids");
    let req = request(golden.ids("prompt_ids"), want.len());
    let (plain, _) = generate(&model, &req, |_| Ok(())).unwrap();
    assert_eq!(plain, want, "plain decoding differs from transformers");

    for hit_rate in [1.0, 0.0, 0.6] {
        let (tokens, streamed, _, stats) = speculate(&model, &req, &want, hit_rate, 4);
        assert_eq!(tokens, want, "hit rate {hit_rate}: output differs");
        assert_eq!(
            streamed, want,
            "hit rate {hit_rate}: streamed tokens differ"
        );
        let expected = simulate(want.len(), 4, hit_rate, usize::MAX);
        let mut got = counters(&stats);
        got.deep_rollbacks = 0;
        assert_eq!(got, expected, "hit rate {hit_rate}: {stats:?}");
    }
    // The simulated cases are what their names say: 24 tokens in 5-token rounds (the first
    // from the prefill: 23 = 4 x 5 + 3 -> 5 forwards), one token a forward, and a mix.
    assert_eq!(simulate(want.len(), 4, 1.0, 0).target_forwards, 5);
    assert_eq!(simulate(want.len(), 4, 0.0, 0).num_accepted_tokens, 0);
    assert_eq!(simulate(want.len(), 4, 0.0, 0).target_forwards, 23);
    let mixed = simulate(want.len(), 4, 0.6, 0);
    assert!(
        mixed.num_accepted_tokens > 0 && mixed.num_accepted_tokens < mixed.num_draft_tokens,
        "{mixed:?}"
    );
}

/// A stand-in for a GPU's fast path: MLX's own blocks for every layer, but windows longer
/// than `limit` tokens declared inexact, so the loop verifies long proposals in parts.
struct WindowsOf(usize);

impl FastPath for WindowsOf {
    fn layer(
        &self,
        layer: &DecoderLayer,
        call: LayerCall<'_>,
    ) -> anyhow::Result<(Array, Option<KvView>)> {
        layer.forward(call.x, call.offset, call.cache, call.shared, call.per_layer)
    }

    fn logits(
        &self,
        _model: &Gemma4Model,
        _x: &Array,
        _window: bool,
    ) -> anyhow::Result<Option<Array>> {
        Ok(None)
    }

    fn verify_window_limit(&self, _model: &Gemma4Model) -> Option<usize> {
        Some(self.0)
    }
}

#[test]
fn proposals_longer_than_a_window_are_verified_in_parts_that_stop_at_the_first_rejection() {
    let mut model = load("tiny-ple-kvshare");
    model.set_fast_path(Some(Box::new(WindowsOf(4))));
    let golden = Golden::load("tiny-ple-kvshare");
    let want = golden.ids("greedy_ids");
    let req = request(golden.ids("prompt_ids"), want.len());
    for hit_rate in [1.0, 0.0, 0.6, 0.9] {
        let (tokens, _, _, stats) = speculate(&model, &req, &want, hit_rate, 10);
        assert_eq!(tokens, want, "hit rate {hit_rate}: output differs");
        let expected = simulate_in_parts(want.len(), 10, hit_rate, usize::MAX, 4);
        let mut got = counters(&stats);
        got.deep_rollbacks = 0;
        assert_eq!(got, expected, "hit rate {hit_rate}: {stats:?}");
    }
    // All accepted: 11-token windows in three parts; none accepted: one part a round.
    let all = simulate_in_parts(want.len(), 10, 1.0, 0, 4);
    assert!(all.target_forwards > simulate(want.len(), 10, 1.0, 0).target_forwards);
    let none = simulate_in_parts(want.len(), 10, 0.0, 0, 4);
    assert_eq!(
        none.target_forwards,
        simulate(want.len(), 10, 0.0, 0).target_forwards
    );
}

/// Where MLX's operations are not trusted to compute a window as decode steps (a GPU) and no
/// fast path takes windows, a window verifies a token at a time: the loop drafts nothing,
/// says why, and gives plain decoding's output; on the CPU the same drafter drafts.
#[test]
fn untrusted_operation_windows_leave_drafting_off() {
    use mlx_spec::model::gemma4::RunSettings;
    let mut model = load("tiny-ple-kvshare");
    let golden = Golden::load("tiny-ple-kvshare");
    let want = golden.ids("greedy_ids");
    let req = request(golden.ids("prompt_ids"), want.len());
    assert_eq!(
        model.verify_window_limit(),
        None,
        "the CPU runs windows whole"
    );
    let (_, _, _, trusted) = speculate(&model, &req, &want, 1.0, 4);
    assert!(trusted.drafting_skipped.is_none() && trusted.num_drafts > 0);

    model.set_settings(RunSettings {
        operation_windows_match_steps: false,
        ..model.settings()
    });
    assert_eq!(model.verify_window_limit(), Some(1));
    let (tokens, _, _, stats) = speculate(&model, &req, &want, 1.0, 4);
    assert_eq!(tokens, want);
    assert!(stats.drafting_skipped.is_some(), "{stats:?}");
    assert_eq!(stats.num_drafts, 0);
    // A fast path's window kernels are trusted where MLX's operations are not.
    model.set_fast_path(Some(Box::new(WindowsOf(4))));
    assert_eq!(model.verify_window_limit(), Some(4));
}

/// A stop token among the drafts of a round whose earlier drafts are accepted: the
/// speculative output ends exactly where plain decoding ends (before the stop token), and
/// neither the stop token nor anything drafted after it is emitted or streamed.
#[test]
fn a_stop_token_inside_an_accepted_window_ends_output_where_plain_decoding_does() {
    let model = load("tiny-ple-kvshare");
    let golden = Golden::load("tiny-ple-kvshare");
    let prompt = golden.ids("prompt_ids");
    let continuation = golden.ids("greedy_ids");
    // With every draft right and 4 a round, rounds emit indices 1-5, 6-10, ...: index i is
    // the round's draft number (i - 1) % 5, and draft numbers 1 to 3 have an accepted draft
    // before them and one after. Take the first token first met at such an index.
    let (at, stop) = continuation
        .iter()
        .enumerate()
        .find(|&(i, t)| i > 0 && (1..=3).contains(&((i - 1) % 5)) && !continuation[..i].contains(t))
        .map(|(i, &t)| (i, t))
        .expect("the golden continuation has a token first met inside a window");
    // (Rounds before it are full: 4 drafts fit the budget up to index 19.)
    assert!(at < 19, "stop index {at}");
    let req = GenerateRequest {
        stop_ids: vec![stop],
        ignore_eos: false,
        ..request(prompt, continuation.len())
    };
    let (plain, plain_stats) = generate(&model, &req, |_| Ok(())).unwrap();
    assert_eq!(
        plain,
        continuation[..at],
        "plain decoding stops before {stop}"
    );
    assert_eq!(plain_stats.stop_token, Some(stop));

    let (tokens, streamed, reason, stats) = speculate(&model, &req, &continuation, 1.0, 4);
    assert_eq!(
        tokens, plain,
        "speculative output past the stop token {stop}"
    );
    assert_eq!(
        streamed, plain,
        "streamed tokens past the stop token {stop}"
    );
    assert_eq!(reason, plain_stats.stop_reason);
    // The stop token was drafted inside the window of the last round, after accepted drafts.
    let last_round_first = 1 + (at - 1) / 5 * 5;
    let accepted_in_last_round = (at - last_round_first) as u64;
    assert!(accepted_in_last_round >= 1);
    assert_eq!(
        stats.num_accepted_tokens,
        (last_round_first - 1) as u64 / 5 * 4 + accepted_in_last_round,
        "{stats:?}"
    );
}

/// Rounds of 12 drafts half of which are wrong, on fixtures whose sliding window is 4 and 8
/// tokens, for 560 tokens (past the 512 slots the buffers start with): most rejections roll
/// the cache back by more than the window, after it wrapped many times and after the
/// buffers' first compaction; the greedy output must still be the plain one, and every draft
/// accepted exactly when it was right.
#[test]
fn rollbacks_deeper_than_the_sliding_window_keep_greedy_output_exact() {
    for name in ["tiny-moe-keqv", "tiny-wrapped-bf16"] {
        let model = load(name);
        let window = model.config.sliding_window;
        let k = 12;
        assert!(k > window, "{name}: window {window}");
        let req = request(Golden::load(name).ids("prompt_ids"), 560);
        let (plain, _) = generate(&model, &req, |_| Ok(())).unwrap();
        let (tokens, _, _, stats) = speculate(&model, &req, &plain, 0.5, k);
        assert_eq!(tokens, plain, "{name}: speculative output differs");
        let expected = simulate(plain.len(), k, 0.5, window);
        let mut got = counters(&stats);
        got.deep_rollbacks = expected.deep_rollbacks;
        assert_eq!(got, expected, "{name}");
        assert!(
            expected.deep_rollbacks > 20,
            "{name}: only {} rollbacks deeper than the window",
            expected.deep_rollbacks
        );
    }
}
