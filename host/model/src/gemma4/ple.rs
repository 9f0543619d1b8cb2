//! Per-layer embeddings (E2B/E4B): a second token embedding, mixed with a projection of the
//! main embedding, gives every layer its own small input vector.

use super::norm::rms_norm;
use anyhow::Result;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::linear::{Embedding, Linear, Loader};
use super::scalar;

pub struct PerLayerEmbeddings {
    num_layers: i32,
    width: i32,
    eps: f32,
    table: Embedding,
    model_projection: Linear,
    projection_norm: Array,
    table_scale: Array,
    projection_scale: Array,
    mix_scale: Array,
}

impl PerLayerEmbeddings {
    pub fn load(
        w: &Loader,
        hidden: usize,
        layers: usize,
        width: usize,
        vocab: usize,
        eps: f32,
    ) -> Result<Self> {
        Ok(PerLayerEmbeddings {
            num_layers: layers as i32,
            width: width as i32,
            eps,
            table: w.embedding("embed_tokens_per_layer", vocab, layers * width)?,
            model_projection: w.linear("per_layer_model_projection", layers * width, hidden)?,
            projection_norm: w.tensor("per_layer_projection_norm.weight", &[width])?,
            table_scale: scalar((width as f32).sqrt(), w.dtype)?,
            projection_scale: scalar((hidden as f32).powf(-0.5), w.dtype)?,
            mix_scale: scalar(0.5f32.sqrt(), w.dtype)?,
        })
    }

    /// Bytes of the per-layer embedding table, of which a token reads only its own row.
    pub fn table_nbytes(&self) -> usize {
        self.table.0.nbytes()
    }

    /// `[T, layers, width]` inputs for every layer, from token ids `[T]` and the scaled main
    /// embedding `[T, hidden]`. `row_by_row`: the projection made one token at a time, so that
    /// each token's values are those of a forward of that token alone (a matrix product over
    /// several rows may sum in another order than one over a single row).
    pub fn inputs(&self, ids: &Array, embedded: &Array, row_by_row: bool) -> Result<Array> {
        let t = ids.shape()[0];
        let shape = [t, self.num_layers, self.width];
        let from_table = self
            .table
            .lookup(ids)?
            .multiply(&self.table_scale)?
            .reshape(&shape)?;
        let projected = if row_by_row && t > 1 {
            let rows = (0..t)
                .map(|i| self.model_projection.forward(&embedded.index(i..i + 1)))
                .collect::<Result<Vec<_>>>()?;
            concatenate(&rows, 0)?
        } else {
            self.model_projection.forward(embedded)?
        };
        let projected = projected
            .multiply(&self.projection_scale)?
            .reshape(&shape)?;
        let projected = rms_norm(&projected, Some(&self.projection_norm), self.eps)?;
        Ok(projected.add(&from_table)?.multiply(&self.mix_scale)?)
    }
}
