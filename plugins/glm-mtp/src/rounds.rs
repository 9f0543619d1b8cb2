//! A request's rows, round after round: which rows the cache holds, which hidden states are
//! waiting for their row, and the chained draft steps of a round.
//!
//! Row `i` is built from `(h_i, t_{i+1})`, the target's final-norm hidden state at `i` and the
//! token after it, and predicts `t_{i+2}`. A round whose anchor token `t_P` sits at position P
//! (the history's last token, not yet processed by the target) drafts
//!
//! ```text
//! step 0:  row P-1 from (h_{P-1}, t_P)               -> d_1     a true row: kept
//! step j:  row P-1+j from (chain(o_{j-1}), d_j)      -> d_{j+1} a chained row: dropped later
//! ```
//!
//! Commit needs no work of its own: the next round first drops the chained rows, then builds
//! every true row it lacks, `(h_i, t_{i+1})` for i up to its own P − 1, in one forward whose
//! last row is its step 0. The hidden states arrive as taps (every verified position exactly
//! once, plain rounds included), so after each round the cache holds exactly the rows a plain
//! pass of the row over the accepted text would hold (mtp.md §2.6, vLLM's form of the commit).

use mlx_spec_plugin_api::mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_spec_plugin_api::mlx_rs::ops::{concatenate, softmax_axis};
use mlx_spec_plugin_api::mlx_rs::{random, Array, Dtype};

use crate::cache::RowCache;
use crate::config::ChainHidden;
use crate::linear::mlx_err;
use crate::row::{MtpRow, RowOutput};

/// What a round reads from the target: its embeddings `[.., rows, H]` of tokens, and its
/// float32 logits `[rows, vocab]` of head inputs (LM head and soft-cap).
pub trait TargetPorts {
    fn embed(&self, ids: &[u32]) -> Result<Array, String>;
    fn logits(&self, head_in: &Array) -> Result<Array, String>;
}

/// How each step's token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    /// The argmax; proposals go without distributions (verified by token match).
    Greedy,
    /// The argmax while its probability under the row is at least `min_probability`.
    GreedyWhileConfident { min_probability: f32 },
    /// Drawn from `softmax(logits / temperature)`, keyed by the request's seed and the draft's
    /// emitted index; the distributions go with the proposal (rejection sampling).
    Sampled {
        temperature: f32,
        seed: u64,
        first_index: u64,
    },
}

/// A round's drafts.
pub struct Drafts {
    pub tokens: Vec<u32>,
    /// With [`Choice::Sampled`]: float32 `[tokens, vocab]`.
    pub probs: Option<Array>,
}

/// One draft step's own row, for tests that compare every intermediate.
pub struct Step {
    pub output: RowOutput,
    /// float32 `[1, vocab]`, from the target's LM head.
    pub logits: Array,
}

pub struct Rounds {
    pub cache: RowCache,
    /// The cache's rows built from the target's own hidden states; rows after them are the
    /// last round's chained rows.
    true_rows: usize,
    /// Hidden states `[rows, H]` of positions whose rows are not built yet, and the first
    /// position.
    waiting: Option<(u64, Array)>,
    kv_prefill: bool,
    chain_hidden: ChainHidden,
    started: bool,
}

impl Rounds {
    pub fn new(kv_prefill: bool, chain_hidden: ChainHidden) -> Self {
        Rounds {
            cache: RowCache::default(),
            true_rows: 0,
            waiting: None,
            kv_prefill,
            chain_hidden,
            started: false,
        }
    }

    /// The target's final-norm hidden states `[rows, H]` of positions `first_position..`,
    /// delivered in order (the prompt, then each round's verified positions).
    pub fn receive(&mut self, first_position: u64, hiddens: Array) -> Result<(), String> {
        let e = mlx_err("keeping hidden states");
        let rows = hiddens.shape()[0] as u64;
        if rows == 0 {
            return Ok(());
        }
        if !self.started {
            self.started = true;
            // Without prefill the cache starts with the prompt's last position, step 0 of the
            // first round.
            let (first, hiddens) = if self.kv_prefill {
                (first_position, hiddens)
            } else {
                let last = rows as i32 - 1;
                (first_position + rows - 1, hiddens.index(last..))
            };
            self.cache.start_at(first);
            self.waiting = Some((first, hiddens));
            return Ok(());
        }
        let expected = match &self.waiting {
            Some((first, w)) => first + w.shape()[0] as u64,
            None => self.cache.first_position() + self.true_rows as u64,
        };
        if first_position != expected {
            return Err(format!(
                "hidden states of position {first_position} arrived where {expected} was next: the host must deliver every verified position once, in order"
            ));
        }
        self.waiting = Some(match self.waiting.take() {
            None => (first_position, hiddens),
            Some((first, w)) => (first, concatenate(&[w, hiddens], 0).map_err(e)?),
        });
        Ok(())
    }

    /// Up to `n` drafts after `history` (its last token is the anchor, at position
    /// `history.len() - 1`); `inspect` sees every step's row (tests).
    pub fn draft(
        &mut self,
        row: &MtpRow,
        history: &[u32],
        n: usize,
        choice: Choice,
        target: &impl TargetPorts,
        mut inspect: impl FnMut(&Step),
    ) -> Result<Drafts, String> {
        let e = mlx_err("MTP draft round");
        let mut tokens = Vec::with_capacity(n);
        if n == 0 || history.is_empty() {
            return Ok(Drafts {
                tokens,
                probs: None,
            });
        }
        let p = history.len() as u64 - 1;
        // Last round's chained rows go; the true rows this round lacks are built at once.
        self.cache.truncate(self.true_rows);
        let start = self.cache.next_position();
        let Some((first, hiddens)) = self.waiting.take() else {
            return Err(format!(
                "no hidden state of position {} has arrived: the host delivers the prompt's taps before prefill and each round's before commit",
                p.saturating_sub(1)
            ));
        };
        let rows = hiddens.shape()[0] as u64;
        if first != start || first + rows != p {
            return Err(format!(
                "hidden states of positions {first}..{} are waiting, but the round at position {p} needs {start}..{p}",
                first + rows
            ));
        }
        let feed = &history[start as usize + 1..=p as usize];
        let built = row.forward(&target.embed(feed)?, &hiddens, &mut self.cache)?;
        self.true_rows += rows as usize;
        let last = rows as i32 - 1;
        let mut output = RowOutput {
            eh_out: built.eh_out.index(last..),
            block_out: built.block_out.index(last..),
            head_in: built.head_in.index(last..),
        };
        let mut probs = Vec::new();
        for j in 0..n {
            let step_logits = target.logits(&output.head_in)?;
            let step = Step {
                output,
                logits: step_logits,
            };
            let token = match choice {
                Choice::Greedy => argmax(&step.logits)?,
                Choice::GreedyWhileConfident { min_probability } => {
                    let token = argmax(&step.logits)?;
                    let q = softmax_axis(&step.logits, -1, true).map_err(&e)?;
                    let probability = q
                        .index((.., token as i32))
                        .try_item_cast::<f32>()
                        .map_err(|err| format!("reading a draft's probability: {err}"))?;
                    if probability < min_probability {
                        inspect(&step);
                        break;
                    }
                    token
                }
                Choice::Sampled {
                    temperature,
                    seed,
                    first_index,
                } => {
                    let scaled = step
                        .logits
                        .multiply(Array::from_f32(1.0 / temperature))
                        .and_then(|l| l.reshape(&[1, -1]))
                        .map_err(&e)?;
                    probs.push(softmax_axis(&scaled, -1, true).map_err(&e)?);
                    let key = random::key(draft_key(seed, first_index + j as u64)).map_err(&e)?;
                    random::categorical(&scaled, -1, None, &key)
                        .and_then(|t| t.as_dtype(Dtype::Uint32))
                        .map_err(&e)?
                        .try_item_cast::<u32>()
                        .map_err(|err| format!("reading a sampled draft: {err}"))?
                }
            };
            inspect(&step);
            tokens.push(token);
            if j + 1 == n {
                break;
            }
            let hidden = match self.chain_hidden {
                ChainHidden::PreNorm => &step.output.block_out,
                ChainHidden::PostNorm => &step.output.head_in,
            };
            output = row.forward(&target.embed(&[token])?, hidden, &mut self.cache)?;
        }
        let probs = if probs.is_empty() {
            None
        } else {
            Some(concatenate(&probs, 0).map_err(&e)?)
        };
        Ok(Drafts { tokens, probs })
    }
}

fn argmax(logits: &Array) -> Result<u32, String> {
    argmax_axis(logits, -1, false)
        .and_then(|t| t.as_dtype(Dtype::Uint32))
        .map_err(mlx_err("picking a draft"))?
        .try_item_cast::<u32>()
        .map_err(|e| format!("reading a draft token: {e}"))
}

/// The random key of the draft at emitted index `index`: splitmix64 of the seed, a constant of
/// this drafter's own (so draws never coincide with the host's verification coin, keyed by the
/// same seed and index) and the index.
pub fn draft_key(seed: u64, index: u64) -> u64 {
    const SALT: u64 = 0x676C_6D2D_6D74_7000; // "glm-mtp"
    mlx_spec_plugin_api::draft_key(SALT, seed, index)
}
