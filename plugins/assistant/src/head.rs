//! The output heads: the drafter's OWN `model.embed_tokens` (d wide, unscaled, tied), never
//! the target's LM head, and no final soft-cap.
//!
//! * Dense (12B/26B/31B): `logits = E · z` over the whole vocabulary.
//! * Centroid (E2B/E4B, "ordered embeddings"): score `num_centroids` cluster centres, keep
//!   the best `top_k` clusters, and score only their tokens (`token_ordering` viewed as
//!   `[num_centroids, vocab / num_centroids]` lists each cluster's tokens). transformers fills
//!   every other logit with `min(candidate scores) − 1`; the draft token is the best candidate,
//!   so drafting never builds the full vector ([`Head::token`]), only [`Head::logits`] does.
//!
//! Which head a checkpoint has is decided by the presence of
//! `masked_embedding.centroids.weight`, not by the config flag alone: a config that says
//! "centroids" without the tensors would otherwise draft from absent weights.

use mlx_spec_plugin_api::mlx_rs::ops::indexing::argmax_axis;
use mlx_spec_plugin_api::mlx_rs::ops::{argpartition_axis, full, matmul};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

use crate::checkpoint::Checkpoint;
use crate::config::AssistantConfig;
use crate::linear::{mlx_err, Linear, Loader};

pub const CENTROIDS: &str = "masked_embedding.centroids";
pub const TOKEN_ORDERING: &str = "masked_embedding.token_ordering";

pub enum Head {
    Dense {
        table: Linear,
    },
    Centroid {
        table: Linear,
        centroids: Linear,
        /// `[num_centroids, vocab / num_centroids]` int32: each cluster's tokens.
        ordering: Array,
        top_k: i32,
    },
}

impl Head {
    pub fn load(cfg: &AssistantConfig, w: &Loader) -> Result<Self, String> {
        let (vocab, d) = (cfg.vocab_size, cfg.hidden_size);
        let table = w.linear("model.embed_tokens", vocab, d)?;
        let has_centroids = w.checkpoint.contains(&format!("{CENTROIDS}.weight"));
        if !has_centroids {
            if cfg.declares_centroid_head {
                return Err(format!(
                    "config.json declares the centroid head (use_ordered_embeddings) but {CENTROIDS}.weight is missing from {}",
                    w.checkpoint.file_of("")
                ));
            }
            return Ok(Head::Dense { table });
        }
        let nc = cfg.num_centroids;
        if nc == 0 || vocab % nc != 0 {
            return Err(format!(
                "num_centroids {nc} does not divide the vocabulary {vocab}"
            ));
        }
        if cfg.centroid_top_k == 0 || cfg.centroid_top_k > nc {
            return Err(format!(
                "centroid_intermediate_top_k {} must be in 1..={nc}",
                cfg.centroid_top_k
            ));
        }
        let centroids = w.linear(CENTROIDS, nc, d)?;
        let ordering = read_ordering(w.checkpoint, vocab)?
            .reshape(&[nc as i32, (vocab / nc) as i32])
            .map_err(mlx_err("token ordering"))?;
        Ok(Head::Centroid {
            table,
            centroids,
            ordering,
            top_k: cfg.centroid_top_k as i32,
        })
    }

    pub fn is_centroid(&self) -> bool {
        matches!(self, Head::Centroid { .. })
    }

    /// The greedy draft token for `z` (`[1, d]`), as a uint32 scalar array (lazy).
    pub fn token(&self, z: &Array) -> Result<Array, String> {
        let e = mlx_err("draft token");
        match self {
            Head::Dense { table } => {
                argmax_axis(table.forward(z)?.reshape(&[-1]).map_err(&e)?, 0, false).map_err(e)
            }
            Head::Centroid { .. } => {
                let (candidates, scores) = self.candidates(z)?;
                let best = argmax_axis(&scores, 0, false).map_err(&e)?;
                candidates
                    .take(&best)
                    .and_then(|t| t.as_dtype(Dtype::Uint32))
                    .map_err(e)
            }
        }
    }

    /// Logits over the whole vocabulary, float32 `[vocab]`, as transformers returns them.
    pub fn logits(&self, z: &Array) -> Result<Array, String> {
        let e = mlx_err("draft logits");
        match self {
            Head::Dense { table } => table
                .forward(z)
                .and_then(|l| l.reshape(&[-1]).map_err(&e))
                .and_then(|l| l.as_dtype(Dtype::Float32).map_err(&e)),
            Head::Centroid { table, .. } => {
                let vocab = match table {
                    Linear::Dense { weight, .. } => weight.shape()[0],
                    Linear::Quantized(q) => q.packed.shape()[0],
                };
                let (candidates, scores) = self.candidates(z)?;
                let scores = scores.as_dtype(Dtype::Float32).map_err(&e)?;
                let fill = scores
                    .min(false)
                    .and_then(|m| m.subtract(Array::from_f32(1.0)))
                    .map_err(&e)?;
                full::<f32>(&[vocab], &fill)
                    .and_then(|f| f.put_along_axis(&candidates, &scores, 0))
                    .map_err(e)
            }
        }
    }

    /// The candidate tokens of the best clusters and their scores (`[top_k * per_cluster]`).
    fn candidates(&self, z: &Array) -> Result<(Array, Array), String> {
        let Head::Centroid {
            table,
            centroids,
            ordering,
            top_k,
        } = self
        else {
            return Err("not a centroid head".to_owned());
        };
        let e = mlx_err("centroid head");
        let cluster_scores = centroids.forward(z)?.reshape(&[-1]).map_err(&e)?;
        // The `top_k` largest scores: partition the negated scores and keep the first k.
        let nc = cluster_scores.shape()[0];
        let best = argpartition_axis(cluster_scores.negative().map_err(&e)?, top_k - 1, 0)
            .and_then(|i| i.split_at_indices(&[*top_k], 0))
            .map_err(&e)?
            .swap_remove(0);
        debug_assert!(*top_k <= nc);
        let candidates = ordering
            .take_axis(&best, 0)
            .and_then(|c| c.reshape(&[-1]))
            .map_err(&e)?;
        let rows = table.rows(&candidates)?;
        let scores = matmul(&rows, z.reshape(&[-1, 1]).map_err(&e)?)
            .and_then(|s| s.reshape(&[-1]))
            .map_err(&e)?;
        Ok((candidates, scores))
    }

    pub fn nbytes(&self) -> usize {
        match self {
            Head::Dense { table } => table.nbytes(),
            Head::Centroid {
                table,
                centroids,
                ordering,
                ..
            } => table.nbytes() + centroids.nbytes() + ordering.nbytes(),
        }
    }
}

/// `masked_embedding.token_ordering` as int32 `[vocab]` (int64 in transformers' files, int32
/// after mlx-vlm), checked to be a permutation of the vocabulary: a bad id would read outside
/// the embedding table.
fn read_ordering(checkpoint: &Checkpoint, vocab: usize) -> Result<Array, String> {
    let raw = checkpoint.tensor(TOKEN_ORDERING, &[vocab])?;
    let file = checkpoint.file_of(TOKEN_ORDERING);
    if !matches!(raw.dtype(), Dtype::Int64 | Dtype::Int32 | Dtype::Uint32) {
        return Err(format!(
            "tensor {TOKEN_ORDERING} in {file}: expected integer ids, found {:?}",
            raw.dtype()
        ));
    }
    let wide = raw
        .as_dtype(Dtype::Int64)
        .map_err(mlx_err("token ordering"))?;
    let ids: Vec<i64> = wide
        .try_as_slice::<i64>()
        .map_err(|e| format!("tensor {TOKEN_ORDERING} in {file}: {e}"))?
        .to_vec();
    let mut seen = vec![false; vocab];
    for &id in &ids {
        let slot = usize::try_from(id)
            .ok()
            .and_then(|i| seen.get_mut(i))
            .ok_or_else(|| {
                format!("tensor {TOKEN_ORDERING} in {file}: id {id} is outside the vocabulary of {vocab}")
            })?;
        if *slot {
            return Err(format!(
                "tensor {TOKEN_ORDERING} in {file}: id {id} appears twice (not a permutation)"
            ));
        }
        *slot = true;
    }
    let ids: Vec<i32> = ids.into_iter().map(|x| x as i32).collect();
    Ok(Array::from_slice(&ids, &[vocab as i32]))
}
