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

/// A kernel the sandbox's image cannot run (another language's kernelspec where the image
/// holds no environment for it): the client's choice of kernel and policy, not a failure,
/// and safe to tell it (the sentence names kernelspecs and settings, no host path).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UnsupportedKernel(pub String);

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
/// fixed paths of [`relocation`], in the image's `environment` (what [`check_image_runs`]
/// found; `None`: the image's own layout).
pub async fn start_kernel(
    agent: &Agent,
    spec: &LaunchSpec,
    map: &Relocation,
    connection: Option<ConnectionFile>,
    uid: u32,
    environment: Option<String>,
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
        environment,
    };
    match agent.request(Op::Start(start)).await? {
        Reply::Started { .. } => Ok(()),
        other => Err(AgentError(format!("unexpected reply {other:?}"))),
    }
}

/// Python modules an image without environments starts kernels with: its own (the kernel
/// pod's image, and a VM root image built before environments, hold the python3 kernel's
/// venv only, at the fixed path).
const IMAGE_KERNEL_MODULES: &[&str] = &[
    "cellgate_kernel_launcher",
    "ipykernel_launcher",
    "ipykernel",
];

/// Refuses, before any VM or pod is made, a kernel the guest's image cannot run; the
/// environment the agent is to show it, when the image holds several. `held` names the
/// image's environments (the VM root image's manifest, `guest.json`): a kernel runs when its
/// kernelspec's is among them. An image that names none (the kernel pod's, a VM image built
/// before environments) holds the python3 venv alone, and runs only a Python venv starting
/// ipykernel ([`runs_in_image`]). Without this the start would fail inside the guest with a
/// missing file or module.
pub fn check_image_runs(
    spec: &LaunchSpec,
    backend: &str,
    held: &[String],
) -> Result<Option<String>, UnsupportedKernel> {
    // A plain program (a probe, a tool, a test's command) is no kernel: the image's own
    // files are what it runs, and a kernelspec's environment when it is in one the image
    // holds (its path maps to the fixed path, where nothing else is).
    if !spec.connection_file.is_file() {
        return Ok(environment_name(&spec.argv).filter(|name| held.contains(name)));
    }
    if held.is_empty() {
        if runs_in_image(&spec.argv, held) {
            return Ok(None);
        }
        return Err(UnsupportedKernel(format!(
            "this kernel cannot run in a {backend} sandbox: its image holds the python3 \
             kernel's environment only (run other kernelspecs under a namespaces or gvisor \
             policy{})",
            match backend {
                "microvm" =>
                    ", or rebuild the guest with ./dev setup: its images hold every kernelspec's",
                "kubernetes" =>
                    ", or name an image holding its environment in the policy's [kubernetes] \
                     kernel_images: kernel.Dockerfile --build-arg KERNEL=<name> builds one",
                _ => "",
            }
        )));
    }
    match environment_name(&spec.argv) {
        Some(name) if held.contains(&name) => Ok(Some(name)),
        name => Err(UnsupportedKernel(format!(
            "this kernel cannot run in a {backend} sandbox: its image holds no environment \
             for {} (it holds {}; rebuild the guest with ./dev setup)",
            name.map_or_else(
                || "a command outside a kernelspec's environment".to_owned(),
                |name| format!("the kernelspec {name:?}")
            ),
            held.join(", ")
        ))),
    }
}

/// The kernel's environment on the host: the directory above its program's (`bin/`) when
/// that is a Python venv or carries [`relocate::ENVIRONMENT_MARKER`].
fn environment_dir(argv: &[String]) -> Option<&Path> {
    let program = Path::new(argv.first().map(String::as_str).unwrap_or_default());
    program.parent().and_then(Path::parent).filter(|env| {
        env.join("pyvenv.cfg").is_file() || env.join(relocate::ENVIRONMENT_MARKER).is_file()
    })
}

/// The name of the kernel's environment in a guest image: its kernelspec's (the
/// environment is `kernels/<name>/.venv`, see `KernelSpec::command`).
pub fn environment_name(argv: &[String]) -> Option<String> {
    let env = environment_dir(argv)?;
    if env.file_name()? != ".venv" {
        return None;
    }
    let name = env.parent()?.file_name()?.to_str()?;
    cellgate_agent::protocol::is_environment_name(name).then(|| name.to_owned())
}

/// Whether a kernel command is one an image holding the environments `held` can run: its
/// kernelspec's environment is among them, or (an image that names none) it is a Python
/// venv's interpreter starting one of the `IMAGE_KERNEL_MODULES`
/// (`python [-X… -u -E…] -m module`).
pub fn runs_in_image(argv: &[String], held: &[String]) -> bool {
    if !held.is_empty() {
        return environment_name(argv).is_some_and(|name| held.contains(&name));
    }
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
/// environment (a venv, or one with [`relocate::ENVIRONMENT_MARKER`]) where the guest shows
/// it (a VM's agent binds it there, a pod's container image has it there).
pub fn relocation(spec: &LaunchSpec) -> Relocation {
    let mut map = Relocation::new();
    map.add(&spec.workspace, relocate::WORKSPACE);
    map.add(&spec.runtime_dir, relocate::RUN_DIR);
    if let Some(env) = environment_dir(&spec.argv) {
        map.add(env, relocate::VENV);
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

    /// What the kernel's program sits in.
    #[derive(Clone, Copy)]
    enum Env {
        Venv,
        Marked,
        Plain,
    }

    /// A kernel's launch spec: `argv`, with a connection file (so it counts as a kernel),
    /// the program in `kernels/<kernelspec>/.venv/bin`, which is an environment of `kind`.
    fn spec(dir: &Path, kernelspec: &str, argv: &[&str], kind: Env) -> LaunchSpec {
        let run = dir.join("run");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(run.join("connection.json"), "{}").unwrap();
        let env_dir = dir.join("kernels").join(kernelspec).join(".venv");
        std::fs::create_dir_all(env_dir.join("bin")).unwrap();
        match kind {
            Env::Venv => std::fs::write(env_dir.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap(),
            Env::Marked => std::fs::write(env_dir.join(relocate::ENVIRONMENT_MARKER), "").unwrap(),
            Env::Plain => {}
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
            generation: 1,
        }
    }

    /// `check_image_runs` of a fresh spec (a directory of its own each: a venv's pyvenv.cfg
    /// must not linger into the next).
    fn check(
        held: &[&str],
        kernelspec: &str,
        argv: &[&str],
        kind: Env,
    ) -> Result<Option<String>, UnsupportedKernel> {
        let dir = tempfile::tempdir().unwrap();
        let held: Vec<String> = held.iter().map(|h| h.to_string()).collect();
        check_image_runs(&spec(dir.path(), kernelspec, argv, kind), "microvm", &held)
    }

    #[test]
    fn an_image_without_environments_runs_python_kernels_only() {
        let runs = |argv: &[&str], kind| check(&[], "python3", argv, kind).is_ok();
        assert!(runs(
            &["python", "-m", "cellgate_kernel_launcher", "-f", "c"],
            Env::Venv
        ));
        assert!(runs(
            &["python", "-Xfrozen_modules=off", "-m", "ipykernel_launcher"],
            Env::Venv
        ));
        assert!(!runs(
            &["python", "-m", "cellgate_bash_kernel", "-f", "c"],
            Env::Venv
        ));
        assert!(!runs(
            &["cellgate-tcp-kernel", "c", "--", "deno"],
            Env::Marked
        ));
        assert!(!runs(&["python", "-m", "ipykernel_launcher"], Env::Plain));
        assert!(!runs(
            &["python", "script.py", "-m", "ipykernel"],
            Env::Venv
        ));
        let error = check(&[], "ir", &["r-kernel", "c"], Env::Marked);
        assert!(
            format!("{error:?}").contains("microvm sandbox"),
            "{error:?}"
        );
    }

    #[test]
    fn an_image_with_environments_runs_the_kernelspecs_it_holds() {
        let held = ["bash", "deno", "ir", "python3"];
        let launcher = ["python", "-m", "cellgate_kernel_launcher", "-f", "c"];
        assert_eq!(
            check(&held, "python3", &launcher, Env::Venv).unwrap(),
            Some("python3".to_owned())
        );
        assert_eq!(
            check(
                &held,
                "deno",
                &["cellgate-tcp-kernel", "c", "--", "deno"],
                Env::Marked
            )
            .unwrap(),
            Some("deno".to_owned())
        );
        assert_eq!(
            check(&held, "ir", &["r-kernel", "c"], Env::Marked).unwrap(),
            Some("ir".to_owned())
        );
        assert_eq!(
            check(
                &held,
                "bash",
                &["python", "-m", "cellgate_bash_kernel"],
                Env::Venv
            )
            .unwrap(),
            Some("bash".to_owned())
        );
        // A kernelspec the image has no environment for, even a Python one: another venv
        // would run it with the wrong packages.
        let error = check(&held, "python3-lean", &launcher, Env::Venv).unwrap_err();
        assert!(error.0.contains("\"python3-lean\""), "{error}");
        assert!(error.0.contains("bash, deno, ir, python3"), "{error}");
        // A program in no environment at all.
        let error = check(&held, "odd", &["tool"], Env::Plain).unwrap_err();
        assert!(error.0.contains("outside a kernelspec"), "{error}");
    }

    #[test]
    fn a_plain_program_runs_from_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let mut plain = spec(dir.path(), "x", &["tool"], Env::Plain);
        plain.connection_file = dir.path().join("none.json");
        assert_eq!(check_image_runs(&plain, "microvm", &[]).unwrap(), None);
        let held = ["x".to_owned()];
        assert_eq!(
            check_image_runs(&plain, "microvm", &held).unwrap(),
            None,
            "no environment: the program is not in one"
        );
        let mut in_env = spec(dir.path(), "x", &["python"], Env::Venv);
        in_env.connection_file = dir.path().join("none.json");
        assert_eq!(
            check_image_runs(&in_env, "microvm", &held).unwrap(),
            Some("x".to_owned())
        );
    }
}
