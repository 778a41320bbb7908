//! Resumable delivery of API v1 events, black box: a real gateway, a real ipykernel in the
//! real sandbox. A cell's stream is cut mid-cell (the test drops its connection after a few
//! events) and resumed with `Last-Event-ID` on `GET /v1/sessions/{id}/executions/{eid}`, and
//! over the session WebSocket's `?last_event_id=`: every event arrives exactly once, in order,
//! then the result, as the execution's record (`GET` of it as JSON) says. A resume from before
//! what the replay buffer still holds is told the gap, by ids. Unknown, malformed and another
//! tenant's executions are 404.
//!
//! Without clocks: the cell prints, then waits for a workspace file the test uploads only
//! once it has cut the stream (and again once the resumed stream is under way), so the cut
//! and the resume both happen while the cell runs.

use anyhow::{bail, ensure, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::api_v1::wait_for_file;
use crate::support::v1::{ws_next, ws_send, V1Client};
use crate::support::{Gateway, Socket};

/// A cell that prints lines 1–5, waits for `go`, prints 6–8, waits for `go2`, prints 9–10.
fn cut_cell() -> String {
    let print = |range: &str| {
        format!("for _i in range{range}:\n    print(f'line {{_i}}', flush=True)\n    _time.sleep(0.02)\n")
    };
    format!(
        "import time as _time\n{}{}{}{}{}",
        print("(1, 6)"),
        wait_for_file("go"),
        print("(6, 9)"),
        wait_for_file("go2"),
        print("(9, 11)"),
    )
}

/// What the cell prints in all.
fn all_lines() -> String {
    (1..=10).map(|i| format!("line {i}\n")).collect()
}

/// The stdout text of `events`, joined.
fn stdout_of(events: &[Value]) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "stream" && e["name"] == "stdout")
        .filter_map(|e| e["text"].as_str())
        .collect()
}

fn id_of(event: &Value) -> Result<u64> {
    event["id"]
        .as_u64()
        .with_context(|| format!("an event without an id: {event}"))
}

/// Every id strictly greater than the one before.
fn ensure_increasing(events: &[Value]) -> Result<()> {
    let ids = events.iter().map(id_of).collect::<Result<Vec<_>>>()?;
    ensure!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "ids not strictly increasing: {ids:?}"
    );
    Ok(())
}

/// Reads SSE events into `seen` until `stop` holds for the last one; checks that the SSE
/// `id:` field and `event:` name agree with the JSON.
async fn read_sse_until(
    sse: &mut crate::support::v1::Sse,
    seen: &mut Vec<Value>,
    stop: impl Fn(&[Value]) -> bool,
) -> Result<()> {
    loop {
        let (id, name, data) = sse.next_with_id().await?;
        ensure!(
            id.as_deref() == Some(id_of(&data)?.to_string().as_str()),
            "the SSE id field {id:?} is not the event's id: {data}"
        );
        ensure!(data["type"] == name.as_str(), "event {name}: {data}");
        seen.push(data);
        if stop(seen) {
            return Ok(());
        }
    }
}

/// Reads WebSocket frames into `seen` until `stop` holds for the last one.
async fn read_ws_until(
    socket: &mut Socket,
    seen: &mut Vec<Value>,
    stop: impl Fn(&[Value]) -> bool,
) -> Result<()> {
    loop {
        seen.push(ws_next(socket).await?);
        if stop(seen) {
            return Ok(());
        }
    }
}

fn is_done(events: &[Value]) -> bool {
    events.last().is_some_and(|e| e["type"] == "done")
}

/// The execution's record as `GET …/executions/{eid}` answers it (200 asserted).
async fn record(v1: &V1Client<'_>, session: &str, execution: &str) -> Result<Value> {
    let (status, record) = v1
        .get(&format!("/v1/sessions/{session}/executions/{execution}"))
        .await?;
    ensure!(status == 200, "{status} {record}");
    Ok(record)
}

async fn upload(v1: &V1Client<'_>, session: &str, name: &str) -> Result<()> {
    let status = v1.put_file(session, name, vec![]).await?;
    ensure!(status == 201, "upload {name}: {status}");
    Ok(())
}

#[tokio::test]
async fn resume_an_sse_stream_cut_mid_cell_with_nothing_lost() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let session = v1.create_session(json!({})).await?;

    let mut cut = v1
        .sse(
            &format!("/v1/sessions/{session}/execute"),
            json!({"code": cut_cell()}),
        )
        .await?;
    let mut seen = Vec::new();
    read_sse_until(&mut cut, &mut seen, |events| {
        stdout_of(events).contains("line 3\n")
    })
    .await?;
    // The test's connection goes, mid-cell (the cell waits for `go`).
    drop(cut);
    ensure!(seen[0]["type"] == "started", "{:?}", seen[0]);
    let execution = seen[0]["execution_id"]
        .as_str()
        .context("execution_id")?
        .to_owned();
    // The cell goes on with nobody listening.
    upload(&v1, &session, "go").await?;

    let last = id_of(seen.last().context("events")?)?;
    let path = format!("/v1/sessions/{session}/executions/{execution}");
    let mut resumed = v1.sse_get(&path, Some(last)).await?;
    let cut_at = seen.len();
    read_sse_until(&mut resumed, &mut seen, |events| {
        stdout_of(events).contains("line 8\n")
    })
    .await?;

    // Still running (it waits for `go2`): the record says so, with every event so far.
    let running = record(&v1, &session, &execution).await?;
    ensure!(running["state"] == "running", "{running}");
    ensure!(running["result"].is_null(), "{running}");
    let so_far = running["events"].as_array().context("events")?;
    ensure!(
        so_far.len() >= seen.len() && so_far[..seen.len()] == seen[..],
        "the record of the running execution is not what was streamed:\n{so_far:?}\n{seen:?}"
    );

    upload(&v1, &session, "go2").await?;
    read_sse_until(&mut resumed, &mut seen, is_done).await?;

    // Every event exactly once, in order: what the two streams carried is the record.
    let done = record(&v1, &session, &execution).await?;
    ensure!(done["state"] == "done", "{done}");
    let recorded = done["events"].as_array().context("events")?;
    ensure!(
        recorded[..] == seen[..],
        "streamed (cut after {cut_at}) and recorded events differ:\n{seen:?}\n{recorded:?}"
    );
    ensure_increasing(&seen)?;
    ensure!(stdout_of(&seen) == all_lines(), "{}", stdout_of(&seen));
    ensure!(done["result"]["status"] == "ok", "{done}");
    ensure!(done["result"]["stdout"] == all_lines(), "{done}");
    ensure!(seen.last() == recorded.last() && is_done(&seen));
    ensure!(
        seen.last().context("done")?["result"] == done["result"],
        "{done}"
    );

    // A finished execution is replayed whole from the start, and nothing after its end.
    let mut again = v1.sse_get(&path, None).await?;
    let mut replayed = Vec::new();
    read_sse_until(&mut again, &mut replayed, is_done).await?;
    ensure!(replayed == seen, "{replayed:?}");
    Ok(())
}

#[tokio::test]
async fn resume_the_session_websocket_with_last_event_id() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let session = v1.create_session(json!({})).await?;

    let (mut socket, _) = tokio_tungstenite::connect_async(v1.ws_request(&session)?).await?;
    let hello = ws_next(&mut socket).await?;
    ensure!(hello["type"] == "session", "{hello}");
    ensure!(hello["last_event_id"].is_u64(), "{hello}");
    ws_send(&mut socket, json!({"type": "execute", "code": cut_cell()})).await?;
    let mut seen = Vec::new();
    read_ws_until(&mut socket, &mut seen, |events| {
        stdout_of(events).contains("line 3\n")
    })
    .await?;
    socket.close(None).await?;
    drop(socket);
    let execution = seen[0]["execution_id"]
        .as_str()
        .context("execution_id")?
        .to_owned();
    upload(&v1, &session, "go").await?;

    let last = id_of(seen.last().context("events")?)?;
    let (mut socket, _) = tokio_tungstenite::connect_async(
        v1.ws_request_query(&session, &format!("?last_event_id={last}"))?,
    )
    .await?;
    let hello = ws_next(&mut socket).await?;
    ensure!(hello["type"] == "session", "{hello}");
    let cut_at = seen.len();
    read_ws_until(&mut socket, &mut seen, |events| {
        stdout_of(events).contains("line 8\n")
    })
    .await?;
    upload(&v1, &session, "go2").await?;
    read_ws_until(&mut socket, &mut seen, is_done).await?;

    let done = record(&v1, &session, &execution).await?;
    let recorded = done["events"].as_array().context("events")?;
    ensure!(
        recorded[..] == seen[..],
        "events over the two sockets (cut after {cut_at}) and recorded differ:\n{seen:?}\n{recorded:?}"
    );
    ensure_increasing(&seen)?;
    ensure!(stdout_of(&seen) == all_lines(), "{}", stdout_of(&seen));
    ensure!(done["result"]["stdout"] == all_lines(), "{done}");

    // An id ahead of the session's (as after a take-over, where ids begin again) hides
    // nothing to come: the hello says where the session is, and new events arrive.
    let newest = id_of(seen.last().context("events")?)?;
    let (mut ahead, _) = tokio_tungstenite::connect_async(
        v1.ws_request_query(&session, &format!("?last_event_id={}", newest + 1000))?,
    )
    .await?;
    let hello = ws_next(&mut ahead).await?;
    ensure!(hello["last_event_id"] == newest, "{hello}");
    ws_send(
        &mut ahead,
        json!({"type": "execute", "code": "print('after')"}),
    )
    .await?;
    let mut after = Vec::new();
    read_ws_until(&mut ahead, &mut after, is_done).await?;
    ensure!(after[0]["type"] == "started", "{after:?}");
    ensure!(id_of(&after[0])? == newest + 1, "{after:?}");
    ensure!(stdout_of(&after) == "after\n", "{after:?}");

    // A malformed resume id is refused before the upgrade.
    let refused =
        tokio_tungstenite::connect_async(v1.ws_request_query(&session, "?last_event_id=seven")?)
            .await;
    match refused {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            ensure!(response.status() == 400, "{response:?}")
        }
        other => bail!("a malformed last_event_id was not refused: {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn resume_past_the_replay_bound_is_told_the_gap() -> Result<()> {
    let gateway = Gateway::builder()
        .args(&["--event-replay-bytes", "4KiB"])
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let session = v1.create_session(json!({})).await?;
    // Far more than 4 KiB of events: the oldest leave the replay buffer.
    let result = v1
        .execute(
            &session,
            "import time\nfor i in range(6):\n    print(str(i) * 1500, flush=True)\n    time.sleep(0.02)\n",
        )
        .await?;
    let execution = result["execution_id"].as_str().context("execution_id")?;
    let recorded = record(&v1, &session, execution).await?;
    let recorded = recorded["events"].as_array().context("events")?.clone();
    let newest = id_of(recorded.last().context("events")?)?;

    let (mut socket, _) =
        tokio_tungstenite::connect_async(v1.ws_request_query(&session, "?last_event_id=0")?)
            .await?;
    let hello = ws_next(&mut socket).await?;
    ensure!(hello["type"] == "session", "{hello}");
    ensure!(hello["last_event_id"] == newest, "{hello} {newest}");
    let gap = ws_next(&mut socket).await?;
    ensure!(gap["type"] == "gap", "no gap told first: {gap}");
    ensure!(gap["first_id"] == 1, "{gap}");
    let last_dropped = gap["last_id"].as_u64().context("last_id")?;
    ensure!(last_dropped >= 1 && last_dropped < newest, "{gap}");
    let mut replayed = Vec::new();
    read_ws_until(&mut socket, &mut replayed, is_done).await?;
    // The gap names exactly what is not replayed: the rest comes, each once, in order.
    let expected: Vec<Value> = recorded
        .iter()
        .filter(|e| e["id"].as_u64().is_some_and(|id| id > last_dropped))
        .cloned()
        .collect();
    ensure!(
        id_of(&replayed[0])? == last_dropped + 1,
        "{gap} then {}",
        replayed[0]
    );
    ensure!(replayed == expected, "{replayed:?}\n{expected:?}");
    ensure!(
        stdout_of(&recorded).len() > 4096,
        "the record keeps every event"
    );
    Ok(())
}

#[tokio::test]
async fn resume_reads_only_the_callers_executions() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = crate::tenants::secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .start()
        .await?;
    let a = V1Client::bearer(
        &gateway,
        &crate::tenants::hs256(&crate::tenants::claims("acme", "default")),
    );
    let b = V1Client::bearer(
        &gateway,
        &crate::tenants::hs256(&crate::tenants::claims("globex", "default")),
    );
    let session = a.create_session(json!({})).await?;
    let result = a.execute(&session, "1 + 1").await?;
    let execution = result["execution_id"].as_str().context("execution_id")?;
    let path = format!("/v1/sessions/{session}/executions/{execution}");

    let mine = record(&a, &session, execution).await?;
    ensure!(mine["state"] == "done", "{mine}");
    ensure!(mine["result"] == result, "{mine}");
    ensure!(mine["code"] == "1 + 1", "{mine}");

    // Listed, for a client that lost the id; a limit out of range is refused.
    let (status, listed) = a.get(&format!("/v1/sessions/{session}/executions")).await?;
    ensure!(status == 200, "{status} {listed}");
    ensure!(
        listed
            == json!([{"execution_id": execution, "state": "done", "code": "1 + 1",
            "started": mine["started"], "status": "ok"}]),
        "{listed}"
    );
    for limit in ["0", "10001", "many"] {
        let (status, body) = a
            .get(&format!("/v1/sessions/{session}/executions?limit={limit}"))
            .await?;
        ensure!(status == 400, "limit {limit}: {status} {body}");
    }
    let (status, body) = b.get(&format!("/v1/sessions/{session}/executions")).await?;
    ensure!(
        status == 404 && body["code"] == "no_such_session",
        "{status} {body}"
    );

    // Another tenant's execution is missing, in JSON and as a stream.
    let (status, body) = b.get(&path).await?;
    ensure!(
        status == 404 && body["code"] == "no_such_session",
        "{status} {body}"
    );
    let streamed = b
        .request(Method::GET, &path)
        .header("Accept", "text/event-stream")
        .send()
        .await?;
    ensure!(streamed.status() == 404, "{}", streamed.status());

    // Unknown and malformed execution ids; an unknown session.
    for unknown in ["0123456789abcdef0123456789abcdef", "not-an-id", "..%2f"] {
        let (status, body) = a
            .get(&format!("/v1/sessions/{session}/executions/{unknown}"))
            .await?;
        ensure!(
            status == 404 && body["code"] == "no_such_execution",
            "{unknown}: {status} {body}"
        );
    }
    let (status, body) = a
        .get(&format!(
            "/v1/sessions/00000000-0000-0000-0000-000000000000/executions/{execution}"
        ))
        .await?;
    ensure!(
        status == 404 && body["code"] == "no_such_session",
        "{status} {body}"
    );
    // A Last-Event-ID that is not an id is refused rather than guessed at.
    let refused = a
        .request(Method::GET, &path)
        .header("Accept", "text/event-stream")
        .header("Last-Event-ID", "latest")
        .send()
        .await?;
    ensure!(refused.status() == 400, "{}", refused.status());
    Ok(())
}
