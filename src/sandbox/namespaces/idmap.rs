//! Who the kernel is: its uid and gid inside the sandbox, and which host ids they stand for.
//!
//! Inside, the kernel is always uid/gid 1000 ("kernel"), never 0. Outside it is:
//! * when the gateway runs as root, an unprivileged host id (by default 65534,
//!   nobody/nogroup), so that files it writes through the runtime directory, and anything
//!   that escapes, are not root's. The gateway hands the runtime directory and the connection
//!   file to that id; their parent directory stays 0700 root, so no other host user reaches
//!   the sockets.
//! * otherwise the gateway's own uid and gid, the only mapping an unprivileged process may
//!   write. `setgroups` is then denied, as the kernel requires, and the process keeps the
//!   gateway's supplementary groups (they show up as `nogroup`): a host limitation of
//!   unprivileged user namespaces.
//!
//! Only that one id is mapped. The sandbox helper and init start with the gateway's host
//! identity and no uid at all inside (they show up as the overflow uid), hold their
//! capabilities in the new user namespace until they switch to uid 1000, and never exec
//! anything before the kernel process does. Nothing in the sandbox can become uid 0 of the
//! namespace, because no host id is mapped to it.
//!
//! The maps are written by the gateway, from outside, into `/proc/<helper>/…` after the
//! helper has unshared its user namespace: a process can only map ids other than its own
//! with CAP_SETUID in the *parent* namespace, which the helper no longer has there.

use std::fs;
use std::io;

use super::sys;

/// The kernel's uid and gid inside every sandbox.
pub const INSIDE_ID: u32 = 1000;

/// The host ids behind the sandbox's uid/gid 1000.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdMap {
    pub outside_uid: u32,
    pub outside_gid: u32,
    /// The gateway is root: it may map any id and leaves `setgroups` allowed, so the helper
    /// can drop the supplementary groups it inherited.
    pub privileged: bool,
}

impl IdMap {
    /// The mapping for the current process: `root_maps_to` when running as root.
    pub fn for_this_process(root_maps_to: (u32, u32)) -> IdMap {
        let euid = sys::geteuid();
        if euid == 0 {
            IdMap {
                outside_uid: root_maps_to.0,
                outside_gid: root_maps_to.1,
                privileged: true,
            }
        } else {
            IdMap {
                outside_uid: euid,
                outside_gid: sys::getegid(),
                privileged: false,
            }
        }
    }

    /// The maps of a helper forked from a zygote, which it writes itself (see
    /// [`IdMap::write_own`]): uid/gid 1000 inside stand for the zygote's uid/gid 1000, and
    /// `setgroups` is denied.
    pub const FORKED: IdMap = IdMap {
        outside_uid: INSIDE_ID,
        outside_gid: INSIDE_ID,
        privileged: false,
    };

    /// Writes the maps of the user namespace this process has just unshared, as a process
    /// without privilege over its parent namespace may: its own ids only. A helper forked
    /// from a zygote does this, since only a process of the parent namespace or of the
    /// namespace itself may write them, and the gateway is neither (the zygote's namespace
    /// lies between).
    pub fn write_own(&self) -> io::Result<()> {
        self.write_at("self")
    }

    /// Writes the maps of the user namespace that process `pid` has just unshared.
    pub fn write(&self, pid: u32) -> io::Result<()> {
        self.write_at(&pid.to_string())
    }

    fn write_at(&self, pid: &str) -> io::Result<()> {
        fn with<'a>(pid: &'a str, what: &'static str) -> impl FnOnce(io::Error) -> io::Error + 'a {
            move |err| io::Error::new(err.kind(), format!("write /proc/{pid}/{what}: {err}"))
        }
        if !self.privileged {
            fs::write(format!("/proc/{pid}/setgroups"), "deny").map_err(with(pid, "setgroups"))?;
        }
        fs::write(
            format!("/proc/{pid}/uid_map"),
            format!("{INSIDE_ID} {} 1\n", self.outside_uid),
        )
        .map_err(with(pid, "uid_map"))?;
        fs::write(
            format!("/proc/{pid}/gid_map"),
            format!("{INSIDE_ID} {} 1\n", self.outside_gid),
        )
        .map_err(with(pid, "gid_map"))?;
        Ok(())
    }
}
