//! Memory, process-count and CPU limits through cgroups, v2 where the host delegates the
//! controllers to a unified hierarchy and v1 otherwise.
//!
//! Runs in the gateway, which creates one cgroup per sandbox nested under the gateway's
//! *own* cgroup (`<own>/cellgate/<name>`), so whoever accounts for the gateway (a systemd
//! unit, a container, a job scheduler) still accounts for its kernels. Shared by the
//! backends that make their cgroups themselves: the namespaces backend moves its sandbox
//! helper into one before it creates the sandbox's init (so every process of the sandbox is
//! inside from its first instruction, and the init unshares a cgroup namespace rooted
//! there), the microvm backend starts each VMM and its device backend inside one
//! ([`KernelCgroup::procs_files`]). gVisor's runsc makes its own (`gvisor/cgroups.rs`).
//!
//! Layouts:
//! * **v2** (`cgroup2` mount whose cgroup lists `memory` in `cgroup.controllers`):
//!   `memory.max`, `memory.swap.max = 0`, `pids.max`, `cpu.max`. Enabling controllers for
//!   children needs the gateway's own cgroup to have no processes of its own (the "no
//!   internal processes" rule); if it has, creation fails and the gateway runs the kernel
//!   without cgroup limits, saying so. The development hosts only have v1 controllers:
//!   `tests/it/cgroup_v2.rs` runs the limit tests in a VM with the v2 hierarchy alone, each
//!   gateway started in a cgroup holding its processes (so through [`move_into_leaf`]).
//! * **v1** (hybrid hosts such as ours: `cgroup` mounts per controller, the unified mount has
//!   no controllers): `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`, so swap is
//!   no way around it), `pids.max`, `cpu.cfs_quota_us`/`cpu.cfs_period_us`, and `cpuacct`
//!   for CPU accounting.
//!
//! Creating cgroups needs root or a delegated subtree. An unprivileged gateway without one
//! gets no cgroup; the launcher then logs which limits are not enforced, and sets
//! `RLIMIT_AS` for a memory limit as the nearest substitute.
//!
//! The pid limit counts threads as well as processes; the caller adds whatever of its own
//! machinery shares the cgroup.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sandbox::cgroupfs::Tables;
use crate::sandbox::{Limits, ResourceUsage};

/// The directory under the gateway's own cgroup that holds the kernels' cgroups.
const PARENT: &str = "cellgate";
/// The leaf the gateway's own processes move to on cgroup v2 when its cgroup must hand
/// controllers down (see [`move_into_leaf`]).
const GATEWAY_LEAF: &str = "cellgate-gateway";

/// CFS period for CPU limits.
const CPU_PERIOD_US: u64 = 100_000;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cgroups unavailable: {0}")]
    Unavailable(String),
    #[error("cannot {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> CgroupError {
    let what = what.into();
    move |source| CgroupError::Io { what, source }
}

/// One v1 controller hierarchy: its name and the gateway's own cgroup directory in it.
#[derive(Debug, Clone)]
pub struct V1Controller {
    name: &'static str,
    own_dir: PathBuf,
}

/// Where kernels' cgroups go on this host.
#[derive(Debug, Clone)]
pub enum Hierarchy {
    V2 { own_dir: PathBuf },
    V1 { controllers: Vec<V1Controller> },
    Unavailable(String),
}

impl Hierarchy {
    /// Looks at this process's mounts and cgroups.
    pub fn detect() -> Hierarchy {
        let (Ok(mountinfo), Ok(own)) = (
            fs::read_to_string("/proc/self/mountinfo"),
            fs::read_to_string("/proc/self/cgroup"),
        ) else {
            return Hierarchy::Unavailable(
                "cannot read /proc/self/mountinfo or /proc/self/cgroup".into(),
            );
        };
        Hierarchy::from_tables(&mountinfo, &own)
    }

    fn from_tables(mountinfo: &str, own: &str) -> Hierarchy {
        let tables = Tables::parse(mountinfo, own);

        // v2 first, when it carries the memory controller.
        if let Some(dir) = tables.v2_dir() {
            let controllers =
                fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            if controllers.split_whitespace().any(|c| c == "memory") {
                return Hierarchy::V2 { own_dir: dir };
            }
        }

        let controllers: Vec<V1Controller> = ["memory", "pids", "cpu", "cpuacct"]
            .into_iter()
            .filter_map(|name| {
                tables
                    .v1_dir(name)
                    .map(|own_dir| V1Controller { name, own_dir })
            })
            .collect();
        if controllers.is_empty() {
            Hierarchy::Unavailable(
                "no cgroup v2 controllers and no v1 memory, pids or cpu hierarchy".into(),
            )
        } else {
            Hierarchy::V1 { controllers }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Hierarchy::V2 { own_dir } => format!("cgroup v2 under {}", own_dir.display()),
            Hierarchy::V1 { controllers } => format!(
                "cgroup v1 ({})",
                controllers
                    .iter()
                    .map(|c| c.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Hierarchy::Unavailable(reason) => format!("no cgroups: {reason}"),
        }
    }

    /// Creates the cgroup of one kernel process and writes its limits.
    pub fn create(&self, name: &str, limits: &Limits) -> Result<KernelCgroup, CgroupError> {
        match self {
            Hierarchy::Unavailable(reason) => Err(CgroupError::Unavailable(reason.clone())),
            Hierarchy::V2 { own_dir } => create_v2(own_dir, name, limits),
            Hierarchy::V1 { controllers } => create_v1(controllers, name, limits),
        }
    }

    /// Removes empty kernel cgroups a previous gateway left behind (one killed with SIGKILL
    /// cannot clean up). rmdir refuses non-empty ones, so live kernels of another gateway
    /// sharing our cgroup are safe; cgroups younger than a minute are left alone, since
    /// another gateway may be about to move its sandbox helper into one it just created.
    pub fn sweep(&self) {
        let parents: Vec<PathBuf> = match self {
            Hierarchy::V2 { own_dir } => vec![own_dir.join(PARENT)],
            Hierarchy::V1 { controllers } => {
                controllers.iter().map(|c| c.own_dir.join(PARENT)).collect()
            }
            Hierarchy::Unavailable(_) => Vec::new(),
        };
        for parent in parents {
            let Ok(entries) = fs::read_dir(&parent) else {
                continue;
            };
            for entry in entries.flatten() {
                let old = entry
                    .metadata()
                    .ok()
                    .filter(|m| m.is_dir())
                    .and_then(|m| m.modified().ok()?.elapsed().ok());
                if old.is_some_and(|age| age > Duration::from_secs(60)) {
                    let _ = fs::remove_dir(entry.path());
                }
            }
        }
    }
}

/// A cgroup name from a kernel id: only characters that are safe in a path component.
pub fn cgroup_name(kernel_id: &str, unique: &str) -> String {
    let clean: String = kernel_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    format!("{clean}.{unique}")
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), CgroupError> {
    fs::write(dir.join(file), value).map_err(io_err(format!(
        "write {value:?} to {}",
        dir.join(file).display()
    )))
}

fn make_dir(dir: &Path) -> Result<(), CgroupError> {
    match fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(err) => Err(io_err(format!("create {}", dir.display()))(err)),
    }
}

/// cgroup v2 lets a cgroup hand controllers to its children only while it holds no process
/// itself (the "no internal processes" rule, EBUSY): a gateway started by systemd with
/// `Delegate=yes`, or as a container's process, sits in the very cgroup it was delegated.
/// Its processes (the gateway, and any other process of that cgroup, all of them in the
/// subtree delegated to it) move into a leaf beside the kernels' parent, as container
/// runtimes do with their init; the cgroup is then free to delegate. Only taken on EBUSY,
/// so a gateway already in a leaf (or on v1) is never moved.
fn move_into_leaf(own_dir: &Path) -> Result<(), CgroupError> {
    let leaf = own_dir.join(GATEWAY_LEAF);
    make_dir(&leaf)?;
    let procs = fs::read_to_string(own_dir.join("cgroup.procs")).map_err(io_err(format!(
        "read {}",
        own_dir.join("cgroup.procs").display()
    )))?;
    for pid in procs.split_whitespace() {
        match fs::write(leaf.join("cgroup.procs"), pid) {
            Ok(()) => {}
            // Gone since the list was read.
            Err(err) if err.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()) => {}
            Err(err) => {
                return Err(io_err(format!(
                    "move process {pid} into {}",
                    leaf.display()
                ))(err))
            }
        }
    }
    tracing::info!(leaf = %leaf.display(), "cgroup v2: moved the gateway's processes into a leaf so that its cgroup can delegate controllers to kernels");
    Ok(())
}

fn create_v2(own_dir: &Path, name: &str, limits: &Limits) -> Result<KernelCgroup, CgroupError> {
    let parent = own_dir.join(PARENT);
    make_dir(&parent)?;
    let available = fs::read_to_string(own_dir.join("cgroup.controllers")).unwrap_or_default();
    let wanted: Vec<&str> = ["memory", "pids", "cpu"]
        .into_iter()
        .filter(|c| available.split_whitespace().any(|a| a == *c))
        .collect();
    let enable = wanted
        .iter()
        .map(|c| format!("+{c}"))
        .collect::<Vec<_>>()
        .join(" ");
    if !enable.is_empty() {
        match write(own_dir, "cgroup.subtree_control", &enable) {
            Err(CgroupError::Io { source, .. })
                if source.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) =>
            {
                move_into_leaf(own_dir)?;
                write(own_dir, "cgroup.subtree_control", &enable)?;
            }
            other => other?,
        }
        write(&parent, "cgroup.subtree_control", &enable)?;
    }
    let dir = parent.join(name);
    make_dir(&dir)?;
    let cgroup = KernelCgroup {
        version: 2,
        dirs: vec![("unified", dir.clone())],
        memory_limited: false,
    };
    // A controller the gateway's cgroup was not given (a delegation of `memory pids` alone,
    // say) has no files here: its limit is left out, and the caller warns about it
    // ([`KernelCgroup::has`]), rather than failing the whole cgroup and losing the others.
    let result = (|| {
        let mut memory_limited = false;
        if let Some(bytes) = limits.memory_bytes.filter(|_| wanted.contains(&"memory")) {
            write(&dir, "memory.max", &bytes.to_string())?;
            if dir.join("memory.swap.max").exists() {
                write(&dir, "memory.swap.max", "0")?;
            }
            memory_limited = true;
        }
        if let Some(pids) = limits.pids.filter(|_| wanted.contains(&"pids")) {
            write(&dir, "pids.max", &pids.to_string())?;
        }
        if let Some(millis) = limits.cpu_millis.filter(|_| wanted.contains(&"cpu")) {
            write(
                &dir,
                "cpu.max",
                &format!("{} {CPU_PERIOD_US}", cpu_quota_us(millis)),
            )?;
        }
        Ok(memory_limited)
    })();
    match result {
        Ok(memory_limited) => Ok(KernelCgroup {
            memory_limited,
            ..cgroup
        }),
        Err(err) => {
            cgroup.remove();
            Err(err)
        }
    }
}

fn create_v1(
    controllers: &[V1Controller],
    name: &str,
    limits: &Limits,
) -> Result<KernelCgroup, CgroupError> {
    let mut cgroup = KernelCgroup {
        version: 1,
        dirs: Vec::new(),
        memory_limited: false,
    };
    let result = (|| {
        for controller in controllers {
            let parent = controller.own_dir.join(PARENT);
            make_dir(&parent)?;
            let dir = parent.join(name);
            make_dir(&dir)?;
            cgroup.dirs.push((controller.name, dir.clone()));
            match controller.name {
                "memory" => {
                    if let Some(bytes) = limits.memory_bytes {
                        write(&dir, "memory.limit_in_bytes", &bytes.to_string())?;
                        // Swap must not be a way around the limit; absent without swap
                        // accounting, so a failure here is not an error.
                        let _ = write(&dir, "memory.memsw.limit_in_bytes", &bytes.to_string());
                        cgroup.memory_limited = true;
                    }
                }
                "pids" => {
                    if let Some(pids) = limits.pids {
                        write(&dir, "pids.max", &pids.to_string())?;
                    }
                }
                "cpu" => {
                    if let Some(millis) = limits.cpu_millis {
                        write(&dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                        write(&dir, "cpu.cfs_quota_us", &cpu_quota_us(millis).to_string())?;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(cgroup),
        Err(err) => {
            cgroup.remove();
            Err(err)
        }
    }
}

/// CFS quota for a share of CPUs in thousandths; the kernel's minimum is 1 ms.
fn cpu_quota_us(millis: u32) -> u64 {
    (u64::from(millis) * CPU_PERIOD_US / 1000).max(1000)
}

/// The cgroup (one directory per v1 controller, or one v2 directory) of one kernel process.
/// A description only: dropping it removes nothing ([`KernelCgroup::remove`] does).
#[derive(Debug, Clone)]
pub struct KernelCgroup {
    version: u8,
    dirs: Vec<(&'static str, PathBuf)>,
    memory_limited: bool,
}

/// A [`KernelCgroup`] written down, for the gateway that adopts its kernel.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct CgroupParts {
    pub version: u8,
    pub dirs: Vec<(String, PathBuf)>,
    pub memory_limited: bool,
}

/// The controller names a cgroup directory is filed under.
const CONTROLLERS: &[&str] = &["memory", "pids", "cpu", "cpuacct", "unified"];

impl KernelCgroup {
    pub fn parts(&self) -> CgroupParts {
        CgroupParts {
            version: self.version,
            dirs: self
                .dirs
                .iter()
                .map(|(name, dir)| ((*name).to_owned(), dir.clone()))
                .collect(),
            memory_limited: self.memory_limited,
        }
    }

    /// The cgroup `parts` describe; `None` when they name a controller this gateway does
    /// not know or a directory that is not a cgroup's.
    pub fn from_parts(parts: &CgroupParts) -> Option<KernelCgroup> {
        let dirs = parts
            .dirs
            .iter()
            .map(|(name, dir)| {
                let name = CONTROLLERS.iter().find(|known| **known == name)?;
                dir.join("cgroup.procs")
                    .exists()
                    .then(|| (*name, dir.clone()))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(KernelCgroup {
            version: parts.version,
            dirs,
            memory_limited: parts.memory_limited,
        })
    }

    /// Whether a memory limit is enforced by this cgroup.
    pub fn memory_limited(&self) -> bool {
        self.memory_limited
    }

    /// Whether this cgroup enforces pid and CPU limits (it has those controllers). On v2, the
    /// controllers its parent hands it (`cgroup.controllers`), which need not be all three.
    pub fn has(&self, controller: &str) -> bool {
        if self.version == 2 {
            self.dirs.iter().any(|(_, dir)| {
                fs::read_to_string(dir.join("cgroup.controllers"))
                    .is_ok_and(|c| c.split_whitespace().any(|c| c == controller))
            })
        } else {
            self.dirs.iter().any(|(name, _)| *name == controller)
        }
    }

    /// Moves a process (and so its future children) into the cgroup.
    pub fn join(&self, pid: u32) -> Result<(), CgroupError> {
        for (_, dir) in &self.dirs {
            write(dir, "cgroup.procs", &pid.to_string())?;
        }
        Ok(())
    }

    /// The `cgroup.procs` files a process writes `0` to in order to move itself in: what a
    /// child does between fork and exec, so no instruction of its program runs outside.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(_, dir)| dir.join("cgroup.procs"))
            .collect()
    }

    /// Gives the cgroup an eighth of the default CPU weight (`cpu.shares` 128 under v1,
    /// `cpu.weight` 12 under v2): its processes get a CPU the others leave, and yield it
    /// to them. For work in the background, such as making a warm-pool snapshot.
    pub fn lower_cpu_weight(&self) -> Result<(), CgroupError> {
        let dir = self
            .dir("cpu")
            .ok_or_else(|| CgroupError::Unavailable("no cpu controller".to_owned()))?;
        if self.version == 2 {
            write(dir, "cpu.weight", "12")
        } else {
            write(dir, "cpu.shares", "128")
        }
    }

    fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(name, _)| self.version == 2 || *name == controller)
            .map(|(_, dir)| dir.as_path())
    }

    fn read_u64(&self, controller: &str, file: &str) -> Option<u64> {
        fs::read_to_string(self.dir(controller)?.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// How many forks the pids limit refused (`max` in `pids.events`, v1 and v2 alike).
    pub fn pids_limit_hits(&self) -> Option<u64> {
        let text = fs::read_to_string(self.dir("pids")?.join("pids.events")).ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix("max "))
            .and_then(|n| n.trim().parse().ok())
    }

    /// How many processes the OOM killer has killed in this cgroup.
    pub fn oom_kills(&self) -> Option<u64> {
        let file = if self.version == 2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        let text = fs::read_to_string(self.dir("memory")?.join(file)).ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
    }

    pub fn usage(&self) -> ResourceUsage {
        if self.version == 2 {
            let cpu_usec = self.dir("cpu").and_then(|dir| {
                fs::read_to_string(dir.join("cpu.stat"))
                    .ok()?
                    .lines()
                    .find_map(|line| {
                        line.strip_prefix("usage_usec ")
                            .and_then(|v| v.trim().parse::<u64>().ok())
                    })
            });
            ResourceUsage {
                cpu_time: cpu_usec.map(Duration::from_micros),
                memory_bytes: self.read_u64("memory", "memory.current"),
                memory_peak_bytes: self.read_u64("memory", "memory.peak"),
            }
        } else {
            ResourceUsage {
                cpu_time: self
                    .read_u64("cpuacct", "cpuacct.usage")
                    .map(Duration::from_nanos),
                memory_bytes: self.read_u64("memory", "memory.usage_in_bytes"),
                memory_peak_bytes: self.read_u64("memory", "memory.max_usage_in_bytes"),
            }
        }
    }

    /// SIGKILLs every process in the cgroup.
    pub fn kill_all(&self) {
        if self.version == 2 {
            if let Some(dir) = self.dir("memory") {
                if fs::write(dir.join("cgroup.kill"), "1").is_ok() {
                    return;
                }
            }
        }
        for (_, dir) in &self.dirs {
            let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) else {
                continue;
            };
            for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
                if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
    }

    /// Kills what is left and removes the directories. Blocking (it waits briefly for killed
    /// processes to leave): call it off the async runtime.
    pub fn remove(&self) {
        for attempt in 0..50 {
            let mut busy = false;
            for (_, dir) in &self.dirs {
                match fs::remove_dir(dir) {
                    Ok(()) => {}
                    Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                    Err(_) => busy = true,
                }
            }
            if !busy {
                return;
            }
            if attempt == 0 {
                self.kill_all();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::warn!(dirs = ?self.dirs, "could not remove a kernel's cgroup");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const HYBRID_CGROUP: &str = "\
8:pids:/
4:memory:/process_api/49dadd
2:cpuacct:/
1:cpu:/
0::/
";

    #[test]
    fn hybrid_layout_uses_v1_under_the_own_cgroup() {
        let Hierarchy::V1 { controllers } = Hierarchy::from_tables(HYBRID_MOUNTINFO, HYBRID_CGROUP)
        else {
            panic!("expected v1");
        };
        let dirs: Vec<(&str, PathBuf)> = controllers
            .into_iter()
            .map(|c| (c.name, c.own_dir))
            .collect();
        assert_eq!(
            dirs,
            vec![
                (
                    "memory",
                    PathBuf::from("/sys/fs/cgroup/memory/process_api/49dadd")
                ),
                ("pids", PathBuf::from("/sys/fs/cgroup/pids")),
                ("cpu", PathBuf::from("/sys/fs/cgroup/cpu")),
                ("cpuacct", PathBuf::from("/sys/fs/cgroup/cpuacct")),
            ]
        );
    }

    #[test]
    fn comounted_controllers_and_mount_roots_are_understood() {
        let mountinfo =
            "40 31 0:37 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n";
        let own = "3:cpu,cpuacct:/docker/abc/sub\n";
        let Hierarchy::V1 { controllers } = Hierarchy::from_tables(mountinfo, own) else {
            panic!("expected v1");
        };
        assert_eq!(controllers.len(), 2);
        assert_eq!(
            controllers[0].own_dir,
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/sub")
        );
    }

    #[test]
    fn nothing_mounted_means_unavailable() {
        assert!(matches!(
            Hierarchy::from_tables("", "0::/\n"),
            Hierarchy::Unavailable(_)
        ));
    }

    /// A gateway's cgroup given `memory` and `cpu` but not `pids` (files stand in for the
    /// cgroup file system): the kernel's cgroup gets the memory and CPU limits, not a failure
    /// for want of `pids.max`, and says it has no pids controller.
    #[test]
    fn v2_limits_only_for_the_controllers_handed_down() {
        let own = tempfile::tempdir().expect("tempdir");
        fs::write(own.path().join("cgroup.controllers"), "cpu memory io\n").expect("write");
        let limits = Limits {
            memory_bytes: Some(256 << 20),
            pids: Some(64),
            cpu_millis: Some(500),
            ..Limits::default()
        };
        let cgroup = create_v2(own.path(), "k.1", &limits).expect("create");
        let dir = own.path().join(PARENT).join("k.1");
        let read = |file: &str| fs::read_to_string(dir.join(file)).ok();
        assert_eq!(read("memory.max").as_deref(), Some("268435456"));
        assert_eq!(read("cpu.max").as_deref(), Some("50000 100000"));
        assert_eq!(read("pids.max"), None);
        assert!(cgroup.memory_limited());
        assert_eq!(
            fs::read_to_string(own.path().join("cgroup.subtree_control")).ok(),
            Some("+memory +cpu".to_owned())
        );
        // What the kernel would list in the new cgroup.
        fs::write(dir.join("cgroup.controllers"), "cpu memory\n").expect("write");
        assert!(cgroup.has("memory") && cgroup.has("cpu") && !cgroup.has("pids"));
    }

    #[test]
    fn names_and_quotas() {
        assert_eq!(cgroup_name("a/b c", "1"), "a_b_c.1");
        assert_eq!(cpu_quota_us(500), 50_000);
        assert_eq!(cpu_quota_us(2000), 200_000);
        assert_eq!(cpu_quota_us(1), 1000);
    }
}
