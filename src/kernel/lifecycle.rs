//! One kernel's life: start, readiness, interrupt, restart (same id), shutdown, death.
//!
//! A [`Kernel`] outlives its processes. Each start or restart launches a new *generation*
//! (a fresh connection file, key and sockets) in the sandbox, while the [`Router`] with its
//! attached clients and buffers stays. Readiness means the gateway's own `kernel_info_request`
//! was answered and the iopub subscription delivered a status: from then on no output can be
//! lost to the ZMQ subscription race, so clients attach without any nudge of their own (the
//! gateway's nudge is resent every 500 ms and waits on the router's signal that the state
//! left `starting`, not on a poll). Readiness is published on a watch channel (starting,
//! ready, restarting, dead, terminated), which sessions turn into kernel phases without polling.
//!
//! Death is noticed from the sandbox's exit watch (milliseconds), reported as
//! `execution_state: dead` with a `reason` (exit code or signal plus the tail of the
//! kernel's log) and a synthesised `status: dead` on iopub. A watchdog enforces the policy's
//! execution timeout: interrupt, then restart after the policy's grace period, answering the
//! cell with an error, a reply and `idle` itself. The kernel model (`KernelModel`) carries
//! cellgate's own fields under `cellgate`: policy, sandbox, and `state_generation`, which
//! changes whenever the kernel's variables were lost.
//!
//! **Hibernation.** An idle kernel whose sandbox can be saved ([`Kernel::hibernate`]: a
//! microVM under a policy with `hibernate_after`) has its sandbox written to disk and ended;
//! the kernel stays registered, `hibernated`, with its id, clients, history and generation.
//! Whatever next waits for the kernel to be ready (a message to send, a client attaching, a
//! file operation) restores it first ([`Kernel::wake`]): the backend adopts the saved
//! sandbox under the same generation and key, and the next execution's result says
//! `restored`. A restore that fails while what was saved is still there (the backend keeps
//! it after a failure of the host's before the sandbox ran) leaves the kernel hibernated:
//! the request is refused with [`KernelError::RestoreDeferred`] and the next one tries
//! again; a restart is the user's way to start afresh instead. One that fails with the save
//! gone is a lost sandbox: a fresh process starts, the generation moves on, and
//! `last_restart_reason` says why. A restore runs in a task of its own: a waiter that gives
//! up (a request's timeout) never cuts it midway.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::channels::{spawn_heartbeat, Channels};
use super::execution::{limit_exit, ExecutionState, Outcome};
use super::launch::{kernel_env, write_connection_file, KernelDirs};
use super::router::{ClientId, Router};
use super::spec::{InterruptMode, KernelSpec};
use super::KernelError;
use crate::ownership::KernelRecord;
use crate::protocol::{Channel, Message};
use crate::sandbox::{
    ExitReport, KernelLabels, LaunchSpec, Launched, Limits, Sandbox, SandboxHandle,
};
use crate::telemetry::metrics::RestoreOutcome;
use crate::timestamp::format_timestamp;

/// The environment variable that tells the kernel launcher
/// (kernels/python3/cellgate_kernel_launcher.py) the output limit of one execution.
pub const OUTPUT_LIMIT_ENV: &str = "CELLGATE_OUTPUT_LIMIT";
/// The variable that names the kernel's policy.
pub const POLICY_ENV: &str = "CELLGATE_POLICY";

/// Where IPython, matplotlib and other XDG-minded libraries keep their own files inside a
/// sandbox (whose `/tmp` is private), rather than under `$HOME`, the user's workspace.
const SANDBOX_TMP_DIRS: &[(&str, &str)] = &[
    ("IPYTHONDIR", "/tmp/.ipython"),
    ("MPLCONFIGDIR", "/tmp/.config/matplotlib"),
    ("XDG_CACHE_HOME", "/tmp/.cache"),
    ("XDG_CONFIG_HOME", "/tmp/.config"),
];

/// Timeouts of the lifecycle.
#[derive(Debug, Clone)]
pub struct KernelOptions {
    /// From launch to ready; past it the kernel is killed and reported dead.
    pub start_timeout: Duration,
    /// How long a kernel may take to exit after `shutdown_request` before it is killed.
    pub shutdown_grace: Duration,
    pub limits: Limits,
    /// A cell running longer is interrupted and reported as `CellTimeoutError`.
    pub execution_timeout: Option<Duration>,
    /// After that interrupt, how long before the kernel is restarted.
    pub interrupt_grace: Duration,
    /// Output bytes one execution may produce before the rest is dropped.
    pub output_limit: Option<u64>,
    /// The policy's idle timeout and lifetime, enforced by the manager's culler.
    pub idle_timeout: Option<Duration>,
    pub lifetime: Option<Duration>,
    /// The gateway's egress proxy (namespaces backend only; elsewhere the kernel has no
    /// network at all). It applies `policy`.
    pub egress: Option<Arc<crate::egress::Egress>>,
    /// The kernel's policy, set by the manager at launch: what the egress proxy allows.
    pub policy: Option<Arc<crate::policy::Policy>>,
    /// The tenant the kernel is started for, when one asked (its sandbox's labels).
    pub tenant: Option<String>,
    /// An orphan's sandbox to take over from a gateway that is gone, and the key its kernel
    /// signs with: the first generation attaches to it instead of launching.
    pub adopt: Option<(KernelRecord, String)>,
    /// The state generation before the first launch (0 for a new kernel): a session's kernel
    /// started again after a gateway restart goes on from its last generation.
    pub first_generation: u64,
    /// How long ago the kernel started, when it started under an earlier gateway (an
    /// adopted kernel's lifetime goes on counting from its start).
    pub age: Option<Duration>,
}

impl Default for KernelOptions {
    fn default() -> Self {
        KernelOptions {
            start_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(3),
            limits: Limits::default(),
            execution_timeout: None,
            interrupt_grace: Duration::from_secs(10),
            output_limit: None,
            idle_timeout: None,
            lifetime: None,
            egress: None,
            policy: None,
            tenant: None,
            adopt: None,
            first_generation: 0,
            age: None,
        }
    }
}

/// Where a kernel is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// The first process is starting.
    Starting,
    /// A new process replaces the last one (asked for, or after a limit ended it).
    Restarting,
    Ready,
    Dead(String),
    Terminated,
    /// Saved to disk, no process: restored by whatever next needs it ready.
    Hibernated,
}

struct Instance {
    generation: u64,
    handle: Arc<dyn SandboxHandle>,
    exit: watch::Receiver<Option<ExitReport>>,
    expected_exit: Arc<AtomicBool>,
    channels: Channels,
    heartbeat: JoinHandle<()>,
    /// The key the process signs with (a restore gives the saved process the same).
    key: String,
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

/// A running (or dead) kernel and everything the gateway knows about it.
pub struct Kernel {
    pub id: crate::ids::KernelId,
    pub spec: Arc<KernelSpec>,
    /// The name of the policy the kernel runs under.
    pub policy: String,
    /// The tenant that owns the kernel (unset: the admin's). Set once, before the kernel is
    /// registered: at launch, or when a pooled kernel is handed out.
    owner: std::sync::OnceLock<String>,
    router: Arc<Router>,
    sandbox: Arc<dyn Sandbox>,
    dirs: KernelDirs,
    env: BTreeMap<String, String>,
    options: KernelOptions,
    readiness: watch::Sender<Readiness>,
    instance: parking_lot::Mutex<Option<Arc<Instance>>>,
    generation: AtomicU64,
    /// Serialises restart and shutdown.
    ops: tokio::sync::Mutex<()>,
    /// The gateway's own session id in the headers of messages it originates.
    session: String,
    /// Why the gateway last restarted the kernel on its own (a timeout the kernel ignored).
    last_restart_reason: parking_lot::Mutex<Option<String>>,
    started: std::time::Instant,
    /// The egress proxy's listener of the current generation.
    egress: parking_lot::Mutex<Option<crate::egress::Listener>>,
    /// A stored session holds it (see [`Kernel::outlives_gateway`]).
    adoptable: AtomicBool,
    /// The kernel itself, for the restore that waiting for readiness may start.
    me: std::sync::Weak<Kernel>,
    /// The key of the hibernated process, while the kernel is hibernated.
    saved_key: parking_lot::Mutex<Option<String>>,
    /// Restored from hibernation since the last execution's result took the news.
    restored: AtomicBool,
    /// Its sandbox refused to hibernate (a backend or a VM that cannot): not asked again.
    cannot_hibernate: AtomicBool,
    /// Bytes its saved sandbox takes on disk, while hibernated (0 otherwise).
    hibernated_bytes: AtomicU64,
    /// Its tenant's hibernated-storage quota refused its save (said once until it fits).
    quota_refused: AtomicBool,
    /// The restores that failed in a row with what was saved kept.
    deferrals: parking_lot::Mutex<Deferrals>,
    /// Held while a client's request is checked against readiness and registered, and
    /// while a save marks the kernel hibernated: a request is either seen by the save (which
    /// then does not happen) or sees the kernel hibernated (and restores it).
    send_gate: parking_lot::Mutex<()>,
}

/// A duration as people write it: `300 s`, `10 min`, `2 h`.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 3600 && secs.is_multiple_of(3600) {
        format!("{} h", secs / 3600)
    } else if secs >= 60 && secs.is_multiple_of(60) {
        format!("{} min", secs / 60)
    } else if secs >= 1 {
        format!("{secs} s")
    } else {
        format!("{} ms", d.as_millis())
    }
}

impl Kernel {
    /// Launches the first generation and returns once the process exists; readiness follows
    /// in the background.
    pub async fn start(
        id: crate::ids::KernelId,
        spec: Arc<KernelSpec>,
        policy: String,
        sandbox: Arc<dyn Sandbox>,
        dirs: KernelDirs,
        client_env: BTreeMap<String, String>,
        options: KernelOptions,
    ) -> Result<Arc<Kernel>, KernelError> {
        let mut env = kernel_env(&spec, id.as_str(), &dirs.work, &client_env);
        if options.egress.is_some() && sandbox.backend().bridges_egress() {
            for (k, v) in crate::egress::kernel_env(&spec.dir, &dirs.work) {
                // A client's own choice (PIP_INDEX_URL, say) cannot open anything: the proxy
                // decides. The defaults only fill what the client left unset.
                env.entry(k).or_insert(v);
            }
        }
        if sandbox.backend().private_tmp() {
            // Configuration and caches into the sandbox's private /tmp: the workspace (the
            // kernel's HOME) then holds only what the user's code wrote.
            for (name, dir) in SANDBOX_TMP_DIRS {
                env.entry((*name).to_owned())
                    .or_insert_with(|| (*dir).to_owned());
            }
        }
        if let Some(limit) = options.output_limit {
            // The kernel launcher stops sending a cell's output a little past this, so a
            // print loop cannot fill the kernel's memory with output the router would drop.
            // Set after the client's variables: a client cannot lift it.
            env.insert(OUTPUT_LIMIT_ENV.to_owned(), limit.to_string());
        }
        // The policy's name, for a kernel's own refusals (the R kernel's `install.packages`
        // names it, as the gateway's denials do). Set after the client's variables.
        env.insert(POLICY_ENV.to_owned(), policy.clone());
        let (readiness, _) = watch::channel(Readiness::Starting);
        let first_generation = options.first_generation;
        let started = options
            .age
            .and_then(|age| std::time::Instant::now().checked_sub(age))
            .unwrap_or_else(std::time::Instant::now);
        let kernel = Arc::new_cyclic(|me| Kernel {
            me: me.clone(),
            saved_key: parking_lot::Mutex::new(None),
            restored: AtomicBool::new(false),
            cannot_hibernate: AtomicBool::new(false),
            hibernated_bytes: AtomicU64::new(0),
            deferrals: parking_lot::Mutex::new(Deferrals::default()),
            quota_refused: AtomicBool::new(false),
            send_gate: parking_lot::Mutex::new(()),
            router: Arc::new(
                Router::new(id.as_str())
                    .with_output_limit(options.output_limit)
                    .with_metrics(crate::telemetry::metrics::metrics().executions_of(&policy)),
            ),
            session: uuid::Uuid::new_v4().to_string(),
            id,
            spec,
            policy,
            owner: std::sync::OnceLock::new(),
            sandbox,
            dirs,
            env,
            options,
            readiness,
            instance: parking_lot::Mutex::new(None),
            generation: AtomicU64::new(first_generation),
            ops: tokio::sync::Mutex::new(()),
            last_restart_reason: parking_lot::Mutex::new(None),
            started,
            egress: parking_lot::Mutex::new(None),
            adoptable: AtomicBool::new(false),
        });
        kernel.spawn_watchdog();
        let launched = kernel.launch_generation().await?;
        let booting = kernel.clone();
        // The boot's log lines belong to the request that started the kernel (its
        // request_id), not to whatever the runtime was doing.
        tokio::spawn(
            async move { booting.finish_boot(launched).await }.instrument(tracing::Span::current()),
        );
        Ok(kernel)
    }

    async fn launch_generation(&self) -> Result<(u64, Launched), KernelError> {
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        // Only the first generation takes a sandbox over; a restart launches a new one.
        let adopt = self
            .options
            .adopt
            .clone()
            .filter(|_| generation == self.options.first_generation + 1);
        self.launch_as(generation, adopt).await
    }

    /// Launches `generation`, or adopts the sandbox `adopt` names (signing with its key).
    async fn launch_as(
        &self,
        generation: u64,
        adopt: Option<(KernelRecord, String)>,
    ) -> Result<(u64, Launched), KernelError> {
        let (runtime_dir, connection_file, connection) = write_connection_file(
            &self.dirs,
            generation,
            &self.spec.name,
            adopt.as_ref().map(|(_, key)| key.as_str()),
        )?;
        let mut egress_socket = None;
        let proxy = (self.options.egress.as_ref())
            .zip(self.options.policy.as_ref())
            .filter(|_| self.sandbox.backend().bridges_egress());
        if let Some((egress, policy)) = proxy {
            // A sandbox that may outlive this gateway reaches its proxy where the next
            // gateway listens too.
            let dir = self
                .sandbox
                .egress_dir(self.id.as_str())
                .unwrap_or_else(|| runtime_dir.clone());
            let listener = egress
                .listen(&dir, self.id.as_str(), policy.clone(), self.router.clone())
                .map_err(|err| KernelError::Io {
                    what: "open the egress proxy socket".to_owned(),
                    source: std::io::Error::other(err),
                })?;
            egress_socket = Some(listener.path.clone());
            *self.egress.lock() = Some(listener);
        }
        let spec = LaunchSpec {
            kernel_id: self.id.to_string(),
            argv: self.spec.command(&connection_file)?,
            env: self.env.clone(),
            runtime_dir,
            connection_file,
            connection,
            workspace: self.dirs.work.clone(),
            log_file: self.dirs.root.join("kernel.log"),
            limits: self.options.limits.clone(),
            egress_socket,
            allow_emulation: self
                .options
                .policy
                .as_ref()
                .is_some_and(|policy| policy.allow_emulation),
            zygote: self
                .options
                .policy
                .as_ref()
                .is_none_or(|policy| policy.zygote),
            labels: KernelLabels {
                policy: self.policy.clone(),
                tenant: self.options.tenant.clone(),
                kernelspec: self.spec.name.clone(),
            },
            adopt: adopt.map(|(record, _)| record),
            backend_settings: self
                .options
                .policy
                .as_ref()
                .map(|policy| policy.backend_settings())
                .unwrap_or_default(),
            generation,
        };
        let launched = match self.sandbox.launch(&spec).await {
            Ok(launched) => launched,
            Err(error) => {
                // Nothing runs from it: a kernel whose launches keep failing (a hibernated
                // one's restores, tried at each request) must not pile them up.
                if let Err(err) = std::fs::remove_dir_all(&spec.runtime_dir) {
                    tracing::debug!(dir = %spec.runtime_dir.display(), %err, "a failed launch's runtime directory stays");
                }
                return Err(error.into());
            }
        };
        tracing::info!(kernel_id = %self.id, generation, backend = self.sandbox.backend().as_str(), pid = ?launched.handle.pid(), "kernel process launched");
        Ok((generation, launched))
    }

    /// Connects to a launched generation, watches its exit and waits until it is ready.
    async fn finish_boot(self: Arc<Self>, (generation, launched): (u64, Launched)) {
        let expected_exit = Arc::new(AtomicBool::new(false));
        self.spawn_exit_watch(generation, launched.exit.clone(), expected_exit.clone());
        let start_timeout = self.start_timeout();
        let result = tokio::time::timeout(start_timeout, async {
            let mut exit = launched.exit.clone();
            let identity = format!("cellgate-{}", uuid::Uuid::new_v4().simple());
            let channels = tokio::select! {
                channels = Channels::connect(&launched.connection, &identity, self.router.clone()) => channels?,
                _ = exit.wait_for(Option::is_some) => return Err(KernelError::DiedDuringStart),
            };
            let heartbeat = spawn_heartbeat(channels.hb_endpoint.clone(), self.id.to_string());
            let instance = Arc::new(Instance {
                generation,
                handle: launched.handle.clone(),
                exit: launched.exit.clone(),
                expected_exit: expected_exit.clone(),
                channels,
                heartbeat,
                key: launched.connection.key.clone(),
            });
            *self.instance.lock() = Some(instance.clone());
            self.router.set_sandbox(Some(launched.handle.clone()));
            self.nudge_until_ready(&instance).await
        })
        .await;
        match result {
            Ok(Ok(())) => {
                tracing::info!(kernel_id = %self.id, generation, "kernel ready");
                // Its idle clock starts now, not when its start was asked: a start that took
                // longer than `hibernate_after` (an emulated VM on a busy host) must not be
                // saved to disk the moment it is ready.
                self.router.touch();
                self.readiness.send_replace(Readiness::Ready);
            }
            Ok(Err(KernelError::DiedDuringStart)) => {
                // The exit watch reports the death with its reason.
            }
            Ok(Err(err)) => self.fail_start(generation, &launched, err.to_string()),
            Err(_) => self.fail_start(
                generation,
                &launched,
                format!(
                    "kernel did not become ready within {} s",
                    start_timeout.as_secs()
                ),
            ),
        }
    }

    fn fail_start(&self, generation: u64, launched: &Launched, reason: String) {
        tracing::error!(kernel_id = %self.id, generation, %reason, "kernel start failed");
        let _ = launched.handle.kill();
        self.mark_dead(reason);
    }

    /// Sends `kernel_info_request`s every half second until one is answered and the iopub
    /// subscription has delivered the status it caused.
    async fn nudge_until_ready(&self, instance: &Instance) -> Result<(), KernelError> {
        let subscribed = || self.router.activity().execution_state != ExecutionState::Starting;
        loop {
            let request = Message::new(
                Channel::Shell,
                "kernel_info_request",
                &self.session,
                None,
                &json!({}),
            );
            let mut reply = Some(self.router.register_internal(request.msg_id()));
            instance.channels.send(&request).await?;
            let deadline = tokio::time::sleep(Duration::from_millis(500));
            tokio::pin!(deadline);
            let mut replied = false;
            loop {
                // Made before the check, so a status arriving between the check and the wait
                // still wakes it.
                let status = self.router.left_starting();
                if replied && subscribed() {
                    return Ok(());
                }
                tokio::select! {
                    answer = async { reply.as_mut()?.await.ok() }, if reply.is_some() => {
                        // Answered, or dropped with a generation that is gone (the next
                        // nudge or the start timeout decides then).
                        replied = answer.is_some();
                        reply = None;
                    }
                    _ = status => {}
                    _ = &mut deadline => break,
                }
            }
        }
    }

    /// Enforces the execution timeout: interrupt a cell that runs too long, and restart the
    /// kernel if the cell is still running `interrupt_grace` later.
    fn spawn_watchdog(self: &Arc<Self>) {
        let Some(limit) = self.options.execution_timeout else {
            return;
        };
        let grace = self.options.interrupt_grace;
        let kernel = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let Some(kernel) = kernel.upgrade() else {
                    return;
                };
                if kernel.readiness() == Readiness::Terminated {
                    return;
                }
                let Some((msg_id, elapsed)) = kernel.router.running() else {
                    continue;
                };
                if elapsed < limit {
                    continue;
                }
                match kernel.router.timed_out_since(&msg_id) {
                    None => {
                        let evalue = format!(
                            "the cell ran longer than the {} execution timeout of policy {} and was interrupted",
                            human(limit),
                            kernel.policy
                        );
                        tracing::warn!(kernel_id = %kernel.id, %msg_id, "execution timeout: interrupting");
                        kernel.router.mark_timed_out(&msg_id, evalue);
                        if let Err(err) = kernel.interrupt().await {
                            tracing::warn!(kernel_id = %kernel.id, %err, "interrupt after timeout failed");
                        }
                    }
                    Some(since) if since.elapsed() >= grace => {
                        let evalue = format!(
                            "the cell ran longer than the {} execution timeout of policy {}, ignored the interrupt for {}, and the kernel was restarted: its variables are lost",
                            human(limit),
                            kernel.policy,
                            human(grace)
                        );
                        tracing::warn!(kernel_id = %kernel.id, %msg_id, "cell ignored the interrupt: restarting the kernel");
                        *kernel.last_restart_reason.lock() = Some(evalue.clone());
                        let restarted = kernel.restart().await;
                        kernel.router.fail_timed_out(&msg_id, &evalue);
                        if let Err(err) = restarted {
                            tracing::error!(kernel_id = %kernel.id, %err, "restart after timeout failed");
                        }
                    }
                    Some(_) => {}
                }
            }
        });
    }

    fn spawn_exit_watch(
        self: &Arc<Self>,
        generation: u64,
        mut exit: watch::Receiver<Option<ExitReport>>,
        expected: Arc<AtomicBool>,
    ) {
        let kernel = Arc::downgrade(self);
        tokio::spawn(async move {
            let report = match exit.wait_for(Option::is_some).await {
                Ok(report) => report.clone().unwrap_or(ExitReport {
                    code: None,
                    signal: None,
                    reason: None,
                }),
                Err(_) => return,
            };
            let Some(kernel) = kernel.upgrade() else {
                return;
            };
            if expected.load(Ordering::SeqCst) {
                tracing::info!(kernel_id = %kernel.id, generation, "kernel process exited as asked");
                return;
            }
            if let Some(limit) = limit_exit(report.cause()) {
                let what = limit.what;
                // A limit ended the kernel: like Jupyter's auto-restart, but the cell that
                // caused it is told why, and the state generation moves on.
                let evalue = format!(
                    "{}; the kernel was restarted and its variables are lost",
                    report.describe()
                );
                tracing::warn!(kernel_id = %kernel.id, generation, %evalue, "kernel {what}: restarting");
                // Hold client messages until the new process is ready, and tell clients the
                // way jupyter_server does for an automatic restart.
                kernel.readiness.send_replace(Readiness::Restarting);
                kernel
                    .router
                    .set_execution_state(ExecutionState::Restarting);
                kernel.router.broadcast(Message::new(
                    Channel::Iopub,
                    "status",
                    &kernel.session,
                    None,
                    &json!({"execution_state": ExecutionState::Restarting}),
                ));
                *kernel.last_restart_reason.lock() = Some(evalue.clone());
                kernel
                    .router
                    .fail_pending_executions(limit.ename, &evalue, limit.outcome);
                if let Err(err) = kernel.restart().await {
                    tracing::error!(kernel_id = %kernel.id, %err, "restart after the kernel {what} failed");
                }
                return;
            }
            let mut reason = report.describe();
            // The log tail explains a kernel that never started (a broken environment). Once
            // the kernel ran user code its log is the user's text, so it is not repeated as
            // the gateway's explanation.
            if matches!(
                kernel.readiness(),
                Readiness::Starting | Readiness::Restarting
            ) {
                if let Some(tail) = kernel.log_tail(3) {
                    reason.push_str(": ");
                    reason.push_str(&tail);
                }
            }
            tracing::error!(kernel_id = %kernel.id, generation, %reason, "kernel died");
            kernel.router.fail_pending_executions(
                "KernelDiedError",
                &format!("the kernel process ended: {reason}"),
                Outcome::SandboxLost,
            );
            kernel.mark_dead(reason);
        });
    }

    fn mark_dead(&self, reason: String) {
        if matches!(*self.readiness.borrow(), Readiness::Terminated) {
            return;
        }
        self.readiness.send_replace(Readiness::Dead(reason));
        self.router.clear_internal();
        self.router.set_execution_state(ExecutionState::Dead);
        // Clients learn it the way jupyter_server tells them.
        self.router.broadcast(Message::new(
            Channel::Iopub,
            "status",
            &self.session,
            None,
            &json!({"execution_state": ExecutionState::Dead}),
        ));
    }

    fn log_tail(&self, lines: usize) -> Option<String> {
        let text = std::fs::read_to_string(self.dirs.root.join("kernel.log")).ok()?;
        let tail: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .rev()
            .take(lines)
            .collect();
        if tail.is_empty() {
            return None;
        }
        let joined = tail.into_iter().rev().collect::<Vec<_>>().join(" | ");
        Some(joined.chars().take(500).collect())
    }

    pub fn readiness(&self) -> Readiness {
        self.readiness.borrow().clone()
    }

    /// Every change of the kernel's readiness from now on (the current value counts as seen).
    pub fn watch_readiness(&self) -> watch::Receiver<Readiness> {
        self.readiness.subscribe()
    }

    /// Waits until the kernel is ready to take messages (or fails).
    async fn ready_instance(&self) -> Result<Arc<Instance>, KernelError> {
        let mut watch = self.readiness.subscribe();
        let wait = async {
            loop {
                let state = watch.borrow_and_update().clone();
                match state {
                    Readiness::Ready => {
                        if let Some(instance) = self.instance.lock().clone() {
                            return Ok(instance);
                        }
                    }
                    Readiness::Dead(reason) => return Err(KernelError::Dead(reason)),
                    Readiness::Terminated => return Err(KernelError::Terminated),
                    Readiness::Starting | Readiness::Restarting => {}
                    Readiness::Hibernated => {
                        if let Some(kernel) = self.me.upgrade() {
                            kernel.wake().await?;
                        }
                    }
                }
                if watch.changed().await.is_err() {
                    return Err(KernelError::Terminated);
                }
            }
        };
        tokio::time::timeout(self.start_timeout(), wait)
            .await
            .map_err(|_| KernelError::NotReady)?
    }

    /// How long a start may take: the gateway's start timeout, times what the sandbox needs
    /// (see [`Sandbox::start_time_factor`]).
    fn start_timeout(&self) -> Duration {
        self.options.start_timeout * self.sandbox.start_time_factor()
    }

    /// Waits for readiness, for clients that attach while the kernel starts.
    pub async fn wait_ready(&self) -> Result<(), KernelError> {
        self.ready_instance().await.map(|_| ())
    }

    /// Bytes its saved sandbox takes on disk while it is hibernated; 0 otherwise.
    pub fn hibernated_bytes(&self) -> u64 {
        if self.is_hibernated() {
            self.hibernated_bytes.load(Ordering::SeqCst)
        } else {
            0
        }
    }

    /// Notes whether its tenant's quota refuses its hibernation now; true when that is
    /// news (refused, and not refused at the last look).
    pub fn quota_refuses_hibernation(&self, refused: bool) -> bool {
        self.quota_refused.swap(refused, Ordering::SeqCst) != refused && refused
    }

    /// Whether the kernel is saved to disk, without a process.
    pub fn is_hibernated(&self) -> bool {
        self.readiness() == Readiness::Hibernated
    }

    /// Notes that the kernel's first process is a hibernated one restored (adopted from the
    /// gateway before this one): the next result says `restored`.
    pub(crate) fn mark_restored(&self) {
        self.restored.store(true, Ordering::SeqCst);
    }

    /// Whether the kernel was restored from hibernation since the last call (an
    /// execution's result says so once).
    pub fn take_restored(&self) -> bool {
        self.restored.swap(false, Ordering::SeqCst)
    }

    /// Saves the kernel's sandbox to disk and ends it (see the module's doc): only a ready
    /// kernel with no cell running and no request since `idle_since` (its last activity when
    /// it was found idle: any message after it, an execute or a completion, may await a
    /// reply the saved VM would never send). Bytes the sandbox takes on disk.
    pub async fn hibernate(
        self: &Arc<Self>,
        idle_since: OffsetDateTime,
    ) -> Result<u64, KernelError> {
        let _ops = self.ops.lock().await;
        if self.readiness() != Readiness::Ready {
            return Err(KernelError::NotHibernatable("it is not ready".to_owned()));
        }
        if self.router.activity().execution_state == ExecutionState::Busy
            || self.router.running().is_some()
            || self.last_activity() != idle_since
        {
            return Err(KernelError::NotHibernatable("it is in use".to_owned()));
        }
        let Some(instance) = self.instance.lock().clone() else {
            return Err(KernelError::NotHibernatable("it has no process".to_owned()));
        };
        let started_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .saturating_sub(self.started.elapsed())
            .as_millis();
        let about = crate::sandbox::Hibernation {
            kernel_id: self.id.to_string(),
            key: instance.key.clone(),
            generation: instance.generation,
            started_ms: u64::try_from(started_ms).unwrap_or(u64::MAX),
        };
        // The process's end is the save's: not a death to report. Hibernated from now on:
        // whatever needs the kernel meanwhile waits for the save, then restores it.
        instance.expected_exit.store(true, Ordering::SeqCst);
        let running = {
            let _gate = self.send_gate.lock();
            self.readiness.send_replace(Readiness::Hibernated);
            self.router.running().is_some() || self.last_activity() != idle_since
        };
        if running {
            // A message came in just before: not now.
            instance.expected_exit.store(false, Ordering::SeqCst);
            self.readiness.send_replace(Readiness::Ready);
            return Err(KernelError::NotHibernatable("a cell is running".to_owned()));
        }
        let saving = std::time::Instant::now();
        let saved = instance.handle.hibernate(&about).await;
        match &saved {
            // Not now (a full disk): tried again at a later pass.
            Err(crate::sandbox::SandboxError::NotNow(_)) => {}
            // Refused, the sandbox untouched: this one never will.
            Err(_) if instance.handle.alive() => {
                self.cannot_hibernate.store(true, Ordering::SeqCst);
            }
            _ => {}
        }
        crate::telemetry::metrics::metrics()
            .hibernation_saved(saving.elapsed(), saved.as_ref().ok().map(|s| s.bytes));
        match saved {
            Ok(saved) => {
                *self.saved_key.lock() = Some(instance.key.clone());
                self.hibernated_bytes.store(saved.bytes, Ordering::SeqCst);
                self.instance.lock().take();
                self.router.clear_internal();
                tracing::info!(kernel_id = %self.id, generation = instance.generation, bytes = saved.bytes, "kernel hibernated");
                Ok(saved.bytes)
            }
            Err(err) => {
                instance.expected_exit.store(false, Ordering::SeqCst);
                self.readiness.send_replace(Readiness::Ready);
                if !instance.handle.alive() {
                    // Its end went by while it was expected: said here instead.
                    let reason = format!("sandbox_lost: saving the kernel to disk failed: {err}");
                    tracing::error!(kernel_id = %self.id, %reason, "hibernation failed");
                    self.router.fail_pending_executions(
                        "KernelDiedError",
                        &reason,
                        super::execution::Outcome::SandboxLost,
                    );
                    self.mark_dead(reason);
                }
                Err(err.into())
            }
        }
    }

    /// Restores a hibernated kernel (see the module's doc); nothing to do for one that is
    /// not. A restore that fails starts a fresh process instead (the generation moves on),
    /// unless what was saved is kept: then the kernel stays hibernated and this answers
    /// [`KernelError::RestoreDeferred`].
    pub async fn wake(self: &Arc<Self>) -> Result<(), KernelError> {
        if !self.is_hibernated() {
            return Ok(());
        }
        let kernel = self.clone();
        tokio::spawn(async move { kernel.restore().await })
            .await
            .map_err(|error| KernelError::Io {
                what: "restoring the hibernated kernel".to_owned(),
                source: std::io::Error::other(error),
            })?
    }

    async fn restore(self: Arc<Self>) -> Result<(), KernelError> {
        let asked = std::time::Instant::now();
        let _ops = self.ops.lock().await;
        if !self.is_hibernated() {
            return Ok(());
        }
        // A restore that failed while this one waited for it: the same answer.
        if let Some(why) = self.deferrals.lock().since(asked) {
            return Err(KernelError::RestoreDeferred(why));
        }
        let started = std::time::Instant::now();
        let generation = self.generation();
        let key = self.saved_key.lock().clone().unwrap_or_default();
        let record = KernelRecord {
            kernel_id: self.id.to_string(),
            owner: String::new(),
            incarnation: String::new(),
            sandbox: self.sandbox.backend().as_str().to_owned(),
            namespace: String::new(),
            kernelspec: self.spec.name.clone(),
            policy: self.policy.clone(),
            tenant: self.options.tenant.clone(),
        };
        let metrics = crate::telemetry::metrics::metrics();
        let failure = match self.launch_as(generation, Some((record, key))).await {
            Ok(launched) => {
                self.clone().finish_boot(launched).await;
                match self.readiness() {
                    Readiness::Ready => None,
                    Readiness::Dead(reason) => Some(reason),
                    other => Some(format!("it ended {other:?}")),
                }
            }
            Err(err) if self.save_is_kept() => {
                let why = err.to_string();
                match self.deferrals.lock().note(&why) {
                    None => {
                        tracing::warn!(kernel_id = %self.id, error = %why, "restore failed; what was saved is kept, the next request tries again");
                        metrics.hibernation_restored(started.elapsed(), RestoreOutcome::deferred);
                        return Err(KernelError::RestoreDeferred(why));
                    }
                    Some(given_up) => Some(given_up),
                }
            }
            Err(err) => Some(err.to_string()),
        };
        *self.deferrals.lock() = Deferrals::default();
        self.hibernated_bytes.store(0, Ordering::SeqCst);
        let Some(failure) = failure else {
            self.saved_key.lock().take();
            self.restored.store(true, Ordering::SeqCst);
            // The user is back: the idle clock starts again.
            self.router.touch();
            metrics.hibernation_restored(started.elapsed(), RestoreOutcome::ok);
            tracing::info!(kernel_id = %self.id, generation, seconds = started.elapsed().as_secs_f64(), "kernel restored from hibernation");
            return Ok(());
        };
        metrics.hibernation_restored(started.elapsed(), RestoreOutcome::failed);
        self.saved_key.lock().take();
        self.sandbox.forget(self.id.as_str());
        if let Some(instance) = self.instance.lock().take() {
            instance.expected_exit.store(true, Ordering::SeqCst);
            let _ = instance.handle.kill();
        }
        let reason = format!(
            "sandbox_lost: the hibernated kernel could not be restored ({failure}); a new \
             kernel was started and its variables and workspace files are lost"
        );
        tracing::warn!(kernel_id = %self.id, %reason, "restore failed");
        *self.last_restart_reason.lock() = Some(reason);
        self.relaunch().await
    }

    /// Whether the backend still holds this kernel's saved sandbox (after a restore that
    /// failed: it keeps it only when another try can work).
    fn save_is_kept(&self) -> bool {
        self.sandbox
            .survivor(self.id.as_str())
            .is_some_and(|survivor| survivor.hibernated)
    }

    /// Starts the kernel's next generation in place of the last (restarting, then ready
    /// or dead): what a restart and a failed restore share.
    async fn relaunch(self: &Arc<Self>) -> Result<(), KernelError> {
        self.readiness.send_replace(Readiness::Restarting);
        self.router.set_execution_state(ExecutionState::Starting);
        let launched = match self.launch_generation().await {
            Ok(launched) => launched,
            Err(err) => {
                self.mark_dead(err.to_string());
                return Err(err);
            }
        };
        self.clone().finish_boot(launched).await;
        match self.readiness() {
            Readiness::Ready => Ok(()),
            Readiness::Dead(reason) => Err(KernelError::Dead(reason)),
            _ => Err(KernelError::NotReady),
        }
    }

    /// Sends a client's message to the kernel, remembering who asked.
    pub async fn send(
        &self,
        client: ClientId,
        session: &str,
        mut message: Message,
    ) -> Result<(), KernelError> {
        if message.msg_type() == "shutdown_request" && message.channel == Channel::Shell {
            // Protocol 5.4 moved shutdown to control; old clients still use shell.
            message.channel = Channel::Control;
        }
        let instance = loop {
            let instance = self.ready_instance().await?;
            let _gate = self.send_gate.lock();
            // A save may have begun since: then wait for it, and restore.
            if self.readiness() == Readiness::Ready {
                self.router.register_request(client, session, &message);
                break instance;
            }
        };
        instance.channels.send(&message).await
    }

    /// Sets environment variables in the running kernel (a silent execute that leaves no
    /// history and no execution count): how a pooled kernel gets a client's `KERNEL_*`
    /// variables after it started.
    pub async fn set_env(&self, vars: &BTreeMap<String, String>) -> Result<(), KernelError> {
        let instance = self.ready_instance().await?;
        let json = serde_json::to_string(vars).unwrap_or_else(|_| "{}".to_owned());
        let literal = super::python::str_literal(&json);
        let code = format!(
            "import json as _cg_json, os as _cg_os\n_cg_os.environ.update(_cg_json.loads({literal}))\ndel _cg_json, _cg_os"
        );
        let content = json!({"code": code, "silent": true, "store_history": false, "user_expressions": {}, "allow_stdin": false, "stop_on_error": false});
        let reply = self
            .internal_request(
                &instance,
                Channel::Shell,
                "execute_request",
                content,
                Duration::from_secs(10),
            )
            .await?;
        match reply.content_json() {
            Some(c) if c["status"] == "ok" => Ok(()),
            other => Err(KernelError::NoReply(format!(
                "execute_request setting the environment ({:?})",
                other.map(|c| c["status"].clone())
            ))),
        }
    }

    /// Counts as activity now (a kernel leaving the pool starts its idle clock).
    pub fn touch(&self) {
        self.router.touch();
    }

    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    async fn internal_request(
        &self,
        instance: &Instance,
        channel: Channel,
        msg_type: &str,
        content: Value,
        timeout: Duration,
    ) -> Result<Arc<Message>, KernelError> {
        let request = Message::new(channel, msg_type, &self.session, None, &content);
        let reply = self.router.register_internal(request.msg_id());
        instance.channels.send(&request).await?;
        tokio::time::timeout(timeout, reply)
            .await
            .map_err(|_| KernelError::NoReply(msg_type.to_owned()))?
            .map_err(|_| KernelError::NoReply(msg_type.to_owned()))
    }

    /// Interrupts the running execution, the way the kernelspec asks.
    pub async fn interrupt(&self) -> Result<(), KernelError> {
        let instance = self.instance.lock().clone().ok_or(KernelError::NotReady)?;
        match self.spec.interrupt_mode {
            InterruptMode::Signal => Ok(instance.handle.signal(libc::SIGINT)?),
            InterruptMode::Message => self
                .internal_request(
                    &instance,
                    Channel::Control,
                    "interrupt_request",
                    json!({}),
                    Duration::from_secs(5),
                )
                .await
                .map(|_| ()),
        }
    }

    /// Stops the current generation: `shutdown_request` on control, a grace period, then kill.
    async fn stop_instance(&self, restart: bool) {
        let Some(instance) = self.instance.lock().take() else {
            return;
        };
        instance.expected_exit.store(true, Ordering::SeqCst);
        let mut exit = instance.exit.clone();
        if exit.borrow().is_none() {
            let graceful = self.internal_request(
                &instance,
                Channel::Control,
                "shutdown_request",
                json!({"restart": restart}),
                self.options.shutdown_grace,
            );
            let _ = graceful.await;
            let exited =
                tokio::time::timeout(self.options.shutdown_grace, exit.wait_for(Option::is_some))
                    .await
                    .is_ok_and(|r| r.is_ok());
            if !exited {
                tracing::warn!(kernel_id = %self.id, generation = instance.generation, "kernel ignored shutdown_request; killing it");
                let _ = instance.handle.kill();
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), exit.wait_for(Option::is_some))
                        .await;
            }
        }
        self.router.clear_internal();
    }

    /// Replaces the kernel process, keeping the id, the clients and their buffers.
    /// Returns when the new process is ready.
    pub async fn restart(self: &Arc<Self>) -> Result<(), KernelError> {
        let _ops = self.ops.lock().await;
        if self.readiness() == Readiness::Terminated {
            return Err(KernelError::Terminated);
        }
        if self.is_hibernated() {
            // A restart asked of a hibernated kernel starts afresh: what was saved goes.
            self.saved_key.lock().take();
            self.sandbox.forget(self.id.as_str());
        }
        self.stop_instance(true).await;
        self.router.clear_running();
        self.relaunch().await
    }

    /// Shuts the kernel down for good: its clients are disconnected and its directories removed.
    pub async fn shutdown(&self) {
        let _ops = self.ops.lock().await;
        if self.readiness() == Readiness::Terminated {
            return;
        }
        self.stop_instance(false).await;
        self.readiness.send_replace(Readiness::Terminated);
        self.router.close_all();
        self.dirs.remove();
        // A hibernated kernel's saved sandbox goes with it.
        self.saved_key.lock().take();
        self.sandbox.forget(self.id.as_str());
        tracing::info!(kernel_id = %self.id, "kernel shut down");
    }

    /// Lets the kernel go without ending it (a replica handing its kernel pods over as it
    /// shuts down): the sandbox's link is closed, its process left running for another
    /// gateway to take over, and this gateway forgets it.
    pub fn detach(&self) {
        if let Some(instance) = self.instance.lock().as_ref() {
            instance.expected_exit.store(true, Ordering::SeqCst);
            instance.handle.detach();
        }
        self.readiness.send_replace(Readiness::Terminated);
        self.router.close_all();
    }

    /// Kills the process at once (gateway shutdown after the grace period).
    pub fn kill_now(&self) {
        if let Some(instance) = self.instance.lock().as_ref() {
            instance.expected_exit.store(true, Ordering::SeqCst);
            let _ = instance.handle.kill();
        }
    }

    pub fn age(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn policy_idle_timeout(&self) -> Option<Duration> {
        self.options.idle_timeout
    }

    /// The policy's `hibernate_after`, unless this kernel's sandbox refused to hibernate.
    pub fn policy_hibernate_after(&self) -> Option<Duration> {
        if self.cannot_hibernate.load(Ordering::SeqCst) {
            return None;
        }
        self.options.policy.as_ref()?.limits.hibernate_after
    }

    pub fn policy_lifetime(&self) -> Option<Duration> {
        self.options.lifetime
    }

    /// How long a cell may ignore a timeout's interrupt before the kernel is restarted.
    pub fn interrupt_grace(&self) -> Duration {
        self.options.interrupt_grace
    }

    /// The workspace of the running process as the gateway reaches it (the namespaces
    /// backend's workspace exists only inside the sandbox), or `None` without a process:
    /// a trusted directory and a path below it to resolve without following links
    /// (see [`crate::sandbox::SandboxHandle::workspace_root`]).
    pub fn workspace(&self) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
        let instance = self.instance.lock().clone()?;
        instance.handle.workspace_root(&self.dirs.work)
    }

    /// The workspace when the sandbox serves it itself (a microVM's agent), while the
    /// current process runs.
    pub fn guest_files(&self) -> Option<std::sync::Arc<dyn crate::workspace::GuestFiles>> {
        let instance = self.instance.lock().clone()?;
        instance.handle.guest_files()
    }

    /// The sandbox backend the kernel runs in.
    pub fn backend(&self) -> crate::sandbox::Backend {
        self.sandbox.backend()
    }

    /// Whether the kernel's sandbox outlives this gateway, for the next one to adopt (see
    /// `KernelManager::detach_survivors`): a backend that keeps its sandboxes, and a kernel
    /// a stored session will ask for again (a kernel no session holds is never adopted).
    pub fn outlives_gateway(&self) -> bool {
        (self.sandbox.kernels_outlive_gateway() || self.is_hibernated())
            && self.adoptable.load(Ordering::SeqCst)
    }

    /// A stored session holds this kernel: a later gateway may adopt it.
    pub fn mark_adoptable(&self) {
        self.adoptable.store(true, Ordering::SeqCst);
    }

    /// Whether the kernel's owner is recorded in the shared registry (`ownership`): other
    /// gateways may route to it or take it over, and it outlives this gateway's process.
    pub fn shares_ownership(&self) -> bool {
        self.sandbox.shares_ownership()
    }

    /// Whether the current process still exists (see [`crate::sandbox::SandboxHandle::alive`]).
    pub fn process_alive(&self) -> bool {
        self.instance
            .lock()
            .as_ref()
            .is_some_and(|instance| instance.handle.alive())
    }

    /// CPU time and memory of the running process, where the backend measures them.
    pub fn usage(&self) -> Option<crate::sandbox::ResourceUsage> {
        let instance = self.instance.lock().clone()?;
        Some(instance.handle.usage())
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    pub fn pid(&self) -> Option<u32> {
        self.instance.lock().as_ref().and_then(|i| i.handle.pid())
    }

    pub fn last_activity(&self) -> OffsetDateTime {
        self.router.activity().last_activity
    }

    pub fn connections(&self) -> usize {
        self.router.connections()
    }

    /// The tenant that owns this kernel; `None` for the admin's.
    pub fn owner(&self) -> Option<&str> {
        self.owner.get().map(String::as_str)
    }

    /// Gives the kernel to `tenant`; a kernel that already has an owner keeps it.
    pub(crate) fn set_owner(&self, tenant: &str) -> bool {
        self.owner.set(tenant.to_owned()).is_ok()
    }

    /// The kernel's `execution_state` as the kernel model gives it.
    pub fn execution_state(&self) -> ExecutionState {
        Self::execution_state_of(&self.readiness(), &self.router.activity())
    }

    fn execution_state_of(
        readiness: &Readiness,
        activity: &super::router::Activity,
    ) -> ExecutionState {
        match readiness {
            // The exit watch may not have told the router yet.
            Readiness::Dead(_) => ExecutionState::Dead,
            Readiness::Starting
            | Readiness::Restarting
            | Readiness::Ready
            | Readiness::Terminated
            | Readiness::Hibernated => activity.execution_state,
        }
    }

    /// The kernel model of the Kernel Gateway API.
    pub fn model(&self) -> KernelModel {
        let activity = self.router.activity();
        let readiness = self.readiness();
        KernelModel {
            id: self.id.to_string(),
            name: self.spec.name.clone(),
            last_activity: format_timestamp(activity.last_activity),
            execution_state: Self::execution_state_of(&readiness, &activity),
            connections: self.router.connections(),
            reason: match readiness {
                Readiness::Dead(reason) => Some(reason),
                _ => None,
            },
            cellgate: CellgateFields {
                policy: self.policy.clone(),
                tenant: self.owner().map(str::to_owned),
                sandbox: self.sandbox.backend(),
                state_generation: self.generation(),
                last_restart_reason: self.last_restart_reason.lock().clone(),
            },
        }
    }
}

/// A kernel as the Kernel Gateway API shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KernelModel {
    pub id: String,
    /// The kernelspec.
    pub name: String,
    pub last_activity: String,
    pub execution_state: ExecutionState,
    pub connections: usize,
    /// Why the kernel died, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// cellgate's own fields, namespaced so Kernel Gateway clients are not confused.
    pub cellgate: CellgateFields,
}

/// The kernel model's `cellgate` object.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CellgateFields {
    pub policy: String,
    /// Always present (`null` for the admin's kernels).
    pub tenant: Option<String>,
    pub sandbox: crate::sandbox::Backend,
    /// Changes whenever the kernel's variables were lost.
    pub state_generation: u64,
    /// Always present (`null` until a limit restarted the kernel).
    pub last_restart_reason: Option<String>,
}

/// Restores of a hibernated kernel that failed in a row with what was saved kept. Each
/// request tries again, but not forever: a save that keeps failing for a reason the
/// backend took for a passing one ([`GIVE_UP_TRIES`] tries over at least
/// [`GIVE_UP_AFTER`]) is given up, and the kernel starts afresh as for a lost sandbox.
#[derive(Debug, Default)]
pub(crate) struct Deferrals {
    first: Option<std::time::Instant>,
    last: Option<(std::time::Instant, String)>,
    tries: u32,
}

/// See [`Deferrals`]: long enough for a host to get over a passing shortage (memory, a
/// full disk an operator is freeing), short enough that a session is not refused all day.
const GIVE_UP_AFTER: Duration = Duration::from_secs(600);
/// See [`Deferrals`].
const GIVE_UP_TRIES: u32 = 3;

impl Deferrals {
    /// Why the last deferred restore failed, if it ended after `asked`: a request that
    /// waited for it gets its answer instead of another try.
    pub(crate) fn since(&self, asked: std::time::Instant) -> Option<String> {
        self.last
            .as_ref()
            .filter(|(ended, _)| *ended > asked)
            .map(|(_, why)| why.clone())
    }

    /// Notes a restore deferred for `why` now; `Some(reason)` when restores are to be
    /// given up (what was saved is then discarded, and `reason` says so).
    pub(crate) fn note(&mut self, why: &str) -> Option<String> {
        self.note_at(why, std::time::Instant::now())
    }

    fn note_at(&mut self, why: &str, now: std::time::Instant) -> Option<String> {
        let first = *self.first.get_or_insert(now);
        self.tries += 1;
        self.last = Some((now, why.to_owned()));
        let over = now.saturating_duration_since(first);
        (self.tries >= GIVE_UP_TRIES && over >= GIVE_UP_AFTER).then(|| {
            format!(
                "{why}; {} restores failed over {} s: what was saved is given up",
                self.tries,
                over.as_secs()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deferred_restores_are_given_up_after_tries_and_time_both() {
        let start = std::time::Instant::now();
        let mut deferrals = Deferrals::default();
        assert_eq!(deferrals.since(start), None);
        // Many tries at once: not given up (a client retrying is not a host failing long).
        for _ in 0..10 {
            assert_eq!(deferrals.note_at("no memory", start), None);
        }
        // A waiter that asked before the last try ended gets its answer.
        let before = start - Duration::from_millis(1);
        assert_eq!(deferrals.since(before).as_deref(), Some("no memory"));
        assert_eq!(deferrals.since(start), None);
        // Long after, but one try only: not given up.
        let mut deferrals = Deferrals::default();
        assert_eq!(deferrals.note_at("no memory", start), None);
        let later = start + GIVE_UP_AFTER;
        assert_eq!(deferrals.note_at("no memory", later), None);
        let given_up = deferrals.note_at("no memory", later).expect("given up");
        assert!(
            given_up.starts_with("no memory; 3 restores failed over 600 s"),
            "{given_up}"
        );
    }
}
