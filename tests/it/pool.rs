//! The warm pool: ready kernels handed out on start, refilled, never reused.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::*;

/// Kernels that became ready so far, from the gateway's log.
fn ready_count(gateway: &Gateway) -> usize {
    gateway.log().matches("kernel ready").count()
}

#[tokio::test]
async fn kernels_come_ready_from_the_pool_and_are_never_reused() -> anyhow::Result<()> {
    let gateway = Gateway::builder()
        .args(&["--pool-size", "2"])
        .start()
        .await?;
    // The pool fills in the background (two kernel starts); wait until two kernels answer
    // from it.
    let before_ready = Instant::now();
    let mut pooled_ids = vec![];
    while pooled_ids.len() < 2 {
        assert!(
            before_ready.elapsed() < 2 * PATIENCE,
            "the pool never filled"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (_, list) = gateway.get_json("/api/kernels").await?;
        assert_eq!(list, json!([]), "pooled kernels are not listed");
        let log = gateway.log();
        pooled_ids = log
            .matches("kernel joined the warm pool")
            .map(|_| ())
            .collect();
    }

    // A start now is served by a ready kernel: it is idle at once, and it gets the client's
    // KERNEL_* variables although it started before the request.
    let started = Instant::now();
    let response = gateway
        .request(reqwest::Method::POST, "/api/kernels")
        .json(&json!({"name": "python3", "env": {"KERNEL_USERNAME": "ada"}}))
        .send()
        .await?;
    let post_time = started.elapsed();
    assert_eq!(response.status().as_u16(), 201);
    let model: serde_json::Value = response.json().await?;
    assert_eq!(model["execution_state"], "idle", "{model}");
    let id = model["id"].as_str().unwrap().to_owned();
    let mut client = gateway.connect(&id, "pool", false).await?;
    let msgs = client
        .run("import os; print(os.environ['KERNEL_USERNAME'])")
        .await?;
    assert_eq!(stdout(&msgs), "ada\n");
    let count = reply(&msgs).content["execution_count"].clone();
    assert_eq!(
        count, 1,
        "setting the environment left no trace in the history"
    );
    println!("POST /api/kernels from the pool took {post_time:?}");
    // Logged before the answer, but read from the gateway's stderr by another thread.
    assert!(
        eventually(PATIENCE, || gateway
            .log()
            .contains("handed out from the warm pool"))
        .await
    );

    // A handed-out kernel, once deleted, is gone for good; the pool refills with new ones.
    client.run("touched = True").await?;
    assert_eq!(gateway.delete_kernel(&id).await?, 204);
    let second = gateway.start_kernel().await?;
    assert_ne!(second, id);
    let mut client = gateway.connect(&second, "pool2", false).await?;
    let msgs = client.run("'touched' in dir()").await?;
    assert_eq!(
        of_type(&msgs, "execute_result")[0].content["data"]["text/plain"],
        "False"
    );
    // Refill: each hand-out started a replacement (two kernel starts).
    let refilled = eventually(2 * PATIENCE, || ready_count(&gateway) >= 4).await;
    assert!(
        refilled,
        "the pool refilled: {} kernels ready",
        ready_count(&gateway)
    );

    // Other policies do not come from the pool.
    let response = gateway
        .request(reqwest::Method::POST, "/api/kernels")
        .json(&json!({"env": {"KERNEL_POLICY": "strict"}}))
        .send()
        .await?;
    let model: serde_json::Value = response.json().await?;
    assert_eq!(model["execution_state"], "starting");
    assert_eq!(model["cellgate"]["policy"], "strict");
    Ok(())
}

/// `--pool-kernels` keeps ready kernels of other kernelspecs too: a Deno session comes from
/// its own pool (idle at once, logged as handed out), a bash one (not pooled) starts cold,
/// and an unknown name stops the gateway at start with the names it knows.
#[tokio::test]
async fn other_kernelspecs_come_from_their_own_pools() -> anyhow::Result<()> {
    let gateway = Gateway::builder()
        .args(&["--pool-size", "1", "--pool-kernels", "python3,deno"])
        .start()
        .await?;
    let filled = eventually(2 * PATIENCE, || {
        let log = gateway.log();
        log.contains("kernel joined the warm pool kernel_id")
            && log.matches("kernel joined the warm pool").count() >= 2
            && log.contains("kernelspec=deno")
    })
    .await;
    assert!(filled, "both pools filled:\n{}", gateway.log());

    // API v1 (its executions wait out Deno's late outputs; the test client's `run` ends at
    // the idle, which Deno may send before the value).
    let v1 = crate::support::v1::V1Client::new(&gateway);
    let created = v1.new_session(json!({"kernel_name": "deno"})).await?;
    assert_eq!(created.model.kernel_name, "deno", "{:?}", created.model);
    assert!(
        eventually(PATIENCE, || gateway
            .log()
            .contains("handed out from the warm pool"))
        .await,
        "the Deno session came from its pool:\n{}",
        gateway.log()
    );
    let r = v1.execute(&created.id, "6 * 7").await?;
    assert_eq!(r["result"], "42", "{r}");
    let handed_out = gateway
        .log()
        .matches("handed out from the warm pool")
        .count();
    let bash = v1.create_session(json!({"kernel_name": "bash"})).await?;
    let r = v1.execute(&bash, "echo ok").await?;
    assert_eq!(r["stdout"], "ok\n", "{r}");
    assert_eq!(
        gateway
            .log()
            .matches("handed out from the warm pool")
            .count(),
        handed_out,
        "bash is not pooled"
    );

    let refused = Gateway::builder()
        .args(&["--pool-kernels", "python3,no-such-kernel"])
        .start()
        .await;
    let err = format!(
        "{:#}",
        refused.err().expect("an unknown kernelspec is refused")
    );
    assert!(err.contains("no-such-kernel"), "{err}");

    // A pooled kernelspec the default sandbox cannot run is refused at start, not left as a
    // pool that never fills (and a /readyz that answers 503 for good): here a microVM guest
    // whose manifest lists no environments (one built before them holds python3's alone).
    let old_guest = tempfile::tempdir()?;
    std::fs::write(
        old_guest.path().join("guest.json"),
        r#"{"kernel": "vmlinux", "initramfs": "initramfs.cpio.gz", "root": "root.ext4"}"#,
    )?;
    for file in ["vmlinux", "initramfs.cpio.gz", "root.ext4"] {
        std::fs::write(old_guest.path().join(file), "")?;
    }
    let refused = Gateway::builder()
        .args(&[
            "--sandbox",
            "microvm",
            "--guest-dir",
            old_guest.path().to_str().expect("a UTF-8 temporary path"),
            "--pool-size",
            "1",
            "--pool-kernels",
            "python3,deno",
        ])
        .start()
        .await;
    let err = format!(
        "{:#}",
        refused
            .err()
            .expect("a pooled kernelspec microVMs cannot run is refused")
    );
    assert!(
        err.contains("kernelspec deno is in the warm pool") && err.contains("microvm"),
        "{err}"
    );
    Ok(())
}
