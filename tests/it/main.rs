//! Integration tests: a real `cellgate serve` process and real ipykernels, driven through the
//! Kernel Gateway HTTP API and both WebSocket framings.

#[path = "../support/mod.rs"]
mod support;

mod adoption;
mod api_v1;
mod api_v1_flow;
mod artifact_links;
mod attack_passes;
mod attacks;
mod cgroup_v2;
mod clients;
mod commands;
mod compat;
mod contract;
mod deploy;
mod egress;
mod helm_chart;
mod hostile;
mod http;
mod kube_api;
mod kubernetes;
mod kubernetes_load;
mod kubernetes_manifests;
mod languages;
mod lifecycle;
mod mcp;
mod messaging;
mod microvm;
mod notebook;
mod npm_policy;
mod operations;
mod pool;
mod quotas;
mod release;
mod resume;
mod sdk;
mod stack;
mod store;
mod tenants;
mod web_client;
mod workspace_ops;
mod zygote;
