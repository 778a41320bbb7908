//! `/mcp` as an OAuth protected resource (RFC 9728, as the MCP 2025-06-18 authorization
//! section asks): where a host that met a 401 finds which authorization server issues the
//! tokens the gateway takes. Only when tenants' JWTs must name an issuer (`--jwt-issuer`):
//! that issuer is the authorization server. Without one there is nothing to point at: the
//! metadata paths answer 404 and 401s keep their plain challenge.
//!
//! - `GET /.well-known/oauth-protected-resource{base_url}mcp` (the resource's own metadata
//!   URL, RFC 9728 §3.1) and `GET /.well-known/oauth-protected-resource` (where hosts that
//!   drop the path look), both at the root whatever `base_url` is, without a credential:
//!   `{"resource", "authorization_servers": [issuer], "bearer_methods_supported": ["header"]}`.
//! - A 401 on `/mcp` adds `resource_metadata="…"` (that URL) to its `WWW-Authenticate`.
//!
//! The gateway names itself from `--public-url` when set; otherwise from the request's
//! `Host`, as `http://` (the gateway itself serves no TLS). A `Host` is the caller's to say,
//! so it is used only when it is a plain `host[:port]` (nothing that could break out of the
//! header's quoted string or the URL), and such answers are marked `no-store`, so that no
//! cache in front hands one caller's name to another.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::gateway::ErrorCode;
use crate::gateway::{ApiError, AppState};

/// The well-known prefix of RFC 9728 §3.
const WELL_KNOWN: &str = "/.well-known/oauth-protected-resource";

/// The metadata routes, mounted at the root and outside authentication: without an issuer
/// they answer 404 as an unknown route does, rather than the 401 of one behind the
/// authentication layer, so a host asking learns there is nothing to discover.
pub fn routes(state: &AppState) -> Router {
    if issuer(state).is_some() && state.config.public_url.is_none() {
        // Behind a proxy that ends TLS, `http://{Host}` is not the URL clients used, and
        // RFC 9728 §3.3 has them discard metadata whose resource differs from it.
        tracing::warn!("OAuth metadata for /mcp names the gateway as http:// and each request's Host: set --public-url if clients reach it by another scheme or name");
    }
    let own = format!("{WELL_KNOWN}{}mcp", state.config.base_url);
    Router::new()
        .route(WELL_KNOWN, get(metadata))
        .route(&own, get(metadata))
        .with_state(state.clone())
}

/// The middleware on the authenticated routes: a 401 on `/mcp` says where the metadata is.
pub async fn challenge(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let on_mcp = path == "/mcp" || path.starts_with("/mcp/");
    let origin = (on_mcp && issuer(&state).is_some())
        .then(|| origin(&state, request.headers(), request.uri()))
        .flatten();
    let mut response = next.run(request).await;
    let Some((origin, _)) = origin else {
        return response;
    };
    if response.status() != StatusCode::UNAUTHORIZED {
        return response;
    }
    let url = metadata_url(&origin, &state.config.base_url);
    let headers = response.headers_mut();
    let challenge = headers
        .get(header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Bearer realm=\"cellgate\"");
    // The origin is checked; `base_url` is the operator's, but a quote in it would still end
    // the quoted string early.
    if url.contains(['"', '\\']) {
        return response;
    }
    if let Ok(value) = HeaderValue::from_str(&format!("{challenge}, resource_metadata=\"{url}\"")) {
        headers.insert(header::WWW_AUTHENTICATE, value);
    }
    response
}

/// The metadata document.
async fn metadata(State(state): State<AppState>, headers: HeaderMap, uri: Uri) -> Response {
    let Some(issuer) = issuer(&state) else {
        return ApiError::no_route(&axum::http::Method::GET, uri.path()).into_response();
    };
    let Some((origin, from_request)) = origin(&state, &headers, &uri) else {
        return ApiError::new(
            StatusCode::BAD_REQUEST,
            "the request's Host is not a plain host[:port], and the gateway has no --public-url to name itself with",
        )
        .code(ErrorCode::BadHost)
        .into_response();
    };
    let body = json!({
        "resource": format!("{origin}{}mcp", state.config.base_url),
        "authorization_servers": [issuer],
        "bearer_methods_supported": ["header"],
    });
    let mut response = Json(body).into_response();
    if from_request {
        response
            .headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

/// The issuer tenants' JWTs must name, when JWTs are accepted at all.
fn issuer(state: &AppState) -> Option<&str> {
    state.jwt.as_ref()?;
    state.config.jwt.issuer.as_deref()
}

/// The gateway's origin (`scheme://host[:port]`) and whether the request named it: the
/// configured public URL, else `http://` and the request's host when it is a plain one.
fn origin(state: &AppState, headers: &HeaderMap, uri: &Uri) -> Option<(String, bool)> {
    if let Some(public) = &state.config.public_url {
        return Some((public.clone(), false));
    }
    let host = match headers.get(header::HOST) {
        Some(host) => host.to_str().ok()?.to_owned(),
        None => uri.authority()?.as_str().to_owned(),
    };
    plain_host(&host).then(|| (format!("http://{}", host.to_ascii_lowercase()), true))
}

/// `{origin}`'s URL of the resource's metadata.
fn metadata_url(origin: &str, base_url: &str) -> String {
    format!("{origin}{WELL_KNOWN}{base_url}mcp")
}

/// A DNS name or IPv4 address, or an IPv6 address in brackets, with an optional port:
/// nothing else (no user info, path, quote, comma or space).
fn plain_host(host: &str) -> bool {
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((inner, port))
                if !inner.is_empty()
                    && inner
                        .chars()
                        .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.') =>
            {
                (inner, port)
            }
            Some(_) => return false,
            None => return false,
        },
        None => match host.find(':') {
            Some(colon) => (&host[..colon], &host[colon..]),
            None => (host, ""),
        },
    };
    let name_ok = !name.is_empty()
        && (host.starts_with('[')
            || name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.'));
    let port_ok = port.is_empty()
        || port
            .strip_prefix(':')
            .is_some_and(|p| !p.is_empty() && p.len() <= 5 && p.parse::<u16>().is_ok());
    name_ok && port_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_hosts_name_the_gateway() {
        for good in [
            "localhost",
            "127.0.0.1:8888",
            "gw.example.com",
            "GW.Example:443",
            "[::1]:8888",
            "[::1]",
        ] {
            assert!(plain_host(good), "{good}");
        }
        for bad in [
            "",
            ":80",
            "gw.example:",
            "gw.example:99999",
            "gw.example:80:81",
            "gw\".example",
            "gw.example\", error=\"x",
            "user@gw.example",
            "gw.example/path",
            "gw example",
            "[::1",
            "[]:80",
            "[::1]x",
            "[::1]:",
        ] {
            assert!(!plain_host(bad), "{bad}");
        }
    }

    #[test]
    fn the_metadata_url_puts_the_well_known_prefix_before_the_path() {
        assert_eq!(
            metadata_url("https://gw.example", "/"),
            "https://gw.example/.well-known/oauth-protected-resource/mcp"
        );
        assert_eq!(
            metadata_url("http://h:1", "/gw/"),
            "http://h:1/.well-known/oauth-protected-resource/gw/mcp"
        );
    }
}
