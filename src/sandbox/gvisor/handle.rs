//! Control of one running gVisor sandbox: the gateway's [`SandboxHandle`] for it.
//!
//! The kernel runs inside the Sentry and has no host process, so the handle holds
//! `runsc run`'s pid (leader of its process group, pinned by a pidfd), or for a sandbox
//! that outlives the gateway its keeper's (see [`super::keeper`]), and a [`Runsc`] for the
//! container: signals and kills go through runsc, the size-limited workspace through that
//! process's root in /proc, and the pids counter through the sandbox's cgroup.

#![allow(unsafe_code)]

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::cgroups;
use super::runsc::Runsc;
use crate::sandbox::sys::pidfd_exited;
use crate::sandbox::{SandboxError, SandboxHandle};

/// Control of one gVisor sandbox.
pub(super) struct GvisorHandle {
    /// `runsc run`'s pid, leader of its process group; a kept sandbox's keeper's.
    pub(super) pid: u32,
    /// A pidfd of that process, when the host has pidfds (Linux 5.3+).
    pub(super) pidfd: Option<std::os::fd::OwnedFd>,
    /// Whether the workspace is the tmpfs in `runsc run`'s mount namespace (a size limit)
    /// rather than the host directory.
    pub(super) private_workspace: bool,
    /// The kernel's uid and gid, for the signalling program.
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) exited: Arc<AtomicBool>,
    pub(super) runsc: Runsc,
    /// The sandbox's cgroup in every hierarchy, when runsc manages cgroups.
    pub(super) cgroup_dirs: Vec<PathBuf>,
    /// The keeper of a sandbox that outlives the gateway.
    pub(super) keeper: Option<KeeperLink>,
}

/// The gateway's line to a kept sandbox's keeper.
#[derive(Clone)]
pub(super) struct KeeperLink {
    /// Where `kill` is asked for; closed when the gateway lets the sandbox go (the keeper
    /// then counts its gateway gone).
    pub(super) commands: Arc<parking_lot::Mutex<Option<Commands>>>,
    /// Let go for the next gateway: its end is not this gateway's to report.
    pub(super) detached: Arc<AtomicBool>,
}

/// The keeper's command channel: the launching gateway's pipe to its stdin, or an
/// adopting gateway's control connection.
pub(super) enum Commands {
    Pipe(std::fs::File),
    Stream(UnixStream),
}

impl Commands {
    fn send(&mut self, line: &str) -> io::Result<()> {
        match self {
            Commands::Pipe(file) => file.write_all(line.as_bytes()),
            Commands::Stream(stream) => stream.write_all(line.as_bytes()),
        }
    }

    /// Closes the channel (a connection for both directions: its other copy, the exit
    /// watcher's, ends too).
    pub(super) fn close(self) {
        if let Commands::Stream(stream) = &self {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl SandboxHandle for GvisorHandle {
    /// The size-limited workspace exists only in `runsc run`'s mount namespace: reached
    /// through that process's root in /proc, as the namespaces backend reaches its own.
    fn workspace_root(&self, workspace: &Path) -> Option<(PathBuf, PathBuf)> {
        if !self.private_workspace {
            return Some((workspace.to_owned(), PathBuf::from(".")));
        }
        if self.pid == 0 || self.exited.load(Ordering::SeqCst) {
            return None;
        }
        let relative = workspace.strip_prefix("/").unwrap_or(workspace);
        Some((
            PathBuf::from(format!("/proc/{}/root", self.pid)),
            relative.to_owned(),
        ))
    }

    /// Whether `runsc run` still exists, by its pidfd: its pid cannot have been reused while
    /// the pidfd says so. Without a pidfd the pid cannot be pinned, so a private workspace
    /// counts as unreachable.
    fn alive(&self) -> bool {
        if self.exited.load(Ordering::SeqCst) {
            return false;
        }
        match &self.pidfd {
            Some(pidfd) => !pidfd_exited(pidfd),
            None => !self.private_workspace,
        }
    }

    /// Every guest process has a ptrace stub on the host, so a refused guest fork shows in
    /// the `pids` cgroup of the sandbox like any other.
    fn pids_limit_hits(&self) -> Option<u64> {
        cgroups::pids_limit_hits_in(&self.cgroup_dirs)
    }

    /// A kept sandbox goes on for the next gateway: the keeper is told by the end of this
    /// gateway's channel, and its end is no longer reported here.
    fn detach(&self) {
        if let Some(keeper) = &self.keeper {
            keeper.detached.store(true, Ordering::SeqCst);
            if let Some(commands) = keeper.commands.lock().take() {
                commands.close();
            }
        }
    }

    /// The kernel has no host process of its own under gVisor (the Sentry runs it).
    fn pid(&self) -> Option<u32> {
        None
    }

    /// A process-directed signal in gVisor may be handed to any thread that does not block
    /// it, and CPython only notices a signal when its *main* thread wakes: a SIGINT that
    /// lands on one of ipykernel's helper threads never interrupts `time.sleep(60)`. So a
    /// small program run inside the sandbox (`runsc exec`) sends the signal to the kernel's
    /// main thread (`tgkill`: the kernel is the only child of the container's init, or PID 1
    /// itself without one) and to every other process of the container but the init, like a
    /// process-group signal. Without a Python in `/usr` to run it, `runsc kill --all` is the
    /// fallback.
    fn signal(&self, signal: i32) -> Result<(), SandboxError> {
        if self.exited.load(Ordering::SeqCst) {
            return Ok(());
        }
        let sig = signal.to_string();
        let result = if Path::new(SIGNAL_PYTHON).exists() {
            let user = format!("{}:{}", self.uid, self.gid);
            let script = signal_script();
            self.runsc.run(
                &["exec", "--user", &user, "--cwd", "/"],
                &[SIGNAL_PYTHON, "-S", "-c", &script, &sig],
            )
        } else {
            self.runsc.run(&["kill", "--all"], &[&sig])
        };
        match result {
            Ok(()) => Ok(()),
            // The container may have ended in the meantime.
            Err(_) if self.exited.load(Ordering::SeqCst) => Ok(()),
            Err(err) => Err(SandboxError::Signal(err)),
        }
    }

    fn kill(&self) -> Result<(), SandboxError> {
        if self.exited.load(Ordering::SeqCst) {
            return Ok(());
        }
        // Let runsc end the container's processes (so `runsc run` reaps its children), then
        // make sure: the sandbox and gofer die with `runsc run` by their parent-death signal.
        let _ = self.runsc.run(&["kill", "--all"], &["KILL"]);
        if let Some(keeper) = &self.keeper {
            return self.kill_kept(keeper);
        }
        if self.exited.load(Ordering::SeqCst) || self.pid == 0 {
            return Ok(());
        }
        let pid = i32::try_from(self.pid)
            .map_err(|_| SandboxError::Signal(io::Error::other("pid out of range")))?;
        // SAFETY: kill(2) with a negative pid signals runsc's process group; `runsc run` is
        // not reaped before `exited` is set, so the group id is not reused.
        let rc = unsafe { libc::kill(-pid, libc::SIGKILL) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::ESRCH) {
                return Err(SandboxError::Signal(err));
            }
        }
        Ok(())
    }
}

impl GvisorHandle {
    /// Asks the keeper to end `runsc run` (it then reports and cleans up); a keeper that
    /// cannot be asked is killed, and the sandbox with it (parent-death signals), its
    /// leftovers swept by the next gateway's start.
    fn kill_kept(&self, keeper: &KeeperLink) -> Result<(), SandboxError> {
        let asked = keeper
            .commands
            .lock()
            .as_mut()
            .is_some_and(|commands| commands.send("kill\n").is_ok());
        if asked || self.exited.load(Ordering::SeqCst) {
            return Ok(());
        }
        match &self.pidfd {
            Some(pidfd) => match crate::sandbox::sys::pidfd_send_signal(pidfd, libc::SIGKILL) {
                Err(err) if err.raw_os_error() != Some(libc::ESRCH) => {
                    Err(SandboxError::Signal(err))
                }
                _ => Ok(()),
            },
            None => Err(SandboxError::Signal(io::Error::other(
                "the sandbox's keeper cannot be reached",
            ))),
        }
    }
}

/// The interpreter that runs [`signal_script`] inside the sandbox (`/usr` is always shown).
const SIGNAL_PYTHON: &str = "/usr/bin/python3";

/// Sends signal `argv[1]` to the kernel's main thread and to every other process but the
/// container's init.
fn signal_script() -> String {
    // The kernel is PID 1, or PID 1's only child when the container runs under
    // `bundle::INIT` (orphans re-parented to the init come later: the lowest pid wins).
    // Everything else but the init gets the signal too, like a process-group signal; the
    // init itself would pass it on to the kernel a second time.
    format!(
        "import os, sys, ctypes\n\
         sig = int(sys.argv[1])\n\
         def ppid(p):\n    \
             try:\n        \
                 return int(open(f'/proc/{{p}}/stat').read().rsplit(')', 1)[1].split()[1])\n    \
             except (OSError, ValueError, IndexError):\n        \
                 return None\n\
         pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n\
         under_init = open('/proc/1/comm').read().strip() == 'tini'\n\
         kernel = min((p for p in pids if p != os.getpid() and ppid(p) == 1), default=1) if under_init else 1\n\
         ctypes.CDLL(None, use_errno=True).syscall({tgkill}, kernel, kernel, sig)\n\
         for p in pids:\n    \
             if p not in (1, kernel, os.getpid()):\n        \
                 try: os.kill(p, sig)\n        \
                 except OSError: pass\n",
        tgkill = libc::SYS_tgkill
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signal_program_is_valid_python() {
        if !Path::new(SIGNAL_PYTHON).exists() {
            return;
        }
        let status = std::process::Command::new(SIGNAL_PYTHON)
            .args(["-c", "import sys; compile(sys.argv[1], 'signal', 'exec')"])
            .arg(signal_script())
            .status()
            .unwrap();
        assert!(status.success());
    }
}
