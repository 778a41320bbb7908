//! `ApiError`: the one error type at the HTTP edge. It maps module errors to a status code and
//! one JSON body everywhere, [`ErrorBody`]: Kernel Gateway's `{"reason", "message"}` (what
//! JupyterLab reads) plus a stable machine `code` (what clients branch on). It shows clients
//! only safe text (never a traceback, host path or token), logs server-side failures in full,
//! and adds the headers a client needs to act: `WWW-Authenticate` on 401, `Retry-After`
//! where waiting helps.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

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
    pub code: String,
}

/// An error answered to an HTTP client.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    /// The body's machine `code` (`ErrorBody::code`).
    pub code: &'static str,
    pub message: String,
    /// Seconds after which the same request may succeed.
    pub retry_after: Option<u64>,
}

/// The code of an error that has no more specific one.
fn default_code(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => "bad_request",
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::FORBIDDEN => "forbidden",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::NOT_ACCEPTABLE => "not_acceptable",
        StatusCode::CONFLICT => "conflict",
        StatusCode::PAYLOAD_TOO_LARGE => "too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::UNPROCESSABLE_ENTITY => "invalid",
        StatusCode::TOO_MANY_REQUESTS => "rate_limited",
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        StatusCode::GATEWAY_TIMEOUT => "timeout",
        status if status.is_server_error() => "internal",
        _ => "error",
    }
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: default_code(status),
            message: message.into(),
            retry_after: None,
        }
    }

    /// This error, with a more specific machine `code`.
    pub fn code(mut self, code: &'static str) -> ApiError {
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
        ApiError::not_found(format!("Kernel does not exist: {id}")).code("no_such_kernel")
    }

    /// The answer to a route that does not exist.
    pub fn no_route(method: &axum::http::Method, path: &str) -> ApiError {
        ApiError::not_found(format!("no route {method} {path}")).code("no_such_route")
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
                code: self.code.to_owned(),
            }),
        )
            .into_response();
        let headers = response.headers_mut();
        // The code also as a header: the answer to a `HEAD` has no body, and a client asking
        // whether a file exists must tell a missing file from a missing session.
        headers.insert(ERROR_CODE, HeaderValue::from_static(self.code));
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the oversize body is never read, so this connection cannot carry
            // another request: saying so keeps a client from reusing it and failing its
            // next request with a broken pipe (seen with reqwest).
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            // RFC 9110: a 401 names how to authenticate. Both the static token and a tenant's
            // JWT go in `Authorization: Bearer …` (`token …` works for the static token too).
            let challenge = if self.code == "invalid_token" {
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
                    .code("no_such_kernelspec")
            }
            E::NoSuchKernel | E::Terminated => {
                ApiError::not_found("Kernel does not exist").code("no_such_kernel")
            }
            E::BadEnv { .. } => ApiError::bad_request(err.to_string()).code("bad_env"),
            E::BackendUnavailable { .. } => {
                ApiError::bad_request(err.to_string()).code("backend_unavailable")
            }
            E::Policy(crate::policy::PolicyError::Unknown { .. }) => {
                ApiError::bad_request(err.to_string()).code("unknown_policy")
            }
            E::TooManyKernels { .. } => {
                ApiError::new(StatusCode::FORBIDDEN, "Resource Limit").code("kernel_limit")
            }
            E::TenantKernelLimit { .. } => {
                ApiError::new(StatusCode::FORBIDDEN, err.to_string()).code("tenant_kernel_limit")
            }
            // Starting or restarting: the same request works once the kernel is up.
            E::NotReady => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                .code("kernel_not_ready")
                .retry_after(2),
            E::Dead(_) | E::DiedDuringStart => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string()).code("kernel_dead")
            }
            E::Sandbox(sandbox) if sandbox.start_failure().is_some() => {
                tracing::warn!(error = %err, "kernel start failed");
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                    .code(sandbox.start_failure().unwrap_or("sandbox_start_failed"))
                    .retry_after(30)
            }
            E::NoReply(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
                .code("kernel_busy")
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
