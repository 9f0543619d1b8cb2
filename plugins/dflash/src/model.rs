//! The whole drafter: the context it keeps, one block forward, and the choice of the block's
//! tokens.
//!
//! ```text
//! context row (per verified position): c = rms(fc(concat(taps)), hidden_norm)
//!                                       each layer keeps rope(rms(k_proj c, k_norm)), v_proj c
//! block at anchor position P:           h = target.embed([anchor, mask, ..., mask])   (E[t] sqrt(H))
//!                                       h = layers(h) at positions P..P+B-1;  hB = rms(h, norm)
//! row j >= 1 predicts the token at P+j: logits_j = target.logits_from_hidden(hB_j)
//!                                       draft j = argmax (or drawn from softmax(logits_j / T))
//! ```
//!
//! The drafter has no embedding and no LM head of its own: z-lab's checkpoints use the
//! target's, here through the host's ports. The anchor's row predicts nothing (its token is
//! known); each mask row predicts the token at its own position, so a block of B drafts B-1.

use std::path::Path;

use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::fast::rms_norm;
use mlx_spec_plugin_api::mlx_rs::ops::concatenate;
use mlx_spec_plugin_api::mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_spec_plugin_api::mlx_rs::ops::softmax_axis;
use mlx_spec_plugin_api::mlx_rs::{random, Array, Dtype};

use crate::config::DFlashConfig;
use crate::layer::DraftLayer;
use crate::linear::{is_float, mlx_err, Linear, Loader};
use crate::rope::Angles;

/// The target's ports the drafter reads: embeddings `[.., rows, H]` as the target's first
/// layer reads them (Gemma's scaled by sqrt(H)), and float32 logits `[rows, V]` of final
/// hidden states (tied head and soft-cap).
pub trait TargetPorts {
    fn embed(&self, ids: &[u32]) -> Result<Array, String>;
    fn logits(&self, hidden: &Array) -> Result<Array, String>;
}

pub struct DFlashModel {
    pub config: DFlashConfig,
    pub dtype: Dtype,
    fc: Linear,
    hidden_norm: Array,
    layers: Vec<DraftLayer>,
    norm: Array,
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

    /// Layer `i`'s keys and values `[1, kv_heads, rows, D]`.
    pub fn layer(&self, i: usize) -> Option<&(Array, Array)> {
        self.layers.get(i)
    }
}

/// One block's forward, lazy until read.
pub struct BlockOutput {
    /// `hB`, all B rows, `[B, H]`.
    pub hidden: Array,
    /// Float32 logits of rows 1..B-1, `[B-1, V]`: row j-1 predicts the token at P+j.
    pub logits: Array,
}

/// How a block's tokens are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    Greedy,
    /// Drawn from `softmax(logits / temperature)` with a key from the seed and the token's
    /// emitted index; the distributions go with the proposal.
    Sampled {
        temperature: f32,
        seed: u64,
        first_index: u64,
    },
}

/// A block's B-1 drafted tokens.
pub struct Block {
    pub tokens: Vec<u32>,
    /// With [`Choice::Sampled`]: `softmax(logits / T)`, `[B-1, V]`.
    pub probs: Option<Array>,
}

impl DFlashModel {
    /// Loads `config.json` and the weights of a checkpoint folder; `dtype`: the compute dtype,
    /// or `None` for the checkpoint's own float dtype.
    pub fn load(dir: &Path, dtype: Option<Dtype>) -> Result<Self, String> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            format!(
                "cannot read {}: {e} (set the drafter's `checkpoint` to a z-lab DFlash checkpoint folder)",
                config_path.display()
            )
        })?;
        let config = DFlashConfig::parse(&text, &config_path.display().to_string())?;
        Self::with_config(dir, config, dtype)
    }

    /// Loads the weights of `dir` for an already parsed (possibly altered) config.
    pub fn with_config(
        dir: &Path,
        config: DFlashConfig,
        dtype: Option<Dtype>,
    ) -> Result<Self, String> {
        let checkpoint = Checkpoint::open_dir(dir)?;
        let stored = checkpoint
            .dtype("norm.weight")
            .filter(|d| is_float(*d))
            .unwrap_or(Dtype::Float32);
        let loader = Loader {
            checkpoint: &checkpoint,
            dtype: dtype.unwrap_or(stored),
            quant: &config.quantization,
        };
        let h = config.hidden_size;
        let taps = config.target_layer_ids.len();
        let layers = (0..config.num_layers)
            .map(|i| DraftLayer::load(&config, i, &loader))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DFlashModel {
            fc: loader.linear("fc", h, taps * h, false)?,
            hidden_norm: loader.float("hidden_norm.weight", &[h])?,
            norm: loader.float("norm.weight", &[h])?,
            layers,
            dtype: loader.dtype,
            config,
        })
    }

    pub fn nbytes(&self) -> usize {
        self.fc.nbytes()
            + self.hidden_norm.nbytes()
            + self.norm.nbytes()
            + self.layers.iter().map(DraftLayer::nbytes).sum::<usize>()
    }

    fn angles(&self, first_position: usize, rows: usize) -> Result<Angles, String> {
        let c = &self.config;
        Angles::new(
            c.rope_theta,
            c.head_dim,
            first_position as u64,
            rows,
            self.dtype,
        )
    }

    /// The context projection `rms(fc(taps), hidden_norm)` of rows `[n, taps * H]`.
    pub fn project_context(&self, taps: &Array) -> Result<Array, String> {
        let taps = taps
            .as_dtype(self.dtype)
            .map_err(mlx_err("casting the taps"))?;
        rms_norm(
            &self.fc.forward(&taps)?,
            Some(&self.hidden_norm),
            self.config.rms_norm_eps,
        )
        .map_err(mlx_err("projecting the context"))
    }

    /// Appends the rows of the next positions (`context.rows()..`) to the context, from their
    /// taps `[n, taps * H]`. Only verified positions arrive, so the context is never trimmed.
    pub fn extend_context(&self, context: &mut Context, taps: &Array) -> Result<(), String> {
        let e = mlx_err("extending the draft context");
        let projected = self.project_context(taps)?;
        let rows = projected.shape()[0] as usize;
        let angles = self.angles(context.rows, rows)?;
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
        Ok(())
    }

    /// The forward of the block `[anchor, mask, ..., mask]` at positions `context.rows()..`.
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
        let mut h = ports
            .embed(&ids)?
            .reshape(&[b as i32, c.hidden_size as i32])
            .and_then(|x| x.as_dtype(self.dtype))
            .map_err(&e)?;
        let p = context.rows;
        let angles = self.angles(p, b)?;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, context.layers.get(i), p, &angles)?;
        }
        let hidden = rms_norm(&h, Some(&self.norm), c.rms_norm_eps).map_err(&e)?;
        let logits = ports
            .logits(&hidden.index(1..))?
            .as_dtype(Dtype::Float32)
            .map_err(&e)?;
        Ok(BlockOutput { hidden, logits })
    }

    /// The block's B-1 tokens, each row on its own (no row reads another's token).
    pub fn choose(&self, out: &BlockOutput, choice: Choice) -> Result<Block, String> {
        let e = mlx_err("choosing the block's tokens");
        let (tokens, probs) = match choice {
            Choice::Greedy => (argmax_axis(&out.logits, -1, false).map_err(&e)?, None),
            Choice::Sampled {
                temperature,
                seed,
                first_index,
            } => {
                let scaled = out
                    .logits
                    .multiply(Array::from_f32(1.0 / temperature))
                    .map_err(&e)?;
                let rows = scaled.shape()[0];
                let mut drawn = Vec::with_capacity(rows as usize);
                for j in 0..rows {
                    let key = random::key(draft_key(seed, first_index + j as u64)).map_err(&e)?;
                    drawn.push(
                        random::categorical(scaled.index(j..j + 1), -1, None, &key).map_err(&e)?,
                    );
                }
                (
                    concatenate(&drawn, 0).map_err(&e)?,
                    Some(softmax_axis(&scaled, -1, true).map_err(&e)?),
                )
            }
        };
        let tokens = tokens.as_dtype(Dtype::Uint32).map_err(&e)?;
        tokens.eval().map_err(&e)?;
        Ok(Block {
            tokens: tokens.as_slice::<u32>().to_vec(),
            probs,
        })
    }
}

/// The random key of the draft at emitted index `index`: splitmix64 of the seed, a constant of
/// this drafter's own (never the host's verification coin) and the index.
pub fn draft_key(seed: u64, index: u64) -> u64 {
    const SALT: u64 = 0x0064_666c_6173_6821; // "dflash!"
    mlx_spec_plugin_api::draft_key(SALT, seed, index)
}

#[cfg(test)]
mod tests {
    use super::draft_key;

    #[test]
    fn draft_keys_differ_by_seed_and_index() {
        assert_ne!(draft_key(1, 0), draft_key(1, 1));
        assert_ne!(draft_key(1, 0), draft_key(2, 0));
        assert_eq!(draft_key(7, 3), draft_key(7, 3));
    }
}
