//! Policies: named, documented TOML files in `policies/` that say how a tenant's kernels run.
//! Sections: the sandbox backend, the limits, and what a kernel may reach (`[egress]`, the
//! hosts of cellgate's proxy) and install (`[packages]`, the projects of cellgate's index);
//! see [`access`].
//!
//! Every field has a default (the values of `policies/default.toml`), a unit, and is
//! validated on load; unknown fields are refused with the file and line, so a typo never
//! silently means "no limit". After loading, policies are plain values: no IO, no state.
//!
//! Must not depend on: kernels, HTTP. (It names a sandbox backend, nothing more.)

pub mod access;
pub mod denial;
pub mod environment;
pub mod npm;
pub use crate::units;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::sandbox::Backend;
pub use access::{Dependencies, EgressRules, PackageRules};
pub use denial::{Denial, DenialKind};
pub use environment::EnvironmentRules;
pub use npm::{NpmRule, NpmRules};
pub use units::{parse_duration, parse_size};

/// Errors in policy files.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {field}: {reason}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        reason: String,
    },
    #[error("no policy named {name:?} (known: {known})")]
    Unknown { name: String, known: String },
    #[error("no policies in {0} (a default.toml is required)")]
    NoDefault(PathBuf),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    description: Option<String>,
    #[serde(default)]
    sandbox: SandboxSection,
    #[serde(default)]
    limits: LimitsSection,
    #[serde(default)]
    egress: access::EgressSection,
    #[serde(default)]
    packages: access::PackagesSection,
    #[serde(default)]
    environment: environment::EnvironmentSection,
    kubernetes: Option<KubernetesSection>,
}

/// `[kubernetes]`: where and how the kubernetes backend runs this policy's kernel pods.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KubernetesSection {
    image: String,
    #[serde(default)]
    kernel_images: BTreeMap<String, String>,
    namespace: Option<String>,
    runtime_class: Option<String>,
    service_account: Option<String>,
    #[serde(default)]
    node_selector: BTreeMap<String, String>,
    #[serde(default)]
    tolerations: Vec<crate::sandbox::kubernetes::PodToleration>,
    image_pull_policy: Option<String>,
    #[serde(default)]
    image_pull_secrets: Vec<String>,
    #[serde(default, with = "units::serde_duration")]
    pending_timeout: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SandboxSection {
    backend: Option<Backend>,
    /// microvm only: this policy's VMs may run under software emulation where the host
    /// has no usable KVM (the gateway's `--microvm-allow-emulation` allows it for all).
    #[serde(default)]
    allow_emulation: bool,
    /// namespaces only: `false` starts this policy's kernels afresh instead of forking them
    /// from the kernel zygote (`src/sandbox/namespaces/zygote.rs`).
    zygote: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsSection {
    #[serde(default, with = "units::serde_duration")]
    execution_timeout: Option<Duration>,
    #[serde(default, with = "units::serde_duration")]
    interrupt_grace: Option<Duration>,
    #[serde(default, with = "units::serde_duration")]
    idle_timeout: Option<Duration>,
    #[serde(default, with = "units::serde_duration")]
    hibernate_after: Option<Duration>,
    #[serde(default, with = "units::serde_duration")]
    lifetime: Option<Duration>,
    #[serde(default, with = "units::serde_size")]
    memory: Option<u64>,
    cpus: Option<f64>,
    pids: Option<u64>,
    #[serde(default, with = "units::serde_size")]
    workspace: Option<u64>,
    #[serde(default, with = "units::serde_size")]
    output_per_execution: Option<u64>,
    max_kernels: Option<usize>,
    #[serde(default, with = "units::serde_size")]
    artifact_size: Option<u64>,
    #[serde(default, with = "units::serde_size")]
    artifacts_per_session: Option<u64>,
    #[serde(default, with = "units::serde_size")]
    artifacts_per_tenant: Option<u64>,
    #[serde(default, with = "units::serde_size")]
    upload_size: Option<u64>,
}

/// The limits of one policy, with defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLimits {
    /// A cell running longer is interrupted…
    pub execution_timeout: Duration,
    /// …and if it is still running this much later, the kernel is restarted.
    pub interrupt_grace: Duration,
    /// A kernel with no activity this long is shut down.
    pub idle_timeout: Duration,
    /// A kernel with no activity this long (a connected client does not keep it awake) is saved to disk and
    /// its memory freed, to be restored at the next request (microvm only; shorter than
    /// `idle_timeout`, which goes on counting while it is hibernated). `None`: never.
    pub hibernate_after: Option<Duration>,
    /// A kernel is shut down this long after it started, whatever it does.
    pub lifetime: Duration,
    pub memory_bytes: u64,
    /// Thousandths of a CPU.
    pub cpu_millis: u32,
    pub pids: u64,
    pub workspace_bytes: u64,
    /// Output of one execution beyond this is dropped (with a marker); the kernel keeps running.
    pub output_per_execution_bytes: u64,
    /// Kernels under this policy at once.
    pub max_kernels: usize,
    /// Largest rich output or `outputs/` file kept as an API v1 artifact.
    pub artifact_bytes: u64,
    /// Bytes of artifacts one session may keep (a deleted session's retained ones count).
    pub artifacts_per_session_bytes: u64,
    /// Bytes of artifacts one tenant may keep over all its sessions under this policy's
    /// quota (live and retained).
    pub artifacts_per_tenant_bytes: u64,
    /// Largest file uploaded into the workspace through API v1.
    pub upload_bytes: u64,
}

impl Default for PolicyLimits {
    fn default() -> Self {
        PolicyLimits {
            execution_timeout: Duration::from_secs(300),
            interrupt_grace: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30 * 60),
            hibernate_after: None,
            lifetime: Duration::from_secs(12 * 3600),
            memory_bytes: 1 << 30,
            cpu_millis: 1000,
            pids: 256,
            workspace_bytes: 1 << 30,
            output_per_execution_bytes: 10 << 20,
            max_kernels: 64,
            artifact_bytes: 32 << 20,
            artifacts_per_session_bytes: 256 << 20,
            artifacts_per_tenant_bytes: 1 << 30,
            upload_bytes: 1 << 30,
        }
    }
}

/// One named policy.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub name: String,
    pub description: String,
    pub backend: Backend,
    /// `[sandbox] allow_emulation`: this policy's microVMs may run under emulation.
    pub allow_emulation: bool,
    /// `[sandbox] zygote` (default true): this policy's namespaces kernels may be forked from
    /// the kernel zygote.
    pub zygote: bool,
    pub limits: PolicyLimits,
    /// Hosts reachable through the egress proxy (none by default).
    pub egress: EgressRules,
    /// Projects the package index lists (none by default).
    pub packages: PackageRules,
    /// Variables a client may set on its kernel besides `KERNEL_*` (none by default).
    pub environment: EnvironmentRules,
    /// `[kubernetes]`: the pods of the kubernetes backend (required by that backend, refused
    /// with any other).
    pub kubernetes: Option<std::sync::Arc<crate::sandbox::PodSettings>>,
}

impl Policy {
    /// The policy's settings for its sandbox backend, as the kernel core passes them on
    /// without looking inside.
    pub fn backend_settings(&self) -> crate::sandbox::BackendSettings {
        let mut settings = self
            .kubernetes
            .clone()
            .map(crate::sandbox::BackendSettings::kubernetes)
            .unwrap_or_default();
        settings.hibernate = self.limits.hibernate_after.is_some();
        settings
    }
}

fn invalid(path: &Path, field: &'static str, reason: impl Into<String>) -> PolicyError {
    PolicyError::Invalid {
        path: path.to_owned(),
        field,
        reason: reason.into(),
    }
}

/// Checks a `[kubernetes]` section as the API server would, so a typo fails at load time
/// rather than at each kernel start.
fn pod_settings(
    section: KubernetesSection,
) -> Result<crate::sandbox::PodSettings, (&'static str, String)> {
    let defaults = crate::sandbox::PodSettings::default();
    if section.image.trim().is_empty() || section.image.chars().any(char::is_whitespace) {
        return Err((
            "kubernetes.image",
            format!("{:?} is not an image reference", section.image),
        ));
    }
    // DNS-1123 names: namespaces are labels, RuntimeClasses and service accounts subdomains.
    fn dns_label(value: &str) -> bool {
        !value.is_empty()
            && value.len() <= 63
            && value
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !value.starts_with('-')
            && !value.ends_with('-')
    }
    fn dns_subdomain(value: &str) -> bool {
        value.len() <= 253 && value.split('.').all(dns_label)
    }
    let names = [
        (
            "kubernetes.namespace",
            section.namespace.as_deref().map(|v| (v, dns_label(v))),
        ),
        (
            "kubernetes.runtime_class",
            section
                .runtime_class
                .as_deref()
                .map(|v| (v, dns_subdomain(v))),
        ),
        (
            "kubernetes.service_account",
            section
                .service_account
                .as_deref()
                .map(|v| (v, dns_subdomain(v))),
        ),
    ];
    for (field, checked) in names {
        if let Some((value, false)) = checked {
            return Err((field, format!("{value:?} is not a valid Kubernetes name")));
        }
    }
    let image_pull_policy = section
        .image_pull_policy
        .unwrap_or(defaults.image_pull_policy);
    if !matches!(
        image_pull_policy.as_str(),
        "Always" | "IfNotPresent" | "Never"
    ) {
        return Err((
            "kubernetes.image_pull_policy",
            format!("{image_pull_policy:?} is not Always, IfNotPresent or Never"),
        ));
    }
    for toleration in &section.tolerations {
        if let Some(operator) = toleration.operator.as_deref() {
            if !matches!(operator, "Exists" | "Equal") {
                return Err((
                    "kubernetes.tolerations",
                    format!("operator {operator:?} is not Exists or Equal"),
                ));
            }
        }
        if let Some(effect) = toleration.effect.as_deref() {
            if !matches!(effect, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
                return Err((
                    "kubernetes.tolerations",
                    format!("effect {effect:?} is not NoSchedule, PreferNoSchedule or NoExecute"),
                ));
            }
        }
    }
    let pending_timeout = section.pending_timeout.unwrap_or(defaults.pending_timeout);
    if pending_timeout < Duration::from_secs(5) {
        return Err((
            "kubernetes.pending_timeout",
            "below 5s no pod starts".to_owned(),
        ));
    }
    for (kernelspec, image) in &section.kernel_images {
        if kernelspec.is_empty() || image.trim().is_empty() {
            return Err((
                "kubernetes.kernel_images",
                format!("{kernelspec:?} = {image:?}: a kernelspec's name and an image reference"),
            ));
        }
    }
    if section.image.trim().is_empty() {
        return Err(("kubernetes.image", "an image reference".to_owned()));
    }
    Ok(crate::sandbox::PodSettings {
        image: section.image,
        kernel_images: section.kernel_images,
        namespace: section.namespace,
        runtime_class: section.runtime_class,
        service_account: section.service_account,
        node_selector: section.node_selector,
        tolerations: section.tolerations,
        image_pull_policy,
        image_pull_secrets: section.image_pull_secrets,
        pending_timeout,
    })
}

impl Policy {
    /// Parses one policy file; `name` is the file's stem.
    pub fn parse(name: &str, path: &Path, text: &str) -> Result<Policy, PolicyError> {
        let file: PolicyFile = toml::from_str(text).map_err(|err| PolicyError::Parse {
            path: path.to_owned(),
            message: err.to_string(),
        })?;
        let d = PolicyLimits::default();
        let l = file.limits;
        let limits = PolicyLimits {
            execution_timeout: l.execution_timeout.unwrap_or(d.execution_timeout),
            interrupt_grace: l.interrupt_grace.unwrap_or(d.interrupt_grace),
            idle_timeout: l.idle_timeout.unwrap_or(d.idle_timeout),
            hibernate_after: l.hibernate_after,
            lifetime: l.lifetime.unwrap_or(d.lifetime),
            memory_bytes: l.memory.unwrap_or(d.memory_bytes),
            cpu_millis: match l.cpus {
                None => d.cpu_millis,
                Some(cpus) if (0.01..=1024.0).contains(&cpus) => (cpus * 1000.0).round() as u32,
                Some(cpus) => {
                    return Err(invalid(
                        path,
                        "limits.cpus",
                        format!("{cpus} is not between 0.01 and 1024"),
                    ))
                }
            },
            pids: l.pids.unwrap_or(d.pids),
            workspace_bytes: l.workspace.unwrap_or(d.workspace_bytes),
            output_per_execution_bytes: l
                .output_per_execution
                .unwrap_or(d.output_per_execution_bytes),
            max_kernels: l.max_kernels.unwrap_or(d.max_kernels),
            artifact_bytes: l.artifact_size.unwrap_or(d.artifact_bytes),
            artifacts_per_session_bytes: l
                .artifacts_per_session
                .unwrap_or(d.artifacts_per_session_bytes),
            artifacts_per_tenant_bytes: l
                .artifacts_per_tenant
                .unwrap_or(d.artifacts_per_tenant_bytes),
            upload_bytes: l.upload_size.unwrap_or(d.upload_bytes),
        };
        if limits.memory_bytes < 64 << 20 {
            return Err(invalid(
                path,
                "limits.memory",
                "below 64MiB a Python kernel cannot start",
            ));
        }
        if limits.pids < 16 {
            return Err(invalid(
                path,
                "limits.pids",
                "below 16 ipykernel's own threads do not fit",
            ));
        }
        if limits.execution_timeout.is_zero()
            || limits.idle_timeout.is_zero()
            || limits.lifetime.is_zero()
        {
            return Err(invalid(path, "limits", "timeouts must be longer than zero"));
        }
        if limits.workspace_bytes < 1 << 20 {
            return Err(invalid(path, "limits.workspace", "below 1MiB"));
        }
        if limits.max_kernels == 0 {
            return Err(invalid(path, "limits.max_kernels", "must be at least 1"));
        }
        let egress =
            access::egress_rules(file.egress).map_err(|(field, why)| invalid(path, field, why))?;
        let packages = access::package_rules(file.packages)
            .map_err(|(field, why)| invalid(path, field, why))?;
        let environment = environment::environment_rules(file.environment)
            .map_err(|(field, why)| invalid(path, field, why))?;
        let backend = file.sandbox.backend.unwrap_or(Backend::Namespaces);
        if file.sandbox.zygote.is_some() && backend != Backend::Namespaces {
            return Err(invalid(
                path,
                "sandbox.zygote",
                "only the namespaces backend forks kernels from a zygote",
            ));
        }
        if let Some(after) = limits.hibernate_after {
            if backend != Backend::Microvm {
                return Err(invalid(
                    path,
                    "limits.hibernate_after",
                    "only the microvm backend can hibernate a kernel so far (namespaces, \
                     gvisor and kubernetes kernels cannot be saved to disk: their idle kernels \
                     are culled at idle_timeout)",
                ));
            }
            if after.is_zero() || after >= limits.idle_timeout {
                return Err(invalid(
                    path,
                    "limits.hibernate_after",
                    format!(
                        "must be longer than zero and shorter than idle_timeout ({} s), which \
                         ends a hibernated kernel too",
                        limits.idle_timeout.as_secs()
                    ),
                ));
            }
        }
        if file.sandbox.allow_emulation && backend != Backend::Microvm {
            return Err(invalid(
                path,
                "sandbox.allow_emulation",
                "only the microvm backend runs under emulation",
            ));
        }
        let kubernetes = match (backend, file.kubernetes) {
            (Backend::Kubernetes, Some(section)) => Some(std::sync::Arc::new(
                pod_settings(section).map_err(|(field, why)| invalid(path, field, why))?,
            )),
            (Backend::Kubernetes, None) => {
                return Err(invalid(
                    path,
                    "kubernetes",
                    "the kubernetes backend needs a [kubernetes] section with at least `image`",
                ))
            }
            (_, Some(_)) => {
                return Err(invalid(
                    path,
                    "kubernetes",
                    "only a policy with `[sandbox] backend = \"kubernetes\"` runs pods",
                ))
            }
            (_, None) => None,
        };
        Ok(Policy {
            name: name.to_owned(),
            description: file.description.unwrap_or_default(),
            backend,
            allow_emulation: file.sandbox.allow_emulation,
            zygote: file.sandbox.zygote.unwrap_or(true),
            limits,
            egress,
            packages,
            environment,
            kubernetes,
        })
    }

    pub fn load(path: &Path) -> Result<Policy, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
            path: path.to_owned(),
            source,
        })?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Policy::parse(&name, path, &text)
    }
}

/// All policies of a gateway, by name. `default` always exists.
#[derive(Debug, Clone)]
pub struct Policies {
    by_name: BTreeMap<String, Policy>,
}

impl Policies {
    /// Loads every `*.toml` in `dir`; one bad file fails the whole load, so a gateway never
    /// starts with a policy silently missing.
    pub fn load(dir: &Path) -> Result<Policies, PolicyError> {
        let entries = std::fs::read_dir(dir).map_err(|source| PolicyError::Read {
            path: dir.to_owned(),
            source,
        })?;
        let mut by_name = BTreeMap::new();
        let mut paths: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        paths.sort();
        for path in paths {
            let policy = Policy::load(&path)?;
            by_name.insert(policy.name.clone(), policy);
        }
        if !by_name.contains_key("default") {
            return Err(PolicyError::NoDefault(dir.to_owned()));
        }
        Ok(Policies { by_name })
    }

    pub fn get(&self, name: &str) -> Result<&Policy, PolicyError> {
        self.by_name.get(name).ok_or_else(|| PolicyError::Unknown {
            name: name.to_owned(),
            known: self.by_name.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    pub fn default_policy(&self) -> &Policy {
        // load() refuses a directory without default.toml.
        &self.by_name["default"]
    }

    pub fn iter(&self) -> impl Iterator<Item = &Policy> {
        self.by_name.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Policy, PolicyError> {
        Policy::parse("t", Path::new("policies/t.toml"), text)
    }

    #[test]
    fn empty_file_means_defaults() {
        let p = parse("").unwrap();
        assert_eq!(p.limits, PolicyLimits::default());
        assert_eq!(p.backend, Backend::Namespaces);
    }

    #[test]
    fn fields_parse_with_units() {
        let p = parse(
            "description = \"x\"\n[sandbox]\nbackend = \"gvisor\"\n[limits]\nmemory = \"2GiB\"\ncpus = 1.5\nexecution_timeout = \"1m\"\n",
        )
        .unwrap();
        assert_eq!(p.backend, Backend::Gvisor);
        assert_eq!(p.limits.memory_bytes, 2 << 30);
        assert_eq!(p.limits.cpu_millis, 1500);
        assert_eq!(p.limits.execution_timeout, Duration::from_secs(60));
    }

    #[test]
    fn unknown_fields_and_bad_values_name_file_and_line() {
        let err = parse("[limits]\nmemory = \"1GiB\"\nmemroy = \"2GiB\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("policies/t.toml") && err.contains("line 3") && err.contains("memroy"),
            "{err}"
        );
        let err = parse("[limits]\nmemory = \"1GB\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2") && err.contains("GiB"), "{err}");
        let err = parse("[limits]\ncpus = 0\n").unwrap_err().to_string();
        assert!(err.contains("limits.cpus"), "{err}");
        let err = parse("[limits]\nmemory = \"1MiB\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("limits.memory"), "{err}");
        let err = parse("[egress]\nallow = []\nalow = []\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 3") && err.contains("alow"), "{err}");
        let err = parse("[packages]\nallow = [\"x>=1\", \"Y_z>=one\"]\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("t.toml")
                && err.contains("packages.allow")
                && err.contains("project 'y-z'"),
            "{err}"
        );
        let p = parse("[egress]\nallow = [\"*.a.org:443\"]\n[packages]\nallow = [\"Numpy\"]\ndependencies = \"implicit\"\n").unwrap();
        assert!(p.egress.allowing("x.a.org", 443).is_some());
        assert_eq!(p.packages.dependencies, Dependencies::Implicit);
        assert!(p.packages.rule("numpy").is_some());
        assert!(p.packages.npm.allow.is_empty(), "no npm list: nothing");
        let p = parse("[packages]\nnpm = [\"lodash@4\", \"@std/path\"]\n").unwrap();
        assert!(p.packages.npm.allows("lodash", "4.17.21") && p.packages.npm.lists("@std/path"));
        assert!(
            p.packages.rule("lodash").is_none(),
            "npm names are not Python projects"
        );
        let err = parse("[packages]\nnpm = [\"Lodash@banana\"]\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("packages.npm") && err.contains("package 'lodash'"),
            "{err}"
        );
        let err = parse("[sandbox]\nbackend = \"docker\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("docker"), "{err}");
        let pods = parse(
            "[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"r.example/k:1\"\nruntime_class = \"gvisor\"\npending_timeout = \"30s\"\ntolerations = [{ key = \"k\", operator = \"Exists\", effect = \"NoSchedule\" }]\n",
        )
        .unwrap();
        let settings = pods.kubernetes.unwrap();
        assert_eq!(settings.runtime_class.as_deref(), Some("gvisor"));
        assert_eq!(settings.pending_timeout, Duration::from_secs(30));
        assert_eq!(settings.image_pull_policy, "IfNotPresent");
        let err = parse("[sandbox]\nbackend = \"kubernetes\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("[kubernetes] section"), "{err}");
        let err = parse("[kubernetes]\nimage = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("only a policy"), "{err}");
        let err = parse("[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"x\"\nnamespace = \"Bad_NS\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("kubernetes.namespace"), "{err}");
        let err = parse("[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"x\"\nimagePullPolicy = \"Always\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("imagePullPolicy"), "{err}");
        let pods = parse("[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"r/k:1\"\nkernel_images = { deno = \"r/k-deno:1\" }\n").unwrap();
        let settings = pods.kubernetes.unwrap();
        assert_eq!(
            settings.kernel_images.get("deno").map(String::as_str),
            Some("r/k-deno:1")
        );
        let err = parse("[sandbox]\nbackend = \"kubernetes\"\n[kubernetes]\nimage = \"x\"\nkernel_images = { deno = \" \" }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("kubernetes.kernel_images"), "{err}");
        // The zygote is the namespaces backend's: on unless a policy says otherwise.
        assert!(parse("").unwrap().zygote);
        assert!(!parse("[sandbox]\nzygote = false\n").unwrap().zygote);
        let err = parse("[sandbox]\nbackend = \"gvisor\"\nzygote = false\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("sandbox.zygote"), "{err}");
        let err = parse("[sandbox]\nallow_emulation = true\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("sandbox.allow_emulation"), "{err}");
        let p = parse("[sandbox]\nbackend = \"microvm\"\nallow_emulation = true\n").unwrap();
        assert!(p.allow_emulation);
        assert!(
            !parse("[sandbox]\nbackend = \"microvm\"\n")
                .unwrap()
                .allow_emulation
        );
    }

    #[test]
    fn only_microvm_policies_hibernate_and_before_their_idle_timeout() {
        let vm = "[sandbox]\nbackend = \"microvm\"\n[limits]\n";
        let p = parse(&format!("{vm}hibernate_after = \"5m\"\n")).unwrap();
        assert_eq!(p.limits.hibernate_after, Some(Duration::from_secs(300)));
        assert!(p.backend_settings().hibernate);
        assert_eq!(parse(vm).unwrap().limits.hibernate_after, None);
        assert!(!parse(vm).unwrap().backend_settings().hibernate);
        for backend in ["namespaces", "gvisor"] {
            let err = parse(&format!(
                "[sandbox]\nbackend = \"{backend}\"\n[limits]\nhibernate_after = \"5m\"\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains("limits.hibernate_after"), "{err}");
            assert!(err.contains("only the microvm backend"), "{err}");
        }
        for late in [
            "hibernate_after = \"30m\"\n",
            "hibernate_after = \"1h\"\nidle_timeout = \"10m\"\n",
            "hibernate_after = \"0s\"\n",
        ] {
            let err = parse(&format!("{vm}{late}")).unwrap_err().to_string();
            assert!(err.contains("shorter than idle_timeout"), "{late}: {err}");
        }
    }

    #[test]
    fn the_shipped_policies_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
        let policies = Policies::load(&dir).unwrap();
        let d = policies.default_policy();
        assert_eq!(
            d.limits,
            PolicyLimits::default(),
            "default.toml states the built-in defaults"
        );
        assert_eq!(d.backend, Backend::Namespaces);
        for name in ["strict", "data-science"] {
            let p = policies.get(name).unwrap();
            assert!(!p.description.is_empty());
        }
        assert!(policies
            .get("nope")
            .unwrap_err()
            .to_string()
            .contains("default"));
    }
}
