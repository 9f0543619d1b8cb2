//! Drafter checkpoints say which target they were trained for (`trained_for.json`, written by
//! `train/trained_for.py`), and the host warns when it runs one with another target: a drafter
//! that reads the target's hidden states drafts next to nothing for a target it never saw, and
//! without the warning the user only sees speculation slower than plain decoding.

mod common;

use common::{default_model, mlx_spec, repo_root};
use mlx_rs::Dtype;
use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model};
use mlx_spec::plugins::trained_for::{target_fingerprint, TrainedFor};

const TRAINED_FOR_THE_DEFAULT_MODEL: [&str; 4] = ["assistant", "glm-mtp", "deepspec", "dflash"];
const NEXT_MODEL: &str = "models/gemma4-code-25m-v2";

fn fingerprint_of(dir: &std::path::Path, dtype: Dtype) -> String {
    let model = Gemma4Model::load(dir, DtypeChoice::Fixed(dtype), None).unwrap();
    target_fingerprint(&model).unwrap()
}

/// The host's fingerprint of the default model is the one the Python script wrote into every
/// shipped checkpoint that reads the target's states, whatever float dtype the model runs in;
/// the next model's differs.
#[test]
fn shipped_checkpoints_name_the_default_model_by_its_fingerprint() {
    let default = fingerprint_of(&default_model(), Dtype::Float32);
    assert_eq!(default, fingerprint_of(&default_model(), Dtype::Bfloat16));
    for plugin in TRAINED_FOR_THE_DEFAULT_MODEL {
        let dir = repo_root().join("plugins").join(plugin).join("checkpoint");
        let record = TrainedFor::read(&dir)
            .unwrap()
            .unwrap_or_else(|| panic!("{plugin}: no trained_for.json"));
        assert_eq!(record.target, "gemma4-code-25m", "{plugin}");
        assert_eq!(record.final_norm_sha256, default, "{plugin}");
    }
    let next = fingerprint_of(&repo_root().join(NEXT_MODEL), Dtype::Float32);
    assert_ne!(next, default);
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
    let warned = stderr_of_a_short_run(&repo_root().join(NEXT_MODEL));
    assert!(
        warned.contains("drafter \"assistant\"")
            && warned.contains("trained for the target \"gemma4-code-25m\"")
            && warned.contains("gemma4-code-25m-v2"),
        "{warned}"
    );
}

/// A malformed record stops the run with the file named, before the model loads.
#[test]
fn a_malformed_record_is_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let plugin = tmp.path().join("assistant");
    let src = repo_root().join("plugins/assistant");
    std::fs::create_dir_all(plugin.join("checkpoint")).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), plugin.join(entry.file_name())).unwrap();
        }
    }
    for entry in std::fs::read_dir(src.join("checkpoint")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(
            entry.path(),
            plugin.join("checkpoint").join(entry.file_name()),
        )
        .unwrap();
    }
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
