//! The `assistant` drafter plugin through the host, end to end, on the two oracle pairs of
//! `tests/fixtures/assistant-oracle` (random targets and assistants made with transformers):
//! `mlx-spec draft` reproduces transformers' first round (the anchor token and the four
//! chained drafts, read from the oracle's own record), and speculating with it leaves greedy
//! and seeded sampled output exactly as plain decoding makes it.

mod common;

use std::path::PathBuf;

use common::{ids_arg, json_of, mlx_spec, repo_root};
use serde_json::Value;

const PAIRS: [&str; 2] = ["e", "dense"];

fn pair(name: &str) -> PathBuf {
    repo_root()
        .join("tests/fixtures/assistant-oracle")
        .join(name)
}

fn oracle(name: &str) -> Value {
    let text = std::fs::read_to_string(pair(name).join("oracle.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// The oracle's prompt: the first `prompt_len` tokens of its recorded `generate` output.
fn prompt(o: &Value) -> Vec<u32> {
    let len = o["prompt_len"].as_u64().unwrap() as usize;
    ids(&o["generate_output"])[..len].to_vec()
}

fn checkpoint_flag(name: &str) -> String {
    format!("checkpoint={}", pair(name).join("assistant").display())
}

fn plugins_dir() -> String {
    repo_root().join("plugins").display().to_string()
}

#[test]
fn the_draft_probe_reproduces_transformers_first_round() {
    for name in PAIRS {
        let o = oracle(name);
        let r0 = &o["rounds"][0];
        assert_eq!(r0["round"], "r0");
        let drafts = ids(&r0["draft_tokens"]);
        let target = pair(name).join("target");
        let out = mlx_spec(&[
            "draft",
            "--model",
            target.to_str().unwrap(),
            "--dtype",
            "f32",
            "--plugins-dir",
            &plugins_dir(),
            "--drafter",
            "assistant",
            "--drafter-set",
            &checkpoint_flag(name),
            "--prompt-ids",
            &ids_arg(&prompt(&o)),
            "--num-draft-tokens",
            &drafts.len().to_string(),
            "--json",
        ]);
        let got = json_of(&out);
        // The anchor is the target's greedy token after the prompt: transformers generated it
        // right after the prompt.
        let anchor = ids(&o["generate_output"])[prompt(&o).len()];
        assert_eq!(got["anchor"].as_u64().unwrap() as u32, anchor, "{name}");
        assert_eq!(ids(&got["drafts"]), drafts, "{name}: drafts");
    }
}

fn generate(name: &str, extra: &[&str]) -> Value {
    let target = pair(name).join("target");
    let o = oracle(name);
    let prompt = ids_arg(&prompt(&o));
    let mut args = vec![
        "generate",
        "--model",
        target.to_str().unwrap(),
        "--dtype",
        "f32",
        "--prompt-ids",
        &prompt,
        "--max-tokens",
        "48",
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    json_of(&mlx_spec(&args))
}

#[test]
fn speculating_with_the_assistant_leaves_greedy_and_seeded_output_unchanged() {
    let plugins = plugins_dir();
    for name in PAIRS {
        let checkpoint = checkpoint_flag(name);
        let drafter = [
            "--plugins-dir",
            &plugins,
            "--drafter",
            "assistant",
            "--drafter-set",
            &checkpoint,
            "--no-auto-off",
        ];
        for sampling in [
            vec![],
            vec!["--temperature", "0.9", "--seed", "7"],
            vec!["--temperature", "1.0", "--top-k", "20", "--seed", "3"],
        ] {
            let plain = generate(name, &sampling);
            let mut with = sampling.clone();
            with.extend_from_slice(&drafter);
            let spec = generate(name, &with);
            assert_eq!(spec["tokens"], plain["tokens"], "{name} {sampling:?}");
            let stats = &spec["stats"];
            assert!(stats["drafter_error"].is_null(), "{name}: {stats}");
            assert!(stats["num_drafts"].as_u64().unwrap() > 0, "{name}: {stats}");
        }
    }
}
