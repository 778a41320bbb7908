//! The API reference page at `/v1/docs`: Swagger UI rendering `/v1/openapi.json`, with "try
//! it out" against this gateway. Its assets are embedded in the binary (`build.rs` copies
//! them from `web-client/node_modules/swagger-ui-dist`, locked by the web client's
//! package-lock.json): the page loads nothing from elsewhere, and its Content-Security-Policy
//! says so. Swagger UI's call to an online validator is switched off. Like the document, the
//! page needs no credential; "Authorize" takes the token for "try it out".

use axum::response::Response;
use axum::routing::get;
use axum::Router;

use crate::gateway::state::AppState;

const BUNDLE: &str = include_str!(concat!(env!("OUT_DIR"), "/swagger-ui-bundle.js"));
const STYLE: &str = include_str!(concat!(env!("OUT_DIR"), "/swagger-ui.css"));

/// Relative addresses throughout, so the page works under any base URL: from `…/v1/docs`,
/// `docs/…` is its assets and `openapi.json` the document.
const PAGE: &str = r##"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>cellgate API v1</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="docs/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script src="docs/init.js"></script>
</body>
</html>
"##;

const INIT: &str = r##"window.ui = SwaggerUIBundle({
  url: new URL("openapi.json", document.baseURI).href,
  dom_id: "#swagger-ui",
  deepLinking: true,
  validatorUrl: null,
  tryItOutEnabled: false,
  displayOperationId: true,
});
"##;

/// Scripts and styles from here only (Swagger UI sets inline styles), images from here or
/// data URLs, requests only back to the gateway, never framed.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
    img-src 'self' data:; font-src 'self' data:; connect-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

fn asset(body: &'static str, content_type: &'static str) -> Response {
    crate::gateway::web::embedded(body, content_type, CSP)
}

/// The page and its assets (outside the authentication layer).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/docs",
            get(|| async { asset(PAGE, "text/html; charset=utf-8") }),
        )
        .route(
            "/v1/docs/swagger-ui-bundle.js",
            get(|| async { asset(BUNDLE, crate::gateway::web::JS) }),
        )
        .route(
            "/v1/docs/swagger-ui.css",
            get(|| async { asset(STYLE, "text/css; charset=utf-8") }),
        )
        .route(
            "/v1/docs/init.js",
            get(|| async { asset(INIT, crate::gateway::web::JS) }),
        )
}
