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
    assert_eq!(a.sha256, b.sha256);
    assert_eq!((a.width, a.height), (Some(640), Some(480)));
    assert_eq!(a.summary, "PNG image 640×480");
    let path = store.path_of(&a);
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
    assert_eq!(v2.previous.as_deref(), Some(v1.id.as_str()));
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
    assert_eq!(std::fs::read(store.path_of(&ok)).unwrap(), data);
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
