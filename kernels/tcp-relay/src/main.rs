//! `cellgate-tcp-kernel`: runs a Jupyter kernel that binds TCP only (Deno's) behind the ipc
//! endpoints a cellgate sandbox gives its kernel.
//!
//! A cellgate sandbox hands its kernel an `ipc` connection file: the sockets live in the
//! sandbox's runtime directory, which the gateway reaches from outside, while the sandbox's
//! network (its own loopback) is out of the gateway's reach. Deno's kernel refuses an ipc
//! connection file. ZMTP is the same byte stream over both transports, so this program binds
//! the ipc socket paths itself, starts the kernel with a TCP connection file on the
//! sandbox's own loopback, and copies bytes between each connection the gateway makes and
//! the kernel's TCP port. It never parses a message: signatures and content pass untouched.
//! Written here, with std and libc only, because no crate does this and it must start in
//! any sandbox (namespaces, gVisor, a microVM, a pod) with nothing else installed.
//!
//! Usage: `cellgate-tcp-kernel CONNECTION_FILE -- PROGRAM ARGS...`, where
//! `{tcp_connection_file}` in ARGS becomes the TCP connection file written beside
//! CONNECTION_FILE. A connection file that already says `tcp` is passed on as it is.
//! SIGINT (the kernel's interrupt), SIGTERM and SIGHUP are passed to the kernel, and its
//! exit status is this program's.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The placeholder in the kernel's arguments for the TCP connection file.
const PLACEHOLDER: &str = "{tcp_connection_file}";
/// The connection file's port fields, in Jupyter's order.
const PORTS: [&str; 5] = [
    "shell_port",
    "iopub_port",
    "stdin_port",
    "control_port",
    "hb_port",
];
/// How long a connection from the gateway waits for the kernel to bind its port: the
/// gateway connects as soon as the kernel process exists, long before Deno has started.
const KERNEL_BIND_WAIT: Duration = Duration::from_secs(120);
/// The signals passed on to the kernel.
const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(err) => {
            eprintln!("cellgate-tcp-kernel: {err}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<ExitCode, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (connection_file, command) = match args.as_slice() {
        [file, dashes, program, rest @ ..] if dashes == "--" => {
            (PathBuf::from(file), (program.clone(), rest.to_vec()))
        }
        _ => {
            return Err("usage: cellgate-tcp-kernel CONNECTION_FILE -- PROGRAM ARGS...".to_owned())
        }
    };
    let text = std::fs::read_to_string(&connection_file)
        .map_err(|err| format!("cannot read {}: {err}", connection_file.display()))?;
    let info: Value = serde_json::from_str(&text)
        .map_err(|err| format!("{} is no connection file: {err}", connection_file.display()))?;
    if info["transport"] == "tcp" {
        let args = with_file(&command.1, &connection_file);
        let err = Command::new(&command.0).args(args).exec();
        return Err(format!("cannot run {}: {err}", command.0));
    }
    let prefix = info["ip"]
        .as_str()
        .ok_or("the connection file has no ipc path prefix (ip)")?
        .to_owned();
    let mut routes = Vec::with_capacity(PORTS.len());
    let mut tcp_info = info.clone();
    // Each port picked by binding it, all held until every one is picked so they differ;
    // then freed for the kernel. Nothing else binds in the sandbox's own network meanwhile.
    let mut held = Vec::with_capacity(PORTS.len());
    for field in PORTS {
        let ipc_port = info[field]
            .as_u64()
            .ok_or_else(|| format!("the connection file has no {field}"))?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .map_err(|err| format!("cannot find a free loopback port: {err}"))?;
        let tcp_port = listener
            .local_addr()
            .map_err(|err| format!("cannot read a loopback port: {err}"))?
            .port();
        held.push(listener);
        tcp_info[field] = Value::from(tcp_port);
        routes.push((PathBuf::from(format!("{prefix}-{ipc_port}")), tcp_port));
    }
    drop(held);
    tcp_info["transport"] = Value::from("tcp");
    tcp_info["ip"] = Value::from("127.0.0.1");
    let tcp_file = PathBuf::from(format!("{}.tcp.json", connection_file.display()));
    write_private(&tcp_file, &tcp_info)?;

    // Blocked before any thread starts, so every thread inherits the mask and the signals
    // wait for `sigwait` below; the kernel gets the default mask back before it runs.
    let forwarded = signal_set();
    block(&forwarded)?;
    let mut kernel = Command::new(&command.0);
    kernel.args(with_file(&command.1, &tcp_file));
    unblock_in_child(&mut kernel);
    let mut child = kernel
        .spawn()
        .map_err(|err| format!("cannot run {}: {err}", command.0))?;
    let pid = child.id();
    for (path, port) in routes {
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)
            .map_err(|err| format!("cannot bind {}: {err}", path.display()))?;
        std::thread::spawn(move || accept_loop(listener, port));
    }
    std::thread::spawn(move || forward_signals(forwarded, pid));
    let status = child
        .wait()
        .map_err(|err| format!("cannot wait for the kernel: {err}"))?;
    let _ = std::fs::remove_file(&tcp_file);
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        // As a shell reports it: the gateway's log says which signal ended the kernel.
        (None, Some(signal)) => ExitCode::from(u8::try_from(128 + signal).unwrap_or(1)),
        (None, None) => ExitCode::from(1),
    })
}

fn with_file(args: &[String], file: &Path) -> Vec<String> {
    let file = file.display().to_string();
    args.iter()
        .map(|arg| arg.replace(PLACEHOLDER, &file))
        .collect()
}

/// Written readable by its owner only: it holds the kernel's signing key.
fn write_private(path: &Path, info: &Value) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|err| format!("cannot write {}: {err}", path.display()))?;
    file.write_all(info.to_string().as_bytes())
        .map_err(|err| format!("cannot write {}: {err}", path.display()))
}

fn accept_loop(listener: UnixListener, port: u16) {
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                std::thread::spawn(move || relay(stream, port));
            }
            Err(err) => {
                eprintln!("cellgate-tcp-kernel: accept on the ipc socket for port {port}: {err}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// One connection of the gateway's, joined to a new connection to the kernel's port.
fn relay(gateway: UnixStream, port: u16) {
    let deadline = Instant::now() + KERNEL_BIND_WAIT;
    let kernel = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(err) => {
                eprintln!("cellgate-tcp-kernel: the kernel never bound port {port}: {err}");
                return;
            }
        }
    };
    // Small messages (a heartbeat, a status) must not wait for more bytes.
    let _ = kernel.set_nodelay(true);
    let (Ok(gateway_read), Ok(kernel_read)) = (gateway.try_clone(), kernel.try_clone()) else {
        return;
    };
    let upstream = std::thread::spawn(move || {
        copy(gateway_read, &kernel);
        let _ = kernel.shutdown(Shutdown::Write);
    });
    copy(kernel_read, &gateway);
    let _ = gateway.shutdown(Shutdown::Write);
    let _ = upstream.join();
}

fn copy(mut from: impl Read, mut to: impl Write) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

#[allow(unsafe_code)]
fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset and sigaddset only write the set they are given, a local here.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in FORWARDED {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

#[allow(unsafe_code)]
fn block(set: &libc::sigset_t) -> Result<(), String> {
    // SAFETY: changes this thread's signal mask only, from a valid set; no pointer escapes.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, set, std::ptr::null_mut()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!(
            "cannot block signals: {}",
            io::Error::from_raw_os_error(rc)
        ))
    }
}

#[allow(unsafe_code)]
fn unblock_in_child(command: &mut Command) {
    let set = signal_set();
    // SAFETY: runs in the forked child before exec, where only async-signal-safe calls are
    // allowed: sigprocmask is one, and `set` was built before the fork.
    unsafe {
        command.pre_exec(move || {
            if libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        });
    }
}

#[allow(unsafe_code)]
fn forward_signals(set: libc::sigset_t, pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    loop {
        let mut signal: libc::c_int = 0;
        // SAFETY: sigwait reads the set and writes the signal number into a local.
        let rc = unsafe { libc::sigwait(&set, &mut signal) };
        if rc != 0 {
            continue;
        }
        // SAFETY: kill takes plain integers; the child is ours and is reaped only by the
        // main thread, after which this process exits.
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_placeholder_becomes_the_file() {
        let args = vec!["--conn".to_owned(), PLACEHOLDER.to_owned()];
        assert_eq!(
            with_file(&args, Path::new("/run/cellgate/k.json.tcp.json")),
            vec!["--conn", "/run/cellgate/k.json.tcp.json"]
        );
    }

    #[test]
    fn bytes_pass_both_ways_once_the_kernel_binds() {
        let dir = std::env::temp_dir().join(format!("tcp-kernel-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("k-1");
        let _ = std::fs::remove_file(&path);
        // A port picked now, bound only later: the relay must wait for it.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || accept_loop(listener, port));
        let mut gateway = UnixStream::connect(&path).unwrap();
        gateway.write_all(b"ping").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let kernel = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let (mut conn, _) = kernel.accept().unwrap();
        let mut got = [0u8; 4];
        conn.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
        conn.write_all(b"pong").unwrap();
        gateway.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
