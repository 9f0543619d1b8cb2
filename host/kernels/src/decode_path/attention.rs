//! A layer's attention on the fast path: for one token, [`attention_heads`] (the input norm,
//! the q/k/v products, the head norms, RoPE and the cache write in one kernel) then
//! [`decode_attention`]; for a verify window of 2-8 tokens, [`window_attention_heads`] then
//! [`window_attention`], each token's output a decode step's; otherwise the model's
//! [`Attention`] steps, with the projections or the head norms and RoPE of one token fused
//! where their kernels serve.

use anyhow::{bail, Result};
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::{dense_weight, kernel_weight, CudaDecode, LayerState};
use crate::attention_heads::{
    attention_heads, serves as heads_kernel_serves, CacheSlot, HeadShape, HeadWeights,
};
use crate::attention_inputs::{attention_inputs, serves, RawHeads};
use crate::decode_attention::{decode_attention, splits_for, window_attention};
use crate::post_attention::Weight;
use crate::products::{normed_products, serves_token};
use crate::window_attention_heads::{self, window_attention_heads};
use mlx_spec_model::gemma4::attention::{buffer_attention, donor_view, Attention, Projections};
use mlx_spec_model::gemma4::cache::{KvView, LayerKv};
use mlx_spec_model::gemma4::config::AttentionKind;
use mlx_spec_model::gemma4::layer::DecoderLayer;

/// What [`CudaDecode::fused_heads`] gives: the queries, the view they attend over, the view a
/// KV-owning layer leaves for its sharers, and the view's visible slots in device memory when
/// the attention-heads kernel handed them on.
struct FusedHeads {
    q: Array,
    view: KvView,
    produced: Option<KvView>,
    visible_on_device: Option<Array>,
}

impl CudaDecode {
    /// [`Attention::forward`] of `layer` with the fused kernels.
    pub(super) fn attention(
        &self,
        layer: &DecoderLayer,
        state: &LayerState,
        x: &Array,
        offset: usize,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
    ) -> Result<(Array, Option<KvView>)> {
        let att = &layer.attention;
        let input_norm = &layer.input_norm;
        let t = x.shape()[0];
        if let Some(weights) = self.window_head_weights(att, state, x, cache.is_some()) {
            return self.window_forward(
                att,
                state,
                x,
                input_norm,
                offset,
                &weights,
                cache,
                shared,
                layer.window,
            );
        }
        let (q, view, produced, visible_on_device) =
            match self.fused_head_weights(att, state, x, cache.is_some()) {
                Some(weights) => {
                    let h = self
                        .fused_heads(att, state, x, input_norm, offset, &weights, cache, shared)?;
                    (h.q, h.view, h.produced, h.visible_on_device)
                }
                None => {
                    let (q, view, produced) =
                        self.heads(att, state, x, input_norm, offset, cache, shared)?;
                    (q, view, produced, None)
                }
            };

        if view.slot_mask.is_some() && self.kernels.attention && t == 1 {
            let slots = view.keys.shape()[2] as usize;
            if let Some(splits) = splits_for(slots, att.head_dim as usize, q.dtype()) {
                let out = decode_attention(
                    &q,
                    &view.keys,
                    &view.values,
                    view.first_query_slots.clone(),
                    visible_on_device.as_ref(),
                    splits,
                    &state.attention_counters,
                )?;
                return Ok((out, produced));
            }
        }
        let out = att.attend(&q, &view, offset, t as usize, layer.window)?;
        Ok((out, produced))
    }

    /// Raw q and, on a KV-owning layer (`owning`), raw k and v projections of
    /// `rms_norm(x, input_norm)`: one kernel for a single token over dense weights with
    /// `products`; `None` where it does not serve (quantized weights stay with MLX's products).
    fn fused_projections(
        &self,
        att: &Attention,
        x: &Array,
        input_norm: &Array,
        owning: bool,
    ) -> Result<Option<Projections>> {
        if !serves_token(self.kernels, x) {
            return Ok(None);
        }
        let kv = att.kv.as_ref().filter(|_| owning);
        let mut weights = vec![dense_weight(&att.q_proj)];
        if let Some(kv) = kv {
            weights.push(dense_weight(&kv.k_proj));
            if let Some(v_proj) = &kv.v_proj {
                weights.push(dense_weight(v_proj));
            }
        }
        let Some(weights) = weights.into_iter().collect::<Option<Vec<&Array>>>() else {
            return Ok(None);
        };
        let mut out = normed_products(x, Some(input_norm), att.eps, &weights)?.into_iter();
        let q = out.next().expect("one output per weight");
        let kv = match (out.next(), out.next()) {
            (Some(k), Some(v)) => Some((k, v)),
            // K=V: the un-normalised k_proj output, before k_norm and RoPE.
            (Some(k), None) => Some((k.clone(), k)),
            _ => None,
        };
        Ok(Some((q, kv)))
    }

    /// The weights [`attention_heads`] needs, when it serves this call: one token, both
    /// fused kernel sets on, a head size it takes, and weights all dense, or (with
    /// `affine4_heads`) all 4-bit in one group size.
    fn fused_head_weights<'a>(
        &self,
        att: &'a Attention,
        state: &'a LayerState,
        x: &Array,
        owning: bool,
    ) -> Option<HeadWeights<'a>> {
        let fused = self.kernels;
        if !(fused.attention
            && serves_token(fused, x)
            && heads_kernel_serves(att.head_dim as usize, x.dtype()))
        {
            return None;
        }
        let weights = kernel_head_weights(att, &state.rope_periods, owning)?;
        let hidden = x.shape()[x.ndim() - 1];
        let mut all = weights.projections();
        let allowed = if weights.q.is_dense() {
            all.all(|w| w.is_dense())
        } else {
            let group = weights.q.group(hidden);
            // Of a layout the kernel takes, or MLX's products run (an error would end the step).
            let fits = |w: &Weight| {
                w.group(hidden) == group && w.layout(w.rows(), hidden, x.dtype(), "").is_ok()
            };
            fused.affine4_heads && group > 0 && all.all(|w| fits(&w))
        };
        allowed.then_some(weights)
    }

    /// The weights [`window_attention_heads`] needs, when the window kernels serve this call:
    /// 2-8 tokens, the window kernels allowed with the single-token kernels they match (so a
    /// window computes what decode steps compute: for 4-bit projections the heads kernel's
    /// `affine4_heads` too), head and hidden sizes they take, and weights all dense or all
    /// 4-bit in one group size.
    fn window_head_weights<'a>(
        &self,
        att: &'a Attention,
        state: &'a LayerState,
        x: &Array,
        owning: bool,
    ) -> Option<HeadWeights<'a>> {
        let fused = self.kernels;
        let t = x.shape()[0] as usize;
        if !(t > 1 && fused.window && fused.attention && fused.products) || x.ndim() != 2 {
            return None;
        }
        let hidden = x.shape()[1] as usize;
        if !window_attention_heads::serves(t, hidden, att.head_dim as usize, x.dtype()) {
            return None;
        }
        let weights = kernel_head_weights(att, &state.rope_periods, owning)?;
        let served = one_layout(&weights, hidden as i32, x.dtype())
            && (weights.q.is_dense() || fused.affine4_heads);
        served.then_some(weights)
    }

    /// A window of 2-8 tokens through the window kernels: [`window_attention_heads`] (one
    /// kernel to normed, rotated heads, the keys and values written into the cache), then
    /// [`window_attention`]; each token's output equals a decode step's for it.
    #[allow(clippy::too_many_arguments)]
    fn window_forward(
        &self,
        att: &Attention,
        state: &LayerState,
        x: &Array,
        input_norm: &Array,
        offset: usize,
        weights: &HeadWeights,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
        window: usize,
    ) -> Result<(Array, Option<KvView>)> {
        let t = x.shape()[0];
        let dtype = x.dtype();
        let shape = head_shape(att);
        let heads = |target: Option<CacheSlot>| {
            window_attention_heads(
                x,
                input_norm,
                att.eps,
                weights,
                &shape,
                offset,
                target,
                &state.window_heads_counter,
            )
        };
        let (q, view, produced) = match cache {
            Some(cache) if weights.kv.is_some() => {
                let kv_shape = [1, att.num_kv_heads, t, att.head_dim];
                let (keys, values, slot) = cache.slots_for_next(t as usize, &kv_shape, dtype)?;
                // Counted before the kernel is built, as for one token (fused_heads).
                let view = cache.count_written(t as usize, dtype)?;
                let q = heads(Some(CacheSlot {
                    keys: &keys,
                    values: &values,
                    slot,
                }))?;
                (q, view.clone(), Some(view))
            }
            _ => {
                let view = donor_view(shared)?;
                (heads(None)?, view, None)
            }
        };
        let slots = view.keys.shape()[2] as usize;
        let slide = (att.kind == AttentionKind::Sliding).then_some(window);
        let splits = splits_for(slots, att.head_dim as usize, dtype)
            .filter(|_| view.query_slots.len() == t as usize);
        let out = match (splits, &view.slot_mask) {
            (Some(splits), _) => window_attention(
                &q,
                &view.keys,
                &view.values,
                &view.query_slots,
                slide,
                splits,
                &state.window_attention_counters,
            )?,
            // Head sizes the attention kernel does not take: MLX's operations, a query at a
            // time with its row of the mask, as a decode step runs them for that query.
            (None, Some(mask)) => {
                let rows = (0..t)
                    .map(|i| {
                        let q = q
                            .index(i..i + 1)
                            .reshape(&[1, att.num_heads, 1, att.head_dim])?;
                        let mask = mask.index(i..i + 1);
                        buffer_attention(&q, &view, &mask, att.num_kv_heads, att.head_dim)
                    })
                    .collect::<Result<Vec<_>>>()?;
                concatenate(&rows, 0)?
            }
            (None, None) => bail!("a window of {t} tokens without a slot mask"),
        };
        Ok((out, produced))
    }

    /// Queries, and the view they attend over, from [`attention_heads`]: one kernel from the
    /// hidden state to normed, rotated heads, writing a KV-owning layer's key and value into
    /// its cache. Also the view's visible slots in device memory, which the kernel hands on
    /// ([`crate::attention_heads::AttentionHeads::step_copy`]).
    #[allow(clippy::too_many_arguments)]
    fn fused_heads(
        &self,
        att: &Attention,
        state: &LayerState,
        x: &Array,
        input_norm: &Array,
        offset: usize,
        weights: &HeadWeights,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
    ) -> Result<FusedHeads> {
        let shape = head_shape(att);
        let dtype = x.dtype();
        let heads = |target: Option<CacheSlot>, view: &KvView| {
            attention_heads(
                x,
                input_norm,
                att.eps,
                weights,
                &shape,
                offset,
                target,
                view.first_query_slots.clone(),
                &state.heads_counter,
            )
        };
        match cache {
            Some(cache) if weights.kv.is_some() => {
                let kv_shape = [1, att.num_kv_heads, 1, att.head_dim];
                let (keys, values, slot) = cache.slot_for_next(&kv_shape, dtype)?;
                // Counted before the kernel is built, so that it knows the slots the query
                // will see: only bookkeeping, as the write's readers all depend on the
                // kernel's queries.
                let view = cache.count_written(1, dtype)?;
                let out = heads(
                    Some(CacheSlot {
                        keys: &keys,
                        values: &values,
                        slot,
                    }),
                    &view,
                )?;
                Ok(FusedHeads {
                    q: out.q,
                    view: view.clone(),
                    produced: Some(view),
                    visible_on_device: out.step_copy,
                })
            }
            _ => {
                let view = donor_view(shared)?;
                let out = heads(None, &view)?;
                Ok(FusedHeads {
                    q: out.q,
                    view,
                    produced: None,
                    visible_on_device: out.step_copy,
                })
            }
        }
    }

    /// Queries, and the view they attend over, from the projections (fused where
    /// [`CudaDecode::fused_projections`] serves), the head norms and RoPE (the
    /// attention-inputs kernel for one token), and the model's cache write.
    #[allow(clippy::too_many_arguments)]
    fn heads(
        &self,
        att: &Attention,
        state: &LayerState,
        x: &Array,
        input_norm: &Array,
        offset: usize,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
    ) -> Result<(Array, KvView, Option<KvView>)> {
        let t = x.shape()[0] as usize;
        let owning = cache.is_some();
        let (q_raw, kv_raw) = match self.fused_projections(att, x, input_norm, owning)? {
            Some(projections) => projections,
            None => att.projections(x, input_norm, owning)?,
        };
        let (nh, nkv, hd) = (att.num_heads, att.num_kv_heads, att.head_dim);
        let (q, kv) = if self.kernels.attention && t == 1 && serves(hd as usize, q_raw.dtype()) {
            let raw = RawHeads {
                q: &q_raw,
                q_norm: &att.q_norm,
                kv: match (&att.kv, &kv_raw) {
                    (Some(projections), Some((k, v))) => Some((k, v, &projections.k_norm)),
                    _ => None,
                },
                periods: &state.rope_periods,
            };
            attention_inputs(&raw, nh, nkv, hd, att.eps, offset)?
        } else {
            att.rotated_heads(&q_raw, kv_raw.as_ref(), t, offset)?
        };
        let (view, produced) = att.store(kv, cache, shared)?;
        Ok((q, view, produced))
    }
}

/// The heads' sizes as the heads kernels take them.
fn head_shape(att: &Attention) -> HeadShape {
    HeadShape {
        heads: att.num_heads,
        kv_heads: att.num_kv_heads,
        head_dim: att.head_dim,
    }
}

/// The most tokens a window may hold for [`window_attention_heads`] to take this layer's
/// heads (projections all dense or all 4-bit in one group size, a head size and width it
/// takes), 1 when it takes none.
pub(super) fn largest_window(att: &Attention, hidden: usize, dtype: mlx_rs::Dtype) -> usize {
    // Only the layout is read here: the host copy of the periods will do.
    let served = kernel_head_weights(att, att.rope.periods(), true)
        .is_some_and(|w| one_layout(&w, hidden as i32, dtype));
    if !served {
        return 1;
    }
    (2..=window_attention_heads::MAX_TOKENS)
        .rev()
        .find(|&t| window_attention_heads::serves(t, hidden, att.head_dim as usize, dtype))
        .unwrap_or(1)
}

/// The layer's projections (k and v on a KV-owning layer with `owning`) as the heads kernels
/// read them, with the head norms and the RoPE `periods`; `None` where one is of no layout
/// they read.
fn kernel_head_weights<'a>(
    att: &'a Attention,
    periods: &'a Array,
    owning: bool,
) -> Option<HeadWeights<'a>> {
    let q = kernel_weight(&att.q_proj)?;
    let kv = match att.kv.as_ref().filter(|_| owning) {
        Some(kv) => {
            let v = match &kv.v_proj {
                Some(v_proj) => Some(kernel_weight(v_proj)?),
                None => None,
            };
            Some((kernel_weight(&kv.k_proj)?, v, &kv.k_norm))
        }
        None => None,
    };
    Some(HeadWeights {
        q,
        kv,
        q_norm: &att.q_norm,
        periods,
    })
}

/// Whether the projections are all dense, or all 4-bit affine in one group size of a layout
/// the heads kernels read (for `hidden` inputs in `dtype`).
fn one_layout(weights: &HeadWeights, hidden: i32, dtype: mlx_rs::Dtype) -> bool {
    let group = weights.q.group(hidden);
    weights.projections().all(|w| {
        w.is_dense() == weights.q.is_dense()
            && w.group(hidden) == group
            && w.layout(w.rows(), hidden, dtype, "").is_ok()
    })
}
