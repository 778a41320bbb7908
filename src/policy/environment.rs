//! `[environment]`: the variables an API v1 client may set on its session's kernel, besides
//! `KERNEL_*` (which every client may set) and the gateway's `env_allowlist`.
//!
//! Deny by default: with no `allow`, a client's other variables are refused (API v1) or
//! dropped (the Kernel Gateway API, as Kernel Gateway does). A pattern is an exact name, a
//! prefix ending in `*` (`OPENAI_*`), or `*` for any name. Whatever the patterns say, the
//! names the sandbox and the kernel's start depend on are never a client's to set
//! ([`reserved`]): the interpreter's and locale settings a kernel zygote fixes at its start
//! (a client choosing them would fork a zygote per value), the search paths and home, the
//! dynamic linker's, the gateway's own (`CELLGATE_*`), and the egress proxy and package
//! index settings the gateway gives the kernel.

use serde::Deserialize;

/// `[environment]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentSection {
    #[serde(default)]
    allow: Vec<String>,
}

/// The checked `[environment]` section.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvironmentRules {
    /// Exact names, and prefixes (the part before a final `*`; empty: any name).
    exact: Vec<String>,
    prefixes: Vec<String>,
}

/// Checks the section: each pattern is a variable name, optionally ending in `*`.
pub fn environment_rules(
    section: EnvironmentSection,
) -> Result<EnvironmentRules, (&'static str, String)> {
    let mut rules = EnvironmentRules::default();
    for pattern in section.allow {
        let (name, prefix) = match pattern.strip_suffix('*') {
            Some(prefix) => (prefix, true),
            None => (pattern.as_str(), false),
        };
        let valid = name.len() <= 128
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && (prefix || !name.is_empty());
        if !valid {
            return Err((
                "environment.allow",
                format!("{pattern:?} is not a variable name or a prefix ending in `*`"),
            ));
        }
        if prefix {
            rules.prefixes.push(name.to_owned());
        } else {
            rules.exact.push(name.to_owned());
        }
    }
    Ok(rules)
}

impl EnvironmentRules {
    /// Whether a client may set `name` under these rules (`KERNEL_*` and the gateway's
    /// allowlist are decided elsewhere).
    pub fn allows(&self, name: &str) -> bool {
        !reserved(name)
            && (self.exact.iter().any(|n| n == name)
                || self.prefixes.iter().any(|p| name.starts_with(p.as_str())))
    }

    /// The patterns, as written (for messages).
    pub fn patterns(&self) -> Vec<String> {
        self.exact
            .iter()
            .cloned()
            .chain(self.prefixes.iter().map(|p| format!("{p}*")))
            .collect()
    }
}

/// Names no policy lets a client set (see the module's doc).
pub fn reserved(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    cellgate_agent::protocol::fixed_at_zygote_start(name)
        || [
            "LD_",
            "CELLGATE_",
            "JPY_",
            "PIP_",
            "UV_",
            // npm's settings, Deno's registry among them (`NPM_CONFIG_REGISTRY`).
            "NPM_CONFIG_",
            "JUPYTER_",
            "IPYTHON",
        ]
        .iter()
        .any(|prefix| upper.starts_with(prefix))
        || matches!(
            upper.as_str(),
            "HTTP_PROXY"
                | "HTTPS_PROXY"
                | "ALL_PROXY"
                | "NO_PROXY"
                | "FTP_PROXY"
                | "SHELL"
                | "USER"
                | "LOGNAME"
                | "TMPDIR"
                | "KERNEL_ID"
                | "KERNEL_GATEWAY"
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(allow: &[&str]) -> Result<EnvironmentRules, (&'static str, String)> {
        environment_rules(EnvironmentSection {
            allow: allow.iter().map(|s| s.to_string()).collect(),
        })
    }

    #[test]
    fn nothing_by_default_and_exact_names_prefixes_or_any() {
        assert!(!EnvironmentRules::default().allows("OPENAI_API_KEY"));
        let some = rules(&["MY_SETTING", "OPENAI_*"]).unwrap();
        assert!(some.allows("MY_SETTING") && some.allows("OPENAI_API_KEY"));
        assert!(!some.allows("MY_SETTING_2") && !some.allows("AWS_KEY"));
        assert_eq!(some.patterns(), ["MY_SETTING", "OPENAI_*"]);
        let any = rules(&["*"]).unwrap();
        assert!(any.allows("ANYTHING") && any.allows("lower_case"));
    }

    #[test]
    fn reserved_names_stay_refused_whatever_the_patterns() {
        let any = rules(&["*", "PATH", "LD_*"]).unwrap();
        for name in [
            "PATH",
            "HOME",
            "LANG",
            "LC_ALL",
            "PYTHONPATH",
            "PYTHONHASHSEED",
            "LD_PRELOAD",
            "CELLGATE_PRELOAD",
            "MPLBACKEND",
            "PYDEVD_X",
            "http_proxy",
            "HTTPS_PROXY",
            "no_proxy",
            "PIP_INDEX_URL",
            "pip_index_url",
            "NPM_CONFIG_REGISTRY",
            "npm_config_registry",
            "KERNEL_ID",
            "JPY_SESSION_NAME",
        ] {
            assert!(!any.allows(name), "{name}");
        }
    }

    #[test]
    fn bad_patterns_are_refused_at_load() {
        for bad in ["", "A-B", "1X", "A*B", "**", "A B"] {
            assert!(rules(&[bad]).is_err(), "{bad:?}");
        }
    }
}
