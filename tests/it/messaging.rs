//! Every kind of message a notebook produces, through both framings.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::support::v1::{ws_next, ws_send, V1Client};
use crate::support::*;

async fn all_output_kinds(v1: bool) -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "sess-out", v1).await?;

    // stream + execute_result
    let msgs = client.run("print('hello'); 6*7").await?;
    assert_eq!(stdout(&msgs), "hello\n");
    let result = of_type(&msgs, "execute_result");
    assert_eq!(result.len(), 1);
    assert_eq!(result[0].content["data"]["text/plain"], "42");
    assert_eq!(reply(&msgs).content["status"], "ok");
    assert!(of_type(&msgs, "execute_input").len() == 1);

    // display_data and update_display_data with a display id, across two cells
    let msgs = client
        .run("from IPython.display import display, HTML\nh = display(HTML('<b>one</b>'), display_id=True)")
        .await?;
    let shown = of_type(&msgs, "display_data");
    assert_eq!(shown[0].content["data"]["text/html"], "<b>one</b>");
    let display_id = shown[0].content["transient"]["display_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let msgs = client.run("h.update(HTML('<b>two</b>'))").await?;
    let updated = of_type(&msgs, "update_display_data");
    assert_eq!(updated[0].content["data"]["text/html"], "<b>two</b>");
    assert_eq!(
        updated[0].content["transient"]["display_id"],
        display_id.as_str()
    );

    // error
    let msgs = client.run("1/0").await?;
    let errors = of_type(&msgs, "error");
    assert_eq!(errors[0].content["ename"], "ZeroDivisionError");
    assert_eq!(reply(&msgs).content["status"], "error");

    // stderr, unicode and a large-ish output keep their bytes
    let msgs = client
        .run("import sys; sys.stderr.write('warn é☃\\n'); print('x' * 100000)")
        .await?;
    let err: String = msgs
        .iter()
        .filter(|m| m.msg_type() == "stream" && m.content["name"] == "stderr")
        .map(|m| m.content["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(err, "warn é☃\n");
    assert_eq!(stdout(&msgs).len(), 100001);

    // input_request / input_reply on stdin
    let id = client
        .execute("name = input('who? '); print('hi', name)")
        .await?;
    let request = loop {
        let msg = client.recv(Duration::from_secs(30)).await?;
        if msg.msg_type() == "input_request" {
            break msg;
        }
    };
    assert_eq!(request.channel, "stdin");
    assert_eq!(request.content["prompt"], "who? ");
    client
        .send("stdin", "input_reply", json!({"value": "Ada"}), vec![])
        .await?;
    let msgs = client.collect(&id, Duration::from_secs(30)).await?;
    assert_eq!(stdout(&msgs), "hi Ada\n");

    // kernel_info and comm_info round trips keep the kernel's own fields
    let id = client
        .send("shell", "kernel_info_request", json!({}), vec![])
        .await?;
    let msgs = client.collect(&id, Duration::from_secs(30)).await?;
    let info = reply(&msgs);
    assert_eq!(info.msg_type(), "kernel_info_reply");
    assert!(
        info.content["supported_features"].is_array(),
        "supported_features survives the relay: {}",
        info.content
    );
    assert_eq!(info.content["language_info"]["name"], "python");

    gateway.delete_kernel(&kernel).await?;
    Ok(())
}

#[tokio::test]
async fn all_output_kinds_legacy_framing() -> anyhow::Result<()> {
    all_output_kinds(false).await
}

#[tokio::test]
async fn all_output_kinds_v1_framing() -> anyhow::Result<()> {
    all_output_kinds(true).await
}

/// Comm messages with binary buffers both ways: the kernel echoes what it receives.
async fn comm_buffers(v1: bool) -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "sess-comm", v1).await?;
    let setup = r#"
def _target(comm, open_msg):
    @comm.on_msg
    def _echo(msg):
        bufs = [bytes(b)[::-1] for b in msg['buffers']]
        comm.send({'got': len(msg['buffers']), 'sizes': [len(b) for b in bufs]}, buffers=bufs)
    comm.send({'opened': True}, buffers=[b'\x00\x01\x02open'])
get_ipython().kernel.comm_manager.register_target('echo', _target)
"#;
    let msgs = client.run(setup).await?;
    assert_eq!(reply(&msgs).content["status"], "ok", "{:?}", msgs);

    let comm_id = uuid::Uuid::new_v4().to_string();
    client
        .send(
            "shell",
            "comm_open",
            json!({"comm_id": comm_id, "target_name": "echo", "data": {}}),
            vec![],
        )
        .await?;
    let opened = loop {
        let msg = client.recv(Duration::from_secs(30)).await?;
        if msg.msg_type() == "comm_msg" {
            break msg;
        }
    };
    assert_eq!(opened.content["data"]["opened"], true);
    assert_eq!(opened.buffers, vec![b"\x00\x01\x02open".to_vec()]);

    let payload: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    client
        .send(
            "shell",
            "comm_msg",
            json!({"comm_id": comm_id, "data": {"ping": 1}}),
            vec![payload.clone(), b"\xff".to_vec()],
        )
        .await?;
    let echoed = loop {
        let msg = client.recv(Duration::from_secs(30)).await?;
        if msg.msg_type() == "comm_msg" && msg.content["data"]["got"].is_number() {
            break msg;
        }
    };
    assert_eq!(echoed.content["data"]["got"], 2);
    let mut reversed = payload.clone();
    reversed.reverse();
    assert_eq!(echoed.buffers, vec![reversed, b"\xff".to_vec()]);
    gateway.delete_kernel(&kernel).await?;
    Ok(())
}

#[tokio::test]
async fn comm_buffers_legacy_framing() -> anyhow::Result<()> {
    comm_buffers(false).await
}

#[tokio::test]
async fn comm_buffers_v1_framing() -> anyhow::Result<()> {
    comm_buffers(true).await
}

/// jupyter_server's GatewayClient (User-Agent Tornado, no Origin) dies on binary frames, so it
/// gets buffers base64-encoded in text frames and every later message still arrives.
#[tokio::test]
async fn gateway_client_relays_get_text_frames_only() -> anyhow::Result<()> {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message as WsMessage;

    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut request = gateway.ws_url(&kernel, "relay").into_client_request()?;
    request
        .headers_mut()
        .insert("Authorization", format!("token {TOKEN}").parse()?);
    request
        .headers_mut()
        .insert("User-Agent", "Tornado/6.6.1".parse()?);
    let (socket, _) = tokio_tungstenite::connect_async(request).await?;
    let mut client = Client {
        socket,
        session: "relay".into(),
        v1: false,
    };
    let code = "from comm import create_comm\nc = create_comm(target_name='t', data={}, buffers=[b'\\x00\\xffbin'])\nprint('after')";
    let id = client.execute(code).await?;
    let mut saw_comm = false;
    let mut saw_after = false;
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(30), client.socket.next())
            .await?
            .expect("open")?;
        let text = match frame {
            WsMessage::Text(text) => text,
            WsMessage::Binary(_) => panic!("a binary frame reached a GatewayClient relay"),
            _ => continue,
        };
        let msg: serde_json::Value = serde_json::from_str(text.as_str())?;
        if msg["msg_type"] == "comm_open" {
            assert_eq!(msg["buffers"], json!(["AP9iaW4="]));
            saw_comm = true;
        }
        if msg["msg_type"] == "stream" && msg["content"]["text"] == "after\n" {
            saw_after = true;
        }
        if msg["msg_type"] == "status"
            && msg["content"]["execution_state"] == "idle"
            && msg["parent_header"]["msg_id"] == id.as_str()
        {
            break;
        }
    }
    assert!(saw_comm && saw_after);
    Ok(())
}

const BIG_OUTPUT: &str = "import sys\nfrom comm import create_comm\n\
sys.stdout.write('a\\u00e9\\u20ac\\U0001F600' * 100_000)\nsys.stdout.flush()\n\
c = create_comm(target_name='big', data={}, buffers=[bytes(range(256)) * 5000])\n";

fn big_text() -> String {
    "aé€😀".repeat(100_000)
}

fn big_buffer() -> Vec<u8> {
    (0..=255u8).cycle().take(256 * 5000).collect()
}

/// Messages of over 1 MB (sent as fragments) arrive whole, byte for byte: multi-byte text in
/// a stream message and a binary buffer, in both framings.
async fn large_messages(v1: bool) -> anyhow::Result<()> {
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "sess-big", v1).await?;
    let msgs = client.run(BIG_OUTPUT).await?;
    assert_eq!(reply(&msgs).content["status"], "ok", "{:?}", reply(&msgs));
    let text: String = msgs
        .iter()
        .filter(|m| m.msg_type() == "stream")
        .filter_map(|m| m.content["text"].as_str())
        .collect();
    assert!(
        text == big_text(),
        "stream text differs ({} bytes)",
        text.len()
    );
    let comm = msgs
        .iter()
        .find(|m| m.msg_type() == "comm_open")
        .expect("comm_open");
    assert_eq!(comm.buffers, vec![big_buffer()]);
    gateway.delete_kernel(&kernel).await?;
    Ok(())
}

#[tokio::test]
async fn large_messages_legacy_framing() -> anyhow::Result<()> {
    large_messages(false).await
}

#[tokio::test]
async fn large_messages_v1_framing() -> anyhow::Result<()> {
    large_messages(true).await
}

/// The same large messages read frame by frame from a raw socket: they come as a first frame
/// and continuations of at most 64 KiB, each text fragment valid UTF-8 by itself, small
/// messages as single frames.
#[tokio::test]
async fn large_messages_are_fragmented_and_small_ones_are_not() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let gateway = Gateway::start().await?;
    let kernel = gateway.start_kernel().await?;
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", gateway.port)).await?;
    let handshake = format!(
        "GET /api/kernels/{kernel}/channels?session_id=raw HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nAuthorization: token {TOKEN}\r\n\r\n"
    );
    tcp.write_all(handshake.as_bytes()).await?;
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(tcp.read_u8().await?);
    }
    let head = String::from_utf8(head)?;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "RFC 6455's sample key gets its sample answer: {head}"
    );

    let msg_id = uuid::Uuid::new_v4().to_string();
    let request = json!({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": "raw",
                   "username": "", "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": BIG_OUTPUT, "silent": false, "store_history": true,
                    "user_expressions": {}, "allow_stdin": false, "stop_on_error": true},
    })
    .to_string();
    // A client frame: FIN + text, masked (RFC 6455 5.3), 16-bit length.
    let mask = [0x11u8, 0x22, 0x33, 0x44];
    let mut frame = vec![0x81, 0x80 | 126];
    frame.extend_from_slice(&(request.len() as u16).to_be_bytes());
    frame.extend_from_slice(&mask);
    frame.extend(request.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    tcp.write_all(&frame).await?;

    // (opcode of the first frame, payload sizes) per message, until our request's idle.
    let mut messages: Vec<(u8, Vec<usize>)> = Vec::new();
    let mut current: Option<(u8, Vec<usize>, Vec<u8>)> = None;
    let mut stream_text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (b0, b1) = tokio::time::timeout_at(deadline, async {
            Ok::<_, std::io::Error>((tcp.read_u8().await?, tcp.read_u8().await?))
        })
        .await??;
        assert_eq!(b1 & 0x80, 0, "server frames are not masked");
        let len = match b1 & 0x7f {
            126 => tcp.read_u16().await? as usize,
            127 => tcp.read_u64().await? as usize,
            n => n as usize,
        };
        let mut payload = vec![0; len];
        tcp.read_exact(&mut payload).await?;
        let (fin, opcode) = (b0 & 0x80 != 0, b0 & 0x0f);
        if opcode >= 8 {
            continue; // ping
        }
        let (first, sizes, body) = match (opcode, current.take()) {
            (0, Some((first, sizes, body))) => (first, sizes, body),
            (1 | 2, None) => (opcode, Vec::new(), Vec::new()),
            (op, cur) => panic!(
                "opcode {op} with a message in progress: {:?}",
                cur.is_some()
            ),
        };
        if first == 1 {
            assert!(
                std::str::from_utf8(&payload).is_ok(),
                "a text fragment is UTF-8 by itself"
            );
        }
        let (mut sizes, mut body) = (sizes, body);
        sizes.push(len);
        body.extend_from_slice(&payload);
        if !fin {
            current = Some((first, sizes, body));
            continue;
        }
        messages.push((first, sizes));
        if first != 1 {
            continue;
        }
        let msg: serde_json::Value = serde_json::from_slice(&body)?;
        if msg["msg_type"] == "stream" {
            stream_text.push_str(msg["content"]["text"].as_str().unwrap_or_default());
        }
        if msg["msg_type"] == "status"
            && msg["content"]["execution_state"] == "idle"
            && msg["parent_header"]["msg_id"] == msg_id.as_str()
        {
            break;
        }
    }
    assert!(
        stream_text == big_text(),
        "stream text differs ({} bytes)",
        stream_text.len()
    );
    let fragmented: Vec<_> = messages
        .iter()
        .filter(|(_, sizes)| sizes.len() > 1)
        .collect();
    assert!(
        fragmented.iter().any(|(op, _)| *op == 1) && fragmented.iter().any(|(op, _)| *op == 2),
        "the large text and binary messages came in fragments: {messages:?}"
    );
    for (_, sizes) in &messages {
        assert!(sizes.iter().all(|&s| s <= 64 << 10), "{sizes:?}");
        if sizes.iter().sum::<usize>() < 64 << 10 {
            assert_eq!(sizes.len(), 1, "a small message is one frame");
        }
    }
    gateway.delete_kernel(&kernel).await?;
    Ok(())
}

/// A gateway (`--sandbox process`: only the sockets are under test) whose python3 kernel
/// sleeps 20 s before it starts while the returned marker file exists: restarts made slow
/// on purpose.
async fn slow_restarts(dir: &std::path::Path) -> anyhow::Result<(Gateway, std::path::PathBuf)> {
    let spec = dir.join("kernels/python3");
    std::fs::create_dir_all(&spec)?;
    std::os::unix::fs::symlink(kernels_dir().join("python3/.venv"), spec.join(".venv"))?;
    let slow = dir.join("slow");
    let script = format!(
        "[ -e '{}' ] && sleep 20; exec {{prefix}}/bin/python -m ipykernel_launcher -f \"$1\"",
        slow.display()
    );
    std::fs::write(
        spec.join("kernel.json"),
        serde_json::to_vec(&json!({
            "argv": ["sh", "-c", script, "sh", "{connection_file}"],
            "display_name": "Python 3 (slow restarts)",
            "language": "python",
        }))?,
    )?;
    let gateway = Gateway::builder()
        .kernels_dir(dir.join("kernels"))
        // A start may take the 20 s and then ipykernel's own start on a loaded machine.
        .args(&[
            "--sandbox",
            "process",
            "--pool-size",
            "0",
            "--start-timeout",
            "300",
        ])
        .start()
        .await?;
    Ok((gateway, slow))
}

/// Sends a ping on `socket` and waits for its pong.
async fn ping(socket: &mut Socket) -> anyhow::Result<()> {
    socket
        .send(WsMessage::Ping(b"still there?".to_vec().into()))
        .await?;
    let pong = tokio::time::timeout(PATIENCE, async {
        while let Some(frame) = socket.next().await {
            if let WsMessage::Pong(payload) = frame? {
                return anyhow::Ok(payload);
            }
        }
        anyhow::bail!("the socket closed")
    })
    .await??;
    anyhow::ensure!(&pong[..] == b"still there?", "pong {pong:?}");
    Ok(())
}

/// A socket whose message waits for the kernel (a restart, or a hibernated VM's restore,
/// minutes under emulation) still answers the client's pings at once, and its message
/// reaches the kernel once it is back. A reader that waited on the kernel answered no ping
/// for as long: jupyter_server gives up on a socket after 90 s without a pong (seen on CI,
/// a microVM restart of 132 s). The kernel here restarts slowly on purpose: its kernelspec
/// sleeps 20 s before `exec`ing ipykernel while a marker file exists; `--sandbox process`,
/// since only the socket's handling is under test.
#[tokio::test]
async fn pings_are_answered_while_a_message_waits_for_the_kernel() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (gateway, slow) = slow_restarts(dir.path()).await?;
    let kernel = gateway.start_kernel().await?;
    let mut client = gateway.connect(&kernel, "s-ping", true).await?;
    let msgs = client.run("1 + 1").await?;
    assert_eq!(reply(&msgs).content["status"], "ok", "{msgs:?}");

    std::fs::write(&slow, "")?;
    let restart = {
        let request = gateway
            .request(
                reqwest::Method::POST,
                &format!("/api/kernels/{kernel}/restart"),
            )
            .header("Content-Type", "application/json")
            .body("{}");
        tokio::spawn(async move { request.send().await.map(|r| r.status().as_u16()) })
    };
    // The restart has begun when the kernel is no longer idle.
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let (_, model) = gateway.get_json(&format!("/api/kernels/{kernel}")).await?;
        if model["execution_state"] != "idle" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the restart never began: {}",
            gateway.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A message waiting for the kernel on an open socket, and a socket opened meanwhile
    // (it waits for the kernel before it is served): both answer a ping now.
    let execute = client.execute("6 * 7").await?;
    let mut late = gateway.connect(&kernel, "s-ping-late", false).await?;
    let early = late.execute("7 * 6").await?;
    for socket in [&mut client.socket, &mut late.socket] {
        ping(socket).await?;
        let (_, model) = gateway.get_json(&format!("/api/kernels/{kernel}")).await?;
        assert!(
            model["execution_state"] == "starting" || model["execution_state"] == "restarting",
            "the pong came only once the kernel was back: {model}"
        );
    }

    assert_eq!(restart.await??, 200);
    for (client, execute) in [(&mut client, execute), (&mut late, early)] {
        let msgs = client.collect(&execute, PATIENCE).await?;
        assert_eq!(
            of_type(&msgs, "execute_result")[0].content["data"]["text/plain"],
            "42",
            "{msgs:?}"
        );
    }
    Ok(())
}

/// The same for API v1's session socket: while a restart it asked for runs, it answers
/// pings, and the restart's end reaches it.
#[tokio::test]
async fn the_session_socket_answers_pings_while_a_restart_runs() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (gateway, slow) = slow_restarts(dir.path()).await?;
    let v1 = V1Client::new(&gateway);
    let id = v1.create_session(json!({})).await?;
    assert_eq!(v1.execute(&id, "1 + 1").await?["result"], "2");
    let mut socket = v1.ws(&id).await?;
    assert_eq!(ws_next(&mut socket).await?["type"], "session");
    std::fs::write(&slow, "")?;
    ws_send(&mut socket, json!({"type": "restart"})).await?;
    let state = || async {
        let (_, model) = v1.get(&format!("/v1/sessions/{id}")).await?;
        anyhow::Ok(model["state"].as_str().unwrap_or_default().to_owned())
    };
    let deadline = std::time::Instant::now() + PATIENCE;
    while state().await? == "idle" {
        assert!(
            std::time::Instant::now() < deadline,
            "the restart never began"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ping(&mut socket).await?;
    let now = state().await?;
    assert!(
        now == "starting" || now == "restarting",
        "the pong came only once the kernel was back ({now})"
    );
    // The restart's end reaches the socket: the kernel ready again.
    loop {
        let event = ws_next(&mut socket).await?;
        if event["type"] == "kernel" && event["state"] == "ready" {
            break;
        }
    }
    assert_eq!(v1.execute(&id, "6 * 7").await?["result"], "42");
    Ok(())
}
