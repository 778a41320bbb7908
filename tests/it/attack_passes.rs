//! The attack suite again, with its attackers in the other sandboxes this kind of host runs:
//! gVisor (every attack but those on the gateway's own front door, `connections::` and
//! `replay_and_origin::`, which start no attacker kernel and would only run twice), and
//! microVMs (the attacks that apply to a VM: host files, processes and network, other
//! sessions, privileged calls, the gateway's token; not the resource attacks, as a VM's limits
//! are its own: `tests/it/microvm.rs`). The attackers' policies name the backend
//! (`CELLGATE_TEST_ATTACKER_SANDBOX`); the bystander stays in the default sandbox.
//!
//! Each pass is one test here that runs this very binary once per attack, one after another
//! (libtest's own harness, `--exact NAME`, as `cgroup_v2` runs the limit tests inside its VM):
//! a process per attack as under nextest, each in a process group of its own, ended with its
//! group past the bound nextest's CI profile gives that attack. The pass fails with the
//! output of every attack that failed, after running them all. So the passes are scheduled
//! by nextest with the rest of the suite, where a core would otherwise idle, instead of
//! running after it (`./dev test` ran them as separate nextest runs once the main pass was
//! done: minutes of CI's wall time).
//!
//! Under gVisor the attacks on the machine's resources (CPU, processes, memory, output,
//! disk) are a pass of their own, which runs alone at the start of the suite with the
//! namespaces backend's resource attacks (`.config/nextest.toml`); the others come in two
//! halves.

use std::process::Stdio;
use std::time::{Duration, Instant};

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

/// The attacks on the machine's resources: the ones nextest runs alone
/// (`.config/nextest.toml`, the same list).
const RESOURCE_ATTACKS: &[&str] = &[
    "attacks::fork_bomb",
    "attacks::cpu_spin_past_the_timeout",
    "attacks::memory_bombs",
    "attacks::output_flood",
    "attacks::output_floods::",
    "attacks::fill_the_workspace",
    "attacks::workspace_memory::",
];

/// Whether `test` is an attack on resources: a prefix match, as nextest's regex is.
fn is_resource_attack(test: &str) -> bool {
    RESOURCE_ATTACKS.iter().any(|p| test.starts_with(p))
}

/// An attack's bound: the one nextest's CI profile gives it as a test of its own (its own
/// waits come first; this only ends an attack that hangs).
fn bound(test: &str) -> Duration {
    if test.contains("token_is_nowhere") {
        Duration::from_secs(25 * 60)
    } else if test == "attacks::fork_bomb" {
        Duration::from_secs(20 * 60)
    } else {
        Duration::from_secs(5 * 60)
    }
}

/// The tests of this binary, by name (`--list --format terse`), `--ignored` ones or not.
fn listed(ignored: bool) -> Result<Vec<String>> {
    let exe = std::env::current_exe().context("this test binary's path")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["--list", "--format", "terse"]);
    if ignored {
        cmd.arg("--ignored");
    }
    let out = cmd.stdin(Stdio::null()).output()?;
    ensure!(out.status.success(), "listing the tests failed: {out:?}");
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .filter_map(|line| line.strip_suffix(": test"))
        .map(str::to_owned)
        .collect())
}

/// The attacks the gVisor passes run (not ignored ones), in name order.
fn gvisor_attacks() -> Result<Vec<String>> {
    let ignored = listed(true)?;
    let mut attacks: Vec<String> = listed(false)?
        .into_iter()
        .filter(|t| {
            t.starts_with("attacks::")
                && !t.starts_with("attacks::connections::")
                && !t.starts_with("attacks::replay_and_origin::")
                && !ignored.contains(t)
        })
        .collect();
    attacks.sort();
    ensure!(
        attacks.len() >= 20,
        "only {} attacks found: {attacks:?}",
        attacks.len()
    );
    Ok(attacks)
}

/// Half `half` (0 or 1) of the gVisor attacks that are not on resources: every other one.
fn gvisor_half(half: usize) -> Result<Vec<String>> {
    Ok(gvisor_attacks()?
        .into_iter()
        .filter(|t| !is_resource_attack(t))
        .enumerate()
        .filter(|(i, _)| i % 2 == half)
        .map(|(_, t)| t)
        .collect())
}

/// Ends a process group, whatever is left of it.
fn kill_group(pgid: u32) {
    let pgid = i32::try_from(pgid)
        .ok()
        .and_then(rustix::process::Pid::from_raw);
    if let Some(pgid) = pgid {
        // Gone already is fine.
        let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
    }
}

/// Runs one attack in a process (group) of its own with the attackers in `backend`: its
/// output if it failed.
async fn run_one(backend: &str, test: &str) -> Result<Option<String>> {
    let exe = std::env::current_exe().context("this test binary's path")?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args(["--exact", test, "--test-threads", "1", "--nocapture"])
        .env("CELLGATE_TEST_ATTACKER_SANDBOX", backend)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let child = cmd.spawn()?;
    let pgid = child.id().context("the attack's process has no pid")?;
    let limit = bound(test);
    let out = match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(out) => out?,
        Err(_) => {
            kill_group(pgid);
            return Ok(Some(format!(
                "{test} ran past its bound of {limit:?} and was ended (its process group \
                 killed); its output is lost with it"
            )));
        }
    };
    // What its gateways and kernels left in the group (a failed test may not have ended them).
    kill_group(pgid);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let want = "test result: ok. 1 passed; 0 failed";
    if out.status.success() && stdout.contains(want) {
        return Ok(None);
    }
    Ok(Some(format!(
        "{test} failed ({}; wanted {want:?}):\n--- stdout ---\n{stdout}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    )))
}

/// Runs `tests` one after another with the attackers in `backend`; fails with the output of
/// every one that failed.
async fn run_pass(backend: &str, tests: &[String]) -> Result<()> {
    ensure!(!tests.is_empty(), "no attacks to run");
    println!(
        "{} attacks with their attackers in {backend}: {tests:?}",
        tests.len()
    );
    let started = Instant::now();
    let mut failures = Vec::new();
    for test in tests {
        let one = Instant::now();
        let failure = run_one(backend, test).await?;
        println!(
            "{test}: {} in {:.1} s",
            if failure.is_some() { "FAILED" } else { "ok" },
            one.elapsed().as_secs_f64()
        );
        failures.extend(failure);
    }
    if !failures.is_empty() {
        bail!(
            "{} of {} attacks with their attackers in {backend} failed:\n\n{}",
            failures.len(),
            tests.len(),
            failures.join("\n\n")
        );
    }
    println!(
        "{backend}: {} attacks passed in {:.1} s",
        tests.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[tokio::test]
async fn attacks_on_resources_with_attackers_under_gvisor() -> Result<()> {
    let tests: Vec<String> = gvisor_attacks()?
        .into_iter()
        .filter(|t| is_resource_attack(t))
        .collect();
    ensure!(
        tests.len() >= RESOURCE_ATTACKS.len(),
        "fewer resource attacks than their list names: {tests:?}"
    );
    run_pass("gvisor", &tests).await
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
    let all = listed(false)?;
    let tests: Vec<String> = VM_ATTACKS.iter().map(|t| (*t).to_owned()).collect();
    for t in &tests {
        ensure!(all.contains(t), "no attack {t} in this binary");
    }
    run_pass("microvm", &tests).await
}

#[test]
fn the_resource_attacks_are_the_ones_nextest_runs_alone() -> Result<()> {
    let config = std::fs::read_to_string(crate::support::repo().join(".config/nextest.toml"))?;
    let names: Vec<&str> = RESOURCE_ATTACKS
        .iter()
        .map(|p| p.trim_start_matches("attacks::"))
        .collect();
    let alone = format!("test(/^attacks::({})/)", names.join("|"));
    ensure!(
        config.contains(&alone),
        "nextest's filter of the resource attacks is not {alone}: keep RESOURCE_ATTACKS and \
         .config/nextest.toml the same"
    );
    Ok(())
}
