//! The real API server's validation of what the double stores (names, labels, annotations,
//! the pod and secret rules a client can trip over, what an update may not change), each
//! failure a 422 `Invalid` worded as the real server words it. A client that passes here
//! would pass there for these rules; rules not listed here are not checked (see mod.rs).

use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::resource::Resource;
use super::status::ApiError;

static DNS_SUBDOMAIN: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
        .expect("a valid regex")
});
static DNS_LABEL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$").expect("a valid regex"));
static QUALIFIED_NAME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$").expect("a valid regex")
});
static SECRET_KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[-._a-zA-Z0-9]+$").expect("a valid regex"));

pub fn dns_subdomain_problem(name: &str) -> Option<String> {
    if name.len() > 253 {
        return Some("must be no more than 253 characters".to_owned());
    }
    (!DNS_SUBDOMAIN.is_match(name)).then(|| {
        "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')".to_owned()
    })
}

pub fn dns_label_problem(name: &str) -> Option<String> {
    if name.len() > 63 {
        return Some("must be no more than 63 characters".to_owned());
    }
    (!DNS_LABEL.is_match(name)).then(|| {
        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')".to_owned()
    })
}

/// A label or annotation key: an optional DNS-subdomain prefix and `/`, then a name.
pub fn label_key_problem(key: &str) -> Option<String> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() {
            return Some("prefix part must be non-empty".to_owned());
        }
        if let Some(problem) = dns_subdomain_problem(prefix) {
            return Some(format!("prefix part {problem}"));
        }
    }
    if name.is_empty() {
        return Some("name part must be non-empty".to_owned());
    }
    if name.len() > 63 {
        return Some("name part must be no more than 63 characters".to_owned());
    }
    (!QUALIFIED_NAME.is_match(name)).then(|| {
        "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')".to_owned()
    })
}

pub fn label_value_problem(value: &str) -> Option<String> {
    if value.is_empty() {
        return None;
    }
    if value.len() > 63 {
        return Some("must be no more than 63 characters".to_owned());
    }
    (!QUALIFIED_NAME.is_match(value)).then(|| {
        "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')".to_owned()
    })
}

/// Every rule for an object about to be stored (create or update).
pub fn validate(resource: Resource, object: &Value) -> Result<(), ApiError> {
    let name = object["metadata"]["name"].as_str().unwrap_or("");
    let mut causes = vec![];
    if let Some(problem) = dns_subdomain_problem(name) {
        causes.push(format!(
            "metadata.name: Invalid value: \"{name}\": {problem}"
        ));
    }
    metadata_rules(&object["metadata"], &mut causes);
    match resource {
        Resource::Pods => pod_rules(&object["spec"], &mut causes),
        Resource::Secrets => secret_rules(object, &mut causes),
        Resource::Leases => {
            if let Some(seconds) = object["spec"]["leaseDurationSeconds"].as_i64() {
                if seconds <= 0 {
                    causes.push(format!(
                        "spec.leaseDurationSeconds: Invalid value: {seconds}: must be greater than 0"
                    ));
                }
            }
        }
        Resource::Events | Resource::NetworkPolicies => {}
    }
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(resource, name, &causes))
    }
}

fn metadata_rules(metadata: &Value, causes: &mut Vec<String>) {
    for (key, value) in metadata["labels"].as_object().into_iter().flatten() {
        if let Some(problem) = label_key_problem(key) {
            causes.push(format!(
                "metadata.labels: Invalid value: \"{key}\": {problem}"
            ));
        }
        let value = value.as_str().unwrap_or("");
        if let Some(problem) = label_value_problem(value) {
            causes.push(format!(
                "metadata.labels: Invalid value: \"{value}\": {problem}"
            ));
        }
    }
    let mut annotation_bytes = 0;
    for (key, value) in metadata["annotations"].as_object().into_iter().flatten() {
        if let Some(problem) = label_key_problem(key) {
            causes.push(format!(
                "metadata.annotations: Invalid value: \"{key}\": {problem}"
            ));
        }
        annotation_bytes += key.len() + value.as_str().map_or(0, str::len);
    }
    if annotation_bytes > 256 * 1024 {
        causes.push("metadata.annotations: Too long: must have at most 262144 bytes".to_owned());
    }
}

fn pod_rules(spec: &Value, causes: &mut Vec<String>) {
    let containers = spec["containers"].as_array().cloned().unwrap_or_default();
    if containers.is_empty() {
        causes.push("spec.containers: Required value".to_owned());
    }
    let mut volume_names = vec![];
    for (i, volume) in spec["volumes"].as_array().into_iter().flatten().enumerate() {
        let name = volume["name"].as_str().unwrap_or("");
        if name.is_empty() {
            causes.push(format!("spec.volumes[{i}].name: Required value"));
        } else if let Some(problem) = dns_label_problem(name) {
            causes.push(format!(
                "spec.volumes[{i}].name: Invalid value: \"{name}\": {problem}"
            ));
        } else if volume_names.contains(&name) {
            causes.push(format!(
                "spec.volumes[{i}].name: Duplicate value: \"{name}\""
            ));
        }
        volume_names.push(name);
    }
    let mut container_names = vec![];
    for (i, container) in containers.iter().enumerate() {
        let field = format!("spec.containers[{i}]");
        let name = container["name"].as_str().unwrap_or("");
        if name.is_empty() {
            causes.push(format!("{field}.name: Required value"));
        } else if let Some(problem) = dns_label_problem(name) {
            causes.push(format!(
                "{field}.name: Invalid value: \"{name}\": {problem}"
            ));
        } else if container_names.contains(&name) {
            causes.push(format!("{field}.name: Duplicate value: \"{name}\""));
        }
        container_names.push(name);
        if container["image"].as_str().unwrap_or("").trim().is_empty() {
            causes.push(format!("{field}.image: Required value"));
        }
        let mut mount_paths = vec![];
        for (j, mount) in container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let mount_name = mount["name"].as_str().unwrap_or("");
            if !volume_names.contains(&mount_name) {
                causes.push(format!(
                    "{field}.volumeMounts[{j}].name: Not found: \"{mount_name}\""
                ));
            }
            let path = mount["mountPath"].as_str().unwrap_or("");
            if path.is_empty() {
                causes.push(format!(
                    "{field}.volumeMounts[{j}].mountPath: Required value"
                ));
            } else if mount_paths.contains(&path) {
                causes.push(format!(
                    "{field}.volumeMounts[{j}].mountPath: Invalid value: \"{path}\": must be unique"
                ));
            }
            mount_paths.push(path);
        }
        for (j, port) in container["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let number = port["containerPort"].as_i64().unwrap_or(0);
            if !(1..=65535).contains(&number) {
                causes.push(format!(
                    "{field}.ports[{j}].containerPort: Invalid value: {number}: must be between 1 and 65535, inclusive"
                ));
            }
        }
    }
}

fn secret_rules(secret: &Value, causes: &mut Vec<String>) {
    let mut total = 0;
    for (key, value) in secret["data"].as_object().into_iter().flatten() {
        if key.len() > 253 || !SECRET_KEY.is_match(key) {
            causes.push(format!(
                "data[{key}]: Invalid value: \"{key}\": a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"
            ));
        }
        // base64 text: 3 bytes per 4 characters.
        total += value.as_str().map_or(0, |v| v.len() / 4 * 3);
    }
    if total > 1024 * 1024 {
        causes.push("data: Too long: must have at most 1048576 bytes".to_owned());
    }
}

/// What an update may not change, beyond [`validate`]'s rules for the new object.
pub fn validate_update(resource: Resource, old: &Value, new: &Value) -> Result<(), ApiError> {
    let name = new["metadata"]["name"].as_str().unwrap_or("");
    let mut causes = vec![];
    match resource {
        Resource::Pods => {
            // Only images and a few scheduling fields of a pod's spec are mutable.
            let strip = |spec: &Value| {
                let mut spec = spec.clone();
                for container in spec["containers"].as_array_mut().into_iter().flatten() {
                    container["image"] = Value::Null;
                }
                for field in [
                    "activeDeadlineSeconds",
                    "tolerations",
                    "terminationGracePeriodSeconds",
                    "schedulingGates",
                ] {
                    if let Some(spec) = spec.as_object_mut() {
                        spec.remove(field);
                    }
                }
                spec
            };
            if strip(&old["spec"]) != strip(&new["spec"]) {
                causes.push("spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)".to_owned());
            }
        }
        Resource::Secrets => {
            if old["type"] != new["type"] {
                causes.push(format!(
                    "type: Invalid value: {}: field is immutable",
                    new["type"]
                ));
            }
            if old["immutable"] == Value::Bool(true) {
                if old["data"] != new["data"] {
                    causes.push(
                        "data: Forbidden: field is immutable when `immutable` is set".to_owned(),
                    );
                }
                if new["immutable"] != Value::Bool(true) {
                    causes.push(
                        "immutable: Forbidden: field is immutable when `immutable` is set"
                            .to_owned(),
                    );
                }
            }
        }
        Resource::Events | Resource::NetworkPolicies | Resource::Leases => {}
    }
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(resource, name, &causes))
    }
}
