//! How this host can run VMs: hardware virtualization (KVM), a PVM-only KVM (which runs only
//! PVM guest kernels at speed), or none (QEMU's software emulation, TCG).
//!
//! The facts are read from a root directory (`/` in production, a folder of fixtures in
//! tests): `/dev/kvm`, the CPU flags in `/proc/cpuinfo`, and `/sys/module/kvm_pvm`.

use std::path::Path;

use super::vmm::Accel;

/// What the host says about virtualization.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// `/dev/kvm` exists.
    pub kvm_device: bool,
    /// The CPU offers VMX or SVM to this host (so KVM runs any guest at speed).
    pub hardware_virtualization: bool,
    /// KVM here is PVM (a paravirtual KVM for hosts that are themselves guests).
    pub pvm: bool,
}

impl HostFacts {
    pub fn read(root: &Path) -> HostFacts {
        let cpuinfo = std::fs::read_to_string(root.join("proc/cpuinfo")).unwrap_or_default();
        let hardware_virtualization = cpuinfo
            .lines()
            .filter(|line| line.starts_with("flags"))
            .any(|line| line.split_whitespace().any(|f| f == "vmx" || f == "svm"));
        HostFacts {
            kvm_device: root.join("dev/kvm").exists(),
            hardware_virtualization,
            pvm: root.join("sys/module/kvm_pvm").exists(),
        }
    }
}

/// The choice, and the sentence that explains it (logged, and shown by `cellgate doctor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub accel: Accel,
    pub why: String,
}

/// KVM when it can run the guest kernel at speed, TCG otherwise.
pub fn choose(facts: &HostFacts, pvm_guest: bool) -> Decision {
    let decision = |accel, why: &str| Decision {
        accel,
        why: why.to_owned(),
    };
    match facts {
        HostFacts {
            kvm_device: true,
            hardware_virtualization: true,
            ..
        } => decision(
            Accel::Kvm,
            "the CPU has hardware virtualization and /dev/kvm exists",
        ),
        HostFacts {
            kvm_device: true,
            pvm: true,
            ..
        } if pvm_guest => decision(
            Accel::Kvm,
            "KVM is PVM here and the guest kernel is a PVM guest",
        ),
        HostFacts {
            kvm_device: true,
            pvm: true,
            ..
        } => decision(
            Accel::Tcg,
            "KVM on this host is PVM-only, which runs only a PVM guest kernel (give one with \
             --guest-kernel and --guest-kernel-pvm)",
        ),
        HostFacts {
            kvm_device: true, ..
        } => decision(
            Accel::Tcg,
            "/dev/kvm exists but the CPU shows no VMX/SVM to this host",
        ),
        _ => decision(Accel::Tcg, "this host has no /dev/kvm"),
    }
}

/// The host's time-stamp counter rate, in kHz, measured against the monotonic clock over
/// 50 ms. Under emulation the guest's TSC runs at the host's rate, and a guest that must
/// calibrate it against the emulated PIT fails when the host is busy, then hangs calibrating
/// its delay loop; given the rate (`tsc_early_khz=`), it skips both.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub fn host_tsc_khz() -> Option<u64> {
    let read = || {
        let now = std::time::Instant::now();
        // SAFETY: RDTSC reads a counter every x86_64 CPU has; it touches no memory.
        (now, unsafe { std::arch::x86_64::_rdtsc() })
    };
    let (t0, c0) = read();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let (t1, c1) = read();
    let nanos = t1.duration_since(t0).as_nanos() as u64;
    let khz = c1.checked_sub(c0)?.checked_mul(1_000_000)? / nanos.max(1);
    // Below 100 MHz or above 10 GHz is no TSC; let the guest calibrate instead.
    (100_000..10_000_000).contains(&khz).then_some(khz)
}

#[cfg(not(target_arch = "x86_64"))]
pub fn host_tsc_khz() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    #[test]
    fn the_host_tsc_rate_is_plausible() {
        let khz = host_tsc_khz().expect("an x86_64 host has a TSC");
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        println!(
            "TSC {khz} kHz; {}",
            cpuinfo
                .lines()
                .find(|l| l.starts_with("cpu MHz"))
                .unwrap_or("")
        );
        assert!((100_000..10_000_000).contains(&khz));
    }

    #[test]
    fn real_kvm_pvm_only_and_none_choose_kvm_tcg_and_tcg() {
        let real = fixture(&[
            ("dev/kvm", ""),
            ("proc/cpuinfo", "processor : 0\nflags : fpu vme vmx sse\n"),
        ]);
        let facts = HostFacts::read(real.path());
        assert!(facts.hardware_virtualization && facts.kvm_device && !facts.pvm);
        assert_eq!(choose(&facts, false).accel, Accel::Kvm);

        let pvm = fixture(&[
            ("dev/kvm", ""),
            ("proc/cpuinfo", "flags : fpu vme sse hypervisor\n"),
            ("sys/module/kvm_pvm/parameters/pvm_native", "N\n"),
        ]);
        let facts = HostFacts::read(pvm.path());
        assert!(facts.pvm && !facts.hardware_virtualization);
        let without = choose(&facts, false);
        assert_eq!(without.accel, Accel::Tcg);
        assert!(without.why.contains("PVM-only"), "{}", without.why);
        assert_eq!(choose(&facts, true).accel, Accel::Kvm);

        let none = fixture(&[("proc/cpuinfo", "flags : fpu vmx\n")]);
        let decision = choose(&HostFacts::read(none.path()), false);
        assert_eq!(decision.accel, Accel::Tcg);
        assert!(decision.why.contains("no /dev/kvm"));
    }
}
