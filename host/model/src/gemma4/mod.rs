//! The Gemma 4 text decoder (dense E2B/E4B/12B/31B and MoE 26B-A4B) on MLX.
//!
//! One file per block: [`config`] (both config.json forms and the derived per-layer plan),
//! [`linear`] (dense and quantized matrices, the checkpoint loader), [`rope`], [`attention`],
//! [`mlp`], [`moe`], [`ple`] (per-layer embeddings), [`layer`] and [`cache`] (per-request KV
//! state); [`handoff`] says when a forward read at once goes to the device. Weights are
//! immutable; all per-request state lives in [`cache::ModelCache`].

pub mod activation;
pub mod attention;
pub mod cache;
pub mod config;
pub mod fast_path;
pub mod handoff;
pub mod layer;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod ple;
pub mod random_weights;
pub mod rope;

use std::path::Path;

use anyhow::{bail, Context, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, tanh};
use mlx_rs::{Array, Dtype};
use norm::rms_norm;

use crate::weights::{TensorSource, WeightStore};
pub use cache::{KvView, ModelCache, TrimError, MAX_MASKED_WINDOW};
pub use config::{AttentionKind, Gemma4Config};
pub use fast_path::{FastPath, LayerCall};
use layer::DecoderLayer;
use linear::{Embedding, Linear, Loader};
use ple::PerLayerEmbeddings;

/// A scalar in the compute dtype, so multiplying by it does not promote the activations.
pub(crate) fn scalar(value: f32, dtype: Dtype) -> Result<Array> {
    Ok(Array::from_f32(value).as_dtype(dtype)?)
}

/// Which positions of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// Only the last position (prefill, plain decode).
    Last,
    /// Every position (verification of drafted tokens, oracle tests).
    All,
}

/// What a forward pass returns.
pub struct ForwardOutput {
    /// `[positions, vocab]` float32 logits after the soft-cap.
    pub logits: Array,
    /// The hidden states [`Capture`] asked for, each `[T, hidden]`.
    pub hidden: Vec<Array>,
}

/// Which hidden states a forward keeps beside its logits. They come out of the forward
/// itself (never a second one), so a drafter reading them sees exactly what the target
/// computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture<'a> {
    /// None.
    Nothing,
    /// As transformers reports `hidden_states`: the scaled embedding, the output of every
    /// layer but the last, and the final norm's output (`num_layers + 1` entries).
    All,
    /// Tap points, in the order given: `-1` the scaled embedding (layer 0's input), `i` the
    /// output of layer `i`, `num_layers` the final norm's output.
    Taps(&'a [i32]),
}

impl From<bool> for Capture<'_> {
    /// `true`: [`Capture::All`]; `false`: [`Capture::Nothing`].
    fn from(all: bool) -> Self {
        if all {
            Capture::All
        } else {
            Capture::Nothing
        }
    }
}

impl Capture<'_> {
    /// The tap points this capture keeps, in output order, for a model of `layers` layers.
    fn points(&self, layers: usize) -> Vec<i32> {
        match self {
            Capture::Nothing => Vec::new(),
            Capture::All => (-1..layers as i32 - 1)
                .chain(std::iter::once(layers as i32))
                .collect(),
            Capture::Taps(points) => points.to_vec(),
        }
    }
}

/// The captured states in the order their tap points were asked for (a point asked twice
/// appears twice).
fn in_order(points: &[i32], taken: Vec<(i32, Array)>) -> Vec<Array> {
    points
        .iter()
        .filter_map(|p| taken.iter().find(|(q, _)| q == p).map(|(_, a)| a.clone()))
        .collect()
}

/// Compute dtype selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeChoice {
    /// The checkpoint's float dtype (for quantized checkpoints, that of the scales).
    Auto,
    Fixed(Dtype),
}

/// The loaded target model.
pub struct Gemma4Model {
    pub config: Gemma4Config,
    pub dtype: Dtype,
    embed: Embedding,
    embed_scale: Array,
    per_layer: Option<PerLayerEmbeddings>,
    layers: Vec<DecoderLayer>,
    final_norm: Array,
    head: Option<Linear>,
    /// `final_logit_softcapping` as a float32 scalar, made once: a scalar made from host data
    /// at every step would be one more host-written array the device reads.
    softcap: Option<Array>,
    /// How forwards run on this device, chosen at load.
    settings: RunSettings,
    /// The faster way of running layers and the head on this device, chosen at load; `None`:
    /// MLX's operations for everything.
    fast_path: Option<Box<dyn FastPath>>,
}

/// How a loaded model hands its forwards to the device: chosen once, at load, for the device
/// the model was loaded on, and read by every forward (never process-wide state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunSettings {
    /// Layers a group when a forward read at once goes to the device ([`handoff`]; 0: whole).
    pub handoff_layers: usize,
    /// Whether MLX's operations compute a window of tokens as that many decode steps would,
    /// so that a verify window may run whole through them. On the CPU they agree to float32
    /// rounding (every fixture's greedy output is the same either way). On a GPU a window's
    /// products and attention take other kernels than a step's and round differently in
    /// bfloat16, enough to flip a near tie between the two likeliest tokens; there only the
    /// fast path's window kernels compute a window as steps.
    pub operation_windows_match_steps: bool,
}

impl Default for RunSettings {
    /// Forwards handed over whole; windows through MLX's operations trusted (the CPU).
    fn default() -> Self {
        RunSettings {
            handoff_layers: 0,
            operation_windows_match_steps: true,
        }
    }
}

/// Tensor name prefixes of the decoder in the layouts we know, most specific first.
const PREFIXES: [&str; 4] = [
    "model.language_model.",
    "language_model.model.",
    "model.",
    "",
];

fn detect_prefix(store: &dyn TensorSource) -> Result<&'static str> {
    PREFIXES
        .into_iter()
        .find(|p| store.contains(&format!("{p}embed_tokens.weight")))
        .context("no embed_tokens.weight under any known prefix (model., model.language_model., language_model.model.): is this a Gemma 4 checkpoint?")
}

fn float_dtype(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

impl Gemma4Model {
    /// Loads `config.json` and the safetensors weights from `dir`.
    pub fn load(
        dir: &Path,
        dtype: DtypeChoice,
        progress: Option<indicatif::ProgressBar>,
    ) -> Result<Self> {
        Self::load_from(dir, dtype, progress, false)
    }

    /// [`Gemma4Model::load`], every quantized matrix dequantized once into a dense one of the
    /// compute dtype: the same weights (`scales * q + biases`), for a device whose quantized
    /// products are much slower than its dense ones (MLX's CPU), at the cost of the dense
    /// copy's memory.
    pub fn load_dequantized(
        dir: &Path,
        dtype: DtypeChoice,
        progress: Option<indicatif::ProgressBar>,
    ) -> Result<Self> {
        Self::load_from(dir, dtype, progress, true)
    }

    fn load_from(
        dir: &Path,
        dtype: DtypeChoice,
        progress: Option<indicatif::ProgressBar>,
        dequantize: bool,
    ) -> Result<Self> {
        if !dir.is_dir() {
            bail!("model folder {} does not exist", dir.display());
        }
        let config = Gemma4Config::from_dir(dir)?;
        let mut store = WeightStore::open(dir)?;
        if let Some(bar) = progress {
            bar.set_length(store.total_bytes());
            store.set_progress(bar);
        }
        Self::build(config, &store, dtype, dequantize)
    }

    pub fn random(
        mut config: Gemma4Config,
        seed: u64,
        dtype: Dtype,
        quant: Option<config::QuantSpec>,
    ) -> Result<Self> {
        let source = random_weights::RandomWeights::new(seed, dtype, quant);
        config.quantization = source.quant_config();
        Self::from_store(config, &source, DtypeChoice::Fixed(dtype))
    }

    pub fn from_store(
        config: Gemma4Config,
        store: &dyn TensorSource,
        dtype: DtypeChoice,
    ) -> Result<Self> {
        Self::build(config, store, dtype, false)
    }

    /// [`Gemma4Model::from_store`], quantized matrices turned dense (in the compute dtype)
    /// when `dequantize`.
    fn build(
        config: Gemma4Config,
        store: &dyn TensorSource,
        dtype: DtypeChoice,
        dequantize: bool,
    ) -> Result<Self> {
        let prefix = detect_prefix(store)?;
        let embed_name = format!("{prefix}embed_tokens");
        let dtype = match dtype {
            DtypeChoice::Fixed(d) => d,
            DtypeChoice::Auto => {
                let probe = if store.contains(&format!("{embed_name}.scales")) {
                    format!("{embed_name}.scales")
                } else {
                    format!("{embed_name}.weight")
                };
                let d = store
                    .dtype_of(&probe)
                    .with_context(|| format!("tensor {probe} is missing"))?;
                if !float_dtype(d) {
                    bail!("{probe} has dtype {d:?}; expected a float dtype");
                }
                d
            }
        };
        let w = Loader {
            store,
            prefix: prefix.to_owned(),
            dtype,
            quant: &config.quantization,
            dequantize,
        };
        let c = &config;
        let h = c.hidden_size;

        let embed = w.embedding("embed_tokens", c.vocab_size, h)?;
        let per_layer = if c.per_layer_input_size > 0 {
            Some(PerLayerEmbeddings::load(
                &w,
                h,
                c.num_layers,
                c.per_layer_input_size,
                c.per_layer_vocab_size,
                c.rms_norm_eps,
            )?)
        } else {
            None
        };
        let layers = (0..c.num_layers)
            .map(|i| DecoderLayer::load(c, i, &w).with_context(|| format!("loading layer {i}")))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = w.tensor("norm.weight", &[h])?;
        let head = if c.tie_word_embeddings {
            None
        } else {
            // An untied head sits beside the decoder: `lm_head` or `language_model.lm_head`.
            let outer = prefix
                .strip_suffix("model.")
                .unwrap_or("")
                .replace("model.language_model.", "");
            let hw = Loader {
                store,
                prefix: outer,
                dtype,
                quant: &config.quantization,
                dequantize,
            };
            Some(hw.linear("lm_head", c.vocab_size, h)?)
        };
        let softcap = config.final_logit_softcapping.map(Array::from_f32);
        Ok(Gemma4Model {
            embed_scale: scalar((h as f32).sqrt(), dtype)?,
            softcap,
            config,
            dtype,
            embed,
            per_layer,
            layers,
            final_norm,
            head,
            settings: RunSettings::default(),
            fast_path: None,
        })
    }

    /// How this model's forwards run.
    pub fn settings(&self) -> RunSettings {
        self.settings
    }

    /// Changes how this model's forwards are handed to the device (the loader applies the
    /// user's choices this way).
    pub fn set_settings(&mut self, settings: RunSettings) {
        self.settings = settings;
    }

    /// Installs (or with `None` removes) the fast path the forwards run through, returning
    /// the one it replaces.
    pub fn set_fast_path(
        &mut self,
        fast_path: Option<Box<dyn FastPath>>,
    ) -> Option<Box<dyn FastPath>> {
        std::mem::replace(&mut self.fast_path, fast_path)
    }

    /// The decoder layers.
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// The output head: the untied `lm_head`, or the embedding table when tied.
    pub fn head(&self) -> &Linear {
        match &self.head {
            Some(head) => head,
            None => &self.embed.0,
        }
    }

    /// The final norm's weight.
    pub fn final_norm(&self) -> &Array {
        &self.final_norm
    }

    /// Weight bytes one decode step reads: every weight except the rows of embedding tables
    /// that are only gathered (the per-layer table always; the token table when the head is
    /// untied) and the experts a token is not routed to. `total_weight_bytes` is what the
    /// loaded weights occupy. This over the device's copy bandwidth is the floor of a decode
    /// step at batch 1 (plus the KV cache it reads).
    pub fn weight_bytes_read_per_token(&self, total_weight_bytes: usize) -> usize {
        let gathered_only = self.per_layer.as_ref().map_or(0, |p| p.table_nbytes())
            + if self.head.is_some() {
                self.embed.0.nbytes()
            } else {
                0
            };
        let unrouted: usize = self
            .layers
            .iter()
            .map(|l| l.unread_nbytes_per_token())
            .sum();
        total_weight_bytes.saturating_sub(gathered_only + unrouted)
    }

    /// A fresh KV state for one sequence.
    pub fn new_cache(&self) -> ModelCache {
        ModelCache::new(&self.config)
    }

    /// Runs `ids` (positions `cache.offset()..`) through the model, extending `cache`.
    pub fn forward<'a>(
        &self,
        ids: &[u32],
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture: impl Into<Capture<'a>>,
    ) -> Result<ForwardOutput> {
        self.forward_slice(ids, cache, logits_for, capture.into(), 0)
    }

    /// [`Gemma4Model::forward`] for a caller that reads the result at once, as a verify round
    /// does: on a GPU the hidden state goes to the device every few layers as the host builds
    /// them ([`handoff`]), so the device starts on the first layers while the host builds the
    /// rest. The same values as [`Gemma4Model::forward`].
    pub fn forward_to_read<'a>(
        &self,
        ids: &[u32],
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture: impl Into<Capture<'a>>,
    ) -> Result<ForwardOutput> {
        let group = self.settings.handoff_layers;
        self.forward_slice(ids, cache, logits_for, capture.into(), group)
    }

    /// [`Gemma4Model::forward_grouped`] on host token ids, checked against the vocabulary.
    fn forward_slice(
        &self,
        ids: &[u32],
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture: Capture,
        group: usize,
    ) -> Result<ForwardOutput> {
        self.check_ids(ids)?;
        let ids = Array::from_slice(ids, &[1, ids.len() as i32]);
        self.forward_grouped(&ids, cache, logits_for, capture, group)
    }

    /// [`Gemma4Model::forward`] on token ids already in an array (`[1, T]`, integer), which
    /// may still be unevaluated: decode feeds the argmax of one step into the next without
    /// waiting for it. The ids are not checked against the vocabulary here.
    pub fn forward_ids<'a>(
        &self,
        ids: &Array,
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture: impl Into<Capture<'a>>,
    ) -> Result<ForwardOutput> {
        self.forward_grouped(ids, cache, logits_for, capture.into(), 0)
    }

    /// [`Gemma4Model::forward_ids`], the output of every `group` layers handed to the device
    /// as soon as it is built (0: none before the caller evaluates the result).
    fn forward_grouped(
        &self,
        ids: &Array,
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture: Capture,
        group: usize,
    ) -> Result<ForwardOutput> {
        let out = self.build_forward(ids, cache, logits_for, capture, group)?;
        self.before_evaluation();
        Ok(out)
    }

    /// The graph of [`Gemma4Model::forward_grouped`].
    fn build_forward(
        &self,
        ids: &Array,
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture: Capture,
        group: usize,
    ) -> Result<ForwardOutput> {
        if ids.ndim() != 2 || ids.shape()[0] != 1 || ids.shape()[1] == 0 {
            bail!(
                "token ids must have shape [1, T] with T >= 1, got {:?}",
                ids.shape()
            );
        }
        let t = ids.shape()[1];
        // Where the fast path takes verify windows of a few tokens exactly as decode steps (a
        // GPU), a longer verify window (logits for every position) runs as windows it takes,
        // one after the other, so that every window computes what decode steps compute. A
        // prompt (the last logits only) runs whole: plain and speculative decoding fill their
        // caches alike.
        let window_limit = self.verify_window_limit();
        let largest_window = window_limit.unwrap_or(usize::MAX);
        if logits_for == LogitsFor::All
            && t as usize > largest_window
            && t as usize <= MAX_MASKED_WINDOW
        {
            return self.forward_in_windows(ids, cache, logits_for, capture, largest_window, group);
        }
        let offset = cache.offset();
        // Activations are `[T, hidden]` matrices throughout: MLX wraps a product of a 3-D
        // input in flatten/unflatten operations, two extra graph nodes per matrix product.
        let ids = ids.reshape(&[t])?;

        let mut x = self.embed.lookup(&ids)?.multiply(&self.embed_scale)?;
        // A window the fast path takes whole computes what as many decode steps compute, so
        // its per-layer projection is made a token at a time, as a decode step makes it.
        let window = window_limit.is_some() && t > 1 && t as usize <= largest_window;
        let per_layer = match &self.per_layer {
            Some(p) => Some(p.inputs(&ids, &x, window)?),
            None => None,
        };
        let layers = self.layers.len();
        let points = capture.points(layers);
        self.check_tap_points(&points)?;
        let wanted = |point: i32| points.contains(&point);
        // Tap point -> its hidden state, filled as the forward passes each point.
        let mut taken: Vec<(i32, Array)> = Vec::with_capacity(points.len());
        if wanted(-1) {
            taken.push((-1, x.clone()));
        }

        let mut views: Vec<Option<KvView>> = vec![None; self.layers.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let plan = &self.config.layers[i];
            let shared = if plan.owns_kv(i) {
                None
            } else {
                views[plan.kv_source].as_ref()
            };
            let (out, view) = match &self.fast_path {
                Some(fast) => fast.layer(
                    layer,
                    LayerCall {
                        x: &x,
                        offset,
                        cache: cache.layer_mut(i),
                        shared,
                        per_layer: per_layer.as_ref(),
                    },
                )?,
                None => {
                    layer.forward(&x, offset, cache.layer_mut(i), shared, per_layer.as_ref())?
                }
            };
            views[i] = view;
            x = out;
            if wanted(i as i32) {
                taken.push((i as i32, x.clone()));
            }
            if handoff::hands_off_after(i, self.layers.len(), group) {
                self.before_evaluation();
                mlx_rs::transforms::async_eval([&x])?;
            }
        }
        cache.advance(t as usize);

        // The fast path's head (on a GPU: a decode token, or a window it takes whole, each
        // window token's logits a decode step's). The final norm's output, when asked for, is
        // made beside it by MLX's operations.
        let fast_logits = match &self.fast_path {
            Some(fast) => fast.logits(self, &x, window)?,
            None => None,
        };
        let final_point = layers as i32;
        if let Some(logits) = fast_logits {
            if wanted(final_point) {
                let normed = rms_norm(&x, Some(&self.final_norm), self.config.rms_norm_eps)?;
                taken.push((final_point, normed));
            }
            let logits = match logits_for {
                LogitsFor::Last if t > 1 => logits.index(((t - 1).., ..)),
                _ => logits,
            };
            let hidden = in_order(&points, taken);
            return Ok(ForwardOutput { logits, hidden });
        }

        let x = rms_norm(&x, Some(&self.final_norm), self.config.rms_norm_eps)?;
        if wanted(final_point) {
            taken.push((final_point, x.clone()));
        }
        let hidden = in_order(&points, taken);
        let x = match logits_for {
            LogitsFor::All => x,
            LogitsFor::Last if t == 1 => x,
            LogitsFor::Last => x.index(((t - 1).., ..)),
        };
        Ok(ForwardOutput {
            logits: self.logits_from_hidden(&x)?,
            hidden,
        })
    }

    /// The longest verify window that runs as one forward, where longer ones run in parts
    /// ([`Gemma4Model::forward_in_windows`]): the fast path's, where it computes a window's
    /// tokens exactly as decode steps (on a GPU, the window kernels: 2-8 tokens for the
    /// layouts they take, 1 where they take none, so such a window verifies a token at a
    /// time). `None` where a window of any length runs whole through MLX's operations: only
    /// where those compute it as steps ([`RunSettings::operation_windows_match_steps`]; on a
    /// GPU without window kernels a window verifies a token at a time, 1).
    pub fn verify_window_limit(&self) -> Option<usize> {
        let fast = self
            .fast_path
            .as_ref()
            .and_then(|fast| fast.verify_window_limit(self));
        match fast {
            Some(limit) => Some(limit),
            None if self.settings.operation_windows_match_steps => None,
            None => Some(1),
        }
    }

    /// Lets the fast path finish what it prepares beside the graph building (kernels met for
    /// the first time compile there) before MLX evaluates a forward.
    fn before_evaluation(&self) {
        if let Some(fast) = &self.fast_path {
            fast.before_evaluation();
        }
    }

    /// [`Gemma4Model::forward_ids`] over `ids` (`[1, T]`) as consecutive windows of at most
    /// `largest` tokens: the logits (and hidden states) of every window, joined. Each window
    /// hands its layers over in groups of `group` ([`handoff`]; 0: whole).
    ///
    /// Each window but the last is handed to the device (`async_eval`) before the next is
    /// built, so the windows run one after the other on the stream. Without that, MLX sees no
    /// dependency between a layer's kernels of one window and the same layer's kernels of the
    /// next: the next window's tokens are known ahead, and our kernels write the cache in place
    /// and count their blocks in the call site's counters, neither of which MLX tracks. It may
    /// then run them at once, and on an H200 a 4-bit E4B verify window a token at a time did
    /// (an illegal memory access).
    pub fn forward_in_windows<'a>(
        &self,
        ids: &Array,
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture: impl Into<Capture<'a>>,
        largest: usize,
        group: usize,
    ) -> Result<ForwardOutput> {
        let capture = capture.into();
        let t = ids.shape()[1] as usize;
        let mut logits = Vec::new();
        let mut hidden: Vec<Vec<Array>> = Vec::new();
        for start in (0..t).step_by(largest) {
            let end = (start + largest).min(t);
            let part = ids.index((.., start as i32..end as i32));
            let wanted = if logits_for == LogitsFor::Last && end < t {
                // Only the last window's last logits are wanted; this one's are not kept.
                LogitsFor::Last
            } else {
                logits_for
            };
            let out = self.forward_grouped(&part, cache, wanted, capture, group)?;
            if end < t {
                let mut queued = vec![&out.logits];
                queued.extend(&out.hidden);
                mlx_rs::transforms::async_eval(queued)?;
            }
            if logits_for == LogitsFor::All || end == t {
                logits.push(out.logits);
            }
            for (i, h) in out.hidden.into_iter().enumerate() {
                match hidden.get_mut(i) {
                    Some(parts) => parts.push(h),
                    None => hidden.push(vec![h]),
                }
            }
        }
        let logits = concatenate(&logits, 0)?;
        let hidden = hidden
            .iter()
            .map(|parts| Ok(concatenate(parts, 0)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(ForwardOutput { logits, hidden })
    }

    /// Scaled token embeddings `[1, T, hidden]`, the input of the first layer.
    pub fn embed(&self, ids: &[u32]) -> Result<Array> {
        self.check_ids(ids)?;
        let ids = Array::from_slice(ids, &[1, ids.len() as i32]);
        Ok(self.embed.lookup(&ids)?.multiply(&self.embed_scale)?)
    }

    /// Refuses tap points outside `-1..=num_layers`.
    fn check_tap_points(&self, points: &[i32]) -> Result<()> {
        let last = self.layers.len() as i32;
        if let Some(bad) = points.iter().find(|&&p| p < -1 || p > last) {
            bail!(
                "tap point {bad} does not exist: this model's are -1 (embeddings), 0..{} (layer outputs) and {last} (final norm)",
                last - 1
            );
        }
        Ok(())
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            bail!("no tokens given");
        }
        if let Some(&bad) = ids
            .iter()
            .find(|&&id| id as usize >= self.config.vocab_size)
        {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                self.config.vocab_size
            );
        }
        Ok(())
    }

    /// Final-norm hidden states `[.., T, H]` → `[T, vocab]` float32 soft-capped logits.
    pub fn logits_from_hidden(&self, x: &Array) -> Result<Array> {
        let logits = match &self.head {
            Some(head) => head.forward(x)?,
            None => self.embed.as_head(x)?,
        };
        let v = self.config.vocab_size as i32;
        let mut logits = logits.reshape(&[-1, v])?.as_dtype(Dtype::Float32)?;
        if let Some(cap) = &self.softcap {
            logits = tanh(logits.divide(cap)?)?.multiply(cap)?;
        }
        Ok(logits)
    }
}

// A model and its caches may move to another thread (a plugin's session, a server's request):
// this fails to compile if either stops being `Send`.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Gemma4Model>();
    send::<ModelCache>();
};
