//! The Helm chart in `deploy/helm/cellgate/`, rendered and linted by Helm itself (Helm's Go
//! SDK, through `tests/python/helm_chart.py`; no helm binary can be fetched here), checked
//! against the kustomize base in `deploy/kubernetes/` that `kubernetes_manifests` checks
//! field by field:
//!
//! - with its default values (and `namespace.create`, off by default as `helm install` needs
//!   the namespace first) the chart renders exactly the objects `kustomize build` makes
//!   of the base (modelled here on the kustomization's own fields: its namespace, labels,
//!   image and ConfigMap generators; a field the model does not know fails the test), but for
//!   what differs by design: Helm's own labels (`helm.sh/chart`, `app.kubernetes.io/instance`,
//!   `…/version`, `…/managed-by`), and how a changed config rolls the pods (kustomize appends a
//!   hash of the content to the ConfigMaps' names; the chart keeps the names and puts a
//!   checksum in the pod template's annotations);
//! - the chart's copies of the gateway's config and policy are the base's files;
//! - `helm lint --strict` passes, the chart's version is cellgate's;
//! - values change what they say: replicas, image, namespace, config, policies.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::kubernetes_manifests::{
    generator_files, kit, kustomization, read, strings, yaml_documents,
};
use crate::support;

/// The labels Helm's conventions add to every object, which the kustomize base has not.
const HELM_LABELS: [&str; 4] = [
    "helm.sh/chart",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
];
/// The pod template's annotation that rolls the pods when the config or a policy changes.
const CHECKSUM: &str = "checksum/config";

fn chart() -> std::path::PathBuf {
    support::repo().join("deploy/helm/cellgate")
}

/// Objects by (kind, name).
type Objects = BTreeMap<(String, String), Value>;

fn key(object: &Value) -> (String, String) {
    (
        object["kind"].as_str().unwrap_or_default().to_owned(),
        object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

/// What Helm made of the chart: its objects, and its lint report.
struct Rendered {
    objects: Objects,
    lint: Value,
}

/// Renders the chart as release `name` in `namespace` with `values`.
fn render(name: &str, namespace: &str, values: Value) -> Result<Rendered> {
    let mut child = Command::new(support::tools_python())
        .arg(support::repo().join("tests/python/helm_chart.py"))
        .arg(chart())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let request = json!({"name": name, "namespace": namespace, "values": values});
    std::io::Write::write_all(
        child.stdin.as_mut().context("stdin")?,
        request.to_string().as_bytes(),
    )?;
    drop(child.stdin.take());
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "tests/python/helm_chart.py failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: Value = serde_json::from_slice(&out.stdout)?;
    let mut objects = Objects::new();
    for (template, text) in answer["manifests"]
        .as_object()
        .context("no manifests in the answer")?
    {
        if template.ends_with(".txt") {
            continue;
        }
        let text = text.as_str().context("a manifest that is not text")?;
        for object in yaml_documents(text).with_context(|| format!("{template}: not YAML"))? {
            if object.is_null() {
                continue;
            }
            let key = key(&object);
            ensure!(
                objects.insert(key.clone(), object).is_none(),
                "{template}: a second {key:?}"
            );
        }
    }
    Ok(Rendered {
        objects,
        lint: answer["lint"].clone(),
    })
}

/// Takes Helm's own labels off every object (after checking they are there) and the checksum
/// annotation off the Deployment's pod template, which it returns.
fn without_helm_parts(objects: &mut Objects) -> Result<String> {
    let mut checksum = None;
    for ((kind, name), object) in objects.iter_mut() {
        let labels = object["metadata"]["labels"]
            .as_object_mut()
            .with_context(|| format!("{kind} {name} has no labels"))?;
        for label in HELM_LABELS {
            ensure!(
                labels.remove(label).is_some(),
                "{kind} {name} lacks Helm's label {label}"
            );
        }
        if kind == "Deployment" {
            let annotations = object["spec"]["template"]["metadata"]["annotations"]
                .as_object_mut()
                .context("the pod template has no annotations")?;
            let sum = annotations
                .remove(CHECKSUM)
                .and_then(|v| v.as_str().map(str::to_owned))
                .context("no checksum annotation on the pod template")?;
            ensure!(
                sum.len() == 64 && sum.bytes().all(|b| b.is_ascii_hexdigit()),
                "the checksum annotation is not a SHA-256: {sum:?}"
            );
            checksum = Some(sum);
        }
    }
    checksum.context("no Deployment")
}

/// `kustomize build deploy/kubernetes`, for the fields the kustomization uses, without the
/// ConfigMaps' hash suffix (see the module's doc).
fn kustomize_build() -> Result<Objects> {
    let kustomization = kustomization()?;
    let known = [
        "apiVersion",
        "kind",
        "namespace",
        "resources",
        "configMapGenerator",
        "images",
        "labels",
    ];
    for field in kustomization
        .as_object()
        .context("the kustomization is not a map")?
        .keys()
    {
        ensure!(
            known.contains(&field.as_str()),
            "kustomization.yaml uses {field:?}, which this test's model of kustomize does not know: teach it"
        );
    }
    let namespace = kustomization["namespace"]
        .as_str()
        .context("no namespace")?;
    let mut objects = Vec::new();
    for file in strings(&kustomization["resources"]) {
        objects.extend(
            yaml_documents(&read(&kit().join(file))?)?
                .into_iter()
                .filter(|o| !o.is_null()),
        );
    }
    for generator in kustomization["configMapGenerator"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for field in generator
            .as_object()
            .context("a generator that is not a map")?
            .keys()
        {
            ensure!(
                field == "name" || field == "files",
                "a configMapGenerator with {field:?}, which this test's model does not know: teach it"
            );
        }
        let mut data = serde_json::Map::new();
        for entry in strings(&generator["files"]) {
            // `key=file`, or the file's base name as its key.
            let (key, file) = entry
                .split_once('=')
                .unwrap_or((entry.rsplit('/').next().unwrap_or(entry), entry));
            data.insert(key.to_owned(), Value::String(read(&kit().join(file))?));
        }
        objects.push(json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generator["name"]},
            "data": data,
        }));
    }
    for object in &mut objects {
        if object["kind"] == "Namespace" {
            object["metadata"]["name"] = json!(namespace);
        } else {
            object["metadata"]["namespace"] = json!(namespace);
        }
        // The namespace transformer's default: only subjects named `default` move (others
        // follow their ServiceAccount by name reference, already in this namespace here).
        // `get_mut`, not indexing: an index inserts a null where the key is missing.
        let subjects = object.get_mut("subjects").and_then(Value::as_array_mut);
        for subject in subjects.into_iter().flatten() {
            if subject["name"] == "default" {
                subject["namespace"] = json!(namespace);
            }
        }
    }
    for entry in kustomization["labels"].as_array().into_iter().flatten() {
        for field in entry
            .as_object()
            .context("a labels entry that is not a map")?
            .keys()
        {
            ensure!(
                field == "pairs",
                "labels with {field:?}, which this test's model does not know: teach it"
            );
        }
        let pairs = entry["pairs"].as_object().context("labels without pairs")?;
        for object in &mut objects {
            let metadata = object["metadata"]
                .as_object_mut()
                .context("an object without metadata")?;
            let labels = metadata.entry("labels").or_insert_with(|| json!({}));
            for (k, v) in pairs {
                labels[k] = v.clone();
            }
        }
    }
    for image in kustomization["images"].as_array().into_iter().flatten() {
        let name = image["name"].as_str().context("an image without name")?;
        let new = format!(
            "{}:{}",
            image["newName"].as_str().context("newName")?,
            image["newTag"].as_str().context("newTag")?
        );
        let mut replaced = 0;
        for object in &mut objects {
            for list in ["containers", "initContainers"] {
                let containers = object
                    .pointer_mut(&format!("/spec/template/spec/{list}"))
                    .and_then(Value::as_array_mut);
                for container in containers.into_iter().flatten() {
                    if container["image"] == name {
                        container["image"] = json!(new);
                        replaced += 1;
                    }
                }
            }
        }
        ensure!(replaced > 0, "image {name} is used by no container");
    }
    let mut built = Objects::new();
    for object in objects {
        let key = key(&object);
        ensure!(
            built.insert(key.clone(), object).is_none(),
            "a second {key:?}"
        );
    }
    Ok(built)
}

/// Fails with both sides of every object that differs.
fn same_objects(got: &Objects, want: &Objects) -> Result<()> {
    let mut problems = Vec::new();
    for (key, object) in want {
        match got.get(key) {
            None => problems.push(format!("the chart has no {key:?}")),
            Some(mine) if mine != object => problems.push(format!(
                "{key:?} differs:\n--- chart ---\n{}\n--- kustomize base ---\n{}",
                serde_json::to_string_pretty(mine)?,
                serde_json::to_string_pretty(object)?
            )),
            Some(_) => {}
        }
    }
    for key in got.keys().filter(|k| !want.contains_key(*k)) {
        problems.push(format!("the chart has {key:?}, the kustomize base has not"));
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("\n\n"));
    }
    Ok(())
}

#[test]
fn with_its_defaults_the_chart_renders_the_kustomize_base() -> Result<()> {
    let base = kustomize_build()?;
    ensure!(
        base.len() >= 9,
        "the kustomize base has {} objects",
        base.len()
    );
    let mut rendered = render(
        "cellgate",
        "cellgate",
        json!({"namespace": {"create": true}}),
    )?;
    without_helm_parts(&mut rendered.objects)?;
    same_objects(&rendered.objects, &base)?;
    // The defaults themselves: the same but the Namespace.
    let mut defaults = render("cellgate", "cellgate", json!({}))?;
    without_helm_parts(&mut defaults.objects)?;
    let mut without_namespace = base;
    without_namespace.retain(|(kind, _), _| kind != "Namespace");
    same_objects(&defaults.objects, &without_namespace)
}

#[test]
fn the_chart_lints_clean_and_is_cellgates_version_with_the_bases_files() -> Result<()> {
    let rendered = render("cellgate", "cellgate", json!({}))?;
    let lint = &rendered.lint;
    ensure!(
        lint["total_charts_linted"] == 1,
        "helm lint linted no chart: {lint}"
    );
    ensure!(
        lint["errors"].as_array().is_some_and(Vec::is_empty),
        "helm lint: {lint}"
    );
    // Severity 2 is a warning, 3 an error (`--strict` fails on both); 1 is information.
    let serious: Vec<&Value> = lint["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["severity"].as_i64().unwrap_or(3) >= 2)
        .collect();
    ensure!(serious.is_empty(), "helm lint --strict: {serious:?}");

    let meta = yaml_documents(&read(&chart().join("Chart.yaml"))?)?.remove(0);
    let cargo = read(&support::repo().join("Cargo.toml"))?;
    let version = cargo
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|l| l.strip_suffix('"'))
        .context("no version in Cargo.toml")?;
    ensure!(
        meta["version"] == version,
        "Chart.yaml version: {}",
        meta["version"]
    );
    ensure!(
        meta["appVersion"] == version,
        "Chart.yaml appVersion: {}",
        meta["appVersion"]
    );

    let kustomization = kustomization()?;
    for generator in kustomization["configMapGenerator"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for file in generator_files(generator) {
            let copy = chart().join("files").join(&file);
            ensure!(
                read(&copy)? == read(&kit().join(&file))?,
                "{} is not deploy/kubernetes/{file}: edit both",
                copy.display()
            );
        }
    }
    let copies = std::fs::read_dir(chart().join("files/policies"))?.count();
    let base = std::fs::read_dir(kit().join("policies"))?.count();
    ensure!(
        copies == base,
        "{copies} policies in the chart, {base} in the base"
    );
    Ok(())
}

#[test]
fn the_charts_values_change_what_they_say() -> Result<()> {
    let defaults = {
        let mut objects = render("cellgate", "cellgate", json!({}))?.objects;
        without_helm_parts(&mut objects)?
    };
    let policy = "description = \"only this\"\n";
    let rendered = render(
        "sandbox",
        "other",
        json!({
            "replicas": 3,
            "namespace": {"create": true},
            "image": {"repository": "registry.test/gw", "tag": "9.9.9"},
            "config": "port = 8888\n",
            "policies": {"only.toml": policy},
            "resources": {"requests": {"cpu": "1"}},
            "storage": {"runtime": "20Gi"},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        }),
    )?;
    let mut objects = rendered.objects;
    for ((kind, name), object) in &objects {
        ensure!(
            object["metadata"]["labels"]["app.kubernetes.io/instance"] == "sandbox",
            "{kind} {name}: not labelled with its release"
        );
    }
    let checksum = without_helm_parts(&mut objects)?;
    ensure!(checksum != defaults, "another config, the same checksum");
    let namespace = objects
        .get(&("Namespace".to_owned(), "other".to_owned()))
        .context("namespace.create renders no Namespace named after the release's")?;
    ensure!(
        namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted",
        "the Namespace lacks its Pod Security label"
    );
    for ((kind, name), object) in objects.iter().filter(|((kind, _), _)| kind != "Namespace") {
        ensure!(
            object["metadata"]["namespace"] == "other",
            "{kind} {name} is not in the release's namespace"
        );
    }
    let get = |kind: &str, name: &str| -> Result<&Value> {
        objects
            .get(&(kind.to_owned(), name.to_owned()))
            .ok_or_else(|| anyhow!("no {kind} {name}"))
    };
    let deployment = get("Deployment", "cellgate")?;
    ensure!(deployment["spec"]["replicas"] == 3, "replicas");
    let pod = &deployment["spec"]["template"]["spec"];
    ensure!(
        pod["containers"][0]["image"] == "registry.test/gw:9.9.9",
        "image: {}",
        pod["containers"][0]["image"]
    );
    ensure!(
        pod["containers"][0]["resources"]["requests"]["cpu"] == "1",
        "resources"
    );
    ensure!(pod["tolerations"][0]["key"] == "dedicated", "tolerations");
    ensure!(
        pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|v| v["name"] == "runtime" && v["emptyDir"]["sizeLimit"] == "20Gi"),
        "storage.runtime"
    );
    ensure!(
        get("RoleBinding", "cellgate-gateway")?["subjects"][0]["namespace"] == "other",
        "the RoleBinding's subject is not the release namespace's ServiceAccount"
    );
    ensure!(
        get("ConfigMap", "cellgate-policies")?["data"] == json!({"only.toml": policy}),
        "policies: {}",
        get("ConfigMap", "cellgate-policies")?["data"]
    );
    ensure!(
        get("ConfigMap", "cellgate-config")?["data"] == json!({"cellgate.toml": "port = 8888\n"}),
        "config"
    );

    // A log filter YAML would read as a boolean stays a string (the API server wants one).
    let off = render("cellgate", "cellgate", json!({"log": {"filter": "off"}}))?;
    let env = &off.objects[&("Deployment".to_owned(), "cellgate".to_owned())]["spec"]["template"]
        ["spec"]["containers"][0]["env"];
    ensure!(
        env.as_array()
            .into_iter()
            .flatten()
            .any(|e| e["name"] == "RUST_LOG" && e["value"] == "off"),
        "RUST_LOG off is not the string \"off\": {env}"
    );
    // The Namespace is never rendered as `default` with the restricted profile.
    let refused = render(
        "cellgate",
        "default",
        json!({"namespace": {"create": true}}),
    );
    ensure!(
        refused
            .as_ref()
            .err()
            .is_some_and(|e| e.to_string().contains("restricted Pod Security profile")),
        "namespace.create in namespace default was not refused: {:?}",
        refused.err()
    );
    Ok(())
}
