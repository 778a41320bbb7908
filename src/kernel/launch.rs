//! Preparing a kernel process: its private directories, connection file, key and environment.
//!
//! Per kernel, `run/` (0700, with 0600 connection files and the ipc sockets) and `work/`
//! (the workspace); per generation, a fresh 256-bit key. The environment starts from a fixed
//! base: nothing of the gateway's own environment leaks into a kernel. Clients may add only
//! `KERNEL_*` variables, the gateway's allowlist and what the policy's `[environment]`
//! allows, values checked; `KERNEL_WORKING_DIR` (a path on the client's machine) is
//! dropped.

use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rand::RngCore;

use super::spec::KernelSpec;
use super::KernelError;
use crate::protocol::ConnectionInfo;

/// The directories of one kernel, under the gateway's runtime root:
/// `run/` (0700: connection files and ipc sockets) and `work/` (the kernel's workspace).
#[derive(Debug, Clone)]
pub struct KernelDirs {
    pub root: PathBuf,
    pub run: PathBuf,
    pub work: PathBuf,
}

impl KernelDirs {
    pub fn create(runtime_root: &Path, kernel_id: &str) -> Result<KernelDirs, KernelError> {
        let root = runtime_root.join(kernel_id);
        let run = root.join("run");
        let work = root.join("work");
        for dir in [&root, &run, &work] {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .map_err(|source| KernelError::Io {
                    what: format!("create {}", dir.display()),
                    source,
                })?;
        }
        Ok(KernelDirs { root, run, work })
    }

    /// The directories at `root` itself, made when missing (0700) and kept when there: a
    /// kernel whose directories must stay where an adopting gateway finds them.
    pub fn create_at(root: &Path) -> Result<KernelDirs, KernelError> {
        let (run, work) = (root.join("run"), root.join("work"));
        for dir in [root, &run, &work] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| KernelError::Io {
                    what: format!("create {}", dir.display()),
                    source,
                })?;
        }
        Ok(KernelDirs {
            root: root.to_owned(),
            run,
            work,
        })
    }

    pub fn remove(&self) {
        if let Err(err) = std::fs::remove_dir_all(&self.root) {
            if err.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %self.root.display(), %err, "could not remove a kernel's directory");
            }
        }
    }
}

/// A fresh random key: 32 bytes, hex-encoded (the key is used as the text's bytes).
pub fn new_key() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

/// Creates the private directory of one kernel process (generation `generation`) and writes
/// its connection file (0600) there; the kernel binds its ipc sockets beside it. The name has
/// a random part and the directory is new for every generation: a kernel (which may write
/// into its own directory) cannot prepare a later generation's files, such as a symlink where
/// a future socket will be. Returns the directory, the file and the connection info.
pub fn write_connection_file(
    dirs: &KernelDirs,
    generation: u64,
    kernel_name: &str,
    key: Option<&str>,
) -> Result<(PathBuf, PathBuf, ConnectionInfo), KernelError> {
    let mut nonce = [0u8; 4];
    rand::rng().fill_bytes(&mut nonce);
    let dir = dirs
        .run
        .join(format!("g{generation}-{}", hex::encode(nonce)));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|source| KernelError::Io {
            what: format!("create {}", dir.display()),
            source,
        })?;
    // A fresh key per generation, except for a kernel taken over from another replica,
    // whose process signs with the key it was started with.
    let key = key.map_or_else(new_key, str::to_owned);
    let info = ConnectionInfo::ipc(&dir.join("k"), key, kernel_name);
    let path = dir.join("connection.json");
    let json = serde_json::to_vec_pretty(&info).map_err(|err| KernelError::Io {
        what: "serialise the connection file".to_owned(),
        source: std::io::Error::other(err),
    })?;
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        file.write_all(&json)
    };
    write().map_err(|source| KernelError::Io {
        what: format!("write {}", path.display()),
        source,
    })?;
    Ok((dir, path, info))
}

/// Whether a client may set the variable `name`: `KERNEL_*`, the gateway's `allowlist`, and
/// what the kernel's policy allows (`[environment]`, which never allows a reserved name).
pub fn client_may_set(
    name: &str,
    allowlist: &[String],
    policy: &crate::policy::EnvironmentRules,
) -> bool {
    (name.starts_with("KERNEL_") || allowlist.iter().any(|a| a == name) || policy.allows(name))
        // What the sandbox and the kernel's start rely on (KERNEL_ID, say), whatever let
        // the name through.
        && !crate::policy::environment::reserved(name)
        // A path on the client's machine: never used, never passed on.
        && name != "KERNEL_WORKING_DIR"
}

/// The variables of `requested` the kernel will get, checked; the others are dropped, as
/// Kernel Gateway does (API v1 refuses them instead: see [`client_may_set`]).
/// Values are checked as Enterprise Gateway does: bounded length, no shell metacharacters
/// that matter for command lines, no control characters.
pub fn filter_client_env(
    requested: &BTreeMap<String, String>,
    allowlist: &[String],
    policy: &crate::policy::EnvironmentRules,
) -> Result<BTreeMap<String, String>, KernelError> {
    let mut env = BTreeMap::new();
    for (name, value) in requested {
        if !client_may_set(name, allowlist, policy) {
            continue;
        }
        let valid_name = !name.is_empty()
            && name.len() <= 128
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        let valid_value = value.len() <= 4096
            && !value
                .chars()
                .any(|c| matches!(c, '$' | '`' | '\r' | '\n' | '\0'));
        if !valid_name || !valid_value {
            return Err(KernelError::BadEnv { name: name.clone() });
        }
        env.insert(name.clone(), value.clone());
    }
    Ok(env)
}

/// The complete environment of a kernel process: a fixed base, the kernelspec's `env`, then
/// the filtered client variables. Nothing of the gateway's own environment is inherited.
pub fn kernel_env(
    spec: &KernelSpec,
    kernel_id: &str,
    workspace: &Path,
    client_env: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let venv_bin = spec.dir.join(".venv").join("bin");
    let mut env = BTreeMap::new();
    env.insert(
        "PATH".to_owned(),
        format!("{}:/usr/local/bin:/usr/bin:/bin", venv_bin.display()),
    );
    env.insert("HOME".to_owned(), workspace.display().to_string());
    env.insert("LANG".to_owned(), "C.UTF-8".to_owned());
    env.insert("PYTHONUNBUFFERED".to_owned(), "1".to_owned());
    env.insert("KERNEL_GATEWAY".to_owned(), "1".to_owned());
    env.insert("KERNEL_ID".to_owned(), kernel_id.to_owned());
    for (k, v) in &spec.env {
        env.insert(k.clone(), v.clone());
    }
    for (k, v) in client_env {
        env.insert(k.clone(), v.clone());
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn only_kernel_vars_and_the_allowlist_pass() {
        let requested = env(&[
            ("KERNEL_USERNAME", "bob"),
            ("KERNEL_WORKING_DIR", "/home/bob/nb"),
            // KERNEL_* but the gateway's own: reserved.
            ("KERNEL_ID", "someone-else"),
            ("KERNEL_GATEWAY", "0"),
            ("KG_AUTH_TOKEN", "secret"),
            ("PATH", "/evil"),
            ("MY_SETTING", "1"),
        ]);
        let out =
            filter_client_env(&requested, &["MY_SETTING".to_owned()], &Default::default()).unwrap();
        assert_eq!(out, env(&[("KERNEL_USERNAME", "bob"), ("MY_SETTING", "1")]));
    }

    #[test]
    fn hostile_values_are_refused() {
        for value in ["$(id)", "a`b`", "a\nb", "a\0b"] {
            let err = filter_client_env(&env(&[("KERNEL_X", value)]), &[], &Default::default())
                .unwrap_err();
            assert!(err.to_string().contains("KERNEL_X"));
        }
        let long = "x".repeat(4097);
        assert!(filter_client_env(&env(&[("KERNEL_X", &long)]), &[], &Default::default()).is_err());
    }

    #[test]
    fn connection_files_are_private_and_keys_fresh() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let dirs = KernelDirs::create(root.path(), "k").unwrap();
        let (dir, path, info) = write_connection_file(&dirs, 1, "python3", None).unwrap();
        let (dir2, _, info2) = write_connection_file(&dirs, 2, "python3", None).unwrap();
        assert_ne!(info.key, info2.key);
        assert_ne!(dir, dir2);
        assert!(path.starts_with(&dir));
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert_eq!(info.key.len(), 64);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let mode = std::fs::metadata(&dirs.run).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        dirs.remove();
        assert!(!dirs.root.exists());
    }
}
