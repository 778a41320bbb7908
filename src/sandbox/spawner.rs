//! Spawning a backend's children so they die with the gateway, also when it is killed with
//! SIGKILL: each child gets `PR_SET_PDEATHSIG(SIGKILL)`. That signal fires when the *thread*
//! that forked the child exits, not the process, so every spawn of a backend happens on one
//! dedicated thread that lives as long as the backend does. Every backend needs exactly this
//! (the process backend's kernel, the namespaces helper, `runsc run`), hence one module.

#![allow(unsafe_code)]

use std::io;
use std::sync::mpsc;

use tokio::process::{Child, Command};
use tokio::sync::oneshot;

use super::SandboxError;

struct SpawnRequest {
    command: Command,
    reply: oneshot::Sender<io::Result<Child>>,
}

/// The spawning thread of one backend.
pub(super) struct Spawner {
    tx: mpsc::Sender<SpawnRequest>,
}

impl Spawner {
    /// Starts the thread. Must be called from within a tokio runtime: the thread registers
    /// the children (and their pipes) with it.
    pub(super) fn start(name: &str) -> Result<Spawner, SandboxError> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|err| SandboxError::Setup(format!("no tokio runtime: {err}")))?;
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _runtime = runtime.enter();
                for mut request in rx {
                    let result = request.command.spawn();
                    let _ = request.reply.send(result);
                }
            })
            .map_err(|err| {
                SandboxError::Setup(format!("cannot start the spawner thread: {err}"))
            })?;
        Ok(Spawner { tx })
    }

    /// Spawns `command` on the spawner thread, with the parent-death signal set in the child.
    pub(super) async fn spawn(&self, command: Command) -> io::Result<Child> {
        self.spawn_with(command, true, None).await
    }

    /// Spawns `command` on the spawner thread; with the parent-death signal when
    /// `pdeathsig` (a child that is to outlive the gateway has none); `fd_at`: a descriptor
    /// of the caller's (kept open until this returns) the child gets at a fixed number.
    pub(super) async fn spawn_with(
        &self,
        mut command: Command,
        pdeathsig: bool,
        fd_at: Option<(std::os::fd::RawFd, std::os::fd::RawFd)>,
    ) -> io::Result<Child> {
        if let Some((fd, at)) = fd_at {
            // SAFETY: runs in the forked child before exec and calls only dup2 and fcntl,
            // which are async-signal-safe.
            unsafe {
                command.pre_exec(move || {
                    if fd == at {
                        // Already in place: only close-on-exec must go.
                        if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                            return Err(io::Error::last_os_error());
                        }
                    } else if libc::dup2(fd, at) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        // SAFETY: the closure runs in the forked child before exec and only calls
        // async-signal-safe functions (prctl, getppid, _exit).
        if pdeathsig {
            unsafe {
                let parent = libc::getpid();
                command.pre_exec(move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    // The gateway may have died between fork and prctl.
                    if libc::getppid() != parent {
                        libc::_exit(1);
                    }
                    Ok(())
                });
            }
        }
        let (reply, response) = oneshot::channel();
        self.tx
            .send(SpawnRequest { command, reply })
            .map_err(|_| io::Error::other("spawner thread is gone"))?;
        response
            .await
            .unwrap_or_else(|_| Err(io::Error::other("spawner thread dropped the request")))
    }
}
