//! The double's control plane state, shared by its HTTP server, its garbage collector and
//! its kubelet: the store, who may do what, which namespaces exist, and the record of every
//! request (so a test can report the API load a kernel start costs).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use serde_json::{json, Value};

use super::auth::Auth;
use super::kubelet::Kubelet;
use super::resource::Resource;
use super::store::Store;

/// One request the API served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub method: String,
    /// The path without its query.
    pub path: String,
    /// The RBAC verb (get, list, watch, create, update, patch, delete, deletecollection),
    /// or "" for a path that names no resource.
    pub verb: String,
    pub watch: bool,
    pub status: u16,
    /// The authenticated user, or "" when authentication failed.
    pub user: String,
}

pub struct Cluster {
    pub store: Mutex<Store>,
    pub auth: RwLock<Auth>,
    pub namespaces: RwLock<BTreeSet<String>>,
    /// RuntimeClasses that exist (a pod naming another is refused, as by admission).
    pub runtime_classes: Vec<String>,
    /// Pod Security admission: a namespace's enforced level (baseline, restricted).
    pub pod_security: HashMap<String, String>,
    pub requests: Mutex<Vec<RequestRecord>>,
    pub watch_events_sent: AtomicU64,
    /// How often a watch that allows bookmarks gets one.
    pub bookmark_interval: Duration,
    pub kubelet: Kubelet,
    /// The double's own runtime (its thread), where background work is spawned.
    pub runtime: tokio::runtime::Handle,
}

/// Now, as the API's `Time` (seconds) and `MicroTime` write it.
pub fn now() -> String {
    timestamp(time::OffsetDateTime::now_utc())
}

pub fn timestamp(at: time::OffsetDateTime) -> String {
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    at.format(&format).expect("a UTC time formats as RFC 3339")
}

impl Cluster {
    pub fn get(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.store.lock().get(resource, namespace, name).cloned()
    }

    /// Changes an object in place (the control plane's own writes: status, binding,
    /// finalizers), when it still is the object with `uid`. A change that changes nothing
    /// writes nothing, as in the real API. Returns the stored object.
    pub fn mutate(
        &self,
        resource: Resource,
        namespace: &str,
        name: &str,
        uid: &str,
        change: impl FnOnce(&mut Value),
    ) -> Option<Value> {
        let mut store = self.store.lock();
        let old = store.get(resource, namespace, name)?;
        if old["metadata"]["uid"] != uid {
            return None;
        }
        let mut new = old.clone();
        change(&mut new);
        if &new == old {
            return Some(new);
        }
        Some(store.put(resource, new))
    }

    /// Records a core v1 Event about a pod, as the scheduler and the kubelet do.
    pub fn record_event(
        &self,
        pod: &Value,
        component: &str,
        kind: &str,
        reason: &str,
        message: &str,
    ) {
        let namespace = pod["metadata"]["namespace"].as_str().unwrap_or("default");
        let pod_name = pod["metadata"]["name"].as_str().unwrap_or("");
        let now = now();
        let event = json!({
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": format!("{pod_name}.{:x}", rand::random::<u64>()),
                "namespace": namespace,
                "uid": uuid::Uuid::new_v4().to_string(),
                "creationTimestamp": now,
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod_name,
                "namespace": namespace,
                "uid": pod["metadata"]["uid"],
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": component, "host": self.kubelet.node_name()},
            "reportingComponent": component,
            "reportingInstance": self.kubelet.node_name(),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        });
        self.store.lock().put(Resource::Events, event);
    }
}
