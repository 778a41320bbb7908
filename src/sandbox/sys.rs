//! The Linux system calls more than one backend makes, each turning the C convention (`-1`
//! and `errno`) into an [`io::Result`]: pidfds (the namespaces and gVisor backends pin
//! their processes with them) and the mount calls that build a sandbox's view of the host
//! (the namespaces backend's root, gVisor's workspace, a microVM's VMM root).
//!
//! Nothing here allocates: the mount calls take C strings made by the caller, so a child
//! forked from the multithreaded gateway may make them before `exec` (gVisor's workspace,
//! the VMM's root), and the namespaces backend's path-taking wrappers in its own `sys.rs`
//! make the strings first. Like those, the wrappers add no policy: they neither retry nor
//! ignore errors.

#![allow(unsafe_code)]

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A libc call's result: `Err(errno)` when it is negative.
pub fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// [`check`] for `syscall(2)`, which returns a `long`.
pub fn check_long(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: unshare(2) takes flags only and touches no memory of ours.
    check(unsafe { libc::unshare(flags) }).map(drop)
}

/// mount(2). `source` and `fstype` may be absent; `data` is the file system's option string.
pub fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let ptr = |s: Option<&CStr>| s.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: every pointer is either null (allowed for source, fstype and data) or points to
    // a NUL-terminated string that outlives the call.
    check(unsafe {
        libc::mount(
            ptr(source),
            target.as_ptr(),
            ptr(fstype),
            flags,
            ptr(data).cast(),
        )
    })
    .map(drop)
}

/// The kernel's `struct mount_attr` (linux/mount.h).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

pub const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
pub const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
pub const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
pub const MOUNT_ATTR_NOEXEC: u64 = 0x0000_0008;

/// mount_setattr(2): sets `attr_set` on the mount at `target` (and every mount below it when
/// `recursive`). Unlike a `MS_REMOUNT|MS_BIND` remount it leaves the flags it is not asked to
/// set alone, so it never trips over flags the host locked on the original mount.
pub fn mount_setattr(target: &CStr, attr_set: u64, recursive: bool) -> io::Result<()> {
    let attr = MountAttr {
        attr_set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    let flags = if recursive {
        libc::AT_RECURSIVE as libc::c_uint
    } else {
        0
    };
    // SAFETY: the path is NUL-terminated and `attr` is a live `struct mount_attr` whose size
    // is passed along, as the syscall requires.
    check_long(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            target.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })
    .map(drop)
}

pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) with integer arguments returns a new descriptor.
    let fd = check_long(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: `fd` was just created and is ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

pub fn pidfd_send_signal(pidfd: &OwnedFd, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: a live pidfd, a signal number, no siginfo, no flags.
    check_long(unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    })
    .map(drop)
}

/// What `fd` polls for reading right now, without waiting (`revents`; 0 for nothing or an
/// error).
pub fn poll_now(fd: &OwnedFd) -> libc::c_short {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    if rc > 0 {
        pfd.revents
    } else {
        0
    }
}

/// Whether the process behind a pidfd has ended (the pidfd polls readable then).
pub fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    poll_now(pidfd) != 0
}

/// Waits, on the tokio runtime, until the process behind `pidfd` has ended (for a process
/// that is not the caller's child, which no `wait` reports). Returns at once when the pidfd
/// cannot be registered with the runtime.
pub async fn pidfd_wait(pidfd: OwnedFd) {
    // SAFETY: the descriptor is owned by the AsyncFd from here on and closed only by it.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    };
    if let Ok(fd) = registered {
        let _ = fd.readable().await;
    }
}
