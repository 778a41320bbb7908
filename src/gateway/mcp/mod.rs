//! The MCP server at `/mcp`: API v1 as Model Context Protocol tools, for agent hosts
//! (desktop assistants, IDE agents, agent frameworks), over the streamable HTTP transport
//! of the official Rust SDK (`rmcp`).
//!
//! **A thin adapter, not a second API.** Every tool is one or two calls of API v1's own
//! routes, made in-process (the v1 router as a tower service) with the caller's
//! [`Principal`], which the authentication layer put on the MCP request: tenancy, policies,
//! limits and errors are API v1's exactly, and a tool cannot do what the caller could not do
//! over HTTP.
//!
//! **The caller's session.** `run_python` without a `session_id` runs in the caller's
//! session, created on first use and kept across calls, so an agent's variables and files
//! last through a conversation. "The caller" is the principal and, where the client keeps an
//! MCP session (`Mcp-Session-Id`), that session: two conversations get two kernels. A
//! session that is gone (deleted, culled) is replaced by a fresh one, and the result says
//! its earlier state is gone. Every result names its `session_id`, which any tool accepts.
//!
//! **Results a model can read.** Text first: status, stdout, stderr, the value, the error
//! and traceback, artifacts with their summaries, denials, `state_generation`. Images (PNG,
//! JPEG, GIF, WebP) come as MCP image content, a few per result and each bounded; other rich
//! outputs as their summary and the artifact id, which `get_artifact` reads as text.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use base64::Engine as _;
use http_body_util::BodyExt as _;
use rmcp::handler::server::common::Extension;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{schemars, tool, tool_handler, tool_router, ServerHandler};
use serde::Deserialize;
use serde_json::{json, Value};
use tower::ServiceExt as _;

use super::auth::Principal;
use super::state::AppState;
use conversations::{Caller, Conversation, Conversations, Defaults};

mod conversations;

/// The most bytes of a file or artifact a tool returns (as text or an image).
const MAX_CONTENT_BYTES: usize = 1 << 20;
/// The most text of a file, an artifact or a notebook a tool returns.
const MAX_TEXT_CHARS: usize = 100_000;
/// Callers whose default session is remembered, and for how long after their last call: a
/// caller back after that gets a new session (and is told so), as after a cull.
const DEFAULT_SESSIONS_KEPT: u64 = 100_000;
const DEFAULT_SESSION_IDLE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
/// How long an MCP session may be idle before rmcp ends it.
const MCP_SESSION_IDLE: std::time::Duration = std::time::Duration::from_secs(2 * 3600);
/// How much longer the gateway remembers an idle MCP session's opener: rmcp ends the
/// session first, so a client never finds its session alive but disowned.
const MCP_SESSION_MARGIN: std::time::Duration = std::time::Duration::from_secs(60);
/// The most bytes of an execution's result a tool reads (its streams are capped at 1 MiB
/// each by the gateway; artifact references and the rest are small).
const MAX_RESULT_BYTES: usize = 8 << 20;
/// The most images one `run_python` result carries (the rest are listed).
const MAX_IMAGES: usize = 4;
/// The most characters of one stream a result quotes (the rest are cut, and it says so).
const MAX_STREAM_CHARS: usize = 20_000;

/// What is mounted at `/mcp` (behind the authentication layer): the MCP service behind
/// [`guard`].
pub fn routes(state: AppState) -> axum::Router {
    let api = super::v1::routes().with_state(state.clone());
    let defaults: Defaults = moka::sync::Cache::builder()
        .max_capacity(DEFAULT_SESSIONS_KEPT)
        .time_to_idle(DEFAULT_SESSION_IDLE)
        .build();
    let deleter = api.clone();
    let end_session: conversations::EndSession = Arc::new(move |principal, session| {
        let api = deleter.clone();
        tokio::spawn(async move {
            let request = Request::builder()
                .method(Method::DELETE)
                .uri(session_path(&session))
                .body(Body::empty());
            let Ok(mut request) = request else { return };
            request.extensions_mut().insert(principal);
            let Ok(answer) = api.oneshot(request).await;
            tracing::info!(session_id = %session, status = answer.status().as_u16(), "an MCP conversation ended: its session deleted");
        });
    });
    let conversations = Conversations::new(
        MCP_SESSION_IDLE + MCP_SESSION_MARGIN,
        DEFAULT_SESSIONS_KEPT,
        defaults.clone(),
        end_session,
    );
    let tenants = state.tenants.clone();
    axum::Router::new()
        .fallback_service(service(api, defaults))
        .layer(axum::middleware::from_fn(move |request, next| {
            guard(conversations.clone(), tenants.clone(), request, next)
        }))
}

/// What rmcp leaves to its host (see [`conversations`]):
/// - an MCP session is its opener's: rmcp accepts any request naming a live session id,
///   which would let another caller replay its cached results or end it. A request naming
///   a session this caller did not open (another's, or one unknown here) is handed on with
///   an id that names none, so it is answered exactly as an unknown session is;
/// - opening one takes a slot of the tenant's cap, and ending one ends its kernel;
/// - every error is the gateway's JSON body (rmcp answers some in plain text);
/// - a client ending its session (`DELETE`) gets 204, not rmcp's 202: the success the
///   official Python SDK expects (it warns about any other).
async fn guard(
    conversations: Conversations,
    tenants: Arc<crate::tenants::Tenants>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;

    let Some(principal) = request.extensions().get::<Principal>().cloned() else {
        // The authentication layer puts a principal on every request it lets through.
        return super::ApiError::unauthorized("the request carries no identity").into_response();
    };
    let who = Caller::of(&principal);
    let named = request
        .headers()
        .get(MCP_SESSION_HEADER)
        .map(|v| v.to_str().map(str::to_owned).unwrap_or_default());
    let mut slot = None;
    let mut own = false;
    match &named {
        Some(id) if !conversations.is_openers(id, &who) => {
            let nobody =
                axum::http::HeaderValue::from_static("00000000-0000-0000-0000-000000000000");
            request.headers_mut().insert(MCP_SESSION_HEADER, nobody);
        }
        Some(_) => own = true,
        // Only a POST without a session opens one.
        None if request.method() == Method::POST => {
            let limit = principal
                .tenant()
                .map_or(usize::MAX, |tenant| tenants.max_mcp_sessions(tenant));
            match conversations.reserve(&who, limit) {
                Ok(reserved) => slot = Some(reserved),
                Err(err) => {
                    return super::ApiError::new(StatusCode::FORBIDDEN, err.to_string())
                        .code("tenant_mcp_session_limit")
                        .into_response()
                }
            }
        }
        None => {}
    }
    let ending = request.method() == Method::DELETE;
    let mut response = next.run(request).await;
    if let (Some(slot), Some(issued)) = (
        slot,
        response
            .headers()
            .get(MCP_SESSION_HEADER)
            .and_then(|v| v.to_str().ok()),
    ) {
        conversations.opened(issued, &principal, slot);
    }
    let status = response.status();
    // rmcp answers success to ending a session it does not know: only the opener's own
    // request, which reached its session, ends it here.
    if ending && own && status.is_success() {
        if let Some(id) = &named {
            conversations.ended(id);
        }
    }
    if ending && status == StatusCode::ACCEPTED {
        *response.status_mut() = StatusCode::NO_CONTENT;
    }
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/json"));
    if (status.is_client_error() || status.is_server_error()) && !json {
        let limited = http_body_util::Limited::new(response.into_body(), 4096);
        let text = match limited.collect().await {
            Ok(body) => String::from_utf8_lossy(&body.to_bytes()).trim().to_owned(),
            Err(_) => String::new(),
        };
        let message = if text.is_empty() {
            status.canonical_reason().unwrap_or("error").to_owned()
        } else {
            text
        };
        let error = super::ApiError::new(status, message);
        let error = if status == StatusCode::NOT_FOUND {
            error.code("no_such_mcp_session")
        } else {
            error
        };
        return error.into_response();
    }
    response
}

/// The header naming an MCP session.
const MCP_SESSION_HEADER: &str = "mcp-session-id";

/// The MCP service itself.
fn service(
    api: axum::Router,
    defaults: Defaults,
) -> StreamableHttpService<Tools, LocalSessionManager> {
    let config = StreamableHttpServerConfig::default()
        // The gateway's edge already checks hosts and origins (a gateway without a token
        // answers loopback names only); with a token, the credential is what protects.
        .disable_allowed_hosts();
    let mut sessions = LocalSessionManager::default();
    // rmcp ends a session idle this long, counting while a tool runs: longer than any cell
    // a policy lets run, so no result is lost midway and a conversation keeps its kernel.
    sessions.session_config.keep_alive = Some(MCP_SESSION_IDLE);
    StreamableHttpService::new(
        move || Ok(Tools::new(api.clone(), defaults.clone())),
        Arc::new(sessions),
        config,
    )
}

/// One MCP session's server (made per session, or per request for stateless clients);
/// the callers' default sessions are shared by all of them.
#[derive(Clone)]
pub struct Tools {
    api: axum::Router,
    /// Each conversation's (caller and MCP session) default cellgate session.
    defaults: Defaults,
    #[allow(dead_code)] // read by the code `tool_handler` generates
    tool_router: ToolRouter<Tools>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RunPython {
    /// The Python code (a notebook cell: the value of its last expression is returned).
    pub code: String,
    /// Interrupt it after this many seconds (the policy's limit applies as well).
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// A session to run in; default: the caller's own, created on first use.
    #[serde(default)]
    pub session_id: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SessionOnly {
    /// The session; default: the caller's own.
    #[serde(default)]
    pub session_id: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct NewSession {
    /// The policy of the new session (default: the caller's default policy).
    #[serde(default)]
    pub policy: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ListFiles {
    /// A directory of the workspace (default: its top).
    #[serde(default)]
    pub dir: Option<String>,
    #[serde(default)]
    pub session_id: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ReadFile {
    /// The file's path in the workspace (relative).
    pub path: String,
    #[serde(default)]
    pub session_id: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WriteFile {
    /// The file's path in the workspace (relative; directories are made).
    pub path: String,
    /// The content: text, or base64 with `encoding` = `base64`.
    pub content: String,
    /// `utf-8` (default) or `base64`.
    #[serde(default)]
    pub encoding: Option<String>,
    #[serde(default)]
    pub session_id: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct GetArtifact {
    /// The artifact's id, as a result lists it.
    pub artifact_id: String,
}

/// An API v1 answer: its status and body.
struct Answer {
    status: StatusCode,
    content_type: String,
    body: bytes::Bytes,
    /// The body was longer than the call read: `body` is empty.
    too_large: bool,
}

impl Answer {
    fn ok(&self) -> bool {
        self.status.is_success()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// A success whose body was too long to read, said as such.
    fn oversized(&self, what: &str, limit: usize) -> Option<CallToolResult> {
        self.too_large.then(|| {
            tool_error(format!(
                "{what}: the answer is over {limit} bytes, more than a tool returns; work on it with run_python instead"
            ))
        })
    }

    /// The error as a model should read it: the gateway's message and code.
    fn failure(&self, what: &str) -> CallToolResult {
        let body = self.json();
        let message = body["message"].as_str().unwrap_or("no message");
        let code = body["code"].as_str().unwrap_or("error");
        CallToolResult::error(vec![ContentBlock::text(format!(
            "{what} failed: {message} ({} {code})",
            self.status.as_u16()
        ))])
    }
}

#[tool_router]
impl Tools {
    fn new(api: axum::Router, defaults: Defaults) -> Tools {
        Tools {
            api,
            defaults,
            tool_router: Self::tool_router(),
        }
    }

    /// One API v1 call as `principal`.
    async fn call(
        &self,
        principal: &Principal,
        method: Method,
        path: &str,
        body: Option<(&'static str, Vec<u8>)>,
    ) -> Answer {
        self.call_bounded(principal, method, path, body, MAX_CONTENT_BYTES)
            .await
    }

    /// [`Self::call`], reading at most `limit` bytes of the answer.
    async fn call_bounded(
        &self,
        principal: &Principal,
        method: Method,
        path: &str,
        body: Option<(&'static str, Vec<u8>)>,
        limit: usize,
    ) -> Answer {
        let mut request = Request::builder().method(method).uri(path);
        let body = match body {
            Some((content_type, bytes)) => {
                request = request.header(header::CONTENT_TYPE, content_type);
                Body::from(bytes)
            }
            None => Body::empty(),
        };
        let Ok(mut request) = request.body(body) else {
            return Answer::internal("a request the gateway could not build");
        };
        request.extensions_mut().insert(principal.clone());
        let response = match self.api.clone().oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("application/octet-stream")
            .to_owned();
        // Bounded: a tool never holds more than it may return.
        let limited = http_body_util::Limited::new(response.into_body(), limit);
        match limited.collect().await {
            Ok(collected) => Answer {
                status,
                content_type,
                body: collected.to_bytes(),
                too_large: false,
            },
            Err(_) => Answer {
                status,
                content_type,
                body: bytes::Bytes::new(),
                too_large: true,
            },
        }
    }

    async fn call_json(
        &self,
        principal: &Principal,
        method: Method,
        path: &str,
        body: Value,
    ) -> Answer {
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        self.call(principal, method, path, Some(("application/json", bytes)))
            .await
    }

    /// The session a tool works in: `requested`, or the caller's own (made when it has
    /// none, or its old one is gone); whether it is new. A caller's calls that find no
    /// session wait for one another, so parallel first calls make one session, not several.
    async fn session(
        &self,
        principal: &Principal,
        caller: &Conversation,
        requested: Option<String>,
    ) -> Result<(String, bool), CallToolResult> {
        if let Some(id) = requested {
            return Ok((id, false));
        }
        let slot = self
            .defaults
            .get_with(caller.clone(), || Arc::new(tokio::sync::Mutex::new(None)));
        let mut known = slot.lock().await;
        if let Some(id) = known.clone() {
            let answer = self
                .call(principal, Method::GET, &session_path(&id), None)
                .await;
            if answer.ok() {
                return Ok((id, false));
            }
            // Only a session that is gone is replaced; any other failure is reported.
            if answer.status != StatusCode::NOT_FOUND {
                return Err(answer.failure("finding the session"));
            }
        }
        let id = self.create(principal, None).await?;
        *known = Some(id.clone());
        Ok((id, true))
    }

    /// Who calls (from the request's `parts`) and the session the tool works in (see
    /// [`Self::session`]): the principal, the session's id, and whether it is new.
    async fn target(
        &self,
        parts: &axum::http::request::Parts,
        requested: Option<String>,
    ) -> Result<(Principal, String, bool), CallToolResult> {
        let (principal, caller) = caller_of(parts)?;
        let (id, new) = self.session(&principal, &caller, requested).await?;
        Ok((principal, id, new))
    }

    /// A new session for `principal`.
    async fn create(
        &self,
        principal: &Principal,
        policy: Option<String>,
    ) -> Result<String, CallToolResult> {
        let body = match policy {
            Some(policy) => json!({"policy": policy}),
            None => json!({}),
        };
        let answer = self
            .call_json(principal, Method::POST, "/v1/sessions", body)
            .await;
        if !answer.ok() {
            return Err(answer.failure("creating a session"));
        }
        Ok(answer.json()["id"].as_str().unwrap_or_default().to_owned())
    }

    #[tool(
        description = "Run Python code in a sandboxed Jupyter kernel. Variables, imports and files persist across calls in the same session (the caller's own unless session_id is given). Returns the status (ok, error, timeout, oom, denied, output_truncated, sandbox_lost), stdout, stderr, the value of the last expression, the error with its traceback, and rich outputs: images inline, other charts, tables and HTML as artifacts (read one with get_artifact). Network access and package installs follow the session's policy; what it refused is listed under denials. state_generation changes when the kernel's variables were lost (restart, crash, out of memory)."
    )]
    async fn run_python(
        &self,
        Parameters(request): Parameters<RunPython>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, new) = match self.target(&parts, request.session_id).await {
            Ok(target) => target,
            Err(error) => return error,
        };
        let mut body = json!({"code": request.code});
        if let Some(timeout) = request.timeout_s {
            body["timeout_s"] = json!(timeout);
        }
        let code = serde_json::to_vec(&body).unwrap_or_default();
        let answer = self
            .call_bounded(
                &principal,
                Method::POST,
                &format!("{}/execute", session_path(&id)),
                Some(("application/json", code)),
                MAX_RESULT_BYTES,
            )
            .await;
        if let Some(oversized) = answer.oversized("the result", MAX_RESULT_BYTES) {
            return oversized;
        }
        if !answer.ok() {
            return answer.failure("running the code");
        }
        let result = answer.json();
        let mut content = vec![ContentBlock::text(describe_execution(&id, new, &result))];
        let mut images = 0;
        for artifact in result["artifacts"].as_array().into_iter().flatten() {
            let mime = artifact["mime"].as_str().unwrap_or_default();
            let bytes = artifact["bytes"].as_u64().unwrap_or(u64::MAX);
            if !is_image(mime) || bytes > MAX_CONTENT_BYTES as u64 || images == MAX_IMAGES {
                continue;
            }
            let Some(artifact_id) = artifact["id"].as_str() else {
                continue;
            };
            let fetched = self
                .call(
                    &principal,
                    Method::GET,
                    &format!("/v1/artifacts/{artifact_id}"),
                    None,
                )
                .await;
            if fetched.ok() && fetched.body.len() <= MAX_CONTENT_BYTES {
                content.push(ContentBlock::image(
                    base64::engine::general_purpose::STANDARD.encode(&fetched.body),
                    mime,
                ));
                images += 1;
            }
        }
        CallToolResult::success(content)
    }

    #[tool(
        description = "Start over: a fresh session (a new kernel, empty workspace) becomes the caller's own; the old one is shut down. Optionally under another policy."
    )]
    async fn new_session(
        &self,
        Parameters(request): Parameters<NewSession>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, caller) = match caller_of(&parts) {
            Ok(found) => found,
            Err(error) => return error,
        };
        let slot = self
            .defaults
            .get_with(caller.clone(), || Arc::new(tokio::sync::Mutex::new(None)));
        let mut known = slot.lock().await;
        let id = match self.create(&principal, request.policy).await {
            Ok(id) => id,
            Err(error) => return error,
        };
        let old = known.replace(id.clone());
        drop(known);
        if let Some(old) = old {
            self.call(&principal, Method::DELETE, &session_path(&old), None)
                .await;
        }
        let answer = self
            .call(&principal, Method::GET, &session_path(&id), None)
            .await;
        let model = answer.json();
        text(format!(
            "New session {id}: policy {}, sandbox {}, state_generation {}.",
            model["policy"].as_str().unwrap_or("?"),
            model["sandbox"].as_str().unwrap_or("?"),
            model["state_generation"]
        ))
    }

    #[tool(
        description = "List the files and directories of the session's workspace (the kernel's working directory), or of one directory in it."
    )]
    async fn list_files(
        &self,
        Parameters(request): Parameters<ListFiles>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self.target(&parts, request.session_id).await {
            Ok(target) => target,
            Err(error) => return error,
        };
        let mut path = format!("{}/files", session_path(&id));
        if let Some(dir) = request.dir.filter(|d| !d.is_empty()) {
            path.push_str(&format!("?dir={}", percent(&dir)));
        }
        let answer = self.call(&principal, Method::GET, &path, None).await;
        if !answer.ok() {
            return answer.failure("listing the files");
        }
        let entries = answer.json();
        let lines: Vec<String> = entries
            .as_array()
            .into_iter()
            .flatten()
            .map(|entry| {
                format!(
                    "{} ({}, {} bytes)",
                    entry["path"].as_str().unwrap_or("?"),
                    entry["kind"].as_str().unwrap_or("?"),
                    entry["size"]
                )
            })
            .collect();
        text(if lines.is_empty() {
            format!("session {id}: no files")
        } else {
            format!("session {id}:\n{}", lines.join("\n"))
        })
    }

    #[tool(
        description = "Read a file of the session's workspace: text as text, images as images; other binary files are described, not returned."
    )]
    async fn read_file(
        &self,
        Parameters(request): Parameters<ReadFile>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self.target(&parts, request.session_id).await {
            Ok(target) => target,
            Err(error) => return error,
        };
        let answer = self
            .call(
                &principal,
                Method::GET,
                &format!(
                    "{}/files/{}",
                    session_path(&id),
                    percent_path(&request.path)
                ),
                None,
            )
            .await;
        if !answer.ok() {
            return answer.failure(&format!("reading {}", request.path));
        }
        if let Some(oversized) = answer.oversized(&request.path, MAX_CONTENT_BYTES) {
            return oversized;
        }
        content_of(&answer, &request.path)
    }

    #[tool(
        description = "Write a file into the session's workspace (text, or base64 with encoding=base64), replacing any file at that path. The code can then open it by its relative path."
    )]
    async fn write_file(
        &self,
        Parameters(request): Parameters<WriteFile>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self.target(&parts, request.session_id).await {
            Ok(target) => target,
            Err(error) => return error,
        };
        let bytes = match request.encoding.as_deref() {
            None | Some("utf-8") | Some("utf8") => request.content.into_bytes(),
            Some("base64") => {
                match base64::engine::general_purpose::STANDARD.decode(request.content.trim()) {
                    Ok(bytes) => bytes,
                    Err(error) => return tool_error(format!("content: invalid base64: {error}")),
                }
            }
            Some(other) => {
                return tool_error(format!("unknown encoding {other:?}: utf-8 or base64"))
            }
        };
        let answer = self
            .call(
                &principal,
                Method::PUT,
                &format!(
                    "{}/files/{}",
                    session_path(&id),
                    percent_path(&request.path)
                ),
                Some(("application/octet-stream", bytes)),
            )
            .await;
        if !answer.ok() {
            return answer.failure(&format!("writing {}", request.path));
        }
        let written = answer.json();
        text(format!(
            "wrote {} ({} bytes) in session {id}",
            written["path"].as_str().unwrap_or(&request.path),
            written["bytes"]
        ))
    }

    #[tool(
        description = "Read an artifact a result listed (by its id): images as images; HTML tables, JSON, Markdown, CSV and other text as text."
    )]
    async fn get_artifact(
        &self,
        Parameters(request): Parameters<GetArtifact>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, _) = match caller_of(&parts) {
            Ok(found) => found,
            Err(error) => return error,
        };
        let answer = self
            .call(
                &principal,
                Method::GET,
                &format!("/v1/artifacts/{}", percent(&request.artifact_id)),
                None,
            )
            .await;
        if !answer.ok() {
            return answer.failure("reading the artifact");
        }
        if let Some(oversized) = answer.oversized(&request.artifact_id, MAX_CONTENT_BYTES) {
            return oversized;
        }
        content_of(&answer, &request.artifact_id)
    }

    #[tool(
        description = "Interrupt the code running in the session (its result reports KeyboardInterrupt); variables are kept."
    )]
    async fn interrupt(
        &self,
        Parameters(request): Parameters<SessionOnly>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self.target(&parts, request.session_id).await {
            Ok(target) => target,
            Err(error) => return error,
        };
        let answer = self
            .call(
                &principal,
                Method::POST,
                &format!("{}/interrupt", session_path(&id)),
                None,
            )
            .await;
        if !answer.ok() {
            return answer.failure("interrupting");
        }
        text(format!("interrupted session {id}"))
    }

    #[tool(
        description = "Restart the session's kernel: all variables and workspace files are lost; state_generation changes."
    )]
    async fn restart(
        &self,
        Parameters(request): Parameters<SessionOnly>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self.target(&parts, request.session_id).await {
            Ok(target) => target,
            Err(error) => return error,
        };
        let answer = self
            .call(
                &principal,
                Method::POST,
                &format!("{}/restart", session_path(&id)),
                None,
            )
            .await;
        if !answer.ok() {
            return answer.failure("restarting");
        }
        text(format!(
            "restarted session {id}: variables and files are gone (state_generation {})",
            answer.json()["state_generation"]
        ))
    }

    #[tool(
        description = "Export the session's history as a Jupyter notebook (.ipynb JSON, nbformat 4): every cell run, with its outputs."
    )]
    async fn export_notebook(
        &self,
        Parameters(request): Parameters<SessionOnly>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self.target(&parts, request.session_id).await {
            Ok(target) => target,
            Err(error) => return error,
        };
        let answer = self
            .call(
                &principal,
                Method::GET,
                &format!("{}/notebook", session_path(&id)),
                None,
            )
            .await;
        if !answer.ok() {
            return answer.failure("exporting the notebook");
        }
        if let Some(oversized) = answer.oversized("the notebook", MAX_CONTENT_BYTES) {
            return oversized;
        }
        text(capped(
            &String::from_utf8_lossy(&answer.body),
            MAX_TEXT_CHARS,
        ))
    }
}

#[tool_handler]
impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("cellgate", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Sandboxed Python (Jupyter kernels) with persistent state. Use run_python to \
                 compute, analyse data and make charts; files you write or upload stay in the \
                 session's workspace. Check each result's status; a new state_generation means \
                 earlier variables are gone.",
            )
    }
}

impl Answer {
    fn internal(message: &str) -> Answer {
        Answer {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            content_type: "application/json".to_owned(),
            body: serde_json::to_vec(&json!({"message": message, "code": "internal"}))
                .unwrap_or_default()
                .into(),
            too_large: false,
        }
    }
}

/// The caller of an MCP request: its principal (put there by the authentication layer) and
/// its conversation, the key of its default session.
fn caller_of(
    parts: &axum::http::request::Parts,
) -> Result<(Principal, Conversation), CallToolResult> {
    let Some(principal) = parts.extensions.get::<Principal>().cloned() else {
        // Unreachable behind the authentication layer, which every /mcp request passes.
        return Err(tool_error("the request carries no identity".to_owned()));
    };
    let conversation = parts
        .headers
        .get(MCP_SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let caller = Caller::of(&principal);
    Ok((principal, (caller, conversation)))
}

fn text(text: String) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(text)])
}

fn tool_error(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message)])
}

fn is_image(mime: &str) -> bool {
    matches!(
        mime,
        "image/png" | "image/jpeg" | "image/gif" | "image/webp"
    )
}

/// A file's or artifact's bytes as content: an image, text, or a description.
fn content_of(answer: &Answer, name: &str) -> CallToolResult {
    let mime = answer
        .content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    if answer.body.len() > MAX_CONTENT_BYTES {
        return text(format!(
            "{name}: {mime}, over {MAX_CONTENT_BYTES} bytes: too large to return here; process it with run_python instead"
        ));
    }
    if is_image(&mime) {
        return CallToolResult::success(vec![ContentBlock::image(
            base64::engine::general_purpose::STANDARD.encode(&answer.body),
            mime,
        )]);
    }
    match std::str::from_utf8(&answer.body) {
        Ok(body) => text(capped(body, MAX_TEXT_CHARS)),
        Err(_) => text(format!(
            "{name}: {mime}, {} bytes of binary data (not text); process it with run_python",
            answer.body.len()
        )),
    }
}

/// `text`, cut at `max` characters with a note saying how much was left out.
fn capped(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_owned(),
        Some((cut, _)) => format!(
            "{}\n[… {} more characters not shown]",
            &text[..cut],
            text[cut..].chars().count()
        ),
    }
}

/// API v1's path of session `id` (encoded: an id is the caller's input).
fn session_path(id: &str) -> String {
    format!("/v1/sessions/{}", percent(id))
}

/// A path's segments percent-encoded (its `/` kept), for an API v1 file route.
fn percent_path(path: &str) -> String {
    path.trim_start_matches('/')
        .split('/')
        .map(percent)
        .collect::<Vec<_>>()
        .join("/")
}

/// Everything but unreserved characters percent-encoded (RFC 3986).
fn percent(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// An execution result as a model reads it.
fn describe_execution(id: &str, new: bool, result: &Value) -> String {
    let mut out = format!(
        "status: {}\nsession: {id} (state_generation {}{})\n",
        result["status"].as_str().unwrap_or("?"),
        result["state_generation"],
        if new {
            "; a new session: variables from earlier calls are not here"
        } else {
            ""
        }
    );
    for stream in ["stdout", "stderr"] {
        if let Some(text) = result[stream].as_str().filter(|t| !t.is_empty()) {
            out.push_str(&format!("{stream}:\n{}\n", capped(text, MAX_STREAM_CHARS)));
            if result[format!("{stream}_truncated")] == true {
                out.push_str(&format!("[{stream} was cut by the gateway]\n"));
            }
        }
    }
    if let Some(value) = result["result"].as_str() {
        out.push_str(&format!("result: {}\n", capped(value, MAX_STREAM_CHARS)));
    }
    if let Some(error) = result["error"].as_object() {
        out.push_str(&format!(
            "error: {}: {}\n",
            error.get("ename").and_then(Value::as_str).unwrap_or("?"),
            error.get("evalue").and_then(Value::as_str).unwrap_or("")
        ));
        let traceback: Vec<&str> = error
            .get("traceback")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        if !traceback.is_empty() {
            out.push_str(&format!(
                "traceback:\n{}\n",
                capped(&traceback.join("\n"), MAX_STREAM_CHARS)
            ));
        }
    }
    let artifacts: Vec<&Value> = result["artifacts"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    if !artifacts.is_empty() {
        out.push_str("artifacts:\n");
        for artifact in artifacts {
            out.push_str(&format!(
                "- {} ({}, {} bytes{}): {}\n",
                artifact["id"].as_str().unwrap_or("?"),
                artifact["mime"].as_str().unwrap_or("?"),
                artifact["bytes"],
                artifact["path"]
                    .as_str()
                    .map(|p| format!(", file {p}"))
                    .unwrap_or_default(),
                artifact["summary"].as_str().unwrap_or("")
            ));
        }
    }
    let denials: Vec<&Value> = result["denials"].as_array().into_iter().flatten().collect();
    if !denials.is_empty() {
        out.push_str("denied by the policy:\n");
        for denial in denials {
            out.push_str(&format!(
                "- {} {} (policy {}): {}\n",
                denial["kind"].as_str().unwrap_or("?"),
                denial["target"].as_str().unwrap_or("?"),
                denial["policy"].as_str().unwrap_or("?"),
                denial["reason"].as_str().unwrap_or("")
            ));
        }
    }
    if let Some(omitted) = result["omitted"].as_array().filter(|o| !o.is_empty()) {
        out.push_str(&format!(
            "{} outputs were not stored (quotas)\n",
            omitted.len()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_read_as_text_with_every_part() {
        let result = json!({
            "status": "error", "state_generation": 2, "stdout": "hi\n", "stderr": "",
            "result": null,
            "error": {"ename": "ZeroDivisionError", "evalue": "division by zero",
                      "traceback": ["Traceback", "  1 / 0"]},
            "artifacts": [{"id": "a1", "mime": "image/png", "bytes": 10, "summary": "PNG image 1×1"}],
            "denials": [{"kind": "egress", "target": "x.example:443", "policy": "default", "reason": "not allowed"}],
        });
        let text = describe_execution("s1", true, &result);
        for part in [
            "status: error",
            "session: s1 (state_generation 2; a new session",
            "stdout:\nhi\n",
            "error: ZeroDivisionError: division by zero",
            "traceback:\nTraceback\n  1 / 0",
            "- a1 (image/png, 10 bytes): PNG image 1×1",
            "- egress x.example:443 (policy default): not allowed",
        ] {
            assert!(text.contains(part), "{part:?} missing from:\n{text}");
        }
        assert!(!text.contains("stderr"), "{text}");
    }

    #[test]
    fn long_text_is_cut_and_says_so() {
        assert_eq!(capped("abc", 5), "abc");
        assert_eq!(capped("abcdef", 3), "abc\n[… 3 more characters not shown]");
        assert_eq!(capped("ééé", 2), "éé\n[… 1 more characters not shown]");
    }

    #[test]
    fn paths_are_percent_encoded_by_segment() {
        assert_eq!(percent_path("a b/c?.csv"), "a%20b/c%3F.csv");
        assert_eq!(percent_path("/x/../y"), "x/../y");
        assert_eq!(percent("id/1"), "id%2F1");
    }
}
