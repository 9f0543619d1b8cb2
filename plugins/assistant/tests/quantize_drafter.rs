//! What `mlx-spec quantize-drafter` writes, loaded by this plugin's own loader: both oracle
//! assistants (centroid head, dense head) quantized at 8 and 4 bits, groups of 32 (the
//! fixtures are 32 wide), draft as the float checkpoint does within the error 8-bit weights
//! allow, and hold their matrices, the gather tables included, packed.
//!
//! The tolerance: 8-bit affine rounding leaves each weight off by a uniform error of at most
//! half a step (`range / 255` of its group of 32; the range of that many normal weights is
//! 4 to 4.5 sigma), an rms error of about 0.5 % of the weights' spread, which a product passes
//! on as the same relative error in its output. Along the assistant's products (the input projection, four layers of q, o, gate/up and down, the head)
//! at most about ten such errors add up in sequence, so the logits' relative rms error
//! `|d| / |logits|` is at most about 5 %: that is the bound, with the same greedy tokens. And
//! since the error is proportional to the step while it is small, 4-bit weights (steps 17
//! times larger) must move the logits at least 4 times as much: the comparison sees the
//! weights and the error scales as rounding does.

mod common;

use std::path::{Path, PathBuf};

use common::{floats, max_diff, scratch, Oracle, PAIRS};
use mlx_spec_assistant::head::Head;
use mlx_spec_assistant::linear::Linear;
use mlx_spec_assistant::AssistantModel;

/// The `mlx-spec` binary of the build these tests belong to (`target/<profile>/mlx-spec`).
fn mlx_spec_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("mlx-spec");
    assert!(
        bin.is_file(),
        "{} is missing: build the host first (cargo build --release)",
        bin.display()
    );
    bin
}

fn quantize(src: &Path, dst: &Path, bits: u32) {
    let out = std::process::Command::new(mlx_spec_binary())
        .args(["quantize-drafter", "--bits", &bits.to_string()])
        .args(["--group-size", "32"])
        .arg(src)
        .arg(dst)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "quantize-drafter: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn run(o: &Oracle, model: &AssistantModel) -> (Vec<Vec<f32>>, Vec<u32>) {
    let round = o.round(model, "r0", 0);
    let (tokens, steps) = o.chain(model, "r0", &round);
    let logits = steps
        .iter()
        .map(|s| floats(&model.head.logits(&s.normed).unwrap()))
        .collect();
    (logits, tokens)
}

/// `|a - b| / |b|` over all steps.
fn relative_rms(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let (mut d2, mut x2) = (0f64, 0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        d2 += f64::from(x - y).powi(2);
        x2 += f64::from(*y).powi(2);
    }
    (d2 / x2).sqrt() as f32
}

#[test]
fn quantized_checkpoints_draft_as_the_float_one() {
    for pair in PAIRS {
        let o = Oracle::open(pair);
        let float = o.model();
        let (float_logits, float_tokens) = run(&o, &float);
        let mut drift = Vec::new();
        for bits in [8, 4] {
            let dir = scratch(&format!("quantize-drafter-{pair}-{bits}"));
            quantize(&o.dir.join("assistant"), &dir, bits);
            let model = AssistantModel::load(&dir, None).unwrap();
            let (logits, tokens) = run(&o, &model);
            let worst = logits
                .iter()
                .zip(&float_logits)
                .map(|(a, b)| max_diff(a, b))
                .fold(0f32, f32::max);
            let d = relative_rms(&logits, &float_logits);
            println!(
                "[{pair}] {bits}-bit: logits off by {:.2} % rms (largest difference {worst:.4}); drafts {tokens:?} (float {float_tokens:?}); {} bytes (float {})",
                100.0 * d,
                model.nbytes(),
                float.nbytes()
            );
            // The weights are held packed, the gather tables too.
            assert!(
                model.nbytes() * 2 < float.nbytes(),
                "{pair} {bits}-bit: {} bytes vs {} in float",
                model.nbytes(),
                float.nbytes()
            );
            let packed = |l: &Linear| matches!(l, Linear::Quantized(_));
            match &model.head {
                Head::Dense { table } => assert!(packed(table), "{pair}: embed_tokens"),
                Head::Centroid {
                    table, centroids, ..
                } => assert!(packed(table) && packed(centroids), "{pair}: head tables"),
            }
            if bits == 8 {
                assert_eq!(tokens, float_tokens, "{pair} 8-bit: drafts differ");
                assert!(d <= 0.05, "{pair} 8-bit: logits off by {d} (relative rms)");
            }
            drift.push(d);
            let _ = std::fs::remove_dir_all(&dir);
        }
        assert!(
            drift[1] > 4.0 * drift[0],
            "{pair}: 4-bit logits ({}) should move at least 4 times as much as 8-bit ones ({})",
            drift[1],
            drift[0]
        );
    }
}
