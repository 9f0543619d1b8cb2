//! Fuzzing the parsers that read what users write: the server's request bodies, the deploy
//! TOML and the plugin manifest. A seeded mutation fuzzer over the corpus in `tests/fuzz/`
//! (byte flips, cuts, repeats, splices and tokens that break JSON and TOML), plus generated
//! request bodies with every field given a random value of a random type. Properties: no
//! parser panics; a refused request is a 400 whose `param` is a field the body has; an
//! accepted request holds only values in their documented ranges; an accepted deploy file
//! holds only valid settings.
//!
//! Bounded: `MLX_SPEC_FUZZ_ITERS` inputs per parser (default 20000, about a second in all);
//! `MLX_SPEC_FUZZ_SEED` picks another run. A failure prints the input that caused it.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use common::repo_root;
use mlx_spec::deploy::DeployConfig;
use mlx_spec::server::api::{self, GenRequest, Input};
use mlx_spec_plugin_api::manifest::Manifest;
use serde_json::{json, Map, Value};

const MAX_NEW_TOKENS: usize = 4096;

/// xorshift64*: small, seeded, enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn iterations() -> usize {
    std::env::var("MLX_SPEC_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20000)
}

fn seed() -> u64 {
    std::env::var("MLX_SPEC_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5EED_1234)
        | 1
}

fn corpus(kind: &str) -> Vec<Vec<u8>> {
    let dir = repo_root().join("tests/fuzz").join(kind);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let out: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert!(!out.is_empty(), "{} holds no corpus", dir.display());
    out
}

const TOKENS: &[&str] = &[
    "\"",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "=",
    "\n",
    "[[",
    "]]",
    "'",
    "\"\"\"",
    "#",
    "\\",
    "\\u0000",
    "null",
    "true",
    "false",
    "-1",
    "0",
    "-0",
    "1e400",
    "-1e400",
    "18446744073709551616",
    "9223372036854775808",
    "4.5",
    "NaN",
    "inf",
    "0x10",
    "\u{1F600}",
    "\u{FFFD}",
    "\u{0}",
    "\"prompt\"",
    "\"messages\"",
    "\"max_tokens\"",
    "\"stop\"",
    "\"speculation\"",
    "\"off\"",
    "[server]",
    "[drafters.x]",
    "port",
    "max_active",
    "host",
    "library",
    "api",
    "[plugin]",
];

fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut data = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = data.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let a = rng.below(len);
                let b = (a + 1 + rng.below(16)).min(len);
                data.drain(a..b);
            }
            2 => {
                let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
                let at = rng.below(len + 1);
                data.splice(at..at, t.iter().copied());
            }
            3 if len > 0 => {
                let a = rng.below(len);
                let b = (a + 1 + rng.below(32)).min(len);
                let piece = data[a..b].to_vec();
                data.splice(b..b, piece);
            }
            4 => {
                let other = &corpus[rng.below(corpus.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                data.truncate(cut);
                data.extend_from_slice(&other[from..]);
            }
            5 if len > 0 => data.truncate(rng.below(len)),
            _ => {
                // A digit run replaced by an extreme number.
                if let Some(i) = (0..len)
                    .map(|k| (k + rng.below(len)) % len)
                    .find(|&i| data[i].is_ascii_digit())
                {
                    let end = (i..len).find(|&j| !data[j].is_ascii_digit()).unwrap_or(len);
                    let t =
                        ["-1", "0", "99999999999999999999", "1.5", "-0.0", "1e308"][rng.below(6)];
                    data.splice(i..end, t.bytes());
                }
            }
        }
    }
    data
}

/// Runs `check` on the corpus and on `iterations()` mutants, failing with the input that
/// panicked.
fn fuzz(kind: &str, check: impl Fn(&[u8])) {
    let corpus = corpus(kind);
    let mut rng = Rng((seed() ^ kind.len() as u64) | 1);
    let run = |input: &[u8]| {
        if catch_unwind(AssertUnwindSafe(|| check(input))).is_err() {
            panic!(
                "{kind}: failed on input {:?}",
                String::from_utf8_lossy(input)
            );
        }
    };
    for c in &corpus {
        run(c);
    }
    for i in 0..iterations() {
        let base = &corpus[i % corpus.len()];
        let input = mutate(&mut rng, base, &corpus);
        run(&input);
    }
}

/// What an accepted request may hold.
fn check_accepted(r: &GenRequest) {
    if let Some(m) = r.max_tokens {
        assert!((1..=MAX_NEW_TOKENS).contains(&m), "max_tokens {m}");
    }
    if let Some(t) = r.temperature {
        assert!(
            t.is_finite() && (0.0..=100.0).contains(&t),
            "temperature {t}"
        );
    }
    if let Some(p) = r.top_p {
        assert!(p > 0.0 && p <= 1.0, "top_p {p}");
    }
    if let Some(p) = r.min_p {
        assert!((0.0..=1.0).contains(&p), "min_p {p}");
    }
    assert!(r.stop_strings.iter().all(|s| !s.is_empty()));
    assert!(r.stop_strings.len() <= api::MAX_STOPS);
    match &r.input {
        Input::Chat(m) => assert!(!m.is_empty()),
        Input::Ids(ids) => assert!(!ids.is_empty()),
        Input::Text(_) => {}
    }
    if let Some(api::SpeculationChoice::Drafter {
        num_draft_tokens: Some(k),
        ..
    }) = &r.speculation
    {
        assert!((1..=64).contains(k), "num_draft_tokens {k}");
    }
}

fn check_request(body: &[u8], chat: bool) {
    match api::parse(body, chat, MAX_NEW_TOKENS) {
        Ok(r) => check_accepted(&r),
        Err(e) => {
            assert_eq!(e.status, 400, "{e:?}");
            assert!(!e.message.is_empty());
            // The field named is one the body has (its first segment).
            if let (Some(param), Ok(Value::Object(obj))) =
                (&e.param, serde_json::from_slice::<Value>(body))
            {
                let top = param.split(['.', '[']).next().unwrap();
                let required = top == "prompt" || top == "messages";
                assert!(
                    obj.contains_key(top) || required,
                    "{param} is not in the body: {e:?}"
                );
            }
            // The error body is OpenAI's shape.
            assert!(e.body()["error"]["message"].is_string());
        }
    }
}

#[test]
fn request_bodies_never_panic_and_errors_name_a_field_of_the_body() {
    fuzz("request", |input| {
        check_request(input, false);
        check_request(input, true);
    });
}

#[test]
fn generated_request_bodies_are_accepted_only_with_valid_values() {
    let mut rng = Rng(seed());
    let keys = [
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "stream",
        "n",
        "speculation",
        "logprobs",
        "echo",
        "model",
        "ignore_eos",
        "best_of",
        "presence_penalty",
    ];
    let mut accepted = 0;
    for _ in 0..iterations() {
        let mut obj = Map::new();
        for key in keys {
            if rng.below(3) == 0 {
                obj.insert(key.to_owned(), random_value(&mut rng, 2));
            }
        }
        for chat in [false, true] {
            // Most bodies get a valid input, so the other fields are what is tested.
            let mut obj = obj.clone();
            if rng.below(4) != 0 {
                obj.remove("prompt");
                obj.remove("messages");
                if chat {
                    obj.insert(
                        "messages".into(),
                        json!([{"role": "user", "content": "hi"}]),
                    );
                } else {
                    obj.insert("prompt".into(), json!("def f():"));
                }
            }
            let body = Value::Object(obj).to_string();
            if catch_unwind(AssertUnwindSafe(|| check_request(body.as_bytes(), chat))).is_err() {
                panic!("failed on {body}");
            }
            if api::parse(body.as_bytes(), chat, MAX_NEW_TOKENS).is_ok() {
                accepted += 1;
            }
        }
    }
    // Both outcomes were exercised.
    assert!(accepted > 0 && accepted < 2 * iterations(), "{accepted}");
}

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth == 0 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => json!(rng.below(2) == 0),
        2 => json!([-1i64, 0, 1, 2, 64, 65, 4096, 4097, i64::MAX][rng.below(9)]),
        3 => json!([-0.5, 0.0, 0.05, 0.5, 1.0, 1.5, 2.0, 101.0, 1e300][rng.below(9)]),
        4 => json!(["", "off", "ngram", "user", "x", "\u{0}"][rng.below(6)]),
        5 => json!(u64::MAX - rng.below(2) as u64),
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, depth - 1))
                .collect(),
        ),
        _ => {
            let mut m = Map::new();
            for key in [
                "drafter",
                "num_draft_tokens",
                "role",
                "content",
                "type",
                "text",
            ] {
                if rng.below(2) == 0 {
                    m.insert(key.into(), random_value(rng, depth - 1));
                }
            }
            Value::Object(m)
        }
    }
}

#[test]
fn deploy_files_never_panic_and_accepted_ones_are_valid() {
    let path = Path::new("fuzz/deploy.toml");
    fuzz("deploy", |input| {
        let Ok(text) = std::str::from_utf8(input) else {
            return;
        };
        match DeployConfig::from_text(text, path) {
            Ok(cfg) => {
                let s = &cfg.server;
                assert!(s.host.parse::<std::net::IpAddr>().is_ok(), "{}", s.host);
                assert!(s.max_active >= 1 && s.max_new_tokens >= 1 && s.max_prompt_tokens >= 1);
                assert!(s.max_body_bytes >= 1);
                assert!(s.request_timeout_s.is_finite() && s.request_timeout_s > 0.0);
                assert!(!(s.api_key.is_some() && s.api_key_env.is_some()));
                assert!(["auto", "f32", "bf16", "f16"].contains(&cfg.model.dtype.as_str()));
                if let Some(d) = &s.default_drafter {
                    assert!(d == "off" || cfg.drafter_names().contains(d), "{d}");
                }
            }
            Err(e) => {
                let e = format!("{e:#}");
                assert!(e.contains("deploy.toml"), "errors name the file: {e}");
            }
        }
    });
}

#[test]
fn plugin_manifests_never_panic() {
    fuzz("manifest", |input| {
        let Ok(text) = std::str::from_utf8(input) else {
            return;
        };
        if let Err(e) = Manifest::parse(text) {
            assert!(!e.is_empty());
        }
    });
}
