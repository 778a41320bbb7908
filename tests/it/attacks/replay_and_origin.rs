//! Attacks on the HTTP edge: replay kernels that escape a tenant's caps, and cross-site or
//! DNS-rebinding requests against a gateway without a token (issue 13, items 1 and 4).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::Gateway;
use crate::tenants::{claims, hs256, secret_file};

/// An nbformat 4.5 notebook of one code cell.
fn notebook(code: &str) -> Value {
    json!({
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": [{"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": null,
                   "outputs": [], "source": code}]
    })
}

/// The ids of the kernels `tenant` lists.
async fn listed(tenant: &V1Client<'_>) -> Result<Vec<String>> {
    let (status, list) = tenant.call(Method::GET, "/api/kernels", None).await?;
    ensure!(status == 200, "listing kernels: {status} {list}");
    Ok(list
        .as_array()
        .context("a list")?
        .iter()
        .filter_map(|k| k["id"].as_str().map(str::to_owned))
        .collect())
}

/// A tenant at its kernel cap is refused a replay exactly as a new kernel (403), on both
/// surfaces; a replay kernel is the caller's while it runs (listed for it, not for another
/// tenant) and holds a place under the caller's cap, so replays cannot lock others out.
#[tokio::test]
async fn replay_kernels_count_against_the_tenants_cap() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--tenant-max-kernels", "1", "--pool-size", "0"])
        .start()
        .await?;
    let acme = hs256(&claims("acme", "default"));
    let globex = hs256(&claims("globex", "default"));
    let (as_acme, as_globex) = (
        V1Client::bearer(&gateway, &acme),
        V1Client::bearer(&gateway, &globex),
    );

    let (status, model) = as_acme
        .call(Method::POST, "/api/kernels", Some(json!({})))
        .await?;
    ensure!(status == 201, "acme's first kernel: {status} {model}");
    let first = model["id"].as_str().context("id")?.to_owned();
    let (status, body) = as_acme
        .call(Method::POST, "/api/kernels", Some(json!({})))
        .await?;
    ensure!(
        status == 403,
        "acme's second kernel must be refused: {status} {body}"
    );

    // At the cap, a replay is refused the same way, on both surfaces, and starts nothing;
    // also when the client asks for a stream of events (the refusal is the status, not an
    // event inside a 200 stream).
    let quick = notebook("print(6 * 7)");
    for path in ["/api/notebooks/replay", "/v1/notebooks/replay"] {
        let (status, body) = as_acme
            .call(Method::POST, path, Some(quick.clone()))
            .await?;
        ensure!(
            status == 403,
            "a replay at the tenant's cap must be refused like a new kernel ({path}): {status} {body}"
        );
        let response = gateway
            .http
            .post(format!("{}{path}", gateway.base))
            .header("Authorization", format!("Bearer {acme}"))
            .header("Accept", "text/event-stream")
            .json(&quick)
            .send()
            .await?;
        let status = response.status().as_u16();
        let body = response.text().await?;
        ensure!(
            status == 403,
            "a streamed replay at the tenant's cap must be refused with 403 ({path}): {status} {body}"
        );
    }
    ensure!(
        listed(&as_acme).await? == vec![first.clone()],
        "nothing new for acme"
    );

    // Below the cap, the replay kernel is acme's while it runs, and fills acme's place.
    ensure!(gateway.delete_kernel(&first).await? == 204, "delete");
    let slow = notebook("import time\ntime.sleep(4)\nprint('done')");
    let replay = {
        let (gateway_http, base, acme) = (gateway.http.clone(), gateway.base.clone(), acme.clone());
        tokio::spawn(async move {
            let response = gateway_http
                .post(format!("{base}/api/notebooks/replay"))
                .header("Authorization", format!("Bearer {acme}"))
                .json(&slow)
                .send()
                .await?;
            let status = response.status().as_u16();
            anyhow::Ok((status, response.json::<Value>().await?))
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let replay_kernel = loop {
        if let [id] = listed(&as_acme).await?.as_slice() {
            break id.clone();
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the running replay's kernel never showed in its tenant's list"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(
        !listed(&as_globex).await?.contains(&replay_kernel),
        "another tenant sees acme's replay kernel"
    );
    let (status, body) = as_acme
        .call(Method::POST, "/api/kernels", Some(json!({})))
        .await?;
    ensure!(
        status == 403,
        "a running replay holds acme's only place: a new kernel must be refused: {status} {body}"
    );
    let (status, body) = as_globex
        .call(Method::POST, "/api/kernels", Some(json!({})))
        .await?;
    ensure!(
        status == 201,
        "globex is not locked out by acme's replay: {status} {body}"
    );

    let (status, answer) = replay.await??;
    ensure!(
        status == 200,
        "the replay below the cap runs: {status} {answer}"
    );
    ensure!(answer["matched"].is_boolean(), "a replay report: {answer}");
    // The replay's kernel is gone with it, and acme's place is free again.
    ensure!(
        listed(&as_acme).await?.is_empty(),
        "the replay kernel is shut down after"
    );
    let (status, body) = as_acme
        .call(Method::POST, "/api/kernels", Some(json!({})))
        .await?;
    ensure!(
        status == 201,
        "acme's place is free after the replay: {status} {body}"
    );
    Ok(())
}

/// A raw request to the gateway with the given headers (no credential); status and body.
async fn raw(
    gateway: &Gateway,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Result<(u16, String)> {
    let mut request = reqwest::Client::new().request(method, format!("{}{path}", gateway.base));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(body) = body {
        request = request.body(body.to_owned());
    }
    let response = request.send().await?;
    Ok((response.status().as_u16(), response.text().await?))
}

/// How many kernels the gateway runs, asked the legitimate way.
async fn kernel_count(gateway: &Gateway) -> Result<usize> {
    let (status, list) = raw(gateway, Method::GET, "/api/kernels", &[], None).await?;
    ensure!(
        status == 200,
        "listing kernels from loopback: {status} {list}"
    );
    Ok(serde_json::from_str::<Value>(&list)?
        .as_array()
        .context("a list")?
        .len())
}

/// The status of a kernel channels WebSocket opened with these Host and Origin headers.
async fn ws_status(gateway: &Gateway, kernel: &str, host: &str, origin: &str) -> Result<u16> {
    gateway
        .ws_upgrade_status(kernel, &[("Host", host), ("Origin", origin)])
        .await
}

/// Without a token, a page elsewhere cannot drive the gateway: a cross-site `text/plain` POST
/// runs nothing, a rebound host name (DNS rebinding) lists and starts nothing and opens no
/// WebSocket, and a foreign Origin is refused; loopback names and origins, and the origins
/// named with `--allow-origin`, keep working.
#[tokio::test]
async fn no_token_gateway_refuses_cross_site_and_rebound_requests() -> Result<()> {
    let gateway = Gateway::builder()
        .token(None)
        .args(&["--allow-origin", "https://app.example"])
        .start()
        .await?;
    let port = gateway.port;
    let code = r#"{"code": "print('ran', 6 * 7)"}"#;

    // A form or fetch from any site may POST text/plain without a preflight.
    let (status, body) = raw(
        &gateway,
        Method::POST,
        "/v1/execute",
        &[
            ("Content-Type", "text/plain"),
            ("Origin", "https://evil.example"),
        ],
        Some(code),
    )
    .await?;
    ensure!(
        (400..500).contains(&status) && !body.contains("ran 42"),
        "a cross-site text/plain POST must run nothing: {status} {body}"
    );
    // Even from a loopback page, a body that is not declared JSON is refused (415).
    let (status, body) = raw(
        &gateway,
        Method::POST,
        "/v1/execute",
        &[("Content-Type", "text/plain")],
        Some(code),
    )
    .await?;
    ensure!(
        status == 415,
        "a text/plain body is refused: {status} {body}"
    );
    // A JSON POST from a foreign origin is refused too.
    let (status, body) = raw(
        &gateway,
        Method::POST,
        "/v1/execute",
        &[
            ("Content-Type", "application/json"),
            ("Origin", "https://evil.example"),
        ],
        Some(code),
    )
    .await?;
    ensure!(
        status == 403 && !body.contains("ran 42"),
        "foreign origin: {status} {body}"
    );
    ensure!(
        kernel_count(&gateway).await? == 0,
        "nothing was started by refused requests"
    );

    // DNS rebinding: the page's own name now resolves to 127.0.0.1.
    let rebound = format!("rebind.evil.example:{port}");
    let rebound_origin = format!("http://{rebound}");
    let rebinding = [
        ("Host", rebound.as_str()),
        ("Origin", rebound_origin.as_str()),
    ];
    let (status, body) = raw(&gateway, Method::GET, "/api/kernels", &rebinding, None).await?;
    ensure!(
        status == 403,
        "a rebound name must not list kernels: {status} {body}"
    );
    let (status, body) = raw(&gateway, Method::GET, "/api/kernels", &rebinding[..1], None).await?;
    ensure!(
        status == 403,
        "a rebound name without Origin must not list kernels: {status} {body}"
    );
    let mut json_rebinding = rebinding.to_vec();
    json_rebinding.push(("Content-Type", "application/json"));
    let (status, body) = raw(
        &gateway,
        Method::POST,
        "/api/kernels",
        &json_rebinding,
        Some("{}"),
    )
    .await?;
    ensure!(
        status == 403,
        "a rebound name must not start kernels: {status} {body}"
    );
    let (status, body) = raw(
        &gateway,
        Method::POST,
        "/v1/execute",
        &json_rebinding,
        Some(code),
    )
    .await?;
    ensure!(
        status == 403 && !body.contains("ran 42"),
        "rebound execute: {status} {body}"
    );
    ensure!(
        kernel_count(&gateway).await? == 0,
        "the rebound requests started nothing"
    );

    // The legitimate ways still work: loopback names and origins, and the allowed origin.
    let loopback_origin = format!("http://127.0.0.1:{port}");
    for origin in [loopback_origin.as_str(), "https://app.example"] {
        let (status, body) = raw(
            &gateway,
            Method::POST,
            "/v1/execute",
            &[("Content-Type", "application/json"), ("Origin", origin)],
            Some(code),
        )
        .await?;
        ensure!(
            status == 200 && body.contains("ran 42"),
            "from {origin}: {status} {body}"
        );
    }
    let localhost = format!("localhost:{port}");
    let (status, body) = raw(
        &gateway,
        Method::GET,
        "/api/kernels",
        &[("Host", localhost.as_str())],
        None,
    )
    .await?;
    ensure!(status == 200, "Host localhost is served: {status} {body}");
    let (status, _) = raw(&gateway, Method::GET, "/", &rebinding, None).await?;
    ensure!(
        status == 403,
        "the page is not served under a rebound name either"
    );

    // The WebSocket: a rebound Host with its matching Origin used to pass the origin check.
    let kernel = gateway.start_kernel().await?;
    let loopback_host = format!("127.0.0.1:{port}");
    let status = ws_status(&gateway, &kernel, &rebound, &rebound_origin).await?;
    ensure!(
        status == 403,
        "a rebound WebSocket must be refused: {status}"
    );
    let status = ws_status(&gateway, &kernel, &loopback_host, "https://evil.example").await?;
    ensure!(
        status == 403,
        "a foreign origin's WebSocket must be refused: {status}"
    );
    let status = ws_status(&gateway, &kernel, &loopback_host, &loopback_origin).await?;
    ensure!(
        status == 101,
        "the gateway's own page opens its WebSocket: {status}"
    );
    let status = ws_status(&gateway, &kernel, &loopback_host, "https://app.example").await?;
    ensure!(
        status == 101,
        "an --allow-origin page opens its WebSocket: {status}"
    );
    Ok(())
}

/// `--allow-origin '*'` without a token would open the gateway to every page: refused at
/// start-up with a clear error.
#[test]
fn any_origin_without_a_token_is_refused_at_start_up() -> Result<()> {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .args(["serve", "--port", "0", "--allow-origin", "*"])
        .env_remove("CELLGATE_AUTH_TOKEN")
        .env_remove("KG_AUTH_TOKEN")
        .env_remove("CELLGATE_CONFIG")
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(!output.status.success(), "it must not start: {stderr}");
    ensure!(stderr.contains("allow_origin `*`"), "says why: {stderr}");
    Ok(())
}
