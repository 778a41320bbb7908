//! A client of QEMU's machine protocol (QMP), for the few commands the warm pool needs:
//! stop a zygote VM and write its state to a snapshot (`getfd`, `stop`, `migrate`,
//! `query-migrate`, `quit`), and resume a restored one (`query-status`, `cont`).
//!
//! Written here rather than taken from the `qapi` crates: those generate bindings for every
//! command of one QEMU version, for six commands whose answers are a status string. QMP is
//! JSON lines: a greeting, `qmp_capabilities`, then a `return` or `error` line per command,
//! with asynchronous `event` lines in between (skipped).
//!
//! The VMM may run a guest that took it over, so its answers are bounded (line length, a
//! deadline on every command) like everything else from the guest's side.

use std::path::Path;
use std::time::Duration;

use cellgate_agent::protocol::read_line;
use serde_json::{json, Value};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use super::MicrovmError;

/// The longest QMP line read: answers here are a few hundred bytes.
const MAX_LINE: usize = 64 << 10;
/// How long one command may take to be answered.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// A QMP connection in command mode.
pub(super) struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

fn failed(what: impl std::fmt::Display) -> MicrovmError {
    MicrovmError::Start(format!("QMP: {what}"))
}

impl Qmp {
    /// Connects to the VMM's QMP socket at `path` (retried until `timeout` while the VMM
    /// starts) and enters command mode.
    pub(super) async fn connect(path: &Path, timeout: Duration) -> Result<Qmp, MicrovmError> {
        Qmp::connect_to(path, timeout, None).await
    }

    /// [`Qmp::connect`] to a socket in a directory the VMM's guest may have had a hand in
    /// (a running VM's, whose VMM owns it): the peer must be the process `vmm_pid`, so a
    /// link planted there cannot point the gateway at another VM's control socket.
    pub(super) async fn connect_to_vmm(
        path: &Path,
        timeout: Duration,
        vmm_pid: u32,
    ) -> Result<Qmp, MicrovmError> {
        Qmp::connect_to(path, timeout, Some(vmm_pid)).await
    }

    async fn connect_to(
        path: &Path,
        timeout: Duration,
        peer: Option<u32>,
    ) -> Result<Qmp, MicrovmError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let stream = loop {
            match super::link::connect_unix(path).await {
                Ok(stream) => break stream,
                Err(error) if tokio::time::Instant::now() >= deadline => {
                    return Err(failed(format!("{}: {error}", path.display())))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        if let Some(vmm_pid) = peer {
            super::link::check_peer(&stream, vmm_pid)
                .map_err(|e| failed(format!("{}: {e}", path.display())))?;
        }
        let (reader, writer) = stream.into_split();
        let mut qmp = Qmp {
            reader: BufReader::new(reader),
            writer,
        };
        let greeting = qmp.line().await?;
        if greeting.get("QMP").is_none() {
            return Err(failed(format!("no greeting but {greeting}")));
        }
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    /// Runs `command` with `arguments`; its `return` value.
    pub(super) async fn execute(
        &mut self,
        command: &str,
        arguments: Value,
    ) -> Result<Value, MicrovmError> {
        let mut line = json!({ "execute": command, "arguments": arguments }).to_string();
        line.push('\n');
        let exchange = async {
            self.writer
                .write_all(line.as_bytes())
                .await
                .map_err(failed)?;
            self.answer(command).await
        };
        tokio::time::timeout(COMMAND_TIMEOUT, exchange)
            .await
            .map_err(|_| failed(format!("{command}: no answer within {COMMAND_TIMEOUT:?}")))?
    }

    /// Gives the VMM `file` under `name` (QMP `getfd`: the descriptor travels with the
    /// command, as `SCM_RIGHTS`), for a later `fd:NAME`.
    pub(super) async fn send_fd(
        &mut self,
        name: &str,
        file: &std::fs::File,
    ) -> Result<(), MicrovmError> {
        use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        use std::os::fd::AsFd;
        let mut line = json!({ "execute": "getfd", "arguments": { "fdname": name } }).to_string();
        line.push('\n');
        let exchange = async {
            let stream: &tokio::net::UnixStream = self.writer.as_ref();
            loop {
                stream.writable().await.map_err(failed)?;
                let sent = stream.try_io(tokio::io::Interest::WRITABLE, || {
                    let fds = [file.as_fd()];
                    let mut space =
                        [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                    let mut control = SendAncillaryBuffer::new(&mut space);
                    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                        return Err(std::io::Error::other("no room for the descriptor"));
                    }
                    let slices = [std::io::IoSlice::new(line.as_bytes())];
                    Ok(sendmsg(
                        stream.as_fd(),
                        &slices,
                        &mut control,
                        SendFlags::NOSIGNAL,
                    )?)
                });
                match sent {
                    // The command and its descriptor went in one message; a line this short
                    // is never split by a unix socket with room for it.
                    Ok(n) if n == line.len() => break,
                    Ok(n) => return Err(failed(format!("getfd: only {n} bytes sent"))),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(failed(e)),
                }
            }
            self.answer("getfd").await.map(drop)
        };
        tokio::time::timeout(COMMAND_TIMEOUT, exchange)
            .await
            .map_err(|_| failed(format!("getfd: no answer within {COMMAND_TIMEOUT:?}")))?
    }

    /// Reads up to `command`'s answer (skipping events); its `return` value.
    async fn answer(&mut self, command: &str) -> Result<Value, MicrovmError> {
        loop {
            let answer = self.line().await?;
            if let Some(value) = answer.get("return") {
                return Ok(value.clone());
            }
            if let Some(error) = answer.get("error") {
                let desc = error.get("desc").and_then(Value::as_str).unwrap_or("?");
                return Err(failed(format!("{command}: {desc}")));
            }
            // An event: not an answer.
        }
    }

    /// The VM's run state (`running`, `paused`, `inmigrate`, `postmigrate`…).
    pub(super) async fn status(&mut self) -> Result<String, MicrovmError> {
        let status = self.execute("query-status", json!({})).await?;
        Ok(status
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned())
    }

    async fn line(&mut self) -> Result<Value, MicrovmError> {
        let line = read_line(&mut self.reader, MAX_LINE)
            .await
            .map_err(failed)?
            .ok_or_else(|| failed("the VMM closed its control socket"))?;
        serde_json::from_str(&line).map_err(failed)
    }
}

/// Writes the state of the (running) VM behind `qmp` to `file`, stopped first so nothing
/// changes meanwhile, and waits until the state is all written (at most `timeout`).
pub(super) async fn save(
    qmp: &mut Qmp,
    file: &std::fs::File,
    timeout: Duration,
) -> Result<(), MicrovmError> {
    // QEMU 7.2 takes a migration's descriptor by name only (`getfd`), not by number.
    qmp.send_fd("snapshot", file).await?;
    // QEMU's default bandwidth cap for migrations (32 MiB/s) is for live migrations over a
    // network; a stopped VM to a local file has nothing to share the bandwidth with.
    qmp.execute(
        "migrate-set-parameters",
        json!({ "max-bandwidth": 1u64 << 40 }),
    )
    .await?;
    qmp.execute("stop", json!({})).await?;
    qmp.execute("migrate", json!({ "uri": "fd:snapshot" }))
        .await?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let state = qmp.execute("query-migrate", json!({})).await?;
        match state
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("none")
        {
            "completed" => return Ok(()),
            "failed" | "cancelled" => {
                let why = state
                    .get("error-desc")
                    .and_then(Value::as_str)
                    .unwrap_or("no reason given");
                return Err(failed(format!("saving the VM failed: {why}")));
            }
            _ if tokio::time::Instant::now() >= deadline => {
                return Err(failed(format!("saving the VM took over {timeout:?}")))
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Waits until a VM started with `-incoming` has loaded its state (at most `timeout`),
/// then runs it: a snapshot of a stopped VM loads paused.
pub(super) async fn resume(
    qmp: &mut Qmp,
    timeout: Duration,
    ran: impl FnOnce(),
) -> Result<(), MicrovmError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match qmp.status().await?.as_str() {
            "inmigrate" if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            "inmigrate" => {
                return Err(failed(format!(
                    "the snapshot was not loaded within {timeout:?}"
                )))
            }
            "running" => {
                ran();
                return Ok(());
            }
            "paused" | "postmigrate" | "prelaunch" => {
                // From the `cont` on, the guest may run whatever its answer.
                ran();
                qmp.execute("cont", json!({})).await?;
                return Ok(());
            }
            other => {
                return Err(failed(format!(
                    "the VM is {other:?} after loading the snapshot"
                )))
            }
        }
    }
}
