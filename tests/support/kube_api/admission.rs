//! What the API server does to a pod between decoding and storing it, as the real one does:
//! defaulting (the values `kubectl get -o yaml` shows that nobody wrote), the
//! ServiceAccount plugin's token volume (a pod that does not opt out with
//! `automountServiceAccountToken: false` gets an API token mounted, a fact a sandbox must
//! not miss), the DefaultTolerationSeconds plugin, the RuntimeClass check and the initial
//! status, and Pod Security admission (the namespace's `baseline` or `restricted` level).
//! Then the double's own limits: a pod the double's kubelet cannot run faithfully
//! is refused loudly at create time instead of being run wrongly.

use rand::Rng;
use serde_json::{json, Map, Value};

use super::resource::Resource;
use super::status::ApiError;

/// The projected volume's mount path, as the ServiceAccount plugin mounts it.
pub const SERVICE_ACCOUNT_MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

fn default(object: &mut Value, key: &str, value: Value) {
    if let Some(map) = object.as_object_mut() {
        map.entry(key.to_owned()).or_insert(value);
    }
}

/// Five characters of the alphabet the API uses for generated names.
pub fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    (0..5)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// Defaults and admission for a pod being created.
pub fn admit_new_pod(pod: &mut Value, runtime_classes: &[String]) -> Result<(), ApiError> {
    let name = pod["metadata"]["name"].as_str().unwrap_or("").to_owned();
    if let Some(class) = pod["spec"]["runtimeClassName"].as_str() {
        if !runtime_classes.iter().any(|c| c == class) {
            return Err(ApiError::admission_forbidden(
                Resource::Pods,
                &name,
                &format!("pod rejected: RuntimeClass \"{class}\" not found"),
            ));
        }
    }
    if !pod["spec"].is_object() {
        pod["spec"] = json!({});
    }
    default_pod_spec(&mut pod["spec"]);
    let spec = &mut pod["spec"];
    if spec["automountServiceAccountToken"] != Value::Bool(false) {
        mount_service_account_token(spec);
    }
    let qos = qos_class(&pod["spec"]);
    pod["status"] = json!({"phase": "Pending", "qosClass": qos});
    Ok(())
}

/// The defaults the API fills into a pod's spec on every write (so an update that leaves
/// them out changes nothing).
pub fn default_pod_spec(spec: &mut Value) {
    default(spec, "restartPolicy", json!("Always"));
    default(spec, "terminationGracePeriodSeconds", json!(30));
    default(spec, "dnsPolicy", json!("ClusterFirst"));
    default(spec, "schedulerName", json!("default-scheduler"));
    default(spec, "securityContext", json!({}));
    default(spec, "serviceAccountName", json!("default"));
    let account = spec["serviceAccountName"].clone();
    spec["serviceAccount"] = account;
    default(spec, "enableServiceLinks", json!(true));
    default(spec, "priority", json!(0));
    default(spec, "preemptionPolicy", json!("PreemptLowerPriority"));
    default_tolerations(spec);
    for container in spec["containers"].as_array_mut().into_iter().flatten() {
        default_container(container);
    }
    for volume in spec["volumes"].as_array_mut().into_iter().flatten() {
        if volume["secret"].is_object() {
            default(&mut volume["secret"], "defaultMode", json!(0o644));
        }
    }
}

fn default_container(container: &mut Value) {
    let image = container["image"].as_str().unwrap_or("").to_owned();
    let untagged_or_latest = {
        let last = image.rsplit('/').next().unwrap_or("");
        !last.contains(':') || last.ends_with(":latest")
    };
    let pull = if untagged_or_latest && !image.contains('@') {
        "Always"
    } else {
        "IfNotPresent"
    };
    default(container, "imagePullPolicy", json!(pull));
    default(
        container,
        "terminationMessagePath",
        json!("/dev/termination-log"),
    );
    default(container, "terminationMessagePolicy", json!("File"));
    default(container, "resources", json!({}));
    for port in container["ports"].as_array_mut().into_iter().flatten() {
        default(port, "protocol", json!("TCP"));
    }
    for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
        if container[probe].is_object() {
            let probe = &mut container[probe];
            default(probe, "timeoutSeconds", json!(1));
            default(probe, "periodSeconds", json!(10));
            default(probe, "successThreshold", json!(1));
            default(probe, "failureThreshold", json!(3));
        }
    }
}

fn default_tolerations(spec: &mut Value) {
    if !spec["tolerations"].is_array() {
        spec["tolerations"] = json!([]);
    }
    let Some(tolerations) = spec["tolerations"].as_array_mut() else {
        return;
    };
    for key in [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ] {
        if !tolerations.iter().any(|t| t["key"] == key) {
            tolerations.push(json!({
                "key": key,
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            }));
        }
    }
}

/// The ServiceAccount admission plugin's projected token volume and its mount in every
/// container that does not already mount something at that path.
fn mount_service_account_token(spec: &mut Value) {
    let volume_name = format!("kube-api-access-{}", random_suffix());
    let volume = json!({
        "name": volume_name,
        "projected": {
            "defaultMode": 0o644,
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
            ],
        },
    });
    if !spec["volumes"].is_array() {
        spec["volumes"] = json!([]);
    }
    if let Some(volumes) = spec["volumes"].as_array_mut() {
        volumes.push(volume);
    }
    for container in spec["containers"].as_array_mut().into_iter().flatten() {
        let mounts_it = container["volumeMounts"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["mountPath"] == SERVICE_ACCOUNT_MOUNT));
        if mounts_it {
            continue;
        }
        if !container["volumeMounts"].is_array() {
            container["volumeMounts"] = json!([]);
        }
        if let Some(mounts) = container["volumeMounts"].as_array_mut() {
            mounts.push(json!({
                "name": volume_name,
                "readOnly": true,
                "mountPath": SERVICE_ACCOUNT_MOUNT,
            }));
        }
    }
}

fn qos_class(spec: &Value) -> &'static str {
    let containers = spec["containers"].as_array().cloned().unwrap_or_default();
    let resources = |c: &Value, kind: &str| -> Map<String, Value> {
        c["resources"][kind]
            .as_object()
            .cloned()
            .unwrap_or_default()
    };
    let none = containers
        .iter()
        .all(|c| resources(c, "requests").is_empty() && resources(c, "limits").is_empty());
    if none {
        return "BestEffort";
    }
    let guaranteed = containers.iter().all(|c| {
        let limits = resources(c, "limits");
        let requests = resources(c, "requests");
        ["cpu", "memory"].iter().all(|r| limits.contains_key(*r))
            && requests.iter().all(|(k, v)| limits.get(k) == Some(v))
    });
    if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

/// The downward-API fields the double's kubelet can put in an env var.
pub const SUPPORTED_FIELD_REFS: [&str; 7] = [
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.podIP",
    "status.hostIP",
];

/// The double's kubelet runs one container per pod, once (restartPolicy Never), with
/// emptyDir, secret and the service account's token volume, a TCP readiness probe, and env
/// from values, downward-API fields and secret keys. Anything else is refused here, loudly.
pub fn refuse_unsupported_pod(pod: &Value) -> Result<(), ApiError> {
    let spec = &pod["spec"];
    let mut problems = vec![];
    let containers = spec["containers"].as_array().cloned().unwrap_or_default();
    if containers.len() > 1 {
        problems.push("pods with more than one container".to_owned());
    }
    for field in ["initContainers", "ephemeralContainers"] {
        if spec[field].as_array().is_some_and(|a| !a.is_empty()) {
            problems.push(format!("spec.{field}"));
        }
    }
    let restart = spec["restartPolicy"].as_str().unwrap_or("Always");
    if restart != "Never" {
        problems.push(format!(
            "restartPolicy {restart} (its kubelet runs a container once: set restartPolicy: Never)"
        ));
    }
    for field in ["hostNetwork", "hostPID", "hostIPC", "hostUsers"] {
        if spec[field] == Value::Bool(true) {
            problems.push(format!("spec.{field}: true"));
        }
    }
    for volume in spec["volumes"].as_array().into_iter().flatten() {
        let name = volume["name"].as_str().unwrap_or("");
        let supported = volume["emptyDir"].is_object()
            || volume["secret"].is_object()
            || (volume["projected"].is_object() && name.starts_with("kube-api-access-"));
        if !supported {
            problems.push(format!(
                "volume {name:?}: only emptyDir and secret volumes are supported"
            ));
        }
    }
    for container in &containers {
        let name = container["name"].as_str().unwrap_or("");
        for field in ["lifecycle", "livenessProbe", "startupProbe", "envFrom"] {
            if !container[field].is_null() {
                problems.push(format!("container {name:?}: {field}"));
            }
        }
        if container["tty"] == Value::Bool(true) || container["stdin"] == Value::Bool(true) {
            problems.push(format!("container {name:?}: tty or stdin"));
        }
        let probe = &container["readinessProbe"];
        if probe.is_object() && !probe["tcpSocket"]["port"].is_i64() {
            problems.push(format!(
                "container {name:?}: a readinessProbe other than tcpSocket with a numeric port"
            ));
        }
        if container["securityContext"]["privileged"] == Value::Bool(true) {
            problems.push(format!("container {name:?}: privileged"));
        }
        for port in container["ports"].as_array().into_iter().flatten() {
            if !port["hostPort"].is_null() {
                problems.push(format!("container {name:?}: hostPort"));
            }
        }
        for mount in container["volumeMounts"].as_array().into_iter().flatten() {
            for field in ["subPath", "subPathExpr", "mountPropagation"] {
                if !mount[field].is_null() {
                    problems.push(format!("container {name:?}: volumeMounts[].{field}"));
                }
            }
        }
        for env in container["env"].as_array().into_iter().flatten() {
            let from = &env["valueFrom"];
            if from.is_null() {
                continue;
            }
            let field_ok = from["fieldRef"]["fieldPath"]
                .as_str()
                .is_some_and(|f| SUPPORTED_FIELD_REFS.contains(&f));
            let secret_ok = from["secretKeyRef"].is_object();
            if !field_ok && !secret_ok {
                problems.push(format!(
                    "container {name:?}: env {:?} valueFrom {from} (supported: fieldRef to {SUPPORTED_FIELD_REFS:?}, secretKeyRef)",
                    env["name"]
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        let name = pod["metadata"]["name"].as_str().unwrap_or("");
        Err(ApiError::unsupported_by_double(format!(
            "pod {name:?}: {}",
            problems.join("; ")
        )))
    }
}

/// A pod update the double's kubelet would not act on (the real one restarts the
/// container with the new image) is refused rather than silently kept.
pub fn refuse_unsupported_pod_update(old: &Value, new: &Value) -> Result<(), ApiError> {
    let images = |pod: &Value| -> Vec<Value> {
        pod["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| c["image"].clone())
            .collect()
    };
    if images(old) != images(new) {
        return Err(ApiError::unsupported_by_double(
            "changing a pod's container image",
        ));
    }
    Ok(())
}

/// Pod Security admission: the checks of the `baseline` and `restricted` levels that a
/// pod the double can run can fail, with the real message (403 Forbidden).
pub fn enforce_pod_security(pod: &Value, level: &str) -> Result<(), ApiError> {
    let spec = &pod["spec"];
    let containers: Vec<Value> = spec["containers"].as_array().cloned().unwrap_or_default();
    let named = |filter: &dyn Fn(&Value) -> bool| -> Vec<String> {
        containers
            .iter()
            .filter(|c| filter(c))
            .map(|c| format!("{:?}", c["name"].as_str().unwrap_or("")))
            .collect()
    };
    let who = |names: &[String]| {
        if names.len() == 1 {
            format!("container {}", names[0])
        } else {
            format!("containers {}", names.join(", "))
        }
    };
    let mut violations = vec![];
    let host: Vec<String> = ["hostNetwork", "hostPID", "hostIPC"]
        .iter()
        .filter(|f| spec[**f] == Value::Bool(true))
        .map(|f| format!("{f}=true"))
        .collect();
    if !host.is_empty() {
        violations.push(format!("host namespaces ({})", host.join(", ")));
    }
    let privileged = named(&|c| c["securityContext"]["privileged"] == Value::Bool(true));
    if !privileged.is_empty() {
        violations.push(format!(
            "privileged ({} must not set securityContext.privileged=true)",
            who(&privileged)
        ));
    }
    if level == "restricted" {
        let escalating =
            named(&|c| c["securityContext"]["allowPrivilegeEscalation"] != Value::Bool(false));
        if !escalating.is_empty() {
            violations.push(format!(
                "allowPrivilegeEscalation != false ({} must set securityContext.allowPrivilegeEscalation=false)",
                who(&escalating)
            ));
        }
        let keeping = named(&|c| {
            !c["securityContext"]["capabilities"]["drop"]
                .as_array()
                .is_some_and(|d| d.iter().any(|x| x == "ALL"))
        });
        if !keeping.is_empty() {
            violations.push(format!(
                "unrestricted capabilities ({} must set securityContext.capabilities.drop=[\"ALL\"])",
                who(&keeping)
            ));
        }
        let pod_non_root = spec["securityContext"]["runAsNonRoot"] == Value::Bool(true);
        let maybe_root = named(&|c| {
            let own = &c["securityContext"]["runAsNonRoot"];
            own == &Value::Bool(false) || (own.is_null() && !pod_non_root)
        });
        if !maybe_root.is_empty() {
            violations.push(format!(
                "runAsNonRoot != true (pod or {} must set securityContext.runAsNonRoot=true)",
                who(&maybe_root)
            ));
        }
        let pod_root = spec["securityContext"]["runAsUser"] == 0;
        let root = named(&|c| c["securityContext"]["runAsUser"] == 0);
        if pod_root || !root.is_empty() {
            let who = if pod_root {
                "pod".to_owned()
            } else {
                who(&root)
            };
            violations.push(format!("runAsUser=0 ({who} must not set runAsUser=0)"));
        }
        let confined = |profile: &Value| {
            matches!(
                profile["type"].as_str(),
                Some("RuntimeDefault" | "Localhost")
            )
        };
        let pod_confined = confined(&spec["securityContext"]["seccompProfile"]);
        let unconfined = named(&|c| {
            let own = &c["securityContext"]["seccompProfile"];
            if own.is_null() {
                !pod_confined
            } else {
                !confined(own)
            }
        });
        if !unconfined.is_empty() {
            violations.push(format!(
                "seccompProfile (pod or {} must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")",
                who(&unconfined)
            ));
        }
    }
    if violations.is_empty() {
        return Ok(());
    }
    let name = pod["metadata"]["name"].as_str().unwrap_or("");
    Err(ApiError::admission_forbidden(
        Resource::Pods,
        name,
        &format!(
            "violates PodSecurity \"{level}:latest\": {}",
            violations.join(", ")
        ),
    ))
}
