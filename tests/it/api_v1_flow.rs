//! API v1 end to end: the real binary, real ipykernels in the real (namespaces) sandbox.

use std::time::Duration;

use anyhow::{Context, Result};
use futures_util::{SinkExt, StreamExt};
use reqwest::Method;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::support::v1::{ws_next, V1Client};
use crate::support::{Gateway, PATIENCE};

/// Creates a session, checking what every creation answers here: its `Location` and an idle
/// state.
async fn create_session(v1: &V1Client<'_>, body: Value) -> Result<String> {
    let created = v1.new_session(body).await?;
    let id = created.id;
    assert_eq!(
        created.location.as_deref(),
        Some(format!("/v1/sessions/{id}").as_str())
    );
    assert_eq!(
        created.model.state,
        cellgate::sessions::SessionState::Idle,
        "{:?}",
        created.model
    );
    assert_eq!(created.model.id.as_str(), id);
    Ok(id)
}

/// Sessions: create, list, get, execute with state kept between executes, the typed
/// result of ok and error, delete.
#[tokio::test]
async fn sessions_execute_and_keep_state() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let id = create_session(&v1, json!({})).await?;

    let result = v1
        .execute(
            &id,
            "x = 40 + 2\nprint('hello')\nimport sys; print('warn', file=sys.stderr)\nx",
        )
        .await?;
    assert_eq!(result["status"], "ok", "{result}");
    assert_eq!(result["stdout"], "hello\n");
    assert_eq!(result["stderr"], "warn\n");
    assert_eq!(result["result"], "42");
    assert_eq!(result["execution_count"], 1);
    assert_eq!(result["state_generation"], 1);
    assert!(result["error"].is_null());
    assert!(result["duration_ms"].as_u64().is_some());
    assert_eq!(result["artifacts"], json!([]));
    assert_eq!(result["denials"], json!([]));

    let result = v1.run(&id, "x * 2").await?;
    assert_eq!(
        result.result.as_deref(),
        Some("84"),
        "state survives between executes"
    );
    assert_eq!(result.execution_count, Some(2));
    assert_eq!(result.status, cellgate::sessions::Status::Ok);

    let result = v1.execute(&id, "def f():\n    return 1 / 0\nf()").await?;
    assert_eq!(result["status"], "error");
    assert_eq!(result["error"]["ename"], "ZeroDivisionError");
    assert_eq!(result["error"]["evalue"], "division by zero");
    let traceback = result["error"]["traceback"]
        .as_array()
        .context("traceback")?;
    assert!(!traceback.is_empty());
    for line in traceback {
        assert!(
            !line.as_str().unwrap().contains('\u{1b}'),
            "ANSI codes left: {line}"
        );
    }
    assert!(traceback
        .iter()
        .any(|l| l.as_str().unwrap().contains("1 / 0")));

    let (status, list) = v1.get("/v1/sessions").await?;
    assert_eq!(status, 200);
    assert!(list
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["id"] == id.as_str()));
    let (status, model) = v1.get(&format!("/v1/sessions/{id}")).await?;
    assert_eq!(status, 200);
    assert_eq!(model["executions"], 3);
    assert_eq!(model["policy"], "default");
    assert_eq!(model["sandbox"], "namespaces");
    // The same session is a kernel of the Kernel Gateway API.
    let (status, kernel) = v1.get(&format!("/api/kernels/{id}")).await?;
    assert_eq!(status, 200, "{kernel}");

    let status = v1
        .request(Method::DELETE, &format!("/v1/sessions/{id}"))
        .send()
        .await?
        .status();
    assert_eq!(status.as_u16(), 204);
    let (status, _) = v1.get(&format!("/v1/sessions/{id}")).await?;
    assert_eq!(status, 404);
    let (status, _) = v1.get(&format!("/api/kernels/{id}")).await?;
    assert_eq!(status, 404, "the kernel went with the session");
    Ok(())
}

/// Clear errors for bad requests; unknown sessions are 404.
#[tokio::test]
async fn bad_requests_get_clear_errors() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let (status, body) = v1.get("/v1/sessions/nope").await?;
    assert_eq!(status, 404, "{body}");
    for (path, body) in [
        ("/v1/sessions", "{not json"),
        ("/v1/sessions", r#"{"kernel_name": 3}"#),
        ("/v1/sessions", r#"{"unknown_field": 1}"#),
    ] {
        let response = v1
            .request(Method::POST, path)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await?;
        assert_eq!(response.status().as_u16(), 400, "{body}");
        let error: Value = response.json().await?;
        assert!(
            error["message"]
                .as_str()
                .unwrap()
                .contains("invalid JSON body"),
            "{error}"
        );
    }
    let response = v1
        .request(Method::POST, "/v1/sessions")
        .json(&json!({"kernel_name": "no-such-kernel"}))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 404);
    let response = v1
        .request(Method::POST, "/v1/sessions")
        .json(&json!({"policy": "no-such-policy"}))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 400);
    let id = create_session(&v1, json!({})).await?;
    let response = v1
        .request(Method::POST, &format!("/v1/sessions/{id}/execute"))
        .json(&json!({"code": "1", "timeout_s": -1}))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 400);
    // Unauthenticated requests are refused.
    let response = reqwest::Client::new()
        .get(format!("{}/v1/sessions", gateway.base))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 401);
    Ok(())
}

/// The session WebSocket: events of an execution in order, arriving while the cell still
/// runs, `input()` answered over the socket, bad client messages answered, not fatal.
#[tokio::test]
async fn websocket_streams_events_progressively() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let id = create_session(&v1, json!({})).await?;
    let mut socket = v1.ws(&id).await?;
    let hello = ws_next(&mut socket).await?;
    assert_eq!(hello["type"], "session");
    assert_eq!(hello["session"]["id"], id.as_str());

    socket.send(WsMessage::Text("{nonsense".into())).await?;
    let error = ws_next(&mut socket).await?;
    assert_eq!(error["type"], "client_error", "{error}");

    // The cell waits for a file the test writes only after it saw the first output: the
    // first event must arrive while the cell is still running.
    let code = "import os, time\nprint('first', flush=True)\nwhile not os.path.exists('go'):\n    time.sleep(0.05)\nprint('second')\nname = input('who? ')\nprint('hi', name)\n7 * 6";
    socket
        .send(WsMessage::Text(
            json!({"type": "execute", "code": code}).to_string().into(),
        ))
        .await?;
    let started = ws_next(&mut socket).await?;
    assert_eq!(started["type"], "started", "{started}");
    let execution = started["execution_id"]
        .as_str()
        .context("execution_id")?
        .to_owned();
    let first = ws_next(&mut socket).await?;
    assert_eq!(first["type"], "stream", "{first}");
    assert_eq!(first["text"], "first\n");
    assert_eq!(first["execution_id"], execution.as_str());
    let response = v1
        .request(Method::PUT, &format!("/v1/sessions/{id}/files/go"))
        .body("")
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 201, "{}", gateway.log());
    let mut seen = vec![];
    let result = loop {
        let event = ws_next(&mut socket).await?;
        seen.push(event["type"].as_str().unwrap_or_default().to_owned());
        match event["type"].as_str() {
            Some("input_request") => {
                assert_eq!(event["prompt"], "who? ");
                socket
                    .send(WsMessage::Text(
                        json!({"type": "input_reply", "value": "Ada"})
                            .to_string()
                            .into(),
                    ))
                    .await?;
            }
            Some("done") => break event["result"].clone(),
            _ => {}
        }
    };
    // stdin and iopub are separate sockets: only iopub's own order is fixed.
    let iopub: Vec<_> = seen.iter().filter(|t| *t != "input_request").collect();
    assert_eq!(
        iopub.first().map(|s| s.as_str()),
        Some("stream"),
        "{seen:?}"
    );
    assert_eq!(&iopub[iopub.len() - 2..], ["result", "done"], "{seen:?}");
    assert_eq!(seen.iter().filter(|t| *t == "input_request").count(), 1);
    assert_eq!(result["status"], "ok", "{result}");
    assert_eq!(result["stdout"], "first\nsecond\nhi Ada\n");
    assert_eq!(result["result"], "42");
    Ok(())
}

/// The session WebSocket follows the kernel's life: a kernel killed mid-cell answers the
/// cell (`sandbox_lost`) and the socket hears `kernel: dead`; deleting the session ends
/// with `kernel: terminated` and the server closing the socket.
#[tokio::test]
async fn websocket_follows_the_kernels_life() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let id = create_session(&v1, json!({})).await?;
    let mut socket = v1.ws(&id).await?;
    assert_eq!(ws_next(&mut socket).await?["type"], "session");
    let code = "import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)";
    let result = v1.execute(&id, code).await?;
    assert_eq!(result["status"], "sandbox_lost", "{result}");
    assert_eq!(result["error"]["ename"], "KernelDiedError");
    let mut types = vec![];
    loop {
        let event = ws_next(&mut socket).await?;
        let kind = event["type"].as_str().unwrap_or_default().to_owned();
        types.push(kind.clone());
        if kind == "kernel" {
            assert_eq!(event["state"], "dead", "{event}");
            break;
        }
    }
    assert!(types.contains(&"done".to_owned()), "{types:?}");
    let (_, model) = v1.get(&format!("/v1/sessions/{id}")).await?;
    assert_eq!(model["state"], "dead", "{model}");
    assert!(
        model["reason"].as_str().unwrap().contains("signal 9"),
        "{model}"
    );
    // Executing on a dead kernel is a typed result, not an HTTP error.
    let result = v1.execute(&id, "1").await?;
    assert_eq!(result["status"], "sandbox_lost", "{result}");

    let status = v1
        .request(Method::DELETE, &format!("/v1/sessions/{id}"))
        .send()
        .await?
        .status();
    assert_eq!(status.as_u16(), 204);
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(30), socket.next())
            .await
            .context("the socket was not closed")?;
        match frame {
            Some(Ok(WsMessage::Text(text))) => {
                let event: Value = serde_json::from_str(text.as_str())?;
                if event["type"] == "kernel" {
                    assert_eq!(event["state"], "terminated", "{event}");
                }
            }
            Some(Ok(WsMessage::Close(_))) | None | Some(Err(_)) => break,
            Some(Ok(_)) => {}
        }
    }
    Ok(())
}

/// A request timeout the cell ignores: interrupt, then (after the policy's grace) a restart;
/// the result says `timeout`, the state generation moves on, and the session keeps working.
#[tokio::test]
async fn an_ignored_timeout_restarts_the_kernel() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("default.toml"),
        "[limits]\ninterrupt_grace = \"1s\"\n",
    )?;
    let gateway = Gateway::builder()
        .policies_dir(dir.path().to_owned())
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let id = create_session(&v1, json!({})).await?;
    v1.execute(&id, "kept = 1").await?;
    let code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('stubborn', flush=True)\nwhile True:\n    time.sleep(0.05)";
    // The timeout leaves the cell time to ignore SIGINT and print first, even on a busy
    // machine (it counts from the cell's start).
    let result = v1
        .execute_with(&id, json!({"code": code, "timeout_s": 2}))
        .await?;
    assert_eq!(result["status"], "timeout", "{result}");
    assert_eq!(result["error"]["ename"], "CellTimeoutError");
    assert!(result["error"]["evalue"]
        .as_str()
        .unwrap()
        .contains("restarted"));
    assert_eq!(result["stdout"], "stubborn\n");
    let after = v1.execute(&id, "'kept' in dir()").await?;
    assert_eq!(after["status"], "ok", "{after}");
    assert_eq!(
        after["result"], "False",
        "variables are gone with the restart"
    );
    assert_eq!(after["state_generation"], 2);
    Ok(())
}

/// Initial files arrive before the first cell; the listing shows what the code wrote; a
/// file written under outputs/ by the code is an artifact whose bytes are the file's.
#[tokio::test]
async fn initial_files_listing_and_output_files() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let id = create_session(
        &v1,
        json!({"files": [
            {"path": "data/in.csv", "content": "a,b\n1,2\n3,4\n"},
            {"path": "blob.bin", "content": "AAEC/w==", "encoding": "base64"},
        ]}),
    )
    .await?;
    let code = "import pandas as pd, os\ndf = pd.read_csv('data/in.csv')\nos.makedirs('outputs', exist_ok=True)\ndf.assign(c=df.a + df.b).to_csv('outputs/sum.csv', index=False)\nlen(open('blob.bin', 'rb').read())";
    let result = v1.execute(&id, code).await?;
    assert_eq!(result["status"], "ok", "{result}");
    assert_eq!(result["result"], "4");
    let artifacts = result["artifacts"].as_array().context("artifacts")?;
    assert_eq!(artifacts.len(), 1, "{result}");
    assert_eq!(artifacts[0]["path"], "outputs/sum.csv");
    assert_eq!(artifacts[0]["mime"], "text/csv");
    let url = artifacts[0]["url"].as_str().context("url")?;
    let response = v1.request(Method::GET, url).send().await?;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.text().await?, "a,b,c\n1,2,3\n3,4,7\n");
    // Unchanged files are not reported again.
    let again = v1.execute(&id, "1").await?;
    assert_eq!(again["artifacts"], json!([]), "{again}");

    let (status, listing) = v1
        .get(&format!("/v1/sessions/{id}/files?recursive=true"))
        .await?;
    assert_eq!(status, 200);
    let paths: Vec<&str> = listing
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    for expected in [
        "blob.bin",
        "data",
        "data/in.csv",
        "outputs",
        "outputs/sum.csv",
    ] {
        assert!(paths.contains(&expected), "{expected} in {paths:?}");
    }
    let response = v1
        .request(Method::GET, &format!("/v1/sessions/{id}/files/blob.bin"))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.bytes().await?.to_vec(), vec![0u8, 1, 2, 255]);
    // A bad initial file fails the create and leaves no session behind.
    let response = v1
        .request(Method::POST, "/v1/sessions")
        .json(&json!({"files": [{"path": "../escape", "content": "x"}]}))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 400);
    let (_, list) = v1.get("/v1/sessions").await?;
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    Ok(())
}

/// The policy's artifact_size and upload_size, and the gateway's artifact retention: an
/// output too large is named in `omitted` (never inlined, never silent), an upload too large
/// is a 413, and a deleted session's artifacts go after the retention period.
#[tokio::test]
async fn policy_caps_and_artifact_retention() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("default.toml"),
        "[limits]\nartifact_size = \"2KiB\"\nupload_size = \"4KiB\"\n",
    )?;
    let gateway = Gateway::builder()
        .policies_dir(dir.path().to_owned())
        .args(&["--artifact-retention", "1"])
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let id = create_session(&v1, json!({})).await?;
    let code = "from IPython.display import display, HTML, Markdown\nimport os\ndisplay(HTML('<p>' + 'x' * 5000 + '</p>'))\ndisplay(Markdown('*small*'))\nos.makedirs('outputs', exist_ok=True)\nopen('outputs/big.txt', 'w').write('y' * 3000)";
    let result = v1.execute(&id, code).await?;
    assert_eq!(result["status"], "ok", "{result}");
    let artifacts = result["artifacts"].as_array().context("artifacts")?;
    assert_eq!(artifacts.len(), 1, "{result}");
    assert_eq!(artifacts[0]["mime"], "text/markdown");
    let omitted = result["omitted"].as_array().context("omitted")?;
    assert_eq!(omitted.len(), 2, "{result}");
    assert_eq!(omitted[0]["mime"], "text/html");
    assert!(omitted[0]["reason"]
        .as_str()
        .unwrap()
        .contains("artifact_size"));
    assert_eq!(omitted[1]["path"], "outputs/big.txt");
    assert!(
        !result.to_string().contains("xxxxxxxxxx"),
        "no inlined output"
    );

    let put = |body: Vec<u8>| {
        v1.request(Method::PUT, &format!("/v1/sessions/{id}/files/up.bin"))
            .body(body)
            .send()
    };
    assert_eq!(put(vec![0; 5000]).await?.status().as_u16(), 413);
    assert_eq!(put(vec![0; 4096]).await?.status().as_u16(), 201);

    let url = artifacts[0]["url"].as_str().context("url")?.to_owned();
    let status = v1
        .request(Method::DELETE, &format!("/v1/sessions/{id}"))
        .send()
        .await?
        .status();
    assert_eq!(status.as_u16(), 204);
    let mut gone = false;
    let deadline = std::time::Instant::now() + PATIENCE;
    while std::time::Instant::now() < deadline {
        let status = v1.request(Method::GET, &url).send().await?.status();
        if status.as_u16() == 404 {
            gone = true;
            break;
        }
        assert_eq!(status.as_u16(), 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        gone,
        "artifacts of a deleted session go after the retention period"
    );
    Ok(())
}
