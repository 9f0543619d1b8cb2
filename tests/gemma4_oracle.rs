//! The Gemma 4 target against transformers 5.24 (goldens from tests/oracle/make_fixtures.py):
//! full-sequence logits and per-layer hidden states, cached single-token decode past the
//! sliding window, chunked prefill, and greedy continuations, on every fixture (PLE + KV
//! sharing + double-wide MLP; MoE + K=V + global KV heads, sharded; the released nested
//! layout in bf16; affine 4/8-bit quantization).

mod common;

use common::{default_model, fixture, max_abs_diff, repo_root, Golden, FIXTURES};
use mlx_rs::Dtype;
use mlx_spec::generate::{generate, greedy_token, GenerateRequest, StopReason};
use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model, LogitsFor};
use mlx_spec::sampler::SamplingParams;

/// Tolerance for float32 logits against the float32 oracle.
const LOGITS_TOL: f32 = 1e-4;

fn load_f32(name: &str) -> Gemma4Model {
    // bf16 fixtures are computed in float32 here: the oracle ran on the same rounded weights.
    Gemma4Model::load(&fixture(name), DtypeChoice::Fixed(Dtype::Float32), None)
        .unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

/// `n` greedy tokens after `prompt`, one cached decode step at a time.
fn greedy(model: &Gemma4Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.new_cache();
    let mut logits = model
        .forward(prompt, &mut cache, LogitsFor::Last, false)
        .unwrap()
        .logits;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let next = greedy_token(&logits).unwrap();
        out.push(next);
        logits = model
            .forward(&[next], &mut cache, LogitsFor::Last, false)
            .unwrap()
            .logits;
    }
    out
}

fn to_vec(a: &mlx_rs::Array) -> Vec<f32> {
    a.as_dtype(Dtype::Float32)
        .unwrap()
        .as_slice::<f32>()
        .to_vec()
}

#[test]
fn full_sequence_logits_and_hidden_states_match_transformers() {
    for name in FIXTURES {
        let model = load_f32(name);
        let golden = Golden::load(name);
        let ids = golden.ids("prompt_ids");
        let mut cache = model.new_cache();
        let out = model
            .forward(&ids, &mut cache, LogitsFor::All, true)
            .unwrap();
        let (_, want) = golden.f32("logits");
        let diff = max_abs_diff(&to_vec(&out.logits), &want);
        assert!(diff < LOGITS_TOL, "{name}: logits differ by {diff}");
        assert_eq!(out.hidden.len(), model.config.num_layers + 1);
        for (k, h) in out.hidden.iter().enumerate() {
            let (_, want) = golden.f32(&format!("hidden.{k}"));
            let diff = max_abs_diff(&to_vec(h), &want);
            assert!(diff < LOGITS_TOL, "{name}: hidden.{k} differs by {diff}");
        }
    }
}

#[test]
fn cached_decode_past_the_window_matches_transformers() {
    for name in FIXTURES {
        let model = load_f32(name);
        let golden = Golden::load(name);
        let ids = golden.ids("prompt_ids");
        let (shape, want) = golden.f32("decode_logits");
        let vocab = shape[1];
        let mut cache = model.new_cache();
        let mut got = to_vec(
            &model
                .forward(&ids[..7], &mut cache, LogitsFor::All, false)
                .unwrap()
                .logits,
        );
        for &id in &ids[7..] {
            got.extend(to_vec(
                &model
                    .forward(&[id], &mut cache, LogitsFor::All, false)
                    .unwrap()
                    .logits,
            ));
        }
        assert_eq!(got.len(), ids.len() * vocab);
        let diff = max_abs_diff(&got, &want);
        assert!(
            diff < LOGITS_TOL,
            "{name}: cached decode logits differ by {diff}"
        );
    }
}

#[test]
fn chunked_prefill_matches_transformers() {
    for name in FIXTURES {
        let model = load_f32(name);
        let golden = Golden::load(name);
        let ids = golden.ids("prompt_ids");
        // Compared with the full-sequence oracle logits: transformers' own chunked run drifts
        // from its full run by up to 7e-5 on these fixtures, and the two drifts would add up.
        let (_, want) = golden.f32("logits");
        let mut cache = model.new_cache();
        let mut got = Vec::new();
        let mut start = 0;
        for len in [3, 5, 4, 8] {
            let chunk = &ids[start..start + len];
            got.extend(to_vec(
                &model
                    .forward(chunk, &mut cache, LogitsFor::All, false)
                    .unwrap()
                    .logits,
            ));
            start += len;
        }
        let diff = max_abs_diff(&got, &want);
        assert!(
            diff < LOGITS_TOL,
            "{name}: chunked prefill logits differ by {diff}"
        );
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    for name in FIXTURES {
        let model = load_f32(name);
        let golden = Golden::load(name);
        let ids = golden.ids("prompt_ids");
        let want = golden.ids("greedy_ids");
        let got = greedy(&model, &ids, want.len());
        assert_eq!(got, want, "{name}: greedy continuation differs");
    }
}

/// `generate` queues each greedy step before reading the token it consumes; it must still give
/// transformers' continuation, and stop at a stop token without emitting it.
#[test]
fn pipelined_greedy_generation_matches_transformers() {
    for name in FIXTURES {
        let model = load_f32(name);
        let golden = Golden::load(name);
        let prompt_ids = golden.ids("prompt_ids");
        let want = golden.ids("greedy_ids");
        let request = |stop_ids: Vec<u32>, max_tokens: usize| GenerateRequest {
            prompt_ids: prompt_ids.clone(),
            max_tokens,
            sampling: SamplingParams::default(),
            stop_ids,
            ignore_eos: false,
        };
        let (got, stats) = generate(&model, &request(vec![], want.len()), |_| Ok(())).unwrap();
        assert_eq!(got, want, "{name}: pipelined greedy continuation differs");
        assert_eq!(stats.stop_reason, StopReason::Length);

        // Stopping on the 6th token ends generation just before its first occurrence.
        let stop = want[5];
        let first = want.iter().position(|&t| t == stop).unwrap();
        let (got, stats) = generate(&model, &request(vec![stop], want.len()), |_| Ok(())).unwrap();
        assert_eq!(got, want[..first], "{name}: generation past the stop token");
        assert_eq!(stats.stop_token, Some(stop));
    }
}

/// Half precision cannot match a float32 oracle to 1e-4. Transformers itself, run in the
/// same dtypes on these fixtures, is off by 0.42 / 0.37 (bf16; wrapped / ple-kvshare) and
/// 0.17 (f16, ple-kvshare) in max |logit| and agrees with its float32 argmax on 85–100% of
/// positions. We compute every block in the model dtype, as transformers does, but MLX's
/// fused RMSNorm rounds the normalised vector to bf16 before applying the weight (transformers
/// rounds once, after), which roughly doubles the drift per layer: measured 1.89 / 0.76 (bf16)
/// and 0.14 (f16). The bounds sit above those figures, still well under the errors of a norm
/// or scale applied in the wrong place (several units), and the argmax must mostly agree.
#[test]
fn half_precision_compute_stays_within_transformers_own_rounding() {
    let cases = [
        ("tiny-wrapped-bf16", Dtype::Bfloat16, 2.5, 0.8),
        ("tiny-ple-kvshare", Dtype::Bfloat16, 1.2, 0.8),
        ("tiny-ple-kvshare", Dtype::Float16, 0.4, 0.95),
    ];
    for (name, dtype, max_diff, min_agreement) in cases {
        let model = Gemma4Model::load(&fixture(name), DtypeChoice::Fixed(dtype), None).unwrap();
        assert_eq!(model.dtype, dtype);
        let golden = Golden::load(name);
        let ids = golden.ids("prompt_ids");
        let out = model
            .forward(&ids, &mut model.new_cache(), LogitsFor::All, true)
            .unwrap();
        // The residual stream stays in the compute dtype: a float32 constant that promoted it
        // would make every later matrix product upcast its weight on each token.
        for (i, h) in out.hidden.iter().enumerate() {
            assert_eq!(h.dtype(), dtype, "{name}: hidden state {i} left {dtype:?}");
        }
        let (shape, want) = golden.f32("logits");
        let got = to_vec(&out.logits);
        let diff = max_abs_diff(&got, &want);
        assert!(diff < max_diff, "{name} {dtype:?}: max |logit diff| {diff}");
        let v = shape[1];
        let argmax = |x: &[f32]| mlx_spec::sampler::argmax(x);
        let agree = (0..ids.len())
            .filter(|&r| argmax(&got[r * v..(r + 1) * v]) == argmax(&want[r * v..(r + 1) * v]))
            .count();
        let agreement = agree as f64 / ids.len() as f64;
        println!("{name} {dtype:?}: max |logit diff| {diff}, argmax agreement {agreement}");
        assert!(
            agreement >= min_agreement,
            "{name} {dtype:?}: argmax agrees on only {agreement}"
        );
    }
}

#[test]
fn auto_dtype_follows_the_checkpoint() {
    let bf16 = Gemma4Model::load(&fixture("tiny-wrapped-bf16"), DtypeChoice::Auto, None).unwrap();
    assert_eq!(bf16.dtype, Dtype::Bfloat16);
    let f32 = Gemma4Model::load(&fixture("tiny-ple-q4"), DtypeChoice::Auto, None).unwrap();
    assert_eq!(
        f32.dtype,
        Dtype::Float32,
        "quantized: the dtype of the scales"
    );
}

/// The default model, trained on real code: transformers' logits on a held-out file and its
/// greedy continuation (tests/goldens/gemma4-code-7m.safetensors, written by the training
/// script from the saved checkpoint).
#[test]
fn trained_default_model_matches_transformers_on_held_out_code() {
    let model =
        Gemma4Model::load(&default_model(), DtypeChoice::Fixed(Dtype::Float32), None).unwrap();
    let golden = Golden::from_file(&repo_root().join("tests/goldens/gemma4-code-7m.safetensors"));
    let ids = golden.ids("prompt_ids");
    assert!(
        ids.len() > model.config.sliding_window / 4,
        "the prompt should be a real stretch of code"
    );
    let out = model
        .forward(&ids, &mut model.new_cache(), LogitsFor::All, false)
        .unwrap();
    let (_, want) = golden.f32("logits");
    let diff = max_abs_diff(&to_vec(&out.logits), &want);
    assert!(diff < LOGITS_TOL, "logits differ by {diff}");

    let want = golden.ids("greedy_ids");
    let got = greedy(&model, &ids, want.len());
    assert_eq!(got, want, "greedy continuation differs from transformers");
}
