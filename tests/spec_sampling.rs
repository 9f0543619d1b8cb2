//! Sampling through the verify loop is lossless in distribution: the first two emitted tokens
//! follow the target's own joint distribution p(t1)·p(t2 | t1), for token-match verification
//! (drafter without probabilities: the target's tokens drawn on the device, as the loop draws
//! them) and for rejection sampling (drafter returning q), under temperature, top-p, top-k and
//! min-p. Each case draws 20 000 generations through the real accept walk, over a synthetic
//! 8-token target and over the tiny-vocabulary fixture model (its logits computed by the real
//! model for every prefix the draws reach), and a chi-square test compares the counts with
//! the exact distribution.
//!
//! The exact distribution is written out here, in float64, from the logits and the settings
//! (softmax at the temperature, then top-k, top-p, min-p as transformers applies them), not
//! taken from the sampler: a temperature or top-p bug shared by the sampler's own
//! `distribution` and the walk would otherwise pass.
//!
//! Rounds draft as the verify loop does, `min(GAMMA, budget - 1)` tokens, so a round whose
//! draft is accepted reaches the walk's bonus branch (the target's own token after the last
//! draft); the test counts those rounds and requires many. A deliberately broken walk must
//! fail the same test, so the test is known to have teeth.

mod common;

use common::sampling::{chi_square_fit, reference_distribution};

use std::cell::RefCell;
use std::collections::HashMap;

use mlx_rs::Dtype;
use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model, LogitsFor};

use mlx_spec::sampler::{sample_on_device, SamplingParams};
use mlx_spec::speculative::{accept_walk, Verified, Walk, WalkLimits};

const DRAWS: u64 = 20_000;
const GAMMA: usize = 3;
const PROMPT: [u32; 2] = [2, 4];

/// Next-token logits after a prefix.
trait Target {
    fn vocab(&self) -> usize;
    fn logits(&self, prefix: &[u32]) -> Vec<f32>;
}

/// A synthetic 8-token target (deterministic, prefix-dependent).
struct Synthetic;

impl Target for Synthetic {
    fn vocab(&self) -> usize {
        8
    }
    fn logits(&self, prefix: &[u32]) -> Vec<f32> {
        let h = prefix
            .iter()
            .fold(17u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64 + 1));
        (0..8)
            .map(|j| ((h % 97) as f32 * 0.37 + j as f32 * 1.3).sin() * 2.0)
            .collect()
    }
}

/// The tiny-vocabulary fixture model; each prefix's logits are computed once.
struct Fixture {
    model: Gemma4Model,
    memo: RefCell<HashMap<Vec<u32>, Vec<f32>>>,
}

impl Target for Fixture {
    fn vocab(&self) -> usize {
        self.model.config.vocab_size
    }
    fn logits(&self, prefix: &[u32]) -> Vec<f32> {
        if let Some(l) = self.memo.borrow().get(prefix) {
            return l.clone();
        }
        let out = self
            .model
            .forward(prefix, &mut self.model.new_cache(), LogitsFor::Last, false)
            .unwrap();
        let l = out.logits.as_slice::<f32>().to_vec();
        self.memo.borrow_mut().insert(prefix.to_vec(), l.clone());
        l
    }
}

fn fixture_target() -> Fixture {
    let dir = common::fixture("tiny-ple-kvshare");
    let model = Gemma4Model::load(&dir, DtypeChoice::Fixed(Dtype::Float32), None).unwrap();
    Fixture {
        model,
        memo: RefCell::new(HashMap::new()),
    }
}

/// A drafter distribution unlike the target's (its softmax at T = 1, unfiltered, mixed half
/// and half with a floor plus a peak elsewhere), but overlapping it enough that drafts are
/// often accepted and the bonus branch is reached.
fn drafter_q(target_logits: &[f32], last: u32) -> Vec<f32> {
    let vocab = target_logits.len();
    let max = target_logits
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f64> = target_logits
        .iter()
        .map(|&l| ((l - max) as f64).exp())
        .collect();
    let total: f64 = exps.iter().sum();
    let mut q: Vec<f32> = exps
        .iter()
        .map(|e| (0.5 * e / total + 0.2 / vocab as f64) as f32)
        .collect();
    q[(last as usize * 5 + 2) % vocab] += 0.3;
    q
}

fn unit(seed: u64, i: u64) -> f64 {
    let mut x =
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// The accept walk under test (the real one, or a broken one for the power check).
type WalkFn = fn(&Verified, &[u32], Option<&[f32]>, &SamplingParams, WalkLimits) -> Walk;

#[derive(Clone, Copy, PartialEq)]
enum DrafterKind {
    /// Proposes tokens without probabilities: exact-match verification.
    TokenMatch,
    /// Samples from q and returns q: rejection sampling.
    WithProbs,
}

/// Index of the largest logit, the lowest among ties.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs one generation of two tokens through the accept walk; returns them and whether a
/// round accepted all its drafts and emitted the bonus token after them.
fn generate_two(
    target: &dyn Target,
    kind: DrafterKind,
    sampling: &SamplingParams,
    walk: WalkFn,
) -> ((u32, u32), bool) {
    let vocab = target.vocab();
    let mut history = PROMPT.to_vec();
    let mut emitted = Vec::new();
    let mut round = 0u64;
    let mut bonus = false;
    while emitted.len() < 2 {
        // Draft as the verify loop does: at most the budget less the round's own token.
        let n = GAMMA.min(2 - emitted.len() - 1);
        let mut drafts = Vec::new();
        let mut probs = Vec::new();
        let mut last = *history.last().unwrap();
        for i in 0..n {
            let mut prefix = history.clone();
            prefix.extend_from_slice(&drafts);
            let q = drafter_q(&target.logits(&prefix), last);
            let u = unit(sampling.seed, round * 16 + i as u64);
            let mut acc = 0.0;
            let mut pick = vocab as u32 - 1;
            for (t, &p) in q.iter().enumerate() {
                acc += p as f64;
                if u < acc {
                    pick = t as u32;
                    break;
                }
            }
            if kind == DrafterKind::TokenMatch {
                // A token-match drafter may propose anything; this one proposes the target's
                // most likely token, so its drafts are often accepted and the bonus branch
                // is reached.
                pick = argmax(&target.logits(&prefix));
            }
            drafts.push(pick);
            probs.extend_from_slice(&q);
            last = pick;
        }
        // The verify window's rows: the target after history, after history + drafts[..i].
        let mut rows = Vec::new();
        let mut prefix = history.clone();
        rows.extend(target.logits(&prefix));
        for &t in &drafts {
            prefix.push(t);
            rows.extend(target.logits(&prefix));
        }
        // Token match: the target's own tokens, drawn on the device from those rows as the
        // verify loop draws them; rejection sampling reads the rows.
        let picks = if kind == DrafterKind::TokenMatch {
            let window = mlx_rs::Array::from_slice(&rows, &[drafts.len() as i32 + 1, vocab as i32]);
            let picks = sample_on_device(&window, sampling, emitted.len() as u64).unwrap();
            picks.eval().unwrap();
            picks.as_slice::<u32>().to_vec()
        } else {
            Vec::new()
        };
        let result = walk(
            &Verified {
                picks: &picks,
                rows: &rows,
                vocab,
            },
            &drafts,
            (kind == DrafterKind::WithProbs).then_some(&probs[..]),
            sampling,
            WalkLimits {
                first_index: emitted.len() as u64,
                budget: 2 - emitted.len(),
                stop_ids: &[],
            },
        );
        assert!(!result.emitted.is_empty());
        if !drafts.is_empty()
            && result.accepted == drafts.len()
            && result.emitted.len() == drafts.len() + 1
        {
            bonus = true;
        }
        emitted.extend_from_slice(&result.emitted);
        history.extend_from_slice(&result.emitted);
        round += 1;
    }
    ((emitted[0], emitted[1]), bonus)
}

#[test]
fn the_reference_distribution_filters_as_specified() {
    // Probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 at T = 1.
    let logits: Vec<f32> = [8.0f32, 4.0, 2.0, 1.0, 1.0]
        .iter()
        .map(|p| p.ln())
        .collect();
    let at = |temperature: f32, top_k: usize, top_p: f32, min_p: f32| {
        let s = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: 0,
            ..Default::default()
        };
        reference_distribution(&logits, &s)
    };
    // (1e-6: the logits are float32 logarithms.)
    let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
    assert!(close(
        &at(1.0, 0, 1.0, 0.0),
        &[0.5, 0.25, 0.125, 0.0625, 0.0625]
    ));
    // T = 0.5 squares the odds: 64, 16, 4, 1, 1 over 86.
    let squared: Vec<f64> = [64.0, 16.0, 4.0, 1.0, 1.0]
        .iter()
        .map(|x| x / 86.0)
        .collect();
    assert!(close(&at(0.5, 0, 1.0, 0.0), &squared));
    assert!(close(
        &at(1.0, 2, 1.0, 0.0),
        &[2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0, 0.0]
    ));
    // top-p 0.7 keeps 0.5 + 0.25; 0.76 needs the third token too.
    assert!(close(
        &at(1.0, 0, 0.7, 0.0),
        &[2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0, 0.0]
    ));
    assert!(close(
        &at(1.0, 0, 0.76, 0.0),
        &[4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0, 0.0, 0.0]
    ));
    // min-p 0.2 drops what is below 0.1.
    assert!(close(
        &at(1.0, 0, 1.0, 0.2),
        &[4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0, 0.0, 0.0]
    ));
    // top-k 3 then top-p 0.6 on the survivors (0.5, 0.25, 0.125) / 0.875: 0.571 < 0.6.
    assert!(close(
        &at(1.0, 3, 0.6, 0.0),
        &[2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0, 0.0]
    ));
}

/// Chi-square statistic of `counts` against the exact joint distribution, with cells of
/// expected count below 5 pooled; returns (statistic, critical value at p = 1e-4).
fn chi_square(
    target: &dyn Target,
    counts: &HashMap<(u32, u32), u64>,
    sampling: &SamplingParams,
) -> (f64, f64) {
    let p1 = reference_distribution(&target.logits(&PROMPT), sampling);
    let mut cells = Vec::new();
    for (t1, &a) in p1.iter().enumerate().filter(|e| *e.1 > 0.0) {
        let t1 = t1 as u32;
        let p2 = reference_distribution(&target.logits(&[PROMPT[0], PROMPT[1], t1]), sampling);
        for (t2, &b) in p2.iter().enumerate().filter(|e| *e.1 > 0.0) {
            let expected = a * b * DRAWS as f64;
            cells.push((expected, *counts.get(&(t1, t2 as u32)).unwrap_or(&0) as f64));
        }
    }
    let seen: u64 = counts.values().sum();
    assert_eq!(seen, DRAWS);
    let covered: f64 = cells.iter().map(|c| c.1).sum();
    assert_eq!(
        covered as u64, DRAWS,
        "a token outside the target's support was emitted"
    );
    chi_square_fit(&cells)
}

/// The sampling settings of the cases: (temperature, top-k, top-p, min-p).
const SETTINGS: [(f32, usize, f32, f32); 4] = [
    (0.8, 0, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.2, 0, 1.0, 0.1),
];

/// What one case measured.
struct Measured {
    stat: f64,
    crit: f64,
    /// Generations in which a round accepted every draft and emitted the bonus token.
    bonus_rounds: u64,
}

fn run(
    target: &dyn Target,
    kind: DrafterKind,
    (temperature, top_k, top_p, min_p): (f32, usize, f32, f32),
    walk: WalkFn,
) -> Measured {
    let settings = |seed| SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        ..Default::default()
    };
    let mut counts = HashMap::new();
    let mut bonus_rounds = 0;
    for seed in 0..DRAWS {
        let (pair, bonus) = generate_two(target, kind, &settings(seed * 7919 + 13), walk);
        *counts.entry(pair).or_insert(0u64) += 1;
        bonus_rounds += bonus as u64;
    }
    let (stat, crit) = chi_square(target, &counts, &settings(0));
    Measured {
        stat,
        crit,
        bonus_rounds,
    }
}

/// Runs every setting and checks the fit and that the bonus branch was taken often: at
/// least 2 % of the generations (each case reaches it in 11 % or more; a walk that never
/// emitted a bonus token, or a drafter whose drafts were never accepted, would fail).
fn check_lossless(target: &dyn Target, kind: DrafterKind, what: &str) {
    for setting in SETTINGS {
        let m = run(target, kind, setting, accept_walk);
        println!(
            "{what} {setting:?}: chi2 {:.1} (critical {:.1}), bonus in {} generations",
            m.stat, m.crit, m.bonus_rounds
        );
        assert!(
            m.stat < m.crit,
            "{what} {setting:?}: chi2 {:.1} >= {:.1}",
            m.stat,
            m.crit
        );
        assert!(
            m.bonus_rounds > DRAWS / 50,
            "{what} {setting:?}: the bonus branch was reached in only {} of {DRAWS} generations",
            m.bonus_rounds
        );
    }
}

#[test]
fn token_match_verification_samples_the_target_distribution() {
    check_lossless(
        &Synthetic,
        DrafterKind::TokenMatch,
        "synthetic, token match",
    );
}

#[test]
fn rejection_sampling_samples_the_target_distribution() {
    check_lossless(&Synthetic, DrafterKind::WithProbs, "synthetic, rejection");
}

/// A walk that trusts the drafter blindly: emits its drafts as if accepted.
fn broken_walk(
    t: &Verified,
    drafts: &[u32],
    probs: Option<&[f32]>,
    s: &SamplingParams,
    l: WalkLimits,
) -> Walk {
    if drafts.is_empty() {
        return accept_walk(t, drafts, probs, s, l);
    }
    let n = drafts.len().min(l.budget);
    Walk {
        emitted: drafts[..n].to_vec(),
        accepted: n,
        stop_token: None,
    }
}

/// A walk whose bonus token ignores the temperature (drawn at T = 1): wrong only in the
/// branch that emits a token after all drafts were accepted.
fn bonus_at_unit_temperature(
    t: &Verified,
    drafts: &[u32],
    probs: Option<&[f32]>,
    s: &SamplingParams,
    l: WalkLimits,
) -> Walk {
    let first_index = l.first_index;
    let walk = accept_walk(t, drafts, probs, s, l);
    let d = drafts.len();
    if d == 0 || walk.accepted < d || walk.emitted.len() <= d {
        return walk;
    }
    let unit = SamplingParams {
        temperature: 1.0,
        ..*s
    };
    let row = &t.rows[d * t.vocab..(d + 1) * t.vocab];
    let mut emitted = walk.emitted.clone();
    emitted[d] = unit.sample(row, first_index + d as u64);
    Walk { emitted, ..walk }
}

#[test]
fn the_test_rejects_a_walk_that_is_not_lossless() {
    let m = run(
        &Synthetic,
        DrafterKind::WithProbs,
        (1.0, 0, 1.0, 0.0),
        broken_walk,
    );
    assert!(
        m.stat > m.crit,
        "a broken walk passed: chi2 {:.1} < {:.1}",
        m.stat,
        m.crit
    );
    // A temperature bug confined to the bonus token is caught too (T = 0.5 against 1).
    let m = run(
        &Synthetic,
        DrafterKind::WithProbs,
        (0.5, 0, 1.0, 0.0),
        bonus_at_unit_temperature,
    );
    assert!(
        m.stat > m.crit,
        "a wrong bonus temperature passed: chi2 {:.1} < {:.1}",
        m.stat,
        m.crit
    );
}

#[test]
fn both_verifications_sample_the_fixture_models_distribution() {
    let target = fixture_target();
    check_lossless(&target, DrafterKind::TokenMatch, "fixture, token match");
    check_lossless(&target, DrafterKind::WithProbs, "fixture, rejection");
    let m = run(
        &target,
        DrafterKind::WithProbs,
        (1.0, 0, 1.0, 0.0),
        broken_walk,
    );
    assert!(
        m.stat > m.crit,
        "a broken walk passed on the fixture: chi2 {:.1} < {:.1}",
        m.stat,
        m.crit
    );
}
