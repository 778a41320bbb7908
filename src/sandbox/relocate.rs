//! The kernel's view of its own paths: the same fixed paths in every sandbox, whatever the
//! host calls them.
//!
//! A sandbox that showed its directories at their host paths told the code inside where the
//! gateway keeps its runtime files, where the checkout lives and which user's home holds the
//! interpreter (through `$HOME`, the working directory, `sys.prefix` and `mountinfo`). So the
//! backends show them at fixed paths instead:
//!
//! | host | inside |
//! |---|---|
//! | the kernel's workspace | [`WORKSPACE`] (`/home/user`, also `$HOME`) |
//! | the generation's runtime directory (connection file, ipc sockets, proxy socket) | [`RUN_DIR`] (`/run/cellgate`) |
//! | the kernel's venv | [`VENV`] (`/opt/cellgate/venv`), rebuilt: see [`VenvView`] |
//! | a kernel environment without Python (marked by [`ENVIRONMENT_MARKER`]) | [`VENV`], bound whole |
//! | the venv's base interpreter prefix | [`PYTHON`] (`/opt/cellgate/python`) |
//!
//! [`Relocation`] maps host paths (and the path lists of the kernel's command and
//! environment, path by path) to inside paths; the gateway itself keeps using host paths,
//! and the connection file the kernel reads is rewritten to the inside ones. The venv is
//! rebuilt rather than bound: its `lib` bound, `pyvenv.cfg`, interpreter links and console
//! scripts rewritten. A prefix that is `/`, overlaps the kernel's directories or is no
//! interpreter's is never bound whole.
//!
//! Nor does anything else the kernel can read name a host path: a namespaces sandbox binds
//! no host directory whose `mountinfo` line would give it away (the runtime directory is a
//! tmpfs of the sandbox's own, which the gateway reaches through the helper's
//! `/proc/<pid>/root`, with the connection file written into it by the init; the Python
//! environment is shown by read-only overlays; the egress bridge reaches the proxy's socket
//! through a descriptor the init opened, never a path), and `./dev setup` builds the kernel
//! venv from Debian's interpreter at `/opt/cellgate/venv` in a private mount namespace, so
//! `sysconfig`, scripts and compiled modules name only `/usr` and that path. A base
//! interpreter built on the host (pyenv) still names its install prefix in its own files.
//!
//! Must not depend on: kernels, HTTP.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

/// The kernel's workspace and `$HOME`.
pub const WORKSPACE: &str = "/home/user";
/// The kernel's runtime directory: its connection file and ipc sockets.
pub const RUN_DIR: &str = "/run/cellgate";
/// The kernel's Python environment (a venv view of the host's venv).
pub const VENV: &str = "/opt/cellgate/venv";
/// The base interpreter's install prefix.
pub const PYTHON: &str = "/opt/cellgate/python";
/// The file that makes a directory a kernel environment without Python (`./dev setup`
/// writes it into `kernels/deno/.venv`): a kernel whose program is in its `bin/` sees the
/// directory whole at [`VENV`]. A marker, not a guess from the layout: a program under
/// some `~/.local/bin` must never show the whole of `~/.local`.
pub const ENVIRONMENT_MARKER: &str = "cellgate-environment";

/// Host path prefixes and the inside paths they are shown at; the longest prefix wins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Relocation {
    pairs: Vec<(PathBuf, PathBuf)>,
}

impl Relocation {
    pub fn new() -> Relocation {
        Relocation::default()
    }

    /// Shows `host` (and everything below it) at `inside`.
    pub fn add(&mut self, host: impl Into<PathBuf>, inside: impl Into<PathBuf>) {
        self.pairs.push((host.into(), inside.into()));
        // Longest first, so a directory inside another relocated one maps by its own rule.
        self.pairs
            .sort_by_key(|(host, _)| std::cmp::Reverse(host.components().count()));
    }

    /// `path` as the kernel sees it; unchanged when no rule covers it.
    pub fn path(&self, path: &Path) -> PathBuf {
        for (host, inside) in &self.pairs {
            if let Ok(rest) = path.strip_prefix(host) {
                return if rest.as_os_str().is_empty() {
                    inside.clone()
                } else {
                    inside.join(rest)
                };
            }
        }
        path.to_owned()
    }

    /// A value of the kernel's command or environment: each `:`-separated absolute path in
    /// it mapped (PATH, PYTHONPATH and single paths alike). Other text is left alone.
    pub fn text(&self, value: &str) -> String {
        value
            .split(':')
            .map(|part| {
                let path = Path::new(part);
                let plain = path.is_absolute()
                    && path
                        .components()
                        .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
                if plain {
                    self.path(path).to_string_lossy().into_owned()
                } else {
                    part.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join(":")
    }

    /// The kernel's command: each argument mapped as [`Relocation::text`], and the value of
    /// an `--option=/path` argument too.
    pub fn argv(&self, argv: &[String]) -> Vec<String> {
        argv.iter()
            .map(|arg| match arg.split_once('=') {
                Some((option, value)) if option.starts_with('-') => {
                    format!("{option}={}", self.text(value))
                }
                _ => self.text(arg),
            })
            .collect()
    }

    pub fn env(&self, env: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        env.iter().map(|(k, v)| (k.clone(), self.text(v))).collect()
    }

    /// The connection file's JSON as the kernel must read it: its ipc endpoint prefix
    /// (`ip`, for `transport: ipc`) mapped. Other transports are returned unchanged.
    pub fn connection_json(&self, json: &[u8]) -> Result<Vec<u8>, serde_json::Error> {
        let mut value: serde_json::Value = serde_json::from_slice(json)?;
        if value["transport"] == "ipc" {
            if let Some(ip) = value["ip"].as_str() {
                let mapped = self.path(Path::new(ip)).to_string_lossy().into_owned();
                value["ip"] = serde_json::Value::String(mapped);
            }
        }
        serde_json::to_vec_pretty(&value)
    }
}

/// Everything a backend needs to show a kernel its fixed paths: the mapping, the command
/// and environment rewritten with it, the venv's view and what stays at host paths.
#[derive(Debug, Clone)]
pub struct KernelView {
    pub map: Relocation,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// The rebuilt venv at [`VENV`] (empty when the program is not in a venv).
    pub venv: Vec<VenvEntry>,
    /// The base interpreter's host prefix, shown at [`PYTHON`].
    pub python_prefix: Option<PathBuf>,
    /// Inside paths to hide behind an empty read-only tmpfs (the base interpreter's own
    /// site-packages, which the venv does not use).
    pub masked: Vec<PathBuf>,
    /// Host directories still shown at their own paths (an interpreter under a system
    /// directory, or one that is not in a venv).
    pub shown_as_is: Vec<PathBuf>,
}

impl KernelView {
    /// The view of `spec`'s kernel. `system` lists the host prefixes every sandbox shows
    /// anyway (an interpreter there says nothing of the host and is not moved).
    pub fn of(spec: &super::LaunchSpec, system: &[&str]) -> std::io::Result<KernelView> {
        use super::python_env::{masked_site_packages, python_roots};
        let program = Path::new(spec.argv.first().map(String::as_str).unwrap_or_default());
        let mut map = Relocation::new();
        map.add(&spec.workspace, WORKSPACE);
        map.add(&spec.runtime_dir, RUN_DIR);
        // Both are bound whole: never `/`, never a directory holding (or inside) the kernel's
        // runtime directory or workspace, which would show other kernels' files, and the
        // base must really be an interpreter's prefix. Anything else stays at its host path
        // and goes through the backend's checks of what may be shown (`visible_roots`).
        let safe = |dir: &Path| {
            let real = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
            let overlaps = |other: &Path| {
                let other = std::fs::canonicalize(other).unwrap_or_else(|_| other.to_owned());
                other.starts_with(&real) || real.starts_with(&other)
            };
            real != Path::new("/") && !overlaps(&spec.runtime_dir) && !overlaps(&spec.workspace)
        };
        let venv = program
            .parent()
            .and_then(Path::parent)
            .filter(|venv| venv.join("pyvenv.cfg").is_file() && safe(venv));
        let base = venv
            .and_then(venv_base_prefix)
            .filter(|base| safe(base) && is_interpreter_prefix(base));
        let environment = program
            .parent()
            .and_then(Path::parent)
            .filter(|env| env.join(ENVIRONMENT_MARKER).is_file() && safe(env));
        let (venv_entries, python_prefix, masked, shown_as_is) = match (venv, base, environment) {
            (None, _, Some(env)) => {
                // A kernel environment that is no Python venv (Deno's binary): shown whole,
                // read-only, at the same fixed path, with nothing to rewrite in it.
                map.add(env, VENV);
                let entries = vec![VenvEntry::Bind {
                    host: env.to_owned(),
                    inside: PathBuf::from(VENV),
                }];
                (entries, None, Vec::new(), Vec::new())
            }
            (Some(venv), Some(base), _) => {
                map.add(venv, VENV);
                let is_system = system.iter().any(|prefix| base.starts_with(prefix));
                if !is_system {
                    map.add(&base, PYTHON);
                }
                let entries = VenvView::of(venv, &map)?.entries;
                let masked = masked_site_packages(program, std::slice::from_ref(&base))
                    .iter()
                    .map(|site| map.path(site))
                    .collect();
                if is_system {
                    (entries, None, masked, vec![base])
                } else {
                    (entries, Some(base), masked, Vec::new())
                }
            }
            // Not a venv: the interpreter's directories at their own paths.
            _ => {
                let roots = python_roots(program);
                let masked = masked_site_packages(program, &roots);
                (Vec::new(), None, masked, roots)
            }
        };
        let mut env = map.env(&spec.env);
        if let Some(prefix) = &python_prefix {
            // The interpreter finds libpython by its RUNPATH, a host path the sandbox lacks.
            if has_libpython(prefix) {
                let lib = format!("{PYTHON}/lib");
                let value = match env.get("LD_LIBRARY_PATH") {
                    Some(old) if !old.is_empty() => format!("{lib}:{old}"),
                    _ => lib,
                };
                env.insert("LD_LIBRARY_PATH".to_owned(), value);
            }
        }
        Ok(KernelView {
            argv: map.argv(&spec.argv),
            env,
            map,
            venv: venv_entries,
            python_prefix,
            masked,
            shown_as_is,
        })
    }

    /// Rewrites the connection file for the kernel: ipc endpoints under [`RUN_DIR`]. The
    /// gateway keeps its own copy of the connection info, with host paths. A command
    /// without a connection file (tools, tests), or with a file that is not one, is left.
    pub fn rewrite_connection_file(&self, path: &Path) -> std::io::Result<()> {
        match self.connection_file(path)? {
            Some(mapped) => std::fs::write(path, mapped),
            None => Ok(()),
        }
    }

    /// The connection file as the kernel must read it (see
    /// [`rewrite_connection_file`](Self::rewrite_connection_file)), without writing it:
    /// `None` where there is none, or it is not one.
    pub fn connection_file(&self, path: &Path) -> std::io::Result<Option<String>> {
        let json = match std::fs::read(path) {
            Ok(json) => json,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(err),
        };
        Ok(self
            .map
            .connection_json(&json)
            .ok()
            .and_then(|mapped| String::from_utf8(mapped).ok()))
    }
}

/// Whether `prefix` looks like a Python installation: `bin/python3*` and `lib/python3.*`.
fn is_interpreter_prefix(prefix: &Path) -> bool {
    has_entry(&prefix.join("bin"), "python3") && has_entry(&prefix.join("lib"), "python3.")
}

/// Whether an interpreter prefix holds a shared libpython (then its binary needs it found).
fn has_libpython(prefix: &Path) -> bool {
    has_entry(&prefix.join("lib"), "libpython")
}

/// Whether `dir` has an entry whose name starts with `start`.
fn has_entry(dir: &Path, start: &str) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(start))
    })
}

/// One entry of the rebuilt venv.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VenvEntry {
    /// A generated file (pyvenv.cfg, a console script with its `#!` line mapped).
    File {
        inside: PathBuf,
        contents: String,
        executable: bool,
    },
    Symlink {
        inside: PathBuf,
        points_to: PathBuf,
    },
    /// A host directory or file shown read-only.
    Bind {
        host: PathBuf,
        inside: PathBuf,
    },
}

/// The host's venv as the kernel sees it at [`VENV`]: `lib/` (the packages) bound read-only,
/// and what holds host paths rewritten: `pyvenv.cfg` (`home` is [`PYTHON`]`/bin`), the
/// interpreter links of `bin/` (to [`PYTHON`]) and the `#!` lines and paths of its console
/// scripts (`pip`, `jupyter`…), so `!pip install` in a cell works as before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VenvView {
    pub entries: Vec<VenvEntry>,
}

/// Scripts larger than this are shown as they are (a venv's console scripts are a few
/// hundred bytes).
const MAX_SCRIPT: u64 = 64 << 10;

impl VenvView {
    /// Builds the view of `venv` (which `map` shows at [`VENV`]); links and scripts that
    /// name other host paths `map` covers (the base interpreter's prefix) are mapped too.
    pub fn of(venv: &Path, map: &Relocation) -> std::io::Result<VenvView> {
        let inside = Path::new(VENV);
        let mut entries = Vec::new();
        let cfg = std::fs::read_to_string(venv.join("pyvenv.cfg"))?;
        let cfg: String = cfg
            .lines()
            // `command` records how the venv was made, with host paths: nothing needs it.
            .filter(|line| !line.trim_start().starts_with("command"))
            .map(|line| match line.split_once('=') {
                Some((key, value)) if matches!(key.trim(), "home" | "executable") => {
                    format!("{} = {}\n", key.trim(), map.text(value.trim()))
                }
                _ => format!("{line}\n"),
            })
            .collect();
        entries.push(VenvEntry::File {
            inside: inside.join("pyvenv.cfg"),
            contents: cfg,
            executable: false,
        });
        for entry in std::fs::read_dir(venv)? {
            let entry = entry?;
            let name = entry.file_name();
            let (host, target) = (entry.path(), inside.join(&name));
            let kind = entry.file_type()?;
            if name == "pyvenv.cfg" {
                continue;
            } else if name == "bin" && kind.is_dir() {
                entries.extend(Self::bin(&host, &target, map)?);
            } else if kind.is_symlink() {
                let points_to = std::fs::read_link(&host)?;
                entries.push(VenvEntry::Symlink {
                    inside: target,
                    points_to: map.path(&points_to),
                });
            } else if kind.is_dir() {
                entries.push(VenvEntry::Bind {
                    host,
                    inside: target,
                });
            } else {
                // A file beside `pyvenv.cfg` (a stamp, a lock): written, not bound, so no
                // mount names its host path.
                entries.push(Self::file(&host, target, map)?);
            }
        }
        Ok(VenvView { entries })
    }

    /// A small text file as written contents with `map`'s paths mapped; anything else bound.
    fn file(host: &Path, inside: PathBuf, map: &Relocation) -> std::io::Result<VenvEntry> {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(host)?;
        let text = (meta.is_file() && meta.len() <= MAX_SCRIPT)
            .then(|| std::fs::read_to_string(host).ok())
            .flatten();
        Ok(match text {
            Some(text) => {
                let mut mapped = text;
                for (from, to) in &map.pairs {
                    mapped = mapped.replace(&*from.to_string_lossy(), &to.to_string_lossy());
                }
                VenvEntry::File {
                    inside,
                    contents: mapped,
                    executable: meta.permissions().mode() & 0o111 != 0,
                }
            }
            None => VenvEntry::Bind {
                host: host.to_owned(),
                inside,
            },
        })
    }

    fn bin(host: &Path, inside: &Path, map: &Relocation) -> std::io::Result<Vec<VenvEntry>> {
        let mut entries = Vec::new();
        for entry in std::fs::read_dir(host)? {
            let entry = entry?;
            let (path, target) = (entry.path(), inside.join(entry.file_name()));
            let meta = std::fs::symlink_metadata(&path)?;
            if meta.file_type().is_symlink() {
                entries.push(VenvEntry::Symlink {
                    inside: target,
                    points_to: map.path(&std::fs::read_link(&path)?),
                });
                continue;
            }
            entries.push(Self::file(&path, target, map)?);
        }
        Ok(entries)
    }
}

/// The base interpreter's prefix of a venv (`home` in its `pyvenv.cfg`, less `bin`).
pub fn venv_base_prefix(venv: &Path) -> Option<PathBuf> {
    let cfg = std::fs::read_to_string(venv.join("pyvenv.cfg")).ok()?;
    let home = cfg.lines().find_map(|line| {
        let (key, value) = line.split_once('=')?;
        (key.trim() == "home").then(|| PathBuf::from(value.trim()))
    })?;
    match home.parent() {
        Some(parent) if home.ends_with("bin") => Some(parent.to_owned()),
        _ => Some(home),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_path_lists_map_by_the_longest_prefix() {
        let mut map = Relocation::new();
        map.add("/srv/gw/k1/work", WORKSPACE);
        map.add("/srv/gw", "/elsewhere");
        map.add("/srv/gw/k1/run/g1", RUN_DIR);
        assert_eq!(map.path(Path::new("/srv/gw/k1/work")), Path::new(WORKSPACE));
        assert_eq!(
            map.path(Path::new("/srv/gw/k1/work/.cellgate")),
            Path::new("/home/user/.cellgate")
        );
        assert_eq!(
            map.path(Path::new("/srv/gw/k1/run/g1/connection.json")),
            Path::new("/run/cellgate/connection.json")
        );
        assert_eq!(map.path(Path::new("/srv/gw/x")), Path::new("/elsewhere/x"));
        // A sibling whose name merely starts the same is not inside.
        assert_eq!(map.path(Path::new("/srv/gwx")), Path::new("/srv/gwx"));
        assert_eq!(
            map.text("/srv/gw/k1/work/bin:/usr/bin:relative/x::-f"),
            "/home/user/bin:/usr/bin:relative/x::-f"
        );
        assert_eq!(map.text("C.UTF-8"), "C.UTF-8");
        assert_eq!(
            map.argv(&["--connection-file=/srv/gw/k1/run/g1/c.json".to_owned()]),
            ["--connection-file=/run/cellgate/c.json"]
        );
        let json = br#"{"transport": "ipc", "ip": "/srv/gw/k1/run/g1/k", "key": "abc"}"#;
        let mapped: serde_json::Value =
            serde_json::from_slice(&map.connection_json(json).unwrap()).unwrap();
        assert_eq!(mapped["ip"], "/run/cellgate/k");
        assert_eq!(mapped["key"], "abc");
    }

    #[test]
    fn a_prefix_that_is_not_an_interpreter_s_own_is_never_bound_whole() {
        let dir = tempfile::tempdir().unwrap();
        let venv = dir.path().join("venv");
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        let run = dir.path().join("k/run/g1");
        let work = dir.path().join("k/work");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        // `home = /bin` (a venv made from /bin/python3) would make `/` the prefix; a prefix
        // holding the kernel's own directories would show other kernels'.
        for home in ["/bin".to_owned(), format!("{}/bin", dir.path().display())] {
            std::fs::write(venv.join("pyvenv.cfg"), format!("home = {home}\n")).unwrap();
            let spec = super::super::LaunchSpec {
                kernel_id: "k".into(),
                argv: vec![venv.join("bin/python").display().to_string()],
                env: BTreeMap::new(),
                connection_file: run.join("c.json"),
                connection: crate::protocol::ConnectionInfo::ipc(&run.join("k"), "k".into(), "p"),
                runtime_dir: run.clone(),
                workspace: work.clone(),
                log_file: dir.path().join("k/kernel.log"),
                limits: super::super::Limits::default(),
                egress_socket: None,
                allow_emulation: false,
                zygote: false,
                labels: Default::default(),
                adopt: None,
                backend_settings: Default::default(),
                generation: 1,
            };
            let view = KernelView::of(&spec, &["/usr"]).unwrap();
            assert_eq!(view.python_prefix, None, "home = {home}");
        }
    }

    #[test]
    fn a_venv_view_holds_no_host_path() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("home/someone/.pyenv/versions/3.11.7");
        std::fs::create_dir_all(base.join("bin")).unwrap();
        std::fs::write(base.join("bin/python3.11"), "").unwrap();
        let venv = dir.path().join("checkout/kernels/python3/.venv");
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        std::fs::create_dir_all(venv.join("lib/python3.11/site-packages")).unwrap();
        std::os::unix::fs::symlink("lib", venv.join("lib64")).unwrap();
        std::fs::write(
            venv.join("pyvenv.cfg"),
            format!(
                "home = {b}/bin\ninclude-system-site-packages = false\nversion = 3.11.7\nexecutable = {b}/bin/python3.11\ncommand = {b}/bin/python3 -m venv {v}\n",
                b = base.display(),
                v = venv.display()
            ),
        )
        .unwrap();
        std::os::unix::fs::symlink(base.join("bin/python3"), venv.join("bin/python3")).unwrap();
        std::os::unix::fs::symlink("python3", venv.join("bin/python")).unwrap();
        std::fs::write(
            venv.join("bin/pip"),
            format!("#!{}/bin/python3\nimport pip\n", venv.display()),
        )
        .unwrap();
        let mut map = Relocation::new();
        map.add(&venv, VENV);
        map.add(&base, PYTHON);
        let view = VenvView::of(&venv, &map).unwrap();
        let host = dir.path().to_string_lossy().into_owned();
        for entry in &view.entries {
            match entry {
                VenvEntry::File {
                    inside, contents, ..
                } => {
                    assert!(!contents.contains(&host), "{inside:?}: {contents}");
                    assert!(inside.starts_with(VENV));
                }
                VenvEntry::Symlink { inside, points_to } => {
                    assert!(
                        !points_to.starts_with(dir.path()),
                        "{inside:?} → {points_to:?}"
                    );
                }
                VenvEntry::Bind { host: from, inside } => {
                    assert!(from.starts_with(&venv) && inside.starts_with(VENV));
                }
            }
        }
        assert!(view.entries.contains(&VenvEntry::Symlink {
            inside: "/opt/cellgate/venv/bin/python3".into(),
            points_to: "/opt/cellgate/python/bin/python3".into(),
        }));
        assert!(view.entries.iter().any(|e| matches!(e,
            VenvEntry::File { inside, contents, executable: false }
                if inside.ends_with("pyvenv.cfg") && contents.contains("home = /opt/cellgate/python/bin"))));
        assert!(view.entries.iter().any(|e| matches!(e,
            VenvEntry::File { inside, contents, .. }
                if inside.ends_with("bin/pip") && contents.starts_with("#!/opt/cellgate/venv/bin/python3"))));
        assert_eq!(venv_base_prefix(&venv), Some(base));
    }
}
