//! Errors of the gvisor backend, as the gateway sees them.
//!
//! No error type of its own, unlike the namespaces backend: what fails here is a file the
//! gateway writes or a runsc command, whose own message (runsc's stderr, the path, the OS
//! error) is all there is to report, so a launch that cannot be prepared fails with a
//! [`SandboxError::Setup`] carrying that message.

use crate::sandbox::SandboxError;

/// A launch that could not be prepared, and why.
pub(super) fn setup(message: impl Into<String>) -> SandboxError {
    SandboxError::Setup(message.into())
}
