//! The namespaces backend's limits on a host whose only cgroup hierarchy is the unified (v2)
//! one. Our development and CI hosts are hybrid (v1 controllers), so the v2 code of
//! `src/sandbox/cgroups.rs` would otherwise never run: this test boots a VM that mounts
//! `cgroup2` alone at `/sys/fs/cgroup` and runs the limit tests of this very binary inside it
//! (the real gateway, a real ipykernel, the real namespaces sandbox), each one started in a
//! cgroup of its own the way systemd's `Delegate=yes` starts a service: a cgroup that holds
//! the gateway's processes and whose controllers the gateway must hand down to its kernels.
//! Inside, each test must pass, the gateway must have moved its processes into a leaf
//! (`cellgate-gateway`) and enabled the controllers for the kernels' parent (`cellgate`); and
//! `cellgate doctor` must report v2 with every controller.
//!
//! How (and why so):
//! - **Debian's own kernel** (the generic `linux-image-amd64`, fetched with `apt-get download`
//!   and unpacked under `target/cgroupv2/` by `tests/cgroupv2/prepare.sh`, which this test
//!   runs; never installed on the host), not the microVM guest's (`guest/`), which is built
//!   without user, pid and network namespaces; building a second kernel would cost CI ~15
//!   minutes. The generic image rather than `-cloud`: the cloud one has no 9p.
//! - **The host's `/` shared read-only** over virtio-9p (QEMU enforces `readonly=on`; no
//!   daemon to run, unlike virtiofs) under a tmpfs overlay in the guest, so the same test
//!   binary, gateway, kernels' venvs and Python are at the same paths and every write stays in
//!   the guest's memory. Fresh /proc, /sys, /dev, /tmp and /run; loopback only: the VM has no
//!   network device. The initramfs (`tests/cgroupv2/init`, busybox-static and the virtio, 9p
//!   and overlay modules) does the mounting.
//! - **Emulation (TCG)**, as for the microVM tests: this host's KVM is unusable, CI's too.
//!   The CPU model is QEMU's `Nehalem`, as for emulated microVMs (Debian's QEMU 7.2
//!   mis-decodes some AVX2 instructions). 4 GiB of memory, 2 CPUs, at the suite's own
//!   priority: at nice 10 beside the main pass on CI's 2 cores the VM got a tenth of a core,
//!   ran 38 minutes instead of 4 and its inner tests' waits ran out.
//! - The guest reports on its serial console, which this test reads line by line (and
//!   prints, so a failure shows the inner test's own output): `cellgate-vm: result …` per
//!   test, `cellgate-vm: doctor …`, `cellgate-vm: done`. Anything missing is a failure; a
//!   host without QEMU or the kernel packages fails saying what is missing, never skips.
//!
//! `./dev test` runs this test in the background beside the main pass (it is excluded from
//! that pass), since it is mostly an emulated CPU's work.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, ensure, Context, Result};

/// The limit tests run inside the VM, by their full names in this binary: the memory limit
/// (a hungry child killed, the kernel lives), the OOM report (the kernel itself killed,
/// `OutOfMemoryError` and outcome `oom`), the pids limit (a fork loop's fork fails with
/// EAGAIN) and the CPU limit (a busy loop held to a quarter of a CPU). Not the attack suite's
/// fork bomb and CPU spin, which test the same limits with a bystander's timings: under
/// emulation the fork bomb alone took over 10 minutes.
const INNER_TESTS: &[&str] = &[
    "lifecycle::policy_limits_reach_the_sandbox",
    "lifecycle::kernel_out_of_memory_restarts_it_with_outcome_oom",
    "api_v1::policy_pids_and_cpu_limits_hold",
];

/// The prefix of every line the guest's scripts write for this test.
const MARK: &str = "cellgate-vm: ";

#[test]
fn namespaces_limits_hold_on_a_cgroup_v2_only_host() -> Result<()> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::var_os("CELLGATE_CGROUPV2_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join("target/cgroupv2"));
    let prepared = Command::new(repo.join("tests/cgroupv2/prepare.sh"))
        .arg(&dir)
        .status()
        .context("run tests/cgroupv2/prepare.sh")?;
    ensure!(
        prepared.success(),
        "tests/cgroupv2/prepare.sh failed ({prepared}): this test needs Debian's linux-image-amd64 and busybox-static packages from apt (see its output above)"
    );
    let qemu = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .context("qemu-system-x86_64 is needed to boot the cgroup v2 VM (./dev setup installs qemu-system-x86)")?;
    ensure!(qemu.status.success(), "qemu-system-x86_64 --version failed");

    let run = tempfile::Builder::new()
        .prefix("run-")
        .tempdir_in(&dir)
        .context("a run directory under the VM's directory (the guest reads it through 9p)")?;
    let job = run.path().join("job");
    std::fs::write(&job, job_script(repo)?)?;

    // setpriv --pdeathsig: QEMU dies with this test, however the test ends.
    let mut child = Command::new("setpriv")
        .args(["--pdeathsig", "KILL", "qemu-system-x86_64"])
        .args(["-accel", "tcg", "-cpu", "Nehalem", "-m", "4G", "-smp", "2"])
        .args([
            "-nodefaults",
            "-no-reboot",
            "-display",
            "none",
            "-monitor",
            "none",
        ])
        .args(["-serial", "stdio", "-nic", "none"])
        .arg("-kernel")
        .arg(dir.join("vmlinuz"))
        .arg("-initrd")
        .arg(dir.join("initramfs.cpio.gz"))
        .arg("-append")
        .arg(format!(
            // loglevel=1: the kernel's own messages (OOM kills…) stay in its log, off the
            // console this test parses.
            "console=ttyS0 quiet loglevel=1 panic=-1 cellgate.job={}",
            job.display()
        ))
        .arg("-virtfs")
        .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("start qemu-system-x86_64")?;
    let console = child.stdout.take().context("QEMU's console")?;
    let (mut reader, mut lines, mut buf) = (BufReader::new(console), Vec::new(), Vec::new());
    // Bytes, not UTF-8 lines: a test's output may hold anything.
    while reader
        .read_until(b'\n', &mut buf)
        .context("read the console")?
        > 0
    {
        let line = String::from_utf8_lossy(&buf).trim_end().to_owned();
        println!("vm| {line}");
        lines.push(line);
        buf.clear();
    }
    let status = child.wait()?;
    println!("QEMU exited: {status}");
    check_console(&lines)
}

/// The script the guest runs (with bash, from the host's root): every inner test in a fresh
/// cgroup holding its processes, then `cellgate doctor` in another.
fn job_script(repo: &Path) -> Result<String> {
    let exe = std::env::current_exe().context("this test binary's path")?;
    let kernels = std::env::var("CELLGATE_KERNELS_DIR")
        .unwrap_or_else(|_| repo.join("kernels").display().to_string());
    let tools = std::env::var("CELLGATE_TOOLS_PYTHON")
        .unwrap_or_else(|_| repo.join(".venv-tools/bin/python").display().to_string());
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    Ok(format!(
        r#"set -u
cd {repo}
# Emulated, and beside the rest of the suite: kernels start slowly (tests/support/mod.rs).
export CELLGATE_KERNELS_DIR={kernels} CELLGATE_TOOLS_PYTHON={tools} RUST_BACKTRACE=1
export CELLGATE_TEST_START_TIMEOUT=900
say() {{ echo "{MARK}$*"; }}
# Runs "$@" in a new cgroup below the root, as a service with Delegate=yes starts.
in_cgroup() {{
  local cg=$1
  shift
  mkdir "$cg" || return 1
  (echo "$BASHPID" >"$cg/cgroup.procs" && exec "$@")
}}
n=0
for t in {tests}; do
  n=$((n + 1))
  cg=/sys/fs/cgroup/gateway-$n
  say "running $t in $cg"
  began=$SECONDS
  in_cgroup "$cg" {exe} --exact "$t" --test-threads 1 --nocapture
  rc=$?
  # The gateway moved the processes of its cgroup into a leaf, so that the cgroup could hand
  # its controllers down to the kernels' parent.
  leaf=no
  [ -d "$cg/cellgate-gateway" ] && [ "$(cat "$cg/cgroup.subtree_control")" = "cpu memory pids" ] &&
    [ "$(cat "$cg/cellgate/cgroup.subtree_control")" = "cpu memory pids" ] && leaf=yes
  say "result $t exit=$rc leaf=$leaf after=$((SECONDS - began))s"
done
say "doctor $(in_cgroup /sys/fs/cgroup/doctor {cellgate} doctor --json 2>/dev/null | tr -d '\n')"
say done
"#,
        repo = quote(&repo.display().to_string()),
        kernels = quote(&kernels),
        tools = quote(&tools),
        tests = INNER_TESTS.join(" "),
        exe = quote(&exe.display().to_string()),
        cellgate = quote(env!("CARGO_BIN_EXE_cellgate")),
    ))
}

/// What the guest reported: every inner test passed and moved its gateway into a leaf, and
/// `doctor` saw cgroup v2 with the memory, pids and cpu controllers, writable.
fn check_console(lines: &[String]) -> Result<()> {
    let marked: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix(MARK))
        .collect();
    if let Some(failed) = marked.iter().find(|m| m.starts_with("FAILED")) {
        bail!("the VM's set-up failed: {failed}");
    }
    let mut problems = Vec::new();
    for test in INNER_TESTS {
        let results: Vec<&str> = marked
            .iter()
            .filter_map(|m| m.strip_prefix(&format!("result {test} ")))
            .collect();
        match results.as_slice() {
            [ok] if ok.starts_with("exit=0 leaf=yes ") => {}
            // The inner test's own words, so that a log cut short (CI keeps its head and
            // tail) still says why.
            [other] => problems.push(format!("{test}: {other}{}", panic_of(lines, test))),
            _ => problems.push(format!(
                "{test}: no result (the VM stopped before it ended?)"
            )),
        }
    }
    let doctor = marked
        .iter()
        .find_map(|m| m.strip_prefix("doctor "))
        .context("no doctor report from the VM")?;
    let report: serde_json::Value = serde_json::from_str(doctor)
        .with_context(|| format!("doctor's report is not JSON: {doctor}"))?;
    let namespaces = report["backends"]
        .as_array()
        .and_then(|b| b.iter().find(|s| s["name"] == "namespaces"))
        .with_context(|| format!("no namespaces section in doctor's report: {report}"))?;
    let facts = &namespaces["facts"];
    if facts["cgroup_version"] != "v2"
        || facts["cgroup_writable"] != true
        || facts["cgroup_controllers"]
            != serde_json::json!({"cpu": "v2", "memory": "v2", "pids": "v2"})
    {
        problems.push(format!("doctor's cgroup facts: {facts}"));
    }
    ensure!(
        marked.contains(&"done"),
        "the VM did not finish its job (see its console above)"
    );
    ensure!(
        problems.is_empty(),
        "on the cgroup v2-only VM: {}",
        problems.join("; ")
    );
    Ok(())
}

/// The panic message an inner test printed between its `running` and `result` lines (the
/// `panicked at` line and the message after it, up to the backtrace), or nothing.
fn panic_of(lines: &[String], test: &str) -> String {
    let (running, result) = (
        format!("{MARK}running {test} "),
        format!("{MARK}result {test} "),
    );
    let output = lines
        .iter()
        .map(|l| l.trim_end_matches('\r'))
        .skip_while(|l| !l.starts_with(&running))
        .take_while(|l| !l.starts_with(&result));
    let message: Vec<&str> = output
        .skip_while(|l| !l.contains("panicked at"))
        .take_while(|l| !l.starts_with("stack backtrace:") && !l.starts_with("note: "))
        .take(12)
        .collect();
    if message.is_empty() {
        String::new()
    } else {
        format!(" [{}]", message.join(" / "))
    }
}

/// A failed inner test's panic message reaches the error, which is what a CI log cut to
/// its head and tail keeps; all passed is no error.
#[test]
fn an_inner_tests_panic_is_in_the_error() {
    let report = |first: &[&str]| {
        let mut lines: Vec<String> = first.iter().map(|l| l.to_string()).collect();
        for test in &INNER_TESTS[1..] {
            lines.push(format!("{MARK}result {test} exit=0 leaf=yes after=9s"));
        }
        lines.push(format!(
            r#"{MARK}doctor {{"backends":[{{"name":"namespaces","facts":{{"cgroup_version":"v2","cgroup_writable":true,"cgroup_controllers":{{"cpu":"v2","memory":"v2","pids":"v2"}}}}}}]}}"#
        ));
        lines.push(format!("{MARK}done"));
        check_console(&lines)
    };
    let err = report(&[
        "cellgate-vm: running lifecycle::policy_limits_reach_the_sandbox in /sys/fs/cgroup/gateway-1",
        "thread 'x' panicked at tests/it/lifecycle.rs:1:2:",
        "no message within 60s\r",
        "stack backtrace:",
        "   0: frames",
        "cellgate-vm: result lifecycle::policy_limits_reach_the_sandbox exit=101 leaf=yes after=700s",
    ])
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "on the cgroup v2-only VM: lifecycle::policy_limits_reach_the_sandbox: exit=101 leaf=yes after=700s [thread 'x' panicked at tests/it/lifecycle.rs:1:2: / no message within 60s]"
    );
    report(&[
        "cellgate-vm: result lifecycle::policy_limits_reach_the_sandbox exit=0 leaf=yes after=9s",
    ])
    .unwrap();
}
