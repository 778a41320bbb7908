//! What an operator watches: Prometheus metrics (counted from real kernels' executions,
//! starts and denials; readable by the admin only, or from the metrics listener), the
//! access log with request ids, and the readiness probe against a working and a broken
//! gateway.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::{eventually, Gateway, PATIENCE};
use crate::tenants::{claims, hs256, secret_file};

/// The samples of a Prometheus text exposition, by their series (name and labels as
/// printed).
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

pub(crate) fn sample(samples: &HashMap<String, f64>, series: &str) -> f64 {
    samples.get(series).copied().unwrap_or_else(|| {
        let family = series.split('{').next().unwrap_or(series);
        let known: Vec<&String> = samples.keys().filter(|k| k.starts_with(family)).collect();
        panic!("no series {series}; {family} has {known:?}")
    })
}

pub(crate) async fn scrape(gateway: &Gateway) -> Result<HashMap<String, f64>> {
    let response = gateway.request(Method::GET, "/metrics").send().await?;
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.text().await?;
    if status != 200 {
        bail!("/metrics: {status} {text}");
    }
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    Ok(samples(&text))
}

/// The metrics listener's address, from the line the gateway prints.
async fn metrics_address(gateway: &Gateway) -> Result<String> {
    let mut address = None;
    eventually(PATIENCE, || {
        address = gateway.stdout_lines().iter().find_map(|l| {
            l.strip_prefix("cellgate metrics on ")
                .map(|u| u.trim_end_matches("/metrics").to_owned())
        });
        address.is_some()
    })
    .await;
    address.context("the gateway printed no metrics address")
}

/// Executions, denials, starts, the pool, WebSockets and tenants, counted from real kernels;
/// `/metrics` answers the admin, refuses tenants and anonymous callers, and the metrics
/// listener serves it without a credential.
#[tokio::test]
async fn metrics_count_what_kernels_did_and_only_operators_read_them() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--pool-size", "1", "--metrics-listen", "127.0.0.1:0"])
        .start()
        .await?;
    let admin = V1Client::new(&gateway);
    // The pool's kernel: a start it serves is a pool hit.
    let mut pooled = false;
    eventually(Duration::from_secs(60), || {
        pooled = gateway.log().contains("kernel joined the warm pool");
        pooled
    })
    .await;
    assert!(pooled, "the pool never filled: {}", gateway.log());
    let before = scrape(&gateway).await?;
    let ok_before = before
        .get("cellgate_executions_total{policy=\"default\",outcome=\"ok\"}")
        .copied()
        .unwrap_or(0.0);

    let session = admin.create_session(json!({})).await?;
    let result = admin.execute(&session, "1+1").await?;
    assert_eq!(result["status"], "ok", "{result}");
    let result = admin.execute(&session, "1/0").await?;
    assert_eq!(result["status"], "error", "{result}");
    let result = admin
        .execute_with(
            &session,
            json!({"code": "import time\ntime.sleep(60)", "timeout_s": 1}),
        )
        .await?;
    assert_eq!(result["status"], "timeout", "{result}");
    // The default policy allows no package: pip asks the gateway's index, which refuses.
    let result = admin
        .execute(&session, "%pip install -q cg-not-allowed-anywhere")
        .await?;
    assert_eq!(result["status"], "denied", "{result}");

    // A tenant's kernel, counted under its tenant.
    let tenant = V1Client::bearer(&gateway, &hs256(&claims("acme", "default")));
    let tenant_session = tenant.create_session(json!({})).await?;
    let result = tenant.execute(&tenant_session, "2+2").await?;
    assert_eq!(result["status"], "ok", "{result}");

    // A kernel WebSocket is open while it is.
    let kernel = gateway.start_kernel().await?;
    let client = gateway.connect(&kernel, "ops-session", false).await?;
    // Counted by the socket's task, which may run a moment after the handshake.
    let mut open_now = 0.0;
    let deadline = std::time::Instant::now() + PATIENCE;
    while std::time::Instant::now() < deadline {
        open_now = sample(&scrape(&gateway).await?, "cellgate_websockets_open");
        if open_now == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(open_now, 1.0, "the open WebSocket is not counted");
    client.close().await;

    let after = scrape(&gateway).await?;
    let executions = |outcome: &str| {
        sample(
            &after,
            &format!("cellgate_executions_total{{policy=\"default\",outcome=\"{outcome}\"}}"),
        )
    };
    // `1+1` and the tenant's `2+2` (the session's own set-up runs no cell).
    assert_eq!(executions("ok") - ok_before, 2.0);
    assert_eq!(executions("error"), 1.0);
    assert_eq!(executions("timeout"), 1.0);
    assert_eq!(executions("denied"), 1.0);
    assert_eq!(executions("oom"), 0.0);
    assert_eq!(
        sample(
            &after,
            "cellgate_execution_seconds_count{policy=\"default\",outcome=\"timeout\"}"
        ),
        1.0
    );
    // The timed-out cell ran at least its 1 s timeout.
    assert_eq!(
        sample(
            &after,
            "cellgate_execution_seconds_bucket{policy=\"default\",outcome=\"timeout\",le=\"0.5\"}"
        ),
        0.0
    );
    assert!(
        sample(
            &after,
            "cellgate_denials_total{policy=\"default\",kind=\"package\"}"
        ) >= 1.0
    );
    assert!(sample(&after, "cellgate_pool_hits_total") >= 1.0);
    let backend = crate::support::forced_sandbox().unwrap_or_else(|| "namespaces".to_owned());
    assert!(
        sample(
            &after,
            &format!("cellgate_kernel_start_seconds_count{{policy=\"default\",backend=\"{backend}\",source=\"pool\"}}")
        ) >= 1.0
    );
    // Three kernels live (two sessions and the WebSocket's), the sessions' idle.
    let kernels = |state: &str| {
        sample(
            &after,
            &format!(
                "cellgate_kernels{{state=\"{state}\",policy=\"default\",backend=\"{backend}\"}}"
            ),
        )
    };
    let states = ["starting", "idle", "busy", "restarting", "dead"];
    let live: f64 = states.iter().map(|s| kernels(s)).sum();
    assert_eq!(live, 3.0, "{:?}", states.map(|s| (s, kernels(s))));
    // Saved to disk, counted apart (none here: the default policy does not hibernate).
    assert_eq!(kernels("hibernated"), 0.0);
    assert!(
        kernels("idle") >= 2.0,
        "{:?}",
        states.map(|s| (s, kernels(s)))
    );
    assert_eq!(
        sample(&after, "cellgate_tenant_kernels{tenant=\"acme\"}"),
        1.0
    );
    assert_eq!(sample(&after, "cellgate_pool_target"), 1.0);
    let mut open_now = 1.0;
    let deadline = std::time::Instant::now() + PATIENCE;
    while std::time::Instant::now() < deadline {
        open_now = sample(&scrape(&gateway).await?, "cellgate_websockets_open");
        if open_now == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(open_now, 0.0, "the closed WebSocket is still counted");
    assert!(
        sample(
            &after,
            "cellgate_http_requests_total{method=\"POST\",route=\"/v1/sessions/{id}/execute\",status=\"200\"}"
        ) >= 5.0
    );
    for series in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_cpu_seconds_total",
        "cellgate_connections_open",
        "cellgate_build_info{version=\"".to_owned().as_str(),
    ] {
        assert!(
            after.keys().any(|k| k.starts_with(series)),
            "{series} missing"
        );
    }

    // Only the admin reads them on the main listener.
    let (status, body) = tenant.get("/metrics").await?;
    assert_eq!(status, 403, "{body}");
    let anonymous = gateway
        .http
        .get(format!("{}/metrics", gateway.base))
        .send()
        .await?;
    assert_eq!(anonymous.status(), 401);
    // The metrics listener needs nothing, and serves the probes too.
    let address = metrics_address(&gateway).await?;
    let open = gateway
        .http
        .get(format!("{address}/metrics"))
        .send()
        .await?;
    assert_eq!(open.status(), 200);
    assert!(open.text().await?.contains("cellgate_executions_total"));
    let ready = gateway.http.get(format!("{address}/readyz")).send().await?;
    assert_eq!(ready.status(), 200);
    // Bound to loopback, it answers loopback names only (DNS rebinding).
    let rebound = gateway
        .http
        .get(format!("{address}/metrics"))
        .header("Host", "attacker.example")
        .send()
        .await?;
    assert_eq!(rebound.status(), 403);
    // And nothing else: no API on it.
    let api = gateway
        .http
        .get(format!("{address}/api/kernels"))
        .send()
        .await?;
    assert_eq!(api.status(), 404);
    Ok(())
}

/// A tenant over its rate is counted under its name.
#[tokio::test]
async fn rate_limited_requests_are_counted_per_tenant() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--tenant-rate", "0.01", "--tenant-burst", "2"])
        .start()
        .await?;
    let tenant = V1Client::bearer(&gateway, &hs256(&claims("globex", "default")));
    let mut refused = 0;
    for _ in 0..5 {
        let (status, _) = tenant.get("/v1/sessions").await?;
        if status == 429 {
            refused += 1;
        }
    }
    assert_eq!(refused, 3);
    let after = scrape(&gateway).await?;
    assert_eq!(
        sample(&after, "cellgate_rate_limited_total{tenant=\"globex\"}"),
        3.0
    );
    Ok(())
}

/// One JSON access line per request, with the route's template (never the raw path or
/// query, where a token can travel), its status, its tenant and its request id; a client's
/// plain id is kept and echoed, anything else replaced; the kernel's start lines carry the
/// id of the request that started it.
#[tokio::test]
async fn the_access_log_names_route_status_tenant_and_request_id() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--log-json")
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .start()
        .await?;
    let token = gateway.token.clone().context("token")?;
    // The token in the query, as some clients send it: it must not reach the log.
    let response = gateway
        .http
        .post(format!("{}/api/kernels?token={token}", gateway.base))
        .header("X-Request-Id", "start-7.a:b")
        .json(&json!({"name": "python3"}))
        .send()
        .await?;
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["x-request-id"], "start-7.a:b");
    let kernel: Value = response.json().await?;
    let id = kernel["id"].as_str().context("id")?.to_owned();
    // Hostile or oversize ids are replaced by the gateway's own.
    for bad in ["two words", "x\" status=\"200", &"a".repeat(200)] {
        let response = gateway
            .request(Method::GET, "/api/kernels")
            .header("X-Request-Id", bad)
            .send()
            .await?;
        let echoed = response.headers()["x-request-id"].to_str()?.to_owned();
        assert_ne!(echoed, bad);
        assert!(
            echoed.len() == 32 && echoed.chars().all(|c| c.is_ascii_hexdigit()),
            "{echoed}"
        );
    }
    let tenant = V1Client::bearer(&gateway, &hs256(&claims("acme", "default")));
    let (status, _) = tenant.get(&format!("/api/kernels/{id}")).await?;
    // Another tenant's kernel: a 404 like a missing one.
    assert_eq!(status, 404);
    // The kernel's boot finishes in the start request's span.
    let mut ready = false;
    eventually(Duration::from_secs(60), || {
        ready = gateway.log().contains("kernel ready");
        ready
    })
    .await;
    assert!(ready, "{}", gateway.log());

    let log = gateway.log();
    assert!(!log.contains(&token), "the token reached the log");
    let lines: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let access: Vec<&Value> = lines
        .iter()
        .filter(|l| l["target"] == "cellgate::access")
        .collect();
    let start = access
        .iter()
        .find(|l| l["span"]["request_id"] == "start-7.a:b")
        .with_context(|| format!("no access line for the start: {access:?}"))?;
    assert_eq!(start["fields"]["method"], "POST");
    assert_eq!(start["fields"]["route"], "/api/kernels");
    assert_eq!(start["fields"]["status"], 201);
    assert!(start["fields"]["latency_ms"].as_f64().is_some());
    let foreign = access
        .iter()
        .find(|l| l["fields"]["route"] == "/api/kernels/{id}")
        .context("no access line for the tenant's request")?;
    assert_eq!(foreign["fields"]["status"], 404);
    assert_eq!(foreign["span"]["tenant"], "acme");
    let booted = lines
        .iter()
        .find(|l| l["fields"]["message"] == "kernel ready")
        .context("no kernel ready line")?;
    assert_eq!(
        booted["span"]["request_id"], "start-7.a:b",
        "the kernel's start is not tied to its request: {booted}"
    );
    // Routes are templates: the kernel's id is in no access line.
    assert!(
        !access.iter().any(|l| l.to_string().contains(&id)),
        "{access:?}"
    );
    Ok(())
}

/// The access lines of `gateway`'s JSON log, by the request id each was sent with, once all
/// of `ids` have one.
async fn access_lines_of(gateway: &Gateway, ids: &[&str]) -> Result<HashMap<String, Value>> {
    let read = || -> HashMap<String, Value> {
        gateway
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|l| l["target"] == "cellgate::access")
            .filter_map(|l| Some((l["span"]["request_id"].as_str()?.to_owned(), l)))
            .collect()
    };
    // The line is written after the response, and read from the log by another thread.
    eventually(PATIENCE, || ids.iter().all(|id| read().contains_key(*id))).await;
    let lines = read();
    for id in ids {
        lines
            .get(*id)
            .with_context(|| format!("no access line for {id}: {}", gateway.log()))?;
    }
    Ok(lines)
}

/// Behind a trusted proxy (`--trusted-proxy 127.0.0.1`, the test's own address) the access
/// line names the client from `X-Forwarded-For` as `peer` (the rightmost address that is
/// not a trusted proxy) and the proxy as `via`; without the header, or with a malformed
/// entry, the peer itself. A gateway that trusts no proxy ignores the header.
#[tokio::test]
async fn the_access_log_names_the_client_behind_a_trusted_proxy_only() -> Result<()> {
    // (request id, X-Forwarded-For, expected peer, expected via)
    let trusted_cases: &[(&str, Option<&str>, &str, Option<&str>)] = &[
        (
            "xff-one",
            Some("198.51.100.7"),
            "198.51.100.7",
            Some("127.0.0.1"),
        ),
        (
            "xff-chain",
            Some("1.2.3.4, 198.51.100.7"),
            "198.51.100.7",
            Some("127.0.0.1"),
        ),
        // nginx's own entry (a trusted address) is skipped.
        (
            "xff-hops",
            Some("1.2.3.4, 198.51.100.7, 127.0.0.1"),
            "198.51.100.7",
            Some("127.0.0.1"),
        ),
        ("xff-none", None, "127.0.0.1", None),
        (
            "xff-garbage",
            Some("198.51.100.7, unknown"),
            "127.0.0.1",
            None,
        ),
    ];
    let gateway = Gateway::builder()
        .args(&["--log-json", "--trusted-proxy", "127.0.0.1"])
        .start()
        .await?;
    let plain = Gateway::builder().arg("--log-json").start().await?;
    for (id, forwarded, _, _) in trusted_cases {
        for gateway in [&gateway, &plain] {
            let mut request = gateway
                .request(Method::GET, "/api/kernelspecs")
                .header("X-Request-Id", *id);
            if let Some(forwarded) = forwarded {
                request = request.header("X-Forwarded-For", *forwarded);
            }
            let status = request.send().await?.status();
            assert_eq!(status, 200, "{id}");
        }
    }
    let ids: Vec<&str> = trusted_cases.iter().map(|case| case.0).collect();
    let lines = access_lines_of(&gateway, &ids).await?;
    for (id, forwarded, peer, via) in trusted_cases {
        let fields = &lines[*id]["fields"];
        assert_eq!(fields["peer"], *peer, "{id} ({forwarded:?}): {fields}");
        match via {
            Some(via) => assert_eq!(fields["via"], *via, "{id}: {fields}"),
            None => assert!(fields.get("via").is_none(), "{id}: {fields}"),
        }
    }
    // Not trusted: the header changes nothing, whatever it says.
    let lines = access_lines_of(&plain, &ids).await?;
    for (id, _, _, _) in trusted_cases {
        let fields = &lines[*id]["fields"];
        assert_eq!(fields["peer"], "127.0.0.1", "{id}: {fields}");
        assert!(fields.get("via").is_none(), "{id}: {fields}");
    }
    Ok(())
}

/// Ready once the pool holds its kernel and the backends passed their check; a gateway
/// whose pool cannot start a kernel, and one of whose policies' backends cannot run here,
/// answers 503 saying both. `/healthz` answers in both.
#[tokio::test]
async fn readiness_waits_for_the_pool_and_the_backends_and_says_what_is_missing() -> Result<()> {
    let gateway = Gateway::builder()
        .args(&["--pool-size", "1"])
        .start()
        .await?;
    let mut answer = (0, Value::Null);
    for _ in 0..120 {
        answer = gateway.get_json("/readyz").await?;
        if answer.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(answer.0, 200, "{}", answer.1);
    assert_eq!(answer.1["ready"], true);
    assert_eq!(answer.1["pool"]["target"], 1);
    assert_eq!(answer.1["pool"]["filled"], true);
    let backend = crate::support::forced_sandbox().unwrap_or_else(|| "namespaces".to_owned());
    assert_eq!(answer.1["backends"][&backend]["ok"], true, "{}", answer.1);
    assert!(scrape(&gateway).await?.get("cellgate_ready") == Some(&1.0));
    let anonymous: Value = gateway
        .http
        .get(format!("{}/readyz", gateway.base))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(anonymous["ready"], true);
    assert!(anonymous.get("backends").is_none(), "{anonymous}");

    // Broken: the default kernelspec cannot start, and a policy names microVMs with no
    // guest images.
    let dir = tempfile::tempdir()?;
    let kernels = dir.path().join("kernels");
    std::fs::create_dir_all(kernels.join("python3"))?;
    std::fs::write(
        kernels.join("python3/kernel.json"),
        json!({"argv": ["/bin/false", "{connection_file}"], "display_name": "broken", "language": "python"}).to_string(),
    )?;
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies)?;
    std::fs::copy(
        crate::support::repo().join("policies/default.toml"),
        policies.join("default.toml"),
    )?;
    std::fs::write(
        policies.join("vm.toml"),
        "description = \"microVMs\"\n[sandbox]\nbackend = \"microvm\"\n",
    )?;
    let broken = Gateway::builder()
        .kernels_dir(kernels)
        .policies_dir(policies)
        .args(&["--pool-size", "1", "--start-timeout", "5"])
        .arg("--guest-dir")
        .arg(dir.path().join("no-guest").to_str().context("path")?)
        .start()
        .await?;
    let forced = crate::support::forced_sandbox();
    let mut answer = (0, Value::Null);
    for _ in 0..120 {
        answer = broken.get_json("/readyz").await?;
        // Both the pool's failure and the backends' first check, which runs beside it.
        let checked = forced.is_some() || !answer.1["backends"]["microvm"].is_null();
        if checked
            && answer.1["waiting_for"]
                .to_string()
                .contains("failed to start")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // As the admin (the test's token): with the details.
    assert_eq!(answer.0, 503, "{}", answer.1);
    assert_eq!(answer.1["ready"], false);
    let waiting = answer.1["waiting_for"].to_string();
    assert!(
        waiting.contains("the warm pool is empty and its last kernel failed to start: "),
        "{waiting}"
    );
    assert_eq!(answer.1["pool"]["filled"], false);
    assert!(answer.1["pool"]["last_error"].is_string(), "{}", answer.1);
    match &forced {
        // A forced backend replaces the policy's own: no microVM is asked for.
        Some(backend) => eprintln!(
            "*** --sandbox {backend} is forced: the microvm policy's degraded backend is not checked ***"
        ),
        None => {
            // Another policy's backend that cannot run is reported, and does not make the
            // gateway unready (the pool does, here).
            assert_eq!(answer.1["backends"]["microvm"]["ok"], false, "{}", answer.1);
            let degraded = answer.1["degraded"].to_string();
            assert!(degraded.contains("sandbox backend microvm cannot launch kernels: "), "{degraded}");
            assert!(!waiting.contains("microvm"), "{waiting}");
        }
    }
    // Anyone else gets the verdict without the host's details.
    let anonymous: Value = broken
        .http
        .get(format!("{}/readyz", broken.base))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(anonymous["ready"], false);
    assert!(anonymous.get("backends").is_none(), "{anonymous}");
    assert!(anonymous["pool"].get("last_error").is_none(), "{anonymous}");
    assert!(
        anonymous["waiting_for"]
            .to_string()
            .contains("its last kernel failed to start\""),
        "{anonymous}"
    );
    let health = broken
        .http
        .get(format!("{}/healthz", broken.base))
        .send()
        .await?;
    assert_eq!(health.status(), 200);
    assert_eq!(health.text().await?, "ok");
    assert_eq!(scrape(&broken).await?.get("cellgate_ready"), Some(&0.0));
    Ok(())
}

/// A pool whose kernel failed to start tries again by itself, backing off, so a gateway
/// that was unready (a host busy at boot, a missing file since put back) becomes ready
/// with no client starting a kernel. The kernelspec fails until a marker file exists; the
/// development backend runs it, so the test can create the marker where it looks.
#[tokio::test]
async fn a_failed_pool_start_is_retried_until_the_gateway_is_ready() -> Result<()> {
    if let Some(backend) = crate::support::forced_sandbox() {
        eprintln!(
            "\n*** --sandbox {backend} is forced: this test needs the development backend (its kernelspec reads a file the test creates on the host); NOT RUN ***\n"
        );
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let spec = dir.path().join("kernels/python3");
    std::fs::create_dir_all(&spec)?;
    std::os::unix::fs::symlink(
        crate::support::kernels_dir().join("python3/.venv"),
        spec.join(".venv"),
    )?;
    let marker = dir.path().join("ready-marker");
    std::fs::write(
        spec.join("kernel.json"),
        json!({
            "argv": [
                "/bin/sh", "-c",
                format!("test -e {} || exit 3; exec \"$0\" -m cellgate_kernel_launcher -f \"$1\"", marker.display()),
                "{prefix}/bin/python", "{connection_file}"
            ],
            "display_name": "fails until the marker exists",
            "language": "python"
        })
        .to_string(),
    )?;
    let gateway = Gateway::builder()
        .kernels_dir(dir.path().join("kernels"))
        .args(&["--pool-size", "1", "--sandbox", "process"])
        .start()
        .await?;
    let mut answer = (0, Value::Null);
    for _ in 0..240 {
        answer = gateway.get_json("/readyz").await?;
        if answer.1["waiting_for"]
            .to_string()
            .contains("failed to start")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(answer.0, 503, "{}", answer.1);
    std::fs::write(&marker, "")?;
    // The back-off is at most 60 s; nothing but probes reaches the gateway meanwhile.
    for _ in 0..240 {
        answer = gateway.get_json("/readyz").await?;
        if answer.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(answer.0, 200, "{}\n{}", answer.1, gateway.log());
    assert_eq!(answer.1["pool"]["ready"], 1);
    let log = gateway.log();
    assert!(log.contains("could not start a pool kernel"), "{log}");
    assert!(log.contains("kernel joined the warm pool"), "{log}");
    let metrics = scrape(&gateway).await?;
    assert_eq!(sample(&metrics, "cellgate_pool_hits_total"), 0.0);
    assert!(
        sample(
            &metrics,
            "cellgate_kernel_start_failures_total{policy=\"default\",backend=\"process\",source=\"refill\"}"
        ) >= 1.0
    );
    Ok(())
}
