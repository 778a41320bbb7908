//! The exit watcher: turns the end of `runsc run` into the one [`ExitReport`] every backend
//! owes, then cleans up after the sandbox.
//!
//! Under gVisor the kernel has no host process of its own, so `runsc run`, which exits with
//! the container's status, stands for it. Why the sandbox died is read from the cgroups the
//! launch made (see [`super::cgroups`]) before anything removes them: this build of runsc
//! ends the whole sandbox when a limit is hit, so an OOM kill or refused forks are the only
//! way to tell a limit from a crash. The report goes out first, so a death is seen within a
//! second; `runsc delete`, the bundle's removal and the cgroups' removal follow.

#![allow(unsafe_code)]

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::process::Child;
use tokio::sync::watch;

use super::cgroups::{
    cgroup_dirs, controller_cgroup_dir, oom_kills, pids_limit_hits, remove_cgroup_dirs,
};
use super::runsc::Runsc;
use crate::sandbox::{ExitCause, ExitReason, ExitReport};

#[allow(clippy::too_many_arguments)]
pub(super) async fn watch_exit(
    mut child: Child,
    cgroups_path: String,
    exited: Arc<AtomicBool>,
    runsc: Runsc,
    bundle: PathBuf,
    memory_limit: Option<u64>,
    memory_cgroup: Option<PathBuf>,
    exit_tx: watch::Sender<Option<ExitReport>>,
) {
    let status = child.wait().await;
    exited.store(true, Ordering::SeqCst);
    let pid = child.id();
    // Whatever of the `runsc run` group is left (nothing, normally).
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory involved.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    // "Gone" means no process left: the Sentry and the gofer die from their parent-death
    // signal a moment after `runsc run`; their (pre-created) pids cgroup says when.
    if let Some(procs) =
        controller_cgroup_dir("pids", &cgroups_path).map(|dir| dir.join("cgroup.procs"))
    {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while std::fs::read_to_string(&procs).is_ok_and(|t| !t.trim().is_empty())
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // Read before `runsc delete` removes the cgroups.
    let pids_hits = pids_limit_hits(&cgroups_path).unwrap_or(0);
    let oom_kills = oom_kills(memory_cgroup.as_deref());
    let report = match status {
        Ok(status) => report(
            Ended::of(status.code(), status.signal()),
            pids_hits,
            oom_kills,
            memory_limit,
        ),
        Err(err) => ExitReport {
            code: None,
            signal: None,
            reason: Some(ExitReason::new(
                ExitCause::SandboxFailed,
                format!("lost track of runsc: {err}"),
            )),
        },
    };
    // Reported at once (a death within a second), then cleaned up: the Sentry and the gofer
    // already have their parent-death signal from `runsc run`, and `runsc delete` makes sure.
    let _ = exit_tx.send(Some(report));
    let _ = tokio::task::spawn_blocking({
        let runsc = runsc.clone();
        move || {
            let _ = runsc.run(&["delete", "--force"], &[]);
        }
    })
    .await;
    let cleanup = tokio::task::spawn_blocking(move || {
        let _ = std::fs::remove_dir_all(&bundle);
        remove_cgroup_dirs(&cgroup_dirs(&cgroups_path));
    });
    let _ = cleanup.await;
}

/// How `runsc run` ended, as the keeper of a surviving sandbox reports it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Ended {
    pub(super) code: Option<i32>,
    pub(super) signal: Option<i32>,
}

impl Ended {
    /// From `runsc run`'s wait status: runsc exits with the container's status, 128 + n for
    /// a signal.
    pub(super) fn of(code: Option<i32>, signal: Option<i32>) -> Ended {
        match (code, signal) {
            (Some(code), _) if code > 128 => Ended {
                code: None,
                signal: Some(code - 128),
            },
            (code, signal) => Ended { code, signal },
        }
    }
}

/// The exit report of a sandbox that ended as `ended`, with the limits' counters read from
/// its cgroups before they were removed.
pub(super) fn report(
    ended: Ended,
    pids_hits: u64,
    oom_kills: u64,
    memory_limit: Option<u64>,
) -> ExitReport {
    let Ended { code, signal } = ended;
    // The OOM killer may pick any process of the sandbox: the sentry (runsc reports
    // SIGKILL) or a runsc helper (runsc then fails with its own status, seen as 2 on a CI
    // run). Any abnormal end with an OOM kill counted is an out-of-memory end.
    let abnormal = signal.is_some() || code != Some(0);
    let reason = if abnormal && oom_kills > 0 {
        Some(ExitReason::new(
            ExitCause::OutOfMemory,
            match memory_limit {
                Some(bytes) => format!(
                    "kernel process killed by the out-of-memory killer (the sandbox's limit of {bytes} bytes, \
                     workspace files included; gVisor ends the whole sandbox)"
                ),
                None => "kernel process killed by the out-of-memory killer".to_owned(),
            },
        ))
    } else if abnormal && pids_hits > 0 {
        // The Sentry cannot run without creating threads: when the guest's forks exhaust
        // the pids limit, gVisor itself fails and the sandbox ends.
        Some(ExitReason::new(
            ExitCause::PidsLimit,
            format!(
                "the sandbox reached its process limit ({}: {pids_hits} forks refused) and gVisor ended it",
                crate::sandbox::PIDS_LIMIT_REASON
            ),
        ))
    } else {
        None
    };
    ExitReport {
        code,
        signal,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runsc_statuses_past_128_are_signals() {
        assert_eq!(
            Ended::of(Some(137), None),
            Ended {
                code: None,
                signal: Some(9)
            }
        );
        assert_eq!(Ended::of(Some(0), None).code, Some(0));
        let oom = report(Ended::of(Some(137), None), 0, 1, Some(1 << 20));
        assert_eq!(oom.reason.map(|r| r.cause), Some(ExitCause::OutOfMemory));
        let limit = report(Ended::of(Some(2), None), 3, 0, None);
        assert_eq!(limit.reason.map(|r| r.cause), Some(ExitCause::PidsLimit));
        assert!(report(Ended::of(Some(0), None), 3, 1, None)
            .reason
            .is_none());
    }
}
