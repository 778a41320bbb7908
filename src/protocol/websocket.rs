//! The two WebSocket framings of Jupyter messages.
//!
//! *Legacy* (no subprotocol): one JSON object per text frame; a message with buffers is a
//! binary frame of big-endian u32 offsets, the JSON without `buffers`, then the buffers.
//! *v1* (`v1.kernel.websocket.jupyter.org`): every frame binary, little-endian u64 offsets,
//! then channel, header, parent header, metadata, content, buffers.
//! Byte layouts: ../shared/research/gateway-contract.md section 1.11.
//!
//! A message is encoded as pieces that share the kernel's bytes ([`Encoded`]), cut into
//! fragments when it is large: one copy for a small message, none beyond tungstenite's for a
//! fragmented large one.

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

/// A kernel message encoded for one client: the bytes of one WebSocket message as a list of
/// pieces. The kernel's parts are shared (`Bytes` clones), never copied, so a 50 MB stream
/// message is not assembled in memory: small messages are joined into one frame, large ones
/// are sent as fragments cut from the pieces (see [`Encoded::fragments`]).
#[derive(Debug, Clone)]
pub struct Encoded {
    /// A binary message; otherwise text (every piece is then UTF-8 on its own).
    pub binary: bool,
    pieces: Vec<Bytes>,
}

impl Encoded {
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole message in one buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        for piece in &self.pieces {
            out.extend_from_slice(piece);
        }
        out
    }

    /// The message cut into payloads of at most `max` bytes (at least one payload, at least
    /// 4 bytes each), in order. A piece cut whole or in slices is shared, not copied; only
    /// neighbouring small pieces are joined. Text is cut between characters only: RFC 6455
    /// allows a fragment to end inside one, but a client that decodes each fragment would
    /// choke on it.
    pub fn fragments(&self, max: usize) -> Vec<Bytes> {
        let max = max.max(4);
        let mut out = Vec::with_capacity(self.len() / max + 2);
        let mut current: Vec<Bytes> = Vec::new();
        let mut current_len = 0;
        let flush = |current: &mut Vec<Bytes>, current_len: &mut usize, out: &mut Vec<Bytes>| {
            match current.len() {
                0 => {}
                1 => out.append(current),
                _ => {
                    let mut joined = Vec::with_capacity(*current_len);
                    for piece in current.drain(..) {
                        joined.extend_from_slice(&piece);
                    }
                    out.push(Bytes::from(joined));
                }
            }
            *current_len = 0;
        };
        for piece in &self.pieces {
            let mut rest = piece.clone();
            while !rest.is_empty() {
                let mut take = (max - current_len).min(rest.len());
                if !self.binary && take < rest.len() {
                    // Back up to the start of the character that does not fit whole.
                    while take > 0 && (rest[take] & 0xC0) == 0x80 {
                        take -= 1;
                    }
                }
                if take > 0 {
                    current.push(rest.split_to(take));
                    current_len += take;
                }
                if current_len == max || (take == 0 && current_len > 0) {
                    flush(&mut current, &mut current_len, &mut out);
                }
            }
        }
        flush(&mut current, &mut current_len, &mut out);
        if out.is_empty() {
            out.push(Bytes::new());
        }
        out
    }
}

/// Encodes a kernel message in the socket's framing. The JSON parts are spliced in verbatim:
/// [`Message::from_parts`] already refused any part that is not a UTF-8 JSON object, so they
/// are not parsed again on this hot path; for text their UTF-8 is checked once more (a
/// message built by hand must never reach a client as invalid text).
pub fn encode(message: &Message, framing: Framing) -> Result<Encoded, ProtocolError> {
    match framing {
        Framing::V1 => Ok(encode_v1_pieces(message)),
        Framing::Legacy => encode_legacy_pieces(message, false),
        Framing::LegacyTextOnly => encode_legacy_pieces(message, true),
    }
}

fn encode_v1_pieces(message: &Message) -> Encoded {
    let channel = Bytes::from_static(message.channel.as_str().as_bytes());
    let mut parts: Vec<Bytes> = Vec::with_capacity(5 + message.buffers.len());
    parts.push(channel);
    parts.push(message.header_bytes.clone());
    parts.push(message.parent_header_bytes.clone());
    parts.push(message.metadata.clone());
    parts.push(message.content.clone());
    parts.extend(message.buffers.iter().cloned());
    let count = parts.len() + 1;
    let table_len = 8 * (count + 1);
    let mut table = Vec::with_capacity(table_len);
    table.extend_from_slice(&(count as u64).to_le_bytes());
    let mut offset = table_len as u64;
    for part in &parts {
        table.extend_from_slice(&offset.to_le_bytes());
        offset += part.len() as u64;
    }
    table.extend_from_slice(&offset.to_le_bytes());
    let mut pieces = Vec::with_capacity(1 + parts.len());
    pieces.push(Bytes::from(table));
    pieces.extend(parts);
    Encoded {
        binary: true,
        pieces,
    }
}

/// The legacy JSON object as pieces, with `buffers_json` (`[]` or base64 strings) when given.
fn legacy_json_pieces(
    message: &Message,
    buffers_json: Option<&str>,
) -> Result<Vec<Bytes>, ProtocolError> {
    for part in [
        &message.header_bytes,
        &message.parent_header_bytes,
        &message.metadata,
        &message.content,
    ] {
        std::str::from_utf8(part).map_err(|_| ProtocolError::NotUtf8)?;
    }
    let ids = format!(
        ",\"msg_id\":{},\"msg_type\":{},\"parent_header\":",
        serde_json::Value::from(message.msg_id()),
        serde_json::Value::from(message.msg_type())
    );
    let tail = match buffers_json {
        Some(list) => format!(
            ",\"buffers\":{list},\"channel\":\"{}\"}}",
            message.channel.as_str()
        ),
        None => format!(",\"channel\":\"{}\"}}", message.channel.as_str()),
    };
    Ok(vec![
        Bytes::from_static(b"{\"header\":"),
        message.header_bytes.clone(),
        Bytes::from(ids),
        message.parent_header_bytes.clone(),
        Bytes::from_static(b",\"metadata\":"),
        message.metadata.clone(),
        Bytes::from_static(b",\"content\":"),
        message.content.clone(),
        Bytes::from(tail),
    ])
}

/// Legacy: a text message, or a binary one when the message has buffers, unless
/// `text_only`, where buffers travel base64-encoded in the JSON's `buffers` list.
fn encode_legacy_pieces(message: &Message, text_only: bool) -> Result<Encoded, ProtocolError> {
    use base64::Engine;
    if message.buffers.is_empty() {
        return Ok(Encoded {
            binary: false,
            pieces: legacy_json_pieces(message, Some("[]"))?,
        });
    }
    if text_only {
        let encoded: Vec<serde_json::Value> = message
            .buffers
            .iter()
            .map(|b| base64::engine::general_purpose::STANDARD.encode(b).into())
            .collect();
        let list = serde_json::Value::Array(encoded).to_string();
        return Ok(Encoded {
            binary: false,
            pieces: legacy_json_pieces(message, Some(&list))?,
        });
    }
    let json = legacy_json_pieces(message, None)?;
    let json_len: usize = json.iter().map(Bytes::len).sum();
    let count = 1 + message.buffers.len();
    let table_len = 4 * (count + 1);
    let mut table = Vec::with_capacity(table_len);
    table.extend_from_slice(&(count as u32).to_be_bytes());
    let mut offset = table_len as u32;
    table.extend_from_slice(&offset.to_be_bytes());
    offset += json_len as u32;
    for buffer in &message.buffers {
        table.extend_from_slice(&offset.to_be_bytes());
        offset += buffer.len() as u32;
    }
    let mut pieces = Vec::with_capacity(1 + json.len() + message.buffers.len());
    pieces.push(Bytes::from(table));
    pieces.extend(json);
    pieces.extend(message.buffers.iter().cloned());
    Ok(Encoded {
        binary: true,
        pieces,
    })
}

fn into_frame(encoded: Encoded) -> Result<Frame, ProtocolError> {
    let bytes = encoded.to_vec();
    if encoded.binary {
        Ok(Frame::Binary(bytes))
    } else {
        String::from_utf8(bytes)
            .map(Frame::Text)
            .map_err(|_| ProtocolError::NotUtf8)
    }
}

/// Encodes a kernel message for a v1 client in one buffer: the kernel's exact bytes, no
/// parsing.
pub fn encode_v1(message: &Message) -> Vec<u8> {
    encode_v1_pieces(message).to_vec()
}

/// Encodes a message with buffers as a legacy *text* frame, buffers base64-encoded in its
/// `buffers` list. For clients that cannot take binary frames: jupyter_server's gateway relay
/// UTF-8-decodes every frame from the gateway, and one binary frame kills its reader (and every
/// later message of that connection). Widgets that need the raw buffers degrade; the
/// connection survives.
pub fn encode_legacy_text_only(message: &Message) -> Result<Frame, ProtocolError> {
    into_frame(encode_legacy_pieces(message, true)?)
}

/// Encodes a kernel message for a legacy client in one buffer: a text frame, or a binary
/// frame when the message has buffers.
pub fn encode_legacy(message: &Message) -> Result<Frame, ProtocolError> {
    into_frame(encode_legacy_pieces(message, false)?)
}

#[cfg(test)]
mod tests;
