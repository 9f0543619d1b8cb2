//! Drafter checkpoints say which target they were trained for (`trained_for.json`, written by
//! `train/trained_for.py`), and the host warns when it runs one with another target: a drafter
//! that reads the target's hidden states drafts next to nothing for a target it never saw, and
//! without the warning the user only sees speculation slower than plain decoding.

mod common;

use common::{default_model, default_model_name, mlx_spec, repo_root};
use mlx_rs::Dtype;
use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model};
use mlx_spec::plugins::trained_for::{target_fingerprint, TrainedFor};

const TRAINED_FOR_THE_DEFAULT_MODEL: [&str; 4] = ["assistant", "glm-mtp", "deepspec", "dflash"];

fn fingerprint_of(dir: &std::path::Path, dtype: Dtype) -> String {
    let model = Gemma4Model::load(dir, DtypeChoice::Fixed(dtype), None).unwrap();
    target_fingerprint(&model).unwrap()
}

/// Copies the plain files of `from` (not its folders) into `to`, which it creates.
fn copy_files(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// A copy of the default model whose final norm differs in one bf16 mantissa bit: the same
/// shapes (every drafter still runs with it), but to the fingerprint another target, as a
/// retrained or fine-tuned model of the same architecture would be.
fn another_target_of_the_same_shape(into: &std::path::Path) -> std::path::PathBuf {
    let dir = into.join("gemma4-code-25m-retrained");
    copy_files(&default_model(), &dir);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let mut bytes = std::fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        let Some(norm) = header.get("model.norm.weight") else {
            continue;
        };
        assert_eq!(
            norm["dtype"], "BF16",
            "the default model stores its norms in bf16"
        );
        let start = norm["data_offsets"][0].as_u64().unwrap() as usize;
        // The low byte of the first value holds its last mantissa bit.
        bytes[8 + header_len + start] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        return dir;
    }
    panic!("no shard of the default model holds model.norm.weight");
}

/// The host's fingerprint of the default model is the one the Python script wrote into every
/// shipped checkpoint that reads the target's states, whatever float dtype the model runs in;
/// a one-bit change of the final norm gives another.
#[test]
fn shipped_checkpoints_name_the_default_model_by_its_fingerprint() {
    let default = fingerprint_of(&default_model(), Dtype::Float32);
    assert_eq!(default, fingerprint_of(&default_model(), Dtype::Bfloat16));
    let name = default_model_name();
    for plugin in TRAINED_FOR_THE_DEFAULT_MODEL {
        let dir = repo_root().join("plugins").join(plugin).join("checkpoint");
        let record = TrainedFor::read(&dir)
            .unwrap()
            .unwrap_or_else(|| panic!("{plugin}: no trained_for.json"));
        assert_eq!(record.target, name, "{plugin}");
        assert_eq!(record.final_norm_sha256, default, "{plugin}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let other = fingerprint_of(
        &another_target_of_the_same_shape(tmp.path()),
        Dtype::Float32,
    );
    assert_ne!(other, default);
}

fn stderr_of_a_short_run(model: &std::path::Path) -> String {
    let plugins = repo_root().join("plugins");
    let out = mlx_spec(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--plugins-dir",
        plugins.to_str().unwrap(),
        "--drafter",
        "assistant",
        "--prompt",
        "def read_config(path):",
        "--max-tokens",
        "4",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    stderr
}

#[test]
fn a_drafter_run_with_another_target_is_warned_about_and_still_runs() {
    let quiet = stderr_of_a_short_run(&default_model());
    assert!(!quiet.contains("was trained for"), "{quiet}");
    let tmp = tempfile::tempdir().unwrap();
    let warned = stderr_of_a_short_run(&another_target_of_the_same_shape(tmp.path()));
    let name = default_model_name();
    assert!(
        warned.contains("drafter \"assistant\"")
            && warned.contains(&format!("trained for the target \"{name}\""))
            && warned.contains("gemma4-code-25m-retrained"),
        "{warned}"
    );
}

/// A malformed record stops the run with the file named, before the model loads.
#[test]
fn a_malformed_record_is_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let plugin = tmp.path().join("assistant");
    let src = repo_root().join("plugins/assistant");
    copy_files(&src, &plugin);
    copy_files(&src.join("checkpoint"), &plugin.join("checkpoint"));
    std::fs::write(
        plugin.join("checkpoint/trained_for.json"),
        r#"{"target": "gemma4-code-25m"}"#,
    )
    .unwrap();
    let out = mlx_spec(&[
        "generate",
        "--plugins-dir",
        tmp.path().to_str().unwrap(),
        "--drafter",
        "assistant",
        "--prompt",
        "x",
        "--max-tokens",
        "1",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("trained_for.json") && stderr.contains("final_norm_sha256"),
        "{stderr}"
    );
}
