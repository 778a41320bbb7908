//! The QEMU driver: the `microvm` machine (no PCI, no firmware, virtio over MMIO), booted
//! straight into the guest kernel through its PVH entry.
//!
//! QEMU confines itself as well, on top of what the backend does to it (`confine.rs`):
//! `-sandbox on` installs its own seccomp filter, which here also refuses `spawn` (no helper
//! programs), privilege changes and resource-control calls.

use std::path::PathBuf;

use super::vmm::{Accel, AgentLink, VmSpec, Vmm};

/// The translated-code cache under emulation, in MiB. QEMU's default is up to 1 GiB per VM
/// (an eighth of the host's RAM): a fixed size keeps a VM's host memory predictable, and
/// what does not fit is translated again.
pub const TCG_CACHE_MIB: u64 = 128;

/// The CPU a VM gets under emulation: a named model whose every feature QEMU's emulator
/// has run correctly for years, not `max`.
///
/// `max` under TCG advertises everything the emulator implements, and QEMU 7.2 (Debian
/// bookworm's) is the first release that implements AVX2, gathers included. Its decoder
/// reads a gather's vector index register 4 (`vpgatherqq (%rax,%ymm4,8)`) as "no index", as
/// for an ordinary SIB byte, so every lane loads the same element (QEMU issue 2474, fixed by
/// "target/i386: Fix VSIB decode" in 9.1, 9.0.3 and 8.2.7, never in 7.2). numpy 2.4
/// dispatches to its x86-64-v3 kernels (AVX2, FMA, BMI) when the CPU has them, and its AVX2
/// argsort (x86-simd-sort) gathers through ymm4: `np.argsort` of 64 or more numbers is
/// silently wrong, and pandas, indexing with it (`pivot_table`, `groupby` on unsorted keys),
/// reads out of bounds and dies of SIGSEGV. Nehalem is x86-64-v2 exactly (SSE4.2, POPCNT,
/// CMPXCHG16B, LAHF), the baseline numpy 2.4 requires, with no AVX: numpy, pandas and
/// OpenBLAS pick their SSE kernels, and no gather exists to mis-decode.
///
/// Under KVM the VM gets `-cpu host`: the host CPU runs every instruction itself, so what it
/// advertises is what it executes, AVX-512 included.
pub const TCG_CPU: &str = "Nehalem";

/// The VMM's descriptor of the snapshot it restores from (`-incoming fd:3`).
pub const SNAPSHOT_FD: i32 = 3;

/// The QEMU driver.
pub struct Qemu {
    pub binary: PathBuf,
}

impl Vmm for Qemu {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn command(&self, vm: &VmSpec) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.binary);
        command.args(args(vm));
        command
    }
}

/// QEMU's arguments for `vm`.
pub fn args(vm: &VmSpec) -> Vec<String> {
    let mut cmdline = vec![
        "console=ttyS0".to_owned(),
        // A guest kernel that panics stops the VM at once (with -no-reboot, QEMU exits).
        "panic=-1".to_owned(),
        "quiet".to_owned(),
    ];
    cmdline.extend(vm.cmdline.iter().cloned());
    let mut memory_backend = String::new();
    let mut args: Vec<String> = vec![
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-accel".into(),
        match vm.accel {
            Accel::Kvm => "kvm".into(),
            Accel::Tcg => format!("tcg,tb-size={TCG_CACHE_MIB}"),
        },
        "-cpu".into(),
        match vm.accel {
            Accel::Kvm => "host".into(),
            Accel::Tcg => TCG_CPU.into(),
        },
        "-m".into(),
        format!("{}M", vm.memory_mib),
        "-smp".into(),
        vm.vcpus.to_string(),
        "-serial".into(),
        format!("file:{}", vm.console.display()),
        "-kernel".into(),
        vm.kernel.display().to_string(),
        "-initrd".into(),
        vm.initramfs.display().to_string(),
        "-append".into(),
        cmdline.join(" "),
        "-drive".into(),
        format!(
            "id=root,file={},format=raw,if=none,readonly=on",
            vm.root.display()
        ),
        "-device".into(),
        "virtio-blk-device,drive=root".into(),
        "-drive".into(),
        format!(
            "id=work,file={},format=raw,if=none,discard=unmap",
            vm.workspace.display()
        ),
        "-device".into(),
        "virtio-blk-device,drive=work".into(),
        "-device".into(),
        "virtio-rng-device".into(),
        // Memory the guest frees goes back to the host: an idle VM shrinks.
        "-device".into(),
        "virtio-balloon-device,free-page-reporting=on".into(),
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
    ];
    if let Some(control) = &vm.control {
        args.extend([
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", control.display()),
        ]);
    }
    if vm.incoming {
        // A descriptor, not a path: the VMM needs no right to the snapshot's file, and
        // cannot change it.
        args.extend(["-incoming".into(), format!("fd:{SNAPSHOT_FD}")]);
    }
    match &vm.agent {
        AgentLink::Serial { socket } => {
            args.extend([
                "-device".into(),
                "virtio-serial-device".into(),
                "-chardev".into(),
                format!(
                    "socket,id=agent,path={},server=on,wait=off",
                    socket.display()
                ),
                "-device".into(),
                format!(
                    "virtserialport,chardev=agent,name={}",
                    cellgate_agent::protocol::SERIAL_PORT_NAME
                ),
            ]);
        }
        AgentLink::Vsock { vhost } => {
            // vhost-user devices need the guest's RAM shared with their backend process.
            memory_backend = format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                vm.memory_mib
            );
            args.extend([
                "-chardev".into(),
                format!("socket,id=vsock,path={}", vhost.display()),
                "-device".into(),
                "vhost-user-vsock-device,chardev=vsock".into(),
            ]);
        }
    }
    let machine = if memory_backend.is_empty() {
        "microvm,x-option-roms=off".to_owned()
    } else {
        args.extend(["-object".into(), memory_backend]);
        "microvm,x-option-roms=off,memory-backend=mem".to_owned()
    };
    let mut all = vec!["-M".to_owned(), machine];
    all.extend(args);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(agent: AgentLink) -> VmSpec {
        VmSpec {
            kernel: "/g/vmlinux".into(),
            initramfs: "/g/initramfs".into(),
            root: "/g/root.ext4".into(),
            workspace: "/k/work.ext4".into(),
            memory_mib: 640,
            vcpus: 1,
            cmdline: vec!["cellgate.transport=serial".into()],
            agent,
            console: "/k/console.log".into(),
            accel: Accel::Tcg,
            control: None,
            incoming: false,
        }
    }

    #[test]
    fn the_root_is_read_only_and_the_guest_has_no_network() {
        let args = args(&spec(AgentLink::Serial {
            socket: "/k/agent.sock".into(),
        }));
        let line = args.join(" ");
        assert!(
            line.contains("file=/g/root.ext4,format=raw,if=none,readonly=on"),
            "{line}"
        );
        assert!(line.contains("-nodefaults"), "{line}");
        assert!(
            !line.contains("-netdev") && !line.contains("-nic"),
            "{line}"
        );
        assert!(line.contains("spawn=deny"), "{line}");
        assert!(line.contains("name=org.cellgate.agent"), "{line}");
        assert!(line.contains("cellgate.transport=serial"), "{line}");
        assert!(!line.contains("memory-backend"), "{line}");
        assert!(
            !line.contains("-incoming") && !line.contains("-qmp"),
            "{line}"
        );
    }

    #[test]
    fn a_restore_reads_the_snapshot_from_a_descriptor() {
        let mut vm = spec(AgentLink::Serial {
            socket: "agent.sock".into(),
        });
        vm.control = Some("qmp.sock".into());
        vm.incoming = true;
        let line = args(&vm).join(" ");
        assert!(line.contains("-incoming fd:3"), "{line}");
        assert!(
            line.contains("-qmp unix:qmp.sock,server=on,wait=off"),
            "{line}"
        );
    }

    #[test]
    fn vsock_shares_guest_memory_with_its_backend() {
        let args = args(&spec(AgentLink::Vsock {
            vhost: "/k/vhost.sock".into(),
        }));
        let line = args.join(" ");
        assert!(line.contains("memory-backend=mem"), "{line}");
        assert!(
            line.contains("memory-backend-memfd,id=mem,size=640M,share=on"),
            "{line}"
        );
        assert!(
            line.contains("vhost-user-vsock-device,chardev=vsock"),
            "{line}"
        );
    }
}
