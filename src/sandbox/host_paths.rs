//! Which host paths a sandbox shows its kernel read-only, at their own paths: the files its
//! command names, and the check every such path passes first (never the root, a system
//! directory every sandbox has anyway, nor anything holding or inside the kernel's runtime
//! directory or workspace). Shared by the backends that bind host paths (namespaces, gVisor).

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

/// Regular files the command names by absolute path (a kernelspec's own script, say):
/// shown read-only, each file alone, not its directory. Files in the runtime directory (the
/// connection file) are there anyway and are filtered out later.
pub fn argv_files(args: &[String]) -> Vec<PathBuf> {
    args.iter()
        .map(PathBuf::from)
        .filter(|path| path.is_absolute() && path.is_file())
        .collect()
}

/// Host paths that are always visible (or never may be bound) inside the sandbox.
pub const SYSTEM_PREFIXES: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/dev", "/proc", "/sys",
];

/// Cleans the list of read-only binds. Each is shown at the path the gateway named (so a
/// venv reached through a symlink keeps working: Python finds `pyvenv.cfg` next to the path
/// it was started as), and judged by where it really leads: it must exist, must not be the
/// root or a system directory, must not be an ancestor of the runtime directory or workspace
/// (which would show other kernels' directories) nor lie inside them; a directory inside
/// another one kept is dropped.
pub fn visible_roots(wanted: Vec<PathBuf>, runtime_dir: &Path, workspace: &Path) -> Vec<PathBuf> {
    let real = |path: &Path| std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let (runtime_real, workspace_real) = (real(runtime_dir), real(workspace));
    let mut kept = BTreeSet::new();
    for path in wanted {
        let literal_ok = path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        let Ok(resolved) = std::fs::canonicalize(&path) else {
            tracing::warn!(path = %path.display(), "not shown in the sandbox: it does not exist");
            continue;
        };
        // Already shown read-write (the connection file named in every kernel's command
        // is in the runtime directory): nothing to bind, nothing to warn about.
        let inside_shown = [(&path, runtime_dir), (&path, workspace)]
            .into_iter()
            .chain([
                (&resolved, runtime_real.as_path()),
                (&resolved, workspace_real.as_path()),
            ])
            .any(|(p, dir)| p != dir && p.starts_with(dir));
        if inside_shown && literal_ok {
            continue;
        }
        let system = |p: &Path| SYSTEM_PREFIXES.iter().any(|prefix| p.starts_with(prefix));
        let overlaps = |p: &Path, dir: &Path| dir.starts_with(p) || p.starts_with(dir);
        let too_wide = path == Path::new("/")
            || resolved == Path::new("/")
            || overlaps(&resolved, &runtime_real)
            || overlaps(&resolved, &workspace_real)
            || overlaps(&path, runtime_dir)
            || overlaps(&path, workspace);
        if too_wide || !literal_ok {
            tracing::warn!(path = %path.display(), "not shown in the sandbox: it would expose the runtime directory or workspace, or is not a plain absolute path");
            continue;
        }
        if !system(&path) && !system(&resolved) {
            kept.insert(path);
        }
    }
    let all: Vec<PathBuf> = kept.iter().cloned().collect();
    kept.into_iter()
        .filter(|path| {
            !all.iter()
                .any(|other| other != path && path.starts_with(other))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_or_system_paths_are_never_bound() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("k1/run");
        std::fs::create_dir_all(&runtime).unwrap();
        let inner = dir.path().join("env/lib");
        std::fs::create_dir_all(&inner).unwrap();
        let connection = runtime.join("connection.json");
        std::fs::write(&connection, "{}").unwrap();
        let shown = visible_roots(
            vec![
                connection,
                "/".into(),
                "/usr/local".into(),
                dir.path().to_path_buf(),
                dir.path().join("env"),
                inner,
            ],
            &std::fs::canonicalize(&runtime).unwrap(),
            Path::new("/nonexistent/work"),
        );
        assert_eq!(
            shown,
            vec![std::fs::canonicalize(dir.path().join("env")).unwrap()]
        );
    }
}
