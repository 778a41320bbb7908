//! The one kernel a guest runs: starting it, signalling and killing it, measuring it, and
//! reaping it (and, on pid 1, every orphan of the guest).
//!
//! On pid 1 the kernel runs in its own cgroup (`/sys/fs/cgroup/kernel`) with the policy's
//! pids and memory limits. The cgroup is how the agent ends everything the kernel started at
//! once (`cgroup.kill`), tells an out-of-memory kill from any other SIGKILL
//! (`memory.events`), and counts refused forks (`pids.events`). The VM's RAM is a little
//! larger than the cgroup's limit, so the guest's OOM killer picks inside the kernel's
//! cgroup and the agent survives to report it.
//!
//! The root image holds every kernelspec's environment under `/opt/cellgate/envs/<name>`;
//! before the kernel (or a zygote) starts, pid 1 binds the one its start names, read-only,
//! at `/opt/cellgate/venv`, where every sandbox shows a kernel its environment. One kernel
//! per VM, so one bind per VM.

#![expect(
    clippy::disallowed_types,
    reason = "the guest agent keeps its dependencies few (no parking_lot in the VM); its std locks are never held across an await (await_holding_lock checks)"
)]

use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cellgate_agent::fault::{is_fault_signal, last_fault, Kmsg};
use cellgate_agent::protocol::{
    fixed_at_zygote_start, is_environment_name, Channel, ConnectionFile, Exit, Start, Usage,
    Zygote, ENVIRONMENTS_DIR, ENVIRONMENT_AT, LOG_TAIL_BYTES, ZYGOTE_FLAG,
};
use rustix::process::{Pid, Signal, WaitOptions};
use tokio::sync::watch;

/// The kernel's cgroup in the guest.
const CGROUP: &str = "/sys/fs/cgroup/kernel";
/// The kernel's stdout and stderr, in the agent's own run directory.
const LOG_FILE: &str = "/run/cellgate-agent/kernel.log";

pub struct Kernel {
    /// Whether this agent is the guest's init: cgroups, mounts and ownership are its job.
    init: bool,
    /// A cgroup the agent reads but does not own (a pod's container cgroup, which holds the
    /// agent too): the kernel's usage and out-of-memory kills, never `cgroup.kill`.
    observed: Option<PathBuf>,
    state: Mutex<State>,
    exit: watch::Sender<Option<Exit>>,
}

#[derive(Default)]
struct State {
    pid: Option<Pid>,
    /// Where each channel's socket is in the guest, from the connection file.
    endpoints: Option<Endpoints>,
    cgroup: Option<PathBuf>,
    log: Option<PathBuf>,
    /// The kernel's working directory: its workspace, which the file streams serve.
    workspace: Option<PathBuf>,
    /// A zygote waiting to become the kernel (see [`Kernel::prepare_zygote`]).
    zygote: Option<ZygoteProcess>,
    /// The guest kernel's log from the kernel's start on: where a fault that killed it is
    /// recorded. None where the agent may not read the log (a pod's agent).
    kmsg: Option<Kmsg>,
    /// The environment shown at [`ENVIRONMENT_AT`], once bound.
    environment: Option<String>,
    /// Whether a kernel was started (a later session must attach), and the key its
    /// connection file signs with (none for a plain program: nothing can attach to it).
    started: bool,
    key: Option<Vec<u8>>,
}

/// A prepared zygote: its process, the agent's end of its socket, and what it was started
/// with (a start it cannot become runs a fresh process instead).
struct ZygoteProcess {
    pid: Pid,
    socket: std::os::unix::net::UnixStream,
    spec: Zygote,
}

/// The longest start request a zygote reads (the launcher's `ZYGOTE_REQUEST_MAX`).
const ZYGOTE_REQUEST_MAX: usize = 1 << 20;

/// How long a zygote may take to import the kernel's modules: seconds natively, tens of
/// seconds under emulation on a busy host.
const ZYGOTE_READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// A channel's socket inside the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Ipc(PathBuf),
    Tcp(String),
}

#[derive(Debug, Clone)]
struct Endpoints([Endpoint; 5]);

/// Errors of starting the kernel, as sentences for the `failed` reply.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("the kernel was started already")]
    AlreadyStarted,
    #[error("no kernel is running")]
    NotRunning,
    #[error("bad connection info: {0}")]
    Connection(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("signal {0} is not a signal")]
    BadSignal(i32),
    #[error("a zygote is prepared already")]
    ZygoteExists,
    #[error("the zygote failed: {0}")]
    Zygote(String),
    #[error("{0}")]
    Restore(String),
    #[error("the environment {0:?}: {1}")]
    Environment(String, String),
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> KernelError {
    let what = what.into();
    move |source| KernelError::Io { what, source }
}

impl Kernel {
    pub fn new(init: bool) -> Kernel {
        Kernel {
            init,
            observed: None,
            state: Mutex::new(State::default()),
            exit: watch::channel(None).0,
        }
    }

    /// Reads the container's cgroup (v2, the agent's own as the cgroup namespace shows it)
    /// for usage and out-of-memory kills, when it is there to read.
    pub fn observing_container_cgroup(mut self) -> Kernel {
        let root = Path::new("/sys/fs/cgroup");
        if root.join("memory.events").is_file() {
            self.observed = Some(root.to_owned());
        }
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The kernel's exit, once it has ended.
    pub fn exit_watch(&self) -> watch::Receiver<Option<Exit>> {
        self.exit.subscribe()
    }

    /// Where `channel`'s socket is, once the kernel was started.
    pub fn endpoint(&self, channel: Channel) -> Option<Endpoint> {
        let state = self.state();
        let index = Channel::ALL.iter().position(|c| *c == channel)?;
        Some(state.endpoints.as_ref()?.0[index].clone())
    }

    /// The kernel's workspace, once a kernel was started (it outlives the kernel: the VM
    /// and its disk go together).
    pub fn workspace(&self) -> Option<PathBuf> {
        self.state().workspace.clone()
    }

    /// Whether a host session must attach (prove the kernel's key) before it may do
    /// anything: once a kernel was started, and its key (`None`: none to prove, so no
    /// session can attach).
    pub fn attach_key(&self) -> (bool, Option<Vec<u8>>) {
        let state = self.state();
        (state.started, state.key.clone())
    }

    /// Makes the kernel look started with `key`, for the session's tests.
    #[cfg(test)]
    pub fn pretend_started(&self, key: &[u8]) {
        let mut state = self.state();
        state.started = true;
        state.key = Some(key.to_vec());
    }

    pub fn running(&self) -> bool {
        self.state().pid.is_some() && self.exit.borrow().is_none()
    }

    /// Starts the kernel; its pid as the guest sees it. A prepared zygote that can become
    /// this kernel does; one that cannot is ended and a fresh process starts.
    pub fn start(&self, start: &Start) -> Result<u32, KernelError> {
        let mut state = self.state();
        if state.pid.is_some() {
            return Err(KernelError::AlreadyStarted);
        }
        if self.init {
            if let Some(name) = &start.environment {
                show_environment(&mut state, name)?;
            }
        }
        let cwd = Path::new(&start.cwd);
        if self.init {
            prepare_workspace(cwd, start.uid, start.gid)?;
        }
        state.workspace = Some(cwd.to_owned());
        let endpoints = match &start.connection {
            Some(connection) => {
                let endpoints = endpoints(&connection.info)?;
                write_connection_file(start, connection, &endpoints, self.init)?;
                Some(endpoints)
            }
            None => None,
        };
        let cgroup = if self.init {
            Some(make_cgroup(start.pids, start.memory_bytes)?)
        } else {
            None
        };
        // Opened before the kernel runs: its records are the ones logged after this.
        state.kmsg = Kmsg::open().ok();
        let pid = match state.zygote.take() {
            Some(zygote) => match zygote.become_kernel(start) {
                Ok(pid) => pid,
                Err(why) => {
                    eprintln!("cellgate-agent: starting a fresh kernel process: {why}");
                    self.spawn_kernel(start, cgroup.as_deref())?
                }
            },
            None => self.spawn_kernel(start, cgroup.as_deref())?,
        };
        state.pid = Some(pid);
        state.started = true;
        state.key = start
            .connection
            .as_ref()
            .and_then(|c| c.info.get("key")?.as_str().map(|k| k.as_bytes().to_vec()));
        state.endpoints = endpoints;
        state.cgroup = cgroup;
        state.log = Some(PathBuf::from(LOG_FILE));
        Ok(pid.as_raw_nonzero().get() as u32)
    }

    /// Runs `start`'s command as the kernel, in `cgroup`.
    fn spawn_kernel(&self, start: &Start, cgroup: Option<&Path>) -> Result<Pid, KernelError> {
        let mut command = kernel_command(&start.argv, &start.env, Path::new(&start.cwd))?;
        command.stdin(std::process::Stdio::null());
        self.spawn(command, start.uid, start.gid, cgroup)
    }

    /// Spawns `command` as `uid`:`gid` (where the agent may change ids), in `cgroup` from
    /// its first instruction. The reaper waits for it (waitpid(-1)), so no handle is kept.
    fn spawn(
        &self,
        mut command: std::process::Command,
        uid: u32,
        gid: u32,
        cgroup: Option<&Path>,
    ) -> Result<Pid, KernelError> {
        if rustix::process::geteuid().is_root() {
            command.uid(uid).gid(gid);
        }
        if let Some(dir) = cgroup {
            let procs = rustix::fs::open(
                dir.join("cgroup.procs"),
                rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| io_error("the kernel's cgroup.procs")(e.into()))?;
            join_cgroup_at_exec(&mut command, procs);
        }
        let program = command.get_program().to_string_lossy().into_owned();
        let child = command
            .spawn()
            .map_err(io_error(format!("starting {program}")))?;
        Pid::from_raw(child.id() as i32)
            .ok_or_else(|| KernelError::Connection("the child has no pid".to_owned()))
    }

    /// Starts a zygote (see [`Op::Zygote`](cellgate_agent::protocol::Op::Zygote)) and waits
    /// until it has imported the kernel's modules. Blocking: call it off the async workers.
    pub fn prepare_zygote(&self, zygote: &Zygote) -> Result<u32, KernelError> {
        let (mut socket, pid) = {
            let mut state = self.state();
            if state.pid.is_some() {
                return Err(KernelError::AlreadyStarted);
            }
            if state.zygote.is_some() {
                return Err(KernelError::ZygoteExists);
            }
            if self.init {
                if let Some(name) = &zygote.environment {
                    show_environment(&mut state, name)?;
                }
            }
            let cwd = Path::new(&zygote.cwd);
            std::fs::create_dir_all(cwd).map_err(io_error(cwd.display().to_string()))?;
            let cgroup = if self.init {
                Some(make_cgroup(None, None)?)
            } else {
                None
            };
            let (ours, theirs) =
                std::os::unix::net::UnixStream::pair().map_err(io_error("the zygote's socket"))?;
            let mut argv = zygote.argv.clone();
            argv.push(ZYGOTE_FLAG.to_owned());
            let mut command = kernel_command(&argv, &zygote.env, cwd)?;
            command.stdin(OwnedFd::from(theirs));
            let pid = self.spawn(command, zygote.uid, zygote.gid, cgroup.as_deref())?;
            let socket = ours.try_clone().map_err(io_error("the zygote's socket"))?;
            state.zygote = Some(ZygoteProcess {
                pid,
                socket: ours,
                spec: zygote.clone(),
            });
            (socket, pid)
        };
        let ready = socket
            .set_read_timeout(Some(ZYGOTE_READY_TIMEOUT))
            .and_then(|()| {
                let mut word = [0u8; 6];
                socket.read_exact(&mut word).map(|()| word)
            });
        match ready {
            Ok(word) if &word == b"ready\n" => Ok(pid.as_raw_nonzero().get() as u32),
            outcome => {
                self.drop_zygote();
                Err(KernelError::Zygote(match outcome {
                    Ok(word) => format!("it said {:?}", String::from_utf8_lossy(&word)),
                    Err(error) => {
                        format!("{error}; its log ends: {}", log_tail(Path::new(LOG_FILE)))
                    }
                }))
            }
        }
    }

    /// Ends a prepared zygote, if there is one.
    fn drop_zygote(&self) {
        if let Some(zygote) = self.state().zygote.take() {
            zygote.end();
        }
    }

    pub fn signal(&self, signal: i32) -> Result<(), KernelError> {
        let pid = self.live_pid()?;
        let signal = Signal::from_named_raw(signal).ok_or(KernelError::BadSignal(signal))?;
        rustix::process::kill_process(pid, signal)
            .map_err(|e| io_error("signalling the kernel")(e.into()))
    }

    /// Ends the kernel and everything it started.
    pub fn kill(&self) -> Result<(), KernelError> {
        let (pid, cgroup) = {
            let state = self.state();
            (state.pid, state.cgroup.clone())
        };
        let pid = pid.ok_or(KernelError::NotRunning)?;
        if let Some(cgroup) = cgroup {
            std::fs::write(cgroup.join("cgroup.kill"), "1").map_err(io_error("cgroup.kill"))?;
            return Ok(());
        }
        match rustix::process::kill_process_group(pid, Signal::KILL) {
            Ok(()) => Ok(()),
            // Gone already: the reaper reports it.
            Err(rustix::io::Errno::SRCH) => Ok(()),
            Err(e) => Err(io_error("killing the kernel")(e.into())),
        }
    }

    fn live_pid(&self) -> Result<Pid, KernelError> {
        match self.state().pid {
            Some(pid) if self.exit.borrow().is_none() => Ok(pid),
            _ => Err(KernelError::NotRunning),
        }
    }

    pub fn usage(&self) -> Usage {
        let Some(cgroup) = self
            .state()
            .cgroup
            .clone()
            .or_else(|| self.observed.clone())
        else {
            return Usage::default();
        };
        Usage {
            cpu_time_us: keyed(&cgroup.join("cpu.stat"), "usage_usec"),
            memory_bytes: single(&cgroup.join("memory.current")),
            memory_peak_bytes: single(&cgroup.join("memory.peak")),
            pids_limit_hits: keyed(&cgroup.join("pids.events"), "max"),
        }
    }

    /// Reaps every child that ends (pid 1 inherits the guest's orphans) and reports the
    /// kernel's end. Call before the first start, so no SIGCHLD is missed.
    pub fn reap_children(self: Arc<Self>) -> std::io::Result<()> {
        let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
        tokio::spawn(async move {
            loop {
                loop {
                    // Under the lock: start() holds it from fork to recording the pid, so a
                    // kernel that dies at once is reaped only once its pid is known (and
                    // never from under std's own wait after a failed exec).
                    let reaped = {
                        let mut state = self.state();
                        let reaped = rustix::process::wait(WaitOptions::NOHANG).ok().flatten();
                        if let Some((pid, _)) = reaped {
                            // Its pid is free from now on: never signal it again.
                            if state.zygote.as_ref().is_some_and(|z| z.pid == pid) {
                                state.zygote = None;
                            }
                        }
                        reaped.map(|(pid, status)| (Some(pid) == state.pid, status))
                    };
                    match reaped {
                        Some((true, status)) => self.ended(status),
                        Some((false, _)) => {}
                        None => break,
                    }
                }
                if sigchld.recv().await.is_none() {
                    return;
                }
            }
        });
        Ok(())
    }

    fn ended(&self, status: rustix::process::WaitStatus) {
        let (cgroup, log, kmsg, pid) = {
            let mut state = self.state();
            (
                state.cgroup.clone(),
                state.log.clone(),
                state.kmsg.take(),
                state.pid,
            )
        };
        let signal = status.terminating_signal();
        let fault = match (signal, kmsg) {
            (Some(signal), Some(mut kmsg)) if is_fault_signal(signal) => {
                last_fault(&kmsg.drain(), pid.map(|p| p.as_raw_nonzero().get() as u32))
            }
            _ => None,
        };
        let mut oom = false;
        let mut pids_limit_hits = 0;
        if let Some(cgroup) = &cgroup {
            // What the kernel left behind goes with it.
            let _ = std::fs::write(cgroup.join("cgroup.kill"), "1");
            oom = keyed(&cgroup.join("memory.events"), "oom_kill").unwrap_or(0) > 0;
            pids_limit_hits = keyed(&cgroup.join("pids.events"), "max").unwrap_or(0);
        } else if let Some(observed) = &self.observed {
            // One kernel per pod: any kill in the container's cgroup was the kernel's (the
            // agent, far smaller, is never the one picked while the kernel lives).
            oom = keyed(&observed.join("memory.events"), "oom_kill").unwrap_or(0) > 0;
            pids_limit_hits = keyed(&observed.join("pids.events"), "max").unwrap_or(0);
        }
        let exit = Exit {
            code: status.exit_status(),
            signal,
            oom,
            pids_limit_hits,
            log_tail: log.as_deref().map(log_tail).unwrap_or_default(),
            fault,
        };
        self.exit.send_replace(Some(exit));
    }
}

impl ZygoteProcess {
    /// Hands the zygote `start`: it takes the environment, directory and arguments and runs
    /// the kernel. Refused (and the zygote ended) when `start` is not a command it can
    /// become, or when it is gone.
    fn become_kernel(mut self, start: &Start) -> Result<Pid, String> {
        use std::io::Write;
        let why = self.refuses(start);
        if let Some(why) = why {
            self.end();
            return Err(why);
        }
        let request = serde_json::json!({
            "args": start.argv[self.spec.argv.len()..],
            "env": start.env,
            "cwd": start.cwd,
        });
        let mut line = request.to_string();
        line.push('\n');
        // The zygote reads at most this much (`ZYGOTE_REQUEST_MAX` in the launcher): a longer
        // request would end it after the start was answered.
        if line.len() > ZYGOTE_REQUEST_MAX {
            self.end();
            return Err(format!("a start request of {} bytes", line.len()));
        }
        // Bounded: the agent holds the kernel's state lock here.
        let written = self
            .socket
            .set_write_timeout(Some(std::time::Duration::from_secs(10)))
            .and_then(|()| self.socket.write_all(line.as_bytes()));
        match written {
            Ok(()) => Ok(self.pid),
            Err(error) => {
                self.end();
                Err(format!("the zygote is gone ({error})"))
            }
        }
    }

    /// Why the zygote cannot become the kernel `start` asks for, if it cannot.
    fn refuses(&self, start: &Start) -> Option<String> {
        if !start.argv.starts_with(&self.spec.argv) {
            return Some(format!(
                "the command {:?} does not begin with the zygote's {:?}",
                start.argv, self.spec.argv
            ));
        }
        if start.environment != self.spec.environment {
            return Some("another environment than the zygote's".to_owned());
        }
        if (start.uid, start.gid) != (self.spec.uid, self.spec.gid) || start.cwd != self.spec.cwd {
            return Some("another user or working directory than the zygote's".to_owned());
        }
        let at_start = |env: &std::collections::BTreeMap<String, String>| {
            env.iter()
                .filter(|(key, _)| fixed_at_zygote_start(key))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<Vec<_>>()
        };
        if at_start(&start.env) != at_start(&self.spec.env) {
            return Some("the environment the zygote started with differs".to_owned());
        }
        None
    }

    /// Ends the zygote (its process group: it has started nothing else yet).
    fn end(self) {
        let _ = rustix::process::kill_process_group(self.pid, Signal::KILL);
    }
}

/// Binds the root image's environment `name` at [`ENVIRONMENT_AT`], read-only, unless it is
/// there already (a zygote's start bound it). A second, different environment is refused:
/// the kernel's files would change under a process already running from them.
fn show_environment(state: &mut State, name: &str) -> Result<(), KernelError> {
    use rustix::mount::{mount_bind, mount_remount, MountFlags};
    let refused = |why: &str| KernelError::Environment(name.to_owned(), why.to_owned());
    match &state.environment {
        Some(bound) if bound == name => return Ok(()),
        Some(bound) => return Err(refused(&format!("{bound:?} is shown already"))),
        None => {}
    }
    if !is_environment_name(name) {
        return Err(refused("not an environment's name"));
    }
    let source = Path::new(ENVIRONMENTS_DIR).join(name);
    if !source.is_dir() {
        return Err(refused(&format!(
            "the root image has no {} (an image built before it, or without it)",
            source.display()
        )));
    }
    std::fs::create_dir_all(ENVIRONMENT_AT).map_err(io_error(ENVIRONMENT_AT))?;
    mount_bind(&source, ENVIRONMENT_AT)
        .map_err(|e| io_error(format!("binding {}", source.display()))(e.into()))?;
    // The lower image is read-only, but the overlay above it is not: the kernel must not
    // change its own environment (nor leave files for a snapshot's clones).
    mount_remount(
        ENVIRONMENT_AT,
        MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
        "",
    )
    .map_err(|e| io_error(format!("{ENVIRONMENT_AT} read-only"))(e.into()))?;
    state.environment = Some(name.to_owned());
    Ok(())
}

/// The kernel's command: `argv` with exactly `env`, in `cwd`, output to the kernel's log, in
/// a process group of its own (so a kill reaches what it started).
fn kernel_command(
    argv: &[String],
    env: &std::collections::BTreeMap<String, String>,
    cwd: &Path,
) -> Result<std::process::Command, KernelError> {
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| KernelError::Connection("empty argv".to_owned()))?;
    let log_dir = Path::new(LOG_FILE).parent().unwrap_or(Path::new("/run"));
    std::fs::create_dir_all(log_dir).map_err(io_error(log_dir.display().to_string()))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(LOG_FILE)
        .map_err(io_error(LOG_FILE))?;
    let mut command = std::process::Command::new(program);
    command
        .args(args)
        .env_clear()
        .envs(env)
        .current_dir(cwd)
        .stdout(log.try_clone().map_err(io_error("the kernel log"))?)
        .stderr(log)
        .process_group(0);
    Ok(command)
}

/// What the agent does first in a VM restored from a snapshot: reseeds the guest's random
/// number generator from `seed` (see [`reseed`]) and sets its clock to `unix_time_ns`.
#[allow(unsafe_code)]
pub fn restored(seed: &str, unix_time_ns: u64) -> Result<(), KernelError> {
    reseed(seed)?;
    let time = libc::timespec {
        tv_sec: (unix_time_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime reads the timespec this function owns, nothing else.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &time) } != 0 {
        return Err(KernelError::Restore(format!(
            "setting the guest's clock: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Mixes `seed` (hex) into the guest's entropy pool and reseeds the kernel's random number
/// generator from it at once, so `os.urandom` in two VMs restored from one snapshot differs
/// from the next call on.
#[allow(unsafe_code)]
fn reseed(seed: &str) -> Result<(), KernelError> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let bytes = cellgate_agent::protocol::decode_hex(seed)
        .filter(|b| b.len() >= 32)
        .ok_or_else(|| KernelError::Connection("a seed is 32 bytes or more, in hex".to_owned()))?;
    let mut urandom = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(io_error("/dev/urandom"))?;
    urandom
        .write_all(&bytes)
        .map_err(io_error("/dev/urandom"))?;
    // RNDRESEEDCRNG: _IO('R', 0x07).
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // SAFETY: an argument-less ioctl on a descriptor this function owns.
    let done = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) };
    if done < 0 {
        return Err(io_error("reseeding the guest RNG")(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Puts the child into the kernel's cgroup before it runs a single instruction of the
/// kernel's program, so no process of the kernel ever runs outside the limits.
#[allow(unsafe_code)]
fn join_cgroup_at_exec(command: &mut std::process::Command, procs: OwnedFd) {
    // SAFETY: the closure runs in the forked child before exec; it only calls write(2) on a
    // descriptor opened before the fork, which is async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            rustix::io::write(procs.as_fd(), b"0")?;
            Ok(())
        });
    }
}

fn endpoints(connection: &serde_json::Value) -> Result<Endpoints, KernelError> {
    let text = |key: &str| {
        connection
            .get(key)
            .and_then(|v| v.as_str())
            .ok_or_else(|| KernelError::Connection(format!("no {key}")))
    };
    let port = |key: &str| {
        connection
            .get(key)
            .and_then(|v| v.as_u64())
            .filter(|p| *p > 0 && *p <= u64::from(u16::MAX))
            .ok_or_else(|| KernelError::Connection(format!("no {key}")))
    };
    let transport = text("transport")?;
    let ip = text("ip")?;
    let mut list = Vec::with_capacity(5);
    for key in [
        "shell_port",
        "iopub_port",
        "stdin_port",
        "control_port",
        "hb_port",
    ] {
        let port = port(key)?;
        list.push(match transport {
            "ipc" => Endpoint::Ipc(PathBuf::from(format!("{ip}-{port}"))),
            "tcp" => Endpoint::Tcp(format!("{ip}:{port}")),
            other => return Err(KernelError::Connection(format!("transport {other}"))),
        });
    }
    let list: [Endpoint; 5] = list
        .try_into()
        .map_err(|_| KernelError::Connection("five ports".to_owned()))?;
    Ok(Endpoints(list))
}

/// Mounts the workspace disk at the kernel's working directory (when the VM has one) and
/// gives it to the kernel's user.
fn prepare_workspace(cwd: &Path, uid: u32, gid: u32) -> Result<(), KernelError> {
    std::fs::create_dir_all(cwd).map_err(io_error(cwd.display().to_string()))?;
    if let Some(device) = crate::boot::virtio_disk(false) {
        forget_cached_blocks(&device)?;
        rustix::mount::mount(
            &device,
            cwd,
            "ext4",
            rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV,
            None,
        )
        .map_err(|e| io_error("mounting the workspace disk")(e.into()))?;
        // mkfs leaves lost+found; it is no file of the kernel's.
        let _ = std::fs::remove_dir(cwd.join("lost+found"));
    }
    chown(cwd, uid, gid)
}

/// Drops what the guest has cached of `device`'s blocks.
///
/// Why: in a VM restored from a snapshot the disk is another file than the one the guest
/// read when it probed the device (a blank one, in the zygote VM); the cached first page,
/// which holds ext4's superblock, would make the mount read the blank disk's zeros.
#[allow(unsafe_code)]
fn forget_cached_blocks(device: &str) -> Result<(), KernelError> {
    use std::os::fd::AsRawFd;
    // BLKFLSBUF: _IO(0x12, 97).
    const BLKFLSBUF: libc::c_ulong = 0x1261;
    let disk = std::fs::File::open(device).map_err(io_error(device.to_owned()))?;
    // SAFETY: an argument-less ioctl on a descriptor this function owns.
    if unsafe { libc::ioctl(disk.as_raw_fd(), BLKFLSBUF as _) } != 0 {
        return Err(io_error(format!("flushing {device}"))(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), KernelError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .map_err(io_error(format!("chown {}", path.display())))
}

/// Writes the connection file and makes the ipc sockets' directory, both the kernel's.
fn write_connection_file(
    start: &Start,
    connection: &ConnectionFile,
    endpoints: &Endpoints,
    init: bool,
) -> Result<(), KernelError> {
    let file = Path::new(&connection.path);
    let mut dirs = vec![];
    if let Some(dir) = file.parent() {
        dirs.push(dir.to_owned());
    }
    if let Endpoint::Ipc(socket) = &endpoints.0[0] {
        if let Some(dir) = socket.parent() {
            dirs.push(dir.to_owned());
        }
    }
    for dir in &dirs {
        std::fs::create_dir_all(dir).map_err(io_error(dir.display().to_string()))?;
        if init {
            chown(dir, start.uid, start.gid)?;
        }
    }
    let body =
        serde_json::to_vec(&connection.info).map_err(|e| KernelError::Connection(e.to_string()))?;
    std::fs::write(file, body).map_err(io_error(file.display().to_string()))?;
    if init {
        chown(file, start.uid, start.gid)?;
    }
    Ok(())
}

/// Makes the kernel's cgroup (or finds the zygote's) and sets the policy's limits.
fn make_cgroup(pids: Option<u64>, memory_bytes: Option<u64>) -> Result<PathBuf, KernelError> {
    let root = Path::new(CGROUP)
        .parent()
        .unwrap_or(Path::new("/sys/fs/cgroup"));
    std::fs::write(root.join("cgroup.subtree_control"), "+pids +memory +cpu")
        .or_else(|_| std::fs::write(root.join("cgroup.subtree_control"), "+pids +memory"))
        .map_err(io_error("enabling the cgroup controllers"))?;
    let dir = PathBuf::from(CGROUP);
    std::fs::create_dir_all(&dir).map_err(io_error(CGROUP))?;
    if let Some(pids) = pids {
        std::fs::write(dir.join("pids.max"), pids.to_string()).map_err(io_error("pids.max"))?;
    }
    if let Some(memory) = memory_bytes {
        std::fs::write(dir.join("memory.max"), memory.to_string())
            .map_err(io_error("memory.max"))?;
    }
    Ok(dir)
}

/// The value of `key` in a flat-keyed cgroup file (`cpu.stat`, `memory.events`).
fn keyed(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

/// A single-value cgroup file (`memory.current`).
fn single(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The last [`LOG_TAIL_BYTES`] of the kernel's log.
fn log_tail(path: &Path) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let from = len.saturating_sub(LOG_TAIL_BYTES as u64);
    let mut tail = Vec::new();
    if file.seek(SeekFrom::Start(from)).is_ok() {
        let _ = file.take(LOG_TAIL_BYTES as u64).read_to_end(&mut tail);
    }
    String::from_utf8_lossy(&tail).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_come_from_the_connection_info() {
        let info = serde_json::json!({
            "transport": "ipc", "ip": "/run/cellgate/kernel",
            "shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5
        });
        let endpoints = endpoints(&info).unwrap();
        assert_eq!(
            endpoints.0[1],
            Endpoint::Ipc(PathBuf::from("/run/cellgate/kernel-2"))
        );
        let mut tcp = info.clone();
        tcp["transport"] = "tcp".into();
        tcp["ip"] = "127.0.0.1".into();
        assert_eq!(
            endpoints_of(&tcp)[4],
            Endpoint::Tcp("127.0.0.1:5".to_owned())
        );
        let mut bad = info;
        bad["hb_port"] = 0.into();
        assert!(super::endpoints(&bad).is_err());
    }

    fn endpoints_of(info: &serde_json::Value) -> [Endpoint; 5] {
        endpoints(info).unwrap().0
    }

    #[test]
    fn cgroup_files_parse() {
        let dir = std::env::temp_dir().join(format!("agent-cg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        )
        .unwrap();
        std::fs::write(dir.join("memory.current"), "4096\n").unwrap();
        assert_eq!(keyed(&dir.join("memory.events"), "oom_kill"), Some(1));
        assert_eq!(keyed(&dir.join("memory.events"), "oom_group_kill"), None);
        assert_eq!(single(&dir.join("memory.current")), Some(4096));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
