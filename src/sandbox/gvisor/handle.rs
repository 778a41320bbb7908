//! Control of one running gVisor sandbox: the gateway's [`SandboxHandle`] for it.
//!
//! The kernel runs inside the Sentry and has no host process, so the handle holds
//! `runsc run`'s pid (leader of its process group, pinned by a pidfd) and a [`Runsc`] for
//! the container: signals and kills go through runsc, the size-limited workspace through
//! `runsc run`'s root in /proc, and the pids counter through the sandbox's cgroup.

#![allow(unsafe_code)]

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::cgroups;
use super::runsc::Runsc;
use crate::sandbox::sys::pidfd_exited;
use crate::sandbox::{SandboxError, SandboxHandle};

/// Control of one gVisor sandbox.
pub(super) struct GvisorHandle {
    /// `runsc run`'s pid, leader of its process group.
    pub(super) pid: u32,
    /// A pidfd of `runsc run`, when the host has pidfds (Linux 5.3+).
    pub(super) pidfd: Option<std::os::fd::OwnedFd>,
    /// Whether the workspace is the tmpfs in `runsc run`'s mount namespace (a size limit)
    /// rather than the host directory.
    pub(super) private_workspace: bool,
    /// The kernel's uid and gid, for the signalling program.
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) exited: Arc<AtomicBool>,
    pub(super) runsc: Runsc,
    /// The sandbox's cgroup (relative), when runsc manages cgroups.
    pub(super) cgroups_path: Option<String>,
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
        cgroups::pids_limit_hits(self.cgroups_path.as_deref()?)
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
