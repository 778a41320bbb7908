//! The sandbox's file system: a fresh, read-only root that holds only what the kernel needs.
//!
//! Runs in the sandbox's init (PID 1 of the new pid namespace), inside the new mount and user
//! namespaces, in two steps:
//!
//! 1. [`RootFs::prepare`], while the init still has the gateway's file-system identity: every
//!    host path the sandbox will see is opened with `O_PATH`. After that the init switches to
//!    the sandbox uid (an unprivileged host uid when the gateway is root), which could not
//!    even traverse `/root` to reach a pyenv interpreter; the open descriptors, used as bind
//!    sources through `/proc/self/fd/N`, make that unnecessary and also pin the exact files
//!    the gateway named (no symlink swapped in between the check and the mount).
//! 2. [`RootFs::build`]: make every mount private (nothing propagates back to the host),
//!    mount a small tmpfs on `/tmp` as the new root (inside our private mount namespace, so
//!    the host's `/tmp` is untouched), create the tree in it, `pivot_root` into it, detach
//!    the old root, and remount the new root read-only.
//!
//! What the tree contains, and nothing else: `/usr` and the merged-usr links (`/bin`, `/lib`,
//! …; bound read-only where a host has real directories), a generated `/etc` (passwd and group
//! with the sandbox user, hosts with localhost, no `resolv.conf`) plus a few read-only host
//! files the C library and Python read (`ld.so.cache`, certificates, fonts, time zone, MIME
//! types, alternatives), `/dev` with null, zero, full, random, urandom and tty bound from the
//! host, a private devpts and `/dev/shm`, a fresh `/proc` for the new pid namespace (its
//! host-wide `boot_id` and `cmdline` masked by files of the sandbox's own), a
//! size-limited private `/tmp`, the size-limited tmpfs workspace at `/home/user`, the
//! kernel's runtime directory (a small tmpfs of its own at `/run/cellgate` holding the
//! connection file and the kernel's ipc sockets, which the gateway reaches through the
//! helper's `/proc/<pid>/root`), the Python environment (read-only overlays at
//! `/opt/cellgate`: see `sandbox::relocate`) and the files the command names (read-only,
//! same paths). Nothing the kernel can read names a host directory: the runtime directory
//! and the Python environment are not binds, whose `mountinfo` lines give their host paths.
//! No `/sys`, `/run`, `/var/run`, `/home`, `/root` contents, host `/tmp`, gateway files or
//! other kernels' directories: every host unix socket visible inside would be a way out, so
//! none is.
//!
//! Mount points are created in order of path depth, so a mount never hides a shallower one's
//! contents (the workspace may live under the runtime root, or under `/tmp` in tests).

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use super::plan::{Plan, Role};
use super::sys::{self, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY};
use crate::sandbox::relocate::{self, VenvEntry};
use crate::sandbox::rootfs::{self, ETC_ENTRIES, USR_LINKS};

/// Where the new root is assembled before `pivot_root`. Mounting over `/tmp` only affects our
/// own mount namespace and needs no directory to be created on the host.
const STAGING: &str = "/tmp";

/// Size of the runtime directory's tmpfs: the connection file and the kernel's ipc sockets.
const RUNTIME_TMPFS_BYTES: u64 = 1 << 20;

/// Size of the root tmpfs: generated `/etc` files and mount points only.
const ROOT_TMPFS_OPTIONS: &str = "mode=0755,size=4m,nr_inodes=4096";

/// Device nodes bound from the host's `/dev`.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

enum Op {
    /// Bind-mount an opened host file or directory (recursively) at `target`.
    Bind {
        target: PathBuf,
        source: OwnedFd,
        is_dir: bool,
        attrs: u64,
    },
    /// A read-only overlay of an opened host directory at `target`: the same files as a
    /// bind, but a mount of its own, whose `/proc/self/mountinfo` line gives `/` as its
    /// root and `/proc/self/fd/N` as its layers, where a bind gives the host path.
    Overlay {
        target: PathBuf,
        source: OwnedFd,
        attrs: u64,
    },
    Symlink {
        target: PathBuf,
        points_to: PathBuf,
    },
    Tmpfs {
        target: PathBuf,
        flags: libc::c_ulong,
        options: String,
    },
    Proc {
        target: PathBuf,
    },
    Devpts {
        target: PathBuf,
    },
    File {
        target: PathBuf,
        contents: String,
        mode: u32,
    },
    /// Hide an existing file (a host-wide `/proc` entry) behind a read-only file of
    /// `contents`.
    Mask {
        target: PathBuf,
        contents: String,
    },
}

impl Op {
    fn target(&self) -> &Path {
        match self {
            Op::Bind { target, .. }
            | Op::Overlay { target, .. }
            | Op::Symlink { target, .. }
            | Op::Tmpfs { target, .. }
            | Op::Proc { target }
            | Op::Devpts { target }
            | Op::File { target, .. }
            | Op::Mask { target, .. } => target,
        }
    }
}

/// The sandbox's root file system, with every host source already opened.
pub struct RootFs {
    ops: Vec<Op>,
}

/// Error context for one failed step.
fn ctx(what: String) -> impl FnOnce(io::Error) -> io::Error {
    move |err| io::Error::new(err.kind(), format!("{what}: {err}"))
}

impl RootFs {
    /// Opens every host source. Runs before the init drops the gateway's file-system identity.
    pub fn prepare(plan: &Plan) -> io::Result<RootFs> {
        let mut ops = Vec::new();
        let ro = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
        host_system(&mut ops, plan, ro)?;
        devices(&mut ops, plan)?;
        private_dirs(&mut ops, plan);
        python_env(&mut ops, plan, ro)?;
        // Shallow mounts first; the sort is stable, so equal depths keep the order of the
        // steps above.
        ops.sort_by_key(|op| depth(op.target()));
        Ok(RootFs { ops })
    }

    /// Builds the tree and pivots into it. Needs CAP_SYS_ADMIN in the user namespace that owns
    /// the mount namespace, and runs as PID 1 of the new pid namespace (for `/proc`).
    pub fn build(self) -> io::Result<()> {
        let staging = Path::new(STAGING);
        sys::mount(
            None,
            Path::new("/"),
            None,
            libc::MS_REC | libc::MS_PRIVATE,
            None,
        )
        .map_err(ctx("make / private".into()))?;
        sys::mount(
            Some(Path::new("tmpfs")),
            staging,
            Some("tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV,
            Some(ROOT_TMPFS_OPTIONS),
        )
        .map_err(ctx("mount the root tmpfs".into()))?;

        for op in self.ops {
            let at = staging.join(relative(op.target()));
            apply(op, &at)?;
        }

        // /dev is complete: make its tmpfs read-only (pts and shm are mounts of their own).
        sys::mount_setattr(
            &staging.join("dev"),
            MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC,
            false,
        )
        .map_err(ctx("make /dev read-only".into()))?;

        std::env::set_current_dir(staging).map_err(ctx("enter the new root".into()))?;
        sys::pivot_root(Path::new("."), Path::new(".")).map_err(ctx("pivot_root".into()))?;
        sys::umount_detach(Path::new(".")).map_err(ctx("detach the old root".into()))?;
        std::env::set_current_dir("/").map_err(ctx("chdir /".into()))?;
        sys::mount_setattr(
            Path::new("/"),
            MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
            false,
        )
        .map_err(ctx("make / read-only".into()))?;
        Ok(())
    }
}

/// The host's system files, read-only: `/usr` and the merged-usr links (bound where a host
/// has real directories), the host `/etc` entries the C library and Python read, and the
/// generated `/etc` files with the sandbox's own user and hosts.
fn host_system(ops: &mut Vec<Op>, plan: &Plan, ro: u64) -> io::Result<()> {
    ops.push(bind(Path::new("/usr"), ro)?);
    for entry in USR_LINKS {
        if let Some(op) = mirror(&Path::new("/").join(entry), ro)? {
            ops.push(op);
        }
    }
    for entry in ETC_ENTRIES {
        if let Some(op) = mirror(Path::new(entry), ro)? {
            ops.push(op);
        }
    }
    for file in etc_files(plan) {
        ops.push(file);
    }
    Ok(())
}

/// A `/dev` of its own: a small tmpfs with only the harmless host devices bound in, the
/// usual links, a private devpts instance (no host terminal reachable) and a `/dev/shm`
/// sized like `/tmp`.
fn devices(ops: &mut Vec<Op>, plan: &Plan) -> io::Result<()> {
    ops.push(Op::Tmpfs {
        target: "/dev".into(),
        flags: libc::MS_NOSUID | libc::MS_NOEXEC,
        options: "mode=0755,size=64k,nr_inodes=64".into(),
    });
    for device in DEVICES {
        let host = Path::new("/dev").join(device);
        if host.exists() {
            ops.push(bind(&host, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC)?);
        }
    }
    for (name, points_to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        ops.push(Op::Symlink {
            target: Path::new("/dev").join(name),
            points_to: points_to.into(),
        });
    }
    ops.push(Op::Devpts {
        target: "/dev/pts".into(),
    });
    ops.push(Op::Tmpfs {
        target: "/dev/shm".into(),
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        options: format!("mode=1777,size={}", plan.tmp_bytes),
    });
    Ok(())
}

/// The sandbox's private, writable or per-sandbox directories: a fresh `/proc` with its
/// host-wide entries masked, a size-limited `/tmp`, the workspace, and the runtime
/// directory (with the connection file). None of them is a host directory.
fn private_dirs(ops: &mut Vec<Op>, plan: &Plan) {
    ops.push(Op::Proc {
        target: "/proc".into(),
    });
    // A zygote's `/proc` stays whole: Linux lets a user namespace mount a `/proc` only
    // where one is fully visible already, and each sandbox forked from the zygote mounts
    // its own (masked) one. The zygote runs no tenant code.
    if plan.role != Role::Zygote {
        ops.extend(proc_masks());
    }
    ops.push(Op::Tmpfs {
        target: "/tmp".into(),
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        options: format!("mode=1777,size={}", plan.tmp_bytes),
    });
    ops.push(Op::Symlink {
        target: "/var/tmp".into(),
        points_to: "/tmp".into(),
    });
    ops.push(Op::Tmpfs {
        target: plan.workspace.clone(),
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        options: format!(
            "mode=0700,size={},uid={},gid={}",
            plan.workspace_bytes, plan.uid, plan.gid
        ),
    });
    ops.push(Op::Tmpfs {
        target: plan.runtime_dir_inside.clone(),
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        options: format!(
            "mode=0700,size={RUNTIME_TMPFS_BYTES},nr_inodes=64,uid={},gid={}",
            plan.uid, plan.gid
        ),
    });
    if let Some(file) = &plan.connection_file {
        ops.push(Op::File {
            target: file.path.clone(),
            contents: file.contents.clone(),
            mode: 0o600,
        });
    }
}

/// The command's files and the Python environment, read-only at their fixed places, with
/// the venv's generated files and links, and last the directories masked inside them.
fn python_env(ops: &mut Vec<Op>, plan: &Plan, ro: u64) -> io::Result<()> {
    for dir in &plan.ro_binds {
        ops.push(bind(dir, ro)?);
    }
    // A forked kernel's sources are the zygote's overlays: bound, not overlaid again
    // (Linux stacks at most two file systems, and a container's root may be one), and a
    // bind of an overlay's root names no host path in mountinfo either.
    let shown_at = if plan.role == Role::Forked {
        bind_at
    } else {
        overlay_at
    };
    if let Some(prefix) = &plan.python_prefix {
        ops.push(shown_at(prefix, Path::new(relocate::PYTHON), ro)?);
    }
    for entry in &plan.venv {
        ops.push(match entry {
            VenvEntry::File {
                inside,
                contents,
                executable,
            } => Op::File {
                target: inside.clone(),
                contents: contents.clone(),
                mode: if *executable { 0o755 } else { 0o644 },
            },
            VenvEntry::Symlink { inside, points_to } => Op::Symlink {
                target: inside.clone(),
                points_to: points_to.clone(),
            },
            VenvEntry::Bind { host, inside } => shown_at(host, inside, ro)?,
        });
    }
    for dir in &plan.masked {
        // Deeper than the bind it sits in, so the depth sort mounts it afterwards.
        ops.push(Op::Tmpfs {
            target: dir.clone(),
            flags: libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            options: "mode=0755,size=4k,nr_inodes=4".into(),
        });
    }
    Ok(())
}

fn apply(op: Op, at: &Path) -> io::Result<()> {
    match op {
        Op::Bind {
            target,
            source,
            is_dir,
            attrs,
        } => apply_bind(&target, source, is_dir, attrs, at)?,
        Op::Overlay {
            target,
            source,
            attrs,
        } => apply_overlay(&target, source, attrs, at)?,
        Op::Symlink { target, points_to } => {
            make_parent(at)?;
            std::os::unix::fs::symlink(&points_to, at)
                .map_err(ctx(format!("symlink {}", target.display())))?;
        }
        Op::Tmpfs {
            target,
            flags,
            options,
        } => {
            make_mount_point(at, true).map_err(ctx(format!("mount point {}", target.display())))?;
            sys::mount(
                Some(Path::new("tmpfs")),
                at,
                Some("tmpfs"),
                flags,
                Some(&options),
            )
            .map_err(ctx(format!("tmpfs on {}", target.display())))?;
        }
        Op::Proc { target } => {
            make_mount_point(at, true).map_err(ctx(format!("mount point {}", target.display())))?;
            sys::mount(
                Some(Path::new("proc")),
                at,
                Some("proc"),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                None,
            )
            .map_err(ctx("mount /proc".into()))?;
        }
        Op::Devpts { target } => {
            make_mount_point(at, true).map_err(ctx(format!("mount point {}", target.display())))?;
            sys::mount(
                Some(Path::new("devpts")),
                at,
                Some("devpts"),
                libc::MS_NOSUID | libc::MS_NOEXEC,
                Some("newinstance,ptmxmode=0666,mode=0620"),
            )
            .map_err(ctx("mount /dev/pts".into()))?;
        }
        Op::File {
            target,
            contents,
            mode,
        } => {
            make_parent(at)?;
            fs::write(at, contents).map_err(ctx(format!("write {}", target.display())))?;
            fs::set_permissions(at, fs::Permissions::from_mode(mode))?;
        }
        Op::Mask { target, contents } => apply_mask(&target, contents, at)?,
    }
    Ok(())
}

/// Binds an opened host source through `/proc/self/fd/N`, so the mount is of the file the
/// gateway opened (no path looked up again), then sets its flags on the whole subtree.
fn apply_bind(
    target: &Path,
    source: OwnedFd,
    is_dir: bool,
    attrs: u64,
    at: &Path,
) -> io::Result<()> {
    make_mount_point(at, is_dir).map_err(ctx(format!("mount point {}", target.display())))?;
    let source_path = PathBuf::from(format!("/proc/self/fd/{}", source.as_raw_fd()));
    sys::mount(
        Some(&source_path),
        at,
        None,
        libc::MS_BIND | libc::MS_REC,
        None,
    )
    .map_err(ctx(format!("bind {}", target.display())))?;
    sys::mount_setattr(at, attrs, true)
        .map_err(ctx(format!("set flags on {}", target.display())))?;
    drop(source);
    Ok(())
}

/// Mounts a read-only overlay of an opened host directory: the same files as a bind, but
/// a mount whose `mountinfo` line names no host path.
fn apply_overlay(target: &Path, source: OwnedFd, attrs: u64, at: &Path) -> io::Result<()> {
    make_mount_point(at, true).map_err(ctx(format!("mount point {}", target.display())))?;
    // overlayfs wants two layers when it has no upper one; the second is the empty
    // mount point itself, which the overlay then covers.
    let empty = sys::open_path(at).map_err(ctx(format!("open {}", target.display())))?;
    let options = format!(
        "lowerdir=/proc/self/fd/{}:/proc/self/fd/{}",
        source.as_raw_fd(),
        empty.as_raw_fd()
    );
    sys::mount(
        Some(Path::new("overlay")),
        at,
        Some("overlay"),
        libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        Some(&options),
    )
    .map_err(ctx(format!("overlay on {}", target.display())))?;
    sys::mount_setattr(at, attrs, false)
        .map_err(ctx(format!("set flags on {}", target.display())))?;
    drop((source, empty));
    Ok(())
}

/// Hides a host-wide file behind a read-only file of the sandbox's own.
fn apply_mask(target: &Path, contents: String, at: &Path) -> io::Result<()> {
    // Written beside the new root's top, bound over the target, then unlinked: the
    // mount keeps the file, and nothing else shows it.
    let name = target.to_string_lossy().replace('/', "_");
    let source = Path::new(STAGING).join(format!(".mask{name}"));
    fs::write(&source, contents).map_err(ctx(format!("write the mask of {}", target.display())))?;
    fs::set_permissions(&source, fs::Permissions::from_mode(0o444))?;
    sys::mount(Some(&source), at, None, libc::MS_BIND, None)
        .map_err(ctx(format!("mask {}", target.display())))?;
    sys::mount_setattr(
        at,
        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        false,
    )
    .map_err(ctx(format!("set flags on {}", target.display())))?;
    fs::remove_file(&source).map_err(ctx(format!("remove the mask of {}", target.display())))?;
    Ok(())
}

/// A bind of an existing host file or directory at its own path, opened now.
fn bind(host: &Path, attrs: u64) -> io::Result<Op> {
    bind_at(host, host, attrs)
}

/// A bind of an existing host file or directory at `target`, opened now.
fn bind_at(host: &Path, target: &Path, attrs: u64) -> io::Result<Op> {
    let source = sys::open_path(host).map_err(ctx(format!("open {}", host.display())))?;
    let meta = fs::metadata(format!("/proc/self/fd/{}", source.as_raw_fd()))
        .map_err(ctx(format!("stat {}", host.display())))?;
    Ok(Op::Bind {
        target: target.to_path_buf(),
        source,
        is_dir: meta.is_dir(),
        attrs,
    })
}

/// A read-only overlay of a host directory at `target`, opened now; a file is bound.
fn overlay_at(host: &Path, target: &Path, attrs: u64) -> io::Result<Op> {
    match bind_at(host, target, attrs)? {
        Op::Bind {
            target,
            source,
            is_dir: true,
            attrs,
        } => Ok(Op::Overlay {
            target,
            source,
            attrs,
        }),
        file => Ok(file),
    }
}

/// The host entry as it is: the same symlink, or a bind of the file or directory; nothing
/// when the host has no such entry.
fn mirror(host: &Path, attrs: u64) -> io::Result<Option<Op>> {
    match fs::symlink_metadata(host) {
        Ok(meta) if meta.file_type().is_symlink() => Ok(Some(Op::Symlink {
            target: host.to_path_buf(),
            points_to: fs::read_link(host)?,
        })),
        Ok(_) => bind(host, attrs).map(Some),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(ctx(format!("stat {}", host.display()))(err)),
    }
}

/// `/proc` files that are the same for every process of the host and would tell one sandbox
/// which machine (and which boot of it) it shares with another: a boot id of the sandbox's
/// own, and a kernel command line that names nothing of the host's (its disks, consoles,
/// image paths).
fn proc_masks() -> Vec<Op> {
    vec![
        Op::Mask {
            target: "/proc/sys/kernel/random/boot_id".into(),
            contents: format!("{}\n", uuid::Uuid::new_v4().hyphenated()),
        },
        Op::Mask {
            target: "/proc/cmdline".into(),
            contents: "quiet\n".to_owned(),
        },
    ]
}

/// The generated `/etc` files (see `sandbox::rootfs`).
fn etc_files(plan: &Plan) -> Vec<Op> {
    rootfs::etc_files(plan.uid, plan.gid, &plan.hostname, &plan.workspace)
        .into_iter()
        .map(|(name, contents)| Op::File {
            target: Path::new("/etc").join(name),
            contents,
            mode: 0o644,
        })
        .collect()
}

fn depth(path: &Path) -> usize {
    path.components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count()
}

/// `path` without its leading `/`, so it can be joined under the staging root.
fn relative(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .collect()
}

fn make_parent(at: &Path) -> io::Result<()> {
    match at.parent() {
        Some(parent) => fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)
            .map_err(ctx(format!("mkdir {}", parent.display()))),
        None => Ok(()),
    }
}

fn make_mount_point(at: &Path, is_dir: bool) -> io::Result<()> {
    if is_dir {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(at)
    } else {
        make_parent(at)?;
        match fs::OpenOptions::new().write(true).create_new(true).open(at) {
            Ok(_) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(err) => Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_counts_normal_components() {
        assert_eq!(depth(Path::new("/")), 0);
        assert_eq!(depth(Path::new("/dev")), 1);
        assert_eq!(depth(Path::new("/dev/pts")), 2);
        assert_eq!(relative(Path::new("/a/b")), PathBuf::from("a/b"));
    }
}
