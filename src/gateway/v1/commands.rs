//! Shell commands in a session's sandbox: `POST /v1/sessions/{id}/commands` (how they run:
//! [`crate::sessions::commands`]).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use tokio::sync::mpsc;
use utoipa::ToSchema;

use super::{body, dormant_for, live_session_for, session_for, ApiError};
use crate::gateway::auth::Principal;
use crate::gateway::state::AppState;
use crate::gateway::ErrorCode;
use crate::sessions::commands::{CommandEvent, CommandRequest, CommandResult};

/// The longest command line.
const MAX_CMD_BYTES: usize = 64 << 10;
/// Variables one command may add.
const MAX_ENV: usize = 256;
/// A command's timeout when the request gives none.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// `POST /v1/sessions/{id}/commands`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommand {
    /// Run by `bash -c` (`sh` where the sandbox has no bash).
    pub cmd: String,
    /// A directory below the workspace to run in (default: the workspace).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Variables added to the kernel's environment for this command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Kill the command (its whole process group) after this many seconds (default 60);
    /// the policy's execution timeout applies as well.
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 86400)]
    pub timeout_s: Option<f64>,
}

fn check(request: RunCommand) -> Result<CommandRequest, ApiError> {
    if request.cmd.trim().is_empty() {
        return Err(ApiError::bad_request("cmd is empty"));
    }
    if request.cmd.len() > MAX_CMD_BYTES || request.cmd.contains('\0') {
        return Err(ApiError::bad_request(format!(
            "cmd must be at most {MAX_CMD_BYTES} bytes, without NUL"
        )));
    }
    let cwd = match request.cwd.as_deref().map(|c| c.trim_matches('/')) {
        None | Some("") => None,
        Some(dir) => {
            crate::workspace::check_path(dir)?;
            Some(dir.to_owned())
        }
    };
    if request.env.len() > MAX_ENV {
        return Err(ApiError::bad_request(format!(
            "env: at most {MAX_ENV} variables"
        )));
    }
    for (name, value) in &request.env {
        let valid_name = !name.is_empty()
            && name.len() <= 128
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid_name || value.len() > 32 << 10 || value.contains('\0') {
            return Err(ApiError::bad_request(format!(
                "env: {name:?} is not a variable name, or its value is over 32 KiB or holds NUL"
            ))
            .code(ErrorCode::InvalidEnv));
        }
    }
    let timeout = match request.timeout_s {
        None => DEFAULT_TIMEOUT,
        Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Duration::from_secs_f64(s),
        Some(_) => {
            return Err(ApiError::bad_request(
                "timeout_s must be a number of seconds above 0 and at most 86400",
            ))
        }
    };
    Ok(CommandRequest {
        cmd: request.cmd,
        cwd,
        env: request.env,
        timeout,
    })
}

/// Run a shell command in the session's sandbox: one JSON result, or with `Accept:
/// text/event-stream` its events (`started`, `stream`, `done`) as they come. The command
/// runs through the session's kernel, after any running cell, with the kernel's user,
/// limits and egress; it is not part of the notebook history.
#[utoipa::path(post, path = "/v1/sessions/{id}/commands", tag = "commands", operation_id = "run_command",
    params(("id" = String, Path)),
    request_body = RunCommand,
    responses(
        (status = 200, body = CommandResult, description = "JSON result; or `text/event-stream` of CommandEvent when asked"),
        (status = 400), (status = 404),
        (status = 409, description = "the session's kernel cannot run commands (`commands_unsupported`)")))]
pub async fn run(
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
    let request = check(body::parse(&body)?)?;
    super::usage::check_quota(&state, &principal).await?;
    let session = live_session_for(&state, &principal, &id).await?;
    let events = session.run_command(request)?;
    if super::sessions::wants_sse(&headers) {
        return Ok(sse(events));
    }
    Ok(Json(wait_for_result(events).await?).into_response())
}

async fn wait_for_result(
    mut events: mpsc::UnboundedReceiver<CommandEvent>,
) -> Result<CommandResult, ApiError> {
    while let Some(event) = events.recv().await {
        if let CommandEvent::Done { result, .. } = event {
            return Ok(*result);
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the command ended without a result",
    )
    .code(ErrorCode::NoResult))
}

fn sse(events: mpsc::UnboundedReceiver<CommandEvent>) -> Response {
    let stream =
        futures_util::stream::unfold((events, false), |(mut events, finished)| async move {
            if finished {
                return None;
            }
            let event = events.recv().await?;
            let done = matches!(event, CommandEvent::Done { .. });
            let sse_event = Event::default()
                .event(event.kind())
                .json_data(&event)
                .unwrap_or_else(|_| Event::default().event("error").data("unserialisable event"));
            Some((Ok::<_, Infallible>(sse_event), (events, done)))
        });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: serde_json::Value) -> Result<CommandRequest, ApiError> {
        check(serde_json::from_value(json).expect("a request"))
    }

    #[test]
    fn requests_are_checked_before_anything_runs() {
        let ok = request(serde_json::json!({"cmd": "ls", "cwd": "/data/", "env": {"A_1": "x"}}))
            .expect("valid");
        assert_eq!(ok.cwd.as_deref(), Some("data"));
        assert_eq!(ok.timeout, DEFAULT_TIMEOUT);
        for bad in [
            serde_json::json!({"cmd": "  "}),
            serde_json::json!({"cmd": "ls", "cwd": "../etc"}),
            serde_json::json!({"cmd": "ls", "env": {"1A": "x"}}),
            serde_json::json!({"cmd": "ls", "env": {"A-B": "x"}}),
            serde_json::json!({"cmd": "ls", "env": {"A": "x\u{0}"}}),
            serde_json::json!({"cmd": "ls", "timeout_s": 0}),
            serde_json::json!({"cmd": "ls", "timeout_s": 90000}),
            serde_json::json!({"cmd": "a\u{0}b"}),
        ] {
            let err = request(bad.clone()).expect_err(&bad.to_string());
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
