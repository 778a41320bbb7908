//! Artifacts: rich outputs (images, HTML, SVG, JSON, chart specs, PDFs…) and files the code
//! wrote to `outputs/`, stored once by content and referenced by id.
//!
//! Blobs live on disk at `<dir>/<sha256[0..2]>/<sha256>`, written once (temporary file, then
//! rename), shared by every artifact with the same bytes and removed with the last one.
//! An artifact record (random id, never the hash: the same bytes in two tenants' sessions
//! are two artifacts, and an id reveals nothing about content) carries its owner (session
//! and tenant), MIME type, size, dimensions where known (read from headers: PNG, JPEG, GIF,
//! WebP through `imagesize`, SVG by hand; no image decoder in the gateway), a short text
//! summary for language models, and for `display_id` updates a version number and the id it
//! replaces (`inspect.rs` reads the head of the content).
//!
//! *Invariant:* a record is counted before its blob is written and blobs are removed under
//! the index lock, so a concurrent put of the same bytes never loses its blob.
//!
//! Records of a deleted session stay fetchable for a retention period (1 h by default),
//! then go with their blob's last reference ([`ArtifactStore::reap`]).
//!
//! Stored bytes are bounded three ways, each checked when an artifact is recorded and named
//! in the refusal ([`Quota`]): per session and per tenant (the policy's
//! `artifacts_per_session` and `artifacts_per_tenant`, counting every record of the session
//! or tenant, a deleted session's retained ones included), and a gateway-wide minimum of free
//! disk under the store. Below that minimum the retained artifacts of deleted sessions go
//! first, oldest first, before their retention ends; live sessions' artifacts are never
//! taken back. A refusal reaches the client as an `omitted` entry naming its quota.
//!
//! Large outputs are stored off the execution's critical path: everything a reference
//! carries (size, dimensions, summary) comes from the head of the content, so
//! [`ArtifactStore::reserve`] records the artifact at once and a [`Reservation`] hashes and
//! writes the bytes in the background. [`ArtifactStore::open`] waits for a pending
//! artifact, so a client that follows a reference the moment it arrives still gets the bytes;
//! a reservation that fails (or is dropped unfilled) removes its record, and a fetch then
//! answers "not found" and the log says why.
//!
//! With a state directory, the index is also a table of its store (`crate::store`): a record
//! is written there once its bytes are stored, its expiry and revocation follow it, and it
//! goes with the record; a gateway started on the same directory takes the records back
//! ([`ArtifactStore::restore`]), so an artifact id keeps naming its bytes across restarts.
//! What a crash leaves behind is swept then: a blob written whose record never reached the
//! store (the gateway died between the two), and temporary files of writes and removals
//! cut short.
//!
//! Must not depend on: HTTP, kernels.

mod inspect;
pub mod links;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::ids::{ArtifactId, ExecutionId};
use crate::store::{ArtifactRow, Store};

pub use inspect::{dimensions, strip_ansi, summarize};

/// MIME types kept as artifacts, in the order a frontend prefers them. Vega-Lite 6 has two
/// spellings: `+json` (what the python3 kernel's Altair renderer sends, and the usual form)
/// and Altair 6's own `.json` (its `mimetype` renderer, when user code enables it).
pub const RICH_MIME_TYPES: &[&str] = &[
    "application/vnd.plotly.v1+json",
    "application/vnd.vegalite.v6+json",
    "application/vnd.vegalite.v6.json",
    "application/vnd.vegalite.v5+json",
    "application/vnd.vegalite.v4+json",
    "application/vnd.vega.v6+json",
    "application/vnd.vega.v5+json",
    "image/png",
    "image/jpeg",
    "image/gif",
    "image/webp",
    "image/svg+xml",
    "application/pdf",
    "text/html",
    "text/markdown",
    "text/latex",
    "application/json",
    "application/geo+json",
];

/// MIME types whose bundle value is base64 text.
pub fn is_base64_mime(mime: &str) -> bool {
    matches!(
        mime,
        "image/png" | "image/jpeg" | "image/gif" | "image/webp" | "application/pdf"
    )
}

/// MIME types a browser could run script from: served with `Content-Security-Policy:
/// sandbox`.
pub fn is_active_content(mime: &str) -> bool {
    matches!(
        mime,
        "text/html" | "image/svg+xml" | "application/xhtml+xml"
    ) || mime.ends_with("+xml")
}

/// Errors of the artifact store.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("artifact of {size} bytes is larger than the limit of {limit} bytes")]
    TooLarge { size: u64, limit: u64 },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the content has {got} bytes, not the {promised} its reference announced")]
    SizeMismatch { promised: u64, got: u64 },
    #[error("artifact {0} is still being stored")]
    NotReady(String),
    #[error(
        "{bytes} more bytes would pass the {quota} quota of {limit} bytes ({used} bytes stored)"
    )]
    OverQuota {
        quota: Quota,
        limit: u64,
        used: u64,
        bytes: u64,
    },
    #[error("the artifact store's disk has {free} bytes free; the gateway keeps {limit} bytes free (artifact_min_free_disk)")]
    DiskLow { free: u64, limit: u64 },
}

impl ArtifactError {
    /// The quota a refusal names, if it is one.
    pub fn quota(&self) -> Option<Quota> {
        match self {
            ArtifactError::TooLarge { .. } => Some(Quota::ArtifactSize),
            ArtifactError::OverQuota { quota, .. } => Some(*quota),
            ArtifactError::DiskLow { .. } => Some(Quota::ArtifactMinFreeDisk),
            _ => None,
        }
    }
}

/// A limit on stored artifacts, named as in the policy or the gateway's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Quota {
    /// The policy's `artifact_size`: one artifact.
    ArtifactSize,
    /// The policy's `artifacts_per_session`.
    ArtifactsPerSession,
    /// The policy's `artifacts_per_tenant`: every session of the tenant, retained ones too.
    ArtifactsPerTenant,
    /// The gateway's `artifact_min_free_disk`.
    ArtifactMinFreeDisk,
}

impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Quota::ArtifactSize => "artifact_size",
            Quota::ArtifactsPerSession => "artifacts_per_session",
            Quota::ArtifactsPerTenant => "artifacts_per_tenant",
            Quota::ArtifactMinFreeDisk => "artifact_min_free_disk",
        })
    }
}

/// The byte quotas of one session's artifacts (its policy's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quotas {
    pub per_session: u64,
    pub per_tenant: u64,
}

impl Default for Quotas {
    /// No quota.
    fn default() -> Self {
        Quotas {
            per_session: u64::MAX,
            per_tenant: u64::MAX,
        }
    }
}

/// Where an artifact came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    DisplayData,
    ExecuteResult,
    UpdateDisplayData,
    /// A file the code wrote under `outputs/`.
    File,
}

/// One artifact, as listed and referenced (and, with the fields skipped here in columns of
/// their own, as the store keeps it).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Artifact {
    pub id: ArtifactId,
    pub mime: String,
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    pub summary: String,
    pub origin: Origin,
    /// The execution that produced it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub execution_id: Option<ExecutionId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub display_id: Option<String>,
    /// 1 for a first display; each `update_display_data` of the same display id adds one.
    pub version: u32,
    /// The artifact this version replaces (same display id, same MIME type).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<ArtifactId>,
    /// For files from `outputs/`: the path below the workspace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    pub created: String,
    #[serde(skip)]
    pub session: String,
    #[serde(skip)]
    pub owner: Option<String>,
}

/// What a caller knows about new content.
#[derive(Debug, Clone)]
pub struct NewArtifact<'a> {
    pub session: &'a str,
    pub owner: Option<&'a str>,
    pub mime: &'a str,
    pub origin: Origin,
    pub execution_id: Option<&'a ExecutionId>,
    pub display_id: Option<&'a str>,
    /// The bundle's `text/plain`, for the summary.
    pub text: Option<&'a str>,
    pub path: Option<&'a str>,
    pub quotas: Quotas,
}

/// What an artifact knows before its bytes are stored: what its reference carries.
#[derive(Debug, Clone)]
pub struct Description {
    pub bytes: u64,
    pub width: Option<u32>,
    pub height: Option<u32>,
    pub summary: String,
}

impl Description {
    /// Describes content of `bytes` bytes from its first bytes (`head`; dimensions are in
    /// the first few KiB of every image format we read).
    pub fn from_head(new: &NewArtifact<'_>, head: &[u8], bytes: u64) -> Description {
        let (width, height) = dimensions(new.mime, head).unzip();
        let summary = summarize(new.mime, head, new.text, (width, height), new.path);
        Description {
            bytes,
            width,
            height,
            summary,
        }
    }
}

/// Where a record's bytes are.
enum Blob {
    /// Stored, under this sha256.
    Stored(String),
    /// Being stored by a [`Reservation`]; the channel says `true` once that is over, either
    /// way.
    Pending(watch::Receiver<bool>),
}

struct Record {
    artifact: Arc<Artifact>,
    blob: Blob,
    /// Set when the owning session ended: the record goes at this instant.
    expires: Option<Instant>,
    /// Whether signed links may open it: until its session is deleted by a client.
    linkable: bool,
}

#[derive(Default)]
struct Index {
    records: HashMap<ArtifactId, Record>,
    /// Artifact ids per blob, to remove a blob with its last record.
    blobs: HashMap<String, usize>,
    /// Latest artifact per (session, display id, MIME type), for update versions.
    displays: HashMap<(String, String, String), ArtifactId>,
    /// Bytes of the records of each session, and of each tenant (`""`: no tenant).
    session_bytes: HashMap<String, u64>,
    tenant_bytes: HashMap<String, u64>,
    /// Bytes recorded but not on the disk yet (reserved rich outputs, a `put` being
    /// written): the free space read does not count them, so the disk minimum must.
    unwritten: u64,
}

fn tenant_key(artifact: &Artifact) -> &str {
    artifact.owner.as_deref().unwrap_or("")
}

impl Index {
    fn insert(&mut self, record: Record) {
        let artifact = &record.artifact;
        *self
            .session_bytes
            .entry(artifact.session.clone())
            .or_default() += artifact.bytes;
        *self
            .tenant_bytes
            .entry(tenant_key(artifact).to_owned())
            .or_default() += artifact.bytes;
        self.records.insert(artifact.id.clone(), record);
    }

    /// Removes a record and its bytes from the usage counts (not its blob reference).
    fn remove(&mut self, id: &ArtifactId) -> Option<Record> {
        let record = self.records.remove(id)?;
        let artifact = &record.artifact;
        for (map, key) in [
            (&mut self.session_bytes, artifact.session.as_str()),
            (&mut self.tenant_bytes, tenant_key(artifact)),
        ] {
            if let Some(used) = map.get_mut(key) {
                *used = used.saturating_sub(artifact.bytes);
                if *used == 0 {
                    map.remove(key);
                }
            }
        }
        Some(record)
    }

    /// Drops one reference to a blob; `true` when it was the last (remove the file).
    fn release_blob(&mut self, sha: &str) -> bool {
        let left = self.blobs.get_mut(sha).map(|n| {
            *n = n.saturating_sub(1);
            *n
        });
        if left == Some(0) {
            self.blobs.remove(sha);
            return true;
        }
        false
    }
}

/// The artifact store of one gateway.
pub struct ArtifactStore {
    dir: PathBuf,
    index: RwLock<Index>,
    retention: Duration,
    /// Free bytes the store leaves on its disk (0: no minimum).
    min_free_disk: u64,
    /// Reads the free bytes of the store's disk (statvfs; tests give a disk of their own).
    free_space: FreeSpace,
    /// The state directory's store, which keeps the index across restarts.
    persisted: Option<Arc<Store>>,
}

/// Unix seconds of an instant ahead of now (for the store, which outlives `Instant`s).
fn unix_after(after: Duration) -> i64 {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    now.saturating_add(i64::try_from(after.as_secs()).unwrap_or(i64::MAX))
}

/// How the store reads its disk's free space.
type FreeSpace = Box<dyn Fn(&Path) -> std::io::Result<u64> + Send + Sync>;

fn statvfs_free(dir: &Path) -> std::io::Result<u64> {
    let stat = rustix::fs::statvfs(dir)?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

impl ArtifactStore {
    /// Opens (creating, 0700) the store in `dir`.
    pub fn new(dir: PathBuf, retention: Duration) -> Result<ArtifactStore, ArtifactError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|source| ArtifactError::Io {
                what: format!("create {}", dir.display()),
                source,
            })?;
        Ok(ArtifactStore {
            dir,
            index: RwLock::new(Index::default()),
            retention,
            min_free_disk: 0,
            free_space: Box::new(statvfs_free),
            persisted: None,
        })
    }

    /// Keeps the index in `store` too (see the module's doc).
    pub fn with_store(mut self, store: Arc<Store>) -> ArtifactStore {
        self.persisted = Some(store);
        self
    }

    /// Takes back the records a store kept. A record whose blob is gone is dropped from the
    /// store, and the log says so.
    pub fn restore(&self, rows: Vec<ArtifactRow>) {
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let mut gone = Vec::new();
        let mut index = self.index.write();
        for row in rows {
            let artifact = match serde_json::from_value::<Artifact>(row.record) {
                Ok(artifact) => artifact,
                Err(err) => {
                    tracing::error!(artifact = %row.id, %err, "a stored artifact record does not parse: dropped");
                    gone.push(row.id);
                    continue;
                }
            };
            let valid_sha =
                row.sha256.len() == 64 && row.sha256.bytes().all(|b| b.is_ascii_hexdigit());
            if !valid_sha || !self.blob_path(&row.sha256).is_file() {
                tracing::error!(artifact = %row.id, sha256 = %row.sha256, "a stored artifact's file is missing: its record is dropped");
                gone.push(row.id);
                continue;
            }
            let artifact = Arc::new(Artifact {
                session: row.session,
                owner: row.tenant,
                ..artifact
            });
            let expires = row.expires_at.map(|at| {
                let left = u64::try_from(at.saturating_sub(now)).unwrap_or(0);
                Instant::now() + Duration::from_secs(left)
            });
            *index.blobs.entry(row.sha256.clone()).or_default() += 1;
            index.insert(Record {
                artifact,
                blob: Blob::Stored(row.sha256),
                expires,
                linkable: row.linkable,
            });
        }
        // Under the lock, as `reap` removes blobs: nothing can count a reference meanwhile.
        let swept = self.sweep_orphans(&index);
        drop(index);
        if swept > 0 {
            tracing::warn!(files = swept, dir = %self.dir.display(), "removed artifact files no record names (written before a crash that lost their record, or temporary files of writes cut short)");
        }
        if let Some(store) = &self.persisted {
            store.delete_artifacts(gone);
        }
    }

    /// Removes the files under the store's directory that no record uses: blobs
    /// (`<sha[0..2]>/<sha>`) the index counts no reference to, and temporary files (names
    /// starting with `.`, which only this module makes). Anything else is left alone and
    /// logged. How many went.
    fn sweep_orphans(&self, index: &Index) -> usize {
        let mut removed = 0;
        let remove = |path: &Path, removed: &mut usize| match std::fs::remove_file(path) {
            Ok(()) => *removed += 1,
            Err(err) => {
                tracing::warn!(path = %path.display(), %err, "could not remove an orphan artifact file")
            }
        };
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if name.starts_with('.') && kind.is_file() {
                remove(&entry.path(), &mut removed);
                continue;
            }
            let prefix = name.len() == 2 && name.bytes().all(|b| b.is_ascii_hexdigit());
            if !(prefix && kind.is_dir()) {
                tracing::warn!(path = %entry.path().display(), "an unexpected file in the artifact store: left alone");
                continue;
            }
            let Ok(blobs) = std::fs::read_dir(entry.path()) else {
                continue;
            };
            for blob in blobs.flatten() {
                let sha = blob.file_name();
                let sha = sha.to_string_lossy();
                let is_blob = sha.len() == 64
                    && sha.starts_with(name.as_ref())
                    && sha.bytes().all(|b| b.is_ascii_hexdigit())
                    && blob.file_type().is_ok_and(|t| t.is_file());
                if !is_blob {
                    tracing::warn!(path = %blob.path().display(), "an unexpected file in the artifact store: left alone");
                    continue;
                }
                if !index.blobs.contains_key(sha.as_ref()) {
                    remove(&blob.path(), &mut removed);
                }
            }
        }
        removed
    }

    /// Writes a record whose bytes are stored to the store, as the index has it now (its
    /// expiry and links: the session may have ended while the bytes were written), queued
    /// under the index's lock as expiries and removals are, so the store sees them in the
    /// index's order. A record gone meanwhile is not written.
    fn persist(&self, artifact: &Artifact, sha: &str) {
        let Some(store) = &self.persisted else {
            return;
        };
        let index = self.index.read();
        let Some(current) = index.records.get(&artifact.id) else {
            return;
        };
        let expires_at = current
            .expires
            .map(|at| unix_after(at.saturating_duration_since(Instant::now())));
        let linkable = current.linkable;
        let record = match serde_json::to_value(artifact) {
            Ok(record) => record,
            Err(err) => {
                tracing::error!(artifact = %artifact.id, %err, "an artifact record could not be written to the store");
                return;
            }
        };
        store.put_artifact(ArtifactRow {
            id: artifact.id.to_string(),
            session: artifact.session.clone(),
            tenant: artifact.owner.clone(),
            sha256: sha.to_owned(),
            record,
            expires_at,
            linkable,
        });
        drop(index);
    }

    /// Removes records from the store.
    fn unpersist(&self, ids: Vec<String>) {
        if let Some(store) = &self.persisted {
            store.delete_artifacts(ids);
        }
    }

    /// Keeps at least `bytes` free on the store's disk (see [`Quota::ArtifactMinFreeDisk`]).
    pub fn with_min_free_disk(mut self, bytes: u64) -> ArtifactStore {
        self.min_free_disk = bytes;
        self
    }

    /// Free bytes on the store's disk for an unprivileged writer; `None` if it cannot be
    /// read (then no minimum is enforced, and the log says so).
    fn free_disk(&self) -> Option<u64> {
        match (self.free_space)(&self.dir) {
            Ok(free) => Some(free),
            Err(err) => {
                tracing::warn!(dir = %self.dir.display(), %err, "cannot read the artifact disk's free space");
                None
            }
        }
    }

    /// Whether `bytes` more fit under `new`'s quotas (what [`ArtifactStore::put`] and the
    /// others check when they record): lets a caller refuse before reading a large file.
    pub fn check(&self, new: &NewArtifact<'_>, bytes: u64) -> Result<(), ArtifactError> {
        let index = self.index.read();
        Self::check_quotas(&index, new, bytes)?;
        drop(index);
        self.check_disk(bytes, false)
    }

    fn check_quotas(index: &Index, new: &NewArtifact<'_>, bytes: u64) -> Result<(), ArtifactError> {
        let session_used = index.session_bytes.get(new.session).copied().unwrap_or(0);
        let tenant_used = index
            .tenant_bytes
            .get(new.owner.unwrap_or(""))
            .copied()
            .unwrap_or(0);
        for (quota, limit, used) in [
            (
                Quota::ArtifactsPerSession,
                new.quotas.per_session,
                session_used,
            ),
            (
                Quota::ArtifactsPerTenant,
                new.quotas.per_tenant,
                tenant_used,
            ),
        ] {
            if used.saturating_add(bytes) > limit {
                return Err(ArtifactError::OverQuota {
                    quota,
                    limit,
                    used,
                    bytes,
                });
            }
        }
        Ok(())
    }

    /// Whether `bytes` more leave the minimum free; with `relieve`, retained artifacts of
    /// deleted sessions are removed (oldest first) to make room.
    fn check_disk(&self, bytes: u64, relieve: bool) -> Result<(), ArtifactError> {
        if self.min_free_disk == 0 {
            return Ok(());
        }
        let Some(free) = self.free_disk() else {
            return Ok(());
        };
        let unwritten = self.index.read().unwritten;
        let wanted = self
            .min_free_disk
            .saturating_add(bytes)
            .saturating_add(unwritten);
        if free >= wanted {
            return Ok(());
        }
        let free = if relieve {
            self.relieve(wanted).unwrap_or(free)
        } else {
            free
        };
        if free >= wanted {
            return Ok(());
        }
        Err(ArtifactError::DiskLow {
            free,
            limit: self.min_free_disk,
        })
    }

    /// Removes retained artifacts of deleted sessions, oldest first, until `wanted` bytes are
    /// free or none is left. Returns the free bytes after.
    ///
    /// The records go under the index lock, counting each blob's size as freed, and each
    /// blob is renamed aside there: a `put` of the same bytes right after must find no file
    /// and write it again, never keep a file about to go. The unlinks, which free the
    /// extents of large files, run after the lock is released, so readers and writers of
    /// other artifacts do not wait for them.
    fn relieve(&self, wanted: u64) -> Option<u64> {
        let free = self.free_disk()?;
        let mut doomed = Vec::new();
        let mut removed = 0usize;
        {
            let mut index = self.index.write();
            let mut retained: Vec<(String, ArtifactId)> = index
                .records
                .iter()
                .filter(|(_, r)| r.expires.is_some() && matches!(r.blob, Blob::Stored(_)))
                .map(|(id, r)| (r.artifact.created.clone(), id.clone()))
                .collect();
            // `created` has a fixed width, so text order is time order.
            retained.sort();
            let mut freed = 0u64;
            for (_, id) in retained {
                if free.saturating_add(freed) >= wanted {
                    break;
                }
                let Some(record) = index.remove(&id) else {
                    continue;
                };
                self.unpersist(vec![id.to_string()]);
                removed += 1;
                if let Blob::Stored(sha) = &record.blob {
                    if index.release_blob(sha) {
                        let (path, aside) = (self.blob_path(sha), self.tmp_path("doomed"));
                        match std::fs::rename(&path, &aside) {
                            Ok(()) => {
                                freed = freed.saturating_add(record.artifact.bytes);
                                doomed.push(aside);
                            }
                            Err(err) => {
                                tracing::warn!(path = %path.display(), %err, "could not remove an artifact");
                            }
                        }
                    }
                }
            }
        }
        for path in &doomed {
            if let Err(err) = std::fs::remove_file(path) {
                tracing::warn!(path = %path.display(), %err, "could not remove an artifact");
            }
        }
        let free = if doomed.is_empty() {
            free
        } else {
            self.free_disk()?
        };
        if removed > 0 {
            tracing::info!(
                removed,
                free,
                min_free = self.min_free_disk,
                "disk low: removed retained artifacts of deleted sessions, oldest first"
            );
        }
        Some(free)
    }

    /// A fresh name beside the blobs for a file on its way in or out.
    fn tmp_path(&self, what: &str) -> PathBuf {
        self.dir
            .join(format!(".{what}-{}", uuid::Uuid::new_v4().simple()))
    }

    fn blob_path(&self, sha: &str) -> PathBuf {
        self.dir.join(&sha[..2]).join(sha)
    }

    /// Stores `content` and records an artifact for it. Blocking IO: call from a blocking
    /// context (`spawn_blocking`) for large content.
    pub fn put(
        &self,
        new: &NewArtifact<'_>,
        content: &[u8],
    ) -> Result<Arc<Artifact>, ArtifactError> {
        let sha = hex::encode(Sha256::digest(content));
        let description = Description::from_head(new, content, content.len() as u64);
        // Recorded first: a blob with a reference is never reaped, so the write below
        // cannot race with the removal of an identical blob.
        let bytes = description.bytes;
        let artifact = self.record(new, description, Blob::Stored(sha.clone()), bytes)?;
        let written = self.write_blob(&sha, content);
        self.written(bytes);
        if let Err(err) = written {
            self.forget(&artifact.id);
            return Err(err);
        }
        self.persist(&artifact, &sha);
        Ok(artifact)
    }

    /// Stores a file already on disk (streamed: never wholly in memory), at most `limit`
    /// bytes.
    pub fn put_reader(
        &self,
        new: &NewArtifact<'_>,
        reader: &mut dyn std::io::Read,
        limit: u64,
    ) -> Result<Arc<Artifact>, ArtifactError> {
        let io = |what: &str| {
            let what = what.to_owned();
            move |source| ArtifactError::Io { what, source }
        };
        let tmp_path = self
            .dir
            .join(format!(".tmp-{}", uuid::Uuid::new_v4().simple()));
        let mut tmp = std::fs::File::create(&tmp_path).map_err(io("create a temporary file"))?;
        let mut hasher = Sha256::new();
        let mut head = Vec::new();
        let mut size = 0u64;
        let mut buf = vec![0u8; 64 << 10];
        let result = (|| {
            loop {
                let n = reader.read(&mut buf).map_err(io("read the file"))?;
                if n == 0 {
                    break;
                }
                size += n as u64;
                if size > limit {
                    return Err(ArtifactError::TooLarge { size, limit });
                }
                hasher.update(&buf[..n]);
                if head.len() < 64 << 10 {
                    head.extend_from_slice(&buf[..n.min((64 << 10) - head.len())]);
                }
                tmp.write_all(&buf[..n]).map_err(io("write the artifact"))?;
            }
            Ok(())
        })();
        if let Err(err) = result {
            let _ = std::fs::remove_file(&tmp_path);
            return Err(err);
        }
        let sha = hex::encode(hasher.finalize());
        let description = Description::from_head(new, &head, size);
        // The temporary file is on the disk already: its bytes are in the free space read.
        let artifact = match self.record(new, description, Blob::Stored(sha.clone()), 0) {
            Ok(artifact) => artifact,
            Err(err) => {
                let _ = std::fs::remove_file(&tmp_path);
                return Err(err);
            }
        };
        let target = self.blob_path(&sha);
        let placed = std::fs::create_dir_all(target.parent().unwrap_or(&self.dir))
            .and_then(|_| std::fs::rename(&tmp_path, &target));
        if let Err(source) = placed {
            let _ = std::fs::remove_file(&tmp_path);
            self.forget(&artifact.id);
            return Err(ArtifactError::Io {
                what: "store the artifact".to_owned(),
                source,
            });
        }
        self.persist(&artifact, &sha);
        Ok(artifact)
    }

    fn write_blob(&self, sha: &str, content: &[u8]) -> Result<(), ArtifactError> {
        let target = self.blob_path(sha);
        if target.exists() {
            return Ok(());
        }
        let io = |what: &str| {
            let what = what.to_owned();
            move |source| ArtifactError::Io { what, source }
        };
        std::fs::create_dir_all(target.parent().unwrap_or(&self.dir))
            .map_err(io("create the artifact directory"))?;
        let tmp_path = self
            .dir
            .join(format!(".tmp-{}", uuid::Uuid::new_v4().simple()));
        let written = std::fs::File::create(&tmp_path)
            .and_then(|mut f| f.write_all(content))
            .and_then(|_| std::fs::rename(&tmp_path, &target));
        if let Err(source) = written {
            let _ = std::fs::remove_file(&tmp_path);
            return Err(ArtifactError::Io {
                what: "store the artifact".to_owned(),
                source,
            });
        }
        Ok(())
    }

    /// Records an artifact whose bytes are not stored yet: its reference can go out at once,
    /// and the returned [`Reservation`] stores the bytes (from any thread). Until then
    /// [`ArtifactStore::open`] waits for them.
    pub fn reserve(
        self: &Arc<Self>,
        new: &NewArtifact<'_>,
        description: Description,
    ) -> Result<(Arc<Artifact>, Reservation), ArtifactError> {
        let (done, pending) = watch::channel(false);
        let bytes = description.bytes;
        let artifact = self.record(new, description, Blob::Pending(pending), bytes)?;
        let reservation = Reservation {
            store: self.clone(),
            id: artifact.id.clone(),
            bytes,
            done,
            settled: false,
        };
        Ok((artifact, reservation))
    }

    /// Records an artifact once it fits under its quotas and the disk minimum; `to_write` is
    /// what is still to land on the disk (0 for a file already written there).
    fn record(
        &self,
        new: &NewArtifact<'_>,
        description: Description,
        blob: Blob,
        to_write: u64,
    ) -> Result<Arc<Artifact>, ArtifactError> {
        let Description {
            bytes,
            width,
            height,
            summary,
        } = description;
        // Quotas first: an artifact they refuse must not cost retained artifacts their place.
        Self::check_quotas(&self.index.read(), new, bytes)?;
        self.check_disk(to_write, true)?;
        let mut index = self.index.write();
        Self::check_quotas(&index, new, bytes)?;
        // Again under the lock, with what other writers have recorded since: two large
        // outputs checked at once must not both take the last of the disk.
        if self.min_free_disk > 0 && to_write > 0 {
            if let Some(free) = self.free_disk() {
                let wanted = self
                    .min_free_disk
                    .saturating_add(to_write)
                    .saturating_add(index.unwritten);
                if free < wanted {
                    return Err(ArtifactError::DiskLow {
                        free: free.saturating_sub(index.unwritten),
                        limit: self.min_free_disk,
                    });
                }
            }
        }
        index.unwritten = index.unwritten.saturating_add(to_write);
        let (version, previous) = match new.display_id {
            Some(display) => {
                let key = (
                    new.session.to_owned(),
                    display.to_owned(),
                    new.mime.to_owned(),
                );
                let previous = index.displays.get(&key).cloned();
                let version = previous
                    .as_ref()
                    .and_then(|p| index.records.get(p))
                    .map_or(1, |r| r.artifact.version + 1);
                (version, previous)
            }
            None => (1, None),
        };
        let artifact = Arc::new(Artifact {
            id: ArtifactId::random(),
            mime: new.mime.to_owned(),
            bytes,
            width,
            height,
            summary,
            origin: new.origin,
            execution_id: new.execution_id.cloned(),
            display_id: new.display_id.map(str::to_owned),
            version,
            previous,
            path: new.path.map(str::to_owned),
            created: crate::timestamp::format_timestamp(time::OffsetDateTime::now_utc()),
            session: new.session.to_owned(),
            owner: new.owner.map(str::to_owned),
        });
        if let Some(display) = new.display_id {
            index.displays.insert(
                (
                    new.session.to_owned(),
                    display.to_owned(),
                    new.mime.to_owned(),
                ),
                artifact.id.clone(),
            );
        }
        if let Blob::Stored(sha) = &blob {
            *index.blobs.entry(sha.clone()).or_default() += 1;
        }
        index.insert(Record {
            artifact: artifact.clone(),
            blob,
            expires: None,
            linkable: true,
        });
        Ok(artifact)
    }

    /// Drops a record whose blob could not be written.
    /// `bytes` recorded as unwritten are on the disk now, or will never be.
    fn written(&self, bytes: u64) {
        let mut index = self.index.write();
        index.unwritten = index.unwritten.saturating_sub(bytes);
    }

    fn forget(&self, id: &ArtifactId) {
        let mut index = self.index.write();
        if let Some(record) = index.remove(id) {
            if let Blob::Stored(sha) = &record.blob {
                if let Some(n) = index.blobs.get_mut(sha) {
                    *n = n.saturating_sub(1);
                }
            }
        }
        // Queued under the lock: see `persist`.
        self.unpersist(vec![id.to_string()]);
        drop(index);
    }

    /// An artifact a signed link may open: any record, retained ones included, unless a
    /// client deleted its session ([`Self::revoke_links`]).
    pub fn get_linkable(&self, id: &ArtifactId) -> Option<Arc<Artifact>> {
        self.index
            .read()
            .records
            .get(id)
            .filter(|r| r.linkable)
            .map(|r| r.artifact.clone())
    }

    /// A client deleted the session: no signed link opens its artifacts any more (the
    /// authenticated API keeps them for the retention period).
    pub fn revoke_links(&self, session: &str) {
        let mut index = self.index.write();
        for record in index.records.values_mut() {
            if record.artifact.session == session {
                record.linkable = false;
            }
        }
        // Queued under the lock: see `persist`.
        if let Some(store) = &self.persisted {
            store.expire_artifacts(session, unix_after(self.retention), true);
        }
        drop(index);
    }

    pub fn get(&self, id: &ArtifactId) -> Option<Arc<Artifact>> {
        self.index
            .read()
            .records
            .get(id)
            .map(|r| r.artifact.clone())
    }

    /// The file holding an artifact's bytes, once they are stored: waits for a pending
    /// artifact (at most `wait`). `Ok(None)`: no such artifact (never was, expired, or its
    /// bytes could not be stored).
    pub async fn open(
        &self,
        id: &ArtifactId,
        wait: Duration,
    ) -> Result<Option<(Arc<Artifact>, PathBuf)>, ArtifactError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let mut pending = {
                let index = self.index.read();
                let Some(record) = index.records.get(id) else {
                    return Ok(None);
                };
                match &record.blob {
                    Blob::Stored(sha) => {
                        return Ok(Some((record.artifact.clone(), self.blob_path(sha))))
                    }
                    Blob::Pending(pending) => pending.clone(),
                }
            };
            // A closed channel means the reservation settled: look again either way.
            let settled = tokio::time::timeout_at(deadline, pending.wait_for(|done| *done));
            if settled.await.is_err() {
                return Err(ArtifactError::NotReady(id.to_string()));
            }
        }
    }

    /// The file holding a stored artifact's bytes (`None` while pending or unknown).
    pub fn path_of(&self, id: &ArtifactId) -> Option<PathBuf> {
        match &self.index.read().records.get(id)?.blob {
            Blob::Stored(sha) => Some(self.blob_path(sha)),
            Blob::Pending(_) => None,
        }
    }

    /// Stores a reservation's bytes: hashes them, counts the blob reference before writing
    /// (so a concurrent reap of identical bytes keeps the file), writes, and only then marks
    /// the record stored. A record that went meanwhile (its session expired) leaves no blob.
    fn fill(&self, id: &ArtifactId, promised: u64, content: &[u8]) -> Result<(), ArtifactError> {
        if content.len() as u64 != promised {
            self.forget(id);
            return Err(ArtifactError::SizeMismatch {
                promised,
                got: content.len() as u64,
            });
        }
        let sha = hex::encode(Sha256::digest(content));
        {
            let mut index = self.index.write();
            if !index.records.contains_key(id) {
                return Ok(());
            }
            *index.blobs.entry(sha.clone()).or_default() += 1;
        }
        let written = self.write_blob(&sha, content);
        let mut index = self.index.write();
        let kept = written.is_ok() && index.records.contains_key(id);
        if kept {
            let stored = index.records.get_mut(id).map(|record| {
                record.blob = Blob::Stored(sha.clone());
                record.artifact.clone()
            });
            drop(index);
            if let Some(artifact) = stored {
                self.persist(&artifact, &sha);
            }
            return Ok(());
        }
        index.remove(id);
        self.unpersist(vec![id.to_string()]);
        if index.release_blob(&sha) {
            let _ = std::fs::remove_file(self.blob_path(&sha));
        }
        written
    }

    /// How many artifacts the store holds, and their bytes (each counted whole, though
    /// identical content is stored once).
    pub fn totals(&self) -> (usize, u64) {
        let index = self.index.read();
        (index.records.len(), index.tenant_bytes.values().sum())
    }

    /// A session's artifacts, oldest first.
    pub fn list(&self, session: &str) -> Vec<Arc<Artifact>> {
        let index = self.index.read();
        let mut out: Vec<_> = index
            .records
            .values()
            .filter(|r| r.artifact.session == session)
            .map(|r| r.artifact.clone())
            .collect();
        out.sort_by(|a, b| a.created.cmp(&b.created).then(a.id.cmp(&b.id)));
        out
    }

    /// The session ended: its artifacts stay for the retention period.
    pub fn expire_session(&self, session: &str) {
        let at = Instant::now() + self.retention;
        let mut index = self.index.write();
        for record in index.records.values_mut() {
            if record.artifact.session == session && record.expires.is_none() {
                record.expires = Some(at);
            }
        }
        index.displays.retain(|(s, _, _), _| s != session);
        // Queued under the lock: see `persist`.
        if let Some(store) = &self.persisted {
            store.expire_artifacts(session, unix_after(self.retention), false);
        }
        drop(index);
    }

    /// Removes expired artifacts, and blobs no artifact uses any more.
    pub fn reap(&self) {
        let now = Instant::now();
        let mut unused = Vec::new();
        // Blobs are removed under the lock: a concurrent `put` of the same bytes either
        // counted its reference before (the blob stays) or writes the blob again after.
        let mut index = self.index.write();
        {
            let expired: Vec<ArtifactId> = index
                .records
                .iter()
                .filter(|(_, r)| r.expires.is_some_and(|e| e <= now))
                .map(|(id, _)| id.clone())
                .collect();
            self.unpersist(expired.iter().map(ToString::to_string).collect());
            for id in expired {
                if let Some(record) = index.remove(&id) {
                    // A pending record counts no blob yet; its reservation cleans up.
                    let Blob::Stored(sha) = &record.blob else {
                        continue;
                    };
                    if index.release_blob(sha) {
                        unused.push(sha.clone());
                    }
                }
            }
        }
        for sha in unused {
            if index.blobs.contains_key(&sha) {
                continue;
            }
            let path = self.blob_path(&sha);
            if let Err(err) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), %err, "could not remove an artifact");
            }
        }
        drop(index);
        // Under disk pressure, retained artifacts go before their time.
        if self.min_free_disk > 0 {
            if let Some(free) = self.free_disk() {
                if free < self.min_free_disk {
                    self.relieve(self.min_free_disk);
                }
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The right to store one recorded artifact's bytes (see [`ArtifactStore::reserve`]).
/// Dropped without [`Reservation::fill`], the artifact is removed.
pub struct Reservation {
    store: Arc<ArtifactStore>,
    id: ArtifactId,
    bytes: u64,
    done: watch::Sender<bool>,
    settled: bool,
}

impl Reservation {
    /// The artifact's id.
    pub fn id(&self) -> &ArtifactId {
        &self.id
    }

    /// Stores the bytes (blocking IO: call from a blocking context). Content of another
    /// size than the reference announced is refused and the artifact removed.
    pub fn fill(mut self, content: &[u8]) -> Result<(), ArtifactError> {
        let result = self.store.fill(&self.id, self.bytes, content);
        self.store.written(self.bytes);
        self.settled = true;
        self.done.send_replace(true);
        result
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.store.written(self.bytes);
            self.store.forget(&self.id);
            self.done.send_replace(true);
        }
    }
}

#[cfg(test)]
mod tests;
