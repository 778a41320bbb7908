//! One pod's life on the double's node, in the real order: scheduled (or Unschedulable),
//! volumes (waiting for a Secret that does not exist yet, as the kubelet retries the
//! mount), sandbox (network namespace, pod IP), image (ErrImagePull, then
//! ImagePullBackOff, for an image the double does not have), container start, readiness,
//! and the end: the container's exit, a graceful deletion (SIGTERM, SIGKILL after the
//! grace period, then the object goes), an eviction (the object stays, Failed/Evicted), or
//! removal. Each step is written to the pod's status (a watch event each) and, as the real
//! components do, recorded as Events.

use std::collections::HashSet;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::watch;

use super::super::cluster::{now, Cluster};
use super::super::resource::Resource;
use super::container::Container;
use super::network::Sandbox;
use super::spec::{self, Inputs, Problem};
use super::status::{self, set_condition, set_container, set_readiness, waiting};
use super::{Image, PodInfo, Signal, GRACE_CAP};

const INSUFFICIENT: &str = "0/1 nodes are available: 1 Insufficient memory.";
const NO_MATCH: &str =
    "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector.";

/// Why a pod's worker stopped driving it forward.
enum Stop {
    Signal(Signal),
    /// The container exited with this code.
    Exited(i32),
    /// The container could not start; its status says why.
    Failed,
    /// The object is gone.
    Gone,
}

pub struct Worker {
    pub cluster: Arc<Cluster>,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub signal: watch::Receiver<Signal>,
    pub info: Arc<Mutex<PodInfo>>,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    pub sandbox: Option<Sandbox>,
    pub container: Option<Container>,
}

/// The next signal other than `Run` (the current one if it is one).
async fn next_signal(signal: &mut watch::Receiver<Signal>) -> Signal {
    loop {
        let current = signal.borrow_and_update().clone();
        if current != Signal::Run {
            return current;
        }
        if signal.changed().await.is_err() {
            return Signal::Shutdown;
        }
    }
}

/// `future`'s output, unless a signal comes first.
async fn unless_signalled<T>(
    signal: &mut watch::Receiver<Signal>,
    future: impl Future<Output = T>,
) -> Result<T, Stop> {
    tokio::select! {
        biased;
        signal = next_signal(signal) => Err(Stop::Signal(signal)),
        out = future => Ok(out),
    }
}

impl Worker {
    pub async fn run(mut self) {
        let stop = self.drive().await;
        self.finish(stop).await;
    }

    fn pod(&self) -> Option<Value> {
        self.cluster
            .get(Resource::Pods, &self.namespace, &self.name)
            .filter(|pod| pod["metadata"]["uid"] == self.uid.as_str())
    }

    fn container_json(&self) -> Value {
        self.pod()
            .map(|pod| pod["spec"]["containers"][0].clone())
            .unwrap_or(Value::Null)
    }

    fn container_name(&self) -> String {
        self.container_json()["name"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }

    fn container_id(&self) -> String {
        format!("cellgate-kube-api://{}", self.uid.replace('-', ""))
    }

    fn update(&self, change: impl FnOnce(&mut Value)) {
        self.cluster.mutate(
            Resource::Pods,
            &self.namespace,
            &self.name,
            &self.uid,
            change,
        );
    }

    fn update_status(&self, change: impl FnOnce(&mut Value)) {
        self.update(|pod| change(&mut pod["status"]));
    }

    fn event(&self, component: &str, kind: &str, reason: &str, message: &str) {
        if let Some(pod) = self.pod() {
            self.cluster
                .record_event(&pod, component, kind, reason, message);
        }
    }

    async fn drive(&mut self) -> Stop {
        if self.pod().is_none() {
            return Stop::Gone;
        }
        if let Err(stop) = self.schedule().await {
            return stop;
        }
        if let Err(stop) = self.wait_for_volumes().await {
            return stop;
        }
        if let Err(stop) = self.make_sandbox().await {
            return stop;
        }
        let image = match self.pull().await {
            Ok(image) => image,
            Err(stop) => return stop,
        };
        if let Err(stop) = self.start(&image).await {
            return stop;
        }
        self.supervise().await
    }

    /// The scheduler: one node, which fits the pod unless the test says it does not or
    /// the pod's nodeSelector names other labels.
    async fn schedule(&mut self) -> Result<(), Stop> {
        let cluster = self.cluster.clone();
        let kubelet = &cluster.kubelet;
        let mut schedulable = kubelet.schedulable.subscribe();
        let mut reported: Option<&str> = None;
        loop {
            let pod = self.pod().ok_or(Stop::Gone)?;
            let open = *schedulable.borrow_and_update();
            let blocker = if !open {
                Some(INSUFFICIENT)
            } else if !node_selector_matches(&pod, kubelet.node_name()) {
                Some(NO_MATCH)
            } else {
                None
            };
            let Some(message) = blocker else {
                break;
            };
            if reported != Some(message) {
                self.update_status(|s| {
                    s["phase"] = json!("Pending");
                    set_condition(
                        s,
                        "PodScheduled",
                        false,
                        Some("Unschedulable"),
                        Some(message),
                    );
                });
                self.event("default-scheduler", "Warning", "FailedScheduling", message);
                reported = Some(message);
            }
            let _ = unless_signalled(&mut self.signal, schedulable.changed()).await?;
        }
        let node = kubelet.node_name().to_owned();
        self.update(|pod| {
            pod["spec"]["nodeName"] = json!(node);
            set_condition(&mut pod["status"], "PodScheduled", true, None, None);
        });
        self.event(
            "default-scheduler",
            "Normal",
            "Scheduled",
            &format!(
                "Successfully assigned {}/{} to {node}",
                self.namespace, self.name
            ),
        );
        let container = self.container_json();
        let name = self.container_name();
        self.update_status(|s| {
            s["phase"] = json!("Pending");
            s["startTime"] = json!(now());
            set_condition(s, "PodReadyToStartContainers", false, None, None);
            set_condition(s, "Initialized", true, None, None);
            set_readiness(s, false, &name, "ContainersNotReady");
            set_container(
                s,
                &container,
                waiting("ContainerCreating", None),
                false,
                None,
            );
        });
        Ok(())
    }

    /// Secret volumes wait for their Secret, as the kubelet retries a failed mount.
    async fn wait_for_volumes(&mut self) -> Result<(), Stop> {
        let mut version = self.cluster.store.lock().version();
        let mut reported = HashSet::new();
        loop {
            let pod = self.pod().ok_or(Stop::Gone)?;
            let missing: Vec<(String, String)> = pod["spec"]["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|v| v["secret"].is_object() && v["secret"]["optional"] != true)
                .filter_map(|v| {
                    let secret = v["secret"]["secretName"].as_str().unwrap_or("");
                    let exists = self
                        .cluster
                        .get(Resource::Secrets, &self.namespace, secret)
                        .is_some();
                    (!exists).then(|| {
                        (
                            v["name"].as_str().unwrap_or("").to_owned(),
                            secret.to_owned(),
                        )
                    })
                })
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            for (volume, secret) in missing {
                if reported.insert(volume.clone()) {
                    self.event(
                        "kubelet",
                        "Warning",
                        "FailedMount",
                        &format!("MountVolume.SetUp failed for volume \"{volume}\" : secret \"{secret}\" not found"),
                    );
                }
            }
            let _ = unless_signalled(&mut self.signal, version.changed()).await?;
        }
    }

    async fn make_sandbox(&mut self) -> Result<(), Stop> {
        let cluster = self.cluster.clone();
        match cluster.kubelet.network.create().await {
            Ok(sandbox) => {
                {
                    let mut info = self.info.lock();
                    info.netns = Some(sandbox.netns.clone());
                    info.pod_ip = Some(sandbox.pod_ip);
                }
                let (pod_ip, host_ip) = (sandbox.pod_ip.to_string(), sandbox.host_ip.to_string());
                self.sandbox = Some(sandbox);
                self.update_status(|s| {
                    s["podIP"] = json!(pod_ip);
                    s["podIPs"] = json!([{"ip": pod_ip}]);
                    s["hostIP"] = json!(host_ip);
                    s["hostIPs"] = json!([{"ip": host_ip}]);
                    set_condition(s, "PodReadyToStartContainers", true, None, None);
                });
                Ok(())
            }
            Err(err) => {
                eprintln!("kube_api: pod {}/{}: {err}", self.namespace, self.name);
                self.event(
                    "kubelet",
                    "Warning",
                    "FailedCreatePodSandBox",
                    &format!("Failed to create pod sandbox: {err}"),
                );
                unless_signalled(&mut self.signal, std::future::pending::<()>()).await?;
                Err(Stop::Gone)
            }
        }
    }

    async fn pull(&mut self) -> Result<Image, Stop> {
        let container = self.container_json();
        let image_name = container["image"].as_str().unwrap_or("").to_owned();
        let image = self.cluster.kubelet.images.lock().get(&image_name).cloned();
        if let Some(image) = image {
            self.event(
                "kubelet",
                "Normal",
                "Pulled",
                &format!("Container image \"{image_name}\" already present on machine"),
            );
            return Ok(image);
        }
        self.event(
            "kubelet",
            "Normal",
            "Pulling",
            &format!("Pulling image \"{image_name}\""),
        );
        let message = format!(
            "failed to pull and unpack image \"{image_name}\": not found (the kube_api test double's images do not include it)"
        );
        self.update_status(|s| {
            set_container(
                s,
                &container,
                waiting("ErrImagePull", Some(&message)),
                false,
                None,
            );
        });
        self.event(
            "kubelet",
            "Warning",
            "Failed",
            &format!("Failed to pull image \"{image_name}\": {message}"),
        );
        self.event("kubelet", "Warning", "Failed", "Error: ErrImagePull");
        unless_signalled(
            &mut self.signal,
            tokio::time::sleep(Duration::from_millis(300)),
        )
        .await?;
        let back_off = format!("Back-off pulling image \"{image_name}\"");
        self.update_status(|s| {
            set_container(
                s,
                &container,
                waiting("ImagePullBackOff", Some(&back_off)),
                false,
                None,
            );
        });
        self.event("kubelet", "Normal", "BackOff", &back_off);
        self.event("kubelet", "Warning", "Failed", "Error: ImagePullBackOff");
        unless_signalled(&mut self.signal, std::future::pending::<()>()).await?;
        Err(Stop::Gone)
    }

    /// Builds and starts the container; retries a configuration error (a missing secret
    /// key) when the API's objects change, as the kubelet does.
    async fn start(&mut self, image: &Image) -> Result<(), Stop> {
        let mut version = self.cluster.store.lock().version();
        let mut reported: Option<String> = None;
        loop {
            let pod = self.pod().ok_or(Stop::Gone)?;
            let container = pod["spec"]["containers"][0].clone();
            let account = pod["spec"]["serviceAccountName"]
                .as_str()
                .unwrap_or("default");
            let token = format!(
                "kube-api-double.serviceaccount.{}.{account}",
                self.namespace
            );
            self.cluster.auth.write().add(
                &token,
                &format!("system:serviceaccount:{}:{account}", self.namespace),
                vec![],
            );
            if let Err(err) = std::fs::create_dir_all(&self.state_dir) {
                return Err(self
                    .cannot_create(&container, &format!("{}: {err}", self.state_dir.display()))
                    .await);
            }
            let sandbox = self.sandbox.clone().ok_or(Stop::Gone)?;
            let cluster = self.cluster.clone();
            let namespace = self.namespace.clone();
            let secret = move |name: &str| cluster.get(Resource::Secrets, &namespace, name);
            let built = spec::build(&Inputs {
                pod: &pod,
                image,
                sandbox: &sandbox,
                state_dir: &self.state_dir,
                node_name: self.cluster.kubelet.node_name(),
                service_account_token: &token,
                secret: &secret,
            });
            let spec = match built {
                Ok(spec) => spec,
                Err(Problem::Config(message)) => {
                    if reported.as_deref() != Some(message.as_str()) {
                        self.update_status(|s| {
                            let state = waiting("CreateContainerConfigError", Some(&message));
                            set_container(s, &container, state, false, None);
                        });
                        self.event("kubelet", "Warning", "Failed", &format!("Error: {message}"));
                        reported = Some(message);
                    }
                    let _ = unless_signalled(&mut self.signal, version.changed()).await?;
                    continue;
                }
                Err(Problem::Create(message)) => {
                    return Err(self.cannot_create(&container, &message).await);
                }
                Err(Problem::Start(message)) => {
                    self.fail_start(&container, &message);
                    return Err(Stop::Failed);
                }
            };
            let started = match Container::start(&spec, &self.log) {
                Ok(started) => started,
                Err(message) => return Err(self.cannot_create(&container, &message).await),
            };
            let started = self.container.insert(started);
            match unless_signalled(&mut self.signal, started.wait_started()).await? {
                Ok(()) => {}
                Err(code) => {
                    let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(5).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    self.fail_start(
                        &container,
                        &format!(
                            "the container's setup failed (exit {code}): {}",
                            tail.join(" | ")
                        ),
                    );
                    return Err(Stop::Failed);
                }
            }
            self.info.lock().pid = self.container.as_ref().and_then(Container::pid);
            let name = container["name"].as_str().unwrap_or("").to_owned();
            self.event(
                "kubelet",
                "Normal",
                "Created",
                &format!("Created container: {name}"),
            );
            self.event(
                "kubelet",
                "Normal",
                "Started",
                &format!("Started container {name}"),
            );
            let ready = container["readinessProbe"].is_null();
            let id = self.container_id();
            self.update_status(|s| {
                s["phase"] = json!("Running");
                set_container(s, &container, status::running(&now()), ready, Some(&id));
                set_readiness(s, ready, &name, "ContainersNotReady");
            });
            return Ok(());
        }
    }

    /// CreateContainerError: the double cannot build this container (said loudly); the
    /// pod stays Pending until it is deleted.
    async fn cannot_create(&mut self, container: &Value, message: &str) -> Stop {
        eprintln!("kube_api: pod {}/{}: {message}", self.namespace, self.name);
        self.update_status(|s| {
            let state = waiting("CreateContainerError", Some(message));
            set_container(s, container, state, false, None);
        });
        self.event("kubelet", "Warning", "Failed", &format!("Error: {message}"));
        match unless_signalled(&mut self.signal, std::future::pending::<()>()).await {
            Err(stop) => stop,
            Ok(()) => Stop::Gone,
        }
    }

    /// The runtime could not start the entrypoint: terminated, exit code 128, Failed.
    fn fail_start(&self, container: &Value, message: &str) {
        let name = container["name"].as_str().unwrap_or("").to_owned();
        let id = self.container_id();
        self.update_status(|s| {
            s["phase"] = json!("Failed");
            let state = status::terminated(128, "StartError", Some(message), None, Some(&id));
            set_container(s, container, state, false, Some(&id));
            set_readiness(s, false, &name, "PodFailed");
        });
        self.event("kubelet", "Warning", "Failed", &format!("Error: {message}"));
    }

    /// A running container: until it exits or a signal comes, with its readiness probe.
    async fn supervise(&mut self) -> Stop {
        let container = self.container_json();
        let name = self.container_name();
        let probe = &container["readinessProbe"];
        let port = probe["tcpSocket"]["port"].as_i64();
        let seconds = |field: &str, default: i64| {
            Duration::from_secs(probe[field].as_i64().unwrap_or(default).max(0) as u64)
        };
        let period = seconds("periodSeconds", 10).max(Duration::from_secs(1));
        let timeout = seconds("timeoutSeconds", 1).max(Duration::from_secs(1));
        let threshold = probe["failureThreshold"].as_i64().unwrap_or(3);
        let pod_ip = self.sandbox.as_ref().map(|s| s.pod_ip);
        let mut ready = port.is_none();
        let mut failures = 0;
        let mut next_probe = tokio::time::Instant::now() + seconds("initialDelaySeconds", 0);
        enum Next {
            Exited(i32),
            Signal(Signal),
            Probe,
        }
        loop {
            let next = {
                let Some(process) = self.container.as_mut() else {
                    return Stop::Gone;
                };
                tokio::select! {
                    code = process.wait() => Next::Exited(code),
                    signal = next_signal(&mut self.signal) => Next::Signal(signal),
                    () = tokio::time::sleep_until(next_probe), if port.is_some() => Next::Probe,
                }
            };
            match next {
                Next::Exited(code) => return Stop::Exited(code),
                Next::Signal(signal) => return Stop::Signal(signal),
                Next::Probe => {
                    next_probe += period;
                    let (Some(ip), Some(port)) = (pod_ip, port) else {
                        continue;
                    };
                    let connect = tokio::net::TcpStream::connect((ip, port as u16));
                    let ok = matches!(tokio::time::timeout(timeout, connect).await, Ok(Ok(_)));
                    let was = ready;
                    if ok {
                        failures = 0;
                        ready = true;
                    } else {
                        failures += 1;
                        if failures >= threshold {
                            ready = false;
                        }
                    }
                    if ready != was {
                        let id = self.container_id();
                        let started = self
                            .pod()
                            .and_then(|p| status::started_at(&p["status"]))
                            .unwrap_or_else(now);
                        self.update_status(|s| {
                            set_container(
                                s,
                                &container,
                                status::running(&started),
                                ready,
                                Some(&id),
                            );
                            set_readiness(s, ready, &name, "ContainersNotReady");
                        });
                    }
                }
            }
        }
    }

    async fn finish(mut self, stop: Stop) {
        match stop {
            Stop::Exited(code) => {
                self.record_exit(code);
                self.teardown().await;
                self.after_terminal().await;
            }
            Stop::Failed => {
                self.teardown().await;
                self.after_terminal().await;
            }
            Stop::Signal(Signal::Delete { grace }) => {
                if let Some(code) = self.stop_container(grace).await {
                    self.record_exit(code);
                }
                self.teardown().await;
                self.await_removal().await;
            }
            Stop::Signal(Signal::Evict(message)) => {
                // As the kubelet's SyncTerminatingPod: the status first, then the kill,
                // then the container's final state.
                self.record_eviction(&message);
                if let Some(code) = self.stop_container(0).await {
                    self.record_killed_container(code);
                }
                self.teardown().await;
                self.after_terminal().await;
            }
            Stop::Signal(Signal::Removed | Signal::Shutdown | Signal::Run) | Stop::Gone => {
                self.stop_container(0).await;
                self.teardown().await;
            }
        }
    }

    /// SIGTERM, then SIGKILL after the grace period (at most [`GRACE_CAP`]); the exit code,
    /// if a container ran.
    async fn stop_container(&mut self, grace: i64) -> Option<i32> {
        self.container.as_ref()?;
        if grace > 0 {
            let name = self.container_name();
            self.event(
                "kubelet",
                "Normal",
                "Killing",
                &format!("Stopping container {name}"),
            );
        }
        let process = self.container.as_mut()?;
        if grace > 0 {
            process.terminate();
            let limit = Duration::from_secs(grace as u64).min(GRACE_CAP);
            if let Ok(code) = tokio::time::timeout(limit, process.wait()).await {
                return Some(code);
            }
        }
        process.kill();
        Some(process.wait().await)
    }

    fn record_exit(&self, code: i32) {
        let container = self.container_json();
        let name = self.container_name();
        let id = self.container_id();
        let started = self.pod().and_then(|p| status::started_at(&p["status"]));
        let (reason, phase, why) = if code == 0 {
            ("Completed", "Succeeded", "PodCompleted")
        } else {
            ("Error", "Failed", "PodFailed")
        };
        self.update_status(|s| {
            s["phase"] = json!(phase);
            let state = status::terminated(code, reason, None, started.as_deref(), Some(&id));
            set_container(s, &container, state, false, Some(&id));
            set_readiness(s, false, &name, why);
            set_condition(s, "PodReadyToStartContainers", false, None, None);
        });
    }

    fn record_eviction(&self, message: &str) {
        let name = self.container_name();
        self.update_status(|s| {
            s["phase"] = json!("Failed");
            s["reason"] = json!("Evicted");
            s["message"] = json!(message);
            set_condition(
                s,
                "DisruptionTarget",
                true,
                Some("TerminationByKubelet"),
                Some(message),
            );
            set_readiness(s, false, &name, "PodFailed");
        });
        self.event("kubelet", "Warning", "Evicted", message);
    }

    /// A container the kubelet killed: terminated, its exit code, the phase kept.
    fn record_killed_container(&self, code: i32) {
        let container = self.container_json();
        let id = self.container_id();
        let started = self.pod().and_then(|p| status::started_at(&p["status"]));
        self.update_status(|s| {
            let state = status::terminated(code, "Error", None, started.as_deref(), Some(&id));
            set_container(s, &container, state, false, Some(&id));
            set_condition(s, "PodReadyToStartContainers", false, None, None);
        });
    }

    async fn teardown(&mut self) {
        if let Some(sandbox) = self.sandbox.take() {
            self.cluster.kubelet.network.destroy(&sandbox).await;
        }
        let mut info = self.info.lock();
        info.netns = None;
        info.pid = None;
    }

    /// A finished pod stays until it is deleted.
    async fn after_terminal(&mut self) {
        loop {
            let current = self.signal.borrow_and_update().clone();
            match current {
                Signal::Delete { .. } => {
                    self.await_removal().await;
                    return;
                }
                Signal::Removed | Signal::Shutdown => return,
                Signal::Run | Signal::Evict(_) => {
                    if self.signal.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// The kubelet's final delete: the object goes once no finalizer holds it.
    async fn await_removal(&mut self) {
        let mut version = self.cluster.store.lock().version();
        loop {
            self.cluster
                .finish_pod_deletion(&self.namespace, &self.name, &self.uid);
            if self.pod().is_none() {
                return;
            }
            tokio::select! {
                changed = version.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                changed = self.signal.changed() => {
                    let current = self.signal.borrow_and_update().clone();
                    if changed.is_err() || matches!(current, Signal::Removed | Signal::Shutdown) {
                        return;
                    }
                }
            }
        }
    }
}

fn node_selector_matches(pod: &Value, node: &str) -> bool {
    let labels = [
        ("kubernetes.io/hostname", node),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", kube_arch()),
    ];
    pod["spec"]["nodeSelector"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(key, value)| labels.iter().any(|(k, v)| k == key && value == *v))
}

/// The node's `kubernetes.io/arch` label (Go's names).
fn kube_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}
