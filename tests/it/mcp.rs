//! The MCP server at `/mcp` with a real MCP client, the official Python SDK over streamable
//! HTTP (`tests/python/mcp_check.py`), against a real gateway and real kernels: the tools,
//! their annotations and input and output schemas, structured results that validate and say
//! what the text says, state across calls, images, errors, files, artifacts, the notebook,
//! interrupt, restart, a fresh session, one kernel per conversation (ended with it), the
//! token, two tenants (JWTs) that cannot use each other's sessions, two whose names would
//! collide if joined into one string, and the cap on a tenant's MCP sessions. Then `/mcp` as
//! an OAuth protected resource (RFC 9728): its metadata and 401 challenge with `--jwt-issuer`
//! (from the Host, or from `--public-url` under a base URL), and neither without.

use anyhow::{ensure, Context, Result};

use crate::support::{repo, tools_python, Gateway, TOKEN};
use crate::tenants::{claims, hs256, secret_file};

/// The cap on each tenant's open MCP sessions the checks run with.
const MCP_CAP: usize = 3;

/// A token of `tenant` with `subject` as its `sub`.
fn token_of(tenant: &str, subject: &str) -> String {
    let mut claims = claims(tenant, "default");
    claims["sub"] = subject.into();
    hs256(&claims)
}

#[tokio::test]
async fn an_mcp_client_uses_every_tool_within_its_rights() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--tenant-max-mcp-sessions", &MCP_CAP.to_string()])
        .start()
        .await?;
    let output = tokio::time::timeout(
        std::time::Duration::from_secs(600),
        tokio::process::Command::new(tools_python())
            .arg(repo().join("tests/python/mcp_check.py"))
            .env("CELLGATE_URL", &gateway.base)
            .env("CELLGATE_TOKEN", TOKEN)
            .env("CELLGATE_TENANT_A", hs256(&claims("acme", "default")))
            .env("CELLGATE_TENANT_B", hs256(&claims("globex", "default")))
            // One string if the caller were keyed by `tenant:{tenant}:{subject}`.
            .env("CELLGATE_TENANT_T_UX", token_of("t", "u:x"))
            .env("CELLGATE_TENANT_TU_X", token_of("t:u", "x"))
            .env("CELLGATE_TENANT_CAPPED", token_of("capped", "c"))
            .env("CELLGATE_MCP_CAP", MCP_CAP.to_string())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("the MCP checks ran over 10 minutes")??;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.success() && stdout.contains("all checks passed"),
        "the MCP checks failed:\n{stdout}\n{stderr}\ngateway log:\n{}",
        gateway.log()
    );
    for check in [
        "every tool says what it may do, and has a title",
        "the structured tools declare output schemas",
        "a tenant cannot use another tenant's session",
        "ending an MCP session ends its kernel",
        "tenants whose names join into one string stay apart",
        "a tenant's MCP sessions are capped at 3",
    ] {
        ensure!(
            stdout.contains(check),
            "the check {check:?} did not run:\n{stdout}"
        );
    }
    // The official client ends its sessions with a DELETE, and is content with the answer.
    ensure!(
        !stderr.contains("Session termination failed"),
        "the client could not end its session:\n{stderr}"
    );
    Ok(())
}

/// The issuer the OAuth checks' gateways name.
const ISSUER: &str = "https://idp.example";

/// The metadata document a gateway at `origin` (with its `base_url`) must serve.
fn expected_metadata(origin: &str, base_url: &str) -> serde_json::Value {
    serde_json::json!({
        "resource": format!("{origin}{base_url}mcp"),
        "authorization_servers": [ISSUER],
        "bearer_methods_supported": ["header"],
    })
}

/// An unauthenticated `POST /mcp` (under `base`): its status and `WWW-Authenticate`.
async fn mcp_refusal(base: &str, authorization: Option<&str>) -> Result<(u16, String)> {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/mcp"))
        .header("Content-Type", "application/json")
        .header("Accept", "application/json, text/event-stream")
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#);
    if let Some(authorization) = authorization {
        request = request.header("Authorization", authorization);
    }
    let answer = request.send().await?;
    let challenge = answer
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap_or("not text").to_owned())
        .unwrap_or_default();
    Ok((answer.status().as_u16(), challenge))
}

#[tokio::test]
async fn with_an_issuer_mcp_is_an_oauth_protected_resource() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .token(None)
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--jwt-issuer", ISSUER])
        .start()
        .await?;
    let origin = format!("http://127.0.0.1:{}", gateway.port);
    let own = format!("{origin}/.well-known/oauth-protected-resource/mcp");
    let http = reqwest::Client::new();

    // A 401 on /mcp points at the metadata, with or without a (bad) token.
    for (authorization, error) in [(None, false), (Some("Bearer not-a-jwt"), true)] {
        let (status, challenge) = mcp_refusal(&gateway.base, authorization).await?;
        ensure!(status == 401, "{authorization:?}: {status}");
        ensure!(
            challenge.starts_with("Bearer realm=\"cellgate\"")
                && challenge.ends_with(&format!(", resource_metadata=\"{own}\""))
                && challenge.contains("error=\"invalid_token\"") == error,
            "{authorization:?}: WWW-Authenticate {challenge:?}"
        );
    }
    // Other routes' 401s are as before: they are not the MCP resource.
    let other = http
        .get(format!("{}/v1/sessions", gateway.base))
        .send()
        .await?;
    let challenge = other.headers().get("www-authenticate").cloned();
    ensure!(
        other.status() == 401
            && challenge
                .as_ref()
                .is_some_and(|c| c == "Bearer realm=\"cellgate\""),
        "/v1/sessions: {} {challenge:?}",
        other.status()
    );

    // Both well-known paths answer the document, without a credential.
    for url in [
        own.clone(),
        format!("{origin}/.well-known/oauth-protected-resource"),
    ] {
        let answer = http.get(&url).send().await?;
        ensure!(answer.status() == 200, "{url}: {}", answer.status());
        ensure!(
            answer
                .headers()
                .get("cache-control")
                .is_some_and(|c| c == "no-store"),
            "{url}: a document made from the Host is not to be cached: {:?}",
            answer.headers()
        );
        let body: serde_json::Value = answer.json().await?;
        ensure!(body == expected_metadata(&origin, "/"), "{url}: {body}");
    }

    // The Host names the gateway when it is a plain host[:port]; anything else is refused,
    // and never reaches the challenge's quoted string.
    let named = http
        .get(&own)
        .header("Host", "GW.example:8443")
        .send()
        .await?
        .json::<serde_json::Value>()
        .await?;
    ensure!(
        named == expected_metadata("http://gw.example:8443", "/"),
        "{named}"
    );
    for hostile in ["gw.example\", error=\"x", "user@gw.example", "gw.example/x"] {
        let answer = http.get(&own).header("Host", hostile).send().await?;
        let status = answer.status();
        let body = answer.text().await?;
        // The gateway's own refusal, not one of hyper's or the edge's.
        ensure!(
            status == 400 && body.contains("\"bad_host\""),
            "Host {hostile:?}: {status} {body}"
        );
        let refused = reqwest::Client::new()
            .post(format!("{}/mcp", gateway.base))
            .header("Host", hostile)
            .header("Content-Type", "application/json")
            .body("{}")
            .send()
            .await?;
        let challenge = refused.headers().get("www-authenticate").cloned();
        ensure!(
            refused.status() == 401
                && challenge
                    .as_ref()
                    .is_some_and(|c| c == "Bearer realm=\"cellgate\""),
            "Host {hostile:?}: {} {challenge:?}",
            refused.status()
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_public_url_and_base_url_name_the_resource() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .token(None)
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--jwt-issuer", ISSUER])
        .args(&["--public-url", "https://GW.example/", "--base-url", "/gw"])
        .start()
        .await?;
    let local = format!("http://127.0.0.1:{}", gateway.port);
    let (status, challenge) = mcp_refusal(&gateway.base, None).await?;
    ensure!(
        status == 401
            && challenge.ends_with(
                ", resource_metadata=\"https://gw.example/.well-known/oauth-protected-resource/gw/mcp\""
            ),
        "{status} {challenge:?}"
    );
    let http = reqwest::Client::new();
    for path in [
        "/.well-known/oauth-protected-resource/gw/mcp",
        "/.well-known/oauth-protected-resource",
    ] {
        // The configured origin, whatever the Host says.
        let answer = http
            .get(format!("{local}{path}"))
            .header("Host", "elsewhere.example")
            .send()
            .await?;
        ensure!(answer.status() == 200, "{path}: {}", answer.status());
        ensure!(
            answer.headers().get("cache-control").is_none(),
            "{path}: {:?}",
            answer.headers()
        );
        let body: serde_json::Value = answer.json().await?;
        ensure!(
            body == expected_metadata("https://gw.example", "/gw/"),
            "{path}: {body}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn without_an_issuer_there_is_no_oauth_metadata() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .token(None)
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .start()
        .await?;
    let http = reqwest::Client::new();
    for path in [
        "/.well-known/oauth-protected-resource/mcp",
        "/.well-known/oauth-protected-resource",
    ] {
        let answer = http.get(format!("{}{path}", gateway.base)).send().await?;
        ensure!(answer.status() == 404, "{path}: {}", answer.status());
    }
    for (authorization, challenge) in [
        (None, "Bearer realm=\"cellgate\""),
        (
            Some("Bearer not-a-jwt"),
            "Bearer realm=\"cellgate\", error=\"invalid_token\"",
        ),
    ] {
        let (status, got) = mcp_refusal(&gateway.base, authorization).await?;
        ensure!(
            status == 401 && got == challenge,
            "{authorization:?}: {status} {got:?}"
        );
    }
    Ok(())
}
