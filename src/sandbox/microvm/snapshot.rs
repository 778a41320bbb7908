//! The warm pool's snapshots: one per kind of VM (its RAM, vCPUs and the kernel it can
//! become), each the saved state of a **zygote** VM: booted, the agent waiting for a
//! gateway, and the kernel's Python started with ipykernel imported, but no kernel yet.
//!
//! A session whose kind of VM has a snapshot gets a VM restored from it instead of a boot:
//! under emulation the restore takes ~0.5 s and the kernel is ready ~3 s after the request (ipykernel
//! setting itself up for its connection, ~50x slower than native), against ~12 s from a boot. The first
//! session of a kind boots, and asks for the kind's snapshot to be made in the background
//! (one at a time).
//!
//! **Making one.** A kind is the VM's RAM, vCPUs, the launcher command and what of its
//! environment Python reads at its start. Its zygote VM runs over virtio-serial (QEMU 7.2
//! cannot save a VM with a vhost-user device); its agent starts the kernel launcher in zygote
//! mode (`--cellgate-zygote`: Python with ipykernel imported and the kernelspec's preload
//! list, `CELLGATE_PRELOAD`: numpy, pandas and matplotlib with its inline backend and one
//! figure drawn, so a first chart pays no import; under emulation only with
//! `--microvm-preload-under-emulation`), in the kernel's cgroup. Then its link is closed and
//! the VM stopped and saved through QMP `migrate` to a descriptor. A later session's VM is
//! loaded from that descriptor (`-incoming fd:3`) and resumed (`cont`); the agent gets
//! `restored` before `start`, which hands the zygote its argv, environment and connection
//! file (it reseeds and becomes the kernel) or, for a command it cannot become, ends it and
//! starts a fresh process. The agent handshake (`guest/agent/src/protocol.rs`) is built for
//! restores: a restored guest still ending its saved session never reaches yamux.
//! Other backends start kernels afresh or fork them (the namespaces backend's zygote);
//! gVisor and Kubernetes pods have no fork or snapshot path yet.
//!
//! **What a clone shares, and what it does not.** Everything in the snapshot is the same in
//! every VM restored from it, so nothing secret or per-session is in it: the zygote has no
//! connection file (key, session id, ports come with the start request, after the restore),
//! and no workspace (its disk is a blank placeholder; a restored VM gets a fresh disk of its
//! policy's size, which the agent mounts at the start after dropping the blocks the guest
//! cached of the blank one, `BLKFLSBUF`; the placeholder is a sparse 1 TiB). What the zygote
//! did draw from random generators is refreshed after the restore: the agent reseeds the
//! guest kernel's generator with host randomness (`RNDADDENTROPY`-style write plus
//! `RNDRESEEDCRNG`) and sets the clock, and the zygote reseeds Python's `random` and numpy's
//! global generator before it becomes the kernel. One thing cannot be redrawn in a
//! running interpreter: the seed of `str` hashing (`PYTHONHASHSEED`), which clones share.
//!
//! **Files.** A snapshot is `<dir>/<key>.vmstate`, mode 0600; the restored VMM gets it as an
//! open descriptor, never the path. The directory must be the gateway's own, mode 0700
//! (otherwise snapshots are off, said loudly), and a snapshot is opened only as the
//! gateway's private regular file, never through a link. `<key>` hashes everything the
//! state depends on (the guest images, the QEMU binary, the VM's shape and command line, the
//! zygote's command and start-up environment, the agent protocol), so a changed input makes
//! a new snapshot rather than restoring a stale one, and snapshots survive a gateway restart.
//! A snapshot a restore fails on is deleted, the session boots, and the kind is made again
//! after [`RETRY_AFTER`] (5 minutes).
//!
//! **Eviction.** Each snapshot is about its VM's RAM, and every change of an input makes a
//! new one: at most [`KEEP`] (8) are kept, the most recently used (a restore marks its file's
//! modification time), and none unused for [`UNUSED_FOR`] (14 days). Eviction runs when the
//! directory is opened and after each build. Gateways sharing a directory evict each
//! other's snapshots by the same rule; one that finds its snapshot gone boots and builds
//! it again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// How old a build's temporary file must be to be taken for a dead gateway's.
const STALE_BUILD: Duration = Duration::from_secs(3600);
/// How long after a failed attempt a kind of VM gets no new one (each costs a boot).
const RETRY_AFTER: Duration = Duration::from_secs(300);
/// How many snapshots a directory keeps: a few policies' kinds of VM.
const KEEP: usize = 8;
/// How long a snapshot nobody restored from is kept.
const UNUSED_FOR: Duration = Duration::from_secs(14 * 24 * 3600);
/// A snapshot's file name ends so.
const SUFFIX: &str = ".vmstate";

/// What a snapshot is of: one kind of VM.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Kind {
    pub memory_mib: u64,
    pub vcpus: u32,
    /// The zygote's command (interpreter, `-m`, launcher module).
    pub argv: Vec<String>,
    /// The zygote's environment (`fixed_at_zygote_start`), sorted.
    pub env: Vec<(String, String)>,
    /// The root image's environment the agent shows the kernel (python3's, python3-lean's:
    /// the same command in another venv).
    pub environment: Option<String>,
}

/// The state of one kind's snapshot.
enum State {
    Building,
    Ready,
    Failed { at: Instant },
}

/// The snapshots one backend keeps, in `dir`.
pub(super) struct Snapshots {
    dir: PathBuf,
    /// What every snapshot depends on beyond its kind (images, VMM, guest command line).
    base: String,
    states: parking_lot::Mutex<HashMap<String, State>>,
}

impl Snapshots {
    /// Snapshots in `dir` (made, private to the gateway's user), for VMs made from `inputs`
    /// (every file and setting the saved state depends on, hashed with each kind).
    pub(super) fn open(dir: &Path, inputs: &[String]) -> std::io::Result<Snapshots> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
        // Whoever can write here chooses the memory of every restored VM: the directory must
        // be the gateway's own and closed to everyone else (an existing one is never chmodded:
        // a wrong path must not loosen or tighten some other directory).
        let meta = std::fs::symlink_metadata(dir)?;
        let euid = rustix::process::geteuid().as_raw();
        if !meta.is_dir() || meta.uid() != euid || meta.mode() & 0o077 != 0 {
            return Err(std::io::Error::other(format!(
                "{} must be a directory of uid {euid} (the gateway's) with mode 0700, not a \
                 link; it is {}uid {}, mode {:o}",
                dir.display(),
                if meta.is_symlink() { "a link, " } else { "" },
                meta.uid(),
                meta.mode() & 0o7777
            )));
        }
        // Builds that a gateway ended midway left their temporary files; recent ones may be
        // another gateway's, at work (a build takes seconds, a minute under emulation).
        for entry in std::fs::read_dir(dir)?.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let stale = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= STALE_BUILD);
            if stale && (name.contains(".partial-") || name.starts_with("build-")) {
                let path = entry.path();
                let _ = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
            }
        }
        let mut base = Sha256::new();
        for input in inputs {
            base.update(input.as_bytes());
            base.update([0]);
        }
        let snapshots = Snapshots {
            dir: dir.to_owned(),
            base: hex::encode(base.finalize()),
            states: parking_lot::Mutex::new(HashMap::new()),
        };
        snapshots.evict();
        Ok(snapshots)
    }

    /// Deletes the snapshots beyond the [`KEEP`] most recently used, and those unused for
    /// [`UNUSED_FOR`]. A restore that has one open keeps reading it.
    fn evict(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut found: Vec<(std::time::SystemTime, PathBuf)> = entries
            .flatten()
            .filter(|entry| entry.file_name().to_string_lossy().ends_with(SUFFIX))
            .filter_map(|entry| {
                let meta = entry.metadata().ok()?;
                Some((meta.modified().ok()?, entry.path())).filter(|_| meta.is_file())
            })
            .collect();
        found.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
        for (rank, (used, path)) in found.into_iter().enumerate() {
            let unused = used.elapsed().unwrap_or_default();
            if rank < KEEP && unused < UNUSED_FOR {
                continue;
            }
            tracing::info!(snapshot = %path.display(), unused_s = unused.as_secs(),
                "microvm: evicting a warm-pool snapshot (at most {KEEP} are kept, none unused for {} days)",
                UNUSED_FOR.as_secs() / 86400);
            let _ = std::fs::remove_file(&path);
            if let Some(key) = path
                .file_name()
                .and_then(|name| name.to_str())
                .and_then(|name| name.strip_suffix(SUFFIX))
            {
                self.states.lock().remove(key);
            }
        }
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    fn key(&self, kind: &Kind) -> String {
        let mut hash = Sha256::new();
        hash.update(self.base.as_bytes());
        hash.update(format!("{}M {}cpu\0", kind.memory_mib, kind.vcpus).as_bytes());
        for word in &kind.argv {
            hash.update(word.as_bytes());
            hash.update([0]);
        }
        for (key, value) in &kind.env {
            hash.update(format!("{key}={value}\0").as_bytes());
        }
        if let Some(environment) = &kind.environment {
            hash.update(format!("environment {environment}\0").as_bytes());
        }
        hex::encode(hash.finalize())[..32].to_owned()
    }

    /// The file of `kind`'s snapshot, where it is.
    pub(super) fn path(&self, kind: &Kind) -> PathBuf {
        self.dir.join(format!("{}{SUFFIX}", self.key(kind)))
    }

    /// `kind`'s snapshot, opened, when there is one (made by this gateway or an earlier
    /// one). Opened without following links, and only if it is the gateway's own file
    /// closed to everyone else.
    pub(super) fn open_ready(&self, kind: &Kind) -> Option<std::fs::File> {
        let key = self.key(kind);
        let known = match self.states.lock().get(&key) {
            Some(State::Building) => return None,
            Some(State::Failed { at }) if at.elapsed() < RETRY_AFTER => return None,
            Some(State::Ready) => true,
            Some(State::Failed { .. }) | None => false,
        };
        let path = self.path(kind);
        let file = open_private(&path)?;
        // Its modification time is when it was last used: what eviction keeps by.
        if let Err(error) = file.set_modified(std::time::SystemTime::now()) {
            tracing::debug!(%error, "microvm: a snapshot's use not recorded");
        }
        if !known {
            self.states.lock().insert(key, State::Ready);
        }
        Some(file)
    }

    /// Whether the caller should make `kind`'s snapshot now: there is none, no snapshot is
    /// being made (one at a time: each is a VM's boot and its RAM written out), and no
    /// attempt failed lately. A `true` must be followed by [`Self::made`].
    pub(super) fn claim(&self, kind: &Kind) -> bool {
        let key = self.key(kind);
        let mut states = self.states.lock();
        if states.values().any(|s| matches!(s, State::Building)) {
            return false;
        }
        let claim = match states.get(&key) {
            Some(State::Ready | State::Building) => false,
            Some(State::Failed { at }) => at.elapsed() >= RETRY_AFTER,
            None => true,
        };
        if claim {
            states.insert(key, State::Building);
        }
        claim
    }

    /// Records how making `kind`'s snapshot ended.
    pub(super) fn made(&self, kind: &Kind, made: Result<PathBuf, String>) {
        let made_one = made.is_ok();
        let state = match made {
            Ok(path) => {
                tracing::info!(snapshot = %path.display(), memory_mib = kind.memory_mib,
                    vcpus = kind.vcpus, "microvm: warm-pool snapshot ready");
                State::Ready
            }
            Err(error) => {
                tracing::warn!(%error, memory_mib = kind.memory_mib, vcpus = kind.vcpus,
                    "microvm: no warm-pool snapshot: VMs of this kind boot (tried again in {} s)",
                    RETRY_AFTER.as_secs());
                State::Failed { at: Instant::now() }
            }
        };
        self.states.lock().insert(self.key(kind), state);
        if made_one {
            self.evict();
        }
    }

    /// Deletes `kind`'s snapshot after a restore from it failed; it is made again after
    /// [`RETRY_AFTER`] (not at once: a snapshot that keeps failing must not cost a build per
    /// session).
    pub(super) fn discard(&self, kind: &Kind, why: &str) {
        let path = self.path(kind);
        tracing::warn!(snapshot = %path.display(), why, "microvm: a restore failed; the snapshot is deleted and made again later");
        // Already gone (another gateway discarded it) is as good.
        let _ = std::fs::remove_file(&path);
        self.states
            .lock()
            .insert(self.key(kind), State::Failed { at: Instant::now() });
    }
}

/// `path` opened for reading if it is a regular file of the gateway's user that nobody else
/// may read or write, never through a link.
fn open_private(path: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    let own = meta.uid() == rustix::process::geteuid().as_raw();
    if !(meta.is_file() && own && meta.mode() & 0o077 == 0) {
        tracing::warn!(snapshot = %path.display(), "microvm: ignoring a snapshot that is not the gateway's private file");
        return None;
    }
    Some(file)
}

/// What a file contributes to a snapshot's key: its path, size and modification time (a
/// rebuilt image or an upgraded QEMU is another input).
pub(super) fn file_input(path: &Path) -> String {
    let meta = std::fs::metadata(path);
    let (len, modified) = meta
        .map(|m| {
            let modified = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            (m.len(), modified)
        })
        .unwrap_or((0, 0));
    format!("{} {len} {modified}", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(memory_mib: u64) -> Kind {
        Kind {
            memory_mib,
            vcpus: 1,
            argv: vec![
                "/opt/cellgate/venv/bin/python".into(),
                "-m".into(),
                "l".into(),
            ],
            env: vec![("LANG".into(), "C.UTF-8".into())],
            environment: Some("python3".into()),
        }
    }

    #[test]
    fn kinds_and_inputs_make_different_keys_and_claims_are_single() {
        let dir = std::env::temp_dir().join(format!("cg-snap-{}", std::process::id()));
        let a = Snapshots::open(&dir, &["images 1".into()]).unwrap();
        let b = Snapshots::open(&dir, &["images 2".into()]).unwrap();
        assert_ne!(a.path(&kind(672)), a.path(&kind(1184)));
        assert_ne!(a.path(&kind(672)), b.path(&kind(672)));
        let mut other_env = kind(672);
        other_env.env.push(("PYTHONHASHSEED".into(), "0".into()));
        assert_ne!(a.path(&kind(672)), a.path(&other_env));
        // python3-lean starts the same command as python3, in another venv.
        let other_venv = Kind {
            environment: Some("python3-lean".into()),
            ..kind(672)
        };
        assert_ne!(a.path(&kind(672)), a.path(&other_venv));

        assert!(a.open_ready(&kind(672)).is_none());
        assert!(a.claim(&kind(672)));
        assert!(!a.claim(&kind(672)), "one build at a time");
        assert!(!a.claim(&kind(1184)), "one build at a time, of any kind");
        a.made(&kind(672), Err("no".into()));
        assert!(!a.claim(&kind(672)), "no retry right after a failure");
        assert!(a.claim(&kind(1184)));
        a.made(&kind(1184), Ok(a.path(&kind(1184))));

        // Found on disk, by a gateway that did not make it; only if it is private.
        use std::os::unix::fs::PermissionsExt;
        let path = b.path(&kind(672));
        std::fs::write(&path, b"state").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(b.open_ready(&kind(672)).is_none(), "readable by others");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(b.open_ready(&kind(672)).is_some());
        b.discard(&kind(672), "test");
        assert!(!path.exists());
        assert!(!b.claim(&kind(672)), "no rebuild right after a discard");
        // A link is never followed.
        std::os::unix::fs::symlink("/etc/hostname", b.path(&kind(16))).unwrap();
        assert!(b.open_ready(&kind(16)).is_none());

        let partial = dir.join("x.vmstate.partial-1");
        std::fs::write(&partial, b"half").unwrap();
        let _ = Snapshots::open(&dir, &[]).unwrap();
        assert!(partial.exists(), "a recent build may be another gateway's");
        let old = std::time::SystemTime::now() - STALE_BUILD - Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&partial)
            .unwrap()
            .set_modified(old)
            .unwrap();
        let _ = Snapshots::open(&dir, &[]).unwrap();
        assert!(!partial.exists(), "left-overs swept");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_least_recently_used_and_long_unused_snapshots_are_evicted() {
        let dir = std::env::temp_dir().join(format!("cg-snap-evict-{}", std::process::id()));
        let snapshots = Snapshots::open(&dir, &["images".into()]).unwrap();
        let now = std::time::SystemTime::now();
        let write = |name: &str, age: Duration| {
            use std::os::unix::fs::OpenOptionsExt;
            let path = dir.join(name);
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&path)
                .unwrap();
            file.set_modified(now - age).unwrap();
            path
        };
        // Unused for too long, though there is room.
        let ancient = write("ancient.vmstate", UNUSED_FOR + Duration::from_secs(60));
        let recent = write("recent.vmstate", Duration::from_secs(60));
        let _ = Snapshots::open(&dir, &["images".into()]).unwrap();
        assert!(!ancient.exists(), "unused for too long");
        assert!(recent.exists());
        std::fs::remove_file(recent).unwrap();

        let kinds: Vec<Kind> = (0..KEEP as u64 + 2).map(|i| kind(100 + i)).collect();
        // KEEP + 2 snapshots, the first the oldest; and one unused for too long.
        let paths: Vec<PathBuf> = kinds
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let name = snapshots.path(k).file_name().unwrap().to_owned();
                write(
                    name.to_str().unwrap(),
                    Duration::from_secs(3600 * (kinds.len() - i) as u64),
                )
            })
            .collect();
        let other = write("notes.txt", UNUSED_FOR * 2);
        // A restore marks its snapshot used: the oldest is now the newest.
        assert!(snapshots.open_ready(&kinds[0]).is_some());
        let _ = Snapshots::open(&dir, &["images".into()]).unwrap();
        assert!(paths[0].exists(), "used just now");
        assert!(
            !paths[1].exists() && !paths[2].exists(),
            "least recently used"
        );
        assert!(paths[3..].iter().all(|p| p.exists()), "the {KEEP} kept");
        assert!(other.exists(), "only snapshots are evicted");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_open_to_others_is_refused_and_left_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("cg-snap-open-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let error = Snapshots::open(&dir, &[]).err().expect("refused");
        assert!(error.to_string().contains("mode 0700"), "{error}");
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755, "not chmodded");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
