//! The SmolLM2 tokenizer, built from the GGUF's own vocabulary and merges (no tokenizer.json):
//! byte-level BPE, digits split individually, the GGUF's control tokens as special tokens.

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::EngineError;

fn strings(content: &Content, key: &str) -> Result<Vec<String>, EngineError> {
    match content.metadata.get(key) {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(EngineError::Internal(format!("{key}: expected strings"))),
            })
            .collect(),
        _ => Err(EngineError::Internal(format!("model file lacks {key}"))),
    }
}

pub fn metadata_u32(content: &Content, key: &str) -> Result<u32, EngineError> {
    content
        .metadata
        .get(key)
        .and_then(|v| v.to_u32().ok())
        .ok_or_else(|| EngineError::Internal(format!("model file lacks {key}")))
}

/// The tokenizer and its special tokens.
pub struct GgufTokenizer {
    pub inner: Tokenizer,
    pub eos_id: u32,
    /// The longest text any one token stands for, in bytes (byte-level BPE: one vocabulary
    /// character per byte).
    pub max_token_bytes: usize,
}

impl GgufTokenizer {
    pub fn from_gguf(content: &Content) -> Result<Self, EngineError> {
        let tokens = strings(content, "tokenizer.ggml.tokens")?;
        let merges = strings(content, "tokenizer.ggml.merges")?;
        let types: Vec<i64> = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.to_i32().map(i64::from).unwrap_or(1))
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let max_token_bytes = tokens.iter().map(|t| t.chars().count()).max().unwrap_or(1);
        let mut vocab = Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert(t.clone(), i as u32);
        }
        let merges: Vec<(String, String)> = merges
            .iter()
            .filter_map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
            })
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| EngineError::Internal(format!("building BPE: {e}")))?;
        let mut tk = Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        tk.with_decoder(Some(ByteLevel::default()));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == 3)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        tk.add_special_tokens(specials)
            .map_err(|e| EngineError::Internal(format!("special tokens: {e}")))?;
        let eos_id = metadata_u32(content, "tokenizer.ggml.eos_token_id")?;
        Ok(Self {
            inner: tk,
            eos_id,
            max_token_bytes,
        })
    }

    /// Token ids of `text`; special-token strings in it become their ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self.inner.encode(text, false) {
            Ok(e) => e.get_ids().to_vec(),
            // The byte-level model has no unknown input; an error here is a bug, not user input.
            Err(e) => {
                tracing::error!(error = %e, "tokenizer failed");
                Vec::new()
            }
        }
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
    }
}

/// Turns a stream of token ids into text pieces without splitting UTF-8 sequences.
#[derive(Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    emitted: usize,
}

impl IncrementalDecoder {
    pub fn push(&mut self, tk: &GgufTokenizer, id: u32) -> String {
        self.ids.push(id);
        let text = tk.decode(&self.ids);
        if text.ends_with('\u{FFFD}') || text.len() < self.emitted {
            return String::new();
        }
        let piece = text[self.emitted..].to_string();
        self.emitted = text.len();
        piece
    }
}
