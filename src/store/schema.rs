//! The store's schema and its migrations: numbered steps, the number reached kept in SQLite's
//! own `PRAGMA user_version`.
//!
//! Hand-written rather than `rusqlite_migration` (which keeps the same number the same
//! way): that crate pins an older rusqlite, and a crate that links SQLite (`links =
//! "sqlite3"`) can be in the tree only once, so every rusqlite upgrade would wait for it,
//! for a loop of a dozen lines. A step is appended, never edited once released; each runs in
//! its own transaction with the version it reaches, so a crash between steps leaves a
//! database at a known version.

use rusqlite::Connection;

/// The schema steps; step `n` (from 1) takes a database from version `n - 1` to `n`.
const STEPS: &[&str] = &[
    // 1: sessions, what export and replay need of their executions, the artifact index,
    // the usage ledger.
    "
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        tenant TEXT,
        policy TEXT NOT NULL,
        kernel_name TEXT NOT NULL,
        language TEXT NOT NULL,
        sandbox TEXT NOT NULL,
        created TEXT NOT NULL,
        generation INTEGER NOT NULL,
        language_info TEXT
    ) STRICT;
    CREATE TABLE cells (
        session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        cell TEXT NOT NULL,
        PRIMARY KEY (session_id, idx)
    ) STRICT;
    CREATE TABLE executions (
        session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        execution_id TEXT NOT NULL,
        code TEXT NOT NULL,
        started TEXT NOT NULL,
        result TEXT,
        PRIMARY KEY (session_id, execution_id)
    ) STRICT;
    CREATE TABLE artifacts (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        tenant TEXT,
        sha256 TEXT NOT NULL,
        record TEXT NOT NULL,
        expires_at INTEGER,
        linkable INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX artifacts_by_session ON artifacts(session_id);
    CREATE TABLE usage (
        id INTEGER PRIMARY KEY,
        at TEXT NOT NULL,
        tenant TEXT,
        session_id TEXT NOT NULL,
        policy TEXT NOT NULL,
        execution_id TEXT NOT NULL,
        wall_ms INTEGER NOT NULL,
        cpu_ms INTEGER,
        peak_memory_bytes INTEGER,
        output_bytes INTEGER NOT NULL,
        artifact_bytes INTEGER NOT NULL,
        outcome TEXT NOT NULL
    ) STRICT;
    CREATE INDEX usage_by_tenant ON usage(tenant, at);
    ",
    // 2: each session's newest event id, so that ids after a restart continue past the
    // ones clients saw (`sessions::persistence`); the ledger by time (the admin's queries
    // of every tenant, the retention sweep); each tenant's CPU per UTC day (the daily
    // quota), from the rows already there.
    "
    ALTER TABLE sessions ADD COLUMN last_event_id INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX usage_by_at ON usage(at);
    CREATE TABLE usage_daily (
        tenant TEXT NOT NULL,
        day TEXT NOT NULL,
        cpu_ms INTEGER NOT NULL,
        PRIMARY KEY (tenant, day)
    ) STRICT, WITHOUT ROWID;
    INSERT INTO usage_daily (tenant, day, cpu_ms)
        SELECT tenant, substr(at, 1, 10), sum(coalesce(cpu_ms, 0)) FROM usage
        WHERE tenant IS NOT NULL GROUP BY tenant, substr(at, 1, 10);
    ",
];

/// The schema version this binary writes.
pub const VERSION: u32 = STEPS.len() as u32;

/// Why the schema could not be brought to [`VERSION`] (`StoreError` says it to the operator,
/// naming the file; this is the step's own account).
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// A later cellgate wrote this database: this one would misread it.
    #[error("schema version {found} is newer than this cellgate's")]
    TooNew { found: u32 },
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
}

/// Runs the steps the database has not had yet.
pub fn migrate(connection: &mut Connection) -> Result<(), MigrateError> {
    let found: u32 = connection.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    if found > VERSION {
        return Err(MigrateError::TooNew { found });
    }
    for (done, step) in STEPS.iter().enumerate().skip(found as usize) {
        let transaction = connection.transaction()?;
        transaction.execute_batch(step)?;
        // The pragma takes no parameter; the number is ours.
        transaction.execute_batch(&format!("PRAGMA user_version = {}", done + 1))?;
        transaction.commit()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_database_reaches_the_latest_version_and_stays_there() {
        let mut connection = Connection::open_in_memory().unwrap();
        migrate(&mut connection).unwrap();
        let version: u32 = connection
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .unwrap();
        assert_eq!(version, VERSION);
        // Again: nothing to do, nothing fails.
        migrate(&mut connection).unwrap();
        let count: i64 = connection
            .query_row("SELECT count(*) FROM usage", [], |row| row.get(0))
            .unwrap();
        assert_eq!(count, 0);
    }

    #[test]
    fn the_daily_sums_start_from_the_ledger_a_version_1_database_holds() {
        let mut connection = Connection::open_in_memory().unwrap();
        connection.execute_batch(STEPS[0]).unwrap();
        connection.execute_batch("PRAGMA user_version = 1").unwrap();
        let add = |tenant: Option<&str>, at: &str, cpu_ms: Option<i64>| {
            connection
                .execute(
                    "INSERT INTO usage (at, tenant, session_id, policy, execution_id, wall_ms,
                       cpu_ms, output_bytes, artifact_bytes, outcome)
                     VALUES (?1, ?2, 's', 'default', 'e', 1, ?3, 0, 0, 'ok')",
                    rusqlite::params![at, tenant, cpu_ms],
                )
                .unwrap();
        };
        add(Some("acme"), "2026-01-01T23:59:59.999999Z", Some(5));
        add(Some("acme"), "2026-01-01T00:00:00.000000Z", Some(7));
        add(Some("acme"), "2026-01-01T12:00:00.000000Z", None);
        add(Some("acme"), "2026-01-02T00:00:00.000000Z", Some(11));
        // The admin's rows have no quota.
        add(None, "2026-01-01T00:00:00.000000Z", Some(13));
        migrate(&mut connection).unwrap();
        let sums: Vec<(String, String, i64)> = connection
            .prepare("SELECT tenant, day, cpu_ms FROM usage_daily ORDER BY tenant, day")
            .unwrap()
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(
            sums,
            [
                ("acme".to_owned(), "2026-01-01".to_owned(), 12),
                ("acme".to_owned(), "2026-01-02".to_owned(), 11)
            ]
        );
        let last_event_id: i64 = connection
            .query_row(
                "SELECT count(*) FROM pragma_table_info('sessions') WHERE name = 'last_event_id'",
                [],
                |row| row.get(0),
            )
            .unwrap();
        assert_eq!(last_event_id, 1);
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let mut connection = Connection::open_in_memory().unwrap();
        connection
            .execute_batch(&format!("PRAGMA user_version = {}", VERSION + 1))
            .unwrap();
        match migrate(&mut connection) {
            Err(MigrateError::TooNew { found }) => assert_eq!(found, VERSION + 1),
            other => panic!("{other:?}"),
        }
    }
}
