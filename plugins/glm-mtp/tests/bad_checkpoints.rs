//! A damaged MTP checkpoint is refused at load with an error naming the file and the tensor,
//! never a panic: a truncated file, a missing tensor, a tensor of the wrong shape, an MLP
//! that is not the one `config.json` describes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mlx_spec_glm_mtp::MtpRow;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mtp-oracle/mtp")
}

/// A copy of the fixture row with its tensors passed through `edit` (name -> (shape, bytes)).
fn damaged(name: &str, edit: impl FnOnce(&mut HashMap<String, (Vec<usize>, Vec<u8>)>)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("glm-mtp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, (Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.shape().to_vec(), t.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (shape, data))| {
            (
                n.clone(),
                TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

fn load_error(dir: &Path) -> String {
    match MtpRow::load(dir, None) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn damaged_checkpoints_are_refused_by_name() {
    let missing = damaged("missing", |t| {
        t.remove("model.layers.6.self_attn.k_proj.bias");
    });
    let e = load_error(&missing);
    assert!(
        e.contains("model.layers.6.self_attn.k_proj.bias") && e.contains("missing"),
        "{e}"
    );

    let reshaped = damaged("shape", |t| {
        let (shape, _) = t.get_mut("model.layers.6.eh_proj.weight").unwrap();
        *shape = vec![128, 64];
    });
    let e = load_error(&reshaped);
    assert!(
        e.contains("eh_proj.weight") && e.contains("[64, 128]"),
        "{e}"
    );

    let dense_weights = damaged("dense", |t| {
        t.retain(|n, _| !n.contains(".mlp."));
        for part in ["gate_proj", "up_proj"] {
            t.insert(
                format!("model.layers.6.mlp.{part}.weight"),
                (vec![96, 64], vec![0u8; 96 * 64 * 4]),
            );
        }
        t.insert(
            "model.layers.6.mlp.down_proj.weight".into(),
            (vec![64, 96], vec![0u8; 96 * 64 * 4]),
        );
    });
    let e = load_error(&dense_weights);
    assert!(
        e.contains("mlp.gate.weight") && e.contains("missing"),
        "{e}"
    );

    let truncated = damaged("truncated", |_| {});
    let file = truncated.join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..(len as usize) / 2]).unwrap();
    let e = load_error(&truncated);
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );

    let no_config = damaged("config", |_| {});
    std::fs::remove_file(no_config.join("config.json")).unwrap();
    let e = load_error(&no_config);
    assert!(e.contains("config.json") && e.contains("checkpoint"), "{e}");

    for dir in [missing, reshaped, dense_weights, truncated, no_config] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
