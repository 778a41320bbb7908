//! A kernel's workspace as the gateway (or, inside a microVM, the guest agent) reaches it:
//! upload, download and list files without ever following a link the sandbox planted.
//!
//! One implementation for both sides of the VM boundary: the gateway opens the workspace of
//! a namespaces or gVisor sandbox from the host, the agent opens its VM's workspace disk for
//! the gateway's file streams (`protocol::FileOp`); the same rules hold in both.
//!
//! The sandbox owns the workspace's contents and may be hostile: it can replace any file or
//! directory with a symlink to `/etc/passwd` or to another session's files, at any moment.
//! So every operation starts from a directory handle of the workspace and resolves paths
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
//! RESOLVE_NO_XDEV)`: the kernel refuses any resolution that would leave the workspace, pass
//! through a symlink (absolute or relative) or cross into another mount, so there is no
//! check-then-use race. The workspace handle itself is opened from a directory the gateway
//! trusts (the host workspace, or `/proc/<kernel pid>/root` for the namespaces backend,
//! whose workspace is a tmpfs inside the sandbox) with the same flags.
//!
//! Files are written to a temporary name in their directory and renamed into place, so a
//! failed or oversized upload leaves nothing behind, and a symlink at the target is replaced,
//! never followed. New files and directories are created with the workspace owner's uid and
//! gid (the sandbox's user; see `AsOwner`), so the kernel can change and delete them.
//!
//! Paths from clients are checked first: relative, no `.`/`..` components, no NUL, at most
//! 4096 bytes and 255 per component.
//!
//! Must not depend on: HTTP, kernels, the gateway.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{Gid, Mode, OFlags, ResolveFlags, Uid};
use serde::Serialize;

use crate::protocol::{FailureKind, FileFailure, WireEntry};

/// Entries a listing returns at most.
pub const MAX_LIST_ENTRIES: usize = 10_000;
const MAX_DEPTH: usize = 32;
/// Names of one directory read at once by a recursive removal.
const REMOVE_BATCH: usize = 4096;
/// Entries one recursive removal takes at most.
const MAX_REMOVE_ENTRIES: u64 = 1_000_000;

/// Errors of workspace operations.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("invalid path {path:?}: {reason}")]
    BadPath { path: String, reason: &'static str },
    #[error("no such file: {0}")]
    NotFound(String),
    #[error("{0} is a link; links in the workspace are never followed")]
    Link(String),
    #[error("{0} is not a regular file")]
    NotAFile(String),
    #[error("{0} is a directory")]
    IsADirectory(String),
    #[error("the upload is larger than the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("the workspace is full")]
    NoSpace,
    #[error("{0} already exists")]
    Exists(String),
    #[error("{0} is a directory that is not empty (remove it with recursive)")]
    NotEmpty(String),
    #[error("{0}: permission denied (the kernel's own permissions or a mount in the way)")]
    PermissionDenied(String),
    #[error("the session has no running kernel (its workspace lives and ends with the sandbox)")]
    Unavailable,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

fn io_error(what: &str, path: &str, err: rustix::io::Errno) -> WorkspaceError {
    use rustix::io::Errno;
    match err {
        Errno::NOENT => WorkspaceError::NotFound(path.to_owned()),
        // ELOOP: a symlink on the way (RESOLVE_NO_SYMLINKS); EXDEV: RESOLVE_BENEATH or
        // NO_XDEV refused the resolution; both mean the sandbox put a link there.
        Errno::LOOP | Errno::XDEV => WorkspaceError::Link(path.to_owned()),
        Errno::NOTDIR => WorkspaceError::NotFound(path.to_owned()),
        Errno::ISDIR => WorkspaceError::IsADirectory(path.to_owned()),
        Errno::NOSPC | Errno::DQUOT => WorkspaceError::NoSpace,
        Errno::EXIST => WorkspaceError::Exists(path.to_owned()),
        // The kernel may take its own permissions away, or the path may be a mount point:
        // the client's answer, not the gateway's failure.
        Errno::ACCESS | Errno::PERM | Errno::BUSY | Errno::ROFS => {
            WorkspaceError::PermissionDenied(path.to_owned())
        }
        Errno::NOTEMPTY => WorkspaceError::NotEmpty(path.to_owned()),
        err => WorkspaceError::Io {
            what: format!("{what} {path}"),
            source: err.into(),
        },
    }
}

/// Checks a client's path and splits it into components.
pub fn check_path(path: &str) -> Result<Vec<&str>, WorkspaceError> {
    let bad = |reason| WorkspaceError::BadPath {
        path: path.chars().take(200).collect(),
        reason,
    };
    if path.is_empty() {
        return Err(bad("empty"));
    }
    if path.len() > 4096 {
        return Err(bad("longer than 4096 bytes"));
    }
    if path.contains('\0') {
        return Err(bad("contains NUL"));
    }
    if path.starts_with('/') {
        return Err(bad("absolute paths are not allowed"));
    }
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    if parts.is_empty() {
        return Err(bad("empty"));
    }
    for part in &parts {
        if *part == ".." || *part == "." {
            return Err(bad("`.` and `..` are not allowed"));
        }
        if part.len() > 255 {
            return Err(bad("a component is longer than 255 bytes"));
        }
    }
    Ok(parts)
}

/// The names in `dir` (without `.` and `..`), at most `limit`, in the directory's order;
/// `what` and `shown` name the operation and the path in an error.
fn read_names(
    dir: &OwnedFd,
    what: &str,
    shown: &str,
    limit: usize,
) -> Result<Vec<std::ffi::CString>, WorkspaceError> {
    let readable = rustix::fs::openat2(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        resolve(),
    )
    .map_err(|e| io_error(what, shown, e))?;
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(&readable).map_err(|e| io_error(what, shown, e))? {
        let entry = entry.map_err(|e| io_error(what, shown, e))?;
        let name = entry.file_name();
        if name.to_bytes() != b"." && name.to_bytes() != b".." {
            names.push(name.to_owned());
            if names.len() >= limit {
                break;
            }
        }
    }
    Ok(names)
}

/// The last component of a checked path, and the directories above it.
fn split<'a, 'p>(
    parts: &'a [&'p str],
    path: &str,
) -> Result<(&'a &'p str, &'a [&'p str]), WorkspaceError> {
    parts
        .split_last()
        .ok_or(WorkspaceError::NotFound(path.to_owned()))
}

fn resolve() -> ResolveFlags {
    ResolveFlags::BENEATH
        | ResolveFlags::NO_SYMLINKS
        | ResolveFlags::NO_MAGICLINKS
        | ResolveFlags::NO_XDEV
}

/// One entry of a listing.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct FileEntry {
    /// Relative to the workspace, `/`-separated.
    pub path: String,
    /// file, dir, symlink, other.
    pub kind: &'static str,
    pub size: u64,
    /// Modification time, seconds since the epoch.
    #[serde(rename = "mtime")]
    pub mtime_s: i64,
    #[serde(skip)]
    pub mtime_ns: i64,
}

/// What a listing covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listing {
    /// Everything below the directory, not only its own entries.
    pub recursive: bool,
    /// Names starting with a dot too (caches and settings the kernel's libraries keep).
    pub hidden: bool,
}

impl Listing {
    /// Every entry below the directory.
    pub const ALL: Listing = Listing {
        recursive: true,
        hidden: true,
    };
}

/// An open workspace.
pub struct Workspace {
    dir: OwnedFd,
    owner: (Uid, Gid),
}

impl Workspace {
    /// Opens the workspace at `relative` below `trusted` (for the gateway, see its
    /// `SandboxHandle::workspace_root`).
    pub fn open(trusted: &Path, relative: &Path) -> Result<Workspace, WorkspaceError> {
        let what = "open the workspace";
        let root = rustix::fs::open(
            trusted,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_error(what, "", e))?;
        let dir = if relative == Path::new(".") {
            root
        } else {
            // The sandbox's root is one mount and its workspace another: no NO_XDEV here.
            rustix::fs::openat2(
                &root,
                relative,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            )
            .map_err(|e| io_error(what, "", e))?
        };
        let stat = rustix::fs::fstat(&dir).map_err(|e| io_error(what, "", e))?;
        Ok(Workspace {
            dir,
            owner: (Uid::from_raw(stat.st_uid), Gid::from_raw(stat.st_gid)),
        })
    }

    /// Takes the workspace owner's identity on this thread while creating files: a tmpfs
    /// mounted inside the sandbox's user namespace refuses (EOVERFLOW) to create an inode
    /// for a uid it cannot map, such as the gateway's root.
    fn as_owner(&self) -> Result<AsOwner, WorkspaceError> {
        AsOwner::enter(self.owner)
    }

    /// Opens the directory `parts` (all of them), creating missing ones when `create`.
    fn open_dir(
        &self,
        parts: &[&str],
        create: bool,
        shown: &str,
    ) -> Result<OwnedFd, WorkspaceError> {
        let mut current = rustix::fs::openat2(
            &self.dir,
            ".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            resolve(),
        )
        .map_err(|e| io_error("open", shown, e))?;
        for part in parts {
            let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
            current = match rustix::fs::openat2(&current, *part, flags, Mode::empty(), resolve()) {
                Ok(fd) => fd,
                // A file where a directory must be made.
                Err(rustix::io::Errno::NOTDIR) if create => {
                    return Err(WorkspaceError::Exists(shown.to_owned()))
                }
                Err(rustix::io::Errno::NOENT) if create => {
                    match rustix::fs::mkdirat(&current, *part, Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(io_error("create directory", shown, e)),
                    }
                    rustix::fs::openat2(&current, *part, flags, Mode::empty(), resolve())
                        .map_err(|e| io_error("open", shown, e))?
                }
                Err(e) => return Err(io_error("open", shown, e)),
            };
        }
        Ok(current)
    }

    /// Opens a regular file for reading; returns it and its size.
    pub fn open_read(&self, path: &str) -> Result<(File, u64), WorkspaceError> {
        let parts = check_path(path)?;
        let (name, dirs) = parts
            .split_last()
            .ok_or(WorkspaceError::NotFound(path.to_owned()))?;
        let dir = self.open_dir(dirs, false, path)?;
        let fd = rustix::fs::openat2(
            &dir,
            *name,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK,
            Mode::empty(),
            resolve(),
        )
        .map_err(|e| io_error("open", path, e))?;
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_error("stat", path, e))?;
        let kind = rustix::fs::FileType::from_raw_mode(stat.st_mode);
        if kind != rustix::fs::FileType::RegularFile {
            // A FIFO would block the reader forever; a device is none of our business.
            return Err(if kind == rustix::fs::FileType::Directory {
                WorkspaceError::IsADirectory(path.to_owned())
            } else {
                WorkspaceError::NotAFile(path.to_owned())
            });
        }
        Ok((File::from(fd), stat.st_size as u64))
    }

    /// Starts writing `path` (parent directories are created); nothing is visible at
    /// `path` until [`Upload::commit`].
    pub fn create(&self, path: &str) -> Result<Upload<'_>, WorkspaceError> {
        let parts = check_path(path)?;
        let _identity = self.as_owner()?;
        let (name, dirs) = parts
            .split_last()
            .ok_or(WorkspaceError::NotFound(path.to_owned()))?;
        let dir = self.open_dir(dirs, true, path)?;
        let temp = format!(".cellgate-upload-{}", random_hex()?);
        let fd = rustix::fs::openat2(
            &dir,
            temp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
            resolve(),
        )
        .map_err(|e| io_error("create", path, e))?;
        Ok(Upload {
            workspace: self,
            dir,
            temp,
            name: (*name).to_owned(),
            path: path.to_owned(),
            file: Some(File::from(fd)),
            written: 0,
        })
    }

    /// What is at `path` (a link is reported as one, never followed).
    pub fn stat(&self, path: &str) -> Result<FileEntry, WorkspaceError> {
        let parts = check_path(path)?;
        let (name, dirs) = split(&parts, path)?;
        let dir = self.open_dir(dirs, false, path)?;
        let stat = rustix::fs::statat(&dir, *name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_error("stat", path, e))?;
        Ok(FileEntry::from_stat(parts.join("/"), &stat))
    }

    /// Creates the directory `path` and any missing parent; an existing directory is fine,
    /// anything else at `path` is [`WorkspaceError::Exists`].
    pub fn make_dir(&self, path: &str) -> Result<FileEntry, WorkspaceError> {
        let parts = check_path(path)?;
        let _identity = self.as_owner()?;
        match self.open_dir(&parts, true, path) {
            Ok(_) => self.stat(path),
            // Something that is not a directory stands in the way (ENOTDIR reads as
            // NotFound on the way down; the last component is checked here).
            Err(err) => match self.stat(path) {
                Ok(entry) if entry.kind != "dir" => Err(WorkspaceError::Exists(path.to_owned())),
                _ => Err(err),
            },
        }
    }

    /// Removes `path`: a file or link (the link itself), or a directory (with its contents
    /// only when `recursive`; otherwise it must be empty). Returns how many entries went.
    pub fn remove(&self, path: &str, recursive: bool) -> Result<u64, WorkspaceError> {
        let parts = check_path(path)?;
        let (name, dirs) = split(&parts, path)?;
        let dir = self.open_dir(dirs, false, path)?;
        let stat = rustix::fs::statat(&dir, *name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_error("remove", path, e))?;
        let is_dir =
            rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::Directory;
        let mut removed = 0;
        if is_dir && recursive {
            let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
            let sub = rustix::fs::openat2(&dir, *name, flags, Mode::empty(), resolve())
                .map_err(|e| io_error("remove", path, e))?;
            let mut budget = MAX_REMOVE_ENTRIES;
            removed += self.empty_dir(&sub, path, 0, &mut budget)?;
        }
        let flags = if is_dir {
            rustix::fs::AtFlags::REMOVEDIR
        } else {
            rustix::fs::AtFlags::empty()
        };
        rustix::fs::unlinkat(&dir, *name, flags).map_err(|e| io_error("remove", path, e))?;
        Ok(removed + 1)
    }

    /// Removes everything in `dir` (whose path is `shown`), depth first, never following a
    /// link: a link is unlinked, the directory it pointed to untouched. Names are read and
    /// removed [`REMOVE_BATCH`] at a time (a kernel can make a directory of millions), and
    /// `budget` bounds the entries one removal may take.
    fn empty_dir(
        &self,
        dir: &OwnedFd,
        shown: &str,
        depth: usize,
        budget: &mut u64,
    ) -> Result<u64, WorkspaceError> {
        if depth > MAX_DEPTH {
            return Err(WorkspaceError::BadPath {
                path: shown.chars().take(200).collect(),
                reason: "nested too deep to remove",
            });
        }
        let mut removed = 0;
        loop {
            let names = read_names(dir, "remove", shown, REMOVE_BATCH)?;
            if names.is_empty() {
                return Ok(removed);
            }
            for name in names {
                if *budget == 0 {
                    return Err(WorkspaceError::BadPath {
                        path: shown.chars().take(200).collect(),
                        reason:
                            "holds more entries than one removal takes (remove its parts first)",
                    });
                }
                let shown_child = format!("{shown}/{}", name.to_string_lossy());
                let stat =
                    match rustix::fs::statat(dir, &name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(stat) => stat,
                        // The kernel removed it meanwhile.
                        Err(rustix::io::Errno::NOENT) => continue,
                        Err(e) => return Err(io_error("remove", &shown_child, e)),
                    };
                let flags = if rustix::fs::FileType::from_raw_mode(stat.st_mode)
                    == rustix::fs::FileType::Directory
                {
                    let sub = rustix::fs::openat2(
                        dir,
                        &name,
                        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                        Mode::empty(),
                        resolve(),
                    )
                    .map_err(|e| io_error("remove", &shown_child, e))?;
                    removed += self.empty_dir(&sub, &shown_child, depth + 1, budget)?;
                    rustix::fs::AtFlags::REMOVEDIR
                } else {
                    rustix::fs::AtFlags::empty()
                };
                match rustix::fs::unlinkat(dir, &name, flags) {
                    Ok(()) => {
                        removed += 1;
                        *budget -= 1;
                    }
                    Err(rustix::io::Errno::NOENT) => {}
                    Err(e) => return Err(io_error("remove", &shown_child, e)),
                }
            }
        }
    }

    /// Moves `from` to `to` (parents of `to` are created). A link moves as a link. Without
    /// `overwrite`, anything at `to` is [`WorkspaceError::Exists`]; with it, a file or
    /// link at `to` is replaced (a directory only by a directory, and only if empty).
    pub fn rename(
        &self,
        from: &str,
        to: &str,
        overwrite: bool,
    ) -> Result<FileEntry, WorkspaceError> {
        let from_parts = check_path(from)?;
        let to_parts = check_path(to)?;
        if to_parts.len() > from_parts.len() && to_parts[..from_parts.len()] == from_parts[..] {
            return Err(WorkspaceError::BadPath {
                path: to.chars().take(200).collect(),
                reason: "a directory cannot move into itself",
            });
        }
        let (from_name, from_dirs) = split(&from_parts, from)?;
        let (to_name, to_dirs) = split(&to_parts, to)?;
        let source = self.open_dir(from_dirs, false, from)?;
        // Checked first so that a missing source does not leave new directories behind.
        rustix::fs::statat(&source, *from_name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_error("move", from, e))?;
        let _identity = self.as_owner()?;
        let target = self.open_dir(to_dirs, true, to)?;
        let flags = if overwrite {
            rustix::fs::RenameFlags::empty()
        } else {
            rustix::fs::RenameFlags::NOREPLACE
        };
        rustix::fs::renameat_with(&source, *from_name, &target, *to_name, flags).map_err(|e| {
            match e {
                rustix::io::Errno::NOENT => WorkspaceError::NotFound(from.to_owned()),
                // A directory onto a file.
                rustix::io::Errno::NOTDIR => WorkspaceError::Exists(to.to_owned()),
                // Moving a directory below itself, or onto a link's own directory.
                rustix::io::Errno::INVAL => WorkspaceError::BadPath {
                    path: to.chars().take(200).collect(),
                    reason: "a directory cannot move into itself",
                },
                e => io_error("move", to, e),
            }
        })?;
        drop(_identity);
        self.stat(to)
    }

    /// Files and directories in `dir` ("" for the whole workspace): its own entries, or
    /// everything below it depth first (`listing`), at most [`MAX_LIST_ENTRIES`]. Links are
    /// listed as `symlink`, never followed. Names starting with a dot are skipped, their
    /// trees unwalked, unless `listing.hidden`.
    pub fn list(&self, dir: &str, listing: Listing) -> Result<Vec<FileEntry>, WorkspaceError> {
        let parts = if dir.is_empty() {
            Vec::new()
        } else {
            check_path(dir)?
        };
        let start = self.open_dir(&parts, false, dir)?;
        let prefix = parts.join("/");
        let mut out = Vec::new();
        self.walk(&start, &prefix, 0, listing, &mut out)?;
        Ok(out)
    }

    fn walk(
        &self,
        dir: &OwnedFd,
        prefix: &str,
        depth: usize,
        listing: Listing,
        out: &mut Vec<FileEntry>,
    ) -> Result<(), WorkspaceError> {
        if depth > MAX_DEPTH {
            return Ok(());
        }
        let mut names = Vec::new();
        for name in read_names(dir, "list", prefix, usize::MAX)? {
            let name = name.to_string_lossy().into_owned();
            if name.starts_with(".cellgate-upload-") {
                continue;
            }
            if !listing.hidden && name.starts_with('.') {
                continue;
            }
            names.push(name);
        }
        names.sort();
        for name in names {
            if out.len() >= MAX_LIST_ENTRIES {
                return Ok(());
            }
            let Ok(stat) =
                rustix::fs::statat(dir, name.as_str(), rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            else {
                continue;
            };
            let path = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            let entry = FileEntry::from_stat(path.clone(), &stat);
            let kind = entry.kind;
            out.push(entry);
            if kind == "dir" && listing.recursive {
                let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
                if let Ok(sub) =
                    rustix::fs::openat2(dir, name.as_str(), flags, Mode::empty(), resolve())
                {
                    self.walk(&sub, &path, depth + 1, listing, out)?;
                }
            }
        }
        Ok(())
    }
}

/// The calling thread runs with the workspace owner's effective uid and gid until this is
/// dropped (only when the gateway is root and the owner is not; otherwise a no-op). Linux
/// keeps credentials per thread and rustix's calls are the raw per-thread syscalls, so no
/// other thread of the gateway is affected; the saved uid stays 0 to switch back.
struct AsOwner {
    switched: bool,
}

impl AsOwner {
    fn enter((uid, gid): (Uid, Gid)) -> Result<AsOwner, WorkspaceError> {
        let root = rustix::process::geteuid().is_root();
        if !root || uid.is_root() {
            return Ok(AsOwner { switched: false });
        }
        let fail = |source: rustix::io::Errno| WorkspaceError::Io {
            what: "take the sandbox user's identity".to_owned(),
            source: source.into(),
        };
        rustix::thread::set_thread_res_gid(None, gid, None).map_err(fail)?;
        if let Err(err) = rustix::thread::set_thread_res_uid(None, uid, None) {
            let _ = rustix::thread::set_thread_res_gid(None, Gid::ROOT, None);
            return Err(fail(err));
        }
        Ok(AsOwner { switched: true })
    }
}

impl Drop for AsOwner {
    fn drop(&mut self) {
        if !self.switched {
            return;
        }
        let uid = rustix::thread::set_thread_res_uid(None, Uid::ROOT, None);
        let gid = rustix::thread::set_thread_res_gid(None, Gid::ROOT, None);
        if uid.is_err() || gid.is_err() {
            // A pool thread left with the sandbox's identity would make later work fail
            // in confusing ways; this cannot happen with the saved uid 0, so stop loudly.
            eprintln!("cellgate: cannot return to root's identity after a workspace write");
            std::process::abort();
        }
    }
}

/// A file being written; removed unless committed.
pub struct Upload<'a> {
    workspace: &'a Workspace,
    dir: OwnedFd,
    temp: String,
    name: String,
    path: String,
    file: Option<File>,
    written: u64,
}

impl Upload<'_> {
    /// Appends `chunk`, refusing to grow past `limit` bytes.
    pub fn write(&mut self, chunk: &[u8], limit: u64) -> Result<(), WorkspaceError> {
        self.written += chunk.len() as u64;
        if self.written > limit {
            return Err(WorkspaceError::TooLarge { limit });
        }
        let file = self.file.as_mut().ok_or(WorkspaceError::Unavailable)?;
        file.write_all(chunk)
            .map_err(|err| match err.raw_os_error() {
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => WorkspaceError::NoSpace,
                _ => WorkspaceError::Io {
                    what: format!("write {}", self.path),
                    source: err,
                },
            })
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    /// Moves the file into place (replacing a file, or a link, never following it).
    pub fn commit(mut self) -> Result<u64, WorkspaceError> {
        let file = self.file.take().ok_or(WorkspaceError::Unavailable)?;
        drop(file);
        let _identity = self.workspace.as_owner()?;
        rustix::fs::renameat(&self.dir, self.temp.as_str(), &self.dir, self.name.as_str())
            .map_err(|e| io_error("store", &self.path, e))?;
        self.temp.clear();
        Ok(self.written)
    }
}

impl Drop for Upload<'_> {
    fn drop(&mut self) {
        if !self.temp.is_empty() {
            let _identity = self.workspace.as_owner();
            let _ =
                rustix::fs::unlinkat(&self.dir, self.temp.as_str(), rustix::fs::AtFlags::empty());
        }
    }
}

impl WorkspaceError {
    /// This error as the agent sends it to the gateway.
    pub fn to_wire(&self) -> FileFailure {
        let kind = match self {
            WorkspaceError::BadPath { .. } => FailureKind::BadPath,
            WorkspaceError::NotFound(_) => FailureKind::NotFound,
            WorkspaceError::Link(_) => FailureKind::Link,
            WorkspaceError::NotAFile(_) => FailureKind::NotAFile,
            WorkspaceError::IsADirectory(_) => FailureKind::IsADirectory,
            WorkspaceError::TooLarge { .. } => FailureKind::TooLarge,
            WorkspaceError::NoSpace => FailureKind::NoSpace,
            WorkspaceError::Exists(_) => FailureKind::Exists,
            WorkspaceError::NotEmpty(_) => FailureKind::NotEmpty,
            WorkspaceError::PermissionDenied(_) => FailureKind::PermissionDenied,
            WorkspaceError::Unavailable => FailureKind::Unavailable,
            WorkspaceError::Io { .. } => FailureKind::Io,
        };
        FileFailure {
            kind,
            message: self.to_string(),
        }
    }

    /// The gateway's error for what the agent reported about `path` (its message is the
    /// guest's, shown as such; `limit` is the upload limit the gateway asked for).
    pub fn from_wire(failure: FileFailure, path: &str, limit: u64) -> WorkspaceError {
        let path = path.to_owned();
        match failure.kind {
            FailureKind::BadPath => WorkspaceError::BadPath {
                path,
                reason: "refused by the guest",
            },
            FailureKind::NotFound => WorkspaceError::NotFound(path),
            FailureKind::Link => WorkspaceError::Link(path),
            FailureKind::NotAFile => WorkspaceError::NotAFile(path),
            FailureKind::IsADirectory => WorkspaceError::IsADirectory(path),
            FailureKind::TooLarge => WorkspaceError::TooLarge { limit },
            FailureKind::NoSpace => WorkspaceError::NoSpace,
            FailureKind::Exists => WorkspaceError::Exists(path),
            FailureKind::NotEmpty => WorkspaceError::NotEmpty(path),
            FailureKind::PermissionDenied => WorkspaceError::PermissionDenied(path),
            FailureKind::Unavailable => WorkspaceError::Unavailable,
            FailureKind::Io => WorkspaceError::Io {
                what: format!("{path} in the guest"),
                source: std::io::Error::other(
                    failure.message.chars().take(512).collect::<String>(),
                ),
            },
        }
    }
}

impl FileEntry {
    fn from_stat(path: String, stat: &rustix::fs::Stat) -> FileEntry {
        FileEntry {
            path,
            kind: kind_of(stat),
            size: stat.st_size as u64,
            mtime_s: stat.st_mtime,
            mtime_ns: stat.st_mtime_nsec as i64,
        }
    }

    /// This entry as it crosses the link.
    pub fn to_wire(&self) -> WireEntry {
        WireEntry {
            path: self.path.clone(),
            kind: self.kind.to_owned(),
            size: self.size,
            mtime_s: self.mtime_s,
            mtime_ns: self.mtime_ns,
        }
    }

    /// An entry the guest listed (an unknown kind is `other`).
    pub fn from_wire(entry: WireEntry) -> FileEntry {
        let kind = match entry.kind.as_str() {
            "file" => "file",
            "dir" => "dir",
            "symlink" => "symlink",
            _ => "other",
        };
        FileEntry {
            path: entry.path,
            kind,
            size: entry.size,
            mtime_s: entry.mtime_s,
            mtime_ns: entry.mtime_ns,
        }
    }
}

fn kind_of(stat: &rustix::fs::Stat) -> &'static str {
    match rustix::fs::FileType::from_raw_mode(stat.st_mode) {
        rustix::fs::FileType::RegularFile => "file",
        rustix::fs::FileType::Directory => "dir",
        rustix::fs::FileType::Symlink => "symlink",
        _ => "other",
    }
}

/// 128 random bits in hex, for names the sandbox cannot guess and squat.
fn random_hex() -> Result<String, WorkspaceError> {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        filled +=
            rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty())
                .map_err(|source| WorkspaceError::Io {
                    what: "getrandom".to_owned(),
                    source: source.into(),
                })?;
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
#[path = "workspace_tests.rs"]
mod tests;
