//! The `deepspec` drafter plugin through the host, end to end, on `tests/fixtures/deepspec-oracle`
//! (DeepSpec's own `Gemma4DSparkModel` with random weights, and a random Gemma 4 target of the
//! shape it was made for): `mlx-spec draft` proposes the block DeepSpec's own module drafts from
//! the target's own taps (`tests/oracle/make_deepspec_e2e.py`), the confidence threshold cuts
//! it where the recorded confidences say, speculating with it leaves greedy and seeded output
//! exactly as plain decoding makes it, sampled blocks verified by rejection sampling keep the
//! target's distribution, and a drafter made for another target is refused by name.

mod common;

use std::path::PathBuf;

use common::{ids_arg, json_of, mlx_spec, repo_root};
use serde_json::Value;

fn fixture() -> PathBuf {
    repo_root().join("tests/fixtures/deepspec-oracle")
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

fn e2e() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("e2e.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn prompt() -> Vec<u32> {
    ids(&e2e()["prompt_ids"])
}

fn draft(settings: &[&str], n: usize) -> Value {
    let (target, plugins, checkpoint) = (target(), plugins_dir(), checkpoint_flag());
    let prompt = ids_arg(&prompt());
    let n = n.to_string();
    let mut args = vec![
        "draft",
        "--model",
        &target,
        "--dtype",
        "f32",
        "--plugins-dir",
        &plugins,
        "--drafter",
        "deepspec",
        "--drafter-set",
        &checkpoint,
        "--prompt-ids",
        &prompt,
        "--num-draft-tokens",
        &n,
        "--json",
    ];
    for s in settings {
        args.extend_from_slice(&["--drafter-set", s]);
    }
    json_of(&mlx_spec(&args))
}

#[test]
fn the_draft_probe_proposes_deepspecs_first_block() {
    let want = e2e();
    let got = draft(&[], 5);
    assert_eq!(got["anchor"], want["anchor"], "the target's greedy token");
    assert_eq!(ids(&got["drafts"]), ids(&want["block_tokens"]));
    // Asked for fewer, the block's first tokens.
    assert_eq!(
        ids(&draft(&[], 3)["drafts"]),
        ids(&want["block_tokens"])[..3]
    );
}

#[test]
fn the_confidence_threshold_cuts_the_block_where_the_confidences_say() {
    let want = e2e();
    let confidence: Vec<f64> = want["confidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_f64().unwrap())
        .collect();
    let block = ids(&want["block_tokens"]);
    // Thresholds between the recorded confidences: each cuts at its first row below it.
    for threshold in [0.01, 0.1, 0.3, 0.5, 0.9] {
        let keep = confidence
            .iter()
            .position(|&c| c < threshold)
            .unwrap_or(block.len());
        let setting = format!("confidence_threshold={threshold}");
        let got = draft(&[&setting], 5);
        assert_eq!(ids(&got["drafts"]), block[..keep], "threshold {threshold}");
    }
}

/// A checkpoint that leaves out its embedding and LM head (`mlx_spec_shared_vocab`) drafts
/// with the target's through the ports: the same block as the full checkpoint whose tables
/// are copies of the target's (as DeepSpec's trainer makes them).
#[test]
fn a_shared_vocabulary_checkpoint_drafts_as_the_full_one_with_the_targets_tables() {
    use safetensors::tensor::TensorView;
    use safetensors::SafeTensors;
    let target_bytes = std::fs::read(fixture().join("target/model.safetensors")).unwrap();
    let target = SafeTensors::deserialize(&target_bytes).unwrap();
    let table = target.tensor("model.embed_tokens.weight").unwrap();
    let drafter_bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let drafter = SafeTensors::deserialize(&drafter_bytes).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, with_tables: bool| {
        let folder = dir.path().join(name);
        std::fs::create_dir_all(&folder).unwrap();
        let mut views: Vec<(String, TensorView)> = drafter
            .tensors()
            .into_iter()
            .filter(|(n, _)| n != "embed_tokens.weight" && n != "lm_head.weight")
            .collect();
        let mut config = config.clone();
        if with_tables {
            views.push(("embed_tokens.weight".into(), table.clone()));
            views.push(("lm_head.weight".into(), table.clone()));
        } else {
            config["mlx_spec_shared_vocab"] = Value::Bool(true);
        }
        safetensors::serialize_to_file(views, None, &folder.join("model.safetensors")).unwrap();
        std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
        format!("checkpoint={}", folder.display())
    };
    let (full, shared) = (write("full", true), write("shared", false));
    let full_block = draft(&[&full], 5);
    let shared_block = draft(&[&shared], 5);
    assert_eq!(full_block["drafts"], shared_block["drafts"]);
    assert_eq!(ids(&shared_block["drafts"]).len(), 5, "{shared_block}");
    // And the tables matter: the fixture's own (random) tables draft another block.
    assert_ne!(full_block["drafts"], e2e()["block_tokens"]);
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
fn speculating_with_the_block_drafter_leaves_greedy_and_seeded_output_unchanged() {
    let plugins = plugins_dir();
    let checkpoint = checkpoint_flag();
    for convention in [vec![], vec!["--drafter-set", "confidence_threshold=0.1"]] {
        let mut drafter = vec![
            "--plugins-dir",
            &plugins,
            "--drafter",
            "deepspec",
            "--drafter-set",
            &checkpoint,
            "--num-draft-tokens",
            "5",
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
fn a_drafter_made_for_another_target_is_refused_by_name() {
    // The default model has 8 layers of width 512; the fixture's drafter was made for 6 of 48.
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
        "deepspec",
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

/// With `sample_drafts`, the drafter draws its block from its own Markov-corrected distribution
/// and hands the host those distributions, which verifies by rejection sampling: the output
/// must still follow the target's distribution exactly. 6 000 seeded generations of three tokens at temperature 1
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
    let checkpoint = fixture().display().to_string();
    overrides.insert("checkpoint".into(), toml::Value::String(checkpoint));
    overrides.insert("sample_drafts".into(), toml::Value::Boolean(true));
    let provider = instantiate(registry.get("deepspec").unwrap(), &overrides).unwrap();
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
