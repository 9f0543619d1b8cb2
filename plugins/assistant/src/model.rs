//! The whole drafter and one draft step.
//!
//! A step takes the target's scaled embedding of a token `e` (`[1, H_b]`) and a hidden state
//! `h` (`[1, H_b]`: the target's final-norm hidden for the first step of a round, the step's
//! own projected output afterwards) and computes
//!
//! ```text
//! a = pre_projection(concat(e, h))          [1, d]      embedding first, hidden second
//! a = layer_i(a) for each layer             reads the donor of the layer's kind
//! z = norm(a)                               [1, d]
//! token = argmax(head(z)); next_hidden = post_projection(z)   [1, H_b]
//! ```
//!
//! Nothing changes between the steps of a round but the token and the hidden: the same donors,
//! masks and query position (the [`Round`]).

use std::path::Path;

use mlx_spec_plugin_api::mlx_rs::fast::rms_norm;
use mlx_spec_plugin_api::mlx_rs::ops::indexing::argmax_axis;
use mlx_spec_plugin_api::mlx_rs::ops::{concatenate, softmax_axis};
use mlx_spec_plugin_api::mlx_rs::random;
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::attention::{AttentionScale, DonorView};
use crate::checkpoint::Checkpoint;
use crate::config::{AssistantConfig, Kind};
use crate::head::Head;
use crate::layer::Layer;
use crate::linear::{is_float, mlx_err, Linear, Loader};
use crate::rope::QueryAngles;

pub struct AssistantModel {
    pub config: AssistantConfig,
    /// The compute dtype every weight was cast to; inputs are cast to it too.
    pub dtype: Dtype,
    pre_projection: Linear,
    layers: Vec<Layer>,
    norm: Array,
    post_projection: Linear,
    pub head: Head,
    /// 1.0 for Gemma 4; changed only by tests that show the other value fails.
    pub attention_scale: AttentionScale,
}

/// What one round's steps share: the visible donor entries and the query's RoPE.
pub struct Round {
    pub sliding: Option<(DonorView, QueryAngles)>,
    pub full: Option<(DonorView, QueryAngles)>,
}

impl Round {
    fn of(&self, kind: Kind) -> Result<&(DonorView, QueryAngles), String> {
        match kind {
            Kind::Sliding => self.sliding.as_ref(),
            Kind::Full => self.full.as_ref(),
        }
        .ok_or_else(|| format!("no {} donor for this round", kind.name()))
    }
}

/// One step's results, lazy until read.
pub struct StepOutput {
    /// `concat(e, h)`, `[1, 2 H_b]`.
    pub input: Array,
    /// The stream after the input projection, then after each layer (`[1, d]` each).
    pub stream: Vec<Array>,
    /// The final-norm output `z`, the head's input.
    pub normed: Array,
    /// `post_projection(z)`, the next step's hidden.
    pub next_hidden: Array,
}

impl AssistantModel {
    /// Loads `config.json` and the weights of a checkpoint folder. `dtype`: the compute dtype,
    /// or `None` for the checkpoint's own float dtype.
    pub fn load(dir: &Path, dtype: Option<Dtype>) -> Result<Self, String> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            format!(
                "cannot read {}: {e} (set the drafter's `checkpoint` to an assistant checkpoint folder)",
                config_path.display()
            )
        })?;
        let config = AssistantConfig::parse(&text, &config_path.display().to_string())?;
        let checkpoint = Checkpoint::open_dir(dir)?;
        // Norm weights stay float in quantized checkpoints, so they tell the float dtype.
        let stored = checkpoint
            .dtype("model.norm.weight")
            .filter(|d| is_float(*d))
            .unwrap_or(Dtype::Float32);
        let dtype = dtype.unwrap_or(stored);
        let loader = Loader {
            checkpoint: &checkpoint,
            quant: &config.quantization,
            dtype,
        };
        let (d, hb) = (config.hidden_size, config.backbone_hidden_size);
        let layers = (0..config.layer_kinds.len())
            .map(|i| Layer::load(&config, i, &loader))
            .collect::<Result<Vec<_>, _>>()?;
        let model = AssistantModel {
            pre_projection: loader.linear("pre_projection", d, 2 * hb)?,
            layers,
            norm: loader.float("model.norm.weight", &[d])?,
            post_projection: loader.linear("post_projection", hb, d)?,
            head: Head::load(&config, &loader)?,
            config,
            dtype,
            attention_scale: AttentionScale::One,
        };
        Ok(model)
    }

    /// Bytes of the weights held.
    pub fn nbytes(&self) -> usize {
        self.pre_projection.nbytes()
            + self.post_projection.nbytes()
            + self.norm.nbytes()
            + self.head.nbytes()
            + self.layers.iter().map(Layer::nbytes).sum::<usize>()
    }

    /// Casts an input (embedding, hidden, donor) to the compute dtype.
    pub fn cast(&self, a: &Array) -> Result<Array, String> {
        if a.dtype() == self.dtype {
            Ok(a.clone())
        } else {
            a.as_dtype(self.dtype)
                .map_err(mlx_err("casting a drafter input"))
        }
    }

    /// One draft step from the token's target embedding and the incoming hidden state (both
    /// `[1, H_b]`, any float dtype).
    pub fn step(
        &self,
        embedding: &Array,
        hidden: &Array,
        round: &Round,
    ) -> Result<StepOutput, String> {
        let e = mlx_err("draft step");
        let hb = self.config.backbone_hidden_size as i32;
        for (what, a) in [("embedding", embedding), ("hidden state", hidden)] {
            if a.size() != hb as usize {
                return Err(format!(
                    "the {what} has shape {:?}, expected {hb} values (the target's hidden size)",
                    a.shape()
                ));
            }
        }
        let embedding = self.cast(&embedding.reshape(&[1, hb]).map_err(&e)?)?;
        let hidden = self.cast(&hidden.reshape(&[1, hb]).map_err(&e)?)?;
        let input = concatenate(&[embedding, hidden], -1).map_err(&e)?;
        let mut x = self.pre_projection.forward(&input)?;
        let mut stream = vec![x.clone()];
        for layer in &self.layers {
            let (donor, angles) = round.of(layer.kind)?;
            x = layer.forward(&x, donor, angles, self.attention_scale)?;
            stream.push(x.clone());
        }
        let normed = rms_norm(&x, Some(&self.norm), self.config.rms_norm_eps).map_err(&e)?;
        let next_hidden = self.post_projection.forward(&normed)?;
        Ok(StepOutput {
            input,
            stream,
            normed,
            next_hidden,
        })
    }

    /// A round of `steps` drafts from the anchor `(token, hidden)`: each step's token (read back once
    /// per step, since its embedding feeds the next) and projected hidden feed the next step.
    /// `embed` gives the target's scaled embedding `[.., H_b]` of a token; `inspect` sees
    /// every step's outputs (tests).
    pub fn chain(
        &self,
        (token, hidden): (u32, &Array),
        round: &Round,
        steps: usize,
        choice: Choice,
        mut embed: impl FnMut(u32) -> Result<Array, String>,
        mut inspect: impl FnMut(&StepOutput),
    ) -> Result<Drafts, String> {
        let mut tokens = Vec::with_capacity(steps);
        let mut rows = Vec::new();
        let (mut token, mut hidden) = (token, hidden.clone());
        for i in 0..steps {
            let out = self.step(&embed(token)?, &hidden, round)?;
            let picked = match choice {
                Choice::Greedy => self.head.token(&out.normed)?,
                Choice::GreedyWhileConfident { min_probability } => {
                    let (picked, probability) = self.confident_token(&out.normed)?;
                    if probability < min_probability {
                        break;
                    }
                    picked
                }
                Choice::Sampled {
                    temperature,
                    seed,
                    first_index,
                } => {
                    let (picked, q) =
                        self.sample(&out.normed, temperature, seed, first_index + i as u64)?;
                    rows.push(q);
                    picked
                }
            };
            token = picked
                .try_item_cast::<u32>()
                .map_err(|e| format!("reading the draft token: {e}"))?;
            inspect(&out);
            hidden = out.next_hidden;
            tokens.push(token);
        }
        let probs = if rows.is_empty() {
            None
        } else {
            Some(concatenate(&rows, 0).map_err(mlx_err("stacking draft distributions"))?)
        };
        Ok(Drafts { tokens, probs })
    }

    /// The argmax token and its probability under the drafter's softmax.
    fn confident_token(&self, z: &Array) -> Result<(Array, f32), String> {
        let e = mlx_err("the draft's probability");
        let logits = self.head.logits(z)?;
        let token = argmax_axis(&logits, 0, false)
            .and_then(|t| t.as_dtype(Dtype::Uint32))
            .map_err(&e)?;
        let probability = softmax_axis(&logits, -1, true)
            .and_then(|q| q.max(false))
            .map_err(&e)?
            .try_item_cast::<f32>()
            .map_err(|err| format!("reading the draft's probability: {err}"))?;
        Ok((token, probability))
    }

    /// Draws a token from `softmax(logits / temperature)` with a key made from the request's
    /// seed and the token's emitted index (never the library's implicit random state), and
    /// returns it with that distribution (float32 `[1, vocab]`).
    fn sample(
        &self,
        z: &Array,
        temperature: f32,
        seed: u64,
        index: u64,
    ) -> Result<(Array, Array), String> {
        let e = mlx_err("sampling a draft");
        let scaled = self
            .head
            .logits(z)?
            .multiply(Array::from_f32(1.0 / temperature))
            .and_then(|l| l.reshape(&[1, -1]))
            .map_err(&e)?;
        let q = softmax_axis(&scaled, -1, true).map_err(&e)?;
        let key = random::key(draft_key(seed, index)).map_err(&e)?;
        let token = random::categorical(&scaled, -1, None, &key)
            .and_then(|t| t.as_dtype(Dtype::Uint32))
            .map_err(&e)?;
        Ok((token, q))
    }
}

/// How each step's token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    /// The argmax (transformers' choice); proposals go without distributions.
    Greedy,
    /// The argmax while the drafter's own probability of it is at least `min_probability`:
    /// the round ends at the first draft below it, so a window is not widened for a draft the
    /// target is unlikely to accept.
    GreedyWhileConfident { min_probability: f32 },
    /// Drawn from `softmax(logits / temperature)`; the distributions go with the proposal, for
    /// the host's rejection sampling. `first_index`: the emitted index of the first draft.
    Sampled {
        temperature: f32,
        seed: u64,
        first_index: u64,
    },
}

/// A round's drafts.
pub struct Drafts {
    pub tokens: Vec<u32>,
    /// With [`Choice::Sampled`]: float32 `[tokens, vocab]`, row `i` the distribution token `i`
    /// was drawn from.
    pub probs: Option<Array>,
}

/// The random key of the draft at emitted index `index`: splitmix64 of the seed, a constant of
/// this drafter's own (so the draws never coincide with the host's verification coin, which
/// is keyed by the same seed and index) and the index.
pub fn draft_key(seed: u64, index: u64) -> u64 {
    const SALT: u64 = 0x6173_7369_7374_616E; // "assistan"
    mlx_spec_plugin_api::draft_key(SALT, seed, index)
}
