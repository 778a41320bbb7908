//! Name resolution for the proxy, and the address classes it refuses.
//!
//! The sandbox has no resolver: the proxy resolves every name itself (through the gateway's
//! static host map first, then the system resolver) and checks every address it would
//! connect to. Loopback, private, shared (CGNAT), link-local (with the cloud metadata
//! address), multicast, NAT64 and unspecified addresses are refused unless the policy names the
//! host exactly; a wildcard rule never opens them. The gateway's own port on this machine
//! counts as loopback. Checking the resolved addresses (not the name) closes DNS rebinding
//! onto internal networks: what is checked is what is dialled.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::policy::access::EgressRule;

/// Why an address is internal, or `None` for a public address.
pub fn internal_class(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_class(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return v4_class(v4);
            }
            let seg = v6.segments();
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if seg[0] & 0xfe00 == 0xfc00 {
                Some("private (unique local)")
            } else if seg[0] & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if seg[0] == 0x64 && seg[1] == 0xff9b {
                // NAT64 can reach any IPv4 address, internal ones included.
                Some("NAT64")
            } else {
                None
            }
        }
    }
}

fn v4_class(v4: Ipv4Addr) -> Option<&'static str> {
    let o = v4.octets();
    if v4 == Ipv4Addr::new(169, 254, 169, 254) {
        Some("cloud metadata")
    } else if v4.is_loopback() {
        Some("loopback")
    } else if v4.is_private() {
        Some("private")
    } else if v4.is_link_local() {
        Some("link-local")
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        Some("shared (CGNAT)")
    } else if o[0] == 0 || v4.is_broadcast() {
        Some("unspecified")
    } else if v4.is_multicast() || o[0] >= 240 {
        Some("multicast or reserved")
    } else {
        None
    }
}

/// What the proxy needs to resolve and vet a destination.
#[derive(Debug, Clone, Default)]
pub struct Resolver {
    /// Names answered without DNS (gateway config `egress_hosts`); tests map their names to
    /// loopback servers this way.
    pub host_map: HashMap<String, IpAddr>,
    /// The gateway's own listening address.
    pub gateway: Option<SocketAddr>,
}

/// A destination the proxy refused or could not resolve.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{host} does not resolve: {reason}")]
    NoAddress { host: String, reason: String },
    #[error("{host} resolves to {ip}, a {class} address; only a policy entry naming {host} exactly opens it")]
    Internal {
        host: String,
        ip: IpAddr,
        class: &'static str,
    },
}

impl Resolver {
    /// The addresses to dial for `host:port` under `rule` (the rule that allowed it).
    pub async fn resolve(
        &self,
        host: &str,
        port: u16,
        rule: &EgressRule,
    ) -> Result<Vec<SocketAddr>, ResolveError> {
        let host_lc = host.to_ascii_lowercase();
        let addrs: Vec<SocketAddr> = if let Some(ip) = self.host_map.get(&host_lc) {
            vec![SocketAddr::new(*ip, port)]
        } else if let Ok(ip) = host_lc
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            vec![SocketAddr::new(ip, port)]
        } else {
            tokio::net::lookup_host((host_lc.as_str(), port))
                .await
                .map_err(|e| ResolveError::NoAddress {
                    host: host.to_owned(),
                    reason: e.to_string(),
                })?
                .collect()
        };
        if addrs.is_empty() {
            return Err(ResolveError::NoAddress {
                host: host.to_owned(),
                reason: "no addresses".to_owned(),
            });
        }
        let named = rule.names_exactly(&host_lc);
        for addr in &addrs {
            let class = internal_class(addr.ip()).or_else(|| self.is_gateway(*addr));
            if let (Some(class), false) = (class, named) {
                return Err(ResolveError::Internal {
                    host: host.to_owned(),
                    ip: addr.ip(),
                    class,
                });
            }
        }
        Ok(addrs)
    }

    fn is_gateway(&self, addr: SocketAddr) -> Option<&'static str> {
        let gateway = self.gateway?;
        let same_host = gateway.ip().is_unspecified() || gateway.ip() == addr.ip();
        (addr.port() == gateway.port() && same_host).then_some("the gateway's own")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_addresses() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "169.254.1.1",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fd00:ec2::254",
            "fe80::1",
            "::ffff:127.0.0.1",
            "64:ff9b::a00:1",
        ] {
            assert!(internal_class(ip.parse().unwrap()).is_some(), "{ip}");
        }
        for ip in ["151.101.0.223", "2a04:4e42::223", "8.8.8.8"] {
            assert!(internal_class(ip.parse().unwrap()).is_none(), "{ip}");
        }
    }

    #[tokio::test]
    async fn wildcards_never_open_internal_addresses() {
        let mut r = Resolver::default();
        r.host_map
            .insert("svc.internal.test".into(), "127.0.0.1".parse().unwrap());
        let wild = EgressRule::parse("*.internal.test:80").unwrap();
        assert!(r.resolve("svc.internal.test", 80, &wild).await.is_err());
        let exact = EgressRule::parse("svc.internal.test:80").unwrap();
        assert!(r.resolve("svc.internal.test", 80, &exact).await.is_ok());
        let any = EgressRule::parse("*.0.0.1:*").unwrap();
        assert!(r.resolve("127.0.0.1", 80, &any).await.is_err());
    }
}
