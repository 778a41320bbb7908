//! The gateway's end of the agent protocol (`cellgate_agent::protocol`): the handshake, the
//! yamux session, requests on the control stream, channel streams, and the guest's egress
//! streams joined to the egress proxy.
//!
//! Everything the guest sends is hostile input: lines are read with a length cap, replies
//! wait with a deadline, and a malformed message ends the session (and with it the VM).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cellgate_agent::protocol::{
    self, begin, hello, parse_go, parse_ready, read_json, read_line, write_json, Channel, Exit,
    GuestMessage, Op, Open, Reply, Request,
};
use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{oneshot, watch, Mutex};

use super::AgentError;

/// How long a request waits for its reply. Generous: an emulated guest is slow, and a start
/// writes files and forks.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// Streams the guest may have open towards the egress proxy at once; more are closed at once.
/// The proxy caps a session's connections lower still; this bounds the gateway's tasks and
/// descriptors whatever a hostile guest opens.
const MAX_GUEST_STREAMS: usize = 64;

/// A duplex byte stream to the guest.
pub trait Duplex: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Duplex for T {}

type Pending = Arc<parking_lot::Mutex<HashMap<u64, oneshot::Sender<Reply>>>>;

/// A live session with one guest's agent.
pub struct Agent {
    streams: Mutex<tokio_yamux::Control>,
    control: Mutex<tokio::io::WriteHalf<tokio_yamux::StreamHandle>>,
    pending: Pending,
    next_id: AtomicU64,
    exit: watch::Receiver<Option<Exit>>,
    /// Set when the session ended (the guest or the transport went away, or broke the
    /// protocol): why.
    closed: watch::Receiver<Option<String>>,
    /// The task that owns the session and its transport: aborting it closes the link.
    session: tokio::task::AbortHandle,
    /// The host detached: the link's end is expected, not the guest breaking the protocol.
    detaching: Arc<std::sync::atomic::AtomicBool>,
}

/// How long the handshake waits for an answer before it says `HELLO` again. A VM restored
/// from a snapshot may still be ending the session it had when it was saved, which can eat a
/// first `HELLO`.
const HELLO_AGAIN: Duration = Duration::from_secs(2);

impl Agent {
    /// Handshakes on `io` and starts the session. Egress streams the guest opens are joined
    /// to `egress` (the proxy's unix socket), or refused when there is none.
    pub async fn connect(
        io: impl Duplex,
        egress: Option<PathBuf>,
        handshake_timeout: Duration,
    ) -> Result<Agent, AgentError> {
        let nonce = format!("{:032x}", rand::random::<u128>());
        let mut io = BufReader::new(io);
        // See the handshake in `cellgate_agent::protocol`: lines other than the one awaited
        // are skipped (what an old session left in the pipe, a restored guest's last frames,
        // repeated answers); the whole handshake has `handshake_timeout`.
        let mut last_line = String::new();
        let handshake = async {
            let mut say_hello = tokio::time::Instant::now();
            loop {
                if tokio::time::Instant::now() >= say_hello {
                    send_line(&mut io, &hello(&nonce)).await?;
                    say_hello = tokio::time::Instant::now() + HELLO_AGAIN;
                }
                // A read cut by the timer loses at most part of a line; the guest answers
                // the next HELLO again.
                let line = tokio::select! {
                    line = handshake_line(&mut io) => line?,
                    () = tokio::time::sleep_until(say_hello) => continue,
                };
                match line {
                    Some(line) if parse_ready(&line) == Some(nonce.as_str()) => break,
                    Some(line) => last_line = line.chars().take(80).collect(),
                    None => {}
                }
            }
            send_line(&mut io, &begin(&nonce)).await?;
            loop {
                match handshake_line(&mut io).await? {
                    Some(line) if parse_go(&line) == Some(nonce.as_str()) => {
                        return Ok::<(), AgentError>(())
                    }
                    Some(line) => last_line = line.chars().take(80).collect(),
                    None => {}
                }
            }
        };
        let shaken = tokio::time::timeout(handshake_timeout, handshake).await;
        match shaken {
            Ok(result) => result?,
            Err(_) if last_line.is_empty() => {
                return Err(AgentError("the guest agent did not answer in time".into()))
            }
            Err(_) => {
                return Err(AgentError(format!(
                    "the guest agent did not answer in time; it said {last_line:?}"
                )))
            }
        }

        let mut session = tokio_yamux::Session::new_client(io, protocol::yamux_config());
        let mut streams = session.control();
        let (closed_tx, closed) = watch::channel(None);
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_GUEST_STREAMS));
        let session_task = tokio::spawn(async move {
            let why = loop {
                match session.next().await {
                    Some(Ok(stream)) => {
                        // Dropping the stream resets it: the guest's connection fails.
                        let Ok(slot) = slots.clone().try_acquire_owned() else {
                            continue;
                        };
                        let egress = egress.clone();
                        tokio::spawn(async move {
                            serve_guest_stream(stream, egress).await;
                            drop(slot);
                        });
                    }
                    Some(Err(error)) => break format!("the agent session broke: {error}"),
                    None => break "the guest closed the agent session".to_owned(),
                }
            };
            closed_tx.send_replace(Some(why));
        });
        let session = session_task.abort_handle();

        let mut control = open(&mut streams, &Open::Control).await?;
        control
            .flush()
            .await
            .map_err(|e| AgentError(format!("control stream: {e}")))?;
        let (reader, writer) = tokio::io::split(control);
        let pending: Pending = Arc::default();
        let (exit_tx, exit) = watch::channel(None);
        let detaching = Arc::new(std::sync::atomic::AtomicBool::new(false));
        tokio::spawn(read_control(
            BufReader::new(reader),
            pending.clone(),
            exit_tx,
            detaching.clone(),
        ));
        Ok(Agent {
            streams: Mutex::new(streams),
            control: Mutex::new(writer),
            pending,
            next_id: AtomicU64::new(1),
            exit,
            closed,
            session,
            detaching,
        })
    }

    /// Closes the link: the guest sees its host go away and waits for the next one.
    pub fn close(&self) {
        self.session.abort();
    }

    /// Proves `key` (the running kernel's) to an agent whose kernel was started by an
    /// earlier session, and checks the agent's own proof: a guest that cannot prove the key
    /// is not this kernel's (see `cellgate_agent::protocol`'s module doc).
    pub async fn attach(&self, key: &[u8]) -> Result<(), AgentError> {
        let ours = format!("{:032x}", rand::random::<u128>());
        let (theirs, proof) = match self
            .request(Op::Challenge {
                nonce: ours.clone(),
            })
            .await?
        {
            Reply::Challenge { nonce, proof } => (nonce, proof),
            other => return Err(AgentError(format!("unexpected reply {other:?}"))),
        };
        if !protocol::check_attach_guest_mac(key, &ours, &theirs, &proof) {
            return Err(AgentError(
                "the guest did not prove the kernel's key: it is not this kernel's VM".into(),
            ));
        }
        let proof = protocol::attach_host_mac(key, &ours, &theirs);
        match self.request(Op::Attach { proof }).await? {
            Reply::Done => Ok(()),
            other => Err(AgentError(format!("unexpected reply {other:?}"))),
        }
    }

    /// Ends the session, not the kernel: once the agent answered, the link is closed, and
    /// the agent waits for the next host, which must [`Agent::attach`].
    pub async fn detach(&self) -> Result<(), AgentError> {
        self.detaching.store(true, Ordering::SeqCst);
        let answered = self.request(Op::Detach).await;
        self.close();
        match answered? {
            Reply::Done => Ok(()),
            other => Err(AgentError(format!("unexpected reply {other:?}"))),
        }
    }

    /// Sends `op` and waits for its reply.
    pub async fn request(&self, op: Op) -> Result<Reply, AgentError> {
        self.request_within(op, REPLY_TIMEOUT).await
    }

    /// Sends `op` and waits `timeout` for its reply.
    pub async fn request_within(&self, op: Op, timeout: Duration) -> Result<Reply, AgentError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().insert(id, tx);
        // Bounded too: a guest that stops reading its control stream fills the window, and
        // a write would then wait for ever with the lock held.
        let sent = tokio::time::timeout(REPLY_TIMEOUT, async {
            let mut writer = self.control.lock().await;
            write_json(&mut *writer, &Request { id, op }).await
        })
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                self.pending.lock().remove(&id);
                return Err(AgentError(format!("control stream: {error}")));
            }
            Err(_) => {
                self.pending.lock().remove(&id);
                return Err(AgentError(
                    "the guest stopped reading its control stream".into(),
                ));
            }
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Reply::Failed { message })) => Err(AgentError(message)),
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(AgentError("the agent session ended".into())),
            Err(_) => {
                self.pending.lock().remove(&id);
                Err(AgentError("the guest agent did not reply in time".into()))
            }
        }
    }

    /// A new stream to one of the kernel's channels.
    pub async fn open_channel(
        &self,
        channel: Channel,
    ) -> Result<tokio_yamux::StreamHandle, AgentError> {
        self.open_stream(&Open::Channel { channel }).await
    }

    /// A new stream for `what`.
    pub async fn open_stream(&self, what: &Open) -> Result<tokio_yamux::StreamHandle, AgentError> {
        tokio::time::timeout(REPLY_TIMEOUT, async {
            let mut streams = self.streams.lock().await;
            open(&mut streams, what).await
        })
        .await
        .map_err(|_| AgentError("the guest does not take new streams".into()))?
    }

    /// The kernel's exit, once the guest reported it.
    pub fn exit(&self) -> watch::Receiver<Option<Exit>> {
        self.exit.clone()
    }

    /// Why the session ended, once it did.
    pub fn closed(&self) -> watch::Receiver<Option<String>> {
        self.closed.clone()
    }
}

fn handshake_error(error: impl std::fmt::Display) -> AgentError {
    AgentError(format!("handshake: {error}"))
}

/// Writes a handshake line and flushes it.
async fn send_line<W: AsyncRead + AsyncWrite + Unpin>(
    io: &mut BufReader<W>,
    line: &str,
) -> Result<(), AgentError> {
    io.get_mut()
        .write_all(line.as_bytes())
        .await
        .map_err(handshake_error)?;
    io.get_mut().flush().await.map_err(handshake_error)
}

/// The next handshake line; `None` for junk longer than one (dropped).
async fn handshake_line<R: AsyncRead + Unpin>(
    io: &mut BufReader<R>,
) -> Result<Option<String>, AgentError> {
    match read_line(io, 512).await {
        Ok(Some(line)) => Ok(Some(line)),
        Err(protocol::ProtocolError::LineTooLong) => {
            protocol::skip_buffered(io).await.map_err(handshake_error)?;
            Ok(None)
        }
        Ok(None) => Err(handshake_error("the link closed")),
        Err(error) => Err(handshake_error(error)),
    }
}

async fn open(
    streams: &mut tokio_yamux::Control,
    what: &Open,
) -> Result<tokio_yamux::StreamHandle, AgentError> {
    let mut stream = streams
        .open_stream()
        .await
        .map_err(|e| AgentError(format!("opening a stream: {e}")))?;
    write_json(&mut stream, what)
        .await
        .map_err(|e| AgentError(format!("opening a stream: {e}")))?;
    Ok(stream)
}

/// Replies go to their requests; the exit event to the watch. Ends at the first malformed
/// line: a guest that breaks the protocol gets no second chance.
async fn read_control(
    mut reader: BufReader<tokio::io::ReadHalf<tokio_yamux::StreamHandle>>,
    pending: Pending,
    exit: watch::Sender<Option<Exit>>,
    detaching: Arc<std::sync::atomic::AtomicBool>,
) {
    loop {
        match read_json::<GuestMessage, _>(&mut reader).await {
            Ok(Some(GuestMessage::Reply { id, reply })) => {
                if let Some(waiter) = pending.lock().remove(&id) {
                    let _ = waiter.send(reply);
                }
            }
            Ok(Some(GuestMessage::Exited(ended))) => {
                exit.send_replace(Some(ended));
            }
            Ok(None) => break,
            Err(_) if detaching.load(Ordering::SeqCst) => break,
            Err(error) => {
                tracing::warn!(%error, "agent: the guest agent broke the protocol");
                break;
            }
        }
    }
    // Waiters see their sender dropped: "the agent session ended".
    pending.lock().clear();
}

/// A stream the guest opened: egress is joined to the proxy, anything else is closed.
async fn serve_guest_stream(stream: tokio_yamux::StreamHandle, egress: Option<PathBuf>) {
    let mut stream = BufReader::new(stream);
    // A stream that never says what it is would hold its slot for ever.
    let open = tokio::time::timeout(Duration::from_secs(10), read_json::<Open, _>(&mut stream));
    let Ok(Ok(Some(Open::Egress))) = open.await else {
        return;
    };
    let Some(path) = egress else {
        return;
    };
    match tokio::net::UnixStream::connect(&path).await {
        Ok(mut proxy) => {
            let _ = tokio::io::copy_bidirectional(&mut stream, &mut proxy).await;
        }
        Err(error) => tracing::debug!(%error, "agent: egress proxy unreachable"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellgate_agent::protocol::answer_handshake;

    /// A guest whose first `HELLO` is eaten (a restored guest still ending its old session)
    /// and whose pipe holds junk and queued `HELLO`s when it starts answering (it booted
    /// slowly): the session still starts, and yamux on both sides sees only frames.
    #[tokio::test]
    async fn the_handshake_survives_a_lost_hello_junk_and_queued_hellos() {
        let (host, guest) = tokio::io::duplex(1 << 16);
        let guest_side = tokio::spawn(async move {
            let mut guest = BufReader::new(guest);
            // The old session reads the first HELLO as yamux data and leaves junk behind.
            let eaten = read_line(&mut guest, 512).await.unwrap().unwrap();
            assert!(eaten.contains("HELLO"), "{eaten}");
            guest
                .get_mut()
                .write_all(b"\x00\x01\x02junk without a newline")
                .await
                .unwrap();
            // A slow boot: the host says HELLO again meanwhile, more than once.
            tokio::time::sleep(HELLO_AGAIN * 2 + Duration::from_millis(500)).await;
            answer_handshake(&mut guest, false).await.unwrap();
            let mut session = tokio_yamux::Session::new_server(guest, protocol::yamux_config());
            let stream = session.next().await.unwrap().unwrap();
            // The session delivers the stream's bytes: keep polling it.
            tokio::spawn(async move { while session.next().await.is_some() {} });
            let mut stream = BufReader::new(stream);
            read_json::<Open, _>(&mut stream).await.unwrap()
        });
        let agent = Agent::connect(host, None, Duration::from_secs(20))
            .await
            .expect("the session starts");
        assert_eq!(guest_side.await.unwrap(), Some(Open::Control));
        drop(agent);
    }

    /// A guest that never answers is given up on at the deadline, saying what it sent.
    #[tokio::test]
    async fn a_guest_that_never_answers_is_given_up_on() {
        let (host, guest) = tokio::io::duplex(1 << 16);
        let _guest = tokio::spawn(async move {
            let mut guest = BufReader::new(guest);
            guest.get_mut().write_all(b"not the agent\n").await.unwrap();
            // Reads and ignores everything, answering nothing.
            while let Ok(Some(_)) = read_line(&mut guest, 4096).await {}
        });
        let error = Agent::connect(host, None, Duration::from_secs(3))
            .await
            .err()
            .expect("no session");
        assert!(error.to_string().contains("not the agent"), "{error}");
    }
}
