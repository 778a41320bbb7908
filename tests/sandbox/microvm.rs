//! What only the `microvm` backend has, against a real ipykernel in a real VM (QEMU under
//! TCG on CI's machines): both agent transports, and starts and kills that leave no VMM,
//! no vsock backend and no socket behind. The tests every backend passes are in `common`.
//!
//! Needs root, QEMU, and the guest `./dev setup` builds (kernel, images, and
//! vhost-device-vsock for the vsock transport). Without them every test FAILS saying what
//! is missing: nothing is skipped silently.

use std::path::PathBuf;
use std::time::Instant;

use cellgate::sandbox::microvm::link::Transport;
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

/// Processes whose command line mentions `needle`.
fn processes_with(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push(cmdline);
        }
    }
    found
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
        let run = kernel.dirs.run.display().to_string();
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
        let run_text = run.display().to_string();
        // The exit report comes after the VMM and its companion were reaped.
        let left = processes_with(&run_text);
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
