//! The state shared by every handler.

use std::sync::Arc;

use crate::config::GatewayConfig;
use crate::jwt::{JwtError, JwtVerifier};
use crate::kernel::KernelManager;
use crate::sessions::Sessions;
use crate::tenants::{TenantError, Tenants};

/// What handlers need: the settings, the kernels, and who may do what.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<GatewayConfig>,
    pub kernels: Arc<KernelManager>,
    /// API v1 sessions (their kernels are in `kernels` too).
    pub sessions: Arc<Sessions>,
    /// Verifies tenants' JWTs; `None` when no JWT key is configured.
    pub jwt: Option<Arc<JwtVerifier>>,
    pub tenants: Arc<Tenants>,
    /// The sandbox backends' last checks (readiness).
    pub checks: Arc<crate::kernel::health::Checks>,
}

/// Why the gateway's state could not be built.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Jwt(#[from] JwtError),
    #[error(transparent)]
    Tenants(#[from] TenantError),
}

impl AppState {
    /// Loads the JWT keys and tenant rules named in `config`; starts checking the sandbox
    /// backends (in the background).
    pub fn new(
        config: Arc<GatewayConfig>,
        kernels: Arc<KernelManager>,
        sessions: Arc<Sessions>,
    ) -> Result<AppState, StateError> {
        let checks = crate::kernel::health::Checks::spawn(&kernels);
        let jwt = JwtVerifier::from_settings(&config.jwt)?.map(Arc::new);
        let tenants = Arc::new(Tenants::new(config.tenants.clone())?);
        let quotas = tenants.clone();
        // Weak: the kernel manager, which keeps the closure, outlives nothing it points to.
        let dormant = Arc::downgrade(&sessions);
        kernels.set_hibernation_quota(Arc::new(move |tenant| {
            let limit = quotas.hibernated_storage(tenant)?;
            let kept = dormant
                .upgrade()
                .map_or(0, |sessions| sessions.dormant_hibernated_bytes(tenant));
            Some(crate::kernel::TenantHibernation { limit, kept })
        }));
        Ok(AppState {
            config,
            kernels,
            sessions,
            jwt,
            tenants,
            checks,
        })
    }
}
