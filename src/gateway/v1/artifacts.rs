//! Artifacts: a session's list, and the bytes of one by id with the headers that keep
//! active content (HTML, SVG) from ever running in the gateway's origin, with a credential or
//! through a signed link (`crate::artifacts::links`).

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use super::{dormant_for, session_for, ApiError, STREAM_CHUNK};
use crate::artifacts::links::LinkError;
use crate::artifacts::{is_active_content, Artifact};
use crate::gateway::auth::Principal;
use crate::gateway::state::AppState;
use crate::gateway::ErrorCode;
use crate::ids::ArtifactId;
use crate::sessions::{expiry_timestamp, ArtifactRef};

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
    let session_id = match dormant_for(&state, &principal, &id) {
        Some(dormant) => dormant.id.clone(),
        None => session_for(&state, &principal, &id)?.id.clone(),
    };
    let options = state.sessions.options();
    Ok(Json(
        state
            .sessions
            .artifacts()
            .list(session_id.as_str())
            .iter()
            .map(|a| options.reference(a))
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
    let known = ArtifactId::parse(&id)
        .ok()
        .and_then(|parsed| state.sessions.artifacts().get(&parsed))
        .filter(|a| principal.may_see(a.owner.as_deref()))
        .ok_or_else(|| not_found(&id))?;
    // An id always names the same bytes.
    serve(
        &state,
        &known,
        &request_headers,
        "private, max-age=31536000, immutable",
    )
    .await
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("no artifact {id}")).code(ErrorCode::NoSuchArtifact)
}

/// The query of a signed link.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LinkQuery {
    /// Unix seconds after which the link no longer works (required).
    #[serde(default)]
    expires: Option<String>,
    /// A tag of the artifact's owner, base64url (required).
    #[serde(default)]
    owner: Option<String>,
    /// base64url HMAC-SHA256 (unpadded) of the artifact's id, the owner's tag and `expires`
    /// (required).
    #[serde(default)]
    signature: Option<String>,
}

/// Marks a 404 to a signed link that verified but names an artifact this gateway does not
/// hold: the only refusal a replica asks its peers about (`replicas::artifacts_anywhere`).
#[derive(Clone, Copy, Debug)]
pub struct VerifiedLink;

/// The artifact's bytes through a signed link, with no credential: what a page puts in
/// `<img src>`. The link comes in every artifact reference (`signed_url`) or from
/// `POST /v1/artifacts/{id}/links`; it works until it expires and while the artifact's
/// session is not deleted. A link that is altered, for another artifact, or whose session a
/// client deleted answers 404, as an unknown id does.
#[utoipa::path(get, path = "/v1/artifacts/{id}/signed", tag = "artifacts", operation_id = "fetch_artifact_signed",
    params(("id" = String, Path), LinkQuery),
    responses((status = 200, description = "the artifact's bytes"),
              (status = 304, description = "the client's copy is current"),
              (status = 400, description = "the link is malformed (`malformed_link`)"),
              (status = 403, description = "the link has expired (`link_expired`) or reaches further ahead than this gateway signs (`link_too_long`)"),
              (status = 404, description = "no such artifact, its session was deleted, the link is not for it, or links are off (`links_off`)"),
              (status = 429, description = "the artifact's tenant is over its request rate")))]
pub async fn fetch_signed(
    State(state): State<AppState>,
    Path(id): Path<String>,
    query: Result<Query<LinkQuery>, axum::extract::rejection::QueryRejection>,
    request_headers: axum::http::HeaderMap,
) -> Result<Response, ApiError> {
    let Some(signer) = state.sessions.options().links.clone() else {
        return Err(links_off());
    };
    let malformed = |message: String| ApiError::bad_request(message).code(ErrorCode::MalformedLink);
    let Query(query) = query.map_err(|err| malformed(format!("a signed link's query: {err}")))?;
    let (Some(expires), Some(owner), Some(signature)) =
        (&query.expires, &query.owner, &query.signature)
    else {
        return Err(malformed(
            "a signed link has expires, owner and signature in its query".to_owned(),
        ));
    };
    // Everything the MAC covers is in the link: a forged or altered one is refused here,
    // before anything is looked up or any replica asked.
    let checked = signer
        .check(&id, expires, owner, signature)
        .map_err(|err| match err {
            LinkError::Expired => {
                ApiError::new(StatusCode::FORBIDDEN, err.to_string()).code(ErrorCode::LinkExpired)
            }
            LinkError::TooFarAhead => {
                ApiError::new(StatusCode::FORBIDDEN, err.to_string()).code(ErrorCode::LinkTooLong)
            }
            LinkError::BadSignature => {
                tracing::info!(artifact = %id, "artifact link refused: signature does not match");
                not_found(&id)
            }
            other => malformed(other.to_string()),
        })?;
    // Not once a client deleted the session: that revokes its links. The id is parsed only
    // now, so that a malformed one is answered as an unknown one, after the same checks.
    let linkable = ArtifactId::parse(&id)
        .ok()
        .and_then(|parsed| state.sessions.artifacts().get_linkable(&parsed));
    let Some(known) = linkable else {
        let mut response = not_found(&id).into_response();
        response.extensions_mut().insert(VerifiedLink);
        return Ok(response);
    };
    if !signer.owned_by(&checked, &known) {
        tracing::info!(artifact = %id, "artifact link refused: not the artifact's owner");
        return Err(not_found(&id));
    }
    // The link spends its tenant's requests, as the tenant's own fetch would.
    if let Some(tenant) = known.owner.as_deref() {
        crate::gateway::access_log::record_tenant(tenant);
        if let Err(err) = state.tenants.check_rate(tenant) {
            return Ok(crate::gateway::auth::rate_limited(tenant, err));
        }
    }
    let mut response = serve(
        &state,
        &known,
        &request_headers,
        &format!("private, max-age={}", checked.remaining_secs()),
    )
    .await?;
    // The link is a credential: never sent on as a Referer by what the page does next.
    response.headers_mut().insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    Ok(response)
}

/// What `POST /v1/artifacts/{id}/links` takes.
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LinkRequest {
    /// Seconds the link works, from 1 to the gateway's maximum
    /// (`--artifact-link-max-ttl`, 7 days unless set) [default: the gateway's link TTL].
    #[serde(default)]
    ttl_s: Option<u64>,
}

/// A signed link.
#[derive(Debug, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct LinkResponse {
    /// Relative to the gateway's base URL, as artifact URLs are.
    pub url: String,
    /// RFC 3339, UTC.
    pub expires: String,
}

/// A signed link to one artifact for as long as asked (within the gateway's maximum): for a
/// page that keeps a chat transcript longer than the links in its references last.
#[utoipa::path(post, path = "/v1/artifacts/{id}/links", tag = "artifacts", operation_id = "sign_artifact_link",
    params(("id" = String, Path)),
    request_body(content = LinkRequest, description = "optional"),
    responses((status = 200, body = LinkResponse),
              (status = 400, description = "a TTL of zero or past the maximum"),
              (status = 404, description = "no such artifact, not the caller's, its session was deleted, or links are off")))]
pub async fn sign_link(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<LinkResponse>, ApiError> {
    let request: LinkRequest = super::body::parse(&body)?;
    let options = state.sessions.options();
    let Some(signer) = options.links.as_deref() else {
        return Err(links_off());
    };
    let known = ArtifactId::parse(&id)
        .ok()
        .and_then(|parsed| state.sessions.artifacts().get_linkable(&parsed))
        .filter(|a| principal.may_see(a.owner.as_deref()))
        .ok_or_else(|| not_found(&id))?;
    let ttl = request
        .ttl_s
        .map(std::time::Duration::from_secs)
        .unwrap_or(signer.ttl());
    let link = signer
        .sign_for(&known, &options.base_url, ttl)
        .map_err(|err| ApiError::bad_request(err.to_string()).code(ErrorCode::BadTtl))?;
    Ok(Json(LinkResponse {
        url: link.url,
        expires: expiry_timestamp(link.expires),
    }))
}

fn links_off() -> ApiError {
    ApiError::not_found("this gateway signs no artifact links (--artifact-link-ttl 0s)")
        .code(ErrorCode::LinksOff)
}

/// The bytes of `known`, with the headers every artifact gets and `cache_control`.
async fn serve(
    state: &AppState,
    known: &Artifact,
    request_headers: &axum::http::HeaderMap,
    cache_control: &str,
) -> Result<Response, ApiError> {
    let id = &known.id;
    // An id always names the same bytes, so a client holding them (it sends their ETag,
    // the id) needs nothing more.
    if etag_matches(request_headers, id.as_str()) {
        let mut response = StatusCode::NOT_MODIFIED.into_response();
        if let Ok(etag) = HeaderValue::from_str(&format!("\"{id}\"")) {
            response.headers_mut().insert(header::ETAG, etag);
        }
        return Ok(response);
    }
    // A reference goes out before a large output's bytes are stored: wait for them.
    let (artifact, path) = state
        .sessions
        .artifacts()
        .open(id, STORE_WAIT)
        .await
        .map_err(|err| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string()))?
        .ok_or_else(|| not_found(id.as_str()))?;
    let file = tokio::fs::File::open(path).await.map_err(|err| {
        tracing::error!(artifact = %artifact.id, %err, "artifact file missing");
        not_found(id.as_str())
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
    set(headers, header::CACHE_CONTROL, cache_control);
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
