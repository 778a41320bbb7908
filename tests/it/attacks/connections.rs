//! Attacks on the listener's resources: open files. The soft `RLIMIT_NOFILE` is raised to the
//! hard limit at start-up, so a few hundred idle connections cannot exhaust a default soft
//! limit of 1024 and stop kernel starts; kernels get their own, lower limit, never the
//! gateway's (issue 13, item 2, in part: the header-read and idle timeouts and the connection
//! caps are still open).

use anyhow::{ensure, Context, Result};
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

use super::json_out;
use crate::support::Gateway;

/// `(soft, hard)` "Max open files" of process `pid`.
fn open_file_limits(pid: u32) -> Result<(String, String)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open files line")?;
    let mut fields = line["Max open files".len()..].split_whitespace();
    let soft = fields.next().context("soft")?.to_owned();
    let hard = fields.next().context("hard")?.to_owned();
    Ok((soft, hard))
}

#[tokio::test]
async fn open_file_limit_is_raised_for_the_gateway_and_not_for_kernels() -> Result<()> {
    // Each test runs in its own process (nextest), so lowering this one's soft limit gives the
    // gateway it spawns the default a distribution would.
    let hard = getrlimit(Resource::Nofile).maximum;
    ensure!(
        hard.is_none_or(|h| h > 1024),
        "this host's hard open-file limit is {hard:?}: nothing to raise, the test cannot show anything"
    );
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(1024),
            maximum: hard,
        },
    )?;
    let gateway = Gateway::builder().start().await?;
    let (soft, gateway_hard) = open_file_limits(gateway.pid())?;
    ensure!(
        soft == gateway_hard,
        "the gateway's soft open-file limit stays {soft} below its hard limit {gateway_hard}"
    );
    ensure!(
        gateway.log().contains("open file limit raised"),
        "the figure is logged: {}",
        gateway.log()
    );

    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "nofile", false).await?;
    let msgs = client
        .run("import json, resource; print(json.dumps(resource.getrlimit(resource.RLIMIT_NOFILE)))")
        .await?;
    let limits = json_out(&msgs)?;
    ensure!(
        limits == serde_json::json!([4096, 4096]),
        "a kernel gets 4096 open files, not the gateway's raised limit: {limits}"
    );
    Ok(())
}
