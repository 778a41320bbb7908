//! The gateway's state on disk, so that it outlives the process: sessions (id, tenant,
//! policy, kernelspec, created, state generation), what notebook export and replay need of
//! their executions (each cell as the kernel's history recorded it, each API v1 result),
//! the artifact index (the blobs are files beside it), and the usage ledger. One SQLite
//! database (`cellgate.db`, through rusqlite with SQLite compiled in) in the state directory
//! (`--state-dir`).
//!
//! - **One gateway per directory:** an exclusive `flock` on `<dir>/lock`, which holds the
//!   holder's pid; a second gateway is refused at start naming it. The lock goes with the
//!   process, SIGKILL included, so a crash needs no clean-up.
//! - **Never a silent loss:** a file that is not a database, fails SQLite's `quick_check`, or
//!   was written by a newer schema stops the start with the file named; so does a database
//!   gone missing (or emptied) while the marker (`<dir>/store-created`) says there was one.
//!   Deleting the directory is the explicit way to start afresh.
//! - **WAL, `synchronous = NORMAL`:** a committed write survives the process (a SIGKILL
//!   included); an OS crash or power loss may take the last transactions, never the file's
//!   consistency. FULL would add an fsync per transaction for that case, on the one writer
//!   every session's records go through; the state here is a record of work done (the
//!   kernels themselves do not survive a restart), not worth that.
//! - **Off the async runtime:** writes are queued to one writer thread that owns its
//!   connection and commits what has queued up as one transaction; queuing never blocks, so
//!   recording a finished execution adds nothing to its answer. Reads (at start, the usage
//!   queries, the quota's sum) run in a blocking context on reader connections of a small
//!   pool: WAL lets them read while the writer writes, and they never wait for each other
//!   (a connection is opened when none is free; [`READERS_KEPT`] are kept).
//! - **The ledger at scale:** each query shape of `GET /v1/usage` has its index (by tenant
//!   and time, by time); the daily CPU quota reads one row of per-tenant-per-UTC-day sums
//!   the writer keeps with each ledger row; rows older than `--usage-retention-days`
//!   (default [`DEFAULT_USAGE_RETENTION_DAYS`]) are deleted by the writer thread when the
//!   store opens and every day after, a chunk per transaction.
//!
//! Rows are plain values ([`records`]); what is inside the JSON columns (a cell, an API v1
//! result, an artifact record) belongs to the layers that write them. Migrations: `schema.rs`.
//!
//! Must not depend on: sessions, kernels, artifacts, HTTP (it stores their rows, as JSON
//! where they have their own shape).

pub mod records;
mod schema;

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use parking_lot::Mutex;
use rusqlite::{Connection, OpenFlags};

use records::Op;
pub use records::{
    ArtifactRow, ExecutionRow, Loaded, SessionRow, StoredSession, UsageQuery, UsageRow,
};

/// The database's file name in the state directory.
pub const DB_FILE: &str = "cellgate.db";
/// The lock file: held (flock) by the gateway using the directory; holds its pid.
pub const LOCK_FILE: &str = "lock";
/// Written once the database exists: from then on, a missing database is an error.
pub const MARKER_FILE: &str = "store-created";
/// How long a reader waits for the writer's lock before SQLite reports the database busy.
const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Writes committed as one transaction at most.
const MAX_BATCH: usize = 1024;
/// Reader connections kept open between reads (more are opened when that many are busy).
pub const READERS_KEPT: usize = 4;
/// Days the usage ledger keeps its rows unless configured.
pub const DEFAULT_USAGE_RETENTION_DAYS: u32 = 90;
/// How often the writer sweeps the ledger of rows past their retention.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// Settings of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreOptions {
    /// Days the usage ledger keeps a row (0: for ever).
    pub usage_retention_days: u32,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            usage_retention_days: DEFAULT_USAGE_RETENTION_DAYS,
        }
    }
}

/// Why the store could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state directory {}: {what}: {source}", dir.display())]
    Io {
        dir: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("state directory {} is in use by another cellgate (pid {holder}); give each gateway its own --state-dir", dir.display())]
    Locked { dir: PathBuf, holder: String },
    #[error("{} is missing, but {} says this state directory had a store: the gateway's sessions would be lost. Put the database back, or delete the state directory to start afresh", path.display(), marker.display())]
    Missing { path: PathBuf, marker: PathBuf },
    #[error("{} is not a usable cellgate store ({reason}): restore it from a backup, or delete the state directory to start afresh", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("{} has schema version {found}, newer than this cellgate knows ({known}): run the cellgate that wrote it, or a later one", path.display())]
    TooNew {
        path: PathBuf,
        found: u32,
        known: u32,
    },
    #[error("{}: {source}", path.display())]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("the store's writer has stopped")]
    Closed,
}

/// The open store of one gateway.
pub struct Store {
    dir: PathBuf,
    db: PathBuf,
    writes: mpsc::Sender<Op>,
    /// Idle reader connections.
    readers: Mutex<Vec<Connection>>,
    writer: Option<std::thread::JoinHandle<()>>,
    /// Held for the store's life: the directory's lock.
    _lock: File,
}

impl Drop for Store {
    /// Lets the writer commit what is queued and close its connection (which checkpoints
    /// the log into the file) before the lock goes.
    fn drop(&mut self) {
        let _ = self.writes.send(Op::Stop);
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("dir", &self.dir).finish()
    }
}

impl Store {
    /// Opens (creating, 0700) the state directory `dir` and its database, checked and
    /// migrated, and starts the writer thread. Blocking: call at start-up or from a
    /// blocking context.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        Store::open_with(dir, StoreOptions::default())
    }

    /// As [`Self::open`], with `options`.
    pub fn open_with(dir: &Path, options: StoreOptions) -> Result<Store, StoreError> {
        use std::os::unix::fs::DirBuilderExt;
        let io = |what| {
            move |source| StoreError::Io {
                dir: dir.to_owned(),
                what,
                source,
            }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io("create it"))?;
        // An existing directory (an operator's, or a parent made by hand) is made private:
        // it holds every session's code, outputs and tenants. The files in it inherit that.
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir)
                .map_err(io("read it"))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700))
                    .map_err(io("make it private (mode 0700)"))?;
            }
        }
        let lock = lock_dir(dir)?;
        let db = dir.join(DB_FILE);
        let marker = dir.join(MARKER_FILE);
        let existed = db.exists();
        let marked = marker.exists();
        if marked && !existed {
            return Err(StoreError::Missing { path: db, marker });
        }
        if marked {
            check_header(&db)?;
        }
        let mut writer = connect(&db, !existed)?;
        check(&writer, &db, marked)?;
        schema::migrate(&mut writer).map_err(|err| match err {
            schema::MigrateError::TooNew { found } => StoreError::TooNew {
                path: db.clone(),
                found,
                known: schema::VERSION,
            },
            schema::MigrateError::Sqlite(source) => classify(&db, source),
        })?;
        if !marked {
            std::fs::write(
                &marker,
                "cellgate's store is cellgate.db in this directory; while this file exists, a missing database stops the gateway's start (delete the directory to start afresh)\n",
            )
            .map_err(io("write its marker"))?;
        }
        let reader = connect(&db, false)?;
        let (writes, queue) = mpsc::channel();
        let path = db.clone();
        let writer = std::thread::Builder::new()
            .name("cellgate-store".to_owned())
            .spawn(move || write_loop(writer, queue, &path, options))
            .map_err(io("start its writer thread"))?;
        tracing::info!(dir = %dir.display(), "state directory opened");
        Ok(Store {
            dir: dir.to_owned(),
            db,
            writes,
            readers: Mutex::new(vec![reader]),
            writer: Some(writer),
            _lock: lock,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Queues a write; never blocks. A writer that has stopped (it never does but with the
    /// process) is logged, not returned: a record is not worth failing an execution for.
    fn write(&self, op: Op) {
        if self.writes.send(op).is_err() {
            tracing::error!(db = %self.db.display(), "the store's writer has stopped: a record was not written");
        }
    }

    /// Waits until every write queued so far is committed. Blocking.
    pub fn flush(&self) -> Result<(), StoreError> {
        let (done, wait) = mpsc::channel();
        self.writes
            .send(Op::Flush(done))
            .map_err(|_| StoreError::Closed)?;
        wait.recv().map_err(|_| StoreError::Closed)
    }

    /// Creates or replaces a session's row.
    pub fn put_session(&self, session: SessionRow) {
        self.write(Op::PutSession(session));
    }

    /// A session's kernel moved to state generation `generation`.
    pub fn set_generation(&self, session: &str, generation: u64) {
        self.write(Op::SetGeneration {
            session: session.to_owned(),
            generation,
        });
    }

    /// Forgets a session, its cells and executions (its artifacts have rows of their own).
    pub fn delete_session(&self, session: &str) {
        self.write(Op::DeleteSession(session.to_owned()));
    }

    /// The session has published events up to id `id` (the stored value only grows).
    pub fn note_event_id(&self, session: &str, id: u64) {
        self.write(Op::NoteEventId {
            session: session.to_owned(),
            id,
        });
    }

    /// Creates or replaces cells of a session's history (by index), and its `language_info`.
    pub fn put_cells(
        &self,
        session: &str,
        language_info: Option<serde_json::Value>,
        cells: Vec<(u64, serde_json::Value)>,
    ) {
        self.write(Op::PutCells {
            session: session.to_owned(),
            language_info,
            cells,
        });
    }

    /// As [`Self::put_cells`], with cells `make` returns on the writer thread: turning a
    /// history's outputs into JSON costs nothing on the caller's.
    pub fn put_cells_with(
        &self,
        session: &str,
        make: impl FnOnce() -> (Option<serde_json::Value>, Vec<(u64, serde_json::Value)>)
            + Send
            + 'static,
    ) {
        self.write(Op::PutCellsWith {
            session: session.to_owned(),
            make: Box::new(make),
        });
    }

    /// Records a finished execution of a session.
    pub fn put_execution(&self, session: &str, execution: ExecutionRow) {
        self.write(Op::PutExecution {
            session: session.to_owned(),
            execution,
        });
    }

    pub fn put_artifact(&self, artifact: ArtifactRow) {
        self.write(Op::PutArtifact(artifact));
    }

    /// A session's artifacts go at `expires_at` (Unix seconds); with `revoke`, signed links
    /// stop opening them.
    pub fn expire_artifacts(&self, session: &str, expires_at: i64, revoke: bool) {
        self.write(Op::ExpireArtifacts {
            session: session.to_owned(),
            expires_at,
            revoke,
        });
    }

    pub fn delete_artifacts(&self, ids: Vec<String>) {
        if !ids.is_empty() {
            self.write(Op::DeleteArtifacts(ids));
        }
    }

    /// Adds an execution to the usage ledger.
    pub fn record_usage(&self, usage: UsageRow) {
        self.write(Op::Usage(usage));
    }

    /// Runs `read` on a reader connection of the pool (one opened if none is idle).
    /// Blocking.
    fn read<T>(
        &self,
        read: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let idle = self.readers.lock().pop();
        let connection = match idle {
            Some(connection) => connection,
            None => connect(&self.db, false)?,
        };
        let result = read(&connection).map_err(|err| classify(&self.db, err));
        let mut readers = self.readers.lock();
        if readers.len() < READERS_KEPT {
            readers.push(connection);
        }
        result
    }

    /// Everything a gateway starting on this directory takes back. Blocking.
    pub fn load(&self) -> Result<Loaded, StoreError> {
        self.read(records::load)
    }

    /// The CPU milliseconds `tenant`'s ledger rows of UTC day `day` (`YYYY-MM-DD`) hold.
    /// Blocking.
    pub fn cpu_ms_of_day(&self, tenant: &str, day: &str) -> Result<u64, StoreError> {
        self.read(|connection| records::cpu_ms_of_day(connection, tenant, day))
    }

    /// The ledger's rows `query` selects, oldest first. Blocking.
    pub fn usage(&self, query: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        self.read(|connection| records::usage(connection, query))
    }
}

/// Takes the directory's lock, or names who holds it.
fn lock_dir(dir: &Path) -> Result<File, StoreError> {
    use rustix::fs::{flock, FlockOperation};
    let path = dir.join(LOCK_FILE);
    let io = |what| {
        move |source| StoreError::Io {
            dir: dir.to_owned(),
            what,
            source,
        }
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io("open its lock file"))?;
    if let Err(err) = flock(&file, FlockOperation::NonBlockingLockExclusive) {
        if err == rustix::io::Errno::WOULDBLOCK {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "unknown".to_owned(),
                pid => pid.to_owned(),
            };
            return Err(StoreError::Locked {
                dir: dir.to_owned(),
                holder,
            });
        }
        return Err(io("lock it")(err.into()));
    }
    file.set_len(0).map_err(io("write its lock file"))?;
    file.rewind().map_err(io("write its lock file"))?;
    writeln!(file, "{}", std::process::id()).map_err(io("write its lock file"))?;
    Ok(file)
}

/// A connection in WAL mode with the store's settings.
fn connect(db: &Path, create: bool) -> Result<Connection, StoreError> {
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if create {
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    }
    let connection = Connection::open_with_flags(db, flags).map_err(|err| classify(db, err))?;
    let setup = || -> rusqlite::Result<()> {
        connection.busy_timeout(BUSY_TIMEOUT)?;
        // The first statement that reads the file: garbage is found here.
        let mode: String =
            connection.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(db = %db.display(), %mode, "the store is not in WAL mode");
        }
        connection.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;")
    };
    setup().map_err(|err| classify(db, err))?;
    Ok(connection)
}

/// The main file starts with SQLite's magic. Checked by hand before SQLite reads it: with
/// a write-ahead log beside it, SQLite may read every page from the log and never notice
/// that the file itself was overwritten.
fn check_header(db: &Path) -> Result<(), StoreError> {
    const MAGIC: &[u8; 16] = b"SQLite format 3\0";
    let mut head = [0u8; 16];
    let read = File::open(db).and_then(|mut file| file.read_exact(&mut head));
    match read {
        Ok(()) if &head == MAGIC => Ok(()),
        Ok(()) => Err(StoreError::Corrupt {
            path: db.to_owned(),
            reason: "it does not start with SQLite's header".to_owned(),
        }),
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => Err(StoreError::Corrupt {
            path: db.to_owned(),
            reason: "it is empty or truncated".to_owned(),
        }),
        Err(source) => Err(StoreError::Io {
            dir: db.parent().unwrap_or(db).to_owned(),
            what: "read its database",
            source,
        }),
    }
}

/// SQLite's own check of the file (`quick_check`: structure, not index contents), and for a
/// store the marker vouches for, that it has a schema at all.
fn check(connection: &Connection, db: &Path, marked: bool) -> Result<(), StoreError> {
    let verdict: String = connection
        .query_row("PRAGMA quick_check", [], |row| row.get(0))
        .map_err(|err| classify(db, err))?;
    if verdict != "ok" {
        return Err(StoreError::Corrupt {
            path: db.to_owned(),
            reason: verdict,
        });
    }
    let version: u32 = connection
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(|err| classify(db, err))?;
    if marked && version == 0 {
        return Err(StoreError::Corrupt {
            path: db.to_owned(),
            reason: "it is empty".to_owned(),
        });
    }
    Ok(())
}

/// A SQLite error, with damage told apart from the rest.
fn classify(db: &Path, err: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode;
    match err.sqlite_error_code() {
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => StoreError::Corrupt {
            path: db.to_owned(),
            reason: err.to_string(),
        },
        _ => StoreError::Sqlite {
            path: db.to_owned(),
            source: err,
        },
    }
}

/// Deletes the ledger's rows past their retention (none with a retention of 0 days).
fn sweep(connection: &mut Connection, db: &Path, options: StoreOptions) {
    if options.usage_retention_days == 0 {
        return;
    }
    let cutoff = time::OffsetDateTime::now_utc()
        - time::Duration::days(i64::from(options.usage_retention_days));
    match records::sweep_usage(connection, &crate::timestamp::format_timestamp(cutoff)) {
        Ok(0) => {}
        Ok(deleted) => {
            tracing::info!(db = %db.display(), deleted, days = options.usage_retention_days, "usage rows past their retention deleted")
        }
        Err(err) => {
            tracing::error!(db = %db.display(), %err, "the usage ledger's retention sweep failed")
        }
    }
}

/// The writer thread: what has queued up is committed as one transaction; a write that
/// fails is logged and the others go on. It sweeps the ledger at its start and every
/// [`SWEEP_EVERY`].
fn write_loop(
    mut connection: Connection,
    queue: mpsc::Receiver<Op>,
    db: &Path,
    options: StoreOptions,
) {
    sweep(&mut connection, db, options);
    let mut next_sweep = std::time::Instant::now() + SWEEP_EVERY;
    let mut stopping = false;
    while !stopping {
        // Checked before waiting, not only when the wait times out: a queue that never
        // stays empty for a day must not put the sweep off for good.
        if std::time::Instant::now() >= next_sweep {
            sweep(&mut connection, db, options);
            next_sweep = std::time::Instant::now() + SWEEP_EVERY;
        }
        let wait = next_sweep.saturating_duration_since(std::time::Instant::now());
        let first = match queue.recv_timeout(wait) {
            Ok(op) => op,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        let mut flushed = Vec::new();
        let committed = (|| -> rusqlite::Result<()> {
            let transaction = connection.transaction()?;
            for op in batch {
                match op {
                    Op::Flush(done) => flushed.push(done),
                    Op::Stop => stopping = true,
                    op => {
                        let what = op.name();
                        if let Err(err) = records::apply(&transaction, op) {
                            tracing::error!(db = %db.display(), %err, what, "a store write failed");
                        }
                    }
                }
            }
            transaction.commit()
        })();
        if let Err(err) = committed {
            tracing::error!(db = %db.display(), %err, "a store transaction failed: its writes are lost");
        }
        for done in flushed {
            let _ = done.send(());
        }
    }
}

#[cfg(test)]
mod tests;
