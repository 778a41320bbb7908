//! The double's HTTP face: the real API paths kube-client uses, each request authenticated,
//! authorized, counted, and answered with the real status codes and bodies (objects,
//! lists, `Status` failures, watch streams).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};

use super::auth::Access;
use super::cluster::{Cluster, RequestRecord};
use super::resource::Resource;
use super::selector::{FieldSelector, Filter, LabelSelector};
use super::status::ApiError;
use super::verbs::{DeleteOptions, PatchType};
use super::watch::{self, WatchParams};

/// The largest request body the real API server accepts.
const MAX_BODY: usize = 3 * 1024 * 1024;

pub fn router(cluster: Arc<Cluster>) -> Router {
    Router::new().fallback(handle).with_state(cluster)
}

/// What a path names.
#[derive(Debug, Clone)]
enum Target {
    Collection {
        resource: Resource,
        /// None: across all namespaces.
        namespace: Option<String>,
    },
    Item {
        resource: Resource,
        namespace: String,
        name: String,
    },
}

impl Target {
    fn resource(&self) -> Resource {
        match self {
            Target::Collection { resource, .. } | Target::Item { resource, .. } => *resource,
        }
    }
}

fn parse_path(path: &str) -> Result<Target, ApiError> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segments.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Err(ApiError::no_such_path()),
    };
    let resource = |plural: &str| {
        Resource::from_path(group, version, plural).ok_or_else(ApiError::no_such_path)
    };
    match rest {
        [plural] => Ok(Target::Collection {
            resource: resource(plural)?,
            namespace: None,
        }),
        ["namespaces", namespace, plural] => Ok(Target::Collection {
            resource: resource(plural)?,
            namespace: Some((*namespace).to_owned()),
        }),
        ["namespaces", namespace, plural, name] => Ok(Target::Item {
            resource: resource(plural)?,
            namespace: (*namespace).to_owned(),
            name: (*name).to_owned(),
        }),
        ["namespaces", _, plural, _, subresource, ..] => {
            eprintln!(
                "kube_api: the test double serves no subresource ({plural}/{subresource}): answering 404"
            );
            Err(ApiError::no_such_path())
        }
        _ => Err(ApiError::no_such_path()),
    }
}

fn flag(query: &HashMap<String, String>, key: &str) -> bool {
    matches!(query.get(key).map(String::as_str), Some("true" | "1"))
}

fn verb_of(method: &Method, target: &Target, watching: bool) -> Result<&'static str, ApiError> {
    let collection = matches!(target, Target::Collection { .. });
    let all_namespaces = matches!(
        target,
        Target::Collection {
            namespace: None,
            ..
        }
    );
    Ok(match (method.as_str(), collection) {
        ("GET", true) if watching => "watch",
        ("GET", true) => "list",
        ("GET", false) => "get",
        ("POST", true) if !all_namespaces => "create",
        ("PUT", false) => "update",
        ("PATCH", false) => "patch",
        ("DELETE", false) => "delete",
        ("DELETE", true) if !all_namespaces => "deletecollection",
        _ => return Err(ApiError::method_not_allowed()),
    })
}

fn json_response(code: u16, body: &Value) -> Response {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        [("content-type", "application/json")],
        serde_json::to_vec(body).expect("JSON values serialize"),
    )
        .into_response()
}

fn error_response(error: &ApiError) -> Response {
    json_response(error.code, &error.to_status())
}

async fn handle(State(cluster): State<Arc<Cluster>>, request: Request) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let query: HashMap<String, String> = Query::try_from_uri(request.uri())
        .map(|Query(q)| q)
        .unwrap_or_default();
    let watching = flag(&query, "watch");
    let mut record = RequestRecord {
        method: method.to_string(),
        path: path.clone(),
        verb: String::new(),
        watch: watching,
        status: 0,
        user: String::new(),
    };
    let response = match serve(&cluster, request, &query, &mut record).await {
        Ok(response) => response,
        Err(error) => error_response(&error),
    };
    record.status = response.status().as_u16();
    cluster.requests.lock().push(record);
    response
}

async fn serve(
    cluster: &Arc<Cluster>,
    request: Request,
    query: &HashMap<String, String>,
    record: &mut RequestRecord,
) -> Result<Response, ApiError> {
    if request.method() == Method::GET && request.uri().path() == "/version" {
        return Ok(json_response(
            200,
            &json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-cellgate-kube-api-double",
                "platform": "linux/amd64",
            }),
        ));
    }
    let user = {
        let authorization = request
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        cluster.auth.read().authenticate(authorization)?.clone()
    };
    record.user = user.subject.clone();
    let target = parse_path(request.uri().path())?;
    let verb = verb_of(request.method(), &target, record.watch)?;
    record.verb = verb.to_owned();
    let (namespace, name) = match &target {
        Target::Collection { namespace, .. } => (namespace.clone(), String::new()),
        Target::Item {
            namespace, name, ..
        } => (Some(namespace.clone()), name.clone()),
    };
    let resource = target.resource();
    user.authorize(&Access {
        verb,
        resource,
        namespace: namespace.as_deref(),
        name: &name,
    })?;
    let content_type = request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = axum::body::to_bytes(request.into_body(), MAX_BODY)
        .await
        .map_err(|_| ApiError::too_large())?;
    let dry_run = query.get("dryRun").is_some_and(|v| v == "All");
    let filter = || -> Result<Filter, ApiError> {
        Ok(Filter {
            namespace: namespace.clone(),
            labels: LabelSelector::parse(query.get("labelSelector").map_or("", String::as_str))?,
            fields: FieldSelector::parse(
                query.get("fieldSelector").map_or("", String::as_str),
                resource,
            )?,
        })
    };
    let ns = namespace.clone().unwrap_or_default();
    match verb {
        "get" => Ok(json_response(
            200,
            &cluster.get_checked(resource, &ns, &name)?,
        )),
        "list" => list(cluster, resource, filter()?, query),
        "watch" => {
            let filter = filter()?;
            if let Some(namespace) = &filter.namespace {
                if !cluster.namespaces.read().contains(namespace) {
                    return Err(ApiError::namespace_not_found(namespace));
                }
            }
            let params = WatchParams {
                resource_version: query.get("resourceVersion").cloned(),
                timeout: query
                    .get("timeoutSeconds")
                    .and_then(|t| t.parse().ok())
                    .map(Duration::from_secs),
                bookmarks: flag(query, "allowWatchBookmarks"),
                send_initial_events: flag(query, "sendInitialEvents"),
            };
            Ok(watch::watch(cluster.clone(), resource, filter, params))
        }
        "create" => {
            require_json(&content_type)?;
            let object = resource.decode(&body)?;
            Ok(json_response(
                201,
                &cluster.create(resource, &ns, object, dry_run)?,
            ))
        }
        "update" => {
            require_json(&content_type)?;
            let object = resource.decode(&body)?;
            let stored = cluster.replace(resource, &ns, &name, object, dry_run)?;
            Ok(json_response(200, &stored))
        }
        "patch" => {
            let patch_type = PatchType::from_content_type(&content_type)?;
            let stored = cluster.patch(resource, &ns, &name, patch_type, &body, dry_run)?;
            Ok(json_response(200, &stored))
        }
        "delete" => {
            let options = delete_options(query, &body, dry_run)?;
            let (code, answer) = cluster.delete(resource, &ns, &name, &options)?;
            Ok(json_response(code, &answer))
        }
        "deletecollection" => {
            let options = delete_options(query, &body, dry_run)?;
            let deleted = cluster.delete_collection(resource, &filter()?, &options)?;
            let rv = cluster.store.lock().resource_version();
            Ok(json_response(200, &list_body(resource, deleted, rv, None)))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn require_json(content_type: &str) -> Result<(), ApiError> {
    let media = content_type.split(';').next().unwrap_or("").trim();
    if media == "application/json" || media.is_empty() {
        Ok(())
    } else {
        Err(ApiError::unsupported_media_type(media))
    }
}

fn list_body(
    resource: Resource,
    items: Vec<Value>,
    rv: u64,
    next: Option<(String, usize)>,
) -> Value {
    // Items of a list carry no kind or apiVersion: the list says them once.
    let items: Vec<Value> = items
        .into_iter()
        .map(|mut item| {
            if let Some(map) = item.as_object_mut() {
                map.remove("kind");
                map.remove("apiVersion");
            }
            item
        })
        .collect();
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if let Some((token, remaining)) = next {
        metadata["continue"] = json!(token);
        metadata["remainingItemCount"] = json!(remaining);
    }
    json!({
        "kind": format!("{}List", resource.kind()),
        "apiVersion": resource.api_version(),
        "metadata": metadata,
        "items": items,
    })
}

/// A list, paginated by `limit` and `continue` (the token is the list's resourceVersion and
/// the next object's namespace and name; later pages show the objects as they are now).
fn list(
    cluster: &Arc<Cluster>,
    resource: Resource,
    filter: Filter,
    query: &HashMap<String, String>,
) -> Result<Response, ApiError> {
    use base64::Engine;
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let (mut items, mut rv) = cluster.list(resource, &filter)?;
    if let Some(token) = query.get("continue").filter(|t| !t.is_empty()) {
        let decoded = engine
            .decode(token)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
            .ok_or_else(|| ApiError::bad_request("continue key is not valid"))?;
        rv = decoded["rv"].as_u64().unwrap_or(rv);
        let from = (
            decoded["namespace"].as_str().unwrap_or("").to_owned(),
            decoded["name"].as_str().unwrap_or("").to_owned(),
        );
        items.retain(|item| {
            let key = (
                item["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned(),
                item["metadata"]["name"].as_str().unwrap_or("").to_owned(),
            );
            key >= from
        });
    }
    let limit = query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let mut next = None;
    if let Some(limit) = limit {
        if items.len() > limit {
            let rest = items.split_off(limit);
            let first = &rest[0]["metadata"];
            let token = json!({"rv": rv, "namespace": first["namespace"], "name": first["name"]});
            next = Some((engine.encode(token.to_string()), rest.len()));
        }
    }
    Ok(json_response(200, &list_body(resource, items, rv, next)))
}

fn delete_options(
    query: &HashMap<String, String>,
    body: &[u8],
    dry_run: bool,
) -> Result<DeleteOptions, ApiError> {
    let body: Value = if body.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(body)
            .map_err(|err| ApiError::bad_request(format!("invalid DeleteOptions: {err}")))?
    };
    let grace = query
        .get("gracePeriodSeconds")
        .and_then(|g| g.parse::<i64>().ok())
        .or_else(|| body["gracePeriodSeconds"].as_i64());
    let propagation = query
        .get("propagationPolicy")
        .cloned()
        .or_else(|| body["propagationPolicy"].as_str().map(str::to_owned))
        .or_else(|| match body["orphanDependents"].as_bool() {
            Some(true) => Some("Orphan".to_owned()),
            _ => None,
        });
    let body_dry_run = body["dryRun"]
        .as_array()
        .is_some_and(|d| d.iter().any(|v| v == "All"));
    Ok(DeleteOptions {
        grace_period_seconds: grace,
        propagation,
        precondition_uid: body["preconditions"]["uid"].as_str().map(str::to_owned),
        precondition_resource_version: body["preconditions"]["resourceVersion"]
            .as_str()
            .map(str::to_owned),
        dry_run: dry_run || body_dry_run,
    })
}

/// Serves until `shutdown` resolves (watch streams end with the runtime).
pub async fn serve_until(
    cluster: Arc<Cluster>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let app = router(cluster);
    tokio::select! {
        result = axum::serve(listener, app) => {
            if let Err(err) = result {
                eprintln!("kube_api: the server stopped: {err}");
            }
        }
        () = shutdown => {}
    }
}
