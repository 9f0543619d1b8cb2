//! Per-layer embeddings (E2B/E4B): a second token embedding, mixed with a projection of the
//! main embedding, gives every layer its own small input vector.

use super::norm::rms_norm;
use anyhow::Result;
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
    /// embedding `[T, hidden]`.
    pub fn inputs(&self, ids: &Array, embedded: &Array) -> Result<Array> {
        let t = ids.shape()[0];
        let shape = [t, self.num_layers, self.width];
        let from_table = self
            .table
            .lookup(ids)?
            .multiply(&self.table_scale)?
            .reshape(&shape)?;
        let projected = self
            .model_projection
            .forward(embedded)?
            .multiply(&self.projection_scale)?
            .reshape(&shape)?;
        let projected = rms_norm(&projected, Some(&self.projection_norm), self.eps)?;
        Ok(projected.add(&from_table)?.multiply(&self.mix_scale)?)
    }
}
