//! Attacks on the listener's resources (issue 13, item 2): every connection is a file
//! descriptor, and a client that holds many for nothing starves kernel starts and API calls.
//!
//! - The soft `RLIMIT_NOFILE` is raised to the hard limit at start-up, so a few hundred idle
//!   connections cannot exhaust a default soft limit of 1024; kernels get their own, lower
//!   limit, never the gateway's.
//! - Slowloris: a request head trickled a byte at a time, or never sent, is cut at the
//!   header-read timeout; a head sent at once is served.
//! - An idle keep-alive connection is closed at the idle timeout, which is not the header
//!   timeout.
//! - Connections per peer address and in total are capped: the excess gets 503 with
//!   `Retry-After`, and room comes back when connections close. An open WebSocket holds
//!   its place. A trusted proxy (`--trusted-proxy`) is held to the total cap only.
//! - A request body that stalls is cut at the body-read timeout; one that keeps coming, even
//!   a byte at a time, is read whole and answered.
//! - None of it touches an authenticated WebSocket or a long execution.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use super::json_out;
use crate::support::v1::V1Client;
use crate::support::{eventually, of_type, stdout, Gateway, PATIENCE};

/// How early a timeout may seem to fire, measured from an instant taken before the event
/// that starts it: not at all, but for a millisecond or two of timer rounding.
///
/// The waits for what must happen (an answer, a close, room under a cap) last up to
/// [`PATIENCE`]: the timeouts under test are seconds, and nothing else closes these
/// connections within that wait, so a close within it, and not before its timeout, is the
/// timeout's. How long each took is printed.
const EARLY: Duration = Duration::from_millis(50);

/// `(soft, hard)` "Max open files" of process `pid`.
fn open_file_limits(pid: u32) -> Result<(String, String)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open files line")?;
    let mut fields = line["Max open files".len()..].split_whitespace();
    let soft = fields.next().context("soft")?.to_owned();
    let hard = fields.next().context("hard")?.to_owned();
    Ok((soft, hard))
}

#[tokio::test]
async fn open_file_limit_is_raised_for_the_gateway_and_not_for_kernels() -> Result<()> {
    // Each test runs in its own process (nextest), so lowering this one's soft limit gives the
    // gateway it spawns the default a distribution would.
    let hard = getrlimit(Resource::Nofile).maximum;
    ensure!(
        hard.is_none_or(|h| h > 1024),
        "this host's hard open-file limit is {hard:?}: nothing to raise, the test cannot show anything"
    );
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(1024),
            maximum: hard,
        },
    )?;
    let gateway = Gateway::builder().start().await?;
    let (soft, gateway_hard) = open_file_limits(gateway.pid())?;
    ensure!(
        soft == gateway_hard,
        "the gateway's soft open-file limit stays {soft} below its hard limit {gateway_hard}"
    );
    ensure!(
        gateway.log().contains("open file limit raised"),
        "the figure is logged: {}",
        gateway.log()
    );

    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "nofile", false).await?;
    let msgs = client
        .run("import json, resource; print(json.dumps(resource.getrlimit(resource.RLIMIT_NOFILE)))")
        .await?;
    let limits = json_out(&msgs)?;
    ensure!(
        limits == serde_json::json!([4096, 4096]),
        "a kernel gets 4096 open files, not the gateway's raised limit: {limits}"
    );
    Ok(())
}

/// A connection to the gateway from the loopback address `from` (127.0.0.1, 127.0.0.2, …:
/// all of 127/8 is this host's, so tests can be several peers).
async fn connect_from(port: u16, from: [u8; 4]) -> Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((from, 0)))?;
    Ok(socket
        .connect(SocketAddr::from(([127, 0, 0, 1], port)))
        .await?)
}

/// An HTTP answer read off a raw socket.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// The head, lower-cased.
    head: String,
    body: String,
}

/// Sends `GET path` (keep-alive, no credentials: `/healthz` needs none) and reads the answer.
async fn get(stream: &mut TcpStream, path: &str) -> Result<Answer> {
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    tokio::time::timeout(PATIENCE, read_answer(stream))
        .await
        .with_context(|| format!("no answer within {PATIENCE:?}"))?
}

async fn read_answer(stream: &mut TcpStream) -> Result<Answer> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let status = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .with_context(|| format!("no status in {head:?}"))?;
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse())
                .transpose()?
                .unwrap_or(0);
            while buf.len() < end + 4 + length {
                let n = stream.read(&mut chunk).await?;
                ensure!(
                    n > 0,
                    "closed in the body: {:?}",
                    String::from_utf8_lossy(&buf)
                );
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + length]).into_owned();
            return Ok(Answer { status, head, body });
        }
        let n = stream.read(&mut chunk).await?;
        ensure!(
            n > 0,
            "closed before a whole answer: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Waits for the gateway to close `stream`, sending nothing; how long that took from
/// `since`, or `None` if it was still open after `limit`. An answer is an error.
async fn closed_after(
    stream: &mut TcpStream,
    since: Instant,
    limit: Duration,
) -> Result<Option<Duration>> {
    let mut buf = [0u8; 1024];
    match tokio::time::timeout_at((since + limit).into(), stream.read(&mut buf)).await {
        Err(_) => Ok(None),
        Ok(Ok(0)) | Ok(Err(_)) => Ok(Some(since.elapsed())),
        Ok(Ok(n)) => bail!(
            "the gateway sent {:?} instead of closing",
            String::from_utf8_lossy(&buf[..n])
        ),
    }
}

/// Slowloris: sends a request head one byte every `every`, never ending it (the last
/// header's value grows forever); how long the gateway kept the connection open, or `None`
/// if it still was after `limit`.
async fn trickle(port: u16, every: Duration, limit: Duration) -> Result<Option<Duration>> {
    // Before the connection opens: the gateway's clock starts after it.
    let started = Instant::now();
    let mut stream = connect_from(port, [127, 0, 0, 1]).await?;
    let head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    let mut bytes = head.iter().chain(std::iter::repeat(&b'a'));
    let mut buf = [0u8; 1024];
    while started.elapsed() < limit {
        let byte = *bytes.next().context("endless")?;
        if stream.write_all(&[byte]).await.is_err() {
            return Ok(Some(started.elapsed()));
        }
        match tokio::time::timeout(every, stream.read(&mut buf)).await {
            Err(_) => {}
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(Some(started.elapsed())),
            Ok(Ok(n)) => bail!(
                "the gateway answered a head that never ended: {:?}",
                String::from_utf8_lossy(&buf[..n])
            ),
        }
    }
    Ok(None)
}

/// With a 1 s header-read timeout: a head trickled a byte every 100 ms and a connection that
/// sends nothing are both closed, not before 1 s (measured from before they opened) and
/// within [`PATIENCE`] (nothing else closes a connection waiting for its head); a head sent
/// at once is served, and its connection, idle meanwhile (idle timeout 120 s, past the
/// wait), is served again afterwards.
#[tokio::test]
async fn slow_headers_are_cut_at_the_header_timeout() -> Result<()> {
    let gateway = Gateway::builder()
        .args(&[
            "--header-read-timeout",
            "1s",
            "--idle-connection-timeout",
            "120s",
        ])
        .start()
        .await?;
    let mut prompt = connect_from(gateway.port, [127, 0, 0, 1]).await?;
    let answer = get(&mut prompt, "/healthz").await?;
    ensure!(answer.status == 200 && answer.body == "ok", "{answer:?}");

    let limit = PATIENCE;
    let silent = async {
        let since = Instant::now();
        let mut stream = connect_from(gateway.port, [127, 0, 0, 1]).await?;
        closed_after(&mut stream, since, limit).await
    };
    let (slow, silent) = tokio::join!(
        trickle(gateway.port, Duration::from_millis(100), limit),
        silent
    );
    let (slow, silent) = (slow?, silent?);
    println!("slowloris: trickled head closed after {slow:?}, silent connection after {silent:?}");
    for (what, kept) in [("a trickled head", slow), ("a silent connection", silent)] {
        let kept = kept.with_context(|| format!("{what} was still open after {limit:?}"))?;
        ensure!(
            kept + EARLY >= Duration::from_secs(1),
            "{what} was closed after {kept:?}, before the 1 s header timeout"
        );
    }

    let answer = get(&mut prompt, "/healthz").await?;
    ensure!(
        answer.status == 200,
        "the prompt connection, idle past the header timeout, is served again: {answer:?}"
    );
    Ok(())
}

/// With a 2 s body-read timeout, an authenticated client that sends a request head promising
/// a 1000-byte body and then one byte is cut, not before 2 s and within [`PATIENCE`] (no
/// other timeout runs while a request is in flight); one that sends its body a byte every
/// 300 ms for 6 s (thrice the timeout in all) gets its answer.
#[tokio::test]
async fn stalled_bodies_are_cut_and_slow_ones_are_read() -> Result<()> {
    let gateway = Gateway::builder()
        .token(Some("body-token"))
        .args(&["--body-read-timeout", "2s"])
        .start()
        .await?;
    let head = |length: usize| {
        format!(
            "POST /api/kernels HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: token body-token\r\n\
             Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        )
    };

    let mut stalled = connect_from(gateway.port, [127, 0, 0, 1]).await?;
    // Before the bytes go: the gateway's clock starts after it has read them.
    let since = Instant::now();
    stalled
        .write_all(format!("{}{{", head(1000)).as_bytes())
        .await?;
    let limit = PATIENCE;
    let kept = closed_after(&mut stalled, since, limit)
        .await?
        .with_context(|| format!("a stalled body's connection was still open after {limit:?}"))?;
    println!("a stalled body's connection was closed after {kept:?}");
    ensure!(
        kept + EARLY >= Duration::from_secs(2),
        "a stalled body's connection was closed after {kept:?}, before the 2 s body timeout"
    );

    // Leading spaces are valid JSON: the body trickles, then ends as a real request. Each
    // gap is 300 ms of the 2 s timeout: a busy machine would have to stall the test or the
    // gateway for over 1.5 s to cut it.
    let body = format!("{}{{\"name\": \"no-such-kernel\"}}", " ".repeat(20));
    let mut slow = connect_from(gateway.port, [127, 0, 0, 1]).await?;
    slow.write_all(head(body.len()).as_bytes()).await?;
    let started = Instant::now();
    for byte in body.as_bytes()[..20].iter() {
        slow.write_all(&[*byte]).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    slow.write_all(&body.as_bytes()[20..]).await?;
    let answer = tokio::time::timeout(PATIENCE, read_answer(&mut slow))
        .await
        .context("no answer to the slow body")??;
    println!("a body sent over {:?}: {answer:?}", started.elapsed());
    ensure!(
        answer.status == 404 && answer.body.contains("no-such-kernel"),
        "the slow body was not read whole and answered: {answer:?}"
    );
    Ok(())
}

/// With a 1 s header timeout and an 8 s idle timeout: a keep-alive connection idle for 2 s
/// (past the header timeout, 6 s short of the idle timeout) is served again, then closed
/// not before 8 s after its last request went out, and within [`PATIENCE`].
#[tokio::test]
async fn idle_keep_alive_connections_are_closed_at_the_idle_timeout() -> Result<()> {
    let gateway = Gateway::builder()
        .args(&[
            "--header-read-timeout",
            "1s",
            "--idle-connection-timeout",
            "8s",
        ])
        .start()
        .await?;
    let mut stream = connect_from(gateway.port, [127, 0, 0, 1]).await?;
    let answer = get(&mut stream, "/healthz").await?;
    ensure!(answer.status == 200, "{answer:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Before the request: the idle clock starts once its answer is sent, after this.
    let asked = Instant::now();
    let answer = get(&mut stream, "/healthz").await?;
    ensure!(
        answer.status == 200,
        "a keep-alive connection idle for 2 s is served: {answer:?}"
    );
    let kept = closed_after(&mut stream, asked, PATIENCE)
        .await?
        .with_context(|| {
            format!(
                "an idle keep-alive connection was still open {PATIENCE:?} after its last request"
            )
        })?;
    println!("idle keep-alive connection closed {kept:?} after its last request");
    ensure!(
        kept + EARLY >= Duration::from_secs(8),
        "closed {kept:?} after its last request, before the 8 s idle timeout"
    );
    Ok(())
}

/// The refusal: 503, `Retry-After: 1`, `Connection: close`, a JSON body saying why, then
/// the connection closes.
async fn expect_refused(stream: &mut TcpStream, why: &str) -> Result<()> {
    let answer = get(stream, "/healthz").await?;
    ensure!(answer.status == 503, "expected 503, got {answer:?}");
    ensure!(
        answer.head.contains("\r\nretry-after: 1") && answer.head.contains("\r\nconnection: close"),
        "{answer:?}"
    );
    let body: serde_json::Value = serde_json::from_str(&answer.body)?;
    let message = body["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains(why),
        "the refusal says {message:?}, not {why:?}"
    );
    // Written straight on the socket, not hyper's: no timeout would close it but the refusal.
    let closed = closed_after(stream, Instant::now(), PATIENCE).await?;
    ensure!(closed.is_some(), "a refused connection stays open");
    Ok(())
}

/// Retries a connection from `from` until it is served (a closed connection's place comes
/// back once the gateway has seen it close), for up to [`PATIENCE`].
async fn served_soon(port: u16, from: [u8; 4]) -> Result<TcpStream> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let mut stream = connect_from(port, from).await?;
        let answer = get(&mut stream, "/healthz").await?;
        if answer.status == 200 {
            return Ok(stream);
        }
        ensure!(
            Instant::now() < deadline,
            "still refused {PATIENCE:?} after connections closed: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `--max-connections-per-peer 3 --max-connections 5`: 127.0.0.1's fourth connection is
/// refused while 127.0.0.2 is still served; with five open, 127.0.0.2's third and
/// 127.0.0.3's first are refused for the total; closing connections makes room again. The
/// refusals are logged once, counted, not once each.
#[tokio::test]
async fn connections_are_capped_per_peer_and_in_total() -> Result<()> {
    let gateway = Gateway::builder()
        .args(&["--max-connections-per-peer", "3", "--max-connections", "5"])
        .start()
        .await?;
    let port = gateway.port;
    let mut first = vec![];
    for _ in 0..3 {
        let mut stream = connect_from(port, [127, 0, 0, 1]).await?;
        let answer = get(&mut stream, "/healthz").await?;
        ensure!(answer.status == 200, "{answer:?}");
        first.push(stream);
    }
    // The refusals (and any while room comes back) from here until the last `served_soon`.
    let refusing = Instant::now();
    let mut over = connect_from(port, [127, 0, 0, 1]).await?;
    expect_refused(&mut over, "too many connections from 127.0.0.1").await?;

    let mut second = vec![];
    for _ in 0..2 {
        let mut stream = connect_from(port, [127, 0, 0, 2]).await?;
        let answer = get(&mut stream, "/healthz").await?;
        ensure!(
            answer.status == 200,
            "another peer is served while 127.0.0.1 is at its cap: {answer:?}"
        );
        second.push(stream);
    }
    let mut over = connect_from(port, [127, 0, 0, 2]).await?;
    expect_refused(&mut over, "the gateway has its most connections open (5)").await?;
    let mut over = connect_from(port, [127, 0, 0, 3]).await?;
    expect_refused(&mut over, "the gateway has its most connections open (5)").await?;

    // The kept connections still work.
    for stream in first.iter_mut().chain(second.iter_mut()) {
        let answer = get(stream, "/healthz").await?;
        ensure!(answer.status == 200, "{answer:?}");
    }
    // Room comes back when connections close: one for 127.0.0.3 (total), then 127.0.0.1's
    // own (per peer).
    drop(second.pop());
    let _third = served_soon(port, [127, 0, 0, 3]).await?;
    drop(first.pop());
    let _again = served_soon(port, [127, 0, 0, 1]).await?;

    // One line per 10 s (the listener's REPORT_EVERY) at most: one, unless the machine was
    // so slow that the refusals spanned more than that. The log is read by another thread.
    let span = refusing.elapsed();
    let most = span.as_secs() as usize / 10 + 1;
    let lines = || gateway.log().matches("over the connection caps").count();
    eventually(PATIENCE, || lines() >= 1).await;
    let log = gateway.log();
    ensure!(
        (1..=most).contains(&lines()),
        "refusals over {span:?} make at most {most} log line(s), and one at least, not {}:\n{log}",
        lines()
    );
    Ok(())
}

/// `--max-connections-per-peer 2 --max-connections 6 --trusted-proxy 127.0.0.1`: 127.0.0.1,
/// a trusted proxy, holds four connections (its clients are many) while 127.0.0.2 is still
/// held to two; with six open, the proxy's next one is refused for the total, which it
/// still counts against (the per-peer cap is checked first: a proxy held to it would be
/// refused for that). The same gateway without `--trusted-proxy` refuses 127.0.0.1's third.
#[tokio::test]
async fn trusted_proxies_are_not_held_to_the_per_peer_cap() -> Result<()> {
    let caps = ["--max-connections-per-peer", "2", "--max-connections", "6"];
    let gateway = Gateway::builder()
        .args(&caps)
        .args(&["--trusted-proxy", "127.0.0.1"])
        .start()
        .await?;
    let port = gateway.port;
    let mut held = vec![];
    for n in 0..4 {
        let mut stream = connect_from(port, [127, 0, 0, 1]).await?;
        let answer = get(&mut stream, "/healthz").await?;
        ensure!(
            answer.status == 200,
            "the trusted proxy's connection {} of 4: {answer:?}",
            n + 1
        );
        held.push(stream);
    }
    for _ in 0..2 {
        let mut stream = connect_from(port, [127, 0, 0, 2]).await?;
        let answer = get(&mut stream, "/healthz").await?;
        ensure!(answer.status == 200, "{answer:?}");
        held.push(stream);
    }
    let mut over = connect_from(port, [127, 0, 0, 2]).await?;
    expect_refused(&mut over, "too many connections from 127.0.0.2").await?;
    let mut over = connect_from(port, [127, 0, 0, 1]).await?;
    expect_refused(&mut over, "the gateway has its most connections open (6)").await?;
    // The held connections still work.
    for stream in &mut held {
        let answer = get(stream, "/healthz").await?;
        ensure!(answer.status == 200, "{answer:?}");
    }
    drop(held);
    drop(gateway);

    let untrusted = Gateway::builder().args(&caps).start().await?;
    let mut first = vec![];
    for _ in 0..2 {
        let mut stream = connect_from(untrusted.port, [127, 0, 0, 1]).await?;
        let answer = get(&mut stream, "/healthz").await?;
        ensure!(answer.status == 200, "{answer:?}");
        first.push(stream);
    }
    let mut over = connect_from(untrusted.port, [127, 0, 0, 1]).await?;
    expect_refused(&mut over, "too many connections from 127.0.0.1").await?;
    Ok(())
}

/// With both timeouts at 1 s: a kernel's authenticated WebSocket stays open and working
/// through a 3 s execution and 2.5 s of silence, and a 3 s execution over plain HTTP
/// (`POST /v1/execute`, in flight throughout) gets its answer.
#[tokio::test]
async fn websockets_and_long_executions_outlive_the_timeouts() -> Result<()> {
    let mut gateway = Gateway::builder()
        .args(&[
            "--header-read-timeout",
            "1s",
            "--idle-connection-timeout",
            "1s",
        ])
        .start()
        .await?;
    // A pooled connection could be reused just as the gateway closes it for idleness.
    gateway.http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "long", false).await?;
    let started = Instant::now();
    let msgs = client
        .run("import time\ntime.sleep(3)\nprint('slept')")
        .await?;
    ensure!(stdout(&msgs) == "slept\n", "{msgs:?}");
    ensure!(started.elapsed() >= Duration::from_secs(3));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let msgs = client.run("1+1").await?;
    let results = of_type(&msgs, "execute_result");
    ensure!(
        results.len() == 1 && results[0].content["data"]["text/plain"] == "2",
        "the WebSocket, silent past both timeouts, still works: {msgs:?}"
    );

    let started = Instant::now();
    let (status, result) = V1Client::new(&gateway)
        .post(
            "/v1/execute",
            json!({"code": "import time\ntime.sleep(3)\nprint('slept')"}),
        )
        .await?;
    ensure!(
        status == 200 && result["stdout"] == "slept\n",
        "{status} {result}"
    );
    ensure!(started.elapsed() >= Duration::from_secs(3));
    Ok(())
}

/// A WebSocket keeps its place under the caps while it is open (its connection is no longer
/// hyper's, but the socket is still a descriptor): with `--max-connections 2`, an open
/// kernel WebSocket and one other connection leave no room for a third, and closing the
/// WebSocket makes room.
#[tokio::test]
async fn websockets_count_against_the_caps() -> Result<()> {
    let mut gateway = Gateway::builder()
        .args(&["--max-connections", "2"])
        .start()
        .await?;
    // No pooled connection may hold one of the two places.
    gateway.http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "counted", false).await?;
    let msgs = client.run("1+1").await?;
    ensure!(of_type(&msgs, "execute_result").len() == 1, "{msgs:?}");
    // Once the kernel start's connection is gone, 127.0.0.2 takes the second place.
    let _held = served_soon(gateway.port, [127, 0, 0, 2]).await?;
    let mut over = connect_from(gateway.port, [127, 0, 0, 3]).await?;
    expect_refused(&mut over, "the gateway has its most connections open (2)").await?;
    client.close().await;
    let _after = served_soon(gateway.port, [127, 0, 0, 3]).await?;
    Ok(())
}
