//! `cellgate doctor`: can this host run each sandbox backend, and if not, why and what fixes it.
//!
//! Every check reads real facts from the host (procfs, sysfs, `PATH`) and, where a cheap one
//! exists, runs the real thing: the namespaces backend starts `/usr/bin/true` in a complete
//! sandbox (the same code path as a kernel), the gvisor backend runs `runsc --version` and
//! `runsc do /bin/true`, the kernelspecs' interpreters import `ipykernel`. Nothing here
//! changes the host: no sysctl is written, no package installed, no module loaded; the fixes
//! are printed as commands for the operator.
//!
//! The report is plain data ([`Report`]) printed as text or, with `--json`, as one JSON
//! object for machines. `cellgate doctor` exits 0 when the default backend works, 1 otherwise.

#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::kernel::KernelSpecs;
use crate::policy::Policies;
use crate::sandbox::{
    Backend, GvisorConfig, LaunchSpec, Limits, NamespacesConfig, NamespacesSandbox, Sandbox,
};

/// What to check.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    pub kernels_dir: PathBuf,
    pub policies_dir: PathBuf,
    /// The backend the gateway would use; the exit code follows it.
    pub default_backend: Backend,
    /// Start real sandboxes (namespaces, runsc) to prove they work. On by default.
    pub probe: bool,
    /// Where the package index gets its files; checked for reachability when set.
    pub package_source: Option<crate::packages::Source>,
}

/// One problem found, with the command (or step) that fixes it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Problem {
    pub problem: String,
    pub fix: String,
}

/// One backend, or one piece of the gateway's set-up (kernels, policies).
#[derive(Debug, Clone, Serialize)]
pub struct Section {
    pub name: String,
    /// Whether this host can use it (for backends: start kernels with it).
    pub available: bool,
    /// What was found, by name: versions, paths, counts, probe timings.
    pub facts: BTreeMap<String, Value>,
    /// Why it is not available, or what works only partly (then `available` may be true).
    pub problems: Vec<Problem>,
}

impl Section {
    fn new(name: &str) -> Section {
        Section {
            name: name.to_owned(),
            available: true,
            facts: BTreeMap::new(),
            problems: Vec::new(),
        }
    }

    fn fact(&mut self, name: &str, value: impl Into<Value>) {
        self.facts.insert(name.to_owned(), value.into());
    }

    /// A problem that makes the section unavailable.
    fn fail(&mut self, problem: impl Into<String>, fix: impl Into<String>) {
        self.available = false;
        self.warn(problem, fix);
    }

    /// A problem that leaves the section usable (a limit not enforced, say).
    fn warn(&mut self, problem: impl Into<String>, fix: impl Into<String>) {
        self.problems.push(Problem {
            problem: problem.into(),
            fix: fix.into(),
        });
    }
}

/// Everything `cellgate doctor` found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub default_backend: String,
    /// Whether the default backend works here (the exit code).
    pub ok: bool,
    pub host: BTreeMap<String, Value>,
    pub backends: Vec<Section>,
    pub setup: Vec<Section>,
}

impl Report {
    /// Readable text, one block per section.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        out.push_str("cellgate doctor\n");
        for (key, value) in &self.host {
            out.push_str(&format!("  {key}: {}\n", plain(value)));
        }
        for (title, sections) in [
            ("Sandbox backends", &self.backends),
            ("Set-up", &self.setup),
        ] {
            out.push_str(&format!("\n{title}\n"));
            for section in sections {
                let mark = match (section.available, section.problems.is_empty()) {
                    (true, true) => "ok",
                    (true, false) => "ok (with warnings)",
                    (false, _) => "NOT AVAILABLE",
                };
                let default = if section.name == self.default_backend {
                    " [default]"
                } else {
                    ""
                };
                out.push_str(&format!("  {}{default}: {mark}\n", section.name));
                for (key, value) in &section.facts {
                    out.push_str(&format!("      {key}: {}\n", plain(value)));
                }
                for problem in &section.problems {
                    out.push_str(&format!("    ! {}\n", problem.problem));
                    out.push_str(&format!("      fix: {}\n", problem.fix));
                }
            }
        }
        out.push_str(&format!(
            "\nDefault backend {}: {}\n",
            self.default_backend,
            if self.ok {
                "works on this host"
            } else {
                "does NOT work on this host"
            }
        ));
        out
    }
}

fn plain(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Runs every check.
pub async fn run(options: &DoctorOptions) -> Report {
    let mut host = BTreeMap::new();
    host.insert(
        "kernel".to_owned(),
        json!(read_trim("/proc/sys/kernel/osrelease")),
    );
    host.insert("euid".to_owned(), json!(euid()));
    host.insert("arch".to_owned(), json!(std::env::consts::ARCH));
    let backends = vec![
        process_section(),
        namespaces_section(options.probe).await,
        gvisor_section(options.probe).await,
        microvm_section(),
    ];
    let mut setup = vec![kernels_section(&options.kernels_dir).await];
    setup.push(policies_section(&options.policies_dir, &backends));
    if let Some(source) = &options.package_source {
        setup.push(package_index_section(source).await);
    }
    let default_backend = options.default_backend.as_str().to_owned();
    let ok = backends
        .iter()
        .find(|s| s.name == default_backend)
        .is_some_and(|s| s.available);
    Report {
        default_backend,
        ok,
        host,
        backends,
        setup,
    }
}

fn read_trim(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn euid() -> u32 {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    unsafe { libc::geteuid() }
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
async fn run_command(program: &Path, args: &[&str], limit: Duration) -> Result<String, String> {
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
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

// ---------------------------------------------------------------------------------------
// Backends.

fn process_section() -> Section {
    let mut s = Section::new("process");
    s.fact("isolation", "none (development only; refused unless named)");
    s
}

/// cgroup facts: which hierarchy provides each controller the sandboxes limit with.
#[derive(Debug, Default)]
struct CgroupFacts {
    /// "v1", "v2", "hybrid" or "none".
    version: &'static str,
    /// controller → "v1" / "v2" for memory, pids, cpu.
    controllers: BTreeMap<&'static str, &'static str>,
    /// Whether this process may create cgroups below its own (in the memory hierarchy).
    writable: bool,
}

fn cgroup_facts() -> CgroupFacts {
    let tables = crate::sandbox::cgroupfs::Tables::read();
    let v2_dir = tables.v2_dir();
    let v2_controllers = v2_dir
        .as_ref()
        .and_then(|dir| read_trim(dir.join("cgroup.controllers")))
        .unwrap_or_default();
    let mut facts = CgroupFacts::default();
    for controller in ["memory", "pids", "cpu"] {
        if v2_controllers.split_whitespace().any(|c| c == controller) {
            facts.controllers.insert(controller, "v2");
        } else if tables.has_v1(controller) {
            facts.controllers.insert(controller, "v1");
        }
    }
    let uses_v1 = facts.controllers.values().any(|v| *v == "v1");
    let uses_v2 = facts.controllers.values().any(|v| *v == "v2");
    facts.version = match (uses_v1, uses_v2, tables.has_v2()) {
        (true, false, true) => "hybrid (v1 controllers, v2 mount without them)",
        (true, false, false) => "v1",
        (false, true, _) => "v2",
        (true, true, _) => "hybrid",
        (false, false, _) => "none",
    };
    // Where the memory controller lives, this process's own cgroup must be writable.
    let memory_dir = match facts.controllers.get("memory") {
        Some(&"v2") => v2_dir,
        Some(_) => tables.v1_dir("memory"),
        None => None,
    };
    facts.writable = memory_dir.is_some_and(|dir| {
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        // SAFETY: access(2) reads the NUL-terminated path and writes nothing.
        unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
    });
    facts
}

/// The Landlock ABI version the running kernel offers, or the errno saying why not.
fn landlock_abi() -> Result<i64, i32> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_ulong = 1;
    // SAFETY: with a NULL attribute pointer and size 0, the VERSION flag only returns the
    // ABI number; no memory is read or written and no descriptor is created.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::ENOSYS))
    } else {
        Ok(rc)
    }
}

async fn namespaces_section(probe: bool) -> Section {
    let mut s = Section::new("namespaces");
    match read_trim("/proc/sys/user/max_user_namespaces") {
        Some(max) => {
            s.fact(
                "max_user_namespaces",
                max.parse::<u64>().map(Value::from).unwrap_or(json!(max)),
            );
            if max == "0" {
                s.fail(
                    "user namespaces are disabled (user.max_user_namespaces = 0)",
                    "sysctl -w user.max_user_namespaces=15000  (persist it in /etc/sysctl.d/)",
                );
            }
        }
        None => s.fail(
            "/proc/sys/user/max_user_namespaces is missing: this kernel has no user namespaces",
            "boot a kernel built with CONFIG_USER_NS=y",
        ),
    }
    match read_trim("/proc/sys/kernel/unprivileged_userns_clone") {
        Some(v) => {
            s.fact("unprivileged_userns_clone", v.clone());
            if v == "0" && euid() != 0 {
                s.fail(
                    "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0) and the gateway is not root",
                    "sysctl -w kernel.unprivileged_userns_clone=1, or run the gateway as root",
                );
            }
        }
        None => s.fact(
            "unprivileged_userns_clone",
            "no such knob (not a Debian-patched kernel)",
        ),
    }
    if let Some(v) = read_trim("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") {
        s.fact("apparmor_restrict_unprivileged_userns", v.clone());
        if v == "1" && euid() != 0 {
            s.fail(
                "AppArmor restricts unprivileged user namespaces and the gateway is not root",
                "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or run the gateway as root",
            );
        }
    }

    let cgroups = cgroup_facts();
    s.fact("cgroup_version", cgroups.version);
    s.fact(
        "cgroup_controllers",
        json!(cgroups
            .controllers
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect::<serde_json::Map<_, _>>()),
    );
    s.fact("cgroup_writable", cgroups.writable);
    for controller in ["memory", "pids", "cpu"] {
        if !cgroups.controllers.contains_key(controller) {
            s.warn(
                format!("no {controller} cgroup controller: {controller} limits are not enforced"),
                format!("enable the {controller} controller (cgroup v2: echo +{controller} > cgroup.subtree_control of the gateway's parent cgroup; v1: mount it)"),
            );
        }
    }
    if !cgroups.writable && !cgroups.controllers.is_empty() {
        s.warn(
            "this process cannot create cgroups below its own: memory, pids and CPU limits are not enforced (RLIMIT_AS only)",
            "run the gateway as root, or under a delegated cgroup (systemd: Delegate=yes in its unit)",
        );
    }

    let seccomp = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Seccomp:"));
    s.fact("seccomp", if seccomp { "supported" } else { "absent" });
    if !seccomp {
        s.fail(
            "the kernel has no seccomp filter support (no Seccomp: line in /proc/self/status)",
            "boot a kernel built with CONFIG_SECCOMP_FILTER=y",
        );
    }
    match landlock_abi() {
        Ok(abi) => s.fact("landlock_abi", abi),
        Err(errno) => {
            let why = if errno == libc::EOPNOTSUPP {
                "built in but disabled (not in the lsm= boot list)"
            } else {
                "not in this kernel"
            };
            s.fact("landlock_abi", Value::Null);
            s.warn(
                format!("Landlock is {why}: the kernel runs without its file-system ruleset (mount namespace and seccomp still apply)"),
                "boot with lsm=landlock,... (CONFIG_SECURITY_LANDLOCK=y)",
            );
        }
    }

    if probe && s.available {
        match probe_namespaces().await {
            Ok(elapsed) => s.fact("probe", format!("started /usr/bin/true in a sandbox in {} ms", elapsed.as_millis())),
            Err(err) => s.fail(
                format!("starting a real sandbox failed: {err}"),
                "see the error above; `cellgate serve --sandbox namespaces` would fail the same way",
            ),
        }
    }
    s
}

/// Starts `/usr/bin/true` in a complete namespaces sandbox (helper, init, mounts, seccomp,
/// Landlock, cgroups) and checks it exits 0.
async fn probe_namespaces() -> Result<Duration, String> {
    let sandbox = NamespacesSandbox::new(NamespacesConfig {
        start_timeout: Duration::from_secs(20),
        ..NamespacesConfig::default()
    })
    .map_err(|e| e.to_string())?;
    probe_sandbox(&sandbox, "/usr/bin/true").await
}

async fn probe_sandbox(sandbox: &dyn Sandbox, program: &str) -> Result<Duration, String> {
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

async fn gvisor_section(probe: bool) -> Section {
    let mut s = Section::new("gvisor");
    let Some(runsc) = find_on_path("runsc") else {
        s.fact("runsc", Value::Null);
        s.fail(
            "runsc is not on PATH",
            "apt-get install -y runsc   (or ./dev setup, which installs it)",
        );
        return s;
    };
    s.fact("runsc", runsc.display().to_string());
    match run_command(&runsc, &["--version"], Duration::from_secs(10)).await {
        Ok(out) => {
            let version = out.lines().next().unwrap_or("").trim().to_owned();
            s.fact("version", version);
        }
        Err(err) => {
            s.fail(
                format!("`runsc --version` failed: {err}"),
                "apt-get install --reinstall -y runsc",
            );
            return s;
        }
    }
    let config = GvisorConfig::default();
    s.fact("platform", config.platform.clone());
    if euid() != 0 {
        s.fail(
            "the gvisor backend needs a root gateway (runsc without --rootless creates namespaces and cgroups)",
            "run the gateway as root",
        );
    }
    s.warn(
        "runsc applies memory and pids limits to the whole sandbox (the host cgroup kills every process of the kernel, not only the one that exceeded it), and the workspace size is not limited",
        "none needed for one kernel per sandbox; a newer runsc enforces limits inside the Sentry",
    );
    if probe && s.available {
        let root = std::env::temp_dir().join(format!(
            "cellgate-doctor-runsc-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ));
        let root_arg = root.display().to_string();
        let started = Instant::now();
        let result = run_command(
            &runsc,
            &[
                "--root",
                &root_arg,
                "--platform",
                &config.platform,
                "--network=none",
                "do",
                "/bin/true",
            ],
            Duration::from_secs(30),
        )
        .await;
        let _ = std::fs::remove_dir_all(&root);
        match result {
            Ok(_) => s.fact(
                "probe",
                format!("`runsc do /bin/true` ran in {} ms", started.elapsed().as_millis()),
            ),
            Err(err) => s.fail(
                format!("`runsc --platform {} --network=none do /bin/true` failed: {err}", config.platform),
                "check `dmesg` and runsc's --debug output; the ptrace platform needs ptrace allowed (kernel.yama.ptrace_scope <= 1)",
            ),
        }
    }
    s
}

fn microvm_section() -> Section {
    let mut s = Section::new("microvm");
    s.fail(
        "the microvm backend is not part of this build",
        "none yet: use namespaces (default) or gvisor",
    );
    let kvm = Path::new("/dev/kvm").exists();
    s.fact("dev_kvm", kvm);
    if !kvm {
        s.warn(
            "/dev/kvm is missing: a microVM would run under TCG emulation (Python 50x slower)",
            "modprobe kvm_intel (or kvm_amd) on a host with virtualisation enabled; in a VM, enable nested virtualisation",
        );
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags").and_then(|r| r.split_once(':')))
        .map(|(_, f)| f.split_whitespace().collect())
        .unwrap_or_default();
    let virt = if flags.contains(&"vmx") {
        Some("vmx")
    } else if flags.contains(&"svm") {
        Some("svm")
    } else {
        None
    };
    s.fact(
        "cpu_virtualisation",
        virt.map(Value::from).unwrap_or(Value::Null),
    );
    if virt.is_none() {
        s.warn(
            "the CPU shows neither vmx nor svm: no hardware virtualisation for guests",
            "enable VT-x/AMD-V in firmware, or nested virtualisation in the host VM",
        );
    }
    let modules = std::fs::read_to_string("/proc/modules").unwrap_or_default();
    let pvm = modules.lines().any(|l| l.starts_with("kvm_pvm "))
        || Path::new("/sys/module/kvm_pvm").exists();
    s.fact("kvm_pvm", pvm);
    if pvm {
        s.warn(
            "PVM-only KVM: stock guest kernels crawl (only PVM-aware guest kernels run at speed)",
            "run microVMs on a host with real VT-x/AMD-V KVM, or build a PVM guest kernel",
        );
    }
    match find_on_path("qemu-system-x86_64") {
        Some(qemu) => s.fact("qemu", qemu.display().to_string()),
        None => {
            s.fact("qemu", Value::Null);
            s.warn(
                "qemu-system-x86_64 is not on PATH",
                "apt-get install -y qemu-system-x86",
            );
        }
    }
    s
}

// ---------------------------------------------------------------------------------------
// Set-up.

async fn kernels_section(dir: &Path) -> Section {
    let mut s = Section::new("kernels");
    s.fact("dir", dir.display().to_string());
    if !dir.is_dir() {
        s.fail(
            format!("kernels directory {} does not exist", dir.display()),
            "run from the repository root, or pass --kernels-dir (CELLGATE_KERNELS_DIR) pointing at a directory of kernelspecs",
        );
        return s;
    }
    let specs = match KernelSpecs::load(dir, None) {
        Ok(specs) => specs,
        Err(err) => {
            s.fail(
                format!("cannot load the kernelspecs: {err}"),
                "fix the kernel.json files named above",
            );
            return s;
        }
    };
    s.fact("specs", json!(specs.names()));
    s.fact("default", specs.default_name());
    for spec in specs.iter() {
        let argv = match spec.command(Path::new("/nonexistent/connection.json")) {
            Ok(argv) => argv,
            Err(err) => {
                s.fail(
                    format!("kernelspec {}: {err}", spec.name),
                    format!(
                        "./dev setup   (builds {}/.venv from requirements.txt)",
                        spec.dir.display()
                    ),
                );
                continue;
            }
        };
        let Some(program) = argv.first() else {
            s.fail(
                format!("kernelspec {} has an empty argv", spec.name),
                "fix its kernel.json",
            );
            continue;
        };
        let program = PathBuf::from(program);
        if !program.is_file() {
            s.fail(
                format!(
                    "kernelspec {}: its program {} does not exist",
                    spec.name,
                    program.display()
                ),
                format!("install {} or fix kernel.json", program.display()),
            );
            continue;
        }
        s.fact(
            &format!("{}.interpreter", spec.name),
            program.display().to_string(),
        );
        if spec.language == "python" {
            // The module argv runs with `-m` (cellgate's launcher, copied in by setup) must
            // be there too: a venv made before it existed starts no kernel.
            let module = argv
                .iter()
                .position(|a| a == "-m")
                .and_then(|i| argv.get(i + 1))
                .map_or("ipykernel", String::as_str);
            match run_command(
                &program,
                &[
                    "-c",
                    "import importlib.util, ipykernel, sys; m = sys.argv[1]; \
                     importlib.util.find_spec(m) or sys.exit('no module ' + m); \
                     print(ipykernel.__version__, sys.version.split()[0])",
                    module,
                ],
                Duration::from_secs(60),
            )
            .await
            {
                Ok(out) => s.fact(&format!("{}.ipykernel", spec.name), out.trim().to_owned()),
                Err(err) => s.fail(
                    format!(
                        "kernelspec {}: `import ipykernel` or module {module} fails: {err}",
                        spec.name
                    ),
                    "./dev setup   (reinstalls the kernel venv and its launcher)",
                ),
            }
        }
    }
    s
}

/// The package index's source: the upstream index answers, or the wheelhouse is readable.
/// Unreachable is a warning, not a failure: kernels run without it, only installs fail.
async fn package_index_section(source: &crate::packages::Source) -> Section {
    use crate::packages::{IndexConfig, PackageIndex, Source};
    let mut s = Section::new("package index");
    match source {
        Source::Upstream(url) => s.fact("upstream", url.clone()),
        Source::Wheelhouse(dir) => s.fact("wheelhouse", dir.display().to_string()),
    }
    let cache = std::env::temp_dir().join(format!("cellgate-doctor-{}", std::process::id()));
    let index = PackageIndex::new(IndexConfig {
        source: source.clone(),
        cache_dir: cache.clone(),
    });
    let started = Instant::now();
    let probed = match index {
        Ok(index) => index.probe().await.map_err(|e| e.to_string()),
        Err(err) => Err(err.to_string()),
    };
    let _ = std::fs::remove_dir_all(&cache);
    match probed {
        Ok(what) => {
            s.fact("reachable", true);
            s.fact(
                "probe",
                format!("{what} ({} ms)", started.elapsed().as_millis()),
            );
        }
        Err(err) => {
            s.fact("reachable", false);
            s.warn(
                format!("the package index source does not answer: {err}; `pip install` in kernels will fail"),
                "let the gateway reach the upstream index (--package-index URL, or a proxy), or serve a local directory with --wheelhouse DIR",
            );
        }
    }
    s
}

fn policies_section(dir: &Path, backends: &[Section]) -> Section {
    let mut s = Section::new("policies");
    s.fact("dir", dir.display().to_string());
    match Policies::load(dir) {
        Ok(policies) => {
            let mut names = Vec::new();
            for policy in policies.iter() {
                names.push(json!({"name": policy.name, "backend": policy.backend.as_str()}));
                let usable = backends
                    .iter()
                    .find(|b| b.name == policy.backend.as_str())
                    .is_some_and(|b| b.available);
                if !usable {
                    s.warn(
                        format!("policy {} uses the {} backend, which this host cannot run: its kernels will fail to start", policy.name, policy.backend.as_str()),
                        format!("see the {} section above", policy.backend.as_str()),
                    );
                }
            }
            s.fact("loaded", Value::Array(names));
        }
        Err(err) => s.fail(
            format!("cannot load the policies: {err}"),
            "fix the file named above, or pass --policies-dir (CELLGATE_POLICIES_DIR)",
        ),
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_output_lists_problems_with_fixes() {
        let mut section = Section::new("gvisor");
        section.fail("runsc is not on PATH", "apt-get install -y runsc");
        let report = Report {
            default_backend: "namespaces".into(),
            ok: false,
            host: BTreeMap::new(),
            backends: vec![section],
            setup: vec![],
        };
        let text = report.to_text();
        assert!(text.contains("gvisor: NOT AVAILABLE"), "{text}");
        assert!(text.contains("fix: apt-get install -y runsc"), "{text}");
        assert!(text.contains("does NOT work"), "{text}");
    }

    #[test]
    fn cgroup_facts_name_a_version() {
        let facts = cgroup_facts();
        assert!(!facts.version.is_empty());
    }
}
