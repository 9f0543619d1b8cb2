//! One Gemma 4 decoder layer: sandwich-normed attention and feed-forward blocks, the optional
//! MoE branch, the optional per-layer-embedding gate, and the learned `layer_scalar`.

use super::norm::rms_norm;
use anyhow::Result;
use mlx_rs::ops::broadcast_to;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::activation::gated_gelu;
use super::attention::Attention;
use super::cache::{KvView, LayerKv};
use super::config::Gemma4Config;
use super::linear::{Linear, Loader};
use super::mlp::Mlp;
use super::moe::Experts;
use crate::kernels::post_attention::{self, post_attention, PerLayerInput, PostAttention};
use crate::kernels::products::{
    device_array, gated_product, new_counter, product_residual, serves_token, GateUp,
};
use crate::kernels::window_post_attention::{self, window_post_attention};
use crate::kernels::Fused;

/// The MoE branch and its three extra norms.
struct MoeBranch {
    experts: Experts,
    pre_norm: Array,
    post_norm_dense: Array,
    post_norm_experts: Array,
}

/// The per-layer-embedding gate.
struct PleGate {
    input_gate: Linear,
    projection: Linear,
    post_norm: Array,
    /// Where this layer's inputs start in the `[1, layers, width]` per-layer inputs (int32,
    /// in device memory), for the fused gate.
    offset: Array,
}

pub struct DecoderLayer {
    eps: f32,
    window: usize,
    input_norm: Array,
    attention: Attention,
    post_attention_norm: Array,
    pre_feedforward_norm: Array,
    mlp: Mlp,
    moe: Option<MoeBranch>,
    post_feedforward_norm: Array,
    ple: Option<PleGate>,
    /// The learned scalar, stored broadcast to `[1, H]` (a view, evaluated once) so a
    /// single-token step multiplies equal shapes and MLX adds no broadcast node per layer.
    layer_scalar: Array,
    /// The same scalar first in a small array in device memory, for the fused kernel.
    layer_scalar_device: Array,
    /// One counter per fused closing product (attention, feed-forward, per-layer input): see
    /// [`crate::kernels::products::new_counter`].
    counters: [Array; 3],
    /// The barrier state of the one-kernel post-attention path
    /// ([`post_attention::new_barrier`]).
    post_attention_barrier: Array,
    /// The barrier state of the one-kernel path for windows of several tokens.
    window_barrier: Array,
}

impl DecoderLayer {
    pub fn load(cfg: &Gemma4Config, index: usize, w: &Loader) -> Result<Self> {
        let h = cfg.hidden_size;
        let p = format!("layers.{index}.");
        let norm = |name: &str| w.tensor(&format!("{p}{name}.weight"), &[h]);
        let moe = match cfg.moe {
            Some(m) => Some(MoeBranch {
                experts: Experts::load(w, index, m, h, cfg.rms_norm_eps)?,
                pre_norm: norm("pre_feedforward_layernorm_2")?,
                post_norm_dense: norm("post_feedforward_layernorm_1")?,
                post_norm_experts: norm("post_feedforward_layernorm_2")?,
            }),
            None => None,
        };
        let ple = if cfg.per_layer_input_size > 0 {
            let pw = cfg.per_layer_input_size;
            Some(PleGate {
                input_gate: w.linear(&format!("{p}per_layer_input_gate"), pw, h)?,
                projection: w.linear(&format!("{p}per_layer_projection"), h, pw)?,
                post_norm: norm("post_per_layer_input_norm")?,
                offset: device_array(&Array::from_slice(&[(index * pw) as i32], &[1]), 4)?,
            })
        } else {
            None
        };
        let layer_scalar_one = w.tensor(&format!("{p}layer_scalar"), &[1])?;
        layer_scalar_one.eval()?;
        let layer_scalar_device = device_array(&layer_scalar_one, 8)?;
        Ok(DecoderLayer {
            eps: cfg.rms_norm_eps,
            window: cfg.sliding_window,
            input_norm: norm("input_layernorm")?,
            attention: Attention::load(cfg, index, w)?,
            post_attention_norm: norm("post_attention_layernorm")?,
            pre_feedforward_norm: norm("pre_feedforward_layernorm")?,
            mlp: Mlp::load(w, &format!("{p}mlp."), h, cfg.layers[index].mlp_width)?,
            moe,
            post_feedforward_norm: norm("post_feedforward_layernorm")?,
            ple,
            layer_scalar: {
                let s = broadcast_to(&layer_scalar_one, &[1, h as i32])?;
                s.eval()?;
                s
            },
            layer_scalar_device,
            counters: [new_counter()?, new_counter()?, new_counter()?],
            post_attention_barrier: post_attention::new_barrier()?,
            window_barrier: post_attention::new_barrier()?,
        })
    }

    /// The most tokens a window may hold for the window kernels to take this whole layer
    /// (heads and everything after them; weights all dense or all 4-bit in one group size,
    /// no MoE branch, shapes they take), 1 when they take none of it: a window of that many
    /// tokens computes what as many decode steps compute.
    pub fn largest_window(&self, dtype: mlx_rs::Dtype) -> usize {
        if self.moe.is_some() {
            return 1;
        }
        let (Some((gate, up, down)), Some(output)) = (
            self.mlp.kernel_weights(),
            self.attention.o_proj().kernel_weight(),
        ) else {
            return 1;
        };
        let (hidden, width, n) = (output.rows(), self.attention.width() as i32, gate.rows());
        let mut weights = vec![(output, width), (gate, hidden), (up, hidden), (down, n)];
        let per_layer = match &self.ple {
            None => 0,
            Some(g) => match (g.input_gate.kernel_weight(), g.projection.kernel_weight()) {
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
        let heads = self.attention.largest_window(hidden, dtype);
        (2..=heads)
            .rev()
            .find(|&t| window_post_attention::serves(hidden, width, n, per_layer, t, dtype, bits))
            .unwrap_or(1)
    }

    /// Whether the layer's attention output weight (and so, where the window kernels take the
    /// layer, every weight of it) is dense rather than 4-bit.
    pub fn is_dense(&self) -> bool {
        self.attention
            .o_proj()
            .kernel_weight()
            .is_none_or(|w| w.is_dense())
    }

    /// Bytes of this layer's weights a single token does not read (unrouted experts).
    pub fn unread_nbytes_per_token(&self) -> usize {
        self.moe
            .as_ref()
            .map_or(0, |m| m.experts.unread_nbytes_per_token())
    }

    fn norm(&self, x: &Array, w: &Array) -> Result<Array> {
        rms_norm(x, Some(w), self.eps)
    }

    /// `x + rms_norm(y, w)`, then times the layer scalar when `last` (the layer's output).
    fn residual(&self, x: &Array, y: &Array, w: &Array, last: bool) -> Result<Array> {
        let sum = x.add(&self.norm(y, w)?)?;
        Ok(if last {
            sum.multiply(&self.layer_scalar)?
        } else {
            sum
        })
    }

    /// `x + rms_norm(proj(a), w)` (times the layer scalar when `last`): the product that
    /// closes a block, with its residual update. One CUDA kernel for a single token with
    /// `fused.products` (over a dense weight, or a 4-bit one with `fused.affine4_products`);
    /// `counter` is the call site's.
    #[allow(clippy::too_many_arguments)]
    fn closing_product(
        &self,
        x: &Array,
        a: &Array,
        proj: &Linear,
        w: &Array,
        last: bool,
        counter: &Array,
        fused: Fused,
    ) -> Result<Array> {
        if serves_token(fused, a) {
            if let Some(weight) = proj.product_weight(a, fused) {
                let scale = last.then_some(&self.layer_scalar_device);
                return product_residual(a, weight, x, w, self.eps, scale, counter);
            }
        }
        self.residual(x, &proj.forward(a)?, w, last)
    }

    /// `gelu_tanh(input_gate(x)) * per_layer[:, index]`, the per-layer input's gate.
    fn per_layer_gate(
        &self,
        gate: &PleGate,
        x: &Array,
        per_layer: &Array,
        index: usize,
        fused: Fused,
    ) -> Result<Array> {
        if serves_token(fused, x) {
            if let Some(weight) = gate.input_gate.product_weight(x, fused) {
                // `per_layer` is `[1, layers, width]`: this layer's inputs are one run of it.
                let up = GateUp::Slice {
                    values: per_layer,
                    offset: &gate.offset,
                };
                return gated_product(x, None, self.eps, weight, up);
            }
        }
        let input = per_layer.index((.., index as i32, ..));
        gated_gelu(&gate.input_gate.forward(x)?, &input)
    }

    /// The layer's output from its input `x` and its attention heads' output `z` through
    /// [`post_attention`] (everything after the heads as one kernel), when the kernel is
    /// allowed for this layer's weights (dense: `fused.post_attention`; 4-bit in one group
    /// size: `fused.affine4`) and serves it: one token, no MoE branch, shapes
    /// that fit, a known CUDA device. Windows of 2-8 tokens go through
    /// [`window_post_attention`] (`fused.window`) where decode steps run the single-token
    /// kernel whose values it gives. `None` otherwise.
    fn one_kernel_after_attention(
        &self,
        x: &Array,
        z: &Array,
        per_layer: Option<(&Array, usize)>,
        fused: Fused,
    ) -> Result<Option<Array>> {
        // The flags first: this runs for every layer of every forward.
        if !(fused.post_attention || fused.affine4 || fused.window) || self.moe.is_some() {
            return Ok(None);
        }
        if x.ndim() != 2 || z.ndim() != 2 || x.shape()[0] != z.shape()[0] {
            return Ok(None);
        }
        let tokens = x.shape()[0] as usize;
        if tokens > 1 && !fused.window {
            return Ok(None);
        }
        let (Some((gate, up, down)), Some(output)) = (
            self.mlp.kernel_weights(),
            self.attention.o_proj().kernel_weight(),
        ) else {
            return Ok(None);
        };
        let ple = match (&self.ple, per_layer) {
            (None, None) => None,
            (Some(g), Some((values, _))) => {
                match (g.input_gate.kernel_weight(), g.projection.kernel_weight()) {
                    (Some(gate), Some(projection)) => Some(PerLayerInput {
                        gate,
                        values,
                        offset: &g.offset,
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
            window_post_attention::serves(h, zw, n, p, tokens, x.dtype(), bits)
        } else {
            post_attention::serves(h, zw, n, p, x.dtype())
        };
        if !serves || post_attention::grid_blocks().is_none() {
            return Ok(None);
        }
        let weights = PostAttention {
            output,
            post_attention_norm: &self.post_attention_norm,
            pre_norm: &self.pre_feedforward_norm,
            gate,
            up,
            down,
            post_norm: &self.post_feedforward_norm,
        };
        let out = if tokens > 1 {
            window_post_attention(
                x,
                z,
                self.eps,
                &weights,
                ple.as_ref(),
                &self.layer_scalar_device,
                &self.window_barrier,
            )?
        } else {
            post_attention(
                x,
                z,
                self.eps,
                &weights,
                ple.as_ref(),
                &self.layer_scalar_device,
                &self.post_attention_barrier,
            )?
        };
        Ok(Some(out))
    }

    /// Runs the layer on `x` (`[T, H]`). `per_layer` is the per-layer embeddings of every
    /// layer (`[T, layers, P]`) with this layer's index. Returns the new hidden state and, for
    /// KV-owning layers, the K/V view sharers of this layer read. `fused`: which CUDA kernels
    /// of [`crate::kernels`] to use.
    pub fn forward(
        &self,
        x: &Array,
        offset: usize,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
        per_layer: Option<(&Array, usize)>,
        fused: Fused,
    ) -> Result<(Array, Option<KvView>)> {
        let (attn, view) = self.attention.forward(
            x,
            &self.input_norm,
            offset,
            cache,
            shared,
            self.window,
            fused,
        )?;
        if let Some(out) = self.one_kernel_after_attention(x, &attn, per_layer, fused)? {
            return Ok((out, view));
        }
        let x = self.closing_product(
            x,
            &attn,
            self.attention.o_proj(),
            &self.post_attention_norm,
            false,
            &self.counters[0],
            fused,
        )?;

        let gated = self.ple.as_ref().zip(per_layer);
        let act = self
            .mlp
            .activation(&x, &self.pre_feedforward_norm, self.eps, fused)?;
        let x = match &self.moe {
            None => self.closing_product(
                &x,
                &act,
                self.mlp.down_proj(),
                &self.post_feedforward_norm,
                gated.is_none(),
                &self.counters[1],
                fused,
            )?,
            Some(moe) => {
                let dense =
                    self.norm(&self.mlp.down_proj().forward(&act)?, &moe.post_norm_dense)?;
                let routed = moe.experts.forward(&x, &self.norm(&x, &moe.pre_norm)?)?;
                let ff = dense.add(&self.norm(&routed, &moe.post_norm_experts)?)?;
                self.residual(&x, &ff, &self.post_feedforward_norm, gated.is_none())?
            }
        };

        if let Some((gate, (per_layer, index))) = gated {
            let g = self.per_layer_gate(gate, &x, per_layer, index, fused)?;
            let out = self.closing_product(
                &x,
                &g,
                &gate.projection,
                &gate.post_norm,
                true,
                &self.counters[2],
                fused,
            )?;
            return Ok((out, view));
        }
        Ok((x, view))
    }
}
