//! Identifiers of the gateway's objects, each with one parser, used wherever an id arrives
//! from outside (a URL path, a JSON body, an MCP tool's arguments):
//!
//! - a kernel's id ([`KernelId`]) and its API v1 session's ([`SessionId`], the same string:
//!   a session is its kernel's) are UUIDs in their hyphenated lowercase form, as the gateway
//!   makes them;
//! - an execution's id ([`ExecutionId`], the id of the kernel message that ran it), a shell
//!   command's ([`CommandId`]) and an artifact's ([`ArtifactId`]) are UUIDs in their simple
//!   form: 32 lowercase hex digits.
//!
//! Anything else is not one of ours: callers answer it as they answer an unknown id (the
//! same status and error code), so a malformed id tells a client nothing an unknown one does
//! not. Upper case is refused rather than folded, so that one object has one spelling (ids
//! are map keys and path segments).
//!
//! Each id serialises as its string and deserialises through its parser.

use std::fmt;

/// Why a string is not an id of some kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not {kind}")]
pub struct IdError {
    /// What was wanted, as a sentence says it ("a kernel id (a UUID)").
    kind: &'static str,
    /// At most 80 characters of what was given.
    text: String,
}

/// Whether `text` is a UUID as `Uuid::hyphenated` writes it: lowercase hex digits in groups
/// of 8-4-4-4-12 joined by hyphens.
fn is_hyphenated_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12]) && groups.iter().all(|g| is_hex(g))
}

/// Whether `text` is a UUID as `Uuid::simple` writes it: 32 lowercase hex digits.
fn is_simple_uuid(text: &str) -> bool {
    text.len() == 32 && is_hex(text)
}

fn is_hex(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// An id type: a `String` newtype made only by its parser (or a random one), with the
/// traits every id shares.
macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $shaped:path) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            #[doc = concat!("The id `text` names, when it is ", $kind, ".")]
            pub fn parse(text: &str) -> Result<$name, IdError> {
                if $shaped(text) {
                    Ok($name(text.to_owned()))
                } else {
                    Err(IdError {
                        kind: $kind,
                        text: text.chars().take(80).collect(),
                    })
                }
            }

            /// The id as it is written.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        // Maps keyed by an id can be asked with the id's text (the same hash: a newtype's
        // derived Hash is its String's, which is its str's).
        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdError;

            fn from_str(text: &str) -> Result<$name, IdError> {
                $name::parse(text)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<$name, D::Error> {
                let text = <String as serde::Deserialize>::deserialize(deserializer)?;
                $name::parse(&text).map_err(serde::de::Error::custom)
            }
        }
    };
}

id_type!(
    /// A kernel's id (and its session's: see [`SessionId`]).
    KernelId,
    "a kernel id (a UUID)",
    is_hyphenated_uuid
);

id_type!(
    /// An API v1 session's id: its kernel's id, so that the same session can be opened
    /// through the Kernel Gateway API.
    SessionId,
    "a session id (a UUID)",
    is_hyphenated_uuid
);

id_type!(
    /// An API v1 execution's id: the `msg_id` of its `execute_request`, which the gateway
    /// makes (or a random one when the kernel could not take the request).
    ExecutionId,
    "an execution id (32 hex digits)",
    is_simple_uuid
);

id_type!(
    /// A shell command's id (API v1 `commands`).
    CommandId,
    "a command id (32 hex digits)",
    is_simple_uuid
);

id_type!(
    /// An artifact's id: random, never derived from its content (the same bytes in two
    /// tenants' sessions are two artifacts, and an id reveals nothing about content).
    ArtifactId,
    "an artifact id (32 hex digits)",
    is_simple_uuid
);

impl KernelId {
    /// A new random id.
    pub fn random() -> KernelId {
        KernelId(uuid::Uuid::new_v4().hyphenated().to_string())
    }
}

impl SessionId {
    /// The id of the session of kernel `kernel`.
    pub fn of(kernel: &KernelId) -> SessionId {
        SessionId(kernel.0.clone())
    }

    /// The id of this session's kernel.
    pub fn kernel(&self) -> KernelId {
        KernelId(self.0.clone())
    }
}

impl ExecutionId {
    /// A new random id.
    pub fn random() -> ExecutionId {
        ExecutionId(uuid::Uuid::new_v4().simple().to_string())
    }
}

impl CommandId {
    /// A new random id.
    pub fn random() -> CommandId {
        CommandId(uuid::Uuid::new_v4().simple().to_string())
    }
}

impl ArtifactId {
    /// A new random id.
    pub fn random() -> ArtifactId {
        ArtifactId(uuid::Uuid::new_v4().simple().to_string())
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
            assert!(SessionId::parse(bad).is_err(), "{bad:?} parsed");
        }
        let long = "x".repeat(500);
        // An error quotes at most 80 characters of what it was given.
        assert!(KernelId::parse(&long).unwrap_err().to_string().len() < 120);
        assert_eq!(
            KernelId::parse("abc").unwrap_err().to_string(),
            "\"abc\" is not a kernel id (a UUID)"
        );
    }

    #[test]
    fn a_session_is_named_as_its_kernel() {
        let kernel = KernelId::random();
        let session = SessionId::of(&kernel);
        assert_eq!(session.as_str(), kernel.as_str());
        assert_eq!(session.kernel(), kernel);
        assert_eq!(SessionId::parse(kernel.as_str()), Ok(session));
    }

    #[test]
    fn simple_ids_are_32_lowercase_hex_digits() {
        assert_eq!(ExecutionId::random().as_str().len(), 32);
        let made = ArtifactId::random();
        assert_eq!(ArtifactId::parse(made.as_str()), Ok(made));
        let made = CommandId::random();
        assert_eq!(CommandId::parse(made.as_str()), Ok(made));
        assert!(ExecutionId::parse("0123456789abcdef0123456789abcdef").is_ok());
        for bad in [
            "",
            "a1",
            "0123456789ABCDEF0123456789ABCDEF",
            "0123456789abcdef0123456789abcdef0",
            "0123456789abcdef0123456789abcde/",
            "bc240c7a-232d-46b9-87f3-1a30b514780b",
        ] {
            assert!(ExecutionId::parse(bad).is_err(), "{bad:?} parsed");
            assert!(ArtifactId::parse(bad).is_err(), "{bad:?} parsed");
            assert!(CommandId::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn ids_go_over_the_wire_as_their_text_and_come_back_through_the_parser() {
        let id = ArtifactId::random();
        let wire = serde_json::to_value(&id).unwrap();
        assert_eq!(wire, serde_json::Value::String(id.to_string()));
        assert_eq!(serde_json::from_value::<ArtifactId>(wire).unwrap(), id);
        let refused = serde_json::from_str::<SessionId>("\"../x\"").unwrap_err();
        assert!(
            refused.to_string().contains("is not a session id"),
            "{refused}"
        );
        let from_bytes: SessionId =
            serde_json::from_slice(b"\"bc240c7a-232d-46b9-87f3-1a30b514780b\"").unwrap();
        assert_eq!(from_bytes.as_str(), "bc240c7a-232d-46b9-87f3-1a30b514780b");
    }
}
