//! `GET /v1/sessions/{id}/ws`: the session's events as JSON text frames (the same
//! [`SessionEvent`]s as SSE, for every execution of the session, whoever started it), and
//! client messages:
//!
//! - `{"type": "execute", "code": "…", "timeout_s"?: 30}`
//! - `{"type": "interrupt"}`
//! - `{"type": "input_reply", "value": "…", "execution_id"?: "…"}`
//! - `{"type": "restart"}`
//!
//! On connect the server sends `{"type": "session", "session": <SessionModel>,
//! "last_event_id": n}` (the newest event id of the session so far). Every event carries its
//! `id` in the session; a client that reconnects with `?last_event_id=N` is first sent the
//! events after `N` that the session's replay buffer still holds, preceded by
//! `{"type": "gap", "first_id", "last_id"}` when some are no longer held, then the live ones,
//! each once. When the session ends (deleted, or its kernel shut down) the last event is
//! `{"type": "kernel", "state": "terminated"}` and the server closes the socket. A client
//! message that cannot be understood or fails answers `{"type": "client_error", "message"}`
//! and the socket stays open. A client too slow for the event rate catches up from the
//! replay buffer; what that no longer holds is told as a `gap` and, for clients older than
//! ids, `{"type": "lagged", "missed": n}`, then the events after it.

use std::sync::Arc;
use std::time::Duration;

use super::ApiError;
use crate::gateway::ErrorCode;
use axum::extract::rejection::QueryRejection;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;
use utoipa::ToSchema;

use super::live_session_for;
use crate::gateway::auth::Principal;
use crate::gateway::kernel_ws::origin_allowed;
use crate::gateway::state::AppState;
use crate::sessions::{Catchup, KernelPhase, Numbered, Session, SessionEvent};

const PING_INTERVAL: Duration = Duration::from_secs(30);
/// Largest client message (code included).
const MAX_CLIENT_MESSAGE: usize = 16 << 20;

/// A message from the client.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientMessage {
    Execute {
        code: String,
        #[serde(default)]
        timeout_s: Option<f64>,
    },
    Interrupt,
    InputReply {
        value: String,
        #[serde(default)]
        execution_id: Option<String>,
    },
    Restart,
}

/// The WebSocket's query (besides a browser's `token`).
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SocketQuery {
    /// Resume: first send the events after this id that the gateway still holds (a `gap`
    /// event names those it does not), then the live ones.
    #[serde(default)]
    pub last_event_id: Option<String>,
}

/// The session's event stream and controls (WebSocket upgrade).
#[utoipa::path(get, path = "/v1/sessions/{id}/ws", tag = "sessions", operation_id = "open_websocket",
    params(("id" = String, Path), SocketQuery),
    responses(
        (status = 101, description = "WebSocket: server frames are NumberedEvent JSON (a SessionEvent with its `id`), and a Gap before events resumed past what the gateway still holds; client frames are ClientMessage JSON"),
        (status = 400, description = "not a WebSocket handshake, or a `last_event_id` that is not a number"),
        (status = 403, description = "a page from an origin the gateway does not allow"),
        (status = 404, description = "no such session"),
        (status = 426, description = "the connection cannot be upgraded")))]
pub async fn socket(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<SocketQuery>, QueryRejection>,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let upgrade = match upgrade {
        Ok(upgrade) => upgrade,
        Err(rejection) => {
            return ApiError::new(rejection.status(), rejection.body_text())
                .code(ErrorCode::NotAWebsocket)
                .into_response()
        }
    };
    if !origin_allowed(&headers, &state.config.allow_origin) {
        return ApiError::new(StatusCode::FORBIDDEN, "Cross origin websockets not allowed")
            .code(ErrorCode::CrossOrigin)
            .into_response();
    }
    let query = match query {
        Ok(Query(query)) => query,
        Err(err) => return ApiError::bad_request(err.body_text()).into_response(),
    };
    let resume = match query.last_event_id.as_deref().map(str::parse::<u64>) {
        None => None,
        Some(Ok(after)) => Some(after),
        Some(Err(_)) => {
            return ApiError::bad_request("last_event_id must be an event id (a whole number)")
                .into_response()
        }
    };
    // Checked when the socket opens, and again for each execution sent over it.
    if let Err(err) = super::usage::check_quota(&state, &principal).await {
        return err.into_response();
    }
    let session = match live_session_for(&state, &principal, &id).await {
        Ok(session) => session,
        Err(err) => return err.into_response(),
    };
    upgrade
        .max_message_size(MAX_CLIENT_MESSAGE)
        .on_upgrade(move |socket| serve(socket, session, resume, (state, principal)))
}

type Sink = SplitSink<WebSocket, WsMessage>;

/// Whether the socket goes on after a frame.
#[derive(PartialEq)]
enum Flow {
    Open,
    Closed,
}

/// Sends one event; after `terminated` (the session is gone) closes the socket.
async fn send_event(sink: &mut Sink, event: &Numbered) -> Flow {
    let Ok(text) = serde_json::to_string(event) else {
        return Flow::Open;
    };
    let terminated = matches!(
        &*event.event,
        SessionEvent::Kernel {
            state: KernelPhase::Terminated,
            ..
        }
    );
    if sink.send(WsMessage::Text(text.into())).await.is_err() {
        return Flow::Closed;
    }
    if terminated {
        let _ = sink.send(WsMessage::Close(None)).await;
        return Flow::Closed;
    }
    Flow::Open
}

/// Sends what a catch-up holds: its gap first (with the older `lagged` frame when `lagged`),
/// then its events after `last`, which moves on to the newest sent.
async fn send_catchup(sink: &mut Sink, catchup: Catchup, last: &mut u64, lagged: bool) -> Flow {
    if let Some(gap) = catchup.gap {
        let mut frames = vec![serde_json::to_string(&gap).unwrap_or_default()];
        if lagged {
            frames.push(json!({"type": "lagged", "missed": gap.missed()}).to_string());
        }
        for frame in frames {
            if sink.send(WsMessage::Text(frame.into())).await.is_err() {
                return Flow::Closed;
            }
        }
        *last = (*last).max(gap.last_id);
    }
    for event in &catchup.events {
        if event.id <= *last {
            continue;
        }
        *last = event.id;
        if send_event(sink, event).await == Flow::Closed {
            return Flow::Closed;
        }
    }
    Flow::Open
}

/// Who is on the socket, for the quota check of each execution it sends.
type Caller = (AppState, Principal);

async fn serve(socket: WebSocket, session: Arc<Session>, resume: Option<u64>, caller: Caller) {
    // Subscribed before the catch-up is read: the two meet with nothing lost, and what both
    // hold is sent once (by id).
    let (mut events, newest) = session.subscribe_after_newest();
    let catchup = resume.map(|after| (after, session.catch_up(after)));
    let weak = Arc::downgrade(&session);
    let (mut sink, mut stream) = socket.split();
    let hello =
        json!({"type": "session", "session": session.model(), "last_event_id": newest}).to_string();
    if sink.send(WsMessage::Text(hello.into())).await.is_err() {
        return;
    }
    let (reply_tx, mut reply_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        // The newest id sent: a fresh client is sent the events after the hello's
        // `last_event_id` (those before it are a resume's).
        let mut last = newest;
        if let Some((after, catchup)) = catchup {
            // An id ahead of the session's (ids began again in a session another replica
            // took over; after a restart they go on instead) must not hide the events to
            // come: the hello says where it is. Its `newest`, not the catch-up's: events
            // published between the two are in the subscription, not in the catch-up.
            last = after.min(newest);
            if send_catchup(&mut sink, catchup, &mut last, false).await == Flow::Closed {
                return;
            }
        }
        let mut ping = tokio::time::interval(PING_INTERVAL);
        ping.tick().await;
        loop {
            let frame = tokio::select! {
                event = events.recv() => match event {
                    Ok(event) => {
                        if event.id <= last {
                            continue;
                        }
                        last = event.id;
                        if send_event(&mut sink, &event).await == Flow::Closed {
                            return;
                        }
                        continue;
                    }
                    Err(RecvError::Lagged(_)) => {
                        // The broadcast dropped some: the replay buffer may still hold them.
                        let Some(session) = weak.upgrade() else {
                            return;
                        };
                        let catchup = session.catch_up(last);
                        drop(session);
                        if send_catchup(&mut sink, catchup, &mut last, true).await == Flow::Closed {
                            return;
                        }
                        continue;
                    }
                    Err(RecvError::Closed) => return,
                },
                reply = reply_rx.recv() => match reply {
                    Some(text) => text,
                    None => return,
                },
                _ = ping.tick() => {
                    if sink.send(WsMessage::Ping(Vec::new().into())).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            if sink.send(WsMessage::Text(frame.into())).await.is_err() {
                return;
            }
        }
    });
    // Messages are handled in order by a task of their own: a restart (or a restore behind
    // an interrupt) takes minutes under emulation, and the reader must keep reading
    // meanwhile so that the client's pings are answered and its close is seen.
    let (to_handler, mut queued) = tokio::sync::mpsc::channel::<ClientMessage>(QUEUED_MESSAGES);
    let handler = {
        let (session, reply_tx) = (session.clone(), reply_tx.clone());
        tokio::spawn(async move {
            while let Some(message) = queued.recv().await {
                if matches!(message, ClientMessage::Execute { .. }) {
                    if let Err(err) = super::usage::check_quota(&caller.0, &caller.1).await {
                        let _ = reply_tx.send(client_error(&err.message));
                        continue;
                    }
                }
                if let Err(message) = handle(&session, message).await {
                    let _ = reply_tx.send(client_error(&message));
                }
            }
        })
    };
    while let Some(Ok(frame)) = stream.next().await {
        let text = match frame {
            WsMessage::Text(text) => text.to_string(),
            WsMessage::Binary(bytes) => match String::from_utf8(bytes.to_vec()) {
                Ok(text) => text,
                Err(_) => {
                    let _ = reply_tx.send(client_error("binary frames must be UTF-8 JSON"));
                    continue;
                }
            },
            WsMessage::Close(_) => break,
            _ => continue,
        };
        let message: ClientMessage = match serde_json::from_str(&text) {
            Ok(message) => message,
            Err(err) => {
                let _ = reply_tx.send(client_error(&format!("invalid message: {err}")));
                continue;
            }
        };
        if to_handler.send(message).await.is_err() {
            break;
        }
    }
    // What the client sent before it went is still handled, as before.
    drop(to_handler);
    let _ = handler.await;
    writer.abort();
}

/// Client messages read but not handled yet (a restart running): past this, the reader
/// waits for the handler.
const QUEUED_MESSAGES: usize = 16;

fn client_error(message: &str) -> String {
    json!({"type": "client_error", "message": message}).to_string()
}

async fn handle(session: &Arc<Session>, message: ClientMessage) -> Result<(), String> {
    match message {
        ClientMessage::Execute { code, timeout_s } => {
            let timeout = match timeout_s {
                None => None,
                Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => {
                    Some(Duration::from_secs_f64(s))
                }
                Some(_) => return Err("timeout_s must be above 0 and at most 86400".to_owned()),
            };
            // The events reach this socket through the session's broadcast.
            drop(session.execute(code, timeout));
            Ok(())
        }
        ClientMessage::Interrupt => session.interrupt().await.map_err(|e| e.to_string()),
        ClientMessage::InputReply {
            value,
            execution_id,
        } => match super::input_for(execution_id.as_deref()) {
            Ok(execution_id) => session
                .input_reply(execution_id.as_ref(), &value)
                .await
                .map_err(|e| e.to_string()),
            Err(err) => Err(err.to_string()),
        },
        ClientMessage::Restart => session.restart().await.map_err(|e| e.to_string()),
    }
}
