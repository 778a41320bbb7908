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
#[utoipa::path(get, path = "/v1/sessions/{id}/artifacts", tag = "artifacts",
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
#[utoipa::path(get, path = "/v1/artifacts/{id}", tag = "artifacts",
    params(("id" = String, Path)),
    responses((status = 200, description = "the artifact's bytes"), (status = 404)))]
pub async fn fetch(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let store = state.sessions.artifacts();
    let not_found = || ApiError::not_found(format!("no artifact {id}"));
    store
        .get(&id)
        .filter(|a| principal.may_see(a.owner.as_deref()))
        .ok_or_else(not_found)?;
    // A reference goes out before a large output's bytes are stored: wait for them.
    let (artifact, path) = store
        .open(&id, STORE_WAIT)
        .await
        .map_err(|err| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string()))?
        .ok_or_else(not_found)?;
    let file = tokio::fs::File::open(path).await.map_err(|err| {
        tracing::error!(artifact = %artifact.id, %err, "artifact file missing");
        ApiError::not_found(format!("no artifact {id}"))
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
