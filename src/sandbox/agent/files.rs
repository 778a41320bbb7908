//! A kernel's workspace as the gateway serves it when an agent holds it (a VM's disk, a
//! pod's volume): each operation of the files API and of the `outputs/` collection is one
//! `files` stream to the agent, which runs the same workspace code the gateway runs on a
//! host directory (`cellgate_agent::workspace`).
//!
//! The guest is hostile here as everywhere: every line is capped, every wait has a
//! deadline, a listing stops at [`MAX_LIST_ENTRIES`], a read delivers at most the size the
//! guest announced, and the gateway counts an upload's bytes against its limit itself.
//! Callers run on blocking threads; this drives the streams with the runtime's `block_on`.

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use cellgate_agent::protocol::{
    read_json_capped, FileOp, FileReply, Open, MAX_FILE_FRAME, MAX_FILE_LINE,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, WriteHalf};
use tokio::runtime::Handle;

use super::session::Agent;
use crate::workspace::{
    check_path, FileEntry, GuestFiles, GuestUpload, Listing, WorkspaceError, MAX_LIST_ENTRIES,
};

/// How long the guest may take for one step (a line, a chunk) of a file operation.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest a download from the guest may take, all of it: a guest that trickles its
/// bytes, each within [`STEP_TIMEOUT`], cannot hold a gateway thread for hours.
const READ_DEADLINE: Duration = Duration::from_secs(600);
/// The most a listing may weigh, all its lines together (10,000 ordinary entries are
/// about 1 MiB).
const MAX_LISTING_BYTES: usize = 8 << 20;

type FileStream = BufReader<tokio_yamux::StreamHandle>;

/// A kernel's workspace, through its agent.
pub struct AgentFiles {
    agent: Arc<Agent>,
    runtime: Handle,
}

impl AgentFiles {
    pub fn new(agent: Arc<Agent>, runtime: Handle) -> AgentFiles {
        AgentFiles { agent, runtime }
    }

    fn open(&self, op: FileOp) -> Result<FileStream, WorkspaceError> {
        let stream = self
            .runtime
            .block_on(self.agent.open_stream(&Open::Files { op }))
            .map_err(|error| guest_error(error.to_string()))?;
        Ok(BufReader::new(stream))
    }

    /// The guest's next line on `stream`, within the step deadline.
    fn reply(&self, stream: &mut FileStream) -> Result<FileReply, WorkspaceError> {
        match self.runtime.block_on(tokio::time::timeout(
            STEP_TIMEOUT,
            read_json_capped(stream, MAX_FILE_LINE),
        )) {
            Ok(Ok(Some(reply))) => Ok(reply),
            Ok(Ok(None)) => Err(guest_error("the guest ended the file stream".to_owned())),
            Ok(Err(error)) => Err(guest_error(error.to_string())),
            Err(_) => Err(guest_error("the guest did not answer in time".to_owned())),
        }
    }
}

fn guest_error(message: String) -> WorkspaceError {
    WorkspaceError::Io {
        what: "the VM's workspace".to_owned(),
        source: std::io::Error::other(message),
    }
}

fn unexpected(reply: &FileReply) -> WorkspaceError {
    guest_error(format!("unexpected answer {reply:?}"))
}

impl AgentFiles {
    /// One operation answered by one entry, which must be the path asked about.
    fn entry(&self, op: FileOp, path: &str) -> Result<FileEntry, WorkspaceError> {
        let mut stream = self.open(op)?;
        match self.reply(&mut stream)? {
            FileReply::Entry(entry) => {
                let asked = check_path(path)?.join("/");
                if entry.path != asked {
                    return Err(guest_error(format!(
                        "the guest answered for {:?} when asked about {asked:?}",
                        entry.path.chars().take(200).collect::<String>()
                    )));
                }
                Ok(FileEntry::from_wire(entry))
            }
            FileReply::Failed(failure) => Err(WorkspaceError::from_wire(failure, path, 0)),
            other => Err(unexpected(&other)),
        }
    }
}

impl GuestFiles for AgentFiles {
    fn stat(&self, path: &str) -> Result<FileEntry, WorkspaceError> {
        self.entry(
            FileOp::Stat {
                path: path.to_owned(),
            },
            path,
        )
    }

    fn make_dir(&self, path: &str) -> Result<FileEntry, WorkspaceError> {
        self.entry(
            FileOp::MakeDir {
                path: path.to_owned(),
            },
            path,
        )
    }

    fn remove(&self, path: &str, recursive: bool) -> Result<u64, WorkspaceError> {
        let mut stream = self.open(FileOp::Remove {
            path: path.to_owned(),
            recursive,
        })?;
        match self.reply(&mut stream)? {
            FileReply::Removed { entries } => Ok(entries),
            FileReply::Failed(failure) => Err(WorkspaceError::from_wire(failure, path, 0)),
            other => Err(unexpected(&other)),
        }
    }

    fn rename(&self, from: &str, to: &str, overwrite: bool) -> Result<FileEntry, WorkspaceError> {
        self.entry(
            FileOp::Rename {
                from: from.to_owned(),
                to: to.to_owned(),
                overwrite,
            },
            to,
        )
    }

    fn list(&self, dir: &str, listing: Listing) -> Result<Vec<FileEntry>, WorkspaceError> {
        let mut stream = self.open(FileOp::List {
            dir: dir.to_owned(),
            recursive: listing.recursive,
            hidden: listing.hidden,
        })?;
        let mut entries = Vec::new();
        let mut weight = 0;
        let prefix = dir.trim_matches('/');
        loop {
            match self.reply(&mut stream)? {
                FileReply::Entry(entry) => {
                    // The guest's own listing stops there too; past it, stop reading.
                    weight += entry.path.len() + 64;
                    if entries.len() >= MAX_LIST_ENTRIES || weight > MAX_LISTING_BYTES {
                        return Ok(entries);
                    }
                    // A path the gateway would refuse from a client, or outside the
                    // directory asked for, is the guest's invention.
                    let inside = prefix.is_empty()
                        || entry
                            .path
                            .strip_prefix(prefix)
                            .is_some_and(|rest| rest.starts_with('/'));
                    if check_path(&entry.path).is_err() || !inside {
                        return Err(guest_error(format!(
                            "the guest listed {:?} in {dir:?}",
                            entry.path.chars().take(200).collect::<String>()
                        )));
                    }
                    entries.push(FileEntry::from_wire(entry));
                }
                FileReply::End => return Ok(entries),
                FileReply::Failed(failure) => {
                    return Err(WorkspaceError::from_wire(failure, dir, 0))
                }
                other => return Err(unexpected(&other)),
            }
        }
    }

    fn open_read(&self, path: &str) -> Result<(Box<dyn Read + Send>, u64), WorkspaceError> {
        let mut stream = self.open(FileOp::Read {
            path: path.to_owned(),
        })?;
        match self.reply(&mut stream)? {
            FileReply::Size { bytes } => Ok((
                Box::new(GuestReader {
                    stream,
                    left: bytes,
                    runtime: self.runtime.clone(),
                    deadline: tokio::time::Instant::now() + READ_DEADLINE,
                }),
                bytes,
            )),
            FileReply::Failed(failure) => Err(WorkspaceError::from_wire(failure, path, 0)),
            other => Err(unexpected(&other)),
        }
    }

    fn create(&self, path: &str, limit: u64) -> Result<Box<dyn GuestUpload>, WorkspaceError> {
        let stream = self.open(FileOp::Write {
            path: path.to_owned(),
            limit,
        })?;
        Ok(Box::new(AgentUpload::new(
            stream,
            self.runtime.clone(),
            path.to_owned(),
            limit,
        )))
    }
}

/// A file's bytes from the guest: no more than it announced.
struct GuestReader {
    stream: FileStream,
    left: u64,
    runtime: Handle,
    deadline: tokio::time::Instant,
}

impl Read for GuestReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self
            .runtime
            .block_on(tokio::time::timeout_at(
                self.deadline
                    .min(tokio::time::Instant::now() + STEP_TIMEOUT),
                self.stream.read(&mut buf[..want]),
            ))
            .map_err(|_| std::io::Error::other("the guest stopped sending the file"))??;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the guest sent less than the file's size",
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// A file being written into the VM's workspace; dropped uncommitted (the stream is reset
/// before its last, empty frame), the guest keeps nothing.
///
/// A yamux stream takes in the peer's window updates only when it is read, so a task reads
/// the stream for the guest's answer while the bytes go out (else the upload stalls after
/// the first window); the guest answers early only to refuse (a full disk).
struct AgentUpload {
    writer: WriteHalf<tokio_yamux::StreamHandle>,
    /// The reader task; `None` once its answer was taken.
    answer: Option<tokio::task::JoinHandle<Result<FileReply, WorkspaceError>>>,
    /// The bytes sent, by the gateway's own count.
    sent: u64,
    runtime: Handle,
    path: String,
    limit: u64,
}

impl AgentUpload {
    fn new(stream: FileStream, runtime: Handle, path: String, limit: u64) -> AgentUpload {
        // Nothing was read yet: the buffer is empty.
        let (reader, writer) = tokio::io::split(stream.into_inner());
        let mut reader = BufReader::new(reader);
        let answer = runtime.spawn(async move {
            match read_json_capped(&mut reader, MAX_FILE_LINE).await {
                Ok(Some(reply)) => Ok(reply),
                Ok(None) => Err(guest_error("the guest ended the file stream".to_owned())),
                Err(error) => Err(guest_error(error.to_string())),
            }
        });
        AgentUpload {
            writer,
            answer: Some(answer),
            sent: 0,
            runtime,
            path,
            limit,
        }
    }

    fn failure(&self, reply: Result<FileReply, WorkspaceError>) -> WorkspaceError {
        match reply {
            Ok(FileReply::Failed(failure)) => {
                WorkspaceError::from_wire(failure, &self.path, self.limit)
            }
            Ok(other) => unexpected(&other),
            Err(error) => error,
        }
    }

    fn send(&mut self, frame: &[u8]) -> Result<(), WorkspaceError> {
        let length = u32::try_from(frame.len()).unwrap_or(u32::MAX);
        let writer = &mut self.writer;
        let Some(answer) = self.answer.as_mut() else {
            return Err(guest_error("the guest already answered".to_owned()));
        };
        let sent = self.runtime.block_on(async {
            let write = async {
                writer.write_u32(length).await?;
                writer.write_all(frame).await?;
                writer.flush().await
            };
            tokio::select! {
                written = tokio::time::timeout(STEP_TIMEOUT, write) => Ok(written),
                // The guest answered before the end: it refuses the file.
                reply = answer => Err(reply),
            }
        });
        if sent.is_err() {
            self.answer = None;
        }
        match sent {
            Ok(Ok(Ok(()))) => {
                self.sent += frame.len() as u64;
                Ok(())
            }
            Ok(Ok(Err(error))) => Err(guest_error(format!("sending the file: {error}"))),
            Ok(Err(_)) => Err(guest_error("the guest stopped taking the file".to_owned())),
            Err(reply) => Err(self
                .failure(reply.unwrap_or_else(|_| {
                    Err(guest_error("the file stream's reader failed".into()))
                }))),
        }
    }
}

impl Drop for AgentUpload {
    fn drop(&mut self) {
        // The reader holds half the stream: without it the stream is dropped, and reset.
        if let Some(answer) = &self.answer {
            answer.abort();
        }
    }
}

impl GuestUpload for AgentUpload {
    fn write(&mut self, chunk: &[u8]) -> Result<(), WorkspaceError> {
        for frame in chunk.chunks(MAX_FILE_FRAME as usize) {
            self.send(frame)?;
        }
        Ok(())
    }

    fn commit(mut self: Box<Self>) -> Result<u64, WorkspaceError> {
        self.send(&[])?;
        let Some(answer) = self.answer.as_mut() else {
            return Err(guest_error("the guest already answered".to_owned()));
        };
        let reply = self
            .runtime
            .block_on(tokio::time::timeout(STEP_TIMEOUT, answer));
        self.answer = None;
        match reply {
            // The gateway's own count: the guest's word is not needed.
            Ok(Ok(Ok(FileReply::Written { .. }))) => Ok(self.sent),
            Ok(Ok(reply)) => Err(self.failure(reply)),
            Ok(Err(_)) => Err(guest_error("the file stream's reader failed".to_owned())),
            Err(_) => Err(guest_error("the guest did not answer in time".to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The gateway's side against a fake, hostile guest over an in-memory link: what the
    //! guest sends is bounded, and its refusals arrive as the workspace's errors.

    use std::future::Future;

    use cellgate_agent::protocol::{
        self, read_json, write_json, FailureKind, FileFailure, WireEntry,
    };
    use futures_util::StreamExt;

    use super::*;

    type GuestStream = BufReader<tokio_yamux::StreamHandle>;

    /// An agent whose guest answers every `files` stream with `answer`.
    async fn files_with_guest<F, Fut>(answer: F) -> Arc<AgentFiles>
    where
        F: Fn(FileOp, GuestStream) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (host, guest) = tokio::io::duplex(1 << 20);
        let answer = Arc::new(answer);
        tokio::spawn(async move {
            let mut guest = BufReader::new(guest);
            protocol::answer_handshake(&mut guest, false).await.unwrap();
            let mut session = tokio_yamux::Session::new_server(guest, protocol::yamux_config());
            while let Some(Ok(stream)) = session.next().await {
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut stream = BufReader::new(stream);
                    match read_json::<Open, _>(&mut stream).await {
                        Ok(Some(Open::Files { op })) => answer(op, stream).await,
                        // The control stream stays open, unused.
                        _ => std::future::pending::<()>().await,
                    }
                });
            }
        });
        let agent = Agent::connect(host, None, Duration::from_secs(5))
            .await
            .unwrap();
        Arc::new(AgentFiles::new(Arc::new(agent), Handle::current()))
    }

    fn no_space() -> FileReply {
        FileReply::Failed(FileFailure {
            kind: FailureKind::NoSpace,
            message: "the workspace is full".into(),
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_delivers_no_more_than_the_announced_size() {
        let files = files_with_guest(|_, mut stream| async move {
            write_json(&mut stream, &FileReply::Size { bytes: 10 })
                .await
                .unwrap();
            let _ = stream.get_mut().write_all(&vec![b'a'; 1 << 20]).await;
            std::future::pending::<()>().await
        })
        .await;
        let read = tokio::task::spawn_blocking(move || {
            let (mut reader, size) = files.open_read("f").unwrap();
            let mut bytes = Vec::new();
            reader.read_to_end(&mut bytes).unwrap();
            (size, bytes)
        })
        .await
        .unwrap();
        assert_eq!(read, (10, vec![b'a'; 10]));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listing_stops_at_its_cap_and_junk_is_an_error() {
        let files = files_with_guest(|op, stream| async move {
            // A writing side must read too, or yamux stalls it at the first window.
            let (mut reader, mut stream) = tokio::io::split(stream);
            tokio::spawn(async move {
                let mut buffer = [0; 1024];
                while matches!(reader.read(&mut buffer).await, Ok(n) if n > 0) {}
            });
            if matches!(&op, FileOp::List { dir, .. } if dir == "junk") {
                let _ = stream.write_all(b"{\"file\": \"size\"}\n").await;
                return;
            }
            for i in 0..MAX_LIST_ENTRIES + 50 {
                let entry = WireEntry {
                    path: format!("f{i}"),
                    kind: "weird".into(),
                    size: 1,
                    mtime_s: 0,
                    mtime_ns: 0,
                };
                if write_json(&mut stream, &FileReply::Entry(entry))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            std::future::pending::<()>().await
        })
        .await;
        let (listed, junk) = tokio::task::spawn_blocking(move || {
            (
                files.list("", Listing::ALL).unwrap(),
                files.list("junk", Listing::ALL).map(|_| ()),
            )
        })
        .await
        .unwrap();
        assert_eq!(listed.len(), MAX_LIST_ENTRIES);
        assert_eq!(listed[0].kind, "other", "an unknown kind is other");
        assert!(matches!(junk, Err(WorkspaceError::Io { .. })), "{junk:?}");
    }

    /// A guest that refuses a file midway (its disk is full) and stops reading: the upload
    /// ends with its reason, not after a deadline.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_the_guest_refuses_midway_says_why() {
        let files = files_with_guest(|_, mut stream| async move {
            let _ = stream.read_u32().await;
            write_json(&mut stream, &no_space()).await.unwrap();
            std::future::pending::<()>().await
        })
        .await;
        let started = std::time::Instant::now();
        let result = tokio::task::spawn_blocking(move || {
            let mut upload = files.create("big", 64 << 20)?;
            for _ in 0..64 {
                upload.write(&[7; 1 << 20])?;
            }
            upload.commit()
        })
        .await
        .unwrap();
        assert!(matches!(result, Err(WorkspaceError::NoSpace)), "{result:?}");
        assert!(started.elapsed() < STEP_TIMEOUT, "{:?}", started.elapsed());
    }

    /// The bytes arrive in frames and the file exists only after the empty frame; the
    /// guest's answer is the gateway's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_arrives_in_frames_and_commits_at_the_empty_one() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tx = Arc::new(parking_lot::Mutex::new(Some(tx)));
        let files = files_with_guest(move |op, mut stream| {
            let tx = tx.clone();
            async move {
                let mut received = Vec::new();
                loop {
                    let length = stream.read_u32().await.unwrap();
                    if length == 0 {
                        break;
                    }
                    assert!(length <= MAX_FILE_FRAME);
                    let mut frame = vec![0; length as usize];
                    stream.read_exact(&mut frame).await.unwrap();
                    received.extend_from_slice(&frame);
                }
                let bytes = received.len() as u64;
                if let Some(tx) = tx.lock().take() {
                    let _ = tx.send((op, received));
                }
                write_json(&mut stream, &FileReply::Written { bytes })
                    .await
                    .unwrap();
            }
        })
        .await;
        let content: Vec<u8> = (0..(3u32 << 20) + 5).map(|i| (i % 251) as u8).collect();
        let sent = content.clone();
        let written = tokio::task::spawn_blocking(move || {
            let mut upload = files.create("dir/file", 1 << 30)?;
            upload.write(&sent)?;
            upload.commit()
        })
        .await
        .unwrap()
        .unwrap();
        let (op, received) = rx.await.unwrap();
        assert_eq!(
            op,
            FileOp::Write {
                path: "dir/file".into(),
                limit: 1 << 30
            }
        );
        assert_eq!(written, content.len() as u64);
        assert!(received == content, "the bytes arrived unchanged");
    }
}
