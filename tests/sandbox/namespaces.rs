//! What only the `namespaces` backend has, against real processes and a real ipykernel:
//! one attack per test (reading host secrets, writing outside the workspace, privileged
//! system calls, exhausting memory and pids), `kill` leaving no cgroup, dying with the
//! gateway, an unprivileged gateway, the helper dispatch, and the fixed paths of a venv over
//! another interpreter. The tests every backend passes are in `common`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cellgate::sandbox::{Limits, NamespacesSandbox, Sandbox, SANDBOX_INIT_ARG};
use serde_json::json;

use super::harness::{
    self, base_prefix_inside, command_spec, exit_of, python, require_root, runtime, Kernel,
    KernelDirs, Kind, PATIENCE,
};
use super::{MODE_VAR, OUT_VAR};

fn sandbox() -> NamespacesSandbox {
    harness::namespaces_sandbox()
}

async fn start_kernel(limits: Limits) -> Kernel {
    harness::start_kernel(Kind::Namespaces, limits).await
}

async fn start_kernel_with(python: PathBuf, limits: Limits) -> Kernel {
    harness::start_kernel_with(Kind::Namespaces, python, limits).await
}

/// Launches a python kernel-like process that starts a grandchild, writes the pids to the
/// file named by OUT_VAR, and waits to be killed.
pub fn gateway_mode() -> i32 {
    runtime().block_on(async {
        let out = PathBuf::from(std::env::var(OUT_VAR).expect("out file"));
        let sandbox = sandbox();
        let dirs = KernelDirs::new("gw");
        let code =
            "import subprocess, time\nsubprocess.Popen(['sleep', '1000'])\ntime.sleep(1000)\n";
        let spec = command_spec(
            &dirs,
            vec![python().display().to_string(), "-c".into(), code.into()],
            Limits::default(),
        );
        let launched = sandbox.launch(&spec).await.expect("launch");
        let pid = launched.handle.pid().expect("pid");
        std::fs::write(&out, format!("{pid}\n")).expect("write pids");
        tokio::time::sleep(Duration::from_secs(3600)).await;
        0
    })
}

/// Runs a few checks with the system Python in a sandbox, as whatever user runs this mode.
pub fn unprivileged_mode() -> i32 {
    runtime().block_on(async {
        let sandbox = sandbox();
        let dirs = KernelDirs::new("unpriv");
        let checks = r#"
import os, sys, ctypes, json, socket
status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.unshare(0x10000000)
result = {
    'uid': os.getuid(), 'gid': os.getgid(),
    'caps': status['CapEff'].strip(), 'nnp': status['NoNewPrivs'].strip(), 'seccomp': status['Seccomp'].strip(),
    'root_listing': os.path.exists('/root') and os.listdir('/root'),
    'shadow': os.path.exists('/etc/shadow'),
    'ifaces': [n for _, n in socket.if_nameindex()],
    'unshare': [rc, ctypes.get_errno()],
}
try:
    open('/usr/x', 'w'); result['write_usr'] = 'ok'
except OSError as e:
    result['write_usr'] = e.errno
open(os.path.join(os.getcwd(), 'ok'), 'w').write('ok')
print(json.dumps(result))
ok = (result['uid'] == 1000 and result['caps'] == '0000000000000000' and result['nnp'] == '1'
      and result['seccomp'] == '2' and not result['shadow'] and result['ifaces'] == ['lo']
      and result['unshare'] == [-1, 1] and result['write_usr'] != 'ok' and not result['root_listing'])
sys.exit(0 if ok else 3)
"#;
        let spec = command_spec(
            &dirs,
            vec!["/usr/bin/python3".into(), "-c".into(), checks.into()],
            Limits::default(),
        );
        let launched = match sandbox.launch(&spec).await {
            Ok(launched) => launched,
            Err(err) => {
                println!("launch failed: {err}");
                return 2;
            }
        };
        let report = exit_of(launched).await;
        println!("report: {report:?}");
        println!("log: {}", std::fs::read_to_string(&spec.log_file).unwrap_or_default());
        report.code.unwrap_or(100)
    })
}

/// The pid namespace of a host process, as the target of its /proc/PID/ns/pid link.
fn pid_namespace(pid: u32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

/// Host pids of every process in pid namespace `ns`.
fn processes_in(ns: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid_namespace(pid).as_deref() == Some(ns))
        .collect()
}

/// Waits until no process is left in pid namespace `ns`.
async fn wait_namespace_empty(ns: &Path, within: Duration) -> Vec<u32> {
    let deadline = Instant::now() + within;
    loop {
        let left = processes_in(ns);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filesystem_shows_only_the_sandbox_and_is_read_only_outside_workspace_and_tmp() {
    require_root("filesystem test");
    let marker = std::env::temp_dir().join(format!(
        "cellgate-host-marker-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::write(&marker, "host secret").expect("marker");
    let mut kernel = start_kernel(Limits {
        workspace_bytes: Some(64 << 20),
        ..Limits::default()
    })
    .await;
    let venv = python()
        .parent()
        .and_then(Path::parent)
        .expect("venv")
        .to_path_buf();
    let code = format!(
        r#"
import os, json, shutil, sys
def tryopen(p, mode='r'):
    try:
        with open(p, mode) as f:
            if 'r' in mode: f.read(1)
            else: f.write('x')
        return 'ok'
    except OSError as e:
        return e.errno
r = {{}}
r['shadow'] = tryopen('/etc/shadow')
r['marker'] = os.path.exists({marker:?})
r['sibling'] = os.path.exists({sibling:?})
r['runtime_listing'] = sorted(os.listdir({run:?}))
r['tmp_listing'] = sorted(os.listdir('/tmp'))
r['writes'] = {{p: tryopen(p, 'w') for p in ['/x', '/usr/x', '/etc/x', '/dev/x', '/proc/x', {venv_file:?}, '/root/x']}}
r['write_workspace'] = tryopen(os.path.join(os.getcwd(), 'f'), 'w')
r['write_tmp'] = tryopen('/tmp/f', 'w')
r['write_shm'] = tryopen('/dev/shm/f', 'w')
r['write_runtime'] = tryopen(os.path.join({run:?}, 'kernel-wrote-this'), 'w')
r['cwd'] = os.getcwd()
r['home'] = os.environ['HOME']
r['prefix'] = [sys.prefix, sys.base_prefix, sys.executable]
r['run_listing'] = sorted(os.listdir('/run'))
r['home_listing'] = sorted(os.listdir('/home'))
r['host_paths'] = {{p: os.path.exists(p) for p in [{host_run:?}, {host_work:?}, {venv_dir:?}]}}
r['exists'] = {{p: os.path.exists(p) for p in ['/var/run', '/sys/class', '/root', '/root/.bashrc',
    '/root/.cargo', '/work/main/Cargo.toml', '/etc/resolv.conf', '/etc/ld.so.cache', '/etc/ssl/certs', '/etc/ssl/private']}}
r['dev'] = sorted(os.listdir('/dev'))
r['ws_total'] = shutil.disk_usage(os.getcwd()).total
r['tmp_total'] = shutil.disk_usage('/tmp').total
r['sockets'] = [l.split()[-1] for l in open('/proc/net/unix').read().splitlines()[1:] if len(l.split()) > 7]
print(json.dumps(r))
"#,
        marker = marker.display().to_string(),
        sibling = kernel.dirs.sibling.display().to_string(),
        run = "/run/cellgate",
        venv_file = "/opt/cellgate/venv/x",
        host_run = kernel.dirs.run.display().to_string(),
        host_work = kernel.dirs.work.display().to_string(),
        venv_dir = venv.display().to_string(),
    );
    let out = kernel.execute(&code).await;
    let _ = std::fs::remove_file(&marker);
    assert_eq!(out.status, "ok", "{out:?}\nlog:\n{}", kernel.log());
    let r = out.json();
    println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());

    assert_eq!(
        r["shadow"],
        libc::ENOENT,
        "/etc/shadow must not exist in the sandbox"
    );
    // The host's paths of the runtime directory, workspace, venv and interpreter mean
    // nothing inside: everything is at fixed paths.
    for (path, exists) in r["host_paths"].as_object().expect("host paths") {
        assert_eq!(exists, false, "the host path {path} is visible inside");
    }
    assert_eq!(r["home"], "/home/user");
    assert_eq!(r["home_listing"], json!(["user"]));
    assert_eq!(r["run_listing"], json!(["cellgate"]));
    assert_eq!(
        r["prefix"],
        json!([
            "/opt/cellgate/venv",
            base_prefix_inside(),
            "/opt/cellgate/venv/bin/python"
        ]),
        "sys.prefix, sys.base_prefix, sys.executable"
    );
    assert_eq!(r["marker"], false, "host /tmp must be invisible");
    assert_eq!(
        r["sibling"], false,
        "other kernels' directories must be invisible"
    );
    assert_eq!(
        r["tmp_listing"],
        json!([]),
        "the sandbox's /tmp is its own and empty"
    );
    for (path, result) in r["writes"].as_object().expect("writes") {
        assert_ne!(result, "ok", "writing {path} must fail");
    }
    assert_eq!(r["write_workspace"], "ok");
    assert_eq!(r["write_tmp"], "ok");
    assert_eq!(r["write_shm"], "ok");
    assert_eq!(r["write_runtime"], "ok");
    assert_eq!(r["cwd"], "/home/user");
    for (path, exists) in r["exists"].as_object().expect("exists") {
        let expected = matches!(path.as_str(), "/etc/ld.so.cache" | "/etc/ssl/certs");
        assert_eq!(exists, expected, "{path} visible = {exists}");
    }
    assert_eq!(
        r["dev"],
        json!([
            "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout",
            "tty", "urandom", "zero"
        ])
    );
    assert_eq!(r["ws_total"], 64u64 << 20, "workspace is a 64 MiB tmpfs");
    assert_eq!(r["tmp_total"], 256u64 << 20, "private /tmp is 256 MiB");
    // Every unix socket the kernel can see is one of its own five.
    for socket in r["sockets"].as_array().expect("sockets") {
        let socket = socket.as_str().unwrap_or_default();
        assert!(
            socket.starts_with("/run/cellgate/") || socket.starts_with('@'),
            "unexpected unix socket visible: {socket}"
        );
    }
    // The runtime directory is the sandbox's own tmpfs, not the host's directory: the
    // gateway reaches it through the helper's root, where the kernel's files belong to the
    // unprivileged host id.
    let inside = Path::new(&kernel.launched.connection.ip)
        .parent()
        .expect("runtime directory")
        .join("kernel-wrote-this");
    assert!(
        inside.starts_with("/proc/"),
        "the gateway's way in: {}",
        inside.display()
    );
    let meta = std::fs::metadata(&inside).expect("file from the kernel");
    use std::os::unix::fs::MetadataExt;
    assert_eq!((meta.uid(), meta.gid()), (65534, 65534));
    let host_run = &kernel.spec.runtime_dir;
    assert!(
        !host_run.join("kernel-wrote-this").exists(),
        "the kernel wrote into the host's runtime directory"
    );
    // The host workspace directory is not the sandbox's: nothing appears there.
    assert!(!kernel.dirs.work.join("f").exists());
    kernel.stop().await;
}

/// A venv over an interpreter outside the system prefixes (the tools venv's, a pyenv build on
/// CI's machines) is shown at fixed paths: the base at `/opt/cellgate/python`, by an overlay
/// whose `mountinfo` line names no host path, with its shared libraries found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_venv_over_another_interpreter_is_shown_at_fixed_paths() {
    require_root("relocated interpreter test");
    let tools = std::env::var("CELLGATE_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-tools/bin/python"));
    let venv = tools.parent().and_then(Path::parent).expect("tools venv");
    let cfg = std::fs::read_to_string(venv.join("pyvenv.cfg")).expect("tools venv's pyvenv.cfg");
    let home = cfg
        .lines()
        .find_map(|l| l.split_once('=').filter(|(k, _)| k.trim() == "home"))
        .map(|(_, v)| v.trim().trim_end_matches("/bin").to_owned())
        .expect("home");
    assert!(
        !home.starts_with("/usr"),
        "this test needs a tools venv over an interpreter outside /usr (./dev setup makes it \
         with CELLGATE_PYTHON, python3 by default); {} is over {home}",
        venv.display()
    );
    let mut kernel = start_kernel_with(tools.clone(), Limits::default()).await;
    let out = kernel
        .execute(
            "import json, sys, ssl, sqlite3, ctypes\n\
             print(json.dumps({'base': sys.base_prefix, 'prefix': sys.prefix, \
             'mountinfo': open('/proc/self/mountinfo').read()}))",
        )
        .await;
    assert_eq!(out.status, "ok", "{out:?}\nlog:\n{}", kernel.log());
    let r = out.json();
    assert_eq!(r["base"], "/opt/cellgate/python");
    assert_eq!(r["prefix"], "/opt/cellgate/venv");
    let mountinfo = r["mountinfo"].as_str().expect("mountinfo");
    for host in [home.as_str(), &venv.display().to_string()] {
        assert!(
            !mountinfo.contains(host),
            "mountinfo names {host}:\n{mountinfo}"
        );
    }
    let base_mount = mountinfo
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/opt/cellgate/python"))
        .expect("a mount at /opt/cellgate/python");
    assert!(
        base_mount.contains(" - overlay "),
        "not an overlay: {base_mount}"
    );
    kernel.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileged_calls_are_denied_and_identity_is_unprivileged() {
    require_root("privileges test");
    let mut kernel = start_kernel(Limits::default()).await;
    let code = r#"
import ctypes, os, socket, json
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sys(nr, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if rc == 0 and nr == 56:  # a clone that succeeded: leave at once in the child
        os._exit(0)
    return [rc, ctypes.get_errno()]
def sock(*args):
    try:
        socket.socket(*args).close(); return 'ok'
    except OSError as e:
        return e.errno
buf = ctypes.create_string_buffer(256)
r = {
    'ptrace_traceme': sys(101, 0, 0, 0, 0),
    'ptrace_attach_init': sys(101, 16, 1, 0, 0),
    'process_vm_readv': sys(310, 1, 0, 0, 0, 0, 0),
    'unshare_user': sys(272, 0x10000000),
    'unshare_net': sys(272, 0x40000000),
    'unshare_mount': sys(272, 0x00020000),
    'setns': sys(308, 0, 0),
    'mount': [libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno()],
    'umount': [libc.umount2(b'/tmp', 2), ctypes.get_errno()],
    'fsopen': sys(430, ctypes.addressof(ctypes.create_string_buffer(b'tmpfs')), 0),
    'open_tree': sys(428, -100, ctypes.addressof(ctypes.create_string_buffer(b'/')), 1),
    'clone_newuser': sys(56, 0x10000000 | 17, 0, 0, 0, 0),
    'clone_newpid': sys(56, 0x20000000 | 17, 0, 0, 0, 0),
    'clone3': sys(435, 0, 0),
    'keyctl': sys(250, 0, 0, 0, 0, 0),
    'add_key': sys(248, 0, 0, 0, 0, 0),
    'bpf': sys(321, 0, 0, 0),
    'perf_event_open': sys(298, 0, 0, 0, 0, 0),
    'userfaultfd': sys(323, 0),
    'io_uring_setup': sys(425, 1, ctypes.addressof(buf)),
    'init_module': sys(175, 0, 0, 0),
    'finit_module': sys(313, 0, 0, 0),
    'kexec_load': sys(246, 0, 0, 0, 0),
    'chroot': sys(161, ctypes.addressof(ctypes.create_string_buffer(b'/tmp'))),
    'x32_getpid': sys(0x40000000 | 39),
    'af_packet': sock(17, socket.SOCK_RAW, 0),
    'af_vsock': sock(40, socket.SOCK_STREAM, 0),
    'raw_inet': sock(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
    'tcp': sock(socket.AF_INET, socket.SOCK_STREAM, 0),
    'unix': sock(socket.AF_UNIX, socket.SOCK_STREAM, 0),
    'uid': [os.getuid(), os.geteuid(), os.getgid(), os.getegid()],
    'groups': os.getgroups(),
}
pid = os.fork()
if pid == 0:
    os._exit(7)
r['fork'] = os.waitpid(pid, 0)[1] >> 8
status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())
for k in ['CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp', 'Seccomp_filters']:
    r[k] = status[k].strip()
r['hostname'] = os.uname().nodename
def attempt(f):
    try:
        f(); return 'ok'
    except OSError as e:
        return e.errno
# Landlock: /proc/self/comm is the process's own and writable by file permissions; only the
# Landlock ruleset (writes allowed under the workspace, /tmp, /dev and the runtime dir) refuses.
r['landlock_comm'] = attempt(lambda: open('/proc/self/comm', 'w').write('x'))
# The init holds nothing the kernel may reach: its environment, root and descriptors.
r['init_environ'] = attempt(lambda: open('/proc/1/environ', 'rb').read())
r['init_root'] = attempt(lambda: os.listdir('/proc/1/root'))
r['init_fds'] = attempt(lambda: os.listdir('/proc/1/fd'))
r['kill_init'] = attempt(lambda: os.kill(1, 9))
r['pid1'] = open('/proc/1/cmdline', 'rb').read().split(b'\0')[0].decode()
r['mypid'] = os.getpid()
print(json.dumps(r))
"#;
    let out = kernel.execute(code).await;
    assert_eq!(out.status, "ok", "{out:?}\nlog:\n{}", kernel.log());
    let r = out.json();
    println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
    let eperm = json!([-1, libc::EPERM]);
    for name in [
        "ptrace_traceme",
        "ptrace_attach_init",
        "process_vm_readv",
        "unshare_user",
        "unshare_net",
        "unshare_mount",
        "setns",
        "mount",
        "umount",
        "fsopen",
        "open_tree",
        "clone_newuser",
        "clone_newpid",
        "keyctl",
        "add_key",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "init_module",
        "finit_module",
        "kexec_load",
        "chroot",
    ] {
        assert_eq!(r[name], eperm, "{name} must fail with EPERM");
    }
    assert_eq!(
        r["clone3"],
        json!([-1, libc::ENOSYS]),
        "clone3 answers ENOSYS so libc falls back to clone"
    );
    assert_eq!(
        r["x32_getpid"],
        json!([-1, libc::ENOSYS]),
        "x32 system calls are refused"
    );
    for name in ["af_packet", "af_vsock", "raw_inet"] {
        assert_eq!(r[name], libc::EPERM, "{name} socket must be refused");
    }
    assert_eq!(r["tcp"], "ok");
    assert_eq!(r["unix"], "ok");
    assert_eq!(r["fork"], 7, "plain fork still works");
    assert_eq!(
        r["uid"],
        json!([1000, 1000, 1000, 1000]),
        "uid/gid 1000 inside, never 0"
    );
    assert_eq!(r["groups"], json!([]), "no supplementary groups");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(r[cap], "0000000000000000", "{cap}");
    }
    assert_eq!(r["NoNewPrivs"], "1");
    assert_eq!(r["Seccomp"], "2");
    assert_eq!(r["Seccomp_filters"], "2");
    assert_eq!(r["hostname"], "sandbox");
    assert_eq!(
        r["landlock_comm"],
        libc::EACCES,
        "Landlock refuses writes outside its rules"
    );
    for name in ["init_environ", "init_root", "init_fds"] {
        assert_eq!(r[name], libc::EACCES, "{name} must be out of reach");
    }
    assert_eq!(
        r["kill_init"],
        libc::EPERM,
        "signals to the init are refused (Landlock scope)"
    );
    assert_eq!(
        r["pid1"],
        std::env::current_exe().expect("exe").display().to_string(),
        "our init is PID 1"
    );
    assert_eq!(r["mypid"], 2, "the kernel is the init's first child");

    // Outside: the kernel runs as the unprivileged host id, not as root.
    let pid = kernel.launched.handle.pid().expect("pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("kernel status");
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).expect("Uid");
    assert_eq!(
        uid_line.split_whitespace().nth(1),
        Some("65534"),
        "{uid_line}"
    );
    kernel.stop().await;
}

/// The pids and memory tests need the kernel in a cgroup; as root on our hosts it is.
fn assert_in_cgroup(kernel: &Kernel) {
    let pid = kernel.launched.handle.pid().expect("pid");
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    assert!(
        cgroups
            .lines()
            .any(|l| l.contains(":memory:") && l.contains("/cellgate/")),
        "the kernel is not in a cellgate memory cgroup:\n{cgroups}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_kills_the_hungry_child_and_the_kernel_survives() {
    require_root("memory limit test");
    let mut kernel = start_kernel(Limits {
        memory_bytes: Some(256 << 20),
        // The memory cgroup holds memory + workspace (a RAM disk): 320 MiB here.
        workspace_bytes: Some(64 << 20),
        ..Limits::default()
    })
    .await;
    assert_in_cgroup(&kernel);
    let code = r#"
import subprocess, sys
p = subprocess.run([sys.executable, '-c', 'b = bytearray(400 * 1024 * 1024)\nfor i in range(0, len(b), 4096): b[i] = 1'])
print(p.returncode)
"#;
    let out = kernel.execute(code).await;
    assert_eq!(out.status, "ok", "{out:?}");
    assert_eq!(out.stdout.trim(), "-9", "the child is OOM-killed");
    let out = kernel.execute("1+1").await;
    assert_eq!(out.result.as_deref(), Some("2"), "the kernel survives");
    assert!(kernel
        .launched
        .handle
        .usage()
        .memory_bytes
        .is_some_and(|m| m > 0));

    // When the kernel itself is the victim, the exit report says so.
    let _ = kernel
        .send("execute_request", json!({"code": "b = bytearray(400 * 1024 * 1024)\nfor i in range(0, len(b), 4096): b[i] = 1", "silent": false}))
        .await;
    let report = exit_of(kernel.launched).await;
    assert_eq!(report.signal, Some(libc::SIGKILL), "{report:?}");
    assert!(
        report
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("out-of-memory")),
        "{report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pids_limit_stops_a_fork_loop() {
    require_root("pids limit test");
    let mut kernel = start_kernel(Limits {
        pids: Some(64),
        ..Limits::default()
    })
    .await;
    assert_in_cgroup(&kernel);
    let code = r#"
import os, time, json
kids, err = [], None
try:
    for i in range(500):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
except OSError as e:
    err = e.errno
for k in kids:
    os.kill(k, 9)
for k in kids:
    os.waitpid(k, 0)
print(json.dumps([len(kids), err]))
"#;
    let out = kernel.execute(code).await;
    assert_eq!(out.status, "ok", "{out:?}");
    let r = out.json();
    let forked = r[0].as_u64().expect("count");
    assert!(forked < 64, "forked {forked} processes under a limit of 64");
    assert_eq!(r[1], libc::EAGAIN, "fork fails with EAGAIN at the limit");
    let out = kernel.execute("1+1").await;
    assert_eq!(out.result.as_deref(), Some("2"), "the kernel survives");
    kernel.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_leaves_no_process_and_no_cgroup() {
    require_root("kill test");
    let mut kernel = start_kernel(Limits {
        memory_bytes: Some(512 << 20),
        ..Limits::default()
    })
    .await;
    let code = "import subprocess\np = subprocess.Popen(['sleep', '1000'], start_new_session=True)\nprint(p.pid)";
    let out = kernel.execute(code).await;
    assert_eq!(out.status, "ok", "{out:?}");
    let pid = kernel.launched.handle.pid().expect("pid");
    let ns = pid_namespace(pid).expect("pid namespace");
    assert!(
        processes_in(&ns).len() >= 3,
        "init, kernel and sleep are in the namespace"
    );
    let cgroup_line = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let memory_path = cgroup_line
        .lines()
        .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_owned()))
        .expect("memory cgroup");
    let cgroup_dir = PathBuf::from(format!("/sys/fs/cgroup/memory{memory_path}"));
    assert!(cgroup_dir.exists(), "{}", cgroup_dir.display());

    kernel.launched.handle.kill().expect("kill");
    let report = exit_of(kernel.launched).await;
    assert_eq!(report.signal, Some(libc::SIGKILL), "{report:?}");
    let left = wait_namespace_empty(&ns, PATIENCE).await;
    assert!(left.is_empty(), "processes survived kill(): {left:?}");
    assert!(!Path::new(&format!("/proc/{pid}")).exists());
    assert!(!cgroup_dir.exists(), "the cgroup is removed after the exit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_failures_are_errors_with_the_step() {
    require_root("launch failure test");
    let sandbox = sandbox();
    let dirs = KernelDirs::new("bad");
    let spec = command_spec(&dirs, vec!["/nonexistent/python".into()], Limits::default());
    let err = match sandbox.launch(&spec).await {
        Ok(_) => panic!("launching a missing program must fail"),
        Err(err) => err.to_string(),
    };
    assert!(err.contains("execve /nonexistent/python"), "{err}");
    let spec = command_spec(&dirs, vec!["python".into()], Limits::default());
    let err = sandbox
        .launch(&spec)
        .await
        .err()
        .expect("relative program")
        .to_string();
    assert!(err.contains("absolute"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_dies_with_the_gateway() {
    require_root("gateway death test");
    let _ = python();
    let out_dir = tempfile::tempdir().expect("tempdir");
    let out = out_dir.path().join("pids");
    let mut gateway = std::process::Command::new(std::env::current_exe().expect("exe"))
        .env(MODE_VAR, "namespaces-gateway")
        .env(OUT_VAR, &out)
        // Its kernel directories go inside ours: killed, it cannot remove them itself.
        .env("TMPDIR", out_dir.path())
        .stdin(std::process::Stdio::null())
        .spawn()
        .expect("spawn the stand-in gateway");
    let deadline = Instant::now() + Duration::from_secs(60);
    let pid: u32 = loop {
        if let Some(pid) = std::fs::read_to_string(&out)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break pid;
        }
        assert!(
            Instant::now() < deadline,
            "the stand-in gateway never launched its kernel"
        );
        assert!(
            gateway.try_wait().expect("try_wait").is_none(),
            "the stand-in gateway died"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ns = pid_namespace(pid).expect("kernel pid namespace");
    // A gateway killed with SIGKILL cannot remove the kernel's cgroups; this test does
    // (a later gateway would sweep them).
    let cgroups: Vec<PathBuf> = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controller, path) = (parts.next()?, parts.next()?, parts.next()?);
            (path.contains("/cellgate/") && !controller.is_empty())
                .then(|| PathBuf::from(format!("/sys/fs/cgroup/{controller}{path}")))
        })
        .collect();
    // Let the kernel start its grandchild.
    let deadline = Instant::now() + PATIENCE;
    while processes_in(&ns).len() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        processes_in(&ns).len() >= 3,
        "init, python and sleep should run"
    );

    gateway.kill().expect("SIGKILL the gateway");
    let _ = gateway.wait();
    let left = wait_namespace_empty(&ns, PATIENCE).await;
    assert!(left.is_empty(), "processes outlived the gateway: {left:?}");
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the python kernel is gone"
    );
    for dir in cgroups {
        let _ = std::fs::remove_dir(dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn works_for_an_unprivileged_gateway() {
    require_root("unprivileged test (it drops to nobody with setpriv)");
    assert!(
        Path::new("/usr/bin/setpriv").exists(),
        "setpriv (util-linux) is needed"
    );
    assert!(
        Path::new("/usr/bin/python3").exists(),
        "the system python3 is needed"
    );
    let exe = std::env::current_exe().expect("exe");
    let output = tokio::process::Command::new("/usr/bin/setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(&exe)
        .env(MODE_VAR, "namespaces-unprivileged")
        .env("TMPDIR", "/tmp")
        .output()
        .await
        .expect("run setpriv");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(
        output.status.code(),
        Some(0),
        "the sandbox checks failed as an unprivileged user"
    );
}

#[tokio::test]
async fn the_cellgate_binary_dispatches_the_sandbox_helper() {
    // `cellgate __sandbox-init` must reach `sandbox_init_main` before anything else; it then
    // reads a plan from stdin and reports a failed parse of this one on stdout.
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .arg(SANDBOX_INIT_ARG)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn cellgate");
    let mut stdin = child.stdin.take().expect("stdin");
    let _ = stdin.write_all(b"not a plan\n").await;
    drop(stdin);
    let output = tokio::time::timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("cellgate __sandbox-init did not end within a minute")
        .expect("wait");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(r#""event":"failed""#) && stdout.contains("parse plan"),
        "`cellgate {SANDBOX_INIT_ARG}` does not run the sandbox helper (main.rs must call \
         cellgate::sandbox::sandbox_init_main() when argv[1] is {SANDBOX_INIT_ARG:?}); stdout: {stdout:?}, stderr: {:?}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_output_reaches_the_log_through_a_pipe() {
    require_root("log test");
    let sandbox = sandbox();
    let dirs = KernelDirs::new("log");
    let script = "echo to-stdout; echo to-stderr >&2; echo reopened > /dev/stderr; \
                  echo \"fd1=$(readlink /proc/self/fd/1)\"";
    let spec = command_spec(
        &dirs,
        vec!["/bin/sh".into(), "-c".into(), script.into()],
        Limits::default(),
    );
    let launched = sandbox.launch(&spec).await.expect("launch");
    let report = exit_of(launched).await;
    assert_eq!(report.code, Some(0), "{report:?}");
    let log = std::fs::read_to_string(&spec.log_file).expect("log");
    for line in ["to-stdout", "to-stderr", "reopened"] {
        assert!(
            log.lines().any(|l| l == line),
            "{line:?} missing from the log:\n{log}"
        );
    }
    // A pipe, not the host's log file: its path stays unknown inside.
    assert!(log.contains("fd1=pipe:["), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scientific_stack_works_inside() {
    require_root("scientific stack test");
    let mut kernel = start_kernel(Limits {
        memory_bytes: Some(1 << 30),
        pids: Some(256),
        cpu_millis: Some(1000),
        ..Limits::default()
    })
    .await;
    let code = r#"
import json, os, multiprocessing, io
import numpy as np, pandas as pd, scipy.linalg, psutil
import matplotlib
matplotlib.use('agg')
import matplotlib.pyplot as plt
r = {}
a = np.random.default_rng(0).random((256, 256))
r['matmul'] = float(np.trace(a @ np.eye(256)) - np.trace(a)) == 0.0
r['groupby'] = int(pd.DataFrame({'k': [1, 1, 2], 'v': [1, 2, 3]}).groupby('k').v.sum().loc[1])
r['inv'] = bool(np.allclose(scipy.linalg.inv(np.eye(3) * 2), np.eye(3) / 2))
fig, ax = plt.subplots(); ax.plot([1, 2, 3]); buf = io.BytesIO(); fig.savefig(buf, format='png')
r['png'] = buf.getvalue()[:4] == b'\x89PNG'
r['cpus'] = [os.cpu_count(), psutil.cpu_count()]
r['psutil_self'] = psutil.Process().username()
with multiprocessing.Pool(2) as pool:
    r['pool'] = pool.map(abs, [-1, -2, -3])
r['ssl'] = __import__('ssl').create_default_context().cert_store_stats()['x509_ca'] > 0
print(json.dumps(r))
"#;
    let out = kernel.execute(code).await;
    assert_eq!(out.status, "ok", "{out:?}\nlog:\n{}", kernel.log());
    let r = out.json();
    println!("{r}");
    assert_eq!(r["matmul"], true);
    assert_eq!(r["groupby"], 3);
    assert_eq!(r["inv"], true);
    assert_eq!(r["png"], true);
    assert_eq!(r["psutil_self"], "kernel");
    assert_eq!(r["pool"], json!([1, 2, 3]));
    assert_eq!(r["ssl"], true, "CA certificates are readable");
    kernel.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_limit_caps_cpu_time() {
    require_root("cpu limit test");
    let mut kernel = start_kernel(Limits {
        cpu_millis: Some(250),
        ..Limits::default()
    })
    .await;
    let code = r#"
import time, json
wall0, cpu0 = time.monotonic(), time.process_time()
while time.monotonic() - wall0 < 2.0:
    pass
print(json.dumps([time.monotonic() - wall0, time.process_time() - cpu0]))
"#;
    let out = kernel.execute(code).await;
    assert_eq!(out.status, "ok", "{out:?}");
    let r = out.json();
    let (wall, cpu) = (r[0].as_f64().expect("wall"), r[1].as_f64().expect("cpu"));
    println!("busy loop: {wall:.2} s wall, {cpu:.2} s CPU under a quarter-CPU limit");
    assert!(
        cpu <= wall * 0.25 + 0.2,
        "{cpu} s of CPU in {wall} s wall under a 250 millicpu limit"
    );
    let usage = kernel.launched.handle.usage();
    assert!(
        usage.cpu_time.is_some_and(|t| t > Duration::ZERO),
        "{usage:?}"
    );
    kernel.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_named_in_the_command_are_shown_alone() {
    require_root("command files test");
    let scripts = tempfile::tempdir().expect("tempdir");
    let script = scripts.path().join("kernel_script.py");
    let neighbour = scripts.path().join("neighbour-secret.txt");
    std::fs::write(&neighbour, "not for the kernel").expect("neighbour");
    std::fs::write(
        &script,
        format!(
            "import os, sys\nsys.exit(0 if not os.path.exists({:?}) else 5)\n",
            neighbour.display().to_string()
        ),
    )
    .expect("script");
    let sandbox = sandbox();
    let dirs = KernelDirs::new("script");
    let spec = command_spec(
        &dirs,
        vec!["/usr/bin/python3".into(), script.display().to_string()],
        Limits::default(),
    );
    let launched = sandbox.launch(&spec).await.expect("launch");
    let report = exit_of(launched).await;
    assert_eq!(
        report.code,
        Some(0),
        "{report:?}: the script must run and its neighbour stay invisible; log:\n{}",
        std::fs::read_to_string(&spec.log_file).unwrap_or_default()
    );
}

/// The kernel's parent is the sandbox's init, whose parent is the helper; what they cost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kernel_runs_under_the_init_and_the_helper() {
    require_root("sandbox machinery test");
    let kernel = start_kernel(Limits::default()).await;
    // What the sandbox machinery costs: the init (the kernel's parent) and the helper.
    let status =
        |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |pid: u32, name: &str| {
        status(pid)
            .lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
            .unwrap_or_default()
    };
    let kernel_pid = kernel.launched.handle.pid().expect("pid");
    let init_pid: u32 = field(kernel_pid, "PPid:").parse().expect("init pid");
    let helper_pid: u32 = field(init_pid, "PPid:").parse().expect("helper pid");
    println!(
        "RSS: kernel {}, init {}, helper {}",
        field(kernel_pid, "VmRSS:"),
        field(init_pid, "VmRSS:"),
        field(helper_pid, "VmRSS:")
    );
    kernel.stop().await;
}
