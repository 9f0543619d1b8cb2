//! Shared by the tests: the oracle fixtures of `tests/fixtures/assistant-oracle` (two tiny
//! target/assistant pairs recorded with transformers), read with the plugin's own reader.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use mlx_spec_assistant::attention::DonorView;
use mlx_spec_assistant::checkpoint::Checkpoint;
use mlx_spec_assistant::config::Kind;
use mlx_spec_assistant::rope::QueryAngles;
use mlx_spec_assistant::{AssistantModel, Choice, Round, StepOutput};
use mlx_spec_plugin_api::mlx_rs::{Array, Dtype};

/// The two recorded pairs: E2B/E4B-style with the centroid head, 31B-style (K=V) dense.
pub const PAIRS: [&str; 2] = ["e", "dense"];

pub fn pair_dir(pair: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/assistant-oracle")
        .join(pair)
}

/// One pair's recordings and target checkpoint.
pub struct Oracle {
    pub pair: String,
    pub dir: PathBuf,
    pub rec: Checkpoint,
    pub target: Checkpoint,
    pub meta: serde_json::Value,
    pub target_config: serde_json::Value,
    pub hidden: usize,
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

impl Oracle {
    pub fn open(pair: &str) -> Self {
        let dir = pair_dir(pair);
        let target_config = read_json(&dir.join("target/config.json"));
        Oracle {
            pair: pair.to_owned(),
            rec: Checkpoint::open_file(&dir.join("oracle.safetensors")).unwrap(),
            target: Checkpoint::open_dir(&dir.join("target")).unwrap(),
            meta: read_json(&dir.join("oracle.json")),
            hidden: target_config["hidden_size"].as_u64().unwrap() as usize,
            target_config,
            dir,
        }
    }

    pub fn model(&self) -> AssistantModel {
        AssistantModel::load(&self.dir.join("assistant"), None).unwrap()
    }

    /// A recorded tensor as an array in its stored shape.
    pub fn array(&self, name: &str) -> Array {
        self.rec.tensor_any_shape(name).unwrap()
    }

    pub fn floats(&self, name: &str) -> Vec<f32> {
        floats(&self.array(name))
    }

    pub fn ints(&self, name: &str) -> Vec<i64> {
        let a = self.array(name).as_dtype(Dtype::Int64).unwrap();
        a.as_slice::<i64>().to_vec()
    }

    pub fn has(&self, name: &str) -> bool {
        self.rec.contains(name)
    }

    /// The names of the recorded rounds (`r0`, `r1`, ...).
    pub fn rounds(&self) -> Vec<String> {
        self.meta["rounds"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["round"].as_str().unwrap().to_owned())
            .collect()
    }

    /// The target's scaled embedding of `token` (`[1, H]`): its `embed_tokens` row times
    /// sqrt(H) (float32, as the float32 target rounds it).
    pub fn embed(&self, token: u32) -> Array {
        let table = self
            .target
            .tensor_any_shape("model.embed_tokens.weight")
            .unwrap();
        let row = table
            .take_axis(Array::from_slice(&[token as i32], &[1]), 0)
            .unwrap();
        row.multiply(Array::from_f32((self.hidden as f32).sqrt()))
            .unwrap()
    }

    /// The round's query position P.
    pub fn position(&self, round: &str) -> u64 {
        self.ints(&format!("{round}.position"))[0] as u64
    }

    /// The round's inputs exactly as recorded: donors as stored, transformers' masks, the
    /// query at P (`position_shift` moves it, for negative controls).
    pub fn round(&self, model: &AssistantModel, round: &str, position_shift: i64) -> Round {
        let p = (self.position(round) as i64 + position_shift) as u64;
        let view = |kind: Kind, name: &str| {
            let keys = self.array(&format!("{round}.donor.{name}.k"));
            let values = self.array(&format!("{round}.donor.{name}.v"));
            let mask: Vec<bool> = self
                .ints(&format!("{round}.mask.{name}"))
                .iter()
                .map(|&m| m != 0)
                .collect();
            let angles = QueryAngles::new(
                model.config.rope(kind),
                model.config.head_dim(kind),
                p,
                model.dtype,
            )
            .unwrap();
            (DonorView::masked(keys, values, &mask).unwrap(), angles)
        };
        Round {
            sliding: Some(view(Kind::Sliding, "sliding")),
            full: Some(view(Kind::Full, "full")),
        }
    }

    /// The round's anchor token and hidden state.
    pub fn anchor(&self, round: &str) -> (u32, Array) {
        let ids = self.ints(&format!("{round}.input_ids"));
        (
            *ids.last().unwrap() as u32,
            self.array(&format!("{round}.anchor_hidden")),
        )
    }

    /// Chains the round's steps on the model's own outputs from the recorded anchor; returns
    /// the tokens and every step's outputs.
    pub fn chain(
        &self,
        model: &AssistantModel,
        round: &str,
        inputs: &Round,
    ) -> (Vec<u32>, Vec<StepOutput>) {
        let steps = self.ints(&format!("{round}.draft_tokens")).len();
        let (token, hidden) = self.anchor(round);
        let mut outputs = Vec::new();
        let tokens = model
            .chain(
                (token, &hidden),
                inputs,
                steps,
                Choice::Greedy,
                |t| Ok(self.embed(t)),
                |out| {
                    outputs.push(StepOutput {
                        input: out.input.clone(),
                        stream: out.stream.clone(),
                        normed: out.normed.clone(),
                        next_hidden: out.next_hidden.clone(),
                    })
                },
            )
            .unwrap()
            .tokens;
        (tokens, outputs)
    }
}

pub fn floats(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap();
    a.as_slice::<f32>().to_vec()
}

/// Largest absolute difference; panics on a length mismatch.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0f32,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        )
}

/// A fresh scratch folder under the system's temporary directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("mlx-spec-assistant-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
