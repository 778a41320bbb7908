//! Kernels forked from a warm zygote (issue 28): a Python process that has imported ipykernel
//! and the kernelspec's preload list (`CELLGATE_PRELOAD`) once, and forks a child for each
//! new kernel, so a session's kernel is ready in tens of milliseconds and its first chart
//! pays no import.
//!
//! # Where the zygote lives, and how a forked kernel gets its sandbox
//!
//! The zygote is itself a sandbox of this backend, started like a kernel ([`Role::Zygote`]):
//! its own user, mount, net, ipc, uts and pid namespaces, the same read-only root (so the
//! modules it imports have the paths every kernel sees), uid 1000, no capabilities, no
//! network, a cgroup of its own. It differs from a kernel in three ways: no Landlock and a
//! seccomp filter that lets it build sandboxes (namespaces, mounts, `pivot_root`, which its
//! children need), its standard input is the gateway's control socket, and its init outlives
//! it while sandboxes forked from it still run.
//!
//! What it holds: Python with ipykernel and the preload list (the shipped kernelspec's:
//! numpy, pandas, matplotlib, seaborn) imported, one warm-up chart drawn (so a first chart
//! costs what a second does), the libraries' thread pools held to one thread
//! ([`ONE_THREAD`]: a fork copies only the forking thread), and `gc.freeze()`d. The warm-up
//! loads matplotlib's inline backend before any IPython shell exists, so each forked kernel
//! hooks that backend into its own shell after `IPKernelApp.initialize()`.
//!
//! For each kernel the gateway sends the zygote three descriptors (and the egress proxy's
//! socket, opened `O_PATH`) and nothing else: the pipes a helper has as standard input,
//! output and error. The zygote forks; the child (`setsid`, its signals reset) makes them
//! its stdio and calls `cellgate_become_kernel` in the library built from this crate
//! (`zygote/`, `libcellgate_zygote.so`, shown read-only in the zygote's root): the **same
//! helper, init and confinement code** a cold start runs, on a [`Role::Forked`] plan. The
//! child is the helper: it reads the plan from the pipe, unshares a new user namespace (a
//! child of the zygote's, which root owns, so no host uid gains any right over it) and the
//! rest, and writes its own id maps (only a process of the parent user namespace or of the
//! namespace itself may, and the gateway, with the zygote's namespace between, is neither);
//! the gateway moves it into the kernel's cgroup from outside, as for any helper. The init
//! builds the root from the zygote's own root (the plan's host paths are mapped to where
//! the zygote shows them, [`forked_plan`]); the kernel process is confined exactly as a
//! cold kernel (stdio, rlimits, `no_new_privs`, Landlock, the kernel's seccomp filter
//! stacked on the zygote's) and then returns to Python instead of `execve`: the launcher
//! takes the plan's environment and arguments, writes its own command line and environment
//! over the zygote's in /proc, reseeds what a fork shares (`random`, numpy, OpenSSL) and
//! runs the kernel.
//!
//! No key, environment or plan ever reaches the zygote's memory (which every later kernel
//! inherits): the plan travels on a pipe only the child reads. The zygote cannot be reached
//! from a kernel: another pid namespace (nested), another root, and its socket closed. What
//! every kernel of one zygote does share is its address-space layout and its `str` hash
//! seed (hence the replacements below).
//!
//! # Lifetime
//!
//! One zygote per [`Kind`] (the launcher command, its start-up environment and what the
//! sandbox shows), started by the first kernel of its kind; kernels of the kind wait for a
//! starting zygote (at most [`ZygoteSettings::ready_timeout`]) rather than start cold, so a
//! gateway's first burst forks too. A zygote is replaced after [`ZygoteSettings::max_forks`]
//! kernels or [`ZygoteSettings::max_age`] (500 and an hour; `--kernel-zygote-max-forks`,
//! `--kernel-zygote-max-age`), and the kernels that come while its successor starts still
//! fork from it. A zygote that dies, or a fork that fails, costs a cold start and a new
//! zygote, never a session; a broken kind is retried after [`RETRY_AFTER`]. Kernels outlive
//! their zygote: its init keeps them. On by default; `--kernel-zygote false` starts every
//! kernel cold. `cellgate_zygote_*` metrics count starts, forks and cold starts, and
//! `cellgate doctor` imports each preload list as a zygote would.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::children::kernel_child;
use super::helper::{self, Outcome};
use super::plan::{Event, Plan, Role};
use super::report::report;
use super::sys;
use crate::sandbox::relocate::{self, VenvEntry};
use crate::sandbox::{ExitReport, SandboxHandle};

/// The launcher's argument that makes it a namespaces zygote.
pub const ZYGOTE_FLAG: &str = "--cellgate-ns-zygote";
/// The variable that tells the zygote where its library is.
pub const LIBRARY_ENV: &str = "CELLGATE_ZYGOTE_LIB";
/// The library's file name, looked for beside the gateway's binary.
pub const LIBRARY_FILE: &str = "libcellgate_zygote.so";
pub use super::plan::EGRESS_FD;
/// The variable that gives a forked kernel room for its own environment block.
pub const ROOM_ENV: &str = "CELLGATE_ZYGOTE_ROOM";
/// Bytes of room for a forked kernel's environment (a kernel's is 1-2 KiB).
const ENVIRON_ROOM: usize = 8 << 10;
/// Bytes of room for a forked kernel's command line.
const CMDLINE_ROOM: usize = 512;
/// How long a broken kind waits before a zygote is tried again.
pub const RETRY_AFTER: Duration = Duration::from_secs(60);
/// How long the zygote may take to answer a fork.
const FORK_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest answer to a fork a zygote writes.
const LINE_MAX: u64 = 256;
/// The longest `ready` line (it lists the preload modules that failed).
const READY_LINE_MAX: u64 = 64 << 10;

/// Why a zygote did not fork, or did not start.
#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    #[error("the zygote's control socket: {0}")]
    Control(#[from] io::Error),
    #[error("the zygote answered {0:?}")]
    Answer(String),
    #[error("the zygote's child {0} is not among its children")]
    NoChild(i32),
    #[error("the zygote was given up after an earlier failure")]
    Poisoned,
}

/// The zygote settings of the backend.
#[derive(Debug, Clone)]
pub struct ZygoteSettings {
    pub enabled: bool,
    /// `libcellgate_zygote.so`; `None`: beside the gateway's binary.
    pub library: Option<PathBuf>,
    /// Kernels one zygote forks before it is replaced.
    pub max_forks: u32,
    /// How long one zygote serves before it is replaced.
    pub max_age: Duration,
    /// How long a zygote may take to import its modules.
    pub ready_timeout: Duration,
}

impl Default for ZygoteSettings {
    fn default() -> ZygoteSettings {
        ZygoteSettings {
            enabled: true,
            library: None,
            max_forks: 500,
            max_age: Duration::from_secs(3600),
            ready_timeout: Duration::from_secs(60),
        }
    }
}

impl ZygoteSettings {
    /// The library, when there is one to use.
    pub fn library(&self) -> Option<PathBuf> {
        let path = match &self.library {
            Some(path) => path.clone(),
            None => std::env::current_exe().ok()?.parent()?.join(LIBRARY_FILE),
        };
        path.is_file().then_some(path)
    }
}

/// What makes two kernels forkable from the same zygote: the launcher command, what of the
/// environment Python and the preloaded modules read at their start, and what the sandbox
/// shows (a forked kernel's root is made from the zygote's).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Kind {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    ro_binds: Vec<PathBuf>,
    python_prefix: Option<PathBuf>,
    venv: String,
}

impl Kind {
    /// The kind of `plan`'s kernel, when it is one the launcher starts and has a connection
    /// file.
    pub fn of(plan: &Plan) -> Option<Kind> {
        let launcher = plan.argv.len() >= 3
            && plan.argv[1] == "-m"
            && plan.argv[2] == "cellgate_kernel_launcher";
        if !launcher || plan.connection_file.is_none() || plan.role != Role::Kernel {
            return None;
        }
        let mut ro_binds = plan.ro_binds.clone();
        ro_binds.sort();
        Some(Kind {
            argv: plan.argv[..3].to_vec(),
            env: start_env(plan).into_iter().collect(),
            ro_binds,
            python_prefix: plan.python_prefix.clone(),
            venv: serde_json::to_string(&plan.venv).unwrap_or_default(),
        })
    }
}

/// Settings that keep the preloaded libraries from starting threads at import (`cellgate
/// doctor` imports the preload list with them too).
pub const ONE_THREAD: &[(&str, &str)] = &[
    ("OPENBLAS_NUM_THREADS", "1"),
    ("OMP_NUM_THREADS", "1"),
    ("MKL_NUM_THREADS", "1"),
    // The jemalloc inside pyarrow (symbols prefixed `je_arrow_`) starts a background thread
    // when the library loads; without it, dirty pages are purged inline, on allocation.
    ("JE_ARROW_MALLOC_CONF", "background_thread:false"),
];

/// What of a kernel's environment a zygote starts with (and so every kernel it forks shares).
fn start_env(plan: &Plan) -> std::collections::BTreeMap<String, String> {
    plan.env
        .iter()
        .filter(|(key, _)| cellgate_agent::protocol::fixed_at_zygote_start(key))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The plan of the zygote for kernels like `plan`'s.
pub fn zygote_plan(plan: &Plan, library: &Path) -> Plan {
    let mut env = start_env(plan);
    env.insert(LIBRARY_ENV.to_owned(), library.display().to_string());
    // Room for the kernel's own environment in the block /proc/PID/environ shows, which a
    // forked kernel rewrites (the launcher's `_retitle`): what it shows is then its own, as
    // for a kernel started afresh, and no longer the zygote's (which names a host path).
    env.insert(ROOM_ENV.to_owned(), ".".repeat(ENVIRON_ROOM));
    // One thread: a process that forks must have no other. numpy's BLAS would start a pool,
    // and pyarrow (which pandas imports when it is installed) its jemalloc's purging thread.
    for (setting, value) in ONE_THREAD {
        env.insert((*setting).to_owned(), (*value).to_owned());
    }
    let mut argv = plan.argv[..3].to_vec();
    argv.push(ZYGOTE_FLAG.to_owned());
    // The same for the command line (/proc/PID/cmdline).
    argv.push(".".repeat(CMDLINE_ROOM));
    let mut ro_binds = plan.ro_binds.clone();
    ro_binds.push(library.to_owned());
    Plan {
        kernel_id: format!("zygote-{}", plan.kernel_id),
        argv,
        env,
        workspace_bytes: 16 << 20,
        connection_file: None,
        ro_binds,
        egress_socket: None,
        address_space_limit: None,
        workspace_dirs: Vec::new(),
        // A Landlock domain forbids mounts to every process in it, and the zygote's
        // children build roots; each forked kernel gets its own ruleset.
        landlock: false,
        role: Role::Zygote,
        // The zygote's own sandbox is kept by its init while kernels forked from it run.
        keep: None,
        ..plan.clone()
    }
}

/// `plan` for a helper forked from a zygote: what a cold helper opens on the host, it opens
/// where the zygote's root shows it (the zygote's root is made from the same plan, so every
/// read-only bind is at its own path there, the interpreter's prefix at
/// [`relocate::PYTHON`] and the venv's parts at their inside paths); the egress socket is the
/// descriptor the zygote's child was given.
pub fn forked_plan(plan: Plan) -> Plan {
    let venv = plan
        .venv
        .into_iter()
        .map(|entry| match entry {
            VenvEntry::Bind { inside, .. } => VenvEntry::Bind {
                host: inside.clone(),
                inside,
            },
            other => other,
        })
        .collect();
    Plan {
        python_prefix: plan.python_prefix.map(|_| PathBuf::from(relocate::PYTHON)),
        venv,
        // A kept sandbox's bridge holds the socket's directory (see `pid1.rs`), given as
        // this descriptor; its path then names the socket in it.
        egress_socket: plan.egress_socket.map(|socket| {
            let fd = PathBuf::from(format!("/proc/self/fd/{EGRESS_FD}"));
            match (&plan.keep, socket.file_name()) {
                (Some(_), Some(name)) => fd.join(name),
                _ => fd,
            }
        }),
        role: Role::Forked,
        ..plan
    }
}

/// Entry point of the library (`zygote/src/lib.rs`), in a zygote's child whose stdio are the
/// helper's pipes: runs the helper. Returns only in the kernel process, confined, with the
/// command and environment it must take (JSON: `{"argv": [...], "env": {...}}`); every other
/// process of the sandbox (the helper, the init) ends inside.
pub fn become_kernel() -> String {
    match helper::run(&mut io::stdin().lock()) {
        Ok(Outcome::Kernel(plan)) => {
            serde_json::json!({"argv": plan.argv, "env": plan.env}).to_string()
        }
        Ok(Outcome::Exit(code)) => sys::exit_now(code),
        Err(failure) => {
            report(&Event::Failed {
                stage: failure.stage.to_owned(),
                error: failure.error,
            });
            sys::exit_now(1)
        }
    }
}

/// A running zygote.
pub struct Zygote {
    /// The gateway's end of the control socket (blocking; used off the async workers).
    control: Mutex<BufReader<UnixStream>>,
    /// The zygote process's host pid.
    pid: i32,
    /// Its sandbox: killed when the gateway drops it.
    handle: Arc<dyn SandboxHandle>,
    /// Kept so the exit report is not lost before the watcher reads it.
    _exit: tokio::sync::watch::Receiver<Option<ExitReport>>,
    forks: AtomicU32,
    born: Instant,
    /// Set by a failed exchange: its socket may hold an answer nobody read, so no request
    /// may be made on it again.
    poisoned: AtomicBool,
    /// When its successor last failed to start: it serves on, and the next successor is
    /// tried [`RETRY_AFTER`] later.
    successor_failed: Mutex<Option<Instant>>,
    /// How many modules of its preload list it could not import.
    pub preload_missing: usize,
}

impl Zygote {
    pub fn new(
        control: UnixStream,
        pid: i32,
        handle: Arc<dyn SandboxHandle>,
        exit: tokio::sync::watch::Receiver<Option<ExitReport>>,
    ) -> Zygote {
        Zygote {
            control: Mutex::new(BufReader::new(control)),
            pid,
            handle,
            _exit: exit,
            forks: AtomicU32::new(0),
            born: Instant::now(),
            poisoned: AtomicBool::new(false),
            successor_failed: Mutex::new(None),
            preload_missing: 0,
        }
    }

    /// Waits for the zygote's `ready` (its imports done); the preload modules it could not
    /// import (its kernels start without them, and say so in their logs). Blocking.
    pub fn wait_ready(&self, timeout: Duration) -> Result<Vec<String>, ZygoteError> {
        let mut control = self.control.lock();
        control.get_ref().set_read_timeout(Some(timeout))?;
        let line = read_line(&mut control, READY_LINE_MAX)?;
        match line.split_once(' ') {
            None if line == "ready" => Ok(Vec::new()),
            Some(("ready", failed)) => Ok(failed.split(',').map(str::to_owned).collect()),
            _ => Err(ZygoteError::Answer(line)),
        }
    }

    fn alive(&self) -> bool {
        !self.poisoned.load(Ordering::SeqCst) && self.handle.alive()
    }

    fn expired(&self, settings: &ZygoteSettings) -> bool {
        let spent = self.forks.load(Ordering::Relaxed) >= settings.max_forks
            || self.born.elapsed() >= settings.max_age;
        spent
            && self
                .successor_failed
                .lock()
                .is_none_or(|at| at.elapsed() >= RETRY_AFTER)
    }

    /// Has the zygote fork a helper with these stdio (and egress socket); the helper's host
    /// pid, and a pidfd naming it (opened before the pid was checked, so it cannot name a
    /// process that reused the pid: the zygote reaps its children, the gateway cannot pin
    /// them). Any failure poisons the zygote. Blocking.
    pub fn fork(
        &self,
        stdio: [BorrowedFd<'_>; 3],
        egress: Option<BorrowedFd<'_>>,
    ) -> Result<(i32, OwnedFd), ZygoteError> {
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(ZygoteError::Poisoned);
        }
        let forked = self.exchange(stdio, egress);
        if forked.is_err() {
            self.poisoned.store(true, Ordering::SeqCst);
        }
        forked
    }

    fn exchange(
        &self,
        stdio: [BorrowedFd<'_>; 3],
        egress: Option<BorrowedFd<'_>>,
    ) -> Result<(i32, OwnedFd), ZygoteError> {
        use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        self.forks.fetch_add(1, Ordering::Relaxed);
        let mut control = self.control.lock();
        let mut fds: Vec<BorrowedFd<'_>> = stdio.to_vec();
        fds.extend(egress);
        let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut ancillary = SendAncillaryBuffer::new(&mut space);
        if !ancillary.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(ZygoteError::Control(io::Error::other(
                "cannot attach the descriptors",
            )));
        }
        let request = [b'F'];
        sendmsg(
            control.get_ref().as_fd(),
            &[io::IoSlice::new(&request)],
            &mut ancillary,
            SendFlags::NOSIGNAL,
        )
        .map_err(io::Error::from)?;
        control.get_ref().set_read_timeout(Some(FORK_TIMEOUT))?;
        let line = read_line(&mut control, LINE_MAX)?;
        let ns_pid: i32 = line.parse().map_err(|_| ZygoteError::Answer(line))?;
        let pid = kernel_child(self.pid, ns_pid).ok_or(ZygoteError::NoChild(ns_pid))?;
        let pidfd = sys::pidfd_open(pid)?;
        // Still the zygote's child of that number: the pidfd names the helper.
        if kernel_child(self.pid, ns_pid) != Some(pid) {
            return Err(ZygoteError::NoChild(ns_pid));
        }
        Ok((pid, pidfd))
    }
}

impl Drop for Zygote {
    /// The zygote exits when its socket closes; its sandbox's init stays while kernels
    /// forked from it run.
    fn drop(&mut self) {
        let control = self.control.lock();
        let _ = control.get_ref().shutdown(std::net::Shutdown::Both);
    }
}

fn read_line(control: &mut BufReader<UnixStream>, max: u64) -> io::Result<String> {
    let mut line = String::new();
    let read = io::Read::take(&mut *control, max).read_line(&mut line)?;
    if read == 0 || !line.ends_with('\n') {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the zygote closed its socket",
        ));
    }
    Ok(line.trim_end().to_owned())
}

/// What the registry says about a kind when a kernel of it is to start.
pub enum Lookup {
    /// Fork from this one.
    Ready(Arc<Zygote>),
    /// Start one (the caller does, in the background, and reports to [`Zygotes::started`]),
    /// then look again: a predecessor that served its time still serves until then, else
    /// the answer is [`Lookup::Wait`].
    Start(Starting),
    /// One is starting: wait for it ([`Starting::wait`]), then look again.
    Wait(Starting),
    /// The kind is broken for now: start cold.
    Cold,
}

/// A zygote's start, which kernels of its kind wait for rather than start cold: on a
/// gateway's first kernels, and when a zygote died, forked kernels come within the wait.
#[derive(Clone)]
pub struct Starting(tokio::sync::watch::Receiver<bool>);

impl Starting {
    /// Until the start ended (either way), or `timeout`.
    pub async fn wait(mut self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.0.wait_for(|done| *done)).await;
    }
}

enum Slot {
    Starting {
        /// The zygote being replaced, still serving meanwhile.
        previous: Option<Arc<Zygote>>,
        done: tokio::sync::watch::Sender<bool>,
    },
    Ready(Arc<Zygote>),
    Broken {
        since: Instant,
    },
}

/// The zygotes of the backend, one per [`Kind`].
pub struct Zygotes {
    pub settings: ZygoteSettings,
    /// Whether the configuration asked for zygotes (`settings.enabled` is off also where
    /// they cannot run).
    pub wanted: bool,
    slots: Mutex<HashMap<Kind, Slot>>,
}

impl Zygotes {
    pub fn new(settings: ZygoteSettings, wanted: bool) -> Zygotes {
        Zygotes {
            settings,
            wanted,
            slots: Mutex::new(HashMap::new()),
        }
    }

    pub fn lookup(&self, kind: &Kind) -> Lookup {
        if !self.settings.enabled {
            return Lookup::Cold;
        }
        let mut slots = self.slots.lock();
        let start = |slots: &mut HashMap<Kind, Slot>, previous: Option<Arc<Zygote>>| {
            let (done, waiting) = tokio::sync::watch::channel(false);
            slots.insert(kind.clone(), Slot::Starting { previous, done });
            Lookup::Start(Starting(waiting))
        };
        match slots.get(kind) {
            None => start(&mut slots, None),
            Some(Slot::Starting { previous, done }) => match previous {
                Some(zygote) if zygote.alive() => Lookup::Ready(zygote.clone()),
                _ => Lookup::Wait(Starting(done.subscribe())),
            },
            Some(Slot::Ready(zygote)) if !zygote.alive() => {
                tracing::warn!("kernel zygote died: starting another");
                start(&mut slots, None)
            }
            Some(Slot::Ready(zygote)) if zygote.expired(&self.settings) => {
                // Kernels fork from the old one until its successor is ready.
                tracing::info!("kernel zygote served its time: starting its successor");
                let previous = Some(zygote.clone());
                start(&mut slots, previous)
            }
            Some(Slot::Ready(zygote)) => Lookup::Ready(zygote.clone()),
            Some(Slot::Broken { since }) if since.elapsed() >= RETRY_AFTER => {
                start(&mut slots, None)
            }
            Some(Slot::Broken { .. }) => Lookup::Cold,
        }
    }

    /// A zygote's start ended.
    pub fn started(&self, kind: Kind, zygote: Result<Zygote, String>) {
        let mut slots = self.slots.lock();
        let previous = match slots.get(&kind) {
            Some(Slot::Starting {
                previous: Some(previous),
                ..
            }) if previous.alive() => Some(previous.clone()),
            _ => None,
        };
        let slot = match (zygote, previous) {
            (Ok(zygote), _) => Slot::Ready(Arc::new(zygote)),
            // A successor that failed: the zygote it was to replace still works, so it serves
            // on rather than leave the kind to cold starts.
            (Err(why), Some(previous)) => {
                tracing::warn!(%why, "the successor of a kernel zygote that served its time failed to start: the old one serves on (retried in {} s)", RETRY_AFTER.as_secs());
                *previous.successor_failed.lock() = Some(Instant::now());
                Slot::Ready(previous)
            }
            (Err(why), None) => {
                tracing::warn!(%why, "kernel zygote failed to start: kernels start cold (retried in {} s)", RETRY_AFTER.as_secs());
                Slot::Broken {
                    since: Instant::now(),
                }
            }
        };
        if let Some(Slot::Starting { done, .. }) = slots.insert(kind, slot) {
            let _ = done.send(true);
        }
        let most = slots
            .values()
            .filter_map(|slot| match slot {
                Slot::Ready(zygote) => Some(zygote.preload_missing),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        crate::telemetry::metrics::metrics().zygote_preload_missing(most);
    }

    /// A fork from `zygote` failed: the kind starts cold until a new zygote is up. The
    /// zygote is let go, not killed: its socket closes and it exits, and its init keeps the
    /// kernels it forked.
    pub fn failed(&self, kind: &Kind, zygote: &Arc<Zygote>, why: &str) {
        tracing::warn!(%why, "a kernel fork from the zygote failed: that kernel starts cold, and the zygote is replaced");
        zygote.poisoned.store(true, Ordering::SeqCst);
        let mut slots = self.slots.lock();
        if let Some(Slot::Ready(current)) = slots.get(kind) {
            if Arc::ptr_eq(current, zygote) {
                slots.insert(
                    kind.clone(),
                    Slot::Broken {
                        since: Instant::now(),
                    },
                );
            }
        }
    }
}
