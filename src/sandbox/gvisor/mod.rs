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
//!   *Lifetime*, unless a keeper holds the namespace: *Outliving the gateway*). The gateway
//!   reaches it through `/proc/<runsc pid>/root` (or the keeper's; see
//!   [`GvisorHandle::workspace_root`](GvisorHandle#method.workspace_root)), which is what
//!   gives gVisor sessions the file API and `outputs/` artifacts. Without a limit, the host
//!   directory itself. (A tmpfs of the Sentry would keep the files out of the gateway's
//!   reach; a host directory with no limit let an attack test write 45 GB; see
//!   [`workspace`].) The tmpfs's pages are charged to the memory
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
//! [`PIDS_OVERHEAD`] is added to the policy's number; a refused guest fork shows in the
//! sandbox's `pids` cgroup like any other (a ptrace stub per guest process).
//! The Sentry synthesises the host-wide `/proc/sys/kernel/random/boot_id` and
//! `/proc/cmdline` (the namespaces backend masks them with files of its own).
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
//! [`GvisorHandle::signal`](GvisorHandle#method.signal)). `signal` and `kill` wait for runsc.
//!
//! **Outliving the gateway** (`--kernels-outlive-gateway`, with a state directory; see
//! [`survival`] and [`keeper`]). The chain above is kept, with one link added that does not
//! depend on the gateway: a **keeper**, this binary run with [`GVISOR_KEEPER_ARG`], spawned
//! *without* a parent-death signal in a mount namespace of its own (the workspace tmpfs is
//! mounted there, in the keeper's child before exec, exactly as for `runsc run` above).
//! The keeper runs `runsc run` attached as its own child (parent-death signal towards the
//! keeper), so killing the keeper still ends everything, and nothing ends with the gateway.
//! Why a keeper rather than `runsc run --detach` or `create` + `start` (this 2022 build has
//! both): a detached container has no process of ours to hold the workspace's mount
//! namespace (the gofer pivots into the container's root), to be told its exit status
//! (`runsc wait` must then run somewhere), or to end it when no gateway comes back; the
//! namespaces backend's keeper cannot be reused as it is (it is that backend's helper,
//! single-threaded around the sandbox's init), but its key exchange and records are
//! (`namespaces::survival`).
//!
//! What outlives the gateway: the keeper, `runsc run`, the Sentry and the gofer, the
//! sandbox's cgroups, and the kernel's directories, which live at
//! `<state dir>/sandboxes/<kernel id>/k/` instead of below the gateway's runtime root (see
//! [`Sandbox::kernel_dir`]): the runtime directory whose `ipc://` sockets `--host-uds` made
//! real host sockets (the next gateway connects to the same paths), the workspace's mount
//! point, the kernel's log (`runsc run` writes to the keeper's stderr, the log file), and
//! the bundle with runsc's `--root` state in it. gVisor kernels have no egress (no network
//! at all), so there is no proxy socket to keep. The state directory must leave the socket
//! paths under 108 bytes (`<state dir>` under ~40 characters); a longer one turns survival
//! off for gVisor with a warning at start.
//!
//! What the next gateway re-finds: the record `record.json` (0600 in a 0700 directory; the
//! keeper's pid and start time, the container id, runsc's `--root`, the cgroups, the
//! gateway's view of the connection, the kernel's key), written once the keeper has started
//! `runsc run`. Adopting, a gateway opens a pidfd of the keeper, checks its start time (a
//! reused pid fails), answers the keeper's challenge on `control-g<generation>.sock` with
//! an HMAC under the kernel's key (`cellgate-adopt-v1:`), then connects to the kernel's
//! sockets with that key. It reaches the workspace through `/proc/<keeper>/root`, signals
//! and kills through runsc with the recorded `--root`, and is told the exit status by the
//! keeper (`exited` on the control connection, with the OOM and pids counters), unlike an
//! adopted namespaces kernel. A keeper that is gone means the sandbox is lost
//! (`sandbox_lost`); what it left is removed (`runsc delete`, bundle, cgroups, directories),
//! at the backend's start for every such record, and at the failed adoption.
//!
//! What ends an orphan: the keeper counts the launching gateway as there while its command
//! pipe (the keeper's stdin) is open, and an adopting gateway while its control connection
//! is. With neither for `--orphan-grace`, it ends the container (`runsc kill`, then
//! `runsc run` killed) and, once `runsc run` has ended, removes the container, bundle,
//! cgroups, the kernel's directories and its control socket; the record stays for the next
//! gateway to report the session's sandbox lost. A stopping gateway (SIGTERM) closes its
//! pipes to the keepers of API v1 sessions' kernels (detach) and shuts the others down, as
//! the namespaces backend does.
//!
//! **The container's init.** The container's first process is its PID 1; the kernel is
//! started under Debian's `tini` (`bundle::INIT`, from `/usr`), which reaps the orphans cells
//! leave (a kernel as PID 1 never would: zombies holding pids until the session ended) and
//! has the kernel as its only child. A Linux init cannot be killed from inside its pid
//! namespace, gVisor's can: the bundle's OCI seccomp profile (`--oci-seccomp`) refuses
//! signals and ptrace aimed at PID 1, so a cell's `kill -9 1` does nothing, as elsewhere.
//! Without tini on the host the kernel is PID 1 as before, and `cellgate doctor` warns.
//!
//! **Platform.** `ptrace` (this build has `ptrace` and `kvm`; `kvm` stalls on PVM hosts and
//! `systrap` came in 2023). Syscall-heavy work is slower than in the namespaces backend, and
//! a kernel takes longer to be ready (BENCHMARKS.md, "Measurements behind the code").
//!
//! # Modules
//!
//! * [`bundle`]: the OCI bundle (`config.json`, the rootfs's mount points and `/etc`);
//! * [`workspace`]: the size-limited workspace, a tmpfs only `runsc run` sees;
//! * [`cgroups`]: the memory and pids cgroups the gateway makes, reads and sweeps;
//! * [`runsc`]: runsc's command line for one container (`kill`, `exec`, `delete`);
//! * [`keeper`]: the process that keeps a sandbox going without its gateway;
//! * [`survival`]: a kept sandbox's launch, record, adoption and sweep;
//! * [`exit`]: the exit watcher (one [`ExitReport`](super::ExitReport), then the clean-up);
//! * [`handle`]: [`GvisorHandle`], the gateway's control of a running sandbox;
//! * [`diagnose`](mod@diagnose): what `cellgate doctor` checks;
//! * [`error`]: how a failed launch is reported.

mod bundle;
mod cgroups;
mod diagnose;
mod error;
mod exit;
mod handle;
mod keeper;
mod runsc;
mod survival;
mod workspace;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::process::Command;
use tokio::sync::watch;

use super::diagnosis;
use super::host_paths::{argv_files, visible_roots, SYSTEM_PREFIXES};
use super::namespaces::survival::Survival;
use super::relocate::KernelView;
use super::spawner::Spawner;
use super::{Backend, LaunchSpec, Launched, Sandbox, SandboxError};
use bundle::write_bundle;
use cgroups::{
    controller_cgroup_dir, create_memory_cgroup, create_pids_cgroup, memory_cgroup_dir,
    sweep_cgroups, CGROUP_PARENT,
};
pub use diagnose::diagnose;
use error::setup;
use exit::watch_exit;
use handle::GvisorHandle;
pub use keeper::{gvisor_keeper_main, GVISOR_KEEPER_ARG};
use runsc::Runsc;
use workspace::WorkspaceMount;

/// Host threads and processes of the runsc machinery (Sentry threads, gofer, ptrace stubs)
/// that count against a pids limit besides the kernel's own.
pub const PIDS_OVERHEAD: u64 = 256;

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
    /// Kernels outlive the gateway, each under a keeper, for the next gateway on the same
    /// state directory to adopt (see *Lifetime*); `None`: they end with it.
    pub survival: Option<Survival>,
    /// The binary run as a kept sandbox's keeper with [`GVISOR_KEEPER_ARG`] (this one).
    pub keeper_program: PathBuf,
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
            survival: None,
            keeper_program: PathBuf::from("/proc/self/exe"),
        }
    }
}

/// Starts kernels in gVisor sandboxes.
pub struct GvisorSandbox {
    config: GvisorConfig,
    runsc: PathBuf,
    spawner: Spawner,
}

impl GvisorSandbox {
    /// Finds runsc and checks the gateway may use it. Must be called from within a tokio
    /// runtime: the spawner thread registers children with it.
    #[allow(unsafe_code)] // geteuid(2)
    pub fn new(mut config: GvisorConfig) -> Result<GvisorSandbox, SandboxError> {
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
        if let Some(kept) = &config.survival {
            if kept.kept_paths_fit() {
                survival::sweep(kept, config.command_timeout);
            } else {
                tracing::warn!(dir = %kept.dir.display(), "gVisor kernels end with the gateway: their socket paths below this state directory would be too long for a unix socket (choose a shorter --state-dir)");
                config.survival = None;
            }
        }
        tracing::info!(runsc = %runsc.display(), platform = %config.platform, kept = config.survival.is_some(), "gvisor sandbox backend ready");
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

    /// The kernel's view (fixed paths, see [`relocate`](super::relocate)) and the host paths still shown
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
        let names = RunNames::new(spec)?;
        // With a size limit the workspace is a host tmpfs whose pages the sandbox's writes
        // are charged for; without one it is a host directory (reclaimable page cache).
        let cgroup_memory = spec.limits.memory_cgroup_bytes(spec.limits.workspace_bytes);
        let memory_cgroup = self.pre_create_cgroups(spec, &names.cgroup_path, cgroup_memory);
        self.build_bundle(spec, &names, view, ro_paths).await?;
        let command = self.run_command(spec, &names)?;
        let child = match self.spawner.spawn(command).await {
            Ok(child) => child,
            Err(source) => {
                let _ = std::fs::remove_dir_all(&names.bundle);
                return Err(SandboxError::Spawn {
                    program: self.runsc.display().to_string(),
                    source,
                });
            }
        };
        Ok(self.watch(spec, child, names, cgroup_memory, memory_cgroup))
    }

    /// Makes the sandbox's memory and pids cgroups (with their limits) here rather than
    /// leaving them to runsc: runsc removes the cgroups it creates before `runsc run`
    /// returns, and the watcher must read the OOM counter and `pids.events` first. runsc
    /// joins a cgroup that exists and leaves it in place (and its limits to us); the watcher
    /// removes it. Failing is not fatal (runsc sets the limits then), only less precise
    /// exit reports. Returns the memory cgroup's directory when it was made.
    fn pre_create_cgroups(
        &self,
        spec: &LaunchSpec,
        cgroup_path: &str,
        cgroup_memory: Option<u64>,
    ) -> Option<PathBuf> {
        let memory_cgroup = (self.config.cgroups && spec.limits.memory_bytes.is_some())
            .then(|| memory_cgroup_dir(cgroup_path))
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
            if let Some(dir) = controller_cgroup_dir("pids", cgroup_path) {
                if let Err(err) = create_pids_cgroup(&dir, pids + PIDS_OVERHEAD) {
                    tracing::warn!(kernel_id = %spec.kernel_id, %err, dir = %dir.display(), "cannot pre-create the pids cgroup: runsc sets the limit, and its exhaustion is reported as a plain death");
                }
            }
        }
        memory_cgroup
    }

    /// Writes the OCI bundle off the async runtime (it walks and copies files), and removes
    /// what it wrote when that fails, so a failed launch leaves nothing behind.
    async fn build_bundle(
        &self,
        spec: &LaunchSpec,
        names: &RunNames,
        view: KernelView,
        ro_paths: Vec<PathBuf>,
    ) -> Result<(), SandboxError> {
        let built = tokio::task::spawn_blocking({
            let bundle = names.bundle.clone();
            let config = self.config.clone();
            let spec = spec.clone();
            let cgroup = names.cgroup_path.clone();
            move || write_bundle(&bundle, &config, &spec, &view, &ro_paths, &cgroup)
        })
        .await
        .map_err(|err| setup(format!("bundle task: {err}")))?;
        if let Err(err) = built {
            let _ = std::fs::remove_dir_all(&names.bundle);
            return Err(err);
        }
        Ok(())
    }

    /// The `runsc run` command: its output to the kernel's log, a clean environment, its own
    /// process group, and (with a workspace limit) the private tmpfs workspace mounted in
    /// the child before exec, so the sandbox's writes are bounded and charged to it.
    #[allow(unsafe_code)] // the workspace mount's `pre_exec` hook
    fn run_command(&self, spec: &LaunchSpec, names: &RunNames) -> Result<Command, SandboxError> {
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
            .args(self.global_args(&names.state))
            .args(self.run_flags())
            .arg("run")
            .arg("--bundle")
            .arg(&names.bundle)
            .arg(&names.container_id)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .current_dir(&names.bundle)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0)
            .kill_on_drop(false);
        Ok(command)
    }

    /// Hands the started `runsc run` to its exit watcher (which reports the exit and cleans
    /// up the container, bundle and cgroups) and makes the kernel's handle.
    fn watch(
        &self,
        spec: &LaunchSpec,
        child: tokio::process::Child,
        names: RunNames,
        cgroup_memory: Option<u64>,
        memory_cgroup: Option<PathBuf>,
    ) -> Launched {
        let RunNames {
            container_id,
            bundle,
            state,
            cgroup_path,
        } = names;
        let pid = child.id().unwrap_or(0);
        // Opened before the watcher can reap `runsc run`, so it names that process and no
        // later one that reuses its pid.
        let pidfd = i32::try_from(pid)
            .ok()
            .filter(|&pid| pid > 0)
            .and_then(|pid| super::sys::pidfd_open(pid).ok());
        let exited = Arc::new(AtomicBool::new(false));
        let (exit_tx, exit_rx) = watch::channel(None);
        let runsc = Runsc {
            program: self.runsc.clone(),
            global: self.global_args(&state),
            id: container_id.clone(),
            timeout: self.config.command_timeout,
        };
        let handle_cgroups = if self.config.cgroups {
            cgroups::cgroup_dirs(&cgroup_path)
        } else {
            Vec::new()
        };
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
        Launched {
            handle: Arc::new(GvisorHandle {
                pid,
                pidfd,
                private_workspace: spec.limits.workspace_bytes.is_some(),
                uid: self.config.uid,
                gid: self.config.gid,
                exited,
                runsc,
                cgroup_dirs: handle_cgroups,
                keeper: None,
            }),
            exit: exit_rx,
            connection: spec.connection.clone(),
        }
    }

    /// runsc's flags for every launch, after the global ones.
    fn run_flags(&self) -> Vec<String> {
        let mut flags: Vec<String> = [
            // Explicit because the file API depends on it (see the module doc).
            "--network=none",
            "--host-uds=all",
            "--file-access-mounts=shared",
            // The bundle's seccomp profile keeps the container's init out of the
            // kernel's reach (`bundle::init_guard`); runsc ignores OCI profiles without it.
            "--oci-seccomp",
        ]
        .map(str::to_owned)
        .to_vec();
        if !self.config.cgroups {
            flags.push("--ignore-cgroups".to_owned());
        }
        flags
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
        Box::pin(async move {
            match (&self.config.survival, spec.adopt.is_some()) {
                (Some(kept), true) => self.adopt(spec, kept).await,
                (None, true) => Err(setup(
                    "no sandbox to adopt: gVisor kernels do not outlive the gateway here",
                )),
                (Some(kept), false) => self.launch_kept(spec, kept).await,
                (None, false) => self.launch_gvisor(spec).await,
            }
        })
    }

    fn kernels_outlive_gateway(&self) -> bool {
        self.config.survival.is_some()
    }

    fn survivor(&self, kernel_id: &str) -> Option<super::SurvivorInfo> {
        let record = survival::read(self.config.survival.as_ref()?, kernel_id).ok()?;
        Some(super::SurvivorInfo {
            key: record.key,
            generation: record.generation,
            started_ms: record.started_ms,
            hibernated: false,
            hibernated_bytes: 0,
        })
    }

    fn kernel_dir(&self, kernel_id: &str) -> Option<PathBuf> {
        self.config.survival.as_ref()?.kept_kernel_dir(kernel_id)
    }

    fn end_unclaimed(&self, claimed: &dyn Fn(&str) -> bool) -> usize {
        self.config.survival.as_ref().map_or(0, |kept| {
            survival::end_unclaimed(kept, claimed, self.config.command_timeout)
        })
    }

    fn forget(&self, kernel_id: &str) {
        if let Some(kept) = &self.config.survival {
            kept.remove(kernel_id);
        }
    }
}

/// The names of one launch's container: its runsc id, bundle and state directories, and
/// cgroup path, all from one unique suffix.
struct RunNames {
    container_id: String,
    bundle: PathBuf,
    state: PathBuf,
    cgroup_path: String,
}

impl RunNames {
    /// Names beside the kernel's log; the gateway's pid in the suffix tells a later sweep
    /// whether their owner is alive.
    fn new(spec: &LaunchSpec) -> Result<Self, SandboxError> {
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
        Ok(Self {
            container_id,
            bundle,
            state,
            cgroup_path,
        })
    }
}
