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
        let msg = b.recv(PATIENCE).await?;
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

fn ticks(msgs: &[Msg]) -> Vec<u32> {
    stdout(msgs)
        .lines()
        .filter_map(|l| l.strip_prefix("tick ").and_then(|n| n.parse().ok()))
        .collect()
}

const TICKING: &str =
    "import time\nfor i in range(6):\n    print('tick', i, flush=True)\n    time.sleep(0.15)";

/// JupyterLab closing its socket and reconnecting with the same session_id: with a close
/// handshake (the client reads until the gateway's close frame) nothing is lost or duplicated.
#[tokio::test]
async fn graceful_reconnect_replays_everything_exactly_once() -> anyhow::Result<()> {
    use futures_util::StreamExt;
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "blip", true).await?;
    let id = client.execute(TICKING).await?;
    let mut seen = vec![];
    loop {
        let msg = client.recv(Duration::from_secs(30)).await?;
        let first_tick = msg.msg_type() == "stream";
        seen.push(msg);
        if first_tick {
            break;
        }
    }
    // Close, and read what was already on its way until the gateway's close frame.
    client.socket.close(None).await?;
    while let Some(Ok(frame)) = client.socket.next().await {
        if let Ok(Some(msg)) = decode_for_test(frame, true) {
            seen.push(msg);
        }
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut again = gateway.connect(&kernel, "blip", true).await?;
    seen.extend(again.collect(&id, Duration::from_secs(30)).await?);
    assert_eq!(
        ticks(&seen),
        [0, 1, 2, 3, 4, 5],
        "nothing lost, nothing duplicated"
    );
    assert_eq!(of_type(&seen, "execute_reply").len(), 1);
    // A client with another session id gets no replay.
    let mut other = gateway.connect(&kernel, "other", true).await?;
    assert!(other.recv(Duration::from_millis(500)).await.is_err());
    Ok(())
}

/// A socket that vanishes (network blip): output written to it just before may be gone with
/// it, but the reply to the execution is never lost, and nothing arrives twice out of order.
#[tokio::test]
async fn abrupt_disconnect_never_loses_the_reply() -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    for round in 0..3 {
        let mut client = gateway
            .connect(&kernel, "vanishing", round % 2 == 0)
            .await?;
        let id = client.execute(TICKING).await?;
        client.recv(Duration::from_secs(30)).await?;
        drop(client);
        tokio::time::sleep(Duration::from_millis(300 * round as u64)).await;
        let mut again = gateway
            .connect(&kernel, "vanishing", round % 2 == 0)
            .await?;
        let msgs = again.collect(&id, Duration::from_secs(30)).await?;
        assert_eq!(reply(&msgs).content["status"], "ok", "round {round}");
        let got = ticks(&msgs);
        assert!(
            got.windows(2).all(|w| w[0] < w[1]),
            "round {round}: {got:?}"
        );
        assert_eq!(got.last(), Some(&5), "round {round}: {got:?}");
    }
    Ok(())
}
