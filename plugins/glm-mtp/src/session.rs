//! The plugin side: the loaded row, the pairing check against the target, the per-request
//! session.
//!
//! What a session reads from the host, and when:
//! * at `open_for`: `target.spec()` — refused unless the row's declared target (model type,
//!   layer count, hidden size, vocabulary) is this target;
//! * `tap_layers()`: one tap, the target's final-norm hidden state;
//! * `receive_taps`: every verified position's hidden state, kept until its row is built;
//! * `draft`: `target.embed` for the tokens of the rows it builds, `target.logits_from_hidden`
//!   once per draft step. One host read per step (the token).

use std::sync::{Arc, Mutex};

use mlx_spec_plugin_api::mlx_rs::Array;
use mlx_spec_plugin_api::{
    Drafter, DrafterSession, Proposal, SamplingInfo, Taps, Target, TargetInfo, TargetSpec,
};

use crate::config::MtpConfig;
use crate::rounds::{Choice, Rounds, TargetPorts};
use crate::row::MtpRow;
use crate::settings::{ComputeDtype, Settings};

/// The loaded drafter. MLX arrays may move between threads but not be shared, so sessions
/// reach the weights through a lock (held for one `draft` call).
pub struct MtpDrafter {
    row: Arc<Mutex<MtpRow>>,
    settings: Settings,
    bytes: u64,
}

impl MtpDrafter {
    pub fn new(settings: Settings) -> Result<Self, String> {
        let fixed = match settings.dtype {
            ComputeDtype::Fixed(d) => Some(d),
            ComputeDtype::Target | ComputeDtype::Checkpoint => None,
        };
        let row = MtpRow::load(&settings.checkpoint, fixed)?;
        let bytes = row.nbytes() as u64;
        Ok(MtpDrafter {
            row: Arc::new(Mutex::new(row)),
            settings,
            bytes,
        })
    }
}

impl Drafter for MtpDrafter {
    type Session = MtpSession;

    fn from_config_in(
        config: &serde_json::Value,
        plugin_dir: &std::path::Path,
    ) -> Result<Self, String> {
        MtpDrafter::new(Settings::parse(config, plugin_dir)?)
    }

    fn weights_bytes(&self) -> u64 {
        self.bytes
    }

    fn open(&self, _info: &TargetInfo, _sampling: &SamplingInfo) -> Result<MtpSession, String> {
        Err("the glm-mtp drafter needs a host that describes its target and delivers hidden states (plugin interface revision 2)".to_owned())
    }

    fn open_for(
        &self,
        _info: &TargetInfo,
        target: &Target<'_>,
        sampling: &SamplingInfo,
    ) -> Result<MtpSession, String> {
        let spec = target.spec()?;
        let mut row = self
            .row
            .lock()
            .map_err(|_| "the glm-mtp drafter's weights are poisoned by an earlier panic")?;
        check_pairing(&row.config, &spec)?;
        if self.settings.dtype == ComputeDtype::Target {
            let wanted = spec.activation_dtype()?;
            if row.dtype != wanted {
                // Loaded before the target was known: load again in the target's dtype.
                *row = MtpRow::load(&self.settings.checkpoint, Some(wanted))?;
            }
        }
        let config = &row.config;
        let choice = if self.settings.sample_drafts && sampling.temperature > 0.0 {
            Some((sampling.temperature, sampling.seed))
        } else {
            None
        };
        Ok(MtpSession {
            row: Arc::clone(&self.row),
            rounds: Rounds::new(
                self.settings.kv_prefill.unwrap_or(config.kv_prefill),
                self.settings.chain_hidden.unwrap_or(config.chain_hidden),
            ),
            final_tap: spec.final_hidden_tap(),
            sampling: choice,
            min_draft_probability: self.settings.min_draft_probability,
            vocab: spec.vocab_size as u32,
        })
    }
}

/// Refuses a target the row was not trained for; names both values of what differs.
pub fn check_pairing(config: &MtpConfig, spec: &TargetSpec) -> Result<(), String> {
    let ours = &config.pairing;
    let theirs_type = spec
        .config
        .get("model_type")
        .and_then(|t| t.as_str())
        .unwrap_or(&spec.family);
    let family_of = |t: &str| t.split('_').next().unwrap_or(t).to_owned();
    let checks = [
        (
            "model type",
            family_of(&ours.model_type),
            family_of(theirs_type),
        ),
        (
            "layer count",
            ours.num_hidden_layers.to_string(),
            spec.num_layers.to_string(),
        ),
        (
            "hidden size",
            ours.hidden_size.to_string(),
            spec.hidden_size.to_string(),
        ),
        (
            "vocabulary size",
            ours.vocab_size.to_string(),
            spec.vocab_size.to_string(),
        ),
    ];
    for (what, mine, target) in checks {
        if mine != target {
            return Err(format!(
                "the MTP row was trained for a target whose {what} is {mine}; this target's is {target}"
            ));
        }
    }
    if config.vocab_size != spec.vocab_size {
        return Err(format!(
            "the MTP row's vocab_size is {}; this target's is {}",
            config.vocab_size, spec.vocab_size
        ));
    }
    Ok(())
}

/// The host's ports, as a round reads them.
struct Ports<'a, 'b>(&'a Target<'b>);

impl TargetPorts for Ports<'_, '_> {
    fn embed(&self, ids: &[u32]) -> Result<Array, String> {
        self.0.embed(ids)
    }

    fn logits(&self, head_in: &Array) -> Result<Array, String> {
        self.0.logits_from_hidden(head_in)
    }
}

/// Per-request state: the row's cache and the hidden states waiting for their rows.
pub struct MtpSession {
    row: Arc<Mutex<MtpRow>>,
    rounds: Rounds,
    final_tap: i32,
    /// `sample_drafts` at a temperature above 0: the temperature and the request's seed.
    sampling: Option<(f32, u64)>,
    min_draft_probability: f32,
    vocab: u32,
}

impl DrafterSession for MtpSession {
    fn tap_layers(&self) -> Vec<i32> {
        vec![self.final_tap]
    }

    fn receive_taps(&mut self, taps: Taps) -> Result<(), String> {
        let Some(hidden) = taps.layers.into_iter().next() else {
            return Err("the host delivered no tap rows".to_owned());
        };
        self.rounds.receive(taps.first_position, hidden)
    }

    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        step_base: u64,
        target: &Target<'_>,
    ) -> Result<Proposal, String> {
        if n == 0 || history.is_empty() {
            return Ok(Proposal::tokens(Vec::new()));
        }
        let p = target.position();
        if history.len() as u64 != p + 1 {
            return Err(format!(
                "the history holds {} tokens but the target has processed {p}: the anchor token should be the only one it has not",
                history.len()
            ));
        }
        let choice = match self.sampling {
            Some((temperature, seed)) => Choice::Sampled {
                temperature,
                seed,
                first_index: step_base,
            },
            None if self.min_draft_probability > 0.0 => Choice::GreedyWhileConfident {
                min_probability: self.min_draft_probability,
            },
            None => Choice::Greedy,
        };
        let row = self
            .row
            .lock()
            .map_err(|_| "the glm-mtp drafter's weights are poisoned by an earlier panic")?;
        let drafts = self
            .rounds
            .draft(&row, history, n, choice, &Ports(target), |_| {})?;
        if let Some(bad) = drafts.tokens.iter().find(|&&t| t >= self.vocab) {
            return Err(format!(
                "drafted token {bad} is outside the vocabulary of {}",
                self.vocab
            ));
        }
        Ok(Proposal {
            tokens: drafts.tokens,
            probs: drafts.probs,
        })
    }
}
