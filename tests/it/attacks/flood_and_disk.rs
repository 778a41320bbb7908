//! Attacks by output floods and disk fills: a sustained print loop must not kill the kernel,
//! and a full workspace is ENOSPC, not an out-of-memory kill (issue 13, items 7 and 8).
