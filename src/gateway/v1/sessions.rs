//! Sessions and executions: create, list, get, delete; execute (blocking JSON or SSE);
//! one-shot execute; an execution's record, or its events resumed after `Last-Event-ID`;
//! interrupt, restart, input.
//!
//! Every SSE event carries its id in the session (the `id:` field, and `id` in its JSON), so
//! a client whose `POST …/execute` stream dropped resumes with a `GET` of the execution
//! (which an `EventSource` can also repeat by itself) from the last id it saw.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine;
use serde::Deserialize;
use tokio::sync::mpsc;
use utoipa::ToSchema;

use super::{body, dormant_for, live_session_for, session_for, ApiError};
use crate::gateway::auth::Principal;
use crate::gateway::state::AppState;
use crate::gateway::ErrorCode;
use crate::ids::{ExecutionId, SessionId};
use crate::sessions::{
    ExecutionRecord, ExecutionResult, ExecutionSummary, HistoryEntry, NewSession, Numbered,
    Session, SessionEvent, SessionModel, Sessions, MAX_HISTORY,
};

/// A file to put in the workspace when the session starts.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InitialFile {
    /// Relative to the workspace.
    pub path: String,
    pub content: String,
    /// `utf-8` (default) or `base64`.
    #[serde(default)]
    #[schema(pattern = "^(utf-8|utf8|base64)$")]
    pub encoding: Option<String>,
}

/// `POST /v1/sessions`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// Kernelspec name (default: the gateway's default kernel).
    #[serde(default)]
    pub kernel_name: Option<String>,
    /// Policy name (default: the tenant's policy, else `default`).
    #[serde(default)]
    pub policy: Option<String>,
    /// Environment variables for the kernel (`KERNEL_*` and the gateway's allowlist; any
    /// other name is refused).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub files: Vec<InitialFile>,
}

/// `POST /v1/sessions/{id}/execute`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteRequest {
    pub code: String,
    /// Interrupt the cell after this many seconds and report `timeout` (the policy's
    /// execution timeout applies as well).
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 86400)]
    pub timeout_s: Option<f64>,
}

/// `POST /v1/execute`: one execution in a fresh session that is deleted afterwards
/// (its artifacts stay for the retention period).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteOnceRequest {
    pub code: String,
    /// As for `POST /v1/sessions/{id}/execute`.
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 86400)]
    pub timeout_s: Option<f64>,
    #[serde(default)]
    pub kernel_name: Option<String>,
    #[serde(default)]
    pub policy: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub files: Vec<InitialFile>,
}

/// `POST /v1/sessions/{id}/input`: the answer to `input()`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InputRequest {
    pub value: String,
    /// The execution asking (default: whichever waits).
    #[serde(default)]
    pub execution_id: Option<String>,
}

fn timeout_of(seconds: Option<f64>) -> Result<Option<Duration>, ApiError> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => {
            Ok(Some(Duration::from_secs_f64(s)))
        }
        Some(_) => Err(ApiError::bad_request(
            "timeout_s must be a number of seconds above 0 and at most 86400",
        )),
    }
}

/// The session `principal` asked for, on the terms a tenant gets (`gateway::start_terms`):
/// its policy capped (403 past the cap; its claim's policy when it names none), its kernel
/// cap, and itself as the owner.
fn new_session(
    state: &AppState,
    principal: &Principal,
    kernel_name: Option<String>,
    policy: Option<String>,
    env: BTreeMap<String, String>,
) -> Result<NewSession, ApiError> {
    let terms = crate::gateway::start_terms(state, principal, policy.as_deref())?;
    Ok(NewSession {
        kernel_name,
        policy: terms.policy,
        env,
        owner: terms.owner.as_ref().map(|o| o.tenant.clone()),
        // start_terms has already capped the policy.
        policy_ceiling: None,
        max_kernels: terms.owner.as_ref().and_then(|o| o.max_kernels),
        concurrent_sessions: terms.owner.and_then(|o| o.concurrent_sessions),
    })
}

/// Decodes and checks the initial files before any kernel starts.
fn decode_files(files: Vec<InitialFile>) -> Result<Vec<(String, Vec<u8>)>, ApiError> {
    let mut decoded = Vec::new();
    for file in files {
        let bytes = match file.encoding.as_deref() {
            None | Some("utf-8") | Some("utf8") => file.content.into_bytes(),
            Some("base64") => base64::engine::general_purpose::STANDARD
                .decode(file.content.as_bytes())
                .map_err(|err| {
                    ApiError::bad_request(format!("file {}: invalid base64: {err}", file.path))
                })?,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "file {}: unknown encoding {other:?} (utf-8 or base64)",
                    file.path
                )))
            }
        };
        crate::workspace::check_path(&file.path)?;
        decoded.push((file.path, bytes));
    }
    Ok(decoded)
}

/// Writes the initial files into a new session's workspace.
async fn write_initial_files(
    state: &AppState,
    session: &Arc<Session>,
    files: Vec<(String, Vec<u8>)>,
) -> Result<(), ApiError> {
    if files.is_empty() {
        return Ok(());
    }
    let limit = super::files::upload_limit(state, session);
    let session = session.clone();
    tokio::task::spawn_blocking(move || -> Result<(), ApiError> {
        let workspace = session.open_workspace()?;
        for (path, bytes) in files {
            let mut upload = workspace.create(&path, limit)?;
            upload.write(&bytes)?;
            upload.commit()?;
        }
        Ok(())
    })
    .await
    .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "file task failed"))?
}

async fn create_session(
    state: &AppState,
    principal: &Principal,
    request: CreateSession,
) -> Result<Arc<Session>, ApiError> {
    let files = decode_files(request.files)?;
    let new = new_session(
        state,
        principal,
        request.kernel_name,
        request.policy,
        request.env,
    )?;
    // Kernel Gateway's surface drops what a client may not set, as Kernel Gateway does; a
    // v1 client is told, so a setting never silently goes missing.
    let mut env = new.env.clone();
    if let Some(policy) = &new.policy {
        env.insert(crate::kernel::POLICY_ENV.to_owned(), policy.clone());
    }
    if let Some(refusal) = state
        .sessions
        .kernels()
        .refused_env(new.kernel_name.as_deref(), &env)?
    {
        let list = |items: &[String]| {
            if items.is_empty() {
                "none".to_owned()
            } else {
                items.join(", ")
            }
        };
        return Err(ApiError::bad_request(format!(
            "env: policy {:?} does not let a client set {} (a client may set KERNEL_* variables but KERNEL_WORKING_DIR, the gateway's env_allowlist ({}), and what the policy's [environment] allow names ({}), never a name the sandbox reserves)",
            refusal.policy,
            refusal.names.join(", "),
            list(&refusal.allowlist),
            list(&refusal.patterns),
        ))
        .code(ErrorCode::EnvNotAllowed));
    }
    let session = state.sessions.create(new).await?;
    if let Err(err) = write_initial_files(state, &session, files).await {
        let _ = state.sessions.delete(&session.id).await;
        return Err(err);
    }
    Ok(session)
}

/// Create a session: a kernel in its sandbox, ready when this answers.
#[utoipa::path(post, path = "/v1/sessions", tag = "sessions", operation_id = "create_session",
    request_body = CreateSession,
    responses((status = 201, body = SessionModel), (status = 400), (status = 403), (status = 404, description = "unknown kernelspec")))]
pub async fn create(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: CreateSession = body::parse(&body)?;
    let session = create_session(&state, &principal, request).await?;
    let location = format!("{}v1/sessions/{}", state.config.base_url, session.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(session.model()),
    )
        .into_response())
}

/// The caller's sessions.
#[utoipa::path(get, path = "/v1/sessions", tag = "sessions", operation_id = "list_sessions",
    responses((status = 200, body = Vec<SessionModel>)))]
pub async fn list(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
) -> Json<Vec<SessionModel>> {
    Json(
        state
            .sessions
            .models()
            .into_iter()
            .filter(|(owner, _)| principal.may_see(owner.as_deref()))
            .map(|(_, model)| model)
            .collect(),
    )
}

#[utoipa::path(get, path = "/v1/sessions/{id}", tag = "sessions", operation_id = "get_session",
    params(("id" = String, Path)),
    responses((status = 200, body = SessionModel), (status = 404)))]
pub async fn get(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<SessionModel>, ApiError> {
    if let Some(dormant) = dormant_for(&state, &principal, &id) {
        return Ok(Json(state.sessions.dormant_model(&dormant)));
    }
    Ok(Json(session_for(&state, &principal, &id)?.model()))
}

/// Shut the kernel down; artifacts stay fetchable for the retention period.
#[utoipa::path(delete, path = "/v1/sessions/{id}", tag = "sessions", operation_id = "delete_session",
    params(("id" = String, Path)),
    responses((status = 204), (status = 404)))]
pub async fn delete(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if let Some(dormant) = dormant_for(&state, &principal, &id) {
        state.sessions.delete(&dormant.id).await?;
        return Ok(StatusCode::NO_CONTENT);
    }
    let session = session_for(&state, &principal, &id)?;
    state.sessions.delete(&session.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) fn wants_sse(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("text/event-stream"))
}

/// The events as SSE: `id: <id in the session>`, `event: <type>`, `data: <event JSON>`
/// (with `id` too), ending with `done`. With `delete_after`, that session is deleted before
/// `done` goes out (one-shot executes), so a client that saw `done` never sees the session
/// again.
fn sse(
    events: mpsc::UnboundedReceiver<Numbered>,
    delete_after: Option<(Arc<Sessions>, SessionId)>,
) -> Response {
    let stream = futures_util::stream::unfold(
        (events, delete_after, false),
        |(mut events, delete_after, finished)| async move {
            if finished {
                return None;
            }
            let event = events.recv().await?;
            let done = matches!(*event.event, SessionEvent::Done { .. });
            let delete_after = match (done, delete_after) {
                (true, Some((sessions, id))) => {
                    let _ = sessions.end(&id).await;
                    None
                }
                (_, pending) => pending,
            };
            let sse_event = Event::default()
                .id(event.id.to_string())
                .event(event.event.kind())
                .json_data(&event)
                .unwrap_or_else(|_| Event::default().event("error").data("unserialisable event"));
            Some((Ok::<_, Infallible>(sse_event), (events, delete_after, done)))
        },
    );
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

async fn wait_for_result(
    mut events: mpsc::UnboundedReceiver<Numbered>,
) -> Result<ExecutionResult, ApiError> {
    while let Some(event) = events.recv().await {
        if let SessionEvent::Done { result, .. } = &*event.event {
            return Ok((**result).clone());
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the execution ended without a result",
    )
    .code(ErrorCode::NoResult))
}

/// Run code; one JSON result, or with `Accept: text/event-stream` the events as they come.
#[utoipa::path(post, path = "/v1/sessions/{id}/execute", tag = "execute", operation_id = "execute",
    params(("id" = String, Path)),
    request_body = ExecuteRequest,
    responses(
        (status = 200, body = ExecutionResult, description = "JSON result; or `text/event-stream` of SessionEvent when asked"),
        (status = 400), (status = 404)))]
pub async fn execute(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    // An unknown session is 404 before its body is looked at.
    if dormant_for(&state, &principal, &id).is_none() {
        session_for(&state, &principal, &id)?;
    }
    let request: ExecuteRequest = body::parse(&body)?;
    super::usage::check_quota(&state, &principal).await?;
    let session = live_session_for(&state, &principal, &id).await?;
    let timeout = timeout_of(request.timeout_s)?;
    let events = session.execute(request.code, timeout);
    if wants_sse(&headers) {
        return Ok(sse(events, None));
    }
    Ok(Json(wait_for_result(events).await?).into_response())
}

/// `GET /v1/sessions/{id}/executions`'s query.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExecutionsQuery {
    /// How many of the newest executions (default 100, at most 10000).
    #[serde(default)]
    #[param(value_type = Option<u32>, minimum = 1, maximum = 10000)]
    pub limit: Option<String>,
}

/// Executions listed when no `limit` is given.
const DEFAULT_EXECUTIONS_LISTED: usize = 100;

/// The session's newest executions, oldest first (the running one last): for a client that
/// lost an execution's id (a blocking execute whose connection dropped, a reloaded page).
#[utoipa::path(get, path = "/v1/sessions/{id}/executions", tag = "execute", operation_id = "list_executions",
    params(("id" = String, Path), ExecutionsQuery),
    responses((status = 200, body = Vec<ExecutionSummary>), (status = 400, description = "a limit that is not 1 to 10000"), (status = 404)))]
pub async fn executions(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<ExecutionsQuery>, QueryRejection>,
) -> Result<Json<Vec<ExecutionSummary>>, ApiError> {
    let Query(query) = query.map_err(|err| ApiError::bad_request(err.body_text()))?;
    let session = session_or_dormant(&state, &principal, &id)?;
    // Text in the query, so a bad value is this route's 400 rather than the extractor's.
    let limit = match query.limit.as_deref() {
        None => DEFAULT_EXECUTIONS_LISTED,
        Some(text) => text
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_HISTORY).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request(format!("limit must be a number from 1 to {MAX_HISTORY}"))
            })?,
    };
    Ok(Json(match session {
        Held::Live(session) => session.executions(limit),
        Held::Dormant(entries) => entries
            .iter()
            .skip(entries.len().saturating_sub(limit))
            .map(ExecutionSummary::from)
            .collect(),
    }))
}

/// A session's executions as a path names it: a live session, or the executions the store
/// kept of a dormant one (after a gateway restart, before its next execute revives it), so
/// that a client can still fetch a result it never saw.
enum Held {
    Live(Arc<Session>),
    Dormant(Vec<HistoryEntry>),
}

fn session_or_dormant(state: &AppState, principal: &Principal, id: &str) -> Result<Held, ApiError> {
    match session_for(state, principal, id) {
        Ok(session) => Ok(Held::Live(session)),
        Err(err) => match dormant_for(state, principal, id) {
            Some(dormant) => Ok(Held::Dormant(dormant.executions())),
            None => Err(err),
        },
    }
}

/// `GET /v1/sessions/{id}/executions/{execution_id}`'s query: where to resume from (an
/// `EventSource` sends `Last-Event-ID` by itself when it reconnects; this is for the first
/// request, or a client that cannot set headers).
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExecutionQuery {
    /// Send only the events after this id (the `Last-Event-ID` header wins).
    #[serde(default)]
    pub last_event_id: Option<String>,
}

/// The id a resuming client saw last: `Last-Event-ID`, else the query's `last_event_id`,
/// else 0 (from the start). An id that is not a number is a 400: resuming from a guess
/// could skip events.
fn last_event_id(headers: &HeaderMap, query: Option<&str>) -> Result<u64, ApiError> {
    let header = headers.get("last-event-id").map(|value| value.to_str());
    let text = match (header, query) {
        (Some(Ok(text)), _) | (None, Some(text)) => text.trim(),
        (Some(Err(_)), _) => return Err(ApiError::bad_request("Last-Event-ID is not text")),
        (None, None) => return Ok(0),
    };
    if text.is_empty() {
        return Ok(0);
    }
    text.parse().map_err(|_| {
        ApiError::bad_request(format!(
            "last event id {text:?} is not an event id (a whole number)"
        ))
    })
}

/// An execution of the session, running or done: as JSON its record (every event so far
/// with its id, the result once done); with `Accept: text/event-stream` its events after
/// `Last-Event-ID` (or from the start), those recorded and then the rest as they come,
/// ending with `done`.
#[utoipa::path(get, path = "/v1/sessions/{id}/executions/{execution_id}", tag = "execute", operation_id = "get_execution",
    params(("id" = String, Path), ("execution_id" = String, Path),
        ("Last-Event-ID" = Option<String>, Header, description = "with `text/event-stream`: resume after this event id"),
        ExecutionQuery),
    responses(
        (status = 200, body = ExecutionRecord, description = "JSON record; or `text/event-stream` of NumberedEvent when asked"),
        (status = 400, description = "a last event id that is not a number"),
        (status = 404, description = "no such session or execution (or not the caller's)")))]
pub async fn execution(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path((id, execution_id)): Path<(String, String)>,
    query: Result<Query<ExecutionQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|err| ApiError::bad_request(err.body_text()))?;
    let held = session_or_dormant(&state, &principal, &id)?;
    let unknown = || {
        ApiError::not_found(format!("no execution {execution_id} in session {id}"))
            .code(ErrorCode::NoSuchExecution)
    };
    // A malformed id is answered as an unknown one, as every id is.
    let parsed = ExecutionId::parse(&execution_id).map_err(|_| unknown())?;
    let session = match held {
        Held::Live(session) => session,
        Held::Dormant(entries) => {
            let entry = entries
                .iter()
                .find(|e| e.execution_id == parsed)
                .ok_or_else(unknown)?;
            if wants_sse(&headers) {
                let after = last_event_id(&headers, query.last_event_id.as_deref())?;
                let (tx, rx) = mpsc::unbounded_channel();
                if let Some(done) = entry.restored_done(after) {
                    let _ = tx.send(done);
                }
                return Ok(sse(rx, None));
            }
            return Ok(Json(ExecutionRecord::from(entry)).into_response());
        }
    };
    if wants_sse(&headers) {
        let after = last_event_id(&headers, query.last_event_id.as_deref())?;
        let events = session.follow(&parsed, after).ok_or_else(unknown)?;
        return Ok(sse(events, None));
    }
    let record = session.execution(&parsed).ok_or_else(unknown)?;
    Ok(Json(record).into_response())
}

/// One-shot execute (for an agent's stateless code tool; MCP's `run_python` keeps a session): a fresh session, one execution,
/// deleted afterwards.
#[utoipa::path(post, path = "/v1/execute", tag = "execute", operation_id = "execute_once",
    request_body = ExecuteOnceRequest,
    responses((status = 200, body = ExecutionResult), (status = 400),
        (status = 404, description = "no such kernelspec")))]
pub async fn execute_once(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: ExecuteOnceRequest = body::parse(&body)?;
    let timeout = timeout_of(request.timeout_s)?;
    super::usage::check_quota(&state, &principal).await?;
    let session = create_session(
        &state,
        &principal,
        CreateSession {
            kernel_name: request.kernel_name,
            policy: request.policy,
            env: request.env,
            files: request.files,
        },
    )
    .await?;
    let events = session.execute(request.code, timeout);
    if wants_sse(&headers) {
        return Ok(sse(
            events,
            Some((state.sessions.clone(), session.id.clone())),
        ));
    }
    let result = wait_for_result(events).await;
    // Gone before the answer: a one-shot session never shows up in a later listing.
    if let Err(err) = state.sessions.end(&session.id).await {
        tracing::warn!(session_id = %session.id, %err, "one-shot session not deleted");
    }
    Ok(Json(result?).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/interrupt", tag = "execute", operation_id = "interrupt",
    params(("id" = String, Path)),
    responses((status = 204), (status = 404)))]
pub async fn interrupt(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    session_for(&state, &principal, &id)?
        .interrupt()
        .await
        .map_err(|err| {
            // Not to be repeated later: a late interrupt would stop the next cell.
            let mut err = ApiError::from(err);
            err.retry_after = None;
            err
        })?;
    Ok(StatusCode::NO_CONTENT)
}

/// Restart the kernel: variables and workspace files are lost; `state_generation` changes.
#[utoipa::path(post, path = "/v1/sessions/{id}/restart", tag = "execute", operation_id = "restart",
    params(("id" = String, Path)),
    responses((status = 200, body = SessionModel), (status = 404)))]
pub async fn restart(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<SessionModel>, ApiError> {
    if let Some(dormant) = dormant_for(&state, &principal, &id) {
        // A new kernel is what a restart gives: not the one hibernated before the gateway
        // restarted, which its revival would restore.
        let kernels = state.sessions.kernels();
        if kernels
            .hibernated_generation(&dormant.id.kernel(), &dormant.row.policy)
            .is_some()
        {
            kernels.forget_sandbox(&dormant.id.kernel(), &dormant.row.policy);
        }
        return Ok(Json(
            live_session_for(&state, &principal, &id).await?.model(),
        ));
    }
    let session = session_for(&state, &principal, &id)?;
    session.restart().await?;
    Ok(Json(session.model()))
}

/// Answer the `input()` an execution waits for (409 when none waits).
#[utoipa::path(post, path = "/v1/sessions/{id}/input", tag = "execute", operation_id = "send_input",
    params(("id" = String, Path)),
    request_body = InputRequest,
    responses((status = 204), (status = 404), (status = 409)))]
pub async fn input(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let session = session_for(&state, &principal, &id)?;
    let request: InputRequest = body::parse(&body)?;
    let execution_id = super::input_for(request.execution_id.as_deref())?;
    session
        .input_reply(execution_id.as_ref(), &request.value)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
