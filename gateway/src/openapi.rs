//! The OpenAPI document, generated from the handlers and wire types. `openapi/openapi.json`
//! is this document, committed; a test regenerates it and fails on any difference.

use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::api::{caches, handlers};
use control::admin::{
    caches as admin_caches, handlers as admin, login, overview, passwords, views, webhooks,
    workspaces,
};

struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("x-api-key"))),
        );
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "admin_jwt",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .description(Some(
                        "Admin token (HS256) with a role claim: platform_admin, finance or tenant_admin; \
                         from POST /v1/admin/login, or `cachet billing token` for services",
                    ))
                    .build(),
            ),
        );
    }
}

/// Every response has a description (OpenAPI requires one): where a handler's annotation
/// gives none, the status's reason phrase ("OK", "Bad Request"), or Cachet's own for 529.
struct Descriptions;

impl Modify for Descriptions {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for item in openapi.paths.paths.values_mut() {
            let ops = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ];
            for op in ops.into_iter().flatten() {
                for (code, r) in op.responses.responses.iter_mut() {
                    if let utoipa::openapi::RefOr::T(r) = r
                        && r.description.is_empty()
                    {
                        r.description = reason(code).to_string();
                    }
                }
            }
        }
    }
}

/// A status code's reason phrase (529 is Anthropic's overloaded).
fn reason(code: &str) -> &'static str {
    match code.parse::<u16>() {
        Ok(529) => "Overloaded",
        Ok(c) => axum::http::StatusCode::from_u16(c)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("Response"),
        Err(_) => "Response",
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "Cachet API", description = "Anthropic-compatible Messages API with managed prompt caching."),
    paths(handlers::create_message, handlers::create_chat_completion, handlers::count_tokens, handlers::list_models, handlers::get_model,
          caches::create_cache, caches::list_caches, caches::get_cache, caches::update_cache, caches::delete_cache,
          billing::api::usage, billing::api::list_invoices, billing::api::get_invoice,
          billing::api::rate_invoice, billing::api::list_prices, billing::api::add_price,
          billing::api::retire_price,
          billing::api::export_usage, billing::api::export_storage, billing::api::export_focus,
          login::login, login::refresh, login::logout, login::me, login::list_users,
          login::create_user_handler, login::disable_user, login::unlock_user,
          passwords::change_own_password, passwords::reset_user_password,
          passwords::redeem_password_reset,
          admin::list_tenants, admin::create_tenant, admin::get_tenant, admin::suspend, admin::resume,
          admin::delete_tenant, admin::list_keys, admin::create_key, admin::update_key,
          admin::revoke_key, admin::rotate_key, admin::get_policy, admin::patch_policy,
          admin::list_audit, admin::export_audit, views::usage, views::budget, views::cache,
          overview::overview, workspaces::list_workspaces, workspaces::create_workspace,
          workspaces::get_workspace, workspaces::update_workspace, workspaces::archive_workspace,
          webhooks::list_endpoints, webhooks::create_endpoint, webhooks::disable_endpoint,
          webhooks::list_deliveries, admin_caches::list_objects, admin_caches::delete_object, admin_caches::extend_object,
          admin_caches::purge),
    components(schemas(billing::export::Format)),
    modifiers(&Security, &Descriptions),
    tags((name = "messages", description = "Messages and token counting"), (name = "chat", description = "OpenAI Chat Completions over the same cache"), (name = "models", description = "Served models"),
         (name = "caches", description = "Cache objects: prefixes held by id, named in `cached_content` on both wires"),
         (name = "billing", description = "Finance API: usage, invoices, prices, exports (admin JWT)"),
         (name = "admin", description = "Admin API: login, users, tenants, workspaces, keys, policy, webhooks, usage, budget, cache, audit log (admin JWT)"))
)]
pub struct ApiDoc;

/// The document as committed: pretty JSON with a trailing newline.
pub fn document() -> String {
    let mut s = ApiDoc::openapi()
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    s.push('\n');
    s
}
