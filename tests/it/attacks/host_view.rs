//! Fingerprinting the host from inside the sandbox (issue 13, item 5, in part).
//!
//! `/proc/sys/kernel/random/boot_id` and `/proc/cmdline` are the same for every process of a
//! host: two sessions that read the same values know they share a machine (and the host's
//! command line names its disks and images). Inside a sandbox both are the sandbox's own now.
//! And the kernel's `$HOME` is the user's workspace: IPython's and matplotlib's own files
//! went there among the user's; they go to the sandbox's private `/tmp` now.
//!
//! Not covered yet (the rest of item 5): host paths in `/proc/self/mountinfo`, the working
//! directory and the interpreter's prefix.

use super::{arena, json_out};
use crate::support::*;
use anyhow::{ensure, Context, Result};

const PROBE: &str = r#"
import json, os
def read(path):
    try:
        return open(path).read()
    except OSError as e:
        return f"error: {e}"
print(json.dumps({
    "boot_id": read("/proc/sys/kernel/random/boot_id"),
    "cmdline": read("/proc/cmdline"),
    "env": {k: os.environ.get(k) for k in ("IPYTHONDIR", "MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")},
}))
"#;

/// Two sandboxes read a boot id of their own (not the host's, not each other's) and a
/// command line that is not the host's; IPython's and matplotlib's files stay out of the
/// workspace.
#[tokio::test]
async fn boot_id_and_cmdline_are_the_sandboxes_own() -> Result<()> {
    let arena = arena().await?;
    let (_a, mut first) = arena.attacker("default").await?;
    let (_b, mut second) = arena.attacker("default").await?;
    let host_boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let host_cmdline = std::fs::read_to_string("/proc/cmdline")?;

    let one = json_out(&first.run(PROBE).await?)?;
    let two = json_out(&second.run(PROBE).await?)?;
    println!("host view: {one}");
    for seen in [&one, &two] {
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
