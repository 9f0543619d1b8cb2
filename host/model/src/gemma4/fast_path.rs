//! The boundary between Gemma 4's math and a faster way to run it on one device.
//!
//! The files of this module compute every block with MLX operations, and that is the whole
//! model on every device. A fast path, chosen once at load for the device (on a CUDA GPU,
//! mlx-spec's fused kernels: `CudaDecode` of the `mlx-spec-kernels` crate), runs the layers
//! and the output head of a forward in its own way, with the same values as the blocks here
//! up to the rounding of a different summation order, and exactly the same values for a verify window
//! as for the decode steps it replaces (the verify loop's lossless greedy output depends on
//! that). The model asks it at four points and knows nothing else of it.

use anyhow::Result;
use mlx_rs::Array;

use super::cache::{KvView, LayerKv};
use super::layer::DecoderLayer;
use super::Gemma4Model;

/// One layer's call in a forward: its input, where its tokens sit, its cache and the donor's
/// view for a KV-sharing layer, and the per-layer inputs of every layer (`[T, layers, P]`).
pub struct LayerCall<'a> {
    pub x: &'a Array,
    pub offset: usize,
    pub cache: Option<&'a mut LayerKv>,
    pub shared: Option<&'a KvView>,
    pub per_layer: Option<&'a Array>,
}

pub trait FastPath: Send {
    /// Runs `layer` as [`DecoderLayer::forward`] does: the new hidden state, and for a
    /// KV-owning layer the view its sharers read. Parts it has no faster way for run through
    /// the layer's own blocks.
    fn layer(&self, layer: &DecoderLayer, call: LayerCall<'_>) -> Result<(Array, Option<KvView>)>;

    /// The soft-capped logits of the last layer's output `x` (`[T, hidden]`), when this path
    /// has a faster way for them (`window`: `x` is a verify window this path takes whole);
    /// `None` leaves them to [`Gemma4Model::logits_from_hidden`].
    fn logits(&self, model: &Gemma4Model, x: &Array, window: bool) -> Result<Option<Array>>;

    /// The longest verify window a forward runs whole, where this path computes each of its
    /// tokens exactly as a decode step (see [`Gemma4Model::verify_window_limit`]); `None`
    /// when a window of any length runs whole.
    fn verify_window_limit(&self, model: &Gemma4Model) -> Option<usize>;

    /// Called before the caller evaluates what a forward built (a fast path that compiles
    /// its kernels beside the graph building waits for them here).
    fn before_evaluation(&self) {}
}
