//! The double's node: a scheduler and a kubelet in one, which run each pod the API accepts
//! as a real process tree on this machine (see `worker` for a pod's life, `container` for
//! how its process is started, `network` and `rootfs` for what it sees), and report it in
//! the pod's status as the real ones do, so the gateway's pod-watching code meets the
//! states, reasons and orderings of a real cluster.

mod container;
mod network;
mod rootfs;
mod spec;
mod status;
mod worker;

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::cluster::Cluster;

pub use network::netns_exists;

/// What a container image is in the double: host paths bound (read-only) into the
/// container's root at their container paths, over the host system directories every
/// container sees, plus the image config's entrypoint, cmd, env, working directory and
/// user.
#[derive(Debug, Clone, Default)]
pub struct Image {
    /// (container path, host path).
    pub binds: Vec<(String, PathBuf)>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<(String, String)>,
    pub workdir: Option<String>,
    /// The image's USER (None: root).
    pub user: Option<u32>,
}

impl Image {
    /// An image that is the host's system directories alone (enough for `/usr/bin/python3`).
    pub fn new() -> Image {
        Image::default()
    }

    /// Adds a bind of a host file or directory at a container path.
    pub fn bind(mut self, container_path: &str, host_path: impl AsRef<Path>) -> Image {
        self.binds
            .push((container_path.to_owned(), host_path.as_ref().to_owned()));
        self
    }

    pub fn entrypoint(mut self, argv: &[&str]) -> Image {
        self.entrypoint = argv.iter().map(|s| (*s).to_owned()).collect();
        self
    }

    pub fn env(mut self, name: &str, value: &str) -> Image {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// What the control plane tells a pod's worker.
#[derive(Debug, Clone, PartialEq)]
pub enum Signal {
    Run,
    /// Graceful deletion (the object has its deletionTimestamp).
    Delete {
        grace: i64,
    },
    /// Node-pressure eviction with this message.
    Evict(String),
    /// The object is gone (deleted with grace 0): stop at once.
    Removed,
    /// The double is going away.
    Shutdown,
}

/// What a test can see of a running pod.
#[derive(Debug, Clone, Default)]
pub struct PodInfo {
    pub netns: Option<String>,
    /// The host pid of the container's pid 1.
    pub pid: Option<u32>,
    pub pod_ip: Option<Ipv4Addr>,
}

struct PodEntry {
    namespace: String,
    name: String,
    signal: watch::Sender<Signal>,
    task: Option<JoinHandle<()>>,
    info: Arc<Mutex<PodInfo>>,
}

/// The longest grace period the double waits before SIGKILL.
pub const GRACE_CAP: Duration = Duration::from_secs(5);

pub struct Kubelet {
    node_name: String,
    dir: PathBuf,
    images: Mutex<HashMap<String, Image>>,
    schedulable: watch::Sender<bool>,
    pods: Mutex<HashMap<String, PodEntry>>,
    logs: Mutex<HashMap<(String, String), PathBuf>>,
    network: network::Network,
}

impl Kubelet {
    /// `dir`: the double's state directory; `double`: tells apart the doubles of a process.
    pub fn new(dir: &Path, double: u64, images: HashMap<String, Image>) -> Kubelet {
        network::Network::remove_stale();
        Kubelet {
            node_name: "cellgate-test-node".to_owned(),
            dir: dir.to_owned(),
            images: Mutex::new(images),
            schedulable: watch::channel(true).0,
            pods: Mutex::new(HashMap::new()),
            logs: Mutex::new(HashMap::new()),
            network: network::Network::new(double),
        }
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    pub fn add_image(&self, name: &str, image: Image) {
        self.images.lock().insert(name.to_owned(), image);
    }

    pub fn set_schedulable(&self, schedulable: bool) {
        self.schedulable.send_replace(schedulable);
    }

    /// The log of the latest pod of that name.
    pub fn log_path(&self, namespace: &str, name: &str) -> Option<PathBuf> {
        self.logs
            .lock()
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// (namespace, name) of every pod that has a log.
    pub fn logged_pods(&self) -> Vec<(String, String)> {
        self.logs.lock().keys().cloned().collect()
    }

    /// What the worker of the pod with this uid has made.
    pub fn pod_info(&self, uid: &str) -> Option<PodInfo> {
        self.pods.lock().get(uid).map(|e| e.info.lock().clone())
    }

    /// A new pod: its worker starts (scheduling first).
    pub fn pod_created(&self, cluster: &Arc<Cluster>, pod: &Value) {
        let metadata = &pod["metadata"];
        let uid = metadata["uid"].as_str().unwrap_or("").to_owned();
        let namespace = metadata["namespace"].as_str().unwrap_or("").to_owned();
        let name = metadata["name"].as_str().unwrap_or("").to_owned();
        let log = self
            .dir
            .join("logs")
            .join(format!("{namespace}_{name}_{uid}.log"));
        if let Some(parent) = log.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::write(&log, b"");
        self.logs
            .lock()
            .insert((namespace.clone(), name.clone()), log.clone());
        let (signal, receiver) = watch::channel(Signal::Run);
        let info = Arc::new(Mutex::new(PodInfo::default()));
        let worker = worker::Worker {
            cluster: cluster.clone(),
            namespace: namespace.clone(),
            name: name.clone(),
            uid: uid.clone(),
            signal: receiver,
            info: info.clone(),
            state_dir: self.dir.join("pods").join(&uid),
            log,
            sandbox: None,
            container: None,
        };
        let task = cluster.runtime.spawn(worker.run());
        self.pods.lock().insert(
            uid,
            PodEntry {
                namespace,
                name,
                signal,
                task: Some(task),
                info,
            },
        );
    }

    fn send(&self, uid: &str, signal: Signal) {
        if let Some(entry) = self.pods.lock().get(uid) {
            entry.signal.send_if_modified(|current| {
                // Removal and shutdown win over anything; a deletion over an eviction.
                let stronger = match (&*current, &signal) {
                    (Signal::Removed | Signal::Shutdown, _) => false,
                    (Signal::Delete { .. }, Signal::Evict(_)) => false,
                    (a, b) => a != b,
                };
                if stronger {
                    *current = signal.clone();
                }
                stronger
            });
        }
    }

    pub fn pod_deleting(&self, uid: &str, grace: i64) {
        self.send(uid, Signal::Delete { grace });
    }

    pub fn pod_removed(&self, uid: &str) {
        self.send(uid, Signal::Removed);
    }

    /// Evicts the pod of that uid (asynchronously).
    pub fn evict(&self, uid: &str, message: &str) {
        self.send(uid, Signal::Evict(message.to_owned()));
    }

    /// Stops every pod and waits for their workers (processes killed, namespaces gone).
    pub async fn shutdown(&self) {
        let tasks: Vec<JoinHandle<()>> = {
            let mut pods = self.pods.lock();
            pods.values_mut()
                .filter_map(|entry| {
                    entry.signal.send_replace(Signal::Shutdown);
                    entry.task.take()
                })
                .collect()
        };
        for task in tasks {
            if tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .is_err()
            {
                eprintln!("kube_api: a pod worker did not stop within 10 s");
            }
        }
        self.network.destroy_all_now();
    }
}
