//! The clients in `clients/` against a live gateway with real kernels: the Python client's
//! own test suite (`clients/python/tests`, pytest from the tools venv, where `./dev setup`
//! puts the client).

use anyhow::{ensure, Context, Result};

use crate::support::{repo, tools_python, Gateway, TOKEN};

#[tokio::test]
async fn the_python_client_passes_its_tests_against_a_live_gateway() -> Result<()> {
    let gateway = Gateway::start().await?;
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
