//! MicroVMs that outlive their gateway (see the backend's *Outliving the gateway*): the
//! keeper's start, the record the next gateway re-finds a VM by, its adoption, and the
//! sweep of what VMs that ended without a gateway left.
//!
//! Per kernel, in `<state dir>/sandboxes/<kernel id>/` (0700; the namespaces backend's
//! [`Survival`] makes the directory and the control socket and runs the key exchange):
//! * `record.json` (0600): [`MicrovmRecord`], with the kernel's key;
//! * `control-g<generation>.sock`: the keeper's control socket;
//! * `k/`: the kernel's directories; the VM's runtime directory below `k/run/` holds its
//!   console, workspace disk, the virtio-serial socket QEMU listens on (`agent.sock`, which
//!   the next gateway connects to) and, for a VM that may hibernate, its QMP socket.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use std::sync::Arc;

use super::confine::Jail;
use super::handle::{KeeperLink, Kept, MicrovmHandle, VmmProcess};
use super::keeper::{KeeperPlan, CONTROL_FD, MICROVM_KEEPER_ARG};
use super::{link, MicrovmError, VmSize};
use crate::sandbox::cgroups::{CgroupParts, KernelCgroup};
use crate::sandbox::namespaces::survival::{self, Proc, Survival, SurvivalError};
use crate::sandbox::spawner::Spawner;
use crate::sandbox::{LaunchSpec, Launched};

/// What tells a microVM record from the other backends'.
const BACKEND: &str = "microvm";
/// The kernel's directories below its survival directory. The VM's own sockets there are
/// a few bytes longer than the kernel channels' that `Survival::kept_paths_fit` measures:
/// QEMU binds them by a relative name, and they are reached through their directory
/// (`link::connect_unix`).
use survival::KEPT_KERNEL_DIR as KERNEL_DIR;
/// How long the keeper may take to say it holds the VMM.
const KEEPER_START: Duration = Duration::from_secs(10);

/// The keeper of a record written between the VMM's start and its keeper's: none. A gateway
/// killed in that window leaves a VM nothing would end; the next one's sweep finds it by
/// this record (a live VMM without a live keeper) and ends it. No process has pid 0, so
/// nothing is ever signalled through it.
pub(super) const NO_KEEPER: Proc = Proc { pid: 0, start: 0 };

/// A microVM that outlives its gateway, as the gateway that started it wrote it down.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct MicrovmRecord {
    /// Always [`BACKEND`].
    backend: String,
    pub(super) kernel_id: String,
    pub(super) generation: u64,
    pub(super) key: String,
    /// QEMU, pinned by its start time.
    pub(super) vmm: Proc,
    /// The process that ends the VM when no gateway holds it; [`NO_KEEPER`] in the record
    /// written before the keeper starts.
    pub(super) keeper: Proc,
    /// The VM's runtime directory (the VMM's working directory).
    pub(super) vm_dir: PathBuf,
    /// The kernel's log, where the VMM writes.
    pub(super) log_file: PathBuf,
    /// The VMM's own uid, under a root gateway.
    pub(super) uid: Option<u32>,
    pub(super) cgroup: Option<CgroupParts>,
    pub(super) memory_mib: u64,
    pub(super) vcpus: u32,
    /// The kernel's directories (`k/`).
    pub(super) kernel_dir: PathBuf,
    /// When the kernel started (Unix time, milliseconds).
    pub(super) started_ms: u64,
}

impl MicrovmRecord {
    #[expect(clippy::too_many_arguments, reason = "one record, field by field")]
    pub(super) fn new(
        spec: &LaunchSpec,
        vmm: Proc,
        keeper: Proc,
        uid: Option<u32>,
        cgroup: Option<CgroupParts>,
        size: VmSize,
        kernel_dir: PathBuf,
        started_ms: u64,
    ) -> MicrovmRecord {
        MicrovmRecord {
            backend: BACKEND.to_owned(),
            kernel_id: spec.kernel_id.clone(),
            generation: spec.generation,
            key: spec.connection.key.clone(),
            vmm,
            keeper,
            vm_dir: spec.runtime_dir.clone(),
            log_file: spec.log_file.clone(),
            uid,
            cgroup,
            memory_mib: size.memory_mib,
            vcpus: size.vcpus,
            kernel_dir,
            started_ms,
        }
    }

    pub(super) fn vmm_alive(&self) -> bool {
        survival::start_time(self.vmm.pid) == Some(self.vmm.start)
    }
}

/// The microVM record of `kernel_id`, if it has one.
pub(super) fn read(survival: &Survival, kernel_id: &str) -> Result<MicrovmRecord, SurvivalError> {
    let record: MicrovmRecord = survival.read_record(kernel_id)?;
    if record.backend != BACKEND || record.kernel_id != kernel_id {
        return Err(SurvivalError::BadRecord(format!(
            "a {} record of kernel {}",
            record.backend, record.kernel_id
        )));
    }
    Ok(record)
}

/// What a VM whose VMM is gone may have left (its keeper killed too, or it ended while no
/// gateway was there to see): the cgroup, the kernel's directories and the control socket.
/// The record stays, for the session layer to report the sandbox lost.
fn remove_leftovers(survival: &Survival, record: &MicrovmRecord) {
    if let Some(cgroup) = record.cgroup.as_ref().and_then(KernelCgroup::from_parts) {
        cgroup.remove();
    }
    let _ = std::fs::remove_dir_all(&record.kernel_dir);
    if let Some(path) = survival.control_path(&record.kernel_id, record.generation) {
        let _ = std::fs::remove_file(path);
    }
}

/// Ends at once the VMs recorded here that no session claims: each VMM and keeper, pinned,
/// is killed, then what they leave is removed, and the record. Blocking; the number ended.
pub(super) fn end_unclaimed(survival: &Survival, claimed: &dyn Fn(&str) -> bool) -> usize {
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
        // The keeper first: it would otherwise clean up beside this.
        survival::kill_pinned(&record.keeper);
        if survival::kill_pinned(&record.vmm) {
            ended += 1;
        }
        survival::wait_gone(&record.vmm, survival::UNCLAIMED_WAIT);
        remove_leftovers(survival, &record);
        survival.remove(&id);
    }
    ended
}

/// At the backend's start: the VMs recorded here whose VMM is gone lose what they left;
/// their records stay for the session layer to report them lost.
pub(super) fn sweep(survival: &Survival) {
    let Ok(entries) = std::fs::read_dir(&survival.dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if let Ok(record) = read(survival, &id) {
            let keeper_alive = record.keeper != NO_KEEPER
                && survival::start_time(record.keeper.pid) == Some(record.keeper.start);
            if record.vmm_alive() && !keeper_alive {
                // Nothing would end it after its grace: ended now, reported lost.
                survival::kill_pinned(&record.vmm);
                survival::wait_gone(&record.vmm, survival::UNCLAIMED_WAIT);
            }
            if !record.vmm_alive() {
                survival::kill_pinned(&record.keeper);
                remove_leftovers(survival, &record);
            }
        }
    }
}

/// Starts the keeper of the VM whose VMM is `vmm` (see `keeper.rs`) and waits until it holds
/// the VMM; its command pipe, whose closing (this gateway gone) starts its grace.
pub(super) async fn start_keeper(
    spawner: &Spawner,
    survival: &Survival,
    spec: &LaunchSpec,
    vmm: Proc,
    cgroup: Option<CgroupParts>,
    kernel_dir: &Path,
) -> Result<(std::fs::File, Proc), MicrovmError> {
    let start = |e: String| MicrovmError::Start(format!("the VM's keeper: {e}"));
    let listener = survival
        .control_listener(&spec.kernel_id, spec.generation)
        .map_err(|e| start(e.to_string()))?;
    let plan = KeeperPlan {
        vmm,
        grace_ms: u64::try_from(survival.grace.as_millis()).unwrap_or(u64::MAX),
        key: spec.connection.key.clone(),
        cgroup,
        orphan_leftovers: [
            Some(kernel_dir.to_owned()),
            survival.control_path(&spec.kernel_id, spec.generation),
        ]
        .into_iter()
        .flatten()
        .collect(),
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log_file)
        .map_err(|e| start(format!("{}: {e}", spec.log_file.display())))?;
    let mut command = tokio::process::Command::new("/proc/self/exe");
    command
        .arg(MICROVM_KEEPER_ARG)
        .env_clear()
        .current_dir("/")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .process_group(0)
        .kill_on_drop(false);
    let spawned = spawner
        .spawn_with(command, false, Some((listener.as_raw_fd(), CONTROL_FD)))
        .await;
    drop(listener);
    let mut child = spawned.map_err(|e| start(e.to_string()))?;
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.start_kill();
        return Err(start("no pipes".to_owned()));
    };
    let talk = async {
        let mut line = serde_json::to_vec(&plan).map_err(io::Error::other)?;
        line.push(b'\n');
        stdin.write_all(&line).await?;
        let mut reader = BufReader::new(stdout);
        let mut first = String::new();
        reader.read_line(&mut first).await?;
        Ok::<String, io::Error>(first)
    };
    let first = tokio::time::timeout(KEEPER_START, talk).await;
    if !matches!(&first, Ok(Ok(line)) if line.trim_end() == "running") {
        let _ = child.start_kill();
        let _ = child.wait().await;
        return Err(start(format!(
            "it did not start ({first:?}; see the kernel's log)"
        )));
    }
    let keeper = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .and_then(Proc::of)
        .ok_or_else(|| start("it ended at once".to_owned()))?;
    // The keeper outlives this gateway; while both run, a task reaps it when it ends.
    tokio::spawn(async move {
        let _ = child.wait().await;
    });
    let stdin = stdin
        .into_owned_fd()
        .map_err(|e| start(format!("its command pipe: {e}")))?;
    Ok((std::fs::File::from(stdin), keeper))
}

/// The recorded VM of `kernel_id`, if its VMM is the recorded process and its keeper
/// accepts `key`: the record, a pidfd of the VMM and the control connection to the keeper.
/// Blocking.
pub(super) fn find_survivor(
    survival: &Survival,
    kernel_id: &str,
    key: &str,
) -> Result<(MicrovmRecord, OwnedFd, std::os::unix::net::UnixStream), SurvivalError> {
    let record = read(survival, kernel_id)?;
    if record.key != key {
        return Err(SurvivalError::Refused(
            "the kernel's key is not the one its VM was started with".to_owned(),
        ));
    }
    // The pidfd first, then the start time: a pidfd of a reused pid would name the wrong
    // process, and the start time tells.
    let pidfd =
        crate::sandbox::sys::pidfd_open(record.vmm.pid).map_err(|_| SurvivalError::Gone("VMM"))?;
    if !record.vmm_alive() || crate::sandbox::sys::pidfd_exited(&pidfd) {
        return Err(SurvivalError::Gone("VMM"));
    }
    let stream = survival.attach(kernel_id, record.generation, key)?;
    Ok((record, pidfd, stream))
}

/// The serial socket of a recorded VM, which QEMU listens on.
pub(super) fn serial_socket(record: &MicrovmRecord) -> PathBuf {
    record.vm_dir.join(link::SERIAL_SOCKET)
}

/// Forgets `kernel_id`'s kept VM (which the kernel layer ended or will not restore): its
/// record and control socket; the whole directory once the kernel's own directories (`k/`)
/// are gone (a shutdown removes them first). Why not always the whole directory: before a
/// restart the kernel layer forgets the old sandbox and then starts the next generation in
/// `k/` (seen: a hibernated kernel's restart failed, its `k/run` gone).
pub(super) fn forget(survival: &Survival, kernel_id: &str) {
    if let Ok(record) = read(survival, kernel_id) {
        survival.remove_record(kernel_id, record.generation);
    }
    if let Some(dir) = survival.kernel_dir(kernel_id) {
        if !dir.join(KERNEL_DIR).exists() {
            survival.remove(kernel_id);
        }
    }
}

/// After a failed adoption: the VM is ended (keeper first, each pinned) and leaves nothing,
/// and its record goes. Why not leave a live one to its keeper's grace: with its record gone
/// nothing would end it if its keeper is gone too, and a keeper ending it later would
/// remove the kernel's directories that its session's next generation uses by then.
pub(super) fn give_up(survival: &Survival, kernel_id: &str) {
    if let Ok(record) = read(survival, kernel_id) {
        survival::kill_pinned(&record.keeper);
        survival::kill_pinned(&record.vmm);
        survival::wait_gone(&record.vmm, survival::UNCLAIMED_WAIT);
        remove_leftovers(survival, &record);
    }
    survival.remove(kernel_id);
}

/// The uids of the recorded VMMs that still run, which no new VM may be given (a VM of
/// this gateway sharing a surviving VM's uid could signal, trace or read it).
pub(super) fn live_uids(survival: &Survival) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(&survival.dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().map(str::to_owned))
        .filter_map(|id| read(survival, &id).ok())
        .filter(MicrovmRecord::vmm_alive)
        .filter_map(|record| record.uid)
        .collect()
}

impl super::Core {
    /// Puts the VM whose VMM is `pid` under a keeper (see `keeper.rs`): what its handle
    /// holds of it.
    pub(super) async fn keep(
        &self,
        spec: &LaunchSpec,
        survival: &Survival,
        pid: u32,
        jail: &Jail,
        size: VmSize,
    ) -> Result<Kept, MicrovmError> {
        let vmm = i32::try_from(pid)
            .ok()
            .and_then(Proc::of)
            .ok_or_else(|| MicrovmError::Start("the VMM ended at once".to_owned()))?;
        let kernel_dir = survival
            .kernel_dir(&spec.kernel_id)
            .map(|dir| dir.join(KERNEL_DIR))
            .ok_or_else(|| MicrovmError::Start("not a kernel id".to_owned()))?;
        // Recorded before the keeper starts (see NO_KEEPER): QEMU has no parent-death
        // signal, so from here on only a record lets a next gateway find it.
        let provisional = MicrovmRecord::new(
            spec,
            vmm,
            NO_KEEPER,
            jail.uid(),
            jail.cgroup_parts(),
            size,
            kernel_dir.clone(),
            survival::now_ms(),
        );
        survival
            .write_record(&spec.kernel_id, &provisional)
            .map_err(|e| MicrovmError::Start(format!("the VM's record: {e}")))?;
        let started = start_keeper(
            &self.spawner,
            survival,
            spec,
            vmm,
            jail.cgroup_parts(),
            &kernel_dir,
        )
        .await;
        let (pipe, keeper) = match started {
            Ok(started) => started,
            Err(error) => {
                // The caller ends the VMM. Only the record goes: the kernel's directories
                // (`k/`: workspace, log) and its egress directory are its next generation's.
                survival.remove_record(&spec.kernel_id, spec.generation);
                return Err(error);
            }
        };
        // The keeper is known now: a gateway killed while the VM boots leaves a record whose
        // keeper the next gateway's sweep finds alive (it ends the orphan after its grace).
        let with_keeper = MicrovmRecord {
            keeper,
            ..provisional
        };
        if let Err(error) = survival.write_record(&spec.kernel_id, &with_keeper) {
            tracing::warn!(kernel_id = %spec.kernel_id, %error, "microvm: the VM's record could not be rewritten with its keeper");
        }
        Ok(Kept {
            keeper: parking_lot::Mutex::new(Some(KeeperLink::Pipe(pipe))),
            keeper_proc: keeper,
            survival: survival.clone(),
            kernel_id: spec.kernel_id.clone(),
            generation: spec.generation,
        })
    }

    /// Writes the record of a kept VM whose kernel started. Not fatal when it cannot be:
    /// the kernel runs, and no later gateway can adopt it (its orphan ends after the grace).
    pub(super) fn record(
        &self,
        spec: &LaunchSpec,
        survival: &Survival,
        kept: &Kept,
        pid: u32,
        jail: &Jail,
        size: VmSize,
    ) {
        let written = i32::try_from(pid)
            .ok()
            .and_then(Proc::of)
            .ok_or_else(|| "the VMM is gone".to_owned())
            .and_then(|vmm| {
                let record = MicrovmRecord::new(
                    spec,
                    vmm,
                    kept.keeper_proc,
                    jail.uid(),
                    jail.cgroup_parts(),
                    size,
                    survival
                        .kernel_dir(&spec.kernel_id)
                        .map(|dir| dir.join(KERNEL_DIR))
                        .unwrap_or_default(),
                    survival::now_ms(),
                );
                survival
                    .write_record(&spec.kernel_id, &record)
                    .map_err(|e| e.to_string())
            });
        if let Err(error) = written {
            tracing::warn!(kernel_id = %spec.kernel_id, %error, "microvm: the VM's record could not be written: no later gateway can adopt it");
        }
    }

    /// Attaches to the VM of `spec`'s kernel that outlived the gateway before this one: its
    /// VMM must be the recorded process, its keeper must accept this gateway's key, and its
    /// agent must prove the key too (and be proven it) before anything is served.
    pub(super) async fn adopt_running(
        &self,
        spec: &LaunchSpec,
        survival: &Survival,
    ) -> Result<Launched, MicrovmError> {
        let started = std::time::Instant::now();
        let found = {
            let (survival, id, key) = (
                survival.clone(),
                spec.kernel_id.clone(),
                spec.connection.key.clone(),
            );
            tokio::task::spawn_blocking(move || find_survivor(&survival, &id, &key))
                .await
                .map_err(|e| MicrovmError::Start(format!("adoption task: {e}")))?
        };
        let (record, pidfd, stream) = match found {
            Ok(found) => found,
            Err(error) => {
                let (survival, id) = (survival.clone(), spec.kernel_id.clone());
                let _ = tokio::task::spawn_blocking(move || give_up(&survival, &id)).await;
                return Err(MicrovmError::Start(format!(
                    "the VM did not survive: {error}"
                )));
            }
        };
        let attached = self
            .attach_survivor(spec, survival, &record, &pidfd, stream)
            .await;
        match attached {
            Ok(launched) => {
                tracing::info!(kernel_id = %spec.kernel_id, vmm_pid = record.vmm.pid, seconds = started.elapsed().as_secs_f64(), "microvm: VM adopted: it outlived the gateway before this one");
                Ok(launched)
            }
            Err(error) => {
                // It proved nothing, or broke the protocol: it is not kept for anyone.
                let _ = crate::sandbox::sys::pidfd_send_signal(&pidfd, libc::SIGKILL);
                let gone = pidfd.try_clone().ok();
                if let Some(gone) = gone {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(10),
                        crate::sandbox::sys::pidfd_wait(gone),
                    )
                    .await;
                }
                let (survival, id) = (survival.clone(), spec.kernel_id.clone());
                let _ = tokio::task::spawn_blocking(move || give_up(&survival, &id)).await;
                Err(error)
            }
        }
    }

    async fn attach_survivor(
        &self,
        spec: &LaunchSpec,
        survival: &Survival,
        record: &MicrovmRecord,
        pidfd: &OwnedFd,
        stream: std::os::unix::net::UnixStream,
    ) -> Result<Launched, MicrovmError> {
        let jail = Arc::new(self.confiner.adopt(
            record.uid,
            record.cgroup.as_ref(),
            &record.vm_dir,
        )?);
        let socket = serial_socket(record);
        let io = link::connect_unix(&socket)
            .await
            .map_err(|e| MicrovmError::Start(format!("{}: {e}", socket.display())))?;
        // The VM's directory is the VMM's to write: the socket must be the recorded QEMU's.
        let vmm_pid = u32::try_from(record.vmm.pid).unwrap_or(0);
        link::check_peer(&io, vmm_pid)
            .map_err(|e| MicrovmError::Start(format!("{}: {e}", socket.display())))?;
        let agent = crate::sandbox::agent::Agent::connect(
            io,
            spec.egress_socket.clone(),
            self.config.boot_timeout,
        )
        .await?;
        agent.attach(record.key.as_bytes()).await?;
        let agent = Arc::new(agent);
        let saver = self
            .hibernations
            .clone()
            .filter(|_| spec.backend_settings.hibernate)
            .filter(|_| record.vm_dir.join(super::QMP_SOCKET).exists())
            .map(|hibernations| super::hibernate::Saver {
                hibernations,
                runtime_dir: record.vm_dir.clone(),
                size: VmSize {
                    memory_mib: record.memory_mib,
                    vcpus: record.vcpus,
                },
                machine: self.machine.clone(),
            });
        let kept = Kept {
            keeper: parking_lot::Mutex::new(Some(KeeperLink::Stream(stream))),
            keeper_proc: record.keeper,
            survival: survival.clone(),
            kernel_id: spec.kernel_id.clone(),
            generation: record.generation,
        };
        let handle = Arc::new(MicrovmHandle::new(
            u32::try_from(record.vmm.pid).unwrap_or(0),
            jail,
            saver,
            Some(
                pidfd
                    .try_clone()
                    .map_err(|e| MicrovmError::Start(format!("the VMM's pidfd: {e}")))?,
            ),
            Some(kept),
        ));
        handle.attach(agent.clone());
        if let Err(error) = super::agent::channels::serve(&spec.connection, agent.clone()) {
            agent.close();
            return Err(MicrovmError::Io {
                what: "listening on the kernel's channels".to_owned(),
                source: error,
            });
        }
        let console = open_console(&record.vm_dir)?;
        let (exit_tx, exit_rx) = tokio::sync::watch::channel(None);
        let watched = pidfd
            .try_clone()
            .map_err(|e| MicrovmError::Start(format!("the VMM's pidfd: {e}")))?;
        super::handle::watch_exit(
            VmmProcess::Adopted(watched),
            None,
            agent,
            handle.clone(),
            record.log_file.clone(),
            console,
            exit_tx,
        );
        Ok(Launched {
            handle,
            exit: exit_rx,
            connection: spec.connection.clone(),
        })
    }
}

/// The console of an adopted VM, for reading its last words: opened as a regular file,
/// never through a link the VMM may have put in its place (then nothing is read).
fn open_console(vm_dir: &Path) -> Result<std::fs::File, MicrovmError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = vm_dir.join(super::CONSOLE);
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
        .ok()
        .filter(|file| file.metadata().is_ok_and(|m| m.is_file()));
    match opened {
        Some(file) => Ok(file),
        None => std::fs::File::open("/dev/null").map_err(super::io_error("/dev/null")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_state_directories_are_refused_for_kept_vms() {
        let kept = |dir: &str| Survival {
            dir: PathBuf::from(dir),
            grace: Duration::from_secs(1),
        };
        assert!(kept("/var/lib/cellgate/state/sandboxes").kept_paths_fit());
        assert!(kept("/root/.local/state/cellgate/sandboxes").kept_paths_fit());
        assert!(!kept(&format!("/{}/sandboxes", "x".repeat(40))).kept_paths_fit());
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
                &serde_json::json!({"backend": "gvisor", "kernel_id": "k1", "generation": 1}),
            )
            .unwrap();
        assert!(read(&survival, "k1").is_err());
        assert!(matches!(
            read(&survival, "k2"),
            Err(SurvivalError::NoRecord)
        ));
    }

    /// A gateway killed between starting QEMU and its keeper left only the record written
    /// before the keeper: the next gateway's sweep ends that VMM (a `sleep` stands in for
    /// QEMU) and removes what it left; the record stays, for the session to be reported lost.
    #[test]
    fn a_vm_recorded_before_its_keeper_started_is_ended_by_the_sweep() {
        use std::os::unix::process::ExitStatusExt;
        let dir = tempfile::tempdir().unwrap();
        let survival = Survival {
            dir: dir.path().join("sandboxes"),
            grace: Duration::from_secs(1),
        };
        let mut vmm = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = i32::try_from(vmm.id()).unwrap();
        let kernel_dir = dir.path().join("k");
        std::fs::create_dir(&kernel_dir).unwrap();
        std::fs::create_dir_all(survival.dir.join("k1")).unwrap();
        survival
            .write_record(
                "k1",
                &serde_json::json!({
                    "backend": BACKEND, "kernel_id": "k1", "generation": 1, "key": "x",
                    "vmm": Proc::of(pid).unwrap(), "keeper": NO_KEEPER,
                    "vm_dir": dir.path(), "log_file": dir.path().join("log"),
                    "uid": null, "cgroup": null, "memory_mib": 512, "vcpus": 1,
                    "kernel_dir": kernel_dir, "started_ms": 1
                }),
            )
            .unwrap();
        sweep(&survival);
        let status = vmm.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
        assert!(!kernel_dir.exists());
        assert!(read(&survival, "k1").is_ok());
    }
}
