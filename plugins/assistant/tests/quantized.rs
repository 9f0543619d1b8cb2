//! mlx-community's affine-quantized layout: the oracle's float checkpoint is quantized with
//! MLX's own `quantize` into `.weight` (packed uint32) + `.scales` + `.biases` on every matrix
//! whose width splits into groups (the embedding table and the centroids included), with a
//! `quantization` block in config.json and a per-module `false` for the one matrix that does
//! not split (down_proj, 48 wide). The loader must read it as the same function: the packed
//! checkpoint drafts what the float checkpoint holding the same (dequantized) weights drafts.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{floats, max_diff, scratch, Oracle, PAIRS};
use mlx_spec_assistant::checkpoint::Checkpoint;
use mlx_spec_assistant::AssistantModel;
use mlx_spec_plugin_api::mlx_rs::ops::{dequantize, quantize};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};
use safetensors::tensor::{Dtype as StDtype, TensorView};

const GROUP: i32 = 32;

fn raw_bytes(a: &Array) -> (StDtype, Vec<u8>) {
    match a.dtype() {
        Dtype::Float32 => (
            StDtype::F32,
            a.as_slice::<f32>()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        Dtype::Uint32 => (
            StDtype::U32,
            a.as_slice::<u32>()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        Dtype::Int64 => (
            StDtype::I64,
            a.as_slice::<i64>()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        other => panic!("unexpected dtype {other:?}"),
    }
}

fn write(dir: &Path, tensors: &BTreeMap<String, Array>) {
    let owned: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, a)| {
            let (dtype, bytes) = raw_bytes(a);
            let shape = a.shape().iter().map(|&d| d as usize).collect();
            (name.clone(), dtype, shape, bytes)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Writes the packed checkpoint and its float twin (weights dequantized back); returns both
/// folders.
fn make(o: &Oracle, bits: i32) -> (std::path::PathBuf, std::path::PathBuf) {
    let src = o.dir.join("assistant");
    let float = Checkpoint::open_dir(&src).unwrap();
    let mut packed = BTreeMap::new();
    let mut twin = BTreeMap::new();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let mut quant = serde_json::json!({"group_size": GROUP, "bits": bits});
    for name in float.names().map(str::to_owned).collect::<Vec<_>>() {
        let a = float.tensor_any_shape(&name).unwrap();
        let matrix = a.ndim() == 2 && a.dtype() == Dtype::Float32 && name.ends_with(".weight");
        if !matrix {
            packed.insert(name.clone(), a.clone());
            twin.insert(name, a);
            continue;
        }
        let module = name.trim_end_matches(".weight").to_owned();
        if a.shape()[1] % GROUP != 0 {
            quant[&module] = serde_json::Value::Bool(false);
            packed.insert(name.clone(), a.clone());
            twin.insert(name, a);
            continue;
        }
        let (q, scales, biases) = quantize(&a, GROUP, bits).unwrap();
        let back = dequantize(&q, &scales, &biases, GROUP, bits).unwrap();
        packed.insert(name.clone(), q);
        packed.insert(format!("{module}.scales"), scales);
        packed.insert(format!("{module}.biases"), biases);
        twin.insert(name, back);
    }
    assert!(packed.contains_key("model.embed_tokens.scales"));
    config["quantization"] = quant;
    let tag = format!("{}-{bits}bit", o.pair);
    let (qdir, tdir) = (
        scratch(&format!("{tag}-packed")),
        scratch(&format!("{tag}-twin")),
    );
    write(&qdir, &packed);
    write(&tdir, &twin);
    let mut twin_config = config.clone();
    twin_config.as_object_mut().unwrap().remove("quantization");
    std::fs::write(qdir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(tdir.join("config.json"), twin_config.to_string()).unwrap();
    (qdir, tdir)
}

/// r0's logits of every step and the drafts.
fn run(o: &Oracle, model: &AssistantModel) -> (Vec<Vec<f32>>, Vec<u32>) {
    let round = o.round(model, "r0", 0);
    let (tokens, steps) = o.chain(model, "r0", &round);
    let logits = steps
        .iter()
        .map(|s| floats(&model.head.logits(&s.normed).unwrap()))
        .collect();
    (logits, tokens)
}

#[test]
fn packed_checkpoints_draft_as_their_float_twins() {
    for pair in PAIRS {
        let o = Oracle::open(pair);
        let (float_logits, float_tokens) = run(&o, &o.model());
        for bits in [8, 4] {
            let (qdir, tdir) = make(&o, bits);
            let packed = AssistantModel::load(&qdir, None).unwrap();
            let twin = AssistantModel::load(&tdir, None).unwrap();
            let (pl, pt) = run(&o, &packed);
            let (tl, tt) = run(&o, &twin);
            let vs_twin = pl
                .iter()
                .zip(&tl)
                .map(|(a, b)| max_diff(a, b))
                .fold(0f32, f32::max);
            let vs_float = pl
                .iter()
                .zip(&float_logits)
                .map(|(a, b)| max_diff(a, b))
                .fold(0f32, f32::max);
            println!(
                "[{pair}] {bits}-bit: max |d logits| vs float twin {vs_twin:.2e}, vs original float {vs_float:.3}; drafts {pt:?} (float {float_tokens:?})"
            );
            assert_eq!(
                pt, tt,
                "{pair} {bits}-bit: drafts differ from the float twin"
            );
            assert!(
                vs_twin <= 1e-4,
                "{pair} {bits}-bit: logits differ from the twin by {vs_twin:e}"
            );
            // The packed weights are what the model holds (not dequantized at load).
            assert!(
                packed.nbytes() * 2 < twin.nbytes(),
                "{pair} {bits}-bit: {} bytes packed vs {} in float",
                packed.nbytes(),
                twin.nbytes()
            );
            if bits == 8 {
                assert_eq!(
                    pt, float_tokens,
                    "{pair} 8-bit: drafts differ from the float model's"
                );
                assert!(
                    vs_float < 0.25,
                    "{pair} 8-bit: logits moved by {vs_float} from the float model"
                );
            }
            let _ = std::fs::remove_dir_all(&qdir);
            let _ = std::fs::remove_dir_all(&tdir);
        }
    }
}
