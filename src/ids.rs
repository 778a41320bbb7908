//! Identifiers of the gateway's objects, each with one parser: a kernel's id (which is also
//! its API v1 session's id) is a UUID in its hyphenated lowercase form, as the gateway makes
//! them; anything else in a path is not one of ours and is answered like an unknown kernel.

use std::fmt;

/// Why a string is not an id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a kernel id (a UUID)")]
pub struct IdError(String);

/// A kernel's id (and its session's).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelId(String);

impl KernelId {
    /// A new random id.
    pub fn random() -> KernelId {
        KernelId(uuid::Uuid::new_v4().hyphenated().to_string())
    }

    /// The id `text` names, when it is one: 36 characters, lowercase hex digits in groups of
    /// 8-4-4-4-12 joined by hyphens. Upper case is refused rather than folded, so that one
    /// kernel has one spelling (ids are map keys and path segments).
    pub fn parse(text: &str) -> Result<KernelId, IdError> {
        let groups: Vec<&str> = text.split('-').collect();
        let shaped = groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
            && groups.iter().all(|g| {
                g.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            });
        if shaped {
            Ok(KernelId(text.to_owned()))
        } else {
            Err(IdError(text.chars().take(80).collect()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KernelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<KernelId> for String {
    fn from(id: KernelId) -> String {
        id.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_ids_are_uuids_in_one_spelling() {
        let made = KernelId::random();
        assert_eq!(KernelId::parse(made.as_str()), Ok(made.clone()));
        assert!(KernelId::parse("bc240c7a-232d-46b9-87f3-1a30b514780b").is_ok());
        for bad in [
            "",
            "abc",
            "a-b-c-d-e",
            "BC240C7A-232D-46B9-87F3-1A30B514780B",
            "bc240c7a-232d-46b9-87f3-1a30b514780b-",
            "bc240c7a232d46b987f31a30b514780b",
            "bc240c7a-232d-46b9-87f3-1a30b51478../",
            "bc240c7a-232d-46b9-87f3-1a30b514780g",
        ] {
            assert!(KernelId::parse(bad).is_err(), "{bad:?} parsed");
        }
        let long = "x".repeat(500);
        // An error quotes at most 80 characters of what it was given.
        assert!(KernelId::parse(&long).unwrap_err().to_string().len() < 120);
    }
}
