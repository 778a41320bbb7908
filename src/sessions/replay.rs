//! The replay buffer of a session: every event the session publishes gets the next id of
//! the session (1, 2, 3…, across executions and kernel changes, never reused), and the
//! newest events are kept, bounded by bytes, so that a client whose connection dropped can
//! be sent what it missed (`Last-Event-ID`, the WebSocket's `last_event_id`).
//!
//! *Invariants:* ids are strictly increasing in the order events are published; a catch-up
//! is either complete or says exactly which ids it cannot give ([`Gap`]), never silently
//! shorter; the buffer's size (each event's JSON plus a fixed overhead) stays within its
//! bound, except that the newest event is always kept.
//!
//! Must not depend on: HTTP.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::events::SessionEvent;

/// What one kept event costs besides its JSON: its slot, its id, the `Arc`.
const ENTRY_OVERHEAD: usize = 64;

/// An event of a session with its id, as every API v1 surface sends it: the event's JSON
/// with an `id` field added (SSE also writes it as the `id:` field).
#[derive(Debug, Clone, PartialEq)]
pub struct Numbered {
    pub id: u64,
    pub event: Arc<SessionEvent>,
}

impl Serialize for Numbered {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            id: u64,
            #[serde(flatten)]
            event: &'a SessionEvent,
        }
        Wire {
            id: self.id,
            event: &self.event,
        }
        .serialize(serializer)
    }
}

/// A [`Numbered`] event as a client reads it (and as the OpenAPI document describes it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NumberedEvent {
    /// The event's id in its session: strictly increasing across the session's executions.
    pub id: u64,
    #[serde(flatten)]
    pub event: SessionEvent,
}

impl From<NumberedEvent> for Numbered {
    fn from(wire: NumberedEvent) -> Numbered {
        Numbered {
            id: wire.id,
            event: Arc::new(wire.event),
        }
    }
}

/// Events a catch-up cannot give: the buffer no longer holds ids `first_id..=last_id`.
/// Sent as `{"type": "gap", "first_id", "last_id"}` before the events that follow them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename = "gap")]
pub struct Gap {
    pub first_id: u64,
    pub last_id: u64,
}

impl Gap {
    /// How many events the gap stands for.
    pub fn missed(&self) -> u64 {
        self.last_id.saturating_sub(self.first_id) + 1
    }
}

/// What a client that saw everything up to an id is owed now.
#[derive(Debug, Clone, PartialEq)]
pub struct Catchup {
    /// Ids after the client's that the buffer no longer holds.
    pub gap: Option<Gap>,
    /// The held events after the client's id, oldest first.
    pub events: Vec<Numbered>,
    /// The newest id published so far (0: none yet).
    pub newest: u64,
}

/// The newest events of a session, within a bound in bytes.
#[derive(Debug)]
pub struct Replay {
    kept: VecDeque<(Numbered, usize)>,
    bytes: usize,
    limit: usize,
    newest: u64,
}

impl Replay {
    /// An empty buffer keeping at most `limit` bytes of events.
    pub fn new(limit: usize) -> Replay {
        Replay::after(limit, 0)
    }

    /// An empty buffer whose first event gets id `after + 1`: a session whose earlier ids
    /// (up to `after`) were given by a gateway before a restart. A client that saw fewer
    /// than `after` is told the rest are a gap, as if they had been dropped.
    pub fn after(limit: usize, after: u64) -> Replay {
        Replay {
            kept: VecDeque::new(),
            bytes: 0,
            limit,
            newest: after,
        }
    }

    /// Gives `event` the next id and keeps it, dropping the oldest events past the bound.
    pub fn push(&mut self, event: Arc<SessionEvent>) -> Numbered {
        self.newest += 1;
        let numbered = Numbered {
            id: self.newest,
            event,
        };
        let size = json_size(&numbered) + ENTRY_OVERHEAD;
        self.kept.push_back((numbered.clone(), size));
        self.bytes += size;
        while self.bytes > self.limit && self.kept.len() > 1 {
            if let Some((_, dropped)) = self.kept.pop_front() {
                self.bytes -= dropped;
            }
        }
        numbered
    }

    /// The newest id published so far (0: none yet).
    pub fn newest(&self) -> u64 {
        self.newest
    }

    /// What a client that saw every event up to `after` (0: none) missed: the events still
    /// held, and the gap before them if some were dropped. An `after` the buffer never gave
    /// (ahead of its newest id: another gateway's, before a take-over) is owed nothing.
    pub fn since(&self, after: u64) -> Catchup {
        let oldest_held = self
            .kept
            .front()
            .map_or(self.newest + 1, |(event, _)| event.id);
        let gap = (after < self.newest && after + 1 < oldest_held).then(|| Gap {
            first_id: after + 1,
            last_id: oldest_held - 1,
        });
        let skip = self.kept.partition_point(|(event, _)| event.id <= after);
        Catchup {
            gap,
            events: self
                .kept
                .iter()
                .skip(skip)
                .map(|(event, _)| event.clone())
                .collect(),
            newest: self.newest,
        }
    }
}

/// Bytes of `event`'s JSON, counted without keeping them.
fn json_size(event: &Numbered) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Serialising an event cannot fail (string keys, no maps of other keys); were it to,
    // the event counts as its overhead only.
    let _ = serde_json::to_writer(&mut count, event);
    count.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::ExecutionId;

    fn stream(text: &str) -> Arc<SessionEvent> {
        Arc::new(SessionEvent::Stream {
            execution_id: ExecutionId::parse("0123456789abcdef0123456789abcdef").unwrap(),
            name: "stdout".into(),
            text: text.into(),
        })
    }

    fn ids(catchup: &Catchup) -> Vec<u64> {
        catchup.events.iter().map(|e| e.id).collect()
    }

    #[test]
    fn ids_increase_from_one_and_a_catchup_gives_what_follows() {
        let mut replay = Replay::new(1 << 20);
        assert_eq!(replay.since(0).events, []);
        assert_eq!(replay.since(0).gap, None);
        for (n, text) in ["a", "b", "c"].into_iter().enumerate() {
            assert_eq!(replay.push(stream(text)).id, n as u64 + 1);
        }
        assert_eq!(replay.newest(), 3);
        assert_eq!(ids(&replay.since(0)), [1, 2, 3]);
        assert_eq!(ids(&replay.since(1)), [2, 3]);
        let caught_up = replay.since(3);
        assert_eq!((caught_up.events.len(), caught_up.gap), (0, None));
        assert_eq!(caught_up.newest, 3);
        // An id this buffer never gave is owed nothing, and no gap.
        let ahead = replay.since(9);
        assert_eq!((ahead.events.len(), ahead.gap), (0, None));
    }

    #[test]
    fn past_the_bound_the_oldest_go_and_a_catchup_names_them() {
        let one = json_size(&Numbered {
            id: 1,
            event: stream("x"),
        }) + ENTRY_OVERHEAD;
        // Room for three events of this size (ids of one digit).
        let mut replay = Replay::new(3 * one);
        for _ in 0..5 {
            replay.push(stream("x"));
        }
        assert!(replay.bytes <= 3 * one, "{} > {}", replay.bytes, 3 * one);
        let catchup = replay.since(0);
        assert_eq!(ids(&catchup), [3, 4, 5]);
        assert_eq!(
            catchup.gap,
            Some(Gap {
                first_id: 1,
                last_id: 2
            })
        );
        assert_eq!(catchup.gap.map(|g| g.missed()), Some(2));
        let catchup = replay.since(1);
        assert_eq!(
            catchup.gap,
            Some(Gap {
                first_id: 2,
                last_id: 2
            })
        );
        assert_eq!(replay.since(2).gap, None);
        assert_eq!(ids(&replay.since(2)), [3, 4, 5]);
    }

    #[test]
    fn the_newest_event_stays_even_past_the_bound() {
        let mut replay = Replay::new(10);
        replay.push(stream("first"));
        replay.push(stream("second, larger than the whole bound"));
        let catchup = replay.since(0);
        assert_eq!(ids(&catchup), [2]);
        assert_eq!(
            catchup.gap,
            Some(Gap {
                first_id: 1,
                last_id: 1
            })
        );
    }

    #[test]
    fn a_buffer_after_a_restart_goes_on_past_the_old_ids_and_calls_them_a_gap() {
        let mut replay = Replay::after(1 << 20, 100);
        assert_eq!(replay.newest(), 100);
        // Before any new event: what a client missed is a gap, never nothing.
        assert_eq!(
            replay.since(40).gap,
            Some(Gap {
                first_id: 41,
                last_id: 100
            })
        );
        assert_eq!(replay.since(100).gap, None);
        assert_eq!(replay.push(stream("a")).id, 101);
        let catchup = replay.since(40);
        assert_eq!(
            catchup.gap,
            Some(Gap {
                first_id: 41,
                last_id: 100
            })
        );
        assert_eq!(ids(&catchup), [101]);
        let caught_up = replay.since(100);
        assert_eq!((caught_up.gap, ids(&caught_up)), (None, vec![101]));
    }

    #[test]
    fn a_numbered_event_is_the_event_with_its_id() {
        let numbered = Numbered {
            id: 7,
            event: stream("hi"),
        };
        let wire = serde_json::to_value(&numbered).unwrap();
        assert_eq!(wire["id"], 7);
        assert_eq!(wire["type"], "stream");
        assert_eq!(wire["text"], "hi");
        let read: NumberedEvent = serde_json::from_value(wire).unwrap();
        assert_eq!(Numbered::from(read), numbered);
        // Old readers of the bare event still read it.
        let bare: SessionEvent = serde_json::to_value(&numbered)
            .and_then(serde_json::from_value)
            .unwrap();
        assert_eq!(bare, *numbered.event);
        assert_eq!(
            serde_json::to_value(Gap {
                first_id: 2,
                last_id: 5
            })
            .unwrap(),
            serde_json::json!({"type": "gap", "first_id": 2, "last_id": 5})
        );
    }
}
