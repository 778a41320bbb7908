//! The garbage collector: an object whose `ownerReferences` name only owners that are gone
//! (no object with that uid in its namespace) is deleted, in the background, as the real
//! controller does; one that still has a live owner only loses the dangling references;
//! an owner held by Foreground deletion goes once its dependents are gone.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::Value;

use super::cluster::Cluster;
use super::resource::Resource;
use super::verbs::{owned_by, strip_owner, DeleteOptions};

impl Cluster {
    /// Runs a pass after the current request (the collector is asynchronous in the real
    /// cluster too: a client sees the owner's deletion first).
    pub fn collect_garbage_soon(self: &Arc<Self>) {
        let cluster = self.clone();
        self.runtime.spawn(async move { cluster.collect_garbage() });
    }

    pub fn collect_garbage(self: &Arc<Self>) {
        let mut orphans = vec![];
        let mut half_orphans = vec![];
        let mut finished_owners = vec![];
        {
            let store = self.store.lock();
            let live: HashSet<(String, String)> = store
                .all()
                .map(|(_, o)| (namespace_of(o), uid_of(o)))
                .collect();
            for (resource, object) in store.all() {
                let refs = object["metadata"]["ownerReferences"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let dangling: Vec<String> = refs
                    .iter()
                    .filter_map(|r| r["uid"].as_str())
                    .filter(|uid| !live.contains(&(namespace_of(object), (*uid).to_owned())))
                    .map(str::to_owned)
                    .collect();
                if dangling.is_empty() {
                    continue;
                }
                if dangling.len() < refs.len() {
                    half_orphans.push((resource, object.clone(), dangling));
                } else if object["metadata"]["deletionTimestamp"].is_null() {
                    orphans.push((resource, object.clone()));
                }
            }
            for (resource, object) in store.all() {
                let held = object["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| f.iter().any(|f| f == "foregroundDeletion"));
                if held && !object["metadata"]["deletionTimestamp"].is_null() {
                    let uid = uid_of(object);
                    let has_dependents = store
                        .all()
                        .any(|(_, o)| namespace_of(o) == namespace_of(object) && owned_by(o, &uid));
                    if !has_dependents {
                        finished_owners.push((resource, object.clone()));
                    }
                }
            }
        }
        for (resource, object, dangling) in half_orphans {
            let (namespace, name, uid) = identity(&object);
            self.mutate(resource, &namespace, &name, &uid, |o| {
                for owner in &dangling {
                    strip_owner(o, owner);
                }
            });
        }
        for (resource, object) in orphans {
            let (namespace, name, uid) = identity(&object);
            let options = DeleteOptions {
                precondition_uid: Some(uid),
                ..DeleteOptions::default()
            };
            // Gone already, or changed under us: the next pass sees it again.
            let _ = self.delete(resource, &namespace, &name, &options);
        }
        for (resource, object) in finished_owners {
            let (namespace, name, uid) = identity(&object);
            self.mutate(resource, &namespace, &name, &uid, |o| {
                if let Some(list) = o["metadata"]["finalizers"].as_array_mut() {
                    list.retain(|f| f != "foregroundDeletion");
                }
            });
            self.finish_deletion(resource, &namespace, &name, &uid);
        }
    }

    /// Removes an object being deleted once nothing holds it (no finalizers; for a pod,
    /// the kubelet has stopped it).
    fn finish_deletion(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        name: &str,
        uid: &str,
    ) {
        if resource == Resource::Pods {
            // The pod's kubelet worker removes it once it has stopped it and nothing holds it.
            return;
        }
        let removed = {
            let mut store = self.store.lock();
            match store.get(resource, namespace, name) {
                Some(o)
                    if uid_of(o) == uid
                        && o["metadata"]["finalizers"]
                            .as_array()
                            .is_none_or(|f| f.is_empty()) =>
                {
                    store.remove(resource, namespace, name)
                }
                _ => None,
            }
        };
        if removed.is_some() {
            self.collect_garbage_soon();
        }
    }
}

fn namespace_of(object: &Value) -> String {
    object["metadata"]["namespace"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

fn uid_of(object: &Value) -> String {
    object["metadata"]["uid"].as_str().unwrap_or("").to_owned()
}

fn identity(object: &Value) -> (String, String, String) {
    let name = object["metadata"]["name"].as_str().unwrap_or("").to_owned();
    (namespace_of(object), name, uid_of(object))
}
