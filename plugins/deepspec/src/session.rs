//! The plugin side: the loaded drafter, the pairing check, the per-request session.
//!
//! What a session reads from the host, and when:
//! * at `open_for`: `target.spec()` — refused unless the target's layer count, hidden size and
//!   vocabulary are the ones the drafter was trained against;
//! * `tap_layers()`: the checkpoint's `target_layer_ids` (the residual stream leaving each);
//! * `receive_taps`: every verified position's taps, concatenated in that order and kept
//!   until the next `draft` projects them into the context;
//! * `draft`: nothing for DeepSpec's format, which carries its own embedding and LM head;
//!   `target.embed` and `target.logits_from_hidden` once a block for a shared-vocabulary
//!   checkpoint. One block forward, one read of the block's tokens and confidences.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use mlx_spec_plugin_api::mlx_rs::ops::concatenate;
use mlx_spec_plugin_api::mlx_rs::ops::indexing::IndexOp;
use mlx_spec_plugin_api::mlx_rs::Array;
use mlx_spec_plugin_api::{
    Drafter, DrafterSession, Proposal, SamplingInfo, Taps, Target, TargetInfo, TargetSpec,
};

use crate::config::DSparkConfig;
use crate::linear::mlx_err;
use crate::model::{confident_prefix, Choice, Context, DSparkModel, TargetPorts};
use crate::settings::{calibrated_thresholds, ComputeDtype, Settings};

/// The loaded drafter; sessions reach the weights through a lock (held for one `draft`).
pub struct DeepSpecDrafter {
    model: Arc<Mutex<DSparkModel>>,
    settings: Settings,
    thresholds: Vec<f32>,
    bytes: u64,
}

impl DeepSpecDrafter {
    pub fn new(settings: Settings) -> Result<Self, String> {
        let fixed = match settings.dtype {
            ComputeDtype::Fixed(d) => Some(d),
            ComputeDtype::Target | ComputeDtype::Checkpoint => None,
        };
        let model = DSparkModel::load(&settings.checkpoint, fixed)?;
        let thresholds = match &settings.thresholds {
            Some(t) => t.clone(),
            None => calibrated_thresholds(&settings.checkpoint)?,
        };
        if settings.calibration_log.is_some() && !model.config.confidence_head {
            return Err(format!(
                "a calibration log is asked for, but the checkpoint in {} has no confidence head to calibrate",
                settings.checkpoint.display()
            ));
        }
        if !thresholds.is_empty() && !model.config.confidence_head {
            return Err(format!(
                "confidence thresholds are set, but the checkpoint in {} has no confidence head",
                settings.checkpoint.display()
            ));
        }
        Ok(DeepSpecDrafter {
            bytes: model.nbytes() as u64,
            model: Arc::new(Mutex::new(model)),
            settings,
            thresholds,
        })
    }
}

impl Drafter for DeepSpecDrafter {
    type Session = DeepSpecSession;

    fn from_config_in(
        config: &serde_json::Value,
        plugin_dir: &std::path::Path,
    ) -> Result<Self, String> {
        DeepSpecDrafter::new(Settings::parse(config, plugin_dir)?)
    }

    fn weights_bytes(&self) -> u64 {
        self.bytes
    }

    fn open(
        &self,
        _info: &TargetInfo,
        _sampling: &SamplingInfo,
    ) -> Result<DeepSpecSession, String> {
        Err("the deepspec drafter needs a host that describes its target and delivers hidden states (plugin interface revision 2)".to_owned())
    }

    fn open_for(
        &self,
        _info: &TargetInfo,
        target: &Target<'_>,
        sampling: &SamplingInfo,
    ) -> Result<DeepSpecSession, String> {
        let spec = target.spec()?;
        let mut model = self
            .model
            .lock()
            .map_err(|_| "the deepspec drafter's weights are poisoned by an earlier panic")?;
        check_pairing(&model.config, &spec)?;
        if self.settings.dtype == ComputeDtype::Target {
            let wanted = spec.activation_dtype()?;
            if model.dtype != wanted {
                *model = DSparkModel::load(&self.settings.checkpoint, Some(wanted))?;
            }
        }
        Ok(DeepSpecSession {
            model: Arc::clone(&self.model),
            taps: model.config.target_layer_ids.clone(),
            context: Context::default(),
            waiting: None,
            thresholds: self.thresholds.clone(),
            sampling: (self.settings.sample_drafts && sampling.temperature > 0.0)
                .then_some((sampling.temperature, sampling.seed)),
            vocab: spec.vocab_size as u32,
            log: match &self.settings.calibration_log {
                Some(path) => Some(CalibrationLog::open(path)?),
                None => None,
            },
        })
    }
}

/// Refuses a target the drafter was not trained against; names both values of what differs.
pub fn check_pairing(config: &DSparkConfig, spec: &TargetSpec) -> Result<(), String> {
    for (what, ours, theirs) in [
        ("layer count", config.num_target_layers, spec.num_layers),
        ("hidden size", config.hidden_size, spec.hidden_size),
        ("vocabulary size", config.vocab_size, spec.vocab_size),
    ] {
        if ours != theirs {
            return Err(format!(
                "the deepspec drafter was trained for a target whose {what} is {ours}; this target's is {theirs}"
            ));
        }
    }
    Ok(())
}

/// The host's ports, for a shared-vocabulary drafter.
struct Ports<'a, 'b>(&'a Target<'b>);

impl TargetPorts for Ports<'_, '_> {
    fn embed(&self, ids: &[u32]) -> Result<Array, String> {
        self.0.embed(ids)
    }

    fn logits(&self, hidden: &Array) -> Result<Array, String> {
        self.0.logits_from_hidden(hidden)
    }
}

/// Per-request state: the context rows made so far and the taps waiting to join them.
pub struct DeepSpecSession {
    model: Arc<Mutex<DSparkModel>>,
    taps: Vec<i32>,
    context: Context,
    /// Taps `[rows, taps * H]` of the positions after the context, and the first position.
    waiting: Option<(u64, Array)>,
    thresholds: Vec<f32>,
    sampling: Option<(f32, u64)>,
    vocab: u32,
    log: Option<CalibrationLog>,
}

/// Where a session records its rounds for `mlx-spec calibrate`: the confidences of each
/// proposed block, written with the round's outcome when it is committed.
struct CalibrationLog {
    file: File,
    path: PathBuf,
    /// The confidences of every row of the block last proposed.
    pending: Option<Vec<f32>>,
}

impl CalibrationLog {
    fn open(path: &PathBuf) -> Result<Self, String> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| {
                format!(
                    "deepspec drafter: cannot open the calibration log {}: {e}",
                    path.display()
                )
            })?;
        Ok(CalibrationLog {
            file,
            path: path.clone(),
            pending: None,
        })
    }

    /// One JSON line a verified round: `{"confidence": [..], "proposed": n, "accepted": a}`.
    fn record(&mut self, proposed: usize, accepted: usize) -> Result<(), String> {
        let Some(confidence) = self.pending.take() else {
            return Ok(());
        };
        if proposed == 0 {
            return Ok(());
        }
        let line = serde_json::json!({
            "confidence": confidence,
            "proposed": proposed,
            "accepted": accepted,
        });
        writeln!(self.file, "{line}").map_err(|e| {
            format!(
                "deepspec drafter: cannot write the calibration log {}: {e}",
                self.path.display()
            )
        })
    }
}

impl DrafterSession for DeepSpecSession {
    fn tap_layers(&self) -> Vec<i32> {
        self.taps.clone()
    }

    fn receive_taps(&mut self, taps: Taps) -> Result<(), String> {
        let e = mlx_err("keeping taps");
        let rows = taps.rows();
        if rows == 0 {
            return Ok(());
        }
        if taps.layers.len() != self.taps.len() {
            return Err(format!(
                "the host delivered {} tap points, the drafter asked for {}",
                taps.layers.len(),
                self.taps.len()
            ));
        }
        let features = concatenate(&taps.layers, -1).map_err(&e)?;
        let expected = match &self.waiting {
            Some((first, w)) => first + w.shape()[0] as u64,
            None => self.context.rows() as u64,
        };
        if taps.first_position != expected {
            return Err(format!(
                "taps of position {} arrived where {expected} was next: the host must deliver every verified position once, in order",
                taps.first_position
            ));
        }
        self.waiting = Some(match self.waiting.take() {
            None => (taps.first_position, features),
            Some((first, w)) => (first, concatenate(&[w, features], 0).map_err(&e)?),
        });
        Ok(())
    }

    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        step_base: u64,
        target: &Target<'_>,
    ) -> Result<Proposal, String> {
        let Some(&anchor) = history.last() else {
            return Ok(Proposal::tokens(Vec::new()));
        };
        let p = target.position();
        let model = self
            .model
            .lock()
            .map_err(|_| "the deepspec drafter's weights are poisoned by an earlier panic")?;
        if let Some((_, taps)) = self.waiting.take() {
            model.extend_context(&mut self.context, &taps)?;
        }
        if self.context.rows() as u64 != p {
            return Err(format!(
                "the drafter's context holds positions 0..{} but the anchor sits at {p}: taps are missing",
                self.context.rows()
            ));
        }
        if n == 0 {
            return Ok(Proposal::tokens(Vec::new()));
        }
        let choice = match self.sampling {
            Some((temperature, seed)) => Choice::Sampled {
                temperature,
                seed,
                first_index: step_base,
            },
            None => Choice::Greedy,
        };
        let out = model.block(&self.context, anchor, &Ports(target))?;
        let block = model.choose(&out, anchor, choice)?;
        let keep = confident_prefix(&block.confidence, &self.thresholds, block.tokens.len()).min(n);
        let tokens = block.tokens[..keep].to_vec();
        if let Some(bad) = tokens.iter().find(|&&t| t >= self.vocab) {
            return Err(format!(
                "drafted token {bad} is outside the target's vocabulary of {}",
                self.vocab
            ));
        }
        let probs = match block.probs {
            Some(q) if keep > 0 => Some(q.index(..keep as i32)),
            _ => None,
        };
        if let Some(log) = &mut self.log {
            log.pending = (keep > 0).then(|| block.confidence.clone());
        }
        Ok(Proposal { tokens, probs })
    }

    fn commit(&mut self, drafted: usize, accepted: usize, _emitted: &[u32]) -> Result<(), String> {
        match &mut self.log {
            Some(log) => log.record(drafted, accepted),
            None => Ok(()),
        }
    }
}
