//! cellgate's egress proxy: the only way out of a namespaces sandbox, a microVM or a
//! Kubernetes pod. gVisor and process kernels get no proxy and no proxy environment: they
//! have no network at all (deny-all).
//!
//! Each kernel generation gets its own unix socket listener (`egress.sock` in its runtime
//! directory, handed to the sandbox user; its path reaches the backend as
//! `LaunchSpec::egress_socket`), so the proxy knows which session a connection comes from
//! without trusting anything the sandbox says. Inside a namespaces sandbox a small bridge
//! (forked by the sandbox's init, see `sandbox::namespaces::bridge`) listens on
//! 127.0.0.1:3128 before the kernel exists and forwards each TCP connection to that socket;
//! in a microVM or a pod the agent carries the connections to that port over the agent link.
//! The bridge holds nothing the kernel lacks (the kernel could connect to the socket
//! itself), so a kernel that takes it over (same uid) gains nothing: the policy lives only
//! in the gateway.
//!
//! The kernel's environment ([`kernel_env`]): `HTTP(S)_PROXY` and `http(s)_proxy` pointing
//! at that port, `NO_PROXY` for loopback, `PIP_INDEX_URL` naming the package index (with
//! its trusted host, no input, no retries, no cache) and `PIP_PREFIX=<workspace>/.cellgate`,
//! whose site-packages is on `PYTHONPATH` (made by the init before Python starts: Python
//! caches a missing path entry for good), and `NPM_CONFIG_REGISTRY` naming the npm registry
//! (Deno's `npm:` imports, over plain HTTP through the proxy).
//!
//! The proxy ([`proxy`]) speaks HTTP/1.1: `CONNECT host:port` (TLS stays end to end) and
//! absolute-form requests (`GET http://host/…`). Every destination is checked against the
//! session policy's `[egress]` rules, resolved by the proxy itself and vetted
//! ([`resolve`]); requests for `packages.cellgate.internal` are answered by the package
//! index ([`packages`]) and those for `npm.cellgate.internal` by the npm registry
//! ([`packages::npm`]), whatever the egress rules say.
//!
//! *Invariants:*
//! - the session is known from the socket, never from what the sandbox says;
//! - what the allowlist approved is what the destination is asked for: no byte of a tunnel
//!   goes upstream before its ClientHello named the approved host ([`client_hello`]: SNI,
//!   no Encrypted Client Hello; no SNI only for an IP-literal target; not TLS: refused), and
//!   a plain request goes out with the approved `Host` (another or a second `Host`: 403), so
//!   allowing one name of a CDN opens no other (the `Host` inside TLS stays unseen);
//! - a session holds at most `egress_max_connections` (default 32) proxy connections; more
//!   are answered 429 at once, so one sandbox's flood costs others nothing;
//! - every decision is logged with the kernel id and the msg_id of the running execution;
//!   denials go to the [`DenialSink`] the listener was given (the kernel's router, which
//!   attaches them to that execution: [`Session::deny`]), so the proxy knows nothing of
//!   kernels.
//!
//! Must not depend on: HTTP gateway handlers, kernels.

pub mod client_hello;
pub mod packages;
pub mod proxy;
pub mod resolve;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::policy::{Denial, DenialKind, Policy};
use packages::npm::NpmRegistry;
use packages::PackageIndex;
pub use resolve::Resolver;

/// The address the in-sandbox bridge listens on.
pub const BRIDGE_ADDR: &str = "127.0.0.1:3128";
/// The host name under which the proxy serves the package index.
pub const INDEX_HOST: &str = "packages.cellgate.internal";
/// The host name under which the proxy serves the npm registry ([`packages::npm`]).
pub const NPM_HOST: &str = "npm.cellgate.internal";
/// The socket's name in a kernel generation's runtime directory.
pub const SOCKET_NAME: &str = "egress.sock";

/// Errors of the egress proxy.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("cannot listen on {path}: {source}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Gateway-wide settings of the proxy.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    pub resolver: Resolver,
    /// Proxy connections one session may hold at once; more are answered 429 at once, so a
    /// flood from one sandbox costs the others nothing.
    pub max_connections_per_session: usize,
}

impl Default for EgressConfig {
    fn default() -> Self {
        EgressConfig {
            resolver: Resolver::default(),
            max_connections_per_session: 32,
        }
    }
}

/// The proxy of a gateway: configuration and the package index and npm registry it serves.
pub struct Egress {
    pub config: EgressConfig,
    pub index: Arc<PackageIndex>,
    pub npm: Arc<NpmRegistry>,
}

/// Where the proxy reports what it refused: the kernel's executions (the kernel core
/// implements it), so that the proxy needs to know nothing of kernels.
pub trait DenialSink: Send + Sync {
    /// Attaches `denial` to the execution running now, if any.
    fn record_denial(&self, denial: Denial);
    /// The msg_id of the execution running now, for logs.
    fn current_execution(&self) -> Option<String>;
}

/// One kernel as the proxy sees it.
pub struct Session {
    pub kernel_id: String,
    pub policy: Arc<Policy>,
    sink: Arc<dyn DenialSink>,
    /// Packages state of this session (implicit dependencies, the last allowed project).
    pub packages: parking_lot::Mutex<packages::SessionPackages>,
    connections: Arc<Semaphore>,
}

impl Session {
    pub fn new(
        kernel_id: &str,
        policy: Arc<Policy>,
        sink: Arc<dyn DenialSink>,
        max: usize,
    ) -> Session {
        Session {
            kernel_id: kernel_id.to_owned(),
            policy,
            sink,
            packages: Default::default(),
            connections: Arc::new(Semaphore::new(max.max(1))),
        }
    }

    /// The execution running now, for logs.
    pub fn msg_id(&self) -> Option<String> {
        self.sink.current_execution()
    }

    /// Logs an allowed decision.
    pub fn allow(&self, kind: &'static str, target: &str, detail: &str) {
        tracing::info!(kernel_id = %self.kernel_id, msg_id = ?self.msg_id(), policy = %self.policy.name, kind, target, detail, "egress allowed");
    }

    /// Logs a denial and attaches it to the running execution (if any).
    pub fn deny(&self, kind: DenialKind, target: &str, reason: String) {
        tracing::warn!(kernel_id = %self.kernel_id, msg_id = ?self.msg_id(), policy = %self.policy.name, kind = kind.as_str(), target, %reason, "egress denied");
        crate::telemetry::metrics::metrics().denial(&self.policy.name, kind.as_str());
        self.sink.record_denial(Denial {
            kind,
            target: target.to_owned(),
            policy: self.policy.name.clone(),
            reason,
        });
    }
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A running listener; dropping it stops accepting (connections in flight finish).
pub struct Listener {
    task: JoinHandle<()>,
    pub path: PathBuf,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Egress {
    pub fn new(
        config: EgressConfig,
        index: Arc<PackageIndex>,
        npm: Arc<NpmRegistry>,
    ) -> Arc<Egress> {
        Arc::new(Egress { config, index, npm })
    }

    /// Opens the proxy socket of one kernel generation in `dir`.
    pub fn listen(
        self: &Arc<Self>,
        dir: &Path,
        kernel_id: &str,
        policy: Arc<Policy>,
        sink: Arc<dyn DenialSink>,
    ) -> Result<Listener, EgressError> {
        let path = dir.join(SOCKET_NAME);
        // A directory that outlives the gateway (a surviving sandbox's, see
        // `sandbox::namespaces::survival`) may hold an earlier gateway's socket.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(|source| EgressError::Listen {
            path: path.clone(),
            source,
        })?;
        let session = Arc::new(Session::new(
            kernel_id,
            policy,
            sink,
            self.config.max_connections_per_session,
        ));
        let egress = self.clone();
        let task = tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(err) => {
                        tracing::warn!(kernel_id = %session.kernel_id, %err, "egress accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let permit = session.connections.clone().try_acquire_owned();
                let (egress, session) = (egress.clone(), session.clone());
                tokio::spawn(async move {
                    match permit {
                        Ok(permit) => {
                            proxy::serve_connection(egress, session, stream, permit).await
                        }
                        Err(_) => proxy::refuse_busy(&session, stream).await,
                    }
                });
            }
        });
        Ok(Listener { task, path })
    }
}

/// The environment that points a kernel's HTTP clients, pip and Deno (npm) at the proxy,
/// the index and the npm registry.
/// pip installs with `--prefix <workspace>/.cellgate` (a venv has no user site, and
/// `--target` would ignore, and re-fetch, everything the kernel's environment already has);
/// that prefix's site-packages is on `PYTHONPATH` from the start, so `%pip install x` then
/// `import x` works in the same kernel. `kernel_dir` is the kernelspec's directory, whose
/// `.venv` tells the Python version of the site-packages path.
pub fn kernel_env(kernel_dir: &Path, workspace: &Path) -> Vec<(String, String)> {
    let prefix = workspace.join(".cellgate");
    let version = std::fs::read_dir(kernel_dir.join(".venv/lib"))
        .ok()
        .and_then(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .find(|n| n.starts_with("python3"))
        })
        .unwrap_or_else(|| "python3".to_owned());
    let site = prefix.join("lib").join(version).join("site-packages");
    let proxy = format!("http://{BRIDGE_ADDR}");
    let no_proxy = "localhost,127.0.0.1,::1".to_owned();
    let mut env = vec![];
    for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
        env.push((name.to_owned(), proxy.clone()));
    }
    env.push(("NO_PROXY".to_owned(), no_proxy.clone()));
    env.push(("no_proxy".to_owned(), no_proxy));
    env.push((
        "PIP_INDEX_URL".to_owned(),
        format!("http://{INDEX_HOST}/simple/"),
    ));
    env.push(("PIP_TRUSTED_HOST".to_owned(), INDEX_HOST.to_owned()));
    env.push(("PIP_NO_INPUT".to_owned(), "1".to_owned()));
    env.push(("PIP_RETRIES".to_owned(), "0".to_owned()));
    // A socket read timeout, not a deadline: denials are answered at once whatever it is,
    // and a large wheel the index is still fetching upstream must not time out.
    env.push(("PIP_TIMEOUT".to_owned(), "60".to_owned()));
    env.push(("PIP_DISABLE_PIP_VERSION_CHECK".to_owned(), "1".to_owned()));
    env.push(("PIP_NO_CACHE_DIR".to_owned(), "1".to_owned()));
    env.push(("PIP_PREFIX".to_owned(), prefix.display().to_string()));
    // Deno's `npm:` imports (and npm's installs) from the npm registry ([`NPM_HOST`]). Every
    // kernel gets it, as every kernel gets pip's: a Python or bash kernel may run deno or
    // npm too, and the variable opens nothing the policy does not list.
    env.push((
        "NPM_CONFIG_REGISTRY".to_owned(),
        format!("http://{NPM_HOST}/"),
    ));
    env.push(("PYTHONPATH".to_owned(), site.display().to_string()));
    env
}
