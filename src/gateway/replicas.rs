//! The gateway as one of several replicas on Kubernetes (`--replica-url`): any replica
//! accepts any request, and the one that owns the kernel serves it.
//!
//! - A request naming a kernel (`/api/kernels/{id}…`, `/v1/sessions/{id}…`) that this
//!   replica does not hold is forwarded to its owner, as the session layer's route says
//!   (`sessions::adoption`, which asks the owners' registry, and takes a kernel whose owner
//!   is gone over on the way), after authentication here (so unauthenticated requests never
//!   cost a registry read) and again there.
//! - Listings (`GET /api/kernels`, `GET /v1/sessions`) gather every live replica's, and an
//!   artifact this replica does not hold is asked of the others.
//! - Not shared: MCP sessions (`/mcp`, stateful per replica: a load balancer must keep a
//!   client's MCP session on one replica) and kernels of non-kubernetes policies.
//!
//! A request carrying [`forward::FORWARDED_BY`] is never forwarded again.

use axum::extract::{OriginalUri, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::forward::{self, FORWARDED_BY};
use super::{ApiError, AppState};
use crate::gateway::ErrorCode;
use crate::sessions::Route;

/// The kernel a request is about, by its path (inside the base URL).
fn kernel_of(path: &str) -> Option<&str> {
    let rest = path
        .strip_prefix("/api/kernels/")
        .or_else(|| path.strip_prefix("/v1/sessions/"))?;
    let id = rest.split('/').next()?;
    // Anything but a kernel id is not one of ours to look up.
    crate::ids::KernelId::parse(id).is_ok().then_some(id)
}

/// The path and query as the client sent them (with the base URL the router strips).
fn original_uri(request: &Request) -> axum::http::Uri {
    request
        .extensions()
        .get::<OriginalUri>()
        .map_or_else(|| request.uri().clone(), |o| o.0.clone())
}

/// The middleware: serves a request here when this replica holds its kernel (or no replica
/// does, or it has just taken it over), forwards it to the owner otherwise, by what the
/// session layer's [`Route`] says.
pub async fn route_to_owner(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if !state.kernels.ownership().shared() {
        return next.run(request).await;
    }
    let Some(kernel_id) = kernel_of(request.uri().path()).map(str::to_owned) else {
        return next.run(request).await;
    };
    let forwarded = request.headers().contains_key(FORWARDED_BY);
    match state.sessions.route(&kernel_id, forwarded).await {
        Route::Here => next.run(request).await,
        Route::Forward(owner) => {
            let original = original_uri(&request);
            let me = state.kernels.ownership().gateway_id().to_owned();
            forward::forward(request, &original, &owner.url, &me).await
        }
        Route::Moving(why) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why)
            .code(ErrorCode::KernelMoving)
            .retry_after(1)
            .into_response(),
        Route::Unavailable(error) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, error.to_string())
                .code(ErrorCode::KubernetesUnavailable)
                .retry_after(2)
                .into_response()
        }
    }
}

/// The middleware for artifacts (on the authenticated routes and on signed links): one this
/// replica does not hold is asked of each live peer (the artifact store is each replica's
/// own disk), the first answer that is not a 404 wins. Artifact ids are random: nothing
/// tells which replica made one. Asked: an authenticated fetch or request for a link
/// (`POST /v1/artifacts/{id}/links`, its small body passed on), and a signed link only when
/// this replica verified it ([`super::v1::VerifiedLink`]): a forged link costs no peer a
/// request.
pub async fn artifacts_anywhere(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if !state.kernels.ownership().shared() {
        return next.run(request).await;
    }
    let ownership = state.kernels.ownership().clone();
    let path = request.uri().path();
    let authenticated = request.extensions().get::<super::Principal>().is_some();
    let signed = path.ends_with("/signed");
    let asks_link = request.method() == Method::POST && path.ends_with("/links");
    let asks_artifact = (request.method() == Method::GET || asks_link)
        && path.starts_with("/v1/artifacts/")
        && !request.headers().contains_key(FORWARDED_BY)
        && (authenticated || (signed && !asks_link));
    if !asks_artifact {
        return next.run(request).await;
    }
    let original = original_uri(&request);
    let (method, headers) = (request.method().clone(), request.headers().clone());
    // A link request's body (a TTL) is small: kept to be passed on.
    let (request, body) = if asks_link {
        let (parts, body) = request.into_parts();
        match axum::body::to_bytes(body, LINK_BODY_LIMIT).await {
            Ok(bytes) => (
                Request::from_parts(parts, axum::body::Body::from(bytes.clone())),
                bytes,
            ),
            Err(_) => {
                return ApiError::bad_request("a link request's body is a small JSON object")
                    .code(ErrorCode::InvalidJson)
                    .into_response()
            }
        }
    } else {
        (request, axum::body::Bytes::new())
    };
    let local = next.run(request).await;
    if local.status() != StatusCode::NOT_FOUND
        || (signed
            && local
                .extensions()
                .get::<super::v1::VerifiedLink>()
                .is_none())
    {
        return local;
    }
    let Ok(peers) = ownership.peers().await else {
        return local;
    };
    for peer in peers {
        let mut ask = Request::new(axum::body::Body::from(body.clone()));
        *ask.method_mut() = method.clone();
        *ask.headers_mut() = headers.clone();
        let answer = forward::forward(ask, &original, &peer.url, ownership.gateway_id()).await;
        if answer.status() != StatusCode::NOT_FOUND && !answer.status().is_server_error() {
            return answer;
        }
    }
    local
}

/// The largest body a link request passed on to peers may have.
const LINK_BODY_LIMIT: usize = 4096;

/// The listing routes whose answers gather every replica's.
fn gathered(method: &Method, path: &str) -> bool {
    method == Method::GET && matches!(path, "/api/kernels" | "/v1/sessions")
}

/// The middleware for listings: this replica's answer, with every live peer's merged in
/// (asked with the same credentials; a peer that does not answer in time is left out).
pub async fn gather_listings(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if !state.kernels.ownership().shared() {
        return next.run(request).await;
    }
    let ownership = state.kernels.ownership().clone();
    if !gathered(request.method(), request.uri().path())
        || request.headers().contains_key(FORWARDED_BY)
        || request.extensions().get::<super::Principal>().is_none()
    {
        return next.run(request).await;
    }
    let original = original_uri(&request);
    let headers = request.headers().clone();
    let local = next.run(request).await;
    if !local.status().is_success() {
        return local;
    }
    let peers = match ownership.peers().await {
        Ok(peers) => peers,
        Err(error) => {
            tracing::warn!(%error, "listing the other replicas failed; this replica's list only");
            return local;
        }
    };
    let (parts, body) = local.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let Ok(mut merged) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return Response::from_parts(parts, axum::body::Body::from(bytes));
    };
    let me = ownership.gateway_id().to_owned();
    let asks = peers.iter().map(|peer| {
        let me = me.clone();
        let mut headers = headers.clone();
        headers.remove(axum::http::header::HOST);
        let url = format!(
            "{}{}",
            peer.url,
            original.path_and_query().map_or("", |p| p.as_str())
        );
        async move {
            let response = peer_client()?
                .get(url)
                .headers(headers)
                .header(FORWARDED_BY, me)
                .send()
                .await
                .ok()?;
            response.json::<serde_json::Value>().await.ok()
        }
    });
    for answer in futures_util::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
    {
        merge(&mut merged, answer);
    }
    let body = serde_json::to_vec(&merged).unwrap_or_default();
    let mut response = Response::from_parts(parts, axum::body::Body::from(body));
    response
        .headers_mut()
        .remove(axum::http::header::CONTENT_LENGTH);
    response
}

/// The client that asks peers for their listings, made once: building one loads the TLS
/// roots, which a listing must not pay for.
fn peer_client() -> Option<&'static reqwest::Client> {
    static CLIENT: std::sync::OnceLock<Option<reqwest::Client>> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(3))
                .no_proxy()
                .build()
                .ok()
        })
        .as_ref()
}

/// Appends a peer's list to ours: a bare array (`/api/kernels`) or an object's array field
/// (`/v1/sessions`: `{"sessions": [...]}`).
fn merge(ours: &mut serde_json::Value, theirs: serde_json::Value) {
    match (ours, theirs) {
        (serde_json::Value::Array(ours), serde_json::Value::Array(theirs)) => ours.extend(theirs),
        (serde_json::Value::Object(ours), serde_json::Value::Object(theirs)) => {
            for (key, value) in theirs {
                if let (Some(serde_json::Value::Array(list)), serde_json::Value::Array(more)) =
                    (ours.get_mut(&key), value)
                {
                    list.extend(more);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_paths_name_their_kernel() {
        let id = "0b3c4e4e-6c1b-4f7e-9b7c-2d1f1e0c9a11";
        assert_eq!(kernel_of(&format!("/api/kernels/{id}")), Some(id));
        assert_eq!(kernel_of(&format!("/api/kernels/{id}/channels")), Some(id));
        assert_eq!(
            kernel_of(&format!("/v1/sessions/{id}/files/a.txt")),
            Some(id)
        );
        assert_eq!(kernel_of("/api/kernels"), None);
        assert_eq!(kernel_of("/api/kernels/not-an-id"), None);
        assert_eq!(kernel_of("/v1/artifacts/x"), None);
    }

    #[test]
    fn listings_merge_arrays_and_fields() {
        let mut kernels = serde_json::json!([{"id": "a"}]);
        merge(&mut kernels, serde_json::json!([{"id": "b"}]));
        assert_eq!(kernels.as_array().unwrap().len(), 2);
        let mut sessions = serde_json::json!({"sessions": [{"id": "a"}]});
        merge(
            &mut sessions,
            serde_json::json!({"sessions": [{"id": "b"}], "other": 1}),
        );
        assert_eq!(sessions["sessions"].as_array().unwrap().len(), 2);
    }
}
