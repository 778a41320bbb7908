//! A running kernel pod: signals and usage through its agent, `kill` by deleting the pod,
//! and the exit watch that tells the kernel's own end (from the agent) from the pod's
//! (failed, evicted, deleted by someone else: from the API's watch) and from a link that
//! broke.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cellgate_agent::protocol::{Exit, Op, Reply};
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, WatchEvent, WatchParams};
use tokio::sync::watch;

use super::status::{self, PodState};
use super::PodRemover;
use crate::sandbox::agent::files::AgentFiles;
use crate::sandbox::agent::Agent;
use crate::sandbox::{
    ExitCause, ExitReason, ExitReport, ResourceUsage, SandboxError, SandboxHandle,
};

/// How fresh a usage reading must be before another is asked for: the trait's `usage` is
/// synchronous, so it answers the latest reading and refreshes it in the background.
const USAGE_FRESH: Duration = Duration::from_millis(500);
/// How long a broken link waits for the pod's status to say why.
const LINK_EXPLAINED: Duration = Duration::from_secs(10);

pub(super) struct PodHandle {
    agent: Arc<Agent>,
    files: Arc<AgentFiles>,
    remover: Arc<PodRemover>,
    /// The pod is gone or going.
    ended: Arc<AtomicBool>,
    /// The gateway deleted the pod on purpose.
    killed: AtomicBool,
    /// The gateway let the pod go, running, to another replica.
    detached: Arc<AtomicBool>,
    usage: Arc<parking_lot::Mutex<(Option<Instant>, ResourceUsage)>>,
}

impl PodHandle {
    pub(super) fn new(agent: Arc<Agent>, remover: PodRemover) -> PodHandle {
        PodHandle {
            agent: agent.clone(),
            files: Arc::new(AgentFiles::new(agent, tokio::runtime::Handle::current())),
            remover: Arc::new(remover),
            ended: Arc::new(AtomicBool::new(false)),
            killed: AtomicBool::new(false),
            detached: Arc::new(AtomicBool::new(false)),
            usage: Arc::default(),
        }
    }

    /// Deletes the pod and its Secret, in the background (the trait is synchronous).
    pub(super) fn delete_pod(&self) {
        self.ended.store(true, Ordering::SeqCst);
        self.agent.close();
        let remover = self.remover.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { remover.now().await });
        }
    }
}

impl SandboxHandle for PodHandle {
    /// A pod's processes have no pid on the gateway's host.
    fn pid(&self) -> Option<u32> {
        None
    }

    fn signal(&self, signal: i32) -> Result<(), SandboxError> {
        let agent = self.agent.clone();
        tokio::spawn(async move {
            if let Err(error) = agent.request(Op::Signal { signal }).await {
                tracing::debug!(%error, signal, "kubernetes: signal not delivered");
            }
        });
        Ok(())
    }

    fn kill(&self) -> Result<(), SandboxError> {
        self.killed.store(true, Ordering::SeqCst);
        // The kernel first, through the agent, so its end is reported at once; the pod
        // follows.
        let agent = self.agent.clone();
        tokio::spawn(async move {
            let _ = agent.request_within(Op::Kill, Duration::from_secs(2)).await;
        });
        self.delete_pod();
        Ok(())
    }

    /// The container's cgroup as the agent reads it (the kernel and the agent together).
    fn usage(&self) -> ResourceUsage {
        let (read_at, latest) = self.usage.lock().clone();
        if read_at.is_none_or(|at| at.elapsed() > USAGE_FRESH) && !self.ended.load(Ordering::SeqCst)
        {
            let (agent, usage) = (self.agent.clone(), self.usage.clone());
            tokio::spawn(async move {
                if let Ok(Reply::Usage(read)) = agent
                    .request_within(Op::Usage, Duration::from_secs(5))
                    .await
                {
                    *usage.lock() = (
                        Some(Instant::now()),
                        ResourceUsage {
                            cpu_time: read.cpu_time_us.map(Duration::from_micros),
                            memory_bytes: read.memory_bytes,
                            memory_peak_bytes: read.memory_peak_bytes,
                        },
                    );
                }
            });
        }
        latest
    }

    fn workspace_root(&self, _workspace: &std::path::Path) -> Option<(PathBuf, PathBuf)> {
        None
    }

    fn guest_files(&self) -> Option<Arc<dyn crate::workspace::GuestFiles>> {
        if self.ended.load(Ordering::SeqCst) {
            return None;
        }
        let files: Arc<dyn crate::workspace::GuestFiles> = self.files.clone();
        Some(files)
    }

    fn alive(&self) -> bool {
        !self.ended.load(Ordering::SeqCst)
    }

    fn detach(&self) {
        self.detached.store(true, Ordering::SeqCst);
        self.ended.store(true, Ordering::SeqCst);
        self.agent.close();
    }
}

/// Watches the kernel until it ends and reports exactly once; then the pod goes.
pub(super) fn watch_exit(
    handle: Arc<PodHandle>,
    agent: Arc<Agent>,
    pods: Api<Pod>,
    name: String,
    version: String,
    log_file: PathBuf,
    report: watch::Sender<Option<ExitReport>>,
) {
    tokio::spawn(async move {
        enum Ended {
            Kernel(Option<Exit>),
            Pod(String),
            Link,
        }
        let mut kernel_exit = agent.exit();
        let mut closed = agent.closed();
        let ended = tokio::select! {
            exit = kernel_exit.wait_for(Option::is_some) => Ended::Kernel(exit.ok().and_then(|e| e.clone())),
            why = pod_ended(&pods, &name, version.clone()) => Ended::Pod(why),
            _ = closed.wait_for(Option::is_some) => Ended::Link,
        };
        let exit_report = match ended {
            Ended::Kernel(Some(exit)) => {
                crate::sandbox::agent::keep_log_tail(&log_file, &exit.log_tail);
                kernel_report(&exit)
            }
            Ended::Pod(why) => lost(&handle, why),
            // The agent's exit watch ends with its session: the link broke.
            Ended::Kernel(None) | Ended::Link if !handle.remover.still_ours().await => {
                // Another replica took the kernel over (this one was paused past its
                // lease): its pod is not this replica's to delete, nor its end to report.
                tracing::warn!(pod = %name, "this replica lost a kernel to another replica");
                handle.detached.store(true, Ordering::SeqCst);
                handle.ended.store(true, Ordering::SeqCst);
                return;
            }
            Ended::Kernel(None) | Ended::Link => {
                // The link broke: the pod's end explains it when the pod ended (the kubelet
                // writes the status a moment after the container goes).
                let link = closed.borrow().clone().unwrap_or_default();
                let why = tokio::time::timeout(LINK_EXPLAINED, pod_ended(&pods, &name, version))
                    .await
                    .unwrap_or_else(|_| format!("the link to the kernel's pod broke ({link})"));
                lost(&handle, why)
            }
        };
        if handle.detached.load(Ordering::SeqCst) {
            // Another replica's now: no end to report, nothing to delete.
            return;
        }
        handle.delete_pod();
        let _ = report.send(Some(exit_report));
    });
}

/// Follows the pod until it has ended (failed, evicted, deleted); the reason.
async fn pod_ended(pods: &Api<Pod>, name: &str, mut version: String) -> String {
    loop {
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(290);
        let events = match pods.watch(&params, &version).await {
            Ok(events) => events,
            Err(error) => {
                // The API is unreachable for a while: the kernel runs on meanwhile.
                tracing::debug!(pod = %name, %error, "kubernetes: watching the pod");
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
        };
        let mut events = events.boxed();
        loop {
            match events.try_next().await {
                Ok(Some(WatchEvent::Added(pod) | WatchEvent::Modified(pod))) => {
                    if let Some(seen) = pod.metadata.resource_version.clone() {
                        version = seen;
                    }
                    if let PodState::Ended { why } = status::state(&pod) {
                        return why;
                    }
                }
                Ok(Some(WatchEvent::Deleted(_))) => {
                    return "the kernel's pod was deleted".to_owned()
                }
                Ok(Some(WatchEvent::Bookmark(bookmark))) => {
                    version = bookmark.metadata.resource_version
                }
                Ok(Some(WatchEvent::Error(_))) => {
                    // Expired: read the pod as it is now and watch on from there.
                    match pods.get_opt(name).await {
                        Ok(None) => return "the kernel's pod was deleted".to_owned(),
                        Ok(Some(pod)) => {
                            if let PodState::Ended { why } = status::state(&pod) {
                                return why;
                            }
                            version = pod.metadata.resource_version.unwrap_or_default();
                        }
                        Err(_) => version = "0".to_owned(),
                    }
                    break;
                }
                Ok(None) | Err(_) => break,
            }
        }
    }
}

/// The kernel's end as the agent saw it.
fn kernel_report(exit: &Exit) -> ExitReport {
    let reason = exit
        .oom
        .then(|| {
            ExitReason::new(
                ExitCause::OutOfMemory,
                "the kernel ran out of memory: it was killed at its pod's memory limit (the \
                 policy's memory plus the agent's share)"
                    .to_owned(),
            )
        })
        .or_else(|| {
            exit.signal
                .zip(exit.fault.as_deref())
                .map(|(signal, record)| crate::sandbox::fault_reason(signal, record))
        });
    ExitReport {
        code: exit.code,
        signal: exit.signal,
        reason,
    }
}

/// The pod went without a word from the agent on its kernel: a plain kill when the gateway
/// deleted it, the sandbox lost otherwise.
fn lost(handle: &PodHandle, why: String) -> ExitReport {
    if handle.killed.load(Ordering::SeqCst) {
        return ExitReport {
            code: None,
            signal: Some(libc::SIGKILL),
            reason: None,
        };
    }
    ExitReport {
        code: None,
        signal: None,
        reason: Some(ExitReason::new(ExitCause::SandboxFailed, why)),
    }
}
