//! Hibernation: a session's VM saved to disk while it is idle, its memory freed, and
//! restored at the session's next request with its kernel's process and variables.
//!
//! **Saving** ([`save`]): a VM started for a policy with `[limits] hibernate_after` runs on
//! virtio-serial and keeps its VMM's control socket (QEMU 7.2 cannot save a VM with a
//! vhost-user device, the vsock default). The gateway asks the agent to *detach* (it closes
//! the session's streams and the link; the kernel runs on), gives the guest a moment to be
//! back waiting for a host, then stops the VM and writes its state through QMP `migrate`
//! to `<state-dir>/hibernated/<kernel-id>/vm.state`, ends QEMU, and moves the VM's
//! workspace disk beside it (`workspace.ext4`). `record.json` says what the restore needs:
//! the kernel's key, state generation and start, the VM's shape and the guest images it
//! ran. The directory is 0700 and its files 0600, the gateway's own; nothing is followed
//! through a link. The files are written under temporary names and the record last, so a
//! directory without a record is a save that did not finish, and is removed.
//!
//! **Restoring** ([`Core::restore_hibernated`]): a launch that adopts the kernel (the
//! kernel layer asks, with the kernel's key in its connection file) moves the disk back
//! into the new runtime directory, starts QEMU with `-incoming fd:3` on the saved state
//! (the VMM gets the open file, never the path), `cont`, handshakes with the agent and
//! *attaches*: both prove the kernel's key (HMAC over a nonce from each side), so a saved
//! VM serves only a gateway holding the key, and the gateway talks only to its kernel's
//! VM. Then the agent sets the guest's clock and reseeds its generator (`restored`), and
//! the kernel's channels are served again; the kernel itself never noticed. The saved files
//! are removed once the VM runs from them.
//!
//! **What can fail, and how it is said.** A save is not begun without room for it on the
//! state directory's disk (the VM's RAM, its workspace disk's used blocks and a margin): the
//! VM runs on, and a later pass tries again. A save that fails once begun ends the VM (it
//! is stopped by then) and the kernel is reported dead with the reason, as a lost sandbox.
//! A restore that fails before the guest ran, for what the host did (the VMM could not be
//! spawned, was killed by a signal, or ended for want of memory; its keeper did not start;
//! the state took longer to load than the boot timeout; the save could not be read for a
//! passing reason such as no free descriptor) keeps what was saved as it was
//! ([`hand_back`]): the kernel stays hibernated and the next request tries again
//! ([`Waking`] says how far a restore got; the saved disk stays in place until the guest
//! runs, so a restore cut off by a crash loses nothing either). One that cannot work (the
//! files are gone, links or damaged; the guest images or the VM's shape changed; the VMM
//! ended with an exit code while loading the state, which is how QEMU refuses one) or that
//! failed once the guest ran (its workspace disk may have changed under the saved memory:
//! restoring that memory again could corrupt it) removes what was saved; the kernel layer
//! then starts a fresh kernel (its state generation moves on, as for a lost sandbox).
//! Never a hang: every step has a deadline.

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{io_error, qmp, MicrovmError, VmSize, QMP_SOCKET, SETTLE, WORKSPACE_DISK};
use crate::sandbox::{Hibernated, Hibernation, SurvivorInfo};

/// The saved state's, the record's and the disk's names in a kernel's directory.
const STATE: &str = "vm.state";
const RECORD: &str = "record.json";
/// How long the VMM may take to write a session VM's state (its RAM, up to a few GiB).
const SAVE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long QEMU may take to end after `quit`.
const QUIT_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest record read.
const MAX_RECORD: u64 = 64 << 10;

/// What a hibernated VM's directory says about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Record {
    pub kernel_id: String,
    pub key: String,
    pub generation: u64,
    pub started_ms: u64,
    pub saved_ms: u64,
    pub memory_mib: u64,
    pub vcpus: u32,
    /// The guest images and accelerator it ran with: a restore into other ones would fail
    /// or, worse, half work.
    pub machine: String,
    /// Bytes on disk, state and workspace disk (allocated, not apparent).
    pub bytes: u64,
}

/// The hibernated VMs of this state directory: `<state-dir>/hibernated`.
#[derive(Debug)]
pub struct Hibernations {
    dir: PathBuf,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Kernel ids are the gateway's (UUIDs); anything else never names a directory here.
fn valid_id(kernel_id: &str) -> bool {
    !kernel_id.is_empty()
        && kernel_id.len() <= 64
        && kernel_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

impl Hibernations {
    /// Opens (makes, 0700) the directory; one that is not the gateway's own private
    /// directory is refused.
    pub fn open(dir: &Path) -> Result<Hibernations, MicrovmError> {
        use std::os::unix::fs::MetadataExt;
        let made = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
        made.map_err(io_error(dir.display().to_string()))?;
        let meta = std::fs::symlink_metadata(dir).map_err(io_error(dir.display().to_string()))?;
        if !meta.is_dir()
            || meta.mode() & 0o077 != 0
            || meta.uid() != rustix::process::geteuid().as_raw()
        {
            return Err(MicrovmError::Start(format!(
                "{}: the hibernation directory must be the gateway's own, mode 0700",
                dir.display()
            )));
        }
        let hibernations = Hibernations {
            dir: dir.to_owned(),
        };
        hibernations.remove_unfinished();
        Ok(hibernations)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn kernel_dir(&self, kernel_id: &str) -> Option<PathBuf> {
        valid_id(kernel_id).then(|| self.dir.join(kernel_id))
    }

    /// Saves that did not finish (a crash while saving): no record, so nothing to restore.
    fn remove_unfinished(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if !path.join(RECORD).is_file() {
                tracing::warn!(dir = %path.display(), "microvm: removing a hibernation that never finished saving");
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }

    /// The record of `kernel_id`'s hibernated VM, if there is one that reads.
    pub(super) fn read(&self, kernel_id: &str) -> Result<Record, MicrovmError> {
        use std::io::Read;
        let dir = self
            .kernel_dir(kernel_id)
            .ok_or_else(|| MicrovmError::Start(format!("{kernel_id:?} is not a kernel id")))?;
        let path = dir.join(RECORD);
        let file = open_private(&path)?;
        let mut text = String::new();
        file.take(MAX_RECORD)
            .read_to_string(&mut text)
            .map_err(io_error(path.display().to_string()))?;
        let record: Record = serde_json::from_str(&text)
            .map_err(|e| MicrovmError::Start(format!("{}: does not read: {e}", path.display())))?;
        if record.kernel_id != kernel_id {
            return Err(MicrovmError::Start(format!(
                "{}: the record is another kernel's",
                path.display()
            )));
        }
        Ok(record)
    }

    /// `kernel_id`'s hibernated VM as a survivor the kernel layer may adopt (restore).
    pub fn survivor(&self, kernel_id: &str) -> Option<SurvivorInfo> {
        let record = self.read(kernel_id).ok()?;
        Some(SurvivorInfo {
            key: record.key,
            generation: record.generation,
            started_ms: record.started_ms,
            hibernated: true,
            hibernated_bytes: record.bytes,
        })
    }

    /// Removes what was saved of `kernel_id`.
    pub fn remove(&self, kernel_id: &str) {
        if let Some(dir) = self.kernel_dir(kernel_id) {
            if let Err(error) = std::fs::remove_dir_all(&dir) {
                if error.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(dir = %dir.display(), %error, "microvm: a hibernated VM's files could not be removed");
                }
            }
        }
    }

    /// Bytes every hibernated VM here takes on disk.
    pub fn total_bytes(&self) -> u64 {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .filter_map(|id| self.read(&id).ok())
            .map(|r| r.bytes)
            .sum()
    }
}

/// Opens `path` for reading only as a regular file, never through a link.
fn open_private(path: &Path) -> Result<std::fs::File, MicrovmError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_error(path.display().to_string()))?;
    let meta = file
        .metadata()
        .map_err(io_error(path.display().to_string()))?;
    if !meta.is_file() {
        return Err(MicrovmError::Start(format!(
            "{}: not a regular file",
            path.display()
        )));
    }
    Ok(file)
}

/// Bytes a file takes on disk (a workspace disk is sparse: its size says little).
pub(super) fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// A sparse copy of `source` at `to`, a new 0600 file (never through a link); nothing is
/// left at `to` when it fails.
fn copy_to_new(source: &std::fs::File, to: &Path) -> Result<(), MicrovmError> {
    let target = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(to)
        .map_err(io_error(to.display().to_string()))?;
    copy_sparse(source, &target).map_err(|error| {
        let _ = std::fs::remove_file(to);
        io_error(to.display().to_string())(error)
    })
}

/// Moves `from` to `to`: a rename, or (another file system) a copy then removal. `from`
/// may be in a directory the VMM owns: it must be a regular file, never followed through
/// a link (a planted link would have the gateway copy a host file of its choosing), and
/// the copy keeps a sparse disk's holes (its size would otherwise be written out whole).
fn move_file(from: &Path, to: &Path) -> Result<(), MicrovmError> {
    let source = open_private(from)?;
    match std::fs::rename(from, to) {
        Ok(()) => Ok(()),
        Err(error) if error.raw_os_error() == Some(libc::EXDEV) => {
            copy_to_new(&source, to)?;
            let _ = std::fs::remove_file(from);
            Ok(())
        }
        Err(error) => Err(MicrovmError::Io {
            what: format!("moving {} to {}", from.display(), to.display()),
            source: error,
        }),
    }
}

/// Copies `source` into the empty `target` extent by extent (`SEEK_DATA`/`SEEK_HOLE`), so
/// its holes stay holes, then makes it durable.
fn copy_sparse(source: &std::fs::File, target: &std::fs::File) -> std::io::Result<()> {
    use rustix::fs::{seek, SeekFrom};
    use std::os::unix::fs::FileExt;
    let len = source.metadata()?.len();
    target.set_len(len)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < len {
        let data = match seek(source, SeekFrom::Data(at)) {
            Ok(data) => data,
            // No data past `at`: the rest is a hole.
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = seek(source, SeekFrom::Hole(data))?.min(len);
        let mut offset = data;
        while offset < hole {
            let want = usize::try_from(hole - offset)
                .unwrap_or(usize::MAX)
                .min(buf.len());
            let got = source.read_at(&mut buf[..want], offset)?;
            if got == 0 {
                break;
            }
            target.write_all_at(&buf[..got], offset)?;
            offset += got as u64;
        }
        at = hole;
    }
    target.sync_all()
}

/// Makes `dir`'s entries (a rename, a new file) durable.
fn sync_dir(dir: &Path) -> Result<(), MicrovmError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir.display().to_string()))
}

/// Room left on the state directory's disk beyond a save's estimate.
const DISK_MARGIN: u64 = 256 << 20;

/// Whether the disk of the hibernation directory has room for a save of a VM of `size`
/// whose workspace disk takes `disk_bytes` (its RAM, at most, plus that, plus a margin);
/// why not, when it has not. Checked before the VM is touched: a save that fails midway
/// ends the VM.
pub(super) fn room_for(saver: &Saver, disk_bytes: u64) -> Result<(), String> {
    let needed = (saver.size.memory_mib << 20)
        .saturating_add(disk_bytes)
        .saturating_add(DISK_MARGIN);
    let stat = rustix::fs::statvfs(saver.hibernations.dir())
        .map_err(|e| format!("{}: {e}", saver.hibernations.dir().display()))?;
    let free = stat.f_bavail.saturating_mul(stat.f_frsize);
    if free < needed {
        return Err(format!(
            "{} has {} MiB free, a save of this VM may take {} MiB",
            saver.hibernations.dir().display(),
            free >> 20,
            needed >> 20
        ));
    }
    Ok(())
}

/// What a hibernation-capable VM's handle needs to save it.
pub(super) struct Saver {
    pub hibernations: Arc<Hibernations>,
    /// The VM's runtime directory: its control socket and workspace disk.
    pub runtime_dir: PathBuf,
    pub size: VmSize,
    pub machine: String,
}

/// Saves the VM behind `agent` and `runtime_dir` (see the module's doc); `vmm_pid` is the
/// VMM's process (the only peer its control socket may have), `vmm_gone` says when it has
/// ended. On error, the caller ends the VM.
pub(super) async fn save(
    saver: &Saver,
    about: &Hibernation,
    agent: &crate::sandbox::agent::Agent,
    vmm_pid: u32,
    vmm_gone: impl Fn() -> bool,
) -> Result<Hibernated, MicrovmError> {
    let started = std::time::Instant::now();
    let dir = saver
        .hibernations
        .kernel_dir(&about.kernel_id)
        .ok_or_else(|| MicrovmError::Start("not a kernel id".to_owned()))?;
    // A save of this kernel that did not finish, or one restored from already.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(io_error(dir.display().to_string()))?;
    agent.detach().await?;
    tokio::time::sleep(SETTLE).await;
    let partial = dir.join(format!("{STATE}.partial"));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&partial)
        .map_err(io_error(partial.display().to_string()))?;
    let mut qmp = qmp::Qmp::connect_to_vmm(
        &saver.runtime_dir.join(QMP_SOCKET),
        Duration::from_secs(10),
        vmm_pid,
    )
    .await?;
    qmp::save(&mut qmp, &file, SAVE_TIMEOUT).await?;
    // Durable before the record says the save is whole.
    file.sync_all()
        .map_err(io_error(partial.display().to_string()))?;
    drop(file);
    let _ = qmp.execute("quit", serde_json::json!({})).await;
    drop(qmp);
    let deadline = tokio::time::Instant::now() + QUIT_TIMEOUT;
    while !vmm_gone() {
        if tokio::time::Instant::now() >= deadline {
            return Err(MicrovmError::Start(
                "the VMM did not end after its state was saved".to_owned(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let disk = dir.join(WORKSPACE_DISK);
    let from = saver.runtime_dir.join(WORKSPACE_DISK);
    let to = disk.clone();
    tokio::task::spawn_blocking(move || move_file(&from, &to))
        .await
        .map_err(|e| MicrovmError::Start(format!("moving the workspace disk: {e}")))??;
    let state = dir.join(STATE);
    std::fs::rename(&partial, &state).map_err(io_error(state.display().to_string()))?;
    sync_dir(&dir)?;
    let bytes = allocated(&state) + allocated(&disk);
    let record = Record {
        kernel_id: about.kernel_id.clone(),
        key: about.key.clone(),
        generation: about.generation,
        started_ms: about.started_ms,
        saved_ms: now_ms(),
        memory_mib: saver.size.memory_mib,
        vcpus: saver.size.vcpus,
        machine: saver.machine.clone(),
        bytes,
    };
    write_private(
        &dir.join(RECORD),
        &serde_json::to_vec_pretty(&record).map_err(|e| MicrovmError::Start(e.to_string()))?,
    )?;
    tracing::info!(kernel_id = %about.kernel_id, bytes, seconds = started.elapsed().as_secs_f64(), "microvm: VM hibernated");
    Ok(Hibernated { bytes })
}

/// Writes `bytes` to a new 0600 file at `path` (through a temporary name: a reader never
/// sees half of it).
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), MicrovmError> {
    use std::io::Write;
    let temporary = path.with_extension("partial");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&temporary)
        .map_err(io_error(temporary.display().to_string()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(io_error(temporary.display().to_string()))?;
    std::fs::rename(&temporary, path).map_err(io_error(path.display().to_string()))
}

/// How far a hibernated VM's restore got, which decides whether a failed one may keep
/// what was saved for another try: only one whose guest never ran, and whose save was not
/// itself refused. Until the guest runs, the saved workspace disk stays where it was saved
/// (the VM gets a link to it, or a copy): a restore cut off before then, by a crash or a
/// stop, loses nothing.
#[derive(Debug, Default)]
pub(super) struct Waking {
    /// The guest was let run (`cont` sent, or the VM found running).
    ran: AtomicBool,
    /// The save cannot be restored here: its record does not fit this gateway, its files
    /// are gone or not regular files, or the VMM ended by itself while loading it (a
    /// damaged state).
    refused: AtomicBool,
    /// The saved workspace disk the VM's is linked to or copied from, once taken.
    saved_disk: parking_lot::Mutex<Option<PathBuf>>,
}

impl Waking {
    /// Notes that the guest is about to run: from here a failure loses what was saved, and
    /// the saved name of the disk goes (the VM's link or copy is the disk from now on).
    pub(super) fn ran(&self) {
        self.ran.store(true, Ordering::SeqCst);
        if let Some(disk) = self.saved_disk.lock().take() {
            if let Err(error) = std::fs::remove_file(&disk) {
                tracing::warn!(disk = %disk.display(), %error, "microvm: a restored VM's saved disk could not be removed (it goes with its save)");
            }
        }
    }

    /// Notes that the save itself was refused: another try would fail the same way.
    pub(super) fn refused(&self) {
        self.refused.store(true, Ordering::SeqCst);
    }

    /// Whether a failed restore may keep what was saved for the next request.
    pub(super) fn may_retry(&self) -> bool {
        !self.ran.load(Ordering::SeqCst) && !self.refused.load(Ordering::SeqCst)
    }
}

/// Whether a failure to read a save says the save itself is unusable (gone, a link, not a
/// regular file, a record that does not read or does not fit), rather than a passing
/// failure of the host's (descriptors, I/O).
fn unusable(error: &MicrovmError) -> bool {
    match error {
        MicrovmError::Io { source, .. } => {
            source.kind() == std::io::ErrorKind::NotFound
                || source.raw_os_error() == Some(libc::ELOOP)
        }
        _ => true,
    }
}

/// What a restore takes from a kernel's directory: the saved state, open, and the record;
/// the workspace disk is linked into `runtime_dir` (copied where that is another file
/// system), the saved one staying until the guest runs ([`Waking::ran`]). Checked against
/// the VM it is to become (a save that does not fit, or is not there, is noted
/// `waking.refused()`).
pub(super) fn take_for_restore(
    hibernations: &Hibernations,
    kernel_id: &str,
    runtime_dir: &Path,
    size: VmSize,
    machine: &str,
    waking: &Waking,
) -> Result<(std::fs::File, Record), MicrovmError> {
    let (state, record, disk) =
        checked_save(hibernations, kernel_id, size, machine).inspect_err(|error| {
            if unusable(error) {
                waking.refused();
            }
        })?;
    let taken = runtime_dir.join(WORKSPACE_DISK);
    match std::fs::hard_link(&disk, &taken) {
        Ok(()) => {}
        Err(error) if error.raw_os_error() == Some(libc::EXDEV) => {
            copy_to_new(&open_private(&disk)?, &taken)?;
        }
        Err(error) => return Err(io_error(taken.display().to_string())(error)),
    }
    *waking.saved_disk.lock() = Some(disk);
    Ok((state, record))
}

/// The saved state (open), the record and the disk's path of `kernel_id`'s save, if they
/// fit the VM it is to become.
fn checked_save(
    hibernations: &Hibernations,
    kernel_id: &str,
    size: VmSize,
    machine: &str,
) -> Result<(std::fs::File, Record, PathBuf), MicrovmError> {
    let record = hibernations.read(kernel_id)?;
    if record.machine != machine {
        return Err(MicrovmError::Start(format!(
            "the VM was saved on another machine ({}) than this gateway runs ({machine}): \
             the guest images, the VMM or the accelerator changed",
            record.machine
        )));
    }
    if (record.memory_mib, record.vcpus) != (size.memory_mib, size.vcpus) {
        return Err(MicrovmError::Start(format!(
            "the VM was saved with {} MiB and {} vCPUs, its policy now asks {} MiB and {}",
            record.memory_mib, record.vcpus, size.memory_mib, size.vcpus
        )));
    }
    let dir = hibernations
        .kernel_dir(kernel_id)
        .ok_or_else(|| MicrovmError::Start("not a kernel id".to_owned()))?;
    let state = open_private(&dir.join(STATE))?;
    let disk = dir.join(WORKSPACE_DISK);
    // Checked as the state is: the gateway's regular file, not a link.
    drop(open_private(&disk)?);
    Ok((state, record, disk))
}

/// Puts back what [`take_for_restore`] took, after a restore whose guest never ran: the
/// VM's link to (or copy of) the workspace disk goes, and the saved disk is the gateway's
/// again (the VM's jail was given it); the save is as it was.
pub(super) fn hand_back(
    hibernations: &Hibernations,
    kernel_id: &str,
    runtime_dir: &Path,
) -> Result<(), MicrovmError> {
    let dir = hibernations
        .kernel_dir(kernel_id)
        .ok_or_else(|| MicrovmError::Start("not a kernel id".to_owned()))?;
    let saved = dir.join(WORKSPACE_DISK);
    // Checked as a restore checks it: the gateway's regular file, not a link.
    drop(open_private(&saved)?);
    drop(open_private(&dir.join(STATE))?);
    let taken = runtime_dir.join(WORKSPACE_DISK);
    match std::fs::remove_file(&taken) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(io_error(taken.display().to_string())(error)),
    }
    let (uid, gid) = (rustix::process::geteuid(), rustix::process::getegid());
    std::os::unix::fs::lchown(&saved, Some(uid.as_raw()), Some(gid.as_raw()))
        .map_err(io_error(saved.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moved_disk_keeps_its_holes_and_a_link_is_never_followed() {
        use std::os::unix::fs::FileExt;
        let root = tempfile::tempdir().unwrap();
        let from = root.path().join("disk");
        let disk = std::fs::File::create(&from).unwrap();
        disk.set_len(64 << 20).unwrap();
        disk.write_all_at(b"head", 0).unwrap();
        disk.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        drop(disk);
        let copy = root.path().join("copy");
        let target = std::fs::File::create(&copy).unwrap();
        copy_sparse(&std::fs::File::open(&from).unwrap(), &target).unwrap();
        assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(&from).unwrap());
        assert!(
            allocated(&copy) < 8 << 20,
            "{} bytes allocated",
            allocated(&copy)
        );

        // A link where the disk should be: refused, and its target left alone.
        let secret = root.path().join("secret");
        std::fs::write(&secret, b"not yours").unwrap();
        let planted = root.path().join("planted");
        std::os::unix::fs::symlink(&secret, &planted).unwrap();
        assert!(move_file(&planted, &root.path().join("moved")).is_err());
        assert!(!root.path().join("moved").exists());
        assert_eq!(std::fs::read(&secret).unwrap(), b"not yours");
    }

    #[test]
    fn a_save_is_not_begun_without_room_for_it() {
        let root = tempfile::tempdir().unwrap();
        let saver = |memory_mib| Saver {
            hibernations: Arc::new(Hibernations::open(&root.path().join("h")).unwrap()),
            runtime_dir: root.path().to_owned(),
            size: VmSize {
                memory_mib,
                vcpus: 1,
            },
            machine: String::new(),
        };
        // A VM of 16 MiB fits on any disk the tests run on; one of a billion TiB on none.
        assert_eq!(room_for(&saver(16), 0), Ok(()));
        let why = room_for(&saver(1 << 40), 0).unwrap_err();
        assert!(why.contains("MiB free"), "{why}");
        assert!(room_for(&saver(16), u64::MAX).is_err());
    }

    /// A record of `id`'s save: 512 MiB, 1 vCPU, machine "m", generation 3.
    fn a_record(id: &str) -> Record {
        Record {
            kernel_id: id.to_owned(),
            key: "k".repeat(32),
            generation: 3,
            started_ms: 1,
            saved_ms: 2,
            memory_mib: 512,
            vcpus: 1,
            machine: "m".to_owned(),
            bytes: 10,
        }
    }

    #[test]
    fn a_restore_that_failed_before_the_guest_ran_puts_everything_back() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("hibernated");
        let hibernations = Hibernations::open(&dir).unwrap();
        let id = "0b0e6f3c-1111-4222-8333-444455556666";
        let saved = dir.join(id);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&saved)
            .unwrap();
        let record = a_record(id);
        write_private(&saved.join(RECORD), &serde_json::to_vec(&record).unwrap()).unwrap();
        write_private(&saved.join(STATE), b"state").unwrap();
        write_private(&saved.join(WORKSPACE_DISK), b"disk").unwrap();
        let run = root.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let size = VmSize {
            memory_mib: 512,
            vcpus: 1,
        };

        // A save that does not fit the VM asked for is refused, and nothing is moved.
        let waking = Waking::default();
        let smaller = VmSize {
            memory_mib: 256,
            vcpus: 1,
        };
        assert!(take_for_restore(&hibernations, id, &run, smaller, "m", &waking).is_err());
        assert!(!waking.may_retry());
        let waking = Waking::default();
        assert!(take_for_restore(&hibernations, id, &run, size, "other", &waking).is_err());
        assert!(!waking.may_retry());
        assert!(saved.join(WORKSPACE_DISK).is_file());

        // Taken: the VM gets the disk, the save keeps it until the guest runs (a restore
        // cut off midway loses nothing); then put back, as it was, and taken again.
        let waking = Waking::default();
        let (_, taken) = take_for_restore(&hibernations, id, &run, size, "m", &waking).unwrap();
        assert_eq!(taken, record);
        assert!(waking.may_retry());
        assert_eq!(std::fs::read(run.join(WORKSPACE_DISK)).unwrap(), b"disk");
        assert_eq!(std::fs::read(saved.join(WORKSPACE_DISK)).unwrap(), b"disk");
        hand_back(&hibernations, id, &run).unwrap();
        assert!(!run.join(WORKSPACE_DISK).exists());
        assert_eq!(std::fs::read(saved.join(WORKSPACE_DISK)).unwrap(), b"disk");
        assert_eq!(hibernations.read(id).unwrap(), record);
        assert!(hibernations.survivor(id).is_some());

        // Once the guest runs, the saved disk goes (the VM's is the disk), and a failure
        // keeps nothing; the VMM refusing the state keeps nothing either.
        let waking = Waking::default();
        take_for_restore(&hibernations, id, &run, size, "m", &waking).unwrap();
        waking.ran();
        assert!(!waking.may_retry());
        assert!(!saved.join(WORKSPACE_DISK).exists());
        assert_eq!(std::fs::read(run.join(WORKSPACE_DISK)).unwrap(), b"disk");
        let waking = Waking::default();
        waking.refused();
        assert!(!waking.may_retry());

        // A save whose disk is gone is refused, and cannot be put back.
        assert!(hand_back(&hibernations, id, &run).is_err());
        let waking = Waking::default();
        assert!(take_for_restore(&hibernations, id, &run, size, "m", &waking).is_err());
        assert!(!waking.may_retry());
        // A passing failure of the host's to read a save is not a refusal.
        let busy = MicrovmError::Io {
            what: "vm.state".to_owned(),
            source: std::io::Error::from_raw_os_error(libc::EMFILE),
        };
        assert!(!unusable(&busy));
        let gone = MicrovmError::Io {
            what: "vm.state".to_owned(),
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        };
        assert!(unusable(&gone));
    }

    #[test]
    fn records_are_read_back_only_for_their_kernel_and_unfinished_saves_go() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("hibernated");
        let hibernations = Hibernations::open(&dir).unwrap();
        let id = "0b0e6f3c-1111-4222-8333-444455556666";
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir.join(id))
            .unwrap();
        let record = a_record(id);
        write_private(
            &dir.join(id).join(RECORD),
            &serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
        assert_eq!(hibernations.read(id).unwrap(), record);
        let survivor = hibernations.survivor(id).unwrap();
        assert!(survivor.hibernated);
        assert_eq!(survivor.generation, 3);
        assert!(hibernations.read("../etc").is_err());
        assert!(hibernations.survivor("other").is_none());
        assert_eq!(hibernations.total_bytes(), 10);
        // A save that never wrote its record is gone at the next opening.
        std::fs::create_dir(dir.join("unfinished")).unwrap();
        drop(Hibernations::open(&dir).unwrap());
        assert!(!dir.join("unfinished").exists());
        assert!(dir.join(id).exists());
        hibernations.remove(id);
        assert!(hibernations.survivor(id).is_none());
    }
}
