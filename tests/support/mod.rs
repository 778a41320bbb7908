//! Test harness: a real `cellgate serve` process on 127.0.0.1:0 with real kernels, plus an
//! HTTP client and a Jupyter WebSocket client speaking either framing; [`v1`] is the API v1
//! client.

pub mod kube_api;
pub mod v1;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message as WsMessage;

pub const TOKEN: &str = "test-token-0123456789";

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The kernels directory: `CELLGATE_KERNELS_DIR` or the repository's `kernels/`. A missing
/// kernel environment is a loud failure, never a skip: `./dev setup` creates it.
pub fn kernels_dir() -> PathBuf {
    let dir = std::env::var("CELLGATE_KERNELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo().join("kernels"));
    let python = dir.join("python3/.venv/bin/python");
    assert!(
        python.exists(),
        "the kernel environment {} is missing: run `./dev setup` (these tests need a real ipykernel)",
        python.display()
    );
    dir
}

/// The sandbox the tests run kernels in: the real default (`namespaces`, what the policies
/// name) unless `CELLGATE_TEST_SANDBOX` names another, which the gateways then force on
/// every kernel (`--sandbox`).
pub fn sandbox_backend() -> String {
    forced_sandbox().unwrap_or_else(|| "namespaces".to_owned())
}

/// The backend of the attack suite's attackers: `CELLGATE_TEST_ATTACKER_SANDBOX` (their
/// policies name it, while the bystander stays in the default sandbox), else the one every
/// kernel runs in.
pub fn attacker_backend() -> String {
    std::env::var("CELLGATE_TEST_ATTACKER_SANDBOX")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(sandbox_backend)
}

/// The backend `CELLGATE_TEST_SANDBOX` forces, if any.
pub fn forced_sandbox() -> Option<String> {
    std::env::var("CELLGATE_TEST_SANDBOX")
        .ok()
        .filter(|s| !s.is_empty())
}

/// The Python with jupyter_server, jupyter_client and Kernel Gateway (`.venv-tools`).
pub fn tools_python() -> PathBuf {
    let python = std::env::var("CELLGATE_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo().join(".venv-tools/bin/python"));
    assert!(
        python.exists(),
        "the tools environment {} is missing: run `./dev setup`",
        python.display()
    );
    python
}

/// A running gateway process. Killed (SIGKILL) on drop.
pub struct Gateway {
    pub child: Child,
    pub base: String,
    pub port: u16,
    pub token: Option<String>,
    pub http: reqwest::Client,
    log: std::sync::Arc<parking_lot::Mutex<Vec<String>>>,
    stdout: std::sync::Arc<parking_lot::Mutex<Vec<String>>>,
    /// The state directory the builder made for this gateway alone (removed with it).
    _state_dir: Option<tempfile::TempDir>,
}

pub struct GatewayBuilder {
    args: Vec<String>,
    token: Option<String>,
    kernels_dir: PathBuf,
    policies_dir: PathBuf,
}

impl GatewayBuilder {
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }
    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_owned());
        self
    }
    pub fn token(mut self, token: Option<&str>) -> Self {
        self.token = token.map(str::to_owned);
        self
    }
    pub fn policies_dir(mut self, dir: PathBuf) -> Self {
        self.policies_dir = dir;
        self
    }
    pub fn kernels_dir(mut self, dir: PathBuf) -> Self {
        self.kernels_dir = dir;
        self
    }

    pub async fn start(self) -> Result<Gateway> {
        let mut command = Command::new(env!("CARGO_BIN_EXE_cellgate"));
        command
            .arg("serve")
            .args(["--ip", "127.0.0.1", "--port", "0"])
            .args(
                forced_sandbox()
                    .map(|backend| vec!["--sandbox".to_owned(), backend])
                    .unwrap_or_default(),
            )
            .arg("--kernels-dir")
            .arg(&self.kernels_dir)
            .arg("--policies-dir")
            .arg(&self.policies_dir)
            .args(&self.args)
            .env_remove("CELLGATE_AUTH_TOKEN")
            .env_remove("KG_AUTH_TOKEN")
            .env("RUST_LOG", "info,zeromq=error")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(token) = &self.token {
            command.args(["--token", token]);
        }
        // No warm pool unless a test asks for one: each pooled kernel costs a kernel start.
        if !self.args.iter().any(|a| a == "--pool-size") {
            command.args(["--pool-size", "0"]);
        }
        // No kernel zygote unless a test asks for one (the zygote's own tests, the attack
        // suite): each costs its imports, seconds of CPU, once per gateway, and most tests
        // start one gateway for a kernel or two. Cold kernels are the product's path too
        // (`--kernel-zygote false`, a policy's `zygote = false`, a failed zygote).
        if !self.args.iter().any(|a| a == "--kernel-zygote") {
            command.args(["--kernel-zygote", "false"]);
        }
        // Under emulation (tests/it/cgroup_v2.rs runs tests in an emulated VM, beside the
        // rest of the suite) a kernel's start can take longer than the default 60 s: the VM
        // sets a longer bound, which only fails a start that never ends.
        if !self.args.iter().any(|a| a == "--start-timeout") {
            if let Ok(seconds) = std::env::var("CELLGATE_TEST_START_TIMEOUT") {
                command.args(["--start-timeout", &seconds]);
            }
        }
        // Kernels end with their gateway unless a test asks otherwise: hundreds of test
        // gateways are dropped or killed, and their kernels must not pile up on the machine
        // for an orphan's grace (tests/it/adoption.rs asks, with a short grace).
        if !self.args.iter().any(|a| a == "--kernels-outlive-gateway") {
            command.args(["--kernels-outlive-gateway", "false"]);
        }
        // Every serve option reads a CELLGATE_* (or KG_*) variable: one set in the shell that
        // runs the tests would change every gateway. Only the machine's own facts pass.
        for (name, _) in std::env::vars_os() {
            let Some(name) = name.to_str() else { continue };
            let ours = name.starts_with("CELLGATE_") || name.starts_with("KG_");
            let kept = matches!(
                name,
                "CELLGATE_GUEST_DIR" | "CELLGATE_TOOLS_PYTHON" | "CELLGATE_MICROVM_ALLOW_EMULATION"
            ) || name.starts_with("CELLGATE_TEST_");
            if ours && !kept {
                command.env_remove(name);
            }
        }
        // A state directory of its own unless the test names one: gateways running at once
        // must not share one (the second would be refused), nor leave state behind.
        let state_dir = if self.args.iter().any(|a| a == "--state-dir") {
            None
        } else {
            let dir = tempfile::Builder::new().prefix("cg-state").tempdir()?;
            command.arg("--state-dir").arg(dir.path());
            Some(dir)
        };
        let child = command.spawn().context("spawn cellgate")?;
        let mut gateway = Gateway::attach(child, self.token).await?;
        gateway._state_dir = state_dir;
        Ok(gateway)
    }
}

impl Gateway {
    /// Takes over a `cellgate serve` process started with piped stdout and stderr (a test
    /// that builds its own command line): waits for its "listening" line and collects its
    /// log. `token` is what clients present.
    pub async fn attach(mut child: Child, token: Option<String>) -> Result<Gateway> {
        let stdout = child.stdout.take().context("stdout")?;
        let stderr = child.stderr.take().context("stderr")?;
        let log = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let log_err = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log_err.lock().push(line);
            }
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let printed = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let printed_out = printed.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("cellgate listening on ") {
                    let _ = tx.send(url.trim_end_matches('/').to_owned());
                }
                printed_out.lock().push(line);
            }
        });
        let base = rx
            .recv_timeout(PATIENCE)
            .map_err(|_| anyhow!("cellgate did not start: {:?}", log.lock()))?;
        // The printed address ends with the base URL (`http://127.0.0.1:PORT/gw`).
        let port = base
            .trim_start_matches("http://")
            .split('/')
            .next()
            .unwrap_or_default()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .context("port")?;
        Ok(Gateway {
            child,
            base,
            port,
            token,
            http: reqwest::Client::new(),
            log,
            stdout: printed,
            _state_dir: None,
        })
    }
}

impl Drop for Gateway {
    /// SIGTERM first, as an operator stops it: the gateway ends its kernels and removes its
    /// runtime directory (a SIGKILL left one behind in /tmp per test gateway, gigabytes
    /// over a few runs). SIGKILL after 10 s, for a gateway a test left stuck.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Gateway {
    pub fn builder() -> GatewayBuilder {
        GatewayBuilder {
            args: vec![],
            token: Some(TOKEN.to_owned()),
            kernels_dir: kernels_dir(),
            policies_dir: repo().join("policies"),
        }
    }

    pub async fn start() -> Result<Gateway> {
        Gateway::builder().start().await
    }

    /// A gateway whose only policy, `default`, runs the test sandbox
    /// ([`sandbox_backend`]) with the policy lines `policy` after `[sandbox]`'s backend
    /// (further sections included), and these extra arguments. The directory must outlive
    /// the gateway.
    pub async fn with_default_policy(
        policy: &str,
        args: &[&str],
    ) -> Result<(Gateway, tempfile::TempDir)> {
        let dir = tempfile::tempdir()?;
        std::fs::write(
            dir.path().join("default.toml"),
            format!("[sandbox]\nbackend = \"{}\"\n{policy}", sandbox_backend()),
        )?;
        let gateway = Gateway::builder()
            .policies_dir(dir.path().to_owned())
            .args(args)
            .start()
            .await?;
        Ok((gateway, dir))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        self.log.lock().join("\n")
    }

    /// What the gateway printed on stdout so far, one line each.
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout.lock().clone()
    }

    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut request = self.http.request(method, format!("{}{}", self.base, path));
        if let Some(token) = &self.token {
            request = request.header("Authorization", format!("token {token}"));
        }
        request
    }

    pub async fn get_json(&self, path: &str) -> Result<(u16, Value)> {
        let response = self.request(reqwest::Method::GET, path).send().await?;
        let status = response.status().as_u16();
        let body = response.text().await?;
        Ok((
            status,
            serde_json::from_str(&body).unwrap_or(Value::String(body)),
        ))
    }

    pub async fn start_kernel(&self) -> Result<String> {
        self.start_kernel_named("python3").await
    }

    pub async fn start_kernel_named(&self, name: &str) -> Result<String> {
        let response = self
            .request(reqwest::Method::POST, "/api/kernels")
            .json(&json!({"name": name}))
            .send()
            .await?;
        if response.status().as_u16() != 201 {
            bail!(
                "start kernel: {} {}",
                response.status(),
                response.text().await?
            );
        }
        let model: Value = response.json().await?;
        Ok(model["id"].as_str().context("id")?.to_owned())
    }

    pub async fn delete_kernel(&self, id: &str) -> Result<u16> {
        Ok(self
            .request(reqwest::Method::DELETE, &format!("/api/kernels/{id}"))
            .send()
            .await?
            .status()
            .as_u16())
    }

    pub fn ws_url(&self, kernel: &str, session: &str) -> String {
        format!(
            "{}/api/kernels/{kernel}/channels?session_id={session}",
            self.base.replace("http://", "ws://")
        )
    }

    /// The HTTP status of a kernel channels WebSocket upgrade with these extra headers
    /// (101 when it was accepted; the socket is then closed).
    pub async fn ws_upgrade_status(&self, kernel: &str, headers: &[(&str, &str)]) -> Result<u16> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let mut request = self
            .ws_url(kernel, "upgrade-status")
            .into_client_request()?;
        for (name, value) in headers {
            let name =
                tokio_tungstenite::tungstenite::http::HeaderName::from_bytes(name.as_bytes())?;
            request.headers_mut().insert(name, value.parse()?);
        }
        match tokio_tungstenite::connect_async(request).await {
            Ok((mut socket, response)) => {
                socket.close(None).await.ok();
                Ok(response.status().as_u16())
            }
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                Ok(response.status().as_u16())
            }
            Err(err) => Err(err.into()),
        }
    }

    /// Connects a Jupyter client to a kernel.
    pub async fn connect(&self, kernel: &str, session: &str, v1: bool) -> Result<Client> {
        self.connect_as(kernel, session, v1, self.token.as_deref())
            .await
    }

    /// Connects a legacy-framing client that presents `token` (e.g. a tenant's JWT).
    pub async fn connect_with(&self, kernel: &str, session: &str, token: &str) -> Result<Client> {
        self.connect_as(kernel, session, false, Some(token)).await
    }

    async fn connect_as(
        &self,
        kernel: &str,
        session: &str,
        v1: bool,
        token: Option<&str>,
    ) -> Result<Client> {
        let mut request = self.ws_url(kernel, session).into_client_request()?;
        if let Some(token) = token {
            request
                .headers_mut()
                .insert("Authorization", format!("token {token}").parse()?);
        }
        if v1 {
            request.headers_mut().insert(
                "Sec-WebSocket-Protocol",
                "v1.kernel.websocket.jupyter.org".parse()?,
            );
        }
        let (socket, response) = tokio_tungstenite::connect_async(request).await?;
        let protocol = response
            .headers()
            .get("sec-websocket-protocol")
            .map(|v| v.to_str().unwrap_or_default().to_owned());
        if v1 {
            assert_eq!(protocol.as_deref(), Some("v1.kernel.websocket.jupyter.org"));
        } else {
            assert_eq!(protocol, None);
        }
        Ok(Client {
            socket,
            session: session.to_owned(),
            v1,
        })
    }
}

pub type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A message as a client sees it.
#[derive(Debug, Clone)]
pub struct Msg {
    pub channel: String,
    pub header: Value,
    pub parent_header: Value,
    pub metadata: Value,
    pub content: Value,
    pub buffers: Vec<Vec<u8>>,
}

impl Msg {
    pub fn msg_type(&self) -> &str {
        self.header["msg_type"].as_str().unwrap_or_default()
    }
    pub fn parent_id(&self) -> &str {
        self.parent_header["msg_id"].as_str().unwrap_or_default()
    }
    pub fn is_idle_for(&self, msg_id: &str) -> bool {
        self.msg_type() == "status"
            && self.content["execution_state"] == "idle"
            && self.parent_id() == msg_id
    }
}

pub struct Client {
    pub socket: Socket,
    pub session: String,
    pub v1: bool,
}

fn header(msg_type: &str, session: &str) -> Value {
    json!({
        "msg_id": uuid::Uuid::new_v4().to_string(),
        "msg_type": msg_type,
        "session": session,
        "username": "test",
        "date": "2026-11-22T00:00:00.000000Z",
        "version": "5.4",
    })
}

fn v1_encode(channel: &str, parts: &[Vec<u8>]) -> Vec<u8> {
    let mut all = vec![channel.as_bytes().to_vec()];
    all.extend(parts.iter().cloned());
    let k = all.len() + 1;
    let mut out = (k as u64).to_le_bytes().to_vec();
    let mut offset = 8 * (k as u64 + 1);
    for p in &all {
        out.extend_from_slice(&offset.to_le_bytes());
        offset += p.len() as u64;
    }
    out.extend_from_slice(&offset.to_le_bytes());
    for p in &all {
        out.extend_from_slice(p);
    }
    out
}

fn legacy_binary_encode(json: &[u8], buffers: &[Vec<u8>]) -> Vec<u8> {
    let n = 1 + buffers.len();
    let mut out = (n as u32).to_be_bytes().to_vec();
    let mut offset = 4 * (n as u32 + 1);
    out.extend_from_slice(&offset.to_be_bytes());
    offset += json.len() as u32;
    for b in buffers {
        out.extend_from_slice(&offset.to_be_bytes());
        offset += b.len() as u32;
    }
    out.extend_from_slice(json);
    for b in buffers {
        out.extend_from_slice(b);
    }
    out
}

/// Decodes one frame as a client of the given framing sees it.
pub fn decode_for_test(frame: WsMessage, v1: bool) -> Result<Option<Msg>> {
    decode_frame(frame, v1)
}

fn decode_frame(frame: WsMessage, v1: bool) -> Result<Option<Msg>> {
    match frame {
        WsMessage::Text(text) => {
            let v: Value = serde_json::from_str(text.as_str())?;
            Ok(Some(Msg {
                channel: v["channel"].as_str().unwrap_or_default().to_owned(),
                header: v["header"].clone(),
                parent_header: v["parent_header"].clone(),
                metadata: v["metadata"].clone(),
                content: v["content"].clone(),
                buffers: vec![],
            }))
        }
        WsMessage::Binary(bytes) if v1 => {
            let k = u64::from_le_bytes(bytes[0..8].try_into()?) as usize;
            let offsets: Vec<usize> = (0..k)
                .map(|i| {
                    u64::from_le_bytes(bytes[8 + 8 * i..16 + 8 * i].try_into().unwrap()) as usize
                })
                .collect();
            let parts: Vec<&[u8]> = offsets.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
            Ok(Some(Msg {
                channel: String::from_utf8(parts[0].to_vec())?,
                header: serde_json::from_slice(parts[1])?,
                parent_header: serde_json::from_slice(parts[2])?,
                metadata: serde_json::from_slice(parts[3])?,
                content: serde_json::from_slice(parts[4])?,
                buffers: parts[5..].iter().map(|p| p.to_vec()).collect(),
            }))
        }
        WsMessage::Binary(bytes) => {
            let n = u32::from_be_bytes(bytes[0..4].try_into()?) as usize;
            let mut offsets: Vec<usize> = (0..n)
                .map(|i| {
                    u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize
                })
                .collect();
            offsets.push(bytes.len());
            let parts: Vec<&[u8]> = offsets.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
            let v: Value = serde_json::from_slice(parts[0])?;
            Ok(Some(Msg {
                channel: v["channel"].as_str().unwrap_or_default().to_owned(),
                header: v["header"].clone(),
                parent_header: v["parent_header"].clone(),
                metadata: v["metadata"].clone(),
                content: v["content"].clone(),
                buffers: parts[1..].iter().map(|p| p.to_vec()).collect(),
            }))
        }
        _ => Ok(None),
    }
}

impl Client {
    /// Sends a message; returns its msg_id.
    pub async fn send(
        &mut self,
        channel: &str,
        msg_type: &str,
        content: Value,
        buffers: Vec<Vec<u8>>,
    ) -> Result<String> {
        let header = header(msg_type, &self.session);
        let msg_id = header["msg_id"].as_str().unwrap_or_default().to_owned();
        let frame = if self.v1 {
            let parts = vec![
                serde_json::to_vec(&header)?,
                b"{}".to_vec(),
                b"{}".to_vec(),
                serde_json::to_vec(&content)?,
            ];
            let mut all = parts;
            all.extend(buffers);
            WsMessage::Binary(v1_encode(channel, &all).into())
        } else {
            let msg = json!({"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": channel});
            if buffers.is_empty() {
                WsMessage::Text(msg.to_string().into())
            } else {
                WsMessage::Binary(legacy_binary_encode(msg.to_string().as_bytes(), &buffers).into())
            }
        };
        self.socket.send(frame).await?;
        Ok(msg_id)
    }

    pub async fn execute(&mut self, code: &str) -> Result<String> {
        self.send(
            "shell",
            "execute_request",
            json!({"code": code, "silent": false, "store_history": true, "user_expressions": {}, "allow_stdin": true, "stop_on_error": true}),
            vec![],
        )
        .await
    }

    /// The next Jupyter message, or an error after `timeout`.
    pub async fn recv(&mut self, timeout: Duration) -> Result<Msg> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let frame = tokio::time::timeout(left, self.socket.next())
                .await
                .map_err(|_| anyhow!("no message within {timeout:?}"))?
                .ok_or_else(|| anyhow!("socket closed"))??;
            if let WsMessage::Close(frame) = &frame {
                bail!("socket closed by the gateway: {frame:?}");
            }
            if let Some(msg) = decode_frame(frame, self.v1)? {
                return Ok(msg);
            }
        }
    }

    /// Every message until the idle status of `msg_id` and its shell reply have both arrived.
    pub async fn collect(&mut self, msg_id: &str, timeout: Duration) -> Result<Vec<Msg>> {
        let deadline = Instant::now() + timeout;
        let mut out = vec![];
        let (mut idle, mut reply) = (false, false);
        while !(idle && reply) {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = self.recv(left).await.with_context(|| {
                format!(
                    "waiting for {msg_id}; got so far: {:?}",
                    out.iter()
                        .map(|m: &Msg| m.msg_type().to_owned())
                        .collect::<Vec<_>>()
                )
            })?;
            if msg.is_idle_for(msg_id) {
                idle = true;
            }
            if msg.channel == "shell" && msg.parent_id() == msg_id {
                reply = true;
            }
            out.push(msg);
        }
        Ok(out)
    }

    pub async fn run(&mut self, code: &str) -> Result<Vec<Msg>> {
        let id = self.execute(code).await?;
        self.collect(&id, PATIENCE).await
    }

    pub async fn close(mut self) {
        let _ = self.socket.close(None).await;
    }
}

/// Concatenated stdout of a list of messages.
pub fn stdout(msgs: &[Msg]) -> String {
    msgs.iter()
        .filter(|m| m.msg_type() == "stream" && m.content["name"] == "stdout")
        .map(|m| m.content["text"].as_str().unwrap_or_default())
        .collect()
}

pub fn of_type<'a>(msgs: &'a [Msg], msg_type: &str) -> Vec<&'a Msg> {
    msgs.iter().filter(|m| m.msg_type() == msg_type).collect()
}

pub fn reply(msgs: &[Msg]) -> &Msg {
    msgs.iter()
        .find(|m| m.channel == "shell" && m.msg_type().ends_with("_reply"))
        .expect("a shell reply")
}

/// Whether a process is alive (and not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .map(|(_, r)| r.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// How many host processes carry a kernel's id on their command line: the kernel itself, or
/// under gVisor `runsc run`, the Sentry and the gofer (the kernel has no host process).
pub fn host_processes_per_kernel(backend: &str) -> usize {
    if backend == "gvisor" {
        3
    } else {
        1
    }
}

/// Whether a child process's OOM kill ends the whole sandbox (gVisor: the Sentry is one
/// process for the cgroup's OOM killer) rather than only the child (namespaces).
pub fn child_oom_ends_the_sandbox(backend: &str) -> bool {
    backend == "gvisor"
}

/// Pids of the processes whose command line contains `needle`.
pub fn pids_with(needle: &str) -> Vec<u32> {
    let mut out = vec![];
    // A namespaces sandbox shows the kernel its connection file at a fixed path, so its
    // command line no longer names the kernel: the kernel process is the launcher whose
    // environment says `KERNEL_ID=<id>`.
    let env_entry = format!("KERNEL_ID={needle}\0");
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd);
            let matches = cmd.contains(needle)
                || (cmd.contains("cellgate_kernel_launcher")
                    && std::fs::read(format!("/proc/{pid}/environ"))
                        .is_ok_and(|env| String::from_utf8_lossy(&env).contains(&env_entry)));
            if matches && alive(pid) {
                out.push(pid);
            }
        }
    }
    out
}

/// How many times the cgroup CPU controller held back the kernel of `kernel_id`
/// (`nr_throttled` in `cpu.stat`, v1 or v2, the most of the cgroups of the host processes
/// that carry its id: under gVisor some of them sit outside the limited cgroup), read from
/// the host's cgroup filesystem; `None` when there is no such process or cgroup.
pub fn cpu_throttled(kernel_id: &str) -> Option<u64> {
    pids_with(kernel_id)
        .into_iter()
        .filter_map(|pid| {
            let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
            cgroups.lines().find_map(|line| {
                let mut fields = line.splitn(3, ':');
                let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
                let path = path.trim_start_matches('/');
                let dirs: Vec<PathBuf> = if controllers.is_empty() {
                    vec![PathBuf::from("/sys/fs/cgroup").join(path)]
                } else if controllers.split(',').any(|c| c == "cpu") {
                    ["cpu,cpuacct", "cpu", "cpuacct,cpu"]
                        .iter()
                        .map(|mount| PathBuf::from("/sys/fs/cgroup").join(mount).join(path))
                        .collect()
                } else {
                    vec![]
                };
                dirs.iter().find_map(|dir| {
                    let stat = std::fs::read_to_string(dir.join("cpu.stat")).ok()?;
                    stat.lines()
                        .find_map(|l| l.strip_prefix("nr_throttled "))?
                        .trim()
                        .parse()
                        .ok()
                })
            })
        })
        .max()
}

/// How long a test waits for something that must happen (a process to go, a message or a log
/// line to come, a kernel to be culled): long enough that only something broken, never a
/// slow or busy machine, takes it. Reached only when a test fails, so it costs nothing. Four
/// minutes: the first message of a cell may wait for an emulated VM's kernel to start, which
/// the gateway allows five (`Sandbox::start_time_factor`); 60 s failed a loaded run. Twice
/// this stays below the 600 s sleeps that only an interrupt may end in time.
pub const PATIENCE: Duration = Duration::from_secs(240);

/// Polls `check` until it holds or `timeout` passes.
pub async fn eventually<F: FnMut() -> bool>(timeout: Duration, mut check: F) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}
