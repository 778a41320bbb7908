//! `GET /v1/sessions/{id}/ws`: the session's events as JSON text frames (the same
//! [`SessionEvent`]s as SSE, for every execution of the session, whoever started it), and
//! client messages:
//!
//! - `{"type": "execute", "code": "…", "timeout_s"?: 30}`
//! - `{"type": "interrupt"}`
//! - `{"type": "input_reply", "value": "…", "execution_id"?: "…"}`
//! - `{"type": "restart"}`
//!
//! On connect the server sends `{"type": "session", "session": <SessionModel>}`. When the
//! session ends (deleted, or its kernel shut down) the last event is
//! `{"type": "kernel", "state": "terminated"}` and the server closes the socket. A client
//! message that cannot be understood or fails answers `{"type": "client_error", "message"}`
//! and the socket stays open. A client too slow for the event rate gets
//! `{"type": "lagged", "missed": n}` and then the events after the gap.

use std::sync::Arc;
use std::time::Duration;

use super::ApiError;
use crate::gateway::ErrorCode;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;
use utoipa::ToSchema;

use super::live_session_for;
use crate::gateway::auth::Principal;
use crate::gateway::kernel_ws::origin_allowed;
use crate::gateway::state::AppState;
use crate::sessions::{KernelPhase, Session, SessionEvent};

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

/// The session's event stream and controls (WebSocket upgrade).
#[utoipa::path(get, path = "/v1/sessions/{id}/ws", tag = "sessions", operation_id = "open_websocket",
    params(("id" = String, Path)),
    responses(
        (status = 101, description = "WebSocket: server frames are SessionEvent JSON; client frames are ClientMessage JSON"),
        (status = 400, description = "not a WebSocket handshake"),
        (status = 403, description = "a page from an origin the gateway does not allow"),
        (status = 404, description = "no such session"),
        (status = 426, description = "the connection cannot be upgraded")))]
pub async fn socket(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
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
    // Checked when the socket opens: executions sent over an open socket are not.
    if let Err(err) = super::usage::check_quota(&state, &principal).await {
        return err.into_response();
    }
    let session = match live_session_for(&state, &principal, &id).await {
        Ok(session) => session,
        Err(err) => return err.into_response(),
    };
    upgrade
        .max_message_size(MAX_CLIENT_MESSAGE)
        .on_upgrade(move |socket| serve(socket, session))
}

async fn serve(socket: WebSocket, session: Arc<Session>) {
    let mut events = session.subscribe();
    let (mut sink, mut stream) = socket.split();
    let hello = json!({"type": "session", "session": session.model()}).to_string();
    if sink.send(WsMessage::Text(hello.into())).await.is_err() {
        return;
    }
    let (reply_tx, mut reply_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        let mut ping = tokio::time::interval(PING_INTERVAL);
        ping.tick().await;
        loop {
            let frame = tokio::select! {
                event = events.recv() => match event {
                    Ok(event) => {
                        let last = matches!(&*event, SessionEvent::Kernel { state: KernelPhase::Terminated, .. });
                        let Ok(text) = serde_json::to_string(&*event) else {
                            continue;
                        };
                        if last {
                            // The session is gone: say so, then close.
                            let _ = sink.send(WsMessage::Text(text.into())).await;
                            let _ = sink.send(WsMessage::Close(None)).await;
                            return;
                        }
                        text
                    }
                    Err(RecvError::Lagged(missed)) => {
                        json!({"type": "lagged", "missed": missed}).to_string()
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
        if let Err(message) = handle(&session, message).await {
            let _ = reply_tx.send(client_error(&message));
        }
    }
    writer.abort();
}

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
