//! A Landlock ruleset for the kernel process: defence in depth on top of the mount namespace.
//!
//! The mount namespace already decides what exists; Landlock decides, independently of
//! mounts and of file permissions, what the process may do with it. Everything under `/` may
//! be read and executed; only the workspace, `/tmp`, `/dev/shm`, the runtime directory and
//! the device nodes in `/dev` may be written. If a later bug or a missed mount made some
//! other path writable, the kernel still could not write to it. Where the kernel supports it
//! (Landlock ABI 6), the ruleset is also scoped: no signals to processes outside the sandbox's
//! Landlock domain (that is, the init) and no connections to abstract unix sockets created
//! outside it.
//!
//! Best effort: on a kernel without Landlock, or with an older ABI, the ruleset enforces what
//! it can and [`restrict`] says what it achieved. TCP port rules are not used: the sandbox's
//! network namespace has nothing but loopback, and notebooks legitimately serve on loopback.

use std::path::PathBuf;

use ::landlock::{
    path_beneath_rules, Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};

use super::plan::Plan;

/// The newest ABI this ruleset was written and tested against.
const TARGET_ABI: ABI = ABI::V6;

#[derive(Debug, thiserror::Error)]
#[error("landlock: {0}")]
pub struct LandlockError(#[from] ::landlock::RulesetError);

/// Restricts the calling thread (and what it executes). Returns how much was enforced.
pub fn restrict(plan: &Plan) -> Result<&'static str, LandlockError> {
    let writable: Vec<PathBuf> = vec![
        plan.workspace.clone(),
        "/tmp".into(),
        "/dev".into(),
        plan.runtime_dir_inside.clone(),
    ];
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(TARGET_ABI))?
        .scope(Scope::from_all(TARGET_ABI))?
        .create()?
        .add_rules(path_beneath_rules(["/"], AccessFs::from_read(TARGET_ABI)))?
        .add_rules(path_beneath_rules(
            &writable,
            AccessFs::from_all(TARGET_ABI),
        ))?
        .restrict_self()?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => "fully enforced",
        RulesetStatus::PartiallyEnforced => "partially enforced (older Landlock ABI)",
        RulesetStatus::NotEnforced => "not enforced (no Landlock in this kernel)",
    })
}
