//! The keeper of a microVM that outlives its gateway (see the backend's *Outliving the
//! gateway*): a small process of ours (this binary, run with [`MICROVM_KEEPER_ARG`]) that
//! ends the VM when no gateway has held it for the orphan grace.
//!
//! It is not the VMM's parent and holds nothing of the VM: the VMM is the gateway's child
//! (confined as every VMM, with no parent-death signal), and the keeper pins it by a pidfd
//! opened while the gateway that started it was alive (its start time checked against the
//! plan's), so a reused pid is never signalled.
//!
//! * Its gateway: the launching one while the keeper's stdin (the gateway's command pipe)
//!   is open; an adopting one while it holds a connection to the control socket (at
//!   [`CONTROL_FD`]) after answering the challenge with the kernel's key (the exchange of
//!   `namespaces::survival`, `cellgate-adopt-v1:`). The keeper writes `running` once it
//!   holds the VMM's pidfd.
//! * With no gateway for the plan's grace, it kills the VMM and, once it is gone, removes
//!   what the VM left: its cgroup and the files the plan names (the kernel's directories,
//!   the control socket). The record stays, so that the next gateway reports the session's
//!   sandbox lost.
//! * When the VMM ends while a gateway holds it, that gateway cleans up; the keeper just
//!   ends.
//!
//! Why a keeper on the host rather than the guest agent powering the VM off: the guest runs
//! the kernel's code, and a guest taken over would keep its VM forever; the host decides.

#![allow(unsafe_code)]

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::sandbox::cgroups::{CgroupParts, KernelCgroup};
use crate::sandbox::namespaces::survival::{self, Proc};
use crate::sandbox::sys;

/// The first argument that makes this binary a microVM's keeper.
pub const MICROVM_KEEPER_ARG: &str = "__microvm-keeper";
/// The descriptor the keeper finds its control socket at.
pub(super) const CONTROL_FD: RawFd = 3;

/// What the gateway tells its keeper: one JSON line on its stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct KeeperPlan {
    /// The VMM, as the gateway started it.
    pub(super) vmm: Proc,
    pub(super) grace_ms: u64,
    /// The kernel's key, which an adopting gateway proves it holds.
    pub(super) key: String,
    /// The VM's cgroup, removed when it ends with no gateway.
    pub(super) cgroup: Option<CgroupParts>,
    /// Removed when the VM ends with no gateway: the kernel's directories and the control
    /// socket.
    pub(super) orphan_leftovers: Vec<PathBuf>,
}

/// The keeper's entry point (from `main`, before anything else runs).
pub fn microvm_keeper_main() -> ! {
    let code = match run() {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("cellgate: the microVM's keeper failed: {err}");
            1
        }
    };
    std::process::exit(code)
}

/// Where the keeper's gateway is.
enum Gateway {
    /// The launching gateway: its command pipe on stdin.
    Launcher,
    /// An adopting gateway's control connection.
    Adopter(UnixStream),
    None,
}

impl Gateway {
    fn read_fd(&self) -> RawFd {
        match self {
            Gateway::Launcher => 0,
            Gateway::Adopter(stream) => stream.as_raw_fd(),
            Gateway::None => -1,
        }
    }
}

fn run() -> io::Result<()> {
    // SAFETY: signal(2) with SIG_IGN: a write to a gone gateway must fail with EPIPE.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let plan: KeeperPlan = serde_json::from_slice(&survival::read_plan_line(0)?)
        .map_err(|err| io::Error::other(format!("the plan: {err}")))?;
    // SAFETY: the gateway put the listening socket at CONTROL_FD for this process.
    let control = unsafe { UnixListener::from_raw_fd(CONTROL_FD) };
    control.set_nonblocking(true)?;
    // The pidfd first, then the start time: a pidfd of a reused pid would name the wrong
    // process, and the start time tells.
    let pidfd = sys::pidfd_open(plan.vmm.pid)?;
    if survival::start_time(plan.vmm.pid) != Some(plan.vmm.start) {
        return Err(io::Error::other("the VMM is not the one in the plan"));
    }
    {
        // SAFETY: fd 1 is the gateway's pipe; ManuallyDrop keeps it open.
        let mut out = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(1) });
        let _ = out.write_all(b"running\n");
    }
    let mut gateway = Gateway::Launcher;
    let grace = Duration::from_millis(plan.grace_ms);
    let mut alone_since: Option<Instant> = None;
    let mut killed = false;
    loop {
        if matches!(gateway, Gateway::None) {
            alone_since.get_or_insert_with(Instant::now);
        } else {
            alone_since = None;
        }
        let timeout = match alone_since {
            Some(_) if killed => -1,
            Some(since) => {
                let left = grace.saturating_sub(since.elapsed());
                if left.is_zero() {
                    eprintln!("cellgate: no gateway came back within the grace: the VM ends");
                    let _ = sys::pidfd_send_signal(&pidfd, libc::SIGKILL);
                    killed = true;
                    continue;
                }
                i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)
            }
            None => -1,
        };
        let mut fds = [
            survival::poll_in(pidfd.as_raw_fd()),
            survival::poll_in(control.as_raw_fd()),
            survival::poll_in(gateway.read_fd()),
        ];
        // SAFETY: a valid array of pollfd of the given length.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        // The VMM's end first: whether it is an orphan's is what the gateway was before it
        // ended, not a gateway that let go just after (it ended the VM on purpose, and its
        // next generation may be using the kernel's directories already).
        if fds[0].revents != 0 {
            break;
        }
        if fds[2].revents != 0 {
            let mut buf = [0u8; 256];
            let read = match &gateway {
                Gateway::Launcher => {
                    // SAFETY: fd 0 is the gateway's pipe; ManuallyDrop keeps it open.
                    std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(0) })
                        .read(&mut buf)
                }
                Gateway::Adopter(stream) => (&*stream).read(&mut buf),
                Gateway::None => Ok(1),
            };
            // The gateway says nothing: only its going away matters.
            if matches!(read, Ok(0) | Err(_)) {
                gateway = Gateway::None;
            }
        }
        if fds[1].revents & libc::POLLIN != 0 {
            if let Ok((stream, _)) = control.accept() {
                if let Some(stream) = survival::challenge(stream, plan.key.as_bytes()) {
                    // The newest gateway with the key is the VM's gateway.
                    gateway = Gateway::Adopter(stream);
                }
            }
        }
    }
    if matches!(gateway, Gateway::None) {
        clean_up(&plan);
    }
    Ok(())
}

/// What a VM that ended with no gateway leaves: its cgroup (anything left in it killed) and
/// the kernel's files.
fn clean_up(plan: &KeeperPlan) {
    if let Some(cgroup) = plan.cgroup.as_ref().and_then(KernelCgroup::from_parts) {
        cgroup.remove();
    }
    for path in &plan.orphan_leftovers {
        let _ = std::fs::remove_dir_all(path).or_else(|_| std::fs::remove_file(path));
    }
}
