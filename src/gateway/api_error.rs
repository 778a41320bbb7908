//! `ApiError`: the one error type at the HTTP edge. It maps module errors to a status code and
//! Kernel Gateway's error body `{"reason", "message"}`, shows clients only safe text (never a
//! traceback, host path or token), and logs server-side failures in full.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::kernel::KernelError;

/// An error answered to an HTTP client.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let reason = self.status.canonical_reason().unwrap_or("Error");
        let mut response = (
            self.status,
            Json(json!({"reason": reason, "message": self.message})),
        )
            .into_response();
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the oversize body is never read, so this connection cannot carry
            // another request: saying so keeps a client from reusing it and failing its
            // next request with a broken pipe (seen with reqwest).
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
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
            }
            E::NoSuchKernel => ApiError::not_found("Kernel does not exist"),
            E::BadEnv { .. } | E::BackendUnavailable { .. } => {
                ApiError::bad_request(err.to_string())
            }
            E::Policy(crate::policy::PolicyError::Unknown { .. }) => {
                ApiError::bad_request(err.to_string())
            }
            E::TooManyKernels { .. } => ApiError::new(StatusCode::FORBIDDEN, "Resource Limit"),
            E::TenantKernelLimit { .. } => ApiError::new(StatusCode::FORBIDDEN, err.to_string()),
            E::Terminated => ApiError::not_found("Kernel does not exist"),
            E::Dead(_) | E::NotReady | E::DiedDuringStart | E::NoReply(_) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string())
            }
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
