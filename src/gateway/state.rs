//! The state shared by every handler.

use std::sync::Arc;

use crate::config::GatewayConfig;
use crate::kernel::KernelManager;
use crate::sessions::Sessions;

/// What handlers need: the settings and the kernels.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<GatewayConfig>,
    pub kernels: Arc<KernelManager>,
    /// API v1 sessions (their kernels are in `kernels` too).
    pub sessions: Arc<Sessions>,
}
