//! The HTTP and WebSocket surfaces. Handlers parse requests into calls on the kernel registry
//! and sessions and turn results into Kernel Gateway–shaped responses. *Invariant:* axum
//! types stop here; nothing below this module sees them.
//!
//! Layers, outermost first: the access log (`access_log.rs`), CORS (answers preflights
//! before anything else), the edge checks (`edge.rs`: JSON bodies, and loopback Host and
//! Origin without a token), auth (`auth.rs`), the replica middlewares (`replicas.rs`,
//! inside auth), then the routes. The JSON-body rule wraps each route's methods
//! (`json_only`), not the router, so a method a route does not take is a 405 with `Allow`
//! whatever its body; an unknown route is a 404 `no_such_route`, in the same error body as
//! every other answer (`api_error.rs`).
//!
//! *Invariants:*
//! - no request a page elsewhere can make without a preflight reaches a handler that parses
//!   JSON, and a gateway without a token answers no page outside loopback (DNS rebinding
//!   included);
//! - every handler takes `Extension<Principal>`; `auth::start_terms` gives a tenant's new
//!   kernel its owner, its policy (capped) and its kernel cap, and every kernel a request
//!   starts (REST, API v1 sessions, notebook replays on both surfaces) is started on the
//!   caller's terms: owned by the caller and counted against its cap, so no route starts a
//!   kernel that belongs to nobody;
//! - a tenant sees only what it owns: another tenant's kernel (REST or WebSocket) answers
//!   exactly as a missing id (`kernels::lookup_for`), never 403.
//!
//! The surfaces: the Kernel Gateway REST API (`kernels.rs`) and channels WebSocket
//! (`ws_upgrade.rs`, `kernel_ws.rs`), notebook export and replay (`notebooks.rs`), API v1
//! ([`v1`]), MCP (`mcp/`), the web client (`web.rs`), and the operator's probes and metrics
//! (`operations.rs`; with `--metrics-listen` also on an address of their own, bound before
//! any kernel starts, unauthenticated). `listener.rs` is the accept loop (timeouts and
//! connection caps), `client_addr.rs` says who a request came from, and with
//! `--replica-url` `replicas.rs` and `forward.rs` send a request to the replica that owns
//! its kernel.

mod access_log;
mod api_error;
mod auth;
pub mod client_addr;
mod edge;
mod error_code;
mod forward;
mod kernel_ws;
mod kernels;
pub mod listener;
mod mcp;
mod notebooks;
mod operations;
mod replicas;
mod state;
pub mod v1;
mod web;
mod ws_upgrade;

use std::sync::Arc;

use axum::http::{HeaderName, HeaderValue, Method};
use axum::routing::{get, post, MethodRouter};
use axum::{middleware, Router};
use tower_http::cors::{AllowOrigin, CorsLayer};

pub use api_error::ApiError;
pub use auth::{start_terms, Principal, StartTerms};
pub use error_code::ErrorCode;
pub use state::{AppState, StateError};

use crate::artifacts::links::LinkSigner;
use crate::config::GatewayConfig;
use crate::kernel::KernelManager;

/// The routes of the Kernel Gateway API (gateway-contract.md 1.2), under `base_url`.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/api", get(kernels::api_root))
        .route("/api/kernelspecs", get(kernels::list_kernelspecs))
        .route("/api/kernelspecs/{name}", get(kernels::get_kernelspec))
        .route(
            "/kernelspecs/{name}/{file}",
            get(kernels::kernelspec_resource),
        )
        .route(
            "/api/kernels",
            json_only(get(kernels::list_kernels).post(kernels::start_kernel)),
        )
        .route(
            "/api/kernels/{id}",
            get(kernels::get_kernel).delete(kernels::delete_kernel),
        )
        .route(
            "/api/kernels/{id}/interrupt",
            json_only(post(kernels::interrupt_kernel)),
        )
        .route(
            "/api/kernels/{id}/restart",
            json_only(post(kernels::restart_kernel)),
        )
        .route("/api/kernels/{id}/channels", get(kernel_ws::channels))
        // Prometheus, for the admin (a tenant's JWT gets 403).
        .merge(operations::metrics_route())
        // API v1 (chat apps and agents), behind the same auth layer.
        .merge(v1::routes())
        // API v1 as MCP tools (agent hosts), behind the same auth layer.
        .nest_service("/mcp", mcp::routes(state.clone()))
        // Notebook export and replay (cellgate extensions).
        .route(
            "/api/kernels/{id}/notebook",
            get(notebooks::export_kernel_notebook),
        )
        .route(
            "/api/notebooks/replay",
            json_only(post(notebooks::replay_notebook).layer(
                axum::extract::DefaultBodyLimit::max(notebooks::MAX_NOTEBOOK_BYTES),
            )),
        )
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        // Inside auth: only authenticated requests are forwarded or cost an API read.
        .layer(middleware::from_fn_with_state(
            state.clone(),
            replicas::route_to_owner,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            replicas::gather_listings,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            replicas::artifacts_anywhere,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        // Outside auth, whose 401s it completes: on /mcp they say where the OAuth metadata is.
        .layer(middleware::from_fn_with_state(
            state.clone(),
            mcp::oauth::challenge,
        ));
    // Signed artifact links are public routes, and held by one replica like any artifact.
    let public_v1 = v1::public_routes().layer(middleware::from_fn_with_state(
        state.clone(),
        replicas::artifacts_anywhere,
    ));
    let health = operations::probe_routes()
        .merge(public_v1)
        .merge(web::routes(&state.config.base_url));
    let routes = api.merge(health).with_state(state.clone());
    let routes = if state.config.base_url == "/" {
        routes
    } else {
        let prefix = state.config.base_url.trim_end_matches('/');
        Router::new()
            .nest(prefix, routes)
            .route(&format!("{prefix}/"), get(|| async { web::page() }))
            .fallback(no_route)
    };
    // At the root whatever the base URL: RFC 9728 puts the well-known prefix before the
    // resource's path. No credential: a host reads it before it has one.
    let routes = routes.merge(mcp::oauth::routes(&state));
    // Inside CORS, which answers preflights first; outside auth and the base URL, so every
    // route, the page included, is checked.
    let routes = routes.layer(middleware::from_fn_with_state(state.clone(), edge::check));
    let routes = match cors_layer(&state.config) {
        Some(cors) => routes.layer(cors),
        None => routes,
    };
    // Outermost: every answer is logged and counted, refusals of the layers above included.
    routes.layer(middleware::from_fn(access_log::access_log))
}

/// `route` with the JSON body rule ([`edge::require_json`]) on the methods it takes: every
/// route with a `POST` or `PATCH` handler is wrapped so. Not a router-wide route layer,
/// which would also wrap the 405 answer to a method the route does not take.
pub(crate) fn json_only(route: MethodRouter<AppState>) -> MethodRouter<AppState> {
    route.route_layer(middleware::from_fn(edge::require_json))
}

async fn no_route(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::no_route(&method, uri.path())
}

async fn wrong_method(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::wrong_method(&method, uri.path())
}

fn cors_layer(config: &GatewayConfig) -> Option<CorsLayer> {
    if config.allow_origin.is_empty() {
        return None;
    }
    let allow_origin = if config.allow_origin.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        // Normalised and checked by the config, so every one is a valid header value.
        AllowOrigin::list(
            config
                .allow_origin
                .iter()
                .filter_map(|o| HeaderValue::from_str(o).ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow_origin)
            .allow_methods([
                Method::GET,
                Method::POST,
                Method::DELETE,
                Method::PUT,
                Method::PATCH,
                Method::OPTIONS,
            ])
            .allow_headers([
                HeaderName::from_static("authorization"),
                HeaderName::from_static("content-type"),
                HeaderName::from_static("x-requested-with"),
            ]),
    )
}

/// The state a gateway keeps across restarts: its open store and what it held at start.
pub struct Persistence {
    pub store: Arc<crate::store::Store>,
    pub loaded: crate::store::Loaded,
}

/// The session layer of API v1. Artifacts live in the state directory when there is one (and
/// with the sessions it held, are taken back from its store), else beside the kernels'
/// runtime directories.
fn v1_sessions(
    config: &GatewayConfig,
    kernels: &Arc<KernelManager>,
    links: Option<LinkSigner>,
    persistence: Option<Persistence>,
) -> std::io::Result<Arc<crate::sessions::Sessions>> {
    let dir = match &persistence {
        Some(p) => p.store.dir().join("artifacts"),
        None => kernels.runtime_root().join("artifacts"),
    };
    let mut artifacts = crate::artifacts::ArtifactStore::new(dir, config.artifact_retention)
        .map_err(std::io::Error::other)?
        .with_min_free_disk(config.artifact_min_free_disk);
    let (store, loaded) = match persistence {
        Some(Persistence { store, loaded }) => {
            artifacts = artifacts.with_store(store.clone());
            (Some(store), loaded)
        }
        None => (None, crate::store::Loaded::default()),
    };
    artifacts.restore(loaded.artifacts);
    let sessions = crate::sessions::Sessions::with_store(
        kernels.clone(),
        Arc::new(artifacts),
        crate::sessions::SessionOptions {
            base_url: config.base_url.clone(),
            links: links.map(Arc::new),
            replay_bytes: config.event_replay_bytes,
            dormant_retention: config.dormant_retention,
            ..Default::default()
        },
        store,
    );
    sessions.restore(loaded.sessions);
    sessions.spawn_survivor_adoption();
    Ok(sessions)
}

/// The signer of artifact links (`crate::artifacts::links`), with the key from
/// `--artifact-link-key-file`, else derived from the token, else from the JWT HMAC secret,
/// else random; `None` when links are off (a zero TTL). Called before any kernel starts, so a
/// bad key file stops the gateway first.
pub fn link_signer(config: &GatewayConfig) -> std::io::Result<Option<LinkSigner>> {
    if config.artifact_link_ttl.is_zero() {
        return Ok(None);
    }
    let key = if let Some(path) = &config.artifact_link_key_file {
        let mut key = std::fs::read(path).map_err(|err| {
            std::io::Error::new(
                err.kind(),
                format!("artifact link key {}: {err}", path.display()),
            )
        })?;
        while matches!(key.last(), Some(b'\n' | b'\r')) {
            key.pop();
        }
        if key.len() < crate::artifacts::links::MIN_KEY_BYTES {
            return Err(std::io::Error::other(format!(
                "artifact link key {}: {} bytes; at least {} are required",
                path.display(),
                key.len(),
                crate::artifacts::links::MIN_KEY_BYTES
            )));
        }
        key
    } else if let Some(token) = &config.token {
        LinkSigner::derive_key(token.as_bytes())
    } else if let Some(path) = &config.jwt.secret_file {
        let secret = crate::jwt::read_secret(path).map_err(std::io::Error::other)?;
        LinkSigner::derive_key(&secret)
    } else {
        if config.jwt.enabled() {
            tracing::warn!("artifact links are signed with a random key: they stop working when the gateway restarts, and replicas refuse each other's (set --artifact-link-key-file)");
        }
        LinkSigner::random_key()
    };
    Ok(Some(LinkSigner::new(
        key,
        config.artifact_link_ttl,
        config.artifact_link_max_ttl,
    )))
}

/// Serves on `listener` (TCP_NODELAY on every connection, the timeouts and caps of
/// `listener.rs`) until `shutdown` resolves.
pub async fn serve(
    config: Arc<GatewayConfig>,
    kernels: Arc<KernelManager>,
    listener: tokio::net::TcpListener,
    metrics_listener: Option<tokio::net::TcpListener>,
    links: Option<LinkSigner>,
    persistence: Option<Persistence>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let quota_set = config.tenants.cpu_seconds_per_day.is_some()
        || config
            .tenants
            .limits
            .values()
            .any(|l| l.cpu_seconds_per_day.is_some());
    if quota_set && persistence.is_none() {
        tracing::warn!("cpu_seconds_per_day is set, but without a state directory (--state-dir none) there is no usage ledger to count it in: it is not enforced");
    }
    let sessions = v1_sessions(&config, &kernels, links, persistence)?;
    // Often enough for short retention periods, cheap at any size.
    let reap_every = (config.artifact_retention / 2).clamp(
        std::time::Duration::from_millis(250),
        std::time::Duration::from_secs(30),
    );
    sessions.spawn_reaper(reap_every);
    let limits = listener::ConnectionLimits::from_config(&config);
    let trusted = client_addr::TrustedProxies::new(&config.trusted_proxies);
    tracing::info!(
        header_read_timeout = ?limits.header_read_timeout,
        idle_connection_timeout = ?limits.idle_timeout,
        max_connections = limits.max_connections,
        max_connections_per_peer = limits.max_per_peer,
        trusted_proxies = ?config.trusted_proxies,
        "client connection limits"
    );
    for network in trusted.everything() {
        tracing::warn!(%network, "trusted_proxies holds every address: any client of that family can name itself whatever address it likes in X-Forwarded-For, and none is held to max_connections_per_peer; name the proxies' own addresses instead");
    }
    // Counters alerts watch exist at zero from the start (telemetry::metrics): the tenants
    // the settings name, under a request rate.
    for tenant in config.tenants.rate_limited_tenants() {
        crate::telemetry::metrics::metrics().declare_tenant(tenant);
    }
    // Kernels of replicas that are gone are taken over (nothing to do for a gateway alone).
    sessions.spawn_adopter();
    let state = AppState::new(config.clone(), kernels, sessions).map_err(std::io::Error::other)?;
    // The metrics listener stops with the main one.
    let (stopping, stop) = tokio::sync::watch::channel(false);
    if let Some(metrics_listener) = metrics_listener {
        let local = metrics_listener.local_addr()?;
        if !local.ip().is_loopback() {
            tracing::warn!(address = %local, "the metrics listener needs no credential and its metrics name tenants: keep its address reachable by the scraper only");
        }
        let app = operations::metrics_listener_router(state.clone(), local.ip().is_loopback())
            .layer(middleware::from_fn(access_log::access_log));
        let mut stop = stop.clone();
        tokio::spawn(listener::serve(
            metrics_listener,
            app,
            limits,
            trusted.clone(),
            async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            },
        ));
    }
    drop(stop);
    let shutdown = async move {
        shutdown.await;
        stopping.send_replace(true);
    };
    let kept = state.sessions.clone();
    listener::serve(listener, router(state), limits, trusted, shutdown).await;
    // Before the kernels are shut down: their sessions stay in the store.
    kept.close().await;
    Ok(())
}
