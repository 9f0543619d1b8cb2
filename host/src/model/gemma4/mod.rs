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
    /// With `capture_hidden`: the scaled embedding, the output of each layer, and the final
    /// norm output (`num_layers + 1` entries of `[T, hidden]`, as transformers reports them).
    pub hidden: Vec<Array>,
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
    /// [`Gemma4Model::largest_exact_window`], worked out at first use.
    largest_window: std::sync::OnceLock<usize>,
    /// How forwards run on this device, chosen at load.
    settings: RunSettings,
}

/// How a loaded model runs its forwards: settings chosen once, at load, for the device the
/// model was loaded on, and read by every forward (never process-wide state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunSettings {
    /// Which of mlx-spec's fused CUDA kernels a forward uses (none off a CUDA GPU).
    pub kernels: crate::kernels::Fused,
    /// Layers a group when a forward read at once goes to the device ([`handoff`]; 0: whole).
    pub handoff_layers: usize,
}

impl RunSettings {
    /// The defaults for MLX's current default device: on a CUDA GPU (a Linux build whose
    /// default device is the GPU) the default kernel set and hand-off groups of
    /// [`handoff::DEFAULT_GPU_HANDOFF_LAYERS`]; elsewhere MLX's operations, handed over whole.
    pub fn for_default_device() -> RunSettings {
        let gpu = crate::device::default_is(mlx_rs::DeviceType::Gpu);
        RunSettings {
            kernels: if gpu && cfg!(target_os = "linux") {
                crate::kernels::Fused::allowed()
            } else {
                crate::kernels::Fused::default()
            },
            handoff_layers: if gpu {
                handoff::DEFAULT_GPU_HANDOFF_LAYERS
            } else {
                0
            },
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
        if !dir.is_dir() {
            bail!("model folder {} does not exist", dir.display());
        }
        let config = Gemma4Config::from_dir(dir)?;
        let mut store = WeightStore::open(dir)?;
        if let Some(bar) = progress {
            bar.set_length(store.total_bytes());
            store.set_progress(bar);
        }
        Self::from_store(config, &store, dtype)
    }

    /// A model of `config`'s shapes with seeded random weights (see [`random_weights`]).
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
            largest_window: std::sync::OnceLock::new(),
            settings: RunSettings::for_default_device(),
        })
    }

    /// How this model's forwards run.
    pub fn settings(&self) -> RunSettings {
        self.settings
    }

    /// Changes how this model's forwards run (the loader applies the user's choices this
    /// way). Fused kernels asked for off a CUDA GPU are ignored: only MLX's operations run
    /// there.
    pub fn set_settings(&mut self, settings: RunSettings) {
        self.settings = settings;
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
    pub fn forward(
        &self,
        ids: &[u32],
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture_hidden: bool,
    ) -> Result<ForwardOutput> {
        self.forward_slice(ids, cache, logits_for, capture_hidden, 0)
    }

    /// [`Gemma4Model::forward`] for a caller that reads the result at once, as a verify round
    /// does: on a GPU the hidden state goes to the device every few layers as the host builds
    /// them ([`handoff`]), so the device starts on the first layers while the host builds the
    /// rest. The same values as [`Gemma4Model::forward`].
    pub fn forward_to_read(
        &self,
        ids: &[u32],
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture_hidden: bool,
    ) -> Result<ForwardOutput> {
        let group = self.settings.handoff_layers;
        self.forward_slice(ids, cache, logits_for, capture_hidden, group)
    }

    /// [`Gemma4Model::forward_grouped`] on host token ids, checked against the vocabulary.
    fn forward_slice(
        &self,
        ids: &[u32],
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture_hidden: bool,
        group: usize,
    ) -> Result<ForwardOutput> {
        self.check_ids(ids)?;
        let ids = Array::from_slice(ids, &[1, ids.len() as i32]);
        self.forward_grouped(&ids, cache, logits_for, capture_hidden, group)
    }

    /// [`Gemma4Model::forward`] on token ids already in an array (`[1, T]`, integer), which
    /// may still be unevaluated: decode feeds the argmax of one step into the next without
    /// waiting for it. The ids are not checked against the vocabulary here.
    pub fn forward_ids(
        &self,
        ids: &Array,
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture_hidden: bool,
    ) -> Result<ForwardOutput> {
        self.forward_grouped(ids, cache, logits_for, capture_hidden, 0)
    }

    /// [`Gemma4Model::forward_ids`], the output of every `group` layers handed to the device
    /// as soon as it is built (0: none before the caller evaluates the result).
    fn forward_grouped(
        &self,
        ids: &Array,
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture_hidden: bool,
        group: usize,
    ) -> Result<ForwardOutput> {
        let out = self.build_forward(ids, cache, logits_for, capture_hidden, group)?;
        // Kernels met for the first time on this machine compile beside the graph building;
        // MLX must find them compiled when the caller evaluates the result.
        crate::kernels::kernel_cache::wait_for_compiles();
        Ok(out)
    }

    /// The graph of [`Gemma4Model::forward_grouped`].
    fn build_forward(
        &self,
        ids: &Array,
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture_hidden: bool,
        group: usize,
    ) -> Result<ForwardOutput> {
        if ids.ndim() != 2 || ids.shape()[0] != 1 || ids.shape()[1] == 0 {
            bail!(
                "token ids must have shape [1, T] with T >= 1, got {:?}",
                ids.shape()
            );
        }
        let t = ids.shape()[1];
        let fused = self.kernels();
        // With the window kernels on (a GPU), a verify window (logits for every position)
        // longer than they take for this model runs as windows they take, one after the other,
        // so that every window computes what decode steps compute. A prompt (the last logits
        // only) runs whole: plain and speculative decoding fill their caches alike.
        let largest_window = self.window_limit_for(fused).unwrap_or(usize::MAX);
        if logits_for == LogitsFor::All
            && t as usize > largest_window
            && t as usize <= MAX_MASKED_WINDOW
        {
            return self.forward_in_windows(
                ids,
                cache,
                logits_for,
                capture_hidden,
                largest_window,
                group,
            );
        }
        let offset = cache.offset();
        // Activations are `[T, hidden]` matrices throughout: MLX wraps a product of a 3-D
        // input in flatten/unflatten operations, two extra graph nodes per matrix product.
        let ids = ids.reshape(&[t])?;

        let mut x = self.embed.lookup(&ids)?.multiply(&self.embed_scale)?;
        // A window the window kernels take computes what as many decode steps compute, so
        // its per-layer projection is made a token at a time, as a decode step makes it.
        let window = fused.window && t > 1 && t as usize <= largest_window;
        let per_layer = match &self.per_layer {
            Some(p) => Some(p.inputs(&ids, &x, window)?),
            None => None,
        };
        let mut hidden = Vec::new();
        if capture_hidden {
            hidden.push(x.clone());
        }

        let mut views: Vec<Option<KvView>> = vec![None; self.layers.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let plan = &self.config.layers[i];
            let shared = if plan.owns_kv(i) {
                None
            } else {
                views[plan.kv_source].as_ref()
            };
            let (out, view) = layer.forward(
                &x,
                offset,
                cache.layer_mut(i),
                shared,
                per_layer.as_ref().map(|p| (p, i)),
                fused,
            )?;
            views[i] = view;
            x = out;
            if capture_hidden && i + 1 < self.layers.len() {
                hidden.push(x.clone());
            }
            if handoff::hands_off_after(i, self.layers.len(), group) {
                crate::kernels::kernel_cache::wait_for_compiles();
                mlx_rs::transforms::async_eval([&x])?;
            }
        }
        cache.advance(t as usize);

        // A decode token, or a window of 2-8 tokens: the head as one kernel (each window
        // token's logits a decode step's). The final norm's output, when asked for, is made
        // beside it by MLX's operations.
        if let Some(logits) = self.head_kernel_logits(&x, fused, window)? {
            if capture_hidden {
                hidden.push(rms_norm(
                    &x,
                    Some(&self.final_norm),
                    self.config.rms_norm_eps,
                )?);
            }
            let logits = match logits_for {
                LogitsFor::Last if t > 1 => logits.index(((t - 1).., ..)),
                _ => logits,
            };
            return Ok(ForwardOutput { logits, hidden });
        }

        let x = rms_norm(&x, Some(&self.final_norm), self.config.rms_norm_eps)?;
        if capture_hidden {
            hidden.push(x.clone());
        }
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

    /// The most tokens a window may hold for the window kernels to take all of this model
    /// (every layer, and the head): 2-8 for dense or 4-bit weights of the shapes they take, 1
    /// where they take any part of it not (an MoE branch, other bit widths). Windows longer
    /// than this run in parts on a GPU ([`Gemma4Model::forward_in_windows`]).
    pub fn largest_exact_window(&self) -> usize {
        *self.largest_window.get_or_init(|| {
            let head = match &self.head {
                Some(head) => head,
                None => &self.embed.0,
            };
            let hidden = self.config.hidden_size;
            let head_served = head
                .kernel_weight()
                .is_some_and(|w| w.layout(w.rows(), hidden as i32, self.dtype, "").is_ok())
                && crate::kernels::products::serves(hidden, self.dtype);
            if !head_served {
                return 1;
            }
            self.layers
                .iter()
                .map(|l| l.largest_window(self.dtype))
                .min()
                .unwrap_or(1)
        })
    }

    /// The logits of `x` (the last layer's output, `[T, hidden]`) through the output-head
    /// kernels, where they serve it: one token ([`crate::kernels::output_head`]), or a window
    /// (`window`) of 2-8 tokens ([`crate::kernels::window_output_head`]). `None` otherwise.
    fn head_kernel_logits(
        &self,
        x: &Array,
        fused: crate::kernels::Fused,
        window: bool,
    ) -> Result<Option<Array>> {
        if !fused.output_head {
            return Ok(None);
        }
        let head = match &self.head {
            Some(head) => head,
            None => &self.embed.0,
        };
        let Some(weight) = head.kernel_weight() else {
            return Ok(None);
        };
        let (eps, cap) = (
            self.config.rms_norm_eps,
            self.config.final_logit_softcapping,
        );
        use crate::kernels::{output_head, window_output_head};
        Ok(
            if x.shape()[0] == 1 && output_head::serves_head(x, &weight) {
                Some(output_head::output_head(
                    x,
                    &self.final_norm,
                    eps,
                    weight,
                    cap,
                )?)
            } else if window && window_output_head::serves_head(x, &weight) {
                Some(window_output_head::window_output_head(
                    x,
                    &self.final_norm,
                    eps,
                    weight,
                    cap,
                )?)
            } else {
                None
            },
        )
    }

    /// The longest verify window that runs as one forward, where longer ones run in parts
    /// ([`Gemma4Model::forward_in_windows`]): with the window kernels on (a GPU), the longest
    /// they take for this model ([`Gemma4Model::largest_exact_window`]), 1 where they take none
    /// (an MoE branch, weights of other bit widths), where decode steps do not run the
    /// single-token kernels whose values they give (a kernel set without them), or where no
    /// grid-wide barrier is safe (a GPU shared through MPS): such a window verifies a token at
    /// a time, as decode steps. `None` where a window of any length runs whole (MLX's
    /// operations: the CPU, or the window kernels off).
    pub fn verify_window_limit(&self) -> Option<usize> {
        self.window_limit_for(self.kernels())
    }

    /// The fused kernels the next forward uses: those of [`RunSettings`], or while the lab
    /// records kernel sources without running them ([`crate::kernels::capture_kernels`]),
    /// the lab's set whatever the device.
    fn kernels(&self) -> crate::kernels::Fused {
        if crate::kernels::capturing() {
            return crate::kernels::Fused::allowed();
        }
        self.settings.kernels
    }

    /// [`Gemma4Model::verify_window_limit`] with the kernels `fused` allows.
    fn window_limit_for(&self, fused: crate::kernels::Fused) -> Option<usize> {
        if !fused.window {
            return None;
        }
        // The single-token kernels a window kernel matches: the heads, decode attention and
        // the head for every layout; after the heads, the post-attention kernel for dense
        // layers and its 4-bit form (with the 4-bit heads) for quantized ones.
        let dense = self.layers.iter().any(|l| l.is_dense());
        let quantized = self.layers.iter().any(|l| !l.is_dense());
        let matched = fused.attention
            && fused.products
            && fused.output_head
            && (!dense || fused.post_attention)
            && (!quantized || (fused.affine4 && fused.affine4_heads));
        Some(
            if matched && crate::kernels::post_attention::grid_blocks().is_some() {
                self.largest_exact_window()
            } else {
                1
            },
        )
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
    pub fn forward_in_windows(
        &self,
        ids: &Array,
        cache: &mut ModelCache,
        logits_for: LogitsFor,
        capture_hidden: bool,
        largest: usize,
        group: usize,
    ) -> Result<ForwardOutput> {
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
            let out = self.forward_grouped(&part, cache, wanted, capture_hidden, group)?;
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
