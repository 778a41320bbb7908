//! The MCP server at `/mcp` with a real MCP client, the official Python SDK over streamable
//! HTTP (`tests/python/mcp_check.py`), against a real gateway and real kernels: the tools,
//! their annotations and input and output schemas, structured results that validate and say
//! what the text says, state across calls, images, errors, files, artifacts, the notebook,
//! interrupt, restart, a fresh session, one kernel per conversation (ended with it), the
//! token, two tenants (JWTs) that cannot use each other's sessions, two whose names would
//! collide if joined into one string, and the cap on a tenant's MCP sessions.

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

