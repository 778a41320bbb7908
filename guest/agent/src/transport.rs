//! The byte stream to the gateway: a vsock connection the agent opens to the host, the
//! virtio-serial port, or, off pid 1, a unix socket for tests.
//!
//! vsock: the agent connects to the host (CID 2) on [`VSOCK_PORT`] as soon as it is ready,
//! and again after a session ends (a snapshot restore resets vsock connections). Dialing
//! out, not listening, means the host never guesses when the guest is up: it waits on its
//! own listener (hybrid vsock puts it at `<uds>_<port>`). A virtio-serial port is one pipe
//! for the VM's whole life, which the host side opens and closes. Both end up as one
//! [`Stream`] that the session module handshakes on.
//!
//! TCP (a Kubernetes pod's agent): the agent listens, since the gateway knows the pod's
//! address once the pod runs, and every connection must first prove the kernel's key
//! ([`cellgate_agent::protocol::prove_to_host`]). Proofs run concurrently, each with a
//! deadline and a cap on how many at once, so a port scanner or a stalled peer never holds
//! the gateway out; a connection that proves the key supersedes the session before it (a
//! gateway replica adopting the kernel after its owner vanished without closing).

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use cellgate_agent::protocol::{SERIAL_PORT_NAME, VSOCK_PORT};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Which transport the agent waits on.
#[derive(Debug, Clone)]
pub enum Kind {
    Vsock,
    Serial,
    Unix(PathBuf),
    Tcp {
        listen: std::net::SocketAddr,
        key_file: PathBuf,
    },
}

/// How long a TCP peer has to prove the key: a gateway answers in milliseconds, and every
/// unproven connection holds one of [`MAX_UNPROVEN`] slots meanwhile.
const PROOF_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
/// Unproven TCP connections at once; more are closed at once.
const MAX_UNPROVEN: usize = 16;

/// A duplex byte stream to the host.
pub trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

pub struct Stream {
    pub io: Box<dyn Duplex>,
    /// End of stream means "no host yet" (a virtio-serial port with its host side closed),
    /// not "gone": the handshake keeps waiting instead of giving up.
    pub eof_is_idle: bool,
    /// The peer proved the kernel's key already (TCP): the session starts attached.
    pub proven: bool,
}

pub enum Transport {
    Vsock,
    Serial(PathBuf),
    Unix(tokio::net::UnixListener),
    /// Connections that proved the key, from the acceptor task.
    Tcp(tokio::sync::mpsc::Receiver<Stream>),
}

impl Transport {
    pub async fn open(kind: &Kind) -> io::Result<Transport> {
        Ok(match kind {
            Kind::Vsock => Transport::Vsock,
            Kind::Serial => Transport::Serial(find_serial_port()?),
            Kind::Unix(path) => {
                let _ = std::fs::remove_file(path);
                Transport::Unix(tokio::net::UnixListener::bind(path)?)
            }
            Kind::Tcp { listen, key_file } => {
                let key = std::fs::read_to_string(key_file).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("the key file {}: {e}", key_file.display()),
                    )
                })?;
                let key = key.trim().as_bytes().to_vec();
                if key.len() < 32 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("the key in {} is shorter than 32 bytes", key_file.display()),
                    ));
                }
                let listener = tokio::net::TcpListener::bind(listen).await?;
                Transport::Tcp(accept_proven(listener, key))
            }
        })
    }

    /// Whether a new connection ends the session in progress (TCP: a replica adopting the
    /// kernel); the other transports serve one session after the other.
    pub fn supersedes(&self) -> bool {
        matches!(self, Transport::Tcp(_))
    }

    /// Waits for the next host connection.
    pub async fn accept(&mut self) -> io::Result<Stream> {
        Ok(match self {
            Transport::Vsock => Stream {
                io: Box::new(SmallWrites(dial_host().await)),
                eof_is_idle: false,
                proven: false,
            },
            Transport::Serial(path) => Stream {
                io: Box::new(SerialPort::open(path)?),
                eof_is_idle: true,
                proven: false,
            },
            Transport::Unix(listener) => Stream {
                io: Box::new(listener.accept().await?.0),
                eof_is_idle: false,
                proven: false,
            },
            Transport::Tcp(proven) => proven.recv().await.ok_or_else(|| {
                io::Error::new(io::ErrorKind::BrokenPipe, "the TCP listener ended")
            })?,
        })
    }
}

/// 128 bits from the kernel's generator, in hex: the guest's side of a proof.
pub fn random_nonce() -> String {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            // EINTR; the generator itself never fails once seeded.
            Err(_) => continue,
        }
    }
    cellgate_agent::protocol::encode_hex(&bytes)
}

/// Accepts TCP connections and passes on those that prove `key`, in the order they did.
fn accept_proven(
    listener: tokio::net::TcpListener,
    key: Vec<u8>,
) -> tokio::sync::mpsc::Receiver<Stream> {
    let (proven_tx, proven) = tokio::sync::mpsc::channel(1);
    let key = std::sync::Arc::new(key);
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_UNPROVEN));
    tokio::spawn(async move {
        loop {
            let Ok((tcp, peer)) = listener.accept().await else {
                // Out of descriptors, say: a moment, then on.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue; // dropped: closed at once
            };
            let _ = tcp.set_nodelay(true);
            let (key, proven_tx) = (key.clone(), proven_tx.clone());
            tokio::spawn(async move {
                let nonce = random_nonce();
                let mut io = tokio::io::BufReader::new(tcp);
                let proof = cellgate_agent::protocol::prove_to_host(&mut io, &key, &nonce);
                match tokio::time::timeout(PROOF_DEADLINE, proof).await {
                    Ok(Ok(true)) => {
                        drop(slot);
                        let stream = Stream {
                            io: Box::new(io),
                            eof_is_idle: false,
                            proven: true,
                        };
                        let _ = proven_tx.send(stream).await;
                    }
                    _ => eprintln!("cellgate-agent: {peer} did not prove the key; closed"),
                }
            });
        }
    });
    proven
}

/// The largest write handed to the guest's vsock socket.
///
/// Why: rust-vmm's vhost-device-vsock (0.3.0, the latest) lost bytes of large writes from
/// the guest to the host (seen with 64 KiB writes under TCG: the gateway's yamux decoder then
/// met file bytes where a frame header belonged and the session broke), while the same
/// transfers in 8 KiB writes arrived intact in every test. Its transmit path drops a packet
/// it cannot buffer (`send_bytes`: "TODO: Terminate this connection"): small writes make
/// that rarer, not impossible. A lost packet breaks the session, which the gateway reports
/// as the sandbox failing (never as corrupted data). The fix belongs upstream; yamux
/// completes partial writes by itself.
const MAX_VSOCK_WRITE: usize = 8 << 10;

/// A vsock stream whose writes are at most [`MAX_VSOCK_WRITE`] bytes.
struct SmallWrites(tokio_vsock::VsockStream);

impl AsyncRead for SmallWrites {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for SmallWrites {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let data = &data[..data.len().min(MAX_VSOCK_WRITE)];
        Pin::new(&mut self.0).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Connects to the host's agent port, retrying until the host listens.
async fn dial_host() -> tokio_vsock::VsockStream {
    let host = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_HOST, VSOCK_PORT);
    loop {
        match tokio_vsock::VsockStream::connect(host).await {
            Ok(stream) => return stream,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
}

/// The `/dev` node of the virtio-serial port named [`SERIAL_PORT_NAME`].
fn find_serial_port() -> io::Result<PathBuf> {
    for entry in std::fs::read_dir("/sys/class/virtio-ports")? {
        let entry = entry?;
        let name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if name.trim_end() == SERIAL_PORT_NAME {
            return Ok(PathBuf::from("/dev").join(entry.file_name()));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no virtio-serial port named {SERIAL_PORT_NAME}"),
    ))
}

/// A virtio-serial port opened non-blocking and driven by the reactor.
///
/// While the port's host side is closed the guest's driver reports it hung up, and tokio
/// keeps "read closed" and "write closed" once it has seen them: the port then always looks
/// ready, and a read or write that finds nothing to do (`EAGAIN`) would be retried at once,
/// for ever. That is what a VM restored from a snapshot meets: its agent opened the port
/// while the zygote's host was gone, and the new host is there now (seen: the agent's main
/// thread at 100 % of the vCPU, halving the kernel's speed). On `EAGAIN` behind such stale
/// readiness the port's descriptor is registered with the reactor afresh, which reports its
/// state as it is now. Never closed and opened again: closing a port drops what the host
/// sent and the guest has not read yet.
struct SerialPort {
    /// Always `Some` but while [`SerialPort::refresh`] swaps the registration.
    fd: Option<AsyncFd<OwnedFd>>,
    /// A pause after a fresh registration that still found stale readiness (a port that
    /// says hung-up and yet would block): the retries then come at most every 10 ms.
    backoff: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl SerialPort {
    fn open(path: &PathBuf) -> io::Result<SerialPort> {
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::open(
            path,
            OFlags::RDWR | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
            Mode::empty(),
        )?;
        Ok(SerialPort {
            fd: Some(register(fd)?),
            backoff: None,
        })
    }

    fn fd(&self) -> io::Result<&AsyncFd<OwnedFd>> {
        self.fd
            .as_ref()
            .ok_or_else(|| io::Error::other("the serial port's registration was lost"))
    }

    /// Registers the descriptor with the reactor afresh (see the type's doc); `Pending`
    /// (with a wake-up in 10 ms) when the last registration was fresh already.
    fn refresh(&mut self, cx: &mut Context<'_>, fresh: &mut bool) -> Poll<io::Result<()>> {
        if *fresh {
            let backoff = self.backoff.get_or_insert_with(|| {
                Box::pin(tokio::time::sleep(std::time::Duration::from_millis(10)))
            });
            ready!(backoff.as_mut().poll(cx));
            self.backoff = None;
        }
        let fd = self
            .fd
            .take()
            .ok_or_else(|| io::Error::other("the serial port's registration was lost"))?;
        self.fd = Some(register(fd.into_inner())?);
        *fresh = true;
        Poll::Ready(Ok(()))
    }
}

#[allow(unsafe_code)]
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor stays open and the same for
    // the AsyncFd's whole life, and OwnedFd::as_raw_fd always answers that one descriptor.
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

impl AsyncRead for SerialPort {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let mut fresh = false;
        loop {
            let stale = {
                let mut guard = ready!(this.fd()?.poll_read_ready(cx))?;
                let stale = guard.ready().is_read_closed();
                let unfilled = buf.initialize_unfilled();
                match guard.try_io(|fd| Ok(rustix::io::read(fd.get_ref().as_fd(), &mut *unfilled)?))
                {
                    Ok(Ok(n)) => {
                        buf.advance(n);
                        return Poll::Ready(Ok(()));
                    }
                    Ok(Err(error)) => return Poll::Ready(Err(error)),
                    Err(_would_block) => stale,
                }
            };
            if stale {
                ready!(this.refresh(cx, &mut fresh))?;
            }
        }
    }
}

impl AsyncWrite for SerialPort {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let mut fresh = false;
        loop {
            let stale = {
                let mut guard = ready!(this.fd()?.poll_write_ready(cx))?;
                let stale = guard.ready().is_write_closed();
                match guard.try_io(|fd| Ok(rustix::io::write(fd.get_ref().as_fd(), data)?)) {
                    Ok(result) => return Poll::Ready(result),
                    Err(_would_block) => stale,
                }
            };
            if stale {
                ready!(this.refresh(cx, &mut fresh))?;
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
