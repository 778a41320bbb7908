//! API v1, the surface for chat apps and agents: sessions, typed execution results (JSON,
//! Server-Sent Events, or a WebSocket per session), artifacts and workspace files. The
//! handlers parse requests into calls on [`crate::sessions`], [`crate::artifacts`] and
//! [`crate::workspace`] and map their errors to [`ApiError`]. Contract: docs/api-v1.md.
//!
//! Routes live here, mounted in the gateway's router behind the auth layer. Bodies are
//! parsed with a 400 and serde's message; SSE when the client accepts `text/event-stream`;
//! the session WebSocket is `ws.rs` (JSON events out; `execute`, `interrupt`, `input_reply`,
//! `restart` in); artifacts are served with `nosniff` and, for HTML and SVG,
//! `Content-Security-Policy: sandbox`; uploads stream through a bounded channel to a
//! blocking writer. Streams in results and events are plain text (`sessions/plain.rs`: ANSI
//! stripped across chunk boundaries, carriage-return frames collapsed); the Kernel Gateway
//! surface never passes through that.
//!
//! The OpenAPI document at `/v1/openapi.json` ([`openapi`]) is generated from the same route
//! table, then given once what every route shares (the `ErrorBody` on each error status,
//! its `code` listed as the `ErrorCode` enum; 401 (but on the public signed-link route),
//! 429 and 500 and their headers; binary and SSE media types). It and the reference page
//! (`docs.rs`, Swagger UI embedded by `build.rs`) need no credential.
//!
//! Tenancy: every handler takes the request's [`Principal`]; a session, artifact or file of
//! another tenant answers 404 exactly like a missing one.

mod artifacts;
pub use artifacts::VerifiedLink;
mod body;
mod commands;
mod docs;
pub(super) mod files;
pub mod kernelspecs;
mod notebooks;
pub mod openapi;
mod sessions;
mod usage;
mod ws;

/// Read size when streaming a file or artifact to a client: tokio's default of 4 KiB costs a
/// read and a write per 4 KiB of a multi-megabyte image.
const STREAM_CHUNK: usize = 64 << 10;

use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;

use super::api_error::ApiError;
use super::auth::Principal;
use super::json_only;
use super::state::AppState;
use crate::gateway::ErrorCode;
use crate::ids::{ExecutionId, SessionId};
use crate::sessions::{Session, SessionError};
use crate::workspace::WorkspaceError;

/// The routes of API v1 that need no credential: its OpenAPI document and the reference
/// page that renders it.
pub fn public_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/openapi.json", get(openapi::document))
        // A signed link is its own credential (crate::artifacts::links).
        .route("/v1/artifacts/{id}/signed", get(artifacts::fetch_signed))
        .merge(docs::routes())
}

/// The routes of API v1 (to be mounted behind the auth layer).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/sessions",
            json_only(get(sessions::list).post(sessions::create)),
        )
        .route("/v1/kernelspecs", get(kernelspecs::list))
        .route(
            "/v1/sessions/{id}",
            get(sessions::get).delete(sessions::delete),
        )
        .route(
            "/v1/sessions/{id}/execute",
            json_only(post(sessions::execute)),
        )
        .route("/v1/sessions/{id}/executions", get(sessions::executions))
        .route(
            "/v1/sessions/{id}/executions/{execution_id}",
            get(sessions::execution),
        )
        .route("/v1/execute", json_only(post(sessions::execute_once)))
        .route(
            "/v1/sessions/{id}/interrupt",
            json_only(post(sessions::interrupt)),
        )
        .route(
            "/v1/sessions/{id}/restart",
            json_only(post(sessions::restart)),
        )
        .route("/v1/sessions/{id}/input", json_only(post(sessions::input)))
        .route("/v1/sessions/{id}/commands", json_only(post(commands::run)))
        .route("/v1/sessions/{id}/files", get(files::list))
        .route(
            "/v1/sessions/{id}/files/{*path}",
            // The JSON rule binds POST only: an upload's body is the file.
            json_only(
                get(files::download)
                    .head(files::head)
                    .put(files::upload)
                    .delete(files::remove)
                    .post(files::operate),
            ),
        )
        .route("/v1/sessions/{id}/artifacts", get(artifacts::list))
        .route("/v1/artifacts/{id}", get(artifacts::fetch))
        .route(
            "/v1/artifacts/{id}/links",
            json_only(post(artifacts::sign_link)),
        )
        .route("/v1/sessions/{id}/ws", get(ws::socket))
        .route("/v1/sessions/{id}/notebook", get(notebooks::export))
        .route("/v1/usage", get(usage::usage))
        .route(
            "/v1/notebooks/replay",
            json_only(post(notebooks::replay)).layer(axum::extract::DefaultBodyLimit::max(
                super::notebooks::MAX_NOTEBOOK_BYTES,
            )),
        )
}

/// The session a path names (`id`, as it came) if `principal` may see it; 404 otherwise,
/// the same for a malformed id, an unknown one and another tenant's.
///
/// A dormant session (its kernel lost in a gateway restart) answers 409 `kernel_dead` here:
/// the routes that need its kernel's process; [`live_session_for`] starts one instead.
fn session_for(
    state: &AppState,
    principal: &Principal,
    id: &str,
) -> Result<Arc<Session>, ApiError> {
    SessionId::parse(id)
        .ok()
        .and_then(|parsed| state.sessions.get(&parsed))
        .filter(|s| principal.may_see(s.owner.as_deref()))
        .ok_or_else(|| match dormant_for(state, principal, id) {
            Some(_) => ApiError::new(StatusCode::CONFLICT, crate::sessions::KERNEL_LOST)
                .code(ErrorCode::KernelDead),
            None => ApiError::not_found(format!("no session {id}")).code(ErrorCode::NoSuchSession),
        })
}

/// The dormant session a path names (known from the state directory, its kernel lost in a
/// gateway restart) if `principal` may see it.
fn dormant_for(
    state: &AppState,
    principal: &Principal,
    id: &str,
) -> Option<Arc<crate::sessions::Dormant>> {
    SessionId::parse(id)
        .ok()
        .and_then(|parsed| state.sessions.dormant(&parsed))
        .filter(|d| principal.may_see(d.owner()))
}

/// The session a path names, as [`session_for`], but a dormant one gets a new kernel first
/// (its owner's kernel cap applies): the routes that run code.
async fn live_session_for(
    state: &AppState,
    principal: &Principal,
    id: &str,
) -> Result<Arc<Session>, ApiError> {
    match dormant_for(state, principal, id) {
        Some(dormant) => {
            // The new kernel is a new sandbox: the caller's policy cap today applies, not
            // the one the session was created under (it may have been lowered since).
            crate::gateway::start_terms(state, principal, Some(&dormant.row.policy))?;
            let caps = dormant.owner().map_or((None, None), |t| {
                (
                    state.tenants.max_kernels(t),
                    state.tenants.concurrent_sessions(t),
                )
            });
            Ok(state.sessions.revive(&dormant.id, caps).await?)
        }
        None => awake_session_for(state, principal, id).await,
    }
}

/// The session a path names, as [`session_for`], its kernel restored first if it was
/// hibernated (saved to disk while idle): the routes that need its kernel's process
/// (files, and through [`live_session_for`] the ones that run code). A restore that fails
/// starts a fresh kernel (the session's generation moves on); only a kernel that cannot
/// start at all is an error here.
async fn awake_session_for(
    state: &AppState,
    principal: &Principal,
    id: &str,
) -> Result<Arc<Session>, ApiError> {
    let session = session_for(state, principal, id)?;
    session
        .kernel
        .wake()
        .await
        .map_err(|err| ApiError::from(SessionError::Kernel(err)))?;
    Ok(session)
}

/// The execution an `input` reply names (`None`: whichever waits). Body fields stay text
/// so that a malformed id is answered as before: no execution has it, so none waits for
/// input under it (409), where a typed field would have refused the body (400).
fn input_for(execution_id: Option<&str>) -> Result<Option<ExecutionId>, SessionError> {
    execution_id
        .map(ExecutionId::parse)
        .transpose()
        .map_err(|_| SessionError::NoInputAwaited)
}

impl From<SessionError> for ApiError {
    fn from(err: SessionError) -> ApiError {
        match err {
            SessionError::NotFound => {
                ApiError::not_found("no such session").code(ErrorCode::NoSuchSession)
            }
            SessionError::Kernel(err) => err.into(),
            SessionError::Workspace(err) => err.into(),
            SessionError::PolicyNotAllowed { .. } => {
                ApiError::bad_request(err.to_string()).code(ErrorCode::PolicyNotAllowed)
            }
            SessionError::CommandsUnsupported { .. } => {
                ApiError::new(StatusCode::CONFLICT, err.to_string())
                    .code(ErrorCode::CommandsUnsupported)
            }
            SessionError::NoInputAwaited => ApiError::new(
                StatusCode::CONFLICT,
                "no execution of this session is waiting for input",
            )
            .code(ErrorCode::NoInputAwaited),
            SessionError::Artifact(err) => {
                tracing::error!(%err, "artifact store failed");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Internal error; see the gateway's log",
                )
            }
        }
    }
}

impl From<WorkspaceError> for ApiError {
    fn from(err: WorkspaceError) -> ApiError {
        use WorkspaceError as E;
        match &err {
            E::BadPath { .. } => ApiError::bad_request(err.to_string()).code(ErrorCode::BadPath),
            E::NotFound(_) => ApiError::not_found(err.to_string()).code(ErrorCode::NoSuchFile),
            // A link answers like a missing file: the sandbox's links are never followed,
            // and whatever they point at is none of the client's business.
            E::Link(_) => ApiError::not_found(err.to_string()).code(ErrorCode::NoSuchFile),
            E::NotAFile(_) => {
                ApiError::new(StatusCode::CONFLICT, err.to_string()).code(ErrorCode::NotAFile)
            }
            E::IsADirectory(_) => {
                ApiError::new(StatusCode::CONFLICT, err.to_string()).code(ErrorCode::IsADirectory)
            }
            E::TooLarge { .. } => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, err.to_string()),
            E::NoSpace => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, err.to_string())
                .code(ErrorCode::WorkspaceFull),
            E::Exists(_) => {
                ApiError::new(StatusCode::CONFLICT, err.to_string()).code(ErrorCode::Exists)
            }
            E::PermissionDenied(_) => ApiError::new(StatusCode::FORBIDDEN, err.to_string())
                .code(ErrorCode::PermissionDenied),
            E::NotEmpty(_) => {
                ApiError::new(StatusCode::CONFLICT, err.to_string()).code(ErrorCode::NotEmpty)
            }
            E::Unavailable => ApiError::new(StatusCode::CONFLICT, err.to_string())
                .code(ErrorCode::WorkspaceUnavailable),
            E::Io { .. } => {
                tracing::error!(%err, "workspace operation failed");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Internal error; see the gateway's log",
                )
            }
        }
    }
}
