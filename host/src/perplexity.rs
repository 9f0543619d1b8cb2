//! Perplexity of text under a loaded model: how well a checkpoint (or a quantization of it)
//! predicts real files.
//!
//! Each file is tokenized with one leading BOS and cut into chunks of at most `context`
//! predicted tokens. A chunk starts from a fresh cache at the token before its first target
//! (BOS for the first chunk), so every token after BOS is predicted exactly once, from at most
//! `context` tokens of its own file. Nothing is appended after the text (no EOS).
//! Within a chunk the tokens go through the model in blocks of [`BLOCK`] positions with the
//! cache carried over, the same chunked prefill generation uses, so a long context needs only
//! one block of logits in memory.

use anyhow::{bail, Context, Result};
use mlx_rs::Dtype;

use crate::model::gemma4::{Gemma4Model, LogitsFor};

/// Positions per forward inside one chunk.
pub const BLOCK: usize = 512;

/// The negative log-likelihood of one sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Nll {
    /// Sum over predicted tokens, in nats.
    pub nats: f64,
    /// Predicted tokens (every token but the first).
    pub tokens: usize,
}

impl Nll {
    /// Nats per predicted token (0 when nothing was predicted).
    pub fn per_token(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.nats / self.tokens as f64
        }
    }

    /// `exp(nats per token)`.
    pub fn perplexity(&self) -> f64 {
        self.per_token().exp()
    }

    /// The two summed.
    pub fn add(&mut self, other: Nll) {
        self.nats += other.nats;
        self.tokens += other.tokens;
    }
}

/// The context a model serves: `max_position_embeddings` of its config.json, if any.
pub fn served_context(config_json: &serde_json::Value) -> Option<usize> {
    let text = config_json.get("text_config").unwrap_or(config_json);
    text.get("max_position_embeddings")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
}

/// `-log p(ids[i] | ids[..i])` summed over `i >= 1`, in chunks of at most `context` targets.
pub fn sequence_nll(model: &Gemma4Model, ids: &[u32], context: usize) -> Result<Nll> {
    if context == 0 {
        bail!("the context must hold at least one token");
    }
    let mut total = Nll {
        nats: 0.0,
        tokens: 0,
    };
    if ids.len() < 2 {
        return Ok(total);
    }
    let targets = ids.len() - 1;
    let mut first = 0;
    while first < targets {
        let n = context.min(targets - first);
        // Inputs ids[first .. first + n], targets ids[first + 1 ..= first + n].
        total.add(chunk_nll(model, &ids[first..first + n + 1])?);
        first += n;
    }
    Ok(total)
}

/// NLL of `chunk[1..]` given the tokens before each, from a fresh cache.
fn chunk_nll(model: &Gemma4Model, chunk: &[u32]) -> Result<Nll> {
    let inputs = &chunk[..chunk.len() - 1];
    let mut cache = model.new_cache();
    let mut nll = Nll {
        nats: 0.0,
        tokens: 0,
    };
    let vocab = model.config.vocab_size;
    for (b, block) in inputs.chunks(BLOCK).enumerate() {
        let out = model.forward(block, &mut cache, LogitsFor::All, false)?;
        let logits = out.logits.as_dtype(Dtype::Float32)?;
        logits.eval()?;
        let values = logits.as_slice::<f32>();
        if values.len() != block.len() * vocab {
            bail!(
                "the model returned {} logits for {} positions of a {vocab}-token vocabulary",
                values.len(),
                block.len()
            );
        }
        for (i, row) in values.chunks(vocab).enumerate() {
            let target = chunk[b * BLOCK + i + 1] as usize;
            nll.nats += neg_log_softmax(row, target);
            nll.tokens += 1;
        }
    }
    Ok(nll)
}

/// `logsumexp(row) - row[target]`, accumulated in f64.
fn neg_log_softmax(row: &[f32], target: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln() - row[target] as f64
}

/// One text file's result.
#[derive(Debug, Clone)]
pub struct FileNll {
    pub path: String,
    pub nll: Nll,
}

/// Tokenizes `text` (one leading BOS) and scores it; `what` names it in errors.
pub fn text_nll(
    model: &Gemma4Model,
    tokenizer: &crate::tokenizer::Tokenizer,
    text: &str,
    context: usize,
    what: &str,
) -> Result<Nll> {
    let ids = tokenizer
        .encode_prompt(text)
        .with_context(|| format!("cannot tokenize {what}"))?;
    sequence_nll(model, &ids, context).with_context(|| format!("scoring {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neg_log_softmax_is_the_cross_entropy() {
        let row = [1.0f32, 2.0, 3.0];
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        for (t, &x) in row.iter().enumerate() {
            let want = -((x as f64).exp() / z).ln();
            assert!((neg_log_softmax(&row, t) - want).abs() < 1e-12);
        }
        // Large logits do not overflow.
        assert!(neg_log_softmax(&[1000.0, 0.0], 0) < 1e-12);
    }

    #[test]
    fn served_context_reads_the_text_config() {
        let flat = serde_json::json!({"max_position_embeddings": 8192});
        assert_eq!(served_context(&flat), Some(8192));
        let nested = serde_json::json!({"text_config": {"max_position_embeddings": 131072}});
        assert_eq!(served_context(&nested), Some(131072));
        assert_eq!(served_context(&serde_json::json!({})), None);
    }

    #[test]
    fn totals_add_and_average() {
        let mut a = Nll {
            nats: 3.0,
            tokens: 2,
        };
        a.add(Nll {
            nats: 1.0,
            tokens: 2,
        });
        assert_eq!(a.tokens, 4);
        assert!((a.per_token() - 1.0).abs() < 1e-12);
        assert!((a.perplexity() - std::f64::consts::E).abs() < 1e-12);
    }
}
