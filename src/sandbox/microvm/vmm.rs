//! What a virtual machine monitor must do for this backend, and nothing else: turn a
//! [`VmSpec`] into the command that runs the VM. QEMU's `microvm` machine is the one driver
//! today (`qemu.rs`); Firecracker or Cloud Hypervisor would be another implementation
//! of [`Vmm`], with the rest of the backend (agent, transports, images, limits) unchanged.

use std::path::PathBuf;

/// How the VM's CPU is provided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualization through `/dev/kvm`.
    Kvm,
    /// QEMU's software emulation: works anywhere, ~50x slower for Python.
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The byte stream between the gateway and the guest agent, as the VMM must provide it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentLink {
    /// A virtio-serial port whose host end is a unix socket the VMM listens on.
    Serial { socket: PathBuf },
    /// A vhost-user vsock device whose backend (vhost-device-vsock) listens on `vhost`;
    /// the gateway reaches the guest through the backend's hybrid-vsock socket.
    Vsock { vhost: PathBuf },
}

/// One VM, as every driver understands it.
#[derive(Debug, Clone)]
pub struct VmSpec {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// The shared root image, attached read-only.
    pub root: PathBuf,
    /// The VM's private workspace disk, attached read-write.
    pub workspace: PathBuf,
    pub memory_mib: u64,
    pub vcpus: u32,
    /// Words appended to the guest kernel's command line (`cellgate.*` settings).
    pub cmdline: Vec<String>,
    pub agent: AgentLink,
    /// Where the guest's serial console goes: the gateway reads why a guest died there.
    pub console: PathBuf,
    pub accel: Accel,
    /// Where the VMM's control socket goes (QEMU's QMP), for saving and restoring the VM.
    pub control: Option<PathBuf>,
    /// Whether the VM's state comes from a snapshot on the VMM's descriptor 3 rather than
    /// from a boot; the VM then waits, paused, to be resumed.
    pub incoming: bool,
}

/// A virtual machine monitor driver.
pub trait Vmm: Send + Sync {
    fn name(&self) -> &'static str;
    /// The command that runs `vm` until the guest powers off (then the command exits).
    fn command(&self, vm: &VmSpec) -> tokio::process::Command;
}
