//! Comparing a cell's outputs with what a replay produced, ignoring what changes from run to
//! run: execution counts, memory addresses in reprs (`0x7f…`), timestamps, kernel temp-file
//! names, uuids and widget model ids, terminal colours, tracebacks (their frames name the cell
//! by its execution count and the kernel's temp file; the exception type and message are
//! compared), and image bytes (images are compared by their header dimensions: PNG and JPEG
//! encoders are not byte-stable across library versions).

use std::sync::OnceLock;

use base64::Engine;
use regex::Regex;
use serde_json::{json, Map, Value};

/// Longest diff text in a report.
const MAX_DIFF_CHARS: usize = 400;

struct Volatile {
    pattern: Regex,
    replacement: &'static str,
}

fn volatile() -> &'static [Volatile] {
    static PATTERNS: OnceLock<Vec<Volatile>> = OnceLock::new();
    PATTERNS.get_or_init(|| {
        [
            (r"\x1b\[[0-9;]*[A-Za-z]", ""),
            (r"/tmp/ipykernel_\d+/\d+\.py", "<kernel-file>"),
            (r"/tmp/tmp[A-Za-z0-9_]{6,}", "<tempfile>"),
            (
                r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",
                "<uuid>",
            ),
            (
                r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?",
                "<timestamp>",
            ),
            // Widget model ids and other random 128-bit hex ids.
            (r"\b[0-9a-f]{32}\b", "<id>"),
            (r"0x[0-9a-fA-F]{6,}", "0x<address>"),
        ]
        .into_iter()
        .map(|(pattern, replacement)| Volatile {
            // The patterns are literals above; a typo fails every replay test at once.
            pattern: Regex::new(pattern).expect("volatile-part patterns are valid"),
            replacement,
        })
        .collect()
    })
}

/// Text with its volatile parts replaced by placeholders.
pub fn normalize_text(text: &str) -> String {
    let mut text = text.replace("\r\n", "\n");
    for volatile in volatile() {
        if volatile.pattern.is_match(&text) {
            text = volatile
                .pattern
                .replace_all(&text, volatile.replacement)
                .into_owned();
        }
    }
    text
}

/// A string or list of strings (nbformat's multiline form) as one string.
fn joined(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) if items.iter().all(Value::is_string) => {
            Some(items.iter().filter_map(Value::as_str).collect())
        }
        _ => None,
    }
}

/// Width and height of a base64 PNG, JPEG, GIF or WebP.
pub fn image_dimensions(mime: &str, base64_data: &str) -> Option<(u32, u32)> {
    if !matches!(
        mime,
        "image/png" | "image/jpeg" | "image/gif" | "image/webp"
    ) {
        return None;
    }
    let compact: String = base64_data.chars().filter(|c| !c.is_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .ok()?;
    crate::artifacts::dimensions(mime, &bytes)
}

fn normalize_value(value: &Value) -> Value {
    match value {
        Value::String(s) => Value::String(normalize_text(s)),
        Value::Array(items) => Value::Array(items.iter().map(normalize_value).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), normalize_value(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn normalize_bundle(data: &Value) -> Value {
    let Some(map) = data.as_object() else {
        return json!({});
    };
    let mut out = Map::new();
    for (mime, value) in map {
        let normalized = if mime.starts_with("image/") && mime != "image/svg+xml" {
            let text = joined(value).unwrap_or_default();
            match image_dimensions(mime, &text) {
                Some((w, h)) => json!(format!("<{mime} {w}x{h}>")),
                None => json!(format!("<{mime} undecodable>")),
            }
        } else if mime == "text/html" && map.contains_key("image/png") {
            // matplotlib-style HTML twins of an image embed its bytes.
            json!("<html>")
        } else {
            match joined(value) {
                Some(text) => Value::String(normalize_text(&text)),
                None => normalize_value(value),
            }
        };
        out.insert(mime.clone(), normalized);
    }
    Value::Object(out)
}

/// One output reduced to what a comparison looks at.
fn normalize_output(output: &Value) -> Value {
    let kind = output
        .get("output_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    match kind {
        "stream" => json!({
            "output_type": "stream",
            "name": output.get("name").cloned().unwrap_or(Value::Null),
            "text": normalize_text(&output.get("text").and_then(joined).unwrap_or_default()),
        }),
        "display_data" | "execute_result" => json!({
            "output_type": kind,
            "data": normalize_bundle(output.get("data").unwrap_or(&Value::Null)),
            "metadata": normalize_value(output.get("metadata").unwrap_or(&json!({}))),
        }),
        "error" => json!({
            "output_type": "error",
            "ename": output.get("ename").cloned().unwrap_or(Value::Null),
            "evalue": normalize_value(output.get("evalue").unwrap_or(&Value::Null)),
        }),
        _ => normalize_value(output),
    }
}

/// Lines a library writes only when something took long: whether they appear says how
/// busy the machine was, not what the code did. matplotlib logs its notice when building
/// its font cache (in a fresh sandbox, at the first import of pyplot) takes over 5 s.
const TIMING_NOTICES: &[&str] = &["Matplotlib is building the font cache; this may take a moment."];

/// A stream's text without [`TIMING_NOTICES`] lines.
fn without_timing_notices(text: &str) -> String {
    if !TIMING_NOTICES.iter().any(|notice| text.contains(notice)) {
        return text.to_owned();
    }
    text.split_inclusive('\n')
        .filter(|line| !TIMING_NOTICES.contains(&line.trim_end()))
        .collect()
}

/// Normalized outputs, with consecutive streams of one name merged (writers differ in how
/// they split them), and timing notices dropped.
fn normalize_all(outputs: &[Value]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::with_capacity(outputs.len());
    for mut output in outputs.iter().map(normalize_output) {
        if output["output_type"] == "stream" {
            let text = without_timing_notices(output["text"].as_str().unwrap_or(""));
            if text.is_empty() {
                continue;
            }
            output["text"] = Value::String(text);
            if let Some(last) = out.last_mut() {
                if last["output_type"] == "stream" && last["name"] == output["name"] {
                    let text = format!(
                        "{}{}",
                        last["text"].as_str().unwrap_or(""),
                        output["text"].as_str().unwrap_or("")
                    );
                    last["text"] = Value::String(text);
                    continue;
                }
            }
        }
        out.push(output);
    }
    out
}

fn describe(output: &Value) -> String {
    match output["output_type"].as_str().unwrap_or("") {
        "stream" => format!(
            "{} {:?}",
            output["name"].as_str().unwrap_or("stream"),
            output["text"].as_str().unwrap_or("")
        ),
        "error" => format!(
            "error {}: {}",
            output["ename"].as_str().unwrap_or(""),
            output["evalue"].as_str().unwrap_or("")
        ),
        kind => {
            let data = &output["data"];
            let plain = data["text/plain"].as_str();
            let mimes: Vec<&str> = data
                .as_object()
                .map(|m| m.keys().map(String::as_str).collect())
                .unwrap_or_default();
            match plain {
                Some(text) => format!("{kind} {text:?} ({})", mimes.join(", ")),
                None => format!("{kind} {}", data),
            }
        }
    }
}

/// Where two normalized outputs first differ, in a few words.
fn first_difference(expected: &Value, actual: &Value) -> String {
    if expected["output_type"] == "stream" && actual["output_type"] == "stream" {
        let (e, a) = (
            expected["text"].as_str().unwrap_or(""),
            actual["text"].as_str().unwrap_or(""),
        );
        let mut e_lines = e.lines();
        let mut a_lines = a.lines();
        let mut line = 1;
        loop {
            match (e_lines.next(), a_lines.next()) {
                (Some(x), Some(y)) if x == y => line += 1,
                (x, y) => {
                    return format!(
                        "{} line {line}: expected {:?}, got {:?}",
                        expected["name"].as_str().unwrap_or("stream"),
                        x.unwrap_or("<end>"),
                        y.unwrap_or("<end>")
                    )
                }
            }
        }
    }
    format!("expected {}, got {}", describe(expected), describe(actual))
}

fn shorten(mut text: String) -> String {
    if text.chars().count() > MAX_DIFF_CHARS {
        text = text.chars().take(MAX_DIFF_CHARS).collect::<String>() + "…";
    }
    text
}

/// `None` when the outputs match once volatile parts are ignored; else a short description of
/// the first difference.
pub fn compare_outputs(expected: &[Value], actual: &[Value]) -> Option<String> {
    let expected = normalize_all(expected);
    let actual = normalize_all(actual);
    for (index, (e, a)) in expected.iter().zip(actual.iter()).enumerate() {
        if e != a {
            return Some(shorten(format!(
                "output {index}: {}",
                first_difference(e, a)
            )));
        }
    }
    match expected.len().cmp(&actual.len()) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Less => Some(shorten(format!(
            "{} outputs expected, {} produced; first extra: {}",
            expected.len(),
            actual.len(),
            describe(&actual[expected.len()])
        ))),
        std::cmp::Ordering::Greater => Some(shorten(format!(
            "{} outputs expected, {} produced; first missing: {}",
            expected.len(),
            actual.len(),
            describe(&expected[actual.len()])
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PNG_2X3: &str = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAADCAYAAAC56t6BAAAAEklEQVR4nGNgYGD4z8DAwMDAAAAHAAHJvx2sAAAAAElFTkSuQmCC";

    #[test]
    fn volatile_parts_are_ignored() {
        let a = json!([{"output_type": "execute_result", "execution_count": 3, "metadata": {},
            "data": {"text/plain": ["<object at 0x7f3a2b1c0d90>\n", "2026-11-22 10:00:01.123"]}}]);
        let b = json!([{"output_type": "execute_result", "execution_count": 9, "metadata": {},
            "data": {"text/plain": "<object at 0x7f00deadbeef>\n2025-01-01T00:00:00Z"}}]);
        assert_eq!(
            compare_outputs(a.as_array().unwrap(), b.as_array().unwrap()),
            None
        );
        let s1 = json!([{"output_type": "stream", "name": "stdout", "text": "a"}, {"output_type": "stream", "name": "stdout", "text": "b\n"}]);
        let s2 = json!([{"output_type": "stream", "name": "stdout", "text": ["ab\n"]}]);
        assert_eq!(
            compare_outputs(s1.as_array().unwrap(), s2.as_array().unwrap()),
            None
        );
    }

    #[test]
    fn timing_notices_are_ignored_and_nothing_else() {
        let notice = "Matplotlib is building the font cache; this may take a moment.\n";
        let quiet = json!([{"output_type": "stream", "name": "stdout", "text": "True\n"}]);
        let busy = json!([{"output_type": "stream", "name": "stderr", "text": notice},
            {"output_type": "stream", "name": "stdout", "text": "True\n"}]);
        assert_eq!(
            compare_outputs(quiet.as_array().unwrap(), busy.as_array().unwrap()),
            None
        );
        let mixed =
            json!([{"output_type": "stream", "name": "stdout", "text": format!("{notice}True\n")}]);
        assert_eq!(
            compare_outputs(quiet.as_array().unwrap(), mixed.as_array().unwrap()),
            None
        );
        // A line that only mentions it is text like any other.
        let quoted = json!([{"output_type": "stream", "name": "stdout", "text": format!("said: {notice}True\n")}]);
        assert!(compare_outputs(quiet.as_array().unwrap(), quoted.as_array().unwrap()).is_some());
    }

    #[test]
    fn differences_are_reported_briefly() {
        let a = json!([{"output_type": "stream", "name": "stdout", "text": "1\n2\n"}]);
        let b = json!([{"output_type": "stream", "name": "stdout", "text": "1\n3\n"}]);
        let diff = compare_outputs(a.as_array().unwrap(), b.as_array().unwrap()).unwrap();
        assert!(diff.contains("line 2") && diff.contains("\"3\""), "{diff}");
        let none: Vec<Value> = vec![];
        let diff = compare_outputs(&none, b.as_array().unwrap()).unwrap();
        assert!(diff.contains("first extra"), "{diff}");
    }

    #[test]
    fn images_compare_by_dimensions() {
        assert_eq!(image_dimensions("image/png", PNG_2X3), Some((2, 3)));
        let one = json!([{"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG_2X3}}]);
        let mut other = one.clone();
        // Same header, different pixel bytes: still the same image for the comparison.
        other[0]["data"]["image/png"] = json!(PNG_2X3.replace("nGNgYGD4", "nGNgYGD5"));
        assert_eq!(
            compare_outputs(one.as_array().unwrap(), other.as_array().unwrap()),
            None
        );
    }
}
