//! The model's chat template (`tokenizer.chat_template` in the GGUF), rendered with a real
//! Jinja engine, split into framing text and content blocks.
//!
//! Each content block goes through the template as a sentinel; the rendered text is then cut
//! at the sentinels, so framing (role headers, special tokens) and each block are tokenized
//! separately (docs/decisions/0001) and every block end is an exact token offset.

use minijinja::{Environment, context};

use crate::EngineError;
use crate::prompt::{Prompt, Role};

const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

/// One piece of the rendered prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Template text (may contain special tokens).
    Framing(String),
    /// Content block `n` in tools → system → messages order.
    Block(usize),
}

#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
}

fn sentinel(n: usize) -> String {
    format!("{OPEN}{n}{CLOSE}")
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<Self, EngineError> {
        let mut env = Environment::new();
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| EngineError::Internal(format!("chat template does not compile: {e}")))?;
        Ok(Self { env })
    }

    /// Render the prompt; tools and system blocks form one system message (tools first).
    /// A final assistant message is continued, not closed.
    pub fn render(&self, prompt: &Prompt) -> Result<Vec<Piece>, EngineError> {
        let mut n = 0usize;
        let mut next = || {
            let s = sentinel(n);
            n += 1;
            s
        };
        let mut messages = Vec::new();
        if !prompt.tools.is_empty() || !prompt.system.is_empty() {
            let parts: Vec<String> = prompt
                .tools
                .iter()
                .chain(&prompt.system)
                .map(|_| next())
                .collect();
            messages.push(context! { role => "system", content => parts.join("\n") });
        }
        for m in &prompt.messages {
            let parts: Vec<String> = m.blocks.iter().map(|_| next()).collect();
            let role = if m.role == Role::User {
                "user"
            } else {
                "assistant"
            };
            messages.push(context! { role => role, content => parts.join("\n") });
        }
        let continue_last = prompt
            .messages
            .last()
            .is_some_and(|m| m.role == Role::Assistant);
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        let mut text = tmpl
            .render(context! { messages => messages, add_generation_prompt => !continue_last })
            .map_err(|e| EngineError::Internal(format!("chat template failed: {e}")))?;
        if continue_last {
            // Cut after the last block: the reply continues the assistant's text.
            let last = sentinel(n - 1);
            if let Some(at) = text.rfind(&last) {
                text.truncate(at + last.len());
            }
        }
        Ok(split(&text))
    }
}

fn split(text: &str) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        if start > 0 {
            out.push(Piece::Framing(rest[..start].to_string()));
        }
        let after = &rest[start + OPEN.len_utf8()..];
        let Some(end) = after.find(CLOSE) else { break };
        if let Ok(n) = after[..end].parse() {
            out.push(Piece::Block(n));
        }
        rest = &after[end + CLOSE.len_utf8()..];
    }
    if !rest.is_empty() {
        out.push(Piece::Framing(rest.to_string()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PromptMessage;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn blocks_come_back_in_order_between_framing() {
        let t = ChatTemplate::new(CHATML).unwrap();
        let p = Prompt {
            tools: vec![],
            system: vec!["sys".into()],
            messages: vec![
                PromptMessage {
                    role: Role::User,
                    blocks: vec!["a".into(), "b".into()],
                },
                PromptMessage {
                    role: Role::Assistant,
                    blocks: vec!["c".into()],
                },
            ],
            memo_scope: 0,
        };
        let pieces = t.render(&p).unwrap();
        let blocks: Vec<usize> = pieces
            .iter()
            .filter_map(|p| {
                if let Piece::Block(n) = p {
                    Some(*n)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(blocks, vec![0, 1, 2, 3]);
        assert_eq!(pieces[0], Piece::Framing("<|im_start|>system\n".into()));
        assert_eq!(
            pieces.last(),
            Some(&Piece::Block(3)),
            "final assistant message is continued"
        );
    }
}
