//! The `namespaces` backend: every kernel in its own Linux namespaces, on a read-only root
//! holding only its Python environment, with seccomp, Landlock, rlimits and cgroup limits.
//!
//! # Design
//!
//! The syscalls are implemented here in Rust rather than by driving Debian's bubblewrap: no
//! external binary to install, find and version-check, identical behaviour on every host,
//! errors reported per step in our own terms, and the pieces bwrap does not have (cgroups
//! nested under the gateway's own cgroup, a Landlock ruleset, a seccomp filter that needs no
//! libseccomp) live in the same sequence. bwrap and `nsrun.c` from
//! ../shared/research/isolation/ (measurements in ../shared/research/isolation.md) were the
//! references.
//!
//! Four processes, each with one job:
//!
//! ```text
//! gateway (tokio, multithreaded)
//!  └─ helper   `cellgate __sandbox-init`, re-exec of the gateway's binary   (helper.rs)
//!      │       new user/mount/net/ipc/uts/pid (+cgroup) namespaces; outside the pid ns
//!      └─ init    PID 1: root fs, lo, drops capabilities, reaps    (pid1.rs, mounts.rs)
//!          └─ kernel  stdio, rlimits, no_new_privs, Landlock, seccomp, execve  (confine.rs)
//! ```
//!
//! 1. The gateway computes a [`plan::Plan`] (command, environment, paths, the Python
//!    environment's directories, sizes), creates the kernel's cgroup ([`crate::sandbox::cgroups`]) and, when
//!    it is root, hands the runtime directory to the sandbox's host uid ([`idmap`]).
//! 2. It spawns the helper (`main` dispatches `__sandbox-init` before anything else) from
//!    one dedicated thread with `PR_SET_PDEATHSIG(SIGKILL)` (the signal fires when the
//!    *thread* that forked exits, as in the process backend), writes
//!    the plan to its stdin and reads events from its stdout. The helper's stderr is a pipe
//!    that becomes the kernel's stdout and stderr; the gateway copies it into the log file
//!    (at most 64 MiB).
//! 3. The helper unshares its namespaces and says so; the gateway writes its uid/gid maps
//!    from outside and moves it into the cgroup, then says `go`.
//! 4. The helper forks the init; the init builds the sandbox and forks the kernel process;
//!    the gateway learns the init's host pid, then the kernel's (from the init's `children`
//!    in /proc), and returns [`Launched`].
//! 5. A watcher task reads the last event (the kernel's exit status), waits for the helper,
//!    reads the cgroup's OOM counter, removes the cgroup and reports exactly one
//!    [`ExitReport`].
//!
//! Dying with the gateway: gateway → helper by parent-death signal, helper → init by
//! parent-death signal, init → everything in the pid namespace by the kernel's rule that a
//! pid namespace dies with its PID 1. `kill` SIGKILLs the init (through a pidfd, so never a
//! recycled pid) and every task in the cgroup. `signal` goes to the kernel's process group
//! by its host pid, so SIGINT interrupts the kernel and whatever it runs in the foreground.
//!
//! # Outliving the gateway (`--kernels-outlive-gateway`, on by default with a state directory)
//!
//! What outlives the gateway: a kernel's helper, init, kernel process and egress bridge,
//! and its cgroup. The gateway spawns the helper without a parent-death signal (and the
//! zygote's helper too, so that the zygote's init, the pid namespace every forked kernel
//! lives in, stays while its kernels run; the zygote itself exits when its control socket
//! closes, as it always did). The helper is then self-sufficient ([`keeper`]): the kernel's
//! output reaches the log file through the helper (a pipe it copies, capped as before), the
//! ipc sockets stay in the sandbox's own runtime tmpfs, and the egress bridge reaches the
//! proxy through a directory that keeps its path across restarts
//! (`<state dir>/sandboxes/<kernel id>/egress/`), so it connects to whichever gateway
//! listens there now.
//!
//! What the next gateway re-finds, and how: at launch the gateway writes the sandbox's
//! record ([`survival::Record`]: the helper's, init's and kernel's host pids with their
//! start times, the cgroup, the generation, the kernel's signing key) to
//! `<state dir>/sandboxes/<kernel id>/record.json` (directory 0700, file 0600, the state
//! directory's owner only). A gateway started on the same state directory reads the records
//! of its stored sessions, checks each process is still the one recorded (a pidfd opened
//! first, then the start time in `/proc` compared: a reused pid fails the check), proves it
//! holds the key to the helper's control socket (`control.sock` beside the record: an HMAC
//! of the helper's random challenge under the kernel's key; the directory's mode keeps
//! other uids from connecting at all), and connects to the kernel's ZMQ sockets with that
//! key, as the Kubernetes adoption does. The session comes back live with its generation;
//! a sandbox that did not survive is reported `sandbox_lost` with its generation moved on.
//!
//! What ends an orphan: the helper knows a gateway is there while the launching gateway's
//! event pipe has a reader or an adopting gateway holds its control connection. With
//! neither for `--orphan-grace` (300 s by default), it SIGKILLs the init (the pid namespace
//! and everything in it end) and exits; the next gateway removes the empty cgroup (its
//! sweep) and the record. With the option off, the parent-death chain of the section
//! above ends every kernel with its gateway, as before, and a SIGTERM'd gateway shuts its
//! kernels down; with it on, a SIGTERM'd gateway leaves its sessions' kernels running.
//!
//! The kernel sees its directories at fixed paths (`sandbox::relocate`): the runtime
//! directory, where ZMQ's `ipc://` sockets live, at `/run/cellgate` (the connection file the
//! kernel reads is rewritten to match; the gateway connects by host paths), the Python
//! environment under `/opt/cellgate`, and the workspace, a size-limited tmpfs, at
//! `/home/user` (the host directory stays empty; while the kernel runs, the gateway reaches
//! the files through `/proc/<kernel pid>/root/home/user`).
//!
//! Workspace, `/tmp` and `/dev/shm` are tmpfs: what the kernel writes there is memory,
//! charged to its memory cgroup, so the memory limit bounds them too (the cgroup holds the
//! policy's memory plus the workspace's size, so a full workspace is `ENOSPC`, not an
//! out-of-memory kill).
//!
//! A kernel killed by a fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE) is reported with the host
//! kernel's record of it (the `segfault at … ip … in module[…]` line from `/dev/kmsg`, for
//! the kernel's own pid only, where the gateway runs in the host's pid namespace and may
//! read that log), as the microvm backend does from the guest's.
//!
//! Kernels are forked from a warm zygote by default ([`zygote`]; `--kernel-zygote false`
//! starts every kernel cold as above).
//!
//! What is not isolated: the host kernel itself (seccomp narrows, does not remove, its
//! surface), CPU caches and timing. Without cgroups (an unprivileged gateway without a
//! delegated subtree) memory, pid and CPU limits are not enforced except for `RLIMIT_AS`.
//! An unprivileged gateway's kernel keeps the gateway's supplementary groups (see
//! [`idmap`]). Our hosts have v1 controllers; the v2 paths (limits, the move into a
//! leaf) run in `tests/it/cgroup_v2.rs`, in a VM whose only hierarchy is v2.

mod bridge;
mod children;
mod confine;
pub mod diagnose;
mod error;
mod helper;
mod idmap;
mod keeper;
mod landlock;
mod mounts;
mod pid1;
mod plan;
mod report;
mod seccomp;
pub mod survival;
mod sys;
pub mod zygote;

use crate::sandbox::spawner::Spawner;
use crate::telemetry::metrics::{metrics, ZygoteOutcome};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use super::{
    Backend, ExitCause, ExitReason, ExitReport, LaunchSpec, Launched, Limits, ResourceUsage,
    Sandbox, SandboxError, SandboxHandle,
};
use crate::protocol::ConnectionInfo;
use crate::sandbox::cgroups::{self, Hierarchy, KernelCgroup};
use crate::sandbox::host_paths::{argv_files, visible_roots, SYSTEM_PREFIXES};
use crate::sandbox::relocate::{self, KernelView};
use children::{kernel_child, only_child};
pub use error::NamespacesError;
pub use helper::{sandbox_init_main, SANDBOX_INIT_ARG};
use idmap::{IdMap, INSIDE_ID};
use plan::{Event, Keep, Plan, Role, RuntimeFile, GO};
pub use survival::Survival;
use survival::{Proc, Record, SurvivalError};
pub use zygote::{become_kernel, ZygoteSettings, ONE_THREAD as ZYGOTE_ONE_THREAD};
use zygote::{Kind, Lookup, Zygote};

const GIB: u64 = 1 << 30;
/// Processes of the sandbox machinery that share the kernel's cgroup (the helper outside and
/// the init inside), added to the policy's pid limit.
const HELPER_PROCESSES: u64 = 2;
const MIB: u64 = 1 << 20;

/// Settings of the namespaces backend.
#[derive(Debug, Clone)]
pub struct NamespacesConfig {
    /// The binary to run as the sandbox helper with [`SANDBOX_INIT_ARG`]. `None` means the
    /// running binary (`/proc/self/exe`), whose `main` must dispatch to
    /// [`sandbox_init_main`].
    pub init_program: Option<PathBuf>,
    /// The host uid and gid of the sandbox user when the gateway runs as root.
    pub root_maps_to: (u32, u32),
    /// More host directories to show read-only at the same path (besides `/usr`, the
    /// kernel's Python environment and the files named in its command, which are found from
    /// the command). A kernelspec whose program needs its whole resource directory lists it
    /// here.
    pub extra_ro_paths: Vec<PathBuf>,
    /// Workspace size when the limits set none.
    pub default_workspace_bytes: u64,
    /// Size of the private `/tmp` and of `/dev/shm`.
    pub tmp_bytes: u64,
    /// Add a Landlock ruleset where the host kernel supports it.
    pub landlock: bool,
    /// Create cgroups (where permitted) for limits and accounting.
    pub cgroups: bool,
    /// How long the sandbox may take to exist (not the kernel to be ready).
    pub start_timeout: Duration,
    pub hostname: String,
    /// Kernels forked from a warm zygote (see `namespaces/zygote.rs`).
    pub zygote: ZygoteSettings,
    /// Kernels outlive the gateway, for the next one on the same state directory to adopt
    /// (see "Outliving the gateway" above); `None`: they end with it.
    pub survival: Option<Survival>,
}

impl Default for NamespacesConfig {
    fn default() -> NamespacesConfig {
        NamespacesConfig {
            init_program: None,
            root_maps_to: (65534, 65534),
            extra_ro_paths: Vec::new(),
            default_workspace_bytes: GIB,
            tmp_bytes: 256 * MIB,
            landlock: true,
            cgroups: true,
            start_timeout: Duration::from_secs(30),
            hostname: "sandbox".to_owned(),
            zygote: ZygoteSettings::default(),
            survival: None,
        }
    }
}

/// Starts kernels in namespaced sandboxes.
pub struct NamespacesSandbox {
    core: Arc<Core>,
}

/// The backend's state, shared with the background tasks that start zygotes.
struct Core {
    config: NamespacesConfig,
    ids: IdMap,
    hierarchy: Hierarchy,
    spawner: Spawner,
    zygotes: zygote::Zygotes,
}

/// How a sandbox's helper comes to be.
enum How {
    /// Spawned by the gateway, its plan on a pipe: a kernel started cold.
    Cold,
    /// Spawned by the gateway with this socket as its standard input, which the zygote
    /// keeps; `writer` is the gateway's end, for the plan.
    Zygote {
        stdin: OwnedFd,
        writer: tokio::net::UnixStream,
    },
    /// Forked by this zygote.
    Forked(Arc<Zygote>),
}

/// The helper process, as far as the gateway can wait for it.
enum Helper {
    Spawned(Child),
    /// A zygote's child: not the gateway's to wait for (its end is the events' end), and
    /// named by this pidfd, never by its pid, which its reaper may free at any time.
    Forked(OwnedFd),
}

type Writer = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;
type Reader = Box<dyn tokio::io::AsyncRead + Unpin + Send>;
type EventLines = Lines<BufReader<Reader>>;

impl NamespacesSandbox {
    /// Must be called from within a tokio runtime: the spawner thread registers the helpers'
    /// pipes with it.
    pub fn new(config: NamespacesConfig) -> Result<NamespacesSandbox, SandboxError> {
        if let Ok(max) = std::fs::read_to_string("/proc/sys/user/max_user_namespaces") {
            if max.trim() == "0" {
                return Err(SandboxError::Setup(
                    "user namespaces are disabled on this host (user.max_user_namespaces = 0)"
                        .to_owned(),
                ));
            }
        }
        let spawner = Spawner::start("cellgate-ns-spawner")?;
        let hierarchy = if config.cgroups {
            Hierarchy::detect()
        } else {
            Hierarchy::Unavailable("disabled in the configuration".to_owned())
        };
        if let Some(survival) = &config.survival {
            survival.sweep();
        }
        hierarchy.sweep();
        let ids = IdMap::for_this_process(config.root_maps_to);
        let mut zygote = config.zygote.clone();
        let wanted = zygote.enabled;
        if zygote.enabled && !ids.privileged {
            // The gateway reaches a forked kernel through its helper's /proc entries, which
            // only a privileged gateway may follow (see `gateway_view`).
            tracing::warn!("kernel zygotes are off: the gateway does not run as root; every kernel starts cold");
            zygote.enabled = false;
        }
        if zygote.enabled && zygote.library().is_none() {
            tracing::warn!(
                "kernel zygotes are off: {} is not beside the gateway's binary (`cargo build -p cellgate-zygote`); every kernel starts cold",
                zygote::LIBRARY_FILE
            );
            zygote.enabled = false;
        }
        tracing::info!(
            cgroups = %hierarchy.describe(),
            sandbox_uid = ids.outside_uid,
            zygotes = zygote.enabled,
            "namespaces sandbox backend ready"
        );
        Ok(NamespacesSandbox {
            core: Arc::new(Core {
                config,
                ids,
                hierarchy,
                spawner,
                zygotes: zygote::Zygotes::new(zygote, wanted),
            }),
        })
    }
}

impl Core {
    fn init_program(&self) -> PathBuf {
        self.config
            .init_program
            .clone()
            .unwrap_or_else(|| PathBuf::from("/proc/self/exe"))
    }

    /// What the helper must build for `spec`. The sandbox shows the workspace, the runtime
    /// directory and the Python environment at fixed paths (see [`relocate`]): the plan's
    /// command and environment are rewritten to them, and so is the connection file the
    /// kernel reads (the gateway keeps connecting by host paths).
    fn plan(&self, spec: &LaunchSpec) -> Result<Plan, NamespacesError> {
        let program = spec.argv.first().ok_or(NamespacesError::EmptyCommand)?;
        let program = Path::new(program);
        if !program.is_absolute() {
            return Err(NamespacesError::RelativeProgram(
                program.display().to_string(),
            ));
        }
        let view = KernelView::of(spec, SYSTEM_PREFIXES).map_err(|source| NamespacesError::Io {
            what: "read the kernel's Python environment",
            path: program.to_owned(),
            source,
        })?;
        let mut wanted = view.shown_as_is.clone();
        wanted.extend(argv_files(&spec.argv[1..]));
        wanted.extend(self.config.extra_ro_paths.iter().cloned());
        let connection_file = view
            .connection_file(&spec.connection_file)
            .map_err(|source| NamespacesError::Io {
                what: "read",
                path: spec.connection_file.clone(),
                source,
            })?
            .map(|contents| RuntimeFile {
                path: view.map.path(&spec.connection_file),
                contents,
            });
        let KernelView {
            argv,
            env,
            venv: venv_view,
            python_prefix,
            masked,
            ..
        } = view;
        let workspace = PathBuf::from(relocate::WORKSPACE);
        Ok(Plan {
            kernel_id: spec.kernel_id.clone(),
            argv,
            workspace_dirs: workspace_dirs(&env, &workspace),
            env,
            workspace,
            // tmpfs reads `size=0` as "unlimited": never ask for less than 1 MiB.
            workspace_bytes: spec
                .limits
                .workspace_bytes
                .unwrap_or(self.config.default_workspace_bytes)
                .max(MIB),
            tmp_bytes: self.config.tmp_bytes.max(MIB),
            runtime_dir_inside: PathBuf::from(relocate::RUN_DIR),
            connection_file,
            venv: venv_view,
            python_prefix,
            ro_binds: visible_roots(wanted, &spec.runtime_dir, &spec.workspace),
            masked,
            uid: INSIDE_ID,
            gid: INSIDE_ID,
            hostname: self.config.hostname.clone(),
            address_space_limit: None,
            landlock: self.config.landlock,
            // The gateway opened the proxy socket for this generation: the init runs the
            // bridge to it.
            egress_socket: spec.egress_socket.clone(),
            role: Role::Kernel,
            keep: None,
        })
    }

    /// The kernel's cgroup, or `None` (with a warning) where cgroups cannot be made.
    fn cgroup(&self, spec: &LaunchSpec) -> Option<Arc<KernelCgroup>> {
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let name = cgroups::cgroup_name(&spec.kernel_id, &unique[..8]);
        // The workspace is always a tmpfs here, charged to this cgroup.
        let workspace = spec
            .limits
            .workspace_bytes
            .unwrap_or(self.config.default_workspace_bytes);
        let cgroup_limits = Limits {
            memory_bytes: spec.limits.memory_cgroup_bytes(Some(workspace)),
            pids: spec.limits.pids.map(|pids| pids + HELPER_PROCESSES),
            ..spec.limits.clone()
        };
        match self.hierarchy.create(&name, &cgroup_limits) {
            Ok(cgroup) => {
                let limits = &spec.limits;
                for (set, controller) in [
                    (limits.pids.is_some(), "pids"),
                    (limits.cpu_millis.is_some(), "cpu"),
                ] {
                    if set && !cgroup.has(controller) {
                        tracing::warn!(kernel_id = %spec.kernel_id, controller, "no such cgroup controller here: limit NOT enforced");
                    }
                }
                Some(Arc::new(cgroup))
            }
            Err(err) => {
                let limits = &spec.limits;
                if limits.memory_bytes.is_some()
                    || limits.pids.is_some()
                    || limits.cpu_millis.is_some()
                {
                    tracing::warn!(
                        kernel_id = %spec.kernel_id,
                        %err,
                        "kernel runs without cgroup limits: memory (except RLIMIT_AS), pids and CPU limits are NOT enforced"
                    );
                } else {
                    tracing::debug!(kernel_id = %spec.kernel_id, %err, "kernel runs without a cgroup");
                }
                None
            }
        }
    }

    /// Gives the egress proxy's socket, when the gateway opened one, to the sandbox user:
    /// the bridge connects to it as that user, which needs write permission on it. Only when
    /// the gateway is root (an unprivileged gateway's sandbox user already has its uid).
    fn hand_over(&self, spec: &LaunchSpec) -> Result<(), NamespacesError> {
        if !self.ids.privileged {
            return Ok(());
        }
        let Some(egress) = spec.egress_socket.clone() else {
            return Ok(());
        };
        let owner = Some(self.ids.outside_uid);
        match std::os::unix::fs::chown(&egress, owner, Some(self.ids.outside_gid)) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(NamespacesError::Io {
                what: "hand over",
                path: egress,
                source,
            }),
        }
    }

    async fn launch(self: &Arc<Self>, spec: &LaunchSpec) -> Result<Launched, NamespacesError> {
        if spec.adopt.is_some() {
            return self.adopt(spec).await;
        }
        let plan = self.plan(spec)?;
        if let Some(kind) = Kind::of(&plan).filter(|_| spec.zygote) {
            // One wait at most, for a zygote that is starting; then fork, or start afresh.
            let mut waited = false;
            loop {
                let starting = match self.zygotes.lookup(&kind) {
                    Lookup::Ready(zygote) => {
                        let forked = self
                            .launch_with(spec, plan.clone(), How::Forked(zygote.clone()))
                            .await;
                        match forked {
                            Ok(launched) => {
                                metrics().zygote_fork(ZygoteOutcome::ok);
                                return Ok(launched);
                            }
                            // The zygote's own failure: it is replaced.
                            Err(NamespacesError::Zygote(err)) => {
                                metrics().zygote_fork(ZygoteOutcome::failed);
                                self.zygotes.failed(&kind, &zygote, &err.to_string())
                            }
                            // This kernel's (its limits, its log, a slow machine): the zygote
                            // serves on, and this kernel is given a fresh start.
                            Err(err) => tracing::warn!(
                                kernel_id = %spec.kernel_id,
                                %err,
                                "a kernel forked from the zygote failed to start: starting it afresh"
                            ),
                        }
                        break;
                    }
                    Lookup::Start(starting) => {
                        let core = self.clone();
                        let (plan, spec, kind) = (plan.clone(), spec.clone(), kind.clone());
                        tokio::spawn(async move {
                            use futures_util::FutureExt;
                            // A panic must still end the start, or the kind's kernels would
                            // wait for it every time.
                            let started =
                                std::panic::AssertUnwindSafe(core.start_zygote(&spec, &plan))
                                    .catch_unwind()
                                    .await
                                    .unwrap_or_else(|_| {
                                        Err(NamespacesError::Handshake(
                                            "the zygote's start panicked".to_owned(),
                                        ))
                                    });
                            if started.is_err() {
                                metrics().zygote_started(ZygoteOutcome::failed);
                            }
                            core.zygotes
                                .started(kind, started.map_err(|e| e.to_string()));
                        });
                        // A successor of a zygote that served its time: this kernel forks
                        // from the old one while the new one starts, like every other
                        // meanwhile (the next lookup finds it), rather than wait.
                        drop(starting);
                        continue;
                    }
                    Lookup::Wait(starting) => starting,
                    Lookup::Cold => break,
                };
                if waited {
                    break;
                }
                waited = true;
                starting.wait(self.zygotes.settings.ready_timeout).await;
            }
            // Counted also when zygotes were asked for but cannot run here (not root, no
            // library): the metric is how an operator learns that.
            if self.zygotes.wanted {
                metrics().zygote_cold_start();
            }
        }
        self.launch_with(spec, plan, How::Cold).await
    }

    /// Attaches to the sandbox of `spec`'s kernel that outlived the gateway before this one
    /// (see "Outliving the gateway" above).
    async fn adopt(&self, spec: &LaunchSpec) -> Result<Launched, NamespacesError> {
        let survival = self
            .config
            .survival
            .clone()
            .ok_or(NamespacesError::Adopt(SurvivalError::NoRecord))?;
        let (id, key) = (spec.kernel_id.clone(), spec.connection.key.clone());
        let found = {
            let survival = survival.clone();
            tokio::task::spawn_blocking(move || find_survivor(&survival, &id, &key))
                .await
                .map_err(|err| NamespacesError::Handshake(err.to_string()))?
        };
        let found = match found {
            Ok(found) => found,
            Err(err) => {
                // A sandbox that is gone, or one this gateway cannot prove it may hold, is
                // not tried again: its record goes (an orphan ends after its grace), and
                // the cgroup of one that is gone.
                if let Ok(record) = survival.read(&spec.kernel_id) {
                    if survival::start_time(record.helper.pid) != Some(record.helper.start) {
                        if let Some(cgroup) =
                            record.cgroup.as_ref().and_then(KernelCgroup::from_parts)
                        {
                            let _ = tokio::task::spawn_blocking(move || cgroup.remove()).await;
                        }
                    }
                }
                survival.remove(&spec.kernel_id);
                return Err(NamespacesError::Adopt(err));
            }
        };
        self.hand_over(spec)?;
        let Survivor {
            record,
            init,
            kernel,
            control,
        } = found;
        let cgroup = record
            .cgroup
            .as_ref()
            .and_then(KernelCgroup::from_parts)
            .map(Arc::new);
        let helper_pid = u32::try_from(record.helper.pid).unwrap_or(0);
        let watched = init
            .try_clone()
            .map_err(|err| NamespacesError::Handshake(format!("pidfd: {err}")))?;
        let exited = Arc::new(AtomicBool::new(false));
        let detached = Arc::new(AtomicBool::new(false));
        let handle = Arc::new(NamespacesHandle {
            helper_pid,
            // Not this gateway's child: never signalled by its pid.
            helper_forked: true,
            init_pid: record.init.pid,
            init: Some(init),
            kernel_pid: record.kernel.map(|k| k.pid),
            kernel: Some(kernel),
            exited: exited.clone(),
            detached: detached.clone(),
            cgroup: cgroup.clone(),
            workspace: record.workspace.clone(),
        });
        let (exit_tx, exit_rx) = watch::channel(None);
        let (kernel_id, generation) = (spec.kernel_id.clone(), record.generation);
        let memory_limit = record.memory_limit;
        tokio::spawn(async move {
            crate::sandbox::sys::pidfd_wait(watched).await;
            exited.store(true, Ordering::SeqCst);
            let oom_kills = cgroup.as_ref().and_then(|c| c.oom_kills()).unwrap_or(0);
            remove_cgroup(cgroup).await;
            if !detached.load(Ordering::SeqCst) {
                survival.forget(&kernel_id, generation);
            }
            // Held until the end: the helper counts this gateway as there while it is open.
            drop(control);
            // The kernel's own status went to the gateway that started it; the cgroup
            // still tells an out-of-memory kill.
            let reason = (oom_kills > 0).then(|| {
                ExitReason::new(
                    ExitCause::OutOfMemory,
                    match memory_limit {
                        Some(bytes) => format!("kernel process killed by the out-of-memory killer (the sandbox's limit of {bytes} bytes, workspace files included)"),
                        None => "kernel process killed by the out-of-memory killer".to_owned(),
                    },
                )
            });
            let _ = exit_tx.send(Some(ExitReport {
                code: None,
                signal: reason.as_ref().map(|_| libc::SIGKILL),
                reason,
            }));
        });
        tracing::info!(
            kernel_id = %spec.kernel_id,
            init_pid = record.init.pid,
            forked = record.helper_forked,
            "kernel adopted: its sandbox outlived the gateway before this one"
        );
        Ok(Launched {
            handle,
            exit: exit_rx,
            connection: gateway_view(&spec.connection, &spec.runtime_dir, helper_pid),
        })
    }

    /// Starts a zygote for kernels like `plan`'s (of `spec`) and waits until it is ready.
    async fn start_zygote(
        &self,
        spec: &LaunchSpec,
        plan: &Plan,
    ) -> Result<Zygote, NamespacesError> {
        let library =
            self.zygotes.settings.library().ok_or_else(|| {
                NamespacesError::Handshake(format!("no {}", zygote::LIBRARY_FILE))
            })?;
        let io = |what: &'static str| {
            let path = spec.runtime_dir.clone();
            move |source| NamespacesError::Io { what, path, source }
        };
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(io("socketpair"))?;
        let writer = ours.try_clone().map_err(io("socketpair"))?;
        writer.set_nonblocking(true).map_err(io("socketpair"))?;
        let writer = tokio::net::UnixStream::from_std(writer).map_err(io("socketpair"))?;
        let zygote_plan = zygote::zygote_plan(plan, &library);
        let zygote_spec = LaunchSpec {
            kernel_id: zygote_plan.kernel_id.clone(),
            limits: Limits::default(),
            log_file: spec
                .log_file
                .with_file_name(format!("{}.log", zygote_plan.kernel_id)),
            egress_socket: None,
            ..spec.clone()
        };
        let how = How::Zygote {
            stdin: theirs.into(),
            writer,
        };
        let launched = self.launch_with(&zygote_spec, zygote_plan, how).await?;
        // The writer was a clone of this socket, made non-blocking for tokio (a flag of the
        // socket, not of the descriptor): the zygote is talked to in blocking calls.
        if let Err(source) = ours.set_nonblocking(false) {
            let _ = launched.handle.kill();
            return Err(NamespacesError::Io {
                what: "socketpair",
                path: spec.runtime_dir.clone(),
                source,
            });
        }
        let pid = launched
            .handle
            .pid()
            .and_then(|pid| i32::try_from(pid).ok())
            .ok_or_else(|| NamespacesError::Handshake("the zygote has no pid".to_owned()))?;
        let zygote = Zygote::new(ours, pid, launched.handle.clone(), launched.exit.clone());
        let timeout = self.zygotes.settings.ready_timeout;
        let started = std::time::Instant::now();
        let zygote =
            tokio::task::spawn_blocking(move || zygote.wait_ready(timeout).map(|f| (zygote, f)))
                .await
                .map_err(|err| NamespacesError::Handshake(err.to_string()))?;
        match zygote {
            Ok((mut zygote, failed)) => {
                metrics().zygote_started(ZygoteOutcome::ok);
                zygote.preload_missing = failed.len();
                if !failed.is_empty() {
                    tracing::warn!(
                        modules = %failed.join(", "),
                        log = %zygote_spec.log_file.display(),
                        "kernel zygote could not preload these modules: its kernels import them on first use (the kernelspec's CELLGATE_PRELOAD)"
                    );
                }
                tracing::info!(
                    pid,
                    ready_ms = started.elapsed().as_millis() as u64,
                    "kernel zygote ready: kernels of its kind are forked from it"
                );
                Ok(zygote)
            }
            Err(err) => {
                let _ = launched.handle.kill();
                Err(NamespacesError::Handshake(format!(
                    "the zygote did not become ready: {err} (its log: {})",
                    zygote_spec.log_file.display()
                )))
            }
        }
    }

    async fn launch_with(
        &self,
        spec: &LaunchSpec,
        mut plan: Plan,
        how: How,
    ) -> Result<Launched, NamespacesError> {
        let plan_workspace = plan.workspace.clone();
        let cgroup = self.cgroup(spec);
        if !cgroup.as_ref().is_some_and(|c| c.memory_limited()) {
            plan.address_space_limit = spec.limits.memory_bytes;
        }
        let log = match self.hand_over(spec).and_then(|()| open_kernel_log(spec)) {
            Ok(log) => log,
            Err(err) => {
                remove_cgroup(cgroup).await;
                return Err(err);
            }
        };
        // A kernel (not a zygote) that is to outlive the gateway: its helper holds the
        // control socket and keeps the log itself.
        let kept = match &self.config.survival {
            Some(survival) if plan.role == Role::Kernel && plan.connection_file.is_some() => {
                match survival.control_listener(&spec.kernel_id, spec.generation) {
                    Ok(listener) => {
                        plan.keep = Some(Keep {
                            grace_ms: u64::try_from(survival.grace.as_millis()).unwrap_or(u64::MAX),
                        });
                        Some(Kept {
                            survival: survival.clone(),
                            control: OwnedFd::from(listener),
                        })
                    }
                    Err(err) => {
                        tracing::warn!(kernel_id = %spec.kernel_id, %err, "this kernel cannot outlive the gateway");
                        None
                    }
                }
            }
            _ => None,
        };
        // Outside of that mode, the gateway's death ends every helper (a zygote's too: its
        // init holds the pid namespace of every kernel forked from it).
        let pdeathsig = self.config.survival.is_none();
        let survival = kept.as_ref().map(|k| k.survival.clone());
        let forked = matches!(how, How::Forked(_));
        let (log, helper_log) = match &kept {
            Some(_) => (None, Some(log)),
            None => (Some(log), None),
        };
        let control = kept.map(|k| k.control);
        let helper_io = HelperIo {
            log: helper_log,
            control,
            pdeathsig,
        };
        let started = match how {
            How::Forked(zygote) => {
                plan = zygote::forked_plan(plan);
                self.fork_helper(spec, &zygote, helper_io).await
            }
            How::Cold => self.spawn_helper(None, helper_io).await,
            How::Zygote { stdin, writer } => {
                self.spawn_helper(Some((stdin, writer)), helper_io).await
            }
        };
        let (mut helper, helper_pid, stdin, stdout, output) = match started {
            Ok(started) => started,
            Err(err) => {
                remove_cgroup(cgroup).await;
                return Err(err);
            }
        };
        let log_copy = match (output, log) {
            (Some(output), Some(log)) => Some(tokio::spawn(copy_log(output, log))),
            _ => None,
        };
        let mut events = BufReader::new(stdout).lines();
        let handshake = self.handshake_in_time(
            stdin,
            &mut events,
            &plan,
            helper_pid,
            forked,
            cgroup.as_deref(),
        );
        let started = match handshake.await {
            Ok(started) => started,
            Err(err) => {
                kill_helper(&mut helper).await;
                remove_cgroup(cgroup).await;
                // The egress directory stays: a cold start may follow under this id.
                if let Some(survival) = &survival {
                    survival.forget(&spec.kernel_id, spec.generation);
                }
                return Err(err);
            }
        };
        if let Some(survival) = &survival {
            let record = Proc::of(i32::try_from(helper_pid).unwrap_or(0))
                .zip(Proc::of(started.init_pid))
                .map(|(helper, init)| Record {
                    kernel_id: spec.kernel_id.clone(),
                    generation: spec.generation,
                    key: spec.connection.key.clone(),
                    helper,
                    helper_forked: forked,
                    init,
                    kernel: started.kernel_pid.and_then(Proc::of),
                    cgroup: cgroup.as_ref().map(|c| c.parts()),
                    memory_limit: self.memory_limit(spec, cgroup.as_deref()),
                    workspace: plan_workspace.clone(),
                    started_ms: survival::now_ms(),
                });
            // Without its record the kernel still runs; it ends with this gateway's grace.
            match record.map(|record| survival.write(&record)) {
                Some(Ok(())) => {}
                Some(Err(err)) => {
                    tracing::warn!(kernel_id = %spec.kernel_id, %err, "the kernel's record could not be written: no later gateway can adopt it")
                }
                None => {
                    tracing::debug!(kernel_id = %spec.kernel_id, "the sandbox ended before its record was written")
                }
            }
        }
        let running = Running {
            helper,
            helper_pid,
            forked,
            events,
            log_copy,
            started,
        };
        Ok(self.watch(spec, running, cgroup, plan_workspace, survival))
    }

    /// The handshake with the helper (the plan out, the sandbox's pids back), bounded by the
    /// start timeout: a helper stuck in any step fails the launch instead of hanging it.
    async fn handshake_in_time(
        &self,
        stdin: Writer,
        events: &mut EventLines,
        plan: &Plan,
        helper_pid: u32,
        forked: bool,
        cgroup: Option<&KernelCgroup>,
    ) -> Result<Started, NamespacesError> {
        let handshake = handshake(stdin, events, plan, helper_pid, forked, self.ids, cgroup);
        match tokio::time::timeout(self.config.start_timeout, handshake).await {
            Ok(Ok(started)) => Ok(started),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(NamespacesError::Timeout(
                self.config.start_timeout.as_secs(),
            )),
        }
    }

    /// Makes the started sandbox's handle and hands the helper to its exit watcher, which
    /// reports the kernel's end (with the cgroup's and the host kernel's account of it).
    /// What the cgroup holds at most: memory and the workspace's files (see `cgroup`).
    fn memory_limit(&self, spec: &LaunchSpec, cgroup: Option<&KernelCgroup>) -> Option<u64> {
        cgroup.filter(|c| c.memory_limited()).and(
            spec.limits.memory_cgroup_bytes(Some(
                spec.limits
                    .workspace_bytes
                    .unwrap_or(self.config.default_workspace_bytes),
            )),
        )
    }

    fn watch(
        &self,
        spec: &LaunchSpec,
        running: Running,
        cgroup: Option<Arc<KernelCgroup>>,
        plan_workspace: PathBuf,
        survival: Option<Survival>,
    ) -> Launched {
        let Running {
            helper,
            helper_pid,
            forked,
            events,
            log_copy,
            started,
        } = running;
        let fault_log = started
            .kernel_pid
            .zip(started.kernel_ns_pid)
            .and_then(|(pid, ns_pid)| FaultLog::open(pid, ns_pid));
        let exited = Arc::new(AtomicBool::new(false));
        let detached = Arc::new(AtomicBool::new(false));
        let handle = Arc::new(NamespacesHandle {
            helper_pid,
            helper_forked: forked,
            init_pid: started.init_pid,
            init: started.init_pidfd,
            kernel_pid: started.kernel_pid,
            kernel: started.kernel_pidfd,
            exited: exited.clone(),
            detached: detached.clone(),
            cgroup: cgroup.clone(),
            workspace: plan_workspace,
        });
        tracing::info!(
            kernel_id = %spec.kernel_id,
            init_pid = started.init_pid,
            kernel_pid = started.kernel_pid,
            forked,
            "kernel started in a namespaces sandbox"
        );
        let (exit_tx, exit_rx) = watch::channel(None);
        let memory_limit = self.memory_limit(spec, cgroup.as_deref());
        let (kernel_id, generation) = (spec.kernel_id.clone(), spec.generation);
        tokio::spawn(async move {
            watch_exit(
                helper,
                events,
                exited,
                cgroup,
                memory_limit,
                log_copy,
                fault_log,
                exit_tx,
            )
            .await;
            // The sandbox is gone: nothing is left to adopt (unless this gateway let it go
            // for the next one, and is going itself).
            if let Some(survival) = survival {
                if !detached.load(Ordering::SeqCst) {
                    survival.forget(&kernel_id, generation);
                }
            }
        });
        Launched {
            handle,
            exit: exit_rx,
            connection: gateway_view(&spec.connection, &spec.runtime_dir, helper_pid),
        }
    }

    /// Spawns the helper (`cellgate __sandbox-init`); for a zygote, with the control socket
    /// as its standard input.
    async fn spawn_helper(
        &self,
        zygote: Option<(OwnedFd, tokio::net::UnixStream)>,
        io: HelperIo,
    ) -> Result<(Helper, u32, Writer, Reader, Option<Reader>), NamespacesError> {
        let program = self.init_program();
        let mut command = Command::new(&program);
        let (stdin, writer) = match zygote {
            Some((stdin, writer)) => (std::process::Stdio::from(stdin), Some(writer)),
            None => (std::process::Stdio::piped(), None),
        };
        let stderr = match io.log {
            Some(log) => std::process::Stdio::from(log),
            None => std::process::Stdio::piped(),
        };
        command
            .arg(SANDBOX_INIT_ARG)
            .env_clear()
            .stdin(stdin)
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(false);
        let control = io
            .control
            .as_ref()
            .map(|control| (std::os::fd::AsRawFd::as_raw_fd(control), keeper::CONTROL_FD));
        let spawned = self
            .spawner
            .spawn_with(command, io.pdeathsig, control)
            .await;
        // The helper has its own copy now.
        drop(io.control);
        let mut child =
            spawned.map_err(|source| NamespacesError::SpawnHelper { program, source })?;
        let helper_pid = child.id().unwrap_or(0);
        let writer: Option<Writer> = match writer {
            Some(writer) => Some(Box::new(writer)),
            None => child.stdin.take().map(|w| Box::new(w) as Writer),
        };
        let stderr = child.stderr.take();
        let (Some(writer), Some(stdout)) = (writer, child.stdout.take()) else {
            let _ = child.start_kill();
            let _ = child.wait().await;
            return Err(NamespacesError::Handshake(
                "helper has no stdio pipes".to_owned(),
            ));
        };
        // The kernel's stdout and stderr are this pipe: hand it to the sandbox user too, so
        // the kernel can reopen it as /dev/stdout or /dev/stderr.
        if let Some(stderr) = &stderr {
            self.hand_over_output(stderr);
        }
        Ok((
            Helper::Spawned(child),
            helper_pid,
            writer,
            Box::new(stdout),
            stderr.map(|e| Box::new(e) as Reader),
        ))
    }

    /// Has `zygote` fork the helper, its stdio three new pipes.
    async fn fork_helper(
        &self,
        spec: &LaunchSpec,
        zygote: &Arc<Zygote>,
        helper_io: HelperIo,
    ) -> Result<(Helper, u32, Writer, Reader, Option<Reader>), NamespacesError> {
        let io = |what: &'static str| {
            let path = spec.runtime_dir.clone();
            move |source| NamespacesError::Io { what, path, source }
        };
        let (plan_read, plan_write) = sys::pipe().map_err(io("pipe"))?;
        let (events_read, events_write) = sys::pipe().map_err(io("pipe"))?;
        // A kept sandbox's helper writes the log itself; else the gateway copies a pipe.
        let (output_read, output_write) = match helper_io.log {
            Some(log) => (None, OwnedFd::from(log)),
            None => {
                let (read, write) = sys::pipe().map_err(io("pipe"))?;
                self.hand_over_output(&read);
                (Some(read), write)
            }
        };
        let kept = helper_io.control.is_some();
        let egress = spec
            .egress_socket
            .as_deref()
            .map(|socket| match socket.parent().filter(|_| kept) {
                // A kept sandbox's bridge holds the socket's directory (see `pid1.rs`).
                Some(dir) => sys::open_path(dir),
                None => sys::open_path(socket),
            })
            .transpose()
            .map_err(io("open the egress proxy socket"))?;
        // A kept sandbox's helper gets its control socket and the egress directory through
        // a socket in the egress descriptor's place (see `keeper.rs`): the zygote passes
        // four descriptors at most.
        let egress = match helper_io.control {
            Some(control) => {
                let (ours, theirs) =
                    std::os::unix::net::UnixStream::pair().map_err(io("socketpair"))?;
                let stand_in;
                let egress = match &egress {
                    Some(fd) => fd.as_fd(),
                    None => {
                        stand_in =
                            std::fs::File::open("/dev/null").map_err(io("open /dev/null"))?;
                        stand_in.as_fd()
                    }
                };
                keeper::send_fds(&ours, [control.as_fd(), egress])
                    .map_err(io("hand the control socket over"))?;
                Some(OwnedFd::from(theirs))
            }
            None => egress,
        };
        let zygote = zygote.clone();
        let forked = tokio::task::spawn_blocking(move || {
            zygote.fork(
                [
                    plan_read.as_fd(),
                    events_write.as_fd(),
                    output_write.as_fd(),
                ],
                egress.as_ref().map(|fd| fd.as_fd()),
            )
        })
        .await
        .map_err(|err| NamespacesError::Handshake(err.to_string()))??;
        let (forked, pidfd) = forked;
        let helper_pid = u32::try_from(forked)
            .map_err(|_| NamespacesError::Handshake(format!("bad pid {forked}")))?;
        let pipe = |fd: OwnedFd| -> Result<tokio::net::unix::pipe::Receiver, NamespacesError> {
            tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(io("pipe"))
        };
        let writer =
            tokio::net::unix::pipe::Sender::from_owned_fd(plan_write).map_err(io("pipe"))?;
        let output = match output_read {
            Some(read) => Some(Box::new(pipe(read)?) as Reader),
            None => None,
        };
        Ok((
            Helper::Forked(pidfd),
            helper_pid,
            Box::new(writer),
            Box::new(pipe(events_read)?),
            output,
        ))
    }

    /// Gives the kernel's output pipe to the sandbox user (only a root gateway's differs).
    fn hand_over_output(&self, pipe: &impl std::os::fd::AsFd) {
        if self.ids.privileged {
            if let Err(err) = std::os::unix::fs::fchown(
                pipe,
                Some(self.ids.outside_uid),
                Some(self.ids.outside_gid),
            ) {
                tracing::warn!(%err, "cannot hand the kernel's output pipe to the sandbox user");
            }
        }
    }
}

impl Sandbox for NamespacesSandbox {
    fn backend(&self) -> Backend {
        Backend::Namespaces
    }

    fn kernels_outlive_gateway(&self) -> bool {
        self.core.config.survival.is_some()
    }

    fn survivor(&self, kernel_id: &str) -> Option<super::SurvivorInfo> {
        let record = self.core.config.survival.as_ref()?.read(kernel_id).ok()?;
        Some(super::SurvivorInfo {
            key: record.key,
            generation: record.generation,
            started_ms: record.started_ms,
            hibernated: false,
            hibernated_bytes: 0,
        })
    }

    fn forget(&self, kernel_id: &str) {
        if let Some(survival) = &self.core.config.survival {
            survival.remove(kernel_id);
        }
    }

    fn end_unclaimed(&self, claimed: &dyn Fn(&str) -> bool) -> usize {
        self.core
            .config
            .survival
            .as_ref()
            .map_or(0, |survival| survival.end_unclaimed(claimed))
    }

    fn egress_dir(&self, kernel_id: &str) -> Option<PathBuf> {
        let survival = self.core.config.survival.as_ref()?;
        let ids = self.core.ids;
        let owner = ids.privileged.then_some((ids.outside_uid, ids.outside_gid));
        match survival.egress_dir(kernel_id, owner) {
            Ok(dir) => Some(dir),
            Err(err) => {
                tracing::warn!(kernel_id, %err, "the kernel's egress proxy cannot listen where a later gateway would");
                None
            }
        }
    }

    fn launch<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<Launched, SandboxError>> {
        Box::pin(async move { Ok(self.core.launch(spec).await?) })
    }
}

/// A sandbox found again: its record, its processes pinned, and this gateway's attachment.
struct Survivor {
    record: Record,
    init: OwnedFd,
    kernel: OwnedFd,
    control: std::os::unix::net::UnixStream,
}

/// Reads `kernel_id`'s record, pins its processes (each pidfd opened before its start time is
/// compared, so a pid that names another process now fails), and proves `key` to its
/// helper. Blocking.
fn find_survivor(
    survival: &Survival,
    kernel_id: &str,
    key: &str,
) -> Result<Survivor, SurvivalError> {
    let record = survival.read(kernel_id)?;
    if record.key != key {
        return Err(SurvivalError::Refused(
            "the record holds another key".to_owned(),
        ));
    }
    let pin = |process: Proc, what: &'static str| -> Result<OwnedFd, SurvivalError> {
        let pidfd = sys::pidfd_open(process.pid).map_err(|_| SurvivalError::Gone(what))?;
        if survival::start_time(process.pid) != Some(process.start) || sys::pidfd_exited(&pidfd) {
            return Err(SurvivalError::Gone(what));
        }
        Ok(pidfd)
    };
    let init = pin(record.init, "init")?;
    let kernel = match record.kernel {
        Some(kernel) => pin(kernel, "kernel process"),
        None => Err(SurvivalError::Gone("kernel process")),
    };
    let kernel = match kernel {
        Ok(kernel) => kernel,
        Err(err) => {
            // An init without its kernel is about to end; ended now.
            let _ = sys::pidfd_send_signal(&init, libc::SIGKILL);
            return Err(err);
        }
    };
    pin(record.helper, "helper")?;
    let control = survival.attach(kernel_id, record.generation, key)?;
    Ok(Survivor {
        record,
        init,
        kernel,
        control,
    })
}

/// Opens the kernel's log for appending: the helper's output is copied there, so a failed
/// launch leaves its reason where the operator looks.
fn open_kernel_log(spec: &LaunchSpec) -> Result<std::fs::File, NamespacesError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log_file)
        .map_err(|source| NamespacesError::Io {
            what: "open the kernel log",
            path: spec.log_file.clone(),
            source,
        })
}

/// Ends a helper whose handshake failed, so no half-built sandbox is left running: a spawned
/// one is killed and reaped, a forked one killed through its pidfd (its reaper waits).
async fn kill_helper(helper: &mut Helper) {
    match helper {
        Helper::Spawned(child) => {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        Helper::Forked(pidfd) => {
            let _ = sys::pidfd_send_signal(pidfd, libc::SIGKILL);
        }
    }
}

/// A helper that answered the handshake: what its exit watcher and handle are made of.
struct Running {
    helper: Helper,
    helper_pid: u32,
    forked: bool,
    events: EventLines,
    /// The gateway's copy of the kernel's output (a kept sandbox's helper copies it).
    log_copy: Option<tokio::task::JoinHandle<()>>,
    started: Started,
}

/// A sandbox to be kept past the gateway: its settings and control socket.
struct Kept {
    survival: Survival,
    control: OwnedFd,
}

/// What a helper is given besides its pipes.
struct HelperIo {
    /// A kept sandbox's log file, the helper's stderr (else the gateway copies a pipe).
    log: Option<std::fs::File>,
    /// A kept sandbox's control socket, at `keeper::CONTROL_FD`.
    control: Option<OwnedFd>,
    /// Whether the helper dies with the gateway.
    pdeathsig: bool,
}

/// What the handshake learned.
struct Started {
    init_pid: i32,
    init_pidfd: Option<OwnedFd>,
    kernel_pid: Option<i32>,
    kernel_pidfd: Option<OwnedFd>,
    /// The kernel's pid inside the sandbox.
    kernel_ns_pid: Option<i32>,
}

async fn next_event(events: &mut EventLines, waiting_for: &str) -> Result<Event, NamespacesError> {
    let line = events
        .next_line()
        .await
        .map_err(|err| NamespacesError::Handshake(format!("reading events: {err}")))?
        .ok_or_else(|| {
            NamespacesError::Handshake(format!("exited while the gateway waited for {waiting_for}"))
        })?;
    let event: Event = serde_json::from_str(&line)
        .map_err(|err| NamespacesError::Handshake(format!("unreadable event {line:?}: {err}")))?;
    if let Event::Failed { stage, error } = event {
        return Err(NamespacesError::Step { stage, error });
    }
    Ok(event)
}

async fn handshake(
    mut stdin: Writer,
    events: &mut EventLines,
    plan: &Plan,
    helper_pid: u32,
    forked: bool,
    ids: IdMap,
    cgroup: Option<&KernelCgroup>,
) -> Result<Started, NamespacesError> {
    let mut line = serde_json::to_string(plan)
        .map_err(|err| NamespacesError::Handshake(format!("cannot encode the plan: {err}")))?;
    line.push('\n');
    let broken =
        |err: io::Error| NamespacesError::Handshake(format!("writing to the helper: {err}"));
    stdin.write_all(line.as_bytes()).await.map_err(broken)?;
    stdin.flush().await.map_err(broken)?;

    match next_event(events, "its namespaces").await? {
        Event::Unshared => {}
        other => return Err(NamespacesError::Handshake(format!("unexpected {other:?}"))),
    }
    // Off the async workers: moving a process into a v1 cgroup waits for an RCU grace
    // period, during which a worker stuck in the write held up a burst of kernel starts
    // (BENCHMARKS.md, "Measurements behind the code").
    let cgroup = cgroup.cloned();
    tokio::task::spawn_blocking(move || -> Result<(), NamespacesError> {
        // A forked helper wrote its own (see `IdMap::write_own`).
        if !forked {
            ids.write(helper_pid).map_err(NamespacesError::IdMap)?;
        }
        if let Some(cgroup) = cgroup {
            cgroup.join(helper_pid)?;
        }
        Ok(())
    })
    .await
    .map_err(|err| NamespacesError::Handshake(format!("joining the cgroup: {err}")))??;
    stdin
        .write_all(format!("{GO}\n").as_bytes())
        .await
        .map_err(broken)?;
    stdin.flush().await.map_err(broken)?;
    drop(stdin);

    // The helper reports the init and the init reports the kernel, from two processes:
    // either line may come first.
    let (mut init_pid, mut kernel_ns_pid) = (None, None);
    while init_pid.is_none() || kernel_ns_pid.is_none() {
        match next_event(events, "the init and the kernel process").await? {
            Event::Init { pid } => init_pid = Some(pid),
            Event::Kernel { pid } => kernel_ns_pid = Some(pid),
            other => return Err(NamespacesError::Handshake(format!("unexpected {other:?}"))),
        }
    }
    let Some(mut init_pid) = init_pid else {
        return Err(NamespacesError::Handshake("no init pid".to_owned()));
    };
    if forked {
        // A forked helper names its init by its pid in the zygote's pid namespace; the init
        // is its only child.
        init_pid = i32::try_from(helper_pid)
            .ok()
            .and_then(only_child)
            .ok_or_else(|| NamespacesError::Handshake("the init is gone".to_owned()))?;
    }
    // The init's pid is not reused before the helper reaps it, and the init only ends after
    // the kernel process, which has just started: this pidfd names the init. (If the kernel
    // ended at once, the init may be ending too; then the exit watch reports it.)
    let init_pidfd = sys::pidfd_open(init_pid).ok();
    // A kernel process that already ended has no pid any more; the launch still succeeded,
    // and its exit report follows.
    let kernel_pid = kernel_ns_pid.and_then(|ns_pid| kernel_child(init_pid, ns_pid));
    let kernel_pidfd = kernel_pid.and_then(|pid| sys::pidfd_open(pid).ok());
    Ok(Started {
        init_pid,
        init_pidfd,
        kernel_pid,
        kernel_pidfd,
        kernel_ns_pid,
    })
}

/// At most this much of a kernel's output is kept in its log file.
const LOG_LIMIT: u64 = 64 * MIB;

/// Appends the kernel's output (and the helper's own stderr) to the log file, up to
/// [`LOG_LIMIT`]; the rest is read and dropped so the kernel never blocks on a full pipe.
async fn copy_log(mut output: Reader, log: std::fs::File) {
    use tokio::io::AsyncReadExt;
    let mut log = tokio::fs::File::from_std(log);
    let mut written: u64 = 0;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match output.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if written < LOG_LIMIT {
            let keep = n.min(usize::try_from(LOG_LIMIT - written).unwrap_or(n));
            if log.write_all(&buf[..keep]).await.is_err() {
                written = LOG_LIMIT;
                continue;
            }
            written += keep as u64;
            if written >= LOG_LIMIT {
                let _ = log.write_all(b"\n[cellgate: kernel log truncated]\n").await;
            }
        }
    }
    let _ = log.flush().await;
}

async fn remove_cgroup(cgroup: Option<Arc<KernelCgroup>>) {
    if let Some(cgroup) = cgroup {
        let _ = tokio::task::spawn_blocking(move || cgroup.remove()).await;
    }
}

/// The host's kernel log from the kernel's start on, where Linux records a fault that kills
/// it. Only where the gateway runs in the host's own pid namespace (the log names processes
/// by their pids there, which are then the ones the gateway sees) and may read the log.
struct FaultLog {
    kmsg: cellgate_agent::fault::Kmsg,
    pid: u32,
    ns_pid: u32,
    comm: String,
}

impl FaultLog {
    /// The pid namespace every host process starts in (`PROC_PID_INIT_INO`).
    const HOST_PID_NAMESPACE: &'static str = "pid:[4026531836]";

    /// Opened once the kernel has its pid: the log then holds no record of an earlier
    /// process with that pid.
    fn open(pid: i32, ns_pid: i32) -> Option<FaultLog> {
        let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        if ns.as_os_str() != Self::HOST_PID_NAMESPACE {
            return None;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        Some(FaultLog {
            kmsg: cellgate_agent::fault::Kmsg::open().ok()?,
            pid: u32::try_from(pid).ok()?,
            ns_pid: u32::try_from(ns_pid).ok()?,
            comm: comm.trim_end_matches('\n').to_owned(),
        })
    }

    /// The kernel's own fault record, with its pid as the sandbox knows it.
    fn record(mut self) -> Option<String> {
        let messages = self.kmsg.drain();
        cellgate_agent::fault::fault_of(&messages, &self.comm, self.pid, self.ns_pid)
    }
}

// Each argument is one thing the exit report is made of, handed over once by `launch`; a
// struct for them would only be this list again.
#[allow(clippy::too_many_arguments)]
async fn watch_exit(
    helper: Helper,
    mut events: EventLines,
    exited: Arc<AtomicBool>,
    cgroup: Option<Arc<KernelCgroup>>,
    memory_limit: Option<u64>,
    log_copy: Option<tokio::task::JoinHandle<()>>,
    fault_log: Option<FaultLog>,
    exit_tx: watch::Sender<Option<ExitReport>>,
) {
    let mut kernel_status = None;
    let mut init_status = None;
    let mut failure = None;
    while let Ok(Some(line)) = events.next_line().await {
        match serde_json::from_str::<Event>(&line) {
            Ok(Event::Exited { code, signal }) => kernel_status = Some((code, signal)),
            Ok(Event::InitEnded { code, signal }) => init_status = Some((code, signal)),
            Ok(Event::Failed { stage, error }) => {
                failure = Some(format!("sandbox failure at {stage}: {error}"))
            }
            _ => {}
        }
    }
    // A forked helper's end is the end of its events (it reports last and exits).
    let helper = match helper {
        Helper::Spawned(mut child) => Some(child.wait().await),
        Helper::Forked(_) => None,
    };
    exited.store(true, Ordering::SeqCst);
    // Every writer of the output pipe is gone with the pid namespace: let the copy finish,
    // so the log is complete when the exit is reported.
    if let Some(copy) = log_copy {
        let _ = tokio::time::timeout(Duration::from_secs(2), copy).await;
    }
    let oom_kills = cgroup.as_ref().and_then(|c| c.oom_kills()).unwrap_or(0);
    remove_cgroup(cgroup).await;

    let (code, signal) = match (kernel_status, &helper, init_status) {
        (Some(status), _, _) => status,
        // No report from the init: it was killed (kill(), the OOM killer, or the gateway's
        // death). The helper said how, and exits with 128 + the init's signal.
        (None, _, Some(status)) => status,
        (None, Some(Ok(status)), None) => {
            use std::os::unix::process::ExitStatusExt;
            match (status.code(), status.signal()) {
                (Some(code), _) if code > 128 => (None, Some(code - 128)),
                (code, signal) => (code, signal),
            }
        }
        (None, _, None) => (None, None),
    };
    let reason = if signal == Some(libc::SIGKILL) && oom_kills > 0 {
        Some(ExitReason::new(
            ExitCause::OutOfMemory,
            match memory_limit {
                Some(bytes) => format!(
                    "kernel process killed by the out-of-memory killer (the sandbox's limit of {bytes} bytes, workspace files included)"
                ),
                None => "kernel process killed by the out-of-memory killer".to_owned(),
            },
        ))
    } else if let Some(Err(err)) = helper {
        Some(ExitReason::new(
            ExitCause::SandboxFailed,
            format!("lost track of the sandbox: {err}"),
        ))
    } else if let Some(text) = failure {
        Some(ExitReason::new(ExitCause::SandboxFailed, text))
    } else {
        // A fault: the host kernel's record of this kernel's own (never another process's).
        match (signal, fault_log) {
            (Some(signal), Some(log)) if cellgate_agent::fault::is_fault_signal(signal) => {
                tokio::task::spawn_blocking(move || log.record())
                    .await
                    .ok()
                    .flatten()
                    .map(|record| crate::sandbox::fault_reason(signal, &record))
            }
            _ => None,
        }
    };
    let _ = exit_tx.send(Some(ExitReport {
        code,
        signal,
        reason,
    }));
}

/// Control of one sandboxed kernel.
struct NamespacesHandle {
    helper_pid: u32,
    /// The helper is a zygote's child, which the zygote reaps: its pid is not ours to signal
    /// (it may name another process by then). The init's end is its end.
    helper_forked: bool,
    init_pid: i32,
    init: Option<OwnedFd>,
    kernel_pid: Option<i32>,
    kernel: Option<OwnedFd>,
    exited: Arc<AtomicBool>,
    /// Let go for the next gateway to adopt: its end is not this gateway's to clean up.
    detached: Arc<AtomicBool>,
    cgroup: Option<Arc<KernelCgroup>>,
    /// The workspace's path inside the sandbox.
    workspace: PathBuf,
}

impl NamespacesHandle {
    fn gone(&self) -> bool {
        self.exited.load(Ordering::SeqCst)
    }
}

fn ignore_esrch(result: io::Result<()>) -> Result<(), SandboxError> {
    match result {
        Err(err) if err.raw_os_error() != Some(libc::ESRCH) => Err(SandboxError::Signal(err)),
        _ => Ok(()),
    }
}

impl SandboxHandle for NamespacesHandle {
    fn pid(&self) -> Option<u32> {
        self.kernel_pid.and_then(|pid| u32::try_from(pid).ok())
    }

    /// The signals the init forwards go through the init's pidfd (which cannot name a
    /// recycled process); the init passes them to the kernel's process group. Others go to
    /// the kernel's process group directly, while its pidfd says it exists.
    fn signal(&self, signal: i32) -> Result<(), SandboxError> {
        if self.gone() {
            return Ok(());
        }
        if let (true, Some(init)) = (pid1::FORWARDED.contains(&signal), &self.init) {
            return ignore_esrch(sys::pidfd_send_signal(init, signal));
        }
        match (self.kernel_pid, &self.kernel) {
            (Some(_), Some(pidfd)) if sys::pidfd_exited(pidfd) => Ok(()),
            (Some(pid), Some(pidfd)) => match sys::kill(-pid, signal) {
                Ok(()) => Ok(()),
                Err(_) => ignore_esrch(sys::pidfd_send_signal(pidfd, signal)),
            },
            (Some(pid), None) => ignore_esrch(sys::kill(-pid, signal)),
            (None, _) => Ok(()),
        }
    }

    fn kill(&self) -> Result<(), SandboxError> {
        if self.gone() {
            return Ok(());
        }
        // The init's death ends the pid namespace, and with it every process inside.
        let result = match &self.init {
            Some(pidfd) => sys::pidfd_send_signal(pidfd, libc::SIGKILL),
            None => sys::kill(self.init_pid, libc::SIGKILL),
        };
        if let Some(cgroup) = &self.cgroup {
            cgroup.kill_all();
        }
        if let Ok(pid) = i32::try_from(self.helper_pid) {
            if pid > 0 && !self.helper_forked {
                let _ = sys::kill(pid, libc::SIGKILL);
            }
        }
        ignore_esrch(result)
    }

    /// The workspace is a tmpfs in the sandbox's mount namespace: reached through the
    /// kernel's root (the same mount namespace as the init's; the kernel's pid is the one
    /// whose liveness the caller can check).
    fn workspace_root(&self, _host_workspace: &Path) -> Option<(PathBuf, PathBuf)> {
        let pid = self.kernel_pid.unwrap_or(self.init_pid);
        let relative = self.workspace.strip_prefix("/").unwrap_or(&self.workspace);
        Some((
            PathBuf::from(format!("/proc/{pid}/root")),
            relative.to_owned(),
        ))
    }

    fn alive(&self) -> bool {
        match &self.kernel {
            Some(pidfd) => !self.gone() && !sys::pidfd_exited(pidfd),
            // Without a pidfd (kernels older than 5.3) the pid cannot be pinned.
            None => false,
        }
    }

    fn usage(&self) -> ResourceUsage {
        if let Some(cgroup) = &self.cgroup {
            let usage = cgroup.usage();
            if usage.memory_bytes.is_some() {
                return usage;
            }
        }
        self.kernel_pid
            .and_then(|pid| u32::try_from(pid).ok())
            .and_then(crate::sandbox::procfs::usage)
            .unwrap_or_default()
    }

    fn pids_limit_hits(&self) -> Option<u64> {
        self.cgroup.as_ref()?.pids_limit_hits()
    }

    fn detach(&self) {
        self.detached.store(true, Ordering::SeqCst);
    }
}

/// Directories on the kernel's `PYTHONPATH` inside its workspace: Python caches a missing
/// `sys.path` entry as "no finder" for good, so a directory pip creates later (the
/// per-session site-packages) would stay invisible to `import` in the same kernel. They are
/// made before Python starts.
fn workspace_dirs(
    env: &std::collections::BTreeMap<String, String>,
    workspace: &Path,
) -> Vec<PathBuf> {
    env.get("PYTHONPATH")
        .map(|p| {
            std::env::split_paths(p)
                .filter(|d| d.is_absolute() && d.starts_with(workspace))
                .filter(|d| !d.components().any(|c| c.as_os_str() == ".."))
                .collect()
        })
        .unwrap_or_default()
}

/// The gateway's way to the kernel's ipc sockets: the runtime directory is a tmpfs inside
/// the sandbox, reached through the helper's root. The helper shares the sandbox's mount
/// namespace, so `pivot_root` moved its root too, and unlike the init it stays dumpable
/// (it never changes uid), so an unprivileged gateway may follow `/proc/<pid>/root` as well.
/// A helper forked from a zygote is not dumpable (entering its user namespace without
/// privilege cleared it): a root gateway follows the link by its capabilities, and an
/// unprivileged gateway forks no kernels.
fn gateway_view(
    connection: &ConnectionInfo,
    runtime_dir: &Path,
    helper_pid: u32,
) -> ConnectionInfo {
    let mut info = connection.clone();
    if info.transport == "ipc" {
        if let Ok(rest) = Path::new(&info.ip).strip_prefix(runtime_dir) {
            let inside = Path::new(relocate::RUN_DIR).join(rest);
            info.ip = format!("/proc/{helper_pid}/root{}", inside.display());
        }
    }
    info
}
