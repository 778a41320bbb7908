//! API v1 end to end, black box: a real `cellgate serve`, real ipykernels in the real
//! sandbox, driven over plain HTTP (JSON), Server-Sent Events and the per-session WebSocket,
//! exactly as a chat app or an agent would. Every status a result can have, artifacts of each
//! MIME type, files with traversal and link attacks (sent raw, so no client library cleans
//! the path up first), the one-shot execute and the OpenAPI document.
//!
//! Progressive delivery is proven without clocks: a cell prints, then waits for a file the
//! test uploads only after it has seen that print arrive. A stream that buffered until the
//! end would never let the cell finish (its own deadline then fails the test).
//!
//! Not covered here: `denied` (the egress proxy and package index that produce denials are
//! another branch; their tests live there) and tenants (JWT: another branch).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use futures_util::SinkExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::support::v1::{json_of, ws_next, ws_send, ws_until_done, V1Client, WAIT};
use crate::support::{sandbox_backend, Gateway, PATIENCE};

/// Python that waits (at most 60 s) for the workspace file `name`, then goes on; failing
/// loudly if it never comes.
pub(crate) fn wait_for_file(name: &str) -> String {
    format!(
        "import os as _os, time as _time\n\
         _t0 = _time.monotonic()\n\
         while not _os.path.exists({name:?}):\n\
         \x20   if _time.monotonic() - _t0 > 60: raise RuntimeError('the test never sent {name}')\n\
         \x20   _time.sleep(0.02)\n"
    )
}

/// A gateway whose default policy runs the test sandbox (`CELLGATE_TEST_SANDBOX`, so the
/// suite also runs under gvisor) with these extra `[limits]` lines. The directory must
/// outlive the gateway.
async fn start_gateway(limits: &str) -> Result<(Gateway, tempfile::TempDir)> {
    start_gateway_on(&sandbox_backend(), limits).await
}

/// The same with the default policy naming `backend`; fails loudly when the tests force
/// another backend on every kernel (the test would then not test `backend`).
async fn start_gateway_on(backend: &str, limits: &str) -> Result<(Gateway, tempfile::TempDir)> {
    if let Some(forced) = crate::support::forced_sandbox().filter(|f| f != backend) {
        bail!("this test is about the {backend} backend, but CELLGATE_TEST_SANDBOX={forced} forces another on every kernel");
    }
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("default.toml"),
        format!("[sandbox]\nbackend = \"{backend}\"\n[limits]\n{limits}"),
    )?;
    let gateway = Gateway::builder()
        .policies_dir(dir.path().to_owned())
        .start()
        .await?;
    Ok((gateway, dir))
}

/// One request over a raw TCP connection, the path sent exactly as given (an HTTP client
/// library would normalise `..` and `%2e%2e` away before the gateway ever saw them).
/// Answers the status code and the body.
async fn raw_request(
    gateway: &Gateway,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", gateway.port)).await?;
    let token = gateway.token.clone().unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: token {token}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        gateway.port,
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    let mut response = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut response)).await??;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn streamed(events: &[Value], name: &str) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "stream" && e["name"] == name)
        .map(|e| e["text"].as_str().unwrap_or_default())
        .collect()
}

/// Sessions: create, list, get, execute with state kept, errors typed, resource use,
/// delete; bad requests answered clearly without harming the session; unknown ids 404 on
/// every route.
#[tokio::test]
async fn sessions_execute_and_typed_results() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;

    let (status, list) = v1.get("/v1/sessions").await?;
    assert_eq!(status, 200);
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == id.as_str()),
        "{list}"
    );
    let (status, model) = v1.get(&format!("/v1/sessions/{id}")).await?;
    assert_eq!(status, 200);
    assert_eq!(model["id"], id.as_str());

    // State is kept across executes; stdout, stderr and the text/plain result are separate.
    let r = v1
        .execute(
            &id,
            "x = 41\nimport sys\nprint('out')\nprint('err', file=sys.stderr)",
        )
        .await?;
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["stdout"], "out\n");
    assert_eq!(r["stderr"], "err\n");
    assert!(r["result"].is_null(), "{r}");
    let first_count = r["execution_count"].as_i64().context("execution_count")?;
    let generation = r["state_generation"].as_u64().context("state_generation")?;
    assert!(r["duration_ms"].is_u64(), "{r}");
    assert_eq!(r["artifacts"], json!([]));
    assert_eq!(r["denials"], json!([]));

    let r = v1.execute(&id, "x + 1").await?;
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["result"], "42");
    assert_eq!(r["execution_count"].as_i64(), Some(first_count + 1));
    assert_eq!(r["state_generation"].as_u64(), Some(generation));

    // An error: typed, traceback readable (no ANSI colour codes).
    let r = v1.execute(&id, "def f():\n    return 1 / 0\nf()").await?;
    assert_eq!(r["status"], "error", "{r}");
    assert_eq!(r["error"]["ename"], "ZeroDivisionError");
    assert_eq!(r["error"]["evalue"], "division by zero");
    let traceback = r["error"]["traceback"].as_array().context("traceback")?;
    assert!(!traceback.is_empty());
    let joined: String = traceback
        .iter()
        .map(|l| l.as_str().unwrap_or_default())
        .collect();
    assert!(!joined.contains('\u{1b}'), "ANSI codes left in {joined:?}");
    assert!(joined.contains("ZeroDivisionError"), "{joined}");

    // Resource use is measured by the namespaces sandbox (cgroup).
    if sandbox_backend() == "namespaces" {
        let r = v1
            .execute(&id, "sum(i * i for i in range(3_000_000))")
            .await?;
        assert_eq!(r["status"], "ok", "{r}");
        assert!(r["resources"]["cpu_time_ms"].is_u64(), "{r}");
        assert!(
            r["resources"]["memory_peak_bytes"].as_u64().unwrap_or(0) > 0,
            "{r}"
        );
    }

    // Bad requests: clear 400s; the session still works afterwards.
    let response = v1
        .request(reqwest::Method::POST, &format!("/v1/sessions/{id}/execute"))
        .header("Content-Type", "application/json")
        .body("{not json")
        .send()
        .await?;
    let (status, body) = json_of(response).await?;
    assert_eq!(status, 400, "{body}");
    let (status, body) = v1
        .post(&format!("/v1/sessions/{id}/execute"), json!({"cod": "1"}))
        .await?;
    assert_eq!(status, 400, "{body}");
    let (status, body) = v1
        .post(
            &format!("/v1/sessions/{id}/execute"),
            json!({"code": "1", "timeout_s": -3}),
        )
        .await?;
    assert_eq!(status, 400, "{body}");
    let (status, body) = v1
        .post("/v1/sessions", json!({"kernel_name": "no-such-kernel"}))
        .await?;
    assert!(status == 400 || status == 404, "{status} {body}");
    let (status, body) = v1
        .post("/v1/sessions", json!({"policy": "no-such-policy"}))
        .await?;
    assert!(status == 400 || status == 404, "{status} {body}");
    let r = v1.execute(&id, "x").await?;
    assert_eq!(r["result"], "41");

    // Unknown sessions: 404 on every route.
    let missing = "00000000-0000-4000-8000-000000000000";
    assert_eq!(v1.get(&format!("/v1/sessions/{missing}")).await?.0, 404);
    for route in ["execute", "interrupt", "restart", "input"] {
        let (status, body) = v1
            .post(
                &format!("/v1/sessions/{missing}/{route}"),
                json!({"code": "1", "value": "v"}),
            )
            .await?;
        assert_eq!(status, 404, "{route}: {body}");
    }
    assert_eq!(
        v1.get(&format!("/v1/sessions/{missing}/files")).await?.0,
        404
    );
    assert_eq!(
        v1.get(&format!("/v1/sessions/{missing}/artifacts"))
            .await?
            .0,
        404
    );
    assert_eq!(v1.get("/v1/artifacts/nope").await?.0, 404);

    // Delete: gone from everywhere.
    let status = v1
        .request(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"))
        .send()
        .await?
        .status()
        .as_u16();
    assert_eq!(status, 204);
    assert_eq!(v1.get(&format!("/v1/sessions/{id}")).await?.0, 404);
    let (status, _) = v1
        .post(&format!("/v1/sessions/{id}/execute"), json!({"code": "1"}))
        .await?;
    assert_eq!(status, 404);
    let (_, list) = v1.get("/v1/sessions").await?;
    assert!(!list
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["id"] == id.as_str()));
    Ok(())
}

/// Without credentials API v1 answers 401 like the rest of the gateway.
#[tokio::test]
async fn api_v1_requires_auth() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    for path in ["/v1/sessions", "/v1/artifacts/x", "/v1/sessions/x/files"] {
        let status = reqwest::get(format!("{}{path}", gateway.base))
            .await?
            .status()
            .as_u16();
        assert_eq!(status, 401, "{path}");
    }
    let status = reqwest::Client::new()
        .post(format!("{}/v1/execute", gateway.base))
        .json(&json!({"code": "1"}))
        .send()
        .await?
        .status()
        .as_u16();
    assert_eq!(status, 401);
    Ok(())
}

/// `timeout_s` interrupts the cell and reports `timeout`; the variables survive (an
/// interrupt, not a restart). Restart then changes `state_generation` and loses them.
#[tokio::test]
async fn timeout_keeps_state_and_restart_changes_generation() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1.execute(&id, "kept = 'yes'").await?;
    let generation = r["state_generation"].as_u64().context("state_generation")?;

    let r = v1.execute_with(&id,
        json!({"code": "import time\nprint('before', flush=True)\ntime.sleep(60)", "timeout_s": 1.5}),
    )
    .await?;
    assert_eq!(r["status"], "timeout", "{r}");
    assert_eq!(r["stdout"], "before\n", "{r}");
    assert!(r["duration_ms"].as_u64().unwrap() >= 1000, "{r}");
    let r = v1.execute(&id, "kept").await?;
    assert_eq!(r["result"], "'yes'", "{r}");
    assert_eq!(r["state_generation"].as_u64(), Some(generation));

    let (status, model) = v1
        .post(&format!("/v1/sessions/{id}/restart"), json!({}))
        .await?;
    assert_eq!(status, 200, "{model}");
    let restarted = model["state_generation"].as_u64().context("generation")?;
    assert!(restarted > generation, "{model}");
    let r = v1.execute(&id, "'kept' in dir()").await?;
    assert_eq!(r["result"], "False", "{r}");
    assert_eq!(r["state_generation"].as_u64(), Some(restarted));
    Ok(())
}

/// `sandbox_lost`: the kernel process dies in the middle of a cell; the cell is answered and
/// the gateway keeps serving.
#[tokio::test]
async fn kernel_death_is_sandbox_lost() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1.execute(&id,
        "import os, signal, time\nprint('dying', flush=True)\ntime.sleep(0.2)\nos.kill(os.getpid(), signal.SIGKILL)",
    )
    .await?;
    assert_eq!(r["status"], "sandbox_lost", "{r}");
    assert_eq!(r["stdout"], "dying\n", "{r}");
    assert!(
        r["error"]["evalue"]
            .as_str()
            .unwrap_or_default()
            .contains("signal 9"),
        "{r}"
    );
    let other = v1.create_session(json!({})).await?;
    assert_eq!(v1.execute(&other, "1 + 1").await?["result"], "2");
    Ok(())
}

/// `output_truncated` (the policy's per-cell output limit, whether the output comes in many
/// small pieces or one big one) and `oom` (the kernel exceeds the policy's memory).
#[tokio::test]
async fn policy_limits_give_output_truncated_and_oom() -> Result<()> {
    if sandbox_backend() == "process" {
        panic!(
            "this test needs a sandbox with a memory limit; CELLGATE_TEST_SANDBOX=process has none"
        );
    }
    let (gateway, _policies) =
        // The sandbox's memory cgroup holds memory + workspace (the workspace is RAM).
        start_gateway("memory = \"256MiB\"\nworkspace = \"64MiB\"\noutput_per_execution = \"64KiB\"\n")
            .await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;

    let r = v1
        .execute(
            &id,
            "for i in range(20000):\n    print('x' * 100, flush=(i % 100 == 0))\nfinished = True",
        )
        .await?;
    let stdout = r["stdout"].as_str().context("stdout")?;
    assert_eq!(r["status"], "output_truncated", "{}", r["stderr"]);
    assert!(stdout.len() <= 64 << 10, "{} bytes", stdout.len());
    assert!(stdout.len() > 16 << 10, "{} bytes", stdout.len());
    assert_eq!(v1.execute(&id, "finished").await?["result"], "True");

    // One piece bigger than the whole limit (unflushed output goes out as the cell ends,
    // racing its reply): still reported.
    let r = v1
        .execute(&id, "print('z' * (200 << 10))\nalso = True")
        .await?;
    assert_eq!(r["status"], "output_truncated", "{r}");
    assert_eq!(v1.execute(&id, "also").await?["result"], "True");

    let before = v1.execute(&id, "before = 1").await?;
    let generation = before["state_generation"].as_u64().context("generation")?;
    let r = v1.execute(&id, "hog = b'x' * (600 * 2**20)").await?;
    assert_eq!(r["status"], "oom", "{r}");
    assert_eq!(r["error"]["ename"], "OutOfMemoryError", "{r}");
    let r = v1.execute(&id, "'before' in dir()").await?;
    assert_eq!(r["result"], "False", "{r}");
    assert!(r["state_generation"].as_u64().unwrap() > generation, "{r}");
    Ok(())
}

/// The policy's `pids` and `cpus` hold in the sandbox: a fork loop stops below the pids limit
/// with EAGAIN and the kernel answers on; a busy loop gets at most half a CPU under
/// `cpus = 0.5`, measured in the kernel's own CPU time (which a busy machine can only
/// lower), and its cgroup's `cpu.stat` shows it throttled (which a busy machine cannot fake).
/// Also run on a cgroup v2-only host (`cgroup_v2::`).
#[tokio::test]
async fn policy_pids_and_cpu_limits_hold() -> Result<()> {
    if sandbox_backend() == "process" {
        panic!("this test needs a sandbox with limits; CELLGATE_TEST_SANDBOX=process has none");
    }
    let policies = tempfile::tempdir()?;
    std::fs::write(
        policies.path().join("default.toml"),
        "[limits]\npids = 64\n",
    )?;
    std::fs::write(policies.path().join("half.toml"), "[limits]\ncpus = 0.5\n")?;
    let gateway = Gateway::builder()
        .policies_dir(policies.path().to_owned())
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let id = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;
    let fork_loop = "import os, errno, time\nkids, err = [], None\n\
        for _ in range(200):\n\
        \x20   try:\n\
        \x20       pid = os.fork()\n\
        \x20   except OSError as e:\n\
        \x20       err = e.errno\n\
        \x20       break\n\
        \x20   if pid == 0:\n\
        \x20       time.sleep(60)\n\
        \x20       os._exit(0)\n\
        \x20   kids.append(pid)\n\
        for k in kids:\n\
        \x20   os.kill(k, 9)\n\
        \x20   os.waitpid(k, 0)\n\
        print(len(kids), err == errno.EAGAIN)";
    let r = v1.execute(&id, fork_loop).await?;
    let stdout = r["stdout"].as_str().context("stdout")?;
    let (forked, eagain) = stdout.trim().split_once(' ').context("two words")?;
    let forked: usize = forked.parse().with_context(|| format!("{r}"))?;
    assert!(forked < 64, "forked {forked} under a pids limit of 64: {r}");
    assert_eq!(eagain, "True", "the fork failed with EAGAIN: {r}");
    assert_eq!(v1.execute(&id, "1 + 1").await?["result"], "2");

    let id = v1
        .create_session(json!({"policy": "half"}))
        .await
        .with_context(|| gateway.log())?;
    let busy = "import time, json\nwall0, cpu0 = time.monotonic(), time.process_time()\n\
        while time.monotonic() - wall0 < 3:\n\
        \x20   pass\n\
        print(json.dumps([time.monotonic() - wall0, time.process_time() - cpu0]))";
    let r = v1.execute(&id, busy).await?;
    let measured: Vec<f64> = serde_json::from_str(r["stdout"].as_str().context("stdout")?)
        .with_context(|| format!("{r}"))?;
    let (wall, cpu) = (measured[0], measured[1]);
    println!("busy loop: {wall:.2} s wall, {cpu:.2} s CPU under a half-CPU limit");
    // The slack is two CFS periods' quota at the window's edges. Half a CPU rather than
    // less: the kernel starts under the limit too, which under emulation (`cgroup_v2::`)
    // costs minutes at a quarter.
    assert!(
        cpu <= wall * 0.5 + 0.1,
        "{cpu} s of CPU in {wall} s wall under cpus = 0.5"
    );
    // A machine too busy to give the loop half a CPU would meet that bound with no limit
    // at all: the limit must also have held the kernel back.
    let throttled = crate::support::cpu_throttled(&id)
        .with_context(|| format!("no cpu.stat for the kernel of session {id}"))?;
    assert!(throttled > 0, "the CPU limit never throttled the busy loop");
    Ok(())
}

/// The result's stdout is capped (the full stream went out as events); the kernel runs on.
#[tokio::test]
async fn large_stdout_is_capped_in_the_result() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1
        .execute(
            &id,
            "import sys\nfor i in range(3000):\n    sys.stdout.write('y' * 1023 + '\\n')\n",
        )
        .await?;
    assert_eq!(r["status"], "ok");
    let stdout = r["stdout"].as_str().unwrap();
    assert!(
        stdout.len() < 3000 * 1024,
        "{} bytes in the result",
        stdout.len()
    );
    assert!(
        stdout.len() >= 64 << 10,
        "{} bytes in the result",
        stdout.len()
    );
    assert_eq!(r["stdout_truncated"], true);
    Ok(())
}

/// Every rich MIME type becomes an artifact: stored, referenced (never inlined), served with
/// its Content-Type and nosniff, HTML and SVG with `Content-Security-Policy: sandbox`; the
/// bytes served are the bytes displayed; images carry their size.
#[tokio::test]
async fn artifacts_of_every_mime_type() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let code = r#"
import base64, hashlib, io, json
import matplotlib
matplotlib.use('agg')
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

digests = {}
def show(mime, payload, raw_bytes):
    digests[mime] = hashlib.sha256(raw_bytes).hexdigest()
    display({mime: payload, 'text/plain': '<' + mime + '>'}, raw=True)

fig, ax = plt.subplots(figsize=(4, 3), dpi=50)
ax.imshow(np.random.default_rng(1).random((400, 400)))
png, jpg = io.BytesIO(), io.BytesIO()
fig.savefig(png, format='png'); fig.savefig(jpg, format='jpeg')
show('image/png', base64.b64encode(png.getvalue()).decode(), png.getvalue())
show('image/jpeg', base64.b64encode(jpg.getvalue()).decode(), jpg.getvalue())
svg = '<svg xmlns="http://www.w3.org/2000/svg" width="120" height="80"><rect width="120" height="80" fill="red"/><script>alert(1)</script></svg>'
show('image/svg+xml', svg, svg.encode())
html = '<b>bold</b><script>fetch("/v1/sessions")</script>'
show('text/html', html, html.encode())
show('text/markdown', '# Title\n\ntext', b'# Title\n\ntext')
show('text/latex', '$x^2$', b'$x^2$')
pdf = b'%PDF-1.4\n1 0 obj << >> endobj\ntrailer << >>\n%%EOF\n'
show('application/pdf', base64.b64encode(pdf).decode(), pdf)
for mime, doc in [
    ('application/json', {'a': [1, 2, 3]}),
    ('application/vnd.plotly.v1+json', {'data': [{'type': 'bar', 'x': [1, 2], 'y': [3, 4]}], 'layout': {}}),
    ('application/vnd.vegalite.v5+json', {'$schema': 'https://vega.github.io/schema/vega-lite/v5.json', 'mark': 'bar', 'data': {'values': [{'a': 1}]}}),
    ('application/vnd.vegalite.v4+json', {'mark': 'point', 'data': {'values': [{'a': 2}]}}),
]:
    digests[mime] = None
    display({mime: doc, 'text/plain': '<' + mime + '>'}, raw=True)
print(json.dumps(digests))
"#;
    let response = v1
        .request(reqwest::Method::POST, &format!("/v1/sessions/{id}/execute"))
        .json(&json!({ "code": code }))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().await?;
    // The PNG alone is hundreds of kilobytes: references only, never the bytes.
    assert!(text.len() < 32 << 10, "the result is {} bytes", text.len());
    let r: Value = serde_json::from_str(&text)?;
    assert_eq!(r["status"], "ok", "{r}");
    let digests: Value = serde_json::from_str(r["stdout"].as_str().unwrap().trim())?;
    let artifacts = r["artifacts"].as_array().context("artifacts")?.clone();

    let (_, listed) = v1.get(&format!("/v1/sessions/{id}/artifacts")).await?;
    let listed = listed.as_array().context("listed")?;

    for (mime, digest) in digests.as_object().unwrap() {
        let artifact = artifacts
            .iter()
            .find(|a| a["mime"] == mime.as_str())
            .with_context(|| format!("no {mime} artifact in {artifacts:?}"))?;
        let artifact_id = artifact["id"].as_str().context("id")?;
        assert!(
            listed.iter().any(|a| a["id"] == artifact["id"]),
            "{mime} not listed"
        );
        assert!(
            !artifact["summary"].as_str().unwrap_or_default().is_empty(),
            "{artifact}"
        );
        let url = artifact["url"].as_str().context("url")?;
        assert!(
            url.ends_with(&format!("/v1/artifacts/{artifact_id}")),
            "{url}"
        );
        let response = v1.artifact(artifact_id).await?;
        assert_eq!(response.status().as_u16(), 200, "{mime}");
        let headers = response.headers().clone();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        assert!(
            header("content-type").starts_with(mime.as_str()),
            "{mime}: {}",
            header("content-type")
        );
        assert_eq!(header("x-content-type-options"), "nosniff", "{mime}");
        if mime == "text/html" || mime == "image/svg+xml" {
            assert!(
                header("content-security-policy")
                    .split(';')
                    .any(|d| d.trim() == "sandbox"),
                "{mime}: CSP {:?}",
                header("content-security-policy")
            );
        }
        let bytes = response.bytes().await?;
        assert_eq!(
            artifact["bytes"].as_u64(),
            Some(bytes.len() as u64),
            "{mime}"
        );
        match digest.as_str() {
            Some(digest) => assert_eq!(sha256_hex(&bytes), digest, "{mime} bytes differ"),
            // JSON bundles: the stored document parses and is an object, as displayed.
            None => {
                let doc: Value = serde_json::from_slice(&bytes).with_context(|| mime.clone())?;
                assert!(doc.is_object(), "{mime}: {doc}");
            }
        }
        match mime.as_str() {
            "image/png" | "image/jpeg" => {
                assert_eq!(artifact["width"], 200, "{artifact}");
                assert_eq!(artifact["height"], 150, "{artifact}");
            }
            "image/svg+xml" => {
                assert_eq!(artifact["width"], 120, "{artifact}");
                assert_eq!(artifact["height"], 80, "{artifact}");
            }
            _ => {}
        }
    }
    Ok(())
}

/// A display_id update stores a new version linked to the old one; files written under
/// `outputs/` become artifacts too, once.
#[tokio::test]
async fn display_updates_and_output_files_become_artifacts() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1
        .execute(
            &id,
            "from IPython.display import display, HTML\n\
         h = display(HTML('<b>v1</b>'), display_id=True)\n\
         h.update(HTML('<b>v2</b>'))\n\
         import os\n\
         os.makedirs('outputs', exist_ok=True)\n\
         with open('outputs/report.csv', 'w') as f:\n\
         \x20   f.write('a,b\\n1,2\\n')\n",
        )
        .await?;
    assert_eq!(r["status"], "ok", "{r}");
    let artifacts = r["artifacts"].as_array().context("artifacts")?;
    let html: Vec<&Value> = artifacts
        .iter()
        .filter(|a| a["mime"] == "text/html")
        .collect();
    assert_eq!(html.len(), 2, "{artifacts:?}");
    assert_eq!(html[0]["display_id"], html[1]["display_id"]);
    assert!(html[0]["display_id"].is_string());
    assert_eq!(html[1]["previous"], html[0]["id"], "{html:?}");
    assert!(
        html[1]["version"].as_u64() > html[0]["version"].as_u64(),
        "{html:?}"
    );
    let body = v1
        .artifact(html[1]["id"].as_str().unwrap())
        .await?
        .text()
        .await?;
    assert_eq!(body, "<b>v2</b>");

    let report = artifacts
        .iter()
        .find(|a| a["path"] == "outputs/report.csv")
        .with_context(|| format!("outputs/report.csv is no artifact: {artifacts:?}"))?;
    let body = v1
        .artifact(report["id"].as_str().unwrap())
        .await?
        .text()
        .await?;
    assert_eq!(body, "a,b\n1,2\n");
    // An unchanged output file is not reported again.
    let r = v1.execute(&id, "1").await?;
    assert_eq!(r["artifacts"], json!([]), "{r}");
    Ok(())
}

/// SSE: ordered events (started … stream … done) delivered while the cell runs; `input()`
/// answered through `POST /input`; 409 when nothing waits for input.
#[tokio::test]
async fn sse_streams_progressively_and_input_works() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let code = format!(
        "print('first', flush=True)\n{}print('second')\nname = input('who? ')\nprint('hi', name)\n42",
        wait_for_file("go")
    );
    let mut sse = v1
        .sse(
            &format!("/v1/sessions/{id}/execute"),
            json!({ "code": code }),
        )
        .await?;
    let (name, started) = sse.next().await?;
    assert_eq!(name, "started", "{started}");
    assert_eq!(started["type"], "started");
    let execution = started["execution_id"].clone();
    let (name, first) = sse.next().await?;
    assert_eq!(
        (name.as_str(), &first["text"]),
        ("stream", &json!("first\n")),
        "{first}"
    );
    assert_eq!(first["execution_id"], execution);
    // Only now does the cell get to go on.
    assert_eq!(v1.put_file(&id, "go", b"1".to_vec()).await?, 201);
    let mut events = vec![];
    loop {
        let (name, event) = sse.next().await?;
        assert_eq!(event["type"], name.as_str());
        if name == "input_request" {
            assert_eq!(event["prompt"], "who? ");
            let (status, body) = v1
                .post(&format!("/v1/sessions/{id}/input"), json!({"value": "bob"}))
                .await?;
            assert_eq!(status, 204, "{body}");
        }
        events.push(event);
        if name == "done" {
            break;
        }
    }
    assert_eq!(
        streamed(&events, "stdout"),
        "second\nhi bob\n",
        "{events:?}"
    );
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let result_at = kinds
        .iter()
        .position(|k| *k == "result")
        .context("a result event")?;
    assert!(result_at < kinds.len() - 1);
    let done = events.last().unwrap();
    assert_eq!(done["result"]["status"], "ok", "{done}");
    assert_eq!(done["result"]["result"], "42");
    assert_eq!(done["result"]["stdout"], "first\nsecond\nhi bob\n");

    // Input when nothing waits: 409, and the session is fine.
    let (status, body) = v1
        .post(&format!("/v1/sessions/{id}/input"), json!({"value": "x"}))
        .await?;
    assert_eq!(status, 409, "{body}");
    assert_eq!(v1.execute(&id, "name").await?["result"], "'bob'");
    Ok(())
}

/// The session WebSocket: execute, interrupt and input_reply from the client; every event of
/// the session (also those of executions started over HTTP, and on a second socket), in
/// order, as they happen.
#[tokio::test]
async fn websocket_executes_streams_interrupts_and_answers_input() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let mut socket = v1.ws(&id).await?;
    let hello = ws_next(&mut socket).await?;
    assert_eq!(hello["type"], "session", "{hello}");
    assert_eq!(hello["session"]["id"], id.as_str());

    // Progressive: the first print arrives while the cell still waits for the test.
    let code = format!(
        "print('one', flush=True)\n{}print('two')\n6 * 7",
        wait_for_file("go")
    );
    ws_send(&mut socket, json!({"type": "execute", "code": code})).await?;
    let started = ws_next(&mut socket).await?;
    assert_eq!(started["type"], "started", "{started}");
    let first = ws_next(&mut socket).await?;
    assert_eq!(
        (&first["type"], &first["text"]),
        (&json!("stream"), &json!("one\n")),
        "{first}"
    );
    assert_eq!(v1.put_file(&id, "go", vec![]).await?, 201);
    let events = ws_until_done(&mut socket).await?;
    assert_eq!(streamed(&events, "stdout"), "two\n");
    let done = events.last().unwrap();
    assert_eq!(done["result"]["status"], "ok", "{done}");
    assert_eq!(done["result"]["result"], "42");
    assert!(events
        .iter()
        .all(|e| e["execution_id"] == started["execution_id"]));

    // A message the gateway cannot understand: an error frame, the socket stays usable.
    ws_send(&mut socket, json!({"type": "launch_missiles"})).await?;
    let error = ws_next(&mut socket).await?;
    assert_eq!(error["type"], "client_error", "{error}");
    socket.send(WsMessage::Text("not json".into())).await?;
    assert_eq!(ws_next(&mut socket).await?["type"], "client_error");

    // input() answered over the socket.
    ws_send(
        &mut socket,
        json!({"type": "execute", "code": "answer = input('pin: ')\nprint('got', answer)"}),
    )
    .await?;
    let mut events = vec![];
    loop {
        let event = ws_next(&mut socket).await?;
        if event["type"] == "input_request" {
            assert_eq!(event["prompt"], "pin: ");
            ws_send(&mut socket, json!({"type": "input_reply", "value": "1234"})).await?;
        }
        let done = event["type"] == "done";
        events.push(event);
        if done {
            break;
        }
    }
    assert_eq!(streamed(&events, "stdout"), "got 1234\n", "{events:?}");

    // Interrupt over the socket: KeyboardInterrupt, the variables survive.
    ws_send(
        &mut socket,
        json!({"type": "execute", "code": "import time\nprint('sleeping', flush=True)\ntime.sleep(60)"}),
    )
    .await?;
    loop {
        let event = ws_next(&mut socket).await?;
        if event["type"] == "stream" && event["text"] == "sleeping\n" {
            break;
        }
        assert_ne!(event["type"], "done", "{event}");
    }
    ws_send(&mut socket, json!({"type": "interrupt"})).await?;
    let events = ws_until_done(&mut socket).await?;
    let done = events.last().unwrap();
    assert_eq!(done["result"]["status"], "error", "{done}");
    assert_eq!(
        done["result"]["error"]["ename"], "KeyboardInterrupt",
        "{done}"
    );

    // An execution started over HTTP shows on the socket too, and a second socket sees
    // the same events.
    let mut second = v1.ws(&id).await?;
    assert_eq!(ws_next(&mut second).await?["type"], "session");
    let r = v1.execute(&id, "print(answer)").await?;
    assert_eq!(r["stdout"], "1234\n");
    for socket in [&mut socket, &mut second] {
        let events = ws_until_done(socket).await?;
        assert_eq!(events[0]["type"], "started");
        assert_eq!(streamed(&events, "stdout"), "1234\n");
        assert_eq!(
            events.last().unwrap()["result"]["execution_id"],
            r["execution_id"]
        );
    }

    // A WebSocket to an unknown session: refused with 404.
    let err = v1
        .ws("00000000-0000-4000-8000-000000000000")
        .await
        .err()
        .context("connected to a missing session")?;
    assert!(err.to_string().contains("404"), "{err}");
    Ok(())
}

/// Files: upload → the kernel reads it; the kernel writes → download; list. Traversal,
/// absolute paths, NUL, links planted by the kernel and oversize uploads are refused and
/// change nothing on the host.
#[tokio::test]
async fn files_upload_download_and_attacks() -> Result<()> {
    files_on(&sandbox_backend()).await
}

/// The same for a gVisor session, whose size-limited workspace is a tmpfs only `runsc`
/// sees (reached through /proc), with what that adds: files uploaded into a directory the
/// kernel has listed already appear at once (gVisor caches what it looked up), the size
/// limit holds, and `outputs/` becomes artifacts.
#[tokio::test]
async fn gvisor_files_upload_download_and_attacks() -> Result<()> {
    files_on("gvisor").await
}

async fn files_on(backend: &str) -> Result<()> {
    let (gateway, _policies) = start_gateway_on(backend, "workspace = \"4MiB\"\n").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1
        .create_session(json!({"files": [{"path": "seed/hello.txt", "content": "seeded"}]}))
        .await?;
    assert_eq!(
        v1.execute(&id, "open('seed/hello.txt').read()").await?["result"],
        "'seeded'"
    );

    // Uploaded files belong to the sandbox's user: the kernel may change and remove them.
    let r = v1.execute(&id,
        "import os\nst = os.stat('seed/hello.txt')\nopen('seed/hello.txt', 'a').write('!')\n\
         os.rename('seed/hello.txt', 'seed/moved.txt')\n(st.st_uid == os.getuid(), st.st_gid == os.getgid())",
    )
    .await?;
    assert_eq!(r["result"], "(True, True)", "{r}");

    let csv = b"a,b\n1,2\n3,4\n".to_vec();
    assert_eq!(v1.put_file(&id, "data/in.csv", csv.clone()).await?, 201);
    let r = v1.execute(&id,
        "import pandas as pd\ndf = pd.read_csv('data/in.csv')\ndf['c'] = df.a + df.b\ndf.to_csv('data/out.csv', index=False)\nint(df.c.sum())",
    )
    .await?;
    assert_eq!(r["result"], "10", "{r}");
    let response = v1
        .request(
            reqwest::Method::GET,
            &format!("/v1/sessions/{id}/files/data/out.csv"),
        )
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(
        response
            .headers()
            .get("x-content-type-options")
            .and_then(|v| v.to_str().ok()),
        Some("nosniff")
    );
    assert_eq!(response.text().await?, "a,b,c\n1,2,3\n3,4,7\n");
    let (status, listing) = v1
        .get(&format!("/v1/sessions/{id}/files?recursive=true"))
        .await?;
    assert_eq!(status, 200);
    let paths: Vec<&str> = listing
        .as_array()
        .context("listing")?
        .iter()
        .filter_map(|e| e["path"].as_str())
        .collect();
    for want in ["data/in.csv", "data/out.csv", "seed/moved.txt"] {
        assert!(paths.contains(&want), "{want} missing from {listing}");
    }
    let entry = listing
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["path"] == "data/in.csv")
        .unwrap();
    assert_eq!(entry["size"], csv.len());

    // Traversal in every spelling, sent raw so no client library cleans it up.
    let passwd = std::fs::read("/etc/passwd")?;
    for path in [
        "../x",
        "..%2fx",
        "%2e%2e/x",
        "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "a/../../x",
        "%2fetc%2fpasswd",
        "x%00y",
        ".",
    ] {
        let url = format!("/v1/sessions/{id}/files/{path}");
        let (status, body) = raw_request(&gateway, "PUT", &url, b"pwned").await?;
        assert_eq!(status, 400, "PUT {path}: {body}");
        let (status, body) = raw_request(&gateway, "GET", &url, b"").await?;
        assert_eq!(status, 400, "GET {path}: {body}");
    }
    let (status, body) = raw_request(
        &gateway,
        "GET",
        &format!("/v1/sessions/{id}/files//etc/passwd"),
        b"",
    )
    .await?;
    assert!(status == 400 || status == 404, "{status} {body}");
    assert!(!body.contains("root:"), "{body}");

    // Links planted by hostile code are never followed, in either direction.
    let r = v1.execute(&id,
        "import os\nos.symlink('/etc/passwd', 'passwd')\nos.symlink('/etc', 'etc')\nos.symlink('/', 'root')\n'planted'",
    )
    .await?;
    assert_eq!(r["result"], "'planted'", "{r}");
    let planted = format!("cellgate-pwned-{}", std::process::id());
    for path in [
        "passwd".to_owned(),
        "etc/passwd".to_owned(),
        "root/etc/passwd".to_owned(),
        format!("etc/{planted}"),
        format!("root/tmp/{planted}"),
    ] {
        let url = format!("/v1/sessions/{id}/files/{path}");
        let (status, body) = raw_request(&gateway, "GET", &url, b"").await?;
        assert!((400..500).contains(&status), "GET {path}: {status} {body}");
        assert!(!body.contains("root:"), "GET {path} leaked {body}");
        let (status, body) = raw_request(&gateway, "PUT", &url, b"pwned\n").await?;
        // Replacing the link itself with a file is acceptable; writing through it is not.
        assert!(
            status == 201 || (400..500).contains(&status),
            "PUT {path}: {status} {body}"
        );
    }
    assert_eq!(
        std::fs::read("/etc/passwd")?,
        passwd,
        "the host's /etc/passwd changed"
    );
    for host in [format!("/etc/{planted}"), format!("/tmp/{planted}")] {
        assert!(!std::path::Path::new(&host).exists(), "{host} was created");
    }
    // A FIFO the kernel made: refused, never a download that hangs.
    v1.execute(&id, "import os\nos.mkfifo('pipe')").await?;
    let (status, body) = raw_request(
        &gateway,
        "GET",
        &format!("/v1/sessions/{id}/files/pipe"),
        b"",
    )
    .await?;
    assert!((400..500).contains(&status), "GET pipe: {status} {body}");
    let (status, listing) = v1.get(&format!("/v1/sessions/{id}/files")).await?;
    assert_eq!(
        status, 200,
        "listing with links in the workspace: {listing}"
    );

    // Oversize: 413, and nothing half-written is left behind.
    let status = v1.put_file(&id, "big.bin", vec![7u8; 6 << 20]).await?;
    assert_eq!(status, 413);
    let (_, listing) = v1
        .get(&format!(
            "/v1/sessions/{id}/files?recursive=true&hidden=true"
        ))
        .await?;
    assert!(
        !listing.as_array().unwrap().iter().any(|e| e["path"]
            .as_str()
            .unwrap_or_default()
            .contains("big.bin")
            || e["path"]
                .as_str()
                .unwrap_or_default()
                .contains(".cellgate-upload")),
        "{listing}"
    );
    // The session still works and smaller uploads still fit.
    assert_eq!(
        v1.put_file(&id, "small.bin", vec![1u8; 1 << 20]).await?,
        201
    );
    assert_eq!(
        v1.execute(&id, "import os\nos.path.getsize('small.bin')")
            .await?["result"],
        "1048576"
    );
    let (status, _) = v1.get(&format!("/v1/sessions/{id}/files/nope.txt")).await?;
    assert_eq!(status, 404);

    // Caches: the kernel lists and stats a directory, then a file appears there (and an
    // existing one changes) through the API; the kernel must see both at once.
    let r = v1.execute(&id,
        "import os\nos.makedirs('cache', exist_ok=True)\nopen('cache/old.txt', 'w').write('old')\n\
         (sorted(os.listdir('cache')), os.path.exists('cache/new.txt'), open('cache/old.txt').read())",
    )
    .await?;
    assert_eq!(r["result"], "(['old.txt'], False, 'old')", "{r}");
    assert_eq!(
        v1.put_file(&id, "cache/new.txt", b"new".to_vec()).await?,
        201
    );
    assert_eq!(
        v1.put_file(&id, "cache/old.txt", b"newer".to_vec()).await?,
        201
    );
    let r = v1.execute(&id,
        "(sorted(os.listdir('cache')), open('cache/new.txt').read(), open('cache/old.txt').read())",
    )
    .await?;
    assert_eq!(
        r["result"], "(['new.txt', 'old.txt'], 'new', 'newer')",
        "{r}"
    );
    // What the kernel just wrote (and rewrote) is what a download gets, at once.
    for round in 0..3 {
        let text = format!("round {round}");
        v1.execute(&id, &format!("open('cache/old.txt', 'w').write({text:?})"))
            .await?;
        let response = v1
            .request(
                reqwest::Method::GET,
                &format!("/v1/sessions/{id}/files/cache/old.txt"),
            )
            .send()
            .await?;
        assert_eq!(response.text().await?, text);
    }

    // The workspace's size limit holds for the kernel too (bounded: a broken limit fails
    // here instead of filling the host's disk).
    let r = v1.execute(&id,
        "import os\nn = 0\ntry:\n    with open('fill.bin', 'wb', buffering=0) as f:\n        while n < (64 << 20):\n            n += f.write(b'x' * (1 << 20))\nexcept OSError as e:\n    err = e.errno\nos.remove('fill.bin')\n(n <= (4 << 20), err == __import__('errno').ENOSPC)",
    )
    .await?;
    assert_eq!(r["result"], "(True, True)", "{r}");

    // Files written under outputs/ become artifacts.
    let r = v1.execute(&id,
        "os.makedirs('outputs', exist_ok=True)\nopen('outputs/report.csv', 'w').write('x,y\\n5,6\\n')",
    )
    .await?;
    let artifacts = r["artifacts"].as_array().context("artifacts")?;
    let report = artifacts
        .iter()
        .find(|a| a["path"] == "outputs/report.csv")
        .with_context(|| format!("outputs/report.csv is no artifact: {r}"))?;
    let body = v1
        .artifact(report["id"].as_str().context("id")?)
        .await?
        .text()
        .await?;
    assert_eq!(body, "x,y\n5,6\n");

    crate::workspace_ops::operations_on(&v1, &id, true).await
}

/// One-shot execute: a result from a fresh session that is gone afterwards (its kernel
/// too); artifacts stay fetchable; also as SSE.
#[tokio::test]
async fn one_shot_execute() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let (status, r) = v1.post("/v1/execute",
        json!({"code": "from IPython.display import display, Markdown\ndisplay(Markdown('**hi**'))\nprint(open('in.txt').read())\n7 * 6",
               "files": [{"path": "in.txt", "content": "aW5wdXQ=", "encoding": "base64"}]}),
    )
    .await?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["result"], "42");
    assert_eq!(r["stdout"], "input\n");
    let artifact = r["artifacts"][0]["id"].as_str().context("an artifact")?;
    let response = v1.artifact(artifact).await?;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.text().await?, "**hi**");
    let mut gone = false;
    let deadline = std::time::Instant::now() + PATIENCE;
    while std::time::Instant::now() < deadline {
        let (_, list) = v1.get("/v1/sessions").await?;
        if list.as_array().map(|l| l.is_empty()).unwrap_or(false) {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the one-shot session outlived its execution");
    let (_, kernels) = v1.get("/api/kernels").await?;
    assert_eq!(kernels, json!([]), "its kernel outlived it");

    let mut sse = v1
        .sse("/v1/execute", json!({"code": "print('streamed')"}))
        .await?;
    let mut names = vec![];
    loop {
        let (name, event) = sse.next().await?;
        names.push(name.clone());
        if name == "done" {
            assert_eq!(event["result"]["stdout"], "streamed\n");
            break;
        }
    }
    assert_eq!(
        names.first().map(String::as_str),
        Some("started"),
        "{names:?}"
    );
    Ok(())
}

/// `GET /v1/kernelspecs` lists every kernel a session may run with its language and the
/// default; a session of a chosen kernelspec says which it is and its language in every
/// model v1 answers (create, get, list, restart, the WebSocket's greeting), and really runs
/// that kernel.
#[tokio::test]
async fn kernelspecs_are_listed_and_sessions_carry_their_language() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);

    let anonymous = gateway
        .http
        .get(format!("{}/v1/kernelspecs", gateway.base))
        .send()
        .await?;
    assert_eq!(
        anonymous.status().as_u16(),
        401,
        "the list needs a credential"
    );

    let (status, listed) = v1.get("/v1/kernelspecs").await?;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["default"], "python3", "{listed}");
    let specs = listed["kernelspecs"].as_array().context("kernelspecs")?;
    let language_of = |name: &str| {
        specs
            .iter()
            .find(|s| s["name"] == name)
            .map(|s| s["language"].clone())
    };
    assert_eq!(language_of("python3"), Some(json!("python")), "{listed}");
    assert_eq!(language_of("deno"), Some(json!("typescript")), "{listed}");
    assert_eq!(language_of("bash"), Some(json!("bash")), "{listed}");
    assert_eq!(language_of("ir"), Some(json!("R")), "{listed}");
    let names: Vec<&str> = specs.iter().filter_map(|s| s["name"].as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(names, sorted, "listed by name");
    for spec in specs {
        assert!(
            spec["display_name"].as_str().is_some_and(|d| !d.is_empty()),
            "{spec}"
        );
        assert_eq!(
            spec.as_object().map(|o| o.len()),
            Some(3),
            "name, display_name and language only (no argv or host paths): {spec}"
        );
    }

    let deno = v1.new_session(json!({"kernel_name": "deno"})).await?;
    assert_eq!(deno.model.kernel_name, "deno", "{:?}", deno.model);
    assert_eq!(deno.model.language, "typescript", "{:?}", deno.model);
    // TypeScript that Python refuses: the session runs the kernel it names.
    const TYPED: &str = "const answer: number = 6 * 7;";
    let ran = v1.execute(&deno.id, TYPED).await?;
    assert_eq!(ran["status"], "ok", "the Deno kernel ran it: {ran}");
    // An awaited display: Deno sends it before the cell's idle. (A bare expression's value,
    // or console.log's output, sometimes comes after that idle, when the execution has
    // ended; so it is not what this test looks for.)
    let shown = v1
        .execute(
            &deno.id,
            "await Deno.jupyter.display(Deno.jupyter.html`<b>${answer}</b>`);",
        )
        .await?;
    assert_eq!(shown["artifacts"][0]["mime"], "text/html", "{shown}");
    let (_, got) = v1.get(&format!("/v1/sessions/{}", deno.id)).await?;
    assert_eq!(
        (got["kernel_name"].clone(), got["language"].clone()),
        (json!("deno"), json!("typescript")),
        "{got}"
    );
    let (status, restarted) = v1
        .post(&format!("/v1/sessions/{}/restart", deno.id), json!({}))
        .await?;
    assert_eq!(status, 200, "{restarted}");
    assert_eq!(restarted["language"], "typescript", "{restarted}");
    let mut socket = v1.ws(&deno.id).await?;
    let hello = ws_next(&mut socket).await?;
    assert_eq!(hello["type"], "session", "{hello}");
    assert_eq!(hello["session"]["language"], "typescript", "{hello}");

    let python = v1.new_session(json!({})).await?;
    assert_eq!(python.model.kernel_name, "python3", "{:?}", python.model);
    assert_eq!(python.model.language, "python", "{:?}", python.model);
    let refused = v1.execute(&python.id, TYPED).await?;
    assert_eq!(
        refused["status"], "error",
        "Python is no TypeScript: {refused}"
    );
    let (_, all) = v1.get("/v1/sessions").await?;
    let languages: std::collections::BTreeMap<String, String> = all
        .as_array()
        .context("sessions")?
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap_or_default().to_owned(),
                s["language"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        languages.get(&deno.id).map(String::as_str),
        Some("typescript"),
        "{all}"
    );
    assert_eq!(
        languages.get(&python.id).map(String::as_str),
        Some("python"),
        "{all}"
    );

    let (status, refused) = v1
        .post("/v1/sessions", json!({"kernel_name": "cobol"}))
        .await?;
    assert_eq!(status, 404, "an unknown kernelspec: {refused}");
    Ok(())
}

/// The OpenAPI document is served and describes every route of API v1 and the result and
/// event schemas.
#[tokio::test]
async fn openapi_document_lists_every_route() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let (status, doc) = V1Client::new(&gateway).get("/v1/openapi.json").await?;
    assert_eq!(status, 200);
    assert!(
        doc["openapi"]
            .as_str()
            .unwrap_or_default()
            .starts_with("3."),
        "{doc}"
    );
    let paths = doc["paths"].as_object().context("paths")?;
    for (path, method) in [
        ("/v1/sessions", "post"),
        ("/v1/sessions", "get"),
        ("/v1/kernelspecs", "get"),
        ("/v1/sessions/{id}", "get"),
        ("/v1/sessions/{id}", "delete"),
        ("/v1/sessions/{id}/execute", "post"),
        ("/v1/execute", "post"),
        ("/v1/sessions/{id}/interrupt", "post"),
        ("/v1/sessions/{id}/restart", "post"),
        ("/v1/sessions/{id}/input", "post"),
        ("/v1/sessions/{id}/files", "get"),
        ("/v1/sessions/{id}/files/{path}", "put"),
        ("/v1/sessions/{id}/files/{path}", "get"),
        ("/v1/sessions/{id}/files/{path}", "head"),
        ("/v1/sessions/{id}/files/{path}", "post"),
        ("/v1/sessions/{id}/files/{path}", "delete"),
        ("/v1/sessions/{id}/commands", "post"),
        ("/v1/sessions/{id}/artifacts", "get"),
        ("/v1/artifacts/{id}", "get"),
        ("/v1/sessions/{id}/ws", "get"),
        ("/v1/sessions/{id}/notebook", "get"),
        ("/v1/notebooks/replay", "post"),
    ] {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} missing from the OpenAPI document"
        );
    }
    let schemas = doc["components"]["schemas"]
        .as_object()
        .context("schemas")?;
    for schema in [
        "ExecutionResult",
        "SessionEvent",
        "ArtifactRef",
        "CommandResult",
        "CommandEvent",
        "FileOperation",
        "Kernelspecs",
        "SessionModel",
    ] {
        assert!(schemas.contains_key(schema), "{schema} missing");
    }
    // Session models carry the kernel's language.
    assert!(
        doc["paths"]["/v1/sessions"]["post"]["responses"]["201"]
            .to_string()
            .contains("#/components/schemas/SessionModel"),
        "{}",
        doc["paths"]["/v1/sessions"]["post"]
    );
    assert!(
        schemas["SessionModel"].to_string().contains("\"language\""),
        "{}",
        schemas["SessionModel"]
    );
    // The MCP tool the document names is one the gateway has (`/v1/docs` renders it).
    let text = doc.to_string();
    assert!(
        !text.contains("execute_python") && text.contains("`run_python`"),
        "the one-shot execute's description names no real MCP tool"
    );
    Ok(())
}

/// Hostile code shaping `outputs/`: links to host files (a file link and `outputs` itself
/// as a link), a FIFO that would block a reader, and artifact ids that look like paths. None
/// of it leaks a host file, hangs the execution, or harms the session.
#[tokio::test]
async fn hostile_outputs_never_leak_or_hang() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1
        .execute(
            &id,
            "import os\nos.makedirs('outputs/sub', exist_ok=True)\n\
         os.symlink('/etc/passwd', 'outputs/passwd.txt')\n\
         os.symlink('/etc', 'outputs/etc')\n\
         os.mkfifo('outputs/pipe.txt')\n\
         open('outputs/sub/real.txt', 'w').write('real')\n'ok'",
        )
        .await?;
    assert_eq!(r["status"], "ok", "{r}");
    let artifacts = r["artifacts"].as_array().context("artifacts")?;
    assert_eq!(artifacts.len(), 1, "only the regular file: {artifacts:?}");
    assert_eq!(artifacts[0]["path"], "outputs/sub/real.txt");
    let body = v1
        .artifact(artifacts[0]["id"].as_str().unwrap())
        .await?
        .text()
        .await?;
    assert_eq!(body, "real");

    // outputs itself replaced by a link to a host directory full of files.
    let r = v1
        .execute(
            &id,
            "import os, shutil\nshutil.rmtree('outputs')\nos.symlink('/etc', 'outputs')\n'swapped'",
        )
        .await?;
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["artifacts"], json!([]), "{r}");
    let (_, listed) = v1.get(&format!("/v1/sessions/{id}/artifacts")).await?;
    for artifact in listed.as_array().context("listed")? {
        let body = v1
            .artifact(artifact["id"].as_str().unwrap())
            .await?
            .text()
            .await?;
        assert!(!body.contains("root:"), "{artifact} leaked a host file");
    }

    // Artifact ids that look like paths: 404, never a file.
    for id in [
        "..%2f..%2f..%2fetc%2fpasswd",
        "%2e%2e",
        "%2fetc%2fpasswd",
        "x%00",
    ] {
        let (status, body) =
            raw_request(&gateway, "GET", &format!("/v1/artifacts/{id}"), b"").await?;
        assert!((400..500).contains(&status), "{id}: {status}");
        assert!(!body.contains("root:"), "{id}: {body}");
    }
    assert_eq!(v1.execute(&id, "1 + 1").await?["result"], "2");
    Ok(())
}

/// Interrupt over HTTP stops a running cell (KeyboardInterrupt, variables kept); a deleted
/// session's artifacts stay fetchable for the retention period while the session is gone.
#[tokio::test]
async fn http_interrupt_and_artifacts_outlive_their_session() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1
        .execute(
            &id,
            "kept = 5\nfrom IPython.display import display, SVG\n\
         display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"10\" height=\"20\"/>'))",
        )
        .await?;
    let artifact = r["artifacts"][0]["id"]
        .as_str()
        .context("an artifact")?
        .to_owned();

    let mut sse = v1
        .sse(
            &format!("/v1/sessions/{id}/execute"),
            json!({"code": "import time\nprint('sleeping', flush=True)\ntime.sleep(60)"}),
        )
        .await?;
    loop {
        let (name, event) = sse.next().await?;
        assert_ne!(name, "done", "{event}");
        if name == "stream" && event["text"] == "sleeping\n" {
            break;
        }
    }
    let (status, body) = v1
        .post(&format!("/v1/sessions/{id}/interrupt"), json!({}))
        .await?;
    assert_eq!(status, 204, "{body}");
    let result = loop {
        let (name, event) = sse.next().await?;
        if name == "done" {
            break event["result"].clone();
        }
    };
    assert_eq!(result["status"], "error", "{result}");
    assert_eq!(result["error"]["ename"], "KeyboardInterrupt", "{result}");
    assert_eq!(v1.execute(&id, "kept").await?["result"], "5");

    let status = v1
        .request(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"))
        .send()
        .await?
        .status()
        .as_u16();
    assert_eq!(status, 204);
    assert_eq!(
        v1.get(&format!("/v1/sessions/{id}/artifacts")).await?.0,
        404
    );
    let response = v1.artifact(&artifact).await?;
    assert_eq!(response.status().as_u16(), 200);
    assert!(response.text().await?.contains("height=\"20\""));
    Ok(())
}

/// Executions sent at once to one session are queued, and each result holds only its own
/// output; a busy session never holds up another one.
#[tokio::test]
async fn concurrent_executes_keep_their_own_output() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let other = v1.create_session(json!({})).await?;

    let runs = (0..4).map(|i| {
        let v1 = &v1;
        let id = id.clone();
        async move {
            let code = format!(
                "import time\nfor j in range(5):\n    print('run{i}', j, flush=True)\n    time.sleep(0.01)\nrun{i} = {i}\n{i} * 100"
            );
            (i, v1.execute(&id, &code).await)
        }
    });
    let results = futures_util::future::join_all(runs).await;
    let mut counts = vec![];
    for (i, result) in results {
        let r = result?;
        assert_eq!(r["status"], "ok", "{r}");
        let want: String = (0..5).map(|j| format!("run{i} {j}\n")).collect();
        assert_eq!(
            r["stdout"],
            want.as_str(),
            "run {i} got another's output: {r}"
        );
        assert_eq!(r["result"], (i * 100).to_string());
        counts.push(r["execution_count"].as_i64().context("count")?);
    }
    counts.sort();
    counts.dedup();
    assert_eq!(
        counts.len(),
        4,
        "each execution has its own count: {counts:?}"
    );

    // Session `id` busy (waiting for the test), `other` still answers.
    let mut sse = v1.sse(&format!("/v1/sessions/{id}/execute"),
        json!({"code": format!("print('busy', flush=True)\n{}'released'", wait_for_file("release"))}),
    )
    .await?;
    loop {
        let (name, event) = sse.next().await?;
        assert_ne!(name, "done", "{event}");
        if name == "stream" {
            break;
        }
    }
    let r = v1.execute(&other, "'other answers'").await?;
    assert_eq!(r["result"], "'other answers'");
    let (status, model) = v1.get(&format!("/v1/sessions/{id}")).await?;
    assert_eq!(status, 200);
    assert_eq!(model["state"], "busy", "{model}");
    assert_eq!(v1.put_file(&id, "release", vec![]).await?, 201);
    loop {
        let (name, event) = sse.next().await?;
        if name == "done" {
            assert_eq!(event["result"]["result"], "'released'", "{event}");
            break;
        }
    }
    Ok(())
}

/// Bad requests around files lose nothing: initial files with a bad path or encoding refuse
/// the session (no kernel left behind), also for the one-shot execute; an oversize upload
/// without a Content-Length (chunked, as a streaming client sends it) is cut off with 413.
#[tokio::test]
async fn bad_file_requests_leave_nothing_behind() -> Result<()> {
    let (gateway, _policies) = start_gateway("workspace = \"2MiB\"\n").await?;
    let v1 = V1Client::new(&gateway);
    for files in [
        json!([{"path": "../escape.txt", "content": "x"}]),
        json!([{"path": "/etc/cellgate-escape", "content": "x"}]),
        json!([{"path": "ok.txt", "content": "%%%", "encoding": "base64"}]),
        json!([{"path": "ok.txt", "content": "x", "encoding": "rot13"}]),
    ] {
        let (status, body) = v1.post("/v1/sessions", json!({ "files": files })).await?;
        assert_eq!(status, 400, "{files}: {body}");
        let (status, body) = v1
            .post("/v1/execute", json!({"code": "1", "files": files}))
            .await?;
        assert_eq!(status, 400, "{files}: {body}");
    }
    assert!(!std::path::Path::new("/etc/cellgate-escape").exists());
    let (_, sessions) = v1.get("/v1/sessions").await?;
    assert_eq!(sessions, json!([]), "a refused session was kept");
    let (_, kernels) = v1.get("/api/kernels").await?;
    assert_eq!(kernels, json!([]), "a refused session's kernel was kept");

    let id = v1.create_session(json!({})).await?;
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", gateway.port)).await?;
    let head = format!(
        "PUT /v1/sessions/{id}/files/stream.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Authorization: token {}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        gateway.token.clone().unwrap_or_default()
    );
    stream.write_all(head.as_bytes()).await?;
    let chunk = vec![b'z'; 64 << 10];
    // Up to 8 MiB; the gateway may stop reading (and answer) long before.
    for _ in 0..128 {
        let mut frame = format!("{:x}\r\n", chunk.len()).into_bytes();
        frame.extend_from_slice(&chunk);
        frame.extend_from_slice(b"\r\n");
        if stream.write_all(&frame).await.is_err() {
            break;
        }
    }
    let _ = stream.write_all(b"0\r\n\r\n").await;
    let mut response = Vec::new();
    let _ = tokio::time::timeout(WAIT, stream.read_to_end(&mut response)).await?;
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    let (_, listing) = v1
        .get(&format!(
            "/v1/sessions/{id}/files?recursive=true&hidden=true"
        ))
        .await?;
    // The workspace is the kernel's home (.ipython and such): only the upload matters.
    assert!(
        !listing.as_array().context("listing")?.iter().any(|e| {
            let path = e["path"].as_str().unwrap_or_default();
            path.contains("stream.bin") || path.contains(".cellgate-upload")
        }),
        "a partial upload was left: {listing}"
    );
    assert_eq!(v1.put_file(&id, "fits.bin", vec![0u8; 1 << 20]).await?, 201);

    // A client that goes away halfway through replacing a file: the old file stays, and
    // no part of the new one is left (the body never completed).
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", gateway.port)).await?;
    let head = format!(
        "PUT /v1/sessions/{id}/files/fits.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Authorization: token {}\r\nContent-Length: {}\r\n\r\n",
        gateway.token.clone().unwrap_or_default(),
        1 << 20
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(&[b'y'; 300 << 10]).await?;
    stream.flush().await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(stream);
    let mut kept = None;
    let deadline = std::time::Instant::now() + PATIENCE;
    while std::time::Instant::now() < deadline {
        let (_, listing) = v1
            .get(&format!(
                "/v1/sessions/{id}/files?recursive=true&hidden=true"
            ))
            .await?;
        let entries = listing.as_array().context("listing")?.clone();
        if !entries.iter().any(|e| {
            e["path"]
                .as_str()
                .unwrap_or_default()
                .contains(".cellgate-upload")
        }) {
            kept = entries.into_iter().find(|e| e["path"] == "fits.bin");
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kept = kept.context("fits.bin is gone, or a partial upload stayed")?;
    assert_eq!(kept["size"], 1 << 20, "the old file was replaced: {kept}");
    let (status, body) = v1.get(&format!("/v1/sessions/{id}/files/fits.bin")).await?;
    assert_eq!(status, 200);
    assert!(!body.to_string().contains('y'), "the old content stays");
    Ok(())
}

/// What a chat user actually does: a DataFrame as the last expression (text in `result`, the
/// HTML table as an artifact) and a matplotlib chart through the inline backend (a PNG
/// artifact with its size), no `display` calls by hand.
#[tokio::test]
async fn dataframes_and_matplotlib_charts_arrive_as_artifacts() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1.execute(&id,
        "import pandas as pd\ndf = pd.DataFrame({'city': ['Oslo', 'Lima'], 'temp': [3.5, 19.0]})\ndf",
    )
    .await?;
    assert_eq!(r["status"], "ok", "{r}");
    let text = r["result"].as_str().context("text/plain result")?;
    assert!(text.contains("Oslo") && text.contains("19.0"), "{text}");
    let html = r["artifacts"]
        .as_array()
        .context("artifacts")?
        .iter()
        .find(|a| a["mime"] == "text/html")
        .with_context(|| format!("no HTML table: {r}"))?;
    let body = v1
        .artifact(html["id"].as_str().unwrap())
        .await?
        .text()
        .await?;
    assert!(body.contains("<table") && body.contains("Lima"), "{body}");

    let r = v1.execute(&id,
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nfig = plt.figure(figsize=(3, 2), dpi=100)\nplt.plot([1, 3, 2])\nplt.show()",
    )
    .await?;
    assert_eq!(r["status"], "ok", "{r}");
    let png = r["artifacts"]
        .as_array()
        .context("artifacts")?
        .iter()
        .find(|a| a["mime"] == "image/png")
        .with_context(|| format!("no chart: {r}"))?;
    assert!(png["width"].as_u64().unwrap_or(0) > 100, "{png}");
    assert!(png["height"].as_u64().unwrap_or(0) > 50, "{png}");
    let bytes = v1
        .artifact(png["id"].as_str().unwrap())
        .await?
        .bytes()
        .await?;
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    Ok(())
}

/// SSE and the session WebSocket carry the same events, in the kernel's order: output
/// interleaved with displays exactly as produced.
#[tokio::test]
async fn sse_and_websocket_carry_the_same_ordered_events() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let mut socket = v1.ws(&id).await?;
    assert_eq!(ws_next(&mut socket).await?["type"], "session");
    let code = "from IPython.display import display, Markdown\nimport sys\n\
                print('a', flush=True)\ndisplay(Markdown('*m1*'))\n\
                print('b', flush=True)\nprint('e', file=sys.stderr, flush=True)\n\
                display(Markdown('*m2*'))\nprint('c', flush=True)\n'end'";
    let mut sse = v1
        .sse(
            &format!("/v1/sessions/{id}/execute"),
            json!({ "code": code }),
        )
        .await?;
    let mut from_sse = vec![];
    loop {
        let (name, event) = sse.next().await?;
        from_sse.push(event);
        if name == "done" {
            break;
        }
    }
    let from_ws = ws_until_done(&mut socket).await?;
    assert_eq!(from_sse, from_ws, "SSE and WebSocket differ");
    let shape: Vec<String> = from_sse
        .iter()
        .map(|e| match e["type"].as_str().unwrap_or_default() {
            "stream" => format!(
                "{}:{}",
                e["name"].as_str().unwrap(),
                e["text"].as_str().unwrap().trim()
            ),
            "display" => format!("display:{}", e["text"].as_str().unwrap_or_default()),
            other => other.to_owned(),
        })
        .collect();
    let stdout_and_displays: Vec<&String> = shape
        .iter()
        .filter(|s| s.starts_with("stdout:") || s.starts_with("display:"))
        .collect();
    assert_eq!(
        stdout_and_displays,
        [
            "stdout:a",
            "display:<IPython.core.display.Markdown object>",
            "stdout:b",
            "display:<IPython.core.display.Markdown object>",
            "stdout:c"
        ],
        "{shape:?}"
    );
    assert_eq!(shape.first().map(String::as_str), Some("started"));
    assert_eq!(&shape[shape.len() - 2..], ["result", "done"], "{shape:?}");
    assert!(shape.contains(&"stderr:e".to_owned()), "{shape:?}");
    Ok(())
}

/// Two sessions share nothing: files, artifacts and variables of one never show in the other.
#[tokio::test]
async fn sessions_are_separate() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let a = v1.create_session(json!({})).await?;
    let b = v1.create_session(json!({})).await?;
    assert_eq!(v1.put_file(&a, "only-a.txt", b"a".to_vec()).await?, 201);
    let r = v1.execute(&a,
        "secret = 'a'\nfrom IPython.display import display, Markdown\ndisplay(Markdown('only a'))",
    )
    .await?;
    let artifact_a = r["artifacts"][0]["id"].clone();
    assert!(artifact_a.is_string(), "{r}");

    let r = v1
        .execute(
            &b,
            "import os\n('secret' in dir(), os.path.exists('only-a.txt'))",
        )
        .await?;
    assert_eq!(r["result"], "(False, False)", "{r}");
    let (_, files) = v1.get(&format!("/v1/sessions/{b}/files")).await?;
    assert!(
        !files.to_string().contains("only-a.txt"),
        "b lists a's file: {files}"
    );
    let (status, _) = v1
        .get(&format!("/v1/sessions/{b}/files/only-a.txt"))
        .await?;
    assert_eq!(status, 404);
    let (_, artifacts) = v1.get(&format!("/v1/sessions/{b}/artifacts")).await?;
    assert_eq!(artifacts, json!([]), "b lists a's artifacts");
    let (_, artifacts) = v1.get(&format!("/v1/sessions/{a}/artifacts")).await?;
    assert_eq!(artifacts[0]["id"], artifact_a);
    Ok(())
}

/// Large base64 outputs are referenced at once and stored in the background: a fetch the
/// moment the result arrives gets exactly the displayed bytes (it waits for the store), the
/// reference's size and dimensions are exact, line-wrapped base64 still works, one over the
/// policy's `artifact_size` is omitted with the reason, and one whose tail is not base64 is
/// referenced but answers 404 (nothing half-stored is ever served).
#[tokio::test]
async fn large_outputs_are_stored_off_the_result_path() -> Result<()> {
    let (gateway, _policies) =
        start_gateway("artifact_size = \"2100KiB\"\noutput_per_execution = \"64MiB\"\n").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let code = r#"
import base64, hashlib, json, os, struct, zlib
from IPython.display import display

def png(width, height, size):
    ihdr = struct.pack('>IIBBBBB', width, height, 8, 6, 0, 0, 0)
    chunk = struct.pack('>I', 13) + b'IHDR' + ihdr + struct.pack('>I', zlib.crc32(b'IHDR' + ihdr))
    body = b'\x89PNG\r\n\x1a\n' + chunk
    return body + os.urandom(size - len(body))

digests = {}
for name, (w, h, size, wrap) in {
    'padded1': (1234, 567, 2 << 20, False),
    'padded2': (10, 20, 1 << 20, False),
    'unpadded': (11, 22, 3 << 18, False),
    'wrapped': (30, 40, 300_000, True),
    'too_large': (50, 60, 2_200_000, False),
}.items():
    raw = png(w, h, size)
    text = (base64.encodebytes if wrap else base64.b64encode)(raw).decode()
    digests[name] = [hashlib.sha256(raw).hexdigest(), len(raw)]
    display({'image/png': text, 'text/plain': name}, raw=True)
broken = base64.b64encode(png(7, 8, 600_000)).decode()
display({'image/png': broken[:-8] + '!!!!!!!!', 'text/plain': 'broken'}, raw=True)
print(json.dumps(digests))
"#;
    let r = v1.execute(&id, code).await?;
    assert_eq!(r["status"], "ok", "{r}");
    let digests: Value = serde_json::from_str(r["stdout"].as_str().unwrap().trim())?;
    let artifacts = r["artifacts"].as_array().context("artifacts")?.clone();
    let by_summary = |name: &str| {
        artifacts
            .iter()
            .find(|a| a["summary"].as_str().unwrap_or_default().contains(name))
            .cloned()
    };
    for (name, size) in [
        ("padded1", (1234, 567)),
        ("padded2", (10, 20)),
        ("unpadded", (11, 22)),
        ("wrapped", (30, 40)),
    ] {
        let artifact = by_summary(name).with_context(|| format!("{name}: {artifacts:?}"))?;
        let (digest, bytes) = (&digests[name][0], &digests[name][1]);
        assert_eq!(&artifact["bytes"], bytes, "{name}: {artifact}");
        assert_eq!(
            (artifact["width"].as_u64(), artifact["height"].as_u64()),
            (Some(size.0), Some(size.1)),
            "{name}: {artifact}"
        );
        let response = v1.artifact(artifact["id"].as_str().unwrap()).await?;
        assert_eq!(response.status().as_u16(), 200, "{name}");
        let length = response.headers()["content-length"].to_str()?.to_owned();
        assert_eq!(length, bytes.to_string(), "{name}");
        let body = response.bytes().await?;
        assert_eq!(&sha256_hex(&body), digest, "{name}: served bytes differ");
    }
    assert!(by_summary("too_large").is_none(), "{artifacts:?}");
    let omitted = r["omitted"].as_array().context("omitted")?;
    assert!(
        omitted.iter().any(|o| o["bytes"] == digests["too_large"][1]
            && o["reason"]
                .as_str()
                .unwrap_or_default()
                .contains("artifact_size")),
        "{omitted:?}"
    );
    let broken = by_summary("broken").context("the broken output is referenced")?;
    let response = v1.artifact(broken["id"].as_str().unwrap()).await?;
    assert_eq!(
        response.status().as_u16(),
        404,
        "a broken output is never served"
    );
    // The session goes on.
    let r = v1.execute(&id, "1+1").await?;
    assert_eq!(r["result"], "2", "{r}");
    Ok(())
}

/// Output for machines: a figure made under the `Agg` backend and "shown" (what generated
/// code very often does, and what used to show nothing) arrives as one PNG artifact, and a
/// figure a cell leaves open is shown once; API v1's streams carry no ANSI escapes (also
/// ones a chunk boundary cuts) and progress frames collapse to their last state, while
/// Kernel Gateway's surface stays byte-exact.
#[tokio::test]
async fn figures_and_streams_come_out_clean_for_machines() -> Result<()> {
    let (gateway, _policies) = start_gateway("").await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let pngs = |r: &Value| {
        r["artifacts"]
            .as_array()
            .map(|a| a.iter().filter(|a| a["mime"] == "image/png").count())
            .unwrap_or(0)
    };
    let r = v1
        .execute(
            &id,
            "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n\
             plt.plot([1, 2, 3])\nplt.show()",
        )
        .await?;
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(pngs(&r), 1, "{r}");
    assert!(
        !r["stderr"]
            .as_str()
            .unwrap_or_default()
            .contains("non-interactive"),
        "{r}"
    );
    let png = r["artifacts"][0]["id"].as_str().context("id")?.to_owned();
    let bytes = v1.artifact(&png).await?.bytes().await?;
    assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
    let r = v1
        .execute(
            &id,
            "fig, ax = plt.subplots()\nax.bar([1], [2])\nfig.savefig('chart.png')",
        )
        .await?;
    assert_eq!(pngs(&r), 1, "a figure left open is shown: {r}");
    let r = v1.execute(&id, "1 + 1").await?;
    assert_eq!(r["artifacts"], json!([]), "a figure is shown once: {r}");

    let code = "import sys\nprint('\\x1b[31mred\\x1b[0m plain')\n\
        for i in range(5):\n    print(f'\\r{i * 25}%', end='', flush=True)\nprint()\n\
        print('\\x1b[1', end='', flush=True)\nprint(';32mgreen\\x1b[0m', flush=True)\n\
        print('\\x1b]0;a title\\x07warn', file=sys.stderr)";
    let mut sse = v1
        .sse(&format!("/v1/sessions/{id}/execute"), json!({"code": code}))
        .await?;
    let mut streamed = String::new();
    let result = loop {
        let (kind, event) = sse.next().await?;
        if kind == "stream" {
            streamed.push_str(event["text"].as_str().unwrap_or_default());
        }
        if kind == "done" {
            break event["result"].clone();
        }
    };
    assert_eq!(result["stdout"], "red plain\n100%\ngreen\n", "{result}");
    assert_eq!(result["stderr"], "warn\n", "{result}");
    assert!(!streamed.contains('\u{1b}'), "{streamed:?}");
    // A line that ends with a return (`end="\r"`) keeps its last text.
    let r = v1
        .execute(
            &id,
            "print('step 1', end='\\r', flush=True)\nprint('Done: 42', end='\\r', flush=True)",
        )
        .await?;
    assert_eq!(r["stdout"], "Done: 42", "{r}");
    assert!(
        streamed.contains("100%") && streamed.contains("green"),
        "{streamed:?}"
    );

    // The listing: the top level without dot names unless asked, RFC 3339 times.
    let (_, top) = v1.get(&format!("/v1/sessions/{id}/files")).await?;
    let names: Vec<&str> = top
        .as_array()
        .context("listing")?
        .iter()
        .filter_map(|e| e["path"].as_str())
        .collect();
    assert!(names.contains(&"chart.png"), "{top}");
    assert!(
        names
            .iter()
            .all(|n| !n.starts_with('.') && !n.contains('/')),
        "{top}"
    );
    let mtime = top[0]["mtime"].as_str().context("mtime")?;
    assert!(
        regex::Regex::new(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")?.is_match(mtime),
        "{mtime}"
    );
    let (_, all) = v1
        .get(&format!(
            "/v1/sessions/{id}/files?recursive=true&hidden=true"
        ))
        .await?;
    assert!(
        all.as_array().context("listing")?.iter().any(|e| e["path"]
            .as_str()
            .is_some_and(|p| p.starts_with('.') && p.contains('/'))),
        "{all}"
    );
    let (status, body) = v1
        .get(&format!("/v1/sessions/{id}/files?recursive=maybe"))
        .await?;
    assert_eq!(status, 400, "{body}");

    // Kernel Gateway's surface: the kernel's bytes, escapes and all.
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "raw", false).await?;
    let msg_id = client.execute("print('\\x1b[31mred\\x1b[0m')").await?;
    let msgs = client.collect(&msg_id, Duration::from_secs(30)).await?;
    assert_eq!(crate::support::stdout(&msgs), "\u{1b}[31mred\u{1b}[0m\n");
    Ok(())
}
