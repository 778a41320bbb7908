//! What only the `gvisor` backend (runsc) has, against a real ipykernel: the kernel in the
//! Sentry as uid 65534, `kill` leaving no process and no runsc state behind, the host's files
//! out of sight, the memory limit on the whole sandbox, the size-limited workspace (a tmpfs
//! only runsc's mount namespace holds, reached by the gateway through /proc), and dying with
//! the gateway. The tests every backend passes are in `common`.
//!
//! Needs root and Debian's `runsc` (`apt-get install -y runsc`, part of `./dev setup`).
//! Without runsc every test FAILS with the reason: nothing is skipped silently.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cellgate::sandbox::{GvisorSandbox, Limits, Sandbox};
use serde_json::json;

use super::harness::{
    self, base_prefix_inside, command_spec, exit_of, python, require_root, run_python, runtime,
    Kernel, KernelDirs, Kind, PATIENCE,
};
use super::{MODE_VAR, OUT_VAR};

fn sandbox() -> GvisorSandbox {
    harness::gvisor_sandbox()
}

async fn start_kernel(limits: Limits) -> Kernel {
    harness::start_kernel(Kind::Gvisor, limits).await
}

/// Launches a sandboxed Python that starts a child, writes the kernel's directory to the
/// file named by OUT_VAR once both run, and waits to be killed.
pub fn gateway_mode() -> i32 {
    runtime().block_on(async {
        let out = PathBuf::from(std::env::var(OUT_VAR).expect("out file"));
        let sandbox = sandbox();
        let dirs = KernelDirs::new("gw");
        // Relative: the sandbox shows the workspace at a fixed path, its working directory.
        let code = "import subprocess, time\nsubprocess.Popen(['sleep', '1000'])\nopen('ready', 'w').write('x')\ntime.sleep(1000)\n".to_owned();
        // A size-limited workspace: a tmpfs in runsc's own mount namespace, which must not
        // outlive the sandbox either; the file is looked for where the gateway reaches it.
        let spec = command_spec(
            &dirs,
            vec![python().display().to_string(), "-c".into(), code],
            Limits {
                workspace_bytes: Some(16 << 20),
                ..Limits::default()
            },
        );
        let launched = sandbox.launch(&spec).await.expect("launch");
        let (root, relative) = launched
            .handle
            .workspace_root(&dirs.work)
            .expect("workspace reachable");
        let ready = root.join(relative).join("ready");
        while !ready.exists() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        std::fs::write(&out, dirs.root.display().to_string()).expect("write out");
        // Keep the directories: the test removes them.
        std::mem::forget(dirs);
        tokio::time::sleep(Duration::from_secs(3600)).await;
        0
    })
}

/// Parent pid and state of a host process, from /proc.
fn ppid_and_state(pid: u32) -> Option<(u32, char)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((ppid, state))
}

/// Host processes of one kernel's sandbox: the `runsc` processes whose command line names
/// the kernel's directory, and all their descendants (the sandbox, the gofer, ptrace stubs).
fn sandbox_processes(kernel_dir: &Path) -> Vec<u32> {
    let needle = kernel_dir.display().to_string();
    let pids: Vec<u32> = std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let mut found: Vec<u32> = pids
        .iter()
        .copied()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                .unwrap_or(false)
        })
        .collect();
    loop {
        let more: Vec<u32> = pids
            .iter()
            .copied()
            .filter(|pid| !found.contains(pid))
            .filter(|pid| ppid_and_state(*pid).is_some_and(|(ppid, _)| found.contains(&ppid)))
            .collect();
        if more.is_empty() {
            break;
        }
        found.extend(more);
    }
    found
}

/// The processes among `pids` that still run (zombies are dead: this container's PID 1 may
/// not reap orphans).
fn alive(pids: &[u32]) -> Vec<u32> {
    pids.iter()
        .copied()
        .filter(|pid| ppid_and_state(*pid).is_some_and(|(_, state)| state != 'Z' && state != 'X'))
        .collect()
}

fn bundles_left(kernel_dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(kernel_dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("gvisor-"))
                })
                .collect()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// Tests.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_leaves_no_process_and_no_runsc_state() {
    require_root("kill test");
    let mut kernel = start_kernel(Limits {
        memory_bytes: Some(1 << 30),
        ..Limits::default()
    })
    .await;
    let code = "import subprocess\np = subprocess.Popen(['sleep', '1000'], start_new_session=True)\nprint(p.pid)";
    let out = kernel.execute(code).await;
    assert_eq!(out.status, "ok", "{out:?}");
    let kernel_dir = kernel.dirs.root.clone();
    let processes = sandbox_processes(&kernel_dir);
    assert!(
        processes.len() >= 4,
        "runsc run, gofer, sandbox and stubs: {processes:?}"
    );
    assert_eq!(
        bundles_left(&kernel_dir).len(),
        1,
        "one bundle while running"
    );

    let handle = kernel.launched.handle.clone();
    tokio::task::spawn_blocking(move || handle.kill())
        .await
        .expect("join")
        .expect("kill");
    let report = exit_of(kernel.launched).await;
    assert_eq!(report.signal, Some(libc::SIGKILL), "{report:?}");
    let deadline = Instant::now() + PATIENCE;
    while !alive(&processes).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        alive(&processes).is_empty(),
        "processes survived kill(): {:?}",
        alive(&processes)
    );
    assert!(
        no_bundle_soon(&kernel_dir).await,
        "bundle and runsc state are removed: {:?}",
        bundles_left(&kernel_dir)
    );
}

/// Whether the bundles are gone within [`PATIENCE`] (they are removed just after the exit is
/// reported, so the report does not wait for them).
async fn no_bundle_soon(kernel_dir: &Path) -> bool {
    let deadline = Instant::now() + PATIENCE;
    while !bundles_left(kernel_dir).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bundles_left(kernel_dir).is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_files_are_invisible_and_only_workspace_and_tmp_are_writable() {
    require_root("filesystem test");
    let marker = std::env::temp_dir().join(format!(
        "cellgate-host-marker-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::write(&marker, "host secret").expect("marker");
    let mut kernel = start_kernel(Limits::default()).await;
    let code = format!(
        r#"
import os, json, sys
r = {{}}
r['marker'] = os.path.exists({marker:?})
r['tmp'] = sorted(os.listdir('/tmp'))
r['shadow'] = os.path.exists('/etc/shadow')
r['root'] = os.listdir('/root') if os.path.exists('/root') else []
r['home'] = sorted(os.listdir('/home'))
r['sibling'] = os.path.exists({sibling:?})
r['run'] = sorted(os.listdir('/run/cellgate'))
r['host_paths'] = {{p: os.path.exists(p) for p in [{run:?}, {work:?}, {venv_dir:?}]}}
r['prefix'] = [sys.prefix, sys.base_prefix, sys.executable]
for path in ['/usr/x', '/etc/x', '/x', {venv:?}]:
    try:
        open(path, 'w').write('x'); r[path] = 'written'
    except OSError as e:
        r[path] = e.errno
open(os.path.join(os.getcwd(), 'result.txt'), 'w').write('ok')
open('/tmp/scratch', 'w').write('ok')
r['cwd'] = os.getcwd()
print(json.dumps(r))
"#,
        marker = marker.display().to_string(),
        sibling = kernel.dirs.sibling.display().to_string(),
        run = kernel.dirs.run.display().to_string(),
        work = kernel.dirs.work.display().to_string(),
        venv_dir = python()
            .parent()
            .and_then(Path::parent)
            .expect("venv")
            .display()
            .to_string(),
        venv = "/opt/cellgate/venv/bin/x",
    );
    let out = kernel.execute(&code).await;
    let _ = std::fs::remove_file(&marker);
    assert_eq!(out.status, "ok", "{out:?}");
    let r = out.json();
    println!("{r}");
    assert_eq!(r["marker"], false, "host /tmp is invisible");
    assert_eq!(r["shadow"], false, "/etc/shadow is invisible");
    // The Python environment, runtime directory and workspace are at fixed paths: the
    // host's paths for them mean nothing inside, and /root (a pyenv prefix) is not shown.
    assert_eq!(r["root"], json!([]), "/root shows {}", r["root"]);
    for (path, exists) in r["host_paths"].as_object().expect("host paths") {
        assert_eq!(exists, false, "the host path {path} is visible inside");
    }
    assert_eq!(
        r["prefix"],
        json!([
            "/opt/cellgate/venv",
            base_prefix_inside(),
            "/opt/cellgate/venv/bin/python"
        ]),
        "sys.prefix, sys.base_prefix, sys.executable"
    );
    assert_eq!(r["home"], json!(["user"]));
    assert_eq!(
        r["sibling"], false,
        "another kernel's directory is invisible"
    );
    let tmp: Vec<String> = serde_json::from_value(r["tmp"].clone()).expect("tmp list");
    assert!(
        tmp.iter()
            .all(|name| !name.starts_with("cellgate-host-marker")),
        "{tmp:?}"
    );
    for path in ["/usr/x", "/etc/x", "/x", "/opt/cellgate/venv/bin/x"] {
        assert_ne!(r[path], "written", "{path} must be read-only");
    }
    assert_eq!(r["cwd"], "/home/user");
    assert_eq!(
        std::fs::read_to_string(kernel.dirs.work.join("result.txt")).expect("workspace file"),
        "ok",
        "the workspace is the host directory, writable"
    );
    kernel.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_applies_to_the_whole_sandbox() {
    require_root("memory limit test");
    let limit: u64 = 768 << 20;
    let mut kernel = start_kernel(Limits {
        memory_bytes: Some(limit),
        pids: Some(100),
        cpu_millis: Some(1500),
        ..Limits::default()
    })
    .await;
    // The pids and CPU limits are in runsc's cgroups (pids: plus runsc's own threads).
    let pids_dirs = cgroup_children("pids");
    let with_pids: Vec<&PathBuf> = pids_dirs
        .iter()
        .filter(|d| {
            std::fs::read_to_string(d.join("pids.max")).is_ok_and(|t| {
                t.trim() == (100 + cellgate::sandbox::GVISOR_PIDS_OVERHEAD).to_string()
            })
        })
        .collect();
    assert_eq!(
        with_pids.len(),
        1,
        "one pids cgroup with the limit: {pids_dirs:?}"
    );
    let container = with_pids[0].file_name().expect("name").to_owned();
    let quota = std::fs::read_to_string(
        cgroup_children("cpu")
            .into_iter()
            .find(|d| d.file_name() == Some(&container))
            .expect("cpu cgroup")
            .join("cpu.cfs_quota_us"),
    )
    .expect("quota");
    assert_eq!(quota.trim(), "150000", "1.5 CPUs of a 100 ms period");
    // runsc made the sandbox's cgroup below ours, with the limit.
    let own = std::fs::read_to_string("/proc/self/cgroup").expect("cgroup");
    let memory_own = own
        .lines()
        .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_owned()))
        .expect("memory cgroup (v1)");
    let parent = PathBuf::from(format!(
        "/sys/fs/cgroup/memory{}/cellgate-gvisor",
        memory_own.trim_end_matches('/')
    ));
    let limits: Vec<u64> = std::fs::read_dir(&parent)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| {
                    std::fs::read_to_string(e.path().join("memory.limit_in_bytes")).ok()
                })
                .filter_map(|t| t.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        limits.contains(&limit),
        "a cgroup under {} has memory.limit_in_bytes = {limit}: {limits:?}",
        parent.display()
    );
    let out = kernel.execute("x = bytearray(100 << 20); len(x)").await;
    assert_eq!(out.status, "ok", "a small allocation works: {out:?}");
    let msg_id = kernel
        .send(
            "execute_request",
            json!({"code": "y = [bytearray(64 << 20) for _ in range(64)]", "silent": false,
                   "store_history": false, "user_expressions": {}, "allow_stdin": false}),
        )
        .await;
    let _ = msg_id;
    let mut exit = kernel.launched.exit.clone();
    let report = tokio::time::timeout(Duration::from_secs(60), exit.wait_for(Option::is_some))
        .await
        .expect("the sandbox ends when it exceeds its memory limit")
        .expect("exit watch")
        .clone()
        .expect("report");
    println!("{report:?}");
    assert!(report.is_oom(), "reported as out-of-memory: {report:?}");
    // Removed just after the exit is reported (the report does not wait for them).
    let left = |container: &std::ffi::OsStr| -> Vec<PathBuf> {
        ["memory", "pids", "cpu"]
            .iter()
            .flat_map(|c| cgroup_children(c))
            .filter(|d| d.file_name() == Some(container))
            .collect()
    };
    let deadline = std::time::Instant::now() + PATIENCE;
    while !left(&container).is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let remaining = left(&container);
    assert!(
        remaining.is_empty(),
        "cgroups removed after the exit: {remaining:?}"
    );
}

/// Processes whose mount table has a mount at `path`.
fn mounts_at(path: &Path) -> Vec<u32> {
    let needle = format!(" {} ", path.display());
    std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
                        .is_ok_and(|m| m.lines().any(|l| l.contains(&needle)))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The memory cgroup of the one sandbox launched in `kernel_dir`.
fn memory_cgroup_of(kernel_dir: &Path) -> PathBuf {
    let bundle = bundles_left(kernel_dir);
    let unique = bundle
        .first()
        .and_then(|b| {
            b.file_name()?
                .to_str()?
                .strip_prefix("gvisor-")
                .map(str::to_owned)
        })
        .expect("the sandbox's bundle");
    cgroup_children("memory")
        .into_iter()
        .find(|d| d.file_name().and_then(|n| n.to_str()) == Some(&format!("cellgate-{unique}")))
        .expect("the sandbox's memory cgroup")
}

fn memory_usage(cgroup: &Path) -> u64 {
    std::fs::read_to_string(cgroup.join("memory.usage_in_bytes"))
        .expect("memory.usage_in_bytes")
        .trim()
        .parse()
        .expect("a number")
}

/// With a size limit the workspace is a tmpfs in `runsc run`'s own mount namespace: what
/// the kernel writes lands there, never in the host's directory, and the host's mount table
/// never shows it; the gateway reaches it through `workspace_root`; the limit holds and the
/// kernel's files are charged to the sandbox's memory; the mount ends with the sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_limited_workspace_is_private_and_reachable() {
    require_root("workspace test");
    let mut kernel = start_kernel(Limits {
        workspace_bytes: Some(24 << 20),
        memory_bytes: Some(1 << 30),
        ..Limits::default()
    })
    .await;
    let work = kernel.dirs.work.clone();
    let cgroup = memory_cgroup_of(&kernel.dirs.root);
    let before = memory_usage(&cgroup);
    let out = kernel
        .execute(
            "open('hello.txt', 'w').write('from the kernel')\n\
             with open('blob.bin', 'wb') as f:\n    f.write(b'x' * (16 << 20))\n\
             import os; os.path.getsize('blob.bin')",
        )
        .await;
    assert_eq!(out.result.as_deref(), Some("16777216"), "{out:?}");
    let grown = memory_usage(&cgroup).saturating_sub(before);
    println!("the sandbox's memory grew by {grown} bytes for a 16 MiB file");
    assert!(
        grown >= 12 << 20,
        "the workspace's pages are charged to the sandbox: grew by {grown} bytes only"
    );
    let host: Vec<_> = std::fs::read_dir(&work)
        .expect("host dir")
        .flatten()
        .collect();
    assert!(host.is_empty(), "the host's directory got files: {host:?}");
    assert!(
        !mounts_at(&work).contains(&std::process::id()),
        "the host's mount table shows the workspace"
    );
    let holders = mounts_at(&work);
    assert!(!holders.is_empty(), "no process holds the workspace mount");
    let sandbox = sandbox_processes(&kernel.dirs.root);
    assert!(
        holders.iter().all(|pid| sandbox.contains(pid)),
        "only the sandbox's processes hold the mount: {holders:?} vs {sandbox:?}"
    );
    let handle = kernel.launched.handle.clone();
    let (root, relative) = handle
        .workspace_root(&work)
        .expect("reachable while it runs");
    assert!(handle.alive());
    assert_eq!(
        std::fs::read_to_string(root.join(&relative).join("hello.txt")).expect("read"),
        "from the kernel"
    );
    // The limit holds (bounded: a broken limit fails here, it never fills the disk).
    let out = kernel
        .execute(
            "n = 0\ntry:\n    with open('fill.bin', 'wb', buffering=0) as f:\n        \
             while n < (64 << 20):\n            n += f.write(b'y' * (1 << 20))\n\
             except OSError as e:\n    print(e.errno)\nn",
        )
        .await;
    assert_eq!(out.stdout.trim(), libc::ENOSPC.to_string(), "{out:?}");
    let filled: u64 = out.result.as_deref().unwrap_or("0").parse().expect("n");
    assert!(filled <= 8 << 20, "{filled} bytes in the 8 MiB left");
    kernel.stop().await;
    assert!(!handle.alive());
    assert!(handle.workspace_root(&work).is_none());
    assert_no_mount_soon(&work, "the sandbox").await;
}

/// Fails unless no process holds a mount at `path` within [`PATIENCE`] (`owner` ended just
/// now).
async fn assert_no_mount_soon(path: &Path, owner: &str) {
    let deadline = Instant::now() + PATIENCE;
    while !mounts_at(path).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let holders = mounts_at(path);
    assert!(
        holders.is_empty(),
        "the mount at {} outlived {owner}: held by {holders:?}",
        path.display()
    );
}

/// The sandboxes' cgroups in one v1 controller hierarchy (below this process's cgroup).
fn cgroup_children(controller: &str) -> Vec<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").expect("cgroup");
    let path = own
        .lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctls, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctls.split(',')
                .any(|c| c == controller)
                .then(|| path.to_owned())
        })
        .unwrap_or_else(|| panic!("no v1 {controller} cgroup: this test expects cgroup v1"));
    let parent = Path::new("/sys/fs/cgroup")
        .join(controller)
        .join(path.trim_start_matches('/'))
        .join("cellgate-gvisor");
    std::fs::read_dir(&parent)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_dies_with_the_gateway() {
    require_root("dying-with-the-gateway test");
    python();
    let out = std::env::temp_dir().join(format!(
        "cellgate-gv-gateway-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let mut gateway = std::process::Command::new(std::env::current_exe().expect("exe"))
        .env(MODE_VAR, "gvisor-gateway")
        .env(OUT_VAR, &out)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start the stand-in gateway");
    let deadline = Instant::now() + Duration::from_secs(60);
    let kernel_dir = loop {
        if let Ok(dir) = std::fs::read_to_string(&out) {
            break PathBuf::from(dir);
        }
        if let Ok(Some(status)) = gateway.try_wait() {
            panic!("the stand-in gateway ended early: {status}");
        }
        assert!(Instant::now() < deadline, "the sandbox never started");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = std::fs::remove_file(&out);
    let processes = sandbox_processes(&kernel_dir);
    assert!(processes.len() >= 4, "{processes:?}");
    let work = kernel_dir.join("work");
    assert!(
        !mounts_at(&work).is_empty(),
        "the workspace tmpfs is mounted"
    );
    gateway.kill().expect("SIGKILL the gateway");
    let _ = gateway.wait();
    let deadline = Instant::now() + PATIENCE;
    while !alive(&processes).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = alive(&processes);
    assert_no_mount_soon(&work, "the gateway").await;
    // runsc died before removing its cgroups; the next backend start sweeps them.
    let container = bundles_left(&kernel_dir)
        .first()
        .and_then(|b| {
            b.file_name()?
                .to_str()?
                .strip_prefix("gvisor-")
                .map(|u| format!("cellgate-{u}"))
        })
        .expect("the dead gateway's bundle");
    // (The last sandbox process may take a moment to leave its cgroups.)
    let stale = |name: &str| -> Vec<PathBuf> {
        ["memory", "pids", "cpu"]
            .iter()
            .flat_map(|controller| cgroup_children(controller))
            .filter(|d| d.file_name().and_then(|n| n.to_str()) == Some(name))
            .collect()
    };
    let deadline = Instant::now() + PATIENCE;
    loop {
        drop(sandbox());
        let left = stale(&container);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stale cgroups are swept: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if let Some(tmp) = kernel_dir.parent() {
        let _ = std::fs::remove_dir_all(tmp);
    }
    assert!(
        left.is_empty(),
        "sandbox processes outlived the gateway: {left:?}"
    );
}

/// The kernel really runs under gVisor, as uid 65534.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kernel_runs_in_the_sentry() {
    require_root("gVisor facts test");
    let mut kernel = start_kernel(Limits::default()).await;
    // The kernel really runs under gVisor: the Sentry's own kernel version and dmesg.
    let out = kernel
        .execute("import os, json\nprint(json.dumps({'uid': os.getuid(), 'dmesg': os.path.exists('/proc/self/status'), 'release': os.uname().release}))")
        .await;
    assert_eq!(out.status, "ok", "{out:?}");
    let facts = out.json();
    assert_eq!(facts["uid"], 65534, "{facts}");
    kernel.stop().await;
}

/// A sandbox whose kernel exits by itself leaves no bundle behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exited_sandbox_leaves_no_bundle() {
    require_root("bundle cleanup test");
    let sandbox = sandbox();
    let (report, dirs, _log) = run_python(&sandbox, "import sys; sys.exit(3)").await;
    assert_eq!(report.code, Some(3), "{report:?}");
    assert!(no_bundle_soon(&dirs.root).await);
}
