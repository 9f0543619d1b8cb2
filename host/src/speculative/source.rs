//! A request's drafter session as the verify loop drives it: opening it against the target,
//! the tap points it reads, and every call into it, each checked. Any fault (an error, a
//! caught panic, a malformed proposal) comes back as an error, and the loop then drops the
//! session and finishes the request plainly.

use std::ops::Range;

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::sabi_types::RRef;
use abi_stable::std_types::{RErr, ROk, RResult, RSlice, RString, RVec};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use mlx_spec_plugin_api::abi::{
    DraftProviderBox, DraftSourceBox, SamplingInfo, TapRows, TargetPort_TO,
};
use mlx_spec_plugin_api::tensor::Tensor;

use super::target_port::{target_info, HostTarget};

pub(crate) fn ffi<T>(r: RResult<T, RString>) -> Result<T, String> {
    match r {
        ROk(v) => Ok(v),
        RErr(e) => Err(e.into_string()),
    }
}

fn port<'a>(target: &'a HostTarget<'a>) -> TargetPort_TO<'a, RRef<'a, ()>> {
    TargetPort_TO::from_ptr(target, TD_Opaque)
}

/// A drafted round's proposal, validated.
pub(crate) struct Proposal {
    pub tokens: Vec<u32>,
    /// `[tokens.len(), vocab]` float32 draft distributions, as host vectors (read only when
    /// the request samples: greedy verification never looks at them).
    pub probs: Option<Vec<f32>>,
}

impl Proposal {
    pub fn none() -> Self {
        Proposal {
            tokens: Vec::new(),
            probs: None,
        }
    }
}

/// How far a row of `q` may sum from 1: float32 sums over a large vocabulary drift by a few
/// units in the sixth decimal, while an unnormalised distribution is off by far more.
const Q_SUM_TOLERANCE: f64 = 1e-3;

/// The live drafter session of a request.
pub(crate) struct ActiveSource {
    source: DraftSourceBox,
    /// The tap points it reads (empty: none, and no forward keeps hidden states for it).
    taps: Vec<i32>,
}

impl ActiveSource {
    /// Opens a session against the target (the drafter may read the target's description
    /// and refuse the pairing), then asks which tap points it reads.
    pub fn open(
        provider: &DraftProviderBox,
        target: &HostTarget,
        sampling: SamplingInfo,
    ) -> Result<Self, String> {
        let source = ffi(provider.open(target_info(target.model), port(target), sampling))?;
        let taps = source.tap_layers().into_vec();
        let last = target.model.config.num_layers as i32;
        if let Some(bad) = taps.iter().find(|&&p| p < -1 || p > last) {
            return Err(format!(
                "the drafter asked for tap point {bad}; this target has -1 (embeddings), 0..{} (layer outputs) and {last} (final norm)",
                last - 1
            ));
        }
        Ok(ActiveSource { source, taps })
    }

    /// The tap points every forward of the request keeps for the drafter.
    pub fn taps(&self) -> &[i32] {
        &self.taps
    }

    /// Hands the drafter `rows` of the hidden states a forward kept for it (`hidden[j]` is
    /// `[T, hidden]` for the `j`-th tap point), row 0 of `rows` at `first_position`. Nothing
    /// happens for a drafter without taps.
    pub fn deliver(
        &mut self,
        hidden: &[Array],
        rows: Range<usize>,
        first_position: u64,
    ) -> Result<(), String> {
        if self.taps.is_empty() || rows.is_empty() {
            return Ok(());
        }
        if hidden.len() != self.taps.len() {
            return Err(format!(
                "the forward kept {} tapped states for {} tap points",
                hidden.len(),
                self.taps.len()
            ));
        }
        let (from, to) = (rows.start as i32, rows.end as i32);
        let layers: RVec<Tensor> = hidden
            .iter()
            .map(|h| {
                let whole = h.shape()[0] as usize == rows.end && rows.start == 0;
                Tensor::from_array(if whole {
                    h.clone()
                } else {
                    h.index((from..to, ..))
                })
            })
            .collect();
        ffi(self.source.receive_taps(TapRows {
            first_position,
            layers,
        }))
    }

    /// The drafter's prefill call (after the prompt's taps were delivered).
    pub fn prefill(&mut self, prompt: &[u32], target: &HostTarget) -> Result<(), String> {
        ffi(self
            .source
            .prefill(RSlice::from_slice(prompt), port(target)))
    }

    /// Asks for up to `n` drafts after `history`, and checks the proposal: its length, its
    /// ids, and (when `read_probs`, a sampled request) its distributions.
    pub fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        step_base: u64,
        target: &HostTarget,
        read_probs: bool,
    ) -> Result<Proposal, String> {
        let vocab = target.model.config.vocab_size;
        let d = ffi(self.source.draft(
            RSlice::from_slice(history),
            n as u32,
            step_base,
            port(target),
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
            Some(q) if read_probs => Some(checked_probs(q.into_array(), tokens.len(), vocab)?),
            // Greedy verification compares tokens only: q is dropped unread.
            _ => None,
        };
        Ok(Proposal { tokens, probs })
    }

    /// Tells the drafter how a round ended.
    pub fn commit(
        &mut self,
        drafted: usize,
        accepted: usize,
        emitted: &[u32],
    ) -> Result<(), String> {
        ffi(self
            .source
            .commit(drafted as u32, accepted as u32, RSlice::from_slice(emitted)))
    }
}

/// A drafter's `q` as host rows, refused unless it is `[drafts, vocab]` of finite,
/// non-negative rows that each sum to 1: rejection sampling with an unnormalised `q` would
/// bias the output without any error showing.
fn checked_probs(q: Array, drafts: usize, vocab: usize) -> Result<Vec<f32>, String> {
    if q.shape() != [drafts as i32, vocab as i32] {
        return Err(format!(
            "draft probabilities have shape {:?}, expected [{drafts}, {vocab}]",
            q.shape()
        ));
    }
    let q = q.as_dtype(Dtype::Float32).map_err(|e| e.to_string())?;
    q.eval().map_err(|e| e.to_string())?;
    let values = q.as_slice::<f32>().to_vec();
    if values.iter().any(|v| !v.is_finite() || *v < 0.0) {
        return Err("draft probabilities contain negative or non-finite values".to_owned());
    }
    for (i, row) in values.chunks(vocab.max(1)).enumerate() {
        let sum: f64 = row.iter().map(|&v| v as f64).sum();
        if (sum - 1.0).abs() > Q_SUM_TOLERANCE {
            return Err(format!(
                "draft probabilities of draft {i} sum to {sum}, not 1: return normalised distributions"
            ));
        }
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::checked_probs;
    use mlx_rs::Array;

    #[test]
    fn q_must_be_normalised_finite_and_of_the_proposal_shape() {
        let good = Array::from_slice(&[0.25f32, 0.75, 0.5, 0.5], &[2, 2]);
        assert_eq!(
            checked_probs(good, 2, 2).unwrap(),
            vec![0.25, 0.75, 0.5, 0.5]
        );
        let unnormalised = Array::from_slice(&[0.25f32, 0.75, 0.5, 0.7], &[2, 2]);
        let err = checked_probs(unnormalised, 2, 2).unwrap_err();
        assert!(err.contains("draft 1") && err.contains("sum"), "{err}");
        let negative = Array::from_slice(&[1.5f32, -0.5], &[1, 2]);
        assert!(checked_probs(negative, 1, 2)
            .unwrap_err()
            .contains("negative"));
        let wrong_shape = Array::from_slice(&[0.5f32, 0.5], &[1, 2]);
        assert!(checked_probs(wrong_shape, 2, 2)
            .unwrap_err()
            .contains("shape"));
    }
}
