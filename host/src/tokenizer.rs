//! Tokenizer (`tokenizer.json` through the `tokenizers` crate), Gemma 4's chat turn format,
//! stop tokens, and streaming detokenization.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use serde_json::Value;

/// Gemma 4's fixed special-token ids.
pub const BOS_ID: u32 = 2;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `model` (`assistant` is accepted and written as `model`).
    pub role: String,
    pub content: String,
}

/// Renders messages in Gemma 4's turn format, `<|turn>{role}\n{content}<turn|>\n` each, then
/// opens the model's turn. The BOS token is left to [`Tokenizer::encode_chat`].
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        let role = if m.role == "assistant" {
            "model"
        } else {
            m.role.as_str()
        };
        out.push_str("<|turn>");
        out.push_str(role);
        out.push('\n');
        out.push_str(m.content.trim());
        out.push_str("<turn|>\n");
    }
    out.push_str("<|turn>model\n");
    out
}

/// A loaded `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`; `Ok(None)` when the model ships without one.
    pub fn from_dir(dir: &Path, bos_id: Option<u32>) -> Result<Option<Self>> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow!("cannot load {}: {e}", path.display()))?;
        Ok(Some(Tokenizer { inner, bos_id }))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Text → ids with exactly one leading BOS (whether or not the tokenizer adds one).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenize the prompt: {e}"))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if let Some(bos) = self.bos_id {
            ids.push(bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Chat messages → ids: BOS, the rendered turns (special tokens parsed from the text),
    /// and the opened model turn.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        for marker in ["<|turn>", "<turn|>"] {
            if self.token_to_id(marker).is_none() {
                anyhow::bail!("this tokenizer has no {marker} token, so it cannot render Gemma 4 chat turns; use --prompt");
            }
        }
        self.encode_prompt(&render_chat(messages))
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("cannot detokenize: {e}"))
    }
}

/// Turns a growing token sequence into text pieces as soon as they are complete characters.
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the window re-decoded each step (a few tokens back, for context-dependent
    /// decoders such as SentencePiece's leading-space handling).
    prefix_start: usize,
    /// Tokens before this index have already been emitted as text.
    read_start: usize,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamDecoder {
    pub fn new() -> Self {
        StreamDecoder {
            ids: Vec::new(),
            prefix_start: 0,
            read_start: 0,
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix_start..self.read_start])?;
        let after = tok.decode(&self.ids[self.prefix_start..])?;
        // An incomplete UTF-8 sequence decodes to U+FFFD: wait for the rest.
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.starts_with(&before)
        {
            let piece = after[before.len()..].to_owned();
            self.prefix_start = self.read_start;
            self.read_start = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// The text of the tokens held back so far (an incomplete UTF-8 sequence at the end of a
    /// generation decodes to U+FFFD, as the whole text's decoding gives it), so that the
    /// streamed pieces add up to the decoded text.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix_start..self.read_start])?;
        let after = tok.decode(&self.ids[self.prefix_start..])?;
        self.prefix_start = self.read_start;
        self.read_start = self.ids.len();
        Ok(after
            .strip_prefix(before.as_str())
            .unwrap_or_default()
            .to_owned())
    }
}

/// Stop token ids: config.json's `eos_token_id` plus generation_config.json's, deduplicated.
pub fn stop_ids(dir: &Path, from_config: &[u32]) -> Result<Vec<u32>> {
    let mut ids = from_config.to_vec();
    let path = dir.join("generation_config.json");
    if path.exists() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let extra: Vec<u32> = match v.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|n| n as u32)
                .collect(),
            _ => Vec::new(),
        };
        for id in extra {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_turns_render_in_gemma4_format() {
        let text = render_chat(&[
            ChatMessage {
                role: "system".into(),
                content: "Be terse.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: "Hello.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Bye".into(),
            },
        ]);
        assert_eq!(
            text,
            "<|turn>system\nBe terse.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello.<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n"
        );
    }
}
