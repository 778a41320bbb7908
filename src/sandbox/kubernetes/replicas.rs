//! Gateway replicas on Kubernetes: who owns which kernel, recorded in `coordination.k8s.io`
//! Leases, with the API server as the only arbiter (no protocol of our own between
//! replicas). `Replicas` is this backend's implementation of the `Ownership` trait
//! (`crate::ownership`); a single gateway's is `SingleGateway`.
//!
//! - Each replica holds a Lease of its own, `cellgate-replica-<id>`, renewed every
//!   [`RENEW_EVERY`] (5 s) for [`LEASE_SECONDS`] (15 s), annotated with the URL other
//!   replicas reach it at.
//! - Each kernel pod has a Lease `cellgate-kernel-<kernel id>` whose holder is its owning
//!   replica process (its id and incarnation), labelled with the owner, tenant and policy
//!   (listings and caps count these across replicas). It is written when a kernel gets a
//!   pod or changes hands, never renewed: a kernel's owner is alive as long as the owner's
//!   replica Lease is, so the API's load is per replica, not per kernel. The gateway deletes
//!   it with the kernel (no owner reference: a restart moves it to the kernel's new pod).
//! - A replica is gone when its Lease is released (holder empty: a graceful shutdown hands
//!   its kernels over that way) or has kept one resourceVersion for a full lease duration
//!   as *this* replica's monotonic clock measures it, from when it first saw that version
//!   (timestamps written by another node's clock are never compared). Its kernels are then
//!   adopted: each live replica tries to take each kernel's Lease with the version it read,
//!   and the API server's optimistic concurrency (409 to all but one) picks the new owner.
//!   The winner reattaches to the pod through its agent, with the key from the kernel's
//!   Secret, and gives it a session (`sessions/adoption.rs`: at once when a request names
//!   the kernel, and by a sweep every [`RENEW_EVERY`] for kernels no request names). The
//!   kernel keeps its process, variables and id.
//!
//! *Invariant:* a kernel has exactly one owner: its Lease is created by the replica that
//! made the pod and changes hands only by a PUT carrying the resourceVersion read, so the
//! API server's optimistic concurrency lets one replica win.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};

use futures_util::future::BoxFuture;

use super::objects::{self, label_value};
use super::{api_error, is_status, KubernetesError};
use crate::ownership::{Count, KernelRecord, Owned, Ownership, OwnershipError, Peer, Sweep};

/// How long a replica's Lease holds without renewal.
pub const LEASE_SECONDS: i32 = 15;
/// How often a replica renews its Lease.
pub const RENEW_EVERY: Duration = Duration::from_secs(5);
/// Label keys of the Leases.
pub const LABEL_ROLE: &str = "cellgate.io/role";
pub const LABEL_OWNER: &str = "cellgate.io/owner";
/// The annotation of a replica's URL, and of a kernel Lease's pod and kernelspec.
pub const ANNOTATION_URL: &str = "cellgate.io/url";
pub const ANNOTATION_POD: &str = "cellgate.io/pod";
pub const ANNOTATION_KERNELSPEC: &str = "cellgate.io/kernelspec";
pub const ANNOTATION_NAMESPACE: &str = "cellgate.io/namespace";
pub const ANNOTATION_INCARNATION: &str = "cellgate.io/incarnation";
pub const ANNOTATION_POD_UID: &str = "cellgate.io/pod-uid";

/// A replica's Lease name.
pub fn replica_lease_name(replica: &str) -> String {
    format!(
        "cellgate-replica-{}",
        label_value(replica).to_lowercase().replace('_', "-")
    )
}

/// A kernel's Lease name.
pub fn kernel_lease_name(kernel_id: &str) -> String {
    format!("cellgate-kernel-{kernel_id}")
}

/// This replica's membership: its Lease, its view of the others.
pub struct Replicas {
    leases: Api<Lease>,
    namespace: String,
    id: String,
    url: String,
    /// This process among the replica's (a random id drawn at its start).
    incarnation: String,
    /// Set when this replica is shutting down: it takes nothing over any more.
    leaving: std::sync::atomic::AtomicBool,
    /// Each replica Lease's version as last seen, and when this replica first saw it.
    seen: parking_lot::Mutex<HashMap<String, (String, Instant)>>,
    renewer: parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Replicas {
    /// Takes this replica's Lease (creating it, or taking over one a previous process of the
    /// same id left) and renews it in the background.
    pub async fn join(
        client: kube::Client,
        namespace: &str,
        id: &str,
        url: &str,
    ) -> Result<Arc<Replicas>, KubernetesError> {
        let replicas = Arc::new(Replicas {
            leases: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            id: id.to_owned(),
            url: url.to_owned(),
            incarnation: format!("{:016x}", rand::random::<u64>()),
            leaving: std::sync::atomic::AtomicBool::new(false),
            seen: parking_lot::Mutex::new(HashMap::new()),
            renewer: parking_lot::Mutex::new(None),
        });
        replicas.renew().await?;
        let renewing = replicas.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(RENEW_EVERY).await;
                if let Err(error) = renewing.renew().await {
                    tracing::warn!(%error, "renewing this replica's lease failed");
                }
            }
        });
        *replicas.renewer.lock() = Some(task);
        Ok(replicas)
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether `record` was written by this very process (a kernel it is creating, holds or
    /// is taking over), as opposed to another process, even of the same replica id.
    pub fn wrote(&self, record: &KernelRecord) -> bool {
        record.owner == self.id && record.incarnation == self.incarnation
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn own_lease(&self, version: Option<String>, held: bool) -> Lease {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        Lease {
            metadata: ObjectMeta {
                name: Some(replica_lease_name(&self.id)),
                namespace: Some(self.namespace.clone()),
                resource_version: version,
                labels: Some(BTreeMap::from([
                    (
                        objects::LABEL_NAME.to_owned(),
                        objects::GATEWAY_NAME.to_owned(),
                    ),
                    (LABEL_ROLE.to_owned(), "replica".to_owned()),
                ])),
                annotations: Some(BTreeMap::from([(
                    ANNOTATION_URL.to_owned(),
                    self.url.clone(),
                )])),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(if held { self.id.clone() } else { String::new() }),
                lease_duration_seconds: Some(LEASE_SECONDS),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                ..LeaseSpec::default()
            }),
        }
    }

    /// Writes this replica's Lease (a new renew time), creating it if it is not there.
    async fn renew(&self) -> Result<(), KubernetesError> {
        let name = replica_lease_name(&self.id);
        let action = format!("renew the lease {name}");
        let current = self
            .leases
            .get_opt(&name)
            .await
            .map_err(api_error(action.clone()))?;
        let result = match current {
            None => self
                .leases
                .create(&PostParams::default(), &self.own_lease(None, true))
                .await
                .map(|_| ()),
            Some(lease) => {
                let version = lease.metadata.resource_version.clone();
                self.leases
                    .replace(
                        &name,
                        &PostParams::default(),
                        &self.own_lease(version, true),
                    )
                    .await
                    .map(|_| ())
            }
        };
        match result {
            // Someone wrote it between our read and write (another process with our id?):
            // the next renewal reads again.
            Err(error) if is_status(&error, 409) => {
                tracing::warn!(lease = %name, "this replica's lease changed under it");
                Ok(())
            }
            other => other.map_err(api_error(action)),
        }
    }

    /// Releases this replica's Lease (holder empty) and stops renewing it: the others adopt
    /// its kernels at once instead of after the lease duration.
    pub async fn release(&self) {
        if let Some(task) = self.renewer.lock().take() {
            task.abort();
        }
        let name = replica_lease_name(&self.id);
        if let Ok(Some(lease)) = self.leases.get_opt(&name).await {
            let version = lease.metadata.resource_version.clone();
            let released = self.own_lease(version, false);
            if let Err(error) = self
                .leases
                .replace(&name, &PostParams::default(), &released)
                .await
            {
                tracing::warn!(%error, "releasing this replica's lease failed");
            }
        }
    }

    /// The replicas' Leases, sorted into live peers (not this one) and gone replicas.
    async fn census(&self) -> Result<(Vec<Peer>, Vec<(String, Lease)>), KubernetesError> {
        let params = ListParams::default().labels(&format!("{LABEL_ROLE}=replica"));
        let leases = self
            .leases
            .list(&params)
            .await
            .map_err(api_error("list the replicas' leases"))?;
        let mut seen = self.seen.lock();
        let mut live = Vec::new();
        let mut gone = Vec::new();
        for lease in leases {
            let Some(name) = lease.metadata.name.clone() else {
                continue;
            };
            let holder = lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.clone())
                .unwrap_or_default();
            let version = lease.metadata.resource_version.clone().unwrap_or_default();
            let duration = lease
                .spec
                .as_ref()
                .and_then(|s| s.lease_duration_seconds)
                .unwrap_or(LEASE_SECONDS);
            let first_seen = match seen.get(&name) {
                Some((known, at)) if *known == version => *at,
                _ => {
                    seen.insert(name.clone(), (version, Instant::now()));
                    Instant::now()
                }
            };
            let lapsed = first_seen.elapsed() > Duration::from_secs(duration.max(1) as u64);
            if holder.is_empty() || lapsed {
                gone.push((name, lease));
            } else if holder != self.id {
                let url = lease
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ANNOTATION_URL).cloned())
                    .unwrap_or_default();
                live.push(Peer { id: holder, url });
            }
        }
        Ok((live, gone))
    }

    /// The live replicas other than this one.
    pub async fn peers(&self) -> Result<Vec<Peer>, KubernetesError> {
        Ok(self.census().await?.0)
    }

    /// Records this replica as the owner of a kernel's new pod (just created): a new Lease,
    /// or, for a kernel restarted into a new pod, its Lease rewritten for that pod.
    pub async fn claim(&self, record: &KernelRecord, pod: &Pod) -> Result<(), KubernetesError> {
        let action = format!("record the owner of kernel {}", record.kernel_id);
        let name = kernel_lease_name(&record.kernel_id);
        let lease = kernel_lease(record, &self.id, &self.incarnation, pod);
        // The old pod's clean-up may delete the old Lease between any two of these calls
        // (it deletes only a Lease naming the old pod): start over then.
        let mut tries = 0;
        loop {
            tries += 1;
            let outcome = match self.leases.create(&PostParams::default(), &lease).await {
                Ok(_) => return Ok(()),
                Err(error) if is_status(&error, 409) => match self.leases.get_opt(&name).await {
                    Ok(Some(current)) => {
                        let mut replaced = lease.clone();
                        replaced.metadata.resource_version = current.metadata.resource_version;
                        self.leases
                            .replace(&name, &PostParams::default(), &replaced)
                            .await
                            .map(|_| ())
                    }
                    Ok(None) if tries < 5 => continue,
                    Ok(None) => {
                        return Err(api_error(action)(kube::Error::Api(Box::new(
                            kube::core::Status::failure("the lease came and went", "Conflict")
                                .with_code(409),
                        ))))
                    }
                    Err(error) => Err(error),
                },
                Err(error) => Err(error),
            };
            match outcome {
                Ok(()) => return Ok(()),
                Err(error) if tries < 5 && (is_status(&error, 404) || is_status(&error, 409)) => {}
                Err(error) => return Err(api_error(action)(error)),
            }
        }
    }

    /// Who owns `kernel_id`, by its Lease in `namespace`, and whether that owner is a live
    /// replica (its URL) or gone.
    pub async fn owner_of(&self, kernel_id: &str) -> Result<Option<Owned>, KubernetesError> {
        let Some(lease) = self
            .leases
            .get_opt(&kernel_lease_name(kernel_id))
            .await
            .map_err(api_error(format!("read the owner of kernel {kernel_id}")))?
        else {
            return Ok(None);
        };
        let Some(record) = record_of(&lease) else {
            return Ok(None);
        };
        let (live, _) = self.census().await?;
        let owner = live.into_iter().find(|peer| peer.id == record.owner);
        Ok(Some(Owned { record, owner }))
    }

    /// The kernels whose owner is gone, and those held by any process but this one (which
    /// this process, if it still has them, lost: paused past its lease, say).
    pub async fn sweep(&self) -> Result<Sweep, KubernetesError> {
        let (live, _) = self.census().await?;
        let params = ListParams::default().labels(&format!("{LABEL_ROLE}=kernel"));
        let kernels = self
            .leases
            .list(&params)
            .await
            .map_err(api_error("list the kernels' leases"))?;
        let records: Vec<KernelRecord> = kernels.iter().filter_map(record_of).collect();
        let held_elsewhere = records
            .iter()
            .filter(|record| !self.wrote(record))
            .map(|record| record.kernel_id.clone())
            .collect();
        let orphans = records
            .into_iter()
            .filter(|record| {
                if record.owner == self.id {
                    // An earlier process of this replica's (its container restarted).
                    return record.incarnation != self.incarnation;
                }
                !live.iter().any(|peer| peer.id == record.owner)
            })
            .collect();
        Ok(Sweep {
            orphans,
            held_elsewhere,
        })
    }

    /// Takes `kernel_id` over from its gone owner: the Lease's holder becomes this replica,
    /// if nobody else changed the Lease since `record` was read. `false`: another replica
    /// won.
    pub async fn take_over(&self, record: &KernelRecord) -> Result<bool, KubernetesError> {
        if self.leaving.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(false);
        }
        let leases = &self.leases;
        let name = kernel_lease_name(&record.kernel_id);
        let action = format!("take kernel {} over", record.kernel_id);
        let Some(mut lease) = leases
            .get_opt(&name)
            .await
            .map_err(api_error(action.clone()))?
        else {
            return Ok(false);
        };
        if record_of(&lease)
            .is_none_or(|now| now.owner != record.owner || now.incarnation != record.incarnation)
        {
            return Ok(false);
        }
        lease
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(ANNOTATION_INCARNATION.to_owned(), self.incarnation.clone());
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        spec.holder_identity = Some(self.id.clone());
        spec.acquire_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        lease
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(LABEL_OWNER.to_owned(), label_value(&self.id));
        match leases.replace(&name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(error) if is_status(&error, 409) || is_status(&error, 404) => Ok(false),
            Err(error) => Err(api_error(action)(error)),
        }
    }

    /// Whether this process holds `kernel_id`'s Lease (also when the API cannot say: acting
    /// on its own kernel is the safe default while the API is away, and a Lease that is gone
    /// names nobody else).
    pub async fn holds(&self, kernel_id: &str) -> bool {
        match self.leases.get_opt(&kernel_lease_name(kernel_id)).await {
            Ok(Some(lease)) => record_of(&lease).is_none_or(|record| self.wrote(&record)),
            Ok(None) | Err(_) => true,
        }
    }

    /// Stops taking kernels over (this replica is leaving).
    pub fn leave(&self) {
        self.leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Gives up a kernel this replica took over but could not attach to: its Lease goes when
    /// its pod is gone (nothing left to take over), else it is released (holder empty) for
    /// the next sweep of any replica to try again.
    pub async fn abandon(&self, record: &KernelRecord) {
        let client = self.leases.clone().into_client();
        let pods: Api<Pod> = Api::namespaced(client.clone(), &record.namespace);
        let pod_gone = match pods.get_opt(&record.sandbox).await {
            Ok(None) => true,
            Ok(Some(pod)) => matches!(
                super::status::state(&pod),
                super::status::PodState::Ended { .. }
            ),
            Err(_) => false,
        };
        if pod_gone {
            // Nothing left to take over: the pod, its key and its Lease go.
            let remover = super::PodRemover {
                pods,
                secrets: Api::namespaced(client, &record.namespace),
                name: record.sandbox.clone(),
                lease: None,
            };
            remover.now().await;
            self.forget(&record.kernel_id, &record.sandbox).await;
            return;
        }
        let name = kernel_lease_name(&record.kernel_id);
        let Ok(Some(mut lease)) = self.leases.get_opt(&name).await else {
            return;
        };
        if record_of(&lease).is_none_or(|now| !self.wrote(&now)) {
            return;
        }
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = Some(String::new());
        }
        if let Err(error) = self
            .leases
            .replace(&name, &PostParams::default(), &lease)
            .await
        {
            tracing::warn!(%error, kernel_id = %record.kernel_id, "releasing a kernel's lease failed");
        }
    }

    /// Records the tenant a kernel was handed to (a warm-pool kernel, started for nobody):
    /// caps and take-overs read it from the Lease.
    pub async fn set_tenant(&self, kernel_id: &str, tenant: &str) -> Result<(), KubernetesError> {
        let name = kernel_lease_name(kernel_id);
        let action = format!("record the tenant of kernel {kernel_id}");
        let mut lease = self
            .leases
            .get(&name)
            .await
            .map_err(api_error(action.clone()))?;
        lease
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(objects::LABEL_TENANT.to_owned(), label_value(tenant));
        lease
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(objects::ANNOTATION_TENANT.to_owned(), tenant.to_owned());
        self.leases
            .replace(&name, &PostParams::default(), &lease)
            .await
            .map_err(api_error(action))?;
        Ok(())
    }

    /// Deletes the Leases of gone replicas (housekeeping; a replica that comes back under
    /// the same id makes its own again).
    pub async fn forget_gone(&self) {
        let Ok((_, gone)) = self.census().await else {
            return;
        };
        for (name, lease) in gone {
            let Some(version) = lease.metadata.resource_version.clone() else {
                continue;
            };
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: Some(version),
                    uid: lease.metadata.uid.clone(),
                }),
                ..DeleteParams::default()
            };
            let _ = self.leases.delete(&name, &params).await;
        }
    }

    /// Deletes a kernel's Lease once its pod `pod` is gone, unless the Lease names another
    /// pod by now (the kernel restarted into a new one, whose start may have won the race).
    pub async fn forget(&self, kernel_id: &str, pod: &str) {
        let name = kernel_lease_name(kernel_id);
        let Ok(Some(lease)) = self.leases.get_opt(&name).await else {
            return;
        };
        let names_pod = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_POD))
            .is_some_and(|named| named == pod);
        if !names_pod {
            return;
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: lease.metadata.resource_version.clone(),
                uid: lease.metadata.uid.clone(),
            }),
            ..DeleteParams::default()
        };
        match self.leases.delete(&name, &params).await {
            Ok(_) => {}
            Err(error) if is_status(&error, 404) || is_status(&error, 409) => {}
            Err(error) => tracing::warn!(%error, kernel_id, "deleting a kernel's lease failed"),
        }
    }

    /// The Jupyter key a kernel's messages are signed with, from its Secret (for a take-over).
    pub async fn jupyter_key(&self, record: &KernelRecord) -> Result<String, KubernetesError> {
        let secrets: Api<Secret> =
            Api::namespaced(self.leases.clone().into_client(), &record.namespace);
        let secret = secrets
            .get(&record.sandbox)
            .await
            .map_err(api_error(format!("read the secret {}", record.sandbox)))?;
        let connection = secret
            .data
            .as_ref()
            .and_then(|data| data.get(objects::CONNECTION_NAME))
            .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes.0).ok())
            .and_then(|info| info.get("key")?.as_str().map(str::to_owned));
        connection.ok_or_else(|| {
            KubernetesError::Ended(format!(
                "the secret {} has no connection info",
                record.sandbox
            ))
        })
    }

    /// How many kernels have `label=value` across all replicas (listing their Leases).
    pub async fn count(&self, label: &str, value: &str) -> Result<usize, KubernetesError> {
        let leases = &self.leases;
        let params = ListParams::default().labels(&format!(
            "{LABEL_ROLE}=kernel,{label}={}",
            label_value(value)
        ));
        Ok(leases
            .list(&params)
            .await
            .map_err(api_error("count kernels"))?
            .items
            .len())
    }
}

/// The Kubernetes API's answer as the owners' registry's.
fn unavailable(error: KubernetesError) -> OwnershipError {
    OwnershipError::Unavailable(error.to_string())
}

impl Ownership for Replicas {
    fn shared(&self) -> bool {
        true
    }

    fn gateway_id(&self) -> &str {
        &self.id
    }

    fn wrote(&self, record: &KernelRecord) -> bool {
        Replicas::wrote(self, record)
    }

    fn owner_of<'a>(
        &'a self,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Owned>, OwnershipError>> {
        Box::pin(async move {
            Replicas::owner_of(self, kernel_id)
                .await
                .map_err(unavailable)
        })
    }

    fn sweep_every(&self) -> Duration {
        RENEW_EVERY
    }

    fn sweep(&self) -> BoxFuture<'_, Result<Sweep, OwnershipError>> {
        Box::pin(async move { Replicas::sweep(self).await.map_err(unavailable) })
    }

    fn take_over<'a>(
        &'a self,
        record: &'a KernelRecord,
    ) -> BoxFuture<'a, Result<bool, OwnershipError>> {
        Box::pin(async move { Replicas::take_over(self, record).await.map_err(unavailable) })
    }

    fn signing_key<'a>(
        &'a self,
        record: &'a KernelRecord,
    ) -> BoxFuture<'a, Result<String, OwnershipError>> {
        Box::pin(async move { self.jupyter_key(record).await.map_err(unavailable) })
    }

    fn set_tenant<'a>(
        &'a self,
        kernel_id: &'a str,
        tenant: &'a str,
    ) -> BoxFuture<'a, Result<(), OwnershipError>> {
        Box::pin(async move {
            Replicas::set_tenant(self, kernel_id, tenant)
                .await
                .map_err(unavailable)
        })
    }

    fn count<'a>(&'a self, count: Count<'a>) -> BoxFuture<'a, Result<usize, OwnershipError>> {
        let (label, value) = match count {
            Count::Tenant(tenant) => (objects::LABEL_TENANT, tenant),
            Count::Policy(policy) => (objects::LABEL_POLICY, policy),
        };
        Box::pin(async move {
            Replicas::count(self, label, value)
                .await
                .map_err(unavailable)
        })
    }

    fn peers(&self) -> BoxFuture<'_, Result<Vec<Peer>, OwnershipError>> {
        Box::pin(async move { Replicas::peers(self).await.map_err(unavailable) })
    }

    fn leave(&self) {
        Replicas::leave(self)
    }

    fn release(&self) -> BoxFuture<'_, ()> {
        Box::pin(Replicas::release(self))
    }

    fn forget_gone(&self) -> BoxFuture<'_, ()> {
        Box::pin(Replicas::forget_gone(self))
    }
}

/// A kernel's Lease, held by `owner`'s process `incarnation`, for its pod `pod`. No owner
/// reference to the pod: a restarted kernel's Lease moves from its old pod to its new one,
/// and the old pod's deletion must not take it along (the gateway deletes a kernel's Lease
/// itself, and a take-over of a pod that is gone deletes it).
fn kernel_lease(record: &KernelRecord, owner: &str, incarnation: &str, pod: &Pod) -> Lease {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let mut labels = BTreeMap::from([
        (
            objects::LABEL_NAME.to_owned(),
            objects::GATEWAY_NAME.to_owned(),
        ),
        (LABEL_ROLE.to_owned(), "kernel".to_owned()),
        (LABEL_OWNER.to_owned(), label_value(owner)),
        (
            objects::LABEL_KERNEL.to_owned(),
            label_value(&record.kernel_id),
        ),
        (
            objects::LABEL_POLICY.to_owned(),
            label_value(&record.policy),
        ),
    ]);
    labels.insert(
        objects::LABEL_TENANT.to_owned(),
        label_value(record.tenant.as_deref().unwrap_or("")),
    );
    let mut annotations = BTreeMap::from([
        (ANNOTATION_POD.to_owned(), record.sandbox.clone()),
        (ANNOTATION_NAMESPACE.to_owned(), record.namespace.clone()),
        (ANNOTATION_KERNELSPEC.to_owned(), record.kernelspec.clone()),
        (objects::LABEL_POLICY.to_owned(), record.policy.clone()),
        (ANNOTATION_INCARNATION.to_owned(), incarnation.to_owned()),
        (
            ANNOTATION_POD_UID.to_owned(),
            pod.metadata.uid.clone().unwrap_or_default(),
        ),
    ]);
    if let Some(tenant) = &record.tenant {
        annotations.insert(objects::ANNOTATION_TENANT.to_owned(), tenant.clone());
    }
    Lease {
        metadata: ObjectMeta {
            name: Some(kernel_lease_name(&record.kernel_id)),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(owner.to_owned()),
            acquire_time: Some(now),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        }),
    }
}

/// What a kernel Lease records; `None` for a Lease that is not one of ours.
fn record_of(lease: &Lease) -> Option<KernelRecord> {
    let labels = lease.metadata.labels.as_ref()?;
    if labels.get(LABEL_ROLE).map(String::as_str) != Some("kernel") {
        return None;
    }
    let annotations = lease.metadata.annotations.clone().unwrap_or_default();
    let kernel_id = lease
        .metadata
        .name
        .as_deref()?
        .strip_prefix("cellgate-kernel-")?
        .to_owned();
    Some(KernelRecord {
        kernel_id,
        owner: lease.spec.as_ref()?.holder_identity.clone()?,
        sandbox: annotations.get(ANNOTATION_POD)?.clone(),
        namespace: annotations.get(ANNOTATION_NAMESPACE)?.clone(),
        kernelspec: annotations.get(ANNOTATION_KERNELSPEC)?.clone(),
        policy: annotations.get(objects::LABEL_POLICY)?.clone(),
        tenant: annotations.get(objects::ANNOTATION_TENANT).cloned(),
        incarnation: annotations
            .get(ANNOTATION_INCARNATION)
            .cloned()
            .unwrap_or_default(),
    })
}
