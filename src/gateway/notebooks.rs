//! Notebook routes (cellgate extensions of the Kernel Gateway surface):
//! `GET /api/kernels/{id}/notebook` exports a kernel's history as nbformat 4.5;
//! `POST /api/notebooks/replay` replays an uploaded notebook in a fresh kernel and answers
//! `{notebook, report, matched}`, or streams progress as server-sent events when the client
//! accepts `text/event-stream`.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api_error::ApiError;
use super::kernels::lookup_for;
use super::state::AppState;
use super::Principal;
use crate::kernel::Kernel;
use crate::notebook::{
    export_notebook, parse_notebook, replay, replay_in, start_kernel, KernelspecInfo,
    NotebookError, ReplayOptions, ReplayOutcome,
};

/// Largest notebook a replay accepts (images inline make notebooks big).
pub const MAX_NOTEBOOK_BYTES: usize = 64 << 20;
/// Longest per-cell timeout a request may ask for.
const MAX_TIMEOUT_S: f64 = 3600.0;

impl From<NotebookError> for ApiError {
    fn from(err: NotebookError) -> ApiError {
        match err {
            NotebookError::Kernel(inner) => ApiError::from(inner),
            NotebookError::KernelLost(_) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
            }
            NotebookError::Write(_) => {
                tracing::error!(%err, "notebook could not be written");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Internal error; see the gateway's log",
                )
            }
            _ => ApiError::bad_request(err.to_string()),
        }
    }
}

/// `GET /api/kernels/{id}/notebook`: the kernel's history as an .ipynb (nbformat 4.5).
pub async fn export_kernel_notebook(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let kernel = lookup_for(&state, &principal, &id)?;
    notebook_response(&kernel, &id)
}

/// The kernel's history as an .ipynb download (nbformat 4.5).
pub(super) fn notebook_response(kernel: &Kernel, id: &str) -> Result<Response, ApiError> {
    let history = kernel.router().history().snapshot();
    history_response(&history, &KernelspecInfo::from(kernel.spec.as_ref()), id)
}

/// A history as an .ipynb download (nbformat 4.5).
pub(super) fn history_response(
    history: &crate::kernel::HistorySnapshot,
    info: &KernelspecInfo,
    id: &str,
) -> Result<Response, ApiError> {
    let text = export_notebook(history, info)?;
    let mut response = text.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ipynb+json"),
    );
    let disposition = format!("attachment; filename=\"kernel-{id}.ipynb\"");
    if let Ok(value) = HeaderValue::from_str(&disposition) {
        response
            .headers_mut()
            .insert(header::CONTENT_DISPOSITION, value);
    }
    Ok(response)
}

#[derive(Deserialize, Default)]
pub struct ReplayQuery {
    policy: Option<String>,
    allow_errors: Option<bool>,
    timeout_s: Option<f64>,
}

/// The replay request: the .ipynb itself, or `{"notebook": …, "policy", "allow_errors",
/// "timeout_s"}`; query parameters fill what the body leaves out.
fn parse_request(
    body: &[u8],
    query: ReplayQuery,
) -> Result<(crate::notebook::ParsedNotebook, ReplayOptions), ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::bad_request("the notebook is not UTF-8 text"))?;
    let root: Value = serde_json::from_str(text)
        .map_err(|err| ApiError::from(NotebookError::NotJson(err.to_string())))?;
    let wrapped = root.get("notebook").is_some() && root.get("cells").is_none();
    let fields = if wrapped {
        root.as_object().cloned()
    } else {
        None
    };
    let get = |key: &str| {
        fields
            .as_ref()
            .and_then(|f| f.get(key))
            .filter(|v| !v.is_null())
            .cloned()
    };
    let policy = match get("policy") {
        Some(Value::String(p)) => Some(p),
        Some(_) => return Err(ApiError::bad_request("policy: expected a string")),
        None => query.policy,
    };
    let allow_errors = match get("allow_errors") {
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(ApiError::bad_request(
                "allow_errors: expected true or false",
            ))
        }
        None => query.allow_errors.unwrap_or(false),
    };
    let timeout_s = match get("timeout_s") {
        Some(v) => Some(
            v.as_f64()
                .ok_or_else(|| ApiError::bad_request("timeout_s: expected a number of seconds"))?,
        ),
        None => query.timeout_s,
    };
    let timeout = match timeout_s {
        Some(t) if t > 0.0 && t <= MAX_TIMEOUT_S => Some(Duration::from_secs_f64(t)),
        Some(_) => {
            return Err(ApiError::bad_request(format!(
                "timeout_s: expected a number of seconds between 0 and {MAX_TIMEOUT_S}"
            )))
        }
        None => None,
    };
    // Options first: they are cheap to check, the notebook may be large.
    let parsed = match (wrapped, &root["notebook"]) {
        // The .ipynb text itself, as a string.
        (true, Value::String(text)) => parse_notebook(text)?,
        (true, other) => parse_notebook(&other.to_string())?,
        (false, _) => parse_notebook(text)?,
    };
    Ok((
        parsed,
        ReplayOptions {
            policy,
            allow_errors,
            timeout,
            // Set by the handler from the caller's start terms.
            owner: None,
        },
    ))
}

fn outcome_json(outcome: &ReplayOutcome) -> Value {
    let notebook: Value = serde_json::from_str(&outcome.notebook).unwrap_or(Value::Null);
    json!({"notebook": notebook, "report": outcome.report, "matched": outcome.matched})
}

/// `POST /api/notebooks/replay`.
pub async fn replay_notebook(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    query: Result<Query<ReplayQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|err| ApiError::bad_request(err.body_text()))?;
    let (parsed, mut options) = parse_request(&body, query)?;
    // A replay kernel is started on the same terms as any other kernel of the caller: a
    // tenant's runs under a policy its cap allows (its claim's by default), is its own, and
    // counts against its kernel cap (403 past it, before any work is done).
    let terms = super::start_terms(&state, &principal, options.policy.as_deref())?;
    if let Some(policy) = terms.policy {
        options.policy = Some(policy);
    }
    options.owner = terms.owner;
    let wants_events = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    if !wants_events {
        // In its own task: a client that hangs up must not cancel the replay half-way, which
        // would leave its kernel running (the task shuts it down when done).
        let kernels = state.kernels.clone();
        let task = tokio::spawn(async move { replay(&kernels, parsed, &options, None).await });
        let outcome = task.await.map_err(|err| {
            tracing::error!(%err, "replay task failed");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal error; see the gateway's log",
            )
        })??;
        return Ok(Json(outcome_json(&outcome)).into_response());
    }
    let (events_tx, events_rx) = mpsc::unbounded_channel::<Event>();
    // The kernel starts before the stream does, so a refusal (the tenant's cap, an unknown
    // policy) is this response's status and not an event inside a 200 stream. It starts in
    // the task all the same: a client that hangs up meanwhile leaves no kernel behind.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<Result<(), ApiError>>();
    tokio::spawn(async move {
        let kernel = match start_kernel(&state.kernels, &parsed, &options).await {
            Ok(kernel) => {
                let _ = started_tx.send(Ok(()));
                kernel
            }
            Err(err) => {
                let _ = started_tx.send(Err(ApiError::from(err)));
                return;
            }
        };
        let (progress_tx, mut progress_rx) = mpsc::unbounded_channel();
        let forward = events_tx.clone();
        let relay = tokio::spawn(async move {
            while let Some(progress) = progress_rx.recv().await {
                let event = Event::default().event("progress").json_data(&progress);
                if let Ok(event) = event {
                    let _ = forward.send(event);
                }
            }
        });
        let result = replay_in(&state.kernels, kernel, parsed, &options, Some(&progress_tx)).await;
        drop(progress_tx);
        let _ = relay.await;
        let event = match result {
            Ok(outcome) => Event::default()
                .event("result")
                .json_data(outcome_json(&outcome)),
            Err(err) => {
                let api = ApiError::from(err);
                Event::default()
                    .event("error")
                    .json_data(json!({"status": api.status.as_u16(), "message": api.message}))
            }
        };
        if let Ok(event) = event {
            let _ = events_tx.send(event);
        }
    });
    match started_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(refused)) => return Err(refused),
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal error; see the gateway's log",
            ))
        }
    }
    let stream = futures_util::stream::unfold(events_rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|event| (Ok::<_, Infallible>(event), rx))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}
