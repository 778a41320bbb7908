//! The `[egress]` and `[packages]` sections of a policy: which hosts a kernel may reach
//! through cellgate's proxy, and which Python projects its index lists (the npm packages of
//! `[packages] npm` are [`super::npm`]'s).
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
    /// npm packages (`name` or `name@range`), served by cellgate's npm registry.
    #[serde(default)]
    npm: Vec<String>,
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

/// One `allow` entry of `[packages]`: a project and optionally PEP 440 version specifiers
/// (`==2.32.*`, `>=1.4,!=1.5.0`, `~=2.1`), compared with PEP 440's semantics by
/// `pep440_rs` (`==2.0` matches `2.0.0`). A file whose version is not PEP 440 matches only
/// a rule without specifiers (or an `===` naming it exactly): deny by default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageRule {
    /// Normalised name.
    pub project: String,
    /// The specifiers as written (for messages); `None`: any version.
    pub version: Option<String>,
    /// What `version` says, parsed.
    specifiers: Vec<Specifier>,
}

/// One comma-separated clause of a rule's version.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Specifier {
    Pep440(pep440_rs::VersionSpecifier),
    /// `===text`: the version string exactly (PEP 440's arbitrary equality, which is
    /// meant for versions that are not PEP 440 and so is not parsed).
    Exactly(String),
}

impl Specifier {
    fn parse(clause: &str) -> Result<Specifier, String> {
        if let Some(text) = clause.strip_prefix("===") {
            let text = text.trim();
            if text.is_empty() || text.contains(char::is_whitespace) {
                return Err(format!("{clause:?}: expected a version after ==="));
            }
            return Ok(Specifier::Exactly(text.to_owned()));
        }
        clause
            .parse::<pep440_rs::VersionSpecifier>()
            .map(Specifier::Pep440)
            .map_err(|e| format!("{clause:?} is not a PEP 440 version specifier ({e})"))
    }

    fn matches(&self, raw: &str, version: Option<&pep440_rs::Version>) -> bool {
        match self {
            Specifier::Exactly(text) => text.eq_ignore_ascii_case(raw.trim()),
            Specifier::Pep440(spec) => version.is_some_and(|v| {
                // pep440_rs compares only as many release segments as the shorter side has,
                // so `==2.32.*` would take `2`; PEP 440 pads the candidate with zeros first.
                use pep440_rs::Operator::{EqualStar, NotEqualStar};
                let wanted = spec.version().release().len();
                if matches!(spec.operator(), EqualStar | NotEqualStar) && v.release().len() < wanted
                {
                    let mut release = v.release().to_vec();
                    release.resize(wanted, 0);
                    spec.contains(&v.clone().with_release(release))
                } else {
                    spec.contains(v)
                }
            }),
        }
    }
}

impl PackageRule {
    pub fn parse(entry: &str) -> Result<PackageRule, String> {
        let entry = entry.trim();
        let name_end = entry
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
            .unwrap_or(entry.len());
        let (name, version) = entry.split_at(name_end);
        let version = version.trim();
        if name.is_empty() {
            return Err(format!(
                "{entry:?}: expected a project name, optionally followed by PEP 440 version specifiers (name>=1.2,!=1.3)"
            ));
        }
        let project = normalize_project(name);
        if version.is_empty() {
            return Ok(PackageRule {
                project,
                version: None,
                specifiers: vec![],
            });
        }
        if !version.starts_with(['=', '!', '<', '>', '~']) {
            return Err(format!(
                "{entry:?}: project '{project}': expected PEP 440 version specifiers after the name, not {version:?} (extras and markers are not supported)"
            ));
        }
        let specifiers = version
            .split(',')
            .map(|clause| Specifier::parse(clause.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{entry:?}: project '{project}': {e}"))?;
        Ok(PackageRule {
            project,
            version: Some(version.to_owned()),
            specifiers,
        })
    }

    /// Whether a file of this version may be served: every clause holds. Without
    /// specifiers any version does; with them, a version that is not PEP 440 fails every
    /// clause but an exact `===`.
    ///
    /// As PEP 440 says of specifiers, a pre- or dev-release matches only a rule that names
    /// one itself: `>=1.0` does not open `2.0rc1` (pip skips them by default, but
    /// `pip install --pre` would otherwise reach releases the operator never meant).
    pub fn version_matches(&self, version: &str) -> bool {
        let parsed = version.parse::<pep440_rs::Version>().ok();
        let names_prerelease = self.specifiers.iter().any(|s| match s {
            Specifier::Pep440(spec) => spec.version().any_prerelease(),
            Specifier::Exactly(_) => true,
        });
        if !self.specifiers.is_empty()
            && !names_prerelease
            && parsed.as_ref().is_some_and(|v| v.any_prerelease())
        {
            return false;
        }
        self.specifiers
            .iter()
            .all(|s| s.matches(version, parsed.as_ref()))
    }
}

/// The package rules of a policy. Empty: the index lists nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackageRules {
    pub allow: Vec<PackageRule>,
    pub dependencies: Dependencies,
    /// npm packages the npm registry serves (none by default); see [`super::npm`].
    pub npm: super::npm::NpmRules,
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
    let npm = super::npm::NpmRules::parse(&section.npm).map_err(|e| ("packages.npm", e))?;
    Ok(PackageRules {
        allow,
        dependencies: section.dependencies.unwrap_or_default(),
        npm,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_releases_match_only_a_rule_that_names_one() {
        let rule = PackageRule::parse("demo>=1.0").unwrap();
        assert!(rule.version_matches("1.5"));
        assert!(!rule.version_matches("2.0rc1"));
        assert!(!rule.version_matches("2.0.dev3"));
        let rule = PackageRule::parse("demo>=2.0rc1").unwrap();
        assert!(rule.version_matches("2.0rc2") && rule.version_matches("2.0"));
        // No specifier: every version, pre-releases included (the project is allowed).
        assert!(PackageRule::parse("demo").unwrap().version_matches("3.0a1"));
    }

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
        assert!(
            !r.version_matches("2"),
            "a wildcard pads the candidate with zeros"
        );
        let r = PackageRule::parse("x==1.0").unwrap();
        assert!(r.version_matches("1.0") && !r.version_matches("1.0.1"));
        assert!(PackageRule::parse("x==").is_err());
        let r = PackageRule::parse("cgtiny").unwrap();
        assert!(r.version_matches("1.0") && r.version_matches("not a version"));
    }

    #[test]
    fn pep440_semantics() {
        let m = |rule: &str, v: &str| PackageRule::parse(rule).unwrap().version_matches(v);
        // == compares versions, not strings.
        assert!(m("x==2.0", "2.0.0") && m("x==2", "2.0") && m("x == 1.0", "1.0"));
        assert!(!m("x==2.0", "2.0.1"));
        // A local label is ignored unless the specifier has one.
        assert!(m("x==1.0", "1.0+cpu") && !m("x==1.0+gpu", "1.0+cpu"));
        // Ranges, exclusions and their combinations.
        assert!(m("x>=1.4", "1.4") && m("x>=1.4", "1.10") && !m("x>=1.4", "1.3.9"));
        assert!(m("x>1.4", "1.4.1") && !m("x>1.4", "1.4") && !m("x>1.4", "1.4.post1"));
        assert!(m("x<2", "1.9") && !m("x<2", "2.0") && !m("x<2", "2.0rc1"));
        assert!(m("x<=2", "2.0.0") && !m("x<=2", "2.0.1"));
        assert!(m("x!=1.5", "1.6") && !m("x!=1.5", "1.5.0"));
        assert!(m("x!=1.5.*", "1.6") && !m("x!=1.5.*", "1.5.3"));
        let r = PackageRule::parse("x >=1.4, !=1.5.*, <2").unwrap();
        assert!(r.version_matches("1.4.2") && r.version_matches("1.6"));
        assert!(!r.version_matches("1.5.1") && !r.version_matches("2.0"));
        assert!(!r.version_matches("1.3"));
        // Compatible release: ~=2.2 is >=2.2,==2.*; ~=1.4.5 is >=1.4.5,==1.4.*.
        assert!(m("x~=2.2", "2.9") && !m("x~=2.2", "3.0") && !m("x~=2.2", "2.1"));
        assert!(m("x~=1.4.5", "1.4.9") && !m("x~=1.4.5", "1.5.0"));
        // Epochs and pre-releases.
        assert!(m("x>=2", "1!1.0") && !m("x<3", "1!1.0"));
        // === is the string, for versions PEP 440 cannot read.
        assert!(m("x===1.0-custom", "1.0-CUSTOM") && !m("x===1.0", "1.0.0"));
        // A version that is not PEP 440 fails any restriction (deny by default).
        for rule in ["x>=0", "x!=1.0", "x<99", "x==1.*"] {
            assert!(!m(rule, "dev-snapshot"), "{rule}");
        }
    }

    #[test]
    fn bad_specifiers_name_the_project() {
        for entry in [
            "x>=",
            "x>=1.0,",
            "x~=1",
            "x>=one",
            "x==1.*.2",
            "x[extra]>=1",
            "x 1.0",
            "x===",
            "x>=1.0+local",
        ] {
            let err = PackageRule::parse(entry).expect_err(entry);
            assert!(
                err.contains("project 'x'") || err.contains(entry),
                "{entry}: {err}"
            );
        }
        let err = PackageRule::parse("Some_Pkg>=banana").unwrap_err();
        assert!(
            err.contains("project 'some-pkg'") && err.contains("banana"),
            "{err}"
        );
        assert!(PackageRule::parse(">=1.0").is_err());
    }
}
