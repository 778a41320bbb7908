//! Kernels of other gateways: where a request for a kernel this gateway does not hold goes,
//! and the take-over of kernels whose gateway is gone (at once when a request names one, and
//! by a sweep of the owners' registry otherwise), so sessions survive the loss of a gateway
//! replica. A kernel taken over keeps its process, variables and id; this gateway gives it a
//! session.
//!
//! Only the question "who owns this kernel" is asked here, of `ownership`; the HTTP layer
//! forwards by the [`Route`] it gets (it asks the registry only for the peers to gather
//! listings and artifacts from, and for this gateway's id).

use std::sync::Arc;

use crate::kernel::KernelError;
use crate::ownership::{KernelRecord, Owned, OwnershipError, Peer};

use super::Sessions;

/// Why a take-over failed (losing the race to another gateway is no failure).
#[derive(Debug, thiserror::Error)]
pub enum AdoptionError {
    #[error(transparent)]
    Ownership(#[from] OwnershipError),
    #[error("attaching to the kernel failed: {0}")]
    Kernel(#[from] KernelError),
}

/// Where a request naming a kernel goes.
#[derive(Debug)]
pub enum Route {
    /// Served here: this gateway holds the kernel (or has just taken it over), or no gateway
    /// does (the handlers answer 404).
    Here,
    /// Another live gateway owns it.
    Forward(Peer),
    /// It is changing hands; the same request works shortly. Why, in words.
    Moving(&'static str),
    /// The owners' registry did not answer.
    Unavailable(OwnershipError),
}

impl Sessions {
    /// Where a request for `kernel_id` goes; `forwarded`: it comes from another gateway,
    /// which is never sent back (two gateways that disagree cannot bounce it). An orphan is
    /// taken over on the way.
    pub async fn route(&self, kernel_id: &str, forwarded: bool) -> Route {
        let ownership = self.kernels.ownership();
        if !ownership.shared() {
            return Route::Here;
        }
        if self.kernels.get(kernel_id).is_some() {
            if self.taking_over.lock().contains_key(kernel_id) {
                // Attached but not ready or without its session yet: a 404 now would be a
                // lie the client cannot retry past.
                return Route::Moving("the kernel is being taken over; try again");
            }
            return Route::Here;
        }
        match ownership.owner_of(kernel_id).await {
            Ok(None) => Route::Here,
            Ok(Some(Owned {
                owner: Some(peer), ..
            })) if !forwarded => Route::Forward(peer),
            Ok(Some(Owned { owner: Some(_), .. })) => {
                Route::Moving("the kernel's owner changed while the request travelled; try again")
            }
            // This very process is creating or taking the kernel over right now.
            Ok(Some(Owned { record, .. })) if ownership.wrote(&record) => {
                Route::Moving("the kernel is starting or being taken over; try again")
            }
            Ok(Some(Owned { record, .. })) => {
                if let Err(error) = self.take_over(record).await {
                    tracing::warn!(%error, kernel_id, "taking a kernel over failed");
                }
                // Ours now, or another gateway's that won: served or forwarded on retry.
                if self.kernels.get(kernel_id).is_some() {
                    Route::Here
                } else {
                    Route::Moving("the kernel is being taken over by another replica; try again")
                }
            }
            Err(error) => Route::Unavailable(error),
        }
    }

    /// Takes over a kernel whose gateway is gone, when this one wins its record: attached
    /// to, ready, and given a session. `false`: another gateway won. A kernel won but not
    /// attached to stays this gateway's (its record is not given up: a kernel that cannot be
    /// attached to would otherwise be retried by every gateway's sweep, for good).
    pub async fn take_over(&self, record: KernelRecord) -> Result<bool, AdoptionError> {
        let ownership = self.kernels.ownership();
        if !ownership.take_over(&record).await? {
            return Ok(false);
        }
        let key = ownership.signing_key(&record).await?;
        let tenant = record.tenant.clone();
        let _moving = TakingOver::begin(self, &record.kernel_id);
        let kernel = self.kernels.adopt(record, key).await?;
        let ready = kernel.wait_ready().await;
        // The session is given even to a kernel that did not get ready: held here without
        // one, API v1 would answer 404 for good; with one, the client sees the kernel dead
        // (and why) and its next execute starts it again. Not to one shut down or let go to
        // another gateway meanwhile: this gateway no longer holds it.
        let held = self
            .kernels
            .get(kernel.id.as_str())
            .is_some_and(|now| Arc::ptr_eq(&now, &kernel));
        if held && !matches!(ready, Err(KernelError::Terminated)) {
            self.adopt(kernel, tenant);
        }
        ready?;
        Ok(true)
    }

    /// Sweeps the owners' registry for orphans, and for kernels another process holds now,
    /// as often as the registry asks, for as long as the sessions live. Nothing to do when
    /// this gateway shares ownership with no other.
    pub fn spawn_adopter(self: &Arc<Self>) {
        let ownership = self.kernels.ownership().clone();
        if !ownership.shared() {
            return;
        }
        let sessions = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut sweeps = 0u64;
            loop {
                tokio::time::sleep(ownership.sweep_every()).await;
                let Some(sessions) = sessions.upgrade() else {
                    return;
                };
                let found = match ownership.sweep().await {
                    Ok(found) => found,
                    Err(error) => {
                        tracing::warn!(%error, "looking for kernels whose gateway is gone failed");
                        continue;
                    }
                };
                // Kernels another gateway took from this one (paused past its lease): let
                // go, so requests for them are forwarded to their owner.
                for kernel_id in found.held_elsewhere {
                    if sessions.kernels.release_lost(&kernel_id) {
                        tracing::warn!(kernel_id, "a kernel this gateway held is another's now");
                    }
                }
                for record in found.orphans {
                    let kernel_id = record.kernel_id.clone();
                    if let Err(error) = sessions.take_over(record).await {
                        tracing::warn!(%error, kernel_id, "taking a kernel over failed");
                    }
                }
                sweeps += 1;
                if sweeps.is_multiple_of(12) {
                    ownership.forget_gone().await;
                }
            }
        });
    }
}

/// Marks a kernel as being taken over for as long as it lives (until its session is given,
/// or the take-over failed).
struct TakingOver<'a> {
    sessions: &'a Sessions,
    kernel_id: String,
}

impl<'a> TakingOver<'a> {
    fn begin(sessions: &'a Sessions, kernel_id: &str) -> TakingOver<'a> {
        *sessions
            .taking_over
            .lock()
            .entry(kernel_id.to_owned())
            .or_default() += 1;
        TakingOver {
            sessions,
            kernel_id: kernel_id.to_owned(),
        }
    }
}

impl Drop for TakingOver<'_> {
    fn drop(&mut self) {
        // Counted, not a set: of two overlapping take-overs of one kernel, the first to end
        // must not unmark the other's.
        let mut taking_over = self.sessions.taking_over.lock();
        if let Some(count) = taking_over.get_mut(&self.kernel_id) {
            *count -= 1;
            if *count == 0 {
                taking_over.remove(&self.kernel_id);
            }
        }
    }
}
