//! The workspace file streams: list, read and write the kernel's workspace for the gateway's
//! files API and `outputs/` artifacts, with the same code and rules as the gateway uses on a
//! host workspace (`cellgate_agent::workspace`: links never followed, new files the kernel's).
//!
//! The file system calls block, so each stream is served on a blocking thread that drives
//! its stream with the runtime's `block_on`. A yamux stream that is only written to stalls
//! once the peer's window is used up: the window updates are taken in only by reads. So
//! while a listing or a file goes out, a task keeps reading the stream (the gateway sends
//! nothing more on it).

use std::io::Read;
use std::path::{Path, PathBuf};

use cellgate_agent::protocol::{write_json, FileOp, FileReply, MAX_FILE_FRAME};
use cellgate_agent::workspace::{Workspace, WorkspaceError};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, ReadHalf, WriteHalf};
use tokio::runtime::Handle;

type FileStream = BufReader<tokio_yamux::StreamHandle>;
type Reader = ReadHalf<FileStream>;
type Writer = WriteHalf<FileStream>;

/// Bytes per read or write of a transfer.
const CHUNK: usize = 64 << 10;

/// Serves one file operation on `stream`; `workspace` is the kernel's (none before a kernel
/// was started: the workspace disk is mounted then).
pub async fn serve(stream: FileStream, workspace: Option<PathBuf>, op: FileOp) {
    let runtime = Handle::current();
    let (reader, mut writer) = tokio::io::split(stream);
    let (reader, drain) = if matches!(op, FileOp::Write { .. }) {
        (Some(reader), None)
    } else {
        (None, Some(tokio::spawn(drain(reader))))
    };
    let _ = tokio::task::spawn_blocking(move || {
        let result = match workspace {
            Some(dir) => run(&runtime, reader, &mut writer, &dir, op),
            None => Err(WorkspaceError::Unavailable),
        };
        if let Err(error) = result {
            let _ = runtime.block_on(write_json(&mut writer, &FileReply::Failed(error.to_wire())));
        }
        let _ = runtime.block_on(writer.shutdown());
    })
    .await;
    if let Some(drain) = drain {
        drain.abort();
    }
}

/// Reads and drops whatever arrives, so the stream takes in its window updates.
async fn drain(mut reader: Reader) {
    let mut buffer = [0u8; 1024];
    while matches!(reader.read(&mut buffer).await, Ok(n) if n > 0) {}
}

fn run(
    runtime: &Handle,
    reader: Option<Reader>,
    stream: &mut Writer,
    dir: &Path,
    op: FileOp,
) -> Result<(), WorkspaceError> {
    let workspace = Workspace::open(dir, Path::new("."))?;
    let send = |stream: &mut Writer, reply: &FileReply| {
        runtime
            .block_on(write_json(stream, reply))
            .map_err(|source| WorkspaceError::Io {
                what: "the file stream".to_owned(),
                source,
            })
    };
    match op {
        FileOp::List {
            dir,
            recursive,
            hidden,
        } => {
            let listing = cellgate_agent::workspace::Listing { recursive, hidden };
            for entry in workspace.list(dir.trim_matches('/'), listing)? {
                send(stream, &FileReply::Entry(entry.to_wire()))?;
            }
            send(stream, &FileReply::End)
        }
        FileOp::Read { path } => {
            let (file, size) = workspace.open_read(&path)?;
            send(stream, &FileReply::Size { bytes: size })?;
            // What was there when it was opened: the kernel may grow the file meanwhile.
            let mut file = file.take(size);
            let mut buffer = vec![0; CHUNK];
            loop {
                let n = file
                    .read(&mut buffer)
                    .map_err(|source| WorkspaceError::Io {
                        what: format!("read {path}"),
                        source,
                    })?;
                if n == 0 {
                    return Ok(());
                }
                runtime
                    .block_on(stream.write_all(&buffer[..n]))
                    .map_err(|source| WorkspaceError::Io {
                        what: "the file stream".to_owned(),
                        source,
                    })?;
            }
        }
        FileOp::Write { path, limit } => {
            let Some(mut reader) = reader else {
                return Err(WorkspaceError::Unavailable);
            };
            let mut upload = workspace.create(&path)?;
            let mut buffer = Vec::new();
            let broken = |source| WorkspaceError::Io {
                what: "the file stream".to_owned(),
                source,
            };
            loop {
                // A stream that ends before the empty frame ends here with an error, and
                // the partial file goes with the upload.
                let length = runtime.block_on(reader.read_u32()).map_err(broken)?;
                if length == 0 {
                    break;
                }
                if length > MAX_FILE_FRAME {
                    return Err(broken(std::io::Error::other("a frame over the maximum")));
                }
                buffer.resize(length as usize, 0);
                runtime
                    .block_on(reader.read_exact(&mut buffer))
                    .map_err(broken)?;
                upload.write(&buffer, limit)?;
            }
            let bytes = upload.commit()?;
            send(stream, &FileReply::Written { bytes })
        }
        FileOp::Stat { path } => send(stream, &FileReply::Entry(workspace.stat(&path)?.to_wire())),
        FileOp::MakeDir { path } => send(
            stream,
            &FileReply::Entry(workspace.make_dir(&path)?.to_wire()),
        ),
        FileOp::Remove { path, recursive } => {
            let entries = workspace.remove(&path, recursive)?;
            send(stream, &FileReply::Removed { entries })
        }
        FileOp::Rename {
            from,
            to,
            overwrite,
        } => {
            let entry = workspace.rename(&from, &to, overwrite)?;
            send(stream, &FileReply::Entry(entry.to_wire()))
        }
    }
}
