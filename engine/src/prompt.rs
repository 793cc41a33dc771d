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
