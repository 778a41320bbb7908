//! Integration tests: a real `cellgate serve` process and real ipykernels, driven through the
//! Kernel Gateway HTTP API and both WebSocket framings.

#[path = "../support/mod.rs"]
mod support;

mod attacks;
mod clients;
mod compat;
mod hostile;
mod http;
mod lifecycle;
mod messaging;
mod pool;
mod tenants;
mod web_client;
