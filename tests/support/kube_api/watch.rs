//! Watches: a chunked stream of newline-delimited `{"type","object"}` events, from a
//! resourceVersion (or, from "0" or none, synthetic ADDED events for what exists now, then
//! live ones), with bookmarks, `sendInitialEvents`, `timeoutSeconds`, and 410 Expired for a
//! resourceVersion older than the retained history: what kube-runtime's watcher and a
//! hand-written `Api::watch` loop both rely on.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::Response;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

use super::cluster::Cluster;
use super::resource::Resource;
use super::selector::Filter;
use super::status::ApiError;
use super::store::{Change, ChangeType};

/// A watch request's parameters.
#[derive(Debug, Clone, Default)]
pub struct WatchParams {
    pub resource_version: Option<String>,
    pub timeout: Option<Duration>,
    pub bookmarks: bool,
    pub send_initial_events: bool,
}

/// The streaming response of a watch.
pub fn watch(
    cluster: Arc<Cluster>,
    resource: Resource,
    filter: Filter,
    params: WatchParams,
) -> Response {
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    let task = Watch {
        cluster: cluster.clone(),
        resource,
        filter,
        params,
        tx,
    };
    cluster.runtime.spawn(task.run());
    let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(body)
        .expect("a valid response")
}

struct Watch {
    cluster: Arc<Cluster>,
    resource: Resource,
    filter: Filter,
    params: WatchParams,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
}

/// Where a watch starts: the current objects, or the history after a resourceVersion.
enum Start {
    Listing(Vec<Value>, u64),
    History(Vec<Arc<Change>>, u64),
}

impl Watch {
    async fn run(self) {
        let since = self.params.resource_version.as_deref().unwrap_or("");
        let initial = since.is_empty() || since == "0" || self.params.send_initial_events;
        let begun = {
            let store = self.cluster.store.lock();
            if initial {
                let objects = store.list(self.resource, &self.filter);
                Ok((
                    Start::Listing(objects, store.resource_version()),
                    store.subscribe(),
                ))
            } else {
                match since.parse::<u64>() {
                    Err(_) => Err(ApiError::bad_request(format!(
                        "invalid resource version: {since}"
                    ))),
                    Ok(rv) => store
                        .changes_since(rv)
                        .map(|(past, rx)| (Start::History(past, rv), rx)),
                }
            }
        };
        let (start, mut changes) = match begun {
            Ok(begun) => begun,
            Err(err) => {
                self.send("ERROR", err.to_status()).await;
                return;
            }
        };
        let mut last_rv = match start {
            Start::Listing(objects, rv) => {
                for object in objects {
                    if !self.send("ADDED", object).await {
                        return;
                    }
                }
                if self.params.send_initial_events && self.params.bookmarks {
                    let mut bookmark = self.bookmark(rv);
                    bookmark["metadata"]["annotations"] =
                        json!({"k8s.io/initial-events-end": "true"});
                    if !self.send("BOOKMARK", bookmark).await {
                        return;
                    }
                }
                rv
            }
            Start::History(past, rv) => {
                let mut last = rv;
                for change in past {
                    last = change.rv;
                    if !self.forward(&change).await {
                        return;
                    }
                }
                last
            }
        };
        let deadline = self.params.timeout.map(|t| tokio::time::Instant::now() + t);
        let mut bookmarks = tokio::time::interval_at(
            tokio::time::Instant::now() + self.cluster.bookmark_interval,
            self.cluster.bookmark_interval,
        );
        loop {
            let timeout = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                change = changes.recv() => match change {
                    Ok(change) => {
                        if change.rv <= last_rv {
                            continue;
                        }
                        last_rv = change.rv;
                        if !self.forward(&change).await {
                            return;
                        }
                    }
                    // Too slow a watcher is dropped, as the real watch cache drops it;
                    // the client watches again from its last resourceVersion.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = bookmarks.tick(), if self.params.bookmarks => {
                    if !self.send("BOOKMARK", self.bookmark(last_rv)).await {
                        return;
                    }
                }
                _ = timeout => return,
                _ = self.tx.closed() => return,
            }
        }
    }

    fn bookmark(&self, rv: u64) -> Value {
        json!({
            "kind": self.resource.kind(),
            "apiVersion": self.resource.api_version(),
            "metadata": {"resourceVersion": rv.to_string()},
        })
    }

    /// Sends a change as this watch's filter sees it: an object that starts or stops
    /// matching a selector is ADDED or DELETED for it, as in the real API.
    async fn forward(&self, change: &Change) -> bool {
        if change.resource != self.resource {
            return true;
        }
        let now = self.filter.matches(&change.object);
        let before = change.old.as_ref().is_some_and(|o| self.filter.matches(o));
        let kind = match (change.change, before, now) {
            (ChangeType::Added, _, true) => "ADDED",
            (ChangeType::Modified, true, true) => "MODIFIED",
            (ChangeType::Modified, false, true) => "ADDED",
            (ChangeType::Modified, true, false) => "DELETED",
            (ChangeType::Deleted, _, true) => "DELETED",
            _ => return true,
        };
        self.send(kind, change.object.clone()).await
    }

    /// False once the client has gone.
    async fn send(&self, kind: &str, object: Value) -> bool {
        let mut line = serde_json::to_vec(&json!({"type": kind, "object": object}))
            .expect("JSON values serialize");
        line.push(b'\n');
        let sent = self.tx.send(Ok(Bytes::from(line))).await.is_ok();
        if sent {
            self.cluster
                .watch_events_sent
                .fetch_add(1, Ordering::Relaxed);
        }
        sent
    }
}
