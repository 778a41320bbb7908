//! The Kubernetes objects of a kernel, as `k8s-openapi` types: its pod, the Secret that
//! carries its key, and the NetworkPolicy of its policy's pods. Plain functions of their
//! inputs, so what the cluster is asked for is tested without one.
//!
//! The pod is locked down as far as a pod spec goes (non-root, read-only root, no privilege
//! escalation, no capabilities, the runtime's default seccomp profile, no service account
//! token, no service links), runs in the policy's RuntimeClass (gVisor or Kata), and is
//! sized from the policy's limits. Its only listener is the agent's port, which proves the
//! kernel's key before anything else; its NetworkPolicy admits gateways only and lets it
//! reach nothing: a kernel's egress travels inside the agent link to the gateway's proxy,
//! where the policy's egress and package rules apply as for every backend.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, KeyToPath, LocalObjectReference,
    Pod, PodSecurityContext, PodSpec, ResourceRequirements, SeccompProfile, Secret,
    SecretVolumeSource, SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;

use super::PodSettings;
use crate::sandbox::{relocate, Limits};

/// The agent's TCP port in every kernel pod.
pub const AGENT_PORT: u16 = 7070;
/// The kernel's (and the agent's) uid and gid in the pod.
pub const KERNEL_UID: i64 = 1000;
/// Where the pod's Secret is mounted, and its one key.
pub const KEY_DIR: &str = "/var/run/secrets/cellgate";
pub const KEY_NAME: &str = "key";
/// The Secret's key holding the kernel's connection info (not mounted in the pod).
pub const CONNECTION_NAME: &str = "connection";
/// The agent binary in the kernel image.
pub const AGENT_PATH: &str = "/opt/cellgate/bin/cellgate-agent";
/// The agent's own run directory (the kernel's log), a volume: the root is read-only.
const AGENT_RUN_DIR: &str = "/run/cellgate-agent";

/// Label keys and the values every kernel pod has.
pub const LABEL_NAME: &str = "app.kubernetes.io/name";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const LABEL_COMPONENT: &str = "app.kubernetes.io/component";
pub const LABEL_KERNEL: &str = "cellgate.io/kernel";
pub const LABEL_TENANT: &str = "cellgate.io/tenant";
pub const LABEL_POLICY: &str = "cellgate.io/policy";
pub const KERNEL_POD_NAME: &str = "cellgate-kernel";
/// The labels of the gateway's own pods (deploy/kubernetes), which kernel pods admit.
pub const GATEWAY_NAME: &str = "cellgate";
pub const GATEWAY_COMPONENT: &str = "gateway";
/// The annotation holding the tenant's name as is (a label value is restricted).
pub const ANNOTATION_TENANT: &str = "cellgate.io/tenant";

/// Memory the agent needs beside the kernel in the container's limit.
pub const AGENT_MEMORY_BYTES: u64 = 48 << 20;
/// The pod's run directory (connection file, ipc sockets) and `/tmp`, both memory-backed.
const RUN_DIR_BYTES: u64 = 16 << 20;
const TMP_BYTES: u64 = 256 << 20;

/// Who a kernel pod is for.
#[derive(Debug, Clone)]
pub struct PodOwner {
    pub kernel_id: String,
    pub policy: String,
    pub tenant: Option<String>,
}

/// A pod's name: the kernel's id and a suffix of the launch, since a restarted kernel's
/// new pod may start before the old one is gone.
pub fn pod_name(kernel_id: &str, launch: &str) -> String {
    format!("{KERNEL_POD_NAME}-{kernel_id}-{launch}")
}

/// The labels of a kernel pod and its Secret.
pub fn labels(owner: &PodOwner) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_NAME.to_owned(), KERNEL_POD_NAME.to_owned()),
        (LABEL_MANAGED_BY.to_owned(), GATEWAY_NAME.to_owned()),
        (LABEL_KERNEL.to_owned(), label_value(&owner.kernel_id)),
        (
            LABEL_TENANT.to_owned(),
            label_value(owner.tenant.as_deref().unwrap_or("")),
        ),
        (LABEL_POLICY.to_owned(), label_value(&owner.policy)),
    ])
}

/// `value` as a label value (at most 63 of `[A-Za-z0-9._-]`, alphanumeric at both ends):
/// as is when it is one, else its characters outside the set as `_`, and a hash of the
/// whole when that changed or cut it (two tenants never share a label by accident).
pub fn label_value(value: &str) -> String {
    let valid = value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && value
            .bytes()
            .next()
            .is_none_or(|b| b.is_ascii_alphanumeric())
        && value
            .bytes()
            .last()
            .is_none_or(|b| b.is_ascii_alphanumeric());
    if valid {
        return value.to_owned();
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(value.as_bytes());
    let hash: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    let mut kept: String = value
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(63 - hash.len() - 1)
        .collect();
    kept = kept.trim_matches('_').to_owned();
    if kept.is_empty() {
        hash
    } else {
        format!("{kept}_{hash}")
    }
}

fn quantity(bytes: u64) -> Quantity {
    Quantity(bytes.to_string())
}

/// The kernel's pod: the agent as its entrypoint, listening for gateways that prove the key.
pub fn pod(
    name: &str,
    namespace: &str,
    owner: &PodOwner,
    settings: &PodSettings,
    image: &str,
    limits: &Limits,
) -> Pod {
    let container = container(settings, image, resources(limits));
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels(owner)),
            annotations: owner
                .tenant
                .as_ref()
                .map(|tenant| BTreeMap::from([(ANNOTATION_TENANT.to_owned(), tenant.clone())])),
            ..ObjectMeta::default()
        },
        spec: Some(pod_spec(name, container, settings, limits)),
        status: None,
    }
}

/// The container's requests and limits (the same: the pod is guaranteed what it may use),
/// from the policy's limits plus the agent's own memory beside the kernel.
fn resources(limits: &Limits) -> BTreeMap<String, Quantity> {
    let mut resources = BTreeMap::new();
    if let Some(memory) = limits.memory_bytes {
        resources.insert(
            "memory".to_owned(),
            quantity(memory.saturating_add(AGENT_MEMORY_BYTES)),
        );
    }
    if let Some(millis) = limits.cpu_millis {
        resources.insert("cpu".to_owned(), Quantity(format!("{millis}m")));
    }
    if let Some(workspace) = limits.workspace_bytes {
        // The workspace volume, and what the kernel writes to its memory-backed directories
        // is charged to memory; the container's own writable layer gets nothing (read-only).
        resources.insert("ephemeral-storage".to_owned(), quantity(workspace));
    }
    resources
}

/// The one container: the agent with the kernel's key, non-root, no capabilities, a
/// read-only root, writable only where its volumes are mounted.
fn container(
    settings: &PodSettings,
    image: &str,
    resources: BTreeMap<String, Quantity>,
) -> Container {
    Container {
        name: "kernel".to_owned(),
        image: Some(image.to_owned()),
        image_pull_policy: Some(settings.image_pull_policy.clone()),
        command: Some(vec![
            AGENT_PATH.to_owned(),
            "--listen-tcp".to_owned(),
            format!("0.0.0.0:{AGENT_PORT}"),
            "--key-file".to_owned(),
            format!("{KEY_DIR}/{KEY_NAME}"),
        ]),
        ports: Some(vec![ContainerPort {
            name: Some("agent".to_owned()),
            container_port: i32::from(AGENT_PORT),
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        resources: Some(ResourceRequirements {
            requests: Some(resources.clone()),
            limits: Some(resources),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            run_as_user: Some(KERNEL_UID),
            run_as_group: Some(KERNEL_UID),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                add: None,
            }),
            privileged: Some(false),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(vec![
            mount("key", KEY_DIR, true),
            mount("workspace", relocate::WORKSPACE, false),
            mount("run", relocate::RUN_DIR, false),
            mount("agent", AGENT_RUN_DIR, false),
            mount("tmp", "/tmp", false),
        ]),
        working_dir: Some(relocate::WORKSPACE.to_owned()),
        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
        ..Container::default()
    }
}

/// A volume mount of the container; `read_only` is left out of the spec when false, as the
/// cluster's default.
fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// The pod's spec around its container: nothing of the node's shared (network, pids, ipc),
/// no service account token or links, the runtime's default seccomp profile, and the
/// deployment's scheduling settings.
fn pod_spec(name: &str, container: Container, settings: &PodSettings, limits: &Limits) -> PodSpec {
    let tolerations = settings
        .tolerations
        .iter()
        .map(|t| Toleration {
            key: t.key.clone(),
            operator: t.operator.clone(),
            value: t.value.clone(),
            effect: t.effect.clone(),
            toleration_seconds: t.toleration_seconds,
        })
        .collect::<Vec<_>>();
    PodSpec {
        containers: vec![container],
        restart_policy: Some("Never".to_owned()),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        service_account_name: settings.service_account.clone(),
        runtime_class_name: settings.runtime_class.clone(),
        node_selector: (!settings.node_selector.is_empty()).then(|| settings.node_selector.clone()),
        tolerations: (!tolerations.is_empty()).then_some(tolerations),
        image_pull_secrets: (!settings.image_pull_secrets.is_empty()).then(|| {
            settings
                .image_pull_secrets
                .iter()
                .map(|name| LocalObjectReference { name: name.clone() })
                .collect()
        }),
        // The agent ends the kernel at SIGTERM; nothing is worth waiting for.
        termination_grace_period_seconds: Some(2),
        host_network: Some(false),
        host_pid: Some(false),
        host_ipc: Some(false),
        share_process_namespace: Some(false),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(KERNEL_UID),
            run_as_group: Some(KERNEL_UID),
            fs_group: Some(KERNEL_UID),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                localhost_profile: None,
            }),
            ..PodSecurityContext::default()
        }),
        volumes: Some(volumes(name, limits)),
        ..PodSpec::default()
    }
}

/// The pod's volumes: the Secret `name` (the agent's key only) and the writable directories,
/// the workspace sized by the policy and the rest memory-backed so they count as memory.
fn volumes(name: &str, limits: &Limits) -> Vec<Volume> {
    vec![
        Volume {
            name: "key".to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(name.to_owned()),
                default_mode: Some(0o440),
                optional: Some(false),
                // The agent's key only: the connection info stays with gateways.
                items: Some(vec![KeyToPath {
                    key: KEY_NAME.to_owned(),
                    path: KEY_NAME.to_owned(),
                    mode: None,
                }]),
            }),
            ..Volume::default()
        },
        empty_dir("workspace", None, limits.workspace_bytes),
        empty_dir("run", Some("Memory"), Some(RUN_DIR_BYTES)),
        empty_dir("agent", Some("Memory"), Some(RUN_DIR_BYTES)),
        empty_dir("tmp", Some("Memory"), Some(TMP_BYTES)),
    ]
}

/// An `emptyDir` volume of `medium` (the node's disk when `None`) of at most `bytes`.
fn empty_dir(name: &str, medium: Option<&str>, bytes: Option<u64>) -> Volume {
    Volume {
        name: name.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: medium.map(str::to_owned),
            size_limit: bytes.map(quantity),
        }),
        ..Volume::default()
    }
}

/// The Secret holding the kernel's agent key and its connection info (the key its messages
/// are signed with: a replica taking the kernel over needs both), owned by its pod (created
/// after it, with its uid), so the cluster deletes it with the pod whoever deletes that.
pub fn secret(pod: &Pod, key: &str, connection: Option<&serde_json::Value>) -> Secret {
    let owner = OwnerReference {
        api_version: "v1".to_owned(),
        kind: "Pod".to_owned(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    };
    Secret {
        metadata: ObjectMeta {
            name: pod.metadata.name.clone(),
            namespace: pod.metadata.namespace.clone(),
            labels: pod.metadata.labels.clone(),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        data: Some(
            [(KEY_NAME, Some(key.as_bytes().to_vec()))]
                .into_iter()
                .chain([(
                    CONNECTION_NAME,
                    connection.and_then(|info| serde_json::to_vec(info).ok()),
                )])
                .filter_map(|(name, bytes)| Some((name.to_owned(), ByteString(bytes?))))
                .collect(),
        ),
        type_: Some("Opaque".to_owned()),
        immutable: Some(true),
        ..Secret::default()
    }
}

/// The NetworkPolicy name of a policy's kernel pods.
pub fn network_policy_name(policy: &str) -> String {
    format!(
        "{KERNEL_POD_NAME}s-{}",
        label_value(policy).to_lowercase().replace('_', "-")
    )
}

/// A policy's kernel pods admit gateway pods (of `gateway_namespace`) on the agent's port and
/// reach nothing at all.
pub fn network_policy(namespace: &str, policy: &str, gateway_namespace: &str) -> NetworkPolicy {
    let kernels = BTreeMap::from([
        (LABEL_NAME.to_owned(), KERNEL_POD_NAME.to_owned()),
        (LABEL_POLICY.to_owned(), label_value(policy)),
    ]);
    let gateways = BTreeMap::from([
        (LABEL_NAME.to_owned(), GATEWAY_NAME.to_owned()),
        (LABEL_COMPONENT.to_owned(), GATEWAY_COMPONENT.to_owned()),
    ]);
    NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(network_policy_name(policy)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([
                (LABEL_MANAGED_BY.to_owned(), GATEWAY_NAME.to_owned()),
                (LABEL_POLICY.to_owned(), label_value(policy)),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(kernels),
                match_expressions: None,
            }),
            policy_types: Some(vec!["Ingress".to_owned(), "Egress".to_owned()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(vec![NetworkPolicyPeer {
                    pod_selector: Some(LabelSelector {
                        match_labels: Some(gateways),
                        match_expressions: None,
                    }),
                    // A pod selector alone means the kernels' own namespace.
                    namespace_selector: (gateway_namespace != namespace).then(|| LabelSelector {
                        match_labels: Some(BTreeMap::from([(
                            "kubernetes.io/metadata.name".to_owned(),
                            gateway_namespace.to_owned(),
                        )])),
                        match_expressions: None,
                    }),
                    ..NetworkPolicyPeer::default()
                }]),
                ports: Some(vec![NetworkPolicyPort {
                    port: Some(IntOrString::Int(i32::from(AGENT_PORT))),
                    protocol: Some("TCP".to_owned()),
                    end_port: None,
                }]),
            }]),
            // Egress listed and empty: nothing, not even DNS.
            egress: Some(vec![]),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> PodSettings {
        PodSettings {
            image: "registry.example/cellgate-kernel:1".to_owned(),
            runtime_class: Some("gvisor".to_owned()),
            ..PodSettings::default()
        }
    }

    fn owner() -> PodOwner {
        PodOwner {
            kernel_id: "0b3c4e4e-6c1b-4f7e-9b7c-2d1f1e0c9a11".to_owned(),
            policy: "default".to_owned(),
            tenant: Some("acme corp".to_owned()),
        }
    }

    #[test]
    fn the_pod_is_locked_down_and_sized_from_the_policy() {
        let limits = Limits {
            memory_bytes: Some(1 << 30),
            cpu_millis: Some(1500),
            pids: Some(256),
            workspace_bytes: Some(2 << 30),
        };
        let name = pod_name(&owner().kernel_id, "ab12c");
        assert!(name.len() <= 63, "{name}");
        let settings = settings();
        let pod = pod(
            &name,
            "kernels",
            &owner(),
            &settings,
            &settings.image,
            &limits,
        );
        let json = serde_json::to_value(&pod).unwrap();
        let spec = &json["spec"];
        assert_eq!(spec["automountServiceAccountToken"], false);
        assert_eq!(spec["enableServiceLinks"], false);
        assert_eq!(spec["runtimeClassName"], "gvisor");
        assert_eq!(spec["restartPolicy"], "Never");
        assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
        assert_eq!(
            spec["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        let container = &spec["containers"][0];
        let security = &container["securityContext"];
        assert_eq!(security["allowPrivilegeEscalation"], false);
        assert_eq!(security["readOnlyRootFilesystem"], true);
        assert_eq!(security["capabilities"]["drop"][0], "ALL");
        let limits = &container["resources"]["limits"];
        assert_eq!(
            limits["memory"],
            ((1u64 << 30) + AGENT_MEMORY_BYTES).to_string()
        );
        assert_eq!(limits["cpu"], "1500m");
        assert_eq!(limits["ephemeral-storage"], (2u64 << 30).to_string());
        assert_eq!(container["resources"]["requests"], *limits);
        let labels = &json["metadata"]["labels"];
        assert_eq!(labels[LABEL_KERNEL], owner().kernel_id);
        assert_eq!(labels[LABEL_POLICY], "default");
        // Not a valid label value as is: kept readable, made unique by a hash.
        let tenant = labels[LABEL_TENANT].as_str().unwrap();
        assert!(tenant.starts_with("acme_corp_"), "{tenant}");
        assert_eq!(
            json["metadata"]["annotations"][ANNOTATION_TENANT],
            "acme corp"
        );
        let secret_volume = &spec["volumes"][0]["secret"];
        assert_eq!(secret_volume["secretName"], name);
    }

    #[test]
    fn the_secret_is_owned_by_its_pod() {
        let mut pod = pod(
            "p",
            "ns",
            &owner(),
            &settings(),
            "r/k:1",
            &Limits::default(),
        );
        pod.metadata.uid = Some("uid-1".to_owned());
        let connection = serde_json::json!({"key": "jupyter-key"});
        let secret = secret(&pod, "k".repeat(64).as_str(), Some(&connection));
        let owners = secret.metadata.owner_references.unwrap();
        assert_eq!(owners[0].uid, "uid-1");
        assert_eq!(owners[0].kind, "Pod");
        let data = secret.data.unwrap();
        assert_eq!(data[KEY_NAME].0.len(), 64);
        assert_eq!(data[CONNECTION_NAME].0, br#"{"key":"jupyter-key"}"#);
    }

    #[test]
    fn kernel_pods_reach_nothing_and_admit_gateways_only() {
        let policy = network_policy("ns", "default", "ns");
        let json = serde_json::to_value(&policy).unwrap();
        assert_eq!(json["spec"]["egress"], serde_json::json!([]));
        assert_eq!(
            json["spec"]["policyTypes"],
            serde_json::json!(["Ingress", "Egress"])
        );
        let from = &json["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"];
        assert_eq!(from[LABEL_COMPONENT], GATEWAY_COMPONENT);
        assert_eq!(json["spec"]["ingress"][0]["ports"][0]["port"], AGENT_PORT);
        assert!(json["spec"]["ingress"][0]["from"][0]["namespaceSelector"].is_null());
        let elsewhere = serde_json::to_value(network_policy("kernels", "default", "gw")).unwrap();
        let from = &elsewhere["spec"]["ingress"][0]["from"][0];
        assert_eq!(
            from["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
            "gw"
        );
    }

    #[test]
    fn label_values_are_valid_and_distinct() {
        assert_eq!(label_value("plain-tenant.1"), "plain-tenant.1");
        assert_eq!(label_value(""), "");
        let a = label_value("a/b");
        let b = label_value("a:b");
        assert_ne!(a, b);
        let long = label_value(&"x".repeat(100));
        assert!(long.len() <= 63, "{long}");
        for value in [a, b, long, label_value("-_-")] {
            assert!(value
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c)));
            assert!(
                value.bytes().next().unwrap().is_ascii_alphanumeric(),
                "{value}"
            );
        }
    }
}
