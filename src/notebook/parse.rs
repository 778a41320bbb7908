//! Reading an .ipynb: JSON, version, structure, with errors that name the offending place.
//!
//! The `nbformat` crate does the typed parse and the 4.0–4.4 → 4.5 upgrade (fresh cell ids).
//! Before it runs, the structure is checked here, because the crate's output parser skips an
//! output it cannot read with a message on stderr: an upload must either be read whole or be
//! refused, never silently shortened.

use nbformat::v4;
use serde_json::Value;

use super::NotebookError;

/// A notebook read for replay: the typed 4.5 notebook and, per cell, the JSON of its outputs
/// exactly as uploaded (the comparison works on JSON).
#[derive(Debug, Clone)]
pub struct ParsedNotebook {
    pub notebook: v4::Notebook,
    pub original_outputs: Vec<Vec<Value>>,
    /// The version the file had, e.g. (4, 4).
    pub version: (i64, i64),
}

fn invalid(message: impl Into<String>) -> NotebookError {
    NotebookError::Invalid(message.into())
}

fn check_multiline(value: Option<&Value>, at: &str) -> Result<(), NotebookError> {
    match value {
        Some(Value::String(_)) => Ok(()),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => Ok(()),
        Some(_) => Err(invalid(format!(
            "{at}: expected a string or a list of strings"
        ))),
        None => Err(invalid(format!("{at}: missing"))),
    }
}

fn check_output(output: &Value, at: &str) -> Result<(), NotebookError> {
    let Some(object) = output.as_object() else {
        return Err(invalid(format!("{at}: expected an object")));
    };
    let kind = object.get("output_type").and_then(Value::as_str);
    match kind {
        Some("stream") => {
            if !object.get("name").is_some_and(Value::is_string) {
                return Err(invalid(format!("{at}.name: expected a string")));
            }
            check_multiline(object.get("text"), &format!("{at}.text"))?;
        }
        Some("display_data") | Some("execute_result") => {
            if !object.get("data").is_some_and(Value::is_object) {
                return Err(invalid(format!("{at}.data: expected an object")));
            }
            if !object.get("metadata").is_some_and(Value::is_object) {
                return Err(invalid(format!("{at}.metadata: expected an object")));
            }
        }
        Some("error") => {
            for key in ["ename", "evalue"] {
                if !object.get(key).is_some_and(Value::is_string) {
                    return Err(invalid(format!("{at}.{key}: expected a string")));
                }
            }
            let traceback_ok = object
                .get("traceback")
                .and_then(Value::as_array)
                .is_some_and(|t| t.iter().all(Value::is_string));
            if !traceback_ok {
                return Err(invalid(format!(
                    "{at}.traceback: expected a list of strings"
                )));
            }
        }
        Some(other) => {
            return Err(invalid(format!("{at}.output_type: unknown type {other:?}")));
        }
        None => return Err(invalid(format!("{at}.output_type: missing"))),
    }
    serde_json::from_value::<v4::Output>(output.clone())
        .map(|_| ())
        .map_err(|err| invalid(format!("{at}: {err}")))
}

/// Checks the structure of a v4 notebook's JSON; returns each cell's outputs.
fn check_structure(root: &Value) -> Result<Vec<Vec<Value>>, NotebookError> {
    if !root.get("metadata").is_some_and(Value::is_object) {
        return Err(invalid("metadata: missing or not an object"));
    }
    let Some(cells) = root.get("cells") else {
        return Err(invalid("cells: missing"));
    };
    let Some(cells) = cells.as_array() else {
        return Err(invalid("cells: expected a list"));
    };
    let mut all_outputs = Vec::with_capacity(cells.len());
    for (index, cell) in cells.iter().enumerate() {
        let at = format!("cells[{index}]");
        let Some(object) = cell.as_object() else {
            return Err(invalid(format!("{at}: expected an object")));
        };
        let kind = object.get("cell_type").and_then(Value::as_str);
        if !matches!(kind, Some("code" | "markdown" | "raw")) {
            return Err(invalid(format!(
                "{at}.cell_type: expected code, markdown or raw, found {}",
                object
                    .get("cell_type")
                    .map_or("nothing".to_owned(), Value::to_string)
            )));
        }
        if !object.get("metadata").is_some_and(Value::is_object) {
            return Err(invalid(format!("{at}.metadata: missing or not an object")));
        }
        check_multiline(object.get("source"), &format!("{at}.source"))?;
        let mut outputs = Vec::new();
        if kind == Some("code") {
            match object.get("execution_count") {
                None | Some(Value::Null) => {}
                Some(Value::Number(n)) if n.is_i64() => {}
                Some(_) => {
                    return Err(invalid(format!(
                        "{at}.execution_count: expected an integer or null"
                    )))
                }
            }
            let Some(list) = object.get("outputs").and_then(Value::as_array) else {
                return Err(invalid(format!("{at}.outputs: missing or not a list")));
            };
            for (i, output) in list.iter().enumerate() {
                check_output(output, &format!("{at}.outputs[{i}]"))?;
            }
            outputs = list.clone();
        }
        all_outputs.push(outputs);
    }
    Ok(all_outputs)
}

/// Reads an .ipynb (nbformat 4.0–4.5). Older notebooks are upgraded to 4.5 (cell ids are
/// generated); nbformat 3 and anything malformed are refused with the reason.
pub fn parse_notebook(text: &str) -> Result<ParsedNotebook, NotebookError> {
    let root: Value =
        serde_json::from_str(text).map_err(|err| NotebookError::NotJson(err.to_string()))?;
    if !root.is_object() {
        return Err(invalid("expected a JSON object at the top level"));
    }
    let major = root.get("nbformat").and_then(Value::as_i64);
    let minor = root.get("nbformat_minor").and_then(Value::as_i64);
    let (Some(major), Some(minor)) = (major, minor) else {
        return Err(invalid(
            "nbformat and nbformat_minor: missing or not integers (is this a Jupyter notebook?)",
        ));
    };
    if major != 4 || !(0..=5).contains(&minor) {
        return Err(NotebookError::UnsupportedVersion { major, minor });
    }
    let original_outputs = check_structure(&root)?;
    let parsed = nbformat::parse_notebook(text).map_err(|err| invalid(err.to_string()))?;
    let notebook = match parsed {
        nbformat::Notebook::V4(notebook) => notebook,
        nbformat::Notebook::V4QuirksMode(quirks) => quirks.repair(),
        nbformat::Notebook::Legacy(legacy) => {
            nbformat::upgrade_legacy_notebook(legacy).map_err(|err| invalid(err.to_string()))?
        }
        // Unreachable after the version check above; refused rather than upgraded lossily.
        _ => return Err(NotebookError::UnsupportedVersion { major, minor }),
    };
    Ok(ParsedNotebook {
        notebook,
        original_outputs,
        version: (major, minor),
    })
}

/// Writes a 4.5 notebook the way Python's `nbformat.write` does (sorted keys, one-space
/// indent, trailing newline).
pub fn write_notebook(notebook: v4::Notebook) -> Result<String, NotebookError> {
    nbformat::serialize_notebook(&nbformat::Notebook::V4(notebook))
        .map_err(|err| NotebookError::Write(err.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nb(cells: &str, minor: i64) -> String {
        format!(
            r#"{{"nbformat": 4, "nbformat_minor": {minor}, "metadata": {{}}, "cells": {cells}}}"#
        )
    }

    #[test]
    fn accepts_v44_without_ids_and_generates_them() {
        let text = nb(
            r#"[{"cell_type": "code", "metadata": {}, "source": ["x = 1\n", "x"], "execution_count": 1,
                "outputs": [{"output_type": "execute_result", "execution_count": 1, "data": {"text/plain": "1"}, "metadata": {}}]}]"#,
            4,
        );
        let parsed = parse_notebook(&text).unwrap();
        assert_eq!(parsed.version, (4, 4));
        assert_eq!(parsed.notebook.nbformat_minor, 5);
        assert!(!parsed.notebook.cells[0].id().as_str().is_empty());
        assert_eq!(parsed.original_outputs[0].len(), 1);
    }

    #[test]
    fn refuses_what_is_not_a_v4_notebook_and_says_where() {
        let cases = [
            ("not json", "not valid JSON"),
            ("[1]", "top level"),
            (
                r#"{"nbformat": 3, "nbformat_minor": 0, "worksheets": []}"#,
                "nbformat 3.0",
            ),
            (
                r#"{"nbformat": 4, "nbformat_minor": 5, "metadata": {}}"#,
                "cells: missing",
            ),
            (&nb(r#"{"a": 1}"#, 5), "cells: expected a list"),
            (
                &nb(
                    r#"[{"cell_type": "code", "metadata": {}, "source": 5, "outputs": []}]"#,
                    5,
                ),
                "cells[0].source",
            ),
            (
                &nb(
                    r#"[{"cell_type": "python", "metadata": {}, "source": ""}]"#,
                    5,
                ),
                "cells[0].cell_type",
            ),
            (
                &nb(
                    r#"[{"cell_type": "code", "metadata": {}, "source": "", "outputs": [{"output_type": "stream", "name": "stdout", "text": 3}]}]"#,
                    5,
                ),
                "cells[0].outputs[0].text",
            ),
        ];
        for (text, expected) in cases {
            let err = parse_notebook(text).unwrap_err().to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }
}
