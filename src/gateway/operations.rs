//! What an operator's tooling asks the gateway: `/healthz` (liveness), `/readyz` (readiness)
//! and `/metrics` (Prometheus), on the main listener and, with `--metrics-listen`, on an
//! address of their own.
//!
//! - `/healthz` answers `ok` while the process serves requests: nothing is checked, so a
//!   busy host never gets a healthy gateway restarted.
//! - `/readyz` answers 200 only when the default policy's backend passed its last check
//!   (the checks of `cellgate doctor`, run in the background every [`CHECK_EVERY`], never on
//!   the request: with a probe sandbox at start and after a failure, the host's facts
//!   alone in between and always for microVMs, whose probe is a VM boot) and the warm pool
//!   has reached its
//!   target, with kernels in it or its last start succeeding; else 503. The other policies'
//!   backends are checked and reported as `degraded`, as the gateway's start treats them:
//!   one optional policy that cannot run here must not take every replica out of a load
//!   balancer. A pool that dips while it refills after a hand-out stays ready. The body
//!   says what is missing; its details (the doctor's words, the pool's last error, which
//!   name host paths) go only to the admin, the metrics listener, or a gateway without
//!   credentials (loopback only).
//! - `/metrics` needs the admin (the gateway's token; a tenant's JWT gets 403, as metrics
//!   cross tenants) on the main listener, and nothing on the metrics listener, which an
//!   operator binds to an address only the scraper reaches. Bound to loopback, that
//!   listener answers only loopback `Host` names (a DNS-rebinding page gets nothing).

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use serde::Serialize;

use super::{ApiError, AppState, Principal};
use crate::kernel::health::BackendCheck;
#[cfg(doc)]
use crate::kernel::health::CHECK_EVERY;
use crate::telemetry::metrics::{KernelGroup, Snapshot};

/// `/readyz`'s body.
#[derive(Debug, Serialize)]
pub struct ReadyReport {
    pub ready: bool,
    /// Why not, in words; empty when ready.
    pub waiting_for: Vec<String>,
    /// Other policies' backends that cannot launch kernels here (their kernels are
    /// refused; the gateway stays ready).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub degraded: Vec<String>,
    /// Each backend's last check (detailed answers only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backends: Option<BTreeMap<&'static str, BackendCheck>>,
    pub pool: PoolReport,
}

#[derive(Debug, Serialize)]
pub struct PoolReport {
    pub target: usize,
    pub ready: usize,
    pub starting: usize,
    pub filled: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// Whether the gateway is ready, and why not; `detailed`: with the doctor's words and the
/// pool's last error.
pub fn ready_report(state: &AppState, detailed: bool) -> ReadyReport {
    let mut waiting_for = Vec::new();
    let mut degraded = Vec::new();
    let default_backend = state
        .kernels
        .policies()
        .get("default")
        .map(|p| state.kernels.backend_of(p).as_str())
        .ok();
    let backends = match state.checks.last() {
        Some(backends) => backends,
        None => {
            waiting_for.push("the first check of the sandbox backends is running".to_owned());
            BTreeMap::new()
        }
    };
    for (name, check) in &backends {
        if check.ok {
            continue;
        }
        let why = if detailed {
            format!(": {}", check.problems.join("; "))
        } else {
            String::new()
        };
        let line = format!("sandbox backend {name} cannot launch kernels{why}");
        if Some(*name) == default_backend {
            waiting_for.push(line);
        } else {
            degraded.push(line);
        }
    }
    let pool = state.kernels.pool_status();
    if !pool.filled_once {
        waiting_for.push(format!(
            "the warm pool has not reached its target of {} kernels yet",
            pool.target
        ));
    }
    if let Some(err) = pool.last_error.as_ref().filter(|_| pool.ready == 0) {
        let why = if detailed {
            format!(": {err}")
        } else {
            String::new()
        };
        waiting_for.push(format!(
            "the warm pool is empty and its last kernel failed to start{why}"
        ));
    }
    ReadyReport {
        ready: waiting_for.is_empty(),
        waiting_for,
        degraded,
        backends: detailed.then_some(backends),
        pool: PoolReport {
            target: pool.target,
            ready: pool.ready,
            starting: pool.filling,
            filled: pool.filled_once,
            last_error: pool.last_error.filter(|_| detailed),
        },
    }
}

async fn healthz() -> &'static str {
    "ok"
}

/// `/readyz` on the main listener: details for the admin (or a gateway without
/// credentials, loopback only).
async fn readyz(State(state): State<AppState>, request: axum::extract::Request) -> Response {
    let open = state.config.token.is_none() && state.jwt.is_none();
    let admin = open
        || match (&state.config.token, super::auth::credential(&request)) {
            (Some(expected), Some(presented)) => super::auth::token_matches(expected, &presented),
            _ => false,
        };
    ready_answer(ready_report(&state, admin))
}

/// `/readyz` on the metrics listener: with details.
async fn readyz_detailed(State(state): State<AppState>) -> Response {
    ready_answer(ready_report(&state, true))
}

fn ready_answer(report: ReadyReport) -> Response {
    let status = if report.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, [(header::CACHE_CONTROL, "no-store")], Json(report)).into_response()
}

/// The gateway's state for the metrics.
fn snapshot(state: &AppState) -> Snapshot {
    let kernels = &state.kernels;
    let mut snapshot = Snapshot::default();
    // Every policy's states exist from the start, at zero: a dashboard's series do not
    // appear and vanish with the first and last kernel.
    for policy in kernels.policies().iter() {
        for s in [
            "starting",
            "idle",
            "busy",
            "restarting",
            "dead",
            "hibernated",
        ] {
            snapshot.kernels.insert(
                KernelGroup {
                    state: s,
                    policy: policy.name.clone(),
                    backend: kernels.backend_of(policy).as_str(),
                },
                0,
            );
        }
    }
    for kernel in kernels.list() {
        *snapshot
            .kernels
            .entry(KernelGroup {
                // Saved to disk: not a kernel in memory, counted apart.
                state: if kernel.is_hibernated() {
                    "hibernated"
                } else {
                    kernel.execution_state().as_str()
                },
                policy: kernel.policy.clone(),
                backend: kernel.backend().as_str(),
            })
            .or_default() += 1;
        if let Some(tenant) = kernel.owner() {
            *snapshot
                .tenant_kernels
                .entry(tenant.to_owned())
                .or_default() += 1;
        }
    }
    let pool = kernels.pool_status();
    snapshot.pool_ready = pool.ready as i64;
    snapshot.pool_target = pool.target as i64;
    let (count, bytes) = state.sessions.artifacts().totals();
    snapshot.artifacts = count as i64;
    snapshot.artifact_bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
    snapshot.ready = ready_report(state, false).ready;
    snapshot
}

fn render_metrics(state: &AppState) -> Response {
    match crate::telemetry::metrics::render(&snapshot(state)) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                crate::telemetry::metrics::CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(_) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode the metrics",
        )
        .into_response(),
    }
}

/// `/metrics` on the main listener: the admin only.
async fn metrics_for_admin(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
) -> Response {
    if principal != Principal::Admin {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "the metrics cover every tenant: scrape them with the gateway's token, or from --metrics-listen",
        )
        .into_response();
    }
    render_metrics(&state)
}

/// `/metrics` on the metrics listener.
async fn metrics_open(State(state): State<AppState>) -> Response {
    render_metrics(&state)
}

/// The probes, open to anyone (on the main listener under `base_url`).
pub fn probe_routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
}

/// `/metrics` behind the main listener's authentication.
pub fn metrics_route() -> Router<AppState> {
    Router::new().route("/metrics", get(metrics_for_admin))
}

/// The metrics listener's whole surface: probes and metrics, without authentication.
/// `loopback`: it is bound to a loopback address, so only loopback `Host` names are served.
pub fn metrics_listener_router(state: AppState, loopback: bool) -> Router {
    let router = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz_detailed))
        .route("/metrics", get(metrics_open))
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n") })
        .with_state(state);
    if loopback {
        router.layer(axum::middleware::from_fn(loopback_host_only))
    } else {
        router
    }
}

/// A page elsewhere whose name resolves to 127.0.0.1 (DNS rebinding) sends its own name as
/// `Host`: refused, as the main listener refuses it without a token.
async fn loopback_host_only(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    if !super::edge::is_loopback_host(host) {
        return (
            StatusCode::FORBIDDEN,
            "this listener answers loopback names only\n",
        )
            .into_response();
    }
    next.run(request).await
}
