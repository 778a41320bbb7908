//! The double's etcd: every object by resource, namespace and name, one global
//! resourceVersion counter, and the ordered history of changes that watches are served
//! from (the last `history_limit` changes; a watch from before them gets 410 Expired, as
//! from a compacted etcd). It knows nothing of HTTP or of the API's rules.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::{broadcast, watch};

use super::resource::Resource;
use super::selector::Filter;
use super::status::ApiError;

/// What happened to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeType {
    Added,
    Modified,
    Deleted,
}

impl ChangeType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeType::Added => "ADDED",
            ChangeType::Modified => "MODIFIED",
            ChangeType::Deleted => "DELETED",
        }
    }
}

/// One write, as watches see it.
#[derive(Debug, Clone)]
pub struct Change {
    pub rv: u64,
    pub resource: Resource,
    pub change: ChangeType,
    /// The object after the change (for a deletion: as it was, with the deletion's rv).
    pub object: Value,
    /// The object before (None for an addition): a watch with a selector needs both.
    pub old: Option<Value>,
}

type Key = (Resource, String, String);

/// The retained changes after a resourceVersion, and a receiver of every later one.
pub type Resumed = (Vec<Arc<Change>>, broadcast::Receiver<Arc<Change>>);

pub struct Store {
    objects: BTreeMap<Key, Value>,
    rv: u64,
    history: VecDeque<Arc<Change>>,
    history_limit: usize,
    /// The newest resourceVersion dropped from the history.
    compacted: u64,
    changes: broadcast::Sender<Arc<Change>>,
    version: watch::Sender<u64>,
}

/// How many changes a watch may fall behind before it is ended (the client re-watches).
const WATCH_BUFFER: usize = 4096;

impl Store {
    pub fn new(history_limit: usize) -> Store {
        Store {
            objects: BTreeMap::new(),
            rv: 1,
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            compacted: 0,
            changes: broadcast::channel(WATCH_BUFFER).0,
            version: watch::channel(1).0,
        }
    }

    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    pub fn get(&self, resource: Resource, namespace: &str, name: &str) -> Option<&Value> {
        self.objects
            .get(&(resource, namespace.to_owned(), name.to_owned()))
    }

    /// The objects of a resource that pass `filter`, by namespace and name.
    pub fn list(&self, resource: Resource, filter: &Filter) -> Vec<Value> {
        self.objects
            .range((resource, String::new(), String::new())..)
            .take_while(|((r, _, _), _)| *r == resource)
            .map(|(_, object)| object)
            .filter(|object| filter.matches(object))
            .cloned()
            .collect()
    }

    /// Every object of every resource (for the garbage collector and the kubelet).
    pub fn all(&self) -> impl Iterator<Item = (Resource, &Value)> {
        self.objects.iter().map(|((r, _, _), object)| (*r, object))
    }

    /// Stores `object` under the next resourceVersion: an addition or a modification.
    pub fn put(&mut self, resource: Resource, mut object: Value) -> Value {
        let key = key_of(resource, &object);
        self.rv += 1;
        object["metadata"]["resourceVersion"] = Value::String(self.rv.to_string());
        let old = self.objects.insert(key, object.clone());
        let change = if old.is_some() {
            ChangeType::Modified
        } else {
            ChangeType::Added
        };
        self.record(resource, change, object.clone(), old);
        object
    }

    /// Removes an object; the deletion gets its own resourceVersion.
    pub fn remove(&mut self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        let key = (resource, namespace.to_owned(), name.to_owned());
        let old = self.objects.remove(&key)?;
        self.rv += 1;
        let mut object = old.clone();
        object["metadata"]["resourceVersion"] = Value::String(self.rv.to_string());
        self.record(resource, ChangeType::Deleted, object.clone(), Some(old));
        Some(object)
    }

    fn record(
        &mut self,
        resource: Resource,
        change: ChangeType,
        object: Value,
        old: Option<Value>,
    ) {
        let change = Arc::new(Change {
            rv: self.rv,
            resource,
            change,
            object,
            old,
        });
        self.history.push_back(change.clone());
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.compacted = dropped.rv;
            }
        }
        // No receivers is fine: nobody watches.
        let _ = self.changes.send(change);
        self.version.send_replace(self.rv);
    }

    /// The retained changes after `since`, and a receiver of every later one (taken under
    /// the same lock, so nothing falls between). 410 when `since` is older than the history.
    pub fn changes_since(&self, since: u64) -> Result<Resumed, ApiError> {
        if since < self.compacted {
            return Err(ApiError::expired(format!(
                "too old resource version: {since} ({})",
                self.compacted + 1
            )));
        }
        let past = self
            .history
            .iter()
            .filter(|c| c.rv > since)
            .cloned()
            .collect();
        Ok((past, self.changes.subscribe()))
    }

    /// Every later change, from now.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Change>> {
        self.changes.subscribe()
    }

    /// The resourceVersion, updated on every change: what waiters wait on.
    pub fn version(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

fn key_of(resource: Resource, object: &Value) -> Key {
    let metadata = &object["metadata"];
    (
        resource,
        metadata["namespace"].as_str().unwrap_or("").to_owned(),
        metadata["name"].as_str().unwrap_or("").to_owned(),
    )
}
