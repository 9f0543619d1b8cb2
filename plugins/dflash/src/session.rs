//! The plugin side: the loaded drafter, the pairing check, the per-request session.
//!
//! What a session reads from the host, and when:
//! * at `open_for`: `target.spec()` — refused unless the target's layer count and hidden size
//!   are the ones the drafter was trained against and its vocabulary holds the mask token;
//! * `tap_layers()`: the checkpoint's `target_layer_ids` (the residual stream leaving each);
//! * `receive_taps`: every verified position's taps, concatenated in that order and kept
//!   until the next `draft` projects them into the context;
//! * `draft`: `target.embed` and `target.logits_from_hidden` once each. One block forward, one
//!   read of the block's tokens.

use std::sync::{Arc, Mutex};

use mlx_spec_plugin_api::mlx_rs::ops::concatenate;
use mlx_spec_plugin_api::mlx_rs::ops::indexing::IndexOp;
use mlx_spec_plugin_api::mlx_rs::Array;
use mlx_spec_plugin_api::{
    Drafter, DrafterSession, Proposal, SamplingInfo, Taps, Target, TargetInfo, TargetSpec,
};

use crate::config::DFlashConfig;
use crate::linear::mlx_err;
use crate::model::{Choice, Context, DFlashModel, TargetPorts};
use crate::settings::{ComputeDtype, Settings};

/// The loaded drafter; sessions reach the weights through a lock (held for one `draft`).
pub struct DFlashDrafter {
    model: Arc<Mutex<DFlashModel>>,
    settings: Settings,
    bytes: u64,
}

impl DFlashDrafter {
    pub fn new(settings: Settings) -> Result<Self, String> {
        let fixed = match settings.dtype {
            ComputeDtype::Fixed(d) => Some(d),
            ComputeDtype::Target | ComputeDtype::Checkpoint => None,
        };
        let model = DFlashModel::load(&settings.checkpoint, fixed)?;
        Ok(DFlashDrafter {
            bytes: model.nbytes() as u64,
            model: Arc::new(Mutex::new(model)),
            settings,
        })
    }
}

const POISONED: &str = "the dflash drafter's weights are poisoned by an earlier panic";

impl Drafter for DFlashDrafter {
    type Session = DFlashSession;

    fn from_config_in(
        config: &serde_json::Value,
        plugin_dir: &std::path::Path,
    ) -> Result<Self, String> {
        DFlashDrafter::new(Settings::parse(config, plugin_dir)?)
    }

    fn weights_bytes(&self) -> u64 {
        self.bytes
    }

    fn open(&self, _info: &TargetInfo, _sampling: &SamplingInfo) -> Result<DFlashSession, String> {
        Err("the dflash drafter needs a host that describes its target, delivers hidden states and lends its embedding and LM head (plugin interface revision 2)".to_owned())
    }

    fn open_for(
        &self,
        _info: &TargetInfo,
        target: &Target<'_>,
        sampling: &SamplingInfo,
    ) -> Result<DFlashSession, String> {
        let spec = target.spec()?;
        let mut model = self.model.lock().map_err(|_| POISONED)?;
        check_pairing(&model.config, &spec)?;
        if self.settings.dtype == ComputeDtype::Target {
            let wanted = spec.activation_dtype()?;
            if model.dtype != wanted {
                *model = DFlashModel::load(&self.settings.checkpoint, Some(wanted))?;
            }
        }
        Ok(DFlashSession {
            model: Arc::clone(&self.model),
            taps: model.config.target_layer_ids.clone(),
            context: Context::default(),
            waiting: None,
            sampling: (self.settings.sample_drafts && sampling.temperature > 0.0)
                .then_some((sampling.temperature, sampling.seed)),
            vocab: spec.vocab_size as u32,
        })
    }
}

/// Refuses a target the drafter was not trained against; names both values of what differs.
pub fn check_pairing(config: &DFlashConfig, spec: &TargetSpec) -> Result<(), String> {
    for (what, ours, theirs) in [
        ("layer count", config.num_target_layers, spec.num_layers),
        ("hidden size", config.hidden_size, spec.hidden_size),
    ] {
        if ours != theirs {
            return Err(format!(
                "the dflash drafter was trained for a target whose {what} is {ours}; this target's is {theirs}"
            ));
        }
    }
    // The config already keeps the taps below num_target_layers - 1; this is the same bound
    // stated against the target itself.
    if let Some(bad) = config
        .target_layer_ids
        .iter()
        .find(|&&i| i < -1 || i >= spec.num_layers as i32 - 1)
    {
        return Err(format!(
            "the dflash drafter taps target layer {bad}; this target's layers are 0..{} and the last cannot be tapped",
            spec.num_layers
        ));
    }
    if config.mask_token_id as usize >= spec.vocab_size {
        return Err(format!(
            "the dflash drafter's mask_token_id {} is outside this target's vocabulary of {}",
            config.mask_token_id, spec.vocab_size
        ));
    }
    Ok(())
}

/// The host's ports.
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
pub struct DFlashSession {
    model: Arc<Mutex<DFlashModel>>,
    taps: Vec<i32>,
    context: Context,
    /// Taps `[rows, taps * H]` of the positions after the context, and the first position.
    waiting: Option<(u64, Array)>,
    sampling: Option<(f32, u64)>,
    vocab: u32,
}

impl DrafterSession for DFlashSession {
    fn tap_layers(&self) -> Vec<i32> {
        self.taps.clone()
    }

    fn receive_taps(&mut self, taps: Taps) -> Result<(), String> {
        let e = mlx_err("keeping taps");
        if taps.rows() == 0 {
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
        let model = self.model.lock().map_err(|_| POISONED)?;
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
        let block = model.choose(&out, choice)?;
        let keep = block.tokens.len().min(n);
        let tokens = block.tokens[..keep].to_vec();
        if let Some(bad) = tokens.iter().find(|&&t| t >= self.vocab) {
            return Err(format!(
                "drafted token {bad} is outside the target's vocabulary of {}",
                self.vocab
            ));
        }
        let probs = block.probs.map(|q| q.index(..keep as i32));
        Ok(Proposal { tokens, probs })
    }
}
