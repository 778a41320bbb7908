//! One agent session: the handshake, the yamux session over the transport, and what each
//! stream the gateway opens is for (the control stream, the kernel's channels, workspace
//! file operations).
//!
//! A session ends; the kernel does not. When the host asks [`Op::Detach`], or the link
//! drops, the agent goes back to waiting for a host, the kernel running on. A session that
//! begins once a kernel was started is unattached until it proves the kernel's key
//! (`cellgate_agent::protocol`'s module doc): until then it may open the control stream only
//! and ask only `challenge` and `attach`, and a wrong proof ends it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cellgate_agent::protocol::{
    self, read_json, write_json, Channel, GuestMessage, Op, Open, ProtocolError, Reply, Request,
};
use futures_util::StreamExt;
use tokio::io::BufReader;

use crate::egress::Opener;
use crate::kernel::{Endpoint, Kernel};
use crate::transport::{Duplex, Stream};

/// How long a channel stream waits for the kernel to bind its socket: ipykernel binds all
/// five within a second or two natively, but an emulated guest is ~50x slower.
const BIND_WAIT: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("yamux: {0}")]
    Yamux(String),
}

/// How long a session that is ending (detached, or refused an attach) waits for the host to
/// close the link, so that its last reply gets out; then the agent closes it itself.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// What the streams of one session share: whether it attached, and how its end is asked.
struct Standing {
    attached: AtomicBool,
    end: tokio::sync::watch::Sender<bool>,
}

/// Serves one session until the host goes away, or it detaches.
pub async fn serve(
    stream: Stream,
    kernel: Arc<Kernel>,
    opener: Arc<Opener>,
    init: bool,
) -> Result<(), SessionError> {
    let mut io = BufReader::new(stream.io);
    protocol::answer_handshake(&mut io, stream.eof_is_idle).await?;
    let (started, _) = kernel.attach_key();
    let standing = Arc::new(Standing {
        attached: AtomicBool::new(stream.proven || !started),
        end: tokio::sync::watch::channel(false).0,
    });
    let mut end = standing.end.subscribe();
    // The BufReader goes into yamux as is: it may already hold the host's first frames.
    let mut session = tokio_yamux::Session::new_server(io, protocol::yamux_config());
    if standing.attached.load(Ordering::SeqCst) {
        opener.set(Some(session.control()));
    }
    let mut ending: Option<tokio::time::Instant> = None;
    let result = loop {
        let grace = async {
            match ending {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            next = session.next() => match next {
                // An ending session opens nothing more.
                Some(Ok(_)) if ending.is_some() => {}
                Some(Ok(stream)) => {
                    tokio::spawn(serve_stream(stream, kernel.clone(), init, standing.clone(), opener.clone(), session.control()));
                }
                Some(Err(error)) => break Err(SessionError::Yamux(error.to_string())),
                None => break Ok(()),
            },
            changed = end.changed(), if ending.is_none() => {
                if changed.is_ok() {
                    // The guest's egress streams close with the session.
                    opener.set(None);
                    ending = Some(tokio::time::Instant::now() + CLOSE_GRACE);
                }
            }
            () = grace => break Ok(()),
        }
    };
    opener.set(None);
    result
}

async fn serve_stream(
    stream: tokio_yamux::StreamHandle,
    kernel: Arc<Kernel>,
    init: bool,
    standing: Arc<Standing>,
    opener: Arc<Opener>,
    control: tokio_yamux::Control,
) {
    let mut stream = BufReader::new(stream);
    let open = match read_json::<Open, _>(&mut stream).await {
        Ok(Some(open)) => open,
        _ => return,
    };
    // An unattached session reaches nothing of the kernel: its stream is dropped (reset).
    if !standing.attached.load(Ordering::SeqCst) && open != Open::Control {
        return;
    }
    let result = match open {
        Open::Control => serve_control(stream, kernel, init, &standing, &opener, control).await,
        Open::Channel { channel } => bridge_channel(stream, &kernel, channel).await,
        // Egress streams are the guest's to open.
        Open::Egress => Ok(()),
        Open::Files { op } => {
            crate::files::serve(stream, kernel.workspace(), op).await;
            Ok(())
        }
    };
    if let Err(error) = result {
        eprintln!("cellgate-agent: stream ended: {error}");
    }
}

/// Requests in, replies and the exit event out.
async fn serve_control(
    stream: BufReader<tokio_yamux::StreamHandle>,
    kernel: Arc<Kernel>,
    init: bool,
    standing: &Standing,
    opener: &Opener,
    control: tokio_yamux::Control,
) -> Result<(), SessionError> {
    let (reader, mut writer) = tokio::io::split(stream);
    let mut reader = BufReader::new(reader);
    let mut exit = kernel.exit_watch();
    let mut exit_sent = false;
    // The nonces of the challenge this stream answered, for the attach that follows it.
    let mut challenge: Option<(String, String)> = None;
    loop {
        let attached = standing.attached.load(Ordering::SeqCst);
        if !exit_sent && attached {
            let ended = exit.borrow_and_update().clone();
            if let Some(ended) = ended {
                write_json(&mut writer, &GuestMessage::Exited(ended)).await?;
                exit_sent = true;
            }
        }
        tokio::select! {
            request = read_json::<Request, _>(&mut reader) => {
                let Some(request) = request? else { return Ok(()) };
                if !attached {
                    let (reply, outcome) = attach_step(&kernel, request.op, &mut challenge);
                    let message = GuestMessage::Reply { id: request.id, reply };
                    write_json(&mut writer, &message).await?;
                    match outcome {
                        Some(true) => {
                            standing.attached.store(true, Ordering::SeqCst);
                            opener.set(Some(control.clone()));
                        }
                        Some(false) => {
                            eprintln!("cellgate-agent: a host did not prove the kernel's key; its session ends");
                            standing.end.send_replace(true);
                            return Ok(());
                        }
                        None => {}
                    }
                    continue;
                }
                let poweroff = matches!(request.op, Op::Poweroff);
                let detach = matches!(request.op, Op::Detach);
                let reply = match request.op {
                    // Seconds to minutes of imports: off the async workers, and the control
                    // stream waits for it (the host sends nothing else meanwhile).
                    Op::Zygote(zygote) => {
                        let kernel = kernel.clone();
                        tokio::task::spawn_blocking(move || kernel.prepare_zygote(&zygote))
                            .await
                            .map_err(|e| crate::kernel::KernelError::Zygote(e.to_string()))
                            .and_then(|r| r)
                            .map_or_else(failed, |pid| Reply::Started { pid })
                    }
                    op => answer(&kernel, op),
                };
                let message = GuestMessage::Reply { id: request.id, reply };
                write_json(&mut writer, &message).await?;
                if poweroff && init {
                    crate::boot::poweroff();
                }
                if detach {
                    standing.end.send_replace(true);
                    return Ok(());
                }
            }
            changed = exit.changed(), if !exit_sent && attached => {
                if changed.is_err() {
                    return Ok(());
                }
            }
        }
    }
}

/// One request of a session that has not attached yet: only a challenge, then an attach,
/// are answered. `Some(true)`: the host proved the key; `Some(false)`: it failed to, and
/// the session ends.
fn attach_step(
    kernel: &Kernel,
    op: Op,
    challenge: &mut Option<(String, String)>,
) -> (Reply, Option<bool>) {
    let refuse = |message: &str| Reply::Failed {
        message: message.to_owned(),
    };
    let (_, key) = kernel.attach_key();
    match op {
        Op::Challenge { nonce } => {
            let Some(key) = key else {
                return (
                    refuse("this kernel has no key: nothing can attach to it"),
                    Some(false),
                );
            };
            if !protocol::is_valid_nonce(&nonce) {
                return (refuse("a malformed nonce"), Some(false));
            }
            let ours = crate::transport::random_nonce();
            let proof = protocol::attach_guest_mac(&key, &nonce, &ours);
            *challenge = Some((nonce, ours.clone()));
            (Reply::Challenge { nonce: ours, proof }, None)
        }
        Op::Attach { proof } => {
            let proven = match (key, challenge.take()) {
                (Some(key), Some((host, guest))) => {
                    protocol::check_attach_host_mac(&key, &host, &guest, &proof)
                }
                _ => false,
            };
            if proven {
                (Reply::Done, Some(true))
            } else {
                (refuse("the kernel's key was not proven"), Some(false))
            }
        }
        _ => (
            refuse("this session must attach to the running kernel first (challenge, attach)"),
            None,
        ),
    }
}

fn failed(error: crate::kernel::KernelError) -> Reply {
    Reply::Failed {
        message: error.to_string(),
    }
}

fn answer(kernel: &Kernel, op: Op) -> Reply {
    match op {
        Op::Start(start) => kernel
            .start(&start)
            .map_or_else(failed, |pid| Reply::Started { pid }),
        Op::Signal { signal } => kernel.signal(signal).map_or_else(failed, |()| Reply::Done),
        Op::Kill => kernel.kill().map_or_else(failed, |()| Reply::Done),
        Op::Usage => Reply::Usage(kernel.usage()),
        Op::Restored { seed, unix_time_ns } => {
            crate::kernel::restored(&seed, unix_time_ns).map_or_else(failed, |()| Reply::Done)
        }
        Op::Zygote(_) => Reply::Failed {
            message: "a zygote is prepared on the control stream only".to_owned(),
        },
        Op::Poweroff | Op::Detach => Reply::Done,
        Op::Challenge { .. } | Op::Attach { .. } => Reply::Failed {
            message: "this session is attached already".to_owned(),
        },
    }
}

/// Joins a channel stream to the kernel's socket of that channel, waiting for the kernel to
/// bind it. Bytes only: the ZMTP session is between the gateway and ipykernel.
async fn bridge_channel(
    mut stream: BufReader<tokio_yamux::StreamHandle>,
    kernel: &Kernel,
    channel: Channel,
) -> Result<(), SessionError> {
    let deadline = tokio::time::Instant::now() + BIND_WAIT;
    loop {
        if let Some(endpoint) = kernel.endpoint(channel) {
            if let Ok(mut socket) = connect(&endpoint).await {
                tokio::io::copy_bidirectional(&mut stream, &mut socket).await?;
                return Ok(());
            }
            if !kernel.running() {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn connect(endpoint: &Endpoint) -> std::io::Result<Box<dyn Duplex>> {
    Ok(match endpoint {
        Endpoint::Ipc(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
        Endpoint::Tcp(address) => Box::new(tokio::net::TcpStream::connect(address.as_str()).await?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellgate_agent::protocol::{begin, hello, parse_go, parse_ready, read_line};
    use tokio::io::AsyncWriteExt;

    const KEY: &[u8] = b"the kernel's key, 32 bytes long!";
    const HOST_NONCE: &str = "0123456789abcdef0123456789abcdef";

    /// A host's side of one session with `kernel`'s agent over an in-memory pipe: the
    /// handshake, then yamux; the agent's session task too.
    async fn connect(
        kernel: Arc<Kernel>,
    ) -> (
        tokio_yamux::Control,
        tokio::task::JoinHandle<Result<(), SessionError>>,
    ) {
        let (host, guest) = tokio::io::duplex(1 << 16);
        let stream = Stream {
            io: Box::new(guest),
            eof_is_idle: false,
            proven: false,
        };
        let agent = tokio::spawn(serve(stream, kernel, Arc::new(Opener::default()), false));
        let mut io = BufReader::new(host);
        io.get_mut()
            .write_all(hello(HOST_NONCE).as_bytes())
            .await
            .unwrap();
        let line = read_line(&mut io, 512).await.unwrap().unwrap();
        assert_eq!(parse_ready(&line), Some(HOST_NONCE));
        io.get_mut()
            .write_all(begin(HOST_NONCE).as_bytes())
            .await
            .unwrap();
        let line = read_line(&mut io, 512).await.unwrap().unwrap();
        assert_eq!(parse_go(&line), Some(HOST_NONCE));
        let mut session = tokio_yamux::Session::new_client(io, protocol::yamux_config());
        let control = session.control();
        tokio::spawn(async move { while session.next().await.is_some() {} });
        (control, agent)
    }

    /// A control stream: a request, its reply.
    struct ControlStream(BufReader<tokio_yamux::StreamHandle>, u64);

    impl ControlStream {
        async fn open(control: &mut tokio_yamux::Control) -> ControlStream {
            let mut stream = BufReader::new(control.open_stream().await.unwrap());
            write_json(stream.get_mut(), &Open::Control).await.unwrap();
            ControlStream(stream, 0)
        }

        /// The reply to `op`; `None` when the stream ended instead.
        async fn ask(&mut self, op: Op) -> Option<Reply> {
            self.1 += 1;
            let request = Request { id: self.1, op };
            write_json(self.0.get_mut(), &request).await.ok()?;
            match read_json::<GuestMessage, _>(&mut self.0).await.ok()?? {
                GuestMessage::Reply { id, reply } if id == self.1 => Some(reply),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_new_session_attaches_only_with_the_kernels_key() {
        let kernel = Arc::new(Kernel::new(false));
        // The first session (nothing started yet) is attached, and detaches.
        let (mut control, agent) = connect(kernel.clone()).await;
        let mut stream = ControlStream::open(&mut control).await;
        assert!(matches!(stream.ask(Op::Usage).await, Some(Reply::Usage(_))));
        kernel.pretend_started(KEY);
        assert_eq!(stream.ask(Op::Detach).await, Some(Reply::Done));
        // The agent ends the session itself (within its grace) even if the host does not.
        agent.await.unwrap().unwrap();

        // A later session: nothing before it attaches.
        let (mut control, agent) = connect(kernel.clone()).await;
        let mut stream = ControlStream::open(&mut control).await;
        assert!(
            matches!(stream.ask(Op::Usage).await, Some(Reply::Failed { message }) if message.contains("attach"))
        );
        let mut files = BufReader::new(control.open_stream().await.unwrap());
        let op = Open::Files {
            op: protocol::FileOp::Stat { path: ".".into() },
        };
        let _ = write_json(files.get_mut(), &op).await;
        assert!(
            read_json::<serde_json::Value, _>(&mut files)
                .await
                .map_or(true, |line| line.is_none()),
            "an unattached session's file stream is closed unanswered"
        );
        // A proof with another key is refused, and ends the session.
        let Some(Reply::Challenge { nonce, proof }) = stream
            .ask(Op::Challenge {
                nonce: HOST_NONCE.into(),
            })
            .await
        else {
            panic!("no challenge")
        };
        assert!(protocol::check_attach_guest_mac(
            KEY, HOST_NONCE, &nonce, &proof
        ));
        let wrong =
            protocol::attach_host_mac(b"another key entirely, 32 bytes!!", HOST_NONCE, &nonce);
        assert!(matches!(
            stream.ask(Op::Attach { proof: wrong }).await,
            Some(Reply::Failed { .. })
        ));
        assert_eq!(stream.ask(Op::Usage).await, None, "the session ended");
        drop(control);
        agent.await.unwrap().unwrap();

        // The key's holder attaches, and may do everything.
        let (mut control, _agent) = connect(kernel.clone()).await;
        let mut stream = ControlStream::open(&mut control).await;
        let Some(Reply::Challenge { nonce, .. }) = stream
            .ask(Op::Challenge {
                nonce: HOST_NONCE.into(),
            })
            .await
        else {
            panic!("no challenge")
        };
        let proof = protocol::attach_host_mac(KEY, HOST_NONCE, &nonce);
        assert_eq!(stream.ask(Op::Attach { proof }).await, Some(Reply::Done));
        assert!(matches!(stream.ask(Op::Usage).await, Some(Reply::Usage(_))));
    }

    #[tokio::test]
    async fn an_attach_without_its_challenge_is_refused() {
        let kernel = Arc::new(Kernel::new(false));
        kernel.pretend_started(KEY);
        let (mut control, _agent) = connect(kernel).await;
        let mut stream = ControlStream::open(&mut control).await;
        // A proof made for nonces the guest never gave (a replay) is no proof.
        let proof = protocol::attach_host_mac(KEY, HOST_NONCE, "ffffffffffffffff");
        assert!(matches!(
            stream.ask(Op::Attach { proof }).await,
            Some(Reply::Failed { .. })
        ));
    }
}
