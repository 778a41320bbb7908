//! A process's resource use read from `/proc`, for sandboxes without a cgroup to ask.
//!
//! Must not depend on: kernels, HTTP, any one backend.

use std::time::Duration;

use super::ResourceUsage;

/// CPU time and memory of process `pid`: user plus system time, resident and peak resident
/// memory. `None` once the process is gone.
pub fn usage(pid: u32) -> Option<ResourceUsage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|v| v * 1024)
    };
    Some(ResourceUsage {
        // Linux reports in clock ticks of 1/100 s on every architecture we run on.
        cpu_time: Some(Duration::from_millis(ticks * 10)),
        memory_bytes: kib("VmRSS:"),
        memory_peak_bytes: kib("VmHWM:"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_nothing_for_a_missing_one() {
        let own = usage(std::process::id()).expect("this process");
        assert!(own.memory_bytes.is_some_and(|b| b > 0));
        assert!(own.memory_peak_bytes >= own.memory_bytes);
        assert!(own.cpu_time.is_some());
        // Above the kernel's pid_max (at most 2^22): never a process.
        assert!(usage(5_000_000).is_none());
    }
}
