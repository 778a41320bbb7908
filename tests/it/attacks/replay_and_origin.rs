//! Attacks on the HTTP edge: replay kernels that escape a tenant's caps, and cross-site or
//! DNS-rebinding requests against a gateway without a token (issue 13, items 1 and 4).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::Gateway;
use crate::tenants::{call, claims, hs256, secret_file};

/// An nbformat 4.5 notebook of one code cell.
fn notebook(code: &str) -> Value {
    json!({
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": [{"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": null,
                   "outputs": [], "source": code}]
    })
}

/// The ids of the kernels `bearer` lists.
async fn listed(gateway: &Gateway, bearer: &str) -> Result<Vec<String>> {
    let (status, list) = call(gateway, bearer, Method::GET, "/api/kernels", None).await?;
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

    let (status, model) = call(
        &gateway,
        &acme,
        Method::POST,
        "/api/kernels",
        Some(json!({})),
    )
    .await?;
    ensure!(status == 201, "acme's first kernel: {status} {model}");
    let first = model["id"].as_str().context("id")?.to_owned();
    let (status, body) = call(
        &gateway,
        &acme,
        Method::POST,
        "/api/kernels",
        Some(json!({})),
    )
    .await?;
    ensure!(
        status == 403,
        "acme's second kernel must be refused: {status} {body}"
    );

    // At the cap, a replay is refused the same way, on both surfaces, and starts nothing.
    let quick = notebook("print(6 * 7)");
    for path in ["/api/notebooks/replay", "/v1/notebooks/replay"] {
        let (status, body) = call(&gateway, &acme, Method::POST, path, Some(quick.clone())).await?;
        ensure!(
            status == 403,
            "a replay at the tenant's cap must be refused like a new kernel ({path}): {status} {body}"
        );
    }
    ensure!(
        listed(&gateway, &acme).await? == vec![first.clone()],
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
        if let [id] = listed(&gateway, &acme).await?.as_slice() {
            break id.clone();
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the running replay's kernel never showed in its tenant's list"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(
        !listed(&gateway, &globex).await?.contains(&replay_kernel),
        "another tenant sees acme's replay kernel"
    );
    let (status, body) = call(
        &gateway,
        &acme,
        Method::POST,
        "/api/kernels",
        Some(json!({})),
    )
    .await?;
    ensure!(
        status == 403,
        "a running replay holds acme's only place: a new kernel must be refused: {status} {body}"
    );
    let (status, body) = call(
        &gateway,
        &globex,
        Method::POST,
        "/api/kernels",
        Some(json!({})),
    )
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
        listed(&gateway, &acme).await?.is_empty(),
        "the replay kernel is shut down after"
    );
    let (status, body) = call(
        &gateway,
        &acme,
        Method::POST,
        "/api/kernels",
        Some(json!({})),
    )
    .await?;
    ensure!(
        status == 201,
        "acme's place is free after the replay: {status} {body}"
    );
    Ok(())
}
