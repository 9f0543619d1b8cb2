//! The installed binary (`scripts/install.sh`) runs the README's main command from any
//! directory: its default model and plugins are found beside it, not in the build tree nor in
//! the working directory.

mod common;

use std::process::Command;

use common::repo_root;

#[test]
fn the_installed_binary_runs_the_main_command_from_another_directory() {
    let prefix = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let install = Command::new(repo_root().join("scripts/install.sh"))
        .args(["--no-build", "--prefix"])
        .arg(prefix.path())
        .output()
        .unwrap();
    assert!(
        install.status.success(),
        "install.sh failed: {}",
        String::from_utf8_lossy(&install.stderr)
    );
    let share = prefix.path().join("share/mlx-spec");
    assert!(share
        .join(mlx_spec::DEFAULT_MODEL_DIR)
        .join("config.json")
        .is_file());
    assert!(share.join("plugins/ngram/plugin.toml").is_file());
    // A plugin's own files travel with it; its sources do not.
    assert!(share
        .join("plugins/assistant/checkpoint/model.safetensors")
        .is_file());
    assert!(!share.join("plugins/assistant/src").exists());

    let binary = prefix.path().join("bin/mlx-spec");
    let run = |args: &[&str]| {
        Command::new(&binary)
            .args(args)
            .current_dir(elsewhere.path())
            .env_remove(mlx_spec::HOME_VAR)
            .env_remove("MLX_SPEC_MODEL")
            .env("RUST_LOG", "info")
            .output()
            .unwrap()
    };

    let listed = run(&["plugins", "list"]);
    let listed_text = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.status.success());
    assert!(
        listed_text
            .lines()
            .any(|l| l.starts_with("ngram") && l.contains(" ok (interface revision")),
        "the installed ngram plugin is not listed as usable: {listed_text}"
    );

    let out = run(&[
        "generate",
        "--prompt",
        "def read_config(path):",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--drafter",
        "ngram",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "generate failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stats"]["generated_tokens"], 24);
    assert_eq!(v["stats"]["drafter"], "ngram");
    assert!(!v["text"].as_str().unwrap().is_empty());
    // The assistant finds its checkpoint in the installed plugin folder.
    let out = run(&[
        "generate",
        "--prompt",
        "def read_config(path):",
        "--max-tokens",
        "24",
        "--drafter",
        "assistant",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "generate with the assistant failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let with_assistant: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(with_assistant["stats"]["drafter"], "assistant");
    assert!(with_assistant["stats"]["drafter_error"].is_null());
    // The model it loaded is the installed copy.
    let installed_model = share.join(mlx_spec::DEFAULT_MODEL_DIR);
    assert!(
        stderr.contains(&installed_model.display().to_string()),
        "the default model was not read from {}: {stderr}",
        installed_model.display()
    );
}
