//! What the gvisor backend needs of the host, checked: runsc on `PATH` and answering, a root
//! gateway; and, with `probe`, a real `runsc do /bin/true` on the configured platform.
//!
//! Also says, as a warning, what this runsc build cannot do (limits per process inside the
//! Sentry), so `cellgate doctor` tells an operator before a kernel's whole sandbox is killed.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::GvisorConfig;
use crate::sandbox::diagnosis::{euid, find_on_path, run_command, Diagnosis};

/// Whether this host can run gVisor sandboxes: runsc present and working, a root gateway;
/// with `probe`, `runsc do /bin/true`.
pub async fn diagnose(probe: bool) -> Diagnosis {
    let mut s = Diagnosis::new("gvisor");
    // `runsc checkpoint` needs the kernel's sockets off host paths first: not yet.
    s.fact(
        "hibernation",
        "unsupported: idle kernels are culled at the policy's idle_timeout",
    );
    let Some(runsc) = find_on_path("runsc") else {
        s.fact("runsc", Value::Null);
        s.fail(
            "runsc is not on PATH",
            "apt-get install -y runsc   (or ./dev setup, which installs it)",
        );
        return s;
    };
    s.fact("runsc", runsc.display().to_string());
    match run_command(&runsc, &["--version"], Duration::from_secs(10)).await {
        Ok(out) => {
            let version = out.lines().next().unwrap_or("").trim().to_owned();
            s.fact("version", version);
        }
        Err(err) => {
            s.fail(
                format!("`runsc --version` failed: {err}"),
                "apt-get install --reinstall -y runsc",
            );
            return s;
        }
    }
    let config = GvisorConfig::default();
    s.fact("platform", config.platform.clone());
    if euid() != 0 {
        s.fail(
            "the gvisor backend needs a root gateway (runsc without --rootless creates namespaces and cgroups)",
            "run the gateway as root",
        );
    }
    if std::path::Path::new(super::bundle::INIT).exists() {
        s.fact("init", super::bundle::INIT);
    } else {
        s.fact("init", Value::Null);
        s.warn(
            format!("no {} on this host: each kernel is its container's PID 1 and never reaps the orphans its cells leave (zombies, each holding a pid of the policy's limit, until the session ends)", super::bundle::INIT),
            "install Debian's tini (apt-get install tini; ./dev setup does)",
        );
    }
    s.warn(
        "runsc applies memory and pids limits to the whole sandbox (the host cgroup kills every process of the kernel, not only the one that exceeded it)",
        "none needed for one kernel per sandbox; a newer runsc enforces limits inside the Sentry",
    );
    if probe && s.available {
        let root = std::env::temp_dir().join(format!(
            "cellgate-doctor-runsc-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ));
        let root_arg = root.display().to_string();
        let started = Instant::now();
        let result = run_command(
            &runsc,
            &[
                "--root",
                &root_arg,
                "--platform",
                &config.platform,
                "--network=none",
                "do",
                "/bin/true",
            ],
            Duration::from_secs(30),
        )
        .await;
        let _ = std::fs::remove_dir_all(&root);
        match result {
            Ok(_) => s.fact(
                "probe",
                format!("`runsc do /bin/true` ran in {} ms", started.elapsed().as_millis()),
            ),
            Err(err) => s.fail(
                format!("`runsc --platform {} --network=none do /bin/true` failed: {err}", config.platform),
                "check `dmesg` and runsc's --debug output; the ptrace platform needs ptrace allowed (kernel.yama.ptrace_scope <= 1)",
            ),
        }
    }
    s
}
