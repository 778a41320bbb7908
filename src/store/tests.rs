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
    assert!(!store.read(|c| Ok(records::has_session(c, "s2"))).unwrap());
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
    // The daily quota's sums, per tenant and UTC day.
    assert_eq!(store.cpu_ms_of_day("acme", "2026-01-01").unwrap(), 3);
    assert_eq!(store.cpu_ms_of_day("acme", "2026-01-02").unwrap(), 3);
    assert_eq!(store.cpu_ms_of_day("umbrella", "2026-01-02").unwrap(), 3);
    assert_eq!(store.cpu_ms_of_day("umbrella", "2026-01-01").unwrap(), 0);
    store.record_usage(UsageRow {
        cpu_ms: Some(40),
        ..usage(Some("acme"), "2026-01-02T23:59:59.999999Z")
    });
    store.record_usage(UsageRow {
        cpu_ms: None,
        ..usage(Some("acme"), "2026-01-02T23:59:59.999999Z")
    });
    store.flush().unwrap();
    assert_eq!(store.cpu_ms_of_day("acme", "2026-01-02").unwrap(), 43);
}

/// SQLite's plan for `sql` with `values`, one line per step.
fn plan(connection: &Connection, sql: &str, values: &[Option<String>]) -> String {
    let mut explain = connection
        .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
        .unwrap();
    explain
        .query_map(rusqlite::params_from_iter(values.iter()), |row| {
            row.get::<_, String>(3)
        })
        .unwrap()
        .collect::<rusqlite::Result<Vec<_>>>()
        .unwrap()
        .join("\n")
}

#[test]
fn every_ledger_query_is_served_by_an_index() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    for day in 1..=9 {
        for tenant in [Some("acme"), Some("umbrella"), None] {
            store.record_usage(usage(tenant, &format!("2026-01-0{day}T00:00:00.000000Z")));
        }
    }
    store.flush().unwrap();
    let connection = connect(&store.db, false).unwrap();
    // With statistics, as a long-running database has them: the planner's choice is then
    // the one it makes in production, not a guess on an empty table.
    connection.execute_batch("ANALYZE").unwrap();
    let tenants = [None, Some(None), Some(Some("acme".to_owned()))];
    let times = [
        (None, None),
        (Some("2026-01-03T00:00:00.000000Z"), None),
        (
            Some("2026-01-03T00:00:00.000000Z"),
            Some("2026-01-05T00:00:00.000000Z"),
        ),
        (None, Some("2026-01-05T00:00:00.000000Z")),
    ];
    for tenant in &tenants {
        for (since, until) in times {
            let query = UsageQuery {
                tenant: tenant.clone(),
                since: since.map(str::to_owned),
                until: until.map(str::to_owned),
                limit: 10,
            };
            let (sql, values) = records::usage_sql(&query);
            let plan = plan(&connection, &sql, &values);
            // A condition is a search of an index; none (every row, oldest first, up to the
            // limit) is the time index read in order, which the limit stops early.
            let conditioned =
                query.tenant.is_some() || query.since.is_some() || query.until.is_some();
            let served = if conditioned {
                plan.starts_with("SEARCH usage USING INDEX")
            } else {
                plan.starts_with("SCAN usage USING INDEX usage_by_at")
            };
            assert!(served, "{query:?} is not served by an index:\n{plan}");
            assert!(
                !plan.contains("TEMP B-TREE"),
                "{query:?} sorts its rows apart:\n{plan}"
            );
            // What the plan says is what the store answers.
            let expected = store
                .usage(&UsageQuery {
                    limit: 100,
                    ..query.clone()
                })
                .unwrap();
            let answered = records::usage(&connection, &query).unwrap();
            assert_eq!(answered, expected.into_iter().take(10).collect::<Vec<_>>());
        }
    }
    let quota = plan(
        &connection,
        "SELECT cpu_ms FROM usage_daily WHERE tenant = ?1 AND day = ?2",
        &[Some("acme".to_owned()), Some("2026-01-02".to_owned())],
    );
    assert!(
        quota.contains("SEARCH usage_daily USING PRIMARY KEY"),
        "{quota}"
    );
}

#[test]
fn rows_past_the_retention_are_swept_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let now = time::OffsetDateTime::now_utc();
    let at =
        |days_ago: i64| crate::timestamp::format_timestamp(now - time::Duration::days(days_ago));
    {
        let store = Store::open_with(
            dir.path(),
            StoreOptions {
                usage_retention_days: 0,
            },
        )
        .unwrap();
        for days_ago in [400, 31, 29, 0] {
            store.record_usage(usage(Some("acme"), &at(days_ago)));
        }
        store.flush().unwrap();
    }
    // A retention of 0 kept them all.
    let kept = |store: &Store| {
        store
            .usage(&UsageQuery {
                limit: 100,
                ..Default::default()
            })
            .unwrap()
            .into_iter()
            .map(|row| row.at)
            .collect::<Vec<_>>()
    };
    let store = Store::open(dir.path()).unwrap();
    store.flush().unwrap();
    assert_eq!(kept(&store), [at(31), at(29), at(0)], "90 days by default");
    drop(store);
    let store = Store::open_with(
        dir.path(),
        StoreOptions {
            usage_retention_days: 30,
        },
    )
    .unwrap();
    store.flush().unwrap();
    assert_eq!(kept(&store), [at(29), at(0)]);
    // The daily sums go with their days.
    assert_eq!(store.cpu_ms_of_day("acme", &at(31)[..10]).unwrap(), 0);
    assert_eq!(store.cpu_ms_of_day("acme", &at(29)[..10]).unwrap(), 3);
}

#[test]
fn a_read_does_not_wait_for_another_reader() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store.record_usage(usage(Some("acme"), "2026-01-01T00:00:00.000000Z"));
    store.flush().unwrap();
    // A writer outside the store holding SQLite's write lock: WAL readers go on.
    let mut other = connect(&store.db, false).unwrap();
    let held = other
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .unwrap();
    held.execute("DELETE FROM usage", []).unwrap();
    // Reads from inside another read (one connection for all would wait for itself).
    let nested = store
        .read(|_| {
            Ok(store
                .usage(&UsageQuery {
                    limit: 10,
                    ..Default::default()
                })
                .unwrap()
                .len())
        })
        .unwrap();
    assert_eq!(nested, 1, "the uncommitted delete is not seen");
    drop(held);
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
