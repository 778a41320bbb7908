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
//!
//! Nothing is lost or duplicated: attaching a socket replays its session's buffer atomically
//! under the routing lock; a socket that ends hands back what it did not write (and, when it
//! vanished without a close frame, its last replies), so a reconnect with the same
//! `session_id` misses nothing. Buffers are bounded (64 MiB per session, 8 sessions) and a
//! replay says how much it dropped. The router also taps [`super::history`] for export.
//!
//! What happens to an execution (held reply, output limit, timeout, denials, the pids probe)
//! is decided in [`super::execution`]: [`Router::deliver`] hands each message of a client's
//! request to it and sends on what the verdict says.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot};

use super::execution::{Answer, Denial, ExecutionState, Executions, Outcome, Released, Verdict};
use super::history::History;
use crate::protocol::{Channel, Message};
use crate::sandbox::SandboxHandle;
use crate::telemetry::metrics::ExecutionMetrics;

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
    pub execution_state: ExecutionState,
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
    /// What clients executed and saw, for notebook export.
    history: Arc<History>,
    /// The clients' executions: what the gateway adds to, holds back of or drops from them.
    executions: Executions,
}

/// The routing table of one kernel. Survives restarts: clients stay attached while the kernel
/// process is replaced.
pub struct Router {
    state: Mutex<State>,
    kernel_id: String,
    /// Told whenever the kernel's state leaves `starting`: readiness waits on it.
    left_starting: tokio::sync::Notify,
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
                    execution_state: ExecutionState::Starting,
                    last_activity: OffsetDateTime::now_utc(),
                },
                dropped_replies: 0,
                history: Arc::new(History::new()),
                executions: Executions::new(None),
            }),
            left_starting: tokio::sync::Notify::new(),
        }
    }

    /// Caps the output of each execution (policy `output_per_execution`).
    pub fn with_output_limit(mut self, limit: Option<u64>) -> Router {
        self.state.get_mut().executions.set_output_limit(limit);
        self
    }

    /// Counts executions' ends under the kernel's policy.
    pub fn with_metrics(mut self, metrics: ExecutionMetrics) -> Router {
        self.state.get_mut().executions.set_metrics(metrics);
        self
    }

    /// The sandbox of a new generation (its pids counter starts again at zero).
    pub fn set_sandbox(&self, handle: Option<Arc<dyn SandboxHandle>>) {
        self.state.lock().executions.set_sandbox(handle);
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

    /// The kernel was last active at `at`, under an earlier gateway (an adopted kernel's
    /// idle time goes on counting across the restart).
    pub fn set_last_activity(&self, at: OffsetDateTime) {
        self.state.lock().activity.last_activity = at;
    }

    pub fn set_execution_state(&self, execution_state: ExecutionState) {
        let mut state = self.state.lock();
        self.set_state_locked(&mut state, execution_state);
        state.activity.last_activity = OffsetDateTime::now_utc();
    }

    fn set_state_locked(&self, state: &mut State, execution_state: ExecutionState) {
        let was = std::mem::replace(&mut state.activity.execution_state, execution_state);
        if was == ExecutionState::Starting && execution_state != ExecutionState::Starting {
            self.left_starting.notify_waiters();
        }
    }

    /// Resolves the next time the kernel's state leaves `starting`. Made before checking the
    /// state, it cannot miss a change that comes after the check.
    pub fn left_starting(&self) -> tokio::sync::futures::Notified<'_> {
        self.left_starting.notified()
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
        if message.msg_type() == "execute_request" {
            state.executions.on_request(message);
        }
        state.pending.insert(
            msg_id,
            Requester {
                client,
                session: session.to_owned(),
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
        match message.channel {
            Channel::Iopub => self.deliver_iopub(&mut state, message),
            Channel::Shell | Channel::Control => self.deliver_reply(&mut state, message),
            Channel::Stdin => self.deliver_input_request(&mut state, message),
            Channel::Heartbeat => {}
        }
    }

    /// iopub: hidden when the gateway's own request caused it, else to every client as the
    /// execution decides.
    fn deliver_iopub(&self, state: &mut State, message: Arc<Message>) {
        let parent = message.parent_msg_id();
        let status = ExecutionState::of_status(&message);
        if parent.is_some_and(|p| state.internal_parents.contains(p)) {
            self.on_internal_status(state, parent, status);
            return;
        }
        if message.msg_type() == "iopub_welcome" {
            // The welcome answers the gateway's own SUB subscription; clients never
            // subscribed and would see it arrive unasked after every restart.
            return;
        }
        if let Some(status) = status {
            self.set_state_locked(state, status);
        }
        state.activity.last_activity = OffsetDateTime::now_utc();
        let (released, verdict) = state.executions.on_iopub(message.clone(), status, parent);
        self.send_released(state, released);
        Self::broadcast_verdict(state, verdict);
    }

    /// A shell or control reply: to the gateway when it asked, else to its requester as the
    /// execution decides.
    fn deliver_reply(&self, state: &mut State, message: Arc<Message>) {
        let Some(parent) = message.parent_msg_id() else {
            tracing::debug!(kernel_id = %self.kernel_id, msg_type = message.msg_type(), "dropping an unparented reply");
            return;
        };
        if let Some(waiter) = state.internal_replies.remove(parent) {
            state.history.on_reply(&message);
            let _ = waiter.send(message);
            return;
        }
        let (released, verdict) = state.executions.on_reply(parent, message.clone());
        self.send_released(state, released);
        if !matches!(verdict, Verdict::Hold) {
            state.history.on_reply(&message);
        }
        self.route_verdict(state, parent, verdict);
    }

    /// An `input_request` goes to the client whose execute asked for input.
    fn deliver_input_request(&self, state: &mut State, message: Arc<Message>) {
        let requester = message
            .parent_msg_id()
            .and_then(|p| state.pending.get(p).cloned());
        match requester {
            Some(requester) => self.route_locked(state, &requester, message),
            None => {
                tracing::warn!(kernel_id = %self.kernel_id, "input_request for an unknown execution: sent to every client");
                Self::broadcast_locked(state, &message);
            }
        }
    }

    /// A status caused by one of the gateway's own requests: never shown to clients.
    fn on_internal_status(
        &self,
        state: &mut State,
        parent: Option<&str>,
        status: Option<ExecutionState>,
    ) {
        let (Some(parent), Some(status)) = (parent, status) else {
            return;
        };
        // The first status of any request ends `starting` with `idle`, as in jupyter_server;
        // the gateway's own requests never make a kernel look busy.
        if state.activity.execution_state == ExecutionState::Starting {
            self.set_state_locked(state, ExecutionState::Idle);
        }
        if status == ExecutionState::Idle {
            state.internal_parents.remove(parent);
        }
    }

    /// Sends on an iopub message as its execution decided.
    fn broadcast_verdict(state: &mut State, verdict: Verdict) {
        match verdict {
            Verdict::Forward(message) => Self::broadcast_locked(state, &message),
            Verdict::ForwardAndMark { mark, message } => {
                Self::broadcast_locked(state, &mark);
                Self::broadcast_locked(state, &message);
            }
            Verdict::DropAndMark(mark) => Self::broadcast_locked(state, &mark),
            Verdict::Hold | Verdict::Drop => {}
        }
    }

    /// Sends on a reply to the request `parent` as its execution decided.
    fn route_verdict(&self, state: &mut State, parent: &str, verdict: Verdict) {
        let message = match verdict {
            Verdict::Forward(message) => message,
            Verdict::ForwardAndMark { mark, message } => {
                Self::broadcast_locked(state, &mark);
                message
            }
            Verdict::DropAndMark(mark) => {
                Self::broadcast_locked(state, &mark);
                return;
            }
            Verdict::Hold | Verdict::Drop => return,
        };
        match state.pending.remove(parent) {
            Some(requester) => self.route_locked(state, &requester, message),
            None => {
                state.dropped_replies += 1;
                tracing::debug!(kernel_id = %self.kernel_id, msg_type = message.msg_type(), "reply to an unknown request dropped");
            }
        }
    }

    /// Sends on a held execute_reply its execution let go.
    fn send_released(&self, state: &mut State, released: Option<Released>) {
        if let Some(released) = released {
            state.history.on_reply(&released.kernel_reply);
            self.route_verdict(state, &released.parent, released.verdict);
        }
    }

    /// Sends the gateway's answers to executions the kernel will never answer.
    fn send_answers(&self, state: &mut State, answers: impl IntoIterator<Item = Answer>) {
        for answer in answers {
            let Some(requester) = state.pending.remove(&answer.msg_id) else {
                continue;
            };
            Self::broadcast_locked(state, &answer.error);
            state.history.on_reply(&answer.reply);
            self.route_locked(state, &requester, answer.reply);
            Self::broadcast_locked(state, &answer.idle);
        }
    }

    /// The execution the kernel is busy with, and for how long.
    pub fn running(&self) -> Option<(String, Duration)> {
        self.state.lock().executions.running()
    }

    /// The execution the kernel is running as far as the gateway can tell: the one whose
    /// `busy` was seen, else the oldest execute still waiting for its reply (the kernel runs
    /// them in order, and a cell's side effects, such as a proxy request, can reach the
    /// gateway before its `busy` status does).
    pub fn current_execution(&self) -> Option<String> {
        self.state.lock().executions.current()
    }

    /// Attaches a policy denial to the running execution: a stderr line on iopub now, and
    /// `metadata.cellgate.denials` on its execute_reply. Without a running execution (a
    /// thread of the kernel's own, say) the denial is only logged by the caller.
    pub fn record_denial(&self, denial: Denial) {
        let mut state = self.state.lock();
        if let Some(line) = state.executions.record_denial(denial) {
            Self::broadcast_locked(&mut state, &Arc::new(line));
        }
    }

    /// When the gateway interrupted `msg_id` for running too long, if it did.
    pub fn timed_out_since(&self, msg_id: &str) -> Option<Instant> {
        self.state.lock().executions.timed_out_since(msg_id)
    }

    /// Marks an execution as interrupted for its timeout: its KeyboardInterrupt error and
    /// reply reach clients as `CellTimeoutError` with `evalue`.
    pub fn mark_timed_out(&self, msg_id: &str, evalue: String) {
        self.state.lock().executions.mark_timed_out(msg_id, evalue);
    }

    /// Answers a timed-out execution whose kernel had to be restarted (the process that
    /// would have replied is gone): an error, the execute_reply and an idle status.
    pub fn fail_timed_out(&self, msg_id: &str, evalue: &str) {
        let mut state = self.state.lock();
        let (released, answer) = state.executions.fail_timed_out(msg_id, evalue);
        self.send_released(&mut state, released);
        self.send_answers(&mut state, answer);
    }

    /// Answers every execution still waiting for a reply from a kernel process that is gone:
    /// the running one with `evalue`, queued ones with a note that they never ran.
    pub fn fail_pending_executions(&self, ename: &str, evalue: &str, outcome: Outcome) {
        let mut state = self.state.lock();
        let (released, answers) = state.executions.fail_pending(ename, evalue, outcome);
        self.send_released(&mut state, released);
        self.send_answers(&mut state, answers);
    }

    /// Forgets the running execution (its kernel process is gone).
    pub fn clear_running(&self) {
        let mut state = self.state.lock();
        let released = state.executions.clear_running();
        self.send_released(&mut state, released);
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
        state.executions.clear();
    }
}

/// The egress proxy reports denials to the kernel's executions through this.
impl crate::egress::DenialSink for Router {
    fn record_denial(&self, denial: Denial) {
        Router::record_denial(self, denial);
    }

    fn current_execution(&self) -> Option<String> {
        Router::current_execution(self)
    }
}

#[cfg(test)]
mod tests;
