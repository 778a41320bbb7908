//! What only the `microvm` backend has, against a real ipykernel in a real VM (QEMU under
//! TCG on CI's machines): both agent transports, and starts and kills that leave no VMM,
//! no vsock backend and no socket behind. The tests every backend passes are in `common`.
//!
//! Needs root, QEMU, and the guest `./dev setup` builds (kernel, images, and
//! vhost-device-vsock for the vsock transport). Without them every test FAILS saying what
//! is missing: nothing is skipped silently.

use std::path::{Path, PathBuf};
use std::time::Instant;

use cellgate::sandbox::microvm::link::Transport;
use cellgate::sandbox::microvm::VMM_IDENTITY_BASE;
use cellgate::sandbox::{Limits, Sandbox};

use super::harness::{
    self, command_spec, exit_of, python, require_root, start_kernel_in, KernelDirs,
};

/// The vsock device backend `./dev setup` installs.
fn vsock_backend() -> PathBuf {
    let dir = std::env::var_os("CELLGATE_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/guest"));
    let backend = dir.join("tools/bin/vhost-device-vsock");
    assert!(
        backend.is_file(),
        "{} is missing: ./dev setup installs it (cargo install vhost-device-vsock)",
        backend.display()
    );
    backend
}

/// The processes working in `dir` (a VM's VMM and vsock backend work in its runtime
/// directory): their pids and command lines.
fn processes_in(dir: &Path) -> Vec<(u32, String)> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        if std::fs::read_link(entry.path().join("cwd")).ok().as_deref() != Some(dir.as_path()) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        found.push((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
    }
    found
}

/// The command lines of [`processes_in`].
fn processes_with(dir: &Path) -> Vec<String> {
    processes_in(dir)
        .into_iter()
        .map(|(_, cmdline)| cmdline)
        .collect()
}

/// One field of `/proc/<pid>/status`.
fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_owned()
}

/// A VMM its guest took over holds only what the backend left it: every process of a VM
/// (QEMU, and vhost-device-vsock on the vsock link) runs as an unprivileged uid of its own,
/// with no capability and `no_new_privs`, in network, IPC and UTS namespaces of its own, in
/// a cgroup of its own with memory, CPU and pid limits, with open-file and file-size limits.
/// A second VM gets another uid; a stopped VM leaves no cgroup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vmm_is_confined_on_the_host() {
    require_root("the_vmm_is_confined_on_the_host");
    let sandbox = || {
        Box::new(harness::microvm_sandbox_with(Some(Transport::Vsock {
            backend: vsock_backend(),
        })))
    };
    let limits = Limits {
        memory_bytes: Some(256 << 20),
        cpu_millis: Some(1000),
        ..Limits::default()
    };
    let mut first = start_kernel_in(sandbox(), python(), limits.clone()).await;
    let second = start_kernel_in(sandbox(), python(), limits).await;
    let out = first.execute("1+1").await;
    assert_eq!(out.result.as_deref(), Some("2"), "{out:?}");

    // A file any user may read, beside the VMs' directories: no VMM may see it.
    let canary_dir = tempfile::tempdir().unwrap();
    let canary = canary_dir.path().join("canary");
    std::fs::write(&canary, b"host file").unwrap();
    std::fs::set_permissions(
        canary_dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::set_permissions(&canary, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();

    let link = |pid: u32, ns: &str| std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
    let me = std::process::id();
    let mut uids = Vec::new();
    let mut cgroups = Vec::new();
    for kernel in [&first, &second] {
        let processes = processes_in(&kernel.dirs.run);
        assert_eq!(processes.len(), 2, "VMM and vsock backend: {processes:#?}");
        let kvm = processes.iter().any(|(_, c)| c.contains("-accel kvm"));
        let mut vm_uids = Vec::new();
        for (pid, cmdline) in &processes {
            let uid = status_field(*pid, "Uid");
            let ids: Vec<u32> = uid.split_whitespace().map(|i| i.parse().unwrap()).collect();
            assert!(
                ids.iter()
                    .all(|id| *id == ids[0] && *id >= VMM_IDENTITY_BASE),
                "{cmdline}: Uid {uid}"
            );
            let gid = status_field(*pid, "Gid");
            assert!(
                gid.split_whitespace().all(|g| g == ids[0].to_string()),
                "{cmdline}: Gid {gid}"
            );
            // No supplementary group (but /dev/kvm's, where the VM uses KVM).
            let groups = status_field(*pid, "Groups");
            assert!(
                groups.is_empty() || (kvm && groups.split_whitespace().count() == 1),
                "{cmdline}: Groups {groups}"
            );
            assert_eq!(
                status_field(*pid, "CapEff"),
                "0000000000000000",
                "{cmdline}"
            );
            assert_eq!(
                status_field(*pid, "CapPrm"),
                "0000000000000000",
                "{cmdline}"
            );
            assert_eq!(status_field(*pid, "NoNewPrivs"), "1", "{cmdline}");
            for ns in ["net", "ipc", "uts"] {
                assert_ne!(link(*pid, ns), link(me, ns), "{cmdline}: {ns} namespace");
            }
            let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
            let limit = |name: &str| {
                limits
                    .lines()
                    .find(|l| l.starts_with(name))
                    .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                    .unwrap()
            };
            assert!(limit("Max open files").contains("1024 1024"), "{limits}");
            assert!(!limit("Max file size").contains("unlimited"), "{limits}");
            assert!(limit("Max core file size").contains("0 0"), "{limits}");
            let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
            let memory = cgroup
                .lines()
                .find(|l| {
                    l.split(':')
                        .nth(1)
                        .is_some_and(|c| c.split(',').any(|c| c == "memory"))
                })
                .or_else(|| cgroup.lines().find(|l| l.starts_with("0::")))
                .unwrap_or_default()
                .rsplit(':')
                .next()
                .unwrap_or_default()
                .to_owned();
            assert!(memory.contains("/cellgate/"), "{cmdline}: {cgroup}");
            host_files_seen_by(*pid, cmdline, &kernel.dirs.run, &canary);
            vm_uids.push(ids[0]);
            cgroups.push(memory);
        }
        assert_eq!(
            vm_uids[0], vm_uids[1],
            "one identity per VM: {processes:#?}"
        );
        uids.push(vm_uids[0]);
    }
    assert_ne!(uids[0], uids[1], "two VMs share a uid");

    // The memory limit on the host: the guest's RAM plus the VMM's overhead, written in
    // the VM's cgroup (v1 here; v2 where the host delegates it).
    let memory_dir = cgroup_dir("memory", &cgroups[0]);
    let limit: u64 = ["memory.limit_in_bytes", "memory.max"]
        .iter()
        .find_map(|f| std::fs::read_to_string(memory_dir.join(f)).ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no memory limit in {}", memory_dir.display()));
    assert!(
        limit > 256 << 20 && limit < 2 << 30,
        "VM cgroup memory limit {limit}"
    );

    first.stop().await;
    second.stop().await;
    for cgroup in &cgroups {
        let dir = cgroup_dir("memory", cgroup);
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
}

/// What the VM process `pid` sees of the host's files, read through `/proc/<pid>/root`
/// (its root, as the kernel resolves it for that process): its own runtime directory
/// `run`, `/usr` and the guest images, and nothing else: no `/proc`, `/sys`, `/home`, no
/// `/etc` but the linker's cache, no `canary` (a world-readable file), no snapshot and no
/// manifest beside the images, no other VM's directory; its root is read-only.
fn host_files_seen_by(pid: u32, cmdline: &str, run: &Path, canary: &Path) {
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let inside = |path: &Path| root.join(path.strip_prefix("/").unwrap_or(path));
    let run = run.canonicalize().unwrap();
    assert!(
        inside(&run).join("console.log").exists(),
        "{cmdline}: its own directory is missing from its view"
    );
    assert!(inside(Path::new("/usr/bin")).is_dir(), "{cmdline}: no /usr");
    let program = cmdline.split_whitespace().next().unwrap();
    assert!(
        inside(Path::new(program)).is_file(),
        "{cmdline}: no {program}"
    );
    assert!(
        !inside(canary).exists(),
        "{cmdline}: sees {}",
        canary.display()
    );
    for absent in [
        "/proc/self",
        "/sys/kernel",
        "/home",
        "/root",
        "/etc/passwd",
        "/etc/hostname",
        "/var",
    ] {
        assert!(
            !inside(Path::new(absent)).exists(),
            "{cmdline}: sees {absent}"
        );
    }
    let etc: Vec<_> = std::fs::read_dir(inside(Path::new("/etc")))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(etc, ["ld.so.cache"], "{cmdline}: /etc");
    // Every directory on the way to its own holds that way only.
    for ancestor in run.ancestors().skip(1) {
        let entries: Vec<_> = std::fs::read_dir(inside(ancestor))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        if ancestor == Path::new("/") {
            continue;
        }
        let next = run
            .strip_prefix(ancestor)
            .unwrap()
            .components()
            .next()
            .unwrap();
        let images = guest_dir().canonicalize().unwrap();
        let on_images_path = images.starts_with(ancestor);
        assert!(
            entries
                .iter()
                .all(|e| e == next.as_os_str() || on_images_path),
            "{cmdline}: {} holds {entries:?}",
            ancestor.display()
        );
    }
    // The guest images, each on its own: the manifest and the snapshots beside them are not.
    let guest = guest_dir().canonicalize().unwrap();
    let shown: Vec<_> = std::fs::read_dir(inside(&guest))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        !shown.is_empty()
            && shown
                .iter()
                .all(|name| ["vmlinux-", "initramfs-", "root-", "tools"]
                    .iter()
                    .any(|prefix| name.starts_with(prefix))),
        "{cmdline}: {} shows {shown:?}",
        guest.display()
    );
    let written = std::fs::write(inside(Path::new("/planted")), b"x");
    assert_eq!(
        written.as_ref().map_err(|e| e.raw_os_error()),
        Err(Some(libc::EROFS)),
        "{cmdline}: its root is writable"
    );
}

/// The guest images' directory.
fn guest_dir() -> PathBuf {
    std::env::var_os("CELLGATE_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/guest"))
}

/// A cgroup's directory in the hierarchy that has `controller` (v1), or the unified one.
fn cgroup_dir(controller: &str, path: &str) -> PathBuf {
    let v1 = Path::new("/sys/fs/cgroup").join(controller);
    let base = if v1.is_dir() {
        v1
    } else {
        PathBuf::from("/sys/fs/cgroup")
    };
    base.join(path.trim_start_matches('/'))
}

/// The same agent protocol over both links: a kernel round trip on virtio-serial and on
/// hybrid vsock, each with the link's own processes and nothing of the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_transports_carry_a_kernel() {
    require_root("both_transports_carry_a_kernel");
    for transport in [
        Transport::Serial,
        Transport::Vsock {
            backend: vsock_backend(),
        },
    ] {
        let name = transport.name();
        let sandbox = Box::new(harness::microvm_sandbox_with(Some(transport.clone())));
        let mut kernel = start_kernel_in(sandbox, python(), Limits::default()).await;
        let out = kernel.execute("1+1").await;
        assert_eq!(out.result.as_deref(), Some("2"), "{name}: {out:?}");
        let run = kernel.dirs.run.clone();
        let vmm = processes_with(&run);
        let backends: Vec<_> = vmm
            .iter()
            .filter(|c| c.contains("vhost-device-vsock"))
            .collect();
        match transport {
            Transport::Serial => {
                assert!(
                    vmm.iter().any(|c| c.contains("virtserialport")),
                    "{name}: {vmm:#?}"
                );
                assert!(backends.is_empty(), "{name}: {backends:#?}");
            }
            Transport::Vsock { .. } => {
                assert!(
                    vmm.iter().any(|c| c.contains("vhost-user-vsock-device")),
                    "{name}: {vmm:#?}"
                );
                assert_eq!(backends.len(), 1, "{name}: {vmm:#?}");
            }
        }
        println!("{name}: 1+1 = {:?}", out.result);
        kernel.stop().await;
        assert!(
            processes_with(&run).is_empty(),
            "{name}: the VM outlived stop()"
        );
    }
}

/// Twenty start-and-kill cycles on the default transport: every kill is reported once, as
/// signal 9, and no VMM, vsock backend or socket is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_start_kill_cycles_leave_nothing_behind() {
    require_root("twenty_start_kill_cycles_leave_nothing_behind");
    let sandbox = harness::microvm_sandbox();
    let started = Instant::now();
    let dirs = KernelDirs::new("cycles");
    for cycle in 0..20 {
        let run = dirs.run.join(format!("c{cycle}"));
        std::fs::create_dir(&run).expect("mkdir");
        let mut spec = command_spec(
            &dirs,
            vec!["/bin/sleep".into(), "1000".into()],
            Limits::default(),
        );
        spec.runtime_dir = run.clone();
        spec.connection_file = run.join("connection.json");
        let launched = sandbox.launch(&spec).await.expect("launch");
        launched.handle.kill().expect("kill");
        let report = exit_of(launched).await;
        assert_eq!(
            report.signal,
            Some(libc::SIGKILL),
            "cycle {cycle}: {report:?}"
        );
        // The exit report comes after the VMM and its companion were reaped.
        let left = processes_with(&run);
        assert!(left.is_empty(), "cycle {cycle}: {left:#?}");
    }
    let sockets: Vec<_> = walk(&dirs.run)
        .into_iter()
        .filter(|p| {
            use std::os::unix::fs::FileTypeExt;
            std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
        })
        .filter(|p| {
            // A socket file nobody listens on is harmless only if it is gone: connect.
            std::os::unix::net::UnixStream::connect(p).is_ok()
        })
        .collect();
    assert!(sockets.is_empty(), "live sockets left: {sockets:#?}");
    println!("20 cycles in {:?}", started.elapsed());
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}
