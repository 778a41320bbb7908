//! Storing artifacts: what a 5 MB PNG display output costs the gateway between the kernel's
//! message and the event that references it (base64 decode, SHA-256, header parse, write
//! and rename on the runtime directory's file system). Run with
//! `cargo bench --bench artifacts`.

use std::time::Duration;

use base64::Engine;
use cellgate::artifacts::{ArtifactStore, NewArtifact, Origin, Quotas};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// A PNG header (640×480) followed by pseudo-random bytes, so each blob is new content.
fn png(size: usize, seed: u64) -> Vec<u8> {
    let mut bytes = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\x02\x80\0\0\x01\xe0\x08\x06\0\0\0".to_vec();
    let mut x = seed | 1;
    while bytes.len() < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    bytes.truncate(size);
    bytes
}

fn store_png(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = ArtifactStore::new(dir.path().join("artifacts"), Duration::ZERO)
        .expect("an artifact store");
    let mut group = c.benchmark_group("artifact store");
    group.throughput(Throughput::Bytes(5 << 20));
    group.sample_size(20);
    let mut seed = 0u64;
    // The path the session takes: base64 from the bundle, decoded, then stored.
    group.bench_function("5MB png from base64", |b| {
        b.iter_batched(
            || {
                seed += 1;
                base64::engine::general_purpose::STANDARD.encode(png(5 << 20, seed))
            },
            |encoded| {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .expect("valid base64");
                store
                    .put(
                        &NewArtifact {
                            session: "bench",
                            owner: None,
                            mime: "image/png",
                            origin: Origin::DisplayData,
                            execution_id: None,
                            display_id: None,
                            text: Some("<Figure size 640x480 with 1 Axes>"),
                            path: None,
                            quotas: Quotas::default(),
                        },
                        &bytes,
                    )
                    .expect("stored")
            },
            criterion::BatchSize::LargeInput,
        )
    });
    group.finish();
    store.expire_session("bench");
    store.reap();
}

criterion_group!(benches, store_png);
criterion_main!(benches);
