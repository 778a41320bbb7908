//! Running a container. The first process (`setpriv --pdeathsig KILL` → `nsenter` into
//! the pod's network namespace → `unshare` of new pid, mount, UTS and IPC namespaces →
//! the outer script; one pid, root) builds the container's root (see `rootfs`) in the new
//! mount namespace and reaps the container; its first child is pid 1 of the new pid
//! namespace, which mounts /proc, pivots into the root and execs the entrypoint through
//! `setpriv` with the container's user, groups, capabilities and no_new_privs: the
//! entrypoint is pid 1, as in a real container, and its exit status (128 + the signal
//! when killed) is the outer script's. (`unshare --fork --kill-child` would be simpler,
//! but util-linux 2.38's unshare exits 1 instead of dying of its child's SIGKILL.)
//!
//! Nothing outlives the test process: the first process dies with the double's runtime
//! thread that forked it (its death signal); pid 1 has its own death signal on the outer
//! script (set again by `setpriv --pdeathsig keep` after its credentials change, which
//! clears it); and pid 1's death ends its whole pid namespace.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use base64::Engine;
use rustix::process::{kill_process, Pid, Signal};

use super::rootfs::{Entry, Op, RootFs};

/// Everything a container start needs, resolved.
pub struct Spec {
    /// The pod's state directory on the host (script, marker, shadow staging).
    pub state_dir: PathBuf,
    pub netns: String,
    pub hostname: String,
    pub rootfs: RootFs,
    pub read_only_root: bool,
    pub workdir: String,
    pub env: Vec<(String, String)>,
    pub argv: Vec<String>,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub no_new_privs: bool,
    /// The bounding set (setpriv's lowercase names); empty: none.
    pub capabilities: Vec<String>,
}

fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// `"$R"'/path'`: a container path under the root being built.
fn under_root(path: &str) -> String {
    if path == "/" {
        "\"$R\"".to_owned()
    } else {
        format!("\"$R\"{}", quote(path))
    }
}

fn render_op(op: &Op, state_dir: &Path, out: &mut String) {
    let line = match op {
        Op::Mkdir { path, mode } => format!("mkdir -m {mode:o} {}", under_root(path)),
        Op::Touch { path } => format!(": > {}", under_root(path)),
        Op::Symlink { path, target } => {
            format!("ln -s {} {}", quote(target), under_root(path))
        }
        Op::Bind {
            source,
            path,
            read_only,
        } => format!(
            "mount --bind{} {} {}",
            if *read_only { " -o ro" } else { "" },
            quote(&source.to_string_lossy()),
            under_root(path)
        ),
        Op::Tmpfs { path, options } => format!(
            "mount -t tmpfs -o {} cgk-tmpfs {}",
            quote(options),
            under_root(path)
        ),
        Op::Special {
            path,
            fstype,
            options,
        } => format!(
            "mount -t {fstype} -o {} {fstype} {}",
            quote(options),
            under_root(path)
        ),
        Op::Write {
            path,
            data,
            mode,
            gid,
        } => {
            let encoded = base64::engine::general_purpose::STANDARD.encode(data);
            let target = under_root(path);
            let mut line = format!(
                "printf '%s' {} | base64 -d > {target}\nchmod {mode:o} {target}",
                quote(&encoded)
            );
            if let Some(gid) = gid {
                line.push_str(&format!("\nchgrp {gid} {target}"));
            }
            line
        }
        Op::ReadOnly { path } => format!("mount -o remount,bind,ro {}", under_root(path)),
        Op::Shadow {
            path,
            mode,
            entries,
            staging,
        } => {
            let stage = quote(
                &state_dir
                    .join(format!("shadow/{staging}"))
                    .to_string_lossy(),
            );
            let mut lines = vec![
                format!("mkdir -p {stage}"),
                format!("mount --rbind {} {stage}", under_root(path)),
                format!(
                    "mount -t tmpfs -o mode={mode:o} cgk-shadow {}",
                    under_root(path)
                ),
            ];
            for (name, entry) in entries {
                let target = under_root(&format!("{path}/{name}"));
                let kept = format!("{stage}/{}", quote(name));
                match entry {
                    Entry::Dir => {
                        lines.push(format!("mkdir {target}"));
                        lines.push(format!("mount --rbind {kept} {target}"));
                    }
                    Entry::File => {
                        lines.push(format!(": > {target}"));
                        lines.push(format!("mount --rbind {kept} {target}"));
                    }
                    Entry::Symlink(link) => lines.push(format!("ln -s {} {target}", quote(link))),
                }
            }
            lines.push(format!("umount -l {stage}"));
            lines.join("\n")
        }
    };
    out.push_str(&line);
    out.push('\n');
}

/// The two scripts of a start. The outer one runs in the host's pid namespace (in the
/// pod's new mount, UTS and IPC namespaces), so it can reap pid 1 and exit with its real
/// status; its first child is pid 1 of the new pid namespace (the inner script), which
/// waits on a fifo while the outer script builds the root, then mounts /proc, pivots into
/// the root and execs the entrypoint.
pub fn scripts(
    spec: &Spec,
    root: &Path,
    marker: &Path,
    go: &Path,
    inner_path: &Path,
) -> (String, String) {
    let root = quote(&root.to_string_lossy());
    let go = quote(&go.to_string_lossy());
    let mut outer = String::from("set -eu\n");
    outer.push_str(&format!("R={root}\n"));
    // First child, so pid 1 of the new pid namespace; it dies with this shell.
    outer.push_str(&format!(
        "/usr/bin/setpriv --pdeathsig KILL -- /bin/sh {} &\nPID1=$!\n",
        quote(&inner_path.to_string_lossy())
    ));
    outer.push_str("mount -t tmpfs -o mode=0755 cgk-root \"$R\"\n");
    for op in spec.rootfs.ops() {
        render_op(op, &spec.state_dir, &mut outer);
    }
    outer.push_str(&format!("hostname {}\n", quote(&spec.hostname)));
    outer.push_str(&format!("echo go > {go}\n"));
    outer.push_str("wait \"$PID1\"\n");

    let mut inner = String::from("set -eu\n");
    inner.push_str(&format!("R={root}\n"));
    inner.push_str(&format!("exec 3> {}\n", quote(&marker.to_string_lossy())));
    inner.push_str(&format!("read go < {go}\n[ \"$go\" = go ]\n"));
    inner.push_str("mount -t proc -o nosuid,nodev,noexec proc \"$R\"/proc\n");
    inner.push_str("cd \"$R\"\nmkdir .pivot-root\npivot_root . .pivot-root\ncd /\n");
    inner.push_str("umount -l /.pivot-root\nrmdir /.pivot-root\n");
    if spec.read_only_root {
        inner.push_str("mount -o remount,bind,ro /\n");
    }
    inner.push_str(&format!("cd {}\n", quote(&spec.workdir)));
    inner.push_str("echo started >&3\nexec 3>&-\n");
    let mut exec = vec![
        "exec".to_owned(),
        "/usr/bin/env".to_owned(),
        "-i".to_owned(),
    ];
    exec.extend(spec.env.iter().map(|(k, v)| quote(&format!("{k}={v}"))));
    exec.push("/usr/bin/setpriv".to_owned());
    exec.push(format!("--reuid={}", spec.uid));
    exec.push(format!("--regid={}", spec.gid));
    if spec.groups.is_empty() {
        exec.push("--clear-groups".to_owned());
    } else {
        let groups: Vec<String> = spec.groups.iter().map(u32::to_string).collect();
        exec.push(format!("--groups={}", groups.join(",")));
    }
    if spec.no_new_privs {
        exec.push("--no-new-privs".to_owned());
    }
    exec.push("--inh-caps=-all".to_owned());
    let mut bounding = vec!["-all".to_owned()];
    bounding.extend(spec.capabilities.iter().map(|c| format!("+{c}")));
    exec.push(format!("--bounding-set={}", bounding.join(",")));
    exec.push("--pdeathsig=keep".to_owned());
    exec.push("--".to_owned());
    exec.extend(spec.argv.iter().map(|a| quote(a)));
    inner.push_str(&exec.join(" "));
    inner.push('\n');
    (outer, inner)
}

/// A running (or finished) container.
pub struct Container {
    child: tokio::process::Child,
    marker: PathBuf,
    pid1: Option<u32>,
    exit: Option<i32>,
}

impl Container {
    /// Starts the container; its output goes to `log`.
    pub fn start(spec: &Spec, log: &Path) -> Result<Container, String> {
        let root = spec.state_dir.join("root");
        let marker = spec.state_dir.join("started");
        let go = spec.state_dir.join("go");
        let outer_path = spec.state_dir.join("outer.sh");
        let inner_path = spec.state_dir.join("inner.sh");
        std::fs::create_dir_all(&root).map_err(|err| format!("{}: {err}", root.display()))?;
        let _ = std::fs::remove_file(&go);
        rustix::fs::mkfifoat(rustix::fs::CWD, &go, rustix::fs::Mode::from_raw_mode(0o600))
            .map_err(|err| format!("{}: {err}", go.display()))?;
        let (outer, inner) = scripts(spec, &root, &marker, &go, &inner_path);
        for (path, text) in [(&outer_path, outer), (&inner_path, inner)] {
            std::fs::write(path, text).map_err(|err| format!("{}: {err}", path.display()))?;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|err| format!("{}: {err}", log.display()))?;
        let log_too = log.try_clone().map_err(|err| err.to_string())?;
        let child = tokio::process::Command::new("/usr/bin/setpriv")
            .args(["--pdeathsig", "KILL", "--", "/usr/bin/nsenter"])
            .arg(format!("--net=/run/netns/{}", spec.netns))
            .args([
                "--",
                "/usr/bin/unshare",
                "--pid",
                "--mount",
                "--uts",
                "--ipc",
                "--propagation",
                "private",
                "--",
                "/bin/sh",
            ])
            .arg(&outer_path)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_too)
            .kill_on_drop(true)
            .spawn()
            .map_err(|err| format!("starting the container: {err}"))?;
        Ok(Container {
            child,
            marker,
            pid1: None,
            exit: None,
        })
    }

    /// Waits until the entrypoint is about to run (Ok), or the setup failed (its exit
    /// code).
    pub async fn wait_started(&mut self) -> Result<(), i32> {
        loop {
            if std::fs::read_to_string(&self.marker).is_ok_and(|m| m.starts_with("started")) {
                self.pid1 = self.find_pid1();
                return Ok(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                let code = exit_code(status);
                self.exit = Some(code);
                return Err(code);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The host pid of the container's pid 1.
    pub fn pid(&self) -> Option<u32> {
        self.pid1
    }

    /// pid 1 is the only child of the first process (the outer script) once the root is
    /// built.
    fn find_pid1(&self) -> Option<u32> {
        let parent = self.child.id()?;
        std::fs::read_dir("/proc")
            .ok()?
            .flatten()
            .find_map(|entry| {
                let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                let ppid: u32 = stat
                    .rsplit_once(')')?
                    .1
                    .split_whitespace()
                    .nth(1)?
                    .parse()
                    .ok()?;
                (ppid == parent).then_some(pid)
            })
    }

    /// Sends SIGTERM to pid 1 (which, as in a real container, ignores it unless it
    /// handles it).
    pub fn terminate(&self) {
        if let Some(pid) = self.pid1.and_then(|p| Pid::from_raw(p as i32)) {
            let _ = kill_process(pid, Signal::TERM);
        }
    }

    /// SIGKILL to pid 1 (the pid namespace dies with it; the outer script reaps it and
    /// exits with its status), or to the outer script if pid 1 is not known yet (pid 1's
    /// death signal then kills it).
    pub fn kill(&mut self) {
        match self.pid1.and_then(|p| Pid::from_raw(p as i32)) {
            Some(pid) => {
                let _ = kill_process(pid, Signal::KILL);
            }
            None => {
                let _ = self.child.start_kill();
            }
        }
    }

    /// The exit code: the entrypoint's, or 128 + the signal that killed it.
    pub async fn wait(&mut self) -> i32 {
        if let Some(code) = self.exit {
            return code;
        }
        let code = match self.child.wait().await {
            Ok(status) => exit_code(status),
            Err(_) => 137,
        };
        // pid 1 was reaped by the outer script, unless that one died first: then wait
        // for the orphan to be gone too, so "exited" means no process is left.
        if let Some(pid) = self.pid1 {
            for _ in 0..200 {
                let state = std::fs::read_to_string(format!("/proc/{pid}/stat"));
                let gone = state.map_or(true, |s| {
                    s.rsplit_once(')')
                        .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
                });
                if gone {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        self.exit = Some(code);
        code
    }
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(128)
}
