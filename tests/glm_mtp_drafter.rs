//! The `glm-mtp` drafter plugin through the host, end to end, on the oracle fixture of
//! `tests/fixtures/mtp-oracle` (a random Gemma 4 target and a random GLM-style MTP row made
//! with transformers): `mlx-spec draft` reproduces transformers' first round for each recorded
//! convention, speculating with it leaves greedy and seeded output exactly as plain decoding
//! makes it, sampled drafts verified by rejection sampling keep the target's distribution, and
//! a row trained for another target is refused with both values named.

mod common;

use std::path::PathBuf;

use common::{ids_arg, json_of, mlx_spec, repo_root};
use serde_json::Value;

fn fixture() -> PathBuf {
    repo_root().join("tests/fixtures/mtp-oracle")
}

fn target() -> String {
    fixture().join("target").display().to_string()
}

fn checkpoint_flag() -> String {
    format!("checkpoint={}", fixture().join("mtp").display())
}

fn plugins_dir() -> String {
    repo_root().join("plugins").display().to_string()
}

fn oracle_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("oracle.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// The oracle's prompt (recorded in its safetensors; its first round's `pending` follows it).
fn prompt() -> Vec<u32> {
    use mlx_spec_plugin_api::checkpoint::Checkpoint;
    let rec = Checkpoint::open_file(&fixture().join("oracle.safetensors")).unwrap();
    let a = rec
        .tensor_any_shape("prompt.input_ids")
        .unwrap()
        .as_dtype(mlx_rs::Dtype::Int64)
        .unwrap();
    a.eval().unwrap();
    a.as_slice::<i64>().iter().map(|&t| t as u32).collect()
}

#[test]
fn the_draft_probe_reproduces_each_recorded_convention() {
    let o = oracle_json();
    let prompt = ids_arg(&prompt());
    let (target, plugins, checkpoint) = (target(), plugins_dir(), checkpoint_flag());
    for (case, settings) in [
        ("prefill_prenorm", vec![]),
        ("empty_prenorm", vec!["kv_prefill=false"]),
        ("prefill_postnorm", vec!["chain_hidden=\"post_norm\""]),
    ] {
        let round = &o["cases"][case]["rounds"][0];
        let mut args = vec![
            "draft",
            "--model",
            &target,
            "--dtype",
            "f32",
            "--plugins-dir",
            &plugins,
            "--drafter",
            "glm-mtp",
            "--drafter-set",
            &checkpoint,
            "--prompt-ids",
            &prompt,
            "--num-draft-tokens",
            "3",
            "--json",
        ];
        for s in &settings {
            args.extend_from_slice(&["--drafter-set", s]);
        }
        let got = json_of(&mlx_spec(&args));
        assert_eq!(
            got["anchor"].as_u64().unwrap(),
            round["pending"].as_u64().unwrap(),
            "{case}: the anchor is the target's greedy token after the prompt"
        );
        assert_eq!(ids(&got["drafts"]), ids(&round["drafts"]), "{case}: drafts");
    }
}

fn generate(extra: &[&str]) -> Value {
    let prompt = ids_arg(&prompt());
    let target = target();
    let mut args = vec![
        "generate",
        "--model",
        &target,
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
fn speculating_with_the_mtp_row_leaves_greedy_and_seeded_output_unchanged() {
    let plugins = plugins_dir();
    let checkpoint = checkpoint_flag();
    for convention in [vec![], vec!["--drafter-set", "kv_prefill=false"]] {
        let mut drafter = vec![
            "--plugins-dir",
            &plugins,
            "--drafter",
            "glm-mtp",
            "--drafter-set",
            &checkpoint,
            "--num-draft-tokens",
            "3",
            "--no-auto-off",
        ];
        drafter.extend_from_slice(&convention);
        for sampling in [
            vec![],
            vec!["--temperature", "0.9", "--seed", "7"],
            vec!["--temperature", "1.0", "--top-k", "20", "--seed", "3"],
        ] {
            let plain = generate(&sampling);
            let mut with = sampling.clone();
            with.extend_from_slice(&drafter);
            let spec = generate(&with);
            assert_eq!(
                spec["tokens"], plain["tokens"],
                "{convention:?} {sampling:?}"
            );
            let stats = &spec["stats"];
            assert!(stats["drafter_error"].is_null(), "{stats}");
            assert!(stats["num_drafts"].as_u64().unwrap() > 0, "{stats}");
        }
    }
}

#[test]
fn a_row_trained_for_another_target_is_refused_by_name() {
    // The default model has 8 layers of width 512; the fixture's row was made for 6 of 64.
    let checkpoint = checkpoint_flag();
    let plugins = plugins_dir();
    let out = mlx_spec(&[
        "generate",
        "--prompt",
        "def f(x):",
        "--max-tokens",
        "4",
        "--plugins-dir",
        &plugins,
        "--drafter",
        "glm-mtp",
        "--drafter-set",
        &checkpoint,
        "--json",
    ]);
    let v = json_of(&out);
    let why = v["stats"]["drafter_error"].as_str().unwrap_or_default();
    assert!(
        why.contains("layer count is 6") && why.contains("this target's is 8"),
        "{why}"
    );
    assert_eq!(v["stats"]["generated_tokens"], 4, "plain decoding goes on");
}

/// With `sample_drafts`, the row draws its drafts from its own distribution and hands the host
/// those distributions, which verifies by rejection sampling: the output must still follow the
/// target's distribution exactly. 6 000 seeded generations of three tokens at temperature 1
/// with top-k 3, counted against the exact joint distribution from the target's logits.
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
        &fixture().join("target"),
        DtypeChoice::Fixed(Dtype::Float32),
        None,
    )
    .unwrap();
    let registry = Registry::scan(&[repo_root().join("plugins")]).unwrap();
    let mut overrides = toml::Table::new();
    let checkpoint = fixture().join("mtp").display().to_string();
    overrides.insert("checkpoint".into(), toml::Value::String(checkpoint));
    overrides.insert("sample_drafts".into(), toml::Value::Boolean(true));
    let provider = instantiate(registry.get("glm-mtp").unwrap(), &overrides).unwrap();
    let prompt = prompt();
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 3,
        seed,
        ..Default::default()
    };
    let options = SpecOptions {
        num_draft_tokens: 3,
        auto_off: false,
        fitted_draft_length: false,
    };
    let draws = drafted_three_tokens(&model, &provider, &prompt, options, sampling, DRAWS);
    let (accepted, drafted) = (draws.accepted, draws.drafted);
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
