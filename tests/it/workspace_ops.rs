//! Workspace operations beyond upload and download (issue 32, item 3): `HEAD` (exists),
//! `POST {"op": "mkdir" | "move" | "stat"}` and `DELETE` (with `recursive`), driven against
//! real sandboxes: [`operations_on`] runs in the namespaces and gVisor file tests
//! (`api_v1::files_on`) and in the microVM's (`microvm::workspace_files_cross_the_vm_boundary`,
//! where the guest agent does the work). Links the kernel plants are attacked in every
//! operation: none is ever followed, so nothing outside the workspace is read, moved,
//! created or removed.

use anyhow::{Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::v1::V1Client;

/// `HEAD` of a workspace path: the status and the kind header.
async fn head(
    v1: &V1Client<'_>,
    id: &str,
    path: &str,
) -> Result<(u16, Option<String>, Option<u64>)> {
    let response = v1
        .request(Method::HEAD, &format!("/v1/sessions/{id}/files/{path}"))
        .send()
        .await?;
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let kind = header("x-cellgate-file-kind");
    let length = header("content-length").and_then(|v| v.parse().ok());
    Ok((response.status().as_u16(), kind, length))
}

async fn op(v1: &V1Client<'_>, id: &str, path: &str, body: Value) -> Result<(u16, Value)> {
    v1.post(&format!("/v1/sessions/{id}/files/{path}"), body)
        .await
}

async fn delete(v1: &V1Client<'_>, id: &str, path: &str) -> Result<(u16, Value)> {
    v1.call(
        Method::DELETE,
        &format!("/v1/sessions/{id}/files/{path}"),
        None,
    )
    .await
}

/// The operations and their attacks, in session `id`. `host_checks`: the workspace is on
/// this host (namespaces, gVisor), so a link the kernel plants can name a host directory the
/// test made, which must come through untouched.
pub(crate) async fn operations_on(v1: &V1Client<'_>, id: &str, host_checks: bool) -> Result<()> {
    // mkdir: parents made, 201 the first time, 200 for an existing directory.
    let (status, entry) = op(v1, id, "ops/a/b", json!({"op": "mkdir"})).await?;
    assert_eq!(status, 201, "{entry}");
    assert_eq!(
        (entry["path"].as_str(), entry["kind"].as_str()),
        (Some("ops/a/b"), Some("dir"))
    );
    let (status, _) = op(v1, id, "ops/a/b", json!({"op": "mkdir"})).await?;
    assert_eq!(status, 200);

    // Exists and stat.
    assert_eq!(
        v1.put_file(id, "ops/a/b/f.txt", b"hello".to_vec()).await?,
        201
    );
    assert_eq!(
        head(v1, id, "ops/a/b/f.txt").await?,
        (200, Some("file".into()), Some(5))
    );
    assert_eq!(head(v1, id, "ops/a").await?.0, 200);
    assert_eq!(head(v1, id, "ops/a").await?.1.as_deref(), Some("dir"));
    assert_eq!(head(v1, id, "ops/nope").await?.0, 404);
    // A HEAD's 404 has no body: the code in a header tells a missing file from a missing
    // session.
    for (session, code) in [(id, "no_such_file"), ("no-such-session", "no_such_session")] {
        let response = v1
            .request(
                Method::HEAD,
                &format!("/v1/sessions/{session}/files/ops/nope"),
            )
            .send()
            .await?;
        let said = response
            .headers()
            .get("x-cellgate-error-code")
            .and_then(|v| v.to_str().ok());
        assert_eq!((response.status().as_u16(), said), (404, Some(code)));
    }
    assert_eq!(head(v1, id, "ops/a/b/f.txt/x").await?.0, 404);
    let (status, entry) = op(v1, id, "ops/a/b/f.txt", json!({"op": "stat"})).await?;
    assert_eq!(status, 200, "{entry}");
    assert_eq!(entry["size"], 5);
    assert!(
        entry["mtime"].as_str().is_some_and(|m| m.ends_with('Z')),
        "{entry}"
    );

    // A file where a directory is asked for.
    let (status, body) = op(v1, id, "ops/a/b/f.txt", json!({"op": "mkdir"})).await?;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("exists")),
        "{body}"
    );

    // Move: the kernel sees it at the new path (parents made), not at the old one.
    let (status, entry) = op(
        v1,
        id,
        "ops/a/b/f.txt",
        json!({"op": "move", "to": "ops/moved/g.txt"}),
    )
    .await?;
    assert_eq!(status, 200, "{entry}");
    assert_eq!(entry["path"], "ops/moved/g.txt");
    let r = v1
        .execute(
            id,
            "import os\n(open('ops/moved/g.txt').read(), os.path.exists('ops/a/b/f.txt'))",
        )
        .await?;
    assert_eq!(r["result"], "('hello', False)", "{r}");
    // Onto something: refused without overwrite, replaced with it.
    assert_eq!(
        v1.put_file(id, "ops/other.txt", b"other".to_vec()).await?,
        201
    );
    let (status, body) = op(
        v1,
        id,
        "ops/other.txt",
        json!({"op": "move", "to": "ops/moved/g.txt"}),
    )
    .await?;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("exists")),
        "{body}"
    );
    let (status, body) = op(
        v1,
        id,
        "ops/other.txt",
        json!({"op": "move", "to": "ops/moved/g.txt", "overwrite": true}),
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    let (_, text) = v1
        .get(&format!("/v1/sessions/{id}/files/ops/moved/g.txt"))
        .await?;
    assert_eq!(text, json!("other"));
    // A directory into itself; a missing source; a bad target.
    let (status, body) = op(
        v1,
        id,
        "ops/moved",
        json!({"op": "move", "to": "ops/moved/inner"}),
    )
    .await?;
    assert_eq!(status, 400, "{body}");
    let (status, body) = op(v1, id, "ops/none", json!({"op": "move", "to": "ops/x"})).await?;
    assert_eq!(status, 404, "{body}");
    assert_eq!(
        head(v1, id, "ops/x").await?.0,
        404,
        "a failed move made its target"
    );
    let (status, body) = op(v1, id, "ops/moved", json!({"op": "move", "to": "../out"})).await?;
    assert_eq!(status, 400, "{body}");
    let (status, body) = op(v1, id, "ops/moved", json!({"op": "chmod"})).await?;
    assert_eq!(status, 400, "{body}");

    // Delete: a directory that is not empty only with recursive.
    let (status, body) = delete(v1, id, "ops").await?;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("not_empty")),
        "{body}"
    );
    assert_eq!(
        head(v1, id, "ops/moved/g.txt").await?.0,
        200,
        "a refused delete removed something"
    );
    let (status, body) = delete(v1, id, "ops?recursive=true").await?;
    assert_eq!(status, 200, "{body}");
    assert!(body["removed"].as_u64().is_some_and(|n| n >= 5), "{body}");
    assert_eq!(head(v1, id, "ops").await?.0, 404);
    let (status, _) = delete(v1, id, "ops").await?;
    assert_eq!(status, 404);
    assert_eq!(v1.put_file(id, "single.txt", b"1".to_vec()).await?, 201);
    let (status, body) = delete(v1, id, "single.txt").await?;
    assert_eq!((status, body["removed"].as_u64()), (200, Some(1)), "{body}");

    // Links the kernel plants: reported as links, removed as links, never passed through.
    let victim = format!("/tmp/cellgate-victim-{}-{id}", std::process::id());
    if host_checks {
        std::fs::create_dir_all(format!("{victim}/sub"))?;
        std::fs::write(format!("{victim}/keep.txt"), "keep")?;
        std::fs::write(format!("{victim}/sub/keep.txt"), "keep")?;
    }
    let r = v1
        .execute(
            id,
            &format!(
                "import os\nos.makedirs('trap', exist_ok=True)\nos.symlink({victim:?}, 'trap/host')\n\
                 os.symlink('/etc', 'etclink')\nos.symlink({victim:?}, 'victim')\n'planted'"
            ),
        )
        .await?;
    assert_eq!(r["result"], "'planted'", "{r}");
    assert_eq!(head(v1, id, "etclink").await?.1.as_deref(), Some("symlink"));
    for path in ["etclink/passwd", "victim/keep.txt", "trap/host/keep.txt"] {
        assert_eq!(
            head(v1, id, path).await?.0,
            404,
            "HEAD {path} went through a link"
        );
        let (status, body) = op(v1, id, path, json!({"op": "stat"})).await?;
        assert_eq!(status, 404, "stat {path}: {body}");
        let (status, body) = op(v1, id, path, json!({"op": "move", "to": "stolen"})).await?;
        assert_eq!(status, 404, "move {path}: {body}");
        let (status, body) = delete(v1, id, path).await?;
        assert_eq!(status, 404, "delete {path}: {body}");
    }
    assert_eq!(v1.put_file(id, "bait.txt", b"bait".to_vec()).await?, 201);
    for target in ["victim/bait.txt", "etclink/cellgate-bait", "victim/sub"] {
        let (status, body) = op(v1, id, "bait.txt", json!({"op": "move", "to": target})).await?;
        assert_eq!(status, 404, "move into {target}: {body}");
    }
    for dir in ["victim/made", "etclink/cellgate-made"] {
        let (status, body) = op(v1, id, dir, json!({"op": "mkdir"})).await?;
        assert_eq!(status, 404, "mkdir {dir}: {body}");
    }
    // A recursive delete of a tree holding a link removes the link, not what it names; so
    // does a delete of the link itself.
    let (status, body) = delete(v1, id, "trap?recursive=true").await?;
    assert_eq!(status, 200, "{body}");
    let (status, body) = delete(v1, id, "victim?recursive=true").await?;
    assert_eq!((status, body["removed"].as_u64()), (200, Some(1)), "{body}");
    let r = v1
        .execute(id, "import os\n(os.path.lexists('trap'), os.path.lexists('victim'), os.path.isdir('/etc'))")
        .await?;
    assert_eq!(r["result"], "(False, False, True)", "{r}");
    if host_checks {
        for file in ["keep.txt", "sub/keep.txt"] {
            let kept = std::fs::read_to_string(format!("{victim}/{file}"))
                .with_context(|| format!("the host's {victim}/{file} is gone"))?;
            assert_eq!(kept, "keep");
        }
        for made in ["bait.txt", "made", "sub/bait.txt"] {
            assert!(
                !std::path::Path::new(&format!("{victim}/{made}")).exists(),
                "{made} appeared on the host"
            );
        }
        assert!(!std::path::Path::new("/etc/cellgate-made").exists());
        assert!(!std::path::Path::new("/etc/cellgate-bait").exists());
        std::fs::remove_dir_all(&victim)?;
    }
    let (status, _) = delete(v1, id, "etclink").await?;
    assert_eq!(status, 200);
    assert_eq!(
        head(v1, id, "bait.txt").await?.0,
        200,
        "the refused moves lost the file"
    );
    Ok(())
}
