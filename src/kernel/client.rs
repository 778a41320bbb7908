//! An in-process kernel client: the gateway itself talking to a kernel the way a WebSocket
//! client would, for the chat API and notebook replay.
//!
//! A [`KernelClient`] attaches to a kernel's [`Router`](super::Router) under its own session
//! id with its own queue, so it gets iopub like every client, and replies and
//! `input_request`s for its own requests only. One dispatcher task per client reads that
//! queue and turns the traffic of each execution into typed [`ExecEvent`]s, ending with
//! exactly one [`ExecEvent::Done`] carrying the parsed `execute_reply`, including cellgate's
//! outcome (`metadata.cellgate.outcome`) and policy denials (`metadata.cellgate.denials`).
//!
//! An execution is done when both its `execute_reply` and its `idle` status arrived (they
//! travel on different sockets, in either order); a reply whose idle never comes (a kernel
//! that died between the two) finishes after [`IDLE_AFTER_REPLY`]. A kernel that is shut
//! down, restarted by a client, or whose router drops this client finishes every execution
//! still waiting, so a caller never waits forever. The router's truncation marker counts as
//! `output_truncated` even when the reply overtook the output.
//!
//! A per-execution timeout works like the policy's: interrupt (the router reports the
//! `KeyboardInterrupt` as `CellTimeoutError`, outcome `timeout`), then restart the kernel if
//! the cell ignores the interrupt for the policy's grace period.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::execution::{CellEnd, Denial, ExecutionState, Outcome};
use super::lifecycle::Kernel;
use super::router::{client_queue, ClientId, Inbox};
use super::KernelError;
use crate::protocol::{Channel, Message};

/// How long an execution whose reply arrived waits for its `idle` status.
pub const IDLE_AFTER_REPLY: Duration = Duration::from_secs(2);

/// What a caller may ask of one execution.
#[derive(Debug, Clone, Default)]
pub struct ExecuteOptions {
    /// Interrupt the cell once it has run this long (from the kernel's `busy`), and report
    /// `timeout`. The policy's own execution timeout applies as well.
    pub timeout: Option<Duration>,
    /// Whether `input()` may ask the caller (otherwise it raises in the kernel).
    pub allow_stdin: bool,
    /// Run without an execution count and without history (`silent`).
    pub silent: bool,
    /// Display updates that belong to no execution of this client (from a thread or comm of
    /// an earlier cell) come to this execution too: for a caller that keeps every output
    /// of the kernel, such as a notebook.
    pub adopt_display_updates: bool,
    /// Expressions the kernel evaluates after the code, answered in the reply
    /// ([`ExecuteReply::user_expressions`]): what must reach the caller even past the
    /// output limit, which drops outputs but never the reply.
    pub user_expressions: serde_json::Map<String, Value>,
}

/// One piece of an execution, in the order the kernel produced it.
#[derive(Debug, Clone)]
pub enum ExecEvent {
    /// The kernel started running the cell (its `busy` status).
    Busy,
    Stream {
        name: String,
        text: String,
    },
    /// `display_data` (`update: false`) or `update_display_data` (`update: true`).
    Display {
        data: Map<String, Value>,
        metadata: Value,
        display_id: Option<String>,
        update: bool,
    },
    Result {
        execution_count: Option<i64>,
        data: Map<String, Value>,
        metadata: Value,
    },
    Error {
        ename: String,
        evalue: String,
        traceback: Vec<String>,
    },
    /// `clear_output` (`wait`: clear when the next output arrives).
    ClearOutput {
        wait: bool,
    },
    InputRequest {
        prompt: String,
        password: bool,
    },
    /// The last event of every execution.
    Done(ExecuteReply),
}

/// The parsed `execute_reply` of one execution.
#[derive(Debug, Clone, Default)]
pub struct ExecuteReply {
    /// `ok`, `error` or `aborted`, as the kernel said.
    pub status: String,
    pub execution_count: Option<i64>,
    /// `metadata.cellgate.outcome`: timeout, oom, pids, sandbox_lost, output_truncated.
    pub outcome: Option<Outcome>,
    /// `metadata.cellgate.denials`.
    pub denials: Vec<Denial>,
    pub ename: Option<String>,
    pub evalue: Option<String>,
    pub traceback: Vec<String>,
    /// This request's own timeout ([`ExecuteOptions::timeout`]) passed while the cell ran
    /// (whichever timeout's interrupt got there first).
    pub request_timed_out: bool,
    /// The reply's `user_expressions`, as the kernel sent them (`{}` when it sent none).
    pub user_expressions: Value,
}

impl ExecuteReply {
    /// How the cell ended, all told (the kernel's status, cellgate's outcome, the denials).
    pub fn end(&self) -> CellEnd {
        CellEnd::classify(
            Some(self.status.as_str()),
            self.ename.as_deref(),
            self.outcome,
            &self.denials,
        )
    }

    fn from_message(message: &Message) -> ExecuteReply {
        let content = message.content_json().unwrap_or(Value::Null);
        let metadata: Value = serde_json::from_slice(&message.metadata).unwrap_or(Value::Null);
        let cellgate = &metadata["cellgate"];
        ExecuteReply {
            status: content["status"].as_str().unwrap_or("error").to_owned(),
            execution_count: content["execution_count"].as_i64(),
            // Read one by one: a kernel can put anything in its reply's metadata, and a value
            // that is none of ours must not hide those that are.
            outcome: Outcome::deserialize(&cellgate["outcome"]).ok(),
            denials: cellgate["denials"]
                .as_array()
                .map(|all| {
                    all.iter()
                        .filter_map(|d| Denial::deserialize(d).ok())
                        .collect()
                })
                .unwrap_or_default(),
            ename: content["ename"].as_str().map(str::to_owned),
            evalue: content["evalue"].as_str().map(str::to_owned),
            traceback: strings(&content["traceback"]),
            request_timed_out: false,
            user_expressions: content["user_expressions"].clone(),
        }
    }

    /// A reply the client makes up for an execution the kernel will never answer.
    fn synthetic(ename: &str, evalue: &str, outcome: Option<Outcome>) -> ExecuteReply {
        ExecuteReply {
            status: "error".to_owned(),
            execution_count: None,
            outcome,
            denials: Vec::new(),
            ename: Some(ename.to_owned()),
            evalue: Some(evalue.to_owned()),
            traceback: vec![format!("{ename}: {evalue}")],
            request_timed_out: false,
            user_expressions: Value::Null,
        }
    }
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// One execution in progress: its request id and its events.
pub struct Execution {
    pub msg_id: String,
    pub events: mpsc::UnboundedReceiver<ExecEvent>,
}

struct Pending {
    events: mpsc::UnboundedSender<ExecEvent>,
    reply: Option<ExecuteReply>,
    idle: bool,
    /// The router's truncation marker went by: the output limit cut this cell off, even
    /// when its reply overtook the output (iopub and shell race) and carries no outcome.
    truncated: bool,
    /// The request's own timeout passed while it ran.
    timed_out: bool,
    adopt_display_updates: bool,
    /// Reply and idle are in; the execution waits out its kernel's late-output grace.
    lingering: bool,
}

#[derive(Default)]
struct Shared {
    pending: HashMap<String, Pending>,
    /// The last `input_request` of each execution, to answer it.
    awaiting_input: Option<(String, Arc<Message>)>,
    /// Set once the router let go of this client: nothing more will arrive.
    closed: bool,
    /// An execution of this client adopted display updates: those arriving while none runs
    /// wait here for the next one (a thread of an earlier cell updates when it likes).
    adopting: bool,
    unclaimed_updates: VecDeque<ExecEvent>,
    /// The kernel's late-output grace ([`late_output_of`]).
    late_output: Option<Duration>,
}

/// Display updates kept for the next adopting execution; older ones go first.
const MAX_UNCLAIMED_UPDATES: usize = 256;

/// The gateway's own client of one kernel. Detaches from the router when dropped.
pub struct KernelClient {
    kernel: Arc<Kernel>,
    id: ClientId,
    session: String,
    shared: Arc<Mutex<Shared>>,
    dispatcher: tokio::task::JoinHandle<()>,
}

impl Drop for KernelClient {
    fn drop(&mut self) {
        self.kernel.router().detach(self.id);
        self.dispatcher.abort();
        self.shared.lock().finish_all(
            "ClientClosedError",
            "the execution's client was closed",
            None,
        );
    }
}

impl Shared {
    fn finish(&mut self, msg_id: &str) {
        if let Some(pending) = self.pending.remove(msg_id) {
            let mut reply = pending.reply.unwrap_or_else(|| {
                ExecuteReply::synthetic(
                    "KernelDiedError",
                    "the kernel ended before it answered",
                    Some(Outcome::SandboxLost),
                )
            });
            if pending.truncated && reply.outcome.is_none() {
                reply.outcome = Some(Outcome::OutputTruncated);
            }
            reply.request_timed_out = pending.timed_out;
            let _ = pending.events.send(ExecEvent::Done(reply));
        }
        if self
            .awaiting_input
            .as_ref()
            .is_some_and(|(id, _)| id == msg_id)
        {
            self.awaiting_input = None;
        }
    }

    fn finish_all(&mut self, ename: &str, evalue: &str, outcome: Option<Outcome>) {
        for (_, pending) in self.pending.drain() {
            let mut reply = pending
                .reply
                .unwrap_or_else(|| ExecuteReply::synthetic(ename, evalue, outcome));
            reply.request_timed_out = pending.timed_out;
            let _ = pending.events.send(ExecEvent::Done(reply));
        }
        self.awaiting_input = None;
    }
}

impl KernelClient {
    /// Attaches a new client to `kernel`. Must be called inside a tokio runtime.
    pub fn attach(kernel: Arc<Kernel>) -> KernelClient {
        let session = format!("cellgate-client-{}", uuid::Uuid::new_v4().simple());
        let (outbox, inbox) = client_queue();
        let (id, _) = kernel.router().attach(&session, outbox);
        let shared = Arc::new(Mutex::new(Shared {
            late_output: late_output_of(&kernel.spec),
            ..Shared::default()
        }));
        let dispatcher = tokio::spawn(dispatch(inbox, Arc::downgrade(&shared)));
        KernelClient {
            kernel,
            id,
            session,
            shared,
            dispatcher,
        }
    }

    pub fn kernel(&self) -> &Arc<Kernel> {
        &self.kernel
    }

    /// Sends `code` for execution and returns its event stream. Executions queue in the
    /// kernel in the order they were sent.
    pub async fn execute(
        &self,
        code: &str,
        options: ExecuteOptions,
    ) -> Result<Execution, KernelError> {
        let content = json!({
            "code": code,
            "silent": options.silent,
            "store_history": !options.silent,
            "user_expressions": options.user_expressions,
            "allow_stdin": options.allow_stdin,
            "stop_on_error": true,
        });
        let request = Message::new(
            Channel::Shell,
            "execute_request",
            &self.session,
            None,
            &content,
        );
        let msg_id = request.msg_id().to_owned();
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut shared = self.shared.lock();
            if shared.closed {
                return Err(KernelError::Terminated);
            }
            if options.adopt_display_updates {
                shared.adopting = true;
                for event in shared.unclaimed_updates.drain(..) {
                    let _ = tx.send(event);
                }
            }
            shared.pending.insert(
                msg_id.clone(),
                Pending {
                    events: tx,
                    reply: None,
                    idle: false,
                    truncated: false,
                    timed_out: false,
                    adopt_display_updates: options.adopt_display_updates,
                    lingering: false,
                },
            );
        }
        if let Err(err) = self.kernel.send(self.id, &self.session, request).await {
            self.shared.lock().pending.remove(&msg_id);
            return Err(err);
        }
        if let Some(limit) = options.timeout {
            spawn_timeout(&self.kernel, &self.shared, msg_id.clone(), limit);
        }
        Ok(Execution { msg_id, events: rx })
    }

    /// Answers the pending `input()` of execution `msg_id` (any execution when `None`).
    /// Returns false when no input is awaited.
    pub async fn input_reply(
        &self,
        msg_id: Option<&str>,
        value: &str,
    ) -> Result<bool, KernelError> {
        let request = {
            let mut shared = self.shared.lock();
            match &shared.awaiting_input {
                Some((id, _)) if msg_id.is_none_or(|m| m == id) => {
                    shared.awaiting_input.take().map(|(_, r)| r)
                }
                _ => None,
            }
        };
        let Some(request) = request else {
            return Ok(false);
        };
        let reply = Message::new(
            Channel::Stdin,
            "input_reply",
            &self.session,
            Some(&request),
            &json!({"value": value, "status": "ok"}),
        );
        self.kernel.send(self.id, &self.session, reply).await?;
        Ok(true)
    }

    /// The execution waiting for `input()`, if one is.
    pub fn awaiting_input(&self) -> Option<String> {
        self.shared
            .lock()
            .awaiting_input
            .as_ref()
            .map(|(id, _)| id.clone())
    }

    /// Interrupts whatever the kernel runs.
    pub async fn interrupt(&self) -> Result<(), KernelError> {
        self.kernel.interrupt().await
    }

    /// Restarts the kernel (new state generation). Executions of this client that were still
    /// waiting end with an error saying so: the process that would answer them is gone.
    pub async fn restart(&self) -> Result<(), KernelError> {
        let result = self.kernel.restart().await;
        self.abandon("KernelRestartedError", "the kernel was restarted");
        result
    }

    /// Whether the router let go of this client (the kernel was shut down, or the client
    /// fell too far behind): nothing more will arrive.
    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }

    /// Ends every execution still waiting, with `ename: evalue`.
    pub fn abandon(&self, ename: &str, evalue: &str) {
        self.shared.lock().finish_all(ename, evalue, None);
    }
}

/// The per-execution timeout: interrupt once the cell ran `limit`, restart after the
/// kernel's interrupt grace if it keeps running.
fn spawn_timeout(
    kernel: &Arc<Kernel>,
    shared: &Arc<Mutex<Shared>>,
    msg_id: String,
    limit: Duration,
) {
    let kernel = Arc::downgrade(kernel);
    let shared = Arc::downgrade(shared);
    tokio::spawn(async move {
        let mut interrupted: Option<Instant> = None;
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let (Some(kernel), Some(shared)) = (kernel.upgrade(), shared.upgrade()) else {
                return;
            };
            if !shared.lock().pending.contains_key(&msg_id) {
                return;
            }
            let router = kernel.router();
            let running = router
                .running()
                .filter(|(id, _)| *id == msg_id)
                .map(|(_, elapsed)| elapsed);
            match (interrupted, running) {
                (None, Some(elapsed)) if elapsed >= limit => {
                    if let Some(pending) = shared.lock().pending.get_mut(&msg_id) {
                        pending.timed_out = true;
                    }
                    // The policy's watchdog may have got there first.
                    if router.timed_out_since(&msg_id).is_none() {
                        router.mark_timed_out(
                            &msg_id,
                            format!(
                                "the cell ran longer than its timeout of {:.3} s and was interrupted",
                                limit.as_secs_f64()
                            ),
                        );
                        tracing::info!(kernel_id = %kernel.id, %msg_id, "execution timeout of the request: interrupting");
                        if let Err(err) = kernel.interrupt().await {
                            tracing::warn!(kernel_id = %kernel.id, %err, "interrupt after timeout failed");
                        }
                    }
                    interrupted = Some(Instant::now());
                }
                (Some(since), Some(_)) if since.elapsed() >= kernel.interrupt_grace() => {
                    let evalue = format!(
                        "the cell ran longer than its timeout of {:.3} s, ignored the interrupt, and the kernel was restarted: its variables are lost",
                        limit.as_secs_f64()
                    );
                    tracing::warn!(kernel_id = %kernel.id, %msg_id, "cell ignored the interrupt: restarting the kernel");
                    let restarted = kernel.restart().await;
                    router.fail_timed_out(&msg_id, &evalue);
                    if let Err(err) = restarted {
                        tracing::error!(kernel_id = %kernel.id, %err, "restart after timeout failed");
                    }
                    return;
                }
                _ => {}
            }
        }
    });
}

/// Reads the client's queue and sorts each message into its execution.
async fn dispatch(mut inbox: Inbox, shared: Weak<Mutex<Shared>>) {
    while let Some(message) = inbox.recv().await {
        let Some(shared_arc) = shared.upgrade() else {
            return;
        };
        let mut shared = shared_arc.lock();
        let parent = message
            .parent_msg_id()
            .filter(|p| shared.pending.contains_key(*p))
            .map(str::to_owned);
        let Some(parent) = parent else {
            if message.channel == Channel::Iopub && message.msg_type() == "update_display_data" {
                adopt_display_update(&mut shared, &message);
            }
            continue;
        };
        match message.channel {
            Channel::Iopub => {
                handle_iopub(&mut shared, &parent, &message);
                let complete = shared
                    .pending
                    .get(&parent)
                    .is_some_and(|p| p.idle && p.reply.is_some() && !p.lingering);
                if complete {
                    complete_execution(&mut shared, &shared_arc, parent);
                }
            }
            Channel::Shell if message.msg_type() == "execute_reply" => {
                let reply = ExecuteReply::from_message(&message);
                let idle = match shared.pending.get_mut(&parent) {
                    Some(pending) => {
                        pending.reply = Some(reply);
                        pending.idle
                    }
                    None => false,
                };
                if idle {
                    complete_execution(&mut shared, &shared_arc, parent);
                } else {
                    spawn_idle_fallback(Arc::downgrade(&shared_arc), parent);
                }
            }
            Channel::Stdin if message.msg_type() == "input_request" => {
                let content = message.content_json().unwrap_or(Value::Null);
                let event = ExecEvent::InputRequest {
                    prompt: content["prompt"].as_str().unwrap_or_default().to_owned(),
                    password: content["password"].as_bool().unwrap_or(false),
                };
                if let Some(pending) = shared.pending.get(&parent) {
                    let _ = pending.events.send(event);
                }
                shared.awaiting_input = Some((parent, message.clone()));
            }
            _ => {}
        }
    }
    if let Some(shared) = shared.upgrade() {
        let mut shared = shared.lock();
        shared.closed = true;
        shared.finish_all(
            "KernelDiedError",
            "the kernel was shut down",
            Some(Outcome::SandboxLost),
        );
    }
}

/// Gives a display update of no execution of this client's to those that adopt them, or
/// keeps it for the next one.
fn adopt_display_update(shared: &mut Shared, message: &Message) {
    if !shared.adopting {
        return;
    }
    let Some(event) = display_event(message, true) else {
        return;
    };
    let mut adopted = false;
    for pending in shared.pending.values().filter(|p| p.adopt_display_updates) {
        let _ = pending.events.send(event.clone());
        adopted = true;
    }
    if !adopted {
        if shared.unclaimed_updates.len() >= MAX_UNCLAIMED_UPDATES {
            shared.unclaimed_updates.pop_front();
        }
        shared.unclaimed_updates.push_back(event);
    }
}

/// A `display_data` (`update: false`) or `update_display_data` as its event.
fn display_event(message: &Message, update: bool) -> Option<ExecEvent> {
    let mut content = message.content_json()?;
    Some(ExecEvent::Display {
        data: take_object(&mut content["data"]),
        metadata: content["metadata"].take(),
        display_id: content["transient"]["display_id"]
            .as_str()
            .map(str::to_owned),
        update,
    })
}

/// Finishes an execution whose reply and `idle` both came: at once, or, for a kernel that
/// publishes outputs after its `idle` (see [`late_output_of`]), once that kernel's grace
/// has passed, with the outputs that came meanwhile.
fn complete_execution(shared: &mut Shared, shared_arc: &Arc<Mutex<Shared>>, msg_id: String) {
    let Some(grace) = shared.late_output else {
        shared.finish(&msg_id);
        return;
    };
    if let Some(pending) = shared.pending.get_mut(&msg_id) {
        pending.lingering = true;
    }
    let weak = Arc::downgrade(shared_arc);
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        if let Some(shared) = weak.upgrade() {
            shared.lock().finish(&msg_id);
        }
    });
}

/// How long after an execution's `idle` its kernel may still publish the execution's
/// outputs: the kernelspec's `metadata.cellgate.late_output_ms`. Deno's kernel sends the
/// value of a cell (and `console.log` lines) from another thread, through a channel its
/// main loop drains, and says `idle` without waiting for that channel (its own comment
/// says there is nothing to wait on): measured here, 5 in 100 `execute_result`s came after
/// the `idle`, by under 1 ms. A kernel that declares nothing finishes at its `idle`.
fn late_output_of(spec: &super::KernelSpec) -> Option<Duration> {
    spec.metadata
        .get("cellgate")
        .and_then(|c| c.get("late_output_ms"))
        .and_then(Value::as_u64)
        .filter(|ms| *ms > 0)
        .map(|ms| Duration::from_millis(ms.min(MAX_LATE_OUTPUT_MS)))
}

/// The longest grace a kernelspec may ask for: every execution of its kernels waits it.
const MAX_LATE_OUTPUT_MS: u64 = 1000;

/// Finishes an execution whose reply came but whose `idle` status does not.
fn spawn_idle_fallback(shared: Weak<Mutex<Shared>>, msg_id: String) {
    tokio::spawn(async move {
        tokio::time::sleep(IDLE_AFTER_REPLY).await;
        if let Some(shared) = shared.upgrade() {
            shared.lock().finish(&msg_id);
        }
    });
}

fn handle_iopub(shared: &mut Shared, parent: &str, message: &Message) {
    let content = || message.content_json().unwrap_or(Value::Null);
    let event = match message.msg_type() {
        "status" => match ExecutionState::of_status(message) {
            Some(ExecutionState::Busy) => Some(ExecEvent::Busy),
            Some(ExecutionState::Idle) => {
                if let Some(pending) = shared.pending.get_mut(parent) {
                    pending.idle = true;
                }
                None
            }
            Some(ExecutionState::Starting | ExecutionState::Restarting | ExecutionState::Dead)
            | None => None,
        },
        "stream" => {
            if marker_outcome(message) == Some(Outcome::OutputTruncated) {
                if let Some(pending) = shared.pending.get_mut(parent) {
                    pending.truncated = true;
                }
            }
            let content = content();
            Some(ExecEvent::Stream {
                name: content["name"].as_str().unwrap_or("stdout").to_owned(),
                text: content["text"].as_str().unwrap_or_default().to_owned(),
            })
        }
        kind @ ("display_data" | "update_display_data") => {
            // Unparsable content still counts as a display, as it always did.
            display_event(message, kind == "update_display_data").or_else(|| {
                Some(ExecEvent::Display {
                    data: Map::new(),
                    metadata: Value::Null,
                    display_id: None,
                    update: kind == "update_display_data",
                })
            })
        }
        "execute_result" => {
            let mut content = content();
            Some(ExecEvent::Result {
                execution_count: content["execution_count"].as_i64(),
                data: take_object(&mut content["data"]),
                metadata: content["metadata"].take(),
            })
        }
        "error" => {
            let content = content();
            Some(ExecEvent::Error {
                ename: content["ename"].as_str().unwrap_or_default().to_owned(),
                evalue: content["evalue"].as_str().unwrap_or_default().to_owned(),
                traceback: strings(&content["traceback"]),
            })
        }
        "clear_output" => Some(ExecEvent::ClearOutput {
            wait: content()["wait"].as_bool().unwrap_or(false),
        }),
        _ => None,
    };
    if let (Some(event), Some(pending)) = (event, shared.pending.get(parent)) {
        let _ = pending.events.send(event);
    }
}

/// The outcome a gateway marker line carries (`metadata.cellgate.outcome`).
fn marker_outcome(message: &Message) -> Option<Outcome> {
    #[derive(serde::Deserialize)]
    struct Metadata {
        cellgate: Cellgate,
    }
    #[derive(serde::Deserialize)]
    struct Cellgate {
        outcome: Outcome,
    }
    serde_json::from_slice::<Metadata>(&message.metadata)
        .ok()
        .map(|m| m.cellgate.outcome)
}

fn take_object(value: &mut Value) -> Map<String, Value> {
    match value.take() {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(metadata: Value) -> super::super::KernelSpec {
        super::super::KernelSpec {
            name: "k".into(),
            dir: "/nonexistent".into(),
            argv: vec!["k".into()],
            display_name: "K".into(),
            language: "typescript".into(),
            interrupt_mode: Default::default(),
            env: Default::default(),
            metadata: metadata.as_object().cloned().unwrap_or_default(),
            kernel_protocol_version: None,
            resources: Default::default(),
        }
    }

    #[test]
    fn a_kernelspec_declares_its_late_output_grace_within_a_bound() {
        assert_eq!(late_output_of(&spec(json!({}))), None);
        assert_eq!(
            late_output_of(&spec(json!({"cellgate": {"late_output_ms": 0}}))),
            None
        );
        assert_eq!(
            late_output_of(&spec(json!({"cellgate": {"late_output_ms": 50}}))),
            Some(Duration::from_millis(50))
        );
        assert_eq!(
            late_output_of(&spec(json!({"cellgate": {"late_output_ms": 3_600_000}}))),
            Some(Duration::from_millis(MAX_LATE_OUTPUT_MS))
        );
        assert_eq!(
            late_output_of(&spec(json!({"cellgate": {"late_output_ms": "50"}}))),
            None
        );
    }
}
