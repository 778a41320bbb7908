//! JWT bearer tokens for tenants: verifying them (HS256 with a shared secret from a file, at
//! least [`MIN_SECRET_BYTES`]; RS256/384/512, PS256/384/512, ES256/384 and EdDSA with public
//! keys from PEM files or a JWKS file, whose `kid`s are honoured and `alg`s pinned) and
//! issuing them (`cellgate token`, HS256 from the secret).
//!
//! A token must carry `sub`, `tenant`, `policy` and `exp` (`nbf` is honoured when present;
//! `iss` and `aud` are required and checked when the gateway is configured with them). The
//! algorithm in the token's header only selects among keys of its own family: an HMAC token is
//! checked against the secret alone, never against a public key used as an HMAC secret, and
//! `alg: none` is refused before any key is looked at.
//!
//! Verified tokens are cached (moka) under the SHA-256 of the token, each entry expiring no
//! later than the token's own `exp`, so a cache hit never outlives the token.
//!
//! Secrets never reach a log or an error message: errors name files, never their contents,
//! and rejections say what was wrong with the token, never which key was tried.
//!
//! Must not depend on: HTTP, kernels.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// HS256 secrets shorter than this are refused (RFC 7518 3.2: at least the hash's size).
pub const MIN_SECRET_BYTES: usize = 32;
/// Longest accepted tenant, subject or policy claim.
const MAX_CLAIM_CHARS: usize = 128;
/// Validated tokens kept at once.
const CACHE_CAPACITY: u64 = 10_000;

/// Where the keys come from, and what else a token must say. Holds paths, never secrets, so
/// it may be printed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JwtSettings {
    /// File holding the HS256 secret (trailing newlines are ignored).
    pub secret_file: Option<PathBuf>,
    /// PEM files of public keys (RSA, EC or Ed25519).
    pub public_keys: Vec<PathBuf>,
    /// A JWKS file (`{"keys": [...]}`) of public keys.
    pub jwks_file: Option<PathBuf>,
    /// When set, tokens must carry this `iss`.
    pub issuer: Option<String>,
    /// When set, tokens must carry this `aud`.
    pub audience: Option<String>,
    /// Clock skew tolerated on `exp` and `nbf`.
    pub leeway: Duration,
}

impl JwtSettings {
    /// Whether any key is configured (without one, only the static token authenticates).
    pub fn enabled(&self) -> bool {
        self.secret_file.is_some() || !self.public_keys.is_empty() || self.jwks_file.is_some()
    }
}

/// Errors of JWT configuration, verification and issuing. The `Display` of a rejection is
/// safe to show to the client that presented the token.
#[derive(Debug, thiserror::Error)]
pub enum JwtError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadKey { path: PathBuf, reason: String },
    #[error("{path}: the JWT secret has {len} bytes; at least {MIN_SECRET_BYTES} are required")]
    WeakSecret { path: PathBuf, len: usize },
    #[error("no JWT secret is configured (set jwt_secret_file in the config, --jwt-secret-file or CELLGATE_JWT_SECRET_FILE)")]
    NoSecret,
    #[error("cannot sign the token: {0}")]
    Sign(String),
    #[error("malformed token")]
    Malformed,
    #[error("token algorithm {0} is not accepted")]
    Algorithm(String),
    #[error("no key on this gateway accepts this token")]
    NoKey,
    #[error("token signature is invalid")]
    Signature,
    #[error("token has expired")]
    Expired,
    #[error("token is not valid yet")]
    NotYetValid,
    #[error("token lacks the {0} claim")]
    MissingClaim(String),
    #[error("token claim {0} is invalid")]
    BadClaim(String),
}

/// The claims cellgate reads and writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claims {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The most permissive policy the tenant may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// Required; optional here only so a token without it is named as such.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exp: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iat: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aud: Option<serde_json::Value>,
}

/// What a verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub subject: String,
    pub policy: String,
    /// `exp`, in seconds since the epoch.
    pub expires_at: u64,
}

/// One verification key.
struct Key {
    /// The JWKS `kid`, if any: a token naming a kid is checked only against keys with that kid
    /// (or without one).
    kid: Option<String>,
    /// The JWKS `alg`, if any: the only algorithm this key accepts.
    alg: Option<Algorithm>,
    key: DecodingKey,
}

/// Expires cache entries when their token does.
struct UntilExp;

impl moka::Expiry<[u8; 32], Arc<Identity>> for UntilExp {
    fn expire_after_create(
        &self,
        _key: &[u8; 32],
        value: &Arc<Identity>,
        _created_at: Instant,
    ) -> Option<Duration> {
        Some(Duration::from_secs(value.expires_at.saturating_sub(now())))
    }
}

/// Verifies bearer tokens against the configured keys.
pub struct JwtVerifier {
    keys: Vec<Key>,
    validation: Validation,
    cache: moka::sync::Cache<[u8; 32], Arc<Identity>>,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn read(path: &Path) -> Result<Vec<u8>, JwtError> {
    std::fs::read(path).map_err(|source| JwtError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Reads an HS256 secret: the file's bytes without trailing newlines, at least
/// [`MIN_SECRET_BYTES`] long.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, JwtError> {
    let mut secret = read(path)?;
    while matches!(secret.last(), Some(b'\n' | b'\r')) {
        secret.pop();
    }
    if secret.len() < MIN_SECRET_BYTES {
        return Err(JwtError::WeakSecret {
            path: path.to_owned(),
            len: secret.len(),
        });
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(path = %path.display(), "the JWT secret file is readable by other users; chmod 600 it");
            }
        }
    }
    Ok(secret)
}

fn pem_key(path: &Path) -> Result<DecodingKey, JwtError> {
    let pem = read(path)?;
    if String::from_utf8_lossy(&pem).contains("PRIVATE KEY") {
        return Err(JwtError::BadKey {
            path: path.to_owned(),
            reason: "holds a private key; give the gateway the public key only".to_owned(),
        });
    }
    DecodingKey::from_rsa_pem(&pem)
        .or_else(|_| DecodingKey::from_ec_pem(&pem))
        .or_else(|_| DecodingKey::from_ed_pem(&pem))
        .map_err(|_| JwtError::BadKey {
            path: path.to_owned(),
            reason: "not a PEM-encoded RSA, EC or Ed25519 public key".to_owned(),
        })
}

fn jwks_keys(path: &Path) -> Result<Vec<Key>, JwtError> {
    let bad = |reason: String| JwtError::BadKey {
        path: path.to_owned(),
        reason,
    };
    let set: jsonwebtoken::jwk::JwkSet = serde_json::from_slice(&read(path)?)
        .map_err(|err| bad(format!("not a JWKS document: {err}")))?;
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        if matches!(
            jwk.algorithm,
            jsonwebtoken::jwk::AlgorithmParameters::OctetKey(_)
        ) {
            // A symmetric key in a file meant for public keys is a misconfiguration; taking it
            // would let anyone who can read the JWKS mint tokens.
            return Err(bad(format!(
                "key {i} is a symmetric (oct) key; use jwt_secret_file for HS256"
            )));
        }
        let key = DecodingKey::from_jwk(jwk).map_err(|err| bad(format!("key {i}: {err}")))?;
        let alg = match jwk.common.key_algorithm {
            Some(alg) => Some(
                Algorithm::try_from(alg)
                    .map_err(|_| bad(format!("key {i}: algorithm {alg} is not for signatures")))?,
            ),
            None => None,
        };
        keys.push(Key {
            kid: jwk.common.key_id.clone(),
            alg,
            key,
        });
    }
    Ok(keys)
}

/// The `alg` of a token's header, read without trusting anything else in it.
fn header_alg(token: &str) -> Result<String, JwtError> {
    let header = token.split('.').next().ok_or(JwtError::Malformed)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header.trim_end_matches('='))
        .map_err(|_| JwtError::Malformed)?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| JwtError::Malformed)?;
    let alg = value
        .get("alg")
        .and_then(|a| a.as_str())
        .ok_or(JwtError::Malformed)?;
    // Echoed back to the client: keep it short and printable.
    Ok(alg
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(16)
        .collect())
}

fn check_claim(name: &str, value: Option<String>) -> Result<String, JwtError> {
    let value = value.ok_or_else(|| JwtError::MissingClaim(name.to_owned()))?;
    let ok = !value.is_empty()
        && value.chars().count() <= MAX_CLAIM_CHARS
        && !value.chars().any(|c| c.is_control() || c.is_whitespace());
    if ok {
        Ok(value)
    } else {
        Err(JwtError::BadClaim(name.to_owned()))
    }
}

/// The identity a token's (already verified) claims grant.
pub fn identity(claims: Claims) -> Result<Identity, JwtError> {
    Ok(Identity {
        subject: check_claim("sub", claims.sub)?,
        tenant: check_claim("tenant", claims.tenant)?,
        policy: check_claim("policy", claims.policy)?,
        expires_at: claims
            .exp
            .ok_or_else(|| JwtError::MissingClaim("exp".to_owned()))?,
    })
}

fn rejection(kind: &ErrorKind) -> JwtError {
    match kind {
        ErrorKind::InvalidSignature => JwtError::Signature,
        ErrorKind::ExpiredSignature => JwtError::Expired,
        ErrorKind::ImmatureSignature => JwtError::NotYetValid,
        ErrorKind::MissingRequiredClaim(claim) => JwtError::MissingClaim(claim.clone()),
        ErrorKind::InvalidClaimFormat(claim) => JwtError::BadClaim(claim.clone()),
        ErrorKind::InvalidIssuer => JwtError::BadClaim("iss".to_owned()),
        ErrorKind::InvalidAudience => JwtError::BadClaim("aud".to_owned()),
        ErrorKind::InvalidSubject => JwtError::BadClaim("sub".to_owned()),
        ErrorKind::InvalidAlgorithm | ErrorKind::MissingAlgorithm => JwtError::NoKey,
        _ => JwtError::Malformed,
    }
}

impl JwtVerifier {
    /// Loads the configured keys; `None` when no key is configured.
    pub fn from_settings(settings: &JwtSettings) -> Result<Option<JwtVerifier>, JwtError> {
        if !settings.enabled() {
            return Ok(None);
        }
        let mut keys = Vec::new();
        if let Some(path) = &settings.secret_file {
            keys.push(Key {
                kid: None,
                alg: None,
                key: DecodingKey::from_secret(&read_secret(path)?),
            });
        }
        for path in &settings.public_keys {
            keys.push(Key {
                kid: None,
                alg: None,
                key: pem_key(path)?,
            });
        }
        if let Some(path) = &settings.jwks_file {
            keys.extend(jwks_keys(path)?);
        }
        let mut validation = Validation::new(Algorithm::HS256);
        let mut required = vec!["exp", "sub"];
        validation.leeway = settings.leeway.as_secs();
        validation.validate_nbf = true;
        validation.validate_aud = settings.audience.is_some();
        if let Some(aud) = &settings.audience {
            validation.set_audience(&[aud]);
            required.push("aud");
        }
        if let Some(iss) = &settings.issuer {
            validation.set_issuer(&[iss]);
            required.push("iss");
        }
        validation.set_required_spec_claims(&required);
        Ok(Some(JwtVerifier {
            keys,
            validation,
            cache: moka::sync::Cache::builder()
                .max_capacity(CACHE_CAPACITY)
                .expire_after(UntilExp)
                .build(),
        }))
    }

    /// Verifies a token, from the cache when it was verified before.
    pub fn verify(&self, token: &str) -> Result<Arc<Identity>, JwtError> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(identity) = self.cache.get(&digest) {
            // moka expires lazily; never let a hit outlive the token.
            if identity.expires_at > now() {
                return Ok(identity);
            }
            self.cache.invalidate(&digest);
        }
        let identity = Arc::new(self.verify_uncached(token)?);
        if identity.expires_at > now() {
            self.cache.insert(digest, identity.clone());
        }
        Ok(identity)
    }

    fn verify_uncached(&self, token: &str) -> Result<Identity, JwtError> {
        let alg_name = header_alg(token)?;
        // `none` and unknown names fail here, before any key is looked at.
        let alg: Algorithm = alg_name
            .parse()
            .map_err(|_| JwtError::Algorithm(alg_name.clone()))?;
        let header = jsonwebtoken::decode_header(token).map_err(|_| JwtError::Malformed)?;
        let mut validation = self.validation.clone();
        validation.algorithms = vec![alg];
        let candidates = self.keys.iter().filter(|k| {
            k.key.family() == alg.family()
                && k.alg.is_none_or(|a| a == alg)
                && match (&header.kid, &k.kid) {
                    (Some(wanted), Some(kid)) => wanted == kid,
                    _ => true,
                }
        });
        let mut last = JwtError::NoKey;
        for key in candidates {
            match jsonwebtoken::decode::<Claims>(token, &key.key, &validation) {
                Ok(data) => return identity(data.claims),
                Err(err) => {
                    let err = rejection(err.kind());
                    // Only a bad signature means "maybe another key"; anything else was
                    // found after the signature verified.
                    if !matches!(err, JwtError::Signature | JwtError::NoKey) {
                        return Err(err);
                    }
                    if matches!(err, JwtError::Signature) || matches!(last, JwtError::NoKey) {
                        last = err;
                    }
                }
            }
        }
        Err(last)
    }
}

/// Issues an HS256 token for `tenant` with the given policy cap, valid for `ttl`.
pub fn issue_hs256(
    secret: &[u8],
    tenant: &str,
    subject: &str,
    policy: &str,
    ttl: Duration,
    issuer: Option<&str>,
    audience: Option<&str>,
) -> Result<String, JwtError> {
    let issued = now();
    let claims = Claims {
        sub: Some(subject.to_owned()),
        tenant: Some(tenant.to_owned()),
        policy: Some(policy.to_owned()),
        exp: Some(issued.saturating_add(ttl.as_secs())),
        iat: Some(issued),
        nbf: None,
        iss: issuer.map(str::to_owned),
        aud: audience.map(|a| serde_json::Value::String(a.to_owned())),
    };
    // The same checks a verifier applies, so `cellgate token` cannot mint a token the gateway
    // would refuse.
    identity(claims.clone())?;
    if secret.len() < MIN_SECRET_BYTES {
        return Err(JwtError::Sign(format!(
            "the secret must have at least {MIN_SECRET_BYTES} bytes"
        )));
    }
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret),
    )
    .map_err(|err| JwtError::Sign(err.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef-unit";

    fn verifier(dir: &Path, extra: impl FnOnce(&mut JwtSettings)) -> JwtVerifier {
        let path = dir.join("secret");
        std::fs::write(&path, [SECRET, b"\n"].concat()).unwrap();
        let mut settings = JwtSettings {
            secret_file: Some(path),
            leeway: Duration::from_secs(5),
            ..JwtSettings::default()
        };
        extra(&mut settings);
        JwtVerifier::from_settings(&settings).unwrap().unwrap()
    }

    fn sign(claims: serde_json::Value, secret: &[u8]) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret),
        )
        .unwrap()
    }

    fn good_claims() -> serde_json::Value {
        json!({"sub": "alice", "tenant": "acme", "policy": "strict", "exp": now() + 600})
    }

    fn b64(value: &serde_json::Value) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(value.to_string())
    }

    #[test]
    fn valid_tokens_give_their_identity() {
        let dir = tempfile::tempdir().unwrap();
        let v = verifier(dir.path(), |_| {});
        let id = v.verify(&sign(good_claims(), SECRET)).unwrap();
        assert_eq!(
            (id.tenant.as_str(), id.subject.as_str(), id.policy.as_str()),
            ("acme", "alice", "strict")
        );
        // A second look is a cache hit with the same answer.
        assert_eq!(v.verify(&sign(good_claims(), SECRET)).unwrap(), id);
    }

    #[test]
    fn issued_tokens_verify() {
        let dir = tempfile::tempdir().unwrap();
        let v = verifier(dir.path(), |_| {});
        let token = issue_hs256(
            SECRET,
            "t1",
            "bot",
            "default",
            Duration::from_secs(60),
            None,
            None,
        )
        .unwrap();
        let id = v.verify(&token).unwrap();
        assert_eq!(id.tenant, "t1");
        assert!(id.expires_at >= now() + 50);
        assert!(issue_hs256(b"short", "t", "s", "p", Duration::from_secs(9), None, None).is_err());
        assert!(matches!(
            issue_hs256(SECRET, "a b", "s", "p", Duration::from_secs(9), None, None),
            Err(JwtError::BadClaim(_))
        ));
    }

    #[test]
    fn missing_or_bad_claims_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let v = verifier(dir.path(), |_| {});
        for claim in ["tenant", "policy", "sub", "exp"] {
            let mut claims = good_claims();
            claims.as_object_mut().unwrap().remove(claim);
            let err = v.verify(&sign(claims, SECRET)).unwrap_err();
            assert!(
                matches!(&err, JwtError::MissingClaim(c) if c == claim),
                "{claim}: {err:?}"
            );
        }
        let mut claims = good_claims();
        claims["tenant"] = json!("");
        assert!(matches!(
            v.verify(&sign(claims, SECRET)),
            Err(JwtError::BadClaim(_))
        ));
        let mut claims = good_claims();
        claims["tenant"] = json!(42);
        assert!(v.verify(&sign(claims, SECRET)).is_err());
        let mut claims = good_claims();
        claims["policy"] = json!("x".repeat(200));
        assert!(matches!(
            v.verify(&sign(claims, SECRET)),
            Err(JwtError::BadClaim(_))
        ));
    }

    #[test]
    fn expiry_and_not_before() {
        let dir = tempfile::tempdir().unwrap();
        let v = verifier(dir.path(), |_| {});
        let mut claims = good_claims();
        claims["exp"] = json!(now() - 3600);
        assert!(matches!(
            v.verify(&sign(claims, SECRET)),
            Err(JwtError::Expired)
        ));
        let mut claims = good_claims();
        claims["nbf"] = json!(now() + 3600);
        assert!(matches!(
            v.verify(&sign(claims, SECRET)),
            Err(JwtError::NotYetValid)
        ));
        // Within the leeway: accepted, but never cached past its exp.
        let mut claims = good_claims();
        claims["exp"] = json!(now() - 1);
        let token = sign(claims, SECRET);
        assert!(v.verify(&token).is_ok());
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        assert!(v.cache.get(&digest).is_none());
    }

    #[test]
    fn forged_tampered_and_none_tokens_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let v = verifier(dir.path(), |_| {});
        let forged = sign(good_claims(), b"another secret of the same length, 1");
        assert!(matches!(v.verify(&forged), Err(JwtError::Signature)));

        let good = sign(good_claims(), SECRET);
        let parts: Vec<&str> = good.split('.').collect();
        let mut claims = good_claims();
        claims["tenant"] = json!("victim");
        let tampered = format!("{}.{}.{}", parts[0], b64(&claims), parts[2]);
        assert!(matches!(v.verify(&tampered), Err(JwtError::Signature)));

        let none_header = b64(&json!({"alg": "none", "typ": "JWT"}));
        for sig in ["", parts[2]] {
            let token = format!("{none_header}.{}.{sig}", b64(&good_claims()));
            assert!(
                matches!(v.verify(&token), Err(JwtError::Algorithm(ref a)) if a == "none"),
                "{:?}",
                v.verify(&token)
            );
        }
        for junk in [
            "",
            "abc",
            "a.b",
            "a.b.c",
            "....",
            "eyJhbGciOiJIUzI1NiJ9.x.y",
        ] {
            assert!(v.verify(junk).is_err(), "{junk}");
        }
    }

    #[test]
    fn public_key_families_never_mix() {
        // A gateway with only an RSA public key refuses HS256 tokens outright, whatever their
        // secret (the classic attack signs with the public key's PEM as the HMAC secret).
        let dir = tempfile::tempdir().unwrap();
        let pem_path = dir.path().join("rsa.pub.pem");
        std::fs::write(&pem_path, TEST_RSA_PUBLIC).unwrap();
        let v = JwtVerifier::from_settings(&JwtSettings {
            public_keys: vec![pem_path],
            ..JwtSettings::default()
        })
        .unwrap()
        .unwrap();
        let token = sign(good_claims(), TEST_RSA_PUBLIC.as_bytes());
        assert!(matches!(v.verify(&token), Err(JwtError::NoKey)));
    }

    #[test]
    fn issuer_and_audience_when_configured() {
        let dir = tempfile::tempdir().unwrap();
        let v = verifier(dir.path(), |s| {
            s.issuer = Some("idp".into());
            s.audience = Some("cellgate".into());
        });
        assert!(matches!(
            v.verify(&sign(good_claims(), SECRET)),
            Err(JwtError::MissingClaim(_))
        ));
        let mut claims = good_claims();
        claims["iss"] = json!("idp");
        claims["aud"] = json!("cellgate");
        assert!(v.verify(&sign(claims.clone(), SECRET)).is_ok());
        claims["aud"] = json!("other");
        assert!(matches!(
            v.verify(&sign(claims, SECRET)),
            Err(JwtError::BadClaim(ref c)) if c == "aud"
        ));
    }

    #[test]
    fn configuration_errors() {
        let dir = tempfile::tempdir().unwrap();
        let weak = dir.path().join("weak");
        std::fs::write(&weak, "short\n").unwrap();
        let err = JwtVerifier::from_settings(&JwtSettings {
            secret_file: Some(weak),
            ..JwtSettings::default()
        })
        .err()
        .unwrap();
        assert!(matches!(err, JwtError::WeakSecret { len: 5, .. }));
        assert!(!err.to_string().contains("short"));
        let jwks = dir.path().join("jwks.json");
        std::fs::write(&jwks, r#"{"keys":[{"kty":"oct","k":"c2VjcmV0"}]}"#).unwrap();
        assert!(JwtVerifier::from_settings(&JwtSettings {
            jwks_file: Some(jwks),
            ..JwtSettings::default()
        })
        .is_err());
        assert!(JwtVerifier::from_settings(&JwtSettings::default())
            .unwrap()
            .is_none());
    }

    /// A throwaway 2048-bit RSA public key, generated for this test (its private half was deleted).
    const TEST_RSA_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----
MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEAu5ry3LO1UpBCED38I42F
GOGcRVDLykej8BXhlP+fxx1Ax/iIaBhDhyGILa3ZlQ0P/lHx1yfdBI1a8hmDDG22
Ziq9yxIP/1x+9Iys0M/v0C0+K/kap7d1C0HM6jD7dqBf4nohKEP2rSjfscTGL16Q
SxPiyEsf0H357Tz4szANAZJ1BA1/shemBYLafXE7+7R04FyReJes+v60id9OC4fi
mXlkhPnrrm0AlcZAXjTwA15xQUEovju7ThFoOhckkX/0e2BlWEMCNxJyNGssWAiB
8d0wWpsVlPiqSsa7/3MNOSEvnsPsmtF80NyAPUdtvYKQTKjh9FSVtHo4BTQcA1BP
/wIDAQAB
-----END PUBLIC KEY-----
";
}
