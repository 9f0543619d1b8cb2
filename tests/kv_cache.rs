//! The KV cache as the verify loop will use it: rolling back rejected tokens must leave the
//! model computing exactly what it computes without them, a sliding-window buffer refuses a
//! rollback deeper than what it kept (and stays usable), and random-weight models of any
//! config run dense and quantized.

mod common;

use common::{fixture, max_abs_diff, FIXTURES};
use mlx_rs::Dtype;
use mlx_spec::model::gemma4::config::{Gemma4Config, QuantSpec};
use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model, LogitsFor, ModelCache};

fn load(name: &str) -> Gemma4Model {
    Gemma4Model::load(&fixture(name), DtypeChoice::Fixed(Dtype::Float32), None).unwrap()
}

fn logits(model: &Gemma4Model, ids: &[u32], cache: &mut ModelCache) -> Vec<f32> {
    model
        .forward(ids, cache, LogitsFor::All, false)
        .unwrap()
        .logits
        .as_slice::<f32>()
        .to_vec()
}

const PROMPT: [u32; 14] = [2, 17, 40, 99, 3, 250, 18, 77, 5, 140, 61, 200, 33, 12];

#[test]
fn rollback_then_replay_equals_never_having_drafted() {
    for name in FIXTURES {
        let model = load(name);
        let mut cache = model.new_cache();
        logits(&model, &PROMPT[..10], &mut cache);
        // A "verify" forward over 4 drafted tokens, of which the last 3 are rejected.
        let verify = logits(&model, &[7, 8, 9, 10], &mut cache);
        cache.trim(3).unwrap();
        assert_eq!(cache.offset(), 11);
        // The correct continuation after the accepted token.
        let after_rollback = logits(&model, &[11, 12], &mut cache);

        let mut clean = model.new_cache();
        logits(&model, &PROMPT[..10], &mut clean);
        let reference = logits(&model, &[7, 11, 12], &mut clean);
        let v = model.config.vocab_size;
        assert!(
            max_abs_diff(&verify[..v], &reference[..v]) < 1e-4,
            "{name}: accepted position differs"
        );
        let diff = max_abs_diff(&after_rollback, &reference[v..]);
        assert!(
            diff < 1e-4,
            "{name}: logits after rollback differ by {diff}"
        );
    }
}

#[test]
fn sliding_window_refuses_a_rollback_it_cannot_honour() {
    let model = load("tiny-ple-kvshare"); // window 4
    let mut cache = ModelCache::with_reserve(&model.config, 0);
    for chunk in PROMPT.chunks(3) {
        logits(&model, chunk, &mut cache);
    }
    let offset = cache.offset();
    let err = cache.trim(6).unwrap_err();
    assert_eq!(err.requested, 6);
    assert_eq!(
        cache.offset(),
        offset,
        "a refused trim must not change the cache"
    );
    // The cache still computes the right thing afterwards.
    let next = logits(&model, &[42], &mut cache);
    let mut clean = model.new_cache();
    let mut ids = PROMPT.to_vec();
    ids.push(42);
    let reference = logits(&model, &ids, &mut clean);
    let v = model.config.vocab_size;
    assert!(max_abs_diff(&next, &reference[reference.len() - v..]) < 1e-4);
    // Within the window itself a rollback still works without any reserve.
    cache.trim(1).unwrap();
}

/// A sliding buffer starts with 512 slots (the first allocation rounds the prompt plus one
/// growth step of 256 up to a multiple of 256) and is compacted, its kept keys copied to the
/// front of a fresh buffer, when its end is reached: at about position 510 for a short prompt,
/// then every ~440 positions (512 slots less the window and the 64-position rollback reserve).
/// Full-attention buffers grow (and are copied) at positions 512 and 1024. 1200 positions
/// cross two compactions of each sliding buffer and both growths of each full one.
const PAST_TWO_COMPACTIONS: usize = 1200;

/// Float32 logits up to 1200 positions in, cached against uncached: the two attend with
/// reductions of different shapes (whole buffers under a slot mask against the sliced keys of
/// one long window), which round differently, more so the longer the sequence. Measured: at
/// most 6.2e-4 (tiny-wrapped-bf16 in float32, position 926), 4.7e-4 (tiny-ple-kvshare) and
/// 1.7e-4 (tiny-moe-keqv, windows with rollbacks), scattered along the sequence rather than
/// after the compactions, and already 1.3e-4 in the first 100 positions. One wrong key moves
/// logits by far more: the single-token test checks that one token replaced 300 positions
/// back moves the last row by over ten times this tolerance (measured 0.05 and 0.09).
const LONG_TOL: f32 = 1e-3;

/// `n` token ids in [3, vocab), varied (a fixed LCG), so attention has something to find.
fn varied_ids(n: usize, vocab: usize) -> Vec<u32> {
    let mut x = 12345u64;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            3 + ((x >> 33) % (vocab as u64 - 3)) as u32
        })
        .collect()
}

/// Logits of a forward over all of `ids` at once with a fresh cache: one query window longer
/// than the masked-window limit, which attends over the keys it sliced, never a compacted
/// buffer, and is the reference the cached runs below must reproduce.
fn uncached(model: &Gemma4Model, ids: &[u32]) -> Vec<f32> {
    logits(model, ids, &mut model.new_cache())
}

#[test]
fn single_token_decode_across_compactions_equals_one_forward() {
    // Windows of 4 and 8 keys: each query's mask must move with the buffer's first slot.
    for name in ["tiny-ple-kvshare", "tiny-wrapped-bf16"] {
        let model = load(name);
        let v = model.config.vocab_size;
        let ids = varied_ids(PAST_TWO_COMPACTIONS, v);
        let want = uncached(&model, &ids);
        let mut cache = model.new_cache();
        let prompt = logits(&model, &ids[..3], &mut cache);
        assert!(max_abs_diff(&prompt, &want[..3 * v]) < 1e-4);
        let mut worst = (0.0f32, 0);
        for (p, &id) in ids.iter().enumerate().skip(3) {
            let got = logits(&model, &[id], &mut cache);
            let diff = max_abs_diff(&got, &want[p * v..(p + 1) * v]);
            if diff > worst.0 {
                worst = (diff, p);
            }
            assert!(diff < LONG_TOL, "{name}: position {p} differs by {diff}");
        }
        println!(
            "{name}: largest difference {} at position {}",
            worst.0, worst.1
        );
        assert_eq!(cache.offset(), PAST_TWO_COMPACTIONS);
        // The tolerance is tight enough to see one wrong key: the same sequence with the
        // token 300 positions before the last replaced gives a last row farther off.
        let mut one_key_off = ids.clone();
        let at = ids.len() - 300;
        one_key_off[at] = 3 + (ids[at] + 1 - 3) % (v as u32 - 3);
        let off = uncached(&model, &one_key_off);
        let last = (ids.len() - 1) * v;
        let signal = max_abs_diff(&off[last..], &want[last..]);
        println!("{name}: one key changed moves the last row by {signal}");
        assert!(
            signal > 10.0 * LONG_TOL,
            "{name}: one wrong key moves the last row by only {signal}"
        );
    }
}

#[test]
fn verify_windows_with_rejected_drafts_across_compactions_equal_one_forward() {
    // Windows of `kept` right tokens and `rejected` junk ones (masked windows, up to 64
    // tokens); the junk is rolled back, as the verify loop rolls back rejected drafts, also
    // right after a compaction moved the buffer.
    let model = load("tiny-moe-keqv");
    let v = model.config.vocab_size;
    let ids = varied_ids(PAST_TWO_COMPACTIONS, v);
    let want = uncached(&model, &ids);
    let mut cache = model.new_cache();
    logits(&model, &ids[..2], &mut cache);
    let mut p = 2;
    let mut round = 0;
    let mut worst = (0.0f32, 0);
    while p < ids.len() {
        let kept = (1 + round % 5).min(ids.len() - p);
        let rejected = [2, 0, 7, 1, 13, 40][round % 6];
        let mut window = ids[p..p + kept].to_vec();
        window.extend((0..rejected).map(|j| 3 + ((p + j) * 7 % (v - 3)) as u32));
        let got = logits(&model, &window, &mut cache);
        let diff = max_abs_diff(&got[..kept * v], &want[p * v..(p + kept) * v]);
        if diff > worst.0 {
            worst = (diff, p);
        }
        assert!(
            diff < LONG_TOL,
            "round {round} at position {p}: differs by {diff}"
        );
        cache.trim(rejected).unwrap();
        p += kept;
        round += 1;
        assert_eq!(cache.offset(), p);
    }
    println!("largest difference {} at position {}", worst.0, worst.1);
    // The next token after the last rollback still reads the right keys.
    let next = logits(&model, &[42], &mut cache);
    let mut more = ids.clone();
    more.push(42);
    let reference = uncached(&model, &more);
    assert!(max_abs_diff(&next, &reference[ids.len() * v..]) < LONG_TOL);
}

#[test]
fn long_decode_rolls_back_within_the_reserve() {
    // Past the window many times over and past the buffers' first compaction (each step adds
    // two positions: 600 in all); rollbacks of five keep working.
    let model = load("tiny-moe-keqv");
    let mut cache = model.new_cache();
    let mut clean = model.new_cache();
    logits(&model, &[2], &mut cache);
    logits(&model, &[2], &mut clean);
    for step in 0..300u32 {
        let token = 3 + (step * 37) % 250;
        let junk = [5, 6, 7, 8, 9];
        logits(&model, &[token], &mut cache);
        logits(&model, &junk, &mut cache);
        cache.trim(junk.len()).unwrap();
        let a = logits(&model, &[token + 1], &mut cache);
        let b = {
            logits(&model, &[token], &mut clean);
            logits(&model, &[token + 1], &mut clean)
        };
        assert!(max_abs_diff(&a, &b) < 1e-4, "step {step}");
    }
    assert_eq!(cache.offset(), 601);
}

fn tiny_config(moe: bool) -> Gemma4Config {
    let mut c: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-ple-q4").join("config.json")).unwrap(),
    )
    .unwrap();
    c.as_object_mut().unwrap().remove("quantization");
    c.as_object_mut().unwrap().remove("quantization_config");
    if moe {
        c["enable_moe_block"] = true.into();
        c["num_experts"] = 4.into();
        c["top_k_experts"] = 2.into();
        c["moe_intermediate_size"] = 64.into();
    }
    Gemma4Config::from_json(&c).unwrap()
}

#[test]
fn random_weights_build_any_config_dense_and_quantized() {
    for moe in [false, true] {
        for quant in [
            None,
            Some(QuantSpec {
                group_size: 32,
                bits: 4,
            }),
            Some(QuantSpec {
                group_size: 32,
                bits: 8,
            }),
        ] {
            let build =
                |seed| Gemma4Model::random(tiny_config(moe), seed, Dtype::Float32, quant).unwrap();
            let a = build(1);
            let mut cache = a.new_cache();
            let out = logits(&a, &PROMPT, &mut cache);
            assert_eq!(out.len(), PROMPT.len() * a.config.vocab_size);
            assert!(
                out.iter().all(|x| x.is_finite()),
                "moe={moe} quant={quant:?}: non-finite logits"
            );
            let same = build(1);
            let again = logits(&same, &PROMPT, &mut same.new_cache());
            assert_eq!(
                out, again,
                "moe={moe} quant={quant:?}: same seed must give the same model"
            );
            let different = build(2);
            let other = logits(&different, &PROMPT, &mut different.new_cache());
            assert_ne!(
                out, other,
                "moe={moe} quant={quant:?}: another seed must give another model"
            );
        }
    }
}

/// The per-token weight bytes behind the decode floor: a dense model reads everything but the
/// gathered per-layer table; an MoE model also skips its unrouted experts.
#[test]
fn bytes_read_per_token_skip_gathered_tables_and_unrouted_experts() {
    let dense = Gemma4Model::random(tiny_config(false), 0, Dtype::Float32, None).unwrap();
    let c = &dense.config;
    let f32_bytes = 4;
    let ple_table = c.per_layer_vocab_size * c.num_layers * c.per_layer_input_size * f32_bytes;
    assert!(ple_table > 0, "the fixture config has per-layer embeddings");
    let total = 10 * ple_table; // any total above the table
    assert_eq!(dense.weight_bytes_read_per_token(total), total - ple_table);

    let moe = Gemma4Model::random(tiny_config(true), 0, Dtype::Float32, None).unwrap();
    let m = moe.config.moe.unwrap();
    let per_expert = 3 * m.expert_intermediate_size * moe.config.hidden_size * f32_bytes;
    let unrouted = moe.config.num_layers * (m.num_experts - m.top_k) * per_expert;
    assert_eq!(
        moe.weight_bytes_read_per_token(total),
        total - ple_table - unrouted
    );
}

/// A long verify window run as consecutive shorter windows (as the GPU runs windows longer
/// than its window kernels take) gives the logits and hidden states of one forward over it,
/// and leaves the cache where one forward leaves it.
#[test]
fn a_window_run_in_parts_equals_one_forward() {
    let model = Gemma4Model::random(tiny_config(false), 3, Dtype::Float32, None).unwrap();
    let ids = mlx_rs::Array::from_slice(&PROMPT[..11], &[1, 11]);
    let mut whole_cache = model.new_cache();
    let whole = model
        .forward_ids(&ids, &mut whole_cache, LogitsFor::All, true)
        .unwrap();
    for (largest, group) in [(1, 0), (4, 0), (8, 0), (4, 1), (8, 2)] {
        let mut cache = model.new_cache();
        let parts = model
            .forward_in_windows(&ids, &mut cache, LogitsFor::All, true, largest, group)
            .unwrap();
        assert_eq!(cache.offset(), whole_cache.offset(), "largest {largest}");
        assert_eq!(parts.logits.shape(), whole.logits.shape());
        let (a, b) = (
            parts.logits.as_slice::<f32>(),
            whole.logits.as_slice::<f32>(),
        );
        assert!(
            max_abs_diff(a, b) < 1e-4,
            "largest {largest}, group {group}: logits"
        );
        assert_eq!(parts.hidden.len(), whole.hidden.len());
        for (i, (p, w)) in parts.hidden.iter().zip(&whole.hidden).enumerate() {
            assert_eq!(p.shape(), w.shape(), "hidden state {i}");
            let (p, w) = (p.as_slice::<f32>(), w.as_slice::<f32>());
            assert!(
                max_abs_diff(p, w) < 1e-4,
                "largest {largest}, group {group}: hidden state {i}"
            );
        }
        // Only the last logits: those of the last part's last token.
        let mut cache = model.new_cache();
        let last = model
            .forward_in_windows(&ids, &mut cache, LogitsFor::Last, false, largest, group)
            .unwrap();
        let vocab = model.config.vocab_size;
        assert_eq!(last.logits.shape(), [1, vocab as i32]);
        assert!(max_abs_diff(last.logits.as_slice::<f32>(), &b[10 * vocab..]) < 1e-4);
    }
}

/// A verify window handed to the device a few layers at a time (`forward_to_read`) computes
/// exactly what the same window handed over whole computes, and leaves the same cache: only
/// when the work is submitted changes.
#[test]
fn a_window_handed_over_in_groups_of_layers_equals_one_handed_over_whole() {
    use mlx_spec::model::gemma4::RunSettings;
    let mut model = Gemma4Model::random(tiny_config(false), 5, Dtype::Float32, None).unwrap();
    let (prompt, window) = (&PROMPT[..9], &PROMPT[9..]);
    let mut run = |group: Option<usize>| {
        let mut cache = model.new_cache();
        model
            .forward(prompt, &mut cache, LogitsFor::Last, false)
            .unwrap();
        model.set_settings(RunSettings {
            handoff_layers: group.unwrap_or(0),
            ..RunSettings::default()
        });
        let out = model
            .forward_to_read(window, &mut cache, LogitsFor::All, false)
            .unwrap();
        // The next token after the window reads the window's cache rows.
        let next = model
            .forward(&[7], &mut cache, LogitsFor::Last, false)
            .unwrap();
        (
            out.logits.as_slice::<f32>().to_vec(),
            next.logits.as_slice::<f32>().to_vec(),
            cache.offset(),
        )
    };
    let whole = run(Some(0));
    assert_eq!(whole.2, PROMPT.len() + 1);
    for group in [1, 2, 3] {
        assert_eq!(
            run(Some(group)),
            whole,
            "layers handed over {group} at a time"
        );
    }
}

/// How long a window the GPU's window kernels take whole, by model: up to eight tokens for
/// dense or 4-bit weights, none (1) for an MoE branch, whose windows then run a token at a
/// time on a GPU.
#[test]
fn the_window_kernels_take_dense_and_4bit_models_but_not_moe() {
    use mlx_spec::kernels::{CudaDecode, Fused};
    let largest = |model: &Gemma4Model| {
        CudaDecode::new(model, Fused::every())
            .unwrap()
            .largest_exact_window(model)
    };
    // The fixture's heads of 32 are narrower than the heads kernels take: none.
    let narrow = Gemma4Model::random(tiny_config(false), 0, Dtype::Float32, None).unwrap();
    assert_eq!(largest(&narrow), 1);
    let wide_heads_of = |moe| {
        let mut c = tiny_config(moe);
        for plan in c.layers.iter_mut() {
            plan.head_dim *= 2;
        }
        c
    };
    let wide_heads = || wide_heads_of(false);
    let dense = Gemma4Model::random(wide_heads(), 0, Dtype::Float32, None).unwrap();
    assert_eq!(largest(&dense), 8);
    let quantized = Some(QuantSpec {
        group_size: 32,
        bits: 4,
    });
    let packed = Gemma4Model::random(wide_heads(), 0, Dtype::Float32, quantized).unwrap();
    assert_eq!(largest(&packed), 8);
    // Other bit widths have no kernel.
    let eight_bits = Some(QuantSpec {
        group_size: 32,
        bits: 8,
    });
    let packed8 = Gemma4Model::random(wide_heads(), 0, Dtype::Float32, eight_bits).unwrap();
    assert_eq!(largest(&packed8), 1);
    let moe = Gemma4Model::random(wide_heads_of(true), 0, Dtype::Float32, None).unwrap();
    assert_eq!(largest(&moe), 1);
    // A feed-forward wider than the single-token kernel takes (as the 31B's 21 504 beside its
    // hidden 5 376): the window kernel would take it, but decode steps run the three products,
    // so no window computes what steps compute.
    let mut wide_ff = wide_heads();
    for plan in wide_ff.layers.iter_mut() {
        plan.mlp_width = 32_768;
    }
    let wide_ff = Gemma4Model::random(wide_ff, 0, Dtype::Bfloat16, None).unwrap();
    assert_eq!(largest(&wide_ff), 1);
}

/// The default model's 8-bit weights have no window kernel, so a GPU loads them dense
/// (`load::dequantize_here`): dense, in its checkpoint's dtype (float32) or in bf16, the window
/// kernels take its windows, and speculation can gain there.
#[test]
fn the_window_kernels_take_the_default_model_once_dense() {
    use mlx_spec::kernels::{CudaDecode, Fused};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(mlx_spec::DEFAULT_MODEL_DIR);
    let packed = Gemma4Model::load(&dir, DtypeChoice::Auto, None).unwrap();
    let largest = |model: &Gemma4Model| {
        CudaDecode::new(model, Fused::every())
            .unwrap()
            .largest_exact_window(model)
    };
    assert_eq!(largest(&packed), 1, "8-bit: no window kernel");
    for dtype in [DtypeChoice::Auto, DtypeChoice::Fixed(Dtype::Bfloat16)] {
        let dense = Gemma4Model::load_dequantized(&dir, dtype, None).unwrap();
        assert_eq!(largest(&dense), 8, "dense {:?}", dense.dtype);
    }
}
