//! Shell commands in a session's sandbox (API v1's commands, MCP's `run_command`).
//!
//! A command runs through the session's own kernel: one silent execution of a line that
//! hands the command to `cellgate_command.run_json` (kernels/python3/cellgate_command.py),
//! which runs `bash -c` in the kernel's sandbox and streams its output back as the cell's
//! stream output; how it ended comes back in the reply's `user_expressions` (`cellgate_command.last`),
//! which the output limit (it drops outputs, never the reply) cannot take away. So a command gets
//! exactly the kernel's isolation, limits and egress on every backend, through the one
//! channel the gateway already has into the sandbox; nothing new crosses the boundary.
//!
//! What follows from that, and is documented for clients: a command waits for a running
//! cell (and a cell for a running command: they share the session's turn), it is not part of
//! the notebook history (export and replay show cells only), its events go to its caller
//! only (not to the session's WebSocket subscribers), and only kernels that can run the
//! runner line take commands: Python's, and those whose kernelspec says it
//! (`metadata.cellgate.commands`: the bash kernel, whose process is Python and runs that one
//! line itself, kernels/bash/cellgate_bash_kernel.py).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc;

use super::events::Status;
use super::plain::Streams;
use super::{Session, SessionError};
use crate::ids::CommandId;
use crate::kernel::{ExecEvent, ExecuteOptions, ExecuteReply, Outcome};
use crate::policy::Denial;

/// The user expression whose value (its `application/json`) says how the command ended.
const EXIT_EXPR: &str = "__import__(\"cellgate_command\").last";
/// How long past the command's own timeout the kernel may take before the gateway
/// interrupts it (the runner kills the command at its timeout; this is the backstop).
const BACKSTOP: Duration = Duration::from_secs(10);

/// A command to run.
#[derive(Debug, Clone)]
pub struct CommandRequest {
    /// Given to `bash -c`.
    pub cmd: String,
    /// A directory below the workspace (checked by the caller); `None`: the workspace.
    pub cwd: Option<String>,
    /// Added to the kernel's environment for this command.
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CommandResult {
    #[schema(value_type = String)]
    pub command_id: CommandId,
    /// `ok`: it exited with 0; `error`: another exit code, a signal, or it could not start
    /// (`error` says why); `timeout`: its timeout killed it; `oom`, `sandbox_lost`, `denied`
    /// as for executions.
    pub status: Status,
    /// Its exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it (`SIGKILL` after a timeout or an interrupt).
    pub signal: Option<String>,
    /// Capped (see `stdout_truncated`); the complete stream went out as events.
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// The policy's per-execution output limit cut the output off.
    pub output_truncated: bool,
    /// Why it could not run, or what ended the kernel's side of it.
    pub error: Option<String>,
    /// Policy denials (egress, packages) it caused.
    #[schema(value_type = Vec<serde_json::Value>)]
    pub denials: Vec<Denial>,
    pub duration_ms: u64,
    pub state_generation: u64,
}

/// One event of a running command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CommandEvent {
    Started {
        #[schema(value_type = String)]
        command_id: CommandId,
        cmd: String,
    },
    Stream {
        #[schema(value_type = String)]
        command_id: CommandId,
        /// `stdout` or `stderr`.
        name: String,
        text: String,
    },
    Done {
        #[schema(value_type = String)]
        command_id: CommandId,
        result: Box<CommandResult>,
    },
}

impl CommandEvent {
    /// The name used as the SSE `event:` field.
    pub fn kind(&self) -> &'static str {
        match self {
            CommandEvent::Started { .. } => "started",
            CommandEvent::Stream { .. } => "stream",
            CommandEvent::Done { .. } => "done",
        }
    }
}

/// The runner's report, from [`EXIT_EXPR`].
#[derive(Debug, Default, serde::Deserialize)]
struct Exit {
    exit_code: Option<i32>,
    signal: Option<String>,
    #[serde(default)]
    timed_out: bool,
    #[serde(default)]
    interrupted: bool,
    error: Option<String>,
}

/// The line the kernel executes for `request` (Python): the request as JSON in one ASCII
/// string literal (`crate::kernel::python`), which the runner parses.
fn python_line(request: &CommandRequest) -> String {
    let json = serde_json::json!({
        "cmd": request.cmd,
        "cwd": request.cwd,
        "env": request.env,
        "timeout": request.timeout.as_secs_f64(),
    });
    format!(
        "__import__(\"cellgate_command\").run_json({})",
        crate::kernel::python::str_literal(&json.to_string())
    )
}

impl Session {
    /// Whether this session's kernel can run commands.
    pub fn runs_commands(&self) -> bool {
        self.kernel.spec.language.eq_ignore_ascii_case("python")
            || self.kernel.spec.takes_commands()
    }

    /// Runs `request` in the session's sandbox: its events, ending with
    /// [`CommandEvent::Done`].
    pub fn run_command(
        self: &Arc<Self>,
        request: CommandRequest,
    ) -> Result<mpsc::UnboundedReceiver<CommandEvent>, SessionError> {
        if !self.runs_commands() {
            return Err(SessionError::CommandsUnsupported {
                language: self.kernel.spec.language.clone(),
            });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let session = self.clone();
        tokio::spawn(async move { session.command(request, tx).await });
        Ok(rx)
    }

    async fn command(
        self: Arc<Self>,
        request: CommandRequest,
        tx: mpsc::UnboundedSender<CommandEvent>,
    ) {
        let _one_at_a_time = self.run_lock.lock().await;
        let started = Instant::now();
        let usage_before = self.kernel.usage();
        let generation = self.kernel.generation();
        let line = python_line(&request);
        let mut execution = match self.client.execute(&line, command_options(&request)).await {
            Ok(execution) => execution,
            Err(err) => {
                let command_id = CommandId::random();
                let mut result = CommandResult::new(command_id.clone(), generation);
                result.status = Status::SandboxLost;
                result.error = Some(format!("the kernel cannot run it: {err}"));
                let _ = tx.send(CommandEvent::Started {
                    command_id: command_id.clone(),
                    cmd: request.cmd,
                });
                let _ = tx.send(CommandEvent::Done {
                    command_id,
                    result: Box::new(result),
                });
                return;
            }
        };
        let id = super::request_id(&execution.msg_id, CommandId::parse, CommandId::random);
        let _ = tx.send(CommandEvent::Started {
            command_id: id.clone(),
            cmd: request.cmd,
        });
        let cap = self.options.stream_cap;
        let relayed = relay(&id, &mut execution.events, cap, &tx).await;
        let mut result = relayed.result(CommandResult::new(id.clone(), generation));
        result.duration_ms = started.elapsed().as_millis() as u64;
        result.state_generation = self.kernel.generation();
        // A command costs what a cell does: the usage ledger (and the tenant's CPU quota)
        // counts it, under its command id.
        if let Some(store) = &self.store {
            let resources = super::execution::resources_between(usage_before, self.kernel.usage());
            let output_bytes = (result.stdout.len() + result.stderr.len()) as u64;
            let what = (
                result.command_id.to_string(),
                result.duration_ms,
                output_bytes,
                result.status,
            );
            super::persistence::command_finished(store, &self, what, &resources);
        }
        let _ = tx.send(CommandEvent::Done {
            command_id: id,
            result: Box::new(result),
        });
    }
}

/// A silent execution of the runner line that asks for the runner's report, interrupted
/// past the command's own timeout (see [`BACKSTOP`]).
fn command_options(request: &CommandRequest) -> ExecuteOptions {
    ExecuteOptions {
        timeout: Some(request.timeout + BACKSTOP),
        allow_stdin: false,
        silent: true,
        adopt_display_updates: false,
        user_expressions: serde_json::Map::from_iter([(
            "exit".to_owned(),
            Value::String(EXIT_EXPR.to_owned()),
        )]),
    }
}

impl CommandResult {
    /// A result with nothing known yet (`error` until told otherwise).
    fn new(command_id: CommandId, state_generation: u64) -> CommandResult {
        CommandResult {
            command_id,
            status: Status::Error,
            exit_code: None,
            signal: None,
            stdout: String::new(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            output_truncated: false,
            error: None,
            denials: Vec::new(),
            duration_ms: 0,
            state_generation,
        }
    }
}

/// What the kernel's side of a command said: its streams, the error it raised, its reply.
struct Relayed {
    streams: Streams,
    raised: Option<String>,
    reply: ExecuteReply,
}

/// Sends the command's streams to its caller as they come, until the execution's reply.
async fn relay(
    id: &CommandId,
    events: &mut mpsc::UnboundedReceiver<ExecEvent>,
    cap: usize,
    tx: &mpsc::UnboundedSender<CommandEvent>,
) -> Relayed {
    let mut streams = Streams::default();
    let mut raised = None;
    while let Some(event) = events.recv().await {
        match event {
            ExecEvent::Stream { name, text } => {
                let Some(text) = streams.push(&name, &text, cap) else {
                    continue;
                };
                let _ = tx.send(CommandEvent::Stream {
                    command_id: id.clone(),
                    name,
                    text,
                });
            }
            ExecEvent::Error { ename, evalue, .. } => raised = Some(format!("{ename}: {evalue}")),
            ExecEvent::Done(reply) => {
                return Relayed {
                    streams,
                    raised,
                    reply,
                }
            }
            ExecEvent::Busy
            | ExecEvent::Display { .. }
            | ExecEvent::Result { .. }
            | ExecEvent::ClearOutput { .. }
            | ExecEvent::InputRequest { .. } => {}
        }
    }
    Relayed {
        streams,
        raised,
        reply: ExecuteReply::default(),
    }
}

impl Relayed {
    /// The runner's report, from the reply's `user_expressions`:
    /// `{"exit": {"status": "ok", "data": {"application/json": {...}, ...}}}`.
    fn exit(&self) -> Exit {
        self.reply
            .user_expressions
            .get("exit")
            .filter(|e| e["status"] == "ok")
            .and_then(|e| {
                serde_json::from_value::<Exit>(e["data"]["application/json"].clone()).ok()
            })
            .unwrap_or_default()
    }

    /// `result` completed with how the command ended.
    fn result(self, mut result: CommandResult) -> CommandResult {
        let exit = self.exit();
        let reply = self.reply;
        (result.stdout, result.stderr) = self.streams.collapsed();
        result.stdout_truncated = self.streams.stdout_truncated;
        result.stderr_truncated = self.streams.stderr_truncated;
        result.output_truncated = reply.outcome == Some(Outcome::OutputTruncated);
        result.denials = reply.denials.clone();
        result.exit_code = exit.exit_code;
        result.signal = exit.signal;
        result.error = exit.error.or(self.raised).or_else(|| {
            (reply.status != "ok" && reply.ename.is_some()).then(|| {
                format!(
                    "{}: {}",
                    reply.ename.clone().unwrap_or_default(),
                    reply.evalue.clone().unwrap_or_default()
                )
            })
        });
        if exit.interrupted && result.error.is_none() {
            result.error = Some("interrupted".to_owned());
        }
        result.status = match reply.outcome {
            Some(Outcome::Oom) => Status::Oom,
            Some(Outcome::SandboxLost) => Status::SandboxLost,
            Some(Outcome::Timeout) => Status::Timeout,
            _ if exit.timed_out => Status::Timeout,
            _ if result.exit_code == Some(0) => Status::Ok,
            _ if !result.denials.is_empty() => Status::Denied,
            _ => Status::Error,
        };
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_is_ascii_and_carries_the_request_as_json() {
        let request = CommandRequest {
            cmd: "echo \"$HOME\" 'a\\b'\u{2028}x = 1 # é".to_owned(),
            cwd: Some("data/x y".to_owned()),
            env: BTreeMap::from([("K".to_owned(), "v\"\\".to_owned())]),
            timeout: Duration::from_millis(250),
        };
        let line = python_line(&request);
        assert!(line.chars().all(|c| (' '..='~').contains(&c)), "{line}");
        assert!(
            line.starts_with("__import__(\"cellgate_command\").run_json(\""),
            "{line}"
        );
        assert!(line.contains("\\u2028"), "{line}");
    }

    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(value: &T) -> T {
        serde_json::from_slice(&serde_json::to_vec(value).unwrap()).unwrap()
    }

    #[test]
    fn results_and_events_read_back_as_they_were_sent() {
        let command_id = CommandId::random();
        let result = CommandResult {
            command_id: command_id.clone(),
            status: Status::Timeout,
            exit_code: None,
            signal: Some("SIGKILL".into()),
            stdout: "o".into(),
            stderr: "e".into(),
            stdout_truncated: false,
            stderr_truncated: true,
            output_truncated: false,
            error: Some("why".into()),
            denials: vec![Denial {
                kind: crate::policy::DenialKind::Egress,
                target: "example.com:443".into(),
                policy: "default".into(),
                reason: "not allowed".into(),
            }],
            duration_ms: 3,
            state_generation: 1,
        };
        assert_eq!(round_trip(&result), result);
        for event in [
            CommandEvent::Started {
                command_id: command_id.clone(),
                cmd: "ls".into(),
            },
            CommandEvent::Stream {
                command_id: command_id.clone(),
                name: "stderr".into(),
                text: "x".into(),
            },
            CommandEvent::Done {
                command_id,
                result: Box::new(result),
            },
        ] {
            assert_eq!(round_trip(&event), event);
        }
    }
}
