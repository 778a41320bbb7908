//! Attacks on the egress allowlist by fronting (issue 13, item 6): with one name of a shared
//! front end (a CDN) allowed, reach another name it serves by asking the front end for it
//! in the TLS server name (SNI) of an approved tunnel, in the `Host` header of an approved
//! plain-HTTP request, behind Encrypted Client Hello, or with no TLS at all.
//!
//! The "CDN" is this test's: a TLS listener and a plain-HTTP listener on 127.0.0.1 (the
//! gateway's `egress_hosts` maps both names there; nothing leaves the machine), serving
//! `allowed.cdn.test` and `forbidden.cdn.test` and answering each request with the name it
//! routed on. The TLS listener picks its certificate by SNI, as a CDN does. Each attack runs
//! in a real kernel cell in the real sandbox and must fail with a denial in that execution's
//! result, while the same request for the allowed name works (so the test can fail).
//!
//! Under gVisor (`CELLGATE_TEST_ATTACKER_SANDBOX=gvisor`) a kernel gets no proxy at all (no
//! network, deny-all): the test then checks that every attempt fails before reaching
//! anything, which is all fronting can be checked against there.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

use super::require_sandbox;
use crate::egress::{denials, stderr};
use crate::support::*;

const ALLOWED: &str = "allowed.cdn.test";
const FORBIDDEN: &str = "forbidden.cdn.test";

/// What the fake CDN was asked for, in order: the SNI of each TLS connection that sent any
/// bytes (`<no tls>` when they were not a ClientHello), the `Host` headers of each plain
/// request.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    fn push(&self, what: String) {
        self.0.lock().push(what);
    }
    fn all(&self) -> Vec<String> {
        self.0.lock().clone()
    }
}

/// Reads an HTTP request head; `None` if the peer closed first.
async fn read_head(stream: &mut (impl AsyncReadExt + Unpin)) -> Option<String> {
    let mut head = vec![];
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
        if head.len() > 16 * 1024 {
            return None;
        }
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

fn answer(name: &str) -> String {
    let body = format!("hello from {name}");
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// The CDN's TLS side: one self-signed certificate per name, chosen by SNI; a hello naming
/// neither is dropped. Returns the port.
async fn tls_front(seen: Seen) -> Result<u16> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut configs = HashMap::new();
    for name in [ALLOWED, FORBIDDEN] {
        let certified = rcgen::generate_simple_self_signed(vec![name.to_owned()])?;
        let key =
            rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
        let config = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![certified.cert.der().clone()], key)?;
        configs.insert(name.to_owned(), Arc::new(config));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let configs = Arc::new(configs);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (configs, seen) = (configs.clone(), seen.clone());
            tokio::spawn(async move {
                // The proxy dials before it has read the client's hello: a connection that
                // closes without a byte is one the proxy refused, not a request.
                let mut first = [0u8; 1];
                if !matches!(stream.peek(&mut first).await, Ok(1)) {
                    return;
                }
                let acceptor = tokio_rustls::LazyConfigAcceptor::new(
                    rustls::server::Acceptor::default(),
                    stream,
                );
                let Ok(start) = acceptor.await else {
                    seen.push("<no tls>".to_owned());
                    return;
                };
                let name = start
                    .client_hello()
                    .server_name()
                    .unwrap_or("<no name>")
                    .to_owned();
                seen.push(name.clone());
                let Some(config) = configs.get(&name) else {
                    return;
                };
                let Ok(mut tls) = start.into_stream(config.clone()).await else {
                    return;
                };
                if read_head(&mut tls).await.is_some() {
                    let _ = tls.write_all(answer(&name).as_bytes()).await;
                    let _ = tls.shutdown().await;
                }
            });
        }
    });
    Ok(port)
}

/// The CDN's plain-HTTP side: routes on the `Host` header. Returns the port.
async fn http_front(seen: Seen) -> Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let Some(head) = read_head(&mut stream).await else {
                    return;
                };
                let hosts: Vec<&str> = head
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .filter(|(k, _)| k.eq_ignore_ascii_case("host"))
                    .map(|(_, v)| v.trim())
                    .collect();
                seen.push(hosts.join(","));
                let _ = stream
                    .write_all(answer(hosts.first().unwrap_or(&"<none>")).as_bytes())
                    .await;
            });
        }
    });
    Ok(port)
}

/// Helpers defined once in the attacker's kernel. `tunnel(target, payload)` opens a CONNECT
/// tunnel through the proxy and then either speaks TLS with the SNI `payload` names
/// (`('tls', sni)`, certificates not checked: which site answers is what is looked at) or
/// writes raw bytes and returns what comes back (`('raw', bytes)`).
const HELPERS: &str = r#"
import socket, ssl, struct, json, os
def _connect(target):
    s = socket.create_connection(('127.0.0.1', 3128), timeout=30)
    s.sendall(f'CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n'.encode())
    head = b''
    while not head.endswith(b'\r\n\r\n'):
        c = s.recv(1)
        if not c:
            raise OSError('the proxy closed the connection')
        head += c
    return s, head.split(b' ')[1].decode()
def tunnel(target, kind, payload):
    try:
        s, status = _connect(target)
    except OSError as e:
        return 'no proxy: ' + type(e).__name__
    if status != '200':
        return 'proxy said ' + status
    if kind == 'raw':
        s.sendall(payload)
        got = b''
        while True:
            try:
                c = s.recv(4096)
            except OSError as e:
                return 'raw reset ' + got.hex()
            if not c:
                return 'raw closed ' + got.hex()
            got += c
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        t = ctx.wrap_socket(s, server_hostname=payload)
        t.sendall(f'GET / HTTP/1.1\r\nHost: {payload}\r\nConnection: close\r\n\r\n'.encode())
        data = b''
        while True:
            c = t.recv(4096)
            if not c:
                break
            data += c
        return 'ok: ' + data.split(b'\r\n\r\n', 1)[-1].decode()
    except (ssl.SSLError, OSError) as e:
        return 'tls failed: ' + type(e).__name__ + ': ' + str(e)
def plain(url, hosts):
    try:
        s = socket.create_connection(('127.0.0.1', 3128), timeout=30)
    except OSError as e:
        return 'no proxy: ' + type(e).__name__
    head = f'GET {url} HTTP/1.1\r\n' + ''.join(f'Host: {h}\r\n' for h in hosts) + 'Connection: close\r\n\r\n'
    s.sendall(head.encode())
    data = b''
    while True:
        c = s.recv(4096)
        if not c:
            break
        data += c
    status = data.split(b' ', 2)[1].decode() if data else 'closed'
    return status + ' ' + data.split(b'\r\n\r\n', 1)[-1].decode().strip()
def hello(name, extra):
    # A TLS 1.3-style ClientHello naming `name`, with extra extensions [(type, bytes)].
    exts = [(43, b'\x02\x03\x04'), (10, b'\x00\x02\x00\x1d'), (13, b'\x00\x02\x08\x04'),
            (51, b'\x00\x24\x00\x1d\x00\x20' + os.urandom(32))]
    if name is not None:
        n = name.encode()
        exts.insert(0, (0, struct.pack('>HBH', len(n) + 3, 0, len(n)) + n))
    exts += extra
    ext = b''.join(struct.pack('>HH', t, len(d)) + d for t, d in exts)
    body = b'\x03\x03' + os.urandom(32) + b'\x20' + os.urandom(32) + b'\x00\x02\x13\x01\x01\x00'
    body += struct.pack('>H', len(ext)) + ext
    msg = b'\x01' + len(body).to_bytes(3, 'big') + body
    return b'\x16\x03\x01' + struct.pack('>H', len(msg)) + msg
print('ready')
"#;

/// One egress denial naming `target`, whose reason contains every one of `words`.
fn one_denial(msgs: &[Msg], target: &str, words: &[&str]) -> Result<()> {
    let found = denials(msgs);
    ensure!(
        found.len() == 1,
        "expected one denial, got {found:?}\n{}",
        stderr(msgs)
    );
    let d = &found[0];
    ensure!(
        d["kind"] == "egress" && d["target"] == target && d["policy"] == "cdn",
        "{d}"
    );
    let reason = d["reason"].as_str().unwrap_or_default();
    for word in words {
        ensure!(reason.contains(word), "the reason lacks {word:?}: {reason}");
    }
    Ok(())
}

async fn cell(client: &mut Client, code: &str) -> Result<(String, Vec<Msg>)> {
    let msgs = client.run(code).await?;
    let errors = of_type(&msgs, "error");
    ensure!(
        errors.is_empty(),
        "the cell failed: {:?}",
        errors.iter().map(|e| &e.content).collect::<Vec<_>>()
    );
    Ok((stdout(&msgs).trim_end().to_owned(), msgs))
}

#[tokio::test]
async fn fronting_through_an_allowed_name_is_refused() -> Result<()> {
    require_sandbox();
    let seen_tls = Seen::default();
    let seen_http = Seen::default();
    let tls = tls_front(seen_tls.clone()).await?;
    let http = http_front(seen_http.clone()).await?;

    let dir = tempfile::tempdir()?;
    let policies = dir.path().join("policies");
    std::fs::create_dir(&policies)?;
    let backend = attacker_backend();
    std::fs::write(policies.join("default.toml"), "")?;
    std::fs::write(
        policies.join("cdn.toml"),
        format!(
            "description = \"one name of the CDN\"\n[sandbox]\nbackend = \"{backend}\"\n[egress]\nallow = [\"{ALLOWED}:{tls}\", \"{ALLOWED}:{http}\", \"127.0.0.1:{tls}\"]\n"
        ),
    )?;
    let config = dir.path().join("cellgate.toml");
    std::fs::write(
        &config,
        format!("[egress_hosts]\n\"{ALLOWED}\" = \"127.0.0.1\"\n\"{FORBIDDEN}\" = \"127.0.0.1\"\n"),
    )?;
    let gateway = Gateway::builder()
        .policies_dir(policies)
        .arg("--config")
        .arg(config.to_str().context("path")?)
        .start()
        .await?;
    let response = gateway
        .request(reqwest::Method::POST, "/api/kernels")
        .json(&json!({"name": "python3", "env": {"KERNEL_POLICY": "cdn"}}))
        .send()
        .await?;
    ensure!(
        response.status().as_u16() == 201,
        "start: {}",
        response.text().await?
    );
    let kernel = response.json::<Value>().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    let mut client = gateway.connect(&kernel, "attacker", false).await?;
    let (out, _) = cell(&mut client, HELPERS).await?;
    ensure!(out == "ready", "{out}");

    let allowed_tls = format!("{ALLOWED}:{tls}");
    let allowed_http = format!("{ALLOWED}:{http}");
    let ech = "hello('allowed.cdn.test', [(0xfe0d, b'\\x00\\x00\\x01\\x00\\x01\\x2a\\x00\\x20' + os.urandom(32) + b'\\x00\\x10' + os.urandom(16))])";

    if backend == "gvisor" {
        // No proxy, no network: every attempt fails before reaching anything.
        for code in [
            format!("print(tunnel({allowed_tls:?}, 'tls', {FORBIDDEN:?}))"),
            format!("print(tunnel({allowed_tls:?}, 'tls', {ALLOWED:?}))"),
            format!("print(plain('http://{allowed_http}/', [{FORBIDDEN:?}]))"),
            format!("print(tunnel({allowed_tls:?}, 'raw', {ech}))"),
        ] {
            let (out, _) = cell(&mut client, &code).await?;
            ensure!(out == "no proxy: ConnectionRefusedError", "{code}: {out}");
        }
        ensure!(seen_tls.all().is_empty() && seen_http.all().is_empty());
        println!(
            "gVisor: the kernel has no proxy and no network; fronting has nothing to go through"
        );
        return Ok(());
    }

    // (b) first, the positive control: the allowed name through its tunnel is served.
    let (out, msgs) = cell(
        &mut client,
        &format!("print(tunnel({allowed_tls:?}, 'tls', {ALLOWED:?}))"),
    )
    .await?;
    ensure!(
        out == format!("ok: hello from {ALLOWED}"),
        "{out}\n{}",
        gateway.log()
    );
    ensure!(denials(&msgs).is_empty(), "{:?}", denials(&msgs));

    // (a) the tunnel approved for the allowed name, TLS asking the CDN for the other one.
    let (out, msgs) = cell(
        &mut client,
        &format!("print(tunnel({allowed_tls:?}, 'tls', {FORBIDDEN:?}))"),
    )
    .await?;
    ensure!(
        out.starts_with("tls failed:") && out.contains("UNRECOGNIZED_NAME"),
        "SNI {FORBIDDEN} in a tunnel to {ALLOWED}: {out}"
    );
    one_denial(&msgs, &allowed_tls, &[FORBIDDEN, ALLOWED, "SNI"])?;
    // The same through a tunnel to the CDN's address: an IP target opens no name either.
    let (out, msgs) = cell(
        &mut client,
        &format!("print(tunnel('127.0.0.1:{tls}', 'tls', {FORBIDDEN:?}))"),
    )
    .await?;
    ensure!(
        out.starts_with("tls failed:"),
        "SNI {FORBIDDEN} to 127.0.0.1: {out}"
    );
    one_denial(&msgs, &format!("127.0.0.1:{tls}"), &[FORBIDDEN])?;

    // (c) plain HTTP: the allowed URI with the other name in Host, or both names in two
    // Host headers, is refused; the allowed request reaches the CDN with the approved Host.
    let (out, msgs) = cell(
        &mut client,
        &format!("print(plain('http://{allowed_http}/', [{FORBIDDEN:?}]))"),
    )
    .await?;
    ensure!(out.starts_with("403 "), "Host {FORBIDDEN}: {out}");
    one_denial(&msgs, &allowed_http, &["Host", FORBIDDEN])?;
    let (out, msgs) = cell(
        &mut client,
        &format!("print(plain('http://{allowed_http}/', [{allowed_http:?}, {FORBIDDEN:?}]))"),
    )
    .await?;
    ensure!(out.starts_with("403 "), "two Host headers: {out}");
    one_denial(&msgs, &allowed_http, &["more than one Host"])?;
    let (out, msgs) = cell(
        &mut client,
        &format!(
            "import urllib.request\nprint(urllib.request.urlopen('http://{allowed_http}/x', timeout=30).read().decode())"
        ),
    )
    .await?;
    ensure!(out == format!("hello from {allowed_http}"), "{out}");
    ensure!(denials(&msgs).is_empty());

    // (d) Encrypted Client Hello (it would hide the real name), a hello with no name, and
    // bytes that are not TLS at all: refused, with a TLS alert where TLS was spoken.
    let (out, msgs) = cell(
        &mut client,
        &format!("print(tunnel({allowed_tls:?}, 'raw', {ech}))"),
    )
    .await?;
    ensure!(out == "raw closed 15030300020231", "ECH: {out}");
    one_denial(&msgs, &allowed_tls, &["Encrypted Client Hello"])?;
    let (out, msgs) = cell(
        &mut client,
        &format!("print(tunnel({allowed_tls:?}, 'raw', hello(None, [])))"),
    )
    .await?;
    ensure!(out == "raw closed 15030300020231", "no SNI: {out}");
    one_denial(&msgs, &allowed_tls, &["names no server"])?;
    let (out, msgs) = cell(
        &mut client,
        &format!(
            "print(tunnel({allowed_tls:?}, 'raw', b'GET / HTTP/1.1\\r\\nHost: {FORBIDDEN}\\r\\n\\r\\n'))"
        ),
    )
    .await?;
    ensure!(
        out.starts_with("raw closed") || out.starts_with("raw reset"),
        "plain HTTP in a tunnel: {out}"
    );
    ensure!(!out.contains("68656c6c6f"), "the CDN answered: {out}");
    one_denial(&msgs, &allowed_tls, &["not start with a TLS handshake"])?;

    // The CDN itself never saw the other name, a request without TLS, or a second Host.
    tokio::time::sleep(Duration::from_millis(200)).await;
    ensure!(
        seen_tls.all() == vec![ALLOWED.to_owned()],
        "the CDN's TLS side saw {:?}",
        seen_tls.all()
    );
    ensure!(
        seen_http.all() == vec![allowed_http.clone()],
        "the CDN's HTTP side saw {:?}",
        seen_http.all()
    );
    client.close().await;
    Ok(())
}
