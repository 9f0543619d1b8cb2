//! The exact sampling distribution, written out independently of the sampler, and a
//! chi-square fit of observed counts against it: shared by the tests that check sampled
//! output is distributed exactly as the target's.

use mlx_spec::sampler::SamplingParams;

/// The distribution a token is drawn from, written out from the definitions in float64 (the
/// sampler's own `distribution` is what is under test): softmax of `logits / T`; top-k keeps
/// the k most likely; top-p keeps the smallest most-likely-first set whose (renormalised)
/// mass reaches p; min-p drops tokens below `min_p` times the most likely; then renormalise.
/// Ties are ordered by the lower id. Returns one probability per vocabulary entry.
pub fn reference_distribution(logits: &[f32], s: &SamplingParams) -> Vec<f64> {
    let v = logits.len();
    let t = s.temperature as f64;
    let max = logits
        .iter()
        .map(|&l| l as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = logits
        .iter()
        .map(|&l| ((l as f64 - max) / t).exp())
        .collect();
    let total: f64 = exps.iter().sum();
    let mut probs: Vec<f64> = exps.iter().map(|e| e / total).collect();
    let mut order: Vec<usize> = (0..v).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let mut keep = vec![true; v];
    if s.top_k > 0 {
        for &i in order.iter().skip(s.top_k) {
            keep[i] = false;
        }
    }
    if s.top_p < 1.0 {
        let kept_mass: f64 = (0..v).filter(|&i| keep[i]).map(|i| probs[i]).sum();
        let mut mass = 0.0;
        let mut reached = false;
        for &i in &order {
            if !keep[i] {
                continue;
            }
            if reached {
                keep[i] = false;
                continue;
            }
            mass += probs[i] / kept_mass;
            reached = mass >= s.top_p as f64;
        }
    }
    if s.min_p > 0.0 {
        let top = probs[order[0]];
        for i in 0..v {
            if probs[i] < s.min_p as f64 * top {
                keep[i] = false;
            }
        }
    }
    for i in 0..v {
        if !keep[i] {
            probs[i] = 0.0;
        }
    }
    let total: f64 = probs.iter().sum();
    probs.iter().map(|p| p / total).collect()
}

/// Pearson's chi-square of `(expected, observed)` cells, cells expected below 5 pooled into
/// one, and the critical value it must stay under: the 1 - 1e-4 quantile for its degrees of
/// freedom by the Wilson-Hilferty approximation (z = 3.72). With fixed seeds each case is
/// deterministic; at this level a correct sampler fails for about one seed set in ten
/// thousand. (When the walk's test was written, eight independent seed sets of its synthetic
/// rejection case gave statistics averaging 53 for 51 degrees of freedom; a deliberately
/// broken walk scored about 10^6.)
pub fn chi_square_fit(cells: &[(f64, f64)]) -> (f64, f64) {
    let (mut pooled_e, mut pooled_o, mut stat, mut bins) = (0.0, 0.0, 0.0, 0usize);
    for &(e, o) in cells {
        if e < 5.0 {
            pooled_e += e;
            pooled_o += o;
        } else {
            stat += (o - e).powi(2) / e;
            bins += 1;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_o - pooled_e).powi(2) / pooled_e.max(1e-9);
        bins += 1;
    }
    let k = (bins.max(2) - 1) as f64;
    let crit = k * (1.0 - 2.0 / (9.0 * k) + 3.72 * (2.0 / (9.0 * k)).sqrt()).powi(3);
    (stat, crit)
}

/// What seeded three-token generations with a drafter came to: its drafts, and the chi-square
/// fit of the outputs against the target's exact joint distribution.
pub struct DrafterDraws {
    pub drafted: u64,
    pub accepted: u64,
    pub stat: f64,
    pub crit: f64,
    pub cells: usize,
}

/// `draws` seeded generations of three tokens after `prompt`, speculating with `provider`
/// (`sampling(seed)` the request's parameters), counted against the exact joint distribution
/// of the three tokens computed from the target's own logits with [`reference_distribution`].
/// Asserts that the drafter never failed and that no output fell outside the target's
/// support; the caller judges the branches reached and the fit.
pub fn drafted_three_tokens(
    model: &mlx_spec::model::gemma4::Gemma4Model,
    provider: &mlx_spec_plugin_api::abi::DraftProviderBox,
    prompt: &[u32],
    options: mlx_spec::speculative::SpecOptions,
    sampling: impl Fn(u64) -> SamplingParams,
    draws: u64,
) -> DrafterDraws {
    use mlx_spec::generate::GenerateRequest;
    use mlx_spec::model::gemma4::LogitsFor;
    use mlx_spec::speculative::{generate_speculative, GateMemory};
    use std::collections::HashMap;

    let mut counts: HashMap<Vec<u32>, u64> = HashMap::new();
    let (mut drafted, mut accepted) = (0u64, 0u64);
    for seed in 0..draws {
        let req = GenerateRequest {
            prompt_ids: prompt.to_vec(),
            max_tokens: 3,
            sampling: sampling(seed * 7919 + 5),
            stop_ids: Vec::new(),
            ignore_eos: true,
        };
        let (tokens, _, stats) = generate_speculative(
            model,
            &req,
            Some(provider),
            options,
            &mut GateMemory::default(),
            |_| Ok(()),
        )
        .unwrap();
        assert!(stats.drafter_error.is_none(), "{stats:?}");
        drafted += stats.num_draft_tokens;
        accepted += stats.num_accepted_tokens;
        *counts.entry(tokens).or_default() += 1;
    }
    let next = |prefix: &[u32]| {
        let logits = model
            .forward(prefix, &mut model.new_cache(), LogitsFor::Last, false)
            .unwrap()
            .logits;
        logits.eval().unwrap();
        reference_distribution(logits.as_slice::<f32>(), &sampling(0))
    };
    let mut cells = Vec::new();
    let mut covered = 0u64;
    let mut context = prompt.to_vec();
    for (t1, &a) in next(&context).iter().enumerate().filter(|e| *e.1 > 0.0) {
        context.push(t1 as u32);
        for (t2, &b) in next(&context).iter().enumerate().filter(|e| *e.1 > 0.0) {
            context.push(t2 as u32);
            for (t3, &c) in next(&context).iter().enumerate().filter(|e| *e.1 > 0.0) {
                let seen = *counts
                    .get(&vec![t1 as u32, t2 as u32, t3 as u32])
                    .unwrap_or(&0);
                covered += seen;
                cells.push((a * b * c * draws as f64, seen as f64));
            }
            context.pop();
        }
        context.pop();
    }
    assert_eq!(covered, draws, "an output outside the target's support");
    let (stat, crit) = chi_square_fit(&cells);
    DrafterDraws {
        drafted,
        accepted,
        stat,
        crit,
        cells: cells.len(),
    }
}
