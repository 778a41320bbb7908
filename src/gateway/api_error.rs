//! `ApiError`: the one error type at the HTTP edge. It maps module errors to a status code and
//! one JSON body everywhere, [`ErrorBody`]: Kernel Gateway's `{"reason", "message"}` (what
//! JupyterLab reads) plus a stable machine `code` (what clients branch on). It shows clients
//! only safe text (never a traceback, host path or token), logs server-side failures in full,
//! and adds the headers a client needs to act: `WWW-Authenticate` on 401, `Retry-After`
//! where waiting helps.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::error_code::ErrorCode;
use crate::kernel::KernelError;

/// The header that repeats an error's machine `code` ([`ErrorBody::code`]).
pub const ERROR_CODE: &str = "x-cellgate-error-code";

/// Every error response's body.
#[derive(Debug, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// The HTTP status's reason phrase (`Not Found`).
    pub reason: String,
    /// What went wrong, for a person.
    pub message: String,
    /// What went wrong, for a program: stable across releases (`no_such_session`,
    /// `invalid_json`, `rate_limited`…).
    pub code: ErrorCode,
    /// With `quota_exceeded`: which quota, its limit, and when it frees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<QuotaDetail>,
}

/// What a 429 `quota_exceeded` says of the quota a request ran into.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct QuotaDetail {
    /// The quota as configured: `cpu_seconds_per_day` or `concurrent_sessions`.
    pub name: String,
    /// Its limit, in its unit (CPU seconds; sessions).
    pub limit: u64,
    /// How much of it is used now (CPU seconds today; sessions running or starting).
    pub used: f64,
    /// When it resets (RFC 3339, UTC: the next UTC midnight for `cpu_seconds_per_day`);
    /// absent for a quota that frees when something ends rather than at a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resets_at: Option<String>,
    /// When it frees, for a person.
    pub resets: String,
}

/// An error answered to an HTTP client.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    /// The body's machine `code` (`ErrorBody::code`).
    pub code: ErrorCode,
    pub message: String,
    /// Seconds after which the same request may succeed.
    pub retry_after: Option<u64>,
    /// The quota a 429 `quota_exceeded` ran into (boxed: every handler's `Err` carries
    /// room for it).
    pub quota: Option<Box<QuotaDetail>>,
}

/// The code of an error that has no more specific one.
fn default_code(status: StatusCode) -> ErrorCode {
    match status {
        StatusCode::BAD_REQUEST => ErrorCode::BadRequest,
        StatusCode::UNAUTHORIZED => ErrorCode::Unauthorized,
        StatusCode::FORBIDDEN => ErrorCode::Forbidden,
        StatusCode::NOT_FOUND => ErrorCode::NotFound,
        StatusCode::METHOD_NOT_ALLOWED => ErrorCode::MethodNotAllowed,
        StatusCode::NOT_ACCEPTABLE => ErrorCode::NotAcceptable,
        StatusCode::CONFLICT => ErrorCode::Conflict,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::TooLarge,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
        StatusCode::UNPROCESSABLE_ENTITY => ErrorCode::Invalid,
        StatusCode::TOO_MANY_REQUESTS => ErrorCode::RateLimited,
        StatusCode::SERVICE_UNAVAILABLE => ErrorCode::Unavailable,
        StatusCode::GATEWAY_TIMEOUT => ErrorCode::Timeout,
        status if status.is_server_error() => ErrorCode::Internal,
        _ => ErrorCode::Error,
    }
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: default_code(status),
            message: message.into(),
            retry_after: None,
            quota: None,
        }
    }

    /// 429 `quota_exceeded`: `message` for a person, `quota` for a program.
    pub fn quota_exceeded(message: impl Into<String>, quota: QuotaDetail) -> ApiError {
        ApiError {
            quota: Some(Box::new(quota)),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, message).code(ErrorCode::QuotaExceeded)
        }
    }

    /// This error, with a more specific machine `code`.
    pub fn code(mut self, code: ErrorCode) -> ApiError {
        self.code = code;
        self
    }

    /// This error, saying the request may succeed in `seconds`.
    pub fn retry_after(mut self, seconds: u64) -> ApiError {
        self.retry_after = Some(seconds.max(1));
        self
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// A request without a credential, or with a wrong one.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, message)
    }

    /// A kernel that does not exist, or is not the caller's: the same answer for both.
    pub fn no_such_kernel(id: &str) -> ApiError {
        ApiError::not_found(format!("Kernel does not exist: {id}")).code(ErrorCode::NoSuchKernel)
    }

    /// The answer to a route that does not exist.
    pub fn no_route(method: &axum::http::Method, path: &str) -> ApiError {
        ApiError::not_found(format!("no route {method} {path}")).code(ErrorCode::NoSuchRoute)
    }

    /// The answer to a method a route does not take.
    pub fn wrong_method(method: &axum::http::Method, path: &str) -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{path} does not take {method}"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let reason = self.status.canonical_reason().unwrap_or("Error");
        let mut response = (
            self.status,
            Json(ErrorBody {
                reason: reason.to_owned(),
                message: self.message,
                code: self.code,
                quota: self.quota.map(|quota| *quota),
            }),
        )
            .into_response();
        let headers = response.headers_mut();
        // The code also as a header: the answer to a `HEAD` has no body, and a client asking
        // whether a file exists must tell a missing file from a missing session.
        headers.insert(ERROR_CODE, HeaderValue::from_static(self.code.as_str()));
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the oversize body is never read, so this connection cannot carry
            // another request: saying so keeps a client from reusing it and failing its
            // next request with a broken pipe (seen with reqwest).
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            // RFC 9110: a 401 names how to authenticate. Both the static token and a tenant's
            // JWT go in `Authorization: Bearer …` (`token …` works for the static token too).
            let challenge = if self.code == ErrorCode::InvalidToken {
                "Bearer realm=\"cellgate\", error=\"invalid_token\""
            } else {
                "Bearer realm=\"cellgate\""
            };
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            );
        }
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl From<KernelError> for ApiError {
    fn from(err: KernelError) -> ApiError {
        use KernelError as E;
        match &err {
            E::NoSuchSpec { name, .. } => {
                ApiError::not_found(format!("Kernel spec {name} not found"))
                    .code(ErrorCode::NoSuchKernelspec)
            }
            E::NoSuchKernel | E::Terminated => {
                ApiError::not_found("Kernel does not exist").code(ErrorCode::NoSuchKernel)
            }
            E::BadEnv { .. } => ApiError::bad_request(err.to_string()).code(ErrorCode::BadEnv),
            E::BackendUnavailable { .. } => {
                ApiError::bad_request(err.to_string()).code(ErrorCode::BackendUnavailable)
            }
            E::Policy(crate::policy::PolicyError::Unknown { .. }) => {
                ApiError::bad_request(err.to_string()).code(ErrorCode::UnknownPolicy)
            }
            E::TooManyKernels { .. } => {
                ApiError::new(StatusCode::FORBIDDEN, "Resource Limit").code(ErrorCode::KernelLimit)
            }
            E::TenantKernelLimit { .. } => ApiError::new(StatusCode::FORBIDDEN, err.to_string())
                .code(ErrorCode::TenantKernelLimit),
            // No Retry-After: when a session ends is not a time the gateway knows.
            E::SessionQuota { limit, used, .. } => ApiError::quota_exceeded(
                err.to_string(),
                QuotaDetail {
                    name: "concurrent_sessions".to_owned(),
                    limit: *limit as u64,
                    used: *used as f64,
                    resets_at: None,
                    resets: "when one of the tenant's sessions ends (deleted, culled when idle, or shut down)".to_owned(),
                },
            ),
            // Starting or restarting: the same request works once the kernel is up.
            E::NotReady => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                .code(ErrorCode::KernelNotReady)
                .retry_after(2),
            // Nothing lost, nothing done: the same request may restore it in a while.
            E::RestoreDeferred(_) => {
                tracing::warn!(error = %err, "restore deferred");
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                    .code(ErrorCode::RestoreDeferred)
                    .retry_after(10)
            }
            E::Dead(_) | E::DiedDuringStart => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                    .code(ErrorCode::KernelDead)
            }
            // Not the gateway's failure nor a passing one: this kernelspec needs another
            // policy (or an image the operator adds).
            E::Sandbox(sandbox) if sandbox.unsupported_kernel().is_some() => ApiError::bad_request(
                sandbox.unsupported_kernel().unwrap_or_default(),
            )
            .code(ErrorCode::KernelUnsupported),
            E::Sandbox(sandbox) if sandbox.start_failure().is_some() => {
                tracing::warn!(error = %err, "kernel start failed");
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                    .code(
                        // The sandbox names the failure by its wire code (it is below the
                        // gateway and knows no ErrorCode).
                        sandbox
                            .start_failure()
                            .and_then(ErrorCode::from_wire)
                            .unwrap_or(ErrorCode::SandboxStartFailed),
                    )
                    .retry_after(30)
            }
            E::NoReply(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                .code(ErrorCode::KernelBusy)
                .retry_after(5),
            E::EnvironmentMissing { name, .. } => {
                tracing::error!(%err, "kernel environment missing");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!(
                        "the environment of kernel {name} is not installed on the gateway host"
                    ),
                )
            }
            _ => {
                tracing::error!(error = %err, "request failed");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Internal error; see the gateway's log",
                )
            }
        }
    }
}
