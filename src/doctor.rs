//! `cellgate doctor`: can this host run each sandbox backend, and if not, why and what fixes it.
//!
//! Every check reads real facts from the host (procfs, sysfs, `PATH`) and, where a cheap one
//! exists, runs the real thing. Each backend answers for itself (`sandbox::diagnose`: the
//! namespaces backend starts `/usr/bin/true` in a complete sandbox, the same code path as a
//! kernel; the gvisor backend runs `runsc --version` and `runsc do /bin/true`); this module
//! adds the set-up (the kernelspecs' interpreters import `ipykernel` and, as a kernel zygote
//! would, their preload lists; the policies; whether the package index's upstream answers,
//! or its wheelhouse is readable) and prints the backends' answers beside it. Nothing here
//! changes the host: no sysctl is written, no package installed, no module loaded; the fixes
//! are printed as commands for the operator.
//!
//! The report is plain data ([`Report`]) printed as text or, with `--json`, as one JSON
//! object for machines. `cellgate doctor` exits 0 when the default backend works, 1 otherwise.
//! `cellgate doctor --config FILE` checks what the gateway's configuration file names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::kernel::KernelSpecs;
use crate::policy::Policies;
use crate::sandbox::Backend;

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
    pub package_source: Option<crate::egress::packages::Source>,
    /// The microvm backend's settings.
    pub microvm: crate::sandbox::MicrovmConfig,
    /// Whether the configuration forks namespaces kernels from a zygote.
    pub kernel_zygote: bool,
    /// Where kept kernels would be recorded (`--kernels-outlive-gateway` with a state
    /// directory; `None`: they end with the gateway): each backend's section says whether
    /// its kernels are kept.
    pub survival: Option<crate::sandbox::Survival>,
}

use crate::sandbox::diagnosis::{euid, read_trim, run_command, run_command_with};
/// One backend or one piece of the set-up, as the backends describe themselves.
pub use crate::sandbox::diagnosis::{Diagnosis as Section, Problem};

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
    let mut backends = Vec::new();
    for backend in [
        Backend::Process,
        Backend::Namespaces,
        Backend::Gvisor,
        Backend::Microvm,
        Backend::Kubernetes,
    ] {
        backends.push(
            crate::sandbox::diagnose(
                backend,
                options.probe,
                &options.microvm,
                options.kernel_zygote,
            )
            .await,
        );
    }
    for section in &mut backends {
        section.facts.insert(
            "kernels_outlive_gateway".to_owned(),
            json!(outlives(&section.name, options.survival.as_ref())),
        );
    }
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

/// Whether `backend`'s kernels outlive a gateway that stops or dies, as configured (and as
/// `serve` decides: gVisor's and microVMs' kept sockets must fit a unix socket's address
/// below the state directory).
fn outlives(backend: &str, survival: Option<&crate::sandbox::Survival>) -> &'static str {
    match (backend, survival) {
        ("gvisor" | "microvm", Some(kept)) if !kept.kept_paths_fit() => {
            "no: the state directory's path is too long for their sockets' addresses (choose a shorter --state-dir)"
        }
        ("namespaces" | "gvisor" | "microvm", Some(_)) => {
            "yes: the next gateway on this state directory adopts them"
        }
        ("namespaces" | "gvisor" | "microvm", None) => {
            "no: they end with the gateway (--kernels-outlive-gateway false, or no state directory)"
        }
        ("kubernetes", _) => "with --replica-url: the other replicas take them over",
        _ => "no: they end with the gateway (their sessions come back dormant)",
    }
}

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
                Err(err) => {
                    s.fail(
                        format!(
                            "kernelspec {}: `import ipykernel` or module {module} fails: {err}",
                            spec.name
                        ),
                        "./dev setup   (reinstalls the kernel venv and its launcher)",
                    );
                    continue;
                }
            }
            if module == "cellgate_kernel_launcher" {
                check_preload(&mut s, spec, &program).await;
            }
        }
    }
    s
}

/// Imports the kernelspec's preload list (`CELLGATE_PRELOAD`) as a zygote would, outside any
/// sandbox: what fails to import is left out of every zygote (a warning: kernels still start,
/// that module's first import is just slower), and a thread left running after the imports
/// makes the namespaces zygote refuse to fork, so every kernel starts cold.
async fn check_preload(s: &mut Section, spec: &crate::kernel::KernelSpec, program: &Path) {
    let Some(list) = spec
        .env
        .get(cellgate_agent::protocol::PRELOAD_ENV)
        .filter(|list| !list.trim().is_empty())
    else {
        return;
    };
    // Run as root, usually, and outside any sandbox: in an empty directory of its own (`-m`
    // puts the working directory first on the module path), with only what a zygote starts
    // with (the kernelspec's variables a zygote keeps, the one-thread settings) and a scratch
    // home for matplotlib's font cache, never the operator's environment or home.
    let scratch = std::env::temp_dir().join(format!(
        "cellgate-doctor-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    ));
    let made = {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().mode(0o700).create(&scratch)
    };
    if let Err(err) = made {
        s.warn(
            format!("the preload check needs a scratch directory: {err}"),
            "make the temporary directory writable (TMPDIR)",
        );
        return;
    }
    let scratch_path = scratch.display().to_string();
    let mut env: Vec<(&str, &str)> = spec
        .env
        .iter()
        .filter(|(k, _)| cellgate_agent::protocol::fixed_at_zygote_start(k))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    env.extend(crate::sandbox::ZYGOTE_ONE_THREAD.iter().copied());
    env.extend([
        ("HOME", scratch_path.as_str()),
        ("MPLCONFIGDIR", scratch_path.as_str()),
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
    ]);
    let started = Instant::now();
    let out = run_command_with(
        program,
        &["-m", "cellgate_kernel_launcher", "--cellgate-check-preload"],
        &env,
        &scratch,
        Duration::from_secs(120),
    )
    .await;
    let _ = std::fs::remove_dir_all(&scratch);
    let report = out.map_err(|err| err.to_string()).and_then(|out| {
        serde_json::from_str::<Value>(out.lines().last().unwrap_or_default())
            .map_err(|err| format!("unreadable answer ({err}): {out}"))
    });
    let report = match report {
        Ok(report) => report,
        Err(err) => {
            s.warn(
                format!("kernelspec {}: the preload check failed: {err}", spec.name),
                "./dev setup   (reinstalls the kernel venv and its launcher)",
            );
            return;
        }
    };
    s.fact(
        &format!("{}.preload", spec.name),
        format!("{list} (imported in {} ms)", started.elapsed().as_millis()),
    );
    for failed in report["failed"].as_array().into_iter().flatten() {
        s.warn(
            format!(
                "kernelspec {}: preload {}: zygotes start without it",
                spec.name,
                plain(failed)
            ),
            format!(
                "install it in {}/.venv, or remove it from CELLGATE_PRELOAD in its kernel.json",
                spec.dir.display()
            ),
        );
    }
    let threads: Vec<String> = report["threads"]
        .as_array()
        .into_iter()
        .flatten()
        .map(plain)
        .collect();
    if threads.len() > 1 {
        s.warn(
            format!(
                "kernelspec {}: importing its preload list leaves {} threads ({}): a namespaces zygote will not fork, every kernel starts cold",
                spec.name,
                threads.len(),
                threads.join(", ")
            ),
            "find the module that starts the thread (import each alone) and remove it from CELLGATE_PRELOAD, or keep it from starting one (an environment setting in its kernel.json)",
        );
    }
}

/// The package index's source: the upstream index answers, or the wheelhouse is readable.
/// Unreachable is a warning, not a failure: kernels run without it, only installs fail.
async fn package_index_section(source: &crate::egress::packages::Source) -> Section {
    use crate::egress::packages::{IndexConfig, PackageIndex, Source};
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
}
