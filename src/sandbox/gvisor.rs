//! The `gvisor` backend: every kernel in its own gVisor sandbox (`runsc`), whose Sentry, a
//! user-space kernel written in Go, serves the kernel's system calls; the host kernel sees
//! only the Sentry's narrow, seccomp-filtered set.
//!
//! # Design
//!
//! **OCI bundle, not `runsc do`.** `runsc do` shows the host's whole `/` (copy-on-write) and
//! has no way to bind the runtime directory read-write at a path of our choosing or to pick the user,
//! so the backend writes a bundle per launch: `config.json` (serde_json) and a `rootfs`
//! directory that holds only mount points, the generated `/etc` files and the `bin`/`lib`
//! symlinks of a merged-`/usr` host. The root is read-only; on top of it:
//!
//! * `/usr` read-only, the host's harmless `/etc` entries (dynamic linker cache,
//!   certificates, time zone…) read-only, one by one; never `shadow` or the gateway's files;
//! * the kernel's Python environment at fixed paths (`sandbox::relocate`, shared with the
//!   namespaces backend): the venv's view at `/opt/cellgate/venv` (its `lib` bound
//!   read-only, `pyvenv.cfg`, interpreter links and console scripts rewritten, written into
//!   the bundle's rootfs) and the base interpreter's prefix at `/opt/cellgate/python`; files
//!   named in its command read-only at their own paths;
//! * `/tmp` a tmpfs of the Sentry (memory, charged to the sandbox);
//! * the runtime directory **bind-mounted read-write at `/run/cellgate`**; the connection
//!   file the kernel reads is rewritten to name its `ipc://` endpoints there, while the
//!   gateway connects by host paths. `--host-uds=all` is what makes a
//!   socket the kernel *binds* there a real host socket the gateway can connect to (without
//!   it the socket exists only inside the Sentry); this 2022 build has no narrower mode
//!   (`open`/`create` came later);
//! * the workspace, bind-mounted read-write at `/home/user` (its `$HOME` and working
//!   directory). With a size limit (every
//!   policy has one) it is a **host tmpfs of that size that only `runsc` sees**: `runsc run`
//!   starts in a mount namespace of its own (made in the child before exec: `unshare`,
//!   `/` made private, then the tmpfs, owned by the kernel's uid, mode 0700, `nosuid`,
//!   `nodev`, mounted over the workspace directory), so the gofer serves the tmpfs while the
//!   host's directory stays empty and nothing shows in the host's mount table. The mount
//!   lives exactly as long as the sandbox's processes (they all die with the gateway, see
//!   *Lifetime*). The gateway reaches it through `/proc/<runsc pid>/root` (see
//!   [`GvisorHandle::workspace_root`]), which is what gives gVisor sessions the file API and
//!   `outputs/` artifacts. Without a limit, the host directory itself. (A tmpfs of the
//!   Sentry would keep the files out of the gateway's reach; a host directory with no
//!   limit let an attack test write 45 GB.) The tmpfs's pages are charged to the memory
//!   cgroup of whoever writes them, the sandbox's for the kernel's files; either way the
//!   size limit bounds them. Mounts other than the root are validated by the Sentry on
//!   each use (`--file-access-mounts=shared`, passed explicitly), so a file uploaded
//!   through the gateway is visible to the kernel at once, also in a directory it has
//!   already listed, and a file the kernel has closed is downloadable at once.
//!
//! The kernel runs as uid/gid 65534 inside and out, with no capabilities and
//! `noNewPrivileges`; the gateway (which must be root: runsc without `--rootless` creates
//! namespaces and cgroups) hands the runtime directory, connection file and workspace to
//! that uid, as the namespaces backend does. `--network=none` leaves only loopback.
//!
//! **Limits.** runsc puts the sandbox (Sentry and gofer) in the cgroup named by the spec's
//! `linux.cgroupsPath` (relative: below the gateway's own cgroup, `cellgate-gvisor/<id>`)
//! and writes `linux.resources` there: pids and CPU quota. The memory cgroup is made by the
//! gateway with its limit before runsc starts, because runsc removes the cgroups it made
//! before `runsc run` returns and the exit watcher must read the OOM counter to report an
//! out-of-memory kill. This build does not enforce limits per process inside the Sentry:
//! exceeding the memory limit kills the **whole** sandbox, and the pids limit counts the
//! Sentry's threads and the ptrace stubs (one host process per guest process), so
//! [`PIDS_OVERHEAD`] is added to the policy's number.
//! Cgroups of a `runsc run` killed with its gateway are swept when the backend next starts.
//!
//! **Lifetime.** `runsc run` (attached) is spawned from one dedicated thread with
//! `PR_SET_PDEATHSIG(SIGKILL)`, as in the other backends, and leads its own process group.
//! runsc gives its own children (the sandbox and the gofer) a parent-death signal, so the
//! chain gateway → `runsc run` → sandbox ends everything when the gateway dies, also by
//! SIGKILL. `kill` asks runsc to kill every process of the container, then SIGKILLs the
//! `runsc run` group; the exit watcher then runs `runsc delete --force` and removes the
//! bundle, runsc's state directory and the sandbox's cgroups. `signal` runs a tiny Python
//! program in the container (`runsc exec`) that sends the signal to the kernel's *main
//! thread* and to every other process of the container: `runsc kill` would hand SIGINT to
//! an arbitrary thread, and CPython only notices it when its main thread wakes (see
//! [`GvisorHandle::signal`]). `signal` and `kill` wait for runsc.
//!
//! **Platform.** `ptrace` (this build has `ptrace` and `kvm`; `kvm` stalls on PVM hosts and
//! `systrap` came in 2023). Syscall-heavy work is slower than in the namespaces backend, and
//! a kernel takes longer to be ready (BENCHMARKS.md, "Measurements behind the code").

#![allow(unsafe_code)]

use super::cgroupfs;
use super::diagnosis::{self, euid, find_on_path, run_command, Diagnosis};
use super::rootfs::{self, ETC_ENTRIES, USR_LINKS};
use super::spawner::Spawner;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use super::namespaces::{argv_files, visible_roots, SYSTEM_PREFIXES};
use super::relocate::{self, KernelView, VenvEntry};
use super::{
    Backend, ExitCause, ExitReason, ExitReport, LaunchSpec, Launched, Limits, Sandbox,
    SandboxError, SandboxHandle,
};

/// Host threads and processes of the runsc machinery (Sentry threads, gofer, ptrace stubs)
/// that count against a pids limit besides the kernel's own.
pub const PIDS_OVERHEAD: u64 = 256;

/// The cgroup (relative to the gateway's own) that holds the sandboxes' cgroups.
const CGROUP_PARENT: &str = "cellgate-gvisor";

/// CFS period for CPU limits.
const CPU_PERIOD_US: u64 = 100_000;

/// Settings of the gvisor backend.
#[derive(Debug, Clone)]
pub struct GvisorConfig {
    /// The runsc binary; `None` means `runsc` from `PATH`.
    pub runsc: Option<PathBuf>,
    /// runsc's `--platform`.
    pub platform: String,
    /// The kernel's uid and gid, inside the sandbox and on the host.
    pub uid: u32,
    pub gid: u32,
    /// More host paths to show read-only at the same path.
    pub extra_ro_paths: Vec<PathBuf>,
    /// Put the sandbox in a cgroup with the launch's limits.
    pub cgroups: bool,
    pub hostname: String,
    /// How long `runsc kill` and `runsc delete` may take.
    pub command_timeout: Duration,
}

impl Default for GvisorConfig {
    fn default() -> GvisorConfig {
        GvisorConfig {
            runsc: None,
            platform: "ptrace".to_owned(),
            uid: 65534,
            gid: 65534,
            extra_ro_paths: Vec::new(),
            cgroups: true,
            hostname: "sandbox".to_owned(),
            command_timeout: Duration::from_secs(10),
        }
    }
}

/// Starts kernels in gVisor sandboxes.
pub struct GvisorSandbox {
    config: GvisorConfig,
    runsc: PathBuf,
    spawner: Spawner,
}

fn setup(message: impl Into<String>) -> SandboxError {
    SandboxError::Setup(message.into())
}

impl GvisorSandbox {
    /// Finds runsc and checks the gateway may use it. Must be called from within a tokio
    /// runtime: the spawner thread registers children with it.
    pub fn new(config: GvisorConfig) -> Result<GvisorSandbox, SandboxError> {
        let runsc = match &config.runsc {
            Some(path) => path.clone(),
            None => diagnosis::find_on_path("runsc").ok_or_else(|| {
                setup("runsc is not on PATH (install it: apt-get install -y runsc)")
            })?,
        };
        // SAFETY: geteuid(2) cannot fail and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            return Err(setup(
                "the gvisor backend needs a root gateway (runsc creates namespaces and cgroups)",
            ));
        }
        let spawner = Spawner::start("cellgate-gvisor-spawner")?;
        if config.cgroups {
            sweep_cgroups();
        }
        tracing::info!(runsc = %runsc.display(), platform = %config.platform, "gvisor sandbox backend ready");
        Ok(GvisorSandbox {
            config,
            runsc,
            spawner,
        })
    }

    /// Gives the runtime directory, the connection file and the workspace to the kernel's
    /// uid (the gofer checks permissions as that uid).
    fn hand_over(&self, spec: &LaunchSpec) -> Result<(), SandboxError> {
        for path in [&spec.runtime_dir, &spec.connection_file, &spec.workspace] {
            match std::os::unix::fs::chown(path, Some(self.config.uid), Some(self.config.gid)) {
                Ok(()) => {}
                Err(err)
                    if err.kind() == io::ErrorKind::NotFound && path == &spec.connection_file => {}
                Err(err) => return Err(setup(format!("hand over {}: {err}", path.display()))),
            }
        }
        Ok(())
    }

    /// The kernel's view (fixed paths, see [`relocate`]) and the host paths still shown
    /// read-only at their own paths.
    fn view(&self, spec: &LaunchSpec) -> Result<(KernelView, Vec<PathBuf>), SandboxError> {
        let program = spec
            .argv
            .first()
            .ok_or_else(|| setup("the kernel's command is empty"))?;
        if !Path::new(program).is_absolute() {
            return Err(setup(format!(
                "the kernel's program {program:?} is not an absolute path"
            )));
        }
        let view = KernelView::of(spec, SYSTEM_PREFIXES)
            .map_err(|err| setup(format!("read the kernel's Python environment: {err}")))?;
        let mut wanted = view.shown_as_is.clone();
        wanted.extend(argv_files(&spec.argv[1..]));
        wanted.extend(self.config.extra_ro_paths.iter().cloned());
        view.rewrite_connection_file(&spec.connection_file)
            .map_err(|err| setup(format!("rewrite the connection file: {err}")))?;
        let ro_paths = visible_roots(wanted, &spec.runtime_dir, &spec.workspace);
        Ok((view, ro_paths))
    }

    async fn launch_gvisor(&self, spec: &LaunchSpec) -> Result<Launched, SandboxError> {
        let (view, ro_paths) = self.view(spec)?;
        self.hand_over(spec)?;
        // The gateway's pid in the name tells a later sweep whether its owner is alive.
        let unique = format!(
            "{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let container_id = format!("cellgate-{unique}");
        let base = spec
            .log_file
            .parent()
            .ok_or_else(|| setup("the log file has no parent directory"))?;
        let bundle = base.join(format!("gvisor-{unique}"));
        let state = bundle.join("state");
        let cgroup_path = format!("{CGROUP_PARENT}/{container_id}");
        // Made (with its limit) here rather than by runsc: runsc removes the cgroups it
        // creates before `runsc run` returns, and the watcher must read the OOM counter
        // first. runsc joins a cgroup that exists and leaves it in place (and its limits to
        // us); the watcher removes it.
        // With a size limit the workspace is a host tmpfs whose pages the sandbox's writes
        // are charged for; without one it is a host directory (reclaimable page cache).
        let cgroup_memory = spec.limits.memory_cgroup_bytes(spec.limits.workspace_bytes);
        let memory_cgroup = (self.config.cgroups && spec.limits.memory_bytes.is_some())
            .then(|| memory_cgroup_dir(&cgroup_path))
            .flatten()
            .filter(|dir| match create_memory_cgroup(dir, cgroup_memory) {
                Ok(()) => true,
                Err(err) => {
                    tracing::warn!(kernel_id = %spec.kernel_id, %err, dir = %dir.display(), "cannot pre-create the memory cgroup: OOM kills will be reported as SIGKILL only");
                    false
                }
            });
        // The pids cgroup too, so its `pids.events` outlives `runsc run`: when the guest's
        // forks exhaust the limit the Sentry dies, and the watcher reports which limit.
        if let (true, Some(pids)) = (self.config.cgroups, spec.limits.pids) {
            if let Some(dir) = controller_cgroup_dir("pids", &cgroup_path) {
                let made = std::fs::create_dir_all(&dir).and_then(|()| {
                    std::fs::write(dir.join("pids.max"), (pids + PIDS_OVERHEAD).to_string())
                });
                if let Err(err) = made {
                    tracing::warn!(kernel_id = %spec.kernel_id, %err, dir = %dir.display(), "cannot pre-create the pids cgroup: runsc sets the limit, and its exhaustion is reported as a plain death");
                    let _ = std::fs::remove_dir(&dir);
                }
            }
        }
        let built = tokio::task::spawn_blocking({
            let bundle = bundle.clone();
            let config = self.config.clone();
            let spec = spec.clone();
            let cgroup = cgroup_path.clone();
            move || write_bundle(&bundle, &config, &spec, &view, &ro_paths, &cgroup)
        })
        .await
        .map_err(|err| setup(format!("bundle task: {err}")))?;
        if let Err(err) = built {
            let _ = std::fs::remove_dir_all(&bundle);
            return Err(err);
        }
        let open_log = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&spec.log_file)
                .map_err(|err| setup(format!("open {}: {err}", spec.log_file.display())))
        };
        let (log, log_err) = (open_log()?, open_log()?);
        let mut command = Command::new(&self.runsc);
        if let Some(bytes) = spec.limits.workspace_bytes {
            let mount =
                WorkspaceMount::new(&spec.workspace, bytes, self.config.uid, self.config.gid)?;
            // SAFETY: the closure runs in the forked child before exec and only makes
            // system calls (unshare, mount) on memory prepared before the fork.
            unsafe {
                command.pre_exec(move || mount.apply());
            }
        }
        command
            .args(self.global_args(&state))
            // Explicit because the file API depends on it (see the module doc).
            .args([
                "--network=none",
                "--host-uds=all",
                "--file-access-mounts=shared",
            ])
            .args(if self.config.cgroups {
                &[][..]
            } else {
                &["--ignore-cgroups"][..]
            })
            .arg("run")
            .arg("--bundle")
            .arg(&bundle)
            .arg(&container_id)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .current_dir(&bundle)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0)
            .kill_on_drop(false);
        let child = match self.spawner.spawn(command).await {
            Ok(child) => child,
            Err(source) => {
                let _ = std::fs::remove_dir_all(&bundle);
                return Err(SandboxError::Spawn {
                    program: self.runsc.display().to_string(),
                    source,
                });
            }
        };
        let pid = child.id().unwrap_or(0);
        // Opened before the watcher can reap `runsc run`, so it names that process and no
        // later one that reuses its pid.
        let pidfd = i32::try_from(pid)
            .ok()
            .filter(|&pid| pid > 0)
            .and_then(|pid| super::namespaces::sys::pidfd_open(pid).ok());
        let exited = Arc::new(AtomicBool::new(false));
        let (exit_tx, exit_rx) = watch::channel(None);
        let runsc = Runsc {
            program: self.runsc.clone(),
            global: self.global_args(&state),
            id: container_id.clone(),
            timeout: self.config.command_timeout,
        };
        let handle_cgroup = self.config.cgroups.then(|| cgroup_path.clone());
        tokio::spawn(watch_exit(
            child,
            cgroup_path,
            exited.clone(),
            runsc.clone(),
            bundle,
            cgroup_memory,
            memory_cgroup,
            exit_tx,
        ));
        tracing::info!(kernel_id = %spec.kernel_id, container = %container_id, runsc_pid = pid, "kernel started in gVisor");
        Ok(Launched {
            handle: Arc::new(GvisorHandle {
                pid,
                pidfd,
                private_workspace: spec.limits.workspace_bytes.is_some(),
                uid: self.config.uid,
                gid: self.config.gid,
                exited,
                runsc,
                cgroups_path: handle_cgroup,
            }),
            exit: exit_rx,
            connection: spec.connection.clone(),
        })
    }

    fn global_args(&self, state: &Path) -> Vec<String> {
        vec![
            "--root".to_owned(),
            state.display().to_string(),
            "--platform".to_owned(),
            self.config.platform.clone(),
        ]
    }
}

impl Sandbox for GvisorSandbox {
    fn backend(&self) -> Backend {
        Backend::Gvisor
    }

    fn launch<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<Launched, SandboxError>> {
        Box::pin(self.launch_gvisor(spec))
    }
}

/// Writes `bundle/config.json` and `bundle/rootfs`.
fn write_bundle(
    bundle: &Path,
    config: &GvisorConfig,
    spec: &LaunchSpec,
    view: &KernelView,
    ro_paths: &[PathBuf],
    cgroup: &str,
) -> Result<(), SandboxError> {
    let io = |what: &str, path: &Path| {
        let what = format!("{what} {}", path.display());
        move |err: io::Error| setup(format!("{what}: {err}"))
    };
    let rootfs = bundle.join("rootfs");
    std::fs::create_dir_all(rootfs.join("etc")).map_err(io("mkdir", &rootfs))?;
    for dir in ["usr", "proc", "tmp", "dev"] {
        std::fs::create_dir_all(rootfs.join(dir)).map_err(io("mkdir", &rootfs))?;
    }
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "mode=1777"]}),
        ro_bind(Path::new("/usr")),
    ];
    for name in USR_LINKS {
        let host = Path::new("/").join(name);
        match std::fs::read_link(&host) {
            Ok(target) => std::os::unix::fs::symlink(&target, rootfs.join(name))
                .map_err(io("symlink", &rootfs.join(name)))?,
            Err(_) if host.is_dir() => {
                std::fs::create_dir_all(rootfs.join(name)).map_err(io("mkdir", &host))?;
                mounts.push(ro_bind(&host));
            }
            Err(_) => {}
        }
    }
    for (name, contents) in etc_files(config) {
        let path = rootfs.join("etc").join(name);
        std::fs::write(&path, contents).map_err(io("write", &path))?;
    }
    // (host, inside, writable)
    let mut binds: Vec<(PathBuf, PathBuf, bool)> = ETC_ENTRIES
        .iter()
        .map(PathBuf::from)
        .filter(|p| p.exists())
        .map(|p| (p.clone(), p, false))
        .collect();
    binds.extend(ro_paths.iter().map(|p| (p.clone(), p.clone(), false)));
    if let Some(prefix) = &view.python_prefix {
        binds.push((prefix.clone(), PathBuf::from(relocate::PYTHON), false));
    }
    for entry in &view.venv {
        let in_rootfs = |inside: &Path| rootfs.join(inside.strip_prefix("/").unwrap_or(inside));
        match entry {
            VenvEntry::File {
                inside,
                contents,
                executable,
            } => {
                use std::os::unix::fs::PermissionsExt;
                let path = in_rootfs(inside);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(io("mkdir", parent))?;
                }
                std::fs::write(&path, contents).map_err(io("write", &path))?;
                let mode = if *executable { 0o755 } else { 0o644 };
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                    .map_err(io("chmod", &path))?;
            }
            VenvEntry::Symlink { inside, points_to } => {
                let path = in_rootfs(inside);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(io("mkdir", parent))?;
                }
                std::os::unix::fs::symlink(points_to, &path).map_err(io("symlink", &path))?;
            }
            VenvEntry::Bind { host, inside } => binds.push((host.clone(), inside.clone(), false)),
        }
    }
    binds.push((
        spec.runtime_dir.clone(),
        PathBuf::from(relocate::RUN_DIR),
        true,
    ));
    // With a size limit, `runsc run`'s own mount namespace has a tmpfs of that size at the
    // host path (see `WorkspaceMount`); the host's directory is never what the kernel writes
    // to.
    binds.push((
        spec.workspace.clone(),
        PathBuf::from(relocate::WORKSPACE),
        true,
    ));
    for (host, target, writable) in binds {
        let inside = rootfs.join(target.strip_prefix("/").unwrap_or(&target));
        // Mount points must exist in the read-only root; under /tmp (a tmpfs) runsc makes
        // them itself, but creating them here too is harmless.
        if host.is_dir() {
            std::fs::create_dir_all(&inside).map_err(io("mkdir", &inside))?;
        } else {
            if let Some(parent) = inside.parent() {
                std::fs::create_dir_all(parent).map_err(io("mkdir", parent))?;
            }
            std::fs::write(&inside, b"").map_err(io("create", &inside))?;
        }
        mounts.push(if writable {
            json!({"destination": target, "type": "bind", "source": host,
                   "options": ["rbind", "rw", "nosuid", "nodev"]})
        } else {
            ro_bind_at(&host, &target)
        });
    }
    for dir in &view.masked {
        // After the binds they sit in (OCI mounts apply in order).
        mounts.push(
            json!({"destination": dir, "type": "tmpfs", "source": "tmpfs",
                           "options": ["ro", "nosuid", "nodev", "noexec", "size=4096"]}),
        );
    }
    let env: Vec<String> = view.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let no_caps = json!([]);
    let mut linux = json!({
        "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                       {"type": "uts"}, {"type": "mount"}],
    });
    if config.cgroups {
        linux["cgroupsPath"] = json!(cgroup);
        linux["resources"] = resources(&spec.limits);
    }
    let oci = json!({
        "ociVersion": "1.0.2",
        "hostname": config.hostname,
        "process": {
            "terminal": false,
            "user": {"uid": config.uid, "gid": config.gid},
            "args": view.argv,
            "env": env,
            "cwd": relocate::WORKSPACE,
            "capabilities": {"bounding": no_caps, "effective": no_caps, "inheritable": no_caps,
                             "permitted": no_caps, "ambient": no_caps},
            "noNewPrivileges": true,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}],
        },
        "root": {"path": "rootfs", "readonly": true},
        "mounts": mounts,
        "linux": linux,
    });
    let text =
        serde_json::to_vec_pretty(&oci).map_err(|err| setup(format!("config.json: {err}")))?;
    let path = bundle.join("config.json");
    std::fs::write(&path, text).map_err(io("write", &path))
}

fn ro_bind(host: &Path) -> Value {
    ro_bind_at(host, host)
}

fn ro_bind_at(host: &Path, target: &Path) -> Value {
    json!({"destination": target, "type": "bind", "source": host,
           "options": ["rbind", "ro", "nosuid", "nodev"]})
}

/// OCI `linux.resources` for the limits.
fn resources(limits: &Limits) -> Value {
    let mut resources = json!({});
    if let Some(bytes) = limits.memory_cgroup_bytes(limits.workspace_bytes) {
        resources["memory"] = json!({"limit": bytes, "swap": bytes});
    }
    if let Some(pids) = limits.pids {
        resources["pids"] = json!({"limit": pids + PIDS_OVERHEAD});
    }
    if let Some(millis) = limits.cpu_millis {
        let quota = u64::from(millis) * CPU_PERIOD_US / 1000;
        resources["cpu"] = json!({"quota": quota.max(1000), "period": CPU_PERIOD_US});
    }
    resources
}

/// The generated `/etc` files (see `sandbox::rootfs`).
fn etc_files(config: &GvisorConfig) -> Vec<(&'static str, String)> {
    rootfs::etc_files(
        config.uid,
        config.gid,
        &config.hostname,
        Path::new(relocate::WORKSPACE),
    )
}

/// How to reach one container through runsc's command line.
#[derive(Clone)]
struct Runsc {
    program: PathBuf,
    global: Vec<String>,
    id: String,
    timeout: Duration,
}

impl Runsc {
    /// Runs `runsc <global> <args…> <id> [tail…]` to completion (blocking, bounded).
    fn run(&self, args: &[&str], tail: &[&str]) -> io::Result<()> {
        let mut child = std::process::Command::new(&self.program)
            .args(&self.global)
            .args(args)
            .arg(&self.id)
            .args(tail)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                if status.success() {
                    return Ok(());
                }
                let mut stderr = String::new();
                if let Some(mut pipe) = child.stderr.take() {
                    use std::io::Read;
                    let _ = pipe.read_to_string(&mut stderr);
                }
                return Err(io::Error::other(format!(
                    "runsc {} failed ({status}): {}",
                    args.join(" "),
                    stderr.trim()
                )));
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other(format!(
                    "runsc {} did not finish within {:?}",
                    args.join(" "),
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn watch_exit(
    mut child: Child,
    cgroups_path: String,
    exited: Arc<AtomicBool>,
    runsc: Runsc,
    bundle: PathBuf,
    memory_limit: Option<u64>,
    memory_cgroup: Option<PathBuf>,
    exit_tx: watch::Sender<Option<ExitReport>>,
) {
    let status = child.wait().await;
    exited.store(true, Ordering::SeqCst);
    let pid = child.id();
    // Whatever of the `runsc run` group is left (nothing, normally).
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory involved.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    // "Gone" means no process left: the Sentry and the gofer die from their parent-death
    // signal a moment after `runsc run`; their (pre-created) pids cgroup says when.
    if let Some(procs) =
        controller_cgroup_dir("pids", &cgroups_path).map(|dir| dir.join("cgroup.procs"))
    {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while std::fs::read_to_string(&procs).is_ok_and(|t| !t.trim().is_empty())
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // Read before `runsc delete` removes the cgroups.
    let pids_hits = pids_limit_hits(&cgroups_path).unwrap_or(0);
    let oom_kills = memory_cgroup
        .as_deref()
        .and_then(|dir| std::fs::read_to_string(dir.join("memory.oom_control")).ok())
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
        .or_else(|| {
            let dir = memory_cgroup.as_deref()?;
            let events = std::fs::read_to_string(dir.join("memory.events")).ok()?;
            events
                .lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    let report = match status {
        Ok(status) => {
            // runsc exits with the container's status, 128 + n for a signal.
            let (code, signal) = match (status.code(), status.signal()) {
                (Some(code), _) if code > 128 => (None, Some(code - 128)),
                (code, signal) => (code, signal),
            };
            // The OOM killer may pick any process of the sandbox: the sentry (runsc reports
            // SIGKILL) or a runsc helper (runsc then fails with its own status, seen as 2 on
            // a CI run). Any abnormal end with an OOM kill counted is an out-of-memory end.
            let abnormal = signal.is_some() || code != Some(0);
            let reason = if abnormal && oom_kills > 0 {
                Some(ExitReason::new(
                    ExitCause::OutOfMemory,
                    match memory_limit {
                        Some(bytes) => format!(
                            "kernel process killed by the out-of-memory killer (the sandbox's limit of {bytes} bytes, \
                             workspace files included; gVisor ends the whole sandbox)"
                        ),
                        None => "kernel process killed by the out-of-memory killer".to_owned(),
                    },
                ))
            } else if abnormal && pids_hits > 0 {
                // The Sentry cannot run without creating threads: when the guest's forks
                // exhaust the pids limit, gVisor itself fails and the sandbox ends.
                Some(ExitReason::new(
                    ExitCause::PidsLimit,
                    format!(
                        "the sandbox reached its process limit ({}: {pids_hits} forks refused) and gVisor ended it",
                        crate::sandbox::PIDS_LIMIT_REASON
                    ),
                ))
            } else {
                None
            };
            ExitReport {
                code,
                signal,
                reason,
            }
        }
        Err(err) => ExitReport {
            code: None,
            signal: None,
            reason: Some(ExitReason::new(
                ExitCause::SandboxFailed,
                format!("lost track of runsc: {err}"),
            )),
        },
    };
    // Reported at once (a death within a second), then cleaned up: the Sentry and the gofer
    // already have their parent-death signal from `runsc run`, and `runsc delete` makes sure.
    let _ = exit_tx.send(Some(report));
    let _ = tokio::task::spawn_blocking({
        let runsc = runsc.clone();
        move || {
            let _ = runsc.run(&["delete", "--force"], &[]);
        }
    })
    .await;
    let cleanup = tokio::task::spawn_blocking(move || {
        let _ = std::fs::remove_dir_all(&bundle);
        // runsc leaves its cgroups in place when one of them existed before (the memory
        // and pids cgroups made by the launch): remove the sandbox's cgroup in every
        // hierarchy. Each is empty once the sandbox's last process is gone.
        for dir in cgroup_dirs(&cgroups_path) {
            for _ in 0..50 {
                match std::fs::remove_dir(&dir) {
                    Err(err) if err.kind() != io::ErrorKind::NotFound => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => break,
                }
            }
        }
    });
    let _ = cleanup.await;
}

/// The interpreter that runs [`signal_script`] inside the sandbox (`/usr` is always shown).
const SIGNAL_PYTHON: &str = "/usr/bin/python3";

/// Sends signal `argv[1]` to the main thread of PID 1 and to every other process.
fn signal_script() -> String {
    format!(
        "import os, sys, ctypes\n\
         sig = int(sys.argv[1])\n\
         ctypes.CDLL(None, use_errno=True).syscall({tgkill}, 1, 1, sig)\n\
         for p in os.listdir('/proc'):\n    \
             if p.isdigit() and int(p) not in (1, os.getpid()):\n        \
                 try: os.kill(int(p), sig)\n        \
                 except OSError: pass\n",
        tgkill = libc::SYS_tgkill
    )
}

/// The size-limited workspace of one sandbox: a tmpfs mounted over the workspace directory
/// in a mount namespace made for `runsc run` alone, in its child before exec.
struct WorkspaceMount {
    target: std::ffi::CString,
    options: std::ffi::CString,
}

impl WorkspaceMount {
    fn new(
        workspace: &Path,
        bytes: u64,
        uid: u32,
        gid: u32,
    ) -> Result<WorkspaceMount, SandboxError> {
        use std::os::unix::ffi::OsStrExt;
        let target = std::ffi::CString::new(workspace.as_os_str().as_bytes()).map_err(|_| {
            setup(format!(
                "the workspace path {} has a NUL",
                workspace.display()
            ))
        })?;
        let options = std::ffi::CString::new(format!("size={bytes},mode=0700,uid={uid},gid={gid}"))
            .map_err(|_| setup("tmpfs options with a NUL"))?;
        Ok(WorkspaceMount { target, options })
    }

    /// Runs in the forked child: only system calls, no allocation.
    fn apply(&self) -> io::Result<()> {
        let check = |rc: libc::c_int| {
            if rc == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        };
        // SAFETY: unshare(2) and mount(2) with NUL-terminated strings that outlive the
        // calls (owned by `self`) or null pointers where the call allows them.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            // Nothing mounted from here on may propagate back to the host's namespace.
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"cellgate-workspace".as_ptr(),
                self.target.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                self.options.as_ptr().cast(),
            ))
        }
    }
}

/// Control of one gVisor sandbox.
struct GvisorHandle {
    /// `runsc run`'s pid, leader of its process group.
    pid: u32,
    /// A pidfd of `runsc run`, when the host has pidfds (Linux 5.3+).
    pidfd: Option<std::os::fd::OwnedFd>,
    /// Whether the workspace is the tmpfs in `runsc run`'s mount namespace (a size limit)
    /// rather than the host directory.
    private_workspace: bool,
    /// The kernel's uid and gid, for the signalling program.
    uid: u32,
    gid: u32,
    exited: Arc<AtomicBool>,
    runsc: Runsc,
    /// The sandbox's cgroup (relative), when runsc manages cgroups.
    cgroups_path: Option<String>,
}

impl SandboxHandle for GvisorHandle {
    /// The size-limited workspace exists only in `runsc run`'s mount namespace: reached
    /// through that process's root in /proc, as the namespaces backend reaches its own.
    fn workspace_root(&self, workspace: &Path) -> Option<(PathBuf, PathBuf)> {
        if !self.private_workspace {
            return Some((workspace.to_owned(), PathBuf::from(".")));
        }
        if self.pid == 0 || self.exited.load(Ordering::SeqCst) {
            return None;
        }
        let relative = workspace.strip_prefix("/").unwrap_or(workspace);
        Some((
            PathBuf::from(format!("/proc/{}/root", self.pid)),
            relative.to_owned(),
        ))
    }

    /// Whether `runsc run` still exists, by its pidfd: its pid cannot have been reused while
    /// the pidfd says so. Without a pidfd the pid cannot be pinned, so a private workspace
    /// counts as unreachable.
    fn alive(&self) -> bool {
        if self.exited.load(Ordering::SeqCst) {
            return false;
        }
        match &self.pidfd {
            Some(pidfd) => !super::namespaces::sys::pidfd_exited(pidfd),
            None => !self.private_workspace,
        }
    }

    /// Every guest process has a ptrace stub on the host, so a refused guest fork shows in
    /// the `pids` cgroup of the sandbox like any other.
    fn pids_limit_hits(&self) -> Option<u64> {
        pids_limit_hits(self.cgroups_path.as_deref()?)
    }

    /// The kernel has no host process of its own under gVisor (the Sentry runs it).
    fn pid(&self) -> Option<u32> {
        None
    }

    /// A process-directed signal in gVisor may be handed to any thread that does not block
    /// it, and CPython only notices a signal when its *main* thread wakes: a SIGINT that
    /// lands on one of ipykernel's helper threads never interrupts `time.sleep(60)`. So a
    /// small program run inside the sandbox (`runsc exec`) sends the signal to the kernel's
    /// main thread (`tgkill(1, 1, sig)`: the kernel is the container's PID 1) and to every
    /// other process of the container, like a process-group signal. Without a Python in
    /// `/usr` to run it, `runsc kill --all` is the fallback.
    fn signal(&self, signal: i32) -> Result<(), SandboxError> {
        if self.exited.load(Ordering::SeqCst) {
            return Ok(());
        }
        let sig = signal.to_string();
        let result = if Path::new(SIGNAL_PYTHON).exists() {
            let user = format!("{}:{}", self.uid, self.gid);
            let script = signal_script();
            self.runsc.run(
                &["exec", "--user", &user, "--cwd", "/"],
                &[SIGNAL_PYTHON, "-S", "-c", &script, &sig],
            )
        } else {
            self.runsc.run(&["kill", "--all"], &[&sig])
        };
        match result {
            Ok(()) => Ok(()),
            // The container may have ended in the meantime.
            Err(_) if self.exited.load(Ordering::SeqCst) => Ok(()),
            Err(err) => Err(SandboxError::Signal(err)),
        }
    }

    fn kill(&self) -> Result<(), SandboxError> {
        if self.exited.load(Ordering::SeqCst) {
            return Ok(());
        }
        // Let runsc end the container's processes (so `runsc run` reaps its children), then
        // make sure: the sandbox and gofer die with `runsc run` by their parent-death signal.
        let _ = self.runsc.run(&["kill", "--all"], &["KILL"]);
        if self.exited.load(Ordering::SeqCst) || self.pid == 0 {
            return Ok(());
        }
        let pid = i32::try_from(self.pid)
            .map_err(|_| SandboxError::Signal(io::Error::other("pid out of range")))?;
        // SAFETY: kill(2) with a negative pid signals runsc's process group; `runsc run` is
        // not reaped before `exited` is set, so the group id is not reused.
        let rc = unsafe { libc::kill(-pid, libc::SIGKILL) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::ESRCH) {
                return Err(SandboxError::Signal(err));
            }
        }
        Ok(())
    }
}

/// How many forks the sandbox's pids cgroup refused (`max` in `pids.events`).
fn pids_limit_hits(cgroups_path: &str) -> Option<u64> {
    cgroup_dirs(cgroups_path).into_iter().find_map(|dir| {
        std::fs::read_to_string(dir.join("pids.events"))
            .ok()?
            .lines()
            .find_map(|line| line.strip_prefix("max "))
            .and_then(|n| n.trim().parse().ok())
    })
}

/// Where runsc makes the memory cgroup for the relative `cgroups_path`: below the gateway's
/// own cgroup in the memory hierarchy (v1), or in the unified hierarchy (v2).
fn memory_cgroup_dir(cgroups_path: &str) -> Option<PathBuf> {
    controller_cgroup_dir("memory", cgroups_path)
}

/// The same for another v1 controller (or the unified hierarchy).
fn controller_cgroup_dir(controller: &str, cgroups_path: &str) -> Option<PathBuf> {
    let tables = cgroupfs::Tables::read();
    let own = if tables
        .own
        .iter()
        .any(|o| o.controllers.iter().any(|c| c == controller))
    {
        tables.v1_dir(controller)
    } else {
        tables.v2_dir()
    };
    own.map(|dir| dir.join(cgroups_path))
}

/// Creates the sandbox's memory cgroup with its limit (swap included, so swap is no way
/// around it).
fn create_memory_cgroup(dir: &Path, limit: Option<u64>) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let Some(bytes) = limit else {
        return Ok(());
    };
    let bytes = bytes.to_string();
    let result = if dir.join("memory.limit_in_bytes").exists() {
        std::fs::write(dir.join("memory.limit_in_bytes"), &bytes).and_then(|()| {
            // Absent without swap accounting: then there is no swap to escape to either.
            match std::fs::write(dir.join("memory.memsw.limit_in_bytes"), &bytes) {
                Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
                _ => Ok(()),
            }
        })
    } else {
        std::fs::write(dir.join("memory.max"), &bytes).and_then(|()| {
            match std::fs::write(dir.join("memory.swap.max"), "0") {
                Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
                _ => Ok(()),
            }
        })
    };
    if result.is_err() {
        let _ = std::fs::remove_dir(dir);
    }
    result
}

/// The directory of the relative cgroup path `cgroups_path` in every cgroup hierarchy this
/// process is in (v1: one per mounted hierarchy; v2: the unified one).
fn cgroup_dirs(cgroups_path: &str) -> Vec<PathBuf> {
    cgroupfs::Tables::read()
        .own_dirs()
        .into_iter()
        .map(|dir| dir.join(cgroups_path))
        .collect()
}

/// Age past which an empty sandbox cgroup without its gateway's pid counts as left over.
const SWEEP_MIN_AGE: Duration = Duration::from_secs(120);

/// Removes the empty cgroups of sandboxes whose `runsc run` was killed before it could
/// (a gateway that died). A cgroup with processes in it cannot be removed, so running
/// sandboxes of other gateways keep theirs.
fn sweep_cgroups() {
    for parent in cgroup_dirs(CGROUP_PARENT) {
        let Ok(entries) = std::fs::read_dir(&parent) else {
            continue;
        };
        for entry in entries.flatten() {
            // Only those of dead gateways (the pid in the name): a live gateway may have just
            // made a sandbox's cgroup that runsc has not joined yet (empty, so removable).
            // Names without a pid: only old ones.
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix("cellgate-") else {
                continue;
            };
            let owner_alive = rest
                .split_once('-')
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
                .map(|pid| Path::new(&format!("/proc/{pid}")).exists());
            let old = || {
                entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > SWEEP_MIN_AGE)
            };
            let stale = entry.path().is_dir() && owner_alive.map_or_else(old, |alive| !alive);
            if stale {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}

/// Whether this host can run gVisor sandboxes: runsc present and working, a root gateway;
/// with `probe`, `runsc do /bin/true`.
pub async fn diagnose(probe: bool) -> Diagnosis {
    let mut s = Diagnosis::new("gvisor");
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn bundle_shows_only_what_the_kernel_needs() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("k/run");
        let work = dir.path().join("k/work");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let spec = LaunchSpec {
            kernel_id: "k".into(),
            argv: vec!["/usr/bin/python3".into(), "-c".into(), "pass".into()],
            env: BTreeMap::from([("PATH".to_owned(), "/usr/bin".to_owned())]),
            connection_file: run.join("c.json"),
            connection: crate::protocol::ConnectionInfo::ipc(&run.join("g1"), "k".into(), "p"),
            runtime_dir: run.clone(),
            workspace: work.clone(),
            log_file: dir.path().join("k/kernel.log"),
            limits: Limits {
                memory_bytes: Some(1 << 30),
                pids: Some(10),
                cpu_millis: Some(500),
                workspace_bytes: None,
            },
            egress_socket: None,
        };
        let bundle = dir.path().join("bundle");
        let view = KernelView::of(&spec, SYSTEM_PREFIXES).unwrap();
        write_bundle(
            &bundle,
            &GvisorConfig::default(),
            &spec,
            &view,
            &[],
            "cellgate-gvisor/x",
        )
        .unwrap();
        let config: Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["root"]["readonly"], true);
        assert_eq!(config["process"]["user"]["uid"], 65534);
        assert_eq!(config["process"]["noNewPrivileges"], true);
        assert_eq!(config["process"]["capabilities"]["bounding"], json!([]));
        assert_eq!(config["process"]["cwd"], "/home/user");
        assert_eq!(
            config["linux"]["resources"]["pids"]["limit"],
            10 + PIDS_OVERHEAD
        );
        assert_eq!(config["linux"]["resources"]["cpu"]["quota"], 50_000);
        let mounts = config["mounts"].as_array().unwrap();
        let find = |dest: &Path| {
            mounts
                .iter()
                .find(|m| m["destination"] == json!(dest))
                .unwrap_or_else(|| panic!("no mount at {}", dest.display()))
        };
        let rw = |m: &Value| m["options"].as_array().unwrap().contains(&json!("rw"));
        let (run_mount, work_mount) = (
            find(Path::new("/run/cellgate")),
            find(Path::new("/home/user")),
        );
        assert!(rw(run_mount), "runtime dir writable at its fixed path");
        assert_eq!(run_mount["source"], json!(run));
        assert!(rw(work_mount), "workspace writable");
        assert_eq!(work_mount["source"], json!(work));
        assert!(!rw(find(Path::new("/usr"))));
        assert!(mounts
            .iter()
            .all(|m| m["destination"] != "/etc/shadow" && m["destination"] != "/"));
        let passwd = std::fs::read_to_string(bundle.join("rootfs/etc/passwd")).unwrap();
        assert!(passwd.contains("kernel:x:65534:65534"));
    }

    #[test]
    fn the_signal_program_is_valid_python() {
        if !Path::new(SIGNAL_PYTHON).exists() {
            return;
        }
        let status = std::process::Command::new(SIGNAL_PYTHON)
            .args(["-c", "import sys; compile(sys.argv[1], 'signal', 'exec')"])
            .arg(signal_script())
            .status()
            .unwrap();
        assert!(status.success());
    }
}
