use super::*;

fn sample(signer: &Signer) -> Vec<Bytes> {
    let msg = Message::from_parts(
        Channel::Shell,
        Bytes::from_static(br#"{"msg_id":"m","msg_type":"execute_reply","session":"s"}"#),
        Bytes::from_static(br#"{"msg_id":"p","msg_type":"execute_request"}"#),
        Bytes::from_static(b"{}"),
        Bytes::from_static(br#"{"status":"ok","execution_count":1}"#),
        vec![Bytes::from_static(b"buffer")],
    )
    .unwrap();
    let mut frames = vec![Bytes::from_static(b"identity")];
    frames.extend(encode_multipart(&msg, signer));
    frames
}

#[test]
fn round_trip_with_identity_and_buffer() {
    let signer = Signer::new(b"key");
    let msg = decode_multipart(Channel::Shell, sample(&signer), &signer).unwrap();
    assert_eq!(msg.msg_type(), "execute_reply");
    assert_eq!(msg.parent_msg_id(), Some("p"));
    assert_eq!(msg.buffers, vec![Bytes::from_static(b"buffer")]);
}

#[test]
fn buffers_are_not_signed() {
    let signer = Signer::new(b"key");
    let mut frames = sample(&signer);
    let last = frames.len() - 1;
    frames[last] = Bytes::from_static(b"other buffer");
    assert!(decode_multipart(Channel::Shell, frames, &signer).is_ok());
}

#[test]
fn tampered_content_and_wrong_key_are_rejected() {
    let signer = Signer::new(b"key");
    let mut frames = sample(&signer);
    frames[6] = Bytes::from_static(br#"{"status":"error"}"#);
    assert_eq!(
        decode_multipart(Channel::Shell, frames, &signer).unwrap_err(),
        ProtocolError::BadSignature
    );
    let frames = sample(&Signer::new(b"other"));
    assert_eq!(
        decode_multipart(Channel::Shell, frames, &signer).unwrap_err(),
        ProtocolError::BadSignature
    );
}

#[test]
fn structural_errors() {
    let signer = Signer::new(b"key");
    assert_eq!(
        decode_multipart(Channel::Shell, vec![Bytes::from_static(b"x")], &signer).unwrap_err(),
        ProtocolError::MissingDelimiter { frames: 1 }
    );
    let frames = vec![
        Bytes::from_static(DELIMITER),
        Bytes::new(),
        Bytes::from_static(b"{}"),
    ];
    assert_eq!(
        decode_multipart(Channel::Shell, frames, &signer).unwrap_err(),
        ProtocolError::TooFewParts { found: 2 }
    );
    // A correctly signed message whose header is not JSON is still refused.
    let parts: [&[u8]; 4] = [b"nope", b"{}", b"{}", b"{}"];
    let sig = signer.sign(parts);
    let mut frames = vec![Bytes::from_static(DELIMITER), Bytes::from(sig)];
    frames.extend(parts.iter().map(|p| Bytes::copy_from_slice(p)));
    assert!(matches!(
        decode_multipart(Channel::Shell, frames, &signer),
        Err(ProtocolError::BadJson { part: "header", .. })
    ));
}

#[test]
fn large_messages_are_checked_in_parallel_with_the_same_verdicts() {
    let signer = Signer::new(b"0123456789abcdef0123456789abcdef");
    let text = "x\u{e9}".repeat(PARALLEL_CHECK_BYTES);
    let content = serde_json::json!({"name": "stdout", "text": text}).to_string();
    assert!(content.len() > PARALLEL_CHECK_BYTES);
    let header = Bytes::from_static(br#"{"msg_id":"m","msg_type":"stream","session":"s"}"#);
    let frames = |content: Bytes, signed_content: &[u8]| {
        let signature = signer.sign([&header, b"{}", b"{}", signed_content]);
        vec![
            Bytes::from_static(DELIMITER),
            Bytes::from(signature),
            header.clone(),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            content,
        ]
    };
    let good = Bytes::from(content.clone());
    let msg = decode_multipart(Channel::Iopub, frames(good.clone(), &good), &signer).unwrap();
    assert_eq!(msg.content, good);
    assert_eq!(msg.msg_type(), "stream");

    // One byte changed after signing.
    let mut tampered = content.clone().into_bytes();
    tampered[PARALLEL_CHECK_BYTES] ^= 1;
    assert!(matches!(
        decode_multipart(
            Channel::Iopub,
            frames(Bytes::from(tampered), &good),
            &signer
        ),
        Err(ProtocolError::BadSignature)
    ));
    // Signed, but not JSON: refused as such.
    let mut broken = content.clone().into_bytes();
    broken.pop();
    let broken = Bytes::from(broken);
    assert!(matches!(
        decode_multipart(Channel::Iopub, frames(broken.clone(), &broken), &signer),
        Err(ProtocolError::BadJson { .. })
    ));
    // Both wrong: the signature decides first, as for small messages.
    assert!(matches!(
        decode_multipart(Channel::Iopub, frames(broken, &good), &signer),
        Err(ProtocolError::BadSignature)
    ));
}
