//! Request bodies of API v1: JSON parsed at the edge with a 400 and serde's own explanation
//! for anything malformed (axum's `Json` answers 415/422, which clients do not expect).

use axum::body::Bytes;
use serde::de::DeserializeOwned;

use super::ApiError;
use crate::gateway::ErrorCode;

/// Parses a JSON body, which must be an object; an empty body is `{}`.
pub fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let text: &[u8] = match body.iter().find(|b| !b.is_ascii_whitespace()) {
        None => b"{}",
        Some(b'{') => body,
        // serde would also read a struct from an array of its fields in order.
        Some(_) => {
            return Err(
                ApiError::bad_request("invalid JSON body: expected an object")
                    .code(ErrorCode::InvalidJson),
            )
        }
    };
    serde_json::from_slice(text).map_err(|err| {
        ApiError::bad_request(format!("invalid JSON body: {err}")).code(ErrorCode::InvalidJson)
    })
}
