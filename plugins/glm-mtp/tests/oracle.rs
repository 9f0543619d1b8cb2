//! Parity with transformers' own `MtpLayer(Glm4MoeDecoderLayer)` on the recorded oracle
//! (`tests/fixtures/mtp-oracle`, float32, tolerance 1e-4): three cases (prompt rows in the
//! cache with the pre-norm chain, no prompt rows, the post-norm chain), each a prompt then
//! four rounds of three chained drafts with forced acceptance 2, 0, 3.
//!
//! The target's ports are played by the target checkpoint itself: embeddings
//! `embed_tokens × sqrt(H)`, logits `tanh(E·h / 30) · 30` with the stored table `E` (tied head,
//! soft-cap 30).

use std::path::{Path, PathBuf};

use mlx_spec_glm_mtp::cache::RowCache;
use mlx_spec_glm_mtp::config::ChainHidden;
use mlx_spec_glm_mtp::{Choice, MtpRow, Rounds, TargetPorts};
use mlx_spec_plugin_api::checkpoint::Checkpoint;
use mlx_spec_plugin_api::mlx_rs::ops::indexing::IndexOp;
use mlx_spec_plugin_api::mlx_rs::ops::{matmul, tanh};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

const TOL: f32 = 1e-4;
const CASES: [(&str, bool, ChainHidden); 3] = [
    ("prefill_prenorm", true, ChainHidden::PreNorm),
    ("empty_prenorm", false, ChainHidden::PreNorm),
    ("prefill_postnorm", true, ChainHidden::PostNorm),
];

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mtp-oracle")
}

fn floats(a: &Array) -> Vec<f32> {
    // A product makes a new contiguous array whatever the input's strides.
    let a = a
        .as_dtype(Dtype::Float32)
        .unwrap()
        .multiply(Array::from_f32(1.0))
        .unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

fn argmax(a: &Array) -> u32 {
    floats(a)
        .iter()
        .enumerate()
        .max_by(|x, y| x.1.total_cmp(y.1))
        .unwrap()
        .0 as u32
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    let (a, b) = (floats(a), floats(b));
    assert_eq!(a.len(), b.len(), "shapes differ");
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

struct Oracle {
    rec: Checkpoint,
    meta: serde_json::Value,
    /// `embed_tokens × sqrt(H)`, `[V, H]`: what the target's first layer reads.
    embedding: Array,
    /// `embed_tokens` as stored: the tied LM head.
    head: Array,
    softcap: f32,
}

impl Oracle {
    fn open() -> Self {
        let dir = fixture();
        let target = Checkpoint::open_dir(&dir.join("target")).unwrap();
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("target/config.json")).unwrap())
                .unwrap();
        let hidden = config["hidden_size"].as_u64().unwrap() as f32;
        let table = target
            .tensor_any_shape("model.embed_tokens.weight")
            .unwrap();
        Oracle {
            rec: Checkpoint::open_file(&dir.join("oracle.safetensors")).unwrap(),
            meta: serde_json::from_str(&std::fs::read_to_string(dir.join("oracle.json")).unwrap())
                .unwrap(),
            embedding: table.multiply(Array::from_f32(hidden.sqrt())).unwrap(),
            head: table,
            softcap: config["final_logit_softcapping"].as_f64().unwrap() as f32,
        }
    }

    fn row(&self) -> MtpRow {
        MtpRow::load(&fixture().join("mtp"), Some(Dtype::Float32)).unwrap()
    }

    fn array(&self, name: &str) -> Array {
        self.rec.tensor_any_shape(name).unwrap()
    }

    fn ints(&self, name: &str) -> Vec<u32> {
        let a = self.array(name).as_dtype(Dtype::Int64).unwrap();
        a.eval().unwrap();
        a.as_slice::<i64>().iter().map(|&t| t as u32).collect()
    }

    fn embed(&self, ids: &[u32]) -> Array {
        let ids = Array::from_slice(
            &ids.iter().map(|&t| t as i32).collect::<Vec<_>>(),
            &[ids.len() as i32],
        );
        self.embedding.take_axis(&ids, 0).unwrap()
    }

    fn logits(&self, h: &Array) -> Array {
        let z = matmul(h, self.head.t()).unwrap();
        let cap = Array::from_f32(self.softcap);
        tanh(z.divide(&cap).unwrap())
            .unwrap()
            .multiply(&cap)
            .unwrap()
    }

    fn forced(&self) -> Vec<usize> {
        self.meta["forced_k"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_u64().unwrap() as usize)
            .collect()
    }

    /// Rows `rows` of a recorded `[1, n, H]` hidden-state tensor, as `[rows, H]`.
    fn rows(&self, name: &str, rows: std::ops::Range<i32>) -> Array {
        let a = self.array(name);
        let h = *a.shape().last().unwrap();
        a.reshape(&[-1, h]).unwrap().index(rows)
    }
}

impl TargetPorts for Oracle {
    fn embed(&self, ids: &[u32]) -> Result<Array, String> {
        Ok(Oracle::embed(self, ids))
    }

    fn logits(&self, head_in: &Array) -> Result<Array, String> {
        Ok(Oracle::logits(self, head_in))
    }
}

/// The oracle's own sequence, one step at a time: the prompt rows, then per round the chained
/// steps, the trim to the first (true) row and the absorption of the accepted rows from the
/// verified hidden states. Every intermediate and the cache after every commit.
#[test]
fn every_step_and_every_cache_matches_the_oracle() {
    let o = Oracle::open();
    let row = o.row();
    let prompt = o.ints("prompt.input_ids");
    let len = prompt.len() as i32;
    let forced = o.forced();
    for (case, prefill, chain) in CASES {
        let mut cache = RowCache::default();
        let mut worst = [0f32; 6]; // eh_out, block_out, head_in, logits, absorb, cache
        if prefill {
            cache.start_at(0);
            let out = row
                .forward(
                    &o.embed(&prompt[1..]),
                    &o.rows("prompt.hidden", 0..len - 1),
                    &mut cache,
                )
                .unwrap();
            let want = o.array(&format!("{case}.prefill.block_out"));
            worst[1] = worst[1].max(max_diff(&out.block_out, &want));
        } else {
            cache.start_at(len as u64 - 1);
        }
        let mut pending = argmax(&o.rows("prompt.logits", len - 1..len));
        let mut anchor = o.rows("prompt.hidden", len - 1..len);
        for round in 0..=forced.len() {
            let rows_before = cache.rows();
            let (mut token, mut hidden) = (pending, anchor.clone());
            let mut drafts = Vec::new();
            for step in 0..3 {
                let key = format!("{case}.r{round}.s{step}");
                assert_eq!(o.ints(&format!("{key}.token")), vec![token], "{key}");
                let out = row
                    .forward(&o.embed(&[token]), &hidden, &mut cache)
                    .unwrap();
                let logits = o.logits(&out.head_in);
                for (i, (got, name)) in [
                    (&out.eh_out, "eh_out"),
                    (&out.block_out, "block_out"),
                    (&out.head_in, "head_in"),
                    (&logits, "logits"),
                ]
                .into_iter()
                .enumerate()
                {
                    worst[i] = worst[i].max(max_diff(got, &o.array(&format!("{key}.{name}"))));
                }
                token = argmax(&logits);
                drafts.push(token);
                hidden = match chain {
                    ChainHidden::PreNorm => out.block_out,
                    ChainHidden::PostNorm => out.head_in,
                };
            }
            assert_eq!(
                drafts,
                o.ints(&format!("{case}.r{round}.drafts")),
                "{case} round {round}"
            );
            if round == forced.len() {
                break;
            }
            // Commit: keep the row built from the target's hidden, absorb the accepted rows.
            let k = forced[round] as i32;
            cache.truncate(rows_before + 1);
            let verified = format!("{case}.r{round}.verify.hidden");
            if k > 0 {
                let out = row
                    .forward(
                        &o.embed(&drafts[..k as usize]),
                        &o.rows(&verified, 0..k),
                        &mut cache,
                    )
                    .unwrap();
                let want = o.array(&format!("{case}.r{round}.absorb.block_out"));
                worst[4] = worst[4].max(max_diff(&out.block_out, &want));
            }
            let (keys, values) = cache.keys_values().unwrap();
            for (got, name) in [(keys, "k"), (values, "v")] {
                let want = o.array(&format!("{case}.r{round}.cache.{name}"));
                assert_eq!(got.shape(), want.shape(), "{case} r{round} cache {name}");
                worst[5] = worst[5].max(max_diff(got, &want));
            }
            pending = o.ints(&format!("{case}.r{round}.next_token"))[0];
            anchor = o.rows(&verified, k..k + 1);
        }
        println!(
            "[{case}] max |d| eh_out {:.1e}, block_out {:.1e}, head_in {:.1e}, logits {:.1e}, absorbed {:.1e}, cache {:.1e}",
            worst[0], worst[1], worst[2], worst[3], worst[4], worst[5]
        );
        for (what, w) in [
            "eh_out",
            "block_out",
            "head_in",
            "logits",
            "absorbed rows",
            "cache",
        ]
        .iter()
        .zip(worst)
        {
            assert!(w <= TOL, "{case}: {what} differs by {w:e}");
        }
    }
}

/// What the plugin runs: [`Rounds`] fed the hidden states as the host delivers them (the
/// prompt, then each round's verified positions), building the missing true rows and step 0
/// in one forward. It must draft what the oracle drafts in every round.
fn rounds_drafts(
    o: &Oracle,
    row: &MtpRow,
    prefill: bool,
    chain: ChainHidden,
    case: &str,
) -> (Vec<Vec<u32>>, f32) {
    let prompt = o.ints("prompt.input_ids");
    let len = prompt.len() as i32;
    let forced = o.forced();
    let mut rounds = Rounds::new(prefill, chain);
    rounds.receive(0, o.rows("prompt.hidden", 0..len)).unwrap();
    let mut history = prompt.clone();
    history.push(o.ints(&format!("{case}.r0.s0.token"))[0]);
    let mut all = Vec::new();
    let mut worst = 0f32;
    for round in 0..=forced.len() {
        let p = history.len() as u64 - 1;
        let mut step = 0;
        let drafts = rounds
            .draft(row, &history, 3, Choice::Greedy, o, |s| {
                let want = o.array(&format!("{case}.r{round}.s{step}.logits"));
                worst = worst.max(max_diff(&s.logits, &want));
                step += 1;
            })
            .unwrap();
        all.push(drafts.tokens.clone());
        if round == forced.len() {
            break;
        }
        let k = forced[round];
        let verified = format!("{case}.r{round}.verify.hidden");
        rounds
            .receive(p, o.rows(&verified, 0..k as i32 + 1))
            .unwrap();
        history.extend_from_slice(&drafts.tokens[..k]);
        history.push(o.ints(&format!("{case}.r{round}.next_token"))[0]);
    }
    (all, worst)
}

#[test]
fn the_plugins_rounds_draft_what_the_oracle_drafts() {
    let o = Oracle::open();
    let row = o.row();
    for (case, prefill, chain) in CASES {
        let (got, worst) = rounds_drafts(&o, &row, prefill, chain, case);
        let want: Vec<Vec<u32>> = (0..got.len())
            .map(|r| o.ints(&format!("{case}.r{r}.drafts")))
            .collect();
        println!("[{case}] rounds {got:?}, max |d logits| {worst:.1e}");
        assert_eq!(got, want, "{case}");
        assert!(worst <= TOL, "{case}: logits differ by {worst:e}");
    }
}

/// The oracle tells the conventions apart: the other chain, or no prompt rows, drafts
/// otherwise.
#[test]
fn negative_controls_fail() {
    let o = Oracle::open();
    let row = o.row();
    let want: Vec<Vec<u32>> = (0..4)
        .map(|r| o.ints(&format!("prefill_prenorm.r{r}.drafts")))
        .collect();
    let (right, worst) = rounds_drafts(&o, &row, true, ChainHidden::PreNorm, "prefill_prenorm");
    assert!(
        right == want && worst <= TOL,
        "the control itself must pass"
    );
    for (prefill, chain, what) in [
        (true, ChainHidden::PostNorm, "the post-norm chain"),
        (false, ChainHidden::PreNorm, "skipping the prompt rows"),
    ] {
        let (got, worst) = rounds_drafts(&o, &row, prefill, chain, "prefill_prenorm");
        println!("{what}: drafts {got:?}, max |d logits| {worst:.1e}");
        assert!(
            got != want && worst > 1e-2,
            "{what} passed as the recorded convention"
        );
    }
}
