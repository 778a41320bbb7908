//! What a sandbox backend says about this host: whether it can run here, the facts it found
//! and each problem with the step that fixes it. Every backend answers its own
//! ([`super::diagnose`] asks the right one), and `cellgate doctor` prints the answers; the
//! host facts and the probe (a real sandbox running a real program) are shared here.
//!
//! Nothing here changes the host: no sysctl is written, no package installed, no module
//! loaded; the fixes are printed as commands for the operator.
//!
//! Must not depend on: kernels, HTTP, doctor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use super::{LaunchSpec, Limits, Sandbox};

/// One problem found, with the command (or step) that fixes it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Problem {
    pub problem: String,
    pub fix: String,
}

/// One backend, or one piece of the gateway's set-up (kernels, policies).
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    pub name: String,
    /// Whether this host can use it (for backends: start kernels with it).
    pub available: bool,
    /// What was found, by name: versions, paths, counts, probe timings.
    pub facts: BTreeMap<String, Value>,
    /// Why it is not available, or what works only partly (then `available` may be true).
    pub problems: Vec<Problem>,
}

impl Diagnosis {
    pub fn new(name: &str) -> Diagnosis {
        Diagnosis {
            name: name.to_owned(),
            available: true,
            facts: BTreeMap::new(),
            problems: Vec::new(),
        }
    }

    pub fn fact(&mut self, name: &str, value: impl Into<Value>) {
        self.facts.insert(name.to_owned(), value.into());
    }

    /// A problem that makes it unavailable.
    pub fn fail(&mut self, problem: impl Into<String>, fix: impl Into<String>) {
        self.available = false;
        self.warn(problem, fix);
    }

    /// A problem that leaves it usable (a limit not enforced, say).
    pub fn warn(&mut self, problem: impl Into<String>, fix: impl Into<String>) {
        self.problems.push(Problem {
            problem: problem.into(),
            fix: fix.into(),
        });
    }
}

pub fn read_trim(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The first executable called `name` on `PATH` (or the usual sbin directories, which an
/// unprivileged `PATH` often lacks).
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| {
            use std::os::unix::fs::PermissionsExt;
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Runs a command with a time limit; `Ok(stdout)` only when it exits 0.
pub async fn run_command(program: &Path, args: &[&str], limit: Duration) -> Result<String, String> {
    run(tokio::process::Command::new(program).args(args), limit).await
}

/// [`run_command`] with exactly the environment `env` (nothing inherited), in `cwd`.
pub async fn run_command_with(
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    cwd: &Path,
    limit: Duration,
) -> Result<String, String> {
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .current_dir(cwd);
    run(&mut command, limit).await
}

async fn run(command: &mut tokio::process::Command, limit: Duration) -> Result<String, String> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let output = match tokio::time::timeout(limit, command.output()).await {
        Err(_) => return Err(format!("did not finish within {limit:?}")),
        Ok(Err(err)) => return Err(format!("cannot start: {err}")),
        Ok(Ok(output)) => output,
    };
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: String = stderr
            .trim()
            .chars()
            .rev()
            .take(400)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        Err(format!("{}: {tail}", output.status))
    }
}

/// Runs `program` in `sandbox` (the same code path as a kernel) and checks it exits 0;
/// how long it took.
pub async fn probe(sandbox: &dyn Sandbox, program: &str) -> Result<Duration, String> {
    let dir = std::env::temp_dir().join(format!(
        "cellgate-doctor-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    ));
    let result = probe_in(sandbox, &dir, program).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn probe_in(sandbox: &dyn Sandbox, dir: &Path, program: &str) -> Result<Duration, String> {
    use std::os::unix::fs::DirBuilderExt;
    let run = dir.join("run");
    let work = dir.join("work");
    for d in [dir, &run, &work] {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(d)
            .map_err(|e| format!("mkdir {}: {e}", d.display()))?;
    }
    let mut env = BTreeMap::new();
    env.insert("PATH".to_owned(), "/usr/bin:/bin".to_owned());
    let spec = LaunchSpec {
        kernel_id: "doctor-probe".to_owned(),
        argv: vec![program.to_owned()],
        env,
        connection_file: run.join("connection.json"),
        connection: crate::protocol::ConnectionInfo::ipc(&run.join("k"), String::new(), ""),
        runtime_dir: run,
        workspace: work,
        log_file: dir.join("probe.log"),
        limits: Limits::default(),
        egress_socket: None,
        allow_emulation: false,
        zygote: false,
        labels: Default::default(),
        adopt: None,
        backend_settings: Default::default(),
        generation: 1,
    };
    let started = Instant::now();
    let launched = sandbox.launch(&spec).await.map_err(|e| e.to_string())?;
    let mut exit = launched.exit;
    let report =
        match tokio::time::timeout(Duration::from_secs(30), exit.wait_for(Option::is_some)).await {
            Ok(Ok(report)) => report.clone(),
            Ok(Err(_)) => return Err("the exit watch closed without a report".to_owned()),
            Err(_) => {
                let _ = launched.handle.kill();
                return Err("the probe did not end within 30 s".to_owned());
            }
        };
    let elapsed = started.elapsed();
    match report {
        Some(r) if r.code == Some(0) => Ok(elapsed),
        Some(r) => {
            let log = std::fs::read_to_string(&spec.log_file).unwrap_or_default();
            Err(format!("{}; log: {}", r.describe(), log.trim()))
        }
        None => Err("no exit report".to_owned()),
    }
}
