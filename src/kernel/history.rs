//! A kernel's execution history: every cell a client executed, with its outputs assembled the
//! way a notebook frontend assembles them, kept for notebook export.
//!
//! The [`Router`](super::Router) taps three points: `register_request` (every client's
//! `execute_request`; the gateway's own requests never pass there, silent executions are
//! skipped), the iopub broadcast (exactly what clients are shown, including the gateway's
//! substituted timeout errors and truncation markers) and shell replies (`execute_reply` for the
//! execution count, `kernel_info_reply` for `language_info`, also from the gateway's readiness
//! probe). The tap is cheap on the hot path: a message type it does not record costs one string
//! match, and content is parsed only for recorded types and only when the parent is a
//! recorded execution; it has its own lock, taken under the router's (`cargo bench --bench
//! history`: ~4 ns for an unrecorded type, ~40 ns for an untracked status, ~0.4 µs per
//! recorded stream message, on the shared 2-core dev machine).
//!
//! Outputs are assembled as a frontend does: streams merged, `clear_output` with `wait`
//! honoured, `update_display_data` applied to earlier cells by display id.
//!
//! Memory is bounded: outputs and sources count against [`MAX_HISTORY_BYTES`] (64 MiB) per
//! kernel; past it outputs are replaced by one note per cell and the history says it was
//! truncated.
//!
//! A history outlives its kernel through the state directory's store: cells are written out
//! as JSON ([`RecordedCell::to_stored`], read back by [`RecordedCell::from_stored`]) and a
//! session's new kernel after a gateway restart starts from them ([`History::restore`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use time::OffsetDateTime;

use super::execution::ExecutionState;
use crate::protocol::Message;
use crate::timestamp::format_timestamp;

/// Bytes of sources and outputs one kernel's history keeps.
pub const MAX_HISTORY_BYTES: usize = 64 << 20;
/// Past this, even sources are no longer kept (cells are counted as dropped).
const MAX_HISTORY_HARD_BYTES: usize = 2 * MAX_HISTORY_BYTES;
/// Executions still waiting for their reply or idle status; older ones are closed, so a
/// kernel that never answers cannot make the table grow.
const MAX_OPEN: usize = 1024;

/// The text that stands in for outputs the history had no room for.
fn dropped_note() -> Value {
    json!({
        "output_type": "stream",
        "name": "stderr",
        "text": format!(
            "[cellgate] the rest of this cell's output was not recorded: the session history passed its limit of {} MiB\n",
            MAX_HISTORY_BYTES >> 20
        ),
    })
}

/// One output in nbformat shape, plus the display id updates address it by.
#[derive(Debug, Clone)]
pub struct RecordedOutput {
    pub output: Arc<Value>,
    pub display_id: Option<String>,
}

/// A cell's outputs as a frontend shows them: consecutive streams of one name merged,
/// `clear_output` honoured (with `wait=True`, at the next output).
#[derive(Debug, Clone, Default)]
pub struct OutputLog {
    pub outputs: Vec<RecordedOutput>,
    clear_pending: bool,
}

/// Roughly how many bytes a JSON value takes, for the memory bound.
fn approx_size(value: &Value) -> usize {
    match value {
        Value::String(s) => s.len() + 2,
        Value::Array(items) => items.iter().map(approx_size).sum::<usize>() + 2,
        Value::Object(map) => map.iter().map(|(k, v)| k.len() + 4 + approx_size(v)).sum(),
        _ => 8,
    }
}

#[derive(Deserialize)]
struct StreamContent<'a> {
    #[serde(borrow)]
    name: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    text: std::borrow::Cow<'a, str>,
}

impl OutputLog {
    /// Whether `msg_type` is an iopub message that changes a cell's outputs.
    pub fn records(msg_type: &str) -> bool {
        matches!(
            msg_type,
            "stream" | "display_data" | "execute_result" | "error" | "clear_output"
        )
    }

    fn take_clear(&mut self) -> usize {
        if !self.clear_pending {
            return 0;
        }
        self.clear_pending = false;
        self.clear()
    }

    fn clear(&mut self) -> usize {
        let freed = self.outputs.iter().map(|o| approx_size(&o.output)).sum();
        self.outputs.clear();
        freed
    }

    /// Applies one iopub message (`content` is its raw JSON). Returns the bytes added and
    /// freed, or `None` when the content does not parse.
    pub fn apply(&mut self, msg_type: &str, content: &[u8]) -> Option<(usize, usize)> {
        if msg_type == "stream" {
            let stream: StreamContent<'_> = serde_json::from_slice(content).ok()?;
            let freed = self.take_clear();
            if let Some(last) = self.outputs.last_mut() {
                let same = last.output.get("output_type").and_then(Value::as_str) == Some("stream")
                    && last.output.get("name").and_then(Value::as_str) == Some(&stream.name);
                if same {
                    let output = Arc::make_mut(&mut last.output);
                    if let Some(Value::String(text)) = output.get_mut("text") {
                        text.push_str(&stream.text);
                        return Some((stream.text.len(), freed));
                    }
                }
            }
            let output = json!({"output_type": "stream", "name": stream.name, "text": stream.text});
            let added = approx_size(&output);
            self.outputs.push(RecordedOutput {
                output: Arc::new(output),
                display_id: None,
            });
            return Some((added, freed));
        }
        let content: Map<String, Value> = serde_json::from_slice(content).ok()?;
        if msg_type == "clear_output" {
            if content.get("wait").and_then(Value::as_bool) == Some(true) {
                self.clear_pending = true;
                return Some((0, 0));
            }
            self.clear_pending = false;
            return Some((0, self.clear()));
        }
        let (output, display_id) = to_output(msg_type, content)?;
        let freed = self.take_clear();
        let added = approx_size(&output);
        self.outputs.push(RecordedOutput {
            output: Arc::new(output),
            display_id,
        });
        Some((added, freed))
    }

    /// Replaces data and metadata of every output showing `display_id`; returns bytes added
    /// and freed.
    pub fn update_display(
        &mut self,
        display_id: &str,
        data: &Value,
        metadata: &Value,
    ) -> (usize, usize) {
        let (mut added, mut freed) = (0, 0);
        for recorded in &mut self.outputs {
            if recorded.display_id.as_deref() != Some(display_id) {
                continue;
            }
            let output = Arc::make_mut(&mut recorded.output);
            freed += approx_size(output);
            output["data"] = data.clone();
            output["metadata"] = metadata.clone();
            added += approx_size(output);
        }
        (added, freed)
    }

    /// The outputs as nbformat JSON.
    pub fn to_json(&self) -> Vec<Value> {
        self.outputs.iter().map(|o| (*o.output).clone()).collect()
    }

    /// Pushes an output the gateway made (a note), counted by the caller.
    fn push_note(&mut self, note: Value) {
        self.outputs.push(RecordedOutput {
            output: Arc::new(note),
            display_id: None,
        });
    }
}

/// An iopub output message's content in nbformat shape, and its display id.
fn to_output(msg_type: &str, mut content: Map<String, Value>) -> Option<(Value, Option<String>)> {
    let display_id = content
        .get("transient")
        .and_then(|t| t.get("display_id"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let object = |v: Option<Value>| match v {
        Some(Value::Object(m)) => Value::Object(m),
        _ => json!({}),
    };
    let output = match msg_type {
        "display_data" => json!({
            "output_type": "display_data",
            "data": object(content.remove("data")),
            "metadata": object(content.remove("metadata")),
        }),
        "execute_result" => json!({
            "output_type": "execute_result",
            "execution_count": content.remove("execution_count").filter(Value::is_i64).unwrap_or(Value::Null),
            "data": object(content.remove("data")),
            "metadata": object(content.remove("metadata")),
        }),
        "error" => json!({
            "output_type": "error",
            "ename": content.remove("ename").filter(Value::is_string).unwrap_or_else(|| json!("")),
            "evalue": content.remove("evalue").filter(Value::is_string).unwrap_or_else(|| json!("")),
            "traceback": content
                .remove("traceback")
                .and_then(|t| t.as_array().map(|a| a.iter().filter(|l| l.is_string()).cloned().collect::<Vec<_>>()))
                .map(Value::Array)
                .unwrap_or_else(|| json!([])),
        }),
        _ => return None,
    };
    Some((output, display_id))
}

/// One executed cell.
#[derive(Debug, Clone)]
pub struct RecordedCell {
    /// A cell id for nbformat 4.5: the frontend's own (JupyterLab sends `metadata.cellId`)
    /// when it is valid and unused, else a fresh one.
    pub id: String,
    pub source: String,
    pub execution_count: Option<i64>,
    pub outputs: OutputLog,
    /// nbformat `metadata.execution` timestamps, as JupyterLab records them.
    pub timing: Map<String, Value>,
    /// Outputs were dropped for the memory bound.
    pub outputs_dropped: bool,
    replied: bool,
    idle: bool,
    aborted: bool,
}

/// A cell as the store keeps it (what export needs; display ids do not outlive the kernel
/// that could update them).
#[derive(Serialize, Deserialize)]
struct StoredCell {
    id: String,
    source: String,
    execution_count: Option<i64>,
    outputs: Vec<Value>,
    #[serde(default)]
    timing: Map<String, Value>,
    #[serde(default)]
    outputs_dropped: bool,
    #[serde(default)]
    aborted: bool,
}

impl RecordedCell {
    /// Whether the kernel aborted it (it never ran; export leaves it out).
    pub fn aborted(&self) -> bool {
        self.aborted
    }

    /// The cell as the store keeps it.
    pub fn to_stored(&self) -> Value {
        let stored = StoredCell {
            id: self.id.clone(),
            source: self.source.clone(),
            execution_count: self.execution_count,
            outputs: self.outputs.to_json(),
            timing: self.timing.clone(),
            outputs_dropped: self.outputs_dropped,
            aborted: self.aborted,
        };
        serde_json::to_value(stored).unwrap_or(Value::Null)
    }

    /// A cell the store kept, finished; `None` if it is not one.
    pub fn from_stored(value: Value) -> Option<RecordedCell> {
        let stored: StoredCell = serde_json::from_value(value).ok()?;
        Some(RecordedCell {
            id: stored.id,
            source: stored.source,
            execution_count: stored.execution_count,
            outputs: OutputLog {
                outputs: stored
                    .outputs
                    .into_iter()
                    .map(|output| RecordedOutput {
                        output: Arc::new(output),
                        display_id: None,
                    })
                    .collect(),
                clear_pending: false,
            },
            timing: stored.timing,
            outputs_dropped: stored.outputs_dropped,
            replied: true,
            idle: true,
            aborted: stored.aborted,
        })
    }
}

/// A copy of a history, taken for export.
#[derive(Debug, Clone, Default)]
pub struct HistorySnapshot {
    pub cells: Vec<RecordedCell>,
    /// The kernel's `language_info` from its latest `kernel_info_reply`.
    pub language_info: Option<Value>,
    /// Outputs (or whole cells) were dropped for the memory bound.
    pub truncated: bool,
    pub cells_dropped: u64,
}

#[derive(Default)]
struct Inner {
    cells: Vec<RecordedCell>,
    /// Executions still expecting messages: msg_id → index in `cells`.
    open: HashMap<String, usize>,
    open_order: VecDeque<String>,
    /// Cells that showed a display id, for `update_display_data`.
    displays: HashMap<String, Vec<usize>>,
    language_info: Option<Value>,
    bytes: usize,
    truncated: bool,
    cells_dropped: u64,
}

/// The recorder of one kernel.
#[derive(Default)]
pub struct History {
    inner: Mutex<Inner>,
}

#[derive(Deserialize)]
struct ExecuteRequest {
    #[serde(default)]
    code: String,
    #[serde(default)]
    silent: bool,
}

#[derive(Deserialize)]
struct RequestMetadata {
    #[serde(default, rename = "cellId")]
    cell_id: Option<String>,
}

fn now() -> Value {
    Value::String(format_timestamp(OffsetDateTime::now_utc()))
}

fn valid_cell_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

impl History {
    pub fn new() -> History {
        History::default()
    }

    /// Records a client's `execute_request` (silent ones leave no history, as in Jupyter).
    pub fn on_request(&self, message: &Message) {
        if message.msg_type() != "execute_request" {
            return;
        }
        let Ok(request) = serde_json::from_slice::<ExecuteRequest>(&message.content) else {
            return;
        };
        if request.silent {
            return;
        }
        let wanted_id = serde_json::from_slice::<RequestMetadata>(&message.metadata)
            .ok()
            .and_then(|m| m.cell_id)
            .filter(|id| valid_cell_id(id));
        let mut inner = self.inner.lock();
        let size = request.code.len();
        if inner.bytes + size > MAX_HISTORY_HARD_BYTES {
            inner.truncated = true;
            inner.cells_dropped += 1;
            return;
        }
        inner.bytes += size;
        let id = match wanted_id {
            Some(id) if !inner.cells.iter().any(|c| c.id == id) => id,
            _ => uuid::Uuid::new_v4().simple().to_string()[..16].to_owned(),
        };
        let timing = Map::new();
        let index = inner.cells.len();
        inner.cells.push(RecordedCell {
            id,
            source: request.code,
            execution_count: None,
            outputs: OutputLog::default(),
            timing,
            outputs_dropped: false,
            replied: false,
            idle: false,
            aborted: false,
        });
        if inner.open.len() >= MAX_OPEN {
            if let Some(old) = inner.open_order.pop_front() {
                inner.open.remove(&old);
            }
        }
        let msg_id = message.msg_id().to_owned();
        inner.open_order.push_back(msg_id.clone());
        inner.open.insert(msg_id, index);
    }

    /// Records an iopub message as clients see it.
    pub fn on_iopub(&self, message: &Message) {
        let msg_type = message.msg_type();
        let relevant = OutputLog::records(msg_type)
            || matches!(msg_type, "update_display_data" | "execute_input" | "status");
        if !relevant {
            return;
        }
        let mut inner = self.inner.lock();
        if msg_type == "update_display_data" {
            Self::update_display(&mut inner, &message.content);
            return;
        }
        let Some(parent) = message.parent_msg_id() else {
            return;
        };
        // Content is parsed only past this point: the message belongs to a recorded execution.
        let Some(&index) = inner.open.get(parent) else {
            return;
        };
        if msg_type == "status" {
            let (key, idle) = match ExecutionState::of_status(message) {
                Some(ExecutionState::Busy) => ("iopub.status.busy", false),
                Some(ExecutionState::Idle) => ("iopub.status.idle", true),
                Some(
                    ExecutionState::Starting | ExecutionState::Restarting | ExecutionState::Dead,
                )
                | None => return,
            };
            let cell = &mut inner.cells[index];
            cell.timing.insert(key.to_owned(), now());
            if idle {
                cell.idle = true;
            } else {
                // The kernel started another execution: the finished ones get nothing more.
                Self::close_finished(&mut inner, index);
            }
            return;
        }
        if msg_type == "execute_input" {
            let count = message
                .content_json()
                .and_then(|c| c.get("execution_count").and_then(Value::as_i64));
            let cell = &mut inner.cells[index];
            cell.timing.insert("iopub.execute_input".to_owned(), now());
            if count.is_some() {
                cell.execution_count = count;
            }
            return;
        }
        if inner.bytes + message.content.len() > MAX_HISTORY_BYTES && msg_type != "clear_output" {
            inner.truncated = true;
            let cell = &mut inner.cells[index];
            if !cell.outputs_dropped {
                cell.outputs_dropped = true;
                cell.outputs.push_note(dropped_note());
            }
            return;
        }
        let cell = &mut inner.cells[index];
        let Some((added, freed)) = cell.outputs.apply(msg_type, &message.content) else {
            return;
        };
        let display_id = cell
            .outputs
            .outputs
            .last()
            .and_then(|o| o.display_id.clone())
            .filter(|_| matches!(msg_type, "display_data" | "execute_result"));
        inner.bytes = (inner.bytes + added).saturating_sub(freed);
        if let Some(display_id) = display_id {
            let cells = inner.displays.entry(display_id).or_default();
            if cells.last() != Some(&index) {
                cells.push(index);
            }
        }
    }

    fn update_display(inner: &mut Inner, content: &[u8]) {
        let Ok(content) = serde_json::from_slice::<Value>(content) else {
            return;
        };
        let Some(display_id) = content
            .get("transient")
            .and_then(|t| t.get("display_id"))
            .and_then(Value::as_str)
        else {
            return;
        };
        let Some(indices) = inner.displays.get(display_id).cloned() else {
            return;
        };
        let data = content.get("data").cloned().unwrap_or_else(|| json!({}));
        let metadata = content
            .get("metadata")
            .cloned()
            .unwrap_or_else(|| json!({}));
        for index in indices {
            let (added, freed) = inner.cells[index]
                .outputs
                .update_display(display_id, &data, &metadata);
            inner.bytes = (inner.bytes + added).saturating_sub(freed);
        }
    }

    /// Records a shell reply: the execution count, and `language_info` from any
    /// `kernel_info_reply` (the gateway's readiness probe included).
    pub fn on_reply(&self, message: &Message) {
        match message.msg_type() {
            "kernel_info_reply" => {
                let info = message
                    .content_json()
                    .and_then(|mut c| c.get_mut("language_info").map(Value::take))
                    .filter(Value::is_object);
                if info.is_some() {
                    self.inner.lock().language_info = info;
                }
            }
            "execute_reply" => {
                let Some(parent) = message.parent_msg_id() else {
                    return;
                };
                let mut inner = self.inner.lock();
                let Some(&index) = inner.open.get(parent) else {
                    return;
                };
                let content = message.content_json().unwrap_or_default();
                let cell = &mut inner.cells[index];
                if let Some(count) = content.get("execution_count").and_then(Value::as_i64) {
                    cell.execution_count = Some(count);
                }
                cell.aborted = content.get("status").and_then(Value::as_str) == Some("aborted");
                cell.timing.insert("shell.execute_reply".to_owned(), now());
                cell.replied = true;
            }
            _ => {}
        }
    }

    /// Closes every cell but `running` that has its reply and its `idle`. A finished cell
    /// stays open until the kernel starts another one, not only until its `idle`: Deno's
    /// kernel publishes a cell's value and `console.log` lines after the cell's `idle`
    /// (kernels/deno/README.md), always before it starts the next execution.
    fn close_finished(inner: &mut Inner, running: usize) {
        let Inner {
            cells,
            open,
            open_order,
            ..
        } = inner;
        open.retain(|_, index| *index == running || !(cells[*index].replied && cells[*index].idle));
        open_order.retain(|msg_id| open.contains_key(msg_id));
    }

    /// Starts a fresh kernel's history from the cells an earlier kernel of the same session
    /// recorded (they are finished: nothing more reaches them).
    pub fn restore(&self, cells: Vec<RecordedCell>, language_info: Option<Value>) {
        let mut inner = self.inner.lock();
        let bytes: usize = cells
            .iter()
            .map(|c| {
                c.source.len()
                    + c.outputs
                        .outputs
                        .iter()
                        .map(|o| approx_size(&o.output))
                        .sum::<usize>()
            })
            .sum();
        inner.bytes += bytes;
        let mut restored = cells;
        restored.append(&mut inner.cells);
        inner.cells = restored;
        // Indices of cells recorded before the restore moved up (there are none in a fresh
        // kernel but its readiness probe's, which records no cell).
        inner.open.clear();
        inner.open_order.clear();
        inner.displays.clear();
        if inner.language_info.is_none() {
            inner.language_info = language_info;
        }
    }

    /// How many cells were recorded so far.
    pub fn len(&self) -> usize {
        self.inner.lock().cells.len()
    }

    /// Whether no cell was recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The finished cells from index `from` on, below `upto` (aborted ones included, as
    /// recorded), the index after the last, and `language_info`: what the store writes
    /// after each execution. It stops at the first cell without its reply and its `idle`:
    /// the store's writer runs this later than the execution it writes for ended, when the
    /// kernel may be running the next cell, which must be written whole with its own
    /// execution, not now without its outputs.
    pub fn tail(&self, from: usize, upto: usize) -> (Vec<RecordedCell>, usize, Option<Value>) {
        let inner = self.inner.lock();
        let upto = upto.min(inner.cells.len());
        let cells: Vec<RecordedCell> = inner
            .cells
            .get(from..upto)
            .unwrap_or_default()
            .iter()
            .take_while(|cell| cell.replied && cell.idle)
            .cloned()
            .collect();
        let next = from + cells.len();
        (cells, next, inner.language_info.clone())
    }

    /// A copy for export. Cells the kernel aborted (never ran) are left out.
    pub fn snapshot(&self) -> HistorySnapshot {
        let inner = self.inner.lock();
        HistorySnapshot {
            cells: inner.cells.iter().filter(|c| !c.aborted).cloned().collect(),
            language_info: inner.language_info.clone(),
            truncated: inner.truncated,
            cells_dropped: inner.cells_dropped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Channel;

    #[test]
    fn a_stored_history_comes_back_before_the_new_kernels_cells() {
        let history = History::new();
        let first = request("print('a')");
        history.on_request(&first);
        history.on_iopub(&iopub(
            &first,
            "stream",
            json!({"name": "stdout", "text": "a\n"}),
        ));
        finish(&history, &first, 1);
        let (cells, next, _) = history.tail(0, usize::MAX);
        assert_eq!(next, 1);
        let stored: Vec<Value> = cells.iter().map(RecordedCell::to_stored).collect();
        let later = History::new();
        later.restore(
            stored
                .into_iter()
                .filter_map(RecordedCell::from_stored)
                .collect(),
            Some(json!({"name": "python"})),
        );
        let second = request("1");
        later.on_request(&second);
        finish(&later, &second, 1);
        let snapshot = later.snapshot();
        assert_eq!(snapshot.cells.len(), 2);
        assert_eq!(snapshot.cells[0].source, "print('a')");
        assert_eq!(snapshot.cells[0].outputs.to_json()[0]["text"], "a\n");
        assert_eq!(snapshot.cells[0].execution_count, Some(1));
        assert_eq!(snapshot.cells[1].source, "1");
        assert_eq!(snapshot.language_info.unwrap()["name"], "python");
        assert_eq!(later.tail(1, usize::MAX).0.len(), 1);
    }

    fn request(code: &str) -> Message {
        Message::new(
            Channel::Shell,
            "execute_request",
            "s",
            None,
            &json!({"code": code, "silent": false}),
        )
    }

    fn iopub(parent: &Message, msg_type: &str, content: Value) -> Message {
        Message::new(Channel::Iopub, msg_type, "k", Some(parent), &content)
    }

    fn finish(history: &History, req: &Message, count: i64) {
        history.on_reply(&Message::new(
            Channel::Shell,
            "execute_reply",
            "k",
            Some(req),
            &json!({"status": "ok", "execution_count": count}),
        ));
        history.on_iopub(&iopub(req, "status", json!({"execution_state": "idle"})));
    }

    #[test]
    fn the_tail_stops_at_a_cell_still_running() {
        let history = History::new();
        let first = request("1");
        history.on_request(&first);
        finish(&history, &first, 1);
        // The store's writer may run after the next cell started and before its display.
        let second = request("display(plot)");
        history.on_request(&second);
        history.on_iopub(&iopub(
            &second,
            "status",
            json!({"execution_state": "busy"}),
        ));
        let (cells, next, _) = history.tail(0, usize::MAX);
        assert_eq!((cells.len(), next), (1, 1));
        // Nor past the bound counted when the execution ended.
        let (cells, next, _) = history.tail(0, 0);
        assert_eq!((cells.len(), next), (0, 0));
        history.on_iopub(&iopub(
            &second,
            "display_data",
            json!({"data": {"image/png": "iVBOR"}, "metadata": {}}),
        ));
        finish(&history, &second, 2);
        let (cells, next, _) = history.tail(1, 2);
        assert_eq!((cells.len(), next), (1, 2));
        assert_eq!(cells[0].outputs.to_json()[0]["data"]["image/png"], "iVBOR");
    }

    #[test]
    fn a_finished_cell_takes_outputs_until_the_next_one_starts() {
        let history = History::new();
        let first = request("6 * 7");
        history.on_request(&first);
        finish(&history, &first, 1);
        // Deno's value, after the cell's idle: still the first cell's.
        let value = |req: &Message, text: &str| {
            iopub(
                req,
                "execute_result",
                json!({"data": {"text/plain": text}, "metadata": {}, "execution_count": 1}),
            )
        };
        history.on_iopub(&value(&first, "42"));
        let second = request("1");
        history.on_request(&second);
        history.on_iopub(&iopub(
            &second,
            "status",
            json!({"execution_state": "busy"}),
        ));
        // Once another cell runs, the first gets nothing more.
        history.on_iopub(&value(&first, "stray"));
        finish(&history, &second, 2);
        let cells = history.snapshot().cells;
        let first_outputs = cells[0].outputs.to_json();
        assert_eq!(first_outputs.len(), 1, "{first_outputs:?}");
        assert_eq!(first_outputs[0]["data"]["text/plain"], "42");
        assert!(cells[1].outputs.to_json().is_empty());
    }

    #[test]
    fn streams_merge_and_clear_output_waits() {
        let history = History::new();
        let req = request("print(1)");
        history.on_request(&req);
        let stream = |t: &str| iopub(&req, "stream", json!({"name": "stdout", "text": t}));
        history.on_iopub(&stream("a"));
        history.on_iopub(&stream("b\n"));
        history.on_iopub(&iopub(
            &req,
            "stream",
            json!({"name": "stderr", "text": "e"}),
        ));
        history.on_iopub(&stream("c"));
        let cell = &history.snapshot().cells[0];
        let outputs = cell.outputs.to_json();
        assert_eq!(outputs.len(), 3);
        assert_eq!(outputs[0]["text"], "ab\n");
        history.on_iopub(&iopub(&req, "clear_output", json!({"wait": true})));
        assert_eq!(history.snapshot().cells[0].outputs.outputs.len(), 3);
        history.on_iopub(&stream("d"));
        let outputs = history.snapshot().cells[0].outputs.to_json();
        assert_eq!(outputs.len(), 1);
        assert_eq!(outputs[0]["text"], "d");
        history.on_iopub(&iopub(&req, "clear_output", json!({"wait": false})));
        assert!(history.snapshot().cells[0].outputs.outputs.is_empty());
        finish(&history, &req, 1);
        assert_eq!(history.snapshot().cells[0].execution_count, Some(1));
    }

    #[test]
    fn update_display_reaches_earlier_cells_and_silent_runs_leave_no_trace() {
        let history = History::new();
        let first = request("h = display('x', display_id=True)");
        history.on_request(&first);
        history.on_iopub(
            &iopub(&first, "display_data", json!({"data": {"text/plain": "'x'"}, "metadata": {}, "transient": {"display_id": "d1"}})),
        );
        finish(&history, &first, 1);
        let silent = Message::new(
            Channel::Shell,
            "execute_request",
            "s",
            None,
            &json!({"code": "1", "silent": true}),
        );
        history.on_request(&silent);
        let second = request("h.update('y')");
        history.on_request(&second);
        history.on_iopub(
            &iopub(&second, "update_display_data", json!({"data": {"text/plain": "'y'"}, "metadata": {"m": 1}, "transient": {"display_id": "d1"}})),
        );
        finish(&history, &second, 2);
        let snapshot = history.snapshot();
        assert_eq!(snapshot.cells.len(), 2);
        let first_outputs = snapshot.cells[0].outputs.to_json();
        assert_eq!(first_outputs[0]["data"]["text/plain"], "'y'");
        assert_eq!(first_outputs[0]["metadata"]["m"], 1);
        assert!(first_outputs[0].get("transient").is_none());
        assert!(snapshot.cells[1].outputs.outputs.is_empty());
    }

    #[test]
    fn memory_is_bounded_and_the_snapshot_says_so() {
        let history = History::new();
        let req = request("spam()");
        history.on_request(&req);
        let chunk = "x".repeat(4 << 20);
        for name in ["stdout", "stderr"].iter().cycle().take(18) {
            history.on_iopub(&iopub(&req, "stream", json!({"name": name, "text": chunk})));
        }
        let snapshot = history.snapshot();
        assert!(snapshot.truncated);
        let outputs = snapshot.cells[0].outputs.to_json();
        let kept: usize = outputs
            .iter()
            .map(|o| o["text"].as_str().unwrap().len())
            .sum();
        assert!(kept <= MAX_HISTORY_BYTES, "{kept}");
        assert!(outputs.last().unwrap()["text"]
            .as_str()
            .unwrap()
            .contains("not recorded"));
        // Clearing frees the room again.
        history.on_iopub(&iopub(&req, "clear_output", json!({"wait": false})));
        history.on_iopub(&iopub(
            &req,
            "stream",
            json!({"name": "stdout", "text": chunk}),
        ));
        finish(&history, &req, 1);
        let outputs = history.snapshot().cells[0].outputs.to_json();
        assert_eq!(outputs.len(), 1);
        assert_eq!(outputs[0]["text"].as_str().unwrap().len(), 4 << 20);
    }

    #[test]
    fn cell_ids_come_from_the_frontend_when_usable() {
        let history = History::new();
        let with_id = |id: &str| {
            let mut message = request("1");
            message.metadata = bytes::Bytes::from(json!({"cellId": id}).to_string());
            message
        };
        history.on_request(&with_id("lab-cell-1"));
        history.on_request(&with_id("lab-cell-1"));
        history.on_request(&with_id("not a valid id!"));
        let ids: Vec<String> = history
            .snapshot()
            .cells
            .iter()
            .map(|c| c.id.clone())
            .collect();
        assert_eq!(ids[0], "lab-cell-1");
        assert_ne!(
            ids[1], "lab-cell-1",
            "ids stay unique when a cell runs twice"
        );
        assert!(valid_cell_id(&ids[1]) && valid_cell_id(&ids[2]));
    }

    #[test]
    fn cells_the_kernel_aborted_never_ran_and_are_not_exported() {
        let history = History::new();
        let failing = request("1/0");
        let queued = request("print('never')");
        history.on_request(&failing);
        history.on_request(&queued);
        finish(&history, &failing, 1);
        history.on_reply(&Message::new(
            Channel::Shell,
            "execute_reply",
            "k",
            Some(&queued),
            &json!({"status": "aborted", "execution_count": null}),
        ));
        let cells = history.snapshot().cells;
        assert_eq!(cells.len(), 1);
        assert_eq!(cells[0].source, "1/0");
    }

    #[test]
    fn language_info_comes_from_kernel_info_reply() {
        let history = History::new();
        let req = Message::new(Channel::Shell, "kernel_info_request", "g", None, &json!({}));
        history.on_reply(&Message::new(
            Channel::Shell,
            "kernel_info_reply",
            "k",
            Some(&req),
            &json!({"language_info": {"name": "python", "version": "3.12.1"}}),
        ));
        assert_eq!(history.snapshot().language_info.unwrap()["name"], "python");
    }
}
