//! What every sandbox test uses, whatever the backend: kernel directories laid out as the
//! gateway lays them out (with another kernel's directory beside them, to look for), the
//! kernel venv, a launch spec for any command, a running ipykernel in a sandbox with its
//! shell and iopub sockets connected, and the exit report.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cellgate::protocol::{
    decode_multipart, encode_multipart, Channel, ConnectionInfo, Message, Signer,
};
use cellgate::sandbox::{
    ExitReport, GvisorConfig, GvisorSandbox, LaunchSpec, Launched, Limits, MicrovmConfig,
    MicrovmSandbox, NamespacesConfig, NamespacesSandbox, Sandbox,
};
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// How long a test waits for something that must happen (a process or a mount to go, a
/// cgroup to be swept): long enough that only something broken, never a slow or busy
/// machine, takes it.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The backends the suite runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Namespaces,
    Gvisor,
    Microvm,
}

/// A sandbox of `kind`, or a loud failure saying why this host cannot run it.
pub fn sandbox(kind: Kind) -> Box<dyn Sandbox> {
    match kind {
        Kind::Namespaces => Box::new(namespaces_sandbox()),
        Kind::Gvisor => Box::new(gvisor_sandbox()),
        Kind::Microvm => Box::new(microvm_sandbox()),
    }
}

/// The namespaces backend, with this test binary as its sandbox helper (see the crate's
/// constructor).
pub fn namespaces_sandbox() -> NamespacesSandbox {
    NamespacesSandbox::new(NamespacesConfig {
        init_program: Some(std::env::current_exe().expect("current exe")),
        ..NamespacesConfig::default()
    })
    .expect("namespaces sandbox")
}

/// The gvisor backend, or a loud failure saying why this host cannot run it.
pub fn gvisor_sandbox() -> GvisorSandbox {
    GvisorSandbox::new(GvisorConfig::default()).unwrap_or_else(|err| {
        panic!(
            "the gvisor backend cannot run on this host: {err}\n\
             (install runsc with `apt-get install -y runsc` or `./dev setup`; \
             `cellgate doctor` explains what is missing)"
        )
    })
}

/// The microvm backend, with emulation allowed (CI's machines have no usable KVM), or a
/// loud failure saying why this host cannot run it.
pub fn microvm_sandbox() -> MicrovmSandbox {
    microvm_sandbox_with(None)
}

/// The microvm backend with the agent link `transport` (`None`: the backend's default).
pub fn microvm_sandbox_with(
    transport: Option<cellgate::sandbox::microvm::link::Transport>,
) -> MicrovmSandbox {
    MicrovmSandbox::new(MicrovmConfig {
        allow_emulation: true,
        transport,
        // These tests are about booted VMs and their transports; the gateway's tests cover
        // the warm pool (tests/it/microvm.rs).
        snapshots: false,
        ..MicrovmConfig::default()
    })
    .unwrap_or_else(|err| {
        panic!(
            "the microvm backend cannot run on this host: {err}\n\
             (`./dev setup` installs QEMU and builds the guest; `cellgate doctor` explains \
             what is missing)"
        )
    })
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Where the sandbox shows the venv's base interpreter: a system one (`./dev setup` uses
/// Debian's) stays at its own prefix, any other is shown at `/opt/cellgate/python`.
pub fn base_prefix_inside() -> String {
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
pub fn python() -> PathBuf {
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

/// One kernel's directories, laid out as the gateway lays them out:
/// `<tmp>/<id>/{run,work}`, all 0700, with a sibling kernel's directory next to them.
pub struct KernelDirs {
    _tmp: tempfile::TempDir,
    pub id: String,
    pub root: PathBuf,
    pub run: PathBuf,
    pub work: PathBuf,
    pub sibling: PathBuf,
}

impl KernelDirs {
    pub fn new(tag: &str) -> KernelDirs {
        let tmp = tempfile::Builder::new()
            .prefix("cellgate-sandbox-test-")
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

    pub fn env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        env.insert("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into());
        env.insert("HOME".into(), self.work.display().to_string());
        env.insert("LANG".into(), "C.UTF-8".into());
        env.insert("PYTHONUNBUFFERED".into(), "1".into());
        env
    }
}

pub fn command_spec(dirs: &KernelDirs, argv: Vec<String>, limits: Limits) -> LaunchSpec {
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
        egress_socket: None,
        allow_emulation: false,
        zygote: false,
        labels: Default::default(),
        adopt: None,
        backend_settings: Default::default(),
        generation: 1,
    }
}

/// Runs `code` with the kernel venv's Python in `sandbox` until it exits: its report, its
/// directories and what it printed.
pub async fn run_python(sandbox: &dyn Sandbox, code: &str) -> (ExitReport, KernelDirs, String) {
    let dirs = KernelDirs::new("exit");
    let spec = command_spec(
        &dirs,
        vec![python().display().to_string(), "-c".into(), code.into()],
        Limits::default(),
    );
    let launched = sandbox.launch(&spec).await.expect("launch");
    let report = exit_of(launched).await;
    let log = std::fs::read_to_string(&spec.log_file).unwrap_or_default();
    (report, dirs, log)
}

pub async fn exit_of(launched: Launched) -> ExitReport {
    let mut exit = launched.exit;
    let report = tokio::time::timeout(Duration::from_secs(60), exit.wait_for(Option::is_some))
        .await
        .expect("no exit report within 60 s")
        .expect("exit watch closed");
    report.clone().expect("report")
}

/// A running ipykernel in the sandbox with a shell and an iopub socket connected.
pub struct Kernel {
    /// Kept for the kernel's lifetime: dropping it ends the spawner thread, and the kernel
    /// with it (the helper's parent-death signal is tied to that thread).
    _sandbox: Box<dyn Sandbox>,
    pub dirs: KernelDirs,
    pub spec: LaunchSpec,
    pub launched: Launched,
    pub shell: DealerSocket,
    pub iopub: SubSocket,
    pub signer: Signer,
    pub session: String,
}

/// What one execute request produced.
#[derive(Debug, Default)]
pub struct Executed {
    pub status: String,
    pub stdout: String,
    pub result: Option<String>,
    pub error: Option<String>,
}

impl Executed {
    /// The last line printed, parsed as JSON.
    pub fn json(&self) -> Value {
        let line = self.stdout.lines().last().unwrap_or_default();
        serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {self:?}"))
    }
}

pub async fn start_kernel(kind: Kind, limits: Limits) -> Kernel {
    start_kernel_with(kind, python(), limits).await
}

/// A kernel started with `python` (a venv's interpreter) instead of the kernel venv's.
pub async fn start_kernel_with(kind: Kind, python: PathBuf, limits: Limits) -> Kernel {
    start_kernel_in(sandbox(kind), python, limits).await
}

/// A kernel started in `sandbox` (a backend configured by the test).
pub async fn start_kernel_in(sandbox: Box<dyn Sandbox>, python: PathBuf, limits: Limits) -> Kernel {
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
        egress_socket: None,
        allow_emulation: false,
        zygote: false,
        labels: Default::default(),
        adopt: None,
        backend_settings: Default::default(),
        generation: 1,
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
    // The gateway's own allowance: 60 s, times what the backend needs (an emulated VM).
    let patience = Duration::from_secs(60) * sandbox.start_time_factor();
    if tokio::time::timeout(patience, connect).await.is_err() {
        panic!(
            "kernel sockets never appeared in {patience:?}; log:\n{}",
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
    pub async fn stop(self) {
        self.launched.handle.kill().expect("kill");
        let report = exit_of(self.launched).await;
        assert_eq!(report.signal, Some(libc::SIGKILL), "{report:?}");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log_file).unwrap_or_default()
    }

    pub async fn send(&mut self, msg_type: &str, content: Value) -> String {
        let message = Message::new(Channel::Shell, msg_type, &self.session, None, &content);
        let frames = encode_multipart(&message, &self.signer);
        let zmq = ZmqMessage::try_from(frames).expect("frames");
        self.shell.send(zmq).await.expect("send");
        message.msg_id().to_owned()
    }

    pub async fn recv_iopub(&mut self, wait: Duration) -> Option<Message> {
        let frames: Vec<Bytes> = tokio::time::timeout(wait, self.iopub.recv())
            .await
            .ok()?
            .ok()?
            .into_vec();
        Some(decode_multipart(Channel::Iopub, frames, &self.signer).expect("valid iopub message"))
    }

    /// Sends kernel_info requests until iopub delivers (the SUB socket has joined).
    pub async fn wait_ready(&mut self) {
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
    pub async fn execute_for(&mut self, code: &str, wait: Duration) -> Executed {
        self.execute_watching(code, wait, "", || {}).await
    }

    /// [`Kernel::execute_for`], running `action` once as soon as the cell's stdout holds
    /// `trigger` (never with an empty one): for what must happen while the cell runs, and
    /// not before it started (an interrupt the kernel gets between cells is ignored).
    pub async fn execute_watching(
        &mut self,
        code: &str,
        wait: Duration,
        trigger: &str,
        mut action: impl FnMut(),
    ) -> Executed {
        let mut triggered = trigger.is_empty();
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
                    out.stdout.push_str(content["text"].as_str().unwrap_or(""));
                    if !triggered && out.stdout.contains(trigger) {
                        triggered = true;
                        action();
                    }
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

    pub async fn execute(&mut self, code: &str) -> Executed {
        self.execute_for(code, Duration::from_secs(60)).await
    }
}

pub fn require_root(test: &str) {
    // The effective uid, from /proc (std has no geteuid, and this crate needs no libc call).
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?");
    assert_eq!(
        euid, "0",
        "{test} needs root (the development and CI machines run tests as root; gVisor's runsc needs it); euid is {euid}"
    );
}
