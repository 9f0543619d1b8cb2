//! The neural drafters as they ship, each with the default checkpoint in its plugin folder,
//! trained for the default model (model cards beside them): the `glm-mtp` row
//! (`train/train_mtp.py`), the `deepspec` DSpark drafter (`train/train_dspark.py`) and the
//! `draft-model` 3-layer Gemma 4 (`train/train_model.py --shape draft3`). Each loads from its
//! folder with no setting, leaves greedy output exactly as plain decoding makes it, and is
//! worth its place: on a code prompt a share of its drafts is accepted that a broken load
//! (random-looking drafts accept next to none) cannot reach. Their drafts' parity with the
//! reference implementations is tested on the oracle fixtures (`tests/glm_mtp_drafter.rs`,
//! `tests/deepspec_drafter.rs`, `tests/draft_model_drafter.rs`).

mod common;

use common::{json_of, mlx_spec, repo_root};
use serde_json::Value;

const CODE_PROMPT: &str = "import os\n\n\ndef read_config(path):\n";

fn generate(extra: &[&str]) -> Value {
    let model = repo_root().join("models/gemma4-code-25m");
    let plugins = repo_root().join("plugins");
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--plugins-dir",
        plugins.to_str().unwrap(),
        "--prompt",
        CODE_PROMPT,
        "--max-tokens",
        "120",
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    json_of(&mlx_spec(&args))
}

#[test]
fn each_shipped_drafter_is_lossless_and_accepted() {
    let plain = generate(&[]);
    // (drafter, the least share of drafts accepted; measured on this prompt when they shipped:
    // glm-mtp 0.72, deepspec 0.16 with whole blocks, draft-model 0.44)
    for (drafter, floor) in [("glm-mtp", 0.4), ("deepspec", 0.1), ("draft-model", 0.3)] {
        let spec = generate(&["--drafter", drafter, "--no-auto-off"]);
        assert_eq!(spec["tokens"], plain["tokens"], "{drafter}");
        let stats = &spec["stats"];
        assert!(stats["drafter_error"].is_null(), "{drafter}: {stats}");
        let drafted = stats["num_draft_tokens"].as_u64().unwrap();
        let accepted = stats["num_accepted_tokens"].as_u64().unwrap();
        println!("{drafter}: {accepted} of {drafted} drafts accepted");
        assert!(drafted >= 40, "{drafter}: only {drafted} drafts");
        assert!(
            accepted as f64 >= floor * drafted as f64,
            "{drafter}: {accepted} of {drafted} drafts accepted, below {floor}"
        );
    }
}
