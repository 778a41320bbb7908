//! Tenants: what a JWT tenant may do besides seeing only what it owns (that rule lives with
//! `gateway::Principal`): which policies it may run under, how many kernels it may keep, and
//! how fast it may call the gateway.
//!
//! **Policy cap.** A token's `policy` claim names the most permissive policy its tenant may
//! use. "More permissive" is defined by one explicit list, `policy_order` (least permissive
//! first): a tenant capped at P may use P and every policy listed before P. Without a list,
//! or when P is not in it, the tenant may use P alone. A tenant that names no policy runs
//! under P.
//!
//! **Kernel cap.** Live kernels per tenant (API v1 sessions are kernels, so this caps them
//! too); kernels being started count, so concurrent starts cannot overshoot. Past it, 403
//! `tenant_kernel_limit` (the answer since before quotas; kept for the deployments and
//! clients that read it).
//!
//! **Concurrent-sessions quota.** The same count (`concurrent_sessions`), answered as a
//! quota: 429 `quota_exceeded` naming the quota and its limit, and saying that a place frees
//! when one of the tenant's sessions ends; no `Retry-After`, since that is not a time the
//! gateway knows. A 429 says "later", which is what is true of a concurrency limit; a 403
//! says "never", which clients (and people) give up on. With both set, the lower applies,
//! and at an equal limit the quota's answer.
//!
//! **MCP session cap.** Open MCP sessions (`/mcp` conversations) per tenant, 100 unless
//! set: each holds server state and may start a kernel, and a client that reconnects in a
//! loop must not open them without end.
//!
//! **Rate.** A token bucket per tenant (governor's GCRA): `rate` requests per second
//! sustained, `burst` at once; a request past it answers 429 with `Retry-After`.
//!
//! **CPU quota.** CPU seconds per UTC day (`cpu_seconds_per_day`), summed from the usage
//! ledger of the gateway's state directory: past it, a tenant's new executions are refused
//! with 429 `quota_exceeded`, naming the quota and when it resets (the next UTC midnight). An
//! execution that started under the quota runs to its end.
//!
//! **Hibernated-storage quota.** Bytes of hibernated sessions (`hibernated_storage`: VMs
//! saved to disk while idle, see `[limits] hibernate_after`) a tenant may keep. No request
//! waits on a hibernation (the gateway decides it while the session is idle), so nothing is
//! answered 429: a session whose save would pass the quota is not saved, it stays running
//! (its memory kept) until its policy's `idle_timeout` ends it as before, and the gateway
//! logs and counts the refusal (`cellgate_hibernations_refused_total`). Hibernated sessions
//! count against this quota, not against memory; they still count as sessions
//! (`concurrent_sessions`, `max_kernels`): restoring one must not find its place taken.
//!
//! Defaults apply to every tenant; `[tenants.limits.<name>]` overrides them for one.
//!
//! Must not depend on: HTTP, kernels.

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde::Deserialize;

/// The `[tenants]` section of the config file (command-line flags override its defaults).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    /// Policies from least to most permissive.
    #[serde(default)]
    pub policy_order: Vec<String>,
    /// Live kernels per tenant; unlimited when unset.
    pub max_kernels: Option<usize>,
    /// Open MCP sessions per tenant [default: [`DEFAULT_MAX_MCP_SESSIONS`]].
    pub max_mcp_sessions: Option<usize>,
    /// Sustained requests per second per tenant; unlimited when unset.
    pub rate: Option<f64>,
    /// Requests a tenant may make at once before the rate applies [default: rate, at least 1].
    pub burst: Option<u32>,
    /// CPU seconds of executions per tenant per UTC day; unlimited when unset.
    pub cpu_seconds_per_day: Option<u64>,
    /// Sessions (kernels) per tenant at once, as a quota (429); unlimited when unset.
    pub concurrent_sessions: Option<usize>,
    /// Bytes of hibernated sessions per tenant (`1073741824` or `1GiB`); unlimited when
    /// unset.
    #[serde(default, with = "crate::units::serde_size_or_bytes")]
    pub hibernated_storage: Option<u64>,
    /// Per-tenant overrides of the limits above.
    #[serde(default)]
    pub limits: BTreeMap<String, TenantLimits>,
}

/// One tenant's overrides; unset fields take the defaults.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    pub max_kernels: Option<usize>,
    pub max_mcp_sessions: Option<usize>,
    pub rate: Option<f64>,
    pub burst: Option<u32>,
    pub cpu_seconds_per_day: Option<u64>,
    pub concurrent_sessions: Option<usize>,
    #[serde(default, with = "crate::units::serde_size_or_bytes")]
    pub hibernated_storage: Option<u64>,
}

/// Open MCP sessions a tenant may keep when no setting says otherwise.
pub const DEFAULT_MAX_MCP_SESSIONS: usize = 100;

/// Errors of tenant settings and tenant requests; the `Display` of a request error is meant
/// for the tenant.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TenantError {
    #[error("tenants: {0}")]
    Invalid(String),
    #[error("policy {requested:?} is more permissive than this tenant's policy {cap:?} (allowed: {allowed})")]
    PolicyNotAllowed {
        requested: String,
        cap: String,
        allowed: String,
    },
    #[error("rate limit exceeded; retry in {} s", retry_after.as_secs().max(1))]
    RateLimited { retry_after: Duration },
}

impl TenantSettings {
    /// Checks values a TOML type cannot: positive, finite rates and one mention per policy.
    pub fn validate(&self) -> Result<(), TenantError> {
        let rates = std::iter::once(("default", self.rate)).chain(
            self.limits
                .iter()
                .map(|(name, limits)| (name.as_str(), limits.rate)),
        );
        for (who, rate) in rates {
            if let Some(rate) = rate {
                if !(rate.is_finite() && rate > 0.0 && rate <= 1e6) {
                    return Err(TenantError::Invalid(format!(
                        "rate of {who} must be a number of requests per second in (0, 1000000]"
                    )));
                }
            }
        }
        let mut seen = std::collections::HashSet::new();
        for name in &self.policy_order {
            if !seen.insert(name) {
                return Err(TenantError::Invalid(format!(
                    "policy_order names {name:?} twice"
                )));
            }
        }
        Ok(())
    }

    /// The tenants these settings name (`[tenants.limits.NAME]`) that have a request rate,
    /// their own or the default: the ones whose rate-limit counter can be made ahead.
    pub fn rate_limited_tenants(&self) -> impl Iterator<Item = &str> {
        self.limits
            .iter()
            .filter(|(_, limits)| limits.rate.or(self.rate).is_some())
            .map(|(name, _)| name.as_str())
    }
}

/// Tenant rules in force, with each tenant's token bucket.
pub struct Tenants {
    settings: TenantSettings,
    buckets: parking_lot::Mutex<HashMap<String, Arc<DefaultDirectRateLimiter>>>,
}

impl Tenants {
    pub fn new(settings: TenantSettings) -> Result<Tenants, TenantError> {
        settings.validate()?;
        Ok(Tenants {
            settings,
            buckets: parking_lot::Mutex::new(HashMap::new()),
        })
    }

    /// The policies a tenant capped at `cap` may use, least permissive first.
    pub fn allowed_policies<'a>(&'a self, cap: &'a str) -> Vec<&'a str> {
        match self.settings.policy_order.iter().position(|p| p == cap) {
            Some(at) => self.settings.policy_order[..=at]
                .iter()
                .map(String::as_str)
                .collect(),
            None => vec![cap],
        }
    }

    /// The policy a tenant capped at `cap` runs under when it asks for `requested`.
    pub fn choose_policy(&self, cap: &str, requested: Option<&str>) -> Result<String, TenantError> {
        let Some(requested) = requested else {
            return Ok(cap.to_owned());
        };
        let allowed = self.allowed_policies(cap);
        if allowed.contains(&requested) {
            Ok(requested.to_owned())
        } else {
            Err(TenantError::PolicyNotAllowed {
                requested: requested.to_owned(),
                cap: cap.to_owned(),
                allowed: allowed.join(", "),
            })
        }
    }

    /// Live kernels `tenant` may keep.
    pub fn max_kernels(&self, tenant: &str) -> Option<usize> {
        self.settings
            .limits
            .get(tenant)
            .and_then(|l| l.max_kernels)
            .or(self.settings.max_kernels)
    }

    /// Sessions (kernels) `tenant` may run at once, as a quota.
    pub fn concurrent_sessions(&self, tenant: &str) -> Option<usize> {
        self.settings
            .limits
            .get(tenant)
            .and_then(|l| l.concurrent_sessions)
            .or(self.settings.concurrent_sessions)
    }

    /// Bytes of hibernated sessions `tenant` may keep.
    pub fn hibernated_storage(&self, tenant: &str) -> Option<u64> {
        self.settings
            .limits
            .get(tenant)
            .and_then(|l| l.hibernated_storage)
            .or(self.settings.hibernated_storage)
    }

    /// CPU seconds `tenant`'s executions may use per UTC day.
    pub fn cpu_seconds_per_day(&self, tenant: &str) -> Option<u64> {
        self.settings
            .limits
            .get(tenant)
            .and_then(|l| l.cpu_seconds_per_day)
            .or(self.settings.cpu_seconds_per_day)
    }

    /// Open MCP sessions `tenant` may keep.
    pub fn max_mcp_sessions(&self, tenant: &str) -> usize {
        self.settings
            .limits
            .get(tenant)
            .and_then(|l| l.max_mcp_sessions)
            .or(self.settings.max_mcp_sessions)
            .unwrap_or(DEFAULT_MAX_MCP_SESSIONS)
    }

    fn quota(&self, tenant: &str) -> Option<Quota> {
        let own = self.settings.limits.get(tenant);
        let rate = own.and_then(|l| l.rate).or(self.settings.rate)?;
        let burst = own
            .and_then(|l| l.burst)
            .or(self.settings.burst)
            .unwrap_or(rate.ceil() as u32);
        let burst = NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN);
        // `validate` keeps the rate in (0, 1e6], so the period is at least a microsecond.
        Quota::with_period(Duration::from_secs_f64(1.0 / rate)).map(|q| q.allow_burst(burst))
    }

    /// Takes one request from `tenant`'s bucket, or says how long until one is available.
    pub fn check_rate(&self, tenant: &str) -> Result<(), TenantError> {
        let bucket = {
            let mut buckets = self.buckets.lock();
            match buckets.get(tenant) {
                Some(bucket) => bucket.clone(),
                None => {
                    let Some(quota) = self.quota(tenant) else {
                        return Ok(());
                    };
                    let bucket = Arc::new(RateLimiter::direct(quota));
                    buckets.insert(tenant.to_owned(), bucket.clone());
                    bucket
                }
            }
        };
        bucket
            .check()
            .map_err(|not_until| TenantError::RateLimited {
                retry_after: not_until.wait_time_from(DefaultClock::default().now()),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(toml_text: &str) -> Tenants {
        Tenants::new(toml::from_str(toml_text).unwrap()).unwrap()
    }

    #[test]
    fn policy_cap_follows_the_order() {
        let t = tenants(r#"policy_order = ["strict", "default", "data-science"]"#);
        assert_eq!(t.allowed_policies("default"), ["strict", "default"]);
        assert_eq!(t.choose_policy("default", None).unwrap(), "default");
        assert_eq!(
            t.choose_policy("default", Some("strict")).unwrap(),
            "strict"
        );
        let err = t
            .choose_policy("default", Some("data-science"))
            .unwrap_err();
        assert!(
            err.to_string().contains("more permissive")
                && err.to_string().contains("strict, default"),
            "{err}"
        );
        // A cap outside the list allows itself alone.
        assert_eq!(t.allowed_policies("custom"), ["custom"]);
        assert!(t.choose_policy("custom", Some("strict")).is_err());
        // No list: only the claim's policy.
        let t = tenants("");
        assert_eq!(t.choose_policy("strict", Some("strict")).unwrap(), "strict");
        assert!(t.choose_policy("strict", Some("default")).is_err());
    }

    #[test]
    fn hibernated_storage_has_a_default_and_overrides() {
        let t = tenants("hibernated_storage = 1000\n[limits.big]\nhibernated_storage = \"5KiB\"\n");
        assert_eq!(t.hibernated_storage("anyone"), Some(1000));
        assert_eq!(t.hibernated_storage("big"), Some(5 << 10));
        assert_eq!(tenants("").hibernated_storage("anyone"), None);
    }

    #[test]
    fn limits_with_overrides() {
        let t = tenants(
            "max_kernels = 2\nmax_mcp_sessions = 7\nrate = 1000\nburst = 3\n[limits.big]\nmax_kernels = 10\nmax_mcp_sessions = 70\n[limits.slow]\nrate = 0.001\nburst = 1\n",
        );
        assert_eq!(t.max_kernels("anyone"), Some(2));
        assert_eq!(t.cpu_seconds_per_day("anyone"), None);
        assert_eq!(t.max_kernels("big"), Some(10));
        assert_eq!(t.max_mcp_sessions("anyone"), 7);
        assert_eq!(t.max_mcp_sessions("big"), 70);
        assert_eq!(t.max_mcp_sessions("slow"), 7);
        assert_eq!(
            tenants("").max_mcp_sessions("x"),
            DEFAULT_MAX_MCP_SESSIONS,
            "capped unless set"
        );
        assert!(t.check_rate("slow").is_ok());
        let Err(TenantError::RateLimited { retry_after }) = t.check_rate("slow") else {
            panic!("a second request within the period must be limited");
        };
        assert!(retry_after > Duration::from_secs(100));
        // Another tenant has its own bucket.
        for _ in 0..3 {
            assert!(t.check_rate("other").is_ok());
        }
        assert!(tenants("").check_rate("x").is_ok());
    }

    #[test]
    fn invalid_settings_are_refused() {
        for bad in [
            "rate = 0",
            "rate = -1",
            "rate = nan",
            "[limits.a]\nrate = 0",
            r#"policy_order = ["a", "a"]"#,
        ] {
            let settings: TenantSettings = toml::from_str(bad).unwrap();
            assert!(Tenants::new(settings).is_err(), "{bad}");
        }
        assert!(toml::from_str::<TenantSettings>("rat = 1").is_err());
    }
}
