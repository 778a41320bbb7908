//! What the namespaces backend needs of the host, checked: user namespaces (and the knobs
//! that switch them off for unprivileged users), the cgroup controllers the limits use and
//! whether the gateway may create cgroups, seccomp, Landlock; and, with `probe`, a real
//! sandbox running `/usr/bin/true`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::{sys, NamespacesConfig, NamespacesSandbox};
use crate::sandbox::diagnosis::{self, euid, read_trim, Diagnosis};

/// Whether this host can run namespaces sandboxes, and what it lacks.
pub async fn diagnose(probe: bool, zygote_wanted: bool) -> Diagnosis {
    let mut s = Diagnosis::new("namespaces");
    // Said whatever the host: no namespaces kernel can be saved to disk yet (CRIU cannot dump
    // its user and mount namespaces), so a policy asking `hibernate_after` is refused.
    s.fact(
        "hibernation",
        "unsupported: idle kernels are culled at the policy's idle_timeout",
    );
    check_user_namespaces(&mut s);
    check_cgroups(&mut s);
    check_seccomp_and_landlock(&mut s);
    check_zygote(&mut s, zygote_wanted);

    if probe && s.available {
        match probe_namespaces().await {
            Ok(elapsed) => s.fact("probe", format!("started /usr/bin/true in a sandbox in {} ms", elapsed.as_millis())),
            Err(err) => s.fail(
                format!("starting a real sandbox failed: {err}"),
                "see the error above; `cellgate serve --sandbox namespaces` would fail the same way",
            ),
        }
    }
    s
}

/// User namespaces are the sandbox's base: without them (or with a knob that keeps them
/// from unprivileged users while the gateway is not root) no kernel starts.
fn check_user_namespaces(s: &mut Diagnosis) {
    match read_trim("/proc/sys/user/max_user_namespaces") {
        Some(max) => {
            s.fact(
                "max_user_namespaces",
                max.parse::<u64>().map(Value::from).unwrap_or(json!(max)),
            );
            if max == "0" {
                s.fail(
                    "user namespaces are disabled (user.max_user_namespaces = 0)",
                    "sysctl -w user.max_user_namespaces=15000  (persist it in /etc/sysctl.d/)",
                );
            }
        }
        None => s.fail(
            "/proc/sys/user/max_user_namespaces is missing: this kernel has no user namespaces",
            "boot a kernel built with CONFIG_USER_NS=y",
        ),
    }
    match read_trim("/proc/sys/kernel/unprivileged_userns_clone") {
        Some(v) => {
            s.fact("unprivileged_userns_clone", v.clone());
            if v == "0" && euid() != 0 {
                s.fail(
                    "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0) and the gateway is not root",
                    "sysctl -w kernel.unprivileged_userns_clone=1, or run the gateway as root",
                );
            }
        }
        None => s.fact(
            "unprivileged_userns_clone",
            "no such knob (not a Debian-patched kernel)",
        ),
    }
    if let Some(v) = read_trim("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") {
        s.fact("apparmor_restrict_unprivileged_userns", v.clone());
        if v == "1" && euid() != 0 {
            s.fail(
                "AppArmor restricts unprivileged user namespaces and the gateway is not root",
                "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or run the gateway as root",
            );
        }
    }
}

/// The cgroup controllers the limits use and whether the gateway may create cgroups:
/// without them limits are not enforced, which is worth a warning but not a failure.
fn check_cgroups(s: &mut Diagnosis) {
    let cgroups = cgroup_facts();
    s.fact("cgroup_version", cgroups.version);
    s.fact(
        "cgroup_controllers",
        json!(cgroups
            .controllers
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect::<serde_json::Map<_, _>>()),
    );
    s.fact("cgroup_writable", cgroups.writable);
    for controller in ["memory", "pids", "cpu"] {
        if !cgroups.controllers.contains_key(controller) {
            s.warn(
                format!("no {controller} cgroup controller: {controller} limits are not enforced"),
                format!("enable the {controller} controller (cgroup v2: echo +{controller} > cgroup.subtree_control of the gateway's parent cgroup; v1: mount it)"),
            );
        }
    }
    if !cgroups.writable && !cgroups.controllers.is_empty() {
        s.warn(
            "this process cannot create cgroups below its own: memory, pids and CPU limits are not enforced (RLIMIT_AS only)",
            "run the gateway as root, or under a delegated cgroup (systemd: Delegate=yes in its unit)",
        );
    }
}

/// Seccomp is required (the system call filter is the sandbox's last wall); Landlock is
/// a further layer, so its absence is a warning.
fn check_seccomp_and_landlock(s: &mut Diagnosis) {
    let seccomp = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Seccomp:"));
    s.fact("seccomp", if seccomp { "supported" } else { "absent" });
    if !seccomp {
        s.fail(
            "the kernel has no seccomp filter support (no Seccomp: line in /proc/self/status)",
            "boot a kernel built with CONFIG_SECCOMP_FILTER=y",
        );
    }
    match sys::landlock_abi() {
        Ok(abi) => s.fact("landlock_abi", abi),
        Err(errno) => {
            let why = if errno == libc::EOPNOTSUPP {
                "built in but disabled (not in the lsm= boot list)"
            } else {
                "not in this kernel"
            };
            s.fact("landlock_abi", Value::Null);
            s.warn(
                format!("Landlock is {why}: the kernel runs without its file-system ruleset (mount namespace and seccomp still apply)"),
                "boot with lsm=landlock,... (CONFIG_SECURITY_LANDLOCK=y)",
            );
        }
    }
}

/// Kernels forked from a warm zygote (zygote.rs) start a first chart in ~0.2 s instead of
/// ~1 s: whether they will, and what keeps them from it.
fn check_zygote(s: &mut Diagnosis, zygote_wanted: bool) {
    let zygote = super::ZygoteSettings::default();
    match zygote.library() {
        _ if !zygote_wanted => s.fact(
            "zygote",
            "off (--kernel-zygote false): every kernel starts afresh (a first chart takes ~1 s more)",
        ),
        Some(library) if euid() == 0 => s.fact(
            "zygote",
            format!("kernels fork from a warm zygote ({})", library.display()),
        ),
        Some(_) => s.warn(
            "the gateway is not root, so kernels start cold, without the warm zygote (a first chart takes ~1 s more)",
            "run the gateway as root (it drops to an unprivileged uid in each sandbox)",
        ),
        None => s.warn(
            format!(
                "{} is not beside the gateway's binary, so kernels start cold, without the warm zygote (a first chart takes ~1 s more)",
                super::zygote::LIBRARY_FILE
            ),
            format!(
                "cargo build --release -p cellgate-zygote, and install target/release/{} beside the binary (DEPLOY.md)",
                super::zygote::LIBRARY_FILE
            ),
        ),
    }
}

/// Starts `/usr/bin/true` in a complete namespaces sandbox (helper, init, mounts, seccomp,
/// Landlock, cgroups) and checks it exits 0.
async fn probe_namespaces() -> Result<Duration, String> {
    let sandbox = NamespacesSandbox::new(NamespacesConfig {
        start_timeout: Duration::from_secs(20),
        ..NamespacesConfig::default()
    })
    .map_err(|e| e.to_string())?;
    diagnosis::probe(&sandbox, "/usr/bin/true").await
}

/// cgroup facts: which hierarchy provides each controller the sandboxes limit with.
#[derive(Debug, Default)]
struct CgroupFacts {
    /// "v1", "v2", "hybrid" or "none".
    version: &'static str,
    /// controller → "v1" / "v2" for memory, pids, cpu.
    controllers: BTreeMap<&'static str, &'static str>,
    /// Whether this process may create cgroups below its own (in the memory hierarchy).
    writable: bool,
}

fn cgroup_facts() -> CgroupFacts {
    let tables = crate::sandbox::cgroupfs::Tables::read();
    let v2_dir = tables.v2_dir();
    let v2_controllers = v2_dir
        .as_ref()
        .and_then(|dir| read_trim(dir.join("cgroup.controllers")))
        .unwrap_or_default();
    let mut facts = CgroupFacts::default();
    for controller in ["memory", "pids", "cpu"] {
        if v2_controllers.split_whitespace().any(|c| c == controller) {
            facts.controllers.insert(controller, "v2");
        } else if tables.has_v1(controller) {
            facts.controllers.insert(controller, "v1");
        }
    }
    let uses_v1 = facts.controllers.values().any(|v| *v == "v1");
    let uses_v2 = facts.controllers.values().any(|v| *v == "v2");
    facts.version = match (uses_v1, uses_v2, tables.has_v2()) {
        (true, false, true) => "hybrid (v1 controllers, v2 mount without them)",
        (true, false, false) => "v1",
        (false, true, _) => "v2",
        (true, true, _) => "hybrid",
        (false, false, _) => "none",
    };
    // Where the memory controller lives, this process's own cgroup must be writable.
    let memory_dir = match facts.controllers.get("memory") {
        Some(&"v2") => v2_dir,
        Some(_) => tables.v1_dir("memory"),
        None => None,
    };
    facts.writable = memory_dir
        .is_some_and(|dir| rustix::fs::access(&dir, rustix::fs::Access::WRITE_OK).is_ok());
    facts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_facts_name_a_version() {
        let facts = cgroup_facts();
        assert!(!facts.version.is_empty());
    }
}
