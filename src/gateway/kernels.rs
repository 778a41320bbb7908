//! The Kernel Gateway REST API for kernels and kernelspecs (gateway-contract.md 1.2–1.4):
//! 201 with `Location` on a start, 204 on delete and interrupt, 200 with the model on
//! restart, the kernel-id pattern in paths, and `?user=u/spec`.
//!
//! Tenants see only their own kernels: lists are filtered, and another tenant's kernel
//! answers exactly as a missing one (same status, same body).

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::api_error::ApiError;
use super::auth::{start_terms, Principal};
use super::state::AppState;
use crate::gateway::ErrorCode;
use crate::ids::KernelId;
use crate::kernel::{Kernel, KernelModel, POLICY_ENV};

/// Whether `id` is a kernel id ([`KernelId::parse`]): anything else is answered like an
/// unknown kernel.
pub fn is_kernel_id(id: &str) -> bool {
    KernelId::parse(id).is_ok()
}

/// The kernel `id`, whoever owns it. Handlers answering a client use [`lookup_for`].
pub fn lookup(state: &AppState, id: &str) -> Result<std::sync::Arc<Kernel>, ApiError> {
    if !is_kernel_id(id) {
        return Err(
            ApiError::not_found(format!("{id:?} is not a kernel id (a UUID)"))
                .code(ErrorCode::NoSuchKernel),
        );
    }
    state
        .kernels
        .get(id)
        .ok_or_else(|| ApiError::no_such_kernel(id))
}

/// The kernel `id` if `principal` may see it; another tenant's kernel is answered exactly as
/// a missing one.
pub fn lookup_for(
    state: &AppState,
    principal: &Principal,
    id: &str,
) -> Result<std::sync::Arc<Kernel>, ApiError> {
    let kernel = lookup(state, id)?;
    if principal.may_see(kernel.owner()) {
        Ok(kernel)
    } else {
        Err(ApiError::no_such_kernel(id))
    }
}

pub async fn api_root() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "gateway": "cellgate"}))
}

#[derive(Deserialize)]
pub struct SpecQuery {
    user: Option<String>,
}

pub async fn list_kernelspecs(
    State(state): State<AppState>,
    Query(query): Query<SpecQuery>,
) -> Result<Response, ApiError> {
    let specs = state.kernels.specs();
    // GatewayClient with KERNEL_USERNAME set asks `?user=bob/python3` when it means one spec
    // (gateway-contract.md 1.12.8).
    if let Some((_, name)) = query.user.as_deref().and_then(|u| u.rsplit_once('/')) {
        return get_kernelspec(State(state), Path(name.to_owned()))
            .await
            .map(IntoResponse::into_response);
    }
    let all: Map<String, Value> = specs
        .iter()
        .map(|spec| (spec.name.clone(), spec.model(&state.config.base_url)))
        .collect();
    Ok(Json(json!({"default": specs.default_name(), "kernelspecs": all})).into_response())
}

pub async fn get_kernelspec(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let spec = state.kernels.specs().get(&name).ok_or_else(|| {
        ApiError::not_found(format!("Kernel spec {name} not found"))
            .code(ErrorCode::NoSuchKernelspec)
    })?;
    Ok(Json(spec.model(&state.config.base_url)))
}

pub async fn kernelspec_resource(
    State(state): State<AppState>,
    Path((name, file)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let path = state
        .kernels
        .specs()
        .get(&name)
        .and_then(|spec| spec.resource(&file))
        .ok_or_else(|| ApiError::not_found(format!("no resource {file} of kernelspec {name}")))?;
    let bytes = tokio::fs::read(&path)
        .await
        .map_err(|_| ApiError::not_found(format!("no resource {file} of kernelspec {name}")))?;
    let content_type = match file.rsplit_once('.').map(|(_, ext)| ext) {
        Some("png") => "image/png",
        Some("svg") => "image/svg+xml",
        Some("js") => "application/javascript",
        Some("css") => "text/css",
        _ => "application/octet-stream",
    };
    let mut response = Response::new(Body::from(bytes));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=2592000"),
    );
    Ok(response)
}

pub async fn list_kernels(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
) -> Json<Vec<KernelModel>> {
    Json(
        state
            .kernels
            .list()
            .iter()
            .filter(|k| principal.may_see(k.owner()))
            .map(|k| k.model())
            .collect(),
    )
}

/// Parses the start body by hand so every malformed body gets the same clear 400.
fn parse_start_body(body: &[u8]) -> Result<(Option<String>, BTreeMap<String, String>), ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok((None, BTreeMap::new()));
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|err| ApiError::bad_request(format!("body is not JSON: {err}")))?;
    let Value::Object(object) = value else {
        return Err(ApiError::bad_request("body must be a JSON object"));
    };
    let name = match object.get("name") {
        None | Some(Value::Null) => None,
        Some(Value::String(name)) => Some(name.clone()),
        Some(_) => return Err(ApiError::bad_request("name must be a string")),
    };
    let mut env = BTreeMap::new();
    match object.get("env") {
        None | Some(Value::Null) => {}
        Some(Value::Object(vars)) => {
            for (key, value) in vars {
                let Value::String(value) = value else {
                    return Err(ApiError::bad_request(format!(
                        "env value of {key} must be a string"
                    )));
                };
                env.insert(key.clone(), value.clone());
            }
        }
        Some(_) => return Err(ApiError::bad_request("env must be an object")),
    }
    Ok((name, env))
}

pub async fn start_kernel(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let (name, mut env) = parse_start_body(&body)?;
    let terms = start_terms(&state, &principal, env.get(POLICY_ENV).map(String::as_str))?;
    if let Some(policy) = terms.policy {
        env.insert(POLICY_ENV.to_owned(), policy);
    }
    let kernel = state
        .kernels
        .start_for(name.as_deref(), &env, terms.owner.as_ref())
        .await?;
    let location = format!("{}api/kernels/{}", state.config.base_url, kernel.id);
    let mut response = (StatusCode::CREATED, Json(kernel.model())).into_response();
    if let Ok(value) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    Ok(response)
}

pub async fn get_kernel(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<KernelModel>, ApiError> {
    Ok(Json(lookup_for(&state, &principal, &id)?.model()))
}

pub async fn delete_kernel(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    lookup_for(&state, &principal, &id)?;
    state.kernels.shutdown(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn interrupt_kernel(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    lookup_for(&state, &principal, &id)?.interrupt().await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn restart_kernel(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<KernelModel>, ApiError> {
    let kernel = lookup_for(&state, &principal, &id)?;
    kernel.restart().await?;
    Ok(Json(kernel.model()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_id_pattern() {
        assert!(is_kernel_id("bc240c7a-232d-46b9-87f3-1a30b514780b"));
        assert!(!is_kernel_id("a-b-c-d-e"));
        assert!(!is_kernel_id("abc"));
        assert!(!is_kernel_id("a-b-c-d"));
        assert!(!is_kernel_id("a-b-c-d-e-f"));
        assert!(!is_kernel_id("a-b-c-d-../"));
    }

    #[test]
    fn start_bodies() {
        assert_eq!(parse_start_body(b"").unwrap().0, None);
        let (name, env) =
            parse_start_body(br#"{"name":"python3","env":{"KERNEL_X":"1"}}"#).unwrap();
        assert_eq!(name.as_deref(), Some("python3"));
        assert_eq!(env["KERNEL_X"], "1");
        for bad in [
            &b"[1]"[..],
            b"{",
            br#"{"env":"x"}"#,
            br#"{"name":3}"#,
            br#"{"env":{"A":1}}"#,
        ] {
            assert_eq!(
                parse_start_body(bad).unwrap_err().status,
                StatusCode::BAD_REQUEST
            );
        }
    }
}
