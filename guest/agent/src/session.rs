//! One agent session: the handshake, the yamux session over the transport, and what each
//! stream the gateway opens is for (the control stream, the kernel's channels, workspace
//! file operations).

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

/// Serves one session until the host goes away.
pub async fn serve(
    stream: Stream,
    kernel: Arc<Kernel>,
    opener: Arc<Opener>,
    init: bool,
) -> Result<(), SessionError> {
    let mut io = BufReader::new(stream.io);
    protocol::answer_handshake(&mut io, stream.eof_is_idle).await?;
    // The BufReader goes into yamux as is: it may already hold the host's first frames.
    let mut session = tokio_yamux::Session::new_server(io, protocol::yamux_config());
    opener.set(Some(session.control()));
    let result = loop {
        match session.next().await {
            Some(Ok(stream)) => {
                tokio::spawn(serve_stream(stream, kernel.clone(), init));
            }
            Some(Err(error)) => break Err(SessionError::Yamux(error.to_string())),
            None => break Ok(()),
        }
    };
    opener.set(None);
    result
}

async fn serve_stream(stream: tokio_yamux::StreamHandle, kernel: Arc<Kernel>, init: bool) {
    let mut stream = BufReader::new(stream);
    let open = match read_json::<Open, _>(&mut stream).await {
        Ok(Some(open)) => open,
        _ => return,
    };
    let result = match open {
        Open::Control => serve_control(stream, kernel, init).await,
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
) -> Result<(), SessionError> {
    let (reader, mut writer) = tokio::io::split(stream);
    let mut reader = BufReader::new(reader);
    let mut exit = kernel.exit_watch();
    let mut exit_sent = false;
    loop {
        if !exit_sent {
            let ended = exit.borrow_and_update().clone();
            if let Some(ended) = ended {
                write_json(&mut writer, &GuestMessage::Exited(ended)).await?;
                exit_sent = true;
            }
        }
        tokio::select! {
            request = read_json::<Request, _>(&mut reader) => {
                let Some(request) = request? else { return Ok(()) };
                let poweroff = matches!(request.op, Op::Poweroff);
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
            }
            changed = exit.changed(), if !exit_sent => {
                if changed.is_err() {
                    return Ok(());
                }
            }
        }
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
        Op::Poweroff => Reply::Done,
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
