//! Kernels that outlive their gateway (see the module doc of `namespaces`, "Outliving the
//! gateway"): where a surviving sandbox is described in the state directory, how a gateway
//! proves to the sandbox's helper that it holds the kernel's key, and how it checks that
//! the recorded processes are still the ones it started.
//!
//! Per kernel, `<state dir>/sandboxes/<kernel id>/` (0700, the gateway's uid):
//! * `record.json` (0600): [`Record`], with the kernel's signing key;
//! * `control-g<generation>.sock`: the helper's control socket (the helper holds the listening socket,
//!   made by the gateway; the directory's mode keeps every other uid out);
//! * `egress/`: the egress proxy's socket, at a path every gateway on this state directory
//!   listens at (handed to the sandbox user, who connects to it through the bridge).
//!
//! The control socket's exchange: the helper writes `challenge <64 hex>`; the peer answers
//! the hex HMAC-SHA256 of [`CHALLENGE_CONTEXT`] and the challenge under the kernel's key;
//! the helper answers `ok` and counts the peer as its gateway while the connection stays
//! open, or closes it.
//!
//! The gvisor backend keeps its surviving sandboxes here too (`gvisor::survival`): the same
//! directory per kernel, control socket and exchange ([`challenge`], run by its keeper), and
//! a record of its own shape in `record.json` ([`Survival::write_record`],
//! [`Survival::read_record`]); each backend's records do not read as the other's.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hmac::{Hmac, Mac};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::sandbox::cgroups::CgroupParts;

/// What every answer's MAC covers besides the challenge, so that no other message signed
/// with the kernel's key (a Jupyter message's signature) can serve as an answer.
pub const CHALLENGE_CONTEXT: &[u8] = b"cellgate-adopt-v1:";
/// The record's file name.
const RECORD: &str = "record.json";
/// The control socket's file name, for the kernel's generation (a restart's sandbox has its
/// own, so that the end of the one before removes nothing of the next).
fn control(generation: u64) -> String {
    format!("control-g{generation}.sock")
}
/// The egress directory's name.
const EGRESS: &str = "egress";
/// How long either side of the exchange waits for the other.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);

/// The settings for surviving kernels (the namespaces and gvisor backends').
#[derive(Debug, Clone)]
pub struct Survival {
    /// `<state dir>/sandboxes`.
    pub dir: PathBuf,
    /// How long an orphan waits for a gateway.
    pub grace: Duration,
}

/// A process of the sandbox: its host pid and its start time (field 22 of
/// `/proc/<pid>/stat`, in clock ticks since boot), which a reused pid does not share.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Proc {
    pub pid: i32,
    pub start: u64,
}

impl Proc {
    /// `pid` as it is now; `None` when it is gone.
    pub fn of(pid: i32) -> Option<Proc> {
        Some(Proc {
            pid,
            start: start_time(pid)?,
        })
    }
}

/// A surviving sandbox, as the gateway that started it wrote it down.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub kernel_id: String,
    /// The kernel's state generation when it started.
    pub generation: u64,
    /// The key its messages are signed with (the connection file's).
    pub key: String,
    pub helper: Proc,
    /// The helper is a zygote's child (its parent is not the gateway).
    pub helper_forked: bool,
    pub init: Proc,
    pub kernel: Option<Proc>,
    pub cgroup: Option<CgroupParts>,
    pub memory_limit: Option<u64>,
    /// The workspace's path inside the sandbox.
    pub workspace: PathBuf,
    /// When the kernel started (Unix time, milliseconds).
    pub started_ms: u64,
}

/// Why a sandbox could not be adopted.
#[derive(Debug, thiserror::Error)]
pub enum SurvivalError {
    #[error("no record of a surviving sandbox")]
    NoRecord,
    #[error("the record does not read: {0}")]
    BadRecord(String),
    #[error("the sandbox's {0} is gone (or its pid names another process now)")]
    Gone(&'static str),
    #[error("the sandbox's helper refused this gateway: {0}")]
    Refused(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl Survival {
    /// The directory of one kernel's survival files; `None` for an id that is not a plain
    /// name (ids are the gateway's own, but a path is never built from anything else).
    pub fn kernel_dir(&self, kernel_id: &str) -> Option<PathBuf> {
        let plain = !kernel_id.is_empty()
            && kernel_id.len() <= 64
            && kernel_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        plain.then(|| self.dir.join(kernel_id))
    }

    /// Makes `path` (and its parents) 0700 when missing.
    pub fn make_dir(path: &Path) -> Result<(), SurvivalError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|source| SurvivalError::Io {
                what: "create",
                path: path.to_owned(),
                source,
            })
    }

    /// The egress proxy's directory for `kernel_id`, made when missing (0700, handed to
    /// `owner` when the gateway is root, so that the bridge, running as the sandbox user,
    /// may look the socket up in it).
    pub fn egress_dir(
        &self,
        kernel_id: &str,
        owner: Option<(u32, u32)>,
    ) -> Result<PathBuf, SurvivalError> {
        let dir = self
            .kernel_dir(kernel_id)
            .ok_or(SurvivalError::NoRecord)?
            .join(EGRESS);
        Self::make_dir(&dir)?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).map_err(|source| {
                SurvivalError::Io {
                    what: "hand over",
                    path: dir.clone(),
                    source,
                }
            })?;
        }
        Ok(dir)
    }

    /// Makes the control socket of the kernel's `generation` (a stale one is removed
    /// first), for its helper to hold.
    pub fn control_listener(
        &self,
        kernel_id: &str,
        generation: u64,
    ) -> Result<UnixListener, SurvivalError> {
        let dir = self.kernel_dir(kernel_id).ok_or(SurvivalError::NoRecord)?;
        Self::make_dir(&dir)?;
        let path = dir.join(control(generation));
        let _ = std::fs::remove_file(&path);
        UnixListener::bind(&path).map_err(|source| SurvivalError::Io {
            what: "listen at",
            path,
            source,
        })
    }

    /// Writes `record` (0600), replacing the file atomically.
    pub fn write(&self, record: &Record) -> Result<(), SurvivalError> {
        self.write_record(&record.kernel_id, record)
    }

    /// Writes the record of `kernel_id`'s sandbox, whichever backend's (0600), replacing
    /// the file atomically.
    pub fn write_record(
        &self,
        kernel_id: &str,
        record: &impl Serialize,
    ) -> Result<(), SurvivalError> {
        let dir = self.kernel_dir(kernel_id).ok_or(SurvivalError::NoRecord)?;
        let path = dir.join(RECORD);
        let partial = dir.join(format!("{RECORD}.partial"));
        let io = |what| {
            let path = path.clone();
            move |source| SurvivalError::Io { what, path, source }
        };
        let json =
            serde_json::to_vec(record).map_err(|e| SurvivalError::BadRecord(e.to_string()))?;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&partial)
            .map_err(io("write"))?;
        file.write_all(&json).map_err(io("write"))?;
        file.sync_all().map_err(io("write"))?;
        std::fs::rename(&partial, &path).map_err(io("write"))
    }

    /// The record of `kernel_id`'s sandbox.
    pub fn read(&self, kernel_id: &str) -> Result<Record, SurvivalError> {
        let record: Record = self.read_record(kernel_id)?;
        if record.kernel_id != kernel_id {
            return Err(SurvivalError::BadRecord(format!(
                "it names kernel {}",
                record.kernel_id
            )));
        }
        Ok(record)
    }

    /// The record of `kernel_id`'s sandbox as a backend wrote it (a record of another
    /// backend's does not read: `SurvivalError::BadRecord`).
    pub fn read_record<T: serde::de::DeserializeOwned>(
        &self,
        kernel_id: &str,
    ) -> Result<T, SurvivalError> {
        let path = self
            .kernel_dir(kernel_id)
            .ok_or(SurvivalError::NoRecord)?
            .join(RECORD);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(SurvivalError::NoRecord)
            }
            Err(source) => {
                return Err(SurvivalError::Io {
                    what: "read",
                    path,
                    source,
                })
            }
        };
        serde_json::from_slice(&bytes).map_err(|e| SurvivalError::BadRecord(e.to_string()))
    }

    /// Removes the record of `kernel_id`'s sandbox and the control socket of its
    /// `generation` (whichever backend's).
    pub fn remove_record(&self, kernel_id: &str, generation: u64) {
        if let Some(dir) = self.kernel_dir(kernel_id) {
            let _ = std::fs::remove_file(dir.join(control(generation)));
            let _ = std::fs::remove_file(dir.join(RECORD));
        }
    }

    /// The control socket's path for `kernel_id`'s `generation`.
    pub fn control_path(&self, kernel_id: &str, generation: u64) -> Option<PathBuf> {
        Some(self.kernel_dir(kernel_id)?.join(control(generation)))
    }

    /// Forgets the sandbox of `kernel_id`'s `generation`, which ended or failed to start:
    /// its control socket, and the record when it is that generation's. The egress
    /// directory stays for the kernel's next generation ([`Survival::remove`] ends it).
    pub fn forget(&self, kernel_id: &str, generation: u64) {
        let Some(dir) = self.kernel_dir(kernel_id) else {
            return;
        };
        let _ = std::fs::remove_file(dir.join(control(generation)));
        if self
            .read(kernel_id)
            .is_ok_and(|record| record.generation == generation)
        {
            let _ = std::fs::remove_file(dir.join(RECORD));
        }
    }

    /// At the backend's start: the sandboxes recorded here whose helper is gone (an orphan
    /// that ended itself, or one killed meanwhile) lose their cgroup, which nothing else
    /// would remove; their record stays for the session layer to report them lost (an
    /// adoption that fails removes it). Directories with no record hold nothing to adopt.
    pub fn sweep(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            match self.read(&id) {
                Ok(record) => {
                    if start_time(record.helper.pid) == Some(record.helper.start) {
                        continue;
                    }
                    if let Some(cgroup) = record
                        .cgroup
                        .as_ref()
                        .and_then(crate::sandbox::cgroups::KernelCgroup::from_parts)
                    {
                        cgroup.remove();
                    }
                    if let Some(dir) = self.kernel_dir(&id) {
                        let _ = std::fs::remove_file(dir.join(control(record.generation)));
                    }
                }
                Err(SurvivalError::NoRecord) => self.remove(&id),
                Err(_) => {}
            }
        }
    }

    /// Ends at once the sandboxes recorded here that no session claims (`claimed` false:
    /// a pool's or a Kernel Gateway API kernel, which nothing will ask for again), rather
    /// than leaving them to their orphan grace: each helper, pinned by its pidfd and start
    /// time, is killed (its init has the helper as its parent-death signal's source, and
    /// the pid namespace ends with the init), then its cgroup and record are removed.
    /// Records of another backend's shape are left to it. Blocking; the number ended.
    pub fn end_unclaimed(&self, claimed: &dyn Fn(&str) -> bool) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
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
            let Ok(record) = self.read(&id) else {
                continue;
            };
            if kill_pinned(&record.helper) {
                ended += 1;
            }
            wait_gone(&record.init, UNCLAIMED_WAIT);
            if let Some(cgroup) = record
                .cgroup
                .as_ref()
                .and_then(crate::sandbox::cgroups::KernelCgroup::from_parts)
            {
                cgroup.remove();
            }
            self.remove(&id);
        }
        ended
    }

    /// Forgets `kernel_id`'s sandbox (it ended, or never will be adopted).
    pub fn remove(&self, kernel_id: &str) {
        if let Some(dir) = self.kernel_dir(kernel_id) {
            if let Err(err) = std::fs::remove_dir_all(&dir) {
                if err.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(dir = %dir.display(), %err, "could not remove a sandbox's record");
                }
            }
        }
    }

    /// Proves to the helper of `kernel_id` that this gateway holds `key`; the connection,
    /// which the helper counts as its gateway while it stays open. Blocking.
    pub fn attach(
        &self,
        kernel_id: &str,
        generation: u64,
        key: &str,
    ) -> Result<UnixStream, SurvivalError> {
        let path = self
            .kernel_dir(kernel_id)
            .ok_or(SurvivalError::NoRecord)?
            .join(control(generation));
        let refused = |e: io::Error| SurvivalError::Refused(e.to_string());
        let stream = UnixStream::connect(&path).map_err(refused)?;
        stream
            .set_read_timeout(Some(EXCHANGE_TIMEOUT))
            .map_err(refused)?;
        let mut reader = BufReader::new(stream.try_clone().map_err(refused)?);
        let mut line = String::new();
        reader.read_line(&mut line).map_err(refused)?;
        let challenge = line
            .trim_end()
            .strip_prefix("challenge ")
            .ok_or_else(|| SurvivalError::Refused(format!("unexpected {line:?}")))?;
        let challenge =
            hex::decode(challenge).map_err(|e| SurvivalError::Refused(e.to_string()))?;
        let answer = format!("{}\n", hex::encode(answer(key.as_bytes(), &challenge)));
        (&stream).write_all(answer.as_bytes()).map_err(refused)?;
        line.clear();
        reader.read_line(&mut line).map_err(refused)?;
        if line.trim_end() != "ok" {
            return Err(SurvivalError::Refused(
                "the key does not match (the connection was closed)".to_owned(),
            ));
        }
        stream.set_read_timeout(None).map_err(refused)?;
        Ok(stream)
    }
}

/// The MAC that answers `challenge` under `key`.
pub fn answer(key: &[u8], challenge: &[u8]) -> Vec<u8> {
    // HMAC takes a key of any length.
    let mut mac = match Hmac::<Sha256>::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => return Vec::new(),
    };
    mac.update(CHALLENGE_CONTEXT);
    mac.update(challenge);
    mac.finalize().into_bytes().to_vec()
}

/// Whether `given` (hex) answers `challenge` under `key`, compared in constant time.
pub fn verify(key: &[u8], challenge: &[u8], given: &str) -> bool {
    let Ok(given) = hex::decode(given.trim()) else {
        return false;
    };
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        return false;
    };
    mac.update(CHALLENGE_CONTEXT);
    mac.update(challenge);
    mac.verify_slice(&given).is_ok()
}

/// The keeper's side of the control socket's exchange with a new peer (see the module
/// doc), in both backends' keepers: the connection when it answered with the kernel's key,
/// `None` (and closed) otherwise.
pub fn challenge(stream: UnixStream, key: &[u8]) -> Option<UnixStream> {
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(EXCHANGE_TIMEOUT)).ok()?;
    stream.set_write_timeout(Some(EXCHANGE_TIMEOUT)).ok()?;
    let mut nonce = [0u8; 32];
    rand::rng().fill_bytes(&mut nonce);
    (&stream)
        .write_all(format!("challenge {}\n", hex::encode(nonce)).as_bytes())
        .ok()?;
    // One short line, read byte by byte so nothing past it is consumed.
    let mut answer = Vec::with_capacity(80);
    let mut byte = [0u8; 1];
    while answer.len() < 200 {
        match (&stream).read(&mut byte) {
            Ok(1) if byte[0] == b'\n' => break,
            Ok(1) => answer.push(byte[0]),
            _ => return None,
        }
    }
    let answer = String::from_utf8(answer).ok()?;
    if !verify(key, &nonce, &answer) {
        return None;
    }
    (&stream).write_all(b"ok\n").ok()?;
    Some(stream)
}

/// The start time of `pid` (clock ticks since boot), `None` when it does not exist or has
/// ended. A process that ended stays in /proc until its parent reaps it, and a keeper whose
/// gateway died is reaped by whoever adopted it, at its own pace (seen: the next gateway
/// took such a zombie keeper for a live one and left its sandbox's leftovers for good).
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields are counted after its end.
    let rest = stat.rsplit_once(')')?.1;
    let mut fields = rest.split_whitespace();
    // Field 3 of proc(5), the state: Z (zombie) and X (dead) have ended.
    if matches!(fields.next(), Some("Z" | "X" | "x")) {
        return None;
    }
    // Field 22; the state was field 3.
    fields.nth(18)?.parse().ok()
}

/// How long an unclaimed sandbox's processes may take to end once killed.
pub const UNCLAIMED_WAIT: Duration = Duration::from_secs(5);

/// Kills `process` with SIGKILL if it is still the one recorded (its pidfd opened first,
/// then its start time compared, so a reused pid is never signalled); whether it was.
pub fn kill_pinned(process: &Proc) -> bool {
    use crate::sandbox::sys;
    let Ok(pidfd) = sys::pidfd_open(process.pid) else {
        return false;
    };
    if start_time(process.pid) != Some(process.start) || sys::pidfd_exited(&pidfd) {
        return false;
    }
    sys::pidfd_send_signal(&pidfd, libc::SIGKILL).is_ok()
}

/// Waits, at most `timeout`, until `process` is gone (its pid ended, or names another).
pub fn wait_gone(process: &Proc, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while start_time(process.pid) == Some(process.start) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A kept kernel's own directories below its survival directory (gVisor and microVM): short,
/// because the kernel's `ipc://` socket paths below it must stay under the 108-byte limit
/// of a unix socket address.
pub const KEPT_KERNEL_DIR: &str = "k";
/// The longest socket path below a kept kernel's directory that must be bound by its full
/// name: a kernel channel's, which the gateway listens on (`run/g<generation>-<8 hex>/
/// k-<port>`, with a generous generation).
const KEPT_SOCKET_SUFFIX: &str = "run/g999999-00000000/k-5";

impl Survival {
    /// Whether kept kernels' socket paths below this directory fit a unix socket address.
    pub fn kept_paths_fit(&self) -> bool {
        let longest = self
            .dir
            .join("00000000-0000-0000-0000-000000000000")
            .join(KEPT_KERNEL_DIR)
            .join(KEPT_SOCKET_SUFFIX);
        longest.as_os_str().len() < 108
    }

    /// Where `kernel_id`'s kept directories go (its survival directory made, 0700, up to
    /// its parent); `None`, said in the log, when it cannot be made.
    pub fn kept_kernel_dir(&self, kernel_id: &str) -> Option<PathBuf> {
        let dir = self.kernel_dir(kernel_id)?;
        match Survival::make_dir(&dir) {
            Ok(()) => Some(dir.join(KEPT_KERNEL_DIR)),
            Err(err) => {
                tracing::warn!(kernel_id, %err, "cannot make the kernel's survival directory: its directories go below the runtime directory");
                None
            }
        }
    }
}

/// A keeper's read of its plan: one line from `fd` (its stdin), read byte by byte so that
/// nothing after it is consumed.
#[allow(unsafe_code)] // the stdin descriptor borrowed, not closed
pub fn read_plan_line(fd: std::os::fd::RawFd) -> io::Result<Vec<u8>> {
    use std::os::fd::FromRawFd;
    // SAFETY: `fd` is the keeper's stdin; ManuallyDrop keeps it open.
    let mut file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match file.read(&mut byte) {
            Ok(0) => return Err(io::Error::other("the plan ended early")),
            Ok(_) if byte[0] == b'\n' => return Ok(line),
            Ok(_) => line.push(byte[0]),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
        if line.len() > 1 << 20 {
            return Err(io::Error::other("the plan is too long"));
        }
    }
}

/// A `poll(2)` entry waiting for `fd` to be readable.
pub fn poll_in(fd: std::os::fd::RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_key_answers_the_challenge() {
        let challenge = [7u8; 32];
        let good = hex::encode(answer(b"k1", &challenge));
        assert!(verify(b"k1", &challenge, &good));
        assert!(!verify(b"k2", &challenge, &good));
        assert!(!verify(b"k1", &[8u8; 32], &good));
        assert!(!verify(b"k1", &challenge, "zz"));
        assert!(!verify(b"k1", &challenge, ""));
    }

    #[test]
    fn a_start_time_is_read_past_any_command_name() {
        let own = i32::try_from(std::process::id()).unwrap();
        assert!(start_time(own).is_some_and(|t| t > 0));
        assert_eq!(start_time(i32::MAX), None);
        // A child that ended and is not reaped yet has ended.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let mut zombie = false;
        for _ in 0..500 {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            if stat
                .rsplit_once(')')
                .unwrap()
                .1
                .trim_start()
                .starts_with('Z')
            {
                zombie = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(zombie, "the child never ended");
        assert_eq!(start_time(pid), None);
        child.wait().unwrap();
    }

    #[test]
    fn records_round_trip_and_paths_stay_inside() {
        let dir = tempfile::tempdir().unwrap();
        let survival = Survival {
            dir: dir.path().to_owned(),
            grace: Duration::from_secs(1),
        };
        assert!(survival.kernel_dir("../x").is_none());
        assert!(survival.kernel_dir("").is_none());
        let _listener = survival.control_listener("k1", 3).unwrap();
        let record = Record {
            kernel_id: "k1".into(),
            generation: 3,
            key: "secret".into(),
            helper: Proc { pid: 1, start: 2 },
            helper_forked: false,
            init: Proc { pid: 3, start: 4 },
            kernel: None,
            cgroup: None,
            memory_limit: None,
            workspace: "/home/user".into(),
            started_ms: 5,
        };
        survival.write(&record).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("k1/record.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let back = survival.read("k1").unwrap();
        assert_eq!(back.generation, 3);
        // The end of another generation's sandbox leaves this one's record.
        survival.forget("k1", 2);
        assert!(survival.read("k1").is_ok());
        survival.forget("k1", 3);
        assert!(matches!(survival.read("k1"), Err(SurvivalError::NoRecord)));
        assert!(!dir.path().join("k1/control-g3.sock").exists());
        survival.write(&record).unwrap();
        assert!(matches!(survival.read("k2"), Err(SurvivalError::NoRecord)));
        survival.remove("k1");
        assert!(!dir.path().join("k1").exists());
    }
}
