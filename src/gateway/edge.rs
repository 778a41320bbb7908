//! Checks every request meets before authentication, against pages in a browser that try to
//! drive the gateway: cross-site requests and DNS rebinding.
//!
//! - In every mode, a `POST` or `PATCH` to a route that carries a body must declare it JSON
//!   (`application/json` or a `+json` type): a page can send `text/plain`, form and multipart
//!   bodies to any site without a CORS preflight, and they used to be parsed as JSON anyway.
//!   File uploads are `PUT`, which a page cannot send cross-site without a preflight.
//! - Without a token (no static token, no JWT keys: the gateway then listens on loopback
//!   only), only loopback host names are served (`localhost`, `127.0.0.1`, `[::1]`, any port),
//!   so a name an attacker rebinds to 127.0.0.1 gets nothing; and an `Origin`, when present,
//!   must be a loopback origin or one of `--allow-origin`, so a page elsewhere gets nothing
//!   even through a loopback name. With a token, the credential is what protects: a page
//!   cannot attach it cross-site, and CORS governs what it may read.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::api_error::ApiError;
use super::state::AppState;
use crate::gateway::ErrorCode;

/// The route layer: a `POST` or `PATCH` with a body must declare it JSON. On routes only, so
/// that a method a route does not take is a 405 and a route that does not exist a 404,
/// whatever the body.
pub async fn require_json(request: Request, next: Next) -> Response {
    let verdict = json_body_refusal(request.method(), request.headers());
    pass_or_refuse(verdict, request, next).await
}

/// Runs `request` on, or answers the refusal (logged with what was refused).
async fn pass_or_refuse(verdict: Result<(), ApiError>, request: Request, next: Next) -> Response {
    if let Err(err) = verdict {
        tracing::info!(
            method = %request.method(),
            path = %request.uri().path(),
            reason = %err.message,
            "request refused at the edge"
        );
        return err.into_response();
    }
    next.run(request).await
}

fn json_body_refusal(method: &Method, headers: &HeaderMap) -> Result<(), ApiError> {
    if (method == Method::POST || method == Method::PATCH) && has_body(headers) {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        if !content_type.as_deref().is_some_and(is_json) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "request bodies are JSON: send them with Content-Type: application/json (got {})",
                    content_type.as_deref().unwrap_or("no Content-Type")
                ),
            )
            .code(ErrorCode::NotJson));
        }
    }
    Ok(())
}

/// The middleware: refuses what the module doc lists (but the JSON body rule, which
/// [`require_json`] applies), else passes the request on.
pub async fn check(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let verdict = refusal(&state, request.method(), request.headers(), request.uri());
    pass_or_refuse(verdict, request, next).await
}

fn refusal(
    state: &AppState,
    method: &Method,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
) -> Result<(), ApiError> {
    let unauthenticated = state.config.token.is_none() && state.jwt.is_none();
    if !unauthenticated || method == Method::OPTIONS {
        return Ok(());
    }
    // HTTP/1.1 names the host in `Host`; HTTP/2 in the URI's authority.
    let host = headers
        .get(header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        .or_else(|| uri.authority().map(|a| a.as_str().to_owned()));
    // A request with no host name at all comes from no browser, so no page can have sent it.
    if let Some(host) = host.filter(|h| !is_loopback_host(h)) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "this gateway has no token, so it answers only to loopback names (localhost, 127.0.0.1, [::1]), not to Host {host:?}; start it with --token to serve other names"
            ),
        )
        .code(ErrorCode::HostRefused));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = String::from_utf8_lossy(origin.as_bytes());
        if !is_loopback_origin(&origin) && !listed(&state.config.allow_origin, &origin) {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "this gateway has no token, so it answers only to pages from loopback origins or from --allow-origin, not to Origin {origin:?}"
                ),
            )
            .code(ErrorCode::OriginRefused));
        }
    }
    Ok(())
}

fn has_body(headers: &HeaderMap) -> bool {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        return true;
    }
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 0)
}

/// `application/json`, or any `+json` type (`application/x-ipynb+json`), parameters aside.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Whether `origin` is in `allowed` (`*` allows all); both are compared normalised.
pub(super) fn listed(allowed: &[String], origin: &str) -> bool {
    let origin = origin.trim_end_matches('/').to_ascii_lowercase();
    allowed.iter().any(|a| a == "*" || *a == origin)
}

/// `localhost`, `127.0.0.1` or `[::1]`, with or without a port, in any case.
pub(super) fn is_loopback_host(host: &str) -> bool {
    let host = host.trim().to_ascii_lowercase();
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((inner, "")) => return inner == "::1",
            Some((inner, port)) => {
                return inner == "::1" && port.strip_prefix(':').is_some_and(is_port)
            }
            _ => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name.to_owned(),
            Some(_) => return false,
            None => host,
        }
    };
    name == "localhost" || name == "127.0.0.1"
}

fn is_port(port: &str) -> bool {
    !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit())
}

/// An `http` or `https` origin whose host is a loopback name.
fn is_loopback_origin(origin: &str) -> bool {
    let origin = origin.trim_end_matches('/').to_ascii_lowercase();
    origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .is_some_and(is_loopback_host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        for host in [
            "localhost",
            "LOCALHOST:8888",
            "127.0.0.1",
            "127.0.0.1:1",
            "[::1]",
            "[::1]:8888",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "rebind.evil.example",
            "rebind.evil.example:8888",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "127.0.0.2",
            "[::1].evil",
            "[::2]:8888",
            "localhost:",
            "localhost:80:80",
            "localhost:http",
            "",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn origins() {
        assert!(is_loopback_origin("http://127.0.0.1:8888"));
        assert!(is_loopback_origin("https://localhost"));
        assert!(!is_loopback_origin("null"));
        assert!(!is_loopback_origin("http://rebind.evil.example:8888"));
        assert!(!is_loopback_origin("file://localhost"));
        let allowed = vec!["https://app.example".to_owned()];
        assert!(listed(&allowed, "https://APP.example/"));
        assert!(!listed(&allowed, "https://app.example.evil"));
        assert!(listed(&["*".to_owned()], "http://anything"));
    }

    #[test]
    fn json_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/x-ipynb+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("text/plain; application/json"));
        assert!(!is_json("application/x-www-form-urlencoded"));
        assert!(!is_json("multipart/form-data; boundary=x"));
    }
}
