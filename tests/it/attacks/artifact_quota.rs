//! Attacks on the artifact store's disk: outputs and outputs/ files past the per-session and
//! per-tenant quotas and the free-disk high-water mark (issue 13, item 3).
