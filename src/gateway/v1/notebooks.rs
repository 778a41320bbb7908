//! Notebook export and replay on API v1: a session exports as the .ipynb of its history,
//! and a notebook replays in a fresh sandbox. Both are the notebook module's, shared with
//! the Kernel Gateway surface (`/api/kernels/{id}/notebook`, `/api/notebooks/replay`).

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;

use super::{dormant_for, session_for};
use crate::gateway::api_error::ApiError;
use crate::gateway::auth::Principal;
use crate::gateway::notebooks::{
    history_response, notebook_response, replay_notebook, ReplayQuery,
};
use crate::gateway::state::AppState;
use crate::notebook::KernelspecInfo;

/// The session's history as a notebook (nbformat 4.5): every executed cell in order with its
/// outputs, display updates applied.
#[utoipa::path(get, path = "/v1/sessions/{id}/notebook", tag = "notebooks", operation_id = "export_notebook",
    params(("id" = String, Path, description = "session id")),
    responses((status = 200, content_type = "application/x-ipynb+json",
               description = "the notebook"), (status = 404)))]
pub async fn export(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if let Some(dormant) = dormant_for(&state, &principal, &id) {
        // Its kernel is gone: the stored history, under its kernelspec as installed now (or
        // as stored, if it is not any more).
        let row = &dormant.row;
        let info = match state.kernels.specs().get(&row.kernel_name) {
            Some(spec) => KernelspecInfo::from(spec),
            None => KernelspecInfo {
                name: row.kernel_name.clone(),
                display_name: row.kernel_name.clone(),
                language: row.language.clone(),
            },
        };
        return history_response(&dormant.history(), &info, &id);
    }
    let session = session_for(&state, &principal, &id)?;
    notebook_response(&session.kernel, &id)
}

/// Runs a notebook's code cells in a fresh sandbox and compares each cell's outputs with the
/// notebook's: `{notebook, report, matched}`, or progress and result as Server-Sent Events
/// with `Accept: text/event-stream`. The body is the .ipynb, or
/// `{"notebook", "policy"?, "allow_errors"?, "timeout_s"?}`.
#[utoipa::path(post, path = "/v1/notebooks/replay", tag = "notebooks", operation_id = "replay_notebook",
    params(("policy" = Option<String>, Query, description = "policy of the replay's kernel"),
           ("allow_errors" = Option<bool>, Query, description = "go on after a failing cell"),
           ("timeout_s" = Option<f64>, Query, description = "per-cell timeout")),
    request_body(content = String, content_type = "application/json",
                 description = "the .ipynb, or {notebook, policy, allow_errors, timeout_s}"),
    responses((status = 200, description = "{notebook, report, matched} or an event stream"),
              (status = 400, description = "not a notebook this gateway can replay")))]
pub async fn replay(
    state: State<AppState>,
    principal: Extension<Principal>,
    query: Result<Query<ReplayQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    replay_notebook(state, principal, query, headers, body).await
}
