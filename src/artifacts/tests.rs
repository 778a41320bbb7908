use super::*;

fn new<'a>(session: &'a str, mime: &'a str, display: Option<&'a str>) -> NewArtifact<'a> {
    NewArtifact {
        session,
        owner: Some("t1"),
        mime,
        origin: Origin::DisplayData,
        execution_id: None,
        display_id: display,
        text: None,
        path: None,
        quotas: Quotas::default(),
    }
}

fn png(w: u32, h: u32) -> Vec<u8> {
    let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
    b.extend_from_slice(&w.to_be_bytes());
    b.extend_from_slice(&h.to_be_bytes());
    b.extend_from_slice(&[8, 6, 0, 0, 0]);
    b
}

#[test]
fn same_bytes_one_blob_two_records_removed_with_the_last() {
    let dir = tempfile::tempdir().unwrap();
    let store = ArtifactStore::new(dir.path().join("a"), Duration::ZERO).unwrap();
    let a = store
        .put(&new("s1", "image/png", None), &png(640, 480))
        .unwrap();
    let b = store
        .put(&new("s2", "image/png", None), &png(640, 480))
        .unwrap();
    assert_ne!(a.id, b.id);
    assert_eq!(store.path_of(&a.id), store.path_of(&b.id));
    assert_eq!((a.width, a.height), (Some(640), Some(480)));
    assert_eq!(a.summary, "PNG image 640×480");
    let path = store.path_of(&a.id).unwrap();
    assert!(path.exists());
    store.expire_session("s1");
    store.reap();
    assert!(store.get(&a.id).is_none());
    assert!(path.exists(), "still used by s2");
    store.expire_session("s2");
    store.reap();
    assert!(!path.exists());
}

#[test]
fn display_updates_are_versions() {
    let dir = tempfile::tempdir().unwrap();
    let store = ArtifactStore::new(dir.path().to_owned(), Duration::from_secs(60)).unwrap();
    let v1 = store
        .put(&new("s", "text/html", Some("d")), b"<b>1</b>")
        .unwrap();
    let v2 = store
        .put(&new("s", "text/html", Some("d")), b"<b>2</b>")
        .unwrap();
    assert_eq!((v1.version, v2.version), (1, 2));
    assert_eq!(v2.previous.as_ref(), Some(&v1.id));
    store.expire_session("s");
    store.reap();
    assert!(store.get(&v1.id).is_some(), "kept for the retention period");
}

#[test]
fn streamed_files_respect_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let store = ArtifactStore::new(dir.path().to_owned(), Duration::ZERO).unwrap();
    let data = vec![7u8; 1000];
    let err = store
        .put_reader(
            &new("s", "application/octet-stream", None),
            &mut &data[..],
            999,
        )
        .unwrap_err();
    assert!(matches!(err, ArtifactError::TooLarge { .. }));
    let ok = store
        .put_reader(
            &new("s", "application/octet-stream", None),
            &mut &data[..],
            1000,
        )
        .unwrap();
    assert_eq!(ok.bytes, 1000);
    assert_eq!(std::fs::read(store.path_of(&ok.id).unwrap()).unwrap(), data);
}

#[test]
fn dimensions_from_headers() {
    let svg = br#"<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="460.8pt" height="345.6pt" viewBox="0 0 460.8 345.6">"#;
    assert_eq!(dimensions("image/svg+xml", svg), Some((614, 461)));
    let svg = br#"<svg viewBox="0 0 100 50" xmlns="http://www.w3.org/2000/svg">"#;
    assert_eq!(dimensions("image/svg+xml", svg), Some((100, 50)));
    let jpeg = [
        0xFF, 0xD8, 0xFF, 0xE0, 0, 4, 0, 0, 0xFF, 0xC0, 0, 11, 8, 0, 20, 0, 30, 3, 0, 0, 0,
    ];
    assert_eq!(dimensions("image/jpeg", &jpeg), Some((30, 20)));
    assert_eq!(dimensions("image/png", b"not a png at all, no"), None);
}

/// Real WebP files (written by Pillow), one of each kind: the size is read from the VP8
/// frame header, the VP8L bitstream's packed 14-bit fields, or the VP8X canvas (24-bit,
/// minus one).
#[test]
fn webp_dimensions_of_each_kind() {
    let hex = |s: &str| hex::decode(s).unwrap();
    let lossy = hex("524946464a00000057454250565038203e0000005003009d012a250017003ed166ac50a825a422a56801001a096700c6e680002bf7c37000feed072faef16946bffc94ff177de6efbeebacdb777aa6000000");
    let lossless =
        hex("5249464620000000574542505650384c140000002f28800400075081540820000a9afec78888fe07");
    let extended = hex("524946465e00000057454250565038580a000000100000002b0100010000414c50480a000000010750c088084444ff03565038202e000000b003009d012a2c0102003ed168af52a8262422a1a801001a096900000c74e1c3870e1c386e8000fef36200000000");
    assert_eq!(&lossy[12..16], b"VP8 ");
    assert_eq!(&lossless[12..16], b"VP8L");
    assert_eq!(&extended[12..16], b"VP8X");
    assert_eq!(dimensions("image/webp", &lossy), Some((37, 23)));
    assert_eq!(dimensions("image/webp", &lossless), Some((41, 19)));
    assert_eq!(dimensions("image/webp", &extended), Some((300, 2)));
    assert_eq!(dimensions("image/webp", &lossy[..20]), None, "cut short");
    assert_eq!(
        summarize("image/webp", &lossy, None, (Some(37), Some(23)), None),
        "WebP image 37×23"
    );
}

#[test]
fn png_and_gif_dimensions() {
    // A 2×3 PNG and a 5×7 GIF header.
    let png =
        hex::decode("89504e470d0a1a0a0000000d4948445200000002000000030806000000b9eade81").unwrap();
    assert_eq!(dimensions("image/png", &png), Some((2, 3)));
    let gif = b"GIF89a\x05\x00\x07\x00\x80\x00\x00";
    assert_eq!(dimensions("image/gif", gif), Some((5, 7)));
}

#[test]
fn ansi_codes_are_stripped() {
    let tb = "\u{1b}[0;31mZeroDivisionError\u{1b}[0m: division by zero \u{1b}]8;;http://x\u{7}link";
    assert_eq!(strip_ansi(tb), "ZeroDivisionError: division by zero link");
}

#[test]
fn summaries() {
    let html = b"<div><table border=\"1\" class=\"dataframe\"><tr></tr></table></div>";
    assert_eq!(
        summarize(
            "text/html",
            html,
            Some("   a  b\n0  1  2"),
            (None, None),
            None
        ),
        "DataFrame-like HTML table: a  b"
    );
    assert_eq!(
        summarize("text/markdown", b"# Title\nbody", None, (None, None), None),
        "Markdown: # Title"
    );
}

fn reserve(
    store: &Arc<ArtifactStore>,
    session: &str,
    bytes: &[u8],
) -> (Arc<Artifact>, Reservation) {
    let n = new(session, "image/png", None);
    let description = Description::from_head(&n, &bytes[..bytes.len().min(64)], bytes.len() as u64);
    store.reserve(&n, description).unwrap()
}

#[tokio::test]
async fn a_fetch_waits_for_a_reserved_artifact() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(ArtifactStore::new(dir.path().to_owned(), Duration::ZERO).unwrap());
    let mut content = png(800, 600);
    content.resize(3 << 20, 42);
    let (artifact, reservation) = reserve(&store, "s", &content);
    assert_eq!((artifact.width, artifact.height), (Some(800), Some(600)));
    assert_eq!(artifact.bytes, 3 << 20);
    assert!(store.path_of(&artifact.id).is_none(), "not stored yet");
    let id = artifact.id.clone();
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move { store.open(&id, Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "the fetch waits for the bytes");
    let filled = {
        let content = content.clone();
        tokio::task::spawn_blocking(move || reservation.fill(&content))
    };
    filled.await.unwrap().unwrap();
    let (opened, path) = waiting.await.unwrap().unwrap().expect("stored");
    assert_eq!(opened.id, artifact.id);
    assert_eq!(std::fs::read(path).unwrap(), content);
}

#[tokio::test]
async fn a_failed_or_abandoned_reservation_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(ArtifactStore::new(dir.path().to_owned(), Duration::ZERO).unwrap());
    let content = png(10, 10);
    // Bytes of another size than announced are refused.
    let (wrong, reservation) = reserve(&store, "s", &content);
    let err = reservation.fill(&content[..5]).unwrap_err();
    assert!(
        matches!(err, ArtifactError::SizeMismatch { promised, got: 5 } if promised == content.len() as u64),
        "{err}"
    );
    assert!(store.get(&wrong.id).is_none());
    assert!(store
        .open(&wrong.id, Duration::from_secs(1))
        .await
        .unwrap()
        .is_none());
    // Dropped unfilled (the storing task died): a waiting fetch answers "not found".
    let (dropped, reservation) = reserve(&store, "s", &content);
    let id = dropped.id.clone();
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move { store.open(&id, Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(reservation);
    assert!(waiting.await.unwrap().unwrap().is_none());
    // Still pending when the wait ends: a clear error, not a hang.
    let (slow, _reservation) = reserve(&store, "s", &content);
    let err = store
        .open(&slow.id, Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(matches!(err, ArtifactError::NotReady(_)), "{err}");
    let blobs = walk_files(dir.path());
    assert!(blobs.is_empty(), "no blob left behind: {blobs:?}");
}

#[test]
fn a_reservation_whose_session_expired_meanwhile_stores_no_blob() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(ArtifactStore::new(dir.path().to_owned(), Duration::ZERO).unwrap());
    let content = png(10, 10);
    let (artifact, reservation) = reserve(&store, "gone", &content);
    // The same bytes stored for another session, then that one reaped.
    let other = store
        .put(&new("other", "image/png", None), &content)
        .unwrap();
    store.expire_session("gone");
    store.reap();
    assert!(store.get(&artifact.id).is_none());
    reservation.fill(&content).unwrap();
    assert!(store.get(&artifact.id).is_none());
    let path = store.path_of(&other.id).expect("the other session's blob");
    assert!(path.exists(), "the blob shared with a live artifact stays");
    store.expire_session("other");
    store.reap();
    assert!(!path.exists(), "and goes with its last user");
    assert!(walk_files(dir.path()).is_empty());
}

fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk_files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

fn limited<'a>(session: &'a str, owner: Option<&'a str>, quotas: Quotas) -> NewArtifact<'a> {
    NewArtifact {
        owner,
        quotas,
        ..new(session, "text/html", None)
    }
}

#[test]
fn session_and_tenant_quotas_refuse_and_name_themselves() {
    let dir = tempfile::tempdir().unwrap();
    let store = ArtifactStore::new(dir.path().join("a"), Duration::from_secs(60)).unwrap();
    let quotas = Quotas {
        per_session: 1000,
        per_tenant: 1500,
    };
    let chunk = |c: u8| vec![c; 400];
    store
        .put(&limited("s1", Some("t"), quotas), &chunk(b'a'))
        .unwrap();
    store
        .put(&limited("s1", Some("t"), quotas), &chunk(b'b'))
        .unwrap();
    let err = store
        .put(&limited("s1", Some("t"), quotas), &chunk(b'c'))
        .unwrap_err();
    assert_eq!(err.quota(), Some(Quota::ArtifactsPerSession), "{err}");
    assert!(err.to_string().contains("artifacts_per_session"), "{err}");
    // Another session of the same tenant: its own session quota, the tenant's shared one.
    store
        .put(&limited("s2", Some("t"), quotas), &chunk(b'd'))
        .unwrap();
    let err = store
        .put(&limited("s2", Some("t"), quotas), &chunk(b'e'))
        .unwrap_err();
    assert_eq!(err.quota(), Some(Quota::ArtifactsPerTenant), "{err}");
    assert_eq!(
        store
            .check(&limited("s2", Some("t"), quotas), 400)
            .unwrap_err()
            .quota(),
        Some(Quota::ArtifactsPerTenant)
    );
    // Another tenant is not charged for t's bytes.
    store
        .put(&limited("s3", Some("u"), quotas), &chunk(b'f'))
        .unwrap();
    // Refused content leaves no blob behind: three of t's, one of u's.
    let blobs = walk_files(&dir.path().join("a"));
    assert_eq!(blobs.len(), 4, "blobs on disk: {blobs:?}");
    // A deleted session's retained artifacts still count for its tenant, until reaped.
    store.expire_session("s1");
    assert!(store
        .put(&limited("s4", Some("t"), quotas), &chunk(b'g'))
        .is_err());
}

#[test]
fn reaping_frees_the_quota() {
    let dir = tempfile::tempdir().unwrap();
    let store = ArtifactStore::new(dir.path().join("a"), Duration::ZERO).unwrap();
    let quotas = Quotas {
        per_session: u64::MAX,
        per_tenant: 500,
    };
    store
        .put(&limited("s1", None, quotas), &[1u8; 400])
        .unwrap();
    assert!(store
        .put(&limited("s2", None, quotas), &[2u8; 400])
        .is_err());
    store.expire_session("s1");
    store.reap();
    store
        .put(&limited("s2", None, quotas), &[2u8; 400])
        .unwrap();
}

#[test]
fn below_the_free_disk_minimum_retained_artifacts_go_oldest_first() {
    let dir = tempfile::tempdir().unwrap();
    // A disk of 10 MiB that holds only the store (a real one changes under other tests).
    let mut store = ArtifactStore::new(dir.path().join("a"), Duration::from_secs(3600))
        .unwrap()
        .with_min_free_disk(6 << 20);
    store.free_space = Box::new(|dir: &Path| Ok((10u64 << 20).saturating_sub(du(dir))));
    let mib = |c: u8| vec![c; 1 << 20];
    let old = store.put(&new("old", "image/png", None), &mib(1)).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let newer = store.put(&new("old", "image/png", None), &mib(2)).unwrap();
    let live = store.put(&new("live", "image/png", None), &mib(3)).unwrap();
    let live2 = store.put(&new("live", "image/png", None), &mib(4)).unwrap();
    // 4 MiB stored, 6 MiB free: nothing retained yet, and a live session's artifacts are
    // never taken back.
    let err = store
        .put(&new("live", "image/png", None), &mib(5))
        .unwrap_err();
    assert_eq!(err.quota(), Some(Quota::ArtifactMinFreeDisk), "{err}");
    assert!(err.to_string().contains("artifact_min_free_disk"), "{err}");
    assert!([&old, &newer, &live, &live2]
        .iter()
        .all(|a| store.get(&a.id).is_some()));
    // Once "old" is deleted, its oldest artifact makes room, and only as much as needed.
    store.expire_session("old");
    store.put(&new("live", "image/png", None), &mib(5)).unwrap();
    assert!(
        store.get(&old.id).is_none(),
        "the oldest retained artifact went"
    );
    assert!(
        store.get(&newer.id).is_some(),
        "only as many as needed went"
    );
    assert!(store.get(&live.id).is_some() && store.get(&live2.id).is_some());
    assert_eq!(du(dir.path()), 4 << 20, "the freed blob is gone from disk");
    // The sweeper does the same under pressure, before the retention ends.
    store.min_free_disk = 7 << 20;
    store.reap();
    assert!(store.get(&newer.id).is_none(), "reaped under pressure");
    assert!(store.get(&live.id).is_some());
}

/// Bytes of the files under `dir`.
fn du(dir: &Path) -> u64 {
    let mut n = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let meta = entry.metadata().unwrap();
        n += if meta.is_dir() {
            du(&entry.path())
        } else {
            meta.len()
        };
    }
    n
}

/// Reserved bytes count against the disk minimum before they are written: two large outputs
/// checked while neither is on the disk cannot both take the last of it. Filled or dropped,
/// a reservation gives its count back.
#[test]
fn reservations_in_flight_count_against_the_free_disk_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = ArtifactStore::new(dir.path().join("a"), Duration::from_secs(3600))
        .unwrap()
        .with_min_free_disk(5 << 20);
    store.free_space = Box::new(|dir: &Path| Ok((10u64 << 20).saturating_sub(du(dir))));
    let store = Arc::new(store);
    let content = vec![7u8; 3 << 20];
    // 10 MiB free, 5 kept: one 3 MiB output fits, a second does not while the first is
    // only reserved (5 MiB to spare on paper, but 3 of them promised).
    let (_, first) = reserve(&store, "s", &content);
    let n = new("s", "image/png", None);
    let description = Description::from_head(&n, &content[..64], content.len() as u64);
    let Err(err) = store.reserve(&n, description) else {
        panic!("a second 3 MiB output fits beside a reserved one");
    };
    assert_eq!(err.quota(), Some(Quota::ArtifactMinFreeDisk), "{err}");
    // Dropped unfilled, the promise goes: the second fits now.
    drop(first);
    let (_, second) = reserve(&store, "s", &content);
    second.fill(&content).unwrap();
    // Written, the bytes are in the free space read and no longer promised: 7 MiB free, 5
    // kept, so 2 MiB fit exactly (counted twice, they would not).
    let (_, third) = reserve(&store, "s", &[8u8; 2 << 20]);
    drop(third);
    assert_eq!(store.index.read().unwritten, 0);
}
