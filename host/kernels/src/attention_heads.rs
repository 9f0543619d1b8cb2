//! Everything between a decode token's hidden state and its attention, as one kernel: the
//! layer's input RMSNorm, the q/k/v products, the per-head q/k RMSNorm (with weights) and
//! RoPE, the weightless v RMSNorm, and the write of the new key and value into the layer's
//! cache buffers.
//!
//! Why one kernel: on CUDA a decode step costs what its operations cost on the host
//! (BENCHMARKS.md); this replaces four per KV-owning layer (the products, the head norms and
//! RoPE, two cache writes) and two per KV-sharing one.
//!
//! Products: as [`super::products::normed_products`], a warp per output row over the staged,
//! normed input; each row's result is rounded to the activation dtype (as MLX's product
//! rounds it) into a scratch output. The last block to finish (counted by the call site's
//! counter, which it resets) then takes the heads, a warp each: lane `l` holds the rotate-half
//! pairs `(p, p + D/2)` for `p = l, l + 32, ...`, so norm and rotation need no shared memory.
//! Roundings follow MLX's operations as in [`super::attention_inputs`].
//!
//! The cache write goes into the buffers given as inputs, in place: MLX sees the buffers only
//! as inputs, so the kernel's output `q`, which every later reader of the buffers depends on,
//! orders the write before them. This needs buffers MLX will not copy on the way in
//! (row-contiguous, as the cache allocates them), checked before the call.

use std::cell::RefCell;

use anyhow::{anyhow, bail, Result};
use mlx_rs::{Array, Dtype};

use super::affine4::HEADER as AFFINE4_HEADER;
use super::post_attention::Weight;
use super::products::{HEADER as PRODUCTS_HEADER, THREADS, WARPS};
use super::{step_ints, PerEpsilon, TemplateArg};

/// The head step of the attention-heads kernels, one token's head at a time (after the
/// products' header, for `warp_sum` and `EPS`); the window kernel
/// ([`super::window_attention_heads`]) calls it too, so a window's heads are a decode step's.
pub(crate) const FINISH_HEAD: &str = include_str!("cuda/attention_heads_finish.cuh");

const SOURCE: &str = include_str!("cuda/attention_heads.cu");

/// The kernel's inputs (also [`super::window_attention_heads`]'s); the attention-heads
/// kernel also takes `visible`.
pub(crate) const INPUTS: [&str; 19] = [
    "x",
    "nw",
    "wq",
    "wk",
    "wv",
    "q_w",
    "k_w",
    "periods",
    "position",
    "cache_slot",
    "counter",
    "k_cache",
    "v_cache",
    "wq_s",
    "wq_b",
    "wk_s",
    "wk_b",
    "wv_s",
    "wv_b",
];

/// The kernel's header: the products' and 4-bit helpers, and the step's integers handed on
/// in device memory (the kernel's `STEP_INTS_FROM_HEADS`; reading them across the bus was
/// measured slower and removed).
fn header() -> &'static str {
    Box::leak(
        format!("#define STEP_INTS_FROM_HEADS 1\n{PRODUCTS_HEADER}{AFFINE4_HEADER}{FINISH_HEAD}")
            .into_boxed_str(),
    )
}

thread_local! {
    // Its own name: MLX finds compiled kernels by name and template arguments.
    static KERNELS_STEP_INTS_FROM_HEADS: RefCell<PerEpsilon> = RefCell::new(
        PerEpsilon::new(
            "attention_heads_step_ints",
            INPUTS.iter().copied().chain(["visible"]).collect::<Vec<_>>().leak(),
            &["q", "raw", "step_copy"],
            SOURCE,
        )
        .with_header(header()),
    );
}

/// Blocks of the kernel a multiprocessor holds at least, as NVRTC compiles it for the H200:
/// 34-62 registers a thread in every shape of E4B and 12B, dense and 4-bit
/// (`bench/gpu/compile_check.sh`), so four to six blocks of 256 threads.
pub(crate) const RESIDENT_BLOCKS_PER_MULTIPROCESSOR: i32 = 4;

/// Rounds of eight rows each block makes, for `rows` rows in heads of `d`: 1, or with
/// `one_wave` the fewest of 1, 2, 4 that fit the grid in `resident` blocks while a block's
/// rows stay within one head. The 12B's q/k/v rows (8 192, 8 704 on full-attention layers)
/// need 1 024 and 1 088 blocks of eight warps, two and three waves of the 528 an H200 holds:
/// each wave would stage the input again, and the last one run nearly alone. Changes no value:
/// each row is the same warp-sized sum, only made by another warp (one row a warp in waves
/// was measured slower and removed; BENCHMARKS.md).
pub(crate) fn rows_per_warp(one_wave: bool, rows: i32, d: i32, resident: i32) -> i32 {
    let mut rpw = 1;
    if one_wave {
        while rpw < 4
            && (rows + WARPS * rpw - 1) / (WARPS * rpw) > resident
            && d % (WARPS * rpw * 2) == 0
        {
            rpw *= 2;
        }
    }
    rpw
}

/// Blocks of a kernel the device holds at once, `per_multiprocessor` on each multiprocessor.
pub(crate) fn resident_blocks(per_multiprocessor: i32) -> i32 {
    // Off CUDA the kernels do not run; an H200's 132 multiprocessors stand in.
    crate::cuda::cuda_multiprocessor_count().unwrap_or(132) * per_multiprocessor
}

/// Whether the kernel serves heads of `head_dim` in `dtype`: a warp holds a head as whole
/// rotate-half pairs per lane.
pub fn serves(head_dim: usize, dtype: Dtype) -> bool {
    head_dim >= 64
        && head_dim % 64 == 0
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
}

/// A layer's projection weights (`[rows, hidden]`, all dense or all 4-bit in one group size)
/// and head norms.
pub struct HeadWeights<'a> {
    pub q: Weight<'a>,
    /// Key and value projections with the key norm, on a KV-owning layer; `v` is `None` when
    /// the value is the key projection (K = V layers).
    pub kv: Option<(Weight<'a>, Option<Weight<'a>>, &'a Array)>,
    pub q_norm: &'a Array,
    /// RoPE periods `[D / 2]` (float32; infinite for pairs that are not rotated).
    pub periods: &'a Array,
}

impl<'a> HeadWeights<'a> {
    /// The one layout `(BITS, G)` of the projections for `k` inputs (`q_rows` query rows,
    /// `kv_rows` key and value rows each), all dense or all 4-bit in one group size; else an
    /// error naming `kernel` and the weight.
    pub(crate) fn layout(
        &self,
        kernel: &str,
        k: i32,
        q_rows: i32,
        kv_rows: i32,
        dtype: Dtype,
    ) -> Result<(i32, i32)> {
        let layout = |w: &Weight, rows: i32, what: &str| -> Result<(i32, i32)> {
            w.layout(rows, k, dtype, what)
                .map_err(|e| anyhow!("{kernel}: {e}"))
        };
        let (bits, group) = layout(&self.q, q_rows, "the q weight")?;
        if let Some((wk, wv, _)) = &self.kv {
            let mut layouts = vec![layout(wk, kv_rows, "the k weight")?];
            if let Some(wv) = wv {
                layouts.push(layout(wv, kv_rows, "the v weight")?);
            }
            if layouts.iter().any(|l| *l != (bits, group)) {
                bail!("{kernel}: the q, k and v weights mix layouts (dense, or 4-bit in groups)");
            }
        }
        Ok((bits, group))
    }

    /// The projections: q, then k and v where the layer has them.
    pub fn projections(&self) -> impl Iterator<Item = Weight<'a>> + 'a {
        let kv = self.kv.map(|(k, v, _)| (k, v));
        let kv = kv
            .into_iter()
            .flat_map(|(k, v)| std::iter::once(k).chain(v));
        std::iter::once(self.q).chain(kv)
    }
}

/// Where a KV-owning layer's new key and value go: its buffers
/// `[1, kv_heads, capacity, D]` and the slot.
pub struct CacheSlot<'a> {
    pub keys: &'a Array,
    pub values: &'a Array,
    pub slot: usize,
}

/// Shapes of one call.
pub struct HeadShape {
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
}

/// What [`attention_heads`] gives.
#[derive(Debug)]
pub struct AttentionHeads {
    /// The query heads, `[1, heads, 1, D]`.
    pub q: Array,
    /// The visible slots the call was given, as two int32 values in device memory at its
    /// start (what decode attention takes as its range): the step's integers (position, cache
    /// slot, visible slots), which the host writes into host-visible memory, cross the bus
    /// once per call, requested early by one thread of the first block of each group of
    /// blocks, and reach the block that finishes the heads, and decode attention, in device
    /// memory (reading them across the bus was measured slower and removed; BENCHMARKS.md).
    pub step_copy: Option<Array>,
}

/// The query heads `[1, heads, 1, D]` of the token `x` (`[1, hidden]`) at `position`, its
/// key and value written into `cache` on a KV-owning layer; `visible` is the range of slots
/// the query will attend to (handed on in device memory, [`AttentionHeads::step_copy`]).
/// `counter` comes from
/// [`super::products::new_counters`], one per head whose rows the kernel makes (or
/// [`super::products::new_counter`], then heads are not finished apart),
/// one per call site. Each head is finished (normed, rotated, written to the cache) by the
/// last of the blocks that made its rows, as soon as they are done, where the counters allow
/// (all heads by the last block of the call was measured slower and removed; BENCHMARKS.md). Check [`serves`] and
/// [`super::products::serves_token`] first.
#[allow(clippy::too_many_arguments)]
pub fn attention_heads(
    x: &Array,
    input_norm: &Array,
    eps: f32,
    weights: &HeadWeights,
    shape: &HeadShape,
    position: usize,
    cache: Option<CacheSlot>,
    visible: std::ops::Range<usize>,
    counter: &Array,
) -> Result<AttentionHeads> {
    let dtype = x.dtype();
    let k = x.shape()[x.ndim() - 1];
    let d = shape.head_dim;
    let nkv = match (&weights.kv, &cache) {
        (Some(_), Some(_)) => shape.kv_heads,
        (None, None) => 0,
        _ => bail!("attention_heads: a KV-owning layer needs both its weights and its cache"),
    };
    let (bits, group) = weights.layout("attention_heads", k, shape.heads * d, nkv * d, dtype)?;
    let (wk, wv, k_norm, k_eq_v) = match weights.kv {
        Some((wk, wv, k_norm)) => (wk, wv.unwrap_or(wk), k_norm, wv.is_none()),
        // A sharing layer has no key or value weights: a dense stand-in the kernel never
        // reads (it makes no key or value rows), 4 bytes for MLX's per-graph input count.
        None => {
            let unread = Weight::Dense(super::post_attention::unread_input(dtype));
            (unread, unread, weights.q_norm, false)
        }
    };
    let (k_cache, v_cache, slot_values) = match &cache {
        Some(c) => {
            let capacity = c.keys.shape()[2];
            for buffer in [c.keys, c.values] {
                // MLX would copy a buffer that is not row-contiguous before the kernel, and
                // the write would land in the copy.
                if buffer.shape() != [1, nkv, capacity, d]
                    || buffer.dtype() != dtype
                    || !is_row_contiguous(buffer)
                {
                    bail!(
                        "attention_heads: cache buffer {:?} {:?} cannot take the write in place",
                        buffer.shape(),
                        buffer.dtype()
                    );
                }
            }
            if c.slot >= capacity as usize {
                bail!(
                    "attention_heads: slot {} past the buffer's {capacity}",
                    c.slot
                );
            }
            (c.keys, c.values, [c.slot as i32, capacity])
        }
        // A sharing layer writes nothing: a one-element array stands in for the unused buffers.
        None => {
            let unread = super::post_attention::unread_input(dtype);
            (unread, unread, [0, 0])
        }
    };
    let slot = step_ints(&slot_values)?;
    let rows = shape.heads * d + nkv * d * if k_eq_v { 1 } else { 2 };
    // A counter per head whose rows the kernel makes, where the call site has that many and a
    // block's rows lie in one head.
    let row_heads = rows / d;
    let rpw = rows_per_warp(
        true,
        rows,
        d,
        resident_blocks(RESIDENT_BLOCKS_PER_MULTIPROCESSOR),
    );
    let per_head = d % (WARPS * rpw) == 0
        && counter.size() >= row_heads as usize
        && counter.dtype() == Dtype::Uint32;
    let position_values = [position as i32];
    let visible_values = [visible.start as i32, visible.end as i32];
    let position = step_ints(&position_values)?;
    let visible = step_ints(&visible_values)?;
    let [wq, wq_s, wq_b] = weights.q.inputs();
    let [wk, wk_s, wk_b] = wk.inputs();
    let [wv, wv_s, wv_b] = wv.inputs();
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
        &visible,
    ];
    let (q_shape, raw_shape) = ([1, shape.heads, 1, d], [rows.max(1)]);
    // The visible range, then position, slot and capacity for each group of blocks (one, or
    // one per head whose rows the kernel makes).
    let copy_shape = [4 + 4 * row_heads.max(1)];
    let outputs = [
        (&q_shape[..], dtype),
        (&raw_shape[..], dtype),
        (&copy_shape[..], Dtype::Int32),
    ];
    KERNELS_STEP_INTS_FROM_HEADS.with(|cell| {
        let mut kernels = cell.borrow_mut();
        let kernel = kernels.get(eps)?;
        let mut out = kernel.apply(
            &inputs,
            &outputs,
            ((rows + WARPS * rpw - 1) / (WARPS * rpw) * THREADS, 1, 1),
            (THREADS, 1, 1),
            &[
                (c"T", TemplateArg::Dtype(dtype)),
                (c"K", TemplateArg::Int(k)),
                (c"D", TemplateArg::Int(d)),
                (c"NH", TemplateArg::Int(shape.heads)),
                (c"NKV", TemplateArg::Int(nkv)),
                (c"K_EQ_V", TemplateArg::Bool(k_eq_v)),
                (c"BITS", TemplateArg::Int(bits)),
                (c"G", TemplateArg::Int(group)),
                (c"PER_HEAD", TemplateArg::Bool(per_head)),
                (c"RPW", TemplateArg::Int(rpw)),
                (c"TOUCH", TemplateArg::Bool(false)),
                (c"INT_DOTS", TemplateArg::Bool(false)),
            ],
        )?;
        let step_copy = out.pop();
        Ok(AttentionHeads {
            q: out.swap_remove(0),
            step_copy,
        })
    })
}

/// Whether MLX holds `a` as one row-major block (its kernels then take it without a copy).
pub(crate) fn is_row_contiguous(a: &Array) -> bool {
    // SAFETY: reads the strides of a live array; the pointer is valid for ndim entries.
    let strides = unsafe {
        let ptr = mlx_sys::mlx_array_strides(a.as_ptr());
        std::slice::from_raw_parts(ptr, a.ndim())
    };
    let mut expected = 1usize;
    for (dim, stride) in a.shape().iter().zip(strides).rev() {
        if *dim != 1 && *stride != expected {
            return false;
        }
        expected *= *dim as usize;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_gemma_head_sizes_in_float_dtypes_only() {
        assert!(serves(256, Dtype::Bfloat16));
        assert!(serves(512, Dtype::Float32));
        assert!(!serves(96, Dtype::Float32), "pairs do not fill whole warps");
        assert!(!serves(256, Dtype::Int32));
    }

    #[test]
    fn rows_in_one_wave_cover_every_row_once_within_a_head_a_block() {
        // (rows, head dim, rounds a block wanted on an H200's 528 resident blocks): E4B's
        // KV-owning sliding and full layers, the 12B's sliding and full (K = V) layers.
        let shapes = [
            (3072, 256, 1),
            (6144, 512, 2),
            (8192, 256, 2),
            (8704, 512, 4),
        ];
        for (rows, d, wanted) in shapes {
            assert_eq!(rows_per_warp(false, rows, d, 528), 1, "off: a row a warp");
            let rpw = rows_per_warp(true, rows, d, 528);
            assert_eq!(rpw, wanted, "{rows} rows in heads of {d}");
            // The kernel's assignment: block b, round i, warp w makes row
            // b * WARPS * rpw + i * WARPS + w, for the grid attention_heads launches.
            let block_rows = WARPS * rpw;
            let grid = (rows + block_rows - 1) / block_rows;
            assert!(grid <= 528 || rpw == 4, "{grid} blocks");
            let mut made = vec![0; rows as usize];
            let mut arrivals = vec![0; (rows / d) as usize];
            for b in 0..grid {
                let first = b * block_rows;
                for i in 0..rpw {
                    for w in 0..WARPS {
                        let row = first + i * WARPS + w;
                        if row < rows {
                            made[row as usize] += 1;
                            assert_eq!(row / d, first / d, "block {b} leaves its head");
                        }
                    }
                }
                arrivals[(first / d) as usize] += 1;
            }
            assert!(made.iter().all(|&n| n == 1), "every row made once");
            // The kernel counts D / BLOCK_ROWS arrivals a head before finishing it.
            assert!(arrivals.iter().all(|&n| n == d / block_rows));
        }
        // A head too narrow for more rounds keeps a row a warp.
        assert_eq!(rows_per_warp(true, 64 * 1024, 8, 528), 1);
    }

    #[test]
    fn row_contiguity_follows_the_strides() {
        let a = Array::zeros::<f32>(&[1, 2, 8, 4]).unwrap();
        a.eval().unwrap();
        assert!(is_row_contiguous(&a));
        let t = a.transpose_axes(&[0, 2, 1, 3]).unwrap();
        t.eval().unwrap();
        assert!(!is_row_contiguous(&t));
    }

    #[test]
    fn a_kv_owning_layer_without_its_cache_is_refused() {
        let x = Array::zeros::<f32>(&[1, 64]).unwrap();
        let wq = Array::zeros::<f32>(&[128, 64]).unwrap();
        let wk = Array::zeros::<f32>(&[64, 64]).unwrap();
        let norm = Array::ones::<f32>(&[64]).unwrap();
        let periods = Array::ones::<f32>(&[32]).unwrap();
        let weights = HeadWeights {
            q: Weight::Dense(&wq),
            kv: Some((Weight::Dense(&wk), None, &norm)),
            q_norm: &norm,
            periods: &periods,
        };
        let shape = HeadShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 64,
        };
        let counter = Array::zeros::<u32>(&[16]).unwrap();
        let err = attention_heads(&x, &norm, 1e-6, &weights, &shape, 0, None, 0..0, &counter)
            .unwrap_err();
        assert!(err.to_string().contains("needs both"), "{err}");
    }

    #[test]
    fn dense_and_4bit_projections_are_not_mixed_in_one_call() {
        let x = Array::zeros::<f32>(&[1, 64]).unwrap();
        let wq = Array::zeros::<f32>(&[128, 64]).unwrap();
        // k as 4-bit [64, 64] in groups of 32: 8 words and 2 scales a row.
        let packed = Array::zeros::<u32>(&[64, 8]).unwrap();
        let scales = Array::zeros::<f32>(&[64, 2]).unwrap();
        let norm = Array::ones::<f32>(&[64]).unwrap();
        let periods = Array::ones::<f32>(&[32]).unwrap();
        let weights = HeadWeights {
            q: Weight::Dense(&wq),
            kv: Some((
                Weight::Affine4 {
                    packed: &packed,
                    scales: &scales,
                    biases: &scales,
                },
                None,
                &norm,
            )),
            q_norm: &norm,
            periods: &periods,
        };
        let shape = HeadShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 64,
        };
        let buffer = Array::zeros::<f32>(&[1, 1, 8, 64]).unwrap();
        let counter = Array::zeros::<u32>(&[16]).unwrap();
        // The error of one call writing slot 0 of the buffer with these weights.
        let error_with = |weights: &HeadWeights| {
            let cache = CacheSlot {
                keys: &buffer,
                values: &buffer,
                slot: 0,
            };
            attention_heads(
                &x,
                &norm,
                1e-6,
                weights,
                &shape,
                0,
                Some(cache),
                0..0,
                &counter,
            )
            .unwrap_err()
        };
        let err = error_with(&weights);
        assert!(err.to_string().contains("mix layouts"), "{err}");
        // A k weight of the wrong shape is named.
        let narrow = Array::zeros::<f32>(&[32, 64]).unwrap();
        let weights = HeadWeights {
            kv: Some((Weight::Dense(&narrow), None, &norm)),
            ..weights
        };
        let err = error_with(&weights);
        assert!(err.to_string().contains("the k weight"), "{err}");
    }
}
