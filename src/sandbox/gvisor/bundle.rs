//! The OCI bundle of one launch: `config.json` and a `rootfs` that holds only mount points,
//! the generated `/etc` files and the `bin`/`lib` symlinks of a merged-`/usr` host.
//!
//! A bundle rather than `runsc do`, which shows the host's whole `/` and can neither bind
//! the runtime directory read-write at a path of our choosing nor pick the user (see the
//! backend's design in [`super`]). Everything the kernel sees is decided here, from the
//! launch's spec and its [`KernelView`]; the root is read-only and the mounts are applied
//! in order, so a later mount (a masked directory) covers an earlier one (its bind).

use std::io;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::error::setup;
use super::{GvisorConfig, PIDS_OVERHEAD};
use crate::sandbox::relocate::{self, KernelView, VenvEntry};
use crate::sandbox::rootfs::{self, ETC_ENTRIES, USR_LINKS};
use crate::sandbox::{LaunchSpec, Limits, SandboxError};

/// CFS period for CPU limits.
const CPU_PERIOD_US: u64 = 100_000;

/// Writes `bundle/config.json` and `bundle/rootfs`.
pub(super) fn write_bundle(
    bundle: &Path,
    config: &GvisorConfig,
    spec: &LaunchSpec,
    view: &KernelView,
    ro_paths: &[PathBuf],
    cgroup: &str,
) -> Result<(), SandboxError> {
    let rootfs = bundle.join("rootfs");
    let mut mounts = write_root(&rootfs, config)?;
    let binds = binds(&rootfs, spec, view, ro_paths)?;
    add_binds(&rootfs, binds, &mut mounts)?;
    for dir in &view.masked {
        // After the binds they sit in (OCI mounts apply in order).
        mounts.push(
            json!({"destination": dir, "type": "tmpfs", "source": "tmpfs",
                           "options": ["ro", "nosuid", "nodev", "noexec", "size=4096"]}),
        );
    }
    let oci = oci_config(config, spec, view, cgroup, mounts);
    let text =
        serde_json::to_vec_pretty(&oci).map_err(|err| setup(format!("config.json: {err}")))?;
    let path = bundle.join("config.json");
    std::fs::write(&path, text).map_err(io_err("write", &path))
}

/// The setup error of a failed file operation, naming what was done to which path.
fn io_err(what: &str, path: &Path) -> impl FnOnce(io::Error) -> SandboxError {
    let what = format!("{what} {}", path.display());
    move |err: io::Error| setup(format!("{what}: {err}"))
}

/// The root's own skeleton: the directories its mounts need (the root is read-only in the
/// sandbox), the host's `/usr` and its top-level links (or directories) so programs find
/// their libraries, and the generated `/etc` files. Returns the mounts so far.
fn write_root(rootfs: &Path, config: &GvisorConfig) -> Result<Vec<Value>, SandboxError> {
    std::fs::create_dir_all(rootfs.join("etc")).map_err(io_err("mkdir", rootfs))?;
    for dir in ["usr", "proc", "tmp", "dev"] {
        std::fs::create_dir_all(rootfs.join(dir)).map_err(io_err("mkdir", rootfs))?;
    }
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "mode=1777"]}),
        ro_bind(Path::new("/usr")),
    ];
    for name in USR_LINKS {
        let host = Path::new("/").join(name);
        match std::fs::read_link(&host) {
            Ok(target) => std::os::unix::fs::symlink(&target, rootfs.join(name))
                .map_err(io_err("symlink", &rootfs.join(name)))?,
            Err(_) if host.is_dir() => {
                std::fs::create_dir_all(rootfs.join(name)).map_err(io_err("mkdir", &host))?;
                mounts.push(ro_bind(&host));
            }
            Err(_) => {}
        }
    }
    for (name, contents) in etc_files(config) {
        let path = rootfs.join("etc").join(name);
        std::fs::write(&path, contents).map_err(io_err("write", &path))?;
    }
    Ok(mounts)
}

/// A bind mount of the bundle: (host, inside, writable).
type Bind = (PathBuf, PathBuf, bool);

/// What the kernel sees of the host, as binds: the host's `/etc` entries, the extra
/// read-only paths, the Python prefix and venv at their fixed places (the venv's generated
/// files and links are written into the root here), and last the two writable directories.
fn binds(
    rootfs: &Path,
    spec: &LaunchSpec,
    view: &KernelView,
    ro_paths: &[PathBuf],
) -> Result<Vec<Bind>, SandboxError> {
    let mut binds: Vec<Bind> = ETC_ENTRIES
        .iter()
        .map(PathBuf::from)
        .filter(|p| p.exists())
        .map(|p| (p.clone(), p, false))
        .collect();
    binds.extend(ro_paths.iter().map(|p| (p.clone(), p.clone(), false)));
    if let Some(prefix) = &view.python_prefix {
        binds.push((prefix.clone(), PathBuf::from(relocate::PYTHON), false));
    }
    for entry in &view.venv {
        if let Some(bind) = write_venv_entry(rootfs, entry)? {
            binds.push(bind);
        }
    }
    binds.push((
        spec.runtime_dir.clone(),
        PathBuf::from(relocate::RUN_DIR),
        true,
    ));
    // With a size limit, `runsc run`'s own mount namespace has a tmpfs of that size at the
    // host path (see `WorkspaceMount`); the host's directory is never what the kernel writes
    // to.
    binds.push((
        spec.workspace.clone(),
        PathBuf::from(relocate::WORKSPACE),
        true,
    ));
    Ok(binds)
}

/// Writes one entry of the relocated venv into the root (a file or a symlink), or returns
/// it as a read-only bind when it is host content shown as is.
fn write_venv_entry(rootfs: &Path, entry: &VenvEntry) -> Result<Option<Bind>, SandboxError> {
    let in_rootfs = |inside: &Path| rootfs.join(inside.strip_prefix("/").unwrap_or(inside));
    match entry {
        VenvEntry::File {
            inside,
            contents,
            executable,
        } => {
            use std::os::unix::fs::PermissionsExt;
            let path = in_rootfs(inside);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io_err("mkdir", parent))?;
            }
            std::fs::write(&path, contents).map_err(io_err("write", &path))?;
            let mode = if *executable { 0o755 } else { 0o644 };
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .map_err(io_err("chmod", &path))?;
        }
        VenvEntry::Symlink { inside, points_to } => {
            let path = in_rootfs(inside);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io_err("mkdir", parent))?;
            }
            std::os::unix::fs::symlink(points_to, &path).map_err(io_err("symlink", &path))?;
        }
        VenvEntry::Bind { host, inside } => return Ok(Some((host.clone(), inside.clone(), false))),
    }
    Ok(None)
}

/// Adds the binds to `mounts`, in order, with their mount points made in the root.
fn add_binds(rootfs: &Path, binds: Vec<Bind>, mounts: &mut Vec<Value>) -> Result<(), SandboxError> {
    for (host, target, writable) in binds {
        let inside = rootfs.join(target.strip_prefix("/").unwrap_or(&target));
        // Mount points must exist in the read-only root; under /tmp (a tmpfs) runsc makes
        // them itself, but creating them here too is harmless.
        if host.is_dir() {
            std::fs::create_dir_all(&inside).map_err(io_err("mkdir", &inside))?;
        } else {
            if let Some(parent) = inside.parent() {
                std::fs::create_dir_all(parent).map_err(io_err("mkdir", parent))?;
            }
            std::fs::write(&inside, b"").map_err(io_err("create", &inside))?;
        }
        mounts.push(if writable {
            json!({"destination": target, "type": "bind", "source": host,
                   "options": ["rbind", "rw", "nosuid", "nodev"]})
        } else {
            ro_bind_at(&host, &target)
        });
    }
    Ok(())
}

/// The OCI `config.json`: the kernel's argv as the configured uid, no capabilities, no new
/// privileges, a read-only root, its own namespaces (no network), and with cgroups the
/// launch's limits.
fn oci_config(
    config: &GvisorConfig,
    spec: &LaunchSpec,
    view: &KernelView,
    cgroup: &str,
    mounts: Vec<Value>,
) -> Value {
    let env: Vec<String> = view.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let no_caps = json!([]);
    let args = with_init(&view.argv, Path::new(INIT).exists());
    let mut linux = json!({
        "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                       {"type": "uts"}, {"type": "mount"}],
    });
    if args.first().map(String::as_str) == Some(INIT) {
        linux["seccomp"] = init_guard();
    }
    if config.cgroups {
        linux["cgroupsPath"] = json!(cgroup);
        linux["resources"] = resources(&spec.limits);
    }
    json!({
        "ociVersion": "1.0.2",
        "hostname": config.hostname,
        "process": {
            "terminal": false,
            "user": {"uid": config.uid, "gid": config.gid},
            "args": args,
            "env": env,
            "cwd": relocate::WORKSPACE,
            "capabilities": {"bounding": no_caps, "effective": no_caps, "inheritable": no_caps,
                             "permitted": no_caps, "ambient": no_caps},
            "noNewPrivileges": true,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}],
        },
        "root": {"path": "rootfs", "readonly": true},
        "mounts": mounts,
        "linux": linux,
    })
}

/// The container's init, from Debian's `tini` (under `/usr`, which every sandbox shows).
/// The container's first process is its PID 1, and a kernel there never reaps the orphans
/// its cells leave (a killed command's background processes, a double fork): they would
/// stay zombies, each holding a pid of the policy's limit, until the session ends. tini
/// reaps them and passes signals on; the kernel is its only child, PID 2.
pub(super) const INIT: &str = "/usr/bin/tini";

/// The container's argv: the kernel's, under [`INIT`] when the host has it (without it, the
/// kernel is PID 1 and orphans stay zombies, as `cellgate doctor` says).
fn with_init(argv: &[String], have_init: bool) -> Vec<String> {
    if !have_init {
        return argv.to_vec();
    }
    // `-s` is not needed (it is PID 1); `-g` would signal the kernel's process group, but
    // signals go to the kernel's main thread from inside (`handle::signal_script`).
    let mut args = vec![INIT.to_owned(), "--".to_owned()];
    args.extend_from_slice(argv);
    args
}

/// An OCI seccomp profile that refuses (EPERM) every way to signal or trace PID 1, the
/// container's init, and allows everything else (the Sentry is the boundary; this is not
/// one). A Linux init is unkillable from inside its pid namespace, gVisor's is not: without
/// this, a cell's `os.kill(1, SIGKILL)` (or a `kill -9 1` in a command) would end its own
/// sandbox, where in the other backends it does nothing. `kill(-1)` already spares the init.
fn init_guard() -> Value {
    // The pid arguments are C ints: compared on their low 32 bits, so that a 64-bit value
    // whose low half is 1 (which the kernel reads as 1) is caught too.
    let pid_is_init = |index: u32| json!([{"index": index, "value": 0xffff_ffff_u64, "valueTwo": 1, "op": "SCMP_CMP_MASKED_EQ"}]);
    let eperm = |names: &[&str], index: u32| {
        json!({"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM,
               "args": pid_is_init(index)})
    };
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [
            eperm(&["kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
                    "pidfd_open", "process_vm_writev"], 0),
            eperm(&["ptrace"], 1),
            // Joining the init's process group would let `kill(0, …)` reach it.
            eperm(&["setpgid"], 1),
            // A pidfd of `/proc/1` (opened as a directory) names the init without its pid:
            // no kernel needs to signal through pidfds (ENOSYS: callers fall back to kill).
            json!({"names": ["pidfd_send_signal"], "action": "SCMP_ACT_ERRNO",
                   "errnoRet": libc::ENOSYS}),
        ],
    })
}

fn ro_bind(host: &Path) -> Value {
    ro_bind_at(host, host)
}

fn ro_bind_at(host: &Path, target: &Path) -> Value {
    json!({"destination": target, "type": "bind", "source": host,
           "options": ["rbind", "ro", "nosuid", "nodev"]})
}

/// OCI `linux.resources` for the limits.
fn resources(limits: &Limits) -> Value {
    let mut resources = json!({});
    if let Some(bytes) = limits.memory_cgroup_bytes(limits.workspace_bytes) {
        resources["memory"] = json!({"limit": bytes, "swap": bytes});
    }
    if let Some(pids) = limits.pids {
        resources["pids"] = json!({"limit": pids + PIDS_OVERHEAD});
    }
    if let Some(millis) = limits.cpu_millis {
        let quota = u64::from(millis) * CPU_PERIOD_US / 1000;
        resources["cpu"] = json!({"quota": quota.max(1000), "period": CPU_PERIOD_US});
    }
    resources
}

/// The generated `/etc` files (see `sandbox::rootfs`).
fn etc_files(config: &GvisorConfig) -> Vec<(&'static str, String)> {
    rootfs::etc_files(
        config.uid,
        config.gid,
        &config.hostname,
        Path::new(relocate::WORKSPACE),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::host_paths::SYSTEM_PREFIXES;
    use std::collections::BTreeMap;

    #[test]
    fn bundle_shows_only_what_the_kernel_needs() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("k/run");
        let work = dir.path().join("k/work");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let spec = LaunchSpec {
            kernel_id: "k".into(),
            argv: vec!["/usr/bin/python3".into(), "-c".into(), "pass".into()],
            env: BTreeMap::from([("PATH".to_owned(), "/usr/bin".to_owned())]),
            connection_file: run.join("c.json"),
            connection: crate::protocol::ConnectionInfo::ipc(&run.join("g1"), "k".into(), "p"),
            runtime_dir: run.clone(),
            workspace: work.clone(),
            log_file: dir.path().join("k/kernel.log"),
            limits: Limits {
                memory_bytes: Some(1 << 30),
                pids: Some(10),
                cpu_millis: Some(500),
                workspace_bytes: None,
            },
            egress_socket: None,
            allow_emulation: false,
            zygote: false,
            labels: Default::default(),
            adopt: None,
            backend_settings: Default::default(),
            generation: 1,
        };
        let bundle = dir.path().join("bundle");
        let view = KernelView::of(&spec, SYSTEM_PREFIXES).unwrap();
        write_bundle(
            &bundle,
            &GvisorConfig::default(),
            &spec,
            &view,
            &[],
            "cellgate-gvisor/x",
        )
        .unwrap();
        let config: Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["root"]["readonly"], true);
        assert_eq!(config["process"]["user"]["uid"], 65534);
        assert_eq!(config["process"]["noNewPrivileges"], true);
        assert_eq!(config["process"]["capabilities"]["bounding"], json!([]));
        assert_eq!(config["process"]["cwd"], "/home/user");
        assert_eq!(
            config["linux"]["resources"]["pids"]["limit"],
            10 + PIDS_OVERHEAD
        );
        assert_eq!(config["linux"]["resources"]["cpu"]["quota"], 50_000);
        let mounts = config["mounts"].as_array().unwrap();
        let find = |dest: &Path| {
            mounts
                .iter()
                .find(|m| m["destination"] == json!(dest))
                .unwrap_or_else(|| panic!("no mount at {}", dest.display()))
        };
        let rw = |m: &Value| m["options"].as_array().unwrap().contains(&json!("rw"));
        let (run_mount, work_mount) = (
            find(Path::new("/run/cellgate")),
            find(Path::new("/home/user")),
        );
        assert!(rw(run_mount), "runtime dir writable at its fixed path");
        assert_eq!(run_mount["source"], json!(run));
        assert!(rw(work_mount), "workspace writable");
        assert_eq!(work_mount["source"], json!(work));
        assert!(!rw(find(Path::new("/usr"))));
        assert!(mounts
            .iter()
            .all(|m| m["destination"] != "/etc/shadow" && m["destination"] != "/"));
        let passwd = std::fs::read_to_string(bundle.join("rootfs/etc/passwd")).unwrap();
        assert!(passwd.contains("kernel:x:65534:65534"));
    }
}
