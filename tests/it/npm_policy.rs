//! `[packages] npm` end to end: a real gateway, Deno's kernel in the test sandbox importing
//! `npm:` packages through the egress proxy from cellgate's npm registry, which serves from
//! a local upstream registry built here (packuments and tarballs with their sha512
//! integrity): nothing leaves this machine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use base64::Engine;
use parking_lot::Mutex;
use serde_json::{json, Value};
use sha2::{Digest, Sha512};

use crate::support::v1::V1Client;
use crate::support::*;

/// Writes `<name>-<version>.tgz`: an npm package whose `hello()` answers
/// `"<name> <version> works"` (a `package/` directory with package.json and index.js).
fn build_tarball(dir: &Path, name: &str, version: &str) -> Result<PathBuf> {
    let script = r#"
import io, json, os, sys, tarfile
out, name, version = sys.argv[1], sys.argv[2], sys.argv[3]
files = {
    "package/package.json": json.dumps({"name": name, "version": version, "main": "index.js"}),
    "package/index.js": "module.exports = { hello: () => %s };\n" % json.dumps(f"{name} {version} works"),
}
path = os.path.join(out, f"{name.replace('/', '-')}-{version}.tgz")
with tarfile.open(path, "w:gz") as t:
    for p, text in files.items():
        data = text.encode()
        info = tarfile.TarInfo(p)
        info.size = len(data)
        info.mode = 0o644
        t.addfile(info, io.BytesIO(data))
print(path)
"#;
    let output = std::process::Command::new(tools_python())
        .args(["-c", script])
        .arg(dir)
        .args([name, version])
        .output()?;
    ensure!(
        output.status.success(),
        "building a tarball failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(PathBuf::from(
        String::from_utf8(output.stdout)?.trim().to_owned(),
    ))
}

fn integrity(bytes: &[u8]) -> String {
    format!(
        "sha512-{}",
        base64::engine::general_purpose::STANDARD.encode(Sha512::digest(bytes))
    )
}

/// One version upstream: the bytes served and the integrity its packument lists (of other
/// bytes, for a tampered one).
struct Release {
    version: String,
    served: Vec<u8>,
    integrity: String,
    /// The packument's `dependencies` of this version.
    dependencies: Value,
}

/// A local npm registry: packuments at `/<name>` (`/@scope%2fname` for scoped ones) whose
/// tarballs live at `/tarballs/<file>`, counting requests by path.
struct Registry {
    port: u16,
    hits: Arc<Mutex<HashMap<String, usize>>>,
}

impl Registry {
    async fn start(packages: Vec<(String, Vec<Release>)>) -> Result<Registry> {
        use axum::extract::{OriginalUri, State};
        use axum::http::StatusCode;
        use axum::response::IntoResponse;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let mut documents = HashMap::new();
        let mut files = HashMap::new();
        for (name, releases) in packages {
            let mut versions = serde_json::Map::new();
            let mut latest = String::new();
            for release in releases {
                let file = format!(
                    "{}-{}.tgz",
                    name.trim_start_matches('@').replace('/', "-"),
                    release.version
                );
                versions.insert(
                    release.version.clone(),
                    json!({
                        "name": name,
                        "version": release.version,
                        "dependencies": release.dependencies,
                        "dist": {
                            "tarball": format!("http://127.0.0.1:{port}/tarballs/{file}"),
                            "integrity": release.integrity,
                        },
                    }),
                );
                files.insert(format!("/tarballs/{file}"), release.served);
                latest = release.version;
            }
            let path = format!("/{}", name.replace('/', "%2f"));
            documents.insert(
                path,
                json!({"name": name, "dist-tags": {"latest": latest}, "versions": versions})
                    .to_string(),
            );
        }
        type Shared = (
            Arc<HashMap<String, String>>,
            Arc<HashMap<String, Vec<u8>>>,
            Arc<Mutex<HashMap<String, usize>>>,
        );
        let hits = Arc::new(Mutex::new(HashMap::new()));
        let state: Shared = (Arc::new(documents), Arc::new(files), hits.clone());
        async fn any(
            State((documents, files, hits)): State<Shared>,
            OriginalUri(uri): OriginalUri,
        ) -> axum::response::Response {
            let path = uri.path().replace("%2F", "%2f");
            *hits.lock().entry(path.clone()).or_default() += 1;
            if let Some(document) = documents.get(&path) {
                return (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    document.clone(),
                )
                    .into_response();
            }
            match files.get(&path) {
                Some(bytes) => bytes.clone().into_response(),
                None => StatusCode::NOT_FOUND.into_response(),
            }
        }
        let app = axum::Router::new().fallback(any).with_state(state);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Registry { port, hits })
    }

    fn hits(&self, path: &str) -> usize {
        self.hits.lock().get(path).copied().unwrap_or(0)
    }
}

fn release(dir: &Path, name: &str, version: &str) -> Result<Release> {
    let bytes = std::fs::read(build_tarball(dir, name, version)?)?;
    Ok(Release {
        version: version.to_owned(),
        integrity: integrity(&bytes),
        served: bytes,
        dependencies: json!({}),
    })
}

fn denials(result: &Value) -> Vec<Value> {
    result["denials"].as_array().cloned().unwrap_or_default()
}

#[tokio::test]
async fn deno_imports_only_the_npm_packages_and_versions_the_policy_lists() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut tampered = release(dir.path(), "cg-npm-tampered", "1.0.0")?;
    let evil = build_tarball(dir.path(), "cg-npm-evil", "1.0.0")?;
    // The packument lists the real tarball's sha512; upstream serves another.
    tampered.served = std::fs::read(evil)?;
    let tampered_integrity = tampered.integrity.clone();
    let mut parent = release(dir.path(), "cg-npm-parent", "1.0.0")?;
    parent.dependencies = json!({"cg-npm-child": "^1"});
    let registry = Registry::start(vec![
        (
            "cg-npm-allowed".into(),
            vec![
                release(dir.path(), "cg-npm-allowed", "1.0.0")?,
                release(dir.path(), "cg-npm-allowed", "2.0.0")?,
            ],
        ),
        (
            "@cgscope/scoped".into(),
            vec![release(dir.path(), "@cgscope/scoped", "1.2.0")?],
        ),
        (
            "cg-npm-denied".into(),
            vec![release(dir.path(), "cg-npm-denied", "1.0.0")?],
        ),
        ("cg-npm-tampered".into(), vec![tampered]),
        ("cg-npm-parent".into(), vec![parent]),
        (
            "cg-npm-child".into(),
            vec![release(dir.path(), "cg-npm-child", "1.0.0")?],
        ),
    ])
    .await?;
    let cache = dir.path().join("cache");
    let upstream = format!("http://127.0.0.1:{}", registry.port);
    let (gateway, _policies) = Gateway::with_default_policy(
        "[packages]\nnpm = [\"cg-npm-allowed@^1\", \"@CGScope/Scoped\", \"cg-npm-tampered\", \"cg-npm-parent\"]\n",
        &[
            "--npm-registry",
            &upstream,
            "--package-cache-dir",
            cache.to_str().context("cache path")?,
        ],
    )
    .await?;
    let v1 = V1Client::new(&gateway);
    let session = v1.create_session(json!({"kernel_name": "deno"})).await?;

    // Allowed: the highest version the range allows (upstream's latest, 2.0.0, is not).
    let r = v1
        .execute(
            &session,
            "import allowed from 'npm:cg-npm-allowed'; allowed.hello()",
        )
        .await?;
    ensure!(
        r["status"] == "ok" && r["result"] == "\"cg-npm-allowed 1.0.0 works\"",
        "{r}"
    );
    ensure!(denials(&r).is_empty(), "{r}");
    let r = v1
        .execute(
            &session,
            "import scoped from 'npm:@cgscope/scoped@1'; scoped.hello()",
        )
        .await?;
    ensure!(
        r["status"] == "ok" && r["result"] == "\"@cgscope/scoped 1.2.0 works\"",
        "{r}"
    );
    ensure!(
        registry.hits("/@cgscope%2fscoped") >= 1,
        "scoped names go upstream as npm sends them"
    );
    ensure!(registry.hits("/tarballs/cgscope-scoped-1.2.0.tgz") == 1);

    // What the kernel sees of the packument: the allowed versions only, tarballs here.
    let r = v1
        .execute(
            &session,
            "const p = await (await fetch('http://npm.cellgate.internal/cg-npm-allowed')).json();
console.log(JSON.stringify([Object.keys(p.versions), p['dist-tags'], p.versions['1.0.0'].dist.tarball]))",
        )
        .await?;
    let seen: Value = serde_json::from_str(r["stdout"].as_str().context("stdout")?)
        .with_context(|| format!("{r}"))?;
    ensure!(
        seen == json!([
            ["1.0.0"],
            {"latest": "1.0.0"},
            "http://npm.cellgate.internal/cg-npm-allowed/-/cg-npm-allowed-1.0.0.tgz"
        ]),
        "{seen}"
    );

    // A tarball of a version the range leaves out, asked for directly: refused, with the
    // version and the policy named, and never fetched.
    let r = v1
        .execute(
            &session,
            "(await fetch('http://npm.cellgate.internal/cg-npm-allowed/-/cg-npm-allowed-2.0.0.tgz')).status",
        )
        .await?;
    ensure!(r["result"] == "404", "{r}");
    ensure!(
        denials(&r).iter().any(|d| d["kind"] == "package"
            && d["target"] == "npm:cg-npm-allowed"
            && d["policy"] == "default"
            && d["reason"]
                .as_str()
                .is_some_and(|s| s.contains("version 2.0.0"))),
        "{r}"
    );
    ensure!(registry.hits("/tarballs/cg-npm-allowed-2.0.0.tgz") == 0);

    // Not listed: the import fails, the cell is `denied`, the denial names package and
    // policy, and upstream was never asked.
    let r = v1
        .execute(
            &session,
            "import denied from 'npm:cg-npm-denied'; denied.hello()",
        )
        .await?;
    ensure!(r["status"] == "denied", "{r}");
    ensure!(
        denials(&r).iter().any(|d| d["kind"] == "package"
            && d["target"] == "npm:cg-npm-denied"
            && d["policy"] == "default"
            && d["reason"]
                .as_str()
                .is_some_and(|s| s
                    .contains("npm package 'cg-npm-denied' is not allowed by policy 'default'"))),
        "{r}"
    );
    ensure!(
        registry.hits("/cg-npm-denied") == 0,
        "a refused package went upstream"
    );

    // A dependency the policy does not list: refused, and the denial says whose.
    let r = v1
        .execute(
            &session,
            "import parent from 'npm:cg-npm-parent'; parent.hello()",
        )
        .await?;
    ensure!(r["status"] == "denied", "{r}");
    ensure!(
        denials(&r).iter().any(|d| d["target"] == "npm:cg-npm-child"
            && d["reason"]
                .as_str()
                .is_some_and(|s| s.contains("a dependency of 'cg-npm-parent'"))),
        "{r}"
    );
    ensure!(registry.hits("/cg-npm-child") == 0);

    // Tampered upstream: its sha512 does not match the packument's; nothing reaches Deno
    // whole, nothing is cached.
    let r = v1
        .execute(
            &session,
            "import tampered from 'npm:cg-npm-tampered'; tampered.hello()",
        )
        .await?;
    ensure!(r["status"] != "ok", "a tampered tarball was used: {r}");
    ensure!(registry.hits("/tarballs/cg-npm-tampered-1.0.0.tgz") >= 1);
    let want = format!(
        "sha512-{}",
        integrity_hex(&tampered_integrity).context("integrity")?
    );
    let cached: Vec<String> = std::fs::read_dir(&cache)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    ensure!(
        !cached.contains(&want),
        "the tampered tarball is in the cache: {cached:?}"
    );
    ensure!(
        cached.iter().filter(|n| n.starts_with("sha512-")).count() == 2,
        "the two allowed tarballs are cached by their sha512: {cached:?}"
    );
    let log = gateway.log();
    ensure!(
        log.contains("cg-npm-tampered-1.0.0.tgz: sha512") && log.contains("does not match"),
        "{log}"
    );
    Ok(())
}

fn integrity_hex(integrity: &str) -> Option<String> {
    let b64 = integrity.strip_prefix("sha512-")?;
    Some(hex::encode(
        base64::engine::general_purpose::STANDARD.decode(b64).ok()?,
    ))
}
