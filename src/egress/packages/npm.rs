//! The npm registry cellgate serves to sandboxes: packuments and tarballs of the packages
//! the session's policy lists in `[packages] npm` ([`crate::policy::npm`]), and nothing else.
//!
//! Reached by Deno's `npm:` imports (and any npm client) inside the sandbox as
//! `http://npm.cellgate.internal/` through the egress proxy (`NPM_CONFIG_REGISTRY`, set by
//! [`crate::egress::kernel_env`]); the proxy hands those requests here, whatever the egress
//! rules say. Packuments come from an upstream registry (`--npm-registry`, default
//! registry.npmjs.org), are cached for [`PACKUMENT_TTL`] and served filtered:
//! - only the versions the policy's ranges allow, and only those whose `dist.integrity`
//!   is a sha512 (older ones with a SHA-1 `shasum` alone are left out: SHA-1 is not a
//!   hash a cache should trust) and whose tarball is on the upstream registry's origin;
//! - `dist.tarball` rewritten to this registry (`/<name>/-/<file>-<version>.tgz`), so the
//!   tarball comes through here too;
//! - dist-tags pointing at a left-out version dropped, and `latest` set to the highest
//!   allowed release when upstream's is not allowed (Deno resolves a bare `npm:x` by it).
//!
//! The policy compares names case-insensitively; upstream is asked for a name as the client
//! spelt it. Packuments are served by serialising the cached upstream document's allowed
//! parts in place, never copied per request.
//!
//! Every tarball request asks the policy again (name and version, from the path) and takes
//! its upstream URL and sha512 from the packument, never from the client. Tarballs go
//! through the PyPI index's download machinery (`download.rs`, `follow` in `mod.rs`): one
//! download however many sessions ask, streamed as it arrives, its last byte held back
//! until the sha512 matched, kept in the shared cache (as `sha512-<hex>`) only then, and
//! bounded as there (download slots, per-session flights, size cap, disk margin).
//!
//! A package the policy does not list answers 404, with an npm-style JSON `error` naming
//! the package and the policy, and a denial (`package`, target `npm:<name>`) is attached
//! to the running execution; when an allowed package this session was served declares it
//! as a dependency, the denial says so. A version the policy does not allow is left out of
//! the packument; its tarball answers 404 with a denial too.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use parking_lot::Mutex;
use serde::ser::{Serialize, SerializeMap};
use serde_json::{Map, Value};

use super::download::{Downloads, FileDigest, Wanted};
use super::{follow, respond, IndexError, PackageIndex};
use crate::egress::proxy::Body;
use crate::egress::{Session, NPM_HOST};
use crate::policy::npm::{normalize_npm_name, NpmRules};
use crate::policy::DenialKind;

/// How long an upstream packument is reused.
pub const PACKUMENT_TTL: Duration = Duration::from_secs(300);
/// The largest packument read from upstream. The largest on npmjs.org (full documents of
/// packages with thousands of versions, which is what Deno asks for) are some tens of MiB;
/// the abbreviated ones npm asks for are far smaller.
const MAX_PACKUMENT_BYTES: usize = 64 << 20;
/// Upstream packument bytes kept at most, all packages together (the oldest go), counted
/// as upstream sent them (parsed, they take a few times that).
const MAX_CACHED_BYTES: usize = 256 << 20;
/// The most a packument fetch may take in all.
const PACKUMENT_TIMEOUT: Duration = Duration::from_secs(120);
/// Upstream packument fetches at once, all sessions together: each may hold up to
/// [`MAX_PACKUMENT_BYTES`] in memory while it reads. Requests for one package wait for the
/// fetch under way and then find it cached.
const MAX_FETCHES: usize = 4;
/// Dependencies remembered per session for denial messages, at most.
const MAX_DEPENDENTS: usize = 10_000;
/// npm's abbreviated packument ("corgi"): what installers ask for.
const CORGI: &str = "application/vnd.npm.install-v1+json";

/// Errors of the npm registry.
#[derive(Debug, thiserror::Error)]
pub enum NpmError {
    #[error("upstream registry {url}: {reason}")]
    Upstream { url: String, reason: String },
    #[error("npm package '{name}' {version}: {reason}")]
    Version {
        name: String,
        version: String,
        reason: String,
    },
    #[error(transparent)]
    Index(#[from] IndexError),
}

/// Settings of the npm registry.
#[derive(Debug, Clone)]
pub struct NpmConfig {
    /// The upstream registry, e.g. `https://registry.npmjs.org`.
    pub upstream: String,
}

/// One upstream packument, as fetched (abbreviated or full).
struct Packument {
    /// The document's `modified`; its other top-level fields (readme, maintainers...) are
    /// not served.
    modified: Option<Value>,
    dist_tags: Map<String, Value>,
    versions: Map<String, Value>,
    time: Option<Map<String, Value>>,
    /// Bytes upstream sent (what the cache counts).
    size: usize,
}

/// The npm registry of a gateway, shared by every session.
pub struct NpmRegistry {
    config: NpmConfig,
    client: reqwest::Client,
    downloads: Arc<Downloads>,
    packuments: Mutex<PackumentCache>,
    /// [`MAX_FETCHES`] permits, one held by each upstream packument fetch.
    fetches: tokio::sync::Semaphore,
}

/// Upstream packuments by (name, abbreviated), with when they were fetched.
type PackumentCache = HashMap<(String, bool), (Instant, Arc<Packument>)>;

impl std::fmt::Debug for NpmRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NpmRegistry")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    Packument(String),
    /// Name, tarball file name.
    Tarball(String, String),
}

/// Reads a request path: `/<name>`, `/@scope/<name>` (or `@scope%2f<name>`), and their
/// tarballs `/<name>/-/<file>.tgz`. `None`: not an npm package path.
fn parse_path(path: &str) -> Option<Asked> {
    let path = path
        .strip_prefix('/')?
        .replace("%2f", "/")
        .replace("%2F", "/")
        .replace("%40", "@");
    let path = path.trim_end_matches('/');
    let (name, file) = match path.split_once("/-/") {
        Some((name, file)) => (name, Some(file)),
        None => (path, None),
    };
    // The policy compares names case-insensitively, but upstream is asked for the name as
    // spelt: a few old packages have capitals (`JSONStream`), and their lower-case
    // spelling is another package or none.
    normalize_npm_name(name)?;
    let name = name.to_owned();
    match file {
        None => Some(Asked::Packument(name)),
        Some(file) if !file.contains('/') && file.ends_with(".tgz") => {
            Some(Asked::Tarball(name, file.to_owned()))
        }
        Some(_) => None,
    }
}

/// The version a tarball's file name carries: `<unscoped name>-<version>.tgz`.
fn tarball_version(name: &str, file: &str) -> Option<String> {
    let base = name.rsplit('/').next()?;
    let version = file
        .strip_suffix(".tgz")?
        .strip_prefix(base)?
        .strip_prefix('-')?;
    (!version.is_empty()).then(|| version.to_owned())
}

/// npm's `integrity` as a sha512 digest, if it has one (`sha512-<base64>`, possibly among
/// other algorithms separated by spaces).
fn sha512_of(integrity: &str) -> Option<FileDigest> {
    integrity.split_whitespace().find_map(|part| {
        let b64 = part.strip_prefix("sha512-")?;
        let b64 = b64.split('?').next()?;
        let bytes = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
        (bytes.len() == 64).then(|| FileDigest::Sha512(hex::encode(bytes)))
    })
}

/// The upstream URL, the sha512 and the integrity string of one version's tarball. The
/// tarball must be on the upstream registry's own origin: a packument is upstream's word,
/// and a link elsewhere (an address inside the gateway's network) would have the gateway
/// fetch what no policy named.
fn dist_of(version: &Value, upstream: &str) -> Option<(String, FileDigest, String)> {
    let dist = version.get("dist")?;
    let url = dist.get("tarball")?.as_str()?;
    if !same_origin(url, upstream) {
        return None;
    }
    let integrity = dist.get("integrity")?.as_str()?;
    Some((url.to_owned(), sha512_of(integrity)?, integrity.to_owned()))
}

/// Whether `url` is an http(s) URL on `upstream`'s scheme, host and port.
fn same_origin(url: &str, upstream: &str) -> bool {
    let (Ok(url), Ok(upstream)) = (reqwest::Url::parse(url), reqwest::Url::parse(upstream)) else {
        return false;
    };
    matches!(url.scheme(), "http" | "https")
        && url.scheme() == upstream.scheme()
        && url.host_str().is_some()
        && url.host_str() == upstream.host_str()
        && url.port_or_known_default() == upstream.port_or_known_default()
        && url.username().is_empty()
        && url.password().is_none()
}

/// The file name of a version's tarball on this registry.
fn tarball_file(name: &str, version: &str) -> String {
    let base = name.rsplit('/').next().unwrap_or(name);
    format!("{base}-{version}.tgz")
}

fn json_response(status: StatusCode, content_type: &'static str, body: &Value) -> Response<Body> {
    respond(status, content_type, body.to_string())
}

/// The highest version in `versions` (semver order; ones that are not semver last).
fn highest<'a>(versions: impl Iterator<Item = &'a String>) -> Option<&'a String> {
    versions
        .filter_map(|v| semver::Version::parse(v).ok().map(|parsed| (parsed, v)))
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, v)| v)
}

impl NpmRegistry {
    /// The registry, drawing on `index`'s downloads (the same slots, cache and limits).
    pub fn new(config: NpmConfig, index: &PackageIndex) -> Arc<NpmRegistry> {
        Arc::new(NpmRegistry {
            config,
            client: index.client.clone(),
            downloads: index.downloads.clone(),
            packuments: Mutex::new(HashMap::new()),
            fetches: tokio::sync::Semaphore::new(MAX_FETCHES),
        })
    }

    pub fn upstream(&self) -> &str {
        &self.config.upstream
    }

    /// Answers one request for `npm.cellgate.internal`.
    pub async fn handle(&self, session: &Arc<Session>, req: Request<Incoming>) -> Response<Body> {
        if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
            return npm_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "the npm registry is read-only",
            );
        }
        let corgi = req
            .headers()
            .get(hyper::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains(CORGI));
        let head = req.method() == hyper::Method::HEAD;
        match parse_path(req.uri().path()) {
            Some(Asked::Packument(name)) => self.packument(session, &name, corgi).await,
            Some(Asked::Tarball(name, file)) => self.tarball(session, &name, &file, head).await,
            None => npm_error(StatusCode::NOT_FOUND, "cellgate npm registry: no such page"),
        }
    }

    /// Refuses `name` (not listed): the denial, and the 404 npm clients understand.
    fn refuse(&self, session: &Session, name: &str, version: Option<&str>) -> Response<Body> {
        let policy = &session.policy.name;
        let mut reason = match version {
            None => format!("npm package '{name}' is not allowed by policy '{policy}'"),
            Some(v) => {
                format!("npm package '{name}' version {v} is not allowed by policy '{policy}'")
            }
        };
        if version.is_none() {
            let parent = normalize_npm_name(name)
                .and_then(|key| session.packages.lock().npm_dependents.get(&key).cloned());
            if let Some(parent) = parent {
                reason.push_str(&format!(
                    " (a dependency of '{parent}'; list it in [packages] npm)"
                ));
            }
        }
        session.deny(DenialKind::Package, &format!("npm:{name}"), reason.clone());
        npm_error(StatusCode::NOT_FOUND, &format!("cellgate: {reason}"))
    }

    async fn packument(&self, session: &Session, name: &str, corgi: bool) -> Response<Body> {
        let rules = &session.policy.packages.npm;
        if !rules.lists(name) {
            return self.refuse(session, name, None);
        }
        let packument = match self.fetch(name, corgi).await {
            Ok(Some(p)) => p,
            Ok(None) => {
                return npm_error(
                    StatusCode::NOT_FOUND,
                    &format!("npm package '{name}' is not in the upstream registry"),
                )
            }
            Err(err) => {
                tracing::warn!(kernel_id = %session.kernel_id, name, %err, "npm registry: upstream failed");
                return error_response(&err);
            }
        };
        let served = served(name, rules, &packument, &self.config.upstream);
        let body = match serde_json::to_vec(&served) {
            Ok(body) => body,
            // Values parsed from JSON always serialise; said rather than assumed.
            Err(err) => {
                tracing::warn!(kernel_id = %session.kernel_id, name, %err, "npm registry: a packument did not serialise");
                return npm_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "cellgate npm registry: a packument did not serialise",
                );
            }
        };
        {
            let mut state = session.packages.lock();
            for dependency in &served.dependencies {
                if state.npm_dependents.len() >= MAX_DEPENDENTS {
                    break;
                }
                if let Some(dependency) = normalize_npm_name(dependency) {
                    state
                        .npm_dependents
                        .entry(dependency)
                        .or_insert_with(|| name.to_owned());
                }
            }
        }
        let listed = served.versions.len();
        session.allow("npm", name, &format!("{listed} versions listed"));
        let content_type = if corgi { CORGI } else { "application/json" };
        respond(StatusCode::OK, content_type, body)
    }

    async fn tarball(
        &self,
        session: &Arc<Session>,
        name: &str,
        file: &str,
        head: bool,
    ) -> Response<Body> {
        let rules = &session.policy.packages.npm;
        if !rules.lists(name) {
            return self.refuse(session, name, None);
        }
        let Some(version) = tarball_version(name, file) else {
            return npm_error(
                StatusCode::NOT_FOUND,
                "cellgate npm registry: no such tarball",
            );
        };
        // The packument a session saw is not a permission: ask the policy again.
        if !rules.allows(name, &version) {
            return self.refuse(session, name, Some(&version));
        }
        let wanted = match self.wanted(name, &version).await {
            Ok(wanted) => wanted,
            Err(err) => {
                tracing::warn!(kernel_id = %session.kernel_id, name, version, %err, "npm registry: tarball refused");
                return error_response(&err);
            }
        };
        if head {
            let mut response = respond(StatusCode::OK, "application/octet-stream", Bytes::new());
            if let Some(length) = self.downloads.cached_length(&wanted.digest) {
                response
                    .headers_mut()
                    .insert(hyper::header::CONTENT_LENGTH, length.into());
            }
            return response;
        }
        let body = match follow(&self.downloads, session, wanted).await {
            Ok(body) => body,
            Err(err) => {
                tracing::warn!(kernel_id = %session.kernel_id, name, version, %err, "npm registry: tarball failed");
                return super::file_error("cellgate npm registry", &err);
            }
        };
        let length = body.progress.as_ref().map_or(Some(body.length), |rx| {
            let progress = rx.borrow();
            match progress.state {
                super::State::Done => Some(progress.written),
                _ => progress.length,
            }
        });
        session.allow("npm", name, file);
        let mut response = Response::new(body.into_body());
        let headers = response.headers_mut();
        headers.insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/octet-stream"),
        );
        if let Some(length) = length {
            headers.insert(hyper::header::CONTENT_LENGTH, length.into());
        }
        response
    }

    /// What to download for `name@version`: the packument's tarball URL and sha512.
    async fn wanted(&self, name: &str, version: &str) -> Result<Wanted, NpmError> {
        let error = |reason: &str| NpmError::Version {
            name: name.to_owned(),
            version: version.to_owned(),
            reason: reason.to_owned(),
        };
        // Either form will do; the abbreviated one is the smaller to fetch.
        let cached = self.cached(name, true).or_else(|| self.cached(name, false));
        let packument = match cached {
            Some(p) => p,
            None => self
                .fetch(name, true)
                .await?
                .ok_or_else(|| error("not in the upstream registry"))?,
        };
        let info = packument
            .versions
            .get(version)
            .ok_or_else(|| error("no such version upstream"))?;
        let (url, digest, _) = dist_of(info, &self.config.upstream)
            .ok_or_else(|| error("upstream gives no sha512 integrity for its tarball"))?;
        Ok(Wanted {
            url,
            digest,
            filename: tarball_file(name, version),
            // npm lists no tarball size: the download's hard cap bounds it.
            size: None,
        })
    }

    fn cached(&self, name: &str, corgi: bool) -> Option<Arc<Packument>> {
        let packuments = self.packuments.lock();
        let (at, packument) = packuments.get(&(name.to_owned(), corgi))?;
        (at.elapsed() < PACKUMENT_TTL).then(|| packument.clone())
    }

    /// The upstream packument of `name` (cached for [`PACKUMENT_TTL`]); `None` if upstream
    /// has no such package.
    async fn fetch(&self, name: &str, corgi: bool) -> Result<Option<Arc<Packument>>, NpmError> {
        if let Some(packument) = self.cached(name, corgi) {
            return Ok(Some(packument));
        }
        let _slot = tokio::time::timeout(PACKUMENT_TIMEOUT, self.fetches.acquire())
            .await
            .map_err(|_| {
                NpmError::Index(IndexError::Busy(format!(
                    "all {MAX_FETCHES} packument fetches stayed busy for {} s",
                    PACKUMENT_TIMEOUT.as_secs()
                )))
            })?
            // Never closed.
            .map_err(|_| NpmError::Index(IndexError::Busy("shutting down".to_owned())))?;
        // Whoever held the slot before may have fetched this very packument.
        if let Some(packument) = self.cached(name, corgi) {
            return Ok(Some(packument));
        }
        // Scoped names go as `@scope%2fname`, as npm sends them.
        let url = format!(
            "{}/{}",
            self.config.upstream.trim_end_matches('/'),
            name.replace('/', "%2f")
        );
        let upstream_err = |reason: String| NpmError::Upstream {
            url: url.clone(),
            reason,
        };
        let accept = if corgi {
            "application/vnd.npm.install-v1+json; q=1.0, application/json; q=0.8"
        } else {
            "application/json"
        };
        let fetched = tokio::time::timeout(PACKUMENT_TIMEOUT, async {
            let mut response = self
                .client
                .get(&url)
                .header(reqwest::header::ACCEPT, accept)
                .send()
                .await
                .map_err(|e| upstream_err(e.to_string()))?;
            if response.status() == reqwest::StatusCode::NOT_FOUND {
                return Ok(None);
            }
            if !response.status().is_success() {
                return Err(upstream_err(response.status().to_string()));
            }
            if response
                .content_length()
                .is_some_and(|l| l > MAX_PACKUMENT_BYTES as u64)
            {
                return Err(upstream_err(format!(
                    "the packument is larger than {MAX_PACKUMENT_BYTES} bytes"
                )));
            }
            let mut bytes = Vec::new();
            while let Some(chunk) = response
                .chunk()
                .await
                .map_err(|e| upstream_err(e.to_string()))?
            {
                if bytes.len() + chunk.len() > MAX_PACKUMENT_BYTES {
                    return Err(upstream_err(format!(
                        "the packument is larger than {MAX_PACKUMENT_BYTES} bytes"
                    )));
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(Some(bytes))
        })
        .await
        .map_err(|_| upstream_err(format!("no packument within {PACKUMENT_TIMEOUT:?}")))??;
        let Some(bytes) = fetched else {
            return Ok(None);
        };
        let size = bytes.len();
        let mut document: Map<String, Value> =
            serde_json::from_slice(&bytes).map_err(|e| upstream_err(e.to_string()))?;
        let object = |document: &mut Map<String, Value>, field: &str| match document.remove(field) {
            Some(Value::Object(map)) => Some(map),
            _ => None,
        };
        let packument = Arc::new(Packument {
            versions: object(&mut document, "versions").unwrap_or_default(),
            dist_tags: object(&mut document, "dist-tags").unwrap_or_default(),
            time: object(&mut document, "time"),
            modified: document.remove("modified"),
            size,
        });
        let mut packuments = self.packuments.lock();
        packuments.insert(
            (name.to_owned(), corgi),
            (Instant::now(), packument.clone()),
        );
        // Within the memory budget: the oldest go first (the new one stays).
        let mut total: usize = packuments.values().map(|(_, p)| p.size).sum();
        let mut by_age: BTreeMap<Instant, (String, bool)> = packuments
            .iter()
            .map(|(k, (at, _))| (*at, k.clone()))
            .collect();
        while total > MAX_CACHED_BYTES && packuments.len() > 1 {
            let Some((_, key)) = by_age.pop_first() else {
                break;
            };
            if let Some((_, gone)) = packuments.remove(&key) {
                total -= gone.size;
            }
        }
        Ok(Some(packument))
    }
}

/// What a session whose policy has `rules` is served of `name`'s upstream packument: the
/// allowed versions that have a sha512 integrity on upstream's origin, their tarballs on this
/// registry, the dist-tags that point at them (`latest` the highest allowed release if
/// upstream's is not allowed), their `time` entries. Borrowed from the cached packument and
/// serialised straight from it: a full packument's version documents run to tens of MB,
/// and copying them for every request would cost that much memory per request.
struct Served<'a> {
    name: &'a str,
    packument: &'a Packument,
    /// Version, its upstream document, its integrity; in upstream's order.
    versions: Vec<(&'a String, &'a Map<String, Value>, String)>,
    dist_tags: Map<String, Value>,
    /// The names the served versions depend on (for denial messages).
    dependencies: Vec<String>,
}

fn served<'a>(
    name: &'a str,
    rules: &NpmRules,
    packument: &'a Packument,
    upstream: &str,
) -> Served<'a> {
    let mut versions = vec![];
    let mut dependencies = vec![];
    for (version, info) in &packument.versions {
        if !rules.allows(name, version) {
            continue;
        }
        let (Some((_, _, integrity)), Some(object)) = (dist_of(info, upstream), info.as_object())
        else {
            continue;
        };
        for field in ["dependencies", "optionalDependencies", "peerDependencies"] {
            if let Some(deps) = object.get(field).and_then(Value::as_object) {
                dependencies.extend(deps.keys().cloned());
            }
        }
        versions.push((version, object, integrity));
    }
    let listed = |v: &str| versions.iter().any(|(version, _, _)| version.as_str() == v);
    let mut dist_tags: Map<String, Value> = packument
        .dist_tags
        .iter()
        .filter(|(_, v)| v.as_str().is_some_and(listed))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !dist_tags.contains_key("latest") {
        let all = || versions.iter().map(|(v, _, _)| *v);
        let releases = all().filter(|v| semver::Version::parse(v).is_ok_and(|v| v.pre.is_empty()));
        if let Some(latest) = highest(releases).or_else(|| highest(all())) {
            dist_tags.insert("latest".to_owned(), latest.clone().into());
        }
    }
    Served {
        name,
        packument,
        versions,
        dist_tags,
        dependencies,
    }
}

impl Serialize for Served<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("name", self.name)?;
        map.serialize_entry("dist-tags", &self.dist_tags)?;
        if let Some(time) = &self.packument.time {
            let served_time: BTreeMap<&String, &Value> = time
                .iter()
                .filter(|(k, _)| {
                    *k == "created"
                        || *k == "modified"
                        || self.versions.iter().any(|(v, _, _)| v == k)
                })
                .collect();
            map.serialize_entry("time", &served_time)?;
        }
        if let Some(modified) = &self.packument.modified {
            map.serialize_entry("modified", modified)?;
        }
        map.serialize_entry("versions", &ServedVersions(self))?;
        map.end()
    }
}

/// The `versions` object of a [`Served`] packument.
struct ServedVersions<'a>(&'a Served<'a>);

impl Serialize for ServedVersions<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let served = self.0;
        let mut map = serializer.serialize_map(Some(served.versions.len()))?;
        for (version, document, integrity) in &served.versions {
            map.serialize_entry(
                version,
                &ServedVersion {
                    name: served.name,
                    version,
                    document,
                    integrity,
                },
            )?;
        }
        map.end()
    }
}

/// One version's document as served: upstream's, with the key's `version` (the document
/// must not say another) and a `dist` naming this registry's tarball and the integrity.
struct ServedVersion<'a> {
    name: &'a str,
    version: &'a str,
    document: &'a Map<String, Value>,
    integrity: &'a str,
}

impl Serialize for ServedVersion<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        for (key, value) in self.document {
            if key != "version" && key != "dist" {
                map.serialize_entry(key, value)?;
            }
        }
        map.serialize_entry("version", self.version)?;
        map.serialize_entry(
            "dist",
            &serde_json::json!({
                "tarball": format!("http://{NPM_HOST}/{}/-/{}", self.name, tarball_file(self.name, self.version)),
                "integrity": self.integrity,
            }),
        )?;
        map.end()
    }
}

/// The answer to a failure: 404 for a version upstream lacks (or gives no sha512 for), 503
/// with `Retry-After` while busy, else as a failed file is answered (502, 507).
fn error_response(err: &NpmError) -> Response<Body> {
    match err {
        NpmError::Index(err) => super::file_error("cellgate npm registry", err),
        NpmError::Version { .. } => npm_error(
            StatusCode::NOT_FOUND,
            &format!("cellgate npm registry: {err}"),
        ),
        NpmError::Upstream { .. } => npm_error(
            StatusCode::BAD_GATEWAY,
            &format!("cellgate npm registry: {err}"),
        ),
    }
}

/// An npm-style error: `{"error": message}` (npm prints it; Deno names the status).
fn npm_error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(
        status,
        "application/json",
        &serde_json::json!({ "error": message }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        assert_eq!(
            parse_path("/lodash"),
            Some(Asked::Packument("lodash".into()))
        );
        assert_eq!(
            parse_path("/@Std%2FPath"),
            Some(Asked::Packument("@Std/Path".into())),
            "spelt as asked (the policy ignores case, upstream does not)"
        );
        assert_eq!(
            parse_path("/JSONStream/-/JSONStream-1.3.5.tgz"),
            Some(Asked::Tarball(
                "JSONStream".into(),
                "JSONStream-1.3.5.tgz".into()
            ))
        );
        assert_eq!(
            parse_path("/@std/path"),
            Some(Asked::Packument("@std/path".into()))
        );
        assert_eq!(
            parse_path("/%40std%2fpath"),
            Some(Asked::Packument("@std/path".into()))
        );
        assert_eq!(
            parse_path("/@std/path/-/path-1.0.0.tgz"),
            Some(Asked::Tarball("@std/path".into(), "path-1.0.0.tgz".into()))
        );
        assert_eq!(
            parse_path("/lodash/-/lodash-4.17.21.tgz"),
            Some(Asked::Tarball("lodash".into(), "lodash-4.17.21.tgz".into()))
        );
        for bad in [
            "/",
            "/-/v1/search",
            "/a/b",
            "/../etc",
            "/x/-/../y.tgz",
            "/x/-/y",
        ] {
            assert_eq!(parse_path(bad), None, "{bad}");
        }
        assert_eq!(
            tarball_version("@std/path", "path-1.0.0-rc.1.tgz").as_deref(),
            Some("1.0.0-rc.1")
        );
        assert_eq!(tarball_version("lodash", "other-1.0.0.tgz"), None);
        assert_eq!(tarball_version("lodash", "lodash-.tgz"), None);
    }

    #[test]
    fn integrity() {
        use sha2::{Digest, Sha512};
        let digest = Sha512::digest(b"x");
        let b64 = base64::engine::general_purpose::STANDARD.encode(digest);
        let want = FileDigest::Sha512(hex::encode(digest));
        assert_eq!(sha512_of(&format!("sha512-{b64}")), Some(want.clone()));
        assert_eq!(sha512_of(&format!("sha1-AAAA sha512-{b64}")), Some(want));
        assert_eq!(sha512_of("sha1-2jmj7l5rSw0yVb/vlWAYkK/YBwk="), None);
        assert_eq!(sha512_of("sha512-short"), None);
        let version = serde_json::json!({"dist": {"tarball": "file:///etc/passwd", "integrity": format!("sha512-{b64}")}});
        let upstream = "https://registry.example";
        assert!(
            dist_of(&version, upstream).is_none(),
            "http(s) tarballs only"
        );
        let at = |url: &str| serde_json::json!({"dist": {"tarball": url, "integrity": format!("sha512-{b64}")}});
        assert!(dist_of(&at("https://registry.example/x/-/x-1.tgz"), upstream).is_some());
        assert!(dist_of(&at("https://REGISTRY.example:443/x/-/x-1.tgz"), upstream).is_some());
        for elsewhere in [
            "https://169.254.169.254/latest/meta-data",
            "http://registry.example/x/-/x-1.tgz",
            "https://registry.example:8443/x/-/x-1.tgz",
            "https://registry.example.evil/x/-/x-1.tgz",
            "https://user@registry.example/x/-/x-1.tgz",
        ] {
            assert!(dist_of(&at(elsewhere), upstream).is_none(), "{elsewhere}");
        }
    }

    #[test]
    fn packuments_show_only_allowed_verified_versions() {
        use sha2::{Digest, Sha512};
        let sri = format!(
            "sha512-{}",
            base64::engine::general_purpose::STANDARD.encode(Sha512::digest(b"t"))
        );
        let version = |v: &str, integrity: Option<&str>| {
            let mut dist = serde_json::json!({"tarball": format!("https://up.example/x/-/x-{v}.tgz"), "shasum": "00"});
            if let Some(i) = integrity {
                dist["integrity"] = i.into();
            }
            serde_json::json!({"name": "x", "version": v, "dist": dist, "dependencies": {format!("dep-{v}"): "*"}})
        };
        let mut versions = Map::new();
        versions.insert("1.0.0".into(), version("1.0.0", Some(&sri)));
        versions.insert("1.1.0".into(), version("1.1.0", None));
        versions.insert("2.0.0".into(), version("2.0.0", Some(&sri)));
        versions.insert("3.0.0-beta.1".into(), version("3.0.0-beta.1", Some(&sri)));
        // A document that names another version than its key.
        versions.insert("1.2.0".into(), {
            let mut v = version("1.2.0", Some(&sri));
            v["version"] = "2.0.0".into();
            v
        });
        // A tarball off upstream's origin.
        versions.insert("1.3.0".into(), {
            let mut v = version("1.3.0", Some(&sri));
            v["dist"]["tarball"] = "http://10.0.0.1/x-1.3.0.tgz".into();
            v
        });
        let packument = Packument {
            modified: None,
            dist_tags: serde_json::json!({"latest": "2.0.0", "next": "3.0.0-beta.1"})
                .as_object()
                .cloned()
                .unwrap(),
            versions,
            time: serde_json::json!({"created": "c", "1.0.0": "t1", "2.0.0": "t2"})
                .as_object()
                .cloned(),
            size: 0,
        };
        let rules = NpmRules::parse(&["X@^1 || 3.0.0-beta.1".into()]).unwrap();
        let serve = |name: &str, rules: &NpmRules| {
            let served = served(name, rules, &packument, "https://up.example");
            (serde_json::to_value(&served).unwrap(), served.dependencies)
        };
        let (body, deps) = serve("x", &rules);
        let versions = body["versions"].as_object().unwrap();
        let mut listed: Vec<&String> = versions.keys().collect();
        listed.sort();
        assert_eq!(
            listed,
            ["1.0.0", "1.2.0", "3.0.0-beta.1"],
            "no 2.0.0; no 1.1.0 (SHA-1 only); no 1.3.0 (tarball elsewhere)"
        );
        assert_eq!(versions["1.2.0"]["version"], "1.2.0");
        assert_eq!(
            versions["1.0.0"]["dist"],
            serde_json::json!({"tarball": "http://npm.cellgate.internal/x/-/x-1.0.0.tgz", "integrity": sri})
        );
        assert_eq!(
            body["dist-tags"],
            serde_json::json!({"latest": "1.2.0", "next": "3.0.0-beta.1"}),
            "latest: the highest allowed release"
        );
        assert_eq!(
            body["time"],
            serde_json::json!({"created": "c", "1.0.0": "t1"})
        );
        let mut deps = deps;
        deps.sort();
        assert_eq!(deps, ["dep-1.0.0", "dep-1.2.0", "dep-3.0.0-beta.1"]);
        // A package none of whose versions is allowed: an empty document, no latest.
        let rules = NpmRules::parse(&["x@^9".into()]).unwrap();
        let (body, _) = serve("x", &rules);
        assert_eq!(body["versions"], serde_json::json!({}));
        assert_eq!(body["dist-tags"], serde_json::json!({}));
        // Scoped: the tarball's path keeps the scope, its file name does not.
        let rules = NpmRules::parse(&["@s/x".into()]).unwrap();
        let (body, _) = serve("@s/x", &rules);
        assert_eq!(
            body["versions"]["2.0.0"]["dist"]["tarball"],
            "http://npm.cellgate.internal/@s/x/-/x-2.0.0.tgz"
        );
    }
}
