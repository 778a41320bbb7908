//! The resources the double serves, and what makes each one "typed": a write is decoded
//! into the k8s-openapi type of its resource (a body that does not decode, or names another
//! kind or apiVersion, is a 400 as in the real API) and stored as that type serializes, so
//! unknown fields are dropped and every stored object is one the real types accept.

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::status::ApiError;

/// A resource type of the double's API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Pods,
    Secrets,
    Events,
    NetworkPolicies,
    Leases,
}

impl Resource {
    pub const ALL: [Resource; 5] = [
        Resource::Pods,
        Resource::Secrets,
        Resource::Events,
        Resource::NetworkPolicies,
        Resource::Leases,
    ];

    /// The resource as a URL names it (`pods`), which is also what RBAC rules name.
    pub fn plural(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::Secrets => "secrets",
            Resource::Events => "events",
            Resource::NetworkPolicies => "networkpolicies",
            Resource::Leases => "leases",
        }
    }

    /// The API group ("" for core).
    pub fn group(self) -> &'static str {
        match self {
            Resource::Pods | Resource::Secrets | Resource::Events => "",
            Resource::NetworkPolicies => "networking.k8s.io",
            Resource::Leases => "coordination.k8s.io",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Resource::Pods => "Pod",
            Resource::Secrets => "Secret",
            Resource::Events => "Event",
            Resource::NetworkPolicies => "NetworkPolicy",
            Resource::Leases => "Lease",
        }
    }

    pub fn api_version(self) -> &'static str {
        match self.group() {
            "" => "v1",
            "networking.k8s.io" => "networking.k8s.io/v1",
            _ => "coordination.k8s.io/v1",
        }
    }

    /// `pods`, or `leases.coordination.k8s.io`: how messages name the resource.
    pub fn qualified(self) -> String {
        match self.group() {
            "" => self.plural().to_owned(),
            group => format!("{}.{group}", self.plural()),
        }
    }

    /// The resource an API path names: group ("" for `/api/v1`), version and plural.
    pub fn from_path(group: &str, version: &str, plural: &str) -> Option<Resource> {
        Resource::ALL
            .into_iter()
            .find(|r| r.group() == group && version == "v1" && r.plural() == plural)
    }

    /// The resource a caller of the double's inspection methods names by its plural.
    pub fn from_plural(plural: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.plural() == plural)
    }

    /// Decodes a request body as this resource's type (400 when it does not decode).
    pub fn decode(self, body: &[u8]) -> Result<Value, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|err| self.undecodable(err))?;
        self.normalize(value)
    }

    /// Passes an object through this resource's type: the stored form of a write.
    pub fn normalize(self, value: Value) -> Result<Value, ApiError> {
        match self {
            Resource::Pods => through::<Pod>(value),
            Resource::Secrets => through::<Secret>(value),
            Resource::Events => through::<Event>(value),
            Resource::NetworkPolicies => through::<NetworkPolicy>(value),
            Resource::Leases => through::<Lease>(value),
        }
        .map_err(|err| self.undecodable(err))
    }

    fn undecodable(self, err: serde_json::Error) -> ApiError {
        ApiError::bad_request(format!(
            "{kind} in version \"v1\" cannot be handled as a {kind}: {err}",
            kind = self.kind()
        ))
    }
}

fn through<K: DeserializeOwned + Serialize>(value: Value) -> Result<Value, serde_json::Error> {
    if !value.is_object() {
        return Err(serde::de::Error::custom("the body is not a JSON object"));
    }
    let typed: K = serde_json::from_value(value)?;
    serde_json::to_value(typed)
}
