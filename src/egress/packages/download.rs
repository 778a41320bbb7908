//! Upstream files streamed to pip while they download, once for every session that asks.
//!
//! A download runs in a task of its own, so a client that hangs up stops nothing for the
//! others: it writes to a temporary file in the cache directory, hashing as it goes, and
//! publishes its progress (queued, bytes written, upstream's length, finished or failed)
//! through a `watch` channel. Every client asking for the same file (the same digest:
//! PyPI's sha256, npm's sha512) meanwhile joins it
//! (single flight) and streams the temporary file as it grows ([`FileBody`]), with
//! upstream's `Content-Length`, so pip shows real progress and gateway memory does not grow
//! with the file. The file is renamed into the cache (named by its digest, and hashed again
//! once per process when it is next served from there) only when the hash matched; on a
//! mismatch or a broken transfer it is deleted and every client's body ends in an error. A
//! client never receives a file's last byte before its hash matched, so pip never holds a
//! whole, unverified file.
//!
//! Limits, so that a hostile kernel cannot make the gateway download for nobody, hold the
//! slots other tenants wait for, or fill the disk:
//! - A flight lives only while it has clients: each client holds an `Arc<Flight>` (its
//!   body does, until the file is whole). When the last one goes (pip hung up, a `HEAD`
//!   never starts one), a queued flight is dropped and a running one aborted: its upstream
//!   connection closed, its temporary file removed, nothing cached.
//! - At most [`MAX_DOWNLOADS`] upstream downloads run at once; the others wait for a slot,
//!   and a flight opens its temporary file (two descriptors) only once it holds one. How
//!   long a client waits for a slot is bounded by the index (see `mod.rs`: [`SLOT_WAIT`],
//!   then 503 with `Retry-After`), as is how many flights one session may wait for or run.
//! - A file is at most its listing's `size` (PEP 700) when upstream gives one, and never
//!   more than [`MAX_FILE_SIZE`]; a longer (or shorter) transfer fails and caches nothing.
//! - A download starts only if the cache's disk keeps [`FREE_MARGIN`] free beyond the file
//!   and beyond what the downloads under way still have to write; a file of unknown size
//!   checks again every [`RECHECK_EVERY`] bytes.
//!
//! Timeouts are stall timeouts (no byte for [`STALL`]): a slow download that moves is never
//! cut.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use parking_lot::Mutex;
use sha2::{Digest, Sha256, Sha512};
use tokio::io::AsyncWriteExt;
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};

use super::super::proxy::{Body, BodyError};

/// How long an upstream may send nothing before its download fails (pip's own read
/// timeout in the sandbox is 60 s, so the gateway gives up first and says why).
pub const STALL: Duration = Duration::from_secs(30);
/// Upstream file downloads at once; more wait for a slot (each costs a connection, a
/// temporary file and a write buffer).
pub const MAX_DOWNLOADS: usize = 4;
/// How long a client waits for its flight to get a slot: well under pip's 60 s read
/// timeout, so that pip gets a 503 it retries (with `Retry-After`) instead of a timeout it
/// reports as a failure.
pub const SLOT_WAIT: Duration = Duration::from_secs(30);
/// The largest file the gateway downloads, listed size or not. The largest wheels on PyPI
/// (CUDA builds of torch and friends) are a few GiB; anything beyond this is a broken or
/// hostile upstream, and letting it run would fill the cache's disk, which is often the
/// disk of the runtime directory and the artifacts too.
pub const MAX_FILE_SIZE: u64 = 4 << 30;
/// Free space a download leaves on the cache's disk beyond its file (and beyond what the
/// other downloads still have to write), for everything else on that disk.
pub const FREE_MARGIN: u64 = 1 << 30;
/// A file of unknown size checks the disk's free space again after this many bytes.
pub const RECHECK_EVERY: u64 = 64 << 20;
/// Bytes gathered before a write to the temporary file (and a progress update).
const WRITE_BUFFER: usize = 256 << 10;
/// Bytes a client reads from the file at a time.
const READ_CHUNK: usize = 64 << 10;

/// Why a download failed; every client of it gets this as its body's error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DownloadError {
    #[error("upstream {url}: {reason}")]
    Upstream { url: String, reason: String },
    #[error("{what}: {reason}")]
    Io { what: String, reason: String },
    #[error("{filename}: {algorithm} {got} does not match the index's {want}")]
    HashMismatch {
        filename: String,
        algorithm: &'static str,
        got: String,
        want: String,
    },
    #[error("{filename}: {reason}")]
    Size { filename: String, reason: String },
    #[error(
        "{filename}: the package cache's disk has {free} bytes free; downloading it needs {need} \
         (its size, what other downloads still write, and a {FREE_MARGIN}-byte margin)"
    )]
    DiskFull {
        filename: String,
        free: u64,
        need: u64,
    },
    #[error("every client of the download hung up")]
    Cancelled,
    #[error("the download ended before its end (the gateway dropped it)")]
    Abandoned,
}

/// Where a download is.
#[derive(Debug, Clone)]
pub enum State {
    /// Waiting for a slot (no temporary file yet).
    Queued,
    /// Holding a slot, waiting for upstream's response headers.
    Starting,
    /// Bytes arriving.
    Receiving,
    /// Hash matched; the file is in the cache.
    Done,
    /// The temporary file is gone; nothing was cached.
    Failed(Arc<DownloadError>),
}

/// A download's progress, as its clients see it.
#[derive(Debug, Clone)]
pub struct Progress {
    /// The temporary file, readable (positional reads, so clients share it without a
    /// shared position; it stays readable after the rename), from `Receiving` on.
    pub file: Option<Arc<std::fs::File>>,
    /// Bytes in the temporary file, readable.
    pub written: u64,
    /// Upstream's `Content-Length`, once its headers arrived.
    pub length: Option<u64>,
    pub state: State,
}

/// A download clients can join. Every client holds an `Arc` of it for as long as it
/// wants the download: when the last one is dropped, the download stops.
pub struct Flight {
    pub progress: watch::Receiver<Progress>,
    /// Never sent on: its drop (with the flight) tells the download's task that nobody
    /// wants the file any more.
    _wanted: oneshot::Sender<()>,
}

/// What [`Downloads::join`] found.
pub enum Joined {
    /// The file is in the cache (a download finished meanwhile), open.
    Cached(std::fs::File),
    Flight(Arc<Flight>),
}

/// What a download needs to know of its file.
pub struct Wanted {
    pub url: String,
    pub digest: FileDigest,
    pub filename: String,
    /// The listing's size (PEP 700), when upstream gave one.
    pub size: Option<u64>,
}

/// What a file must hash to, as its index says: PyPI's sha256 or npm's sha512 (a
/// packument's `integrity`). Also the file's name in the cache.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FileDigest {
    /// Hex, lower case.
    Sha256(String),
    /// Hex, lower case.
    Sha512(String),
}

impl FileDigest {
    /// The file's name in the cache: a sha256 alone (as it was before npm came), a sha512
    /// as `sha512-<hex>`.
    pub fn key(&self) -> String {
        match self {
            FileDigest::Sha256(hex) => hex.clone(),
            FileDigest::Sha512(hex) => format!("sha512-{hex}"),
        }
    }

    fn hex(&self) -> &str {
        match self {
            FileDigest::Sha256(hex) | FileDigest::Sha512(hex) => hex,
        }
    }

    fn algorithm(&self) -> &'static str {
        match self {
            FileDigest::Sha256(_) => "sha256",
            FileDigest::Sha512(_) => "sha512",
        }
    }

    fn hasher(&self) -> FileHasher {
        match self {
            FileDigest::Sha256(_) => FileHasher::Sha256(Sha256::new()),
            FileDigest::Sha512(_) => FileHasher::Sha512(Sha512::new()),
        }
    }

    /// Whether `name` is a cache key (`.<key>.<id>` is a download's temporary file).
    fn is_key(name: &str) -> bool {
        let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
        hex(name, 64) || name.strip_prefix("sha512-").is_some_and(|h| hex(h, 128))
    }
}

enum FileHasher {
    Sha256(Sha256),
    Sha512(Sha512),
}

impl FileHasher {
    fn update(&mut self, bytes: &[u8]) {
        match self {
            FileHasher::Sha256(h) => h.update(bytes),
            FileHasher::Sha512(h) => h.update(bytes),
        }
    }

    fn hex(self) -> String {
        match self {
            FileHasher::Sha256(h) => hex::encode(h.finalize()),
            FileHasher::Sha512(h) => hex::encode(h.finalize()),
        }
    }
}

impl std::io::Write for FileHasher {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How the free space of the cache's disk is read (statvfs; unit tests give their own).
type FreeSpace = Box<dyn Fn(&Path) -> std::io::Result<u64> + Send + Sync>;

fn statvfs_free(dir: &Path) -> std::io::Result<u64> {
    let stat = rustix::fs::statvfs(dir)?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// The downloads of a gateway, shared by every session.
pub struct Downloads {
    client: reqwest::Client,
    cache_dir: PathBuf,
    /// Flights by cache key, with their id (a flight's task removes its own entry only). The
    /// map does not keep a flight alive: its clients do.
    running: Mutex<HashMap<String, (u64, Weak<Flight>)>>,
    next_id: AtomicU64,
    slots: Semaphore,
    /// Bytes the running downloads still expect to write (reserved on the disk).
    reserved: Mutex<u64>,
    free_space: FreeSpace,
    /// Cache files whose hash was checked by this process (or that it wrote).
    verified: Mutex<HashSet<String>>,
}

/// Disk space a download reserved and has not written yet; given back as it writes, and
/// all of it when the download ends.
struct Reservation<'a> {
    downloads: &'a Downloads,
    left: u64,
}

impl Reservation<'_> {
    fn written(&mut self, bytes: u64) {
        let bytes = bytes.min(self.left);
        self.left -= bytes;
        let mut reserved = self.downloads.reserved.lock();
        *reserved = reserved.saturating_sub(bytes);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut reserved = self.downloads.reserved.lock();
        *reserved = reserved.saturating_sub(self.left);
    }
}

impl Downloads {
    pub fn new(client: reqwest::Client, cache_dir: PathBuf) -> Arc<Downloads> {
        Downloads::with_free_space(client, cache_dir, Box::new(statvfs_free))
    }

    fn with_free_space(
        client: reqwest::Client,
        cache_dir: PathBuf,
        free_space: FreeSpace,
    ) -> Arc<Downloads> {
        Arc::new(Downloads {
            client,
            cache_dir,
            running: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            slots: Semaphore::new(MAX_DOWNLOADS),
            reserved: Mutex::new(0),
            free_space,
            verified: Mutex::new(HashSet::new()),
        })
    }

    /// Where the file is (or would be) in the cache.
    pub fn path_of(&self, digest: &FileDigest) -> PathBuf {
        self.cache_dir.join(digest.key())
    }

    /// The cached file if it is there and whole (hashed once per process; a corrupt one
    /// is deleted so that it is fetched again).
    pub async fn cached_file(&self, digest: &FileDigest) -> Option<std::fs::File> {
        let path = self.path_of(digest);
        let file = std::fs::File::open(&path).ok()?;
        let key = digest.key();
        if self.verified.lock().contains(&key) {
            return Some(file);
        }
        let mut hasher = digest.hasher();
        let (file, got) = tokio::task::spawn_blocking(move || {
            std::io::copy(&mut &file, &mut hasher).ok()?;
            Some((file, hasher.hex()))
        })
        .await
        .ok()??;
        if got == digest.hex() {
            self.verified.lock().insert(key);
            return Some(file);
        }
        tracing::warn!(file = %path.display(), "cached package file is corrupt; fetching it again");
        let _ = std::fs::remove_file(&path);
        None
    }

    /// The length of the cached file, if there is one (not hashed: for `HEAD`, which
    /// serves no bytes).
    pub fn cached_length(&self, digest: &FileDigest) -> Option<u64> {
        std::fs::metadata(self.path_of(digest))
            .ok()
            .filter(|m| m.is_file())
            .map(|m| m.len())
    }

    /// The download of `wanted`: the one under way, or a new one (queued for a slot; it
    /// lives as long as the returned flight or another client's), or the cached file if a
    /// download finished meanwhile. A file listed larger than [`MAX_FILE_SIZE`] is refused.
    pub fn join(self: &Arc<Self>, wanted: Wanted) -> Result<Joined, DownloadError> {
        if let Some(size) = wanted.size.filter(|&size| size > MAX_FILE_SIZE) {
            return Err(DownloadError::Size {
                filename: wanted.filename,
                reason: format!(
                    "the index lists {size} bytes, more than the {MAX_FILE_SIZE} the gateway downloads"
                ),
            });
        }
        let mut running = self.running.lock();
        // A flight whose last client left is on its way out (its entry stays until its task
        // ends): it cannot be joined, a new one starts.
        if let Some(flight) = running
            .get(&wanted.digest.key())
            .and_then(|(_, flight)| flight.upgrade())
        {
            return Ok(Joined::Flight(flight));
        }
        // A download removes itself from the map only after its rename: not running and
        // not cached means nobody has it.
        if self.verified.lock().contains(&wanted.digest.key()) {
            if let Ok(file) = std::fs::File::open(self.path_of(&wanted.digest)) {
                return Ok(Joined::Cached(file));
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (wanted_tx, wanted_rx) = oneshot::channel();
        let (tx, rx) = watch::channel(Progress {
            file: None,
            written: 0,
            length: None,
            state: State::Queued,
        });
        let flight = Arc::new(Flight {
            progress: rx,
            _wanted: wanted_tx,
        });
        running.insert(wanted.digest.key(), (id, Arc::downgrade(&flight)));
        drop(running);
        tokio::spawn(self.clone().run(wanted, id, wanted_rx, tx));
        Ok(Joined::Flight(flight))
    }

    async fn run(
        self: Arc<Self>,
        wanted: Wanted,
        id: u64,
        mut still_wanted: oneshot::Receiver<()>,
        tx: watch::Sender<Progress>,
    ) {
        let tmp = self.cache_dir.join(format!(
            ".{}.{}",
            wanted.digest.key(),
            uuid::Uuid::new_v4().simple()
        ));
        // Dropping `fetch` (its last client left) drops its slot, its upstream response and
        // its writer, whatever it was waiting for.
        let result = tokio::select! {
            biased;
            result = self.fetch(&wanted, &tmp, &tx) => result,
            // Never sent on: resolves when the flight (held by its clients only) is dropped.
            _ = &mut still_wanted => Err(DownloadError::Cancelled),
        };
        match &result {
            Ok(()) => {
                self.verified.lock().insert(wanted.digest.key());
            }
            Err(err) => {
                if matches!(err, DownloadError::Cancelled) {
                    tracing::info!(file = %wanted.filename, "package download dropped: every client hung up");
                } else {
                    tracing::warn!(file = %wanted.filename, %err, "package download failed");
                }
                // NotFound when the flight never got as far as its file.
                let _ = tokio::fs::remove_file(&tmp).await;
            }
        }
        // Out of the map before the final state is published: a client that comes after
        // the failure starts afresh, one after the success finds the cache. Only this
        // flight's entry: a new flight may have replaced a cancelled one.
        {
            let mut running = self.running.lock();
            let key = wanted.digest.key();
            if running.get(&key).is_some_and(|(i, _)| *i == id) {
                running.remove(&key);
            }
        }
        tx.send_modify(|p| {
            p.state = match result {
                Ok(()) => State::Done,
                Err(err) => State::Failed(Arc::new(err)),
            }
        });
    }

    /// A slot, then the download, then the rename into the cache.
    async fn fetch(
        &self,
        wanted: &Wanted,
        tmp: &Path,
        tx: &watch::Sender<Progress>,
    ) -> Result<(), DownloadError> {
        // Err only if the semaphore is closed, which it never is.
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| DownloadError::Abandoned)?;
        tx.send_modify(|p| p.state = State::Starting);
        self.download(wanted, tmp, tx).await?;
        tokio::fs::rename(tmp, self.path_of(&wanted.digest))
            .await
            .map_err(|e| DownloadError::Io {
                what: format!("rename {}", tmp.display()),
                reason: e.to_string(),
            })
    }

    /// Reserves `more` bytes of the cache's disk for `reservation`, if the disk keeps
    /// [`FREE_MARGIN`] beyond them and beyond every download's reservation.
    fn reserve(
        &self,
        reservation: &mut Reservation<'_>,
        more: u64,
        filename: &str,
    ) -> Result<(), DownloadError> {
        let free = (self.free_space)(&self.cache_dir).map_err(|e| DownloadError::Io {
            what: format!("free space of {}", self.cache_dir.display()),
            reason: e.to_string(),
        })?;
        let mut reserved = self.reserved.lock();
        let need = reserved.saturating_add(more).saturating_add(FREE_MARGIN);
        if free < need {
            return Err(DownloadError::DiskFull {
                filename: filename.to_owned(),
                free,
                need,
            });
        }
        *reserved += more;
        reservation.left += more;
        Ok(())
    }

    async fn download(
        &self,
        wanted: &Wanted,
        tmp: &Path,
        tx: &watch::Sender<Progress>,
    ) -> Result<(), DownloadError> {
        let mut reservation = Reservation {
            downloads: self,
            left: 0,
        };
        let (mut response, length) = self.request(wanted, &mut reservation).await?;
        let writer = open_for_clients(tmp, length, tx)?;
        let (written, got) = self
            .receive(wanted, &mut response, writer, length, &mut reservation, tx)
            .await?;
        if let Some(length) = length.filter(|&l| l != written) {
            return Err(
                wanted.upstream_error(format!("sent {written} bytes of the {length} it announced"))
            );
        }
        if let Some(size) = wanted.size.filter(|&s| s != written) {
            return Err(wanted.size_error(format!(
                "upstream sent {written} bytes, the index lists {size}"
            )));
        }
        if got != wanted.digest.hex() {
            return Err(DownloadError::HashMismatch {
                filename: wanted.filename.clone(),
                algorithm: wanted.digest.algorithm(),
                got,
                want: wanted.digest.hex().to_owned(),
            });
        }
        Ok(())
    }

    /// Asks upstream for the file, with the disk reserved for it; the response and the
    /// length it announces (checked against the index's and the hard cap).
    async fn request(
        &self,
        wanted: &Wanted,
        reservation: &mut Reservation<'_>,
    ) -> Result<(reqwest::Response, Option<u64>), DownloadError> {
        // Before asking upstream: a full disk costs no connection.
        self.reserve(reservation, wanted.size.unwrap_or(0), &wanted.filename)?;
        // The client's read timeout is the stall timeout; there is no total one.
        let response = self
            .client
            .get(&wanted.url)
            .send()
            .await
            .map_err(|e| wanted.upstream_error(e.to_string()))?;
        if !response.status().is_success() {
            return Err(wanted.upstream_error(response.status().to_string()));
        }
        let length = response.content_length();
        match (length, wanted.size) {
            (Some(length), Some(size)) if length != size => {
                return Err(wanted.size_error(format!(
                    "upstream announces {length} bytes, the index lists {size}"
                )));
            }
            (Some(length), _) if length > wanted.limit() => {
                return Err(wanted.size_error(format!(
                    "upstream announces {length} bytes, more than the {MAX_FILE_SIZE} the gateway downloads"
                )));
            }
            (Some(length), None) => self.reserve(reservation, length, &wanted.filename)?,
            _ => {}
        }
        Ok((response, length))
    }

    /// Writes the body to `writer` as it comes, telling clients what is written; the bytes
    /// written and their digest (hex, of the algorithm `wanted` names).
    async fn receive(
        &self,
        wanted: &Wanted,
        response: &mut reqwest::Response,
        mut writer: tokio::fs::File,
        length: Option<u64>,
        reservation: &mut Reservation<'_>,
        tx: &watch::Sender<Progress>,
    ) -> Result<(u64, String), DownloadError> {
        let write_err = |e: std::io::Error| DownloadError::Io {
            what: format!("write the download of {}", wanted.filename),
            reason: e.to_string(),
        };
        let recheck = wanted.size.or(length).is_none();
        let mut hasher = wanted.digest.hasher();
        let mut buffer = Vec::with_capacity(WRITE_BUFFER);
        let (mut received, mut written, mut checked) = (0u64, 0u64, 0u64);
        loop {
            let chunk = response
                .chunk()
                .await
                .map_err(|e| wanted.upstream_error(e.to_string()))?;
            let last = chunk.is_none();
            if let Some(chunk) = &chunk {
                received += chunk.len() as u64;
                if received > wanted.limit() {
                    return Err(wanted.size_error(match wanted.size {
                        Some(size) => {
                            format!("upstream sent more than the {size} bytes the index lists")
                        }
                        None => format!(
                            "upstream sent more than the {MAX_FILE_SIZE} bytes the gateway downloads"
                        ),
                    }));
                }
                hasher.update(chunk);
                buffer.extend_from_slice(chunk);
            }
            if buffer.len() >= WRITE_BUFFER || (last && !buffer.is_empty()) {
                if recheck && written - checked >= RECHECK_EVERY {
                    self.reserve(reservation, 0, &wanted.filename)?;
                    checked = written;
                }
                writer.write_all(&buffer).await.map_err(write_err)?;
                // tokio's file writes in the background: flushed, the bytes are in the
                // file before clients are told they are.
                writer.flush().await.map_err(write_err)?;
                written += buffer.len() as u64;
                reservation.written(buffer.len() as u64);
                buffer.clear();
                tx.send_modify(|p| p.written = written);
            }
            if last {
                return Ok((written, hasher.hex()));
            }
        }
    }
}

/// Creates the download's file and hands clients a reader of it. Only now, with a slot and
/// upstream's answer: a flight that waits holds no descriptor.
fn open_for_clients(
    tmp: &Path,
    length: Option<u64>,
    tx: &watch::Sender<Progress>,
) -> Result<tokio::fs::File, DownloadError> {
    let io = |source: std::io::Error| DownloadError::Io {
        what: format!("create {}", tmp.display()),
        reason: source.to_string(),
    };
    let writer = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(io)?;
    let reader = std::fs::File::open(tmp).map_err(io)?;
    tx.send_modify(|p| {
        p.file = Some(Arc::new(reader));
        p.length = length;
        p.state = State::Receiving;
    });
    Ok(tokio::fs::File::from_std(writer))
}

impl Wanted {
    /// The most this file may be: what the index lists, else the hard cap.
    fn limit(&self) -> u64 {
        self.size.unwrap_or(MAX_FILE_SIZE)
    }

    fn upstream_error(&self, reason: String) -> DownloadError {
        DownloadError::Upstream {
            url: self.url.clone(),
            reason,
        }
    }

    fn size_error(&self, reason: String) -> DownloadError {
        DownloadError::Size {
            filename: self.filename.clone(),
            reason,
        }
    }
}

/// What runs once a served file is whole and verified (with the file).
pub type OnComplete = Box<dyn FnOnce(&std::fs::File) + Send + Sync>;

/// A response body read from a file: a whole one (`progress` is `None`), or one a
/// download is still writing, followed as it grows. Until the download is verified, the
/// last byte written is held back, so a client never has a whole unverified file; if it
/// fails, the body ends in its error.
pub struct FileBody {
    pub file: Arc<std::fs::File>,
    /// The whole file's length, when it is whole.
    pub length: u64,
    pub progress: Option<watch::Receiver<Progress>>,
    /// Runs once the file is whole and verified, before the client gets its last byte
    /// (the index records a wheel's dependencies there).
    pub on_complete: Option<OnComplete>,
    /// The download this body follows, kept alive by it until the file is whole: a client
    /// that hangs up drops its body, and the last one's drop stops the download.
    pub flight: Option<Arc<Flight>>,
    /// The session's share of downloads (see `mod.rs`), held as long as `flight`.
    pub session_slot: Option<OwnedSemaphorePermit>,
}

impl FileBody {
    /// The next chunk, `None` at the end.
    async fn next(&mut self, offset: &mut u64) -> Option<Result<Bytes, BodyError>> {
        loop {
            let (end, whole) = match &mut self.progress {
                None => (self.length, true),
                Some(rx) => {
                    let progress = rx.borrow_and_update().clone();
                    match progress.state {
                        State::Failed(err) => return Some(Err(Box::new((*err).clone()))),
                        State::Done => (progress.written, true),
                        State::Queued | State::Starting | State::Receiving => {
                            (progress.written.saturating_sub(1), false)
                        }
                    }
                }
            };
            if whole {
                // The download is over: nothing to keep alive, and the session's share is
                // free for its next one while this client reads the rest.
                self.flight = None;
                self.session_slot = None;
                if let Some(hook) = self.on_complete.take() {
                    let file = self.file.clone();
                    let _ = tokio::task::spawn_blocking(move || hook(&file)).await;
                }
            }
            if *offset < end {
                let len = (end - *offset).min(READ_CHUNK as u64) as usize;
                let (file, at) = (self.file.clone(), *offset);
                let read = tokio::task::spawn_blocking(move || {
                    let mut buf = vec![0; len];
                    file.read_exact_at(&mut buf, at).map(|()| buf)
                })
                .await;
                return Some(match read {
                    Ok(Ok(buf)) => {
                        *offset += len as u64;
                        Ok(Bytes::from(buf))
                    }
                    Ok(Err(err)) => Err(Box::new(err)),
                    Err(err) => Err(Box::new(err)),
                });
            }
            if whole {
                return None;
            }
            let Some(rx) = &mut self.progress else {
                return None;
            };
            if rx.changed().await.is_err() {
                // The download's task is gone without a final state (the runtime is
                // shutting down): the file is not known to be whole.
                return Some(Err(Box::new(DownloadError::Abandoned)));
            }
        }
    }

    pub fn into_body(self) -> Body {
        use hyper::body::Frame;
        // `None` once an error was sent: nothing follows it, not even a clean end.
        let stream = futures_util::stream::unfold(Some((self, 0u64)), |state| async move {
            let (mut body, mut offset) = state?;
            match body.next(&mut offset).await? {
                Ok(bytes) => Some((Ok(Frame::data(bytes)), Some((body, offset)))),
                Err(err) => Some((Err(err), None)),
            }
        });
        http_body_util::StreamBody::new(stream).boxed()
    }
}

/// Temporary files of downloads no process is writing any more (`.<key>.<id>`, not
/// written to for an hour, far beyond [`STALL`]): left by a gateway that stopped
/// mid-download, removed when one starts. Another gateway's download under way in a
/// shared cache directory is younger than that.
pub fn stale_temporaries(cache_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(cache_dir) else {
        return vec![];
    };
    let old = |path: &Path| {
        std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > Duration::from_secs(3600))
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix('.'))
                .and_then(|n| n.split_once('.'))
                .is_some_and(|(key, _)| FileDigest::is_key(key))
                && old(p)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use std::io::Write;
    use tokio::io::AsyncWriteExt;

    fn body_of(bytes: &[u8], state: State) -> (FileBody, watch::Sender<Progress>) {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(bytes).unwrap();
        let (tx, rx) = watch::channel(Progress {
            file: None,
            written: bytes.len() as u64,
            length: Some(bytes.len() as u64),
            state,
        });
        let body = FileBody {
            file: Arc::new(file),
            length: 0,
            progress: Some(rx),
            on_complete: None,
            flight: None,
            session_slot: None,
        };
        (body, tx)
    }

    #[tokio::test]
    async fn the_last_byte_waits_for_the_hash_and_a_failure_ends_the_body() {
        let (mut body, tx) = body_of(b"0123456789", State::Receiving);
        let mut offset = 0;
        let chunk = body.next(&mut offset).await.unwrap().unwrap();
        assert_eq!(&chunk[..], b"012345678", "all but the last byte");
        assert!(
            body.next(&mut offset).now_or_never().is_none(),
            "the last byte waits while the download is unverified"
        );
        tx.send_modify(|p| {
            p.state = State::Failed(Arc::new(DownloadError::HashMismatch {
                filename: "x.whl".into(),
                algorithm: "sha256",
                got: "a".into(),
                want: "b".into(),
            }))
        });
        let err = body.next(&mut offset).await.unwrap().unwrap_err();
        assert!(err.to_string().contains("does not match"), "{err}");
    }

    #[tokio::test]
    async fn a_verified_download_ends_after_the_hook_has_run() {
        let (mut body, tx) = body_of(b"0123456789", State::Receiving);
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        body.on_complete = Some(Box::new(move |file| {
            assert_eq!(file.metadata().unwrap().len(), 10);
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        }));
        let mut offset = 0;
        body.next(&mut offset).await.unwrap().unwrap();
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
        tx.send_modify(|p| p.state = State::Done);
        let last = body.next(&mut offset).await.unwrap().unwrap();
        assert_eq!(&last[..], b"9");
        assert!(
            ran.load(std::sync::atomic::Ordering::SeqCst),
            "before the last byte"
        );
        assert!(body.next(&mut offset).await.is_none());
    }

    /// An upstream on 127.0.0.1 that answers every request with `body` (with a
    /// `Content-Length` if `announce`), sending `first` bytes, then the rest once
    /// `release` is notified. `hung_up` is sent on when a client closes a connection it
    /// still held.
    struct TestUpstream {
        url: String,
        release: Arc<tokio::sync::Notify>,
        hung_up: tokio::sync::mpsc::UnboundedReceiver<()>,
        requests: Arc<AtomicU64>,
    }

    async fn test_upstream(body: Vec<u8>, first: usize, announce: bool) -> TestUpstream {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/f.whl", listener.local_addr().unwrap());
        let release = Arc::new(tokio::sync::Notify::new());
        let (hung_tx, hung_up) = tokio::sync::mpsc::unbounded_channel();
        let requests = Arc::new(AtomicU64::new(0));
        let (body, notify, count) = (Arc::new(body), release.clone(), requests.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let (body, notify, hung_tx) = (body.clone(), notify.clone(), hung_tx.clone());
                tokio::spawn(async move {
                    let mut seen = vec![];
                    let mut buf = [0u8; 1024];
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = if announce {
                        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len())
                    } else {
                        "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".to_owned()
                    };
                    let first = first.min(body.len());
                    if stream.write_all(head.as_bytes()).await.is_err()
                        || stream.write_all(&body[..first]).await.is_err()
                    {
                        return;
                    }
                    tokio::select! {
                        _ = notify.notified() => {
                            let _ = stream.write_all(&body[first..]).await;
                            let _ = stream.shutdown().await;
                        }
                        // The client sends nothing more: a read ends only when it closes.
                        _ = stream.read(&mut buf) => {
                            let _ = hung_tx.send(());
                        }
                    }
                });
            }
        });
        TestUpstream {
            url,
            release,
            hung_up,
            requests,
        }
    }

    fn downloads(dir: &Path, free: u64) -> Arc<Downloads> {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        Downloads::with_free_space(client, dir.to_owned(), Box::new(move |_| Ok(free)))
    }

    fn wanted(url: &str, body: &[u8], size: Option<u64>) -> Wanted {
        Wanted {
            url: url.to_owned(),
            digest: FileDigest::Sha256(hex::encode(Sha256::digest(body))),
            filename: "f-1.0-py3-none-any.whl".into(),
            size,
        }
    }

    fn flight(joined: Joined) -> Arc<Flight> {
        match joined {
            Joined::Flight(flight) => flight,
            Joined::Cached(_) => panic!("cached"),
        }
    }

    fn entries(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// Waits (generously) until `done` holds.
    async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn final_state(flight: &Flight) -> State {
        let mut rx = flight.progress.clone();
        let state = rx
            .wait_for(|p| matches!(p.state, State::Done | State::Failed(_)))
            .await
            .unwrap()
            .state
            .clone();
        state
    }

    #[tokio::test]
    async fn a_queued_flight_whose_clients_left_is_dropped_before_it_opens_anything() {
        let dir = tempfile::tempdir().unwrap();
        let body = vec![7u8; 1000];
        let mut upstream = test_upstream(body.clone(), 1000, true).await;
        let downloads = downloads(dir.path(), u64::MAX);
        // Every slot taken: the flight queues.
        let slots = downloads
            .slots
            .acquire_many(MAX_DOWNLOADS as u32)
            .await
            .unwrap();
        let queued = flight(downloads.join(wanted(&upstream.url, &body, None)).unwrap());
        let second = flight(downloads.join(wanted(&upstream.url, &body, None)).unwrap());
        assert!(Arc::ptr_eq(&queued, &second), "one flight per file");
        assert!(matches!(queued.progress.borrow().state, State::Queued));
        assert!(
            entries(dir.path()).is_empty(),
            "no temporary file while queued"
        );
        drop((queued, second));
        eventually("the flight is gone", || downloads.running.lock().is_empty()).await;
        drop(slots);
        // Nothing reached upstream, and the slots are all free.
        assert_eq!(upstream.requests.load(Ordering::SeqCst), 0);
        assert_eq!(downloads.slots.available_permits(), MAX_DOWNLOADS);
        // The same file again: a new flight, which completes.
        let again = flight(downloads.join(wanted(&upstream.url, &body, None)).unwrap());
        upstream.release.notify_one();
        assert!(matches!(final_state(&again).await, State::Done));
        assert_eq!(entries(dir.path()), [hex::encode(Sha256::digest(&body))]);
        assert!(upstream.hung_up.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_running_flight_whose_last_client_left_is_aborted_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let body: Vec<u8> = (0..2_000_000u32).map(|i| i as u8).collect();
        let mut upstream = test_upstream(body.clone(), 600_000, true).await;
        let downloads = downloads(dir.path(), u64::MAX);
        let a = flight(downloads.join(wanted(&upstream.url, &body, None)).unwrap());
        let b = flight(downloads.join(wanted(&upstream.url, &body, None)).unwrap());
        let mut rx = a.progress.clone();
        rx.wait_for(|p| p.written > 0).await.unwrap();
        assert_eq!(entries(dir.path()).len(), 1, "the temporary file");
        // One client left: the other keeps the download going.
        drop(a);
        upstream.release.notify_one();
        assert!(matches!(final_state(&b).await, State::Done));
        drop(b);
        let sha = hex::encode(Sha256::digest(&body));
        assert_eq!(entries(dir.path()), std::slice::from_ref(&sha));
        assert!(upstream.hung_up.try_recv().is_err());

        // The same file again, uncached, whose only client leaves mid-transfer.
        std::fs::remove_file(dir.path().join(&sha)).unwrap();
        downloads.verified.lock().clear();
        let only = flight(downloads.join(wanted(&upstream.url, &body, None)).unwrap());
        let mut rx = only.progress.clone();
        rx.wait_for(|p| p.written > 0).await.unwrap();
        drop(rx);
        drop(only);
        tokio::time::timeout(Duration::from_secs(30), upstream.hung_up.recv())
            .await
            .expect("upstream sees the connection closed")
            .unwrap();
        eventually("the temporary file is removed", || {
            entries(dir.path()).is_empty()
        })
        .await;
        eventually("the flight is gone", || downloads.running.lock().is_empty()).await;
        assert_eq!(downloads.slots.available_permits(), MAX_DOWNLOADS);
        assert_eq!(*downloads.reserved.lock(), 0);
    }

    #[tokio::test]
    async fn a_file_longer_than_its_listed_size_fails_and_caches_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let body = vec![1u8; 3_000_000];
        // No Content-Length: the gateway finds out while it receives.
        let upstream = test_upstream(body.clone(), body.len(), false).await;
        let downloads = downloads(dir.path(), u64::MAX);
        let f = flight(
            downloads
                .join(wanted(&upstream.url, &body, Some(1_000_000)))
                .unwrap(),
        );
        let State::Failed(err) = final_state(&f).await else {
            panic!("not refused");
        };
        assert!(
            err.to_string()
                .contains("more than the 1000000 bytes the index lists"),
            "{err}"
        );
        assert!(f.progress.borrow().written <= 1_000_000);
        assert!(entries(dir.path()).is_empty());
        // With a Content-Length that disagrees, nothing is even written.
        let upstream = test_upstream(body.clone(), body.len(), true).await;
        let f = flight(
            downloads
                .join(wanted(&upstream.url, &body, Some(1_000_000)))
                .unwrap(),
        );
        let State::Failed(err) = final_state(&f).await else {
            panic!("not refused");
        };
        assert!(err.to_string().contains("the index lists 1000000"), "{err}");
        assert!(entries(dir.path()).is_empty());
        // Listed above the hard cap: refused at once.
        assert!(matches!(
            downloads.join(wanted(&upstream.url, &body, Some(MAX_FILE_SIZE + 1))),
            Err(DownloadError::Size { .. })
        ));
    }

    #[tokio::test]
    async fn a_download_the_disk_has_no_room_for_is_refused_before_upstream() {
        let dir = tempfile::tempdir().unwrap();
        let body = vec![1u8; 1000];
        let upstream = test_upstream(body.clone(), body.len(), true).await;
        let downloads = downloads(dir.path(), FREE_MARGIN + 500);
        let f = flight(
            downloads
                .join(wanted(&upstream.url, &body, Some(1000)))
                .unwrap(),
        );
        let State::Failed(err) = final_state(&f).await else {
            panic!("not refused");
        };
        assert!(matches!(*err, DownloadError::DiskFull { .. }), "{err}");
        assert_eq!(upstream.requests.load(Ordering::SeqCst), 0);
        assert!(entries(dir.path()).is_empty());
        assert_eq!(*downloads.reserved.lock(), 0);
        // Room for it: it downloads.
        let downloads = super::tests::downloads(dir.path(), FREE_MARGIN + 1000);
        let f = flight(
            downloads
                .join(wanted(&upstream.url, &body, Some(1000)))
                .unwrap(),
        );
        assert!(matches!(final_state(&f).await, State::Done));
    }

    #[tokio::test]
    async fn a_dropped_download_is_an_error_not_an_end() {
        let (mut body, tx) = body_of(b"abc", State::Receiving);
        let mut offset = 0;
        body.next(&mut offset).await.unwrap().unwrap();
        drop(tx);
        assert!(body.next(&mut offset).await.unwrap().is_err());
    }
}
