//! The admin console's web UI: the built single-page app (`admin-ui/dist`, made by
//! `make admin-ui`) served at `/admin`, with headers that keep it to its own origin. Routing
//! inside the app is by URL fragment, so every page is `/admin/`.

use std::path::Path;

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use tower_http::services::{ServeDir, ServeFile};

/// The security headers of every `/admin` answer: scripts, styles and data only from this
/// origin, never framed.
async fn harden(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; \
             connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}

async fn not_built() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Html(
            "<!doctype html><title>Cachet admin</title><h1>The admin UI is not built</h1>\
             <p>Run <code>make admin-ui</code> (or <code>make run</code>), then reload. The admin API \
             under <code>/v1/admin</code> works without it.</p>",
        ),
    )
        .into_response()
}

/// `/admin` serving the files in `dir`.
pub fn routes(dir: &Path) -> Router {
    let index = dir.join("index.html");
    let app = if index.is_file() {
        Router::new().nest_service("/admin", ServeDir::new(dir).fallback(ServeFile::new(index)))
    } else {
        tracing::warn!(dir = %dir.display(), "the admin UI is not built; /admin says how to build it");
        Router::new()
            .route("/admin", get(not_built))
            .route("/admin/{*rest}", get(not_built))
    };
    app.layer(axum::middleware::map_response(harden))
}
