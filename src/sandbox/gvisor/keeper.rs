//! The keeper of a gVisor sandbox that outlives its gateway: a small process of ours (this
//! binary, run with [`GVISOR_KEEPER_ARG`]) that runs `runsc run` as its own child, so that
//! the container does not depend on the gateway's life (see the backend's *Lifetime*).
//!
//! * It holds the sandbox's mount namespace: the gateway made it in the keeper's child
//!   before exec (the size-limited workspace tmpfs, as for an attached `runsc run`), and
//!   `runsc run` inherits it; any gateway reaches the files through `/proc/<keeper>/root`.
//! * `runsc run` has `PR_SET_PDEATHSIG(SIGKILL)` towards the keeper, and runsc gives the
//!   Sentry and the gofer theirs towards `runsc run`: killing the keeper ends everything.
//! * Its gateway: the launching one while the keeper's stdin (the gateway's command pipe)
//!   is open; an adopting one while it holds a connection to the control socket (at
//!   [`CONTROL_FD`]) after answering the challenge with the kernel's key (the exchange of
//!   `namespaces::survival`, `cellgate-adopt-v1:`). Either may write `kill`; the keeper
//!   writes `running <pid>` once `runsc run` is started and `exited <json>` when it ended.
//! * With no gateway for the plan's grace, it ends the container (`runsc kill`, then
//!   `runsc run` killed) and, once `runsc run` is gone, removes what the sandbox left:
//!   `runsc delete`, the bundle, the cgroups, and as an orphan the kernel's directories.
//!   The record stays, so that the next gateway reports the session's sandbox lost.
//!
//! Single-threaded: one `poll` loop, as the namespaces keeper.

#![allow(unsafe_code)]

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::cgroups::{oom_kills, pids_limit_hits_in, remove_cgroup_dirs};
use super::exit::Ended;
use super::runsc::Runsc;
use crate::sandbox::namespaces::survival;
use crate::sandbox::sys;

/// The first argument that makes this binary a gVisor keeper.
pub const GVISOR_KEEPER_ARG: &str = "__gvisor-keeper";
/// The descriptor the keeper finds its control socket at.
pub(super) const CONTROL_FD: RawFd = 3;

/// What the gateway tells its keeper: one JSON line on its stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct KeeperPlan {
    pub(super) runsc: PathBuf,
    /// runsc's global arguments (`--root`, `--platform`), for `kill` and `delete`.
    pub(super) global: Vec<String>,
    /// The whole `runsc run` command line after the program.
    pub(super) run: Vec<String>,
    pub(super) container_id: String,
    pub(super) bundle: PathBuf,
    /// The sandbox's cgroup in every hierarchy (absolute: the next gateway may live in
    /// another cgroup).
    pub(super) cgroup_dirs: Vec<PathBuf>,
    pub(super) memory_cgroup: Option<PathBuf>,
    pub(super) grace_ms: u64,
    /// The kernel's key, which an adopting gateway proves it holds.
    pub(super) key: String,
    /// Removed when the sandbox ends with no gateway: the kernel's directories and the
    /// control socket.
    pub(super) orphan_leftovers: Vec<PathBuf>,
    /// The size-limited workspace's tmpfs, mounted in the keeper's own mount namespace: its
    /// mount point cannot be removed before it is unmounted there.
    pub(super) workspace_mount: Option<PathBuf>,
    pub(super) command_timeout_ms: u64,
}

/// What the keeper reports when `runsc run` has ended.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(super) struct Exited {
    pub(super) ended: Ended,
    pub(super) pids_hits: u64,
    pub(super) oom_kills: u64,
}

/// The keeper's entry point (from `main`, before anything else runs).
pub fn gvisor_keeper_main() -> ! {
    let code = match run() {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("cellgate: the gVisor sandbox's keeper failed: {err}");
            1
        }
    };
    std::process::exit(code)
}

/// Where the keeper's gateway is.
enum Gateway {
    /// The launching gateway: commands on stdin, reports on stdout.
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

    fn say(&self, line: &str) {
        let line = format!("{line}\n");
        let _ = match self {
            // SAFETY: fd 1 is the gateway's pipe for as long as this process runs; the
            // ManuallyDrop keeps it open.
            Gateway::Launcher => {
                std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(1) })
                    .write_all(line.as_bytes())
            }
            Gateway::Adopter(stream) => (&*stream).write_all(line.as_bytes()),
            Gateway::None => Ok(()),
        };
    }
}

fn run() -> io::Result<()> {
    // SAFETY: signal(2) with SIG_IGN: a write to a gone gateway must fail with EPIPE.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let plan: KeeperPlan = serde_json::from_slice(&survival::read_plan_line(0)?)
        .map_err(|err| io::Error::other(format!("the plan: {err}")))?;
    // SAFETY: the gateway put the listening socket at CONTROL_FD for this process.
    let control = unsafe { UnixListener::from_raw_fd(CONTROL_FD) };
    // Not inherited by `runsc run`: only the keeper answers on it.
    // SAFETY: fcntl(2) on a descriptor this process holds.
    sys::check(unsafe { libc::fcntl(CONTROL_FD, libc::F_SETFD, libc::FD_CLOEXEC) })?;
    control.set_nonblocking(true)?;
    let runsc = Runsc {
        program: plan.runsc.clone(),
        global: plan.global.clone(),
        id: plan.container_id.clone(),
        timeout: Duration::from_millis(plan.command_timeout_ms),
    };
    let mut child = spawn_runsc(&plan)?;
    let pid = i32::try_from(child.id()).map_err(io::Error::other)?;
    let pidfd = sys::pidfd_open(pid)?;
    let mut gateway = Gateway::Launcher;
    gateway.say(&format!("running {pid}"));
    let grace = Duration::from_millis(plan.grace_ms);
    let mut alone_since: Option<Instant> = None;
    let mut killed = false;
    // A gateway asked for the end (a restart, a shutdown): what the sandbox leaves behind
    // is that gateway's to clean, whether or not it is still connected when the container
    // is gone (its next generation may already use the kernel's directories).
    let mut told_to_kill = false;
    // What the gateway last said, for a command split across reads.
    let mut heard: Vec<u8> = Vec::new();
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
                    eprintln!("cellgate: no gateway came back within the grace: the sandbox ends");
                    end(&runsc, pid);
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
        // The container's end first: a gateway that let go in the same wake-up (a restart's
        // kill, then its connection closed) is still the one that cleans up, so the sandbox
        // is not taken for an orphan's and `k/`, which its next generation may use, stays.
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
            match read {
                Ok(0) | Err(_) => gateway = Gateway::None,
                Ok(n) => {
                    // A command may come split across reads: the last read's end is kept.
                    heard.extend_from_slice(&buf[..n]);
                    if heard.windows(4).any(|w| w == b"kill") && !killed {
                        end(&runsc, pid);
                        killed = true;
                        told_to_kill = true;
                    }
                    let keep = heard.len().saturating_sub(3);
                    heard.drain(..keep);
                }
            }
        }
        if fds[1].revents & libc::POLLIN != 0 {
            if let Ok((stream, _)) = control.accept() {
                if let Some(stream) = survival::challenge(stream, plan.key.as_bytes()) {
                    // The newest gateway with the key is the sandbox's gateway.
                    gateway = Gateway::Adopter(stream);
                    heard.clear();
                }
            }
        }
    }
    let status = child.wait()?;
    let ended = Ended::of(status.code(), status.signal());
    let exited = finish(&plan, ended);
    gateway.say(&format!(
        "exited {}",
        serde_json::to_string(&exited).unwrap_or_default()
    ));
    clean_up(
        &plan,
        &runsc,
        matches!(gateway, Gateway::None) && !told_to_kill,
    );
    Ok(())
}

/// Starts `runsc run`, its output into the keeper's stderr (the kernel's log), tied to the
/// keeper by its parent-death signal.
fn spawn_runsc(plan: &KeeperPlan) -> io::Result<std::process::Child> {
    // SAFETY: dup(2) of the keeper's stderr, a new descriptor of ours.
    let log = unsafe { std::os::fd::OwnedFd::from_raw_fd(sys::check(libc::dup(2))?) };
    let mut command = std::process::Command::new(&plan.runsc);
    command
        .args(&plan.run)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .current_dir(&plan.bundle)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::from(log));
    let parent = std::process::id();
    // SAFETY: runs in the forked child before exec; prctl and getppid are
    // async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    command.spawn()
}

/// Ends the container: runsc kills its processes, then `runsc run` (not yet reaped, so its
/// pid is still its own) is killed; the Sentry and the gofer follow by their parent-death
/// signal.
fn end(runsc: &Runsc, pid: i32) {
    let _ = runsc.run(&["kill", "--all"], &["KILL"]);
    // SAFETY: kill(2) of our own unreaped child.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// Once `runsc run` has ended: waits for the sandbox's last process to leave its cgroups
/// and reads why it ended from them, before anything removes them.
fn finish(plan: &KeeperPlan, ended: Ended) -> Exited {
    let deadline = Instant::now() + Duration::from_secs(2);
    let busy = || {
        plan.cgroup_dirs.iter().any(|dir| {
            std::fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|t| !t.trim().is_empty())
        })
    };
    while busy() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    Exited {
        ended,
        pids_hits: pids_limit_hits_in(&plan.cgroup_dirs).unwrap_or(0),
        oom_kills: oom_kills(plan.memory_cgroup.as_deref()),
    }
}

/// What an ended sandbox leaves: runsc's container, the bundle, the cgroups, and with no
/// gateway to do it later the kernel's directories.
fn clean_up(plan: &KeeperPlan, runsc: &Runsc, orphan: bool) {
    let _ = runsc.run(&["delete", "--force"], &[]);
    let _ = std::fs::remove_dir_all(&plan.bundle);
    remove_cgroup_dirs(&plan.cgroup_dirs);
    if orphan {
        if let Some(workspace) = &plan.workspace_mount {
            if let Ok(path) = std::ffi::CString::new(workspace.as_os_str().as_encoded_bytes()) {
                // SAFETY: umount2(2) with a valid C string; only this process's namespace.
                unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
            }
        }
        for path in &plan.orphan_leftovers {
            let _ = std::fs::remove_dir_all(path).or_else(|_| std::fs::remove_file(path));
        }
    }
}
