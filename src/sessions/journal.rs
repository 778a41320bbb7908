//! What a session remembers of its events: the replay buffer ([`Replay`]: the newest events
//! of the session with their ids), the execution running now with its events so far, and the
//! history of finished executions (every event and the result, up to [`MAX_HISTORY`]).
//!
//! They sit behind one lock, and the session publishes each event to its subscribers while
//! holding it: so a reader that subscribes and then reads a snapshot here misses nothing and
//! sees what it read again only with ids it already has (a client of
//! `GET /v1/sessions/{id}/executions/{execution_id}` or of a resumed WebSocket drops those).
//!
//! Must not depend on: HTTP.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::events::{ExecutionResult, SessionEvent};
use super::replay::{Catchup, Numbered, NumberedEvent, Replay};
use crate::ids::ExecutionId;

/// Executions kept in a session's history.
pub const MAX_HISTORY: usize = 10_000;

/// One execution in the history (or running).
#[derive(Debug, Clone)]
pub struct HistoryEntry {
    pub execution_id: ExecutionId,
    pub code: String,
    pub started: String,
    /// Every event of the execution, in order, with its id in the session.
    pub events: Vec<Numbered>,
    /// `None` while it runs.
    pub result: Option<Arc<ExecutionResult>>,
}

/// Whether an execution is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionProgress {
    Running,
    Done,
}

/// An execution as `GET /v1/sessions/{id}/executions/{execution_id}` answers it: its events
/// so far (every one, with ids) and, once done, its result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExecutionRecord {
    #[schema(value_type = String)]
    pub execution_id: ExecutionId,
    pub state: ExecutionProgress,
    pub code: String,
    /// When it started (RFC 3339, UTC).
    pub started: String,
    /// Every event so far, oldest first; the last is `done` once it is done.
    pub events: Vec<NumberedEvent>,
    /// Present once `state` is `done`.
    pub result: Option<ExecutionResult>,
}

/// An execution as `GET /v1/sessions/{id}/executions` lists it: enough to find the one whose
/// result a client never saw, without its events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExecutionSummary {
    #[schema(value_type = String)]
    pub execution_id: ExecutionId,
    pub state: ExecutionProgress,
    pub code: String,
    /// When it started (RFC 3339, UTC).
    pub started: String,
    /// The result's status once done.
    pub status: Option<super::events::Status>,
}

impl From<&HistoryEntry> for ExecutionSummary {
    fn from(entry: &HistoryEntry) -> ExecutionSummary {
        ExecutionSummary {
            execution_id: entry.execution_id.clone(),
            state: match entry.result {
                Some(_) => ExecutionProgress::Done,
                None => ExecutionProgress::Running,
            },
            code: entry.code.clone(),
            started: entry.started.clone(),
            status: entry.result.as_ref().map(|r| r.status),
        }
    }
}

impl From<&HistoryEntry> for ExecutionRecord {
    fn from(entry: &HistoryEntry) -> ExecutionRecord {
        ExecutionRecord {
            execution_id: entry.execution_id.clone(),
            state: match entry.result {
                Some(_) => ExecutionProgress::Done,
                None => ExecutionProgress::Running,
            },
            code: entry.code.clone(),
            started: entry.started.clone(),
            events: entry
                .events
                .iter()
                .map(|e| NumberedEvent {
                    id: e.id,
                    event: (*e.event).clone(),
                })
                .collect(),
            result: entry.result.as_deref().cloned(),
        }
    }
}

impl HistoryEntry {
    /// The `done` event of a finished execution whose events were not kept (one restored
    /// from the store after a gateway restart), numbered after `last`: all a resuming
    /// client can still be told. `None` when the entry is running or holds its `done`.
    pub fn restored_done(&self, last: u64) -> Option<Numbered> {
        let result = self.result.as_ref()?;
        if self
            .events
            .iter()
            .any(|e| matches!(*e.event, SessionEvent::Done { .. }))
        {
            return None;
        }
        Some(Numbered {
            id: last + 1,
            event: Arc::new(SessionEvent::Done {
                execution_id: self.execution_id.clone(),
                result: Box::new((**result).clone()),
            }),
        })
    }

    /// The entry without its events (what the store keeps of a finished execution).
    pub fn clone_without_events(&self) -> HistoryEntry {
        HistoryEntry {
            execution_id: self.execution_id.clone(),
            code: self.code.clone(),
            started: self.started.clone(),
            events: Vec::new(),
            result: self.result.clone(),
        }
    }
}

/// A session's events as it remembers them.
#[derive(Debug)]
pub struct Journal {
    replay: Replay,
    running: Option<HistoryEntry>,
    history: VecDeque<HistoryEntry>,
}

impl Journal {
    /// An empty journal whose replay buffer keeps `replay_bytes` of events.
    #[cfg(test)]
    pub fn new(replay_bytes: usize) -> Journal {
        Journal {
            replay: Replay::new(replay_bytes),
            running: None,
            history: VecDeque::new(),
        }
    }

    /// A journal whose history starts with `history` (a session revived from the store: its
    /// executions' results, without their events) and whose replay buffer is empty, its
    /// next event numbered `after + 1`.
    pub fn restored(replay_bytes: usize, history: Vec<HistoryEntry>, after: u64) -> Journal {
        let mut history: VecDeque<HistoryEntry> = history.into();
        while history.len() > MAX_HISTORY {
            history.pop_front();
        }
        Journal {
            replay: Replay::after(replay_bytes, after),
            running: None,
            history,
        }
    }

    /// The execution `execution_id` starts: its events are recorded from now on.
    pub fn begin(&mut self, execution_id: ExecutionId, code: String, started: String) {
        self.running = Some(HistoryEntry {
            execution_id,
            code,
            started,
            events: Vec::new(),
            result: None,
        });
    }

    /// Numbers `event` and records it (in the running execution's events when it is one of
    /// them).
    pub fn record(&mut self, event: Arc<SessionEvent>) -> Numbered {
        let numbered = self.replay.push(event);
        if let Some(running) = &mut self.running {
            if numbered.event.execution_id() == Some(&running.execution_id) {
                running.events.push(numbered.clone());
            }
        }
        numbered
    }

    /// Records the running execution's `done` event and moves it, with its result, to the
    /// history, both at once: no reader sees a `done` without the result.
    pub fn finish(&mut self, done: Arc<SessionEvent>, result: Arc<ExecutionResult>) -> Numbered {
        let numbered = self.record(done);
        if let Some(mut entry) = self.running.take() {
            entry.result = Some(result);
            if self.history.len() >= MAX_HISTORY {
                self.history.pop_front();
            }
            self.history.push_back(entry);
        }
        numbered
    }

    /// The execution `execution_id`, running or in the history.
    pub fn execution(&self, execution_id: &ExecutionId) -> Option<&HistoryEntry> {
        self.running
            .iter()
            .chain(self.history.iter().rev())
            .find(|entry| &entry.execution_id == execution_id)
    }

    /// What a client that saw every event up to `after` missed (see [`Replay::since`]).
    pub fn since(&self, after: u64) -> Catchup {
        self.replay.since(after)
    }

    /// The id of the newest event (0: none yet).
    pub fn newest(&self) -> u64 {
        self.replay.newest()
    }

    /// The finished executions, oldest first.
    pub fn history(&self) -> Vec<HistoryEntry> {
        self.history.iter().cloned().collect()
    }

    /// The newest `limit` executions, oldest first: finished ones, then the running one.
    pub fn recent(&self, limit: usize) -> Vec<ExecutionSummary> {
        let running = usize::from(self.running.is_some());
        let finished = limit.saturating_sub(running).min(self.history.len());
        self.history
            .iter()
            .skip(self.history.len() - finished)
            .chain(self.running.iter())
            .take(limit)
            .map(ExecutionSummary::from)
            .collect()
    }

    /// How many finished executions the history holds.
    pub fn finished(&self) -> usize {
        self.history.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sessions::events::Status;

    fn id(n: u8) -> ExecutionId {
        ExecutionId::parse(&format!("{n:032x}")).unwrap()
    }

    fn stream(execution_id: ExecutionId) -> Arc<SessionEvent> {
        Arc::new(SessionEvent::Stream {
            execution_id,
            name: "stdout".into(),
            text: "x".into(),
        })
    }

    fn result(execution_id: ExecutionId) -> ExecutionResult {
        ExecutionResult {
            execution_id,
            status: Status::Ok,
            execution_count: Some(1),
            stdout: "x".into(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            output_truncated: false,
            result: None,
            error: None,
            artifacts: vec![],
            omitted: vec![],
            denials: vec![],
            duration_ms: 1,
            state_generation: 1,
            resources: Default::default(),
            restored: false,
        }
    }

    #[test]
    fn an_execution_is_found_running_then_done_with_its_events_only() {
        let mut journal = Journal::new(1 << 20);
        journal.begin(id(1), "print('x')".into(), "t".into());
        journal.record(stream(id(1)));
        // The kernel's news is numbered but is no execution's event.
        journal.record(Arc::new(SessionEvent::Kernel {
            state: crate::sessions::KernelPhase::Ready,
            state_generation: 1,
            reason: None,
        }));
        let running = ExecutionRecord::from(journal.execution(&id(1)).unwrap());
        assert_eq!(running.state, ExecutionProgress::Running);
        assert_eq!(running.events.len(), 1);
        assert_eq!(running.events[0].id, 1);
        assert_eq!(running.result, None);
        assert!(journal.execution(&id(2)).is_none());
        let done = Arc::new(SessionEvent::Done {
            execution_id: id(1),
            result: Box::new(result(id(1))),
        });
        let numbered = journal.finish(done, Arc::new(result(id(1))));
        assert_eq!(numbered.id, 3);
        let record = ExecutionRecord::from(journal.execution(&id(1)).unwrap());
        assert_eq!(record.state, ExecutionProgress::Done);
        assert_eq!(
            record.events.iter().map(|e| e.id).collect::<Vec<_>>(),
            [1, 3]
        );
        assert_eq!(record.result, Some(result(id(1))));
        assert_eq!(journal.finished(), 1);
        // Ids go on across executions.
        journal.begin(id(2), "2".into(), "t".into());
        assert_eq!(journal.record(stream(id(2))).id, 4);
        // Listed oldest first, the running one last; a limit keeps the newest.
        let listed = journal.recent(10);
        assert_eq!(
            listed
                .iter()
                .map(|s| (s.execution_id.clone(), s.state, s.status))
                .collect::<Vec<_>>(),
            [
                (id(1), ExecutionProgress::Done, Some(Status::Ok)),
                (id(2), ExecutionProgress::Running, None)
            ]
        );
        assert_eq!(journal.recent(1)[0].execution_id, id(2));
        assert!(journal.recent(0).is_empty());
        let wire = serde_json::to_value(&record).unwrap();
        assert_eq!(wire["state"], "done");
        assert_eq!(wire["events"][1]["id"], 3);
        assert_eq!(wire["events"][1]["type"], "done");
        assert_eq!(
            serde_json::from_value::<ExecutionRecord>(wire).unwrap(),
            record
        );
    }
}
