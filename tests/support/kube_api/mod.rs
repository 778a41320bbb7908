//! A test double of the Kubernetes API server and of one node, for testing the gateway's
//! `kubernetes` backend where there is no cluster (CI, developers' machines).
//!
//! Why a double and not a mock: the gateway's Kubernetes code is only as right as what it
//! was tested against, so the double enforces what the real API server enforces and
//! answers as it answers: typed objects (k8s-openapi's types decode every write), real
//! paths, verbs, status codes and `Status` bodies, resourceVersions and optimistic
//! concurrency, watches with history and 410 Expired, label and field selectors,
//! bearer-token authentication and RBAC with Kubernetes' own messages, admission
//! defaults, garbage collection by ownerReferences, graceful pod deletion. And its node
//! really runs pods: each in its own network namespace with a pod IP the host can reach,
//! its own pid, mount, UTS and IPC namespaces with the entrypoint as pid 1, the
//! securityContext's user and capabilities, and its volumes; the pod's status follows
//! as a kubelet writes it.
//!
//! Where it differs from a real cluster, it says so: what it cannot model faithfully is
//! refused with a 400 naming the double (printed on stderr too), never silently
//! accepted. Known differences that are not refused:
//! - one node; no Namespace, Node, ServiceAccount, ConfigMap or RuntimeClass objects (the
//!   namespaces and runtime classes are [`Options`]); any serviceAccountName is accepted;
//! - a container's root is the host's `/usr`, `/etc` and `/bin`, `/lib`… (read-only) on a
//!   fresh tmpfs, plus the image's binds (read-only): an image is what [`Image`] says, not
//!   a registry's layers;
//! - resources (requests, limits), seccomp, AppArmor, SELinux, sysctls, affinity and
//!   tolerations are stored but not enforced; NetworkPolicies are stored but not
//!   enforced (a pod reaches only its host end anyway); Pod Security admission checks
//!   only host namespaces, privileged, and (restricted) allowPrivilegeEscalation,
//!   capabilities, runAsNonRoot, runAsUser=0 and seccompProfile, in the namespaces
//!   [`Options::pod_security`] names;
//! - no managedFields, generation or server-side apply; strategic merge patches are
//!   refused; lists past their first page show objects as they are now;
//! - a request without a token is 401 (a cluster with anonymous auth says 403 to
//!   `system:anonymous`);
//! - the kubelet retries a missing Secret on every API change (a real one backs off, so
//!   it can take seconds); grace periods are capped at 5 s;
//! - hostIP is the pod's own host end of its veth pair (10.244.x.y), not a node address.
//!
//! It needs root (namespaces, mounts, veths) and panics without it.

#![allow(dead_code)]

mod admission;
mod auth;
mod cluster;
mod gc;
mod http;
mod kubelet;
mod patch;
mod resource;
mod selector;
mod status;
mod store;
mod validation;
mod verbs;
mod watch;

use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use serde_json::Value;

pub use auth::Rule;
pub use cluster::RequestRecord;
pub use kubelet::{netns_exists, Image};

use auth::Auth;
use cluster::Cluster;
use kubelet::Kubelet;
use resource::Resource;
use selector::Filter;
use store::Store;

/// How the double starts.
#[derive(Debug, Clone)]
pub struct Options {
    /// The namespaces that exist (the kubeconfig's namespace is added).
    pub namespaces: Vec<String>,
    /// The kubeconfig context's namespace.
    pub namespace: String,
    /// The images the node has, by the name a pod's `image` gives.
    pub images: HashMap<String, Image>,
    /// RuntimeClasses that exist (pods naming another are refused, as by admission).
    pub runtime_classes: Vec<String>,
    /// Pod Security admission's enforced level by namespace (`baseline`, `restricted`), as
    /// the namespace's `pod-security.kubernetes.io/enforce` label sets it.
    pub pod_security: HashMap<String, String>,
    /// How many changes watches can resume from (older: 410 Expired).
    pub event_history: usize,
    /// How often a watch that allows bookmarks gets one.
    pub bookmark_interval: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            namespaces: vec!["default".to_owned()],
            namespace: "default".to_owned(),
            images: HashMap::new(),
            runtime_classes: vec![],
            pod_security: HashMap::new(),
            event_history: 1000,
            bookmark_interval: Duration::from_secs(60),
        }
    }
}

impl Options {
    /// The kubeconfig's namespace (created).
    pub fn namespace(mut self, namespace: &str) -> Options {
        self.namespace = namespace.to_owned();
        self
    }

    /// Enforces a Pod Security level (`baseline`, `restricted`) in a namespace.
    pub fn pod_security(mut self, namespace: &str, level: &str) -> Options {
        self.pod_security
            .insert(namespace.to_owned(), level.to_owned());
        self
    }

    pub fn image(mut self, name: &str, image: Image) -> Options {
        self.images.insert(name.to_owned(), image);
        self
    }
}

/// Distinguishes the doubles of one test process (in names of network namespaces).
static DOUBLES: AtomicU64 = AtomicU64::new(0);

/// A running double: an API server on 127.0.0.1 and a node, on their own thread and
/// runtime (so neither depends on the test's runtime flavour); dropped, it stops every
/// pod and removes what it made.
pub struct KubeApi {
    cluster: Arc<Cluster>,
    url: String,
    admin_token: String,
    kubeconfig: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    dir: tempfile::TempDir,
}

fn require_root_and_tools() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the kube_api test double runs pods in namespaces, mounts and veth pairs it makes: it needs root (run the tests as root)"
    );
    for tool in ["ip", "unshare", "nsenter", "setpriv", "mount", "pivot_root"] {
        let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
            .iter()
            .any(|dir| Path::new(dir).join(tool).exists());
        assert!(
            found,
            "the kube_api test double needs `{tool}` (iproute2, util-linux)"
        );
    }
}

/// Removes state directories of test processes that died.
fn remove_stale_dirs() {
    for entry in std::fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("cellgate-kube-api-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn random_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl KubeApi {
    /// Starts a double (synchronously: the server runs on its own thread).
    pub async fn start(options: Options) -> KubeApi {
        KubeApi::start_blocking(options)
    }

    pub fn start_blocking(options: Options) -> KubeApi {
        require_root_and_tools();
        remove_stale_dirs();
        let dir = tempfile::Builder::new()
            .prefix(&format!("cellgate-kube-api-{}-", std::process::id()))
            .tempdir()
            .expect("a temporary directory for the double's state");
        let double = DOUBLES.fetch_add(1, Ordering::Relaxed);
        let mut namespaces: BTreeSet<String> = options.namespaces.iter().cloned().collect();
        namespaces.insert(options.namespace.clone());
        let admin_token = random_token();
        let mut auth = Auth::default();
        auth.add(&admin_token, "kubernetes-admin", vec![Rule::everything()]);

        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(Arc<Cluster>, SocketAddr)>();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let state_dir = dir.path().to_owned();
        let thread = std::thread::Builder::new()
            .name(format!("kube-api-double-{double}"))
            .spawn(move || {
                // A current-thread runtime: every pod process is forked by this thread,
                // whose end is what their death signal follows.
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the double's runtime");
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                        .await
                        .expect("a port for the double's API");
                    let address = listener.local_addr().expect("the listener's address");
                    let cluster = Arc::new(Cluster {
                        store: Mutex::new(Store::new(options.event_history)),
                        auth: RwLock::new(auth),
                        namespaces: RwLock::new(namespaces),
                        runtime_classes: options.runtime_classes.clone(),
                        pod_security: options.pod_security.clone(),
                        requests: Mutex::new(vec![]),
                        watch_events_sent: AtomicU64::new(0),
                        bookmark_interval: options.bookmark_interval,
                        kubelet: Kubelet::new(&state_dir, double, options.images.clone()),
                        runtime: tokio::runtime::Handle::current(),
                    });
                    if ready_tx.send((cluster.clone(), address)).is_err() {
                        return;
                    }
                    let stop = async {
                        let _ = stop_rx.await;
                    };
                    http::serve_until(cluster.clone(), listener, stop).await;
                    cluster.kubelet.shutdown().await;
                });
            })
            .expect("the double's thread");
        let (cluster, address) = ready_rx
            .recv()
            .expect("the double's thread starts its server");
        let url = format!("http://{address}");
        let kubeconfig = dir.path().join("kubeconfig");
        write_kubeconfig(&kubeconfig, &url, &admin_token, &options.namespace);
        KubeApi {
            cluster,
            url,
            admin_token,
            kubeconfig,
            stop: Some(stop_tx),
            thread: Some(thread),
            dir,
        }
    }

    /// A kubeconfig for the admin (context namespace: [`Options::namespace`]).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Writes a kubeconfig for another token (e.g. a user of [`KubeApi::add_user`]).
    pub fn kubeconfig_for(&self, token: &str, namespace: &str) -> PathBuf {
        let path = self
            .dir
            .path()
            .join(format!("kubeconfig-{}", random_token()));
        write_kubeconfig(&path, &self.url, token, namespace);
        path
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// A kube client for the admin kubeconfig.
    pub async fn client(&self) -> kube::Client {
        self.client_for(&self.kubeconfig).await
    }

    /// A kube client for a kubeconfig file.
    pub async fn client_for(&self, kubeconfig: &Path) -> kube::Client {
        let config =
            kube::config::Kubeconfig::read_from(kubeconfig).expect("the double's kubeconfig reads");
        let config = kube::Config::from_custom_kubeconfig(config, &Default::default())
            .await
            .expect("kube accepts the double's kubeconfig");
        kube::Client::try_from(config).expect("a kube client for the double")
    }

    /// A user whose `token` authenticates as `subject` (e.g.
    /// `system:serviceaccount:ns:name`) with only these rules.
    pub fn add_user(&self, token: &str, subject: &str, rules: Vec<Rule>) {
        self.cluster.auth.write().add(token, subject, rules);
    }

    pub fn add_namespace(&self, namespace: &str) {
        self.cluster.namespaces.write().insert(namespace.to_owned());
    }

    pub fn add_image(&self, name: &str, image: Image) {
        self.cluster.kubelet.add_image(name, image);
    }

    /// An object as stored (`kind_plural`: pods, secrets, events, networkpolicies, leases).
    pub fn object(&self, kind_plural: &str, namespace: &str, name: &str) -> Option<Value> {
        self.cluster.get(resource(kind_plural), namespace, name)
    }

    /// The objects of a kind in a namespace.
    pub fn objects(&self, kind_plural: &str, namespace: &str) -> Vec<Value> {
        let filter = Filter {
            namespace: Some(namespace.to_owned()),
            ..Filter::default()
        };
        self.cluster
            .store
            .lock()
            .list(resource(kind_plural), &filter)
    }

    /// The pod's container output so far (stdout and stderr, with the setup's errors).
    pub fn pod_log(&self, namespace: &str, name: &str) -> String {
        self.cluster
            .kubelet
            .log_path(namespace, name)
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default()
    }

    fn pod_info(&self, namespace: &str, name: &str) -> Option<kubelet::PodInfo> {
        let pod = self.object("pods", namespace, name)?;
        self.cluster
            .kubelet
            .pod_info(pod["metadata"]["uid"].as_str().unwrap_or(""))
    }

    /// The running pod's network namespace (`ip netns` name).
    pub fn pod_netns(&self, namespace: &str, name: &str) -> Option<String> {
        self.pod_info(namespace, name)?.netns
    }

    /// The host pid of the running pod's pid 1 (its entrypoint).
    pub fn pod_pid(&self, namespace: &str, name: &str) -> Option<u32> {
        self.pod_info(namespace, name)?.pid
    }

    pub fn pod_ip(&self, namespace: &str, name: &str) -> Option<Ipv4Addr> {
        self.pod_info(namespace, name)?.pod_ip
    }

    /// Evicts a pod as the kubelet does under node pressure (asynchronously): its process
    /// is killed, it becomes Failed with reason Evicted and this message, and it stays
    /// until a client deletes it.
    pub fn evict(&self, namespace: &str, name: &str, message: &str) {
        let pod = self
            .object("pods", namespace, name)
            .unwrap_or_else(|| panic!("kube_api: no pod {namespace}/{name} to evict"));
        self.cluster
            .kubelet
            .evict(pod["metadata"]["uid"].as_str().unwrap_or(""), message);
    }

    /// Whether new pods fit on the node (false: they stay Pending, Unschedulable, until
    /// it is true again, as the scheduler retries).
    pub fn set_schedulable(&self, schedulable: bool) {
        self.cluster.kubelet.set_schedulable(schedulable);
    }

    /// Every request served so far.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.cluster.requests.lock().clone()
    }

    /// Forgets the requests served so far (to measure one operation's load).
    pub fn clear_requests(&self) {
        self.cluster.requests.lock().clear();
    }

    /// Watch events streamed to clients so far (bookmarks and errors included).
    pub fn watch_events_sent(&self) -> u64 {
        self.cluster.watch_events_sent.load(Ordering::Relaxed)
    }

    /// Waits until `check` gives a value (checked on every change of the API's objects,
    /// and at least every 100 ms); panics naming `what` after `timeout`.
    pub async fn wait_until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut() -> Option<T>,
    ) -> T {
        let mut version = self.cluster.store.lock().version();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(value) = check() {
                return value;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "kube_api: timed out after {timeout:?} waiting for {what}"
            );
            let _ =
                tokio::time::timeout(left.min(Duration::from_millis(100)), version.changed()).await;
        }
    }

    /// Waits until the pod exists and `check` holds for it; returns it.
    pub async fn wait_for_pod(
        &self,
        namespace: &str,
        name: &str,
        timeout: Duration,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Value {
        self.wait_until(&format!("pod {namespace}/{name}: {what}"), timeout, || {
            self.object("pods", namespace, name)
                .filter(|pod| check(pod))
        })
        .await
    }
}

fn resource(kind_plural: &str) -> Resource {
    Resource::from_plural(kind_plural)
        .unwrap_or_else(|| panic!("kube_api: the double serves no {kind_plural:?}"))
}

fn write_kubeconfig(path: &Path, url: &str, token: &str, namespace: &str) {
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: kube-api-double
  cluster:
    server: {url}
users:
- name: user
  user:
    token: {token}
contexts:
- name: kube-api-double
  context:
    cluster: kube-api-double
    user: user
    namespace: {namespace}
current-context: kube-api-double
preferences: {{}}
"
    );
    std::fs::write(path, text).expect("the kubeconfig is written");
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The pods' output is what explains most failures: show it.
            for (namespace, name) in self.cluster.kubelet.logged_pods() {
                let log = self.pod_log(&namespace, &name);
                if !log.is_empty() {
                    eprintln!("kube_api: log of pod {namespace}/{name}:\n{log}");
                }
            }
        }
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
