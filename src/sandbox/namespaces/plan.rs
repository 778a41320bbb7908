//! What the gateway tells the sandbox helper to build, and what the helper reports back.
//!
//! The gateway decides everything (paths, identities, limits, the kernel's command) and
//! writes one [`Plan`] as a JSON line to the helper's stdin. The helper and the in-sandbox
//! init answer with [`Event`]s, one JSON line each, on the helper's stdout. Keeping the
//! decisions on the gateway side means the code that runs inside the sandbox has no policy of
//! its own and can be read as a fixed sequence of steps.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::sandbox::relocate::VenvEntry;

/// The line the gateway writes after the plan, once the helper's user namespace has its
/// uid/gid maps and the helper sits in the kernel's cgroups.
pub const GO: &str = "go";

/// The descriptor a helper forked from a zygote has the egress proxy's socket at (the
/// zygote's child puts it there), and the path its init opens it by.
pub const EGRESS_FD: i32 = 3;

/// One sandbox, as the helper must build it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Plan {
    pub kernel_id: String,
    /// The kernel's command; `argv[0]` is an absolute path valid inside the sandbox.
    pub argv: Vec<String>,
    /// The kernel's complete environment, its paths as the kernel sees them.
    pub env: BTreeMap<String, String>,
    /// The kernel's working directory inside the sandbox (`/home/user`): a fresh tmpfs of
    /// `workspace_bytes`.
    pub workspace: PathBuf,
    pub workspace_bytes: u64,
    /// Size of the private `/tmp` (and of `/dev/shm`).
    pub tmp_bytes: u64,
    /// The kernel's runtime directory inside the sandbox (`/run/cellgate`): a tmpfs of the
    /// sandbox's own, where the kernel creates its ipc sockets. The gateway reaches it
    /// through `/proc/<helper pid>/root`, so no host directory is bound (a bind shows its
    /// host path in `/proc/self/mountinfo`).
    pub runtime_dir_inside: PathBuf,
    /// The connection file the kernel reads, written into the runtime directory.
    #[serde(default)]
    pub connection_file: Option<RuntimeFile>,
    /// The Python environment at fixed paths (see `sandbox::relocate`): the venv's view and
    /// the base interpreter's host prefix, shown read-only at `relocate::PYTHON`.
    #[serde(default)]
    pub venv: Vec<VenvEntry>,
    #[serde(default)]
    pub python_prefix: Option<PathBuf>,
    /// Host directories and files made visible read-only at the same path (the Python
    /// environment, files named in the command).
    pub ro_binds: Vec<PathBuf>,
    /// Directories inside `ro_binds` hidden behind an empty read-only tmpfs (the base
    /// interpreter's site-packages, which the kernel's venv does not use).
    #[serde(default)]
    pub masked: Vec<PathBuf>,
    /// The kernel's uid and gid inside the sandbox (never 0).
    pub uid: u32,
    pub gid: u32,
    pub hostname: String,
    /// `RLIMIT_AS` for the kernel, set only when no memory cgroup could be made.
    pub address_space_limit: Option<u64>,
    /// Whether to add a Landlock ruleset (best effort: skipped where the kernel lacks it).
    pub landlock: bool,
    /// The egress proxy's unix socket, a host path: when set, the init opens it before it
    /// builds the root file system and runs the bridge from 127.0.0.1:3128 to it (the socket
    /// is never shown inside).
    #[serde(default)]
    pub egress_socket: Option<PathBuf>,
    /// Directories inside the workspace made (by the sandbox user) before the kernel starts.
    #[serde(default)]
    pub workspace_dirs: Vec<PathBuf>,
    /// What the sandbox's last process is (see [`Role`]).
    #[serde(default)]
    pub role: Role,
    /// The sandbox outlives its gateway (see `super::keeper`): `None`, it dies with it.
    #[serde(default)]
    pub keep: Option<Keep>,
}

/// How a sandbox that outlives its gateway keeps itself.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Keep {
    /// How long it waits for a gateway before it ends itself, in milliseconds.
    pub grace_ms: u64,
}

/// What the process the init starts becomes.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A kernel: confined, then `execve` of the plan's command.
    #[default]
    Kernel,
    /// A kernel zygote (`super::zygote`): the plan's command, confined by the zygote's own
    /// seccomp filter (which lets its children build sandboxes of their own), with the
    /// helper's standard input, the gateway's control socket, as its standard input. Its
    /// init outlives it while sandboxes forked from it still run.
    Zygote,
    /// A kernel forked from a zygote: the helper, the init and the kernel are forks of the
    /// zygote's child, which runs this same code; the kernel process is confined exactly as
    /// a [`Role::Kernel`] and then returns to the zygote's Python instead of `execve`.
    Forked,
}

/// A file the sandbox's init writes into the kernel's runtime directory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RuntimeFile {
    /// Its path inside the sandbox, within `runtime_dir_inside`.
    pub path: PathBuf,
    pub contents: String,
}

/// A report from the helper or the init, in the order they happen.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The helper has its new user namespace and waits for its id maps and cgroups.
    Unshared,
    /// The init (PID 1 of the sandbox) exists; `pid` is its host pid.
    Init { pid: i32 },
    /// The kernel process has exec'd its program; `pid` is its pid inside the sandbox.
    Kernel { pid: i32 },
    /// A step failed; nothing of the sandbox is left running after this.
    Failed { stage: String, error: String },
    /// The kernel process ended (the init then ends every other process of the sandbox).
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// The init ended (reported by the helper, last): how, for a gateway that is not the
    /// helper's parent (a helper forked from a zygote), when the init could not say
    /// [`Event::Exited`] itself (it was killed).
    InitEnded {
        code: Option<i32>,
        signal: Option<i32>,
    },
}

impl Event {
    /// One JSON line.
    pub fn to_line(&self) -> String {
        // Serialising this enum cannot fail (strings and integers only); keep a readable
        // fallback all the same rather than a panic inside the sandbox.
        let mut line = serde_json::to_string(self).unwrap_or_else(|_| {
            r#"{"event":"failed","stage":"report","error":"cannot encode an event"}"#.to_owned()
        });
        line.push('\n');
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_as_tagged_lines() {
        let events = [
            Event::Unshared,
            Event::Init { pid: 42 },
            Event::Kernel { pid: 2 },
            Event::Failed {
                stage: "mount".into(),
                error: "EPERM".into(),
            },
            Event::Exited {
                code: None,
                signal: Some(9),
            },
            Event::InitEnded {
                code: Some(0),
                signal: None,
            },
        ];
        for event in events {
            let line = event.to_line();
            assert!(line.ends_with('\n'));
            let back: Event = serde_json::from_str(line.trim_end()).unwrap();
            assert_eq!(back, event);
        }
        assert_eq!(Event::Unshared.to_line(), "{\"event\":\"unshared\"}\n");
    }
}
