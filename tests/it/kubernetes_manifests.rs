//! The Kubernetes kit in `deploy/kubernetes/` (DEPLOY.md, "Kubernetes"), checked without a
//! cluster:
//!
//! - every YAML document parses into the k8s-openapi type of its `kind` (right
//!   `apiVersion`, right field types), and the typed object, written back, still has every
//!   field of the file: k8s-openapi ignores unknown fields, as the API server drops them, so
//!   a misspelt `runAsNonroot` would otherwise pass and silently mean nothing;
//! - the kustomization names only files that exist, and every manifest beside it;
//! - the objects agree with each other and with the gateway's contract (issue 18): the
//!   Role's exact verbs, the Deployment's labels that the kernels' NetworkPolicy admits, its
//!   security context, probes and scrape annotations on ports it serves, `CELLGATE_*`
//!   variables `cellgate serve` knows, the config file and the volumes it names, the Service
//!   and the budget selecting its pods; the pods and NetworkPolicy the gateway creates
//!   (built by its own code) against the namespace's Pod Security profile, the
//!   Deployment's labels and the kernel image;
//! - the policy example matches the local default policy in every rule but the sandbox.
//!
//! The images are not built here (no registry, no Docker daemon): their Dockerfiles are
//! checked as text.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, ensure, Context, Result};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, Pod, PodSpec, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::Resource;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::support;

/// The labels of the gateway's pods: the per-policy NetworkPolicy the gateway creates admits
/// exactly these to its kernels' agent port (the contract of issue 18).
const GATEWAY_LABELS: [(&str, &str); 2] = [
    ("app.kubernetes.io/name", "cellgate"),
    ("app.kubernetes.io/component", "gateway"),
];
/// The gateway's rights: (API group, resource) → verbs. Exactly these, nothing more.
fn gateway_rights() -> BTreeMap<(&'static str, &'static str), BTreeSet<&'static str>> {
    let rights: [(&str, &str, &[&str]); 4] = [
        ("", "pods", &["create", "get", "list", "watch", "delete"]),
        ("", "secrets", &["create", "get", "delete"]),
        (
            "networking.k8s.io",
            "networkpolicies",
            &["create", "get", "update"],
        ),
        (
            "coordination.k8s.io",
            "leases",
            &["create", "get", "list", "update", "delete"],
        ),
    ];
    rights
        .into_iter()
        .map(|(group, resource, verbs)| ((group, resource), verbs.iter().copied().collect()))
        .collect()
}

pub(crate) fn kit() -> PathBuf {
    support::repo().join("deploy/kubernetes")
}

/// A path as the messages show it: relative to the repository.
pub(crate) fn shown(path: &Path) -> String {
    path.strip_prefix(support::repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

pub(crate) fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("read {}", shown(path)))
}

// --- reading the kit -------------------------------------------------------------------------

/// The `.yaml` files below `dir`, sorted.
fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("read {}", shown(dir)))? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(yaml_files(&path)?);
        } else if path
            .extension()
            .is_some_and(|ext| ext == "yaml" || ext == "yml")
        {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The documents of a YAML file (split on `---`; empty documents skipped), read as
/// Kubernetes reads them: YAML 1.1's octal `0440` is 288, as `defaultMode` means it.
pub(crate) fn yaml_documents(text: &str) -> Result<Vec<Value>> {
    let options = serde_saphyr::options! { legacy_octal_numbers: true };
    serde_saphyr::from_multiple_with_options::<Value>(text, options).map_err(|e| anyhow!("{e}"))
}

/// One Kubernetes object of the kit.
pub(crate) struct Manifest {
    pub(crate) file: PathBuf,
    /// Its place in a multi-document file, from 1.
    pub(crate) document: usize,
    pub(crate) value: Value,
}

impl Manifest {
    pub(crate) fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or_default()
    }

    pub(crate) fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or_default()
    }

    fn at(&self) -> String {
        format!(
            "{} (document {}, {} {})",
            shown(&self.file),
            self.document,
            self.kind(),
            self.name()
        )
    }

    /// The directory below `deploy/kubernetes` the file is in ("" for the base).
    pub(crate) fn dir(&self) -> String {
        self.file
            .parent()
            .and_then(|dir| dir.strip_prefix(kit()).ok())
            .map(|dir| dir.display().to_string())
            .unwrap_or_default()
    }

    fn typed<T: Resource + DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_value(self.value.clone()).with_context(|| self.at())
    }
}

/// Every Kubernetes object of the kit: each document of each YAML file but the
/// kustomization (a file for kustomize, not an object of the API).
pub(crate) fn manifests() -> Result<Vec<Manifest>> {
    let mut manifests = Vec::new();
    for file in yaml_files(&kit())? {
        if file
            .file_name()
            .is_some_and(|name| name == "kustomization.yaml")
        {
            continue;
        }
        let documents = yaml_documents(&read(&file)?)
            .with_context(|| format!("{} is not YAML", shown(&file)))?;
        ensure!(!documents.is_empty(), "{} holds no document", shown(&file));
        for (index, value) in documents.into_iter().enumerate() {
            manifests.push(Manifest {
                file: file.clone(),
                document: index + 1,
                value,
            });
        }
    }
    Ok(manifests)
}

/// The one object of kind `T` named `name` in directory `dir` of the kit.
fn find<T: Resource + DeserializeOwned>(
    manifests: &[Manifest],
    dir: &str,
    name: &str,
) -> Result<T> {
    let found: Vec<&Manifest> = manifests
        .iter()
        .filter(|m| m.kind() == T::KIND && m.dir() == dir && m.name() == name)
        .collect();
    match found.as_slice() {
        [one] => one.typed(),
        [] => bail!("no {} named {name} in deploy/kubernetes/{dir}", T::KIND),
        _ => bail!(
            "{} {} named {name} in deploy/kubernetes/{dir}",
            found.len(),
            T::KIND
        ),
    }
}

/// Every object of kind `T` in directory `dir`.
fn all<T: Resource + DeserializeOwned>(manifests: &[Manifest], dir: &str) -> Result<Vec<T>> {
    manifests
        .iter()
        .filter(|m| m.kind() == T::KIND && m.dir() == dir)
        .map(Manifest::typed)
        .collect()
}

// --- typed and complete ----------------------------------------------------------------------

/// The document through its k8s-openapi type and back.
fn round_trip<T: Resource + DeserializeOwned + Serialize>(value: &Value) -> Result<Value> {
    let typed: T = serde_json::from_value(value.clone())?;
    Ok(serde_json::to_value(&typed)?)
}

/// The round trip of the type of `value`'s kind; a kind this test does not know fails.
fn typed_round_trip(value: &Value) -> Result<Value> {
    type RoundTrip = fn(&Value) -> Result<Value>;
    let known: [(&str, RoundTrip); 14] = [
        (Namespace::KIND, round_trip::<Namespace>),
        (ServiceAccount::KIND, round_trip::<ServiceAccount>),
        (Role::KIND, round_trip::<Role>),
        (RoleBinding::KIND, round_trip::<RoleBinding>),
        (ClusterRole::KIND, round_trip::<ClusterRole>),
        (ClusterRoleBinding::KIND, round_trip::<ClusterRoleBinding>),
        (Deployment::KIND, round_trip::<Deployment>),
        (Service::KIND, round_trip::<Service>),
        (PodDisruptionBudget::KIND, round_trip::<PodDisruptionBudget>),
        (ConfigMap::KIND, round_trip::<ConfigMap>),
        (Secret::KIND, round_trip::<Secret>),
        (RuntimeClass::KIND, round_trip::<RuntimeClass>),
        (NetworkPolicy::KIND, round_trip::<NetworkPolicy>),
        (Pod::KIND, round_trip::<Pod>),
    ];
    let kind = value["kind"].as_str().context("no `kind`")?;
    let (_, round_trip) = known
        .iter()
        .find(|(known, _)| *known == kind)
        .with_context(|| {
            format!("kind {kind:?} is not one this test knows: add its k8s-openapi type")
        })?;
    round_trip(value)
}

/// The fields of `original` that `typed` (its round trip) lost or changed, as paths.
fn dropped_fields(original: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (original, typed) {
        (Value::Object(original), Value::Object(typed)) => {
            for (key, value) in original {
                let here = format!("{path}.{key}");
                match typed.get(key) {
                    Some(kept) => dropped_fields(value, kept, &here, out),
                    None => out.push(here),
                }
            }
        }
        (Value::Array(original), Value::Array(typed)) => {
            if original.len() != typed.len() {
                out.push(format!(
                    "{path} ({} items, {} kept)",
                    original.len(),
                    typed.len()
                ));
            }
            for (index, (value, kept)) in original.iter().zip(typed).enumerate() {
                dropped_fields(value, kept, &format!("{path}[{index}]"), out);
            }
        }
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => {}
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path} ({a} became {b})")),
    }
}

/// Why a document is not a complete, typed object of its kind (None: it is).
fn check_document(value: &Value) -> Result<()> {
    let typed = typed_round_trip(value)?;
    let mut dropped = Vec::new();
    dropped_fields(value, &typed, "", &mut dropped);
    ensure!(
        dropped.is_empty(),
        "fields its type does not have (misspelt, or misplaced): {}",
        dropped.join(", ")
    );
    Ok(())
}

#[test]
fn every_manifest_is_a_typed_object_with_no_unknown_field() -> Result<()> {
    let manifests = manifests()?;
    let mut failures = Vec::new();
    for manifest in &manifests {
        if let Err(error) = check_document(&manifest.value) {
            failures.push(format!("{}: {error:#}", manifest.at()));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    // The kit as DEPLOY.md describes it: a missing file fails here, not in a cluster.
    let kinds: BTreeSet<&str> = manifests.iter().map(Manifest::kind).collect();
    for kind in [
        Namespace::KIND,
        ServiceAccount::KIND,
        Role::KIND,
        RoleBinding::KIND,
        Deployment::KIND,
        Service::KIND,
        PodDisruptionBudget::KIND,
        RuntimeClass::KIND,
    ] {
        ensure!(kinds.contains(kind), "no {kind} in deploy/kubernetes");
    }
    Ok(())
}

/// The check itself: what it must catch.
#[test]
fn the_manifest_check_catches_misspelt_fields_and_wrong_versions() -> Result<()> {
    let deployment = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: x}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      securityContext: {runAsNonroot: true}
      containers: [{name: c, image: i, ports: [{containerPort: 1, nmae: x}]}]
"#;
    let value = &yaml_documents(deployment)?[0];
    let error = check_document(value).expect_err("a misspelt field passed");
    let message = format!("{error:#}");
    for path in [
        ".spec.template.spec.securityContext.runAsNonroot",
        ".spec.template.spec.containers[0].ports[0].nmae",
    ] {
        ensure!(message.contains(path), "{path} not reported: {message}");
    }
    // A field of the wrong type, and a kind at an apiVersion that does not serve it.
    let wrong_type = "apiVersion: v1\nkind: Namespace\nmetadata: {name: x, labels: {a: true}}\n";
    ensure!(check_document(&yaml_documents(wrong_type)?[0]).is_err());
    let wrong_version =
        "apiVersion: policy/v1beta1\nkind: PodDisruptionBudget\nmetadata: {name: x}\n";
    ensure!(check_document(&yaml_documents(wrong_version)?[0]).is_err());
    // Two documents, an empty one skipped; octal as Kubernetes reads it.
    let two = "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\n---\nx: 0440\n";
    let documents = yaml_documents(two)?;
    ensure!(documents.len() == 2, "{documents:?}");
    ensure!(documents[1]["x"] == 288, "{documents:?}");
    Ok(())
}

// --- the kustomization -----------------------------------------------------------------------

/// kustomize's top-level fields (a typo among them is otherwise ignored by nothing: kustomize
/// refuses it, but only when someone runs it).
const KUSTOMIZATION_FIELDS: [&str; 30] = [
    "apiVersion",
    "kind",
    "metadata",
    "openapi",
    "namePrefix",
    "nameSuffix",
    "namespace",
    "commonLabels",
    "labels",
    "commonAnnotations",
    "patchesStrategicMerge",
    "patchesJson6902",
    "patches",
    "images",
    "replacements",
    "replicas",
    "vars",
    "sortOptions",
    "resources",
    "crds",
    "components",
    "configMapGenerator",
    "secretGenerator",
    "generatorOptions",
    "helmCharts",
    "helmGlobals",
    "configurations",
    "generators",
    "transformers",
    "buildMetadata",
];

pub(crate) fn kustomization() -> Result<Value> {
    let path = kit().join("kustomization.yaml");
    let mut documents = yaml_documents(&read(&path)?)?;
    ensure!(documents.len() == 1, "kustomization.yaml: one document");
    Ok(documents.remove(0))
}

/// The file names a generator entry reads (`file` or `key=file`).
pub(crate) fn generator_files(entry: &Value) -> Vec<String> {
    entry["files"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|file| file.split_once('=').map_or(file, |(_, f)| f).to_owned())
        .collect()
}

pub(crate) fn strings(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

#[test]
fn the_kustomization_names_every_manifest_and_only_files_that_exist() -> Result<()> {
    let kustomization = kustomization()?;
    let fields = kustomization.as_object().context("not a mapping")?;
    for key in fields.keys() {
        ensure!(
            KUSTOMIZATION_FIELDS.contains(&key.as_str()),
            "kustomization.yaml: {key:?} is no kustomize field"
        );
    }
    ensure!(kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1");
    ensure!(kustomization["kind"] == "Kustomization");

    // resources: files of this directory, and all of them (a manifest left out of the list
    // would silently never reach the cluster).
    let resources: BTreeSet<&str> = strings(&kustomization["resources"]).into_iter().collect();
    for resource in &resources {
        ensure!(
            !resource.contains('/') && kit().join(resource).is_file(),
            "resource {resource}: not a file beside kustomization.yaml"
        );
    }
    for file in std::fs::read_dir(kit())? {
        let name = file?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".yaml") && name != "kustomization.yaml" {
            ensure!(
                resources.contains(name.as_str()),
                "{name} is not in resources"
            );
        }
    }

    // Only namespaced objects, all in the kustomization's namespace (so `kubectl apply -f`
    // of one file lands in the same place), and that namespace among them.
    let namespace = kustomization["namespace"].as_str().context("namespace")?;
    let manifests = manifests()?;
    let base: Vec<&Manifest> = manifests.iter().filter(|m| m.dir().is_empty()).collect();
    for manifest in &base {
        match manifest.kind() {
            "Namespace" => ensure!(manifest.name() == namespace, "{}", manifest.at()),
            "RuntimeClass" | "ClusterRole" | "ClusterRoleBinding" => {
                bail!(
                    "{}: cluster-scoped, not for the namespaced base",
                    manifest.at()
                )
            }
            _ => ensure!(
                manifest.value["metadata"]["namespace"] == namespace,
                "{}: metadata.namespace is not {namespace}",
                manifest.at()
            ),
        }
    }
    ensure!(
        base.iter().any(|m| m.kind() == "Namespace"),
        "no Namespace object"
    );

    // Generated ConfigMaps: their files exist, every policy file is in one, and they are the
    // ConfigMaps the Deployment mounts (kustomize rewrites those names with a hash).
    let generators = kustomization["configMapGenerator"]
        .as_array()
        .context("configMapGenerator")?;
    let mut generated = BTreeSet::new();
    let mut generated_files = BTreeSet::new();
    for entry in generators {
        generated.insert(
            entry["name"]
                .as_str()
                .context("a generator's name")?
                .to_owned(),
        );
        for file in generator_files(entry) {
            ensure!(
                kit().join(&file).is_file(),
                "configMapGenerator: {file} is missing"
            );
            generated_files.insert(file);
        }
    }
    for policy in std::fs::read_dir(kit().join("policies"))? {
        let name = format!("policies/{}", policy?.file_name().to_string_lossy());
        if name.ends_with(".toml") {
            ensure!(generated_files.contains(&name), "{name} is in no ConfigMap");
        }
    }
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let pod = pod_spec(&deployment)?;
    for volume in pod.volumes.iter().flatten() {
        if let Some(config_map) = &volume.config_map {
            ensure!(
                generated.contains(&config_map.name),
                "volume {}: ConfigMap {} is not generated",
                volume.name,
                config_map.name
            );
        }
    }

    // Nothing secret in the repository: no Secret object, no secretGenerator.
    ensure!(
        kustomization.get("secretGenerator").is_none(),
        "secrets are created by hand (DEPLOY.md), not generated from files here"
    );
    ensure!(
        !base.iter().any(|m| m.kind() == "Secret"),
        "a Secret in the base"
    );

    // images: each entry renames an image some container uses, and every container's image
    // has an entry (the operator's registry goes there).
    let images: BTreeSet<&str> = kustomization["images"]
        .as_array()
        .context("images")?
        .iter()
        .filter_map(|image| image["name"].as_str())
        .collect();
    let used: BTreeSet<&str> = pod
        .containers
        .iter()
        .filter_map(|c| c.image.as_deref())
        .collect();
    ensure!(
        images == used,
        "images {images:?}, containers' images {used:?}"
    );
    Ok(())
}

// --- the Role ----------------------------------------------------------------------------

#[test]
fn the_role_grants_exactly_the_gateways_verbs() -> Result<()> {
    let manifests = manifests()?;
    ensure!(
        !manifests
            .iter()
            .any(|m| matches!(m.kind(), "ClusterRole" | "ClusterRoleBinding")),
        "the gateway has no cluster-scoped right"
    );
    let role: Role = find(&manifests, "", "cellgate-gateway")?;
    let mut granted: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for rule in role.rules.iter().flatten() {
        ensure!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "rule {rule:?}: resourceNames or nonResourceURLs"
        );
        let groups = rule.api_groups.as_deref().unwrap_or_default();
        let resources = rule.resources.as_deref().unwrap_or_default();
        for name in groups.iter().chain(resources).chain(&rule.verbs) {
            ensure!(!name.contains('*'), "a wildcard in {rule:?}");
        }
        for group in groups {
            for resource in resources {
                granted
                    .entry((group.clone(), resource.clone()))
                    .or_default()
                    .extend(rule.verbs.iter().cloned());
            }
        }
    }
    let expected: BTreeMap<(String, String), BTreeSet<String>> = gateway_rights()
        .into_iter()
        .map(|((group, resource), verbs)| {
            (
                (group.to_owned(), resource.to_owned()),
                verbs.into_iter().map(str::to_owned).collect(),
            )
        })
        .collect();
    ensure!(
        granted == expected,
        "the Role grants\n{granted:#?}\nthe gateway's contract is\n{expected:#?}"
    );

    // Bound to the ServiceAccount the Deployment runs as, in the Role's namespace.
    let binding: RoleBinding = find(&manifests, "", "cellgate-gateway")?;
    ensure!(binding.role_ref.kind == "Role" && binding.role_ref.name == "cellgate-gateway");
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let account = pod_spec(&deployment)?
        .service_account_name
        .clone()
        .context("the Deployment names no serviceAccountName")?;
    let _: ServiceAccount = find(&manifests, "", &account)?;
    let subjects = binding.subjects.as_deref().unwrap_or_default();
    ensure!(
        subjects.len() == 1
            && subjects[0].kind == "ServiceAccount"
            && subjects[0].name == account
            && subjects[0].namespace == role.metadata.namespace,
        "the RoleBinding's subjects: {subjects:?}"
    );
    Ok(())
}

// --- the Deployment ----------------------------------------------------------------------------

fn pod_spec(deployment: &Deployment) -> Result<&PodSpec> {
    deployment
        .spec
        .as_ref()
        .and_then(|spec| spec.template.spec.as_ref())
        .context("the Deployment has no pod template spec")
}

fn pod_labels(deployment: &Deployment) -> BTreeMap<String, String> {
    deployment
        .spec
        .as_ref()
        .and_then(|spec| spec.template.metadata.as_ref())
        .and_then(|meta| meta.labels.clone())
        .unwrap_or_default()
}

fn gateway_container(deployment: &Deployment) -> Result<&Container> {
    let containers = &pod_spec(deployment)?.containers;
    ensure!(containers.len() == 1, "one container: {}", containers.len());
    Ok(&containers[0])
}

/// Every label of `selector` is on `labels`, with the same value.
fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The container port a probe or a Service names (by name or number).
fn container_port(container: &Container, port: &IntOrString) -> Result<i32> {
    let ports = container.ports.as_deref().unwrap_or_default();
    let found = match port {
        IntOrString::Int(number) => ports.iter().find(|p| p.container_port == *number),
        IntOrString::String(name) => ports.iter().find(|p| p.name.as_deref() == Some(name)),
    };
    found
        .map(|p| p.container_port)
        .with_context(|| format!("port {port:?} is not one the container exposes"))
}

fn named_port(container: &Container, name: &str) -> Result<i32> {
    container_port(container, &IntOrString::String(name.to_owned()))
}

fn env_value<'a>(container: &'a Container, name: &str) -> Option<&'a str> {
    container
        .env
        .iter()
        .flatten()
        .find(|var| var.name == name)
        .and_then(|var| var.value.as_deref())
}

#[test]
fn the_deployment_runs_unprivileged_replicas_with_the_labels_their_kernels_admit() -> Result<()> {
    let manifests = manifests()?;
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let spec = deployment.spec.as_ref().context("spec")?;
    // Replicas sharing kernels through leases; a rolling update that starts the new one
    // before the old one hands its kernels over.
    ensure!(spec.replicas >= Some(2), "replicas: {:?}", spec.replicas);
    let strategy = spec.strategy.as_ref().context("strategy")?;
    ensure!(
        strategy.type_.as_deref() == Some("RollingUpdate")
            && strategy
                .rolling_update
                .as_ref()
                .and_then(|r| r.max_unavailable.clone())
                == Some(IntOrString::Int(0)),
        "strategy: {strategy:?}"
    );
    let env = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|p| p.containers[0].env.clone().unwrap_or_default())
        .unwrap_or_default();
    let from_field = |name: &str| {
        env.iter()
            .find(|var| var.name == name)
            .and_then(|var| var.value_from.as_ref()?.field_ref.as_ref())
            .map(|field| field.field_path.clone())
    };
    ensure!(
        from_field("CELLGATE_REPLICA_ID").as_deref() == Some("metadata.name"),
        "each replica is named by its pod"
    );
    ensure!(from_field("POD_IP").as_deref() == Some("status.podIP"));
    ensure!(
        env.iter().any(|var| var.name == "CELLGATE_REPLICA_URL"
            && var.value.as_deref() == Some("http://$(POD_IP):8888")),
        "the replica URL is the pod's address on the API port"
    );

    let labels = pod_labels(&deployment);
    for (key, value) in GATEWAY_LABELS {
        ensure!(
            labels.get(key).map(String::as_str) == Some(value),
            "the gateway's pods need {key}={value}: the kernels' NetworkPolicy admits only them"
        );
    }
    let selector = spec.selector.match_labels.clone().unwrap_or_default();
    ensure!(
        selects(&selector, &labels),
        "the selector {selector:?} misses its own pods"
    );

    let pod = pod_spec(&deployment)?;
    // The gateway talks to the API server with its token; kernels are pods, so nothing
    // here needs a privilege or the host.
    ensure!(
        pod.automount_service_account_token == Some(true),
        "the gateway needs its ServiceAccount token (in-cluster config)"
    );
    ensure!(
        pod.host_network != Some(true) && pod.host_pid != Some(true) && pod.host_ipc != Some(true)
    );
    let security = pod
        .security_context
        .as_ref()
        .context("pod securityContext")?;
    ensure!(security.run_as_non_root == Some(true), "runAsNonRoot");
    ensure!(
        security.run_as_user.is_some_and(|uid| uid != 0),
        "runAsUser"
    );
    let seccomp = security.seccomp_profile.as_ref().map(|p| p.type_.as_str());
    ensure!(
        seccomp == Some("RuntimeDefault"),
        "seccompProfile: {seccomp:?}"
    );
    for volume in pod.volumes.iter().flatten() {
        ensure!(
            volume.config_map.is_some() || volume.empty_dir.is_some() || volume.secret.is_some(),
            "volume {}: only ConfigMaps, Secrets and emptyDirs",
            volume.name
        );
    }

    let container = gateway_container(&deployment)?;
    let security = container
        .security_context
        .as_ref()
        .context("container securityContext")?;
    ensure!(
        security.read_only_root_filesystem == Some(true),
        "readOnlyRootFilesystem"
    );
    ensure!(
        security.allow_privilege_escalation == Some(false),
        "allowPrivilegeEscalation"
    );
    ensure!(security.privileged != Some(true), "privileged");
    let capabilities = security.capabilities.as_ref().context("capabilities")?;
    ensure!(
        capabilities.drop.as_deref() == Some(&["ALL".to_owned()][..])
            && capabilities.add.as_deref().unwrap_or_default().is_empty(),
        "capabilities: drop ALL, add none: {capabilities:?}"
    );
    // A read-only root: /tmp is a volume.
    let mounts: Vec<&str> = container
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect();
    ensure!(mounts.contains(&"/tmp"), "no volume at /tmp: {mounts:?}");

    // The image runs as the user the pod says (files it owns, and runAsNonRoot's check).
    let dockerfile = Dockerfile::read("gateway.Dockerfile")?;
    let user = format!(
        "{}:{}",
        security_uid(pod)?,
        pod.security_context
            .as_ref()
            .and_then(|s| s.run_as_group)
            .context("runAsGroup")?
    );
    ensure!(
        dockerfile.final_user() == Some(user.as_str()),
        "gateway.Dockerfile's USER {:?}, the pod's {user}",
        dockerfile.final_user()
    );
    Ok(())
}

/// The replicas spread over nodes and then zones, as a preference (a one-node cluster still
/// runs them all), counting the gateway's own pods only.
#[test]
fn the_gateway_replicas_spread_over_nodes_and_zones() -> Result<()> {
    let manifests = manifests()?;
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let labels = pod_labels(&deployment);
    let constraints = pod_spec(&deployment)?
        .topology_spread_constraints
        .as_deref()
        .unwrap_or_default();
    for key in ["kubernetes.io/hostname", "topology.kubernetes.io/zone"] {
        let constraint = constraints
            .iter()
            .find(|c| c.topology_key == key)
            .with_context(|| format!("no topologySpreadConstraint over {key}: {constraints:?}"))?;
        ensure!(
            constraint.max_skew == 1 && constraint.when_unsatisfiable == "ScheduleAnyway",
            "{key}: maxSkew 1 and ScheduleAnyway (a preference, never a pending replica): {constraint:?}"
        );
        let selector = constraint
            .label_selector
            .as_ref()
            .with_context(|| format!("{key}: no labelSelector"))?;
        let match_labels = selector.match_labels.clone().unwrap_or_default();
        ensure!(
            selector.match_expressions.is_none() && selects(&match_labels, &labels),
            "{key}: the selector {selector:?} misses the gateway's pods"
        );
        // The gateway's own labels, not merely some of its pods' (kustomize adds
        // `part-of`, which other pods of the namespace could share).
        for (label, value) in GATEWAY_LABELS {
            ensure!(
                match_labels.get(label).map(String::as_str) == Some(value),
                "{key}: the selector does not name {label}={value}: {match_labels:?}"
            );
        }
    }
    Ok(())
}

fn security_uid(pod: &PodSpec) -> Result<i64> {
    pod.security_context
        .as_ref()
        .and_then(|s| s.run_as_user)
        .context("runAsUser")
}

#[test]
fn the_probes_and_scrape_annotations_name_ports_the_gateway_serves() -> Result<()> {
    let manifests = manifests()?;
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let container = gateway_container(&deployment)?;
    let metrics_port = named_port(container, "metrics")?;
    let http_port = named_port(container, "http")?;

    // The metrics listener: the variable's port is the port named `metrics`, on every
    // address of the pod (the kubelet and Prometheus come from outside it).
    let listen: SocketAddr = env_value(container, "CELLGATE_METRICS_LISTEN")
        .context("CELLGATE_METRICS_LISTEN is not set")?
        .parse()?;
    ensure!(
        listen.ip().is_unspecified() && i32::from(listen.port()) == metrics_port,
        "CELLGATE_METRICS_LISTEN={listen}, the container's metrics port {metrics_port}"
    );

    let annotations = deployment
        .spec
        .as_ref()
        .and_then(|spec| spec.template.metadata.as_ref())
        .and_then(|meta| meta.annotations.clone())
        .unwrap_or_default();
    let annotation = |key: &str| annotations.get(key).map(String::as_str);
    ensure!(annotation("prometheus.io/scrape") == Some("true"));
    ensure!(annotation("prometheus.io/path") == Some("/metrics"));
    ensure!(
        annotation("prometheus.io/port") == Some(metrics_port.to_string().as_str()),
        "prometheus.io/port {:?}: the metrics listener is on {metrics_port}",
        annotation("prometheus.io/port")
    );

    // Liveness and start-up ask /healthz, readiness /readyz, each on a port the gateway
    // serves them on (both listeners do).
    let probes = [
        ("startupProbe", &container.startup_probe, "/healthz"),
        ("livenessProbe", &container.liveness_probe, "/healthz"),
        ("readinessProbe", &container.readiness_probe, "/readyz"),
    ];
    for (name, probe, path) in probes {
        let get = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .with_context(|| format!("{name}: no httpGet"))?;
        ensure!(
            get.path.as_deref() == Some(path),
            "{name}: path {:?}, not {path}",
            get.path
        );
        let port = container_port(container, &get.port).with_context(|| name.to_owned())?;
        ensure!(
            port == metrics_port || port == http_port,
            "{name}: port {port} serves no probe"
        );
    }
    Ok(())
}

/// The `CELLGATE_*` variables `cellgate serve` reads, from its `--help`.
fn serve_variables() -> Result<BTreeSet<String>> {
    let out = Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .args(["serve", "--help"])
        .output()?;
    ensure!(out.status.success(), "cellgate serve --help failed");
    let help = String::from_utf8(out.stdout)?;
    let names: BTreeSet<String> = help
        .split("[env: ")
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect::<String>()
        })
        .collect();
    ensure!(
        names.contains("CELLGATE_AUTH_TOKEN") && names.contains("CELLGATE_METRICS_LISTEN"),
        "no [env: …] names found in `cellgate serve --help`:\n{help}"
    );
    Ok(names)
}

#[test]
fn the_deployment_sets_only_variables_cellgate_serve_knows() -> Result<()> {
    let known = serve_variables()?;
    let manifests = manifests()?;
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let container = gateway_container(&deployment)?;
    for var in container.env.iter().flatten() {
        if var.name.starts_with("CELLGATE_") {
            ensure!(
                known.contains(&var.name),
                "{} is not a variable of `cellgate serve` (known: {known:?})",
                var.name
            );
        }
    }
    ensure!(
        container.env_from.is_none(),
        "envFrom hides which variables are set"
    );

    // The token comes from the Secret DEPLOY.md tells the operator to create, by that
    // name and key.
    let token = container
        .env
        .iter()
        .flatten()
        .find(|var| var.name == "CELLGATE_AUTH_TOKEN")
        .context("CELLGATE_AUTH_TOKEN is not set")?;
    let secret = token
        .value_from
        .as_ref()
        .and_then(|from| from.secret_key_ref.as_ref())
        .context("CELLGATE_AUTH_TOKEN must come from a Secret")?;
    let deploy_md = read(&support::repo().join("DEPLOY.md"))?;
    let create = format!("create secret generic {}", secret.name);
    let key = format!("--from-file={}=", secret.key);
    ensure!(
        deploy_md
            .lines()
            .any(|line| line.contains(&create) && line.contains(&key)),
        "DEPLOY.md never says `kubectl … {create} {key}…`"
    );
    Ok(())
}

#[test]
fn the_gateway_config_parses_and_names_the_pods_volumes() -> Result<()> {
    let manifests = manifests()?;
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let pod = pod_spec(&deployment)?;
    let container = gateway_container(&deployment)?;
    let kustomization = kustomization()?;

    // Where each volume is mounted, and what it is.
    let mount_of = |volume: &str| -> Option<&str> {
        container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == volume)
            .map(|m| m.mount_path.as_str())
    };
    let config_map_mount = |config_map: &str| -> Result<&str> {
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.config_map.as_ref().is_some_and(|c| c.name == config_map))
            .with_context(|| format!("no volume of ConfigMap {config_map}"))?;
        mount_of(&volume.name).with_context(|| format!("volume {} is not mounted", volume.name))
    };
    let writable: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .filter(|v| v.empty_dir.is_some())
        .filter_map(|v| mount_of(&v.name))
        .collect();

    // `serve --config FILE`, FILE being the generated ConfigMap's file where it is mounted.
    let args: Vec<&str> = container
        .args
        .iter()
        .flatten()
        .map(String::as_str)
        .collect();
    let config_arg = match args.as_slice() {
        ["serve", "--config", path] => *path,
        other => bail!("args {other:?}: expected serve --config FILE"),
    };
    let generator = kustomization["configMapGenerator"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|g| g["name"] == "cellgate-config")
        .context("no cellgate-config generator")?;
    let files = generator_files(generator);
    ensure!(files.len() == 1, "cellgate-config: one file, {files:?}");
    let file_name = Path::new(&files[0]).file_name().context("file name")?;
    let expected = Path::new(config_map_mount("cellgate-config")?).join(file_name);
    ensure!(
        Path::new(config_arg) == expected,
        "--config {config_arg}, the ConfigMap's file is at {}",
        expected.display()
    );

    // cellgate's own parser accepts the file (unknown keys are errors), with the token the
    // Secret provides.
    let path = kit().join(&files[0]);
    let args = cellgate::config::ServeArgs {
        config: Some(path.clone()),
        token: Some("from-the-secret".to_owned()),
        ..Default::default()
    };
    cellgate::config::GatewayConfig::resolve(&args)
        .map_err(|e| anyhow!("{}: {e}", shown(&path)))?;

    // And what it names is where the pod has it.
    let config: toml::Table = toml::from_str(&read(&path)?)?;
    let setting = |key: &str| -> Result<&str> {
        config
            .get(key)
            .and_then(toml::Value::as_str)
            .with_context(|| format!("{}: no {key}", shown(&path)))
    };
    let port = config.get("port").and_then(toml::Value::as_integer);
    ensure!(
        port == Some(i64::from(named_port(container, "http")?)),
        "port {port:?} is not the container's http port"
    );
    ensure!(
        setting("ip")? == "0.0.0.0",
        "the pod's clients come from outside it"
    );
    ensure!(
        setting("policies_dir")? == config_map_mount("cellgate-policies")?,
        "policies_dir is not where ConfigMap cellgate-policies is mounted"
    );
    // The root is read-only: what the gateway writes is on its emptyDirs.
    for key in ["runtime_dir", "state_dir", "package_cache_dir"] {
        let dir = setting(key)?;
        ensure!(
            writable
                .iter()
                .any(|mount| Path::new(dir).starts_with(mount)),
            "{key} {dir} is on no emptyDir volume ({writable:?})"
        );
    }
    // The kernelspecs are in the gateway image.
    let kernels_dir = setting("kernels_dir")?;
    let dockerfile = read(&kit().join("images/gateway.Dockerfile"))?;
    ensure!(
        dockerfile.contains(&format!("{kernels_dir}/python3/")),
        "gateway.Dockerfile puts no kernelspec in {kernels_dir}"
    );
    Ok(())
}

#[test]
fn the_service_and_the_budget_select_the_gateways_pods() -> Result<()> {
    let manifests = manifests()?;
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let labels = pod_labels(&deployment);
    let container = gateway_container(&deployment)?;

    let service: Service = find(&manifests, "", "cellgate")?;
    let spec = service.spec.as_ref().context("Service spec")?;
    let selector = spec.selector.clone().unwrap_or_default();
    ensure!(
        selects(&selector, &labels),
        "the Service's selector {selector:?} misses the pods"
    );
    for port in spec.ports.iter().flatten() {
        let target = port
            .target_port
            .clone()
            .unwrap_or(IntOrString::Int(port.port));
        ensure!(
            container_port(container, &target)? == named_port(container, "http")?,
            "Service port {}: the API is on the http port",
            port.port
        );
    }

    let budget: PodDisruptionBudget = find(&manifests, "", "cellgate")?;
    let spec = budget.spec.as_ref().context("PodDisruptionBudget spec")?;
    let selector = spec
        .selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .unwrap_or_default();
    ensure!(
        selects(&selector, &labels),
        "the budget's selector {selector:?} misses the pods"
    );
    // Drains take one replica at a time; with two or more, one always serves.
    ensure!(
        spec.min_available == Some(IntOrString::Int(1)) && spec.max_unavailable.is_none(),
        "the budget keeps one replica: minAvailable: 1"
    );
    Ok(())
}

// --- what the gateway creates: its kernels' pods and NetworkPolicy ---------------------------

/// The example policy, through cellgate's own parser.
fn kit_policies() -> Result<cellgate::policy::Policies> {
    Ok(cellgate::policy::Policies::load(&kit().join("policies"))?)
}

/// The pod the gateway creates for a kernel of `policy` (the builder the kubernetes backend
/// uses), in the kit's namespace.
fn kernel_pod(policy: &cellgate::policy::Policy) -> Result<Pod> {
    use cellgate::sandbox::kubernetes::objects;
    let settings = policy
        .kubernetes
        .as_ref()
        .with_context(|| format!("policy {} has no [kubernetes] settings", policy.name))?;
    let limits = cellgate::sandbox::Limits {
        memory_bytes: Some(policy.limits.memory_bytes),
        cpu_millis: Some(policy.limits.cpu_millis),
        pids: Some(policy.limits.pids),
        workspace_bytes: Some(policy.limits.workspace_bytes),
    };
    let owner = objects::PodOwner {
        kernel_id: "0b3c4e4e-6c1b-4f7e-9b7c-2d1f1e0c9a11".to_owned(),
        policy: policy.name.clone(),
        tenant: Some("acme".to_owned()),
    };
    let name = objects::pod_name(&owner.kernel_id, "a1b2c");
    Ok(objects::pod(
        &name,
        "cellgate",
        &owner,
        settings,
        &settings.image,
        &limits,
    ))
}

/// What Pod Security Admission's "restricted" profile (with "baseline" under it) refuses in
/// a pod: the kit's namespace enforces it, so such a pod would never start there.
fn restricted_violations(spec: &PodSpec) -> Vec<String> {
    let mut violations = Vec::new();
    let pod_security = spec.security_context.clone().unwrap_or_default();
    if spec.host_network == Some(true) || spec.host_pid == Some(true) || spec.host_ipc == Some(true)
    {
        violations.push("host namespaces".to_owned());
    }
    for volume in spec.volumes.iter().flatten() {
        let allowed = volume.config_map.is_some()
            || volume.csi.is_some()
            || volume.downward_api.is_some()
            || volume.empty_dir.is_some()
            || volume.ephemeral.is_some()
            || volume.persistent_volume_claim.is_some()
            || volume.projected.is_some()
            || volume.secret.is_some();
        if !allowed {
            violations.push(format!("volume {}: a type restricted forbids", volume.name));
        }
    }
    let pod_seccomp = pod_security
        .seccomp_profile
        .as_ref()
        .map(|p| p.type_.clone());
    for container in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        let security = container.security_context.clone().unwrap_or_default();
        let name = &container.name;
        if security.privileged == Some(true) {
            violations.push(format!("{name}: privileged"));
        }
        if security.allow_privilege_escalation != Some(false) {
            violations.push(format!("{name}: allowPrivilegeEscalation is not false"));
        }
        if security.run_as_non_root.or(pod_security.run_as_non_root) != Some(true) {
            violations.push(format!("{name}: runAsNonRoot is not true"));
        }
        if security.run_as_user.or(pod_security.run_as_user) == Some(0) {
            violations.push(format!("{name}: runAsUser 0"));
        }
        let seccomp = security
            .seccomp_profile
            .as_ref()
            .map(|p| p.type_.clone())
            .or(pod_seccomp.clone());
        if !matches!(seccomp.as_deref(), Some("RuntimeDefault" | "Localhost")) {
            violations.push(format!("{name}: seccompProfile {seccomp:?}"));
        }
        let capabilities = security.capabilities.clone().unwrap_or_default();
        if !capabilities
            .drop
            .unwrap_or_default()
            .iter()
            .any(|c| c == "ALL")
        {
            violations.push(format!("{name}: capabilities do not drop ALL"));
        }
        if capabilities
            .add
            .unwrap_or_default()
            .iter()
            .any(|c| c != "NET_BIND_SERVICE")
        {
            violations.push(format!("{name}: capabilities added"));
        }
        if container
            .ports
            .iter()
            .flatten()
            .any(|p| p.host_port.is_some_and(|port| port != 0))
        {
            violations.push(format!("{name}: a host port"));
        }
    }
    violations
}

#[test]
fn the_namespace_enforces_the_restricted_profile_that_every_pod_passes() -> Result<()> {
    let manifests = manifests()?;
    let namespace: Namespace = find(&manifests, "", "cellgate")?;
    let labels = namespace.metadata.labels.unwrap_or_default();
    ensure!(
        labels
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str)
            == Some("restricted"),
        "the namespace must enforce the restricted profile: the gateway creates pods in it"
    );
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let violations = restricted_violations(pod_spec(&deployment)?);
    ensure!(violations.is_empty(), "the gateway's pod: {violations:?}");
    for policy in kit_policies()?.iter() {
        let pod = kernel_pod(policy)?;
        let violations = restricted_violations(pod.spec.as_ref().context("spec")?);
        ensure!(
            violations.is_empty(),
            "policy {}'s kernel pods: {violations:?}",
            policy.name
        );
    }
    Ok(())
}

#[test]
fn the_kernels_network_policy_admits_the_deployments_pods() -> Result<()> {
    use cellgate::sandbox::kubernetes::objects;
    let manifests = manifests()?;
    let deployment: Deployment = find(&manifests, "", "cellgate")?;
    let gateway_labels = pod_labels(&deployment);
    for policy in kit_policies()?.iter() {
        let network_policy = objects::network_policy("cellgate", &policy.name, "cellgate");
        let spec = network_policy.spec.as_ref().context("spec")?;
        // It selects the policy's kernel pods...
        let kernel_labels = kernel_pod(policy)?.metadata.labels.unwrap_or_default();
        let selected = spec
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .unwrap_or_default();
        ensure!(
            selects(&selected, &kernel_labels),
            "the NetworkPolicy selects {selected:?}, not the kernel pods {kernel_labels:?}"
        );
        // ...and admits the Deployment's pods, on the port the kernel's agent listens on.
        let peers: Vec<_> = spec
            .ingress
            .iter()
            .flatten()
            .flat_map(|rule| rule.from.iter().flatten())
            .collect();
        ensure!(!peers.is_empty(), "the NetworkPolicy admits nobody");
        for peer in peers {
            let admitted = peer
                .pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.clone())
                .unwrap_or_default();
            ensure!(
                selects(&admitted, &gateway_labels),
                "the kernels admit pods labelled {admitted:?}; the Deployment's pods are \
                 {gateway_labels:?}: the gateway could not reach its kernels"
            );
        }
        let ports: Vec<_> = spec
            .ingress
            .iter()
            .flatten()
            .flat_map(|rule| rule.ports.iter().flatten())
            .filter_map(|p| p.port.clone())
            .collect();
        ensure!(
            ports == [IntOrString::Int(i32::from(objects::AGENT_PORT))],
            "ingress ports {ports:?}"
        );
    }
    // The contract, as the code has it.
    for (key, value) in GATEWAY_LABELS {
        ensure!(gateway_labels.get(key).map(String::as_str) == Some(value));
    }
    ensure!(
        objects::GATEWAY_NAME == GATEWAY_LABELS[0].1
            && objects::GATEWAY_COMPONENT == GATEWAY_LABELS[1].1
    );
    Ok(())
}

#[test]
fn the_kernel_image_provides_what_kernel_pods_run() -> Result<()> {
    use cellgate::sandbox::relocate::{VENV, WORKSPACE};
    let policies = kit_policies()?;
    let dockerfile = Dockerfile::read("kernel.Dockerfile")?;
    for policy in policies.iter() {
        let pod = kernel_pod(policy)?;
        let spec = pod.spec.as_ref().context("spec")?;
        ensure!(spec.containers.len() == 1, "one container");
        let container = &spec.containers[0];
        // The agent is where the command says.
        let command = container.command.as_deref().unwrap_or_default();
        let agent = command.first().context("no command")?;
        ensure!(
            dockerfile
                .instructions
                .iter()
                .any(|line| line.starts_with("COPY ") && line.ends_with(agent.as_str())),
            "kernel.Dockerfile installs nothing at {agent}"
        );
        // The image's own entrypoint and arguments are the pod's command (for `docker run`
        // and readers of the Dockerfile).
        let mut own = dockerfile.exec_form("ENTRYPOINT")?;
        own.extend(dockerfile.exec_form("CMD")?);
        ensure!(
            own == command,
            "kernel.Dockerfile runs {own:?}, the gateway's pods {command:?}"
        );
        // The image's user is the pod's (the files it owns, runAsNonRoot's check).
        let security = spec.security_context.as_ref().context("securityContext")?;
        let user = format!(
            "{}:{}",
            security.run_as_user.context("runAsUser")?,
            security.run_as_group.context("runAsGroup")?
        );
        ensure!(
            dockerfile.final_user() == Some(user.as_str()),
            "kernel.Dockerfile's USER {:?}, the pod's {user}",
            dockerfile.final_user()
        );
        // The pod's image is the policy's, and the image's is the gateway's view of a kernel:
        // its venv at VENV, its home the workspace the pod mounts.
        let settings = policy.kubernetes.as_ref().context("[kubernetes]")?;
        ensure!(container.image.as_deref() == Some(settings.image.as_str()));
        ensure!(
            dockerfile.text.contains(&format!("-m venv {VENV}")),
            "kernel.Dockerfile makes no venv at {VENV}"
        );
        let mounts: Vec<&str> = container
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        ensure!(
            mounts.contains(&WORKSPACE),
            "no workspace at {WORKSPACE}: {mounts:?}"
        );
        ensure!(
            dockerfile.text.contains(&format!("HOME={WORKSPACE}")),
            "the kernel's HOME is its workspace"
        );
        // The runtime class the policy names is one of the kit's.
        if let Some(class) = &settings.runtime_class {
            let _: RuntimeClass = find(&manifests()?, "runtimeclasses", class)?;
        }
    }
    Ok(())
}

// --- the policy example ----------------------------------------------------------------------

#[test]
fn the_policy_example_is_the_local_default_on_kubernetes() -> Result<()> {
    let policies = kit_policies()?;
    let policy = policies.default_policy();
    ensure!(
        policy.backend.as_str() == "kubernetes",
        "the example's backend is {}",
        policy.backend.as_str()
    );
    let settings = policy.kubernetes.as_ref().context("[kubernetes]")?;
    let tag = settings.image.rsplit_once(':').map(|(_, tag)| tag);
    ensure!(
        tag.is_some_and(|tag| tag != "latest" && !tag.contains('/')),
        "the kernel image {:?}: pin a tag",
        settings.image
    );
    ensure!(
        settings.runtime_class.is_some(),
        "the example runs kernels under a sandboxing RuntimeClass"
    );
    let runtime_classes: Vec<RuntimeClass> = all(&manifests()?, "runtimeclasses")?;
    let names: BTreeSet<String> = runtime_classes
        .iter()
        .filter_map(|class| class.metadata.name.clone())
        .collect();
    ensure!(
        names == BTreeSet::from(["gvisor".to_owned(), "kata".to_owned()]),
        "runtimeclasses/: {names:?}"
    );

    // Every rule but the sandbox is the local default's: the cluster changes where kernels
    // run, not what they may do.
    let local = cellgate::policy::Policies::load(&support::repo().join("policies"))?;
    let local = local.default_policy();
    ensure!(
        policy.limits == local.limits,
        "[limits] differ from policies/default.toml's"
    );
    ensure!(
        policy.egress == local.egress,
        "[egress] differs from policies/default.toml's"
    );
    ensure!(
        policy.packages == local.packages,
        "[packages] differ from policies/default.toml's"
    );
    Ok(())
}

// --- the images --------------------------------------------------------------------------------

/// A Dockerfile's instructions (continuation lines joined, comments dropped).
struct Dockerfile {
    name: String,
    text: String,
    instructions: Vec<String>,
}

impl Dockerfile {
    fn read(name: &str) -> Result<Dockerfile> {
        let text = read(&kit().join("images").join(name))?;
        let mut instructions = Vec::new();
        let mut pending = String::new();
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with('#') || (pending.is_empty() && line.is_empty()) {
                continue;
            }
            match line.strip_suffix('\\') {
                Some(rest) => {
                    pending.push_str(rest.trim_end());
                    pending.push(' ');
                }
                None => instructions.push(std::mem::take(&mut pending) + line),
            }
        }
        Ok(Dockerfile {
            name: name.to_owned(),
            text,
            instructions,
        })
    }

    /// The `ARG NAME=default` values.
    fn args(&self) -> BTreeMap<&str, &str> {
        self.instructions
            .iter()
            .filter_map(|line| line.strip_prefix("ARG "))
            .filter_map(|arg| arg.split_once('='))
            .collect()
    }

    /// The images of the `FROM` lines, with the ARG defaults substituted.
    fn bases(&self) -> Vec<String> {
        let args = self.args();
        self.instructions
            .iter()
            .filter_map(|line| line.strip_prefix("FROM "))
            .map(|from| {
                let image = from.split_whitespace().next().unwrap_or_default();
                args.iter().fold(image.to_owned(), |image, (name, value)| {
                    image.replace(&format!("${{{name}}}"), value)
                })
            })
            .collect()
    }

    /// The final stage's last `ENTRYPOINT` or `CMD` (exec form: a JSON array).
    fn exec_form(&self, instruction: &str) -> Result<Vec<String>> {
        let prefix = format!("{instruction} ");
        let last_from = self
            .instructions
            .iter()
            .rposition(|line| line.starts_with("FROM "))
            .context("no FROM")?;
        let line = self.instructions[last_from..]
            .iter()
            .filter_map(|line| line.strip_prefix(&prefix))
            .next_back()
            .with_context(|| format!("{}: no {instruction}", self.name))?;
        serde_json::from_str(line)
            .with_context(|| format!("{}: {instruction} {line} is not exec form", self.name))
    }

    /// The last `USER` of the final stage.
    fn final_user(&self) -> Option<&str> {
        let last_from = self
            .instructions
            .iter()
            .rposition(|line| line.starts_with("FROM "))?;
        self.instructions[last_from..]
            .iter()
            .filter_map(|line| line.strip_prefix("USER "))
            .next_back()
            .map(str::trim)
    }
}

#[test]
fn the_images_are_multi_stage_pinned_non_root_and_say_they_are_untested() -> Result<()> {
    let toolchain: toml::Table =
        toml::from_str(&read(&support::repo().join("rust-toolchain.toml"))?)?;
    let channel = toolchain["toolchain"]["channel"]
        .as_str()
        .context("rust-toolchain.toml: channel")?;
    for name in ["gateway.Dockerfile", "kernel.Dockerfile"] {
        let dockerfile = Dockerfile::read(name)?;
        let name = &dockerfile.name;
        let bases = dockerfile.bases();
        ensure!(
            bases.len() >= 2,
            "{name}: multi-stage (a build stage, then the image)"
        );
        for base in &bases {
            let (image, tag) = base
                .rsplit_once(':')
                .with_context(|| format!("{name}: FROM {base} has no tag"))?;
            ensure!(
                !image.is_empty() && tag != "latest",
                "{name}: FROM {base}: pin a tag"
            );
            ensure!(
                tag.contains("bookworm") || tag.contains(channel),
                "{name}: FROM {base}: Debian bookworm"
            );
        }
        // The build's Rust is the toolchain rust-toolchain.toml pins (else rustup would
        // download another one during the build).
        ensure!(
            dockerfile.args().get("RUST_VERSION") == Some(&channel),
            "{name}: ARG RUST_VERSION is not {channel}"
        );
        let user = dockerfile
            .final_user()
            .context("no USER in the final stage")?;
        ensure!(
            !matches!(user.split(':').next(), Some("0" | "root")),
            "{name}: the image runs as root"
        );
        ensure!(
            dockerfile.text.contains("UNTESTED"),
            "{name} must say it was never built here"
        );
        let ignore = kit().join("images").join(format!("{name}.dockerignore"));
        ensure!(
            read(&ignore)?.lines().any(|line| line.trim() == "target"),
            "{}: the build context leaves target/ out",
            shown(&ignore)
        );
    }
    Ok(())
}
