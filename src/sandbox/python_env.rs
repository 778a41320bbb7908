//! The Python environment behind a kernel's interpreter, found from the host's files: the
//! directories a sandbox must show for it to run (a venv and its base interpreter's prefix)
//! and the host's own site-packages it must not. Read by the relocation of those
//! directories (`relocate.rs`), which the backends that bind host directories (namespaces,
//! gVisor) share.

use std::path::{Path, PathBuf};

/// The base interpreter's `site-packages` and `dist-packages` directories among `roots`,
/// when `program` runs in a venv that does not use them (`include-system-site-packages =
/// false`, the default): whatever the host installed globally (cloud CLIs, their credentials
/// helpers …) stays out of sight.
pub fn masked_site_packages(program: &Path, roots: &[PathBuf]) -> Vec<PathBuf> {
    let Some(venv) = program.parent().and_then(Path::parent) else {
        return Vec::new();
    };
    let Ok(cfg) = std::fs::read_to_string(venv.join("pyvenv.cfg")) else {
        return Vec::new();
    };
    let uses_system = cfg.lines().any(|line| {
        line.split_once('=').is_some_and(|(k, v)| {
            k.trim() == "include-system-site-packages" && v.trim().eq_ignore_ascii_case("true")
        })
    });
    if uses_system {
        return Vec::new();
    }
    let mut masked = Vec::new();
    // Debian's interpreter keeps the host's packages in `dist-packages`, its own and those
    // under /usr/local (`lib/python3/dist-packages`, `lib/python3.11/dist-packages`).
    let mut roots: Vec<&Path> = roots
        .iter()
        .map(PathBuf::as_path)
        .filter(|r| *r != venv)
        .collect();
    if roots.contains(&Path::new("/usr")) {
        roots.push(Path::new("/usr/local"));
    }
    for root in roots {
        let Ok(entries) = std::fs::read_dir(root.join("lib")) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_name().to_string_lossy().starts_with("python") {
                continue;
            }
            for name in ["site-packages", "dist-packages"] {
                let site = entry.path().join(name);
                if site.is_dir() {
                    masked.push(site);
                }
            }
        }
    }
    masked.sort();
    masked
}

/// The directories of the Python environment behind `program`: a venv's own directory and,
/// from its `pyvenv.cfg`, the base interpreter's prefix; and the prefix of the real
/// executable behind any symlinks. Only these are shown, never their parents (a pyenv
/// prefix under `/root` does not show the rest of `/root`).
pub fn python_roots(program: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Some(prefix) = program.parent().and_then(Path::parent) {
        if let Ok(cfg) = std::fs::read_to_string(prefix.join("pyvenv.cfg")) {
            roots.push(prefix.to_path_buf());
            let home = cfg.lines().find_map(|line| {
                let (key, value) = line.split_once('=')?;
                (key.trim() == "home").then(|| PathBuf::from(value.trim()))
            });
            if let Some(home) = home {
                match home.parent() {
                    Some(parent) if home.ends_with("bin") => roots.push(parent.to_path_buf()),
                    _ => roots.push(home),
                }
            }
        }
    }
    if let Ok(real) = std::fs::canonicalize(program) {
        if let Some(prefix) = real
            .parent()
            .filter(|dir| dir.ends_with("bin"))
            .and_then(Path::parent)
        {
            roots.push(prefix.to_path_buf());
        }
    }
    roots
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::host_paths::visible_roots;

    #[test]
    fn venv_roots_include_the_base_prefix_only() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base");
        std::fs::create_dir_all(base.join("bin")).unwrap();
        std::fs::write(base.join("bin/python3.11"), "").unwrap();
        let venv = dir.path().join("venv");
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        std::os::unix::fs::symlink(base.join("bin/python3.11"), venv.join("bin/python")).unwrap();
        std::fs::write(
            venv.join("pyvenv.cfg"),
            format!(
                "home = {}\ninclude-system-site-packages = false\n",
                base.join("bin").display()
            ),
        )
        .unwrap();
        let roots = python_roots(&venv.join("bin/python"));
        assert!(roots.contains(&venv));
        assert!(roots.contains(&base));
        let shown = visible_roots(roots, Path::new("/run/k/1/run"), Path::new("/run/k/1/work"));
        assert_eq!(shown.len(), 2);
        assert!(shown.contains(&base) && shown.contains(&venv));
    }
}
