//! Attention of one query token over a layer's whole K/V buffers, with the additive slot mask
//! of the cache (0 where visible, -inf elsewhere), given as the range of visible slots: the
//! single-token case of
//! `model::gemma4::attention`'s buffer attention, as one kernel.
//!
//! The slots of each query head are split over several blocks of eight warps, about 128 slots
//! a block (a decode step has few heads, and one block per head leaves most of the device
//! idle). A warp takes its share of the block's slots at once (up to 16 slots for a head of
//! 256 in half precision, 8 for 512; the first version took four), each
//! lane loading 16 bytes of a row at a time. Two paths:
//! * a share of one round of the block's warps (the default 128-slot share of a head of 256)
//!   requests all its key and value rows at once, together with the visible range
//!   (host-visible memory: a bus crossing), and masks only then: one trip to memory;
//! * a longer share reads the range first, then takes rounds of keys and rounds of values,
//!   reading only the rows the mask shows (an unfilled buffer costs nothing).
//!
//! With four slots a warp, one round meant 32-slot shares: fewer trips, but four times the
//! blocks and a merge of four times the shares; in one H200 process (E4B, 512 tokens) it
//! decoded at 206 tok/s against 216 for 128-slot shares of several rounds. Wide rounds give
//! 128-slot shares one trip without more blocks. Softmax over the block's scores in shared
//! memory; each lane sums its elements of the weighted values, then the warps' sums are added. The last of a head's blocks to finish merges the head's
//! blocks (one launch: the host cost of a second one outweighed its device time).
//! Scale 1.0 (Gemma 4 normalises q and k). Scores are rounded to the activation dtype as
//! MLX's product rounds them; the softmax and the weighted sum run in float32.

use std::cell::RefCell;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

use super::{step_ints, CudaKernel, TemplateArg, REDUCE_HEADER};

const SOURCE: &str = include_str!("cuda/decode_attention.cu");

const WARPS: i32 = 8;
/// Slots one block scores at most (its shared score buffer).
const MAX_CHUNK: usize = 1024;
/// Slots a block takes when there are enough of them.
pub const DEFAULT_SHARE_SLOTS: usize = 128;
// A compacted cache keeps each slot modulo the share size (see `SLOT_ALIGNMENT`).
const _: () = assert!(DEFAULT_SHARE_SLOTS == mlx_spec_model::gemma4::cache::SLOT_ALIGNMENT);

/// Whether a warp takes its whole share of a block's slots at once (up to 16 slots of a head
/// of 256, 8 of 512), so that a block's default share is one trip to memory, rather than four
/// slots at a time (the first version, measured slower and removed; the kernel's `WIDE`).
const WIDE_ROUNDS: bool = true;

/// At most this many blocks per head.
const MAX_SPLITS: usize = 64;

/// A head's slots are split into shares of a fixed size at fixed slots
/// ([`DEFAULT_SHARE_SLOTS`], larger only past 64 shares), rather than into a power of two of
/// shares sized by the buffer (the first way, removed). With the cache keeping each position's
/// slot modulo that size when it compacts ([`mlx_spec_model::gemma4::cache`]), a query's slots
/// then fall into the same shares whatever the buffer's capacity, so a verify window's queries
/// sum exactly as the decode steps of the same positions sum, even when the window made the
/// buffer grow or compact at another position (BENCHMARKS.md: the same fixtures' tokens, no
/// slower than the first way).
///
/// Slots a share takes for a buffer of `slots` (a power of two, at least
/// [`DEFAULT_SHARE_SLOTS`], enough for at most [`MAX_SPLITS`] shares), and how many shares.
fn aligned_split(slots: usize) -> (usize, usize) {
    aligned_split_of(slots, DEFAULT_SHARE_SLOTS)
}

/// [`aligned_split`] for shares of at least `share` slots.
fn aligned_split_of(slots: usize, share: usize) -> (usize, usize) {
    let chunk = share.max(slots.div_ceil(MAX_SPLITS).next_power_of_two());
    (chunk, slots.div_ceil(chunk).max(1))
}

thread_local! {
    static KERNEL: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
}

/// How many blocks split the slots of one head: a power of two (few compiled variants as a
/// buffer grows) giving each about [`DEFAULT_SHARE_SLOTS`] slots; `None` when the kernel does not
/// serve the shape: rows must split into 16-byte loads over a warp (`head_dim` a multiple of
/// 256 in half precision, 128 in float32: Gemma 4's 256 and 512), and a block's share must
/// fit its score buffer.
pub fn splits_for(slots: usize, head_dim: usize, dtype: Dtype) -> Option<usize> {
    let element = match dtype {
        Dtype::Float32 => 4,
        Dtype::Bfloat16 | Dtype::Float16 => 2,
        _ => return None,
    };
    if head_dim == 0 || (head_dim * element) % (32 * 16) != 0 || slots == 0 {
        return None;
    }
    let (chunk, splits) = aligned_split(slots);
    (chunk <= MAX_CHUNK).then_some(splits)
}

/// `q`: `[1, heads, 1, D]`; `keys`, `values`: `[1, kv_heads, slots, D]`; `visible`: the
/// slots the query attends to (what the cache's slot mask leaves visible), and optionally the
/// same two values already in device memory (the attention-heads kernel's
/// [`super::attention_heads::AttentionHeads::step_copy`]), read there instead of across the bus. Returns `[1, heads * D]`. `splits` is what [`splits_for`] gave
/// for the shape (the caller asks it first, to know whether the kernel serves the shape);
/// `counters` come from [`super::products::new_counters`] (one per query head), one set per
/// call site (calls of one site never
/// overlap: each step's depends on the previous step's token).
///
/// Every (head, share of the slots) block computes its share's softmax maximum, sum and
/// weighted sum of values; the last of a head's blocks to finish merges them. The
/// probabilities therefore stay in float32 until the end, where MLX's softmax rounds them to
/// the activation dtype before the product with the values: the same function, computed
/// slightly more precisely in half precision (identical roundings in float32).
pub fn decode_attention(
    q: &Array,
    keys: &Array,
    values: &Array,
    visible: std::ops::Range<usize>,
    visible_on_device: Option<&Array>,
    splits: usize,
    counters: &Array,
) -> Result<Array> {
    let (heads, slots) = (q.shape()[1], keys.shape()[2]);
    if counters.size() < heads as usize || counters.dtype() != Dtype::Uint32 {
        bail!("decode_attention needs {heads} uint32 counters, got {counters:?}");
    }
    if visible.end > slots as usize || visible.start > visible.end {
        bail!("decode_attention: slots {visible:?} outside a buffer of {slots}");
    }
    let visible = match visible_on_device {
        Some(copy) if copy.dtype() == Dtype::Int32 && copy.size() >= 2 => copy.clone(),
        Some(copy) => bail!("decode_attention: visible slots in {copy:?}, not int32 x 2"),
        None => step_ints(&[visible.start as i32, visible.end as i32])?,
    };
    launch(q, keys, values, &visible, 1, 0, splits, counters)
}

/// Attention of a window of queries (`q`: `[T, heads, D]`, a verify window's, at consecutive
/// positions) over the layer's whole K/V buffers, query `t` over `query_slots[t]` (the
/// cache's view of the window); returns `[T, heads * D]`. Each query's row is what
/// [`decode_attention`] gives for that query alone over the same buffers, bit for bit (the
/// same blocks, shares and merge). `counters`: one per query head and token, the call site's.
///
/// The slots reach the kernel as two integers (8 bytes, which MLX keeps in host-visible
/// memory; a longer host-made array would live in managed memory, paged in at the kernel's
/// first touch): the first kept slot and the end of query 0's slots. Query `t` sees up to
/// `t` slots more, from `window` slots before its end (a sliding layer's window; none for a
/// full-attention layer): checked against `query_slots` here.
pub fn window_attention(
    q: &Array,
    keys: &Array,
    values: &Array,
    query_slots: &[std::ops::Range<usize>],
    window: Option<usize>,
    splits: usize,
    counters: &Array,
) -> Result<Array> {
    let (tokens, heads) = (q.shape()[0], q.shape()[1]);
    if q.ndim() != 3 || tokens < 1 || query_slots.len() != tokens as usize {
        bail!(
            "window_attention: queries {:?} for {} visible ranges, expected [T, heads, D]",
            q.shape(),
            query_slots.len()
        );
    }
    if counters.size() < (tokens * heads) as usize || counters.dtype() != Dtype::Uint32 {
        bail!(
            "window_attention needs {} uint32 counters, got {counters:?}",
            tokens * heads
        );
    }
    let slide = window.unwrap_or(1 << 30);
    let kept = query_slots.iter().map(|r| r.start).min().unwrap_or(0);
    let end = query_slots[0].end;
    let derived = |t: usize| (end + t).saturating_sub(slide).max(kept)..end + t;
    if let Some(t) = (0..tokens as usize).find(|&t| query_slots[t] != derived(t)) {
        bail!(
            "window_attention: query {t} sees slots {:?}, not the {:?} its window gives",
            query_slots[t],
            derived(t)
        );
    }
    if end + tokens as usize - 1 > keys.shape()[2] as usize {
        bail!(
            "window_attention: slots past a buffer of {}",
            keys.shape()[2]
        );
    }
    let visible = step_ints(&[kept as i32, end as i32])?;
    launch(
        q,
        keys,
        values,
        &visible,
        tokens,
        slide as i32,
        splits,
        counters,
    )
}

/// Adds the kernel over `tokens` queries to the graph (`slide`: 0 for one query whose slots
/// `visible` gives, else the window's slide, see [`window_attention`]).
#[allow(clippy::too_many_arguments)]
fn launch(
    q: &Array,
    keys: &Array,
    values: &Array,
    visible: &Array,
    tokens: i32,
    slide: i32,
    splits: usize,
    counters: &Array,
) -> Result<Array> {
    // [1, heads, 1, D] for one query, [T, heads, D] for a window.
    let heads = q.shape()[1];
    let d = q.shape()[q.ndim() - 1];
    let (kv_heads, slots) = (keys.shape()[1], keys.shape()[2]);
    let fixed_chunk = aligned_split(slots as usize).0 as i32;
    let splits = splits as i32;
    KERNEL.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(CudaKernel::new(
                "decode_attention",
                &["q", "k", "v", "visible", "counter"],
                &["partial", "out"],
                SOURCE,
                REDUCE_HEADER,
            )?);
        }
        let kernel = slot.as_ref().expect("just built");
        let threads = 32 * WARPS;
        let mut out = kernel.apply(
            &[q, keys, values, visible, counters],
            &[
                (&[tokens * heads * splits, d + 2], Dtype::Float32),
                (&[tokens, heads * d], q.dtype()),
            ],
            (heads * splits * threads, tokens, 1),
            (threads, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(q.dtype())),
                (c"D", TemplateArg::Int(d)),
                (c"GROUP", TemplateArg::Int(heads / kv_heads)),
                (c"WARPS", TemplateArg::Int(WARPS)),
                (c"SPLITS", TemplateArg::Int(splits)),
                (c"SLOTS", TemplateArg::Int(slots)),
                (c"MAX_CHUNK", TemplateArg::Int(MAX_CHUNK as i32)),
                (c"WIDE", TemplateArg::Bool(WIDE_ROUNDS)),
                (c"SLIDE", TemplateArg::Int(slide)),
                (c"FIXED_CHUNK", TemplateArg::Int(fixed_chunk)),
            ],
        )?;
        Ok(out.remove(1))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_whose_slots_do_not_follow_its_positions_is_refused() {
        let q = Array::zeros::<f32>(&[2, 8, 256]).unwrap();
        let kv = Array::zeros::<f32>(&[1, 2, 64, 256]).unwrap();
        let counters = Array::zeros::<u32>(&[16]).unwrap();
        // The second query must see one slot more than the first.
        let err = window_attention(&q, &kv, &kv, &[0..10, 0..10], None, 1, &counters).unwrap_err();
        assert!(err.to_string().contains("query 1"), "{err}");
        // A sliding window of 8: the second query's first slot moves on too.
        let err =
            window_attention(&q, &kv, &kv, &[2..10, 2..11], Some(8), 1, &counters).unwrap_err();
        assert!(err.to_string().contains("query 1"), "{err}");
        // Too few counters for two tokens of eight heads.
        let few = Array::zeros::<u32>(&[8]).unwrap();
        let err = window_attention(&q, &kv, &kv, &[0..10, 0..11], None, 1, &few).unwrap_err();
        assert!(err.to_string().contains("counters"), "{err}");
        // Slots past the buffer.
        let err = window_attention(&q, &kv, &kv, &[0..64, 0..65], None, 1, &counters).unwrap_err();
        assert!(err.to_string().contains("past a buffer"), "{err}");
    }

    #[test]
    fn aligned_shares_keep_their_size_as_a_buffer_grows() {
        // The same 128-slot shares whatever the capacity: a slot stays in share slot / 128.
        for slots in [100, 768, 1024, 1280, 8192] {
            let (chunk, splits) = aligned_split_of(slots, 128);
            assert_eq!(chunk, 128, "{slots} slots");
            assert_eq!(splits, slots.div_ceil(128));
        }
        // Past 64 shares they grow, in powers of two, to stay at 64 at most.
        assert_eq!(aligned_split_of(8193, 128), (256, 33));
        assert_eq!(aligned_split_of(40_000, 128), (1024, 40));
        assert_eq!(aligned_split_of(70_000, 128).0, 2048);
    }

    #[test]
    fn splits_slots_into_block_sized_shares_for_gemma_head_sizes() {
        // The default: shares of 128 slots at multiples of 128.
        assert_eq!(splits_for(600, 256, Dtype::Bfloat16), Some(5));
        assert_eq!(splits_for(100, 512, Dtype::Float32), Some(1));
        assert_eq!(splits_for(4096, 512, Dtype::Bfloat16), Some(32));
        // At most 64 blocks a head, their shares growing past 8 192 slots; beyond 64 x 1024
        // slots the MLX operations take over.
        assert_eq!(splits_for(40_000, 256, Dtype::Bfloat16), Some(40));
        assert_eq!(splits_for(70_000, 256, Dtype::Bfloat16), None);
        // Rows that do not split into 16-byte loads over a warp.
        assert_eq!(splits_for(100, 64, Dtype::Bfloat16), None);
        assert_eq!(splits_for(100, 128, Dtype::Float32), Some(1));
        assert_eq!(splits_for(100, 256, Dtype::Int32), None);
    }
}
