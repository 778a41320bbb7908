//! Authentication and the tenant rules at the HTTP edge.
//!
//! Credentials as Kernel Gateway takes them, a little stricter: `?token=T`,
//! `Authorization: token T` or `Authorization: Bearer T`; the query wins when both are given;
//! an empty credential counts as none. The static token (compared in constant time) makes the
//! request the admin's; otherwise, when JWT keys are configured, the credential must be a JWT
//! that `crate::jwt` verifies, and the request is its tenant's. A tenant's request then takes
//! one token from its rate bucket (429 with `Retry-After` when empty). CORS preflights are
//! answered before this layer runs. A refusal of a request with a body says
//! `Connection: close`, since the unread body ends the connection.
//!
//! Rejections are 401 with a reason that says what was wrong with the token (expired, bad
//! signature, missing claim) and nothing about the gateway's keys; with only the static token
//! configured the body stays Kernel Gateway's (empty message).

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::api_error::ApiError;
use super::state::AppState;
use crate::gateway::ErrorCode;
use crate::kernel::Owner;
use crate::tenants::TenantError;

/// Who a request comes from; `require_token` puts it in the request's extensions, so handlers
/// take `Extension<Principal>`.
///
/// Tenancy rule for every surface: a tenant sees only what it owns, and anything else answers
/// 404 exactly as a missing id would (never 403, which would confirm that the id exists).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// The static token, or no token configured (loopback only): sees everything.
    Admin,
    /// A JWT bearer: one tenant, capped at the most permissive policy it may use.
    Tenant {
        tenant: String,
        subject: String,
        policy: String,
    },
}

impl Principal {
    /// The tenant that owns what this principal creates (`None` for the admin).
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Principal::Admin => None,
            Principal::Tenant { tenant, .. } => Some(tenant),
        }
    }

    /// Whether this principal may see something owned by `owner` (`None`: made by the admin).
    pub fn may_see(&self, owner: Option<&str>) -> bool {
        match self {
            Principal::Admin => true,
            Principal::Tenant { tenant, .. } => owner == Some(tenant.as_str()),
        }
    }
}

/// How a kernel (or API v1 session) that `principal` starts may run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartTerms {
    /// The owner to record, with its kernel cap (`None`: the admin's kernel).
    pub owner: Option<Owner>,
    /// The policy to run under; `None` lets the usual choice apply (kernelspec metadata,
    /// then `default`), which only the admin gets.
    pub policy: Option<String>,
}

/// The terms of a start by `principal` that asks for policy `requested`: a tenant runs under
/// the policy it asked for if its cap allows it (else 403), or under its cap when it asked for
/// none; its kernel is recorded as its own and counts toward its kernel cap.
pub fn start_terms(
    state: &AppState,
    principal: &Principal,
    requested: Option<&str>,
) -> Result<StartTerms, ApiError> {
    match principal {
        Principal::Admin => Ok(StartTerms {
            owner: None,
            policy: requested.map(str::to_owned),
        }),
        Principal::Tenant { tenant, policy, .. } => {
            let chosen = state
                .tenants
                .choose_policy(policy, requested)
                .map_err(|err| ApiError::new(StatusCode::FORBIDDEN, err.to_string()))?;
            Ok(StartTerms {
                owner: Some(Owner {
                    tenant: tenant.clone(),
                    max_kernels: state.tenants.max_kernels(tenant),
                    concurrent_sessions: state.tenants.concurrent_sessions(tenant),
                }),
                policy: Some(chosen),
            })
        }
    }
}

/// The credential a request presents, if any.
pub fn credential(request: &Request) -> Option<String> {
    let from_query = request.uri().query().and_then(|query| {
        query.split('&').find_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            (key == "token").then(|| percent_decode(value))
        })
    });
    if let Some(token) = from_query.filter(|t| !t.is_empty()) {
        return Some(token);
    }
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    let scheme_ok = scheme.eq_ignore_ascii_case("token") || scheme.eq_ignore_ascii_case("bearer");
    (scheme_ok && !token.is_empty()).then(|| token.to_owned())
}

fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `presented` is the configured token, in time independent of where they differ.
pub fn token_matches(expected: &str, presented: &str) -> bool {
    expected.as_bytes().ct_eq(presented.as_bytes()).into()
}

/// Authenticates every request (OPTIONS passes: preflights carry no credentials) and puts
/// its [`Principal`] into the request's extensions; applies tenants' rate limits.
pub async fn require_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    // A refusal leaves the request's body unread, and the connection cannot carry another
    // request after it: saying so keeps a client from sending its next one (say, the same
    // request with a token) on a connection the server is closing.
    let unread_body = has_body(&request);
    let response = authenticate(state, request, next).await;
    if unread_body && response.extensions().get::<Refused>().is_some() {
        let mut response = response;
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return response;
    }
    response
}

/// Marks a response as this layer's refusal of the request.
#[derive(Clone, Copy)]
struct Refused;

trait MarkRefused {
    fn refused(self) -> Response;
}

impl MarkRefused for Response {
    fn refused(mut self) -> Response {
        self.extensions_mut().insert(Refused);
        self
    }
}

/// Whether a request declares a body.
fn has_body(request: &Request) -> bool {
    let headers = request.headers();
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim() != "0")
}

/// [`require_token`] without the connection's fate.
async fn authenticate(state: AppState, mut request: Request, next: Next) -> Response {
    let expected = state.config.token.as_deref();
    let jwt = state.jwt.as_deref();
    if expected.is_none() && jwt.is_none() {
        // Loopback only (the config refuses anything else without authentication).
        request.extensions_mut().insert(Principal::Admin);
        return next.run(request).await;
    }
    if request.method() == Method::OPTIONS {
        return next.run(request).await;
    }
    let presented = credential(&request);
    let principal = match (presented, jwt) {
        (Some(presented), _) if expected.is_some_and(|t| token_matches(t, &presented)) => {
            Principal::Admin
        }
        (Some(presented), Some(jwt)) => match jwt.verify(&presented) {
            Ok(identity) => Principal::Tenant {
                tenant: identity.tenant.clone(),
                subject: identity.subject.clone(),
                policy: identity.policy.clone(),
            },
            Err(err) => {
                tracing::info!(reason = %err, path = %request.uri().path(), "bearer token refused");
                return ApiError::unauthorized(format!("invalid token: {err}"))
                    .code(ErrorCode::InvalidToken)
                    .into_response()
                    .refused();
            }
        },
        (None, Some(_)) => {
            return ApiError::unauthorized(
                "authentication required: Authorization: Bearer <JWT> (or the gateway's token)",
            )
            .code(ErrorCode::MissingToken)
            .into_response()
            .refused()
        }
        (Some(_), None) => {
            return ApiError::unauthorized("wrong token")
                .code(ErrorCode::InvalidToken)
                .into_response()
                .refused()
        }
        (None, None) => return ApiError::unauthorized(
            "authentication required: Authorization: Bearer <the gateway's token> (or token <T>)",
        )
        .code(ErrorCode::MissingToken)
        .into_response()
        .refused(),
    };
    if let Principal::Tenant { tenant, .. } = &principal {
        super::access_log::record_tenant(tenant);
        if let Err(err) = state.tenants.check_rate(tenant) {
            return rate_limited(tenant, err).refused();
        }
    }
    request.extensions_mut().insert(principal);
    next.run(request).await
}

pub(crate) fn rate_limited(tenant: &str, err: TenantError) -> Response {
    let retry_after = match &err {
        TenantError::RateLimited { retry_after } => retry_after.as_secs_f64().ceil().max(1.0),
        _ => 1.0,
    };
    tracing::debug!(tenant, "tenant over its request rate");
    crate::telemetry::metrics::metrics().rate_limited(tenant);
    ApiError::new(StatusCode::TOO_MANY_REQUESTS, err.to_string())
        .retry_after(retry_after as u64)
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn req(uri: &str, auth: Option<&str>) -> Request {
        let mut builder = Request::builder().uri(uri);
        if let Some(a) = auth {
            builder = builder.header(header::AUTHORIZATION, a);
        }
        builder.body(Body::empty()).unwrap()
    }

    #[test]
    fn credentials_from_query_and_headers() {
        assert_eq!(
            credential(&req("/api?token=abc", None)).as_deref(),
            Some("abc")
        );
        assert_eq!(
            credential(&req("/api?a=1&token=a%2Bb", None)).as_deref(),
            Some("a+b")
        );
        assert_eq!(
            credential(&req("/api", Some("token xyz"))).as_deref(),
            Some("xyz")
        );
        assert_eq!(
            credential(&req("/api", Some("Bearer xyz"))).as_deref(),
            Some("xyz")
        );
        assert_eq!(credential(&req("/api", Some("Basic xyz"))), None);
        assert_eq!(credential(&req("/api", Some("token "))), None);
        assert_eq!(
            credential(&req("/api?token=", Some("token h"))).as_deref(),
            Some("h")
        );
        assert_eq!(
            credential(&req("/api?token=q", Some("token h"))).as_deref(),
            Some("q")
        );
        assert_eq!(credential(&req("/api?token=%", None)).as_deref(), Some("%"));
    }

    #[test]
    fn token_comparison() {
        assert!(token_matches("secret", "secret"));
        assert!(!token_matches("secret", "secreT"));
        assert!(!token_matches("secret", "secret2"));
        assert!(!token_matches("secret", ""));
    }
}
