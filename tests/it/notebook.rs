//! Notebook export and replay: cells run through the Kernel Gateway WebSocket (as JupyterLab
//! runs them) export as nbformat 4.5 that Python's nbformat validates, and replay to the same
//! outputs in a fresh sandboxed kernel; notebooks written by Python's nbformat (4.4 and 4.5)
//! replay through HTTP and the CLI; malformed notebooks get clear errors.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::*;

/// Runs Python code with the tools environment (nbformat 5); returns stdout.
fn tools(code: &str, args: &[&Path]) -> Result<String> {
    let output = Command::new(tools_python())
        .arg("-c")
        .arg(code)
        .args(args)
        .output()
        .context("run the tools python")?;
    ensure!(
        output.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// Validates a notebook file with Python's `nbformat.validate`; returns its nbformat_minor.
fn validate(path: &Path) -> Result<String> {
    tools(
        "import sys, nbformat\n\
         nb = nbformat.read(sys.argv[1], as_version=nbformat.NO_CONVERT)\n\
         nbformat.validate(nb)\n\
         print(f'{nb.nbformat}.{nb.nbformat_minor}')",
        &[path],
    )
    .map(|s| s.trim().to_owned())
}

fn joined(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
        _ => String::new(),
    }
}

async fn replay_http(gateway: &Gateway, body: &str, query: &str) -> Result<(u16, Value)> {
    let response = gateway
        .request(
            reqwest::Method::POST,
            &format!("/api/notebooks/replay{query}"),
        )
        .header("Content-Type", "application/json")
        .body(body.to_owned())
        .send()
        .await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    Ok((
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

/// Each replayed cell's status, in order (`same`, `different`, `error`, `skipped`).
pub(crate) fn statuses(answer: &Value) -> Vec<String> {
    answer["report"]
        .as_array()
        .map(|r| {
            r.iter()
                .map(|c| c["status"].as_str().unwrap_or("?").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn websocket_session_exports_valid_notebook_that_replays_the_same() -> Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "lab-session", true).await?;

    // Streams split across several messages (flushes with pauses in between).
    let msgs = client
        .run("import sys, time\nfor part in ['a', 'b\\n', 'c']:\n    sys.stdout.write(part); sys.stdout.flush(); time.sleep(0.05)\nprint()\nprint('err', file=sys.stderr)")
        .await?;
    ensure!(
        of_type(&msgs, "stream").len() >= 3,
        "the stream was not split: {msgs:?}"
    );
    // A display shown in one cell and updated from the next.
    client
        .run("from IPython.display import display, update_display, clear_output\nh = display('first', display_id=True)")
        .await?;
    client.run("h.update('second')").await?;
    // clear_output, immediate and deferred.
    client
        .run("print('gone'); clear_output(); print('kept')")
        .await?;
    client
        .run("print('old'); clear_output(wait=True); print('new')")
        .await?;
    // An error, a silent execution (never in the history) and a matplotlib figure.
    client.run("1/0").await?;
    let silent = client
        .send(
            "shell",
            "execute_request",
            json!({"code": "secret = 1", "silent": true, "store_history": false, "user_expressions": {}, "allow_stdin": false}),
            vec![],
        )
        .await?;
    client.collect(&silent, Duration::from_secs(60)).await?;
    let msgs = client
        .run("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
        .await?;
    ensure!(
        of_type(&msgs, "display_data")
            .iter()
            .any(|m| m.content["data"]["image/png"].is_string()),
        "matplotlib showed no PNG: {msgs:?}"
    );
    client.run("print(object())\n6 * 7").await?;

    let response = gateway
        .request(
            reqwest::Method::GET,
            &format!("/api/kernels/{kernel}/notebook"),
        )
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(
        response.headers()["content-type"],
        "application/x-ipynb+json"
    );
    let text = response.text().await?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("export.ipynb");
    std::fs::write(&path, &text)?;
    assert_eq!(validate(&path)?, "4.5");

    let nb: Value = serde_json::from_str(&text)?;
    assert_eq!(nb["metadata"]["kernelspec"]["name"], "python3");
    assert_eq!(nb["metadata"]["language_info"]["name"], "python");
    let cells = nb["cells"].as_array().context("cells")?;
    assert_eq!(cells.len(), 8, "silent executions must not be exported");
    assert!(cells
        .iter()
        .all(|c| !joined(&c["source"]).contains("secret")));
    let counts: Vec<i64> = cells
        .iter()
        .map(|c| c["execution_count"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(counts, (1..=8).collect::<Vec<i64>>());
    let outputs = |i: usize| cells[i]["outputs"].as_array().cloned().unwrap_or_default();
    // Streams merged as Jupyter shows them.
    assert_eq!(outputs(0).len(), 2);
    assert_eq!(joined(&outputs(0)[0]["text"]), "ab\nc\n");
    assert_eq!(outputs(0)[1]["name"], "stderr");
    // The update reached the earlier cell; the updating cell shows nothing itself.
    assert_eq!(outputs(1).len(), 1);
    assert_eq!(joined(&outputs(1)[0]["data"]["text/plain"]), "'second'");
    assert!(outputs(1)[0].get("transient").is_none());
    assert!(outputs(2).is_empty());
    assert_eq!(outputs(3).len(), 1);
    assert_eq!(joined(&outputs(3)[0]["text"]), "kept\n");
    assert_eq!(outputs(4).len(), 1);
    assert_eq!(joined(&outputs(4)[0]["text"]), "new\n");
    assert_eq!(outputs(5)[0]["output_type"], "error");
    assert_eq!(outputs(5)[0]["ename"], "ZeroDivisionError");
    assert!(outputs(6)
        .iter()
        .any(|o| o["data"]["image/png"].is_string()));
    assert_eq!(outputs(7).last().unwrap()["output_type"], "execute_result");
    assert!(cells[0]["metadata"]["execution"]["iopub.status.busy"].is_string());

    // Replaying the export (errors allowed: it has one) gives the same outputs.
    let (status, answer) = replay_http(&gateway, &text, "?allow_errors=true").await?;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(statuses(&answer), vec!["same"; 8], "{:#}", answer["report"]);
    assert_eq!(answer["matched"], true);
    let replayed = dir.path().join("replayed.ipynb");
    std::fs::write(&replayed, answer["notebook"].to_string())?;
    assert_eq!(validate(&replayed)?, "4.5");
    // Without allow_errors the replay stops at the untagged error.
    let (_, answer) = replay_http(&gateway, &text, "").await?;
    assert_eq!(
        statuses(&answer),
        ["same", "same", "same", "same", "same", "error", "skipped", "skipped"]
    );
    assert_eq!(answer["matched"], false);

    // The export CLI fetches the same notebook.
    let out = dir.path().join("cli.ipynb");
    let status = Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .args([
            "export",
            "--url",
            &gateway.base,
            "--token",
            TOKEN,
            &kernel,
            "-o",
        ])
        .arg(&out)
        .status()?;
    assert!(status.success());
    assert_eq!(validate(&out)?, "4.5");
    let via_cli: Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    assert_eq!(via_cli["cells"].as_array().map(Vec::len), Some(8));

    // Both routes sit behind the token.
    let anonymous = reqwest::Client::new();
    let status = anonymous
        .get(format!("{}/api/kernels/{kernel}/notebook", gateway.base))
        .send()
        .await?
        .status();
    assert_eq!(status.as_u16(), 401);
    let status = anonymous
        .post(format!("{}/api/notebooks/replay", gateway.base))
        .header("Content-Type", "application/json")
        .body(text.clone())
        .send()
        .await?
        .status();
    assert_eq!(status.as_u16(), 401);

    // An unknown kernel is a 404, and the kernel still works.
    let (status, _) = gateway
        .get_json("/api/kernels/00000000-0000-0000-0000-000000000000/notebook")
        .await?;
    assert_eq!(status, 404);
    let msgs = client.run("1+1").await?;
    assert_eq!(
        of_type(&msgs, "execute_result")[0].content["data"]["text/plain"],
        "2"
    );
    Ok(())
}

/// Writes a notebook with Python's nbformat at 4.`minor` (4.4: no cell ids).
fn python_notebook(path: &Path, minor: u8) -> Result<()> {
    let script = r##"
import sys, nbformat
from nbformat.v4 import new_notebook, new_code_cell, new_markdown_cell, new_output
minor = int(sys.argv[2])
ks = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
nb = new_notebook(metadata={"kernelspec": ks, "language_info": {"name": "python"}})
stream = lambda text, name="stdout": new_output("stream", name=name, text=text)
nb.cells = [
    new_markdown_cell("# replay me"),
    new_code_cell("x = 6 * 7\nprint('x is', x)", execution_count=1, outputs=[stream("x is 42\n")]),
    new_code_cell("from IPython.display import display, clear_output\nh = display('first', display_id=True)", execution_count=2,
                  outputs=[new_output("display_data", data={"text/plain": "'second'"})]),
    new_code_cell("h.update('second')", execution_count=3),
    new_code_cell("raise ValueError('expected')", execution_count=4, metadata={"tags": ["raises-exception"]},
                  outputs=[new_output("error", ename="ValueError", evalue="expected", traceback=["..."])]),
    new_code_cell("print('old'); clear_output(wait=True); print('new')", execution_count=5, outputs=[stream("new\n")]),
    new_code_cell("", execution_count=None),
    new_code_cell("import datetime\nprint(datetime.datetime.now(), object())\nx", execution_count=7,
                  outputs=[stream("2020-01-01 00:00:00.000001 <object object at 0x7f1234567890>\n"),
                           new_output("execute_result", data={"text/plain": "42"}, execution_count=7)]),
]
nb.nbformat_minor = minor
if minor < 5:
    for cell in nb.cells:
        del cell["id"]
nbformat.write(nb, sys.argv[1], version=4)
"##;
    tools(script, &[path, Path::new(&minor.to_string())])?;
    Ok(())
}

fn replay_cli(args: &[&str], notebook: &Path) -> Result<(i32, String, String)> {
    let output = Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .arg("replay")
        .arg(notebook)
        .args(["--sandbox", &sandbox_backend()])
        .arg("--kernels-dir")
        .arg(kernels_dir())
        .arg("--policies-dir")
        .arg(repo().join("policies"))
        .args(args)
        .output()?;
    Ok((
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

#[tokio::test]
async fn python_written_notebooks_replay_over_http_and_cli() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let v44 = dir.path().join("v44.ipynb");
    let v45 = dir.path().join("v45.ipynb");
    python_notebook(&v44, 4)?;
    python_notebook(&v45, 5)?;
    assert_eq!(validate(&v44)?, "4.4");
    let raw44: Value = serde_json::from_str(&std::fs::read_to_string(&v44)?)?;
    assert!(raw44["cells"][0].get("id").is_none());

    // HTTP: 4.5 with a policy chosen, and 4.4 (ids generated) with progress as events.
    let gateway = Gateway::start().await?;
    let (status, answer) =
        replay_http(&gateway, &std::fs::read_to_string(&v45)?, "?policy=default").await?;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(statuses(&answer), vec!["same"; 7], "{:#}", answer["report"]);
    assert_eq!(answer["matched"], true);
    assert_eq!(answer["report"][3]["error"], "ValueError: expected");
    let response = gateway
        .request(reqwest::Method::POST, "/api/notebooks/replay")
        .header("Accept", "text/event-stream")
        .header("Content-Type", "application/json")
        .body(std::fs::read_to_string(&v44)?)
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 200);
    let events = response.text().await?;
    assert_eq!(events.matches("event: progress").count(), 7, "{events}");
    assert!(events.contains("\"done\":7"), "{events}");
    let result = events
        .split("event: result\ndata: ")
        .nth(1)
        .context("a result event")?;
    let result: Value = serde_json::from_str(result.lines().next().unwrap_or(""))?;
    assert_eq!(result["matched"], true, "{result:#}");
    let executed = &result["notebook"];
    assert_eq!(executed["nbformat_minor"], 5);
    assert!(executed["cells"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["id"].as_str().is_some_and(|id| !id.is_empty())));
    let unknown_policy =
        replay_http(&gateway, &std::fs::read_to_string(&v45)?, "?policy=nope").await?;
    assert_eq!(unknown_policy.0, 400, "{}", unknown_policy.1);

    // CLI, in-process: all same → 0, and the executed notebook is valid 4.5.
    let out = dir.path().join("out.ipynb");
    let (code, stdout, stderr) = replay_cli(&["--output", out.to_str().unwrap()], &v44)?;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("7 same"), "{stdout}");
    assert_eq!(validate(&out)?, "4.5");

    // A changed expectation → 1 with a short diff.
    let mut changed = raw44.clone();
    changed["cells"][1]["outputs"][0]["text"] = json!(["x is 43\n"]);
    let changed_path = dir.path().join("changed.ipynb");
    std::fs::write(&changed_path, changed.to_string())?;
    let (code, stdout, _) = replay_cli(&["--json"], &changed_path)?;
    assert_eq!(code, 1, "{stdout}");
    let report: Value = serde_json::from_str(stdout.trim())?;
    assert_eq!(report["report"][0]["status"], "different");
    let diff = report["report"][0]["diff"].as_str().unwrap_or_default();
    assert!(
        diff.contains("x is 43") && diff.contains("x is 42"),
        "{diff}"
    );

    // An untagged error → 1, the rest skipped; --allow-errors goes on.
    let mut failing = raw44.clone();
    failing["cells"][1]["source"] = json!("print('x is', x)\nundefined_name");
    let failing_path = dir.path().join("failing.ipynb");
    std::fs::write(&failing_path, failing.to_string())?;
    let (code, stdout, _) = replay_cli(&["--json"], &failing_path)?;
    assert_eq!(code, 1, "{stdout}");
    let report: Value = serde_json::from_str(stdout.trim())?;
    assert_eq!(report["report"][0]["status"], "error");
    assert!(report["report"][0]["error"]
        .as_str()
        .unwrap_or_default()
        .contains("NameError"));
    assert_eq!(report["report"][6]["status"], "skipped");

    // Through a running gateway with --url.
    let (code, stdout, stderr) =
        replay_cli(&["--url", &gateway.base, "--token", TOKEN, "--json"], &v45)?;
    assert_eq!(code, 0, "{stdout}\n{stderr}");

    // Unusable notebooks → 2.
    let v3 = dir.path().join("v3.ipynb");
    std::fs::write(
        &v3,
        r#"{"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": []}"#,
    )?;
    let (code, _, stderr) = replay_cli(&[], &v3)?;
    assert_eq!(code, 2);
    assert!(stderr.contains("nbformat 3.0"), "{stderr}");
    let (code, _, stderr) = replay_cli(&[], &dir.path().join("missing.ipynb"))?;
    assert_eq!(code, 2, "{stderr}");
    Ok(())
}

#[tokio::test]
async fn malformed_notebooks_get_clear_errors_and_the_gateway_keeps_serving() -> Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let cases: Vec<(String, &str)> = vec![
        ("this is not json".to_owned(), "not valid JSON"),
        ("[]".to_owned(), "top level"),
        (json!({"nbformat": 3, "nbformat_minor": 0, "worksheets": []}).to_string(), "nbformat 3.0 notebooks are not supported"),
        (json!({"nbformat": 4, "nbformat_minor": 9, "metadata": {}, "cells": []}).to_string(), "nbformat 4.9"),
        (json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}}).to_string(), "cells: missing"),
        (json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": 5}).to_string(), "cells: expected a list"),
        (json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "id": "a", "metadata": {}, "source": 3, "outputs": []}]}).to_string(), "cells[0].source"),
        (json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "id": "a", "metadata": {}, "source": "", "outputs": {}}]}).to_string(), "cells[0].outputs"),
        (json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "id": "a", "metadata": {}, "source": "", "outputs": [{"output_type": "bogus"}]}]}).to_string(), "cells[0].outputs[0].output_type"),
        (json!({"nbformat": "4", "nbformat_minor": 5, "metadata": {}, "cells": []}).to_string(), "nbformat and nbformat_minor"),
    ];
    for (body, expected) in &cases {
        let (status, answer) = replay_http(&gateway, body, "").await?;
        assert_eq!(status, 400, "{body}: {answer}");
        let message = answer["message"].as_str().unwrap_or_default();
        assert!(message.contains(expected), "{body}: {message}");
    }
    let empty =
        json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": []}).to_string();
    for (query, expected) in [
        ("?timeout_s=-1", "timeout_s"),
        ("?allow_errors=maybe", "allow_errors"),
    ] {
        let (status, answer) = replay_http(&gateway, &empty, query).await?;
        assert_eq!(status, 400, "{answer}");
        let message = answer["message"].as_str().unwrap_or_default();
        assert!(message.contains(expected), "{query}: {message}");
    }
    let wrapped = json!({"notebook": empty, "timeout_s": "soon"}).to_string();
    let (status, answer) = replay_http(&gateway, &wrapped, "").await?;
    assert_eq!(status, 400, "{answer}");
    assert!(answer["message"]
        .as_str()
        .unwrap_or_default()
        .contains("timeout_s"));
    // The wrapped form works, with the notebook given as text.
    let wrapped = json!({"notebook": empty, "allow_errors": true}).to_string();
    let (status, answer) = replay_http(&gateway, &wrapped, "").await?;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["matched"], true);

    // A cell past its own timeout is interrupted and reported; later cells are skipped.
    let slow = json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": "slow", "metadata": {"execution": {"timeout": 1}}, "source": "import time; time.sleep(60)", "execution_count": null, "outputs": []},
        {"cell_type": "code", "id": "after", "metadata": {}, "source": "print(1)", "execution_count": null, "outputs": []},
    ]});
    let (status, answer) = replay_http(&gateway, &slow.to_string(), "").await?;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(statuses(&answer), ["error", "skipped"]);
    assert!(answer["report"][0]["error"]
        .as_str()
        .unwrap_or_default()
        .contains("CellTimeoutError"));

    // Kernelspec names differ between machines: the notebook's language decides; a language
    // this gateway has no kernel for is refused.
    let with_spec = |name: &str, language: &str| {
        json!({"nbformat": 4, "nbformat_minor": 5,
               "metadata": {"kernelspec": {"name": name, "display_name": name, "language": language}},
               "cells": [{"cell_type": "code", "id": "one", "metadata": {}, "source": "print(1)", "execution_count": 1,
                          "outputs": [{"output_type": "stream", "name": "stdout", "text": "1\n"}]}]})
        .to_string()
    };
    let (status, answer) =
        replay_http(&gateway, &with_spec("conda-env-x-py", "python"), "").await?;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["matched"], true, "{answer}");
    let (status, answer) = replay_http(&gateway, &with_spec("julia-1.10", "julia"), "").await?;
    assert_eq!(status, 400, "{answer}");
    assert!(answer["message"]
        .as_str()
        .unwrap_or_default()
        .contains("kernel julia-1.10 is not available"));

    // Nothing else broke: the kernel answers and no replay kernel is left behind.
    let mut client = gateway.connect(&kernel, "after-bad-input", false).await?;
    let msgs = client.run("1+1").await?;
    assert_eq!(
        of_type(&msgs, "execute_result")[0].content["data"]["text/plain"],
        "2"
    );
    let (_, kernels) = gateway.get_json("/api/kernels").await?;
    assert_eq!(kernels.as_array().map(Vec::len), Some(1), "{kernels}");
    Ok(())
}

/// API v1: a chat session exports as a notebook (its cells, in order, with outputs), and that
/// notebook replays through `/v1/notebooks/replay` with every cell the same.
#[tokio::test]
async fn api_v1_session_exports_and_replays() -> Result<()> {
    let gateway = Gateway::builder().token(Some("t-nb")).start().await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    for code in ["x = 20", "print(x + 1)", "x * 2"] {
        let result = v1.execute(&id, code).await?;
        ensure!(result["status"] == "ok", "{code}: {result}");
    }
    let response = v1
        .request(reqwest::Method::GET, &format!("/v1/sessions/{id}/notebook"))
        .send()
        .await?;
    ensure!(response.status().as_u16() == 200);
    let notebook: Value = response.json().await?;
    let cells = notebook["cells"].as_array().context("cells")?;
    // nbformat writes multi-line strings as lists of lines.
    let text = |v: &Value| -> String {
        match v {
            Value::Array(lines) => lines.iter().filter_map(Value::as_str).collect(),
            other => other.as_str().unwrap_or_default().to_owned(),
        }
    };
    let sources: Vec<String> = cells.iter().map(|c| text(&c["source"])).collect();
    ensure!(
        sources == ["x = 20", "print(x + 1)", "x * 2"],
        "cells in order: {sources:?}"
    );
    ensure!(
        text(&cells[1]["outputs"][0]["text"]) == "21\n",
        "{}",
        cells[1]
    );
    ensure!(
        text(&cells[2]["outputs"][0]["data"]["text/plain"]) == "40",
        "{}",
        cells[2]
    );
    let answer: Value = v1
        .request(reqwest::Method::POST, "/v1/notebooks/replay")
        .json(&notebook)
        .send()
        .await?
        .json()
        .await?;
    ensure!(answer["matched"] == true, "replay: {}", answer["report"]);
    // Another session's id, or none, is a 404 like any unknown session.
    let status = v1
        .request(reqwest::Method::GET, "/v1/sessions/nope/notebook")
        .send()
        .await?
        .status();
    ensure!(status.as_u16() == 404);
    Ok(())
}
