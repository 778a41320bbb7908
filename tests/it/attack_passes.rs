//! The attack suite again, with its attackers in the other sandboxes this kind of host runs:
//! gVisor (every attack but those on the gateway's own front door, `connections::` and
//! `replay_and_origin::`, which start no attacker kernel and would only run twice), and
//! microVMs (the attacks that apply to a VM: host files, processes and network, other
//! sessions, privileged calls, the gateway's token; not the resource attacks, as a VM's limits
//! are its own: `tests/it/microvm.rs`). The attackers' policies name the backend
//! (`CELLGATE_TEST_ATTACKER_SANDBOX`); the bystander stays in the default sandbox.
//!
//! Each pass is one test here that runs this very binary on its list of attacks, one at a
//! time (libtest's own harness, as `cgroup_v2` runs the limit tests inside its VM), and fails
//! with the inner output unless every attack ran and passed. So the passes are scheduled by
//! nextest with the rest of the suite, filling the last minutes of a pass that mostly waits on
//! kernels, instead of running after it (`./dev test` ran them as separate nextest runs once
//! the main pass was done: minutes of CI's wall time). The gVisor attacks come in two halves,
//! two tests that run side by side.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

/// The attacks that apply to a VM.
const VM_ATTACKS: &[&str] = &[
    "attacks::read_etc_shadow",
    "attacks::the_gateway_token_is_nowhere_the_kernel_can_read",
    "attacks::another_sessions_connection_file_and_workspace",
    "attacks::host_processes_are_invisible_and_the_gateway_cannot_be_killed",
    "attacks::writes_outside_the_workspace",
    "attacks::network_and_host_sockets_are_unreachable",
    "attacks::privileged_syscalls_are_refused",
    "attacks::kill_everything_from_inside",
];

/// A pass's own bound: each attack has bounds of its own (the fork bomb's is 15 min), so this
/// only ends a harness that hangs.
const PASS_BOUND: Duration = Duration::from_secs(40 * 60);

/// Every test of this binary, by name (`--list --format terse`).
fn all_tests() -> Result<Vec<String>> {
    let exe = std::env::current_exe().context("this test binary's path")?;
    let out = std::process::Command::new(exe)
        .args(["--list", "--format", "terse"])
        .stdin(Stdio::null())
        .output()?;
    ensure!(out.status.success(), "listing the tests failed: {out:?}");
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .filter_map(|line| line.strip_suffix(": test"))
        .map(str::to_owned)
        .collect())
}

/// The gVisor pass's attacks, half `half` (0 or 1) of them: every other one in name order.
fn gvisor_half(half: usize) -> Result<Vec<String>> {
    let mut attacks: Vec<String> = all_tests()?
        .into_iter()
        .filter(|t| {
            t.starts_with("attacks::")
                && !t.starts_with("attacks::connections::")
                && !t.starts_with("attacks::replay_and_origin::")
        })
        .collect();
    attacks.sort();
    ensure!(
        attacks.len() >= 20,
        "only {} attacks found: {attacks:?}",
        attacks.len()
    );
    Ok(attacks
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 2 == half)
        .map(|(_, t)| t)
        .collect())
}

/// Runs `tests` of this binary one at a time with the attackers in `backend`, and fails with
/// their output unless all of them ran and passed.
async fn run_pass(backend: &str, tests: &[String]) -> Result<()> {
    ensure!(!tests.is_empty(), "no attacks to run");
    let exe = std::env::current_exe().context("this test binary's path")?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("--exact")
        .args(tests)
        .args(["--test-threads", "1"])
        .env("CELLGATE_TEST_ATTACKER_SANDBOX", backend)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    println!(
        "{} attacks with their attackers in {backend}: {tests:?}",
        tests.len()
    );
    let started = std::time::Instant::now();
    let out = tokio::time::timeout(PASS_BOUND, cmd.output())
        .await
        .with_context(|| format!("the {backend} attack pass ran past {PASS_BOUND:?}"))??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want = format!("test result: ok. {} passed; 0 failed", tests.len());
    if !out.status.success() || !stdout.contains(&want) {
        bail!(
            "the attacks with their attackers in {backend} failed ({}; wanted {want:?}):\n\
             --- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
            out.status
        );
    }
    // Each attack's line with its time, for the record (nextest shows it with --success-output).
    for line in stdout.lines().filter(|l| l.starts_with("test ")) {
        println!("{line}");
    }
    println!(
        "{backend}: {} attacks passed in {:?}",
        tests.len(),
        started.elapsed()
    );
    Ok(())
}

#[tokio::test]
async fn attacks_with_attackers_under_gvisor_first_half() -> Result<()> {
    run_pass("gvisor", &gvisor_half(0)?).await
}

#[tokio::test]
async fn attacks_with_attackers_under_gvisor_second_half() -> Result<()> {
    run_pass("gvisor", &gvisor_half(1)?).await
}

#[tokio::test]
async fn attacks_with_attackers_in_microvms() -> Result<()> {
    let all = all_tests()?;
    let tests: Vec<String> = VM_ATTACKS.iter().map(|t| (*t).to_owned()).collect();
    for t in &tests {
        ensure!(all.contains(t), "no attack {t} in this binary");
    }
    run_pass("microvm", &tests).await
}
