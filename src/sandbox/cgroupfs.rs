//! Where this process sits in the host's cgroup hierarchies, read from `/proc/self/mountinfo`
//! and `/proc/self/cgroup`.
//!
//! One reader for every backend and for `doctor`: the namespaces backend nests its kernels'
//! cgroups under the gateway's own, gVisor finds the cgroups runsc makes there, and `doctor`
//! reports which hierarchy carries which controller. Each used to parse both tables its own
//! way (and gVisor assumed every v1 hierarchy is mounted at `/sys/fs/cgroup/<controller>`
//! with its root at `/`, which a container's mount of a sub-hierarchy is not).
//!
//! Must not depend on: kernels, HTTP, any one backend.

use std::path::{Path, PathBuf};

/// A mount of a cgroup file system.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    /// The cgroup the mount shows as its root (`/` unless a sub-hierarchy is mounted).
    pub root: String,
    pub mount_point: PathBuf,
    /// 1 for `cgroup`, 2 for `cgroup2`.
    pub version: u8,
    /// The super block options: a v1 hierarchy's controllers are among them.
    pub options: Vec<String>,
}

/// One line of `/proc/self/cgroup`: this process's cgroup in one hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnCgroup {
    /// The hierarchy's v1 controllers; empty for the unified (v2) hierarchy.
    pub controllers: Vec<String>,
    pub path: String,
}

/// Both tables, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tables {
    pub mounts: Vec<CgroupMount>,
    pub own: Vec<OwnCgroup>,
}

impl Tables {
    /// This process's tables; empty where `/proc` cannot be read.
    pub fn read() -> Tables {
        Tables::parse(
            &std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
            &std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default(),
        )
    }

    pub fn parse(mountinfo: &str, own: &str) -> Tables {
        Tables {
            mounts: parse_mountinfo(mountinfo),
            own: parse_proc_cgroup(own),
        }
    }

    /// This process's cgroup directory in the unified hierarchy.
    pub fn v2_dir(&self) -> Option<PathBuf> {
        let own = self.own.iter().find(|o| o.controllers.is_empty())?;
        self.mounts
            .iter()
            .filter(|m| m.version == 2)
            .find_map(|m| dir_in_mount(m, &own.path))
    }

    /// This process's cgroup directory in the v1 hierarchy of `controller`.
    pub fn v1_dir(&self, controller: &str) -> Option<PathBuf> {
        let own = self
            .own
            .iter()
            .find(|o| o.controllers.iter().any(|c| c == controller))?;
        self.mounts
            .iter()
            .filter(|m| m.version == 1 && m.options.iter().any(|o| o == controller))
            .find_map(|m| dir_in_mount(m, &own.path))
    }

    /// Whether some v1 hierarchy with `controller` is mounted.
    pub fn has_v1(&self, controller: &str) -> bool {
        self.mounts
            .iter()
            .any(|m| m.version == 1 && m.options.iter().any(|o| o == controller))
    }

    /// Whether a unified hierarchy is mounted.
    pub fn has_v2(&self) -> bool {
        self.mounts.iter().any(|m| m.version == 2)
    }

    /// This process's cgroup directory in every hierarchy it is in and that is mounted.
    pub fn own_dirs(&self) -> Vec<PathBuf> {
        self.own
            .iter()
            .filter_map(|own| {
                let mount = match own.controllers.first() {
                    None => self.mounts.iter().find(|m| m.version == 2),
                    Some(first) => self
                        .mounts
                        .iter()
                        .find(|m| m.version == 1 && m.options.iter().any(|o| o == first)),
                }?;
                dir_in_mount(mount, &own.path)
            })
            .collect()
    }
}

fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(mount_point), Some(fstype), Some(super_options)) =
            (left.get(3), left.get(4), right.first(), right.get(2))
        else {
            continue;
        };
        let version = match *fstype {
            "cgroup" => 1,
            "cgroup2" => 2,
            _ => continue,
        };
        mounts.push(CgroupMount {
            root: unescape_mountinfo(root),
            mount_point: PathBuf::from(unescape_mountinfo(mount_point)),
            version,
            options: super_options.split(',').map(str::to_owned).collect(),
        });
    }
    mounts
}

/// mountinfo escapes spaces, tabs, newlines and backslashes as octal.
fn unescape_mountinfo(field: &str) -> String {
    field
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

fn parse_proc_cgroup(text: &str) -> Vec<OwnCgroup> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            Some(OwnCgroup {
                controllers: controllers
                    .split(',')
                    .filter(|c| !c.is_empty())
                    .map(str::to_owned)
                    .collect(),
                path: path.to_owned(),
            })
        })
        .collect()
}

/// The directory of cgroup `path` within `mount`, or `None` when the mount's root does not
/// contain it.
pub fn dir_in_mount(mount: &CgroupMount, path: &str) -> Option<PathBuf> {
    let relative = if mount.root == "/" {
        path.trim_start_matches('/')
    } else {
        path.strip_prefix(mount.root.as_str())?
            .trim_start_matches('/')
    };
    Some(Path::new(&mount.mount_point).join(relative))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
30 23 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw
34 30 0:30 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime - cgroup cgroup rw,cpu,cpuacct
36 30 0:32 /docker/abc /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime - cgroup cgroup rw,pids
37 30 0:33 / /mnt/with\\040space rw - cgroup cgroup rw,freezer
";
    const OWN: &str = "\
5:pids:/docker/abc/gw
4:cpu,cpuacct:/gw
3:memory:/gw
2:freezer:/
0::/gw
";

    #[test]
    fn finds_own_directories_per_controller_and_hierarchy() {
        let tables = Tables::parse(HYBRID, OWN);
        assert_eq!(tables.mounts.len(), 5);
        assert_eq!(
            tables.v1_dir("memory"),
            Some(PathBuf::from("/sys/fs/cgroup/memory/gw"))
        );
        assert_eq!(
            tables.v1_dir("cpuacct"),
            Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/gw"))
        );
        // A sub-hierarchy mounted at its own root: the path is taken relative to it.
        assert_eq!(
            tables.v1_dir("pids"),
            Some(PathBuf::from("/sys/fs/cgroup/pids/gw"))
        );
        assert_eq!(
            tables.v2_dir(),
            Some(PathBuf::from("/sys/fs/cgroup/unified/gw"))
        );
        assert!(tables.has_v1("cpu") && !tables.has_v1("blkio") && tables.has_v2());
        assert_eq!(
            tables.mounts[4].mount_point,
            PathBuf::from("/mnt/with space")
        );
        assert_eq!(tables.own_dirs().len(), 5);
    }

    #[test]
    fn a_path_outside_the_mounted_root_has_no_directory() {
        let tables = Tables::parse(HYBRID, "5:pids:/elsewhere\n");
        assert_eq!(tables.v1_dir("pids"), None);
        assert!(Tables::parse("", "").own_dirs().is_empty());
    }
}
