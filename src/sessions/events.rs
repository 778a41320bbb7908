//! The typed events and results of API v1, as they go over SSE, the session WebSocket and
//! the blocking execute. Serialised with `type` as the tag; the JSON schema is documented in
//! the OpenAPI document (`/v1/openapi.json`) and in docs/api-v1.md.

use serde::{Deserialize, Serialize};

use crate::artifacts::links::LinkSigner;
use crate::artifacts::{Artifact, Quota};
use crate::ids::{ArtifactId, ExecutionId};
use crate::policy::Denial;

/// A reference to an artifact: what a client (or a language model) needs instead of the
/// bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ArtifactRef {
    #[schema(value_type = String)]
    pub id: ArtifactId,
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
    #[schema(value_type = Option<String>)]
    pub previous: Option<ArtifactId>,
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

impl ExecutionResult {
    /// The result of an execution whose sandbox (or the gateway holding it) was lost: status
    /// `sandbox_lost`, no output, the error saying why.
    pub fn lost(
        execution_id: ExecutionId,
        state_generation: u64,
        ename: &str,
        evalue: String,
    ) -> ExecutionResult {
        ExecutionResult {
            execution_id,
            status: Status::SandboxLost,
            execution_count: None,
            stdout: String::new(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            output_truncated: false,
            result: None,
            error: Some(ExecError {
                ename: ename.to_owned(),
                evalue,
                traceback: Vec::new(),
            }),
            artifacts: Vec::new(),
            omitted: Vec::new(),
            denials: Vec::new(),
            duration_ms: 0,
            state_generation,
            resources: Resources::default(),
            restored: false,
        }
    }
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExecError {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

/// An output that is not in `artifacts`, and why: past a quota (named in `quota`), or not
/// decodable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExecutionResult {
    #[schema(value_type = String)]
    pub execution_id: ExecutionId,
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
    #[schema(value_type = Vec<serde_json::Value>)]
    pub denials: Vec<Denial>,
    pub duration_ms: u64,
    /// Changes whenever the kernel's variables were lost (restart, crash, OOM).
    pub state_generation: u64,
    pub resources: Resources,
    /// The session had been hibernated (saved to disk while idle) and was restored for
    /// this execution, its variables intact (the generation is the same). Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restored: bool,
}

/// One event of a session: the stream of an execution, or the kernel's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SessionEvent {
    /// The execution was sent to the kernel.
    Started {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
        code: String,
    },
    Stream {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
        name: String,
        text: String,
    },
    Display {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
        #[serde(skip_serializing_if = "Option::is_none")]
        display_id: Option<String>,
        /// The bundle's `text/plain`.
        #[serde(skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        artifacts: Vec<ArtifactRef>,
    },
    UpdateDisplay {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
        display_id: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        artifacts: Vec<ArtifactRef>,
    },
    ClearOutput {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
        wait: bool,
    },
    Result {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
        execution_count: Option<i64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        artifacts: Vec<ArtifactRef>,
    },
    Error {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
        ename: String,
        evalue: String,
        traceback: Vec<String>,
    },
    InputRequest {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
        prompt: String,
        password: bool,
    },
    Done {
        #[schema(value_type = String)]
        execution_id: ExecutionId,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum KernelPhase {
    Starting,
    Restarting,
    Ready,
    Dead,
    Terminated,
    /// Saved to disk while idle; restored (`ready`, same generation) by the next request.
    Hibernated,
}

impl SessionEvent {
    /// The execution the event is of (`None`: the kernel's news).
    pub fn execution_id(&self) -> Option<&ExecutionId> {
        match self {
            SessionEvent::Started { execution_id, .. }
            | SessionEvent::Stream { execution_id, .. }
            | SessionEvent::Display { execution_id, .. }
            | SessionEvent::UpdateDisplay { execution_id, .. }
            | SessionEvent::ClearOutput { execution_id, .. }
            | SessionEvent::Result { execution_id, .. }
            | SessionEvent::Error { execution_id, .. }
            | SessionEvent::InputRequest { execution_id, .. }
            | SessionEvent::Done { execution_id, .. } => Some(execution_id),
            SessionEvent::Kernel { .. } => None,
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::DenialKind;

    /// `value` as API v1 sends it, read back as a client of the crate reads it.
    fn round_trip<T>(value: &T) -> T
    where
        T: Serialize + serde::de::DeserializeOwned,
    {
        serde_json::from_slice(&serde_json::to_vec(value).unwrap()).unwrap()
    }

    fn execution_id() -> ExecutionId {
        ExecutionId::parse("0123456789abcdef0123456789abcdef").unwrap()
    }

    fn artifact(previous: Option<ArtifactId>) -> ArtifactRef {
        ArtifactRef {
            id: ArtifactId::random(),
            url: "v1/artifacts/x".into(),
            mime: "image/png".into(),
            bytes: 7,
            width: Some(2),
            height: None,
            summary: "a chart".into(),
            display_id: Some("d".into()),
            version: 2,
            previous,
            path: None,
            signed_url: Some("v1/artifacts/x/signed?e=1".into()),
            signed_url_expires: Some("2026-01-01T00:00:00.000000Z".into()),
        }
    }

    fn result() -> ExecutionResult {
        ExecutionResult {
            execution_id: execution_id(),
            status: Status::Denied,
            execution_count: Some(3),
            stdout: "out".into(),
            stderr: String::new(),
            stdout_truncated: true,
            stderr_truncated: false,
            output_truncated: true,
            result: None,
            error: Some(ExecError {
                ename: "E".into(),
                evalue: "v".into(),
                traceback: vec!["t".into()],
            }),
            artifacts: vec![artifact(None), artifact(Some(ArtifactId::random()))],
            omitted: vec![Omitted {
                mime: "text/html".into(),
                bytes: 9,
                path: Some("outputs/a.html".into()),
                reason: "quota".into(),
                quota: Some(Quota::ArtifactsPerSession),
            }],
            denials: vec![Denial {
                kind: DenialKind::Package,
                target: "numpy".into(),
                policy: "default".into(),
                reason: "not allowed".into(),
            }],
            duration_ms: 12,
            state_generation: 4,
            resources: Resources {
                cpu_time_ms: Some(1),
                memory_peak_bytes: None,
                memory_bytes: Some(2),
            },
            restored: true,
        }
    }

    #[test]
    fn results_and_events_read_back_as_they_were_sent() {
        let result = result();
        assert_eq!(round_trip(&result), result);
        let events = [
            SessionEvent::Started {
                execution_id: execution_id(),
                code: "1".into(),
            },
            SessionEvent::Stream {
                execution_id: execution_id(),
                name: "stdout".into(),
                text: "x".into(),
            },
            SessionEvent::Display {
                execution_id: execution_id(),
                display_id: None,
                text: Some("t".into()),
                artifacts: vec![artifact(None)],
            },
            SessionEvent::UpdateDisplay {
                execution_id: execution_id(),
                display_id: Some("d".into()),
                text: None,
                artifacts: vec![],
            },
            SessionEvent::ClearOutput {
                execution_id: execution_id(),
                wait: true,
            },
            SessionEvent::Result {
                execution_id: execution_id(),
                execution_count: None,
                text: Some("2".into()),
                artifacts: vec![],
            },
            SessionEvent::Error {
                execution_id: execution_id(),
                ename: "E".into(),
                evalue: "v".into(),
                traceback: vec![],
            },
            SessionEvent::InputRequest {
                execution_id: execution_id(),
                prompt: "?".into(),
                password: false,
            },
            SessionEvent::Done {
                execution_id: execution_id(),
                result: Box::new(result),
            },
            SessionEvent::Kernel {
                state: KernelPhase::Restarting,
                state_generation: 5,
                reason: Some("oom".into()),
            },
        ];
        for event in events {
            assert_eq!(round_trip(&event), event, "{}", event.kind());
        }
    }

    #[test]
    fn a_result_naming_an_id_of_another_shape_is_refused() {
        let mut wire = serde_json::to_value(result()).unwrap();
        wire["execution_id"] = "e1".into();
        let refused = serde_json::from_value::<ExecutionResult>(wire).unwrap_err();
        assert!(
            refused.to_string().contains("not an execution id"),
            "{refused}"
        );
    }

    #[test]
    fn the_gateways_request_ids_are_execution_ids() {
        // An execution's id is its execute_request's msg_id (sessions::request_id).
        let message = crate::protocol::Message::new(
            crate::protocol::Channel::Shell,
            "execute_request",
            "session",
            None,
            &serde_json::json!({}),
        );
        assert!(ExecutionId::parse(message.msg_id()).is_ok());
        assert!(crate::ids::CommandId::parse(message.msg_id()).is_ok());
    }
}
