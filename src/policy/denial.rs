//! What a policy refused a kernel: one [`Denial`], as the egress proxy and the package index
//! report it and the execution that caused it carries it (`metadata.cellgate.denials`).
//!
//! Here, below both the proxy and the kernel core, so that the proxy reports a typed denial
//! without knowing the kernel (it is given a sink) and the kernel reads the same type.

use serde::{Deserialize, Serialize};

/// What a policy refused an execution: an element of `metadata.cellgate.denials`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Denial {
    pub kind: DenialKind,
    /// The host and port, URL or package the execution asked for.
    pub target: String,
    /// The policy that refused it.
    pub policy: String,
    /// The sentence the cell's stderr line shows.
    pub reason: String,
}

/// Which rules refused: the egress allowlist or the package index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenialKind {
    Egress,
    Package,
}

impl DenialKind {
    /// Every kind (the metrics export each at zero before its first denial).
    pub const ALL: [DenialKind; 2] = [DenialKind::Egress, DenialKind::Package];

    /// The wire name (the same as serde's), for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            DenialKind::Egress => "egress",
            DenialKind::Package => "package",
        }
    }
}
