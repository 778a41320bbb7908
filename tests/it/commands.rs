//! Shell commands in a session's sandbox (`POST /v1/sessions/{id}/commands`, issue 32 item 3),
//! against a real gateway and real kernels in the test sandbox: exit codes, both streams,
//! the working directory and variables, the timeout that kills the command's whole process
//! group, progressive SSE (proven without clocks: the command waits for a file the test
//! uploads only once it has seen the command's first line), the kernel's state left alone,
//! the sandbox's walls around the command, per-session environment variables under the
//! policy's `[environment]`, and clear refusals of bad requests.

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::Gateway;

/// A gateway whose default policy runs the test sandbox with these `[environment]` and
/// `[limits]` lines, and these extra arguments.
async fn gateway(
    environment: &str,
    limits: &str,
    args: &[&str],
) -> Result<(Gateway, tempfile::TempDir)> {
    Gateway::with_default_policy(
        &format!("[environment]\n{environment}\n[limits]\n{limits}\n"),
        args,
    )
    .await
}

async fn run(v1: &V1Client<'_>, id: &str, body: Value) -> Result<Value> {
    let (status, result) = v1
        .post(&format!("/v1/sessions/{id}/commands"), body)
        .await?;
    anyhow::ensure!(status == 200, "command: {status} {result}");
    Ok(result)
}

#[tokio::test]
async fn commands_run_in_the_sessions_sandbox() -> Result<()> {
    let (gateway, _policies) = gateway("", "output_per_execution = \"256KiB\"", &[]).await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let r = v1
        .execute(
            &id,
            "import os\nkept = 41\n(os.getuid(), os.uname().nodename)",
        )
        .await?;
    let kernel_identity = r["result"].as_str().context("identity")?.to_owned();
    let count_before = r["execution_count"].clone();

    // Exit code, both streams, status.
    let r = run(
        &v1,
        &id,
        json!({"cmd": "echo out; echo err >&2; printf 'é\\n'; exit 3"}),
    )
    .await?;
    assert_eq!(
        (
            r["status"].as_str(),
            r["exit_code"].as_i64(),
            r["stdout"].as_str(),
            r["stderr"].as_str()
        ),
        (Some("error"), Some(3), Some("out\né\n"), Some("err\n")),
        "{r}"
    );
    assert!(r["signal"].is_null() && r["command_id"].is_string(), "{r}");

    // The same user and host as the kernel, in the workspace or a directory below it, with
    // the request's variables.
    assert_eq!(
        v1.put_file(&id, "data/in.csv", b"a\n1\n".to_vec()).await?,
        201
    );
    let r = run(
        &v1,
        &id,
        json!({"cmd": "python3 -c 'import os; print((os.getuid(), os.uname().nodename))'; pwd; ls; echo \"$GREETING\"",
               "cwd": "data", "env": {"GREETING": "hi there"}}),
    )
    .await?;
    assert_eq!(r["status"], "ok", "{r}");
    let lines: Vec<&str> = r["stdout"].as_str().unwrap_or_default().lines().collect();
    assert_eq!(lines.len(), 4, "{r}");
    assert_eq!(
        lines[0], kernel_identity,
        "the command runs as the kernel does"
    );
    assert!(lines[1].ends_with("/data"), "{r}");
    assert_eq!(&lines[2..], ["in.csv", "hi there"], "{r}");

    // The kernel's variables and execution count are untouched.
    let r = v1.execute(&id, "kept + 1").await?;
    assert_eq!(r["result"], "42", "{r}");
    assert_eq!(
        r["execution_count"].as_i64(),
        count_before.as_i64().map(|c| c + 1),
        "a command took an execution count: {r}"
    );

    // The timeout kills the whole process group; the session goes on.
    let r = run(
        &v1,
        &id,
        json!({"cmd": "sleep 300 & echo started; sleep 300", "timeout_s": 1}),
    )
    .await?;
    assert_eq!(
        (
            r["status"].as_str(),
            r["signal"].as_str(),
            r["stdout"].as_str()
        ),
        (Some("timeout"), Some("SIGKILL"), Some("started\n")),
        "{r}"
    );
    let r = run(
        &v1,
        &id,
        // Live ones only: a killed process is a zombie until its new parent (the sandbox's
        // init) reaps it, which the test does not wait for (reaping is proven by
        // `lifecycle::orphans_are_reaped_in_every_sandbox`).
        json!({"cmd": "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = sleep ] && ! grep -q '^State:[[:space:]]*Z' $p/status 2>/dev/null && echo x; done | wc -l"}),
    )
    .await?;
    assert_eq!(
        r["stdout"], "0\n",
        "the timed-out command's processes live on: {r}"
    );

    // A process left in the background by a command that exited does not hold its result.
    let r = run(
        &v1,
        &id,
        json!({"cmd": "sleep 120 >/dev/null 2>&1 & echo bg"}),
    )
    .await?;
    assert_eq!(
        (r["status"].as_str(), r["stdout"].as_str()),
        (Some("ok"), Some("bg\n")),
        "{r}"
    );

    // A background process that keeps writing keeps running after the command's result
    // (its output is read and dropped, never a broken pipe).
    let r = run(
        &v1,
        &id,
        json!({"cmd": "sh -c 'while :; do echo tick; sleep 0.1; done' & echo started"}),
    )
    .await?;
    assert_eq!(r["status"], "ok", "{r}");
    // The writer may print first: the two run at once.
    assert!(
        r["stdout"]
            .as_str()
            .is_some_and(|s| s.lines().any(|l| l == "started")),
        "{r}"
    );
    let alive = "sleep 2; for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q 'whil[e] :' && ! grep -q '^State:[[:space:]]*Z' $p/status && echo alive; done | sort -u";
    let r = run(&v1, &id, json!({ "cmd": alive })).await?;
    assert_eq!(r["stdout"], "alive\n", "the background writer died: {r}");
    // A command that closes its output runs to its end, not to a kill.
    let r = run(
        &v1,
        &id,
        json!({"cmd": "exec >/dev/null 2>&1; sleep 1; exit 5"}),
    )
    .await?;
    assert_eq!(
        (r["exit_code"].as_i64(), r["signal"].as_str()),
        (Some(5), None),
        "{r}"
    );
    // Past the policy's output limit the exit still comes back.
    let r = run(
        &v1,
        &id,
        json!({"cmd": "head -c 600000 /dev/zero | tr '\\0' x; echo; exit 0"}),
    )
    .await?;
    assert_eq!(
        (
            r["status"].as_str(),
            r["exit_code"].as_i64(),
            r["output_truncated"].as_bool()
        ),
        (Some("ok"), Some(0), Some(true)),
        "{r}"
    );
    // Any character reaches the shell as written: line separators IPython would split a
    // cell at, prompts it would strip.
    let odd = "a\u{2028}>>> b\u{85}In [1]: c\u{2029}!d";
    let r = run(&v1, &id, json!({ "cmd": format!("printf '%s' '{odd}'") })).await?;
    assert_eq!(r["stdout"], odd, "{r}");

    // A directory that is not there: the command never ran, and says why.
    let r = run(&v1, &id, json!({"cmd": "true", "cwd": "missing"})).await?;
    assert_eq!(r["status"], "error", "{r}");
    assert!(
        r["error"]
            .as_str()
            .is_some_and(|e| e.contains("FileNotFoundError")),
        "{r}"
    );

    // The sandbox's walls hold for commands: no network, the host's files unseen.
    let r = run(
        &v1,
        &id,
        json!({"cmd": "python3 -c \"import socket; socket.create_connection(('192.0.2.1', 80), timeout=3)\""}),
    )
    .await?;
    assert_eq!(r["status"], "error", "a command reached the network: {r}");
    let stderr = r["stderr"].as_str().unwrap_or_default();
    assert!(
        // ENETUNREACH (namespaces: loopback only), EHOSTUNREACH (gVisor's --network=none).
        ["Network is unreachable", "No route to host", "timed out"]
            .iter()
            .any(|why| stderr.contains(why)),
        "refused for another reason: {r}"
    );
    let marker = format!("/tmp/cellgate-host-only-{}", std::process::id());
    std::fs::write(&marker, "host")?;
    let r = run(&v1, &id, json!({"cmd": format!("cat {marker}")})).await?;
    std::fs::remove_file(&marker)?;
    assert_eq!(r["status"], "error", "a command read a host file: {r}");
    assert!(
        r["stderr"]
            .as_str()
            .is_some_and(|e| e.contains("No such file")),
        "{r}"
    );

    // Streamed as it runs: the command waits for a file the test uploads only after the
    // command's first line arrived.
    let mut sse = v1
        .sse(
            &format!("/v1/sessions/{id}/commands"),
            json!({"cmd": "echo first; for i in $(seq 600); do [ -e go ] && break; sleep 0.1; done; cat go"}),
        )
        .await?;
    let (kind, started) = sse.next().await?;
    assert_eq!(
        (kind.as_str(), started["cmd"].is_string()),
        ("started", true),
        "{started}"
    );
    let (kind, first) = sse.next().await?;
    assert_eq!(
        (kind.as_str(), first["text"].as_str()),
        ("stream", Some("first\n")),
        "{first}"
    );
    assert_eq!(v1.put_file(&id, "go", b"went\n".to_vec()).await?, 201);
    let mut rest = Vec::new();
    let done = loop {
        let (kind, event) = sse.next().await?;
        if kind == "done" {
            break event;
        }
        rest.push(event);
    };
    assert_eq!(done["result"]["status"], "ok", "{done}");
    assert_eq!(done["result"]["stdout"], "first\nwent\n", "{done}");
    assert!(rest.iter().any(|e| e["text"] == "went\n"), "{rest:?}");

    // An interrupt of the session ends a running command (its whole group), not the kernel.
    let mut sse = v1
        .sse(
            &format!("/v1/sessions/{id}/commands"),
            json!({"cmd": "echo waiting; sleep 300"}),
        )
        .await?;
    let (_, _started) = sse.next().await?;
    let (kind, first) = sse.next().await?;
    assert_eq!(
        (kind.as_str(), first["text"].as_str()),
        ("stream", Some("waiting\n")),
        "{first}"
    );
    let (status, _) = v1
        .post(&format!("/v1/sessions/{id}/interrupt"), json!({}))
        .await?;
    assert_eq!(status, 204);
    let done = loop {
        let (kind, event) = sse.next().await?;
        if kind == "done" {
            break event;
        }
    };
    assert_eq!(
        (
            done["result"]["signal"].as_str(),
            done["result"]["error"].as_str()
        ),
        (Some("SIGKILL"), Some("interrupted")),
        "{done}"
    );
    assert_eq!(
        v1.execute(&id, "kept").await?["result"],
        "41",
        "the interrupt cost the variables"
    );

    // Bad requests: refused before anything runs, the session unharmed.
    for (body, why) in [
        (json!({"cmd": ""}), "empty"),
        (json!({"cmd": "ls", "cwd": "../.."}), "traversal"),
        (json!({"cmd": "ls", "env": {"A=B": "x"}}), "bad name"),
        (json!({"cmd": "ls", "timeout_s": -1}), "bad timeout"),
        (json!({"cmd": "ls", "shell": "zsh"}), "unknown field"),
    ] {
        let (status, body) = v1
            .post(&format!("/v1/sessions/{id}/commands"), body)
            .await?;
        assert_eq!(status, 400, "{why}: {body}");
    }
    let (status, _) = v1
        .post("/v1/sessions/nope/commands", json!({"cmd": "ls"}))
        .await?;
    assert_eq!(status, 404);
    assert_eq!(v1.execute(&id, "kept").await?["result"], "41");
    Ok(())
}

/// Per-session variables: refused, naming the policy, unless its `[environment]` allows them;
/// reserved names refused whatever it says; allowed ones reach the kernel and its commands,
/// for a pooled kernel as for a fresh one.
#[tokio::test]
async fn session_variables_follow_the_policy() -> Result<()> {
    let (strict, _strict_policies) = gateway("", "", &[]).await?;
    let v1 = V1Client::new(&strict);
    let (status, body) = v1
        .post("/v1/sessions", json!({"env": {"OPENAI_API_KEY": "sk-1"}}))
        .await?;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("env_not_allowed")),
        "{body}"
    );
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("\"default\"") && message.contains("OPENAI_API_KEY"),
        "{body}"
    );
    drop(strict);

    // A warm pool of one: the first session's kernel comes from it and takes the variables
    // as it is handed out, the second starts afresh with them.
    let (open, _open_policies) = gateway(
        "allow = [\"OPENAI_*\", \"MY_SETTING\"]",
        "",
        &["--pool-size", "1"],
    )
    .await?;
    let v1 = V1Client::new(&open);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let (_, ready) = v1.get("/readyz").await?;
        if ready["pool"]["ready"] == 1 {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the pool never filled: {ready}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    for reserved in ["PATH", "LD_PRELOAD", "PYTHONPATH", "HTTP_PROXY"] {
        let (status, body) = v1
            .post("/v1/sessions", json!({"env": {reserved: "x"}}))
            .await?;
        assert_eq!(status, 400, "{reserved}: {body}");
    }
    let (status, body) = v1
        .post(
            "/v1/sessions",
            json!({"env": {"OTHER": "x", "MY_SETTING": "y"}}),
        )
        .await?;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("OTHER"),
        "{body}"
    );
    // Values with what IPython would split a line at reach the kernel intact, both ways.
    let value = |round: u32| format!("sk-{round}\u{2028}>>> x\u{85}y");
    for round in 0..2 {
        let id = v1
            .create_session(json!({"env": {"OPENAI_API_KEY": value(round), "MY_SETTING": "on"}}))
            .await?;
        let r = v1
            .execute(&id, "import os, json\nprint(json.dumps([os.environ['OPENAI_API_KEY'], os.environ['MY_SETTING']]))")
            .await?;
        let seen: Vec<String> = serde_json::from_str(r["stdout"].as_str().unwrap_or_default())
            .with_context(|| format!("{r}"))?;
        assert_eq!(seen, [value(round), "on".to_owned()], "{r}");
        let r = run(&v1, &id, json!({"cmd": "printf '%s' \"$OPENAI_API_KEY\""})).await?;
        assert_eq!(r["stdout"].as_str(), Some(value(round).as_str()), "{r}");
    }
    let handed_out = open
        .log()
        .matches("kernel handed out from the warm pool")
        .count();
    assert_eq!(
        handed_out,
        1,
        "one kernel from the pool, one afresh:\n{}",
        open.log()
    );
    Ok(())
}
