//! Kernels forked from a warm zygote (issue 28, `src/sandbox/namespaces/zygote.rs`): real
//! gateways, real ipykernels, the namespaces sandbox.

use anyhow::{Context, Result};
use serde_json::json;

use crate::operations::{sample, scrape};
use crate::support::v1::V1Client;
use crate::support::*;

/// Whether this run's kernels are namespaces ones, which the zygote is for; says so loudly
/// when not.
fn namespaces_run() -> bool {
    let backend = sandbox_backend();
    if backend != "namespaces" {
        eprintln!("NOT RUN: the zygote is the namespaces backend's, and this run forces {backend}");
    }
    backend == "namespaces"
}

/// What a kernel says about itself: forked or not, what it has imported, its draws, what it
/// sees of processes.
const PROBE: &str = "import json, os, random, sys, uuid\n\
import numpy\n\
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n\
print(json.dumps({'forked': '--cellgate-ns-zygote' in sys.orig_argv,\n\
  'preloaded': sorted(m for m in ('numpy', 'pandas', 'matplotlib.pyplot') if m in sys.modules),\n\
  'random': random.random(), 'numpy_random': numpy.random.random(),\n\
  'uuid': str(uuid.uuid4()), 'urandom': os.urandom(8).hex(),\n\
  'key': get_ipython().kernel.session.key.hex(),\n\
  'pid': os.getpid(), 'ppid': os.getppid(), 'pids': pids, 'uid': os.getuid(),\n\
  'cwd': os.getcwd(), 'env': sorted(os.environ),\n\
  'cmdline': open('/proc/self/cmdline').read().split('\\0'),\n\
  'environ': sorted(e.split('=')[0] for e in open('/proc/self/environ').read().split('\\0') if e)}))";

/// Whether an execution ended ok with a PNG among its artifacts.
fn shows_a_png(r: &serde_json::Value) -> bool {
    r["status"] == "ok"
        && r["artifacts"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["mime"] == "image/png"))
}

async fn probe(v1: &V1Client<'_>, id: &str) -> Result<serde_json::Value> {
    let r = v1.execute(id, PROBE).await?;
    anyhow::ensure!(r["status"] == "ok", "the probe failed: {r}");
    Ok(serde_json::from_str(
        r["stdout"].as_str().context("stdout")?.trim(),
    )?)
}

/// The gateway's zygote processes: its descendants whose command line names the zygote flag
/// and whose parent's does not (forked helpers, inits and kernels keep the zygote's command
/// line; the zygote's parent is its sandbox's init, the gateway's binary), first in a pid
/// namespace one level below the host's.
fn zygote_pids(gateway: &Gateway) -> Vec<i32> {
    let is_zygote_like = |pid: i32| {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        String::from_utf8_lossy(&cmdline).contains("--cellgate-ns-zygote")
    };
    let mut found = Vec::new();
    for pid in descendants(gateway.pid() as i32) {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|v| v.trim().parse::<i32>().ok())
            .unwrap_or(0);
        if !is_zygote_like(pid) || is_zygote_like(ppid) {
            continue;
        }
        // In its own pid namespace the zygote is its init's first child, 2; the helpers it
        // forks come later (and stay in that namespace, with the init, when it dies).
        let nspid: Vec<String> = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .map(|v| v.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default();
        if nspid.len() == 2 && nspid[1] == "2" {
            found.push(pid);
        }
    }
    found
}

/// Every descendant of `root`, by the parent pids in /proc.
fn descendants(root: i32) -> Vec<i32> {
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if let Some(ppid) = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|v| v.trim().parse::<i32>().ok())
        {
            parents.push((pid, ppid));
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// Kernels of a gateway with the zygote on (the default) are forked from it, each in a
/// sandbox of its own: the preload list is imported before the first cell, and a first
/// chart arrives; two kernels share no random draw, key or file; a kernel sees only its
/// own sandbox's processes (no zygote, no other kernel); interrupts, the files API and
/// restarts work; a killed zygote leaves running kernels working and new ones start (cold
/// meanwhile, forked again once a new zygote is up).
#[tokio::test]
async fn kernels_fork_from_a_zygote_into_sandboxes_of_their_own() -> Result<()> {
    if !namespaces_run() {
        return Ok(());
    }
    let gateway = Gateway::builder()
        .args(&["--kernel-zygote", "true"])
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let started = std::time::Instant::now();
    let a = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;
    println!(
        "first session (waits for the zygote) in {:?}",
        started.elapsed()
    );
    let started = std::time::Instant::now();
    let b = v1.create_session(json!({})).await?;
    println!("second session in {:?}", started.elapsed());
    let (pa, pb) = (probe(&v1, &a).await?, probe(&v1, &b).await?);
    for p in [&pa, &pb] {
        assert_eq!(
            p["forked"],
            true,
            "forked from the zygote: {p}\n{}",
            gateway.log()
        );
        assert_eq!(
            p["preloaded"],
            json!(["matplotlib.pyplot", "numpy", "pandas"]),
            "the preload list is imported before the first cell: {p}"
        );
        // The kernel's parent is its sandbox's init; it sees its own sandbox only.
        assert_eq!(p["ppid"], 1, "{p}");
        assert!(p["pids"].as_array().map_or(0, Vec::len) <= 4, "{p}");
        assert_eq!(p["uid"], 1000, "{p}");
        assert_eq!(p["cwd"], "/home/user", "{p}");
        let env = p["env"].as_array().context("env")?;
        assert!(
            !env.iter()
                .any(|k| k == "CELLGATE_ZYGOTE_LIB" || k == "CELLGATE_PRELOAD"),
            "the kernel has the kernel's environment, not the zygote's: {p}"
        );
        // What `ps` and /proc show is the kernel's command line and environment, as for a
        // kernel started afresh, and nothing of the zygote's (whose names a host path).
        let cmdline = p["cmdline"].as_array().context("cmdline")?;
        assert!(
            cmdline.iter().any(|a| a == "-f")
                && !cmdline
                    .iter()
                    .any(|a| a.as_str().is_some_and(|a| a.contains("zygote"))),
            "{p}"
        );
        let environ = p["environ"].as_array().context("environ")?;
        assert!(
            environ.iter().any(|k| k == "KERNEL_ID")
                && !environ
                    .iter()
                    .any(|k| k.as_str().is_some_and(|k| k.contains("ZYGOTE"))),
            "{p}"
        );
    }
    for field in ["random", "numpy_random", "uuid", "urandom", "key"] {
        assert_ne!(pa[field], pb[field], "two forked kernels share {field}");
    }

    // A first chart, with pandas and matplotlib already imported.
    let r = v1
        .execute(
            &a,
            "import pandas as pd\nimport matplotlib.pyplot as plt\n\
             pd.DataFrame({'m': range(12), 'r': range(12)}).plot(x='m', y='r'); plt.show()",
        )
        .await?;
    assert!(shows_a_png(&r), "the chart is a PNG artifact: {r}");
    // A seaborn chart left open at the cell's end, in the other kernel: the inline backend's
    // end-of-cell display, which the zygote (whose warm-up chart loaded that backend before
    // any shell existed) must leave hooked into each kernel's shell.
    let r = v1
        .execute(
            &b,
            "import seaborn as sns\n\
             sns.barplot(x=['a', 'b', 'c'], y=[3, 1, 2])",
        )
        .await?;
    assert!(
        shows_a_png(&r),
        "the figure left open is shown as a PNG artifact: {r}"
    );

    // Files are each kernel's own, and the files API reaches a forked kernel's workspace.
    assert_eq!(v1.put_file(&a, "mine.txt", b"a's".to_vec()).await?, 201);
    let r = v1
        .execute(&b, "import os\nprint(os.path.exists('mine.txt'))")
        .await?;
    assert_eq!(r["stdout"], "False\n", "{r}");
    let r = v1.execute(&a, "print(open('mine.txt').read())").await?;
    assert_eq!(r["stdout"], "a's\n", "{r}");

    // An interrupt is a KeyboardInterrupt, as in a kernel started afresh (the confinement
    // reset the signals Python had set).
    let interrupt = async {
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        v1.post(&format!("/v1/sessions/{a}/interrupt"), json!({}))
            .await
    };
    let (r, interrupted) = tokio::join!(v1.execute(&a, "import time\ntime.sleep(60)"), interrupt);
    let (r, (status, _)) = (r?, interrupted?);
    assert!(status < 300, "interrupt answered {status}");
    assert_eq!(r["error"]["ename"], "KeyboardInterrupt", "{r}");
    assert_eq!(v1.execute(&a, "6 * 7").await?["result"], "42");

    // A killed zygote: the running kernels go on; new ones start.
    let zygotes = zygote_pids(&gateway);
    assert_eq!(zygotes.len(), 1, "one zygote: {zygotes:?}");
    signal(zygotes[0], "-KILL");
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(v1.execute(&b, "1 + 1").await?["result"], "2");
    let c = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;
    assert_eq!(v1.execute(&c, "2 + 2").await?["result"], "4");
    let pc = probe(&v1, &c).await?;
    assert_eq!(
        pc["forked"],
        true,
        "a new zygote serves: {pc}\n{}",
        gateway.log()
    );
    let zygotes = zygote_pids(&gateway);
    assert_eq!(zygotes.len(), 1, "one new zygote: {zygotes:?}");
    Ok(())
}

fn signal(pid: i32, name: &str) {
    let _ = std::process::Command::new("kill")
        .args([name, &pid.to_string()])
        .status();
}

/// `--kernel-zygote false`: every kernel starts afresh. With the zygote on, a policy's
/// `[sandbox] zygote = false` starts that policy's kernels afresh, and only those.
#[tokio::test]
async fn the_zygote_can_be_turned_off() -> Result<()> {
    if !namespaces_run() {
        return Ok(());
    }
    let gateway = Gateway::builder()
        .args(&["--kernel-zygote", "false"])
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    let p = probe(&v1, &id).await?;
    assert_eq!(p["forked"], false, "{p}");
    assert_eq!(p["preloaded"], json!(["numpy"]), "nothing preloaded: {p}");
    assert_eq!(p["ppid"], 1, "{p}");
    drop(gateway);

    let policies = tempfile::tempdir()?;
    std::fs::write(policies.path().join("default.toml"), "")?;
    std::fs::write(
        policies.path().join("cold.toml"),
        "[sandbox]\nbackend = \"namespaces\"\nzygote = false\n",
    )?;
    let gateway = Gateway::builder()
        .policies_dir(policies.path().to_owned())
        .args(&["--kernel-zygote", "true"])
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let cold = v1.create_session(json!({"policy": "cold"})).await?;
    let forked = v1.create_session(json!({"policy": "default"})).await?;
    assert_eq!(probe(&v1, &cold).await?["forked"], false);
    assert_eq!(probe(&v1, &forked).await?["forked"], true);
    Ok(())
}

/// A kernelspec whose preload list names a module its environment lacks: the zygote starts
/// without it and says so (the gateway's log, and each kernel's log), its kernels are forked
/// and work, with the rest of the list imported.
#[tokio::test]
async fn a_broken_preload_leaves_the_zygote_working() -> Result<()> {
    if !namespaces_run() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let spec_dir = dir.path().join("kernels/python3");
    std::fs::create_dir_all(&spec_dir)?;
    let real = kernels_dir().join("python3");
    let mut spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(real.join("kernel.json"))?)?;
    spec["env"]["CELLGATE_PRELOAD"] = json!("numpy,no_such_module_here,pandas");
    std::fs::write(spec_dir.join("kernel.json"), spec.to_string())?;
    std::os::unix::fs::symlink(real.join(".venv"), spec_dir.join(".venv"))?;
    let gateway = Gateway::builder()
        .kernels_dir(dir.path().join("kernels"))
        .args(&["--kernel-zygote", "true"])
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let id = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;
    let p = probe(&v1, &id).await?;
    assert_eq!(p["forked"], true, "{p}\n{}", gateway.log());
    assert_eq!(p["preloaded"], json!(["numpy", "pandas"]), "{p}");
    let log = gateway.log();
    assert!(
        log.contains("could not preload these modules") && log.contains("no_such_module_here"),
        "the gateway's log says which module is missing:\n{log}"
    );
    let r = v1.execute(&id, "import no_such_module_here").await?;
    assert_eq!(r["error"]["ename"], "ModuleNotFoundError", "{r}");

    // An operator sees it in the metrics, and `cellgate doctor` names the module.
    let metrics = scrape(&gateway).await?;
    assert_eq!(sample(&metrics, "cellgate_zygote_preload_missing"), 1.0);
    assert_eq!(
        sample(&metrics, r#"cellgate_zygote_starts_total{outcome="ok"}"#),
        1.0
    );
    assert_eq!(
        sample(&metrics, r#"cellgate_zygote_forks_total{outcome="ok"}"#),
        1.0
    );
    assert_eq!(
        sample(&metrics, r#"cellgate_zygote_forks_total{outcome="failed"}"#),
        0.0
    );
    let doctor = tokio::process::Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .args(["doctor", "--json", "--no-probe", "--kernels-dir"])
        .arg(dir.path().join("kernels"))
        .output()
        .await?;
    let report: serde_json::Value = serde_json::from_slice(&doctor.stdout)
        .with_context(|| String::from_utf8_lossy(&doctor.stderr).into_owned())?;
    let kernels = report["setup"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["name"] == "kernels"))
        .with_context(|| format!("{report}"))?;
    assert!(
        kernels["problems"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["problem"]
                .as_str()
                .is_some_and(|t| t.contains("preload no_such_module_here")))),
        "doctor names the module the preload cannot import: {kernels}"
    );
    // pandas imports pyarrow, whose allocator would start a thread but for the zygote's
    // one-thread settings, which doctor's check uses too.
    assert!(
        kernels["problems"]
            .as_array()
            .is_some_and(|p| p.iter().all(|p| !p["problem"]
                .as_str()
                .unwrap_or_default()
                .contains("threads"))),
        "importing the preload list leaves one thread: {kernels}"
    );
    assert!(
        kernels["facts"]["python3.preload"]
            .as_str()
            .is_some_and(|f| f.starts_with("numpy,no_such_module_here,pandas")),
        "{kernels}"
    );
    // The namespaces backend's zygote fact follows the configuration: on (this host can
    // fork: root, the library beside the binary), then off as `--kernel-zygote false`'s
    // variable says.
    for (setting, expected) in [
        ("true", "kernels fork from a warm zygote"),
        ("false", "off"),
    ] {
        let doctor = tokio::process::Command::new(env!("CARGO_BIN_EXE_cellgate"))
            .args(["doctor", "--json", "--no-probe", "--kernels-dir"])
            .arg(dir.path().join("kernels"))
            .env("CELLGATE_KERNEL_ZYGOTE", setting)
            .output()
            .await?;
        let report: serde_json::Value = serde_json::from_slice(&doctor.stdout)
            .with_context(|| String::from_utf8_lossy(&doctor.stderr).into_owned())?;
        let namespaces = report["backends"]
            .as_array()
            .and_then(|b| b.iter().find(|b| b["name"] == "namespaces"))
            .with_context(|| format!("{report}"))?;
        assert!(
            namespaces["facts"]["zygote"]
                .as_str()
                .is_some_and(|f| f.starts_with(expected)),
            "CELLGATE_KERNEL_ZYGOTE={setting}: {namespaces}"
        );
    }
    Ok(())
}

/// A zygote that stops answering (here: stopped with SIGSTOP) costs the kernel asked for
/// meanwhile a fresh start after the fork's timeout, never a session, and the kernels it
/// forked before keep running, also once it is let go and exits.
#[tokio::test]
async fn a_zygote_that_stops_answering_is_let_go_and_its_kernels_live_on() -> Result<()> {
    if !namespaces_run() {
        return Ok(());
    }
    let gateway = Gateway::builder()
        .args(&["--kernel-zygote", "true"])
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let a = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;
    assert_eq!(probe(&v1, &a).await?["forked"], true);
    let zygotes = zygote_pids(&gateway);
    assert_eq!(zygotes.len(), 1, "{zygotes:?}");
    signal(zygotes[0], "-STOP");
    let b = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;
    signal(zygotes[0], "-CONT");
    let pb = probe(&v1, &b).await?;
    assert_eq!(pb["forked"], false, "started afresh: {pb}");
    assert!(
        gateway
            .log()
            .contains("a kernel fork from the zygote failed"),
        "{}",
        gateway.log()
    );
    // The zygote was let go: it exits, and the kernel it forked lives on.
    assert!(
        eventually(PATIENCE, || !std::path::Path::new(&format!(
            "/proc/{}",
            zygotes[0]
        ))
        .exists())
        .await,
        "the zygote let go of did not exit"
    );
    assert_eq!(v1.execute(&a, "1 + 1").await?["result"], "2");
    assert_eq!(v1.execute(&b, "2 + 2").await?["result"], "4");
    Ok(())
}

/// A zygote that has forked `--kernel-zygote-max-forks` kernels is replaced: the kernel that
/// finds it spent still forks from it while its successor starts (no wait), and later
/// kernels fork from the successor.
#[tokio::test]
async fn a_zygote_is_replaced_after_its_forks_and_no_kernel_waits_for_that() -> Result<()> {
    if !namespaces_run() {
        return Ok(());
    }
    let gateway = Gateway::builder()
        .args(&["--kernel-zygote", "true", "--kernel-zygote-max-forks", "1"])
        .start()
        .await?;
    let v1 = V1Client::new(&gateway);
    let a = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;
    let b = v1
        .create_session(json!({}))
        .await
        .with_context(|| gateway.log())?;
    for id in [&a, &b] {
        let p = probe(&v1, id).await?;
        assert_eq!(p["forked"], true, "{p}\n{}", gateway.log());
    }
    // b found the first zygote spent: its successor starts in the background.
    let deadline = std::time::Instant::now() + PATIENCE;
    let starts = loop {
        let metrics = scrape(&gateway).await?;
        let starts = sample(&metrics, r#"cellgate_zygote_starts_total{outcome="ok"}"#);
        if starts >= 2.0 || std::time::Instant::now() > deadline {
            break starts;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(starts, 2.0, "a successor started: {}", gateway.log());
    let c = v1.create_session(json!({})).await?;
    let p = probe(&v1, &c).await?;
    assert_eq!(p["forked"], true, "{p}\n{}", gateway.log());
    let metrics = scrape(&gateway).await?;
    assert_eq!(
        sample(&metrics, r#"cellgate_zygote_forks_total{outcome="ok"}"#),
        3.0
    );
    assert_eq!(sample(&metrics, "cellgate_zygote_cold_starts_total"), 0.0);
    // The first zygote, let go, exits; its kernels live on.
    eventually(PATIENCE, || zygote_pids(&gateway).len() == 1).await;
    assert_eq!(
        zygote_pids(&gateway).len(),
        1,
        "{:?}",
        zygote_pids(&gateway)
    );
    // A fork keeps its zygote's address-space layout: a and b share one (b forked from the
    // spent zygote, not from its successor), c has its successor's.
    let mut layout = Vec::new();
    for id in [&a, &b, &c] {
        let r = v1.execute(id, "import os\nprint(hex(id(os)))").await?;
        assert_eq!(r["status"], "ok", "{r}");
        layout.push(r["stdout"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(
        layout[0], layout[1],
        "a and b forked from one zygote: {layout:?}"
    );
    assert_ne!(
        layout[0], layout[2],
        "c forked from the successor: {layout:?}"
    );
    Ok(())
}
