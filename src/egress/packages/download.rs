//! Upstream files streamed to pip while they download, once for every session that asks.
//!
//! A download runs in a task of its own, so a client that hangs up stops nothing for the
//! others: it writes to a temporary file in the cache directory, hashing as it goes, and
//! publishes its progress (bytes written, upstream's length, finished or failed) through a
//! `watch` channel. Every client asking for the same sha256 meanwhile joins it (single
//! flight) and streams the temporary file as it grows ([`FileBody`]), with upstream's
//! `Content-Length`, so pip shows real progress and gateway memory does not grow with the
//! file. The file is renamed into the cache (named by its sha256) only when the hash
//! matched; on a mismatch or a broken transfer it is deleted and every client's body ends
//! in an error. A client never receives a file's last byte before its hash matched, so pip
//! never holds a whole, unverified file.
//!
//! Timeouts are stall timeouts (no byte for [`STALL`]): a slow download that moves is never
//! cut. At most [`MAX_DOWNLOADS`] upstream downloads run at once; the others wait for a
//! slot.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::sync::{watch, Semaphore};

use super::super::proxy::{Body, BodyError};

/// How long an upstream may send nothing before its download fails (pip's own read
/// timeout in the sandbox is 60 s, so the gateway gives up first and says why).
pub const STALL: Duration = Duration::from_secs(30);
/// Upstream file downloads at once; more wait for a slot (each costs a connection, a
/// temporary file and a write buffer).
pub const MAX_DOWNLOADS: usize = 4;
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
    #[error("{filename}: sha256 {got} does not match the index's {want}")]
    HashMismatch {
        filename: String,
        got: String,
        want: String,
    },
    #[error("the download ended before its end (the gateway dropped it)")]
    Abandoned,
}

/// Where a download is.
#[derive(Debug, Clone)]
pub enum State {
    /// Waiting for a slot or for upstream's response headers.
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
    /// Bytes in the temporary file, readable.
    pub written: u64,
    /// Upstream's `Content-Length`, once its headers arrived.
    pub length: Option<u64>,
    pub state: State,
}

/// A download clients can join: its file (positional reads, so clients share it without a
/// shared position; it stays readable after the rename) and its progress.
pub struct Flight {
    pub file: Arc<std::fs::File>,
    pub progress: watch::Receiver<Progress>,
}

/// What a download needs to know of its file.
pub struct Wanted {
    pub url: String,
    pub sha256: String,
    pub filename: String,
}

/// The downloads of a gateway, shared by every session.
pub struct Downloads {
    client: reqwest::Client,
    cache_dir: PathBuf,
    running: Mutex<HashMap<String, Arc<Flight>>>,
    slots: Arc<Semaphore>,
    /// Cache files whose hash was checked by this process (or that it wrote).
    verified: Mutex<HashSet<String>>,
}

impl Downloads {
    pub fn new(client: reqwest::Client, cache_dir: PathBuf) -> Arc<Downloads> {
        Arc::new(Downloads {
            client,
            cache_dir,
            running: Mutex::new(HashMap::new()),
            slots: Arc::new(Semaphore::new(MAX_DOWNLOADS)),
            verified: Mutex::new(HashSet::new()),
        })
    }

    fn cached(&self, sha256: &str) -> PathBuf {
        self.cache_dir.join(sha256)
    }

    /// The cached file if it is there and whole (hashed once per process; a corrupt one
    /// is deleted so that it is fetched again).
    pub async fn cached_file(&self, sha256: &str) -> Option<std::fs::File> {
        let path = self.cached(sha256);
        let file = std::fs::File::open(&path).ok()?;
        if self.verified.lock().contains(sha256) {
            return Some(file);
        }
        let (file, got) = tokio::task::spawn_blocking(move || {
            let mut hasher = Sha256::new();
            std::io::copy(&mut &file, &mut hasher).ok()?;
            Some((file, hex::encode(hasher.finalize())))
        })
        .await
        .ok()??;
        if got == sha256 {
            self.verified.lock().insert(got);
            return Some(file);
        }
        tracing::warn!(file = %path.display(), "cached package file is corrupt; fetching it again");
        let _ = std::fs::remove_file(&path);
        None
    }

    /// The download of `wanted`: the one under way, or a new one. `Err`: the cached file
    /// appeared meanwhile (a download finished), open.
    pub fn join(
        self: &Arc<Self>,
        wanted: Wanted,
    ) -> Result<Result<Arc<Flight>, std::fs::File>, DownloadError> {
        let mut running = self.running.lock();
        if let Some(flight) = running.get(&wanted.sha256) {
            return Ok(Ok(flight.clone()));
        }
        // A download removes itself from the map only after its rename: not running and
        // not cached means nobody has it.
        if self.verified.lock().contains(&wanted.sha256) {
            if let Ok(file) = std::fs::File::open(self.cached(&wanted.sha256)) {
                return Ok(Err(file));
            }
        }
        let tmp = self.cache_dir.join(format!(
            ".{}.{}",
            wanted.sha256,
            uuid::Uuid::new_v4().simple()
        ));
        let io = |source: std::io::Error| DownloadError::Io {
            what: format!("create {}", tmp.display()),
            reason: source.to_string(),
        };
        let writer = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io)?;
        let reader = std::fs::File::open(&tmp).map_err(io)?;
        let (tx, rx) = watch::channel(Progress {
            written: 0,
            length: None,
            state: State::Starting,
        });
        let flight = Arc::new(Flight {
            file: Arc::new(reader),
            progress: rx,
        });
        running.insert(wanted.sha256.clone(), flight.clone());
        tokio::spawn(
            self.clone()
                .run(wanted, tmp, tokio::fs::File::from_std(writer), tx),
        );
        Ok(Ok(flight))
    }

    async fn run(
        self: Arc<Self>,
        wanted: Wanted,
        tmp: PathBuf,
        writer: tokio::fs::File,
        tx: watch::Sender<Progress>,
    ) {
        let result = match self.slots.clone().acquire_owned().await {
            Ok(_slot) => self.download(&wanted, writer, &tx).await,
            Err(_) => Err(DownloadError::Abandoned),
        };
        let result = match result {
            Ok(()) => tokio::fs::rename(&tmp, self.cached(&wanted.sha256))
                .await
                .map_err(|e| DownloadError::Io {
                    what: format!("rename {}", tmp.display()),
                    reason: e.to_string(),
                }),
            Err(err) => Err(err),
        };
        match &result {
            Ok(()) => {
                self.verified.lock().insert(wanted.sha256.clone());
            }
            Err(err) => {
                tracing::warn!(file = %wanted.filename, %err, "package download failed");
                let _ = tokio::fs::remove_file(&tmp).await;
            }
        }
        // Out of the map before the final state is published: a client that comes after
        // the failure starts afresh, one after the success finds the cache.
        self.running.lock().remove(&wanted.sha256);
        tx.send_modify(|p| {
            p.state = match result {
                Ok(()) => State::Done,
                Err(err) => State::Failed(Arc::new(err)),
            }
        });
    }

    async fn download(
        &self,
        wanted: &Wanted,
        mut writer: tokio::fs::File,
        tx: &watch::Sender<Progress>,
    ) -> Result<(), DownloadError> {
        let upstream_err = |reason: String| DownloadError::Upstream {
            url: wanted.url.clone(),
            reason,
        };
        let write_err = |e: std::io::Error| DownloadError::Io {
            what: format!("write the download of {}", wanted.filename),
            reason: e.to_string(),
        };
        // The client's read timeout is the stall timeout; there is no total one.
        let mut response = self
            .client
            .get(&wanted.url)
            .send()
            .await
            .map_err(|e| upstream_err(e.to_string()))?;
        if !response.status().is_success() {
            return Err(upstream_err(response.status().to_string()));
        }
        let length = response.content_length();
        tx.send_modify(|p| {
            p.length = length;
            p.state = State::Receiving;
        });
        let mut hasher = Sha256::new();
        let mut buffer = Vec::with_capacity(WRITE_BUFFER);
        let mut written = 0u64;
        loop {
            let chunk = response
                .chunk()
                .await
                .map_err(|e| upstream_err(e.to_string()))?;
            let last = chunk.is_none();
            if let Some(chunk) = &chunk {
                hasher.update(chunk);
                buffer.extend_from_slice(chunk);
            }
            if buffer.len() >= WRITE_BUFFER || (last && !buffer.is_empty()) {
                writer.write_all(&buffer).await.map_err(write_err)?;
                // tokio's file writes in the background: flushed, the bytes are in the
                // file before clients are told they are.
                writer.flush().await.map_err(write_err)?;
                written += buffer.len() as u64;
                buffer.clear();
                tx.send_modify(|p| p.written = written);
            }
            if last {
                break;
            }
        }
        if let Some(length) = length.filter(|&l| l != written) {
            return Err(upstream_err(format!(
                "sent {written} bytes of the {length} it announced"
            )));
        }
        let got = hex::encode(hasher.finalize());
        if got != wanted.sha256 {
            return Err(DownloadError::HashMismatch {
                filename: wanted.filename.clone(),
                got,
                want: wanted.sha256.clone(),
            });
        }
        Ok(())
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
                        State::Starting | State::Receiving => {
                            (progress.written.saturating_sub(1), false)
                        }
                    }
                }
            };
            if whole {
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

/// Temporary files of downloads no process is writing any more (`.<sha256>.<id>`, not
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
                .is_some_and(|(sha, _)| sha.len() == 64)
                && old(p)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use std::io::Write;

    fn body_of(bytes: &[u8], state: State) -> (FileBody, watch::Sender<Progress>) {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(bytes).unwrap();
        let (tx, rx) = watch::channel(Progress {
            written: bytes.len() as u64,
            length: Some(bytes.len() as u64),
            state,
        });
        let body = FileBody {
            file: Arc::new(file),
            length: 0,
            progress: Some(rx),
            on_complete: None,
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

    #[tokio::test]
    async fn a_dropped_download_is_an_error_not_an_end() {
        let (mut body, tx) = body_of(b"abc", State::Receiving);
        let mut offset = 0;
        body.next(&mut offset).await.unwrap().unwrap();
        drop(tx);
        assert!(body.next(&mut offset).await.unwrap().is_err());
    }
}
