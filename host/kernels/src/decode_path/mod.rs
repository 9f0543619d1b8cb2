//! [`CudaDecode`]: the model's fast path on a CUDA GPU, mlx-spec's fused kernels in place of
//! chains of MLX operations ([`mlx_spec_model::gemma4::FastPath`]).
//!
//! The model's files hold Gemma 4's math; this module decides, call by call, which of that
//! math runs as a fused kernel: every route the kernels take and the conditions they serve
//! under, with the per-layer state they keep on the device (completion counters, barrier
//! state, small arrays the kernels read in device memory). Whatever a kernel does not serve
//! runs through the model's own blocks, so one forward may mix both.
//!
//! * [`attention`]: a layer's attention heads, the cache write and the decode attention;
//! * [`layer`]: everything of a layer after its heads (one kernel, or the products fused
//!   with their norms and residual updates);
//! * this file: construction, the output head, and the longest verify window whose tokens
//!   the window kernels compute exactly as decode steps.

mod attention;
mod layer;

use anyhow::Result;
use mlx_rs::Array;

use super::post_attention::{self, Weight};
use super::products::{device_array, new_counter, new_counters};
use super::{kernel_cache, output_head, window_attention_heads, window_output_head, Fused};
use mlx_spec_model::gemma4::attention::Attention;
use mlx_spec_model::gemma4::cache::KvView;
use mlx_spec_model::gemma4::layer::DecoderLayer;
use mlx_spec_model::gemma4::linear::Linear;
use mlx_spec_model::gemma4::{FastPath, Gemma4Model, LayerCall};

/// What one layer's kernels keep in device memory between calls.
struct LayerState {
    /// Completion counter of the attention-heads kernel (device memory).
    heads_counter: Array,
    /// Block counters of decode attention (device memory).
    attention_counters: Array,
    /// The same two for windows of several tokens (one attention counter per head and token).
    window_heads_counter: Array,
    window_attention_counters: Array,
    /// The RoPE periods made by an operation on the device: device memory, which the kernels
    /// read without crossing the bus (MLX keeps arrays made from host data in host-visible
    /// memory).
    rope_periods: Array,
    /// The layer scalar, first in a small array in device memory.
    layer_scalar: Array,
    /// Where this layer's inputs start in the `[1, layers, width]` per-layer inputs (int32,
    /// in device memory), for the fused gate.
    per_layer_offset: Option<Array>,
    /// One counter per fused closing product (attention, feed-forward, per-layer input): see
    /// [`super::products::new_counter`].
    counters: [Array; 3],
    /// The barrier state of the one-kernel post-attention path
    /// ([`post_attention::new_barrier`]).
    post_attention_barrier: Array,
    /// The barrier state of the one-kernel path for windows of several tokens.
    window_barrier: Array,
}

impl LayerState {
    fn new(layer: &DecoderLayer, per_layer_width: usize) -> Result<Self> {
        let att: &Attention = &layer.attention;
        let (heads, kv_heads) = (att.num_heads as usize, att.num_kv_heads as usize);
        let periods = att.rope.periods();
        let rope_periods = device_array(periods, periods.size() as i32).unwrap_or(periods.clone());
        Ok(LayerState {
            // One per head whose rows the attention-heads kernel makes: queries, keys, values.
            heads_counter: new_counters(heads + 2 * kv_heads)?,
            attention_counters: new_counters(heads)?,
            // One per head too, for the window kernel's heads finished apart.
            window_heads_counter: new_counters(heads + 2 * kv_heads)?,
            window_attention_counters: new_counters(heads * window_attention_heads::MAX_TOKENS)?,
            rope_periods,
            layer_scalar: device_array(&layer.layer_scalar_value, 8)?,
            per_layer_offset: match &layer.ple {
                Some(_) => Some(device_array(
                    &Array::from_slice(&[(layer.index * per_layer_width) as i32], &[1]),
                    4,
                )?),
                None => None,
            },
            counters: [new_counter()?, new_counter()?, new_counter()?],
            post_attention_barrier: post_attention::new_barrier()?,
            window_barrier: post_attention::new_barrier()?,
        })
    }
}

/// The fused kernels as a model's fast path (install it with
/// [`Gemma4Model::set_fast_path`]; `mlx_spec::load` does on a CUDA GPU).
pub struct CudaDecode {
    kernels: Fused,
    layers: Vec<LayerState>,
    /// [`CudaDecode::largest_exact_window`], worked out at first use (while the lab records
    /// kernel sources, the grid is an H200's: `super::capture_kernels`).
    largest_window: std::sync::OnceLock<usize>,
}

impl CudaDecode {
    /// The kernels `kernels` allows, for `model`'s weights.
    pub fn new(model: &Gemma4Model, kernels: Fused) -> Result<Self> {
        let width = model.config.per_layer_input_size;
        let layers = model
            .layers()
            .iter()
            .map(|l| LayerState::new(l, width))
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaDecode {
            kernels,
            layers,
            largest_window: std::sync::OnceLock::new(),
        })
    }

    /// The most tokens a window may hold for the window kernels to take all of the model
    /// (every layer, and the head): 2-8 for dense or 4-bit weights of the shapes they take, 1
    /// where they take any part of it not (an MoE branch, other bit widths). Windows longer
    /// than this run in parts on a GPU (`Gemma4Model::forward_in_windows`).
    pub fn largest_exact_window(&self, model: &Gemma4Model) -> usize {
        *self
            .largest_window
            .get_or_init(|| largest_exact_window(model))
    }
}

/// See [`CudaDecode::largest_exact_window`].
fn largest_exact_window(model: &Gemma4Model) -> usize {
    let hidden = model.config.hidden_size;
    let head_served = kernel_weight(model.head())
        .is_some_and(|w| w.layout(w.rows(), hidden as i32, model.dtype, "").is_ok())
        && super::products::serves(hidden, model.dtype);
    if !head_served {
        return 1;
    }
    model
        .layers()
        .iter()
        .map(|l| layer::largest_window(l, model.dtype))
        .min()
        .unwrap_or(1)
}

impl FastPath for CudaDecode {
    fn layer(&self, layer: &DecoderLayer, call: LayerCall<'_>) -> Result<(Array, Option<KvView>)> {
        self.layer_forward(layer, &self.layers[layer.index], call)
    }

    /// A decode token ([`output_head`]), or a window the window kernels take whole
    /// ([`window_output_head`]): the final norm, the head's product and the soft-cap as one
    /// kernel.
    fn logits(&self, model: &Gemma4Model, x: &Array, window: bool) -> Result<Option<Array>> {
        if !self.kernels.output_head {
            return Ok(None);
        }
        let Some(weight) = kernel_weight(model.head()) else {
            return Ok(None);
        };
        let (norm, eps, cap) = (
            model.final_norm(),
            model.config.rms_norm_eps,
            model.config.final_logit_softcapping,
        );
        Ok(
            if x.shape()[0] == 1 && output_head::serves_head(x, &weight) {
                Some(output_head::output_head(x, norm, eps, weight, cap)?)
            } else if window && window_output_head::serves_head(x, &weight) {
                Some(window_output_head::window_output_head(
                    x, norm, eps, weight, cap,
                )?)
            } else {
                None
            },
        )
    }

    /// With the window kernels on, the longest window they take for this model; 1 where they
    /// take none (an MoE branch, weights of other bit widths), where decode steps do not run
    /// the single-token kernels whose values they give (a kernel set without them), or where
    /// no grid-wide barrier is safe (a GPU shared through MPS). `None` with the window kernels
    /// off: MLX's operations take a window of any length.
    fn verify_window_limit(&self, model: &Gemma4Model) -> Option<usize> {
        let fused = self.kernels;
        if !fused.window {
            return None;
        }
        // The single-token kernels a window kernel matches: the heads, decode attention and
        // the head for every layout; after the heads, the post-attention kernel for dense
        // layers and its 4-bit form (with the 4-bit heads) for quantized ones.
        let dense = model.layers().iter().any(layer::is_dense);
        let quantized = model.layers().iter().any(|l| !layer::is_dense(l));
        let matched = fused.attention
            && fused.products
            && fused.output_head
            && (!dense || fused.post_attention)
            && (!quantized || (fused.affine4 && fused.affine4_heads));
        Some(if matched && post_attention::grid_blocks().is_some() {
            self.largest_exact_window(model)
        } else {
            1
        })
    }

    /// Kernels met for the first time on this machine compile beside the graph building;
    /// MLX must find them compiled when the caller evaluates the result.
    fn before_evaluation(&self) {
        kernel_cache::wait_for_compiles();
    }
}

/// The `[out, in]` weight of a dense matrix (what the fused products read).
fn dense_weight(linear: &Linear) -> Option<&Array> {
    match linear {
        Linear::Dense(d) => Some(&d.weight),
        Linear::Quantized(_) => None,
    }
}

/// The matrix as the fused post-attention kernel reads it: dense, or 4-bit affine (`None` for
/// other bit widths).
fn kernel_weight(linear: &Linear) -> Option<Weight<'_>> {
    match linear {
        Linear::Dense(d) => Some(Weight::Dense(&d.weight)),
        Linear::Quantized(q) if q.spec.bits == 4 => Some(Weight::Affine4 {
            packed: &q.packed,
            scales: &q.scales,
            biases: &q.biases,
        }),
        Linear::Quantized(_) => None,
    }
}

/// The matrix as the fused product kernels read it for an input `x` (`[1, K]`): dense, or
/// 4-bit affine in a group size they take when `fused.affine4_products` allows it; `None`
/// otherwise (MLX's product runs).
fn product_weight<'a>(linear: &'a Linear, x: &Array, fused: Fused) -> Option<Weight<'a>> {
    let weight = kernel_weight(linear)?;
    if weight.is_dense() {
        return Some(weight);
    }
    // The flag first: this runs for every product of every step.
    if !fused.affine4_products {
        return None;
    }
    let k = x.shape()[x.ndim() - 1];
    weight
        .layout(weight.rows(), k, x.dtype(), "")
        .is_ok()
        .then_some(weight)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Dtype;
    use mlx_spec_model::gemma4::config::QuantSpec;
    use mlx_spec_model::gemma4::linear::Quantized;

    #[test]
    fn a_4bit_matrix_goes_to_the_fused_products_only_when_allowed_and_fitting() {
        // [16, 64] in 4 bits, groups of 32.
        let linear = Linear::Quantized(Quantized {
            packed: Array::zeros::<u32>(&[16, 8]).unwrap(),
            scales: Array::zeros::<f32>(&[16, 2]).unwrap(),
            biases: Array::zeros::<f32>(&[16, 2]).unwrap(),
            spec: QuantSpec {
                group_size: 32,
                bits: 4,
            },
        });
        let x = Array::zeros::<f32>(&[1, 64]).unwrap();
        let mut fused = Fused {
            products: true,
            ..Fused::default()
        };
        assert!(product_weight(&linear, &x, fused).is_none(), "not allowed");
        fused.affine4_products = true;
        assert!(product_weight(&linear, &x, fused).is_some());
        let wrong_width = Array::zeros::<f32>(&[1, 128]).unwrap();
        assert!(product_weight(&linear, &wrong_width, fused).is_none());
        let other_dtype = Array::zeros::<f32>(&[1, 64])
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        assert!(
            product_weight(&linear, &other_dtype, fused).is_none(),
            "scales of another dtype"
        );
    }
}
