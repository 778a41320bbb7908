//! The VMM's confinement on the host: what a VMM its guest has taken over can still reach.
//!
//! The VM boundary is the guest kernel plus the VMM; a guest that breaks out of QEMU's
//! device emulation holds whatever QEMU holds. So each VM's VMM and its vsock device backend
//! start (between fork and exec, before any instruction of theirs runs):
//!
//! - **in a cgroup of their own** (`<gateway's cgroup>/cellgate/<kernel>.vm-…`, the shared
//!   [`crate::sandbox::cgroups`]): memory = the guest's RAM plus the VMM's own overhead
//!   (with QEMU's translated-code cache fixed at 128 MiB under TCG), CPU quota = the
//!   policy's CPUs, a pid limit (256 tasks); the gateway reads the VM's cost there and
//!   removes it when the VM is gone;
//! - **as nobody in particular**: under a root gateway, a uid and gid of their own, one pair
//!   per live VM ([`IDENTITY_BASE`] onwards, no supplementary group but `/dev/kvm`'s under
//!   KVM), so two VMMs cannot signal, trace or read each other; the VM's runtime directory
//!   is handed to that uid and its parent stays root's 0700, so the VMM reaches its own
//!   files only, through its working directory (every path the VMM is given in there is
//!   relative). An unprivileged gateway cannot change uid: its VMMs get a user namespace
//!   mapping only the gateway's ids, which leaves them no capability over the host but
//!   the gateway's own uid: a VMM broken out of can then signal the gateway, read its
//!   environment and reach every session's files. Run the gateway as root (it drops
//!   every VMM to its own uid) where the VM boundary matters;
//! - **in a root of their own** ([`super::hostview`]): a mount namespace whose tree holds
//!   `/usr`, the binaries, the guest images and the VM's runtime directory, nothing else
//!   of the host's files;
//! - **in network, IPC and UTS namespaces of their own**: no interface but a down
//!   loopback, no host abstract sockets, no host System V IPC;
//! - **with resource limits**: open files ([`NOFILE`], 1024), file size ([`fsize`]: the
//!   larger of the workspace disk and the guest's RAM (a memfd), the largest file a VMM
//!   writes, so a guest flooding
//!   its console fills at most that much; `SIGXFSZ` is ignored so the flood fails its writes
//!   instead of killing the VM), no core dumps, and `no_new_privs`;
//! - **with only the descriptors it is meant to have**: stdio, and a snapshot's when it
//!   restores one; everything else the gateway holds is close-on-exec, whoever opened it.
//!
//! The gateway reads the VM's console through the handle it created the file with, never
//! through the path (which the VMM could turn into a link to a host file).
//!
//! QEMU adds its own seccomp filter (`-sandbox on`, see `qemu.rs`).

#![allow(unsafe_code)]

use std::collections::HashSet;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use super::hostview::{HostView, HostViewError, RootPlan};
use crate::sandbox::cgroups::{self, Hierarchy, KernelCgroup};
use crate::sandbox::sys::{self, check};
use crate::sandbox::{Limits, ResourceUsage};

/// The first uid/gid given to VMMs under a root gateway; 2^20 follow. Above
/// the ranges distributions give users, subordinate ids (`/etc/subuid`) and systemd's
/// containers (up to 0x6FFFFFFF), below systemd's reserved top of the 31-bit space.
pub const IDENTITY_BASE: u32 = 0x7700_0000;
/// How many VMM identities there are: live VMs per host, at most.
const IDENTITY_SLOTS: u32 = 1 << 20;
/// Open files a VMM may hold: QEMU needs a few dozen (images, sockets, eventfds, its
/// thread pool's), the vsock backend one per guest connection.
const NOFILE: u64 = 1024;
/// Threads and processes in the VM's cgroup: QEMU's vCPU, RCU and I/O worker threads (its
/// block layer's pool grows to 64 per context) and the vsock backend's few. QEMU cannot
/// start programs (`-sandbox spawn=deny`); the limit bounds its threads.
const PIDS: u64 = 256;
/// The smallest file-size limit, whatever the workspace disk's size.
const MIN_FSIZE: u64 = 64 << 20;

/// The file-size limit of a VMM whose workspace disk is `disk_bytes` long and whose guest
/// has `memory_mib` of RAM (a memfd under vsock, which the limit applies to as well).
pub(super) fn fsize(disk_bytes: u64, memory_mib: u64) -> u64 {
    disk_bytes.max(memory_mib << 20).max(MIN_FSIZE)
}

/// Errors of confining a VMM.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("no VMM identity is free: {IDENTITY_SLOTS} VMs are running")]
    NoIdentity,
    #[error("the VM's cgroup: {0}")]
    Cgroup(#[from] cgroups::CgroupError),
    #[error("the VMM's view of the host's files: {0}")]
    HostView(#[from] HostViewError),
    #[error("handing {path} to the VMM's uid: {source}")]
    Chown {
        path: String,
        #[source]
        source: io::Error,
    },
}

/// Per backend: the cgroup hierarchy and the identities in use.
pub(super) struct Confiner {
    hierarchy: Hierarchy,
    /// Whether the gateway is root, and so gives each VMM an unprivileged uid of its own.
    privileged: bool,
    /// `/dev/kvm`'s group, for VMMs that use it.
    kvm_group: Option<u32>,
    identities: Arc<Identities>,
    /// The host files every VMM of this backend sees.
    view: HostView,
}

#[derive(Default)]
struct Identities(Mutex<Slots>);

/// The slots in use, and where the search for a free one starts.
#[derive(Default)]
struct Slots {
    live: HashSet<u32>,
    next: u32,
}

impl Confiner {
    /// Looks at this host once: its cgroups (sweeping what a dead gateway left) and whether
    /// the gateway may change uids; opens what VMMs will see of the host's files: the
    /// system's and `files` (the binaries VMs run and the guest images, absolute paths).
    pub(super) fn new(use_kvm: bool, files: &[&Path]) -> Result<Confiner, ConfineError> {
        let view = HostView::new(files, use_kvm)?;
        let hierarchy = Hierarchy::detect();
        hierarchy.sweep();
        let kvm_group = use_kvm
            .then(|| {
                std::os::unix::fs::MetadataExt::gid(&std::fs::metadata("/dev/kvm").ok()?).into()
            })
            .flatten();
        tracing::info!(cgroups = %hierarchy.describe(), "microvm: VMMs are confined");
        Ok(Confiner {
            hierarchy,
            privileged: rustix::process::geteuid().is_root(),
            kvm_group,
            // Two gateways on one host rarely start at the same slot.
            identities: Arc::new(Identities(Mutex::new(Slots {
                live: HashSet::new(),
                next: rand::random::<u32>() % IDENTITY_SLOTS,
            }))),
            view,
        })
    }

    /// The confinement of one VM whose runtime directory is `dir`: its cgroup made (with
    /// `limits`), its identity chosen and `dir` handed to it. `None` for a limit: not set.
    pub(super) fn prepare(
        &self,
        name: &str,
        limits: &Limits,
        dir: &Path,
        files: &[&Path],
        fsize: u64,
    ) -> Result<Jail, ConfineError> {
        let root = self.view.plan(dir)?;
        let identity = if self.privileged {
            let slot = self.identities.take()?;
            let id = IDENTITY_BASE + slot;
            for path in std::iter::once(dir).chain(files.iter().copied()) {
                // lchown: a link is never followed, whoever put it there.
                std::os::unix::fs::lchown(path, Some(id), Some(id)).map_err(|source| {
                    self.identities.give_back(slot);
                    ConfineError::Chown {
                        path: path.display().to_string(),
                        source,
                    }
                })?;
            }
            Identity::Dropped {
                id,
                groups: self.kvm_group.into_iter().collect(),
                _slot: SlotGuard {
                    slot,
                    identities: self.identities.clone(),
                },
            }
        } else {
            let uid = rustix::process::getuid().as_raw();
            let gid = rustix::process::getgid().as_raw();
            Identity::Own {
                uid_map: format!("{uid} {uid} 1\n").into_bytes(),
                gid_map: format!("{gid} {gid} 1\n").into_bytes(),
            }
        };
        // As for the namespaces backend's kernels: a host that will not give the gateway a
        // cgroup (none delegated, or v2's rule against processes in an inner cgroup)
        // still runs VMs, loudly without host limits.
        let cgroup = match self.hierarchy.create(name, limits) {
            Ok(cgroup) => Some(cgroup),
            Err(error) => {
                tracing::warn!(%error, vm = name, "microvm: no cgroup for the VMM: its memory, CPU and pid limits are NOT enforced on the host (the guest's own limits still hold)");
                None
            }
        };
        let cgroup_procs = cgroup
            .as_ref()
            .map(|cgroup| {
                cgroup
                    .procs_files()
                    .iter()
                    .filter_map(|path| CString::new(path.as_os_str().as_bytes()).ok())
                    .collect()
            })
            .unwrap_or_default();
        Ok(Jail {
            cgroup: parking_lot::Mutex::new(cgroup),
            plan: Arc::new(ChildPlan {
                cgroup_procs,
                identity,
                fsize,
                root,
            }),
        })
    }
}

impl Confiner {
    /// Marks the uids of VMs an earlier gateway left running as taken, before this gateway
    /// gives any VM one: a surviving VM keeps its uid whether or not it is ever adopted (an
    /// adopted one's is freed when it ends, by its jail).
    pub(super) fn reserve(&self, uids: &[u32]) {
        self.identities.reserve(uids);
    }

    /// The confinement of a VM an earlier gateway started (adopted): its cgroup as
    /// recorded, and its uid, which no VM of this gateway is given while it lives. Nothing
    /// is started in it.
    pub(super) fn adopt(
        &self,
        uid: Option<u32>,
        cgroup: Option<&cgroups::CgroupParts>,
        dir: &Path,
    ) -> Result<Jail, ConfineError> {
        let root = self.view.plan(dir)?;
        let identity = match uid {
            Some(id) if (IDENTITY_BASE..IDENTITY_BASE + IDENTITY_SLOTS).contains(&id) => {
                let slot = id - IDENTITY_BASE;
                self.identities.0.lock().live.insert(slot);
                Identity::Dropped {
                    id,
                    groups: self.kvm_group.into_iter().collect(),
                    _slot: SlotGuard {
                        slot,
                        identities: self.identities.clone(),
                    },
                }
            }
            _ => Identity::Own {
                uid_map: Vec::new(),
                gid_map: Vec::new(),
            },
        };
        Ok(Jail {
            cgroup: parking_lot::Mutex::new(cgroup.and_then(KernelCgroup::from_parts)),
            plan: Arc::new(ChildPlan {
                cgroup_procs: Vec::new(),
                identity,
                fsize: 0,
                root,
            }),
        })
    }
}

impl Identities {
    fn take(&self) -> Result<u32, ConfineError> {
        let mut slots = self.0.lock();
        for _ in 0..IDENTITY_SLOTS {
            let slot = slots.next;
            slots.next = (slot + 1) % IDENTITY_SLOTS;
            if slots.live.insert(slot) {
                return Ok(slot);
            }
        }
        Err(ConfineError::NoIdentity)
    }

    /// Marks the slots of these uids taken (uids outside the range are not ours).
    fn reserve(&self, uids: &[u32]) {
        let mut slots = self.0.lock();
        for &id in uids {
            if (IDENTITY_BASE..IDENTITY_BASE + IDENTITY_SLOTS).contains(&id) {
                slots.live.insert(id - IDENTITY_BASE);
            }
        }
    }

    fn give_back(&self, slot: u32) {
        self.0.lock().live.remove(&slot);
    }
}

/// Frees a VMM identity when the VM's last process is gone.
struct SlotGuard {
    slot: u32,
    identities: Arc<Identities>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.identities.give_back(self.slot);
    }
}

enum Identity {
    /// A root gateway's VMM: this uid and gid, these supplementary groups.
    Dropped {
        id: u32,
        groups: Vec<u32>,
        _slot: SlotGuard,
    },
    /// An unprivileged gateway's VMM: its own ids in a user namespace of its own.
    Own { uid_map: Vec<u8>, gid_map: Vec<u8> },
}

/// What the child does before exec, prepared in the gateway so the child only makes
/// system calls (no allocation between fork and exec).
struct ChildPlan {
    cgroup_procs: Vec<CString>,
    identity: Identity,
    fsize: u64,
    root: RootPlan,
}

/// One VM's confinement, alive as long as its processes may be. Dropped without
/// [`Jail::release`] (a launch abandoned midway), it removes its cgroup, killing what is
/// in it, on a thread of its own.
pub(super) struct Jail {
    cgroup: parking_lot::Mutex<Option<KernelCgroup>>,
    plan: Arc<ChildPlan>,
}

impl Drop for Jail {
    fn drop(&mut self) {
        if let Some(cgroup) = self.cgroup.get_mut().take() {
            let _ = std::thread::Builder::new()
                .name("cellgate-vm-cgroup".to_owned())
                .spawn(move || cgroup.remove());
        }
    }
}

impl Jail {
    /// Makes `command` start confined.
    pub(super) fn apply(&self, command: &mut tokio::process::Command) {
        let plan = self.plan.clone();
        // SAFETY: the closure runs in the forked child before exec and makes system calls
        // only (open, write, close, setrlimit, signal, unshare, setgroups, setres[ug]id,
        // prctl) on data prepared before the fork; `io::Error::last_os_error` does not
        // allocate.
        unsafe {
            command.pre_exec(move || confine_child(&plan));
        }
    }

    /// Gives `command`'s process `file` as its descriptor [`qemu::SNAPSHOT_FD`](super::qemu::SNAPSHOT_FD)
    /// (and nothing else of the gateway's: every other descriptor is close-on-exec). Call it
    /// after [`Jail::apply`], whose step marks every inherited descriptor close-on-exec.
    pub(super) fn pass_snapshot(command: &mut tokio::process::Command, file: std::fs::File) {
        use std::os::fd::{AsRawFd, OwnedFd};
        let fd = OwnedFd::from(file);
        let target = super::qemu::SNAPSHOT_FD;
        // SAFETY: the closure runs in the forked child before exec and calls only dup2 and
        // fcntl, which are async-signal-safe, on a descriptor opened before the fork.
        unsafe {
            command.pre_exec(move || {
                let raw = fd.as_raw_fd();
                if raw == target {
                    // dup2 onto itself keeps close-on-exec set: clear it instead.
                    if libc::fcntl(raw, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(raw, target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    /// The uid the VMM runs as, when it is one of its own.
    pub(super) fn uid(&self) -> Option<u32> {
        match &self.plan.identity {
            Identity::Dropped { id, .. } => Some(*id),
            Identity::Own { .. } => None,
        }
    }

    /// What the VM costs the host (VMM and device backend together), where its cgroup says.
    pub(super) fn usage(&self) -> Option<ResourceUsage> {
        self.cgroup.lock().as_ref().map(KernelCgroup::usage)
    }

    /// Makes the VM work in the background: it gets a CPU only as the host's other work
    /// leaves it (see `KernelCgroup::lower_cpu_weight`). Best effort: without a cgroup or a
    /// cpu controller it competes as any VM does, and says so.
    pub(super) fn background(&self) {
        let cgroup = self.cgroup.lock();
        let lowered = cgroup.as_ref().map(KernelCgroup::lower_cpu_weight);
        if let Some(Err(error)) = lowered {
            tracing::warn!(%error, "microvm: a background VM runs at the normal CPU weight");
        }
    }

    /// How many times the host's OOM killer acted in the VM's cgroup.
    pub(super) fn oom_kills(&self) -> u64 {
        self.cgroup
            .lock()
            .as_ref()
            .and_then(KernelCgroup::oom_kills)
            .unwrap_or(0)
    }

    /// Lets the cgroup be, with the VM in it: the VM outlives this gateway, and the next one
    /// (or the VM's keeper) removes it.
    pub(super) fn keep(&self) {
        drop(self.cgroup.lock().take());
    }

    /// The cgroup, written down for a gateway that adopts the VM.
    pub(super) fn cgroup_parts(&self) -> Option<cgroups::CgroupParts> {
        self.cgroup.lock().as_ref().map(KernelCgroup::parts)
    }

    /// Removes the cgroup, killing what is left in it (the identity is free once the jail
    /// is dropped). Blocking.
    pub(super) fn release(&self) {
        let cgroup = self.cgroup.lock().take();
        if let Some(cgroup) = cgroup {
            cgroup.remove();
        }
    }
}

/// The VM's limits on the host: memory `memory_mib`, `cpu_millis` of CPU, [`PIDS`].
pub(super) fn host_limits(memory_mib: u64, cpu_millis: Option<u32>) -> Limits {
    Limits {
        memory_bytes: Some(memory_mib << 20),
        cpu_millis,
        pids: Some(PIDS),
        workspace_bytes: None,
    }
}

/// Writes `bytes` to the file at `path` (open, write, close).
fn write_file(path: &[u8], bytes: &[u8]) -> io::Result<()> {
    // SAFETY: `path` is NUL-terminated (a CString's bytes or a literal with `\0`).
    let fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_WRONLY | libc::O_CLOEXEC) };
    check(fd)?;
    // SAFETY: `bytes` is a live buffer of its length; `fd` is ours.
    let written = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    let error = io::Error::last_os_error();
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(fd) };
    if written == bytes.len() as isize {
        Ok(())
    } else {
        Err(error)
    }
}

fn set_limit(resource: libc::__rlimit_resource_t, value: u64) -> io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: a plain struct passed by reference.
    check(unsafe { libc::setrlimit(resource, &limit) }).map(drop)
}

/// Runs in the child between fork and exec.
fn confine_child(plan: &ChildPlan) -> io::Result<()> {
    // Into the cgroup first, so everything after is accounted there: writing 0 moves the
    // writer itself.
    for procs in &plan.cgroup_procs {
        write_file(procs.as_bytes_with_nul(), b"0")?;
    }
    set_limit(libc::RLIMIT_FSIZE, plan.fsize)?;
    set_limit(libc::RLIMIT_CORE, 0)?;
    // SAFETY: setting a signal's disposition to ignore.
    if unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) } == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    let namespaces =
        libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
    match &plan.identity {
        Identity::Dropped { id, groups, .. } => {
            // Namespaces and the new root while still root; then the ids, which drops
            // every capability.
            sys::unshare(namespaces)?;
            plan.root.enter()?;
            // SAFETY: setgroups and setres[ug]id take integers and a live slice.
            unsafe {
                check(libc::setgroups(groups.len(), groups.as_ptr()))?;
                check(libc::setresgid(*id, *id, *id))?;
                check(libc::setresuid(*id, *id, *id))?;
            }
        }
        Identity::Own { uid_map, gid_map } => {
            sys::unshare(libc::CLONE_NEWUSER | namespaces)?;
            write_file(b"/proc/self/setgroups\0", b"deny")?;
            write_file(b"/proc/self/uid_map\0", uid_map)?;
            write_file(b"/proc/self/gid_map\0", gid_map)?;
            // The namespace's capabilities (over its own mounts only) build the root.
            plan.root.enter()?;
        }
    }
    // After the root is built: building it opens a descriptor per bound path, and the
    // child inherits the gateway's table, whose lowest free number may be above the limit.
    set_limit(libc::RLIMIT_NOFILE, NOFILE)?;
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
    // A descriptor the gateway opened without close-on-exec (a library's, or a race
    // between another thread's open and its fcntl) must not reach the VMM: every one above
    // stdio is marked now. A snapshot's descriptor is put in place after this, on purpose.
    // SAFETY: close_range with integer arguments.
    check(unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    } as libc::c_int)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_never_shared_while_live() {
        let identities = Identities::default();
        let a = identities.take().unwrap();
        let b = identities.take().unwrap();
        assert_ne!(a, b);
        identities.give_back(a);
        let live = identities.0.lock().live.clone();
        assert_eq!(live, HashSet::from([b]));
    }

    #[test]
    fn a_surviving_vms_uid_is_never_given_again() {
        let identities = Identities::default();
        identities.reserve(&[IDENTITY_BASE, IDENTITY_BASE + 1, 1000]);
        let taken: Vec<u32> = (0..3).map(|_| identities.take().unwrap()).collect();
        assert_eq!(taken, vec![2, 3, 4]);
        // The uid outside the range took no slot.
        assert_eq!(identities.0.lock().live, HashSet::from([0, 1, 2, 3, 4]));
    }

    #[test]
    fn the_file_size_limit_is_the_disk_or_a_floor() {
        assert_eq!(fsize(1 << 30, 512), 1 << 30);
        assert_eq!(fsize(8 << 20, 1184), 1184 << 20);
        assert_eq!(fsize(8 << 20, 32), MIN_FSIZE);
    }
}
