//! A pod's network, as a CNI plugin would make it: its own network namespace, a veth pair
//! whose pod end is `eth0` with a 10.244.x.y address of a /30 the host end shares, `lo`
//! up, and no default route, so the host reaches the pod's IP directly and the pod
//! reaches nothing but its host end (what the gateway's NetworkPolicy leaves a kernel pod).
//!
//! Names carry the owning process's pid (`cgk-<pid>-<double>-<n>`), so leftovers of a
//! test process that died are recognised and removed at the next start; a /30 is claimed
//! by creating its host link (`cgkv<index>`), which the kernel lets only one process do.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::process::Command;

/// A pod's network namespace and addresses.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub netns: String,
    pub host_link: String,
    pub pod_ip: Ipv4Addr,
    pub host_ip: Ipv4Addr,
}

/// The /30s of 10.244.0.0/16.
const SUBNETS: u64 = 16384;
const NETNS_DIR: &str = "/run/netns";

pub struct Network {
    prefix: String,
    next: AtomicU64,
    first_subnet: u64,
}

async fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .await
        .map_err(|err| format!("ip {}: {err}", args.join(" ")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

impl Network {
    /// `double` tells apart the doubles of one process.
    pub fn new(double: u64) -> Network {
        let pid = u64::from(std::process::id());
        Network {
            prefix: format!("cgk-{pid}-{double}"),
            next: AtomicU64::new(0),
            first_subnet: (pid * 7919 + double * 127) % SUBNETS,
        }
    }

    pub async fn create(&self) -> Result<Sandbox, String> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let netns = format!("{}-{n}", self.prefix);
        ip(&["netns", "add", &netns]).await?;
        let made = self.wire(&netns, n).await;
        if made.is_err() {
            let _ = ip(&["netns", "del", &netns]).await;
        }
        made
    }

    async fn wire(&self, netns: &str, n: u64) -> Result<Sandbox, String> {
        for attempt in 0..SUBNETS {
            let index = (self.first_subnet + n * 37 + attempt) % SUBNETS;
            let host_link = format!("cgkv{index}");
            let made = ip(&[
                "link", "add", &host_link, "type", "veth", "peer", "name", "eth0", "netns", netns,
            ])
            .await;
            match made {
                Ok(()) => {}
                Err(err) if err.contains("File exists") => continue,
                Err(err) => return Err(err),
            }
            let base = u32::from(Ipv4Addr::new(10, 244, 0, 0)) + (index as u32) * 4;
            let host_ip = Ipv4Addr::from(base + 1);
            let pod_ip = Ipv4Addr::from(base + 2);
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_link]).await?;
            ip(&["link", "set", &host_link, "up"]).await?;
            ip(&[
                "-n",
                netns,
                "addr",
                "add",
                &format!("{pod_ip}/30"),
                "dev",
                "eth0",
            ])
            .await?;
            ip(&["-n", netns, "link", "set", "eth0", "up"]).await?;
            ip(&["-n", netns, "link", "set", "lo", "up"]).await?;
            return Ok(Sandbox {
                netns: netns.to_owned(),
                host_link,
                pod_ip,
                host_ip,
            });
        }
        Err("no free /30 in 10.244.0.0/16".to_owned())
    }

    /// Removes a pod's namespace (its veth pair goes with it).
    pub async fn destroy(&self, sandbox: &Sandbox) {
        if let Err(err) = ip(&["netns", "del", &sandbox.netns]).await {
            eprintln!("kube_api: {err}");
        }
    }

    /// Removes every namespace of this double that is still there (the last resort when
    /// it is dropped).
    pub fn destroy_all_now(&self) {
        for name in netns_names() {
            if name.starts_with(&format!("{}-", self.prefix)) {
                delete_now(&name);
            }
        }
    }

    /// Removes the namespaces of test processes that are gone.
    pub fn remove_stale() {
        for name in netns_names() {
            let Some(pid) = name
                .strip_prefix("cgk-")
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                delete_now(&name);
            }
        }
    }
}

fn netns_names() -> Vec<String> {
    std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("cgk-"))
        .collect()
}

fn delete_now(name: &str) {
    let deleted = std::process::Command::new("ip")
        .args(["netns", "del", name])
        .output();
    if !deleted.is_ok_and(|o| o.status.success()) {
        eprintln!("kube_api: could not delete the network namespace {name}");
    }
}

/// Whether a network namespace of that name exists.
pub fn netns_exists(name: &str) -> bool {
    Path::new(NETNS_DIR).join(name).exists()
}
