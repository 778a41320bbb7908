//! The registry of kernels: start, look up, list, shut down, cull idle ones.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use time::OffsetDateTime;

use super::launch::{filter_client_env, KernelDirs};
use super::lifecycle::{Kernel, KernelOptions, Readiness};
use super::spec::KernelSpecs;
use super::KernelError;
use crate::ownership::{Count, KernelRecord, Ownership};
use crate::policy::{Policies, Policy};
use crate::sandbox::{Backends, Limits, SandboxError};
use crate::telemetry::metrics::{RestoreOutcome, StartSource};

/// The environment variable (from the start request) that names a kernel's policy.
/// GatewayClient forwards every `KERNEL_*` variable of the lab server's environment, so a
/// JupyterLab user picks a policy with `KERNEL_POLICY=data-science jupyter lab …`.
pub const POLICY_ENV: &str = "KERNEL_POLICY";

/// Settings of the kernel registry.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// Where each kernel's private directories go (created 0700, removed on drop).
    pub runtime_root: PathBuf,
    pub max_kernels: Option<usize>,
    /// Extra environment variable names clients may pass besides `KERNEL_*`.
    pub env_allowlist: Vec<String>,
    /// Kernels idle this long are shut down; `None` disables culling.
    pub cull_idle_timeout: Option<Duration>,
    pub cull_interval: Duration,
    /// Whether kernels with open connections may be culled.
    pub cull_connected: bool,
    pub kernel: KernelOptions,
    pub policies: Policies,
    /// Ready kernels kept for each pooled kernelspec under the default policy; 0 disables.
    pub pool_size: usize,
    /// The kernelspecs the warm pool keeps kernels of (`--pool-kernels`); empty: the
    /// default kernelspec only.
    pub pool_kernels: Vec<String>,
}

/// How long a pool refill waits at most for clients' kernels to finish starting.
const POOL_DEFER_MAX: Duration = Duration::from_secs(30);

/// The tenant a kernel is started for, and how many live kernels that tenant may keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub tenant: String,
    pub max_kernels: Option<usize>,
    /// The same count as a quota (`concurrent_sessions`): refused with
    /// [`KernelError::SessionQuota`] rather than [`KernelError::TenantKernelLimit`].
    pub concurrent_sessions: Option<usize>,
}

impl Owner {
    /// Refuses one more kernel when the tenant has `counted` (live, being started, or
    /// recorded by other gateways) and a cap or quota says no more.
    fn check(&self, counted: usize) -> Result<(), KernelError> {
        if let Some(limit) = self.concurrent_sessions.filter(|&limit| counted >= limit) {
            return Err(KernelError::SessionQuota {
                tenant: self.tenant.clone(),
                limit,
                used: counted,
            });
        }
        match self.max_kernels {
            Some(max) if counted >= max => Err(KernelError::TenantKernelLimit { max }),
            _ => Ok(()),
        }
    }
}

/// All kernels of this gateway.
pub struct KernelManager {
    kernels: RwLock<HashMap<crate::ids::KernelId, Arc<Kernel>>>,
    specs: KernelSpecs,
    backends: Backends,
    options: ManagerOptions,
    /// The warm pools, one per pooled kernelspec: started, ready, never touched by a
    /// client. A kernel leaves its pool for good when it is handed out.
    pools: parking_lot::Mutex<HashMap<String, Pool>>,
    /// Kernels being started per tenant, so concurrent starts count toward its cap.
    starting: parking_lot::Mutex<HashMap<String, usize>>,
    /// Each tenant's hibernated-storage quota in bytes (`None`: unlimited).
    hibernation_quota: parking_lot::RwLock<Option<HibernationQuota>>,
    /// A pass of saves is under way: saves run one at a time, so each one's disk-room and
    /// quota checks see what the ones before it took.
    saving: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// A tenant's hibernated-storage quota, from the tenant settings (which this module does
/// not read itself), and what the tenant has hibernated beyond this gateway's kernels.
pub type HibernationQuota = Arc<dyn Fn(&str) -> Option<TenantHibernation> + Send + Sync>;

/// A tenant's hibernated-storage quota as the save pass checks it.
#[derive(Debug, Clone, Copy)]
pub struct TenantHibernation {
    /// The quota, in bytes.
    pub limit: u64,
    /// Bytes on disk of its sessions saved by an earlier gateway on this state directory
    /// and not restored since (dormant sessions: no kernel of this gateway holds them).
    pub kept: u64,
}

/// Whether a save of about `estimate` bytes fits a quota of `limit` with `used` taken.
fn hibernation_fits(used: u64, estimate: u64, limit: u64) -> bool {
    used.saturating_add(estimate) <= limit
}

/// A tenant's place among kernels being started; released on drop.
struct Reservation<'a> {
    manager: &'a KernelManager,
    tenant: String,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut starting = self.manager.starting.lock();
        if let Some(n) = starting.get_mut(&self.tenant) {
            *n -= 1;
            if *n == 0 {
                starting.remove(&self.tenant);
            }
        }
    }
}

#[derive(Default)]
struct Pool {
    ready: std::collections::VecDeque<Arc<Kernel>>,
    /// Kernels being started for the pool.
    filling: usize,
    /// Whether the pool has held its target since the gateway started.
    filled_once: bool,
    /// Why the last pool kernel failed to start, until one starts again.
    last_error: Option<String>,
    /// Pool starts that failed in a row (the retry's back-off), and whether a retry waits.
    failures: u32,
    retry_pending: bool,
}

/// The longest wait before a failed pool start is tried again.
const POOL_RETRY_MAX: Duration = Duration::from_secs(60);

/// Client variables a start would not pass on, and what would have allowed them.
#[derive(Debug, Clone)]
pub struct EnvRefusal {
    pub names: Vec<String>,
    /// The policy the kernel would run under.
    pub policy: String,
    /// Its `[environment] allow` patterns.
    pub patterns: Vec<String>,
    /// The gateway's `env_allowlist`.
    pub allowlist: Vec<String>,
}

/// The warm pool's state, for readiness and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    /// Ready kernels the pool keeps (`--pool-size`).
    pub target: usize,
    /// Ready kernels in it now.
    pub ready: usize,
    /// Kernels being started for it.
    pub filling: usize,
    /// Whether it has held its target since the gateway started (a pool that never filled
    /// says the default policy's kernels cannot start here).
    pub filled_once: bool,
    /// Why its last kernel failed to start, until one starts again.
    pub last_error: Option<String>,
}

/// The kernelspecs the warm pool keeps kernels of: `--pool-kernels`, else the default.
fn pooled_specs(specs: &KernelSpecs, options: &ManagerOptions) -> Vec<String> {
    if options.pool_kernels.is_empty() {
        vec![specs.default_name().to_owned()]
    } else {
        options.pool_kernels.clone()
    }
}

/// Refuses at start a pooled kernelspec the default policy's sandbox cannot run (a Deno
/// kernel in Kubernetes pods, or in microVMs whose image holds no environment of its): its
/// pool would never fill and `/readyz` would answer 503 for good, with nothing saying why.
fn check_pool_runs(
    specs: &KernelSpecs,
    backends: &Backends,
    options: &ManagerOptions,
) -> Result<(), KernelError> {
    if options.pool_size == 0 {
        return Ok(());
    }
    let backend = backends
        .forced()
        .unwrap_or(options.policies.default_policy().backend);
    if !backend.has_agent() {
        return Ok(());
    }
    let held = backends.image_environments(backend);
    let settings = options.policies.default_policy().backend_settings();
    for name in pooled_specs(specs, options) {
        if backends.has_own_image(backend, &settings, &name) {
            continue;
        }
        let Some(spec) = specs.get(&name) else {
            continue;
        };
        let argv = spec.command(std::path::Path::new("connection.json"))?;
        if !crate::sandbox::agent::runs_in_image(&argv, &held) {
            return Err(KernelError::PoolCannotRun {
                name,
                backend: backend.as_str(),
            });
        }
    }
    Ok(())
}

impl KernelManager {
    pub fn new(
        specs: KernelSpecs,
        backends: Backends,
        options: ManagerOptions,
    ) -> Result<Arc<KernelManager>, KernelError> {
        use std::os::unix::fs::DirBuilderExt;
        // A pooled kernelspec that does not exist is the operator's typo: said at start,
        // not found later as a pool that never fills.
        if let Some(name) = options
            .pool_kernels
            .iter()
            .find(|name| specs.get(name).is_none())
        {
            return Err(KernelError::NoSuchSpec {
                name: name.clone(),
                known: specs.names(),
            });
        }
        check_pool_runs(&specs, &backends, &options)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&options.runtime_root)
            .map_err(|source| KernelError::Io {
                what: format!("create {}", options.runtime_root.display()),
                source,
            })?;
        let manager = Arc::new(KernelManager {
            kernels: RwLock::new(HashMap::new()),
            specs,
            backends,
            options,
            pools: parking_lot::Mutex::new(HashMap::new()),
            starting: parking_lot::Mutex::new(HashMap::new()),
            hibernation_quota: parking_lot::RwLock::new(None),
            saving: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
        });
        // Each policy's counters exist at zero before its first start, failure, execution
        // or denial, so that alerts on their increase see the first one (telemetry::metrics).
        let kinds = crate::policy::DenialKind::ALL.map(|kind| kind.as_str());
        for policy in manager.options.policies.iter() {
            // Only the default policy's kernels are pooled (`start_for`, `refill_pool`).
            let pooled = policy.name == "default" && manager.options.pool_size > 0;
            crate::telemetry::metrics::metrics().declare_policy(
                &policy.name,
                manager.backend_of(policy).as_str(),
                pooled,
                &kinds,
            );
        }
        Ok(manager)
    }

    /// The policies kernels run under.
    pub fn policies(&self) -> &Policies {
        &self.options.policies
    }

    /// Where kernels' private directories go; the gateway keeps its other runtime state
    /// (artifacts) beside them.
    pub fn runtime_root(&self) -> &std::path::Path {
        &self.options.runtime_root
    }

    pub fn specs(&self) -> &KernelSpecs {
        &self.specs
    }

    /// Starts a kernel of kernelspec `name` (the default when `None`) for the admin, from the
    /// warm pool when one fits.
    pub async fn start(
        self: &Arc<Self>,
        name: Option<&str>,
        requested_env: &BTreeMap<String, String>,
    ) -> Result<Arc<Kernel>, KernelError> {
        self.start_for(name, requested_env, None).await
    }

    /// Takes a place for one more kernel of `owner`, or refuses past its cap. Live kernels
    /// and kernels being started both count.
    fn reserve(&self, owner: &Owner) -> Result<Reservation<'_>, KernelError> {
        let mut starting = self.starting.lock();
        let pending = starting.get(&owner.tenant).copied().unwrap_or(0);
        if owner.max_kernels.is_some() || owner.concurrent_sessions.is_some() {
            let live = self
                .kernels
                .read()
                .values()
                .filter(|k| k.owner() == Some(owner.tenant.as_str()))
                .count();
            owner.check(live + pending)?;
        }
        starting.insert(owner.tenant.clone(), pending + 1);
        Ok(Reservation {
            manager: self,
            tenant: owner.tenant.clone(),
        })
    }

    /// The tenant's and the policy's caps across gateways sharing ownership: their kernels
    /// recorded there are counted by the registry (every gateway's), this gateway's other
    /// kernels and the starts in progress here as for one gateway. Starts racing on two
    /// gateways may both pass: a cap can be exceeded by the number of gateways at most.
    async fn check_shared_caps(
        &self,
        owner: Option<&Owner>,
        policy: &Policy,
    ) -> Result<(), KernelError> {
        let ownership = self.ownership();
        if !ownership.shared() {
            return Ok(());
        }
        if let Some(owner) =
            owner.filter(|o| o.max_kernels.is_some() || o.concurrent_sessions.is_some())
        {
            let recorded = ownership.count(Count::Tenant(&owner.tenant)).await?;
            let unrecorded_here = self
                .kernels
                .read()
                .values()
                .filter(|k| k.owner() == Some(owner.tenant.as_str()))
                .filter(|k| !k.shares_ownership())
                .count();
            // This start's own reservation is among the pending ones.
            let pending = self
                .starting
                .lock()
                .get(&owner.tenant)
                .copied()
                .unwrap_or(1)
                .saturating_sub(1);
            owner.check(recorded + unrecorded_here + pending)?;
        }
        // The backend says whether it records its kernels (a backend that cannot run here
        // records nothing: the launch fails on it anyway).
        let recorded_here = self
            .backends
            .get(policy.backend)
            .is_ok_and(|sandbox| sandbox.shares_ownership());
        if recorded_here {
            let recorded = ownership.count(Count::Policy(&policy.name)).await?;
            if recorded >= policy.limits.max_kernels {
                return Err(KernelError::TooManyKernels {
                    max: policy.limits.max_kernels,
                });
            }
        }
        Ok(())
    }

    /// Who owns which kernel (this gateway alone, or the registry it shares with others).
    pub fn ownership(&self) -> &Arc<dyn Ownership> {
        self.backends.ownership()
    }

    /// Starts a kernel owned by `owner` (the admin when `None`), from the warm pool when one
    /// fits. The kernel has its owner before any other request can see it.
    pub async fn start_for(
        self: &Arc<Self>,
        name: Option<&str>,
        requested_env: &BTreeMap<String, String>,
        owner: Option<&Owner>,
    ) -> Result<Arc<Kernel>, KernelError> {
        self.start_with(name, requested_env, owner, None).await
    }

    /// Starts a kernel under the id `id` it had before (a session's, after a gateway
    /// restart), its state generation going on after `generation`; never from the pool.
    pub async fn start_again(
        self: &Arc<Self>,
        id: crate::ids::KernelId,
        generation: u64,
        name: Option<&str>,
        requested_env: &BTreeMap<String, String>,
        owner: Option<&Owner>,
    ) -> Result<Arc<Kernel>, KernelError> {
        if let Some(kernel) = self.get(id.as_str()) {
            return Ok(kernel);
        }
        self.start_with(name, requested_env, owner, Some((id, generation)))
            .await
    }

    async fn start_with(
        self: &Arc<Self>,
        name: Option<&str>,
        requested_env: &BTreeMap<String, String>,
        owner: Option<&Owner>,
        again: Option<(crate::ids::KernelId, u64)>,
    ) -> Result<Arc<Kernel>, KernelError> {
        let _reservation = owner.map(|o| self.reserve(o)).transpose()?;
        let spec = self.spec(name)?;
        if let Some(max) = self.options.max_kernels {
            if self.kernels.read().len() >= max {
                return Err(KernelError::TooManyKernels { max });
            }
        }
        // The policy may come from the client's KERNEL_POLICY, which any client may set;
        // its `[environment]` then decides the client's other variables.
        let base_env = filter_client_env(
            requested_env,
            &self.options.env_allowlist,
            &Default::default(),
        )?;
        let policy = self.policy_for(spec, &base_env)?.clone();
        let client_env = filter_client_env(
            requested_env,
            &self.options.env_allowlist,
            &policy.environment,
        )?;
        let running = self
            .kernels
            .read()
            .values()
            .filter(|k| k.policy == policy.name)
            .count();
        if running >= policy.limits.max_kernels {
            return Err(KernelError::TooManyKernels {
                max: policy.limits.max_kernels,
            });
        }
        self.check_shared_caps(owner, &policy).await?;
        let poolable = policy.name == "default" && self.pooled_specs().contains(&spec.name);
        let asked = std::time::Instant::now();
        let backend = self.backend_of(&policy).as_str();
        let metrics = crate::telemetry::metrics::metrics();
        if poolable && self.options.pool_size > 0 && again.is_none() {
            let pooled = self.take_from_pool(&spec.name);
            metrics.pool_lookup(pooled.is_some());
            let extra: BTreeMap<String, String> = client_env
                .iter()
                .filter(|(k, _)| k.as_str() != POLICY_ENV)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            // A pooled kernel that cannot take the client's variables is nobody's: it is
            // shut down (it is in no registry, so nothing else would) and the start goes on
            // cold.
            let pooled = match pooled {
                Some(kernel) if !extra.is_empty() => match kernel.set_env(&extra).await {
                    Ok(()) => Some(kernel),
                    Err(error) => {
                        tracing::warn!(%error, kernel_id = %kernel.id, "a pooled kernel did not take the client's variables: it is shut down, and a kernel starts afresh");
                        tokio::spawn(async move { kernel.shutdown().await });
                        None
                    }
                },
                other => other,
            };
            if let Some(kernel) = pooled {
                kernel.touch();
                if let Some(owner) = owner {
                    kernel.set_owner(&owner.tenant);
                    // Started for nobody: its record learns its tenant (caps, take-overs).
                    if kernel.shares_ownership() {
                        let recorded = self
                            .ownership()
                            .set_tenant(kernel.id.as_str(), &owner.tenant);
                        if let Err(error) = recorded.await {
                            tracing::warn!(%error, kernel_id = %kernel.id, "recording a pooled kernel's tenant failed");
                        }
                    }
                }
                self.kernels
                    .write()
                    .insert(kernel.id.clone(), kernel.clone());
                self.refill_pool();
                metrics.kernel_started(&policy.name, backend, StartSource::pool, asked.elapsed());
                tracing::info!(kernel_id = %kernel.id, "kernel handed out from the warm pool");
                return Ok(kernel);
            }
            self.refill_pool();
        }
        let tenant = owner.map(|owner| owner.tenant.clone());
        let kernel = match self
            .launch(spec, &policy, client_env, tenant, None, again)
            .await
        {
            Ok(kernel) => kernel,
            Err(err) => {
                metrics.kernel_start_failed(&policy.name, backend, StartSource::cold);
                return Err(err);
            }
        };
        // The client's wait ends when the kernel is ready, which the start request does
        // not wait for: measured beside it.
        let watched = kernel.clone();
        let policy_name = policy.name.clone();
        tokio::spawn(async move {
            match watched.wait_ready().await {
                Ok(()) => metrics.kernel_started(
                    &policy_name,
                    backend,
                    StartSource::cold,
                    asked.elapsed(),
                ),
                Err(_) => metrics.kernel_start_failed(&policy_name, backend, StartSource::cold),
            }
        });
        if let Some(owner) = owner {
            kernel.set_owner(&owner.tenant);
        }
        self.kernels
            .write()
            .insert(kernel.id.clone(), kernel.clone());
        Ok(kernel)
    }

    /// Launches a kernel (not registered).
    async fn launch(
        &self,
        spec: &super::KernelSpec,
        policy: &Policy,
        client_env: BTreeMap<String, String>,
        tenant: Option<String>,
        adopt: Option<(KernelRecord, String)>,
        again: Option<(crate::ids::KernelId, u64)>,
    ) -> Result<Arc<Kernel>, KernelError> {
        self.launch_with_age(spec, policy, client_env, tenant, adopt, again, None)
            .await
    }

    /// [`KernelManager::launch`] of a kernel that started `age` ago (under an earlier
    /// gateway).
    // One more than `launch`'s list, each handed on once.
    #[allow(clippy::too_many_arguments)]
    async fn launch_with_age(
        &self,
        spec: &super::KernelSpec,
        policy: &Policy,
        client_env: BTreeMap<String, String>,
        tenant: Option<String>,
        adopt: Option<(KernelRecord, String)>,
        again: Option<(crate::ids::KernelId, u64)>,
        age: Option<Duration>,
    ) -> Result<Arc<Kernel>, KernelError> {
        let mut options = self.options.kernel.clone();
        options.tenant = tenant;
        options.age = age;
        let id = match (&adopt, again) {
            (None, None) => crate::ids::KernelId::random(),
            (_, Some((id, generation))) => {
                options.first_generation = generation;
                id
            }
            // Only gateways name kernels, so a record names one of their ids; a record that
            // does not is no kernel this gateway can take over.
            (Some((record, _)), None) => crate::ids::KernelId::parse(&record.kernel_id)
                .map_err(|_| KernelError::NoSuchKernel)?,
        };
        options.adopt = adopt;
        options.execution_timeout = Some(policy.limits.execution_timeout);
        options.interrupt_grace = policy.limits.interrupt_grace;
        options.output_limit = Some(policy.limits.output_per_execution_bytes);
        options.idle_timeout = Some(policy.limits.idle_timeout);
        options.lifetime = Some(policy.limits.lifetime);
        options.policy = Some(Arc::new(policy.clone()));
        options.limits = Limits {
            memory_bytes: Some(policy.limits.memory_bytes),
            cpu_millis: Some(policy.limits.cpu_millis),
            pids: Some(policy.limits.pids),
            workspace_bytes: Some(policy.limits.workspace_bytes),
        };
        let backend = self.backend_of(policy).as_str();
        let unavailable = |err: SandboxError| KernelError::BackendUnavailable {
            policy: policy.name.clone(),
            backend,
            reason: err.to_string(),
        };
        let sandbox = self.backends.get(policy.backend).map_err(unavailable)?;
        let dirs = match sandbox.kernel_dir(id.as_str()) {
            Some(root) => KernelDirs::create_at(&root)?,
            None => KernelDirs::create(&self.options.runtime_root, id.as_str())?,
        };
        let started = Kernel::start(
            id,
            Arc::new(spec.clone()),
            policy.name.clone(),
            sandbox,
            dirs.clone(),
            client_env,
            options,
        )
        .await
        .map_err(|err| match err {
            // The backend exists but will not run this policy's kernels here.
            KernelError::Sandbox(err) if err.is_refusal() => unavailable(err),
            other => other,
        });
        if started.is_err() {
            dirs.remove();
        }
        started
    }

    fn take_from_pool(&self, spec: &str) -> Option<Arc<Kernel>> {
        let mut pools = self.pools.lock();
        let pool = pools.get_mut(spec)?;
        while let Some(kernel) = pool.ready.pop_front() {
            if kernel.readiness() == Readiness::Ready {
                return Some(kernel);
            }
            // Died while waiting: drop it (its exit was already reported in the log).
            tokio::spawn(async move { kernel.shutdown().await });
        }
        None
    }

    /// Whether a kernel handed to a client is still starting.
    fn clients_starting(&self) -> bool {
        self.kernels.read().values().any(|kernel| {
            matches!(
                kernel.readiness(),
                Readiness::Starting | Readiness::Restarting
            )
        })
    }

    /// The kernelspecs the warm pool keeps kernels of.
    fn pooled_specs(&self) -> Vec<String> {
        pooled_specs(&self.specs, &self.options)
    }

    /// Starts pool kernels in the background until each pooled kernelspec's pool holds
    /// `pool_size`.
    pub fn refill_pool(self: &Arc<Self>) {
        for spec in self.pooled_specs() {
            self.refill_pool_of(spec);
        }
    }

    fn refill_pool_of(self: &Arc<Self>, spec_name: String) {
        let wanted = self.options.pool_size;
        let missing = {
            let mut pools = self.pools.lock();
            let pool = pools.entry(spec_name.clone()).or_default();
            let missing = wanted.saturating_sub(pool.ready.len() + pool.filling);
            pool.filling += missing;
            missing
        };
        for _ in 0..missing {
            let manager = Arc::downgrade(self);
            let spec_name = spec_name.clone();
            tokio::spawn(async move {
                // A pool kernel competes for the CPU with the kernels clients are waiting
                // for: while any of theirs is still starting (a burst of fifty on two cores
                // takes seconds), wait. Bounded, so a kernel stuck starting never keeps
                // the pool empty for long.
                let deadline = tokio::time::Instant::now() + POOL_DEFER_MAX;
                loop {
                    let Some(manager) = manager.upgrade() else {
                        return;
                    };
                    if !manager.clients_starting() || tokio::time::Instant::now() >= deadline {
                        break;
                    }
                    drop(manager);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let Some(manager) = manager.upgrade() else {
                    return;
                };
                let began = std::time::Instant::now();
                let metrics = crate::telemetry::metrics::metrics();
                let (kernel, labels) = match (
                    manager.specs.get(&spec_name),
                    manager.options.policies.get("default"),
                ) {
                    (Some(spec), Ok(policy)) => {
                        let (spec, policy) = (spec.clone(), policy.clone());
                        let backend = manager.backend_of(&policy);
                        (
                            manager
                                .launch(&spec, &policy, BTreeMap::new(), None, None, None)
                                .await,
                            Some((policy.name, backend.as_str())),
                        )
                    }
                    _ => (Err(KernelError::NotReady), None),
                };
                let ready = match kernel {
                    Ok(kernel) => kernel.wait_ready().await.map(|_| kernel),
                    Err(err) => Err(err),
                };
                if let Some((policy, backend)) = &labels {
                    match &ready {
                        Ok(_) => metrics.kernel_started(
                            policy,
                            backend,
                            StartSource::refill,
                            began.elapsed(),
                        ),
                        Err(_) => metrics.kernel_start_failed(policy, backend, StartSource::refill),
                    }
                }
                let mut pools = manager.pools.lock();
                let pool = pools.entry(spec_name.clone()).or_default();
                pool.filling = pool.filling.saturating_sub(1);
                match ready {
                    Ok(kernel) => {
                        // Logged once it can be handed out ("kernel ready" comes earlier).
                        tracing::info!(kernel_id = %kernel.id, kernelspec = %spec_name, "kernel joined the warm pool");
                        pool.ready.push_back(kernel);
                        pool.filled_once |= pool.ready.len() >= wanted;
                        pool.last_error = None;
                        pool.failures = 0;
                    }
                    Err(err) => {
                        pool.last_error = Some(format!("{spec_name}: {err}"));
                        pool.failures = pool.failures.saturating_add(1);
                        // Tried again by itself, backing off: a pool that failed once (a
                        // host busy at boot) must not stay empty, and the gateway unready,
                        // until a client happens to start a kernel.
                        let wait =
                            Duration::from_secs(1 << pool.failures.min(6)).min(POOL_RETRY_MAX);
                        tracing::warn!(%err, kernelspec = %spec_name, retry_in = ?wait, "could not start a pool kernel");
                        if !pool.retry_pending {
                            pool.retry_pending = true;
                            let weak = Arc::downgrade(&manager);
                            tokio::spawn(async move {
                                tokio::time::sleep(wait).await;
                                if let Some(manager) = weak.upgrade() {
                                    if let Some(pool) = manager.pools.lock().get_mut(&spec_name) {
                                        pool.retry_pending = false;
                                    }
                                    manager.refill_pool_of(spec_name);
                                }
                            });
                        }
                    }
                }
            });
        }
    }

    /// Kernelspec `name`, or the default one.
    fn spec(&self, name: Option<&str>) -> Result<&super::KernelSpec, KernelError> {
        let name = name.unwrap_or(self.specs.default_name());
        self.specs.get(name).ok_or_else(|| KernelError::NoSuchSpec {
            name: name.to_owned(),
            known: self.specs.names(),
        })
    }

    /// The variables of `requested` a start of kernelspec `name` would drop (neither
    /// `KERNEL_*`, the gateway's allowlist nor allowed by the policy it would run under),
    /// for a caller that refuses rather than drops.
    pub fn refused_env(
        &self,
        name: Option<&str>,
        requested: &BTreeMap<String, String>,
    ) -> Result<Option<EnvRefusal>, KernelError> {
        let spec = self.spec(name)?;
        let base_env =
            filter_client_env(requested, &self.options.env_allowlist, &Default::default())?;
        let policy = self.policy_for(spec, &base_env)?;
        let names: Vec<String> = requested
            .keys()
            .filter(|n| {
                !super::launch::client_may_set(n, &self.options.env_allowlist, &policy.environment)
            })
            .cloned()
            .collect();
        Ok((!names.is_empty()).then(|| EnvRefusal {
            names,
            policy: policy.name.clone(),
            patterns: policy.environment.patterns(),
            allowlist: self.options.env_allowlist.clone(),
        }))
    }

    /// The policy a kernel runs under: `KERNEL_POLICY` from the request, else the
    /// kernelspec's `metadata.cellgate.policy`, else `default`. Its backend is the policy's
    /// own unless the operator forced one (`--sandbox`).
    fn policy_for(
        &self,
        spec: &super::KernelSpec,
        client_env: &BTreeMap<String, String>,
    ) -> Result<&Policy, KernelError> {
        let from_spec = spec
            .metadata
            .get("cellgate")
            .and_then(|c| c.get("policy"))
            .and_then(|p| p.as_str());
        let name = client_env
            .get(POLICY_ENV)
            .map(String::as_str)
            .or(from_spec)
            .unwrap_or("default");
        let policy = self.options.policies.get(name)?;
        Ok(policy)
    }

    /// The warm pools' state, summed over the pooled kernelspecs.
    pub fn pool_status(&self) -> PoolStatus {
        let specs = self.pooled_specs();
        let pools = self.pools.lock();
        let of = |spec: &String| pools.get(spec);
        PoolStatus {
            target: self.options.pool_size * specs.len(),
            // A pool kernel that died waiting is dropped at the next hand-out, not counted.
            ready: specs
                .iter()
                .filter_map(of)
                .flat_map(|pool| pool.ready.iter())
                .filter(|k| k.readiness() == Readiness::Ready)
                .count(),
            filling: specs.iter().filter_map(of).map(|pool| pool.filling).sum(),
            filled_once: self.options.pool_size == 0
                || specs
                    .iter()
                    .all(|spec| of(spec).is_some_and(|pool| pool.filled_once)),
            last_error: specs
                .iter()
                .filter_map(of)
                .find_map(|pool| pool.last_error.clone()),
        }
    }

    /// The backend a policy's kernels run in here (the operator's `--sandbox`, else its own).
    pub fn backend_of(&self, policy: &Policy) -> crate::sandbox::Backend {
        self.backends.forced().unwrap_or(policy.backend)
    }

    /// What checks the backends with this gateway's settings (`cellgate doctor`'s checks).
    pub fn diagnoser(&self) -> crate::sandbox::Diagnoser {
        self.backends.diagnoser()
    }

    pub fn get(&self, id: &str) -> Option<Arc<Kernel>> {
        self.kernels.read().get(id).cloned()
    }

    pub fn list(&self) -> Vec<Arc<Kernel>> {
        let mut kernels: Vec<_> = self.kernels.read().values().cloned().collect();
        kernels.sort_by(|a, b| a.id.cmp(&b.id));
        kernels
    }

    /// Takes over a kernel whose gateway is gone (its sandbox still runs): attached to, not
    /// started, under the id, kernelspec, policy and tenant its record names; `key` is the
    /// one its messages are signed with. A kernel this gateway has already is returned.
    pub async fn adopt(
        &self,
        record: KernelRecord,
        key: String,
    ) -> Result<Arc<Kernel>, KernelError> {
        if let Some(kernel) = self.get(&record.kernel_id) {
            return Ok(kernel);
        }
        let spec = self
            .specs
            .get(&record.kernelspec)
            .ok_or_else(|| KernelError::NoSuchSpec {
                name: record.kernelspec.clone(),
                known: self.specs.names(),
            })?
            .clone();
        let policy = self.options.policies.get(&record.policy)?.clone();
        let tenant = record.tenant.clone();
        let kernel = self
            .launch(
                &spec,
                &policy,
                BTreeMap::new(),
                tenant.clone(),
                Some((record, key)),
                None,
            )
            .await?;
        if let Some(tenant) = &tenant {
            kernel.set_owner(tenant);
        }
        self.kernels
            .write()
            .insert(kernel.id.clone(), kernel.clone());
        tracing::info!(kernel_id = %kernel.id, "kernel taken over from a gateway that is gone");
        Ok(kernel)
    }

    /// Ends the sandboxes that outlived the gateway before this one and that no stored
    /// session claims (`claimed`: the stored sessions' kernel ids), in the backends the
    /// policies use. Blocking; the number ended.
    pub fn end_unclaimed_survivors(&self, claimed: &std::collections::HashSet<String>) -> usize {
        let used = self.options.policies.iter().map(|policy| policy.backend);
        self.backends
            .end_unclaimed(used, &|id: &str| claimed.contains(id))
    }

    /// Whether `id`'s kernel (of `policy`) has a sandbox that outlived the gateway before
    /// this one, which [`KernelManager::adopt_survivor`] may take back.
    pub fn has_survivor(&self, id: &crate::ids::KernelId, policy: &str) -> bool {
        let Ok(policy) = self.options.policies.get(policy) else {
            return false;
        };
        self.backends.get(policy.backend).is_ok_and(|sandbox| {
            sandbox
                .survivor(id.as_str())
                .is_some_and(|survivor| !survivor.hibernated)
        })
    }

    /// Removes what `id`'s backend kept of its sandbox for a later gateway (a hibernated
    /// VM's files): its session is gone for good, or starts afresh.
    pub fn forget_sandbox(&self, id: &crate::ids::KernelId, policy: &str) {
        let Ok(policy) = self.options.policies.get(policy) else {
            return;
        };
        if let Ok(sandbox) = self.backends.get(policy.backend) {
            sandbox.forget(id.as_str());
        }
    }

    /// Whether `id`'s kernel (of `policy`) is hibernated on disk from a gateway before this
    /// one (its session is listed `hibernated`, and its next request restores it): its
    /// state generation when it is.
    pub fn hibernated_generation(&self, id: &crate::ids::KernelId, policy: &str) -> Option<u64> {
        let policy = self.options.policies.get(policy).ok()?;
        let survivor = self
            .backends
            .get(policy.backend)
            .ok()?
            .survivor(id.as_str())?;
        survivor.hibernated.then_some(survivor.generation)
    }

    /// Bytes on disk of `id`'s sandbox, saved by the gateway before this one and not
    /// restored yet; 0 when it has none.
    pub fn kept_hibernated_bytes(&self, id: &crate::ids::KernelId, policy: &str) -> u64 {
        let Ok(policy) = self.options.policies.get(policy) else {
            return 0;
        };
        self.backends
            .get(policy.backend)
            .ok()
            .and_then(|backend| backend.survivor(id.as_str()))
            .filter(|survivor| survivor.hibernated)
            .map_or(0, |survivor| survivor.hibernated_bytes)
    }

    /// Takes back the kernel of a session whose sandbox outlived the gateway before this one
    /// (same state directory): attached to, not started, under its id, generation,
    /// kernelspec, policy and tenant. `Ok(None)`: it has no such sandbox; an error: it had
    /// one, which is gone or refused this gateway (see `sandbox::namespaces::survival`), or
    /// (a hibernated one) could not be restored now but is kept
    /// ([`KernelError::RestoreDeferred`]).
    pub async fn adopt_survivor(
        &self,
        id: crate::ids::KernelId,
        kernelspec: &str,
        policy: &str,
        tenant: Option<String>,
    ) -> Result<Option<Arc<Kernel>>, KernelError> {
        if let Some(kernel) = self.get(id.as_str()) {
            return Ok(Some(kernel));
        }
        let spec = self
            .specs
            .get(kernelspec)
            .ok_or_else(|| KernelError::NoSuchSpec {
                name: kernelspec.to_owned(),
                known: self.specs.names(),
            })?
            .clone();
        let policy = self.options.policies.get(policy)?.clone();
        let sandbox =
            self.backends
                .get(policy.backend)
                .map_err(|err| KernelError::BackendUnavailable {
                    policy: policy.name.clone(),
                    backend: self.backend_of(&policy).as_str(),
                    reason: err.to_string(),
                })?;
        let Some(survivor) = sandbox.survivor(id.as_str()) else {
            return Ok(None);
        };
        let record = KernelRecord {
            kernel_id: id.to_string(),
            owner: String::new(),
            incarnation: String::new(),
            sandbox: self.backend_of(&policy).as_str().to_owned(),
            namespace: String::new(),
            kernelspec: spec.name.clone(),
            policy: policy.name.clone(),
            tenant: tenant.clone(),
        };
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let age = Duration::from_millis(now_ms.saturating_sub(survivor.started_ms));
        let restoring = std::time::Instant::now();
        let kernel_id = id.to_string();
        let launched = self
            .launch_with_age(
                &spec,
                &policy,
                BTreeMap::new(),
                tenant.clone(),
                Some((record, survivor.key.clone())),
                Some((id, survivor.generation.saturating_sub(1))),
                Some(age),
            )
            .await;
        if survivor.hibernated {
            // The VM restored (to its kernel's process running, not yet ready), or not:
            // with what was saved kept for another try (a failure of the host's before the
            // VM ran), or gone.
            let kept = launched.is_err()
                && sandbox
                    .survivor(&kernel_id)
                    .is_some_and(|survivor| survivor.hibernated);
            let outcome = match (&launched, kept) {
                (Ok(_), _) => RestoreOutcome::ok,
                (Err(_), true) => RestoreOutcome::deferred,
                (Err(_), false) => RestoreOutcome::failed,
            };
            crate::telemetry::metrics::metrics().hibernation_restored(restoring.elapsed(), outcome);
            if let (Err(err), true) = (&launched, kept) {
                return Err(KernelError::RestoreDeferred(err.to_string()));
            }
        }
        let kernel = launched?;
        if let Some(tenant) = &tenant {
            kernel.set_owner(tenant);
        }
        if survivor.hibernated {
            kernel.mark_restored();
        }
        self.kernels
            .write()
            .insert(kernel.id.clone(), kernel.clone());
        tracing::info!(kernel_id = %kernel.id, generation = kernel.generation(), "kernel adopted from the gateway before this one");
        Ok(Some(kernel))
    }

    /// Lets every kernel whose sandbox outlives the gateway go, running, for the next
    /// gateway on this state directory (this one is stopping); how many.
    pub fn detach_survivors(&self) -> usize {
        self.detach_where(|k| k.outlives_gateway())
    }

    /// Lets every hibernated kernel a stored session holds go, its saved sandbox kept on
    /// disk for the next gateway on this state directory (this one is stopping); how many.
    pub fn detach_hibernated(&self) -> usize {
        self.detach_where(|k| k.is_hibernated() && k.outlives_gateway())
    }

    /// Removes the kernels `which` picks and detaches them (their sandboxes run on); how many.
    fn detach_where(&self, which: impl Fn(&Kernel) -> bool) -> usize {
        let kept: Vec<Arc<Kernel>> = {
            let mut kernels = self.kernels.write();
            kernels
                .extract_if(|_, k| which(k))
                .map(|(_, kernel)| kernel)
                .collect()
        };
        for kernel in &kept {
            kernel.detach();
        }
        kept.len()
    }

    /// Forgets a kernel another gateway holds now (this one lost it), without touching its
    /// sandbox; whether there was one to forget.
    pub fn release_lost(&self, id: &str) -> bool {
        let kernel = {
            let mut kernels = self.kernels.write();
            match kernels.get(id) {
                Some(k) if k.shares_ownership() => kernels.remove(id),
                _ => None,
            }
        };
        match kernel {
            Some(kernel) => {
                kernel.detach();
                true
            }
            None => false,
        }
    }

    /// Lets every kernel whose owner is recorded go, running, to the other gateways (this
    /// one is shutting down); the other kernels stay for [`KernelManager::shutdown_all`].
    pub fn hand_over_shared(&self) -> usize {
        self.detach_where(|k| k.shares_ownership())
    }

    /// Shuts one kernel down and forgets it.
    pub async fn shutdown(&self, id: &str) -> Result<(), KernelError> {
        let kernel = self.get(id).ok_or(KernelError::NoSuchKernel)?;
        kernel.shutdown().await;
        // Listed until its process is gone, so a 404 means the kernel really is.
        self.kernels.write().remove(id);
        Ok(())
    }

    /// Shuts every kernel down, in parallel, then kills whatever is left.
    pub async fn shutdown_all(&self) {
        let mut kernels: Vec<_> = self.kernels.write().drain().map(|(_, k)| k).collect();
        kernels.extend(
            self.pools
                .lock()
                .values_mut()
                .flat_map(|pool| pool.ready.drain(..)),
        );
        let all = kernels.iter().map(|k| k.shutdown());
        let graceful = futures_util::future::join_all(all);
        if tokio::time::timeout(Duration::from_secs(10), graceful)
            .await
            .is_err()
        {
            for kernel in &kernels {
                kernel.kill_now();
            }
        }
    }

    /// Kills every kernel at once, without waiting (used when the process is going down).
    pub fn kill_all(&self) {
        for kernel in self.kernels.read().values() {
            kernel.kill_now();
        }
        for kernel in self
            .pools
            .lock()
            .values()
            .flat_map(|pool| pool.ready.iter())
        {
            kernel.kill_now();
        }
    }

    /// Culls idle kernels every `cull_interval` until the manager is dropped.
    pub fn spawn_culler(self: &Arc<Self>) {
        let manager = Arc::downgrade(self);
        let interval = self.options.cull_interval;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(manager) = manager.upgrade() else {
                    return;
                };
                manager.cull_once().await;
            }
        });
    }

    /// Shuts down kernels that are idle past the gateway's culling timeout (unconnected ones
    /// only, unless `cull_connected`), idle past their policy's `idle_timeout`, or older than
    /// their policy's `lifetime`. A kernel busy with a cell is never idle.
    async fn cull_once(self: &Arc<Self>) {
        let now = OffsetDateTime::now_utc();
        let mut doomed = Vec::new();
        for kernel in self.list() {
            let idle_for = now - kernel.last_activity();
            let busy = kernel.router().activity().execution_state == super::ExecutionState::Busy;
            let dead = matches!(kernel.readiness(), Readiness::Dead(_));
            let unattended = self.options.cull_connected || kernel.connections() == 0;
            let reason = match (self.options.cull_idle_timeout, kernel.policy_idle_timeout()) {
                (Some(t), _) if (dead || (!busy && unattended)) && idle_for > t => {
                    Some("idle past the gateway's culling timeout")
                }
                (_, Some(t)) if !busy && idle_for > t => {
                    Some("idle past its policy's idle_timeout")
                }
                _ if kernel.age() > kernel.policy_lifetime().unwrap_or(Duration::MAX) => {
                    Some("older than its policy's lifetime")
                }
                _ => None,
            };
            if let Some(reason) = reason {
                doomed.push((kernel, reason));
            }
        }
        for (kernel, reason) in doomed {
            tracing::info!(kernel_id = %kernel.id, connections = kernel.connections(), reason, "culling kernel");
            let _ = self.shutdown(kernel.id.as_str()).await;
        }
        self.hibernate_idle(now);
    }

    /// Sets each tenant's hibernated-storage quota (`[tenants] hibernated_storage`).
    pub fn set_hibernation_quota(&self, quota: HibernationQuota) {
        *self.hibernation_quota.write() = Some(quota);
    }

    /// Whether `kernel`'s tenant may keep it hibernated as well: what its hibernated kernels
    /// take, plus this one's memory now (about what its save takes), within its quota.
    fn hibernation_allowed(&self, kernel: &Kernel) -> bool {
        let Some(tenant) = kernel.owner() else {
            return true;
        };
        let Some(TenantHibernation { limit, kept }) = self
            .hibernation_quota
            .read()
            .as_ref()
            .and_then(|quota| quota(tenant))
        else {
            return true;
        };
        let held: u64 = self
            .list()
            .iter()
            .filter(|k| k.owner() == Some(tenant))
            .map(|k| k.hibernated_bytes())
            .sum();
        let used = held.saturating_add(kept);
        let estimate = kernel
            .usage()
            .and_then(|usage| usage.memory_bytes)
            .unwrap_or(0);
        let fits = hibernation_fits(used, estimate, limit);
        if kernel.quota_refuses_hibernation(!fits) {
            crate::telemetry::metrics::metrics().hibernation_refused();
            tracing::warn!(kernel_id = %kernel.id, tenant, used, kept, estimate, limit, "not hibernated: the tenant's hibernated_storage quota would be passed; the session stays running until its idle_timeout");
        }
        fits
    }

    /// Saves to disk, in the background, the ready kernels idle past their policy's
    /// `hibernate_after` with no cell running (a connected client does not keep a kernel
    /// awake: its next message restores it).
    fn hibernate_idle(self: &Arc<Self>, now: OffsetDateTime) {
        use std::sync::atomic::Ordering;
        let idle: Vec<(Arc<Kernel>, OffsetDateTime)> = self
            .list()
            .into_iter()
            .filter_map(|kernel| {
                let after = kernel.policy_hibernate_after()?;
                let idle_since = kernel.last_activity();
                let idle = kernel.readiness() == Readiness::Ready
                    && kernel.router().activity().execution_state == super::ExecutionState::Idle
                    && kernel.router().running().is_none()
                    && now - idle_since > after;
                idle.then_some((kernel, idle_since))
            })
            .collect();
        // One pass at a time, its saves one after another: each save's room on disk and
        // its tenant's quota are checked after the saves before it have taken theirs.
        if idle.is_empty() || self.saving.swap(true, Ordering::SeqCst) {
            return;
        }
        /// Ends the pass however its task ends (a panic too), so later passes run.
        struct Pass(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Pass {
            fn drop(&mut self) {
                self.0.store(false, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let manager = Arc::downgrade(self);
        let pass = Pass(self.saving.clone());
        tokio::spawn(async move {
            let _pass = pass;
            for (kernel, idle_since) in idle {
                let Some(manager) = manager.upgrade() else {
                    break;
                };
                if !manager.hibernation_allowed(&kernel) {
                    continue;
                }
                drop(manager);
                tracing::info!(kernel_id = %kernel.id, "hibernating an idle kernel");
                if let Err(err) = kernel.hibernate(idle_since).await {
                    tracing::warn!(kernel_id = %kernel.id, %err, "the kernel was not hibernated");
                }
            }
        });
    }
}

impl Drop for KernelManager {
    fn drop(&mut self) {
        self.kill_all();
        if let Err(err) = std::fs::remove_dir_all(&self.options.runtime_root) {
            if err.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %self.options.runtime_root.display(), %err, "could not remove the runtime directory");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hibernation_fits_its_tenants_quota_or_is_not_made() {
        assert!(hibernation_fits(0, 100, 100));
        assert!(hibernation_fits(40, 60, 100));
        assert!(!hibernation_fits(40, 61, 100));
        assert!(!hibernation_fits(100, 1, 100));
        assert!(!hibernation_fits(u64::MAX, 1, u64::MAX - 1));
    }
}
