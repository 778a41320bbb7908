//! The `process` backend: the kernel as a plain child process, with no isolation at all.
//!
//! For development and for tests of everything above the sandbox. The gateway refuses it
//! unless the configuration names it, and logs every start as unsandboxed.
//!
//! Dying with the gateway: each kernel gets `PR_SET_PDEATHSIG(SIGKILL)`. The kernel receives
//! that signal when the *thread* that forked it exits, so all spawns happen on one dedicated
//! thread that lives as long as this backend does. Each kernel leads its own process group,
//! so `kill` and interrupts reach the processes it started too.

#![allow(unsafe_code)]

use super::diagnosis::Diagnosis;
use super::spawner::Spawner;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::process::Command;
use tokio::sync::watch;

use super::{
    Backend, ExitCause, ExitReason, ExitReport, LaunchSpec, Launched, ResourceUsage, Sandbox,
    SandboxError, SandboxHandle,
};

/// Starts kernels as child processes of the gateway.
pub struct ProcessSandbox {
    spawner: Spawner,
}

impl ProcessSandbox {
    /// Must be called from within a tokio runtime: the spawner thread registers children
    /// with it.
    pub fn new() -> Result<ProcessSandbox, SandboxError> {
        let spawner = Spawner::start("cellgate-spawner")?;
        Ok(ProcessSandbox { spawner })
    }
}

impl Sandbox for ProcessSandbox {
    fn backend(&self) -> Backend {
        Backend::Process
    }

    fn launch<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<Launched, SandboxError>> {
        Box::pin(self.launch_process(spec))
    }
}

impl ProcessSandbox {
    async fn launch_process(&self, spec: &LaunchSpec) -> Result<Launched, SandboxError> {
        tracing::warn!(
            kernel_id = %spec.kernel_id,
            "starting kernel WITHOUT a sandbox (process backend): its code runs with the gateway's privileges"
        );
        let program = spec.argv.first().cloned().unwrap_or_default();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&spec.log_file)
            .map_err(|err| {
                SandboxError::Setup(format!("open {}: {err}", spec.log_file.display()))
            })?;
        let log_err = log
            .try_clone()
            .map_err(|err| SandboxError::Setup(format!("dup the kernel log: {err}")))?;
        let mut command = Command::new(&program);
        command
            .args(&spec.argv[1..])
            .env_clear()
            .envs(&spec.env)
            .current_dir(&spec.workspace)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0)
            .kill_on_drop(false);
        let child = self
            .spawner
            .spawn(command)
            .await
            .map_err(|source| SandboxError::Spawn {
                program: program.clone(),
                source,
            })?;
        let pid = child.id().unwrap_or(0);
        let exited = Arc::new(AtomicBool::new(false));
        let (exit_tx, exit_rx) = watch::channel(None);
        let watcher_exited = exited.clone();
        tokio::spawn(async move {
            let mut child = child;
            let report = match child.wait().await {
                Ok(status) => ExitReport {
                    code: status.code(),
                    signal: status.signal(),
                    reason: None,
                },
                Err(err) => ExitReport {
                    code: None,
                    signal: None,
                    reason: Some(ExitReason::new(
                        ExitCause::SandboxFailed,
                        format!("lost track of the kernel process: {err}"),
                    )),
                },
            };
            watcher_exited.store(true, Ordering::SeqCst);
            // The process group may still hold the kernel's children.
            // SAFETY: kill(2) with a negative pid signals a process group; no memory involved.
            unsafe {
                libc::kill(-(pid as i32), libc::SIGKILL);
            }
            let _ = exit_tx.send(Some(report));
        });
        Ok(Launched {
            handle: Arc::new(ProcessHandle { pid, exited }),
            exit: exit_rx,
            connection: spec.connection.clone(),
        })
    }
}

struct ProcessHandle {
    pid: u32,
    exited: Arc<AtomicBool>,
}

impl ProcessHandle {
    fn signal_group(&self, signal: i32) -> Result<(), SandboxError> {
        if self.exited.load(Ordering::SeqCst) || self.pid == 0 {
            // Never signal a pid that may have been reused.
            return Ok(());
        }
        // SAFETY: kill(2) with a negative pid signals the kernel's process group.
        let rc = unsafe { libc::kill(-(self.pid as i32), signal) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::ESRCH) {
                return Err(SandboxError::Signal(err));
            }
        }
        Ok(())
    }
}

impl SandboxHandle for ProcessHandle {
    fn pid(&self) -> Option<u32> {
        Some(self.pid)
    }

    fn signal(&self, signal: i32) -> Result<(), SandboxError> {
        // jupyter_client interrupts the whole process group too, so `!sleep 60` stops.
        self.signal_group(signal)
    }

    fn kill(&self) -> Result<(), SandboxError> {
        self.signal_group(libc::SIGKILL)
    }

    fn usage(&self) -> ResourceUsage {
        super::procfs::usage(self.pid).unwrap_or_default()
    }
}

/// The process backend runs anywhere, and isolates nothing.
pub fn diagnose() -> Diagnosis {
    let mut s = Diagnosis::new("process");
    s.fact("isolation", "none (development only; refused unless named)");
    s
}
