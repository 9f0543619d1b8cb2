//! Graph diagnostics: the lazy graph of one computation as Graphviz DOT and its operations
//! counted by kind (from the model crate's [`mlx_spec_model::graph`]), and the host time one
//! operation of each kind costs. A decode step on a GPU costs roughly a fixed host-side time
//! per operation, so the count says how much a change to the model code can save, and the
//! cost per kind says which operations to fuse next.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use mlx_rs::fast::rms_norm;
use mlx_rs::ops::matmul;
use mlx_rs::random;
use mlx_rs::transforms::async_eval;
use mlx_rs::{Array, Dtype};

use mlx_spec::kernels::post_attention::{self, PostAttention, Weight};
use mlx_spec::kernels::products::device_array;
use mlx_spec::kernels::products::{
    gated_product, gated_product_rows, new_counter, new_counters, normed_products,
    product_residual, product_residual_rows, GateUp, ROWS_PER_WARP_CHOICES,
};
use mlx_spec::kernels::{CudaKernel, Fused, TemplateArg};
use mlx_spec::model::gemma4::activation::gated_gelu;
pub use mlx_spec::model::graph::{count_operations, export_dot};

/// Body of the op-cost kernel: one multiply per element.
const SCALE_SOURCE: &str = "
    size_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) { out[i] = static_cast<T>(static_cast<float>(x[i]) * 0.5f); }
";

/// What one operation of a kind costs, from a chain of operations each fed by the last.
#[derive(Debug, Clone)]
pub struct OperationCost {
    pub kind: &'static str,
    /// Host time to add one operation to the lazy graph (our code and MLX's graph building).
    pub build_us: f64,
    /// Host time `async_eval` takes per operation (MLX walks the graph and encodes kernels).
    pub submit_us: f64,
    /// Wall time per operation from the start of building to the chain's result on the host.
    pub total_us: f64,
}

/// The host cost per operation of MLX's addition, RMSNorm and matrix product, and, where the
/// fused CUDA kernels run (a CUDA default device), of each fused product kernel: chains of
/// `chain` operations on a `[1, width]` bf16 vector with `[width, width]` weights, small enough
/// that the device finishes each operation in about its launch time. The median of `rounds`
/// chains after a warm-up one.
pub fn operation_costs(
    chain: usize,
    width: i32,
    rounds: usize,
    fused: Fused,
) -> Result<Vec<OperationCost>> {
    if chain == 0 || width <= 0 || width % 8 != 0 || rounds == 0 {
        bail!("operation_costs needs a chain, a positive width divisible by 8 and a round");
    }
    let dtype = Dtype::Bfloat16;
    let key = random::key(7)?;
    let weight = random::normal::<half::bf16>(&[width, width], 0.0, 0.02, &key)?;
    let weight_t = weight.transpose()?;
    let norm = Array::ones::<f32>(&[width])?.as_dtype(dtype)?;
    let start = Array::ones::<f32>(&[1, width])?.as_dtype(dtype)?;
    let counter = new_counter()?;
    for a in [&weight, &weight_t, &norm, &start, &counter] {
        a.eval()?;
    }
    type Step<'a> = Box<dyn Fn(&Array) -> Result<Array> + 'a>;
    let mut kinds: Vec<(&'static str, Step)> = vec![
        ("add (MLX)", Box::new(|x: &Array| Ok(x.add(&norm)?))),
        (
            "rms_norm (MLX)",
            Box::new(|x: &Array| Ok(rms_norm(x, Some(&norm), 1e-6)?)),
        ),
        (
            "matmul [1, w] x [w, w] (MLX)",
            Box::new(|x: &Array| Ok(matmul(x, &weight_t)?)),
        ),
    ];
    // One trivial kernel with a short and a long (padded) source handed to MLX inline, and
    // the long one through an `#include` (what `CudaKernel::new` does): MLX assembles,
    // copies and hashes a custom kernel's whole source at every call, so the differences are
    // what the source's length costs and what the include saves.
    let scale_small = CudaKernel::new_inline("op_cost_scale", &["x"], &["out"], SCALE_SOURCE, "");
    let padding = format!("// {}\n", "padding ".repeat(4096));
    let scale_large = CudaKernel::new_inline(
        "op_cost_scale_padded",
        &["x"],
        &["out"],
        SCALE_SOURCE,
        &padding,
    );
    let scale_included = CudaKernel::new(
        "op_cost_scale_included",
        &["x"],
        &["out"],
        SCALE_SOURCE,
        &padding,
    );
    let scale = |kernel: &CudaKernel, x: &Array| -> Result<Array> {
        let shape = x.shape().to_vec();
        let n = x.size() as i32;
        Ok(kernel
            .apply(
                &[x],
                &[(&shape, x.dtype())],
                (n, 1, 1),
                (256, 1, 1),
                &[
                    (c"T", TemplateArg::Dtype(x.dtype())),
                    (c"N", TemplateArg::Int(n)),
                ],
            )?
            .remove(0))
    };
    kinds.push((
        "reshape (MLX)",
        Box::new(|x: &Array| Ok(x.reshape(&[-1])?.reshape(&[1, -1])?)),
    ));
    if fused.products {
        let (small, large, included) = (scale_small?, scale_large?, scale_included?);
        kinds.push((
            "scale, 0.1 KB source inline (ours)",
            Box::new(move |x: &Array| scale(&small, x)),
        ));
        kinds.push((
            "scale, 33 KB source inline (ours)",
            Box::new(move |x: &Array| scale(&large, x)),
        ));
        kinds.push((
            "scale, 33 KB source by #include (ours)",
            Box::new(move |x: &Array| scale(&included, x)),
        ));
        kinds.push((
            "normed_products (ours)",
            Box::new(|x: &Array| Ok(normed_products(x, Some(&norm), 1e-6, &[&weight])?.remove(0))),
        ));
        kinds.push((
            "gated_product (ours)",
            Box::new(|x: &Array| {
                gated_product(
                    x,
                    Some(&norm),
                    1e-6,
                    Weight::Dense(&weight),
                    GateUp::Product(Weight::Dense(&weight)),
                )
            }),
        ));
        kinds.push((
            "product_residual (ours)",
            Box::new(|x: &Array| {
                product_residual(x, Weight::Dense(&weight), x, &norm, 1e-6, None, &counter)
            }),
        ));
    }
    // A verify window's rows: MLX's product of more than one row is cuBLAS's (one row is
    // MLX's own matrix-vector kernel), which a window of k > 1 tokens calls for every weight.
    let window = Array::ones::<f32>(&[4, width])?.as_dtype(dtype)?;
    window.eval()?;
    let window_kinds: Vec<(&'static str, Step)> = vec![
        ("add [4, w] (MLX)", Box::new(|x: &Array| Ok(x.add(&norm)?))),
        (
            "matmul [4, w] x [w, w] (MLX: cuBLAS)",
            Box::new(|x: &Array| Ok(matmul(x, &weight_t)?)),
        ),
    ];
    let mut costs = Vec::new();
    for (first, kinds) in [(&start, &kinds), (&window, &window_kinds)] {
        for (kind, step) in kinds {
            let (build_us, submit_us, total_us) = time_chain(first, chain, rounds, |x, _| step(x))?;
            costs.push(OperationCost {
                kind,
                build_us,
                submit_us,
                total_us,
            });
        }
    }
    Ok(costs)
}

/// Times `rounds` chains of `links` calls of `link` (each fed the previous result and its
/// index) from `start`, after a warm-up chain: the median chain's host time to build, host
/// time in `async_eval`, and wall time to the result, each in µs per link.
fn time_chain(
    start: &Array,
    links: usize,
    rounds: usize,
    link: impl Fn(&Array, usize) -> Result<Array>,
) -> Result<(f64, f64, f64)> {
    let mut samples = Vec::new();
    for round in 0..=rounds {
        let begin = Instant::now();
        let mut x = start.clone();
        for i in 0..links {
            x = link(&x, i)?;
        }
        let built = Instant::now();
        async_eval([&x])?;
        let submitted = Instant::now();
        x.eval()?;
        let done = Instant::now();
        if round > 0 {
            let per_link = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6 / links as f64;
            samples.push((
                per_link(begin, built),
                per_link(built, submitted),
                per_link(begin, done),
            ));
        }
    }
    samples.sort_by(|a, b| a.2.total_cmp(&b.2));
    Ok(samples[samples.len() / 2])
}

/// How fast one way of computing a decode token's feed-forward block streams its weights.
#[derive(Debug, Clone)]
pub struct FeedForwardSpeed {
    pub kind: String,
    /// Host time to build one block's operations.
    pub build_us: f64,
    /// Host time `async_eval` takes per block.
    pub submit_us: f64,
    /// Wall time per block, from the start of building to the result on the host.
    pub total_us: f64,
    /// Weight bytes per block over `total_us`: the device's streaming rate when the device,
    /// not the host, bounds the chain (then `total_us` is well above build + submit).
    pub gb_per_s: f64,
}

/// One synthetic layer's weights for [`feed_forward_speed`].
struct LayerWeights {
    gate: Array,
    up: Array,
    down: Array,
    /// The attention output product `[hidden, attention_width]`.
    output: Array,
    /// Counters of the two closing products (feed-forward, attention output).
    counters: [Array; 2],
    barrier: Array,
}

/// The feed-forward block of a decode token (`h + rms_norm(down(gelu(gate(n)) * up(n)))`,
/// `n = rms_norm(h)`) over `layers` distinct bf16 weight sets of `hidden` x `intermediate`,
/// chained as in a model, timed with MLX's operations and, where the fused CUDA kernels run,
/// with [`gated_product`] and [`product_residual`] at each row count per warp. Then the
/// attention's output product (`[hidden, attention_width]`) and the feed-forward block
/// together, as three fused products and (with `post-attention` allowed) as one
/// [`post_attention::post_attention`] kernel. The weights of the chain should exceed the
/// device's cache (E4B: 157 MB a layer) for the rate to be the memory's. The median of
/// `rounds` chains after a warm-up one.
pub fn feed_forward_speed(
    hidden: i32,
    intermediate: i32,
    attention_width: i32,
    layers: usize,
    rounds: usize,
    fused: Fused,
) -> Result<Vec<FeedForwardSpeed>> {
    if hidden <= 0 || intermediate <= 0 || attention_width <= 0 || layers == 0 || rounds == 0 {
        bail!("feed_forward_speed needs positive sizes, a layer and a round");
    }
    let dtype = Dtype::Bfloat16;
    let eps = 1e-6;
    let mut weights = Vec::with_capacity(layers);
    for layer in 0..layers {
        let normal = |rows: i32, cols: i32, seed: usize| -> Result<Array> {
            let key = random::key((100 + 3 * layer + seed) as u64)?;
            Ok(random::normal::<half::bf16>(
                &[rows, cols],
                0.0,
                0.02,
                &key,
            )?)
        };
        let gate = normal(intermediate, hidden, 0)?;
        let up = normal(intermediate, hidden, 1)?;
        let down = normal(hidden, intermediate, 2)?;
        let output = normal(hidden, attention_width, 3)?;
        for w in [&gate, &up, &down, &output] {
            w.eval()?;
        }
        weights.push(LayerWeights {
            gate,
            up,
            down,
            output,
            counters: [new_counter()?, new_counter()?],
            barrier: post_attention::new_barrier()?,
        });
    }
    let norm = Array::ones::<f32>(&[hidden])?.as_dtype(dtype)?;
    let start = random::normal::<half::bf16>(&[1, hidden], 0.0, 1.0, &random::key(99)?)?;
    // The attention heads' output each layer's block starts from (the same for every layer:
    // only the weights' streaming is measured).
    let heads = random::normal::<half::bf16>(&[1, attention_width], 0.0, 1.0, &random::key(98)?)?;
    let scale = device_array(&Array::ones::<f32>(&[1])?.as_dtype(dtype)?, 8)?;
    for a in [&norm, &start, &heads] {
        a.eval()?;
    }
    let feed_forward_bytes = 3.0 * hidden as f64 * intermediate as f64 * 2.0;
    let with_output_bytes = feed_forward_bytes + hidden as f64 * attention_width as f64 * 2.0;
    let (weights, norm, heads, scale) = (&weights, &norm, &heads, &scale);

    type Block<'a> = Box<dyn Fn(&Array, usize) -> Result<Array> + 'a>;
    let mut kinds: Vec<(String, f64, Block)> = vec![(
        "MLX operations".to_string(),
        feed_forward_bytes,
        Box::new(|h: &Array, l: usize| {
            let w = &weights[l];
            let n = rms_norm(h, Some(norm), eps)?;
            let act = gated_gelu(
                &matmul(&n, w.gate.transpose()?)?,
                &matmul(&n, w.up.transpose()?)?,
            )?;
            let d = matmul(&act, w.down.transpose()?)?;
            Ok(h.add(rms_norm(&d, Some(norm), eps)?)?)
        }),
    )];
    if fused.products {
        for rows in ROWS_PER_WARP_CHOICES {
            kinds.push((
                format!("fused products, {rows} row(s) per warp"),
                feed_forward_bytes,
                Box::new(move |h: &Array, l: usize| {
                    let w = &weights[l];
                    let act = gated_product_rows(
                        h,
                        Some(norm),
                        eps,
                        Weight::Dense(&w.gate),
                        GateUp::Product(Weight::Dense(&w.up)),
                        rows,
                    )?;
                    let counter = &w.counters[0];
                    product_residual_rows(
                        &act,
                        Weight::Dense(&w.down),
                        h,
                        norm,
                        eps,
                        None,
                        counter,
                        rows,
                    )
                }),
            ));
        }
        kinds.push((
            "attention output + feed-forward, fused products (3 kernels)".to_string(),
            with_output_bytes,
            Box::new(|h: &Array, l: usize| {
                let w = &weights[l];
                let x1 = product_residual(
                    heads,
                    Weight::Dense(&w.output),
                    h,
                    norm,
                    eps,
                    None,
                    &w.counters[1],
                )?;
                let act = gated_product(
                    &x1,
                    Some(norm),
                    eps,
                    Weight::Dense(&w.gate),
                    GateUp::Product(Weight::Dense(&w.up)),
                )?;
                product_residual(
                    &act,
                    Weight::Dense(&w.down),
                    &x1,
                    norm,
                    eps,
                    Some(scale),
                    &w.counters[0],
                )
            }),
        ));
    }
    let (h, z, n) = (
        hidden as usize,
        attention_width as usize,
        intermediate as usize,
    );
    if fused.post_attention
        && post_attention::serves(h, z, n, 0, dtype)
        && post_attention::grid_blocks().is_some()
    {
        kinds.push((
            "attention output + feed-forward, one post-attention kernel".to_string(),
            with_output_bytes,
            Box::new(|h: &Array, l: usize| {
                let w = &weights[l];
                let block = PostAttention {
                    output: Weight::Dense(&w.output),
                    post_attention_norm: norm,
                    pre_norm: norm,
                    gate: Weight::Dense(&w.gate),
                    up: Weight::Dense(&w.up),
                    down: Weight::Dense(&w.down),
                    post_norm: norm,
                };
                post_attention::post_attention(h, heads, eps, &block, None, scale, &w.barrier)
            }),
        ));
    }
    let mut speeds = Vec::new();
    for (kind, bytes, block) in &kinds {
        let (build_us, submit_us, total_us) = time_chain(&start, layers, rounds, block)?;
        speeds.push(FeedForwardSpeed {
            kind: kind.clone(),
            build_us,
            submit_us,
            total_us,
            gb_per_s: bytes / (total_us * 1e3),
        });
    }
    Ok(speeds)
}

/// One case of [`decode_attention_errors`].
pub struct AttentionCheck {
    /// Head size, buffer slots and visible range, as `D 256, 768 slots, 0..700`.
    pub case: String,
    /// Largest |kernel - reference| over the output.
    pub error: f32,
}

/// The fused decode attention kernel against the same attention computed by MLX's operations
/// in float32 (scores rounded to `dtype` as MLX's product rounds them), on random queries,
/// keys and values of Gemma 4's head sizes (8 query heads over 2 KV heads), buffers of one to
/// several rounds a block, and visible ranges that start at 0 or later. CUDA only (the
/// kernel's device).
/// Fails if an error exceeds `tolerance`.
pub fn decode_attention_errors(dtype: Dtype, tolerance: f32) -> Result<Vec<AttentionCheck>> {
    use mlx_spec::kernels::decode_attention::{decode_attention, splits_for};
    let (heads, kv_heads) = (8, 2);
    let cases: [(i32, i32, std::ops::Range<usize>); 6] = [
        (256, 768, 0..700),
        (256, 768, 256..768),
        (256, 40, 0..33),
        (256, 4096, 100..4000),
        (512, 1024, 0..600),
        (512, 768, 3..768),
    ];
    let mut rows = Vec::new();
    let run = || -> Result<()> {
        for (seed, (d, slots, visible)) in cases.into_iter().enumerate() {
            let normal = |i: u64, shape: &[i32], scale: f32| -> Result<Array> {
                let key = random::key(0xa77e + 3 * seed as u64 + i)?;
                Ok(random::normal::<f32>(shape, 0.0, scale, &key)?.as_dtype(dtype)?)
            };
            // Scores of order 1, as after Gemma 4's q/k norms and a 1 / sqrt(D)-sized spread.
            let q = normal(0, &[1, heads, 1, d], 1.0 / (d as f32).sqrt())?;
            let k = normal(1, &[1, kv_heads, slots, d], 1.0)?;
            let v = normal(2, &[1, kv_heads, slots, d], 1.0)?;
            let splits = splits_for(slots as usize, d as usize, dtype)
                .with_context(|| format!("decode attention does not serve D {d}, {slots} slots"))?;
            // Each call gets its own counters: the calls do not depend on one another, so
            // MLX may run them at once, and calls sharing counters would then miscount.
            let counters = new_counters(heads as usize)?;
            let output = decode_attention(&q, &k, &v, visible.clone(), None, splits, &counters)?
                .as_dtype(Dtype::Float32)?;
            // Reference: the query heads of each KV head as one [group, D] matrix.
            let group = heads / kv_heads;
            let q32 = q
                .as_dtype(Dtype::Float32)?
                .reshape(&[1, kv_heads, group, d])?;
            let scores = matmul(
                &q32,
                &k.as_dtype(Dtype::Float32)?.transpose_axes(&[0, 1, 3, 2])?,
            )?
            .as_dtype(dtype)?
            .as_dtype(Dtype::Float32)?;
            let mask: Vec<f32> = (0..slots as usize)
                .map(|s| {
                    if visible.contains(&s) {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let mask = Array::from_slice(&mask, &[1, 1, 1, slots]);
            let weights = mlx_rs::ops::softmax_axis(&scores.add(&mask)?, -1, true)?;
            let reference =
                matmul(&weights, &v.as_dtype(Dtype::Float32)?)?.reshape(&[1, heads * d])?;
            let largest = |a: &Array, b: &Array| -> Result<f32> {
                Ok(a.subtract(b)?.abs()?.max(None)?.try_item_exact::<f32>()?)
            };
            // The visible range read from device memory (as the attention-heads kernel hands
            // it on) must give the same bits as from host memory.
            let range = Array::from_slice(&[visible.start as i32, visible.end as i32], &[2]);
            let on_device = mlx_spec::kernels::products::padded(&range, 4)?;
            let from_device = decode_attention(
                &q,
                &k,
                &v,
                visible.clone(),
                Some(&on_device),
                splits,
                &new_counters(heads as usize)?,
            )?
            .as_dtype(Dtype::Float32)?;
            let device_gap = largest(&from_device, &output)?;
            if device_gap != 0.0 {
                bail!(
                    "decode attention, D {d}, {slots} slots, {visible:?}: the range in device \
                     memory changed the output by {device_gap:e}"
                );
            }
            let row = AttentionCheck {
                case: format!("D {d}, {slots} slots, {visible:?}"),
                error: largest(&output, &reference)?,
            };
            // A NaN fails too.
            if row.error.is_nan() || row.error > tolerance {
                bail!(
                    "decode attention, {}: error {:e} against MLX's operations exceeds {tolerance:e}",
                    row.case,
                    row.error
                );
            }
            rows.push(row);
        }
        Ok(())
    };
    run().map(|()| rows)
}

/// One window case of [`window_post_attention_differences`].
pub struct WindowCheck {
    /// Which shape and window.
    pub case: String,
    /// Output elements of the window kernel that differ from the single-token kernel's for
    /// the same token (the check fails unless 0), of `elements`.
    pub differing: usize,
    pub elements: usize,
}

/// The window kernel ([`mlx_spec::kernels::window_post_attention`]) against the single-token
/// post-attention kernel run token by token, on E4B's shapes (sliding and full attention
/// widths, with the per-layer input, and one shape without it) with random bf16 weights and
/// inputs, for windows of 2, 4 and 8 tokens: each token's row must be the same bits. CUDA
/// only. Fails on the first difference.
pub fn window_post_attention_differences() -> Result<Vec<WindowCheck>> {
    use mlx_rs::ops::indexing::IndexOp;
    use mlx_spec::kernels::post_attention::{new_barrier, post_attention, PerLayerInput};
    use mlx_spec::kernels::window_post_attention::window_post_attention;
    let (hidden, intermediate, per_layer, layers) = (2560, 10240, 256, 42);
    let normal = |seed: u64, shape: &[i32], spread: f32| -> Result<Array> {
        Ok(
            random::normal::<f32>(shape, 0.0, spread, &random::key(seed)?)?
                .as_dtype(Dtype::Bfloat16)?,
        )
    };
    let gate = normal(31, &[intermediate, hidden], 0.02)?;
    let up = normal(32, &[intermediate, hidden], 0.02)?;
    let down = normal(33, &[hidden, intermediate], 0.02)?;
    let ple_gate = normal(34, &[per_layer, hidden], 0.02)?;
    let ple_projection = normal(35, &[hidden, per_layer], 0.05)?;
    let norms: Vec<Array> = (0..4)
        .map(|i| normal(40 + i, &[hidden], 1.0))
        .collect::<Result<_>>()?;
    let scale = device_array(
        &Array::from_slice(&[0.75f32], &[1]).as_dtype(Dtype::Bfloat16)?,
        8,
    )?;
    let offset = device_array(&Array::from_slice(&[7 * per_layer], &[1]), 4)?;
    let (single_barrier, window_barrier) = (new_barrier()?, new_barrier()?);
    let mut rows = Vec::new();
    for (attention_width, with_ple) in [(2048, true), (4096, true), (2048, false)] {
        let output = normal(
            36 + attention_width as u64,
            &[hidden, attention_width],
            0.02,
        )?;
        let weights = PostAttention {
            output: Weight::Dense(&output),
            post_attention_norm: &norms[0],
            pre_norm: &norms[1],
            gate: Weight::Dense(&gate),
            up: Weight::Dense(&up),
            down: Weight::Dense(&down),
            post_norm: &norms[2],
        };
        for tokens in [2, 4, 8] {
            let seed = 100 * tokens as u64 + attention_width as u64;
            let x = normal(seed, &[tokens, hidden], 1.0)?;
            let z = normal(seed + 1, &[tokens, attention_width], 1.0)?;
            let values = normal(seed + 2, &[tokens, layers, per_layer], 1.0)?;
            let ple = |values| PerLayerInput {
                gate: Weight::Dense(&ple_gate),
                values,
                offset: &offset,
                projection: Weight::Dense(&ple_projection),
                post_norm: &norms[3],
            };
            let window_ple = ple(&values);
            let window = window_post_attention(
                &x,
                &z,
                1e-6,
                &weights,
                with_ple.then_some(&window_ple),
                &scale,
                &window_barrier,
            )?;
            window.eval()?;
            let mut differing = 0;
            for t in 0..tokens {
                let row = |a: &Array| -> Result<Array> {
                    let r = a.index(t..t + 1);
                    Ok(r.reshape(&[1, -1])?)
                };
                let token_values = values.index(t..t + 1);
                let token_ple = PerLayerInput {
                    values: &token_values,
                    ..ple(&values)
                };
                let single = post_attention(
                    &row(&x)?,
                    &row(&z)?,
                    1e-6,
                    &weights,
                    with_ple.then_some(&token_ple),
                    &scale,
                    &single_barrier,
                )?;
                // As float32 (exact for bf16): unequal values, or NaN on either side.
                let unequal = mlx_rs::ops::ne(
                    &single.as_dtype(Dtype::Float32)?,
                    &row(&window)?.as_dtype(Dtype::Float32)?,
                )?
                .as_dtype(Dtype::Int32)?
                .sum(None)?
                .try_item_exact::<i32>()?;
                differing += unequal as usize;
            }
            let case = format!(
                "{tokens} tokens, attention {attention_width}{}",
                if with_ple { ", per-layer input" } else { "" }
            );
            if differing > 0 {
                bail!("window post-attention kernel, {case}: {differing} output values differ from the single-token kernel's");
            }
            rows.push(WindowCheck {
                case,
                differing,
                elements: tokens as usize * hidden as usize,
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feed_forward_speed_times_mlx_operations_on_the_cpu() {
        let speeds = feed_forward_speed(64, 128, 64, 2, 1, Fused::default()).unwrap();
        // No fused kernels off a CUDA device.
        assert_eq!(speeds.len(), 1, "{speeds:?}");
        assert_eq!(speeds[0].kind, "MLX operations");
        let s = &speeds[0];
        assert!(s.total_us >= s.build_us && s.gb_per_s > 0.0, "{s:?}");
        assert!(feed_forward_speed(64, 128, 64, 0, 1, Fused::default()).is_err());
        assert!(feed_forward_speed(64, 128, 0, 2, 1, Fused::default()).is_err());
    }

    #[test]
    fn operation_costs_time_every_mlx_kind_on_the_cpu() {
        let costs = operation_costs(8, 64, 1, Fused::default()).unwrap();
        let kinds: Vec<&str> = costs.iter().map(|c| c.kind).collect();
        // No fused kernels off a CUDA device: MLX's four kinds of one row, then its two of a
        // four-row window.
        assert_eq!(kinds.len(), 6, "{kinds:?}");
        assert!(kinds[0].starts_with("add"), "{kinds:?}");
        assert!(kinds[5].starts_with("matmul [4, w]"), "{kinds:?}");
        for c in &costs {
            assert!(c.build_us > 0.0 && c.total_us >= c.build_us, "{c:?}");
        }
        assert!(operation_costs(0, 64, 1, Fused::default()).is_err());
        assert!(operation_costs(8, 60, 1, Fused::default()).is_err());
    }
}
