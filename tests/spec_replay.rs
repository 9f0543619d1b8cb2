//! Replayed drafts (`bench --replay-drafts`): drafts taken from the plain output with a set hit
//! rate go through the real verify loop, which must accept exactly the right ones and still
//! emit the plain output.

mod common;

use mlx_rs::Dtype;
use mlx_spec::generate::{generate, GenerateRequest};
use mlx_spec::model::gemma4::{DtypeChoice, Gemma4Model};
use mlx_spec::sampler::SamplingParams;
use mlx_spec::speculative::replay::ReplayDrafter;
use mlx_spec::speculative::{generate_speculative, SpecOptions, SpecStats};

fn request() -> GenerateRequest {
    GenerateRequest {
        prompt_ids: vec![2, 17, 40, 33, 9, 71],
        max_tokens: 40,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        ignore_eos: true,
    }
}

/// Speculates with replayed drafts; asserts the output is the plain one.
fn replay(model: &Gemma4Model, plain: &[u32], hit_rate: f64, k: usize) -> SpecStats {
    let provider = ReplayDrafter::new(plain.to_vec(), hit_rate, 11)
        .unwrap()
        .into_provider();
    let options = SpecOptions {
        num_draft_tokens: k,
        auto_off: false,
        fitted_draft_length: false,
    };
    let (tokens, _, stats) =
        generate_speculative(model, &request(), Some(&provider), options, |_| Ok(())).unwrap();
    assert_eq!(tokens, plain, "hit rate {hit_rate}, {k} drafts");
    stats
}

#[test]
fn replayed_drafts_are_accepted_exactly_when_right() {
    let model = Gemma4Model::load(
        &common::fixture("tiny-ple-kvshare"),
        DtypeChoice::Fixed(Dtype::Float32),
        None,
    )
    .unwrap();
    let (plain, _) = generate(&model, &request(), |_| Ok(())).unwrap();
    assert_eq!(plain.len(), 40);

    // Every draft right: every drafted token is accepted, each round emits k + 1 (the first
    // token comes from the prefill, as in plain decoding: 39 more in 7 rounds of 5 and one of 4).
    let all = replay(&model, &plain, 1.0, 4);
    assert!(all.num_draft_tokens > 0);
    assert_eq!(all.num_accepted_tokens, all.num_draft_tokens);
    assert_eq!(all.target_forwards, 8, "{all:?}");

    // Every draft wrong (the right token plus one): none is accepted, one token a forward
    // after the prefill's.
    let none = replay(&model, &plain, 0.0, 4);
    assert!(none.num_draft_tokens > 0);
    assert_eq!(none.num_accepted_tokens, 0);
    assert_eq!(none.target_forwards, 39);

    // In between: some accepted, some not, and the output is still the plain one.
    let some = replay(&model, &plain, 0.6, 4);
    assert!(
        some.num_accepted_tokens > 0 && some.num_accepted_tokens < some.num_draft_tokens,
        "{some:?}"
    );
    assert!(some.target_forwards > 8 && some.target_forwards < 39);
}

/// `mlx-spec bench --replay-drafts ...` on the fixture, prompt 8, one measured round, with
/// `args` after.
fn replay_bench(args: &[&str]) -> std::process::Output {
    let model = common::fixture("tiny-ple-kvshare");
    let mut all = vec![
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "8",
        "--repeats",
        "1",
    ];
    all.extend_from_slice(args);
    common::mlx_spec(&all)
}

#[test]
fn the_bench_refuses_a_hit_rate_outside_zero_to_one() {
    let out = replay_bench(&["--replay-drafts", "1.5", "--gen-tokens", "8"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("hit rate must lie between 0 and 1, got 1.5"),
        "{stderr}"
    );
}

#[test]
fn the_bench_measures_replayed_drafts_against_plain_decoding() {
    let out = replay_bench(&[
        "--replay-drafts",
        "1,0",
        "--replay-draft-lengths",
        "3",
        "--gen-tokens",
        "24",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = common::json_of(&out);
    // Each hit rate with rounds sized by recent acceptance, then by the fitted costs.
    let cases: Vec<_> = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["draft_length"] == "recent")
        .collect();
    assert_eq!(cases.len(), 2);
    assert_eq!(v["cases"].as_array().unwrap().len(), 4);
    // All right: every drafted token is accepted (the bench itself fails if any output
    // differs); the draft gate times a few plain rounds in between, so fewer than 24 forwards.
    assert_eq!(
        cases[0]["num_accepted_tokens"],
        cases[0]["num_draft_tokens_total"]
    );
    assert!(cases[0]["num_accepted_tokens"].as_u64().unwrap() > 0);
    assert_eq!(cases[0]["expected_acceptance_length"], 4.0);
    assert!(cases[0]["target_forwards"].as_u64().unwrap() < 24, "{v}");
    // All wrong: nothing accepted, one token a forward after the prefill's.
    assert_eq!(cases[1]["num_accepted_tokens"], 0);
    assert_eq!(cases[1]["target_forwards"], 23);
}

/// Each case runs once for every hand-off asked for; a verify window handed to the device in
/// groups of layers computes what it computes whole, so the counters agree case for case.
#[test]
fn the_bench_compares_hand_offs_side_by_side() {
    let out = replay_bench(&[
        "--replay-drafts",
        "0.7",
        "--replay-draft-lengths",
        "3",
        "--replay-sizings",
        "fitted",
        "--replay-handoffs",
        "0,2",
        "--gen-tokens",
        "24",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = common::json_of(&out);
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2, "{v}");
    assert_eq!(cases[0]["handoff_layers"], 0);
    assert_eq!(cases[1]["handoff_layers"], 2);
    for c in cases {
        assert_eq!(c["draft_length"], "fitted");
    }
    assert_eq!(
        cases[0]["num_accepted_tokens"],
        cases[1]["num_accepted_tokens"]
    );
}
