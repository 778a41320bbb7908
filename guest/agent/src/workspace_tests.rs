use std::io::Read;

use super::*;

fn workspace() -> (tempfile::TempDir, Workspace) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ws")).unwrap();
    let ws = Workspace::open(dir.path(), Path::new("ws")).unwrap();
    (dir, ws)
}

#[test]
fn client_paths_are_checked() {
    for bad in ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a\0b", "/"] {
        assert!(check_path(bad).is_err(), "{bad:?}");
    }
    assert_eq!(check_path("a/b//c.txt").unwrap(), vec!["a", "b", "c.txt"]);
    assert!(check_path(&"x".repeat(256)).is_err());
}

#[test]
fn upload_then_download_and_list() {
    let (dir, ws) = workspace();
    let mut up = ws.create("data/in.csv").unwrap();
    up.write(b"a,b\n1,2\n", 100).unwrap();
    assert!(
        !dir.path().join("ws/data/in.csv").exists(),
        "not visible before commit"
    );
    assert_eq!(up.commit().unwrap(), 8);
    let (mut file, size) = ws.open_read("data/in.csv").unwrap();
    assert_eq!(size, 8);
    let mut downloaded = Vec::new();
    file.read_to_end(&mut downloaded).unwrap();
    assert_eq!(downloaded, b"a,b\n1,2\n");
    let list = ws.list("", Listing::ALL).unwrap();
    let paths: Vec<_> = list.iter().map(|e| (e.path.as_str(), e.kind)).collect();
    assert_eq!(paths, vec![("data", "dir"), ("data/in.csv", "file")]);
}

#[test]
fn oversized_uploads_leave_nothing() {
    let (dir, ws) = workspace();
    let mut up = ws.create("big.bin").unwrap();
    up.write(&[0; 10], 15).unwrap();
    assert!(matches!(
        up.write(&[0; 10], 15),
        Err(WorkspaceError::TooLarge { limit: 15 })
    ));
    drop(up);
    assert_eq!(std::fs::read_dir(dir.path().join("ws")).unwrap().count(), 0);
}

#[test]
fn planted_symlinks_are_never_followed() {
    let (dir, ws) = workspace();
    let outside = dir.path().join("secret");
    std::fs::write(&outside, "host secret").unwrap();
    let base = dir.path().join("ws");
    std::os::unix::fs::symlink(&outside, base.join("abs")).unwrap();
    std::os::unix::fs::symlink("../secret", base.join("rel")).unwrap();
    std::os::unix::fs::symlink("/etc", base.join("etc")).unwrap();
    std::os::unix::fs::symlink(dir.path(), base.join("up")).unwrap();
    for path in ["abs", "rel", "etc/passwd", "up/secret"] {
        assert!(
            matches!(ws.open_read(path), Err(WorkspaceError::Link(_))),
            "{path}"
        );
    }
    // Writing through a planted directory link is refused; writing onto a file link
    // replaces the link itself.
    assert!(matches!(
        ws.create("up/secret"),
        Err(WorkspaceError::Link(_))
    ));
    let mut up = ws.create("abs").unwrap();
    up.write(b"mine", 10).unwrap();
    up.commit().unwrap();
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "host secret");
    assert_eq!(std::fs::read_to_string(base.join("abs")).unwrap(), "mine");
    let kinds: Vec<_> = ws
        .list("", Listing::ALL)
        .unwrap()
        .into_iter()
        .map(|e| (e.path, e.kind))
        .collect();
    assert!(kinds.contains(&("etc".to_owned(), "symlink")));
    assert!(kinds.iter().all(|(p, _)| !p.starts_with("etc/")));
}

#[test]
fn fifos_and_directories_are_not_files() {
    let (dir, ws) = workspace();
    let base = dir.path().join("ws");
    std::fs::create_dir(base.join("d")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        base.join("fifo"),
        rustix::fs::FileType::Fifo,
        Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    assert!(matches!(
        ws.open_read("d"),
        Err(WorkspaceError::IsADirectory(_))
    ));
    assert!(matches!(
        ws.open_read("fifo"),
        Err(WorkspaceError::NotAFile(_))
    ));
    assert!(matches!(
        ws.open_read("none"),
        Err(WorkspaceError::NotFound(_))
    ));
}
