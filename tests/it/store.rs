//! The gateway's state across restarts (`--state-dir`, src/store): a gateway killed with
//! SIGKILL and started again on the same directory knows its sessions (tenant, policy,
//! kernelspec, history, artifacts), reports their kernels lost with the state generation
//! moved on, and starts a new kernel at the next execute; a damaged, missing or held store
//! stops the start with a clear error, never a silent fresh start.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::v1::{ws_next, ws_send};
use crate::support::{eventually, kernels_dir, repo, Gateway, PATIENCE};
use crate::tenants::{claims, hs256, secret_file};

/// A gateway on state directory `state` that accepts the tenants' test JWTs.
async fn gateway_on(state: &Path, secret: &Path) -> Result<Gateway> {
    Gateway::builder()
        .arg("--state-dir")
        .arg(state.to_str().context("path")?)
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .start()
        .await
}

/// A count from the gateway's database, read beside the running gateway (SQLite in WAL
/// mode lets a reader in while the writer works).
fn count(state: &Path, sql: &str, session: &str) -> i64 {
    let open = rusqlite::Connection::open_with_flags(
        state.join("cellgate.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE,
    );
    open.and_then(|db| db.query_row(sql, [session], |row| row.get(0)))
        .unwrap_or(-1)
}

/// Waits until the store holds `n` executions, cells and usage rows of `session` (the
/// gateway writes them after each answer, from its writer thread).
async fn stored(state: &Path, session: &str, n: i64) -> Result<()> {
    let done = eventually(PATIENCE, || {
        count(
            state,
            "SELECT count(*) FROM executions WHERE session_id = ?1 AND result IS NOT NULL",
            session,
        ) == n
            && count(
                state,
                "SELECT count(*) FROM cells WHERE session_id = ?1",
                session,
            ) == n
            && count(
                state,
                "SELECT count(*) FROM usage WHERE session_id = ?1",
                session,
            ) == n
    })
    .await;
    if !done {
        bail!("the store never held {n} executions and cells of {session}");
    }
    Ok(())
}

/// The code cells' sources and the outputs' texts and MIME types of an exported notebook.
fn cells_of(notebook: &Value) -> Vec<(String, String)> {
    notebook["cells"]
        .as_array()
        .map(|cells| {
            cells
                .iter()
                .map(|cell| {
                    let source = match &cell["source"] {
                        Value::Array(lines) => {
                            lines.iter().filter_map(Value::as_str).collect::<String>()
                        }
                        other => other.as_str().unwrap_or_default().to_owned(),
                    };
                    (source, cell["outputs"].to_string())
                })
                .collect()
        })
        .unwrap_or_default()
}

const PLOT: &str = r#"
import matplotlib
matplotlib.use('agg')
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(2, 2), dpi=40)
ax.plot([1, 3, 2])
plt.show()
"#;

#[tokio::test]
async fn a_gateway_restarted_after_sigkill_knows_its_sessions() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let state = dir.path().join("state");
    let acme = hs256(&claims("acme", "default"));
    let umbrella = hs256(&claims("umbrella", "default"));

    let mut first = gateway_on(&state, &secret).await?;
    let before = V1Client::bearer(&first, &acme)
        .new_session(json!({"policy": "default"}))
        .await?;
    let id = before.id.clone();
    let client = V1Client::bearer(&first, &acme);
    let hello = client.run(&id, "x = 6 * 7\nprint('hello', x)").await?;
    assert_eq!(hello.stdout, "hello 42\n");
    let plot = client.run(&id, PLOT).await?;
    let png = plot
        .artifacts
        .iter()
        .find(|a| a.mime == "image/png")
        .with_context(|| format!("no PNG artifact: {plot:?}"))?
        .id
        .to_string();
    let bytes = client.artifact(&png).await?.bytes().await?;
    assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
    let (_, model) = client.get(&format!("/v1/sessions/{id}")).await?;
    let generation = model["state_generation"].as_u64().context("generation")?;
    stored(&state, &id, 2).await?;
    // A third execution is running when the gateway dies: it is known as begun.
    let mut running = client
        .sse(
            &format!("/v1/sessions/{id}/execute"),
            json!({"code": "import time\ntime.sleep(600)"}),
        )
        .await?;
    let (name, started) = running.next().await?;
    assert_eq!(name, "started", "{started}");
    let running_id = started["execution_id"]
        .as_str()
        .context("the started event's execution id")?
        .to_owned();
    let begun = eventually(PATIENCE, || {
        count(
            &state,
            "SELECT count(*) FROM executions WHERE session_id = ?1 AND result IS NULL",
            &id,
        ) == 1
    })
    .await;
    assert!(begun, "the running execution was never recorded as begun");

    // No chance to write anything more: the store has what it had.
    first.child.kill()?;
    first.child.wait()?;
    drop(first);

    let second = gateway_on(&state, &secret).await?;
    let client = V1Client::bearer(&second, &acme);
    let (status, listed) = client.get("/v1/sessions").await?;
    assert_eq!(status, 200, "{listed}");
    let listed = listed.as_array().context("a list")?;
    assert_eq!(listed.len(), 1, "{listed:?}");
    let session = &listed[0];
    assert_eq!(session["id"], id.as_str());
    assert_eq!(session["tenant"], "acme");
    assert_eq!(session["policy"], before.model.policy.as_str());
    assert_eq!(session["kernel_name"], before.model.kernel_name.as_str());
    assert_eq!(session["language"], "python");
    assert_eq!(session["created"], before.model.created.as_str());
    assert_eq!(session["executions"], 3);
    assert_eq!(session["state"], "dead", "{session}");
    assert!(
        session["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("kernel_lost")),
        "{session}"
    );
    let lost_generation = session["state_generation"].as_u64().context("generation")?;
    assert!(
        lost_generation > generation,
        "{lost_generation} after {generation}"
    );
    // Another tenant sees nothing of it.
    let other = V1Client::bearer(&second, &umbrella);
    assert_eq!(other.get("/v1/sessions").await?.1, json!([]));
    assert_eq!(other.get(&format!("/v1/sessions/{id}")).await?.0, 404);
    assert_eq!(other.artifact(&png).await?.status().as_u16(), 404);

    // Its history exports, its artifact downloads with the same bytes.
    let response = client
        .request(Method::GET, &format!("/v1/sessions/{id}/notebook"))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 200);
    let notebook: Value = response.json().await?;
    let cells = cells_of(&notebook);
    assert_eq!(cells.len(), 2, "{notebook}");
    assert!(cells[0].0.contains("print('hello', x)") && cells[0].1.contains("hello 42"));
    assert!(cells[1].0.contains("ax.plot") && cells[1].1.contains("image/png"));
    let again = client.artifact(&png).await?;
    assert_eq!(again.status().as_u16(), 200);
    assert_eq!(again.bytes().await?, bytes);
    let (_, artifacts) = client.get(&format!("/v1/sessions/{id}/artifacts")).await?;
    assert!(
        artifacts.to_string().contains(&png),
        "{artifacts} has no {png}"
    );
    // The usage ledger outlived the process too.
    let (status, usage) = client.get("/v1/usage").await?;
    assert_eq!(status, 200, "{usage}");
    assert_eq!(
        usage["records"].as_array().map(Vec::len),
        Some(2),
        "{usage}"
    );
    assert_eq!(usage["records"][0]["outcome"], "ok");
    // Routes that need the kernel's process say it is gone.
    let (status, files) = client.get(&format!("/v1/sessions/{id}/files")).await?;
    assert_eq!(status, 409, "{files}");
    // A result a client never saw can still be fetched, as JSON or as the `done` a resumed
    // stream ends with; another tenant cannot.
    let hello_id = hello.execution_id.to_string();
    let (status, listed) = client.get(&format!("/v1/sessions/{id}/executions")).await?;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed.as_array().map(Vec::len), Some(3), "{listed}");
    assert_eq!(listed[0]["execution_id"], hello_id.as_str(), "{listed}");
    assert_eq!(listed[0]["status"], "ok", "{listed}");
    // The one running at the crash is answered for as lost, never as running for good.
    assert_eq!(listed[2]["execution_id"], running_id.as_str(), "{listed}");
    assert_eq!(listed[2]["status"], "sandbox_lost", "{listed}");
    let (_, lost) = client
        .get(&format!("/v1/sessions/{id}/executions/{running_id}"))
        .await?;
    assert_eq!(lost["state"], "done", "{lost}");
    assert_eq!(lost["result"]["error"]["ename"], "KernelLost", "{lost}");
    let hello_path = format!("/v1/sessions/{id}/executions/{hello_id}");
    let (status, record) = client.get(&hello_path).await?;
    assert_eq!(status, 200, "{record}");
    assert_eq!(record["state"], "done", "{record}");
    assert_eq!(record["result"]["stdout"], "hello 42\n", "{record}");
    let mut resumed = client.sse_get(&hello_path, Some(3)).await?;
    let (event_id, name, done) = resumed.next_with_id().await?;
    assert_eq!(name, "done", "{done}");
    assert_eq!(
        event_id.as_deref(),
        Some("4"),
        "numbered after the client's last id"
    );
    assert_eq!(done["result"]["stdout"], "hello 42\n", "{done}");
    assert_eq!(other.get(&hello_path).await?.0, 404);

    // A new kernel is a new sandbox under the caller's cap as it is now: the same tenant
    // capped to a stricter policy than the session's cannot start it again.
    let capped = hs256(&claims("acme", "strict"));
    let (status, refused) = V1Client::bearer(&second, &capped)
        .post(&format!("/v1/sessions/{id}/execute"), json!({"code": "1"}))
        .await?;
    assert_eq!(status, 403, "{refused}");
    assert_eq!(
        client.get(&format!("/v1/sessions/{id}")).await?.1["state"],
        "dead",
        "still dormant"
    );

    // The next execute starts a new kernel: the variables are gone, the generation is the
    // one the listing gave, and the history goes on.
    let lost = client.run(&id, "x").await?;
    assert_eq!(
        lost.error.as_ref().map(|e| e.ename.as_str()),
        Some("NameError")
    );
    assert_eq!(lost.state_generation, lost_generation);
    let fresh = client.run(&id, "print(1 + 1)").await?;
    assert_eq!(fresh.stdout, "2\n");
    // Revived, the session still answers for the executions before the restart.
    let mut resumed = client.sse_get(&hello_path, None).await?;
    let (_, name, done) = resumed.next_with_id().await?;
    assert_eq!(name, "done", "{done}");
    assert_eq!(done["result"]["stdout"], "hello 42\n", "{done}");
    let (_, model) = client.get(&format!("/v1/sessions/{id}")).await?;
    assert_eq!(model["state"], "idle", "{model}");
    assert_eq!(model["executions"], 5);
    let notebook: Value = client
        .request(Method::GET, &format!("/v1/sessions/{id}/notebook"))
        .send()
        .await?
        .json()
        .await?;
    let cells = cells_of(&notebook);
    assert_eq!(cells.len(), 4, "{notebook}");
    assert!(cells[0].0.contains("print('hello', x)") && cells[3].0.contains("print(1 + 1)"));
    stored(&state, &id, 4).await?;

    // A deleted session leaves the store.
    assert_eq!(
        client
            .request(Method::DELETE, &format!("/v1/sessions/{id}"))
            .send()
            .await?
            .status()
            .as_u16(),
        204
    );
    let gone = eventually(PATIENCE, || {
        count(&state, "SELECT count(*) FROM sessions WHERE id = ?1", &id) == 0
    })
    .await;
    assert!(gone, "the deleted session is still in the store");
    Ok(())
}

/// `cellgate serve` on state directory `state`, expected to stop at start: its exit status
/// and stderr (a gateway that starts instead fails the test).
async fn refused_start(state: &Path) -> Result<(std::process::ExitStatus, String)> {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_cellgate"));
    command
        .args([
            "serve",
            "--ip",
            "127.0.0.1",
            "--port",
            "0",
            "--pool-size",
            "0",
        ])
        .args(["--kernel-zygote", "false"])
        .arg("--kernels-dir")
        .arg(kernels_dir())
        .arg("--policies-dir")
        .arg(repo().join("policies"))
        .arg("--state-dir")
        .arg(state)
        .kill_on_drop(true);
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if (name.starts_with("CELLGATE_") || name.starts_with("KG_"))
            && !name.starts_with("CELLGATE_TEST_")
            && name != "CELLGATE_GUEST_DIR"
        {
            command.env_remove(name);
        }
    }
    let output = tokio::time::timeout(PATIENCE, command.output())
        .await
        .context("the gateway started instead of refusing")??;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if stdout.contains("listening") {
        bail!("the gateway started: {stdout}{stderr}");
    }
    Ok((output.status, stderr))
}

/// A state directory a gateway has used (it holds a store), and the database's path.
async fn used_state_dir(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let state = dir.join("state");
    let gateway = Gateway::builder()
        .arg("--state-dir")
        .arg(state.to_str().context("path")?)
        .start()
        .await?;
    drop(gateway);
    let db = state.join("cellgate.db");
    assert!(db.is_file(), "no database in {}", state.display());
    Ok((state, db))
}

#[tokio::test]
async fn a_damaged_or_missing_store_stops_the_start() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (state, db) = used_state_dir(dir.path()).await?;

    std::fs::write(&db, vec![0x42; 64 << 10])?;
    let (status, stderr) = refused_start(&state).await?;
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&db.display().to_string())
            && stderr.contains("not a usable cellgate store"),
        "{stderr}"
    );

    for file in ["cellgate.db", "cellgate.db-wal", "cellgate.db-shm"] {
        let _ = std::fs::remove_file(state.join(file));
    }
    let (status, stderr) = refused_start(&state).await?;
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&db.display().to_string())
            && stderr.contains("is missing")
            && stderr.contains("delete the state directory"),
        "{stderr}"
    );
    assert!(
        !db.exists(),
        "a refused start must not make a fresh database"
    );

    // Deleting the directory is the way to start afresh.
    std::fs::remove_dir_all(&state)?;
    let gateway = Gateway::builder()
        .arg("--state-dir")
        .arg(state.to_str().context("path")?)
        .start()
        .await?;
    assert_eq!(
        V1Client::new(&gateway).get("/v1/sessions").await?.1,
        json!([])
    );
    Ok(())
}

#[tokio::test]
async fn a_store_held_by_a_running_gateway_refuses_a_second_one() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let first = Gateway::builder()
        .arg("--state-dir")
        .arg(state.to_str().context("path")?)
        .start()
        .await?;
    let (status, stderr) = refused_start(&state).await?;
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("in use by another cellgate")
            && stderr.contains(&format!("pid {}", first.pid())),
        "{stderr}"
    );
    // The first is unharmed.
    assert_eq!(V1Client::new(&first).get("/v1/sessions").await?.0, 200);
    Ok(())
}

#[tokio::test]
async fn the_store_keeps_a_usage_ledger_each_tenant_reads_its_own_of() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let state = dir.path().join("state");
    let gateway = gateway_on(&state, &secret).await?;
    let acme = V1Client::bearer(&gateway, &hs256(&claims("acme", "default")));
    let umbrella = V1Client::bearer(&gateway, &hs256(&claims("umbrella", "default")));
    let mut sessions = Vec::new();
    for (client, code) in [(&acme, "print('x' * 1000)"), (&umbrella, "1 / 0")] {
        let id = client.create_session(json!({})).await?;
        client.run(&id, code).await?;
        sessions.push(id);
    }
    for id in &sessions {
        let written = eventually(PATIENCE, || {
            count(
                &state,
                "SELECT count(*) FROM usage WHERE session_id = ?1",
                id,
            ) == 1
        })
        .await;
        assert!(written, "no usage row for {id}");
    }

    let (status, own) = acme.get("/v1/usage").await?;
    assert_eq!(status, 200, "{own}");
    let records = own["records"].as_array().context("records")?;
    assert_eq!(records.len(), 1, "{own}");
    let record = &records[0];
    assert_eq!(record["tenant"], "acme");
    assert_eq!(record["session_id"], sessions[0].as_str());
    assert_eq!(record["policy"], "default");
    assert_eq!(record["outcome"], "ok");
    assert!(record["output_bytes"].as_u64() >= Some(1000), "{record}");
    assert_eq!(own["totals"]["executions"], 1);
    assert_eq!(
        umbrella.get("/v1/usage").await?.1["records"][0]["outcome"],
        "error"
    );
    // Never another tenant's.
    assert_eq!(acme.get("/v1/usage?tenant=umbrella").await?.0, 403);

    // The admin reads everyone's, or one tenant's, in a period.
    let admin = V1Client::new(&gateway);
    let (_, all) = admin.get("/v1/usage").await?;
    assert_eq!(all["totals"]["executions"], 2, "{all}");
    let (_, one) = admin.get("/v1/usage?tenant=umbrella").await?;
    assert_eq!(one["records"].as_array().map(Vec::len), Some(1), "{one}");
    let (_, later) = admin.get("/v1/usage?since=2999-01-01T00:00:00Z").await?;
    assert_eq!(later["records"], json!([]));
    let (_, earlier) = admin
        .get("/v1/usage?since=2000-01-01T00:00:00Z&until=2999-01-01T00:00:00%2B01:00")
        .await?;
    assert_eq!(earlier["totals"]["executions"], 2, "{earlier}");
    assert_eq!(admin.get("/v1/usage?since=yesterday").await?.0, 400);
    Ok(())
}

#[tokio::test]
async fn a_tenant_past_its_cpu_quota_in_the_store_gets_429_naming_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let state = dir.path().join("state");
    let config = dir.path().join("cellgate.toml");
    std::fs::write(&config, "[tenants.limits.acme]\ncpu_seconds_per_day = 1\n")?;
    let gateway = Gateway::builder()
        .arg("--state-dir")
        .arg(state.to_str().context("path")?)
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .arg("--config")
        .arg(config.to_str().context("path")?)
        .start()
        .await?;
    let acme = V1Client::bearer(&gateway, &hs256(&claims("acme", "default")));
    let umbrella = V1Client::bearer(&gateway, &hs256(&claims("umbrella", "default")));
    let id = acme.create_session(json!({})).await?;
    // A socket opened while under the quota.
    let mut socket = acme.ws(&id).await?;
    let hello = ws_next(&mut socket).await?;
    assert_eq!(hello["type"], "session", "{hello}");
    // A shell command is charged as a cell is.
    let (status, command) = acme
        .post(
            &format!("/v1/sessions/{id}/commands"),
            // CPU time, not wall time: a loaded machine gives the loop less than its wall.
            json!({"cmd": "python3 -c 'import time\ns = time.process_time()\nwhile time.process_time() - s < 1.5:\n    pass' && echo burnt"}),
        )
        .await?;
    assert_eq!(status, 200, "{command}");
    assert_eq!(command["stdout"], "burnt\n", "{command}");
    let written = eventually(PATIENCE, || {
        count(
            &state,
            "SELECT count(*) FROM usage WHERE session_id = ?1 AND cpu_ms >= 1000",
            &id,
        ) == 1
    })
    .await;
    assert!(
        written,
        "no usage row of at least 1 s of CPU for the command"
    );

    let response = acme
        .request(Method::POST, &format!("/v1/sessions/{id}/execute"))
        .json(&json!({"code": "1"}))
        .send()
        .await?;
    let retry_after: Option<u64> = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let (status, refused) = crate::support::v1::json_of(response).await?;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["code"], "quota_exceeded");
    let message = refused["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("cpu_seconds_per_day") && message.contains("resets at"),
        "{message}"
    );
    // When it resets, for a program: the next UTC midnight, and the seconds until then.
    let quota = &refused["quota"];
    assert_eq!(quota["name"], "cpu_seconds_per_day", "{refused}");
    assert_eq!(quota["limit"], 1, "{refused}");
    assert!(quota["used"].as_f64() >= Some(1.0), "{refused}");
    let resets_at = quota["resets_at"].as_str().context("resets_at")?;
    let reset =
        time::OffsetDateTime::parse(resets_at, &time::format_description::well_known::Rfc3339)?;
    let now = time::OffsetDateTime::now_utc();
    assert_eq!(reset.time(), time::Time::MIDNIGHT, "{resets_at}");
    assert_eq!(reset.offset(), time::UtcOffset::UTC, "{resets_at}");
    assert!(
        reset > now && reset - now <= time::Duration::days(1),
        "{resets_at}"
    );
    let retry_after = retry_after.context("no Retry-After")?;
    let until_reset = (reset - now).whole_seconds().unsigned_abs();
    assert!(
        retry_after >= until_reset.saturating_sub(60) && retry_after <= until_reset + 1,
        "Retry-After {retry_after} s, {until_reset} s to {resets_at}"
    );
    let (status, _) = acme.post("/v1/execute", json!({"code": "1"})).await?;
    assert_eq!(status, 429);
    // The socket opened before is refused each execution past the quota too.
    ws_send(&mut socket, json!({"type": "execute", "code": "1"})).await?;
    let refused = ws_next(&mut socket).await?;
    assert_eq!(refused["type"], "client_error", "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .is_some_and(|m| m.contains("cpu_seconds_per_day")),
        "{refused}"
    );
    // Another tenant, and the admin, have no such quota.
    let other = umbrella.create_session(json!({})).await?;
    assert_eq!(
        umbrella.run(&other, "1 + 1").await?.result.as_deref(),
        Some("2")
    );
    assert_eq!(
        V1Client::new(&gateway)
            .run(&id, "1 + 1")
            .await?
            .result
            .as_deref(),
        Some("2")
    );
    Ok(())
}

/// The ids of an SSE execution's events up to its `done` (or, with `until`, up to the first
/// event that name), with the last event read.
async fn sse_ids(sse: &mut crate::support::v1::Sse, until: &str) -> Result<(Vec<u64>, Value)> {
    let mut ids = Vec::new();
    loop {
        let (id, name, data) = sse.next_with_id().await?;
        let id: u64 = id.context("an event without an id")?.parse()?;
        ids.push(id);
        if name == until || name == "done" {
            return Ok((ids, data));
        }
    }
}

#[tokio::test]
async fn event_ids_go_on_after_a_restart_and_an_old_resume_is_told_the_gap() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let state = dir.path().join("state");
    let acme = hs256(&claims("acme", "default"));

    let mut first = gateway_on(&state, &secret).await?;
    let client = V1Client::bearer(&first, &acme);
    let id = client.create_session(json!({})).await?;
    let mut sse = client
        .sse(
            &format!("/v1/sessions/{id}/execute"),
            json!({"code": "x = 1"}),
        )
        .await?;
    let (finished, _) = sse_ids(&mut sse, "done").await?;
    let early = *finished.first().context("no events")?;
    let noted = *finished.last().context("no events")?;
    let written = eventually(PATIENCE, || {
        count(
            &state,
            "SELECT last_event_id FROM sessions WHERE id = ?1",
            &id,
        ) >= i64::try_from(noted).unwrap_or(i64::MAX)
    })
    .await;
    assert!(written, "the store never noted event id {noted}");
    // A cell is running and printing when the gateway dies: its ids were never noted.
    let mut running = client
        .sse(
            &format!("/v1/sessions/{id}/execute"),
            json!({"code": "print('before', flush=True)\nimport time\ntime.sleep(600)"}),
        )
        .await?;
    let (seen, printed) = sse_ids(&mut running, "stream").await?;
    assert_eq!(printed["text"], "before\n", "{printed}");
    let last_seen = *seen.last().context("no events")?;
    assert!(last_seen > noted, "{last_seen} after {noted}");
    first.child.kill()?;
    first.child.wait()?;
    drop(first);

    let second = gateway_on(&state, &secret).await?;
    let client = V1Client::bearer(&second, &acme);
    let mut sse = client
        .sse(
            &format!("/v1/sessions/{id}/execute"),
            json!({"code": "print('after')"}),
        )
        .await?;
    let (after, done) = sse_ids(&mut sse, "done").await?;
    assert_eq!(done["result"]["stdout"], "after\n", "{done}");
    // Past every id a client had: new events are not taken for ones it saw.
    let first_new = *after.first().context("no events")?;
    assert!(
        first_new > last_seen,
        "ids began again at {first_new}, not past {last_seen}"
    );

    // A client resuming the session with an id from before the restart is told the gap,
    // then sent what the new gateway holds.
    for resumed_from in [last_seen, early] {
        let (mut socket, _) = tokio_tungstenite::connect_async(
            client.ws_request_query(&id, &format!("?last_event_id={resumed_from}"))?,
        )
        .await?;
        let hello = ws_next(&mut socket).await?;
        assert_eq!(hello["type"], "session", "{hello}");
        let gap = ws_next(&mut socket).await?;
        assert_eq!(gap["type"], "gap", "nothing said of the lost ids: {gap}");
        assert_eq!(gap["first_id"], resumed_from + 1, "{gap}");
        let gap_end = gap["last_id"].as_u64().context("last_id")?;
        assert!(gap_end < first_new, "{gap} hides {first_new}");
        let mut texts = String::new();
        loop {
            let event = ws_next(&mut socket).await?;
            let event_id = event["id"].as_u64().context("an event without an id")?;
            assert!(event_id > gap_end, "{event} inside {gap}");
            if event["type"] == "stream" {
                texts.push_str(event["text"].as_str().unwrap_or_default());
            }
            if event["type"] == "done" {
                break;
            }
        }
        assert_eq!(texts, "after\n");
    }
    Ok(())
}

/// Runs `sql` on the gateway's database (stopped) with `?1` = `session`.
fn write(state: &Path, sql: &str, session: &str) -> Result<usize> {
    let db = rusqlite::Connection::open(state.join("cellgate.db"))?;
    Ok(db.execute(sql, [session])?)
}

#[tokio::test]
async fn dormant_sessions_expire_when_their_policy_would_have_ended_their_kernel() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let state = dir.path().join("state");
    let acme = hs256(&claims("acme", "default"));

    let mut first = gateway_on(&state, &secret).await?;
    let client = V1Client::bearer(&first, &acme);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = client.create_session(json!({})).await?;
        ids.push(id);
    }
    let plot = client.run(&ids[0], PLOT).await?;
    let png = plot
        .artifacts
        .first()
        .with_context(|| format!("no artifact: {plot:?}"))?
        .id
        .to_string();
    client.run(&ids[1], "1").await?;
    client.run(&ids[2], "1").await?;
    // A policy that keeps an idle kernel 2 hours: the gateway's bound ends it sooner.
    let analyst = V1Client::bearer(&first, &hs256(&claims("globex", "data-science")));
    let bounded = analyst.create_session(json!({})).await?;
    analyst.run(&bounded, "1").await?;
    ids.push(bounded.clone());
    for id in &ids {
        stored(&state, id, 1).await?;
    }
    first.child.kill()?;
    first.child.wait()?;
    drop(first);

    // The default policy ends a kernel idle for 30 minutes, and any after 12 hours. The
    // first session was last active 2 hours ago; the second was created 13 hours ago but
    // ran a cell a minute ago; the third is as it was. The fourth's policy (data-science)
    // would keep it idle 2 hours; it was last active 90 minutes ago, past the gateway's
    // --dormant-retention of 1 hour.
    let ago = |minutes: i64| {
        let at = time::OffsetDateTime::now_utc() - time::Duration::minutes(minutes);
        at.format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default()
    };
    let (idle, old, recent) = (&ids[0], &ids[1], &ids[2]);
    write(
        &state,
        &format!("UPDATE sessions SET created = '{}' WHERE id = ?1", ago(100)),
        &bounded,
    )?;
    write(
        &state,
        &format!(
            "UPDATE executions SET started = '{}' WHERE session_id = ?1",
            ago(90)
        ),
        &bounded,
    )?;
    write(
        &state,
        &format!("UPDATE sessions SET created = '{}' WHERE id = ?1", ago(180)),
        idle,
    )?;
    write(
        &state,
        &format!(
            "UPDATE executions SET started = '{}' WHERE session_id = ?1",
            ago(120)
        ),
        idle,
    )?;
    write(
        &state,
        &format!(
            "UPDATE sessions SET created = '{}' WHERE id = ?1",
            ago(13 * 60)
        ),
        old,
    )?;
    write(
        &state,
        &format!(
            "UPDATE executions SET started = '{}' WHERE session_id = ?1",
            ago(1)
        ),
        old,
    )?;

    let second = Gateway::builder()
        .arg("--state-dir")
        .arg(state.to_str().context("path")?)
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--artifact-retention", "0"])
        .args(&["--dormant-retention", "1h"])
        .start()
        .await?;
    let client = V1Client::bearer(&second, &acme);
    let analyst = V1Client::bearer(&second, &hs256(&claims("globex", "data-science")));
    assert_eq!(
        analyst.get("/v1/sessions").await?.1,
        json!([]),
        "past --dormant-retention, whatever its policy says"
    );
    let (_, listed) = client.get("/v1/sessions").await?;
    let listed: Vec<&str> = listed
        .as_array()
        .context("a list")?
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(listed, [recent.as_str()], "only the third is kept");
    for expired in [idle, old] {
        assert_eq!(client.get(&format!("/v1/sessions/{expired}")).await?.0, 404);
        // Not started again either.
        let (status, body) = client
            .post(
                &format!("/v1/sessions/{expired}/execute"),
                json!({"code": "1"}),
            )
            .await?;
        assert_eq!(status, 404, "{body}");
    }
    // Gone from the store, with their artifacts (after the artifact retention, 0 here).
    let forgotten = eventually(PATIENCE, || {
        [idle, old].iter().all(|id| {
            count(&state, "SELECT count(*) FROM sessions WHERE id = ?1", id) == 0
                && count(
                    &state,
                    "SELECT count(*) FROM artifacts WHERE session_id = ?1",
                    id,
                ) == 0
        })
    })
    .await;
    assert!(forgotten, "the expired sessions are still in the store");
    assert_eq!(client.artifact(&png).await?.status().as_u16(), 404);
    // The kept one starts again.
    assert_eq!(
        client.run(recent, "1 + 1").await?.result.as_deref(),
        Some("2")
    );
    Ok(())
}

#[tokio::test]
async fn artifact_files_no_record_names_are_swept_at_start() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let state = dir.path().join("state");
    let acme = hs256(&claims("acme", "default"));
    let mut first = gateway_on(&state, &secret).await?;
    let client = V1Client::bearer(&first, &acme);
    let id = client.create_session(json!({})).await?;
    let plot = client.run(&id, PLOT).await?;
    let png = plot
        .artifacts
        .first()
        .with_context(|| format!("no artifact: {plot:?}"))?
        .id
        .to_string();
    let bytes = client.artifact(&png).await?.bytes().await?;
    let kept = eventually(PATIENCE, || {
        count(
            &state,
            "SELECT count(*) FROM artifacts WHERE session_id = ?1",
            &id,
        ) == 1
    })
    .await;
    assert!(kept, "the artifact's record never reached the store");
    first.child.kill()?;
    first.child.wait()?;
    drop(first);

    // What a crash between a blob's write and its record's commit leaves, and a write cut
    // short; and a file that is none of the store's, which is not its to remove.
    let artifacts = state.join("artifacts");
    let orphan_sha = format!("ab{}", "0".repeat(62));
    std::fs::create_dir_all(artifacts.join("ab"))?;
    let orphan = artifacts.join("ab").join(&orphan_sha);
    std::fs::write(&orphan, b"bytes whose record never committed")?;
    let partial = artifacts.join(".tmp-0123456789abcdef");
    std::fs::write(&partial, b"half a blob")?;
    let foreign = artifacts.join("ab").join("README");
    std::fs::write(&foreign, b"an operator's note")?;

    let second = gateway_on(&state, &secret).await?;
    assert!(!orphan.exists(), "the orphan blob is still there");
    assert!(!partial.exists(), "the temporary file is still there");
    assert!(foreign.exists(), "a file the store never wrote was removed");
    // The recorded one is untouched.
    let again = V1Client::bearer(&second, &acme).artifact(&png).await?;
    assert_eq!(again.status().as_u16(), 200);
    assert_eq!(again.bytes().await?, bytes);
    Ok(())
}
