//! The egress bridge: the sandbox's only way to the gateway's egress proxy.
//!
//! The sandbox's network namespace has loopback only. When the plan names an egress socket
//! (the proxy's unix socket in the kernel's host runtime directory, opened by the init with
//! `O_PATH` before it left the host's file system, and reached as `/proc/self/fd/N`: a
//! descriptor the kernel does not inherit, where a bind would show a host path), the init binds 127.0.0.1:3128 before it forks the kernel, so the port is there
//! from the kernel's first instruction, and forks this bridge: a plain uid 1000 process with
//! no capabilities, the kernel's Landlock ruleset and seccomp filter, that copies each TCP
//! connection to a fresh connection on the unix socket. It decides nothing: the proxy on the
//! other end knows the session from the socket alone and applies the policy.
//!
//! Blocking threads, one per direction of a connection: the bridge runs no async runtime,
//! stays tiny, and is capped at [`MAX_CONNECTIONS`] so it cannot eat the sandbox's pids limit.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use seccompiler::BpfProgram;

use super::landlock;
use super::plan::Plan;
use super::seccomp;
use super::sys;

/// Connections bridged at once; the proxy has its own, lower per-session cap.
pub const MAX_CONNECTIONS: usize = 64;
/// Where the bridge listens inside the sandbox.
pub const LISTEN: &str = "127.0.0.1:3128";

/// Binds the bridge's port (in the init, before the kernel exists).
pub fn bind() -> std::io::Result<TcpListener> {
    TcpListener::bind(LISTEN)
}

/// Runs the bridge in a forked child of the init; never returns.
pub fn run(plan: &Plan, programs: &[BpfProgram], listener: TcpListener, proxy: OwnedFd) -> ! {
    if let Err(err) = confine(plan, programs, &[listener.as_raw_fd(), proxy.as_raw_fd()]) {
        eprintln!("cellgate egress bridge: {err}");
        sys::exit_now(126);
    }
    // `proxy` stays open for the bridge's life: every connection goes through it.
    let mut socket = PathBuf::from(format!("/proc/self/fd/{}", proxy.as_raw_fd()));
    // A kept sandbox's descriptor is the socket's directory (see `pid1.rs`).
    if let (Some(_), Some(name)) = (
        &plan.keep,
        plan.egress_socket.as_deref().and_then(Path::file_name),
    ) {
        socket.push(name);
    }
    let active = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if active.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
            drop(stream);
            continue;
        }
        active.fetch_add(1, Ordering::Relaxed);
        let (active, socket) = (active.clone(), socket.clone());
        let spawned = std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || {
                bridge(stream, &socket);
                active.fetch_sub(1, Ordering::Relaxed);
            });
        if spawned.is_err() {
            // Out of threads (pids limit): the connection is dropped, the bridge lives on.
            continue;
        }
    }
    sys::exit_now(0)
}

fn confine(plan: &Plan, programs: &[BpfProgram], keep: &[i32]) -> Result<(), String> {
    sys::reset_signals().map_err(|e| format!("reset signals: {e}"))?;
    sys::set_parent_death_signal(libc::SIGKILL).map_err(|e| format!("pdeathsig: {e}"))?;
    // stdout is the init's event channel to the gateway: never the bridge's.
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| format!("open /dev/null: {e}"))?;
    sys::dup2(null.as_raw_fd(), 0).map_err(|e| format!("stdin: {e}"))?;
    sys::dup2(null.as_raw_fd(), 1).map_err(|e| format!("stdout: {e}"))?;
    drop(null);
    sys::set_no_new_privs().map_err(|e| format!("no_new_privs: {e}"))?;
    if plan.landlock {
        landlock::restrict(plan).map_err(|e| format!("landlock: {e}"))?;
    }
    sys::close_all_above_stdio_except(keep).map_err(|e| format!("close fds: {e}"))?;
    seccomp::install(programs).map_err(|e| format!("seccomp: {e}"))
}

fn bridge(tcp: TcpStream, socket: &Path) {
    let Ok(unix) = UnixStream::connect(socket) else {
        return;
    };
    let (Ok(tcp_read), Ok(unix_write)) = (tcp.try_clone(), unix.try_clone()) else {
        return;
    };
    let upstream = std::thread::Builder::new()
        .stack_size(64 << 10)
        .spawn(move || {
            copy(tcp_read, unix_write, |s| {
                let _ = s.shutdown(Shutdown::Write);
            })
        });
    copy(unix, tcp, |s| {
        let _ = s.shutdown(Shutdown::Write);
    });
    if let Ok(handle) = upstream {
        let _ = handle.join();
    }
}

fn copy<R: Read, W: Write>(mut from: R, mut to: W, done: impl FnOnce(&W)) {
    let mut buf = [0u8; 16 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    done(&to);
}
