//! Thin wrappers over the Linux system calls the sandbox needs, each turning the C convention
//! (`-1` and `errno`) into an [`io::Result`].
//!
//! Every call into libc of the backend is reached through here (the one exception is the
//! gateway's `pre_exec` hook in `mod.rs`), so the rest of the backend reads as ordinary Rust;
//! the calls other backends make too (pidfds, `unshare`, the mount calls on C strings) live
//! once in [`crate::sandbox::sys`] and are re-exported or wrapped here; the only
//! `unsafe` left to callers is [`fork`], whose contract (a single-threaded caller) cannot be
//! checked here. The wrappers add no policy: they neither retry nor ignore errors. `libc` is
//! used directly rather than `nix` or `rustix`: the calls are few, several are raw syscalls
//! anyway (`mount_setattr`, `pivot_root`, `pidfd_*`, `capset` with an empty set), and the
//! crate already depends on `libc`.

#![allow(unsafe_code)]

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::sandbox::sys::{self, check, check_long};
pub use crate::sandbox::sys::{
    pidfd_exited, pidfd_open, pidfd_send_signal, unshare, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC,
    MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY,
};

/// Turns a path into a C string; paths with NUL bytes cannot name a file.
pub fn cstring(path: impl AsRef<OsStr>) -> io::Result<CString> {
    CString::new(path.as_ref().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// mount(2). `source` and `fstype` may be absent; `data` is the file system's option string.
pub fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = source.map(cstring).transpose()?;
    let target = cstring(target)?;
    let fstype = fstype.map(cstring).transpose()?;
    let data = data.map(cstring).transpose()?;
    sys::mount(
        source.as_deref(),
        &target,
        fstype.as_deref(),
        flags,
        data.as_deref(),
    )
}

/// mount_setattr(2): sets `attr_set` on the mount at `target` (and every mount below it when
/// `recursive`). Unlike a `MS_REMOUNT|MS_BIND` remount it leaves the flags it is not asked to
/// set alone, so it never trips over flags the host locked on the original mount.
pub fn mount_setattr(target: &Path, attr_set: u64, recursive: bool) -> io::Result<()> {
    let target = cstring(target)?;
    sys::mount_setattr(&target, attr_set, recursive)
}

pub fn umount_detach(target: &Path) -> io::Result<()> {
    let target = cstring(target)?;
    // SAFETY: NUL-terminated path, no other memory involved.
    check(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) }).map(drop)
}

pub fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let new_root = cstring(new_root)?;
    let put_old = cstring(put_old)?;
    // SAFETY: both pointers are NUL-terminated strings alive for the call.
    check_long(unsafe { libc::syscall(libc::SYS_pivot_root, new_root.as_ptr(), put_old.as_ptr()) })
        .map(drop)
}

pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(drop)
}

pub fn setresuid(uid: u32) -> io::Result<()> {
    // SAFETY: plain integer arguments. The process is single-threaded when this runs, so the
    // raw syscall's per-thread semantics and glibc's all-threads semantics agree.
    check(unsafe { libc::setresuid(uid, uid, uid) }).map(drop)
}

pub fn setresgid(gid: u32) -> io::Result<()> {
    // SAFETY: as for setresuid.
    check(unsafe { libc::setresgid(gid, gid, gid) }).map(drop)
}

/// Drops every supplementary group.
pub fn clear_groups() -> io::Result<()> {
    // SAFETY: a zero-length list with a null pointer is the documented way to clear groups.
    check(unsafe { libc::setgroups(0, std::ptr::null()) }).map(drop)
}

pub fn geteuid() -> u32 {
    // SAFETY: geteuid(2) cannot fail and takes no arguments.
    unsafe { libc::geteuid() }
}

pub fn getegid() -> u32 {
    // SAFETY: getegid(2) cannot fail and takes no arguments.
    unsafe { libc::getegid() }
}

fn prctl(option: libc::c_int, arg2: libc::c_ulong) -> io::Result<()> {
    // SAFETY: every prctl option used in this module takes integer arguments only.
    check(unsafe {
        libc::prctl(
            option,
            arg2,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    })
    .map(drop)
}

pub fn set_parent_death_signal(signal: libc::c_int) -> io::Result<()> {
    prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong)
}

pub fn set_no_new_privs() -> io::Result<()> {
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1)
}

pub fn set_dumpable(dumpable: bool) -> io::Result<()> {
    prctl(libc::PR_SET_DUMPABLE, libc::c_ulong::from(dumpable))
}

pub fn set_securebits(bits: libc::c_int) -> io::Result<()> {
    prctl(libc::PR_SET_SECUREBITS, bits as libc::c_ulong)
}

pub fn clear_ambient_capabilities() -> io::Result<()> {
    // SAFETY: integer arguments only.
    check(unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    })
    .map(drop)
}

/// Removes every capability from the bounding set, so nothing executed later can regain one.
pub fn drop_bounding_set() -> io::Result<()> {
    let last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<libc::c_ulong>().ok())
        .unwrap_or(63);
    for cap in 0..=last {
        match prctl(libc::PR_CAPBSET_DROP, cap) {
            Ok(()) => {}
            // Capabilities this kernel does not know.
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => break,
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Empties the effective, permitted and inheritable capability sets of the calling thread.
pub fn clear_capabilities() -> io::Result<()> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: version 3 of capset(2) reads a header and exactly two data structs, which is
    // what we pass.
    check_long(unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    })
    .map(drop)
}

/// The outcome of [`fork`].
pub enum Forked {
    Parent { child: libc::pid_t },
    Child,
}

/// fork(2).
///
/// # Safety
/// The caller must be single-threaded: after a fork in a multithreaded process the child may
/// only call async-signal-safe functions, and the callers of this function allocate freely.
pub unsafe fn fork() -> io::Result<Forked> {
    // SAFETY: the caller guarantees a single-threaded process (see above).
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(Forked::Child),
        child => Ok(Forked::Parent { child }),
    }
}

/// How a child ended, from a wait status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Exited(i32),
    Signaled(i32),
}

/// waitpid(2). `Ok(None)` means nothing to report yet (with `WNOHANG`) or a stop/continue.
pub fn waitpid(pid: libc::pid_t, flags: libc::c_int) -> io::Result<Option<(libc::pid_t, Ended)>> {
    let mut status: libc::c_int = 0;
    // SAFETY: `status` is a valid out pointer for the duration of the call.
    let rc = unsafe { libc::waitpid(pid, &mut status, flags) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if rc == 0 {
        return Ok(None);
    }
    if libc::WIFEXITED(status) {
        Ok(Some((rc, Ended::Exited(libc::WEXITSTATUS(status)))))
    } else if libc::WIFSIGNALED(status) {
        Ok(Some((rc, Ended::Signaled(libc::WTERMSIG(status)))))
    } else {
        Ok(None)
    }
}

pub fn kill(pid: libc::pid_t, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: kill(2) takes integers only.
    check(unsafe { libc::kill(pid, signal) }).map(drop)
}

pub fn setsid() -> io::Result<()> {
    // SAFETY: setsid(2) takes no arguments.
    check(unsafe { libc::setsid() }).map(drop)
}

/// A set of signals.
pub struct SignalSet(libc::sigset_t);

impl SignalSet {
    pub fn of(signals: &[libc::c_int]) -> SignalSet {
        // SAFETY: sigemptyset initialises the zeroed set; sigaddset only fails for invalid
        // signal numbers, which the callers do not pass.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for &signal in signals {
                libc::sigaddset(&mut set, signal);
            }
            SignalSet(set)
        }
    }

    /// Blocks these signals (adds them to the mask).
    pub fn block(&self) -> io::Result<()> {
        // SAFETY: the set is initialised; the old mask is not requested.
        let rc = unsafe { libc::sigprocmask(libc::SIG_BLOCK, &self.0, std::ptr::null_mut()) };
        check(rc).map(drop)
    }

    /// Waits for one of these (blocked) signals and returns it with the sender's pid.
    pub fn wait(&self) -> io::Result<(libc::c_int, libc::pid_t)> {
        loop {
            // SAFETY: an all-zero siginfo_t is a valid value of this plain C struct.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: `info` is a valid out pointer; the set is initialised.
            let rc = unsafe { libc::sigwaitinfo(&self.0, &mut info) };
            if rc >= 0 {
                // SAFETY: si_pid is valid for signals sent by kill(2) and for SIGCHLD; for
                // others it reads whatever the kernel filled in, which callers only log.
                let pid = unsafe { info.si_pid() };
                return Ok((rc, pid));
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) {
                return Err(err);
            }
        }
    }
}

/// Empties the signal mask and resets every catchable signal to its default action, so an
/// exec'd program starts with nothing inherited from us (Rust ignores SIGPIPE, for one).
pub fn reset_signals() -> io::Result<()> {
    for signal in 1..libc::SIGRTMAX() {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        // SAFETY: SIG_DFL is a valid disposition; invalid numbers just return EINVAL.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
        }
    }
    let empty = SignalSet::of(&[]);
    // SAFETY: the set is initialised; the old mask is not requested.
    check(unsafe { libc::sigprocmask(libc::SIG_SETMASK, &empty.0, std::ptr::null_mut()) }).map(drop)
}

pub fn setrlimit(resource: libc::__rlimit_resource_t, soft: u64, hard: u64) -> io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: `limit` is a valid rlimit for the call's duration.
    check(unsafe { libc::setrlimit(resource, &limit) }).map(drop)
}

pub fn dup2(old: RawFd, new: RawFd) -> io::Result<()> {
    // SAFETY: dup2(2) on integers; the caller owns `new`'s slot (it replaces stdio).
    check(unsafe { libc::dup2(old, new) }).map(drop)
}

/// Makes standard input `/dev/null` (closing what it was).
pub fn stdin_from_null() -> io::Result<()> {
    let null = std::fs::File::open("/dev/null")?;
    dup2(null.as_raw_fd(), 0)
}

/// Closes every descriptor above stdio except `keep`.
pub fn close_all_above_stdio_except(keep: &[RawFd]) -> io::Result<()> {
    let close_range = |first: RawFd, last: libc::c_uint| {
        // SAFETY: closing descriptors this process inherited; nothing of ours refers to them
        // afterwards (the caller keeps only stdio and `keep`).
        check(unsafe { libc::close_range(first as libc::c_uint, last, 0) }).map(drop)
    };
    let mut keep: Vec<RawFd> = keep.iter().copied().filter(|fd| *fd > 2).collect();
    keep.sort_unstable();
    keep.dedup();
    let mut first = 3;
    for fd in keep {
        if fd > first {
            close_range(first, (fd - 1) as libc::c_uint)?;
        }
        first = fd + 1;
    }
    close_range(first, libc::c_uint::MAX)
}

pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Opens `path` with `O_PATH`: a handle to the file itself, usable as a bind-mount source
/// through `/proc/self/fd/N` after the caller lost the right to look the path up.
pub fn open_path(path: &Path) -> io::Result<OwnedFd> {
    let c = cstring(path)?;
    // SAFETY: NUL-terminated path; the returned descriptor is new and ours.
    let fd = check(unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) })?;
    // SAFETY: `fd` was just created.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the other end of a pipe we read from is gone (without blocking).
pub fn pipe_hung_up(fd: &OwnedFd) -> bool {
    sys::poll_now(fd) & libc::POLLHUP != 0
}

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: socket(2) with constant arguments; the descriptor is wrapped at once.
    let sock =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `sock` is new and ours.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: an all-zero ifreq is valid; the name and flags are filled in below.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads a struct ifreq, which `req` is.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) }).map(drop)
}

/// execve(2); returns only on failure.
pub fn execve(path: &CStr, argv: &[CString], env: &[CString]) -> io::Error {
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut env_ptrs: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
    env_ptrs.push(std::ptr::null());
    // SAFETY: both arrays are null-terminated and point to strings that outlive the call.
    unsafe {
        libc::execve(path.as_ptr(), argv_ptrs.as_ptr(), env_ptrs.as_ptr());
    }
    io::Error::last_os_error()
}

/// Ends the process at once, without running destructors or flushing stdio buffers.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit(2) never returns and needs no cleanup from us.
    unsafe { libc::_exit(code) }
}

/// The Landlock ABI version the running kernel offers, or the errno saying why not.
pub fn landlock_abi() -> Result<i64, i32> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_ulong = 1;
    // SAFETY: with a NULL attribute pointer and size 0, the VERSION flag only returns the
    // ABI number; no memory is read or written and no descriptor is created.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::ENOSYS))
    } else {
        Ok(rc)
    }
}
