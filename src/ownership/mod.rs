//! Who owns which kernel: the question every gateway process asks before it serves a kernel,
//! answered by one trait whatever the answer's source.
//!
//! A single gateway owns every kernel it has ([`SingleGateway`]). Gateway replicas on
//! Kubernetes record each kernel pod's owner in a Lease (the implementation lives with the
//! Kubernetes backend, which makes the pods: `sandbox::kubernetes::replicas`); there a kernel
//! may be another replica's (requests for it are forwarded), or an orphan whose owner is
//! gone (taken over by whichever replica wins its record).
//!
//! The kernel core asks this trait and never a backend; the session layer decides where a
//! request for a kernel goes and takes orphans over (`sessions::adoption`); the HTTP layer
//! forwards by what the session layer says.
//!
//! A kernel is *claimed* (its record written) by the backend that makes its sandbox, since
//! the record names that sandbox: the trait has no `claim`, and a backend says with
//! `Sandbox::shares_ownership` whether it claims its kernels.
//!
//! Must not depend on: anything of this crate (it sits below the sandbox backends that
//! implement it).

use std::time::Duration;

use futures_util::future::BoxFuture;

/// Why the owners' registry could not answer.
#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    /// The registry (the Kubernetes API, for replicas) did not answer or refused.
    #[error("{0}")]
    Unavailable(String),
}

/// Who owns a kernel, as its record says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRecord {
    pub kernel_id: String,
    /// The owning gateway's id.
    pub owner: String,
    /// Which process of the owner wrote it: a gateway restarted under the same id has a new
    /// one, and takes its old kernels over like any other gateway's.
    pub incarnation: String,
    /// The kernel's sandbox, by its backend's name for it (a pod).
    pub sandbox: String,
    /// Where that name is unique (a Kubernetes namespace).
    pub namespace: String,
    pub kernelspec: String,
    pub policy: String,
    pub tenant: Option<String>,
}

/// A live gateway other than this one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub id: String,
    /// Where other gateways reach it.
    pub url: String,
}

/// A recorded kernel and its owner, when that owner is a live gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owned {
    pub record: KernelRecord,
    /// `None`: the owner is gone (the kernel is an orphan to take over).
    pub owner: Option<Peer>,
}

/// What a sweep of the registry found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Kernels whose owner is gone.
    pub orphans: Vec<KernelRecord>,
    /// Kernels held by any process but this one: if this process still has any of them, it
    /// lost them (paused past its lease, say) and must let them go.
    pub held_elsewhere: Vec<String>,
}

/// Which kernels to count across gateways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count<'a> {
    Tenant(&'a str),
    Policy(&'a str),
}

/// The owners' registry.
pub trait Ownership: Send + Sync {
    /// Whether other gateways may own kernels (replicas). When not, every other method
    /// answers as for a registry that records nothing, and callers may skip asking.
    fn shared(&self) -> bool;

    /// This gateway's id among its peers.
    fn gateway_id(&self) -> &str;

    /// Whether `record` was written by this very process (a kernel it is creating, holds or
    /// is taking over), as opposed to another process, even of the same gateway id.
    fn wrote(&self, record: &KernelRecord) -> bool;

    /// Who owns `kernel_id`; `None` when no record names it.
    fn owner_of<'a>(
        &'a self,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Owned>, OwnershipError>>;

    /// How often the registry is worth sweeping for orphans.
    fn sweep_every(&self) -> Duration;

    /// The orphans to take over, and the kernels another process holds.
    fn sweep(&self) -> BoxFuture<'_, Result<Sweep, OwnershipError>>;

    /// Makes this process the owner of an orphan, if nobody changed its record since
    /// `record` was read; `false`: another gateway won (or this one is leaving).
    fn take_over<'a>(
        &'a self,
        record: &'a KernelRecord,
    ) -> BoxFuture<'a, Result<bool, OwnershipError>>;

    /// The key an adopted kernel's messages are signed with.
    fn signing_key<'a>(
        &'a self,
        record: &'a KernelRecord,
    ) -> BoxFuture<'a, Result<String, OwnershipError>>;

    /// Records the tenant a kernel was handed to after its start (a warm-pool kernel).
    fn set_tenant<'a>(
        &'a self,
        kernel_id: &'a str,
        tenant: &'a str,
    ) -> BoxFuture<'a, Result<(), OwnershipError>>;

    /// How many recorded kernels match, across every gateway.
    fn count<'a>(&'a self, count: Count<'a>) -> BoxFuture<'a, Result<usize, OwnershipError>>;

    /// The live gateways other than this one.
    fn peers(&self) -> BoxFuture<'_, Result<Vec<Peer>, OwnershipError>>;

    /// Stops taking kernels over (this gateway is leaving).
    fn leave(&self);

    /// Lets this gateway's membership go, so its peers take its kernels over at once.
    fn release(&self) -> BoxFuture<'_, ()>;

    /// Housekeeping: forgets gateways that are gone.
    fn forget_gone(&self) -> BoxFuture<'_, ()>;
}

/// One gateway alone: it owns every kernel it has, and nobody else owns any.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleGateway;

impl Ownership for SingleGateway {
    fn shared(&self) -> bool {
        false
    }

    fn gateway_id(&self) -> &str {
        "local"
    }

    fn wrote(&self, _record: &KernelRecord) -> bool {
        false
    }

    fn owner_of<'a>(
        &'a self,
        _kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Owned>, OwnershipError>> {
        Box::pin(async { Ok(None) })
    }

    fn sweep_every(&self) -> Duration {
        // Never swept (nothing is recorded); an hour, should anyone ask.
        Duration::from_secs(3600)
    }

    fn sweep(&self) -> BoxFuture<'_, Result<Sweep, OwnershipError>> {
        Box::pin(async { Ok(Sweep::default()) })
    }

    fn take_over<'a>(
        &'a self,
        _record: &'a KernelRecord,
    ) -> BoxFuture<'a, Result<bool, OwnershipError>> {
        Box::pin(async { Ok(false) })
    }

    fn signing_key<'a>(
        &'a self,
        record: &'a KernelRecord,
    ) -> BoxFuture<'a, Result<String, OwnershipError>> {
        Box::pin(async move {
            Err(OwnershipError::Unavailable(format!(
                "kernel {} is recorded nowhere: a single gateway adopts nothing",
                record.kernel_id
            )))
        })
    }

    fn set_tenant<'a>(
        &'a self,
        _kernel_id: &'a str,
        _tenant: &'a str,
    ) -> BoxFuture<'a, Result<(), OwnershipError>> {
        Box::pin(async { Ok(()) })
    }

    fn count<'a>(&'a self, _count: Count<'a>) -> BoxFuture<'a, Result<usize, OwnershipError>> {
        Box::pin(async { Ok(0) })
    }

    fn peers(&self) -> BoxFuture<'_, Result<Vec<Peer>, OwnershipError>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    fn leave(&self) {}

    fn release(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    fn forget_gone(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_single_gateway_records_nothing_and_adopts_nothing() {
        let single = SingleGateway;
        assert!(!single.shared());
        assert_eq!(single.owner_of("k").await.unwrap(), None);
        assert_eq!(single.sweep().await.unwrap(), Sweep::default());
        let record = KernelRecord {
            kernel_id: "k".into(),
            owner: "other".into(),
            incarnation: "1".into(),
            sandbox: "pod".into(),
            namespace: "ns".into(),
            kernelspec: "python3".into(),
            policy: "default".into(),
            tenant: None,
        };
        assert!(!single.wrote(&record));
        assert!(!single.take_over(&record).await.unwrap());
        assert!(single.signing_key(&record).await.is_err());
        assert_eq!(single.count(Count::Tenant("t")).await.unwrap(), 0);
        assert!(single.peers().await.unwrap().is_empty());
    }
}
