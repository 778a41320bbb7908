//! An execution's life as the gateway sees it, and the words for how it ended.
//!
//! This is where "what a cell's outcome is" lives. [`Outcome`], [`ExecutionState`],
//! [`Denial`] (defined in `policy::denial`, below the proxy that reports it) and the
//! sandbox's [`ExitCause`] (defined in `sandbox`) are enums with serde names; the JSON in
//! `metadata.cellgate` and in status messages is only their wire encoding, and every consumer
//! matches them exhaustively, so a new outcome nobody handles does not compile. [`CellEnd`]
//! is the one classification of how a cell ended, from its reply and those: the metrics'
//! outcome label and API v1's status are mapped from it.
//!
//! `Executions` follows one kernel's executions: which one runs, its output against the
//! policy's limit, whether the gateway timed it out, the policy denials it collected, its
//! reply held until its `idle`, and whether the pids limit refused it a fork. The router hands
//! it each delivered message of an execution and does what the returned `Verdict` says;
//! `Executions` never calls back into the router, so the routing table and the supervision of
//! executions can be read (and tested) apart. The verdicts: forward, forward after a marker
//! line, hold, drop (plus any held reply the message released).
//!
//! - **Output limit:** past the policy's per-cell limit, output is dropped with one marker
//!   and the reply's outcome is `output_truncated`; the kernel launcher, told the limit in
//!   `CELLGATE_OUTPUT_LIMIT`, stops buffering the cell's output a little past it, so a print
//!   loop cannot fill the kernel's memory with output the router would drop.
//! - **Timeouts:** a `KeyboardInterrupt` the gateway caused becomes `CellTimeoutError`.
//! - **Held reply:** the running execution's `execute_reply` is held until its `idle` status
//!   (released also by the next `busy`, the kernel's death or restart): shell and iopub are
//!   separate sockets, and a reply used to overtake the cell's last large output (still being
//!   checked), so it missed `output_truncated` and reached clients before the output.
//! - **Pids:** a *failed* `execute_reply` asks the generation's sandbox whether its pids
//!   limit refused a fork since the last report (cgroup `pids.events`); if so the reply gets
//!   outcome `pids` and a stderr line names the limit. Successful replies never pay for the
//!   read.
//! - **Denials** the egress proxy reports (`Router::record_denial`) attach to the running
//!   execution: the one whose `busy` was seen, else the oldest execute awaiting its reply (a
//!   proxy request can beat the `busy`): one stderr line at once, and
//!   `metadata.cellgate.denials` merged into the reply's `cellgate` object; only executions
//!   with denials are rewritten.
//!
//! The outcomes: `timeout`, `oom`, `pids`, `sandbox_lost`, `output_truncated`; the map from
//! the sandbox's `ExitCause` to the outcome of a limit that ended the kernel lives here too.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::json;

pub use crate::policy::{Denial, DenialKind};
use crate::protocol::{Channel, HeaderFields, Message};
use crate::sandbox::SandboxHandle;
use crate::telemetry::metrics::{ExecOutcome, ExecutionMetrics};

/// Why a sandbox ended, as its backend knows it. Defined by the sandbox (which must not
/// depend on kernels) and mapped to an [`Outcome`] here ([`limit_exit`]).
pub use crate::sandbox::ExitCause;

/// How cellgate says an execution ended, beyond the kernel's own reply status: the
/// `metadata.cellgate.outcome` of the execute_reply (and of the gateway's marker lines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Interrupted for running past a timeout (the request's or the policy's).
    Timeout,
    /// The kernel ran out of the policy's memory and was restarted.
    Oom,
    /// The sandbox's pids limit refused a fork while the cell ran (a failed cell only), or
    /// ended a gVisor sandbox.
    Pids,
    /// The kernel process died, or was gone before the cell ran.
    SandboxLost,
    /// Output past the policy's per-cell limit was dropped; the kernel kept running.
    OutputTruncated,
}

/// How a cell ended: the one classification of an execution's end. The metrics' outcome
/// label ([`ExecOutcome`]) and API v1's status map from it and decide nothing themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CellEnd {
    Ok,
    /// Succeeded; output past the policy's per-cell limit was dropped.
    OutputTruncated,
    /// The code raised (or failed with the pids limit's refusal, which its stderr names).
    Error,
    /// A client interrupted it (`KeyboardInterrupt`).
    Interrupted,
    /// Never ran: an earlier cell failed and the kernel aborted the queue. `denied`: the
    /// policy refused something while it waited (API v1 says `denied`, the metrics
    /// `aborted`).
    Aborted {
        denied: bool,
    },
    /// Failed, or installed nothing, because the policy refused something it tried.
    Denied,
    Timeout,
    Oom,
    /// The sandbox ended under the cell (or before it ran).
    SandboxLost,
}

impl CellEnd {
    /// Every end, for the tests that walk them (their exhaustive matches stop compiling
    /// when a variant is added: add it here too).
    pub const ALL: [CellEnd; 10] = [
        CellEnd::Ok,
        CellEnd::OutputTruncated,
        CellEnd::Error,
        CellEnd::Interrupted,
        CellEnd::Aborted { denied: false },
        CellEnd::Aborted { denied: true },
        CellEnd::Denied,
        CellEnd::Timeout,
        CellEnd::Oom,
        CellEnd::SandboxLost,
    ];

    /// Classifies an execution's end from its reply's `status` and `ename`, the outcome the
    /// gateway gave it, and the policy's denials during it.
    pub fn classify(
        status: Option<&str>,
        ename: Option<&str>,
        outcome: Option<Outcome>,
        denials: &[Denial],
    ) -> CellEnd {
        match outcome {
            Some(Outcome::Timeout) => return CellEnd::Timeout,
            Some(Outcome::Oom) => return CellEnd::Oom,
            Some(Outcome::SandboxLost) => return CellEnd::SandboxLost,
            Some(Outcome::Pids | Outcome::OutputTruncated) | None => {}
        }
        let denied = !denials.is_empty();
        if status == Some("ok") {
            // `%pip install` of a refused package fails on stderr without raising: the cell
            // "ends ok" having installed nothing.
            if denials.iter().any(|d| d.kind == DenialKind::Package) {
                return CellEnd::Denied;
            }
            return if outcome == Some(Outcome::OutputTruncated) {
                CellEnd::OutputTruncated
            } else {
                CellEnd::Ok
            };
        }
        match (status, ename) {
            (Some("aborted"), _) => CellEnd::Aborted { denied },
            // A failed cell that tried something refused failed because of it, most likely,
            // whatever it raised; the denials say what.
            _ if denied => CellEnd::Denied,
            (_, Some("KeyboardInterrupt")) => CellEnd::Interrupted,
            _ => CellEnd::Error,
        }
    }
}

impl From<CellEnd> for ExecOutcome {
    fn from(end: CellEnd) -> ExecOutcome {
        match end {
            CellEnd::Ok | CellEnd::OutputTruncated => ExecOutcome::ok,
            CellEnd::Error => ExecOutcome::error,
            CellEnd::Interrupted => ExecOutcome::interrupted,
            CellEnd::Aborted { .. } => ExecOutcome::aborted,
            CellEnd::Denied => ExecOutcome::denied,
            CellEnd::Timeout => ExecOutcome::timeout,
            CellEnd::Oom => ExecOutcome::oom,
            CellEnd::SandboxLost => ExecOutcome::lost,
        }
    }
}

/// A kernel's `execution_state`: what its iopub status says, and what the gateway itself
/// reports while it restarts the kernel or after the kernel died (the kernel model's field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionState {
    Starting,
    Idle,
    Busy,
    Restarting,
    Dead,
}

impl ExecutionState {
    /// The wire name (the same as serde's).
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionState::Starting => "starting",
            ExecutionState::Idle => "idle",
            ExecutionState::Busy => "busy",
            ExecutionState::Restarting => "restarting",
            ExecutionState::Dead => "dead",
        }
    }

    /// The state a `status` message announces; `None` for any other message, and for a
    /// status whose state is none of the protocol's.
    pub fn of_status(message: &Message) -> Option<ExecutionState> {
        #[derive(Deserialize)]
        struct StatusContent {
            execution_state: ExecutionState,
        }
        if message.msg_type() != "status" {
            return None;
        }
        serde_json::from_slice::<StatusContent>(&message.content)
            .ok()
            .map(|c| c.execution_state)
    }
}

/// What the gateway tells the running cell when a limit ended its kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitExit {
    /// The `ename` of the error the cell gets.
    pub ename: &'static str,
    pub outcome: Outcome,
    /// For the log: "kernel {what}: restarting".
    pub what: &'static str,
}

/// The limit that ended a kernel, if one did: such a kernel is restarted (its cell told why)
/// rather than reported dead.
pub fn limit_exit(cause: ExitCause) -> Option<LimitExit> {
    match cause {
        ExitCause::OutOfMemory => Some(LimitExit {
            ename: "OutOfMemoryError",
            outcome: Outcome::Oom,
            what: "out of memory",
        }),
        ExitCause::PidsLimit => Some(LimitExit {
            ename: "ProcessLimitError",
            outcome: Outcome::Pids,
            what: "reached its process limit",
        }),
        ExitCause::Exited | ExitCause::SandboxFailed => None,
    }
}

/// What the router does with a message it handed to [`Executions`].
#[derive(Debug)]
#[must_use]
pub(super) enum Verdict {
    /// Send it on: iopub to everyone, a reply to its requester (possibly rewritten).
    Forward(Arc<Message>),
    /// Send the gateway's marker line on iopub first, then the message.
    ForwardAndMark {
        mark: Arc<Message>,
        message: Arc<Message>,
    },
    /// The execution keeps it (a reply waiting for its `idle`) and releases it later.
    Hold,
    /// Not for clients (output past the limit).
    Drop,
    /// Not for clients; the marker line goes out in its place.
    DropAndMark(Arc<Message>),
}

/// A held execute_reply the execution let go: sent before the message that released it.
#[derive(Debug)]
#[must_use]
pub(super) struct Released {
    /// The execute_request it answers.
    pub parent: String,
    /// The reply as the kernel sent it (what history records).
    pub kernel_reply: Arc<Message>,
    pub verdict: Verdict,
}

/// The gateway's answer to an execution the kernel will never answer: an error on iopub,
/// the execute_reply for its requester, then `idle`.
#[derive(Debug)]
pub(super) struct Answer {
    pub msg_id: String,
    pub error: Arc<Message>,
    pub reply: Arc<Message>,
    pub idle: Arc<Message>,
}

/// An execute request sent to the kernel and not answered yet.
struct Waiting {
    msg_id: String,
    /// When the request went to the kernel (the execution's duration, for metrics).
    sent: Instant,
    /// The request's header, to answer it (or add lines to it) in the kernel's stead.
    header: HeaderFields,
    header_bytes: Bytes,
}

/// The execution the kernel is busy with.
struct Running {
    msg_id: String,
    since: Instant,
    /// Output bytes so far, and whether the limit cut it off.
    output: u64,
    truncated: bool,
}

/// An execution the gateway interrupted because it ran past a timeout.
struct TimedOut {
    since: Instant,
    evalue: String,
}

/// The running generation's sandbox, asked after a failed execution whether the pids limit
/// refused a fork; and the count already reported.
struct PidsProbe {
    handle: Arc<dyn SandboxHandle>,
    seen: u64,
}

/// Executes waiting for their reply are remembered up to this many (a kernel that never
/// answers must not grow the gateway).
const MAX_WAITING: usize = 16_384;
/// Denials kept per execution: a loop of denied requests must not grow the reply forever.
const MAX_DENIALS_PER_EXECUTION: usize = 100;

/// The executions of one kernel (all generations: it lives in the router).
pub(super) struct Executions {
    /// Output bytes one execution may produce; the rest is dropped with a marker.
    output_limit: Option<u64>,
    waiting: VecDeque<Waiting>,
    running: Option<Running>,
    timed_out: HashMap<String, TimedOut>,
    /// Executions whose output was cut off, for their reply's outcome.
    truncated: HashSet<String>,
    /// Policy denials of executions not yet replied to.
    denials: HashMap<String, Vec<Denial>>,
    /// The running execution's execute_reply, held until its `idle` status: the reply comes
    /// on the shell socket and can overtake the execution's last outputs, still on iopub (a
    /// large one is checked off the async workers for tens of ms). The reply's outcome
    /// (`output_truncated`) depends on those outputs, and clients get them first.
    held: Option<(String, Arc<Message>)>,
    pids: Option<PidsProbe>,
    /// Where executions' ends are counted (the kernel's policy's handles).
    metrics: Option<ExecutionMetrics>,
}

impl Executions {
    pub fn new(output_limit: Option<u64>) -> Executions {
        Executions {
            output_limit,
            waiting: VecDeque::new(),
            running: None,
            timed_out: HashMap::new(),
            truncated: HashSet::new(),
            denials: HashMap::new(),
            held: None,
            pids: None,
            metrics: None,
        }
    }

    /// Counts executions' ends under the kernel's policy.
    pub fn set_metrics(&mut self, metrics: ExecutionMetrics) {
        self.metrics = Some(metrics);
    }

    pub fn set_output_limit(&mut self, limit: Option<u64>) {
        self.output_limit = limit;
    }

    /// The sandbox of a new generation (its pids counter starts again at zero).
    pub fn set_sandbox(&mut self, handle: Option<Arc<dyn SandboxHandle>>) {
        self.pids = handle.map(|handle| PidsProbe { handle, seen: 0 });
    }

    /// A client's execute_request on its way to the kernel.
    pub fn on_request(&mut self, request: &Message) {
        if self.waiting.len() >= MAX_WAITING {
            self.waiting.pop_front();
        }
        self.waiting.push_back(Waiting {
            msg_id: request.msg_id().to_owned(),
            sent: Instant::now(),
            header: request.header.clone(),
            header_bytes: request.header_bytes.clone(),
        });
    }

    /// An iopub message of a client's request (`status`: its parsed state).
    pub fn on_iopub(
        &mut self,
        message: Arc<Message>,
        status: Option<ExecutionState>,
        parent: Option<&str>,
    ) -> (Option<Released>, Verdict) {
        let Some(parent) = parent else {
            return (None, Verdict::Forward(message));
        };
        if let Some(state) = status {
            let parent_is_execute = message
                .parent
                .as_ref()
                .is_some_and(|p| p.msg_type == "execute_request");
            let released = match state {
                ExecutionState::Busy if parent_is_execute => {
                    // A kernel that never said idle for the last one: its reply goes out
                    // now rather than never.
                    let released = self.release_held();
                    self.running = Some(Running {
                        msg_id: parent.to_owned(),
                        since: Instant::now(),
                        output: 0,
                        truncated: false,
                    });
                    released
                }
                ExecutionState::Idle if self.is_running(parent) => {
                    // Every output of the execution is in: its reply first, then this idle,
                    // the order a kernel sends them in.
                    let released = self.release_held();
                    self.running = None;
                    released
                }
                ExecutionState::Busy
                | ExecutionState::Idle
                | ExecutionState::Starting
                | ExecutionState::Restarting
                | ExecutionState::Dead => None,
            };
            return (released, Verdict::Forward(message));
        }
        let msg_type = message.msg_type();
        if let (Some(limit), Some(running)) = (
            self.output_limit,
            self.running.as_mut().filter(|r| r.msg_id == parent),
        ) {
            let is_output = matches!(
                msg_type,
                "stream" | "display_data" | "execute_result" | "update_display_data"
            );
            if is_output {
                running.output += message.byte_len() as u64;
                if running.output > limit {
                    if running.truncated {
                        return (None, Verdict::Drop);
                    }
                    running.truncated = true;
                    if self.truncated.len() > 256 {
                        self.truncated.clear();
                    }
                    self.truncated.insert(parent.to_owned());
                    let marker = truncation_marker(&message, limit);
                    return (None, Verdict::DropAndMark(Arc::new(marker)));
                }
            }
        }
        if msg_type == "error" {
            if let Some(timed_out) = self.timed_out.get(parent) {
                let error = timeout_error(&message, &timed_out.evalue);
                return (None, Verdict::Forward(Arc::new(error)));
            }
        }
        (None, Verdict::Forward(message))
    }

    /// A shell or control reply to a client's request.
    pub fn on_reply(&mut self, parent: &str, message: Arc<Message>) -> (Option<Released>, Verdict) {
        if message.msg_type() != "execute_reply" {
            return (None, Verdict::Forward(message));
        }
        if self.is_running(parent) {
            let released = self.release_held();
            self.held = Some((parent.to_owned(), message));
            return (released, Verdict::Hold);
        }
        (None, self.finish(parent, message))
    }

    /// The execution the kernel is busy with, and for how long.
    pub fn running(&self) -> Option<(String, Duration)> {
        self.running
            .as_ref()
            .map(|r| (r.msg_id.clone(), r.since.elapsed()))
    }

    /// The execution the kernel is running as far as the gateway can tell: the one whose
    /// `busy` was seen, else the oldest execute still waiting for its reply (the kernel runs
    /// them in order, and a cell's side effects, such as a proxy request, can reach the
    /// gateway before its `busy` status does).
    pub fn current(&self) -> Option<String> {
        self.running
            .as_ref()
            .map(|r| r.msg_id.clone())
            .or_else(|| self.waiting.front().map(|w| w.msg_id.clone()))
    }

    /// Attaches a policy denial to the running execution; returns the stderr line for
    /// clients. Without a running execution (a thread of the kernel's own, say) there is
    /// nothing to attach it to.
    pub fn record_denial(&mut self, denial: Denial) -> Option<Message> {
        let msg_id = self.current()?;
        let waiting = self.waiting.iter().find(|w| w.msg_id == msg_id)?;
        let line = Message::answering(
            &waiting.header,
            &waiting.header_bytes,
            Channel::Iopub,
            "stream",
            &json!({"name": "stderr", "text": format!("cellgate: {}\n", denial.reason)}),
            &json!({"cellgate": {"denial": denial}}),
        );
        let list = self.denials.entry(msg_id).or_default();
        if list.len() < MAX_DENIALS_PER_EXECUTION {
            list.push(denial);
        }
        if self.denials.len() > 256 {
            let current = self.current();
            self.denials.retain(|k, _| Some(k) == current.as_ref());
        }
        Some(line)
    }

    /// When the gateway interrupted `msg_id` for running too long, if it did.
    pub fn timed_out_since(&self, msg_id: &str) -> Option<Instant> {
        self.timed_out.get(msg_id).map(|t| t.since)
    }

    /// Marks an execution as interrupted for its timeout: its KeyboardInterrupt error and
    /// reply reach clients as `CellTimeoutError` with `evalue`.
    pub fn mark_timed_out(&mut self, msg_id: &str, evalue: String) {
        if self.timed_out.len() > 64 {
            self.timed_out.clear();
        }
        self.timed_out.insert(
            msg_id.to_owned(),
            TimedOut {
                since: Instant::now(),
                evalue,
            },
        );
    }

    /// Answers a timed-out execution whose kernel had to be restarted (the process that
    /// would have replied is gone).
    pub fn fail_timed_out(
        &mut self,
        msg_id: &str,
        evalue: &str,
    ) -> (Option<Released>, Option<Answer>) {
        let released = self.release_held();
        self.timed_out.remove(msg_id);
        self.running = None;
        let answer = self
            .take_waiting(msg_id)
            .map(|w| self.answer(w, "CellTimeoutError", evalue, Outcome::Timeout));
        (released, answer)
    }

    /// Answers every execution still waiting for a reply from a kernel process that is gone:
    /// the running one with `evalue`, queued ones with a note that they never ran.
    pub fn fail_pending(
        &mut self,
        ename: &str,
        evalue: &str,
        outcome: Outcome,
    ) -> (Option<Released>, Vec<Answer>) {
        // A reply that came before the process died is the real answer.
        let released = self.release_held();
        // The kernel runs executions in order, so without a `busy` seen yet (the process can
        // die before its status gets out) the oldest waiting execute is the running one.
        let running = self.current();
        self.running = None;
        let waiting = std::mem::take(&mut self.waiting);
        let answers = waiting
            .into_iter()
            .map(|w| {
                if running.as_deref() == Some(w.msg_id.as_str()) {
                    self.answer(w, ename, evalue, outcome)
                } else {
                    let text = format!("this cell never ran: {evalue}");
                    self.answer_unrun(w, ename, &text, outcome)
                }
            })
            .collect();
        (released, answers)
    }

    /// Forgets the running execution (its kernel process is gone); its held reply goes out.
    pub fn clear_running(&mut self) -> Option<Released> {
        let released = self.release_held();
        self.running = None;
        released
    }

    /// Forgets every execution waiting for a reply (the kernel is shut down for good).
    pub fn clear(&mut self) {
        self.waiting.clear();
        self.held = None;
    }

    fn is_running(&self, msg_id: &str) -> bool {
        self.running.as_ref().is_some_and(|r| r.msg_id == msg_id)
    }

    fn take_waiting(&mut self, msg_id: &str) -> Option<Waiting> {
        // Executions end in the order they were sent: the search ends at the front.
        let at = self.waiting.iter().position(|w| w.msg_id == msg_id)?;
        self.waiting.remove(at)
    }

    fn release_held(&mut self) -> Option<Released> {
        let (parent, kernel_reply) = self.held.take()?;
        let verdict = self.finish(&parent, kernel_reply.clone());
        Some(Released {
            parent,
            kernel_reply,
            verdict,
        })
    }

    /// The execute_reply for its requester, with what the gateway knows of its execution: a
    /// timeout, cut-off output, a refused fork, policy denials.
    fn finish(&mut self, parent: &str, message: Arc<Message>) -> Verdict {
        let waiting = self.take_waiting(parent);
        let timed_out = self.timed_out.remove(parent);
        if let (Some(metrics), Some(waiting)) = (&self.metrics, &waiting) {
            // The gateway's outcomes come later (truncation, pids): only its timeout counts.
            let outcome = timed_out.as_ref().map(|_| Outcome::Timeout);
            let end = ending(&message, outcome, self.denials.get(parent));
            metrics.record(end.into(), waiting.sent.elapsed());
        }
        let message = match timed_out {
            Some(timed_out) => Arc::new(timeout_reply(&message, &timed_out.evalue)),
            None => message,
        };
        let (mark, message) = if self.truncated.remove(parent) {
            (
                None,
                Arc::new(with_outcome(&message, Outcome::OutputTruncated)),
            )
        } else {
            self.pids_outcome(message)
        };
        // Only executions with denials pay for a rewrite.
        let message = match self.denials.remove(parent) {
            Some(denials) => Arc::new(with_denials(&message, denials)),
            None => message,
        };
        match mark {
            Some(mark) => Verdict::ForwardAndMark { mark, message },
            None => Verdict::Forward(message),
        }
    }

    /// A failed execution during which the pids limit refused a fork gets the outcome `pids`
    /// and a stderr line saying so (its own error, often `BlockingIOError`, stays as it is).
    /// Only failed replies pay for reading the counter: a cell that caught the refusal and
    /// succeeded did not end because of the limit.
    fn pids_outcome(&mut self, message: Arc<Message>) -> (Option<Arc<Message>>, Arc<Message>) {
        let Some(probe) = self.pids.as_mut() else {
            return (None, message);
        };
        if !reply_failed(&message) || has_outcome(&message) {
            return (None, message);
        }
        let Some(hits) = probe.handle.pids_limit_hits() else {
            return (None, message);
        };
        if hits <= probe.seen {
            return (None, message);
        }
        probe.seen = hits;
        let text = "\n[cellgate] this execution reached the sandbox's process limit (policy `pids`): new processes and threads were refused\n";
        let parent = message.parent.clone().unwrap_or_default();
        let marker = Message::answering(
            &parent,
            &message.parent_header_bytes,
            Channel::Iopub,
            "stream",
            &json!({"name": "stderr", "text": text}),
            &json!({"cellgate": {"outcome": Outcome::Pids}}),
        );
        (
            Some(Arc::new(marker)),
            Arc::new(with_outcome(&message, Outcome::Pids)),
        )
    }

    /// [`Self::answer`] for an execution that was queued behind the one that ended the
    /// kernel: counted as `aborted` (it never ran), answered with the same outcome.
    fn answer_unrun(
        &mut self,
        waiting: Waiting,
        ename: &str,
        evalue: &str,
        outcome: Outcome,
    ) -> Answer {
        let metrics = self.metrics.take();
        if let Some(metrics) = &metrics {
            metrics.record(ExecOutcome::aborted, waiting.sent.elapsed());
        }
        let answer = self.answer(waiting, ename, evalue, outcome);
        self.metrics = metrics;
        answer
    }

    /// The gateway's error, execute_reply and idle for `waiting`, in the kernel's stead.
    fn answer(&mut self, waiting: Waiting, ename: &str, evalue: &str, outcome: Outcome) -> Answer {
        let Waiting {
            msg_id,
            sent,
            header,
            header_bytes,
        } = waiting;
        if let Some(metrics) = &self.metrics {
            let denials = self.denials.get(&msg_id).map_or(&[][..], Vec::as_slice);
            // The end of the execute_reply made below.
            let end = CellEnd::classify(Some("error"), Some(ename), Some(outcome), denials);
            metrics.record(end.into(), sent.elapsed());
        }
        let error = json!({
            "ename": ename,
            "evalue": evalue,
            "traceback": [format!("{ename}: {evalue}")],
        });
        let metadata = json!({"cellgate": {"outcome": outcome}});
        let iopub_error = Message::answering(
            &header,
            &header_bytes,
            Channel::Iopub,
            "error",
            &error,
            &metadata,
        );
        let mut reply_content = error;
        reply_content["status"] = json!("error");
        reply_content["execution_count"] = json!(null);
        let mut reply = Message::answering(
            &header,
            &header_bytes,
            Channel::Shell,
            "execute_reply",
            &reply_content,
            &metadata,
        );
        // A cell whose kernel died or timed out still reports what the policy denied it.
        if let Some(denials) = self.denials.remove(&msg_id) {
            reply = with_denials(&reply, denials);
        }
        let idle = Message::answering(
            &header,
            &header_bytes,
            Channel::Iopub,
            "status",
            &json!({"execution_state": ExecutionState::Idle}),
            &json!({}),
        );
        Answer {
            msg_id,
            error: Arc::new(iopub_error),
            reply: Arc::new(reply),
            idle: Arc::new(idle),
        }
    }
}

/// The stderr line that replaces a cell's output past the limit.
fn truncation_marker(dropped: &Message, limit: u64) -> Message {
    let text = format!(
        "\n[cellgate] this cell's output passed the limit of {} MiB; the rest of its output is dropped (the cell keeps running)\n",
        limit as f64 / (1u64 << 20) as f64
    );
    let parent = dropped.parent.clone().unwrap_or_default();
    Message::answering(
        &parent,
        &dropped.parent_header_bytes,
        Channel::Iopub,
        "stream",
        &json!({"name": "stderr", "text": text}),
        &json!({"cellgate": {"outcome": Outcome::OutputTruncated}}),
    )
}

/// The fields of a reply's content the gateway reads (the rest is skipped, not copied).
#[derive(Deserialize)]
struct ReplyStatus<'a> {
    #[serde(borrow)]
    status: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    ename: Option<std::borrow::Cow<'a, str>>,
}

/// How a reply ends its execution, with the gateway's `outcome` for it (for the metrics).
fn ending(message: &Message, outcome: Option<Outcome>, denials: Option<&Vec<Denial>>) -> CellEnd {
    let reply = serde_json::from_slice::<ReplyStatus<'_>>(&message.content).ok();
    CellEnd::classify(
        reply.as_ref().and_then(|r| r.status.as_deref()),
        reply.as_ref().and_then(|r| r.ename.as_deref()),
        outcome,
        denials.map_or(&[][..], Vec::as_slice),
    )
}

/// Whether a reply's `status` is anything but `ok`.
fn reply_failed(message: &Message) -> bool {
    serde_json::from_slice::<ReplyStatus<'_>>(&message.content)
        .ok()
        .and_then(|c| c.status)
        .is_some_and(|s| s != "ok")
}

/// Whether the message already carries an outcome (the gateway's, or one the kernel claims).
fn has_outcome(message: &Message) -> bool {
    serde_json::from_slice::<serde_json::Value>(&message.metadata)
        .ok()
        .is_some_and(|m| m["cellgate"]["outcome"].is_string())
}

/// The same message with `metadata.cellgate.outcome` set (other `cellgate` fields, such as
/// denials, are kept); header and content keep their bytes.
fn with_outcome(message: &Message, outcome: Outcome) -> Message {
    with_cellgate_field(message, "outcome", json!(outcome))
}

/// The same message with `metadata.cellgate.denials` set, merged into any `cellgate` object.
fn with_denials(message: &Message, denials: Vec<Denial>) -> Message {
    with_cellgate_field(message, "denials", json!(denials))
}

/// The same message with `metadata.cellgate.<key>` set, the rest of the metadata kept (a
/// metadata or `cellgate` value that is not an object is replaced by one).
fn with_cellgate_field(message: &Message, key: &str, value: serde_json::Value) -> Message {
    let mut metadata: serde_json::Value =
        serde_json::from_slice(&message.metadata).unwrap_or_else(|_| json!({}));
    if !metadata.is_object() {
        metadata = json!({});
    }
    if !metadata["cellgate"].is_object() {
        metadata["cellgate"] = json!({});
    }
    metadata["cellgate"][key] = value;
    let mut changed = message.clone();
    changed.metadata = Bytes::from(metadata.to_string());
    changed
}

fn timeout_content(evalue: &str) -> serde_json::Value {
    json!({
        "ename": "CellTimeoutError",
        "evalue": evalue,
        "traceback": [format!("CellTimeoutError: {evalue}")],
    })
}

/// The kernel's KeyboardInterrupt error, reported as the timeout it really was.
fn timeout_error(original: &Message, evalue: &str) -> Message {
    original.with_content(
        &timeout_content(evalue),
        &json!({"cellgate": {"outcome": Outcome::Timeout}}),
    )
}

/// The kernel's error execute_reply, reported as a timeout; the execution count is kept.
fn timeout_reply(original: &Message, evalue: &str) -> Message {
    let count = original
        .content_json()
        .and_then(|c| c.get("execution_count").cloned())
        .unwrap_or(serde_json::Value::Null);
    let mut content = timeout_content(evalue);
    content["status"] = json!("error");
    content["execution_count"] = count;
    original.with_content(
        &content,
        &json!({"cellgate": {"outcome": Outcome::Timeout}}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_are_the_documented_ones() {
        let names = |v: serde_json::Value| v.as_str().map(str::to_owned);
        let outcomes = [
            (Outcome::Timeout, "timeout"),
            (Outcome::Oom, "oom"),
            (Outcome::Pids, "pids"),
            (Outcome::SandboxLost, "sandbox_lost"),
            (Outcome::OutputTruncated, "output_truncated"),
        ];
        for (outcome, name) in outcomes {
            assert_eq!(names(json!(outcome)).as_deref(), Some(name));
        }
        let states = [
            ExecutionState::Starting,
            ExecutionState::Idle,
            ExecutionState::Busy,
            ExecutionState::Restarting,
            ExecutionState::Dead,
        ];
        for state in states {
            assert_eq!(names(json!(state)).as_deref(), Some(state.as_str()));
        }
        let denial = Denial {
            kind: DenialKind::Package,
            target: "x".to_owned(),
            policy: "p".to_owned(),
            reason: "no".to_owned(),
        };
        assert_eq!(
            json!(denial),
            json!({"kind": "package", "target": "x", "policy": "p", "reason": "no"})
        );
    }

    /// A kernel message whose parent is the execute request `parent`.
    fn of_execute(msg_type: &str, parent: &str, content: &str) -> Arc<Message> {
        let channel = if msg_type.ends_with("_reply") {
            Channel::Shell
        } else {
            Channel::Iopub
        };
        Arc::new(
            Message::from_parts(
                channel,
                Bytes::from(format!(r#"{{"msg_id":"m","msg_type":"{msg_type}"}}"#)),
                Bytes::from(format!(
                    r#"{{"msg_id":"{parent}","msg_type":"execute_request"}}"#
                )),
                Bytes::from_static(b"{}"),
                Bytes::from(content.to_owned()),
                vec![],
            )
            .unwrap(),
        )
    }

    fn request(id: &str) -> Message {
        Message::from_parts(
            Channel::Shell,
            Bytes::from(format!(
                r#"{{"msg_id":"{id}","msg_type":"execute_request"}}"#
            )),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            vec![],
        )
        .unwrap()
    }

    fn status(
        executions: &mut Executions,
        parent: &str,
        state: ExecutionState,
    ) -> Option<Released> {
        let content = json!({"execution_state": state}).to_string();
        let message = of_execute("status", parent, &content);
        let (released, verdict) = executions.on_iopub(message, Some(state), Some(parent));
        assert!(matches!(verdict, Verdict::Forward(_)), "{verdict:?}");
        released
    }

    fn outcome_of(message: &Message) -> serde_json::Value {
        let metadata: serde_json::Value = serde_json::from_slice(&message.metadata).unwrap();
        metadata["cellgate"]["outcome"].clone()
    }

    #[test]
    fn the_running_reply_waits_for_idle_and_carries_the_truncation() {
        let mut executions = Executions::new(Some(100));
        executions.on_request(&request("r1"));
        assert_eq!(executions.current().as_deref(), Some("r1"));
        assert!(status(&mut executions, "r1", ExecutionState::Busy).is_none());
        let reply = of_execute("execute_reply", "r1", r#"{"status":"ok"}"#);
        let (released, verdict) = executions.on_reply("r1", reply);
        assert!(released.is_none());
        assert!(matches!(verdict, Verdict::Hold));
        let big = format!(r#"{{"name":"stdout","text":"{}"}}"#, "x".repeat(200));
        let (_, first) = executions.on_iopub(of_execute("stream", "r1", &big), None, Some("r1"));
        let Verdict::DropAndMark(marker) = first else {
            panic!("the first output past the limit leaves a marker: {first:?}");
        };
        assert_eq!(outcome_of(&marker), "output_truncated");
        let (_, second) = executions.on_iopub(of_execute("stream", "r1", &big), None, Some("r1"));
        assert!(matches!(second, Verdict::Drop), "one marker only");
        let released = status(&mut executions, "r1", ExecutionState::Idle).expect("released");
        assert_eq!(released.parent, "r1");
        let Verdict::Forward(reply) = released.verdict else {
            panic!("{:?}", released.verdict);
        };
        assert_eq!(outcome_of(&reply), "output_truncated");
        assert_eq!(executions.current(), None);
    }

    #[test]
    fn denials_and_timeouts_reach_the_execution_they_belong_to() {
        let mut executions = Executions::new(None);
        let denial = Denial {
            kind: DenialKind::Egress,
            target: "h:1".to_owned(),
            policy: "p".to_owned(),
            reason: "no".to_owned(),
        };
        assert!(
            executions.record_denial(denial.clone()).is_none(),
            "nothing runs"
        );
        executions.on_request(&request("r1"));
        let line = executions
            .record_denial(denial.clone())
            .expect("a stderr line");
        assert_eq!(line.parent_msg_id(), Some("r1"));
        executions.mark_timed_out("r1", "too long".to_owned());
        let error = of_execute("error", "r1", r#"{"ename":"KeyboardInterrupt"}"#);
        let (_, verdict) = executions.on_iopub(error, None, Some("r1"));
        let Verdict::Forward(error) = verdict else {
            panic!("{verdict:?}");
        };
        assert_eq!(error.content_json().unwrap()["ename"], "CellTimeoutError");
        let (released, answers) = executions.fail_pending("E", "gone", Outcome::SandboxLost);
        assert!(released.is_none());
        assert_eq!(answers.len(), 1);
        let metadata: serde_json::Value =
            serde_json::from_slice(&answers[0].reply.metadata).unwrap();
        assert_eq!(metadata["cellgate"]["outcome"], "sandbox_lost");
        assert_eq!(metadata["cellgate"]["denials"], json!([denial]));
    }

    #[test]
    fn only_limits_restart_the_kernel() {
        assert_eq!(
            limit_exit(ExitCause::OutOfMemory).map(|l| l.outcome),
            Some(Outcome::Oom)
        );
        assert_eq!(
            limit_exit(ExitCause::PidsLimit).map(|l| l.outcome),
            Some(Outcome::Pids)
        );
        assert_eq!(limit_exit(ExitCause::Exited), None);
        assert_eq!(limit_exit(ExitCause::SandboxFailed), None);
    }

    fn denial(kind: DenialKind) -> Denial {
        Denial {
            kind,
            target: String::new(),
            policy: String::new(),
            reason: String::new(),
        }
    }

    /// A reply that ends as `end`: (status, ename, the gateway's outcome, denials).
    fn ending_as(end: CellEnd) -> (&'static str, &'static str, Option<Outcome>, Vec<Denial>) {
        let (egress, package) = (denial(DenialKind::Egress), denial(DenialKind::Package));
        match end {
            CellEnd::Ok => ("ok", "", None, vec![egress]),
            CellEnd::OutputTruncated => ("ok", "", Some(Outcome::OutputTruncated), vec![]),
            CellEnd::Error => ("error", "ValueError", Some(Outcome::Pids), vec![]),
            CellEnd::Interrupted => ("error", "KeyboardInterrupt", None, vec![]),
            CellEnd::Aborted { denied: false } => ("aborted", "", None, vec![]),
            CellEnd::Aborted { denied: true } => ("aborted", "", None, vec![egress]),
            CellEnd::Denied => ("ok", "", Some(Outcome::OutputTruncated), vec![package]),
            CellEnd::Timeout => ("ok", "", Some(Outcome::Timeout), vec![package]),
            CellEnd::Oom => ("error", "", Some(Outcome::Oom), vec![egress]),
            CellEnd::SandboxLost => ("error", "", Some(Outcome::SandboxLost), vec![]),
        }
    }

    #[test]
    fn every_cell_end_is_classified_and_counted() {
        for end in CellEnd::ALL {
            let (status, ename, outcome, denials) = ending_as(end);
            let classified = CellEnd::classify(Some(status), Some(ename), outcome, &denials);
            assert_eq!(classified, end);
            let counted = match end {
                CellEnd::Ok | CellEnd::OutputTruncated => ExecOutcome::ok,
                CellEnd::Error => ExecOutcome::error,
                CellEnd::Interrupted => ExecOutcome::interrupted,
                CellEnd::Aborted { .. } => ExecOutcome::aborted,
                CellEnd::Denied => ExecOutcome::denied,
                CellEnd::Timeout => ExecOutcome::timeout,
                CellEnd::Oom => ExecOutcome::oom,
                CellEnd::SandboxLost => ExecOutcome::lost,
            };
            assert_eq!(ExecOutcome::from(end), counted, "{end:?}");
        }
        // A failed cell that tried something refused is `denied`, whatever it raised; a
        // reply without a status failed.
        let egress = [denial(DenialKind::Egress)];
        let interrupted =
            CellEnd::classify(Some("error"), Some("KeyboardInterrupt"), None, &egress);
        assert_eq!(interrupted, CellEnd::Denied);
        assert_eq!(CellEnd::classify(None, None, None, &[]), CellEnd::Error);
    }
}
