//! The sandbox helper: the gateway's binary re-executed as `cellgate __sandbox-init`, the
//! first process of every sandbox.
//!
//! Why a re-exec: the gateway is a multithreaded tokio process, and after `fork` in such a
//! process only async-signal-safe calls are allowed until `exec`, which rules out building a
//! file system, compiling a seccomp filter or a Landlock ruleset there. A freshly exec'd
//! helper is single-threaded, so it and the processes it forks may allocate, use the
//! standard library and report errors in plain Rust.
//!
//! The helper, in order:
//! 1. reads the [`Plan`] (one JSON line on stdin);
//! 2. unshares new user, mount, network, IPC, UTS and pid namespaces (the pid namespace
//!    applies to its children), reports [`Event::Unshared`] and waits for the gateway's `go`
//!    line: meanwhile the gateway writes the uid/gid maps (a helper forked from a zygote
//!    writes its own first: see `zygote.rs`) and moves the helper into the kernel's cgroups;
//! 3. unshares a cgroup namespace (now rooted at the kernel's cgroup) and forks the init,
//!    which becomes PID 1 of the new pid namespace (see [`super::pid1`]);
//! 4. reports the init's host pid, waits for it and exits with its status.
//!
//! A sandbox that outlives its gateway (`Plan::keep`) is kept by its helper instead, which
//! then has no parent-death signal (see `keeper.rs`). Otherwise the helper
//! stays outside the sandbox's pid namespace, with `PR_SET_PDEATHSIG(SIGKILL)` set by the
//! gateway: if the gateway dies, the helper dies, the init (whose parent-death signal points
//! at the helper) dies, and the kernel takes every process of the pid namespace with it.
//! The helper's stdout is the event channel back to the gateway; its stderr is a pipe the
//! gateway copies into the kernel's log file, and the kernel's stdout and stderr.

#![allow(unsafe_code)]

use std::io::{self, BufRead};

use super::idmap::IdMap;
use super::keeper::Keeper;
use super::pid1;
use super::plan::{Event, Plan, Role, GO};
use super::report::{at, report, Failure};
use super::sys::{self, Ended, Forked};

/// The hidden first argument that makes the gateway's binary the sandbox helper.
pub const SANDBOX_INIT_ARG: &str = "__sandbox-init";

/// Entry point of `cellgate __sandbox-init`. Call it before anything starts a thread (in
/// particular before the tokio runtime): `unshare(CLONE_NEWUSER)` fails in a multithreaded
/// process.
pub fn sandbox_init_main() -> ! {
    let code = match run(&mut io::stdin().lock()) {
        Ok(Outcome::Exit(code)) => code,
        // Only a `Role::Forked` plan's kernel returns, and only a zygote's child runs one.
        Ok(Outcome::Kernel(_)) => 127,
        Err(failure) => {
            report(&Event::Failed {
                stage: failure.stage.to_owned(),
                error: failure.error,
            });
            1
        }
    };
    sys::exit_now(code)
}

/// How [`run`] ends in the process that called it.
pub enum Outcome {
    /// The helper's work is done: exit with this code.
    Exit(i32),
    /// This process is now the confined kernel of a [`Role::Forked`] plan.
    Kernel(Box<Plan>),
}

/// The helper's steps, reading the plan and the gateway's `go` from `input`.
pub fn run(input: &mut impl BufRead) -> Result<Outcome, Failure> {
    let mut line = String::new();
    input.read_line(&mut line).map_err(at("read plan"))?;
    let plan: Plan = serde_json::from_str(line.trim_end()).map_err(at("parse plan"))?;

    sys::unshare(
        libc::CLONE_NEWUSER
            | libc::CLONE_NEWNS
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWPID,
    )
    .map_err(at("unshare namespaces"))?;
    if plan.role == Role::Forked {
        // Entering the new user namespace made this process non-dumpable (its capabilities
        // changed), which gives its /proc files to root: it could not write its own maps.
        // Dumpable for that moment only; the init's change of uid clears it again.
        sys::set_dumpable(true).map_err(at("set dumpable"))?;
        IdMap::FORKED.write_own().map_err(at("write the id maps"))?;
        sys::set_dumpable(false).map_err(at("set dumpable"))?;
    }
    report(&Event::Unshared);

    line.clear();
    input
        .read_line(&mut line)
        .map_err(at("wait for the gateway"))?;
    if line.trim_end() != GO {
        // The gateway gave up (its end closed): nothing was started.
        return Ok(Outcome::Exit(1));
    }

    sys::unshare(libc::CLONE_NEWCGROUP).map_err(at("unshare cgroup namespace"))?;

    // A sandbox that outlives its gateway keeps itself (see `keeper.rs`).
    let keeper = plan
        .keep
        .as_ref()
        .map(|keep| Keeper::prepare(keep, &plan))
        .transpose()?;
    // The init watches this pipe: when its write end (held only by us) closes, we are gone.
    let (alive_read, alive_write) = sys::pipe().map_err(at("pipe"))?;
    // SAFETY: this process is single-threaded: it was exec'd moments ago (or forked from a
    // zygote that checked it has one thread) and starts no threads (reading stdin and
    // writing stdout do not).
    match unsafe { sys::fork() }.map_err(at("fork the init"))? {
        Forked::Child => {
            drop(alive_write);
            if let Some(keeper) = keeper {
                keeper.into_init()?;
            }
            Ok(Outcome::Kernel(Box::new(pid1::run(plan, alive_read))))
        }
        Forked::Parent { child } => {
            drop(alive_read);
            if plan.role == Role::Zygote {
                // The zygote's control socket is the zygote's alone.
                sys::stdin_from_null().map_err(at("close the control socket"))?;
            }
            report(&Event::Init { pid: child });
            let ended = match keeper {
                Some(keeper) => keeper.run(child)?,
                None => loop {
                    match sys::waitpid(child, 0) {
                        Ok(Some((_, ended))) => break ended,
                        Ok(None) => continue,
                        Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
                        Err(err) => return Err(at("wait for the init")(err)),
                    }
                },
            };
            drop(alive_write);
            let (code, signal) = match ended {
                Ended::Exited(code) => (Some(code), None),
                Ended::Signaled(signal) => (None, Some(signal)),
            };
            report(&Event::InitEnded { code, signal });
            Ok(Outcome::Exit(match ended {
                Ended::Exited(code) => code,
                Ended::Signaled(signal) => 128 + signal,
            }))
        }
    }
}
