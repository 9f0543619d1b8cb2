//! A broken checkpoint is an error naming the file and the tensor, never a panic.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{pair_dir, scratch};
use mlx_spec_assistant::AssistantModel;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;

fn source() -> PathBuf {
    pair_dir("e").join("assistant")
}

/// A copy of the e/ assistant with `edit` applied to its tensors (name -> (dtype, shape, bytes)).
fn edited(
    name: &str,
    edit: impl FnOnce(&mut BTreeMap<String, (StDtype, Vec<usize>, Vec<u8>)>),
) -> PathBuf {
    let bytes = std::fs::read(source().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<String, (StDtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let dir = scratch(name);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    std::fs::copy(source().join("config.json"), dir.join("config.json")).unwrap();
    dir
}

fn load_err(dir: &Path) -> String {
    match AssistantModel::load(dir, None) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn truncated_and_corrupt_files_are_named() {
    let bytes = std::fs::read(source().join("model.safetensors")).unwrap();
    let dir = scratch("truncated");
    std::fs::copy(source().join("config.json"), dir.join("config.json")).unwrap();
    let file = dir.join("model.safetensors");
    std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains(&file.display().to_string()) && e.contains("truncated"),
        "{e}"
    );

    std::fs::write(&file, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}").unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains(&file.display().to_string()) && e.contains("not a valid safetensors"),
        "{e}"
    );

    std::fs::write(&file, b"").unwrap();
    let e = load_err(&dir);
    assert!(e.contains("not a valid safetensors"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_tensors_and_wrong_shapes_are_named() {
    let dir = edited("missing", |t| {
        t.remove("model.layers.2.mlp.up_proj.weight");
    });
    let e = load_err(&dir);
    assert!(
        e.contains("model.layers.2.mlp.up_proj.weight") && e.contains("missing"),
        "{e}"
    );

    let dir = edited("shape", |t| {
        let entry = t.get_mut("model.layers.1.self_attn.q_proj.weight").unwrap();
        entry.1 = vec![32, 64];
    });
    let e = load_err(&dir);
    assert!(
        e.contains("model.layers.1.self_attn.q_proj.weight")
            && e.contains("[64, 32]")
            && e.contains("[32, 64]"),
        "{e}"
    );

    let dir = edited("no-centroids", |t| {
        t.remove("masked_embedding.centroids.weight");
    });
    let e = load_err(&dir);
    assert!(
        e.contains("masked_embedding.centroids.weight") && e.contains("use_ordered_embeddings"),
        "{e}"
    );

    let dir = edited("ordering", |t| {
        let entry = t.get_mut("masked_embedding.token_ordering").unwrap();
        entry.2[..8].copy_from_slice(&999i64.to_le_bytes());
    });
    let e = load_err(&dir);
    assert!(
        e.contains("masked_embedding.token_ordering") && e.contains("999"),
        "{e}"
    );

    let dir = edited("quantized-without-config", |t| {
        t.insert(
            "pre_projection.scales".into(),
            (StDtype::F32, vec![32, 4], vec![0u8; 32 * 4 * 4]),
        );
    });
    let e = load_err(&dir);
    assert!(
        e.contains("pre_projection") && e.contains("quantization"),
        "{e}"
    );
}

#[test]
fn a_bad_or_absent_config_is_named() {
    let dir = scratch("no-config");
    let e = load_err(&dir);
    assert!(e.contains("config.json") && e.contains("checkpoint"), "{e}");
    std::fs::write(dir.join("config.json"), "{ nope").unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("config.json") && e.contains("not valid JSON"),
        "{e}"
    );
    std::fs::copy(source().join("config.json"), dir.join("config.json")).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("no weights"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
