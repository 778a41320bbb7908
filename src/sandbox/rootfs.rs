//! What every backend's root file system shows of the host, beside the kernel's own
//! directories: the merged-`/usr` links, a short list of harmless `/etc` entries, and the
//! `/etc` files generated for the sandbox (who the kernel is, localhost).
//!
//! One list for both backends: the namespaces backend and gVisor had grown different `/etc`
//! lists with no reason written down, so a file the kernel found under one was missing under
//! the other. An entry the host lacks is skipped by both.
//!
//! Must not depend on: kernels, HTTP, any one backend.

use std::path::Path;

/// Top-level host entries that are symlinks into `/usr` on merged-usr systems (Debian since
/// bookworm) and directories elsewhere; names below `/`.
pub const USR_LINKS: &[&str] = &["bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// Host `/etc` entries the kernel may read, each shown read-only on its own: the dynamic
/// linker's cache, TLS certificates, fonts, time zone, MIME types, resolver and locale
/// settings that name no host, Debian's alternatives links and the two R settings R cannot
/// start without (`/usr/lib/R/etc` links into `/etc/R`; not its `*.site` files, where hosts
/// keep tokens). Never `shadow`,
/// `ssl/private`, `resolv.conf`, `hosts`, `hostname` or the gateway's configuration.
pub const ETC_ENTRIES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/ca-certificates",
    "/etc/ca-certificates.conf",
    "/etc/pki",
    "/etc/crypto-policies",
    "/etc/fonts",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/mime.types",
    "/etc/os-release",
    "/etc/debian_version",
    "/etc/protocols",
    "/etc/services",
    "/etc/gai.conf",
    "/etc/host.conf",
    "/etc/inputrc",
    "/etc/locale.alias",
    "/etc/R/Renviron",
    "/etc/R/ldpaths",
];

/// The generated `/etc` files, by name: `passwd` and `group` with root, the kernel's user
/// (`uid`, `gid`, its home) and nobody; `hosts` and `hostname` with localhost and the
/// sandbox's `hostname`; an `nsswitch.conf` that reads only files.
pub fn etc_files(uid: u32, gid: u32, hostname: &str, home: &Path) -> Vec<(&'static str, String)> {
    const NOBODY: u32 = 65534;
    let home = home.display();
    let mut passwd = format!(
        "root:x:0:0:root:/root:/usr/sbin/nologin\nkernel:x:{uid}:{gid}:kernel:{home}:/bin/sh\n"
    );
    // A kernel that runs as nobody (gVisor's) is `kernel` by name: one entry per id.
    if uid != NOBODY {
        passwd.push_str("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n");
    }
    let mut group = format!("root:x:0:\nkernel:x:{gid}:\n");
    if gid != NOBODY {
        group.push_str("nogroup:x:65534:\n");
    }
    vec![
        ("passwd", passwd),
        ("group", group),
        (
            "hosts",
            format!("127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n"),
        ),
        ("hostname", format!("{hostname}\n")),
        (
            "nsswitch.conf",
            "passwd: files\ngroup: files\nshadow: files\nhosts: files\nnetworks: files\n\
             protocols: files\nservices: files\n"
                .to_owned(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_per_id_and_never_a_host_secret() {
        let files = etc_files(65534, 65534, "sandbox", Path::new("/home/user"));
        let passwd = &files[0].1;
        assert_eq!(passwd.matches(":65534:").count(), 1, "{passwd}");
        assert!(passwd.contains("kernel:x:65534:65534:kernel:/home/user:/bin/sh"));
        let files = etc_files(1000, 1000, "sandbox", Path::new("/home/user"));
        assert!(files[0].1.contains("nobody:x:65534"));
        assert!(files[2].1.contains("localhost sandbox"));
        for secret in [
            "shadow",
            "ssl/private",
            "resolv.conf",
            "/etc/hosts",
            "cellgate",
        ] {
            assert!(
                !ETC_ENTRIES.iter().any(|e| e.contains(secret)),
                "{secret} is listed"
            );
        }
    }
}
