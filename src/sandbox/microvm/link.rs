//! The gateway's end of the agent link: the byte stream the agent protocol runs on.
//!
//! - **Hybrid vsock** (the default where `vhost-device-vsock` is installed): QEMU's
//!   `vhost-user-vsock-device` is served by rust-vmm's `vhost-device-vsock`, one process per
//!   VM, which joins the guest's vsock connections to host unix sockets: a connection the
//!   guest makes to the host's port P arrives at `<uds>_P`. The agent dials out when it is
//!   ready, so the gateway listens there before the VM starts and never polls a booting
//!   guest (polling with `CONNECT <port>` raced the guest's vsock driver: seen hanging with
//!   no answer). Firecracker and Cloud Hypervisor deliver guest connections the same way.
//! - **virtio-serial**: a port whose host end is a unix socket QEMU listens on. No second
//!   process, and QEMU can snapshot a VM that has one (it cannot with vhost-user vsock).

use std::path::{Path, PathBuf};
use std::time::Duration;

use cellgate_agent::protocol::VSOCK_PORT;

use super::confine::Jail;
use super::spawner_command;
use super::vmm::AgentLink;
use super::MicrovmError;
use crate::sandbox::agent::Duplex;
use crate::sandbox::spawner::Spawner;

/// The link's sockets in the VM's runtime directory: the serial port's (QEMU listens), the
/// vsock backend's vhost-user socket (it listens, QEMU connects) and the prefix of its
/// hybrid-vsock sockets.
pub(super) const SERIAL_SOCKET: &str = "agent.sock";
pub(super) const VHOST_SOCKET: &str = "vhost.sock";
pub(super) const VSOCK_SOCKET: &str = "vsock.sock";

/// Which transport a backend's VMs use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// virtio-serial.
    Serial,
    /// Hybrid vsock through this `vhost-device-vsock` binary.
    Vsock { backend: PathBuf },
}

impl Transport {
    /// The guest kernel command line's word for it.
    pub fn cmdline(&self) -> &'static str {
        match self {
            Transport::Serial => "cellgate.transport=serial",
            Transport::Vsock { .. } => "cellgate.transport=vsock",
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Transport::Serial => "virtio-serial",
            Transport::Vsock { .. } => "vsock",
        }
    }
}

/// One VM's link, set up before the VMM starts.
pub(super) struct Link {
    kind: LinkKind,
    /// The vsock device's backend process, which lives and dies with the VM.
    pub(super) companion: Option<tokio::process::Child>,
}

enum LinkKind {
    Serial {
        socket: PathBuf,
    },
    Vsock {
        /// Where the agent's connection arrives.
        listener: tokio::net::UnixListener,
    },
}

impl Link {
    /// Prepares the link in the VM's directory `dir`: for vsock, starts the device backend
    /// (confined in the VM's `jail`) and waits for its vhost-user socket. The paths the VMM
    /// and the backend are given are relative to `dir`, their working directory.
    pub(super) async fn prepare(
        transport: &Transport,
        dir: &Path,
        spawner: &Spawner,
        log: &Path,
        jail: &Jail,
    ) -> Result<Link, MicrovmError> {
        match transport {
            Transport::Serial => Ok(Link {
                kind: LinkKind::Serial {
                    socket: dir.join(SERIAL_SOCKET),
                },
                companion: None,
            }),
            Transport::Vsock { backend } => {
                let vhost = dir.join(VHOST_SOCKET);
                let uds = dir.join(VSOCK_SOCKET);
                let port = PathBuf::from(format!("{}_{VSOCK_PORT}", uds.display()));
                let listener = tokio::net::UnixListener::bind(&port)
                    .map_err(|e| MicrovmError::Start(format!("the agent's vsock port: {e}")))?;
                // The backend connects to it as the VMM's uid: connecting needs write
                // permission on the socket.
                if let Some(uid) = jail.uid() {
                    std::os::unix::fs::lchown(&port, Some(uid), Some(uid))
                        .map_err(|e| MicrovmError::Start(format!("the agent's vsock port: {e}")))?;
                }
                let mut command = spawner_command(backend, dir, log)?;
                command
                    .args(["--guest-cid", "3", "--socket", VHOST_SOCKET])
                    .args(["--uds-path", VSOCK_SOCKET]);
                jail.apply(&mut command);
                let mut child = spawner
                    .spawn(command)
                    .await
                    .map_err(|e| MicrovmError::Start(format!("{}: {e}", backend.display())))?;
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while !vhost.exists() {
                    if let Ok(Some(status)) = child.try_wait() {
                        return Err(MicrovmError::Start(format!(
                            "vhost-device-vsock ended at once ({status}); see {}",
                            log.display()
                        )));
                    }
                    if tokio::time::Instant::now() >= deadline {
                        let _ = child.start_kill();
                        return Err(MicrovmError::Start(
                            "vhost-device-vsock never opened its socket".to_owned(),
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Ok(Link {
                    kind: LinkKind::Vsock { listener },
                    companion: Some(child),
                })
            }
        }
    }

    /// What the VMM must attach, relative to its working directory.
    pub(super) fn vm_link(&self) -> AgentLink {
        match &self.kind {
            LinkKind::Serial { .. } => AgentLink::Serial {
                socket: PathBuf::from(SERIAL_SOCKET),
            },
            LinkKind::Vsock { .. } => AgentLink::Vsock {
                vhost: PathBuf::from(VHOST_SOCKET),
            },
        }
    }

    /// The stream to the agent, once there is one: the serial port's socket (retried while
    /// QEMU starts), or the agent's vsock connection (waited for while the guest boots).
    pub(super) async fn connect(&self, timeout: Duration) -> Result<Box<dyn Duplex>, MicrovmError> {
        let never = |error: String| {
            MicrovmError::Start(format!("the guest agent's link never opened: {error}"))
        };
        match &self.kind {
            LinkKind::Serial { socket } => {
                let deadline = tokio::time::Instant::now() + timeout;
                loop {
                    match connect_unix(socket).await {
                        Ok(stream) => return Ok(Box::new(stream)),
                        Err(error) if tokio::time::Instant::now() >= deadline => {
                            return Err(never(error.to_string()))
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            }
            LinkKind::Vsock { listener, .. } => {
                match tokio::time::timeout(timeout, listener.accept()).await {
                    Ok(Ok((stream, _))) => Ok(Box::new(stream)),
                    Ok(Err(error)) => Err(never(error.to_string())),
                    Err(_) => Err(never(format!("no connection within {timeout:?}"))),
                }
            }
        }
    }
}

/// The longest path a unix socket address holds, with its terminating NUL.
const SUN_PATH: usize = 108;

/// Connects to the unix socket at `path`, whatever its length: one longer than a socket
/// address holds is reached through a descriptor of its directory
/// (`/proc/self/fd/<n>/<name>`). A kept VM's sockets below a state directory can be that
/// long, where QEMU itself binds them by a relative name in its working directory.
pub(super) async fn connect_unix(path: &Path) -> std::io::Result<tokio::net::UnixStream> {
    use std::os::fd::AsRawFd;
    if path.as_os_str().len() < SUN_PATH {
        return tokio::net::UnixStream::connect(path).await;
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return tokio::net::UnixStream::connect(path).await;
    };
    let dir = rustix::fs::open(
        dir,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    let short = Path::new("/proc/self/fd")
        .join(dir.as_raw_fd().to_string())
        .join(name);
    tokio::net::UnixStream::connect(short).await
}

/// Whose listening socket a connection reached: `Err` with what was found unless the peer
/// is the process `pid`. For sockets in a directory a VMM (and so a guest that took it over)
/// can write: a link planted in place of QEMU's socket could point the gateway at any
/// socket it may reach (another VM's, a host daemon's), and nothing is sent before this
/// check passes.
#[allow(unsafe_code)] // getsockopt(2) into a local ucred
pub(super) fn check_peer(stream: &tokio::net::UnixStream, pid: u32) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    // Read with libc rather than rustix: a peer in a pid namespace this process cannot see
    // is reported as pid 0, which rustix's non-zero `Pid` cannot hold.
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket descriptor, and a buffer of the length given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(format!(
            "its peer's credentials: {}",
            std::io::Error::last_os_error()
        ));
    }
    let peer = cred.pid;
    if peer <= 0 || u32::try_from(peer).ok() != Some(pid) {
        return Err(format!(
            "not this VM's VMM's socket (its peer is pid {peer}, the VMM {pid})"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_socket_past_the_address_limit_is_reached_through_its_directory() {
        use std::os::fd::AsRawFd;
        let root = tempfile::tempdir().unwrap();
        let mut dir = root.path().to_owned();
        while dir.as_os_str().len() < SUN_PATH {
            dir = dir.join("a-long-directory-name");
        }
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let held = std::fs::File::open(&dir).unwrap();
        let _listener = tokio::net::UnixListener::bind(
            Path::new("/proc/self/fd")
                .join(held.as_raw_fd().to_string())
                .join("s.sock"),
        )
        .unwrap();
        assert!(tokio::net::UnixStream::connect(&path).await.is_err());
        assert!(connect_unix(&path).await.is_ok());
    }

    /// A socket whose listener is another process than the VMM is refused: what a link
    /// planted in place of QEMU's socket leads to.
    #[tokio::test]
    async fn only_the_vmms_own_socket_passes_the_peer_check() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let _listener = tokio::net::UnixListener::bind(&path).unwrap();
        let stream = connect_unix(&path).await.unwrap();
        assert!(check_peer(&stream, std::process::id()).is_ok());
        let mut other = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let err = check_peer(&stream, other.id()).unwrap_err();
        other.kill().unwrap();
        other.wait().unwrap();
        assert!(err.contains("not this VM's VMM's socket"), "{err}");
    }
}
