//! Running one execution of a session: kernel events in, session events and artifacts out,
//! the typed result last.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{Map, Value};
use tokio::sync::mpsc;

use super::events::{
    ArtifactRef, ExecError, ExecutionResult, Omitted, Resources, SessionEvent, Status,
};
use super::{HistoryEntry, Session, MAX_HISTORY};
use crate::artifacts::{
    is_base64_mime, strip_ansi, Artifact, ArtifactError, Description, NewArtifact, Origin, Quota,
    RICH_MIME_TYPES,
};
use crate::kernel::{ExecEvent, ExecuteOptions, ExecuteReply, Outcome, Readiness};

/// Accumulates what the result reports.
struct Collected {
    stdout: String,
    stderr: String,
    stdout_truncated: bool,
    stderr_truncated: bool,
    result: Option<String>,
    error: Option<ExecError>,
    artifacts: Vec<ArtifactRef>,
    omitted: Vec<Omitted>,
}

pub(super) fn push_capped(buffer: &mut String, truncated: &mut bool, text: &str, cap: usize) {
    if *truncated {
        return;
    }
    if buffer.len() + text.len() <= cap {
        buffer.push_str(text);
        return;
    }
    let mut end = cap.saturating_sub(buffer.len());
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    buffer.push_str(&text[..end]);
    *truncated = true;
}

/// Base64 outputs from this length on are stored in the background (~48 KiB decoded: below
/// it the whole store costs less than handing it to another thread).
const BACKGROUND_MIN_BASE64: usize = 64 << 10;
/// Base64 characters decoded up front to describe a large output (dimensions are in the
/// first KiB of PNG, GIF and WebP; JPEG's frame header may follow metadata).
const HEAD_BASE64: usize = 64 << 10;

/// The decoded head of a base64 text, and the decoded length of the whole.
struct Base64Head {
    bytes: Vec<u8>,
    total: u64,
}

/// Decodes the head of `encoded` and computes its decoded length, without reading the rest.
/// `None` (the caller decodes it all, and reports what is wrong) unless the text is one
/// padded line: any ASCII whitespace or a length that is not a multiple of 4 would make the
/// computed length wrong.
fn base64_head(encoded: &str) -> Option<Base64Head> {
    let raw = encoded.as_bytes();
    if !raw.len().is_multiple_of(4) || memchr::memchr3(b'\n', b'\r', b' ', raw).is_some() {
        return None;
    }
    if memchr::memchr2(b'\t', b'\x0c', raw).is_some() {
        return None;
    }
    let padding = raw.iter().rev().take(2).filter(|b| **b == b'=').count();
    let total = (raw.len() / 4 * 3 - padding) as u64;
    let head = &encoded[..HEAD_BASE64.min(raw.len())];
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(head)
        .ok()?;
    Some(Base64Head { bytes, total })
}

/// Decodes base64 output; only line-wrapped base64 pays for a cleaned copy.
fn decode_base64(encoded: &str) -> Result<Vec<u8>, base64::DecodeError> {
    let engine = &base64::engine::general_purpose::STANDARD;
    engine.decode(encoded).or_else(|_| {
        let cleaned: String = encoded.chars().filter(|c| !c.is_whitespace()).collect();
        engine.decode(cleaned)
    })
}

fn too_large(session: &str, mime: &str, bytes: u64, limit: u64, path: Option<&str>) -> Omitted {
    tracing::warn!(session_id = %session, mime, bytes, limit, path, "output larger than the artifact limit; not stored");
    Omitted {
        mime: mime.to_owned(),
        bytes,
        path: path.map(str::to_owned),
        reason: format!("larger than the policy's artifact_size of {limit} bytes"),
        quota: Some(Quota::ArtifactSize),
    }
}

/// The omitted-output entry of an artifact a quota refused; `None` for other failures,
/// which are only logged.
fn refused(
    session: &str,
    mime: &str,
    bytes: u64,
    path: Option<&str>,
    err: &ArtifactError,
) -> Option<Omitted> {
    let quota = err.quota()?;
    tracing::warn!(session_id = %session, mime, bytes, %quota, %err, "artifact not stored");
    Some(Omitted {
        mime: mime.to_owned(),
        bytes,
        path: path.map(str::to_owned),
        reason: err.to_string(),
        quota: Some(quota),
    })
}

/// Maps the kernel's reply (and cellgate's outcome on it) to the API's status.
pub fn status_of(reply: &ExecuteReply) -> Status {
    let failed = reply.status != "ok";
    // A failed cell that tried something the policy refused failed because of it, most
    // likely; the denials say what.
    let failure = || {
        if reply.denials.is_empty() {
            Status::Error
        } else {
            Status::Denied
        }
    };
    let refused_package = reply
        .denials
        .iter()
        .any(|denial| denial.kind == crate::kernel::DenialKind::Package);
    match reply.outcome {
        Some(Outcome::Timeout) => Status::Timeout,
        Some(Outcome::Oom) => Status::Oom,
        Some(Outcome::SandboxLost) => Status::SandboxLost,
        // docs/api-v1.md gives the process limit no status of its own: the cell failed with
        // its own error (`BlockingIOError`, say) and its stderr names the limit.
        Some(Outcome::Pids) if failed => failure(),
        Some(Outcome::OutputTruncated) if failed => failure(),
        None if failed => failure(),
        // `%pip install` of a package the policy refuses reports pip's failure on stderr
        // but does not raise: the cell "succeeds" without what it asked for.
        _ if refused_package => Status::Denied,
        Some(Outcome::OutputTruncated) => Status::OutputTruncated,
        Some(Outcome::Pids) | None => Status::Ok,
    }
}

impl Session {
    pub(super) async fn run(
        self: Arc<Self>,
        code: String,
        timeout: Option<Duration>,
        tx: mpsc::UnboundedSender<Arc<SessionEvent>>,
    ) {
        let _turn = self.run_lock.lock().await;
        let started = Instant::now();
        let started_at = crate::kernel::format_timestamp(time::OffsetDateTime::now_utc());
        let usage_before = self.kernel.usage();
        let options = ExecuteOptions {
            timeout,
            allow_stdin: true,
            silent: false,
            adopt_display_updates: false,
            user_expressions: Default::default(),
        };
        let emit = |event: SessionEvent, history: &mut Vec<Arc<SessionEvent>>| {
            let event = Arc::new(event);
            history.push(event.clone());
            let _ = tx.send(event.clone());
            self.publish(event);
        };
        let mut events = Vec::new();
        let mut execution = match self.client.execute(&code, options).await {
            Ok(execution) => execution,
            Err(err) => {
                // The kernel is dead or gone: a typed result, not an HTTP error.
                let execution_id = uuid::Uuid::new_v4().simple().to_string();
                emit(
                    SessionEvent::Started {
                        execution_id: execution_id.clone(),
                        code: code.clone(),
                    },
                    &mut events,
                );
                let result = ExecutionResult {
                    execution_id: execution_id.clone(),
                    status: Status::SandboxLost,
                    execution_count: None,
                    stdout: String::new(),
                    stderr: String::new(),
                    stdout_truncated: false,
                    stderr_truncated: false,
                    output_truncated: false,
                    result: None,
                    error: Some(ExecError {
                        ename: "KernelDiedError".to_owned(),
                        evalue: match self.kernel.readiness() {
                            Readiness::Dead(reason) => format!("the kernel is dead: {reason}"),
                            _ => err.to_string(),
                        },
                        traceback: Vec::new(),
                    }),
                    artifacts: Vec::new(),
                    omitted: Vec::new(),
                    denials: Vec::new(),
                    duration_ms: 0,
                    state_generation: self.kernel.generation(),
                    resources: Resources::default(),
                };
                self.finish(execution_id, code, started_at, events, result, &tx);
                return;
            }
        };
        let execution_id = execution.msg_id.clone();
        emit(
            SessionEvent::Started {
                execution_id: execution_id.clone(),
                code: code.clone(),
            },
            &mut events,
        );
        let cap = self.options.stream_cap;
        let mut collected = Collected {
            stdout: String::new(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            result: None,
            error: None,
            artifacts: Vec::new(),
            omitted: Vec::new(),
        };
        let mut reply = None;
        let mut plain_stdout = super::plain::PlainStream::default();
        let mut plain_stderr = super::plain::PlainStream::default();
        while let Some(event) = execution.events.recv().await {
            let id = execution_id.clone();
            match event {
                ExecEvent::Busy => {}
                ExecEvent::Stream { name, text } => {
                    let (buffer, truncated, plain) = if name == "stderr" {
                        (
                            &mut collected.stderr,
                            &mut collected.stderr_truncated,
                            &mut plain_stderr,
                        )
                    } else {
                        (
                            &mut collected.stdout,
                            &mut collected.stdout_truncated,
                            &mut plain_stdout,
                        )
                    };
                    let text = plain.push(&text);
                    if text.is_empty() {
                        continue;
                    }
                    push_capped(buffer, truncated, &text, cap);
                    emit(
                        SessionEvent::Stream {
                            execution_id: id,
                            name,
                            text,
                        },
                        &mut events,
                    );
                }
                ExecEvent::Display {
                    data,
                    display_id,
                    update,
                    ..
                } => {
                    let origin = if update {
                        Origin::UpdateDisplayData
                    } else {
                        Origin::DisplayData
                    };
                    let text = plain_text(&data);
                    let refs = self
                        .store_bundle(
                            data,
                            origin,
                            &id,
                            display_id.as_deref(),
                            &mut collected.omitted,
                        )
                        .await;
                    collected.artifacts.extend(refs.iter().cloned());
                    let event = if update {
                        SessionEvent::UpdateDisplay {
                            execution_id: id,
                            display_id,
                            text,
                            artifacts: refs,
                        }
                    } else {
                        SessionEvent::Display {
                            execution_id: id,
                            display_id,
                            text,
                            artifacts: refs,
                        }
                    };
                    emit(event, &mut events);
                }
                ExecEvent::Result {
                    execution_count,
                    data,
                    ..
                } => {
                    let text = plain_text(&data);
                    let refs = self
                        .store_bundle(
                            data,
                            Origin::ExecuteResult,
                            &id,
                            None,
                            &mut collected.omitted,
                        )
                        .await;
                    collected.artifacts.extend(refs.iter().cloned());
                    collected.result = text.clone();
                    emit(
                        SessionEvent::Result {
                            execution_id: id,
                            execution_count,
                            text,
                            artifacts: refs,
                        },
                        &mut events,
                    );
                }
                ExecEvent::Error {
                    ename,
                    evalue,
                    traceback,
                } => {
                    let traceback: Vec<String> = traceback.iter().map(|t| strip_ansi(t)).collect();
                    collected.error = Some(ExecError {
                        ename: ename.clone(),
                        evalue: evalue.clone(),
                        traceback: traceback.clone(),
                    });
                    emit(
                        SessionEvent::Error {
                            execution_id: id,
                            ename,
                            evalue,
                            traceback,
                        },
                        &mut events,
                    );
                }
                ExecEvent::ClearOutput { wait } => emit(
                    SessionEvent::ClearOutput {
                        execution_id: id,
                        wait,
                    },
                    &mut events,
                ),
                ExecEvent::InputRequest { prompt, password } => emit(
                    SessionEvent::InputRequest {
                        execution_id: id,
                        prompt,
                        password,
                    },
                    &mut events,
                ),
                ExecEvent::Done(done) => {
                    reply = Some(done);
                    break;
                }
            }
        }
        let reply = reply.unwrap_or_default();
        // Files the code wrote under outputs/ become artifacts.
        let (files, omitted) = self.collect_outputs(&execution_id).await;
        collected.artifacts.extend(files);
        collected.omitted.extend(omitted);
        let status = status_of(&reply);
        let error = collected.error.or_else(|| {
            (reply.status != "ok").then(|| ExecError {
                ename: reply.ename.clone().unwrap_or_default(),
                evalue: reply.evalue.clone().unwrap_or_default(),
                traceback: reply.traceback.iter().map(|t| strip_ansi(t)).collect(),
            })
        });
        let usage_after = self.kernel.usage();
        let resources = match (usage_before, usage_after) {
            (Some(before), Some(after)) => Resources {
                cpu_time_ms: match (before.cpu_time, after.cpu_time) {
                    (Some(b), Some(a)) => Some(a.saturating_sub(b).as_millis() as u64),
                    _ => None,
                },
                memory_peak_bytes: after.memory_peak_bytes,
                memory_bytes: after.memory_bytes,
            },
            _ => Resources::default(),
        };
        let result = ExecutionResult {
            execution_id: execution_id.clone(),
            status,
            execution_count: reply.execution_count,
            stdout: super::plain::collapse_overwrites(&collected.stdout),
            stderr: super::plain::collapse_overwrites(&collected.stderr),
            stdout_truncated: collected.stdout_truncated,
            stderr_truncated: collected.stderr_truncated,
            output_truncated: reply.outcome == Some(Outcome::OutputTruncated),
            result: collected.result,
            error,
            artifacts: collected.artifacts,
            omitted: collected.omitted,
            // The API's wire form of each denial (docs/api-v1.md: the reply's, verbatim).
            denials: reply
                .denials
                .iter()
                .filter_map(|d| serde_json::to_value(d).ok())
                .collect(),
            duration_ms: started.elapsed().as_millis() as u64,
            state_generation: self.kernel.generation(),
            resources,
        };
        self.finish(execution_id, code, started_at, events, result, &tx);
    }

    fn finish(
        &self,
        execution_id: String,
        code: String,
        started: String,
        mut events: Vec<Arc<SessionEvent>>,
        result: ExecutionResult,
        tx: &mpsc::UnboundedSender<Arc<SessionEvent>>,
    ) {
        let result = Arc::new(result);
        let done = Arc::new(SessionEvent::Done {
            execution_id: execution_id.clone(),
            result: Box::new((*result).clone()),
        });
        events.push(done.clone());
        let _ = tx.send(done.clone());
        self.publish(done);
        let mut history = self.history.lock();
        if history.len() >= MAX_HISTORY {
            history.remove(0);
        }
        history.push(HistoryEntry {
            execution_id,
            code,
            started,
            events,
            result: Some(result),
        });
    }

    /// Stores the rich parts of a MIME bundle; returns references in the bundle's order of
    /// preference. An output too large or undecodable is reported in the log and skipped.
    /// Large base64 outputs (images, PDFs) are described from their head and stored in the
    /// background (see [`crate::artifacts::Reservation`]): the reference goes out without
    /// waiting for the decode, hash and write of megabytes.
    async fn store_bundle(
        &self,
        mut data: Map<String, Value>,
        origin: Origin,
        execution_id: &str,
        display_id: Option<&str>,
        omitted: &mut Vec<Omitted>,
    ) -> Vec<ArtifactRef> {
        let text = plain_text(&data);
        let mut refs = Vec::new();
        for mime in RICH_MIME_TYPES {
            let Some(value) = data.get_mut(*mime) else {
                continue;
            };
            let new = NewArtifact {
                session: &self.id,
                owner: self.owner.as_deref(),
                mime,
                origin,
                execution_id: Some(execution_id),
                display_id,
                text: text.as_deref(),
                path: None,
                quotas: self.options.artifact_quotas,
            };
            let limit = self.options.artifact_max_bytes;
            if let Value::String(encoded) = value {
                if is_base64_mime(mime) && encoded.len() >= BACKGROUND_MIN_BASE64 {
                    if let Some(head) = base64_head(encoded) {
                        let bytes = head.total;
                        if bytes > limit {
                            omitted.push(too_large(&self.id, mime, bytes, limit, None));
                            continue;
                        }
                        let description = Description::from_head(&new, &head.bytes, bytes);
                        let encoded = std::mem::take(encoded);
                        match self.store_in_background(&new, description, encoded).await {
                            Ok(artifact) => refs.push(self.options.reference(&artifact)),
                            Err(err) => match refused(&self.id, mime, bytes, None, &err) {
                                Some(entry) => omitted.push(entry),
                                None => log_store_error(&self.id, &err),
                            },
                        }
                        continue;
                    }
                }
            }
            let content: Vec<u8> = match value {
                Value::String(s) if is_base64_mime(mime) => {
                    // Kernels send one line; only line-wrapped base64 pays for a cleaned copy.
                    match decode_base64(s) {
                        Ok(bytes) => bytes,
                        Err(err) => {
                            tracing::warn!(session_id = %self.id, mime, %err, "output is not valid base64; not stored");
                            omitted.push(Omitted {
                                mime: (*mime).to_owned(),
                                bytes: s.len() as u64,
                                path: None,
                                reason: format!("not valid base64: {err}"),
                                quota: None,
                            });
                            continue;
                        }
                    }
                }
                Value::String(s) => std::mem::take(s).into_bytes(),
                // Lists of lines (nbformat style) join into one text.
                Value::Array(lines) if lines.iter().all(Value::is_string) => lines
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<String>()
                    .into_bytes(),
                other => other.to_string().into_bytes(),
            };
            if content.len() as u64 > limit {
                omitted.push(too_large(&self.id, mime, content.len() as u64, limit, None));
                continue;
            }
            let store = self.artifacts.clone();
            let bytes = content.len() as u64;
            let quotas = self.options.artifact_quotas;
            let (session, owner, exec, display, text, mime_owned) = (
                self.id.clone(),
                self.owner.clone(),
                execution_id.to_owned(),
                display_id.map(str::to_owned),
                text.clone(),
                (*mime).to_owned(),
            );
            let stored = tokio::task::spawn_blocking(move || {
                store.put(
                    &NewArtifact {
                        session: &session,
                        owner: owner.as_deref(),
                        mime: &mime_owned,
                        origin,
                        execution_id: Some(&exec),
                        display_id: display.as_deref(),
                        text: text.as_deref(),
                        path: None,
                        quotas,
                    },
                    &content,
                )
            })
            .await;
            match stored {
                Ok(Ok(artifact)) => refs.push(self.options.reference(&artifact)),
                Ok(Err(err)) => match refused(&self.id, mime, bytes, None, &err) {
                    Some(entry) => omitted.push(entry),
                    None => log_store_error(&self.id, &err),
                },
                Err(err) => tracing::error!(session_id = %self.id, %err, "artifact task failed"),
            }
        }
        refs
    }

    /// Records the artifact now and decodes, hashes and writes it on the blocking pool. At
    /// most [`super::BACKGROUND_STORES`] run at once per session; past that the execution
    /// waits here (back-pressure on a kernel that floods outputs).
    async fn store_in_background(
        &self,
        new: &NewArtifact<'_>,
        description: Description,
        encoded: String,
    ) -> Result<Arc<Artifact>, ArtifactError> {
        let permit = self.background_stores.clone().acquire_owned().await;
        let (artifact, reservation) = self.artifacts.reserve(new, description)?;
        let session = self.id.clone();
        let id = artifact.id.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let stored = match decode_base64(&encoded) {
                Ok(bytes) => {
                    drop(encoded);
                    reservation.fill(&bytes)
                }
                // The head decoded, the rest did not: a kernel sent broken base64. The
                // reference is already out; fetching it answers 404 and this log says why.
                Err(err) => {
                    drop(reservation);
                    tracing::warn!(session_id = %session, artifact = %id, %err, "output is not valid base64; artifact removed");
                    return;
                }
            };
            if let Err(err) = stored {
                log_store_error(&session, &err);
            }
        });
        Ok(artifact)
    }

    /// Turns new or changed files under the workspace's `outputs/` into artifacts.
    async fn collect_outputs(&self, execution_id: &str) -> (Vec<ArtifactRef>, Vec<Omitted>) {
        let Some(workspace) = self.workspace() else {
            return (Vec::new(), Vec::new());
        };
        let store = self.artifacts.clone();
        let (session, owner, exec) = (self.id.clone(), self.owner.clone(), execution_id.to_owned());
        let seen = self.outputs_seen.lock().clone();
        let limit = self.options.artifact_max_bytes;
        let quotas = self.options.artifact_quotas;
        let scanned = tokio::task::spawn_blocking(move || {
            let mut stored = Vec::new();
            let mut omitted = Vec::new();
            let mut seen = seen;
            let files = match workspace.list("outputs", crate::workspace::Listing::ALL) {
                Ok(files) => files,
                Err(_) => return (stored, omitted, seen),
            };
            for file in files.into_iter().filter(|f| f.kind == "file") {
                let stamp = (file.size, file.mtime_s, file.mtime_ns);
                if seen.get(&file.path) == Some(&stamp) {
                    continue;
                }
                seen.insert(file.path.clone(), stamp);
                let mime = crate::workspace::mime_for(&file.path);
                if file.size > limit {
                    omitted.push(too_large(
                        &session,
                        mime,
                        file.size,
                        limit,
                        Some(&file.path),
                    ));
                    continue;
                }
                let new = NewArtifact {
                    session: &session,
                    owner: owner.as_deref(),
                    mime,
                    origin: Origin::File,
                    execution_id: Some(&exec),
                    display_id: None,
                    text: None,
                    path: Some(&file.path),
                    quotas,
                };
                // Refused before the file is read and copied, when its listed size is over.
                let checked = match store.check(&new, file.size) {
                    Ok(()) => match workspace.open_read(&file.path) {
                        Ok((mut reader, _)) => store.put_reader(&new, &mut reader, limit),
                        // Gone or replaced since the listing: the kernel's business.
                        Err(_) => continue,
                    },
                    Err(err) => Err(err),
                };
                match checked {
                    Ok(artifact) => stored.push(artifact),
                    Err(err) => match refused(&session, mime, file.size, Some(&file.path), &err) {
                        Some(entry) => omitted.push(entry),
                        None => log_store_error(&session, &err),
                    },
                }
            }
            (stored, omitted, seen)
        })
        .await;
        match scanned {
            Ok((stored, omitted, seen)) => {
                *self.outputs_seen.lock() = seen;
                let refs = stored.iter().map(|a| self.options.reference(a)).collect();
                (refs, omitted)
            }
            Err(_) => (Vec::new(), Vec::new()),
        }
    }
}

fn log_store_error(session: &str, err: &ArtifactError) {
    match err {
        ArtifactError::TooLarge { .. } => {
            tracing::warn!(session_id = %session, %err, "artifact not stored")
        }
        _ => tracing::error!(session_id = %session, %err, "artifact not stored"),
    }
}

fn plain_text(data: &Map<String, Value>) -> Option<String> {
    match data.get("text/plain")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(lines) => Some(lines.iter().filter_map(Value::as_str).collect()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(status: &str, outcome: Option<&str>, denials: usize) -> ExecuteReply {
        let denial = crate::kernel::Denial {
            kind: crate::kernel::DenialKind::Egress,
            target: String::new(),
            policy: String::new(),
            reason: String::new(),
        };
        ExecuteReply {
            status: status.to_owned(),
            outcome: outcome.map(|o| serde_json::from_value(serde_json::json!(o)).unwrap()),
            denials: vec![denial; denials],
            ..ExecuteReply::default()
        }
    }

    #[test]
    fn statuses_from_replies() {
        assert_eq!(status_of(&reply("ok", None, 0)), Status::Ok);
        assert_eq!(status_of(&reply("error", None, 0)), Status::Error);
        assert_eq!(status_of(&reply("aborted", None, 0)), Status::Error);
        assert_eq!(
            status_of(&reply("error", Some("timeout"), 0)),
            Status::Timeout
        );
        assert_eq!(status_of(&reply("error", Some("oom"), 0)), Status::Oom);
        assert_eq!(
            status_of(&reply("error", Some("sandbox_lost"), 0)),
            Status::SandboxLost
        );
        assert_eq!(status_of(&reply("error", None, 1)), Status::Denied);
        // A cell that caught a refused connection succeeded; one whose package install
        // was refused did not, whether or not it raised.
        assert_eq!(status_of(&reply("ok", None, 1)), Status::Ok);
        let mut pip = reply("ok", None, 1);
        pip.denials[0].kind = crate::kernel::DenialKind::Package;
        assert_eq!(status_of(&pip), Status::Denied);
        pip.outcome = Some(Outcome::OutputTruncated);
        assert_eq!(status_of(&pip), Status::Denied);
        assert_eq!(
            status_of(&reply("ok", Some("output_truncated"), 0)),
            Status::OutputTruncated
        );
        assert_eq!(
            status_of(&reply("error", Some("output_truncated"), 0)),
            Status::Error
        );
    }

    #[test]
    fn streams_are_capped_on_char_boundaries() {
        let (mut buffer, mut truncated) = (String::new(), false);
        push_capped(&mut buffer, &mut truncated, "ab", 4);
        push_capped(&mut buffer, &mut truncated, "cé", 4);
        assert_eq!(buffer, "abc");
        assert!(truncated);
        push_capped(&mut buffer, &mut truncated, "d", 4);
        assert_eq!(buffer, "abc");
    }
}
