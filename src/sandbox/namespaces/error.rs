//! Errors of the namespaces backend, as the gateway sees them.

use std::path::PathBuf;

/// Why a namespaced kernel could not be started.
#[derive(Debug, thiserror::Error)]
pub enum NamespacesError {
    #[error("the kernel command is empty")]
    EmptyCommand,
    #[error("the kernel program must be an absolute path, got {0:?}")]
    RelativeProgram(String),
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not start the sandbox helper {program}: {source}")]
    SpawnHelper {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox helper: {0}")]
    Handshake(String),
    #[error("sandbox set-up failed at {stage}: {error}")]
    Step { stage: String, error: String },
    #[error("the sandbox did not start within {0} s")]
    Timeout(u64),
    #[error("cannot write the sandbox's id maps: {0}")]
    IdMap(#[source] std::io::Error),
    #[error(transparent)]
    Cgroup(#[from] crate::sandbox::cgroups::CgroupError),
    /// The zygote did not fork (the kernel then starts afresh, and the zygote is replaced).
    #[error(transparent)]
    Zygote(#[from] super::zygote::ZygoteError),
    /// A sandbox that outlived the gateway before this one could not be adopted.
    #[error("the kernel's sandbox could not be adopted: {0}")]
    Adopt(#[source] super::survival::SurvivalError),
}
