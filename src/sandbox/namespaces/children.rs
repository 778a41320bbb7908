//! The sandbox's processes as the gateway finds them in `/proc`: the helper's one child
//! (the init) and the init's child that is the kernel. Used when a sandbox starts and when a
//! zygote forks a kernel.

/// The host pid of `parent`'s one child.
pub fn only_child(parent: i32) -> Option<i32> {
    let children =
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    let mut pids = children.split_whitespace().filter_map(|p| p.parse().ok());
    match (pids.next(), pids.next()) {
        (Some(pid), None) => Some(pid),
        _ => None,
    }
}

/// The host pid of the init's child whose pid in the sandbox is `ns_pid`: the kernel
/// process. The init has another child when the plan names an egress socket (the egress
/// bridge, forked first), so the kernel is told by its pid in the namespace (the last field
/// of `NSpid`), never by its place among the children.
pub fn kernel_child(parent: i32, ns_pid: i32) -> Option<i32> {
    let status_of = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/status")).ok();
    let field = |status: &str, name: &str| -> Option<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
    };
    let is_kernel = |pid: i32| {
        status_of(pid).is_some_and(|status| {
            field(&status, "PPid:").and_then(|v| v.parse::<i32>().ok()) == Some(parent)
                && field(&status, "NSpid:")
                    .and_then(|v| v.split_whitespace().last()?.parse::<i32>().ok())
                    == Some(ns_pid)
        })
    };
    if let Ok(children) = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
    {
        return children
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .find(|&pid| is_kernel(pid));
    }
    // Kernels without CONFIG_PROC_CHILDREN: scan every process.
    let entries = std::fs::read_dir("/proc").ok()?;
    entries.flatten().find_map(|entry| {
        let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
        is_kernel(pid).then_some(pid)
    })
}
