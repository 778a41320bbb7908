//! The sandboxes' cgroups, as far as the gateway deals with them.
//!
//! runsc makes a sandbox's cgroups itself (below the gateway's own cgroup, at the spec's
//! relative `linux.cgroupsPath`) and removes the ones it made before `runsc run` returns,
//! which is too early for the exit watcher to read why the sandbox died. So the gateway
//! makes the memory and pids cgroups first, with their limits: runsc joins a cgroup that
//! exists and leaves it in place, the watcher reads its OOM and `pids.events` counters and
//! then removes it. Cgroups left behind by a gateway that died are swept when the backend
//! next starts. Where this process's cgroups are comes from [`cgroupfs`], the one reader of
//! the host's tables.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sandbox::cgroupfs;

/// The cgroup (relative to the gateway's own) that holds the sandboxes' cgroups.
pub(super) const CGROUP_PARENT: &str = "cellgate-gvisor";

/// Age past which an empty sandbox cgroup without its gateway's pid counts as left over.
const SWEEP_MIN_AGE: Duration = Duration::from_secs(120);

/// How many forks the sandbox's pids cgroup refused (`max` in `pids.events`).
pub(super) fn pids_limit_hits(cgroups_path: &str) -> Option<u64> {
    pids_limit_hits_in(&cgroup_dirs(cgroups_path))
}

/// How many processes the OOM killer killed in the memory cgroup `dir` (v1's
/// `memory.oom_control`, else v2's `memory.events`); 0 without a cgroup or a counter.
pub(super) fn oom_kills(dir: Option<&Path>) -> u64 {
    dir.and_then(|dir| std::fs::read_to_string(dir.join("memory.oom_control")).ok())
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
        .or_else(|| {
            let dir = dir?;
            let events = std::fs::read_to_string(dir.join("memory.events")).ok()?;
            events
                .lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
}

/// Where runsc makes the memory cgroup for the relative `cgroups_path`: below the gateway's
/// own cgroup in the memory hierarchy (v1), or in the unified hierarchy (v2).
pub(super) fn memory_cgroup_dir(cgroups_path: &str) -> Option<PathBuf> {
    controller_cgroup_dir("memory", cgroups_path)
}

/// The same for another v1 controller (or the unified hierarchy).
pub(super) fn controller_cgroup_dir(controller: &str, cgroups_path: &str) -> Option<PathBuf> {
    let tables = cgroupfs::Tables::read();
    let own = if tables
        .own
        .iter()
        .any(|o| o.controllers.iter().any(|c| c == controller))
    {
        tables.v1_dir(controller)
    } else {
        tables.v2_dir()
    };
    own.map(|dir| dir.join(cgroups_path))
}

/// Creates the sandbox's memory cgroup with its limit (swap included, so swap is no way
/// around it).
pub(super) fn create_memory_cgroup(dir: &Path, limit: Option<u64>) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let Some(bytes) = limit else {
        return Ok(());
    };
    let bytes = bytes.to_string();
    let result = if dir.join("memory.limit_in_bytes").exists() {
        std::fs::write(dir.join("memory.limit_in_bytes"), &bytes).and_then(|()| {
            // Absent without swap accounting: then there is no swap to escape to either.
            match std::fs::write(dir.join("memory.memsw.limit_in_bytes"), &bytes) {
                Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
                _ => Ok(()),
            }
        })
    } else {
        std::fs::write(dir.join("memory.max"), &bytes).and_then(|()| {
            match std::fs::write(dir.join("memory.swap.max"), "0") {
                Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
                _ => Ok(()),
            }
        })
    };
    if result.is_err() {
        let _ = std::fs::remove_dir(dir);
    }
    result
}

/// Creates the sandbox's pids cgroup with its limit `max`, so that its `pids.events`
/// outlives `runsc run`.
pub(super) fn create_pids_cgroup(dir: &Path, max: u64) -> io::Result<()> {
    let made = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(dir.join("pids.max"), max.to_string()));
    if made.is_err() {
        let _ = std::fs::remove_dir(dir);
    }
    made
}

/// The directory of the relative cgroup path `cgroups_path` in every cgroup hierarchy this
/// process is in (v1: one per mounted hierarchy; v2: the unified one).
pub(super) fn cgroup_dirs(cgroups_path: &str) -> Vec<PathBuf> {
    cgroupfs::Tables::read()
        .own_dirs()
        .into_iter()
        .map(|dir| dir.join(cgroups_path))
        .collect()
}

/// Removes a sandbox's cgroup `dirs` (one per hierarchy), waiting a little for each to empty.
/// runsc leaves its cgroups in place when one of them existed before (the memory and pids
/// cgroups made by the launch); each is empty once the sandbox's last process is gone.
pub(super) fn remove_cgroup_dirs(dirs: &[PathBuf]) {
    for dir in dirs {
        for _ in 0..50 {
            match std::fs::remove_dir(dir) {
                Err(err) if err.kind() != io::ErrorKind::NotFound => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => break,
            }
        }
    }
}

/// How long the processes a dead sandbox left may take to leave its cgroups once killed.
const LEFTOVER_WAIT: Duration = Duration::from_secs(15);

/// Ends what a sandbox whose keeper is gone left in its cgroup `dirs`, then removes them.
///
/// Why not [`remove_cgroup_dirs`] alone: its short wait suits a sandbox that has just ended
/// in order; here the sandbox was killed from outside, its processes may still be on their
/// way out (a loaded host took seconds), and nothing would try again, so the cgroups stayed
/// for good. Every process still listed is killed, pinned by a pidfd and seen in the cgroup
/// after the pin, so a pid reused meanwhile is never signalled; nothing else joins these
/// cgroups, which are named for this one sandbox.
pub(super) fn end_and_remove_cgroup_dirs(dirs: &[PathBuf]) {
    let deadline = std::time::Instant::now() + LEFTOVER_WAIT;
    for dir in dirs {
        loop {
            kill_members(dir);
            match std::fs::remove_dir(dir) {
                Err(err)
                    if err.kind() != io::ErrorKind::NotFound
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(err) if err.kind() != io::ErrorKind::NotFound => {
                    tracing::warn!(dir = %dir.display(), %err, "gvisor: a dead sandbox's cgroup could not be removed");
                    break;
                }
                _ => break,
            }
        }
    }
}

/// The pids `cgroup.procs` of `dir` lists.
fn members(dir: &Path) -> Vec<libc::pid_t> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// SIGKILLs the processes in the cgroup `dir` (see [`end_and_remove_cgroup_dirs`]).
fn kill_members(dir: &Path) {
    let listed = members(dir);
    if listed.is_empty() {
        return;
    }
    let pinned: Vec<_> = listed
        .into_iter()
        .filter_map(|pid| {
            crate::sandbox::sys::pidfd_open(pid)
                .ok()
                .map(|fd| (pid, fd))
        })
        .collect();
    let still = members(dir);
    for (pid, pidfd) in pinned {
        if still.contains(&pid) {
            let _ = crate::sandbox::sys::pidfd_send_signal(&pidfd, libc::SIGKILL);
        }
    }
}

/// How many forks the pids cgroup among `dirs` refused (`max` in `pids.events`).
pub(super) fn pids_limit_hits_in(dirs: &[PathBuf]) -> Option<u64> {
    dirs.iter().find_map(|dir| {
        std::fs::read_to_string(dir.join("pids.events"))
            .ok()?
            .lines()
            .find_map(|line| line.strip_prefix("max "))
            .and_then(|n| n.trim().parse().ok())
    })
}

/// Removes the empty cgroups of sandboxes whose `runsc run` was killed before it could
/// (a gateway that died). A cgroup with processes in it cannot be removed, so running
/// sandboxes of other gateways keep theirs.
pub(super) fn sweep_cgroups() {
    for parent in cgroup_dirs(CGROUP_PARENT) {
        let Ok(entries) = std::fs::read_dir(&parent) else {
            continue;
        };
        for entry in entries.flatten() {
            // Only those of dead gateways (the pid in the name): a live gateway may have just
            // made a sandbox's cgroup that runsc has not joined yet (empty, so removable).
            // Names without a pid: only old ones.
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix("cellgate-") else {
                continue;
            };
            let owner_alive = rest
                .split_once('-')
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
                .map(|pid| Path::new(&format!("/proc/{pid}")).exists());
            let old = || {
                entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > SWEEP_MIN_AGE)
            };
            let stale = entry.path().is_dir() && owner_alive.map_or_else(old, |alive| !alive);
            if stale {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}
