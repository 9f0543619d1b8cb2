//! What `mlx-spec quantize-drafter` writes for a z-lab DFlash checkpoint, loaded by this
//! plugin's own loader, computes what the float checkpoint computes within the error 8-bit
//! weights allow, its matrices held packed.
//!
//! The oracle fixture is 48 wide, which no group of 64 divides, so the main case is a widened
//! copy: every tensor of the fixture redrawn at hidden 64 and MLP 128 (each with its own mean
//! and spread), quantized in groups of 64. The target's ports are a random 64-wide table (the
//! embedding, and the tied head with a soft-cap); both models see the same taps and anchors,
//! and the logits of each block's draft rows are compared.
//!
//! The tolerance: 8-bit affine rounding moves each weight by at most half a step (a 255th of
//! its group's range), an rms error of about 0.5 % of the weights' spread, passed on as the
//! same relative error by each product; along fc and three layers' q/k/v, o, gate/up and down
//! about fifteen such errors add up, so the logits' relative rms error stays under 5 %, with
//! the same greedy drafts. 4-bit steps are 17 times larger, so 4-bit weights must move the
//! logits at least 4 times as much: the comparison sees the weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_spec_dflash::{Choice, Context, DFlashModel, TargetPorts};
use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::ops::{matmul, tanh};
use mlx_spec_plugin_api::mlx_rs::{random, Array, Dtype};
use safetensors::tensor::{Dtype as StDtype, TensorView};

const WIDTH: i32 = 64;
const VOCAB: i32 = 300;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dflash-oracle")
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
    let dir = std::env::temp_dir().join(format!("mlx-spec-dflash-{name}-{}", std::process::id()));
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

/// A random 64-wide target: embedding `E[t] * 8` and the tied head soft-capped at 30.
struct RandomTarget {
    table: Array,
}

impl RandomTarget {
    fn new() -> Self {
        let key = random::key(7).unwrap();
        RandomTarget {
            table: random::normal::<f32>(&[VOCAB, WIDTH][..], 0.0, 1.0, &key).unwrap(),
        }
    }
}

impl TargetPorts for RandomTarget {
    fn embed(&self, ids: &[u32]) -> Result<Array, String> {
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let n = ids.len() as i32;
        self.table
            .take_axis(Array::from_slice(&ids, &[n]), 0)
            .and_then(|x| x.multiply(Array::from_f32((WIDTH as f32).sqrt())))
            .map_err(|e| e.to_string())
    }

    fn logits(&self, hidden: &Array) -> Result<Array, String> {
        let hidden = hidden.as_dtype(Dtype::Float32).map_err(|e| e.to_string())?;
        let raw = matmul(&hidden, self.table.t()).map_err(|e| e.to_string())?;
        let cap = Array::from_f32(30.0);
        raw.divide(&cap)
            .and_then(|x| tanh(&x))
            .and_then(|x| x.multiply(&cap))
            .map_err(|e| e.to_string())
    }
}

/// The fixture redrawn wider: hidden 48 -> 64, MLP 96 -> 128, taps 144 -> 192 (the heads'
/// 64 query and 32 key/value rows stay).
fn widened() -> PathBuf {
    let dir = scratch("widened");
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    config["hidden_size"] = WIDTH.into();
    config["intermediate_size"] = 128.into();
    config["vocab_size"] = VOCAB.into();
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
        let is_o_proj = name.contains("o_proj");
        let shape: Vec<usize> = src
            .shape(name)
            .unwrap()
            .iter()
            .enumerate()
            .map(|(axis, &d)| match d {
                48 => 64,
                96 => 128,
                144 => 192,
                // o_proj reads the 4 x 16 query heads: its input stays 64.
                64 if is_o_proj && axis == 1 => 64,
                d => d,
            })
            .collect();
        let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let key = random::key(2000 + i as u64).unwrap();
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

/// The draft rows' logits and drafts of two blocks (after 12 context rows, then 3 more) on
/// seeded random taps.
fn blocks(model: &DFlashModel, target: &RandomTarget) -> Vec<(Vec<f32>, Vec<u32>)> {
    let width = (model.config.target_layer_ids.len() * model.config.hidden_size) as i32;
    let mut context = Context::default();
    let mut out = Vec::new();
    for (rows, anchor, seed) in [(12, 7u32, 1u64), (3, 11, 2)] {
        let key = random::key(seed).unwrap();
        let taps = random::normal::<f32>(&[rows, width][..], 0.0, 1.0, &key).unwrap();
        model.extend_context(&mut context, &taps).unwrap();
        let o = model.block(&context, anchor, target).unwrap();
        let b = model.choose(&o, Choice::Greedy).unwrap();
        out.push((floats(&o.logits), b.tokens));
    }
    out
}

/// (relative rms difference of the logits, whether the drafts are the same).
fn compare(float: &DFlashModel, other: &DFlashModel, target: &RandomTarget) -> (f32, bool) {
    let (mut d2, mut x2, mut same) = (0f64, 0f64, true);
    for ((fl, ft), (ol, ot)) in blocks(float, target).iter().zip(blocks(other, target)) {
        for (x, y) in fl.iter().zip(&ol) {
            d2 += f64::from(x - y).powi(2);
            x2 += f64::from(*x).powi(2);
        }
        same &= *ft == ot;
    }
    ((d2 / x2).sqrt() as f32, same)
}

#[test]
fn quantized_checkpoints_compute_as_the_float_one() {
    let src = widened();
    let target = RandomTarget::new();
    let float = DFlashModel::load(&src, None).unwrap();
    let mut drift = Vec::new();
    for bits in [8, 4] {
        let dir = scratch(&format!("q{bits}"));
        quantize(&src, &dir, bits, 64);
        let ck = Checkpoint::open_dir(&dir).unwrap();
        for module in ["fc", "layers.0.self_attn.q_proj", "layers.2.mlp.down_proj"] {
            assert!(
                ck.contains(&format!("{module}.scales")),
                "{module} is packed"
            );
        }
        let model = DFlashModel::load(&dir, None).unwrap();
        let (d, same) = compare(&float, &model, &target);
        println!(
            "{bits}-bit: logits off by {:.2} % rms, same drafts {same}; {} bytes (float {})",
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
            assert!(same, "8-bit: greedy drafts differ");
            assert!(d <= 0.05, "8-bit: logits off by {d} (relative rms)");
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

/// The fixture itself in groups of 32: only the 64-wide `o_proj` and the 96-wide `down_proj`
/// inputs split, so those pack and every other matrix, listed `false`, loads in float beside
/// them; the oracle's drafts stay.
#[test]
fn a_partly_quantized_fixture_loads_and_matches() {
    let dir = scratch("fixture-q8");
    quantize(&fixture(), &dir, 8, 32);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization"]["fc"], false);
    let ck = Checkpoint::open_dir(&dir).unwrap();
    assert!(ck.contains("layers.1.self_attn.o_proj.scales"));
    assert!(ck.contains("layers.1.mlp.down_proj.scales"));
    assert!(!ck.contains("fc.scales"));
    let float = DFlashModel::load(&fixture(), None).unwrap();
    let model = DFlashModel::load(&dir, None).unwrap();
    // The fixture is 48 wide: a table of that width plays the target.
    let key = random::key(9).unwrap();
    let narrow = RandomTarget {
        table: random::normal::<f32>(&[VOCAB, 48][..], 0.0, 1.0, &key).unwrap(),
    };
    let (d, same) = compare(&float, &model, &narrow);
    println!("fixture 8-bit: logits off by {:.3} % rms", 100.0 * d);
    assert!(model.nbytes() < float.nbytes());
    assert!(same && d <= 0.05, "drafts same {same}, drift {d}");
    let _ = std::fs::remove_dir_all(&dir);
}
