//! Sessions of API v1: a kernel (started through the [`KernelManager`] under a policy:
//! `KERNEL_POLICY`, with the tenant's policy as a ceiling), the gateway's own
//! [`KernelClient`] of it, the history of its executions (every event and result: notebook
//! export's source), its artifacts and files, and its owner tenant. A session's id is its
//! kernel's id, so the same session can also be opened from JupyterLab through the Kernel
//! Gateway API.
//!
//! An execution runs in a task of its own under a per-session lock (the kernel queues
//! anyway; the lock keeps the history and `input()` unambiguous): events are published as
//! they come (to the caller's stream and to every WebSocket of the session), rich outputs
//! become artifacts on the way, files new or changed under `outputs/` after the cell become
//! artifacts, and the typed [`ExecutionResult`] ends the stream (its status mapped from the
//! outcome, denials and reply; capped streams; an ANSI-free traceback; CPU time and peak
//! memory from the sandbox's cgroup). A caller that goes away does not stop the execution;
//! its result stays in the history.
//!
//! Every event is numbered in its session when it is published (`replay.rs`), and the
//! session's journal (`journal.rs`: the newest events, the running execution, the history)
//! lets a client that lost its connection catch up: an execution's events after an id
//! ([`Session::follow`], [`Session::execution`]), or the session's ([`Session::catch_up`],
//! with a [`Gap`] for what is no longer held).
//!
//! A session publishes its kernel's phase (`KernelPhase`) from the kernel's readiness watch
//! channel, without polling; sessions whose kernel disappears (culled, deleted through the
//! Kernel Gateway API) are reaped. Shell commands run through the session's kernel
//! ([`commands`]); streams become plain text for machines (`plain.rs`).
//!
//! With a state directory, sessions are kept in its store and come back after a gateway
//! restart, dormant until their next execute starts a new kernel (`persistence.rs`).
//!
//! Across gateway replicas, `adoption.rs` answers where a kernel's requests go
//! (`Sessions::route`: here, forwarded to its owner, moving, or unavailable), takes over
//! kernels whose owner is gone (at once when a request names one, and by a periodic sweep
//! otherwise), and gives each a session; who owns what is the `Ownership` trait's answer.
//!
//! Must not depend on: HTTP.

mod adoption;
pub mod commands;
pub mod events;
mod execution;
mod journal;
mod outputs;
mod persistence;
mod plain;
pub mod replay;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::{broadcast, mpsc};

use crate::artifacts::links::LinkSigner;
use crate::artifacts::{Artifact, ArtifactError, ArtifactStore};
use crate::ids::{ExecutionId, IdError, SessionId};
use crate::kernel::{
    ExecutionState, Kernel, KernelClient, KernelError, KernelManager, Readiness, POLICY_ENV,
};
use crate::store::Store;
use crate::workspace::{Files, Workspace, WorkspaceError};
pub use adoption::{AdoptionError, Route};
pub use events::{
    expiry_timestamp, ArtifactRef, ExecError, ExecutionResult, KernelPhase, Omitted, Resources,
    SessionEvent, Status,
};
use journal::Journal;
pub use journal::{
    ExecutionProgress, ExecutionRecord, ExecutionSummary, HistoryEntry, MAX_HISTORY,
};
pub use persistence::{Dormant, KERNEL_LOST, SANDBOX_LOST};
pub use replay::{Catchup, Gap, Numbered, NumberedEvent};

/// Events kept for WebSocket subscribers that fall behind (past it, they catch up from the
/// replay buffer).
const EVENT_BACKLOG: usize = 4096;
/// Bytes of events a session keeps for clients that resume, unless configured.
pub const DEFAULT_REPLAY_BYTES: usize = 4 << 20;
/// The longest a dormant session is kept after its last activity, unless configured.
pub const DEFAULT_DORMANT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Settings of the session layer.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Bytes of stdout and of stderr kept in a result (the events carry everything).
    pub stream_cap: usize,
    /// Largest artifact stored; bigger outputs are left out (and logged). Each session
    /// takes its policy's `artifact_size`.
    pub artifact_max_bytes: u64,
    /// Bytes of artifacts per session and per tenant: the policy's `artifacts_per_session`
    /// and `artifacts_per_tenant`.
    pub artifact_quotas: crate::artifacts::Quotas,
    /// How long artifacts of a deleted session stay fetchable.
    pub artifact_retention: Duration,
    /// The gateway's base URL (starts and ends with `/`), for artifact URLs.
    pub base_url: String,
    /// Signs the links in artifact references (`None`: references carry none).
    pub links: Option<Arc<LinkSigner>>,
    /// Bytes of a session's newest events kept for clients that resume (`replay.rs`).
    pub replay_bytes: usize,
    /// The longest a dormant session is kept after its last activity (`None`: as its
    /// policy's idle timeout and lifetime say).
    pub dormant_retention: Option<Duration>,
}

impl SessionOptions {
    /// The reference to `artifact` that results and listings carry.
    pub fn reference(&self, artifact: &Artifact) -> ArtifactRef {
        ArtifactRef::new(artifact, &self.base_url, self.links.as_deref())
    }
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            stream_cap: 1 << 20,
            artifact_max_bytes: 64 << 20,
            artifact_quotas: crate::artifacts::Quotas::default(),
            artifact_retention: Duration::from_secs(3600),
            base_url: "/".to_owned(),
            links: None,
            replay_bytes: DEFAULT_REPLAY_BYTES,
            dormant_retention: Some(DEFAULT_DORMANT_RETENTION),
        }
    }
}

/// Errors of the session layer.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no such session")]
    NotFound,
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(transparent)]
    Workspace(#[from] WorkspaceError),
    #[error("tenant {tenant} may only use policy {allowed}, not {requested}")]
    PolicyNotAllowed {
        tenant: String,
        allowed: String,
        requested: String,
    },
    #[error("no input is awaited")]
    NoInputAwaited,
    #[error("this session's kernel ({language}) cannot run commands: only Python and bash kernels can (run them in a python3 or bash session)")]
    CommandsUnsupported { language: String },
}

/// What a new session asks for.
#[derive(Debug, Clone, Default)]
pub struct NewSession {
    pub kernel_name: Option<String>,
    pub policy: Option<String>,
    pub env: BTreeMap<String, String>,
    /// The owning tenant (`None`: the admin).
    pub owner: Option<String>,
    /// The most permissive policy the owner may use (`None`: any).
    pub policy_ceiling: Option<String>,
    /// Live kernels the owner may keep (`None`: no cap); sessions count as kernels.
    pub max_kernels: Option<usize>,
    /// The same count as a quota (`concurrent_sessions`: 429 rather than 403).
    pub concurrent_sessions: Option<usize>,
}

/// A session's state as listed: its kernel's execution state while it has a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    Starting,
    Idle,
    Busy,
    Restarting,
    Dead,
    Terminated,
    /// Saved to disk while idle (`[limits] hibernate_after`): the next request restores it,
    /// its variables intact.
    Hibernated,
}

impl From<ExecutionState> for SessionState {
    fn from(state: ExecutionState) -> SessionState {
        match state {
            ExecutionState::Starting => SessionState::Starting,
            ExecutionState::Idle => SessionState::Idle,
            ExecutionState::Busy => SessionState::Busy,
            ExecutionState::Restarting => SessionState::Restarting,
            ExecutionState::Dead => SessionState::Dead,
        }
    }
}

/// A session as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct SessionModel {
    #[schema(value_type = String)]
    pub id: SessionId,
    pub kernel_name: String,
    /// The kernelspec's language (`python`, `typescript`, `bash`, `R`…), as
    /// `GET /v1/kernelspecs` lists it, so a client can label and highlight code.
    pub language: String,
    pub policy: String,
    pub sandbox: String,
    pub state: SessionState,
    pub state_generation: u64,
    pub created: String,
    pub last_activity: String,
    pub executions: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One session.
pub struct Session {
    pub id: SessionId,
    pub owner: Option<String>,
    pub kernel: Arc<Kernel>,
    client: KernelClient,
    created: String,
    events: broadcast::Sender<Numbered>,
    /// One execution at a time through the API: the kernel would queue them anyway, and
    /// this keeps the history in order and `input()` unambiguous.
    run_lock: tokio::sync::Mutex<()>,
    /// Whether an execution is between its start and its `done`: news of the kernel's life
    /// waits for it (see `spawn_monitor`).
    in_turn: tokio::sync::watch::Sender<bool>,
    /// Whether `terminated` went out: it is the last event, told once.
    terminated_told: std::sync::atomic::AtomicBool,
    /// The replay buffer, the running execution and the history; events are published
    /// while it is held (`journal.rs` says why).
    journal: Mutex<Journal>,
    /// Files under `outputs/` already turned into artifacts: path → (size, mtime).
    outputs_seen: Mutex<HashMap<String, (u64, i64, i64)>>,
    artifacts: Arc<ArtifactStore>,
    /// Large outputs being stored in the background; bounded so a kernel that floods
    /// images waits for the disk instead of piling decoded copies up in memory.
    background_stores: Arc<tokio::sync::Semaphore>,
    options: SessionOptions,
    /// The state directory's store, if the gateway has one.
    store: Option<Arc<Store>>,
    /// Cells of the kernel's history written to the store so far.
    persisted_cells: Arc<std::sync::atomic::AtomicUsize>,
}

/// Large outputs of one session stored at once in the background.
const BACKGROUND_STORES: usize = 4;

impl Session {
    pub fn model(&self) -> SessionModel {
        let model = self.kernel.model();
        let readiness = self.kernel.readiness();
        let state = match &readiness {
            Readiness::Terminated => SessionState::Terminated,
            Readiness::Dead(_) => SessionState::Dead,
            Readiness::Hibernated => SessionState::Hibernated,
            Readiness::Starting | Readiness::Restarting | Readiness::Ready => {
                self.kernel.execution_state().into()
            }
        };
        SessionModel {
            id: self.id.clone(),
            kernel_name: self.kernel.spec.name.clone(),
            language: self.kernel.spec.language.clone(),
            policy: self.kernel.policy.clone(),
            sandbox: model.cellgate.sandbox.as_str().to_owned(),
            state,
            state_generation: self.kernel.generation(),
            created: self.created.clone(),
            last_activity: model.last_activity,
            executions: self.journal.lock().finished(),
            tenant: self.owner.clone(),
            reason: match readiness {
                Readiness::Dead(reason) => Some(reason),
                _ => None,
            },
        }
    }

    /// Every event of this session from now on (all executions, kernel state changes).
    pub fn subscribe(&self) -> broadcast::Receiver<Numbered> {
        self.events.subscribe()
    }

    /// The finished executions, oldest first.
    pub fn history(&self) -> Vec<HistoryEntry> {
        self.journal.lock().history()
    }

    /// What a client that saw every event of the session up to `after` missed (events
    /// still held, and a gap where some are not). Subscribe first, then catch up: the two
    /// meet with no event lost, and the ones seen twice carry ids already seen.
    pub fn catch_up(&self, after: u64) -> Catchup {
        self.journal.lock().since(after)
    }

    /// Every event of this session from now on, and the id of the newest one before them:
    /// subscribed under the lock events are published under, so the receiver gets exactly
    /// the events after that id.
    pub fn subscribe_after_newest(&self) -> (broadcast::Receiver<Numbered>, u64) {
        let journal = self.journal.lock();
        (self.events.subscribe(), journal.newest())
    }

    /// The session's newest `limit` executions, oldest first (the running one last).
    pub fn executions(&self, limit: usize) -> Vec<ExecutionSummary> {
        self.journal.lock().recent(limit)
    }

    /// The execution `execution_id` of this session, running or finished (while the
    /// history keeps it).
    pub fn execution(&self, execution_id: &ExecutionId) -> Option<ExecutionRecord> {
        self.journal
            .lock()
            .execution(execution_id)
            .map(ExecutionRecord::from)
    }

    /// The events of execution `execution_id` after the id `after` (0: all of them), those
    /// recorded so far and then the rest as they come, ending with its `done`; `None` when
    /// the session has no such execution. Following does not hold the session alive: the
    /// stream ends when the session does.
    pub fn follow(
        self: &Arc<Self>,
        execution_id: &ExecutionId,
        after: u64,
    ) -> Option<mpsc::UnboundedReceiver<Numbered>> {
        // Subscribed before the snapshot is read: nothing published between is missed.
        let mut live = self.subscribe();
        let (snapshot, newest) = {
            let journal = self.journal.lock();
            (journal.execution(execution_id)?.clone(), journal.newest())
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let weak = Arc::downgrade(self);
        let execution_id = execution_id.clone();
        tokio::spawn(async move {
            // An id ahead of the session's (ids began again after a take-over)
            // must not hide the events to come.
            let mut last = after.min(newest);
            // Sends what `entry` holds past `last`; true once its `done` went.
            let send_recorded = |entry: &HistoryEntry, last: &mut u64| {
                for event in &entry.events {
                    if event.id <= *last {
                        continue;
                    }
                    *last = event.id;
                    if tx.send(event.clone()).is_err() {
                        return true;
                    }
                }
                // Numbered after what the client saw, which may be ahead of this
                // session's ids (it must not be taken for a repeat).
                if let Some(done) = entry.restored_done((*last).max(after)) {
                    *last = done.id;
                    let _ = tx.send(done);
                }
                entry.result.is_some()
            };
            if send_recorded(&snapshot, &mut last) {
                return;
            }
            drop(snapshot);
            loop {
                let event = tokio::select! {
                    event = live.recv() => event,
                    _ = tx.closed() => return,
                };
                match event {
                    Ok(event) => {
                        if event.id <= last || event.event.execution_id() != Some(&execution_id) {
                            continue;
                        }
                        last = event.id;
                        let done = matches!(*event.event, SessionEvent::Done { .. });
                        if tx.send(event).is_err() || done {
                            return;
                        }
                    }
                    // Too slow for the broadcast: what it dropped is in the record.
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let Some(session) = weak.upgrade() else {
                            return;
                        };
                        let journal = session.journal.lock();
                        let Some(entry) = journal.execution(&execution_id) else {
                            return;
                        };
                        if send_recorded(entry, &mut last) {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Some(rx)
    }

    pub fn artifacts(&self) -> &Arc<ArtifactStore> {
        &self.artifacts
    }

    pub fn options(&self) -> &SessionOptions {
        &self.options
    }

    /// The kernel's workspace (files), while it has a process.
    pub fn open_workspace(&self) -> Result<Files, WorkspaceError> {
        // A dead kernel's pid may name another process by now: never look there.
        if matches!(
            self.kernel.readiness(),
            Readiness::Dead(_) | Readiness::Terminated
        ) {
            return Err(WorkspaceError::Unavailable);
        }
        if self.kernel.backend().has_agent() {
            return self
                .kernel
                .guest_files()
                .map(Files::Guest)
                .ok_or(WorkspaceError::Unavailable);
        }
        let (trusted, relative) = self.kernel.workspace().ok_or(WorkspaceError::Unavailable)?;
        let workspace = Workspace::open(&trusted, &relative)?;
        // Opened through /proc/<pid>: the process must still be there now, so the pid was
        // not reused by another (host) process in between.
        if !self.kernel.process_alive() {
            return Err(WorkspaceError::Unavailable);
        }
        Ok(Files::Local(workspace))
    }

    fn workspace(&self) -> Option<Files> {
        self.open_workspace().ok()
    }

    pub fn client(&self) -> &KernelClient {
        &self.client
    }

    /// Numbers `event`, records it and sends it to the session's subscribers, in one step
    /// under the journal's lock (so subscribers get ids in order).
    fn publish(&self, event: SessionEvent) -> Numbered {
        let mut journal = self.journal.lock();
        let numbered = journal.record(Arc::new(event));
        if let Some(store) = &self.store {
            persistence::event_published(store, &self.id, numbered.id);
        }
        // No subscriber is fine: the event is also in the caller's stream and the journal.
        let _ = self.events.send(numbered.clone());
        numbered
    }

    /// The kernel's life as the session's subscribers see it: starting, restarting, ready,
    /// dead, terminated.
    fn kernel_state(&self) -> (KernelPhase, u64, Option<String>) {
        let generation = self.kernel.generation();
        match self.kernel.readiness() {
            Readiness::Ready => (KernelPhase::Ready, generation, None),
            Readiness::Starting => (KernelPhase::Starting, generation, None),
            Readiness::Restarting => (KernelPhase::Restarting, generation, None),
            Readiness::Dead(reason) => (KernelPhase::Dead, generation, Some(reason)),
            Readiness::Terminated => (KernelPhase::Terminated, generation, None),
            Readiness::Hibernated => (KernelPhase::Hibernated, generation, None),
        }
    }

    fn publish_kernel_state(&self) {
        self.publish_kernel_phase(self.kernel_state());
    }

    /// Tells subscribers of a change of the kernel's life; `terminated` only once (the
    /// monitor and [`Sessions::end`] may both see it).
    fn publish_kernel_phase(
        &self,
        (state, state_generation, reason): (KernelPhase, u64, Option<String>),
    ) {
        if state == KernelPhase::Terminated
            && self
                .terminated_told
                .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        self.publish(SessionEvent::Kernel {
            state,
            state_generation,
            reason,
        });
    }

    pub async fn interrupt(&self) -> Result<(), SessionError> {
        Ok(self.client.interrupt().await?)
    }

    /// Restarts the kernel: variables and workspace files are lost, the state generation
    /// moves on.
    pub async fn restart(&self) -> Result<(), SessionError> {
        let result = self.client.restart().await;
        self.outputs_seen.lock().clear();
        Ok(result?)
    }

    /// Answers the `input()` the running execution waits for.
    pub async fn input_reply(
        &self,
        execution_id: Option<&ExecutionId>,
        value: &str,
    ) -> Result<(), SessionError> {
        let execution_id = execution_id.map(ExecutionId::as_str);
        if self.client.input_reply(execution_id, value).await? {
            Ok(())
        } else {
            Err(SessionError::NoInputAwaited)
        }
    }

    /// Starts an execution; its events (ending with `done`) arrive on the receiver.
    pub fn execute(
        self: &Arc<Self>,
        code: String,
        timeout: Option<Duration>,
    ) -> mpsc::UnboundedReceiver<Numbered> {
        let (tx, rx) = mpsc::unbounded_channel();
        let session = self.clone();
        tokio::spawn(async move { session.run(code, timeout, tx).await });
        rx
    }
}

/// The id API v1 gives an execution or a command the kernel took: its request's `msg_id`,
/// which the gateway made as a simple UUID (`protocol::new_header`), so it parses (a test
/// holds that). Were that ever to change, the execution gets a random id rather than none:
/// its `input()` is then answered without naming it.
fn request_id<T>(msg_id: &str, parse: fn(&str) -> Result<T, IdError>, random: fn() -> T) -> T {
    parse(msg_id).unwrap_or_else(|err| {
        tracing::warn!(%err, "a request's msg_id is not an API id: a random one stands for it");
        random()
    })
}

/// Tells the session's subscribers when its kernel's life changes (a restart after a
/// timeout or OOM, a death, a shutdown from the Kernel Gateway API), as the kernel's
/// readiness changes. A change that ends a running cell is told after that cell's `done`
/// (its answer says what happened; clients read the kernel's news after it), waiting for it
/// at most [`KERNEL_NEWS_WAIT`]: a cell may also run on across a change.
fn spawn_monitor(session: &Arc<Session>) {
    let weak = Arc::downgrade(session);
    // Subscribed before the state is read: a change after the read is seen below.
    let mut readiness = session.kernel.watch_readiness();
    let mut last = session.kernel_state();
    tokio::spawn(async move {
        // The kernel's sender lives as long as the kernel: an error means it is gone.
        while readiness.changed().await.is_ok() {
            let Some(session) = weak.upgrade() else {
                return;
            };
            let now = session.kernel_state();
            if now == last {
                continue;
            }
            let mut in_turn = session.in_turn.subscribe();
            let _ =
                tokio::time::timeout(KERNEL_NEWS_WAIT, in_turn.wait_for(|running| !running)).await;
            let terminated = now.0 == KernelPhase::Terminated;
            if let Some(store) = &session.store {
                store.set_generation(session.id.as_str(), now.1);
            }
            session.publish_kernel_phase(now.clone());
            if terminated {
                return;
            }
            last = now;
        }
    });
}

/// How long news of the kernel's life waits for the running cell's `done`.
const KERNEL_NEWS_WAIT: Duration = Duration::from_secs(2);

/// What a session registered again after a restart starts from.
#[derive(Default)]
struct Restored {
    created: Option<String>,
    history: Vec<HistoryEntry>,
    persisted_cells: usize,
    /// The id its events number on from (0: a new session's start at 1).
    events_after: u64,
}

/// Every session of the gateway.
pub struct Sessions {
    kernels: Arc<KernelManager>,
    artifacts: Arc<ArtifactStore>,
    sessions: RwLock<HashMap<SessionId, Arc<Session>>>,
    options: SessionOptions,
    /// The state directory's store, if the gateway has one.
    store: Option<Arc<Store>>,
    /// Sessions from the store whose kernel did not survive the restart.
    dormant: RwLock<HashMap<SessionId, Arc<Dormant>>>,
    /// The gateway is stopping: kernels ending now keep their sessions in the store.
    closing: std::sync::atomic::AtomicBool,
    /// Kernels being taken over from a replica that is gone: held here already, their
    /// session not given yet (requests for them are told to retry, not answered 404).
    /// How many take-overs of each are under way.
    taking_over: Mutex<HashMap<String, usize>>,
}

impl Sessions {
    pub fn new(
        kernels: Arc<KernelManager>,
        artifacts: Arc<ArtifactStore>,
        options: SessionOptions,
    ) -> Arc<Sessions> {
        Sessions::with_store(kernels, artifacts, options, None)
    }

    /// Sessions kept in `store` too (`None`: in memory only).
    pub fn with_store(
        kernels: Arc<KernelManager>,
        artifacts: Arc<ArtifactStore>,
        options: SessionOptions,
        store: Option<Arc<Store>>,
    ) -> Arc<Sessions> {
        Arc::new(Sessions {
            kernels,
            artifacts,
            sessions: RwLock::new(HashMap::new()),
            options,
            store,
            dormant: RwLock::new(HashMap::new()),
            closing: std::sync::atomic::AtomicBool::new(false),
            taking_over: Mutex::new(HashMap::new()),
        })
    }

    /// Takes back the sessions the store kept, dormant; their state generation moves on
    /// (in the store too, so the next restart moves it again).
    pub fn restore(&self, stored: Vec<crate::store::StoredSession>) {
        let mut dormant = self.dormant.write();
        for session in stored {
            let Some(session) = Dormant::from_stored(session) else {
                continue;
            };
            if let Some(store) = &self.store {
                store.set_generation(session.id.as_str(), session.row.generation);
            }
            dormant.insert(session.id.clone(), Arc::new(session));
        }
        let taken_back = dormant.len();
        drop(dormant);
        let expired = self.expire_dormant(time::OffsetDateTime::now_utc());
        if taken_back > 0 {
            tracing::info!(
                sessions = taken_back - expired.len(),
                expired = expired.len(),
                "sessions taken back from the state directory; their kernels start again at their next execute"
            );
        }
    }

    /// When dormant session `dormant` expires: when its policy's idle timeout or lifetime
    /// would have ended its kernel had it lived (the idle timeout from its last activity, the
    /// lifetime from its creation), or [`SessionOptions::dormant_retention`] after its last
    /// activity, whichever comes first. A session whose policy is gone has the bound alone;
    /// one whose times do not read expires now.
    fn dormant_expiry(&self, dormant: &Dormant) -> Option<time::OffsetDateTime> {
        use time::format_description::well_known::Rfc3339;
        let Some(active) = dormant.last_active() else {
            return Some(time::OffsetDateTime::UNIX_EPOCH);
        };
        let mut expiry = self.options.dormant_retention.map(|bound| active + bound);
        if let Ok(policy) = self.kernels.policies().get(&dormant.row.policy) {
            let idle = active + policy.limits.idle_timeout;
            let life = time::OffsetDateTime::parse(&dormant.row.created, &Rfc3339)
                .map_or(idle, |created| created + policy.limits.lifetime);
            let policy_end = idle.min(life);
            expiry = Some(expiry.map_or(policy_end, |bound| bound.min(policy_end)));
        }
        expiry
    }

    /// Removes the dormant sessions expired at `now` (see `dormant_expiry`) as a
    /// culled session is removed: from the store, its artifacts kept for their retention,
    /// its signed links working until then. Returns their ids.
    pub fn expire_dormant(&self, now: time::OffsetDateTime) -> Vec<SessionId> {
        let expired: Vec<SessionId> = self
            .dormant
            .read()
            .values()
            .filter(|d| self.dormant_expiry(d).is_some_and(|at| at <= now))
            .map(|d| d.id.clone())
            .collect();
        let mut removed = Vec::new();
        for id in expired {
            // Under the map's lock, as `end` does: a revival racing the expiry either took
            // it first (then it is live, not expired) or finds it gone.
            let mut dormant = self.dormant.write();
            let Some(gone) = dormant.remove(&id) else {
                continue;
            };
            if let Some(store) = &self.store {
                store.delete_session(id.as_str());
            }
            drop(dormant);
            // A sandbox kept for it (hibernated on disk) goes with it.
            self.kernels.forget_sandbox(&id.kernel(), &gone.row.policy);
            self.artifacts.expire_session(id.as_str());
            tracing::info!(session_id = %id, "dormant session expired: its policy's idle timeout or lifetime, or --dormant-retention, has passed");
            removed.push(id);
        }
        removed
    }

    /// The state directory's store, if the gateway has one.
    pub fn store(&self) -> Option<&Arc<Store>> {
        self.store.as_ref()
    }

    /// A dormant session (known from the store, its kernel lost in a restart).
    pub fn dormant(&self, id: &SessionId) -> Option<Arc<Dormant>> {
        self.dormant.read().get(id).cloned()
    }

    /// A dormant session as listed: `hibernated`, its generation kept, when its kernel was
    /// saved to disk by the gateway before this one (its next request restores it).
    pub fn dormant_model(&self, dormant: &Dormant) -> SessionModel {
        let mut model = dormant.model();
        if let Some(generation) = self
            .kernels
            .hibernated_generation(&dormant.id.kernel(), &dormant.row.policy)
        {
            model.state = SessionState::Hibernated;
            model.state_generation = generation;
            model.reason = None;
        }
        model
    }

    /// Bytes on disk of `tenant`'s dormant sessions whose kernels the gateway before this
    /// one hibernated: its hibernated-storage quota counts them before they are restored.
    pub fn dormant_hibernated_bytes(&self, tenant: &str) -> u64 {
        let dormant: Vec<Arc<Dormant>> = self
            .dormant
            .read()
            .values()
            .filter(|d| d.row.tenant.as_deref() == Some(tenant))
            .cloned()
            .collect();
        dormant
            .iter()
            .map(|d| {
                self.kernels
                    .kept_hibernated_bytes(&d.id.kernel(), &d.row.policy)
            })
            .sum()
    }

    /// Every session as listed, live and dormant, with its owner, oldest first.
    pub fn models(&self) -> Vec<(Option<String>, SessionModel)> {
        let mut out: Vec<(Option<String>, SessionModel)> = self
            .list()
            .iter()
            .map(|s| (s.owner.clone(), s.model()))
            .collect();
        out.extend(
            self.dormant
                .read()
                .values()
                .map(|d| (d.row.tenant.clone(), self.dormant_model(d))),
        );
        out.sort_by(|a, b| a.1.created.cmp(&b.1.created).then(a.1.id.cmp(&b.1.id)));
        out
    }

    /// Starts a new kernel for a dormant session, under its id and policy, its history
    /// going on from the stored one; `caps` are its owner's kernel cap and concurrent-sessions
    /// quota. A session that is
    /// live already is returned as it is.
    pub async fn revive(
        self: &Arc<Self>,
        id: &SessionId,
        caps: (Option<usize>, Option<usize>),
    ) -> Result<Arc<Session>, SessionError> {
        // In a task of its own: a client that goes away must not cut a kernel's start or a
        // hibernated sandbox's restore midway.
        let (sessions, id) = (self.clone(), id.clone());
        tokio::spawn(async move { sessions.revive_now(&id, caps).await })
            .await
            .map_err(|error| {
                SessionError::Kernel(KernelError::Io {
                    what: "reviving the session".to_owned(),
                    source: std::io::Error::other(error),
                })
            })?
    }

    async fn revive_now(
        &self,
        id: &SessionId,
        (max_kernels, concurrent_sessions): (Option<usize>, Option<usize>),
    ) -> Result<Arc<Session>, SessionError> {
        let Some(dormant) = self.dormant(id) else {
            return self.get(id).ok_or(SessionError::NotFound);
        };
        let asked = std::time::Instant::now();
        let reviving = dormant.reviving.clone();
        let _one_at_a_time = reviving.lock().await;
        // Revived by the request this one waited for.
        if let Some(session) = self.get(id) {
            return Ok(session);
        }
        // Or its restore deferred: the same answer, not another try.
        if let Some(why) = dormant.deferrals.lock().since(asked) {
            return Err(KernelError::RestoreDeferred(why).into());
        }
        let row = &dormant.row;
        let owner = row.tenant.as_ref().map(|tenant| crate::kernel::Owner {
            tenant: tenant.clone(),
            max_kernels,
            concurrent_sessions,
        });
        // A sandbox that outlived the gateway before this one is taken back (a request may
        // come before the adoption at start got to it). A hibernated one that could not be
        // restored now, but is kept, leaves the session dormant for the next request.
        if let Some(kernel) = self.adopt_kernel(&dormant).await? {
            let session = self.bring_back(id, kernel).await?;
            tracing::info!(session_id = %session.id, generation = session.kernel.generation(), "session adopted: its kernel outlived the gateway before this one");
            return Ok(session);
        }
        let env = BTreeMap::from([(POLICY_ENV.to_owned(), row.policy.clone())]);
        // The first launch takes the generation the dormant session reported.
        let kernel = self
            .kernels
            .start_again(
                id.kernel(),
                row.generation.saturating_sub(1),
                Some(&row.kernel_name),
                &env,
                owner.as_ref(),
            )
            .await?;
        if let Err(err) = kernel.wait_ready().await {
            let _ = self.kernels.shutdown(kernel.id.as_str()).await;
            return Err(err.into());
        }
        let session = self.bring_back(id, kernel).await?;
        tracing::info!(session_id = %session.id, generation = session.kernel.generation(), "a dormant session's kernel started again");
        Ok(session)
    }

    /// Takes back, in the background, the kernels of dormant sessions whose sandboxes
    /// outlived the gateway before this one (`--kernels-outlive-gateway`): each session
    /// comes back live, its generation kept; one whose sandbox did not survive stays
    /// dormant, `sandbox_lost`, until its next execute starts a new kernel.
    pub fn spawn_survivor_adoption(self: &Arc<Self>) {
        // Sandboxes no stored session claims (the dead gateway's pool, its Kernel Gateway
        // API kernels) would idle until their orphan grace: ended now.
        let claimed: std::collections::HashSet<String> = self
            .dormant
            .read()
            .values()
            .map(|d| d.id.kernel().as_str().to_owned())
            .collect();
        let kernels = self.kernels.clone();
        tokio::task::spawn_blocking(move || {
            let ended = kernels.end_unclaimed_survivors(&claimed);
            if ended > 0 {
                tracing::info!(
                    ended,
                    "ended the kernels that outlived the gateway before this one and that no session claims (a pool's, the Kernel Gateway API's)"
                );
            }
        });
        let found: Vec<SessionId> = self
            .dormant
            .read()
            .values()
            .filter(|d| self.kernels.has_survivor(&d.id.kernel(), &d.row.policy))
            .map(|d| d.id.clone())
            .collect();
        if found.is_empty() {
            return;
        }
        tracing::info!(
            sessions = found.len(),
            "adopting the kernels that outlived the gateway before this one"
        );
        let sessions = self.clone();
        tokio::spawn(async move {
            let all = found.iter().map(|id| sessions.adopt_survivor(id));
            futures_util::future::join_all(all).await;
        });
    }

    /// Adopts one dormant session's surviving kernel (see
    /// [`Sessions::spawn_survivor_adoption`]).
    async fn adopt_survivor(&self, id: &SessionId) {
        let Some(dormant) = self.dormant(id) else {
            return;
        };
        let reviving = dormant.reviving.clone();
        let _one_at_a_time = reviving.lock().await;
        if self.get(id).is_some() {
            return;
        }
        let asked = std::time::Instant::now();
        let Ok(Some(kernel)) = self.adopt_kernel(&dormant).await else {
            return;
        };
        match self.bring_back(id, kernel).await {
            Ok(session) => tracing::info!(
                session_id = %session.id,
                generation = session.kernel.generation(),
                adoption_ms = asked.elapsed().as_millis() as u64,
                "session adopted: its kernel outlived the gateway before this one"
            ),
            Err(err) => {
                tracing::warn!(session_id = %id, %err, "an adopted kernel's session could not be taken back")
            }
        }
    }

    /// The dormant session's kernel, adopted and ready, when its sandbox outlived the
    /// gateway before this one; `None` otherwise (a sandbox that was kept but is gone or
    /// cannot be adopted marks the session [`SANDBOX_LOST`]); an error for a hibernated one
    /// not restored now but kept (the session stays dormant, not lost). Called under its
    /// `reviving` lock.
    async fn adopt_kernel(&self, dormant: &Dormant) -> Result<Option<Arc<Kernel>>, KernelError> {
        let row = &dormant.row;
        let adopted = self
            .kernels
            .adopt_survivor(
                dormant.id.kernel(),
                &row.kernel_name,
                &row.policy,
                row.tenant.clone(),
            )
            .await;
        let failure = match adopted {
            Ok(None) => return Ok(None),
            Err(KernelError::RestoreDeferred(why)) => {
                let Some(given_up) = dormant.deferrals.lock().note(&why) else {
                    return Err(KernelError::RestoreDeferred(why));
                };
                self.kernels
                    .forget_sandbox(&dormant.id.kernel(), &row.policy);
                given_up
            }
            Ok(Some(kernel)) => match kernel.wait_ready().await {
                Ok(()) => {
                    // Idle culling goes on counting from before the restart.
                    if let Some(at) = dormant.last_active() {
                        kernel.router().set_last_activity(at);
                    }
                    return Ok(Some(kernel));
                }
                Err(err) => {
                    let _ = self.kernels.shutdown(kernel.id.as_str()).await;
                    err.to_string()
                }
            },
            Err(err) => err.to_string(),
        };
        tracing::warn!(session_id = %dormant.id, error = %failure, "a session's sandbox did not survive the restart: it starts a new kernel at its next execute");
        dormant
            .lost
            .store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(None)
    }

    /// Makes a dormant session live again on `kernel` (ready), its history going on from
    /// the stored one.
    async fn bring_back(
        &self,
        id: &SessionId,
        kernel: Arc<Kernel>,
    ) -> Result<Arc<Session>, SessionError> {
        // Registered under the dormant map's lock: a listing never sees the session in
        // neither map while it changes from dormant to live.
        let registered = {
            let mut dormant = self.dormant.write();
            dormant.remove(id).map(|dormant| {
                let (owner, created) = (dormant.row.tenant.clone(), dormant.row.created.clone());
                let events_after = dormant.events_after();
                let (cells, language_info, entries) = Arc::unwrap_or_clone(dormant).into_history();
                let persisted = cells.len();
                kernel.router().history().restore(cells, language_info);
                self.register(
                    kernel.clone(),
                    owner,
                    Restored {
                        created: Some(created),
                        history: entries,
                        persisted_cells: persisted,
                        events_after,
                    },
                )
            })
        };
        match registered {
            Some(session) => Ok(session),
            None => {
                // Deleted meanwhile.
                let _ = self.kernels.shutdown(kernel.id.as_str()).await;
                Err(SessionError::NotFound)
            }
        }
    }

    /// The gateway is stopping: from now on a session whose kernel ends stays in the store;
    /// waits until the store has every write queued so far.
    pub async fn close(&self) {
        self.closing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(store) = self.store.clone() {
            match tokio::task::spawn_blocking(move || store.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::error!(%err, "the store could not be flushed"),
                Err(err) => tracing::error!(%err, "the store could not be flushed"),
            }
        }
    }

    pub fn artifacts(&self) -> &Arc<ArtifactStore> {
        &self.artifacts
    }

    pub fn kernels(&self) -> &Arc<KernelManager> {
        &self.kernels
    }

    pub fn options(&self) -> &SessionOptions {
        &self.options
    }

    /// Starts a kernel and waits until it is ready.
    pub async fn create(&self, new: NewSession) -> Result<Arc<Session>, SessionError> {
        let mut env = new.env.clone();
        env.remove(POLICY_ENV);
        let policy = match (&new.policy, &new.policy_ceiling) {
            (Some(requested), Some(allowed)) if requested != allowed => {
                return Err(SessionError::PolicyNotAllowed {
                    tenant: new.owner.clone().unwrap_or_default(),
                    allowed: allowed.clone(),
                    requested: requested.clone(),
                })
            }
            (Some(p), _) | (None, Some(p)) => Some(p.clone()),
            (None, None) => None,
        };
        if let Some(policy) = policy {
            env.insert(POLICY_ENV.to_owned(), policy);
        }
        let owner = new.owner.as_ref().map(|tenant| crate::kernel::Owner {
            tenant: tenant.clone(),
            max_kernels: new.max_kernels,
            concurrent_sessions: new.concurrent_sessions,
        });
        let kernel = self
            .kernels
            .start_for(new.kernel_name.as_deref(), &env, owner.as_ref())
            .await?;
        if let Err(err) = kernel.wait_ready().await {
            let _ = self.kernels.shutdown(kernel.id.as_str()).await;
            return Err(err.into());
        }
        let session = self.register(kernel, new.owner, Restored::default());
        tracing::info!(session_id = %session.id, tenant = ?session.owner, policy = %session.kernel.policy, "session created");
        Ok(session)
    }

    /// The session of a kernel this gateway took over from a replica that is gone: the
    /// kernel and its variables carried on; what the old replica held in memory (the
    /// history, unsaved artifact records) did not.
    pub fn adopt(&self, kernel: Arc<Kernel>, owner: Option<String>) -> Arc<Session> {
        if let Some(session) = self.get(&SessionId::of(&kernel.id)) {
            return session;
        }
        let session = self.register(kernel, owner, Restored::default());
        tracing::info!(session_id = %session.id, tenant = ?session.owner, "session taken over");
        session
    }

    fn register(
        &self,
        kernel: Arc<Kernel>,
        owner: Option<String>,
        restored: Restored,
    ) -> Arc<Session> {
        let mut options = self.options.clone();
        if let Ok(policy) = self.kernels.policies().get(&kernel.policy) {
            options.artifact_max_bytes = policy.limits.artifact_bytes;
            options.artifact_quotas = crate::artifacts::Quotas {
                per_session: policy.limits.artifacts_per_session_bytes,
                per_tenant: policy.limits.artifacts_per_tenant_bytes,
            };
        }
        if self.store.is_some() {
            // The store knows the session: a later gateway asks for its kernel again.
            kernel.mark_adoptable();
        }
        let (events, _) = broadcast::channel(EVENT_BACKLOG);
        let session = Arc::new(Session {
            id: SessionId::of(&kernel.id),
            owner,
            client: KernelClient::attach(kernel.clone()),
            kernel,
            created: restored.created.unwrap_or_else(|| {
                crate::kernel::format_timestamp(time::OffsetDateTime::now_utc())
            }),
            events,
            run_lock: tokio::sync::Mutex::new(()),
            in_turn: tokio::sync::watch::Sender::new(false),
            terminated_told: std::sync::atomic::AtomicBool::new(false),
            journal: Mutex::new(Journal::restored(
                options.replay_bytes,
                restored.history,
                restored.events_after,
            )),
            outputs_seen: Mutex::new(HashMap::new()),
            artifacts: self.artifacts.clone(),
            background_stores: Arc::new(tokio::sync::Semaphore::new(BACKGROUND_STORES)),
            options,
            store: self.store.clone(),
            persisted_cells: Arc::new(std::sync::atomic::AtomicUsize::new(
                restored.persisted_cells,
            )),
        });
        {
            let mut sessions = self.sessions.write();
            sessions.insert(session.id.clone(), session.clone());
            // Queued under the map's lock, as the deletes are: the store sees a session's
            // row written and deleted in the order the map had it (a delete racing the
            // creation must not leave the row behind).
            if let Some(store) = &self.store {
                store.put_session(persistence::row_of(&session));
                // A crash before its next note must not number from before the leap again.
                if restored.events_after > 0 {
                    store.note_event_id(session.id.as_str(), restored.events_after);
                }
            }
        }
        spawn_monitor(&session);
        session
    }

    pub fn get(&self, id: &SessionId) -> Option<Arc<Session>> {
        self.sessions.read().get(id).cloned()
    }

    pub fn list(&self) -> Vec<Arc<Session>> {
        let mut out: Vec<_> = self.sessions.read().values().cloned().collect();
        out.sort_by(|a, b| a.created.cmp(&b.created).then(a.id.cmp(&b.id)));
        out
    }

    /// A client deletes the session: its kernel is shut down, its artifacts stay for the
    /// retention period, and the signed links to them stop working.
    pub async fn delete(&self, id: &SessionId) -> Result<(), SessionError> {
        self.end(id).await?;
        self.artifacts.revoke_links(id.as_str());
        Ok(())
    }

    /// Ends the session as [`Self::delete`] does, but its artifacts' signed links keep
    /// working until they expire or the artifacts go: a one-shot execute's session ends with
    /// its result, whose links are what the caller shows.
    pub async fn end(&self, id: &SessionId) -> Result<(), SessionError> {
        let gone = self.dormant.write().remove(id);
        if let Some(gone) = gone {
            if let Some(store) = &self.store {
                store.delete_session(id.as_str());
            }
            self.kernels.forget_sandbox(&id.kernel(), &gone.row.policy);
            self.artifacts.expire_session(id.as_str());
            tracing::info!(session_id = %id, "dormant session deleted");
            return Ok(());
        }
        let session = {
            let mut sessions = self.sessions.write();
            let session = sessions.remove(id).ok_or(SessionError::NotFound)?;
            // Under the map's lock: see `register`.
            if let Some(store) = &self.store {
                store.delete_session(id.as_str());
            }
            session
        };
        session
            .client
            .abandon("SessionDeletedError", "the session was deleted");
        match self.kernels.shutdown(id.as_str()).await {
            Ok(()) | Err(KernelError::NoSuchKernel) => {}
            Err(err) => return Err(err.into()),
        }
        session.publish_kernel_state();
        self.artifacts.expire_session(id.as_str());
        tracing::info!(session_id = %id, "session deleted");
        Ok(())
    }

    /// Sessions whose kernel is gone (culled, or deleted through the Kernel Gateway API) are
    /// forgotten; expired artifacts are removed. Runs every `interval`.
    pub fn spawn_reaper(self: &Arc<Self>, interval: Duration) {
        let sessions = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(sessions) = sessions.upgrade() else {
                    return;
                };
                let gone: Vec<SessionId> = sessions
                    .sessions
                    .read()
                    .keys()
                    .filter(|id| sessions.kernels.get(id.as_str()).is_none())
                    .cloned()
                    .collect();
                let closing = sessions.closing.load(std::sync::atomic::Ordering::SeqCst);
                for id in gone {
                    let removed = {
                        let mut map = sessions.sessions.write();
                        let removed = map.remove(&id);
                        // Under the map's lock: see `register`.
                        if let (Some(_), false, Some(store)) = (&removed, closing, &sessions.store)
                        {
                            store.delete_session(id.as_str());
                        }
                        removed
                    };
                    if let Some(session) = removed {
                        session
                            .client
                            .abandon("KernelDiedError", "the session's kernel was shut down");
                    }
                    if closing {
                        // Ended by the gateway's own stop: the session is kept for the next
                        // start (its artifacts too).
                        continue;
                    }
                    sessions.artifacts.expire_session(id.as_str());
                    tracing::info!(session_id = %id, "session ended with its kernel");
                }
                sessions.expire_dormant(time::OffsetDateTime::now_utc());
                let artifacts = sessions.artifacts.clone();
                let _ = tokio::task::spawn_blocking(move || artifacts.reap()).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_model_reads_back_as_it_was_sent() {
        let session = SessionModel {
            id: SessionId::of(&crate::ids::KernelId::random()),
            kernel_name: "python3".into(),
            language: "python".into(),
            policy: "default".into(),
            sandbox: "namespaces".into(),
            state: SessionState::Busy,
            state_generation: 6,
            created: "2026-01-01T00:00:00.000000Z".into(),
            last_activity: "2026-01-01T00:00:01.000000Z".into(),
            executions: 2,
            tenant: Some("acme".into()),
            reason: None,
        };
        let wire = serde_json::to_vec(&session).unwrap();
        assert_eq!(
            serde_json::from_slice::<SessionModel>(&wire).unwrap(),
            session
        );
    }
}
