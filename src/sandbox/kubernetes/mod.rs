//! The kubernetes backend: each kernel is a pod of the policy's image (its Python
//! environment and `cellgate-agent`), in the policy's RuntimeClass (gVisor or Kata), reached
//! over TCP through the same guest agent as a microVM (`sandbox/agent`). No cluster protocol
//! of our own: the API server is the record of what runs where, spoken to through `kube`
//! with the typed objects of `k8s-openapi`.
//!
//! A launch, in order:
//! 1. the policy's NetworkPolicy is made sure of (once per policy and process): its pods
//!    admit gateway pods on the agent's port (7070) and reach nothing, not even DNS (their
//!    egress is a stream of the agent link, so the egress proxy and package index apply
//!    unchanged);
//! 2. the pod is created ([`objects::pod`]: uid 1000, read-only root, every capability
//!    dropped, `restartPolicy: Never`, the policy's RuntimeClass, requests = limits: the
//!    policy's memory plus the agent's 48 MiB, its CPUs, and the workspace as ephemeral
//!    storage and as the `emptyDir` at `/home/user`), then the Secret with the kernel's
//!    key, owned by the pod (so the cluster deletes it with the pod, whoever deletes that);
//!    the kubelet waits for the Secret before it starts the container;
//! 3. the pod is watched until it runs (`status.rs` reads Kubernetes' own reasons); a pod
//!    still pending at the policy's `pending_timeout` (an image that does not pull, no node
//!    with room), or at once for a reason that never clears (`ErrImageNeverPull`,
//!    `CreateContainerConfigError`), is deleted and the launch fails with that reason
//!    ([`KubernetesError::Pending`]; HTTP 503, `pod_pending` or `pod_failed`);
//! 4. the gateway dials the pod's address, proves the key and makes the agent prove it
//!    (a pod address reused by another pod is refused), then starts the kernel through the
//!    agent, and serves the kernel's channels on unix sockets at its ipc paths, as for a VM.
//!
//! Afterwards the pod stays watched: a pod that fails, is evicted or deleted by someone else
//! ends the kernel as `sandbox_lost` with the reason; the kernel's own end comes from the
//! agent (its exit status, an out-of-memory kill read from the container's cgroup). `kill`
//! asks the agent to kill the kernel and deletes the pod and the Secret. Usage is the
//! container's cgroup as the agent reads it, refreshed in the background (the `Sandbox`
//! trait's usage call is synchronous). The policy's pids limit is not enforced in a pod (the
//! kubelet's `podPidsLimit` is per node).
//!
//! Gateway replicas share this backend's kernels: [`replicas`] records who owns which
//! kernel in Leases (the `Ownership` implementation of this backend).
//!
//! Must not depend on: kernels, policies, HTTP (the policy's `[kubernetes]` section arrives
//! as [`PodSettings`] in the launch spec).

mod handle;
pub mod objects;
pub mod replicas;
pub mod status;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use tokio::sync::{watch, OnceCell};

use super::agent::{self, channels, Agent, AgentError};
use super::diagnosis::Diagnosis;
use super::{Backend, LaunchSpec, Launched, Sandbox, SandboxError};
use crate::ownership::KernelRecord;
use handle::PodHandle;
use objects::PodOwner;
use status::PodState;

/// How long the agent may take to prove the key, and then to answer the handshake.
const AGENT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a running pod's agent may take to listen (its process starting).
const DIAL_TIMEOUT: Duration = Duration::from_secs(30);

/// A policy's `[kubernetes]` section: where and how its kernel pods run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSettings {
    /// The kernel image: the kernel's Python environment at `/opt/cellgate/venv` and the
    /// agent at `/opt/cellgate/bin/cellgate-agent` (deploy/kubernetes/images).
    pub image: String,
    /// The images of other kernelspecs, by name: each holds that kernel's environment at
    /// `/opt/cellgate/venv` (kernel.Dockerfile `--build-arg KERNEL=NAME`). A pod's agent runs
    /// unprivileged and cannot bind an environment there itself, as a VM's does: one
    /// image per language instead.
    pub kernel_images: BTreeMap<String, String>,
    /// `None`: the namespace of the gateway's own configuration (in a cluster, its own).
    pub namespace: Option<String>,
    /// The RuntimeClass that isolates the pod (`gvisor`, `kata`); `None`: the cluster's
    /// default runtime, which is no sandbox: only for trusted code.
    pub runtime_class: Option<String>,
    pub service_account: Option<String>,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<PodToleration>,
    pub image_pull_policy: String,
    pub image_pull_secrets: Vec<String>,
    /// A pod not running this long after its creation is deleted and the start fails.
    pub pending_timeout: Duration,
}

impl Default for PodSettings {
    fn default() -> PodSettings {
        PodSettings {
            image: String::new(),
            kernel_images: BTreeMap::new(),
            namespace: None,
            runtime_class: None,
            service_account: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            image_pull_policy: "IfNotPresent".to_owned(),
            image_pull_secrets: Vec::new(),
            pending_timeout: Duration::from_secs(120),
        }
    }
}

/// A toleration of the pods' nodes' taints, as Kubernetes spells it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodToleration {
    pub key: Option<String>,
    pub operator: Option<String>,
    pub value: Option<String>,
    pub effect: Option<String>,
    pub toleration_seconds: Option<i64>,
}

/// Errors of the kubernetes backend.
#[derive(Debug, thiserror::Error)]
pub enum KubernetesError {
    #[error("no Kubernetes configuration (in-cluster service account or KUBECONFIG): {0}")]
    Config(String),
    #[error("the policy names the kubernetes backend but has no [kubernetes] section")]
    NoSettings,
    #[error("the Kubernetes API refused to {action}: {message}")]
    Api { action: String, message: String },
    #[error("the kernel's pod did not start within {timeout:?}: {why}")]
    Pending { timeout: Duration, why: String },
    #[error("the kernel's pod ended before its kernel started: {0}")]
    Ended(String),
    #[error("the kernel pod's agent: {0}")]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Unsupported(#[from] agent::UnsupportedKernel),
}

fn api_error(action: impl Into<String>) -> impl FnOnce(kube::Error) -> KubernetesError {
    let action = action.into();
    move |error| KubernetesError::Api {
        action,
        message: match error {
            kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
            other => other.to_string(),
        },
    }
}

/// Whether `error` is the API's answer `code`.
fn is_status(error: &kube::Error, code: u16) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == code)
}

/// The kubernetes backend of one gateway.
pub struct KubernetesSandbox {
    /// Made at first use (finding the configuration reads files and may run a credential
    /// plugin), then shared.
    client: OnceCell<(kube::Client, String)>,
    /// The policies whose NetworkPolicy this process has made sure of, by namespace.
    network_policies: parking_lot::Mutex<HashSet<(String, String)>>,
    /// The policies without a RuntimeClass this process has warned of.
    unsandboxed: parking_lot::Mutex<HashSet<String>>,
    /// This gateway's membership among replicas, when it has others: each kernel's owner is
    /// recorded as it is created.
    replicas: Option<Arc<replicas::Replicas>>,
}

/// The API client and the configuration's default namespace, from the environment: the
/// in-cluster service account, else `KUBECONFIG` or `~/.kube/config`.
pub async fn client_from_environment() -> Result<(kube::Client, String), KubernetesError> {
    let config = kube::Config::infer()
        .await
        .map_err(|e| KubernetesError::Config(e.to_string()))?;
    let namespace = config.default_namespace.clone();
    let client =
        kube::Client::try_from(config).map_err(|e| KubernetesError::Config(e.to_string()))?;
    Ok((client, namespace))
}

impl KubernetesSandbox {
    pub fn new(replicas: Option<Arc<replicas::Replicas>>) -> KubernetesSandbox {
        KubernetesSandbox {
            client: OnceCell::new(),
            network_policies: parking_lot::Mutex::new(HashSet::new()),
            unsandboxed: parking_lot::Mutex::new(HashSet::new()),
            replicas,
        }
    }

    /// The API client and the configuration's default namespace.
    async fn client(&self) -> Result<&(kube::Client, String), KubernetesError> {
        self.client.get_or_try_init(client_from_environment).await
    }

    async fn launch_pod(&self, spec: &LaunchSpec) -> Result<Launched, KubernetesError> {
        let settings = spec
            .backend_settings
            .kubernetes
            .as_ref()
            .ok_or(KubernetesError::NoSettings)?;
        let launch = &spec.labels;
        if settings.runtime_class.is_none() && self.unsandboxed.lock().insert(launch.policy.clone())
        {
            // Said once per policy: the cluster's default runtime is a container, which is
            // no sandbox for hostile code.
            tracing::warn!(policy = %launch.policy, "this policy names no runtime_class: its kernel pods run in the cluster's default runtime (containers, not a sandbox); name gvisor or kata for untrusted code");
        }
        let (client, default_namespace) = self.client().await?;
        let namespace = match &spec.adopt {
            Some(record) => record.namespace.clone(),
            None => settings
                .namespace
                .clone()
                .unwrap_or_else(|| default_namespace.clone()),
        };
        self.ensure_network_policy(client, &namespace, &launch.policy, default_namespace)
            .await?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
        let (name, agent, version) = match &spec.adopt {
            Some(record) => self.attach(spec, &pods, &secrets, record).await?,
            None => {
                self.create(spec, settings, &pods, &secrets, &namespace)
                    .await?
            }
        };
        let remove = self.remover(&pods, &secrets, &name, &spec.kernel_id);
        let agent = Arc::new(agent);
        let handle = Arc::new(PodHandle::new(agent.clone(), remove));
        if let Err(error) = channels::serve(&spec.connection, agent.clone()) {
            handle.delete_pod();
            return Err(KubernetesError::Agent(AgentError(format!(
                "listening on the kernel's channels: {error}"
            ))));
        }
        tracing::info!(kernel_id = %spec.kernel_id, pod = %name, %namespace, adopted = spec.adopt.is_some(), "kernel pod running");
        let (exit_tx, exit) = watch::channel(None);
        handle::watch_exit(
            handle.clone(),
            agent,
            pods,
            name,
            version,
            spec.log_file.clone(),
            exit_tx,
        );
        Ok(Launched {
            handle,
            exit,
            connection: spec.connection.clone(),
        })
    }

    fn remover(
        &self,
        pods: &Api<Pod>,
        secrets: &Api<Secret>,
        name: &str,
        kernel_id: &str,
    ) -> PodRemover {
        PodRemover {
            pods: pods.clone(),
            secrets: secrets.clone(),
            name: name.to_owned(),
            lease: self
                .replicas
                .as_ref()
                .map(|replicas| (replicas.clone(), kernel_id.to_owned())),
        }
    }

    /// A new pod for the kernel: created, its owner recorded, its Secret made, watched until
    /// it runs, its agent proven and the kernel started. Anything failing removes the pod.
    async fn create(
        &self,
        spec: &LaunchSpec,
        settings: &PodSettings,
        pods: &Api<Pod>,
        secrets: &Api<Secret>,
        namespace: &str,
    ) -> Result<(String, Agent, String), KubernetesError> {
        let launch = &spec.labels;
        let owner = PodOwner {
            kernel_id: spec.kernel_id.clone(),
            policy: launch.policy.clone(),
            tenant: launch.tenant.clone(),
        };
        let suffix = format!("{:05x}", rand::random::<u32>() & 0xf_ffff);
        let name = objects::pod_name(&spec.kernel_id, &suffix);
        let key = format!(
            "{:032x}{:032x}",
            rand::random::<u128>(),
            rand::random::<u128>()
        );
        // The default kernel image holds the python3 venv alone (deploy/kubernetes/images);
        // another kernelspec runs in the image the policy names for it, whose environment is
        // at the same fixed path.
        let image = match settings.kernel_images.get(&launch.kernelspec) {
            Some(image) => image,
            None => {
                agent::check_image_runs(spec, "kubernetes", &[])?;
                &settings.image
            }
        };
        let map = agent::relocation(spec);
        let connection = agent::guest_connection(spec, &map)?;
        let pod = objects::pod(&name, namespace, &owner, settings, image, &spec.limits);
        let created = pods
            .create(&PostParams::default(), &pod)
            .await
            .map_err(api_error(format!("create the pod {name}")))?;
        let remove = self.remover(pods, secrets, &name, &spec.kernel_id);
        let started = async {
            if let Some(replicas) = &self.replicas {
                let record = KernelRecord {
                    kernel_id: spec.kernel_id.clone(),
                    owner: replicas.id().to_owned(),
                    incarnation: String::new(),
                    sandbox: name.clone(),
                    namespace: namespace.to_owned(),
                    kernelspec: launch.kernelspec.clone(),
                    policy: launch.policy.clone(),
                    tenant: launch.tenant.clone(),
                };
                replicas.claim(&record, &created).await?;
            }
            let secret = objects::secret(&created, &key, connection.as_ref().map(|c| &c.info));
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .map_err(api_error(format!("create the secret {name}")))?;
            let (ip, version) = wait_running(pods, &name, settings.pending_timeout).await?;
            let agent = dial(&ip, key.as_bytes(), spec).await?;
            let uid = objects::KERNEL_UID as u32;
            agent::start_kernel(&agent, spec, &map, connection, uid, None).await?;
            Ok::<_, KubernetesError>((agent, version))
        };
        match started.await {
            Ok((agent, version)) => Ok((name, agent, version)),
            Err(error) => {
                remove.now().await;
                Err(error)
            }
        }
    }

    /// A running pod whose owner is gone: its key from its Secret, its agent proven, the
    /// kernel already running in it (no start).
    async fn attach(
        &self,
        spec: &LaunchSpec,
        pods: &Api<Pod>,
        secrets: &Api<Secret>,
        record: &KernelRecord,
    ) -> Result<(String, Agent, String), KubernetesError> {
        let name = record.sandbox.clone();
        let secret = secrets
            .get(&name)
            .await
            .map_err(api_error(format!("read the secret {name}")))?;
        let key = secret
            .data
            .as_ref()
            .and_then(|data| data.get(objects::KEY_NAME))
            .map(|key| key.0.clone())
            .ok_or_else(|| KubernetesError::Ended(format!("the secret {name} has no key")))?;
        let (ip, version) = wait_running(pods, &name, Duration::from_secs(10)).await?;
        let agent = dial(&ip, &key, spec).await?;
        Ok((name, agent, version))
    }

    /// Creates the policy's NetworkPolicy, or brings it back to what it must be.
    async fn ensure_network_policy(
        &self,
        client: &kube::Client,
        namespace: &str,
        policy: &str,
        gateway_namespace: &str,
    ) -> Result<(), KubernetesError> {
        let key = (namespace.to_owned(), policy.to_owned());
        if self.network_policies.lock().contains(&key) {
            return Ok(());
        }
        let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), namespace);
        let wanted = objects::network_policy(namespace, policy, gateway_namespace);
        let name = objects::network_policy_name(policy);
        let action = format!("make sure of the network policy {name}");
        match api
            .get_opt(&name)
            .await
            .map_err(api_error(action.clone()))?
        {
            None => match api.create(&PostParams::default(), &wanted).await {
                // Another replica made it meanwhile: the same object.
                Err(error) if is_status(&error, 409) => {}
                other => {
                    other.map_err(api_error(action))?;
                }
            },
            Some(existing) if existing.spec == wanted.spec => {}
            Some(existing) => {
                let mut replaced = wanted;
                replaced.metadata.resource_version = existing.metadata.resource_version;
                api.replace(&name, &PostParams::default(), &replaced)
                    .await
                    .map_err(api_error(action))?;
                tracing::warn!(%name, %namespace, "a kernel network policy had been changed; restored");
            }
        }
        self.network_policies.lock().insert(key);
        Ok(())
    }
}

impl Sandbox for KubernetesSandbox {
    fn backend(&self) -> Backend {
        Backend::Kubernetes
    }

    fn launch<'a>(&'a self, spec: &'a LaunchSpec) -> BoxFuture<'a, Result<Launched, SandboxError>> {
        Box::pin(async move { self.launch_pod(spec).await.map_err(SandboxError::from) })
    }

    fn shares_ownership(&self) -> bool {
        self.replicas.is_some()
    }
}

impl From<KubernetesError> for SandboxError {
    fn from(error: KubernetesError) -> SandboxError {
        SandboxError::Kubernetes(Box::new(error))
    }
}

/// Deletes a kernel's pod and Secret (the Secret would go with the pod anyway, by its owner
/// reference; deleting it too means no key outlives the kernel for the garbage collector's
/// delay).
pub(crate) struct PodRemover {
    pods: Api<Pod>,
    secrets: Api<Secret>,
    name: String,
    /// The kernel's ownership Lease, when replicas record one (in the replicas' namespace,
    /// which may not be the pod's: no owner reference reaches across).
    lease: Option<(Arc<replicas::Replicas>, String)>,
}

impl PodRemover {
    /// Whether this process still owns the kernel by its Lease (always, without replicas).
    /// An owner that was paused past its lease finds another replica holding its kernel:
    /// it must then let the pod be, not delete it from under its new owner.
    pub(crate) async fn still_ours(&self) -> bool {
        match &self.lease {
            None => true,
            Some((replicas, kernel_id)) => replicas.holds(kernel_id).await,
        }
    }

    pub(crate) async fn now(&self) {
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        for result in [
            self.pods.delete(&self.name, &now).await.map(|_| ()),
            self.secrets.delete(&self.name, &now).await.map(|_| ()),
        ] {
            match result {
                Ok(()) => {}
                Err(error) if is_status(&error, 404) => {}
                Err(error) => {
                    tracing::warn!(pod = %self.name, %error, "deleting a kernel's pod or secret failed")
                }
            }
        }
        if let Some((replicas, kernel_id)) = &self.lease {
            replicas.forget(kernel_id, &self.name).await;
        }
    }
}

/// Watches the pod until it runs: its address and the resource version to go on watching
/// from. Past `deadline` (or at once, for a reason that never clears by itself) the pod's
/// latest reason is the error.
async fn wait_running(
    pods: &Api<Pod>,
    name: &str,
    deadline: Duration,
) -> Result<(String, String), KubernetesError> {
    let mut why: Option<String> = None;
    let waited = tokio::time::timeout(deadline, async {
        let mut version = "0".to_owned();
        loop {
            let params = WatchParams::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(290);
            let mut events = pods
                .watch(&params, &version)
                .await
                .map_err(api_error(format!("watch the pod {name}")))?
                .boxed();
            while let Some(event) = events
                .try_next()
                .await
                .map_err(api_error(format!("watch the pod {name}")))?
            {
                let pod = match event {
                    WatchEvent::Added(pod) | WatchEvent::Modified(pod) => pod,
                    WatchEvent::Deleted(_) => {
                        return Err(KubernetesError::Ended(
                            "the pod was deleted while it started".to_owned(),
                        ))
                    }
                    WatchEvent::Bookmark(bookmark) => {
                        version = bookmark.metadata.resource_version;
                        continue;
                    }
                    // Too old a version: start over from the current state.
                    WatchEvent::Error(_) => {
                        version = "0".to_owned();
                        break;
                    }
                };
                if let Some(seen) = pod.metadata.resource_version.clone() {
                    version = seen;
                }
                match status::state(&pod) {
                    PodState::Running { ip } => return Ok((ip, version)),
                    PodState::Ended { why } => return Err(KubernetesError::Ended(why)),
                    PodState::Waiting { why: now } => {
                        if let Some(reason) = now.as_deref().filter(|r| status::hopeless(r)) {
                            return Err(KubernetesError::Ended(reason.to_owned()));
                        }
                        if now.is_some() {
                            why = now;
                        }
                    }
                }
            }
        }
    })
    .await;
    match waited {
        Ok(result) => result,
        Err(_) => Err(KubernetesError::Pending {
            timeout: deadline,
            why: why.unwrap_or_else(|| "no reason given by Kubernetes".to_owned()),
        }),
    }
}

/// Dials the pod's agent (it may take a moment to listen) and proves the key both ways.
async fn dial(ip: &str, key: &[u8], spec: &LaunchSpec) -> Result<Agent, KubernetesError> {
    let address = match ip.parse::<std::net::IpAddr>() {
        Ok(ip) => std::net::SocketAddr::new(ip, objects::AGENT_PORT),
        Err(_) => {
            return Err(KubernetesError::Ended(format!(
                "the pod's address {ip:?} is not an IP address"
            )))
        }
    };
    let dialed = tokio::time::timeout(DIAL_TIMEOUT, async {
        loop {
            match tokio::net::TcpStream::connect(address).await {
                Ok(tcp) => return tcp,
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
    .await
    .map_err(|_| {
        AgentError(format!(
            "nothing listens on {address} {DIAL_TIMEOUT:?} after the pod started"
        ))
    })?;
    let _ = dialed.set_nodelay(true);
    let proven = agent::prove(dialed, key, AGENT_TIMEOUT).await?;
    Ok(Agent::connect(proven, spec.egress_socket.clone(), AGENT_TIMEOUT).await?)
}

/// What `cellgate doctor` and readiness say of this backend: whether a configuration is
/// found and the API answers, listing kernel pods in its default namespace (which the
/// gateway's role must allow). Nothing is created.
pub async fn diagnose() -> Diagnosis {
    let mut diagnosis = Diagnosis::new("kubernetes");
    match client_from_environment().await {
        Err(error) => diagnosis.fail(
            error.to_string(),
            "run the gateway in the cluster with its ServiceAccount (deploy/kubernetes), or set KUBECONFIG",
        ),
        Ok((client, namespace)) => {
            diagnosis.fact("namespace", namespace.as_str());
            let pods: Api<Pod> = Api::namespaced(client, &namespace);
            let params = ListParams::default()
                .labels(&format!("{}={}", objects::LABEL_NAME, objects::KERNEL_POD_NAME))
                .limit(1);
            if let Err(error) = pods.list(&params).await {
                diagnosis.fail(
                    api_error(format!("list pods in {namespace}"))(error).to_string(),
                    "grant the gateway's ServiceAccount the Role in deploy/kubernetes/role.yaml",
                );
            }
        }
    }
    diagnosis
}
