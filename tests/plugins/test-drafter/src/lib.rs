//! A test drafter whose behaviour is chosen by its `mode` setting:
//!
//! * `script`: proposes the continuation given in `script` (the target's own output, so every
//!   draft is accepted), aligned by `prompt_len`;
//! * `wrong`: the same continuation with every token shifted by one (never accepted greedily);
//! * `panic`: panics while drafting;
//! * `out_of_vocab`: proposes a token id past the vocabulary;
//! * `too_many`: returns more tokens than asked for;
//! * `refuse`: refuses to open a request;
//! * `empty`: never proposes anything (every round is a plain step through the plugin
//!   boundary: measures its cost);
//! * `shift`: proposes the last token plus one, `n` times (nearly always wrong: exercises
//!   auto-off);
//! * `noisy`: samples drafts from its own distribution `q` and returns `q` (rejection
//!   sampling path): q mixes a uniform floor with a peak on `(last token * 7 + 3) % vocab`;
//! * `bad_port`: calls the target's ports with bad arguments and passes their error on.

use mlx_spec_plugin_api::mlx_rs::Array;
use mlx_spec_plugin_api::{
    declare_drafter_plugin, Drafter, DrafterSession, Proposal, SamplingInfo, Target, TargetInfo,
};
use serde::Deserialize;

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    mode: String,
    #[serde(default)]
    script: Vec<u32>,
    #[serde(default)]
    prompt_len: usize,
}

pub struct TestDrafter(Config);

impl Drafter for TestDrafter {
    type Session = TestSession;

    fn from_config(config: &serde_json::Value) -> Result<Self, String> {
        let c: Config = serde_json::from_value(config.clone())
            .map_err(|e| format!("test drafter configuration: {e}"))?;
        Ok(TestDrafter(c))
    }

    fn open(&self, target: &TargetInfo, sampling: &SamplingInfo) -> Result<TestSession, String> {
        if self.0.mode == "refuse" {
            return Err("this drafter refuses every request".to_owned());
        }
        Ok(TestSession {
            config: self.0.clone(),
            vocab: target.vocab_size,
            seed: sampling.seed,
        })
    }
}

pub struct TestSession {
    config: Config,
    vocab: u32,
    seed: u64,
}

/// A uniform number in [0, 1) from (seed, index), independent of the host's streams.
fn unit(seed: u64, index: u64) -> f64 {
    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ index.wrapping_add(0x1234_5678);
    for _ in 0..3 {
        x ^= x >> 33;
        x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    }
    (x >> 11) as f64 / (1u64 << 53) as f64
}

impl DrafterSession for TestSession {
    fn draft(
        &mut self,
        history: &[u32],
        n: usize,
        step_base: u64,
        target: &Target<'_>,
    ) -> Result<Proposal, String> {
        let c = &self.config;
        let from_script = |shift: u32| -> Vec<u32> {
            // history = prompt + emitted; the next emitted index is history.len() - prompt_len.
            let next = history.len().saturating_sub(c.prompt_len);
            c.script
                .iter()
                .skip(next)
                .take(n)
                .map(|t| (t + shift) % self.vocab)
                .collect()
        };
        match c.mode.as_str() {
            "script" => Ok(Proposal::tokens(from_script(0))),
            "wrong" => Ok(Proposal::tokens(from_script(1))),
            "empty" => Ok(Proposal::tokens(Vec::new())),
            "shift" => {
                let next = (history.last().copied().unwrap_or(0) + 1) % self.vocab;
                Ok(Proposal::tokens(vec![next; n]))
            }
            "panic" => panic!("test drafter panics on purpose at step {step_base}"),
            "out_of_vocab" => Ok(Proposal::tokens(vec![self.vocab + 5])),
            "too_many" => Ok(Proposal::tokens(vec![3; n + 3])),
            "bad_port" => {
                // Ports answer misuse with errors, never a crash: a layer that does not
                // exist, then hidden states of the wrong width.
                let missing = target.donor_kv(9999).err().unwrap_or_default();
                if !missing.contains("does not exist") {
                    return Err(format!("donor_kv(9999) should be refused, got {missing:?}"));
                }
                let narrow = Array::from_slice(&[0f32; 3], &[1, 3]);
                target
                    .logits_from_hidden(&narrow)
                    .map(|_| Proposal::tokens(Vec::new()))
            }
            "noisy" => {
                let v = self.vocab as usize;
                let mut last = *history.last().unwrap_or(&0);
                let mut tokens = Vec::with_capacity(n);
                let mut probs = Vec::with_capacity(n * v);
                for i in 0..n {
                    let peak = ((last as usize) * 7 + 3) % v;
                    let mut q = vec![0.5 / v as f32; v];
                    q[peak] += 0.5;
                    let u = unit(self.seed, step_base + i as u64);
                    let mut acc = 0.0;
                    let mut pick = v - 1;
                    for (t, &p) in q.iter().enumerate() {
                        acc += p as f64;
                        if u < acc {
                            pick = t;
                            break;
                        }
                    }
                    tokens.push(pick as u32);
                    probs.extend_from_slice(&q);
                    last = pick as u32;
                }
                let probs = Array::from_slice(&probs, &[n as i32, v as i32]);
                Ok(Proposal {
                    tokens,
                    probs: Some(probs),
                })
            }
            other => Err(format!("unknown test mode {other:?}")),
        }
    }
}

declare_drafter_plugin!("test-drafter", TestDrafter);
