//! Hot paths of the relay: decoding a kernel multipart (signature check included) and
//! encoding it for each WebSocket framing, for a `1+1` reply and for a 5 MB PNG display_data.
//! Run with `cargo bench --bench wire`.

use bytes::Bytes;
use cellgate::protocol::websocket::{decode_legacy_text, decode_v1, encode, encode_v1, Framing};
use cellgate::protocol::{decode_multipart, encode_multipart, Channel, Message, Signer};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn message(content: String) -> Message {
    Message::from_parts(
        Channel::Iopub,
        Bytes::from_static(br#"{"msg_id":"a1b2c3d4-e5f6_1234_42","msg_type":"execute_result","username":"u","session":"a1b2c3d4","date":"2026-11-22T05:19:25.362021Z","version":"5.4"}"#),
        Bytes::from_static(br#"{"msg_id":"3d4de99e23584b089cdbdb9dcb22fc7e","msg_type":"execute_request","username":"u","session":"s","date":"2026-11-22T05:19:25.344000Z","version":"5.3"}"#),
        Bytes::from_static(b"{}"),
        Bytes::from(content),
        vec![],
    )
    .expect("a valid message")
}

fn cases() -> Vec<(&'static str, Message)> {
    let small =
        message(r#"{"data":{"text/plain":"2"},"metadata":{},"execution_count":1}"#.to_owned());
    // 5 MB of base64, as a PNG display_data carries it.
    let png: String = "iVBORw0KGgo".chars().cycle().take(5 << 20).collect();
    let large = message(format!(
        r#"{{"data":{{"image/png":"{png}","text/plain":"<Figure>"}},"metadata":{{}}}}"#
    ));
    vec![("1+1 result", small), ("5MB png", large)]
}

fn bench(c: &mut Criterion) {
    let signer = Signer::new(b"0f6a4b7e-5d2c-4a1b-9e8f-7c6d5e4f3a2b");
    let mut group = c.benchmark_group("relay");
    for (name, msg) in cases() {
        group.throughput(Throughput::Bytes(msg.byte_len() as u64));
        let frames = encode_multipart(&msg, &signer);
        group.bench_with_input(
            BenchmarkId::new("decode_multipart", name),
            &frames,
            |b, frames| {
                b.iter(|| decode_multipart(Channel::Iopub, frames.clone(), &signer).expect("valid"))
            },
        );
        group.bench_with_input(
            BenchmarkId::new("encode_multipart", name),
            &msg,
            |b, msg| b.iter(|| encode_multipart(msg, &signer)),
        );
        // What the socket writer does: one buffer for a message of up to 64 KiB, fragments
        // cut from the kernel's bytes above that.
        for (label, framing) in [
            ("encode_v1", Framing::V1),
            ("encode_legacy", Framing::Legacy),
        ] {
            group.bench_with_input(BenchmarkId::new(label, name), &msg, |b, msg| {
                b.iter(|| {
                    let encoded = encode(msg, framing).expect("valid json");
                    if encoded.len() <= 64 << 10 {
                        vec![Bytes::from(encoded.to_vec())]
                    } else {
                        encoded.fragments(64 << 10)
                    }
                })
            });
        }
    }
    let request = r#"{"header":{"msg_id":"3d4de99e23584b089cdbdb9dcb22fc7e","msg_type":"execute_request","username":"u","session":"s","date":"2026-11-22T05:19:25.344000Z","version":"5.3"},"parent_header":{},"metadata":{},"content":{"code":"1+1","silent":false,"store_history":true,"user_expressions":{},"allow_stdin":true,"stop_on_error":true},"channel":"shell","buffers":[]}"#;
    group.throughput(Throughput::Bytes(request.len() as u64));
    group.bench_function("decode_legacy_text/execute_request", |b| {
        b.iter(|| decode_legacy_text(request).expect("valid"))
    });
    // The same request as a v1 client frames it (channel "shell").
    let v1_frame = encode_v1(&decode_legacy_text(request).expect("valid"));
    group.bench_function("decode_v1/execute_request", |b| {
        b.iter(|| decode_v1(&v1_frame).expect("valid"))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
