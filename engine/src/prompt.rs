//! The engine-neutral prompt: what the gateway hands an engine to render.

/// A conversation role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
}

/// One message: its content blocks, each already reduced to text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptMessage {
    pub role: Role,
    pub blocks: Vec<String>,
}

/// Tools → system → messages, each content block as text (`cache_control` never included).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prompt {
    pub tools: Vec<String>,
    pub system: Vec<String>,
    pub messages: Vec<PromptMessage>,
    /// Whose tokenization memo this render uses (the tenant): text one tenant sent never
    /// makes another tenant's render faster.
    pub memo_scope: u128,
}

impl Prompt {
    /// Bytes of text in every block (the template's framing not included).
    pub fn text_bytes(&self) -> usize {
        let blocks = self.messages.iter().flat_map(|m| m.blocks.iter());
        self.tools
            .iter()
            .chain(&self.system)
            .chain(blocks)
            .map(String::len)
            .sum()
    }

    /// Refuse, before any tokenizing, a prompt whose text cannot fit `info`'s context
    /// window however it tokenizes (each token covers at most `max_token_bytes` bytes).
    pub fn check_fits(&self, info: &crate::ModelInfo) -> Result<(), crate::EngineError> {
        let bytes = self.text_bytes();
        let min_tokens = bytes / info.max_token_bytes.max(1);
        if min_tokens > info.context_window {
            return Err(crate::EngineError::PromptTooLarge {
                bytes,
                min_tokens,
                limit: info.context_window,
            });
        }
        Ok(())
    }
}

/// A rendered prompt: token ids and the token offset at the end of every content block.
///
/// Every content block is tokenized on its own, so each block end is a token boundary and
/// the same block text always yields the same tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rendered {
    pub tokens: Vec<u32>,
    pub tool_ends: Vec<usize>,
    pub system_ends: Vec<usize>,
    /// `message_ends[m][b]`: end offset of block `b` of message `m`.
    pub message_ends: Vec<Vec<usize>>,
}
