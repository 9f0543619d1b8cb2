//! What `mlx-spec quantize-drafter` writes, loaded by this plugin's own loader: the oracle row
//! (`tests/fixtures/mtp-oracle/mtp`: attention with biases, routed and shared experts)
//! quantized at 8 and 4 bits, groups of 32 (its widths are 64, 96, 128; the experts' 24-wide
//! down projections and the router stay float), computes what the float row computes within
//! the error 8-bit weights allow, with its matrices held packed.
//!
//! Both rows get the same inputs at every step (the prompt rows, then four chained steps on
//! the float row's own tokens and hidden states), so only the weights differ.
//!
//! The tolerance: 8-bit affine rounding leaves each weight off by a uniform error of at most
//! half a step (`range / 255` of its group of 32; the range of that many normal weights is
//! 4 to 4.5 sigma), an rms error of about 0.5 % of the weights' spread, which a product passes
//! on as the same relative error in its output. Along the row's products (eh_proj, q/k/v, o, the experts' gate/up and down)
//! at most about ten such errors add up in sequence, so the logits' relative rms error
//! `|d| / |logits|` is at most about 5 %: that is the bound, with the same greedy tokens. And
//! since the error is proportional to the step while it is small, 4-bit weights (steps 17
//! times larger) must move the logits at least 4 times as much: the comparison sees the
//! weights and the error scales as rounding does.

use std::path::{Path, PathBuf};

use mlx_spec_glm_mtp::cache::RowCache;
use mlx_spec_glm_mtp::MtpRow;
use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::ops::indexing::IndexOp;
use mlx_spec_plugin_api::mlx_rs::ops::{matmul, tanh};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mtp-oracle")
}

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

fn floats(a: &Array) -> Vec<f32> {
    let a = a
        .as_dtype(Dtype::Float32)
        .unwrap()
        .multiply(Array::from_f32(1.0))
        .unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|x, y| x.1.total_cmp(y.1))
        .unwrap()
        .0 as u32
}

struct Target {
    table: Array,
    hidden: f32,
    softcap: f32,
}

impl Target {
    fn open() -> Self {
        let dir = fixture().join("target");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let table = Checkpoint::open_dir(&dir)
            .unwrap()
            .tensor_any_shape("model.embed_tokens.weight")
            .unwrap();
        Target {
            table,
            hidden: config["hidden_size"].as_f64().unwrap() as f32,
            softcap: config["final_logit_softcapping"].as_f64().unwrap() as f32,
        }
    }

    fn embed(&self, ids: &[u32]) -> Array {
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        self.table
            .take_axis(Array::from_slice(&ids, &[ids.len() as i32]), 0)
            .unwrap()
            .multiply(Array::from_f32(self.hidden.sqrt()))
            .unwrap()
    }

    fn logits(&self, h: &Array) -> Vec<f32> {
        let cap = Array::from_f32(self.softcap);
        let z = matmul(h, self.table.t()).unwrap();
        floats(
            &tanh(z.divide(&cap).unwrap())
                .unwrap()
                .multiply(&cap)
                .unwrap(),
        )
    }
}

/// The relative rms and the largest difference of every step's logits (prompt rows first) of
/// both rows on the float row's inputs, and the tokens each picks at the chained steps.
fn compare(float: &MtpRow, other: &MtpRow) -> (f32, f32, Vec<u32>, Vec<u32>) {
    let t = Target::open();
    let rec = Checkpoint::open_file(&fixture().join("oracle.safetensors")).unwrap();
    let prompt: Vec<u32> = {
        let a = rec
            .tensor_any_shape("prompt.input_ids")
            .unwrap()
            .as_dtype(Dtype::Int64)
            .unwrap();
        a.eval().unwrap();
        a.as_slice::<i64>().iter().map(|&x| x as u32).collect()
    };
    let hidden = rec.tensor_any_shape("prompt.hidden").unwrap();
    let h = *hidden.shape().last().unwrap();
    let hidden = hidden.reshape(&[-1, h]).unwrap();
    let len = prompt.len() as i32;
    let (mut cf, mut co) = (RowCache::default(), RowCache::default());
    cf.start_at(0);
    co.start_at(0);
    let e = t.embed(&prompt[1..]);
    let rows = hidden.index(0..len - 1);
    let (pf, po) = (
        float.forward(&e, &rows, &mut cf).unwrap(),
        other.forward(&e, &rows, &mut co).unwrap(),
    );
    let (mut worst, mut d2, mut x2) = (0f32, 0f64, 0f64);
    let mut measure = |a: &[f32], b: &[f32]| {
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((x - y).abs());
            d2 += f64::from(x - y).powi(2);
            x2 += f64::from(*x).powi(2);
        }
    };
    measure(&t.logits(&pf.head_in), &t.logits(&po.head_in));
    // The target's greedy token after the prompt, as recorded.
    let logits = rec.tensor_any_shape("prompt.logits").unwrap();
    let v = *logits.shape().last().unwrap();
    let mut token = argmax(&floats(
        &logits.reshape(&[-1, v]).unwrap().index(len - 1..len),
    ));
    let mut h_in = hidden.index(len - 1..len);
    let (mut tf, mut to) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        let e = t.embed(&[token]);
        let of = float.forward(&e, &h_in, &mut cf).unwrap();
        let oo = other.forward(&e, &h_in, &mut co).unwrap();
        let (lf, lo) = (t.logits(&of.head_in), t.logits(&oo.head_in));
        measure(&lf, &lo);
        tf.push(argmax(&lf));
        to.push(argmax(&lo));
        token = argmax(&lf);
        h_in = of.block_out;
    }
    ((d2 / x2).sqrt() as f32, worst, tf, to)
}

#[test]
fn quantized_rows_compute_as_the_float_row() {
    let src = fixture().join("mtp");
    let float = MtpRow::load(&src, None).unwrap();
    let mut drift = Vec::new();
    for bits in [8, 4] {
        let dir = std::env::temp_dir().join(format!(
            "mlx-spec-glm-mtp-quantized-{bits}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let out = std::process::Command::new(mlx_spec_binary())
            .args(["quantize-drafter", "--bits", &bits.to_string()])
            .args(["--group-size", "32"])
            .arg(&src)
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "quantize-drafter: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let row = MtpRow::load(&dir, None).unwrap();
        let (d, worst, tf, to) = compare(&float, &row);
        println!(
            "{bits}-bit: logits off by {:.2} % rms (largest difference {worst:.4}); tokens {to:?} (float {tf:?}); {} bytes (float {})",
            100.0 * d,
            row.nbytes(),
            float.nbytes()
        );
        assert!(
            row.nbytes() * 2 < float.nbytes(),
            "{bits}-bit: {} bytes vs {} in float: not held packed",
            row.nbytes(),
            float.nbytes()
        );
        if bits == 8 {
            assert_eq!(to, tf, "8-bit: tokens differ");
            assert!(d <= 0.05, "8-bit: logits off by {d} (relative rms)");
        }
        drift.push(d);
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(
        drift[1] > 4.0 * drift[0],
        "4-bit logits ({}) should move at least 4 times as much as 8-bit ones ({})",
        drift[1],
        drift[0]
    );
}
