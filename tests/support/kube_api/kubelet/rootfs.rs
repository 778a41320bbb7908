//! A container's filesystem, planned before anything is mounted: what the container sees
//! at each path, and the mount operations that build it inside the pod's own mount
//! namespace (never on the host's). The base is the host's system directories
//! (`/usr`, `/etc`, and `/bin`, `/lib`… as the host has them), read-only, on a fresh
//! tmpfs root; the image's binds and the pod's volumes go on top. A target whose parent
//! directory does not exist under a read-only host directory is made by "shadowing" that
//! directory: a tmpfs over it, holding its original entries bound back one by one, so
//! nothing is ever created on the host's filesystem.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// One step of building the root, run by the pod's setup script with `$R` as the root.
#[derive(Debug, Clone)]
pub enum Op {
    Mkdir {
        path: String,
        mode: u32,
    },
    Touch {
        path: String,
    },
    Symlink {
        path: String,
        target: String,
    },
    Bind {
        source: PathBuf,
        path: String,
        read_only: bool,
    },
    Tmpfs {
        path: String,
        options: String,
    },
    /// proc, sysfs, devpts.
    Special {
        path: String,
        fstype: String,
        options: String,
    },
    Write {
        path: String,
        data: Vec<u8>,
        mode: u32,
        gid: Option<u32>,
    },
    ReadOnly {
        path: String,
    },
    /// Makes a read-only directory writable, keeping what it shows (see `make_writable`).
    Shadow {
        path: String,
        mode: u32,
        entries: Vec<(String, Entry)>,
        /// The number of the staging directory its old content is kept in meanwhile.
        staging: usize,
    },
}

/// An entry of a shadowed directory.
#[derive(Debug, Clone)]
pub enum Entry {
    Dir,
    File,
    Symlink(String),
}

/// What backs a mount in the container.
#[derive(Debug, Clone)]
enum Layer {
    /// A read-only bind of a host directory.
    HostDir(PathBuf),
    /// A bind of a host file.
    HostFile(PathBuf),
    /// A tmpfs the plan fills in (its entries are in `created`).
    Scratch,
    /// proc, sysfs, devpts: nothing goes under them.
    Opaque,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Dir,
    File,
    Symlink(String),
}

/// The plan of a container's root.
#[derive(Debug, Default)]
pub struct RootFs {
    mounts: BTreeMap<String, Layer>,
    created: HashMap<String, Node>,
    ops: Vec<Op>,
    shadows: usize,
}

/// The host entries at `/` the container's root shows (read-only): the system's programs,
/// libraries and configuration. Home directories, /var, /opt, /tmp and the rest are the
/// container's own (empty) directories.
const HOST_SYSTEM: [&str; 8] = [
    "usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32",
];
const EMPTY_DIRS: [(&str, u32); 9] = [
    ("home", 0o755),
    ("root", 0o700),
    ("var", 0o755),
    ("opt", 0o755),
    ("srv", 0o755),
    ("mnt", 0o755),
    ("media", 0o755),
    ("tmp", 0o1777),
    ("run", 0o755),
];
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

fn parent(path: &str) -> String {
    match path.rsplit_once('/') {
        Some(("", _)) | None => "/".to_owned(),
        Some((parent, _)) => parent.to_owned(),
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

impl RootFs {
    /// The base root: host system directories, /proc, /sys, a minimal /dev.
    pub fn base() -> Result<RootFs, String> {
        let mut fs = RootFs::default();
        fs.mounts.insert("/".to_owned(), Layer::Scratch);
        for name in HOST_SYSTEM {
            let host = Path::new("/").join(name);
            let Ok(meta) = host.symlink_metadata() else {
                continue;
            };
            let path = join("/", name);
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&host)
                    .map_err(|err| format!("{}: {err}", host.display()))?;
                fs.symlink(&path, &target.to_string_lossy())?;
            } else if meta.is_dir() {
                fs.mkdir(&path, 0o755);
                fs.push_bind(host, &path, true, true);
            }
        }
        for (name, mode) in EMPTY_DIRS {
            fs.mkdir(&join("/", name), mode);
        }
        fs.mkdir("/proc", 0o555);
        fs.special("/proc", "proc", "nosuid,nodev,noexec");
        fs.mkdir("/sys", 0o555);
        fs.special("/sys", "sysfs", "ro,nosuid,nodev,noexec");
        fs.mkdir("/dev", 0o755);
        fs.tmpfs("/dev", "mode=0755,nosuid")?;
        for device in DEVICES {
            let path = join("/dev", device);
            fs.touch(&path);
            fs.push_bind(Path::new("/dev").join(device), &path, false, false);
        }
        for (name, target) in [
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
            ("ptmx", "pts/ptmx"),
        ] {
            fs.symlink(&join("/dev", name), target)?;
        }
        fs.mkdir("/dev/pts", 0o755);
        fs.special("/dev/pts", "devpts", "newinstance,ptmxmode=0666,mode=0620");
        fs.mkdir("/dev/shm", 0o1777);
        fs.tmpfs("/dev/shm", "mode=1777,nosuid,nodev")?;
        Ok(fs)
    }

    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    fn mkdir(&mut self, path: &str, mode: u32) {
        self.ops.push(Op::Mkdir {
            path: path.to_owned(),
            mode,
        });
        self.created.insert(path.to_owned(), Node::Dir);
    }

    fn touch(&mut self, path: &str) {
        self.ops.push(Op::Touch {
            path: path.to_owned(),
        });
        self.created.insert(path.to_owned(), Node::File);
    }

    fn special(&mut self, path: &str, fstype: &str, options: &str) {
        self.ops.push(Op::Special {
            path: path.to_owned(),
            fstype: fstype.to_owned(),
            options: options.to_owned(),
        });
        self.mounts.insert(path.to_owned(), Layer::Opaque);
    }

    fn push_bind(&mut self, source: PathBuf, path: &str, read_only: bool, dir: bool) {
        self.ops.push(Op::Bind {
            source: source.clone(),
            path: path.to_owned(),
            read_only,
        });
        let layer = if dir {
            Layer::HostDir(source)
        } else {
            Layer::HostFile(source)
        };
        self.mount_at(path, layer);
    }

    /// Records a mount; whatever was under its path is hidden now.
    fn mount_at(&mut self, path: &str, layer: Layer) {
        let below = format!("{}/", path.trim_end_matches('/'));
        self.mounts.retain(|m, _| !m.starts_with(&below));
        self.created.retain(|c, _| !c.starts_with(&below));
        self.mounts.insert(path.to_owned(), layer);
    }

    /// The mount a path is under, and the path relative to it.
    fn layer_of(&self, path: &str) -> (&str, &Layer) {
        self.mounts
            .iter()
            .rev()
            .find(|(m, _)| {
                m.as_str() == "/" || path == m.as_str() || path.starts_with(&format!("{m}/"))
            })
            .map(|(m, layer)| (m.as_str(), layer))
            .expect("the root is always mounted")
    }

    /// What is at a path whose parents hold no symlinks (None: nothing).
    fn lookup(&self, path: &str) -> Option<Node> {
        let (mount, layer) = self.layer_of(path);
        let rest = path[mount.len()..].trim_start_matches('/');
        if rest.is_empty() {
            return Some(match layer {
                Layer::HostFile(_) => Node::File,
                _ => Node::Dir,
            });
        }
        match layer {
            Layer::HostDir(source) => {
                let host = source.join(rest);
                let meta = host.symlink_metadata().ok()?;
                Some(if meta.file_type().is_symlink() {
                    Node::Symlink(
                        std::fs::read_link(&host)
                            .ok()?
                            .to_string_lossy()
                            .into_owned(),
                    )
                } else if meta.is_dir() {
                    Node::Dir
                } else {
                    Node::File
                })
            }
            Layer::Scratch => self.created.get(path).cloned(),
            Layer::HostFile(_) | Layer::Opaque => None,
        }
    }

    /// The path with every symlink on it resolved inside the container.
    pub fn resolve(&self, path: &str) -> Result<String, String> {
        self.resolve_from("/", path, 0)
    }

    fn resolve_from(&self, base: &str, path: &str, depth: usize) -> Result<String, String> {
        if depth > 40 {
            return Err(format!("too many levels of symbolic links at {path}"));
        }
        let mut current = if path.starts_with('/') {
            "/".to_owned()
        } else {
            base.to_owned()
        };
        let parts: Vec<&str> = path
            .split('/')
            .filter(|p| !p.is_empty() && *p != ".")
            .collect();
        for (i, part) in parts.iter().enumerate() {
            if *part == ".." {
                current = parent(&current);
                continue;
            }
            let next = join(&current, part);
            match self.lookup(&next) {
                Some(Node::Symlink(target)) => {
                    let resolved = self.resolve_from(&current, &target, depth + 1)?;
                    let rest = parts[i + 1..].join("/");
                    return if rest.is_empty() {
                        Ok(resolved)
                    } else {
                        self.resolve_from(&resolved, &rest, depth + 1)
                    };
                }
                _ => current = next,
            }
        }
        Ok(current)
    }

    /// Makes `path` a directory (and its parents), shadowing read-only host directories
    /// where something has to be created in them.
    pub fn ensure_dir(&mut self, path: &str) -> Result<(), String> {
        if path == "/" {
            return Ok(());
        }
        match self.lookup(path) {
            Some(Node::Dir) => Ok(()),
            Some(_) => Err(format!("{path} exists and is not a directory")),
            None => {
                let up = parent(path);
                self.ensure_dir(&up)?;
                self.make_writable(&up)?;
                self.mkdir(path, 0o755);
                Ok(())
            }
        }
    }

    /// Lets the plan create entries in `dir`: a scratch tmpfs already allows it; a host
    /// directory is shadowed: its current content (host entries and whatever is mounted
    /// in it) is kept aside with a recursive bind, a tmpfs covers it, and each entry is
    /// bound back.
    fn make_writable(&mut self, dir: &str) -> Result<(), String> {
        let (mount, layer) = self.layer_of(dir);
        let source = match layer {
            Layer::Scratch => return Ok(()),
            Layer::HostDir(source) => source.join(dir[mount.len()..].trim_start_matches('/')),
            Layer::HostFile(_) | Layer::Opaque => {
                return Err(format!("cannot create anything under {dir}"))
            }
        };
        let mode = source
            .metadata()
            .map(|m| m.permissions().mode() & 0o7777)
            .unwrap_or(0o755);
        let mut entries: BTreeMap<String, Node> = BTreeMap::new();
        let listing =
            std::fs::read_dir(&source).map_err(|err| format!("{}: {err}", source.display()))?;
        for entry in listing {
            let entry = entry.map_err(|err| format!("{}: {err}", source.display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let node = if kind.is_symlink() {
                let target = std::fs::read_link(entry.path())
                    .map_err(|err| format!("{}: {err}", entry.path().display()))?;
                Node::Symlink(target.to_string_lossy().into_owned())
            } else if kind.is_dir() {
                Node::Dir
            } else if kind.is_file() {
                Node::File
            } else {
                continue;
            };
            entries.insert(name, node);
        }
        let below = format!("{dir}/");
        for (path, layer) in &self.mounts {
            if let Some(name) = path.strip_prefix(&below).filter(|n| !n.contains('/')) {
                let node = match layer {
                    Layer::HostFile(_) => Node::File,
                    _ => Node::Dir,
                };
                entries.insert(name.to_owned(), node);
            }
        }
        self.shadows += 1;
        self.ops.push(Op::Shadow {
            path: dir.to_owned(),
            mode,
            entries: entries
                .iter()
                .map(|(name, node)| {
                    let kind = match node {
                        Node::Dir => Entry::Dir,
                        Node::File => Entry::File,
                        Node::Symlink(target) => Entry::Symlink(target.clone()),
                    };
                    (name.clone(), kind)
                })
                .collect(),
            staging: self.shadows,
        });
        self.mounts.insert(dir.to_owned(), Layer::Scratch);
        for (name, node) in entries {
            let path = join(dir, &name);
            match &node {
                Node::Dir if !self.mounts.contains_key(&path) => {
                    self.mounts
                        .insert(path.clone(), Layer::HostDir(source.join(&name)));
                }
                Node::File if !self.mounts.contains_key(&path) => {
                    self.mounts
                        .insert(path.clone(), Layer::HostFile(source.join(&name)));
                }
                _ => {}
            }
            self.created.insert(path, node);
        }
        Ok(())
    }

    /// Binds a host file or directory at a container path.
    pub fn bind(&mut self, path: &str, source: &Path, read_only: bool) -> Result<(), String> {
        let source = source
            .canonicalize()
            .map_err(|err| format!("bind source {}: {err}", source.display()))?;
        let path = self.resolve(path)?;
        if source.is_dir() {
            self.ensure_dir(&path)?;
            self.push_bind(source, &path, read_only, true);
        } else {
            let up = parent(&path);
            self.ensure_dir(&up)?;
            match self.lookup(&path) {
                Some(Node::File) => {}
                Some(_) => return Err(format!("{path} exists and is not a file")),
                None => {
                    self.make_writable(&up)?;
                    self.touch(&path);
                }
            }
            self.push_bind(source, &path, read_only, false);
        }
        Ok(())
    }

    /// Mounts a fresh tmpfs at a container path; returns the resolved path.
    pub fn tmpfs(&mut self, path: &str, options: &str) -> Result<String, String> {
        let path = self.resolve(path)?;
        self.ensure_dir(&path)?;
        self.ops.push(Op::Tmpfs {
            path: path.clone(),
            options: options.to_owned(),
        });
        self.mount_at(&path, Layer::Scratch);
        Ok(path)
    }

    /// Creates a symlink (its directory is made writable if need be).
    pub fn symlink(&mut self, path: &str, target: &str) -> Result<(), String> {
        let up = parent(path);
        self.make_writable(&up)?;
        self.ops.push(Op::Symlink {
            path: path.to_owned(),
            target: target.to_owned(),
        });
        self.created
            .insert(path.to_owned(), Node::Symlink(target.to_owned()));
        Ok(())
    }

    /// Writes a file on a scratch tmpfs (a volume's content).
    pub fn write(
        &mut self,
        path: &str,
        data: &[u8],
        mode: u32,
        gid: Option<u32>,
    ) -> Result<(), String> {
        let up = parent(path);
        self.ensure_dir(&up)?;
        self.make_writable(&up)?;
        self.ops.push(Op::Write {
            path: path.to_owned(),
            data: data.to_vec(),
            mode,
            gid,
        });
        self.created.insert(path.to_owned(), Node::File);
        Ok(())
    }

    /// Makes a directory on a scratch tmpfs with a mode.
    pub fn mkdir_mode(&mut self, path: &str, mode: u32) -> Result<(), String> {
        let up = parent(path);
        self.ensure_dir(&up)?;
        self.make_writable(&up)?;
        self.mkdir(path, mode);
        Ok(())
    }

    pub fn read_only(&mut self, path: &str) {
        self.ops.push(Op::ReadOnly {
            path: path.to_owned(),
        });
    }

    /// Whether a directory exists in the container (after the plan).
    pub fn is_dir(&self, path: &str) -> bool {
        self.resolve(path)
            .is_ok_and(|p| self.lookup(&p) == Some(Node::Dir))
    }

    /// Where the container's `execvp` would find a program, as the runtime checks before
    /// starting it.
    pub fn find_executable(&self, program: &str, path_env: &str, workdir: &str) -> Option<String> {
        let is_file = |p: &str| {
            self.resolve_from(workdir, p, 0)
                .is_ok_and(|p| self.lookup(&p) == Some(Node::File))
        };
        if program.contains('/') {
            return is_file(program).then(|| program.to_owned());
        }
        path_env
            .split(':')
            .filter(|dir| !dir.is_empty())
            .map(|dir| join(dir, program))
            .find(|candidate| is_file(candidate))
    }
}
