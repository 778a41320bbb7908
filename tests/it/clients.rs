//! Several clients on one kernel, reconnects, and buffering while nobody is connected.

use std::time::Duration;

use crate::support::*;

#[tokio::test]
async fn two_clients_share_iopub_and_keep_their_own_replies() -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut a = gateway.connect(&kernel, "client-a", false).await?;
    let mut b = gateway.connect(&kernel, "client-b", true).await?;
    let id = a.execute("print('from a')").await?;
    let seen_by_a = a.collect(&id, Duration::from_secs(30)).await?;
    assert_eq!(stdout(&seen_by_a), "from a\n");
    // b sees a's output and idle, but not a's reply.
    let mut seen_by_b = vec![];
    loop {
        let msg = b.recv(Duration::from_secs(10)).await?;
        let done = msg.is_idle_for(&id);
        seen_by_b.push(msg);
        if done {
            break;
        }
    }
    assert_eq!(stdout(&seen_by_b), "from a\n");
    assert!(
        seen_by_b.iter().all(|m| m.channel != "shell"),
        "b got a's reply"
    );
    // And a stray reply does not arrive later either.
    assert!(b.recv(Duration::from_millis(300)).await.is_err());
    let (_, model) = gateway.get_json(&format!("/api/kernels/{kernel}")).await?;
    assert_eq!(model["connections"], 2);
    Ok(())
}

/// JupyterLab reconnects with the same session_id while the old socket is still closing.
/// Kernel Gateway 3.0.1 loses the reply here; every reply must arrive.
#[tokio::test]
async fn same_session_reconnect_race_loses_no_reply() -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    for round in 0..5 {
        let mut old = gateway.connect(&kernel, "lab-client", false).await?;
        let id = old
            .execute(&format!("import time; time.sleep(0.2); print({round})"))
            .await?;
        // The new socket opens before the old one is gone.
        let mut new = gateway.connect(&kernel, "lab-client", false).await?;
        old.close().await;
        let msgs = new.collect(&id, Duration::from_secs(30)).await?;
        assert_eq!(reply(&msgs).content["status"], "ok", "round {round}");
        new.close().await;
    }
    Ok(())
}

#[tokio::test]
async fn output_produced_while_disconnected_is_replayed_exactly_once() -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "blip", true).await?;
    let id = client
        .execute("import time\nfor i in range(6):\n    print('tick', i, flush=True)\n    time.sleep(0.15)")
        .await?;
    // Read a little, then drop the connection mid-cell (an abrupt network blip).
    let first = client.recv(Duration::from_secs(30)).await?;
    let mut seen = vec![first];
    drop(client);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut again = gateway.connect(&kernel, "blip", true).await?;
    seen.extend(again.collect(&id, Duration::from_secs(30)).await?);
    let out = stdout(&seen);
    let expected: String = (0..6).map(|i| format!("tick {i}\n")).collect();
    assert_eq!(out, expected, "nothing lost, nothing duplicated");
    assert_eq!(reply(&seen).content["status"], "ok");
    // A client with another session id gets no replay.
    let mut other = gateway.connect(&kernel, "other", true).await?;
    assert!(other.recv(Duration::from_millis(500)).await.is_err());
    Ok(())
}
