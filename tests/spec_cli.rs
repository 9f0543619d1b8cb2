//! Speculative decoding through the `mlx-spec` binary with real plugin libraries: lossless
//! greedy and seeded-sampling output for every drafter (ngram, a drafter that is always right,
//! one that is always wrong), faults that switch the drafter off without losing the request,
//! libraries the loader must refuse, the deploy config, an out-of-tree plugin dropped into
//! a plugins directory of an already-built host, and a plugin built against the previous
//! interface revision.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{expect_error, fixture, ids_arg, json_of, mlx_spec, repo_root, Golden, FIXTURES};
use serde_json::Value;

/// Where cargo put the binary, and with it the workspace's plugin libraries.
fn target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mlx-spec"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn lib_name(stem: &str) -> String {
    if cfg!(target_os = "macos") {
        format!("lib{stem}.dylib")
    } else {
        format!("lib{stem}.so")
    }
}

/// Installs `library` (from the build folder) with `manifest` as plugins/<folder>.
fn install(plugins: &Path, folder: &str, library: &Path, manifest: &str) {
    let dir = plugins.join(folder);
    std::fs::create_dir_all(&dir).unwrap();
    assert!(
        library.is_file(),
        "{} is not built (run `cargo build --release --workspace`)",
        library.display()
    );
    std::fs::copy(library, dir.join(library.file_name().unwrap())).unwrap();
    std::fs::write(dir.join("plugin.toml"), manifest).unwrap();
}

fn manifest(name: &str, stem: &str, defaults: &str) -> String {
    format!(
        "[plugin]\nname = \"{name}\"\nversion = \"0.1.0\"\nkind = \"other\"\napi = 1\nlibrary = \"{}\"\n[needs]\ntarget_families = [\"gemma4\"]\n[defaults]\n{defaults}\n",
        lib_name(stem)
    )
}

/// A plugins directory with ngram (its real manifest) and the test drafters.
fn plugins_dir() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let ngram_manifest =
        std::fs::read_to_string(repo_root().join("plugins/ngram/plugin.toml")).unwrap();
    install(
        tmp.path(),
        "ngram",
        &target_dir().join(lib_name("mlx_spec_ngram")),
        &ngram_manifest,
    );
    for mode in [
        "wrong",
        "panic",
        "out_of_vocab",
        "too_many",
        "refuse",
        "noisy",
        "bad_port",
    ] {
        // Every folder holds the same library under its own name; tests pick one with
        // `--plugins-dir <folder>`.
        let m = manifest(
            "test-drafter",
            "mlx_spec_test_drafter",
            &format!("mode = \"{mode}\""),
        );
        let folder = format!("test-{}", mode.replace('_', "-"));
        install(
            tmp.path(),
            &folder,
            &target_dir().join(lib_name("mlx_spec_test_drafter")),
            &m,
        );
    }
    tmp
}

fn tokens_of(v: &Value) -> Vec<u32> {
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Generates with `extra` flags; returns the JSON result.
fn run(model: &Path, ids: &[u32], max_tokens: usize, extra: &[&str]) -> Value {
    let mut args = vec![
        "generate".to_owned(),
        "--model".into(),
        model.to_str().unwrap().into(),
        "--prompt-ids".into(),
        ids_arg(ids),
        "--max-tokens".into(),
        max_tokens.to_string(),
        "--ignore-eos".into(),
        "--dtype".into(),
        "f32".into(),
        "--json".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let v = json_of(&mlx_spec(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    // With --ignore-eos every run emits exactly max_tokens, so two runs compared for equal
    // output cannot agree by both stopping early (or emitting nothing).
    assert_eq!(tokens_of(&v).len(), max_tokens, "{v}");
    assert_eq!(v["stats"]["generated_tokens"], max_tokens, "{v}");
    v
}

fn prompts(name: &str) -> Vec<Vec<u32>> {
    let golden = Golden::load(name);
    vec![
        golden.ids("prompt_ids"),
        vec![2, 10, 20, 30, 40, 10, 20, 30, 40, 10, 20, 30],
        vec![2, 7],
    ]
}

#[test]
fn ngram_is_lossless_greedy_on_every_fixture() {
    let plugins = plugins_dir();
    let dir = plugins.path().to_str().unwrap();
    for name in FIXTURES {
        for ids in prompts(name) {
            let plain = run(&fixture(name), &ids, 40, &[]);
            let spec = run(
                &fixture(name),
                &ids,
                40,
                &["--drafter", "ngram", "--plugins-dir", dir],
            );
            assert_eq!(
                tokens_of(&spec),
                tokens_of(&plain),
                "{name} {ids:?}: ngram changed the output"
            );
            assert!(
                spec["stats"]["drafter_error"].is_null(),
                "{}",
                spec["stats"]
            );
        }
        let repetitive = run(
            &fixture(name),
            &prompts(name)[1],
            40,
            &["--drafter", "ngram", "--plugins-dir", dir],
        );
        let stats = &repetitive["stats"];
        assert!(
            stats["num_accepted_tokens"].as_u64().unwrap() > 0,
            "{name}: nothing accepted: {stats}"
        );
        assert!(
            stats["target_forwards"].as_u64().unwrap() < 40,
            "{name}: no forward saved: {stats}"
        );
        assert_eq!(
            stats["accepted_per_position"].as_array().unwrap().len(),
            stats["drafted_per_position"].as_array().unwrap().len()
        );
    }
}

#[test]
fn seeded_sampling_with_a_drafter_emits_exactly_the_plain_samples() {
    let plugins = plugins_dir();
    let dir = plugins.path().to_str().unwrap();
    // Tokens drawn on the device (with and without top-k's partial sort), on the host, and
    // where `auto` puts them (`--sampler`): each way the loop draws as plain decoding draws.
    for name in ["tiny-ple-kvshare", "tiny-wrapped-bf16"] {
        for (t, p, k) in [
            ("0.8", "1.0", "0"),
            ("1.0", "0.9", "0"),
            ("1.0", "0.95", "16"),
        ] {
            for place in ["auto", "device", "host"] {
                let flags = [
                    "--temperature",
                    t,
                    "--top-p",
                    p,
                    "--top-k",
                    k,
                    "--seed",
                    "42",
                    "--sampler",
                    place,
                ];
                let ids = &prompts(name)[1];
                let plain = run(&fixture(name), ids, 40, &flags);
                let mut with = flags.to_vec();
                with.extend(["--drafter", "ngram", "--plugins-dir", dir]);
                let spec = run(&fixture(name), ids, 40, &with);
                assert_eq!(
                    tokens_of(&spec),
                    tokens_of(&plain),
                    "{name} T={t} top-p={p} top-k={k} drawn by {place}"
                );
            }
        }
    }
}

#[test]
fn always_right_and_always_wrong_drafters_leave_the_output_unchanged() {
    let plugins = plugins_dir();
    for name in FIXTURES {
        let ids = Golden::load(name).ids("prompt_ids");
        let plain = run(&fixture(name), &ids, 60, &[]);
        let script = ids_arg(&tokens_of(&plain));
        // The test drafter in `mode`, scripted with the target's own continuation.
        let scripted = |mode: &str| {
            let defaults = format!(
                "mode = \"{mode}\"\nprompt_len = {}\nscript = [{script}]",
                ids.len()
            );
            let m = manifest("test-drafter", "mlx_spec_test_drafter", &defaults);
            install(
                plugins.path(),
                mode,
                &target_dir().join(lib_name("mlx_spec_test_drafter")),
                &m,
            );
            let dir = plugins.path().join(mode);
            run(
                &fixture(name),
                &ids,
                60,
                &[
                    "--drafter",
                    "test-drafter",
                    "--plugins-dir",
                    dir.to_str().unwrap(),
                ],
            )
        };
        // An oracle drafter: proposes exactly what the target will emit.
        let right = scripted("script");
        assert_eq!(
            tokens_of(&right),
            tokens_of(&plain),
            "{name}: oracle drafter changed the output"
        );
        let s = &right["stats"];
        assert_eq!(
            s["num_accepted_tokens"], s["num_draft_tokens"],
            "{name}: oracle drafts must all be accepted: {s}"
        );
        assert!(
            s["target_forwards"].as_u64().unwrap() <= 7,
            "{name}: 60 tokens in 10-token rounds: {s}"
        );

        let bad = scripted("wrong");
        assert_eq!(
            tokens_of(&bad),
            tokens_of(&plain),
            "{name}: wrong drafter changed the output"
        );
        let s = &bad["stats"];
        assert_eq!(s["num_accepted_tokens"], 0, "{s}");
        assert!(
            s["paused_rounds"].as_u64().unwrap() > 0,
            "auto-off never paused a drafter that is always wrong: {s}"
        );
    }
}

#[test]
fn faulty_drafters_are_switched_off_and_the_request_still_succeeds() {
    let plugins = plugins_dir();
    let name = "tiny-moe-keqv";
    let ids = prompts(name)[1].clone();
    let plain = run(&fixture(name), &ids, 30, &[]);
    for (folder, expected) in [
        ("test-panic", "panicked"),
        ("test-out-of-vocab", "outside the vocabulary"),
        ("test-too-many", "at most"),
        ("test-refuse", "refuses"),
        // A port given bad arguments answers with an error (the drafter passes it on).
        ("test-bad-port", "hidden states of width 3"),
    ] {
        let dir = plugins.path().join(folder);
        let out = run(
            &fixture(name),
            &ids,
            30,
            &[
                "--drafter",
                "test-drafter",
                "--plugins-dir",
                dir.to_str().unwrap(),
            ],
        );
        assert_eq!(
            tokens_of(&out),
            tokens_of(&plain),
            "{folder}: output changed"
        );
        let err = out["stats"]["drafter_error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            err.contains(expected),
            "{folder}: drafter_error {err:?} should mention {expected:?}"
        );
    }
}

#[test]
fn rejection_sampling_drafter_runs_end_to_end() {
    let plugins = plugins_dir();
    let dir = plugins.path().join("test-noisy");
    let noisy = |seed: &str| {
        run(
            &fixture("tiny-wrapped-bf16"),
            &[2, 150, 151, 152],
            40,
            &[
                "--temperature",
                "1.0",
                "--seed",
                seed,
                "--drafter",
                "test-drafter",
                "--plugins-dir",
                dir.to_str().unwrap(),
                "--no-auto-off",
            ],
        )
    };
    let out = noisy("3");
    let s = &out["stats"];
    // The drafter ran every round without fault, and its drafts went through rejection
    // sampling: some accepted (its distribution overlaps the target's), not all.
    assert!(s["drafter_error"].is_null(), "{s}");
    assert_eq!(s["drafter"], "test-drafter");
    let drafted = s["num_draft_tokens"].as_u64().unwrap();
    let accepted = s["num_accepted_tokens"].as_u64().unwrap();
    assert!(s["num_drafts"].as_u64().unwrap() > 0, "{s}");
    assert!(accepted > 0 && accepted < drafted, "{s}");
    // Accepted drafts save forwards: fewer than one per token after the prefill's.
    assert!(s["target_forwards"].as_u64().unwrap() < 39, "{s}");
    let tokens = tokens_of(&out);
    assert_eq!(tokens.len(), 40);
    assert_eq!(s["generated_tokens"], 40);
    assert!(tokens.iter().all(|&t| t < 512));
    // Seeded: the drafter's draws and the host's coins repeat, and another seed differs.
    assert_eq!(tokens_of(&noisy("3")), tokens, "same seed, other tokens");
    assert_ne!(tokens_of(&noisy("4")), tokens, "another seed, same tokens");
}

#[test]
fn the_loader_refuses_bad_libraries_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    install(
        p,
        "bad-abi",
        &target_dir().join(lib_name("mlx_spec_bad_abi")),
        &manifest("bad-abi", "mlx_spec_bad_abi", ""),
    );
    install(
        p,
        "bad-mlx",
        &target_dir().join(lib_name("mlx_spec_bad_mlx")),
        &manifest("bad-mlx", "mlx_spec_bad_mlx", ""),
    );
    let pinned = manifest("pinned", "mlx_spec_ngram", "").replace(
        "api = 1",
        &format!("api = 1\nsha256 = \"{}\"", "ab".repeat(32)),
    );
    install(
        p,
        "pinned",
        &target_dir().join(lib_name("mlx_spec_ngram")),
        &pinned.replace("name = \"pinned\"", "name = \"ngram\""),
    );
    install(
        p,
        "typo",
        &target_dir().join(lib_name("mlx_spec_ngram")),
        &manifest("ngram", "mlx_spec_ngram", "").replace("api = 1", "api = 1\nlibary = \"x\""),
    );
    install(
        p,
        "future",
        &target_dir().join(lib_name("mlx_spec_ngram")),
        &manifest("ngram", "mlx_spec_ngram", "").replace("api = 1", "api = 2"),
    );
    std::fs::create_dir_all(p.join("missing")).unwrap();
    std::fs::write(
        p.join("missing/plugin.toml"),
        manifest("ghost", "does_not_exist", ""),
    )
    .unwrap();

    for (folder, expected) in [
        ("bad-abi", "plugin ABI 2"),
        ("bad-mlx", "MLX 0.0.1"),
        ("pinned", "sha256"),
        ("typo", "libary"),
        ("future", "ABI 2"),
        ("missing", "missing"),
    ] {
        let err = expect_error(&["plugins", "check", p.join(folder).to_str().unwrap()]);
        assert!(err.contains(expected), "{folder}: {err}");
    }
    // Listing reports every plugin with its status and succeeds.
    let out = mlx_spec(&["plugins", "list", "--plugins-dir", p.to_str().unwrap()]);
    assert!(out.status.success());
    let listing = String::from_utf8_lossy(&out.stdout);
    assert_eq!(listing.matches("unusable").count(), 6, "{listing}");
    // Asking for a refused drafter is a clear error, not a crash.
    let err = expect_error(&[
        "generate",
        "--model",
        fixture("tiny-ple-kvshare").to_str().unwrap(),
        "--prompt-ids",
        "2,3",
        "--drafter",
        "bad-abi",
        "--plugins-dir",
        p.to_str().unwrap(),
    ]);
    assert!(err.contains("bad-abi") && err.contains("ABI"), "{err}");
    let err = expect_error(&[
        "generate",
        "--model",
        fixture("tiny-ple-kvshare").to_str().unwrap(),
        "--prompt-ids",
        "2,3",
        "--drafter",
        "nope",
        "--plugins-dir",
        p.to_str().unwrap(),
    ]);
    assert!(err.contains("nope"), "{err}");
}

/// `generate --drafter NAME --plugins-dir DIR` on the fixture: the one-line error it gives.
fn drafter_error(name: &str, plugins: &Path) -> String {
    expect_error(&[
        "generate",
        "--model",
        fixture("tiny-ple-kvshare").to_str().unwrap(),
        "--prompt-ids",
        "2,3",
        "--drafter",
        name,
        "--plugins-dir",
        plugins.to_str().unwrap(),
    ])
}

/// A library file the manifest names but that is another drafter (it calls itself `ngram`),
/// a manifest with a library for another OS only, a file of random bytes named like a
/// library, and two folders claiming one name: each is refused with an error naming the
/// plugin and the file at fault, by `plugins check`, `plugins list` and `generate`, and the
/// host does not panic (`expect_error` checks that).
#[test]
fn the_loader_refuses_misnamed_foreign_corrupt_and_duplicate_plugins() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    let ngram_lib = target_dir().join(lib_name("mlx_spec_ngram"));

    // ngram's library under the test drafter's file name, in a manifest naming the test
    // drafter: the file exists and loads, but the library's own name is "ngram".
    let renamed = p.join("renamed");
    std::fs::create_dir_all(&renamed).unwrap();
    let disguised = lib_name("mlx_spec_test_drafter");
    std::fs::copy(&ngram_lib, renamed.join(&disguised)).unwrap();
    std::fs::write(
        renamed.join("plugin.toml"),
        manifest("test-drafter", "mlx_spec_test_drafter", ""),
    )
    .unwrap();
    let err = expect_error(&["plugins", "check", renamed.to_str().unwrap()]);
    assert!(
        err.contains(&disguised)
            && err.contains("calls itself \"ngram\"")
            && err.contains("\"test-drafter\""),
        "{err}"
    );
    // The file's name itself does not matter: the same file in a manifest that names the
    // library's own name loads (so the refusal above is about the name, not the copy).
    let honest = p.join("honest");
    std::fs::create_dir_all(&honest).unwrap();
    std::fs::copy(&ngram_lib, honest.join(&disguised)).unwrap();
    std::fs::write(
        honest.join("plugin.toml"),
        manifest("ngram", "mlx_spec_test_drafter", ""),
    )
    .unwrap();
    let out = mlx_spec(&["plugins", "check", honest.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("OK ngram 0.1.0"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same library under a manifest that says another version: a manifest left beside
    // another build of the library.
    std::fs::write(
        honest.join("plugin.toml"),
        manifest("ngram", "mlx_spec_test_drafter", "")
            .replace("version = \"0.1.0\"", "version = \"0.9.0\""),
    )
    .unwrap();
    let err = expect_error(&["plugins", "check", honest.to_str().unwrap()]);
    assert!(
        err.contains("version 0.1.0") && err.contains("says 0.9.0"),
        "{err}"
    );
    std::fs::remove_dir_all(&honest).unwrap();

    // A library for another OS only.
    let other_os = if cfg!(target_os = "macos") {
        "linux"
    } else {
        "macos"
    };
    let foreign = p.join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(
        foreign.join("plugin.toml"),
        manifest("foreign", "mlx_spec_ngram", "").replace(
            &format!("library = \"{}\"", lib_name("mlx_spec_ngram")),
            &format!("library = {{ {other_os} = \"libforeign.x\" }}"),
        ),
    )
    .unwrap();
    let err = expect_error(&["plugins", "check", foreign.to_str().unwrap()]);
    assert!(
        err.contains("foreign/plugin.toml")
            && err.contains(&format!("names no file for {}", std::env::consts::OS)),
        "{err}"
    );

    // Random bytes named like a library: the loader's error names the file.
    let corrupt = p.join("corrupt");
    std::fs::create_dir_all(&corrupt).unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let junk: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(corrupt.join(lib_name("mlx_spec_corrupt")), junk).unwrap();
    std::fs::write(
        corrupt.join("plugin.toml"),
        manifest("corrupt", "mlx_spec_corrupt", ""),
    )
    .unwrap();
    let err = expect_error(&["plugins", "check", corrupt.to_str().unwrap()]);
    assert!(err.contains(&lib_name("mlx_spec_corrupt")), "{err}");

    // Every one of them as `generate --drafter` would meet it, in one plugins directory.
    let err = drafter_error("test-drafter", p);
    assert!(
        err.contains("drafter \"test-drafter\" cannot be used") && err.contains("calls itself"),
        "{err}"
    );
    let err = drafter_error("foreign", p);
    assert!(
        err.contains("drafter \"foreign\" cannot be used") && err.contains("names no file"),
        "{err}"
    );
    let err = drafter_error("corrupt", p);
    assert!(
        err.contains("drafter \"corrupt\" cannot be used")
            && err.contains(&lib_name("mlx_spec_corrupt")),
        "{err}"
    );

    // Two folders of one directory both called "ngram" (each a good plugin on its own):
    // which one `--drafter ngram` means is ambiguous, so neither is used, and the error names
    // both manifests.
    for folder in ["ngram-a", "ngram-b"] {
        install(
            p,
            folder,
            &ngram_lib,
            &manifest("ngram", "mlx_spec_ngram", ""),
        );
    }
    let err = drafter_error("ngram", p);
    assert!(
        err.contains("drafter \"ngram\" cannot be used")
            && err.contains("also named \"ngram\"")
            && err.contains("ngram-a")
            && err.contains("ngram-b"),
        "{err}"
    );
    // The listing shows every plugin and why it is unusable; it still succeeds.
    let out = mlx_spec(&["plugins", "list", "--plugins-dir", p.to_str().unwrap()]);
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{listing}");
    let line_of = |name: &str| -> Vec<&str> {
        listing
            .lines()
            .filter(|l| l.split_whitespace().next() == Some(name))
            .collect()
    };
    let ngrams = line_of("ngram");
    assert_eq!(ngrams.len(), 2, "{listing}");
    assert!(
        ngrams
            .iter()
            .all(|l| l.contains("unusable: ") && l.contains("also named")),
        "{listing}"
    );
    assert!(
        line_of("test-drafter")[0].contains("calls itself"),
        "{listing}"
    );
    assert!(line_of("foreign")[0].contains("names no file"), "{listing}");
    assert!(line_of("corrupt")[0].contains("unusable: "), "{listing}");
}

#[test]
fn plugins_list_shows_the_shipped_ngram() {
    let plugins = plugins_dir();
    let out = mlx_spec(&[
        "plugins",
        "list",
        "--plugins-dir",
        plugins.path().to_str().unwrap(),
    ]);
    let listing = String::from_utf8_lossy(&out.stdout);
    let line = listing
        .lines()
        .find(|l| l.starts_with("ngram"))
        .unwrap_or_else(|| panic!("{listing}"));
    assert!(
        line.contains("0.1.0") && line.ends_with("ok (interface revision 2)"),
        "{line}"
    );
}

#[test]
fn deploy_config_runs_the_drafter_and_names_bad_keys() {
    let plugins = plugins_dir();
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("deploy.toml");
    let model = fixture("tiny-ple-kvshare");
    std::fs::write(
        &config,
        format!(
            "[model]\npath = {:?}\ndtype = \"f32\"\n[plugins]\ndirs = [{:?}]\n[drafter]\nname = \"ngram\"\nnum_draft_tokens = 4\n[drafter.config]\nmax_ngram = 2\n[sampling]\nmax_tokens = 24\n",
            model.to_str().unwrap(),
            plugins.path().to_str().unwrap()
        ),
    )
    .unwrap();
    let ids = prompts("tiny-ple-kvshare")[1].clone();
    let out = json_of(&mlx_spec(&[
        "run",
        "--config",
        config.to_str().unwrap(),
        "--prompt-ids",
        &ids_arg(&ids),
        "--json",
    ]));
    let plain = json_of(&mlx_spec(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        &ids_arg(&ids),
        "--max-tokens",
        "24",
        "--dtype",
        "f32",
        "--json",
    ]));
    assert_eq!(tokens_of(&out), tokens_of(&plain));
    assert_eq!(out["stats"]["drafter"], "ngram");
    let max_drafted = out["stats"]["drafted_per_position"]
        .as_array()
        .unwrap()
        .len();
    assert!(
        max_drafted <= 4,
        "num_draft_tokens = 4 not honoured: {}",
        out["stats"]
    );

    std::fs::write(
        &config,
        "[model]\npath = \"m\"\n[drafter]\nname = \"ngram\"\nnum_draft_token = 3\n",
    )
    .unwrap();
    let err = expect_error(&[
        "run",
        "--config",
        config.to_str().unwrap(),
        "--prompt-ids",
        "2",
    ]);
    assert!(
        err.contains("num_draft_token") && err.contains("line 5"),
        "{err}"
    );
}

/// Builds a plugin crate that lives outside the workspace, as its author would, and returns
/// its library. Such crates share one build folder, so the SDK's dependencies build once.
fn build_out_of_tree(crate_path: &str, library_stem: &str) -> std::path::PathBuf {
    build_crate_at(&repo_root().join(crate_path), library_stem)
}

/// [`build_out_of_tree`] for a crate anywhere.
fn build_crate_at(crate_dir: &Path, library_stem: &str) -> std::path::PathBuf {
    let crate_path = crate_dir.display().to_string();
    let target = repo_root().join("target/out-of-tree");
    let status = Command::new(env!("CARGO"))
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(crate_dir.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(crate_dir)
        .status()
        .expect("run cargo");
    assert!(status.success(), "building {crate_path} failed");
    target.join("release").join(lib_name(library_stem))
}

#[test]
fn an_out_of_tree_plugin_drops_into_an_already_built_host() {
    let crate_dir = repo_root().join("tests/drop-in/echo-drafter");
    let library = build_out_of_tree("tests/drop-in/echo-drafter", "echo_drafter");
    let plugins = tempfile::tempdir().unwrap();
    let manifest = std::fs::read_to_string(crate_dir.join("plugin.toml")).unwrap();
    install(plugins.path(), "echo", &library, &manifest);

    for name in ["tiny-ple-kvshare", "tiny-moe-keqv"] {
        let ids = prompts(name)[1].clone();
        let plain = run(&fixture(name), &ids, 40, &[]);
        let spec = run(
            &fixture(name),
            &ids,
            40,
            &[
                "--drafter",
                "echo",
                "--plugins-dir",
                plugins.path().to_str().unwrap(),
            ],
        );
        assert_eq!(
            tokens_of(&spec),
            tokens_of(&plain),
            "{name}: the drop-in plugin changed the output"
        );
        assert!(
            spec["stats"]["num_drafts"].as_u64().unwrap() > 0,
            "{}",
            spec["stats"]
        );
    }
}

/// A library built against the SDK of interface revision 1 (kept in tests/compat as it was)
/// loads into today's host and drafts: the interface grew only by appending, and the host
/// falls back to revision 1's entry points where the library lacks the new ones.
#[test]
fn a_plugin_built_against_the_previous_interface_still_loads_and_drafts() {
    let crate_dir = repo_root().join("tests/compat/echo-r1");
    let library = build_out_of_tree("tests/compat/echo-r1", "echo_r1");
    let plugins = tempfile::tempdir().unwrap();
    let manifest = std::fs::read_to_string(crate_dir.join("plugin.toml")).unwrap();
    install(plugins.path(), "echo-r1", &library, &manifest);
    let dir = plugins.path().to_str().unwrap();

    let list = mlx_spec(&["plugins", "list", "--plugins-dir", dir]);
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    let listing = String::from_utf8_lossy(&list.stdout);
    assert!(
        listing.contains("echo-r1") && listing.contains("ok (interface revision 1)"),
        "{listing}"
    );

    let name = "tiny-ple-kvshare";
    let ids = prompts(name)[1].clone();
    let plain = run(&fixture(name), &ids, 40, &[]);
    let spec = run(
        &fixture(name),
        &ids,
        40,
        &["--drafter", "echo-r1", "--plugins-dir", dir],
    );
    assert_eq!(tokens_of(&spec), tokens_of(&plain));
    assert!(
        spec["stats"]["num_drafts"].as_u64().unwrap() > 0,
        "the revision-1 drafter was never asked: {}",
        spec["stats"]
    );
    assert!(
        spec["stats"]["drafter_error"].is_null(),
        "{}",
        spec["stats"]
    );
}

/// `plugins new` writes a crate that builds and loads as it comes, and whose drafter reads a
/// hidden-state tap: it refuses to draft unless the taps it received cover every position
/// before the anchor, so lossless output with drafts and no drafter error shows the host
/// delivers every verified position (prompt, drafted rounds, plain rounds) exactly once.
#[test]
fn a_scaffolded_drafter_builds_loads_and_sees_every_verified_position() {
    let work = tempfile::tempdir().unwrap();
    let crate_dir = work.path().join("tapcheck");
    let sdk = repo_root().join("plugin-api");
    let made = mlx_spec(&[
        "plugins",
        "new",
        "tapcheck",
        "--dir",
        crate_dir.to_str().unwrap(),
        "--sdk",
        sdk.to_str().unwrap(),
    ]);
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let library = build_crate_at(&crate_dir, "tapcheck");
    let plugins = tempfile::tempdir().unwrap();
    let manifest = std::fs::read_to_string(crate_dir.join("plugin.toml")).unwrap();
    install(plugins.path(), "tapcheck", &library, &manifest);
    let check = mlx_spec(&[
        "plugins",
        "check",
        plugins.path().join("tapcheck").to_str().unwrap(),
    ]);
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let dir = plugins.path().to_str().unwrap();
    for name in ["tiny-ple-kvshare", "tiny-moe-keqv"] {
        for ids in prompts(name) {
            let plain = run(&fixture(name), &ids, 40, &[]);
            // Auto-off pauses the drafter (plain rounds) when its drafts keep missing.
            let spec = run(
                &fixture(name),
                &ids,
                40,
                &["--drafter", "tapcheck", "--plugins-dir", dir],
            );
            assert_eq!(tokens_of(&spec), tokens_of(&plain), "{name}");
            let stats = &spec["stats"];
            assert!(stats["drafter_error"].is_null(), "{name}: {stats}");
            assert!(stats["num_drafts"].as_u64().unwrap() > 0, "{name}: {stats}");
        }
    }
}
