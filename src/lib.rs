//! cellgate: a Jupyter kernel gateway that runs every kernel in its own sandbox.
//!
//! Layout, following the request path (see ARCHITECTURE.md):
//! - [`gateway`]: the HTTP and WebSocket surfaces (Kernel Gateway API), auth, errors.
//! - [`kernel`]: one kernel's life (launch, channels, routing replies to clients, restart,
//!   shutdown) and the registry of kernels.
//! - [`sandbox`]: where a kernel process runs; one trait, one module per backend.
//! - [`protocol`]: the Jupyter wire format: multipart codec, signing, WebSocket framings.
//! - [`policy`]: policy files (sandbox backend and limits), parsed and validated.
//! - [`config`]: the gateway's settings from the command line, environment and file.
//! - [`doctor`]: `cellgate doctor`, which backends this host can run and how to fix the rest.
//! - [`jwt`]: JWT bearer tokens for tenants: verifying (cached) and issuing.
//! - [`tenants`]: per-tenant policy caps, kernel caps and request rates.

#![deny(unsafe_code)]

pub mod config;
pub mod doctor;
pub mod gateway;
pub mod jwt;
pub mod kernel;
pub mod policy;
pub mod protocol;
pub mod sandbox;
pub mod telemetry;
pub mod tenants;
