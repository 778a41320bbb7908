//! The `microvm` backend: every kernel in a virtual machine of its own, with its own guest
//! Linux kernel, reached only through the guest agent.
//!
//! # Design
//!
//! **One VM per kernel.** The VMM ([`vmm::Vmm`]; QEMU's `microvm` machine today, see
//! `qemu`, behind that trait so Firecracker or Cloud Hypervisor can be added) boots the
//! project's guest kernel (a Linux built from Debian's source with `guest/kernel.config`)
//! straight into an initramfs that holds only the agent (`guest/agent`, a crate of this
//! workspace, pid 1). The agent mounts the shared read-only ext4 root image (Debian's Python
//! and the kernel's venv at `/opt/cellgate/venv`, `guest/build-image.py`) under a tmpfs
//! overlay the size of the writable layer, and waits for the gateway. `./dev setup` builds
//! all three into `target/guest/` (each cached by the hash of its inputs) and names them in
//! `guest.json` ([`image`]).
//!
//! **No network.** The guest has no network device at all. Everything crosses one byte
//! stream, the agent link ([`vmm::AgentLink`]: hybrid vsock through vhost-device-vsock by
//! default, the agent dialing the host, or virtio-serial; see [`link`]), carrying a yamux
//! session (`sandbox::agent`, protocol in `guest/agent/src/protocol.rs`): a JSON-lines
//! control stream (zygote, restored, start, signal, kill, usage, the kernel's exit), one
//! stream per ZMQ connection of the kernel's five channels, one per TCP connection the
//! kernel makes to its proxy port 127.0.0.1:3128, joined here to the gateway's egress proxy,
//! so egress and package policies hold unchanged, and one per workspace file operation
//! (list, read, a framed write committed by an empty frame, so a dropped upload leaves
//! nothing; stat, mkdir, rename, remove; the same `cellgate_agent::workspace` code as a host
//! workspace).
//!
//! Two things the link taught: yamux takes in window updates only on reads, so a side that
//! only writes (an upload, a download) keeps a task reading the stream, or it stalls after
//! the first 256 KiB; and the agent writes at most 8 KiB at a time to vsock, because
//! vhost-device-vsock 0.3.0 lost bytes of larger writes (the gateway's yamux decoder met file
//! bytes where a frame header belonged).
//!
//! **The gateway's side of the channels** (`channels`): the backend listens on the ipc
//! paths of the kernel's connection info (in the runtime directory) and turns each
//! connection into a channel stream; the agent joins it to the kernel's own socket in the
//! guest. ZMTP passes through untouched, so the gateway's kernel client is the same for
//! every backend.
//!
//! **Limits.** Memory is the guest's RAM ([`GUEST_OVERHEAD_MIB`] above the policy's
//! figure, which the agent sets on the kernel's cgroup inside, so the guest's own OOM
//! killer picks the kernel and the agent reports `oom`); CPUs are vCPUs; pids are the
//! guest cgroup's; the workspace is a sparse ext4 disk of the policy's size, private to the
//! VM and deleted with it.
//!
//! **Host detection** ([`accel`]): real VMX/SVM means KVM, where the guest gets `-cpu host`;
//! a PVM-only host (this project's CI machines) or none means QEMU's emulation (TCG), which
//! works but is ~50x slower for Python and is refused at launch unless
//! `--microvm-allow-emulation` or the policy's `[sandbox] allow_emulation` allows it. Under
//! TCG the guest is given the host's TSC rate (a busy host otherwise made guests hang
//! calibrating their timers) and the `Nehalem` CPU model, not `max` (`qemu::TCG_CPU` says
//! why: QEMU 7.2 mis-decodes the AVX2 gathers numpy's argsort uses).
//!
//! **Why a VM ended** (`handle.rs`): the kernel's own end (code, signal, OOM, pids) is told
//! apart from a VMM killed by the gateway, a guest kernel panic (from its console) and a VMM
//! crash; a kernel killed by a fault also carries the guest kernel's record of it.
//!
//! **The warm pool** (`snapshot.rs`, `qmp.rs`): later sessions of a kind of VM are restored
//! from a snapshot of a zygote VM instead of booting.
//!
//! **Hibernation** (`hibernate.rs`): a session's VM, idle past its policy's
//! `hibernate_after`, is saved whole to the state directory (its RAM and devices through QMP
//! `migrate`, its workspace disk moved beside it; 0700/0600, the kernel's key in its record)
//! and ended; the next request restores it (`-incoming` on the saved state, `cont`), the
//! gateway and the agent proving the kernel's key to each other before the agent serves
//! anything (the agent's kernel outlived its detached session). Such a VM runs on
//! virtio-serial (a vhost-user device cannot be migrated) and keeps its VMM's QMP socket
//! for its life. A save that fails ends the VM (reported as a lost sandbox); a restore that
//! fails (files damaged or gone, other guest images, QEMU or VM shape, a guest that does
//! not prove the key) removes what was saved and the kernel layer starts a fresh kernel,
//! its generation moved on. Every step has a deadline.
//!
//! **Outliving the gateway** (`--kernels-outlive-gateway`, with a state directory;
//! `survival.rs`, `keeper.rs`). A session's VM keeps running when its gateway stops (SIGTERM:
//! API v1 sessions' kernels only, as for the other backends) or dies (SIGKILL), and the next
//! gateway on the same state directory adopts it: the session is live again with its
//! variables, workspace files and state generation.
//!
//! - *What outlives the gateway*: QEMU, started as every VMM is (its own uid, cgroup,
//!   host view and limits, `confine.rs`) but with no parent-death signal, in a process group
//!   of its own, never killed when the gateway's handle on it is dropped; its cgroup; and
//!   the kernel's directories, at `<state dir>/sandboxes/<kernel id>/k/` instead of below the
//!   gateway's runtime root ([`Sandbox::kernel_dir`]): the VM's runtime directory with its
//!   console, workspace disk, the virtio-serial socket and (for a VM that may hibernate) its
//!   QMP socket, and the kernel's log.
//! - *The link*: such a VM always runs on virtio-serial, QEMU listening on `agent.sock` in
//!   its runtime directory, which the next gateway connects to. Hybrid vsock would need its
//!   device backend (`vhost-device-vsock`, a process per VM) kept as well, with the guest's
//!   RAM shared with it; QEMU already listens, and hibernation uses the same link. The
//!   agent treats a lost link as a detach (its kernel runs on) and serves a new session only
//!   once it attached with the key proof both ways (`Agent::attach`): a gateway that does not
//!   hold the kernel's key reaches nothing of the kernel, and the gateway uses no VM that
//!   cannot prove it. The state directory must leave the kernels' socket paths under 108
//!   bytes (`<state dir>` under ~33 characters); a longer one turns survival off for
//!   microVMs with a warning at start.
//! - *What ends an orphan*: a keeper, this binary run with [`MICROVM_KEEPER_ARG`], started
//!   with the VM (no parent-death signal either). It holds a pidfd of QEMU (opened while the
//!   launching gateway, QEMU's parent, was alive, and checked against QEMU's start time),
//!   counts the launching gateway as there while its command pipe is open and an adopting
//!   one while its control connection is (after the challenge `namespaces::survival` runs,
//!   `control-g<generation>.sock`), and with neither for `--orphan-grace` kills QEMU through
//!   the pidfd, then removes the VM's cgroup, the kernel's directories and the control
//!   socket; the record stays, so the next gateway reports the session's sandbox lost. A
//!   keeper on the host rather than the agent powering the guest off: the guest runs the
//!   kernel's code, and a guest taken over would keep its VM forever.
//! - *Adoption*: the record (`record.json`, 0600 in a 0700 directory: QEMU's and the
//!   keeper's pid and start time, the VM's directory, cgroup, uid and shape, the
//!   generation, the kernel's key), written once the kernel started, and before that,
//!   between QEMU's start and its keeper's, with no keeper (`survival::NO_KEEPER`): a
//!   gateway killed in that window leaves a record, and the next one's start-up sweep ends
//!   the live QEMU it names whose keeper is not alive. Adopting, a gateway
//!   opens a pidfd of QEMU and checks its start time (a reused pid fails), proves the key to
//!   the keeper, connects to the serial socket and checks that its listener is that QEMU
//!   (`SO_PEERCRED`: the VM's directory is the VMM's to write, and a link planted in place
//!   of the socket must lead nowhere; nothing is sent before), handshakes with the agent and
//!   attaches (both prove the key), then serves the kernel's channels again; guest egress streams are
//!   joined to the new gateway's proxy. The VMM's uid is reserved for it (no new VM gets it),
//!   its end is watched through the pidfd (not its child: no exit status, but the agent
//!   still reports the kernel's end, and the console a guest panic), and `kill` signals the
//!   pidfd. A VM whose QEMU is gone is `sandbox_lost` (its leftovers swept at the backend's
//!   start, or at the failed adoption), and the next execute starts a fresh kernel; one that
//!   does not prove the key is killed. Kept VMs no session claims (a kernel pool's, the
//!   Kernel Gateway API's) are ended by the next gateway at its start
//!   ([`Sandbox::end_unclaimed`]).
//! - *Hibernated and warm-pool VMs*: a hibernated VM is already on disk
//!   (`<state dir>/hibernated/`) and is restored at its session's next request, as before;
//!   the VM it is restored into is kept like any other. A kept VM started for a policy with
//!   `hibernate_after` keeps its QMP socket, so an adopted one can still hibernate. The warm
//!   pool's snapshots are files, untouched by a restart; its zygote VMs are the gateway's own
//!   and end with it.
//!
//! # Invariants
//!
//! - Everything from the guest is hostile input: lines are capped, requests and replies have
//!   deadlines, guest-opened streams are capped per VM (64) and yamux to 128 streams of
//!   256 KiB windows, the log tail and console are read to a bounded length, and a malformed
//!   message ends the session and the VM (reported as a sandbox failure).
//! - A VMM its guest took over holds nothing else (`confine.rs`, `hostview.rs`).
//! - A snapshot holds nothing per session or secret, and every clone redraws what the zygote
//!   drew (`snapshot.rs`). A hibernated VM is one session's, in the gateway's private
//!   directory, restored once, into its own session only.
//!
//! Must not depend on: kernels' channels, sessions, HTTP.

pub mod accel;
mod confine;
pub mod diagnose;
mod handle;
mod hibernate;
mod hostview;
pub mod image;
mod keeper;
pub mod link;
mod qemu;
mod qmp;
mod snapshot;
mod survival;
pub mod vmm;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cellgate_agent::protocol::{
    fixed_at_zygote_start, ConnectionFile, Op, Reply, Zygote, PRELOAD_ENV,
};
use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::agent::{self, channels};
use super::relocate::{self, Relocation};
use super::spawner::Spawner;
use super::{Backend, LaunchSpec, Launched, Sandbox, SandboxError};
pub use confine::IDENTITY_BASE as VMM_IDENTITY_BASE;
use handle::MicrovmHandle;
pub use hibernate::Hibernations;
pub use keeper::{microvm_keeper_main, MICROVM_KEEPER_ARG};
use vmm::{Accel, VmSpec, Vmm};

/// RAM the guest gets beyond the policy's memory limit: its kernel, the agent and a little
/// page cache. The kernel's cgroup inside holds the policy's figure.
pub const GUEST_OVERHEAD_MIB: u64 = 160;
/// The guest's RAM when the policy sets no memory limit.
const DEFAULT_MEMORY_MIB: u64 = 1024;
/// The workspace disk's size when the policy sets none.
const DEFAULT_WORKSPACE_BYTES: u64 = 1 << 30;
/// The writable layer over the root image (`/tmp`, `~/.cache`…), in the guest's RAM.
const LAYER_MIB: u64 = 256;
/// The kernel's user in the guest.
const KERNEL_UID: u32 = 1000;
/// What the VMM needs on the host beyond the guest's RAM: QEMU itself, the translated-code
/// cache under emulation ([`qemu::TCG_CACHE_MIB`]), the vsock backend. The VM's cgroup
/// holds guest RAM plus this.
const VMM_OVERHEAD_MIB: u64 = 192 + qemu::TCG_CACHE_MIB;

/// Errors of the microvm backend.
#[derive(Debug, thiserror::Error)]
pub enum MicrovmError {
    #[error("the guest image is missing: {0}")]
    Image(String),
    #[error("{0}")]
    Accel(String),
    #[error("the VM could not start: {0}")]
    Start(String),
    #[error("guest agent: {0}")]
    Agent(String),
    #[error(transparent)]
    Unsupported(#[from] agent::UnsupportedKernel),
    #[error("confining the VMM: {0}")]
    Confine(#[from] confine::ConfineError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<agent::AgentError> for MicrovmError {
    fn from(error: agent::AgentError) -> MicrovmError {
        MicrovmError::Agent(error.0)
    }
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> MicrovmError {
    let what = what.into();
    move |source| MicrovmError::Io { what, source }
}

/// The backend's settings.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// The QEMU binary.
    pub qemu: PathBuf,
    /// Where `./dev setup` put the guest images (`guest.json` inside).
    pub guest_dir: PathBuf,
    /// Whether to serve with software emulation when the host has no usable KVM.
    pub allow_emulation: bool,
    /// How long a VM may take from start to its agent's handshake.
    pub boot_timeout: Duration,
    /// The agent link; `None`: hybrid vsock where `vhost-device-vsock` is installed (in the
    /// guest directory's `tools/bin`, or on `PATH`), virtio-serial otherwise.
    pub transport: Option<link::Transport>,
    /// Whether sessions get VMs restored from warm-pool snapshots (`snapshot.rs`) where
    /// their kind of VM has one, rather than booted.
    pub snapshots: bool,
    /// Where the snapshots are kept; `None`: `snapshots/` in the guest directory.
    pub snapshot_dir: Option<PathBuf>,
    /// Whether emulated VMs' snapshots import the kernelspec's preload list too
    /// (`CELLGATE_PRELOAD`, see `cellgate_agent::protocol::PRELOAD_ENV`); with KVM they
    /// always do.
    pub preload_under_emulation: bool,
    /// An operator's own guest kernel (an uncompressed `vmlinux`) instead of the project's.
    pub guest_kernel: Option<PathBuf>,
    /// Whether [`Self::guest_kernel`] is a PVM guest (for hosts whose KVM is PVM-only).
    pub guest_kernel_pvm: bool,
    /// Where hibernated VMs are saved (`<state-dir>/hibernated`, see `hibernate.rs`);
    /// `None` (no state directory): no VM hibernates.
    pub hibernate_dir: Option<PathBuf>,
    /// Session VMs outlive the gateway, each under a keeper, for the next gateway on the
    /// same state directory (`survival.rs`); `None`: they end with it.
    pub survival: Option<super::Survival>,
}

impl MicrovmConfig {
    /// The operator's guest kernel and whether it is a PVM guest, when one is given.
    pub fn own_kernel(&self) -> Option<(&Path, bool)> {
        self.guest_kernel
            .as_deref()
            .map(|kernel| (kernel, self.guest_kernel_pvm))
    }
}

impl Default for MicrovmConfig {
    fn default() -> MicrovmConfig {
        MicrovmConfig {
            qemu: PathBuf::from("qemu-system-x86_64"),
            guest_dir: image::default_dir(),
            allow_emulation: false,
            boot_timeout: Duration::from_secs(120),
            transport: None,
            snapshots: true,
            snapshot_dir: None,
            preload_under_emulation: false,
            guest_kernel: None,
            guest_kernel_pvm: false,
            hibernate_dir: None,
            survival: None,
        }
    }
}

/// Starts kernels in microVMs.
pub struct MicrovmSandbox {
    core: Arc<Core>,
}

/// The backend's state, shared with the background tasks that make snapshots.
struct Core {
    config: MicrovmConfig,
    images: image::GuestImages,
    accel: Accel,
    transport: link::Transport,
    /// Guest kernel command-line words this host needs (the TSC rate under emulation).
    host_cmdline: Vec<String>,
    vmm: Arc<dyn Vmm>,
    spawner: Spawner,
    confiner: confine::Confiner,
    /// Why a launch is refused unless its policy allows emulation; `None`: VMs may start.
    emulation_refused: Option<String>,
    /// The warm pool's snapshots, when they are on and their directory could be made.
    snapshots: Option<snapshot::Snapshots>,
    /// Hibernated VMs, when the gateway has a state directory.
    hibernations: Option<Arc<hibernate::Hibernations>>,
    /// What a saved VM state depends on beyond its shape: the guest images, the VMM, the
    /// accelerator and CPU model (a hibernated VM is restored only into the same).
    machine: String,
}

impl MicrovmSandbox {
    /// Finds the guest images and decides how VMs get their CPU. Must be called from within
    /// a tokio runtime (the spawner thread registers children with it).
    pub fn new(mut config: MicrovmConfig) -> Result<MicrovmSandbox, SandboxError> {
        if let Some(kept) = &config.survival {
            if kept.kept_paths_fit() {
                survival::sweep(kept);
            } else {
                tracing::warn!(dir = %kept.dir.display(), "microVM kernels end with the gateway: their socket paths below this state directory would be too long for a unix socket (choose a shorter --state-dir)");
                config.survival = None;
            }
        }
        let images = image::GuestImages::locate(&config.guest_dir, config.own_kernel())?;
        let decision = accel::choose(&accel::HostFacts::read(Path::new("/")), images.pvm_guest);
        // Emulation is refused per launch, not here: a policy may allow it for its own
        // kernels (`[sandbox] allow_emulation`) where the gateway does not for all.
        let emulation_refused =
            (decision.accel == Accel::Tcg && !config.allow_emulation).then(|| {
                format!(
                    "{}; microVMs would run under software emulation (TCG), ~50x slower, which \
                     is refused for serving: --microvm-allow-emulation (or \
                     CELLGATE_MICROVM_ALLOW_EMULATION=true, or microvm_allow_emulation = true \
                     in the config file) accepts it for every policy, `allow_emulation = \
                     true` in a policy's [sandbox] for that policy's kernels",
                    decision.why
                )
            });
        let accel = decision.accel;
        if accel == Accel::Tcg {
            tracing::warn!(
                why = %decision.why,
                allowed = if config.allow_emulation { "for every policy" } else { "only for policies with allow_emulation" },
                "microvm: VMs run under SOFTWARE EMULATION (TCG): functional, ~50x slower \
                 for Python; not for production"
            );
        }
        let mut host_cmdline = Vec::new();
        if accel == Accel::Tcg {
            // See accel::host_tsc_khz. no_timer_check: the emulated timer may miss the
            // IO-APIC check's deadline on a busy host; the timer works regardless.
            host_cmdline.push("no_timer_check".to_owned());
            if let Some(khz) = accel::host_tsc_khz() {
                host_cmdline.push(format!("tsc_early_khz={khz}"));
            }
        }
        let transport = match config.transport.clone() {
            Some(link::Transport::Vsock { backend }) => link::Transport::Vsock {
                backend: absolute_program(&backend)?,
            },
            Some(transport) => transport,
            None => match default_transport(&config.guest_dir) {
                link::Transport::Vsock { backend } => link::Transport::Vsock {
                    backend: absolute_program(&backend)?,
                },
                transport => transport,
            },
        };
        // A VMM starts in a root of its own (`hostview`), where only absolute paths to the
        // files it was shown lead anywhere.
        let qemu_binary = absolute_program(&config.qemu)?;
        tracing::info!(
            accel = accel.as_str(),
            transport = transport.name(),
            kept = config.survival.is_some(),
            "microvm backend ready"
        );
        let spawner = Spawner::start("cellgate-microvm-spawner")?;
        let mut shown = vec![
            qemu_binary.as_path(),
            images.kernel.as_path(),
            images.initramfs.as_path(),
            images.root.as_path(),
        ];
        if let link::Transport::Vsock { backend } = &transport {
            shown.push(backend);
        }
        let confiner = confine::Confiner::new(accel == Accel::Kvm, &shown)
            .map_err(|e| SandboxError::Setup(format!("microvm: {e}")))?;
        if let Some(kept) = &config.survival {
            confiner.reserve(&survival::live_uids(kept));
        }
        let snapshots = config
            .snapshots
            .then(|| open_snapshots(&config, &images, &qemu_binary, accel, &host_cmdline))
            .flatten();
        let hibernations = match &config.hibernate_dir {
            Some(dir) => match hibernate::Hibernations::open(dir) {
                Ok(hibernations) => Some(Arc::new(hibernations)),
                Err(error) => {
                    tracing::warn!(%error, "microvm: VMs cannot hibernate (their kernels are culled at idle_timeout instead)");
                    None
                }
            },
            None => None,
        };
        let machine = [
            snapshot::file_input(&images.kernel),
            snapshot::file_input(&images.initramfs),
            snapshot::file_input(&images.root),
            snapshot::file_input(&qemu_binary),
            accel.as_str().to_owned(),
            cellgate_agent::protocol::MAGIC.to_owned(),
        ]
        .join(" ");
        Ok(MicrovmSandbox {
            core: Arc::new(Core {
                confiner,
                emulation_refused,
                transport,
                host_cmdline,
                vmm: Arc::new(qemu::Qemu {
                    binary: qemu_binary,
                }),
                config,
                images,
                accel,
                spawner,
                snapshots,
                hibernations,
                machine,
            }),
        })
    }

    /// How this backend's VMs get their CPU.
    pub fn accel(&self) -> Accel {
        self.core.accel
    }

    /// How this backend's VMs talk to the gateway (a VM restored from a snapshot always
    /// over virtio-serial).
    pub fn transport(&self) -> &link::Transport {
        &self.core.transport
    }

    /// Where the warm pool's snapshots are kept, when they are on.
    pub fn snapshot_dir(&self) -> Option<&Path> {
        self.core.snapshots.as_ref().map(|s| s.dir())
    }
}

/// The warm pool's snapshots for VMs of these images, accelerator and command line, or
/// `None` (said loudly) where their directory cannot be made.
fn open_snapshots(
    config: &MicrovmConfig,
    images: &image::GuestImages,
    qemu: &Path,
    accel: Accel,
    host_cmdline: &[String],
) -> Option<snapshot::Snapshots> {
    let dir = config
        .snapshot_dir
        .clone()
        .unwrap_or_else(|| config.guest_dir.join("snapshots"));
    let mut inputs = vec![
        format!("cellgate {}", env!("CARGO_PKG_VERSION")),
        cellgate_agent::protocol::MAGIC.to_owned(),
        snapshot::file_input(&images.kernel),
        snapshot::file_input(&images.initramfs),
        snapshot::file_input(&images.root),
        snapshot::file_input(qemu),
        accel.as_str().to_owned(),
        // A VM's state holds its CPU's model and features: a state saved with another model
        // is never restored into this one.
        match accel {
            Accel::Tcg => format!("cpu {}", qemu::TCG_CPU),
            Accel::Kvm => "cpu host".to_owned(),
        },
        // The TSC rate is measured at each start and jitters by a few kHz: to the MHz, so a
        // restarted gateway finds its snapshots (the guest's clock runs off the host's TSC
        // either way; the rate only steers its calibration).
        host_cmdline
            .iter()
            .map(|word| match word.strip_prefix("tsc_early_khz=") {
                Some(khz) => format!("tsc_mhz={}", khz.parse::<u64>().unwrap_or(0) / 1000),
                None => word.clone(),
            })
            .collect::<Vec<_>>()
            .join(" "),
        format!("layer {LAYER_MIB} overhead {GUEST_OVERHEAD_MIB} disk {SNAPSHOT_DISK_BYTES}"),
    ];
    if accel == Accel::Kvm {
        // `-cpu host`: the state holds this CPU's model and features.
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        inputs.extend(
            cpuinfo
                .lines()
                .filter(|l| l.starts_with("model name") || l.starts_with("flags"))
                .take(2)
                .map(str::to_owned),
        );
    }
    match snapshot::Snapshots::open(&dir, &inputs) {
        Ok(snapshots) => Some(snapshots),
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "microvm: no warm-pool snapshots (their directory cannot be made): every VM boots");
            None
        }
    }
}

impl Sandbox for MicrovmSandbox {
    fn backend(&self) -> Backend {
        Backend::Microvm
    }

    fn launch<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<Launched, SandboxError>> {
        Box::pin(async move { Ok(self.core.launch_vm(spec).await?) })
    }

    fn kernels_outlive_gateway(&self) -> bool {
        self.core.config.survival.is_some()
    }

    /// A hibernated VM is a sandbox the kernel layer may adopt: adopting restores it; so is
    /// a running VM that outlived the gateway before this one.
    fn survivor(&self, kernel_id: &str) -> Option<super::SurvivorInfo> {
        if let Some(hibernated) = self
            .core
            .hibernations
            .as_ref()
            .and_then(|h| h.survivor(kernel_id))
        {
            return Some(hibernated);
        }
        let record = survival::read(self.core.config.survival.as_ref()?, kernel_id).ok()?;
        Some(super::SurvivorInfo {
            key: record.key,
            generation: record.generation,
            started_ms: record.started_ms,
            hibernated: false,
            hibernated_bytes: 0,
        })
    }

    fn kernel_dir(&self, kernel_id: &str) -> Option<PathBuf> {
        self.core
            .config
            .survival
            .as_ref()?
            .kept_kernel_dir(kernel_id)
    }

    fn end_unclaimed(&self, claimed: &dyn Fn(&str) -> bool) -> usize {
        self.core
            .config
            .survival
            .as_ref()
            .map_or(0, |kept| survival::end_unclaimed(kept, claimed))
    }

    fn forget(&self, kernel_id: &str) {
        if let Some(hibernations) = &self.core.hibernations {
            hibernations.remove(kernel_id);
        }
        if let Some(kept) = &self.core.config.survival {
            survival::forget(kept, kernel_id);
        }
    }

    /// Under emulation Python runs ~50x slower: ipykernel's imports alone took over the
    /// default 60 s on a busy 2-core machine while the VM was healthy.
    fn start_time_factor(&self) -> u32 {
        match self.core.accel {
            Accel::Tcg => TCG_START_TIME_FACTOR,
            _ => 1,
        }
    }
}

/// How many times the start timeout an emulated VM's kernel gets (5 minutes by default).
const TCG_START_TIME_FACTOR: u32 = 5;

/// The workspace disk's size in a zygote VM: a blank sparse placeholder, as large as any
/// restored VM's disk may be (the guest keeps the size it saw at its boot).
const SNAPSHOT_DISK_BYTES: u64 = 1 << 40;
/// How long a zygote may take to import the kernel's modules.
const ZYGOTE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the VMM may take to write a zygote's state.
const SAVE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a zygote's guest gets to see its host go away before it is saved: the agent is
/// then back to waiting for a gateway (a restored VM that is not says `HELLO` again anyway).
const SETTLE: Duration = Duration::from_millis(1000);
/// The VMM's control socket in the VM's runtime directory (snapshots and restores only).
const QMP_SOCKET: &str = "qmp.sock";

/// What a zygote VM is made from, besides its [`snapshot::Kind`].
struct ZygotePlan {
    kind: snapshot::Kind,
    zygote: Zygote,
}

impl Core {
    async fn launch_vm(self: &Arc<Self>, spec: &LaunchSpec) -> Result<Launched, MicrovmError> {
        if let Some(refused) = self
            .emulation_refused
            .as_ref()
            .filter(|_| !spec.allow_emulation)
        {
            return Err(MicrovmError::Accel(refused.clone()));
        }
        let unloaded;
        let spec = if self.accel == Accel::Tcg
            && !self.config.preload_under_emulation
            && spec.env.contains_key(PRELOAD_ENV)
        {
            // Under emulation the preload is a cell's cost, not every snapshot's.
            let mut without = spec.clone();
            without.env.remove(PRELOAD_ENV);
            unloaded = without;
            &unloaded
        } else {
            spec
        };
        let environment = agent::check_image_runs(spec, "microvm", &self.images.environments)?;
        let environment = environment.as_deref();
        let map = agent::relocation(spec);
        let connection = agent::guest_connection(spec, &map)?;
        let size = VmSize::of(&spec.limits);
        if spec.adopt.is_some() {
            let hibernated = self
                .hibernations
                .as_ref()
                .is_some_and(|h| h.survivor(&spec.kernel_id).is_some());
            if let (false, Some(kept)) = (hibernated, &self.config.survival) {
                return self.adopt_running(spec, kept).await;
            }
            return self
                .restore_hibernated(spec, &map, environment, connection, size)
                .await;
        }
        let plan = self.zygote_plan(spec, &map, environment, size, connection.is_some());
        let snapshots = self.snapshots.as_ref();
        if let Some((plan, snapshots)) = plan.as_ref().zip(snapshots) {
            if let Some(file) = snapshots.open_ready(&plan.kind) {
                match self
                    .attempt(
                        spec,
                        &map,
                        environment,
                        connection.clone(),
                        size,
                        Some(file),
                    )
                    .await
                {
                    Ok(launched) => return Ok(launched),
                    Err(error) => {
                        snapshots.discard(&plan.kind, &error.to_string());
                        clear_runtime_dir(&spec.runtime_dir);
                    }
                }
            }
        }
        let launched = self
            .attempt(spec, &map, environment, connection, size, None)
            .await?;
        if let Some((plan, snapshots)) = plan.zip(snapshots) {
            if snapshots.claim(&plan.kind) {
                let core = self.clone();
                tokio::spawn(async move {
                    let made = core.make_snapshot(&plan).await.map_err(|e| e.to_string());
                    if let Some(snapshots) = &core.snapshots {
                        snapshots.made(&plan.kind, made);
                    }
                });
            }
        }
        Ok(launched)
    }

    /// The zygote that a VM for `spec` could be restored from, when it is a kernel the
    /// launcher starts (`python -m cellgate_kernel_launcher …`: Python kernelspecs; Deno, R
    /// and bash VMs always boot) and its workspace fits the snapshot's disk. Its kind names
    /// the kernel's `environment`: python3 and python3-lean start the same command, each in
    /// its own venv.
    fn zygote_plan(
        &self,
        spec: &LaunchSpec,
        map: &Relocation,
        environment: Option<&str>,
        size: VmSize,
        has_connection: bool,
    ) -> Option<ZygotePlan> {
        self.snapshots.as_ref()?;
        let argv = map.argv(&spec.argv);
        let workspace = spec
            .limits
            .workspace_bytes
            .unwrap_or(DEFAULT_WORKSPACE_BYTES);
        let launcher = argv.len() >= 3 && argv[1] == "-m" && argv[2] == "cellgate_kernel_launcher";
        if !has_connection || !launcher || workspace > SNAPSHOT_DISK_BYTES {
            return None;
        }
        let zygote_env: std::collections::BTreeMap<String, String> = map
            .env(&spec.env)
            .into_iter()
            .filter(|(key, _)| fixed_at_zygote_start(key))
            .collect();
        let at_start: Vec<(String, String)> = zygote_env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Some(ZygotePlan {
            kind: snapshot::Kind {
                memory_mib: size.memory_mib,
                vcpus: size.vcpus,
                argv: argv[..3].to_vec(),
                env: at_start,
                environment: environment.map(str::to_owned),
            },
            zygote: Zygote {
                argv: argv[..3].to_vec(),
                env: zygote_env,
                cwd: relocate::WORKSPACE.to_owned(),
                uid: KERNEL_UID,
                gid: KERNEL_UID,
                environment: environment.map(str::to_owned),
            },
        })
    }

    /// `spec`'s kernel's VM, restored from where it hibernated (`hibernate.rs`). Afterwards
    /// what was saved is gone (the VM runs from it, or it cannot be restored: a fresh kernel
    /// is then the kernel layer's answer), or, after a failure before the guest ran, kept
    /// as it was for the next try.
    async fn restore_hibernated(
        &self,
        spec: &LaunchSpec,
        map: &Relocation,
        environment: Option<&str>,
        connection: Option<ConnectionFile>,
        size: VmSize,
    ) -> Result<Launched, MicrovmError> {
        let hibernations = self.hibernations.as_ref().ok_or_else(|| {
            MicrovmError::Start(
                "no hibernated VM to restore: this gateway has no state directory".to_owned(),
            )
        })?;
        let waking = hibernate::Waking::default();
        let restored = self
            .restore_from(
                hibernations,
                spec,
                (map, environment, connection),
                size,
                &waking,
            )
            .await;
        match &restored {
            Err(error) if waking.may_retry() => {
                match hibernate::hand_back(hibernations, &spec.kernel_id, &spec.runtime_dir) {
                    Ok(()) => {
                        tracing::warn!(kernel_id = %spec.kernel_id, %error, "microvm: the restore failed before the guest ran; what was saved is kept for the next try");
                    }
                    Err(lost) => {
                        tracing::error!(kernel_id = %spec.kernel_id, %error, %lost, "microvm: the restore failed and what was saved could not be put back");
                        hibernations.remove(&spec.kernel_id);
                    }
                }
            }
            _ => hibernations.remove(&spec.kernel_id),
        }
        if restored.is_err() {
            clear_runtime_dir(&spec.runtime_dir);
        }
        restored
    }

    async fn restore_from(
        &self,
        hibernations: &hibernate::Hibernations,
        spec: &LaunchSpec,
        (map, environment, connection): (&Relocation, Option<&str>, Option<ConnectionFile>),
        size: VmSize,
        waking: &hibernate::Waking,
    ) -> Result<Launched, MicrovmError> {
        let started = std::time::Instant::now();
        let (state, record) = hibernate::take_for_restore(
            hibernations,
            &spec.kernel_id,
            &spec.runtime_dir,
            size,
            &self.machine,
            waking,
        )?;
        if record.key != spec.connection.key {
            waking.refused();
            return Err(MicrovmError::Start(
                "the kernel's key is not the one its VM was saved with".to_owned(),
            ));
        }
        let disk = spec.runtime_dir.join(WORKSPACE_DISK);
        let disk_bytes = std::fs::metadata(&disk)
            .map_err(io_error(disk.display().to_string()))?
            .len();
        let key = record.key.as_bytes().to_vec();
        let booted = self
            .boot_jailed(
                spec,
                (map, environment, connection),
                size,
                (&disk, disk_bytes),
                Some(state),
                Some((&key, waking)),
            )
            .await;
        if booted.is_ok() {
            tracing::info!(kernel_id = %spec.kernel_id, seconds = started.elapsed().as_secs_f64(), "microvm: hibernated VM restored");
        }
        booted
    }

    /// [`Core::boot`] in a jail of its own for `spec`'s VM of `size` with its workspace
    /// `disk` (path, bytes); on failure, whatever of the VM is left goes with the jail's
    /// cgroup.
    async fn boot_jailed(
        &self,
        spec: &LaunchSpec,
        (map, environment, connection): (&Relocation, Option<&str>, Option<ConnectionFile>),
        size: VmSize,
        (disk, disk_bytes): (&Path, u64),
        snapshot: Option<std::fs::File>,
        hibernated: Option<(&[u8], &hibernate::Waking)>,
    ) -> Result<Launched, MicrovmError> {
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let jail = Arc::new(self.confiner.prepare(
            &crate::sandbox::cgroups::cgroup_name(&spec.kernel_id, &format!("vm-{}", &unique[..8])),
            &confine::host_limits(size.memory_mib + VMM_OVERHEAD_MIB, spec.limits.cpu_millis),
            &spec.runtime_dir,
            &[disk],
            confine::fsize(disk_bytes, size.memory_mib),
        )?);
        let booted = self
            .boot(
                spec,
                map,
                environment,
                connection,
                size,
                jail.clone(),
                snapshot,
                hibernated,
            )
            .await;
        if booted.is_err() {
            let _ = tokio::task::spawn_blocking(move || jail.release()).await;
        }
        booted
    }

    /// One try at `spec`'s VM: booted, or restored from `snapshot`.
    async fn attempt(
        &self,
        spec: &LaunchSpec,
        map: &Relocation,
        environment: Option<&str>,
        connection: Option<ConnectionFile>,
        size: VmSize,
        snapshot: Option<std::fs::File>,
    ) -> Result<Launched, MicrovmError> {
        let dir = &spec.runtime_dir;
        let disk = dir.join(WORKSPACE_DISK);
        let disk_bytes = image::make_workspace_disk(
            &disk,
            spec.limits
                .workspace_bytes
                .unwrap_or(DEFAULT_WORKSPACE_BYTES),
            KERNEL_UID,
        )
        .await?;
        self.boot_jailed(
            spec,
            (map, environment, connection),
            size,
            (&disk, disk_bytes),
            snapshot,
            None,
        )
        .await
    }

    /// The VM of `size` on `transport`'s `link`: booted, or (`restore`) loaded from the
    /// snapshot on the VMM's descriptor 3. `control`: give the VMM its control socket.
    fn vm_spec(
        &self,
        transport: &link::Transport,
        link: &link::Link,
        size: VmSize,
        control: bool,
        restore: bool,
    ) -> VmSpec {
        VmSpec {
            kernel: self.images.kernel.clone(),
            initramfs: self.images.initramfs.clone(),
            root: self.images.root.clone(),
            workspace: PathBuf::from(WORKSPACE_DISK),
            memory_mib: size.memory_mib,
            vcpus: size.vcpus,
            cmdline: [
                transport.cmdline().to_owned(),
                format!("cellgate.layer_mb={LAYER_MIB}"),
            ]
            .into_iter()
            .chain(self.host_cmdline.iter().cloned())
            .collect(),
            agent: link.vm_link(),
            console: PathBuf::from(CONSOLE),
            accel: self.accel,
            control: control.then(|| PathBuf::from(QMP_SOCKET)),
            incoming: restore,
        }
    }

    /// Starts the VMM (and the link's device backend) confined in `jail`, waits for the
    /// agent and starts the kernel. With `snapshot`, the VM is restored from it instead of
    /// booted (over virtio-serial: QEMU cannot save a VM with a vhost-user device). With
    /// `hibernated` too (the kernel's key), the snapshot is a hibernated VM whose kernel
    /// runs already: the gateway attaches to it instead of starting one. A VM whose policy
    /// asks for hibernation runs on virtio-serial and keeps its VMM's control socket. On
    /// failure, the processes it started are reaped.
    #[expect(
        clippy::too_many_arguments,
        reason = "one VM's inputs, each from a different step of launch_vm"
    )]
    async fn boot(
        &self,
        spec: &LaunchSpec,
        map: &Relocation,
        environment: Option<&str>,
        connection: Option<ConnectionFile>,
        size: VmSize,
        jail: Arc<confine::Jail>,
        snapshot: Option<std::fs::File>,
        hibernated: Option<(&[u8], &hibernate::Waking)>,
    ) -> Result<Launched, MicrovmError> {
        let dir = &spec.runtime_dir;
        let restore = snapshot.is_some();
        let saver = self
            .hibernations
            .clone()
            .filter(|_| spec.backend_settings.hibernate)
            .map(|hibernations| hibernate::Saver {
                hibernations,
                runtime_dir: dir.clone(),
                size,
                machine: self.machine.clone(),
            });
        // A VM that outlives the gateway is reached again over virtio-serial: QEMU listens
        // on a socket in the VM's directory, which the next gateway connects to (a vsock
        // device's backend would be one more process to keep).
        let kept = self.config.survival.as_ref();
        let transport = if restore || saver.is_some() || kept.is_some() {
            link::Transport::Serial
        } else {
            self.transport.clone()
        };
        let console = create_console(dir, jail.uid())?;
        let mut link =
            link::Link::prepare(&transport, dir, &self.spawner, &spec.log_file, &jail).await?;
        let vm = self.vm_spec(&transport, &link, size, restore || saver.is_some(), restore);
        let mut command = self.vmm.command(&vm);
        plain_child(&mut command, dir, &spec.log_file)?;
        if kept.is_some() {
            // Nothing of the gateway's end (its exit, its runtime's drop, a signal to its
            // process group) ends the VMM: its keeper does, or the gateway on purpose. A
            // launch abandoned midway still loses its VM with the jail's cgroup.
            command.kill_on_drop(false).process_group(0);
        }
        jail.apply(&mut command);
        if let Some(file) = snapshot {
            confine::Jail::pass_snapshot(&mut command, file);
        }
        let child = self
            .spawner
            .spawn_with(command, kept.is_none(), None)
            .await
            .map_err(|e| MicrovmError::Start(format!("{}: {e}", self.vmm.name())));
        let mut companion = link.companion.take();
        let mut child = match child {
            Ok(child) => child,
            Err(error) => {
                if let Some(companion) = &mut companion {
                    let _ = companion.kill().await;
                }
                return Err(error);
            }
        };
        let pid = child.id().unwrap_or(0);
        tracing::info!(kernel_id = %spec.kernel_id, pid, accel = self.accel.as_str(),
            memory_mib = size.memory_mib, vcpus = size.vcpus, vmm_uid = ?jail.uid(),
            from = match (hibernated, restore) {
                (Some(_), _) => "hibernation",
                (None, true) => "snapshot",
                (None, false) => "boot",
            },
            "microvm: VM started");
        let keeps_control = saver.is_some();
        let kept = match kept {
            Some(survival) => match self.keep(spec, survival, pid, &jail, size).await {
                Ok(kept) => Some(kept),
                Err(error) => {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                    if let Some(companion) = &mut companion {
                        let _ = companion.kill().await;
                    }
                    return Err(error);
                }
            },
            None => None,
        };
        let handle = Arc::new(MicrovmHandle::new(pid, jail.clone(), saver, None, kept));

        let started = async {
            if restore {
                let mut qmp =
                    qmp::Qmp::connect(&dir.join(QMP_SOCKET), self.config.boot_timeout).await?;
                let ran = || {
                    if let Some((_, waking)) = hibernated {
                        waking.ran();
                    }
                };
                qmp::resume(&mut qmp, self.config.boot_timeout, ran).await?;
                drop(qmp);
                if !keeps_control {
                    // Nothing else is asked of the VMM: no control socket for the VM's life.
                    let _ = std::fs::remove_file(dir.join(QMP_SOCKET));
                }
            }
            let io = link.connect(self.config.boot_timeout).await?;
            let agent =
                agent::Agent::connect(io, spec.egress_socket.clone(), self.config.boot_timeout)
                    .await?;
            if let Some((key, _)) = hibernated {
                // The kernel runs already: prove its key (and have the guest prove it).
                agent.attach(key).await?;
                agent.request(restored_op()).await?;
                return Ok(Arc::new(agent));
            }
            if restore {
                agent.request(restored_op()).await?;
            }
            let environment = environment.map(str::to_owned);
            agent::start_kernel(&agent, spec, map, connection, KERNEL_UID, environment).await?;
            Ok(Arc::new(agent))
        };
        let agent = tokio::select! {
            agent = started => agent,
            // A VMM that dies while booting says why in its log and on the console.
            status = child.wait() => Err(MicrovmError::Start(format!(
                "the VMM ended while booting ({}): {}",
                status.map_or_else(|e| e.to_string(), |s| s.to_string()),
                handle::last_words(&spec.log_file, &console),
            ))),
        };
        let served = agent.and_then(|agent| {
            handle.attach(agent.clone());
            channels::serve(&spec.connection, agent.clone())
                .map_err(io_error("listening on the kernel's channels"))?;
            Ok(agent)
        });
        let agent = match served {
            Ok(agent) => agent,
            Err(error) => {
                if let Some((_, waking)) = hibernated.filter(|(_, w)| w.may_retry()) {
                    // A VMM that ends by itself (an exit code, not a signal) before the
                    // guest ran refused the saved state (damaged, or not its own): trying
                    // again would not help, unless what it lacked was the host's memory. A
                    // moment for it to end, when its end is what failed the boot.
                    let ended = tokio::time::timeout(Duration::from_millis(500), child.wait());
                    if let Ok(Ok(status)) = ended.await {
                        let words = handle::last_words(&spec.log_file, &console);
                        if status.code().is_some() && !lacked_memory(&words) {
                            waking.refused();
                        }
                    }
                }
                handle.kill_vmm(false);
                let _ = child.wait().await;
                if let Some(kept) = handle.kept() {
                    kept.forget();
                }
                if let Some(companion) = &mut companion {
                    let _ = companion.kill().await;
                }
                return Err(match error {
                    MicrovmError::Agent(message) => MicrovmError::Agent(format!(
                        "{message} ({})",
                        handle::last_words(&spec.log_file, &console)
                    )),
                    other => other,
                });
            }
        };
        if let (Some(survival), Some(kept)) = (&self.config.survival, handle.kept()) {
            self.record(spec, survival, kept, pid, &jail, size);
        }
        let (exit_tx, exit_rx) = watch::channel(None);
        handle::watch_exit(
            handle::VmmProcess::Child(child),
            companion,
            agent,
            handle.clone(),
            spec.log_file.clone(),
            console,
            exit_tx,
        );
        Ok(Launched {
            handle,
            exit: exit_rx,
            connection: spec.connection.clone(),
        })
    }
}

impl Core {
    /// Makes the snapshot of `plan`'s zygote: boots a VM of its kind, has the agent prepare
    /// the zygote, closes the link and saves the VM's state; the snapshot's path.
    async fn make_snapshot(&self, plan: &ZygotePlan) -> Result<PathBuf, MicrovmError> {
        let snapshots = self
            .snapshots
            .as_ref()
            .ok_or_else(|| MicrovmError::Start("snapshots are off".to_owned()))?;
        let started = std::time::Instant::now();
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let dir = snapshots.dir().join(format!("build-{}", &unique[..12]));
        std::fs::create_dir(&dir).map_err(io_error(dir.display().to_string()))?;
        let target = snapshots.path(&plan.kind);
        let partial = target.with_extension(format!("vmstate.partial-{}", &unique[..12]));
        let made = self.save_zygote(plan, &dir, &partial, &unique).await;
        let made = made.and_then(|()| {
            std::fs::rename(&partial, &target).map_err(io_error(target.display().to_string()))
        });
        let _ = std::fs::remove_file(&partial);
        let _ = std::fs::remove_dir_all(&dir);
        made?;
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            "microvm: zygote saved"
        );
        Ok(target)
    }

    async fn save_zygote(
        &self,
        plan: &ZygotePlan,
        dir: &Path,
        partial: &Path,
        unique: &str,
    ) -> Result<(), MicrovmError> {
        use std::os::unix::fs::OpenOptionsExt;
        let size = VmSize {
            memory_mib: plan.kind.memory_mib,
            vcpus: plan.kind.vcpus,
        };
        let log = dir.join("vm.log");
        let disk = dir.join(WORKSPACE_DISK);
        std::fs::File::create(&disk)
            .and_then(|f| f.set_len(SNAPSHOT_DISK_BYTES))
            .map_err(io_error(disk.display().to_string()))?;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(partial)
            .map_err(io_error(partial.display().to_string()))?;
        let jail = Arc::new(self.confiner.prepare(
            &crate::sandbox::cgroups::cgroup_name("snapshot", &format!("zygote-{}", &unique[..8])),
            &confine::host_limits(size.memory_mib + VMM_OVERHEAD_MIB, None),
            dir,
            &[&disk],
            confine::fsize(SNAPSHOT_DISK_BYTES, size.memory_mib),
        )?);
        // Live sessions come first: a zygote under emulation is tens of CPU-seconds, which
        // would otherwise halve the CPU of a session's VM on a two-core host.
        jail.background();
        let saved = self.run_zygote(plan, dir, &log, size, &jail, file).await;
        let released = jail.clone();
        let _ = tokio::task::spawn_blocking(move || released.release()).await;
        saved.map_err(|error| match error {
            MicrovmError::Agent(message) | MicrovmError::Start(message) => {
                MicrovmError::Start(format!("{message} ({})", read_tail(&log)))
            }
            other => other,
        })
    }

    async fn run_zygote(
        &self,
        plan: &ZygotePlan,
        dir: &Path,
        log: &Path,
        size: VmSize,
        jail: &confine::Jail,
        snapshot: std::fs::File,
    ) -> Result<(), MicrovmError> {
        let transport = link::Transport::Serial;
        let _console = create_console(dir, jail.uid())?;
        let link = link::Link::prepare(&transport, dir, &self.spawner, log, jail).await?;
        let vm = self.vm_spec(&transport, &link, size, true, false);
        let mut command = self.vmm.command(&vm);
        plain_child(&mut command, dir, log)?;
        jail.apply(&mut command);
        let mut child = self
            .spawner
            .spawn(command)
            .await
            .map_err(|e| MicrovmError::Start(format!("{}: {e}", self.vmm.name())))?;
        let work = async {
            let io = link.connect(self.config.boot_timeout).await?;
            let agent = agent::Agent::connect(io, None, self.config.boot_timeout).await?;
            match agent
                .request_within(Op::Zygote(plan.zygote.clone()), ZYGOTE_TIMEOUT)
                .await?
            {
                Reply::Started { .. } => {}
                other => return Err(MicrovmError::Agent(format!("unexpected reply {other:?}"))),
            }
            agent.close();
            tokio::time::sleep(SETTLE).await;
            let mut qmp = qmp::Qmp::connect(&dir.join(QMP_SOCKET), Duration::from_secs(10)).await?;
            qmp::save(&mut qmp, &snapshot, SAVE_TIMEOUT).await?;
            let _ = qmp.execute("quit", serde_json::json!({})).await;
            Ok(())
        };
        let result = tokio::select! {
            result = work => result,
            status = child.wait() => Err(MicrovmError::Start(format!(
                "the zygote's VMM ended ({})",
                status.map_or_else(|e| e.to_string(), |s| s.to_string())
            ))),
        };
        let _ = child.start_kill();
        let _ = child.wait().await;
        result
    }
}

/// The first request to a restored VM: fresh randomness from the host, and the time.
fn restored_op() -> Op {
    let seed: [u8; 32] = rand::random();
    let unix_time_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    Op::Restored {
        seed: hex::encode(seed),
        unix_time_ns,
    }
}

/// Removes what a failed attempt left in a VM's runtime directory (console, link and
/// control sockets, workspace disk) so that another attempt starts clean; the kernel's own
/// files (log, connection file) stay.
fn clear_runtime_dir(dir: &Path) {
    for name in [
        CONSOLE,
        WORKSPACE_DISK,
        QMP_SOCKET,
        link::SERIAL_SOCKET,
        link::VHOST_SOCKET,
    ] {
        let _ = std::fs::remove_file(dir.join(name));
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(link::VSOCK_SOCKET)
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// The end of a file, lossily, for an error message.
fn read_tail(path: &Path) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let from = text.len().saturating_sub(2048);
    String::from_utf8_lossy(&text[from..]).trim().to_owned()
}

/// The workspace disk's and the console's names in the VM's runtime directory (the VMM's
/// working directory, where it is given relative paths: see `confine`).
const WORKSPACE_DISK: &str = "workspace.ext4";
const CONSOLE: &str = "console.log";

/// Creates the console's file for the VMM (its uid's, where it has one) and keeps the
/// gateway's own handle on it: the gateway reads the guest's last words through that
/// handle, never through the path, which the VMM can replace (with a link to a host file).
fn create_console(dir: &Path, vmm_uid: Option<u32>) -> Result<std::fs::File, MicrovmError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(CONSOLE);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(io_error(path.display().to_string()))?;
    if let Some(uid) = vmm_uid {
        std::os::unix::fs::fchown(&file, Some(uid), Some(uid))
            .map_err(io_error(path.display().to_string()))?;
    }
    Ok(file)
}

/// The VM's RAM and vCPUs for a policy's limits.
#[derive(Debug, Clone, Copy)]
struct VmSize {
    memory_mib: u64,
    vcpus: u32,
}

impl VmSize {
    fn of(limits: &crate::sandbox::Limits) -> VmSize {
        VmSize {
            memory_mib: limits.memory_bytes.map_or(DEFAULT_MEMORY_MIB, |bytes| {
                bytes.div_ceil(1 << 20) + GUEST_OVERHEAD_MIB
            }),
            vcpus: limits
                .cpu_millis
                .map_or(1, |millis| millis.div_ceil(1000).max(1)),
        }
    }
}

/// The transport when the configuration names none: hybrid vsock where its device backend
/// is installed, virtio-serial otherwise.
fn default_transport(guest_dir: &Path) -> link::Transport {
    let installed = guest_dir.join("tools/bin/vhost-device-vsock");
    let backend = if installed.is_file() {
        Some(installed)
    } else {
        super::diagnosis::find_on_path("vhost-device-vsock")
    };
    match backend {
        Some(backend) => link::Transport::Vsock { backend },
        None => link::Transport::Serial,
    }
}

/// `program`'s absolute path, without symlinks: a bare name is looked up on `PATH`.
fn absolute_program(program: &Path) -> Result<PathBuf, SandboxError> {
    let found = if program.components().count() == 1 {
        super::diagnosis::find_on_path(&program.to_string_lossy())
            .unwrap_or_else(|| program.to_owned())
    } else {
        program.to_owned()
    };
    std::fs::canonicalize(&found)
        .map_err(|e| SandboxError::Setup(format!("microvm: {}: {e}", program.display())))
}

/// Whether a VMM's last words say it ended for want of the host's memory (a passing
/// condition, unlike a state it could not load).
fn lacked_memory(words: &str) -> bool {
    words.contains("Cannot allocate memory") || words.contains("Resource temporarily unavailable")
}

/// Makes `command` a plain child of the backend: nothing of the gateway's environment, no
/// stdin, output to the kernel's log, working directory `dir`, killed when its handle is
/// dropped: the exit watch holds it until it is reaped, so only a launch abandoned midway
/// (its request's future dropped) drops it early, and must not leave a VM behind.
fn plain_child(
    command: &mut tokio::process::Command,
    dir: &Path,
    log_file: &Path,
) -> Result<(), MicrovmError> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_file)
        .map_err(io_error(format!("{}", log_file.display())))?;
    let log_err = log.try_clone().map_err(io_error("the kernel log"))?;
    command
        .env_clear()
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .kill_on_drop(true);
    Ok(())
}

/// A plain child command of `program` (see [`plain_child`]).
fn spawner_command(
    program: &Path,
    dir: &Path,
    log_file: &Path,
) -> Result<tokio::process::Command, MicrovmError> {
    let mut command = tokio::process::Command::new(program);
    plain_child(&mut command, dir, log_file)?;
    Ok(command)
}

impl From<MicrovmError> for SandboxError {
    fn from(error: MicrovmError) -> SandboxError {
        SandboxError::Microvm(error)
    }
}
