//! The package index cellgate serves to sandboxes: PEP 503 (HTML) and PEP 691 (JSON) simple
//! API, listing only what the session's policy allows.
//!
//! Reached by pip inside the sandbox as `http://packages.cellgate.internal/simple/` through
//! the egress proxy (the proxy hands those requests here, whatever the egress rules say).
//! Files come from an upstream simple index (PEP 691 JSON; default PyPI) or, offline, from a
//! wheelhouse directory. Upstream files land in a shared on-disk cache named by their sha256,
//! written only after the download's hash matched the index's; every file is served under
//! `/files/<sha256>/<filename>`, and a session gets a file only if its policy allows the
//! file's project and version: knowing another tenant's hash opens nothing.
//!
//! A project the policy does not list answers 404 (pip fails at once: "no matching
//! distribution") and a denial naming the project and the policy is attached to the running
//! execution; when pip asks for it right after fetching an allowed project, the denial says
//! it is a dependency of that project.
//!
//! Part of the egress proxy (it is the proxy's one built-in upstream, served under
//! [`super::INDEX_HOST`]). Must not depend on: kernels (it reports through [`super::Session`]).

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

use super::proxy::{text, Body, BodyError};
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
    #[error("{filename}: sha256 {got} does not match the index's {want}")]
    HashMismatch {
        filename: String,
        got: String,
        want: String,
    },
}

/// Per-session state of the index.
#[derive(Debug, Default)]
pub struct SessionPackages {
    /// Projects declared as dependencies by allowed wheels this session fetched (used when
    /// the policy's dependencies are implicit).
    pub implied: HashSet<String>,
    /// The last allowed project whose file this session fetched, with the execution.
    pub last_allowed: Option<(String, Option<String>)>,
}

/// One distribution file.
#[derive(Debug, Clone)]
struct FileEntry {
    project: String,
    version: String,
    filename: String,
    sha256: String,
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
    /// Cache files whose hash was checked by this process.
    verified: Mutex<HashSet<String>>,
    /// Upstream listings, by project, for [`LISTING_TTL`]: an install of a cached wheel
    /// should not wait for the upstream index each time.
    listings: Mutex<HashMap<String, (std::time::Instant, Vec<FileEntry>)>>,
}

/// How long an upstream project listing is reused.
const LISTING_TTL: std::time::Duration = std::time::Duration::from_secs(300);
/// Upstream listings kept at most (the oldest go first).
const MAX_LISTINGS: usize = 1024;

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
        let client = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .timeout(std::time::Duration::from_secs(120))
            .user_agent(concat!("cellgate/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| IndexError::Upstream {
                url: String::new(),
                reason: e.to_string(),
            })?;
        Ok(Arc::new(PackageIndex {
            config,
            client,
            files: Mutex::new(HashMap::new()),
            local_hashes: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashSet::new()),
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
    pub async fn handle(&self, session: &Session, req: Request<Incoming>) -> Response<Body> {
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
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match segments.as_slice() {
            ["simple"] => self.root(session, json),
            ["simple", project] => self.project(session, project, json).await,
            ["files", sha, filename] => self.file(session, sha, filename).await,
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

    async fn file(&self, session: &Session, sha: &str, filename: &str) -> Response<Body> {
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
        let path = match self.fetch(&entry).await {
            Ok(path) => path,
            Err(err) => {
                tracing::warn!(kernel_id = %session.kernel_id, file = %entry.filename, %err, "package index: file failed");
                return text(StatusCode::BAD_GATEWAY, format!("cellgate index: {err}"));
            }
        };
        let file = match tokio::fs::File::open(&path).await {
            Ok(file) => file,
            Err(err) => {
                return text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cellgate index: {err}"),
                )
            }
        };
        let implied = if session.policy.packages.dependencies == Dependencies::Implicit
            && entry.filename.ends_with(".whl")
        {
            read_small(&path).await.map(|b| wheel_requirements(&b))
        } else {
            None
        };
        {
            let mut state = session.packages.lock();
            state.last_allowed = Some((entry.project.clone(), session.msg_id()));
            state.implied.extend(implied.unwrap_or_default());
        }
        session.allow("package", &entry.project, &entry.filename);
        let mut response = Response::new(stream_file(file));
        response.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/octet-stream"),
        );
        response
    }

    /// The file on disk: the wheelhouse's, or the cache's (downloaded and verified first).
    async fn fetch(&self, entry: &FileEntry) -> Result<PathBuf, IndexError> {
        let url = match &entry.origin {
            Origin::Path(path) => return Ok(path.clone()),
            Origin::Url(url) => url,
        };
        let cached = self.config.cache_dir.join(&entry.sha256);
        if cached.exists() {
            if self.verified.lock().contains(&entry.sha256) {
                return Ok(cached);
            }
            let got = sha256_file(&cached).map_err(|source| IndexError::Io {
                what: format!("read {}", cached.display()),
                source,
            })?;
            if got == entry.sha256 {
                self.verified.lock().insert(got);
                return Ok(cached);
            }
            tracing::warn!(file = %cached.display(), "cached package file is corrupt; fetching it again");
            let _ = std::fs::remove_file(&cached);
        }
        let upstream_err = |reason: String| IndexError::Upstream {
            url: url.clone(),
            reason,
        };
        let response = self
            .client
            .get(url)
            .send()
            .await
            .map_err(|e| upstream_err(e.to_string()))?;
        if !response.status().is_success() {
            return Err(upstream_err(response.status().to_string()));
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|e| upstream_err(e.to_string()))?;
        let got = hex::encode(Sha256::digest(&bytes));
        if got != entry.sha256 {
            return Err(IndexError::HashMismatch {
                filename: entry.filename.clone(),
                got,
                want: entry.sha256.clone(),
            });
        }
        let tmp = self.config.cache_dir.join(format!(
            ".{}.{}",
            entry.sha256,
            uuid::Uuid::new_v4().simple()
        ));
        let io = |source| IndexError::Io {
            what: format!("write {}", tmp.display()),
            source,
        };
        tokio::fs::write(&tmp, &bytes).await.map_err(io)?;
        tokio::fs::rename(&tmp, &cached).await.map_err(io)?;
        self.verified.lock().insert(got);
        Ok(cached)
    }
}

/// Wheels up to this size are read for their dependencies (implicit mode); a larger one's
/// dependencies must be listed.
const MAX_WHEEL_SCAN: u64 = 256 << 20;

async fn read_small(path: &Path) -> Option<Vec<u8>> {
    let meta = tokio::fs::metadata(path).await.ok()?;
    if meta.len() > MAX_WHEEL_SCAN {
        return None;
    }
    tokio::fs::read(path).await.ok()
}

/// A file as a streamed response body, read in 64 KiB chunks.
fn stream_file(file: tokio::fs::File) -> Body {
    use hyper::body::Frame;
    use tokio::io::AsyncReadExt;
    let stream = futures_util::stream::unfold(file, |mut file| async move {
        let mut buf = vec![0u8; 64 << 10];
        match file.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(Frame::data(Bytes::from(buf))), file))
            }
            Err(err) => Some((Err(BodyError::from(err)), file)),
        }
    });
    http_body_util::StreamBody::new(stream).boxed()
}

/// Project names a wheel's `METADATA` declares in `Requires-Dist` (without extras markers:
/// a conditional dependency is still a dependency pip may ask for).
fn wheel_requirements(wheel: &[u8]) -> Vec<String> {
    let Some(metadata) = zip_member_suffix(wheel, ".dist-info/METADATA") else {
        return vec![];
    };
    String::from_utf8_lossy(&metadata)
        .lines()
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.strip_prefix("Requires-Dist:"))
        .filter_map(|req| {
            let name: String = req
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .collect();
            (!name.is_empty()).then(|| normalize_project(&name))
        })
        .collect()
}

/// One stored or deflated member of a zip archive, by the end of its name. Hand-written
/// over miniz_oxide: only `METADATA` is ever read, and a full zip crate is a large
/// dependency for one small file.
fn zip_member_suffix(data: &[u8], suffix: &str) -> Option<Vec<u8>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(data.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(data.get(o..o + 4)?.try_into().ok()?));
    // End of central directory: the last "PK\5\6".
    let eocd = (0..data.len().saturating_sub(21))
        .rev()
        .find(|&i| data[i..].starts_with(b"PK\x05\x06"))?;
    let entries = u16_at(eocd + 10)? as usize;
    let mut at = u32_at(eocd + 16)? as usize;
    for _ in 0..entries {
        if u32_at(at)? != 0x0201_4b50 {
            return None;
        }
        let method = u16_at(at + 10)?;
        let compressed = u32_at(at + 20)? as usize;
        let name_len = u16_at(at + 28)? as usize;
        let extra_len = u16_at(at + 30)? as usize;
        let comment_len = u16_at(at + 32)? as usize;
        let local = u32_at(at + 42)? as usize;
        let name = data.get(at + 46..at + 46 + name_len)?;
        at += 46 + name_len + extra_len + comment_len;
        if !name.ends_with(suffix.as_bytes()) {
            continue;
        }
        let start = local + 30 + u16_at(local + 26)? as usize + u16_at(local + 28)? as usize;
        let raw = data.get(start..start + compressed)?;
        return match method {
            0 => Some(raw.to_vec()),
            8 => inflate(raw),
            _ => None,
        };
    }
    None
}

fn inflate(raw: &[u8]) -> Option<Vec<u8>> {
    // METADATA is small; the cap keeps a hostile wheel from inflating without bound.
    miniz_oxide::inflate::decompress_to_vec_with_limit(raw, 4 << 20).ok()
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
