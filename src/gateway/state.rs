//! The state shared by every handler.

use std::sync::Arc;

use crate::config::GatewayConfig;
use crate::kernel::KernelManager;

/// What handlers need: the settings and the kernels.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<GatewayConfig>,
    pub kernels: Arc<KernelManager>,
}
