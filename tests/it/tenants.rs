//! Tenants through the real binary: JWTs from `cellgate token` and from test-made keys,
//! tenant isolation on the Kernel Gateway API (REST and WebSocket) attacked by another tenant,
//! policy caps, per-tenant kernel caps and request rates, and every kind of bad token.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use base64::Engine;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::Method;
use serde_json::{json, Value};

use crate::support::v1::V1Client;
use crate::support::{stdout, Gateway};

pub(crate) const SECRET: &str = "tenants-test-secret-0123456789abcdef";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

pub(crate) fn secret_file(dir: &Path) -> PathBuf {
    let path = dir.join("jwt-secret");
    std::fs::write(&path, format!("{SECRET}\n")).unwrap();
    path
}

fn sign(claims: &Value, alg: Algorithm, key: &EncodingKey) -> String {
    jsonwebtoken::encode(&Header::new(alg), claims, key).unwrap()
}

pub(crate) fn hs256(claims: &Value) -> String {
    sign(
        claims,
        Algorithm::HS256,
        &EncodingKey::from_secret(SECRET.as_bytes()),
    )
}

pub(crate) fn claims(tenant: &str, policy: &str) -> Value {
    json!({"sub": format!("{tenant}-user"), "tenant": tenant, "policy": policy, "exp": now() + 3600})
}

fn b64(value: &Value) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(value.to_string())
}

/// `cellgate token …` with the given extra arguments; its stdout, or its stderr as the error.
fn cellgate_token(args: &[&str]) -> Result<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_cellgate"))
        .arg("token")
        .args(args)
        .env_remove("CELLGATE_JWT_SECRET_FILE")
        .env_remove("CELLGATE_CONFIG")
        .output()?;
    if !output.status.success() {
        bail!("{}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(String::from_utf8(output.stdout)?.trim().to_owned())
}

/// The HTTP status of a WebSocket upgrade to kernel `id` as `bearer`.
async fn ws_status(gateway: &Gateway, bearer: &str, id: &str) -> Result<u16> {
    let authorization = format!("Bearer {bearer}");
    gateway
        .ws_upgrade_status(id, &[("Authorization", authorization.as_str())])
        .await
}

#[tokio::test]
async fn tenant_isolation_on_the_kernel_gateway_api() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--policy-order", "strict,default,data-science"])
        .args(&["--tenant-max-kernels", "2"])
        .start()
        .await?;

    // Tenant A's token comes from `cellgate token` with the same secret file.
    let token_a = cellgate_token(&[
        "--tenant",
        "acme",
        "--policy",
        "default",
        "--ttl",
        "30m",
        "--jwt-secret-file",
        secret.to_str().context("path")?,
    ])?;
    let token_b = hs256(&claims("globex", "data-science"));
    let a = V1Client::bearer(&gateway, &token_a);
    let b = V1Client::bearer(&gateway, &token_b);

    // A starts a kernel without naming a policy: it runs under A's cap and is A's.
    let (status, model) = a
        .call(
            Method::POST,
            "/api/kernels",
            Some(json!({"name": "python3"})),
        )
        .await?;
    assert_eq!(status, 201, "{model}");
    let id = model["id"].as_str().context("id")?.to_owned();
    assert_eq!(model["cellgate"]["tenant"], "acme");
    assert_eq!(model["cellgate"]["policy"], "default");

    // Policy cap: more permissive than the claim is refused; less permissive is fine.
    let (status, body) = a
        .call(
            Method::POST,
            "/api/kernels",
            Some(json!({"name": "python3", "env": {"KERNEL_POLICY": "data-science"}})),
        )
        .await?;
    assert_eq!(status, 403, "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains("more permissive"), "{message}");
    let (status, strict) = a
        .call(
            Method::POST,
            "/api/kernels",
            Some(json!({"name": "python3", "env": {"KERNEL_POLICY": "strict"}})),
        )
        .await?;
    assert_eq!(status, 201, "{strict}");
    assert_eq!(strict["cellgate"]["policy"], "strict");
    // A now has two live kernels, its cap.
    let (status, body) = a.call(Method::POST, "/api/kernels", None).await?;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("maximum of 2"),
        "{body}"
    );

    // B sees none of A's kernels, and every way of touching one by id answers exactly as a
    // kernel that does not exist.
    let (status, list) = b.call(Method::GET, "/api/kernels", None).await?;
    assert_eq!((status, list), (200, json!([])));
    let missing = uuid::Uuid::new_v4().to_string();
    for (method, suffix) in [
        (Method::GET, ""),
        (Method::DELETE, ""),
        (Method::POST, "/interrupt"),
        (Method::POST, "/restart"),
    ] {
        let (status, body) = b
            .call(method.clone(), &format!("/api/kernels/{id}{suffix}"), None)
            .await?;
        let (missing_status, missing_body) = b
            .call(
                method.clone(),
                &format!("/api/kernels/{missing}{suffix}"),
                None,
            )
            .await?;
        assert_eq!(status, 404, "{method} {suffix}: {body}");
        assert_eq!(missing_status, 404);
        let masked: Value = serde_json::from_str(&missing_body.to_string().replace(&missing, &id))?;
        assert_eq!(body, masked, "{method} {suffix}");
    }
    assert_eq!(ws_status(&gateway, &token_b, &id).await?, 404);
    assert_eq!(ws_status(&gateway, &token_b, &missing).await?, 404);

    // A's kernel survived the attempts, and A uses it through the WebSocket.
    let mut as_a = gateway.connect_with(&id, "a-session", &token_a).await?;
    let msgs = as_a.run("print('owned by', 6 * 7)").await?;
    assert_eq!(stdout(&msgs), "owned by 42\n");
    as_a.close().await;
    let (status, list) = a.call(Method::GET, "/api/kernels", None).await?;
    assert_eq!(status, 200);
    let mut ids: Vec<&str> = list
        .as_array()
        .context("list")?
        .iter()
        .filter_map(|k| k["id"].as_str())
        .collect();
    ids.sort();
    let mut expected = vec![id.as_str(), strict["id"].as_str().context("id")?];
    expected.sort();
    assert_eq!(ids, expected);

    // B's own kernel is B's alone (and its claim allows data-science).
    let (status, b_model) = b
        .call(
            Method::POST,
            "/api/kernels",
            Some(json!({"env": {"KERNEL_POLICY": "strict"}})),
        )
        .await?;
    assert_eq!(status, 201, "{b_model}");
    let b_id = b_model["id"].as_str().context("id")?.to_owned();
    let (status, _) = a
        .call(Method::GET, &format!("/api/kernels/{b_id}"), None)
        .await?;
    assert_eq!(status, 404);

    // The admin sees everything, with owners.
    let (status, all) = gateway.get_json("/api/kernels").await?;
    assert_eq!(status, 200);
    let tenants: Vec<&str> = all
        .as_array()
        .context("list")?
        .iter()
        .filter_map(|k| k["cellgate"]["tenant"].as_str())
        .collect();
    assert_eq!(tenants.len(), 3, "{all}");
    assert!(tenants.contains(&"acme") && tenants.contains(&"globex"));

    // A frees a slot and may start again; B cannot delete A's kernel, A can.
    let (status, _) = a
        .call(
            Method::DELETE,
            &format!("/api/kernels/{}", strict["id"].as_str().context("id")?),
            None,
        )
        .await?;
    assert_eq!(status, 204);
    for kernel in [&id, &b_id] {
        assert_eq!(gateway.delete_kernel(kernel).await?, 204);
    }
    Ok(())
}

/// Generates a key pair with the openssl CLI: (private PEM, public PEM).
fn openssl_keypair(dir: &Path, name: &str, genpkey_args: &[&str]) -> Result<(Vec<u8>, PathBuf)> {
    let private = dir.join(format!("{name}.key"));
    let public = dir.join(format!("{name}.pub.pem"));
    let status = Command::new("openssl")
        .arg("genpkey")
        .args(genpkey_args)
        .arg("-out")
        .arg(&private)
        .stderr(std::process::Stdio::null())
        .status()
        .context("openssl is needed to make test keys (apt-get install openssl)")?;
    assert!(status.success(), "openssl genpkey failed");
    let status = Command::new("openssl")
        .args(["pkey", "-pubout", "-in"])
        .arg(&private)
        .arg("-out")
        .arg(&public)
        .status()?;
    assert!(status.success(), "openssl pkey -pubout failed");
    Ok((std::fs::read(&private)?, public))
}

#[tokio::test]
async fn bad_tokens_are_refused_and_public_keys_work() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let (rsa_private, rsa_public) = openssl_keypair(
        dir.path(),
        "rsa",
        &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
    )?;
    let (ec_private, ec_public) = openssl_keypair(
        dir.path(),
        "ec",
        &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
    )?;
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .arg("--jwt-public-key")
        .arg(rsa_public.to_str().context("path")?)
        .arg("--jwt-public-key")
        .arg(ec_public.to_str().context("path")?)
        .start()
        .await?;
    let rsa_key = EncodingKey::from_rsa_pem(&rsa_private)?;
    let ec_key = EncodingKey::from_ec_pem(&ec_private)?;

    for token in [
        hs256(&claims("t", "default")),
        sign(&claims("t", "default"), Algorithm::RS256, &rsa_key),
        sign(&claims("t", "default"), Algorithm::ES256, &ec_key),
    ] {
        let (status, body) = V1Client::bearer(&gateway, &token)
            .call(Method::GET, "/api/kernels", None)
            .await?;
        assert_eq!(status, 200, "{body}");
    }
    // Static-token admins still get in beside JWTs.
    assert_eq!(gateway.get_json("/api/kernels").await?.0, 200);

    let good = hs256(&claims("t", "default"));
    let parts: Vec<&str> = good.split('.').collect();
    let mut victim = claims("t", "default");
    victim["tenant"] = json!("victim");
    let public_pem = std::fs::read(&rsa_public)?;
    let mut bad: Vec<(&str, String, &str)> = vec![
        (
            "expired",
            hs256(&json!({"sub": "s", "tenant": "t", "policy": "default", "exp": now() - 3600})),
            "expired",
        ),
        (
            "forged (another secret)",
            sign(
                &claims("t", "default"),
                Algorithm::HS256,
                &EncodingKey::from_secret(b"not-the-gateway-secret-0123456789abc"),
            ),
            "signature",
        ),
        (
            "alg none",
            format!(
                "{}.{}.",
                b64(&json!({"alg": "none", "typ": "JWT"})),
                b64(&claims("t", "default"))
            ),
            "algorithm none",
        ),
        (
            "tampered payload",
            format!("{}.{}.{}", parts[0], b64(&victim), parts[2]),
            "signature",
        ),
        (
            "HS256 signed with the RSA public key as secret",
            sign(
                &claims("t", "default"),
                Algorithm::HS256,
                &EncodingKey::from_secret(&public_pem),
            ),
            "signature",
        ),
        (
            "RS256 signed with another RSA key",
            sign(
                &claims("t", "default"),
                Algorithm::RS256,
                &EncodingKey::from_rsa_pem(
                    &openssl_keypair(
                        dir.path(),
                        "other",
                        &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
                    )?
                    .0,
                )?,
            ),
            "signature",
        ),
        (
            "not yet valid",
            hs256(&{
                let mut c = claims("t", "default");
                c["nbf"] = json!(now() + 3600);
                c
            }),
            "not valid yet",
        ),
        ("garbage", "not-a-jwt".to_owned(), "malformed"),
    ];
    for claim in ["tenant", "policy", "sub", "exp"] {
        let mut c = claims("t", "default");
        c.as_object_mut().unwrap().remove(claim);
        bad.push(("missing claim", hs256(&c), claim));
    }
    for (what, token, reason) in bad {
        let response = gateway
            .http
            .get(format!("{}/api/kernels", gateway.base))
            .header("Authorization", format!("Bearer {token}"))
            .send()
            .await?;
        assert_eq!(response.status().as_u16(), 401, "{what}");
        assert!(
            response.headers().contains_key("www-authenticate"),
            "{what}"
        );
        let body: Value = response.json().await?;
        let message = body["message"].as_str().unwrap_or_default();
        assert!(message.contains(reason), "{what}: {message}");
        assert!(
            !message.contains(SECRET) && !message.contains("BEGIN"),
            "{what}: {message}"
        );
        // The query string is refused the same way (browsers' WebSockets use it).
        let status = ws_status(&gateway, &token, &uuid::Uuid::new_v4().to_string()).await?;
        assert_eq!(status, 401, "{what} over WebSocket");
    }
    let response = gateway
        .http
        .get(format!("{}/api/kernels", gateway.base))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 401);
    // No log line carries a token or the secret.
    let log = gateway.log();
    assert!(!log.contains(SECRET) && !log.contains(&good), "{log}");
    Ok(())
}

#[tokio::test]
async fn tenants_are_rate_limited_one_by_one() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    // One request per 100 s after a burst of 3: the fourth is refused however slow the host.
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--tenant-rate", "0.01", "--tenant-burst", "3"])
        .start()
        .await?;
    let busy = hs256(&claims("busy", "default"));
    for _ in 0..3 {
        assert_eq!(
            V1Client::bearer(&gateway, &busy)
                .call(Method::GET, "/api/kernels", None)
                .await?
                .0,
            200
        );
    }
    let response = gateway
        .http
        .get(format!("{}/api/kernels", gateway.base))
        .header("Authorization", format!("Bearer {busy}"))
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 429);
    let retry_after: u64 = response
        .headers()
        .get("retry-after")
        .context("Retry-After")?
        .to_str()?
        .parse()?;
    assert!((1..=100).contains(&retry_after), "{retry_after}");
    // Another tenant, and the admin, are not slowed by it.
    let calm = hs256(&claims("calm", "default"));
    assert_eq!(
        V1Client::bearer(&gateway, &calm)
            .call(Method::GET, "/api/kernels", None)
            .await?
            .0,
        200
    );
    for _ in 0..5 {
        assert_eq!(gateway.get_json("/api/kernels").await?.0, 200);
    }
    Ok(())
}

#[test]
fn token_command_checks_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path());
    let secret = secret.to_str().unwrap();
    let err = cellgate_token(&["--tenant", "t", "--policy", "p", "--ttl", "soon"]).unwrap_err();
    assert!(err.to_string().contains("--ttl"), "{err}");
    let err = cellgate_token(&["--tenant", "t", "--policy", "p"]).unwrap_err();
    assert!(err.to_string().contains("secret"), "{err}");
    let weak = dir.path().join("weak");
    std::fs::write(&weak, "short").unwrap();
    let err = cellgate_token(&[
        "--tenant",
        "t",
        "--policy",
        "p",
        "--jwt-secret-file",
        weak.to_str().unwrap(),
    ])
    .unwrap_err();
    assert!(err.to_string().contains("at least 32"), "{err}");
    let token = cellgate_token(&[
        "--tenant",
        "t",
        "--policy",
        "strict",
        "--ttl",
        "90m",
        "--sub",
        "bot-7",
        "--jwt-secret-file",
        secret,
    ])
    .unwrap();
    let payload = token.split('.').nth(1).unwrap();
    let claims: Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(claims["tenant"], "t");
    assert_eq!(claims["sub"], "bot-7");
    assert_eq!(claims["policy"], "strict");
    let ttl = claims["exp"].as_u64().unwrap() - claims["iat"].as_u64().unwrap();
    assert_eq!(ttl, 90 * 60);
    // The token command refuses claims a gateway would refuse.
    assert!(cellgate_token(&[
        "--tenant",
        "two words",
        "--policy",
        "p",
        "--jwt-secret-file",
        secret
    ])
    .is_err());
}

/// A JWKS file holding an RSA key with a `kid` and a pinned `alg`, built from an openssl key.
#[tokio::test]
async fn jwks_keys_select_by_kid_and_pin_their_algorithm() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (private, public) = openssl_keypair(
        dir.path(),
        "jwks",
        &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
    )?;
    let output = Command::new("openssl")
        .args(["rsa", "-pubin", "-noout", "-modulus", "-in"])
        .arg(&public)
        .output()?;
    assert!(output.status.success(), "openssl rsa -modulus failed");
    let hex_modulus = String::from_utf8(output.stdout)?
        .trim()
        .trim_start_matches("Modulus=")
        .to_owned();
    let modulus = hex::decode(&hex_modulus)?;
    let n = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(modulus);
    let jwks = dir.path().join("jwks.json");
    std::fs::write(
        &jwks,
        json!({"keys": [{"kty": "RSA", "kid": "k1", "alg": "RS256", "use": "sig", "n": n, "e": "AQAB"}]})
            .to_string(),
    )?;
    let gateway = Gateway::builder()
        .token(None)
        .arg("--jwks-file")
        .arg(jwks.to_str().context("path")?)
        .start()
        .await?;
    let key = EncodingKey::from_rsa_pem(&private)?;
    let with_header = |alg: Algorithm, kid: Option<&str>| {
        let mut header = Header::new(alg);
        header.kid = kid.map(str::to_owned);
        jsonwebtoken::encode(&header, &claims("j", "default"), &key).unwrap()
    };
    let cases = [
        (with_header(Algorithm::RS256, Some("k1")), 200),
        (with_header(Algorithm::RS256, None), 200),
        // Same key, another kid: no key matches.
        (with_header(Algorithm::RS256, Some("k2")), 401),
        // Same key, an algorithm the JWKS does not allow for it.
        (with_header(Algorithm::PS256, Some("k1")), 401),
        (with_header(Algorithm::RS512, Some("k1")), 401),
    ];
    for (i, (token, expected)) in cases.iter().enumerate() {
        let (status, body) = V1Client::bearer(&gateway, token)
            .call(Method::GET, "/api/kernels", None)
            .await?;
        assert_eq!(status, *expected, "case {i}: {body}");
    }
    // Only JWTs configured: the static token is unknown, so no admin over HTTP.
    assert_eq!(gateway.get_json("/api/kernels").await?.0, 401);
    Ok(())
}

/// A kernel from the warm pool becomes its tenant's when handed out, and only that tenant's.
#[tokio::test]
async fn pooled_kernels_belong_to_the_tenant_they_are_handed_to() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--pool-size", "1"])
        .start()
        .await?;
    assert!(
        crate::support::eventually(std::time::Duration::from_secs(120), || gateway
            .log()
            .contains("kernel joined the warm pool"))
        .await,
        "the pool never filled: {}",
        gateway.log()
    );
    let token_a = hs256(&claims("pool-a", "default"));
    let token_b = hs256(&claims("pool-b", "default"));
    let a = V1Client::bearer(&gateway, &token_a);
    let b = V1Client::bearer(&gateway, &token_b);
    let (status, model) = a.call(Method::POST, "/api/kernels", None).await?;
    assert_eq!(status, 201, "{model}");
    // The line is logged before the response is sent, but read from the gateway's stderr by
    // another thread, which may not have got to it yet.
    assert!(
        crate::support::eventually(crate::support::PATIENCE, || gateway
            .log()
            .contains("handed out from the warm pool"))
        .await,
        "the kernel did not come from the pool: {}",
        gateway.log()
    );
    assert_eq!(model["cellgate"]["tenant"], "pool-a");
    let id = model["id"].as_str().context("id")?;
    let (status, _) = b
        .call(Method::GET, &format!("/api/kernels/{id}"), None)
        .await?;
    assert_eq!(status, 404);
    assert_eq!(
        b.call(Method::GET, "/api/kernels", None).await?.1,
        json!([])
    );
    let (status, _) = a
        .call(Method::GET, &format!("/api/kernels/{id}"), None)
        .await?;
    assert_eq!(status, 200);
    Ok(())
}

/// API v1 under tenants: a session is its tenant's on every v1 route and on the Kernel
/// Gateway API; another tenant reaches none of its session, files, artifacts or socket.
#[tokio::test]
async fn v1_sessions_artifacts_and_files_are_tenant_isolated() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let secret = secret_file(dir.path());
    let gateway = Gateway::builder()
        .arg("--jwt-secret-file")
        .arg(secret.to_str().context("path")?)
        .args(&["--policy-order", "strict,default,data-science"])
        .args(&["--tenant-max-kernels", "1"])
        .start()
        .await?;
    let token_a = hs256(&claims("v1-a", "default"));
    let token_b = hs256(&claims("v1-b", "default"));
    let a = V1Client::bearer(&gateway, &token_a);
    let b = V1Client::bearer(&gateway, &token_b);

    // Policy cap on v1 too.
    let (status, body) = a
        .call(
            Method::POST,
            "/v1/sessions",
            Some(json!({"policy": "data-science"})),
        )
        .await?;
    assert_eq!(status, 403, "{body}");
    let (status, session) = a
        .call(Method::POST, "/v1/sessions", Some(json!({})))
        .await?;
    assert_eq!(status, 201, "{session}");
    assert_eq!(session["tenant"], "v1-a");
    assert_eq!(session["policy"], "default");
    let id = session["id"].as_str().context("id")?.to_owned();
    // Sessions count toward the tenant's kernel cap, on either API.
    let (status, body) = a
        .call(Method::POST, "/v1/sessions", Some(json!({})))
        .await?;
    assert_eq!(status, 403, "{body}");
    let (status, body) = a.call(Method::POST, "/api/kernels", None).await?;
    assert_eq!(status, 403, "{body}");

    // A's session is A's kernel on the Kernel Gateway API.
    let (status, model) = a
        .call(Method::GET, &format!("/api/kernels/{id}"), None)
        .await?;
    assert_eq!(status, 200, "{model}");
    assert_eq!(model["cellgate"]["tenant"], "v1-a");

    // A makes an artifact and a file.
    let upload = a
        .put_file(&id, "secret.csv", b"a,b\n1,2\n".to_vec())
        .await?;
    assert_eq!(upload, 201);
    let (status, result) = a
        .call(
            Method::POST,
            &format!("/v1/sessions/{id}/execute"),
            Some(json!({"code": "from IPython.display import HTML\nHTML('<b>mine</b>')"})),
        )
        .await?;
    assert_eq!(status, 200, "{result}");
    let artifact = result["artifacts"][0]["id"]
        .as_str()
        .context("an artifact")?
        .to_owned();

    // B: nothing of A's exists.
    let missing = uuid::Uuid::new_v4().to_string();
    let routes: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, "/v1/sessions/{}".into(), None),
        (Method::DELETE, "/v1/sessions/{}".into(), None),
        (
            Method::POST,
            "/v1/sessions/{}/execute".into(),
            Some(json!({"code": "1"})),
        ),
        (Method::POST, "/v1/sessions/{}/interrupt".into(), None),
        (Method::POST, "/v1/sessions/{}/restart".into(), None),
        (
            Method::POST,
            "/v1/sessions/{}/input".into(),
            Some(json!({"value": "x"})),
        ),
        (Method::GET, "/v1/sessions/{}/files".into(), None),
        (Method::GET, "/v1/sessions/{}/files/secret.csv".into(), None),
        (Method::GET, "/v1/sessions/{}/artifacts".into(), None),
    ];
    for (method, pattern, body) in &routes {
        let (status, answer) = b
            .call(method.clone(), &pattern.replace("{}", &id), body.clone())
            .await?;
        let (missing_status, missing_answer) = b
            .call(
                method.clone(),
                &pattern.replace("{}", &missing),
                body.clone(),
            )
            .await?;
        assert_eq!(status, 404, "{method} {pattern}: {answer}");
        assert_eq!(missing_status, 404, "{method} {pattern}");
        let masked: Value =
            serde_json::from_str(&missing_answer.to_string().replace(&missing, &id))?;
        assert_eq!(answer, masked, "{method} {pattern}");
    }
    let (status, _) = b
        .call(Method::GET, &format!("/v1/artifacts/{artifact}"), None)
        .await?;
    assert_eq!(status, 404);
    let (status, list) = b.call(Method::GET, "/v1/sessions", None).await?;
    assert_eq!((status, list), (200, json!([])));
    match tokio_tungstenite::connect_async(b.ws_request(&id)?).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 404)
        }
        other => panic!(
            "tenant B opened A's session socket: {:?}",
            other.map(|_| ())
        ),
    }

    // A still has everything.
    let (status, _) = a
        .call(Method::GET, &format!("/v1/artifacts/{artifact}"), None)
        .await?;
    assert_eq!(status, 200);
    let (status, _) = a
        .call(Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await?;
    assert_eq!(status, 204);
    Ok(())
}
