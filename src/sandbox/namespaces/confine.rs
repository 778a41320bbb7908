//! The kernel process's last steps before `execve`: the confinement that only this process
//! and what it starts carry.
//!
//! Forked by the init, already uid/gid 1000 with no capabilities, inside the finished root.
//! In order:
//! 1. default signal actions and an empty mask (the init blocks the signals it waits for,
//!    and masks survive `execve`), `PR_SET_PDEATHSIG(SIGKILL)`, a session and process group
//!    of its own (so interrupts reach `!sleep 60` too);
//! 2. stdio: stdin from `/dev/null`, stdout and stderr to the kernel's output pipe (the
//!    helper's stderr, which the gateway copies into the log file; a pipe, so the kernel can
//!    reopen `/dev/stderr` and never learns the log's host path); every other inherited
//!    descriptor is closed, so the event channel to the gateway is out of its reach;
//! 3. rlimits: no core dumps; 4096 open files whatever the gateway's own limit (which it
//!    raises for itself); `RLIMIT_AS` when the plan asks for it (no memory cgroup);
//! 4. the workspace as working directory;
//! 5. `PR_SET_NO_NEW_PRIVS`, then Landlock (best effort), then the seccomp filter, last,
//!    because it also denies calls the earlier steps make;
//! 6. `execve` of the kernel's command with exactly the plan's environment.
//!
//! Any failure is written to the init's close-on-exec pipe and the process exits with 127;
//! the init turns that into a failed launch.

use std::convert::Infallible;
use std::ffi::CString;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use seccompiler::BpfProgram;

use super::landlock;
use super::plan::{Plan, Role};
use super::seccomp;
use super::sys;

/// Open files a kernel may hold (the same as under gVisor).
const KERNEL_NOFILE: u64 = 4096;

pub fn exec_kernel(plan: &Plan, programs: &[BpfProgram], error_pipe: OwnedFd) -> ! {
    let Err(message) = confine_and_exec(plan, programs, error_pipe.as_raw_fd());
    fail(error_pipe, &message)
}

/// For [`Role::Forked`]: the same confinement as [`exec_kernel`], in the same order, and then
/// a return to the caller (the zygote's Python, which becomes the kernel) instead of
/// `execve`. The error pipe is closed on success, which tells the init the kernel started,
/// as a successful `execve` closes it.
pub fn confine_in_place(plan: &Plan, programs: &[BpfProgram], error_pipe: OwnedFd) {
    let confined = confine(plan, programs, error_pipe.as_raw_fd()).and_then(|_| {
        // Dumpable, as a kernel is after its `execve` (the init's change of uid cleared it):
        // its /proc files are then its own, so it can read its /proc/self/environ, as a
        // kernel started afresh can.
        sys::set_dumpable(true).map_err(step("set dumpable"))
    });
    match confined {
        Ok(()) => drop(error_pipe),
        Err(message) => fail(error_pipe, &message),
    }
}

fn fail(error_pipe: OwnedFd, message: &str) -> ! {
    let mut error_pipe = std::fs::File::from(error_pipe);
    let _ = error_pipe.write_all(message.as_bytes());
    sys::exit_now(127)
}

fn step<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> String {
    move |err| format!("{what}: {err}")
}

fn confine_and_exec(
    plan: &Plan,
    programs: &[BpfProgram],
    error_fd: RawFd,
) -> Result<Infallible, String> {
    let (program, argv, env) = confine(plan, programs, error_fd)?;
    let err = sys::execve(&program, &argv, &env);
    Err(format!("execve {}: {err}", plan.argv[0]))
}

/// Every step before `execve`; the command and environment, ready for it.
fn confine(
    plan: &Plan,
    programs: &[BpfProgram],
    error_fd: RawFd,
) -> Result<(CString, Vec<CString>, Vec<CString>), String> {
    sys::reset_signals().map_err(step("reset signals"))?;
    sys::set_parent_death_signal(libc::SIGKILL).map_err(step("set parent death signal"))?;
    sys::setsid().map_err(step("setsid"))?;

    // A zygote's standard input is the gateway's control socket (see `Role::Zygote`).
    if plan.role != Role::Zygote {
        let null = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .map_err(step("open /dev/null"))?;
        sys::dup2(null.as_raw_fd(), 0).map_err(step("stdin"))?;
        drop(null);
    }
    sys::dup2(2, 1).map_err(step("stdout"))?;

    sys::setrlimit(libc::RLIMIT_CORE, 0, 0).map_err(step("RLIMIT_CORE"))?;
    // The gateway raises its own soft limit to the hard one at start-up (it holds sockets for
    // every client and kernel); a kernel gets gVisor's figure instead, never the gateway's.
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .maximum
        .unwrap_or(u64::MAX);
    let nofile = KERNEL_NOFILE.min(hard);
    sys::setrlimit(libc::RLIMIT_NOFILE, nofile, nofile).map_err(step("RLIMIT_NOFILE"))?;
    if let Some(bytes) = plan.address_space_limit {
        sys::setrlimit(libc::RLIMIT_AS, bytes, bytes).map_err(step("RLIMIT_AS"))?;
    }

    std::env::set_current_dir(&plan.workspace).map_err(step("enter the workspace"))?;

    let argv: Vec<CString> = plan
        .argv
        .iter()
        .map(sys::cstring)
        .collect::<Result<_, _>>()
        .map_err(step("argv"))?;
    let env: Vec<CString> = plan
        .env
        .iter()
        .map(|(k, v)| sys::cstring(format!("{k}={v}")))
        .collect::<Result<_, _>>()
        .map_err(step("environment"))?;
    let program = argv.first().ok_or("empty command")?.clone();

    sys::set_no_new_privs().map_err(step("no_new_privs"))?;
    if plan.landlock {
        landlock::restrict(plan).map_err(step("landlock"))?;
    }
    // The error pipe stays open (it is close-on-exec); everything else inherited goes.
    sys::close_all_above_stdio_except(&[error_fd]).map_err(step("close inherited descriptors"))?;
    seccomp::install(programs).map_err(step("seccomp"))?;
    Ok((program, argv, env))
}
