//! A Messages (and count_tokens) request body, as a client could send it: validation either
//! refuses it with a 4xx in the API's error shape or accepts it, and an accepted request
//! renders into a prompt, its breakpoints placed and its cache keys derived, without a panic.

#![no_main]

use std::sync::OnceLock;

use cachet_common::{Scope, TenantId, WorkspaceId};
use engine::Engine;
use engine::Prompt;
use engine::sim::{SimEngine, SimProfile};
use gateway::wire::validate::{self, Breakpoint, ModelLimits};
use gateway::error::ApiError;
use libfuzzer_sys::fuzz_target;

fn engine() -> &'static SimEngine {
    static E: OnceLock<SimEngine> = OnceLock::new();
    E.get_or_init(|| SimEngine::new(SimProfile::tiny(), 0.0))
}

fuzz_target!(|data: &[u8]| {
    let engine = engine();
    let limits = |_: &str| {
        Some(ModelLimits {
            max_output_tokens: engine.info().max_output_tokens,
        })
    };
    let scope = Scope {
        tenant: TenantId(uuid::Uuid::from_u128(1)),
        workspace: WorkspaceId(uuid::Uuid::from_u128(2)),
    };
    // Accepted: the request renders, or is refused with a 4xx. Refused: with a 4xx.
    let check = |parts: Result<(Prompt, Vec<Breakpoint>), ApiError>| match parts {
        Ok((p, bps)) => {
            if let Err(e) = gateway::render::prepare(engine, &p, &bps, scope) {
                assert!(e.status().is_client_error(), "{e:?}");
            }
        }
        Err(e) => assert!(e.status().is_client_error(), "{e:?}"),
    };
    let prompt = |tools: Option<&[_]>, system: Option<&_>, messages: &[_]| {
        gateway::render::to_prompt(tools, system, messages, scope)
    };
    check(validate::messages_request(data, limits).map(|(r, bps)| {
        (
            prompt(r.tools.as_deref(), r.system.as_ref(), &r.messages),
            bps,
        )
    }));
    check(
        validate::count_tokens_request(data, |m| m == "sim-tiny").map(|(r, bps)| {
            (
                prompt(r.tools.as_deref(), r.system.as_ref(), &r.messages),
                bps,
            )
        }),
    );
});
