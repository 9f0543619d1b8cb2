//! The `dflash` drafter plugin through the host, end to end, on `tests/fixtures/dflash-oracle`
//! (z-lab's own `DFlashDraftModel` with random weights, and a random Gemma 4 target of the
//! shape it was made for, `tests/oracle/make_dflash_oracle.py`): `mlx-spec draft` proposes the
//! block z-lab's module drafts from the target's own taps through the target's embedding and
//! head, speculating with it leaves greedy and seeded output exactly as plain decoding makes
//! it, sampled blocks verified by rejection sampling keep the target's distribution, and a
//! drafter made for another target is refused by name.

mod common;

use std::path::PathBuf;

use common::{ids_arg, json_of, mlx_spec, repo_root};
use serde_json::Value;

fn fixture() -> PathBuf {
    repo_root().join("tests/fixtures/dflash-oracle")
}

fn target() -> String {
    fixture().join("target").display().to_string()
}

fn checkpoint_flag() -> String {
    format!("checkpoint={}", fixture().display())
}

fn plugins_dir() -> String {
    repo_root().join("plugins").display().to_string()
}

fn oracle() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("oracle.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn prompt() -> Vec<u32> {
    ids(&oracle()["prompt_ids"])
}

fn draft(n: usize) -> Value {
    let (target, plugins, checkpoint) = (target(), plugins_dir(), checkpoint_flag());
    let prompt = ids_arg(&prompt());
    let n = n.to_string();
    json_of(&mlx_spec(&[
        "draft",
        "--model",
        &target,
        "--dtype",
        "f32",
        "--plugins-dir",
        &plugins,
        "--drafter",
        "dflash",
        "--drafter-set",
        &checkpoint,
        "--prompt-ids",
        &prompt,
        "--num-draft-tokens",
        &n,
        "--json",
    ]))
}

#[test]
fn the_draft_probe_proposes_zlabs_first_block() {
    let first = &oracle()["rounds"][0];
    let want = ids(&first["drafts"]);
    assert_eq!(want.len(), 5, "a block of 6 drafts 5");
    let got = draft(5);
    assert_eq!(got["anchor"], first["anchor"], "the target's greedy token");
    assert_eq!(ids(&got["drafts"]), want);
    // Asked for more than B-1, the block is all there is; asked for fewer, its first tokens.
    assert_eq!(ids(&draft(8)["drafts"]), want);
    assert_eq!(ids(&draft(2)["drafts"]), want[..2]);
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

/// Token-match verification reproduces plain decoding token for token, greedy and seeded.
/// With `sample_drafts` the host verifies by rejection sampling, which keeps the target's
/// distribution but not each seeded path (the χ² test below checks it); at temperature 0 the
/// drafter takes argmax and the output is plain greedy decoding's.
#[test]
fn speculating_with_the_block_drafter_leaves_greedy_and_seeded_output_unchanged() {
    let plugins = plugins_dir();
    let checkpoint = checkpoint_flag();
    let greedy: Vec<&str> = vec![];
    let seeded = vec!["--temperature", "0.9", "--seed", "7"];
    let top_k = vec!["--temperature", "1.0", "--top-k", "20", "--seed", "3"];
    let cases = [
        (vec![], vec![greedy.clone(), seeded, top_k]),
        (vec!["--drafter-set", "sample_drafts=true"], vec![greedy]),
    ];
    for (convention, samplings) in cases {
        let mut drafter = vec![
            "--plugins-dir",
            &plugins,
            "--drafter",
            "dflash",
            "--drafter-set",
            &checkpoint,
            "--num-draft-tokens",
            "5",
            "--no-auto-off",
        ];
        drafter.extend_from_slice(&convention);
        for sampling in samplings {
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
fn a_drafter_made_for_another_target_is_refused_by_name() {
    // The default model has 8 layers of width 512; the fixture's drafter was made for 7 of 48.
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
        "dflash",
        "--drafter-set",
        &checkpoint,
        "--json",
    ]);
    let v = json_of(&out);
    let why = v["stats"]["drafter_error"].as_str().unwrap_or_default();
    assert!(
        why.contains("dflash")
            && why.contains("layer count is 7")
            && why.contains("this target's is 8"),
        "{why}"
    );
    assert_eq!(v["stats"]["generated_tokens"], 4, "plain decoding goes on");
}

/// With `sample_drafts`, the drafter draws each block row from `softmax(logits / T)` and hands
/// the host those distributions, which verifies by rejection sampling: the output must still
/// follow the target's distribution exactly. 6 000 seeded generations of three tokens at
/// temperature 10 with top-k 3, counted against the exact joint distribution from the
/// target's logits.
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
    let checkpoint = fixture().display().to_string();
    overrides.insert("checkpoint".into(), toml::Value::String(checkpoint));
    overrides.insert("sample_drafts".into(), toml::Value::Boolean(true));
    let provider = instantiate(registry.get("dflash").unwrap(), &overrides).unwrap();
    let prompt = prompt();
    // A hot request flattens the drafter's q too (it samples at the request's temperature):
    // the random drafter's tokens then land in the target's top 3 often enough.
    let sampling = |seed| SamplingParams {
        temperature: 10.0,
        top_k: 3,
        seed,
        ..Default::default()
    };
    let options = SpecOptions {
        num_draft_tokens: 5,
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
