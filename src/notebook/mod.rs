//! Notebooks: export a kernel's history as nbformat 4.5, read .ipynb files (v4.0–4.5), and
//! replay a notebook's code cells in a fresh sandboxed kernel, comparing outputs.
//!
//! Parsing and writing go through the `nbformat` crate (runtimed): its v4.5 output is
//! byte-identical to Python's `nbformat.write` and it upgrades 4.0–4.4 (adding cell ids).
//! Outputs are compared and assembled as plain JSON (`serde_json::Value`), because the
//! crate's typed media would re-shape MIME bundles we only relay (research:
//! gateway-contract.md §4.3). Its v3 upgrade is lossy, so nbformat 3 is refused.
//!
//! [`export_notebook`] is a plain function of a history snapshot and the kernelspec, so any
//! surface can serve it: `GET /api/kernels/{id}/notebook` and `POST /api/notebooks/replay`
//! (`gateway/notebooks.rs`, where a replay runs in its own task, so a client hanging up
//! never leaves a replay kernel behind), and `cellgate export` and `cellgate replay`
//! (`notebook_cli.rs`, with an in-process `KernelManager` by default, or `--url`).
//!
//! Must not depend on: HTTP (axum types stay in `gateway/`).

mod compare;
mod export;
mod parse;
mod replay;

pub use compare::{compare_outputs, image_dimensions, normalize_text};
pub use export::{export_notebook, KernelspecInfo};
pub use parse::{parse_notebook, write_notebook, ParsedNotebook};
pub use replay::{
    replay, replay_in, replay_with, start_kernel, CellReport, CellRun, CellRunner, CellStatus,
    KernelRunner, Progress, ReplayOptions, ReplayOutcome,
};

use crate::kernel::KernelError;

/// Errors of reading, writing and replaying notebooks.
#[derive(Debug, thiserror::Error)]
pub enum NotebookError {
    #[error("the notebook is not valid JSON: {0}")]
    NotJson(String),
    #[error("the notebook is not a valid nbformat 4 notebook: {0}")]
    Invalid(String),
    #[error("nbformat {major}.{minor} notebooks are not supported: only nbformat 4.0 to 4.5 (open and save it with a current Jupyter to convert it)")]
    UnsupportedVersion { major: i64, minor: i64 },
    #[error("cannot write the notebook: {0}")]
    Write(String),
    #[error(
        "the notebook's kernel {name} is not available on this gateway (available: {available})"
    )]
    UnknownKernel { name: String, available: String },
    #[error("the replay kernel: {0}")]
    Kernel(#[from] KernelError),
    #[error("the replay kernel stopped answering: {0}")]
    KernelLost(String),
}
