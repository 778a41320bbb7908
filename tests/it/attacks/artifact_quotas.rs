//! Filling the host's disk with artifacts (issue 13, item 3).
//!
//! Rich outputs and `outputs/` files were capped per artifact only: executions that each
//! wrote 6×16 MiB under the `strict` policy left 384 MiB on the host's disk, kept for the
//! whole retention after the session was deleted. Now the policy's `artifacts_per_session`
//! and `artifacts_per_tenant` and the gateway's `--artifact-min-free-disk` bound them, and an
//! output past any of them is listed in the result's `omitted` with the quota's name.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use super::runtime_root_of;
use crate::support::v1::V1Client;
use crate::support::*;
use crate::tenants::{claims, hs256, secret_file};

const MIB: u64 = 1 << 20;

/// A cell writing `n` files of 10 MiB of random bytes (so no two are the same) under
/// `outputs/`, named after `tag`.
fn write_outputs(tag: &str, n: usize) -> String {
    format!(
        "import os\nos.makedirs('outputs', exist_ok=True)\nfor i in range({n}):\n    open(f'outputs/{tag}-{{i}}.bin', 'wb').write(os.urandom(10 << 20))\n"
    )
}

/// Executes `code`, which must succeed.
async fn execute_ok(v1: &V1Client<'_>, session: &str, code: &str) -> Result<Value> {
    let result = v1.execute(session, code).await?;
    ensure!(result["status"] == "ok", "the cell failed: {result}");
    Ok(result)
}

/// (stored, omitted for `quota`, omitted for anything else) of a result.
fn counts(result: &Value, quota: &str) -> (usize, usize, usize) {
    let stored = result["artifacts"].as_array().map_or(0, Vec::len);
    let omitted = result["omitted"].as_array().cloned().unwrap_or_default();
    let named = omitted.iter().filter(|o| o["quota"] == quota).count();
    (stored, named, omitted.len() - named)
}

/// Bytes of the files under `dir`.
fn du(dir: &Path) -> u64 {
    let mut n = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        match entry.metadata() {
            Ok(meta) if meta.is_dir() => n += du(&entry.path()),
            Ok(meta) => n += meta.len(),
            Err(_) => {}
        }
    }
    n
}

/// Per session 40 MiB, per tenant 70 MiB, of 10 MiB files: a session keeps four, the
/// tenant's second session three more, another tenant is not charged, a deleted session's
/// retained artifacts still count, and the host's disk holds no more than the quotas allow.
#[tokio::test]
async fn session_and_tenant_quotas_bound_the_artifacts_on_disk() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let policies = dir.path().join("policies");
    std::fs::create_dir(&policies)?;
    std::fs::write(
        policies.join("default.toml"),
        format!(
            "[sandbox]\nbackend = \"{}\"\n[limits]\nartifact_size = \"16MiB\"\nartifacts_per_session = \"40MiB\"\nartifacts_per_tenant = \"70MiB\"\n",
            attacker_backend()
        ),
    )?;
    let gateway = Gateway::builder()
        .policies_dir(policies)
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--pool-size", "0"])
        .start()
        .await?;
    let acme = V1Client::bearer(&gateway, &hs256(&claims("acme", "default")));
    let globex = V1Client::bearer(&gateway, &hs256(&claims("globex", "default")));

    let first = acme.create_session(json!({})).await?;
    let result = execute_ok(&acme, &first, &write_outputs("a", 6)).await?;
    let (stored, over, other) = counts(&result, "artifacts_per_session");
    println!("acme's first session: {stored} stored, {over} over its session quota");
    ensure!((stored, over, other) == (4, 2, 0), "{result}");
    let reason = result["omitted"][0]["reason"].as_str().unwrap_or_default();
    ensure!(reason.contains("artifacts_per_session"), "{reason}");

    let second = acme.create_session(json!({})).await?;
    let result = execute_ok(&acme, &second, &write_outputs("b", 6)).await?;
    let (stored, over, other) = counts(&result, "artifacts_per_tenant");
    println!("acme's second session: {stored} stored, {over} over the tenant's quota");
    ensure!((stored, over, other) == (3, 3, 0), "{result}");

    let theirs = globex.create_session(json!({})).await?;
    let result = execute_ok(&globex, &theirs, &write_outputs("c", 2)).await?;
    ensure!(
        counts(&result, "") == (2, 0, 0),
        "globex is charged for acme's artifacts: {result}"
    );

    // A deleted session's artifacts stay fetchable for the retention, and still count.
    let runtime = runtime_root_of(&first)?;
    let (status, body) = acme
        .call(Method::DELETE, &format!("/v1/sessions/{first}"), None)
        .await?;
    ensure!(status == 204, "delete: {status} {body}");
    let result = execute_ok(&acme, &second, &write_outputs("d", 1)).await?;
    ensure!(
        counts(&result, "artifacts_per_tenant") == (0, 1, 0),
        "the deleted session's retained artifacts stopped counting: {result}"
    );

    let on_disk = du(&runtime.join("artifacts"));
    println!("artifacts on the host's disk: {} MiB", on_disk / MIB);
    ensure!(
        on_disk <= 90 * MIB,
        "{} MiB of artifacts on disk for quotas of 70 + 20 MiB",
        on_disk / MIB
    );
    Ok(())
}

/// With the gateway's free-disk minimum above what the disk has, every output is refused
/// and named `artifact_min_free_disk`; the cell itself succeeds.
#[tokio::test]
async fn below_the_free_disk_minimum_outputs_are_refused_by_name() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("default.toml"),
        format!("[sandbox]\nbackend = \"{}\"\n", attacker_backend()),
    )?;
    let gateway = Gateway::builder()
        .policies_dir(dir.path().to_owned())
        .args(&["--artifact-min-free-disk", "1000TiB", "--pool-size", "0"])
        .start()
        .await?;
    let admin = V1Client::bearer(&gateway, TOKEN);
    let session = admin.create_session(json!({})).await?;
    let result = execute_ok(
        &admin,
        &session,
        "from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))\nprint('ran')",
    )
    .await?;
    ensure!(result["stdout"] == "ran\n", "{result}");
    ensure!(
        counts(&result, "artifact_min_free_disk") == (0, 1, 0),
        "{result}"
    );
    let reason = result["omitted"][0]["reason"].as_str().unwrap_or_default();
    ensure!(reason.contains("artifact_min_free_disk"), "{reason}");
    Ok(())
}
