//! Gemma 4 self-attention: q/k norms, weightless v norm, per-kind RoPE, scale 1.0, GQA, and
//! KV sharing (sharer layers project only Q and read a donor layer's K/V).
//!
//! [`Attention::forward`] is three steps, each public so that a faster path of the decode
//! step ([`super::fast_path`]) can replace one and keep the others: the projections, the
//! heads (norms, RoPE, and the cache write that yields the view the queries attend over),
//! and the attention itself.

use anyhow::Result;
use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};

use super::norm::rms_norm;
use mlx_rs::ops::{arange, logical_and, matmul, softmax_axis};
use mlx_rs::Array;

use super::cache::{KvView, LayerKv};
use super::config::{AttentionKind, Gemma4Config, LayerPlan};
use super::linear::{Linear, Loader};
use super::rope::Rope;

/// K/V projections, present only on KV-owning layers.
pub struct KvProjections {
    pub k_proj: Linear,
    /// `None` when V is the k_proj output (K=V full layers).
    pub v_proj: Option<Linear>,
    pub k_norm: Array,
}

pub struct Attention {
    pub kind: AttentionKind,
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub head_dim: i32,
    pub eps: f32,
    pub q_proj: Linear,
    pub q_norm: Array,
    pub o_proj: Linear,
    /// `None` on a KV-sharing layer.
    pub kv: Option<KvProjections>,
    pub rope: Rope,
}

/// Raw projections of one call: q, and on a KV-owning layer k and v (k twice for K=V).
pub type Projections = (Array, Option<(Array, Array)>);

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
        })
    }

    pub fn o_proj(&self) -> &Linear {
        &self.o_proj
    }

    /// The heads' output width (`heads * head_dim`), the input of `o_proj`.
    pub fn width(&self) -> usize {
        (self.num_heads * self.head_dim) as usize
    }

    /// Attends `rms_norm(x, input_norm)` (`x`: `[T, hidden]`, first token at `offset`) and
    /// returns the heads' output `[T, heads * head_dim]`, before `o_proj` (the layer applies
    /// that product with its residual update). A KV-owning layer appends its new K/V to `cache`
    /// and returns the view it attended over so sharers can reuse it; a sharer passes the
    /// donor's view in `shared`.
    pub fn forward(
        &self,
        x: &Array,
        input_norm: &Array,
        offset: usize,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
        window: usize,
    ) -> Result<(Array, Option<KvView>)> {
        let t = x.shape()[0] as usize;
        let (q_raw, kv_raw) = self.projections(x, input_norm, cache.is_some())?;
        let (q, kv) = self.rotated_heads(&q_raw, kv_raw.as_ref(), t, offset)?;
        let (view, produced) = self.store(kv, cache, shared)?;
        let out = self.attend(&q, &view, offset, t, window)?;
        Ok((out, produced))
    }

    /// Raw q and, on a KV-owning layer (`owning`), raw k and v projections of
    /// `rms_norm(x, input_norm)`.
    pub fn projections(&self, x: &Array, input_norm: &Array, owning: bool) -> Result<Projections> {
        let kv = self.kv.as_ref().filter(|_| owning);
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

    /// Queries `[1, heads, T, head_dim]` from raw projections (`t` tokens from `offset`):
    /// q RMSNorm and RoPE; with raw k and v, the keys (k RMSNorm and RoPE) and values (the
    /// weightless v RMSNorm) of the same layout.
    pub fn rotated_heads(
        &self,
        q_raw: &Array,
        kv_raw: Option<&(Array, Array)>,
        t: usize,
        offset: usize,
    ) -> Result<(Array, Option<(Array, Array)>)> {
        let (t, nh, nkv, hd) = (t as i32, self.num_heads, self.num_kv_heads, self.head_dim);
        let q = rms_norm(
            &heads_first(q_raw, t, nh, hd)?,
            Some(&self.q_norm),
            self.eps,
        )?;
        let q = self.rope.apply(&q, offset)?;
        let kv = match (kv_raw, &self.kv) {
            (Some((k_raw, v_raw)), Some(projections)) => {
                // RMSNorm acts on the last axis (head_dim), so it commutes with the transpose.
                let k = rms_norm(
                    &heads_first(k_raw, t, nkv, hd)?,
                    Some(&projections.k_norm),
                    self.eps,
                )?;
                let k = self.rope.apply(&k, offset)?;
                let v = rms_norm(&heads_first(v_raw, t, nkv, hd)?, None, self.eps)?;
                Some((k, v))
            }
            _ => None,
        };
        Ok((q, kv))
    }

    /// The view the queries attend over, and the one a KV-owning layer leaves for its
    /// sharers: new keys and values appended to `cache`, or the donor's view (`shared`) on a
    /// sharing layer.
    pub fn store(
        &self,
        kv: Option<(Array, Array)>,
        cache: Option<&mut LayerKv>,
        shared: Option<&KvView>,
    ) -> Result<(KvView, Option<KvView>)> {
        Ok(match (kv, cache) {
            (Some((k, v)), Some(cache)) => {
                let view = cache.append(&k, &v)?;
                (view.clone(), Some(view))
            }
            _ => (donor_view(shared)?, None),
        })
    }

    /// The attention of queries `q` (`[1, heads, T, head_dim]`, `t` tokens from `offset`) over
    /// `view`: `[T, heads * head_dim]`. Short windows over a cache's whole buffers use its
    /// slot mask; long ones (prefill chunks) MLX's attention over the visible keys.
    pub fn attend(
        &self,
        q: &Array,
        view: &KvView,
        offset: usize,
        t: usize,
        window: usize,
    ) -> Result<Array> {
        if let Some(slot_mask) = &view.slot_mask {
            return buffer_attention(q, view, slot_mask, self.num_kv_heads, self.head_dim);
        }
        let mask = attention_mask(self.kind, offset, t, view, window)?;
        let out = match &mask {
            Some(m) => scaled_dot_product_attention(
                q,
                &view.keys,
                &view.values,
                1.0,
                ScaledDotProductAttentionMask::Array(m),
                None,
            )?,
            None => scaled_dot_product_attention(q, &view.keys, &view.values, 1.0, None, None)?,
        };
        Ok(out
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[t as i32, self.num_heads * self.head_dim])?)
    }
}

/// The donor's view a KV-sharing layer attends over.
pub fn donor_view(shared: Option<&KvView>) -> Result<KvView> {
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
pub fn buffer_attention(
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
