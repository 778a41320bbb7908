//! The sandbox backends against real processes and a real ipykernel, through the `Sandbox`
//! trait: `common` runs the same tests against every backend, `namespaces`, `gvisor` and
//! `microvm` what only one of them has; `harness` is what they all use.
//!
//! This test binary doubles as the namespaces backend's sandbox helper: started as
//! `<exe> __sandbox-init`, a constructor runs `sandbox_init_main` before the test harness
//! (and its threads) exist, so the tests do not depend on the `cellgate` binary's `main`.
//! One test checks that `main` dispatches the same way. The constructor also runs the
//! stand-in gateways that the dying-with-the-gateway and unprivileged tests start as
//! separate processes (`MODE_VAR`).
//!
//! Needs root (the development and CI machines run as root), Debian's `runsc` for gVisor
//! (`./dev setup` installs it; without it the gVisor tests FAIL saying so), and the kernel
//! venv in `kernels/python3/.venv` (built by `./dev setup`).

mod common;
mod gvisor;
mod harness;
mod microvm;
mod namespaces;

use cellgate::sandbox::SANDBOX_INIT_ARG;

/// Which stand-in gateway this process is, when a test started it as one.
const MODE_VAR: &str = "CELLGATE_SANDBOX_TEST_MODE";
/// Where a stand-in gateway writes what the test needs to know.
const OUT_VAR: &str = "CELLGATE_SANDBOX_TEST_OUT";

// SAFETY (for the allow): a constructor in .init_array runs before main, while the process
// is single-threaded, which is what the sandbox helper needs; it calls no unsafe code.
#[allow(unsafe_code)]
#[used]
#[link_section = ".init_array"]
static BEFORE_MAIN: extern "C" fn() = before_main;

extern "C" fn before_main() {
    let Ok(cmdline) = std::fs::read("/proc/self/cmdline") else {
        return;
    };
    if cmdline.split(|&b| b == 0).nth(1) == Some(SANDBOX_INIT_ARG.as_bytes()) {
        cellgate::sandbox::sandbox_init_main();
    }
    match std::env::var(MODE_VAR).as_deref() {
        Ok("namespaces-gateway") => std::process::exit(namespaces::gateway_mode()),
        Ok("namespaces-unprivileged") => std::process::exit(namespaces::unprivileged_mode()),
        Ok("gvisor-gateway") => std::process::exit(gvisor::gateway_mode()),
        _ => {}
    }
}
