//! The `ngram` drafter: prompt-lookup decoding.
//!
//! To propose the next tokens it looks for an earlier occurrence of the history's last `k`
//! tokens — longest `k` first (from `max_ngram` down to `min_ngram`), leftmost occurrence
//! first — and proposes what followed it. Nothing matches: no proposal, and the host takes an
//! ordinary decode step. No weights and no access to the target: it shines where the output
//! repeats its input (code edits, quoting, extraction).

use mlx_spec_plugin_api::{
    declare_drafter_plugin, Drafter, DrafterSession, Proposal, SamplingInfo, Target, TargetInfo,
};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct NgramConfig {
    #[serde(default = "default_max")]
    max_ngram: usize,
    #[serde(default = "default_min")]
    min_ngram: usize,
}

fn default_max() -> usize {
    3
}

/// A one-token match proposes whatever followed the last occurrence of a common token; its
/// drafts are rejected often enough that the gate pauses the drafter on free text. Two tokens
/// of context measured faster on both prompt sets (BENCHMARKS.md, ngram's minimum match).
fn default_min() -> usize {
    2
}

/// The loaded drafter (just its settings).
pub struct NgramDrafter {
    max_ngram: usize,
    min_ngram: usize,
}

impl NgramDrafter {
    pub fn new(max_ngram: usize, min_ngram: usize) -> Result<Self, String> {
        if max_ngram == 0 || min_ngram == 0 || min_ngram > max_ngram {
            return Err(format!(
                "ngram: need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}"
            ));
        }
        Ok(NgramDrafter {
            max_ngram,
            min_ngram,
        })
    }
}

impl Drafter for NgramDrafter {
    type Session = NgramSession;

    fn from_config(config: &serde_json::Value) -> Result<Self, String> {
        let c: NgramConfig = mlx_spec_plugin_api::parse_settings(config, "ngram")?;
        NgramDrafter::new(c.max_ngram, c.min_ngram)
    }

    fn open(&self, _target: &TargetInfo, _sampling: &SamplingInfo) -> Result<NgramSession, String> {
        Ok(NgramSession {
            max_ngram: self.max_ngram,
            min_ngram: self.min_ngram,
        })
    }
}

/// Per-request state: none beyond the settings, since the host hands over the history.
pub struct NgramSession {
    max_ngram: usize,
    min_ngram: usize,
}

/// The continuation (up to `n` tokens) of the longest, leftmost earlier match of the last
/// `k in max..=min` tokens of `history`.
pub fn propose(history: &[u32], n: usize, max_ngram: usize, min_ngram: usize) -> Vec<u32> {
    let len = history.len();
    if n == 0 || len < 2 {
        return Vec::new();
    }
    for k in (min_ngram..=max_ngram.min(len - 1)).rev() {
        let tail = &history[len - k..];
        // `i + k < len` skips the tail matching itself and leaves at least one token after.
        if let Some(i) = (0..len - k).find(|&i| &history[i..i + k] == tail) {
            let start = i + k;
            return history[start..(start + n).min(len)].to_vec();
        }
    }
    Vec::new()
}

impl DrafterSession for NgramSession {
    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        _step_base: u64,
        _target: &Target<'_>,
    ) -> Result<Proposal, String> {
        Ok(Proposal::tokens(propose(
            history,
            n,
            self.max_ngram,
            self.min_ngram,
        )))
    }
}

declare_drafter_plugin!("ngram", NgramDrafter);

#[cfg(test)]
mod tests {
    use super::propose;

    #[test]
    fn longest_match_first_then_leftmost() {
        // tail [1,2,3] occurs at 0; [2,3] alone also at 4, but the 3-gram wins.
        let h = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3];
        assert_eq!(propose(&h, 2, 3, 1), vec![9, 2]);
        // With max 2: the leftmost [2,3] is at 1 -> continuation 9, 2, 3.
        assert_eq!(propose(&h, 3, 2, 1), vec![9, 2, 3]);
    }

    #[test]
    fn continuation_may_be_shorter_than_asked_and_self_match_is_excluded() {
        assert_eq!(propose(&[5, 6, 5], 4, 3, 1), vec![6, 5]);
        assert_eq!(propose(&[1, 2, 3, 4], 4, 3, 1), Vec::<u32>::new());
        assert_eq!(propose(&[7], 4, 3, 1), Vec::<u32>::new());
    }

    #[test]
    fn min_ngram_limits_short_matches() {
        let h = [4, 1, 8, 8, 2, 1];
        assert_eq!(propose(&h, 2, 3, 1), vec![8, 8]);
        assert_eq!(propose(&h, 2, 3, 2), Vec::<u32>::new());
    }
}
