//! The integration tests' one client of API v1 (and of any other route, as the same caller):
//! requests carry the gateway's admin token, a tenant's JWT or no credential; JSON calls,
//! sessions and executes, files, artifacts, Server-Sent Events and the session WebSocket.
//!
//! It checks only what a helper's name promises (a created session is 201, an execute is
//! 200), and that API v1's answers read as the crate's own types (`SessionModel`,
//! `ExecutionResult`): a field renamed on one side fails every test that creates a session
//! or executes. Everything a test is about stays in the test.

use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use cellgate::sessions::{ExecutionResult, SessionModel};
use futures_util::{SinkExt, StreamExt};
use reqwest::Method;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use super::{Gateway, Socket};

/// How long a client waits for an SSE event or a WebSocket frame before it fails the test.
pub const WAIT: Duration = Duration::from_secs(90);

/// A caller of one gateway.
#[derive(Clone)]
pub struct V1Client<'g> {
    gateway: &'g Gateway,
    /// The `Authorization` header's value, if the caller presents one.
    authorization: Option<String>,
}

/// A session just created: its id, the `Location` the gateway answered and its model.
pub struct Created {
    pub id: String,
    pub location: Option<String>,
    pub model: SessionModel,
}

impl<'g> V1Client<'g> {
    /// With the gateway's own token (the admin), or no credential for a gateway without one.
    pub fn new(gateway: &'g Gateway) -> Self {
        V1Client {
            gateway,
            authorization: gateway.token.as_ref().map(|t| format!("token {t}")),
        }
    }

    /// As the holder of `jwt` (a tenant), sent as `Authorization: Bearer`.
    pub fn bearer(gateway: &'g Gateway, jwt: &str) -> Self {
        V1Client {
            gateway,
            authorization: Some(format!("Bearer {jwt}")),
        }
    }

    /// A request to `path` (from the gateway's base URL on) with this caller's credential.
    pub fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let request = self
            .gateway
            .http
            .request(method, format!("{}{path}", self.gateway.base));
        match &self.authorization {
            Some(value) => request.header("Authorization", value),
            None => request,
        }
    }

    /// A request with an optional JSON body; the status and the answer as JSON (a body that
    /// is not JSON comes back as a JSON string).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value)> {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(&body);
        }
        json_of(request.send().await?).await
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Result<(u16, Value)> {
        self.call(Method::GET, path, None).await
    }

    /// `POST path` with a JSON body.
    pub async fn post(&self, path: &str, body: Value) -> Result<(u16, Value)> {
        self.call(Method::POST, path, Some(body)).await
    }

    /// Creates a session (anything but 201 is an error).
    pub async fn new_session(&self, body: Value) -> Result<Created> {
        let response = self
            .request(Method::POST, "/v1/sessions")
            .json(&body)
            .send()
            .await?;
        let location = response
            .headers()
            .get("location")
            .map(|l| l.to_str().unwrap_or_default().to_owned());
        let (status, model) = json_of(response).await?;
        if status != 201 {
            bail!("create session: {status} {model}");
        }
        let model: SessionModel = serde_json::from_value(model.clone())
            .with_context(|| format!("a session model: {model}"))?;
        let id = model.id.to_string();
        Ok(Created {
            id,
            location,
            model,
        })
    }

    /// Creates a session; answers its id.
    pub async fn create_session(&self, body: Value) -> Result<String> {
        Ok(self.new_session(body).await?.id)
    }

    /// Blocking execute of `code`; the result JSON (any HTTP status other than 200 is an
    /// error).
    pub async fn execute(&self, session: &str, code: &str) -> Result<Value> {
        self.execute_with(session, json!({ "code": code })).await
    }

    /// Blocking execute with a whole request body.
    pub async fn execute_with(&self, session: &str, body: Value) -> Result<Value> {
        let (status, result) = self
            .post(&format!("/v1/sessions/{session}/execute"), body)
            .await?;
        if status != 200 {
            bail!("execute: {status} {result}");
        }
        serde_json::from_value::<ExecutionResult>(result.clone())
            .with_context(|| format!("an execution result: {result}"))?;
        Ok(result)
    }

    /// Blocking execute of `code`; the result as the crate's own type.
    pub async fn run(&self, session: &str, code: &str) -> Result<ExecutionResult> {
        let result = self.execute(session, code).await?;
        Ok(serde_json::from_value(result)?)
    }

    /// Uploads a workspace file; its status (a 5xx is an error).
    pub async fn put_file(&self, session: &str, path: &str, bytes: Vec<u8>) -> Result<u16> {
        let response = self
            .request(Method::PUT, &format!("/v1/sessions/{session}/files/{path}"))
            .body(bytes)
            .send()
            .await?;
        let status = response.status().as_u16();
        if status >= 500 {
            bail!("PUT {path}: {status} {}", response.text().await?);
        }
        Ok(status)
    }

    /// `GET /v1/artifacts/{id}`, the response as it came.
    pub async fn artifact(&self, id: &str) -> Result<reqwest::Response> {
        Ok(self
            .request(Method::GET, &format!("/v1/artifacts/{id}"))
            .send()
            .await?)
    }

    /// `POST path` asking for Server-Sent Events (anything but 200 is an error).
    pub async fn sse(&self, path: &str, body: Value) -> Result<Sse> {
        let response = self
            .request(Method::POST, path)
            .header("Accept", "text/event-stream")
            .json(&body)
            .send()
            .await?;
        Sse::of(response).await
    }

    /// `GET path` asking for Server-Sent Events, with `Last-Event-ID` when given (anything
    /// but 200 is an error).
    pub async fn sse_get(&self, path: &str, last_event_id: Option<u64>) -> Result<Sse> {
        let mut request = self
            .request(Method::GET, path)
            .header("Accept", "text/event-stream");
        if let Some(id) = last_event_id {
            request = request.header("Last-Event-ID", id.to_string());
        }
        Sse::of(request.send().await?).await
    }
}

impl Sse {
    /// The stream of `response`, which must be a 200 of `text/event-stream`.
    async fn of(response: reqwest::Response) -> Result<Sse> {
        if response.status().as_u16() != 200 {
            bail!("SSE: {} {}", response.status(), response.text().await?);
        }
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        Ok(Sse {
            response,
            buffer: String::new(),
        })
    }
}

impl<'g> V1Client<'g> {
    /// The upgrade request of the session WebSocket, with this caller's credential.
    pub fn ws_request(
        &self,
        session: &str,
    ) -> Result<tokio_tungstenite::tungstenite::handshake::client::Request> {
        self.ws_request_query(session, "")
    }

    /// The upgrade request of the session WebSocket with a query (`?…`, or empty).
    pub fn ws_request_query(
        &self,
        session: &str,
        query: &str,
    ) -> Result<tokio_tungstenite::tungstenite::handshake::client::Request> {
        let url = format!(
            "{}/v1/sessions/{session}/ws{query}",
            self.gateway.base.replace("http://", "ws://")
        );
        let mut request = url.into_client_request()?;
        if let Some(value) = &self.authorization {
            request
                .headers_mut()
                .insert("Authorization", value.parse()?);
        }
        Ok(request)
    }

    /// The session WebSocket, open.
    pub async fn ws(&self, session: &str) -> Result<Socket> {
        let (socket, _) = tokio_tungstenite::connect_async(self.ws_request(session)?).await?;
        Ok(socket)
    }
}

/// A response's status and its body as JSON (a body that is not JSON as a JSON string).
pub async fn json_of(response: reqwest::Response) -> Result<(u16, Value)> {
    let status = response.status().as_u16();
    let body = response.text().await?;
    Ok((
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    ))
}

/// Server-Sent Events of one response, read as they arrive.
pub struct Sse {
    response: reqwest::Response,
    buffer: String,
}

impl Sse {
    /// The next event: its `event:` name and its `data:` JSON (keep-alive comments skipped).
    pub async fn next(&mut self) -> Result<(String, Value)> {
        let (_, name, data) = self.next_with_id().await?;
        Ok((name, data))
    }

    /// The next event with its `id:` field, if it has one.
    pub async fn next_with_id(&mut self) -> Result<(Option<String>, String, Value)> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut id = None;
                let mut name = String::new();
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        name = v.trim().to_owned();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.strip_prefix(' ').unwrap_or(v));
                    } else if let Some(v) = line.strip_prefix("id:") {
                        id = Some(v.trim().to_owned());
                    }
                }
                if data.is_empty() {
                    continue;
                }
                return Ok((id, name, serde_json::from_str(&data)?));
            }
            let chunk = tokio::time::timeout(WAIT, self.response.chunk())
                .await
                .map_err(|_| anyhow!("no SSE event within {WAIT:?}; buffered {:?}", self.buffer))??
                .ok_or_else(|| anyhow!("SSE stream ended; buffered {:?}", self.buffer))?;
            self.buffer.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

/// The next JSON event of a session WebSocket (a close frame is an error).
pub async fn ws_next(socket: &mut Socket) -> Result<Value> {
    loop {
        let frame = tokio::time::timeout(WAIT, socket.next())
            .await
            .map_err(|_| anyhow!("no WebSocket frame within {WAIT:?}"))?
            .ok_or_else(|| anyhow!("WebSocket closed"))??;
        match frame {
            WsMessage::Text(text) => return Ok(serde_json::from_str(text.as_str())?),
            WsMessage::Close(frame) => bail!("WebSocket closed by the gateway: {frame:?}"),
            _ => continue,
        }
    }
}

/// Sends one JSON message on a session WebSocket.
pub async fn ws_send(socket: &mut Socket, message: Value) -> Result<()> {
    socket
        .send(WsMessage::Text(message.to_string().into()))
        .await?;
    Ok(())
}

/// Every event of a session WebSocket up to and including `done`.
pub async fn ws_until_done(socket: &mut Socket) -> Result<Vec<Value>> {
    let mut events = Vec::new();
    loop {
        let event = ws_next(socket).await?;
        let done = event["type"] == "done";
        events.push(event);
        if done {
            return Ok(events);
        }
    }
}
