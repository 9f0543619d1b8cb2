//! The assistant drafter as it ships: `plugins/assistant/checkpoint`, trained for the default
//! model by `train/train_assistant.py` (model card beside it). Its drafts are transformers'
//! own (`Gemma4AssistantForCausalLM` on the dequantized target, recorded by
//! `tests/oracle/make_assistant_golden.py`), speculating with it leaves greedy output exactly
//! as plain decoding makes it, and it is worth running: on a code prompt most of its drafts
//! are accepted.

mod common;

use common::{default_model, ids_arg, json_of, mlx_spec, repo_root};
use serde_json::Value;

const CODE_PROMPT: &str = "import os\n\n\ndef read_config(path):\n";

fn model() -> String {
    default_model().display().to_string()
}

fn plugins() -> String {
    repo_root().join("plugins").display().to_string()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// `tests/fixtures/assistant-shipped.json`: transformers' anchor and drafts for three prompts.
fn golden() -> Value {
    let path = repo_root().join("tests/fixtures/assistant-shipped.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `mlx-spec draft` with the shipped assistant: its JSON (`anchor`, `drafts`).
fn draft(prompt_ids: &Value, k: &str, settings: &[&str]) -> Value {
    let (model, plugins, prompt) = (model(), plugins(), ids_arg(&ids(prompt_ids)));
    let mut args = vec![
        "draft",
        "--model",
        &model,
        "--plugins-dir",
        &plugins,
        "--drafter",
        "assistant",
        "--prompt-ids",
        &prompt,
        "--num-draft-tokens",
        k,
        "--json",
    ];
    for setting in settings {
        args.extend_from_slice(&["--drafter-set", setting]);
    }
    json_of(&mlx_spec(&args))
}

/// `mlx-spec generate --json` of the code prompt, greedy; `extra` adds the drafter's flags.
fn generate_code(max_tokens: &str, extra: &[&str]) -> Value {
    let model = model();
    let mut args = vec![
        "generate",
        "--model",
        &model,
        "--prompt",
        CODE_PROMPT,
        "--max-tokens",
        max_tokens,
        "--json",
    ];
    args.extend_from_slice(extra);
    json_of(&mlx_spec(&args))
}

#[test]
fn the_shipped_checkpoint_drafts_what_transformers_drafts() {
    let golden = golden();
    let k = golden["num_draft_tokens"].as_u64().unwrap().to_string();
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        // transformers' drafts, recorded without the checkpoint's confidence floor.
        let got = draft(&case["prompt_ids"], &k, &["min_draft_probability=0"]);
        assert_eq!(got["anchor"], case["anchor"], "{}", case["text"]);
        assert_eq!(
            ids(&got["drafts"]),
            ids(&case["drafts"]),
            "{}",
            case["text"]
        );
    }
}

#[test]
fn the_shipped_assistant_is_lossless_and_mostly_accepted_on_code() {
    let plain = generate_code("96", &[]);
    let plugins = plugins();
    // Every round drafts: with auto-off the gate's choice of rounds follows measured times.
    let spec = generate_code(
        "96",
        &[
            "--plugins-dir",
            &plugins,
            "--drafter",
            "assistant",
            "--no-auto-off",
        ],
    );
    assert_eq!(spec["tokens"], plain["tokens"]);
    let stats = &spec["stats"];
    assert!(stats["drafter_error"].is_null(), "{stats}");
    let drafted = stats["num_draft_tokens"].as_f64().unwrap();
    let accepted = stats["num_accepted_tokens"].as_f64().unwrap();
    // A drafter that guesses has almost every draft rejected; the shipped one, with its
    // confidence floor, had 61 of its 70 drafts accepted on this prompt when it was trained.
    assert!(
        drafted >= 40.0 && accepted / drafted >= 0.6,
        "{accepted} of {drafted} drafts accepted: {stats}"
    );
}

/// `min_draft_probability` ends a greedy round at the first draft the drafter itself doubts:
/// what is proposed is a prefix of the round without the floor, shorter where the drafter is
/// unsure, and the output stays that of plain decoding.
#[test]
fn a_confidence_floor_cuts_rounds_to_a_prefix_and_stays_lossless() {
    let mut shortened = 0;
    for case in golden()["cases"].as_array().unwrap() {
        let floored =
            ids(&draft(&case["prompt_ids"], "6", &["min_draft_probability=0.5"])["drafts"]);
        let full = ids(&case["drafts"]);
        assert!(full.starts_with(&floored), "{floored:?} vs {full:?}");
        shortened += usize::from(floored.len() < full.len());
        // With no setting, the floor is the checkpoint's own `assistant_confidence_threshold`
        // (0.5 in its generation_config.json).
        assert_eq!(
            ids(&draft(&case["prompt_ids"], "6", &[])["drafts"]),
            floored
        );
    }
    assert!(shortened > 0, "no round was cut at 0.5");

    let plain = generate_code("64", &[]);
    let plugins = plugins();
    let spec = generate_code(
        "64",
        &[
            "--plugins-dir",
            &plugins,
            "--drafter",
            "assistant",
            "--drafter-set",
            "min_draft_probability=0.5",
            "--no-auto-off",
        ],
    );
    assert_eq!(spec["tokens"], plain["tokens"]);
    assert!(
        spec["stats"]["drafter_error"].is_null(),
        "{}",
        spec["stats"]
    );
    assert!(spec["stats"]["num_drafts"].as_u64().unwrap() > 0);
}
