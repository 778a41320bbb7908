//! The npm side of `[packages]`: which npm packages (Deno's `npm:` imports, or npm itself)
//! cellgate's npm registry serves, and which of their versions.
//!
//! An entry is a package name, optionally followed by `@` and a node-semver range:
//! `"lodash"`, `"chalk@5"`, `"@types/node@^20 || ^22"`. Names are npm's: lower case, with an
//! optional `@scope/`; they are compared case-insensitively and the scope is part of the
//! name (`@a/x` is not `x`).
//!
//! Ranges are read with npm's grammar (`||`, space-separated comparators, hyphen ranges,
//! `x`/`*` wildcards, a bare full version meaning exactly that version) and compared by the
//! `semver` crate, already in the tree, after translating each comparator to its syntax
//! (`1.2.3` → `=1.2.3`, `1.x` → `1.*`, `1.2 - 2` → `>=1.2.0, <3.0.0`). The two grammars
//! disagree on bare versions (Cargo's `1.2` is `^1.2`, npm's is `1.2.x`): the translation
//! keeps npm's meaning, so a rule means what an npm user reads. Pre-releases match as npm
//! says (only a comparator naming one of the same `major.minor.patch`).
//!
//! Plain values and pure functions, like the rest of `crate::policy`; the npm registry
//! (`crate::egress::packages::npm`) applies them.

use semver::{Version, VersionReq};

/// One `npm` entry of `[packages]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpmRule {
    /// Normalised name (lower case, scope kept).
    pub name: String,
    /// The range as written (for messages); `None`: any version.
    pub range: Option<String>,
    /// `range` parsed: any of these sets matches (npm's `||`).
    alternatives: Vec<VersionReq>,
}

/// npm's name normalisation: lower case, an optional `@scope/` kept. `None` if `name` is
/// not an npm package name (so that no path trick reaches the upstream registry).
pub fn normalize_npm_name(name: &str) -> Option<String> {
    let name = name.trim().to_ascii_lowercase();
    let valid_part = |part: &str| {
        !part.is_empty()
            && part.len() <= 214
            && !part.starts_with('.')
            && !part.starts_with('_')
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~'))
    };
    let ok = match name.strip_prefix('@') {
        Some(scoped) => scoped
            .split_once('/')
            .is_some_and(|(scope, rest)| valid_part(scope) && valid_part(rest)),
        None => valid_part(&name),
    };
    (ok && name.len() <= 214).then_some(name)
}

impl NpmRule {
    pub fn parse(entry: &str) -> Result<NpmRule, String> {
        let entry = entry.trim();
        // The name's own `@` (a scope) is its first character; a range follows the next one.
        let split = entry
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == '@')
            .map(|(i, _)| i);
        let (raw_name, range) = match split {
            Some(i) => (&entry[..i], Some(entry[i + 1..].trim())),
            None => (entry, None),
        };
        let name = normalize_npm_name(raw_name).ok_or_else(|| {
            format!("{entry:?}: expected an npm package name (name or @scope/name), optionally followed by @range")
        })?;
        let Some(range) = range else {
            return Ok(NpmRule {
                name,
                range: None,
                alternatives: vec![],
            });
        };
        if range.is_empty() {
            return Err(format!(
                "{entry:?}: package '{name}': expected a range after @"
            ));
        }
        let alternatives = parse_range(range).map_err(|e| {
            format!("{entry:?}: package '{name}': {range:?} is not an npm version range ({e})")
        })?;
        Ok(NpmRule {
            name,
            range: Some(range.to_owned()),
            alternatives,
        })
    }

    /// Whether this version may be served. Without a range any version does (pre-releases
    /// too: the package is allowed); with one, a version that is not semver never does.
    pub fn version_matches(&self, version: &str) -> bool {
        if self.range.is_none() {
            return true;
        }
        let Ok(version) = Version::parse(version.trim().trim_start_matches(['v', '='])) else {
            return false;
        };
        self.alternatives.iter().any(|req| req.matches(&version))
    }
}

/// The npm rules of a policy. Empty: the npm registry serves nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NpmRules {
    pub allow: Vec<NpmRule>,
}

impl NpmRules {
    pub fn parse(entries: &[String]) -> Result<NpmRules, String> {
        let allow = entries
            .iter()
            .map(|e| NpmRule::parse(e))
            .collect::<Result<_, _>>()?;
        Ok(NpmRules { allow })
    }

    /// The rules naming `name` (any case): a package may be listed twice, say
    /// `"x@^1"` and `"x@^3"`, and a version any of them allows is allowed.
    pub fn rules<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a NpmRule> + 'a {
        let name = normalize_npm_name(name);
        self.allow
            .iter()
            .filter(move |r| name.as_deref() == Some(r.name.as_str()))
    }

    /// Whether the package is listed at all.
    pub fn lists(&self, name: &str) -> bool {
        self.rules(name).next().is_some()
    }

    /// Whether this version of the package may be served.
    pub fn allows(&self, name: &str, version: &str) -> bool {
        self.rules(name).any(|r| r.version_matches(version))
    }
}

/// An npm range as the alternatives (`||`) it is made of, each a [`VersionReq`].
fn parse_range(range: &str) -> Result<Vec<VersionReq>, String> {
    range
        .split("||")
        .map(|set| {
            let comparators = comparator_set(set.trim())?;
            let text = if comparators.is_empty() {
                "*".to_owned()
            } else {
                comparators.join(", ")
            };
            VersionReq::parse(&text).map_err(|e| format!("{set:?}: {e}"))
        })
        .collect()
}

/// The tokens of a comparator set with a lone operator joined to the version after it: npm
/// allows a space there (`>= 1.2`, `~ 1.2`).
fn operators_joined(tokens: &[&str]) -> Result<Vec<String>, String> {
    let is_operator = |t: &str| !t.is_empty() && t.chars().all(|c| "<>=^~".contains(c));
    let mut out = Vec::with_capacity(tokens.len());
    let mut tokens = tokens.iter();
    while let Some(&token) = tokens.next() {
        if is_operator(token) {
            match tokens.next() {
                Some(&version) if !is_operator(version) => out.push(format!("{token}{version}")),
                _ => return Err(format!("operator {token:?} without a version after it")),
            }
        } else {
            out.push(token.to_owned());
        }
    }
    Ok(out)
}

/// One space-separated set of npm comparators, in `semver`'s syntax.
fn comparator_set(set: &str) -> Result<Vec<String>, String> {
    let tokens: Vec<&str> = set.split_whitespace().collect();
    if let [low, "-", high] = tokens.as_slice() {
        // Hyphen range: inclusive of a partial low end's zeros, of a partial high end's
        // whole release line (`1 - 2` is `>=1.0.0 <3.0.0`).
        let low = partial(low)?;
        let high = partial(high)?;
        let mut out = vec![];
        if !low.is_any() {
            out.push(format!(">={}", low.floor()));
        }
        if !high.is_any() {
            out.push(high.at_most());
        }
        return Ok(out);
    }
    if tokens.contains(&"-") {
        return Err("a hyphen range is `low - high`, alone in its set".to_owned());
    }
    let mut out = vec![];
    for token in operators_joined(&tokens)? {
        let token = token.as_str();
        let op_len = token
            .find(|c: char| !matches!(c, '<' | '>' | '=' | '^' | '~'))
            .unwrap_or(token.len());
        let (op, version) = token.split_at(op_len);
        if !matches!(op, "" | "=" | "<" | ">" | "<=" | ">=" | "^" | "~") {
            return Err(format!("unknown operator {op:?}"));
        }
        let version = partial(version)?;
        if version.is_any() {
            if matches!(op, "<" | ">") {
                // `<*`, `>*`: nothing at all.
                out.push("<0.0.0-0".to_owned());
            }
            continue;
        }
        out.push(match op {
            // A bare version: exactly it when whole, its release line when partial (X-range).
            "" | "=" => version.exact_or_wildcard(),
            _ => format!("{op}{}", version.text()),
        });
    }
    Ok(out)
}

/// A possibly partial version: `1`, `1.2`, `1.2.3-beta.1`, with `x`, `X` or `*` for the
/// missing parts.
struct Partial {
    major: Option<u64>,
    minor: Option<u64>,
    patch: Option<u64>,
    /// Pre-release and build suffix, as written (only on a whole version).
    rest: String,
}

fn partial(text: &str) -> Result<Partial, String> {
    let text = text.trim_start_matches(['v', '=']);
    if text.is_empty() {
        return Err("expected a version".to_owned());
    }
    let (core, rest) = match text.find(['-', '+']) {
        Some(i) => text.split_at(i),
        None => (text, ""),
    };
    let mut parts = core.split('.');
    let mut next = |what: &str| -> Result<Option<u64>, String> {
        match parts.next() {
            None | Some("x" | "X" | "*") => Ok(None),
            Some(n) => n
                .parse::<u64>()
                .map(Some)
                .map_err(|_| format!("{text:?}: bad {what} {n:?}")),
        }
    };
    let (major, minor, patch) = (next("major")?, next("minor")?, next("patch")?);
    if parts.next().is_some() {
        return Err(format!("{text:?}: more than three parts"));
    }
    if major.is_none() && (minor.is_some() || patch.is_some()) || minor.is_none() && patch.is_some()
    {
        return Err(format!("{text:?}: a wildcard is followed by a number"));
    }
    if !rest.is_empty() && patch.is_none() {
        return Err(format!("{text:?}: a pre-release needs a whole version"));
    }
    Ok(Partial {
        major,
        minor,
        patch,
        rest: rest.to_owned(),
    })
}

impl Partial {
    fn is_any(&self) -> bool {
        self.major.is_none()
    }

    /// As written, without wildcards (`semver` reads `1.2` as a partial version).
    fn text(&self) -> String {
        let mut out = String::new();
        for (i, part) in [self.major, self.minor, self.patch]
            .into_iter()
            .map_while(|p| p)
            .enumerate()
        {
            if i > 0 {
                out.push('.');
            }
            out.push_str(&part.to_string());
        }
        out.push_str(&self.rest);
        out
    }

    /// The lowest version it names (missing parts zero).
    fn floor(&self) -> String {
        format!(
            "{}.{}.{}{}",
            self.major.unwrap_or(0),
            self.minor.unwrap_or(0),
            self.patch.unwrap_or(0),
            self.rest
        )
    }

    /// `=1.2.3` when whole, else the release line (`1.*`, `1.2.*`).
    fn exact_or_wildcard(&self) -> String {
        match (self.minor, self.patch) {
            (Some(_), Some(_)) => format!("={}", self.text()),
            _ => format!("{}.*", self.text()),
        }
    }

    /// The upper end of a hyphen range: `<=1.2.3` when whole, else below the next line.
    fn at_most(&self) -> String {
        match (self.major, self.minor, self.patch) {
            (Some(_), Some(_), Some(_)) => format!("<={}", self.text()),
            (Some(major), Some(minor), None) => format!("<{major}.{}.0", minor + 1),
            (Some(major), None, _) => format!("<{}.0.0", major + 1),
            (None, _, _) => "*".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_their_scope_and_ignore_case() {
        assert_eq!(normalize_npm_name("Lodash").as_deref(), Some("lodash"));
        assert_eq!(
            normalize_npm_name("@Std/Path").as_deref(),
            Some("@std/path")
        );
        for bad in [
            "", "@", "@scope", "@/x", "a/b", "../x", "x y", ".x", "@s/../x", "x%2f",
        ] {
            assert_eq!(normalize_npm_name(bad), None, "{bad}");
        }
        let rules = NpmRules::parse(&["@std/path@^1".into(), "Chalk@5".into()]).unwrap();
        assert!(rules.lists("@STD/path") && rules.lists("chalk"));
        assert!(!rules.lists("path"), "the scope is part of the name");
        assert!(!rules.lists("@other/path"));
        assert_eq!(rules.allow[0].name, "@std/path");
        assert_eq!(rules.allow[0].range.as_deref(), Some("^1"));
    }

    #[test]
    fn ranges_mean_what_npm_says() {
        let m = |entry: &str, v: &str| NpmRule::parse(entry).unwrap().version_matches(v);
        // A bare major or minor is its release line; a bare whole version is exact.
        assert!(m("x@5", "5.3.0") && !m("x@5", "6.0.0") && !m("x@5", "4.9.9"));
        assert!(
            m("x@5.1", "5.1.9") && !m("x@5.1", "5.2.0"),
            "npm, not Cargo"
        );
        assert!(
            m("x@1.2.3", "1.2.3") && !m("x@1.2.3", "1.2.4"),
            "npm, not Cargo"
        );
        assert!(m("x@1.x", "1.9.0") && m("x@1.2.*", "1.2.7") && !m("x@1.x", "2.0.0"));
        // Caret and tilde.
        assert!(m("x@^1.2", "1.9.0") && !m("x@^1.2", "2.0.0") && !m("x@^1.2", "1.1.0"));
        assert!(m("x@^0.2.3", "0.2.9") && !m("x@^0.2.3", "0.3.0"));
        assert!(m("x@~1.2.3", "1.2.9") && !m("x@~1.2.3", "1.3.0"));
        // Sets, alternatives and hyphen ranges.
        assert!(m("x@>=1.2 <2", "1.5.0") && !m("x@>=1.2 <2", "2.0.0"));
        assert!(m("x@>=1.2.0 <2", "1.2.0") && !m("x@>=1.2 <2", "1.1.9"));
        assert!(m("x@^1 || ^3", "3.1.0") && !m("x@^1 || ^3", "2.0.0"));
        assert!(m("x@1.2 - 2", "2.9.9") && !m("x@1.2 - 2", "3.0.0") && !m("x@1.2 - 2", "1.1.0"));
        assert!(m("x@1.2.3 - 1.4.0", "1.4.0") && !m("x@1.2.3 - 1.4.0", "1.4.1"));
        assert!(m("x@*", "9.9.9") && m("x@>1.2", "1.3.0") && !m("x@>1.2", "1.2.5"));
        assert!(m("x@<=1.2", "1.2.9") && !m("x@<=1.2", "1.3.0"));
        // npm allows a space after an operator.
        assert!(m("x@>= 1.2 < 2", "1.5.0") && !m("x@>= 1.2 < 2", "2.0.0"));
        assert!(m("x@~ 1.2.3", "1.2.9") && !m("x@~ 1.2.3", "1.3.0"));
        // Pre-releases: only a comparator naming one on the same release.
        assert!(!m("x@^1", "1.5.0-beta.1") && !m("x@*", "2.0.0-rc.1"));
        assert!(m("x@>=2.0.0-rc.1", "2.0.0-rc.2") && !m("x@>=2.0.0-rc.1", "2.1.0-rc.1"));
        assert!(m("x", "2.0.0-rc.1"), "no range: every version");
        // Not semver: never under a range.
        assert!(!m("x@*", "latest") && !m("x@>=0", "1.2"));
        assert!(m("x", "anything"));
        // Two rules for one package: either allows.
        let rules = NpmRules::parse(&["x@^1".into(), "X@^3".into()]).unwrap();
        assert!(rules.allows("x", "1.0.0") && rules.allows("x", "3.2.0"));
        assert!(!rules.allows("x", "2.0.0") && !rules.allows("y", "1.0.0"));
    }

    #[test]
    fn bad_entries_name_the_package() {
        for entry in [
            "x@",
            "x@banana",
            "x@>>1",
            "x@1.2.3.4",
            "x@1.x.3",
            "x@1 - 2 - 3",
            "x@1.2-beta",
            "x@>=",
            "x@>= <2",
        ] {
            let err = NpmRule::parse(entry).expect_err(entry);
            assert!(err.contains("package 'x'"), "{entry}: {err}");
        }
        assert!(NpmRule::parse("@scope").is_err());
        assert!(NpmRule::parse("@1.0").is_err());
        assert!(NpmRule::parse("a b").is_err());
    }
}
