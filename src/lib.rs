//! cellgate: a Jupyter kernel gateway that runs every kernel in its own sandbox.
//!
//! Layout, following the request path (see ARCHITECTURE.md):
//! - [`gateway`]: the HTTP and WebSocket surfaces (Kernel Gateway API, API v1), auth, errors.
//! - [`sessions`]: API v1 sessions: a kernel, its history, typed results and events.
//! - [`artifacts`]: rich outputs and output files stored by content, referenced by id.
//! - [`workspace`]: a kernel's files, reached without ever following a sandbox's link.
//! - [`kernel`]: one kernel's life (launch, channels, routing replies to clients, restart,
//!   shutdown), the registry of kernels, and the gateway's own kernel client.
//! - `ownership`: who owns which kernel (one gateway, or one of several replicas).
//! - [`sandbox`]: where a kernel process runs; one trait, one module per backend.
//! - [`egress`]: the egress proxy and package index that enforce a policy's network rules.
//! - [`protocol`]: the Jupyter wire format: multipart codec, signing, WebSocket framings.
//! - [`notebook`]: notebook export (a kernel's history as nbformat 4.5) and replay.
//! - [`policy`]: policy files (sandbox backend and limits), parsed and validated.
//! - [`config`]: the gateway's settings from the command line, environment and file.
//! - [`doctor`]: `cellgate doctor`, which backends this host can run and how to fix the rest.
//! - [`jwt`]: JWT bearer tokens for tenants: verifying (cached) and issuing.
//! - [`tenants`]: per-tenant policy caps, kernel caps and request rates.
//! - [`timestamp`]: the one timestamp format of every surface.
//! - `ids`: typed identifiers (kernel ids) with one parser each.
//! - [`telemetry`]: logs and Prometheus metrics.

pub mod artifacts;
pub mod config;
pub mod doctor;
pub mod egress;
pub mod gateway;
pub mod ids;
pub mod jwt;
pub mod kernel;
pub mod notebook;
pub mod ownership;
pub mod policy;
pub mod protocol;
pub mod sandbox;
pub mod sessions;
pub mod store;
pub mod telemetry;
pub mod tenants;
pub mod timestamp;
pub mod units;
pub mod workspace;
