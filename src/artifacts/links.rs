//! Signed links to artifacts: URLs a browser can put in `<img src>` with no credential.
//!
//! A chat page that shows a chart must not hold the gateway's token (or a tenant's JWT) just
//! to fetch an image, and `<img>` cannot send an `Authorization` header anyway. A link is the
//! artifact's id, an expiry, a tag of the artifact's owner and an HMAC-SHA256 over all three:
//!
//! ```text
//! <base>v1/artifacts/<id>/signed?expires=<unix seconds>&owner=<tag>&signature=<mac>
//! tag       = HMAC(key, "cellgate artifact owner v1\n" owner)[..16]
//! signature = HMAC(key, "cellgate artifact link v1\n" id "\n" tag "\n" expires)
//! ```
//!
//! (`owner` is `t`, the tenant name's length as 8 bytes big-endian, and the name, or `-` for
//! the admin's sessions; tag and signature are base64url without padding.)
//!
//! - **Bound to one artifact and its tenant.** The id and the owner's tag are under the MAC,
//!   and the gateway that holds the artifact checks the tag against the artifact's owner: a
//!   link opens nothing else. The tag, not the name, travels: a link does not say which
//!   tenant it is from.
//! - **Checked anywhere, before anything is looked up.** Everything the MAC covers is in the
//!   URL, so any gateway with the key refuses a forged or altered link at once
//!   ([`LinkSigner::check`]); replicas ask each other only for links that verified (marked
//!   `VerifiedLink` at the HTTP edge). A bad link answers 404 exactly as an unknown id, so a
//!   link reveals nothing about other artifacts.
//! - **Expiring.** `expires` is under the MAC; a link past it is refused. The gateway signs
//!   for `ttl` (default an hour) in every artifact reference it gives out, and for up to
//!   `max_ttl` when a client asks for one link ([`LinkSigner::sign_for`]).
//! - **Revocable.** A link opens an artifact of a live session only
//!   (`ArtifactStore::get_linkable`): a client's `DELETE` of the session revokes every link
//!   to its artifacts at once, though the authenticated API keeps them fetchable for the
//!   retention period; a session that ended otherwise (a one-shot execute, a culled kernel)
//!   keeps its links until they expire or its artifacts go. Changing the key revokes every
//!   link.
//! - **The key.** `--artifact-link-key-file` (shared by replicas behind one load balancer),
//!   else one derived from the gateway's token (replicas share that too), else from the JWT
//!   HMAC secret, else a random key per process (links die with it). A derived key is
//!   HMAC(secret, a fixed label): a link says nothing about the secret.
//!
//! Comparisons are constant-time (`hmac`'s `verify_slice`, `subtle` for the tag); an expiry
//! further ahead than `max_ttl` allows is refused (a link cannot outlive the setting that
//! made it), and so is any spelling of a number but the canonical one (one URL per link).
//!
//! The signed route (`GET /v1/artifacts/{id}/signed`) is the only public route that serves
//! tenant data: it is outside the auth layer by design, and its fetch spends the owner
//! tenant's request rate.
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
/// What an owner's tag covers first.
const OWNER_LABEL: &str = "cellgate artifact owner v1";
/// Bytes of an owner's tag: enough that no two owners' tags meet.
const TAG_BYTES: usize = 16;
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
        let tag = self.owner_tag(artifact.owner.as_deref());
        let signature = URL_SAFE_NO_PAD.encode(self.signature(artifact.id.as_str(), &tag, expires));
        let tag = URL_SAFE_NO_PAD.encode(tag);
        Link {
            url: format!(
                "{base_url}v1/artifacts/{}/signed?expires={expires}&owner={tag}&signature={signature}",
                artifact.id
            ),
            expires,
        }
    }

    /// Checks a link to artifact `id` from its query values alone: the shape, the expiry and
    /// the MAC. What it answers still has to be the artifact's owner's ([`Self::owned_by`]).
    pub fn check(
        &self,
        id: &str,
        expires: &str,
        owner: &str,
        signature: &str,
    ) -> Result<Checked, LinkError> {
        let canonical = !expires.is_empty()
            && expires.len() <= 20
            && expires.bytes().all(|b| b.is_ascii_digit())
            && !(expires.len() > 1 && expires.starts_with('0'));
        let expires: u64 = expires
            .parse()
            .ok()
            .filter(|_| canonical)
            .ok_or(LinkError::Malformed("expires is not a number of seconds"))?;
        let owner: [u8; TAG_BYTES] = URL_SAFE_NO_PAD
            .decode(owner)
            .ok()
            .and_then(|tag| tag.try_into().ok())
            .ok_or(LinkError::Malformed("owner is not a tag"))?;
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
        let mut mac = keyed(&self.key);
        feed(&mut mac, id, &owner, expires);
        mac.verify_slice(&signature)
            .map_err(|_| LinkError::BadSignature)?;
        Ok(Checked { owner, expires })
    }

    /// Whether a checked link names `artifact`'s owner.
    pub fn owned_by(&self, checked: &Checked, artifact: &Artifact) -> bool {
        use subtle::ConstantTimeEq;
        self.owner_tag(artifact.owner.as_deref())
            .ct_eq(&checked.owner)
            .into()
    }

    fn owner_tag(&self, owner: Option<&str>) -> [u8; TAG_BYTES] {
        let mut mac = keyed(&self.key);
        mac.update(OWNER_LABEL.as_bytes());
        mac.update(b"\n");
        match owner {
            // Length-prefixed, so no tenant's name can stand for another's (JWT claims may
            // hold any byte), and the admin's mark is no tenant's name.
            Some(tenant) => {
                mac.update(b"t");
                mac.update(&(tenant.len() as u64).to_be_bytes());
                mac.update(tenant.as_bytes());
            }
            None => mac.update(b"-"),
        }
        let full: [u8; 32] = mac.finalize().into_bytes().into();
        let mut tag = [0u8; TAG_BYTES];
        tag.copy_from_slice(&full[..TAG_BYTES]);
        tag
    }

    fn signature(&self, id: &str, tag: &[u8; TAG_BYTES], expires: u64) -> [u8; 32] {
        let mut mac = keyed(&self.key);
        feed(&mut mac, id, tag, expires);
        mac.finalize().into_bytes().into()
    }
}

/// A link whose MAC and expiry hold; its owner's tag is still to be compared.
#[derive(Debug)]
pub struct Checked {
    owner: [u8; TAG_BYTES],
    expires: u64,
}

impl Checked {
    /// Seconds the link still works.
    pub fn remaining_secs(&self) -> u64 {
        self.expires.saturating_sub(now())
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

/// The signed message.
fn feed(mac: &mut HmacSha256, id: &str, tag: &[u8; TAG_BYTES], expires: u64) {
    mac.update(LABEL.as_bytes());
    mac.update(b"\n");
    mac.update(id.as_bytes());
    mac.update(b"\n");
    mac.update(tag);
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

    /// An artifact named by a short tag (`a1`, `a2`): its id is the tag padded with zeros.
    fn artifact(tag: &str, owner: Option<&str>) -> Artifact {
        Artifact {
            id: crate::ids::ArtifactId::parse(&format!("{tag:0>32}")).unwrap(),
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

    fn query(link: &Link) -> (String, String, String, String) {
        let (path, query) = link.url.split_once('?').unwrap();
        let id = path.split('/').rev().nth(1).unwrap().to_owned();
        let mut fields = std::collections::HashMap::new();
        for pair in query.split('&') {
            let (k, v) = pair.split_once('=').unwrap();
            fields.insert(k.to_owned(), v.to_owned());
        }
        assert_eq!(fields.len(), 3, "{}", link.url);
        (
            id,
            fields["expires"].clone(),
            fields["owner"].clone(),
            fields["signature"].clone(),
        )
    }

    /// What the holder of `artifact` answers to `link`.
    fn check(signer: &LinkSigner, artifact: &Artifact, link: &Link) -> Result<(), LinkError> {
        let (_, expires, owner, signature) = query(link);
        let checked = signer.check(artifact.id.as_str(), &expires, &owner, &signature)?;
        if signer.owned_by(&checked, artifact) {
            Ok(())
        } else {
            Err(LinkError::BadSignature)
        }
    }

    #[test]
    fn a_link_opens_its_artifact_only() {
        let s = signer();
        let a = artifact("a1", Some("acme"));
        let link = s.sign(&a, "/gw/");
        assert!(link
            .url
            .starts_with(&format!("/gw/v1/artifacts/{}/signed?expires=", a.id)));
        assert!(
            !link.url.contains("acme"),
            "the tenant's name stays out of the link"
        );
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
    fn altered_or_expired_links_are_refused_from_the_link_alone() {
        let s = signer();
        let a = artifact("a1", None);
        let link = s.sign(&a, "/");
        let (id, expires, owner, signature) = query(&link);
        assert!(s.check(&id, &expires, &owner, &signature).is_ok());
        // A later expiry under the old signature.
        let later = (expires.parse::<u64>().unwrap() + 1).to_string();
        assert_eq!(
            s.check(&id, &later, &owner, &signature).unwrap_err(),
            LinkError::BadSignature
        );
        // Another spelling of the same expiry.
        for spelling in [
            format!("0{expires}"),
            format!("+{expires}"),
            format!("{expires} "),
        ] {
            assert!(matches!(
                s.check(&id, &spelling, &owner, &signature),
                Err(LinkError::Malformed(_))
            ));
        }
        // Another owner's tag (a tenant's on the admin's link).
        let tenant_tag = URL_SAFE_NO_PAD.encode(s.owner_tag(Some("acme")));
        assert_eq!(
            s.check(&id, &expires, &tenant_tag, &signature).unwrap_err(),
            LinkError::BadSignature
        );
        // One character of the signature changed.
        let mut bad = signature.clone().into_bytes();
        bad[0] = if bad[0] == b'A' { b'B' } else { b'A' };
        let bad = String::from_utf8(bad).unwrap();
        assert_eq!(
            s.check(&id, &expires, &owner, &bad).unwrap_err(),
            LinkError::BadSignature
        );
        // Past, too far ahead, malformed.
        let (_, e, o, sig) = query(&s.sign_until(&a, "/", now() - 1));
        assert_eq!(s.check(&id, &e, &o, &sig).unwrap_err(), LinkError::Expired);
        let (_, e, o, sig) = query(&s.sign_until(&a, "/", now() + 86400 * 2));
        assert_eq!(
            s.check(&id, &e, &o, &sig).unwrap_err(),
            LinkError::TooFarAhead
        );
        for (e, o, sig) in [
            ("soon", owner.as_str(), signature.as_str()),
            ("", owner.as_str(), signature.as_str()),
            (expires.as_str(), "AAAA", signature.as_str()),
            (expires.as_str(), owner.as_str(), "not base64!"),
            (expires.as_str(), owner.as_str(), "AAAA"),
        ] {
            assert!(
                matches!(s.check(&id, e, o, sig), Err(LinkError::Malformed(_))),
                "{e} {o} {sig}"
            );
        }
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
        let s = signer();
        let a = artifact("a1", Some("x\n1"));
        let b = artifact("a1", Some("x"));
        let link = s.sign(&a, "/");
        assert_eq!(check(&s, &b, &link), Err(LinkError::BadSignature));
        assert_ne!(
            s.owner_tag(Some("-")),
            s.owner_tag(None),
            "the admin's mark is not a tenant named '-'"
        );
        assert_ne!(s.owner_tag(Some("t:u")), s.owner_tag(Some("t")));
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
