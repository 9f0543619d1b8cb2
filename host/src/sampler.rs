//! Token sampling: greedy, temperature, top-k, top-p and min-p, seeded and reproducible.
//!
//! The sample for the token at emitted index `i` depends only on `(seed, i)` and the logits:
//! its random number comes from a counter-based generator keyed by both, never from a
//! sequential RNG state. The verify loop relies on this — a drafted token is accepted exactly
//! when it equals what the target would have sampled at that index — and so does every
//! reproducibility claim (`--seed`).
//!
//! Filters apply in transformers' order: temperature, top-k, top-p, min-p.
//!
//! Two samplers share these rules and this key. [`sample_on_device`] draws on MLX's device
//! from the logits where they are, and every sampled path of the host draws through it
//! ([`draw_tokens`]: plain decoding, the verify loop's token match), so that a sampled step
//! does not wait for its logits to reach the host. [`SamplingParams::sample`] and
//! [`SamplingParams::distribution`] compute on the host in float64: the exact distribution the
//! tests measure the device against, the rejection sampling of drafters that return their own
//! distributions, and, where [`SamplingParams::draw`] says so (`--sampler host`, or top-p alone on the
//! CPU), the draws themselves, as the first versions drew.

use anyhow::{bail, Result};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::ops::{argpartition_axis, argsort_axis, concatenate, cumsum, exp, minimum, select};
use mlx_rs::{Array, Dtype};

/// Sampling settings of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = off).
    pub min_p: f32,
    pub seed: u64,
    /// Where sampled tokens are drawn.
    pub draw: DrawPlace,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            draw: DrawPlace::Auto,
        }
    }
}

impl SamplingParams {
    /// Rejects settings that have no meaning, naming the flag at fault.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top-p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min-p must be in [0, 1], got {}", self.min_p);
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The distribution tokens are drawn from after every filter: `(token, probability)`
    /// pairs, most likely first (ties broken by lower id), probabilities summing to 1.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        if self.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let inv_t = 1.0 / self.temperature as f64;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut weights: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l as f64 - max) * inv_t).exp()))
            .filter(|&(_, w)| w > 0.0)
            .collect();
        let by_weight = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));

        if self.top_k > 0 && self.top_k < weights.len() {
            weights.select_nth_unstable_by(self.top_k - 1, by_weight);
            weights.truncate(self.top_k);
        }
        if self.top_p < 1.0 {
            // Sort only as many candidates as needed: grow the sorted head until it holds the
            // nucleus (usually a few dozen tokens out of the whole vocabulary).
            let total: f64 = weights.iter().map(|w| w.1).sum();
            let target = self.top_p as f64 * total;
            let mut head = 64.min(weights.len());
            loop {
                if head < weights.len() {
                    weights.select_nth_unstable_by(head - 1, by_weight);
                }
                weights[..head].sort_by(by_weight);
                let mut mass = 0.0;
                let cut = weights[..head].iter().position(|w| {
                    mass += w.1;
                    mass >= target
                });
                if let Some(last) = cut {
                    weights.truncate(last + 1);
                    break;
                }
                if head == weights.len() {
                    break;
                }
                head = (head * 4).min(weights.len());
            }
        }
        weights.sort_by(by_weight);
        if self.min_p > 0.0 {
            let floor = self.min_p as f64 * weights[0].1;
            weights.retain(|w| w.1 >= floor);
        }
        let total: f64 = weights.iter().map(|w| w.1).sum();
        for w in &mut weights {
            w.1 /= total;
        }
        weights
    }

    /// The token emitted at index `index` of this request, given the target's logits there.
    pub fn sample(&self, logits: &[f32], index: u64) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        draw(
            &self.distribution(logits),
            uniform(self.seed, index, Stream::Token),
        )
    }
}

/// The tokens at emitted indices `first_index .. first_index + T`, drawn on the device from
/// `[T, vocab]` float32 logits and not yet evaluated (`[T]`, uint32): row `t` is drawn from
/// the row's [`SamplingParams::distribution`] with the number `uniform(seed, first_index + t,
/// Token)`, the same key the host sampler uses. Greedy: the argmax of every row.
///
/// Why on the device: a token drawn on the host must wait for its logits, so every step of
/// sampled decoding synchronised, where greedy decoding queues step n + 1 before reading token
/// n (on an H200 a synchronised step cost 6.4 ms against 4.1 queued). A token drawn here
/// stays on the device, so the next forward can be queued behind it as greedy decoding
/// queues its argmax, and a verify round reads `T` token ids instead of `T` rows of logits.
///
/// The arithmetic is float32 where the host's is float64, so the two may draw different
/// tokens near a boundary of the cumulative distribution: the distribution is the same, the
/// tokens are not bit for bit the host sampler's. Every sampled path of the host (plain
/// decoding, the verify loop's token match) draws here, so plain and speculative decoding draw
/// alike. Ties at a top-k or top-p boundary may keep a different one of the tied tokens than
/// the host, whose order among ties is by id.
pub fn sample_on_device(
    logits: &Array,
    params: &SamplingParams,
    first_index: u64,
) -> Result<Array> {
    if params.is_greedy() {
        return Ok(argmax_axis(logits, -1, false)?.as_dtype(Dtype::Uint32)?);
    }
    let uniforms = device_uniforms(params.seed, first_index, logits.shape()[0] as usize)?;
    draw_rows(logits, params, &uniforms)
}

/// [`sample_on_device`] with the rows' uniforms given (`[rows, 1]` float32 in [0, 1]).
fn draw_rows(logits: &Array, params: &SamplingParams, uniforms: &Array) -> Result<Array> {
    let rows = logits.shape()[0];
    let vocab = logits.shape()[1];
    let x = logits.as_dtype(Dtype::Float32)?;
    let max = x.max_axis(-1, true)?;
    let inv_t = Array::from_f32(1.0 / params.temperature);
    let mut weights = exp(x.subtract(&max)?.multiply(&inv_t)?)?;
    let top_k = params.top_k > 0 && params.top_k < vocab as usize;
    let ranked = top_k || params.top_p < 1.0 || params.min_p > 0.0;
    let zero = Array::from_f32(0.0);
    // The filters keep the most likely tokens, so they act on the weights sorted most likely
    // first; then every filter keeps a prefix. Without one, the draw walks the ids in order.
    // With top-k only the k most likely are sorted (Gemma 4's own settings keep 64 of 262 144).
    let order = if ranked {
        let order = if top_k {
            let k = params.top_k as i32;
            let candidates = argpartition_axis(weights.negative()?, k - 1, -1)?.index((.., 0..k));
            weights = weights.take_along_axis(&candidates, -1)?;
            let by_weight = argsort_axis(weights.negative()?, -1)?;
            weights = weights.take_along_axis(&by_weight, -1)?;
            candidates.take_along_axis(&by_weight, -1)?
        } else {
            let order = argsort_axis(weights.negative()?, -1)?;
            weights = weights.take_along_axis(&order, -1)?;
            order
        };
        if params.top_p < 1.0 {
            // A token stays while the mass before it is short of top_p of the total: the
            // smallest prefix whose mass reaches it, as the host keeps.
            let before = cumsum(&weights, -1, false, true)?.subtract(&weights)?;
            let target = weights
                .sum_axis(-1, true)?
                .multiply(Array::from_f32(params.top_p))?;
            weights = select(&before.lt(&target)?, &weights, &zero)?;
        }
        if params.min_p > 0.0 {
            let floor = weights
                .index((.., 0..1))
                .multiply(Array::from_f32(params.min_p))?;
            weights = select(&weights.ge(&floor)?, &weights, &zero)?;
        }
        Some(order)
    } else {
        None
    };
    // Inverse CDF: the first position whose running mass exceeds u times the total.
    let width = weights.shape()[1];
    let running = cumsum(&weights, -1, false, true)?;
    let total = running.index((.., (width - 1)..width));
    let position = running
        .le(uniforms.multiply(&total)?)?
        .as_dtype(Dtype::Int32)?
        .sum_axis(-1, true)?;
    // u rounded to float32 can make u times the total equal the total, which counts every
    // position: take the last one with weight (in id order weights that underflowed to 0 can
    // sit anywhere, so not merely the count of those kept).
    let positions = Array::from_iter(0..width, &[1, width]);
    let last_kept =
        select(&weights.gt(&zero)?, &positions, Array::from_int(-1))?.max_axis(-1, true)?;
    let position = minimum(&position, &last_kept)?;
    let tokens = match order {
        Some(order) => order.take_along_axis(&position, -1)?,
        None => position,
    };
    Ok(tokens.reshape(&[rows])?.as_dtype(Dtype::Uint32)?)
}

/// Where sampled tokens are drawn (`--sampler`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DrawPlace {
    /// The device, except for top-p without top-k on the CPU: there the device is the host's
    /// own cores, and sorting the whole vocabulary every step costs more than waiting for the
    /// logits and sorting on the host only the head the nucleus needs (BENCHMARKS.md).
    #[default]
    Auto,
    /// Always [`sample_on_device`].
    Device,
    /// Always the host, in float64 ([`SamplingParams::sample`]), after waiting for the
    /// logits: the way of the first versions.
    Host,
}

/// Whether a draw with `params` happens on the host (`params.draw`).
fn draws_on_host(params: &SamplingParams) -> bool {
    match params.draw {
        DrawPlace::Device => false,
        DrawPlace::Host => true,
        DrawPlace::Auto => {
            params.top_p < 1.0
                && params.top_k == 0
                && crate::device::default_is(mlx_rs::DeviceType::Cpu)
        }
    }
}

/// The tokens at emitted indices `first_index ..` of `[T, vocab]` logits (`[T]`, uint32), as
/// every sampled path of the host draws them: [`sample_on_device`], or where `params.draw`
/// says the host, each row's [`SamplingParams::sample`], after waiting for the logits.
pub fn draw_tokens(logits: &Array, params: &SamplingParams, first_index: u64) -> Result<Array> {
    if params.is_greedy() || !draws_on_host(params) {
        return sample_on_device(logits, params, first_index);
    }
    let logits = logits.as_dtype(Dtype::Float32)?;
    logits.eval()?;
    let vocab = logits.shape()[1] as usize;
    let tokens: Vec<u32> = logits
        .as_slice::<f32>()
        .chunks(vocab)
        .zip(first_index..)
        .map(|(row, index)| params.sample(row, index))
        .collect();
    Ok(Array::from_slice(&tokens, &[tokens.len() as i32]))
}

/// `[rows, 1]` float32 uniforms for the indices `first_index ..`, one host scalar each: an
/// array made from more than 8 bytes of host data lives in CUDA managed memory, which the GPU
/// pages in when it first reads it (about 0.2 ms), where 4-byte scalars do not.
fn device_uniforms(seed: u64, first_index: u64, rows: usize) -> Result<Array> {
    let scalars: Vec<Array> = (0..rows as u64)
        .map(|t| {
            let u = uniform(seed, first_index + t, Stream::Token) as f32;
            Array::from_slice(&[u], &[1, 1])
        })
        .collect();
    Ok(match scalars.len() {
        1 => scalars.into_iter().next().unwrap(),
        _ => concatenate(&scalars, 0)?,
    })
}

/// Independent random streams derived from one seed; the verify loop uses a second stream
/// for its accept/reject coin so it never reuses the token draw's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Token = 0,
    Accept = 1,
    Residual = 2,
}

/// A uniform number in [0, 1) that depends only on `(seed, index, stream)`.
pub fn uniform(seed: u64, index: u64, stream: Stream) -> f64 {
    let mut x = seed ^ 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(index.wrapping_add(1));
    x ^= (stream as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    // Three rounds of the SplitMix64 finaliser: a bijective, well-mixed hash.
    for _ in 0..3 {
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
    }
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// Inverse-CDF draw from a normalised `(token, probability)` list.
pub fn draw(dist: &[(u32, f64)], u: f64) -> u32 {
    let mut acc = 0.0;
    for &(token, p) in dist {
        acc += p;
        if u < acc {
            return token;
        }
    }
    dist.last().map(|d| d.0).unwrap_or(0)
}

/// Index of the largest logit (the lowest index among ties, like torch and MLX).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: 7,
            draw: DrawPlace::Auto,
        }
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(params(0.0, 0, 1.0, 0.0).sample(&[0.0, 1.0, 5.0], 3), 2);
    }

    #[test]
    fn temperature_softmax_is_exact() {
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln()];
        let d = params(1.0, 0, 1.0, 0.0).distribution(&logits);
        let probs: Vec<(u32, f64)> = d
            .iter()
            .map(|&(t, p)| (t, (p * 8.0 * 1e6).round() / 1e6))
            .collect();
        assert_eq!(probs, vec![(2, 5.0), (1, 2.0), (0, 1.0)]);
        // Temperature 0.5 squares the odds.
        let d = params(0.5, 0, 1.0, 0.0).distribution(&logits);
        assert!((d[0].1 - 25.0 / 30.0).abs() < 1e-6, "{d:?}");
    }

    #[test]
    fn top_k_top_p_min_p_filter_as_transformers_does() {
        // probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
        let logits: Vec<f32> = [8.0f32, 4.0, 2.0, 1.0, 1.0]
            .iter()
            .map(|p| p.ln())
            .collect();
        let kept = |p: SamplingParams| {
            p.distribution(&logits)
                .iter()
                .map(|d| d.0)
                .collect::<Vec<_>>()
        };
        assert_eq!(kept(params(1.0, 2, 1.0, 0.0)), [0, 1]);
        // top-p 0.7: 0.5 < 0.7, 0.75 >= 0.7 -> two tokens
        assert_eq!(kept(params(1.0, 0, 0.7, 0.0)), [0, 1]);
        assert_eq!(kept(params(1.0, 0, 0.76, 0.0)), [0, 1, 2]);
        // min-p 0.2 drops tokens below 0.1
        assert_eq!(kept(params(1.0, 0, 1.0, 0.2)), [0, 1, 2]);
        // top-k then top-p act on the renormalised survivors: (0.5, 0.25, 0.125)/0.875
        assert_eq!(kept(params(1.0, 3, 0.6, 0.0)), [0, 1]);
    }

    #[test]
    fn sampling_depends_only_on_seed_and_index() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(1.0, 0, 1.0, 0.0);
        let a: Vec<u32> = (0..20).map(|i| p.sample(&logits, i)).collect();
        let b: Vec<u32> = (0..20)
            .rev()
            .map(|i| p.sample(&logits, i))
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        assert_eq!(a, b, "order of calls must not matter");
        let other = SamplingParams { seed: 8, ..p };
        let c: Vec<u32> = (0..20).map(|i| other.sample(&logits, i)).collect();
        assert_ne!(a, c, "a different seed gives a different sequence");
    }

    #[test]
    fn sampled_frequencies_follow_the_distribution() {
        // Chi-square goodness of fit over 20 000 draws, 4 categories (3 dof): the 0.999
        // quantile is 16.27, so a correct sampler fails this about once in a thousand seeds
        // and this fixed seed is deterministic.
        let probs = [0.1f64, 0.2, 0.3, 0.4];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let p = SamplingParams {
            seed: 12345,
            ..params(1.0, 0, 1.0, 0.0)
        };
        let n = 20_000;
        let mut counts = [0usize; 4];
        for i in 0..n {
            counts[p.sample(&logits, i) as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(probs)
            .map(|(&c, p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum();
        assert!(chi2 < 16.27, "chi2 = {chi2}, counts {counts:?}");
    }

    /// Draws `n` tokens on the device from one logits row repeated, at indices 0 .. n.
    fn device_draws(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let vocab = logits.len() as i32;
        let row = Array::from_slice(logits, &[1, vocab]);
        let rows = mlx_rs::ops::broadcast_to(&row, &[n as i32, vocab]).unwrap();
        let tokens = sample_on_device(&rows, p, 0).unwrap();
        tokens.eval().unwrap();
        tokens.as_slice::<u32>().to_vec()
    }

    #[test]
    fn device_draws_follow_the_host_distribution_under_every_filter() {
        // Chi-square of 20 000 device draws against the host's exact distribution, cells of
        // expected count below 5 pooled; the bound is the 0.9999 quantile for the cells' degrees
        // of freedom (Wilson-Hilferty), so a correct sampler fails about once in 10 000 seeds.
        let logits: Vec<f32> = (0..40).map(|i| (i as f32 * 0.61).sin() * 3.0).collect();
        let n = 20_000;
        for p in [
            params(1.0, 0, 1.0, 0.0),
            params(0.7, 0, 1.0, 0.0),
            params(1.0, 5, 1.0, 0.0),
            params(1.0, 0, 0.8, 0.0),
            params(1.0, 0, 1.0, 0.1),
            params(0.8, 12, 0.9, 0.05),
        ] {
            let dist = p.distribution(&logits);
            let draws = device_draws(&p, &logits, n);
            let mut counts = std::collections::HashMap::new();
            for t in draws {
                *counts.entry(t).or_insert(0usize) += 1;
            }
            for t in counts.keys() {
                assert!(
                    dist.iter().any(|d| d.0 == *t),
                    "{p:?}: token {t} is outside the filtered support"
                );
            }
            let (mut stat, mut cells, mut pooled_e, mut pooled_o) = (0.0, 0usize, 0.0, 0.0);
            for &(t, prob) in &dist {
                let (e, o) = (prob * n as f64, *counts.get(&t).unwrap_or(&0) as f64);
                if e < 5.0 {
                    pooled_e += e;
                    pooled_o += o;
                } else {
                    stat += (o - e).powi(2) / e;
                    cells += 1;
                }
            }
            if pooled_e > 0.0 {
                stat += (pooled_o - pooled_e).powi(2) / pooled_e.max(1e-9);
                cells += 1;
            }
            let dof = (cells.max(2) - 1) as f64;
            let z = 3.719; // the standard normal's 0.9999 quantile
            let a = 2.0 / (9.0 * dof);
            let bound = dof * (1.0 - a + z * a.sqrt()).powi(3);
            assert!(
                stat < bound,
                "{p:?}: chi2 {stat:.1} over {dof} dof, bound {bound:.1}"
            );
        }
    }

    #[test]
    fn device_draws_depend_only_on_seed_index_and_row() {
        let logits: Vec<f32> = (0..3 * 30).map(|i| (i as f32 * 0.37).cos() * 2.0).collect();
        let p = params(0.9, 8, 0.95, 0.0);
        let rows = Array::from_slice(&logits, &[3, 30]);
        let together = sample_on_device(&rows, &p, 5).unwrap();
        together.eval().unwrap();
        for t in 0..3 {
            let row = Array::from_slice(&logits[t * 30..(t + 1) * 30], &[1, 30]);
            let alone = sample_on_device(&row, &p, 5 + t as u64).unwrap();
            alone.eval().unwrap();
            assert_eq!(alone.as_slice::<u32>()[0], together.as_slice::<u32>()[t]);
        }
        let greedy = sample_on_device(&rows, &params(0.0, 0, 1.0, 0.0), 0).unwrap();
        greedy.eval().unwrap();
        for t in 0..3 {
            let row = &logits[t * 30..(t + 1) * 30];
            assert_eq!(greedy.as_slice::<u32>()[t], argmax(row));
        }
    }

    #[test]
    fn a_number_that_rounds_to_one_still_draws_a_token_with_weight() {
        // Weights 1, 0, 0, 1, 0 (the zeros underflowed): with u times the total equal to the
        // total every position counts, and the draw must fall back to the last token with
        // weight, in id order (no filter) and sorted (top-p).
        let logits = Array::from_slice(&[0.0f32, -1e4, -1e4, 0.0, -1e4], &[1, 5]);
        let one = Array::from_slice(&[1.0f32], &[1, 1]);
        for p in [params(1.0, 0, 1.0, 0.0), params(1.0, 0, 0.99, 0.0)] {
            let token = draw_rows(&logits, &p, &one).unwrap();
            token.eval().unwrap();
            let token = token.as_slice::<u32>()[0];
            assert!(
                token == 0 || token == 3,
                "{p:?}: drew token {token} of weight 0"
            );
        }
        let zero = Array::from_slice(&[0.0f32], &[1, 1]);
        let first = draw_rows(&logits, &params(1.0, 0, 1.0, 0.0), &zero).unwrap();
        first.eval().unwrap();
        assert_eq!(first.as_slice::<u32>(), [0]);
    }

    #[test]
    fn auto_draws_top_p_alone_on_the_cpu_host_and_the_rest_on_the_device() {
        // Unit tests run on the CPU.
        assert!(draws_on_host(&params(0.8, 0, 0.95, 0.0)));
        assert!(!draws_on_host(&params(0.8, 64, 0.95, 0.0)));
        assert!(!draws_on_host(&params(0.8, 0, 1.0, 0.1)));
        assert!(!draws_on_host(&params(1.0, 0, 1.0, 0.0)));
        let placed = |draw, p: SamplingParams| SamplingParams { draw, ..p };
        assert!(!draws_on_host(&placed(
            DrawPlace::Device,
            params(0.8, 0, 0.95, 0.0)
        )));
        assert!(draws_on_host(&placed(
            DrawPlace::Host,
            params(1.0, 0, 1.0, 0.0)
        )));
        // Drawn on the host, a row is the float64 sampler's own draw at its index.
        let logits: Vec<f32> = (0..30).map(|i| (i as f32 * 0.7).sin()).collect();
        let p = placed(DrawPlace::Host, params(0.9, 0, 1.0, 0.0));
        let drawn = draw_tokens(&Array::from_slice(&logits, &[1, 30]), &p, 4).unwrap();
        assert_eq!(drawn.as_slice::<u32>(), [p.sample(&logits, 4)]);
    }

    #[test]
    fn uniform_is_in_range_and_streams_differ() {
        for i in 0..1000 {
            let u = uniform(3, i, Stream::Token);
            assert!((0.0..1.0).contains(&u));
            assert_ne!(u, uniform(3, i, Stream::Accept));
        }
    }

    #[test]
    fn validation_names_the_bad_setting() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("top-p"));
        let bad = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
    }
}
