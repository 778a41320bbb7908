//! The API's failures as the real server sends them: a `Status` object with the HTTP code,
//! a machine-readable `reason` and Kubernetes' own message wording, which kube-client turns
//! into `kube::Error::Api` carrying the same code and reason. Callers match on those, so the
//! wording and reasons here copy the real API server's.

use serde_json::{json, Value};

use super::resource::Resource;

/// A failed request, ready to become a `Status` body.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    /// `details` (name, group, kind as the resource's plural), when the failure is about
    /// one object or one resource.
    pub details: Option<Value>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn about(mut self, resource: Resource, name: &str) -> ApiError {
        let mut details = json!({"kind": resource.plural()});
        if !name.is_empty() {
            details["name"] = json!(name);
        }
        if !resource.group().is_empty() {
            details["group"] = json!(resource.group());
        }
        self.details = Some(details);
        self
    }

    pub fn not_found(resource: Resource, name: &str) -> ApiError {
        ApiError::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", resource.qualified()),
        )
        .about(resource, name)
    }

    /// A namespace the cluster does not have (the double's namespaces are fixed sets).
    pub fn namespace_not_found(namespace: &str) -> ApiError {
        let mut error = ApiError::new(
            404,
            "NotFound",
            format!("namespaces \"{namespace}\" not found"),
        );
        error.details = Some(json!({"name": namespace, "kind": "namespaces"}));
        error
    }

    /// A path no resource of the double serves.
    pub fn no_such_path() -> ApiError {
        ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
    }

    pub fn already_exists(resource: Resource, name: &str) -> ApiError {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", resource.qualified()),
        )
        .about(resource, name)
    }

    /// An optimistic-concurrency failure: the write named an older resourceVersion.
    pub fn conflict(resource: Resource, name: &str) -> ApiError {
        ApiError::conflict_because(
            resource,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub fn conflict_because(resource: Resource, name: &str, why: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                resource.qualified()
            ),
        )
        .about(resource, name)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(401, "Unauthorized", "Unauthorized")
    }

    /// RBAC's denial, worded as the API server words it.
    pub fn forbidden(
        resource: Resource,
        name: &str,
        user: &str,
        verb: &str,
        namespace: Option<&str>,
    ) -> ApiError {
        let object = if name.is_empty() {
            resource.qualified()
        } else {
            format!("{} \"{name}\"", resource.qualified())
        };
        let scope = match namespace {
            Some(namespace) => format!("in the namespace \"{namespace}\""),
            None => "at the cluster scope".to_owned(),
        };
        ApiError::new(
            403,
            "Forbidden",
            format!(
                "{object} is forbidden: User \"{user}\" cannot {verb} resource \"{}\" in API group \"{}\" {scope}",
                resource.plural(),
                resource.group()
            ),
        )
        .about(resource, name)
    }

    /// An admission plugin's refusal (e.g. an unknown RuntimeClass).
    pub fn admission_forbidden(resource: Resource, name: &str, why: &str) -> ApiError {
        ApiError::new(
            403,
            "Forbidden",
            format!("{} \"{name}\" is forbidden: {why}", resource.qualified()),
        )
        .about(resource, name)
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "BadRequest", message)
    }

    /// Something the real API accepts but this double does not model: refused loudly (and
    /// printed on stderr), never silently ignored.
    pub fn unsupported_by_double(what: impl Into<String>) -> ApiError {
        let message = format!("the kube_api test double does not support {}", what.into());
        eprintln!("kube_api: {message}");
        ApiError::new(400, "BadRequest", message)
    }

    /// Validation failures (422), each cause as `field: what`.
    pub fn invalid(resource: Resource, name: &str, causes: &[String]) -> ApiError {
        let list = if causes.len() == 1 {
            causes[0].clone()
        } else {
            format!("[{}]", causes.join(", "))
        };
        let mut error = ApiError::new(
            422,
            "Invalid",
            format!("{} \"{name}\" is invalid: {list}", resource.kind()),
        )
        .about(resource, name);
        if let Some(details) = error.details.as_mut() {
            details["kind"] = json!(resource.kind());
            details["causes"] = causes
                .iter()
                .map(|cause| {
                    let (field, message) = cause.split_once(": ").unwrap_or(("", cause));
                    json!({"reason": "FieldValueInvalid", "message": message, "field": field})
                })
                .collect();
        }
        error
    }

    /// A 422 that is not about one field (e.g. a JSON patch whose `test` failed).
    pub fn new_unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::new(422, "Invalid", message)
    }

    pub fn expired(message: impl Into<String>) -> ApiError {
        ApiError::new(410, "Expired", message)
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    pub fn unsupported_media_type(content_type: &str) -> ApiError {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format ({content_type:?}) - accepted media types include: application/json-patch+json, application/merge-patch+json"),
        )
    }

    pub fn too_large() -> ApiError {
        ApiError::new(
            413,
            "RequestEntityTooLarge",
            "Request entity too large: limit is 3145728",
        )
    }

    /// The `Status` object the API sends for this failure.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
    }
}

/// The `Status` a successful delete of a resource that does not return the deleted object
/// (everything but pods) answers with.
pub fn deleted(resource: Resource, name: &str, uid: &str) -> Value {
    let mut details = json!({"name": name, "kind": resource.plural(), "uid": uid});
    if !resource.group().is_empty() {
        details["group"] = json!(resource.group());
    }
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    })
}
