//! A measuring instrument, not a drafter for users: drafts replayed from a continuation the
//! target is known to produce (its own plain greedy output), each draft right with a chosen
//! probability (`bench --replay-drafts`).
//!
//! Why: a speculative speedup is the product of two things, how many drafts the target accepts
//! and what a verify window costs against a decode step. Real drafters on real checkpoints
//! give the first; on a machine that has only random weights of a real model's shape (the GPU
//! machine), no drafter accepts anything, so the second could not show. Replayed drafts with a
//! set hit rate give any acceptance on any shape, through the real verify loop (windows,
//! rollback, the draft gate), and the loop's own guarantee still holds: the output must equal
//! the plain output, so the bench checks it.
//!
//! Draft `j` of a round stands for emitted index `step_base + j`. Whether the draft at index
//! `i` is right is a fixed coin of `(seed, i)`, so every round and every repeat of a
//! measurement meets the same drafts; a wrong draft is the right token plus one (mod the
//! vocabulary). Each draft is thus accepted with probability `hit_rate` given that the ones
//! before it were, and a round of `k` drafts emits on average `(1 - p^(k+1)) / (1 - p)`
//! tokens ([`expected_acceptance_length`]).

use mlx_spec_plugin_api::abi::DraftProviderBox;
use mlx_spec_plugin_api::sdk::provider_in_process;
use mlx_spec_plugin_api::{Drafter, DrafterSession, Proposal, SamplingInfo, Target, TargetInfo};

/// Replays `continuation` (the tokens emitted after the prompt) with a hit rate.
#[derive(Debug, Clone)]
pub struct ReplayDrafter {
    continuation: Vec<u32>,
    hit_rate: f64,
    seed: u64,
}

impl ReplayDrafter {
    /// `hit_rate` must lie in [0, 1].
    pub fn new(continuation: Vec<u32>, hit_rate: f64, seed: u64) -> Result<Self, String> {
        if !(0.0..=1.0).contains(&hit_rate) {
            return Err(format!(
                "replayed drafts: the hit rate must lie between 0 and 1, got {hit_rate}"
            ));
        }
        Ok(ReplayDrafter {
            continuation,
            hit_rate,
            seed,
        })
    }

    /// This drafter behind the plugin ABI, as the verify loop takes every drafter.
    pub fn into_provider(self) -> DraftProviderBox {
        provider_in_process(self)
    }
}

/// Mean tokens a round emits with `k` drafts each right with probability `p` (given that the
/// ones before it were): `1 + p + p² + … + p^k`.
pub fn expected_acceptance_length(p: f64, k: usize) -> f64 {
    (0..=k).map(|j| p.powi(j as i32)).sum()
}

/// A uniform number in [0, 1) that depends only on `(seed, index)` (SplitMix64): whether the
/// replayed draft at emitted index `index` is right (below the hit rate). Public so that a
/// test can simulate the drafter's counters.
pub fn coin(seed: u64, index: u64) -> f64 {
    let mut z = seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

impl Drafter for ReplayDrafter {
    type Session = ReplaySession;

    fn from_config(_config: &serde_json::Value) -> Result<Self, String> {
        Err("replayed drafts are built by the bench, not from a manifest".into())
    }

    fn open(&self, target: &TargetInfo, _sampling: &SamplingInfo) -> Result<ReplaySession, String> {
        Ok(ReplaySession {
            drafter: self.clone(),
            vocab: target.vocab_size.max(1),
        })
    }
}

/// One request's replay (the drafter's settings and the target's vocabulary).
pub struct ReplaySession {
    drafter: ReplayDrafter,
    vocab: u32,
}

impl DrafterSession for ReplaySession {
    fn draft(
        &mut self,
        _history: &[u32],
        n: usize,
        step_base: u64,
        _target: &Target<'_>,
    ) -> Result<Proposal, String> {
        let d = &self.drafter;
        let tokens = (step_base..)
            .take(n)
            .map_while(|i| {
                let right = *d.continuation.get(i as usize)?;
                Some(if coin(d.seed, i) < d.hit_rate {
                    right
                } else {
                    (right + 1) % self.vocab
                })
            })
            .collect();
        Ok(Proposal::tokens(tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_hit_rates_outside_zero_to_one() {
        for bad in [-0.1, 1.5, f64::NAN] {
            let e = ReplayDrafter::new(vec![1], bad, 0).unwrap_err();
            assert!(e.contains("hit rate"), "{e}");
        }
        assert!(ReplayDrafter::new(vec![1], 0.0, 0).is_ok());
        assert!(ReplayDrafter::new(vec![1], 1.0, 0).is_ok());
    }

    #[test]
    fn coins_are_uniform_and_fixed_by_seed_and_index() {
        let n = 20_000;
        let below = (0..n).filter(|&i| coin(7, i) < 0.3).count() as f64 / n as f64;
        assert!((below - 0.3).abs() < 0.02, "{below}");
        assert_eq!(coin(7, 123), coin(7, 123));
        assert_ne!(coin(7, 123), coin(8, 123));
    }

    #[test]
    fn expected_length_sums_the_geometric_series() {
        assert_eq!(expected_acceptance_length(1.0, 7), 8.0);
        assert_eq!(expected_acceptance_length(0.0, 7), 1.0);
        assert!((expected_acceptance_length(0.5, 2) - 1.75).abs() < 1e-12);
    }
}
