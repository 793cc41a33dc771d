//! A Messages (and count_tokens) request body, as a client could send it: validation either
//! refuses it with a 4xx in the API's error shape or accepts it, and an accepted request
//! renders into a prompt, its breakpoints placed and its cache keys derived, without a panic.

#![no_main]

use std::sync::OnceLock;

use cachet_common::{Scope, TenantId, WorkspaceId};
use engine::Engine;
use engine::sim::{SimEngine, SimProfile};
use gateway::api::validate::{self, ModelLimits};
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
    match validate::messages_request(data, limits) {
        Ok((req, bps)) => {
            let p = gateway::render::to_prompt(
                req.tools.as_deref(),
                req.system.as_ref(),
                &req.messages,
                scope,
            );
            if let Err(e) = gateway::render::prepare(engine, &p, &bps, scope) {
                assert!(e.kind.status().is_client_error(), "{e:?}");
            }
        }
        Err(e) => assert!(e.kind.status().is_client_error(), "{e:?}"),
    }
    match validate::count_tokens_request(data, |m| m == "sim-tiny") {
        Ok((req, bps)) => {
            let p = gateway::render::to_prompt(
                req.tools.as_deref(),
                req.system.as_ref(),
                &req.messages,
                scope,
            );
            if let Err(e) = gateway::render::prepare(engine, &p, &bps, scope) {
                assert!(e.kind.status().is_client_error(), "{e:?}");
            }
        }
        Err(e) => assert!(e.kind.status().is_client_error(), "{e:?}"),
    }
});
