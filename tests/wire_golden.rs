//! Golden wire vectors: raw ZMQ multiparts captured from a real ipykernel 7.4 with a known key
//! (tests/fixtures/ipykernel-7.4-multipart.json, made by tests/fixtures/capture_ipykernel.py),
//! decoded and re-encoded by cellgate's codec.
//!
//! Checks, for every captured message: the signature verifies with the key; header and parent
//! routing fields match what Python parsed; re-encoding gives byte-identical frames after the
//! delimiter (signature included); flipping any byte of the four signed parts, or of the
//! signature, fails verification; buffers are not signed; both WebSocket encodings carry the
//! kernel's exact JSON.

use bytes::Bytes;
use cellgate::protocol::websocket::{
    decode_legacy_binary, decode_legacy_text, decode_v1, encode_legacy, encode_v1, Frame,
};
use cellgate::protocol::{
    decode_multipart, encode_multipart, Channel, Message, ProtocolError, Signer, DELIMITER,
};
use serde_json::Value;

const FIXTURE: &str = include_str!("fixtures/ipykernel-7.4-multipart.json");

struct Captured {
    channel: Channel,
    direction: String,
    msg_type: String,
    msg_id: String,
    parent_msg_id: Option<String>,
    identities: usize,
    buffers: usize,
    frames: Vec<Bytes>,
}

impl Captured {
    fn label(&self) -> String {
        format!(
            "{} {} {} {}",
            self.direction,
            self.channel,
            self.msg_type,
            &self.msg_id[..self.msg_id.len().min(12)]
        )
    }

    /// The frames from the delimiter on: what the codec encodes.
    fn wire(&self) -> &[Bytes] {
        &self.frames[self.identities..]
    }

    fn part(&self, i: usize) -> &[u8] {
        &self.frames[self.identities + 2 + i]
    }
}

fn base64_decode(text: &str) -> Vec<u8> {
    fn value(c: u8) -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            other => panic!("not base64: {:?}", other as char),
        }
    }
    let bytes = text.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= value(c) << (18 - 6 * i);
        }
        let n = chunk.len() - 1;
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + n]);
    }
    out
}

fn fixture() -> (Value, Vec<Captured>) {
    let doc: Value = serde_json::from_str(FIXTURE).expect("the fixture is JSON");
    let messages = doc["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            let s = |k: &str| m[k].as_str().expect(k).to_owned();
            Captured {
                channel: Channel::parse(m["channel"].as_str().expect("channel")).expect("channel"),
                direction: s("direction"),
                msg_type: s("msg_type"),
                msg_id: s("msg_id"),
                parent_msg_id: m["parent_msg_id"].as_str().map(str::to_owned),
                identities: m["identities"].as_u64().expect("identities") as usize,
                buffers: m["buffers"].as_u64().expect("buffers") as usize,
                frames: m["frames"]
                    .as_array()
                    .expect("frames")
                    .iter()
                    .map(|f| Bytes::from(base64_decode(f.as_str().expect("frame"))))
                    .collect(),
            }
        })
        .collect();
    (doc, messages)
}

fn signer(doc: &Value) -> Signer {
    Signer::new(doc["key"].as_str().expect("key").as_bytes())
}

fn decode(captured: &Captured, signer: &Signer) -> Message {
    decode_multipart(captured.channel, captured.frames.clone(), signer)
        .unwrap_or_else(|err| panic!("{}: {err}", captured.label()))
}

fn json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).expect("JSON part")
}

#[test]
fn base64_decoder_matches_known_vectors() {
    assert_eq!(base64_decode("PElEU3xNU0c+"), b"<IDS|MSG>");
    assert_eq!(base64_decode(""), b"");
    assert_eq!(base64_decode("YQ=="), b"a");
    assert_eq!(base64_decode("YWI="), b"ab");
    assert_eq!(base64_decode("YWJj"), b"abc");
    assert_eq!(base64_decode("/+8A"), [0xff, 0xef, 0x00]);
}

#[test]
fn the_fixture_covers_what_the_tests_rely_on() {
    let (doc, messages) = fixture();
    assert_eq!(doc["signature_scheme"], "hmac-sha256");
    assert!(
        doc["ipykernel"].as_str().unwrap().starts_with("7.4"),
        "{}",
        doc["ipykernel"]
    );
    assert!(messages.len() >= 30, "{} messages", messages.len());
    let has = |direction: &str, channel: Channel, msg_type: &str| {
        messages
            .iter()
            .any(|m| m.direction == direction && m.channel == channel && m.msg_type == msg_type)
    };
    for msg_type in [
        "status",
        "execute_input",
        "stream",
        "display_data",
        "update_display_data",
        "execute_result",
        "error",
        "comm_msg",
    ] {
        assert!(has("received", Channel::Iopub, msg_type), "{msg_type}");
    }
    assert!(has("received", Channel::Shell, "kernel_info_reply"));
    assert!(has("received", Channel::Shell, "execute_reply"));
    assert!(has("received", Channel::Control, "kernel_info_reply"));
    assert!(has("received", Channel::Stdin, "input_request"));
    assert!(has("sent", Channel::Stdin, "input_reply"));
    assert!(has("sent", Channel::Shell, "execute_request"));
    for direction in ["sent", "received"] {
        assert!(
            messages
                .iter()
                .any(|m| m.direction == direction && m.buffers > 1),
            "{direction} messages with several buffers"
        );
    }
    assert!(
        messages
            .iter()
            .any(|m| m.channel == Channel::Iopub && m.identities == 1),
        "iopub topics"
    );
    for m in &messages {
        assert_eq!(m.frames[m.identities].as_ref(), DELIMITER, "{}", m.label());
        assert_eq!(
            m.frames.len(),
            m.identities + 6 + m.buffers,
            "{}",
            m.label()
        );
    }
}

#[test]
fn every_captured_multipart_decodes_with_its_signature_verified() {
    let (doc, messages) = fixture();
    let signer = signer(&doc);
    let wrong = Signer::new(b"not-the-key");
    for captured in &messages {
        let message = decode(captured, &signer);
        let label = captured.label();
        assert_eq!(message.channel, captured.channel, "{label}");
        assert_eq!(message.msg_type(), captured.msg_type, "{label}");
        assert_eq!(message.msg_id(), captured.msg_id, "{label}");
        assert_eq!(
            message.parent_msg_id(),
            captured.parent_msg_id.as_deref(),
            "{label}"
        );
        // The parts are the captured bytes, untouched.
        for (i, part) in [
            &message.header_bytes,
            &message.parent_header_bytes,
            &message.metadata,
            &message.content,
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(part.as_ref(), captured.part(i), "{label} part {i}");
        }
        assert_eq!(message.buffers.len(), captured.buffers, "{label}");
        assert_eq!(
            message.buffers.as_slice(),
            &captured.frames[captured.identities + 6..],
            "{label}"
        );
        let header = json(&message.header_bytes);
        assert_eq!(
            header["session"],
            message.header.session.as_str(),
            "{label}"
        );
        assert_eq!(
            decode_multipart(captured.channel, captured.frames.clone(), &wrong).err(),
            Some(ProtocolError::BadSignature),
            "{label} with another key"
        );
    }
    // Replies and outputs point at the requests we sent.
    let sent: std::collections::HashMap<&str, &Captured> = messages
        .iter()
        .filter(|m| m.direction == "sent")
        .map(|m| (m.msg_id.as_str(), m))
        .collect();
    for reply in messages
        .iter()
        .filter(|m| m.direction == "received" && m.msg_type.ends_with("_reply"))
    {
        let parent = reply
            .parent_msg_id
            .as_deref()
            .expect("a reply has a parent");
        let request = sent.get(parent).expect("the reply's request was captured");
        assert_eq!(
            request.msg_type.replace("_request", "_reply"),
            reply.msg_type
        );
        assert_eq!(request.channel, reply.channel, "{}", reply.label());
    }
}

#[test]
fn reencoding_gives_byte_identical_frames() {
    let (doc, messages) = fixture();
    let signer = signer(&doc);
    for captured in &messages {
        let message = decode(captured, &signer);
        let frames = encode_multipart(&message, &signer);
        assert_eq!(
            frames.as_slice(),
            captured.wire(),
            "{}: delimiter, signature, parts and buffers",
            captured.label()
        );
    }
}

#[test]
fn flipping_any_signed_byte_fails_verification() {
    let (doc, messages) = fixture();
    let signer = signer(&doc);
    let mut flips = 0usize;
    for captured in &messages {
        // The untouched message verifies, so each failure below is the flip's doing.
        decode(captured, &signer);
        // Frame indices of the signature and the four signed parts.
        let signature = captured.identities + 1;
        for frame in signature..signature + 5 {
            for at in 0..captured.frames[frame].len() {
                let mut frames = captured.frames.clone();
                let mut bytes = frames[frame].to_vec();
                bytes[at] ^= 0x01;
                frames[frame] = Bytes::from(bytes);
                assert_eq!(
                    decode_multipart(captured.channel, frames, &signer).err(),
                    Some(ProtocolError::BadSignature),
                    "{}: frame {frame} byte {at} flipped",
                    captured.label()
                );
                flips += 1;
            }
        }
    }
    assert!(flips > 10_000, "{flips}");
}

#[test]
fn buffers_are_not_signed() {
    let (doc, messages) = fixture();
    let signer = signer(&doc);
    let with_buffers: Vec<&Captured> = messages.iter().filter(|m| m.buffers > 0).collect();
    assert!(with_buffers.len() >= 4);
    for captured in with_buffers {
        let first = captured.identities + 6;
        // Changed, dropped and added buffers all keep the signature valid.
        let mut changed = captured.frames.clone();
        changed[first] = Bytes::from_static(b"something else entirely");
        let message = decode_multipart(captured.channel, changed, &signer)
            .unwrap_or_else(|err| panic!("{}: {err}", captured.label()));
        assert_eq!(message.buffers[0].as_ref(), b"something else entirely");

        let dropped = captured.frames[..first].to_vec();
        let message = decode_multipart(captured.channel, dropped, &signer)
            .unwrap_or_else(|err| panic!("{}: {err}", captured.label()));
        assert!(message.buffers.is_empty());

        let mut added = captured.frames.clone();
        added.push(Bytes::from_static(b"extra"));
        let message = decode_multipart(captured.channel, added, &signer)
            .unwrap_or_else(|err| panic!("{}: {err}", captured.label()));
        assert_eq!(message.buffers.len(), captured.buffers + 1);
        // And the signature the codec writes is the same with or without buffers.
        let mut bare = message.clone();
        bare.buffers.clear();
        assert_eq!(
            encode_multipart(&message, &signer)[1],
            encode_multipart(&bare, &signer)[1]
        );
    }
}

/// Parses a v1 frame independently of the crate: (channel, parts after the channel).
fn split_v1(frame: &[u8]) -> (String, Vec<Vec<u8>>) {
    let word = |i: usize| u64::from_le_bytes(frame[8 * i..8 * i + 8].try_into().unwrap()) as usize;
    let k = word(0);
    let offsets: Vec<usize> = (1..=k).map(word).collect();
    assert_eq!(offsets[0], 8 * (k + 1), "first offset follows the table");
    assert_eq!(
        *offsets.last().unwrap(),
        frame.len(),
        "last offset is the end"
    );
    let mut parts: Vec<Vec<u8>> = offsets
        .windows(2)
        .map(|w| frame[w[0]..w[1]].to_vec())
        .collect();
    let channel = String::from_utf8(parts.remove(0)).unwrap();
    (channel, parts)
}

/// Parses a legacy binary frame independently of the crate: (JSON, buffers).
fn split_legacy_binary(frame: &[u8]) -> (Value, Vec<Vec<u8>>) {
    let word = |i: usize| u32::from_be_bytes(frame[4 * i..4 * i + 4].try_into().unwrap()) as usize;
    let n = word(0);
    let mut offsets: Vec<usize> = (1..=n).map(word).collect();
    assert_eq!(offsets[0], 4 * (n + 1));
    offsets.push(frame.len());
    let parts: Vec<&[u8]> = offsets.windows(2).map(|w| &frame[w[0]..w[1]]).collect();
    (
        json(parts[0]),
        parts[1..].iter().map(|p| p.to_vec()).collect(),
    )
}

#[test]
fn both_websocket_encodings_carry_the_same_json() {
    let (doc, messages) = fixture();
    let signer = signer(&doc);
    for captured in &messages {
        let message = decode(captured, &signer);
        let label = captured.label();
        let raw = [
            captured.part(0),
            captured.part(1),
            captured.part(2),
            captured.part(3),
        ];
        let values: Vec<Value> = raw.iter().map(|p| json(p)).collect();
        let buffers: Vec<Vec<u8>> = message.buffers.iter().map(|b| b.to_vec()).collect();

        // v1: the kernel's exact bytes.
        let v1 = encode_v1(&message);
        let (channel, parts) = split_v1(&v1);
        assert_eq!(channel, captured.channel.as_str(), "{label}");
        assert_eq!(parts.len(), 4 + captured.buffers, "{label}");
        for i in 0..4 {
            assert_eq!(parts[i], raw[i], "{label}: v1 part {i}");
        }
        assert_eq!(&parts[4..], buffers.as_slice(), "{label}");

        // Legacy: text without buffers, binary with them; same JSON values either way.
        let (legacy, legacy_buffers) = match encode_legacy(&message).expect(&label) {
            Frame::Text(text) => {
                assert_eq!(captured.buffers, 0, "{label}: buffers need a binary frame");
                let v: Value = serde_json::from_str(&text).expect(&label);
                assert_eq!(v["buffers"], serde_json::json!([]), "{label}");
                (v, vec![])
            }
            Frame::Binary(bytes) => {
                assert!(captured.buffers > 0, "{label}: binary only with buffers");
                split_legacy_binary(&bytes)
            }
        };
        assert_eq!(legacy["header"], values[0], "{label}");
        assert_eq!(legacy["parent_header"], values[1], "{label}");
        assert_eq!(legacy["metadata"], values[2], "{label}");
        assert_eq!(legacy["content"], values[3], "{label}");
        assert_eq!(legacy["msg_id"], captured.msg_id.as_str(), "{label}");
        assert_eq!(legacy["msg_type"], captured.msg_type.as_str(), "{label}");
        assert_eq!(legacy["channel"], captured.channel.as_str(), "{label}");
        assert_eq!(legacy_buffers, buffers, "{label}");

        // What a client may send (not iopub) decodes back to the same bytes from both.
        if captured.channel != Channel::Iopub {
            let from_v1 = decode_v1(&v1).expect(&label);
            let from_legacy = match encode_legacy(&message).expect(&label) {
                Frame::Text(text) => decode_legacy_text(&text),
                Frame::Binary(bytes) => decode_legacy_binary(&bytes),
            }
            .expect(&label);
            for decoded in [&from_v1, &from_legacy] {
                assert_eq!(decoded.channel, captured.channel, "{label}");
                assert_eq!(decoded.header_bytes.as_ref(), raw[0], "{label}");
                assert_eq!(decoded.parent_header_bytes.as_ref(), raw[1], "{label}");
                assert_eq!(decoded.metadata.as_ref(), raw[2], "{label}");
                assert_eq!(decoded.content.as_ref(), raw[3], "{label}");
                assert_eq!(decoded.buffers, message.buffers, "{label}");
                // Re-signed for the kernel, it is the captured multipart again.
                assert_eq!(
                    encode_multipart(decoded, &signer).as_slice(),
                    captured.wire(),
                    "{label}"
                );
            }
        }
    }
}
