//! From a validated request to tokens, breakpoint offsets and block keys.
//!
//! Each content block becomes one text segment (tool definitions as canonical JSON); the
//! `cache_control` markers are never part of the text, so moving a marker changes no token
//! and no hash.

use cache_fabric::{KeySpace, PrefixKeys};
use cachet_common::Scope;
use engine::{Engine, EngineError, Prompt, PromptMessage, Rendered, Role};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::usage::{self, Placed};
use crate::wire::types::{
    ContentBlock, InputMessage, MessageContent, MessageRole, SystemPrompt, Tool,
};
use crate::wire::validate::Breakpoint;

fn tool_text(t: &Tool) -> String {
    json!({"name": t.name, "description": t.description, "input_schema": t.input_schema})
        .to_string()
}

fn block_text(b: &ContentBlock) -> String {
    match b {
        ContentBlock::Text { text, .. } => text.clone(),
        ContentBlock::ToolUse {
            id, name, input, ..
        } => json!({"type": "tool_use", "id": id, "name": name, "input": input}).to_string(),
        ContentBlock::ToolResult {
            tool_use_id,
            content,
            is_error,
            ..
        } => {
            let text = match content {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(items)) => items
                    .iter()
                    .filter_map(|i| i.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            json!({"type": "tool_result", "tool_use_id": tool_use_id, "is_error": is_error.unwrap_or(false), "content": text})
                .to_string()
        }
        ContentBlock::Thinking { thinking, .. } => thinking.clone(),
        ContentBlock::RedactedThinking { data } => data.clone(),
    }
}

/// The engine-neutral prompt of a request.
pub fn to_prompt(
    tools: Option<&[Tool]>,
    system: Option<&SystemPrompt>,
    messages: &[InputMessage],
    scope: Scope,
) -> Prompt {
    Prompt {
        // Workspace ids are unique across tenants: a memo scoped by workspace is scoped by
        // tenant too, like the cache itself.
        memo_scope: scope.workspace.as_uuid().as_u128(),
        tools: tools.unwrap_or_default().iter().map(tool_text).collect(),
        system: match system {
            None => Vec::new(),
            Some(SystemPrompt::Text(s)) => vec![s.clone()],
            Some(SystemPrompt::Blocks(b)) => b.iter().map(|b| b.text.clone()).collect(),
        },
        messages: messages
            .iter()
            .map(|m| PromptMessage {
                role: if m.role == MessageRole::User {
                    Role::User
                } else {
                    Role::Assistant
                },
                blocks: match &m.content {
                    MessageContent::Text(s) => vec![s.clone()],
                    MessageContent::Blocks(bs) => bs.iter().map(block_text).collect(),
                },
            })
            .collect(),
    }
}

pub fn render_error(e: EngineError) -> ApiError {
    ApiError::from_service("render failed", &e)
}

/// A rendered request, ready for the fabric and the engine.
pub struct Prepared {
    pub rendered: Rendered,
    pub placed: Vec<Placed>,
    /// Keys up to the last cacheable breakpoint; `None` when nothing is cacheable.
    pub keys: Option<PrefixKeys>,
    pub upto: usize,
}

/// Render, place breakpoints and compute block keys. CPU work: call off the async runtime.
pub fn prepare(
    engine: &dyn Engine,
    prompt: &Prompt,
    bps: &[Breakpoint],
    scope: Scope,
) -> Result<Prepared, ApiError> {
    let info = engine.info();
    let rendered = engine.render(prompt).map_err(render_error)?;
    let placed = usage::place(bps, &rendered, info.min_cacheable_tokens);
    let upto = placed
        .iter()
        .filter(|p| p.cacheable)
        .map(|p| p.offset)
        .max()
        .unwrap_or(0);
    let keys = (upto > 0).then(|| {
        let ks = KeySpace::new(
            scope,
            &info.id,
            &info.adapter_id,
            info.key_dtype(),
            info.block_size,
        );
        ks.prefix_keys(&rendered.tokens, upto, &usage::boundaries(&rendered, upto))
    });
    Ok(Prepared {
        rendered,
        placed,
        keys,
        upto,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::validate::{self, ModelLimits};
    use cachet_common::{TenantId, WorkspaceId};
    use engine::sim::{SimEngine, SimProfile};
    use proptest::prelude::*;
    use serde_json::json;

    fn prepared(body: &serde_json::Value, scope: Scope) -> Prepared {
        let (req, bps) = validate::messages_request(body.to_string().as_bytes(), |_| {
            Some(ModelLimits {
                max_output_tokens: 4096,
            })
        })
        .unwrap();
        let engine = SimEngine::new(SimProfile::tiny(), 0.0);
        let prompt = to_prompt(
            req.tools.as_deref(),
            req.system.as_ref(),
            &req.messages,
            scope,
        );
        prepare(&engine, &prompt, &bps, scope).unwrap()
    }

    proptest! {
        /// Markers are not part of the rendered text: wherever they sit, the tokens and the
        /// block hashes of the common prefix are the same.
        #[test]
        fn moving_markers_changes_no_token_and_no_hash(marks in proptest::collection::vec(any::<bool>(), 4)) {
            let scope = Scope { tenant: TenantId::new(), workspace: WorkspaceId::new() };
            let text = |p: &str| (0..20).map(|i| format!("{p}{i} ")).collect::<String>();
            let block = |t: String, m: bool| if m {
                json!({"type": "text", "text": t, "cache_control": {"type": "ephemeral"}})
            } else {
                json!({"type": "text", "text": t})
            };
            let body = |m: &[bool]| json!({
                "model": "sim-tiny", "max_tokens": 8,
                "system": [block(text("a"), m[0]), block(text("b"), m[1])],
                "messages": [
                    {"role": "user", "content": [block(text("c"), m[2])]},
                    {"role": "assistant", "content": [block(text("d"), m[3])]},
                    {"role": "user", "content": [block(text("e"), true)]}
                ]
            });
            // At most 3 optional markers besides the last message's: the limit is 4.
            let mut marks = marks;
            if marks.iter().all(|&m| m) {
                marks[0] = false;
            }
            let marked = prepared(&body(&marks), scope);
            let plain = prepared(&body(&[false; 4]), scope);
            prop_assert_eq!(&marked.rendered.tokens, &plain.rendered.tokens);
            // Both end at the last message's marker, so both key the same prefix.
            prop_assert_eq!(marked.upto, plain.upto);
            prop_assert_eq!(&marked.keys.as_ref().unwrap().blocks, &plain.keys.as_ref().unwrap().blocks);
        }
    }
}
