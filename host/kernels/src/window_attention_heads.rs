//! The attention heads of a window of 2 to 8 tokens as one kernel, over dense or 4-bit weights: what
//! [`super::attention_heads`] does for one token (the input RMSNorm, the q/k/v products, the
//! head norms and RoPE, the write of the keys and values into the cache), each weight row read
//! once for all the window's tokens.
//!
//! Each token's queries, keys and values are the single-token kernel's bit for bit: the same
//! staging and norm of the input, each row's dot over the same pieces in the same order
//! (`weight_dot_window`: for 4-bit rows the single-token kernel's float or integer dots, each
//! token's chunk sums and integers made as that kernel makes them), the same head code at the
//! token's position. The keys and values go
//! to the `T` consecutive slots from the given one (the cache keeps keys in temporal order).
//! As in the single-token kernel, the buffers are inputs written in place, and the queries,
//! which every later reader of the buffers depends on, order the write before them.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::attention_heads::{is_row_contiguous, CacheSlot, HeadShape, HeadWeights};
use super::products::{element_bytes, THREADS, WARPS};
use super::{step_ints, PerSharedMemory, TemplateArg};

const SOURCE: &str = include_str!("cuda/window_attention_heads.cu");

/// Blocks of the kernel a multiprocessor holds: as many as the single-token kernel's
/// registers allow, at most, and as many as its shared memory leaves room for (227 KB a
/// multiprocessor on the H200, about 1 KB more a block for its static arrays and the system's
/// share).
fn resident_blocks_per_multiprocessor(shared: usize) -> i32 {
    let by_memory = (227 * 1024 / (shared + 1024)) as i32;
    by_memory.clamp(
        1,
        super::attention_heads::RESIDENT_BLOCKS_PER_MULTIPROCESSOR,
    )
}

/// Tokens a call takes at most.
pub const MAX_TOKENS: usize = super::window_post_attention::MAX_TOKENS;

thread_local! {
    static KERNELS: RefCell<PerSharedMemory> = RefCell::new(PerSharedMemory::new(
        "window_attention_heads",
        &super::attention_heads::INPUTS,
        &["q", "raw"],
        SOURCE,
        super::window_post_attention::rows_window_header(super::attention_heads::FINISH_HEAD),
    ));
}

/// Whether the kernel serves `tokens` tokens of width `hidden` with heads of `head_dim` in
/// `dtype` (the single-token kernel's head sizes; the staged inputs fit shared memory).
pub fn serves(tokens: usize, hidden: usize, head_dim: usize, dtype: Dtype) -> bool {
    let Some(e) = element_bytes(dtype) else {
        return false;
    };
    (2..=MAX_TOKENS).contains(&tokens)
        && super::attention_heads::serves(head_dim, dtype)
        && super::products::serves(hidden, dtype)
        && shared_bytes(tokens, hidden, e, 4) <= 200 * 1024
}

/// Bytes of dynamic shared memory for `tokens` staged inputs of `hidden` values, and over
/// 4-bit rows (`bits` 4) each token's chunk sums and integer scales, a float each per 32
/// values.
fn shared_bytes(tokens: usize, hidden: usize, element: usize, bits: i32) -> usize {
    let per_chunk = if bits == 0 { 0 } else { 2 * 4 };
    tokens * (hidden * element + hidden / 32 * per_chunk)
}

/// The query heads `[T, heads, D]` of the window `x` (`[T, hidden]`, positions `position..`),
/// its keys and values written into `cache` (slots `cache.slot..`) on a KV-owning layer, with
/// dense weights or 4-bit ones in one group size. `counter`: the call site's
/// ([`super::products::new_counters`], one per head whose rows the kernel makes). Where the
/// counters allow, the window's heads are finished as the single-token kernel finishes them:
/// each head, for every token of the window, by the last of the blocks that made its rows,
/// with the grid kept to one wave ([`super::attention_heads::rows_per_warp`]) (every head of
/// every token by the last block of the call was measured slower and removed;
/// BENCHMARKS.md). Check [`serves`].
#[allow(clippy::too_many_arguments)]
pub fn window_attention_heads(
    x: &Array,
    input_norm: &Array,
    eps: f32,
    weights: &HeadWeights,
    shape: &HeadShape,
    position: usize,
    cache: Option<CacheSlot>,
    counter: &Array,
) -> Result<Array> {
    let dtype = x.dtype();
    let (tokens, k) = (x.shape()[0], x.shape()[x.ndim() - 1]);
    let d = shape.head_dim;
    if x.ndim() != 2 || !serves(tokens as usize, k as usize, d as usize, dtype) {
        bail!(
            "window_attention_heads does not serve {:?} {dtype:?} with heads of {d}",
            x.shape()
        );
    }
    let nkv = match (&weights.kv, &cache) {
        (Some(_), Some(_)) => shape.kv_heads,
        (None, None) => 0,
        _ => {
            bail!("window_attention_heads: a KV-owning layer needs both its weights and its cache")
        }
    };
    let (bits, group) =
        weights.layout("window_attention_heads", k, shape.heads * d, nkv * d, dtype)?;
    let unread = super::post_attention::unread_input(dtype);
    let (wk, wv, k_norm, k_eq_v) = match weights.kv {
        Some((wk, wv, k_norm)) => (wk.inputs(), wv.unwrap_or(wk).inputs(), k_norm, wv.is_none()),
        // A sharing layer makes no key or value rows: one-element stand-ins.
        None => ([unread; 3], [unread; 3], weights.q_norm, false),
    };
    let (k_cache, v_cache, slot_values) = match &cache {
        Some(c) => {
            let capacity = c.keys.shape()[2];
            for buffer in [c.keys, c.values] {
                if buffer.shape() != [1, nkv, capacity, d]
                    || buffer.dtype() != dtype
                    || !is_row_contiguous(buffer)
                {
                    bail!(
                        "window_attention_heads: cache buffer {:?} {:?} cannot take the write in place",
                        buffer.shape(),
                        buffer.dtype()
                    );
                }
            }
            if c.slot + tokens as usize > capacity as usize {
                bail!(
                    "window_attention_heads: slots {}..{} past the buffer's {capacity}",
                    c.slot,
                    c.slot + tokens as usize
                );
            }
            (c.keys, c.values, [c.slot as i32, capacity])
        }
        None => (unread, unread, [0, 0]),
    };
    let slot = step_ints(&slot_values)?;
    let position = step_ints(&[position as i32])?;
    let rows = shape.heads * d + nkv * d * if k_eq_v { 1 } else { 2 };
    let [wq, wq_s, wq_b] = weights.q.inputs();
    let [wk, wk_s, wk_b] = wk;
    let [wv, wv_s, wv_b] = wv;
    let inputs = [
        x,
        input_norm,
        wq,
        wk,
        wv,
        weights.q_norm,
        k_norm,
        weights.periods,
        &position,
        &slot,
        counter,
        k_cache,
        v_cache,
        wq_s,
        wq_b,
        wk_s,
        wk_b,
        wv_s,
        wv_b,
    ];
    let element = element_bytes(dtype).unwrap_or(2);
    let shared = shared_bytes(tokens as usize, k as usize, element, bits);
    let (q_shape, raw_shape) = ([tokens, shape.heads, d], [tokens * rows]);
    let apart = counter.size() >= (rows / d) as usize && counter.dtype() == Dtype::Uint32;
    let resident =
        super::attention_heads::resident_blocks(resident_blocks_per_multiprocessor(shared));
    let rpw = super::attention_heads::rows_per_warp(apart, rows, d, resident);
    let per_head = apart && d % (WARPS * rpw) == 0;
    KERNELS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(shared, eps)?;
        let mut out = kernel.apply(
            &inputs,
            &[(&q_shape[..], dtype), (&raw_shape[..], dtype)],
            ((rows + WARPS * rpw - 1) / (WARPS * rpw) * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"D", TemplateArg::Int(d)),
                (c"NH", TemplateArg::Int(shape.heads)),
                (c"NKV", TemplateArg::Int(nkv)),
                (c"K_EQ_V", TemplateArg::Bool(k_eq_v)),
                (c"PER_HEAD", TemplateArg::Bool(per_head)),
                (c"RPW", TemplateArg::Int(rpw)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
                (c"INT_DOTS", TemplateArg::Bool(false)),
                (c"TOKENS", TemplateArg::Int(tokens)),
            ],
        )?;
        Ok(out.swap_remove(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_blocks_follow_the_staged_window() {
        // E4B, a window of 2 (10 KB staged): the register bound, four.
        assert_eq!(resident_blocks_per_multiprocessor(10 * 1024), 4);
        // The 12B, a window of 8 (61 KB staged): three fit.
        assert_eq!(resident_blocks_per_multiprocessor(8 * 3840 * 2), 3);
        // Never none.
        assert_eq!(resident_blocks_per_multiprocessor(400 * 1024), 1);
    }

    #[test]
    fn windows_of_gemma_head_sizes_are_served() {
        assert!(serves(4, 2560, 256, Dtype::Bfloat16));
        assert!(serves(8, 2560, 512, Dtype::Bfloat16));
        assert!(
            !serves(1, 2560, 256, Dtype::Bfloat16),
            "one token is the single-token kernel's"
        );
        assert!(!serves(9, 2560, 256, Dtype::Bfloat16));
        assert!(!serves(4, 2560, 96, Dtype::Bfloat16));
    }
}
