//! The deployment kit in `deploy/` (DEPLOY.md): the systemd unit is valid and the gateway
//! serves with exactly its command line, environment and example config, and stops on
//! SIGTERM within the unit's `TimeoutStopSec`; nginx with the example config in front of a
//! real gateway carries REST, kernel WebSockets and unbuffered Server-Sent Events over TLS;
//! the Grafana dashboard and the alerting rules name only metrics the gateway exports.
//!
//! Nothing here is skipped: a missing `systemd-analyze` or `nginx` fails its test with the
//! reason (`./dev setup` installs both on Debian).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_rustls::rustls;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::support::{self, Gateway, TOKEN};

/// Where the unit and its files are installed (the paths `ExecStart=` and
/// `EnvironmentFile=` name), and the file of `deploy/` each is installed from.
const INSTALLED_BINARY: &str = "/usr/local/bin/cellgate";
const INSTALLED_CONFIG: &str = "/etc/cellgate/cellgate.toml";
const INSTALLED_ENV_FILE: &str = "/etc/cellgate/cellgate.env";

fn deploy_dir() -> PathBuf {
    support::repo().join("deploy")
}

/// A program of the host, on `PATH` or in the sbin directories a root shell would search; a
/// missing one fails the test with how to install it.
fn host_program(name: &str, package: &str) -> PathBuf {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        .map(|dir| Path::new(dir).join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not installed, so the deployment kit cannot be checked: `./dev setup` \
                 installs it (Debian package {package}, in the dev script's APT_PACKAGES)"
            )
        });
    found
}

// --- the systemd unit --------------------------------------------------------------------

/// The `[Service]` settings of a unit file, in order (continuation lines joined).
fn service_settings(unit: &str) -> Vec<(String, String)> {
    let mut settings = Vec::new();
    let mut section = String::new();
    let mut pending = String::new();
    for raw in unit.lines() {
        let line = raw.trim();
        if pending.is_empty() && (line.is_empty() || line.starts_with('#') || line.starts_with(';'))
        {
            continue;
        }
        if let Some(rest) = line.strip_suffix('\\') {
            pending.push_str(rest);
            pending.push(' ');
            continue;
        }
        let line = std::mem::take(&mut pending) + line;
        if line.starts_with('[') {
            section = line;
            continue;
        }
        if section != "[Service]" {
            continue;
        }
        if let Some((key, value)) = line.split_once('=') {
            settings.push((key.trim().to_owned(), value.trim().to_owned()));
        }
    }
    settings
}

fn setting<'a>(settings: &'a [(String, String)], key: &str) -> Vec<&'a str> {
    settings
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .collect()
}

/// A systemd time span such as `30s`, `1min 30s` or `90` (seconds).
fn time_span(text: &str) -> Result<Duration> {
    let mut total = Duration::ZERO;
    for part in text.split_whitespace() {
        let digits: String = part.chars().take_while(|c| c.is_ascii_digit()).collect();
        let unit = &part[digits.len()..];
        let n: u64 = digits
            .parse()
            .with_context(|| format!("time span {text:?}"))?;
        total += match unit {
            "" | "s" | "sec" => Duration::from_secs(n),
            "ms" | "msec" => Duration::from_millis(n),
            "m" | "min" => Duration::from_secs(60 * n),
            "h" | "hr" => Duration::from_secs(3600 * n),
            _ => bail!("time span {text:?}: unknown unit {unit:?}"),
        };
    }
    Ok(total)
}

/// `KEY=VALUE` lines of an environment file (comments and blank lines skipped).
fn env_file(text: &str) -> Result<Vec<(String, String)>> {
    let mut vars = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .with_context(|| format!("not KEY=VALUE: {line:?}"))?;
        ensure!(
            !value.starts_with(['"', '\'']),
            "quoted values are not parsed here: {line:?}"
        );
        vars.push((key.to_owned(), value.to_owned()));
    }
    Ok(vars)
}

fn unit_text() -> Result<String> {
    let path = deploy_dir().join("systemd/cellgate.service");
    std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
}

#[test]
fn systemd_analyze_accepts_the_unit_and_its_drop_ins() -> Result<()> {
    let analyze = host_program("systemd-analyze", "systemd");
    let unit = unit_text()?;
    let settings = service_settings(&unit);
    // `verify` checks that ExecStart's binary exists and is executable: the unit is copied
    // with the built binary in place of the installed one, and nothing else changed.
    let exec_start = setting(&settings, "ExecStart");
    ensure!(
        exec_start.len() == 1 && exec_start[0].starts_with(&format!("{INSTALLED_BINARY} ")),
        "one ExecStart running {INSTALLED_BINARY}: {exec_start:?}"
    );
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("cellgate.service"),
        unit.replace(INSTALLED_BINARY, env!("CARGO_BIN_EXE_cellgate")),
    )?;
    let verify = |what: &str| -> Result<()> {
        let out = Command::new(&analyze)
            .args(["verify", "--man=no"])
            .arg(dir.path().join("cellgate.service"))
            .env("SYSTEMD_LOG_LEVEL", "notice")
            .output()
            .with_context(|| format!("run {}", analyze.display()))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Warnings about the unit (unknown keys, bad values) are printed without failing.
        let about_unit: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("cellgate.service") || l.contains(".conf"))
            .collect();
        ensure!(
            out.status.success() && about_unit.is_empty(),
            "systemd-analyze verify ({what}) failed ({}):\n{stderr}",
            out.status
        );
        Ok(())
    };
    verify("the unit")?;
    // Each drop-in, as systemd would load it beside the unit.
    let drop_ins = dir.path().join("cellgate.service.d");
    std::fs::create_dir(&drop_ins)?;
    for drop_in in ["unprivileged.conf", "microvm.conf"] {
        std::fs::copy(
            deploy_dir().join("systemd").join(drop_in),
            drop_ins.join(drop_in),
        )?;
        verify(&format!("the unit with systemd/{drop_in}"))?;
        std::fs::remove_file(drop_ins.join(drop_in))?;
    }
    Ok(())
}

#[tokio::test]
async fn the_gateway_serves_with_the_units_exact_command_line_and_stops_on_sigterm() -> Result<()> {
    let settings = service_settings(&unit_text()?);
    let exec_start = setting(&settings, "ExecStart");
    ensure!(exec_start.len() == 1, "one ExecStart: {exec_start:?}");
    ensure!(
        !exec_start[0].contains(['"', '\'', '$', '%']),
        "ExecStart is split on spaces here; quotes, variables and specifiers are not handled: {}",
        exec_start[0]
    );
    let mut argv: Vec<String> = exec_start[0]
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    ensure!(argv[0] == INSTALLED_BINARY, "ExecStart runs {}", argv[0]);
    // The two substitutions: the built binary, and the config file it is installed from.
    argv[0] = env!("CARGO_BIN_EXE_cellgate").to_owned();
    let config_at = argv
        .iter()
        .position(|a| a == INSTALLED_CONFIG)
        .with_context(|| format!("ExecStart names {INSTALLED_CONFIG}: {argv:?}"))?;
    argv[config_at] = deploy_dir()
        .join("cellgate.toml")
        .to_string_lossy()
        .into_owned();

    // The environment systemd gives the service: its default PATH, then Environment=, then
    // the EnvironmentFile= (which overrides Environment=).
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert(
        "PATH".into(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    for value in setting(&settings, "Environment") {
        for pair in value.split_whitespace() {
            let (k, v) = pair
                .split_once('=')
                .with_context(|| format!("Environment={value}"))?;
            env.insert(k.into(), v.into());
        }
    }
    let env_files = setting(&settings, "EnvironmentFile");
    ensure!(
        env_files
            .iter()
            .all(|f| f.trim_start_matches('-') == INSTALLED_ENV_FILE),
        "EnvironmentFile= other than {INSTALLED_ENV_FILE}: {env_files:?}"
    );
    if !env_files.is_empty() {
        let text = std::fs::read_to_string(deploy_dir().join("cellgate.env"))?;
        env.extend(env_file(&text)?);
    }

    // What the test changes, as an operator would through the environment: a free port,
    // the token, this checkout's kernels and policies, and throwaway state directories.
    // Every variable must exist: without it the gateway would write to the config's
    // /var/lib/cellgate and /var/cache/cellgate on this host.
    let help = Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .args(["serve", "--help"])
        .output()?;
    let help = String::from_utf8_lossy(&help.stdout);
    // Short: unix socket paths below the runtime directory must fit in 108 bytes.
    let state = tempfile::Builder::new().prefix("cg").tempdir()?;
    let runtime_dir = state.path().join("run");
    let mut overrides = vec![
        ("CELLGATE_PORT", "0".to_owned()),
        ("CELLGATE_AUTH_TOKEN", TOKEN.to_owned()),
        (
            "CELLGATE_KERNELS_DIR",
            support::kernels_dir().to_string_lossy().into_owned(),
        ),
        (
            "CELLGATE_POLICIES_DIR",
            support::repo()
                .join("policies")
                .to_string_lossy()
                .into_owned(),
        ),
        (
            "CELLGATE_RUNTIME_DIR",
            runtime_dir.to_string_lossy().into_owned(),
        ),
        (
            "CELLGATE_PACKAGE_CACHE_DIR",
            state.path().join("cache").to_string_lossy().into_owned(),
        ),
        (
            "CELLGATE_MICROVM_SNAPSHOT_DIR",
            state
                .path()
                .join("snapshots")
                .to_string_lossy()
                .into_owned(),
        ),
        (
            "CELLGATE_STATE_DIR",
            state.path().join("state").to_string_lossy().into_owned(),
        ),
    ];
    for (name, _) in &overrides {
        ensure!(
            help.contains(name),
            "`cellgate serve` has no {name} environment variable, which this test needs to \
             keep the example config's directories off this host"
        );
    }
    // The backend a test run forces, and the microVM guest of this checkout.
    if let Some(backend) = support::forced_sandbox() {
        overrides.push(("CELLGATE_SANDBOX", backend));
    }
    for name in ["CELLGATE_GUEST_DIR", "CELLGATE_MICROVM_ALLOW_EMULATION"] {
        if let Ok(value) = std::env::var(name) {
            overrides.push((name, value));
        }
    }
    env.extend(overrides.into_iter().map(|(k, v)| (k.to_owned(), v)));

    let child = Command::new(&argv[0])
        .args(&argv[1..])
        .env_clear()
        .envs(&env)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn cellgate")?;
    let mut gateway = Gateway::attach(child, Some(TOKEN.to_owned())).await?;
    let pid = gateway.pid();
    // The runtime root is where the environment said, not the config's.
    let runtime_root = runtime_dir.join(format!("cellgate-{pid}"));
    ensure!(
        runtime_root.is_dir(),
        "no runtime root at {}: {}",
        runtime_root.display(),
        gateway.log()
    );

    // And the settings are the example config's (the gateway logs its connection limits).
    let config: toml::Table = toml::from_str(&std::fs::read_to_string(
        deploy_dir().join("cellgate.toml"),
    )?)?;
    let per_peer = config
        .get("max_connections_per_peer")
        .context("deploy/cellgate.toml sets max_connections_per_peer")?;
    // (The line comes on stderr just after the "listening" line on stdout.)
    let wanted = format!("max_connections_per_peer={per_peer}");
    ensure!(
        support::eventually(support::PATIENCE, || gateway.log().contains(&wanted)).await,
        "the gateway did not take deploy/cellgate.toml's max_connections_per_peer = {per_peer}: {}",
        gateway.log()
    );

    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "deploy-unit", false).await?;
    let msgs = client.run("1+1").await?;
    let result = support::of_type(&msgs, "execute_result");
    ensure!(
        result.len() == 1 && result[0].content["data"]["text/plain"] == "2",
        "1+1 gave {:?}; log: {}",
        msgs.iter().map(|m| &m.content).collect::<Vec<_>>(),
        gateway.log()
    );
    ensure!(
        !support::pids_with(&kernel).is_empty(),
        "no host process of kernel {kernel}"
    );

    // SIGTERM, as `systemctl stop` sends it (KillMode=process: to the gateway alone), with the
    // kernel running and its WebSocket open: the gateway must be gone within the unit's
    // TimeoutStopSec (past it systemd would SIGKILL the unit), having ended its kernels.
    let timeout_stop = setting(&settings, "TimeoutStopSec");
    ensure!(timeout_stop.len() == 1, "TimeoutStopSec: {timeout_stop:?}");
    let timeout_stop = time_span(timeout_stop[0])?;
    ensure!(
        setting(&settings, "KillMode") == ["process"],
        "KillMode=process: the gateway alone gets SIGTERM, ends its kernels itself and leaves the kept ones for the next gateway"
    );
    // TimeoutStopSec is the unit's own bound, not a guess at this machine's speed: the
    // gateway's own deadlines (10 s for requests, then 10 s for kernels) keep it within.
    let term = rustix::process::Pid::from_raw(pid as i32).context("pid")?;
    let terminated = Instant::now();
    rustix::process::kill_process(term, rustix::process::Signal::TERM)?;
    let deadline = terminated + timeout_stop;
    let status = loop {
        if let Some(status) = gateway.child.try_wait()? {
            break status;
        }
        ensure!(
            Instant::now() < deadline,
            "the gateway still runs {timeout_stop:?} after SIGTERM (TimeoutStopSec): {}",
            gateway.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!(
        "the gateway exited {:?} after SIGTERM",
        terminated.elapsed()
    );
    ensure!(
        status.success(),
        "the gateway exited with {status} after SIGTERM: {}",
        gateway.log()
    );
    ensure!(
        support::eventually(support::PATIENCE, || support::pids_with(&kernel).is_empty()).await,
        "kernel {kernel} outlived the gateway: {:?}",
        support::pids_with(&kernel)
    );
    ensure!(
        !runtime_root.exists(),
        "the gateway left its runtime root {} behind",
        runtime_root.display()
    );
    client.close().await;
    Ok(())
}

// --- nginx in front of a gateway -----------------------------------------------------------

/// The name the test certificate is for and nginx's `server_name`; resolved to loopback by
/// the clients themselves, never through DNS.
const SERVER_NAME: &str = "cellgate.example.com";

/// DER bytes as PEM (rcgen is built without its PEM feature).
fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let text = base64::engine::general_purpose::STANDARD.encode(der);
    let lines: Vec<&str> = text
        .as_bytes()
        .chunks(64)
        .map(|line| std::str::from_utf8(line).expect("base64 is ASCII"))
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

/// Two distinct free loopback ports (bound together, then released for nginx to take).
fn two_free_ports() -> Result<(u16, u16)> {
    let a = std::net::TcpListener::bind("127.0.0.1:0")?;
    let b = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// `deploy/nginx/cellgate.conf` with only its addresses, ports and file paths replaced; each
/// replaced text must be there, so a changed example cannot leave the test checking
/// something else.
fn templated_nginx_conf(
    gateway_port: u16,
    tls_port: u16,
    http_port: u16,
    dir: &Path,
) -> Result<String> {
    let mut conf = std::fs::read_to_string(deploy_dir().join("nginx/cellgate.conf"))?;
    let replacements = [
        (
            "server 127.0.0.1:8888;".to_owned(),
            format!("server 127.0.0.1:{gateway_port};"),
        ),
        (
            "listen 443 ssl http2;".to_owned(),
            format!("listen 127.0.0.1:{tls_port} ssl http2;"),
        ),
        ("listen [::]:443 ssl http2;".to_owned(), String::new()),
        (
            "listen 80;".to_owned(),
            format!("listen 127.0.0.1:{http_port};"),
        ),
        ("listen [::]:80;".to_owned(), String::new()),
        (
            "/etc/ssl/certs/cellgate.example.com.pem".to_owned(),
            dir.join("cert.pem").display().to_string(),
        ),
        (
            "/etc/ssl/private/cellgate.example.com.key".to_owned(),
            dir.join("key.pem").display().to_string(),
        ),
        (
            "/var/log/nginx/cellgate.access.log".to_owned(),
            dir.join("access.log").display().to_string(),
        ),
    ];
    for (from, to) in replacements {
        ensure!(
            conf.matches(&from).count() == 1,
            "deploy/nginx/cellgate.conf should contain {from:?} once"
        );
        conf = conf.replace(&from, &to);
    }
    Ok(conf)
}

/// A running nginx (master and workers), stopped on drop.
struct Nginx {
    child: Child,
    dir: PathBuf,
}

impl Nginx {
    fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: the master stops its workers before it exits (SIGKILL would orphan them).
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts nginx with the templated example config under `dir`; returns once it accepts
/// TLS connections on `tls_port`.
async fn start_nginx(
    dir: &Path,
    gateway_port: u16,
    tls_port: u16,
    http_port: u16,
) -> Result<Nginx> {
    let nginx = host_program("nginx", "nginx");
    std::fs::write(
        dir.join("cellgate.conf"),
        templated_nginx_conf(gateway_port, tls_port, http_port, dir)?,
    )?;
    let d = dir.display();
    std::fs::write(
        dir.join("nginx.conf"),
        format!(
            "daemon off;\nmaster_process on;\nworker_processes 1;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log info;\nevents {{ worker_connections 256; }}\n\
             http {{\n  client_body_temp_path {d}/client_body;\n  proxy_temp_path {d}/proxy;\n\
             \x20 fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n\
             \x20 scgi_temp_path {d}/scgi;\n  access_log {d}/access.log;\n\
             \x20 include {d}/cellgate.conf;\n}}\n"
        ),
    )?;
    let args = |command: &mut Command| {
        command
            .arg("-p")
            .arg(dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .arg("-e")
            .arg(dir.join("error.log"));
    };
    let mut check = Command::new(&nginx);
    args(&mut check);
    let out = check.arg("-t").output()?;
    ensure!(
        out.status.success(),
        "nginx -t refuses deploy/nginx/cellgate.conf:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut command = Command::new(&nginx);
    args(&mut command);
    let child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("spawn nginx")?;
    let nginx = Nginx {
        child,
        dir: dir.to_owned(),
    };
    let deadline = Instant::now() + support::PATIENCE;
    while tokio::net::TcpStream::connect(("127.0.0.1", tls_port))
        .await
        .is_err()
    {
        ensure!(
            Instant::now() < deadline,
            "nginx did not listen on 127.0.0.1:{tls_port}: {}",
            nginx.error_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(nginx)
}

/// The next Server-Sent Event of a response: its `event:` name and `data:` JSON.
async fn next_event(
    response: &mut reqwest::Response,
    buffer: &mut String,
) -> Result<(String, Value)> {
    loop {
        if let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let mut name = String::new();
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            if !data.is_empty() {
                return Ok((name, serde_json::from_str(&data)?));
            }
            continue;
        }
        let chunk = tokio::time::timeout(support::v1::WAIT, response.chunk())
            .await
            .map_err(|_| {
                anyhow!(
                    "no event through nginx within {:?} while the cell waits for input: the \
                     stream is buffered (got so far: {buffer:?})",
                    support::v1::WAIT
                )
            })??
            .ok_or_else(|| anyhow!("the stream ended; buffered {buffer:?}"))?;
        buffer.push_str(&String::from_utf8_lossy(&chunk));
    }
}

#[tokio::test]
async fn nginx_with_the_example_config_carries_rest_websockets_and_streams_over_tls() -> Result<()>
{
    let gateway = Gateway::start().await?;
    let dir = tempfile::tempdir()?;
    // nginx's workers drop root: they must reach the temp directories the master makes here.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    let certified = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_owned()])?;
    let cert_pem = pem("CERTIFICATE", certified.cert.der());
    std::fs::write(dir.path().join("cert.pem"), &cert_pem)?;
    std::fs::write(
        dir.path().join("key.pem"),
        pem("PRIVATE KEY", &certified.signing_key.serialize_der()),
    )?;
    let (tls_port, http_port) = two_free_ports()?;
    let nginx = start_nginx(dir.path(), gateway.port, tls_port, http_port).await?;
    let base = format!("https://{SERVER_NAME}:{tls_port}");
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let https = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(cert_pem.as_bytes())?)
        .resolve(SERVER_NAME, loopback)
        .build()?;
    let auth = format!("token {TOKEN}");
    let context = || format!("nginx: {}\ngateway: {}", nginx.error_log(), gateway.log());

    // Plain HTTP is redirected to HTTPS.
    let plain = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .resolve(SERVER_NAME, loopback)
        .build()?;
    let response = plain
        .get(format!("http://{SERVER_NAME}:{http_port}/api"))
        .send()
        .await?;
    ensure!(response.status().as_u16() == 308, "{}", response.status());
    let location = response.headers()["location"].to_str()?.to_owned();
    ensure!(
        location == format!("https://{SERVER_NAME}/api"),
        "{location}"
    );

    // REST through TLS, with a request id nginx passes on and logs.
    let response = https
        .get(format!("{base}/api/kernelspecs"))
        .header("Authorization", &auth)
        .header("X-Request-Id", "deploy-test-request-1")
        .send()
        .await
        .with_context(context)?;
    ensure!(response.status().as_u16() == 200, "{}", response.status());
    let specs: Value = response.json().await?;
    ensure!(specs["kernelspecs"]["python3"].is_object(), "{specs}");
    // Unauthenticated callers get the gateway's own 401 through the proxy.
    let response = https.get(format!("{base}/api/kernels")).send().await?;
    ensure!(response.status().as_u16() == 401, "{}", response.status());
    // Metrics are not published through the proxy.
    let response = https
        .get(format!("{base}/metrics"))
        .header("Authorization", &auth)
        .send()
        .await?;
    ensure!(response.status().as_u16() == 404, "{}", response.status());

    // A kernel WebSocket over TLS (wss), as a browser page served through the proxy opens
    // it: its Origin is the proxy's, which the gateway compares with the Host nginx sends.
    let response = https
        .post(format!("{base}/api/kernels"))
        .header("Authorization", &auth)
        .json(&json!({"name": "python3"}))
        .send()
        .await?;
    ensure!(response.status().as_u16() == 201, "{}", response.status());
    let kernel: Value = response.json().await?;
    let kernel = kernel["id"].as_str().context("kernel id")?.to_owned();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(certified.cert.der().clone())?;
    let tls_config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", tls_port)).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(tls_config))
        .connect(
            rustls::pki_types::ServerName::try_from(SERVER_NAME)?.to_owned(),
            tcp,
        )
        .await?;
    let mut request = format!(
        "wss://{SERVER_NAME}:{tls_port}/api/kernels/{kernel}/channels?session_id=deploy-nginx"
    )
    .into_client_request()?;
    request.headers_mut().insert("Authorization", auth.parse()?);
    request.headers_mut().insert(
        "Origin",
        format!("https://{SERVER_NAME}:{tls_port}").parse()?,
    );
    let (mut socket, _) = tokio_tungstenite::client_async(request, tls)
        .await
        .with_context(context)?;
    let msg_id = uuid::Uuid::new_v4().to_string();
    let execute = json!({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": "deploy-nginx",
                   "username": "test", "date": "2026-11-22T00:00:00.000000Z", "version": "5.4"},
        "parent_header": {}, "metadata": {}, "channel": "shell",
        "content": {"code": "1+1", "silent": false, "store_history": true,
                    "user_expressions": {}, "allow_stdin": false, "stop_on_error": true},
    });
    socket
        .send(WsMessage::Text(execute.to_string().into()))
        .await?;
    let (mut result, mut reply) = (None, None);
    while result.is_none() || reply.is_none() {
        let frame = tokio::time::timeout(support::v1::WAIT, socket.next())
            .await
            .map_err(|_| anyhow!("no message over wss within {:?}", support::v1::WAIT))?
            .context("the WebSocket closed")??;
        let WsMessage::Text(text) = frame else {
            continue;
        };
        let msg: Value = serde_json::from_str(text.as_str())?;
        if msg["parent_header"]["msg_id"] != msg_id.as_str() {
            continue;
        }
        match msg["header"]["msg_type"].as_str() {
            Some("execute_result") => result = Some(msg["content"]["data"]["text/plain"].clone()),
            Some("execute_reply") => reply = Some(msg["content"]["status"].clone()),
            _ => {}
        }
    }
    ensure!(
        result == Some(json!("2")) && reply == Some(json!("ok")),
        "{result:?} {reply:?}"
    );
    socket.close(None).await.ok();

    // An API v1 execute as Server-Sent Events: the cell prints, then waits for input. The
    // printed line and the input request can only reach the client while the cell waits if
    // nginx passes the stream on as it comes; the answer is sent only after both arrived.
    let response = https
        .post(format!("{base}/v1/sessions"))
        .header("Authorization", &auth)
        .json(&json!({}))
        .send()
        .await?;
    ensure!(response.status().as_u16() == 201, "{}", response.status());
    let session: Value = response.json().await?;
    let session = session["id"].as_str().context("session id")?.to_owned();
    let sse = https
        .post(format!("{base}/v1/sessions/{session}/execute"))
        .header("Authorization", &auth)
        .header("Accept", "text/event-stream")
        .json(&json!({"code": "print('before', flush=True)\nanswer = input('go? ')\nprint('after', answer)"}))
        .send();
    // Even the response head waits behind a buffering proxy (until the cell ends, which it
    // cannot before it gets its input).
    let mut stream = tokio::time::timeout(support::v1::WAIT, sse)
        .await
        .map_err(|_| {
            anyhow!(
                "no response head through nginx within {:?} while the cell waits for input: \
                 the stream is buffered",
                support::v1::WAIT
            )
        })??;
    ensure!(stream.status().as_u16() == 200, "{}", stream.status());
    let mut buffer = String::new();
    let mut seen = Vec::new();
    let mut answered_input = false;
    loop {
        let (name, event) = next_event(&mut stream, &mut buffer).await?;
        seen.push(name.clone());
        // The printed line and the input request both reach the client while the cell waits
        // for its input, whatever their order (they come from the kernel on two channels,
        // which Jupyter does not order): only then is the input sent.
        let both = seen.iter().any(|n| n == "stream") && seen.iter().any(|n| n == "input_request");
        if both && !answered_input {
            answered_input = true;
            let answered = https
                .post(format!("{base}/v1/sessions/{session}/input"))
                .header("Authorization", &auth)
                .json(&json!({"value": "yes"}))
                .send()
                .await?;
            ensure!(answered.status().as_u16() == 204, "{}", answered.status());
        }
        if name == "done" {
            let result = &event["result"];
            ensure!(
                result["status"] == "ok" && result["stdout"] == "before\nafter yes\n",
                "{event}"
            );
            break;
        }
    }
    ensure!(seen.iter().any(|n| n == "input_request"), "{seen:?}");

    // An upload larger than nginx's default body limit (1 MiB) goes through.
    let body = vec![b'x'; 3 << 20];
    let response = https
        .put(format!("{base}/v1/sessions/{session}/files/big.bin"))
        .header("Authorization", &auth)
        .body(body)
        .send()
        .await?;
    ensure!(
        response.status().as_u16() == 201,
        "{} {}",
        response.status(),
        response.text().await?
    );

    // nginx logged the client's request id.
    let access = std::fs::read_to_string(dir.path().join("access.log"))?;
    ensure!(
        access.contains("rid=deploy-test-request-1"),
        "the access log has no request id: {access}"
    );
    drop(nginx);
    Ok(())
}

// --- the Grafana dashboard and the alerting rules -----------------------------------------

/// Labels Prometheus adds to every scraped series.
const TARGET_LABELS: &[&str] = &["instance", "job"];

/// The metric selectors of a PromQL expression: each metric name with the label names its
/// `{...}` matcher uses. Function and aggregation names, keywords, grouping label lists,
/// strings, numbers and ranges are not metrics.
fn promql_selectors(expr: &str) -> Result<Vec<(String, Vec<String>)>> {
    const KEYWORDS: &[&str] = &[
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
        "Inf",
        "NaN",
    ];
    const GROUPING: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut selectors = Vec::new();
    let mut i = 0;
    let skip_spaces = |mut j: usize| {
        while j < chars.len() && chars[j].is_whitespace() {
            j += 1;
        }
        j
    };
    // The index just past the bracket closing the one at `open`.
    let close = |open: usize, left: char, right: char| -> Result<usize> {
        let mut depth = 0;
        let mut j = open;
        let mut quote = None;
        while j < chars.len() {
            let c = chars[j];
            match quote {
                Some(_) if c == '\\' => j += 1,
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None if c == '"' || c == '\'' || c == '`' => quote = Some(c),
                None if c == left => depth += 1,
                None if c == right => {
                    depth -= 1;
                    if depth == 0 {
                        return Ok(j + 1);
                    }
                }
                None => {}
            }
            j += 1;
        }
        bail!("unbalanced {left}{right} in {expr:?}")
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            let mut j = i + 1;
            while j < chars.len() && chars[j] != c {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            i = j + 1;
        } else if c == '[' {
            i = close(i, '[', ']')?;
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i])) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = skip_spaces(i);
            if GROUPING.contains(&word.as_str()) {
                if chars.get(next) == Some(&'(') {
                    i = close(next, '(', ')')?;
                }
            } else if KEYWORDS.contains(&word.as_str())
                || chars.get(next) == Some(&'(')
                || ["by", "without"].iter().any(|g| {
                    let after: String = chars[next..].iter().take(g.len() + 1).collect();
                    after.starts_with(g)
                        && !after[g.len()..]
                            .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                })
            {
                // A keyword, a function called, or an aggregation (`sum by (x) (...)`).
            } else {
                let mut labels = Vec::new();
                if chars.get(next) == Some(&'{') {
                    let end = close(next, '{', '}')?;
                    let matcher: String = chars[next + 1..end - 1].iter().collect();
                    for part in matcher.split(',') {
                        let name: String = part
                            .trim()
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        if !name.is_empty() {
                            labels.push(name);
                        }
                    }
                    i = end;
                }
                selectors.push((word, labels));
            }
        } else if c == '{' {
            bail!("a selector without a metric name in {expr:?}");
        } else {
            i += 1;
        }
    }
    Ok(selectors)
}

/// Every metric an expression names is exported, with the labels its matchers use.
fn check_expression(
    expr: &str,
    also_allowed: &[&str],
    known: &BTreeMap<String, Vec<String>>,
) -> Result<Vec<String>> {
    let selectors = promql_selectors(expr)?;
    ensure!(!selectors.is_empty(), "no metric in {expr:?}");
    let mut names = Vec::new();
    for (name, labels) in selectors {
        if also_allowed.contains(&name.as_str()) {
            continue;
        }
        let Some(exported) = known.get(name.as_str()) else {
            bail!("{expr:?} names {name}, which the gateway does not export");
        };
        for label in &labels {
            ensure!(
                exported.iter().any(|l| l == label)
                    || TARGET_LABELS.contains(&label.as_str())
                    || (label == "le" && name.ends_with("_bucket")),
                "{expr:?}: {name} has no label {label}"
            );
        }
        names.push(name);
    }
    Ok(names)
}

/// The metrics the gateway exports, with their labels (`le` of histograms is implied): the
/// gateway's own exposition code, given one event of every kind and a state with a kernel,
/// a tenant and a pool, so that every family has a sample whose labels can be read. A
/// family renamed or a label dropped in the code fails the dashboard and the alerts here.
fn known_metrics() -> BTreeMap<String, Vec<String>> {
    use cellgate::telemetry::metrics::{metrics, ExecOutcome, KernelGroup, Snapshot, StartSource};
    let m = metrics();
    m.kernel_started(
        "default",
        "namespaces",
        StartSource::cold,
        Duration::from_secs(1),
    );
    m.kernel_start_failed("default", "namespaces", StartSource::refill);
    m.pool_lookup(true);
    m.executions_of("default")
        .record(ExecOutcome::ok, Duration::from_millis(3));
    m.denial("default", "egress");
    m.rate_limited("acme");
    m.http_request("GET", "/api/kernels", 200, Duration::from_millis(1));
    let _open = (m.websocket_opened(), m.connection_opened());
    let mut snapshot = Snapshot {
        pool_target: 1,
        ..Snapshot::default()
    };
    snapshot.kernels.insert(
        KernelGroup {
            state: "idle",
            policy: "default".to_owned(),
            backend: "namespaces",
        },
        1,
    );
    snapshot.tenant_kernels.insert("acme".to_owned(), 1);
    let text = cellgate::telemetry::metrics::render(&snapshot).expect("render");
    let mut known: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let series = line.rsplit_once(' ').map_or(line, |(series, _)| series);
        let (name, matchers) = series.split_once('{').unwrap_or((series, ""));
        let labels = known.entry(name.to_owned()).or_default();
        // Label values here are plain words: no comma or quote inside them.
        for pair in matchers.trim_end_matches('}').split(',') {
            if let Some((label, _)) = pair.split_once('=') {
                if label != "le" && !labels.iter().any(|l| l == label) {
                    labels.push(label.to_owned());
                }
            }
        }
    }
    known
}

#[test]
fn promql_selectors_are_found() -> Result<()> {
    let found = promql_selectors(
        "histogram_quantile(0.95, sum by (le, source) (rate(a_bucket{x=~\"$v\", y!=\"}\"}[$__rate_interval]))) \
         / on(instance) group_left(version) b + 1e3 * c_total offset 5m",
    )?;
    let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a_bucket", "b", "c_total"]);
    assert_eq!(found[0].1, ["x", "y"]);
    Ok(())
}

#[test]
fn the_grafana_dashboard_uses_only_exported_metrics() -> Result<()> {
    let path = deploy_dir().join("grafana/cellgate.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    // Importable: the data source is an input, every panel and query uses it.
    let inputs = dashboard["__inputs"].as_array().context("__inputs")?;
    ensure!(
        inputs
            .iter()
            .any(|i| i["name"] == "DS_PROMETHEUS" && i["pluginId"] == "prometheus"),
        "no DS_PROMETHEUS input: {inputs:?}"
    );
    let known = known_metrics();
    let mut used = BTreeSet::new();
    let mut ids = BTreeSet::new();
    let mut panels: Vec<&Value> = dashboard["panels"]
        .as_array()
        .context("panels")?
        .iter()
        .collect();
    let mut expressions = 0;
    while let Some(panel) = panels.pop() {
        let id = panel["id"].as_u64().context("a panel without an id")?;
        ensure!(ids.insert(id), "two panels have id {id}");
        if let Some(inner) = panel["panels"].as_array() {
            panels.extend(inner);
        }
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().unwrap_or_default();
        ensure!(
            panel["datasource"]["uid"] == "${DS_PROMETHEUS}",
            "panel {title:?} does not use the DS_PROMETHEUS input"
        );
        let targets = panel["targets"].as_array().context("targets")?;
        ensure!(!targets.is_empty(), "panel {title:?} has no query");
        for target in targets {
            let expr = target["expr"].as_str().context("a target without expr")?;
            used.extend(
                check_expression(expr, &[], &known).with_context(|| format!("panel {title:?}"))?,
            );
            expressions += 1;
        }
    }
    // Template variables: label_values(metric, label).
    for variable in dashboard["templating"]["list"]
        .as_array()
        .context("templating")?
    {
        let query = variable["query"]["query"]
            .as_str()
            .or(variable["query"].as_str())
            .unwrap_or_default();
        if let Some(args) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
        {
            let (metric, label) = args.split_once(',').context(query.to_owned())?;
            let (metric, label) = (metric.trim(), label.trim());
            let labels = known
                .get(metric)
                .with_context(|| format!("variable {query:?}: no metric {metric}"))?;
            ensure!(
                labels.iter().any(|l| l == label) || TARGET_LABELS.contains(&label),
                "variable {query:?}: {metric} has no label {label}"
            );
        }
    }
    // Every family is on the dashboard (histograms through their buckets).
    // The process's threads and virtual memory are exported for completeness, not charted.
    let unused: Vec<&String> = known
        .keys()
        .filter(|name| !name.ends_with("_sum") && !name.ends_with("_count"))
        .filter(|name| {
            !matches!(
                name.as_str(),
                "process_threads" | "process_virtual_memory_bytes"
            )
        })
        .filter(|name| !used.contains(*name))
        .collect();
    ensure!(unused.is_empty(), "metrics no panel shows: {unused:?}");
    ensure!(expressions >= 20, "only {expressions} queries");
    Ok(())
}

/// The alerting rules of `deploy/prometheus/alerts.yml`, each group's `rules` flattened,
/// read as YAML through the tools venv's PyYAML (the crate has no YAML parser).
fn alert_rules() -> Result<Vec<Value>> {
    let path = deploy_dir().join("prometheus/alerts.yml");
    let out = Command::new(support::tools_python())
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
        ])
        .arg(&path)
        .output()?;
    ensure!(
        out.status.success(),
        "{} is not YAML: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let rules: Value = serde_json::from_slice(&out.stdout)?;
    let mut all = Vec::new();
    for group in rules["groups"].as_array().context("groups")? {
        all.extend(group["rules"].as_array().context("rules")?.iter().cloned());
    }
    ensure!(!all.is_empty(), "no alerting rule");
    Ok(all)
}

/// Where the rules' `runbook_url`s point: docs/runbook.md under one placeholder base the
/// operator replaces (alerts.yml's header says so).
const RUNBOOK_BASE: &str = "https://git.example.com/cellgate/blob/main/docs/runbook.md#";

/// The anchors of a Markdown file's headings, as GitHub makes them: lower case, spaces to
/// `-`, punctuation other than `-` and `_` dropped.
fn heading_anchors(markdown: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut anchors = BTreeSet::new();
    for line in markdown.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        }
        let Some(title) = line.strip_prefix('#').filter(|_| !in_code) else {
            continue;
        };
        let title = title.trim_start_matches('#').trim();
        anchors.insert(
            title
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
                .map(|c| if c == ' ' { '-' } else { c })
                .collect(),
        );
    }
    anchors
}

#[test]
fn the_alerting_rules_use_only_exported_metrics() -> Result<()> {
    let known = known_metrics();
    let runbook = std::fs::read_to_string(support::repo().join("docs/runbook.md"))
        .context("docs/runbook.md")?;
    let anchors = heading_anchors(&runbook);
    let mut linked = BTreeSet::new();
    for rule in alert_rules()? {
        let name = rule["alert"].as_str().context("a rule without a name")?;
        let expr = rule["expr"].as_str().context("a rule without expr")?;
        // `up` is Prometheus's own, per scrape target.
        check_expression(expr, &["up"], &known).with_context(|| format!("alert {name}"))?;
        ensure!(
            rule["annotations"]["summary"].is_string() && rule["labels"]["severity"].is_string(),
            "alert {name} needs a summary and a severity"
        );
        // Every alert says where its runbook is, and that section exists.
        let url = rule["annotations"]["runbook_url"]
            .as_str()
            .with_context(|| format!("alert {name} has no runbook_url"))?;
        let anchor = url
            .strip_prefix(RUNBOOK_BASE)
            .with_context(|| format!("alert {name}: runbook_url {url} is not {RUNBOOK_BASE}…"))?;
        ensure!(
            anchors.contains(anchor),
            "alert {name}: docs/runbook.md has no section #{anchor} (its anchors: {anchors:?})"
        );
        linked.insert(anchor.to_owned());
    }
    // And no runbook section outlives its alert (alerts' sections are their names: one
    // word, unlike the page's title).
    let orphans: Vec<&String> = anchors
        .iter()
        .filter(|a| a.starts_with("cellgate") && !a.contains('-'))
        .filter(|a| !linked.contains(*a))
        .collect();
    ensure!(
        orphans.is_empty(),
        "runbook sections no alert links: {orphans:?}"
    );
    Ok(())
}

/// Every counter an alerting rule watches (a `_total` or a histogram's `_bucket`) is
/// exported with at least one series at zero by a gateway that has just started, before any
/// request: Prometheus's `increase()` and `rate()` see a series' first sample as its
/// start, so without a series at zero the rule would miss the first event.
///
/// Label values come from the configuration: the policies (the repository's), and a tenant
/// named under `[tenants.limits]` with a request rate (tenants are only known from their
/// JWTs otherwise). Requests by route and status are made by requests alone: their label
/// sets are not known ahead, and the rule on them is a ratio sustained over 10 minutes,
/// which a first request missed does not change.
#[tokio::test]
async fn every_counter_the_alerts_watch_exists_at_zero_right_after_start() -> Result<()> {
    const MADE_BY_REQUESTS: &[&str] = &["cellgate_http_requests_total"];
    let mut watched = BTreeSet::new();
    for rule in alert_rules()? {
        let expr = rule["expr"].as_str().context("a rule without expr")?;
        for (name, _) in promql_selectors(expr)? {
            if name.starts_with("cellgate_")
                && (name.ends_with("_total") || name.ends_with("_bucket"))
            {
                watched.insert(name);
            }
        }
    }
    ensure!(
        watched.contains("cellgate_kernel_start_failures_total")
            && watched.contains("cellgate_rate_limited_total"),
        "the rules watch other counters now: {watched:?}"
    );
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("cellgate.toml");
    std::fs::write(
        &config,
        "[tenants]\nrate = 5\n[tenants.limits.acme]\nmax_kernels = 2\n",
    )?;
    let gateway = Gateway::builder()
        .arg("--config")
        .arg(config.to_str().context("path")?)
        .start()
        .await?;
    // The first request the gateway serves (the harness sends none before it).
    let response = gateway
        .request(reqwest::Method::GET, "/metrics")
        .send()
        .await?;
    ensure!(response.status() == 200, "/metrics: {}", response.status());
    let text = response.text().await?;
    let series: Vec<(&str, &str)> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .collect();
    for name in &watched {
        if MADE_BY_REQUESTS.contains(&name.as_str()) {
            continue;
        }
        let found: Vec<&(&str, &str)> = series
            .iter()
            .filter(|(s, _)| s.split('{').next() == Some(name.as_str()))
            .collect();
        ensure!(
            !found.is_empty(),
            "{name} has no series before its first event:\n{text}"
        );
        // At zero: made ahead, not by an event.
        for (s, value) in found {
            ensure!(*value == "0", "{s} is {value} before anything happened");
        }
    }
    ensure!(
        text.contains("cellgate_rate_limited_total{tenant=\"acme\"} 0"),
        "the configured tenant's counter:\n{text}"
    );
    Ok(())
}
