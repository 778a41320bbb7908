//! The store's rows as plain values, and the SQL that writes and reads them. The JSON
//! columns hold what other layers shape (a history cell, an API v1 result, an artifact
//! record); the store keeps them as they came.

use std::sync::mpsc;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use serde_json::Value;

/// A session as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionRow {
    pub id: String,
    pub tenant: Option<String>,
    pub policy: String,
    pub kernel_name: String,
    pub language: String,
    pub sandbox: String,
    pub created: String,
    pub generation: u64,
}

/// A finished API v1 execution.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecutionRow {
    pub execution_id: String,
    pub code: String,
    pub started: String,
    /// The API v1 result, as JSON.
    pub result: Option<Value>,
}

/// A session with what it had recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredSession {
    pub session: SessionRow,
    /// The kernel's `language_info`, for export.
    pub language_info: Option<Value>,
    /// The history's cells, in order (each as the kernel layer wrote it).
    pub cells: Vec<Value>,
    /// Its API v1 executions, in order.
    pub executions: Vec<ExecutionRow>,
    /// The newest event id the session noted (see [`super::Store::note_event_id`]).
    pub last_event_id: u64,
}

/// One artifact record; its bytes are the blob named by `sha256`.
#[derive(Debug, Clone, PartialEq)]
pub struct ArtifactRow {
    pub id: String,
    pub session: String,
    pub tenant: Option<String>,
    pub sha256: String,
    /// The record as the artifact layer wrote it.
    pub record: Value,
    /// Unix seconds at which it goes (its session ended), if it does.
    pub expires_at: Option<i64>,
    /// Whether signed links still open it.
    pub linkable: bool,
}

/// Everything a gateway takes back at start.
#[derive(Debug, Default)]
pub struct Loaded {
    pub sessions: Vec<StoredSession>,
    pub artifacts: Vec<ArtifactRow>,
}

/// One execution in the usage ledger.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct UsageRow {
    /// When the execution ended (the gateway's timestamp format).
    pub at: String,
    pub tenant: Option<String>,
    pub session: String,
    pub policy: String,
    pub execution_id: String,
    pub wall_ms: u64,
    pub cpu_ms: Option<u64>,
    pub peak_memory_bytes: Option<u64>,
    pub output_bytes: u64,
    pub artifact_bytes: u64,
    /// The API v1 status.
    pub outcome: String,
}

/// Which ledger rows to read.
#[derive(Debug, Clone, Default)]
pub struct UsageQuery {
    /// `Some(None)`: the admin's own rows (no tenant); `None`: every tenant.
    pub tenant: Option<Option<String>>,
    /// From this timestamp on (inclusive).
    pub since: Option<String>,
    /// Before this timestamp.
    pub until: Option<String>,
    pub limit: usize,
}

/// Makes cells to write (`language_info`, and cells by index) on the writer thread.
pub type MakeCells = Box<dyn FnOnce() -> (Option<Value>, Vec<(u64, Value)>) + Send>;

/// A write for the writer thread.
pub(super) enum Op {
    PutSession(SessionRow),
    SetGeneration {
        session: String,
        generation: u64,
    },
    DeleteSession(String),
    NoteEventId {
        session: String,
        id: u64,
    },
    PutCells {
        session: String,
        language_info: Option<Value>,
        cells: Vec<(u64, Value)>,
    },
    /// As `PutCells`, the cells made on the writer thread.
    PutCellsWith {
        session: String,
        make: MakeCells,
    },
    PutExecution {
        session: String,
        execution: ExecutionRow,
    },
    PutArtifact(ArtifactRow),
    ExpireArtifacts {
        session: String,
        expires_at: i64,
        revoke: bool,
    },
    DeleteArtifacts(Vec<String>),
    Usage(UsageRow),
    Flush(mpsc::Sender<()>),
    /// The store is being dropped: the writer ends after this batch.
    Stop,
}

impl Op {
    /// For the log.
    pub(super) fn name(&self) -> &'static str {
        match self {
            Op::PutSession(_) => "put_session",
            Op::SetGeneration { .. } => "set_generation",
            Op::DeleteSession(_) => "delete_session",
            Op::NoteEventId { .. } => "note_event_id",
            Op::PutCells { .. } | Op::PutCellsWith { .. } => "put_cells",
            Op::PutExecution { .. } => "put_execution",
            Op::PutArtifact(_) => "put_artifact",
            Op::ExpireArtifacts { .. } => "expire_artifacts",
            Op::DeleteArtifacts(_) => "delete_artifacts",
            Op::Usage(_) => "usage",
            Op::Flush(_) => "flush",
            Op::Stop => "stop",
        }
    }
}

fn json(value: &Value) -> String {
    value.to_string()
}

/// SQLite integers are signed; our counters never reach 2^63.
fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

pub(super) fn apply(tx: &Transaction<'_>, op: Op) -> rusqlite::Result<()> {
    match op {
        Op::PutSession(s) => {
            tx.execute(
                "INSERT INTO sessions (id, tenant, policy, kernel_name, language, sandbox, created, generation)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                 ON CONFLICT (id) DO UPDATE SET tenant = ?2, policy = ?3, kernel_name = ?4,
                   language = ?5, sandbox = ?6, created = ?7, generation = ?8",
                params![
                    s.id,
                    s.tenant,
                    s.policy,
                    s.kernel_name,
                    s.language,
                    s.sandbox,
                    s.created,
                    int(s.generation)
                ],
            )?;
        }
        Op::SetGeneration {
            session,
            generation,
        } => {
            tx.execute(
                "UPDATE sessions SET generation = max(generation, ?2) WHERE id = ?1",
                params![session, int(generation)],
            )?;
        }
        Op::DeleteSession(session) => {
            tx.execute("DELETE FROM sessions WHERE id = ?1", params![session])?;
        }
        Op::NoteEventId { session, id } => {
            tx.execute(
                "UPDATE sessions SET last_event_id = max(last_event_id, ?2) WHERE id = ?1",
                params![session, int(id)],
            )?;
        }
        Op::PutCellsWith { session, make } => {
            let (language_info, cells) = make();
            return apply(
                tx,
                Op::PutCells {
                    session,
                    language_info,
                    cells,
                },
            );
        }
        Op::PutCells {
            session,
            language_info,
            cells,
        } => {
            if let Some(info) = language_info {
                tx.execute(
                    "UPDATE sessions SET language_info = ?2 WHERE id = ?1",
                    params![session, json(&info)],
                )?;
            }
            let mut put = tx.prepare_cached(
                "INSERT INTO cells (session_id, idx, cell) SELECT ?1, ?2, ?3
                 WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?1)
                 ON CONFLICT (session_id, idx) DO UPDATE SET cell = ?3",
            )?;
            for (idx, cell) in cells {
                put.execute(params![session, int(idx), json(&cell)])?;
            }
        }
        Op::PutExecution { session, execution } => {
            tx.execute(
                "INSERT INTO executions (session_id, execution_id, code, started, result)
                 SELECT ?1, ?2, ?3, ?4, ?5 WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?1)
                 ON CONFLICT (session_id, execution_id) DO UPDATE SET result = ?5",
                params![
                    session,
                    execution.execution_id,
                    execution.code,
                    execution.started,
                    execution.result.as_ref().map(json)
                ],
            )?;
        }
        Op::PutArtifact(a) => {
            tx.execute(
                "INSERT INTO artifacts (id, session_id, tenant, sha256, record, expires_at, linkable)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                 ON CONFLICT (id) DO UPDATE SET sha256 = ?4, record = ?5, expires_at = ?6, linkable = ?7",
                params![
                    a.id,
                    a.session,
                    a.tenant,
                    a.sha256,
                    json(&a.record),
                    a.expires_at,
                    a.linkable
                ],
            )?;
        }
        Op::ExpireArtifacts {
            session,
            expires_at,
            revoke,
        } => {
            tx.execute(
                "UPDATE artifacts SET expires_at = coalesce(expires_at, ?2),
                   linkable = CASE WHEN ?3 THEN 0 ELSE linkable END
                 WHERE session_id = ?1",
                params![session, expires_at, revoke],
            )?;
        }
        Op::DeleteArtifacts(ids) => {
            let mut delete = tx.prepare_cached("DELETE FROM artifacts WHERE id = ?1")?;
            for id in ids {
                delete.execute(params![id])?;
            }
        }
        Op::Usage(u) => {
            // The day is the ledger timestamp's date: UTC, as the quota's day is.
            if let (Some(tenant), Some(cpu_ms)) = (&u.tenant, u.cpu_ms) {
                tx.execute(
                    "INSERT INTO usage_daily (tenant, day, cpu_ms) VALUES (?1, substr(?2, 1, 10), ?3)
                     ON CONFLICT (tenant, day) DO UPDATE SET cpu_ms = cpu_ms + ?3",
                    params![tenant, u.at, int(cpu_ms)],
                )?;
            }
            tx.execute(
                "INSERT INTO usage (at, tenant, session_id, policy, execution_id, wall_ms, cpu_ms,
                   peak_memory_bytes, output_bytes, artifact_bytes, outcome)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                params![
                    u.at,
                    u.tenant,
                    u.session,
                    u.policy,
                    u.execution_id,
                    int(u.wall_ms),
                    u.cpu_ms.map(int),
                    u.peak_memory_bytes.map(int),
                    int(u.output_bytes),
                    int(u.artifact_bytes),
                    u.outcome
                ],
            )?;
        }
        Op::Flush(_) | Op::Stop => {}
    }
    Ok(())
}

/// A JSON column; a value that does not parse is a damaged store.
fn parse_json(text: String, column: usize) -> rusqlite::Result<Value> {
    serde_json::from_str(&text).map_err(|err| {
        rusqlite::Error::FromSqlConversionFailure(column, rusqlite::types::Type::Text, err.into())
    })
}

fn uint(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

pub(super) fn load(connection: &Connection) -> rusqlite::Result<Loaded> {
    let mut sessions = Vec::new();
    let mut select = connection.prepare(
        "SELECT id, tenant, policy, kernel_name, language, sandbox, created, generation, language_info,
           last_event_id
         FROM sessions ORDER BY created, id",
    )?;
    let rows = select.query_map([], |row| {
        Ok((
            SessionRow {
                id: row.get(0)?,
                tenant: row.get(1)?,
                policy: row.get(2)?,
                kernel_name: row.get(3)?,
                language: row.get(4)?,
                sandbox: row.get(5)?,
                created: row.get(6)?,
                generation: uint(row.get(7)?),
            },
            row.get::<_, Option<String>>(8)?,
            uint(row.get(9)?),
        ))
    })?;
    let mut cells =
        connection.prepare("SELECT cell FROM cells WHERE session_id = ?1 ORDER BY idx")?;
    let mut executions = connection.prepare(
        "SELECT execution_id, code, started, result FROM executions WHERE session_id = ?1 ORDER BY rowid",
    )?;
    for row in rows {
        let (session, language_info, last_event_id) = row?;
        let language_info = language_info.map(|t| parse_json(t, 8)).transpose()?;
        let cells = cells
            .query_map(params![session.id], |row| parse_json(row.get(0)?, 0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let executions = executions
            .query_map(params![session.id], |row| {
                Ok(ExecutionRow {
                    execution_id: row.get(0)?,
                    code: row.get(1)?,
                    started: row.get(2)?,
                    result: row
                        .get::<_, Option<String>>(3)?
                        .map(|t| parse_json(t, 3))
                        .transpose()?,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        sessions.push(StoredSession {
            session,
            language_info,
            cells,
            executions,
            last_event_id,
        });
    }
    let artifacts = connection
        .prepare(
            "SELECT id, session_id, tenant, sha256, record, expires_at, linkable FROM artifacts",
        )?
        .query_map([], |row| {
            Ok(ArtifactRow {
                id: row.get(0)?,
                session: row.get(1)?,
                tenant: row.get(2)?,
                sha256: row.get(3)?,
                record: parse_json(row.get(4)?, 4)?,
                expires_at: row.get(5)?,
                linkable: row.get(6)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(Loaded {
        sessions,
        artifacts,
    })
}

/// The CPU milliseconds `tenant`'s ledger rows of UTC day `day` (`YYYY-MM-DD`) hold, from
/// the per-day sums (one row read, whatever the ledger's size).
pub(super) fn cpu_ms_of_day(
    connection: &Connection,
    tenant: &str,
    day: &str,
) -> rusqlite::Result<u64> {
    let total: Option<i64> = connection
        .query_row(
            "SELECT cpu_ms FROM usage_daily WHERE tenant = ?1 AND day = ?2",
            params![tenant, day],
            |row| row.get(0),
        )
        .optional()?;
    Ok(total.map_or(0, uint))
}

/// The ledger query `query` asks for: only the conditions it has, so that SQLite picks an
/// index for each shape (a `(?1 OR tenant IS ?2)` would have it scan the table), and its
/// parameters.
pub(super) fn usage_sql(query: &UsageQuery) -> (String, Vec<Option<String>>) {
    let mut conditions = Vec::new();
    let mut values = Vec::new();
    match &query.tenant {
        None => {}
        Some(None) => conditions.push("tenant IS NULL".to_owned()),
        Some(Some(tenant)) => {
            values.push(Some(tenant.clone()));
            conditions.push(format!("tenant = ?{}", values.len()));
        }
    }
    if let Some(since) = &query.since {
        values.push(Some(since.clone()));
        conditions.push(format!("at >= ?{}", values.len()));
    }
    if let Some(until) = &query.until {
        values.push(Some(until.clone()));
        conditions.push(format!("at < ?{}", values.len()));
    }
    let filter = if conditions.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", conditions.join(" AND "))
    };
    let sql = format!(
        "SELECT at, tenant, session_id, policy, execution_id, wall_ms, cpu_ms, peak_memory_bytes,
           output_bytes, artifact_bytes, outcome
         FROM usage {filter} ORDER BY at, id LIMIT {}",
        query.limit.min(i64::MAX as usize)
    );
    (sql, values)
}

pub(super) fn usage(
    connection: &Connection,
    query: &UsageQuery,
) -> rusqlite::Result<Vec<UsageRow>> {
    let (sql, values) = usage_sql(query);
    let mut select = connection.prepare(&sql)?;
    let rows = select.query_map(rusqlite::params_from_iter(values.iter()), |row| {
        Ok(UsageRow {
            at: row.get(0)?,
            tenant: row.get(1)?,
            session: row.get(2)?,
            policy: row.get(3)?,
            execution_id: row.get(4)?,
            wall_ms: uint(row.get(5)?),
            cpu_ms: row.get::<_, Option<i64>>(6)?.map(uint),
            peak_memory_bytes: row.get::<_, Option<i64>>(7)?.map(uint),
            output_bytes: uint(row.get(8)?),
            artifact_bytes: uint(row.get(9)?),
            outcome: row.get(10)?,
        })
    })?;
    rows.collect()
}

/// Whether a session row exists (tests).
#[cfg(test)]
pub(super) fn has_session(connection: &Connection, id: &str) -> bool {
    connection
        .query_row(
            "SELECT count(*) FROM sessions WHERE id = ?1",
            params![id],
            |row| row.get::<_, i64>(0),
        )
        .is_ok_and(|n| n > 0)
}

/// Rows a retention sweep deletes per transaction: the writer's other work waits for one
/// chunk at most, not for a whole first sweep of a large ledger.
const SWEEP_CHUNK: i64 = 10_000;

/// Deletes the ledger's rows (and per-day sums) from before `cutoff` (a ledger timestamp),
/// a chunk per transaction; how many rows went.
pub(super) fn sweep_usage(connection: &mut Connection, cutoff: &str) -> rusqlite::Result<u64> {
    let mut deleted = 0;
    loop {
        let tx = connection.transaction()?;
        let n = tx.execute(
            "DELETE FROM usage WHERE id IN (SELECT id FROM usage WHERE at < ?1 LIMIT ?2)",
            params![cutoff, SWEEP_CHUNK],
        )?;
        tx.commit()?;
        deleted += n as u64;
        if (n as i64) < SWEEP_CHUNK {
            break;
        }
    }
    connection.execute(
        "DELETE FROM usage_daily WHERE day < substr(?1, 1, 10)",
        params![cutoff],
    )?;
    Ok(deleted)
}
