//! The `assistant` drafter plugin through the host, end to end, on the two oracle pairs of
//! `tests/fixtures/assistant-oracle` (random targets and assistants made with transformers):
//! `mlx-spec draft` reproduces transformers' first round (the anchor token and the four
//! chained drafts, read from the oracle's own record), and speculating with it leaves greedy
//! and seeded sampled output exactly as plain decoding makes it; a relative checkpoint path
//! resolves against the plugin's folder.

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

/// A relative `checkpoint` in the manifest names a folder beside the manifest, wherever the
/// host is run from: the host passes the plugin's folder to the drafter.
#[test]
fn a_relative_checkpoint_resolves_against_the_plugin_folder() {
    let plugins = tempfile::tempdir().unwrap();
    let folder = plugins.path().join("assistant");
    std::fs::create_dir_all(folder.join("weights")).unwrap();
    let source = pair("e").join("assistant");
    for entry in std::fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(
            &path,
            folder.join("weights").join(path.file_name().unwrap()),
        )
        .unwrap();
    }
    let manifest = std::fs::read_to_string(repo_root().join("plugins/assistant/plugin.toml"))
        .unwrap()
        .replace("checkpoint = \"checkpoint\"", "checkpoint = \"weights\"");
    assert!(manifest.contains("\"weights\""), "{manifest}");
    std::fs::write(folder.join("plugin.toml"), manifest).unwrap();
    let library = std::path::PathBuf::from(env!("CARGO_BIN_EXE_mlx-spec"))
        .parent()
        .unwrap()
        .join(if cfg!(target_os = "macos") {
            "libmlx_spec_assistant.dylib"
        } else {
            "libmlx_spec_assistant.so"
        });
    std::fs::copy(&library, folder.join(library.file_name().unwrap())).unwrap();

    let elsewhere = tempfile::tempdir().unwrap();
    let o = oracle("e");
    let target = pair("e").join("target");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(["draft", "--model"])
        .arg(&target)
        .args(["--dtype", "f32", "--plugins-dir"])
        .arg(plugins.path())
        .args([
            "--drafter",
            "assistant",
            "--prompt-ids",
            &ids_arg(&prompt(&o)),
        ])
        .args(["--num-draft-tokens", "4", "--json"])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    let got = json_of(&out);
    assert_eq!(ids(&got["drafts"]), ids(&o["rounds"][0]["draft_tokens"]));
}

/// With `sample_drafts`, the assistant draws its drafts from its own distribution and hands
/// the host those distributions, which verifies by rejection sampling: the output must still
/// follow the target's distribution exactly. 6 000 seeded generations of three tokens at
/// temperature 1 with top-k 3 (27 possible outputs, the second token from a draft accepted or
/// rejected, the third a bonus token or a plain step), counted against the exact joint
/// distribution computed from the target's logits.
#[test]
fn sampled_drafts_with_rejection_sampling_keep_the_target_distribution() {
    use common::sampling::drafted_three_tokens;
    use mlx_rs::Dtype;
    use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model};
    use mlx_spec::plugins::{instantiate, Registry};
    use mlx_spec::sampler::SamplingParams;
    use mlx_spec::speculative::SpecOptions;

    const DRAWS: u64 = 6000;
    let model = Gemma4Model::load(
        &pair("e").join("target"),
        DtypeChoice::Fixed(Dtype::Float32),
        None,
    )
    .unwrap();
    let registry = Registry::scan(&[repo_root().join("plugins")]).unwrap();
    let mut overrides = toml::Table::new();
    let checkpoint = pair("e").join("assistant").display().to_string();
    overrides.insert("checkpoint".into(), toml::Value::String(checkpoint));
    overrides.insert("sample_drafts".into(), toml::Value::Boolean(true));
    let provider = instantiate(registry.get("assistant").unwrap(), &overrides).unwrap();
    let prompt = prompt(&oracle("e"));
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 3,
        seed,
        ..Default::default()
    };
    let options = SpecOptions {
        num_draft_tokens: 4,
        auto_off: false,
        fitted_draft_length: false,
    };
    let draws = drafted_three_tokens(&model, &provider, &prompt, options, sampling, DRAWS);
    let (accepted, drafted) = (draws.accepted, draws.drafted);
    // A random assistant's q spreads over the vocabulary while top-k 3 keeps three tokens, so
    // few drafts are accepted (57 of 6 000 when this was written): enough to reach the bonus
    // token, and thousands of rejections reach the residual draw.
    assert!(
        accepted >= 20 && drafted - accepted >= 20,
        "both branches must be reached: {accepted} of {drafted} drafts accepted"
    );
    println!(
        "{accepted} of {drafted} drafts accepted; chi2 {:.1} < {:.1}?",
        draws.stat, draws.crit
    );
    assert!(
        draws.stat < draws.crit,
        "chi2 {:.1} >= {:.1} over {} cells",
        draws.stat,
        draws.crit,
        draws.cells
    );
}
