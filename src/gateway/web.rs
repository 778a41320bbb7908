//! The web client (`web-client/`), served at the gateway's root with every asset embedded in
//! the binary (`include_str!`): the page, its script (and the code highlighter it imports)
//! and style, and the chart libraries
//! (Plotly's cartesian bundle: scatter, bar, histogram, box, heatmap, pie...; Vega,
//! Vega-Lite, vega-embed) that `build.rs` copies from `web-client/node_modules` (a stand-in
//! script when they are not installed).
//!
//! Plotly and Altair figures come from the kernel as one bundle of spec and PNG
//! (`kernels/python3/cellgate_display.py`, an IPython extension the kernelspec loads): the
//! page draws the spec; API v1 and MCP clients, which run no JavaScript, take the PNG.
//!
//! The page itself needs no authentication (it holds no data); it asks for a token and
//! drives one API v1 session over its WebSocket. Artifacts are fetched with the token in
//! the `Authorization` header and shown from blobs. *Invariant:* the token is never in a
//! page or subresource URL (only in the WebSocket's query, which browsers require). Its
//! Content-Security-Policy keeps scripts to these assets and framing out; rich HTML outputs
//! run in `sandbox="allow-scripts"` srcdoc iframes (an opaque origin: no access to the
//! page, its storage or the token), which inherit that policy (the one script the page adds
//! to them, `frame-height.js`, only reports the content's height).

use axum::extract::RawQuery;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

use super::state::AppState;

const INDEX: &str = include_str!("../../web-client/index.html");
const APP_JS: &str = include_str!("../../web-client/app.js");
const HIGHLIGHT_JS: &str = include_str!("../../web-client/highlight.js");
const STYLE: &str = include_str!("../../web-client/style.css");
const FRAME_HEIGHT_JS: &str = include_str!("../../web-client/frame-height.js");
const PLOTLY: &str = include_str!(concat!(env!("OUT_DIR"), "/plotly.min.js"));
const VEGA: &str = include_str!(concat!(env!("OUT_DIR"), "/vega.min.js"));
const VEGA_LITE: &str = include_str!(concat!(env!("OUT_DIR"), "/vega-lite.min.js"));
const VEGA_EMBED: &str = include_str!(concat!(env!("OUT_DIR"), "/vega-embed.min.js"));

/// Scripts only from here ('unsafe-eval' because Vega compiles its expressions); styles
/// inline too (Plotly and pandas tables use them); images from blobs the page made; network
/// only back to the gateway; never framed by another site.
const CSP: &str = "default-src 'self'; script-src 'self' 'unsafe-eval'; \
    style-src 'self' 'unsafe-inline'; img-src 'self' blob: data:; font-src 'self' data:; \
    connect-src 'self' ws: wss:; frame-src 'self' blob: about:; object-src 'none'; \
    base-uri 'self'; form-action 'self'; frame-ancestors 'none'";

fn asset(body: &'static str, content_type: &'static str) -> Response {
    embedded(body, content_type, CSP)
}

/// An asset embedded in the binary, with `csp` and the headers every embedded page and
/// asset gets (no sniffing, no framing, no referrer, revalidated). The API reference page
/// (`v1/docs.rs`) serves its own under a stricter policy.
pub(super) fn embedded(
    body: &'static str,
    content_type: &'static str,
    csp: &'static str,
) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(csp),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // Assets change with the binary; revalidate rather than serve a stale client.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

pub(super) const JS: &str = "text/javascript; charset=utf-8";

/// The page itself.
pub fn page() -> Response {
    asset(INDEX, "text/html; charset=utf-8")
}

/// `/` and `/assets/*`, outside the authentication layer.
///
/// Under a base URL such as `/gw/`, the page must be loaded as `/gw/`: the browser resolves
/// the page's relative `assets/...` and API paths against it, and from `/gw` they would land
/// at `/assets/...`. So the bare prefix (what `/` becomes once nested) redirects there,
/// keeping the query; the caller routes `{prefix}/` to [`page`].
pub fn routes(base_url: &str) -> Router<AppState> {
    let root = if base_url == "/" {
        get(|| async { page() })
    } else {
        let target = format!("{}/", base_url.trim_end_matches('/'));
        get(move |RawQuery(query): RawQuery| async move {
            match query {
                Some(query) => Redirect::permanent(&format!("{target}?{query}")),
                None => Redirect::permanent(&target),
            }
        })
    };
    Router::new()
        .route("/", root)
        .route("/assets/app.js", get(|| async { asset(APP_JS, JS) }))
        .route(
            "/assets/highlight.js",
            get(|| async { asset(HIGHLIGHT_JS, JS) }),
        )
        .route(
            "/assets/frame-height.js",
            get(|| async { asset(FRAME_HEIGHT_JS, JS) }),
        )
        .route(
            "/assets/style.css",
            get(|| async { asset(STYLE, "text/css; charset=utf-8") }),
        )
        .route("/assets/plotly.min.js", get(|| async { asset(PLOTLY, JS) }))
        .route("/assets/vega.min.js", get(|| async { asset(VEGA, JS) }))
        .route(
            "/assets/vega-lite.min.js",
            get(|| async { asset(VEGA_LITE, JS) }),
        )
        .route(
            "/assets/vega-embed.min.js",
            get(|| async { asset(VEGA_EMBED, JS) }),
        )
}
