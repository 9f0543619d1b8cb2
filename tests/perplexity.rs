//! `mlx-spec perplexity` against transformers 5.24 (tests/goldens/perplexity.json, written by
//! tests/oracle/make_perplexity_goldens.py): the same token count and nats per token within
//! 1e-4 in float32, on a bf16 fixture and on the 8-bit default model (dequantized for the
//! oracle), at the context each model serves and at a short context that cuts the text into
//! chunks; plus the errors a user can cause.

mod common;

use common::{expect_error, json_of, mlx_spec, repo_root};
use serde_json::Value;

/// Tolerance on nats per token against the float32 oracle.
const TOL: f64 = 1e-4;

fn goldens() -> Vec<Value> {
    let path = repo_root().join("tests/goldens/perplexity.json");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn nats_per_token_match_transformers() {
    let cases = goldens();
    assert!(
        cases.len() >= 4,
        "the goldens cover both models at two contexts"
    );
    for case in cases {
        let model = repo_root().join(case["model"].as_str().unwrap());
        let file = repo_root().join(case["file"].as_str().unwrap());
        let model = model.to_str().unwrap().to_owned();
        let file = file.to_str().unwrap().to_owned();
        let mut args = vec!["perplexity", "--model", &model, "--dtype", "f32", "--json"];
        let context = case["context"].as_u64().map(|c| c.to_string());
        if let Some(c) = &context {
            args.extend(["--context", c]);
        }
        args.push(&file);
        let report = json_of(&mlx_spec(&args));
        let want_tokens = case["tokens"].as_u64().unwrap();
        let want = case["nats"].as_f64().unwrap() / want_tokens as f64;
        let what = format!("{model} at context {context:?}");
        assert_eq!(report["tokens"].as_u64(), Some(want_tokens), "{what}");
        let served = case["served_context"].as_u64().unwrap();
        assert_eq!(
            report["context"].as_u64().unwrap(),
            case["context"].as_u64().unwrap_or(served),
            "{what}: the context used"
        );
        let got = report["nats_per_token"].as_f64().unwrap();
        assert!(
            (got - want).abs() < TOL,
            "{what}: {got} nats/token, transformers {want}"
        );
        let ppl = report["perplexity"].as_f64().unwrap();
        assert!((ppl - got.exp()).abs() < 1e-9 * ppl, "{what}: perplexity");
        let file_row = &report["files"][0];
        assert_eq!(file_row["tokens"].as_u64(), Some(want_tokens), "{what}");
    }
}

#[test]
fn several_files_add_up() {
    let model = repo_root().join("tests/fixtures/tiny-wrapped-bf16");
    let file = repo_root().join("tests/fixtures/perplexity/sample.py");
    let (model, file) = (model.to_str().unwrap(), file.to_str().unwrap());
    let one = json_of(&mlx_spec(&[
        "perplexity",
        "--model",
        model,
        "--dtype",
        "f32",
        "--json",
        file,
    ]));
    let two = json_of(&mlx_spec(&[
        "perplexity",
        "--model",
        model,
        "--dtype",
        "f32",
        "--json",
        file,
        file,
    ]));
    assert_eq!(two["files"].as_array().unwrap().len(), 2);
    assert_eq!(
        two["tokens"].as_u64().unwrap(),
        2 * one["tokens"].as_u64().unwrap()
    );
    let (a, b) = (one["nats"].as_f64().unwrap(), two["nats"].as_f64().unwrap());
    assert!((b - 2.0 * a).abs() < 1e-6 * b, "{b} vs 2 x {a}");
}

#[test]
fn user_errors_are_one_line() {
    let model = repo_root().join("tests/fixtures/tiny-wrapped-bf16");
    let model = model.to_str().unwrap();
    let err = expect_error(&["perplexity", "--model", model, "no/such/file.py"]);
    assert!(err.contains("no/such/file.py"), "{err}");
    let file = repo_root().join("tests/fixtures/perplexity/sample.py");
    let file = file.to_str().unwrap();
    let err = expect_error(&["perplexity", "--model", model, "--context", "0", file]);
    assert!(err.contains("--context"), "{err}");
    // A model folder without tokenizer.json cannot read text.
    let bare = repo_root().join("tests/fixtures/tiny-ple-kvshare");
    let err = expect_error(&["perplexity", "--model", bare.to_str().unwrap(), file]);
    assert!(err.contains("tokenizer.json"), "{err}");
}
