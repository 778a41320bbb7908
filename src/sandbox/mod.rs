//! Where a kernel process runs. One trait, one module per backend; the rest of the gateway
//! never knows which backend it is talking to.
//!
//! A backend receives a [`LaunchSpec`] (the command, its environment, the kernel's private
//! runtime directory holding the ipc sockets and the connection file, the workspace, the
//! limits, the egress proxy's socket and, for a pod, its settings) and returns a
//! [`Launched`] kernel: a handle to signal and kill it, an exit watch, and the connection
//! info as the *gateway* must use it (a backend that exposes the runtime directory under
//! another path inside the sandbox rewrites the paths).
//!
//! Invariants every backend keeps:
//! - the kernel dies with the gateway, also when the gateway is killed with SIGKILL (every
//!   spawn happens on one long-lived thread with `PR_SET_PDEATHSIG`, because the signal
//!   follows the forking *thread*: `spawner.rs`);
//! - `kill` ends the kernel and everything it started (its whole process group);
//! - the exit watch reports exactly one [`ExitReport`] when the kernel is gone.
//!
//! The backends: `namespaces` (the default; Linux namespaces, Landlock and seccomp, written
//! in Rust), `gvisor` (`runsc`), `microvm` (a VM per kernel, QEMU and the guest agent),
//! `kubernetes` (a pod per kernel, the same agent over TCP) and `process` (no isolation, for
//! development: refused unless the configuration names it). `Backends` makes each on first
//! use and shares it: a kernel's policy picks its backend, and `--sandbox B` forces one on
//! every kernel (the only way `process` runs). A backend says whether it records kernels'
//! owners for other gateway replicas (`Sandbox::shares_ownership`); nothing above this
//! module asks which backend it is.
//!
//! Pieces every backend shares live once, beside the backends: the fixed paths the kernel
//! sees (`relocate.rs`), the host files a root shows (`rootfs.rs`), where the gateway sits
//! in the host's cgroup hierarchies (`cgroupfs.rs`, also read by `doctor`), a sandbox's
//! cgroup below the gateway's own (`cgroups.rs`: the namespaces backend's kernels and the
//! microvm backend's VMMs), a process's usage from `/proc` (`procfs.rs`), the spawner, the
//! Python environment discovery and syscall wrappers, and what a backend says about the host
//! (`diagnosis.rs`: each backend answers `diagnose` in its own module; `doctor` only prints
//! the answers beside its set-up checks).
//!
//! Two invariants of the backends that run the kernel on this host's kernel (namespaces,
//! gVisor):
//! - the kernel sees fixed paths, never the host's (`relocate.rs` says how, and what else
//!   could name a host path);
//! - a RAM-backed workspace is charged to the sandbox's memory cgroup, so that cgroup holds
//!   the policy's memory plus the workspace's size (`Limits::memory_cgroup_bytes`): a full
//!   workspace is `ENOSPC` in the cell, never an out-of-memory kill. IPython's, matplotlib's
//!   and the XDG caches live in the sandbox's `/tmp`, not in the workspace.
//!
//! Must not depend on: kernels' channels, sessions, HTTP.

pub mod agent;
pub mod cgroupfs;
mod cgroups;
pub mod diagnosis;
mod gvisor;
mod host_paths;
pub mod kubernetes;
pub mod microvm;
mod namespaces;
mod process;
mod procfs;
mod python_env;
pub mod relocate;
pub mod rootfs;
mod spawner;
mod sys;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use crate::ownership::{KernelRecord, Ownership, SingleGateway};
use crate::protocol::ConnectionInfo;

pub use gvisor::{
    gvisor_keeper_main, GvisorConfig, GvisorSandbox, GVISOR_KEEPER_ARG,
    PIDS_OVERHEAD as GVISOR_PIDS_OVERHEAD,
};
pub use kubernetes::{KubernetesError, KubernetesSandbox, PodSettings};
pub use microvm::{
    microvm_keeper_main, MicrovmConfig, MicrovmError, MicrovmSandbox, MICROVM_KEEPER_ARG,
};
pub use namespaces::{
    become_kernel, sandbox_init_main, NamespacesConfig, NamespacesError, NamespacesSandbox,
    Survival, ZygoteSettings, SANDBOX_INIT_ARG, ZYGOTE_ONE_THREAD,
};
pub use process::ProcessSandbox;

/// The sandbox backends, by the names policies and the config use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// No isolation: a plain child process. Development only; refused unless named.
    Process,
    /// Linux namespaces, seccomp, cgroups (the default once available).
    Namespaces,
    /// gVisor's runsc.
    Gvisor,
    /// A virtual machine per kernel (QEMU's microvm machine), reached through the guest
    /// agent.
    Microvm,
    /// A Kubernetes pod per kernel (isolated by the policy's RuntimeClass), reached over TCP
    /// through the same agent.
    Kubernetes,
}

impl Backend {
    /// Whether the backend gives the kernel a way to the gateway's egress proxy (the
    /// namespaces bridge, the microVM agent's proxy port); the others have no network at all.
    pub fn bridges_egress(self) -> bool {
        match self {
            Backend::Namespaces | Backend::Microvm | Backend::Kubernetes => true,
            Backend::Process | Backend::Gvisor => false,
        }
    }

    /// Whether the kernel has a private `/tmp` of the sandbox's own (every backend but the
    /// unisolated process), where its configuration and caches go instead of the workspace.
    pub fn private_tmp(self) -> bool {
        self != Backend::Process
    }

    /// Whether a probe sandbox is cheap enough for the gateway's background checks; a
    /// microVM's is a VM boot (seconds of CPU under emulation, in every gateway that names
    /// the backend): its host facts, images and binaries are checked instead, and its
    /// kernels' starts tell the rest.
    pub fn cheap_probe(self) -> bool {
        self != Backend::Microvm
    }

    /// Whether the kernel's workspace is served by its agent (`SandboxHandle::guest_files`)
    /// rather than opened by the gateway.
    pub fn has_agent(self) -> bool {
        match self {
            Backend::Microvm | Backend::Kubernetes => true,
            Backend::Process | Backend::Namespaces | Backend::Gvisor => false,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Process => "process",
            Backend::Namespaces => "namespaces",
            Backend::Gvisor => "gvisor",
            Backend::Microvm => "microvm",
            Backend::Kubernetes => "kubernetes",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = SandboxError;
    fn from_str(s: &str) -> Result<Backend, SandboxError> {
        match s {
            "process" => Ok(Backend::Process),
            "namespaces" => Ok(Backend::Namespaces),
            "gvisor" => Ok(Backend::Gvisor),
            "microvm" => Ok(Backend::Microvm),
            "kubernetes" => Ok(Backend::Kubernetes),
            other => Err(SandboxError::UnknownBackend(other.to_owned())),
        }
    }
}

/// Makes the sandbox of `backend`: the microvm backend with `microvm`, the namespaces backend
/// with `zygote`, the namespaces and gvisor backends with `survival`, the kubernetes backend
/// with this gateway's membership among replicas, the others with their default
/// configuration.
pub fn create(
    backend: Backend,
    microvm: &MicrovmConfig,
    zygote: &ZygoteSettings,
    survival: Option<Survival>,
    replicas: Option<Arc<kubernetes::replicas::Replicas>>,
) -> Result<Arc<dyn Sandbox>, SandboxError> {
    Ok(match backend {
        Backend::Process => Arc::new(ProcessSandbox::new()?),
        Backend::Namespaces => Arc::new(NamespacesSandbox::new(NamespacesConfig {
            zygote: zygote.clone(),
            survival,
            ..NamespacesConfig::default()
        })?),
        Backend::Gvisor => Arc::new(GvisorSandbox::new(GvisorConfig {
            survival,
            ..GvisorConfig::default()
        })?),
        Backend::Microvm => Arc::new(MicrovmSandbox::new(MicrovmConfig {
            survival,
            ..microvm.clone()
        })?),
        Backend::Kubernetes => Arc::new(KubernetesSandbox::new(replicas)),
    })
}

/// What `backend` says about this host (`cellgate doctor`); with `probe`, a real sandbox is
/// started to prove it. `zygote`: whether the configuration wants kernels forked from a
/// zygote (`--kernel-zygote`).
pub async fn diagnose(
    backend: Backend,
    probe: bool,
    microvm: &MicrovmConfig,
    zygote: bool,
) -> diagnosis::Diagnosis {
    match backend {
        Backend::Process => process::diagnose(),
        Backend::Namespaces => namespaces::diagnose::diagnose(probe, zygote).await,
        Backend::Gvisor => gvisor::diagnose(probe).await,
        Backend::Microvm => microvm::diagnose::diagnose(probe, microvm).await,
        Backend::Kubernetes => kubernetes::diagnose().await,
    }
}

/// Diagnoses backends with one gateway's settings (`diagnose`).
#[derive(Clone)]
pub struct Diagnoser {
    microvm: MicrovmConfig,
    zygote: bool,
}

impl Diagnoser {
    /// What `backend` says about this host; with `probe`, a real sandbox is started.
    pub async fn diagnose(&self, backend: Backend, probe: bool) -> diagnosis::Diagnosis {
        diagnose(backend, probe, &self.microvm, self.zygote).await
    }
}

/// The backends of one gateway. Each policy names its backend; a backend is made on first
/// use and then shared by all its kernels, so a gateway serves namespaces and gVisor
/// kernels side by side. An operator may force one backend for every kernel (`--sandbox`):
/// `process` for development, or e.g. `gvisor` to run everything in the stronger sandbox.
pub struct Backends {
    forced: Option<Backend>,
    microvm: MicrovmConfig,
    zygote: ZygoteSettings,
    survival: Option<Survival>,
    replicas: Option<Arc<kubernetes::replicas::Replicas>>,
    /// Who owns which kernel: this gateway alone, or the replicas' Leases.
    ownership: Arc<dyn Ownership>,
    made: parking_lot::Mutex<std::collections::HashMap<Backend, Arc<dyn Sandbox>>>,
}

impl Backends {
    pub fn new(forced: Option<Backend>, microvm: MicrovmConfig) -> Backends {
        Backends {
            forced,
            microvm,
            zygote: ZygoteSettings::default(),
            survival: None,
            replicas: None,
            ownership: Arc::new(SingleGateway),
            made: parking_lot::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// The namespaces backend's zygotes (on by default).
    pub fn with_zygote(mut self, zygote: ZygoteSettings) -> Backends {
        self.zygote = zygote;
        self
    }

    /// Namespaces, gVisor and microVM kernels outlive the gateway (see `namespaces`,
    /// "Outliving the gateway", `gvisor`, *Lifetime*, and `microvm`, *Outliving the
    /// gateway*).
    pub fn with_survival(mut self, survival: Option<Survival>) -> Backends {
        self.survival = survival;
        self
    }

    /// Records kernel pods' owners among `replicas` (the kubernetes backend), which then
    /// answer who owns which kernel.
    pub fn with_replicas(mut self, replicas: Arc<kubernetes::replicas::Replicas>) -> Backends {
        self.ownership = replicas.clone();
        self.replicas = Some(replicas);
        self
    }

    /// Who owns which kernel.
    pub fn ownership(&self) -> &Arc<dyn Ownership> {
        &self.ownership
    }

    /// What diagnoses the backends with this gateway's settings, apart from the backends
    /// themselves (a check that outlives them holds nothing of theirs).
    pub fn diagnoser(&self) -> Diagnoser {
        Diagnoser {
            microvm: self.microvm.clone(),
            zygote: self.zygote.enabled,
        }
    }

    /// The backend every kernel runs in, when the operator forced one.
    pub fn forced(&self) -> Option<Backend> {
        self.forced
    }

    /// Whether a policy with `settings` runs kernelspec `name` in an image of its own on
    /// `backend` (Kubernetes' `kernel_images`), whatever the backend's default image holds.
    pub fn has_own_image(&self, backend: Backend, settings: &BackendSettings, name: &str) -> bool {
        backend == Backend::Kubernetes
            && settings
                .kubernetes
                .as_ref()
                .is_some_and(|pods| pods.kernel_images.contains_key(name))
    }

    /// The kernelspecs whose environments `backend`'s image holds, for a backend whose
    /// kernels run from an image: the microVM root image's manifest lists them; the
    /// kernel pod image lists none (it holds the python3 venv alone).
    pub fn image_environments(&self, backend: Backend) -> Vec<String> {
        match backend {
            Backend::Microvm => microvm::image::environments(&self.microvm.guest_dir),
            _ => Vec::new(),
        }
    }

    /// Ends the sandboxes that outlived the gateway before this one and that no session
    /// claims ([`Sandbox::end_unclaimed`]), in those of the `used` backends that keep
    /// kernels (namespaces and gVisor; no other backend is set up for it). Blocking; the
    /// number ended.
    pub fn end_unclaimed(
        &self,
        used: impl IntoIterator<Item = Backend>,
        claimed: &dyn Fn(&str) -> bool,
    ) -> usize {
        let mut seen = std::collections::HashSet::new();
        let mut ended = 0;
        for wanted in used {
            let backend = self.forced.unwrap_or(wanted);
            if !matches!(backend, Backend::Namespaces | Backend::Gvisor) || !seen.insert(backend) {
                continue;
            }
            if let Ok(sandbox) = self.get(backend) {
                if sandbox.kernels_outlive_gateway() {
                    ended += sandbox.end_unclaimed(claimed);
                }
            }
        }
        ended
    }

    /// The sandbox for a policy that names `wanted` (or the forced one). A backend this host
    /// cannot run is an error each time it is asked for, so a fixed host needs no restart.
    pub fn get(&self, wanted: Backend) -> Result<Arc<dyn Sandbox>, SandboxError> {
        let backend = self.forced.unwrap_or(wanted);
        if backend == Backend::Process && self.forced != Some(Backend::Process) {
            // A policy file alone never turns isolation off.
            return Err(SandboxError::ProcessNotAllowed);
        }
        let mut made = self.made.lock();
        if let Some(sandbox) = made.get(&backend) {
            return Ok(sandbox.clone());
        }
        let sandbox = create(
            backend,
            &self.microvm,
            &self.zygote,
            self.survival.clone(),
            self.replicas.clone(),
        )?;
        made.insert(backend, sandbox.clone());
        Ok(sandbox)
    }
}

/// Resource limits a backend enforces where it can. `None` means "no limit from the policy";
/// a backend that cannot enforce a set limit logs so at launch (the `process` backend
/// enforces none), and `cellgate doctor` says which ones this host cannot enforce.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    /// Thousandths of a CPU, so limits stay `Eq`.
    pub cpu_millis: Option<u32>,
    pub pids: Option<u64>,
    pub workspace_bytes: Option<u64>,
}

impl Limits {
    /// The limit of the sandbox's memory cgroup when its workspace is a RAM disk of
    /// `workspace_in_ram` bytes: memory plus the workspace.
    ///
    /// Why: a tmpfs's pages are charged to the memory cgroup of whoever writes them and
    /// cannot be reclaimed without swap, so with the cgroup at `memory` alone a full workspace
    /// killed the kernel for memory instead of answering ENOSPC. With room for both, filling
    /// the workspace ends at its own size with `No space left on device` and the kernel lives;
    /// the processes (with their `/tmp` and `/dev/shm`, RAM disks too) may use what the
    /// workspace's files leave free of the sum. A sandbox never costs the host more RAM than
    /// memory + workspace.
    pub fn memory_cgroup_bytes(&self, workspace_in_ram: Option<u64>) -> Option<u64> {
        self.memory_bytes
            .map(|memory| memory.saturating_add(workspace_in_ram.unwrap_or(0)))
    }
}

/// Everything a backend needs to start one kernel.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// The kernel's id, for logs and cgroup names.
    pub kernel_id: String,
    /// The command, placeholders already substituted. `argv[0]` is a host path.
    pub argv: Vec<String>,
    /// The complete environment of the kernel: nothing of the gateway's leaks in.
    pub env: BTreeMap<String, String>,
    /// Private 0700 directory with the connection file and the ipc sockets.
    pub runtime_dir: PathBuf,
    /// The connection file inside `runtime_dir`, as the gateway wrote it.
    pub connection_file: PathBuf,
    /// The connection info in the file (paths as the gateway sees them).
    pub connection: ConnectionInfo,
    /// The kernel's writable working directory.
    pub workspace: PathBuf,
    /// Where the kernel's stdout and stderr go (inside `runtime_dir`'s parent, never inside
    /// the workspace): the gateway reads its tail to explain a kernel that died.
    pub log_file: PathBuf,
    pub limits: Limits,
    /// The egress proxy's unix socket for this generation, when the gateway opened one: the
    /// backend gives the kernel its way to it (the namespaces bridge). The sandbox knows
    /// nothing else of the proxy.
    pub egress_socket: Option<PathBuf>,
    /// The policy lets a microVM run under software emulation (`[sandbox] allow_emulation`).
    pub allow_emulation: bool,
    /// The policy lets a namespaces kernel be forked from the zygote (`[sandbox] zygote`).
    pub zygote: bool,
    /// Who the kernel is for (a backend that labels its sandboxes or records their owners
    /// names them).
    pub labels: KernelLabels,
    /// A running sandbox to attach to rather than a new one: an orphan's, taken over from a
    /// gateway that is gone (the first generation of an adopted kernel only).
    pub adopt: Option<KernelRecord>,
    /// The policy's settings for its backend, opaque above the sandbox.
    pub backend_settings: BackendSettings,
    /// The kernel's state generation this launch starts (a surviving sandbox's record
    /// keeps it).
    pub generation: u64,
}

/// Who a kernel is for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelLabels {
    pub policy: String,
    pub tenant: Option<String>,
    pub kernelspec: String,
}

/// A policy's settings for the backends that take any beyond the common limits (the
/// `[kubernetes]` section), carried through the kernel core without its looking inside.
#[derive(Debug, Clone, Default)]
pub struct BackendSettings {
    pub(crate) kubernetes: Option<Arc<PodSettings>>,
    /// The policy asks for hibernation (`[limits] hibernate_after`): the sandbox must be one
    /// that can be saved (a microVM on virtio-serial, with its VMM's control socket kept).
    pub(crate) hibernate: bool,
}

impl BackendSettings {
    /// The kubernetes backend's pod settings.
    pub fn kubernetes(settings: Arc<PodSettings>) -> BackendSettings {
        BackendSettings {
            kubernetes: Some(settings),
            hibernate: false,
        }
    }
}

/// The words an [`ExitReport`] reason uses for the pids limit.
pub const PIDS_LIMIT_REASON: &str = "policy pids limit";

/// Why a sandbox ended, as far as its backend can tell. The kernel side maps it to the
/// cell's outcome (`kernel::execution`); nothing classifies the reason's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitCause {
    /// The kernel exited or was killed by a signal; its code or signal says the rest.
    Exited,
    /// The out-of-memory killer ended it (the sandbox's memory limit).
    OutOfMemory,
    /// The sandbox's pids limit ended it (gVisor cannot survive that; the namespaces backend
    /// can, and reports it per execution instead).
    PidsLimit,
    /// The sandbox itself failed, or the gateway lost track of it.
    SandboxFailed,
}

/// A backend's explanation of an end: its cause and the sentence people see. It reads as
/// that sentence (`Deref<Target = str>`), which is all a person or a log wants of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReason {
    pub cause: ExitCause,
    pub text: String,
}

impl ExitReason {
    pub fn new(cause: ExitCause, text: String) -> ExitReason {
        ExitReason { cause, text }
    }
}

impl std::ops::Deref for ExitReason {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// How a kernel process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReport {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// A backend's explanation when it knows more (OOM kill, limit hit, sandbox failure).
    pub reason: Option<ExitReason>,
}

impl ExitReport {
    /// Why the sandbox ended.
    pub fn cause(&self) -> ExitCause {
        self.reason
            .as_ref()
            .map_or(ExitCause::Exited, |reason| reason.cause)
    }

    /// Whether the kernel process was killed by the out-of-memory killer (its memory limit).
    /// The namespaces and gVisor backends read the cgroup's OOM events.
    pub fn is_oom(&self) -> bool {
        self.cause() == ExitCause::OutOfMemory
    }

    /// A short human-readable description for the kernel model's `reason`.
    pub fn describe(&self) -> String {
        if let Some(reason) = &self.reason {
            return reason.text.clone();
        }
        match (self.code, self.signal) {
            (_, Some(sig)) => match signal_name(sig) {
                Some(name) => format!("kernel process killed by signal {sig} ({name})"),
                None => format!("kernel process killed by signal {sig}"),
            },
            (Some(code), None) => format!("kernel process exited with code {code}"),
            (None, None) => "kernel process ended".to_owned(),
        }
    }
}

/// The name of the signals a kernel commonly dies of.
pub fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    })
}

/// The reason of a kernel killed by a fault whose record the sandbox's own kernel logged
/// (`cellgate_agent::fault`): the signal, and where it happened, in Linux's words.
pub fn fault_reason(signal: i32, record: &str) -> ExitReason {
    let name = signal_name(signal).unwrap_or("a fault signal");
    // A guest agent's record is the guest's word: no longer than the agent would send.
    let record: String = record
        .chars()
        .take(cellgate_agent::fault::MAX_FAULT_BYTES)
        .collect();
    ExitReason::new(
        ExitCause::Exited,
        format!("kernel process killed by signal {signal} ({name}); Linux logged: {record}"),
    )
}

/// Control of a running sandboxed kernel.
pub trait SandboxHandle: Send + Sync {
    /// The kernel's process id as the host sees it, when there is one.
    fn pid(&self) -> Option<u32>;
    /// Delivers a signal to the kernel process itself (interrupts use SIGINT).
    fn signal(&self, signal: i32) -> Result<(), SandboxError>;
    /// Ends the kernel and everything it started, at once.
    fn kill(&self) -> Result<(), SandboxError>;
    /// CPU time and memory used so far, where the backend can measure them.
    fn usage(&self) -> ResourceUsage {
        ResourceUsage::default()
    }
    /// How many times a process or thread creation was refused for the sandbox's pids limit,
    /// where the backend can tell (cgroup `pids.events`).
    fn pids_limit_hits(&self) -> Option<u64> {
        None
    }
    /// Where the gateway reaches the kernel's `workspace`: a directory the gateway may open
    /// normally (it trusts every component), and a path relative to it that the sandbox may
    /// have changed, to be resolved without following any link (openat2 with
    /// `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`). Backends whose workspace is a host
    /// directory answer the workspace itself and `.`; the namespaces backend's workspace is
    /// a tmpfs in the sandbox's mount namespace, reached through its root in /proc (and
    /// gVisor's a tmpfs in `runsc run`'s). `None`: no process holds it any more.
    fn workspace_root(&self, workspace: &std::path::Path) -> Option<(PathBuf, PathBuf)> {
        Some((workspace.to_owned(), PathBuf::from(".")))
    }
    /// The workspace when the sandbox serves it itself (a microVM's agent): then the
    /// gateway never opens [`SandboxHandle::workspace_root`]. `None`: the gateway opens it.
    fn guest_files(&self) -> Option<Arc<dyn crate::workspace::GuestFiles>> {
        None
    }
    /// Closes the gateway's link to a kernel that outlives it (a pod another replica takes
    /// over): its end is not reported and nothing is killed. Backends whose kernels die with
    /// the gateway have nothing to do.
    fn detach(&self) {}
    /// Saves the running sandbox to disk and ends it, its memory freed (hibernation): a
    /// later launch with [`LaunchSpec::adopt`] restores it, the kernel's process and
    /// variables as they were. What the save needs to know of the kernel is in `about`.
    /// Backends that cannot (all but a hibernation-capable microVM) refuse, the sandbox
    /// untouched.
    fn hibernate<'a>(
        &'a self,
        _about: &'a Hibernation,
    ) -> BoxFuture<'a, Result<Hibernated, SandboxError>> {
        Box::pin(async {
            Err(SandboxError::Setup(
                "this sandbox cannot hibernate".to_owned(),
            ))
        })
    }
    /// Whether the kernel process still exists. Checked *after* opening a path from
    /// [`SandboxHandle::workspace_root`] under `/proc/<pid>`: a process that has not exited
    /// cannot have had its pid reused, so the handle opened was the sandbox's.
    fn alive(&self) -> bool {
        true
    }
}

/// Resource use of one kernel, as far as the backend knows.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ResourceUsage {
    pub cpu_time: Option<Duration>,
    pub memory_bytes: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
}

/// A started kernel.
pub struct Launched {
    pub handle: Arc<dyn SandboxHandle>,
    /// `None` while running, then the exit report, exactly once.
    pub exit: watch::Receiver<Option<ExitReport>>,
    /// The connection info the gateway connects with.
    pub connection: ConnectionInfo,
}

/// A sandbox backend.
pub trait Sandbox: Send + Sync {
    fn backend(&self) -> Backend;
    /// Starts a kernel. Returns once the kernel process exists (not once it is ready).
    fn launch<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<Launched, SandboxError>>;
    /// How many times the gateway's start timeout a kernel here may take to become ready:
    /// 1, except where the host makes every start slow by nature (an emulated VM), so that
    /// the timeout catches a kernel that hangs, not one that runs at the emulator's speed.
    fn start_time_factor(&self) -> u32 {
        1
    }
    /// Whether this backend records each kernel's owner in the shared registry (`ownership`),
    /// so other gateways may route to its kernels or take them over, and its kernels outlive
    /// this gateway's process.
    fn shares_ownership(&self) -> bool {
        false
    }
    /// Whether this backend's kernels outlive the gateway's process, for the next gateway on
    /// the same state directory to adopt (the namespaces, gvisor and microvm backends with
    /// `--kernels-outlive-gateway`).
    fn kernels_outlive_gateway(&self) -> bool {
        false
    }
    /// The sandbox of `kernel_id` that outlived the gateway before this one, as its record
    /// says (a launch with [`LaunchSpec::adopt`] then attaches to it and checks it).
    fn survivor(&self, _kernel_id: &str) -> Option<SurvivorInfo> {
        None
    }
    /// Where `kernel_id`'s egress proxy listens when that must be the same place for every
    /// gateway on this state directory (a surviving sandbox's bridge connects there);
    /// `None`: in the kernel's runtime directory.
    fn egress_dir(&self, _kernel_id: &str) -> Option<PathBuf> {
        None
    }
    /// Where `kernel_id`'s directories (runtime directory, workspace, log) go when the next
    /// gateway must find them at the same host paths (a kept gVisor sandbox's `ipc://`
    /// sockets and workspace mount are there); `None`: below the gateway's runtime root.
    fn kernel_dir(&self, _kernel_id: &str) -> Option<PathBuf> {
        None
    }
    /// `kernel_id` is shut down for good: whatever this backend kept of it for a later
    /// gateway goes.
    fn forget(&self, _kernel_id: &str) {}
    /// Ends at once the sandboxes that outlived the gateway before this one and that no
    /// session claims (`claimed(kernel_id)` false: a pool's or a Kernel Gateway API kernel,
    /// which nothing would ask for again), rather than leaving them to their orphan grace.
    /// Called once at start, under the state directory's lock. Blocking; the number ended.
    fn end_unclaimed(&self, _claimed: &dyn Fn(&str) -> bool) -> usize {
        0
    }
}

/// A sandbox that outlived its gateway, as far as the kernel's layer needs to know it.
#[derive(Debug, Clone)]
pub struct SurvivorInfo {
    /// The key the kernel's messages are signed with.
    pub key: String,
    /// The kernel's state generation.
    pub generation: u64,
    /// When the kernel started (Unix time, milliseconds).
    pub started_ms: u64,
    /// It is saved on disk (hibernated), not running: adopting it restores it, which is
    /// left to the session's next request rather than done at start.
    pub hibernated: bool,
    /// What it takes on disk while hibernated (0 otherwise): tenants' quotas count it.
    pub hibernated_bytes: u64,
}

/// What a backend saving a sandbox to disk records of its kernel (see
/// [`SandboxHandle::hibernate`]), to give it back as a [`SurvivorInfo`].
#[derive(Debug, Clone)]
pub struct Hibernation {
    pub kernel_id: String,
    pub key: String,
    pub generation: u64,
    pub started_ms: u64,
}

/// A sandbox saved to disk.
#[derive(Debug, Clone, Copy)]
pub struct Hibernated {
    /// Bytes on disk: the saved state and what the sandbox keeps beside it (a workspace
    /// disk, as allocated).
    pub bytes: u64,
}

/// Errors of sandbox backends.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "unknown sandbox backend {0:?} (known: process, namespaces, gvisor, microvm, kubernetes)"
    )]
    UnknownBackend(String),
    #[error("the process backend runs kernels without any isolation; name it explicitly (--sandbox process) to use it")]
    ProcessNotAllowed,
    #[error("could not start {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("could not signal the kernel: {0}")]
    Signal(#[source] std::io::Error),
    #[error("sandbox set-up failed: {0}")]
    Setup(String),
    /// A save to disk (hibernation) not made now, the sandbox untouched: it may be tried
    /// again later (the disk is too full, say).
    #[error("not saved now: {0}")]
    NotNow(String),
    #[error(transparent)]
    Namespaces(#[from] NamespacesError),
    #[error(transparent)]
    Microvm(MicrovmError),
    #[error(transparent)]
    Kubernetes(Box<KubernetesError>),
}

impl SandboxError {
    /// Whether the backend refused the launch for what this host cannot do for the
    /// kernel's policy (a microVM under emulation the policy does not allow), as opposed
    /// to a launch that failed.
    pub fn is_refusal(&self) -> bool {
        matches!(self, SandboxError::Microvm(MicrovmError::Accel(_)))
    }

    /// The error code of a start that failed for what the cluster said (clients get the
    /// reason: a pod that did not schedule or pull, or that failed while it started), as
    /// opposed to an internal error.
    /// The sandbox's image cannot run the kernel asked for (its message says which and
    /// how to get one that can): the client's choice, told as it is.
    pub fn unsupported_kernel(&self) -> Option<String> {
        match self {
            SandboxError::Microvm(MicrovmError::Unsupported(e)) => Some(e.to_string()),
            SandboxError::Kubernetes(error) => match &**error {
                KubernetesError::Unsupported(e) => Some(e.to_string()),
                _ => None,
            },
            _ => None,
        }
    }

    pub fn start_failure(&self) -> Option<&'static str> {
        match self {
            SandboxError::Kubernetes(error) => match **error {
                KubernetesError::Pending { .. } => Some("pod_pending"),
                KubernetesError::Ended(_) => Some("pod_failed"),
                _ => None,
            },
            _ => None,
        }
    }
}
