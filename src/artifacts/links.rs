//! Signed links to artifacts: URLs a browser can put in `<img src>` with no credential.
//!
//! A chat page that shows a chart must not hold the gateway's token (or a tenant's JWT) just
//! to fetch an image, and `<img>` cannot send an `Authorization` header anyway. A link is the
//! artifact's id, an expiry and an HMAC-SHA256 over both and the artifact's owner:
//!
//! ```text
//! <base>v1/artifacts/<id>/signed?expires=<unix seconds>&signature=<base64url, no padding>
//! signature = HMAC(key, "cellgate artifact link v1\n" id "\n" owner "\n" expires)
//! ```
//!
//! - **Bound to one artifact and its tenant.** The id and the owner (the tenant, or `-` for
//!   the admin's sessions) are under the MAC, so a link opens nothing else, and an artifact
//!   that is not its signer's tenant's never matches.
//! - **Expiring.** `expires` is under the MAC; a link past it is refused. The gateway signs
//!   for `ttl` (default an hour) in every artifact reference it gives out, and for up to
//!   `max_ttl` when a client asks for one link ([`LinkSigner::sign_for`]).
//! - **Revocable.** A link opens an artifact only while its session lives: deleting the
//!   session revokes every link to its artifacts at once, though the authenticated API keeps
//!   them fetchable for the retention period. Changing the key revokes every link.
//! - **The key.** `--artifact-link-key-file` (shared by replicas behind one load balancer),
//!   else one derived from the gateway's token (replicas share that too), else from the JWT
//!   HMAC secret, else a random key per process (links die with it; said at start). A
//!   derived key is HMAC(secret, a fixed label): a link says nothing about the secret.
//!
//! Verification compares in constant time (`hmac`'s `verify_slice`), and refuses an expiry
//! further ahead than `max_ttl` allows (a link cannot outlive the policy that made it).
//!
//! Must not depend on: HTTP, kernels (a link is a string; the HTTP edge serves it).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::Artifact;

type HmacSha256 = Hmac<Sha256>;

/// What a signature covers first: a version, so a later scheme cannot be confused with this.
const LABEL: &str = "cellgate artifact link v1";
/// What a key derived from another secret is derived with.
const DERIVE_LABEL: &[u8] = b"cellgate artifact link key v1";
/// The fewest bytes a key file must hold.
pub const MIN_KEY_BYTES: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LinkError {
    #[error("the link has expired")]
    Expired,
    #[error("the link's expiry is further ahead than this gateway signs for")]
    TooFarAhead,
    #[error("the link's signature does not match")]
    BadSignature,
    #[error("the link is malformed: {0}")]
    Malformed(&'static str),
    #[error("a link may last at most {max} s, not {asked} s")]
    TtlTooLong { asked: u64, max: u64 },
    #[error("a link must last at least 1 s")]
    TtlZero,
}

/// A signed link, relative to the gateway's base URL, and when it stops working.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub url: String,
    /// Unix seconds.
    pub expires: u64,
}

/// Signs and checks artifact links with one key.
pub struct LinkSigner {
    key: Vec<u8>,
    ttl: Duration,
    max_ttl: Duration,
}

impl std::fmt::Debug for LinkSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("LinkSigner")
            .field("ttl", &self.ttl)
            .field("max_ttl", &self.max_ttl)
            .finish_non_exhaustive()
    }
}

impl LinkSigner {
    /// A signer with `key` (at least [`MIN_KEY_BYTES`]) that signs references for `ttl` and
    /// single links for up to `max_ttl` (at least `ttl`).
    pub fn new(key: Vec<u8>, ttl: Duration, max_ttl: Duration) -> LinkSigner {
        LinkSigner {
            key,
            ttl,
            max_ttl: max_ttl.max(ttl),
        }
    }

    /// The key derived from another secret (the gateway's token, a JWT HMAC secret).
    pub fn derive_key(secret: &[u8]) -> Vec<u8> {
        mac(secret, &[DERIVE_LABEL]).to_vec()
    }

    /// A key of random bytes, for a gateway with no secret to derive one from.
    pub fn random_key() -> Vec<u8> {
        let key: [u8; MIN_KEY_BYTES] = rand::random();
        key.to_vec()
    }

    /// How long the links in artifact references last.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The most a single link may last.
    pub fn max_ttl(&self) -> Duration {
        self.max_ttl
    }

    /// The link an artifact reference carries: valid for `ttl` from now.
    pub fn sign(&self, artifact: &Artifact, base_url: &str) -> Link {
        self.sign_until(artifact, base_url, now() + self.ttl.as_secs())
    }

    /// A link valid for `ttl` from now, at most `max_ttl`.
    pub fn sign_for(
        &self,
        artifact: &Artifact,
        base_url: &str,
        ttl: Duration,
    ) -> Result<Link, LinkError> {
        if ttl.as_secs() == 0 {
            return Err(LinkError::TtlZero);
        }
        if ttl > self.max_ttl {
            return Err(LinkError::TtlTooLong {
                asked: ttl.as_secs(),
                max: self.max_ttl.as_secs(),
            });
        }
        Ok(self.sign_until(artifact, base_url, now() + ttl.as_secs()))
    }

    fn sign_until(&self, artifact: &Artifact, base_url: &str, expires: u64) -> Link {
        let signature = URL_SAFE_NO_PAD.encode(self.signature(
            &artifact.id,
            artifact.owner.as_deref(),
            expires,
        ));
        Link {
            url: format!(
                "{base_url}v1/artifacts/{}/signed?expires={expires}&signature={signature}",
                artifact.id
            ),
            expires,
        }
    }

    /// Checks the shape and expiry of a link's query values, before the artifact is looked
    /// up (cheap refusals first: a replica asks its peers only for links that may be good).
    pub fn precheck(&self, expires: &str, signature: &str) -> Result<(u64, Vec<u8>), LinkError> {
        let expires: u64 = expires
            .parse()
            .map_err(|_| LinkError::Malformed("expires is not a number of seconds"))?;
        let signature = URL_SAFE_NO_PAD
            .decode(signature)
            .map_err(|_| LinkError::Malformed("signature is not base64url"))?;
        if signature.len() != 32 {
            return Err(LinkError::Malformed("signature is not 32 bytes"));
        }
        let now = now();
        if expires <= now {
            return Err(LinkError::Expired);
        }
        // A clock a little behind the signer's (another replica) is allowed for.
        if expires > now + self.max_ttl.as_secs() + 60 {
            return Err(LinkError::TooFarAhead);
        }
        Ok((expires, signature))
    }

    /// Whether `signature` signs `artifact` until `expires` (both from [`Self::precheck`]).
    pub fn verify(
        &self,
        artifact: &Artifact,
        expires: u64,
        signature: &[u8],
    ) -> Result<(), LinkError> {
        let mut mac = keyed(&self.key);
        feed(&mut mac, &artifact.id, artifact.owner.as_deref(), expires);
        mac.verify_slice(signature)
            .map_err(|_| LinkError::BadSignature)
    }

    fn signature(&self, id: &str, owner: Option<&str>, expires: u64) -> [u8; 32] {
        let mut mac = keyed(&self.key);
        feed(&mut mac, id, owner, expires);
        mac.finalize().into_bytes().into()
    }
}

fn keyed(key: &[u8]) -> HmacSha256 {
    // HMAC takes a key of any length; this never fails.
    match HmacSha256::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    }
}

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = keyed(key);
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// The signed message. A tenant's name is length-prefixed (JWT claims may hold any byte), so
/// no owner can stand for another owner and the fields after it, and the admin's mark is no
/// tenant's name.
fn feed(mac: &mut HmacSha256, id: &str, owner: Option<&str>, expires: u64) {
    mac.update(LABEL.as_bytes());
    mac.update(b"\n");
    mac.update(id.as_bytes());
    mac.update(b"\n");
    match owner {
        // Length-prefixed, so no owner's bytes can stand for the fields after it.
        Some(tenant) => {
            mac.update(b"t");
            mac.update(&(tenant.len() as u64).to_be_bytes());
            mac.update(tenant.as_bytes());
        }
        None => mac.update(b"-"),
    }
    mac.update(b"\n");
    mac.update(expires.to_string().as_bytes());
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifacts::Origin;

    fn artifact(id: &str, owner: Option<&str>) -> Artifact {
        Artifact {
            id: id.to_owned(),
            mime: "image/png".to_owned(),
            bytes: 3,
            width: None,
            height: None,
            summary: String::new(),
            origin: Origin::DisplayData,
            execution_id: None,
            display_id: None,
            version: 1,
            previous: None,
            path: None,
            created: String::new(),
            session: "s".to_owned(),
            owner: owner.map(str::to_owned),
        }
    }

    fn signer() -> LinkSigner {
        LinkSigner::new(
            LinkSigner::derive_key(b"token"),
            Duration::from_secs(3600),
            Duration::from_secs(86400),
        )
    }

    fn query(link: &Link) -> (String, String) {
        let query = link.url.split_once('?').unwrap().1;
        let mut expires = String::new();
        let mut signature = String::new();
        for pair in query.split('&') {
            let (k, v) = pair.split_once('=').unwrap();
            match k {
                "expires" => expires = v.to_owned(),
                "signature" => signature = v.to_owned(),
                _ => panic!("unexpected {k}"),
            }
        }
        (expires, signature)
    }

    fn check(signer: &LinkSigner, artifact: &Artifact, link: &Link) -> Result<(), LinkError> {
        let (expires, signature) = query(link);
        let (expires, signature) = signer.precheck(&expires, &signature)?;
        signer.verify(artifact, expires, &signature)
    }

    #[test]
    fn a_link_opens_its_artifact_only() {
        let s = signer();
        let a = artifact("a1", Some("acme"));
        let link = s.sign(&a, "/gw/");
        assert!(link.url.starts_with("/gw/v1/artifacts/a1/signed?expires="));
        assert_eq!(check(&s, &a, &link), Ok(()));
        // Another id, another owner, the admin's: refused.
        assert_eq!(
            check(&s, &artifact("a2", Some("acme")), &link),
            Err(LinkError::BadSignature)
        );
        assert_eq!(
            check(&s, &artifact("a1", Some("other")), &link),
            Err(LinkError::BadSignature)
        );
        assert_eq!(
            check(&s, &artifact("a1", None), &link),
            Err(LinkError::BadSignature)
        );
        // Another key: refused.
        let other = LinkSigner::new(
            LinkSigner::derive_key(b"another token"),
            Duration::from_secs(3600),
            Duration::from_secs(86400),
        );
        assert_eq!(check(&other, &a, &link), Err(LinkError::BadSignature));
    }

    #[test]
    fn altered_or_expired_links_are_refused() {
        let s = signer();
        let a = artifact("a1", None);
        let link = s.sign(&a, "/");
        let (expires, signature) = query(&link);
        // A later expiry under the old signature.
        let later = (expires.parse::<u64>().unwrap() + 1).to_string();
        let (e, sig) = s.precheck(&later, &signature).unwrap();
        assert_eq!(s.verify(&a, e, &sig), Err(LinkError::BadSignature));
        // One character of the signature changed.
        let mut bad = signature.clone().into_bytes();
        bad[0] = if bad[0] == b'A' { b'B' } else { b'A' };
        let (e, sig) = s
            .precheck(&expires, std::str::from_utf8(&bad).unwrap())
            .unwrap();
        assert_eq!(s.verify(&a, e, &sig), Err(LinkError::BadSignature));
        // Past, too far ahead, malformed.
        let past = s.sign_until(&a, "/", now() - 1);
        let (e, sig) = query(&past);
        assert_eq!(s.precheck(&e, &sig), Err(LinkError::Expired));
        let far = s.sign_until(&a, "/", now() + 86400 * 2);
        let (e, sig) = query(&far);
        assert_eq!(s.precheck(&e, &sig), Err(LinkError::TooFarAhead));
        assert!(matches!(
            s.precheck("soon", &signature),
            Err(LinkError::Malformed(_))
        ));
        assert!(matches!(
            s.precheck(&expires, "not base64!"),
            Err(LinkError::Malformed(_))
        ));
        assert!(matches!(
            s.precheck(&expires, "AAAA"),
            Err(LinkError::Malformed(_))
        ));
    }

    #[test]
    fn single_links_last_what_is_asked_within_the_maximum() {
        let s = signer();
        let a = artifact("a1", Some("acme"));
        let link = s.sign_for(&a, "/", Duration::from_secs(60)).unwrap();
        let expires = link.expires;
        assert!(expires >= now() + 59 && expires <= now() + 60, "{expires}");
        assert_eq!(check(&s, &a, &link), Ok(()));
        assert_eq!(
            s.sign_for(&a, "/", Duration::from_secs(86401)),
            Err(LinkError::TtlTooLong {
                asked: 86401,
                max: 86400
            })
        );
        assert_eq!(s.sign_for(&a, "/", Duration::ZERO), Err(LinkError::TtlZero));
    }

    #[test]
    fn owners_cannot_stand_for_each_other() {
        // A tenant name that would read as another owner plus fields in a joined string.
        let s = signer();
        let a = artifact("a1", Some("x\n1"));
        let b = artifact("a1", Some("x"));
        let link = s.sign(&a, "/");
        assert_eq!(check(&s, &b, &link), Err(LinkError::BadSignature));
        assert_ne!(
            s.signature("a1", Some("-"), 5),
            s.signature("a1", None, 5),
            "the admin's mark is not a tenant named '-'"
        );
    }

    #[test]
    fn derived_keys_differ_from_their_secret_and_each_other() {
        let k1 = LinkSigner::derive_key(b"token");
        assert_ne!(k1, b"token".to_vec());
        assert_ne!(k1, LinkSigner::derive_key(b"token2"));
        assert_eq!(k1, LinkSigner::derive_key(b"token"));
        assert_ne!(LinkSigner::random_key(), LinkSigner::random_key());
    }
}
