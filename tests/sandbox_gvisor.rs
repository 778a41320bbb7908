//! The `gvisor` sandbox backend (runsc) against a real ipykernel: a 1+1 round trip, an
//! interrupt, `kill` leaving no process and no runsc state behind, the host's files and
//! network out of sight, the exit status, the memory limit, and the size-limited workspace
//! (a tmpfs only runsc's mount namespace holds, reached by the gateway through /proc).
//!
//! Needs root and Debian's `runsc` (`apt-get install -y runsc`, part of `./dev setup`), and
//! the kernel venv in `kernels/python3/.venv`. Without runsc every test FAILS with the reason:
//! nothing is skipped silently.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cellgate::protocol::{
    decode_multipart, encode_multipart, Channel, ConnectionInfo, Message, Signer,
};
use cellgate::sandbox::{
    ExitReport, GvisorConfig, GvisorSandbox, LaunchSpec, Launched, Limits, Sandbox,
};
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

// ---------------------------------------------------------------------------------------
// This binary as a stand-in gateway, for the dying-with-the-gateway test.

const MODE_VAR: &str = "CELLGATE_GV_TEST_MODE";
const OUT_VAR: &str = "CELLGATE_GV_TEST_OUT";

#[used]
#[link_section = ".init_array"]
static BEFORE_MAIN: extern "C" fn() = before_main;

extern "C" fn before_main() {
    if std::env::var(MODE_VAR).as_deref() == Ok("gateway") {
        std::process::exit(gateway_mode());
    }
}

/// Launches a sandboxed Python that starts a child, writes the kernel's directory to the
/// file named by OUT_VAR once both run, and waits to be killed.
fn gateway_mode() -> i32 {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
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

/// Where the sandbox shows the venv's base interpreter: a system one (`./dev setup` uses
/// Debian's) stays at its own prefix, any other is shown at `/opt/cellgate/python`.
fn base_prefix_inside() -> String {
    let venv = python()
        .parent()
        .and_then(Path::parent)
        .expect("venv")
        .to_path_buf();
    let cfg = std::fs::read_to_string(venv.join("pyvenv.cfg")).expect("pyvenv.cfg");
    let home = cfg
        .lines()
        .find_map(|l| l.split_once('=').filter(|(k, _)| k.trim() == "home"))
        .map(|(_, v)| v.trim().to_owned())
        .expect("home in pyvenv.cfg");
    if home == "/usr/bin" {
        "/usr".to_owned()
    } else {
        "/opt/cellgate/python".to_owned()
    }
}

/// The kernel venv's interpreter, waiting for the background job that builds it if needed.
fn python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/python3/.venv/bin/python");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let ready = std::fs::read_to_string("/tmp/venv-kernel.log")
            .map(|log| log.contains("KERNEL_OK"))
            .unwrap_or(true);
        if python.exists() && ready {
            return python;
        }
        assert!(
            Instant::now() < deadline,
            "no kernel venv at {} (run ./dev setup; /tmp/venv-kernel.log never said KERNEL_OK)",
            python.display()
        );
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// The gvisor backend, or a loud failure saying why this host cannot run it.
fn sandbox() -> GvisorSandbox {
    GvisorSandbox::new(GvisorConfig::default()).unwrap_or_else(|err| {
        panic!(
            "the gvisor backend cannot run on this host: {err}\n\
             (install runsc with `apt-get install -y runsc` or `./dev setup`; \
             `cellgate doctor` explains what is missing)"
        )
    })
}

/// One kernel's directories, laid out as the gateway lays them out:
/// `<tmp>/<id>/{run,work}`, all 0700, with a sibling kernel's directory next to them.
struct KernelDirs {
    _tmp: tempfile::TempDir,
    id: String,
    root: PathBuf,
    run: PathBuf,
    work: PathBuf,
    sibling: PathBuf,
}

impl KernelDirs {
    fn new(tag: &str) -> KernelDirs {
        let tmp = tempfile::Builder::new()
            .prefix("cellgate-gv-test-")
            .tempdir()
            .expect("tempdir");
        let id = format!("{tag}-{}", uuid::Uuid::new_v4().simple());
        let root = tmp.path().join(&id);
        let run = root.join("run");
        let work = root.join("work");
        let sibling = tmp.path().join("other-kernel/run");
        for dir in [&root, &run, &work, &sibling] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .expect("mkdir");
        }
        std::fs::write(
            sibling.join("connection-g1.json"),
            "{\"key\":\"other kernel's secret\"}",
        )
        .expect("sibling");
        KernelDirs {
            _tmp: tmp,
            id,
            root,
            run,
            work,
            sibling,
        }
    }

    fn env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        env.insert("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into());
        env.insert("HOME".into(), self.work.display().to_string());
        env.insert("LANG".into(), "C.UTF-8".into());
        env.insert("PYTHONUNBUFFERED".into(), "1".into());
        env
    }
}

fn command_spec(dirs: &KernelDirs, argv: Vec<String>, limits: Limits) -> LaunchSpec {
    let connection = ConnectionInfo::ipc(&dirs.run.join("g1"), "unused".into(), "python3");
    LaunchSpec {
        kernel_id: dirs.id.clone(),
        argv,
        env: dirs.env(),
        runtime_dir: dirs.run.clone(),
        connection_file: dirs.run.join("connection-g1.json"),
        connection,
        workspace: dirs.work.clone(),
        log_file: dirs.root.join("kernel.log"),
        limits,
    }
}

async fn exit_of(launched: Launched) -> ExitReport {
    let mut exit = launched.exit;
    let report = tokio::time::timeout(Duration::from_secs(60), exit.wait_for(Option::is_some))
        .await
        .expect("no exit report within 60 s")
        .expect("exit watch closed");
    report.clone().expect("report")
}

/// A running ipykernel in the sandbox with a shell and an iopub socket connected.
struct Kernel {
    /// Kept for the kernel's lifetime: dropping it ends the spawner thread, and the kernel
    /// with it (the helper's parent-death signal is tied to that thread).
    _sandbox: GvisorSandbox,
    dirs: KernelDirs,
    spec: LaunchSpec,
    launched: Launched,
    shell: DealerSocket,
    iopub: SubSocket,
    signer: Signer,
    session: String,
}

/// What one execute request produced.
#[derive(Debug, Default)]
struct Executed {
    status: String,
    stdout: String,
    result: Option<String>,
    error: Option<String>,
}

impl Executed {
    /// The last line printed, parsed as JSON.
    fn json(&self) -> Value {
        let line = self.stdout.lines().last().unwrap_or_default();
        serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {self:?}"))
    }
}

async fn start_kernel(limits: Limits) -> Kernel {
    let python = python();
    let sandbox = sandbox();
    let dirs = KernelDirs::new("k");
    let key = uuid::Uuid::new_v4().simple().to_string();
    let connection = ConnectionInfo::ipc(&dirs.run.join("g1"), key.clone(), "python3");
    let connection_file = dirs.run.join("connection-g1.json");
    std::fs::write(
        &connection_file,
        serde_json::to_vec(&connection).expect("json"),
    )
    .expect("connection file");
    let spec = LaunchSpec {
        kernel_id: dirs.id.clone(),
        argv: vec![
            python.display().to_string(),
            "-m".into(),
            "ipykernel_launcher".into(),
            "-f".into(),
            connection_file.display().to_string(),
        ],
        env: dirs.env(),
        runtime_dir: dirs.run.clone(),
        connection_file,
        connection,
        workspace: dirs.work.clone(),
        log_file: dirs.root.join("kernel.log"),
        limits,
    };
    let started = Instant::now();
    let launched = sandbox
        .launch(&spec)
        .await
        .unwrap_or_else(|err| panic!("launch: {err}"));
    let launch_time = started.elapsed();

    let options = || {
        let mut options = SocketOptions::default();
        options.no_connect_timeout();
        options
    };
    let mut shell = DealerSocket::with_options(options());
    let mut iopub = SubSocket::with_options(options());
    iopub.subscribe("").await.expect("subscribe");
    let connect = async {
        shell
            .connect(&launched.connection.shell_endpoint())
            .await
            .expect("shell");
        iopub
            .connect(&launched.connection.iopub_endpoint())
            .await
            .expect("iopub");
    };
    if tokio::time::timeout(Duration::from_secs(60), connect)
        .await
        .is_err()
    {
        panic!(
            "kernel sockets never appeared; log:\n{}",
            std::fs::read_to_string(&spec.log_file).unwrap_or_default()
        );
    }
    let mut kernel = Kernel {
        _sandbox: sandbox,
        dirs,
        spec,
        launched,
        shell,
        iopub,
        signer: Signer::new(key.as_bytes()),
        session: uuid::Uuid::new_v4().to_string(),
    };
    kernel.wait_ready().await;
    println!(
        "sandbox launched in {launch_time:?}, kernel ready {:?} after launch() was called",
        started.elapsed()
    );
    kernel
}

impl Kernel {
    /// Kills the kernel and waits for its exit report (by then its cgroup is gone).
    async fn stop(self) {
        self.launched.handle.kill().expect("kill");
        let report = exit_of(self.launched).await;
        assert_eq!(report.signal, Some(libc::SIGKILL), "{report:?}");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log_file).unwrap_or_default()
    }

    async fn send(&mut self, msg_type: &str, content: Value) -> String {
        let message = Message::new(Channel::Shell, msg_type, &self.session, None, &content);
        let frames = encode_multipart(&message, &self.signer);
        let zmq = ZmqMessage::try_from(frames).expect("frames");
        self.shell.send(zmq).await.expect("send");
        message.msg_id().to_owned()
    }

    async fn recv_iopub(&mut self, wait: Duration) -> Option<Message> {
        let frames: Vec<Bytes> = tokio::time::timeout(wait, self.iopub.recv())
            .await
            .ok()?
            .ok()?
            .into_vec();
        Some(decode_multipart(Channel::Iopub, frames, &self.signer).expect("valid iopub message"))
    }

    /// Sends kernel_info requests until iopub delivers (the SUB socket has joined).
    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.send("kernel_info_request", json!({})).await;
            if self.recv_iopub(Duration::from_millis(500)).await.is_some() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "kernel never answered; log:\n{}",
                self.log()
            );
        }
        // Let the remaining replies and statuses arrive, then drop them.
        tokio::time::sleep(Duration::from_millis(300)).await;
        while self.recv_iopub(Duration::from_millis(50)).await.is_some() {}
        while let Ok(Ok(_)) =
            tokio::time::timeout(Duration::from_millis(50), self.shell.recv()).await
        {}
    }

    /// Sends code and collects its output until the kernel is idle again and has replied.
    async fn execute_for(&mut self, code: &str, wait: Duration) -> Executed {
        let msg_id = self
            .send(
                "execute_request",
                json!({"code": code, "silent": false, "store_history": false,
                       "user_expressions": {}, "allow_stdin": false, "stop_on_error": true}),
            )
            .await;
        let deadline = Instant::now() + wait;
        let mut out = Executed::default();
        let mut idle = false;
        while !idle {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = self.recv_iopub(left).await.unwrap_or_else(|| {
                panic!(
                    "no idle status for {code:?}; so far {out:?}; log:\n{}",
                    self.log()
                )
            });
            if message.parent_msg_id() != Some(msg_id.as_str()) {
                continue;
            }
            let content = message.content_json().unwrap_or_default();
            match message.msg_type() {
                "stream" if content["name"] == "stdout" => {
                    out.stdout.push_str(content["text"].as_str().unwrap_or(""))
                }
                "execute_result" => {
                    out.result = content["data"]["text/plain"].as_str().map(str::to_owned)
                }
                "error" => out.error = content["ename"].as_str().map(str::to_owned),
                "status" if content["execution_state"] == "idle" => idle = true,
                _ => {}
            }
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let frames = tokio::time::timeout(left, self.shell.recv())
                .await
                .expect("execute_reply in time")
                .expect("shell open")
                .into_vec();
            let reply =
                decode_multipart(Channel::Shell, frames, &self.signer).expect("valid reply");
            if reply.parent_msg_id() == Some(msg_id.as_str()) {
                out.status = reply.content_json().unwrap_or_default()["status"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                return out;
            }
        }
    }

    async fn execute(&mut self, code: &str) -> Executed {
        self.execute_for(code, Duration::from_secs(60)).await
    }
}

fn require_root(test: &str) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?");
    assert_eq!(
        euid, "0",
        "{test} needs root (the gvisor backend runs runsc as root); euid is {euid}"
    );
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
async fn one_plus_one_round_trips() {
    require_root("one_plus_one_round_trips");
    let mut kernel = start_kernel(Limits::default()).await;
    let started = Instant::now();
    let out = kernel.execute("1+1").await;
    let rtt = started.elapsed();
    assert_eq!(out.status, "ok", "{out:?}");
    assert_eq!(out.result.as_deref(), Some("2"));
    let mut times = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let out = kernel.execute("1+1").await;
        assert_eq!(out.result.as_deref(), Some("2"));
        times.push(t.elapsed());
    }
    times.sort();
    println!("1+1 first {rtt:?}, median of 10 {:?}", times[5]);
    // The kernel really runs under gVisor: the Sentry's own kernel version and dmesg.
    let out = kernel
        .execute("import os, json\nprint(json.dumps({'uid': os.getuid(), 'dmesg': os.path.exists('/proc/self/status'), 'release': os.uname().release}))")
        .await;
    assert_eq!(out.status, "ok", "{out:?}");
    let facts = out.json();
    assert_eq!(facts["uid"], 65534, "{facts}");
    kernel.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_reaches_the_kernel() {
    require_root("interrupt test");
    let mut kernel = start_kernel(Limits::default()).await;
    let handle = kernel.launched.handle.clone();
    let interrupter = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        tokio::task::spawn_blocking(move || handle.signal(libc::SIGINT))
            .await
            .expect("join")
            .expect("signal");
    });
    let started = Instant::now();
    let out = kernel
        .execute_for("import time\ntime.sleep(60)", Duration::from_secs(30))
        .await;
    interrupter.await.expect("interrupter");
    assert_eq!(out.status, "error", "{out:?}");
    assert_eq!(out.error.as_deref(), Some("KeyboardInterrupt"));
    assert!(started.elapsed() < Duration::from_secs(20));
    let out = kernel.execute("1+1").await;
    assert_eq!(
        out.result.as_deref(),
        Some("2"),
        "the kernel survives the interrupt"
    );
    kernel.stop().await;
}

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
    let deadline = Instant::now() + Duration::from_secs(5);
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

/// Whether the bundles are gone within a few seconds (they are removed just after the exit
/// is reported, so the report does not wait for them).
async fn no_bundle_soon(kernel_dir: &Path) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
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
async fn network_is_loopback_only() {
    require_root("network test");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("host listener");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let mut kernel = start_kernel(Limits::default()).await;
    let code = format!(
        r#"
import socket, json
r = {{'ifaces': [n for _, n in socket.if_nameindex()]}}
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=3); r['host_tcp'] = 'connected'
except OSError as e:
    r['host_tcp'] = type(e).__name__
try:
    socket.create_connection(('1.1.1.1', 53), timeout=3); r['internet'] = 'connected'
except OSError as e:
    r['internet'] = type(e).__name__
try:
    socket.getaddrinfo('example.com', 443); r['dns'] = 'resolved'
except OSError as e:
    r['dns'] = type(e).__name__
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()
c = socket.create_connection(s.getsockname(), timeout=3)
r['loopback'] = 'ok'
print(json.dumps(r))
"#
    );
    let out = kernel.execute(&code).await;
    assert_eq!(out.status, "ok", "{out:?}");
    let r = out.json();
    println!("{r}");
    assert_eq!(r["ifaces"], json!(["lo"]), "only lo");
    assert_ne!(
        r["host_tcp"], "connected",
        "the host's 127.0.0.1 is unreachable"
    );
    assert_ne!(r["internet"], "connected");
    assert_ne!(r["dns"], "resolved");
    assert_eq!(r["loopback"], "ok", "loopback inside works");
    assert!(
        matches!(listener.accept(), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "nothing reached the host listener"
    );
    kernel.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_status_is_reported() {
    require_root("exit status test");
    let sandbox = sandbox();
    let dirs = KernelDirs::new("exit");
    let spec = command_spec(
        &dirs,
        vec![
            python().display().to_string(),
            "-c".into(),
            "import sys; print('bye'); sys.exit(3)".into(),
        ],
        Limits::default(),
    );
    let launched = sandbox.launch(&spec).await.expect("launch");
    let report = exit_of(launched).await;
    let log = std::fs::read_to_string(&spec.log_file).unwrap_or_default();
    assert_eq!(report.code, Some(3), "{report:?}; log:\n{log}");
    assert!(log.contains("bye"), "kernel output reaches the log: {log}");
    assert!(no_bundle_soon(&dirs.root).await);
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
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
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

/// Fails unless no process holds a mount at `path` within 10 s (`owner` ended just now).
async fn assert_no_mount_soon(path: &Path, owner: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
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
        .env(MODE_VAR, "gateway")
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
    let deadline = Instant::now() + Duration::from_secs(10);
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
    let deadline = Instant::now() + Duration::from_secs(5);
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
