//! The `[egress]` and `[packages]` sections of a policy: which hosts a kernel may reach
//! through cellgate's proxy, and which Python projects its index lists.
//!
//! Plain values and pure matching functions; the proxy (`crate::egress`) and the index
//! (`crate::egress::packages`) apply them.

use serde::Deserialize;

/// `[egress]` as written in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EgressSection {
    /// `"deny"` is the only default; spelled out so a file can say what it means.
    default: Option<String>,
    #[serde(default)]
    allow: Vec<String>,
}

/// `[packages]` as written in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PackagesSection {
    #[serde(default)]
    allow: Vec<String>,
    dependencies: Option<Dependencies>,
}

/// Whether dependencies of allowed projects must be listed themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dependencies {
    /// Every project pip asks for must be listed; the denial names the missing one.
    #[default]
    Explicit,
    /// A project that an allowed project's wheel declares in `Requires-Dist` is served too
    /// (any version), once that wheel was fetched through the index by the same session.
    Implicit,
}

/// A host pattern: an exact name (`api.github.com`), a subdomain wildcard (`*.example.org`,
/// which does not match `example.org` itself), or an IP address literal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    Exact(String),
    Suffix(String),
}

/// One `allow` entry of `[egress]`: a host pattern and a port (`*` for any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressRule {
    pub host: HostPattern,
    pub port: Option<u16>,
}

impl EgressRule {
    pub fn parse(entry: &str) -> Result<EgressRule, String> {
        let (host, port) = entry
            .rsplit_once(':')
            .ok_or_else(|| format!("{entry:?}: expected host:port (port may be *)"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port = match port {
            "*" => None,
            p => Some(
                p.parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| format!("{entry:?}: bad port {p:?}"))?,
            ),
        };
        let host = host.to_ascii_lowercase();
        let valid = |name: &str| {
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | ':'))
        };
        let host = match host.strip_prefix("*.") {
            Some(rest) if valid(rest) => HostPattern::Suffix(format!(".{rest}")),
            None if valid(&host) => HostPattern::Exact(host),
            _ => return Err(format!("{entry:?}: bad host pattern")),
        };
        Ok(EgressRule { host, port })
    }

    pub fn matches(&self, host: &str, port: u16) -> bool {
        let host_ok = match &self.host {
            HostPattern::Exact(name) => name.eq_ignore_ascii_case(host),
            HostPattern::Suffix(suffix) => {
                // Bytes, not str slicing: a non-ASCII host must not split a character.
                host.len() > suffix.len()
                    && host.as_bytes()[host.len() - suffix.len()..]
                        .eq_ignore_ascii_case(suffix.as_bytes())
            }
        };
        host_ok && self.port.is_none_or(|p| p == port)
    }

    /// Whether this rule names exactly this host (not by wildcard): only such rules open
    /// loopback, private, link-local or metadata addresses.
    pub fn names_exactly(&self, host: &str) -> bool {
        matches!(&self.host, HostPattern::Exact(name) if name.eq_ignore_ascii_case(host))
    }
}

/// The egress rules of a policy. Empty: nothing is reachable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressRules {
    pub allow: Vec<EgressRule>,
}

impl EgressRules {
    /// The rule that allows `host:port`, if any.
    pub fn allowing(&self, host: &str, port: u16) -> Option<&EgressRule> {
        self.allow.iter().find(|r| r.matches(host, port))
    }
}

/// PEP 503 normalisation: lowercase, runs of `-`, `_` and `.` become one `-`.
pub fn normalize_project(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut sep = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            sep = true;
            continue;
        }
        if sep && !out.is_empty() {
            out.push('-');
        }
        sep = false;
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// One `allow` entry of `[packages]`: a project and optionally a version pattern
/// (`==2.32.*`, `==1.0`); other specifiers are refused, so a pin means what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageRule {
    /// Normalised name.
    pub project: String,
    /// The version as written after `==`; a trailing `.*` matches a prefix.
    pub version: Option<String>,
}

impl PackageRule {
    pub fn parse(entry: &str) -> Result<PackageRule, String> {
        let entry = entry.trim();
        let (name, version) = match entry.split_once("==") {
            Some((n, v)) => (n.trim(), Some(v.trim().to_owned())),
            None => (entry, None),
        };
        let valid_name = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !valid_name {
            return Err(format!(
                "{entry:?}: expected a project name, optionally with ==version or ==version.*"
            ));
        }
        if let Some(v) = &version {
            let body = v.strip_suffix(".*").unwrap_or(v);
            if body.is_empty()
                || !body
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '!'))
            {
                return Err(format!("{entry:?}: bad version {v:?}"));
            }
        }
        Ok(PackageRule {
            project: normalize_project(name),
            version,
        })
    }

    pub fn version_matches(&self, version: &str) -> bool {
        match &self.version {
            None => true,
            Some(pin) => match pin.strip_suffix(".*") {
                Some(prefix) => {
                    version == prefix
                        || version
                            .strip_prefix(prefix)
                            .is_some_and(|rest| rest.starts_with('.'))
                }
                None => version == pin,
            },
        }
    }
}

/// The package rules of a policy. Empty: the index lists nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackageRules {
    pub allow: Vec<PackageRule>,
    pub dependencies: Dependencies,
}

impl PackageRules {
    /// The rule for a project (any spelling), if listed.
    pub fn rule(&self, project: &str) -> Option<&PackageRule> {
        let name = normalize_project(project);
        self.allow.iter().find(|r| r.project == name)
    }
}

pub(super) fn egress_rules(section: EgressSection) -> Result<EgressRules, (&'static str, String)> {
    match section.default.as_deref() {
        None | Some("deny") => {}
        Some(other) => {
            return Err((
                "egress.default",
                format!("{other:?}: only \"deny\" (list what is allowed in egress.allow)"),
            ))
        }
    }
    let allow = section
        .allow
        .iter()
        .map(|e| EgressRule::parse(e))
        .collect::<Result<_, _>>()
        .map_err(|e| ("egress.allow", e))?;
    Ok(EgressRules { allow })
}

pub(super) fn package_rules(
    section: PackagesSection,
) -> Result<PackageRules, (&'static str, String)> {
    let allow = section
        .allow
        .iter()
        .map(|e| PackageRule::parse(e))
        .collect::<Result<_, _>>()
        .map_err(|e| ("packages.allow", e))?;
    Ok(PackageRules {
        allow,
        dependencies: section.dependencies.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_patterns() {
        let r = EgressRule::parse("*.example.org:443").unwrap();
        assert!(r.matches("a.example.org", 443) && r.matches("A.b.Example.org", 443));
        assert!(!r.matches("example.org", 443) && !r.matches("a.example.org", 80));
        assert!(!r.matches("evilexample.org", 443));
        assert!(!r.matches("ééééééééééééé", 443));
        let r = EgressRule::parse("api.github.com:*").unwrap();
        assert!(r.matches("api.github.com", 1) && r.names_exactly("API.github.com"));
        assert!(EgressRule::parse("nohost").is_err());
        assert!(EgressRule::parse("a b:1").is_err());
        assert!(EgressRule::parse("a:0").is_err());
        assert!(EgressRule::parse("[::1]:80").unwrap().matches("::1", 80));
    }

    #[test]
    fn package_names_and_pins() {
        assert_eq!(normalize_project("Foo.Bar__baz"), "foo-bar-baz");
        let r = PackageRule::parse("Requests==2.32.*").unwrap();
        assert_eq!(r.project, "requests");
        assert!(r.version_matches("2.32.3") && r.version_matches("2.32"));
        assert!(!r.version_matches("2.320.0") && !r.version_matches("2.31.0"));
        let r = PackageRule::parse("x==1.0").unwrap();
        assert!(r.version_matches("1.0") && !r.version_matches("1.0.1"));
        assert!(PackageRule::parse("x>=1").is_err());
        assert!(PackageRule::parse("x==").is_err());
    }
}
