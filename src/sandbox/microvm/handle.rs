//! A running microVM kernel: signals and usage through the agent, `kill` by ending the VMM,
//! and the exit watch that says why a VM ended.
//!
//! Why a VM ends, in the order the watch tells them apart:
//! - the agent reported the kernel's end (its exit status; `oom` when the guest's OOM killer
//!   picked the kernel's cgroup, the pids limit when forks were refused), then the gateway
//!   powers the VM off;
//! - the gateway killed the VMM (`kill`): the kernel was killed, signal 9, as elsewhere;
//! - the guest kernel panicked (its console says so, and QEMU exits with `-no-reboot`);
//! - the host's OOM killer ended the VMM at the VM's memory limit on the host (its cgroup
//!   counts it);
//! - the VMM itself crashed or was killed by someone else.
//!
//! A VM saved to disk (hibernated, `hibernate.rs`) ends on purpose too: its agent session
//! closes first, which is not taken for a failure while the save runs.
//!
//! A VM that outlives the gateway (`survival.rs`) has a keeper besides: the handle holds
//! the link to it (the launching gateway's command pipe, or an adopting one's control
//! connection), and [`SandboxHandle::detach`] lets it go with the VM running. An adopted
//! VMM is not this gateway's child: its end is watched, and it is killed, through a pidfd.
//!
//! A kernel killed by a fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE) also carries the guest
//! kernel's record of it (`guest/agent/src/fault.rs`: the `segfault at … ip … in module[…]`
//! line from `/dev/kmsg`, the offset in the module and the code bytes), as the namespaces
//! backend does from the host's log.

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cellgate_agent::protocol::{Exit, Op};
use tokio::sync::watch;

use super::confine::Jail;
use crate::sandbox::agent::files::AgentFiles;
use crate::sandbox::agent::Agent;
use crate::sandbox::{
    ExitCause, ExitReason, ExitReport, ResourceUsage, SandboxError, SandboxHandle,
};

/// How long a guest gets to power off after its kernel ended before the VMM is killed.
const POWEROFF_GRACE: Duration = Duration::from_secs(2);

/// The VMM process: this gateway's child, or (adopted) another gateway's, held by a pidfd.
pub(super) enum VmmProcess {
    Child(tokio::process::Child),
    Adopted(std::os::fd::OwnedFd),
}

impl VmmProcess {
    /// Waits for the VMM's end: its status when it is this gateway's child.
    pub(super) async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match self {
            VmmProcess::Child(child) => child.wait().await,
            VmmProcess::Adopted(pidfd) => {
                let pidfd = pidfd.try_clone()?;
                crate::sandbox::sys::pidfd_wait(pidfd).await;
                Err(std::io::Error::other(
                    "it was adopted from an earlier gateway: its exit status is not known",
                ))
            }
        }
    }
}

/// The link to the keeper of a VM that outlives the gateway: closing it (dropping it) tells
/// the keeper that no gateway holds the VM any more.
pub(super) enum KeeperLink {
    /// The launching gateway's command pipe.
    Pipe(#[expect(dead_code, reason = "held open: its end is the message")] std::fs::File),
    /// An adopting gateway's control connection.
    Stream(
        #[expect(dead_code, reason = "held open: its end is the message")]
        std::os::unix::net::UnixStream,
    ),
}

/// What a VM that outlives the gateway adds to its handle.
pub(super) struct Kept {
    pub keeper: parking_lot::Mutex<Option<KeeperLink>>,
    pub keeper_proc: crate::sandbox::namespaces::survival::Proc,
    pub survival: crate::sandbox::Survival,
    pub kernel_id: String,
    pub generation: u64,
}

impl Kept {
    /// Forgets the VM, which ended: its control socket, and its record when it is this
    /// generation's (the kernel's next generation may have written its own already).
    pub(super) fn forget(&self) {
        #[derive(serde::Deserialize)]
        struct Generation {
            generation: u64,
        }
        let ours = self
            .survival
            .read_record::<Generation>(&self.kernel_id)
            .is_ok_and(|record| record.generation == self.generation);
        if ours {
            self.survival
                .remove_record(&self.kernel_id, self.generation);
        } else if let Some(path) = self.survival.control_path(&self.kernel_id, self.generation) {
            let _ = std::fs::remove_file(path);
        }
    }
}

pub(super) struct MicrovmHandle {
    vmm_pid: u32,
    /// The VMM's pidfd, when it was adopted (not this gateway's child: its pid could be
    /// reused once it ends, and nobody here reaps it).
    pidfd: Option<std::os::fd::OwnedFd>,
    /// The VM outlives the gateway: its keeper and record.
    kept: Option<Kept>,
    /// Let go for the next gateway: its end is not reported, and nothing is killed.
    detached: AtomicBool,
    agent: OnceLock<Arc<Agent>>,
    files: OnceLock<Arc<AgentFiles>>,
    /// The VMM is gone (never signal a pid that may have been reused).
    exited: Arc<AtomicBool>,
    /// The gateway ended the VMM on purpose.
    killed: AtomicBool,
    /// The VM's confinement on the host: its cgroup tells what the VM costs.
    jail: Arc<Jail>,
    /// How to save the VM, when its policy asks for hibernation.
    saver: Option<super::hibernate::Saver>,
    /// A save is under way: the agent session's end is the save's doing.
    hibernating: AtomicBool,
}

impl MicrovmHandle {
    pub(super) fn new(
        vmm_pid: u32,
        jail: Arc<Jail>,
        saver: Option<super::hibernate::Saver>,
        pidfd: Option<std::os::fd::OwnedFd>,
        kept: Option<Kept>,
    ) -> MicrovmHandle {
        MicrovmHandle {
            vmm_pid,
            pidfd,
            kept,
            detached: AtomicBool::new(false),
            agent: OnceLock::new(),
            files: OnceLock::new(),
            exited: Arc::new(AtomicBool::new(false)),
            killed: AtomicBool::new(false),
            jail,
            saver,
            hibernating: AtomicBool::new(false),
        }
    }

    /// The agent, once the kernel started. Called on the runtime, whose handle the file
    /// operations (on blocking threads) drive their streams with.
    pub(super) fn attach(&self, agent: Arc<Agent>) {
        let _ = self.files.set(Arc::new(AgentFiles::new(
            agent.clone(),
            tokio::runtime::Handle::current(),
        )));
        let _ = self.agent.set(agent);
    }

    /// What the VM adds when it outlives the gateway.
    pub(super) fn kept(&self) -> Option<&Kept> {
        self.kept.as_ref()
    }

    /// Ends the VMM at once, and with it the guest and everything in it. `on_purpose`: the
    /// gateway ended the kernel (its report is a plain kill), not a failure's clean-up.
    pub(super) fn kill_vmm(&self, on_purpose: bool) {
        if self.exited.load(Ordering::SeqCst) || self.vmm_pid == 0 {
            return;
        }
        if on_purpose {
            self.killed.store(true, Ordering::SeqCst);
        }
        if let Some(pidfd) = &self.pidfd {
            let _ = crate::sandbox::sys::pidfd_send_signal(pidfd, libc::SIGKILL);
            return;
        }
        let pid = rustix::process::Pid::from_raw(self.vmm_pid as i32);
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

impl SandboxHandle for MicrovmHandle {
    fn pid(&self) -> Option<u32> {
        Some(self.vmm_pid)
    }

    fn signal(&self, signal: i32) -> Result<(), SandboxError> {
        let Some(agent) = self.agent.get().cloned() else {
            return Ok(());
        };
        // The trait is synchronous; the guest answers within milliseconds, and a failure
        // (the VM is going away) has nobody to tell but the log.
        tokio::spawn(async move {
            if let Err(error) = agent.request(Op::Signal { signal }).await {
                tracing::debug!(%error, signal, "microvm: signal not delivered");
            }
        });
        Ok(())
    }

    fn kill(&self) -> Result<(), SandboxError> {
        self.kill_vmm(true);
        Ok(())
    }

    /// What the VM costs the host: its cgroup's CPU time and memory (VMM and device
    /// backend), or the VMM process's where there is no cgroup.
    fn usage(&self) -> ResourceUsage {
        if self.exited.load(Ordering::SeqCst) {
            return ResourceUsage::default();
        }
        self.jail
            .usage()
            .or_else(|| crate::sandbox::procfs::usage(self.vmm_pid))
            .unwrap_or_default()
    }

    /// The workspace is a disk inside the VM; the gateway has no path to it.
    fn workspace_root(&self, _workspace: &Path) -> Option<(PathBuf, PathBuf)> {
        None
    }

    /// The agent serves the workspace, while the VM runs.
    fn guest_files(&self) -> Option<Arc<dyn crate::workspace::GuestFiles>> {
        if self.exited.load(Ordering::SeqCst) {
            return None;
        }
        let files: Arc<dyn crate::workspace::GuestFiles> = self.files.get()?.clone();
        Some(files)
    }

    fn alive(&self) -> bool {
        !self.exited.load(Ordering::SeqCst)
    }

    /// Lets a VM that outlives the gateway go, running: the link to its agent closes (the
    /// guest waits for the next gateway, its kernel running on), the keeper is told no
    /// gateway holds it, and its cgroup stays.
    fn detach(&self) {
        let Some(kept) = &self.kept else {
            return;
        };
        self.detached.store(true, Ordering::SeqCst);
        self.jail.keep();
        if let Some(agent) = self.agent.get() {
            agent.close();
        }
        drop(kept.keeper.lock().take());
    }

    fn hibernate<'a>(
        &'a self,
        about: &'a crate::sandbox::Hibernation,
    ) -> futures_util::future::BoxFuture<'a, Result<crate::sandbox::Hibernated, SandboxError>> {
        Box::pin(async move {
            let refused =
                |why: &str| SandboxError::Microvm(super::MicrovmError::Start(why.to_owned()));
            let Some(saver) = &self.saver else {
                return Err(refused(
                    "this VM cannot hibernate: its policy has no hibernate_after, or the \
                     gateway has no state directory",
                ));
            };
            let Some(agent) = self.agent.get().cloned() else {
                return Err(refused("the VM's agent is not attached yet"));
            };
            let disk = super::hibernate::allocated(&saver.runtime_dir.join(super::WORKSPACE_DISK));
            if let Err(why) = super::hibernate::room_for(saver, disk) {
                return Err(SandboxError::NotNow(why));
            }
            if self.exited.load(Ordering::SeqCst) || self.hibernating.swap(true, Ordering::SeqCst) {
                return Err(refused("the VM is gone, or being saved already"));
            }
            let exited = self.exited.clone();
            let saved = super::hibernate::save(saver, about, &agent, self.vmm_pid, || {
                exited.load(Ordering::SeqCst)
            })
            .await;
            if saved.is_err() {
                // Stopped, detached or half saved: the VM cannot go on. What was saved goes.
                self.kill_vmm(false);
                saver.hibernations.remove(&about.kernel_id);
            }
            Ok(saved?)
        })
    }
}

/// Watches the VM until it ends and reports exactly once.
pub(super) fn watch_exit(
    mut child: VmmProcess,
    companion: Option<tokio::process::Child>,
    agent: Arc<Agent>,
    handle: Arc<MicrovmHandle>,
    log_file: PathBuf,
    console: File,
    report: watch::Sender<Option<ExitReport>>,
) {
    tokio::spawn(async move {
        let mut kernel_exit = agent.exit();
        let ended = tokio::select! {
            status = child.wait() => Err(status),
            ended = kernel_exit.wait_for(Option::is_some) => Ok(ended.ok().and_then(|e| e.clone())),
        };
        if handle.detached.load(Ordering::SeqCst) {
            // Let go for the next gateway: the VM runs on, its cgroup kept; nothing is
            // reported (the kernel layer expects no end), and the VMM is never killed.
            if let VmmProcess::Child(child) = child {
                std::mem::forget(child);
            }
            return;
        }
        // Marked as soon as the VMM is reaped: its pid may be another process's from then on.
        let reaped = |handle: &MicrovmHandle| handle.exited.store(true, Ordering::SeqCst);
        let exit_report = match ended {
            Ok(Some(exit)) => {
                crate::sandbox::agent::keep_log_tail(&log_file, &exit.log_tail);
                // The kernel is gone; the VM goes too. The agent powers off when asked; a
                // guest that does not is killed.
                let poweroff = agent.request(Op::Poweroff);
                let _ = tokio::time::timeout(POWEROFF_GRACE, poweroff).await;
                if tokio::time::timeout(POWEROFF_GRACE, child.wait())
                    .await
                    .is_err()
                {
                    handle.kill_vmm(false);
                    let _ = child.wait().await;
                }
                reaped(&handle);
                kernel_report(&exit)
            }
            Ok(None) if handle.hibernating.load(Ordering::SeqCst) => {
                // Being saved: the VMM ends once its state is written (or the save, failing,
                // kills it).
                let status = child.wait().await;
                reaped(&handle);
                match status {
                    Ok(status) if status.success() => ExitReport {
                        code: Some(0),
                        signal: None,
                        reason: None,
                    },
                    status => vm_report(status.ok(), &handle, &log_file, &console),
                }
            }
            Ok(None) => {
                // The agent session ended without a word on the kernel (the guest broke the
                // protocol or the link closed): the VM goes, as a failure unless the gateway
                // killed it.
                handle.kill_vmm(false);
                let _ = child.wait().await;
                reaped(&handle);
                let why = agent.closed().borrow().clone().unwrap_or_default();
                let mut report = vm_report(None, &handle, &log_file, &console);
                if let Some(reason) = &mut report.reason {
                    reason.text = format!("{why}: {}", reason.text);
                }
                report
            }
            Err(status) => {
                reaped(&handle);
                vm_report(status.ok(), &handle, &log_file, &console)
            }
        };
        // The vsock device's backend has no VM left to serve.
        if let Some(mut companion) = companion {
            let _ = companion.kill().await;
        }
        let jail = handle.jail.clone();
        let _ = tokio::task::spawn_blocking(move || jail.release()).await;
        if let Some(kept) = &handle.kept {
            // Forgotten before the report: the report may start the kernel's next
            // generation, whose record this must not remove. The keeper ends by itself.
            kept.forget();
            drop(kept.keeper.lock().take());
        }
        let _ = report.send(Some(exit_report));
    });
}

/// The kernel's end as the agent saw it.
fn kernel_report(exit: &Exit) -> ExitReport {
    let reason = if exit.oom {
        Some(ExitReason::new(
            ExitCause::OutOfMemory,
            "the kernel ran out of memory: the guest's out-of-memory killer ended it at the \
             policy's memory limit"
                .to_owned(),
        ))
    } else if exit.pids_limit_hits > 0 && exit.signal.is_some() {
        Some(ExitReason::new(
            ExitCause::PidsLimit,
            format!(
                "the kernel died after {} process creations were refused at the {}",
                exit.pids_limit_hits,
                crate::sandbox::PIDS_LIMIT_REASON
            ),
        ))
    } else {
        exit.signal
            .zip(exit.fault.as_deref())
            .map(|(signal, record)| crate::sandbox::fault_reason(signal, record))
    };
    ExitReport {
        code: exit.code,
        signal: exit.signal,
        reason,
    }
}

/// The VM's end when the agent reported none.
fn vm_report(
    status: Option<std::process::ExitStatus>,
    handle: &MicrovmHandle,
    log_file: &Path,
    console: &File,
) -> ExitReport {
    if handle.killed.load(Ordering::SeqCst) {
        return ExitReport {
            code: None,
            signal: Some(libc::SIGKILL),
            reason: None,
        };
    }
    let console_text = tail_of(console);
    if let Some(panic) = console_text.lines().find(|l| l.contains("Kernel panic")) {
        return failed(format!("the guest kernel panicked: {}", clean(panic)));
    }
    if handle.jail.oom_kills() > 0 {
        return failed(
            "the host's out-of-memory killer ended the VMM at the VM's memory limit on the host \
             (guest RAM plus the VMM's own overhead)"
                .to_owned(),
        );
    }
    let how = match status {
        Some(status) => match (status.code(), status.signal()) {
            (_, Some(signal)) => format!("was killed by signal {signal}"),
            (Some(code), None) => format!("exited with code {code}"),
            (None, None) => "ended".to_owned(),
        },
        None => "was lost".to_owned(),
    };
    failed(format!(
        "the VM ended without its kernel: the VMM {how}: {}",
        last_words(log_file, console)
    ))
}

fn failed(text: String) -> ExitReport {
    ExitReport {
        code: None,
        signal: None,
        reason: Some(ExitReason::new(ExitCause::SandboxFailed, text)),
    }
}

/// The last lines of the VMM's own log and of the guest's console, for an error message.
pub(super) fn last_words(log_file: &Path, console: &File) -> String {
    let tail = |text: String, lines: usize| {
        let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        all[all.len().saturating_sub(lines)..]
            .iter()
            .map(|l| clean(l))
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let vmm = tail(
        File::open(log_file)
            .map(|file| tail_of(&file))
            .unwrap_or_default(),
        3,
    );
    let guest = tail(tail_of(console), 3);
    match (vmm.is_empty(), guest.is_empty()) {
        (true, true) => "no output".to_owned(),
        (false, true) => vmm,
        (true, false) => format!("guest console: {guest}"),
        (false, false) => format!("{vmm}; guest console: {guest}"),
    }
}

/// How much of the end of a log or console the gateway reads: the guest writes the console
/// and may make it any size.
const TAIL_BYTES: u64 = 64 << 10;

/// The last [`TAIL_BYTES`] of `file`, invalid UTF-8 replaced (never the whole file).
fn tail_of(file: &File) -> String {
    use std::os::unix::fs::FileExt;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(TAIL_BYTES);
    let mut bytes = vec![0; (len - start) as usize];
    let mut read = 0;
    while read < bytes.len() {
        match file.read_at(&mut bytes[read..], start + read as u64) {
            Ok(0) | Err(_) => break,
            Ok(n) => read += n,
        }
    }
    bytes.truncate(read);
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A console line without its timestamp and control characters.
fn clean(line: &str) -> String {
    let line = match line.trim_start().strip_prefix('[') {
        Some(rest) => rest.split_once(']').map_or(line, |(_, after)| after),
        None => line,
    };
    line.chars()
        .filter(|c| !c.is_control())
        .collect::<String>()
        .trim()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_lines_lose_their_timestamps() {
        assert_eq!(
            clean("[    1.234567] Kernel panic - not syncing: Attempted to kill init!"),
            "Kernel panic - not syncing: Attempted to kill init!"
        );
        assert_eq!(clean("plain\r"), "plain");
    }

    #[test]
    fn an_oom_kill_in_the_guest_is_an_oom() {
        let exit = Exit {
            code: None,
            signal: Some(9),
            oom: true,
            pids_limit_hits: 0,
            log_tail: String::new(),
            fault: None,
        };
        assert!(kernel_report(&exit).is_oom());
        let plain = Exit { oom: false, ..exit };
        assert_eq!(kernel_report(&plain).cause(), ExitCause::Exited);
    }

    #[test]
    fn a_fault_says_where_it_happened() {
        let exit = Exit {
            code: None,
            signal: Some(11),
            oom: false,
            pids_limit_hits: 0,
            log_tail: String::new(),
            fault: Some("python3[9]: segfault at 0 ip 1234 sp 0 error 4 in a.so[1000+1000] (ip is a.so+0x234)".into()),
        };
        let report = kernel_report(&exit);
        assert_eq!(report.cause(), ExitCause::Exited);
        assert_eq!(
            report.describe(),
            "kernel process killed by signal 11 (SIGSEGV); Linux logged: \
             python3[9]: segfault at 0 ip 1234 sp 0 error 4 in a.so[1000+1000] (ip is a.so+0x234)"
        );
        let unrecorded = Exit {
            fault: None,
            ..exit
        };
        assert_eq!(
            kernel_report(&unrecorded).describe(),
            "kernel process killed by signal 11 (SIGSEGV)"
        );
    }
}
