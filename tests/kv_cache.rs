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

#[test]
fn long_decode_rolls_back_within_the_reserve() {
    // Past the window many times over; rollbacks of up to the reserve keep working.
    let model = load("tiny-moe-keqv");
    let mut cache = model.new_cache();
    let mut clean = model.new_cache();
    logits(&model, &[2], &mut cache);
    logits(&model, &[2], &mut clean);
    for step in 0..40u32 {
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
}
