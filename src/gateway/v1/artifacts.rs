//! Artifacts: a session's list, and the bytes of one by id with the headers that keep
//! active content (HTML, SVG) from ever running in the gateway's origin.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use super::{session_for, ApiError, STREAM_CHUNK};
use crate::artifacts::{is_active_content, Artifact};
use crate::gateway::auth::Principal;
use crate::gateway::state::AppState;
use crate::sessions::ArtifactRef;

/// How long a fetch waits for a large output's bytes still being stored (seconds of work at
/// most, unless the host's disk stalls).
const STORE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Every artifact of the session, oldest first.
#[utoipa::path(get, path = "/v1/sessions/{id}/artifacts", tag = "artifacts", operation_id = "list_artifacts",
    params(("id" = String, Path)),
    responses((status = 200, body = Vec<ArtifactRef>), (status = 404)))]
pub async fn list(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Vec<ArtifactRef>>, ApiError> {
    let session = session_for(&state, &principal, &id)?;
    let base = &state.sessions.options().base_url;
    Ok(Json(
        state
            .sessions
            .artifacts()
            .list(&session.id)
            .iter()
            .map(|a| ArtifactRef::new(a, base))
            .collect(),
    ))
}

/// Whether `If-None-Match` names the entity tag `"<id>"` (or is `*`), weak or strong
/// (RFC 9110 compares weakly for this header).
fn etag_matches(headers: &axum::http::HeaderMap, id: &str) -> bool {
    headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .any(|tag| {
            tag == "*"
                || tag
                    .trim_start_matches("W/")
                    .strip_prefix('"')
                    .and_then(|t| t.strip_suffix('"'))
                    == Some(id)
        })
}

fn content_type(artifact: &Artifact) -> String {
    let textual = artifact.mime.starts_with("text/")
        || artifact.mime == "image/svg+xml"
        || artifact.mime.ends_with("json");
    if textual {
        format!("{}; charset=utf-8", artifact.mime)
    } else {
        artifact.mime.clone()
    }
}

/// The artifact's bytes, with its Content-Type, `X-Content-Type-Options: nosniff`, and for
/// HTML and SVG `Content-Security-Policy: sandbox` (scripts in them run, if at all, in an
/// opaque origin that cannot reach the gateway's cookies, storage or API).
#[utoipa::path(get, path = "/v1/artifacts/{id}", tag = "artifacts", operation_id = "fetch_artifact",
    params(("id" = String, Path), ("If-None-Match" = Option<String>, Header, description = "the ETag of a copy the client holds")),
    responses((status = 200, description = "the artifact's bytes"),
              (status = 304, description = "the client's copy is current (an id always names the same bytes)"),
              (status = 404, description = "no such artifact, or not the caller's")))]
pub async fn fetch(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    request_headers: axum::http::HeaderMap,
) -> Result<Response, ApiError> {
    let store = state.sessions.artifacts();
    let not_found = || ApiError::not_found(format!("no artifact {id}")).code("no_such_artifact");
    let known = store
        .get(&id)
        .filter(|a| principal.may_see(a.owner.as_deref()))
        .ok_or_else(not_found)?;
    // An id always names the same bytes, so a client holding them (it sends their ETag,
    // the id) needs nothing more.
    if etag_matches(&request_headers, &known.id) {
        let mut response = StatusCode::NOT_MODIFIED.into_response();
        if let Ok(etag) = HeaderValue::from_str(&format!("\"{}\"", known.id)) {
            response.headers_mut().insert(header::ETAG, etag);
        }
        return Ok(response);
    }
    // A reference goes out before a large output's bytes are stored: wait for them.
    let (artifact, path) = store
        .open(&id, STORE_WAIT)
        .await
        .map_err(|err| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string()))?
        .ok_or_else(not_found)?;
    let file = tokio::fs::File::open(path).await.map_err(|err| {
        tracing::error!(artifact = %artifact.id, %err, "artifact file missing");
        ApiError::not_found(format!("no artifact {id}")).code("no_such_artifact")
    })?;
    let body = Body::from_stream(tokio_util::io::ReaderStream::with_capacity(
        file,
        STREAM_CHUNK,
    ));
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    let set = |headers: &mut axum::http::HeaderMap, name, value: &str| {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    };
    set(headers, header::CONTENT_TYPE, &content_type(&artifact));
    set(headers, header::CONTENT_LENGTH, &artifact.bytes.to_string());
    set(headers, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    // An id always names the same bytes.
    set(
        headers,
        header::CACHE_CONTROL,
        "private, max-age=31536000, immutable",
    );
    set(headers, header::ETAG, &format!("\"{}\"", artifact.id));
    if is_active_content(&artifact.mime) {
        set(headers, header::CONTENT_SECURITY_POLICY, "sandbox");
    }
    if let Some(path) = &artifact.path {
        let name: String = path
            .rsplit('/')
            .next()
            .unwrap_or("file")
            .chars()
            .filter(|c| c.is_ascii_graphic() && *c != '"' && *c != '\\')
            .collect();
        set(
            headers,
            header::CONTENT_DISPOSITION,
            &format!("inline; filename=\"{name}\""),
        );
    }
    Ok(response)
}
