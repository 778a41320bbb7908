//! Cost of the notebook-history tap on the router's iopub path: a message type it does not
//! record, a stream of a recorded execution (merged into the previous stream) and a status of
//! a request it does not track. Run with `cargo bench --bench history`.

use bytes::Bytes;
use cellgate::kernel::History;
use cellgate::protocol::{Channel, Message};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};

fn kernel_message(channel: Channel, msg_type: &str, parent: &str, content: &str) -> Message {
    Message::from_parts(
        channel,
        Bytes::from(format!(
            r#"{{"msg_id":"m-{msg_type}","msg_type":"{msg_type}","session":"k","date":"2026-11-22T05:19:25.362021Z","version":"5.4"}}"#
        )),
        Bytes::from(format!(
            r#"{{"msg_id":"{parent}","msg_type":"execute_request","session":"s","version":"5.4"}}"#
        )),
        Bytes::from_static(b"{}"),
        Bytes::from(content.to_owned()),
        vec![],
    )
    .expect("a valid message")
}

fn bench(c: &mut Criterion) {
    let request = kernel_message(
        Channel::Shell,
        "execute_request",
        "none",
        r#"{"code":"for i in range(10**6): print(i)","silent":false}"#,
    );
    let recorded_parent = request.msg_id().to_owned();
    let stream = kernel_message(
        Channel::Iopub,
        "stream",
        &recorded_parent,
        r#"{"name":"stdout","text":"a line of output from the kernel, about eighty bytes long\n"}"#,
    );
    let comm = kernel_message(
        Channel::Iopub,
        "comm_msg",
        &recorded_parent,
        r#"{"comm_id":"c","data":{"method":"update","state":{"value":1}}}"#,
    );
    let status = kernel_message(
        Channel::Iopub,
        "status",
        "untracked",
        r#"{"execution_state":"busy"}"#,
    );
    let mut group = c.benchmark_group("history_tap");
    let history = History::new();
    history.on_request(&request);
    group.bench_function("comm_msg (type not recorded)", |b| {
        b.iter(|| history.on_iopub(&comm))
    });
    group.bench_function("status of an untracked request", |b| {
        b.iter(|| history.on_iopub(&status))
    });
    // Fresh histories in batches, so the memory bound is never what is measured.
    group.bench_function("stream of a recorded execution", |b| {
        b.iter_batched_ref(
            || {
                let history = History::new();
                history.on_request(&request);
                history
            },
            |history| {
                for _ in 0..100 {
                    history.on_iopub(&stream);
                }
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
