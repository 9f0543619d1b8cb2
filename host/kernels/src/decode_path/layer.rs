//! A decoder layer on the fast path: its attention ([`super::attention`]), then everything
//! after the heads as one kernel ([`post_attention`], [`window_post_attention`]) where that
//! serves the call, else each product fused with the norms and residual update around it
//! ([`super::super::products`]), else the layer's own blocks.

use anyhow::Result;
use mlx_rs::Array;

use super::{kernel_weight, product_weight, CudaDecode, LayerState};
use crate::post_attention::{self, post_attention, PerLayerInput, PostAttention};
use crate::products::{gated_product, product_residual, serves_token, GateUp};
use crate::window_post_attention::{self, window_post_attention};
use crate::window_products::{self, window_gated_product, window_product_residual};
use mlx_spec_model::gemma4::cache::KvView;
use mlx_spec_model::gemma4::layer::{DecoderLayer, PleGate};
use mlx_spec_model::gemma4::linear::Linear;
use mlx_spec_model::gemma4::LayerCall;

impl CudaDecode {
    /// [`DecoderLayer::forward`] with the fused kernels.
    pub(super) fn layer_forward(
        &self,
        layer: &DecoderLayer,
        state: &LayerState,
        call: LayerCall<'_>,
    ) -> Result<(Array, Option<KvView>)> {
        let LayerCall {
            x,
            offset,
            cache,
            shared,
            per_layer,
        } = call;
        let (attn, view) = self.attention(layer, state, x, offset, cache, shared)?;
        if let Some(out) = self.one_kernel_after_attention(layer, state, x, &attn, per_layer)? {
            return Ok((out, view));
        }
        if let Some(out) = self.window_products_after_attention(layer, state, x, &attn)? {
            return Ok((out, view));
        }
        let x = self.closing_product(
            layer,
            state,
            x,
            &attn,
            layer.attention.o_proj(),
            &layer.post_attention_norm,
            false,
            &state.counters[0],
        )?;

        let gated = layer.ple.as_ref().zip(per_layer);
        let act = self.activation(layer, &x)?;
        let x = match &layer.moe {
            None => self.closing_product(
                layer,
                state,
                &x,
                &act,
                layer.mlp.down_proj(),
                &layer.post_feedforward_norm,
                gated.is_none(),
                &state.counters[1],
            )?,
            Some(moe) => layer.moe_feed_forward(moe, &x, &act, gated.is_none())?,
        };

        if let Some((gate, per_layer)) = gated {
            let g = self.per_layer_gate(layer, state, gate, &x, per_layer)?;
            let out = self.closing_product(
                layer,
                state,
                &x,
                &g,
                &gate.projection,
                &gate.post_norm,
                true,
                &state.counters[2],
            )?;
            return Ok((out, view));
        }
        Ok((x, view))
    }

    /// `x + rms_norm(proj(a), w)` (times the layer scalar when `last`): the product that
    /// closes a block, with its residual update. One kernel for a single token with
    /// `products` (over a dense weight, or a 4-bit one with `affine4_products`); `counter` is
    /// the call site's.
    #[allow(clippy::too_many_arguments)]
    fn closing_product(
        &self,
        layer: &DecoderLayer,
        state: &LayerState,
        x: &Array,
        a: &Array,
        proj: &Linear,
        w: &Array,
        last: bool,
        counter: &Array,
    ) -> Result<Array> {
        if serves_token(self.kernels, a) {
            if let Some(weight) = product_weight(proj, a, self.kernels) {
                let scale = last.then_some(&state.layer_scalar);
                return product_residual(a, weight, x, w, layer.eps, scale, counter);
            }
        }
        layer.residual(x, &proj.forward(a)?, w, last)
    }

    /// The feed-forward activation `gelu_tanh(gate(x')) * up(x')`, `x' = rms_norm(x,
    /// pre_norm)`: one kernel for a single token with `products` (dense weights, or 4-bit ones
    /// in one layout with `affine4_products`).
    fn activation(&self, layer: &DecoderLayer, x: &Array) -> Result<Array> {
        let mlp = &layer.mlp;
        if serves_token(self.kernels, x) {
            if let (Some(gate), Some(up)) = (
                product_weight(&mlp.gate_proj, x, self.kernels),
                product_weight(&mlp.up_proj, x, self.kernels),
            ) {
                let k = x.shape()[x.ndim() - 1];
                if gate.is_dense() == up.is_dense() && gate.group(k) == up.group(k) {
                    return gated_product(
                        x,
                        Some(&layer.pre_feedforward_norm),
                        layer.eps,
                        gate,
                        GateUp::Product(up),
                    );
                }
            }
        }
        mlp.activation(x, &layer.pre_feedforward_norm, layer.eps)
    }

    /// `gelu_tanh(input_gate(x)) * per_layer[:, index]`, the per-layer input's gate.
    fn per_layer_gate(
        &self,
        layer: &DecoderLayer,
        state: &LayerState,
        gate: &PleGate,
        x: &Array,
        per_layer: &Array,
    ) -> Result<Array> {
        if serves_token(self.kernels, x) {
            if let (Some(weight), Some(offset)) = (
                product_weight(&gate.input_gate, x, self.kernels),
                &state.per_layer_offset,
            ) {
                // `per_layer` is `[1, layers, width]`: this layer's inputs are one run of it.
                let up = GateUp::Slice {
                    values: per_layer,
                    offset,
                };
                return gated_product(x, None, layer.eps, weight, up);
            }
        }
        layer.per_layer_gate(gate, x, per_layer)
    }

    /// The layer's output from its input `x` and its attention heads' output `z` through
    /// [`post_attention`] (everything after the heads as one kernel), when the kernel is
    /// allowed for this layer's weights (dense: `post_attention`; 4-bit in one group size:
    /// `affine4`) and serves it: one token, no MoE branch, shapes that fit, a known CUDA
    /// device. Windows of 2-8 tokens go through [`window_post_attention`] (`window`) where
    /// decode steps run the single-token kernel whose values it gives. `None` otherwise.
    fn one_kernel_after_attention(
        &self,
        layer: &DecoderLayer,
        state: &LayerState,
        x: &Array,
        z: &Array,
        per_layer: Option<&Array>,
    ) -> Result<Option<Array>> {
        let fused = self.kernels;
        // The flags first: this runs for every layer of every forward.
        if !(fused.post_attention || fused.affine4 || fused.window) || layer.moe.is_some() {
            return Ok(None);
        }
        if x.ndim() != 2 || z.ndim() != 2 || x.shape()[0] != z.shape()[0] {
            return Ok(None);
        }
        let tokens = x.shape()[0] as usize;
        if tokens > 1 && !fused.window {
            return Ok(None);
        }
        let (Some((gate, up, down)), Some(output)) =
            (mlp_weights(layer), kernel_weight(layer.attention.o_proj()))
        else {
            return Ok(None);
        };
        let ple = match (&layer.ple, per_layer, &state.per_layer_offset) {
            (None, None, _) => None,
            (Some(g), Some(values), Some(offset)) => {
                match (kernel_weight(&g.input_gate), kernel_weight(&g.projection)) {
                    (Some(gate), Some(projection)) => Some(PerLayerInput {
                        gate,
                        values,
                        offset,
                        projection,
                        post_norm: &g.post_norm,
                    }),
                    _ => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        let (h, zw, n) = (x.shape()[1], z.shape()[1], gate.rows());
        let p = ple.as_ref().map_or(0, |v| v.gate.rows());
        // One layout for all: dense, or (when allowed) 4-bit in one group size.
        // (Arrays, not vectors: this runs for every layer of every forward.)
        let core = [(output, zw), (gate, h), (up, h), (down, n)];
        let per_layer = ple.as_ref().map(|v| [(v.gate, h), (v.projection, p)]);
        let all = || core.iter().chain(per_layer.iter().flatten());
        let all_dense = all().all(|(w, _)| w.is_dense());
        let group = output.group(zw);
        let one_group = group > 0 && all().all(|(w, k)| w.group(*k) == group);
        // Dense layers with `post-attention`, 4-bit ones with `affine4`: measured on the H200,
        // the one kernel loses to the three products over dense weights and wins over 4-bit
        // ones, where it replaces MLX's quantized products (BENCHMARKS.md). Windows: where
        // decode steps run the single-token kernel whose values the window kernel gives.
        let allowed = if all_dense {
            fused.post_attention
        } else {
            fused.affine4 && one_group
        };
        if !allowed {
            return Ok(None);
        }
        let (h, zw, n, p) = (h as usize, zw as usize, n as usize, p as usize);
        let serves = if tokens > 1 {
            let bits = if all_dense { 0 } else { 4 };
            post_attention::serves(h, zw, n, p, x.dtype())
                && window_post_attention::serves(h, zw, n, p, tokens, x.dtype(), bits)
        } else {
            post_attention::serves(h, zw, n, p, x.dtype())
        };
        if !serves || post_attention::grid_blocks().is_none() {
            return Ok(None);
        }
        let weights = PostAttention {
            output,
            post_attention_norm: &layer.post_attention_norm,
            pre_norm: &layer.pre_feedforward_norm,
            gate,
            up,
            down,
            post_norm: &layer.post_feedforward_norm,
        };
        let out = if tokens > 1 {
            window_post_attention(
                x,
                z,
                layer.eps,
                &weights,
                ple.as_ref(),
                &state.layer_scalar,
                &state.window_barrier,
            )?
        } else {
            post_attention(
                x,
                z,
                layer.eps,
                &weights,
                ple.as_ref(),
                &state.layer_scalar,
                &state.post_attention_barrier,
            )?
        };
        Ok(Some(out))
    }
}

impl CudaDecode {
    /// A window (2-8 tokens) of a layer too wide for the post-attention kernel, whose decode
    /// steps run the three products, through their window forms ([`window_products`]): each
    /// token gets what a decode step gives it. Dense weights, no MoE branch, no per-layer
    /// input; `None` otherwise.
    fn window_products_after_attention(
        &self,
        layer: &DecoderLayer,
        state: &LayerState,
        x: &Array,
        z: &Array,
    ) -> Result<Option<Array>> {
        let fused = self.kernels;
        if !(fused.window && fused.products) || x.ndim() != 2 || x.shape()[0] < 2 {
            return Ok(None);
        }
        let Some(weights) = dense_products(layer) else {
            return Ok(None);
        };
        let tokens = x.shape()[0] as usize;
        if products_window(&weights, z.shape()[z.ndim() - 1] as usize, x.dtype()) < tokens {
            return Ok(None);
        }
        let [output, gate, up, down] = weights;
        let x1 = window_product_residual(
            z,
            output,
            x,
            &layer.post_attention_norm,
            layer.eps,
            None,
            &state.counters[0],
        )?;
        let act =
            window_gated_product(&x1, Some(&layer.pre_feedforward_norm), layer.eps, gate, up)?;
        let out = window_product_residual(
            &act,
            down,
            &x1,
            &layer.post_feedforward_norm,
            layer.eps,
            Some(&state.layer_scalar),
            &state.counters[1],
        )?;
        Ok(Some(out))
    }
}

/// The attention output, gate, up and down matrices of a layer whose decode steps run the
/// three products over dense weights (no MoE branch, no per-layer input); `None` otherwise.
fn dense_products(layer: &DecoderLayer) -> Option<[&Array; 4]> {
    if layer.moe.is_some() || layer.ple.is_some() {
        return None;
    }
    fn dense(l: &Linear) -> Option<&Array> {
        match l {
            Linear::Dense(d) => Some(&d.weight),
            Linear::Quantized(_) => None,
        }
    }
    let mlp = &layer.mlp;
    Some([
        dense(layer.attention.o_proj())?,
        dense(&mlp.gate_proj)?,
        dense(&mlp.up_proj)?,
        dense(&mlp.down_proj)?,
    ])
}

/// The most tokens the window products take for these weights and an attention `width`, 1
/// where the post-attention kernel serves the layer's decode steps (its window form then
/// gives their values) or they take no window.
fn products_window(weights: &[&Array; 4], width: usize, dtype: mlx_rs::Dtype) -> usize {
    let [_, gate, _, _] = weights;
    let (hidden, n) = (gate.shape()[1] as usize, gate.shape()[0] as usize);
    if post_attention::serves(hidden, width, n, 0, dtype) {
        return 1;
    }
    (2..=window_products::MAX_TOKENS)
        .rev()
        .find(|&t| {
            [width, hidden, n]
                .into_iter()
                .all(|k| window_products::serves(k, t, dtype))
        })
        .unwrap_or(1)
}

/// Gate, up and down as the fused post-attention kernel reads them.
fn mlp_weights(
    layer: &DecoderLayer,
) -> Option<(
    post_attention::Weight<'_>,
    post_attention::Weight<'_>,
    post_attention::Weight<'_>,
)> {
    Some((
        kernel_weight(&layer.mlp.gate_proj)?,
        kernel_weight(&layer.mlp.up_proj)?,
        kernel_weight(&layer.mlp.down_proj)?,
    ))
}

/// Whether the layer's attention output weight (and so, where the window kernels take the
/// layer, every weight of it) is dense rather than 4-bit.
pub(super) fn is_dense(layer: &DecoderLayer) -> bool {
    kernel_weight(layer.attention.o_proj()).is_none_or(|w| w.is_dense())
}

/// The most tokens a window may hold for the window kernels to take this whole layer (heads
/// and everything after them; weights all dense or all 4-bit in one group size, no MoE
/// branch, shapes they take), 1 when they take none of it: a window of that many tokens
/// computes what as many decode steps compute.
pub(super) fn largest_window(layer: &DecoderLayer, dtype: mlx_rs::Dtype) -> usize {
    if layer.moe.is_some() {
        return 1;
    }
    let (Some((gate, up, down)), Some(output)) =
        (mlp_weights(layer), kernel_weight(layer.attention.o_proj()))
    else {
        return 1;
    };
    let (hidden, width, n) = (output.rows(), layer.attention.width() as i32, gate.rows());
    let mut weights = vec![(output, width), (gate, hidden), (up, hidden), (down, n)];
    let per_layer = match &layer.ple {
        None => 0,
        Some(g) => match (kernel_weight(&g.input_gate), kernel_weight(&g.projection)) {
            (Some(a), Some(b)) => {
                weights.extend([(a, hidden), (b, a.rows())]);
                a.rows() as usize
            }
            _ => return 1,
        },
    };
    let (bits, group) = (if output.is_dense() { 0 } else { 4 }, output.group(width));
    // One layout the kernels read: dense, or 4-bit in one group size of whole chunks.
    let one_layout = (bits == 0 || (group > 0 && group % 32 == 0))
        && weights
            .iter()
            .all(|(w, k)| w.is_dense() == (bits == 0) && w.group(*k) == group);
    if !one_layout {
        return 1;
    }
    let (hidden, width, n) = (hidden as usize, width as usize, n as usize);
    let heads = super::attention::largest_window(&layer.attention, hidden, dtype);
    // A window kernel gives the values of the single-token kernel it matches: a layer too
    // wide for the post-attention kernel (the 31B's 21 504-wide feed-forward input) runs the
    // three products in its decode steps, and their window forms in a window.
    if !post_attention::serves(hidden, width, n, per_layer, dtype) {
        return match dense_products(layer) {
            Some(weights) => heads.min(products_window(&weights, width, dtype)),
            None => 1,
        };
    }
    (2..=heads)
        .rev()
        .find(|&t| window_post_attention::serves(hidden, width, n, per_layer, t, dtype, bits))
        .unwrap_or(1)
}
