//! HMAC message signing (`signature_scheme: hmac-sha256`).
//!
//! The key is the UTF-8 bytes of the connection file's `key` string, not a hex decoding of it.
//! The signature covers header, parent header, metadata and content, in that order, and never
//! the buffers. An empty key disables signing, as in jupyter_client.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Signs and verifies messages with one kernel's key. Cloning is cheap.
#[derive(Clone)]
pub struct Signer {
    mac: Option<HmacSha256>,
}

impl Signer {
    pub fn new(key: &[u8]) -> Signer {
        if key.is_empty() {
            return Signer { mac: None };
        }
        // HMAC accepts keys of any length, so this cannot fail; keep the unsigned fallback
        // rather than a panic all the same.
        Signer {
            mac: HmacSha256::new_from_slice(key).ok(),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.mac.is_some()
    }

    /// Lower-case hex HMAC of the four parts, or an empty signature without a key.
    pub fn sign(&self, parts: [&[u8]; 4]) -> Vec<u8> {
        let Some(mac) = &self.mac else {
            return Vec::new();
        };
        let mut mac = mac.clone();
        for part in parts {
            mac.update(part);
        }
        hex::encode(mac.finalize().into_bytes()).into_bytes()
    }

    /// Constant-time check of a received signature against the received bytes.
    pub fn verify(&self, parts: [&[u8]; 4], signature: &[u8]) -> bool {
        let Some(mac) = &self.mac else {
            return true;
        };
        let mut expected = [0u8; 32];
        if signature.len() != 64 || hex::decode_to_slice(signature, &mut expected).is_err() {
            return false;
        }
        let mut mac = mac.clone();
        for part in parts {
            mac.update(part);
        }
        mac.verify_slice(&expected).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_matches_python_hmac() {
        // Reference value computed with Python: hmac.new(b"key", b"abcd", hashlib.sha256).hexdigest()
        let signer = Signer::new(b"key");
        let sig = signer.sign([b"a", b"b", b"c", b"d"]);
        assert_eq!(
            String::from_utf8(sig).unwrap(),
            "2a31ec0ee8d878c9eece9fb0df79b3b90b2256240163aa5ee50d176d3d1121f8"
        );
    }

    #[test]
    fn verify_rejects_tampering_and_accepts_the_original() {
        let signer = Signer::new(b"secret");
        let parts: [&[u8]; 4] = [b"{\"h\":1}", b"{}", b"{}", b"{\"x\":2}"];
        let sig = signer.sign(parts);
        assert!(signer.verify(parts, &sig));
        let tampered: [&[u8]; 4] = [b"{\"h\":1}", b"{}", b"{}", b"{\"x\":3}"];
        assert!(!signer.verify(tampered, &sig));
        assert!(!signer.verify(parts, b"not-hex"));
        assert!(!signer.verify(parts, &sig[..63]));
        let mut upper = sig.clone();
        upper.make_ascii_uppercase();
        assert!(
            signer.verify(parts, &upper),
            "hex case does not change the digest"
        );
    }

    #[test]
    fn empty_key_disables_signing() {
        let signer = Signer::new(b"");
        assert!(!signer.is_enabled());
        assert!(signer.sign([b"a", b"b", b"c", b"d"]).is_empty());
        assert!(signer.verify([b"a", b"b", b"c", b"d"], b""));
    }
}
