//! Forwarding a request to the replica that owns its kernel: the same method, path, query,
//! headers (hop-by-hop ones removed, [`FORWARDED_BY`] added naming this replica; the
//! client's credentials included: the owner authenticates the request again) and body,
//! streamed both ways, so Server-Sent Events arrive as they are sent; a WebSocket upgrade
//! (a `101`) is passed through and its two connections joined byte for byte. An owner that
//! does not answer is a 502 `replica_unreachable`.
//!
//! *Invariant:* a request is never forwarded twice: one carrying [`FORWARDED_BY`] is served
//! where it lands or refused with 503 `kernel_moving`, and peers' listing and artifact asks
//! are not gathered again. Authentication comes before any API read or peer request (the
//! replica middlewares sit inside the auth layer), so an unauthenticated request costs
//! neither.
//!
//! Hand-written on hyper's client (no reverse-proxy crate of the field does upgrades on
//! axum 0.8 and hyper 1 without pulling a second HTTP stack): a connection per forwarded
//! request, to a peer address on the cluster network.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use super::ApiError;
use crate::gateway::ErrorCode;

/// The header a forwarded request carries: the forwarding replica's id. The owner never
/// forwards such a request again, so two replicas that disagree cannot bounce it.
pub const FORWARDED_BY: HeaderName = HeaderName::from_static("x-cellgate-forwarded-by");

/// How long connecting to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Headers of one hop (RFC 9110 §7.6.1), not passed on; an upgrade's own are put back.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Sends `request` (its path and query as the client sent them, `original`) to the replica
/// at `base` (`http://host:port`), as replica `me`, and answers with the owner's response.
pub async fn forward(mut request: Request, original: &Uri, base: &str, me: &str) -> Response {
    let Some(authority) = base.strip_prefix("http://") else {
        return unavailable(format!("the owning replica's URL {base:?} is not http://"));
    };
    let path = original
        .path_and_query()
        .map_or_else(|| original.path().to_owned(), |p| p.as_str().to_owned());
    let target: Uri = match format!("http://{authority}{path}").parse() {
        Ok(uri) => uri,
        Err(error) => return unavailable(format!("the owning replica's URL: {error}")),
    };
    let upgrade = request
        .headers()
        .get(header::UPGRADE)
        .cloned()
        .filter(|_| has_token(request.headers().get(header::CONNECTION), "upgrade"));
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut request));
    let (mut parts, body) = request.into_parts();
    for name in HOP_BY_HOP {
        parts.headers.remove(name);
    }
    if let Some(protocol) = &upgrade {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, protocol.clone());
    }
    parts.headers.insert(header::HOST, host_value(authority));
    if let Ok(me) = HeaderValue::from_str(me) {
        parts.headers.insert(FORWARDED_BY, me);
    }
    parts.uri = target;
    let outgoing = Request::from_parts(parts, body);

    let connected = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect(authority.to_owned()),
    )
    .await;
    let tcp = match connected {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(error)) => return unavailable(format!("the owning replica at {base}: {error}")),
        Err(_) => return unavailable(format!("the owning replica at {base} did not answer")),
    };
    let _ = tcp.set_nodelay(true);
    let (mut sender, connection) =
        match hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await {
            Ok(pair) => pair,
            Err(error) => return unavailable(format!("the owning replica at {base}: {error}")),
        };
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            tracing::debug!(%error, "forwarded connection");
        }
    });
    let mut response = match sender.send_request(outgoing).await {
        Ok(response) => response,
        Err(error) => return unavailable(format!("the owning replica at {base}: {error}")),
    };
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_side) = client_side {
            let owner_side = hyper::upgrade::on(&mut response);
            tokio::spawn(async move {
                let (Ok(client), Ok(owner)) = tokio::join!(client_side, owner_side) else {
                    return;
                };
                let (mut client, mut owner) = (TokioIo::new(client), TokioIo::new(owner));
                let _ = tokio::io::copy_bidirectional(&mut client, &mut owner).await;
            });
        }
    }
    let (mut parts, body) = response.into_parts();
    if parts.status != StatusCode::SWITCHING_PROTOCOLS {
        for name in HOP_BY_HOP {
            parts.headers.remove(name);
        }
    }
    Response::from_parts(parts, Body::new(body))
}

fn host_value(authority: &str) -> HeaderValue {
    HeaderValue::from_str(authority).unwrap_or_else(|_| HeaderValue::from_static("localhost"))
}

/// Whether a comma-separated header holds `token` (case-insensitive).
fn has_token(value: Option<&HeaderValue>, token: &str) -> bool {
    value
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
}

fn unavailable(message: String) -> Response {
    tracing::warn!(%message, "forwarding to the owning replica failed");
    ApiError::new(StatusCode::BAD_GATEWAY, message)
        .code(ErrorCode::ReplicaUnreachable)
        // A replica killed a moment ago holds its lease until it lapses; then another
        // takes its kernels over and the same request works.
        .retry_after(5)
        .into_response()
}
