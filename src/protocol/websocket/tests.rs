use super::*;

fn kernel_message(buffers: Vec<Bytes>) -> Message {
    Message::from_parts(
        Channel::Iopub,
        Bytes::from_static(br#"{"msg_id":"k1","msg_type":"comm_msg","session":"s","date":"2026-11-22T05:19:25.362021Z","version":"5.4","username":"u"}"#),
        Bytes::from_static(br#"{"msg_id":"p1","msg_type":"comm_msg"}"#),
        Bytes::from_static(b"{}"),
        Bytes::from_static(br#"{"comm_id":"c","data":{"x":1.0e3,"s":"\u00e9\u2603"}}"#),
        buffers,
    )
    .unwrap()
}

fn v1_frame(parts: &[&[u8]]) -> Vec<u8> {
    let k = parts.len() + 1;
    let mut out = (k as u64).to_le_bytes().to_vec();
    let mut offset = 8 * (k as u64 + 1);
    for p in parts {
        out.extend_from_slice(&offset.to_le_bytes());
        offset += p.len() as u64;
    }
    out.extend_from_slice(&offset.to_le_bytes());
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

#[test]
fn v1_layout_matches_the_captured_kernel_info_request() {
    // The research captured a 254-byte frame: k = 6, offsets 56, 61, 248, 250, 252, 254,
    // with a 187-byte header.
    let header = format!(
        "{{\"msg_id\":\"{}\",\"msg_type\":\"kernel_info_request\",\"pad\":\"{}\"}}",
        "m".repeat(10),
        "x".repeat(187 - 65)
    );
    assert_eq!(header.len(), 187);
    let frame = v1_frame(&[b"shell", header.as_bytes(), b"{}", b"{}", b"{}"]);
    assert_eq!(frame.len(), 254);
    let offsets: Vec<u64> = (1..7)
        .map(|i| u64::from_le_bytes(frame[i * 8..i * 8 + 8].try_into().unwrap()))
        .collect();
    assert_eq!(offsets, [56, 61, 248, 250, 252, 254]);
    let msg = decode_v1(&frame).unwrap();
    assert_eq!(msg.channel, Channel::Shell);
    assert_eq!(msg.msg_type(), "kernel_info_request");
    assert_eq!(msg.header_bytes.as_ref(), header.as_bytes());
    assert!(msg.buffers.is_empty());
}

#[test]
fn v1_round_trip_keeps_bytes_and_buffers() {
    let msg = kernel_message(vec![Bytes::from_static(b"\x00\x01\xff"), Bytes::new()]);
    let frame = encode_v1(&msg);
    // The decoder is the client-side one, so decode the kernel's iopub frame with the layout
    // reader directly.
    let parts = split_offsets(&frame, 8, true, |b| {
        u64::from_le_bytes(b.try_into().unwrap())
    })
    .unwrap();
    assert_eq!(parts[0], b"iopub");
    assert_eq!(parts[1], msg.header_bytes.as_ref());
    assert_eq!(parts[4], msg.content.as_ref());
    assert_eq!(parts[5], b"\x00\x01\xff");
    assert_eq!(parts[6], b"");
    assert_eq!(parts.len(), 7);
}

#[test]
fn legacy_text_is_valid_json_with_convenience_keys() {
    let msg = kernel_message(Vec::new());
    let Frame::Text(text) = encode_legacy(&msg).unwrap() else {
        panic!("a message without buffers is a text frame");
    };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["msg_id"], "k1");
    assert_eq!(v["msg_type"], "comm_msg");
    assert_eq!(v["channel"], "iopub");
    assert_eq!(v["buffers"], serde_json::json!([]));
    assert_eq!(v["content"]["data"]["s"], "é☃");
    assert_eq!(v["parent_header"]["msg_id"], "p1");
    // The content bytes are spliced verbatim: the float keeps its spelling.
    assert!(text.contains(r#""x":1.0e3"#));
}

#[test]
fn legacy_binary_matches_the_captured_layout() {
    let msg = kernel_message(vec![Bytes::from_static(b"hello")]);
    let Frame::Binary(frame) = encode_legacy(&msg).unwrap() else {
        panic!("a message with buffers is a binary frame");
    };
    assert_eq!(&frame[0..4], &[0, 0, 0, 2]);
    assert_eq!(&frame[4..8], &[0, 0, 0, 12]);
    let json_end = u32::from_be_bytes(frame[8..12].try_into().unwrap()) as usize;
    assert_eq!(&frame[json_end..], b"hello");
    let v: serde_json::Value = serde_json::from_slice(&frame[12..json_end]).unwrap();
    assert_eq!(v["channel"], "iopub");
    assert!(v.get("buffers").is_none());
    // And a client can send the same layout back.
    let mut client = frame.clone();
    let text = String::from_utf8(frame[12..json_end].to_vec())
        .unwrap()
        .replace("\"iopub\"", "\"shell\"");
    client.splice(12..json_end, text.bytes());
    let back = decode_legacy_binary(&client).unwrap();
    assert_eq!(back.channel, Channel::Shell);
    assert_eq!(back.buffers, vec![Bytes::from_static(b"hello")]);
}

#[test]
fn legacy_text_from_client_defaults_to_shell_and_keeps_header_bytes() {
    let text = r#"{"header": {"msg_id": "a", "msg_type": "execute_request", "session": "s", "subshell_id": "x"}, "parent_header": {}, "metadata": {}, "content": {"code": "1+1"}, "buffers": []}"#;
    let msg = decode_legacy_text(text).unwrap();
    assert_eq!(msg.channel, Channel::Shell);
    assert_eq!(msg.msg_id(), "a");
    assert_eq!(
        msg.header_bytes.as_ref(),
        br#"{"msg_id": "a", "msg_type": "execute_request", "session": "s", "subshell_id": "x"}"#
    );
    assert_eq!(msg.content.as_ref(), br#"{"code": "1+1"}"#);
}

#[test]
fn malformed_client_frames_are_errors_not_panics() {
    let cases: Vec<&[u8]> = vec![
        b"",
        b"\x00",
        b"\xff\xff\xff\xff\xff\xff\xff\xff",
        b"\x01\x00\x00\x00\x00\x00\x00\x00\x10\x00\x00\x00\x00\x00\x00\x00",
        b"\x06\x00\x00\x00\x00\x00\x00\x00",
    ];
    for case in cases {
        assert!(decode_v1(case).is_err(), "{case:?}");
        assert!(decode_legacy_binary(case).is_err(), "{case:?}");
    }
    for text in [
        "",
        "null",
        "[]",
        r#"{"header": 1}"#,
        r#"{"header": {"msg_type": "x"}}"#,
        r#"{"header": {"msg_id": "a", "msg_type": "x"}, "channel": "hb"}"#,
        r#"{"header": {"msg_id": "a", "msg_type": "x"}, "channel": "nope"}"#,
        r#"{"header": {"msg_id": "a", "msg_type": "x"}, "content": [1]}"#,
    ] {
        assert!(decode_legacy_text(text).is_err(), "{text}");
    }
    // Offsets out of order.
    let mut frame = v1_frame(&[
        b"shell",
        br#"{"msg_id":"a","msg_type":"b"}"#,
        b"{}",
        b"{}",
        b"{}",
    ]);
    frame[8..16].copy_from_slice(&1000u64.to_le_bytes());
    assert!(decode_v1(&frame).is_err());
    // A non-object content part.
    let frame = v1_frame(&[
        b"shell",
        br#"{"msg_id":"a","msg_type":"b"}"#,
        b"{}",
        b"{}",
        b"[]",
    ]);
    assert!(decode_v1(&frame).is_err());
}

#[test]
fn messages_with_parts_that_are_not_json_objects_cannot_be_built() {
    // encode_legacy splices parts verbatim; that is safe because no Message holds a part that
    // is not a UTF-8 JSON object.
    for content in [&b"{\"a\": \xff}"[..], b"{\"a\": ", b"[1]", b"", b"{} {}"] {
        let built = Message::from_parts(
            Channel::Iopub,
            Bytes::from_static(br#"{"msg_id":"a","msg_type":"stream"}"#),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            Bytes::copy_from_slice(content),
            vec![],
        );
        assert!(built.is_err(), "{content:?}");
    }
    // Invalid UTF-8 put in by hand is still refused when encoding.
    let mut msg = kernel_message(Vec::new());
    msg.content = Bytes::from_static(b"{\"a\": \xff}");
    assert!(encode_legacy(&msg).is_err());
}

#[test]
fn text_only_legacy_carries_buffers_as_base64() {
    let msg = kernel_message(vec![Bytes::from_static(b"\x00\xffhi")]);
    let Frame::Text(text) = encode_legacy_text_only(&msg).unwrap() else {
        panic!("always text");
    };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["buffers"], serde_json::json!(["AP9oaQ=="]));
    assert_eq!(v["channel"], "iopub");
    assert_eq!(v["content"]["comm_id"], "c");
    // Without buffers it is the ordinary text frame.
    let plain = kernel_message(Vec::new());
    assert_eq!(
        encode_legacy_text_only(&plain).unwrap(),
        encode_legacy(&plain).unwrap()
    );
}

fn stream_message(text: &str, buffers: Vec<Bytes>) -> Message {
    let content = serde_json::json!({"name": "stdout", "text": text}).to_string();
    Message::from_parts(
        Channel::Iopub,
        Bytes::from_static(br#"{"msg_id":"k2","msg_type":"stream","session":"s"}"#),
        Bytes::from_static(br#"{"msg_id":"p2","msg_type":"execute_request"}"#),
        Bytes::from_static(b"{}"),
        Bytes::from(content),
        buffers,
    )
    .unwrap()
}

#[test]
fn fragments_rebuild_the_message_and_keep_characters_whole() {
    // Multi-byte characters at every alignment: 2, 3 and 4 bytes in UTF-8.
    let text = "aé€😀".repeat(3000);
    let cases = [
        (stream_message(&text, vec![]), Framing::Legacy),
        (stream_message(&text, vec![]), Framing::V1),
        (
            stream_message(&text, vec![Bytes::from(vec![0xff; 5000])]),
            Framing::Legacy,
        ),
        (
            stream_message(&text, vec![Bytes::from(vec![0x80; 5000])]),
            Framing::LegacyTextOnly,
        ),
        (kernel_message(vec![]), Framing::Legacy),
    ];
    for (msg, framing) in cases {
        let encoded = encode(&msg, framing).unwrap();
        let whole = encoded.to_vec();
        assert_eq!(whole.len(), encoded.len());
        for max in [1, 4, 5, 7, 64, 1000, 4096, whole.len(), whole.len() + 1] {
            let fragments = encoded.fragments(max);
            let joined: Vec<u8> = fragments.iter().flat_map(|f| f.iter().copied()).collect();
            assert_eq!(joined, whole, "{framing:?} max {max}");
            for fragment in &fragments {
                assert!(fragment.len() <= max.max(4), "{framing:?} max {max}");
                assert!(!fragment.is_empty());
                if !encoded.binary {
                    assert!(
                        std::str::from_utf8(fragment).is_ok(),
                        "{framing:?} max {max}"
                    );
                }
            }
            if max >= whole.len() {
                assert_eq!(fragments.len(), 1);
            }
        }
    }
}

#[test]
fn fragments_share_the_kernels_bytes() {
    let text = "x".repeat(1 << 20);
    let msg = stream_message(&text, vec![]);
    let encoded = encode(&msg, Framing::Legacy).unwrap();
    let content = msg.content.as_ptr_range();
    let fragments = encoded.fragments(64 << 10);
    let shared = fragments
        .iter()
        .filter(|f| content.contains(&f.as_ptr()))
        .count();
    // All but the first (header and the start of the content, joined) and the last.
    assert!(
        shared >= fragments.len() - 2,
        "{shared} of {}",
        fragments.len()
    );
}

#[test]
fn an_empty_encoding_is_one_empty_fragment() {
    let encoded = Encoded {
        binary: true,
        pieces: vec![Bytes::new(), Bytes::new()],
    };
    assert_eq!(encoded.fragments(10), vec![Bytes::new()]);
}
