//! Signed artifact links (`src/artifacts/links.rs`) through the real binary and real kernels:
//! a link opens its artifact with no credential, in a browser's `<img src>` too, and nothing
//! else: not when altered, expired, moved to another artifact or asked for by another tenant,
//! and not once its session is deleted.

use std::time::Duration;

use anyhow::{Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::{Gateway, TOKEN};
use crate::tenants::{claims, hs256, secret_file};

/// A cell that shows one small matplotlib chart.
const CHART: &str = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()";

/// The first artifact of a result, and its signed link (absolute).
fn first_artifact(gateway: &Gateway, result: &Value) -> Result<(String, String)> {
    let artifact = &result["artifacts"][0];
    let id = artifact["id"].as_str().context("an artifact")?.to_owned();
    let link = artifact["signed_url"]
        .as_str()
        .with_context(|| format!("a signed_url in {artifact}"))?;
    assert!(
        artifact["signed_url_expires"].as_str().is_some(),
        "{artifact}"
    );
    Ok((id, origin(gateway) + link))
}

/// `scheme://host:port` of the gateway (its links are absolute paths on it).
fn origin(gateway: &Gateway) -> String {
    let after_scheme = gateway.base.find("://").map_or(0, |i| i + 3);
    let end = gateway.base[after_scheme..]
        .find('/')
        .map_or(gateway.base.len(), |i| after_scheme + i);
    gateway.base[..end].to_owned()
}

fn b64url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// The documented owner tag: HMAC(key, label, owner)[..16].
fn owner_tag(key: &str, tenant: Option<&str>) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).expect("a key");
    mac.update(b"cellgate artifact owner v1\n");
    match tenant {
        Some(name) => {
            mac.update(b"t");
            mac.update(&(name.len() as u64).to_be_bytes());
            mac.update(name.as_bytes());
        }
        None => mac.update(b"-"),
    }
    b64url(&mac.finalize().into_bytes()[..16])
}

/// The documented link MAC over the id, the owner's tag and the expiry.
fn link_mac(key: &str, id: &str, tag: &str, expires: &str) -> String {
    use base64::Engine;
    use hmac::Mac;
    let tag = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(tag)
        .expect("a tag");
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).expect("a key");
    mac.update(format!("cellgate artifact link v1\n{id}\n").as_bytes());
    mac.update(&tag);
    mac.update(format!("\n{expires}").as_bytes());
    b64url(&mac.finalize().into_bytes())
}

/// A GET with no credential at all; status, headers and body.
async fn anonymous(url: &str) -> Result<(u16, reqwest::header::HeaderMap, Vec<u8>)> {
    let response = reqwest::Client::new().get(url).send().await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    Ok((status, headers, response.bytes().await?.to_vec()))
}

fn with_query(link: &str, key: &str, value: &str) -> String {
    let (path, query) = link.split_once('?').expect("a query");
    let kept: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _)) if k == key => format!("{key}={value}"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{path}?{}", kept.join("&"))
}

fn query_value(link: &str, key: &str) -> String {
    link.split_once('?')
        .expect("a query")
        .1
        .split('&')
        .find_map(|pair| pair.strip_prefix(&format!("{key}=")))
        .expect("the key")
        .to_owned()
}

#[tokio::test]
async fn a_signed_link_opens_its_artifact_only_while_valid_and_its_session_lives() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--artifact-link-max-ttl", "2h"])
        .start()
        .await?;
    let a = V1Client::bearer(&gateway, &hs256(&claims("links-a", "default")));
    let b = V1Client::bearer(&gateway, &hs256(&claims("links-b", "default")));
    let admin = V1Client::new(&gateway);

    let session_a = a.create_session(json!({})).await?;
    let (chart, link) = first_artifact(&gateway, &a.execute(&session_a, CHART).await?)?;
    let (html, html_link) = first_artifact(
        &gateway,
        &a.execute(
            &session_a,
            "from IPython.display import HTML\nHTML('<b>hi</b>')",
        )
        .await?,
    )?;
    let session_b = b.create_session(json!({})).await?;
    let (chart_b, _) = first_artifact(&gateway, &b.execute(&session_b, CHART).await?)?;

    // No credential: the same bytes the owner gets, with a lifetime that ends with the link
    // and no Referer carrying the link on.
    let owner_bytes = a.artifact(&chart).await?.bytes().await?.to_vec();
    let (status, headers, bytes) = anonymous(&link).await?;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
    assert_eq!(bytes, owner_bytes);
    assert_eq!(headers["content-type"], "image/png");
    assert_eq!(headers["referrer-policy"], "no-referrer");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    let cache = headers["cache-control"].to_str()?;
    let max_age: u64 = cache
        .strip_prefix("private, max-age=")
        .with_context(|| cache.to_owned())?
        .parse()?;
    assert!(max_age <= 3600 && max_age > 3000, "{cache}");
    // Active content keeps its sandbox through a link too.
    let (status, headers, _) = anonymous(&html_link).await?;
    assert_eq!(status, 200);
    assert_eq!(headers["content-security-policy"], "sandbox");

    // Altered: a later expiry, one changed character, another artifact's id (of the same
    // tenant, and of another), the unsigned route: refused, as an unknown id is.
    let expires: u64 = query_value(&link, "expires").parse()?;
    let later = with_query(&link, "expires", &(expires + 1).to_string());
    assert_eq!(anonymous(&later).await?.0, 404);
    let signature = query_value(&link, "signature");
    let mut flipped = signature.clone().into_bytes();
    flipped[5] = if flipped[5] == b'A' { b'B' } else { b'A' };
    let flipped = with_query(&link, "signature", std::str::from_utf8(&flipped)?);
    assert_eq!(anonymous(&flipped).await?.0, 404);
    for other in [&html, &chart_b] {
        let moved = link.replace(&chart, other);
        let (status, _, body) = anonymous(&moved).await?;
        assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
    }
    let unsigned = link.replace("/signed?", "?");
    assert_eq!(anonymous(&unsigned).await?.0, 401);
    // Malformed and expired links say so.
    let (status, _, body) = anonymous(&with_query(&link, "signature", "short")).await?;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("malformed_link"));
    let (status, _, _) = anonymous(&with_query(&link, "expires", "soon")).await?;
    assert_eq!(status, 400);
    let (status, _, body) = anonymous(link.split_once('?').context("query")?.0).await?;
    assert_eq!(status, 400, "no query at all");
    assert!(String::from_utf8_lossy(&body).contains("malformed_link"));
    let (status, _, body) = anonymous(&format!("{link}&expires=1")).await?;
    assert_eq!(status, 400, "a key twice");
    assert!(String::from_utf8_lossy(&body).contains("malformed_link"));

    // A link asked for: within the maximum, for the caller's own artifacts only.
    let (status, minted) = a
        .post(&format!("/v1/artifacts/{chart}/links"), json!({"ttl_s": 1}))
        .await?;
    assert_eq!(status, 200, "{minted}");
    let short = origin(&gateway) + minted["url"].as_str().context("url")?;
    assert!(minted["expires"].as_str().is_some(), "{minted}");
    let (status, long) = a
        .post(
            &format!("/v1/artifacts/{chart}/links"),
            json!({"ttl_s": 7200}),
        )
        .await?;
    assert_eq!(status, 200, "{long}");
    let (status, body) = a
        .post(
            &format!("/v1/artifacts/{chart}/links"),
            json!({"ttl_s": 7201}),
        )
        .await?;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["code"], "bad_ttl");
    let (status, body) = a
        .post(&format!("/v1/artifacts/{chart}/links"), json!({"ttl_s": 0}))
        .await?;
    assert_eq!(status, 400, "{body}");
    let (status, body) = b
        .post(&format!("/v1/artifacts/{chart}/links"), json!({}))
        .await?;
    assert_eq!(status, 404, "another tenant's artifact: {body}");
    let (status, body) = a
        .call(Method::POST, &format!("/v1/artifacts/{chart}/links"), None)
        .await?;
    assert_eq!(status, 200, "no body: the default TTL: {body}");
    // The one-second link expires (the check is against the clock, not a race: 2 s later
    // it is past whatever the clock said when it was signed).
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (status, _, body) = anonymous(&short).await?;
    assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("link_expired"));

    // The listing's references carry fresh links too.
    let (status, listed) = a
        .get(&format!("/v1/sessions/{session_a}/artifacts"))
        .await?;
    assert_eq!(status, 200);
    let listed_link = origin(&gateway)
        + listed[0]["signed_url"]
            .as_str()
            .with_context(|| format!("{listed}"))?;
    assert_eq!(anonymous(&listed_link).await?.0, 200);

    // Deleting the session revokes its links, though the owner still fetches the artifact
    // for the retention period.
    let (status, _) = a
        .call(Method::DELETE, &format!("/v1/sessions/{session_a}"), None)
        .await?;
    assert_eq!(status, 204);
    assert_eq!(anonymous(&link).await?.0, 404);
    assert_eq!(anonymous(&listed_link).await?.0, 404);
    assert_eq!(a.artifact(&chart).await?.status().as_u16(), 200);
    let (status, body) = a
        .post(&format!("/v1/artifacts/{chart}/links"), json!({}))
        .await?;
    assert_eq!(status, 404, "no new link for an ended session: {body}");

    // A one-shot execute's session ends with its result, and the links it gave keep working.
    let (status, once) = a.post("/v1/execute", json!({"code": CHART})).await?;
    assert_eq!(status, 200, "{once}");
    let (_, once_link) = first_artifact(&gateway, &once)?;
    assert_eq!(anonymous(&once_link).await?.0, 200);

    // The admin's sessions have links too; a link moved to another owner's artifact never
    // opens it (the owner's tag is checked by the unit tests and the key-file test below).
    let session_admin = admin.create_session(json!({})).await?;
    let (chart_admin, admin_link) =
        first_artifact(&gateway, &admin.execute(&session_admin, CHART).await?)?;
    assert_eq!(anonymous(&admin_link).await?.0, 200);
    let (chart_b2, b_link) = first_artifact(&gateway, &b.execute(&session_b, CHART).await?)?;
    assert_eq!(
        anonymous(&b_link.replace(&chart_b2, &chart_admin)).await?.0,
        404
    );
    assert_eq!(
        anonymous(&admin_link.replace(&chart_admin, &chart_b2))
            .await?
            .0,
        404
    );
    Ok(())
}

/// The naturalWidth Chromium finds for each URL in an `<img>` of an about:blank page (no
/// credential, not the gateway's origin): 0 when the image did not load.
async fn widths_in_a_browser(urls: &[&str]) -> Result<Vec<u64>> {
    let browser_dir = crate::web_client::browser_tools();
    let output = tokio::process::Command::new("node")
        .arg("img.mjs")
        .current_dir(&browser_dir)
        .env("IMG_URLS", serde_json::to_string(urls)?)
        .output()
        .await
        .context("run node (Debian package nodejs; ./dev setup installs it)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "img.mjs failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line: Value = serde_json::from_str(stdout.trim()).context("img.mjs's line")?;
    assert_eq!(line["origin"], "about:blank", "{line}");
    line["widths"]
        .as_array()
        .context("widths")?
        .iter()
        .map(|w| w.as_u64().context("a width"))
        .collect()
}

#[tokio::test]
async fn a_browser_shows_a_signed_link_in_an_img_and_not_the_plain_url() -> Result<()> {
    let gateway = Gateway::start().await?;
    let admin = V1Client::new(&gateway);
    let session = admin.create_session(json!({})).await?;
    let result = admin.execute(&session, CHART).await?;
    let (_, link) = first_artifact(&gateway, &result)?;
    let plain = origin(&gateway) + result["artifacts"][0]["url"].as_str().context("url")?;
    let widths = widths_in_a_browser(&[&link, &plain]).await?;
    let width = result["artifacts"][0]["width"].as_u64().context("width")?;
    assert_eq!(
        widths,
        vec![width, 0],
        "the signed link loads, the plain URL needs a token"
    );
    // Deleted: a browser with nothing cached no longer gets it.
    let (status, _) = admin
        .call(Method::DELETE, &format!("/v1/sessions/{session}"), None)
        .await?;
    assert_eq!(status, 204);
    assert_eq!(widths_in_a_browser(&[&link]).await?, vec![0]);
    Ok(())
}

#[tokio::test]
async fn links_are_off_with_a_zero_ttl_and_a_key_file_signs_them() -> Result<()> {
    let gateway = Gateway::builder()
        .args(&["--artifact-link-ttl", "0s"])
        .start()
        .await?;
    let admin = V1Client::new(&gateway);
    let session = admin.create_session(json!({})).await?;
    let result = admin.execute(&session, CHART).await?;
    let artifact = &result["artifacts"][0];
    assert!(artifact["id"].is_string(), "{result}");
    assert!(artifact.get("signed_url").is_none(), "{artifact}");
    let id = artifact["id"].as_str().context("id")?;
    let (status, body) = admin
        .post(&format!("/v1/artifacts/{id}/links"), json!({}))
        .await?;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["code"], "links_off");
    let (status, _, body) = anonymous(&format!(
        "{}/v1/artifacts/{id}/signed?expires=9999999999&owner={}&signature={}",
        gateway.base,
        "A".repeat(22),
        "A".repeat(43)
    ))
    .await?;
    assert_eq!(status, 404);
    assert!(String::from_utf8_lossy(&body).contains("links_off"));
    drop(gateway);

    // A key file too short to be a key stops the gateway with a clear error, before it
    // says it listens.
    let dir = tempfile::tempdir()?;
    let short = dir.path().join("short-key");
    std::fs::write(&short, "0123456789\n")?;
    let refused = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_cellgate"))
            .args(["serve", "--ip", "127.0.0.1", "--port", "0", "--token", "t"])
            .arg("--kernels-dir")
            .arg(crate::support::kernels_dir())
            .arg("--artifact-link-key-file")
            .arg(&short)
            .output(),
    )
    .await??;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(
        stderr.contains("artifact link key") && stderr.contains("at least 32"),
        "{stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&refused.stdout).contains("listening"),
        "refused before listening"
    );
    // A good one signs the links.
    let key = dir.path().join("key");
    std::fs::write(&key, "k".repeat(40))?;
    let gateway = Gateway::builder()
        .arg("--artifact-link-key-file")
        .arg(key.to_str().context("path")?)
        .start()
        .await?;
    let admin = V1Client::new(&gateway);
    let session = admin.create_session(json!({})).await?;
    let (_, link) = first_artifact(&gateway, &admin.execute(&session, CHART).await?)?;
    let (status, _, bytes) = anonymous(&link).await?;
    assert_eq!(status, 200);
    assert!(bytes.starts_with(b"\x89PNG"));
    // Signed with the file's key (the gateway has a token too), by the documented scheme.
    let key = "k".repeat(40);
    let id = link
        .split("/v1/artifacts/")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .context("id")?
        .to_owned();
    let expires = query_value(&link, "expires");
    let admin_tag = owner_tag(&key, None);
    assert_eq!(query_value(&link, "owner"), admin_tag);
    assert_eq!(
        query_value(&link, "signature"),
        link_mac(&key, &id, &admin_tag, &expires)
    );
    // A link made with the key for another owner (a tenant's tag on the admin's artifact):
    // it verifies, and the holder refuses it.
    let tenant_tag = owner_tag(&key, Some("acme"));
    let forged = with_query(
        &with_query(&link, "owner", &tenant_tag),
        "signature",
        &link_mac(&key, &id, &tenant_tag, &expires),
    );
    let (status, _, body) = anonymous(&forged).await?;
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("no_such_artifact"));
    assert!(!TOKEN.is_empty());
    Ok(())
}

#[tokio::test]
async fn fetches_through_a_link_spend_its_tenants_request_rate() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    // A burst of 6 and then one request per 100 s: exact counts, whatever the machine's speed.
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--tenant-rate", "0.01", "--tenant-burst", "6"])
        .start()
        .await?;
    let a = V1Client::bearer(&gateway, &hs256(&claims("links-rate", "default")));
    // Two of the six: the session and the cell.
    let session = a.create_session(json!({})).await?;
    let (_, link) = first_artifact(&gateway, &a.execute(&session, CHART).await?)?;
    for n in 3..=6 {
        assert_eq!(anonymous(&link).await?.0, 200, "request {n} of the burst");
    }
    let (status, headers, body) = anonymous(&link).await?;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));
    assert!(headers.contains_key("retry-after"));
    // The tenant's own API calls wait with it: the link spent them.
    let (status, _) = a.get(&format!("/v1/sessions/{session}")).await?;
    assert_eq!(status, 429);
    Ok(())
}
