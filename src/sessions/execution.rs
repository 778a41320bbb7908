//! Running one execution of a session: kernel events in, session events and artifacts out,
//! the typed result last. [`Session::run`] goes through the steps in order: the kernel call,
//! the translation of its events ([`Turn`]), the files the cell wrote, the resources it used,
//! and the result's assembly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use tokio::sync::mpsc;

use super::events::{
    ArtifactRef, ExecError, ExecutionResult, Omitted, Resources, SessionEvent, Status,
};
use super::outputs::plain_text;
use super::plain::Streams;
use super::replay::Numbered;
use super::Session;
use crate::artifacts::{strip_ansi, Origin};
use crate::ids::ExecutionId;
use crate::kernel::{
    CellEnd, ExecEvent, ExecuteOptions, ExecuteReply, KernelError, Outcome, Readiness,
    ResourceUsage,
};

/// Accumulates what the result reports.
#[derive(Default)]
struct Collected {
    streams: Streams,
    result: Option<String>,
    error: Option<ExecError>,
    artifacts: Vec<ArtifactRef>,
    omitted: Vec<Omitted>,
}

/// API v1's status of a cell's end (docs/api-v1.md). The process limit has no status of its
/// own: such a cell failed with its own error (`BlockingIOError`, say), its stderr names the
/// limit.
impl From<CellEnd> for Status {
    fn from(end: CellEnd) -> Status {
        match end {
            CellEnd::Ok => Status::Ok,
            CellEnd::OutputTruncated => Status::OutputTruncated,
            CellEnd::Error | CellEnd::Interrupted | CellEnd::Aborted { denied: false } => {
                Status::Error
            }
            CellEnd::Denied | CellEnd::Aborted { denied: true } => Status::Denied,
            CellEnd::Timeout => Status::Timeout,
            CellEnd::Oom => Status::Oom,
            CellEnd::SandboxLost => Status::SandboxLost,
        }
    }
}

/// Maps the kernel's reply (and cellgate's outcome on it) to the API's status.
pub fn status_of(reply: &ExecuteReply) -> Status {
    reply.end().into()
}

/// What the API's executions ask of the kernel: a visible execution that may ask for input.
fn execute_options(timeout: Option<Duration>) -> ExecuteOptions {
    ExecuteOptions {
        timeout,
        allow_stdin: true,
        silent: false,
        adopt_display_updates: false,
        user_expressions: Default::default(),
    }
}

/// The resources an execution used, from the sandbox's usage before and after it.
pub(super) fn resources_between(
    before: Option<ResourceUsage>,
    after: Option<ResourceUsage>,
) -> Resources {
    match (before, after) {
        (Some(before), Some(after)) => Resources {
            cpu_time_ms: match (before.cpu_time, after.cpu_time) {
                (Some(b), Some(a)) => Some(a.saturating_sub(b).as_millis() as u64),
                _ => None,
            },
            memory_peak_bytes: after.memory_peak_bytes,
            memory_bytes: after.memory_bytes,
        },
        _ => Resources::default(),
    }
}

/// One execution's session side while it runs: what its result will report (its events are
/// recorded in the session's journal as they go out).
struct Turn<'a> {
    session: &'a Session,
    tx: &'a mpsc::UnboundedSender<Numbered>,
    execution_id: ExecutionId,
    collected: Collected,
}

impl<'a> Turn<'a> {
    /// The turn of `execution_id`, announced with its `Started` event.
    fn start(
        session: &'a Session,
        tx: &'a mpsc::UnboundedSender<Numbered>,
        execution_id: ExecutionId,
        code: String,
        started_at: String,
    ) -> Turn<'a> {
        // Recorded as begun (no result yet): if the gateway dies before `done`, the next one
        // answers for it as lost rather than not knowing it (`persistence::lost_result`).
        if let Some(store) = &session.store {
            super::persistence::execution_begun(store, session, &execution_id, &code, &started_at);
        }
        session
            .journal
            .lock()
            .begin(execution_id.clone(), code.clone(), started_at);
        let mut turn = Turn {
            session,
            tx,
            execution_id,
            collected: Collected::default(),
        };
        turn.emit(SessionEvent::Started {
            execution_id: turn.execution_id.clone(),
            code,
        });
        turn
    }

    /// Sends an event to the caller and the session's subscribers; the session's journal
    /// keeps it.
    fn emit(&mut self, event: SessionEvent) {
        let numbered = self.session.publish(event);
        let _ = self.tx.send(numbered);
    }

    /// Translates the kernel's events into session events until its reply (a default one if
    /// the execution ended without).
    async fn translate(&mut self, events: &mut mpsc::UnboundedReceiver<ExecEvent>) -> ExecuteReply {
        while let Some(event) = events.recv().await {
            let id = self.execution_id.clone();
            match event {
                ExecEvent::Busy => {}
                ExecEvent::Stream { name, text } => self.on_stream(name, &text),
                ExecEvent::Display {
                    data,
                    display_id,
                    update,
                    ..
                } => self.on_display(data, display_id, update).await,
                ExecEvent::Result {
                    execution_count,
                    data,
                    ..
                } => self.on_result(execution_count, data).await,
                ExecEvent::Error {
                    ename,
                    evalue,
                    traceback,
                } => self.on_error(ename, evalue, &traceback),
                ExecEvent::ClearOutput { wait } => self.emit(SessionEvent::ClearOutput {
                    execution_id: id,
                    wait,
                }),
                ExecEvent::InputRequest { prompt, password } => {
                    self.emit(SessionEvent::InputRequest {
                        execution_id: id,
                        prompt,
                        password,
                    })
                }
                ExecEvent::Done(done) => return done,
            }
        }
        ExecuteReply::default()
    }

    fn on_stream(&mut self, name: String, text: &str) {
        let cap = self.session.options.stream_cap;
        let Some(text) = self.collected.streams.push(&name, text, cap) else {
            return;
        };
        self.emit(SessionEvent::Stream {
            execution_id: self.execution_id.clone(),
            name,
            text,
        });
    }

    async fn on_display(
        &mut self,
        data: Map<String, Value>,
        display_id: Option<String>,
        update: bool,
    ) {
        let origin = if update {
            Origin::UpdateDisplayData
        } else {
            Origin::DisplayData
        };
        let text = plain_text(&data);
        let text_only = !data
            .keys()
            .any(|mime| crate::artifacts::RICH_MIME_TYPES.contains(&mime.as_str()));
        let refs = self
            .session
            .store_bundle(
                data,
                origin,
                &self.execution_id,
                display_id.as_deref(),
                &mut self.collected.omitted,
            )
            .await;
        self.collected.artifacts.extend(refs.iter().cloned());
        if text_only && !update && display_id.is_none() {
            // A display with nothing but text (not one whose rich part was omitted: the
            // omission says so) is what the cell showed as text: IRkernel
            // shows every value so (`x` alone in a cell), and `display("…")` in Python. The
            // result's `stdout` carries it, as a print would, or a chat client would see
            // nothing of it; the event below still tells live clients it was a display.
            if let Some(text) = &text {
                let cap = self.session.options.stream_cap;
                let _ = self
                    .collected
                    .streams
                    .push("stdout", &format!("{text}\n"), cap);
            }
        }
        let execution_id = self.execution_id.clone();
        self.emit(if update {
            SessionEvent::UpdateDisplay {
                execution_id,
                display_id,
                text,
                artifacts: refs,
            }
        } else {
            SessionEvent::Display {
                execution_id,
                display_id,
                text,
                artifacts: refs,
            }
        });
    }

    async fn on_result(&mut self, execution_count: Option<i64>, data: Map<String, Value>) {
        let text = plain_text(&data);
        let refs = self
            .session
            .store_bundle(
                data,
                Origin::ExecuteResult,
                &self.execution_id,
                None,
                &mut self.collected.omitted,
            )
            .await;
        self.collected.artifacts.extend(refs.iter().cloned());
        self.collected.result = text.clone();
        self.emit(SessionEvent::Result {
            execution_id: self.execution_id.clone(),
            execution_count,
            text,
            artifacts: refs,
        });
    }

    fn on_error(&mut self, ename: String, evalue: String, traceback: &[String]) {
        let traceback: Vec<String> = traceback.iter().map(|t| strip_ansi(t)).collect();
        self.collected.error = Some(ExecError {
            ename: ename.clone(),
            evalue: evalue.clone(),
            traceback: traceback.clone(),
        });
        self.emit(SessionEvent::Error {
            execution_id: self.execution_id.clone(),
            ename,
            evalue,
            traceback,
        });
    }

    /// Sends the `Done` event with `result`, and moves the execution to the history in the
    /// same step.
    fn finish(self, result: ExecutionResult) {
        let done = Arc::new(SessionEvent::Done {
            execution_id: self.execution_id.clone(),
            result: Box::new(result.clone()),
        });
        let (numbered, finished) = {
            let mut journal = self.session.journal.lock();
            let numbered = journal.finish(done, Arc::new(result));
            let _ = self.session.events.send(numbered.clone());
            // What the store keeps of it (its events stay here: only their output bytes
            // are counted), taken under the same lock.
            let finished =
                self.session
                    .store
                    .as_ref()
                    .and(journal.execution(&self.execution_id).map(|entry| {
                        let bytes = entry.events.iter().map(|e| output_bytes(&e.event)).sum();
                        (entry.clone_without_events(), bytes)
                    }));
            (numbered, finished)
        };
        let _ = self.tx.send(numbered);
        // After `done` went out: the store's writes are queued, never waited for.
        if let (Some(store), Some((entry, output_bytes))) = (&self.session.store, finished) {
            super::persistence::execution_finished(store, self.session, &entry, output_bytes);
        }
    }
}

/// Bytes of text output an event carries, for the usage ledger (artifacts are counted
/// apart).
fn output_bytes(event: &SessionEvent) -> u64 {
    let text = match event {
        SessionEvent::Stream { text, .. } => Some(text),
        SessionEvent::Display { text, .. }
        | SessionEvent::UpdateDisplay { text, .. }
        | SessionEvent::Result { text, .. } => text.as_ref(),
        _ => None,
    };
    text.map_or(0, |t| t.len() as u64)
}

/// An execution between its start and its `done`, as the session's monitor sees it; over
/// when dropped (also when the run ends early).
struct InTurn<'a>(&'a Session);

impl<'a> InTurn<'a> {
    fn enter(session: &'a Session) -> InTurn<'a> {
        session.in_turn.send_replace(true);
        InTurn(session)
    }
}

impl Drop for InTurn<'_> {
    fn drop(&mut self) {
        self.0.in_turn.send_replace(false);
    }
}

impl Session {
    pub(super) async fn run(
        self: Arc<Self>,
        code: String,
        timeout: Option<Duration>,
        tx: mpsc::UnboundedSender<Numbered>,
    ) {
        let _one_at_a_time = self.run_lock.lock().await;
        let _in_turn = InTurn::enter(&self);
        let started = Instant::now();
        let started_at = crate::kernel::format_timestamp(time::OffsetDateTime::now_utc());
        let usage_before = self.kernel.usage();
        let mut execution = match self.client.execute(&code, execute_options(timeout)).await {
            Ok(execution) => execution,
            Err(err) => {
                // The kernel is dead or gone: a typed result, not an HTTP error.
                let execution_id = ExecutionId::random();
                let turn = Turn::start(&self, &tx, execution_id, code, started_at);
                let result = self.lost_result(turn.execution_id.clone(), &err);
                turn.finish(result);
                return;
            }
        };
        let execution_id =
            super::request_id(&execution.msg_id, ExecutionId::parse, ExecutionId::random);
        let mut turn = Turn::start(&self, &tx, execution_id, code, started_at);
        let reply = turn.translate(&mut execution.events).await;
        // Files the code wrote under outputs/ become artifacts.
        let (files, omitted) = self.collect_outputs(&turn.execution_id).await;
        turn.collected.artifacts.extend(files);
        turn.collected.omitted.extend(omitted);
        let resources = resources_between(usage_before, self.kernel.usage());
        let collected = std::mem::take(&mut turn.collected);
        let duration_ms = started.elapsed().as_millis() as u64;
        let id = turn.execution_id.clone();
        turn.finish(self.result(id, collected, &reply, resources, duration_ms));
    }

    /// The result of an execution the kernel could not take.
    fn lost_result(&self, execution_id: ExecutionId, err: &KernelError) -> ExecutionResult {
        let evalue = match self.kernel.readiness() {
            Readiness::Dead(reason) => format!("the kernel is dead: {reason}"),
            _ => err.to_string(),
        };
        ExecutionResult::lost(
            execution_id,
            self.kernel.generation(),
            "KernelDiedError",
            evalue,
        )
    }

    /// The result of an execution the kernel replied to.
    fn result(
        &self,
        execution_id: ExecutionId,
        collected: Collected,
        reply: &ExecuteReply,
        resources: Resources,
        duration_ms: u64,
    ) -> ExecutionResult {
        let error = collected.error.or_else(|| {
            (reply.status != "ok").then(|| ExecError {
                ename: reply.ename.clone().unwrap_or_default(),
                evalue: reply.evalue.clone().unwrap_or_default(),
                traceback: reply.traceback.iter().map(|t| strip_ansi(t)).collect(),
            })
        });
        let (stdout, stderr) = collected.streams.collapsed();
        ExecutionResult {
            execution_id,
            status: status_of(reply),
            execution_count: reply.execution_count,
            stdout,
            stderr,
            stdout_truncated: collected.streams.stdout_truncated,
            stderr_truncated: collected.streams.stderr_truncated,
            output_truncated: reply.outcome == Some(Outcome::OutputTruncated),
            result: collected.result,
            error,
            artifacts: collected.artifacts,
            omitted: collected.omitted,
            // The reply's denials, verbatim (docs/api-v1.md).
            denials: reply.denials.clone(),
            duration_ms,
            state_generation: self.kernel.generation(),
            resources,
            restored: self.kernel.take_restored(),
        }
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
    fn every_cell_end_has_its_status() {
        for end in CellEnd::ALL {
            let status = match end {
                CellEnd::Ok => Status::Ok,
                CellEnd::OutputTruncated => Status::OutputTruncated,
                CellEnd::Error | CellEnd::Interrupted => Status::Error,
                CellEnd::Aborted { denied } => match denied {
                    true => Status::Denied,
                    false => Status::Error,
                },
                CellEnd::Denied => Status::Denied,
                CellEnd::Timeout => Status::Timeout,
                CellEnd::Oom => Status::Oom,
                CellEnd::SandboxLost => Status::SandboxLost,
            };
            assert_eq!(Status::from(end), status, "{end:?}");
        }
    }
}
