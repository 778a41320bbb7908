//! The ZMQ multipart codec: routing identities, `<IDS|MSG>`, signature, four JSON parts,
//! buffers.
//!
//! From [`PARALLEL_CHECK_BYTES`] (1 MiB) on, a message's signature and its JSON checks run
//! on two threads at once; `kernel/channels.rs` runs them off the async workers.

use bytes::Bytes;

use super::{Channel, Message, ProtocolError, Signer};

/// Separates routing identities from the message proper.
pub const DELIMITER: &[u8] = b"<IDS|MSG>";

/// Decodes one multipart received from a kernel. The signature is checked in constant time
/// over the received bytes before anything else is parsed. Identities are discarded: a client
/// socket only ever talks to one kernel.
pub fn decode_multipart(
    channel: Channel,
    frames: Vec<Bytes>,
    signer: &Signer,
) -> Result<Message, ProtocolError> {
    let total = frames.len();
    let Some(delim) = frames.iter().position(|f| f.as_ref() == DELIMITER) else {
        return Err(ProtocolError::MissingDelimiter { frames: total });
    };
    let after = total - delim - 1;
    if after < 5 {
        return Err(ProtocolError::TooFewParts { found: after });
    }
    let mut rest = frames.into_iter().skip(delim + 1);
    // The length check above guarantees these five frames exist.
    let (Some(signature), Some(header), Some(parent), Some(metadata), Some(content)) = (
        rest.next(),
        rest.next(),
        rest.next(),
        rest.next(),
        rest.next(),
    ) else {
        return Err(ProtocolError::TooFewParts { found: after });
    };
    let buffers = rest.collect();
    let signed = header.len() + parent.len() + metadata.len() + content.len();
    if signed < PARALLEL_CHECK_BYTES || !signer.is_enabled() {
        if !signer.verify([&header, &parent, &metadata, &content], &signature) {
            return Err(ProtocolError::BadSignature);
        }
        return Message::from_parts(channel, header, parent, metadata, content, buffers);
    }
    // Hashing and validating a large message (tens of MB of output) take tens of milliseconds
    // each, and both read the same immutable bytes, so they run on two cores at once. The
    // signature still decides first: a forged message reports BadSignature, whatever its shape.
    let (signature_ok, parsed) = std::thread::scope(|scope| {
        let check =
            scope.spawn(|| signer.verify([&header, &parent, &metadata, &content], &signature));
        let parsed = Message::from_parts(
            channel,
            header.clone(),
            parent.clone(),
            metadata.clone(),
            content.clone(),
            buffers,
        );
        // A panic in the hash is impossible in practice; counting it as a bad signature keeps
        // the message out rather than taking the reader down.
        (check.join().unwrap_or(false), parsed)
    });
    if !signature_ok {
        return Err(ProtocolError::BadSignature);
    }
    parsed
}

/// Signed bytes from which [`decode_multipart`] checks the signature and the JSON in parallel
/// (below it, a thread costs more than it saves).
pub const PARALLEL_CHECK_BYTES: usize = 1 << 20;

/// Encodes a message for a kernel socket: delimiter, a fresh signature over the exact bytes
/// sent, the four parts, the buffers. DEALER sockets add no identity of their own.
pub fn encode_multipart(message: &Message, signer: &Signer) -> Vec<Bytes> {
    let signature = signer.sign([
        &message.header_bytes,
        &message.parent_header_bytes,
        &message.metadata,
        &message.content,
    ]);
    let mut frames = Vec::with_capacity(6 + message.buffers.len());
    frames.push(Bytes::from_static(DELIMITER));
    frames.push(Bytes::from(signature));
    frames.push(message.header_bytes.clone());
    frames.push(message.parent_header_bytes.clone());
    frames.push(message.metadata.clone());
    frames.push(message.content.clone());
    frames.extend(message.buffers.iter().cloned());
    frames
}

#[cfg(test)]
mod tests;
