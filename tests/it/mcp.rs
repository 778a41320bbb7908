//! The MCP server at `/mcp` with a real MCP client, the official Python SDK over streamable
//! HTTP (`tests/python/mcp_check.py`), against a real gateway and real kernels: the tools
//! and their schemas, state across calls, images, errors, files, artifacts, the notebook,
//! interrupt, restart, a fresh session, one kernel per conversation, the token, and two
//! tenants (JWTs) that cannot use each other's sessions.

use anyhow::{ensure, Context, Result};

use crate::support::{repo, tools_python, Gateway, TOKEN};
use crate::tenants::{claims, hs256, secret_file};

#[tokio::test]
async fn an_mcp_client_uses_every_tool_within_its_rights() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
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
    ensure!(
        stdout.contains("a tenant cannot use another tenant's session"),
        "the tenant checks did not run:\n{stdout}"
    );
    // The official client ends its sessions with a DELETE, and is content with the answer.
    ensure!(
        !stderr.contains("Session termination failed"),
        "the client could not end its session:\n{stderr}"
    );
    Ok(())
}
