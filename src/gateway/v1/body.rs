//! Request bodies of API v1: JSON parsed at the edge with a 400 and serde's own explanation
//! for anything malformed (axum's `Json` answers 415/422, which clients do not expect).

use axum::body::Bytes;
use serde::de::DeserializeOwned;

use super::ApiError;

/// Parses a JSON body; an empty body is `{}`.
pub fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let text: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(text)
        .map_err(|err| ApiError::bad_request(format!("invalid JSON body: {err}")))
}
