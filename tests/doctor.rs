//! `cellgate doctor` as users run it: the real binary, on this host, with `--json`.
//!
//! The development and CI hosts run as root with user namespaces and cgroup v1 controllers,
//! so the namespaces backend must be reported available, with the facts it found.

use std::process::Command;

use serde_json::Value;

/// `cellgate` as the tests run it: from the repository, with the package index's check
/// pointed at a closed loopback port (the default, PyPI, is not this machine's to probe).
fn cellgate() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cellgate"));
    command
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("CELLGATE_PACKAGE_INDEX", "http://127.0.0.1:9/simple");
    // The runner's own settings (./dev test exports CELLGATE_KERNELS_DIR) would override
    // what a test gives in a config file.
    for name in [
        "CELLGATE_KERNELS_DIR",
        "CELLGATE_POLICIES_DIR",
        "CELLGATE_SANDBOX",
        "CELLGATE_CONFIG",
        "CELLGATE_WHEELHOUSE",
    ] {
        command.env_remove(name);
    }
    command
}

fn doctor(args: &[&str]) -> (Option<i32>, Value) {
    let output = cellgate()
        .arg("doctor")
        .arg("--json")
        .args(args)
        .output()
        .expect("run cellgate doctor");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report = serde_json::from_str(&stdout).unwrap_or_else(|err| {
        panic!(
            "doctor --json printed no JSON ({err}):\n{stdout}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code(), report)
}

fn section<'a>(report: &'a Value, group: &str, name: &str) -> &'a Value {
    report[group]
        .as_array()
        .and_then(|sections| sections.iter().find(|s| s["name"] == name))
        .unwrap_or_else(|| panic!("no {group} section {name:?} in {report:#}"))
}

#[test]
fn namespaces_is_available_here_with_real_facts() {
    let (code, report) = doctor(&[]);
    // The index's check ran, against the loopback stand-in.
    let index = section(&report, "setup", "package index");
    assert!(index.to_string().contains("127.0.0.1:9"), "{index:#}");
    let ns = section(&report, "backends", "namespaces");
    assert_eq!(ns["available"], true, "{ns:#}");
    assert_eq!(report["default_backend"], "namespaces");
    assert_eq!(report["ok"], true, "{report:#}");
    assert_eq!(code, Some(0), "exit code follows the default backend");

    let facts = &ns["facts"];
    // Namespaces kernels cannot be saved to disk (hibernated) yet: said, not left to guess.
    assert!(
        facts["hibernation"]
            .as_str()
            .is_some_and(|h| h.starts_with("unsupported")),
        "{facts:#}"
    );
    // The cgroup version the host really has, and where each controller lives.
    let version = facts["cgroup_version"].as_str().expect("cgroup_version");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    if mountinfo.contains(" - cgroup cgroup ") {
        assert!(
            version.contains("v1") || version.contains("hybrid"),
            "{version}"
        );
    } else {
        assert_eq!(version, "v2");
    }
    assert!(
        facts["cgroup_controllers"]["memory"].is_string(),
        "{facts:#}"
    );
    let max: u64 = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .expect("max_user_namespaces")
        .trim()
        .parse()
        .expect("number");
    assert_eq!(facts["max_user_namespaces"], max);
    assert_eq!(facts["seccomp"], "supported");
    assert!(
        facts["landlock_abi"].as_i64().is_some_and(|abi| abi >= 1),
        "{facts:#}"
    );
    // The probe started a real sandbox.
    assert!(
        facts["probe"]
            .as_str()
            .is_some_and(|p| p.contains("/usr/bin/true")),
        "{facts:#}"
    );

    // Every backend is reported, each with a reason when unavailable.
    for name in ["process", "namespaces", "gvisor", "microvm"] {
        let backend = section(&report, "backends", name);
        if backend["available"] == false {
            let problems = backend["problems"].as_array().expect("problems");
            assert!(!problems.is_empty(), "{name} unavailable without a reason");
            assert!(problems.iter().all(|p| p["fix"].is_string()), "{backend:#}");
        }
    }
    let microvm = section(&report, "backends", "microvm");
    assert_eq!(
        microvm["facts"]["dev_kvm"],
        std::path::Path::new("/dev/kvm").exists()
    );
    assert_eq!(section(&report, "setup", "policies")["available"], true);
}

#[test]
fn a_missing_kernels_dir_is_reported_as_a_problem() {
    let (code, report) = doctor(&["--kernels-dir", "/nonexistent", "--no-probe"]);
    let kernels = section(&report, "setup", "kernels");
    assert_eq!(kernels["available"], false, "{kernels:#}");
    let problems = kernels["problems"].as_array().expect("problems");
    assert!(
        problems.iter().any(|p| p["problem"]
            .as_str()
            .is_some_and(|t| t.contains("/nonexistent"))
            && p["fix"]
                .as_str()
                .is_some_and(|f| f.contains("--kernels-dir"))),
        "{kernels:#}"
    );
    // The backend still works, so the exit code is still 0.
    assert_eq!(code, Some(0));
}

#[test]
fn text_output_is_readable() {
    let output = cellgate()
        .args(["doctor", "--no-probe", "--kernels-dir", "/nonexistent"])
        .output()
        .expect("run cellgate doctor");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("namespaces [default]: ok"), "{text}");
    assert!(text.contains("kernels: NOT AVAILABLE"), "{text}");
    assert!(text.contains("fix: "), "{text}");
}

/// `--config` reads the same file `serve` does: its directories are the ones checked, and a
/// flag still overrides it.
#[test]
fn the_config_file_names_what_is_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("cellgate.toml");
    std::fs::write(
        &config,
        "kernels_dir = \"/nonexistent-kernels\"\npolicies_dir = \"policies\"\n",
    )
    .expect("write config");
    let config = config.to_str().expect("path");
    let (_, report) = doctor(&["--config", config, "--no-probe"]);
    let kernels = section(&report, "setup", "kernels");
    assert_eq!(kernels["available"], false, "{kernels:#}");
    assert!(
        kernels.to_string().contains("/nonexistent-kernels"),
        "{kernels:#}"
    );
    let (_, report) = doctor(&["--config", config, "--no-probe", "--kernels-dir", "kernels"]);
    let kernels = section(&report, "setup", "kernels");
    assert!(
        !kernels.to_string().contains("/nonexistent-kernels"),
        "{kernels:#}"
    );
    // A config file with an unknown key is refused as `serve` refuses it.
    std::fs::write(dir.path().join("bad.toml"), "kernel_dir = \"k\"\n").expect("write");
    let output = cellgate()
        .args(["doctor", "--no-probe", "--config"])
        .arg(dir.path().join("bad.toml"))
        .output()
        .expect("run cellgate doctor");
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("kernel_dir"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// An empty `CELLGATE_*` variable (an env file's `CELLGATE_KERNELS_DIR=`) counts as unset,
/// not as an empty value.
#[test]
fn empty_variables_count_as_unset() {
    let output = cellgate()
        .args(["doctor", "--json", "--no-probe"])
        .env("CELLGATE_KERNELS_DIR", "")
        .env("CELLGATE_SANDBOX", "")
        .env("CELLGATE_POLICIES_DIR", "")
        .output()
        .expect("run cellgate doctor");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(report["default_backend"], "namespaces");
    assert_eq!(section(&report, "setup", "policies")["available"], true);
}

/// Each backend says whether its kernels outlive a gateway that stops or dies, as the
/// configuration would have it (`kernels_outlive_gateway`, on by default).
#[test]
fn it_says_which_backends_keep_their_kernels() {
    let kept = |report: &Value, name: &str| {
        section(report, "backends", name)["facts"]["kernels_outlive_gateway"]
            .as_str()
            .unwrap_or_else(|| panic!("no kernels_outlive_gateway fact for {name}: {report:#}"))
            .to_owned()
    };
    let (_, report) = doctor(&["--no-probe"]);
    for name in ["namespaces", "gvisor", "microvm"] {
        assert!(kept(&report, name).starts_with("yes"), "{report:#}");
    }
    assert!(
        kept(&report, "kubernetes").starts_with("with"),
        "{report:#}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("cellgate.toml");
    std::fs::write(&config, "kernels_outlive_gateway = false\n").expect("write config");
    let (_, report) = doctor(&["--config", config.to_str().expect("path"), "--no-probe"]);
    for name in ["namespaces", "gvisor", "microvm"] {
        assert!(kept(&report, name).starts_with("no"), "{report:#}");
    }
    // A state directory whose kept sockets' paths would not fit a socket address: `serve`
    // keeps namespaces kernels only, and doctor says so.
    let long = dir.path().join("x".repeat(60)).join("state");
    std::fs::write(
        &config,
        format!("state_dir = {:?}\n", long.to_str().expect("path")),
    )
    .expect("write config");
    let (_, report) = doctor(&["--config", config.to_str().expect("path"), "--no-probe"]);
    assert!(kept(&report, "namespaces").starts_with("yes"), "{report:#}");
    for name in ["gvisor", "microvm"] {
        assert!(
            kept(&report, name).contains("too long"),
            "{name}: {report:#}"
        );
    }
}
