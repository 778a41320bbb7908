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
//! **Languages.** `run_code` takes a language (python, typescript/javascript, r, bash: any a
//! kernelspec has) and runs in the caller's session of that language's kernelspec (the
//! default kernelspec's session is `run_python`'s), so one conversation may keep a Python,
//! a Deno and an R session side by side; all end with the conversation.
//!
//! **The caller's session.** `run_python` without a `session_id` runs in the caller's
//! session, created on first use and kept across calls, so an agent's variables and files
//! last through a conversation. "The caller" is the principal and, where the client keeps an
//! MCP session (`Mcp-Session-Id`), that session: two conversations get two kernels. A
//! session that is gone (deleted, culled) is replaced by a fresh one, and the result says
//! its earlier state is gone. Every result names its `session_id`, which any tool accepts.
//! These default sessions are kept in a moka cache keyed by caller and MCP session (idle
//! entries dropped after a day), with one lock per conversation, so parallel first calls
//! make one kernel. An MCP session is its opener's alone, counted against its tenant's cap,
//! and ends with its default session (`conversations.rs`).
//!
//! **Results a model can read.** Text first: status, stdout, stderr, the value, the error
//! and traceback, artifacts with their summaries, denials, `state_generation`. Images (PNG,
//! JPEG, GIF, WebP) come as MCP image content, a few per result and each bounded; other rich
//! outputs as their summary and the artifact id, which `get_artifact` reads as text.
//!
//! **Results a program can read.** The tools whose result is not a file's content also
//! return it as `structuredContent`, typed in [`output`] (whose schemas are their
//! `outputSchema`); the text is rendered from that same value. Every tool carries a title and
//! its hints (read-only, destructive, idempotent, open world), set on each `#[tool]`;
//! `run_python`'s `openWorldHint` is set when the server is built, from whether any policy
//! allows egress or packages. The handler lists the router it holds, not rmcp's default of a
//! fresh one per call, which would drop it. [`oauth`] publishes `/mcp`'s
//! OAuth protected-resource metadata when the gateway names a JWT issuer.

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

use super::api_error::ErrorBody;
use super::auth::Principal;
use super::error_code::ErrorCode;
use super::state::AppState;
use super::v1::kernelspecs::{Kernelspec, Kernelspecs};
use crate::ids::{ArtifactId, SessionId};
use crate::sessions::commands::CommandResult;
use crate::sessions::ExecutionResult;
use conversations::{Caller, Conversation, Conversations, Defaults};
use output::capped;

mod conversations;
pub mod oauth;
mod output;

/// The most bytes of a file or artifact a tool returns (as text or an image).
const MAX_CONTENT_BYTES: usize = 1 << 20;
/// The most text of a file, an artifact or a notebook a tool returns.
const MAX_TEXT_CHARS: usize = 100_000;
/// Callers whose default session is remembered, and for how long after their last call: a
/// caller back after that gets a new session (and is told so), as after a cull.
const DEFAULT_SESSIONS_KEPT: u64 = 100_000;
const DEFAULT_SESSION_IDLE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
/// The most MCP sessions open at once on the gateway (each tenant has its own cap besides).
const MAX_MCP_SESSIONS: usize = 100_000;
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

/// What is mounted at `/mcp` (behind the authentication layer): the MCP service behind
/// [`guard`].
pub fn routes(state: AppState) -> axum::Router {
    let api = super::v1::routes().with_state(state.clone());
    let defaults: Defaults = moka::sync::Cache::builder()
        .max_capacity(DEFAULT_SESSIONS_KEPT)
        .time_to_idle(DEFAULT_SESSION_IDLE)
        .build();
    let mut sessions = LocalSessionManager::default();
    // rmcp ends a session idle this long, counting while a tool runs: longer than any cell
    // a policy lets run, so no result is lost midway and a conversation keeps its kernel.
    sessions.session_config.keep_alive = Some(MCP_SESSION_IDLE);
    let sessions = Arc::new(sessions);
    let closer = sessions.clone();
    let deleter = api.clone();
    let hooks = conversations::Hooks {
        close_mcp_session: Arc::new(move |id| {
            let sessions = closer.clone();
            tokio::spawn(async move {
                use rmcp::transport::streamable_http_server::session::SessionManager as _;
                if let Err(error) = sessions.close_session(&Arc::from(id.as_str())).await {
                    tracing::warn!(mcp_session = %id, %error, "closing an MCP session failed");
                }
            });
        }),
        delete_session: Arc::new(move |principal, session| {
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
        }),
    };
    let conversations = Conversations::new(
        MCP_SESSION_IDLE + MCP_SESSION_MARGIN,
        MAX_MCP_SESSIONS,
        defaults.clone(),
        hooks,
    );
    let tenants = state.tenants.clone();
    let open_world = open_world(state.kernels.policies());
    axum::Router::new()
        .fallback_service(service(api, defaults, sessions, open_world))
        .layer(axum::middleware::from_fn(move |request, next| {
            guard(conversations.clone(), tenants.clone(), request, next)
        }))
}

/// What rmcp leaves to its host (see [`conversations`]):
/// - an MCP session is its opener's: rmcp accepts any request naming a live session id,
///   which would let another caller replay its cached results or end it. A request naming
///   a session this caller did not open (another's, or one unknown here) is handed on with
///   an id that names none, so it is answered exactly as an unknown session is;
/// - opening one is counted against the tenant's cap and the gateway's, and ending one
///   ends its kernel;
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
    let mut own = false;
    match &named {
        Some(id) if !conversations.is_openers(id, &who) => {
            let nobody =
                axum::http::HeaderValue::from_static("00000000-0000-0000-0000-000000000000");
            request.headers_mut().insert(MCP_SESSION_HEADER, nobody);
        }
        Some(_) => own = true,
        None => {}
    }
    let ending = request.method() == Method::DELETE;
    let mut response = next.run(request).await;
    // A session rmcp just opened is counted before its id reaches the client.
    let issued = response
        .headers()
        .get(MCP_SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|_| named.is_none());
    if let Some(issued) = issued {
        let limit = principal
            .tenant()
            .map_or(usize::MAX, |tenant| tenants.max_mcp_sessions(tenant));
        if let Err(err) = conversations.open(issued, &principal, limit) {
            let (status, code) = match err {
                conversations::ConversationError::TooMany { .. } => {
                    (StatusCode::FORBIDDEN, ErrorCode::TenantMcpSessionLimit)
                }
                conversations::ConversationError::Full { .. } => {
                    (StatusCode::SERVICE_UNAVAILABLE, ErrorCode::McpSessionLimit)
                }
            };
            return super::ApiError::new(status, err.to_string())
                .code(code)
                .into_response();
        }
    }
    let status = response.status();
    // The opener's own request ended its session, or found it gone from rmcp (expired a
    // moment before the gateway's record). rmcp answers success to ending a session it does
    // not know, so only the opener's own request, which reached its session, counts.
    if own && ((ending && status.is_success()) || status == StatusCode::NOT_FOUND) {
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
            error.code(ErrorCode::NoSuchMcpSession)
        } else {
            error
        };
        return error.into_response();
    }
    response
}

/// Whether code run through the tools may reach anything beyond the gateway: whether any
/// policy lets its kernels through the egress proxy or install packages (fetched from an
/// index outside). The hint is one per tool, not per caller, so it is the widest any caller
/// could get; with the shipped policies, which allow neither, it is false.
fn open_world(policies: &crate::policy::Policies) -> bool {
    policies
        .iter()
        .any(|policy| !policy.egress.allow.is_empty() || !policy.packages.allow.is_empty())
}

/// The header naming an MCP session.
const MCP_SESSION_HEADER: &str = "mcp-session-id";

/// The MCP service itself.
fn service(
    api: axum::Router,
    defaults: Defaults,
    sessions: Arc<LocalSessionManager>,
    open_world: bool,
) -> StreamableHttpService<Tools, LocalSessionManager> {
    let config = StreamableHttpServerConfig::default()
        // The gateway's edge already checks hosts and origins (a gateway without a token
        // answers loopback names only); with a token, the credential is what protects.
        .disable_allowed_hosts();
    StreamableHttpService::new(
        move || Ok(Tools::new(api.clone(), defaults.clone(), open_world)),
        sessions,
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
    /// The tools, as `tool_handler`'s code lists and calls them.
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
pub struct RunCode {
    /// The code (a notebook cell: the value of its last expression is returned).
    pub code: String,
    /// Its language: `python`, `typescript` or `javascript` (Deno), `r`, `bash`; any
    /// language a kernelspec of the gateway has (case does not matter).
    pub language: String,
    /// Interrupt it after this many seconds (the policy's limit applies as well).
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// A session to run in (its kernel must be of that language); default: the caller's own
    /// session for that language, created on first use.
    #[serde(default)]
    pub session_id: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RunCommand {
    /// The shell command line (run by `bash -c` in the workspace).
    pub cmd: String,
    /// A directory below the workspace to run in.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Kill it after this many seconds (default 60; the policy's limit applies as well).
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

    /// The body read as a `T`; one that does not fit is a tool error naming `what`, so a
    /// result is never built from a guess.
    fn parse<T: serde::de::DeserializeOwned>(&self, what: &str) -> Result<T, CallToolResult> {
        serde_json::from_slice(&self.body).map_err(|error| {
            tool_error(format!(
                "{what}: an answer the tool could not read: {error}"
            ))
        })
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
        let (message, code) = match serde_json::from_slice::<ErrorBody>(&self.body) {
            Ok(body) => (body.message, body.code),
            Err(_) => ("no message".to_owned(), ErrorCode::Error),
        };
        CallToolResult::error(vec![ContentBlock::text(format!(
            "{what} failed: {message} ({} {code})",
            self.status.as_u16()
        ))])
    }
}

#[tool_router]
impl Tools {
    /// `open_world`: some policy lets code reach beyond the gateway (see [`open_world`]).
    fn new(api: axum::Router, defaults: Defaults, open_world: bool) -> Tools {
        let mut tool_router = Self::tool_router();
        for tool in ["run_python", "run_code", "run_command"] {
            if let Some(route) = tool_router.map.get_mut(tool) {
                let annotations = route.attr.annotations.get_or_insert_with(Default::default);
                annotations.open_world_hint = Some(open_world);
            }
        }
        Tools {
            api,
            defaults,
            tool_router,
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
        what: &str,
    ) -> Result<(SessionId, bool), CallToolResult> {
        self.session_of(principal, caller, requested, None, what)
            .await
    }

    /// [`Self::session`] for kernelspec `kernel` (`None`: the gateway's default one): the
    /// caller keeps one default session per kernelspec.
    async fn session_of(
        &self,
        principal: &Principal,
        caller: &Conversation,
        requested: Option<String>,
        kernel: Option<&str>,
        what: &str,
    ) -> Result<(SessionId, bool), CallToolResult> {
        if let Some(text) = requested {
            return match SessionId::parse(&text) {
                Ok(id) => Ok((id, false)),
                // API v1 answers a malformed id as an unknown one (404): asked, it words the
                // tool's error exactly as it did when the id went to it unchecked.
                Err(_) => Err(self
                    .call(principal, Method::GET, &session_path(&text), None)
                    .await
                    .failure(what)),
            };
        }
        let slot = self.defaults.get_with(caller.clone(), Default::default);
        let mut known = slot.lock().await;
        if known.ended {
            return Err(ended_conversation());
        }
        let existing = match kernel {
            None => known.id.clone(),
            Some(kernel) => known.others.get(kernel).cloned(),
        };
        if let Some(id) = existing {
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
        let id = self
            .create_of(principal, known.policy.clone(), kernel)
            .await?;
        match kernel {
            None => known.id = Some(id.clone()),
            Some(kernel) => {
                known.others.insert(kernel.to_owned(), id.clone());
            }
        }
        Ok((id, true))
    }

    /// Who calls (from the request's `parts`) and the session the tool works in (see
    /// [`Self::session`]; `what` the tool does, for its error): the principal, the session's
    /// id, and whether it is new.
    async fn target(
        &self,
        parts: &axum::http::request::Parts,
        requested: Option<String>,
        what: &str,
    ) -> Result<(Principal, SessionId, bool), CallToolResult> {
        let (principal, caller) = caller_of(parts)?;
        let (id, new) = self.session(&principal, &caller, requested, what).await?;
        Ok((principal, id, new))
    }

    /// A new session for `principal`.
    async fn create(
        &self,
        principal: &Principal,
        policy: Option<String>,
    ) -> Result<SessionId, CallToolResult> {
        self.create_of(principal, policy, None).await
    }

    /// A new session for `principal` of kernelspec `kernel` (`None`: the default one).
    async fn create_of(
        &self,
        principal: &Principal,
        policy: Option<String>,
        kernel: Option<&str>,
    ) -> Result<SessionId, CallToolResult> {
        let mut body = json!({});
        if let Some(policy) = policy {
            body["policy"] = json!(policy);
        }
        if let Some(kernel) = kernel {
            body["kernel_name"] = json!(kernel);
        }
        let answer = self
            .call_json(principal, Method::POST, "/v1/sessions", body)
            .await;
        if !answer.ok() {
            return Err(answer.failure("creating a session"));
        }
        Ok(answer.parse::<output::ApiSession>("the new session")?.id)
    }

    #[tool(
        title = "Run Python",
        description = "Run Python code in a sandboxed Jupyter kernel. Variables, imports and files persist across calls in the same session (the caller's own unless session_id is given). Returns the status (ok, error, timeout, oom, denied, output_truncated, sandbox_lost), stdout, stderr, the value of the last expression, the error with its traceback, and rich outputs: images inline, other charts, tables and HTML as artifacts (read one with get_artifact). Network access and package installs follow the session's policy; what it refused is listed under denials. state_generation changes when the kernel's variables were lost (restart, crash, out of memory).",
        // Its code may delete or overwrite anything in the session; whether it reaches the
        // network depends on the policies, so `Tools::new` sets openWorldHint.
        annotations(
            title = "Run Python",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false
        ),
        output_schema = rmcp::handler::server::tool::schema_for_output::<output::Execution>()
    )]
    async fn run_python(
        &self,
        Parameters(request): Parameters<RunPython>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, new) = match self
            .target(&parts, request.session_id, "running the code")
            .await
        {
            Ok(target) => target,
            Err(error) => return error,
        };
        self.execute(&principal, id, new, request.code, request.timeout_s)
            .await
    }

    #[tool(
        title = "Run code",
        description = "Run code in a sandboxed Jupyter kernel of the given language: python, typescript or javascript (Deno; npm: imports as the policy allows), r (with ggplot2, dplyr, readr, tidyr), bash. Each language has its own session per caller (variables, imports and files persist across calls), unless session_id names one of that language. Returns the same result as run_python: status (ok, error, timeout, oom, denied, output_truncated, sandbox_lost), stdout, stderr, the value, the error with its traceback, images inline and other rich outputs as artifacts (get_artifact reads one), denials, state_generation. An unknown language is answered with the languages this gateway has.",
        annotations(
            title = "Run code",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false
        ),
        output_schema = rmcp::handler::server::tool::schema_for_output::<output::Execution>()
    )]
    async fn run_code(
        &self,
        Parameters(request): Parameters<RunCode>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, caller) = match caller_of(&parts) {
            Ok(found) => found,
            Err(error) => return error,
        };
        let (kernel, is_default) = match self.kernel_for(&principal, &request.language).await {
            Ok(found) => found,
            Err(error) => return error,
        };
        // The default kernelspec's session is the one run_python uses.
        let slot = (!is_default).then_some(kernel.name.as_str());
        let requested = request.session_id.clone();
        let (id, new) = match self
            .session_of(
                &principal,
                &caller,
                request.session_id,
                slot,
                "running the code",
            )
            .await
        {
            Ok(found) => found,
            Err(error) => return error,
        };
        if requested.is_some() {
            // A named session must run the language asked for: code of one language run by
            // another's kernel fails in confusing ways.
            let answer = self
                .call(&principal, Method::GET, &session_path(&id), None)
                .await;
            if !answer.ok() {
                return answer.failure("finding the session");
            }
            match answer.parse::<output::ApiSession>("the session") {
                Ok(model) if model.language.eq_ignore_ascii_case(&kernel.language) => {}
                Ok(model) => {
                    return tool_error(format!(
                        "session {id} runs {} ({}), not {}: leave session_id out to use your {} session",
                        model.language, model.kernel_name, request.language, request.language
                    ))
                }
                Err(error) => return error,
            }
        }
        self.execute(&principal, id, new, request.code, request.timeout_s)
            .await
    }

    /// The kernelspec of `language` (`js`/`javascript`/`ts` name Deno's TypeScript, `sh` and
    /// `shell` bash; a kernelspec's own name works too): the gateway's default kernelspec
    /// when it is of that language, else the first by name; and whether it is the default.
    async fn kernel_for(
        &self,
        principal: &Principal,
        language: &str,
    ) -> Result<(Kernelspec, bool), CallToolResult> {
        let answer = self
            .call(principal, Method::GET, "/v1/kernelspecs", None)
            .await;
        if !answer.ok() {
            return Err(answer.failure("listing the languages"));
        }
        let listed = answer.parse::<Kernelspecs>("the kernelspecs")?;
        let wanted = match language.trim().to_ascii_lowercase().as_str() {
            "js" | "javascript" | "ts" | "typescript" | "deno" => "typescript".to_owned(),
            "sh" | "shell" => "bash".to_owned(),
            "py" | "python3" => "python".to_owned(),
            other => other.to_owned(),
        };
        let matches = |spec: &&Kernelspec| {
            spec.language.eq_ignore_ascii_case(&wanted) || spec.name.eq_ignore_ascii_case(&wanted)
        };
        listed
            .kernelspecs
            .iter()
            .filter(matches)
            .find(|spec| spec.name == listed.default)
            .or_else(|| listed.kernelspecs.iter().find(matches))
            .map(|spec| (spec.clone(), spec.name == listed.default))
            .ok_or_else(|| {
                let mut known: Vec<String> = listed
                    .kernelspecs
                    .iter()
                    .map(|spec| spec.language.to_ascii_lowercase())
                    .collect();
                known.sort();
                known.dedup();
                tool_error(format!(
                    "no kernel for language {language:?} here; this gateway runs: {}",
                    known.join(", ")
                ))
            })
    }

    /// Runs `code` in session `id` through API v1 and renders its result, images inline.
    async fn execute(
        &self,
        principal: &Principal,
        id: SessionId,
        new: bool,
        code: String,
        timeout_s: Option<f64>,
    ) -> CallToolResult {
        let principal = principal.clone();
        let mut body = json!({"code": code});
        if let Some(timeout) = timeout_s {
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
        let execution = match answer.parse::<ExecutionResult>("the result") {
            Ok(read) => output::Execution::new(id, new, read),
            Err(error) => return error,
        };
        let mut images = Vec::new();
        for artifact in &execution.artifacts {
            if !is_image(&artifact.mime)
                || artifact.bytes > MAX_CONTENT_BYTES as u64
                || images.len() == MAX_IMAGES
            {
                continue;
            }
            let fetched = self
                .call(
                    &principal,
                    Method::GET,
                    &format!("/v1/artifacts/{}", artifact.id),
                    None,
                )
                .await;
            if fetched.ok() && fetched.body.len() <= MAX_CONTENT_BYTES {
                images.push(ContentBlock::image(
                    base64::engine::general_purpose::STANDARD.encode(&fetched.body),
                    artifact.mime.clone(),
                ));
            }
        }
        structured(&execution, images)
    }

    #[tool(
        title = "Run a shell command",
        description = "Run a shell command (bash) in the session's sandbox, in its workspace: the same files, user, limits and network policy as the Python code (pip, ls, git, unzip, a script...). Returns the status (ok for exit code 0, error, timeout, oom, denied, sandbox_lost), the exit code or signal, stdout and stderr. It runs after any running code and does not change the Python variables.",
        annotations(
            title = "Run a shell command",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false
        ),
        output_schema = rmcp::handler::server::tool::schema_for_output::<output::Command>()
    )]
    async fn run_command(
        &self,
        Parameters(request): Parameters<RunCommand>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, new) = match self
            .target(&parts, request.session_id, "running the command")
            .await
        {
            Ok(target) => target,
            Err(error) => return error,
        };
        let mut body = json!({"cmd": request.cmd});
        if let Some(cwd) = request.cwd {
            body["cwd"] = json!(cwd);
        }
        if let Some(timeout) = request.timeout_s {
            body["timeout_s"] = json!(timeout);
        }
        let answer = self
            .call_bounded(
                &principal,
                Method::POST,
                &format!("{}/commands", session_path(&id)),
                Some((
                    "application/json",
                    serde_json::to_vec(&body).unwrap_or_default(),
                )),
                MAX_RESULT_BYTES,
            )
            .await;
        if let Some(oversized) = answer.oversized("the result", MAX_RESULT_BYTES) {
            return oversized;
        }
        if !answer.ok() {
            return answer.failure("running the command");
        }
        match answer.parse::<CommandResult>("the result") {
            Ok(read) => structured(&output::Command::new(id, new, read), vec![]),
            Err(error) => error,
        }
    }

    #[tool(
        title = "New session",
        description = "Start over: a fresh session (a new kernel, empty workspace) becomes the caller's own; the old one is shut down. Optionally under another policy.",
        annotations(
            title = "New session",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false,
            open_world_hint = false
        ),
        output_schema = rmcp::handler::server::tool::schema_for_output::<output::NewSession>()
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
        let slot = self.defaults.get_with(caller.clone(), Default::default);
        let mut known = slot.lock().await;
        if known.ended {
            return ended_conversation();
        }
        let id = match self.create(&principal, request.policy.clone()).await {
            Ok(id) => id,
            Err(error) => return error,
        };
        let old = known.id.replace(id.clone());
        // The conversation's sessions of other languages start afresh too, under the new
        // policy when run_code next needs them.
        let others = std::mem::take(&mut known.others);
        known.policy = request.policy;
        drop(known);
        if let Some(old) = &old {
            self.call(&principal, Method::DELETE, &session_path(old), None)
                .await;
        }
        for other in others.values() {
            self.call(&principal, Method::DELETE, &session_path(other), None)
                .await;
        }
        let answer = self
            .call(&principal, Method::GET, &session_path(&id), None)
            .await;
        if !answer.ok() {
            return answer.failure("reading the new session");
        }
        let model = match answer.parse::<output::ApiSession>("the new session") {
            Ok(model) => model,
            Err(error) => return error,
        };
        structured(
            &output::NewSession {
                session_id: id,
                policy: model.policy,
                sandbox: model.sandbox,
                state_generation: model.state_generation,
                replaced: old,
            },
            vec![],
        )
    }

    #[tool(
        title = "List workspace files",
        description = "List the files and directories of the session's workspace (the kernel's working directory), or of one directory in it.",
        annotations(
            title = "List workspace files",
            read_only_hint = true,
            open_world_hint = false
        ),
        output_schema = rmcp::handler::server::tool::schema_for_output::<output::FileList>()
    )]
    async fn list_files(
        &self,
        Parameters(request): Parameters<ListFiles>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self
            .target(&parts, request.session_id, "listing the files")
            .await
        {
            Ok(target) => target,
            Err(error) => return error,
        };
        let dir = request.dir.unwrap_or_default();
        let mut path = format!("{}/files", session_path(&id));
        if !dir.is_empty() {
            path.push_str(&format!("?dir={}", percent(&dir)));
        }
        let answer = self.call(&principal, Method::GET, &path, None).await;
        if !answer.ok() {
            return answer.failure("listing the files");
        }
        let files = match answer.parse::<Vec<super::v1::files::ListedFile>>("the listing") {
            Ok(files) => files.into_iter().map(output::ListedFile::from).collect(),
            Err(error) => return error,
        };
        structured(
            &output::FileList {
                session_id: id,
                dir,
                files,
            },
            vec![],
        )
    }

    #[tool(
        title = "Read a workspace file",
        description = "Read a file of the session's workspace: text as text, images as images; other binary files are described, not returned.",
        annotations(
            title = "Read a workspace file",
            read_only_hint = true,
            open_world_hint = false
        )
    )]
    async fn read_file(
        &self,
        Parameters(request): Parameters<ReadFile>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self
            .target(
                &parts,
                request.session_id,
                &format!("reading {}", request.path),
            )
            .await
        {
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
        title = "Write a workspace file",
        description = "Write a file into the session's workspace (text, or base64 with encoding=base64), replacing any file at that path. The code can then open it by its relative path.",
        // Replaces what was at the path; writing the same content again changes nothing.
        annotations(
            title = "Write a workspace file",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        ),
        output_schema = rmcp::handler::server::tool::schema_for_output::<output::Written>()
    )]
    async fn write_file(
        &self,
        Parameters(request): Parameters<WriteFile>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self
            .target(
                &parts,
                request.session_id,
                &format!("writing {}", request.path),
            )
            .await
        {
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
        let written = match answer.parse::<super::v1::files::Uploaded>("the upload's answer") {
            Ok(written) => written,
            Err(error) => return error,
        };
        structured(
            &output::Written {
                session_id: id,
                path: written.path,
                bytes: written.bytes,
            },
            vec![],
        )
    }

    #[tool(
        title = "Read an artifact",
        description = "Read an artifact a result listed (by its id): images as images; HTML tables, JSON, Markdown, CSV and other text as text.",
        annotations(
            title = "Read an artifact",
            read_only_hint = true,
            open_world_hint = false
        )
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
        let path = match ArtifactId::parse(&request.artifact_id) {
            Ok(id) => format!("/v1/artifacts/{id}"),
            // API v1 answers a malformed id as an unknown one (404), in its own words.
            Err(_) => format!("/v1/artifacts/{}", percent(&request.artifact_id)),
        };
        let answer = self.call(&principal, Method::GET, &path, None).await;
        if !answer.ok() {
            return answer.failure("reading the artifact");
        }
        if let Some(oversized) = answer.oversized(&request.artifact_id, MAX_CONTENT_BYTES) {
            return oversized;
        }
        content_of(&answer, &request.artifact_id)
    }

    #[tool(
        title = "Interrupt",
        description = "Interrupt the code running in the session (its result reports KeyboardInterrupt); variables are kept.",
        // It ends the running cell's work, but no state: a second interrupt finds nothing
        // more to stop.
        annotations(
            title = "Interrupt",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        ),
        output_schema = rmcp::handler::server::tool::schema_for_output::<output::SessionAction>()
    )]
    async fn interrupt(
        &self,
        Parameters(request): Parameters<SessionOnly>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self
            .target(&parts, request.session_id, "interrupting")
            .await
        {
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
        structured(
            &output::SessionAction {
                session_id: id,
                action: output::Action::Interrupted,
                state_generation: None,
            },
            vec![],
        )
    }

    #[tool(
        title = "Restart the kernel",
        description = "Restart the session's kernel: all variables and workspace files are lost; state_generation changes.",
        annotations(
            title = "Restart the kernel",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false,
            open_world_hint = false
        ),
        output_schema = rmcp::handler::server::tool::schema_for_output::<output::SessionAction>()
    )]
    async fn restart(
        &self,
        Parameters(request): Parameters<SessionOnly>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self.target(&parts, request.session_id, "restarting").await {
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
        let model = match answer.parse::<output::ApiSession>("the restarted session") {
            Ok(model) => model,
            Err(error) => return error,
        };
        structured(
            &output::SessionAction {
                session_id: id,
                action: output::Action::Restarted,
                state_generation: Some(model.state_generation),
            },
            vec![],
        )
    }

    #[tool(
        title = "Export the notebook",
        description = "Export the session's history as a Jupyter notebook (.ipynb JSON, nbformat 4): every cell run, with its outputs.",
        annotations(
            title = "Export the notebook",
            read_only_hint = true,
            open_world_hint = false
        )
    )]
    async fn export_notebook(
        &self,
        Parameters(request): Parameters<SessionOnly>,
        Extension(parts): Extension<axum::http::request::Parts>,
    ) -> CallToolResult {
        let (principal, id, _) = match self
            .target(&parts, request.session_id, "exporting the notebook")
            .await
        {
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

// The router this server holds (not a fresh one per call, rmcp's default): its tools carry
// the hints `Tools::new` set.
#[tool_handler(router = self.tool_router)]
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
            body: serde_json::to_vec(&ErrorBody {
                reason: "Internal Server Error".to_owned(),
                message: message.to_owned(),
                code: ErrorCode::Internal,
                quota: None,
            })
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

/// The answer to a tool call racing its conversation's end.
fn ended_conversation() -> CallToolResult {
    tool_error("this MCP session has ended; open a new one to go on".to_owned())
}

fn text(text: String) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(text)])
}

/// A result whose text (then `more`, such as images) and `structuredContent` are one value:
/// the text is rendered from it, so the two cannot disagree.
fn structured<T: serde::Serialize + std::fmt::Display>(
    value: &T,
    more: Vec<ContentBlock>,
) -> CallToolResult {
    let structured = match serde_json::to_value(value) {
        Ok(structured) => structured,
        Err(error) => return tool_error(format!("a result the tool could not write: {error}")),
    };
    let mut content = vec![ContentBlock::text(value.to_string())];
    content.extend(more);
    let mut result = CallToolResult::success(content);
    result.structured_content = Some(structured);
    result
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

/// API v1's path of session `id` (encoded: a malformed id is the caller's input, sent on
/// as it came).
fn session_path(id: &(impl AsRef<str> + ?Sized)) -> String {
    format!("/v1/sessions/{}", percent(id.as_ref()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_percent_encoded_by_segment() {
        assert_eq!(percent_path("a b/c?.csv"), "a%20b/c%3F.csv");
        assert_eq!(percent_path("/x/../y"), "x/../y");
        assert_eq!(percent("id/1"), "id%2F1");
    }
}
