//! The fuzz targets' properties (fuzz/fuzz_targets/checks.rs) over a deterministic corpus, on
//! stable Rust and in every `cargo nextest run`: ~200k inputs from a seeded xorshift, half
//! mutations of real frames (the golden ipykernel capture, re-signed with the fuzz key, and
//! its v1 and legacy WebSocket encodings), half random bytes and splices. No decoder may panic,
//! and every round trip in checks.rs must hold. The coverage-guided fuzzer (fuzz/README.md)
//! goes much deeper; this keeps the basics guarded where nightly is not available.

#[path = "../fuzz/fuzz_targets/checks.rs"]
mod checks;

use bytes::Bytes;
use cellgate::protocol::websocket::{encode_legacy, encode_v1, Frame};
use cellgate::protocol::{decode_multipart, encode_multipart, Channel, Message, Signer, DELIMITER};
use serde_json::Value;

const FIXTURE: &str = include_str!("fixtures/ipykernel-7.4-multipart.json");
const INPUTS_PER_TARGET: usize = 200_000;

/// xorshift64*: small, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            _ => 63,
        }
    };
    let bytes = text.trim_end_matches('=').as_bytes();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= value(c) << (18 - 6 * i);
        }
        out.extend_from_slice(&acc.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// The captured messages, decoded with the capture's key.
fn golden_messages() -> Vec<Message> {
    let doc: Value = serde_json::from_str(FIXTURE).expect("fixture");
    let signer = Signer::new(doc["key"].as_str().expect("key").as_bytes());
    doc["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            let channel = Channel::parse(m["channel"].as_str().expect("channel")).expect("channel");
            let frames: Vec<Bytes> = m["frames"]
                .as_array()
                .expect("frames")
                .iter()
                .map(|f| Bytes::from(base64_decode(f.as_str().expect("frame"))))
                .collect();
            decode_multipart(channel, frames, &signer).expect("golden message decodes")
        })
        .collect()
}

/// Multipart seeds: each golden message re-signed with the fuzz key, plus hand-made edge
/// cases (regressions the fuzzer found belong here).
fn multipart_seeds(messages: &[Message]) -> Vec<Vec<u8>> {
    let signer = Signer::new(checks::KEY);
    let mut seeds: Vec<Vec<u8>> = messages
        .iter()
        .map(|m| checks::join_frames(m.channel, &encode_multipart(m, &signer)))
        .collect();
    let header = br#"{"msg_id":"m","msg_type":"stream","session":"s"}"#;
    for content in [
        // A JSON part with whitespace around it survives a legacy round trip as the same JSON
        // (found by cargo fuzz: the bytes differ, the value does not).
        &b"{\"a\":1} "[..],
        b"\t{}\r\n",
        b"{\"deep\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
        b"{\"s\":\"\\ud83d\\ude00 \\u0000 \xc3\xa9\"}",
        b"not json",
        b"[]",
    ] {
        // Signed by hand: the decoder must refuse the parts that are not JSON objects, so
        // they cannot be built as a Message first.
        let parts: [&[u8]; 4] = [header, b"{}", b"{}", content];
        let mut frames = vec![
            Bytes::from_static(cellgate::protocol::DELIMITER),
            Bytes::from(signer.sign(parts)),
        ];
        frames.extend(parts.iter().map(|p| Bytes::copy_from_slice(p)));
        frames.push(Bytes::from_static(b"\x00buffer"));
        seeds.push(checks::join_frames(Channel::Shell, &frames));
    }
    // Identities before the delimiter, an identity that is the delimiter, nothing at all.
    let mut with_ids = vec![Bytes::from_static(b"id-1"), Bytes::from_static(b"id-2")];
    with_ids.extend(encode_multipart(&messages[0], &signer));
    seeds.push(checks::join_frames(Channel::Shell, &with_ids));
    seeds.push(checks::join_frames(
        Channel::Iopub,
        &vec![Bytes::from_static(DELIMITER); 7],
    ));
    seeds.push(Vec::new());
    seeds
}

/// WebSocket seeds: each golden message as a v1 frame and as a legacy frame.
fn websocket_seeds(messages: &[Message]) -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for m in messages {
        // Clients send on shell, control and stdin; a few iopub frames stay as error cases.
        if m.channel == Channel::Iopub && m.msg_type() != "stream" {
            continue;
        }
        seeds.push(encode_v1(m));
        match encode_legacy(m).expect("golden messages are JSON") {
            Frame::Text(text) => seeds.push(text.into_bytes()),
            Frame::Binary(bytes) => seeds.push(bytes),
        }
    }
    seeds.push(br#"{"header":{"msg_id":"a","msg_type":"b"}}"#.to_vec());
    seeds.push(
        br#"{"header":{"msg_id":"a","msg_type":"b"},"parent_header":null,"channel":"control"}"#
            .to_vec(),
    );
    seeds
}

const INTERESTING: [u8; 12] = [
    0, 1, 0x7f, 0x80, 0xff, b'{', b'}', b'"', b'\\', b':', b',', b'<',
];

/// One mutation of `seed`, sometimes spliced with `other`.
fn mutate(rng: &mut Rng, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut out = seed.to_vec();
    // Mostly one edit, so that many mutants still decode and reach the round trips.
    let edits = if rng.below(4) == 0 {
        2 + rng.below(3)
    } else {
        1
    };
    for _ in 0..edits {
        let len = out.len();
        match rng.below(9) {
            0 if len > 0 => {
                let at = rng.below(len);
                out[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                out[at] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => out.truncate(rng.below(len + 1)),
            3 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let junk = rng.bytes(n);
                out.splice(at..at, junk);
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(64));
                out.drain(at..at + n);
            }
            5 if len >= 8 => {
                // Rewrite a length or offset word near the front.
                let at = rng.below(len.min(80) - 7);
                let word = match rng.below(4) {
                    0 => u64::MAX,
                    1 => rng.next(),
                    2 => len as u64,
                    _ => u64::from_le_bytes(out[at..at + 8].try_into().unwrap_or([0; 8]))
                        .wrapping_add(rng.below(5) as u64)
                        .wrapping_sub(2),
                };
                out[at..at + 8].copy_from_slice(&word.to_le_bytes());
            }
            6 if len >= 4 => {
                let at = rng.below(len.min(40) - 3);
                let word = (rng.next() as u32) >> rng.below(32);
                out[at..at + 4].copy_from_slice(&word.to_be_bytes());
            }
            7 if !other.is_empty() => {
                let cut = rng.below(len + 1);
                let from = rng.below(other.len());
                out.truncate(cut);
                out.extend_from_slice(&other[from..]);
            }
            _ if len > 0 => {
                // Duplicate a chunk.
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(32));
                let chunk = out[at..at + n].to_vec();
                out.splice(at..at, chunk);
            }
            _ => out.push(rng.next() as u8),
        }
    }
    out
}

/// Half mutations of seeds, half random inputs (random bytes, or random frames in the
/// multipart layout).
fn corpus(rng: &mut Rng, seeds: &[Vec<u8>], i: usize) -> Vec<u8> {
    if i < seeds.len() {
        return seeds[i].clone();
    }
    if i.is_multiple_of(2) {
        let seed = &seeds[rng.below(seeds.len())];
        let other = &seeds[rng.below(seeds.len())];
        mutate(rng, seed, other)
    } else {
        let n = rng.below(512);
        rng.bytes(n)
    }
}

#[test]
fn multipart_decoder_survives_a_deterministic_corpus() {
    let messages = golden_messages();
    let seeds = multipart_seeds(&messages);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut decoded = 0usize;
    for i in 0..INPUTS_PER_TARGET {
        decoded += checks::multipart(&corpus(&mut rng, &seeds, i));
    }
    eprintln!("{decoded} successful decodes of {INPUTS_PER_TARGET} inputs");
    // The corpus must reach past the decoder, or the round-trip properties are never tested.
    assert!(
        decoded > INPUTS_PER_TARGET / 20,
        "only {decoded} successful decodes"
    );
}

#[test]
fn websocket_decoders_survive_a_deterministic_corpus() {
    let messages = golden_messages();
    let seeds = websocket_seeds(&messages);
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut accepted = 0usize;
    for i in 0..INPUTS_PER_TARGET {
        accepted += checks::websocket(&corpus(&mut rng, &seeds, i));
    }
    eprintln!("{accepted} accepted frames of {INPUTS_PER_TARGET} inputs");
    assert!(
        accepted > INPUTS_PER_TARGET / 40,
        "only {accepted} accepted frames"
    );
}

#[test]
fn the_split_scheme_round_trips() {
    let frames = vec![
        Bytes::from_static(b"a"),
        Bytes::new(),
        Bytes::from(vec![7u8; 300]),
    ];
    let joined = checks::join_frames(Channel::Control, &frames);
    assert_eq!(
        checks::split_frames(&joined),
        (Channel::Control, frames.clone())
    );
    // A truncated last frame keeps what is there.
    let (_, cut) = checks::split_frames(&joined[..joined.len() - 100]);
    assert_eq!(cut[2].len(), 200);
}

/// A real ClientHello (rustls, offering TLS 1.3 and 1.2, with a server name), as one record
/// and re-cut into records of a few sizes: what a proxy may see on a tunnel.
fn client_hello_seeds() -> Vec<Vec<u8>> {
    use tokio_rustls::rustls;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("fuzz.example").expect("name");
    let mut connection =
        rustls::ClientConnection::new(std::sync::Arc::new(config), name).expect("client");
    let mut hello = Vec::new();
    while connection.wants_write() {
        connection.write_tls(&mut hello).expect("write the hello");
    }
    // One record: type, version, length, then the handshake message.
    let message = hello[5..].to_vec();
    let mut seeds = vec![hello];
    for size in [1, 7, 64, 200] {
        let mut records = Vec::new();
        for chunk in message.chunks(size) {
            records.extend([22, 3, 1]);
            records.extend((chunk.len() as u16).to_be_bytes());
            records.extend(chunk);
        }
        seeds.push(records);
    }
    seeds
}

#[test]
fn the_client_hello_reader_decides_the_same_for_every_cut() {
    let seeds = client_hello_seeds();
    for seed in &seeds {
        assert_eq!(checks::client_hello(seed), 1, "a real hello is accepted");
    }
    let mut rng = Rng(0xd1b5_4a32_d192_ed03);
    let inputs = 20_000;
    let mut accepted = 0usize;
    for i in 0..inputs {
        accepted += checks::client_hello(&corpus(&mut rng, &seeds, i));
    }
    eprintln!("{accepted} accepted hellos of {inputs} inputs");
    // Mutants must still reach the prefix property, or it is never tested.
    assert!(accepted > inputs / 50, "only {accepted} accepted hellos");
}
