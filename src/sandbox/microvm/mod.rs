//! The `microvm` backend: every kernel in a virtual machine of its own, with its own guest
//! Linux kernel, reached only through the guest agent.
//!
//! # Design
//!
//! **One VM per kernel.** The VMM ([`vmm::Vmm`]; QEMU's `microvm` machine today, see
//! `qemu`) boots the project's guest kernel (`guest/kernel.config`) straight into an
//! initramfs that holds only the agent (`guest/agent`). The agent mounts the shared
//! read-only root image (Debian's Python and the kernel's venv, `guest/build-image.py`)
//! under a tmpfs overlay the size of the writable layer, and waits for the gateway.
//!
//! **No network.** The guest has no network device at all. Everything crosses one byte
//! stream, the agent link ([`vmm::AgentLink`]: hybrid vsock through vhost-device-vsock by
//! default, or virtio-serial; see [`link`]), carrying a yamux session (`agent`): a control stream for
//! start/signal/usage/exit, one stream per ZMQ connection of the kernel's five channels,
//! and one per TCP connection the kernel makes to its proxy port, joined here to the
//! gateway's egress proxy, so egress and package policies hold unchanged.
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
//! **Host detection** ([`accel`]): real VMX/SVM means KVM; a PVM-only host (this project's
//! CI machines) or none means QEMU's emulation (TCG), which works but is ~50x slower for
//! Python and is refused unless emulation is allowed.
//!
//! Must not depend on: kernels' channels, sessions, HTTP.

pub mod accel;
mod agent;
mod channels;
mod confine;
pub mod diagnose;
mod files;
mod handle;
pub mod image;
pub mod link;
mod qemu;
pub mod vmm;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cellgate_agent::protocol::{ConnectionFile, Op, Reply, Start};
use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::relocate::{self, Relocation};
use super::spawner::Spawner;
use super::{Backend, LaunchSpec, Launched, Sandbox, SandboxError};
pub use confine::IDENTITY_BASE as VMM_IDENTITY_BASE;
use handle::MicrovmHandle;
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
    #[error("confining the VMM: {0}")]
    Confine(#[from] confine::ConfineError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
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
}

impl Default for MicrovmConfig {
    fn default() -> MicrovmConfig {
        MicrovmConfig {
            qemu: PathBuf::from("qemu-system-x86_64"),
            guest_dir: image::default_dir(),
            allow_emulation: false,
            boot_timeout: Duration::from_secs(120),
            transport: None,
        }
    }
}

/// Starts kernels in microVMs.
pub struct MicrovmSandbox {
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
}

impl MicrovmSandbox {
    /// Finds the guest images and decides how VMs get their CPU. Must be called from within
    /// a tokio runtime (the spawner thread registers children with it).
    pub fn new(config: MicrovmConfig) -> Result<MicrovmSandbox, SandboxError> {
        let images = image::GuestImages::locate(&config.guest_dir)?;
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
        let transport = config
            .transport
            .clone()
            .unwrap_or_else(|| default_transport(&config.guest_dir));
        tracing::info!(
            accel = accel.as_str(),
            transport = transport.name(),
            "microvm backend ready"
        );
        let spawner = Spawner::start("cellgate-microvm-spawner")?;
        let confiner = confine::Confiner::new(accel == Accel::Kvm);
        Ok(MicrovmSandbox {
            confiner,
            emulation_refused,
            transport,
            host_cmdline,
            vmm: Arc::new(qemu::Qemu {
                binary: config.qemu.clone(),
            }),
            config,
            images,
            accel,
            spawner,
        })
    }

    /// How this backend's VMs get their CPU.
    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// How this backend's VMs talk to the gateway.
    pub fn transport(&self) -> &link::Transport {
        &self.transport
    }
}

impl Sandbox for MicrovmSandbox {
    fn backend(&self) -> Backend {
        Backend::Microvm
    }

    fn launch<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<Launched, SandboxError>> {
        Box::pin(async move { Ok(self.launch_vm(spec).await?) })
    }
}

impl MicrovmSandbox {
    async fn launch_vm(&self, spec: &LaunchSpec) -> Result<Launched, MicrovmError> {
        if let Some(refused) = self
            .emulation_refused
            .as_ref()
            .filter(|_| !spec.allow_emulation)
        {
            return Err(MicrovmError::Accel(refused.clone()));
        }
        let map = relocation(spec);
        let connection = guest_connection(spec, &map)?;
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
        let size = VmSize::of(&spec.limits);
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let jail = Arc::new(self.confiner.prepare(
            &crate::sandbox::cgroups::cgroup_name(&spec.kernel_id, &format!("vm-{}", &unique[..8])),
            &confine::host_limits(size.memory_mib + VMM_OVERHEAD_MIB, spec.limits.cpu_millis),
            dir,
            &[&disk],
            confine::fsize(disk_bytes, size.memory_mib),
        )?);
        let booted = self.boot(spec, &map, connection, size, jail.clone()).await;
        if booted.is_err() {
            // Whatever of the VM is left goes with its cgroup.
            let _ = tokio::task::spawn_blocking(move || jail.release()).await;
        }
        booted
    }

    /// Starts the VMM (and the link's device backend) confined in `jail`, waits for the
    /// agent and starts the kernel. On failure, the processes it started are reaped.
    async fn boot(
        &self,
        spec: &LaunchSpec,
        map: &Relocation,
        connection: Option<ConnectionFile>,
        size: VmSize,
        jail: Arc<confine::Jail>,
    ) -> Result<Launched, MicrovmError> {
        let dir = &spec.runtime_dir;
        let console = create_console(dir, jail.uid())?;
        let mut link =
            link::Link::prepare(&self.transport, dir, &self.spawner, &spec.log_file, &jail).await?;
        let vm = VmSpec {
            kernel: self.images.kernel.clone(),
            initramfs: self.images.initramfs.clone(),
            root: self.images.root.clone(),
            workspace: PathBuf::from(WORKSPACE_DISK),
            memory_mib: size.memory_mib,
            vcpus: size.vcpus,
            cmdline: [
                self.transport.cmdline().to_owned(),
                format!("cellgate.layer_mb={LAYER_MIB}"),
            ]
            .into_iter()
            .chain(self.host_cmdline.iter().cloned())
            .collect(),
            agent: link.vm_link(),
            console: PathBuf::from(CONSOLE),
            accel: self.accel,
        };
        let mut command = self.vmm.command(&vm);
        plain_child(&mut command, dir, &spec.log_file)?;
        jail.apply(&mut command);
        let child = self
            .spawner
            .spawn(command)
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
            "microvm: VM started");
        let handle = Arc::new(MicrovmHandle::new(pid, jail.clone()));

        let started = async {
            let io = link.connect(self.config.boot_timeout).await?;
            let agent =
                agent::Agent::connect(io, spec.egress_socket.clone(), self.config.boot_timeout)
                    .await?;
            start_kernel(&agent, spec, map, connection).await?;
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
                handle.kill_vmm(false);
                let _ = child.wait().await;
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
        let (exit_tx, exit_rx) = watch::channel(None);
        handle::watch_exit(
            child,
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

/// Asks the agent to start the kernel.
async fn start_kernel(
    agent: &agent::Agent,
    spec: &LaunchSpec,
    map: &Relocation,
    connection: Option<ConnectionFile>,
) -> Result<(), MicrovmError> {
    let start = Start {
        argv: map.argv(&spec.argv),
        env: map.env(&spec.env),
        cwd: relocate::WORKSPACE.to_owned(),
        connection,
        uid: KERNEL_UID,
        gid: KERNEL_UID,
        pids: spec.limits.pids,
        memory_bytes: spec.limits.memory_bytes,
    };
    match agent.request(Op::Start(start)).await? {
        Reply::Started { .. } => Ok(()),
        other => Err(MicrovmError::Agent(format!("unexpected reply {other:?}"))),
    }
}

/// The kernel's paths in the guest: the same fixed paths as in every sandbox, with the
/// venv where the root image has it.
fn relocation(spec: &LaunchSpec) -> Relocation {
    let mut map = Relocation::new();
    map.add(&spec.workspace, relocate::WORKSPACE);
    map.add(&spec.runtime_dir, relocate::RUN_DIR);
    let program = Path::new(spec.argv.first().map(String::as_str).unwrap_or_default());
    if let Some(venv) = program
        .parent()
        .and_then(Path::parent)
        .filter(|venv| venv.join("pyvenv.cfg").is_file())
    {
        map.add(venv, relocate::VENV);
    }
    map
}

/// The kernel's connection file as the guest must have it (its ipc paths under
/// [`relocate::RUN_DIR`]); `None` when the command has none (a plain program).
fn guest_connection(
    spec: &LaunchSpec,
    map: &Relocation,
) -> Result<Option<ConnectionFile>, MicrovmError> {
    let json = match std::fs::read(&spec.connection_file) {
        Ok(json) => json,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(spec.connection_file.display().to_string())(e)),
    };
    let bad = |e: serde_json::Error| MicrovmError::Start(format!("the connection file: {e}"));
    let info = serde_json::from_slice(&map.connection_json(&json).map_err(bad)?).map_err(bad)?;
    Ok(Some(ConnectionFile {
        path: map.path(&spec.connection_file).display().to_string(),
        info,
    }))
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
