//! Authentication (bearer tokens) and authorization (RBAC-shaped rules) of the double's
//! API, so a gateway's Role can be tested for being enough and no more: every request is
//! checked as the real authorizer checks it, before the object is looked at, and refused
//! with the real 401 and 403 `Status`es.

use std::collections::HashMap;

use super::resource::Resource;
use super::status::ApiError;

/// One RBAC policy rule, with the namespaces its binding grants it in (a RoleBinding per
/// namespace, or `"*"` for a ClusterRoleBinding).
#[derive(Debug, Clone)]
pub struct Rule {
    /// API groups ("" is core; "*" any).
    pub api_groups: Vec<String>,
    /// Resource plurals ("*" any).
    pub resources: Vec<String>,
    /// get, list, watch, create, update, patch, delete, deletecollection ("*" any).
    pub verbs: Vec<String>,
    /// Namespaces the rule is bound in ("*": all, and the cluster scope).
    pub namespaces: Vec<String>,
    /// resourceNames: when not empty, only these objects (never list, watch or create).
    pub names: Vec<String>,
}

impl Rule {
    /// A rule for `resources` of one API group, with `verbs`, in `namespaces`.
    pub fn new(api_group: &str, resources: &[&str], verbs: &[&str], namespaces: &[&str]) -> Rule {
        let owned = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect();
        Rule {
            api_groups: vec![api_group.to_owned()],
            resources: owned(resources),
            verbs: owned(verbs),
            namespaces: owned(namespaces),
            names: vec![],
        }
    }

    /// Restricts the rule to these object names (RBAC's resourceNames).
    pub fn named(mut self, names: &[&str]) -> Rule {
        self.names = names.iter().map(|s| (*s).to_owned()).collect();
        self
    }

    /// Everything, everywhere: cluster-admin.
    pub fn everything() -> Rule {
        Rule::new("*", &["*"], &["*"], &["*"])
    }

    fn allows(&self, request: &Access<'_>) -> bool {
        let any = |list: &[String], item: &str| list.iter().any(|x| x == "*" || x == item);
        let namespace_ok = match request.namespace {
            Some(ns) => any(&self.namespaces, ns),
            None => self.namespaces.iter().any(|x| x == "*"),
        };
        let name_ok = self.names.is_empty()
            || (!request.name.is_empty() && self.names.iter().any(|n| n == request.name));
        any(&self.api_groups, request.resource.group())
            && any(&self.resources, request.resource.plural())
            && any(&self.verbs, request.verb)
            && namespace_ok
            && name_ok
    }
}

/// What a request wants to do, as the authorizer sees it.
#[derive(Debug, Clone, Copy)]
pub struct Access<'a> {
    pub verb: &'a str,
    pub resource: Resource,
    /// None: across all namespaces (the cluster scope).
    pub namespace: Option<&'a str>,
    /// The object's name ("" for collection requests).
    pub name: &'a str,
}

#[derive(Debug, Clone)]
pub struct User {
    /// The user name RBAC messages show, e.g. `system:serviceaccount:cellgate:gateway`.
    pub subject: String,
    pub rules: Vec<Rule>,
}

/// The tokens the API accepts.
#[derive(Debug, Default)]
pub struct Auth {
    users: HashMap<String, User>,
}

impl Auth {
    pub fn add(&mut self, token: &str, subject: &str, rules: Vec<Rule>) {
        self.users.insert(
            token.to_owned(),
            User {
                subject: subject.to_owned(),
                rules,
            },
        );
    }

    /// The user an `Authorization` header names; 401 for none or an unknown token.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<&User, ApiError> {
        let token = authorization
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(ApiError::unauthorized)?;
        self.users.get(token).ok_or_else(ApiError::unauthorized)
    }
}

impl User {
    /// RBAC: allowed when any rule allows; the real 403 otherwise.
    pub fn authorize(&self, access: &Access<'_>) -> Result<(), ApiError> {
        if self.rules.iter().any(|rule| rule.allows(access)) {
            return Ok(());
        }
        Err(ApiError::forbidden(
            access.resource,
            access.name,
            &self.subject,
            access.verb,
            access.namespace,
        ))
    }
}
