//! What the fuzz targets check, shared with the stable corpus test
//! (tests/decoder_robustness.rs includes this file), so both run the same properties.
//!
//! Beyond "no decoder or encoder panics on any input":
//! - a decoded multipart, re-encoded with the same signer, decodes to the same message;
//! - whatever a legacy client may be sent (`encode_legacy` is Ok) is also valid for v1
//!   clients (`decode_v1` of `encode_v1` is Ok with the same parts) on client channels;
//! - a client frame that decodes re-encodes (both framings) to a frame that decodes to the
//!   same parts.

#![allow(dead_code)]

use bytes::Bytes;
use cellgate::protocol::websocket::{
    decode_legacy_binary, decode_legacy_text, decode_v1, encode_legacy, encode_v1, Frame,
};
use cellgate::protocol::{
    decode_multipart, encode_multipart, Channel, Message, ProtocolError, Signer,
};

/// The key of the keyed signer.
pub const KEY: &[u8] = b"fuzz-key-5f0c1d2e";

const CHANNELS: [Channel; 5] = [
    Channel::Shell,
    Channel::Control,
    Channel::Stdin,
    Channel::Iopub,
    Channel::Heartbeat,
];

/// Splits fuzz input into a channel and frames: byte 0 picks the channel, then each frame is
/// a little-endian u16 length and that many bytes; a short last frame takes what is left.
pub fn split_frames(data: &[u8]) -> (Channel, Vec<Bytes>) {
    let Some((&selector, mut rest)) = data.split_first() else {
        return (Channel::Shell, Vec::new());
    };
    let channel = CHANNELS[usize::from(selector) % CHANNELS.len()];
    let mut frames = Vec::new();
    while !rest.is_empty() {
        if rest.len() < 2 {
            frames.push(Bytes::copy_from_slice(rest));
            break;
        }
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
        let body = &rest[2..];
        let take = len.min(body.len());
        frames.push(Bytes::copy_from_slice(&body[..take]));
        rest = &body[take..];
    }
    (channel, frames)
}

/// The inverse of `split_frames`, to build seeds and mutations from real multiparts.
pub fn join_frames(channel: Channel, frames: &[Bytes]) -> Vec<u8> {
    let selector = CHANNELS.iter().position(|c| *c == channel).unwrap_or(0) as u8;
    let mut out = vec![selector];
    for frame in frames {
        let len = frame.len().min(usize::from(u16::MAX));
        out.extend_from_slice(&(len as u16).to_le_bytes());
        out.extend_from_slice(&frame[..len]);
    }
    out
}

fn parts(message: &Message) -> [&[u8]; 4] {
    [
        &message.header_bytes,
        &message.parent_header_bytes,
        &message.metadata,
        &message.content,
    ]
}

fn assert_same(a: &Message, b: &Message, what: &str) {
    assert_eq!(parts(a), parts(b), "{what}: parts differ");
    assert_eq!(a.buffers, b.buffers, "{what}: buffers differ");
    assert_eq!(a.channel, b.channel, "{what}: channel differs");
    assert_eq!(a.header, b.header, "{what}: header fields differ");
    assert_eq!(a.parent, b.parent, "{what}: parent fields differ");
}

/// Like `assert_same`, for a legacy round trip: each JSON part is embedded in a bigger JSON
/// text and comes back without the whitespace around it.
fn assert_same_json(a: &Message, b: &Message, what: &str) {
    let trimmed = |m: &Message| parts(m).map(|p| p.trim_ascii().to_vec());
    assert_eq!(trimmed(a), trimmed(b), "{what}: parts differ");
    assert_eq!(a.buffers, b.buffers, "{what}: buffers differ");
    assert_eq!(a.channel, b.channel, "{what}: channel differs");
    assert_eq!(a.header, b.header, "{what}: header fields differ");
    assert_eq!(a.parent, b.parent, "{what}: parent fields differ");
}

fn is_client_channel(channel: Channel) -> bool {
    matches!(channel, Channel::Shell | Channel::Control | Channel::Stdin)
}

/// Both encodings of a message, and the properties that link them.
fn encodings(message: &Message) {
    let v1 = encode_v1(message);
    let legacy = encode_legacy(message);
    if !is_client_channel(message.channel) {
        return;
    }
    if let Ok(frame) = &legacy {
        let back = decode_v1(&v1).expect("a message fit for legacy clients is fit for v1");
        assert_same(message, &back, "v1 round trip");
        let back = match frame {
            Frame::Text(text) => decode_legacy_text(text),
            Frame::Binary(bytes) => decode_legacy_binary(bytes),
        }
        .expect("a legacy frame we encode decodes");
        assert_same_json(message, &back, "legacy round trip");
    }
}

/// One multipart from a kernel, decoded with a keyed and an unkeyed signer. Returns how many
/// of the two decoded it.
pub fn multipart(data: &[u8]) -> usize {
    let (channel, frames) = split_frames(data);
    let mut decoded = 0;
    for signer in [Signer::new(KEY), Signer::new(b"")] {
        let Ok(message) = decode_multipart(channel, frames.clone(), &signer) else {
            continue;
        };
        let encoded = encode_multipart(&message, &signer);
        let again = decode_multipart(channel, encoded, &signer)
            .expect("a decoded message re-encodes to one that decodes");
        assert_same(&message, &again, "multipart round trip");
        decoded += 1;
        let _ = message.content_json();
        let _ = message.byte_len();
        encodings(&message);
    }
    decoded
}

/// One WebSocket frame from a client, tried as each framing would receive it. Returns how many
/// of the three decoders accepted it.
pub fn websocket(data: &[u8]) -> usize {
    let decoded: [Result<Message, ProtocolError>; 3] = [
        decode_v1(data),
        decode_legacy_binary(data),
        std::str::from_utf8(data)
            .map_err(|_| ProtocolError::NotUtf8)
            .and_then(decode_legacy_text),
    ];
    let mut accepted = 0;
    for message in decoded.into_iter().flatten() {
        accepted += 1;
        // Whatever a client can send is valid JSON in each part, so both encodings work.
        let v1 = encode_v1(&message);
        let back = decode_v1(&v1).expect("a decoded client message re-encodes for v1");
        assert_same(&message, &back, "v1 re-encoding");
        let frame = encode_legacy(&message).expect("a decoded client message encodes legacy");
        let back = match &frame {
            Frame::Text(text) => decode_legacy_text(text),
            Frame::Binary(bytes) => decode_legacy_binary(bytes),
        }
        .expect("a legacy frame we encode decodes");
        assert_same_json(&message, &back, "legacy re-encoding");
        // And toward the kernel.
        let signer = Signer::new(KEY);
        let frames = encode_multipart(&message, &signer);
        let back = decode_multipart(message.channel, frames, &signer)
            .expect("a client message signed for the kernel verifies");
        assert_same(&message, &back, "multipart of a client message");
    }
    accepted
}

/// A tunnel's first bytes, as the egress proxy reads them: `client_hello::parse` never panics,
/// and it decides the same whatever the cut: every prefix of an input that yields a
/// ClientHello asks for more or yields the same one, never an error (a proxy that reads the
/// hello in pieces, as TCP delivers it, must decide as one that reads it whole). Returns 1
/// when the input is a complete, acceptable ClientHello.
pub fn client_hello(data: &[u8]) -> usize {
    use cellgate::egress::client_hello::parse;
    let Ok(Some(whole)) = parse(data) else {
        return 0;
    };
    // Every cut for small inputs, a spread of them for large ones.
    let step = (data.len() / 256).max(1);
    for end in (0..data.len()).step_by(step) {
        match parse(&data[..end]) {
            Ok(None) => {}
            Ok(Some(prefix)) => {
                assert_eq!(prefix, whole, "a prefix of {end} bytes reads another hello")
            }
            Err(err) => {
                panic!("a prefix of {end} bytes is refused ({err}) though the whole is accepted")
            }
        }
    }
    1
}
