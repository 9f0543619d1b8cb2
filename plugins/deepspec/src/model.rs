//! The whole drafter: the context it keeps, one block forward, and the choice of the block's
//! tokens (Markov head) and of how many to propose (confidence head).
//!
//! ```text
//! context row (per verified position): c = rms(fc(concat(taps)), hidden_norm)
//!                                       each layer keeps rope(rms(k_proj c, k_norm)), rms(k_proj c)
//! block at anchor position P:           h = embed_tokens[anchor, mask, ..., mask] * sqrt(H)
//!                                       h = layers(h) at positions P..P+B-1;  hB = rms(h, norm)
//! row k predicts the token at P+k+1:    U_k = softcap(lm_head hB_k)
//!                                       Z_k = U_k + markov_w2 markov_w1[prev_k]   prev_0 = anchor
//!                                       tok_k = argmax Z_k (or drawn from softmax(Z_k / T))
//! confidence of row k:                  c_k = sigmoid(proj [hB_k ; markov_w1[prev_k]])
//! ```
//!
//! The drafter's embedding and LM head are its own frozen copies of the target's (DeepSpec's
//! format), or, in a checkpoint marked `mlx_spec_shared_vocab`, the target's own through its
//! ports (the copies would only repeat the target's tables). The Markov chain runs on the
//! device: each token stays an MLX array that feeds the next row's lookup, and the block is
//! read back once.

use std::path::Path;

use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::fast::rms_norm;
use mlx_spec_plugin_api::mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_spec_plugin_api::mlx_rs::ops::{concatenate, sigmoid, softmax_axis, tanh};
use mlx_spec_plugin_api::mlx_rs::{random, Array, Dtype};

use crate::config::DSparkConfig;
use crate::layer::DraftLayer;
use crate::linear::{is_float, mlx_err, Linear, Loader};
use crate::rope::Angles;
use mlx_spec_plugin_api::quant::QuantConfig;

/// Where a block's embeddings and logits come from.
pub enum Vocabulary {
    /// The checkpoint's tables: `embed_tokens` `[V, H]`, looked up and scaled by `sqrt(H)`
    /// rounded to the weight dtype, and `lm_head`, soft-capped as the config says.
    Own {
        embed_tokens: Linear,
        embed_scale: Array,
        lm_head: Linear,
    },
    /// The target's input embedding and LM head (with its soft-cap), through its ports.
    Target,
}

/// The target's ports a shared-vocabulary drafter reads: embeddings `[.., rows, H]` as the
/// target's first layer reads them, and float32 logits `[rows, V]` of final hidden states.
pub trait TargetPorts {
    fn embed(&self, ids: &[u32]) -> Result<Array, String>;
    fn logits(&self, hidden: &Array) -> Result<Array, String>;
}

/// For drafters with their own tables: no port is read.
pub struct NoPorts;

impl TargetPorts for NoPorts {
    fn embed(&self, _ids: &[u32]) -> Result<Array, String> {
        Err("this drafter has no target to read embeddings from".to_owned())
    }
    fn logits(&self, _hidden: &Array) -> Result<Array, String> {
        Err("this drafter has no target to read logits from".to_owned())
    }
}

pub struct DSparkModel {
    pub config: DSparkConfig,
    pub dtype: Dtype,
    pub vocabulary: Vocabulary,
    fc: Linear,
    hidden_norm: Array,
    layers: Vec<DraftLayer>,
    norm: Array,
    /// `markov_w1` `[V, r]` (a lookup) and `markov_w2` `[V, r]` (a product).
    markov: Option<(Linear, Linear)>,
    /// `proj` `[1, H (+ r)]` and its bias `[1]`.
    confidence: Option<(Linear, bool)>,
}

/// The drafter's keys and values of every context row, per layer.
#[derive(Default)]
pub struct Context {
    layers: Vec<(Array, Array)>,
    rows: usize,
}

impl Context {
    /// Context rows held: positions `0..rows`, so the next anchor sits at `rows`.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Layer `i`'s keys and values `[1, kv_heads, rows, D]` (tests compare them).
    pub fn layer(&self, i: usize) -> Option<&(Array, Array)> {
        self.layers.get(i)
    }
}

/// One block's forward, lazy until read.
pub struct BlockOutput {
    /// `hB`, `[B, H]`.
    pub hidden: Array,
    /// `U`, soft-capped, `[B, V]`, float32.
    pub base_logits: Array,
}

/// How a block's tokens are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    Greedy,
    /// Drawn from `softmax(Z_k / temperature)` with a key from the seed and the token's emitted
    /// index; the distributions go with the proposal.
    Sampled {
        temperature: f32,
        seed: u64,
        first_index: u64,
    },
}

/// A block's tokens and what the heads say about them.
pub struct Block {
    pub tokens: Vec<u32>,
    /// `Z`, the Markov-corrected logits, `[B, V]` float32.
    pub logits: Array,
    /// With [`Choice::Sampled`]: `softmax(Z / T)`, `[B, V]`.
    pub probs: Option<Array>,
    /// `sigmoid(z_k)`, one per row (empty without a confidence head).
    pub confidence: Vec<f32>,
    /// The confidence head's logits `z_k`, `[B]` (tests).
    pub confidence_logits: Option<Array>,
}

impl DSparkModel {
    /// Loads `config.json` and the weights of a checkpoint folder; `dtype`: the compute dtype,
    /// or `None` for the checkpoint's own float dtype.
    pub fn load(dir: &Path, dtype: Option<Dtype>) -> Result<Self, String> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            format!(
                "cannot read {}: {e} (set the drafter's `checkpoint` to a DeepSpec checkpoint folder)",
                config_path.display()
            )
        })?;
        let config = DSparkConfig::parse(&text, &config_path.display().to_string())?;
        let checkpoint = Checkpoint::open_dir(dir)?;
        let stored = checkpoint
            .dtype("norm.weight")
            .filter(|d| is_float(*d))
            .unwrap_or(Dtype::Float32);
        let loader = Loader {
            checkpoint: &checkpoint,
            prefix: String::new(),
            dtype: dtype.unwrap_or(stored),
            quant: QuantConfig::from_config(
                &serde_json::from_str(&text).map_err(|e| e.to_string())?,
                &config_path.display().to_string(),
            )?,
        };
        let (h, v) = (config.hidden_size, config.vocab_size);
        let taps = config.target_layer_ids.len();
        let layers = (0..config.num_layers)
            .map(|i| DraftLayer::load(&config, i, &loader))
            .collect::<Result<Vec<_>, _>>()?;
        let markov = if config.markov_rank > 0 {
            let r = config.markov_rank;
            Some((
                loader.linear("markov_head.markov_w1", v, r, false)?,
                loader.linear("markov_head.markov_w2", v, r, false)?,
            ))
        } else {
            None
        };
        let confidence = if config.confidence_head {
            let width = h + if config.confidence_with_markov {
                config.markov_rank
            } else {
                0
            };
            Some((
                loader.linear("confidence_head.proj", 1, width, true)?,
                config.confidence_with_markov,
            ))
        } else {
            None
        };
        let vocabulary = if config.shared_vocab {
            Vocabulary::Target
        } else {
            // transformers scales by sqrt(H) cast to the embedding's dtype (62.0 for 3840 in bf16).
            Vocabulary::Own {
                embed_tokens: loader.linear("embed_tokens", v, h, false)?,
                embed_scale: Array::from_f32((h as f32).sqrt())
                    .as_dtype(loader.dtype)
                    .map_err(mlx_err("embedding scale"))?,
                lm_head: loader.linear("lm_head", v, h, false)?,
            }
        };
        Ok(DSparkModel {
            vocabulary,
            fc: loader.linear("fc", h, taps * h, false)?,
            hidden_norm: loader.float("hidden_norm.weight", &[h])?,
            norm: loader.float("norm.weight", &[h])?,
            layers,
            markov,
            confidence,
            dtype: loader.dtype,
            config,
        })
    }

    pub fn nbytes(&self) -> usize {
        let vocabulary = match &self.vocabulary {
            Vocabulary::Own {
                embed_tokens,
                lm_head,
                ..
            } => embed_tokens.nbytes() + lm_head.nbytes(),
            Vocabulary::Target => 0,
        };
        vocabulary
            + self.fc.nbytes()
            + self.hidden_norm.nbytes()
            + self.norm.nbytes()
            + self.layers.iter().map(DraftLayer::nbytes).sum::<usize>()
            + self
                .markov
                .as_ref()
                .map_or(0, |(w1, w2)| w1.nbytes() + w2.nbytes())
            + self.confidence.as_ref().map_or(0, |(p, _)| p.nbytes())
    }

    fn angles(&self, first_position: u64, rows: usize) -> Result<Angles, String> {
        let c = &self.config;
        Angles::new(
            c.rope_theta,
            c.partial_rotary_factor,
            c.head_dim,
            first_position,
            rows,
            self.dtype,
        )
    }

    /// The context projection `rms(fc(taps), hidden_norm)` of rows `[n, taps * H]`.
    pub fn project_context(&self, taps: &Array) -> Result<Array, String> {
        let taps = if taps.dtype() == self.dtype {
            taps.clone()
        } else {
            taps.as_dtype(self.dtype)
                .map_err(mlx_err("casting the taps"))?
        };
        rms_norm(
            &self.fc.forward(&taps)?,
            Some(&self.hidden_norm),
            self.config.rms_norm_eps,
        )
        .map_err(mlx_err("projecting the context"))
    }

    /// Appends the rows of the next positions (`context.rows()..`) to the context, from their
    /// taps `[n, taps * H]`; returns their projection (tests compare it).
    pub fn extend_context(&self, context: &mut Context, taps: &Array) -> Result<Array, String> {
        let e = mlx_err("extending the draft context");
        let projected = self.project_context(taps)?;
        let rows = projected.shape()[0] as usize;
        let angles = self.angles(context.rows as u64, rows)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let (k, v) = layer.keys_values(&projected, &angles)?;
            layers.push(match context.layers.get(i) {
                Some((kc, vc)) => (
                    concatenate(&[kc.clone(), k], 2).map_err(&e)?,
                    concatenate(&[vc.clone(), v], 2).map_err(&e)?,
                ),
                None => (k, v),
            });
        }
        context.layers = layers;
        context.rows += rows;
        Ok(projected)
    }

    /// The forward of the block `[anchor, mask, ..., mask]` at positions `context.rows()..`;
    /// `ports` are read only by a shared-vocabulary drafter.
    pub fn block(
        &self,
        context: &Context,
        anchor: u32,
        ports: &dyn TargetPorts,
    ) -> Result<BlockOutput, String> {
        let e = mlx_err("draft block");
        let c = &self.config;
        let b = c.block_size;
        let mut ids = vec![c.mask_token_id; b];
        ids[0] = anchor;
        let mut h = match &self.vocabulary {
            Vocabulary::Own {
                embed_tokens,
                embed_scale,
                ..
            } => {
                let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
                embed_tokens
                    .rows(&Array::from_slice(&ids, &[b as i32]))?
                    .multiply(embed_scale)
                    .map_err(&e)?
            }
            Vocabulary::Target => ports
                .embed(&ids)?
                .reshape(&[b as i32, c.hidden_size as i32])
                .and_then(|x| x.as_dtype(self.dtype))
                .map_err(&e)?,
        };
        let angles = self.angles(context.rows as u64, b)?;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, context.layers.get(i), &angles)?;
        }
        let hidden = rms_norm(&h, Some(&self.norm), c.rms_norm_eps).map_err(&e)?;
        let lm_head = match &self.vocabulary {
            Vocabulary::Own { lm_head, .. } => lm_head,
            // The target's port applies its own soft-cap.
            Vocabulary::Target => {
                return Ok(BlockOutput {
                    base_logits: ports.logits(&hidden)?,
                    hidden,
                })
            }
        };
        let mut base_logits = lm_head
            .forward(&hidden)?
            .as_dtype(Dtype::Float32)
            .map_err(&e)?;
        if let Some(cap) = c.softcap {
            let cap = Array::from_f32(cap);
            base_logits = base_logits
                .divide(&cap)
                .and_then(|z| tanh(&z))
                .and_then(|z| z.multiply(&cap))
                .map_err(&e)?;
        }
        Ok(BlockOutput {
            hidden,
            base_logits,
        })
    }

    /// The block's tokens left to right (each row's Markov bias reads the token before it),
    /// and the confidence of every row.
    pub fn choose(&self, out: &BlockOutput, anchor: u32, choice: Choice) -> Result<Block, String> {
        let e = mlx_err("choosing the block's tokens");
        let b = self.config.block_size as i32;
        let mut prev = Array::from_slice(&[anchor], &[1]);
        let (mut tokens, mut rows, mut probs, mut prevs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for k in 0..b {
            let mut z = out.base_logits.index(k..k + 1);
            let markov_row = match &self.markov {
                Some((w1, w2)) => {
                    let row = w1.rows(&prev)?;
                    let bias = w2.forward(&row)?.as_dtype(Dtype::Float32).map_err(&e)?;
                    z = z.add(bias).map_err(&e)?;
                    Some(row)
                }
                None => None,
            };
            prevs.push(markov_row);
            let token = match choice {
                Choice::Greedy => argmax_axis(&z, -1, false).map_err(&e)?,
                Choice::Sampled {
                    temperature,
                    seed,
                    first_index,
                } => {
                    let scaled = z.multiply(Array::from_f32(1.0 / temperature)).map_err(&e)?;
                    probs.push(softmax_axis(&scaled, -1, true).map_err(&e)?);
                    let key = random::key(draft_key(seed, first_index + k as u64)).map_err(&e)?;
                    random::categorical(&scaled, -1, None, &key).map_err(&e)?
                }
            }
            .as_dtype(Dtype::Uint32)
            .map_err(&e)?;
            rows.push(z);
            tokens.push(token.clone());
            prev = token;
        }
        let logits = concatenate(&rows, 0).map_err(&e)?;
        let tokens = concatenate(&tokens, 0).map_err(&e)?;
        let confidence_logits = match &self.confidence {
            Some((proj, with_markov)) => {
                let features = if *with_markov {
                    let table: Vec<Array> = prevs.into_iter().flatten().collect();
                    let table = concatenate(&table, 0)
                        .and_then(|t| t.as_dtype(out.hidden.dtype()))
                        .map_err(&e)?;
                    concatenate(&[out.hidden.clone(), table], -1).map_err(&e)?
                } else {
                    out.hidden.clone()
                };
                Some(
                    proj.forward(&features)?
                        .reshape(&[b])
                        .and_then(|z| z.as_dtype(Dtype::Float32))
                        .map_err(&e)?,
                )
            }
            None => None,
        };
        let confidence = match &confidence_logits {
            Some(z) => {
                let c = sigmoid(z).map_err(&e)?;
                c.eval().map_err(&e)?;
                c.as_slice::<f32>().to_vec()
            }
            None => Vec::new(),
        };
        tokens.eval().map_err(&e)?;
        Ok(Block {
            tokens: tokens.as_slice::<u32>().to_vec(),
            logits,
            probs: if probs.is_empty() {
                None
            } else {
                Some(concatenate(&probs, 0).map_err(&e)?)
            },
            confidence,
            confidence_logits,
        })
    }
}

/// How many of a block's tokens to propose: the rows before the first whose confidence is
/// below its threshold (`thresholds[k]`, the last one repeating; none or 0: no cut). May be 0.
pub fn confident_prefix(confidence: &[f32], thresholds: &[f32], block: usize) -> usize {
    if confidence.is_empty() || thresholds.is_empty() {
        return block;
    }
    for (k, &c) in confidence.iter().enumerate().take(block) {
        let t = thresholds[k.min(thresholds.len() - 1)];
        if t > 0.0 && c < t {
            return k;
        }
    }
    block
}

/// The random key of the draft at emitted index `index`: splitmix64 of the seed, a constant of
/// this drafter's own (never the host's verification coin) and the index.
pub fn draft_key(seed: u64, index: u64) -> u64 {
    const SALT: u64 = 0x6465_6570_7370_6563; // "deepspec"
    mlx_spec_plugin_api::draft_key(SALT, seed, index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_confident_prefix_stops_at_the_first_doubt() {
        let c = [0.9, 0.6, 0.2, 0.8];
        assert_eq!(confident_prefix(&c, &[], 4), 4, "no thresholds: no cut");
        assert_eq!(confident_prefix(&c, &[0.0], 4), 4, "0: no cut");
        assert_eq!(confident_prefix(&c, &[0.5], 4), 2);
        assert_eq!(confident_prefix(&c, &[0.95], 4), 0, "the empty proposal");
        assert_eq!(confident_prefix(&c, &[0.5, 0.7], 4), 1, "per position");
        assert_eq!(confident_prefix(&[], &[0.5], 4), 4, "no confidence head");
    }
}
