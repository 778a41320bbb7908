//! Sessions in the state directory's store (`crate::store`), so that a gateway started
//! again on the same directory knows every session it had.
//!
//! What is written, and when: a session's row when it starts (and when its kernel's state
//! generation moves), each finished execution (its API v1 result, the kernel history's new
//! cells for export, a usage ledger row) after its `done` went out, and its removal when a
//! client deletes it (or its kernel is shut down through the Kernel Gateway API, or culled:
//! the session ends with it, as without a store). Cells a JupyterLab client ran on a
//! session's kernel are written with the session's next API v1 execution. Writes are queued to the store's writer thread; the cells are even
//! turned into JSON there, so an execution's answer never waits for the store.
//!
//! After a restart, a session whose kernel outlived the gateway (`--kernels-outlive-gateway`,
//! namespaces kernels) is adopted: it comes back live with its variables, files and
//! generation ([`super::Sessions::spawn_survivor_adoption`]). Any other stored session
//! comes back *dormant* ([`Dormant`]): listed with its id, tenant, policy, kernelspec and
//! creation time, its state `dead` with [`KERNEL_LOST`] as the reason and its state
//! generation moved on (its variables are gone); its notebook exports from the stored cells
//! and its artifacts stay. Its next execute (or restart, shell command, or session
//! WebSocket) starts a new kernel under the same id ([`super::Sessions::revive`]), whose
//! history goes on from the stored cells.
//!
//! A gateway stopping (SIGTERM) keeps its sessions, and ends their kernels unless they
//! outlive it: only a client's delete removes a session from the store. A kernel adopted
//! but dormant until then reports [`SANDBOX_LOST`] when its sandbox did not survive.
//!
//! **Event ids continue after a restart.** A client resuming with the `Last-Event-ID` it
//! had before the restart must be told what it missed, and must not take new events for
//! ones it saw (clients drop ids they have). So each session notes its newest event id in
//! the store with the rows it writes anyway (an execution begun, an execution finished) and
//! every [`EVENT_IDS_NOTED_EVERY`] events between (a cell that prints in a loop). The id a
//! crash can leave unnoted is bounded by that, plus what the writer had not committed; a
//! revived session numbers on from the noted id plus [`RESTART_ID_LEAP`], well past both, and
//! a client behind that is sent a `gap` up to it (some of those ids were never given: a
//! gap says they cannot be had, which is true).

use std::sync::Arc;

use serde_json::Value;

use super::{ExecutionResult, HistoryEntry, Session, SessionModel, SessionState};
use crate::ids::{ExecutionId, SessionId};
use crate::kernel::history::RecordedCell;
use crate::kernel::HistorySnapshot;
use crate::store::{ExecutionRow, SessionRow, Store, StoredSession, UsageRow};

/// A session notes its newest event id in the store at least this often (in events).
pub(super) const EVENT_IDS_NOTED_EVERY: u64 = 1024;
/// How far past the noted id a revived session's ids start: room for the ids given after
/// the last note (at most [`EVENT_IDS_NOTED_EVERY`]) and for notes the writer had queued but
/// not committed when the gateway died.
pub(super) const RESTART_ID_LEAP: u64 = 1 << 16;

/// The reason a dormant session gives for its kernel.
pub const KERNEL_LOST: &str = "kernel_lost: the gateway restarted and this session's kernel (its variables and workspace files) is gone; its next execute starts a new kernel";

/// The reason a dormant session gives when its kernel's sandbox was to outlive the gateway
/// (`--kernels-outlive-gateway`) but did not.
pub const SANDBOX_LOST: &str = "sandbox_lost: this session's sandbox ended while the gateway was down (or could not be adopted); its variables and workspace files are gone, and its next execute starts a new kernel";

/// A session known from the store whose kernel did not survive the gateway's restart.
#[derive(Debug, Clone)]
pub struct Dormant {
    pub id: SessionId,
    pub row: SessionRow,
    language_info: Option<Value>,
    cells: Vec<Value>,
    executions: Vec<ExecutionRow>,
    /// The newest event id the session noted before the restart.
    last_event_id: u64,
    /// Held while its kernel starts again: concurrent requests for it wait for one revival,
    /// and other sessions' revivals do not wait at all.
    pub(super) reviving: Arc<tokio::sync::Mutex<()>>,
    /// Its sandbox was kept for adoption, which failed (see [`SANDBOX_LOST`]).
    pub(super) lost: Arc<std::sync::atomic::AtomicBool>,
    /// Its hibernated sandbox's restores that failed in a row with what was saved kept.
    pub(super) deferrals: Arc<parking_lot::Mutex<crate::kernel::Deferrals>>,
}

impl Dormant {
    /// A stored session, its state generation moved on past its lost kernel's. `None` when
    /// its id is not a session id (the log says so).
    pub(super) fn from_stored(stored: StoredSession) -> Option<Dormant> {
        let Ok(id) = SessionId::parse(&stored.session.id) else {
            tracing::error!(session_id = %stored.session.id, "a stored session's id does not parse: it is left out");
            return None;
        };
        let mut row = stored.session;
        row.generation += 1;
        Some(Dormant {
            id,
            row,
            language_info: stored.language_info,
            cells: stored.cells,
            executions: stored.executions,
            last_event_id: stored.last_event_id,
            reviving: Arc::default(),
            lost: Arc::default(),
            deferrals: Arc::default(),
        })
    }

    pub fn owner(&self) -> Option<&str> {
        self.row.tenant.as_deref()
    }

    pub fn model(&self) -> SessionModel {
        let last_activity = self
            .executions
            .last()
            .map_or_else(|| self.row.created.clone(), |e| e.started.clone());
        SessionModel {
            id: self.id.clone(),
            kernel_name: self.row.kernel_name.clone(),
            language: self.row.language.clone(),
            policy: self.row.policy.clone(),
            sandbox: self.row.sandbox.clone(),
            state: SessionState::Dead,
            state_generation: self.row.generation,
            created: self.row.created.clone(),
            last_activity,
            executions: self.executions.len(),
            tenant: self.row.tenant.clone(),
            reason: Some(
                if self.lost.load(std::sync::atomic::Ordering::SeqCst) {
                    SANDBOX_LOST
                } else {
                    KERNEL_LOST
                }
                .to_owned(),
            ),
        }
    }

    fn recorded_cells(&self) -> Vec<RecordedCell> {
        self.cells
            .iter()
            .cloned()
            .filter_map(RecordedCell::from_stored)
            .collect()
    }

    /// The stored history, as notebook export reads a kernel's.
    pub fn history(&self) -> HistorySnapshot {
        HistorySnapshot {
            cells: self
                .recorded_cells()
                .into_iter()
                .filter(|c| !c.aborted())
                .collect(),
            language_info: self.language_info.clone(),
            truncated: false,
            cells_dropped: 0,
        }
    }

    /// When it was last active, as far as the store knows: the end of its last execution
    /// (its start, plus its duration once done), else its creation. `None` when neither
    /// reads as a timestamp.
    pub(super) fn last_active(&self) -> Option<time::OffsetDateTime> {
        use time::format_description::well_known::Rfc3339;
        let parse = |text: &str| time::OffsetDateTime::parse(text, &Rfc3339).ok();
        let created = parse(&self.row.created);
        let ended = self.executions.last().and_then(|e| {
            let duration_ms = e
                .result
                .as_ref()
                .and_then(|r| r.get("duration_ms")?.as_u64())
                .unwrap_or(0);
            Some(parse(&e.started)? + std::time::Duration::from_millis(duration_ms))
        });
        created.max(ended)
    }

    /// The id the revived session's events number on from (see the module's doc).
    pub(super) fn events_after(&self) -> u64 {
        self.last_event_id.saturating_add(RESTART_ID_LEAP)
    }

    /// What the new kernel's history and the session's execution list start from.
    pub(super) fn into_history(self) -> (Vec<RecordedCell>, Option<Value>, Vec<HistoryEntry>) {
        let cells = self.recorded_cells();
        let entries = self.executions();
        (cells, self.language_info, entries)
    }

    /// The session's executions as the store kept them, oldest first: their results, not
    /// their events (what `GET …/executions` answers before the session is revived).
    pub fn executions(&self) -> Vec<HistoryEntry> {
        self.executions
            .iter()
            .filter_map(|e| {
                let execution_id = ExecutionId::parse(&e.execution_id).ok()?;
                let lost = |why: &str| {
                    lost_result(&execution_id, self.row.generation.saturating_sub(1), why)
                };
                let result = match e.result.clone() {
                    // Begun, never done: the gateway died while it ran.
                    None => lost("the gateway stopped while this execution ran: its outputs were not kept"),
                    Some(json) => match serde_json::from_value::<ExecutionResult>(json) {
                        Ok(result) => result,
                        Err(err) => {
                            // Written by another version, or damaged: said, not guessed.
                            tracing::warn!(session_id = %self.id, execution_id = %execution_id, %err, "a stored execution's result does not read");
                            lost("its stored result could not be read")
                        }
                    },
                };
                let result = Some(Arc::new(result));
                Some(HistoryEntry {
                    execution_id,
                    code: e.code.clone(),
                    started: e.started.clone(),
                    events: Vec::new(),
                    result,
                })
            })
            .collect()
    }
}

/// The result of an execution the store cannot give one for (it was running when the gateway
/// died, or its stored result does not read): `sandbox_lost`, saying why.
fn lost_result(execution_id: &ExecutionId, generation: u64, why: &str) -> ExecutionResult {
    ExecutionResult::lost(
        execution_id.clone(),
        generation,
        "KernelLost",
        why.to_owned(),
    )
}

/// Records that an execution began (its result comes with `execution_finished`).
pub(super) fn execution_begun(
    store: &Store,
    session: &Session,
    execution_id: &ExecutionId,
    code: &str,
    started: &str,
) {
    store.put_execution(
        session.id.as_str(),
        ExecutionRow {
            execution_id: execution_id.to_string(),
            code: code.to_owned(),
            started: started.to_owned(),
            result: None,
        },
    );
    store.note_event_id(session.id.as_str(), session.journal.lock().newest());
}

/// A finished shell command's row in the usage ledger (commands are not in the history).
/// (`command_id`, `wall_ms`, `output_bytes`, `status`: the command's result's, passed as
/// values so that this module does not depend on `commands`.)
pub(super) fn command_finished(
    store: &Store,
    session: &Session,
    (command_id, wall_ms, output_bytes, status): (String, u64, u64, super::Status),
    resources: &super::Resources,
) {
    store.record_usage(UsageRow {
        at: crate::timestamp::format_timestamp(time::OffsetDateTime::now_utc()),
        tenant: session.owner.clone(),
        session: session.id.to_string(),
        policy: session.kernel.policy.clone(),
        execution_id: command_id,
        wall_ms,
        cpu_ms: resources.cpu_time_ms,
        peak_memory_bytes: resources.memory_peak_bytes,
        output_bytes,
        artifact_bytes: 0,
        outcome: serde_json::to_value(status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
    });
}

/// A live session's row.
pub(super) fn row_of(session: &Session) -> SessionRow {
    let model = session.model();
    SessionRow {
        id: session.id.to_string(),
        tenant: session.owner.clone(),
        policy: model.policy,
        kernel_name: model.kernel_name,
        language: model.language,
        sandbox: model.sandbox,
        created: model.created,
        generation: model.state_generation,
    }
}

/// Writes what a finished execution adds: its result, the history's new cells (turned into
/// JSON on the store's writer thread), and its usage.
pub(super) fn execution_finished(
    store: &Store,
    session: &Session,
    entry: &HistoryEntry,
    output_bytes: u64,
) {
    let id = session.id.to_string();
    let result = entry.result.as_deref();
    store.put_execution(
        &id,
        ExecutionRow {
            execution_id: entry.execution_id.to_string(),
            code: entry.code.clone(),
            started: entry.started.clone(),
            result: result.and_then(|r| serde_json::to_value(r).ok()),
        },
    );
    store.note_event_id(&id, session.journal.lock().newest());
    let history = session.kernel.router().history();
    // The cells up to this execution's, counted now: the writer runs the closure later,
    // maybe while the kernel already runs the next cell (`History::tail`).
    let upto = history.len();
    let persisted = session.persisted_cells.clone();
    store.put_cells_with(&id, move || {
        let from = persisted.load(std::sync::atomic::Ordering::SeqCst);
        let (cells, next, language_info) = history.tail(from, upto);
        persisted.store(next, std::sync::atomic::Ordering::SeqCst);
        let cells = (from..)
            .zip(cells.iter().map(RecordedCell::to_stored))
            .map(|(index, cell)| (index as u64, cell))
            .collect();
        (language_info, cells)
    });
    if let Some(result) = result {
        store.record_usage(UsageRow {
            at: crate::timestamp::format_timestamp(time::OffsetDateTime::now_utc()),
            tenant: session.owner.clone(),
            session: id,
            policy: session.kernel.policy.clone(),
            execution_id: result.execution_id.to_string(),
            wall_ms: result.duration_ms,
            cpu_ms: result.resources.cpu_time_ms,
            peak_memory_bytes: result.resources.memory_peak_bytes,
            output_bytes,
            artifact_bytes: result.artifacts.iter().map(|a| a.bytes).sum(),
            outcome: serde_json::to_value(result.status)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
        });
    }
}

/// Notes a published event's id now and then (see the module's doc).
pub(super) fn event_published(store: &Store, session: &SessionId, id: u64) {
    if id.is_multiple_of(EVENT_IDS_NOTED_EVERY) {
        store.note_event_id(session.as_str(), id);
    }
}
