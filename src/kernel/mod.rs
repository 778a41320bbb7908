//! Kernels: kernelspecs, launching a kernel in a sandbox, the ZMQ channels to it, routing its
//! messages to clients, its executions and how they ended ([`execution`]), and its
//! lifecycle; [`KernelManager`] keeps them all.
//!
//! - `spec.rs` reads `kernels/*/kernel.json`; `launch.rs` makes a kernel's directories, key
//!   and environment; `lifecycle.rs` is one kernel's life across its generations;
//!   `channels.rs` its ZMQ sockets; `router.rs` who asked what; [`execution`] an
//!   execution's life and outcome; [`history`] what clients executed, for export;
//!   [`client`] the gateway's own client of a kernel (API v1, replay); `health.rs` the
//!   backends' background readiness checks, which `/readyz` reports.
//! - `manager.rs`, the registry: `max_kernels`, per-policy caps, the tenants' live-kernel
//!   caps (counted under one lock together with the starts in flight, so concurrent starts
//!   cannot overshoot), idle culling and the warm pool. A kernel's policy (from
//!   `KERNEL_POLICY` in the start request, which GatewayClient forwards from the lab's
//!   `KERNEL_*` variables, else the kernelspec's `metadata.cellgate.policy`, else `default`)
//!   becomes its sandbox limits (memory, CPU, pids, workspace), its execution timeout and its
//!   per-cell output limit. Who owns a kernel (this gateway, or another replica) is asked of
//!   the `Ownership` trait (`Backends::ownership()`); the manager never names a backend.
//! - The warm pool holds ready kernels of the default kernelspec and policy; a hand-out
//!   applies the client's `KERNEL_*` variables with a silent execute; a kernel never returns
//!   to the pool; a refill waits until the kernels clients asked for have started, so it
//!   never competes with them; a failed pool start is retried with back-off, so readiness
//!   recovers by itself.
//!
//! Must not depend on: HTTP (axum types never reach this module), and no file here names a
//! sandbox backend (tests/layering.rs fails on one that does).

mod channels;
pub mod client;
pub mod execution;
pub mod health;
pub mod history;
mod launch;
mod lifecycle;
mod manager;
pub mod python;
mod router;
pub mod spec;

use std::path::PathBuf;

pub use channels::DROPPED_INVALID;
pub use client::{ExecEvent, ExecuteOptions, ExecuteReply, Execution, KernelClient};
pub use execution::{CellEnd, Denial, DenialKind, ExecutionState, ExitCause, Outcome};
pub use history::{History, HistorySnapshot};
pub(crate) use lifecycle::Deferrals;
pub use lifecycle::{CellgateFields, Kernel, KernelModel, KernelOptions, Readiness};
// A kernel's resource figures ([`Kernel::usage`]), as its sandbox reads them.
pub use crate::sandbox::ResourceUsage;
// Only for sessions/, which still names it here (being reworked on another branch); the
// format is every surface's, so it lives in `crate::timestamp`.
pub use crate::timestamp::format_timestamp;
pub use launch::client_may_set;
pub use manager::{
    EnvRefusal, KernelManager, ManagerOptions, Owner, PoolStatus, TenantHibernation, POLICY_ENV,
};
pub use router::{client_queue, ClientId, Inbox, Outbox, Router};
pub use spec::{KernelSpec, KernelSpecs};

use crate::protocol::Channel;
use crate::sandbox::SandboxError;

/// Errors of kernel management.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("cannot read {path}: {source}")]
    SpecRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot parse {path}: {source}")]
    SpecParse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid kernelspec {path}: {reason}")]
    SpecInvalid { path: PathBuf, reason: String },
    #[error("no kernelspecs in {dir}")]
    NoSpecs { dir: PathBuf },
    #[error("Kernel spec {name} not found")]
    NoSuchSpec { name: String, known: Vec<String> },
    #[error("kernelspec {name} is in the warm pool (--pool-kernels) but the default policy's {backend} sandbox cannot run it (its image holds no environment of this kernelspec; a microVM guest built by ./dev setup holds every kernelspec's): pool it under a namespaces or gvisor default policy, or leave it out of the pool")]
    PoolCannotRun { name: String, backend: &'static str },
    #[error("the environment of kernel {name} is missing ({expected} does not exist); run `./dev setup`")]
    EnvironmentMissing { name: String, expected: PathBuf },
    #[error("environment variable {name} has a value that is not allowed")]
    BadEnv { name: String },
    #[error("the gateway runs its maximum of {max} kernels")]
    TooManyKernels { max: usize },
    #[error("this tenant already runs its maximum of {max} kernels; shut one down first")]
    TenantKernelLimit { max: usize },
    /// The tenant's `concurrent_sessions` quota (a quota, answered 429: it frees by itself
    /// when one of the tenant's sessions ends).
    #[error("tenant {tenant} runs {used} sessions, its quota concurrent_sessions of {limit}; a place frees when one of its sessions ends (deleted, culled when idle, or shut down)")]
    SessionQuota {
        tenant: String,
        limit: usize,
        used: usize,
    },
    #[error("no such kernel")]
    NoSuchKernel,
    #[error("kernel is dead: {0}")]
    Dead(String),
    #[error("kernel was shut down")]
    Terminated,
    #[error("kernel is not ready")]
    NotReady,
    #[error("the kernel cannot hibernate now: {0}")]
    NotHibernatable(String),
    /// A restore from hibernation that failed with what was saved kept (see
    /// [`Kernel::wake`]): the same request may work later.
    #[error("the hibernated kernel could not be restored now ({0}); what it saved is kept and the next request tries again (restart the session to start afresh instead, losing its variables and workspace files)")]
    RestoreDeferred(String),
    #[error("kernel process died while starting")]
    DiedDuringStart,
    #[error("no reply to {0} from the kernel")]
    NoReply(String),
    #[error("cannot send on the {0} channel")]
    BadChannel(Channel),
    #[error("the kernel's socket {path} is not a socket (links are refused, not followed)")]
    NotASocket { path: String },
    #[error("ZMQ: {0}")]
    Zmq(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Policy(#[from] crate::policy::PolicyError),
    /// The shared owners' registry did not answer (counting kernels across gateways).
    #[error("the kernels' owners could not be read: {0}")]
    Ownership(#[from] crate::ownership::OwnershipError),
    #[error("policy {policy} runs kernels in the {backend} sandbox, which this host cannot run ({reason}); `cellgate doctor` says how to fix it")]
    BackendUnavailable {
        policy: String,
        backend: &'static str,
        reason: String,
    },
}
