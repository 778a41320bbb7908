//! Fingerprinting the host from inside the sandbox (issue 13, item 5).
//!
//! `/proc/sys/kernel/random/boot_id` and `/proc/cmdline` are the same for every process of a
//! host: two sessions that read the same values know they share a machine (and the host's
//! command line names its disks and images). Inside a sandbox both are the sandbox's own now.
//! The kernel's working directory, `$HOME`, `sys.prefix`, its command line, its environment
//! and its connection file named the gateway's runtime directory, the checkout holding the
//! kernel's venv and the interpreter's prefix under the host's home; every sandbox now shows
//! them at the same fixed paths (`/home/user`, `/run/cellgate`, `/opt/cellgate/…`). And
//! IPython's and matplotlib's own files, which went into the workspace among the user's, go
//! to the sandbox's private `/tmp`.
//!
//! Nor does what the kernel can read elsewhere: `/proc/self/mountinfo` (a bind names its
//! source's host path: the runtime directory is a tmpfs of the sandbox's own and the Python
//! environment is shown by overlays, in a namespaces sandbox; gVisor shows no host mounts),
//! and the Python installation's own files (`sysconfig`'s build variables, compiled modules,
//! scripts: `./dev setup` builds the kernel venv from Debian's interpreter, at the path the
//! sandboxes show it).

use anyhow::{ensure, Context, Result};

use super::{arena, json_out, runtime_root_of};
use crate::support::*;

const PROBE: &str = r#"
import json, os, sys
def read(path):
    try:
        return open(path).read()
    except OSError as e:
        return f"error: {e}"
def build_paths():
    # What the Python installation's own files say about where it was built and installed.
    import glob, importlib.util, sysconfig
    def pyc(module):
        spec = importlib.util.find_spec(module)
        cached = spec and spec.origin and importlib.util.cache_from_source(spec.origin)
        if not cached or not os.path.exists(cached):
            return None
        return open(cached, "rb").read().decode("latin-1")
    scripts = [p for p in glob.glob(sys.prefix + "/bin/*") + glob.glob(sys.base_prefix + "/bin/pip*")
               + glob.glob(sys.base_prefix + "/bin/idle*") if os.path.isfile(p)]
    return {
        "sysconfig": json.dumps(sysconfig.get_config_vars(), default=str),
        "pyc": {m: pyc(m) for m in ("json", "ipykernel.kernelapp", "numpy", "cellgate_kernel_launcher")},
        "scripts": {p: open(p, "rb").read(4096).decode("latin-1") for p in scripts},
    }
connection = [a for a in open("/proc/self/cmdline").read().split("\0") if a.endswith(".json")]
print(json.dumps({
    "boot_id": read("/proc/sys/kernel/random/boot_id"),
    "cmdline": read("/proc/cmdline"),
    "env": {k: os.environ.get(k) for k in ("IPYTHONDIR", "MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")},
    "where": {
        "cwd": os.getcwd(), "home": os.environ.get("HOME"), "prefix": sys.prefix,
        "base_prefix": sys.base_prefix, "executable": sys.executable, "path": sys.path,
        "environ": dict(os.environ), "argv": read("/proc/self/cmdline"),
        "connection_file": read(connection[0]) if connection else "none",
    },
    "mountinfo": read("/proc/self/mountinfo"),
    "build": build_paths(),
}))
"#;

/// Host paths the kernel must not learn: the gateway's runtime directory, the checkout (the
/// kernel venv's directory) and the base interpreter's prefix (a pyenv under `/root` here).
fn host_markers(runtime_root: &std::path::Path) -> Result<Vec<String>> {
    let venv = kernels_dir().join("python3/.venv");
    let cfg = std::fs::read_to_string(venv.join("pyvenv.cfg"))?;
    let home = cfg
        .lines()
        .find_map(|l| l.split_once('=').filter(|(k, _)| k.trim() == "home"))
        .map(|(_, v)| v.trim().trim_end_matches("/bin").to_owned())
        .context("home in pyvenv.cfg")?;
    let mut markers = vec![
        runtime_root.display().to_string(),
        venv.display().to_string(),
        repo().display().to_string(),
    ];
    // A Debian interpreter under /usr is the same on every host: not a marker.
    if !home.starts_with("/usr") {
        markers.push(home);
    }
    Ok(markers)
}

/// Two sandboxes read a boot id of their own (not the host's, not each other's) and a
/// command line that is not the host's; nothing the kernel is told (working directory,
/// environment, prefixes, command, connection file) names a host path; IPython's and
/// matplotlib's files stay out of the workspace.
#[tokio::test]
async fn boot_id_and_cmdline_are_the_sandboxes_own() -> Result<()> {
    let arena = arena().await?;
    let (a, mut first) = arena.attacker("default").await?;
    let (_b, mut second) = arena.attacker("default").await?;
    let host_boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let host_cmdline = std::fs::read_to_string("/proc/cmdline")?;

    let one = json_out(&first.run(PROBE).await?)?;
    let two = json_out(&second.run(PROBE).await?)?;
    println!("host view: {}", one["where"]);
    let markers = host_markers(&runtime_root_of(&a)?)?;
    for seen in [&one, &two] {
        let text = seen["where"].to_string();
        for marker in &markers {
            ensure!(
                !text.contains(marker.as_str()),
                "the kernel sees the host path {marker}: {}",
                seen["where"]
            );
        }
        ensure!(
            seen["where"]["cwd"] == "/home/user" && seen["where"]["home"] == "/home/user",
            "the workspace is not at /home/user: {}",
            seen["where"]
        );
        ensure!(
            seen["where"]["prefix"] == "/opt/cellgate/venv",
            "sys.prefix: {}",
            seen["where"]["prefix"]
        );
        let leaks: Vec<&str> = seen["mountinfo"]
            .as_str()
            .unwrap_or_default()
            .lines()
            .filter(|l| markers.iter().any(|m| l.contains(m.as_str())))
            .collect();
        // The installation's own files: sysconfig's build variables, compiled modules of
        // the standard library and of the venv, scripts.
        let build = &seen["build"];
        let compiled = build["pyc"].as_object().context("pyc")?;
        ensure!(
            compiled["json"].is_string() && compiled["ipykernel.kernelapp"].is_string(),
            "no compiled modules to read: {:?}",
            compiled.keys()
        );
        let scripts = build["scripts"].as_object().context("scripts")?;
        ensure!(
            scripts.len() > 3,
            "no scripts to read: {:?}",
            scripts.keys()
        );
        let text = build.to_string();
        for marker in &markers {
            ensure!(
                !text.contains(marker.as_str()),
                "the Python installation's files name the host path {marker}"
            );
        }
        // Binds name their source's path within its host file system: the runtime
        // directory and the Python environment are not binds (gVisor shows no host mounts).
        ensure!(
            leaks.is_empty(),
            "/proc/self/mountinfo names host paths: {leaks:#?}"
        );
        let boot_id = seen["boot_id"].as_str().context("boot_id")?;
        // gVisor has no such file at all: as neutral as a boot id of its own.
        ensure!(
            boot_id.trim().len() == 36 || boot_id.contains("No such file"),
            "boot_id is neither a UUID nor absent: {boot_id:?}"
        );
        ensure!(
            boot_id != host_boot_id,
            "the sandbox reads the host's boot_id"
        );
        let cmdline = seen["cmdline"].as_str().context("cmdline")?;
        ensure!(
            cmdline != host_cmdline,
            "the sandbox reads the host's command line: {cmdline:?}"
        );
        for (name, dir) in seen["env"].as_object().context("env")? {
            ensure!(
                dir.as_str().is_some_and(|d| d.starts_with("/tmp/")),
                "{name} is {dir}, not under the sandbox's /tmp"
            );
        }
    }
    let present = one["boot_id"]
        .as_str()
        .is_some_and(|b| b.trim().len() == 36);
    ensure!(
        !present || one["boot_id"] != two["boot_id"],
        "two sandboxes share a boot_id: {}",
        one["boot_id"]
    );

    // IPython (started) and matplotlib (imported, cache built) leave the workspace alone.
    let msgs = second
        .run("import matplotlib\nmatplotlib.use('agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])\nimport os\nprint(sorted(os.listdir(os.path.expanduser('~'))))")
        .await?;
    ensure!(reply(&msgs).content["status"] == "ok", "{msgs:?}");
    let listed = stdout(&msgs);
    let names = [".ipython", ".cache", ".config"];
    ensure!(
        names.iter().all(|n| !listed.contains(n)),
        "the workspace holds the libraries' own files: {listed}"
    );
    Ok(())
}
