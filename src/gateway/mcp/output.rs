//! What the tools return to programs: one typed value per tool, sent as the result's
//! `structuredContent`, whose JSON schema (derived by schemars from the type) is the tool's
//! `outputSchema` (MCP 2025-06-18).
//!
//! The text a model reads is rendered from the same value (`Display`), never from the API v1
//! answer beside it, so a structured field cannot disagree with the text: whatever a cap cut
//! from one is cut from the other, and says so in both. Values are read from API v1's JSON
//! answers into these types first; an answer that does not fit is a tool error, never a
//! half-filled result. They are read as API v1's own types (`ExecutionResult`,
//! `CommandResult`, `SessionModel`), so a field renamed there fails to compile here.

use std::fmt;

use rmcp::schemars;
use serde::{Deserialize, Serialize};

use crate::ids::{ArtifactId, SessionId};
use crate::sessions::commands::CommandResult;
use crate::sessions::{ArtifactRef, ExecutionResult, Status};

/// The most characters of one stream, value or traceback a result quotes.
pub const MAX_STREAM_CHARS: usize = 20_000;

/// How an execution ended: API v1's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionStatus {
    Ok,
    Error,
    Timeout,
    Oom,
    Denied,
    OutputTruncated,
    SandboxLost,
}

// Exhaustive both ways: a status API v1 adds fails to compile until it has a name here.
impl From<Status> for ExecutionStatus {
    fn from(status: Status) -> ExecutionStatus {
        match status {
            Status::Ok => ExecutionStatus::Ok,
            Status::Error => ExecutionStatus::Error,
            Status::Timeout => ExecutionStatus::Timeout,
            Status::Oom => ExecutionStatus::Oom,
            Status::Denied => ExecutionStatus::Denied,
            Status::OutputTruncated => ExecutionStatus::OutputTruncated,
            Status::SandboxLost => ExecutionStatus::SandboxLost,
        }
    }
}

impl ExecutionStatus {
    fn as_str(self) -> &'static str {
        match self {
            ExecutionStatus::Ok => "ok",
            ExecutionStatus::Error => "error",
            ExecutionStatus::Timeout => "timeout",
            ExecutionStatus::Oom => "oom",
            ExecutionStatus::Denied => "denied",
            ExecutionStatus::OutputTruncated => "output_truncated",
            ExecutionStatus::SandboxLost => "sandbox_lost",
        }
    }
}

/// `run_python`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Execution {
    pub status: ExecutionStatus,
    /// The session the code ran in; any tool takes it as `session_id`.
    #[schemars(with = "String")]
    pub session_id: SessionId,
    /// The session was made for this call: variables from earlier calls are not in it.
    pub new_session: bool,
    /// Changes whenever the kernel's variables were lost (restart, crash, out of memory).
    pub state_generation: u64,
    /// What the code printed, at most 20 000 characters.
    pub stdout: String,
    /// More was printed than `stdout` holds (cut by the gateway or by this tool).
    pub stdout_truncated: bool,
    pub stderr: String,
    pub stderr_truncated: bool,
    /// The value of the last expression (`text/plain`), cut at 20 000 characters with a note
    /// saying how many more there were.
    pub result: Option<String>,
    pub error: Option<ExecutionError>,
    /// Rich outputs stored apart (images, HTML, charts…): `get_artifact` reads one.
    pub artifacts: Vec<ArtifactSummary>,
    /// What the session's policy refused the code (network, packages).
    pub denials: Vec<Denial>,
    /// How many outputs were not stored (past a quota).
    pub omitted: usize,
}

/// The error a failed execution raised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ExecutionError {
    pub ename: String,
    pub evalue: String,
    /// Without colour codes; at most 20 000 characters in all (the last line then says how
    /// many more there were).
    pub traceback: Vec<String>,
}

/// An artifact as a result lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ArtifactSummary {
    /// What `get_artifact` takes.
    #[schemars(with = "String")]
    pub id: ArtifactId,
    pub mime: String,
    pub bytes: u64,
    /// One line saying what it is (`PNG image 640×480`, `HTML table 3×2`…).
    pub summary: String,
    /// The workspace file it was made from, for files written under `outputs/`.
    #[serde(default)]
    pub path: Option<String>,
}

/// Something a policy refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Denial {
    /// `egress` or `package`.
    pub kind: String,
    /// The host and port, URL or package asked for.
    pub target: String,
    pub policy: String,
    pub reason: String,
}

impl From<ArtifactRef> for ArtifactSummary {
    fn from(artifact: ArtifactRef) -> ArtifactSummary {
        ArtifactSummary {
            id: artifact.id,
            mime: artifact.mime,
            bytes: artifact.bytes,
            summary: artifact.summary,
            path: artifact.path,
        }
    }
}

impl From<crate::policy::Denial> for Denial {
    fn from(denial: crate::policy::Denial) -> Denial {
        Denial {
            kind: denial.kind.as_str().to_owned(),
            target: denial.target,
            policy: denial.policy,
            reason: denial.reason,
        }
    }
}

impl Execution {
    /// The result of `answer`, run in session `session_id` (`new_session`: made for this call),
    /// with every text capped as the model will read it.
    pub fn new(session_id: SessionId, new_session: bool, answer: ExecutionResult) -> Execution {
        let (stdout, stdout_cut) = cut(&answer.stdout, MAX_STREAM_CHARS);
        let (stderr, stderr_cut) = cut(&answer.stderr, MAX_STREAM_CHARS);
        Execution {
            status: answer.status.into(),
            session_id,
            new_session,
            state_generation: answer.state_generation,
            stdout,
            stdout_truncated: answer.stdout_truncated || stdout_cut,
            stderr,
            stderr_truncated: answer.stderr_truncated || stderr_cut,
            result: answer.result.map(|value| capped(&value, MAX_STREAM_CHARS)),
            error: answer.error.map(|error| ExecutionError {
                traceback: capped_lines(&error.traceback, MAX_STREAM_CHARS),
                ename: error.ename,
                evalue: error.evalue,
            }),
            artifacts: answer.artifacts.into_iter().map(Into::into).collect(),
            denials: answer.denials.into_iter().map(Into::into).collect(),
            omitted: answer.omitted.len(),
        }
    }
}

impl fmt::Display for Execution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "status: {}", self.status.as_str())?;
        writeln!(
            f,
            "session: {} (state_generation {}{})",
            self.session_id,
            self.state_generation,
            if self.new_session {
                "; a new session: variables from earlier calls are not here"
            } else {
                ""
            }
        )?;
        write_streams(
            f,
            (&self.stdout, self.stdout_truncated),
            (&self.stderr, self.stderr_truncated),
        )?;
        if let Some(value) = &self.result {
            writeln!(f, "result: {value}")?;
        }
        if let Some(error) = &self.error {
            writeln!(f, "error: {}: {}", error.ename, error.evalue)?;
            if !error.traceback.is_empty() {
                writeln!(f, "traceback:\n{}", error.traceback.join("\n"))?;
            }
        }
        if !self.artifacts.is_empty() {
            writeln!(f, "artifacts:")?;
            for artifact in &self.artifacts {
                let file = artifact
                    .path
                    .as_deref()
                    .map(|p| format!(", file {p}"))
                    .unwrap_or_default();
                writeln!(
                    f,
                    "- {} ({}, {} bytes{file}): {}",
                    artifact.id, artifact.mime, artifact.bytes, artifact.summary
                )?;
            }
        }
        if !self.denials.is_empty() {
            writeln!(f, "denied by the policy:")?;
            for denial in &self.denials {
                writeln!(
                    f,
                    "- {} {} (policy {}): {}",
                    denial.kind, denial.target, denial.policy, denial.reason
                )?;
            }
        }
        if self.omitted > 0 {
            writeln!(f, "{} outputs were not stored (quotas)", self.omitted)?;
        }
        Ok(())
    }
}

/// `run_command`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Command {
    /// `ok` (exit 0), `error` (another exit code, a signal, or it could not start),
    /// `timeout`, `oom`, `denied`, `sandbox_lost`.
    pub status: ExecutionStatus,
    #[schemars(with = "String")]
    pub session_id: SessionId,
    /// The session was made for this call.
    pub new_session: bool,
    pub exit_code: Option<i32>,
    /// The signal that ended it (`SIGKILL` after the timeout).
    pub signal: Option<String>,
    /// What it printed, at most 20 000 characters.
    pub stdout: String,
    pub stdout_truncated: bool,
    pub stderr: String,
    pub stderr_truncated: bool,
    /// Why it could not run, or what ended it early.
    pub error: Option<String>,
    pub denials: Vec<Denial>,
}

impl Command {
    /// The result of `answer`, with every text capped as the model will read it.
    pub fn new(session_id: SessionId, new_session: bool, answer: CommandResult) -> Command {
        let (stdout, stdout_cut) = cut(&answer.stdout, MAX_STREAM_CHARS);
        let (stderr, stderr_cut) = cut(&answer.stderr, MAX_STREAM_CHARS);
        Command {
            status: answer.status.into(),
            session_id,
            new_session,
            exit_code: answer.exit_code,
            signal: answer.signal,
            stdout,
            stdout_truncated: answer.stdout_truncated || stdout_cut,
            stderr,
            stderr_truncated: answer.stderr_truncated || stderr_cut,
            error: answer.error.map(|e| capped(&e, MAX_STREAM_CHARS)),
            denials: answer.denials.into_iter().map(Into::into).collect(),
        }
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "status: {}", self.status.as_str())?;
        match (self.exit_code, &self.signal) {
            (Some(code), _) => writeln!(f, " (exit code {code})")?,
            (None, Some(signal)) => writeln!(f, " (killed by {signal})")?,
            (None, None) => writeln!(f)?,
        }
        writeln!(f, "session: {}", self.session_id)?;
        write_streams(
            f,
            (&self.stdout, self.stdout_truncated),
            (&self.stderr, self.stderr_truncated),
        )?;
        if let Some(error) = &self.error {
            writeln!(f, "error: {error}")?;
        }
        for denial in &self.denials {
            writeln!(
                f,
                "denied by the policy: {} {} (policy {}): {}",
                denial.kind, denial.target, denial.policy, denial.reason
            )?;
        }
        Ok(())
    }
}

/// The two streams of a result as the model reads them: each when not empty, and a line
/// when it was cut.
fn write_streams(
    f: &mut fmt::Formatter<'_>,
    stdout: (&str, bool),
    stderr: (&str, bool),
) -> fmt::Result {
    for (name, (text, truncated)) in [("stdout", stdout), ("stderr", stderr)] {
        if !text.is_empty() {
            writeln!(f, "{name}:\n{text}")?;
        }
        if truncated {
            writeln!(f, "[{name} was cut: more was printed than is shown]")?;
        }
    }
    Ok(())
}

/// `list_files`' result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct FileList {
    #[schemars(with = "String")]
    pub session_id: SessionId,
    /// The directory listed, relative to the workspace (empty: its top).
    pub dir: String,
    pub files: Vec<ListedFile>,
}

/// A file or directory of the workspace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ListedFile {
    /// Relative to the workspace, `/`-separated.
    pub path: String,
    /// `file`, `dir`, `symlink` (never followed) or `other`.
    pub kind: String,
    pub size: u64,
}

impl From<crate::gateway::v1::files::ListedFile> for ListedFile {
    fn from(file: crate::gateway::v1::files::ListedFile) -> ListedFile {
        ListedFile {
            path: file.path,
            kind: file.kind,
            size: file.size,
        }
    }
}

impl fmt::Display for FileList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = if self.dir.is_empty() {
            format!("session {}", self.session_id)
        } else {
            format!("session {}, {}", self.session_id, self.dir)
        };
        if self.files.is_empty() {
            return write!(f, "{place}: no files");
        }
        write!(f, "{place}:")?;
        for file in &self.files {
            write!(f, "\n{} ({}, {} bytes)", file.path, file.kind, file.size)?;
        }
        Ok(())
    }
}

/// API v1's session model, read as API v1 writes it (a renamed field fails to compile).
pub type ApiSession = crate::sessions::SessionModel;

/// `new_session`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct NewSession {
    /// The caller's session from now on.
    #[schemars(with = "String")]
    pub session_id: SessionId,
    pub policy: String,
    /// The sandbox backend its kernel runs in.
    pub sandbox: String,
    pub state_generation: u64,
    /// The session it replaced, now shut down.
    #[schemars(with = "Option<String>")]
    pub replaced: Option<SessionId>,
}

impl fmt::Display for NewSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "New session {}: policy {}, sandbox {}, state_generation {}.",
            self.session_id, self.policy, self.sandbox, self.state_generation
        )?;
        if let Some(old) = &self.replaced {
            write!(f, " Session {old} was shut down.")?;
        }
        Ok(())
    }
}

/// `interrupt`'s and `restart`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SessionAction {
    #[schemars(with = "String")]
    pub session_id: SessionId,
    /// `interrupted` (variables kept) or `restarted` (variables and files gone).
    pub action: Action,
    /// After a restart: the session's new state generation.
    pub state_generation: Option<u64>,
}

/// What `interrupt` or `restart` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Interrupted,
    Restarted,
}

impl fmt::Display for SessionAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.action, self.state_generation) {
            (Action::Interrupted, _) => write!(f, "interrupted session {}", self.session_id),
            (Action::Restarted, Some(generation)) => write!(
                f,
                "restarted session {}: variables and files are gone (state_generation {generation})",
                self.session_id
            ),
            (Action::Restarted, None) => write!(
                f,
                "restarted session {}: variables and files are gone",
                self.session_id
            ),
        }
    }
}

/// `write_file`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Written {
    #[schemars(with = "String")]
    pub session_id: SessionId,
    /// The file's path in the workspace, as the gateway stored it.
    pub path: String,
    pub bytes: u64,
}

impl fmt::Display for Written {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wrote {} ({} bytes) in session {}",
            self.path, self.bytes, self.session_id
        )
    }
}

/// `text`, cut at `max` characters with a note saying how much was left out.
pub fn capped(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_owned(),
        Some((cut, _)) => format!(
            "{}\n[… {} more characters not shown]",
            &text[..cut],
            text[cut..].chars().count()
        ),
    }
}

/// `text`'s first `max` characters, and whether any were left out.
fn cut(text: &str, max: usize) -> (String, bool) {
    match text.char_indices().nth(max) {
        None => (text.to_owned(), false),
        Some((end, _)) => (text[..end].to_owned(), true),
    }
}

/// `lines` cut at `max` characters in all (line breaks counted), the last line kept saying
/// how much was left out: what `capped` makes of the lines joined.
fn capped_lines(lines: &[String], max: usize) -> Vec<String> {
    let joined = lines.join("\n");
    if joined.chars().count() <= max {
        return lines.to_vec();
    }
    capped(&joined, max)
        .split('\n')
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::ExecutionId;
    use crate::sessions::{ExecError, Omitted, Resources};

    const SESSION: &str = "bc240c7a-232d-46b9-87f3-1a30b514780b";
    const ARTIFACT: &str = "0123456789abcdef0123456789abcdef";
    const EXECUTION: &str = "fedcba9876543210fedcba9876543210";

    fn session() -> SessionId {
        SessionId::parse(SESSION).unwrap()
    }

    fn check_status(status: Status) {
        // Every status API v1 can answer reads as one of the schema's, by the same name.
        let wire = serde_json::to_value(status).unwrap();
        let read = ExecutionStatus::from(status);
        assert_eq!(read.as_str(), wire.as_str().unwrap());
        assert_eq!(serde_json::to_value(read).unwrap(), wire);
    }

    #[test]
    fn every_api_status_has_a_schema_name() {
        for status in [
            Status::Ok,
            Status::Error,
            Status::Timeout,
            Status::Oom,
            Status::Denied,
            Status::OutputTruncated,
            Status::SandboxLost,
        ] {
            check_status(status);
        }
    }

    /// An API v1 result with nothing in it.
    fn answer(status: Status) -> ExecutionResult {
        ExecutionResult {
            execution_id: ExecutionId::parse(EXECUTION).unwrap(),
            status,
            execution_count: None,
            stdout: String::new(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            output_truncated: false,
            result: None,
            error: None,
            artifacts: vec![],
            omitted: vec![],
            denials: vec![],
            duration_ms: 3,
            state_generation: 1,
            resources: Resources::default(),
            restored: false,
        }
    }

    fn artifact_ref() -> ArtifactRef {
        ArtifactRef {
            id: ArtifactId::parse(ARTIFACT).unwrap(),
            url: format!("v1/artifacts/{ARTIFACT}"),
            mime: "image/png".into(),
            bytes: 10,
            width: None,
            height: None,
            summary: "PNG image 1×1".into(),
            display_id: None,
            version: 1,
            previous: None,
            path: None,
            signed_url: None,
            signed_url_expires: None,
        }
    }

    fn denial() -> crate::policy::Denial {
        crate::policy::Denial {
            kind: crate::policy::DenialKind::Egress,
            target: "x.example:443".into(),
            policy: "default".into(),
            reason: "not allowed".into(),
        }
    }

    #[test]
    fn results_read_as_text_with_every_part() {
        let result = Execution::new(
            session(),
            true,
            ExecutionResult {
                state_generation: 2,
                stdout: "hi\n".into(),
                error: Some(ExecError {
                    ename: "ZeroDivisionError".into(),
                    evalue: "division by zero".into(),
                    traceback: vec!["Traceback".into(), "  1 / 0".into()],
                }),
                artifacts: vec![artifact_ref()],
                denials: vec![denial()],
                omitted: vec![Omitted {
                    mime: "image/png".into(),
                    bytes: 1,
                    path: None,
                    reason: "quota".into(),
                    quota: None,
                }],
                ..answer(Status::Error)
            },
        );
        let text = result.to_string();
        for part in [
            "status: error",
            &format!("session: {SESSION} (state_generation 2; a new session"),
            "stdout:\nhi\n",
            "error: ZeroDivisionError: division by zero",
            "traceback:\nTraceback\n  1 / 0",
            &format!("- {ARTIFACT} (image/png, 10 bytes): PNG image 1×1"),
            "- egress x.example:443 (policy default): not allowed",
            "1 outputs were not stored",
        ] {
            assert!(text.contains(part), "{part:?} missing from:\n{text}");
        }
        assert!(!text.contains("stderr"), "{text}");
        assert_eq!(result.omitted, 1);
        assert_eq!(result.artifacts[0].path, None);
    }

    #[test]
    fn a_stream_cut_here_is_cut_in_both_and_flagged() {
        let long = "x".repeat(MAX_STREAM_CHARS + 5);
        let result = Execution::new(
            session(),
            false,
            ExecutionResult {
                stdout: long.clone(),
                stderr: "e".into(),
                stderr_truncated: true,
                result: Some(long),
                ..answer(Status::Ok)
            },
        );
        assert_eq!(result.stdout.chars().count(), MAX_STREAM_CHARS);
        assert!(result.stdout_truncated && result.stderr_truncated);
        let text = result.to_string();
        assert!(text.contains(&format!("stdout:\n{}\n[stdout was cut", result.stdout)));
        assert!(text.contains("stderr:\ne\n[stderr was cut"));
        let value = result.result.as_deref().unwrap();
        assert!(
            value.ends_with("[… 5 more characters not shown]"),
            "{value}"
        );
        assert!(text.contains(&format!("result: {value}\n")));
    }

    #[test]
    fn a_long_traceback_is_cut_with_a_note() {
        let lines: Vec<String> = (0..3).map(|_| "y".repeat(MAX_STREAM_CHARS / 2)).collect();
        let kept = capped_lines(&lines, MAX_STREAM_CHARS);
        assert_eq!(kept.len(), 3);
        assert!(kept[2].starts_with("[… "), "{:?}", &kept[2][..20]);
        assert_eq!(capped_lines(&lines[..1], MAX_STREAM_CHARS), lines[..1]);
    }

    #[test]
    fn long_text_is_cut_and_says_so() {
        assert_eq!(capped("abc", 5), "abc");
        assert_eq!(capped("abcdef", 3), "abc\n[… 3 more characters not shown]");
        assert_eq!(capped("ééé", 2), "éé\n[… 1 more characters not shown]");
    }

    #[test]
    fn the_other_results_read_as_before() {
        let files = FileList {
            session_id: session(),
            dir: String::new(),
            files: vec![ListedFile {
                path: "a.csv".into(),
                kind: "file".into(),
                size: 8,
            }],
        };
        assert_eq!(
            files.to_string(),
            format!("session {SESSION}:\na.csv (file, 8 bytes)")
        );
        let none = FileList {
            files: vec![],
            ..files
        };
        assert_eq!(none.to_string(), format!("session {SESSION}: no files"));
        let restarted = SessionAction {
            session_id: session(),
            action: Action::Restarted,
            state_generation: Some(3),
        };
        assert_eq!(
            restarted.to_string(),
            format!(
                "restarted session {SESSION}: variables and files are gone (state_generation 3)"
            )
        );
    }

    // API v1's own results, as the API sends them (serialised) and as a tool reads them
    // (deserialised into the same types): what the tool makes of them, field by field.
    #[test]
    fn api_v1_results_read_back_field_by_field() {
        let execution = ExecutionResult {
            execution_count: Some(4),
            stdout: "out".into(),
            stderr: "err".into(),
            stdout_truncated: true,
            stderr_truncated: true,
            result: Some("42".into()),
            error: Some(ExecError {
                ename: "ValueError".into(),
                evalue: "bad".into(),
                traceback: vec!["line".into()],
            }),
            artifacts: vec![ArtifactRef {
                path: Some("outputs/chart.png".into()),
                summary: "a chart".into(),
                bytes: 7,
                ..artifact_ref()
            }],
            omitted: vec![Omitted {
                mime: "image/png".into(),
                bytes: 9,
                path: None,
                reason: "quota".into(),
                quota: None,
            }],
            denials: vec![denial()],
            state_generation: 3,
            ..answer(Status::Error)
        };
        let wire = serde_json::to_vec(&execution).unwrap();
        let read: ExecutionResult = serde_json::from_slice(&wire).unwrap();
        assert_eq!(read, execution);
        let expected_denial = Denial {
            kind: "egress".into(),
            target: "x.example:443".into(),
            policy: "default".into(),
            reason: "not allowed".into(),
        };
        assert_eq!(
            Execution::new(session(), false, read),
            Execution {
                status: ExecutionStatus::Error,
                session_id: session(),
                new_session: false,
                state_generation: 3,
                stdout: "out".into(),
                stdout_truncated: true,
                stderr: "err".into(),
                stderr_truncated: true,
                result: Some("42".into()),
                error: Some(ExecutionError {
                    ename: "ValueError".into(),
                    evalue: "bad".into(),
                    traceback: vec!["line".into()],
                }),
                artifacts: vec![ArtifactSummary {
                    id: ArtifactId::parse(ARTIFACT).unwrap(),
                    mime: "image/png".into(),
                    bytes: 7,
                    summary: "a chart".into(),
                    path: Some("outputs/chart.png".into()),
                }],
                denials: vec![expected_denial.clone()],
                omitted: 1,
            }
        );

        let command = CommandResult {
            command_id: crate::ids::CommandId::parse(EXECUTION).unwrap(),
            status: Status::Error,
            exit_code: Some(2),
            signal: Some("SIGTERM".into()),
            stdout: "out".into(),
            stderr: "err".into(),
            stdout_truncated: true,
            stderr_truncated: true,
            output_truncated: false,
            error: Some("why".into()),
            denials: vec![denial()],
            duration_ms: 5,
            state_generation: 3,
        };
        let read: CommandResult =
            serde_json::from_slice(&serde_json::to_vec(&command).unwrap()).unwrap();
        assert_eq!(read, command);
        assert_eq!(
            Command::new(session(), true, read),
            Command {
                status: ExecutionStatus::Error,
                session_id: session(),
                new_session: true,
                exit_code: Some(2),
                signal: Some("SIGTERM".into()),
                stdout: "out".into(),
                stdout_truncated: true,
                stderr: "err".into(),
                stderr_truncated: true,
                error: Some("why".into()),
                denials: vec![expected_denial],
            }
        );
    }

    // What a tool answers goes out as structuredContent and comes back the same.
    #[test]
    fn tool_results_round_trip() {
        let execution = Execution::new(
            session(),
            true,
            ExecutionResult {
                artifacts: vec![artifact_ref()],
                ..answer(Status::Ok)
            },
        );
        let back: Execution =
            serde_json::from_value(serde_json::to_value(&execution).unwrap()).unwrap();
        assert_eq!(back, execution);
        let new = NewSession {
            session_id: session(),
            policy: "default".into(),
            sandbox: "namespaces".into(),
            state_generation: 1,
            replaced: Some(session()),
        };
        let back: NewSession = serde_json::from_value(serde_json::to_value(&new).unwrap()).unwrap();
        assert_eq!(back, new);
    }
}
