//! The draft model, its pairing with the target, and the per-request session.
//!
//! A session keeps the draft model's own KV cache and the tokens it holds. Each round it
//! keeps the longest prefix of those tokens that the history still agrees with (the accepted
//! drafts survive, the rejected ones are rolled back), feeds the history's remaining tokens
//! (at least the anchor) in one forward, and then one token per further draft. A rollback
//! deeper than the cache allows (past a sliding window's reserve) starts the cache again
//! from the history, which is slower and still right.

use std::sync::{Arc, Mutex};

use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::ops::{concatenate, softmax_axis};
use mlx_rs::{random, Array, Dtype};
use mlx_spec_model::gemma4::{DtypeChoice, Gemma4Config, Gemma4Model, LogitsFor, ModelCache};
use mlx_spec_plugin_api::{
    Drafter, DrafterSession, Proposal, SamplingInfo, Target, TargetInfo, TargetSpec,
};

use crate::settings::{ComputeDtype, Settings};

fn load(settings: &Settings, dtype: Option<Dtype>) -> Result<Gemma4Model, String> {
    if let Some(seed) = settings.random_weights_seed {
        return random_model(settings, seed, dtype.unwrap_or(Dtype::Bfloat16));
    }
    let choice = match dtype {
        Some(d) => DtypeChoice::Fixed(d),
        None => DtypeChoice::Auto,
    };
    // In float32 (the CPU's dtype) quantized matrices run faster dequantized once, as the
    // host loads its target there.
    let model = if dtype == Some(Dtype::Float32) {
        Gemma4Model::load_dequantized(&settings.checkpoint, choice, None)
    } else {
        Gemma4Model::load(&settings.checkpoint, choice, None)
    };
    model.map_err(|e| {
        format!(
            "draft model {}: {e:#} (set the drafter's `checkpoint` to a Gemma 4 model folder)",
            settings.checkpoint.display()
        )
    })
}

/// A draft model of `checkpoint`'s config with seeded random weights: what a round costs at a
/// released model's size, measured without its weights (the host's `--random-weights`).
fn random_model(settings: &Settings, seed: u64, dtype: Dtype) -> Result<Gemma4Model, String> {
    let path = &settings.checkpoint;
    let config_path = if path.is_dir() {
        path.join("config.json")
    } else {
        path.clone()
    };
    let config =
        Gemma4Config::from_file(&config_path).map_err(|e| format!("draft model: {e:#}"))?;
    Gemma4Model::random(config, seed, dtype, None)
        .map_err(|e| format!("random draft model for {}: {e:#}", config_path.display()))
}

/// The loaded draft model; sessions reach it through a lock (held for one `draft`).
pub struct DraftModelDrafter {
    model: Arc<Mutex<Gemma4Model>>,
    /// The dtype the model was loaded for (`None`: the checkpoint's, its matrices as stored).
    loaded_for: Mutex<Option<Dtype>>,
    settings: Settings,
}

impl DraftModelDrafter {
    pub fn new(settings: Settings) -> Result<Self, String> {
        let fixed = match settings.dtype {
            ComputeDtype::Fixed(d) => Some(d),
            // Random weights are drawn once, in the dtype a GPU target computes in.
            _ if settings.random_weights_seed.is_some() => Some(Dtype::Bfloat16),
            ComputeDtype::Target | ComputeDtype::Checkpoint => None,
        };
        Ok(DraftModelDrafter {
            model: Arc::new(Mutex::new(load(&settings, fixed)?)),
            loaded_for: Mutex::new(fixed),
            settings,
        })
    }
}

impl Drafter for DraftModelDrafter {
    type Session = DraftModelSession;

    fn from_config_in(
        config: &serde_json::Value,
        plugin_dir: &std::path::Path,
    ) -> Result<Self, String> {
        DraftModelDrafter::new(Settings::parse(config, plugin_dir)?)
    }

    fn open(
        &self,
        _info: &TargetInfo,
        _sampling: &SamplingInfo,
    ) -> Result<DraftModelSession, String> {
        Err("the draft-model drafter needs a host that describes its target (plugin interface revision 2)".to_owned())
    }

    fn open_for(
        &self,
        _info: &TargetInfo,
        target: &Target<'_>,
        sampling: &SamplingInfo,
    ) -> Result<DraftModelSession, String> {
        let spec = target.spec()?;
        let mut guard = self
            .model
            .lock()
            .map_err(|_| "the draft model is poisoned by an earlier panic")?;
        let model = &mut *guard;
        check_pairing(model, &spec)?;
        if self.settings.dtype == ComputeDtype::Target {
            // Loaded once more for the target's dtype, even when the checkpoint's dtype is the
            // same: only a load for float32 dequantizes packed matrices, and a packed draft
            // model drafts several times slower on the CPU (BENCHMARKS.md, Quantized drafters).
            let wanted = spec.activation_dtype()?;
            let mut loaded_for = self
                .loaded_for
                .lock()
                .map_err(|_| "the draft model is poisoned by an earlier panic")?;
            if *loaded_for != Some(wanted) {
                *model = load(&self.settings, Some(wanted))?;
                *loaded_for = Some(wanted);
            }
        }
        Ok(DraftModelSession {
            model: Arc::clone(&self.model),
            cache: model.new_cache(),
            fed: Vec::new(),
            min_draft_probability: self.settings.min_draft_probability,
            sampling: (self.settings.sample_drafts && sampling.temperature > 0.0)
                .then_some((sampling.temperature, sampling.seed)),
        })
    }
}

/// Refuses a draft model that does not speak the target's vocabulary.
pub fn check_pairing(model: &Gemma4Model, spec: &TargetSpec) -> Result<(), String> {
    let ours = model.config.vocab_size;
    if ours != spec.vocab_size {
        return Err(format!(
            "the draft model's vocabulary has {ours} tokens; the target's has {}: a draft model must share the target's tokenizer",
            spec.vocab_size
        ));
    }
    Ok(())
}

/// Per-request state: the draft model's cache and the tokens it holds.
pub struct DraftModelSession {
    model: Arc<Mutex<Gemma4Model>>,
    cache: ModelCache,
    fed: Vec<u32>,
    min_draft_probability: f32,
    sampling: Option<(f32, u64)>,
}

impl DrafterSession for DraftModelSession {
    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        step_base: u64,
        _target: &Target<'_>,
    ) -> Result<Proposal, String> {
        if n == 0 || history.is_empty() {
            return Ok(Proposal::tokens(Vec::new()));
        }
        let guard = self
            .model
            .lock()
            .map_err(|_| "the draft model is poisoned by an earlier panic")?;
        let model = &*guard;
        let cache = &mut self.cache;
        let e =
            |what: &'static str| move |err: anyhow::Error| format!("draft model, {what}: {err:#}");
        // Keep what the history still agrees with, always feeding at least the anchor.
        let agreed = self
            .fed
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len() - 1);
        if agreed < self.fed.len() {
            if cache.trim(self.fed.len() - agreed).is_ok() {
                self.fed.truncate(agreed);
            } else {
                *cache = model.new_cache();
                self.fed.clear();
            }
        }
        let feed = &history[self.fed.len()..];
        let mut logits = model
            .forward(feed, cache, LogitsFor::Last, false)
            .map_err(e("forward"))?
            .logits;
        self.fed.extend_from_slice(feed);
        let err = |what: &'static str| {
            move |x: mlx_rs::error::Exception| format!("draft model, {what}: {x}")
        };
        let (mut tokens, mut probs) = (Vec::with_capacity(n), Vec::new());
        for j in 0..n {
            let logits_row = logits.reshape(&[1, -1]).map_err(err("logits"))?;
            let token = match self.sampling {
                None => {
                    let token: u32 = argmax_axis(&logits_row, -1, false)
                        .and_then(|t| t.as_dtype(Dtype::Uint32))
                        .map_err(err("argmax"))?
                        .try_item_cast()
                        .map_err(|x| format!("draft model, reading a draft: {x}"))?;
                    if self.min_draft_probability > 0.0 {
                        let probability: f32 = softmax_axis(&logits_row, -1, true)
                            .map(|q| q.index((.., token as i32)))
                            .map_err(err("probability"))?
                            .try_item_cast()
                            .map_err(|x| format!("draft model, reading a probability: {x}"))?;
                        if probability < self.min_draft_probability {
                            break;
                        }
                    }
                    token
                }
                Some((temperature, seed)) => {
                    let scaled = logits_row
                        .multiply(Array::from_f32(1.0 / temperature))
                        .map_err(err("temperature"))?;
                    probs.push(softmax_axis(&scaled, -1, true).map_err(err("softmax"))?);
                    let key =
                        random::key(draft_key(seed, step_base + j as u64)).map_err(err("key"))?;
                    random::categorical(&scaled, -1, None, &key)
                        .and_then(|t| t.as_dtype(Dtype::Uint32))
                        .map_err(err("sampling"))?
                        .try_item_cast()
                        .map_err(|x| format!("draft model, reading a draft: {x}"))?
                }
            };
            tokens.push(token);
            if j + 1 == n {
                break;
            }
            logits = model
                .forward(&[token], cache, LogitsFor::Last, false)
                .map_err(e("forward"))?
                .logits;
            self.fed.push(token);
        }
        let probs = if probs.is_empty() {
            None
        } else {
            Some(concatenate(&probs, 0).map_err(err("stacking distributions"))?)
        };
        Ok(Proposal { tokens, probs })
    }
}

/// The random key of the draft at emitted index `index`: splitmix64 of the seed, a constant of
/// this drafter's own (never the host's verification coin) and the index.
pub fn draft_key(seed: u64, index: u64) -> u64 {
    const SALT: u64 = 0x6472_6166_746D_646C; // "draftmdl"
    mlx_spec_plugin_api::draft_key(SALT, seed, index)
}
