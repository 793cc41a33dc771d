//! `max_tokens` and `stop_sequences` over any [`Generation`], producing text deltas.
//!
//! Text that could be the start of a stop sequence is held back until it is known not to
//! be one, so a streamed response never shows part of a stop sequence.

use crate::{EngineError, Generation, StopReason};

/// Text produced by one step (possibly empty while text is held back).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    pub text: String,
}

pub struct TextStream {
    generation: Box<dyn Generation>,
    max_tokens: u32,
    produced: u32,
    stops: Vec<String>,
    pending: String,
    finished: Option<StopReason>,
}

impl TextStream {
    pub fn new(
        generation: Box<dyn Generation>,
        max_tokens: u32,
        stop_sequences: Vec<String>,
    ) -> Self {
        let stops = stop_sequences
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        Self {
            generation,
            max_tokens,
            produced: 0,
            stops,
            pending: String::new(),
            finished: None,
        }
    }

    /// Tokens generated so far (the billed output tokens).
    pub fn output_tokens(&self) -> u32 {
        self.produced
    }

    /// Why the stream ended, once it has.
    pub fn stop_reason(&self) -> Option<&StopReason> {
        self.finished.as_ref()
    }

    /// The next piece of text, or `None` once finished.
    pub fn next_delta(&mut self) -> Result<Option<Delta>, EngineError> {
        if self.finished.is_some() {
            return Ok(None);
        }
        if self.produced >= self.max_tokens {
            return Ok(Some(self.finish(StopReason::MaxTokens)));
        }
        let Some(tok) = self.generation.next_token()? else {
            return Ok(Some(self.finish(StopReason::EndTurn)));
        };
        self.produced += 1;
        self.pending.push_str(&tok.text);
        if let Some((idx, stop)) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|i| (i, s.clone())))
            .min_by_key(|(i, _)| *i)
        {
            self.pending.truncate(idx);
            return Ok(Some(self.finish(StopReason::StopSequence(stop))));
        }
        let hold = self.held_back_len();
        let emit_to = self.pending.len() - hold;
        let text: String = self.pending.drain(..emit_to).collect();
        Ok(Some(Delta { text }))
    }

    fn finish(&mut self, reason: StopReason) -> Delta {
        self.finished = Some(reason);
        Delta {
            text: std::mem::take(&mut self.pending),
        }
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop sequence.
    fn held_back_len(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            for (i, _) in self.pending.char_indices() {
                let suffix = &self.pending[i..];
                if suffix.len() < s.len() && s.starts_with(suffix) {
                    best = best.max(suffix.len());
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvBlock, Token};

    struct Words(Vec<&'static str>);
    impl Generation for Words {
        fn take_exports(&mut self) -> Vec<KvBlock> {
            Vec::new()
        }
        fn next_token(&mut self) -> Result<Option<Token>, EngineError> {
            Ok(if self.0.is_empty() {
                None
            } else {
                Some(Token {
                    id: 0,
                    text: self.0.remove(0).to_string(),
                })
            })
        }
    }

    fn run(words: Vec<&'static str>, max: u32, stops: &[&str]) -> (String, StopReason, u32) {
        let mut s = TextStream::new(
            Box::new(Words(words)),
            max,
            stops.iter().map(|s| s.to_string()).collect(),
        );
        let mut out = String::new();
        while let Some(d) = s.next_delta().unwrap() {
            out.push_str(&d.text);
        }
        (out, s.stop_reason().unwrap().clone(), s.output_tokens())
    }

    #[test]
    fn stops_at_end_of_turn_and_max_tokens() {
        assert_eq!(
            run(vec!["a", " b"], 10, &[]),
            ("a b".into(), StopReason::EndTurn, 2)
        );
        assert_eq!(
            run(vec!["a", " b", " c"], 2, &[]),
            ("a b".into(), StopReason::MaxTokens, 2)
        );
        assert_eq!(
            run(vec!["a"], 0, &[]),
            ("".into(), StopReason::MaxTokens, 0)
        );
    }

    #[test]
    fn stop_sequence_spanning_tokens_is_cut_and_never_shown() {
        let (text, reason, n) = run(vec!["hello", " wor", "ld", " again"], 10, &["world"]);
        assert_eq!(text, "hello ");
        assert_eq!(reason, StopReason::StopSequence("world".into()));
        assert_eq!(n, 3);
    }

    #[test]
    fn held_back_text_is_released_when_it_is_not_a_stop() {
        let (text, reason, _) = run(vec!["wo", "w"], 10, &["world"]);
        assert_eq!((text.as_str(), reason), ("wow", StopReason::EndTurn));
    }
}
