//! The package index cellgate serves to sandboxes: PEP 503 (HTML) and PEP 691 (JSON) simple
//! API, listing only what the session's policy allows (project names normalised per PEP 503;
//! the policy's PEP 440 specifiers, such as `>=1.2,!=1.3.*`, compared by `pep440_rs`, filter
//! the files).
//!
//! Reached by pip inside the sandbox as `http://packages.cellgate.internal/simple/` through
//! the egress proxy (the proxy hands those requests here, whatever the egress rules say).
//! Files come from an upstream simple index (PEP 691 JSON; `--package-index`, default PyPI)
//! or, offline, from a wheelhouse directory (`--wheelhouse`). Upstream files stream to pip
//! as they download, once however many sessions ask (`download.rs`), into a shared on-disk
//! cache named by their sha256, kept only when the download's hash matched the index's;
//! every file is served under `/files/<sha256>/<filename>` with its `Content-Length` (so
//! pip draws a progress bar, which API v1 collapses to one line), and every file request
//! asks the policy again: a session gets a file only if its policy allows the file's
//! project and version, so knowing another tenant's hash opens nothing.
//!
//! Downloads are bounded (`download.rs` has the limits): a session waits or downloads at
//! most [`MAX_SESSION_FLIGHTS`] files at once and a file waits at most
//! `download::SLOT_WAIT` (30 s) for a download slot (both then answer 503 with `Retry-After`,
//! which pip retries), a download stops when its last client hangs up, and a `HEAD`
//! never starts one.
//!
//! A project the policy does not list answers 404 (pip fails at once: "no matching
//! distribution") and a denial naming the project and the policy is attached to the running
//! execution; when pip asks for it right after fetching an allowed project, the denial says
//! it is a dependency of that project. With `dependencies = "implicit"` the index also
//! serves the projects declared in `Requires-Dist` of the allowed wheels the session fetched
//! (`wheel.rs` reads them, recorded before pip gets the wheel's last byte).
//!
//! Part of the egress proxy (it is the proxy's one built-in upstream, served under
//! [`super::INDEX_HOST`]). Must not depend on: kernels (it reports through [`super::Session`]).

mod download;
pub mod npm;
mod wheel;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use parking_lot::Mutex;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use download::{DownloadError, Downloads, FileBody, FileDigest, Joined, State, Wanted};

use super::proxy::{text, Body};
use super::Session;
use crate::policy::access::{normalize_project, PackageRule};
use crate::policy::DenialKind;
use crate::policy::Dependencies;

/// Where files come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A PEP 691 simple index, e.g. `https://pypi.org/simple`.
    Upstream(String),
    /// A directory of wheels and sdists (offline mode).
    Wheelhouse(PathBuf),
}

/// Settings of the index.
#[derive(Debug, Clone)]
pub struct IndexConfig {
    pub source: Source,
    /// The shared cache of upstream files (created 0700).
    pub cache_dir: PathBuf,
}

/// Errors of the index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("upstream index {url}: {reason}")]
    Upstream { url: String, reason: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Download(#[from] DownloadError),
    /// Try again later (answered 503 with `Retry-After`).
    #[error("{0}")]
    Busy(String),
}

/// Downloads one session may wait for or run at once: enough for pip (which fetches one
/// file at a time) and a few cells installing side by side, too few for one kernel to
/// queue ahead of every other tenant.
pub const MAX_SESSION_FLIGHTS: usize = 8;
/// Seconds a client told 503 is asked to wait before it retries.
const RETRY_AFTER_SECS: u32 = 10;

/// Per-session state of the index.
#[derive(Debug)]
pub struct SessionPackages {
    /// Projects declared as dependencies by allowed wheels this session fetched (used when
    /// the policy's dependencies are implicit).
    pub implied: HashSet<String>,
    /// The last allowed project whose file this session fetched, with the execution.
    pub last_allowed: Option<(String, Option<String>)>,
    /// npm packages declared as dependencies by the allowed versions of packuments this
    /// session was served, with the package that declared each (for denial messages).
    pub npm_dependents: HashMap<String, String>,
    /// [`MAX_SESSION_FLIGHTS`] permits, one held by each body of this session following a
    /// download that is not over.
    flights: Arc<tokio::sync::Semaphore>,
}

impl Default for SessionPackages {
    fn default() -> SessionPackages {
        SessionPackages {
            implied: HashSet::new(),
            last_allowed: None,
            npm_dependents: HashMap::new(),
            flights: Arc::new(tokio::sync::Semaphore::new(MAX_SESSION_FLIGHTS)),
        }
    }
}

/// One distribution file.
#[derive(Debug, Clone)]
struct FileEntry {
    project: String,
    version: String,
    filename: String,
    sha256: String,
    /// The file's size as the upstream index lists it (PEP 700), if it does.
    size: Option<u64>,
    requires_python: Option<String>,
    yanked: bool,
    origin: Origin,
}

#[derive(Debug, Clone)]
enum Origin {
    Url(String),
    Path(PathBuf),
}

/// The index of a gateway, shared by every session.
pub struct PackageIndex {
    config: IndexConfig,
    client: reqwest::Client,
    /// Files listed to some session, by sha256.
    files: Mutex<HashMap<String, FileEntry>>,
    /// Wheelhouse hashes by (path, size, mtime).
    local_hashes: Mutex<HashMap<(PathBuf, u64, i64), String>>,
    /// Upstream files: cached, or downloading for whoever asks.
    downloads: Arc<Downloads>,
    /// Upstream listings, by project, for [`LISTING_TTL`]: an install of a cached wheel
    /// should not wait for the upstream index each time.
    listings: Mutex<HashMap<String, (std::time::Instant, Vec<FileEntry>)>>,
}

/// How long an upstream project listing is reused.
const LISTING_TTL: std::time::Duration = std::time::Duration::from_secs(300);
/// Upstream listings kept at most (the oldest go first).
const MAX_LISTINGS: usize = 1024;
/// The most an upstream listing may take in all (files have a stall timeout only).
const LISTING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

#[derive(Deserialize)]
struct UpstreamProject {
    files: Vec<UpstreamFile>,
}

#[derive(Deserialize)]
struct UpstreamFile {
    filename: String,
    url: String,
    #[serde(default)]
    hashes: HashMap<String, String>,
    /// PEP 700 (API 1.1); older indexes leave it out.
    #[serde(default)]
    size: Option<u64>,
    #[serde(rename = "requires-python")]
    requires_python: Option<String>,
    #[serde(default)]
    yanked: serde_json::Value,
}

/// Project and version from a distribution's file name (wheel or sdist).
pub fn parse_filename(filename: &str) -> Option<(String, String)> {
    if let Some(stem) = filename.strip_suffix(".whl") {
        let mut parts = stem.split('-');
        let name = parts.next()?;
        let version = parts.next()?;
        return Some((normalize_project(name), version.to_owned()));
    }
    let stem = [".tar.gz", ".zip", ".tar.bz2"]
        .iter()
        .find_map(|ext| filename.strip_suffix(ext))?;
    let (name, version) = stem.rsplit_once('-')?;
    Some((normalize_project(name), version.to_owned()))
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut response = Response::new(Full::new(body.into()).map_err(|n| match n {}).boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

const JSON_TYPE: &str = "application/vnd.pypi.simple.v1+json";

impl PackageIndex {
    pub fn new(config: IndexConfig) -> Result<Arc<PackageIndex>, IndexError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&config.cache_dir)
            .map_err(|source| IndexError::Io {
                what: format!("create {}", config.cache_dir.display()),
                source,
            })?;
        for stale in download::stale_temporaries(&config.cache_dir) {
            let _ = std::fs::remove_file(stale);
        }
        // A read (stall) timeout and no total one: a large wheel on a slow link takes as
        // long as it takes while bytes move. Listings add a total timeout of their own.
        let client = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .read_timeout(download::STALL)
            .user_agent(concat!("cellgate/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| IndexError::Upstream {
                url: String::new(),
                reason: e.to_string(),
            })?;
        let downloads = Downloads::new(client.clone(), config.cache_dir.clone());
        Ok(Arc::new(PackageIndex {
            config,
            client,
            files: Mutex::new(HashMap::new()),
            local_hashes: Mutex::new(HashMap::new()),
            downloads,
            listings: Mutex::new(HashMap::new()),
        }))
    }

    pub fn source(&self) -> &Source {
        &self.config.source
    }

    /// Whether the upstream index answers (for `cellgate doctor`): its root listing.
    pub async fn probe(&self) -> Result<String, IndexError> {
        match &self.config.source {
            Source::Wheelhouse(dir) => {
                let n = std::fs::read_dir(dir)
                    .map_err(|source| IndexError::Io {
                        what: format!("read {}", dir.display()),
                        source,
                    })?
                    .count();
                Ok(format!("wheelhouse {} ({n} files)", dir.display()))
            }
            Source::Upstream(url) => {
                let probe = format!("{}/pip/", url.trim_end_matches('/'));
                let response = self
                    .client
                    .get(&probe)
                    .header("Accept", JSON_TYPE)
                    .timeout(std::time::Duration::from_secs(10))
                    .send()
                    .await
                    .map_err(|e| IndexError::Upstream {
                        url: probe.clone(),
                        reason: e.to_string(),
                    })?;
                if !response.status().is_success() {
                    return Err(IndexError::Upstream {
                        url: probe,
                        reason: response.status().to_string(),
                    });
                }
                Ok(format!("upstream {url} answers"))
            }
        }
    }

    /// Answers one request for `packages.cellgate.internal`.
    pub async fn handle(&self, session: &Arc<Session>, req: Request<Incoming>) -> Response<Body> {
        if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "the package index is read-only",
            );
        }
        let json = req
            .headers()
            .get(hyper::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains(JSON_TYPE));
        let head = req.method() == hyper::Method::HEAD;
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match segments.as_slice() {
            ["simple"] => self.root(session, json),
            ["simple", project] => self.project(session, project, json).await,
            ["files", sha, filename] => self.file(session, sha, filename, head).await,
            _ => text(StatusCode::NOT_FOUND, "cellgate index: no such page"),
        }
    }

    fn root(&self, session: &Session, json: bool) -> Response<Body> {
        let names: Vec<&str> = session
            .policy
            .packages
            .allow
            .iter()
            .map(|r| r.project.as_str())
            .collect();
        if json {
            let body = serde_json::json!({
                "meta": {"api-version": "1.0"},
                "projects": names.iter().map(|n| serde_json::json!({"name": n})).collect::<Vec<_>>(),
            });
            return respond(StatusCode::OK, JSON_TYPE, body.to_string());
        }
        let mut html = String::from("<!DOCTYPE html><html><body>\n");
        for name in names {
            html.push_str(&format!("<a href=\"/simple/{name}/\">{name}</a>\n"));
        }
        html.push_str("</body></html>\n");
        respond(StatusCode::OK, "text/html", html)
    }

    /// The rule that lets this session see `project`, or the denial's reason.
    fn permission(&self, session: &Session, project: &str) -> Result<Option<PackageRule>, String> {
        let packages = &session.policy.packages;
        if let Some(rule) = packages.rule(project) {
            return Ok(Some(rule.clone()));
        }
        let state = session.packages.lock();
        if packages.dependencies == Dependencies::Implicit && state.implied.contains(project) {
            return Ok(None);
        }
        let mut reason = format!(
            "package '{project}' is not allowed by policy '{}'",
            session.policy.name
        );
        let running = session.msg_id();
        if let Some((parent, _)) = state
            .last_allowed
            .as_ref()
            .filter(|(_, at)| at.is_some() && *at == running)
        {
            reason.push_str(&format!(
                " (pip asked for it as a dependency of '{parent}'; the policy's dependencies are {}: list it in [packages] allow)",
                match packages.dependencies {
                    Dependencies::Explicit => "explicit",
                    Dependencies::Implicit => "implicit, but no allowed wheel declared it",
                }
            ));
        }
        Err(reason)
    }

    async fn project(&self, session: &Session, raw: &str, json: bool) -> Response<Body> {
        let project = normalize_project(raw);
        let rule = match self.permission(session, &project) {
            Ok(rule) => rule,
            Err(reason) => {
                session.deny(DenialKind::Package, &project, reason.clone());
                return text(StatusCode::NOT_FOUND, format!("cellgate: {reason}"));
            }
        };
        let files = match self.list(&project).await {
            Ok(files) => files,
            Err(err) => {
                tracing::warn!(kernel_id = %session.kernel_id, project, %err, "package index: upstream failed");
                return text(StatusCode::BAD_GATEWAY, format!("cellgate index: {err}"));
            }
        };
        let files: Vec<FileEntry> = files
            .into_iter()
            .filter(|f| rule.as_ref().is_none_or(|r| r.version_matches(&f.version)))
            .collect();
        session.allow(
            "package",
            &project,
            &format!("{} files listed", files.len()),
        );
        {
            let mut known = self.files.lock();
            for f in &files {
                known.insert(f.sha256.clone(), f.clone());
            }
        }
        if json {
            let body = serde_json::json!({
                "meta": {"api-version": "1.0"},
                "name": project,
                "files": files.iter().map(|f| {
                    let mut entry = serde_json::json!({
                        "filename": f.filename,
                        "url": format!("/files/{}/{}", f.sha256, f.filename),
                        "hashes": {"sha256": f.sha256},
                    });
                    if let Some(rp) = &f.requires_python {
                        entry["requires-python"] = rp.clone().into();
                    }
                    if f.yanked {
                        entry["yanked"] = true.into();
                    }
                    entry
                }).collect::<Vec<_>>(),
            });
            return respond(StatusCode::OK, JSON_TYPE, body.to_string());
        }
        let mut html = format!("<!DOCTYPE html><html><body><h1>{project}</h1>\n");
        for f in &files {
            let rp = f
                .requires_python
                .as_ref()
                .map(|r| format!(" data-requires-python=\"{}\"", html_escape(r)))
                .unwrap_or_default();
            let yanked = if f.yanked { " data-yanked=\"\"" } else { "" };
            html.push_str(&format!(
                "<a href=\"/files/{sha}/{name}#sha256={sha}\"{rp}{yanked}>{name}</a>\n",
                sha = f.sha256,
                name = html_escape(&f.filename)
            ));
        }
        html.push_str("</body></html>\n");
        respond(StatusCode::OK, "text/html", html)
    }

    /// Every file of a project at the source (unfiltered).
    async fn list(&self, project: &str) -> Result<Vec<FileEntry>, IndexError> {
        match &self.config.source {
            Source::Wheelhouse(dir) => {
                let dir = dir.clone();
                let project = project.to_owned();
                let entries = std::fs::read_dir(&dir).map_err(|source| IndexError::Io {
                    what: format!("read {}", dir.display()),
                    source,
                })?;
                let mut files = vec![];
                for entry in entries.flatten() {
                    let filename = entry.file_name().to_string_lossy().into_owned();
                    let Some((name, version)) = parse_filename(&filename) else {
                        continue;
                    };
                    if name != project {
                        continue;
                    }
                    let path = entry.path();
                    let sha256 = self.local_hash(&path)?;
                    files.push(FileEntry {
                        project: name,
                        version,
                        filename,
                        sha256,
                        size: None,
                        requires_python: None,
                        yanked: false,
                        origin: Origin::Path(path),
                    });
                }
                files.sort_by(|a, b| a.filename.cmp(&b.filename));
                Ok(files)
            }
            Source::Upstream(base) => {
                if let Some((at, files)) = self.listings.lock().get(project) {
                    if at.elapsed() < LISTING_TTL {
                        return Ok(files.clone());
                    }
                }
                let files = self.list_upstream(base, project).await?;
                let mut listings = self.listings.lock();
                if listings.len() >= MAX_LISTINGS {
                    if let Some(oldest) = listings
                        .iter()
                        .min_by_key(|(_, (at, _))| *at)
                        .map(|(k, _)| k.clone())
                    {
                        listings.remove(&oldest);
                    }
                }
                listings.insert(
                    project.to_owned(),
                    (std::time::Instant::now(), files.clone()),
                );
                Ok(files)
            }
        }
    }

    async fn list_upstream(&self, base: &str, project: &str) -> Result<Vec<FileEntry>, IndexError> {
        let url = format!("{}/{project}/", base.trim_end_matches('/'));
        let upstream_err = |reason: String| IndexError::Upstream {
            url: url.clone(),
            reason,
        };
        let response = self
            .client
            .get(&url)
            .header("Accept", JSON_TYPE)
            .timeout(LISTING_TIMEOUT)
            .send()
            .await
            .map_err(|e| upstream_err(e.to_string()))?;
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(vec![]);
        }
        if !response.status().is_success() {
            return Err(upstream_err(response.status().to_string()));
        }
        let base_url = response.url().clone();
        let listing: UpstreamProject = response
            .json()
            .await
            .map_err(|e| upstream_err(e.to_string()))?;
        let mut files = vec![];
        for f in listing.files {
            let (Some(sha256), Some((name, version))) =
                (f.hashes.get("sha256"), parse_filename(&f.filename))
            else {
                continue;
            };
            if name != project
                || sha256.len() != 64
                || !sha256.chars().all(|c| c.is_ascii_hexdigit())
            {
                continue;
            }
            let Ok(url) = base_url.join(&f.url) else {
                continue;
            };
            files.push(FileEntry {
                project: name,
                version,
                filename: f.filename,
                sha256: sha256.to_ascii_lowercase(),
                size: f.size,
                requires_python: f.requires_python,
                yanked: !matches!(
                    f.yanked,
                    serde_json::Value::Bool(false) | serde_json::Value::Null
                ),
                origin: Origin::Url(url.to_string()),
            });
        }
        Ok(files)
    }

    fn local_hash(&self, path: &Path) -> Result<String, IndexError> {
        use std::os::unix::fs::MetadataExt;
        let io = |source| IndexError::Io {
            what: format!("read {}", path.display()),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        let key = (path.to_owned(), meta.len(), meta.mtime());
        if let Some(hash) = self.local_hashes.lock().get(&key) {
            return Ok(hash.clone());
        }
        let hash = sha256_file(path).map_err(io)?;
        self.local_hashes.lock().insert(key, hash.clone());
        Ok(hash)
    }

    async fn file(
        &self,
        session: &Arc<Session>,
        sha: &str,
        filename: &str,
        head: bool,
    ) -> Response<Body> {
        let entry = self.files.lock().get(sha).cloned();
        let Some(entry) = entry.filter(|e| e.filename == filename) else {
            return text(StatusCode::NOT_FOUND, "cellgate index: no such file");
        };
        // The listing a session saw is not a permission: ask the policy again.
        match self.permission(session, &entry.project) {
            Ok(Some(rule)) if !rule.version_matches(&entry.version) => {
                let reason = format!(
                    "package '{}' version {} is not allowed by policy '{}'",
                    entry.project, entry.version, session.policy.name
                );
                session.deny(DenialKind::Package, &entry.project, reason.clone());
                return text(StatusCode::FORBIDDEN, format!("cellgate: {reason}"));
            }
            Ok(_) => {}
            Err(reason) => {
                session.deny(DenialKind::Package, &entry.project, reason.clone());
                return text(StatusCode::FORBIDDEN, format!("cellgate: {reason}"));
            }
        }
        if head {
            return self.head(&entry);
        }
        let mut body = match self.open(session, &entry).await {
            Ok(body) => body,
            Err(err) => {
                tracing::warn!(kernel_id = %session.kernel_id, file = %entry.filename, %err, "package index: file failed");
                return file_error("cellgate index", &err);
            }
        };
        if session.policy.packages.dependencies == Dependencies::Implicit
            && entry.filename.ends_with(".whl")
        {
            // Before pip has the whole wheel, so before it can ask for a dependency.
            let session = session.clone();
            body.on_complete = Some(Box::new(move |file| {
                let requires = wheel::requirements(file);
                session.packages.lock().implied.extend(requires);
            }));
        }
        let length = body.progress.as_ref().map_or(Some(body.length), |rx| {
            let progress = rx.borrow();
            match progress.state {
                State::Done => Some(progress.written),
                _ => progress.length,
            }
        });
        session.packages.lock().last_allowed = Some((entry.project.clone(), session.msg_id()));
        session.allow("package", &entry.project, &entry.filename);
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

    /// `HEAD` of a file, answered from what is known: it never starts a download (a client
    /// that asks only for headers would leave one behind). The length of the wheelhouse's
    /// or the cache's file, else the listed size, else no length.
    fn head(&self, entry: &FileEntry) -> Response<Body> {
        let length = match &entry.origin {
            Origin::Path(path) => std::fs::metadata(path).ok().map(|m| m.len()),
            Origin::Url(_) => self
                .downloads
                .cached_length(&FileDigest::Sha256(entry.sha256.clone()))
                .or(entry.size),
        };
        let mut response = respond(StatusCode::OK, "application/octet-stream", Bytes::new());
        if let Some(length) = length {
            response
                .headers_mut()
                .insert(hyper::header::CONTENT_LENGTH, length.into());
        }
        response
    }

    /// The file's bytes: the wheelhouse's whole, or the upstream file's ([`follow`]).
    async fn open(&self, session: &Session, entry: &FileEntry) -> Result<FileBody, IndexError> {
        let url = match &entry.origin {
            Origin::Path(path) => {
                let file = std::fs::File::open(path).map_err(|source| IndexError::Io {
                    what: format!("read {}", path.display()),
                    source,
                })?;
                return whole(file, path);
            }
            Origin::Url(url) => url,
        };
        let wanted = Wanted {
            url: url.clone(),
            digest: FileDigest::Sha256(entry.sha256.clone()),
            filename: entry.filename.clone(),
            size: entry.size,
        };
        follow(&self.downloads, session, wanted).await
    }
}

/// The response to a file that cannot be served: 503 with `Retry-After` when busy (pip and
/// Deno retry), 507 when the cache's disk is full, else 502.
fn file_error(who: &str, err: &IndexError) -> Response<Body> {
    let status = match err {
        IndexError::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
        IndexError::Download(DownloadError::DiskFull { .. }) => StatusCode::INSUFFICIENT_STORAGE,
        _ => StatusCode::BAD_GATEWAY,
    };
    let mut response = text(status, format!("{who}: {err}"));
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(hyper::header::RETRY_AFTER, RETRY_AFTER_SECS.into());
    }
    response
}

/// A file served whole from an open file.
fn whole(file: std::fs::File, what: &Path) -> Result<FileBody, IndexError> {
    let length = file
        .metadata()
        .map_err(|source| IndexError::Io {
            what: format!("read {}", what.display()),
            source,
        })?
        .len();
    Ok(FileBody {
        file: Arc::new(file),
        length,
        progress: None,
        on_complete: None,
        flight: None,
        session_slot: None,
    })
}

/// An upstream file's bytes for `session`: the cache's whole, or a download's as they
/// arrive (once upstream answered, so that its length is known). A download counts against
/// the session's [`MAX_SESSION_FLIGHTS`] and waits at most [`download::SLOT_WAIT`] for a
/// slot ([`IndexError::Busy`] past either). Shared by the PyPI index and the npm registry,
/// so that both draw on the same slots, cache and limits.
async fn follow(
    downloads: &Arc<Downloads>,
    session: &Session,
    wanted: Wanted,
) -> Result<FileBody, IndexError> {
    let cached = downloads.path_of(&wanted.digest);
    if let Some(file) = downloads.cached_file(&wanted.digest).await {
        return whole(file, &cached);
    }
    let session_slot = session
        .packages
        .lock()
        .flights
        .clone()
        .try_acquire_owned()
        .map_err(|_| {
            IndexError::Busy(format!(
                "this session already waits for or runs {MAX_SESSION_FLIGHTS} package downloads"
            ))
        })?;
    let flight = match downloads.join(wanted)? {
        Joined::Flight(flight) => flight,
        Joined::Cached(file) => return whole(file, &cached),
    };
    // From here, returning early drops `flight`: if no other client holds it, the
    // download is dropped (queued) or stopped (running).
    let mut progress = flight.progress.clone();
    let abandoned = || IndexError::Download(DownloadError::Abandoned);
    tokio::time::timeout(
        download::SLOT_WAIT,
        progress.wait_for(|p| !matches!(p.state, State::Queued)),
    )
    .await
    .map_err(|_| {
        IndexError::Busy(format!(
            "all {} package download slots stayed busy for {} s",
            download::MAX_DOWNLOADS,
            download::SLOT_WAIT.as_secs()
        ))
    })?
    .map_err(|_| abandoned())?;
    // Upstream's headers: bounded by the client's connect and read timeouts.
    let state = progress
        .wait_for(|p| !matches!(p.state, State::Queued | State::Starting))
        .await
        .map(|p| p.state.clone())
        .map_err(|_| abandoned())?;
    if let State::Failed(err) = state {
        return Err(IndexError::Download((*err).clone()));
    }
    // Set before the state left `Starting`.
    let file = progress.borrow().file.clone().ok_or_else(abandoned)?;
    Ok(FileBody {
        file,
        length: 0,
        progress: Some(progress),
        on_complete: None,
        flight: Some(flight),
        session_slot: Some(session_slot),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filenames() {
        assert_eq!(
            parse_filename("Foo_Bar-1.2.3-py3-none-any.whl"),
            Some(("foo-bar".into(), "1.2.3".into()))
        );
        assert_eq!(
            parse_filename("foo-bar-1.0.tar.gz"),
            Some(("foo-bar".into(), "1.0".into()))
        );
        assert_eq!(parse_filename("README"), None);
    }
}
