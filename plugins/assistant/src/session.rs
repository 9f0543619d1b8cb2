//! The plugin side: the loaded drafter, the pairing check against the target, and the
//! per-request session.
//!
//! What a session reads from the host, and when:
//! * at `open_for`: `target.spec()` — refused unless the checkpoint's backbone hidden size,
//!   vocabulary, kv heads, head dims, RoPE and sliding window equal the target's donor layers;
//! * `tap_layers()`: one tap, the target's final-norm hidden state;
//! * `receive_taps` (the prompt before `prefill`, each round's verified positions before
//!   `commit`): keeps only the last row and its position — the anchor hidden of the next round;
//! * `draft(history, n, ..)`: the anchor token is `history.last()` at index
//!   P = `target.position()`; the kept hidden must be position P − 1. It borrows the donor K/V
//!   of `spec.donor_layers` for the call (`target.donor_kv`), keeps the entries the query may
//!   see (full layers: every position before P; sliding layers: the last `window+1` positions
//!   before P, or `window`), rotates the query to P (or P − 1), and chains `n` greedy steps,
//!   embedding each drafted token with `target.embed`. One host read per step (the token).
//!
//! Drafts are greedy and come without probabilities: the host verifies them by token match,
//! which keeps the output exact at any temperature. With `sample_drafts = true` and a
//! temperature above 0, each draft is drawn from `softmax(logits / T)` (keyed by the request's
//! seed and the draft's emitted index) and the distributions go with the proposal, for the
//! host's rejection sampling.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use mlx_spec_plugin_api::mlx_rs::ops::indexing::IndexOp;
use mlx_spec_plugin_api::mlx_rs::Array;
use mlx_spec_plugin_api::target_spec::{AttentionSpec, RopeSpec};
use mlx_spec_plugin_api::{
    Drafter, DrafterSession, Proposal, SamplingInfo, Taps, Target, TargetInfo, TargetSpec,
};

use crate::attention::DonorView;
use crate::config::{AssistantConfig, Kind, RopeKind};
use crate::linear::mlx_err;
use crate::model::{AssistantModel, Choice, Round};
use crate::rope::QueryAngles;
use crate::settings::{confidence_floor, ComputeDtype, QueryPosition, Settings, SlidingKeys};

/// The loaded drafter. MLX arrays may move between threads but not be shared, so sessions
/// reach the weights through a lock (held for one `draft` call).
pub struct AssistantDrafter {
    model: Arc<Mutex<AssistantModel>>,
    settings: Settings,
    bytes: u64,
    /// Greedy rounds end at the first draft the drafter gives less than this (0: never).
    min_draft_probability: f32,
}

impl AssistantDrafter {
    pub fn new(settings: Settings) -> Result<Self, String> {
        let model = AssistantModel::load(&settings.checkpoint, settings.dtype.fixed())?;
        let bytes = model.nbytes() as u64;
        let min_draft_probability = match settings.min_draft_probability {
            Some(p) => p,
            None => confidence_floor(&settings.checkpoint)?,
        };
        Ok(AssistantDrafter {
            model: Arc::new(Mutex::new(model)),
            settings,
            bytes,
            min_draft_probability,
        })
    }
}

impl Drafter for AssistantDrafter {
    type Session = AssistantSession;

    fn from_config_in(
        config: &serde_json::Value,
        plugin_dir: &std::path::Path,
    ) -> Result<Self, String> {
        AssistantDrafter::new(Settings::parse(config, plugin_dir)?)
    }

    fn weights_bytes(&self) -> u64 {
        self.bytes
    }

    fn open(
        &self,
        _info: &TargetInfo,
        _sampling: &SamplingInfo,
    ) -> Result<AssistantSession, String> {
        Err("the assistant drafter needs a host that describes its target and lends its K/V (plugin interface revision 2)".to_owned())
    }

    fn open_for(
        &self,
        _info: &TargetInfo,
        target: &Target<'_>,
        sampling: &SamplingInfo,
    ) -> Result<AssistantSession, String> {
        let spec = target.spec()?;
        let mut model = self
            .model
            .lock()
            .map_err(|_| "the assistant drafter's weights are poisoned by an earlier panic")?;
        let donors = check_pairing(&model.config, &spec)?;
        if self.settings.dtype == ComputeDtype::Target {
            let wanted = spec.activation_dtype()?;
            if model.dtype != wanted {
                // Loaded before the target was known: load again in the target's dtype.
                *model = AssistantModel::load(&self.settings.checkpoint, Some(wanted))?;
            }
        }
        Ok(AssistantSession {
            model: Arc::clone(&self.model),
            position: self.settings.position,
            sliding_keys: self.settings.sliding_keys,
            window: model.config.sliding_window,
            donors,
            final_tap: spec.final_hidden_tap(),
            anchor: None,
            sampling: (self.settings.sample_drafts && sampling.temperature > 0.0)
                .then_some((sampling.temperature, sampling.seed)),
            min_draft_probability: self.min_draft_probability,
        })
    }
}

/// The target layers whose K/V each drafter kind reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DonorLayers {
    pub sliding: Option<usize>,
    pub full: Option<usize>,
}

/// Refuses a target the checkpoint was not made for; names both values of what differs.
pub fn check_pairing(cfg: &AssistantConfig, spec: &TargetSpec) -> Result<DonorLayers, String> {
    let refuse = |what: &str, ours: String, theirs: String| {
        Err(format!(
            "the assistant checkpoint does not fit this target: its {what} is {ours}, the target's is {theirs}"
        ))
    };
    if cfg.backbone_hidden_size != spec.hidden_size {
        return refuse(
            "backbone_hidden_size",
            cfg.backbone_hidden_size.to_string(),
            format!("hidden size {}", spec.hidden_size),
        );
    }
    if cfg.vocab_size != spec.vocab_size {
        return refuse(
            "vocabulary size",
            cfg.vocab_size.to_string(),
            spec.vocab_size.to_string(),
        );
    }
    let mut layers = DonorLayers {
        sliding: None,
        full: None,
    };
    for kind in [Kind::Sliding, Kind::Full] {
        if !cfg.uses(kind) {
            continue;
        }
        let (donor, theirs): (Option<usize>, &AttentionSpec) = match kind {
            Kind::Sliding => (spec.donor_layers.sliding, &spec.sliding),
            Kind::Full => (spec.donor_layers.full, &spec.full),
        };
        let Some(donor) = donor else {
            return Err(format!(
                "the assistant checkpoint has {} layers but the target has no KV-owning layer of that kind to read",
                kind.name()
            ));
        };
        let name = kind.name();
        if cfg.kv_heads(kind) != theirs.num_kv_heads {
            return refuse(
                &format!("{name} kv head count"),
                cfg.kv_heads(kind).to_string(),
                format!("{} (layer {donor})", theirs.num_kv_heads),
            );
        }
        if cfg.head_dim(kind) != theirs.head_dim {
            return refuse(
                &format!("{name} head dim"),
                cfg.head_dim(kind).to_string(),
                format!("{} (layer {donor})", theirs.head_dim),
            );
        }
        if !same_rope(cfg.rope(kind), &theirs.rope) {
            return refuse(
                &format!("{name} RoPE"),
                format!("{:?}", cfg.rope(kind)),
                format!("{:?}", theirs.rope),
            );
        }
        match kind {
            Kind::Sliding => layers.sliding = Some(donor),
            Kind::Full => layers.full = Some(donor),
        }
    }
    if cfg.uses(Kind::Sliding) && cfg.sliding_window != spec.sliding_window {
        return refuse(
            "sliding_window",
            cfg.sliding_window.to_string(),
            spec.sliding_window.to_string(),
        );
    }
    Ok(layers)
}

fn same_rope(ours: RopeKind, theirs: &RopeSpec) -> bool {
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0);
    match (ours, theirs) {
        (RopeKind::Default { theta: a }, RopeSpec::Default { theta: b }) => close(a, *b),
        (
            RopeKind::Proportional {
                theta,
                partial_factor,
                factor,
            },
            RopeSpec::Proportional {
                theta: t,
                partial_rotary_factor: p,
                factor: f,
            },
        ) => close(theta, *t) && close(partial_factor, *p) && close(factor, *f),
        _ => false,
    }
}

/// The donor entries (indices into a donor whose entry 0 holds `first_position`, `len`
/// entries) a query of the round at P may see: full layers every position before P, sliding
/// layers the last `window + 1` (or `window`) positions before P. `None`: nothing to see.
pub fn visible_entries(
    kind: Kind,
    p: u64,
    window: usize,
    sliding_keys: SlidingKeys,
    first_position: u64,
    len: usize,
) -> Option<Range<usize>> {
    let from = match kind {
        Kind::Full => 0,
        Kind::Sliding => {
            let keys = match sliding_keys {
                SlidingKeys::WindowPlusOne => window as u64 + 1,
                SlidingKeys::Window => window as u64,
            };
            p.saturating_sub(keys)
        }
    };
    let start = from.max(first_position);
    let end = p.min(first_position + len as u64);
    (start < end).then(|| (start - first_position) as usize..(end - first_position) as usize)
}

/// Per-request state: the anchor hidden (the last tapped row) and the pairing.
pub struct AssistantSession {
    model: Arc<Mutex<AssistantModel>>,
    position: QueryPosition,
    sliding_keys: SlidingKeys,
    window: usize,
    donors: DonorLayers,
    final_tap: i32,
    /// Absolute position and final-norm hidden state `[1, H_b]` of the last verified position.
    anchor: Option<(u64, Array)>,
    /// `sample_drafts` at a temperature above 0: the temperature and the request's seed.
    sampling: Option<(f32, u64)>,
    /// Greedy rounds end at the first draft the drafter gives less than this (0: never).
    min_draft_probability: f32,
}

impl AssistantSession {
    /// Borrows the donor of `kind` and keeps the entries visible from P.
    fn donor_view(
        &self,
        model: &AssistantModel,
        target: &Target<'_>,
        kind: Kind,
        p: u64,
    ) -> Result<Option<DonorView>, String> {
        let layer = match kind {
            Kind::Sliding => self.donors.sliding,
            Kind::Full => self.donors.full,
        };
        let Some(layer) = layer else {
            return Ok(None);
        };
        let kv = target.donor_kv(layer)?;
        let cfg = &model.config;
        let want = [
            1,
            cfg.kv_heads(kind) as i32,
            kv.len() as i32,
            cfg.head_dim(kind) as i32,
        ];
        if kv.keys.shape() != want || kv.values.shape() != want {
            return Err(format!(
                "donor K/V of target layer {layer} have shapes {:?} / {:?}, expected {want:?}",
                kv.keys.shape(),
                kv.values.shape()
            ));
        }
        let Some(range) = visible_entries(
            kind,
            p,
            self.window,
            self.sliding_keys,
            kv.first_position,
            kv.len(),
        ) else {
            return Ok(None);
        };
        let (a, b) = (range.start as i32, range.end as i32);
        Ok(Some(DonorView {
            keys: model.cast(&kv.keys.index((.., .., a..b, ..)))?,
            values: model.cast(&kv.values.index((.., .., a..b, ..)))?,
            mask: None,
        }))
    }
}

impl DrafterSession for AssistantSession {
    fn tap_layers(&self) -> Vec<i32> {
        vec![self.final_tap]
    }

    fn receive_taps(&mut self, taps: Taps) -> Result<(), String> {
        let rows = taps.rows();
        let Some(hidden) = taps.layers.first() else {
            return Err("the host delivered no tap rows".to_owned());
        };
        if rows == 0 {
            return Ok(());
        }
        // Only the last row matters: it is the anchor hidden of the next round.
        let last = hidden
            .index((rows as i32 - 1)..(rows as i32))
            .reshape(&[1, -1])
            .map_err(mlx_err("keeping the last tapped row"))?;
        self.anchor = Some((taps.first_position + rows as u64 - 1, last));
        Ok(())
    }

    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        step_base: u64,
        target: &Target<'_>,
    ) -> Result<Proposal, String> {
        let Some(&anchor_token) = history.last() else {
            return Ok(Proposal::tokens(Vec::new()));
        };
        let p = target.position();
        if n == 0 {
            return Ok(Proposal::tokens(Vec::new()));
        }
        if history.len() as u64 != p + 1 {
            return Err(format!(
                "the history holds {} tokens but the target has processed {p}: the anchor token should be the only one it has not",
                history.len()
            ));
        }
        let Some((hidden_position, hidden)) = &self.anchor else {
            return Err(
                "no hidden state received: the host delivers the prompt's taps before prefill"
                    .to_owned(),
            );
        };
        if hidden_position + 1 != p {
            return Err(format!(
                "the last hidden state received is of position {hidden_position}, but the anchor token at {p} needs position {}",
                p.saturating_sub(1)
            ));
        }
        let query_position = match self.position {
            QueryPosition::Anchor => p,
            QueryPosition::Previous => p - 1,
        };
        let model = self
            .model
            .lock()
            .map_err(|_| "the assistant drafter's weights are poisoned by an earlier panic")?;
        let mut round = Round {
            sliding: None,
            full: None,
        };
        for kind in [Kind::Sliding, Kind::Full] {
            if !model.config.uses(kind) {
                continue;
            }
            let Some(view) = self.donor_view(&model, target, kind, p)? else {
                // Nothing the query may attend to (no K/V kept yet): no proposal this round.
                return Ok(Proposal::tokens(Vec::new()));
            };
            let cfg = &model.config;
            let angles = QueryAngles::new(
                cfg.rope(kind),
                cfg.head_dim(kind),
                query_position,
                model.dtype,
            )?;
            match kind {
                Kind::Sliding => round.sliding = Some((view, angles)),
                Kind::Full => round.full = Some((view, angles)),
            }
        }
        let vocab = model.config.vocab_size as u32;
        let choice = match self.sampling {
            None if self.min_draft_probability > 0.0 => Choice::GreedyWhileConfident {
                min_probability: self.min_draft_probability,
            },
            None => Choice::Greedy,
            Some((temperature, seed)) => Choice::Sampled {
                temperature,
                seed,
                first_index: step_base,
            },
        };
        let drafts = model.chain(
            (anchor_token, hidden),
            &round,
            n,
            choice,
            |token| target.embed(&[token]),
            |_| {},
        )?;
        if let Some(bad) = drafts.tokens.iter().find(|&&t| t >= vocab) {
            return Err(format!(
                "drafted token {bad} is outside the vocabulary of {vocab}"
            ));
        }
        Ok(Proposal {
            tokens: drafts.tokens,
            probs: drafts.probs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_entries_follow_positions_not_lengths() {
        use Kind::*;
        use SlidingKeys::*;
        // Prompt of 12 after prefill, window 4: sliding sees 7..12, full sees all.
        assert_eq!(
            visible_entries(Sliding, 12, 4, WindowPlusOne, 0, 12),
            Some(7..12)
        );
        assert_eq!(visible_entries(Sliding, 12, 4, Window, 0, 12), Some(8..12));
        assert_eq!(
            visible_entries(Full, 12, 4, WindowPlusOne, 0, 12),
            Some(0..12)
        );
        // A ring that kept positions 20..30 (entry 0 = position 20), P = 30.
        assert_eq!(
            visible_entries(Sliding, 30, 4, WindowPlusOne, 20, 10),
            Some(5..10)
        );
        // A ring of W entries cannot give W + 1: what it has is used.
        assert_eq!(
            visible_entries(Sliding, 30, 4, WindowPlusOne, 26, 4),
            Some(0..4)
        );
        // Entries at or after P (never lent, but never attended either).
        assert_eq!(visible_entries(Full, 5, 4, WindowPlusOne, 0, 8), Some(0..5));
        // Short prompt: fewer than W + 1 positions exist.
        assert_eq!(
            visible_entries(Sliding, 2, 4, WindowPlusOne, 0, 2),
            Some(0..2)
        );
        assert_eq!(visible_entries(Full, 0, 4, WindowPlusOne, 0, 0), None);
    }
}
