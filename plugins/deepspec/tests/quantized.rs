//! What `mlx-spec quantize-drafter` writes, loaded by this plugin's own loader, computes what
//! the float checkpoint computes within the error 8-bit weights allow, with its matrices, the
//! gather tables (`embed_tokens`, `markov_head.markov_w1`) included, held packed and the
//! confidence head in float.
//!
//! The oracle fixture is 48 wide, which no group of 32 or 64 divides (only its 128-wide
//! `o_proj` packs), so the main case is a widened copy: the fixture's tensors redrawn at
//! hidden 64, MLP 128, Markov rank 64 (each tensor with its own mean and spread), quantized
//! in groups of 64. Both models get the same random taps and anchors; the block's base logits,
//! its Markov-corrected logits and its confidences are compared.
//!
//! The tolerance: 8-bit affine rounding leaves each weight off by a uniform error of at most
//! half a step (`range / 255` of its group of 64; the range of that many normal weights is
//! 4 to 4.5 sigma), an rms error of about 0.5 % of the weights' spread, which a product passes
//! on as the same relative error in its output. Along the block's products (fc, two layers of q/k, o, gate/up and down, the head and the Markov table)
//! at most about ten such errors add up in sequence, so the logits' relative rms error
//! `|d| / |logits|` is at most about 5 %: that is the bound, with the same greedy tokens. And
//! since the error is proportional to the step while it is small, 4-bit weights (steps 17
//! times larger) must move the logits at least 4 times as much: the comparison sees the
//! weights and the error scales as rounding does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_spec_deepspec::{Block, BlockOutput, Choice, Context, DSparkModel, NoPorts};
use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::{random, Array, Dtype};
use safetensors::tensor::{Dtype as StDtype, TensorView};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepspec-oracle")
}

/// The `mlx-spec` binary of the build these tests belong to (`target/<profile>/mlx-spec`).
fn mlx_spec_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("mlx-spec");
    assert!(
        bin.is_file(),
        "{} is missing: build the host first (cargo build --release)",
        bin.display()
    );
    bin
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mlx-spec-deepspec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn quantize(src: &Path, dst: &Path, bits: u32, group: u32) {
    let out = std::process::Command::new(mlx_spec_binary())
        .args(["quantize-drafter", "--bits", &bits.to_string()])
        .args(["--group-size", &group.to_string()])
        .arg(src)
        .arg(dst)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "quantize-drafter: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn floats(a: &Array) -> Vec<f32> {
    let a = a
        .as_dtype(Dtype::Float32)
        .unwrap()
        .multiply(Array::from_f32(1.0))
        .unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

/// The fixture redrawn wider: hidden 48 -> 64, MLP 80 -> 128, taps 144 -> 192, Markov rank
/// 16 -> 64 (confidence input 64 -> 128).
fn widened() -> PathBuf {
    let dir = scratch("widened");
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    config["hidden_size"] = 64.into();
    config["intermediate_size"] = 128.into();
    config["markov_rank"] = 64.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let src = Checkpoint::open_dir(&fixture()).unwrap();
    let mut owned: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for (i, name) in src.names().enumerate() {
        let a = floats(&src.tensor_any_shape(name).unwrap());
        let n = a.len() as f32;
        let mean = a.iter().sum::<f32>() / n;
        let spread = (a.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n)
            .sqrt()
            .max(1e-3);
        let markov = name.starts_with("markov_head.");
        let shape: Vec<usize> = src
            .shape(name)
            .unwrap()
            .iter()
            .enumerate()
            .map(|(axis, &d)| match d {
                48 => 64,
                80 => 128,
                144 => 192,
                16 if markov && axis == 1 => 64,
                64 if name.starts_with("confidence_head.") => 128,
                d => d,
            })
            .collect();
        let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let key = random::key(1000 + i as u64).unwrap();
        let drawn = random::normal::<f32>(&dims[..], mean, spread, &key).unwrap();
        let bytes = floats(&drawn)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        owned.insert(name.to_owned(), (shape, bytes));
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, (s, b))| {
            (
                n.clone(),
                TensorView::new(StDtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// Two blocks (after 12 context rows, then 3 more) on seeded random taps.
fn blocks(model: &DSparkModel) -> Vec<(BlockOutput, Block)> {
    let width = (model.config.target_layer_ids.len() * model.config.hidden_size) as i32;
    let mut context = Context::default();
    let mut out = Vec::new();
    for (rows, anchor, seed) in [(12, 7u32, 1u64), (3, 11, 2)] {
        let key = random::key(seed).unwrap();
        let taps = random::normal::<f32>(&[rows, width][..], 0.0, 1.0, &key).unwrap();
        model.extend_context(&mut context, &taps).unwrap();
        let o = model.block(&context, anchor, &NoPorts).unwrap();
        let b = model.choose(&o, anchor, Choice::Greedy).unwrap();
        out.push((o, b));
    }
    out
}

/// (relative rms difference of the base and Markov logits, their largest difference, the
/// largest difference of a confidence, whether the tokens are the same).
fn compare(float: &DSparkModel, other: &DSparkModel) -> (f32, f32, f32, bool) {
    let (mut d2, mut x2, mut worst, mut dc, mut same) = (0f64, 0f64, 0f32, 0f32, true);
    for ((fo, fb), (oo, ob)) in blocks(float).iter().zip(blocks(other).iter()) {
        for (a, b) in [(&fo.base_logits, &oo.base_logits), (&fb.logits, &ob.logits)] {
            for (x, y) in floats(a).iter().zip(floats(b)) {
                worst = worst.max((x - y).abs());
                d2 += f64::from(x - y).powi(2);
                x2 += f64::from(*x).powi(2);
            }
        }
        for (x, y) in fb.confidence.iter().zip(&ob.confidence) {
            dc = dc.max((x - y).abs());
        }
        same &= fb.tokens == ob.tokens;
    }
    ((d2 / x2).sqrt() as f32, worst, dc, same)
}

#[test]
fn quantized_checkpoints_compute_as_the_float_one() {
    let src = widened();
    let float = DSparkModel::load(&src, None).unwrap();
    let mut drift = Vec::new();
    for bits in [8, 4] {
        let dir = scratch(&format!("q{bits}"));
        quantize(&src, &dir, bits, 64);
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["quantization"]["confidence_head.proj"], false);
        let ck = Checkpoint::open_dir(&dir).unwrap();
        for table in ["embed_tokens", "markov_head.markov_w1", "lm_head", "fc"] {
            assert!(ck.contains(&format!("{table}.scales")), "{table} is packed");
        }
        let model = DSparkModel::load(&dir, None).unwrap();
        let (d, worst, dc, same) = compare(&float, &model);
        println!(
            "{bits}-bit: logits off by {:.2} % rms (largest difference {worst:.4}), max |d confidence| {dc:.4}, same tokens {same}; {} bytes (float {})",
            100.0 * d,
            model.nbytes(),
            float.nbytes()
        );
        assert!(
            model.nbytes() * 2 < float.nbytes(),
            "{bits}-bit: {} bytes vs {} in float: not held packed",
            model.nbytes(),
            float.nbytes()
        );
        if bits == 8 {
            assert!(same, "8-bit: greedy tokens differ");
            assert!(d <= 0.05, "8-bit: logits off by {d} (relative rms)");
            assert!(dc <= 0.02, "8-bit: confidences moved by {dc}");
        }
        drift.push(d);
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(
        drift[1] > 4.0 * drift[0],
        "4-bit logits ({}) should move at least 4 times as much as 8-bit ones ({})",
        drift[1],
        drift[0]
    );
    let _ = std::fs::remove_dir_all(&src);
}

/// The fixture itself: only its 128-wide `o_proj` packs in groups of 32; the other matrices,
/// listed `false`, load in float beside it.
#[test]
fn a_partly_quantized_fixture_loads_and_matches() {
    let dir = scratch("fixture-q8");
    quantize(&fixture(), &dir, 8, 32);
    let float = DSparkModel::load(&fixture(), None).unwrap();
    let model = DSparkModel::load(&dir, None).unwrap();
    let (d, worst, dc, same) = compare(&float, &model);
    println!(
        "fixture 8-bit: logits off by {:.3} % rms (largest difference {worst:.5}), max |d confidence| {dc:.5}",
        100.0 * d
    );
    assert!(model.nbytes() < float.nbytes());
    assert!(same && d <= 0.05 && dc <= 0.02);
    let _ = std::fs::remove_dir_all(&dir);
}
