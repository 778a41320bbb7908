//! Workspace files: upload (streamed to disk, size-limited by the session's policy),
//! download, list. Every path goes through [`crate::workspace`], which never follows a link.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{awake_session_for, ApiError, STREAM_CHUNK};
use crate::gateway::auth::Principal;
use crate::gateway::state::AppState;
use crate::sessions::Session;
use crate::workspace::{mime_for, FileEntry, FileReader, WorkspaceError};

/// Largest upload: the policy's `upload_size`, and never more than its workspace.
pub fn upload_limit(state: &AppState, session: &Session) -> u64 {
    state
        .sessions
        .kernels()
        .policies()
        .get(&session.kernel.policy)
        .map(|p| p.limits.upload_bytes.min(p.limits.workspace_bytes))
        .unwrap_or(1 << 30)
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    /// A directory below the workspace (default: its top).
    #[serde(default)]
    dir: Option<String>,
    /// Everything below `dir`, not only its own entries.
    #[serde(default)]
    recursive: bool,
    /// Also names starting with a dot (the kernel's libraries keep caches and settings there).
    #[serde(default)]
    hidden: bool,
}

/// A file or directory of the workspace, as the listing shows it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ListedFile {
    /// Relative to the workspace, `/`-separated.
    pub path: String,
    /// `file`, `dir`, `symlink` (never followed) or `other`.
    pub kind: String,
    pub size: u64,
    /// The last modification, RFC 3339 in UTC, as every timestamp of the API.
    pub mtime: String,
}

impl ListedFile {
    fn from_entry(entry: FileEntry) -> ListedFile {
        let nanos = i128::from(entry.mtime_s) * 1_000_000_000 + i128::from(entry.mtime_ns);
        let at = time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
        ListedFile {
            path: entry.path,
            kind: entry.kind.to_owned(),
            size: entry.size,
            mtime: crate::timestamp::format_timestamp(at),
        }
    }
}

/// Whether `entry` belongs in a listing of `dir` (`""`: the top) with these options.
fn listed(path: &str, dir: &str, recursive: bool, hidden: bool) -> bool {
    let below = if dir.is_empty() {
        path
    } else {
        match path
            .strip_prefix(dir)
            .and_then(|rest| rest.strip_prefix('/'))
        {
            Some(rest) => rest,
            None => return false,
        }
    };
    (recursive || !below.contains('/'))
        && (hidden || !below.split('/').any(|part| part.starts_with('.')))
}

/// A stored upload.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Uploaded {
    pub path: String,
    pub bytes: u64,
}

/// The files and directories of the workspace, or of `dir` in it (links listed, never
/// followed): its own entries, or everything below it with `recursive`; names starting
/// with a dot only with `hidden`.
#[utoipa::path(get, path = "/v1/sessions/{id}/files", tag = "files", operation_id = "list_files",
    params(("id" = String, Path),
           ("dir" = Option<String>, Query, description = "a directory of the workspace (default: its top)"),
           ("recursive" = Option<bool>, Query, description = "everything below `dir` (default: false)"),
           ("hidden" = Option<bool>, Query, description = "also dot files and directories (default: false)")),
    responses((status = 200, body = Vec<ListedFile>), (status = 400, description = "a bad path"),
              (status = 404, description = "no such session or directory"),
              (status = 409, description = "not a directory, or the workspace is unavailable")))]
pub async fn list(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<ListedFile>>, ApiError> {
    let Query(query) = query.map_err(|err| ApiError::bad_request(err.body_text()))?;
    let session = awake_session_for(&state, &principal, &id).await?;
    let (recursive, hidden) = (query.recursive, query.hidden);
    let listing = crate::workspace::Listing { recursive, hidden };
    let dir = query.dir.unwrap_or_default().trim_matches('/').to_owned();
    let listed_dir = dir.clone();
    let entries = tokio::task::spawn_blocking(move || {
        let workspace = session.open_workspace()?;
        workspace.list(&listed_dir, listing)
    })
    .await
    .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "file task failed"))??;
    Ok(Json(
        entries
            .into_iter()
            // The workspace walked only what was asked; this also holds for an agent that
            // predates the options and lists everything.
            .filter(|entry| listed(&entry.path, &dir, recursive, hidden))
            .map(ListedFile::from_entry)
            .collect(),
    ))
}

/// Upload a file (the request body is the content), replacing any file at `path`.
#[utoipa::path(put, path = "/v1/sessions/{id}/files/{path}", tag = "files", operation_id = "upload_file",
    params(("id" = String, Path), ("path" = String, Path)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, body = Uploaded), (status = 400, description = "a bad path"),
              (status = 404, description = "no such session"),
              (status = 409, description = "the path is a directory, or the workspace is unavailable"),
              (status = 413, description = "over the upload limit or the workspace's free space")))]
pub async fn upload(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path((id, path)): Path<(String, String)>,
    body: Body,
) -> Result<Response, ApiError> {
    let session = awake_session_for(&state, &principal, &id).await?;
    crate::workspace::check_path(&path)?;
    let limit = upload_limit(&state, &session);
    // The body streams through a bounded channel into a blocking writer: never more than
    // a few chunks in memory, whatever the upload's size. `None` says the body is complete:
    // a channel that closes without it (the client went away, the request was dropped)
    // leaves nothing, never a truncated file in place of the old one.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<axum::body::Bytes>>(8);
    let writer_session: Arc<Session> = session.clone();
    let writer_path = path.clone();
    let writer = tokio::task::spawn_blocking(move || -> Result<u64, ApiError> {
        let workspace = writer_session.open_workspace()?;
        let mut upload = workspace.create(&writer_path, limit)?;
        loop {
            match rx.blocking_recv() {
                Some(Some(chunk)) => upload.write(&chunk)?,
                Some(None) => return Ok(upload.commit()?),
                // Dropping the upload removes the partial file.
                None => return Err(ApiError::bad_request("upload interrupted")),
            }
        }
    });
    let mut stream = body.into_data_stream();
    let mut failed = None;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(chunk) => {
                if tx.send(Some(chunk)).await.is_err() {
                    // The writer stopped (its error says why, a 413 say). What the client
                    // still sends is read and dropped, within bounds, before the answer:
                    // a connection closed with its upload unread is reset, and the client
                    // sees an error sending instead of the 413 (seen on CI).
                    drain(&mut stream).await;
                    break;
                }
            }
            Err(err) => {
                failed = Some(ApiError::bad_request(format!("upload interrupted: {err}")));
                break;
            }
        }
    }
    if let Some(err) = failed {
        // The writer sees the channel close without the end: it keeps nothing.
        drop(tx);
        let _ = writer.await;
        return Err(err);
    }
    // The body is complete (a writer that stopped early has its error to say).
    let _ = tx.send(None).await;
    drop(tx);
    let bytes = writer
        .await
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "file task failed"))??;
    Ok((StatusCode::CREATED, Json(Uploaded { path, bytes })).into_response())
}

/// How much of a refused upload's rest is read and dropped, and for how long at most.
const DRAIN_BYTES: usize = 64 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads and drops what is left of a body (see `upload`), up to [`DRAIN_BYTES`] or
/// [`DRAIN_TIME`]; past either, the connection closes as before.
async fn drain(
    stream: &mut (impl futures_util::Stream<Item = Result<axum::body::Bytes, axum::Error>> + Unpin),
) {
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        let mut read = 0usize;
        while let Some(Ok(chunk)) = stream.next().await {
            read += chunk.len();
            if read > DRAIN_BYTES {
                break;
            }
        }
    })
    .await;
}

/// Runs `work` on the session's workspace on a blocking thread.
async fn on_workspace<T: Send + 'static>(
    session: Arc<Session>,
    work: impl FnOnce(&crate::workspace::Files) -> Result<T, WorkspaceError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(move || {
        let workspace = session.open_workspace()?;
        work(&workspace).map_err(ApiError::from)
    })
    .await
    .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "file task failed"))?
}

/// Whether something is at `path`, and what: answers 200 with `X-Cellgate-File-Kind`
/// (`file`, `dir`, `symlink`, `other`), `Last-Modified` and, for a file, `Content-Length`;
/// 404 when nothing is there. A link is reported as a link, never followed.
#[utoipa::path(head, path = "/v1/sessions/{id}/files/{path}", tag = "files", operation_id = "file_exists",
    params(("id" = String, Path), ("path" = String, Path)),
    responses((status = 200, description = "something is at the path",
               headers(("X-Cellgate-File-Kind" = String, description = "file, dir, symlink or other"),
                       ("Content-Length" = u64, description = "a file's size"),
                       ("Last-Modified" = String, description = "its modification time"))),
              (status = 400, description = "a bad path"),
              (status = 404, description = "no such session or file"),
              (status = 409, description = "the workspace is unavailable")))]
pub async fn head(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let session = awake_session_for(&state, &principal, &id).await?;
    let entry = on_workspace(session, move |workspace| workspace.stat(&path)).await?;
    let mut response = StatusCode::OK.into_response();
    let headers = response.headers_mut();
    headers.insert(FILE_KIND, HeaderValue::from_static(entry.kind));
    if entry.kind == "file" {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(entry.size));
    }
    let modified = std::time::UNIX_EPOCH
        + std::time::Duration::from_secs(u64::try_from(entry.mtime_s).unwrap_or(0));
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(modified)) {
        headers.insert(header::LAST_MODIFIED, value);
    }
    Ok(response)
}

/// The header that says what a path is.
pub const FILE_KIND: &str = "x-cellgate-file-kind";

#[derive(Debug, Deserialize)]
pub struct RemoveQuery {
    /// Also a directory that is not empty, with everything in it.
    #[serde(default)]
    recursive: bool,
}

/// What a removal removed.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Removed {
    pub path: String,
    /// Entries removed: 1 for a file, link or empty directory; more for a tree.
    pub removed: u64,
}

/// Remove a file, a link (the link, not what it points at) or a directory: an empty one, or
/// with `recursive=true` everything in it.
#[utoipa::path(delete, path = "/v1/sessions/{id}/files/{path}", tag = "files", operation_id = "remove_file",
    params(("id" = String, Path), ("path" = String, Path),
           ("recursive" = Option<bool>, Query, description = "also a directory that is not empty (default: false)")),
    responses((status = 200, body = Removed), (status = 400, description = "a bad path"),
              (status = 404, description = "no such session or file"),
              (status = 409, description = "a directory that is not empty (`not_empty`), or the workspace is unavailable")))]
pub async fn remove(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path((id, path)): Path<(String, String)>,
    query: Result<Query<RemoveQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Removed>, ApiError> {
    let Query(query) = query.map_err(|err| ApiError::bad_request(err.body_text()))?;
    let session = awake_session_for(&state, &principal, &id).await?;
    let removed_path = path.clone();
    let removed = on_workspace(session, move |workspace| {
        workspace.remove(&removed_path, query.recursive)
    })
    .await?;
    Ok(Json(Removed { path, removed }))
}

/// `POST /v1/sessions/{id}/files/{path}`: an operation on the path.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum FileOperation {
    /// Create the directory and any missing parent (an existing directory is fine).
    Mkdir,
    /// Move (rename) the path to `to`; missing parents of `to` are created. Without
    /// `overwrite`, anything at `to` is a conflict (`exists`).
    Move {
        to: String,
        #[serde(default)]
        overwrite: bool,
    },
    /// What is at the path.
    Stat,
}

/// Create a directory, move a file or directory, or describe a path: answers with the entry
/// at the path (for `move`, at its new path).
#[utoipa::path(post, path = "/v1/sessions/{id}/files/{path}", tag = "files", operation_id = "file_operation",
    params(("id" = String, Path), ("path" = String, Path)),
    request_body = FileOperation,
    responses((status = 200, body = ListedFile, description = "the entry now at the path (`move`: at `to`)"),
              (status = 201, body = ListedFile, description = "`mkdir` created the directory"),
              (status = 400, description = "a bad path, or a directory moved into itself"),
              (status = 404, description = "no such session or file"),
              (status = 409, description = "something else is at the path (`exists`), or the workspace is unavailable")))]
pub async fn operate(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path((id, path)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let operation: FileOperation = super::body::parse(&body)?;
    let session = awake_session_for(&state, &principal, &id).await?;
    let (status, entry) = on_workspace(session, move |workspace| match operation {
        FileOperation::Mkdir => {
            let existed = matches!(workspace.stat(&path), Ok(entry) if entry.kind == "dir");
            let entry = workspace.make_dir(&path)?;
            Ok((
                if existed {
                    StatusCode::OK
                } else {
                    StatusCode::CREATED
                },
                entry,
            ))
        }
        FileOperation::Move { to, overwrite } => {
            Ok((StatusCode::OK, workspace.rename(&path, &to, overwrite)?))
        }
        FileOperation::Stat => Ok((StatusCode::OK, workspace.stat(&path)?)),
    })
    .await?;
    Ok((status, Json(ListedFile::from_entry(entry))).into_response())
}

/// The bytes of a blocking reader (a guest's file stream) as a body stream: read on a
/// blocking thread, a few chunks ahead of the client at most, `size` bytes at most.
fn blocking_stream(
    reader: Box<dyn std::io::Read + Send>,
    size: u64,
) -> impl futures_util::Stream<Item = std::io::Result<axum::body::Bytes>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::task::spawn_blocking(move || {
        let mut reader = std::io::Read::take(reader, size);
        loop {
            let mut chunk = vec![0; STREAM_CHUNK];
            let item = match std::io::Read::read(&mut reader, &mut chunk) {
                Ok(0) => return,
                Ok(n) => {
                    chunk.truncate(n);
                    Ok(axum::body::Bytes::from(chunk))
                }
                Err(error) => Err(error),
            };
            let failed = item.is_err();
            // The client went away, or the reader failed: stop either way.
            if tx.blocking_send(item).is_err() || failed {
                return;
            }
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

/// Download a file.
#[utoipa::path(get, path = "/v1/sessions/{id}/files/{path}", tag = "files", operation_id = "download_file",
    params(("id" = String, Path), ("path" = String, Path)),
    responses((status = 200, description = "the file's bytes"), (status = 400, description = "a bad path"),
              (status = 404, description = "no such session or file"),
              (status = 409, description = "the path is a directory, or the workspace is unavailable")))]
pub async fn download(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let session = awake_session_for(&state, &principal, &id).await?;
    let open_path = path.clone();
    let (reader, size) = tokio::task::spawn_blocking(move || {
        let workspace = session.open_workspace()?;
        workspace.open_read(&open_path)
    })
    .await
    .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "file task failed"))??;
    let body = match reader {
        // The sandbox may grow the file meanwhile: what was there when it was opened.
        FileReader::Local(file) => Body::from_stream(tokio_util::io::ReaderStream::with_capacity(
            tokio::io::AsyncReadExt::take(tokio::fs::File::from_std(file), size),
            STREAM_CHUNK,
        )),
        FileReader::Guest(reader) => Body::from_stream(blocking_stream(reader, size)),
    };
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    // Downloads are never rendered in the gateway's origin: attachment, nosniff, sandbox.
    let mime = mime_for(&path);
    let name: String = path
        .rsplit('/')
        .next()
        .unwrap_or("file")
        .chars()
        .filter(|c| c.is_ascii_graphic() && *c != '"' && *c != '\\')
        .collect();
    for (name, value) in [
        (header::CONTENT_TYPE, mime.to_owned()),
        (header::CONTENT_LENGTH, size.to_string()),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_owned()),
        (header::CONTENT_SECURITY_POLICY, "sandbox".to_owned()),
        (
            header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{name}\""),
        ),
    ] {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_take_their_level_and_hide_dot_names() {
        let top = |p| listed(p, "", false, false);
        assert!(top("a.csv") && top("data"));
        assert!(!top("data/in.csv") && !top(".cache") && !top("data/.x"));
        assert!(listed("data/in.csv", "", true, false));
        assert!(!listed(".cache/pip/x", "", true, false));
        assert!(listed(".cache/pip/x", "", true, true));
        assert!(listed("data/in.csv", "data", false, false));
        assert!(!listed("data/sub/in.csv", "data", false, false));
        assert!(
            !listed("database.csv", "data", true, true),
            "a sibling is not below"
        );
        assert!(!listed("x", ".hidden", false, false));
        assert!(
            listed(".hidden/x", ".hidden", false, false),
            "a hidden dir asked for by name"
        );
    }

    #[test]
    fn modification_times_are_rfc_3339() {
        let entry = FileEntry {
            path: "a".into(),
            kind: "file",
            size: 1,
            mtime_s: 1_795_743_406,
            mtime_ns: 250_000_000,
        };
        assert_eq!(
            ListedFile::from_entry(entry).mtime,
            "2026-11-27T01:36:46.250000Z"
        );
    }
}
