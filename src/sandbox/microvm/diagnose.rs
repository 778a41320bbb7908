//! What the microvm backend needs of the host, checked: QEMU, the guest images, mke2fs, and
//! how VMs would get their CPU (KVM, or emulation and whether it is allowed); with `probe`,
//! a real VM that boots its agent and runs `/bin/true` as its kernel.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::accel::{choose, HostFacts};
use super::image::GuestImages;
use super::vmm::Accel;
use super::{MicrovmConfig, MicrovmSandbox};
use crate::sandbox::diagnosis::{find_on_path, probe as run_probe, run_command, Diagnosis};

pub async fn diagnose(probe: bool, config: &MicrovmConfig) -> Diagnosis {
    let mut s = Diagnosis::new("microvm");
    s.fact(
        "hibernation",
        "supported: policies with hibernate_after, with a state directory",
    );
    let config = config.clone();
    match find_on_path(&config.qemu.to_string_lossy()) {
        Some(qemu) => {
            s.fact("qemu", qemu.display().to_string());
            match run_command(&qemu, &["--version"], Duration::from_secs(10)).await {
                Ok(out) => s.fact("qemu_version", out.lines().next().unwrap_or("").trim()),
                Err(err) => s.fail(
                    format!("`{} --version` failed: {err}", qemu.display()),
                    "apt-get install --reinstall -y qemu-system-x86",
                ),
            }
        }
        None => {
            s.fact("qemu", Value::Null);
            s.fail(
                "qemu-system-x86_64 is not on PATH",
                "apt-get install -y qemu-system-x86   (or ./dev setup)",
            );
        }
    }
    if find_on_path("mke2fs").is_none() {
        s.fail(
            "mke2fs is not on PATH (it makes each VM's workspace disk)",
            "apt-get install -y e2fsprogs",
        );
    }
    s.fact("guest_dir", config.guest_dir.display().to_string());
    let images = match GuestImages::locate(&config.guest_dir, config.own_kernel()) {
        Ok(images) => {
            s.fact("guest_kernel", images.kernel.display().to_string());
            s.fact("guest_root", images.root.display().to_string());
            Some(images)
        }
        Err(err) => {
            s.fail(
                err.to_string(),
                "./dev setup builds the guest kernel and images (about 5 min the first time)",
            );
            None
        }
    };
    if config.snapshots {
        let dir = config
            .snapshot_dir
            .clone()
            .unwrap_or_else(|| config.guest_dir.join("snapshots"));
        let ready = std::fs::read_dir(&dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.path().extension().is_some_and(|x| x == "vmstate"))
                    .count()
            })
            .unwrap_or(0);
        s.fact("snapshots", "on: each kind of VM is restored from a warm-pool snapshot once the first of its kind has booted");
        s.fact("snapshot_dir", dir.display().to_string());
        s.fact("snapshots_saved", ready);
    } else {
        s.fact(
            "snapshots",
            "off (--microvm-snapshots false): every VM boots",
        );
    }
    let facts = HostFacts::read(Path::new("/"));
    s.fact("dev_kvm", facts.kvm_device);
    s.fact("hardware_virtualization", facts.hardware_virtualization);
    s.fact("kvm_pvm", facts.pvm);
    let decision = choose(&facts, images.as_ref().is_some_and(|i| i.pvm_guest));
    s.fact("accel", decision.accel.as_str());
    s.fact("accel_why", decision.why.clone());
    if decision.accel == Accel::Tcg {
        if config.allow_emulation {
            s.warn(
                format!("{}: VMs run under software emulation (TCG), ~50x slower for Python; allowed by --microvm-allow-emulation", decision.why),
                "serve microVMs on a host with hardware virtualization (or give a PVM guest kernel on a PVM host)",
            );
        } else {
            s.fail(
                format!("{}: VMs would run under software emulation (TCG), which is refused for serving", decision.why),
                "--microvm-allow-emulation (CELLGATE_MICROVM_ALLOW_EMULATION=true) accepts emulation for every policy, `allow_emulation = true` in a policy's [sandbox] for that policy (tests, development); or use a host with hardware virtualization",
            );
        }
    }
    if probe && s.available {
        match MicrovmSandbox::new(config) {
            Ok(sandbox) => match run_probe(&sandbox, "/bin/true").await {
                Ok(took) => s.fact(
                    "probe",
                    format!("a VM booted and ran /bin/true in {} ms", took.as_millis()),
                ),
                Err(err) => s.fail(
                    format!("a probe VM failed: {err}"),
                    "see the guest console in the error; rebuild the guest with ./dev setup",
                ),
            },
            Err(err) => s.fail(err.to_string(), "see above"),
        }
    }
    s
}
