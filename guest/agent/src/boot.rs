//! The guest's init duties: its settings from the kernel command line, its file system, its
//! loopback interface, and powering off.
//!
//! The file system the kernel sees is an overlay: the shared read-only root image
//! (`/dev/vda`, ext4, the kernel's Python environment) below, a tmpfs above whose size the
//! command line gives (`cellgate.layer_mb`), so every write outside the workspace lands in the
//! VM's own RAM and is gone with it. The agent builds it under `/newroot` in its initramfs and
//! then moves it to `/` (what `switch_root` does), so agent and kernel share one root and the
//! agent's tools need no second copy. The workspace disk is mounted later, at the kernel's
//! start: a zygote VM that is snapshotted for the warm pool has none yet.

use std::io;
use std::path::Path;

use rustix::mount::{mount, mount_move, MountFlags};

use crate::transport;
use crate::Settings;

/// The writable layer's size when the command line gives none.
const DEFAULT_LAYER_MB: u64 = 256;

/// Reads `cellgate.*` settings from `/proc/cmdline` (mounted first: pid 1 starts with none).
pub fn settings_from_cmdline() -> Result<Settings, String> {
    let _ = std::fs::create_dir_all("/proc");
    // EBUSY: already mounted (a second call); anything else shows when the read fails.
    let _ = mount("proc", "/proc", "proc", MountFlags::empty(), None);
    let cmdline =
        std::fs::read_to_string("/proc/cmdline").map_err(|e| format!("/proc/cmdline: {e}"))?;
    let transport = match cmdline_value(&cmdline, "cellgate.transport") {
        Some("vsock") | None => transport::Kind::Vsock,
        Some("serial") => transport::Kind::Serial,
        Some(other) => return Err(format!("unknown cellgate.transport={other}")),
    };
    Ok(Settings {
        transport,
        init: true,
        pod: false,
    })
}

/// The value of `key=` in a kernel command line.
pub fn cmdline_value<'a>(cmdline: &'a str, key: &str) -> Option<&'a str> {
    cmdline
        .split_ascii_whitespace()
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
}

/// Builds the guest's root file system and moves into it.
pub fn boot() -> io::Result<()> {
    let cmdline = std::fs::read_to_string("/proc/cmdline")?;
    let layer_mb = cmdline_value(&cmdline, "cellgate.layer_mb")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(DEFAULT_LAYER_MB);
    let quiet = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    mount_at("sysfs", "/sys", "sysfs", quiet, "")?;
    mount_at("dev", "/dev", "devtmpfs", MountFlags::NOSUID, "mode=0755")?;
    let root_device = virtio_disk(true).ok_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, "no read-only disk: no root image")
    })?;
    mount_at(&root_device, "/lower", "ext4", MountFlags::RDONLY, "")
        .map_err(|e| with_context(e, "mounting the root image"))?;
    mount_at(
        "layer",
        "/layer",
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        &format!("size={layer_mb}m,mode=0755"),
    )?;
    std::fs::create_dir_all("/layer/upper")?;
    std::fs::create_dir_all("/layer/work")?;
    mount_at(
        "root",
        "/newroot",
        "overlay",
        MountFlags::empty(),
        "lowerdir=/lower,upperdir=/layer/upper,workdir=/layer/work",
    )?;
    let root = Path::new("/newroot");
    mount_at("proc", root.join("proc"), "proc", quiet, "")?;
    mount_at(
        "sysfs",
        root.join("sys"),
        "sysfs",
        quiet | MountFlags::RDONLY,
        "",
    )?;
    mount_at("cgroup2", root.join("sys/fs/cgroup"), "cgroup2", quiet, "")?;
    mount_at(
        "dev",
        root.join("dev"),
        "devtmpfs",
        MountFlags::NOSUID,
        "mode=0755",
    )?;
    // Pseudo-terminals: bash_kernel drives its shell through one (pexpect).
    mount_at(
        "devpts",
        root.join("dev/pts"),
        "devpts",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        "mode=0620,ptmxmode=0666",
    )?;
    mount_at(
        "shm",
        root.join("dev/shm"),
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        "mode=1777,size=64m",
    )?;
    mount_at(
        "run",
        root.join("run"),
        "tmpfs",
        quiet,
        "mode=0755,size=16m",
    )?;
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp)?;
    set_mode(&tmp, 0o1777)?;
    std::env::set_current_dir(root)?;
    mount_move(".", "/")?;
    rustix::process::chroot(".")?;
    std::env::set_current_dir("/")?;
    crate::egress::loopback_up()?;
    let hostname = cmdline_value(&cmdline, "cellgate.hostname").unwrap_or("sandbox");
    rustix::system::sethostname(hostname.as_bytes())?;
    Ok(())
}

/// The VM's read-only virtio disk (the shared root image) or its writable one (the
/// workspace). Told apart by the flag the VMM sets, not by name: the order in which a VMM's
/// MMIO devices become vda, vdb… is the VMM's business.
pub fn virtio_disk(read_only: bool) -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/block")
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("vd"))
        .collect();
    names.sort();
    names.into_iter().find_map(|name| {
        let ro = std::fs::read_to_string(format!("/sys/block/{name}/ro")).ok()?;
        (ro.trim() == "1" && read_only || ro.trim() == "0" && !read_only)
            .then(|| format!("/dev/{name}"))
    })
}

fn mount_at(
    source: &str,
    target: impl AsRef<Path>,
    fstype: &str,
    flags: MountFlags,
    data: &str,
) -> io::Result<()> {
    let target = target.as_ref();
    std::fs::create_dir_all(target)?;
    let data = std::ffi::CString::new(data)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in mount options"))?;
    mount(source, target, fstype, flags, data.as_c_str())
        .map_err(|e| with_context(e.into(), &format!("mount {fstype} on {}", target.display())))
}

fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

fn with_context(error: io::Error, what: &str) -> io::Error {
    io::Error::new(error.kind(), format!("{what}: {error}"))
}

/// Powers the VM off; the VMM then exits. Only pid 1 may, and it never returns.
pub fn poweroff() -> ! {
    rustix::fs::sync();
    let _ = rustix::system::reboot(rustix::system::RebootCommand::PowerOff);
    // reboot(2) does not return on success; if it failed, ending pid 1 panics the guest
    // kernel, which stops the VM as well.
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_values_from_a_command_line() {
        let line = "console=ttyS0 cellgate.transport=serial cellgate.layer_mb=64 quiet";
        assert_eq!(cmdline_value(line, "cellgate.transport"), Some("serial"));
        assert_eq!(cmdline_value(line, "cellgate.layer_mb"), Some("64"));
        assert_eq!(cmdline_value(line, "cellgate.layer"), None);
        assert_eq!(cmdline_value(line, "console"), Some("ttyS0"));
    }
}
