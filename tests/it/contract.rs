//! API v1's contract with the clients generated from it: the OpenAPI document is valid
//! (openapi-spec-validator), a live gateway answers what it says (a bounded schemathesis
//! run), and every error is the same JSON body with a stable code and the headers a client
//! acts on. Against a real gateway with real kernels in the default sandbox.

use std::collections::HashSet;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::{tools_python, Gateway};

/// A program of the tools environment (beside its Python).
fn tool(name: &str) -> PathBuf {
    let python = tools_python();
    let program = python.with_file_name(name);
    assert!(
        program.exists(),
        "{} is missing: `./dev setup` installs it into the tools environment",
        program.display()
    );
    program
}

/// Runs `program` with `args` (at most `limit` seconds) in a scratch directory (schemathesis
/// keeps a cache where it runs); its exit status and output.
async fn run(program: &PathBuf, args: &[&str], limit: u64) -> Result<(bool, String)> {
    let scratch = tempfile::tempdir()?;
    let output = tokio::time::timeout(
        std::time::Duration::from_secs(limit),
        tokio::process::Command::new(program)
            .args(args)
            .current_dir(scratch.path())
            .env("NO_COLOR", "1")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .with_context(|| format!("{} ran over {limit} s", program.display()))??;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((output.status.success(), text))
}

/// The document is served without a credential (it holds no secret) and is valid OpenAPI;
/// every operation has its own id, and every error status it declares has the error body.
#[tokio::test]
async fn the_openapi_document_is_public_and_valid() -> Result<()> {
    let gateway = Gateway::start().await?;
    let response = gateway
        .http
        .get(format!("{}/v1/openapi.json", gateway.base))
        .send()
        .await?;
    ensure!(response.status() == 200, "{}", response.status());
    let document: Value = response.json().await?;
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), serde_json::to_vec(&document)?)?;
    let (valid, output) = run(
        &tool("openapi-spec-validator"),
        &[file.path().to_str().context("path")?],
        60,
    )
    .await?;
    ensure!(
        valid,
        "openapi-spec-validator refuses the document:\n{output}"
    );

    let mut ids = HashSet::new();
    for (path, item) in document["paths"].as_object().context("paths")? {
        for (method, operation) in item.as_object().context("path item")? {
            let id = operation["operationId"].as_str().context("operationId")?;
            ensure!(ids.insert(id.to_owned()), "operationId {id} twice");
            if path == "/v1/openapi.json" {
                ensure!(operation["security"] == json!([]), "{operation}");
                continue;
            }
            let responses = operation["responses"].as_object().context("responses")?;
            // A signed link is its own credential: public, and never a 401.
            let public = path == "/v1/artifacts/{id}/signed";
            if public {
                ensure!(operation["security"] == json!([]), "{operation}");
                ensure!(!responses.contains_key("401"), "{method} {path}: a 401");
            }
            for status in ["401", "429", "500"]
                .into_iter()
                .filter(|s| !(public && *s == "401"))
            {
                ensure!(
                    responses.contains_key(status),
                    "{method} {path}: no {status}"
                );
            }
            for (status, response) in responses {
                if status.starts_with('4') || status.starts_with('5') {
                    ensure!(
                        response.pointer("/content/application~1json/schema/$ref")
                            == Some(&json!("#/components/schemas/ErrorBody")),
                        "{method} {path} {status}: {response}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// A bounded schemathesis run (its coverage, fuzzing and stateful phases, a few examples
/// per operation, a fixed seed) against a live gateway finds no response that disagrees
/// with the document: no undocumented status or media type, no body off its schema, no
/// server error, no malformed request accepted, no wrong answer to a method a route does
/// not take. Its check that every schema-valid request succeeds is left out: names of
/// policies and kernelspecs, the env allowlist and workspace paths are checked by the
/// gateway against its configuration, which a schema cannot list.
#[tokio::test]
async fn a_live_gateway_answers_what_its_document_says() -> Result<()> {
    let gateway = Gateway::start().await?;
    let token = gateway.token.clone().context("token")?;
    let url = format!("{}/v1/openapi.json", gateway.base);
    let authorization = format!("Authorization: token {token}");
    let (passed, output) = run(
        &tool("schemathesis"),
        &[
            "run",
            &url,
            "--header",
            &authorization,
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
            "--max-examples",
            "6",
            "--seed",
            "20261127",
            "--phases",
            "examples,coverage,fuzzing,stateful",
        ],
        600,
    )
    .await?;
    ensure!(
        passed,
        "schemathesis found responses that disagree with the document:\n{output}\n\ngateway log:\n{}",
        gateway.log()
    );
    ensure!(
        output.contains("passed"),
        "schemathesis ran no test:\n{output}"
    );
    Ok(())
}

/// The error body of `response`, checked: `reason` is the status's phrase, `message` says
/// something, `code` is the one expected.
async fn error_of(response: reqwest::Response, status: u16, code: &str) -> Result<Value> {
    let got = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = response.text().await?;
    ensure!(got == status, "{got} (not {status}): {body}");
    ensure!(content_type == "application/json", "{content_type}: {body}");
    let body: Value = serde_json::from_str(&body).with_context(|| body.clone())?;
    let reason = reqwest::StatusCode::from_u16(status)?
        .canonical_reason()
        .unwrap_or_default();
    ensure!(body["reason"] == reason, "{body}");
    ensure!(body["code"] == code, "{body}");
    ensure!(
        body["message"].as_str().is_some_and(|m| m.len() > 5),
        "{body}"
    );
    Ok(body)
}

/// Every error a client meets is the JSON body with its code, and carries the header that
/// says what to do next.
#[tokio::test]
async fn errors_are_one_body_with_a_code_and_the_headers_to_act_on() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let url = |path: &str| format!("{}{path}", gateway.base);

    // No credential, and a wrong one: 401 saying how to authenticate.
    let response = gateway.http.get(url("/v1/sessions")).send().await?;
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    error_of(response, 401, "missing_token").await?;
    ensure!(
        challenge.as_deref() == Some("Bearer realm=\"cellgate\""),
        "{challenge:?}"
    );
    let response = gateway
        .http
        .get(url("/v1/sessions"))
        .header("Authorization", "token not-the-token")
        .send()
        .await?;
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    error_of(response, 401, "invalid_token").await?;
    ensure!(
        challenge
            .as_deref()
            .is_some_and(|c| c.contains("error=\"invalid_token\"")),
        "{challenge:?}"
    );

    // A route that does not exist, a method a route does not take (whatever the body).
    let response = v1.request(Method::GET, "/v1/nowhere").send().await?;
    error_of(response, 404, "no_such_route").await?;
    let response = v1
        .request(Method::PATCH, "/v1/sessions/x/files/a.txt")
        .header("Content-Type", "text/plain")
        .body("x")
        .send()
        .await?;
    let allow = response
        .headers()
        .get("allow")
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    error_of(response, 405, "method_not_allowed").await?;
    ensure!(
        allow.as_deref().is_some_and(|a| a.contains("PUT")),
        "{allow:?}"
    );

    // Bodies: not declared JSON, not an object, malformed.
    let response = v1
        .request(Method::POST, "/v1/sessions")
        .header("Content-Type", "text/plain")
        .body("{}")
        .send()
        .await?;
    error_of(response, 415, "not_json").await?;
    for body in ["[null, null]", "{\"kernel_name\": ", "\"x\""] {
        let response = v1
            .request(Method::POST, "/v1/sessions")
            .header("Content-Type", "application/json")
            .body(body)
            .send()
            .await?;
        error_of(response, 400, "invalid_json").await?;
    }
    // An environment variable the gateway does not let clients set is named, not dropped.
    let response = v1
        .request(Method::POST, "/v1/sessions")
        .json(&json!({"env": {"KERNEL_FINE": "1", "LD_PRELOAD": "/tmp/x.so"}}))
        .send()
        .await?;
    let body = error_of(response, 400, "env_not_allowed").await?;
    ensure!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("LD_PRELOAD") && !m.contains("KERNEL_FINE")),
        "{body}"
    );
    let (status, sessions) = v1.get("/v1/sessions").await?;
    ensure!(
        status == 200 && sessions == json!([]),
        "a refused session was made: {sessions}"
    );

    // A session that does not exist, an input nobody waits for.
    let response = v1.request(Method::GET, "/v1/sessions/nope").send().await?;
    error_of(response, 404, "no_such_session").await?;
    let id = v1.create_session(json!({})).await?;
    let response = v1
        .request(Method::POST, &format!("/v1/sessions/{id}/input"))
        .json(&json!({"value": "x"}))
        .send()
        .await?;
    error_of(response, 409, "no_input_awaited").await?;
    // Ids are parsed (crate::ids), but a malformed one answers as an unknown one does.
    for execution in ["nope", "0123456789abcdef0123456789abcdef"] {
        let response = v1
            .request(Method::POST, &format!("/v1/sessions/{id}/input"))
            .json(&json!({"value": "x", "execution_id": execution}))
            .send()
            .await?;
        error_of(response, 409, "no_input_awaited").await?;
    }
    for session in [
        "bc240c7a-232d-46b9-87f3-1a30b514780b".to_owned(),
        id.to_uppercase(),
    ] {
        let response = v1
            .request(Method::GET, &format!("/v1/sessions/{session}"))
            .send()
            .await?;
        error_of(response, 404, "no_such_session").await?;
    }

    // An artifact a client holds (its ETag) is not sent again.
    let r = v1
        .execute(
            &id,
            "from IPython.display import HTML, display\ndisplay(HTML('<b>kept</b>'))",
        )
        .await?;
    let artifact = r["artifacts"][0]["id"]
        .as_str()
        .with_context(|| format!("no artifact: {r}"))?
        .to_owned();
    let response = v1.artifact(&artifact).await?;
    let etag = response
        .headers()
        .get("etag")
        .context("no ETag")?
        .to_str()?
        .to_owned();
    ensure!(response.text().await? == "<b>kept</b>");
    for tag in [
        etag.clone(),
        format!("W/{etag}"),
        format!("\"other\", {etag}"),
    ] {
        let response = v1
            .request(Method::GET, &format!("/v1/artifacts/{artifact}"))
            .header("If-None-Match", &tag)
            .send()
            .await?;
        ensure!(response.status() == 304, "{tag}: {}", response.status());
        ensure!(response.text().await?.is_empty());
    }
    let response = v1
        .request(Method::GET, &format!("/v1/artifacts/{artifact}"))
        .header("If-None-Match", "\"other\"")
        .send()
        .await?;
    ensure!(response.status() == 200, "{}", response.status());
    for unknown in [
        "nope".to_owned(),
        "0123456789abcdef0123456789abcdef".to_owned(),
        artifact.to_uppercase(),
    ] {
        let response = v1
            .request(Method::GET, &format!("/v1/artifacts/{unknown}"))
            .send()
            .await?;
        error_of(response, 404, "no_such_artifact").await?;
    }
    // Its log went to a pipe: plain text, no colour codes for a file or a log shipper.
    let log = gateway.log();
    ensure!(
        log.contains(" INFO ") && !log.contains('\u{1b}'),
        "the log carries escape codes: {:?}",
        log.lines()
            .filter(|l| l.contains('\u{1b}'))
            .take(3)
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// Every route that takes a `POST` refuses a body that is not declared JSON (a page may
/// send `text/plain` cross-site without a preflight), whichever surface it is on: the
/// JSON rule is put on each such route by hand, and this finds one that was missed.
#[tokio::test]
async fn every_post_route_refuses_a_body_not_declared_json() -> Result<()> {
    let gateway = Gateway::start().await?;
    let v1 = V1Client::new(&gateway);
    let (_, document) = v1.get("/v1/openapi.json").await?;
    let mut paths: Vec<String> = document["paths"]
        .as_object()
        .context("paths")?
        .iter()
        .filter(|(_, item)| item.get("post").is_some())
        .map(|(path, _)| path.replace("{id}", "x"))
        .collect();
    ensure!(paths.len() >= 7, "{paths:?}");
    // Kernel Gateway's surface and the cellgate extensions on it, and the MCP server.
    for path in [
        "/mcp",
        "/api/kernels",
        "/api/kernels/x/interrupt",
        "/api/kernels/x/restart",
        "/api/notebooks/replay",
    ] {
        paths.push(path.to_owned());
    }
    for path in &paths {
        let response = v1
            .request(Method::POST, path)
            // What an MCP client accepts: /mcp checks it before the body's type.
            .header("Accept", "application/json, text/event-stream")
            .header("Content-Type", "text/plain")
            .body("{\"code\": \"1\"}")
            .send()
            .await?;
        if response.status() != 415 {
            bail!(
                "POST {path} with a text/plain body: {} {}",
                response.status(),
                response.text().await?
            );
        }
    }
    Ok(())
}

/// The reference page at `/v1/docs` in headless Chromium (`tests/browser/docs.mjs`): every
/// operation rendered from the gateway's own assets (nothing loaded from elsewhere, no
/// console error under its Content-Security-Policy), "Authorize" takes the token, and "try
/// it out" creates and lists a session through the real API.
#[tokio::test]
async fn the_reference_page_renders_the_document_and_tries_it_out() -> Result<()> {
    let browser_dir = crate::web_client::browser_tools();
    let gateway = Gateway::start().await?;
    let output = tokio::process::Command::new("node")
        .arg("docs.mjs")
        .current_dir(&browser_dir)
        .env("CELLGATE_URL", &gateway.base)
        .env("CELLGATE_TOKEN", crate::support::TOKEN)
        .env(
            "SCREENSHOT_DIR",
            crate::support::repo().join("target/web-client-screenshots/docs"),
        )
        .output()
        .await
        .context("run node (Debian package nodejs; ./dev setup installs it)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success() && stdout.contains("all steps passed"),
        "the reference page failed:\n{stdout}\n{}\ngateway log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        gateway.log()
    );
    let (_, sessions) = V1Client::new(&gateway).get("/v1/sessions").await?;
    ensure!(
        sessions.as_array().is_some_and(|s| s.len() == 1),
        "the page's try-it-out made no session: {sessions}"
    );
    Ok(())
}
