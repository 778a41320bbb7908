//! The kernel channels WebSocket, `/api/kernels/{id}/channels?session_id=…`.
//!
//! Both framings are served (legacy JSON by default, v1 when the client offers its
//! subprotocol, which is then echoed). Each socket attaches to the kernel's router: iopub from
//! every requester, replies and `input_request`s for its own requests, and, when its
//! `session_id` had no socket for a while, the output buffered meanwhile. Several sockets may
//! share a `session_id`; none is evicted for it.
//!
//! The `Origin` is checked at the handshake. A reader loop decodes client frames and queues
//! them for a forwarder task that sends them to the kernel in order (a send waits while the
//! kernel restarts, or is restored from hibernation, for minutes under emulation; the reader
//! keeps reading meanwhile, so the client's pings are answered and its close is seen: a
//! reader waiting on the kernel left jupyter_server's pings unanswered and it dropped the
//! socket after 90 s); a writer task encodes kernel messages for this client (as raw frames:
//! a large message in fragments, see `ws_upgrade`; queued frames batched per flush) and
//! pings it every 30 s. A client that cannot keep up is disconnected past 256 MiB queued,
//! and its session buffers like any other. A frame that cannot be decoded closes this
//! socket with 1007 and the reason; the kernel and every other socket carry on.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Extension, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, Stream, StreamExt};
use serde::Deserialize;
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{CloseCode, Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::Frame as WsFrame;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::Error as WsError;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use super::auth::Principal;
use super::kernels::is_kernel_id;
use super::state::AppState;
use super::ws_upgrade::{KernelSocket, WsUpgrade};
use crate::kernel::{client_queue, ClientId, Inbox, Kernel};
use crate::protocol::websocket::{self, Framing, V1_SUBPROTOCOL};
use crate::protocol::{Channel, Message};

/// How often idle sockets are pinged (Kernel Gateway uses 30 s).
const PING_INTERVAL: Duration = Duration::from_secs(30);
/// Client messages read but not yet sent to the kernel (while it restarts): past this, the
/// reader waits for the forwarder, as it waited for the kernel before.
const TO_KERNEL_QUEUE: usize = 256;
/// Bytes of a socket's client frames held before the kernel takes them, in messages of the
/// largest size allowed: past it, the reader waits for the forwarder (and, before the
/// kernel was ever ready, the socket is closed with 1008). One message in flight was the
/// bound when the reader waited on the kernel itself.
const HELD_MESSAGES_OF_MAX_SIZE: usize = 2;
/// Messages encoded per flush when output is queued.
const WRITE_BATCH: usize = 64;
/// Messages larger than this go out as fragments of this size, cut from the kernel's bytes:
/// the client starts reading while the rest is still being written, and the socket's write
/// buffer stays small (one whole frame meant copies and fresh pages before its first byte).
const FRAGMENT_BYTES: usize = 64 << 10;
/// Replies remembered per socket for re-delivery after an abrupt disconnect.
const RECENT_REPLIES: usize = 16;

/// What a socket's writer hands back when it stops.
struct WriterEnd {
    inbox: Inbox,
    unsent: Vec<Arc<Message>>,
    recent_replies: VecDeque<Arc<Message>>,
}

#[derive(Deserialize)]
pub struct ChannelsQuery {
    session_id: Option<String>,
}

/// Whether a browser page from `Origin` may open the socket: no Origin (GatewayClient, CLI
/// clients), a configured allowed origin (`*` allows all), or the gateway's own origin (as
/// named by `Host`: without a token, `edge.rs` has already refused any Host but a loopback
/// name, so a rebound name never reaches this comparison).
pub(super) fn origin_allowed(headers: &HeaderMap, allow_origin: &[String]) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()) else {
        return true;
    };
    if super::edge::listed(allow_origin, origin) {
        return true;
    }
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let origin_host = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    origin_host.is_some() && origin_host == host
}

/// Whether the socket comes from jupyter_server's GatewayClient (JupyterLab with
/// `--gateway-url`): a Tornado client without an Origin. It relays our frames to the browser
/// as text and cannot take binary ones.
fn is_gateway_client_relay(headers: &HeaderMap) -> bool {
    let tornado = headers
        .get(header::USER_AGENT)
        .and_then(|ua| ua.to_str().ok())
        .is_some_and(|ua| ua.starts_with("Tornado/"));
    tornado && !headers.contains_key(header::ORIGIN)
}

pub async fn channels(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    Query(query): Query<ChannelsQuery>,
    headers: HeaderMap,
    upgrade: WsUpgrade,
) -> Response {
    if !origin_allowed(&headers, &state.config.allow_origin) {
        return (StatusCode::FORBIDDEN, "Cross origin websockets not allowed").into_response();
    }
    // Another tenant's kernel is answered exactly as a missing one.
    let kernel = match is_kernel_id(&id).then(|| state.kernels.get(&id)).flatten() {
        Some(kernel) if principal.may_see(kernel.owner()) => kernel,
        _ => return StatusCode::NOT_FOUND.into_response(),
    };
    let session = query
        .session_id
        .filter(|s| !s.is_empty() && s.len() <= 256)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let upgrade = upgrade.protocols(&[V1_SUBPROTOCOL]);
    let config = WebSocketConfig::default()
        .max_message_size(Some(state.config.max_message_bytes))
        .max_frame_size(Some(state.config.max_message_bytes))
        // Read buffers are allocated per socket; most client frames are small, so keep idle
        // connections cheap (tungstenite's default is 128 KiB).
        .read_buffer_size(8 << 10)
        .write_buffer_size(8 << 10);
    let framing = if upgrade.selected_protocol().is_some() {
        Framing::V1
    } else if is_gateway_client_relay(&headers) {
        // jupyter_server's GatewayClient dies on binary frames (gateway-contract.md 1.12.6).
        Framing::LegacyTextOnly
    } else {
        Framing::Legacy
    };
    upgrade.on_upgrade(config, move |socket| {
        serve_socket(
            socket,
            kernel,
            session,
            framing,
            held_budget(state.config.max_message_bytes),
        )
    })
}

/// The frames of one kernel message for this client: one frame, or fragments of
/// [`FRAGMENT_BYTES`] for a large message. A raw frame needs no `Utf8Bytes`, so text that
/// [`websocket::encode`] already checked is not checked again.
fn encode(message: &Message, framing: Framing) -> Vec<WsFrame> {
    let encoded = match websocket::encode(message, framing) {
        Ok(encoded) => encoded,
        Err(err) => {
            tracing::warn!(%err, msg_type = message.msg_type(), "kernel message not valid JSON; not sent to a legacy client");
            return Vec::new();
        }
    };
    let data = if encoded.binary {
        Data::Binary
    } else {
        Data::Text
    };
    if encoded.len() <= FRAGMENT_BYTES {
        return vec![WsFrame::message(encoded.to_vec(), OpCode::Data(data), true)];
    }
    let fragments = encoded.fragments(FRAGMENT_BYTES);
    let last = fragments.len() - 1;
    fragments
        .into_iter()
        .enumerate()
        .map(|(i, payload)| {
            let opcode = if i == 0 { data } else { Data::Continue };
            WsFrame::message(payload, OpCode::Data(opcode), i == last)
        })
        .collect()
}

fn close_frame(code: u16, reason: impl Into<String>) -> WsMessage {
    WsMessage::Close(Some(CloseFrame {
        code: CloseCode::from(code),
        reason: reason.into().into(),
    }))
}

fn decode(
    frame: &WsMessage,
    framing: Framing,
) -> Option<Result<Message, crate::protocol::ProtocolError>> {
    // Matched on the framing first, with no wildcard, so a new framing cannot silently
    // drop client frames.
    match framing {
        // A v1 client that sends a JSON text frame means a legacy message.
        Framing::Legacy | Framing::LegacyTextOnly | Framing::V1
            if matches!(frame, WsMessage::Text(_)) =>
        {
            let text = frame.to_text().ok()?;
            Some(websocket::decode_legacy_text(text))
        }
        Framing::Legacy | Framing::LegacyTextOnly => match frame {
            WsMessage::Binary(bytes) => Some(websocket::decode_legacy_binary(bytes)),
            _ => None,
        },
        Framing::V1 => match frame {
            WsMessage::Binary(bytes) => Some(websocket::decode_v1(bytes)),
            _ => None,
        },
    }
}

/// The socket's half that carries frames to the client.
type FrameSink = futures_util::stream::SplitSink<KernelSocket, WsMessage>;

/// A close code and reason the reader wants the writer to send.
type CloseRequest = (u16, String);

/// The byte budget of a socket's held frames (see [`HELD_MESSAGES_OF_MAX_SIZE`]), as
/// semaphore permits (at most `u32::MAX`).
fn held_budget(max_message_bytes: usize) -> u32 {
    u32::try_from(max_message_bytes.saturating_mul(HELD_MESSAGES_OF_MAX_SIZE)).unwrap_or(u32::MAX)
}

/// What a frame counts against the held-bytes budget (never more than the whole budget, or
/// it would wait for ever).
fn held_cost(frame: &WsMessage, budget: u32) -> u32 {
    u32::try_from(frame.len())
        .unwrap_or(u32::MAX)
        .clamp(1, budget.max(1))
}

async fn serve_socket(
    socket: KernelSocket,
    kernel: Arc<Kernel>,
    session: String,
    framing: Framing,
    budget: u32,
) {
    let _open = crate::telemetry::metrics::metrics().websocket_opened();
    let (mut sink, mut stream) = socket.split();
    // Frames are read while the kernel starts (minutes for an emulated VM or a pod whose
    // image is pulled), so that pings are answered (tungstenite answers them as it reads);
    // the messages they carry are handled once it is ready.
    let (mut early, mut early_bytes) = (Vec::new(), 0u64);
    // The client went before the kernel was ready (`Some(graceful)`): what it sent is still
    // delivered once the kernel is, as when the reader waited for the kernel first.
    let mut gone: Option<bool> = None;
    let ready = {
        let ready = kernel.wait_ready();
        tokio::pin!(ready);
        loop {
            tokio::select! {
                // Ready first: a frame waiting beside a ready kernel is read by the reader.
                biased;
                ready = &mut ready => break ready,
                frame = stream.next(), if gone.is_none() => match frame {
                    Some(Ok(WsMessage::Close(_))) => gone = Some(true),
                    None => gone = Some(false),
                    Some(Err(err)) => {
                        tracing::info!(kernel_id = %kernel.id, session_id = %session, %err, "client socket error while the kernel started");
                        gone = Some(false);
                    }
                    Some(Ok(frame @ (WsMessage::Text(_) | WsMessage::Binary(_)))) => {
                        early_bytes += u64::from(held_cost(&frame, budget));
                        if early.len() >= TO_KERNEL_QUEUE || early_bytes > u64::from(budget) {
                            let _ = sink
                                .send(close_frame(1008, "too much sent before the kernel was ready"))
                                .await;
                            return;
                        }
                        early.push(frame);
                    }
                    Some(Ok(_)) => {}
                },
            }
        }
    };
    if let Err(err) = ready {
        let reason = format!("kernel unavailable: {err}");
        let _ = sink
            .send(close_frame(
                1011,
                reason.chars().take(120).collect::<String>(),
            ))
            .await;
        return;
    }
    // The early frames, then the socket's (none once the client is gone; a close frame
    // if it closed).
    let stream = futures_util::stream::iter(early.into_iter().map(Ok))
        .chain(stream.take(if gone.is_some() { 0 } else { usize::MAX }))
        .chain(futures_util::stream::iter(
            (gone == Some(true)).then_some(Ok(WsMessage::Close(None))),
        ));
    let (outbox, inbox) = client_queue();
    let (client, replayed) = kernel.router().attach(&session, outbox);
    tracing::info!(kernel_id = %kernel.id, session_id = %session, ?framing, replayed, "client connected");
    let (close_tx, close_rx) = oneshot::channel::<CloseRequest>();
    let writer = tokio::spawn(write_frames(sink, inbox, framing, close_rx));
    // The reader drops `close_tx` when it ends: that ends the writer (after a close frame
    // it was asked to send), which hands back what it did not deliver; the router keeps
    // that for the session's next socket.
    let (graceful, forwarder) =
        read_frames(stream, &kernel, client, &session, framing, close_tx, budget).await;
    // What the client sent before it went is still delivered, as when the reader sent each
    // message itself before reading the next frame; before the detach, so that the requests
    // are this socket's when their replies come (a JupyterLab reconnecting with the same
    // session_id gets them: clients::same_session_reconnect_race_loses_no_reply). While
    // the kernel restarts that keeps a gone socket attached, as the reader waiting on the
    // kernel did before.
    let _ = forwarder.await;
    match tokio::time::timeout(Duration::from_secs(2), writer).await {
        Ok(Ok(end)) => {
            let mut leftovers = if graceful {
                Vec::new()
            } else {
                end.recent_replies.into_iter().collect()
            };
            leftovers.extend(end.unsent);
            kernel.router().detach_with(client, end.inbox, leftovers);
        }
        _ => kernel.router().detach(client),
    }
    tracing::info!(kernel_id = %kernel.id, session_id = %session, "client disconnected");
}

/// The writer task: encodes the router's messages for this client, pings it, and sends the
/// close frame the reader asks for.
async fn write_frames(
    mut sink: FrameSink,
    mut inbox: Inbox,
    framing: Framing,
    mut close_rx: oneshot::Receiver<CloseRequest>,
) -> WriterEnd {
    let mut ping = tokio::time::interval(PING_INTERVAL);
    ping.tick().await;
    // Replies written most recently: on an abrupt disconnect they may never have reached
    // the client, so they go back to the router (a rare duplicate beats a lost reply).
    let mut recent_replies: VecDeque<Arc<Message>> = VecDeque::with_capacity(RECENT_REPLIES);
    let end = |inbox, unsent, recent_replies| WriterEnd {
        inbox,
        unsent,
        recent_replies,
    };
    loop {
        tokio::select! {
            message = inbox.recv() => {
                let Some(message) = message else {
                    // The router let go of us: too slow, or the kernel was shut down.
                    let frame = if inbox.evicted() {
                        close_frame(1008, "client too slow: its output queue passed the limit")
                    } else {
                        close_frame(1001, "kernel shut down")
                    };
                    let _ = sink.send(frame).await;
                    return end(inbox, Vec::new(), recent_replies);
                };
                let written =
                    write_batch(&mut sink, message, &mut inbox, framing, &mut recent_replies).await;
                if let Err(unsent) = written {
                    return end(inbox, unsent, recent_replies);
                }
            }
            _ = ping.tick() => {
                if sink.send(WsMessage::Ping(Default::default())).await.is_err() {
                    return end(inbox, Vec::new(), recent_replies);
                }
            }
            close = &mut close_rx => {
                if let Ok((code, reason)) = close {
                    let _ = sink.send(close_frame(code, reason)).await;
                }
                return end(inbox, Vec::new(), recent_replies);
            }
        }
    }
}

/// Writes `first` and what else is queued (up to [`WRITE_BATCH`]) with one flush; replies
/// written join `recent_replies`. On a failed write, the messages not written.
async fn write_batch(
    sink: &mut FrameSink,
    first: Arc<Message>,
    inbox: &mut Inbox,
    framing: Framing,
    recent_replies: &mut VecDeque<Arc<Message>>,
) -> Result<(), Vec<Arc<Message>>> {
    let mut batch = vec![first];
    while batch.len() < WRITE_BATCH {
        match inbox.try_recv() {
            Some(more) => batch.push(more),
            None => break,
        }
    }
    for (i, message) in batch.iter().enumerate() {
        for frame in encode(message, framing) {
            if sink.feed(WsMessage::Frame(frame)).await.is_err() {
                return Err(batch[i..].to_vec());
            }
        }
        if message.channel != Channel::Iopub {
            if recent_replies.len() == RECENT_REPLIES {
                recent_replies.pop_front();
            }
            recent_replies.push_back(message.clone());
        }
    }
    if sink.flush().await.is_err() {
        return Err(Vec::new());
    }
    Ok(())
}

/// The reader: decodes the client's frames and sends their messages to the kernel until
/// the socket ends. Whether it ended gracefully: a client that closes with a close frame
/// read everything it wanted; one that vanishes may have missed what was last written to it.
/// Also the forwarder task, which the caller awaits before it detaches the socket.
async fn read_frames(
    stream: impl Stream<Item = Result<WsMessage, WsError>> + Unpin,
    kernel: &Arc<Kernel>,
    client: ClientId,
    session: &str,
    framing: Framing,
    close_tx: oneshot::Sender<CloseRequest>,
    budget: u32,
) -> (bool, tokio::task::JoinHandle<()>) {
    let (to_kernel, queued) = tokio::sync::mpsc::channel(TO_KERNEL_QUEUE);
    let forwarder = tokio::spawn(forward(kernel.clone(), client, session.to_owned(), queued));
    let held = Held {
        to_kernel,
        budget: Arc::new(tokio::sync::Semaphore::new(budget as usize)),
        size: budget,
    };
    let graceful = read_into(stream, kernel, session, framing, close_tx, held).await;
    (graceful, forwarder)
}

/// The way from the reader to the forwarder: messages with the permits of their bytes.
struct Held {
    to_kernel: tokio::sync::mpsc::Sender<(Message, tokio::sync::OwnedSemaphorePermit)>,
    budget: Arc<tokio::sync::Semaphore>,
    size: u32,
}

/// Sends the client's messages to the kernel, one after the other, each once the kernel is
/// ready for it; a message's bytes count against the budget until it is sent.
async fn forward(
    kernel: Arc<Kernel>,
    client: ClientId,
    session: String,
    mut queued: tokio::sync::mpsc::Receiver<(Message, tokio::sync::OwnedSemaphorePermit)>,
) {
    while let Some((message, _held)) = queued.recv().await {
        let msg_id = message.msg_id().to_owned();
        if let Err(err) = kernel.send(client, &session, message).await {
            tracing::warn!(kernel_id = %kernel.id, session_id = %session, %msg_id, %err, "could not send a client message to the kernel");
        }
    }
}

/// The reader's loop: frames decoded into `to_kernel` until the socket ends.
async fn read_into(
    mut stream: impl Stream<Item = Result<WsMessage, WsError>> + Unpin,
    kernel: &Kernel,
    session: &str,
    framing: Framing,
    close_tx: oneshot::Sender<CloseRequest>,
    held: Held,
) -> bool {
    while let Some(frame) = stream.next().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(err) => {
                tracing::info!(kernel_id = %kernel.id, session_id = %session, %err, "client socket error");
                let reason: String = err.to_string().chars().take(120).collect();
                let code = if reason.contains("too long") || reason.contains("too big") {
                    1009
                } else {
                    1002
                };
                let _ = close_tx.send((code, reason));
                return false;
            }
        };
        if matches!(frame, WsMessage::Close(_)) {
            return true;
        }
        let Some(decoded) = decode(&frame, framing) else {
            continue;
        };
        match decoded {
            Ok(message) => {
                let cost = held_cost(&frame, held.size);
                drop(frame);
                let Ok(permit) = held.budget.clone().acquire_many_owned(cost).await else {
                    return false;
                };
                if held.to_kernel.send((message, permit)).await.is_err() {
                    return false;
                }
            }
            Err(err) => {
                tracing::warn!(kernel_id = %kernel.id, session_id = %session, %err, "invalid message from client; closing its socket");
                let reason: String = format!("invalid message: {err}")
                    .chars()
                    .take(120)
                    .collect();
                let _ = close_tx.send((1007, reason));
                return false;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn origins() {
        let mut headers = HeaderMap::new();
        assert!(origin_allowed(&headers, &[]));
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8888"));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8888"),
        );
        assert!(origin_allowed(&headers, &[]));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        assert!(!origin_allowed(&headers, &[]));
        assert!(origin_allowed(&headers, &["*".to_owned()]));
        assert!(origin_allowed(
            &headers,
            &["http://evil.example".to_owned()]
        ));
        assert!(!origin_allowed(
            &headers,
            &["http://other.example".to_owned()]
        ));
    }
}
