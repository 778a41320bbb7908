//! The gateway's settings: command line, environment (including Kernel Gateway's `KG_*`
//! names for drop-in use) and an optional TOML file, in that order of precedence; unknown
//! keys in the file are refused with their line.
//!
//! *Invariant:* every option has a `CELLGATE_*` variable (clap's `env`, so `--help` lists
//! it; `KG_*` names are read after it) and a file key; a unit test fails an option without
//! both. `main` drops empty `CELLGATE_*`/`KG_*` variables before parsing (empty means
//! unset). No token and no JWT key means loopback only. JWT settings hold paths, never
//! secrets.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use ipnet::{IpNet, Ipv4Net};
use serde::Deserialize;

use crate::jwt::JwtSettings;
use crate::sandbox::Backend;
use crate::tenants::TenantSettings;

/// Options of `cellgate serve`. Every option can also be set in the config file.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// Address to listen on (also KG_IP) [default: 127.0.0.1].
    #[arg(long, env = "CELLGATE_IP")]
    pub ip: Option<IpAddr>,
    /// Port to listen on; 0 picks a free one (also KG_PORT) [default: 8888].
    #[arg(long, env = "CELLGATE_PORT")]
    pub port: Option<u16>,
    /// Token clients must present (`Authorization: token T`, `Bearer T` or `?token=T`; also
    /// KG_AUTH_TOKEN). Without one, only loopback addresses are allowed.
    #[arg(long, env = "CELLGATE_AUTH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// TOML config file; command-line options and environment variables override it.
    #[arg(long, env = "CELLGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory of kernelspecs [default: ./kernels].
    #[arg(long, env = "CELLGATE_KERNELS_DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// Directory of policy files [default: ./policies].
    #[arg(long, env = "CELLGATE_POLICIES_DIR")]
    pub policies_dir: Option<PathBuf>,
    /// Kernelspec used when a request names none (also KG_DEFAULT_KERNEL_NAME)
    /// [default: python3].
    #[arg(long, env = "CELLGATE_DEFAULT_KERNEL_NAME")]
    pub default_kernel_name: Option<String>,
    /// Run every kernel in this sandbox backend, whatever its policy names: namespaces,
    /// gvisor, or process (no isolation, development only) [default: each policy's backend].
    #[arg(long, env = "CELLGATE_SANDBOX")]
    pub sandbox: Option<Backend>,
    /// Maximum number of kernels at once (also KG_MAX_KERNELS) [default: unlimited].
    #[arg(long, env = "CELLGATE_MAX_KERNELS")]
    pub max_kernels: Option<usize>,
    /// Cull kernels idle for this many seconds; 0 disables culling [default: 0].
    #[arg(long, env = "CELLGATE_CULL_IDLE_TIMEOUT")]
    pub cull_idle_timeout: Option<u64>,
    /// Seconds between culling passes (gateway and policy idle timeouts), as Jupyter's
    /// `cull_interval` [default: 300].
    #[arg(long, env = "CELLGATE_CULL_INTERVAL")]
    pub cull_interval: Option<u64>,
    /// Also cull idle kernels that have open connections [default: false].
    #[arg(long, env = "CELLGATE_CULL_CONNECTED", value_parser = clap::builder::BoolishValueParser::new())]
    pub cull_connected: Option<bool>,
    /// Ready kernels kept for the default kernelspec and policy, handed out on start; 0
    /// disables the pool [default: 1].
    #[arg(long, env = "CELLGATE_POOL_SIZE")]
    pub pool_size: Option<usize>,
    /// Kernelspecs the warm pool keeps `--pool-size` ready kernels of each, comma separated
    /// (e.g. `python3,deno`) [default: the default kernelspec].
    #[arg(long, env = "CELLGATE_POOL_KERNELS", value_delimiter = ',')]
    pub pool_kernels: Option<Vec<String>>,
    /// Fork namespaces-sandboxed kernels from a warm zygote (Python with ipykernel and the
    /// kernelspec's preload list imported, in a sandbox of its own) instead of starting each
    /// afresh: ready in tens of milliseconds, and a first chart without imports. A zygote
    /// that fails costs cold starts, never a session [default: true].
    #[arg(long, env = "CELLGATE_KERNEL_ZYGOTE", value_parser = clap::builder::BoolishValueParser::new())]
    pub kernel_zygote: Option<bool>,
    /// Kernels one zygote forks before a fresh one replaces it. Every kernel of one zygote
    /// shares its address-space layout and `str` hash seed (ARCHITECTURE.md, the zygote's
    /// invariant): fewer means less shared, at a zygote's start (~2-4 s of CPU) each time
    /// [default: 500].
    #[arg(long, env = "CELLGATE_KERNEL_ZYGOTE_MAX_FORKS", value_parser = clap::value_parser!(u32).range(1..))]
    pub kernel_zygote_max_forks: Option<u32>,
    /// Seconds one zygote serves before a fresh one replaces it (see
    /// --kernel-zygote-max-forks) [default: 3600].
    #[arg(long, env = "CELLGATE_KERNEL_ZYGOTE_MAX_AGE", value_parser = clap::value_parser!(u64).range(1..))]
    pub kernel_zygote_max_age: Option<u64>,
    /// Keep namespaces-sandboxed kernels running when the gateway stops or crashes, for the
    /// next gateway on the same state directory to adopt with their variables and files
    /// (needs a state directory; `false`: every kernel ends with the gateway) [default: true].
    #[arg(long, env = "CELLGATE_KERNELS_OUTLIVE_GATEWAY", value_parser = clap::builder::BoolishValueParser::new())]
    pub kernels_outlive_gateway: Option<bool>,
    /// Seconds a kernel that outlived its gateway waits for a gateway to adopt it before it
    /// ends itself [default: 300].
    #[arg(long, env = "CELLGATE_ORPHAN_GRACE", value_parser = clap::value_parser!(u64).range(1..))]
    pub orphan_grace: Option<u64>,
    /// Seconds a kernel may take to become ready (five times as long in a microVM under
    /// software emulation) [default: 60].
    #[arg(long, env = "CELLGATE_START_TIMEOUT")]
    pub start_timeout: Option<u64>,
    /// An origin (`https://app.example:8443`) whose pages may call the gateway: answered
    /// with CORS headers and let through the WebSocket and no-token origin checks. Repeatable
    /// or comma separated; `*` allows every origin and needs a token or JWT keys (also
    /// KG_ALLOW_ORIGIN).
    #[arg(long, env = "CELLGATE_ALLOW_ORIGIN", value_delimiter = ',')]
    pub allow_origin: Vec<String>,
    /// Environment variable names clients may pass to kernels besides KERNEL_*, comma
    /// separated (also KG_ENV_WHITELIST).
    #[arg(long, env = "CELLGATE_ENV_ALLOWLIST", value_delimiter = ',')]
    pub env_allowlist: Option<Vec<String>>,
    /// Largest WebSocket message accepted from a client, in MiB [default: 64].
    #[arg(long, env = "CELLGATE_MAX_MESSAGE_MIB")]
    pub max_message_mib: Option<usize>,
    /// Directory for kernels' private runtime directories [default: a fresh one under $TMPDIR].
    #[arg(long, env = "CELLGATE_RUNTIME_DIR")]
    pub runtime_dir: Option<PathBuf>,
    /// Directory of the gateway's state, kept across restarts: its sessions, their history
    /// and artifacts, the usage ledger (an SQLite database, and the artifacts' files). One
    /// gateway per directory; `none` keeps everything in memory and under the runtime
    /// directory, gone when the gateway stops [default: $XDG_STATE_HOME/cellgate, else
    /// ~/.local/state/cellgate, else ./cellgate-state].
    #[arg(long, env = "CELLGATE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Days the usage ledger (in the state directory) keeps a row; older rows are deleted at
    /// start and daily; 0 keeps them for ever [default: 90].
    #[arg(long, env = "CELLGATE_USAGE_RETENTION_DAYS")]
    pub usage_retention_days: Option<u32>,
    /// The longest a session the gateway took back after a restart (dormant: its kernel
    /// lost) is kept after its last activity, e.g. 7d; its policy's idle timeout and lifetime
    /// end it sooner, as they would have ended its kernel; 0s for no bound beyond the
    /// policy's [default: 7d].
    #[arg(long, env = "CELLGATE_DORMANT_RETENTION", value_parser = crate::policy::parse_duration)]
    pub dormant_retention: Option<Duration>,
    /// Path prefix of every route (also KG_BASE_URL) [default: /].
    #[arg(long, env = "CELLGATE_BASE_URL")]
    pub base_url: Option<String>,
    /// The origin clients reach the gateway at (scheme, host, optional port; e.g.
    /// https://cellgate.example.com when TLS ends at a proxy in front), for where the gateway
    /// names itself in full: /mcp's OAuth metadata [default: http:// and each request's Host].
    // This text is `--help` too, where markup around the URL would be printed as is.
    #[allow(rustdoc::bare_urls)]
    #[arg(long, env = "CELLGATE_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// Also serve /metrics, /healthz and /readyz, without authentication, on this address
    /// (e.g. 127.0.0.1:9464, an address only the scraper reaches) [default: none: /metrics
    /// is served on the main listener, to the gateway's token only].
    #[arg(long, env = "CELLGATE_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Serve as one of several replicas on Kubernetes: the URL the other replicas reach this
    /// one at (e.g. http://$(POD_IP):8888). Kernel ownership goes in Leases in the gateway's
    /// namespace, requests for another replica's kernel are forwarded to it, and the kernels
    /// of a replica that is gone are taken over [default: none: a single gateway].
    #[arg(long, env = "CELLGATE_REPLICA_URL")]
    pub replica_url: Option<String>,
    /// This replica's name among replicas (its pod's name) [default: the host name].
    #[arg(long, env = "CELLGATE_REPLICA_ID")]
    pub replica_id: Option<String>,
    // --- egress proxy and package index (src/egress, src/packages) ---
    /// Upstream simple index (PEP 691 JSON) the package index serves from
    /// [default: https://pypi.org/simple].
    // This text is `--help` too, where markup around the URL would be printed as is.
    #[allow(rustdoc::bare_urls)]
    #[arg(long, env = "CELLGATE_PACKAGE_INDEX")]
    pub package_index: Option<String>,
    /// Upstream npm registry the npm registry (Deno's `npm:` imports) serves from
    /// [default: https://registry.npmjs.org].
    #[allow(rustdoc::bare_urls)]
    #[arg(long, env = "CELLGATE_NPM_REGISTRY")]
    pub npm_registry: Option<String>,
    /// Serve packages from this directory of wheels and sdists instead (offline mode).
    #[arg(long, env = "CELLGATE_WHEELHOUSE")]
    pub wheelhouse: Option<PathBuf>,
    /// Shared cache of downloaded package files [default: ~/.cache/cellgate/packages].
    #[arg(long, env = "CELLGATE_PACKAGE_CACHE_DIR")]
    pub package_cache_dir: Option<PathBuf>,
    /// Proxy connections (egress and package index) one kernel may hold at once
    /// [default: 32].
    #[arg(long, env = "CELLGATE_EGRESS_MAX_CONNECTIONS")]
    pub egress_max_connections: Option<usize>,
    /// Seconds an API v1 session's artifacts stay fetchable after the session ended
    /// [default: 3600].
    #[arg(long, env = "CELLGATE_ARTIFACT_RETENTION")]
    pub artifact_retention: Option<u64>,
    /// How long the signed link in each artifact reference works (a URL a page can put in
    /// `<img src>` with no credential), e.g. 1h; 0s for no signed links [default: 1h].
    #[arg(long, env = "CELLGATE_ARTIFACT_LINK_TTL", value_parser = crate::policy::parse_duration)]
    pub artifact_link_ttl: Option<Duration>,
    /// The longest a client may ask one signed link to work
    /// (`POST /v1/artifacts/{id}/links`) [default: 7d].
    #[arg(long, env = "CELLGATE_ARTIFACT_LINK_MAX_TTL", value_parser = crate::policy::parse_duration)]
    pub artifact_link_max_ttl: Option<Duration>,
    /// File holding the key that signs artifact links (at least 32 bytes; replicas behind
    /// one address share it) [default: derived from the token, else from the JWT secret,
    /// else random at each start].
    #[arg(long, env = "CELLGATE_ARTIFACT_LINK_KEY_FILE")]
    pub artifact_link_key_file: Option<PathBuf>,
    // --- client connections (src/gateway/listener.rs) ---
    /// Time a client has to send a request's headers, from their first byte (from the
    /// connection's opening for its first request); past it the connection is closed
    /// (e.g. 5s, 500ms) [default: 5s].
    #[arg(long, env = "CELLGATE_HEADER_READ_TIMEOUT", value_parser = crate::policy::parse_duration)]
    pub header_read_timeout: Option<Duration>,
    /// Time a keep-alive connection may wait for its next request before it is closed;
    /// requests in flight and WebSockets are never idle [default: 60s].
    #[arg(long, env = "CELLGATE_IDLE_CONNECTION_TIMEOUT", value_parser = crate::policy::parse_duration)]
    pub idle_connection_timeout: Option<Duration>,
    /// Time a request's body may stall while the gateway waits for it (an upload, a JSON
    /// body) before the connection is closed; a body that keeps coming is never cut
    /// [default: 30s].
    #[arg(long, env = "CELLGATE_BODY_READ_TIMEOUT", value_parser = crate::policy::parse_duration)]
    pub body_read_timeout: Option<Duration>,
    /// Client connections open at once, WebSockets included; past it new ones get 503
    /// [default: half the open-file limit, at most 65536].
    #[arg(long, env = "CELLGATE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Client connections one IP address may hold at once; past it its new ones get 503.
    /// Trusted proxies (--trusted-proxy) are not held to it [default: 256].
    #[arg(long, env = "CELLGATE_MAX_CONNECTIONS_PER_PEER")]
    pub max_connections_per_peer: Option<usize>,
    /// A reverse proxy in front of the gateway, as an IP address or a network (10.0.0.0/8,
    /// fd00::/8); repeatable or comma separated. For a connection from one, the client's
    /// address is taken from X-Forwarded-For (the rightmost address that is not itself a
    /// trusted proxy) for the access log, and the connection is not held to
    /// --max-connections-per-peer [default: none: X-Forwarded-For is ignored].
    #[arg(
        long = "trusted-proxy",
        env = "CELLGATE_TRUSTED_PROXIES",
        value_delimiter = ','
    )]
    pub trusted_proxies: Vec<String>,
    /// Free disk the artifact store keeps under it, such as 2GiB: below it, retained
    /// artifacts of deleted sessions go first, then new ones are refused; 0B for no minimum
    /// [default: 1GiB].
    #[arg(long, env = "CELLGATE_ARTIFACT_MIN_FREE_DISK", value_parser = crate::policy::units::parse_size)]
    pub artifact_min_free_disk: Option<u64>,
    /// Bytes of each API v1 session's newest events kept for clients that resume a dropped
    /// stream (`Last-Event-ID`, the WebSocket's `last_event_id`), such as 4MiB; past it the
    /// oldest go, and a client resuming from before them is told which it missed
    /// [default: 4MiB].
    #[arg(long, env = "CELLGATE_EVENT_REPLAY_BYTES", value_parser = crate::policy::units::parse_size)]
    pub event_replay_bytes: Option<u64>,
    #[command(flatten)]
    pub auth: AuthArgs,
    #[command(flatten)]
    pub microvm: MicrovmArgs,
}

/// The microvm backend's options (`cellgate serve`, `doctor` and `notebook replay`).
#[derive(Debug, Clone, Default, Args)]
pub struct MicrovmArgs {
    /// Where the microVM guest's kernel and images are (`guest.json` inside; `./dev setup`
    /// builds them) [default: guest/ beside the binary's directory, e.g. target/guest].
    #[arg(long, env = "CELLGATE_GUEST_DIR")]
    pub guest_dir: Option<PathBuf>,
    /// Serve microVMs under software emulation (TCG) when this host has no usable KVM:
    /// functional, ~50x slower for Python; for tests and development.
    #[arg(long, env = "CELLGATE_MICROVM_ALLOW_EMULATION", value_parser = clap::builder::BoolishValueParser::new())]
    pub microvm_allow_emulation: bool,
    /// Restore sessions' microVMs from warm-pool snapshots (a VM with Python and ipykernel
    /// imported, made once per kind of VM in the background) instead of booting each one
    /// [default: true].
    #[arg(long, env = "CELLGATE_MICROVM_SNAPSHOTS", value_parser = clap::builder::BoolishValueParser::new())]
    pub microvm_snapshots: Option<bool>,
    /// Where the warm-pool snapshots are kept [default: snapshots/ in the guest directory].
    #[arg(long, env = "CELLGATE_MICROVM_SNAPSHOT_DIR")]
    pub microvm_snapshot_dir: Option<PathBuf>,
    /// Import the kernelspec's preload list (`CELLGATE_PRELOAD` in its kernel.json: numpy,
    /// pandas, matplotlib, seaborn by default) into warm-pool snapshots under emulation too. With KVM
    /// they always hold it; under TCG the imports cost ~40 s per kind of VM and every
    /// restored VM is larger, so by default emulated VMs import the list at their first use
    /// instead [default: false].
    #[arg(long, env = "CELLGATE_MICROVM_PRELOAD_UNDER_EMULATION", value_parser = clap::builder::BoolishValueParser::new())]
    pub microvm_preload_under_emulation: Option<bool>,
    /// An operator's own guest kernel for microVMs (an uncompressed vmlinux), instead of the
    /// one ./dev setup builds: for example a PVM guest on a host whose KVM is PVM-only.
    #[arg(long, env = "CELLGATE_GUEST_VMLINUX")]
    pub guest_kernel: Option<PathBuf>,
    /// The --guest-kernel is a PVM guest (CELLGATE_GUEST_PVM=1).
    #[arg(long, env = "CELLGATE_GUEST_PVM", value_parser = clap::builder::BoolishValueParser::new(), requires = "guest_kernel")]
    pub guest_kernel_pvm: bool,
}

/// The microvm settings a config file may hold (keys of the same names).
#[derive(Debug, Clone, Default)]
pub struct MicrovmFileSettings {
    pub guest_dir: Option<PathBuf>,
    pub microvm_allow_emulation: Option<bool>,
    pub microvm_snapshots: Option<bool>,
    pub microvm_snapshot_dir: Option<PathBuf>,
    pub microvm_preload_under_emulation: Option<bool>,
    pub guest_kernel: Option<PathBuf>,
    pub guest_kernel_pvm: Option<bool>,
}

impl MicrovmArgs {
    /// The backend's settings: these options, then the config file's, then the defaults.
    pub fn config(&self, file: MicrovmFileSettings) -> crate::sandbox::MicrovmConfig {
        let mut config = crate::sandbox::MicrovmConfig::default();
        if let Some(dir) = self.guest_dir.clone().or(file.guest_dir) {
            config.guest_dir = dir;
        }
        config.allow_emulation =
            self.microvm_allow_emulation || file.microvm_allow_emulation == Some(true);
        if let Some(on) = self.microvm_snapshots.or(file.microvm_snapshots) {
            config.snapshots = on;
        }
        config.snapshot_dir = self
            .microvm_snapshot_dir
            .clone()
            .or(file.microvm_snapshot_dir);
        config.preload_under_emulation = self
            .microvm_preload_under_emulation
            .or(file.microvm_preload_under_emulation)
            .unwrap_or(false);
        config.guest_kernel = self.guest_kernel.clone().or(file.guest_kernel);
        config.guest_kernel_pvm = self.guest_kernel_pvm || file.guest_kernel_pvm == Some(true);
        config
    }
}

/// JWT and tenant options of `cellgate serve` (also read by `cellgate token`).
#[derive(Debug, Clone, Default, Args)]
pub struct AuthArgs {
    /// File holding the HS256 secret of tenants' JWTs (at least 32 bytes).
    #[arg(long, env = "CELLGATE_JWT_SECRET_FILE")]
    pub jwt_secret_file: Option<PathBuf>,
    /// PEM file of a public key (RSA, EC or Ed25519) that signs tenants' JWTs; repeatable
    /// (comma separated in the variable).
    #[arg(
        long = "jwt-public-key",
        env = "CELLGATE_JWT_PUBLIC_KEYS",
        value_delimiter = ','
    )]
    pub jwt_public_keys: Vec<PathBuf>,
    /// JWKS file of public keys that sign tenants' JWTs.
    #[arg(long, env = "CELLGATE_JWKS_FILE")]
    pub jwks_file: Option<PathBuf>,
    /// Issuer (`iss`) tenants' JWTs must name.
    #[arg(long, env = "CELLGATE_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// Audience (`aud`) tenants' JWTs must name.
    #[arg(long, env = "CELLGATE_JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
    /// Seconds of clock skew allowed on JWTs' `exp` and `nbf` [default: 30].
    #[arg(long, env = "CELLGATE_JWT_LEEWAY_S")]
    pub jwt_leeway_s: Option<u64>,
    /// Live kernels (and sessions) per tenant (config file: `[tenants] max_kernels`)
    /// [default: unlimited].
    #[arg(long, env = "CELLGATE_TENANT_MAX_KERNELS")]
    pub tenant_max_kernels: Option<usize>,
    /// Open MCP sessions per tenant (config file: `[tenants] max_mcp_sessions`)
    /// [default: 100].
    #[arg(long, env = "CELLGATE_TENANT_MAX_MCP_SESSIONS")]
    pub tenant_max_mcp_sessions: Option<usize>,
    /// Sustained requests per second per tenant (config file: `[tenants] rate`)
    /// [default: unlimited].
    #[arg(long, env = "CELLGATE_TENANT_RATE")]
    pub tenant_rate: Option<f64>,
    /// Requests a tenant may make at once before its rate applies (config file:
    /// `[tenants] burst`) [default: the rate].
    #[arg(long, env = "CELLGATE_TENANT_BURST")]
    pub tenant_burst: Option<u32>,
    /// CPU seconds of executions per tenant per UTC day, counted in the usage ledger (needs a
    /// state directory; config file: `[tenants] cpu_seconds_per_day`) [default: unlimited].
    #[arg(long, env = "CELLGATE_TENANT_CPU_SECONDS_PER_DAY")]
    pub tenant_cpu_seconds_per_day: Option<u64>,
    /// Sessions (kernels) a tenant may run at once, as a quota answered 429
    /// `quota_exceeded` (config file: `[tenants] concurrent_sessions`) [default: unlimited].
    #[arg(long, env = "CELLGATE_TENANT_CONCURRENT_SESSIONS")]
    pub tenant_concurrent_sessions: Option<usize>,
    /// Hibernated sessions' bytes a tenant may keep on disk (`4GiB`, or a number of bytes):
    /// a save past it is not made, the session stays running (config file: `[tenants]
    /// hibernated_storage`) [default: unlimited].
    #[arg(long, env = "CELLGATE_TENANT_HIBERNATED_STORAGE", value_parser = crate::units::parse_size_or_bytes)]
    pub tenant_hibernated_storage: Option<u64>,
    /// Policies from least to most permissive, comma separated: a tenant capped at P may
    /// use P and those before it (config file: `[tenants] policy_order`) [default: only P].
    #[arg(long, env = "CELLGATE_POLICY_ORDER", value_delimiter = ',')]
    pub policy_order: Option<Vec<String>>,
}

/// The config file. Unknown keys are errors, reported with their line.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    ip: Option<IpAddr>,
    port: Option<u16>,
    token: Option<String>,
    kernels_dir: Option<PathBuf>,
    policies_dir: Option<PathBuf>,
    default_kernel_name: Option<String>,
    sandbox: Option<Backend>,
    max_kernels: Option<usize>,
    cull_idle_timeout: Option<u64>,
    cull_interval: Option<u64>,
    cull_connected: Option<bool>,
    start_timeout: Option<u64>,
    pool_size: Option<usize>,
    pool_kernels: Option<Vec<String>>,
    kernel_zygote: Option<bool>,
    kernel_zygote_max_forks: Option<u32>,
    kernel_zygote_max_age: Option<u64>,
    kernels_outlive_gateway: Option<bool>,
    orphan_grace: Option<u64>,
    allow_origin: Option<OneOrMany>,
    env_allowlist: Option<Vec<String>>,
    max_message_mib: Option<usize>,
    runtime_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    usage_retention_days: Option<u32>,
    #[serde(default, with = "crate::policy::units::serde_duration")]
    dormant_retention: Option<Duration>,
    base_url: Option<String>,
    public_url: Option<String>,
    jwt_secret_file: Option<PathBuf>,
    #[serde(default)]
    jwt_public_keys: Vec<PathBuf>,
    jwks_file: Option<PathBuf>,
    jwt_issuer: Option<String>,
    jwt_audience: Option<String>,
    jwt_leeway_s: Option<u64>,
    #[serde(default)]
    tenants: TenantSettings,
    package_index: Option<String>,
    npm_registry: Option<String>,
    wheelhouse: Option<PathBuf>,
    package_cache_dir: Option<PathBuf>,
    /// Names the egress proxy resolves without DNS (tests map names to loopback servers).
    #[serde(default)]
    egress_hosts: std::collections::BTreeMap<String, IpAddr>,
    egress_max_connections: Option<usize>,
    metrics_listen: Option<std::net::SocketAddr>,
    replica_url: Option<String>,
    replica_id: Option<String>,
    artifact_retention: Option<u64>,
    #[serde(default, with = "crate::policy::units::serde_duration")]
    artifact_link_ttl: Option<Duration>,
    #[serde(default, with = "crate::policy::units::serde_duration")]
    artifact_link_max_ttl: Option<Duration>,
    artifact_link_key_file: Option<PathBuf>,
    guest_dir: Option<PathBuf>,
    microvm_allow_emulation: Option<bool>,
    microvm_snapshots: Option<bool>,
    microvm_snapshot_dir: Option<PathBuf>,
    microvm_preload_under_emulation: Option<bool>,
    guest_kernel: Option<PathBuf>,
    guest_kernel_pvm: Option<bool>,
    #[serde(default, with = "crate::policy::units::serde_duration")]
    header_read_timeout: Option<Duration>,
    #[serde(default, with = "crate::policy::units::serde_duration")]
    idle_connection_timeout: Option<Duration>,
    #[serde(default, with = "crate::policy::units::serde_duration")]
    body_read_timeout: Option<Duration>,
    max_connections: Option<usize>,
    max_connections_per_peer: Option<usize>,
    trusted_proxies: Option<OneOrMany>,
    #[serde(default, with = "crate::policy::units::serde_size")]
    artifact_min_free_disk: Option<u64>,
    #[serde(default, with = "crate::policy::units::serde_size")]
    event_replay_bytes: Option<u64>,
}

/// Resolved settings of a running gateway.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub ip: IpAddr,
    pub port: u16,
    pub token: Option<String>,
    pub kernels_dir: PathBuf,
    pub policies_dir: PathBuf,
    pub default_kernel_name: Option<String>,
    /// A backend forced on every kernel; `None`: each policy's own.
    pub sandbox: Option<Backend>,
    pub max_kernels: Option<usize>,
    pub cull_idle_timeout: Option<Duration>,
    pub cull_interval: Duration,
    pub cull_connected: bool,
    pub start_timeout: Duration,
    pub pool_size: usize,
    /// The kernelspecs the pool keeps (empty: the default kernelspec).
    pub pool_kernels: Vec<String>,
    /// Whether namespaces kernels fork from a zygote.
    pub kernel_zygote: bool,
    /// Kernels one zygote forks, and how long it serves, before a fresh one replaces it.
    pub kernel_zygote_max_forks: u32,
    pub kernel_zygote_max_age: Duration,
    /// Whether namespaces kernels outlive the gateway (only with a state directory).
    pub kernels_outlive_gateway: bool,
    /// How long a kernel that outlived its gateway waits to be adopted.
    pub orphan_grace: Duration,
    /// Origins allowed to call the gateway from a browser (`*`: any), normalised.
    pub allow_origin: Vec<String>,
    pub env_allowlist: Vec<String>,
    pub max_message_bytes: usize,
    pub runtime_dir: Option<PathBuf>,
    /// The state directory (`crate::store`); `None`: nothing outlives the process.
    pub state_dir: Option<PathBuf>,
    /// Days the usage ledger keeps a row (0: for ever).
    pub usage_retention_days: u32,
    /// The longest a dormant session is kept after its last activity (`None`: its policy's
    /// rules alone).
    pub dormant_retention: Option<Duration>,
    /// Always starts and ends with `/`.
    pub base_url: String,
    /// `scheme://host[:port]`, lower case, no trailing slash; `None`: taken from each
    /// request.
    pub public_url: Option<String>,
    /// JWT keys (paths only: secrets are read when the gateway starts and never kept here).
    pub jwt: JwtSettings,
    pub tenants: TenantSettings,
    /// Upstream simple index; ignored when `wheelhouse` is set.
    pub package_index: String,
    /// Upstream npm registry (always upstream: there is no offline npm source).
    pub npm_registry: String,
    pub wheelhouse: Option<PathBuf>,
    pub package_cache_dir: PathBuf,
    /// Static host map of the egress proxy's resolver (file only).
    pub egress_hosts: std::collections::BTreeMap<String, IpAddr>,
    /// Proxy connections one kernel may hold at once.
    pub egress_max_connections: usize,
    /// A second listener for /metrics and the probes, without authentication.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// This gateway's name and URL among replicas on Kubernetes, when it has others.
    pub replica: Option<ReplicaConfig>,
    /// How long artifacts outlive their API v1 session.
    pub artifact_retention: Duration,
    /// How long the signed link in an artifact reference works; zero: no links.
    pub artifact_link_ttl: Duration,
    /// The longest one link asked for may work.
    pub artifact_link_max_ttl: Duration,
    /// The links' key (a path only: read when the gateway starts, never kept here).
    pub artifact_link_key_file: Option<PathBuf>,
    /// How long a request's head may take to arrive, from its first byte.
    pub header_read_timeout: Duration,
    /// How long a keep-alive connection may wait for its next request.
    pub idle_connection_timeout: Duration,
    /// How long a request's body may stall while a handler waits for it.
    pub body_read_timeout: Duration,
    /// Client connections at once; `None`: derived from the open-file limit when serving.
    pub max_connections: Option<usize>,
    /// Client connections at once from one IP address (trusted proxies excepted).
    pub max_connections_per_peer: usize,
    /// Networks of the reverse proxies whose `X-Forwarded-For` is believed, host bits
    /// cleared, IPv4-mapped networks as IPv4 ones (peers are compared in that form).
    pub trusted_proxies: Vec<IpNet>,
    /// Free bytes the artifact store keeps on its disk (0: no minimum).
    pub artifact_min_free_disk: u64,
    /// Bytes of each API v1 session's newest events kept for clients that resume.
    pub event_replay_bytes: usize,
    /// The microvm backend's settings.
    pub microvm: crate::sandbox::MicrovmConfig,
}

/// The artifact store's default minimum of free disk.
pub const DEFAULT_ARTIFACT_MIN_FREE_DISK: u64 = 1 << 30;

/// This gateway's place among replicas on Kubernetes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// Its name (the holder of its Lease); unique among the replicas.
    pub id: String,
    /// Where the other replicas reach it, without a trailing slash.
    pub url: String,
}

/// The replica settings: none without a URL; the id defaults to the host name (a pod's
/// name, which is unique in its namespace).
fn replica_config(
    url: Option<String>,
    id: Option<String>,
) -> Result<Option<ReplicaConfig>, ConfigError> {
    let Some(url) = url else {
        return match id {
            Some(_) => Err(ConfigError::ReplicaIdAlone),
            None => Ok(None),
        };
    };
    let trimmed = url.trim_end_matches('/');
    let valid = ["http://"].iter().any(|scheme| {
        trimmed
            .strip_prefix(scheme)
            .is_some_and(|rest| !rest.is_empty() && !rest.contains(['/', '?', '#', '@', ' ']))
    });
    if !valid {
        return Err(ConfigError::BadReplicaUrl(url));
    }
    let id = id.filter(|id| !id.trim().is_empty()).unwrap_or_else(|| {
        rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned()
    });
    Ok(Some(ReplicaConfig {
        id,
        url: trimmed.to_owned(),
    }))
}

/// Errors in settings.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("environment variable {name}: {message}")]
    Env { name: &'static str, message: String },
    #[error("refusing to listen on {ip} without a token: set --token or CELLGATE_AUTH_TOKEN (or JWT keys: --jwt-secret-file, --jwt-public-key, --jwks-file), or listen on a loopback address")]
    TokenRequired { ip: IpAddr },
    #[error("allow_origin {0:?}: expected `*` or an origin such as https://app.example or http://127.0.0.1:8080 (scheme and host, an optional port, no path)")]
    BadOrigin(String),
    #[error("allow_origin `*` would let any web page drive a gateway that has no token: set --token (or JWT keys), or name the origins allowed")]
    AnyOriginWithoutToken,
    #[error("base_url {0:?} must be a path")]
    BadBaseUrl(String),
    #[error("public_url {0:?}: expected an origin such as https://cellgate.example.com (http or https, a host, an optional port, no path)")]
    BadPublicUrl(String),
    #[error("replica_url {0:?}: expected http://, a host and an optional port, no path (the address other replicas reach this one at on the cluster network)")]
    BadReplicaUrl(String),
    #[error("replica_id needs replica_url: a replica must say where the others reach it")]
    ReplicaIdAlone,
    #[error("env_allowlist names {0}, which no client may set: the sandbox and the kernel's start rely on it (policies/README.md, [environment])")]
    ReservedEnv(String),
    #[error("trusted_proxies {0:?}: expected an IP address (10.0.0.7, ::1) or a network in CIDR notation (10.0.0.0/8, fd00::/8)")]
    BadTrustedProxy(String),
    #[error("{name} = 0 would {consequence}: give at least {least}")]
    Zero {
        name: &'static str,
        consequence: &'static str,
        least: &'static str,
    },
    #[error(transparent)]
    Tenants(#[from] crate::tenants::TenantError),
}

/// A config-file value that may be one string or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(one) => one.split(',').map(str::to_owned).collect(),
            OneOrMany::Many(many) => many,
        }
    }
}

/// `*`, or an origin as browsers send it (`scheme://host[:port]`, lower case, no trailing
/// slash), so comparisons with the `Origin` header are exact.
fn normalise_origin(origin: &str) -> Result<String, ConfigError> {
    if origin == "*" {
        return Ok(origin.to_owned());
    }
    let bad = || ConfigError::BadOrigin(origin.to_owned());
    let lower = origin.trim_end_matches('/').to_ascii_lowercase();
    let (scheme, rest) = lower.split_once("://").ok_or_else(bad)?;
    let host_ok = !rest.is_empty()
        && !rest.contains(['/', '?', '#', '@', ' '])
        && rest
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-.:[]_".contains(c));
    if !matches!(scheme, "http" | "https") || !host_ok {
        return Err(bad());
    }
    Ok(lower)
}

/// A trusted proxy's address (a network of one) or network. An IPv4-mapped IPv6 network
/// (`::ffff:10.0.0.0/104`) becomes its IPv4 network, since a peer's address is compared in
/// its canonical form (an IPv4 client of a dual-stack listener as IPv4). Host bits are
/// cleared (`10.1.2.3/8` is `10.0.0.0/8`), as most tools read such a value.
fn trusted_network(value: &str) -> Result<IpNet, ConfigError> {
    let bad = || ConfigError::BadTrustedProxy(value.to_owned());
    let net = match value.parse::<IpNet>() {
        Ok(net) => net,
        Err(_) => IpNet::from(value.parse::<IpAddr>().map_err(|_| bad())?),
    };
    let net = match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => IpNet::V4(Ipv4Net::new(v4, v6.prefix_len() - 96).map_err(|_| bad())?),
            None => net,
        },
        _ => net,
    };
    Ok(net.trunc())
}

/// An origin clients reach the gateway at, normalised as [`normalise_origin`] does.
fn public_url(url: &str) -> Result<String, ConfigError> {
    match normalise_origin(url) {
        Ok(origin) if origin != "*" => Ok(origin),
        _ => Err(ConfigError::BadPublicUrl(url.to_owned())),
    }
}

/// Reads an environment variable, treating an empty value as unset.
fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn env_parse<T: std::str::FromStr>(name: &'static str) -> Result<Option<T>, ConfigError>
where
    T::Err: std::fmt::Display,
{
    env_var(name)
        .map(|v| {
            v.parse::<T>().map_err(|err| ConfigError::Env {
                name,
                message: err.to_string(),
            })
        })
        .transpose()
}

fn load_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|err| ConfigError::Parse {
        path: path.to_owned(),
        message: err.to_string(),
    })
}

/// The value of `--state-dir` that turns persistence off.
pub const NO_STATE_DIR: &str = "none";

/// The state directory: as given (`none`: no persistence), else the XDG state directory.
fn state_dir(given: Option<PathBuf>) -> Option<PathBuf> {
    match given {
        Some(dir) if dir.as_os_str() == NO_STATE_DIR => None,
        Some(dir) => Some(dir),
        None => Some(
            env_var("XDG_STATE_HOME")
                .map(PathBuf::from)
                .or_else(|| env_var("HOME").map(|h| PathBuf::from(h).join(".local").join("state")))
                .map(|base| base.join("cellgate"))
                // No home at all (a bare service): beside the working directory, as the
                // kernels and policies are by default (not `./cellgate`, where the binary
                // itself often is).
                .unwrap_or_else(|| PathBuf::from("cellgate-state")),
        ),
    }
}

fn default_package_cache() -> PathBuf {
    env_var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env_var("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("cellgate")
        .join("packages")
}

/// Where and how the gateway listens: its address and the path it serves under.
struct Listener {
    ip: IpAddr,
    port: u16,
    base_url: String,
}

fn listener(args: &ServeArgs, file: &mut FileConfig) -> Result<Listener, ConfigError> {
    let ip = match args.ip {
        Some(ip) => Some(ip),
        None => env_parse::<IpAddr>("CELLGATE_IP")?.or(env_parse("KG_IP")?),
    }
    .or(file.ip)
    .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let port = match args.port {
        Some(port) => Some(port),
        None => env_parse::<u16>("CELLGATE_PORT")?.or(env_parse("KG_PORT")?),
    }
    .or(file.port)
    .unwrap_or(8888);
    let base_url = args
        .base_url
        .clone()
        .or_else(|| env_var("KG_BASE_URL"))
        .or(file.base_url.take())
        .unwrap_or_else(|| "/".to_owned());
    if base_url.contains(['?', '#', ' ']) || base_url.contains("..") {
        return Err(ConfigError::BadBaseUrl(base_url));
    }
    let base_url = format!("/{}/", base_url.trim_matches('/')).replace("//", "/");
    Ok(Listener { ip, port, base_url })
}

/// Who may call: the static token, the JWT keys, and what each tenant may use.
struct Auth {
    token: Option<String>,
    jwt: JwtSettings,
    tenants: TenantSettings,
}

impl Auth {
    /// Neither a token nor JWT keys: anyone who reaches the gateway is its admin.
    fn open(&self) -> bool {
        self.token.is_none() && !self.jwt.enabled()
    }
}

/// The authentication settings; refused when nothing guards a non-loopback `ip`.
fn auth(args: &ServeArgs, file: &mut FileConfig, ip: IpAddr) -> Result<Auth, ConfigError> {
    let token = args
        .token
        .clone()
        .or_else(|| env_var("CELLGATE_AUTH_TOKEN"))
        .or_else(|| env_var("KG_AUTH_TOKEN"))
        .or(file.token.take())
        .filter(|t| !t.is_empty());
    let auth = Auth {
        token,
        jwt: jwt(args, file),
        tenants: tenants(args, file)?,
    };
    if auth.open() && !ip.is_loopback() {
        return Err(ConfigError::TokenRequired { ip });
    }
    Ok(auth)
}

fn jwt(args: &ServeArgs, file: &mut FileConfig) -> JwtSettings {
    let auth = &args.auth;
    JwtSettings {
        secret_file: auth
            .jwt_secret_file
            .clone()
            .or_else(|| env_var("CELLGATE_JWT_SECRET_FILE").map(PathBuf::from))
            .or(file.jwt_secret_file.take()),
        public_keys: if auth.jwt_public_keys.is_empty() {
            std::mem::take(&mut file.jwt_public_keys)
        } else {
            auth.jwt_public_keys.clone()
        },
        jwks_file: auth
            .jwks_file
            .clone()
            .or_else(|| env_var("CELLGATE_JWKS_FILE").map(PathBuf::from))
            .or(file.jwks_file.take()),
        issuer: auth.jwt_issuer.clone().or(file.jwt_issuer.take()),
        audience: auth.jwt_audience.clone().or(file.jwt_audience.take()),
        leeway: Duration::from_secs(auth.jwt_leeway_s.or(file.jwt_leeway_s).unwrap_or(30)),
    }
}

/// The file's `[tenants]`, with the command line's values over it.
fn tenants(args: &ServeArgs, file: &mut FileConfig) -> Result<TenantSettings, ConfigError> {
    let mut tenants = std::mem::take(&mut file.tenants);
    if let Some(max) = args.auth.tenant_max_kernels {
        tenants.max_kernels = Some(max);
    }
    if let Some(max) = args.auth.tenant_max_mcp_sessions {
        tenants.max_mcp_sessions = Some(max);
    }
    if let Some(rate) = args.auth.tenant_rate {
        tenants.rate = Some(rate);
    }
    if let Some(burst) = args.auth.tenant_burst {
        tenants.burst = Some(burst);
    }
    if let Some(seconds) = args.auth.tenant_cpu_seconds_per_day {
        tenants.cpu_seconds_per_day = Some(seconds);
    }
    if let Some(sessions) = args.auth.tenant_concurrent_sessions {
        tenants.concurrent_sessions = Some(sessions);
    }
    if let Some(bytes) = args.auth.tenant_hibernated_storage {
        tenants.hibernated_storage = Some(bytes);
    }
    if let Some(order) = &args.auth.policy_order {
        // `a, b` in a variable means `a` and `b`.
        tenants.policy_order = order.iter().map(|p| p.trim().to_owned()).collect();
    }
    tenants.validate()?;
    Ok(tenants)
}

/// The origins whose pages may call the gateway; `*` is refused without authentication.
fn allow_origin(
    args: &ServeArgs,
    file: &mut FileConfig,
    auth: &Auth,
) -> Result<Vec<String>, ConfigError> {
    let allow_origin = if !args.allow_origin.is_empty() {
        args.allow_origin.clone()
    } else if let Some(list) = env_var("KG_ALLOW_ORIGIN") {
        list.split(',').map(str::to_owned).collect()
    } else {
        file.allow_origin
            .take()
            .map(OneOrMany::into_vec)
            .unwrap_or_default()
    };
    let allow_origin = allow_origin
        .iter()
        .map(|o| o.trim())
        .filter(|o| !o.is_empty())
        .map(normalise_origin)
        .collect::<Result<Vec<_>, _>>()?;
    if auth.open() && allow_origin.iter().any(|o| o == "*") {
        return Err(ConfigError::AnyOriginWithoutToken);
    }
    Ok(allow_origin)
}

/// How the listener treats connections: its timeouts, the proxies it trusts, its limit.
struct Connections {
    header_read_timeout: Duration,
    body_read_timeout: Duration,
    idle_connection_timeout: Duration,
    trusted_proxies: Vec<IpNet>,
    max_connections: Option<usize>,
}

/// A connection timeout from the CLI, else the file, else its default; never zero.
fn connection_timeout(
    value: Option<Duration>,
    default: u64,
    name: &'static str,
    consequence: &'static str,
    least: &'static str,
) -> Result<Duration, ConfigError> {
    let value = value.unwrap_or(Duration::from_secs(default));
    if value.is_zero() {
        return Err(ConfigError::Zero {
            name,
            consequence,
            least,
        });
    }
    Ok(value)
}

fn connections(args: &ServeArgs, file: &mut FileConfig) -> Result<Connections, ConfigError> {
    let header_read_timeout = connection_timeout(
        args.header_read_timeout.or(file.header_read_timeout),
        5,
        "header_read_timeout",
        "close every connection before its first request",
        "a few seconds, e.g. 5s",
    )?;
    let body_read_timeout = connection_timeout(
        args.body_read_timeout.or(file.body_read_timeout),
        30,
        "body_read_timeout",
        "close every connection whose request has a body",
        "some seconds, e.g. 30s",
    )?;
    let idle_connection_timeout = connection_timeout(
        args.idle_connection_timeout
            .or(file.idle_connection_timeout),
        60,
        "idle_connection_timeout",
        "close every keep-alive connection after its first response",
        "a few seconds, e.g. 60s",
    )?;
    let trusted_proxies = if args.trusted_proxies.is_empty() {
        file.trusted_proxies
            .take()
            .map(OneOrMany::into_vec)
            .unwrap_or_default()
    } else {
        args.trusted_proxies.clone()
    };
    let trusted_proxies = trusted_proxies
        .iter()
        .map(|value| value.trim())
        .filter(|value| !value.is_empty())
        .map(trusted_network)
        .collect::<Result<Vec<_>, _>>()?;
    let max_connections = args.max_connections.or(file.max_connections);
    if max_connections == Some(0) {
        return Err(ConfigError::Zero {
            name: "max_connections",
            consequence: "refuse every connection",
            least: "1 (leave it unset for half the open-file limit)",
        });
    }
    Ok(Connections {
        header_read_timeout,
        body_read_timeout,
        idle_connection_timeout,
        trusted_proxies,
        max_connections,
    })
}

/// The host variables a client may set for its kernel; none the gateway sets itself.
fn env_allowlist(args: &ServeArgs, file: &mut FileConfig) -> Result<Vec<String>, ConfigError> {
    let env_allowlist: Vec<String> = args
        .env_allowlist
        .as_ref()
        .map(|names| names.iter().map(|n| n.trim().to_owned()).collect())
        .or_else(|| {
            env_var("KG_ENV_WHITELIST").map(|v| v.split(',').map(|s| s.trim().to_owned()).collect())
        })
        .or(file.env_allowlist.take())
        .unwrap_or_default();
    if let Some(name) = env_allowlist
        .iter()
        .find(|n| crate::policy::environment::reserved(n))
    {
        return Err(ConfigError::ReservedEnv(name.clone()));
    }
    Ok(env_allowlist)
}

fn max_connections_per_peer(args: &ServeArgs, file: &FileConfig) -> Result<usize, ConfigError> {
    let max_connections_per_peer = args
        .max_connections_per_peer
        .or(file.max_connections_per_peer)
        .unwrap_or(256);
    if max_connections_per_peer == 0 {
        return Err(ConfigError::Zero {
            name: "max_connections_per_peer",
            consequence: "refuse every connection",
            least: "1; JupyterLab alone opens a few plus one WebSocket per kernel",
        });
    }
    Ok(max_connections_per_peer)
}

/// Where kernels come from, how many may live, and how they are started and culled.
struct Kernels {
    kernels_dir: PathBuf,
    policies_dir: PathBuf,
    default_kernel_name: Option<String>,
    sandbox: Option<Backend>,
    max_kernels: Option<usize>,
    cull_idle_timeout: Option<Duration>,
    cull_interval: Duration,
    cull_connected: bool,
    start_timeout: Duration,
    pool_size: usize,
    pool_kernels: Vec<String>,
    kernel_zygote: bool,
    kernel_zygote_max_forks: u32,
    kernel_zygote_max_age: Duration,
    kernels_outlive_gateway: bool,
    orphan_grace: Duration,
}

fn kernels(args: &ServeArgs, file: &mut FileConfig) -> Result<Kernels, ConfigError> {
    let cull = args
        .cull_idle_timeout
        .or(file.cull_idle_timeout)
        .unwrap_or(0);
    let seconds =
        |value: Option<u64>, default: u64| Duration::from_secs(value.unwrap_or(default).max(1));
    Ok(Kernels {
        kernels_dir: args
            .kernels_dir
            .clone()
            .or_else(|| env_var("CELLGATE_KERNELS_DIR").map(PathBuf::from))
            .or(file.kernels_dir.take())
            .unwrap_or_else(|| PathBuf::from("kernels")),
        policies_dir: args
            .policies_dir
            .clone()
            .or_else(|| env_var("CELLGATE_POLICIES_DIR").map(PathBuf::from))
            .or(file.policies_dir.take())
            .unwrap_or_else(|| PathBuf::from("policies")),
        default_kernel_name: args
            .default_kernel_name
            .clone()
            .or_else(|| env_var("KG_DEFAULT_KERNEL_NAME"))
            .or(file.default_kernel_name.take()),
        sandbox: args.sandbox.or(file.sandbox),
        max_kernels: match args.max_kernels {
            Some(max) => Some(max),
            None => env_parse("KG_MAX_KERNELS")?,
        }
        .or(file.max_kernels),
        cull_idle_timeout: (cull > 0).then(|| Duration::from_secs(cull)),
        cull_interval: seconds(args.cull_interval.or(file.cull_interval), 300),
        cull_connected: args.cull_connected.or(file.cull_connected).unwrap_or(false),
        start_timeout: seconds(args.start_timeout.or(file.start_timeout), 60),
        pool_size: args.pool_size.or(file.pool_size).unwrap_or(1),
        pool_kernels: args
            .pool_kernels
            .clone()
            .or(file.pool_kernels.take())
            .unwrap_or_default()
            .into_iter()
            .map(|name| name.trim().to_owned())
            .filter(|name| !name.is_empty())
            .collect(),
        kernel_zygote: args.kernel_zygote.or(file.kernel_zygote).unwrap_or(true),
        kernel_zygote_max_forks: args
            .kernel_zygote_max_forks
            .or(file.kernel_zygote_max_forks)
            .unwrap_or(500)
            .max(1),
        kernel_zygote_max_age: seconds(
            args.kernel_zygote_max_age.or(file.kernel_zygote_max_age),
            3600,
        ),
        kernels_outlive_gateway: args
            .kernels_outlive_gateway
            .or(file.kernels_outlive_gateway)
            .unwrap_or(true),
        orphan_grace: seconds(args.orphan_grace.or(file.orphan_grace), 300)
            .max(Duration::from_secs(1)),
    })
}

/// How long artifacts and their links live, how links are signed, the disk they leave free.
struct Artifacts {
    retention: Duration,
    link_ttl: Duration,
    link_max_ttl: Duration,
    link_key_file: Option<PathBuf>,
    min_free_disk: u64,
}

fn artifacts(args: &ServeArgs, file: &mut FileConfig) -> Artifacts {
    Artifacts {
        retention: Duration::from_secs(
            args.artifact_retention
                .or(file.artifact_retention)
                .unwrap_or(3600),
        ),
        link_ttl: args
            .artifact_link_ttl
            .or(file.artifact_link_ttl)
            .unwrap_or(Duration::from_secs(3600)),
        link_max_ttl: args
            .artifact_link_max_ttl
            .or(file.artifact_link_max_ttl)
            .unwrap_or(Duration::from_secs(7 * 86_400)),
        link_key_file: args
            .artifact_link_key_file
            .clone()
            .or(file.artifact_link_key_file.take()),
        min_free_disk: args
            .artifact_min_free_disk
            .or(file.artifact_min_free_disk)
            .unwrap_or(DEFAULT_ARTIFACT_MIN_FREE_DISK),
    }
}

/// Where packages come from, and how the egress proxy resolves and limits connections.
struct Egress {
    package_index: String,
    npm_registry: String,
    wheelhouse: Option<PathBuf>,
    package_cache_dir: PathBuf,
    hosts: std::collections::BTreeMap<String, IpAddr>,
    max_connections: usize,
}

fn egress(args: &ServeArgs, file: &mut FileConfig) -> Egress {
    Egress {
        package_index: args
            .package_index
            .clone()
            .or(file.package_index.take())
            .unwrap_or_else(|| "https://pypi.org/simple".to_owned()),
        npm_registry: args
            .npm_registry
            .clone()
            .or(file.npm_registry.take())
            .unwrap_or_else(|| "https://registry.npmjs.org".to_owned()),
        wheelhouse: args.wheelhouse.clone().or(file.wheelhouse.take()),
        package_cache_dir: args
            .package_cache_dir
            .clone()
            .or(file.package_cache_dir.take())
            .unwrap_or_else(default_package_cache),
        hosts: std::mem::take(&mut file.egress_hosts)
            .into_iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .collect(),
        max_connections: args
            .egress_max_connections
            .or(file.egress_max_connections)
            .unwrap_or(32)
            .max(1),
    }
}

/// The microVM backend's settings the config file may give (the command line's win).
fn microvm(args: &ServeArgs, file: &mut FileConfig) -> crate::sandbox::MicrovmConfig {
    args.microvm.config(MicrovmFileSettings {
        guest_dir: file.guest_dir.take(),
        microvm_allow_emulation: file.microvm_allow_emulation,
        microvm_snapshots: file.microvm_snapshots,
        microvm_snapshot_dir: file.microvm_snapshot_dir.take(),
        microvm_preload_under_emulation: file.microvm_preload_under_emulation,
        guest_kernel: file.guest_kernel.take(),
        guest_kernel_pvm: file.guest_kernel_pvm,
    })
}

impl GatewayConfig {
    /// Where the sandboxes that outlive the gateway are kept, when they do: with
    /// `kernels_outlive_gateway` and a state directory. What `serve` and `doctor` both use,
    /// so that doctor judges the directory serve will use.
    pub fn survival(&self) -> Option<crate::sandbox::Survival> {
        if !self.kernels_outlive_gateway {
            return None;
        }
        Some(crate::sandbox::Survival {
            dir: self.state_dir.as_ref()?.join("sandboxes"),
            grace: self.orphan_grace,
        })
    }

    /// Resolves the settings: command line, then environment, then file, then defaults.
    /// The groups are resolved in a fixed order: the first problem found is the one
    /// reported.
    pub fn resolve(args: &ServeArgs) -> Result<GatewayConfig, ConfigError> {
        let mut file = match &args.config {
            Some(path) => load_file(path)?,
            None => FileConfig::default(),
        };
        let file = &mut file;
        let Listener { ip, port, base_url } = listener(args, file)?;
        let auth = auth(args, file, ip)?;
        let allow_origin = allow_origin(args, file, &auth)?;
        let connections = connections(args, file)?;
        let env_allowlist = env_allowlist(args, file)?;
        let max_connections_per_peer = max_connections_per_peer(args, file)?;
        let kernels = kernels(args, file)?;
        let (artifacts, egress) = (artifacts(args, file), egress(args, file));
        Ok(GatewayConfig {
            ip,
            port,
            token: auth.token,
            kernels_dir: kernels.kernels_dir,
            policies_dir: kernels.policies_dir,
            default_kernel_name: kernels.default_kernel_name,
            sandbox: kernels.sandbox,
            max_kernels: kernels.max_kernels,
            cull_idle_timeout: kernels.cull_idle_timeout,
            cull_interval: kernels.cull_interval,
            cull_connected: kernels.cull_connected,
            start_timeout: kernels.start_timeout,
            pool_size: kernels.pool_size,
            pool_kernels: kernels.pool_kernels,
            kernel_zygote: kernels.kernel_zygote,
            kernel_zygote_max_forks: kernels.kernel_zygote_max_forks,
            kernel_zygote_max_age: kernels.kernel_zygote_max_age,
            kernels_outlive_gateway: kernels.kernels_outlive_gateway,
            orphan_grace: kernels.orphan_grace,
            artifact_retention: artifacts.retention,
            artifact_link_ttl: artifacts.link_ttl,
            artifact_link_max_ttl: artifacts.link_max_ttl,
            artifact_link_key_file: artifacts.link_key_file,
            artifact_min_free_disk: artifacts.min_free_disk,
            event_replay_bytes: args
                .event_replay_bytes
                .or(file.event_replay_bytes)
                .map_or(crate::sessions::DEFAULT_REPLAY_BYTES, |bytes| {
                    usize::try_from(bytes).unwrap_or(usize::MAX)
                }),
            microvm: microvm(args, file),
            allow_origin,
            env_allowlist,
            max_message_bytes: args
                .max_message_mib
                .or(file.max_message_mib)
                .unwrap_or(64)
                .max(1)
                << 20,
            runtime_dir: args.runtime_dir.clone().or(file.runtime_dir.take()),
            state_dir: state_dir(args.state_dir.clone().or(file.state_dir.take())),
            usage_retention_days: args
                .usage_retention_days
                .or(file.usage_retention_days)
                .unwrap_or(crate::store::DEFAULT_USAGE_RETENTION_DAYS),
            dormant_retention: Some(
                args.dormant_retention
                    .or(file.dormant_retention)
                    .unwrap_or(crate::sessions::DEFAULT_DORMANT_RETENTION),
            )
            .filter(|bound| !bound.is_zero()),
            base_url,
            public_url: args
                .public_url
                .clone()
                .or(file.public_url.take())
                .map(|url| public_url(&url))
                .transpose()?,
            jwt: auth.jwt,
            tenants: auth.tenants,
            package_index: egress.package_index,
            npm_registry: egress.npm_registry,
            wheelhouse: egress.wheelhouse,
            package_cache_dir: egress.package_cache_dir,
            egress_hosts: egress.hosts,
            egress_max_connections: egress.max_connections,
            metrics_listen: args.metrics_listen.or(file.metrics_listen),
            replica: replica_config(
                args.replica_url.clone().or(file.replica_url.take()),
                args.replica_id.clone().or(file.replica_id.take()),
            )?,
            header_read_timeout: connections.header_read_timeout,
            idle_connection_timeout: connections.idle_connection_timeout,
            body_read_timeout: connections.body_read_timeout,
            max_connections: connections.max_connections,
            max_connections_per_peer,
            trusted_proxies: connections.trusted_proxies,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every option of `cellgate serve` can be set three ways: a flag, a `CELLGATE_*`
    /// variable (shown by `--help`) and a config-file key. A new option without its
    /// variable, or without a key the file accepts, fails here.
    #[test]
    fn an_allowlist_naming_a_reserved_variable_is_refused() {
        for name in [
            "LANG",
            "PYTHONPATH",
            "LD_PRELOAD",
            "KERNEL_ID",
            "http_proxy",
        ] {
            let args = ServeArgs {
                env_allowlist: Some(vec![name.to_owned()]),
                ..Default::default()
            };
            match GatewayConfig::resolve(&args) {
                Err(ConfigError::ReservedEnv(refused)) => assert_eq!(refused, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        let args = ServeArgs {
            env_allowlist: Some(vec!["MY_SETTING".to_owned()]),
            ..Default::default()
        };
        assert!(GatewayConfig::resolve(&args).is_ok());
    }

    #[test]
    fn a_state_dir_is_kept_unless_it_is_none() {
        let resolve = |dir: &str| {
            GatewayConfig::resolve(&ServeArgs {
                state_dir: Some(PathBuf::from(dir)),
                ..Default::default()
            })
            .unwrap()
            .state_dir
        };
        assert_eq!(resolve("none"), None);
        assert_eq!(resolve("/srv/state"), Some(PathBuf::from("/srv/state")));
        // The default persists somewhere.
        let default = GatewayConfig::resolve(&ServeArgs::default()).unwrap();
        assert!(default.state_dir.is_some_and(|d| d.ends_with("cellgate")));
    }

    #[test]
    fn sandboxes_outlive_the_gateway_only_with_a_state_directory_and_the_option() {
        let with = |dir: &str, outlive: Option<bool>| {
            GatewayConfig::resolve(&ServeArgs {
                state_dir: Some(PathBuf::from(dir)),
                kernels_outlive_gateway: outlive,
                ..ServeArgs::default()
            })
            .unwrap()
            .survival()
            .map(|survival| survival.dir)
        };
        assert_eq!(
            with("/srv/state", None),
            Some(PathBuf::from("/srv/state/sandboxes"))
        );
        assert_eq!(with("/srv/state", Some(false)), None);
        assert_eq!(with("none", Some(true)), None);
    }

    #[test]
    fn every_serve_option_has_a_variable_and_a_file_key() {
        use clap::Args;
        // Each option's key in the config file, with a value the file accepts.
        let top: &[(&str, &str)] = &[
            ("ip", "ip = \"127.0.0.1\""),
            ("port", "port = 9999"),
            ("token", "token = \"t\""),
            ("kernels_dir", "kernels_dir = \"k\""),
            ("policies_dir", "policies_dir = \"p\""),
            ("default_kernel_name", "default_kernel_name = \"python3\""),
            ("sandbox", "sandbox = \"namespaces\""),
            ("max_kernels", "max_kernels = 9"),
            ("cull_idle_timeout", "cull_idle_timeout = 600"),
            ("cull_interval", "cull_interval = 60"),
            ("cull_connected", "cull_connected = true"),
            ("pool_size", "pool_size = 2"),
            ("pool_kernels", "pool_kernels = [\"python3\", \"deno\"]"),
            ("kernel_zygote", "kernel_zygote = false"),
            ("kernel_zygote_max_forks", "kernel_zygote_max_forks = 50"),
            ("kernel_zygote_max_age", "kernel_zygote_max_age = 600"),
            ("kernels_outlive_gateway", "kernels_outlive_gateway = false"),
            ("orphan_grace", "orphan_grace = 60"),
            ("start_timeout", "start_timeout = 30"),
            ("allow_origin", "allow_origin = [\"https://app.example\"]"),
            ("env_allowlist", "env_allowlist = [\"MY_SETTING\"]"),
            ("max_message_mib", "max_message_mib = 8"),
            ("runtime_dir", "runtime_dir = \"/run/cellgate\""),
            ("state_dir", "state_dir = \"/var/lib/cellgate/state\""),
            ("usage_retention_days", "usage_retention_days = 30"),
            ("dormant_retention", "dormant_retention = \"2d\""),
            ("base_url", "base_url = \"/gw\""),
            ("public_url", "public_url = \"https://gw.example\""),
            ("metrics_listen", "metrics_listen = \"127.0.0.1:9464\""),
            ("replica_url", "replica_url = \"http://10.0.0.1:8888\""),
            ("replica_id", "replica_id = \"gw-1\""),
            (
                "package_index",
                "package_index = \"http://127.0.0.1:1/simple\"",
            ),
            ("npm_registry", "npm_registry = \"http://127.0.0.1:1/npm\""),
            ("wheelhouse", "wheelhouse = \"w\""),
            ("package_cache_dir", "package_cache_dir = \"c\""),
            ("egress_max_connections", "egress_max_connections = 8"),
            ("artifact_retention", "artifact_retention = 60"),
            ("artifact_link_ttl", "artifact_link_ttl = \"10m\""),
            ("artifact_link_max_ttl", "artifact_link_max_ttl = \"1d\""),
            (
                "artifact_link_key_file",
                "artifact_link_key_file = \"/etc/cellgate/link-key\"",
            ),
            ("header_read_timeout", "header_read_timeout = \"5s\""),
            (
                "idle_connection_timeout",
                "idle_connection_timeout = \"60s\"",
            ),
            ("body_read_timeout", "body_read_timeout = \"30s\""),
            ("max_connections", "max_connections = 100"),
            ("max_connections_per_peer", "max_connections_per_peer = 10"),
            (
                "trusted_proxies",
                "trusted_proxies = [\"10.0.0.0/8\", \"127.0.0.1\"]",
            ),
            (
                "artifact_min_free_disk",
                "artifact_min_free_disk = \"1GiB\"",
            ),
            ("event_replay_bytes", "event_replay_bytes = \"64KiB\""),
            ("jwt_secret_file", "jwt_secret_file = \"/etc/cellgate/jwt\""),
            (
                "jwt_public_keys",
                "jwt_public_keys = [\"/etc/cellgate/k.pem\"]",
            ),
            ("jwks_file", "jwks_file = \"/etc/cellgate/jwks.json\""),
            ("jwt_issuer", "jwt_issuer = \"idp\""),
            ("jwt_audience", "jwt_audience = \"cellgate\""),
            ("jwt_leeway_s", "jwt_leeway_s = 5"),
            ("guest_dir", "guest_dir = \"g\""),
            ("microvm_allow_emulation", "microvm_allow_emulation = false"),
            ("microvm_snapshots", "microvm_snapshots = true"),
            ("microvm_snapshot_dir", "microvm_snapshot_dir = \"s\""),
            (
                "microvm_preload_under_emulation",
                "microvm_preload_under_emulation = true",
            ),
            ("guest_kernel", "guest_kernel = \"vmlinux\""),
            ("guest_kernel_pvm", "guest_kernel_pvm = false"),
        ];
        // The tenant options live in the file's `[tenants]` table.
        let tenants: &[(&str, &str)] = &[
            ("tenant_max_kernels", "max_kernels = 3"),
            ("tenant_max_mcp_sessions", "max_mcp_sessions = 20"),
            ("tenant_rate", "rate = 2.5"),
            ("tenant_burst", "burst = 5"),
            ("tenant_cpu_seconds_per_day", "cpu_seconds_per_day = 3600"),
            ("tenant_concurrent_sessions", "concurrent_sessions = 4"),
            ("tenant_hibernated_storage", "hibernated_storage = \"1GiB\""),
            ("policy_order", "policy_order = [\"strict\", \"default\"]"),
        ];
        let command = ServeArgs::augment_args(clap::Command::new("serve"));
        let mut checked = 0;
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "config" {
                continue;
            }
            assert!(
                arg.get_env().is_some(),
                "--{} has no environment variable",
                arg.get_long().unwrap_or(id)
            );
            assert!(
                top.iter().chain(tenants).any(|(key, _)| *key == id),
                "--{} has no config-file key in this test",
                arg.get_long().unwrap_or(id)
            );
            checked += 1;
        }
        assert_eq!(
            checked,
            top.len() + tenants.len(),
            "a key here is no option"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        let mut text: Vec<&str> = top.iter().map(|(_, line)| *line).collect();
        text.push("[tenants]");
        text.extend(tenants.iter().map(|(_, line)| *line));
        std::fs::write(&path, text.join("\n")).unwrap();
        let config = GatewayConfig::resolve(&ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(
            config.metrics_listen,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert_eq!(config.egress_max_connections, 8);
        assert_eq!(config.event_replay_bytes, 64 << 10);
        assert_eq!(config.jwt.leeway, Duration::from_secs(5));
        assert_eq!(config.tenants.burst, Some(5));
        assert_eq!(
            config.trusted_proxies,
            [
                "10.0.0.0/8".parse::<IpNet>().unwrap(),
                "127.0.0.1/32".parse().unwrap()
            ]
        );
    }

    #[test]
    fn trusted_proxies_from_flags_or_file_and_bad_ones_refused() {
        let resolve = |values: &[&str]| {
            GatewayConfig::resolve(&ServeArgs {
                trusted_proxies: values.iter().map(|v| v.to_string()).collect(),
                ..ServeArgs::default()
            })
            .map(|config| config.trusted_proxies)
        };
        let net = |text: &str| text.parse::<IpNet>().unwrap();
        assert_eq!(resolve(&[]).unwrap(), []);
        // Addresses are networks of one; host bits are cleared; a mapped IPv6 network is
        // the IPv4 one its addresses canonicalise to; blanks (a trailing comma) are skipped.
        assert_eq!(
            resolve(&[
                " 127.0.0.1",
                "::1",
                "10.1.2.3/8",
                "::ffff:192.168.0.0/112",
                ""
            ])
            .unwrap(),
            [
                net("127.0.0.1/32"),
                net("::1/128"),
                net("10.0.0.0/8"),
                net("192.168.0.0/16")
            ]
        );
        for bad in [
            "10.0.0.0/33",
            "localhost",
            "10.0.0",
            "10.0.0.0/8/1",
            "fe80::1%eth0",
            "*",
        ] {
            let err = resolve(&["127.0.0.1", bad]).unwrap_err();
            assert!(
                matches!(&err, ConfigError::BadTrustedProxy(value) if value == bad),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains(bad), "{err}");
        }
        // The file's list, or one comma-separated string; the command line replaces it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "trusted_proxies = \"10.0.0.0/8, 192.0.2.1\"\n").unwrap();
        let from_file = |trusted_proxies: Vec<String>| {
            GatewayConfig::resolve(&ServeArgs {
                config: Some(path.clone()),
                trusted_proxies,
                ..ServeArgs::default()
            })
            .map(|config| config.trusted_proxies)
        };
        assert_eq!(
            from_file(vec![]).unwrap(),
            [net("10.0.0.0/8"), net("192.0.2.1/32")]
        );
        assert_eq!(from_file(vec!["::1".into()]).unwrap(), [net("::1/128")]);
        std::fs::write(&path, "trusted_proxies = [\"10.0.0.0/8\", \"nginx\"]\n").unwrap();
        assert!(matches!(
            from_file(vec![]),
            Err(ConfigError::BadTrustedProxy(value)) if value == "nginx"
        ));
    }

    #[test]
    fn unknown_keys_are_reported_with_their_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "port = 9000\nprot = 1\n").unwrap();
        let args = ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        };
        let err = GatewayConfig::resolve(&args).unwrap_err().to_string();
        assert!(err.contains("prot") && err.contains("line 2"), "{err}");
    }

    #[test]
    fn no_token_means_loopback_only() {
        let args = ServeArgs {
            ip: Some("0.0.0.0".parse().unwrap()),
            token: Some(String::new()),
            ..ServeArgs::default()
        };
        // An empty token counts as none.
        if std::env::var("CELLGATE_AUTH_TOKEN").is_err() && std::env::var("KG_AUTH_TOKEN").is_err()
        {
            assert!(matches!(
                GatewayConfig::resolve(&args),
                Err(ConfigError::TokenRequired { .. })
            ));
        }
        let args = ServeArgs {
            ip: Some("0.0.0.0".parse().unwrap()),
            token: Some("t".into()),
            base_url: Some("gw/".into()),
            ..ServeArgs::default()
        };
        let config = GatewayConfig::resolve(&args).unwrap();
        assert_eq!(config.base_url, "/gw/");
    }

    #[test]
    fn public_url_is_an_origin() {
        let resolve = |url: &str| {
            GatewayConfig::resolve(&ServeArgs {
                public_url: Some(url.into()),
                ..ServeArgs::default()
            })
            .map(|config| config.public_url)
        };
        assert_eq!(
            resolve("HTTPS://GW.example:8443/").unwrap().as_deref(),
            Some("https://gw.example:8443")
        );
        for bad in [
            "gw.example",
            "ftp://gw.example",
            "https://gw.example/mcp",
            "https://gw\".example",
            "*",
        ] {
            assert!(
                matches!(resolve(bad), Err(ConfigError::BadPublicUrl(_))),
                "{bad}"
            );
        }
        let unset = GatewayConfig::resolve(&ServeArgs::default()).unwrap();
        assert_eq!(unset.public_url, None);
    }

    #[test]
    fn jwt_and_tenant_settings_from_file_and_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "ip = \"0.0.0.0\"\njwt_secret_file = \"/etc/cellgate/jwt\"\njwt_issuer = \"idp\"\n\
             [tenants]\npolicy_order = [\"strict\", \"default\"]\nmax_kernels = 3\n\
             [tenants.limits.acme]\nmax_kernels = 9\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path.clone()),
            auth: AuthArgs {
                tenant_max_kernels: Some(5),
                tenant_rate: Some(2.5),
                ..AuthArgs::default()
            },
            ..ServeArgs::default()
        };
        // JWT keys count as authentication: a public address is allowed without a token.
        let config = GatewayConfig::resolve(&args).unwrap();
        assert_eq!(
            config.jwt.secret_file.as_deref(),
            Some(Path::new("/etc/cellgate/jwt"))
        );
        assert_eq!(config.jwt.issuer.as_deref(), Some("idp"));
        assert_eq!(config.tenants.max_kernels, Some(5));
        assert_eq!(config.tenants.rate, Some(2.5));
        assert_eq!(config.tenants.limits["acme"].max_kernels, Some(9));
        assert_eq!(config.tenants.policy_order, ["strict", "default"]);
        // The settings hold the secret's path, never the secret itself.
        assert!(format!("{config:?}").contains("/etc/cellgate/jwt"));

        let bad = ServeArgs {
            config: Some(path),
            auth: AuthArgs {
                tenant_rate: Some(0.0),
                ..AuthArgs::default()
            },
            ..ServeArgs::default()
        };
        assert!(matches!(
            GatewayConfig::resolve(&bad),
            Err(ConfigError::Tenants(_))
        ));
    }

    #[test]
    fn connection_limits_from_file_and_flags_and_zero_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "header_read_timeout = \"2s\"\nidle_connection_timeout = \"1m30s\"\nbody_read_timeout = \"45s\"\n\
             max_connections_per_peer = 8\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path.clone()),
            max_connections: Some(100),
            ..ServeArgs::default()
        };
        let config = GatewayConfig::resolve(&args).unwrap();
        assert_eq!(config.header_read_timeout, Duration::from_secs(2));
        assert_eq!(config.idle_connection_timeout, Duration::from_secs(90));
        assert_eq!(config.body_read_timeout, Duration::from_secs(45));
        assert_eq!(config.max_connections, Some(100));
        assert_eq!(config.max_connections_per_peer, 8);

        let defaults = GatewayConfig::resolve(&ServeArgs::default()).unwrap();
        assert_eq!(defaults.header_read_timeout, Duration::from_secs(5));
        assert_eq!(defaults.idle_connection_timeout, Duration::from_secs(60));
        assert_eq!(defaults.body_read_timeout, Duration::from_secs(30));
        assert_eq!(defaults.max_connections, None);
        assert_eq!(defaults.max_connections_per_peer, 256);

        for args in [
            ServeArgs {
                header_read_timeout: Some(Duration::ZERO),
                ..ServeArgs::default()
            },
            ServeArgs {
                idle_connection_timeout: Some(Duration::ZERO),
                ..ServeArgs::default()
            },
            ServeArgs {
                max_connections: Some(0),
                ..ServeArgs::default()
            },
            ServeArgs {
                max_connections_per_peer: Some(0),
                ..ServeArgs::default()
            },
        ] {
            let err = GatewayConfig::resolve(&args).unwrap_err();
            assert!(matches!(err, ConfigError::Zero { .. }), "{err}");
        }

        std::fs::write(&path, "header_read_timeout = \"5\"\n").unwrap();
        let args = ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        };
        let err = GatewayConfig::resolve(&args).unwrap_err().to_string();
        assert!(
            err.contains("header_read_timeout") && err.contains("without a unit"),
            "{err}"
        );
    }
}
