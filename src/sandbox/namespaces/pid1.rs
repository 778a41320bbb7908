//! The sandbox's init: PID 1 of the new pid namespace. It builds the sandbox, starts the
//! kernel process, forwards signals to it and reaps every process of the sandbox.
//!
//! In order, as a fork of the helper (single-threaded, so it may allocate freely):
//! 1. `PR_SET_PDEATHSIG(SIGKILL)`, then a check that the helper is still there (the pipe it
//!    holds has not hung up): from here on, the helper's death is the init's.
//! 2. Opens every host path the sandbox will show ([`RootFs::prepare`]), still with the
//!    gateway's host identity.
//! 3. Drops supplementary groups (where the id maps allow it) and switches to the sandbox
//!    uid/gid 1000, keeping its capabilities in the user namespace
//!    (`SECBIT_NO_SETUID_FIXUP`): from now on, files it creates belong to the kernel's
//!    unprivileged host id. The uid change clears the parent-death signal, so it is set
//!    (and the helper checked) once more.
//! 4. Builds the root file system and pivots into it ([`RootFs::build`]), brings up the
//!    loopback interface of the empty network namespace, sets the host name, and makes the
//!    plan's workspace directories (the per-session site-packages on `PYTHONPATH`).
//! 5. Gives up every capability for good: locked securebits (`NOROOT`, no setuid fixup), an
//!    empty bounding set, no ambient, effective, permitted or inheritable capabilities.
//!    From here on the init and the kernel are plain uid 1000 processes.
//! 6. Blocks the signals it handles; when the plan names an egress socket, binds
//!    127.0.0.1:3128 and forks the egress bridge ([`super::bridge`]). Then forks the kernel
//!    process (see [`super::confine`]),
//!    then waits until the kernel's `execve` succeeded (a close-on-exec pipe stays silent)
//!    or failed (the pipe carries the error), and reports either.
//! 7. Loops on `sigwaitinfo`: `SIGCHLD` reaps whatever ended (orphans are reparented to
//!    PID 1); SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are forwarded to the
//!    kernel's process group. When the kernel process ends, it kills every other process of
//!    the namespace, reaps them, reports the kernel's exit status and exits, which ends the
//!    pid namespace.
//!
//! A PID 1 gets no default signal actions, so a stray signal from inside cannot kill it;
//! only SIGKILL from outside (the gateway's `kill`, or the parent-death signal) can.

#![allow(unsafe_code)]

use std::io::Read;
use std::os::fd::OwnedFd;

use super::bridge;
use super::confine;
use super::mounts::RootFs;
use super::plan::{Event, Plan, Role};
use super::report::{at, report, Failure};
use super::seccomp;
use super::sys::{self, Ended, Forked, SignalSet};

/// Signals the init forwards to the kernel's process group.
pub const FORWARDED: &[libc::c_int] = &[
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// Runs the init. Returns only in the kernel process of a [`Role::Forked`] sandbox, confined,
/// with its plan: that process goes on as the kernel (see [`super::zygote`]).
pub fn run(plan: Plan, helper_alive: OwnedFd) -> Plan {
    match init(plan, helper_alive) {
        Ok(Some(plan)) => plan,
        Ok(None) => sys::exit_now(0),
        Err(failure) => {
            report(&Event::Failed {
                stage: failure.stage.to_owned(),
                error: failure.error,
            });
            sys::exit_now(1)
        }
    }
}

fn init(plan: Plan, helper_alive: OwnedFd) -> Result<Option<Plan>, Failure> {
    sys::set_parent_death_signal(libc::SIGKILL).map_err(at("set parent death signal"))?;
    if sys::pipe_hung_up(&helper_alive) {
        return Err(at("start")("the sandbox helper is gone"));
    }

    let root = RootFs::prepare(&plan).map_err(at("open host paths"))?;
    // The proxy's socket is never shown inside: the bridge connects through this descriptor
    // (close-on-exec, so the kernel does not inherit it).
    // A kept sandbox's bridge holds the socket's directory instead, so that it reaches
    // whichever gateway listens there now (see `survival.rs`).
    let egress = plan
        .egress_socket
        .as_deref()
        .map(|socket| match (&plan.keep, socket.parent()) {
            (Some(_), Some(dir)) => sys::open_path(dir),
            _ => sys::open_path(socket),
        })
        .transpose()
        .map_err(at("open the egress proxy socket"))?;

    sys::set_securebits(libc::SECBIT_NO_SETUID_FIXUP).map_err(at("securebits"))?;
    match sys::clear_groups() {
        Ok(()) => {}
        // Unprivileged gateways must deny setgroups in the user namespace.
        Err(err) if err.raw_os_error() == Some(libc::EPERM) => {}
        Err(err) => return Err(at("drop supplementary groups")(err)),
    }
    sys::setresgid(plan.gid).map_err(at("setresgid"))?;
    sys::setresuid(plan.uid).map_err(at("setresuid"))?;
    // Changing the effective uid clears the parent-death signal: set it again, and check
    // again that the helper did not die in between.
    sys::set_parent_death_signal(libc::SIGKILL).map_err(at("set parent death signal"))?;
    if sys::pipe_hung_up(&helper_alive) {
        return Err(at("start")("the sandbox helper is gone"));
    }

    root.build().map_err(at("build the root file system"))?;
    for dir in &plan.workspace_dirs {
        std::fs::create_dir_all(dir).map_err(at("create a workspace directory"))?;
    }
    sys::loopback_up().map_err(at("bring up lo"))?;
    sys::sethostname(&plan.hostname).map_err(at("sethostname"))?;

    drop_all_capabilities()?;

    let programs = match plan.role {
        Role::Zygote => seccomp::build_for_zygote(),
        Role::Kernel | Role::Forked => seccomp::build(),
    }
    .map_err(at("build the seccomp filter"))?;
    let signals = {
        let mut list = FORWARDED.to_vec();
        list.push(libc::SIGCHLD);
        SignalSet::of(&list)
    };
    signals.block().map_err(at("block signals"))?;

    if let Some(socket) = egress {
        let listener = bridge::bind().map_err(at("bind the egress bridge"))?;
        // SAFETY: the init is a fork of the single-threaded helper and starts no threads.
        match unsafe { sys::fork() }.map_err(at("fork the egress bridge"))? {
            Forked::Child => bridge::run(&plan, &programs, listener, socket),
            Forked::Parent { .. } => drop((listener, socket)),
        }
    }

    let (exec_read, exec_write) = sys::pipe().map_err(at("pipe"))?;
    // SAFETY: the init is a fork of the single-threaded helper and starts no threads.
    let kernel = match unsafe { sys::fork() }.map_err(at("fork the kernel"))? {
        Forked::Child => {
            drop(exec_read);
            if plan.role != Role::Forked {
                confine::exec_kernel(&plan, &programs, exec_write)
            }
            // Closed here rather than by the confinement's sweep of inherited descriptors,
            // which would leave this owner to close a number that is no longer its own.
            drop(helper_alive);
            confine::confine_in_place(&plan, &programs, exec_write);
            return Ok(Some(plan));
        }
        Forked::Parent { child } => child,
    };
    drop(exec_write);
    if plan.role == Role::Zygote {
        // The zygote's control socket is the zygote's alone.
        sys::stdin_from_null().map_err(at("close the control socket"))?;
    }

    let mut exec_error = String::new();
    let _ = std::fs::File::from(exec_read).read_to_string(&mut exec_error);
    if !exec_error.is_empty() {
        let _ = sys::waitpid(kernel, 0);
        return Err(Failure {
            stage: "start the kernel",
            error: exec_error,
        });
    }
    report(&Event::Kernel { pid: kernel });

    let ended = supervise(&signals, kernel, plan.role).map_err(at("supervise"))?;
    let (code, signal) = match ended {
        Ended::Exited(code) => (Some(code), None),
        Ended::Signaled(signal) => (None, Some(signal)),
    };
    report(&Event::Exited { code, signal });
    Ok(None)
}

fn drop_all_capabilities() -> Result<(), Failure> {
    sys::set_securebits(
        libc::SECBIT_NOROOT
            | libc::SECBIT_NOROOT_LOCKED
            | libc::SECBIT_NO_SETUID_FIXUP
            | libc::SECBIT_NO_SETUID_FIXUP_LOCKED
            | libc::SECBIT_KEEP_CAPS_LOCKED,
    )
    .map_err(at("lock securebits"))?;
    sys::drop_bounding_set().map_err(at("drop the capability bounding set"))?;
    sys::clear_ambient_capabilities().map_err(at("clear ambient capabilities"))?;
    sys::clear_capabilities().map_err(at("clear capabilities"))?;
    Ok(())
}

/// Reaps and forwards until the kernel process ends; then ends everything else.
///
/// A zygote's init differs in two ways: signals go to the zygote alone (its children, the
/// helpers of running sandboxes, are not its process group's to share), and when the zygote
/// ends the sandboxes forked from it go on; the init reaps until the last of them ended.
fn supervise(signals: &SignalSet, kernel: libc::pid_t, role: Role) -> std::io::Result<Ended> {
    loop {
        let (signal, _) = signals.wait()?;
        if signal != libc::SIGCHLD {
            // The kernel leads its own process group (it called setsid).
            if role == Role::Zygote || sys::kill(-kernel, signal).is_err() {
                let _ = sys::kill(kernel, signal);
            }
            continue;
        }
        loop {
            match sys::waitpid(-1, libc::WNOHANG) {
                Ok(Some((pid, ended))) if pid == kernel && role == Role::Zygote => {
                    reap_all();
                    return Ok(ended);
                }
                Ok(Some((pid, ended))) if pid == kernel => {
                    // Everything else in the namespace goes with the kernel.
                    let _ = sys::kill(-1, libc::SIGKILL);
                    reap_all();
                    return Ok(ended);
                }
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(err) if err.raw_os_error() == Some(libc::ECHILD) => break,
                Err(err) => return Err(err),
            }
        }
    }
}

fn reap_all() {
    loop {
        match sys::waitpid(-1, 0) {
            Ok(_) => continue,
            Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
            Err(_) => return,
        }
    }
}
