//! The `cellgate` command: parse the command line, set up logging, run the chosen subcommand.

mod notebook_cli;

use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};

use cellgate::config::{GatewayConfig, ServeArgs};
use cellgate::kernel::{KernelManager, KernelOptions, KernelSpecs, ManagerOptions};
use cellgate::sandbox::{Backend, Backends, ZygoteSettings};

#[derive(Parser)]
#[command(
    name = "cellgate",
    version,
    about = "A sandboxed Jupyter kernel gateway"
)]
struct Cli {
    /// Log as JSON lines instead of text.
    #[arg(long, global = true, env = "CELLGATE_LOG_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up: the size difference between the variants costs nothing.
#[expect(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serve the Kernel Gateway API (JupyterLab: --gateway-url=http://IP:PORT).
    Serve(ServeArgs),
    /// Check which sandbox backends this host can run, and how to fix the rest.
    Doctor(DoctorArgs),
    /// Issue a tenant's JWT (HS256) from the configured secret; prints it on stdout.
    Token(TokenArgs),
    /// Export a kernel's history from a running gateway as a notebook (.ipynb, nbformat 4.5).
    Export(notebook_cli::ExportArgs),
    /// Replay a notebook's code cells in a fresh sandboxed kernel and compare the outputs
    /// (exit 0: all matched, 1: a cell differed or errored, 2: unusable notebook or arguments).
    Replay(notebook_cli::ReplayArgs),
}

#[derive(clap::Args)]
struct TokenArgs {
    /// The tenant the token is for.
    #[arg(long)]
    tenant: String,
    /// The most permissive policy the tenant may use.
    #[arg(long)]
    policy: String,
    /// How long the token is valid: e.g. 30m, 12h, 7d.
    #[arg(long, default_value = "1h")]
    ttl: String,
    /// The subject (who within the tenant) [default: the tenant].
    #[arg(long)]
    sub: Option<String>,
    /// The gateway's config file, for its JWT secret, issuer and audience.
    #[arg(long, env = "CELLGATE_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// File holding the HS256 secret [env: CELLGATE_JWT_SECRET_FILE].
    #[arg(long)]
    jwt_secret_file: Option<std::path::PathBuf>,
}

#[derive(clap::Args)]
struct DoctorArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// The gateway's config file: its kernels, policies, backend, microVM and package
    /// settings are checked (the options below override it, as for `serve`).
    #[arg(long, env = "CELLGATE_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Directory of kernelspecs to check [default: ./kernels].
    #[arg(long, env = "CELLGATE_KERNELS_DIR")]
    kernels_dir: Option<std::path::PathBuf>,
    /// Directory of policy files to check [default: ./policies].
    #[arg(long, env = "CELLGATE_POLICIES_DIR")]
    policies_dir: Option<std::path::PathBuf>,
    /// The backend the gateway would use; the exit code says whether it works
    /// [default: namespaces].
    #[arg(long, env = "CELLGATE_SANDBOX")]
    sandbox: Option<Backend>,
    /// Only inspect the host; do not start probe sandboxes.
    #[arg(long)]
    no_probe: bool,
    /// Whether the gateway forks namespaces kernels from a zygote, as for `serve`
    /// [default: true].
    #[arg(long, env = "CELLGATE_KERNEL_ZYGOTE", value_parser = clap::builder::BoolishValueParser::new())]
    kernel_zygote: Option<bool>,
    #[command(flatten)]
    microvm: cellgate::config::MicrovmArgs,
    /// Upstream index the package index would serve from (checked for reachability)
    /// [default: https://pypi.org/simple].
    #[expect(rustdoc::bare_urls)]
    #[arg(long, env = "CELLGATE_PACKAGE_INDEX")]
    package_index: Option<String>,
    /// A wheelhouse directory instead of the upstream index.
    #[arg(long, env = "CELLGATE_WHEELHOUSE")]
    wheelhouse: Option<std::path::PathBuf>,
}

// jemalloc keeps freed memory for reuse (and returns it after its decay time): with glibc's
// allocator the large per-message buffers of a big output went back to the OS and came back
// as fresh, faulting pages, and the ZMQ reader's buffer growth took `malloc`'s slow path on
// every message. Large outputs relay faster than with glibc's malloc, at a small idle cost;
// mimalloc was as fast but idled much larger (BENCHMARKS.md, "Measurements behind the code").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> anyhow::Result<()> {
    // The namespaces sandbox re-executes this binary as its in-sandbox helper; that mode must
    // run before anything else (no runtime, no threads, no argument parsing).
    if std::env::args_os()
        .nth(1)
        .is_some_and(|arg| arg == cellgate::sandbox::SANDBOX_INIT_ARG)
    {
        cellgate::sandbox::sandbox_init_main()
    }
    // So does a gVisor sandbox's keeper (a kernel that outlives the gateway).
    if std::env::args_os()
        .nth(1)
        .is_some_and(|arg| arg == cellgate::sandbox::GVISOR_KEEPER_ARG)
    {
        cellgate::sandbox::gvisor_keeper_main()
    }
    // And a microVM's keeper.
    if std::env::args_os()
        .nth(1)
        .is_some_and(|arg| arg == cellgate::sandbox::MICROVM_KEEPER_ARG)
    {
        cellgate::sandbox::microvm_keeper_main()
    }
    // An empty CELLGATE_* or KG_* variable means unset (an env file's `CELLGATE_AUTH_TOKEN=`),
    // as it always has: clap would parse "" as the option's value. Still one thread here.
    for (name, value) in std::env::vars_os() {
        let ours = name
            .to_str()
            .is_some_and(|n| n.starts_with("CELLGATE_") || n.starts_with("KG_"));
        if ours && value.is_empty() {
            #[expect(
                clippy::disallowed_methods,
                reason = "one thread yet: no runtime, no other thread reads the environment"
            )]
            std::env::remove_var(&name);
        }
    }
    let cli = Cli::parse();
    if matches!(cli.command, Command::Export(_) | Command::Replay(_))
        && std::env::var_os("RUST_LOG").is_none()
    {
        // A one-shot command reports its own progress; the gateway's info log is noise there.
        #[expect(
            clippy::disallowed_methods,
            reason = "still one thread: the runtime starts below"
        )]
        std::env::set_var("RUST_LOG", "warn,zeromq=error");
    }
    cellgate::telemetry::init(cli.log_json);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    match cli.command {
        Command::Serve(args) => runtime.block_on(serve(args)),
        Command::Token(args) => issue_token(args),
        Command::Doctor(args) => {
            let json = args.json;
            let report = runtime.block_on(cellgate::doctor::run(&doctor_options(args)?));
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.to_text());
            }
            std::process::exit(if report.ok { 0 } else { 1 })
        }
        Command::Export(args) => runtime.block_on(notebook_cli::export(args)),
        Command::Replay(args) => {
            let code = runtime.block_on(notebook_cli::replay_command(args));
            // Kernels are shut down by now; do not wait for the runtime's idle tasks.
            runtime.shutdown_timeout(std::time::Duration::from_secs(2));
            std::process::exit(code)
        }
    }
}

/// What `cellgate doctor` checks: its options, then the config file `serve` would read,
/// then the defaults, resolved as `serve` resolves them.
fn doctor_options(args: DoctorArgs) -> anyhow::Result<cellgate::doctor::DoctorOptions> {
    let serve_args = ServeArgs {
        config: args.config,
        // The doctor listens nowhere: a public `ip` whose credentials come from elsewhere
        // (a JWT key in the environment, say) must not fail its check.
        ip: Some(std::net::IpAddr::from([127, 0, 0, 1])),
        kernels_dir: args.kernels_dir,
        policies_dir: args.policies_dir,
        sandbox: args.sandbox,
        package_index: args.package_index,
        wheelhouse: args.wheelhouse,
        microvm: args.microvm,
        kernel_zygote: args.kernel_zygote,
        ..Default::default()
    };
    let config = GatewayConfig::resolve(&serve_args)?;
    let survival = config.survival();
    Ok(cellgate::doctor::DoctorOptions {
        kernels_dir: config.kernels_dir,
        policies_dir: config.policies_dir,
        default_backend: config.sandbox.unwrap_or(Backend::Namespaces),
        probe: !args.no_probe,
        microvm: config.microvm,
        kernel_zygote: config.kernel_zygote,
        survival,
        package_source: Some(match config.wheelhouse {
            Some(dir) => cellgate::egress::packages::Source::Wheelhouse(dir),
            None => cellgate::egress::packages::Source::Upstream(config.package_index),
        }),
    })
}

/// `cellgate token`: reads the secret (and issuer and audience) exactly as `serve` would.
fn issue_token(args: TokenArgs) -> anyhow::Result<()> {
    let ttl = cellgate::policy::parse_duration(&args.ttl)
        .map_err(|err| anyhow::anyhow!("--ttl: {err}"))?;
    anyhow::ensure!(!ttl.is_zero(), "--ttl must be longer than zero");
    let serve_args = ServeArgs {
        config: args.config,
        auth: cellgate::config::AuthArgs {
            jwt_secret_file: args.jwt_secret_file,
            ..Default::default()
        },
        ..Default::default()
    };
    let config = GatewayConfig::resolve(&serve_args)?;
    let secret_file = config
        .jwt
        .secret_file
        .as_deref()
        .ok_or(cellgate::jwt::JwtError::NoSecret)?;
    let secret = cellgate::jwt::read_secret(secret_file)?;
    let token = cellgate::jwt::issue_hs256(
        &secret,
        &args.tenant,
        args.sub.as_deref().unwrap_or(&args.tenant),
        &args.policy,
        ttl,
        config.jwt.issuer.as_deref(),
        config.jwt.audience.as_deref(),
    )?;
    println!("{token}");
    Ok(())
}

/// The egress proxy and its package index (src/egress), from the gateway config.
fn egress_proxy(
    config: &GatewayConfig,
    gateway: std::net::SocketAddr,
) -> anyhow::Result<Arc<cellgate::egress::Egress>> {
    use cellgate::egress::packages::{IndexConfig, PackageIndex, Source};
    let source = match &config.wheelhouse {
        Some(dir) => Source::Wheelhouse(dir.clone()),
        None => Source::Upstream(config.package_index.clone()),
    };
    let index = PackageIndex::new(IndexConfig {
        source,
        cache_dir: config.package_cache_dir.clone(),
    })?;
    let npm = cellgate::egress::packages::npm::NpmRegistry::new(
        cellgate::egress::packages::npm::NpmConfig {
            upstream: config.npm_registry.clone(),
        },
        &index,
    );
    Ok(cellgate::egress::Egress::new(
        cellgate::egress::EgressConfig {
            resolver: cellgate::egress::Resolver {
                host_map: config.egress_hosts.clone().into_iter().collect(),
                gateway: Some(gateway),
            },
            max_connections_per_session: config.egress_max_connections,
        },
        index,
        npm,
    ))
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = Arc::new(GatewayConfig::resolve(&args)?);
    // A key file that cannot sign links stops the gateway before any kernel starts.
    let links = cellgate::gateway::link_signer(&config)?;
    let specs = KernelSpecs::load(&config.kernels_dir, config.default_kernel_name.as_deref())
        .with_context(|| format!("loading kernelspecs from {}", config.kernels_dir.display()))?;
    let policies = cellgate::policy::Policies::load(&config.policies_dir)
        .with_context(|| format!("loading policies from {}", config.policies_dir.display()))?;
    let mut microvm = config.microvm.clone();
    // Hibernated microVMs are saved in the state directory, and wait there across restarts.
    microvm.hibernate_dir = config.state_dir.as_ref().map(|dir| dir.join("hibernated"));
    let mut backends = Backends::new(config.sandbox, microvm)
        .with_zygote(ZygoteSettings {
            enabled: config.kernel_zygote,
            max_forks: config.kernel_zygote_max_forks,
            max_age: config.kernel_zygote_max_age,
            ..ZygoteSettings::default()
        })
        .with_survival(survival(&config));
    if survival(&config).is_some() {
        // Said once at start, so that an operator restarting a gateway knows which sessions
        // keep their variables: the namespaces, gVisor and microVM backends keep their
        // sandboxes.
        tracing::info!(
            grace_s = config.orphan_grace.as_secs(),
            "kernels outlive the gateway: namespaces, gVisor and microVM kernels are kept for the next gateway on this state directory"
        );
    }
    // A replica takes its Lease before any kernel starts: every kernel it makes has a live
    // owner from its first moment.
    let replicas = match &config.replica {
        Some(replica) => {
            let (client, namespace) =
                cellgate::sandbox::kubernetes::client_from_environment().await?;
            let replicas = cellgate::sandbox::kubernetes::replicas::Replicas::join(
                client,
                &namespace,
                &replica.id,
                &replica.url,
            )
            .await
            .context("joining the gateway replicas (--replica-url)")?;
            tracing::info!(replica = %replica.id, url = %replica.url, %namespace, "serving as one of the gateway's replicas");
            backends = backends.with_replicas(replicas.clone());
            Some(replicas)
        }
        None => None,
    };
    check_backends(&backends, &policies, &config)?;
    // Before the listener: a held, damaged or missing store stops the start with nothing
    // to clean up.
    let persistence = open_state(&config).await?;
    let runtime_root = runtime_root(&config);
    raise_open_file_limit();
    let listener = tokio::net::TcpListener::bind((config.ip, config.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", config.ip, config.port))?;
    let local = listener.local_addr()?;
    // Bound before any kernel starts, so a taken address fails the start with nothing to
    // clean up.
    let metrics_listener = match config.metrics_listen {
        Some(address) => Some(
            tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| format!("cannot listen on {address} (--metrics-listen)"))?,
        ),
        None => None,
    };
    // Bound first: the egress proxy must know the gateway's own address to refuse it.
    let egress = egress_proxy(&config, local)?;
    let kernels = KernelManager::new(
        specs,
        backends,
        ManagerOptions {
            runtime_root,
            max_kernels: config.max_kernels,
            env_allowlist: config.env_allowlist.clone(),
            cull_idle_timeout: config.cull_idle_timeout,
            cull_interval: config.cull_interval,
            cull_connected: config.cull_connected,
            kernel: KernelOptions {
                start_timeout: config.start_timeout,
                egress: Some(egress),
                ..KernelOptions::default()
            },
            policies,
            pool_size: config.pool_size,
            pool_kernels: config.pool_kernels.clone(),
        },
    )?;
    kernels.spawn_culler();
    kernels.refill_pool();
    announce(&config, local, metrics_listener.as_ref())?;
    // Read before `serve` takes the configuration: a stopping gateway lets these kernels go.
    let config_outlive = survival(&config).is_some();
    let served = cellgate::gateway::serve(
        config,
        kernels.clone(),
        listener,
        metrics_listener,
        links,
        persistence,
        shutdown_signal(),
    )
    .await;
    // A replica's kernel pods go on running for the others to take over (at once: its
    // Lease is released); every other sandbox ends with the gateway.
    if let Some(replicas) = &replicas {
        replicas.leave();
        let handed = kernels.hand_over_shared();
        replicas.release().await;
        tracing::info!(
            kernels = handed,
            "kernel pods handed over to the other replicas"
        );
    }
    let hibernated = kernels.detach_hibernated();
    if hibernated > 0 {
        tracing::info!(
            kernels = hibernated,
            "hibernated kernels kept on disk for the next gateway on this state directory"
        );
    }
    if config_outlive {
        let kept = kernels.detach_survivors();
        if kept > 0 {
            tracing::info!(
                kernels = kept,
                "kernels left running for the next gateway on this state directory"
            );
        }
    }
    kernels.shutdown_all().await;
    // The manager's own drop would remove it, but tasks still holding it (the culler, the
    // artifact reaper) keep it alive until the process is gone.
    if let Err(err) = std::fs::remove_dir_all(kernels.runtime_root()) {
        if err.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %kernels.runtime_root().display(), %err, "could not remove the runtime directory");
        }
    }
    Ok(served?)
}

/// Fails at start, not at the first kernel, when the default policy's backend cannot run;
/// other policies' backends are made on first use (and `cellgate doctor` checks them): a
/// policy whose backend cannot run is only warned about.
fn check_backends(
    backends: &Backends,
    policies: &cellgate::policy::Policies,
    config: &GatewayConfig,
) -> anyhow::Result<()> {
    let default_backend = policies
        .get("default")
        .map(|p| p.backend)
        .unwrap_or(Backend::Namespaces);
    backends.get(default_backend).with_context(|| {
        format!(
            "the {} sandbox (default policy) cannot run on this host (see `cellgate doctor`)",
            config.sandbox.unwrap_or(default_backend).as_str()
        )
    })?;
    for policy in policies.iter() {
        if let Err(err) = backends.get(policy.backend) {
            tracing::warn!(policy = %policy.name, backend = config.sandbox.unwrap_or(policy.backend).as_str(), %err, "this policy's sandbox cannot run on this host: its kernels will be refused");
        }
    }
    Ok(())
}

/// Opens the state directory's store and reads what it kept (`None`: `--state-dir none`).
async fn open_state(
    config: &GatewayConfig,
) -> anyhow::Result<Option<cellgate::gateway::Persistence>> {
    let Some(dir) = config.state_dir.clone() else {
        tracing::warn!("no state directory (--state-dir none): sessions, their history and artifacts end with this process");
        return Ok(None);
    };
    let options = cellgate::store::StoreOptions {
        usage_retention_days: config.usage_retention_days,
    };
    let opened = tokio::task::spawn_blocking(move || {
        let store = cellgate::store::Store::open_with(&dir, options)?;
        let loaded = store.load()?;
        Ok::<_, cellgate::store::StoreError>((store, loaded))
    })
    .await
    .context("the state directory's store could not be opened")?;
    let (store, loaded) = opened.context("the gateway's state (--state-dir)")?;
    Ok(Some(cellgate::gateway::Persistence {
        store: Arc::new(store),
        loaded,
    }))
}

/// Where kernels that outlive the gateway are recorded (`None`: they end with it).
fn survival(config: &GatewayConfig) -> Option<cellgate::sandbox::Survival> {
    if config.kernels_outlive_gateway && config.state_dir.is_none() {
        tracing::warn!("--kernels-outlive-gateway needs a state directory: without one (--state-dir none) kernels end with the gateway");
    }
    config.survival()
}

/// The directory of this gateway's kernels' run directories.
fn runtime_root(config: &GatewayConfig) -> std::path::PathBuf {
    match &config.runtime_dir {
        Some(dir) => dir.join(format!("cellgate-{}", std::process::id())),
        // Short: ipc socket paths below it must stay under the 108-byte unix socket limit.
        None => std::env::temp_dir().join(format!(
            "cellgate-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        )),
    }
}

/// Says where the gateway serves, in the log and on stdout.
fn announce(
    config: &GatewayConfig,
    local: std::net::SocketAddr,
    metrics_listener: Option<&tokio::net::TcpListener>,
) -> anyhow::Result<()> {
    tracing::info!(
        url = %format!("http://{local}{}", config.base_url),
        sandbox = config.sandbox.map_or("per policy", Backend::as_str),
        auth = match (config.token.is_some(), config.jwt.enabled()) {
            (true, true) => "token and JWT",
            (true, false) => "token",
            (false, true) => "JWT",
            (false, false) => "none (loopback only)",
        },
        "cellgate is serving the Kernel Gateway API"
    );
    // Tools that start us (tests, benchmarks) read the port from this line.
    println!("cellgate listening on http://{local}{}", config.base_url);
    if let Some(metrics) = metrics_listener {
        let address = metrics.local_addr()?;
        tracing::info!(url = %format!("http://{address}/metrics"), "serving metrics and probes");
        println!("cellgate metrics on http://{address}/metrics");
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {},
    }
    tracing::info!("shutting down");
}

/// Raises the soft limit on open files to the hard limit: every client connection, kernel
/// socket and proxied connection is a descriptor, and a default soft limit of 1024 would let
/// a few hundred idle connections stop kernel starts and API calls. Kernels get their own,
/// lower limit from the sandbox.
fn raise_open_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => tracing::info!(
            soft = ?limit.current,
            now = ?limit.maximum,
            "open file limit raised to the hard limit"
        ),
        Err(err) => tracing::warn!(
            %err,
            soft = ?limit.current,
            hard = ?limit.maximum,
            "cannot raise the open file limit"
        ),
    }
}
