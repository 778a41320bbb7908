//! `GET /v1/usage`: the usage ledger (`crate::store`), one row per finished API v1
//! execution or shell command, and its totals. A tenant reads its own rows; the admin any
//! tenant's (`tenant=`), or everyone's. `since` and `until` bound the period (RFC 3339).
//!
//! [`check_quota`]: the tenant's CPU seconds of the UTC day so far against its
//! `cpu_seconds_per_day`, before an execution or command starts (also each execution sent
//! over an open session WebSocket) (`crate::tenants`). What it does not count, said for
//! operators: CPU a session's processes use between executions (a background process a cell
//! left running), executions through the Kernel Gateway API (JupyterLab's), and requests that
//! start at the same moment all pass a check that only the last one would fail.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::ApiError;
use crate::gateway::api_error::QuotaDetail;
use crate::gateway::auth::Principal;
use crate::gateway::state::AppState;
use crate::gateway::ErrorCode;
use crate::store::{UsageQuery, UsageRow};

/// Rows one answer holds at most (and by default).
const MAX_ROWS: usize = 10_000;

/// The query of `GET /v1/usage`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UsageParams {
    /// The tenant whose rows to read (the admin only; a tenant always reads its own).
    #[serde(default)]
    tenant: Option<String>,
    /// From this instant on (RFC 3339, inclusive).
    #[serde(default)]
    since: Option<String>,
    /// Before this instant (RFC 3339).
    #[serde(default)]
    until: Option<String>,
    /// At most this many rows, oldest first (default and maximum 10000).
    #[serde(default)]
    limit: Option<usize>,
}

/// One execution in the ledger.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageRecord {
    /// When it ended.
    pub at: String,
    pub tenant: Option<String>,
    pub session_id: String,
    pub policy: String,
    pub execution_id: String,
    pub wall_ms: u64,
    pub cpu_ms: Option<u64>,
    pub peak_memory_bytes: Option<u64>,
    /// Bytes of text output (streams, displayed and returned values).
    pub output_bytes: u64,
    pub artifact_bytes: u64,
    /// The execution's `status`.
    pub outcome: String,
}

/// The returned rows' sums: with `truncated`, of those rows only (not of every row the
/// period holds: ask for a shorter period).
#[derive(Debug, Default, Serialize, ToSchema)]
pub struct UsageTotals {
    pub executions: u64,
    pub wall_ms: u64,
    pub cpu_ms: u64,
    pub output_bytes: u64,
    pub artifact_bytes: u64,
}

/// `GET /v1/usage`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Usage {
    pub records: Vec<UsageRecord>,
    pub totals: UsageTotals,
    /// More rows matched than `limit` let through.
    pub truncated: bool,
}

impl From<UsageRow> for UsageRecord {
    fn from(row: UsageRow) -> UsageRecord {
        UsageRecord {
            at: row.at,
            tenant: row.tenant,
            session_id: row.session,
            policy: row.policy,
            execution_id: row.execution_id,
            wall_ms: row.wall_ms,
            cpu_ms: row.cpu_ms,
            peak_memory_bytes: row.peak_memory_bytes,
            output_bytes: row.output_bytes,
            artifact_bytes: row.artifact_bytes,
            outcome: row.outcome,
        }
    }
}

/// An RFC 3339 instant in the ledger's own format (which sorts as text).
fn instant(name: &str, text: Option<String>) -> Result<Option<String>, ApiError> {
    text.map(|text| {
        OffsetDateTime::parse(&text, &Rfc3339)
            .map(crate::timestamp::format_timestamp)
            .map_err(|err| ApiError::bad_request(format!("{name}: not an RFC 3339 instant: {err}")))
    })
    .transpose()
}

/// The usage ledger: one record per finished execution, oldest first, with totals.
#[utoipa::path(get, path = "/v1/usage", tag = "usage", operation_id = "usage",
    params(UsageParams),
    responses((status = 200, body = Usage), (status = 400),
        (status = 403, description = "a tenant asked for another tenant's usage"),
        (status = 503, description = "the gateway keeps no ledger (`--state-dir none`)")))]
pub async fn usage(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    query: Result<Query<UsageParams>, QueryRejection>,
) -> Result<Json<Usage>, ApiError> {
    let Query(params) = query.map_err(|err| ApiError::bad_request(err.body_text()))?;
    let tenant = match (&principal, params.tenant) {
        (Principal::Admin, tenant) => tenant.map(Some),
        (Principal::Tenant { tenant, .. }, Some(asked)) if &asked != tenant => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "a tenant reads its own usage only",
            ))
        }
        (Principal::Tenant { tenant, .. }, _) => Some(Some(tenant.clone())),
    };
    let limit = params.limit.unwrap_or(MAX_ROWS);
    if !(1..=MAX_ROWS).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be a number from 1 to {MAX_ROWS}"
        )));
    }
    let query = UsageQuery {
        tenant,
        since: instant("since", params.since)?,
        until: instant("until", params.until)?,
        // One more than asked: whether there were more.
        limit: limit + 1,
    };
    let store = state.sessions.store().cloned().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this gateway keeps no usage ledger: it runs without a state directory (--state-dir none)",
        )
        .code(ErrorCode::Unavailable)
    })?;
    let rows = tokio::task::spawn_blocking(move || store.usage(&query))
        .await
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "usage task failed"))?
        .map_err(|err| {
            tracing::error!(%err, "the usage ledger could not be read");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal error; see the gateway's log",
            )
        })?;
    let truncated = rows.len() > limit;
    let records: Vec<UsageRecord> = rows.into_iter().take(limit).map(Into::into).collect();
    let mut totals = UsageTotals::default();
    for record in &records {
        totals.executions += 1;
        totals.wall_ms += record.wall_ms;
        totals.cpu_ms += record.cpu_ms.unwrap_or(0);
        totals.output_bytes += record.output_bytes;
        totals.artifact_bytes += record.artifact_bytes;
    }
    Ok(Json(Usage {
        records,
        totals,
        truncated,
    }))
}

/// Refuses a tenant's new execution once its executions of this UTC day have used its
/// `cpu_seconds_per_day`: 429 `quota_exceeded`, naming the quota, the use and the reset.
/// The admin has no quota; without a state directory there is no ledger to count in (the
/// start-up log says so when a quota is set).
pub(super) async fn check_quota(state: &AppState, principal: &Principal) -> Result<(), ApiError> {
    let Principal::Tenant { tenant, .. } = principal else {
        return Ok(());
    };
    let Some(limit) = state.tenants.cpu_seconds_per_day(tenant) else {
        return Ok(());
    };
    let Some(store) = state.sessions.store().cloned() else {
        return Ok(());
    };
    let now = OffsetDateTime::now_utc();
    // The ledger's day: its timestamps' date, in UTC.
    let day = crate::timestamp::format_timestamp(now)[..10].to_owned();
    let owner = tenant.clone();
    let used_ms = tokio::task::spawn_blocking(move || store.cpu_ms_of_day(&owner, &day))
        .await
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "quota task failed"))?
        .map_err(|err| {
            tracing::error!(%err, "the usage ledger could not be read for a quota");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal error; see the gateway's log",
            )
        })?;
    if used_ms < limit.saturating_mul(1000) {
        return Ok(());
    }
    Err(cpu_quota_exceeded(tenant, limit, used_ms, now))
}

/// The answer past `cpu_seconds_per_day` at `now`: the quota resets at the next UTC
/// midnight, which the body says (`quota.resets_at`) and `Retry-After` counts down to.
fn cpu_quota_exceeded(tenant: &str, limit: u64, used_ms: u64, now: OffsetDateTime) -> ApiError {
    let reset = now.replace_time(time::Time::MIDNIGHT) + time::Duration::days(1);
    let resets_at = crate::timestamp::format_timestamp(reset);
    let used = used_ms as f64 / 1000.0;
    ApiError::quota_exceeded(
        format!(
            "tenant {tenant} has used its quota cpu_seconds_per_day of {limit} s (used {used:.1} s today); it resets at {resets_at} (UTC midnight)"
        ),
        QuotaDetail {
            name: "cpu_seconds_per_day".to_owned(),
            limit,
            used,
            resets: format!("at {resets_at} (UTC midnight)"),
            resets_at: Some(resets_at),
        },
    )
    // Whole seconds, rounded up: a client that waits this long finds the day over.
    .retry_after(((reset - now).as_seconds_f64().ceil() as u64).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_quota_resets_at_the_next_utc_midnight_and_says_so() {
        let now = time::macros::datetime!(2026-03-04 23:59:30.25 UTC);
        let err = cpu_quota_exceeded("acme", 60, 61_500, now);
        assert_eq!(err.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(err.code, ErrorCode::QuotaExceeded);
        assert_eq!(err.retry_after, Some(30));
        let quota = err.quota.expect("a quota detail");
        assert_eq!(quota.name, "cpu_seconds_per_day");
        assert_eq!((quota.limit, quota.used), (60, 61.5));
        let resets_at = quota.resets_at.expect("a reset time");
        assert!(resets_at.starts_with("2026-03-05T00:00:00"), "{resets_at}");
        assert!(err.message.contains(&resets_at), "{}", err.message);
        // Any instant in a day resets at that day's end, never at its start.
        let early = cpu_quota_exceeded(
            "acme",
            60,
            61_500,
            time::macros::datetime!(2026-03-05 0:00 UTC),
        );
        assert_eq!(early.retry_after, Some(86_400));
    }
}
