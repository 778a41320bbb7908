//! Replay: run a notebook's code cells in order in a fresh kernel and compare each cell's
//! outputs with the notebook's.
//!
//! The engine ([`replay_with`]) drives any [`CellRunner`]; [`KernelRunner`] executes on a
//! kernel of the [`KernelManager`] through a [`KernelClient`], as one more client of it (so
//! the kernel's policy, timeouts and output limits apply as to any client, and a cell's
//! timeout interrupts it the way the client's does for API v1). It stops at the first
//! error unless the cell is tagged `raises-exception` or errors are allowed; later cells are
//! reported as skipped. Display updates of earlier cells are adopted, so outputs are
//! compared after the last cell.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use nbformat::v4;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::compare::compare_outputs;
use super::export::typed_outputs;
use super::parse::{write_notebook, ParsedNotebook};
use super::NotebookError;
use crate::kernel::history::OutputLog;
use crate::kernel::{
    ExecEvent, ExecuteOptions, ExecuteReply, Kernel, KernelClient, KernelManager, Outcome,
    POLICY_ENV,
};

/// How long a cell may run when neither the request nor the cell says.
pub const DEFAULT_CELL_TIMEOUT: Duration = Duration::from_secs(120);

/// What a replay is asked to do.
#[derive(Debug, Clone, Default)]
pub struct ReplayOptions {
    /// The policy the replay kernel runs under (`None`: the kernelspec's or `default`).
    pub policy: Option<String>,
    /// Keep going after errors in cells not tagged `raises-exception`.
    pub allow_errors: bool,
    /// Per-cell timeout unless the cell's `metadata.execution.timeout` says otherwise.
    pub timeout: Option<Duration>,
    /// Whose kernel the replay's is (`None`: the admin's). A tenant's replay kernel is its
    /// own like any other: listed for it, and counted against its kernel cap.
    pub owner: Option<crate::kernel::Owner>,
}

/// How one cell came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CellStatus {
    Same,
    Different,
    Error,
    Skipped,
}

/// One line of the replay report, per code cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CellReport {
    /// Position among all cells of the notebook.
    pub index: usize,
    pub id: String,
    pub status: CellStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub execution_count: Option<i64>,
}

/// Progress after each code cell.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    pub done: usize,
    pub total: usize,
    pub cell: CellReport,
}

/// The result of a replay.
#[derive(Debug, Clone)]
pub struct ReplayOutcome {
    /// The executed notebook, nbformat 4.5 JSON text.
    pub notebook: String,
    pub report: Vec<CellReport>,
    /// Every code cell came out `same`.
    pub matched: bool,
}

/// What running one cell produced.
#[derive(Debug, Clone, Default)]
pub struct CellRun {
    pub outputs: OutputLog,
    pub execution_count: Option<i64>,
    /// `ename: evalue` when the cell raised.
    pub error: Option<String>,
    /// The cell ran past its timeout (and was interrupted).
    pub timed_out: bool,
    /// Display updates (display id, data, metadata) for outputs of earlier cells.
    pub display_updates: Vec<(String, Value, Value)>,
    /// The kernel could not run the cell at all (it died, or stopped answering): the replay
    /// ends here whatever errors are allowed.
    pub kernel_lost: bool,
}

/// Executes code cells one after another in one kernel.
pub trait CellRunner {
    fn execute(
        &mut self,
        code: &str,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<CellRun, NotebookError>> + Send;

    /// The kernel's `language_info`, for the executed notebook's metadata.
    fn language_info(&self) -> Option<Value>;
}

/// A [`CellRunner`] on a gateway kernel, through its own [`KernelClient`].
pub struct KernelRunner {
    client: KernelClient,
}

impl KernelRunner {
    /// Attaches to `kernel`. Must be called inside a tokio runtime.
    pub fn new(kernel: Arc<Kernel>) -> KernelRunner {
        KernelRunner {
            client: KernelClient::attach(kernel),
        }
    }

    /// Adds one event of the cell to its run.
    fn apply(run: &mut CellRun, event: ExecEvent) {
        let (msg_type, content) = match event {
            ExecEvent::Stream { name, text } => ("stream", json!({"name": name, "text": text})),
            ExecEvent::Display {
                data,
                metadata,
                display_id,
                update: false,
            } => (
                "display_data",
                json!({"data": data, "metadata": metadata, "transient": {"display_id": display_id}}),
            ),
            ExecEvent::Display {
                data,
                metadata,
                display_id,
                update: true,
            } => {
                // Updates of earlier cells' displays (from a thread, say) belong to the
                // notebook too: the client hands them to this execution.
                if let Some(id) = display_id {
                    let (data, metadata) = (Value::Object(data), metadata);
                    run.outputs.update_display(&id, &data, &metadata);
                    run.display_updates.push((id, data, metadata));
                }
                return;
            }
            ExecEvent::Result {
                execution_count,
                data,
                metadata,
            } => (
                "execute_result",
                json!({"execution_count": execution_count, "data": data, "metadata": metadata}),
            ),
            ExecEvent::Error {
                ename,
                evalue,
                traceback,
            } => {
                run.error = Some(format!("{ename}: {evalue}"));
                (
                    "error",
                    json!({"ename": ename, "evalue": evalue, "traceback": traceback}),
                )
            }
            ExecEvent::ClearOutput { wait } => ("clear_output", json!({"wait": wait})),
            // Replays run with stdin off: `input()` raises in the kernel.
            ExecEvent::Busy | ExecEvent::InputRequest { .. } | ExecEvent::Done(_) => return,
        };
        run.outputs.apply(msg_type, content.to_string().as_bytes());
    }

    /// Completes the run from the cell's reply.
    fn finish(
        &self,
        run: &mut CellRun,
        reply: ExecuteReply,
        timeout: Duration,
        generation: u64,
    ) -> Result<(), NotebookError> {
        if reply.execution_count.is_some() {
            run.execution_count = reply.execution_count;
        }
        if reply.request_timed_out {
            if self.client.kernel().generation() != generation {
                // The cell ignored the interrupt and the client restarted the kernel.
                return Err(NotebookError::KernelLost(format!(
                    "no reply {} s after interrupting a cell that timed out",
                    self.client.kernel().interrupt_grace().as_secs()
                )));
            }
            run.timed_out = true;
            run.error = Some(format!(
                "CellTimeoutError: the cell ran longer than its timeout of {} s and was interrupted",
                timeout.as_secs()
            ));
            // The interrupt's error (the router's CellTimeoutError) stands for the timeout,
            // said in the replay's own words.
            run.outputs.outputs.retain(|o| {
                !matches!(
                    o.output.get("ename").and_then(Value::as_str),
                    Some("KeyboardInterrupt" | "CellTimeoutError")
                )
            });
            run.outputs.apply(
                "error",
                json!({"ename": "CellTimeoutError", "evalue": format!("the cell ran longer than its timeout of {} s", timeout.as_secs()), "traceback": []})
                    .to_string()
                    .as_bytes(),
            );
            return Ok(());
        }
        if self.client.is_closed() && reply.outcome == Some(Outcome::SandboxLost) {
            return Err(NotebookError::KernelLost("its queue closed".to_owned()));
        }
        if reply.status == "error" && run.error.is_none() {
            run.error = Some(format!(
                "{}: {}",
                reply.ename.as_deref().unwrap_or(""),
                reply.evalue.as_deref().unwrap_or("")
            ));
        }
        Ok(())
    }
}

impl CellRunner for KernelRunner {
    async fn execute(&mut self, code: &str, timeout: Duration) -> Result<CellRun, NotebookError> {
        let generation = self.client.kernel().generation();
        let options = ExecuteOptions {
            timeout: Some(timeout),
            allow_stdin: false,
            silent: false,
            adopt_display_updates: true,
            user_expressions: Default::default(),
        };
        let mut execution = self.client.execute(code, options).await?;
        let mut run = CellRun::default();
        // The client ends every execution with `Done`, also when the kernel goes away.
        while let Some(event) = execution.events.recv().await {
            match event {
                ExecEvent::Done(reply) => {
                    self.finish(&mut run, reply, timeout, generation)?;
                    return Ok(run);
                }
                event => Self::apply(&mut run, event),
            }
        }
        Err(NotebookError::KernelLost("its queue closed".to_owned()))
    }

    fn language_info(&self) -> Option<Value> {
        self.client
            .kernel()
            .router()
            .history()
            .snapshot()
            .language_info
    }
}

fn cell_timeout(metadata: &v4::CellMetadata, default: Duration) -> Duration {
    let from_cell = metadata
        .execution
        .as_ref()
        .and_then(|e| e.additional.get("timeout"))
        .or_else(|| metadata.additional.get("timeout"))
        .and_then(Value::as_f64)
        .filter(|t| *t > 0.0 && t.is_finite());
    from_cell.map_or(default, |secs| Duration::from_secs_f64(secs.min(86_400.0)))
}

/// A code cell that ran: its line in the report, its position in the notebook, its outputs.
struct Executed {
    line: usize,
    index: usize,
    outputs: OutputLog,
}

/// Runs the notebook's code cells on `runner` and compares; `progress` hears after each cell.
pub async fn replay_with<R: CellRunner>(
    runner: &mut R,
    parsed: ParsedNotebook,
    options: &ReplayOptions,
    progress: Option<&mpsc::UnboundedSender<Progress>>,
) -> Result<ReplayOutcome, NotebookError> {
    let ParsedNotebook {
        mut notebook,
        original_outputs,
        ..
    } = parsed;
    let default_timeout = options.timeout.unwrap_or(DEFAULT_CELL_TIMEOUT);
    let total = notebook
        .cells
        .iter()
        .filter(|c| matches!(c, v4::Cell::Code { .. }))
        .count();
    let mut report = Vec::with_capacity(total);
    let mut executed = Vec::new();
    let mut stopped = false;
    for (index, cell) in notebook.cells.iter_mut().enumerate() {
        let v4::Cell::Code {
            id,
            metadata,
            execution_count,
            source,
            outputs,
        } = cell
        else {
            continue;
        };
        let code: String = source.concat();
        let expected = original_outputs.get(index).cloned().unwrap_or_default();
        let mut line = CellReport {
            index,
            id: id.to_string(),
            status: CellStatus::Skipped,
            diff: None,
            error: None,
            execution_count: None,
        };
        if stopped || code.trim().is_empty() {
            // Jupyter does not send empty cells to the kernel either.
            *execution_count = None;
            outputs.clear();
            if !stopped {
                compare_into(&mut line, &expected, &[]);
            }
        } else {
            let timeout = cell_timeout(metadata, default_timeout);
            let run = run_cell(runner, &code, timeout, &mut executed).await;
            line.execution_count = run.execution_count;
            let tagged = metadata
                .tags
                .as_ref()
                .is_some_and(|t| t.iter().any(|t| t == "raises-exception"));
            stopped = judge(&mut line, &run, &expected, tagged, options.allow_errors);
            *execution_count = run.execution_count.and_then(|c| i32::try_from(c).ok());
            executed.push(Executed {
                line: report.len(),
                index,
                outputs: run.outputs,
            });
        }
        report.push(line.clone());
        if let Some(progress) = progress {
            let _ = progress.send(Progress {
                done: report.len(),
                total,
                cell: line,
            });
        }
    }
    write_outputs(&mut notebook, &mut report, executed, &original_outputs);
    if let Some(info) = runner
        .language_info()
        .and_then(|i| serde_json::from_value::<v4::LanguageInfo>(i).ok())
    {
        notebook.metadata.language_info = Some(info);
    }
    let matched = report.iter().all(|r| r.status == CellStatus::Same);
    Ok(ReplayOutcome {
        notebook: write_notebook(notebook)?,
        report,
        matched,
    })
}

/// Runs one cell; its display updates go to the outputs of the cells before it.
async fn run_cell<R: CellRunner>(
    runner: &mut R,
    code: &str,
    timeout: Duration,
    executed: &mut [Executed],
) -> CellRun {
    let run = match runner.execute(code, timeout).await {
        Ok(run) => run,
        // The report so far is worth more than an error for the whole replay.
        Err(err) => CellRun {
            error: Some(err.to_string()),
            kernel_lost: true,
            ..CellRun::default()
        },
    };
    for (display_id, data, meta) in &run.display_updates {
        for cell in executed.iter_mut() {
            cell.outputs.update_display(display_id, data, meta);
        }
    }
    run
}

/// Reports how a cell that ran came out; whether the replay stops after it. An error stops
/// it unless the cell is tagged `raises-exception` (`tagged`) or errors are allowed; a lost
/// kernel always does.
fn judge(
    line: &mut CellReport,
    run: &CellRun,
    expected: &[Value],
    tagged: bool,
    allow_errors: bool,
) -> bool {
    match (&run.error, tagged || allow_errors) {
        (Some(error), _) if run.kernel_lost => {
            line.status = CellStatus::Error;
            line.error = Some(error.clone());
            true
        }
        (Some(error), false) => {
            line.status = CellStatus::Error;
            line.error = Some(error.clone());
            true
        }
        (Some(_), true) if run.timed_out => {
            line.status = CellStatus::Error;
            line.error = run.error.clone();
            !allow_errors
        }
        _ => {
            line.error = run.error.clone();
            compare_into(line, expected, &run.outputs.to_json());
            false
        }
    }
}

/// `line`'s status (and diff) from comparing `produced` with the notebook's outputs.
fn compare_into(line: &mut CellReport, expected: &[Value], produced: &[Value]) {
    line.diff = compare_outputs(expected, produced);
    line.status = if line.diff.is_none() {
        CellStatus::Same
    } else {
        CellStatus::Different
    };
}

/// Writes each executed cell's outputs into the notebook. Display updates may have changed
/// earlier cells' outputs, so those compared are compared again (progress reported the
/// comparison as it stood then).
fn write_outputs(
    notebook: &mut v4::Notebook,
    report: &mut [CellReport],
    executed: Vec<Executed>,
    original_outputs: &[Vec<Value>],
) {
    for cell in executed {
        let produced = cell.outputs.to_json();
        let line = &mut report[cell.line];
        if matches!(line.status, CellStatus::Same | CellStatus::Different) {
            let expected = original_outputs
                .get(cell.index)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            compare_into(line, expected, &produced);
        }
        if let Some(v4::Cell::Code { outputs, .. }) = notebook.cells.get_mut(cell.index) {
            *outputs = typed_outputs(&produced);
        }
    }
}

/// The kernelspec to replay on: the notebook's by name; else, because kernelspec names differ
/// between machines (`python3`, `conda-env-x-py`, …), one of the notebook's language; else
/// the default when the notebook names none.
fn kernel_for(
    specs: &crate::kernel::KernelSpecs,
    metadata: &v4::Metadata,
) -> Result<Option<String>, NotebookError> {
    let Some(wanted) = &metadata.kernelspec else {
        return Ok(None);
    };
    if specs.get(&wanted.name).is_some() {
        return Ok(Some(wanted.name.clone()));
    }
    let language = wanted
        .language
        .clone()
        .or_else(|| metadata.language_info.as_ref().map(|l| l.name.clone()));
    let same_language = |spec: &&crate::kernel::KernelSpec| {
        language
            .as_deref()
            .is_some_and(|l| spec.language.eq_ignore_ascii_case(l))
    };
    let by_language = specs
        .get(specs.default_name())
        .filter(same_language)
        .or_else(|| specs.iter().find(same_language));
    match by_language {
        Some(spec) => {
            tracing::info!(wanted = %wanted.name, using = %spec.name, "replaying on a kernelspec of the notebook's language");
            Ok(Some(spec.name.clone()))
        }
        None => Err(NotebookError::UnknownKernel {
            name: wanted.name.clone(),
            available: specs.names().join(", "),
        }),
    }
}

/// Replays a notebook in a fresh kernel of `manager` (see `kernel_for` for which) under
/// `options.policy`; the kernel is shut down after.
pub async fn replay(
    manager: &Arc<KernelManager>,
    parsed: ParsedNotebook,
    options: &ReplayOptions,
    progress: Option<&mpsc::UnboundedSender<Progress>>,
) -> Result<ReplayOutcome, NotebookError> {
    let kernel = start_kernel(manager, &parsed, options).await?;
    replay_in(manager, kernel, parsed, options, progress).await
}

/// Starts the kernel a replay of `parsed` runs in (its owner's caps apply: refused past
/// them). Separate from [`replay_in`] so a caller can answer a refusal before it starts
/// streaming.
pub async fn start_kernel(
    manager: &Arc<KernelManager>,
    parsed: &ParsedNotebook,
    options: &ReplayOptions,
) -> Result<Arc<Kernel>, NotebookError> {
    let name = kernel_for(manager.specs(), &parsed.notebook.metadata)?;
    let mut env = BTreeMap::new();
    if let Some(policy) = &options.policy {
        env.insert(POLICY_ENV.to_owned(), policy.clone());
    }
    Ok(manager
        .start_for(name.as_deref(), &env, options.owner.as_ref())
        .await?)
}

/// Replays `parsed` in `kernel` (from [`start_kernel`]) and shuts the kernel down after.
pub async fn replay_in(
    manager: &Arc<KernelManager>,
    kernel: Arc<Kernel>,
    parsed: ParsedNotebook,
    options: &ReplayOptions,
    progress: Option<&mpsc::UnboundedSender<Progress>>,
) -> Result<ReplayOutcome, NotebookError> {
    let result = async {
        kernel.wait_ready().await?;
        let mut runner = KernelRunner::new(kernel.clone());
        replay_with(&mut runner, parsed, options, progress).await
    }
    .await;
    if let Err(err) = manager.shutdown(kernel.id.as_str()).await {
        tracing::warn!(kernel_id = %kernel.id, %err, "could not shut the replay kernel down");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notebook::parse_notebook;

    /// Answers each cell from a script: (stdout, error).
    struct Scripted {
        answers: Vec<(&'static str, Option<&'static str>)>,
        count: i64,
    }

    impl CellRunner for Scripted {
        async fn execute(
            &mut self,
            _code: &str,
            _timeout: Duration,
        ) -> Result<CellRun, NotebookError> {
            let (text, error) = self.answers.remove(0);
            self.count += 1;
            let mut run = CellRun {
                execution_count: Some(self.count),
                ..CellRun::default()
            };
            if !text.is_empty() {
                run.outputs.apply(
                    "stream",
                    json!({"name": "stdout", "text": text})
                        .to_string()
                        .as_bytes(),
                );
            }
            if let Some(error) = error {
                run.outputs.apply(
                    "error",
                    json!({"ename": "ValueError", "evalue": error, "traceback": []})
                        .to_string()
                        .as_bytes(),
                );
                run.error = Some(format!("ValueError: {error}"));
            }
            Ok(run)
        }
        fn language_info(&self) -> Option<Value> {
            Some(json!({"name": "python"}))
        }
    }

    /// A kernel that dies on the second cell.
    struct Dying(usize);

    impl CellRunner for Dying {
        async fn execute(
            &mut self,
            _code: &str,
            _timeout: Duration,
        ) -> Result<CellRun, NotebookError> {
            self.0 += 1;
            if self.0 == 2 {
                return Err(NotebookError::KernelLost("gone".to_owned()));
            }
            Ok(CellRun::default())
        }
        fn language_info(&self) -> Option<Value> {
            None
        }
    }

    #[tokio::test]
    async fn a_lost_kernel_ends_the_replay_with_a_report() {
        let nb = json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
            code("a", json!([]), &[]), code("b", json!([]), &[]), code("c", json!([]), &[]),
        ]});
        let parsed = parse_notebook(&nb.to_string()).unwrap();
        let options = ReplayOptions {
            allow_errors: true,
            ..ReplayOptions::default()
        };
        let outcome = replay_with(&mut Dying(0), parsed, &options, None)
            .await
            .unwrap();
        let statuses: Vec<CellStatus> = outcome.report.iter().map(|r| r.status).collect();
        assert_eq!(
            statuses,
            vec![CellStatus::Same, CellStatus::Error, CellStatus::Skipped]
        );
        assert!(outcome.report[1].error.as_deref().unwrap().contains("gone"));
    }

    fn code(source: &str, outputs: Value, tags: &[&str]) -> Value {
        json!({"cell_type": "code", "id": uuid::Uuid::new_v4().simple().to_string(), "metadata": {"tags": tags},
               "source": source, "execution_count": 1, "outputs": outputs})
    }

    fn stdout(text: &str) -> Value {
        json!([{"output_type": "stream", "name": "stdout", "text": text}])
    }

    #[tokio::test]
    async fn stops_at_an_untagged_error_and_skips_the_rest() {
        let nb = json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
            code("print(1)", stdout("1\n"), &[]),
            {"cell_type": "markdown", "id": "md", "metadata": {}, "source": "# hi"},
            code("raise", json!([{"output_type": "error", "ename": "ValueError", "evalue": "x", "traceback": []}]), &["raises-exception"]),
            code("print(2)", stdout("2\n"), &[]),
            code("bad", json!([]), &[]),
            code("print(3)", stdout("3\n"), &[]),
        ]});
        let parsed = parse_notebook(&nb.to_string()).unwrap();
        let mut runner = Scripted {
            answers: vec![
                ("1\n", None),
                ("", Some("x")),
                ("two\n", None),
                ("", Some("boom")),
            ],
            count: 0,
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let outcome = replay_with(&mut runner, parsed, &ReplayOptions::default(), Some(&tx))
            .await
            .unwrap();
        let statuses: Vec<CellStatus> = outcome.report.iter().map(|r| r.status).collect();
        use CellStatus::*;
        assert_eq!(statuses, vec![Same, Same, Different, Error, Skipped]);
        assert!(!outcome.matched);
        assert!(outcome.report[2].diff.as_deref().unwrap().contains("two"));
        assert_eq!(outcome.report[3].error.as_deref(), Some("ValueError: boom"));
        let mut seen = 0;
        while let Ok(p) = rx.try_recv() {
            seen += 1;
            assert_eq!((p.done, p.total), (seen, 5));
        }
        assert_eq!(seen, 5);
        let written: Value = serde_json::from_str(&outcome.notebook).unwrap();
        assert_eq!(written["nbformat_minor"], 5);
        assert_eq!(written["cells"][1]["cell_type"], "markdown");
        assert_eq!(written["cells"][5]["execution_count"], Value::Null);
    }
}
