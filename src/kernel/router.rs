//! Routes one kernel's messages to the WebSocket clients attached to it.
//!
//! The gateway holds a single set of ZMQ sockets per kernel (one identity for shell, control
//! and stdin, one SUB for iopub) and does the routing itself:
//! - iopub goes to every attached client;
//! - a shell or control reply goes to the client that sent the request, found by the reply's
//!   `parent_header.msg_id`; an `input_request` on stdin goes to the client that sent the
//!   execute it belongs to;
//! - a client whose socket is gone keeps its replies: they go to another socket of the same
//!   `session_id` if there is one, else into that session's offline buffer, replayed when a
//!   socket with the same `session_id` attaches.
//!
//! Routing by request id rather than by ZMQ identity is what makes a newer socket that
//! reuses the `session_id` of a closing one safe (Kernel Gateway 3.0.1 loses replies there,
//! gateway-contract.md 1.12), and it costs no sockets per connection.
//!
//! Messages caused by the gateway's own requests (start-up nudges, interrupts, shutdowns) are
//! answered to the gateway and never shown to clients.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::json;
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot};

use super::history::History;
use crate::protocol::{Channel, HeaderFields, Message};
use crate::sandbox::SandboxHandle;

/// Identifies one attached WebSocket.
pub type ClientId = u64;

/// Bytes queued for one client before it counts as too slow and is disconnected (its session
/// then buffers like any disconnected one). Without this a stalled reader grows the gateway's
/// memory without bound.
pub const MAX_CLIENT_QUEUE_BYTES: usize = 256 << 20;

/// The router's end of one client's queue.
#[derive(Clone)]
pub struct Outbox {
    tx: mpsc::UnboundedSender<Arc<Message>>,
    shared: Arc<QueueState>,
}

/// The writer's end of one client's queue.
pub struct Inbox {
    rx: mpsc::UnboundedReceiver<Arc<Message>>,
    shared: Arc<QueueState>,
}

#[derive(Default)]
struct QueueState {
    bytes: std::sync::atomic::AtomicUsize,
    evicted: std::sync::atomic::AtomicBool,
}

/// A queue from the router to one client's writer, with byte accounting.
pub fn client_queue() -> (Outbox, Inbox) {
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(QueueState::default());
    (
        Outbox {
            tx,
            shared: shared.clone(),
        },
        Inbox { rx, shared },
    )
}

impl Outbox {
    /// Queues a message; false when the client is over its limit.
    fn push(&self, message: Arc<Message>) -> bool {
        use std::sync::atomic::Ordering;
        let size = message.byte_len();
        if self.shared.bytes.fetch_add(size, Ordering::Relaxed) + size > MAX_CLIENT_QUEUE_BYTES {
            self.shared.evicted.store(true, Ordering::Relaxed);
            return false;
        }
        let _ = self.tx.send(message);
        true
    }
}

impl Inbox {
    fn account(&self, message: &Arc<Message>) {
        self.shared
            .bytes
            .fetch_sub(message.byte_len(), std::sync::atomic::Ordering::Relaxed);
    }

    pub async fn recv(&mut self) -> Option<Arc<Message>> {
        let message = self.rx.recv().await?;
        self.account(&message);
        Some(message)
    }

    pub fn try_recv(&mut self) -> Option<Arc<Message>> {
        let message = self.rx.try_recv().ok()?;
        self.account(&message);
        Some(message)
    }

    /// Whether the router dropped this client for being too slow.
    pub fn evicted(&self) -> bool {
        self.shared
            .evicted
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Requests whose replies are still expected are remembered up to this many; older entries
/// are forgotten (a request without a reply, such as `comm_msg`, must not leak forever).
const MAX_PENDING: usize = 16_384;
/// Sessions buffered at once while they have no socket.
const MAX_OFFLINE_SESSIONS: usize = 8;
/// Bytes buffered per offline session before further output is dropped (and counted).
const MAX_OFFLINE_BYTES: usize = 64 << 20;

struct Client {
    session: String,
    outbox: Outbox,
}

#[derive(Clone)]
struct Requester {
    client: ClientId,
    session: String,
    /// For execute requests: the request's header, to answer it in the kernel's stead.
    request: Option<(HeaderFields, Bytes)>,
}

/// An execution the gateway interrupted because it ran past the policy's timeout.
struct TimedOut {
    since: Instant,
    evalue: String,
}

#[derive(Default)]
struct OfflineBuffer {
    messages: Vec<Arc<Message>>,
    bytes: usize,
    dropped: usize,
    /// Order of creation, to evict the oldest buffer first.
    serial: u64,
}

/// Kernel state visible in the kernel model, kept here because deliveries change it.
#[derive(Debug, Clone)]
pub struct Activity {
    pub execution_state: String,
    pub last_activity: OffsetDateTime,
}

struct State {
    clients: HashMap<ClientId, Client>,
    next_client: ClientId,
    pending: HashMap<String, Requester>,
    pending_order: VecDeque<String>,
    internal_replies: HashMap<String, oneshot::Sender<Arc<Message>>>,
    internal_parents: HashSet<String>,
    offline: HashMap<String, OfflineBuffer>,
    offline_serial: u64,
    activity: Activity,
    dropped_replies: u64,
    /// The execute request the kernel is busy with, and since when.
    running: Option<(String, Instant)>,
    timed_out: HashMap<String, TimedOut>,
    /// Output bytes of the running execution, and whether it was cut off.
    cell_output: u64,
    cell_truncated: bool,
    /// Executions whose output was cut off, for their reply's outcome.
    truncated: HashSet<String>,
    /// The running generation's sandbox, asked after a failed execution whether the pids
    /// limit refused a fork; and the count already reported.
    pids_probe: Option<Arc<dyn SandboxHandle>>,
    pids_seen: u64,
    /// What clients executed and saw, for notebook export.
    history: Arc<History>,
    /// Policy denials (egress, packages) of executions not yet replied to.
    denials: HashMap<String, Vec<serde_json::Value>>,
    /// The running execution's execute_reply, held until its `idle` status: the reply comes
    /// on the shell socket and can overtake the execution's last outputs, still on iopub (a
    /// large one is checked off the async workers for tens of ms). The reply's outcome
    /// (`output_truncated`) depends on those outputs, and clients get them first.
    held_reply: Option<(String, Arc<Message>)>,
}

/// The routing table of one kernel. Survives restarts: clients stay attached while the kernel
/// process is replaced.
pub struct Router {
    state: Mutex<State>,
    kernel_id: String,
    /// Output bytes one execution may produce; the rest is dropped with a marker.
    output_limit: Option<u64>,
}

#[derive(Deserialize)]
struct StatusContent<'a> {
    #[serde(borrow)]
    execution_state: std::borrow::Cow<'a, str>,
}

fn status_of(message: &Message) -> Option<String> {
    if message.msg_type() != "status" {
        return None;
    }
    serde_json::from_slice::<StatusContent<'_>>(&message.content)
        .ok()
        .map(|c| c.execution_state.into_owned())
}

impl Router {
    pub fn new(kernel_id: &str) -> Router {
        Router {
            kernel_id: kernel_id.to_owned(),
            state: Mutex::new(State {
                clients: HashMap::new(),
                next_client: 1,
                pending: HashMap::new(),
                pending_order: VecDeque::new(),
                internal_replies: HashMap::new(),
                internal_parents: HashSet::new(),
                offline: HashMap::new(),
                offline_serial: 0,
                activity: Activity {
                    execution_state: "starting".to_owned(),
                    last_activity: OffsetDateTime::now_utc(),
                },
                dropped_replies: 0,
                running: None,
                held_reply: None,
                timed_out: HashMap::new(),
                cell_output: 0,
                cell_truncated: false,
                truncated: HashSet::new(),
                pids_probe: None,
                pids_seen: 0,
                history: Arc::new(History::new()),
                denials: HashMap::new(),
            }),
            output_limit: None,
        }
    }

    /// Caps the output of each execution (policy `output_per_execution`).
    pub fn with_output_limit(mut self, limit: Option<u64>) -> Router {
        self.output_limit = limit;
        self
    }

    /// The sandbox of a new generation (its pids counter starts again at zero).
    pub fn set_sandbox(&self, handle: Option<Arc<dyn SandboxHandle>>) {
        let mut state = self.state.lock();
        state.pids_probe = handle;
        state.pids_seen = 0;
    }

    /// Attaches a client. Output buffered for its session while it had no socket is queued to
    /// it first, atomically with the attachment, so nothing is lost or duplicated.
    /// Returns the client's id and how many buffered messages were replayed.
    pub fn attach(&self, session: &str, outbox: Outbox) -> (ClientId, usize) {
        let mut state = self.state.lock();
        let id = state.next_client;
        state.next_client += 1;
        let mut replayed = 0;
        if let Some(buffer) = state.offline.remove(session) {
            replayed = buffer.messages.len();
            for message in buffer.messages {
                outbox.push(message);
            }
            if buffer.dropped > 0 {
                let notice = Message::new(
                    Channel::Iopub,
                    "stream",
                    "cellgate",
                    None,
                    &serde_json::json!({
                        "name": "stderr",
                        "text": format!(
                            "[cellgate] {} messages of output were dropped while no client was connected (buffer limit {} MiB)\n",
                            buffer.dropped,
                            MAX_OFFLINE_BYTES >> 20
                        ),
                    }),
                );
                outbox.push(Arc::new(notice));
            }
            tracing::info!(kernel_id = %self.kernel_id, session, replayed, "replayed buffered messages");
        }
        state.clients.insert(
            id,
            Client {
                session: session.to_owned(),
                outbox,
            },
        );
        (id, replayed)
    }

    /// Detaches a client. When it was the last socket of its session, that session's output
    /// is buffered from now on.
    pub fn detach(&self, id: ClientId) {
        let mut state = self.state.lock();
        Self::detach_locked(&mut state, id);
    }

    fn detach_locked(state: &mut State, id: ClientId) {
        let Some(client) = state.clients.remove(&id) else {
            return;
        };
        let session_still_open = state.clients.values().any(|c| c.session == client.session);
        if session_still_open || state.offline.contains_key(&client.session) {
            return;
        }
        if state.offline.len() >= MAX_OFFLINE_SESSIONS {
            let oldest = state
                .offline
                .iter()
                .min_by_key(|(_, b)| b.serial)
                .map(|(s, _)| s.clone());
            if let Some(oldest) = oldest {
                state.offline.remove(&oldest);
            }
        }
        state.offline_serial += 1;
        let serial = state.offline_serial;
        state.offline.insert(
            client.session,
            OfflineBuffer {
                serial,
                ..OfflineBuffer::default()
            },
        );
    }

    /// Detaches a client whose socket ended, taking back what it never delivered:
    /// `leftovers` (oldest first) and whatever is still queued in its inbox. Replies among them
    /// go to another socket of the same session if there is one; otherwise everything opens
    /// the session's offline buffer, ahead of what arrives later.
    pub fn detach_with(&self, id: ClientId, mut inbox: Inbox, mut leftovers: Vec<Arc<Message>>) {
        let mut state = self.state.lock();
        let Some(session) = state.clients.get(&id).map(|c| c.session.clone()) else {
            return;
        };
        Self::detach_locked(&mut state, id);
        while let Some(message) = inbox.try_recv() {
            leftovers.push(message);
        }
        if leftovers.is_empty() {
            return;
        }
        if let Some(other) = state.clients.values().find(|c| c.session == session) {
            for message in leftovers {
                if message.channel != Channel::Iopub {
                    other.outbox.push(message);
                }
            }
            return;
        }
        if let Some(buffer) = state.offline.get_mut(&session) {
            let mut rest = std::mem::take(&mut buffer.messages);
            buffer.bytes = 0;
            for message in leftovers.iter().chain(rest.iter()) {
                let size = message.byte_len();
                if buffer.bytes + size > MAX_OFFLINE_BYTES {
                    buffer.dropped += 1;
                    continue;
                }
                buffer.bytes += size;
                buffer.messages.push(message.clone());
            }
            rest.clear();
        }
    }

    pub fn connections(&self) -> usize {
        self.state.lock().clients.len()
    }

    pub fn activity(&self) -> Activity {
        self.state.lock().activity.clone()
    }

    pub fn touch(&self) {
        self.state.lock().activity.last_activity = OffsetDateTime::now_utc();
    }

    pub fn set_execution_state(&self, execution_state: &str) {
        let mut state = self.state.lock();
        state.activity.execution_state = execution_state.to_owned();
        state.activity.last_activity = OffsetDateTime::now_utc();
    }

    /// Records who sent a request, so its reply finds its way back.
    pub fn register_request(&self, client: ClientId, session: &str, message: &Message) {
        let mut state = self.state.lock();
        state.activity.last_activity = OffsetDateTime::now_utc();
        state.history.on_request(message);
        let expects_reply = matches!(message.channel, Channel::Shell | Channel::Control)
            && message.msg_type().ends_with("_request");
        if !expects_reply {
            return;
        }
        let msg_id = message.msg_id().to_owned();
        if state.pending.len() >= MAX_PENDING {
            if let Some(old) = state.pending_order.pop_front() {
                state.pending.remove(&old);
            }
        }
        state.pending_order.push_back(msg_id.clone());
        let request = (message.msg_type() == "execute_request")
            .then(|| (message.header.clone(), message.header_bytes.clone()));
        state.pending.insert(
            msg_id,
            Requester {
                client,
                session: session.to_owned(),
                request,
            },
        );
    }

    /// Registers a request the gateway itself sends; its reply comes back on the receiver and
    /// the iopub messages it causes are hidden from clients.
    pub fn register_internal(&self, msg_id: &str) -> oneshot::Receiver<Arc<Message>> {
        let (tx, rx) = oneshot::channel();
        let mut state = self.state.lock();
        state.internal_replies.insert(msg_id.to_owned(), tx);
        state.internal_parents.insert(msg_id.to_owned());
        rx
    }

    /// Forgets the gateway's own requests, for a kernel process that is gone.
    pub fn clear_internal(&self) {
        let mut state = self.state.lock();
        state.internal_replies.clear();
        state.internal_parents.clear();
    }

    /// Delivers one message from the kernel.
    pub fn deliver(&self, message: Message) {
        let message = Arc::new(message);
        let mut state = self.state.lock();
        let parent = message.parent_msg_id().map(str::to_owned);
        match message.channel {
            Channel::Iopub => {
                let status = status_of(&message);
                if let Some(parent) = parent.as_deref() {
                    if state.internal_parents.contains(parent) {
                        if let Some(status) = status {
                            // The first status of any request ends `starting` with `idle`,
                            // as in jupyter_server; the gateway's own requests never make a
                            // kernel look busy.
                            if state.activity.execution_state == "starting" {
                                state.activity.execution_state = "idle".to_owned();
                            }
                            if status == "idle" {
                                state.internal_parents.remove(parent);
                            }
                        }
                        return;
                    }
                }
                if message.msg_type() == "iopub_welcome" {
                    // The welcome answers the gateway's own SUB subscription; clients never
                    // subscribed and would see it arrive unasked after every restart.
                    return;
                }
                if let Some(status) = status {
                    let parent_is_execute = message
                        .parent
                        .as_ref()
                        .is_some_and(|p| p.msg_type == "execute_request");
                    match (status.as_str(), parent.as_deref()) {
                        ("busy", Some(p)) if parent_is_execute => {
                            // A kernel that never said idle for the last one: its reply
                            // goes out now rather than never.
                            self.release_held_locked(&mut state);
                            state.running = Some((p.to_owned(), Instant::now()));
                            state.cell_output = 0;
                            state.cell_truncated = false;
                        }
                        ("idle", Some(p))
                            if state.running.as_ref().is_some_and(|(r, _)| r == p) =>
                        {
                            // Every output of the execution is in: its reply first, then
                            // this idle, the order a kernel sends them in.
                            self.release_held_locked(&mut state);
                            state.running = None;
                        }
                        _ => {}
                    }
                    state.activity.execution_state = status;
                }
                state.activity.last_activity = OffsetDateTime::now_utc();
                if let (Some(limit), Some(p)) = (self.output_limit, parent.as_deref()) {
                    let is_output = matches!(
                        message.msg_type(),
                        "stream" | "display_data" | "execute_result" | "update_display_data"
                    );
                    let of_running = state.running.as_ref().is_some_and(|(r, _)| r == p);
                    if is_output && of_running {
                        state.cell_output += message.byte_len() as u64;
                        if state.cell_output > limit {
                            if !state.cell_truncated {
                                state.cell_truncated = true;
                                if state.truncated.len() > 256 {
                                    state.truncated.clear();
                                }
                                state.truncated.insert(p.to_owned());
                                let marker = truncation_marker(&message, limit);
                                Self::broadcast_locked(&mut state, &Arc::new(marker));
                            }
                            return;
                        }
                    }
                }
                let message = match parent.as_deref().and_then(|p| state.timed_out.get(p)) {
                    Some(timed_out) if message.msg_type() == "error" => {
                        Arc::new(timeout_error(&message, &timed_out.evalue))
                    }
                    _ => message,
                };
                Self::broadcast_locked(&mut state, &message);
            }
            Channel::Shell | Channel::Control => {
                let Some(parent) = parent else {
                    tracing::debug!(kernel_id = %self.kernel_id, msg_type = message.msg_type(), "dropping an unparented reply");
                    return;
                };
                if let Some(waiter) = state.internal_replies.remove(&parent) {
                    state.history.on_reply(&message);
                    let _ = waiter.send(message);
                    return;
                }
                let of_running = state.running.as_ref().is_some_and(|(r, _)| *r == parent);
                if message.msg_type() == "execute_reply" && of_running {
                    self.release_held_locked(&mut state);
                    state.held_reply = Some((parent, message));
                    return;
                }
                self.finish_reply_locked(&mut state, parent, message);
            }
            Channel::Stdin => {
                let requester = parent.as_ref().and_then(|p| state.pending.get(p).cloned());
                match requester {
                    Some(requester) => self.route_locked(&mut state, &requester, message),
                    None => {
                        tracing::warn!(kernel_id = %self.kernel_id, "input_request for an unknown execution: sent to every client");
                        Self::broadcast_locked(&mut state, &message);
                    }
                }
            }
            Channel::Heartbeat => {}
        }
    }

    /// Sends on a reply to its requester, with what the gateway knows of its execution: a
    /// timeout, cut-off output, a refused fork, policy denials.
    fn finish_reply_locked(&self, state: &mut State, parent: String, message: Arc<Message>) {
        state.history.on_reply(&message);
        let message = match state.timed_out.get(&parent) {
            Some(timed_out) if message.msg_type() == "execute_reply" => {
                let substituted = timeout_reply(&message, &timed_out.evalue);
                state.timed_out.remove(&parent);
                Arc::new(substituted)
            }
            _ => message,
        };
        let message = if message.msg_type() == "execute_reply" {
            let message = if state.truncated.remove(&parent) {
                Arc::new(with_outcome(&message, "output_truncated"))
            } else {
                Self::pids_outcome(state, message)
            };
            // Only executions with denials pay for a rewrite.
            match state.denials.remove(&parent) {
                Some(denials) => Arc::new(with_denials(&message, denials)),
                None => message,
            }
        } else {
            message
        };
        match state.pending.remove(&parent) {
            Some(requester) => self.route_locked(state, &requester, message),
            None => {
                state.dropped_replies += 1;
                tracing::debug!(kernel_id = %self.kernel_id, msg_type = message.msg_type(), "reply to an unknown request dropped");
            }
        }
    }

    /// Sends on the held execute_reply, if any.
    fn release_held_locked(&self, state: &mut State) {
        if let Some((parent, reply)) = state.held_reply.take() {
            self.finish_reply_locked(state, parent, reply);
        }
    }

    /// A failed execution during which the pids limit refused a fork gets the outcome `pids`
    /// and a stderr line saying so (its own error, often `BlockingIOError`, stays as it is).
    /// Only failed replies pay for reading the counter: a cell that caught the refusal and
    /// succeeded did not end because of the limit.
    fn pids_outcome(state: &mut State, message: Arc<Message>) -> Arc<Message> {
        let Some(probe) = state.pids_probe.clone() else {
            return message;
        };
        if !reply_failed(&message) || has_outcome(&message) {
            return message;
        }
        let Some(hits) = probe.pids_limit_hits() else {
            return message;
        };
        if hits <= state.pids_seen {
            return message;
        }
        state.pids_seen = hits;
        let text = "\n[cellgate] this execution reached the sandbox's process limit (policy `pids`): new processes and threads were refused\n";
        let parent = message.parent.clone().unwrap_or_default();
        let marker = Message::answering(
            &parent,
            &message.parent_header_bytes,
            Channel::Iopub,
            "stream",
            &json!({"name": "stderr", "text": text}),
            &json!({"cellgate": {"outcome": "pids"}}),
        );
        Self::broadcast_locked(state, &Arc::new(marker));
        Arc::new(with_outcome(&message, "pids"))
    }

    /// The execution the kernel is busy with, and for how long.
    pub fn running(&self) -> Option<(String, Duration)> {
        let state = self.state.lock();
        state
            .running
            .as_ref()
            .map(|(id, since)| (id.clone(), since.elapsed()))
    }

    /// The execution the kernel is running as far as the gateway can tell: the one whose
    /// `busy` was seen, else the oldest execute still waiting for its reply (the kernel runs
    /// them in order, and a cell's side effects, such as a proxy request, can reach the
    /// gateway before its `busy` status does).
    pub fn current_execution(&self) -> Option<String> {
        Self::current_execution_locked(&self.state.lock())
    }

    fn current_execution_locked(state: &State) -> Option<String> {
        state
            .running
            .as_ref()
            .map(|(id, _)| id.clone())
            .or_else(|| {
                state
                    .pending_order
                    .iter()
                    .find(|id| state.pending.get(*id).is_some_and(|r| r.request.is_some()))
                    .cloned()
            })
    }

    /// Attaches a policy denial (`{"kind","target","policy","reason"}`) to the running
    /// execution: a stderr line on iopub now, and `metadata.cellgate.denials` on its
    /// execute_reply. Without a running execution (a thread of the kernel's own, say) the
    /// denial is only logged by the caller.
    pub fn record_denial(&self, denial: serde_json::Value) {
        let mut state = self.state.lock();
        let Some(msg_id) = Self::current_execution_locked(&state) else {
            return;
        };
        let Some((header, header_bytes)) =
            state.pending.get(&msg_id).and_then(|r| r.request.clone())
        else {
            return;
        };
        let reason = denial
            .get("reason")
            .and_then(|r| r.as_str())
            .unwrap_or("denied by policy");
        let line = Message::answering(
            &header,
            &header_bytes,
            Channel::Iopub,
            "stream",
            &json!({"name": "stderr", "text": format!("cellgate: {reason}\n")}),
            &json!({"cellgate": {"denial": denial}}),
        );
        let list = state.denials.entry(msg_id).or_default();
        // A loop of denied requests must not grow the reply without bound.
        if list.len() < 100 {
            list.push(denial);
        }
        if state.denials.len() > 256 {
            let current = Self::current_execution_locked(&state);
            state.denials.retain(|k, _| Some(k) == current.as_ref());
        }
        Self::broadcast_locked(&mut state, &Arc::new(line));
    }

    /// When the gateway interrupted `msg_id` for running too long, if it did.
    pub fn timed_out_since(&self, msg_id: &str) -> Option<Instant> {
        self.state.lock().timed_out.get(msg_id).map(|t| t.since)
    }

    /// Marks an execution as interrupted for its timeout: its KeyboardInterrupt error and
    /// reply reach clients as `CellTimeoutError` with `evalue`.
    pub fn mark_timed_out(&self, msg_id: &str, evalue: String) {
        let mut state = self.state.lock();
        if state.timed_out.len() > 64 {
            state.timed_out.clear();
        }
        state.timed_out.insert(
            msg_id.to_owned(),
            TimedOut {
                since: Instant::now(),
                evalue,
            },
        );
    }

    /// Answers a timed-out execution whose kernel had to be restarted (the process that
    /// would have replied is gone): an error, the execute_reply and an idle status.
    pub fn fail_timed_out(&self, msg_id: &str, evalue: &str) {
        let mut state = self.state.lock();
        self.release_held_locked(&mut state);
        state.timed_out.remove(msg_id);
        state.running = None;
        if let Some(requester) = state.pending.remove(msg_id) {
            self.fail_locked(
                &mut state,
                &requester,
                "CellTimeoutError",
                evalue,
                "timeout",
            );
        }
    }

    /// Answers every execution still waiting for a reply from a kernel process that is gone:
    /// the running one with `evalue`, queued ones with a note that they never ran.
    pub fn fail_pending_executions(&self, ename: &str, evalue: &str, outcome: &str) {
        let mut state = self.state.lock();
        // A reply that came before the process died is the real answer.
        self.release_held_locked(&mut state);
        // The kernel runs executions in order, so without a `busy` seen yet (the process can
        // die before its status gets out) the oldest waiting execute is the running one.
        let running = state.running.take().map(|(id, _)| id).or_else(|| {
            state
                .pending_order
                .iter()
                .find(|id| state.pending.get(*id).is_some_and(|r| r.request.is_some()))
                .cloned()
        });
        let waiting: Vec<String> = state
            .pending_order
            .iter()
            .filter(|id| state.pending.get(*id).is_some_and(|r| r.request.is_some()))
            .cloned()
            .collect();
        for msg_id in waiting {
            let Some(requester) = state.pending.remove(&msg_id) else {
                continue;
            };
            let text = if running.as_deref() == Some(msg_id.as_str()) {
                evalue.to_owned()
            } else {
                format!("this cell never ran: {evalue}")
            };
            self.fail_locked(&mut state, &requester, ename, &text, outcome);
        }
    }

    fn fail_locked(
        &self,
        state: &mut State,
        requester: &Requester,
        ename: &str,
        evalue: &str,
        outcome: &str,
    ) {
        let Some((header, header_bytes)) = requester.request.clone() else {
            return;
        };
        let error = json!({
            "ename": ename,
            "evalue": evalue,
            "traceback": [format!("{ename}: {evalue}")],
        });
        let metadata = json!({"cellgate": {"outcome": outcome}});
        let iopub_error = Message::answering(
            &header,
            &header_bytes,
            Channel::Iopub,
            "error",
            &error,
            &metadata,
        );
        let mut reply_content = error.clone();
        reply_content["status"] = json!("error");
        reply_content["execution_count"] = json!(null);
        let mut reply = Message::answering(
            &header,
            &header_bytes,
            Channel::Shell,
            "execute_reply",
            &reply_content,
            &metadata,
        );
        // A cell whose kernel died or timed out still reports what the policy denied it.
        if let Some(denials) = state.denials.remove(&header.msg_id) {
            reply = with_denials(&reply, denials);
        }
        let idle = Message::answering(
            &header,
            &header_bytes,
            Channel::Iopub,
            "status",
            &json!({"execution_state": "idle"}),
            &json!({}),
        );
        Self::broadcast_locked(state, &Arc::new(iopub_error));
        state.history.on_reply(&reply);
        self.route_locked(state, requester, Arc::new(reply));
        Self::broadcast_locked(state, &Arc::new(idle));
    }

    /// Forgets the running execution (its kernel process is gone).
    pub fn clear_running(&self) {
        let mut state = self.state.lock();
        self.release_held_locked(&mut state);
        state.running = None;
    }

    /// Sends a message the gateway made (a synthesised status) to every client.
    pub fn broadcast(&self, message: Message) {
        let message = Arc::new(message);
        let mut state = self.state.lock();
        Self::broadcast_locked(&mut state, &message);
    }

    fn broadcast_locked(state: &mut State, message: &Arc<Message>) {
        state.history.on_iopub(message);
        let mut too_slow = Vec::new();
        for (id, client) in &state.clients {
            if !client.outbox.push(message.clone()) {
                too_slow.push(*id);
            }
        }
        for id in too_slow {
            tracing::warn!(
                client = id,
                "disconnecting a client that does not keep up with the kernel's output"
            );
            Self::detach_locked(state, id);
        }
        for buffer in state.offline.values_mut() {
            Self::buffer(buffer, message);
        }
    }

    fn buffer(buffer: &mut OfflineBuffer, message: &Arc<Message>) {
        let size = message.byte_len();
        if buffer.bytes + size > MAX_OFFLINE_BYTES {
            buffer.dropped += 1;
            return;
        }
        buffer.bytes += size;
        buffer.messages.push(message.clone());
    }

    fn route_locked(&self, state: &mut State, requester: &Requester, message: Arc<Message>) {
        if let Some(client) = state.clients.get(&requester.client) {
            client.outbox.push(message);
            return;
        }
        if let Some(client) = state
            .clients
            .values()
            .find(|c| c.session == requester.session)
        {
            client.outbox.push(message);
            return;
        }
        if let Some(buffer) = state.offline.get_mut(&requester.session) {
            Self::buffer(buffer, &message);
            return;
        }
        state.dropped_replies += 1;
        tracing::warn!(kernel_id = %self.kernel_id, session = %requester.session, msg_type = message.msg_type(), "reply for a session with no socket and no buffer dropped");
    }

    /// The kernel's execution history (for notebook export).
    pub fn history(&self) -> Arc<History> {
        self.state.lock().history.clone()
    }

    /// Detaches every client (their sockets close) and forgets every buffer.
    pub fn close_all(&self) {
        let mut state = self.state.lock();
        state.clients.clear();
        state.offline.clear();
        state.pending.clear();
        state.pending_order.clear();
        state.internal_replies.clear();
        state.internal_parents.clear();
        state.held_reply = None;
    }
}

/// The stderr line that replaces a cell's output past the limit.
fn truncation_marker(dropped: &Message, limit: u64) -> Message {
    let text = format!(
        "\n[cellgate] this cell's output passed the limit of {} MiB; the rest of its output is dropped (the cell keeps running)\n",
        limit as f64 / (1u64 << 20) as f64
    );
    let parent = dropped.parent.clone().unwrap_or_default();
    Message::answering(
        &parent,
        &dropped.parent_header_bytes,
        Channel::Iopub,
        "stream",
        &json!({"name": "stderr", "text": text}),
        &json!({"cellgate": {"outcome": "output_truncated"}}),
    )
}

#[derive(Deserialize)]
struct ReplyStatus<'a> {
    #[serde(borrow)]
    status: Option<std::borrow::Cow<'a, str>>,
}

/// Whether a reply's `status` is anything but `ok`.
fn reply_failed(message: &Message) -> bool {
    serde_json::from_slice::<ReplyStatus<'_>>(&message.content)
        .ok()
        .and_then(|c| c.status)
        .is_some_and(|s| s != "ok")
}

/// Whether the gateway already gave this message an outcome.
fn has_outcome(message: &Message) -> bool {
    serde_json::from_slice::<serde_json::Value>(&message.metadata)
        .ok()
        .is_some_and(|m| m["cellgate"]["outcome"].is_string())
}

/// The same message with `metadata.cellgate.outcome` set (other `cellgate` fields, such as
/// denials, are kept); header and content keep their bytes.
fn with_outcome(message: &Message, outcome: &str) -> Message {
    with_cellgate_field(message, "outcome", json!(outcome))
}

/// The same message with `metadata.cellgate.denials` set, merged into any `cellgate` object.
fn with_denials(message: &Message, denials: Vec<serde_json::Value>) -> Message {
    with_cellgate_field(message, "denials", serde_json::Value::Array(denials))
}

/// The same message with `metadata.cellgate.<key>` set, the rest of the metadata kept (a
/// metadata or `cellgate` value that is not an object is replaced by one).
fn with_cellgate_field(message: &Message, key: &str, value: serde_json::Value) -> Message {
    let mut metadata: serde_json::Value =
        serde_json::from_slice(&message.metadata).unwrap_or_else(|_| json!({}));
    if !metadata.is_object() {
        metadata = json!({});
    }
    if !metadata["cellgate"].is_object() {
        metadata["cellgate"] = json!({});
    }
    metadata["cellgate"][key] = value;
    let mut changed = message.clone();
    changed.metadata = Bytes::from(metadata.to_string());
    changed
}

fn timeout_content(evalue: &str) -> serde_json::Value {
    json!({
        "ename": "CellTimeoutError",
        "evalue": evalue,
        "traceback": [format!("CellTimeoutError: {evalue}")],
    })
}

/// The kernel's KeyboardInterrupt error, reported as the timeout it really was.
fn timeout_error(original: &Message, evalue: &str) -> Message {
    original.with_content(
        &timeout_content(evalue),
        &json!({"cellgate": {"outcome": "timeout"}}),
    )
}

/// The kernel's error execute_reply, reported as a timeout; the execution count is kept.
fn timeout_reply(original: &Message, evalue: &str) -> Message {
    let count = original
        .content_json()
        .and_then(|c| c.get("execution_count").cloned())
        .unwrap_or(serde_json::Value::Null);
    let mut content = timeout_content(evalue);
    content["status"] = json!("error");
    content["execution_count"] = count;
    original.with_content(&content, &json!({"cellgate": {"outcome": "timeout"}}))
}

#[cfg(test)]
mod tests;
