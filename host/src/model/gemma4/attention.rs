//! Gemma 4 self-attention: q/k norms, weightless v norm, per-kind RoPE, scale 1.0, GQA, and
//! KV sharing (sharer layers project only Q and read a donor layer's K/V).

use anyhow::{bail, Result};
use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};

use super::norm::rms_norm;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{arange, concatenate, logical_and, matmul, softmax_axis};
use mlx_rs::Array;

use super::cache::{KvView, LayerKv};
use super::config::{AttentionKind, Gemma4Config, LayerPlan};
use super::linear::{Linear, Loader};
use super::rope::Rope;
use crate::kernels::attention_heads::{
    attention_heads, serves as heads_kernel_serves, CacheSlot, HeadShape, HeadWeights,
};
use crate::kernels::attention_inputs::{attention_inputs, serves, RawHeads};
use crate::kernels::decode_attention::{decode_attention, splits_for, window_attention};
use crate::kernels::post_attention::Weight;
use crate::kernels::products::{new_counters, normed_products, serves_token};
use crate::kernels::window_attention_heads::{self, window_attention_heads};
use crate::kernels::Fused;

/// K/V projections, present only on KV-owning layers.
struct KvProjections {
    k_proj: Linear,
    /// `None` when V is the k_proj output (K=V full layers).
    v_proj: Option<Linear>,
    k_norm: Array,
}

pub struct Attention {
    kind: AttentionKind,
    num_heads: i32,
    num_kv_heads: i32,
    head_dim: i32,
    eps: f32,
    q_proj: Linear,
    q_norm: Array,
    o_proj: Linear,
    kv: Option<KvProjections>,
    rope: Rope,
    /// Completion counter of this layer's fused heads kernel (device memory).
    heads_counter: Array,
    /// Block counters of this layer's fused decode attention (device memory).
    attention_counters: Array,
    /// The same two for windows of several tokens (one attention counter per head and token).
    window_heads_counter: Array,
    window_attention_counters: Array,
}

impl Attention {
    pub fn load(cfg: &Gemma4Config, index: usize, w: &Loader) -> Result<Self> {
        let plan: &LayerPlan = &cfg.layers[index];
        let p = format!("layers.{index}.self_attn.");
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_heads,
            plan.num_kv_heads,
            plan.head_dim,
        );
        let kv = if plan.owns_kv(index) {
            Some(KvProjections {
                k_proj: w.linear(&format!("{p}k_proj"), nkv * hd, h)?,
                v_proj: if plan.k_eq_v {
                    None
                } else {
                    Some(w.linear(&format!("{p}v_proj"), nkv * hd, h)?)
                },
                k_norm: w.tensor(&format!("{p}k_norm.weight"), &[hd])?,
            })
        } else {
            None
        };
        Ok(Attention {
            kind: plan.kind,
            num_heads: nh as i32,
            num_kv_heads: nkv as i32,
            head_dim: hd as i32,
            eps: cfg.rms_norm_eps,
            q_proj: w.linear(&format!("{p}q_proj"), nh * hd, h)?,
            q_norm: w.tensor(&format!("{p}q_norm.weight"), &[hd])?,
            o_proj: w.linear(&format!("{p}o_proj"), h, nh * hd)?,
            kv,
            rope: Rope::new(cfg.rope(plan.kind), hd),
            // One per head whose rows the attention-heads kernel makes: queries, keys, values.
            heads_counter: new_counters(nh + 2 * nkv)?,
            attention_counters: new_counters(nh)?,
            // One per head too, for the window kernel's heads finished apart.
            window_heads_counter: new_counters(nh + 2 * nkv)?,
            window_attention_counters: new_counters(nh * window_attention_heads::MAX_TOKENS)?,
        })
    }

    pub fn o_proj(&self) -> &Linear {
        &self.o_proj
    }

    /// The most tokens a window may hold for [`window_attention_heads`] to take this layer's
    /// heads (projections all dense or all 4-bit in one group size, a head size and width it
    /// takes), 1 when it takes none.
    pub fn largest_window(&self, hidden: usize, dtype: mlx_rs::Dtype) -> usize {
        let served = self
            .kernel_head_weights(true)
            .is_some_and(|w| one_layout(&w, hidden as i32, dtype));
        if !served {
            return 1;
        }
        (2..=window_attention_heads::MAX_TOKENS)
            .rev()
            .find(|&t| window_attention_heads::serves(t, hidden, self.head_dim as usize, dtype))
            .unwrap_or(1)
    }

    /// The heads' output width (`heads * head_dim`), the input of `o_proj`.
    pub fn width(&self) -> usize {
        (self.num_heads * self.head_dim) as usize
    }

    /// Raw q and, on a KV-owning layer (`owning`), raw k and v projections of
    /// `rms_norm(x, input_norm)`. One CUDA kernel for a single token with `fused.products`.
    fn projections(
        &self,
        x: &Array,
        input_norm: &Array,
        owning: bool,
        fused: Fused,
    ) -> Result<(Array, Option<(Array, Array)>)> {
        let kv = self.kv.as_ref().filter(|_| owning);
        if serves_token(fused, x) {
            let mut weights = vec![self.q_proj.dense_weight()];
            if let Some(kv) = kv {
                weights.push(kv.k_proj.dense_weight());
                if let Some(v_proj) = &kv.v_proj {
                    weights.push(v_proj.dense_weight());
                }
            }
            // Quantized weights stay with MLX's products.
            if let Some(weights) = weights.into_iter().collect::<Option<Vec<&Array>>>() {
                let mut out = normed_products(x, Some(input_norm), self.eps, &weights)?.into_iter();
                let q = out.next().expect("one output per weight");
                let kv = match (out.next(), out.next()) {
                    (Some(k), Some(v)) => Some((k, v)),
                    // K=V: the un-normalised k_proj output, before k_norm and RoPE.
                    (Some(k), None) => Some((k.clone(), k)),
                    _ => None,
                };
                return Ok((q, kv));
            }
        }
        let x = rms_norm(x, Some(input_norm), self.eps)?;
        let q = self.q_proj.forward(&x)?;
        let kv = match kv {
            Some(kv) => {
                let k = kv.k_proj.forward(&x)?;
                let v = match &kv.v_proj {
                    Some(v_proj) => v_proj.forward(&x)?,
                    // K=V: the un-normalised k_proj output, before k_norm and RoPE.
                    None => k.clone(),
                };
                Some((k, v))
            }
            None => None,
        };
        Ok((q, kv))
    }

    /// Attends `rms_norm(x, input_norm)` (`x`: `[T, hidden]`, first token at `offset`) and
    /// returns the heads' output `[T, heads * head_dim]`, before `o_proj` (the layer fuses that
    /// product with its residual update). A KV-owning layer appends its new K/V to `cache` and
    /// returns the view it attended over so sharers can reuse it; a sharer passes the donor's
    /// view in `shared`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &Array,
        input_norm: &Array,
        offset: usize,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
        window: usize,
        fused: Fused,
    ) -> Result<(Array, Option<KvView>)> {
        let t = x.shape()[0];
        if let Some(weights) = self.window_head_weights(x, cache.is_some(), fused) {
            return self.window_forward(x, input_norm, offset, &weights, cache, shared, window);
        }
        let (q, view, produced, visible_on_device) =
            match self.fused_head_weights(x, cache.is_some(), fused) {
                Some(weights) => {
                    let h = self.fused_heads(x, input_norm, offset, &weights, cache, shared)?;
                    (h.q, h.view, h.produced, h.visible_on_device)
                }
                None => {
                    let (q, view, produced) =
                        self.heads(x, input_norm, offset, cache, shared, fused)?;
                    (q, view, produced, None)
                }
            };

        if let Some(slot_mask) = &view.slot_mask {
            let slots = view.keys.shape()[2] as usize;
            let splits = (fused.attention && t == 1)
                .then(|| splits_for(slots, self.head_dim as usize, q.dtype()))
                .flatten();
            let out = match splits {
                Some(splits) => decode_attention(
                    &q,
                    &view.keys,
                    &view.values,
                    view.first_query_slots.clone(),
                    visible_on_device.as_ref(),
                    splits,
                    &self.attention_counters,
                )?,
                None => buffer_attention(&q, &view, slot_mask, self.num_kv_heads, self.head_dim)?,
            };
            return Ok((out, produced));
        }
        // Long windows (prefill chunks): MLX's attention over the visible keys.
        let mask = attention_mask(self.kind, offset, t as usize, &view, window)?;
        let out = match &mask {
            Some(m) => scaled_dot_product_attention(
                &q,
                &view.keys,
                &view.values,
                1.0,
                ScaledDotProductAttentionMask::Array(m),
                None,
            )?,
            None => scaled_dot_product_attention(&q, &view.keys, &view.values, 1.0, None, None)?,
        };
        let out = out
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[t, self.num_heads * self.head_dim])?;
        Ok((out, produced))
    }

    /// The weights [`attention_heads`] needs, when it serves this call: one token, both
    /// fused kernel sets on, a head size it takes, and weights all dense, or (with
    /// `fused.affine4_heads`) all 4-bit in one group size.
    fn fused_head_weights(&self, x: &Array, owning: bool, fused: Fused) -> Option<HeadWeights<'_>> {
        if !(fused.attention
            && serves_token(fused, x)
            && heads_kernel_serves(self.head_dim as usize, x.dtype()))
        {
            return None;
        }
        let weights = self.kernel_head_weights(owning)?;
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

    /// The layer's projections (k and v on a KV-owning layer with `owning`) as the heads
    /// kernels read them, with the head norms and RoPE periods; `None` where one is of no
    /// layout they read.
    fn kernel_head_weights(&self, owning: bool) -> Option<HeadWeights<'_>> {
        let q = self.q_proj.kernel_weight()?;
        let kv = match self.kv.as_ref().filter(|_| owning) {
            Some(kv) => {
                let v = match &kv.v_proj {
                    Some(v_proj) => Some(v_proj.kernel_weight()?),
                    None => None,
                };
                Some((kv.k_proj.kernel_weight()?, v, &kv.k_norm))
            }
            None => None,
        };
        Some(HeadWeights {
            q,
            kv,
            q_norm: &self.q_norm,
            periods: self.rope.device_periods(),
        })
    }

    /// The weights [`window_attention_heads`] needs, when the window kernels serve this call:
    /// 2-8 tokens, the window kernels allowed with the single-token kernels they match (so a
    /// window computes what decode steps compute: for 4-bit projections the heads kernel's
    /// `affine4_heads` too), head and hidden sizes they take, and weights all dense or all
    /// 4-bit in one group size.
    fn window_head_weights(
        &self,
        x: &Array,
        owning: bool,
        fused: Fused,
    ) -> Option<HeadWeights<'_>> {
        let t = x.shape()[0] as usize;
        if !(t > 1 && fused.window && fused.attention && fused.products) || x.ndim() != 2 {
            return None;
        }
        let hidden = x.shape()[1] as usize;
        if !window_attention_heads::serves(t, hidden, self.head_dim as usize, x.dtype()) {
            return None;
        }
        let weights = self.kernel_head_weights(owning)?;
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
        let shape = HeadShape {
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        };
        let heads = |target: Option<CacheSlot>| {
            window_attention_heads(
                x,
                input_norm,
                self.eps,
                weights,
                &shape,
                offset,
                target,
                &self.window_heads_counter,
            )
        };
        let (q, view, produced) = match cache {
            Some(cache) if weights.kv.is_some() => {
                let kv_shape = [1, self.num_kv_heads, t, self.head_dim];
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
        let slide = (self.kind == AttentionKind::Sliding).then_some(window);
        let splits = splits_for(slots, self.head_dim as usize, dtype)
            .filter(|_| view.query_slots.len() == t as usize);
        let out = match (splits, &view.slot_mask) {
            (Some(splits), _) => window_attention(
                &q,
                &view.keys,
                &view.values,
                &view.query_slots,
                slide,
                splits,
                &self.window_attention_counters,
            )?,
            // Head sizes the attention kernel does not take: MLX's operations, a query at a
            // time with its row of the mask, as a decode step runs them for that query.
            (None, Some(mask)) => {
                let rows = (0..t)
                    .map(|i| {
                        let q =
                            q.index(i..i + 1)
                                .reshape(&[1, self.num_heads, 1, self.head_dim])?;
                        let mask = mask.index(i..i + 1);
                        buffer_attention(&q, &view, &mask, self.num_kv_heads, self.head_dim)
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
    /// ([`crate::kernels::attention_heads::AttentionHeads::step_copy`]).
    fn fused_heads(
        &self,
        x: &Array,
        input_norm: &Array,
        offset: usize,
        weights: &HeadWeights,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
    ) -> Result<FusedHeads> {
        let shape = HeadShape {
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        };
        let dtype = x.dtype();
        let heads = |target: Option<CacheSlot>, view: &KvView| {
            attention_heads(
                x,
                input_norm,
                self.eps,
                weights,
                &shape,
                offset,
                target,
                view.first_query_slots.clone(),
                &self.heads_counter,
            )
        };
        match cache {
            Some(cache) if weights.kv.is_some() => {
                let kv_shape = [1, self.num_kv_heads, 1, self.head_dim];
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

    /// Queries, and the view they attend over, from the projections, the head norms and RoPE
    /// as separate operations (or the attention-inputs kernel for one token), appending a
    /// KV-owning layer's keys and values to its cache.
    fn heads(
        &self,
        x: &Array,
        input_norm: &Array,
        offset: usize,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
        fused: Fused,
    ) -> Result<(Array, KvView, Option<KvView>)> {
        let t = x.shape()[0];
        let (q_raw, kv_raw) = self.projections(x, input_norm, cache.is_some(), fused)?;
        let kv_raw = match (&self.kv, kv_raw) {
            (Some(kv), Some((k, v))) => Some((k, v, &kv.k_norm)),
            _ => None,
        };
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, kv) = if fused.attention && t == 1 && serves(hd as usize, q_raw.dtype()) {
            let raw = RawHeads {
                q: &q_raw,
                q_norm: &self.q_norm,
                kv: kv_raw.as_ref().map(|(k, v, norm)| (k, v, *norm)),
                periods: self.rope.device_periods(),
            };
            attention_inputs(&raw, nh, nkv, hd, self.eps, offset)?
        } else {
            let q = rms_norm(
                &heads_first(&q_raw, t, nh, hd)?,
                Some(&self.q_norm),
                self.eps,
            )?;
            let q = self.rope.apply(&q, offset)?;
            let kv = match &kv_raw {
                Some((k_raw, v_raw, k_norm)) => {
                    // RMSNorm acts on the last axis (head_dim), so it commutes with the
                    // transpose.
                    let k = rms_norm(&heads_first(k_raw, t, nkv, hd)?, Some(*k_norm), self.eps)?;
                    let k = self.rope.apply(&k, offset)?;
                    let v = rms_norm(&heads_first(v_raw, t, nkv, hd)?, None, self.eps)?;
                    Some((k, v))
                }
                None => None,
            };
            (q, kv)
        };

        let (view, produced) = match (kv, cache) {
            (Some((k, v)), Some(cache)) => {
                let view = cache.append(&k, &v)?;
                (view.clone(), Some(view))
            }
            _ => (donor_view(shared)?, None),
        };

        Ok((q, view, produced))
    }
}

/// What [`Attention::fused_heads`] gives: the queries, the view they attend over, the view a
/// KV-owning layer leaves for its sharers, and the view's visible slots in device memory when
/// the attention-heads kernel handed them on.
struct FusedHeads {
    q: Array,
    view: KvView,
    produced: Option<KvView>,
    visible_on_device: Option<Array>,
}

/// The donor's view a KV-sharing layer attends over.
fn donor_view(shared: Option<&KvView>) -> Result<KvView> {
    shared
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("KV-sharing layer called without its donor's keys"))
}

/// Attention of a short query window (`q`: `[1, heads, T, head_dim]`) over the whole K/V
/// buffers of `view`, `slot_mask` (`[T, capacity]`) hiding from each query the slots it must
/// not see, as two matrix products; returns `[T, heads * head_dim]`.
///
/// The query heads that share a KV head become rows of one product, so nothing is broadcast
/// or repeated. MLX's fused attention has no CUDA kernel for Gemma 4's head sizes (256 and
/// 512) and falls back to a longer graph of the same products; decode and verification run
/// this on every layer, so it is written out here. Scale 1.0: Gemma 4 normalises q and k
/// instead. Scores are rounded to the activation dtype and the softmax accumulates in
/// float32, as transformers' eager attention does.
fn buffer_attention(
    q: &Array,
    view: &KvView,
    slot_mask: &Array,
    kv_heads: i32,
    head_dim: i32,
) -> Result<Array> {
    let (heads, t) = (q.shape()[1], q.shape()[2]);
    let group = heads / kv_heads;
    let capacity = view.keys.shape()[2];
    // Rows ordered (head within the group, token): the order of `q`'s memory.
    let q = q.reshape(&[1, kv_heads, group * t, head_dim])?;
    let scores = matmul(&q, view.keys.swap_axes(-1, -2)?)?;
    let scores = if t == 1 {
        scores.add(slot_mask)?
    } else {
        scores
            .reshape(&[1, kv_heads, group, t, capacity])?
            .add(slot_mask)?
            .reshape(&[1, kv_heads, group * t, capacity])?
    };
    let out = matmul(&softmax_axis(&scores, -1, true)?, &view.values)?;
    Ok(if t == 1 {
        out.reshape(&[1, heads * head_dim])?
    } else {
        out.reshape(&[1, kv_heads, group, t, head_dim])?
            .transpose_axes(&[0, 3, 1, 2, 4])?
            .reshape(&[t, heads * head_dim])?
    })
}

/// `[T, heads * head_dim]` projections to the `[1, heads, T, head_dim]` layout of RoPE and
/// attention. A single token needs no transpose, only a reshape: one graph node instead of two
/// on the decode path, and no strided view for the next kernel to copy.
fn heads_first(x: &Array, t: i32, heads: i32, head_dim: i32) -> Result<Array> {
    Ok(if t == 1 {
        x.reshape(&[1, heads, 1, head_dim])?
    } else {
        x.reshape(&[1, t, heads, head_dim])?
            .transpose_axes(&[0, 2, 1, 3])?
    })
}

/// Boolean mask `[T, K]` (true = attend) for queries at `offset..offset+T` over keys at
/// `view.first_position..`, or `None` when every key is visible to every query.
fn attention_mask(
    kind: AttentionKind,
    offset: usize,
    t: usize,
    view: &KvView,
    window: usize,
) -> Result<Option<Array>> {
    let keys = view.keys.shape()[2] as usize;
    let last_query = offset + t - 1;
    let all_causal = view.first_position + keys <= offset + 1; // every key precedes the first query
    let all_in_window = kind == AttentionKind::Full || last_query < view.first_position + window;
    if all_causal && all_in_window {
        return Ok(None);
    }
    let q_pos =
        arange::<_, i32>(offset as i32, (offset + t) as i32, None)?.reshape(&[t as i32, 1])?;
    let k_pos = arange::<_, i32>(
        view.first_position as i32,
        (view.first_position + keys) as i32,
        None,
    )?
    .reshape(&[1, keys as i32])?;
    let causal = k_pos.le(&q_pos)?;
    Ok(Some(match kind {
        AttentionKind::Full => causal,
        AttentionKind::Sliding => {
            let in_window = q_pos.subtract(&k_pos)?.lt(Array::from_int(window as i32))?;
            logical_and(&causal, &in_window)?
        }
    }))
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
