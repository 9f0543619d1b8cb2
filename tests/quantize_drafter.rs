//! `mlx-spec quantize-drafter` as a user runs it, on the oracle fixture of each drafter format:
//! what it writes (MLX's packed layout for every matrix whose width splits into groups, the
//! float tensors untouched, the `quantization` block with `false` for each matrix left in
//! float, the other files copied but not the model card), that the same input gives the same
//! bytes, and a one-line error naming the file for each input it refuses. Whether the plugins
//! compute with what it writes is tested beside each plugin (`plugins/*/tests/quantized*.rs`).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{expect_error, fixture, mlx_spec};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde_json::Value;

struct Info {
    dtype: Dtype,
    shape: Vec<usize>,
}

fn tensors(dir: &Path) -> BTreeMap<String, Info> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                Info {
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                },
            )
        })
        .collect()
}

fn config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mlx-spec-quantize-drafter-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn quantize(src: &Path, dst: &Path, bits: &str, group: &str) {
    let out = mlx_spec(&[
        "quantize-drafter",
        "--bits",
        bits,
        "--group-size",
        group,
        src.to_str().unwrap(),
        dst.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "quantize-drafter {}: {}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Checks the written folder against its source: every float `.weight` matrix of width
/// divisible by `group` (and not kept by rule) packed, everything else as it was.
fn check_layout(src: &Path, dst: &Path, bits: usize, group: usize, kept_by_rule: &[&str]) {
    let before = tensors(src);
    let after = tensors(dst);
    let block = &config(dst)["quantization"];
    assert_eq!(block["bits"], bits, "{}", dst.display());
    assert_eq!(block["group_size"], group);
    assert_eq!(block["mode"], "affine");
    let (mut packed, mut float) = (0, 0);
    for (name, info) in &before {
        let module = name.trim_end_matches(".weight");
        let matrix = name.ends_with(".weight")
            && info.shape.len() == 2
            && matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16);
        let by_rule = kept_by_rule.iter().any(|k| module.contains(k));
        if matrix && !by_rule && info.shape[1] % group == 0 {
            let (out_dim, in_dim) = (info.shape[0], info.shape[1]);
            let w = &after[name];
            assert_eq!(w.dtype, Dtype::U32, "{name}");
            assert_eq!(w.shape, vec![out_dim, in_dim * bits / 32], "{name}");
            for part in ["scales", "biases"] {
                let p = &after[&format!("{module}.{part}")];
                assert_eq!(p.shape, vec![out_dim, in_dim / group], "{module}.{part}");
                assert_eq!(p.dtype, info.dtype, "{module}.{part} keeps the float dtype");
            }
            assert!(block.get(module).is_none(), "{module} packed but listed");
            packed += 1;
        } else {
            let w = &after[name];
            assert_eq!(
                (w.dtype, &w.shape),
                (info.dtype, &info.shape),
                "{name} must stay as it was"
            );
            assert!(!after.contains_key(&format!("{module}.scales")), "{name}");
            if matrix {
                assert_eq!(block[module], false, "{module} left in float is listed");
                float += 1;
            }
        }
    }
    assert_eq!(
        after.len(),
        before.len() + 2 * packed,
        "{}: nothing else is written",
        dst.display()
    );
    assert!(packed > 0);
    println!("{}: {packed} packed, {float} float", dst.display());
    // The rest of the source config is unchanged.
    let mut want = config(src);
    want["quantization"] = block.clone();
    assert_eq!(config(dst), want);
}

#[test]
fn each_format_is_written_in_mlx_layout() {
    let cases: [(&str, PathBuf, &str, &[&str]); 5] = [
        (
            "assistant-e",
            fixture("assistant-oracle/e/assistant"),
            "32",
            &[],
        ),
        (
            "assistant-dense",
            fixture("assistant-oracle/dense/assistant"),
            "32",
            &[],
        ),
        ("glm-mtp", fixture("mtp-oracle/mtp"), "32", &["mlp.gate"]),
        (
            "deepspec",
            fixture("deepspec-oracle"),
            "32",
            &["confidence_head"],
        ),
        ("dflash", fixture("dflash-oracle"), "32", &[]),
    ];
    for (name, src, group, rule) in cases {
        for bits in ["8", "4"] {
            let dst = scratch(&format!("{name}-{bits}"));
            quantize(&src, &dst, bits, group);
            check_layout(&src, &dst, bits.parse().unwrap(), 32, rule);
            // Other files come along; the model card does not.
            for entry in std::fs::read_dir(&src).unwrap() {
                let entry = entry.unwrap();
                // Files only: a folder beside the weights (an oracle's target) is not copied.
                if !entry.path().is_file() {
                    assert!(!dst.join(entry.file_name()).exists());
                    continue;
                }
                let file = entry.file_name().to_string_lossy().into_owned();
                let copied = dst.join(&file).exists();
                // Safetensors files are not copied (the weights are written anew as one
                // model.safetensors), nor is the card.
                if file.ends_with(".safetensors") {
                    continue;
                }
                let expected = file != "README.md";
                assert_eq!(copied, expected, "{name}: {file}");
            }
            let _ = std::fs::remove_dir_all(&dst);
        }
    }
    // The expert router and the confidence head are matrices kept by rule (their widths
    // split into groups of 32: 64 and 64).
    let mtp = scratch("router");
    quantize(&fixture("mtp-oracle/mtp"), &mtp, "8", "32");
    assert_eq!(
        config(&mtp)["quantization"]["model.layers.6.mlp.gate"],
        false
    );
    let _ = std::fs::remove_dir_all(&mtp);
}

#[test]
fn the_same_input_gives_the_same_bytes() {
    let src = fixture("assistant-oracle/e/assistant");
    let (a, b) = (scratch("same-a"), scratch("same-b"));
    quantize(&src, &a, "8", "32");
    quantize(&src, &b, "8", "32");
    for file in ["model.safetensors", "config.json"] {
        assert!(
            std::fs::read(a.join(file)).unwrap() == std::fs::read(b.join(file)).unwrap(),
            "{file} differs between two runs"
        );
    }
    let _ = std::fs::remove_dir_all(&a);
    let _ = std::fs::remove_dir_all(&b);
}

#[test]
fn bad_inputs_are_refused_naming_the_file() {
    let run = |src: &Path, dst: &Path, bits: &str, group: &str| {
        expect_error(&[
            "quantize-drafter",
            "--bits",
            bits,
            "--group-size",
            group,
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
        ])
    };
    let src = fixture("assistant-oracle/e/assistant");
    let dst = scratch("refused");

    // A target checkpoint is no drafter format.
    let target = fixture("assistant-oracle/e/target");
    let e = run(&target, &dst, "8", "32");
    assert!(
        e.contains(&target.join("config.json").display().to_string())
            && e.contains("not a drafter format"),
        "{e}"
    );
    assert!(!dst.exists(), "nothing is written for a refused input");

    // No config.json.
    let empty = scratch("no-config");
    std::fs::create_dir_all(&empty).unwrap();
    let e = run(&empty, &dst, "8", "32");
    assert!(
        e.contains(&empty.join("config.json").display().to_string()),
        "{e}"
    );

    // An already quantized source: by its config block, and by its tensors when the block is
    // gone.
    let quantized = scratch("already");
    quantize(&src, &quantized, "8", "32");
    let e = run(&quantized, &dst, "4", "32");
    assert!(
        e.contains(&quantized.join("config.json").display().to_string())
            && e.contains("already quantized"),
        "{e}"
    );
    let mut cfg = config(&quantized);
    cfg.as_object_mut().unwrap().remove("quantization");
    std::fs::write(quantized.join("config.json"), cfg.to_string()).unwrap();
    let e = run(&quantized, &dst, "4", "32");
    assert!(
        e.contains(&quantized.join("model.safetensors").display().to_string())
            && e.contains("already quantized"),
        "{e}"
    );

    // A destination that exists and is not empty is left alone.
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(dst.join("keep.txt"), "mine").unwrap();
    let e = run(&src, &dst, "8", "32");
    assert!(
        e.contains(&dst.display().to_string()) && e.contains("not empty"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(dst.join("keep.txt")).unwrap(),
        "mine"
    );
    assert_eq!(std::fs::read_dir(&dst).unwrap().count(), 1);

    // Bits and group sizes other than 4|8 and 32|64 are refused by the parser.
    for (bits, group, flag) in [("3", "32", "--bits"), ("8", "48", "--group-size")] {
        let out = mlx_spec(&[
            "quantize-drafter",
            "--bits",
            bits,
            "--group-size",
            group,
            src.to_str().unwrap(),
            scratch("flags").to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(flag), "{stderr}");
    }

    for d in [&dst, &empty, &quantized] {
        let _ = std::fs::remove_dir_all(d);
    }
}
