//! The clients in `clients/` against a live gateway with real kernels: each one's own test
//! suite. The Python client's (`clients/python/tests`) with pytest from the tools venv,
//! where `./dev setup` puts the client; the TypeScript client's (`clients/typescript/test`)
//! with node's test runner, on the client compiled afresh with its locked `tsc`.

use anyhow::{ensure, Context, Result};

use crate::support::{repo, tools_python, Gateway, TOKEN};

/// The clients' gateway: the test sandbox, and a default policy that lets a client set
/// `CLIENT_TEST_*` variables (the clients' per-session environment tests; any other name
/// is refused, which they test too). The directory must outlive the gateway.
async fn gateway() -> Result<(Gateway, tempfile::TempDir)> {
    Gateway::with_default_policy("[environment]\nallow = [\"CLIENT_TEST_*\"]\n", &[]).await
}

#[tokio::test]
async fn the_python_client_passes_its_tests_against_a_live_gateway() -> Result<()> {
    let (gateway, _policies) = gateway().await?;
    let output = tokio::time::timeout(
        std::time::Duration::from_secs(600),
        tokio::process::Command::new(tools_python())
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "clients/python/tests",
            ])
            .current_dir(repo())
            // This checkout's client: the tools venv's editable install points at whichever
            // checkout ran `./dev setup` (a worktree shares the main one's venv).
            .env("PYTHONPATH", repo().join("clients/python/src"))
            .env("CELLGATE_URL", &gateway.base)
            .env("CELLGATE_TOKEN", TOKEN)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("the Python client's tests ran over 10 minutes")??;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success() && stdout.contains(" passed"),
        "the Python client's tests failed:\n{stdout}\n{}\ngateway log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        gateway.log()
    );
    ensure!(!stdout.contains("skipped"), "a test was skipped:\n{stdout}");
    Ok(())
}

#[tokio::test]
async fn the_typescript_client_passes_its_tests_against_a_live_gateway() -> Result<()> {
    let dir = repo().join("clients/typescript");
    let tsc = dir.join("node_modules/.bin/tsc");
    ensure!(
        tsc.exists(),
        "{} is missing: `./dev setup` runs npm ci there",
        tsc.display()
    );
    let built = tokio::process::Command::new(&tsc)
        .args(["-p", "."])
        .current_dir(&dir)
        .output()
        .await
        .context("run tsc (node from Debian's nodejs)")?;
    ensure!(
        built.status.success(),
        "the TypeScript client does not compile:\n{}{}",
        String::from_utf8_lossy(&built.stdout),
        String::from_utf8_lossy(&built.stderr)
    );
    let (gateway, _policies) = gateway().await?;
    let output = tokio::time::timeout(
        std::time::Duration::from_secs(600),
        tokio::process::Command::new("node")
            .args(["--test", "test/"])
            .current_dir(&dir)
            .env("CELLGATE_URL", &gateway.base)
            .env("CELLGATE_TOKEN", TOKEN)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("the TypeScript client's tests ran over 10 minutes")??;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success() && stdout.contains("# fail 0") && !stdout.contains("# pass 0"),
        "the TypeScript client's tests failed:\n{stdout}\n{}\ngateway log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        gateway.log()
    );
    ensure!(
        stdout.contains("# skipped 0"),
        "a test was skipped:\n{stdout}"
    );
    Ok(())
}
