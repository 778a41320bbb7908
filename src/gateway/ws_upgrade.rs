//! The WebSocket handshake of the kernel channels, answered here rather than by axum's
//! `WebSocketUpgrade` so the socket is a `tokio-tungstenite` stream we drive ourselves.
//!
//! Why not axum's: its `Message` has no raw-frame variant, so a 50 MB stream message had to
//! go out as one frame. tungstenite copies a frame whole into its write buffer and, after each
//! partial socket write, moves the unsent rest to the buffer's front: the copy, the fresh
//! pages and the quadratic moves all came before the client saw a byte (BENCHMARKS.md,
//! "Measurements behind the code"). With raw frames the writer sends large messages as
//! 64 KiB fragments, straight from the kernel's bytes (see `kernel_ws`).
//!
//! The checks are RFC 6455's (and what axum checks): GET, `Connection: upgrade`,
//! `Upgrade: websocket`, version 13, a key; HTTP/1.1 only (cellgate serves no HTTP/2).

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

use super::ApiError;

/// The server side of an upgraded kernel channels connection.
pub type KernelSocket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// A valid WebSocket upgrade request, not yet answered.
pub struct WsUpgrade {
    key: HeaderValue,
    offered: Vec<String>,
    selected: Option<HeaderValue>,
    on_upgrade: OnUpgrade,
}

fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|value| {
        value
            .to_str()
            .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

impl<S: Send + Sync> FromRequestParts<S> for WsUpgrade {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        if parts.method != Method::GET {
            return Err(ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "WebSocket request must be GET",
            ));
        }
        if !has_token(&parts.headers, header::CONNECTION, "upgrade") {
            return Err(ApiError::bad_request(
                "Connection header did not include 'upgrade'",
            ));
        }
        if !has_token(&parts.headers, header::UPGRADE, "websocket") {
            return Err(ApiError::bad_request(
                "`Upgrade` header did not include 'websocket'",
            ));
        }
        if parts
            .headers
            .get(header::SEC_WEBSOCKET_VERSION)
            .is_none_or(|v| v.as_bytes() != b"13")
        {
            return Err(ApiError::bad_request(
                "`Sec-WebSocket-Version` header did not include '13'",
            ));
        }
        let key = parts
            .headers
            .get(header::SEC_WEBSOCKET_KEY)
            .cloned()
            .ok_or_else(|| ApiError::bad_request("`Sec-WebSocket-Key` header missing"))?;
        let on_upgrade = parts.extensions.remove::<OnUpgrade>().ok_or_else(|| {
            ApiError::new(
                StatusCode::UPGRADE_REQUIRED,
                "WebSocket request couldn't be upgraded since no upgrade state was present",
            )
        })?;
        let offered = parts
            .headers
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.is_empty())
            .collect();
        Ok(WsUpgrade {
            key,
            offered,
            selected: None,
            on_upgrade,
        })
    }
}

impl WsUpgrade {
    /// Picks the first of `supported` that the client offered; it is echoed in the answer.
    pub fn protocols(mut self, supported: &[&'static str]) -> Self {
        self.selected = supported
            .iter()
            .find(|p| self.offered.iter().any(|o| o == *p))
            .map(|p| HeaderValue::from_static(p));
        self
    }

    pub fn selected_protocol(&self) -> Option<&HeaderValue> {
        self.selected.as_ref()
    }

    /// Answers 101 and runs `callback` on the socket once hyper hands the connection over.
    pub fn on_upgrade<F, Fut>(self, config: WebSocketConfig, callback: F) -> Response
    where
        F: FnOnce(KernelSocket) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let on_upgrade = self.on_upgrade;
        tokio::spawn(async move {
            let upgraded = match on_upgrade.await {
                Ok(upgraded) => upgraded,
                Err(err) => {
                    tracing::debug!(%err, "WebSocket upgrade did not complete");
                    return;
                }
            };
            let socket = WebSocketStream::from_raw_socket(
                TokioIo::new(upgraded),
                Role::Server,
                Some(config),
            )
            .await;
            callback(socket).await;
        });
        let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        match HeaderValue::from_str(&derive_accept_key(self.key.as_bytes())) {
            Ok(accept) => {
                headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
            }
            // The accept key is base64, always a valid header value.
            Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
        if let Some(protocol) = self.selected {
            headers.insert(header::SEC_WEBSOCKET_PROTOCOL, protocol);
        }
        response
    }
}
