//! The API's write verbs with the real server's semantics: create (names, generateName,
//! system metadata, 409 AlreadyExists), update and patch (optimistic concurrency on
//! resourceVersion, immutable fields, no-op writes that write nothing), delete (pods'
//! graceful deletion through the kubelet, preconditions, finalizers, propagation), all
//! over the store and independent of HTTP.

use std::sync::Arc;

use base64::Engine;
use serde_json::{json, Value};

use super::admission;
use super::cluster::{now, timestamp, Cluster};
use super::patch;
use super::resource::Resource;
use super::selector::Filter;
use super::status::{self, ApiError};
use super::validation;

/// A delete's options, from the query or the DeleteOptions body.
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    pub grace_period_seconds: Option<i64>,
    /// Background (the default), Foreground or Orphan.
    pub propagation: Option<String>,
    pub precondition_uid: Option<String>,
    pub precondition_resource_version: Option<String>,
    pub dry_run: bool,
}

/// How a patch body is to be read, from its Content-Type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    Json,
}

impl PatchType {
    pub fn from_content_type(content_type: &str) -> Result<PatchType, ApiError> {
        match content_type.split(';').next().unwrap_or("").trim() {
            "application/merge-patch+json" => Ok(PatchType::Merge),
            "application/json-patch+json" => Ok(PatchType::Json),
            "application/strategic-merge-patch+json" => Err(ApiError::unsupported_by_double(
                "strategic merge patches (use a JSON merge patch)",
            )),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => Err(
                ApiError::unsupported_by_double("server-side apply (use a JSON merge patch)"),
            ),
            other => Err(ApiError::unsupported_media_type(other)),
        }
    }
}

/// `stringData` is write-only: the API folds it into `data` (base64), as here.
fn fold_string_data(secret: &mut Value) {
    let Some(string_data) = secret.as_object_mut().and_then(|s| s.remove("stringData")) else {
        return;
    };
    for (key, value) in string_data.as_object().into_iter().flatten() {
        let encoded = base64::engine::general_purpose::STANDARD
            .encode(value.as_str().unwrap_or("").as_bytes());
        secret["data"][key] = json!(encoded);
    }
    if secret["type"].is_null() {
        secret["type"] = json!("Opaque");
    }
}

fn meta_str<'a>(object: &'a Value, field: &str) -> &'a str {
    object["metadata"][field].as_str().unwrap_or("")
}

fn finalizers(object: &Value) -> Vec<String> {
    object["metadata"]["finalizers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect()
}

impl Cluster {
    fn check_namespace(&self, namespace: &str) -> Result<(), ApiError> {
        if self.namespaces.read().contains(namespace) {
            Ok(())
        } else {
            Err(ApiError::namespace_not_found(namespace))
        }
    }

    pub fn list(&self, resource: Resource, filter: &Filter) -> Result<(Vec<Value>, u64), ApiError> {
        if let Some(namespace) = &filter.namespace {
            self.check_namespace(namespace)?;
        }
        let store = self.store.lock();
        Ok((store.list(resource, filter), store.resource_version()))
    }

    pub fn get_checked(
        &self,
        resource: Resource,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        self.check_namespace(namespace)?;
        self.get(resource, namespace, name)
            .ok_or_else(|| ApiError::not_found(resource, name))
    }

    pub fn create(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        mut object: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        self.check_namespace(namespace)?;
        if !object["metadata"].is_object() {
            object["metadata"] = json!({});
        }
        let given_namespace = meta_str(&object, "namespace");
        if !given_namespace.is_empty() && given_namespace != namespace {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let metadata = &mut object["metadata"];
        let generate = metadata["generateName"].as_str().unwrap_or("").to_owned();
        if metadata["name"].as_str().unwrap_or("").is_empty() {
            if generate.is_empty() {
                return Err(ApiError::invalid(
                    resource,
                    "",
                    &[
                        "metadata.name: Required value: name or generateName is required"
                            .to_owned(),
                    ],
                ));
            }
            metadata["name"] = json!(format!("{generate}{}", admission::random_suffix()));
        }
        metadata["namespace"] = json!(namespace);
        metadata["uid"] = json!(uuid::Uuid::new_v4().to_string());
        metadata["creationTimestamp"] = json!(now());
        if let Some(metadata) = metadata.as_object_mut() {
            for field in [
                "resourceVersion",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "managedFields",
                "selfLink",
            ] {
                metadata.remove(field);
            }
        }
        match resource {
            Resource::Secrets => {
                fold_string_data(&mut object);
                if object["type"].is_null() {
                    object["type"] = json!("Opaque");
                }
            }
            Resource::Pods => admission::admit_new_pod(&mut object, &self.runtime_classes)?,
            _ => {}
        }
        let object = resource.normalize(object)?;
        validation::validate(resource, &object)?;
        if resource == Resource::Pods {
            if let Some(level) = self.pod_security.get(namespace) {
                admission::enforce_pod_security(&object, level)?;
            }
            admission::refuse_unsupported_pod(&object)?;
        }
        let name = meta_str(&object, "name").to_owned();
        let stored = {
            let mut store = self.store.lock();
            if store.get(resource, namespace, &name).is_some() {
                return Err(ApiError::already_exists(resource, &name));
            }
            if dry_run {
                return Ok(object);
            }
            store.put(resource, object)
        };
        if resource == Resource::Pods {
            self.kubelet.pod_created(self, &stored);
        }
        if !stored["metadata"]["ownerReferences"].is_null() {
            self.collect_garbage_soon();
        }
        Ok(stored)
    }

    /// PUT: the body replaces the object, if it names the stored resourceVersion (or none).
    pub fn replace(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        name: &str,
        object: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        self.check_namespace(namespace)?;
        self.update(resource, namespace, name, dry_run, |_| Ok(object))
    }

    /// PATCH: the body is applied to the stored object, then written like an update.
    pub fn patch(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        name: &str,
        patch_type: PatchType,
        body: &[u8],
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        self.check_namespace(namespace)?;
        let patch_body: Value = serde_json::from_slice(body)
            .map_err(|err| ApiError::bad_request(format!("error decoding patch: {err}")))?;
        self.update(resource, namespace, name, dry_run, |old| {
            let mut new = old.clone();
            match patch_type {
                PatchType::Merge => patch::merge(&mut new, &patch_body),
                PatchType::Json => patch::json_patch(&mut new, &patch_body)?,
            }
            resource.normalize(new)
        })
    }

    /// An update, all under the store's lock: `make` turns the stored object into the
    /// proposed one; then the real API's checks, and the write (or none when nothing
    /// changed).
    fn update(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        name: &str,
        dry_run: bool,
        make: impl FnOnce(&Value) -> Result<Value, ApiError>,
    ) -> Result<Value, ApiError> {
        let (stored, finished) = {
            let mut store = self.store.lock();
            let old = store
                .get(resource, namespace, name)
                .cloned()
                .ok_or_else(|| ApiError::not_found(resource, name))?;
            let mut new = make(&old)?;
            if !new["metadata"].is_object() {
                new["metadata"] = json!({});
            }
            let given_name = meta_str(&new, "name");
            if !given_name.is_empty() && given_name != name {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({given_name}) does not match the name on the URL ({name})"
                )));
            }
            let given_namespace = meta_str(&new, "namespace");
            if !given_namespace.is_empty() && given_namespace != namespace {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            let given_rv = meta_str(&new, "resourceVersion");
            if !given_rv.is_empty() && given_rv != meta_str(&old, "resourceVersion") {
                return Err(ApiError::conflict(resource, name));
            }
            let given_uid = meta_str(&new, "uid");
            if !given_uid.is_empty() && given_uid != meta_str(&old, "uid") {
                return Err(ApiError::conflict_because(
                    resource,
                    name,
                    &format!(
                        "Precondition failed: UID in precondition: {given_uid}, UID in object meta: {}",
                        meta_str(&old, "uid")
                    ),
                ));
            }
            // System fields are the server's, whatever the body says.
            for field in [
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "resourceVersion",
            ] {
                match old["metadata"].get(field) {
                    Some(value) => new["metadata"][field] = value.clone(),
                    None => {
                        if let Some(metadata) = new["metadata"].as_object_mut() {
                            metadata.remove(field);
                        }
                    }
                }
            }
            match resource {
                Resource::Secrets => {
                    fold_string_data(&mut new);
                    if new["type"].is_null() {
                        new["type"] = json!("Opaque");
                    }
                }
                Resource::Pods => {
                    // Status is the kubelet's, through a subresource clients here lack.
                    new["status"] = old["status"].clone();
                    if !new["spec"].is_object() {
                        new["spec"] = json!({});
                    }
                    admission::default_pod_spec(&mut new["spec"]);
                }
                _ => {}
            }
            let new = resource.normalize(new)?;
            validation::validate(resource, &new)?;
            validation::validate_update(resource, &old, &new)?;
            if resource == Resource::Pods {
                admission::refuse_unsupported_pod_update(&old, &new)?;
            }
            if dry_run || new == old {
                return Ok(new);
            }
            let deleting = !new["metadata"]["deletionTimestamp"].is_null();
            if deleting && finalizers(&new).is_empty() && resource != Resource::Pods {
                // The last finalizer is gone: the deletion completes.
                store.put(resource, new);
                (store.remove(resource, namespace, name), true)
            } else {
                (Some(store.put(resource, new)), false)
            }
        };
        // (A pod being deleted is removed by its kubelet worker, which watches for its
        // finalizers to go.)
        if finished {
            self.collect_garbage_soon();
        }
        stored.ok_or_else(|| ApiError::not_found(resource, name))
    }

    /// DELETE: returns the HTTP code and body (pods: the object; others: a `Status`).
    pub fn delete(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        name: &str,
        options: &DeleteOptions,
    ) -> Result<(u16, Value), ApiError> {
        self.check_namespace(namespace)?;
        let propagation = options.propagation.as_deref().unwrap_or("Background");
        if !["Background", "Foreground", "Orphan"].contains(&propagation) {
            return Err(ApiError::invalid(
                resource,
                name,
                &[format!("propagationPolicy: Unsupported value: \"{propagation}\": supported values: \"Foreground\", \"Background\", \"Orphan\"")],
            ));
        }
        let mut store = self.store.lock();
        let current = store
            .get(resource, namespace, name)
            .cloned()
            .ok_or_else(|| ApiError::not_found(resource, name))?;
        let uid = meta_str(&current, "uid").to_owned();
        if let Some(want) = &options.precondition_uid {
            if *want != uid {
                return Err(ApiError::conflict_because(
                    resource,
                    name,
                    &format!("Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"),
                ));
            }
        }
        if let Some(want) = &options.precondition_resource_version {
            let have = meta_str(&current, "resourceVersion");
            if want != have {
                return Err(ApiError::conflict_because(
                    resource,
                    name,
                    &format!("Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in object meta: {have}"),
                ));
            }
        }
        let answer = |object: &Value| match resource {
            Resource::Pods => object.clone(),
            _ => status::deleted(resource, name, &uid),
        };
        if options.dry_run {
            return Ok((200, answer(&current)));
        }
        let dependents: Vec<(Resource, Value)> = store
            .all()
            .filter(|(_, o)| meta_str(o, "namespace") == namespace && owned_by(o, &uid))
            .map(|(r, o)| (r, o.clone()))
            .collect();
        if propagation == "Orphan" {
            for (dependent_resource, mut dependent) in dependents.clone() {
                strip_owner(&mut dependent, &uid);
                store.put(dependent_resource, dependent);
            }
        }
        let mut object = current.clone();
        let already_deleting = !object["metadata"]["deletionTimestamp"].is_null();
        let foreground = propagation == "Foreground" && !dependents.is_empty();
        if foreground
            && !finalizers(&object)
                .iter()
                .any(|f| f == "foregroundDeletion")
        {
            let mut list = finalizers(&object);
            list.push("foregroundDeletion".to_owned());
            object["metadata"]["finalizers"] = json!(list);
        }
        let grace = if resource == Resource::Pods {
            pod_grace_period(&object, options.grace_period_seconds)
        } else {
            0
        };
        if resource == Resource::Pods && already_deleting && grace > 0 {
            // A second graceful delete changes nothing: the kubelet is already on it.
            return Ok((200, object));
        }
        let keep = grace > 0 || !finalizers(&object).is_empty();
        if keep {
            if !already_deleting {
                let at = time::OffsetDateTime::now_utc() + time::Duration::seconds(grace);
                object["metadata"]["deletionTimestamp"] = json!(timestamp(at));
                object["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
            }
            let stored = if object == current {
                current
            } else {
                store.put(resource, object)
            };
            drop(store);
            if resource == Resource::Pods {
                self.kubelet.pod_deleting(&uid, grace);
            }
            if foreground {
                self.collect_garbage_soon();
            }
            let code = if grace > 0 { 200 } else { 202 };
            return Ok((code, answer(&stored)));
        }
        let removed = store
            .remove(resource, namespace, name)
            .ok_or_else(|| ApiError::not_found(resource, name))?;
        drop(store);
        if resource == Resource::Pods {
            self.kubelet.pod_removed(&uid);
        }
        self.collect_garbage_soon();
        Ok((200, answer(&removed)))
    }

    /// The kubelet's last word on a pod it stopped: the object goes (unless finalizers
    /// hold it), as when the real kubelet deletes it with grace 0 and a uid precondition.
    pub fn finish_pod_deletion(self: &Arc<Self>, namespace: &str, name: &str, uid: &str) {
        let removed = {
            let mut store = self.store.lock();
            match store.get(Resource::Pods, namespace, name) {
                Some(pod) if meta_str(pod, "uid") == uid && finalizers(pod).is_empty() => {
                    store.remove(Resource::Pods, namespace, name)
                }
                _ => None,
            }
        };
        if removed.is_some() {
            self.collect_garbage_soon();
        }
    }

    /// DELETE on a collection: each matching object as its own delete.
    pub fn delete_collection(
        self: &Arc<Self>,
        resource: Resource,
        filter: &Filter,
        options: &DeleteOptions,
    ) -> Result<Vec<Value>, ApiError> {
        let (objects, _) = self.list(resource, filter)?;
        let mut deleted = vec![];
        for object in objects {
            let namespace = meta_str(&object, "namespace");
            let name = meta_str(&object, "name");
            match self.delete(resource, namespace, name, options) {
                Ok(_) => deleted.push(object),
                Err(err) if err.code == 404 => {}
                Err(err) => return Err(err),
            }
        }
        Ok(deleted)
    }
}

/// A pod's grace period: the request's, else the pod's own (30 s by default); none for a
/// pod that never reached a node or has already finished, as in the real API.
fn pod_grace_period(pod: &Value, requested: Option<i64>) -> i64 {
    let phase = pod["status"]["phase"].as_str().unwrap_or("");
    if pod["spec"]["nodeName"].is_null() || phase == "Succeeded" || phase == "Failed" {
        return 0;
    }
    requested
        .or_else(|| pod["spec"]["terminationGracePeriodSeconds"].as_i64())
        .unwrap_or(30)
        .max(0)
}

pub fn owned_by(object: &Value, uid: &str) -> bool {
    object["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
}

pub fn strip_owner(object: &mut Value, uid: &str) {
    if let Some(refs) = object["metadata"]["ownerReferences"].as_array_mut() {
        refs.retain(|r| r["uid"] != uid);
        if refs.is_empty() {
            if let Some(metadata) = object["metadata"].as_object_mut() {
                metadata.remove("ownerReferences");
            }
        }
    }
}
