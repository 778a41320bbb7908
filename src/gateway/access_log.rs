//! The access log and request ids: one line per request (method, route template, status,
//! latency, peer, tenant, request id), the request counted in the HTTP metrics, and every
//! log line the request causes (a kernel's start included) inside a `request` span that
//! carries its `request_id`.
//!
//! `peer` is the request's client ([`ClientAddr`]): the TCP peer, or, behind a trusted
//! proxy, the client the proxy named in `X-Forwarded-For`, with the proxy as `via` (a field
//! only such lines have).
//!
//! A client's `X-Request-Id` is kept when it is a plain token (letters, digits and `-._:`,
//! at most 128 bytes) so that a proxy's or a client's id follows the request through; any
//! other value is replaced by a fresh one, since the id is written into log lines a log
//! reader trusts. The id goes back in the response's `X-Request-Id`. Hand-written rather
//! than tower-http's request-id and trace layers, which keep whatever id a client sends.
//!
//! Never logged: the raw path and query (a `?token=` credential travels there, and ids in
//! paths would make the route label unbounded) and any header but the request id.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderName, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use super::client_addr::ClientAddr;

/// The request id header, both ways.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Whether a client's id may be kept as it is.
fn acceptable(value: &HeaderValue) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 128
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:".contains(b))
}

fn fresh_id() -> HeaderValue {
    // A simple UUID is 32 hex digits: always a valid header value.
    HeaderValue::from_str(&uuid::Uuid::new_v4().simple().to_string())
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

/// The method as a label: the standard ones, everything else as `other` (a method is any
/// token a client likes; the label set must stay small).
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// The outermost layer of every route.
pub async fn access_log(mut request: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = request
        .headers()
        .get(&X_REQUEST_ID)
        .filter(|v| acceptable(v))
        .cloned()
        .unwrap_or_else(fresh_id);
    request
        .headers_mut()
        .insert(X_REQUEST_ID.clone(), id.clone());
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |m| m.as_str())
        .to_owned();
    let method = method_label(request.method());
    let client = request.extensions().get::<ClientAddr>().copied();
    let span = tracing::info_span!(
        "request",
        request_id = %String::from_utf8_lossy(id.as_bytes()),
        tenant = tracing::field::Empty,
    );
    let mut response = next.run(request).instrument(span.clone()).await;
    let elapsed = started.elapsed();
    let status = response.status().as_u16();
    response.headers_mut().insert(X_REQUEST_ID.clone(), id);
    crate::telemetry::metrics::metrics().http_request(method, &route, status, elapsed);
    let latency_ms = (elapsed.as_secs_f64() * 1e5).round() / 100.0;
    let peer = client.map_or_else(|| "-".to_owned(), |client| client.ip.to_string());
    // `None` records no field at all.
    let via = client
        .and_then(|client| client.via)
        .map(tracing::field::display);
    span.in_scope(|| {
        // Probes and scrapes come every few seconds from the orchestrator: at debug, so
        // they do not bury the requests people make (a failed one is still at info).
        if matches!(route.as_str(), "/healthz" | "/readyz" | "/metrics") && status < 400 {
            tracing::debug!(target: "cellgate::access", method, route, status, latency_ms, %peer, via, "request");
        } else {
            tracing::info!(target: "cellgate::access", method, route, status, latency_ms, %peer, via, "request");
        }
    });
    response
}

/// Names the tenant of the request being served in its span (and so in its access line).
pub fn record_tenant(tenant: &str) {
    tracing::Span::current().record("tenant", tenant);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_ids_are_kept() {
        for good in ["abc", "0f-12_3.4:5", &"a".repeat(128)] {
            assert!(acceptable(&HeaderValue::from_str(good).unwrap()), "{good}");
        }
        for bad in ["", "a b", "id\" status=200", "x=y", &"a".repeat(129), "%0a"] {
            assert!(!acceptable(&HeaderValue::from_str(bad).unwrap()), "{bad}");
        }
        assert!(acceptable(&fresh_id()));
    }
}
