//! A cell's outputs kept as artifacts: the rich parts of its display and result bundles, and
//! the files it wrote under the workspace's `outputs/`. What a quota or the size limit
//! refuses is reported as an [`Omitted`] entry, never dropped silently.

use std::collections::HashMap;
use std::sync::Arc;

use base64::Engine;
use serde_json::{Map, Value};

use super::events::{ArtifactRef, Omitted};
use super::Session;
use crate::artifacts::{
    is_base64_mime, Artifact, ArtifactError, ArtifactStore, Description, NewArtifact, Origin,
    Quota, Quotas, RICH_MIME_TYPES,
};
use crate::ids::ExecutionId;
use crate::workspace::{FileEntry, Files};

/// Base64 outputs from this length on are stored in the background (~48 KiB decoded: below
/// it the whole store costs less than handing it to another thread).
const BACKGROUND_MIN_BASE64: usize = 64 << 10;
/// Base64 characters decoded up front to describe a large output (dimensions are in the
/// first KiB of PNG, GIF and WebP; JPEG's frame header may follow metadata).
const HEAD_BASE64: usize = 64 << 10;

/// The decoded head of a base64 text, and the decoded length of the whole.
struct Base64Head {
    bytes: Vec<u8>,
    total: u64,
}

/// Decodes the head of `encoded` and computes its decoded length, without reading the rest.
/// `None` (the caller decodes it all, and reports what is wrong) unless the text is one
/// padded line: any ASCII whitespace or a length that is not a multiple of 4 would make the
/// computed length wrong.
fn base64_head(encoded: &str) -> Option<Base64Head> {
    let raw = encoded.as_bytes();
    if !raw.len().is_multiple_of(4) || memchr::memchr3(b'\n', b'\r', b' ', raw).is_some() {
        return None;
    }
    if memchr::memchr2(b'\t', b'\x0c', raw).is_some() {
        return None;
    }
    let padding = raw.iter().rev().take(2).filter(|b| **b == b'=').count();
    let total = (raw.len() / 4 * 3 - padding) as u64;
    let head = &encoded[..HEAD_BASE64.min(raw.len())];
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(head)
        .ok()?;
    Some(Base64Head { bytes, total })
}

/// Decodes base64 output; only line-wrapped base64 pays for a cleaned copy.
fn decode_base64(encoded: &str) -> Result<Vec<u8>, base64::DecodeError> {
    let engine = &base64::engine::general_purpose::STANDARD;
    engine.decode(encoded).or_else(|_| {
        let cleaned: String = encoded.chars().filter(|c| !c.is_whitespace()).collect();
        engine.decode(cleaned)
    })
}

fn too_large(session: &str, mime: &str, bytes: u64, limit: u64, path: Option<&str>) -> Omitted {
    tracing::warn!(session_id = %session, mime, bytes, limit, path, "output larger than the artifact limit; not stored");
    Omitted {
        mime: mime.to_owned(),
        bytes,
        path: path.map(str::to_owned),
        reason: format!("larger than the policy's artifact_size of {limit} bytes"),
        quota: Some(Quota::ArtifactSize),
    }
}

/// The omitted-output entry of an artifact a quota refused; `None` for other failures,
/// which are only logged.
fn refused(
    session: &str,
    mime: &str,
    bytes: u64,
    path: Option<&str>,
    err: &ArtifactError,
) -> Option<Omitted> {
    let quota = err.quota()?;
    tracing::warn!(session_id = %session, mime, bytes, %quota, %err, "artifact not stored");
    Some(Omitted {
        mime: mime.to_owned(),
        bytes,
        path: path.map(str::to_owned),
        reason: err.to_string(),
        quota: Some(quota),
    })
}

/// Reports a store that failed: as an omitted output when a quota refused it, else in the
/// log only.
fn report_refusal(
    session: &str,
    mime: &str,
    bytes: u64,
    path: Option<&str>,
    err: &ArtifactError,
    omitted: &mut Vec<Omitted>,
) {
    match refused(session, mime, bytes, path, err) {
        Some(entry) => omitted.push(entry),
        None => log_store_error(session, err),
    }
}

fn log_store_error(session: &str, err: &ArtifactError) {
    match err {
        ArtifactError::TooLarge { .. } => {
            tracing::warn!(session_id = %session, %err, "artifact not stored")
        }
        _ => tracing::error!(session_id = %session, %err, "artifact not stored"),
    }
}

/// The `text/plain` part of a MIME bundle (a list of lines, nbformat style, joined).
pub(super) fn plain_text(data: &Map<String, Value>) -> Option<String> {
    match data.get("text/plain")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(lines) => Some(lines.iter().filter_map(Value::as_str).collect()),
        _ => None,
    }
}

/// The bytes of one part of a MIME bundle; an omitted entry when base64 that does not
/// decode.
fn bundle_content(session: &str, mime: &str, value: &mut Value) -> Result<Vec<u8>, Omitted> {
    Ok(match value {
        Value::String(s) if is_base64_mime(mime) => {
            // Kernels send one line; only line-wrapped base64 pays for a cleaned copy.
            match decode_base64(s) {
                Ok(bytes) => bytes,
                Err(err) => {
                    tracing::warn!(session_id = %session, mime, %err, "output is not valid base64; not stored");
                    return Err(Omitted {
                        mime: mime.to_owned(),
                        bytes: s.len() as u64,
                        path: None,
                        reason: format!("not valid base64: {err}"),
                        quota: None,
                    });
                }
            }
        }
        Value::String(s) => std::mem::take(s).into_bytes(),
        // Lists of lines (nbformat style) join into one text.
        Value::Array(lines) if lines.iter().all(Value::is_string) => lines
            .iter()
            .filter_map(Value::as_str)
            .collect::<String>()
            .into_bytes(),
        other => other.to_string().into_bytes(),
    })
}

impl Session {
    /// Stores the rich parts of a MIME bundle; returns references in the bundle's order of
    /// preference. An output too large or undecodable is reported in the log and skipped.
    /// Large base64 outputs (images, PDFs) are described from their head and stored in the
    /// background (see [`crate::artifacts::Reservation`]): the reference goes out without
    /// waiting for the decode, hash and write of megabytes.
    pub(super) async fn store_bundle(
        &self,
        mut data: Map<String, Value>,
        origin: Origin,
        execution_id: &ExecutionId,
        display_id: Option<&str>,
        omitted: &mut Vec<Omitted>,
    ) -> Vec<ArtifactRef> {
        let text = plain_text(&data);
        let mut refs = Vec::new();
        for mime in RICH_MIME_TYPES {
            let Some(value) = data.get_mut(*mime) else {
                continue;
            };
            let new = NewArtifact {
                session: self.id.as_str(),
                owner: self.owner.as_deref(),
                mime,
                origin,
                execution_id: Some(execution_id),
                display_id,
                text: text.as_deref(),
                path: None,
                quotas: self.options.artifact_quotas,
            };
            if let Some(stored) = self.store_large_base64(&new, value, omitted).await {
                refs.extend(stored);
                continue;
            }
            let content = match bundle_content(self.id.as_str(), mime, value) {
                Ok(content) => content,
                Err(entry) => {
                    omitted.push(entry);
                    continue;
                }
            };
            refs.extend(self.store_part(&new, content, omitted).await);
        }
        refs
    }

    /// A large base64 part, stored in the background from its decoded head: `Some` (a
    /// reference, or none when it was refused) when it took that path, `None` when the part
    /// is stored whole ([`Self::store_part`]).
    async fn store_large_base64(
        &self,
        new: &NewArtifact<'_>,
        value: &mut Value,
        omitted: &mut Vec<Omitted>,
    ) -> Option<Option<ArtifactRef>> {
        let Value::String(encoded) = value else {
            return None;
        };
        if !is_base64_mime(new.mime) || encoded.len() < BACKGROUND_MIN_BASE64 {
            return None;
        }
        let head = base64_head(encoded)?;
        let (bytes, limit) = (head.total, self.options.artifact_max_bytes);
        if bytes > limit {
            omitted.push(too_large(self.id.as_str(), new.mime, bytes, limit, None));
            return Some(None);
        }
        let description = Description::from_head(new, &head.bytes, bytes);
        let encoded = std::mem::take(encoded);
        match self.store_in_background(new, description, encoded).await {
            Ok(artifact) => Some(Some(self.options.reference(&artifact))),
            Err(err) => {
                report_refusal(self.id.as_str(), new.mime, bytes, None, &err, omitted);
                Some(None)
            }
        }
    }

    /// Stores one decoded part on the blocking pool; `None` when it was refused or failed.
    async fn store_part(
        &self,
        new: &NewArtifact<'_>,
        content: Vec<u8>,
        omitted: &mut Vec<Omitted>,
    ) -> Option<ArtifactRef> {
        let (mime, limit) = (new.mime, self.options.artifact_max_bytes);
        if content.len() as u64 > limit {
            omitted.push(too_large(
                self.id.as_str(),
                mime,
                content.len() as u64,
                limit,
                None,
            ));
            return None;
        }
        let store = self.artifacts.clone();
        let bytes = content.len() as u64;
        let (quotas, origin) = (new.quotas, new.origin);
        let (session, owner, exec, display, text, mime_owned) = (
            new.session.to_owned(),
            new.owner.map(str::to_owned),
            new.execution_id.cloned(),
            new.display_id.map(str::to_owned),
            new.text.map(str::to_owned),
            mime.to_owned(),
        );
        let stored = tokio::task::spawn_blocking(move || {
            store.put(
                &NewArtifact {
                    session: &session,
                    owner: owner.as_deref(),
                    mime: &mime_owned,
                    origin,
                    execution_id: exec.as_ref(),
                    display_id: display.as_deref(),
                    text: text.as_deref(),
                    path: None,
                    quotas,
                },
                &content,
            )
        })
        .await;
        match stored {
            Ok(Ok(artifact)) => return Some(self.options.reference(&artifact)),
            Ok(Err(err)) => report_refusal(self.id.as_str(), mime, bytes, None, &err, omitted),
            Err(err) => tracing::error!(session_id = %self.id, %err, "artifact task failed"),
        }
        None
    }

    /// Records the artifact now and decodes, hashes and writes it on the blocking pool. At
    /// most [`super::BACKGROUND_STORES`] run at once per session; past that the execution
    /// waits here (back-pressure on a kernel that floods outputs).
    async fn store_in_background(
        &self,
        new: &NewArtifact<'_>,
        description: Description,
        encoded: String,
    ) -> Result<Arc<Artifact>, ArtifactError> {
        let permit = self.background_stores.clone().acquire_owned().await;
        let (artifact, reservation) = self.artifacts.reserve(new, description)?;
        let session = self.id.clone();
        let id = artifact.id.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let stored = match decode_base64(&encoded) {
                Ok(bytes) => {
                    drop(encoded);
                    reservation.fill(&bytes)
                }
                // The head decoded, the rest did not: a kernel sent broken base64. The
                // reference is already out; fetching it answers 404 and this log says why.
                Err(err) => {
                    drop(reservation);
                    tracing::warn!(session_id = %session, artifact = %id, %err, "output is not valid base64; artifact removed");
                    return;
                }
            };
            if let Err(err) = stored {
                log_store_error(session.as_str(), &err);
            }
        });
        Ok(artifact)
    }

    /// Turns new or changed files under the workspace's `outputs/` into artifacts.
    pub(super) async fn collect_outputs(
        &self,
        execution_id: &ExecutionId,
    ) -> (Vec<ArtifactRef>, Vec<Omitted>) {
        let Some(workspace) = self.workspace() else {
            return (Vec::new(), Vec::new());
        };
        let scan = OutputScan {
            store: self.artifacts.clone(),
            session: self.id.to_string(),
            owner: self.owner.clone(),
            execution_id: execution_id.clone(),
            limit: self.options.artifact_max_bytes,
            quotas: self.options.artifact_quotas,
            seen: self.outputs_seen.lock().clone(),
            stored: Vec::new(),
            omitted: Vec::new(),
        };
        let scanned = tokio::task::spawn_blocking(move || scan.run(&workspace)).await;
        match scanned {
            Ok(scan) => {
                *self.outputs_seen.lock() = scan.seen;
                let refs = scan
                    .stored
                    .iter()
                    .map(|a| self.options.reference(a))
                    .collect();
                (refs, scan.omitted)
            }
            Err(_) => (Vec::new(), Vec::new()),
        }
    }
}

/// One pass over `outputs/` on the blocking pool: the files seen before (path → size and
/// mtime) in, the artifacts stored and the files left out added.
struct OutputScan {
    store: Arc<ArtifactStore>,
    session: String,
    owner: Option<String>,
    execution_id: ExecutionId,
    limit: u64,
    quotas: Quotas,
    seen: HashMap<String, (u64, i64, i64)>,
    stored: Vec<Arc<Artifact>>,
    omitted: Vec<Omitted>,
}

impl OutputScan {
    fn run(mut self, workspace: &Files) -> OutputScan {
        let files = match workspace.list("outputs", crate::workspace::Listing::ALL) {
            Ok(files) => files,
            Err(_) => return self,
        };
        for file in files.into_iter().filter(|f| f.kind == "file") {
            let stamp = (file.size, file.mtime_s, file.mtime_ns);
            if self.seen.get(&file.path) == Some(&stamp) {
                continue;
            }
            self.seen.insert(file.path.clone(), stamp);
            self.store_file(workspace, &file);
        }
        self
    }

    fn store_file(&mut self, workspace: &Files, file: &FileEntry) {
        let mime = crate::workspace::mime_for(&file.path);
        if file.size > self.limit {
            let entry = too_large(&self.session, mime, file.size, self.limit, Some(&file.path));
            self.omitted.push(entry);
            return;
        }
        let new = NewArtifact {
            session: &self.session,
            owner: self.owner.as_deref(),
            mime,
            origin: Origin::File,
            execution_id: Some(&self.execution_id),
            display_id: None,
            text: None,
            path: Some(&file.path),
            quotas: self.quotas,
        };
        // Refused before the file is read and copied, when its listed size is over.
        let checked = match self.store.check(&new, file.size) {
            Ok(()) => match workspace.open_read(&file.path) {
                Ok((mut reader, _)) => self.store.put_reader(&new, &mut reader, self.limit),
                // Gone or replaced since the listing: the kernel's business.
                Err(_) => return,
            },
            Err(err) => Err(err),
        };
        match checked {
            Ok(artifact) => self.stored.push(artifact),
            Err(err) => {
                let path = Some(file.path.as_str());
                report_refusal(
                    &self.session,
                    mime,
                    file.size,
                    path,
                    &err,
                    &mut self.omitted,
                )
            }
        }
    }
}
