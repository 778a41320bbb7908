use serde_json::json;

use super::*;

fn session(id: &str) -> SessionRow {
    SessionRow {
        id: id.to_owned(),
        tenant: Some("acme".to_owned()),
        policy: "default".to_owned(),
        kernel_name: "python3".to_owned(),
        language: "python".to_owned(),
        sandbox: "namespaces".to_owned(),
        created: "2026-01-01T00:00:00.000000Z".to_owned(),
        generation: 1,
    }
}

fn usage(tenant: Option<&str>, at: &str) -> UsageRow {
    UsageRow {
        at: at.to_owned(),
        tenant: tenant.map(str::to_owned),
        session: "s1".to_owned(),
        policy: "default".to_owned(),
        execution_id: "e".to_owned(),
        wall_ms: 12,
        cpu_ms: Some(3),
        peak_memory_bytes: Some(1 << 20),
        output_bytes: 5,
        artifact_bytes: 0,
        outcome: "ok".to_owned(),
    }
}

#[test]
fn what_is_written_is_there_after_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path()).unwrap();
        store.put_session(session("s1"));
        store.put_session(session("s2"));
        store.set_generation("s1", 3);
        store.put_cells(
            "s1",
            Some(json!({"name": "python"})),
            vec![(0, json!({"source": "1"})), (1, json!({"source": "2"}))],
        );
        // A cell written again replaces itself.
        store.put_cells("s1", None, vec![(1, json!({"source": "2!"}))]);
        store.put_execution(
            "s1",
            ExecutionRow {
                execution_id: "e1".to_owned(),
                code: "1".to_owned(),
                started: "t".to_owned(),
                result: Some(json!({"status": "ok"})),
            },
        );
        store.put_artifact(ArtifactRow {
            id: "a1".to_owned(),
            session: "s1".to_owned(),
            tenant: Some("acme".to_owned()),
            sha256: "ab".repeat(32),
            record: json!({"mime": "image/png"}),
            expires_at: None,
            linkable: true,
        });
        store.delete_session("s2");
        // Cells of a session that is gone are not kept.
        store.put_cells("s2", None, vec![(0, json!({}))]);
        store.record_usage(usage(Some("acme"), "2026-01-01T00:00:01.000000Z"));
        store.flush().unwrap();
    }
    let store = Store::open(dir.path()).unwrap();
    let loaded = store.load().unwrap();
    assert_eq!(loaded.sessions.len(), 1);
    let s1 = &loaded.sessions[0];
    assert_eq!(
        s1.session,
        SessionRow {
            generation: 3,
            ..session("s1")
        }
    );
    assert_eq!(s1.language_info, Some(json!({"name": "python"})));
    assert_eq!(
        s1.cells,
        vec![json!({"source": "1"}), json!({"source": "2!"})]
    );
    assert_eq!(s1.executions.len(), 1);
    assert_eq!(s1.executions[0].result, Some(json!({"status": "ok"})));
    assert_eq!(loaded.artifacts.len(), 1);
    assert_eq!(loaded.artifacts[0].record, json!({"mime": "image/png"}));
    assert!(!records::has_session(&store.reader.lock(), "s2"));
    // Expiry and revocation reach the row.
    store.expire_artifacts("s1", 1234, true);
    store.flush().unwrap();
    let artifact = &store.load().unwrap().artifacts[0];
    assert_eq!(
        (artifact.expires_at, artifact.linkable),
        (Some(1234), false)
    );
    store.delete_artifacts(vec!["a1".to_owned()]);
    store.flush().unwrap();
    assert!(store.load().unwrap().artifacts.is_empty());
}

#[test]
fn the_ledger_answers_by_tenant_and_period() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store.record_usage(usage(Some("acme"), "2026-01-01T00:00:00.000000Z"));
    store.record_usage(usage(Some("acme"), "2026-01-02T00:00:00.000000Z"));
    store.record_usage(usage(Some("umbrella"), "2026-01-02T00:00:00.000000Z"));
    store.record_usage(usage(None, "2026-01-02T00:00:00.000000Z"));
    store.flush().unwrap();
    let all = |query: UsageQuery| {
        store
            .usage(&UsageQuery {
                limit: 100,
                ..query
            })
            .unwrap()
    };
    assert_eq!(all(UsageQuery::default()).len(), 4);
    let acme = all(UsageQuery {
        tenant: Some(Some("acme".to_owned())),
        ..Default::default()
    });
    assert_eq!(acme.len(), 2);
    assert_eq!(acme[0], usage(Some("acme"), "2026-01-01T00:00:00.000000Z"));
    let admin = all(UsageQuery {
        tenant: Some(None),
        ..Default::default()
    });
    assert_eq!(admin.len(), 1);
    let second_day = all(UsageQuery {
        since: Some("2026-01-02T00:00:00.000000Z".to_owned()),
        until: Some("2026-01-03T00:00:00.000000Z".to_owned()),
        ..Default::default()
    });
    assert_eq!(second_day.len(), 3);
    let acme_cpu = store
        .cpu_ms(&UsageQuery {
            tenant: Some(Some("acme".to_owned())),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(acme_cpu, 6);
}

#[test]
fn a_second_opener_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let _first = Store::open(dir.path()).unwrap();
    match Store::open(dir.path()) {
        Err(err @ StoreError::Locked { .. }) => {
            assert!(
                err.to_string()
                    .contains(&format!("pid {}", std::process::id())),
                "{err}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn garbage_for_a_database_stops_the_open_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    let db = dir.path().join(DB_FILE);
    std::fs::write(&db, vec![0x5a; 8192]).unwrap();
    match Store::open(dir.path()) {
        Err(err @ StoreError::Corrupt { .. }) => {
            assert!(err.to_string().contains(&db.display().to_string()), "{err}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_missing_or_emptied_database_is_an_error_not_a_fresh_start() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    let db = dir.path().join(DB_FILE);
    std::fs::remove_file(&db).unwrap();
    assert!(matches!(
        Store::open(dir.path()),
        Err(StoreError::Missing { .. })
    ));
    assert!(!db.exists(), "a refused open must not create the file");
    std::fs::write(&db, b"").unwrap();
    assert!(matches!(
        Store::open(dir.path()),
        Err(StoreError::Corrupt { .. })
    ));
}

#[test]
fn a_newer_schema_stops_the_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    let db = dir.path().join(DB_FILE);
    Connection::open(&db)
        .unwrap()
        .execute_batch(&format!("PRAGMA user_version = {}", schema::VERSION + 7))
        .unwrap();
    match Store::open(dir.path()) {
        Err(StoreError::TooNew { found, known, .. }) => {
            assert_eq!((found, known), (schema::VERSION + 7, schema::VERSION))
        }
        other => panic!("{other:?}"),
    }
}
