//! The helper of a sandbox that outlives its gateway (a plan with [`Keep`]): instead of
//! only waiting for the init, it keeps the sandbox going on its own.
//!
//! * The kernel's output: the init's stderr (the kernel's stdout and stderr) is a pipe the
//!   helper made, which it copies into its own stderr, the kernel's log file (the gateway
//!   opened it), up to [`LOG_LIMIT`] bytes, then reads and drops, so the kernel never
//!   blocks on a full pipe whether a gateway runs or not.
//! * Its gateway: the launching gateway is there while the event pipe (the helper's
//!   stdout) has a reader; an adopting gateway while it holds a connection to the control
//!   socket ([`CONTROL_FD`], a listening socket the gateway made in the state directory)
//!   after it answered the challenge with the kernel's key (`survival.rs`).
//! * Its end: with no gateway for the plan's grace, it SIGKILLs the init (the pid namespace
//!   and everything in it end); it exits once the init has ended, as a helper always does.
//!
//! Single-threaded, like the rest of the helper: one `poll` loop.

#![allow(unsafe_code)]

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use super::plan::{Keep, Plan, Role, EGRESS_FD};
use super::report::{at, Failure};
use super::survival;
use super::sys::{self, Ended};

/// The descriptor the helper finds its control socket at.
pub const CONTROL_FD: RawFd = 4;
/// At most this much of a kernel's output is kept in its log file (as the gateway's copy).
const LOG_LIMIT: u64 = 64 << 20;

/// What the helper holds for a kept sandbox, made before the init is forked.
pub struct Keeper {
    grace: Duration,
    key: Vec<u8>,
    control: UnixListener,
    output_read: OwnedFd,
    output_write: Option<OwnedFd>,
}

impl Keeper {
    /// The control socket (at [`CONTROL_FD`]) and the output pipe, and the kernel's key
    /// (from the connection file in the plan).
    pub fn prepare(keep: &Keep, plan: &Plan) -> Result<Keeper, Failure> {
        if plan.role == Role::Forked {
            take_forked_fds().map_err(at("receive the control socket"))?;
        }
        let key = plan
            .connection_file
            .as_ref()
            .and_then(|file| serde_json::from_str::<serde_json::Value>(&file.contents).ok())
            .and_then(|info| info.get("key")?.as_str().map(str::to_owned))
            .filter(|key| !key.is_empty())
            .ok_or_else(|| at("keep the sandbox")("the plan has no kernel key"))?;
        // SAFETY: the gateway put the listening socket at CONTROL_FD for this process and
        // nothing else owns that number.
        let control = unsafe { UnixListener::from_raw_fd(CONTROL_FD) };
        set_cloexec(control.as_raw_fd()).map_err(at("keep the control socket"))?;
        control
            .set_nonblocking(true)
            .map_err(at("keep the control socket"))?;
        let (output_read, output_write) = sys::pipe().map_err(at("pipe"))?;
        // The kernel reopens /dev/stdout or /dev/stderr by its own uid: the pipe is the
        // helper's (the gateway's host uid), and reachable only through this sandbox's fds.
        // SAFETY: fchmod on a descriptor we own.
        crate::sandbox::sys::check(unsafe { libc::fchmod(output_write.as_raw_fd(), 0o666) })
            .map_err(at("share the output pipe"))?;
        // SAFETY: signal(2) with SIG_IGN; a write to a gone gateway's pipe must fail with
        // EPIPE, not end the helper.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        Ok(Keeper {
            grace: Duration::from_millis(keep.grace_ms),
            key: key.into_bytes(),
            control,
            output_read,
            output_write: Some(output_write),
        })
    }

    /// In the init: the output pipe becomes its stderr; the helper's ends are closed.
    pub fn into_init(self) -> Result<(), Failure> {
        if let Some(write) = &self.output_write {
            sys::dup2(write.as_raw_fd(), 2).map_err(at("output pipe"))?;
        }
        Ok(())
    }

    /// In the helper, once the init runs: keeps the sandbox until the init has ended.
    pub fn run(mut self, init: libc::pid_t) -> Result<Ended, Failure> {
        self.output_write = None;
        let pidfd = sys::pidfd_open(init).map_err(at("open the init's pidfd"))?;
        let mut output = Some(std::fs::File::from(self.output_read));
        let mut log_written: u64 = 0;
        let mut events_reader = true;
        let mut gateway: Option<UnixStream> = None;
        let mut alone_since: Option<Instant> = None;
        let mut killed = false;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let attached = events_reader || gateway.is_some();
            if attached {
                alone_since = None;
            } else if alone_since.is_none() {
                alone_since = Some(Instant::now());
            }
            let timeout = match alone_since {
                Some(_) if killed => -1,
                Some(since) => {
                    let left = self.grace.saturating_sub(since.elapsed());
                    if left.is_zero() {
                        // Nobody came for it: end the sandbox.
                        let _ = sys::pidfd_send_signal(&pidfd, libc::SIGKILL);
                        killed = true;
                        continue;
                    }
                    i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)
                }
                None => -1,
            };
            let mut fds = vec![
                poll_fd(pidfd.as_raw_fd(), libc::POLLIN),
                poll_fd(self.control.as_raw_fd(), libc::POLLIN),
                // Events 0: only POLLERR (the reader is gone) is reported.
                poll_fd(if events_reader { 1 } else { -1 }, 0),
                poll_fd(output.as_ref().map_or(-1, AsRawFd::as_raw_fd), libc::POLLIN),
                poll_fd(
                    gateway.as_ref().map_or(-1, AsRawFd::as_raw_fd),
                    libc::POLLIN,
                ),
            ];
            // SAFETY: `fds` is a valid array of pollfd of the given length.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if rc < 0 {
                let err = io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(at("poll")(err));
            }
            if fds[2].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                events_reader = false;
            }
            if fds[3].revents != 0 {
                if let Some(pipe) = &mut output {
                    match copy_some(pipe, &mut buf, &mut log_written) {
                        Ok(true) => {}
                        _ => output = None,
                    }
                }
            }
            if fds[4].revents != 0 {
                // The gateway closed its connection (it writes nothing after `ok`).
                gateway = None;
            }
            if fds[1].revents & libc::POLLIN != 0 {
                if let Ok((stream, _)) = self.control.accept() {
                    if let Some(stream) = survival::challenge(stream, &self.key) {
                        // The newest gateway with the key is the sandbox's gateway.
                        gateway = Some(stream);
                    }
                }
            }
            if fds[0].revents != 0 {
                let ended = loop {
                    match sys::waitpid(init, 0) {
                        Ok(Some((_, ended))) => break ended,
                        Ok(None) => continue,
                        Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
                        Err(err) => return Err(at("wait for the init")(err)),
                    }
                };
                // Every writer of the output pipe was in the pid namespace, which is gone:
                // what is left in it is read to its end.
                if let Some(mut pipe) = output.take() {
                    while let Ok(true) = copy_some(&mut pipe, &mut buf, &mut log_written) {}
                }
                return Ok(ended);
            }
        }
    }
}

/// Sends a kept sandbox's control socket and egress directory (or a stand-in) to a helper
/// forked from a zygote (see [`take_forked_fds`]).
pub fn send_fds(socket: &UnixStream, fds: [std::os::fd::BorrowedFd<'_>; 2]) -> io::Result<()> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    if !ancillary.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("cannot attach the descriptors"));
    }
    sendmsg(
        socket,
        &[io::IoSlice::new(b"K")],
        &mut ancillary,
        SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// In a helper forked from a zygote, which passes four descriptors at most: the socket at
/// [`EGRESS_FD`] brings the control socket, put at [`CONTROL_FD`], and the egress directory
/// (or a stand-in), put at [`EGRESS_FD`] in the socket's place.
fn take_forked_fds() -> io::Result<()> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    // SAFETY: the zygote's child put the gateway's socket at EGRESS_FD; nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(EGRESS_FD) };
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut ancillary = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    recvmsg(
        &socket,
        &mut [io::IoSliceMut::new(&mut byte)],
        &mut ancillary,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for message in ancillary.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    let [control, egress]: [OwnedFd; 2] = fds
        .try_into()
        .map_err(|_| io::Error::other("expected two descriptors"))?;
    drop(socket);
    // Moved out of the way first: either may have been given a target's number.
    let (control, egress) = (above(control)?, above(egress)?);
    // dup2 leaves the copies without close-on-exec; nothing here execs before the
    // confinement closes every inherited descriptor of the kernel.
    sys::dup2(control.as_raw_fd(), CONTROL_FD)?;
    sys::dup2(egress.as_raw_fd(), EGRESS_FD)?;
    Ok(())
}

/// A copy of `fd` numbered 100 or more (the original is closed).
fn above(fd: OwnedFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl on a descriptor we own; the new one is ours.
    let copy = crate::sandbox::sys::check(unsafe {
        libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 100)
    })?;
    // SAFETY: `copy` was just created.
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

fn poll_fd(fd: RawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor this process holds.
    crate::sandbox::sys::check(unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) })
        .map(drop)
}

/// Copies what the output pipe holds now into the log (stderr), up to the limit; `false`
/// at its end.
fn copy_some(pipe: &mut std::fs::File, buf: &mut [u8], written: &mut u64) -> io::Result<bool> {
    let n = match pipe.read(buf) {
        Ok(0) => return Ok(false),
        Ok(n) => n,
        Err(err) if err.kind() == io::ErrorKind::Interrupted => return Ok(true),
        Err(err) => return Err(err),
    };
    if *written < LOG_LIMIT {
        let keep = n.min(usize::try_from(LOG_LIMIT - *written).unwrap_or(n));
        let mut log = io::stderr().lock();
        if log.write_all(&buf[..keep]).is_err() {
            *written = LOG_LIMIT;
        } else {
            *written += keep as u64;
            if *written >= LOG_LIMIT {
                let _ = log.write_all(b"\n[cellgate: kernel log truncated]\n");
            }
        }
    }
    Ok(true)
}
