//! A kernel's history as an nbformat 4.5 notebook.

use nbformat::v4;
use serde_json::{json, Value};

use super::parse::write_notebook;
use super::NotebookError;
use crate::kernel::history::MAX_HISTORY_BYTES;
use crate::kernel::HistorySnapshot;

/// The kernelspec named in `metadata.kernelspec`.
#[derive(Debug, Clone)]
pub struct KernelspecInfo {
    pub name: String,
    pub display_name: String,
    pub language: String,
}

impl From<&crate::kernel::KernelSpec> for KernelspecInfo {
    fn from(spec: &crate::kernel::KernelSpec) -> Self {
        KernelspecInfo {
            name: spec.name.clone(),
            display_name: spec.display_name.clone(),
            language: spec.language.clone(),
        }
    }
}

/// An output the typed notebook model cannot hold (a kernel sent something nbformat does not
/// allow), replaced by a visible note rather than dropped or failing the whole export.
fn unexportable(reason: &str) -> v4::Output {
    v4::Output::Stream {
        name: "stderr".to_owned(),
        text: v4::MultilineString(format!(
            "[cellgate] an output of this cell could not be exported: {reason}\n"
        )),
    }
}

/// Converts outputs in nbformat JSON to the typed model.
pub(super) fn typed_outputs(outputs: &[Value]) -> Vec<v4::Output> {
    outputs
        .iter()
        .map(|output| {
            serde_json::from_value::<v4::Output>(output.clone())
                .unwrap_or_else(|err| unexportable(&err.to_string()))
        })
        .collect()
}

/// Lines as nbformat stores sources: split after each newline.
pub(super) fn source_lines(source: &str) -> Vec<String> {
    source.split_inclusive('\n').map(str::to_owned).collect()
}

/// The history as an nbformat 4.5 notebook (JSON text, Python `nbformat.write` style): every
/// executed cell in order with its source, execution count, outputs and timing metadata, and
/// the kernelspec and `language_info` the kernel reported. When the history hit its memory
/// bound, `metadata.cellgate.history` says so.
pub fn export_notebook(
    history: &HistorySnapshot,
    kernelspec: &KernelspecInfo,
) -> Result<String, NotebookError> {
    let mut cells = Vec::with_capacity(history.cells.len());
    for cell in &history.cells {
        let id = v4::CellId::new(&cell.id).unwrap_or_else(|_| uuid::Uuid::new_v4().into());
        let metadata = v4::CellMetadata {
            execution: serde_json::from_value(Value::Object(cell.timing.clone())).ok(),
            ..v4::CellMetadata::default()
        };
        cells.push(v4::Cell::Code {
            id,
            metadata,
            execution_count: cell.execution_count.and_then(|c| i32::try_from(c).ok()),
            source: source_lines(&cell.source),
            outputs: typed_outputs(&cell.outputs.to_json()),
        });
    }
    let mut additional = std::collections::HashMap::new();
    if history.truncated {
        additional.insert(
            "cellgate".to_owned(),
            json!({"history": {
                "truncated": true,
                "limit_bytes": MAX_HISTORY_BYTES,
                "cells_dropped": history.cells_dropped,
                "note": "the session produced more output than the history keeps; some outputs (or cells) are missing from this notebook",
            }}),
        );
    }
    let language_info = history
        .language_info
        .clone()
        .and_then(|info| serde_json::from_value::<v4::LanguageInfo>(info).ok())
        .or_else(|| serde_json::from_value(json!({"name": kernelspec.language})).ok());
    let metadata = v4::Metadata {
        kernelspec: Some(v4::KernelSpec {
            name: kernelspec.name.clone(),
            display_name: kernelspec.display_name.clone(),
            language: Some(kernelspec.language.clone()),
            additional: Default::default(),
        }),
        language_info,
        authors: None,
        additional,
    };
    write_notebook(v4::Notebook {
        metadata,
        nbformat: 4,
        nbformat_minor: 5,
        cells,
    })
}
