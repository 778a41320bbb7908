//! The concurrent-sessions quota (`concurrent_sessions`) through every surface that starts a
//! kernel: API v1 sessions, the one-shot execute, MCP's `new_session`, the Kernel Gateway
//! API (`POST /api/kernels`, what JupyterLab calls), and a dormant session started again: 429 `quota_exceeded` with the quota, its
//! limit and when it frees in the body, no `Retry-After` (a session's end is no time the
//! gateway knows), and a place again once a session ends. The CPU quota's test is
//! `store::a_tenant_past_its_cpu_quota_in_the_store_gets_429_naming_it` (it needs a ledger).

use anyhow::{bail, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::v1::{json_of, V1Client};
use crate::support::Gateway;
use crate::tenants::{claims, hs256, secret_file};

/// Asserts that `(status, body, retry_after)` is the concurrent-sessions quota's 429.
fn assert_session_quota(surface: &str, status: u16, body: &Value, retry_after: Option<&str>) {
    assert_eq!(status, 429, "{surface}: {body}");
    assert_eq!(body["code"], "quota_exceeded", "{surface}: {body}");
    assert_eq!(
        body["quota"]["name"], "concurrent_sessions",
        "{surface}: {body}"
    );
    assert_eq!(body["quota"]["limit"], 1, "{surface}: {body}");
    assert_eq!(body["quota"]["used"], 1.0, "{surface}: {body}");
    assert!(
        body["quota"].get("resets_at").is_none(),
        "{surface}: {body}"
    );
    assert!(
        body["quota"]["resets"]
            .as_str()
            .is_some_and(|r| r.contains("sessions ends")),
        "{surface}: {body}"
    );
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("concurrent_sessions") && message.contains("frees when"),
        "{surface}: {message}"
    );
    assert_eq!(
        retry_after, None,
        "{surface}: no time to retry after is known"
    );
}

/// `method path` with a JSON body as `bearer`: status, body, `Retry-After`.
async fn call(
    client: &V1Client<'_>,
    method: Method,
    path: &str,
    body: Value,
) -> Result<(u16, Value, Option<String>)> {
    let response = client.request(method, path).json(&body).send().await?;
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap_or("not text").to_owned());
    let (status, body) = json_of(response).await?;
    Ok((status, body, retry_after))
}

/// One JSON-RPC message to `/mcp` as `bearer` (in MCP session `mcp_id`): the answer's
/// headers and its JSON-RPC message (read from SSE when the server streams it).
async fn mcp(
    gateway: &Gateway,
    bearer: &str,
    mcp_id: Option<&str>,
    message: Value,
) -> Result<(reqwest::header::HeaderMap, Value)> {
    let mut request = reqwest::Client::new()
        .post(format!("{}/mcp", gateway.base))
        .header("Accept", "application/json, text/event-stream")
        .header("Authorization", format!("Bearer {bearer}"))
        .json(&message);
    if let Some(id) = mcp_id {
        request = request.header("Mcp-Session-Id", id);
    }
    let response = request.send().await?;
    let headers = response.headers().clone();
    let text = response.text().await?;
    if message.get("id").is_none() {
        return Ok((headers, Value::Null));
    }
    let data = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim)
        .find(|data| !data.is_empty())
        .unwrap_or(text.trim());
    Ok((headers, serde_json::from_str(data).context(text.clone())?))
}

/// MCP's `new_session` tool as `bearer`, in a fresh MCP session: its result.
async fn mcp_new_session(gateway: &Gateway, bearer: &str) -> Result<Value> {
    let (headers, _) = mcp(
        gateway,
        bearer,
        None,
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-03-26", "capabilities": {},
            "clientInfo": {"name": "quotas", "version": "1"}}}),
    )
    .await?;
    let id = headers
        .get("mcp-session-id")
        .context("no Mcp-Session-Id")?
        .to_str()?
        .to_owned();
    mcp(
        gateway,
        bearer,
        Some(&id),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    )
    .await?;
    let (_, answer) = mcp(
        gateway,
        bearer,
        Some(&id),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "new_session", "arguments": {}}}),
    )
    .await?;
    match answer.get("result") {
        Some(result) => Ok(result.clone()),
        None => bail!("no result: {answer}"),
    }
}

#[tokio::test]
async fn a_tenant_past_its_concurrent_sessions_gets_429_on_every_surface() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let config = dir.path().join("cellgate.toml");
    std::fs::write(&config, "[tenants.limits.acme]\nconcurrent_sessions = 1\n")?;
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .arg("--config")
        .arg(config.to_str().context("path")?)
        .start()
        .await?;
    let token = hs256(&claims("acme", "default"));
    let acme = V1Client::bearer(&gateway, &token);
    let umbrella = V1Client::bearer(&gateway, &hs256(&claims("umbrella", "default")));
    let id = acme.create_session(json!({})).await?;

    let (status, body, retry) = call(&acme, Method::POST, "/v1/sessions", json!({})).await?;
    assert_session_quota("POST /v1/sessions", status, &body, retry.as_deref());
    let (status, body, retry) =
        call(&acme, Method::POST, "/v1/execute", json!({"code": "1"})).await?;
    assert_session_quota("POST /v1/execute", status, &body, retry.as_deref());
    // JupyterLab shows the body's `message` in its "Error Starting Kernel" dialog.
    let (status, body, retry) = call(
        &acme,
        Method::POST,
        "/api/kernels",
        json!({"name": "python3"}),
    )
    .await?;
    assert_session_quota("POST /api/kernels", status, &body, retry.as_deref());
    let refused = mcp_new_session(&gateway, &token).await?;
    assert_eq!(refused["isError"], true, "{refused}");
    let text = refused["content"][0]["text"].as_str().unwrap_or_default();
    assert!(
        text.contains("concurrent_sessions") && text.contains("429 quota_exceeded"),
        "{text}"
    );
    // Another tenant, and the admin, are not held by acme's quota.
    umbrella.create_session(json!({})).await?;
    V1Client::new(&gateway).create_session(json!({})).await?;

    // The running session is not disturbed, and its end frees the place.
    assert_eq!(acme.run(&id, "1 + 1").await?.result.as_deref(), Some("2"));
    let deleted = acme
        .request(Method::DELETE, &format!("/v1/sessions/{id}"))
        .send()
        .await?;
    assert_eq!(deleted.status().as_u16(), 204);
    let (status, once, _) =
        call(&acme, Method::POST, "/v1/execute", json!({"code": "6 * 7"})).await?;
    assert_eq!(status, 200, "{once}");
    let again = acme.create_session(json!({})).await?;
    assert_ne!(again, id);
    Ok(())
}

#[tokio::test]
async fn reviving_a_dormant_session_counts_against_concurrent_sessions() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let state = dir.path().join("state");
    let config = dir.path().join("cellgate.toml");
    std::fs::write(&config, "[tenants.limits.acme]\nconcurrent_sessions = 1\n")?;
    let start = || {
        Gateway::builder()
            .arg("--state-dir")
            .arg(state.to_str().unwrap_or_default())
            .arg("--jwt-secret-file")
            .arg(secret.to_str().unwrap_or_default())
            .arg("--config")
            .arg(config.to_str().unwrap_or_default())
            .start()
    };
    let token = hs256(&claims("acme", "default"));
    let mut first = start().await?;
    let acme = V1Client::bearer(&first, &token);
    let dormant = acme.create_session(json!({})).await?;
    acme.run(&dormant, "x = 1").await?;
    first.child.kill()?;
    first.child.wait()?;
    drop(first);

    let second = start().await?;
    let acme = V1Client::bearer(&second, &token);
    // A dormant session holds no kernel: a new one fits.
    let live = acme.create_session(json!({})).await?;
    // Starting the dormant one again would make two.
    let (status, body, retry) = call(
        &acme,
        Method::POST,
        &format!("/v1/sessions/{dormant}/execute"),
        json!({"code": "1"}),
    )
    .await?;
    assert_session_quota(
        "reviving a dormant session",
        status,
        &body,
        retry.as_deref(),
    );
    assert_eq!(
        acme.get(&format!("/v1/sessions/{dormant}")).await?.1["state"],
        "dead",
        "still dormant"
    );
    let deleted = acme
        .request(Method::DELETE, &format!("/v1/sessions/{live}"))
        .send()
        .await?;
    assert_eq!(deleted.status().as_u16(), 204);
    assert_eq!(
        acme.run(&dormant, "1 + 1").await?.result.as_deref(),
        Some("2")
    );
    Ok(())
}
