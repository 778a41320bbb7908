//! `labelSelector` and `fieldSelector` of list, watch and deletecollection, with the real
//! API's syntax (equality- and set-based labels; the field labels each resource supports)
//! and its 400 for anything else, so a client's selector that the real server would refuse
//! is refused here too.

use serde_json::Value;

use super::resource::Resource;
use super::status::ApiError;

#[derive(Debug, Clone, PartialEq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector; the empty one matches everything.
#[derive(Debug, Clone, Default)]
pub struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    pub fn parse(text: &str) -> Result<LabelSelector, ApiError> {
        let mut requirements = vec![];
        for term in split_terms(text) {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            requirements.push(parse_term(term).ok_or_else(|| {
                ApiError::bad_request(format!("unable to parse requirement: {term:?}"))
            })?);
        }
        Ok(LabelSelector(requirements))
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let label = |key: &str| labels.get(key).and_then(Value::as_str);
        self.0.iter().all(|requirement| match requirement {
            Requirement::Equals(k, v) => label(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => label(k) != Some(v.as_str()),
            Requirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => !label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::Exists(k) => label(k).is_some(),
            Requirement::NotExists(k) => label(k).is_none(),
        })
    }
}

/// Commas separate requirements, except inside a set's parentheses.
fn split_terms(text: &str) -> Vec<&str> {
    let (mut terms, mut depth, mut start) = (vec![], 0, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&text[start..]);
    terms
}

fn parse_term(term: &str) -> Option<Requirement> {
    if let Some(key) = term.strip_prefix('!') {
        return valid_key(key.trim()).then(|| Requirement::NotExists(key.trim().to_owned()));
    }
    for (op, set_op) in [(" notin ", true), (" in ", false)] {
        if let Some((key, set)) = term.split_once(op) {
            let key = key.trim();
            let set = set.trim().strip_prefix('(')?.strip_suffix(')')?;
            let values: Vec<String> = set.split(',').map(|v| v.trim().to_owned()).collect();
            if !valid_key(key) || !values.iter().all(|v| valid_value(v)) {
                return None;
            }
            return Some(if set_op {
                Requirement::NotIn(key.to_owned(), values)
            } else {
                Requirement::In(key.to_owned(), values)
            });
        }
    }
    let (key, value, equal) = if let Some((k, v)) = term.split_once("!=") {
        (k, v, false)
    } else if let Some((k, v)) = term.split_once("==") {
        (k, v, true)
    } else if let Some((k, v)) = term.split_once('=') {
        (k, v, true)
    } else {
        return valid_key(term).then(|| Requirement::Exists(term.to_owned()));
    };
    let (key, value) = (key.trim(), value.trim());
    if !valid_key(key) || !valid_value(value) {
        return None;
    }
    Some(if equal {
        Requirement::Equals(key.to_owned(), value.to_owned())
    } else {
        Requirement::NotEquals(key.to_owned(), value.to_owned())
    })
}

fn valid_key(key: &str) -> bool {
    super::validation::label_key_problem(key).is_none()
}

fn valid_value(value: &str) -> bool {
    super::validation::label_value_problem(value).is_none()
}

/// A parsed field selector: `field=value`, `field==value` or `field!=value` terms.
#[derive(Debug, Clone, Default)]
pub struct FieldSelector(Vec<(String, String, bool)>);

impl FieldSelector {
    pub fn parse(text: &str, resource: Resource) -> Result<FieldSelector, ApiError> {
        let mut terms = vec![];
        for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (field, value, equal) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, v, true)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{text}'; can't understand '{term}'"
                )));
            };
            if !supported_field(resource, field) {
                return Err(ApiError::bad_request(format!(
                    "field label not supported: {field}"
                )));
            }
            terms.push((field.to_owned(), value.to_owned(), equal));
        }
        Ok(FieldSelector(terms))
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(field, value, equal)| {
            let actual = field
                .split('.')
                .fold(object, |v, part| &v[part])
                .as_str()
                .unwrap_or("");
            (actual == value) == *equal
        })
    }
}

/// The field labels the real API supports for each resource (the ones the double serves).
fn supported_field(resource: Resource, field: &str) -> bool {
    let common = ["metadata.name", "metadata.namespace"];
    let specific: &[&str] = match resource {
        Resource::Pods => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "status.phase",
            "status.podIP",
        ],
        Resource::Secrets => &["type"],
        Resource::Events => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ],
        Resource::NetworkPolicies | Resource::Leases => &[],
    };
    common.contains(&field) || specific.contains(&field)
}

/// A list or watch's filter: namespace (None: all), labels and fields.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, object: &Value) -> bool {
        let namespace_matches = self
            .namespace
            .as_deref()
            .is_none_or(|ns| object["metadata"]["namespace"].as_str() == Some(ns));
        namespace_matches && self.labels.matches(object) && self.fields.matches(object)
    }
}
