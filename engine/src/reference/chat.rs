//! The chat renderer SmolLM2's engines share: its tokenizer and chat template, read from the
//! GGUF's metadata (no weights), and the tokenization memo. The reference engine renders
//! with it, and so does a vLLM upstream serving the same model ([`crate::vllm`]): keys are
//! over token ids, so both must produce the same ones.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file;

use super::template::{ChatTemplate, Piece};
use super::tokenizer::GgufTokenizer;
use super::{MODEL_SHA256, hex_digest, missing};
use crate::memo::SegmentMemo;
use crate::{EngineError, ModelInfo, Prompt, Rendered};

pub struct ChatRenderer {
    tokenizer: Arc<GgufTokenizer>,
    template: ChatTemplate,
    memo: SegmentMemo,
}

impl ChatRenderer {
    /// From an opened model file's metadata.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self, EngineError> {
        let tokenizer = GgufTokenizer::from_gguf(content)?;
        let template_src = match content.metadata.get("tokenizer.chat_template") {
            Some(gguf_file::Value::String(s)) => s.clone(),
            _ => {
                return Err(EngineError::Internal(
                    "model file has no chat template".into(),
                ));
            }
        };
        Ok(Self {
            tokenizer: Arc::new(tokenizer),
            template: ChatTemplate::new(&template_src)?,
            memo: SegmentMemo::new(crate::memo::MODEL_MEMO_BYTES),
        })
    }

    /// From the model file at `path`, verified by SHA-256; its weights are not read.
    pub fn load(path: &Path) -> Result<Self, EngineError> {
        let bytes =
            std::fs::read(path).map_err(|e| missing(path, &format!("cannot be read ({e})")))?;
        let digest = hex_digest(&bytes);
        drop(bytes);
        if digest != MODEL_SHA256 {
            return Err(missing(
                path,
                &format!("is corrupt (SHA-256 {digest}, expected {MODEL_SHA256})"),
            ));
        }
        let mut file = std::fs::File::open(path).map_err(|e| missing(path, &e.to_string()))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| missing(path, &format!("is not GGUF ({e})")))?;
        Self::from_gguf(&content)
    }

    pub fn tokenizer(&self) -> &GgufTokenizer {
        &self.tokenizer
    }

    pub fn tokenizer_arc(&self) -> Arc<GgufTokenizer> {
        self.tokenizer.clone()
    }

    /// Render tools → system → messages through the chat template, with the offset at the
    /// end of every content block; refuses a prompt longer than `info`'s context.
    pub fn render(&self, prompt: &Prompt, info: &ModelInfo) -> Result<Rendered, EngineError> {
        prompt.check_fits(info)?;
        let pieces = self.template.render(prompt)?;
        // Block n → (which list, index) in tools → system → messages order.
        let mut texts: Vec<&str> = Vec::new();
        let mut slots: Vec<(u8, usize, usize)> = Vec::new();
        for (i, t) in prompt.tools.iter().enumerate() {
            texts.push(t);
            slots.push((0, i, 0));
        }
        for (i, s) in prompt.system.iter().enumerate() {
            texts.push(s);
            slots.push((1, i, 0));
        }
        for (m, msg) in prompt.messages.iter().enumerate() {
            for (j, b) in msg.blocks.iter().enumerate() {
                texts.push(b);
                slots.push((2, m, j));
            }
        }
        let mut r = Rendered {
            tokens: Vec::new(),
            tool_ends: vec![0; prompt.tools.len()],
            system_ends: vec![0; prompt.system.len()],
            message_ends: prompt
                .messages
                .iter()
                .map(|m| vec![0; m.blocks.len()])
                .collect(),
        };
        let encode = |s: &str| self.tokenizer.encode(s);
        for p in pieces {
            match p {
                Piece::Framing(s) => {
                    r.tokens
                        .extend_from_slice(&self.memo.tokens(prompt.memo_scope, &s, encode))
                }
                Piece::Block(n) => {
                    let text = texts
                        .get(n)
                        .ok_or_else(|| EngineError::Internal("template lost a block".into()))?;
                    r.tokens
                        .extend_from_slice(&self.memo.tokens(prompt.memo_scope, text, encode));
                    let end = r.tokens.len();
                    match slots[n] {
                        (0, i, _) => r.tool_ends[i] = end,
                        (1, i, _) => r.system_ends[i] = end,
                        (_, m, j) => r.message_ends[m][j] = end,
                    }
                }
            }
        }
        if r.tokens.len() > info.context_window {
            return Err(EngineError::ContextTooLong {
                tokens: r.tokens.len(),
                limit: info.context_window,
            });
        }
        Ok(r)
    }
}
