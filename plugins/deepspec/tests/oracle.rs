//! Parity with DeepSpec's own `Gemma4DSparkModel` (`tests/fixtures/deepspec-oracle`: DeepSpec's
//! module and inference helpers with random weights and random taps, float32): three rounds of
//! one context cache (12 fresh rows; 3 more after two accepted drafts; 1 more after an empty
//! proposal). The context projection, every layer's cached keys and values, the block's
//! hidden state, the base and Markov logits, the confidences within 1e-4; the tokens and the
//! proposal length at every recorded threshold exactly.

use std::path::{Path, PathBuf};

use mlx_spec_deepspec::{confident_prefix, Choice, Context, DSparkModel, NoPorts};
use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepspec-oracle")
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

#[test]
fn three_rounds_match_deepspec() {
    let dir = fixture();
    let rec = Checkpoint::open_file(&dir.join("oracle.safetensors")).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("oracle_meta.json")).unwrap())
            .unwrap();
    let model = DSparkModel::load(&dir, Some(Dtype::Float32)).unwrap();
    let b = model.config.block_size;
    let get = |name: &str| rec.tensor_any_shape(name).unwrap();
    let mut context = Context::default();
    for round in meta["rounds"].as_array().unwrap() {
        let tag = round["tag"].as_str().unwrap();
        let anchor = round["anchor"].as_u64().unwrap() as u32;
        assert_eq!(
            context.rows() as u64,
            round["cache_rows_before"].as_u64().unwrap()
        );
        let taps = get(&format!("{tag}.new_taps"));
        let width = *taps.shape().last().unwrap();
        let taps = taps.reshape(&[-1, width]).unwrap();
        let projected = model.extend_context(&mut context, &taps).unwrap();
        assert_eq!(
            context.rows() as u64,
            round["anchor_position"].as_u64().unwrap()
        );
        let mut worst = vec![(
            "context projection",
            max_diff(&projected, &get(&format!("{tag}.new_ctx_projected"))),
        )];
        for i in 0..model.config.num_layers {
            let (k, v) = context.layer(i).unwrap();
            worst.push((
                "cached keys",
                max_diff(k, &get(&format!("{tag}.cache_after.k.{i}"))),
            ));
            worst.push((
                "cached values",
                max_diff(v, &get(&format!("{tag}.cache_after.v.{i}"))),
            ));
        }
        let out = model.block(&context, anchor, &NoPorts).unwrap();
        let block = model.choose(&out, anchor, Choice::Greedy).unwrap();
        worst.push((
            "block hidden",
            max_diff(&out.hidden, &get(&format!("{tag}.block_hidden"))),
        ));
        worst.push((
            "base logits",
            max_diff(&out.base_logits, &get(&format!("{tag}.base_logits"))),
        ));
        worst.push((
            "Markov logits",
            max_diff(&block.logits, &get(&format!("{tag}.markov_logits"))),
        ));
        worst.push((
            "confidence logits",
            max_diff(
                block.confidence_logits.as_ref().unwrap(),
                &get(&format!("{tag}.confidence_logits")),
            ),
        ));
        worst.push((
            "confidence",
            max_diff(
                &Array::from_slice(&block.confidence, &[1, b as i32]),
                &get(&format!("{tag}.confidence")),
            ),
        ));
        let want: Vec<u32> = round["draft_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        println!("[{tag}] tokens {:?}, {worst:?}", block.tokens);
        assert_eq!(block.tokens, want, "{tag}: tokens");
        for (what, w) in worst {
            assert!(w <= TOL, "{tag}: {what} differs by {w:e}");
        }
        let lengths = round["proposal_length_by_threshold"].as_object().unwrap();
        assert!(
            lengths.len() >= 3,
            "{tag}: the oracle records several thresholds"
        );
        for (threshold, length) in lengths {
            let t: f32 = threshold.parse().unwrap();
            assert_eq!(
                confident_prefix(&block.confidence, &[t], b) as u64,
                length.as_u64().unwrap(),
                "{tag}: proposal length at threshold {t}"
            );
        }
    }
}
