//! jupyter_server 2.21.1 in gateway mode (`--GatewayClient.url`) in front of cellgate, driven
//! through jupyter_server's own REST and WebSocket API the way the JupyterLab frontend drives
//! it. This is the deployment the Kernel Gateway contract exists for (gateway-contract.md
//! 1.1, 1.13): if this test passes, `jupyter lab --gateway-url` works against cellgate.
//!
//! What jupyter_server does that may surprise (observed with this test, jupyter_server 2.21.1,
//! tornado 6.6.1):
//! - It refuses to start as root without `--ServerApp.allow_root=True`, and
//!   `--ServerApp.token` is deprecated in favour of `--IdentityProvider.token`.
//! - `POST /api/sessions` answers with cellgate's model from the POST (`execution_state:
//!   starting`, `connections: 0`), and `GET /api/kernels/{id}` and the restart answer keep
//!   serving that cached model (stale `last_activity`, still `starting`, 0 connections) even
//!   while a socket is open. Only `GET /api/kernels` (the list) asks cellgate again, so only
//!   the list shows `connections: 1` and `idle`.
//! - The upstream socket to cellgate is opened per browser socket with the browser's
//!   `session_id`, no subprotocol (legacy framing), `Authorization: token …`.
//! - Frames are relayed as text; the `execute_reply` can reach the browser after the
//!   execution's `idle` status (shell and iopub are separate streams), so a client must wait
//!   for both (the harness's `collect` does).
//! - After `DELETE /api/sessions/{id}` cellgate closes the upstream socket (1001), and
//!   jupyter_server then tries to re-open it up to 5 times with back-off (each gets 404 and
//!   logs "Future exception was never retrieved … HTTP 404"), while the browser-side socket is
//!   left open and silent: `GatewayWebSocketConnection` never closes it.
//! - (Read in `jupyter_server/gateway/connections.py`, not exercised here.) A binary upstream
//!   frame (a legacy message with buffers) is `decode("utf8")`d and relayed as text; that
//!   raises outside the `try`, ending the relay task, unless the frame happens to be UTF-8.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::support::*;

const LAB_TOKEN: &str = "lab-token-9876543210";

/// A jupyter_server process in gateway mode, in its own process group, with private HOME and
/// Jupyter directories so no user or system configuration is read. Killed (the whole group)
/// on drop.
struct JupyterServer {
    child: Child,
    /// Set once the group was killed and the child reaped: its pid may be reused after that.
    reaped: bool,
    base: String,
    http: reqwest::Client,
    log: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Pids of the live processes in process group `pgid`.
fn group_members(pgid: u32) -> Vec<u32> {
    let mut out = vec![];
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command: state, ppid, pgrp, …
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid) && alive(pid) {
            out.push(pid);
        }
    }
    out
}

/// The URL jupyter_server wrote to its server info file (`jpserver-<pid>.json`), which it
/// writes once it listens.
fn server_info_url(runtime_dir: &Path) -> Option<String> {
    for entry in std::fs::read_dir(runtime_dir).ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("jpserver-") && name.ends_with(".json") {
            let text = std::fs::read_to_string(entry.path()).ok()?;
            let info: Value = serde_json::from_str(&text).ok()?;
            return info["url"]
                .as_str()
                .map(|u| u.trim_end_matches('/').to_owned());
        }
    }
    None
}

impl JupyterServer {
    /// `extra` are more `--Option=value` arguments for jupyter_server.
    async fn start(gateway: &Gateway, extra: &[String]) -> Result<JupyterServer> {
        let python = tools_python();
        let dir = tempfile::tempdir()?;
        let home = dir.path().join("home");
        let runtime = dir.path().join("runtime");
        let root = dir.path().join("notebooks");
        for d in [&home, &runtime, &root] {
            std::fs::create_dir_all(d)?;
        }
        let port = free_port()?;
        let gateway_token = gateway
            .token
            .clone()
            .context("the compatibility test needs a gateway with a token")?;
        let mut command = Command::new(&python);
        command
            .args(["-m", "jupyter_server"])
            .arg("--ServerApp.ip=127.0.0.1")
            .arg(format!("--ServerApp.port={port}"))
            .arg(format!("--IdentityProvider.token={LAB_TOKEN}"))
            .arg("--ServerApp.open_browser=False")
            .arg("--ServerApp.allow_root=True")
            .arg(format!("--ServerApp.root_dir={}", root.display()))
            .arg(format!("--GatewayClient.url={}", gateway.base))
            .arg(format!("--GatewayClient.auth_token={gateway_token}"))
            .args(extra)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("LANG", "C.UTF-8")
            .env("HOME", &home)
            .env("JUPYTER_CONFIG_DIR", home.join(".jupyter"))
            .env("JUPYTER_DATA_DIR", home.join("data"))
            .env("JUPYTER_RUNTIME_DIR", &runtime)
            .env("IPYTHONDIR", home.join(".ipython"))
            // No config files at all, not even the venv's etc/jupyter.
            .env("JUPYTER_NO_CONFIG", "1")
            .env("JUPYTER_PLATFORM_DIRS", "1")
            .current_dir(&root)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = command
            .spawn()
            .with_context(|| format!("spawn {} -m jupyter_server", python.display()))?;
        let log = Arc::new(Mutex::new(Vec::new()));
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    log.lock().push(line);
                }
            });
        }
        let mut server = JupyterServer {
            child,
            reaped: false,
            base: String::new(),
            http: reqwest::Client::new(),
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "jupyter_server exited ({status}) before answering /api/status:\n{}",
                    server.log()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "jupyter_server did not answer /api/status within 60 s:\n{}",
                    server.log()
                );
            }
            if server.base.is_empty() {
                if let Some(url) = server_info_url(&runtime) {
                    server.base = url;
                }
            }
            if !server.base.is_empty() {
                let answered = server
                    .request(reqwest::Method::GET, "/api/status")
                    .send()
                    .await
                    .is_ok_and(|r| r.status().as_u16() == 200);
                if answered {
                    return Ok(server);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log(&self) -> String {
        self.log.lock().join("\n")
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{}", self.base, path))
            .header("Authorization", format!("token {LAB_TOKEN}"))
    }

    async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value)> {
        let mut request = self.request(method.clone(), path);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        Ok((status, value))
    }

    /// Opens jupyter_server's kernel channels socket as the JupyterLab frontend does. It
    /// forces the legacy framing in gateway mode, so no subprotocol is offered.
    async fn connect(&self, kernel: &str, session: &str) -> Result<Client> {
        let url = format!(
            "{}/api/kernels/{kernel}/channels?session_id={session}",
            self.base.replace("http://", "ws://")
        );
        let mut request = url.into_client_request()?;
        request
            .headers_mut()
            .insert("Authorization", format!("token {LAB_TOKEN}").parse()?);
        let (socket, _) = tokio_tungstenite::connect_async(request).await?;
        Ok(Client {
            socket,
            session: session.to_owned(),
            v1: false,
        })
    }

    /// Kills the whole process group and checks that nothing of it is left.
    fn stop(mut self) -> Result<()> {
        let pgid = self.child.id();
        self.kill();
        let deadline = Instant::now() + PATIENCE;
        while !group_members(pgid).is_empty() {
            if Instant::now() > deadline {
                bail!(
                    "processes of jupyter_server's group outlived it: {:?}",
                    group_members(pgid)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn kill(&mut self) {
        if self.reaped {
            return;
        }
        // The child leads its own group (process_group(0)), so its pid is the group id.
        if let Some(pgid) = i32::try_from(self.child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reaped = true;
    }
}

impl Drop for JupyterServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn kernel_ids(list: &Value) -> Vec<String> {
    list.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|k| k["id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn jupyter_server_in_gateway_mode_drives_cellgate() -> Result<()> {
    let gateway = Gateway::start().await?;
    drive_through_jupyter_server(&gateway, &[]).await
}

/// The same path with the kernel in a microVM (`--sandbox microvm`, emulation allowed on
/// CI's machines): JupyterLab needs nothing else for a VM kernel, interrupt and restart
/// (a fresh VM) included.
///
/// A restart replaces the VM, which under emulation on a busy 2-core machine has taken more
/// than jupyter_server's default request timeout (42 s; a KVM host runs the VM at native
/// speed). The test gives jupyter_server the longer timeout an operator of an emulated host
/// would set, so what it checks is the protocol, not the emulator's speed; the time taken is
/// printed.
#[tokio::test]
async fn jupyter_server_in_gateway_mode_drives_a_microvm_kernel() -> Result<()> {
    let mut builder = Gateway::builder().arg("--microvm-allow-emulation");
    match forced_sandbox() {
        Some(forced) if forced != "microvm" => anyhow::bail!(
            "this test is about the microvm backend, but CELLGATE_TEST_SANDBOX={forced} forces another"
        ),
        Some(_) => {}
        None => builder = builder.args(&["--sandbox", "microvm"]),
    }
    let gateway = builder.start().await?;
    drive_through_jupyter_server(
        &gateway,
        &["--GatewayClient.request_timeout=300".to_owned()],
    )
    .await?;
    let log = regex::Regex::new("\x1b\\[[0-9;]*m")?
        .replace_all(&gateway.log(), "")
        .into_owned();
    assert!(
        log.contains("backend=\"microvm\""),
        "the kernels ran in microVMs:\n{log}"
    );
    Ok(())
}

/// `work`'s output, `client`'s socket read (its pings answered, its messages dropped)
/// until then; an error if the socket closes meanwhile.
async fn answering_pings<T>(
    client: &mut Client,
    work: impl std::future::Future<Output = T>,
) -> Result<T> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            done = &mut work => return Ok(done),
            frame = client.socket.next() => match frame {
                Some(Ok(WsMessage::Close(frame))) => bail!("jupyter_server closed the socket: {frame:?}"),
                Some(Ok(_)) => {}
                Some(Err(error)) => bail!("the socket failed: {error}"),
                None => bail!("jupyter_server closed the socket"),
            },
        }
    }
}

/// Opens a notebook through jupyter_server in front of `gateway`, runs, interrupts,
/// restarts and closes it as the JupyterLab frontend does.
async fn drive_through_jupyter_server(gateway: &Gateway, lab_args: &[String]) -> Result<()> {
    let lab = JupyterServer::start(gateway, lab_args).await?;
    // Both sides' logs: a socket jupyter_server gave up on (a ping timeout) is explained by
    // what the gateway did meanwhile.
    let context = |what: &str| {
        format!(
            "{what}\n--- jupyter_server log:\n{}\n--- cellgate log:\n{}",
            lab.log(),
            gateway.log()
        )
    };

    // Kernelspecs come from cellgate.
    let (status, specs) = lab
        .json(reqwest::Method::GET, "/api/kernelspecs", None)
        .await?;
    assert_eq!(status, 200, "{}", context(&specs.to_string()));
    assert_eq!(specs["default"], "python3", "{specs}");
    let (_, ours) = gateway.get_json("/api/kernelspecs").await?;
    assert_eq!(
        specs["kernelspecs"]["python3"]["spec"]["display_name"],
        ours["kernelspecs"]["python3"]["spec"]["display_name"],
        "jupyter_server lists cellgate's python3: {specs}"
    );

    // Opening a notebook: jupyter_server POSTs /api/kernels to cellgate.
    let (status, session) = lab
        .json(
            reqwest::Method::POST,
            "/api/sessions",
            Some(json!({
                "path": "Untitled.ipynb",
                "name": "Untitled.ipynb",
                "type": "notebook",
                "kernel": {"name": "python3"},
            })),
        )
        .await?;
    assert_eq!(status, 201, "{}", context(&session.to_string()));
    let session_id = session["id"].as_str().context("session id")?.to_owned();
    let kernel = session["kernel"]["id"]
        .as_str()
        .context("kernel id")?
        .to_owned();
    assert_eq!(session["kernel"]["name"], "python3");
    let (status, listed) = gateway.get_json("/api/kernels").await?;
    assert_eq!(status, 200);
    assert_eq!(
        kernel_ids(&listed),
        vec![kernel.clone()],
        "the session's kernel runs in cellgate"
    );

    // The kernel channels socket, relayed by jupyter_server to cellgate.
    let client_session = uuid::Uuid::new_v4().to_string();
    let mut client = lab.connect(&kernel, &client_session).await?;
    let msgs = client
        .run("secret = 41; print('hi'); 1+1")
        .await
        .with_context(|| context("first execution"))?;
    assert_eq!(stdout(&msgs), "hi\n");
    let results = of_type(&msgs, "execute_result");
    assert_eq!(results.len(), 1, "{msgs:?}");
    assert_eq!(results[0].content["data"]["text/plain"], "2");
    assert_eq!(reply(&msgs).content["status"], "ok");
    assert!(
        msgs.iter().all(|m| m.msg_type() != "execute_result"
            || m.parent_header["session"] == client_session.as_str()),
        "the client's own header.session survives both relays"
    );

    // jupyter_server's list asks cellgate, which counts the relay's upstream socket.
    let (status, lab_kernels) = lab.json(reqwest::Method::GET, "/api/kernels", None).await?;
    assert_eq!(status, 200, "{}", context(&lab_kernels.to_string()));
    let model = lab_kernels
        .as_array()
        .and_then(|a| a.iter().find(|k| k["id"] == kernel.as_str()))
        .with_context(|| context(&format!("kernel missing from {lab_kernels}")))?;
    assert_eq!(model["name"], "python3");
    assert_eq!(
        model["connections"], 1,
        "the list reflects cellgate's live model: {model}"
    );
    assert_eq!(model["execution_state"], "idle", "{model}");

    // Interrupt through jupyter_server's REST (the sleep is far past the wait for the cell's
    // end: only the interrupt ends it in time).
    let id = client.execute("import time; time.sleep(600)").await?;
    loop {
        let msg = client.recv(Duration::from_secs(30)).await?;
        if msg.msg_type() == "execute_input" && msg.parent_id() == id {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, body) = lab
        .json(
            reqwest::Method::POST,
            &format!("/api/kernels/{kernel}/interrupt"),
            Some(json!({})),
        )
        .await?;
    assert_eq!(status, 204, "{}", context(&body.to_string()));
    let msgs = client
        .collect(&id, 2 * PATIENCE)
        .await
        .with_context(|| context("interrupted execution"))?;
    let errors = of_type(&msgs, "error");
    assert_eq!(errors.len(), 1, "{msgs:?}");
    assert_eq!(errors[0].content["ename"], "KeyboardInterrupt");
    assert_eq!(reply(&msgs).content["status"], "error");

    // Restart through jupyter_server's REST: same id, fresh state, same socket keeps working.
    let restart_began = std::time::Instant::now();
    let restart_path = format!("/api/kernels/{kernel}/restart");
    let restart = lab.json(reqwest::Method::POST, &restart_path, Some(json!({})));
    // A browser answers jupyter_server's pings whatever its page awaits; this client does
    // only while its socket is read. An emulated VM's restart can take over two minutes on
    // a busy machine, past jupyter_server's ping timeout: the socket is read meanwhile (what
    // comes is the restart's status traffic, which nothing below looks for).
    let (status, model) = answering_pings(&mut client, restart)
        .await
        .with_context(|| context("restart"))??;
    assert_eq!(status, 200, "{}", context(&model.to_string()));
    eprintln!(
        "the restart through jupyter_server took {:.1} s",
        restart_began.elapsed().as_secs_f64()
    );
    assert_eq!(model["id"], kernel.as_str());
    let msgs = client
        .run("secret")
        .await
        .with_context(|| context("execution after restart"))?;
    let errors = of_type(&msgs, "error");
    assert_eq!(errors.len(), 1, "{msgs:?}");
    assert_eq!(errors[0].content["ename"], "NameError", "{msgs:?}");
    let msgs = client.run("1+1").await?;
    assert_eq!(
        of_type(&msgs, "execute_result")[0].content["data"]["text/plain"],
        "2"
    );

    // Closing the notebook: jupyter_server DELETEs the kernel on cellgate.
    let (status, body) = lab
        .json(
            reqwest::Method::DELETE,
            &format!("/api/sessions/{session_id}"),
            None,
        )
        .await?;
    assert_eq!(status, 204, "{}", context(&body.to_string()));
    let (status, listed) = gateway.get_json("/api/kernels").await?;
    assert_eq!(status, 200);
    assert!(
        !kernel_ids(&listed).contains(&kernel),
        "cellgate still lists the deleted session's kernel: {listed}"
    );
    let (status, _) = gateway.get_json(&format!("/api/kernels/{kernel}")).await?;
    assert_eq!(status, 404);
    assert!(
        eventually(PATIENCE, || pids_with(&kernel).is_empty()).await,
        "the kernel process is gone"
    );
    let (status, lab_kernels) = lab.json(reqwest::Method::GET, "/api/kernels", None).await?;
    assert_eq!(status, 200);
    assert!(kernel_ids(&lab_kernels).is_empty(), "{lab_kernels}");

    client.close().await;
    lab.stop()?;
    assert!(alive(gateway.pid()), "cellgate is still running");
    Ok(())
}
