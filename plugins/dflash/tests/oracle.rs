//! Parity with z-lab's own `DFlashDraftModel` (`tests/fixtures/dflash-oracle`, made by
//! `tests/oracle/make_dflash_oracle.py`: z-lab's module with random weights drafting for a
//! random Gemma 4 target from the target's own taps, float32): three rounds of one context
//! (12 prompt rows; 3 more after two forced acceptances; 1 more after none). The block's
//! final hidden state and the logits of rows 1..B-1 within 1e-4, the B-1 drafts exactly.
//!
//! The target's ports are played here by its tables read straight from the fixture: the
//! embedding `E[t] * sqrt(H)` and the tied head with Gemma's soft-cap.
//!
//! Negative controls: the same drafter with every layer full (non-causal), without the
//! window, or with the attention scale of 1, must miss the oracle — the fixture can tell the
//! conventions apart. Every layer full is also checked against the oracle's record of z-lab's
//! module under transformers' plain eager attention (round 1), which ignores the window.

use std::path::{Path, PathBuf};

use mlx_spec_dflash::{Choice, Context, DFlashConfig, DFlashModel, TargetPorts};
use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::ops::{matmul, tanh};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dflash-oracle")
}

fn floats(a: &Array) -> Vec<f32> {
    // A product makes a new contiguous array whatever the input's strides.
    let a = a
        .as_dtype(Dtype::Float32)
        .unwrap()
        .multiply(Array::from_f32(1.0))
        .unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    let (a, b) = (floats(a), floats(b));
    assert_eq!(a.len(), b.len(), "sizes differ");
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The fixture target's embedding and tied, soft-capped head.
struct FixtureTarget {
    table: Array,
    scale: f32,
    cap: f32,
}

impl FixtureTarget {
    fn load() -> Self {
        let dir = fixture().join("target");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let hidden = config["hidden_size"].as_u64().unwrap() as f32;
        let checkpoint = Checkpoint::open_dir(&dir).unwrap();
        FixtureTarget {
            table: checkpoint
                .tensor_any_shape("model.embed_tokens.weight")
                .unwrap()
                .as_dtype(Dtype::Float32)
                .unwrap(),
            // transformers keeps sqrt(H) in the weights' dtype: float32 here.
            scale: hidden.sqrt(),
            cap: config["final_logit_softcapping"].as_f64().unwrap() as f32,
        }
    }
}

impl TargetPorts for FixtureTarget {
    fn embed(&self, ids: &[u32]) -> Result<Array, String> {
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let n = ids.len() as i32;
        self.table
            .take_axis(Array::from_slice(&ids, &[n]), 0)
            .and_then(|x| x.multiply(Array::from_f32(self.scale)))
            .map_err(|e| e.to_string())
    }

    fn logits(&self, hidden: &Array) -> Result<Array, String> {
        let cap = Array::from_f32(self.cap);
        matmul(hidden, self.table.transpose().unwrap())
            .and_then(|z| z.divide(&cap))
            .and_then(|z| tanh(&z))
            .and_then(|z| z.multiply(&cap))
            .map_err(|e| e.to_string())
    }
}

fn meta() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("oracle.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Runs every recorded round; returns per round (tokens match, worst hidden and logit
/// differences).
fn run_rounds(model: &DFlashModel) -> Vec<(String, bool, f32, f32)> {
    let rec = Checkpoint::open_file(&fixture().join("oracle.safetensors")).unwrap();
    let get = |name: &str| rec.tensor_any_shape(name).unwrap();
    let target = FixtureTarget::load();
    let mut context = Context::default();
    let mut results = Vec::new();
    for round in meta()["rounds"].as_array().unwrap() {
        let tag = round["tag"].as_str().unwrap();
        assert_eq!(
            context.rows() as u64,
            round["context_rows_before"].as_u64().unwrap(),
            "{tag}"
        );
        model
            .extend_context(&mut context, &get(&format!("{tag}.new_taps")))
            .unwrap();
        assert_eq!(
            context.rows() as u64,
            round["anchor_position"].as_u64().unwrap(),
            "{tag}"
        );
        let anchor = round["anchor"].as_u64().unwrap() as u32;
        let out = model.block(&context, anchor, &target).unwrap();
        let block = model.choose(&out, Choice::Greedy).unwrap();
        let hidden = max_diff(&out.hidden, &get(&format!("{tag}.block_hidden")));
        let logits = max_diff(&out.logits, &get(&format!("{tag}.logits")));
        let same = block.tokens == ids(&round["drafts"]);
        println!(
            "[{tag}] drafts {:?} (oracle {}), hidden {hidden:e}, logits {logits:e}",
            block.tokens, round["drafts"]
        );
        results.push((tag.to_owned(), same, hidden, logits));
    }
    results
}

#[test]
fn every_recorded_round_matches_zlabs_module() {
    let meta = meta();
    assert!(
        meta["min_top2_logit_gap"].as_f64().unwrap() > 1e-3,
        "the oracle's tokens must not hang on float32 noise"
    );
    let model = DFlashModel::load(&fixture(), Some(Dtype::Float32)).unwrap();
    // The config leaves the taps out; z-lab's default picked these.
    assert_eq!(
        model.config.target_layer_ids,
        meta["target_layer_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap() as i32)
            .collect::<Vec<_>>()
    );
    let b = model.config.block_size;
    let rounds = run_rounds(&model);
    assert_eq!(rounds.len(), 3);
    for (tag, same, hidden, logits) in rounds {
        assert!(same, "{tag}: the drafts differ from z-lab's");
        assert!(hidden <= TOL, "{tag}: block hidden differs by {hidden:e}");
        assert!(logits <= TOL, "{tag}: logits differ by {logits:e}");
    }
    assert_eq!(ids(&meta["rounds"][0]["drafts"]).len(), b - 1, "B-1 drafts");
}

fn altered(change: impl Fn(&mut DFlashConfig)) -> Vec<(String, bool, f32, f32)> {
    let dir = fixture();
    let mut config = DFlashConfig::parse(
        &std::fs::read_to_string(dir.join("config.json")).unwrap(),
        "",
    )
    .unwrap();
    change(&mut config);
    run_rounds(&DFlashModel::with_config(&dir, config, Some(Dtype::Float32)).unwrap())
}

/// Every layer full is z-lab's module as it stands on the CPU (transformers' eager attention
/// drops the window): it misses the oracle, and matches the oracle's record of that module.
#[test]
fn every_layer_non_causal_misses_the_oracle_and_is_zlabs_eager_module() {
    let all_full = |c: &mut DFlashConfig| c.layer_windows = vec![None; c.num_layers];
    let rounds = altered(all_full);
    let worst = rounds.iter().map(|r| r.3).fold(0.0, f32::max);
    assert!(
        worst > 1e-2,
        "sliding layers' causality left no trace: {worst:e}"
    );
    let dir = fixture();
    let mut config = DFlashConfig::parse(
        &std::fs::read_to_string(dir.join("config.json")).unwrap(),
        "",
    )
    .unwrap();
    all_full(&mut config);
    let model = DFlashModel::with_config(&dir, config, Some(Dtype::Float32)).unwrap();
    let rec = Checkpoint::open_file(&dir.join("oracle.safetensors")).unwrap();
    let mut context = Context::default();
    model
        .extend_context(&mut context, &rec.tensor_any_shape("r1.new_taps").unwrap())
        .unwrap();
    let meta = meta();
    let anchor = meta["rounds"][0]["anchor"].as_u64().unwrap() as u32;
    let out = model
        .block(&context, anchor, &FixtureTarget::load())
        .unwrap();
    let stock = rec.tensor_any_shape("r1.stock_eager_logits").unwrap();
    let diff = max_diff(&out.logits, &stock);
    assert!(diff <= TOL, "z-lab's eager module differs by {diff:e}");
    assert_eq!(
        model.choose(&out, Choice::Greedy).unwrap().tokens,
        ids(&meta["r1_stock_eager"]["drafts"])
    );
}

#[test]
fn a_window_too_wide_misses_the_oracle() {
    // Causal but without the window: the context beyond the window must matter.
    let rounds = altered(|c| {
        for w in c.layer_windows.iter_mut().flatten() {
            *w = 1 << 20;
        }
    });
    let worst = rounds.iter().map(|r| r.3).fold(0.0, f32::max);
    assert!(worst > 1e-2, "the window left no trace: {worst:e}");
}

#[test]
fn attention_scale_one_misses_the_oracle() {
    let rounds = altered(|c| c.attention_scale = 1.0);
    let worst = rounds.iter().map(|r| r.3).fold(0.0, f32::max);
    assert!(worst > 1e-2, "the attention scale left no trace: {worst:e}");
    assert!(rounds.iter().any(|r| !r.1), "the drafts should change too");
}

/// `sample_drafts`: each row drawn with a key from the seed and its emitted index, and the
/// distributions handed over are `softmax(logits / T)` of the same rows.
#[test]
fn sampled_blocks_are_keyed_by_seed_and_index_and_carry_their_distributions() {
    use mlx_spec_plugin_api::mlx_rs::ops::softmax_axis;
    let model = DFlashModel::load(&fixture(), Some(Dtype::Float32)).unwrap();
    let rec = Checkpoint::open_file(&fixture().join("oracle.safetensors")).unwrap();
    let mut context = Context::default();
    model
        .extend_context(&mut context, &rec.tensor_any_shape("r1.new_taps").unwrap())
        .unwrap();
    let anchor = meta()["rounds"][0]["anchor"].as_u64().unwrap() as u32;
    let out = model
        .block(&context, anchor, &FixtureTarget::load())
        .unwrap();
    let sample = |seed, first_index| {
        let choice = Choice::Sampled {
            temperature: 20.0,
            seed,
            first_index,
        };
        model.choose(&out, choice).unwrap()
    };
    let a = sample(1, 100);
    assert_eq!(
        a.tokens,
        sample(1, 100).tokens,
        "the same key, the same block"
    );
    let others: Vec<Vec<u32>> = (2..6).map(|s| sample(s, 100).tokens).collect();
    assert!(others.iter().any(|t| *t != a.tokens), "the seed is read");
    let moved: Vec<Vec<u32>> = (101..105).map(|i| sample(1, i).tokens).collect();
    assert!(
        moved.iter().any(|t| *t != a.tokens),
        "the emitted index is read"
    );
    let q = a.probs.expect("sampled blocks carry q");
    assert_eq!(q.shape(), &[5, 300]);
    let want = softmax_axis(
        out.logits.multiply(Array::from_f32(1.0 / 20.0)).unwrap(),
        -1,
        true,
    )
    .unwrap();
    assert!(max_diff(&q, &want) < 1e-6);
    assert!(model.choose(&out, Choice::Greedy).unwrap().probs.is_none());
}
