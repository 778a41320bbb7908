//! The ZMQ sockets the gateway holds to one kernel process: DEALERs for shell, control and
//! stdin sharing one identity (the kernel sends `input_request` to the identity that sent the
//! execute), a SUB for iopub, and a REQ for the heartbeat.
//!
//! One reader task per socket verifies and decodes each multipart and hands it to the
//! kernel's [`Router`]. A message that fails the signature or shape checks is dropped and
//! counted; it never stops a reader. Dropping [`Channels`] stops the readers.

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
}

impl Drop for Channels {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
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
        let signer = Signer::new(info.key.as_bytes());
        let mut sub_options = SocketOptions::default();
        sub_options.no_connect_timeout();
        let mut iopub = SubSocket::with_options(sub_options);
        iopub
            .subscribe("")
            .await
            .map_err(|err| KernelError::Zmq(err.to_string()))?;
        let (iopub_at, shell_at, control_at, stdin_at) = (
            info.iopub_endpoint(),
            info.shell_endpoint(),
            info.control_endpoint(),
            info.stdin_endpoint(),
        );
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
            match decode_multipart(channel, frames, &signer) {
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
