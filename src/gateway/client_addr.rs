//! Who a request came from: the TCP peer, or, when the peer is a reverse proxy the operator
//! trusts (`--trusted-proxy`), the client that proxy names in `X-Forwarded-For`.
//!
//! The header is a list each proxy appends to (nginx's `$proxy_add_x_forwarded_for`): the
//! client's own claims on the left, the address each proxy saw on the right. Only the
//! entries the trusted proxies wrote can be believed, so the list is walked from the right:
//! entries that are themselves trusted proxies (a chain: a load balancer, then nginx) are
//! skipped, and the first one that is not is the client. What is left of it was written by
//! the client or by proxies nobody vouches for, and is never read.
//!
//! - A peer that is not trusted is the client, whatever the header says: a client that
//!   connects directly cannot claim another address.
//! - An entry is an IPv4 or IPv6 address, optionally with a port (`198.51.100.7:5678`,
//!   `[2001:db8::7]:5678`; some load balancers append one), which is dropped; IPv4-mapped
//!   IPv6 addresses count as their IPv4 address, as peers do. Anything else (`unknown`, an
//!   empty entry, a zone id, a name) is malformed and ends the walk with the peer as the
//!   client: never a value the gateway could not read, and never an entry left of it.
//! - When every entry is a trusted proxy, the leftmost is the client (an internal caller,
//!   such as a load balancer's health check, reached the gateway through the chain).
//! - Several `X-Forwarded-For` lines are one list, in order (RFC 9110, section 5.3).
//!   RFC 7239's `Forwarded` header is not read: nginx and the common ingress controllers
//!   send `X-Forwarded-For`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use axum::http::{HeaderMap, HeaderName};
use ipnet::IpNet;

/// The header proxies name the client in.
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The address of the client a request came from; a request extension, put on every
/// request by the listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr {
    /// The client: the TCP peer, or the address a trusted proxy forwarded for.
    pub ip: IpAddr,
    /// The trusted proxy the request came through (the TCP peer), when `ip` was taken from
    /// its `X-Forwarded-For`.
    pub via: Option<IpAddr>,
}

/// The networks of trusted proxies; cheap to clone (one per listener and connection).
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies {
    networks: Arc<[IpNet]>,
}

impl TrustedProxies {
    /// Trusts `networks` (as the config resolved them: see `config::trusted_network`).
    pub fn new(networks: &[IpNet]) -> TrustedProxies {
        TrustedProxies {
            networks: networks.into(),
        }
    }

    /// Whether connections from `ip` come from a trusted proxy.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.networks.iter().any(|network| network.contains(&ip))
    }

    /// The trusted networks that hold every address of their family (`0.0.0.0/0`,
    /// `::/0`): with one, any client of that family can name itself whatever it likes.
    pub fn everything(&self) -> impl Iterator<Item = &IpNet> {
        self.networks
            .iter()
            .filter(|network| network.prefix_len() == 0)
    }

    /// The client of a request that came from `peer` with `headers`.
    pub fn client(&self, peer: IpAddr, headers: &HeaderMap) -> ClientAddr {
        let peer = peer.to_canonical();
        let direct = ClientAddr {
            ip: peer,
            via: None,
        };
        if self.networks.is_empty() || !self.contains(peer) {
            return direct;
        }
        let mut leftmost = None;
        for value in headers.get_all(&X_FORWARDED_FOR).iter().rev() {
            let Ok(value) = value.to_str() else {
                return direct;
            };
            for entry in value.rsplit(',') {
                let Some(ip) = parse_entry(entry) else {
                    return direct;
                };
                if !self.contains(ip) {
                    return ClientAddr {
                        ip,
                        via: Some(peer),
                    };
                }
                leftmost = Some(ip);
            }
        }
        match leftmost {
            Some(ip) => ClientAddr {
                ip,
                via: Some(peer),
            },
            None => direct,
        }
    }
}

/// One `X-Forwarded-For` entry: an address, or an address and a port (dropped); `None` for
/// anything else.
fn parse_entry(entry: &str) -> Option<IpAddr> {
    // Spaces around the commas are the list syntax's (RFC 9110's OWS).
    let entry = entry.trim_matches([' ', '\t']);
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Some(rest) = entry.strip_prefix('[') {
        // `[2001:db8::7]` or `[2001:db8::7]:5678`.
        let (ip, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        return ip
            .parse::<Ipv6Addr>()
            .ok()
            .map(|ip| IpAddr::V6(ip).to_canonical());
    }
    // `198.51.100.7:5678`; an IPv6 address with a port must be bracketed (else its last
    // group and a port could not be told apart), and parsed above.
    let (ip, port) = entry.split_once(':')?;
    if !is_port(port) {
        return None;
    }
    ip.parse::<Ipv4Addr>().ok().map(IpAddr::V4)
}

/// Decimal digits that make a port number (`u16`'s own parser also takes a `+`).
fn is_port(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) && text.parse::<u16>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn trusted(networks: &[&str]) -> TrustedProxies {
        let networks: Vec<IpNet> = networks.iter().map(|n| n.parse().unwrap()).collect();
        TrustedProxies::new(&networks)
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn headers(lines: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for line in lines {
            headers.append(&X_FORWARDED_FOR, HeaderValue::from_str(line).unwrap());
        }
        headers
    }

    /// The client of a request from `peer` with `lines` of `X-Forwarded-For`, as
    /// `(client, via)`.
    fn client(proxies: &TrustedProxies, peer: &str, lines: &[&str]) -> (IpAddr, Option<IpAddr>) {
        let found = proxies.client(ip(peer), &headers(lines));
        (found.ip, found.via)
    }

    #[test]
    fn the_rightmost_untrusted_entry_is_the_client() {
        let proxies = trusted(&["10.0.0.0/8", "127.0.0.1/32"]);
        let via = Some(ip("127.0.0.1"));
        assert_eq!(
            client(&proxies, "127.0.0.1", &["198.51.100.7"]),
            (ip("198.51.100.7"), via)
        );
        // The client's own claim, on the left, is never read.
        assert_eq!(
            client(&proxies, "127.0.0.1", &["1.2.3.4, 198.51.100.7"]),
            (ip("198.51.100.7"), via)
        );
        // A chain: trusted hops on the right are skipped.
        assert_eq!(
            client(
                &proxies,
                "127.0.0.1",
                &["1.2.3.4,198.51.100.7 , 10.0.0.9,10.1.1.1"]
            ),
            (ip("198.51.100.7"), via)
        );
        // Several header lines are one list, in order.
        assert_eq!(
            client(
                &proxies,
                "127.0.0.1",
                &["1.2.3.4, 198.51.100.7", "10.0.0.9"]
            ),
            (ip("198.51.100.7"), via)
        );
        assert_eq!(
            client(&proxies, "127.0.0.1", &["10.0.0.9", "198.51.100.8"]),
            (ip("198.51.100.8"), via)
        );
        // Every entry trusted: the leftmost, the farthest hop known.
        assert_eq!(
            client(&proxies, "10.2.0.1", &["10.0.0.5, 10.0.0.9"]),
            (ip("10.0.0.5"), Some(ip("10.2.0.1")))
        );
    }

    #[test]
    fn an_untrusted_peer_or_no_header_means_the_peer() {
        let proxies = trusted(&["10.0.0.0/8"]);
        // A direct client cannot claim another address.
        assert_eq!(
            client(&proxies, "192.0.2.1", &["10.0.0.1"]),
            (ip("192.0.2.1"), None)
        );
        assert_eq!(
            client(&proxies, "192.0.2.1", &["198.51.100.7"]),
            (ip("192.0.2.1"), None)
        );
        assert_eq!(client(&proxies, "10.0.0.3", &[]), (ip("10.0.0.3"), None));
        // Nothing trusted: the header is ignored even from loopback.
        assert_eq!(
            client(&TrustedProxies::default(), "127.0.0.1", &["198.51.100.7"]),
            (ip("127.0.0.1"), None)
        );
    }

    #[test]
    fn a_malformed_entry_stops_the_walk_at_the_peer() {
        let proxies = trusted(&["10.0.0.0/8"]);
        let peer = (ip("10.0.0.3"), None);
        for header in [
            "unknown",
            "",
            "198.51.100.7,",
            "198.51.100.7, , 10.0.0.1",
            "198.51.100.7, garbage, 10.0.0.1",
            "198.51.100.7 10.0.0.1",
            "fe80::1%eth0",
            "2001:db8::7:5678:1:2:3:4:5",
            "[2001:db8::7",
            "[2001:db8::7]5678",
            "[198.51.100.7]:80",
            "198.51.100.7:",
            "198.51.100.7:+80",
            "198.51.100.7:65536",
            "198.051.100.7",
            "_hidden",
        ] {
            assert_eq!(client(&proxies, "10.0.0.3", &[header]), peer, "{header:?}");
        }
        // A malformed entry left of the client is never reached.
        assert_eq!(
            client(&proxies, "10.0.0.3", &["garbage, 198.51.100.7"]),
            (ip("198.51.100.7"), Some(ip("10.0.0.3")))
        );
        // A value that is not visible ASCII is malformed too.
        let mut opaque = HeaderMap::new();
        opaque.insert(
            &X_FORWARDED_FOR,
            HeaderValue::from_bytes(b"198.51.100.\xff").unwrap(),
        );
        assert_eq!(
            proxies.client(ip("10.0.0.3"), &opaque),
            ClientAddr {
                ip: ip("10.0.0.3"),
                via: None
            }
        );
    }

    #[test]
    fn ipv6_mapped_addresses_and_ports() {
        let proxies = trusted(&["10.0.0.0/8", "fd00::/8"]);
        // IPv6, bare or bracketed, with or without a port.
        for (header, want) in [
            ("2001:db8::7", "2001:db8::7"),
            ("[2001:db8::7]", "2001:db8::7"),
            ("[2001:db8::7]:5678", "2001:db8::7"),
            ("198.51.100.7:5678", "198.51.100.7"),
            ("1.2.3.4:1, 198.51.100.7:0", "198.51.100.7"),
            // Mapped addresses are their IPv4 address, trusted or not.
            ("::ffff:198.51.100.7", "198.51.100.7"),
            ("[::ffff:198.51.100.7]:80", "198.51.100.7"),
            ("198.51.100.7, ::ffff:10.0.0.1", "198.51.100.7"),
            ("198.51.100.7, fd00::1", "198.51.100.7"),
        ] {
            assert_eq!(
                client(&proxies, "fd00::2", &[header]),
                (ip(want), Some(ip("fd00::2"))),
                "{header:?}"
            );
        }
        // A proxy on a dual-stack listener arrives as a mapped address: still trusted, and
        // named as IPv4.
        assert_eq!(
            client(&proxies, "::ffff:10.0.0.3", &["198.51.100.7"]),
            (ip("198.51.100.7"), Some(ip("10.0.0.3")))
        );
        assert!(proxies.contains(ip("::ffff:10.9.9.9")));
        assert!(!proxies.contains(ip("::ffff:11.0.0.1")));
        assert!(!proxies.contains(ip("fe00::1")));
    }

    #[test]
    fn everything_names_only_networks_of_every_address() {
        let proxies = trusted(&["10.0.0.0/8", "0.0.0.0/0", "::/0", "::1/128"]);
        let wide: Vec<String> = proxies.everything().map(ToString::to_string).collect();
        assert_eq!(wide, ["0.0.0.0/0", "::/0"]);
        assert_eq!(trusted(&["10.0.0.0/8"]).everything().count(), 0);
    }
}
