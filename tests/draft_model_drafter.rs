//! The `draft-model` drafter plugin through the host, end to end: a Gemma 4 of the target's
//! vocabulary drafts with its own KV cache through `mlx-spec-model`, the host's own Gemma 4
//! (checked against transformers by the oracle tests). Its drafts are its own greedy
//! continuation; the target's own checkpoint drafting for itself is accepted in full; greedy
//! and seeded output are exactly plain decoding's; sampled drafts with rejection sampling keep
//! the target's distribution; a draft model of another vocabulary is refused by name.

mod common;

use common::{ids_arg, json_of, mlx_spec, repo_root};
use serde_json::Value;

const TARGET: &str = "tiny-ple-kvshare";
/// Another Gemma 4 of the same vocabulary (256): MoE layers and K=V attention.
const OTHER: &str = "tiny-moe-keqv";

fn draft_fixture(name: &str) -> String {
    repo_root()
        .join("tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

fn plugins_dir() -> String {
    repo_root().join("plugins").display().to_string()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn prompt() -> Vec<u32> {
    vec![2, 17, 93, 41, 200, 5, 77, 128, 64, 9, 150, 33]
}

fn generate(model: &str, prompt: &[u32], tokens: usize, extra: &[&str]) -> Value {
    let model = draft_fixture(model);
    let prompt = ids_arg(prompt);
    let tokens = tokens.to_string();
    let mut args = vec![
        "generate",
        "--model",
        &model,
        "--dtype",
        "f32",
        "--prompt-ids",
        &prompt,
        "--max-tokens",
        &tokens,
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    json_of(&mlx_spec(&args))
}

#[test]
fn the_drafts_are_the_draft_models_own_greedy_continuation() {
    let (target, plugins) = (draft_fixture(TARGET), plugins_dir());
    let checkpoint = format!("checkpoint={}", draft_fixture(OTHER));
    let prompt_arg = ids_arg(&prompt());
    let got = json_of(&mlx_spec(&[
        "draft",
        "--model",
        &target,
        "--dtype",
        "f32",
        "--plugins-dir",
        &plugins,
        "--drafter",
        "draft-model",
        "--drafter-set",
        &checkpoint,
        "--prompt-ids",
        &prompt_arg,
        "--num-draft-tokens",
        "5",
        "--json",
    ]));
    // The anchor is the target's greedy token; the drafts continue prompt + anchor as the
    // draft model alone would.
    let anchor = ids(&generate(TARGET, &prompt(), 1, &[])["tokens"])[0];
    assert_eq!(got["anchor"].as_u64().unwrap() as u32, anchor);
    let mut history = prompt();
    history.push(anchor);
    let own = ids(&generate(OTHER, &history, 5, &[])["tokens"]);
    assert_eq!(ids(&got["drafts"]), own);
}

#[test]
fn speculating_with_a_draft_model_leaves_greedy_and_seeded_output_unchanged() {
    let plugins = plugins_dir();
    for (draft, all_accepted) in [(OTHER, false), (TARGET, true)] {
        let checkpoint = format!("checkpoint={}", draft_fixture(draft));
        let drafter = [
            "--plugins-dir",
            &plugins,
            "--drafter",
            "draft-model",
            "--drafter-set",
            &checkpoint,
            "--num-draft-tokens",
            "4",
            "--no-auto-off",
        ];
        for sampling in [
            vec![],
            vec!["--temperature", "0.9", "--seed", "7"],
            vec!["--temperature", "1.0", "--top-k", "20", "--seed", "3"],
        ] {
            let plain = generate(TARGET, &prompt(), 40, &sampling);
            let mut with = sampling.clone();
            with.extend_from_slice(&drafter);
            let spec = generate(TARGET, &prompt(), 40, &with);
            assert_eq!(spec["tokens"], plain["tokens"], "{draft} {sampling:?}");
            let stats = &spec["stats"];
            assert!(stats["drafter_error"].is_null(), "{stats}");
            assert!(stats["num_drafts"].as_u64().unwrap() > 0, "{stats}");
            if all_accepted && sampling.is_empty() {
                // The target drafting for itself greedily: every draft is the target's own
                // token, whatever was rolled back and re-fed before it.
                assert_eq!(
                    stats["num_accepted_tokens"], stats["num_draft_tokens"],
                    "{stats}"
                );
            }
        }
    }
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused_by_name() {
    let checkpoint = format!("checkpoint={}", draft_fixture("deepspec-oracle/target"));
    let plugins = plugins_dir();
    let v = generate(
        TARGET,
        &prompt(),
        4,
        &[
            "--plugins-dir",
            &plugins,
            "--drafter",
            "draft-model",
            "--drafter-set",
            &checkpoint,
        ],
    );
    let why = v["stats"]["drafter_error"].as_str().unwrap_or_default();
    assert!(
        why.contains("vocabulary has 300 tokens") && why.contains("the target's has 256"),
        "{why}"
    );
    assert_eq!(v["stats"]["generated_tokens"], 4, "plain decoding goes on");
}

/// With `sample_drafts`, the draft model draws its drafts from its own distribution and hands
/// the host those distributions, which verifies by rejection sampling: the output must still
/// follow the target's distribution exactly. The draft model is the target's own checkpoint
/// here, so its full softmax overlaps the target's top-3 distribution well: most drafts are
/// accepted and the rest reach the residual draw. 6 000 seeded generations of three tokens at temperature 1
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
        &repo_root().join("tests/fixtures/tiny-ple-kvshare"),
        DtypeChoice::Fixed(Dtype::Float32),
        None,
    )
    .unwrap();
    let registry = Registry::scan(&[repo_root().join("plugins")]).unwrap();
    let mut overrides = toml::Table::new();
    let checkpoint = draft_fixture("tiny-ple-kvshare");
    overrides.insert("checkpoint".into(), toml::Value::String(checkpoint));
    overrides.insert("sample_drafts".into(), toml::Value::Boolean(true));
    let provider = instantiate(registry.get("draft-model").unwrap(), &overrides).unwrap();
    let prompt = prompt();
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 3,
        seed,
        ..Default::default()
    };
    let options = SpecOptions {
        num_draft_tokens: 2,
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
