//! A kernel's workspace as the gateway serves it (files API, `outputs/` artifacts, initial
//! files): [`Files`], one face for the two ways a workspace is reached, against a hostile
//! sandbox.
//!
//! - **Local**: the namespaces and gVisor backends' workspaces are directories the gateway
//!   opens itself ([`Workspace`], from `cellgate_agent::workspace`, whose doc says how a
//!   hostile sandbox's links are never followed). The namespaces backend's workspace is a
//!   size-limited tmpfs in the sandbox's mount namespace (so the size limit holds and the
//!   host sees nothing): the gateway opens it from `/proc/<kernel pid>/root`
//!   (`SandboxHandle::workspace_root`; gVisor's from `/proc/<runsc pid>/root`; host backends
//!   answer their host directory), and that process's pidfd must still be live after the
//!   open, so a reused pid can never point the gateway at a host process's root.
//! - **In a guest**: a microVM's (or a pod's) workspace is inside it; the guest agent serves
//!   it with the same code ([`GuestFiles`], `SandboxHandle::guest_files`, one agent stream
//!   per operation), so the same rules hold in the guest. The gateway counts an upload's
//!   bytes against the limit itself and caps what the guest sends (listing entries, a
//!   read's announced size, line lengths, a deadline per step).
//!
//! *Invariants* (kept by `cellgate_agent::workspace` on both sides): every path is resolved
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
//! RESOLVE_NO_XDEV)` from a directory handle, so no link the kernel plants (absolute,
//! relative, swapped in during the request) is ever followed; client paths are relative,
//! without `.`/`..`/NUL; uploads go to a temporary name and are renamed into place (a link
//! at the target is replaced, not followed; an oversized upload leaves nothing); files are
//! created with the sandbox user's uid/gid, taken per thread around the syscalls (a tmpfs
//! mounted in the sandbox's user namespace refuses inodes for root, which it cannot map);
//! reads refuse anything but regular files (a FIFO would hang the gateway).
//!
//! Everything here blocks: callers run it on blocking threads.
//!
//! Must not depend on: HTTP, kernels.

use std::io::Read;
use std::sync::Arc;

pub use cellgate_agent::workspace::{
    check_path, FileEntry, Listing, Upload, Workspace, WorkspaceError, MAX_LIST_ENTRIES,
};

/// A workspace that a sandbox serves itself (the microvm guest agent). Blocking.
pub trait GuestFiles: Send + Sync {
    /// The entries of `dir`, as [`Workspace::list`].
    fn list(&self, dir: &str, listing: Listing) -> Result<Vec<FileEntry>, WorkspaceError>;
    /// A regular file's bytes and size, as [`Workspace::open_read`].
    fn open_read(&self, path: &str) -> Result<(Box<dyn Read + Send>, u64), WorkspaceError>;
    /// Starts writing `path`, refusing more than `limit` bytes; nothing is at `path` until
    /// the upload is committed.
    fn create(&self, path: &str, limit: u64) -> Result<Box<dyn GuestUpload>, WorkspaceError>;
    /// As [`Workspace::stat`].
    fn stat(&self, path: &str) -> Result<FileEntry, WorkspaceError>;
    /// As [`Workspace::make_dir`].
    fn make_dir(&self, path: &str) -> Result<FileEntry, WorkspaceError>;
    /// As [`Workspace::remove`].
    fn remove(&self, path: &str, recursive: bool) -> Result<u64, WorkspaceError>;
    /// As [`Workspace::rename`].
    fn rename(&self, from: &str, to: &str, overwrite: bool) -> Result<FileEntry, WorkspaceError>;
}

/// A file being written into a guest's workspace; dropped uncommitted, it leaves nothing.
pub trait GuestUpload: Send {
    fn write(&mut self, chunk: &[u8]) -> Result<(), WorkspaceError>;
    fn commit(self: Box<Self>) -> Result<u64, WorkspaceError>;
}

/// A kernel's workspace, wherever it is.
pub enum Files {
    Local(Workspace),
    Guest(Arc<dyn GuestFiles>),
}

impl Files {
    pub fn list(&self, dir: &str, listing: Listing) -> Result<Vec<FileEntry>, WorkspaceError> {
        match self {
            Files::Local(workspace) => workspace.list(dir, listing),
            Files::Guest(files) => files.list(dir, listing),
        }
    }

    pub fn open_read(&self, path: &str) -> Result<(FileReader, u64), WorkspaceError> {
        match self {
            Files::Local(workspace) => workspace
                .open_read(path)
                .map(|(file, size)| (FileReader::Local(file), size)),
            Files::Guest(files) => {
                check_path(path)?;
                files
                    .open_read(path)
                    .map(|(reader, size)| (FileReader::Guest(reader), size))
            }
        }
    }

    /// What is at `path` (a link as a link).
    pub fn stat(&self, path: &str) -> Result<FileEntry, WorkspaceError> {
        check_path(path)?;
        match self {
            Files::Local(workspace) => workspace.stat(path),
            Files::Guest(files) => files.stat(path),
        }
    }

    /// Creates a directory and its parents.
    pub fn make_dir(&self, path: &str) -> Result<FileEntry, WorkspaceError> {
        check_path(path)?;
        match self {
            Files::Local(workspace) => workspace.make_dir(path),
            Files::Guest(files) => files.make_dir(path),
        }
    }

    /// Removes a file, link or directory (a non-empty one only when `recursive`); how many
    /// entries went.
    pub fn remove(&self, path: &str, recursive: bool) -> Result<u64, WorkspaceError> {
        check_path(path)?;
        match self {
            Files::Local(workspace) => workspace.remove(path, recursive),
            Files::Guest(files) => files.remove(path, recursive),
        }
    }

    /// Moves `from` to `to`; the entry now at `to`.
    pub fn rename(
        &self,
        from: &str,
        to: &str,
        overwrite: bool,
    ) -> Result<FileEntry, WorkspaceError> {
        check_path(from)?;
        check_path(to)?;
        match self {
            Files::Local(workspace) => workspace.rename(from, to, overwrite),
            Files::Guest(files) => files.rename(from, to, overwrite),
        }
    }

    /// Starts writing `path`, at most `limit` bytes.
    pub fn create(&self, path: &str, limit: u64) -> Result<FileUpload<'_>, WorkspaceError> {
        Ok(match self {
            Files::Local(workspace) => FileUpload::Local {
                upload: workspace.create(path)?,
                limit,
            },
            Files::Guest(files) => {
                check_path(path)?;
                FileUpload::Guest {
                    upload: files.create(path, limit)?,
                    limit,
                    written: 0,
                }
            }
        })
    }
}

/// A file's bytes: a host file (which async code can read without a blocking thread) or a
/// guest's stream.
pub enum FileReader {
    Local(std::fs::File),
    Guest(Box<dyn Read + Send>),
}

impl Read for FileReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            FileReader::Local(file) => file.read(buf),
            FileReader::Guest(reader) => reader.read(buf),
        }
    }
}

/// A file being written; removed unless committed.
pub enum FileUpload<'a> {
    Local {
        upload: Upload<'a>,
        limit: u64,
    },
    Guest {
        upload: Box<dyn GuestUpload>,
        limit: u64,
        written: u64,
    },
}

impl FileUpload<'_> {
    /// Appends `chunk`, refusing to grow past the limit.
    pub fn write(&mut self, chunk: &[u8]) -> Result<(), WorkspaceError> {
        match self {
            FileUpload::Local { upload, limit } => upload.write(chunk, *limit),
            FileUpload::Guest {
                upload,
                limit,
                written,
            } => {
                // Counted here too: the guest is not trusted to enforce the gateway's limit.
                *written += chunk.len() as u64;
                if *written > *limit {
                    return Err(WorkspaceError::TooLarge { limit: *limit });
                }
                upload.write(chunk)
            }
        }
    }

    /// Moves the file into place; its size.
    pub fn commit(self) -> Result<u64, WorkspaceError> {
        match self {
            FileUpload::Local { upload, .. } => upload.commit(),
            FileUpload::Guest { upload, .. } => upload.commit(),
        }
    }
}
/// A file's MIME type from its extension (`application/octet-stream` when unknown).
pub fn mime_for(path: &str) -> &'static str {
    let ext = path
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "svg" => "image/svg+xml",
        "pdf" => "application/pdf",
        "html" | "htm" => "text/html",
        "md" => "text/markdown",
        "tex" => "text/latex",
        "json" => "application/json",
        "csv" => "text/csv",
        "tsv" => "text/tab-separated-values",
        "txt" | "log" => "text/plain",
        "parquet" => "application/vnd.apache.parquet",
        "xlsx" => "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
        "zip" => "application/zip",
        _ => "application/octet-stream",
    }
}
