//! Tokens to text for a response: streaming detokenization and stop strings.
//!
//! Text that could be the start of a stop string is held back until the next tokens show it
//! is not, so no stream ever sends text past a stop string; the stop string itself is not
//! sent (as OpenAI's API has it).

use anyhow::Result;

use crate::tokenizer::{StreamDecoder, Tokenizer};

/// The text of one response so far.
pub struct TextAssembler {
    decoder: StreamDecoder,
    stops: Vec<String>,
    /// Everything decoded so far.
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    /// Set once a stop string was found: the text ends here.
    stopped: bool,
}

impl TextAssembler {
    pub fn new(stops: Vec<String>) -> TextAssembler {
        TextAssembler {
            decoder: StreamDecoder::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            sent: 0,
            stopped: false,
        }
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds a token; returns the token's own decoded piece (for per-token displays) and the
    /// text that may be sent now.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<(String, String)> {
        if self.stopped {
            return Ok((String::new(), String::new()));
        }
        let piece = self.decoder.push(tok, id)?;
        self.text.push_str(&piece);
        Ok((piece, self.release(false)))
    }

    /// Ends the text: whatever was held back (bytes of an unfinished character, a possible
    /// start of a stop string) goes out, up to a stop string.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        if !self.stopped {
            let rest = self.decoder.finish(tok)?;
            self.text.push_str(&rest);
        }
        Ok(self.release(true))
    }

    /// The whole text handed out.
    pub fn sent_text(&self) -> &str {
        &self.text[..self.sent]
    }

    fn release(&mut self, last: bool) -> String {
        if self.stopped {
            return String::new();
        }
        // A stop string may have begun in text not yet sent.
        let search_from = self.sent;
        let found = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|at| search_from + at)
            })
            .min();
        let end = match found {
            Some(at) => {
                self.stopped = true;
                at
            }
            None if last => self.text.len(),
            None => self.text.len() - self.held_back(),
        };
        let out = self.text[self.sent..end].to_owned();
        self.sent = end;
        if self.stopped {
            self.text.truncate(end);
        }
        out
    }

    /// Bytes at the end of the text that begin some stop string.
    fn held_back(&self) -> usize {
        let unsent = &self.text[self.sent..];
        let mut longest = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                let prefix = &s[..i];
                if i > longest && unsent.ends_with(prefix) {
                    longest = i;
                }
            }
        }
        longest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives `release` directly with text pieces (no tokenizer needed).
    fn feed(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let mut a = TextAssembler::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            a.text.push_str(p);
            out.push(a.release(false));
        }
        out.push(a.release(true));
        (out, a.stopped(), a.sent_text().to_owned())
    }

    #[test]
    fn stop_strings_end_the_text_and_are_not_sent() {
        let (out, stopped, all) = feed(&["\n\n"], &["def f", "():\n", "\n    x"]);
        assert!(stopped);
        assert_eq!(all, "def f():");
        // The lone newline was held back until the next piece showed the stop string.
        assert_eq!(out[1], "():");
        assert_eq!(out.concat(), "def f():");
    }

    #[test]
    fn a_possible_start_is_held_back_then_released() {
        let (out, stopped, all) = feed(&["END"], &["abc E", "N", "x", " done"]);
        assert!(!stopped);
        assert_eq!(out, vec!["abc ", "", "ENx", " done", ""]);
        assert_eq!(all, "abc ENx done");
        // At the end, a held-back prefix goes out.
        let (out, stopped, _) = feed(&["END"], &["abc EN"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "abc EN");
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins_and_unicode_is_respected() {
        let (_, stopped, all) = feed(&["é!", "b"], &["aé", "!b"]);
        assert!(stopped);
        assert_eq!(all, "a");
        let (_, stopped, all) = feed(&[], &["x", "y"]);
        assert!(!stopped);
        assert_eq!(all, "xy");
    }
}
