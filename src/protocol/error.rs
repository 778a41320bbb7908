//! Errors of the wire layer: every way a frame from a kernel or a client can be malformed.

/// A message that cannot be relayed, and why. Each variant is a reason to drop one message;
/// none of them is a reason to stop a connection's task.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("no <IDS|MSG> delimiter in a multipart of {frames} frames")]
    MissingDelimiter { frames: usize },
    #[error(
        "{found} frames after the delimiter, at least 5 are needed (signature and four JSON parts)"
    )]
    TooFewParts { found: usize },
    #[error("signature mismatch")]
    BadSignature,
    #[error("the {part} part is not a JSON object: {reason}")]
    BadJson { part: &'static str, reason: String },
    #[error("header lacks a string {field}")]
    MissingHeaderField { field: &'static str },
    #[error("unknown channel {0:?}")]
    UnknownChannel(String),
    #[error("malformed binary frame: {0}")]
    BadFrame(&'static str),
    #[error("frame is not valid UTF-8 JSON")]
    NotUtf8,
}
