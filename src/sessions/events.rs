//! The typed events and results of API v1, as they go over SSE, the session WebSocket and
//! the blocking execute. Serialised with `type` as the tag; the JSON schema is documented in
//! the OpenAPI document (`/v1/openapi.json`) and in docs/api-v1.md.

use serde::Serialize;
use serde_json::Value;

use crate::artifacts::links::LinkSigner;
use crate::artifacts::{Artifact, Quota};

/// A reference to an artifact: what a client (or a language model) needs instead of the
/// bytes.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ArtifactRef {
    pub id: String,
    /// Relative to the gateway's base URL.
    pub url: String,
    pub mime: String,
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    pub summary: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub display_id: Option<String>,
    pub version: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The same bytes with no credential, for a page's `<img src>` (relative to the gateway's
    /// base URL): signed for this artifact, valid until `signed_url_expires` and while the
    /// session is not deleted (`crate::artifacts::links`). Absent when the gateway signs no links.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signed_url: Option<String>,
    /// When `signed_url` stops working (RFC 3339, UTC).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signed_url_expires: Option<String>,
}

impl ArtifactRef {
    /// The reference to `artifact`, with a signed link when `links` is given.
    pub fn new(artifact: &Artifact, base_url: &str, links: Option<&LinkSigner>) -> ArtifactRef {
        let link = links.map(|signer| signer.sign(artifact, base_url));
        ArtifactRef {
            id: artifact.id.clone(),
            url: format!("{base_url}v1/artifacts/{}", artifact.id),
            signed_url_expires: link.as_ref().map(|l| expiry_timestamp(l.expires)),
            signed_url: link.map(|l| l.url),
            mime: artifact.mime.clone(),
            bytes: artifact.bytes,
            width: artifact.width,
            height: artifact.height,
            summary: artifact.summary.clone(),
            display_id: artifact.display_id.clone(),
            version: artifact.version,
            previous: artifact.previous.clone(),
            path: artifact.path.clone(),
        }
    }
}

/// Unix seconds as the gateway writes timestamps.
pub fn expiry_timestamp(unix: u64) -> String {
    let at = i64::try_from(unix)
        .ok()
        .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    crate::timestamp::format_timestamp(at)
}

/// The error of a failed execution; the traceback has no ANSI colour codes.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ExecError {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

/// An output that is not in `artifacts`, and why: past a quota (named in `quota`), or not
/// decodable.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Omitted {
    pub mime: String,
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    pub reason: String,
    /// The quota that left it out: `artifact_size`, `artifacts_per_session`,
    /// `artifacts_per_tenant` or `artifact_min_free_disk`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quota: Option<Quota>,
}

/// Resource use of the sandbox during one execution, where measurable.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct Resources {
    /// CPU time of the whole sandbox during the execution.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_time_ms: Option<u64>,
    /// The sandbox's peak memory since it started (the kernel's process lifetime).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_peak_bytes: Option<u64>,
    /// The sandbox's memory when the execution ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
}

/// How an execution ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    Error,
    Timeout,
    Oom,
    Denied,
    OutputTruncated,
    SandboxLost,
}

/// The result of one execution.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ExecutionResult {
    pub execution_id: String,
    pub status: Status,
    pub execution_count: Option<i64>,
    /// Capped (see `stdout_truncated`); the complete stream went out as events.
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// The policy's per-cell output limit cut the output off (the kernel kept running).
    pub output_truncated: bool,
    /// `text/plain` of the execute_result.
    pub result: Option<String>,
    pub error: Option<ExecError>,
    pub artifacts: Vec<ArtifactRef>,
    /// Outputs left out of `artifacts` (never silently).
    pub omitted: Vec<Omitted>,
    /// Policy denials (egress, packages) caused by this execution.
    pub denials: Vec<Value>,
    pub duration_ms: u64,
    /// Changes whenever the kernel's variables were lost (restart, crash, OOM).
    pub state_generation: u64,
    pub resources: Resources,
}

/// One event of a session: the stream of an execution, or the kernel's state.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SessionEvent {
    /// The execution was sent to the kernel.
    Started {
        execution_id: String,
        code: String,
    },
    Stream {
        execution_id: String,
        name: String,
        text: String,
    },
    Display {
        execution_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        display_id: Option<String>,
        /// The bundle's `text/plain`.
        #[serde(skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        artifacts: Vec<ArtifactRef>,
    },
    UpdateDisplay {
        execution_id: String,
        display_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        artifacts: Vec<ArtifactRef>,
    },
    ClearOutput {
        execution_id: String,
        wait: bool,
    },
    Result {
        execution_id: String,
        execution_count: Option<i64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        artifacts: Vec<ArtifactRef>,
    },
    Error {
        execution_id: String,
        ename: String,
        evalue: String,
        traceback: Vec<String>,
    },
    InputRequest {
        execution_id: String,
        prompt: String,
        password: bool,
    },
    Done {
        execution_id: String,
        result: Box<ExecutionResult>,
    },
    /// The kernel's state changed outside an execution (restart, death).
    Kernel {
        state: KernelPhase,
        state_generation: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}

/// A session's kernel's life, as its subscribers are told of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum KernelPhase {
    Starting,
    Restarting,
    Ready,
    Dead,
    Terminated,
}

impl SessionEvent {
    /// The name used as the SSE `event:` field.
    pub fn kind(&self) -> &'static str {
        match self {
            SessionEvent::Started { .. } => "started",
            SessionEvent::Stream { .. } => "stream",
            SessionEvent::Display { .. } => "display",
            SessionEvent::UpdateDisplay { .. } => "update_display",
            SessionEvent::ClearOutput { .. } => "clear_output",
            SessionEvent::Result { .. } => "result",
            SessionEvent::Error { .. } => "error",
            SessionEvent::InputRequest { .. } => "input_request",
            SessionEvent::Done { .. } => "done",
            SessionEvent::Kernel { .. } => "kernel",
        }
    }
}
