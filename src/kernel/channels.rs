//! The ZMQ sockets the gateway holds to one kernel process: DEALERs for shell, control and
//! stdin sharing one identity (the kernel sends `input_request` to the identity that sent the
//! execute), a SUB for iopub, and a REQ for the heartbeat.
//!
//! The kernel's ipc sockets are awaited with inotify (no polling while fifty kernels start)
//! and pinned by `O_PATH` descriptors. One reader task per socket verifies and decodes each
//! multipart and hands it to the kernel's [`Router`]; a large message is checked off the
//! async workers (signature and JSON in parallel), so other kernels' messages keep flowing.
//! A message that fails the signature or shape checks is dropped and counted; it never
//! stops a reader. Dropping [`Channels`] stops the readers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use zeromq::util::PeerIdentity;
use zeromq::{
    DealerSendHalf, DealerSocket, ReqSocket, Socket, SocketOptions, SocketRecv, SocketSend,
    SubSocket, ZmqMessage,
};

use super::router::Router;
use super::KernelError;
use crate::protocol::{
    decode_multipart, encode_multipart, Channel, ConnectionInfo, Message, Signer,
    PARALLEL_CHECK_BYTES,
};

/// Messages dropped because they failed verification, across all kernels (for metrics).
pub static DROPPED_INVALID: AtomicU64 = AtomicU64::new(0);

/// Open sockets to one kernel process.
pub struct Channels {
    shell: Mutex<DealerSendHalf>,
    control: Mutex<DealerSendHalf>,
    stdin: Mutex<DealerSendHalf>,
    signer: Signer,
    tasks: Vec<JoinHandle<()>>,
    /// `O_PATH` handles of the kernel's ipc sockets; every (re)connect goes through them.
    _pinned: Vec<std::fs::File>,
    /// The heartbeat endpoint, through its pinned handle.
    pub hb_endpoint: String,
}

/// The kernel's ipc sockets, pinned: the gateway (which may run as root, outside the
/// sandbox) must never connect through a path the sandboxed kernel can rewrite. It waits until
/// the kernel has bound all five sockets, opens each with `O_PATH | O_NOFOLLOW` (a symlink is
/// refused, not followed), checks it is a socket, and connects through `/proc/self/fd/N` from
/// then on — ZMQ reconnects included — so swapping a socket for a link later changes nothing.
struct Pinned {
    files: Vec<std::fs::File>,
    info: ConnectionInfo,
    endpoints: [String; 5],
}

async fn pin_sockets(info: &ConnectionInfo) -> Result<Pinned, KernelError> {
    if info.transport != "ipc" {
        let endpoints = [
            info.shell_endpoint(),
            info.iopub_endpoint(),
            info.stdin_endpoint(),
            info.control_endpoint(),
            info.hb_endpoint(),
        ];
        return Ok(Pinned {
            files: Vec::new(),
            info: info.clone(),
            endpoints,
        });
    }
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    use std::os::unix::io::AsRawFd;
    let ports = [
        info.shell_port,
        info.iopub_port,
        info.stdin_port,
        info.control_port,
        info.hb_port,
    ];
    let paths: Vec<std::path::PathBuf> = ports
        .iter()
        .map(|port| std::path::PathBuf::from(format!("{}-{}", info.ip, port)))
        .collect();
    // The caller bounds this wait with the start timeout and the kernel's exit.
    wait_for_paths(&paths).await;
    let mut files = Vec::with_capacity(5);
    let mut endpoints = Vec::with_capacity(5);
    for path in &paths {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| KernelError::Io {
                what: format!(
                    "open the kernel's socket {} (a symlink is refused)",
                    path.display()
                ),
                source,
            })?;
        let is_socket = file
            .metadata()
            .map(|m| m.file_type().is_socket())
            .unwrap_or(false);
        if !is_socket {
            return Err(KernelError::NotASocket {
                path: path.display().to_string(),
            });
        }
        endpoints.push(format!("ipc:///proc/self/fd/{}", file.as_raw_fd()));
        files.push(file);
    }
    let endpoints: [String; 5] = endpoints
        .try_into()
        .map_err(|_| KernelError::Zmq("five sockets expected".into()))?;
    Ok(Pinned {
        files,
        info: info.clone(),
        endpoints,
    })
}

impl Drop for Channels {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Returns once every path exists. Woken by inotify on their directories: a kernel may take
/// seconds to bind its sockets when many start at once, and polling every few milliseconds
/// for all of them cost the gateway measurable CPU (BENCHMARKS.md, "Measurements behind the
/// code"). A slow tick re-checks anyway, so a missed event (a directory replaced, inotify
/// instances exhausted) only costs latency; without inotify at all it polls.
#[allow(unsafe_code)] // AsyncFd::register (tokio's safe constructor is deprecated as unsound)
async fn wait_for_paths(paths: &[std::path::PathBuf]) {
    use rustix::fs::inotify;
    let all_there = || paths.iter().all(|p| std::fs::symlink_metadata(p).is_ok());
    let watcher = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)
        .ok()
        .filter(|fd| {
            let mut dirs: Vec<&std::path::Path> = paths.iter().filter_map(|p| p.parent()).collect();
            dirs.dedup();
            dirs.iter().all(|dir| {
                inotify::add_watch(
                    fd,
                    *dir,
                    inotify::WatchFlags::CREATE | inotify::WatchFlags::MOVED_TO,
                )
                .is_ok()
            })
        })
        // SAFETY: the OwnedFd is a valid inotify descriptor that the AsyncFd owns from
        // here on; nothing else closes or replaces it while it is registered.
        .and_then(|fd| unsafe { tokio::io::unix::AsyncFd::register(fd) }.ok());
    let tick = if watcher.is_some() {
        Duration::from_millis(250)
    } else {
        Duration::from_millis(5)
    };
    // Checked after the watch is in place, so a creation in between is not missed.
    while !all_there() {
        let Some(watcher) = &watcher else {
            tokio::time::sleep(tick).await;
            continue;
        };
        tokio::select! {
            ready = watcher.readable() => {
                if let Ok(mut guard) = ready {
                    // Which file appeared does not matter: drain, then check them all.
                    let mut buf = [0u8; 4096];
                    while rustix::io::read(guard.get_inner(), &mut buf).is_ok() {}
                    guard.clear_ready();
                } else {
                    tokio::time::sleep(tick).await;
                }
            }
            _ = tokio::time::sleep(tick) => {}
        }
    }
}

async fn dealer(endpoint: &str, identity: &str) -> Result<DealerSocket, KernelError> {
    let mut options = SocketOptions::default();
    let identity: PeerIdentity = identity
        .parse()
        .map_err(|err: zeromq::ZmqError| KernelError::Zmq(err.to_string()))?;
    options.peer_identity(identity).no_connect_timeout();
    let mut socket = DealerSocket::with_options(options);
    socket
        .connect(endpoint)
        .await
        .map_err(|err| KernelError::Zmq(format!("connect {endpoint}: {err}")))?;
    Ok(socket)
}

impl Channels {
    /// Connects to a kernel's sockets and starts delivering its messages to `router`.
    /// Waits for the kernel to bind, so callers bound it with a timeout.
    pub async fn connect(
        info: &ConnectionInfo,
        identity: &str,
        router: Arc<Router>,
    ) -> Result<Channels, KernelError> {
        let pinned = pin_sockets(info).await?;
        let info = &pinned.info;
        let signer = Signer::new(info.key.as_bytes());
        let mut sub_options = SocketOptions::default();
        sub_options.no_connect_timeout();
        let mut iopub = SubSocket::with_options(sub_options);
        iopub
            .subscribe("")
            .await
            .map_err(|err| KernelError::Zmq(err.to_string()))?;
        let [shell_at, iopub_at, stdin_at, control_at, hb_at] = pinned.endpoints.clone();
        let (iopub_conn, shell, control, stdin) = tokio::join!(
            iopub.connect(&iopub_at),
            dealer(&shell_at, identity),
            dealer(&control_at, identity),
            dealer(&stdin_at, identity),
        );
        iopub_conn.map_err(|err| KernelError::Zmq(format!("connect iopub: {err}")))?;
        let (shell_tx, shell_rx) = shell?.split();
        let (control_tx, control_rx) = control?.split();
        let (stdin_tx, stdin_rx) = stdin?.split();
        let tasks = vec![
            spawn_reader(Channel::Iopub, iopub, signer.clone(), router.clone()),
            spawn_reader(Channel::Shell, shell_rx, signer.clone(), router.clone()),
            spawn_reader(Channel::Control, control_rx, signer.clone(), router.clone()),
            spawn_reader(Channel::Stdin, stdin_rx, signer.clone(), router),
        ];
        Ok(Channels {
            shell: Mutex::new(shell_tx),
            control: Mutex::new(control_tx),
            stdin: Mutex::new(stdin_tx),
            signer,
            tasks,
            _pinned: pinned.files,
            hb_endpoint: hb_at,
        })
    }

    /// Signs and sends one message on its channel.
    pub async fn send(&self, message: &Message) -> Result<(), KernelError> {
        let frames = encode_multipart(message, &self.signer);
        let zmq =
            ZmqMessage::try_from(frames).map_err(|_| KernelError::Zmq("empty message".into()))?;
        let socket = match message.channel {
            Channel::Shell => &self.shell,
            Channel::Control => &self.control,
            Channel::Stdin => &self.stdin,
            Channel::Iopub | Channel::Heartbeat => {
                return Err(KernelError::BadChannel(message.channel))
            }
        };
        socket
            .lock()
            .await
            .send(zmq)
            .await
            .map_err(|err| KernelError::Zmq(err.to_string()))
    }
}

fn spawn_reader<S>(
    channel: Channel,
    mut socket: S,
    signer: Signer,
    router: Arc<Router>,
) -> JoinHandle<()>
where
    S: SocketRecv + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let frames: Vec<Bytes> = match socket.recv().await {
                Ok(message) => message.into_vec(),
                Err(err) => {
                    tracing::debug!(%channel, %err, "kernel socket closed");
                    return;
                }
            };
            // Checking a large message takes milliseconds of CPU: off the async workers, so
            // other kernels' messages keep flowing meanwhile. Order is kept (awaited here).
            let size: usize = frames.iter().map(Bytes::len).sum();
            let decoded = if size >= PARALLEL_CHECK_BYTES {
                let signer = signer.clone();
                match tokio::task::spawn_blocking(move || {
                    decode_multipart(channel, frames, &signer)
                })
                .await
                {
                    Ok(decoded) => decoded,
                    Err(err) => {
                        tracing::error!(%channel, %err, "checking a large kernel message failed");
                        continue;
                    }
                }
            } else {
                decode_multipart(channel, frames, &signer)
            };
            match decoded {
                Ok(message) => router.deliver(message),
                Err(err) => {
                    DROPPED_INVALID.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%channel, %err, "dropped an invalid message from the kernel");
                }
            }
        }
    })
}

/// Checks that the kernel's event loop answers heartbeats; logs when it stops answering.
/// Liveness of the process itself comes from the sandbox's exit watch, which is faster.
pub fn spawn_heartbeat(endpoint: String, kernel_id: String) -> JoinHandle<()> {
    tokio::spawn(async move {
        const INTERVAL: Duration = Duration::from_secs(5);
        const TIMEOUT: Duration = Duration::from_secs(3);
        let mut misses = 0u32;
        loop {
            let mut socket = ReqSocket::new();
            if tokio::time::timeout(TIMEOUT, socket.connect(&endpoint))
                .await
                .is_err()
            {
                misses += 1;
            } else {
                loop {
                    tokio::time::sleep(INTERVAL).await;
                    let ping = ZmqMessage::from(Bytes::from_static(b"cellgate-ping"));
                    let answered = tokio::time::timeout(TIMEOUT, async {
                        socket.send(ping).await.ok()?;
                        socket.recv().await.ok()
                    })
                    .await;
                    match answered {
                        Ok(Some(_)) => {
                            if misses > 0 {
                                tracing::info!(%kernel_id, "kernel answers heartbeats again");
                            }
                            misses = 0;
                        }
                        // A REQ socket that timed out mid-exchange cannot be reused.
                        _ => break,
                    }
                }
                misses += 1;
            }
            if misses == 3 {
                tracing::warn!(%kernel_id, "kernel has not answered 3 heartbeats (its event loop may be blocked)");
            }
            tokio::time::sleep(INTERVAL).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn info(dir: &std::path::Path) -> ConnectionInfo {
        ConnectionInfo::ipc(&dir.join("k"), "key".into(), "python3")
    }

    #[tokio::test]
    async fn sockets_are_pinned_and_links_refused() {
        let dir = tempfile::tempdir().unwrap();
        let listeners: Vec<UnixListener> = (1..=5)
            .map(|p| UnixListener::bind(dir.path().join(format!("k-{p}"))).unwrap())
            .collect();
        let pinned = pin_sockets(&info(dir.path())).await.unwrap();
        assert!(pinned
            .endpoints
            .iter()
            .all(|e| e.starts_with("ipc:///proc/self/fd/")));
        // Replacing a socket by a link to somewhere else after pinning changes nothing: the
        // handle still reaches the original listener.
        let elsewhere = tempfile::tempdir().unwrap();
        let decoy = UnixListener::bind(elsewhere.path().join("decoy")).unwrap();
        decoy.set_nonblocking(true).unwrap();
        std::fs::remove_file(dir.path().join("k-1")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("decoy"), dir.path().join("k-1")).unwrap();
        let path = pinned.endpoints[0].trim_start_matches("ipc://");
        std::os::unix::net::UnixStream::connect(path).unwrap();
        listeners[0].accept().unwrap();
        assert!(decoy.accept().is_err(), "the decoy got nothing");

        // A link where a socket should be is refused, not followed.
        let planted = tempfile::tempdir().unwrap();
        for p in 1..=5 {
            std::os::unix::fs::symlink(
                elsewhere.path().join("decoy"),
                planted.path().join(format!("k-{p}")),
            )
            .unwrap();
        }
        // (O_PATH | O_NOFOLLOW opens the link itself, which is no socket.)
        assert!(matches!(
            pin_sockets(&info(planted.path())).await,
            Err(KernelError::NotASocket { .. })
        ));
        // So is a file that is not a socket.
        let files = tempfile::tempdir().unwrap();
        for p in 1..=5 {
            std::fs::write(files.path().join(format!("k-{p}")), b"").unwrap();
        }
        assert!(matches!(
            pin_sockets(&info(files.path())).await,
            Err(KernelError::NotASocket { .. })
        ));
    }
}
