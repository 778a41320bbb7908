//! Attacks that front the egress allowlist: a Host header or a TLS SNI that differs from the
//! name the allowlist approved (issue 13, item 6).
