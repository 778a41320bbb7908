//! gVisor sandboxes that outlive their gateway (see the backend's *Lifetime*): the launch
//! under a [`keeper`](super::keeper), the record the next gateway re-finds them by, their
//! adoption, and the sweep of what the ones that ended without a gateway left.
//!
//! Per kernel, in `<state dir>/sandboxes/<kernel id>/` (0700, as for the namespaces backend,
//! whose [`Survival`] makes the directory, the control socket and the key exchange):
//! * `record.json` (0600): [`GvisorRecord`], with the kernel's key;
//! * `control-g<generation>.sock`: the keeper's control socket;
//! * `k/`: the kernel's directories (runtime directory with the connection file and the
//!   `ipc://` sockets, which runsc's `--host-uds` makes real host sockets; the workspace's
//!   mount point; the kernel's log; the bundle with runsc's `--root` state), at a path
//!   that stays the same for every gateway on this state directory.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::sync::watch;

use super::cgroups::{cgroup_dirs, end_and_remove_cgroup_dirs, remove_cgroup_dirs};
use super::error::setup;
use super::exit::report;
use super::handle::{Commands, GvisorHandle, KeeperLink};
use super::keeper::{Exited, KeeperPlan, CONTROL_FD, GVISOR_KEEPER_ARG};
use super::runsc::Runsc;
use super::workspace::WorkspaceMount;
use super::{GvisorSandbox, RunNames};
use crate::protocol::ConnectionInfo;
use crate::sandbox::namespaces::survival::{self, Proc, Survival, SurvivalError};
use crate::sandbox::{ExitCause, ExitReason, ExitReport, LaunchSpec, Launched, SandboxError};

/// What tells a gVisor record from a namespaces sandbox's.
const BACKEND: &str = "gvisor";

/// A surviving gVisor sandbox, as the gateway that started it wrote it down.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct GvisorRecord {
    /// Always [`BACKEND`].
    backend: String,
    pub(super) kernel_id: String,
    pub(super) generation: u64,
    pub(super) key: String,
    /// The keeper: `runsc run`'s parent, holder of the workspace's mount namespace.
    pub(super) keeper: Proc,
    container_id: String,
    runsc: PathBuf,
    /// runsc's global arguments (its `--root` below the bundle, the platform).
    global: Vec<String>,
    bundle: PathBuf,
    cgroup_dirs: Vec<PathBuf>,
    memory_limit: Option<u64>,
    private_workspace: bool,
    uid: u32,
    gid: u32,
    /// How the gateway reaches the kernel (host `ipc://` paths).
    connection: ConnectionInfo,
    /// The kernel's directories (`k/`).
    kernel_dir: PathBuf,
    /// When the kernel started (Unix time, milliseconds).
    pub(super) started_ms: u64,
}

impl GvisorRecord {
    fn keeper_alive(&self) -> bool {
        survival::start_time(self.keeper.pid) == Some(self.keeper.start)
    }

    fn runsc(&self, timeout: Duration) -> Runsc {
        Runsc {
            program: self.runsc.clone(),
            global: self.global.clone(),
            id: self.container_id.clone(),
            timeout,
        }
    }
}

/// The gVisor record of `kernel_id`, if it has one.
pub(super) fn read(survival: &Survival, kernel_id: &str) -> Result<GvisorRecord, SurvivalError> {
    let record: GvisorRecord = survival.read_record(kernel_id)?;
    if record.backend != BACKEND || record.kernel_id != kernel_id {
        return Err(SurvivalError::BadRecord(format!(
            "a {} record of kernel {}",
            record.backend, record.kernel_id
        )));
    }
    Ok(record)
}

/// Forgets the sandbox of `kernel_id`'s `generation`, which ended: its control socket and
/// its record (when it is that generation's).
fn forget(survival: &Survival, kernel_id: &str, generation: u64) {
    if read(survival, kernel_id).is_ok_and(|r| r.generation == generation) {
        survival.remove_record(kernel_id, generation);
    } else if let Some(path) = survival.control_path(kernel_id, generation) {
        let _ = std::fs::remove_file(path);
    }
}

/// What a sandbox whose keeper is gone may have left (a keeper killed before it could
/// clean up): runsc's container, the bundle, the cgroups, the kernel's directories and
/// the control socket. The record stays, for the session layer to report the sandbox lost.
fn remove_leftovers(survival: &Survival, record: &GvisorRecord, timeout: Duration) {
    if record.bundle.exists() {
        let _ = record.runsc(timeout).run(&["delete", "--force"], &[]);
    }
    end_and_remove_cgroup_dirs(&record.cgroup_dirs);
    let _ = std::fs::remove_dir_all(&record.kernel_dir);
    if let Some(path) = survival.control_path(&record.kernel_id, record.generation) {
        let _ = std::fs::remove_file(path);
    }
}

/// Ends at once the gVisor sandboxes recorded here that no session claims (see
/// [`Survival::end_unclaimed`]): each keeper, pinned, is killed (`runsc run` and the
/// sandbox end with it), then what it would have cleaned up is removed, and the record.
/// Blocking; the number ended.
pub(super) fn end_unclaimed(
    survival: &Survival,
    claimed: &dyn Fn(&str) -> bool,
    timeout: Duration,
) -> usize {
    let Ok(entries) = std::fs::read_dir(&survival.dir) else {
        return 0;
    };
    let mut ended = 0;
    for entry in entries.flatten() {
        let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if claimed(&id) {
            continue;
        }
        let Ok(record) = read(survival, &id) else {
            continue;
        };
        if survival::kill_pinned(&record.keeper) {
            ended += 1;
        }
        survival::wait_gone(&record.keeper, survival::UNCLAIMED_WAIT);
        remove_leftovers(survival, &record, timeout);
        survival.remove(&id);
    }
    ended
}

/// At the backend's start: the gVisor sandboxes recorded here whose keeper is gone lose
/// what they left; their records stay for the session layer to report them lost.
pub(super) fn sweep(survival: &Survival, timeout: Duration) {
    let Ok(entries) = std::fs::read_dir(&survival.dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if let Ok(record) = read(survival, &id) {
            if !record.keeper_alive() {
                remove_leftovers(survival, &record, timeout);
            }
        }
    }
}

impl GvisorSandbox {
    /// Starts `spec`'s kernel under a keeper that outlives the gateway, and records it.
    #[allow(unsafe_code)] // the workspace mount's `pre_exec` hook
    pub(super) async fn launch_kept(
        &self,
        spec: &LaunchSpec,
        survival: &Survival,
    ) -> Result<Launched, SandboxError> {
        let (view, ro_paths) = self.view(spec)?;
        self.hand_over(spec)?;
        let names = RunNames::new(spec)?;
        let cgroup_memory = spec.limits.memory_cgroup_bytes(spec.limits.workspace_bytes);
        let memory_cgroup = self.pre_create_cgroups(spec, &names.cgroup_path, cgroup_memory);
        let dirs = if self.config.cgroups {
            cgroup_dirs(&names.cgroup_path)
        } else {
            Vec::new()
        };
        let failed = |err: SandboxError| {
            let _ = std::fs::remove_dir_all(&names.bundle);
            remove_cgroup_dirs(&dirs);
            err
        };
        self.build_bundle(spec, &names, view, ro_paths)
            .await
            .map_err(failed)?;
        let kernel_dir = spec
            .log_file
            .parent()
            .map(Path::to_owned)
            .unwrap_or_default();
        let listener = survival
            .control_listener(&spec.kernel_id, spec.generation)
            .map_err(|err| failed(setup(format!("the keeper's control socket: {err}"))))?;
        let global = self.global_args(&names.state);
        let mut run = global.clone();
        run.extend(self.run_flags());
        run.extend([
            "run".to_owned(),
            "--bundle".to_owned(),
            names.bundle.display().to_string(),
            names.container_id.clone(),
        ]);
        let plan = KeeperPlan {
            runsc: self.runsc.clone(),
            global: global.clone(),
            run,
            container_id: names.container_id.clone(),
            bundle: names.bundle.clone(),
            cgroup_dirs: dirs.clone(),
            memory_cgroup: memory_cgroup.clone(),
            grace_ms: u64::try_from(survival.grace.as_millis()).unwrap_or(u64::MAX),
            key: spec.connection.key.clone(),
            orphan_leftovers: [
                Some(kernel_dir.clone()),
                survival.control_path(&spec.kernel_id, spec.generation),
            ]
            .into_iter()
            .flatten()
            .collect(),
            workspace_mount: spec.limits.workspace_bytes.map(|_| spec.workspace.clone()),
            command_timeout_ms: u64::try_from(self.config.command_timeout.as_millis())
                .unwrap_or(u64::MAX),
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&spec.log_file)
            .map_err(|err| failed(setup(format!("open {}: {err}", spec.log_file.display()))))?;
        let mut command = Command::new(&self.config.keeper_program);
        command
            .arg(GVISOR_KEEPER_ARG)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .current_dir("/")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(false);
        if let Some(bytes) = spec.limits.workspace_bytes {
            let mount =
                WorkspaceMount::new(&spec.workspace, bytes, self.config.uid, self.config.gid)
                    .map_err(failed)?;
            // SAFETY: the closure runs in the forked child before exec and only makes
            // system calls (unshare, mount) on memory prepared before the fork.
            unsafe {
                command.pre_exec(move || mount.apply());
            }
        }
        let spawned = self
            .spawner
            .spawn_with(command, false, Some((listener.as_raw_fd(), CONTROL_FD)))
            .await;
        // The keeper has its own copy now.
        drop(listener);
        let mut child = spawned.map_err(|source| {
            failed(SandboxError::Spawn {
                program: self.config.keeper_program.display().to_string(),
                source,
            })
        })?;
        let keeper_pid = child.id().unwrap_or(0);
        let pidfd = i32::try_from(keeper_pid)
            .ok()
            .and_then(|pid| crate::sandbox::sys::pidfd_open(pid).ok());
        let started = start_keeper(&mut child, &plan, self.config.command_timeout).await;
        let (commands, events) = match started {
            Ok(pipes) => pipes,
            Err(err) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                forget(survival, &spec.kernel_id, spec.generation);
                return Err(failed(err));
            }
        };
        let keeper = i32::try_from(keeper_pid)
            .ok()
            .and_then(Proc::of)
            .ok_or_else(|| setup("the keeper is gone"));
        let record = keeper.map(|keeper| GvisorRecord {
            backend: BACKEND.to_owned(),
            kernel_id: spec.kernel_id.clone(),
            generation: spec.generation,
            key: spec.connection.key.clone(),
            keeper,
            container_id: names.container_id.clone(),
            runsc: self.runsc.clone(),
            global: global.clone(),
            bundle: names.bundle.clone(),
            cgroup_dirs: dirs.clone(),
            memory_limit: cgroup_memory,
            private_workspace: spec.limits.workspace_bytes.is_some(),
            uid: self.config.uid,
            gid: self.config.gid,
            connection: spec.connection.clone(),
            kernel_dir,
            started_ms: survival::now_ms(),
        });
        if let Err(err) = record.and_then(|record| {
            survival
                .write_record(&spec.kernel_id, &record)
                .map_err(|err| setup(err.to_string()))
        }) {
            // Not fatal: the kernel runs, no later gateway can adopt it (its orphan ends
            // after the grace).
            tracing::warn!(kernel_id = %spec.kernel_id, %err, "the kernel's record could not be written: no later gateway can adopt it");
        }
        let runsc = Runsc {
            program: self.runsc.clone(),
            global,
            id: names.container_id.clone(),
            timeout: self.config.command_timeout,
        };
        tracing::info!(kernel_id = %spec.kernel_id, container = %names.container_id, keeper_pid, "kernel started in gVisor under a keeper (it outlives the gateway)");
        Ok(self.kept_handle(
            spec,
            Kept {
                keeper_pid,
                pidfd,
                private_workspace: spec.limits.workspace_bytes.is_some(),
                runsc,
                cgroup_dirs: dirs,
                memory_limit: cgroup_memory,
                commands: Commands::Pipe(commands),
                events: Box::new(events),
                child: Some(child),
                survival: survival.clone(),
                generation: spec.generation,
                connection: spec.connection.clone(),
            },
        ))
    }

    /// Attaches to the sandbox of `spec`'s kernel that outlived the gateway before this
    /// one: its keeper must be the recorded process and accept this gateway's key.
    pub(super) async fn adopt(
        &self,
        spec: &LaunchSpec,
        survival: &Survival,
    ) -> Result<Launched, SandboxError> {
        let found = {
            let (survival, id, key) = (
                survival.clone(),
                spec.kernel_id.clone(),
                spec.connection.key.clone(),
            );
            tokio::task::spawn_blocking(move || find_survivor(&survival, &id, &key))
                .await
                .map_err(|err| setup(format!("adoption task: {err}")))?
        };
        let (record, pidfd, stream) = match found {
            Ok(found) => found,
            Err(err) => {
                // A sandbox that is gone, or one this gateway cannot prove it may hold, is
                // not tried again: its leftovers and record go (an orphan ends after its
                // grace).
                let (survival2, id, timeout) = (
                    survival.clone(),
                    spec.kernel_id.clone(),
                    self.config.command_timeout,
                );
                let _ = tokio::task::spawn_blocking(move || {
                    if let Ok(record) = read(&survival2, &id) {
                        if !record.keeper_alive() {
                            remove_leftovers(&survival2, &record, timeout);
                        }
                    }
                    survival2.remove(&id);
                })
                .await;
                return Err(setup(format!("the sandbox did not survive: {err}")));
            }
        };
        let io_err = |err: io::Error| setup(format!("the keeper's connection: {err}"));
        let commands = stream.try_clone().map_err(io_err)?;
        stream.set_nonblocking(true).map_err(io_err)?;
        let events = tokio::net::UnixStream::from_std(stream).map_err(io_err)?;
        tracing::info!(kernel_id = %spec.kernel_id, keeper_pid = record.keeper.pid, "kernel adopted: its gVisor sandbox outlived the gateway before this one");
        Ok(self.kept_handle(
            spec,
            Kept {
                keeper_pid: u32::try_from(record.keeper.pid).unwrap_or(0),
                pidfd: Some(pidfd),
                private_workspace: record.private_workspace,
                runsc: record.runsc(self.config.command_timeout),
                cgroup_dirs: record.cgroup_dirs.clone(),
                memory_limit: record.memory_limit,
                commands: Commands::Stream(commands),
                events: Box::new(events),
                child: None,
                survival: survival.clone(),
                generation: record.generation,
                connection: record.connection.clone(),
            },
        ))
    }

    /// The handle of a kept sandbox, and its exit watcher.
    fn kept_handle(&self, spec: &LaunchSpec, kept: Kept) -> Launched {
        let exited = Arc::new(AtomicBool::new(false));
        let link = KeeperLink {
            commands: Arc::new(Mutex::new(Some(kept.commands))),
            detached: Arc::new(AtomicBool::new(false)),
        };
        let (exit_tx, exit_rx) = watch::channel(None);
        let watched = kept.pidfd.as_ref().and_then(|fd| fd.try_clone().ok());
        tokio::spawn(watch_keeper(Watch {
            events: kept.events,
            child: kept.child,
            pidfd: watched,
            exited: exited.clone(),
            link: link.clone(),
            memory_limit: kept.memory_limit,
            exit_tx,
            survival: kept.survival,
            kernel_id: spec.kernel_id.clone(),
            generation: kept.generation,
        }));
        Launched {
            handle: Arc::new(GvisorHandle {
                pid: kept.keeper_pid,
                pidfd: kept.pidfd,
                private_workspace: kept.private_workspace,
                uid: self.config.uid,
                gid: self.config.gid,
                exited,
                runsc: kept.runsc,
                cgroup_dirs: kept.cgroup_dirs,
                keeper: Some(link),
            }),
            exit: exit_rx,
            connection: kept.connection,
        }
    }
}

/// A kept sandbox, launched or adopted.
struct Kept {
    keeper_pid: u32,
    pidfd: Option<OwnedFd>,
    private_workspace: bool,
    runsc: Runsc,
    cgroup_dirs: Vec<PathBuf>,
    memory_limit: Option<u64>,
    commands: Commands,
    events: Box<dyn AsyncRead + Unpin + Send>,
    /// The keeper when this gateway started it (reaped by the watcher).
    child: Option<tokio::process::Child>,
    survival: Survival,
    generation: u64,
    connection: ConnectionInfo,
}

/// Hands the keeper its plan and waits until it has started `runsc run`; its command pipe
/// and its report stream.
async fn start_keeper(
    child: &mut tokio::process::Child,
    plan: &KeeperPlan,
    timeout: Duration,
) -> Result<(std::fs::File, tokio::process::ChildStdout), SandboxError> {
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Err(setup("the keeper has no pipes"));
    };
    let mut line = serde_json::to_vec(plan).map_err(|err| setup(format!("the plan: {err}")))?;
    line.push(b'\n');
    stdin
        .write_all(&line)
        .await
        .map_err(|err| setup(format!("hand the keeper its plan: {err}")))?;
    let mut reader = BufReader::new(stdout);
    let mut first = String::new();
    let read = tokio::time::timeout(timeout, reader.read_line(&mut first)).await;
    if !matches!(read, Ok(Ok(n)) if n > 0) || !first.starts_with("running ") {
        return Err(setup(
            "the sandbox's keeper could not start runsc (see the kernel's log)",
        ));
    }
    let stdin = stdin
        .into_owned_fd()
        .map_err(|err| setup(format!("the keeper's command pipe: {err}")))?;
    // The reader's buffer is empty: the keeper writes nothing more before `exited`.
    Ok((std::fs::File::from(stdin), reader.into_inner()))
}

/// The recorded sandbox of `kernel_id`, if its keeper is the recorded process and accepts
/// `key`: the record, a pidfd of the keeper and the control connection.
fn find_survivor(
    survival: &Survival,
    kernel_id: &str,
    key: &str,
) -> Result<(GvisorRecord, OwnedFd, UnixStream), SurvivalError> {
    let record = read(survival, kernel_id)?;
    // The pidfd first, then the start time: a pidfd of a reused pid would name the wrong
    // process, and the start time tells.
    let pidfd = crate::sandbox::sys::pidfd_open(record.keeper.pid)
        .map_err(|_| SurvivalError::Gone("keeper"))?;
    if !record.keeper_alive() || crate::sandbox::sys::pidfd_exited(&pidfd) {
        return Err(SurvivalError::Gone("keeper"));
    }
    let stream = survival.attach(kernel_id, record.generation, key)?;
    Ok((record, pidfd, stream))
}

/// What the exit watcher of a kept sandbox needs.
struct Watch {
    events: Box<dyn AsyncRead + Unpin + Send>,
    child: Option<tokio::process::Child>,
    pidfd: Option<OwnedFd>,
    exited: Arc<AtomicBool>,
    link: KeeperLink,
    memory_limit: Option<u64>,
    exit_tx: watch::Sender<Option<ExitReport>>,
    survival: Survival,
    kernel_id: String,
    generation: u64,
}

/// Waits for the keeper's `exited` report (or its end) and turns it into the exit report;
/// a sandbox let go for the next gateway (detached) reports nothing.
async fn watch_keeper(watch: Watch) {
    let Watch {
        events,
        mut child,
        pidfd,
        exited,
        link,
        memory_limit,
        exit_tx,
        survival,
        kernel_id,
        generation,
    } = watch;
    let mut lines = BufReader::new(events).lines();
    let mut reported: Option<Exited> = None;
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(json) = line.strip_prefix("exited ") {
            reported = serde_json::from_str(json).ok();
            break;
        }
    }
    let detached = link.detached.load(Ordering::SeqCst);
    if !detached || reported.is_some() {
        exited.store(true, Ordering::SeqCst);
    }
    if detached {
        return;
    }
    let report = match reported {
        Some(exited) => report(
            exited.ended,
            exited.pids_hits,
            exited.oom_kills,
            memory_limit,
        ),
        None => ExitReport {
            code: None,
            signal: None,
            reason: Some(ExitReason::new(
                ExitCause::SandboxFailed,
                "the gVisor sandbox's keeper ended without a report (see the kernel's log)"
                    .to_owned(),
            )),
        },
    };
    // Forgotten before the report: the report may start the kernel's next generation, whose
    // record this must not remove.
    forget(&survival, &kernel_id, generation);
    let _ = exit_tx.send(Some(report));
    // The keeper cleans up after the sandbox, then ends.
    if let Some(commands) = link.commands.lock().take() {
        commands.close();
    }
    match (child.as_mut(), pidfd) {
        (Some(child), _) => {
            let _ = child.wait().await;
        }
        (None, Some(pidfd)) => crate::sandbox::sys::pidfd_wait(pidfd).await,
        (None, None) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_state_directories_are_refused_for_kept_sandboxes() {
        let kept = |dir: &str| Survival {
            dir: PathBuf::from(dir),
            grace: Duration::from_secs(1),
        };
        assert!(kept("/var/lib/cellgate/state/sandboxes").kept_paths_fit());
        assert!(!kept(&format!("/{}/sandboxes", "x".repeat(60))).kept_paths_fit());
    }

    #[test]
    fn a_record_of_another_backend_does_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let survival = Survival {
            dir: dir.path().to_owned(),
            grace: Duration::from_secs(1),
        };
        std::fs::create_dir(dir.path().join("k1")).unwrap();
        survival
            .write_record(
                "k1",
                &serde_json::json!({"kernel_id": "k1", "generation": 1}),
            )
            .unwrap();
        assert!(matches!(
            read(&survival, "k1"),
            Err(SurvivalError::BadRecord(_))
        ));
        assert!(matches!(
            read(&survival, "k2"),
            Err(SurvivalError::NoRecord)
        ));
    }
}
