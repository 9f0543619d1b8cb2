//! Per-request KV state: one buffer per KV-owning layer, trimmable for speculative rollback.
//!
//! Full-attention layers keep every key. Sliding layers keep the window plus a rollback
//! reserve: the attention of the next chunk needs the last `window - 1` keys, and a verify
//! step that rejects `n` drafted tokens needs `n` more keys older than that. Keys are kept in
//! temporal order (no ring), so a trim is always a length change; a trim deeper than what a
//! sliding buffer still holds is refused with [`TrimError`] instead of silently attending over
//! a wrong window. Buffers grow in steps and are written in place with slice updates.
//!
//! A sliding buffer forgets old keys by moving its first valid slot (`head`) forward, not by
//! reallocating: the buffer is compacted (the kept keys copied to the front of a fresh one)
//! only when its end is reached, about once every `GROWTH_STEP` tokens. A decode step
//! therefore adds two slice updates per KV-owning layer to the graph and copies nothing but
//! the new keys; its queries read the whole buffers through a slot mask ([`KvView`]).

use anyhow::Result;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::{Array, Dtype};
use std::sync::{Arc, Mutex, PoisonError};

use super::config::{AttentionKind, Gemma4Config};

/// Keys and values are allocated in multiples of this many positions.
const GROWTH_STEP: usize = 256;

/// A compaction keeps every position's slot modulo this many slots, so that the GPU's decode
/// attention, which sums a head's slots in shares of this size at fixed slots, sums a
/// verify window's queries as it sums decode steps' even when the cache was compacted in
/// between (the kernels check they agree: `decode_attention` of the `mlx-spec-kernels` crate).
pub const SLOT_ALIGNMENT: usize = 128;

/// Default number of positions a sliding buffer keeps beyond the window, so any verify
/// window up to this size can be rolled back.
pub const DEFAULT_ROLLBACK_RESERVE: usize = 64;

/// A trim that a sliding-window buffer cannot honour because the keys it would need were
/// already dropped.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot roll the KV cache back by {requested} tokens: layer {layer} keeps only {available}"
)]
pub struct TrimError {
    pub layer: usize,
    pub requested: usize,
    pub available: usize,
}

/// The K/V one attention call reads: keys for absolute positions `first_position ..`.
#[derive(Clone)]
pub struct KvView {
    pub keys: Array,
    pub values: Array,
    pub first_position: usize,
    /// Set for short query windows (decode, verification): `keys`/`values` are then the whole
    /// buffers, whose shape changes only when a buffer grows, and this additive `[T, capacity]`
    /// mask (0 or -inf, in the activation dtype) hides from each query the slots it must not
    /// see. A constant shape lets MLX reuse its matrix-product plans from one step to the next;
    /// a view that grows by one key per token needs new plans at every step, which costs more
    /// host time than the whole step's arithmetic.
    pub slot_mask: Option<Array>,
    /// The slots the first new query sees (its window's kept keys up to its own): with one
    /// query, what `slot_mask` leaves visible.
    pub first_query_slots: std::ops::Range<usize>,
    /// The slots each new query of a window sees, in order (what each row of `slot_mask`
    /// leaves visible); empty for a single query (its slots are `first_query_slots`) and for
    /// windows past [`MAX_MASKED_WINDOW`].
    pub query_slots: Vec<std::ops::Range<usize>>,
}

/// Query windows up to this many tokens attend over whole buffers with a slot mask.
pub const MAX_MASKED_WINDOW: usize = 64;

/// What a slot mask depends on (the queries are the last `tokens` kept positions); equal keys
/// give equal masks, so the layers of one kind (which all hold the same positions) share one
/// mask per step.
#[derive(Clone, Copy, PartialEq, Eq)]
struct MaskKey {
    tokens: usize,
    head: usize,
    start: usize,
    len: usize,
    capacity: usize,
}

/// The last mask built, shared by the layers of one kind of a cache (they see the same slots,
/// so one build serves them all within a forward). Behind a mutex so that a cache, like a
/// request holding it, can move to another thread.
type MaskMemo = Arc<Mutex<Option<(MaskKey, Array)>>>;

/// An additive `[rows, capacity]` mask: row `i` is 0 inside `visible(i)`, -inf elsewhere.
fn mask_array(
    rows: usize,
    capacity: usize,
    visible: impl Fn(usize) -> std::ops::Range<usize>,
    dtype: Dtype,
) -> Result<Array> {
    let mut values = vec![f32::NEG_INFINITY; rows * capacity];
    for i in 0..rows {
        let range = visible(i);
        values[i * capacity + range.start..i * capacity + range.end].fill(0.0);
    }
    let shape = [rows as i32, capacity as i32];
    Ok(match dtype {
        Dtype::Bfloat16 => {
            let v: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
            Array::from_slice(&v, &shape)
        }
        Dtype::Float16 => {
            let v: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
            Array::from_slice(&v, &shape)
        }
        _ => Array::from_slice(&values, &shape).as_dtype(dtype)?,
    })
}

/// `buffer` (`[1, heads, slots, D]`) with slots `from..to` replaced by `update` (`[1, heads,
/// to - from, D]`), as one slice-update operation. mlx-rs's `index_mut` drops the update's
/// leading unit axis and then restores it: two reshapes per write, on every KV-owning layer of
/// every step, which on a GPU cost host time like any other operation.
fn write_slots(buffer: &Array, update: &Array, from: i32, to: i32) -> Result<Array> {
    let s = buffer.shape();
    let expected = [s[0], s[1], to - from, s[3]];
    if s.len() != 4 || update.shape() != expected {
        anyhow::bail!(
            "KV write of shape {:?} into slots {from}..{to} of a {:?} buffer",
            update.shape(),
            s
        );
    }
    let start = [0, 0, from, 0];
    let stop = [s[0], s[1], to, s[3]];
    let strides = [1i32; 4];
    let stream = mlx_rs::Stream::new();
    // SAFETY: the result handle is created here and either handed to an owning `Array` or
    // freed; the inputs outlive the call; the index arrays hold four entries each.
    unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let rc = mlx_sys::mlx_slice_update(
            &mut out,
            buffer.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            4,
            stop.as_ptr(),
            4,
            strides.as_ptr(),
            4,
            stream.as_ptr(),
        );
        if rc != 0 {
            mlx_sys::mlx_array_free(out);
            anyhow::bail!("MLX refused the KV write into slots {from}..{to}");
        }
        Ok(Array::from_ptr(out))
    }
}

/// K/V of one layer: `[1, kv_heads, capacity, head_dim]`, valid in slots
/// `[head, head + len)`, slot `head` holding absolute position `start`.
pub struct LayerKv {
    kind: AttentionKind,
    window: usize,
    reserve: usize,
    keys: Option<Array>,
    values: Option<Array>,
    head: usize,
    start: usize,
    len: usize,
    /// Shared by the layers of this kind.
    mask_memo: MaskMemo,
}

impl LayerKv {
    fn new(kind: AttentionKind, window: usize, reserve: usize, mask_memo: MaskMemo) -> Self {
        LayerKv {
            mask_memo,
            kind,
            window,
            reserve,
            keys: None,
            values: None,
            head: 0,
            start: 0,
            len: 0,
        }
    }

    fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.shape()[2] as usize)
    }

    /// Number of tokens this layer has seen.
    pub fn end_position(&self) -> usize {
        self.start + self.len
    }

    /// The keys and values this layer keeps, oldest first (`[1, kv_heads, n, head_dim]`), and
    /// the absolute position of the first: the slots `head..head + len`, never the slots of
    /// forgotten or rolled-back positions. `None` before anything was stored. The arrays are
    /// slices of the live buffers, which the fused kernels write in place: read them before the
    /// next forward.
    pub fn kept(&self) -> Option<(Array, Array, usize)> {
        let (keys, values) = (self.keys.as_ref()?, self.values.as_ref()?);
        let (from, to) = (self.head as i32, (self.head + self.len) as i32);
        Some((
            keys.index((.., .., from..to, ..)),
            values.index((.., .., from..to, ..)),
            self.start,
        ))
    }

    /// Appends `[1, kv_heads, t, head_dim]` keys/values for positions `end_position()..` and
    /// returns what the new queries attend over: for windows up to [`MAX_MASKED_WINDOW`]
    /// tokens the whole buffers and a slot mask, for longer ones the visible keys.
    pub fn append(&mut self, k: &Array, v: &Array) -> Result<KvView> {
        let t = k.shape()[2] as usize;
        let slot = self.make_room(t, k.shape(), k.dtype())?;
        let (a, b) = (slot as i32, (slot + t) as i32);
        let keys = self.keys.as_ref().expect("allocated by make_room");
        self.keys = Some(write_slots(keys, k, a, b)?);
        let values = self.values.as_ref().expect("allocated by make_room");
        self.values = Some(write_slots(values, v, a, b)?);
        self.count_written(t, k.dtype())
    }

    /// For a kernel that writes one token's key and value into the buffers itself: makes
    /// room for it (`shape`: `[1, kv_heads, 1, head_dim]`) and returns the buffers and the
    /// slot to write. Follow with [`LayerKv::count_written`] once the write is in the graph.
    pub fn slot_for_next(&mut self, shape: &[i32], dtype: Dtype) -> Result<(Array, Array, usize)> {
        self.slots_for_next(1, shape, dtype)
    }

    /// [`LayerKv::slot_for_next`] for `t` tokens, written to the `t` slots from the one
    /// returned (`shape`: `[1, kv_heads, t, head_dim]`).
    pub fn slots_for_next(
        &mut self,
        t: usize,
        shape: &[i32],
        dtype: Dtype,
    ) -> Result<(Array, Array, usize)> {
        let slot = self.make_room(t, shape, dtype)?;
        let keys = self.keys.clone().expect("allocated by make_room");
        let values = self.values.clone().expect("allocated by make_room");
        Ok((keys, values, slot))
    }

    /// Forgets what no query can reach any more and grows the buffers if `t` more keys
    /// (each `shape` with `t` positions) do not fit; returns the first slot to write.
    fn make_room(&mut self, t: usize, shape: &[i32], dtype: Dtype) -> Result<usize> {
        let offset = self.end_position();
        if self.kind == AttentionKind::Sliding {
            // Forget keys no future query (nor a rollback within the reserve) can reach.
            let keep_from = offset.saturating_sub(self.window - 1 + self.reserve);
            if keep_from > self.start {
                let n = keep_from - self.start;
                self.head += n;
                self.start += n;
                self.len -= n;
            }
        }
        if self.head + self.len + t > self.capacity() {
            self.compact_and_grow(shape, dtype, self.len + t)?;
        }
        Ok(self.head + self.len)
    }

    /// Counts the `t` keys just written after the valid ones and returns the view the new
    /// queries attend over.
    pub fn count_written(&mut self, t: usize, dtype: Dtype) -> Result<KvView> {
        self.len += t;
        let offset = self.end_position() - t;
        // The earliest new query (at `offset`) sees the earliest key any of them needs.
        let first_position = self.first_visible(offset);
        let from = self.head + first_position - self.start;
        let to = self.head + self.len;
        let first_query_slots = from..self.head + offset - self.start + 1;
        let (keys, values) = match (&self.keys, &self.values) {
            (Some(k), Some(v)) => (k, v),
            _ => anyhow::bail!("KV cache: keys counted before any buffer exists"),
        };
        if t <= MAX_MASKED_WINDOW {
            return Ok(KvView {
                keys: keys.clone(),
                values: values.clone(),
                first_position,
                slot_mask: Some(self.slot_mask(t, dtype)?),
                first_query_slots,
                // (Not made for one token: a decode step would allocate it in every layer.)
                query_slots: if t > 1 {
                    (0..t).map(|i| self.query_visible(offset, i)).collect()
                } else {
                    Vec::new()
                },
            });
        }
        let (from, to) = (from as i32, to as i32);
        Ok(KvView {
            keys: keys.index((.., .., from..to, ..)),
            values: values.index((.., .., from..to, ..)),
            first_position,
            slot_mask: None,
            first_query_slots,
            query_slots: Vec::new(),
        })
    }

    /// The slots the query `i` of a window starting at position `offset` sees: the kept slots
    /// from its window's start up to its own.
    fn query_visible(&self, offset: usize, i: usize) -> std::ops::Range<usize> {
        let slot_of = |position: usize| self.head + position - self.start;
        let position = offset + i;
        slot_of(self.first_visible(position))..slot_of(position) + 1
    }

    /// The first position a query at `position` attends to: the first kept one, or for a
    /// sliding layer the start of its window.
    fn first_visible(&self, position: usize) -> usize {
        match self.kind {
            AttentionKind::Full => self.start,
            AttentionKind::Sliding => (position + 1).saturating_sub(self.window).max(self.start),
        }
    }

    /// The mask of the last `t` positions, just appended, as queries: each sees the kept slots
    /// from its window's start up to its own slot.
    fn slot_mask(&self, t: usize, dtype: Dtype) -> Result<Array> {
        let key = MaskKey {
            tokens: t,
            head: self.head,
            start: self.start,
            len: self.len,
            capacity: self.capacity(),
        };
        let mut memo = self
            .mask_memo
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((k, mask)) = memo.as_ref() {
            if *k == key {
                return Ok(mask.clone());
            }
        }
        let offset = self.end_position() - t;
        let visible = |i: usize| self.query_visible(offset, i);
        let mask = mask_array(t, self.capacity(), visible, dtype)?;
        *memo = Some((key, mask.clone()));
        Ok(mask)
    }

    /// Moves the valid slots to the front of a fresh buffer with room for `needed` slots plus
    /// at least one growth step (so a sliding buffer compacts once per step, not per token).
    /// The front is kept at the old first slot modulo [`SLOT_ALIGNMENT`], so every position
    /// keeps its slot modulo that: a query's slots fall into the same shares of the GPU's
    /// decode attention whenever its buffer was compacted.
    fn compact_and_grow(&mut self, shape: &[i32], dtype: Dtype, needed: usize) -> Result<()> {
        let lead = self.head % SLOT_ALIGNMENT;
        let capacity = (lead + needed + GROWTH_STEP).div_ceil(GROWTH_STEP) * GROWTH_STEP;
        let fresh_shape = [
            shape[0],
            shape[1],
            (capacity - lead - self.len) as i32,
            shape[3],
        ];
        let lead_shape = [shape[0], shape[1], lead as i32, shape[3]];
        let (from, to) = (self.head as i32, (self.head + self.len) as i32);
        let moved = |old: &Option<Array>| -> Result<Array> {
            let fresh = zeros_dtype(&fresh_shape, dtype)?;
            let mut parts = Vec::with_capacity(3);
            if lead > 0 {
                parts.push(zeros_dtype(&lead_shape, dtype)?);
            }
            if let Some(old) = old {
                parts.push(old.index((.., .., from..to, ..)));
            }
            parts.push(fresh);
            Ok(if parts.len() == 1 {
                parts.pop().expect("one part")
            } else {
                concatenate(&parts, 2)?
            })
        };
        self.keys = Some(moved(&self.keys)?);
        self.values = Some(moved(&self.values)?);
        self.head = lead;
        Ok(())
    }

    /// Forgets the last `n` positions.
    fn trimmable(&self) -> usize {
        match self.kind {
            AttentionKind::Full => self.len,
            // After the trim the next query (at end - n) must still see back `window - 1`.
            AttentionKind::Sliding if self.start == 0 => self.len,
            AttentionKind::Sliding => (self.len + 1).saturating_sub(self.window),
        }
    }

    fn trim(&mut self, layer: usize, n: usize) -> Result<(), TrimError> {
        let available = self.trimmable();
        if n > available {
            return Err(TrimError {
                layer,
                requested: n,
                available,
            });
        }
        self.len -= n;
        Ok(())
    }
}

/// The KV state of one sequence: a buffer per KV-owning layer (`None` for sharers).
pub struct ModelCache {
    layers: Vec<Option<LayerKv>>,
    offset: usize,
}

impl ModelCache {
    pub fn new(config: &Gemma4Config) -> Self {
        Self::with_reserve(config, DEFAULT_ROLLBACK_RESERVE)
    }

    /// A cache whose sliding layers can roll back up to `reserve` tokens at any time.
    pub fn with_reserve(config: &Gemma4Config, reserve: usize) -> Self {
        let (full_masks, sliding_masks) = (MaskMemo::default(), MaskMemo::default());
        let layers = config
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let memo = match l.kind {
                    AttentionKind::Full => full_masks.clone(),
                    AttentionKind::Sliding => sliding_masks.clone(),
                };
                l.owns_kv(i)
                    .then(|| LayerKv::new(l.kind, config.sliding_window.max(1), reserve, memo))
            })
            .collect();
        ModelCache { layers, offset: 0 }
    }

    /// Number of tokens processed so far (the position of the next token).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Layer `i`'s K/V state (`None` for a layer that shares another's).
    pub fn layer(&self, i: usize) -> Option<&LayerKv> {
        self.layers.get(i).and_then(Option::as_ref)
    }

    pub(crate) fn layer_mut(&mut self, i: usize) -> Option<&mut LayerKv> {
        self.layers[i].as_mut()
    }

    pub(crate) fn advance(&mut self, t: usize) {
        self.offset += t;
    }

    /// Rolls every layer back by `n` tokens (rejected drafts). On error nothing changes.
    pub fn trim(&mut self, n: usize) -> Result<(), TrimError> {
        for (i, layer) in self.layers.iter().enumerate() {
            if let Some(l) = layer {
                // Check every layer first so a refusal leaves the cache consistent.
                if n > l.trimmable() {
                    return Err(TrimError {
                        layer: i,
                        requested: n,
                        available: l.trimmable(),
                    });
                }
            }
        }
        for (i, layer) in self.layers.iter_mut().enumerate() {
            if let Some(l) = layer {
                l.trim(i, n)?;
            }
        }
        self.offset -= n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{count_operations, export_dot};

    #[test]
    fn a_kv_write_is_one_slice_update_of_the_given_slots() {
        let buffer = Array::zeros::<f32>(&[1, 2, 4, 2]).unwrap();
        buffer.eval().unwrap();
        let update = Array::from_slice(&[1f32, 2.0, 3.0, 4.0], &[1, 2, 1, 2]);
        let written = write_slots(&buffer, &update, 2, 3).unwrap();

        let path = std::env::temp_dir().join(format!("mlx-spec-kv-{}.dot", std::process::id()));
        export_dot(&written, &path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        let counts = count_operations(&text);
        assert_eq!(counts.len(), 1, "{counts:?}");
        assert_eq!(counts.get("SliceUpdate"), Some(&1), "{counts:?}");

        // Head h, slot s, element e sits at (h * 4 + s) * 2 + e.
        let mut expected = [0f32; 16];
        expected[2 * 2..2 * 2 + 2].copy_from_slice(&[1.0, 2.0]);
        expected[(4 + 2) * 2..(4 + 2) * 2 + 2].copy_from_slice(&[3.0, 4.0]);
        assert_eq!(written.as_slice::<f32>(), &expected[..]);
    }

    #[test]
    fn a_kv_write_of_the_wrong_shape_is_refused() {
        let buffer = Array::zeros::<f32>(&[1, 2, 4, 2]).unwrap();
        let update = Array::zeros::<f32>(&[1, 2, 1, 2]).unwrap();
        let err = write_slots(&buffer, &update, 1, 3).unwrap_err();
        assert!(err.to_string().contains("slots 1..3"), "{err}");
    }

    /// The positions the mask of a one-token view leaves visible (entries equal to 0).
    fn visible_in_mask(view: &KvView) -> Vec<usize> {
        let mask = view
            .slot_mask
            .as_ref()
            .unwrap()
            .as_dtype(Dtype::Float32)
            .unwrap();
        mask.as_slice::<f32>()
            .iter()
            .enumerate()
            .filter(|(_, v)| **v == 0.0)
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn a_single_query_sees_exactly_its_first_query_slots() {
        for kind in [AttentionKind::Sliding, AttentionKind::Full] {
            let mut layer = LayerKv::new(kind, 4, 2, MaskMemo::default());
            // A prompt of three, then single tokens past a compaction of the sliding buffer.
            let prompt = Array::zeros::<f32>(&[1, 1, 3, 2]).unwrap();
            layer.append(&prompt, &prompt).unwrap();
            let mut compactions = 0;
            for step in 0..1100 {
                let head = layer.head;
                let token =
                    Array::full::<f32>(&[1, 1, 1, 2], Array::from_f32(step as f32)).unwrap();
                let view = layer.append(&token, &token).unwrap();
                // Only a compaction moves the first slot back.
                compactions += usize::from(layer.head < head);
                let seen: Vec<usize> = view.first_query_slots.clone().collect();
                assert_eq!(seen, visible_in_mask(&view), "{kind:?}, step {step}");
                if kind == AttentionKind::Sliding {
                    assert_eq!(seen.len(), 4, "a window of four, step {step}");
                }
            }
            if kind == AttentionKind::Sliding {
                assert!(compactions >= 2, "the buffer compacted {compactions} times");
            }
        }
    }

    #[test]
    fn a_cache_filled_on_one_thread_serves_steps_on_another() {
        // A server may hand a request, cache and all, to another thread between rounds.
        let memo = MaskMemo::default();
        let mut layer = LayerKv::new(AttentionKind::Sliding, 4, 2, memo.clone());
        let prompt = Array::zeros::<f32>(&[1, 1, 3, 2]).unwrap();
        layer.append(&prompt, &prompt).unwrap();
        let seen = std::thread::spawn(move || {
            let token = Array::ones::<f32>(&[1, 1, 1, 2]).unwrap();
            let view = layer.append(&token, &token).unwrap();
            (
                view.first_query_slots.clone().collect::<Vec<_>>(),
                visible_in_mask(&view),
            )
        })
        .join()
        .unwrap();
        assert_eq!(seen.0, seen.1);
        assert_eq!(seen.0.len(), 4, "the new token sees a window of four");
        // The mask the other thread built is the one the memo now holds.
        assert!(memo.lock().unwrap().is_some());
    }

    #[test]
    fn a_compaction_keeps_every_position_slot_modulo_the_alignment() {
        let mut layer = LayerKv::new(AttentionKind::Sliding, 16, 4, MaskMemo::default());
        let prompt = Array::zeros::<f32>(&[1, 1, 5, 2]).unwrap();
        layer.append(&prompt, &prompt).unwrap();
        // The slot of position p is head + p - start: its offset from p must not change.
        let offset = |l: &LayerKv| (l.head + SLOT_ALIGNMENT * 64 - l.start) % SLOT_ALIGNMENT;
        let first = offset(&layer);
        let mut compactions = 0;
        for step in 0..2000 {
            let head = layer.head;
            let t = 1 + step % 3;
            let window = Array::zeros::<f32>(&[1, 1, t, 2]).unwrap();
            layer.append(&window, &window).unwrap();
            // Forgetting moves the first slot forward; only a compaction moves it back.
            if layer.head < head {
                compactions += 1;
            }
            assert_eq!(offset(&layer), first, "step {step}");
            assert!(layer.head + layer.len <= layer.capacity());
        }
        assert!(compactions > 3, "the buffer compacted {compactions} times");
    }

    #[test]
    fn each_query_of_a_window_sees_the_slots_of_its_mask_row() {
        for kind in [AttentionKind::Sliding, AttentionKind::Full] {
            let mut layer = LayerKv::new(kind, 4, 8, MaskMemo::default());
            let prompt = Array::zeros::<f32>(&[1, 1, 2, 2]).unwrap();
            layer.append(&prompt, &prompt).unwrap();
            // Windows of three past several compactions.
            let mut compactions = 0;
            for step in 0..600 {
                let head = layer.head;
                let window = Array::zeros::<f32>(&[1, 1, 3, 2]).unwrap();
                let view = layer.append(&window, &window).unwrap();
                compactions += usize::from(layer.head < head);
                let mask = view
                    .slot_mask
                    .as_ref()
                    .unwrap()
                    .as_dtype(Dtype::Float32)
                    .unwrap();
                let capacity = mask.shape()[1] as usize;
                let values = mask.as_slice::<f32>();
                assert_eq!(view.query_slots.len(), 3);
                assert_eq!(view.query_slots[0], view.first_query_slots);
                for (i, slots) in view.query_slots.iter().enumerate() {
                    let row = &values[i * capacity..(i + 1) * capacity];
                    let shown: Vec<usize> = (0..capacity).filter(|&s| row[s] == 0.0).collect();
                    let expected: Vec<usize> = slots.clone().collect();
                    assert_eq!(shown, expected, "{kind:?}, step {step}, query {i}");
                }
                // Rejected drafts: the cache rolls back one of the three, as a verify step does.
                layer.trim(0, 1).unwrap();
            }
            if kind == AttentionKind::Sliding {
                assert!(compactions >= 1, "the buffer compacted {compactions} times");
            }
        }
    }

    #[test]
    fn a_kernel_write_takes_the_slot_append_would_write() {
        let mut by_append = LayerKv::new(AttentionKind::Sliding, 4, 2, MaskMemo::default());
        let mut by_kernel = LayerKv::new(AttentionKind::Sliding, 4, 2, MaskMemo::default());
        let token = Array::zeros::<f32>(&[1, 1, 1, 2]).unwrap();
        let mut compactions = 0;
        for step in 0..1100 {
            let head = by_kernel.head;
            let appended = by_append.append(&token, &token).unwrap();
            let (keys, _, slot) = by_kernel
                .slot_for_next(&[1, 1, 1, 2], Dtype::Float32)
                .unwrap();
            assert_eq!(keys.shape(), appended.keys.shape(), "step {step}");
            let counted = by_kernel.count_written(1, Dtype::Float32).unwrap();
            // The slot written is the last valid one, as after the append.
            assert_eq!(slot, by_kernel.head + by_kernel.len - 1, "step {step}");
            assert_eq!(
                (by_kernel.head, by_kernel.len, by_kernel.start),
                (by_append.head, by_append.len, by_append.start),
                "step {step}"
            );
            assert_eq!(
                counted.first_query_slots, appended.first_query_slots,
                "step {step}"
            );
            compactions += usize::from(by_kernel.head < head);
        }
        assert!(compactions >= 2, "the buffer compacted {compactions} times");
    }
}
