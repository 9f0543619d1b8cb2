//! The developer lab (`mlx-spec-lab`): its instruments run on the CPU and report what they
//! must (the CPU decode is bitwise repeatable; every fused-kernel set falls back to the same
//! operations off a CUDA GPU; replayed drafts are accepted exactly when right).

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// Runs the built `mlx-spec-lab` on the default model unless `--model` is given.
fn lab(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mlx-spec-lab"))
        .args(args)
        .env_remove("MLX_SPEC_MODEL")
        .output()
        .expect("run mlx-spec-lab")
}

/// A test fixture model folder.
fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The one JSON object a `--json` run prints.
fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "mlx-spec-lab failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(
        stdout.lines().count(),
        1,
        "--json prints one line: {stdout}"
    );
    serde_json::from_str(&stdout).expect("stdout is one JSON object")
}

/// `mlx-spec-lab --replay-drafts ...` on the fixture, prompt 8, one measured round, with
/// `args` after.
fn replay_bench(args: &[&str]) -> std::process::Output {
    let model = fixture("tiny-ple-kvshare");
    let mut all = vec![
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "8",
        "--repeats",
        "1",
    ];
    all.extend_from_slice(args);
    lab(&all)
}

#[test]
fn repeatability_finds_the_cpu_decode_bitwise_repeatable() {
    let out = lab(&[
        "--prompt-tokens",
        "24",
        "--gen-tokens",
        "12",
        "--repeatability",
        "2",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("step-by-step run 1: logits identical at all 13 steps"),
        "{stdout}"
    );
    for run in 0..2 {
        assert!(
            stdout.contains(&format!("pipelined run {run}: tokens identical")),
            "{stdout}"
        );
    }
}

#[test]
fn compare_sampling_measures_every_setting_drawn_on_the_device_and_on_the_host() {
    let out = lab(&[
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "6",
        "--repeats",
        "1",
        "--compare-sampling",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json_of(&out);
    let rows = v["sampling"].as_array().expect("a list of settings");
    // Greedy once, then four sampling settings both ways.
    assert_eq!(rows.len(), 9, "{v}");
    assert_eq!(rows[0]["sampling"], "greedy");
    assert_eq!(rows[0]["of_greedy"], 1.0);
    let on = |place: &str| rows.iter().filter(|r| r["drawn_on"] == place).count();
    assert_eq!((on("device"), on("host")), (5, 4));
    for r in rows {
        assert!(r["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn compare_fused_off_cuda_runs_the_same_operations_for_every_set() {
    // Off a CUDA GPU every fused kernel is refused, so each set decodes with MLX's
    // operations: the same tokens and a logit gap of exactly 0 (a set whose kernels leaked
    // onto the CPU would fail here, and so would a gap computed against the wrong set).
    let out = lab(&[
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "3",
        "--repeats",
        "1",
        "--compare-fused",
        "--json",
    ]);
    let v = json_of(&out);
    let sets = v["fused_comparison"].as_array().expect("a list of sets");
    assert_eq!(sets.len(), 2, "none and the default set: {sets:?}");
    assert_eq!(sets[0]["kernels"], "none");
    assert_eq!(sets[1]["kernels"], "default");
    for s in sets {
        assert_eq!(s["same_tokens_as_none"], true, "{s}");
        assert_eq!(s["first_step_logit_gap"].as_f64(), Some(0.0), "{s}");
        let median = s["decode_tokens_per_s"].as_f64().unwrap();
        let slowest = s["slowest_round_tokens_per_s"].as_f64().unwrap();
        let fastest = s["fastest_round_tokens_per_s"].as_f64().unwrap();
        assert!(median > 0.0, "{s}");
        assert!(
            0.0 < slowest && slowest <= median && median <= fastest,
            "{s}"
        );
    }
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
    let v = json_of(&out);
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
    let v = json_of(&out);
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

/// The plain measurement with the lab's additions: one JSON object holding `bench`'s fields
/// and the CPU cross-check and step graph beside them.
#[test]
fn the_plain_measurement_carries_the_cpu_check_and_the_step_graph() {
    let dir = std::env::temp_dir().join(format!("mlx-spec-lab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dot = dir.join("step.dot");
    let out = lab(&[
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "3",
        "--repeats",
        "1",
        "--check-cpu",
        "4",
        "--dump-step-graph",
        dot.to_str().unwrap(),
        "--json",
    ]);
    let v = json_of(&out);
    assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["gen_tokens"], 3);
    // The CPU against itself, the reference run with MLX's compiled fusions off: the same
    // tokens, logits within float32 rounding.
    assert_eq!(v["cpu_check"]["same_tokens"], true, "{v}");
    assert_eq!(v["cpu_check"]["cpu_tokens"].as_array().unwrap().len(), 4);
    let gap = v["cpu_check"]["max_logit_diff"].as_f64().unwrap();
    assert!(gap < 1e-4, "{v}");
    let ops = &v["step_operations"];
    let by_kind: u64 = ops["by_kind"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert!(by_kind > 50, "a decode step of many operations: {ops}");
    assert_eq!(ops["total"].as_u64(), Some(by_kind));
    assert!(std::fs::read_to_string(&dot).unwrap().contains("digraph"));
    std::fs::remove_dir_all(&dir).ok();
}
