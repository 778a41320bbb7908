//! The gateway's side of the guest agent (`guest/agent`), shared by the backends whose
//! kernels run behind one: a microVM's (over vsock or virtio-serial) and a Kubernetes
//! pod's (over TCP, after a proof of the kernel's key). One authenticated byte stream
//! carries a yamux session: the control stream ([`session`]), one stream per ZMQ
//! connection, joined to unix sockets at the kernel's ipc paths ([`channels`], so
//! `KernelClient` is the same for every backend), one per workspace file operation
//! ([`files`]), and the guest's egress connections, joined to the egress proxy.
//!
//! Over TCP, before the handshake, both ends prove the kernel's 256-bit key with an
//! HMAC-SHA256 over a fresh nonce from each side (the labels differ per direction, so
//! neither proof replays as the other); the agent runs proofs concurrently (16 at most, 10 s
//! each), and a connection that proves the key supersedes the session before it, so a
//! replica can take a kernel over from one that vanished without closing. This
//! authenticates; it does not encrypt (SCALING.md).
//!
//! Everything the agent sends is hostile input: see each module.

pub mod channels;
pub mod files;
pub mod session;

use std::path::Path;
use std::time::Duration;

use cellgate_agent::protocol::{
    self, auth, check_guest_proof, host_proof, read_line, ConnectionFile, Op, Reply, Start,
    LOG_TAIL_BYTES,
};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

use super::relocate::{self, Relocation};
use super::LaunchSpec;

pub use session::{Agent, Duplex};

/// What went wrong with an agent: the sentence says it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AgentError(pub String);

/// The host's side of the TCP proof (`cellgate_agent::protocol`'s module doc): sends its
/// nonce, checks the guest's proof of `key`, answers with its own. Within `deadline`; the
/// stream, with whatever the guest sent after its proof, is returned for [`Agent::connect`].
pub async fn prove<S>(io: S, key: &[u8], deadline: Duration) -> Result<BufReader<S>, AgentError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let nonce = format!("{:032x}", rand::random::<u128>());
    let mut io = BufReader::new(io);
    let exchange = async {
        let failed = |e: std::io::Error| AgentError(format!("the key proof: {e}"));
        io.get_mut()
            .write_all(auth(&nonce).as_bytes())
            .await
            .map_err(failed)?;
        io.get_mut().flush().await.map_err(failed)?;
        let line = read_line(&mut io, 512)
            .await
            .map_err(|e| AgentError(format!("the key proof: {e}")))?
            .ok_or_else(|| AgentError("the agent closed the connection before its proof".into()))?;
        let guest_nonce = check_guest_proof(key, &nonce, &line)
            .ok_or_else(|| {
                AgentError(
                    "the agent did not prove the kernel's key: this is not the kernel's pod".into(),
                )
            })?
            .to_owned();
        io.get_mut()
            .write_all(host_proof(key, &nonce, &guest_nonce).as_bytes())
            .await
            .map_err(failed)?;
        io.get_mut().flush().await.map_err(failed)?;
        Ok::<(), AgentError>(())
    };
    match tokio::time::timeout(deadline, exchange).await {
        Ok(result) => result.map(|()| io),
        Err(_) => Err(AgentError(format!(
            "the agent did not prove the key within {deadline:?} ({})",
            protocol::MAGIC
        ))),
    }
}

/// Asks the agent to start the kernel (as `uid`, where the agent may change ids), at the
/// fixed paths of [`relocation`].
pub async fn start_kernel(
    agent: &Agent,
    spec: &LaunchSpec,
    map: &Relocation,
    connection: Option<ConnectionFile>,
    uid: u32,
) -> Result<(), AgentError> {
    let start = Start {
        argv: map.argv(&spec.argv),
        env: map.env(&spec.env),
        cwd: relocate::WORKSPACE.to_owned(),
        connection,
        uid,
        gid: uid,
        pids: spec.limits.pids,
        memory_bytes: spec.limits.memory_bytes,
    };
    match agent.request(Op::Start(start)).await? {
        Reply::Started { .. } => Ok(()),
        other => Err(AgentError(format!("unexpected reply {other:?}"))),
    }
}

/// Python modules the guest image's environment starts kernels with: its own (a VM's root
/// image and the kernel pod's image hold the python3 kernel's venv, nothing else).
const IMAGE_KERNEL_MODULES: &[&str] = &[
    "cellgate_kernel_launcher",
    "ipykernel_launcher",
    "ipykernel",
];

/// Refuses, before any VM or pod is made, a kernel the guest's image cannot run: one whose
/// environment is not a Python venv starting ipykernel (Deno's, R's, bash_kernel's). The
/// image holds the python3 kernel's environment only; without this the start would fail
/// inside the guest with a missing file or module.
pub fn check_image_runs(spec: &LaunchSpec, backend: &str) -> Result<(), AgentError> {
    // A plain program (a probe, a tool, a test's command) is no kernel: the image's own
    // files are what it runs.
    if !spec.connection_file.is_file() {
        return Ok(());
    }
    if runs_in_image(&spec.argv) {
        return Ok(());
    }
    Err(AgentError(format!(
        "this kernel cannot run in a {backend} sandbox: its image holds the python3 kernel's \
         environment only (run other kernelspecs under a namespaces or gvisor policy)"
    )))
}

/// Whether a kernel command is one the guest's image can run: a Python venv's interpreter
/// starting one of the image's kernel modules (`python [-X… -u -E…] -m module`).
pub fn runs_in_image(argv: &[String]) -> bool {
    let program = Path::new(argv.first().map(String::as_str).unwrap_or_default());
    let in_venv = program
        .parent()
        .and_then(Path::parent)
        .is_some_and(|venv| venv.join("pyvenv.cfg").is_file());
    // Interpreter flags may come before `-m`.
    let flags = argv.iter().skip(1).take_while(|arg| arg.starts_with('-'));
    let module = flags
        .clone()
        .position(|arg| arg == "-m")
        .and_then(|at| argv.get(at + 2))
        .map(String::as_str);
    in_venv && module.is_some_and(|m| IMAGE_KERNEL_MODULES.contains(&m))
}

/// The kernel's paths in the guest: the same fixed paths as in every sandbox, with the
/// venv where the guest's image has it (a VM's root image, a pod's container image).
pub fn relocation(spec: &LaunchSpec) -> Relocation {
    let mut map = Relocation::new();
    map.add(&spec.workspace, relocate::WORKSPACE);
    map.add(&spec.runtime_dir, relocate::RUN_DIR);
    let program = Path::new(spec.argv.first().map(String::as_str).unwrap_or_default());
    if let Some(venv) = program
        .parent()
        .and_then(Path::parent)
        .filter(|venv| venv.join("pyvenv.cfg").is_file())
    {
        map.add(venv, relocate::VENV);
    }
    map
}

/// The kernel's connection file as the guest must have it (its ipc paths under
/// [`relocate::RUN_DIR`]); `None` when the command has none (a plain program).
pub fn guest_connection(
    spec: &LaunchSpec,
    map: &Relocation,
) -> Result<Option<ConnectionFile>, AgentError> {
    let json = match std::fs::read(&spec.connection_file) {
        Ok(json) => json,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(AgentError(format!(
                "{}: {e}",
                spec.connection_file.display()
            )))
        }
    };
    let bad = |e: serde_json::Error| AgentError(format!("the connection file: {e}"));
    let info = serde_json::from_slice(&map.connection_json(&json).map_err(bad)?).map_err(bad)?;
    Ok(Some(ConnectionFile {
        path: map.path(&spec.connection_file).display().to_string(),
        info,
    }))
}

/// Appends the kernel's log tail that the agent reported with its exit to the kernel's log
/// file on the gateway's side (where a dead kernel's reason is read from), at most
/// [`LOG_TAIL_BYTES`] of it, cut at a character boundary: the agent says how long its tail
/// is, and the gateway does not take its word.
pub fn keep_log_tail(log_file: &Path, tail: &str) {
    use std::io::Write;
    let mut end = tail.len().min(LOG_TAIL_BYTES);
    while !tail.is_char_boundary(end) {
        end -= 1;
    }
    if end == 0 {
        return;
    }
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_file)
    {
        let _ = file.write_all(&tail.as_bytes()[..end]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A kernel's launch spec: `argv`, with a connection file (so it counts as a kernel)
    /// and, when `venv`, the program in a venv.
    fn spec(dir: &Path, argv: &[&str], venv: bool) -> LaunchSpec {
        let run = dir.join("run");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(run.join("connection.json"), "{}").unwrap();
        let env_dir = dir.join("env");
        std::fs::create_dir_all(env_dir.join("bin")).unwrap();
        if venv {
            std::fs::write(env_dir.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        }
        let mut argv: Vec<String> = argv.iter().map(|a| a.to_string()).collect();
        argv[0] = env_dir.join("bin").join(&argv[0]).display().to_string();
        LaunchSpec {
            kernel_id: "k".to_owned(),
            argv,
            env: BTreeMap::new(),
            connection_file: run.join("connection.json"),
            connection: crate::protocol::ConnectionInfo::ipc(&run.join("k"), String::new(), ""),
            runtime_dir: run,
            workspace: dir.join("work"),
            log_file: dir.join("kernel.log"),
            limits: Default::default(),
            egress_socket: None,
            allow_emulation: false,
            zygote: false,
            labels: Default::default(),
            adopt: None,
            backend_settings: Default::default(),
        }
    }

    #[test]
    fn the_image_runs_python_kernels_only() {
        // A directory of its own each: a venv's pyvenv.cfg must not linger into the next.
        let runs = |argv: &[&str], venv: bool| {
            let dir = tempfile::tempdir().unwrap();
            check_image_runs(&spec(dir.path(), argv, venv), "microvm").is_ok()
        };
        let dir = tempfile::tempdir().unwrap();
        assert!(runs(
            &["python", "-m", "cellgate_kernel_launcher", "-f", "c"],
            true
        ));
        assert!(runs(
            &["python", "-Xfrozen_modules=off", "-m", "ipykernel_launcher"],
            true
        ));
        assert!(!runs(
            &["python", "-m", "cellgate_bash_kernel", "-f", "c"],
            true
        ));
        assert!(!runs(&["cellgate-tcp-kernel", "c", "--", "deno"], false));
        assert!(!runs(&["python", "-m", "ipykernel_launcher"], false));
        assert!(!runs(&["python", "script.py", "-m", "ipykernel"], true));
        let error = check_image_runs(&spec(dir.path(), &["r-kernel", "c"], false), "microvm");
        assert!(
            format!("{error:?}").contains("microvm sandbox"),
            "{error:?}"
        );
    }
}
