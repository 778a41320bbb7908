//! The two WebSocket framings of Jupyter messages.
//!
//! *Legacy* (no subprotocol): one JSON object per text frame; a message with buffers is a
//! binary frame of big-endian u32 offsets, the JSON without `buffers`, then the buffers.
//! *v1* (`v1.kernel.websocket.jupyter.org`): every frame binary, little-endian u64 offsets,
//! then channel, header, parent header, metadata, content, buffers.
//! Byte layouts: ../shared/research/gateway-contract.md section 1.11.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Channel, Message, ProtocolError};

/// The subprotocol name of the v1 framing.
pub const V1_SUBPROTOCOL: &str = "v1.kernel.websocket.jupyter.org";

/// Which framing a WebSocket connection speaks, fixed at the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Legacy,
    /// Legacy, but never a binary frame (see [`encode_legacy_text_only`]).
    LegacyTextOnly,
    V1,
}

/// One frame to send to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Text(String),
    Binary(Vec<u8>),
}

#[derive(Deserialize)]
struct LegacyMessage<'a> {
    #[serde(borrow)]
    header: &'a RawValue,
    #[serde(borrow, default)]
    parent_header: Option<&'a RawValue>,
    #[serde(borrow, default)]
    metadata: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    channel: Option<Cow<'a, str>>,
}

fn object_part(raw: Option<&RawValue>, part: &'static str) -> Result<Bytes, ProtocolError> {
    match raw {
        None => Ok(Bytes::from_static(b"{}")),
        Some(raw) if raw.get().starts_with('{') => Ok(Bytes::copy_from_slice(raw.get().as_bytes())),
        Some(raw) if raw.get() == "null" && part == "parent_header" => {
            Ok(Bytes::from_static(b"{}"))
        }
        Some(_) => Err(ProtocolError::BadJson {
            part,
            reason: "expected an object".to_owned(),
        }),
    }
}

fn client_channel(name: Option<&str>) -> Result<Channel, ProtocolError> {
    // jupyter_server assumes shell when a legacy client omits the channel.
    match Channel::parse(name.unwrap_or("shell"))? {
        Channel::Heartbeat | Channel::Iopub => Err(ProtocolError::UnknownChannel(
            name.unwrap_or_default().to_owned(),
        )),
        channel => Ok(channel),
    }
}

fn legacy_json(json: &[u8], buffers: Vec<Bytes>) -> Result<Message, ProtocolError> {
    let msg: LegacyMessage<'_> =
        serde_json::from_slice(json).map_err(|err| ProtocolError::BadJson {
            part: "message",
            reason: err.to_string(),
        })?;
    let channel = client_channel(msg.channel.as_deref())?;
    let header = object_part(Some(msg.header), "header")?;
    Message::from_parts(
        channel,
        header,
        object_part(msg.parent_header, "parent_header")?,
        object_part(msg.metadata, "metadata")?,
        object_part(msg.content, "content")?,
        buffers,
    )
}

/// Decodes a legacy text frame from a client.
pub fn decode_legacy_text(text: &str) -> Result<Message, ProtocolError> {
    legacy_json(text.as_bytes(), Vec::new())
}

/// Decodes a legacy binary frame (a message with buffers) from a client.
pub fn decode_legacy_binary(frame: &[u8]) -> Result<Message, ProtocolError> {
    let parts = split_offsets(frame, 4, false, |b| {
        u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as u64
    })?;
    let mut parts = parts.into_iter();
    let Some(json) = parts.next() else {
        return Err(ProtocolError::BadFrame("no JSON part"));
    };
    legacy_json(json, parts.map(Bytes::copy_from_slice).collect())
}

/// Decodes a v1 frame from a client.
pub fn decode_v1(frame: &[u8]) -> Result<Message, ProtocolError> {
    let parts = split_offsets(frame, 8, true, |b| {
        u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    })?;
    if parts.len() < 5 {
        return Err(ProtocolError::BadFrame(
            "fewer than five parts (channel and four JSON parts)",
        ));
    }
    let channel_name = std::str::from_utf8(parts[0]).map_err(|_| ProtocolError::NotUtf8)?;
    let channel = client_channel(Some(channel_name))?;
    Message::from_parts(
        channel,
        Bytes::copy_from_slice(parts[1]),
        Bytes::copy_from_slice(parts[2]),
        Bytes::copy_from_slice(parts[3]),
        Bytes::copy_from_slice(parts[4]),
        parts[5..]
            .iter()
            .map(|p| Bytes::copy_from_slice(p))
            .collect(),
    )
}

/// Splits a frame laid out as `count, offset[count], parts…` where each part runs from its
/// offset to the next one. With `end_offset` (v1) the last offset marks the end of the frame;
/// without it (legacy) the last part runs to the end.
fn split_offsets(
    frame: &[u8],
    width: usize,
    end_offset: bool,
    read: impl Fn(&[u8]) -> u64,
) -> Result<Vec<&[u8]>, ProtocolError> {
    if frame.len() < width {
        return Err(ProtocolError::BadFrame("shorter than its offset count"));
    }
    let count = read(&frame[..width]);
    let table_end = (count as u128 + 1) * width as u128;
    if count == 0 || table_end > frame.len() as u128 {
        return Err(ProtocolError::BadFrame(
            "offset table does not fit the frame",
        ));
    }
    let count = count as usize;
    let mut offsets = Vec::with_capacity(count + 1);
    for i in 0..count {
        let at = width * (i + 1);
        offsets.push(read(&frame[at..at + width]));
    }
    let len = frame.len() as u64;
    if offsets[0] < table_end as u64 {
        return Err(ProtocolError::BadFrame(
            "first part overlaps the offset table",
        ));
    }
    if offsets.windows(2).any(|w| w[0] > w[1]) || offsets.iter().any(|&o| o > len) {
        return Err(ProtocolError::BadFrame(
            "offsets out of order or out of bounds",
        ));
    }
    if end_offset {
        if offsets.last() != Some(&len) {
            return Err(ProtocolError::BadFrame(
                "last offset is not the frame length",
            ));
        }
    } else {
        offsets.push(len);
    }
    Ok(offsets
        .windows(2)
        .map(|w| &frame[w[0] as usize..w[1] as usize])
        .collect())
}

/// Encodes a kernel message for a v1 client: the kernel's exact bytes, no parsing.
pub fn encode_v1(message: &Message) -> Vec<u8> {
    let channel = message.channel.as_str().as_bytes();
    let mut parts: Vec<&[u8]> = Vec::with_capacity(5 + message.buffers.len());
    parts.push(channel);
    parts.push(&message.header_bytes);
    parts.push(&message.parent_header_bytes);
    parts.push(&message.metadata);
    parts.push(&message.content);
    parts.extend(message.buffers.iter().map(|b| b.as_ref()));
    let count = parts.len() + 1;
    let table = 8 * (count + 1);
    let body: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(table + body);
    out.extend_from_slice(&(count as u64).to_le_bytes());
    let mut offset = table as u64;
    for part in &parts {
        out.extend_from_slice(&offset.to_le_bytes());
        offset += part.len() as u64;
    }
    out.extend_from_slice(&offset.to_le_bytes());
    for part in &parts {
        out.extend_from_slice(part);
    }
    out
}

/// Encodes a message with buffers as a legacy *text* frame, buffers base64-encoded in its
/// `buffers` list. For clients that cannot take binary frames: jupyter_server's gateway relay
/// UTF-8-decodes every frame from the gateway, and one binary frame kills its reader (and every
/// later message of that connection). Widgets that need the raw buffers degrade; the
/// connection survives.
pub fn encode_legacy_text_only(message: &Message) -> Result<Frame, ProtocolError> {
    use base64::Engine;
    if message.buffers.is_empty() {
        return encode_legacy(message);
    }
    let mut without = message.clone();
    without.buffers = Vec::new();
    let Frame::Text(json) = encode_legacy(&without)? else {
        return Err(ProtocolError::BadFrame("expected a text frame"));
    };
    let encoded: Vec<serde_json::Value> = message
        .buffers
        .iter()
        .map(|b| base64::engine::general_purpose::STANDARD.encode(b).into())
        .collect();
    let list = serde_json::Value::Array(encoded).to_string();
    // encode_legacy wrote `"buffers":[]` once, right before the channel.
    Ok(Frame::Text(json.replacen(
        ",\"buffers\":[],\"channel\":",
        &format!(",\"buffers\":{list},\"channel\":"),
        1,
    )))
}

/// Encodes a kernel message for a legacy client: a text frame, or a binary frame when the
/// message has buffers. The JSON parts are spliced in verbatim: [`Message::from_parts`]
/// already refused any part that is not a UTF-8 JSON object, so they are not parsed again on
/// this hot path (only the UTF-8 view is taken, which a `String` needs).
pub fn encode_legacy(message: &Message) -> Result<Frame, ProtocolError> {
    fn text(b: &Bytes) -> Result<&str, ProtocolError> {
        std::str::from_utf8(b).map_err(|_| ProtocolError::NotUtf8)
    }
    let (header, parent, metadata, content) = (
        text(&message.header_bytes)?,
        text(&message.parent_header_bytes)?,
        text(&message.metadata)?,
        text(&message.content)?,
    );
    let mut json = String::with_capacity(message.byte_len() + 128);
    json.push_str("{\"header\":");
    json.push_str(header);
    json.push_str(",\"msg_id\":");
    json.push_str(&serde_json::Value::from(message.msg_id()).to_string());
    json.push_str(",\"msg_type\":");
    json.push_str(&serde_json::Value::from(message.msg_type()).to_string());
    json.push_str(",\"parent_header\":");
    json.push_str(parent);
    json.push_str(",\"metadata\":");
    json.push_str(metadata);
    json.push_str(",\"content\":");
    json.push_str(content);
    if message.buffers.is_empty() {
        json.push_str(",\"buffers\":[],\"channel\":\"");
        json.push_str(message.channel.as_str());
        json.push_str("\"}");
        return Ok(Frame::Text(json));
    }
    json.push_str(",\"channel\":\"");
    json.push_str(message.channel.as_str());
    json.push_str("\"}");
    let count = 1 + message.buffers.len();
    let table = 4 * (count + 1);
    let mut out = Vec::with_capacity(table + message.byte_len() + 128);
    out.extend_from_slice(&(count as u32).to_be_bytes());
    let mut offset = table as u32;
    out.extend_from_slice(&offset.to_be_bytes());
    offset += json.len() as u32;
    for buffer in &message.buffers {
        out.extend_from_slice(&offset.to_be_bytes());
        offset += buffer.len() as u32;
    }
    out.extend_from_slice(json.as_bytes());
    for buffer in &message.buffers {
        out.extend_from_slice(buffer);
    }
    Ok(Frame::Binary(out))
}

#[cfg(test)]
mod tests;
