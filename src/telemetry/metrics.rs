//! The gateway's Prometheus metrics: what happened (counters and histograms, recorded where
//! it happens) and what is (gauges read from the gateway's state at each scrape).
//!
//! Events (kernel starts by source: pool, cold or refill; start failures; pool hits and
//! misses; executions and their durations by outcome; denials; rate-limited requests; HTTP
//! requests by route template; open connections and WebSockets; the zygotes' starts, forks
//! and cold starts; hibernations and restores by outcome, their durations, and the saved
//! sandboxes' sizes) are recorded into process-wide families ([`metrics()`]), as the logger is
//! process-wide: kernels, the egress proxy, tenants and the HTTP edge all record without
//! being handed a registry. Nothing here sits on the per-message path: an execution, a
//! kernel start, a request or a denial costs an atomic add and, for histograms, one
//! uncontended mutex. Hot recorders hold pre-resolved handles ([`ExecutionMetrics`]), so
//! they hash no labels either.
//!
//! State (kernels by state, the pool, artifacts, tenants' kernels, readiness) is not kept in
//! gauges that every change would have to update, and could drift: the gateway reads it at
//! scrape time into a [`Snapshot`], and [`render`] encodes both in the Prometheus text
//! format (0.0.4), with the process's own figures (RSS, CPU, descriptors) read from procfs.
//!
//! Labels are bounded: policies and backends come from configuration, outcomes and routes
//! are fixed sets (a route is its template, never a raw path), tenants are the gateway's
//! own tenants.
//!
//! Counters whose label values are known at start exist at zero from then on: without a
//! series before the first event, Prometheus's `increase()` and `rate()` see the first
//! event as the series' start, not as a step, and an alert on it stays silent. The zygote's
//! outcomes are made with the families; each policy's starts, start failures, executions
//! and denials when the kernel registry loads the policies ([`Metrics::declare_policy`]);
//! each configured tenant's rate limiting when the gateway starts serving
//! ([`Metrics::declare_tenant`]). Requests by route and status are not: their label sets
//! are only known as requests come.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The `Content-Type` of [`render`]'s text.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// How a kernel handed to a client was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)] // The label's values, as Prometheus shows them.
pub enum StartSource {
    /// Taken from the warm pool.
    pool,
    /// Launched for the request (the client waited for the whole start).
    cold,
    /// Launched to refill the pool (no client waited).
    refill,
}

/// How an execution ended, as the metrics count it: the kernel's reply status, refined by
/// what the gateway knows (a timeout it enforced, a limit that ended the sandbox, a policy
/// denial during the cell).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)] // The label's values, as Prometheus shows them.
pub enum ExecOutcome {
    ok,
    error,
    /// Interrupted by a client (`KeyboardInterrupt`).
    interrupted,
    /// Not run: an earlier cell failed and the kernel aborted the queue.
    aborted,
    timeout,
    oom,
    /// Failed, or installed nothing, because the policy refused something it tried.
    denied,
    /// The sandbox ended under the cell (or before it ran).
    lost,
}

impl ExecOutcome {
    const ALL: [ExecOutcome; 8] = [
        ExecOutcome::ok,
        ExecOutcome::error,
        ExecOutcome::interrupted,
        ExecOutcome::aborted,
        ExecOutcome::timeout,
        ExecOutcome::oom,
        ExecOutcome::denied,
        ExecOutcome::lost,
    ];
}

/// How a kernel zygote's start, or a fork from one, ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)] // The label's values, as Prometheus shows them.
pub enum ZygoteOutcome {
    ok,
    failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ZygoteLabels {
    outcome: ZygoteOutcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StartLabels {
    policy: String,
    backend: &'static str,
    source: StartSource,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ExecLabels {
    policy: String,
    outcome: ExecOutcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DenialLabels {
    policy: String,
    kind: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HttpLabels {
    method: &'static str,
    route: String,
    status: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteLabels {
    method: &'static str,
    route: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
    policy: String,
    backend: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct VersionLabels {
    version: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Kernel starts: from a pool hand-out (milliseconds) to a cold microVM boot (seconds).
fn start_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
    ])
}

/// Cells: from `1+1` (milliseconds) to long computations (the policies' timeouts).
fn execution_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        600.0, 1800.0,
    ])
}

/// Requests, to their response's head (a stream's or a WebSocket's whole life is not a
/// request's latency).
fn http_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

/// The process-wide event metrics.
pub struct Metrics {
    kernel_start: HistogramFamily<StartLabels>,
    kernel_start_failures: Family<StartLabels, Counter>,
    pool_hits: Counter,
    pool_misses: Counter,
    executions: Family<ExecLabels, Counter>,
    execution_seconds: HistogramFamily<ExecLabels>,
    denials: Family<DenialLabels, Counter>,
    rate_limited: Family<TenantLabels, Counter>,
    websockets_open: Gauge,
    connections_open: Gauge,
    http_requests: Family<HttpLabels, Counter>,
    http_seconds: HistogramFamily<RouteLabels>,
    zygote_starts: Family<ZygoteLabels, Counter>,
    zygote_forks: Family<ZygoteLabels, Counter>,
    zygote_cold_starts: Counter,
    zygote_preload_missing: Gauge,
    hibernations: Family<HibernationLabels, Counter>,
    hibernate_seconds: Histogram,
    hibernated_bytes: Histogram,
    restores: Family<RestoreLabels, Counter>,
    restore_seconds: Histogram,
    hibernations_refused: Counter,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HibernationLabels {
    outcome: ZygoteOutcome,
}

/// How a restore from hibernation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)] // The label's values, as Prometheus shows them.
pub enum RestoreOutcome {
    /// The saved kernel runs again.
    ok,
    /// It could not be restored and what was saved is gone: a fresh kernel replaced it.
    failed,
    /// Not restored this time, what was saved kept: the next request tries again.
    deferred,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RestoreLabels {
    outcome: RestoreOutcome,
}

/// Saves and restores of a VM: about a second natively, tens of seconds under emulation.
fn hibernation_histogram() -> Histogram {
    Histogram::new([
        0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
    ])
}

/// A saved sandbox on disk: about its RAM plus its workspace's used blocks.
fn size_histogram() -> Histogram {
    Histogram::new(
        [
            16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
        ]
        .map(|mib| mib * 1048576.0),
    )
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    let metrics = new_metrics();
    // At zero from the start, so that an alert on the first failure has a series to see.
    for outcome in [ZygoteOutcome::ok, ZygoteOutcome::failed] {
        drop(
            metrics
                .hibernations
                .get_or_create(&HibernationLabels { outcome }),
        );
        drop(
            metrics
                .zygote_starts
                .get_or_create(&ZygoteLabels { outcome }),
        );
        drop(
            metrics
                .zygote_forks
                .get_or_create(&ZygoteLabels { outcome }),
        );
    }
    for outcome in [
        RestoreOutcome::ok,
        RestoreOutcome::failed,
        RestoreOutcome::deferred,
    ] {
        drop(metrics.restores.get_or_create(&RestoreLabels { outcome }));
    }
    metrics
});

fn new_metrics() -> Metrics {
    Metrics {
        kernel_start: Family::new_with_constructor(start_histogram),
        kernel_start_failures: Family::default(),
        pool_hits: Counter::default(),
        pool_misses: Counter::default(),
        executions: Family::default(),
        execution_seconds: Family::new_with_constructor(execution_histogram),
        denials: Family::default(),
        rate_limited: Family::default(),
        websockets_open: Gauge::default(),
        connections_open: Gauge::default(),
        http_requests: Family::default(),
        http_seconds: Family::new_with_constructor(http_histogram),
        zygote_starts: Family::default(),
        zygote_forks: Family::default(),
        zygote_cold_starts: Counter::default(),
        zygote_preload_missing: Gauge::default(),
        hibernations: Family::default(),
        hibernate_seconds: hibernation_histogram(),
        hibernated_bytes: size_histogram(),
        restores: Family::default(),
        restore_seconds: hibernation_histogram(),
        hibernations_refused: Counter::default(),
    }
}

/// The process's metrics.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// An open connection or WebSocket, counted until dropped.
#[must_use]
pub struct OpenGuard(&'static Gauge);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One policy's execution counters and histograms, resolved once per kernel so that an
/// execution's end is two atomic adds and a histogram observation.
#[derive(Clone)]
pub struct ExecutionMetrics {
    by_outcome: [(Counter, Histogram); ExecOutcome::ALL.len()],
}

impl std::fmt::Debug for ExecutionMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExecutionMetrics")
    }
}

impl ExecutionMetrics {
    /// Records one execution's end.
    pub fn record(&self, outcome: ExecOutcome, elapsed: Duration) {
        // `ALL` lists the variants in declaration order (checked in the tests).
        let (count, seconds) = &self.by_outcome[outcome as usize];
        count.inc();
        seconds.observe(elapsed.as_secs_f64());
    }
}

impl Metrics {
    /// Makes the series of `policy`'s kernels (run by `backend`) at zero, where not there
    /// yet: starts and start failures (cold; from and for the pool when `pooled`),
    /// executions by outcome, and denials of each of `denial_kinds`.
    pub fn declare_policy(
        &self,
        policy: &str,
        backend: &'static str,
        pooled: bool,
        denial_kinds: &[&'static str],
    ) {
        let labels = |source| StartLabels {
            policy: policy.to_owned(),
            backend,
            source,
        };
        drop(self.kernel_start.get_or_create(&labels(StartSource::cold)));
        drop(
            self.kernel_start_failures
                .get_or_create(&labels(StartSource::cold)),
        );
        if pooled {
            drop(self.kernel_start.get_or_create(&labels(StartSource::pool)));
            drop(
                self.kernel_start
                    .get_or_create(&labels(StartSource::refill)),
            );
            // A pool hand-out does not fail (an empty pool is a miss): only refills do.
            drop(
                self.kernel_start_failures
                    .get_or_create(&labels(StartSource::refill)),
            );
        }
        drop(self.executions_of(policy));
        for &kind in denial_kinds {
            drop(self.denials.get_or_create(&DenialLabels {
                policy: policy.to_owned(),
                kind,
            }));
        }
    }

    /// Makes `tenant`'s rate-limit counter at zero, where not there yet.
    pub fn declare_tenant(&self, tenant: &str) {
        drop(self.rate_limited.get_or_create(&TenantLabels {
            tenant: tenant.to_owned(),
        }));
    }

    /// A kernel became ready for a client (or for the pool).
    pub fn kernel_started(
        &self,
        policy: &str,
        backend: &'static str,
        source: StartSource,
        elapsed: Duration,
    ) {
        self.kernel_start
            .get_or_create(&StartLabels {
                policy: policy.to_owned(),
                backend,
                source,
            })
            .observe(elapsed.as_secs_f64());
    }

    /// A kernel failed to start, or to become ready (`source`: `cold` for a client's,
    /// `refill` for the pool's).
    pub fn kernel_start_failed(&self, policy: &str, backend: &'static str, source: StartSource) {
        self.kernel_start_failures
            .get_or_create(&StartLabels {
                policy: policy.to_owned(),
                backend,
                source,
            })
            .inc();
    }

    /// A kernel zygote's start ended: ready, or failed.
    pub fn zygote_started(&self, outcome: ZygoteOutcome) {
        self.zygote_starts
            .get_or_create(&ZygoteLabels { outcome })
            .inc();
    }

    /// The most modules any serving zygote left out of its preload list.
    pub fn zygote_preload_missing(&self, most: usize) {
        self.zygote_preload_missing
            .set(i64::try_from(most).unwrap_or(i64::MAX));
    }

    /// A kernel was forked from a zygote, or the zygote failed to fork it.
    pub fn zygote_fork(&self, outcome: ZygoteOutcome) {
        self.zygote_forks
            .get_or_create(&ZygoteLabels { outcome })
            .inc();
    }

    /// A kernel's sandbox was saved to disk (`bytes` on disk) or failed to be (`None`).
    pub fn hibernation_saved(&self, elapsed: Duration, bytes: Option<u64>) {
        let outcome = match bytes {
            Some(bytes) => {
                self.hibernate_seconds.observe(elapsed.as_secs_f64());
                self.hibernated_bytes.observe(bytes as f64);
                ZygoteOutcome::ok
            }
            None => ZygoteOutcome::failed,
        };
        self.hibernations
            .get_or_create(&HibernationLabels { outcome })
            .inc();
    }

    /// A save was not made: its tenant's hibernated-storage quota would have been passed.
    pub fn hibernation_refused(&self) {
        self.hibernations_refused.inc();
    }

    /// A hibernated kernel was restored (`ok`), or could not be and started afresh.
    pub fn hibernation_restored(&self, elapsed: Duration, outcome: RestoreOutcome) {
        if outcome == RestoreOutcome::ok {
            self.restore_seconds.observe(elapsed.as_secs_f64());
        }
        self.restores
            .get_or_create(&RestoreLabels { outcome })
            .inc();
    }

    /// A kernel a zygote could have forked started cold (no zygote ready, or a failed fork).
    pub fn zygote_cold_start(&self) {
        self.zygote_cold_starts.inc();
    }

    /// A start the warm pool could serve took a pool kernel (`hit`) or found none.
    pub fn pool_lookup(&self, hit: bool) {
        if hit {
            self.pool_hits.inc();
        } else {
            self.pool_misses.inc();
        }
    }

    /// The handles a kernel of `policy` records its executions with.
    pub fn executions_of(&self, policy: &str) -> ExecutionMetrics {
        ExecutionMetrics {
            by_outcome: ExecOutcome::ALL.map(|outcome| {
                let labels = ExecLabels {
                    policy: policy.to_owned(),
                    outcome,
                };
                (
                    self.executions.get_or_create_owned(&labels),
                    self.execution_seconds.get_or_create_owned(&labels),
                )
            }),
        }
    }

    /// The policy refused a kernel something (`kind`: `egress` or `package`).
    pub fn denial(&self, policy: &str, kind: &'static str) {
        self.denials
            .get_or_create(&DenialLabels {
                policy: policy.to_owned(),
                kind,
            })
            .inc();
    }

    /// A tenant's request was refused for its rate.
    pub fn rate_limited(&self, tenant: &str) {
        self.rate_limited
            .get_or_create(&TenantLabels {
                tenant: tenant.to_owned(),
            })
            .inc();
    }

    /// A kernel WebSocket opened; closed when the guard drops.
    pub fn websocket_opened(&'static self) -> OpenGuard {
        self.websockets_open.inc();
        OpenGuard(&self.websockets_open)
    }

    /// A client connection was admitted; closed when the guard drops.
    pub fn connection_opened(&'static self) -> OpenGuard {
        self.connections_open.inc();
        OpenGuard(&self.connections_open)
    }

    /// A request's response head went out. `route` is the route's template.
    pub fn http_request(&self, method: &'static str, route: &str, status: u16, elapsed: Duration) {
        self.http_requests
            .get_or_create(&HttpLabels {
                method,
                route: route.to_owned(),
                status,
            })
            .inc();
        self.http_seconds
            .get_or_create(&RouteLabels {
                method,
                route: route.to_owned(),
            })
            .observe(elapsed.as_secs_f64());
    }
}

/// Kernels of one state, policy and backend.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelGroup {
    pub state: &'static str,
    pub policy: String,
    pub backend: &'static str,
}

/// The gateway's state at a scrape.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub kernels: BTreeMap<KernelGroup, i64>,
    pub tenant_kernels: BTreeMap<String, i64>,
    pub pool_ready: i64,
    pub pool_target: i64,
    pub artifacts: i64,
    pub artifact_bytes: i64,
    pub ready: bool,
}

/// The metrics and `snapshot` in the Prometheus text format.
pub fn render(snapshot: &Snapshot) -> Result<String, std::fmt::Error> {
    let m = metrics();
    let mut registry = Registry::with_prefix("cellgate");
    register_starts(&mut registry, m);
    register_executions(&mut registry, m);
    register_traffic(&mut registry, m);
    register_zygotes(&mut registry, m);
    register_hibernation(&mut registry, m);
    register_snapshot(&mut registry, snapshot);
    // Unprefixed, as every Prometheus client library names them.
    let mut process = Registry::default();
    register_process(&mut process);
    let mut out = String::with_capacity(16 << 10);
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)?;
    prometheus_client::encoding::prometheus_text::encode(&mut out, &process)?;
    Ok(out)
}

/// Hibernation: saves and restores.
fn register_hibernation(registry: &mut Registry, m: &Metrics) {
    registry.register(
        "hibernations",
        "Kernels' sandboxes saved to disk (hibernated), by outcome",
        m.hibernations.clone(),
    );
    registry.register(
        "hibernate_seconds",
        "Time to save a kernel's sandbox to disk",
        m.hibernate_seconds.clone(),
    );
    registry.register(
        "hibernated_bytes",
        "Bytes on disk of a hibernated sandbox (its saved state and workspace)",
        m.hibernated_bytes.clone(),
    );
    registry.register(
        "hibernations_refused",
        "Idle kernels not hibernated: their tenant's hibernated_storage quota would be passed",
        m.hibernations_refused.clone(),
    );
    registry.register(
        "restores",
        "Restores of hibernated kernels: ok, failed (what was saved lost, a fresh kernel started) or deferred (not restored this time, what was saved kept for the next request)",
        m.restores.clone(),
    );
    registry.register(
        "restore_seconds",
        "Time to restore a hibernated kernel, to ready",
        m.restore_seconds.clone(),
    );
}

/// Kernel starts and the warm pool.
fn register_starts(registry: &mut Registry, m: &Metrics) {
    registry.register(
        "kernel_start_seconds",
        "Time from a start request (or a pool refill) to a kernel ready for messages",
        m.kernel_start.clone(),
    );
    registry.register(
        "kernel_start_failures",
        "Kernels that failed to start or to become ready",
        m.kernel_start_failures.clone(),
    );
    registry.register(
        "pool_hits",
        "Starts served from the warm pool",
        m.pool_hits.clone(),
    );
    registry.register(
        "pool_misses",
        "Starts the warm pool could have served but found empty",
        m.pool_misses.clone(),
    );
}

/// Executions' ends and durations, and what the policy and the tenant rate refused.
fn register_executions(registry: &mut Registry, m: &Metrics) {
    registry.register(
        "executions",
        "Executions ended, by outcome",
        m.executions.clone(),
    );
    registry.register(
        "execution_seconds",
        "Time from an execute_request to its reply, by outcome",
        m.execution_seconds.clone(),
    );
    registry.register(
        "denials",
        "Requests the policy refused a kernel: egress (network) or package",
        m.denials.clone(),
    );
    registry.register(
        "rate_limited",
        "Requests refused for their tenant's rate",
        m.rate_limited.clone(),
    );
}

/// Client connections, WebSockets and HTTP requests.
fn register_traffic(registry: &mut Registry, m: &Metrics) {
    registry.register(
        "websockets_open",
        "Kernel channel WebSockets open",
        m.websockets_open.clone(),
    );
    registry.register(
        "connections_open",
        "Client connections open (HTTP and WebSocket)",
        m.connections_open.clone(),
    );
    registry.register(
        "http_requests",
        "Requests answered, by method, route template and status",
        m.http_requests.clone(),
    );
    registry.register(
        "http_request_duration_seconds",
        "Time to a response's head, by method and route template",
        m.http_seconds.clone(),
    );
}

/// The namespaces backend's kernel zygotes.
fn register_zygotes(registry: &mut Registry, m: &Metrics) {
    registry.register(
        "zygote_starts",
        "Kernel zygote starts (namespaces backend), by outcome",
        m.zygote_starts.clone(),
    );
    registry.register(
        "zygote_forks",
        "Kernels forked from a zygote (ok), and forks the zygote failed (it is then replaced)",
        m.zygote_forks.clone(),
    );
    registry.register(
        "zygote_cold_starts",
        "Kernels a zygote could have forked that started cold (no zygote ready, or a failed fork)",
        m.zygote_cold_starts.clone(),
    );
    registry.register(
        "zygote_preload_missing",
        "The most modules of its preload list a serving zygote could not import",
        m.zygote_preload_missing.clone(),
    );
}

/// The gateway's state at this scrape: kernels, tenants, the pool, artifacts, readiness.
fn register_snapshot(registry: &mut Registry, snapshot: &Snapshot) {
    let kernels = Family::<StateLabels, Gauge>::default();
    for (group, count) in &snapshot.kernels {
        kernels
            .get_or_create(&StateLabels {
                state: group.state,
                policy: group.policy.clone(),
                backend: group.backend,
            })
            .set(*count);
    }
    registry.register(
        "kernels",
        "Kernels by execution state, policy and backend (pool kernels excluded)",
        kernels,
    );
    let tenants = Family::<TenantLabels, Gauge>::default();
    for (tenant, count) in &snapshot.tenant_kernels {
        tenants
            .get_or_create(&TenantLabels {
                tenant: tenant.clone(),
            })
            .set(*count);
    }
    registry.register("tenant_kernels", "Live kernels per tenant", tenants);
    for (name, help, value) in [
        (
            "pool_ready",
            "Ready kernels waiting in the warm pool",
            snapshot.pool_ready,
        ),
        (
            "pool_target",
            "Kernels the warm pool keeps ready",
            snapshot.pool_target,
        ),
        ("artifacts", "Artifacts stored", snapshot.artifacts),
        (
            "artifact_bytes",
            "Bytes of the artifacts stored",
            snapshot.artifact_bytes,
        ),
        (
            "ready",
            "1 when /readyz answers 200",
            i64::from(snapshot.ready),
        ),
    ] {
        registry.register(name, help, ConstGauge::new(value));
    }
    let info = Family::<VersionLabels, Gauge>::default();
    info.get_or_create(&VersionLabels {
        version: env!("CARGO_PKG_VERSION"),
    })
    .set(1);
    registry.register("build_info", "The gateway's version", info);
}

/// The process figures Prometheus's client libraries export under these names, from procfs.
/// Written here: prometheus-client has no process collector, and these are five reads.
fn register_process(registry: &mut Registry) {
    let process = registry.sub_registry_with_prefix("process");
    let Some(stat) = ProcessStat::read() else {
        return;
    };
    process.register(
        "cpu_seconds",
        "User and system CPU time of the gateway process (kernels not included)",
        ConstCounter::new(stat.cpu_seconds),
    );
    process.register(
        "resident_memory_bytes",
        "Resident memory of the gateway process",
        ConstGauge::new(stat.rss_bytes),
    );
    process.register(
        "virtual_memory_bytes",
        "Virtual memory of the gateway process",
        ConstGauge::new(stat.vsize_bytes),
    );
    process.register(
        "threads",
        "Threads of the gateway process",
        ConstGauge::new(stat.threads),
    );
    if let Some(start) = stat.start_time_seconds {
        process.register(
            "start_time_seconds",
            "Start of the gateway process since the Unix epoch",
            ConstGauge::new(start),
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        process.register(
            "open_fds",
            "Open file descriptors of the gateway process",
            ConstGauge::new(fds.count() as i64),
        );
    }
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if let Some(max) = limit.current {
        process.register(
            "max_fds",
            "The gateway's open file limit",
            ConstGauge::new(i64::try_from(max).unwrap_or(i64::MAX)),
        );
    }
}

struct ProcessStat {
    cpu_seconds: f64,
    rss_bytes: i64,
    vsize_bytes: i64,
    threads: i64,
    start_time_seconds: Option<i64>,
}

impl ProcessStat {
    fn read() -> Option<ProcessStat> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The command name is in parentheses and may hold spaces: fields count from its end.
        let after = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = after.split(' ').collect();
        // proc(5) numbers fields from 1 with the pid; `after` starts at field 3 (state).
        let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
        let ticks = rustix::param::clock_ticks_per_second() as f64;
        let page = rustix::param::page_size() as i64;
        let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        });
        let started = field(22)? as f64 / ticks;
        Some(ProcessStat {
            cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
            threads: field(20)? as i64,
            start_time_seconds: boot.map(|b| (b as f64 + started) as i64),
            vsize_bytes: field(23)? as i64,
            rss_bytes: field(24)? as i64 * page,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_index_their_own_handles() {
        for (at, outcome) in ExecOutcome::ALL.iter().enumerate() {
            assert_eq!(*outcome as usize, at, "{outcome:?}");
        }
    }

    #[test]
    fn declared_series_are_exported_at_zero() {
        let m = metrics();
        m.declare_policy("declared-policy", "gvisor", true, &["egress", "package"]);
        m.declare_policy("declared-unpooled", "namespaces", false, &["egress"]);
        m.declare_tenant("declared-tenant");
        let text = render(&Snapshot::default()).unwrap();
        let p = "policy=\"declared-policy\",backend=\"gvisor\"";
        for line in [
            format!("cellgate_kernel_start_failures_total{{{p},source=\"cold\"}} 0"),
            format!("cellgate_kernel_start_failures_total{{{p},source=\"refill\"}} 0"),
            format!("cellgate_kernel_start_seconds_count{{{p},source=\"pool\"}} 0"),
            format!("cellgate_kernel_start_seconds_bucket{{{p},source=\"cold\",le=\"+Inf\"}} 0"),
            "cellgate_executions_total{policy=\"declared-policy\",outcome=\"ok\"} 0".to_owned(),
            "cellgate_denials_total{policy=\"declared-policy\",kind=\"package\"} 0".to_owned(),
            "cellgate_denials_total{policy=\"declared-unpooled\",kind=\"egress\"} 0".to_owned(),
            "cellgate_rate_limited_total{tenant=\"declared-tenant\"} 0".to_owned(),
            "cellgate_zygote_forks_total{outcome=\"failed\"} 0".to_owned(),
            "cellgate_zygote_cold_starts_total 0".to_owned(),
            "cellgate_pool_misses_total 0".to_owned(),
            "cellgate_hibernations_total{outcome=\"failed\"} 0".to_owned(),
            "cellgate_restores_total{outcome=\"ok\"} 0".to_owned(),
            "cellgate_restores_total{outcome=\"deferred\"} 0".to_owned(),
            "cellgate_hibernations_refused_total 0".to_owned(),
        ] {
            assert!(text.contains(&line), "{line} missing from:\n{text}");
        }
        // No pool, no pool series; only the kinds named.
        for absent in ["source=\"refill\"", "source=\"pool\"", "kind=\"package\""] {
            assert!(
                !text
                    .lines()
                    .any(|l| l.contains("declared-unpooled") && l.contains(absent)),
                "{absent} for an unpooled policy"
            );
        }
    }

    #[test]
    fn the_text_format_holds_events_state_and_process() {
        let m = metrics();
        m.executions_of("unit-policy")
            .record(ExecOutcome::timeout, Duration::from_millis(1500));
        m.kernel_started(
            "unit-policy",
            "namespaces",
            StartSource::pool,
            Duration::from_millis(3),
        );
        m.denial("unit-policy", "package");
        let mut snapshot = Snapshot {
            pool_target: 2,
            ready: true,
            ..Snapshot::default()
        };
        snapshot.kernels.insert(
            KernelGroup {
                state: "busy",
                policy: "unit-policy".into(),
                backend: "gvisor",
            },
            4,
        );
        let text = render(&snapshot).unwrap();
        for line in [
            "cellgate_executions_total{policy=\"unit-policy\",outcome=\"timeout\"} 1",
            "cellgate_execution_seconds_bucket{policy=\"unit-policy\",outcome=\"timeout\",le=\"2.5\"} 1",
            "cellgate_execution_seconds_bucket{policy=\"unit-policy\",outcome=\"timeout\",le=\"1\"} 0",
            "cellgate_kernel_start_seconds_count{policy=\"unit-policy\",backend=\"namespaces\",source=\"pool\"} 1",
            "cellgate_denials_total{policy=\"unit-policy\",kind=\"package\"} 1",
            "cellgate_kernels{state=\"busy\",policy=\"unit-policy\",backend=\"gvisor\"} 4",
            "cellgate_pool_target 2",
            "cellgate_ready 1",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        // The outcomes a kernel resolved are exported at zero before the first of each.
        assert!(
            text.contains("cellgate_executions_total{policy=\"unit-policy\",outcome=\"oom\"} 0")
        );
        let rss = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .expect("rss exported");
        assert!(rss.parse::<i64>().unwrap() > 1 << 20, "{rss}");
        assert!(text.contains("process_open_fds "));
    }
}
