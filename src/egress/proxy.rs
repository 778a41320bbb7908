//! One proxy connection: HTTP/1.1 served by hyper, `CONNECT` tunnels and absolute-form
//! requests forwarded, index requests answered locally.
//!
//! What the allowlist approved is what the destination is asked for: an absolute-form
//! request goes upstream with the `Host` of its URI (a different or repeated `Host` header
//! is refused, since a shared front end routes on it), and a tunnel forwards nothing until
//! the client's TLS ClientHello names the approved host ([`super::client_hello`]), since a
//! CDN routes on that name. Otherwise allowing one name on a CDN would open all of them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::OwnedSemaphorePermit;

use super::client_hello::{self, ClientHello};
use super::{Egress, Session, INDEX_HOST, NPM_HOST};
use crate::policy::DenialKind;

/// Errors of a response body while it streams.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;
/// Response bodies of the proxy: streamed from upstream or from disk, or built here.
pub type Body = BoxBody<Bytes, BodyError>;

/// How long a dial may take; a black-holed destination must not hold the cell.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS alert descriptions (RFC 8446, 6) sent to a client whose tunnel is refused, so its TLS
/// library says why instead of reporting a bare reset.
const ALERT_ACCESS_DENIED: u8 = 49;
const ALERT_UNRECOGNIZED_NAME: u8 = 112;

pub fn text(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let mut body = message.into();
    body.push('\n');
    let mut response = Response::new(Full::new(Bytes::from(body)).map_err(|n| match n {}).boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Answers a connection over the session's cap with 429 and closes it.
pub async fn refuse_busy(session: &Session, mut stream: UnixStream) {
    tracing::warn!(kernel_id = %session.kernel_id, "egress connection refused: too many at once");
    let _ = stream
        .write_all(
            b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
}

/// The session's connection slot, shared with the service so that a `CONNECT` tunnel (which
/// outlives the HTTP connection it came on) keeps it until the tunnel closes.
type Slot = Arc<parking_lot::Mutex<Option<OwnedSemaphorePermit>>>;

pub async fn serve_connection(
    egress: Arc<Egress>,
    session: Arc<Session>,
    stream: UnixStream,
    permit: OwnedSemaphorePermit,
) {
    let slot: Slot = Arc::new(parking_lot::Mutex::new(Some(permit)));
    let service = hyper::service::service_fn(move |req| {
        let (egress, session, slot) = (egress.clone(), session.clone(), slot.clone());
        async move { Ok::<_, std::convert::Infallible>(handle(egress, session, slot, req).await) }
    });
    let result = hyper::server::conn::http1::Builder::new()
        .preserve_header_case(true)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades()
        .await;
    if let Err(err) = result {
        tracing::debug!(%err, "egress connection ended with an error");
    }
}

/// Splits `host:port` (`[v6]:port` too).
fn host_port(authority: &str, default_port: u16) -> Option<(String, u16)> {
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, tail) = rest.split_once(']')?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None if tail.is_empty() => default_port,
            None => return None,
        };
        return Some((host.to_owned(), port));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Some((host.to_owned(), port.parse().ok()?)),
        None => Some((authority.to_owned(), default_port)),
    }
}

async fn handle(
    egress: Arc<Egress>,
    session: Arc<Session>,
    slot: Slot,
    req: Request<Incoming>,
) -> Response<Body> {
    let is_connect = req.method() == Method::CONNECT;
    // CONNECT carries an authority, absolute-form requests a full URI: both have one.
    let target = req.uri().authority().map(|a| a.as_str().to_owned());
    let default_port = if req.uri().scheme_str() == Some("https") {
        443
    } else {
        80
    };
    let Some((host, port)) = target.as_deref().and_then(|t| host_port(t, default_port)) else {
        return text(
            StatusCode::BAD_REQUEST,
            "cellgate proxy: send CONNECT host:port or an absolute-form request (http://host/…)",
        );
    };
    if !is_connect && host.eq_ignore_ascii_case(INDEX_HOST) {
        return egress.index.handle(&session, req).await;
    }
    if !is_connect && host.eq_ignore_ascii_case(NPM_HOST) {
        return egress.npm.handle(&session, req).await;
    }
    let target = format!("{host}:{port}");
    let Some(rule) = session.policy.egress.allowing(&host, port) else {
        let mut reason = format!(
            "egress to {target} is not allowed by policy '{}'",
            session.policy.name
        );
        if same_host(&host, "jsr.io") {
            // Deno's `jsr:` imports: cellgate's registry does not serve JSR.
            reason.push_str(
                " (a jsr: import: cellgate serves npm: packages only, those [packages] npm lists)",
            );
        }
        session.deny(DenialKind::Egress, &target, reason.clone());
        return text(StatusCode::FORBIDDEN, format!("cellgate: {reason}"));
    };
    let rule = rule.clone();
    let host_header = if is_connect {
        None
    } else {
        match approved_host_header(req.headers(), &host, port, default_port) {
            Ok(value) => Some(value),
            Err(why) => {
                let reason = format!("egress to {target} refused: {why}");
                session.deny(DenialKind::Egress, &target, reason.clone());
                return text(StatusCode::FORBIDDEN, format!("cellgate: {reason}"));
            }
        }
    };
    let addrs = match egress.config.resolver.resolve(&host, port, &rule).await {
        Ok(addrs) => addrs,
        Err(err) => {
            let reason = format!("egress to {target} refused: {err}");
            session.deny(DenialKind::Egress, &target, reason.clone());
            return text(StatusCode::FORBIDDEN, format!("cellgate: {reason}"));
        }
    };
    let upstream = match dial(&addrs).await {
        Ok(stream) => stream,
        Err(err) => {
            tracing::info!(kernel_id = %session.kernel_id, target, %err, "egress dial failed");
            return text(
                StatusCode::BAD_GATEWAY,
                format!("cellgate: cannot reach {target}: {err}"),
            );
        }
    };
    if let Some(host_header) = host_header {
        session.allow("egress", &target, "http");
        return forward(req, upstream, host_header).await;
    }
    let permit = slot.lock().take();
    tokio::spawn(async move {
        let _permit = permit;
        match hyper::upgrade::on(req).await {
            Ok(upgraded) => {
                tunnel(&session, &host, &target, TokioIo::new(upgraded), upstream).await
            }
            Err(err) => tracing::debug!(%err, "CONNECT upgrade failed"),
        }
    });
    Response::new(http_body_util::Empty::new().map_err(|n| match n {}).boxed())
}

/// Whether two host names are the same name: DNS is case-insensitive and `name.` is the
/// fully qualified spelling of `name`.
fn same_host(a: &str, b: &str) -> bool {
    let a = a.strip_suffix('.').unwrap_or(a);
    let b = b.strip_suffix('.').unwrap_or(b);
    a.eq_ignore_ascii_case(b)
}

/// The `Host` header an absolute-form request for `host:port` goes upstream with, or why the
/// request is refused: a `Host` header naming anything else, or several of them (a front end
/// might route on either).
fn approved_host_header(
    headers: &hyper::HeaderMap,
    host: &str,
    port: u16,
    default_port: u16,
) -> Result<hyper::header::HeaderValue, String> {
    let mut sent = headers.get_all(hyper::header::HOST).iter();
    if let (Some(_), Some(_)) = (sent.next(), sent.next()) {
        return Err("the request has more than one Host header".to_owned());
    }
    if let Some(value) = headers.get(hyper::header::HOST) {
        let matches = value
            .to_str()
            .ok()
            .and_then(|v| host_port(v, default_port))
            .is_some_and(|(h, p)| same_host(&h, host) && p == port);
        if !matches {
            return Err(format!(
                "its Host header {:?} differs from the approved host {host}:{port}",
                String::from_utf8_lossy(value.as_bytes())
            ));
        }
    }
    let name = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    let value = if port == default_port {
        name
    } else {
        format!("{name}:{port}")
    };
    hyper::header::HeaderValue::from_str(&value)
        .map_err(|_| format!("{value:?} is not a valid Host header"))
}

/// Why a tunnel to `approved` may not carry this ClientHello, with the alert to send.
fn refusal(approved: &str, hello: &ClientHello) -> Option<(String, u8)> {
    if hello.encrypted {
        return Some((
            "the TLS ClientHello offers Encrypted Client Hello, which hides the server name \
             it asks for; tunnels need the name in the clear"
                .to_owned(),
            ALERT_ACCESS_DENIED,
        ));
    }
    match &hello.server_name {
        Some(name) if same_host(name, approved) => None,
        Some(name) => Some((
            format!(
                "the TLS server name (SNI) {name:?} differs from the approved host {approved:?}"
            ),
            ALERT_UNRECOGNIZED_NAME,
        )),
        None if approved.parse::<std::net::IpAddr>().is_ok() => None,
        None => Some((
            format!(
                "the TLS ClientHello names no server (SNI); only a tunnel to an IP address \
                 may omit it, and this one is to {approved:?}"
            ),
            ALERT_ACCESS_DENIED,
        )),
    }
}

/// An approved `CONNECT`: the client's ClientHello is read and checked before a byte goes
/// upstream, then forwarded with the rest of the stream.
async fn tunnel<C>(
    session: &Session,
    host: &str,
    target: &str,
    mut client: C,
    mut upstream: TcpStream,
) where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let first = match client_hello::read(&mut client).await {
        Ok((hello, bytes)) => {
            if let Some((why, alert)) = refusal(host, &hello) {
                session.deny(
                    DenialKind::Egress,
                    target,
                    format!("egress to {target} refused: {why}"),
                );
                // A fatal alert in a TLS 1.2-versioned record, which any TLS client reads.
                let _ = client.write_all(&[21, 3, 3, 0, 2, 2, alert]).await;
                let _ = client.shutdown().await;
                return;
            }
            bytes
        }
        // Opened and closed without a byte: nothing was sent anywhere, nothing to refuse.
        Err(client_hello::ClientHelloError::Truncated(0)) => return,
        Err(client_hello::ClientHelloError::Io(err)) => {
            tracing::debug!(kernel_id = %session.kernel_id, target, %err, "tunnel read failed");
            return;
        }
        Err(err) => {
            session.deny(
                DenialKind::Egress,
                target,
                format!("egress to {target} refused: {err}"),
            );
            let _ = client.shutdown().await;
            return;
        }
    };
    session.allow("egress", target, "connect");
    if upstream.write_all(&first).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}

async fn dial(addrs: &[std::net::SocketAddr]) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("no address");
    for addr in addrs {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(err)) => last = err,
            Err(_) => last = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
        }
    }
    Err(last)
}

/// Sends one absolute-form request on a fresh upstream connection, in origin form, with the
/// approved `Host`.
async fn forward(
    req: Request<Incoming>,
    upstream: TcpStream,
    host: hyper::header::HeaderValue,
) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    parts.uri = match path.parse() {
        Ok(uri) => uri,
        Err(_) => return text(StatusCode::BAD_REQUEST, "cellgate proxy: bad path"),
    };
    for name in ["proxy-connection", "proxy-authorization"] {
        parts.headers.remove(name);
    }
    parts.headers.insert(hyper::header::HOST, host);
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(pair) => pair,
            Err(err) => {
                return text(
                    StatusCode::BAD_GATEWAY,
                    format!("cellgate: upstream: {err}"),
                )
            }
        };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    match sender.send_request(Request::from_parts(parts, body)).await {
        Ok(response) => response.map(|b| b.map_err(BodyError::from).boxed()),
        Err(err) => text(
            StatusCode::BAD_GATEWAY,
            format!("cellgate: upstream: {err}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities() {
        assert_eq!(host_port("a.b:443", 80), Some(("a.b".into(), 443)));
        assert_eq!(host_port("a.b", 80), Some(("a.b".into(), 80)));
        assert_eq!(host_port("[::1]:8080", 80), Some(("::1".into(), 8080)));
        assert_eq!(host_port("u:p@h:1", 80), Some(("h".into(), 1)));
        assert_eq!(host_port("h:x", 80), None);
    }

    fn headers(hosts: &[&str]) -> hyper::HeaderMap {
        let mut map = hyper::HeaderMap::new();
        for h in hosts {
            map.append(hyper::header::HOST, h.parse().unwrap());
        }
        map
    }

    #[test]
    fn plain_requests_go_upstream_with_the_approved_host() {
        let ok = |sent: &[&str], host: &str, port: u16| {
            approved_host_header(&headers(sent), host, port, 80)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        assert_eq!(ok(&[], "a.test", 80).unwrap(), "a.test");
        assert_eq!(ok(&["A.Test."], "a.test", 80).unwrap(), "a.test");
        assert_eq!(ok(&["a.test:80"], "a.test", 80).unwrap(), "a.test");
        assert_eq!(ok(&["a.test:8080"], "a.test", 8080).unwrap(), "a.test:8080");
        assert_eq!(ok(&["[::1]:81"], "::1", 81).unwrap(), "[::1]:81");
        for (sent, port) in [
            (&["b.test"][..], 80),
            (&["a.test:81"], 80),
            (&["a.test"], 8080),
            (&["a.test.b.test"], 80),
            (&["a.test", "a.test"], 80),
            (&["a.test", "b.test"], 80),
        ] {
            let err = ok(sent, "a.test", port).unwrap_err();
            assert!(err.contains("Host header"), "{sent:?}: {err}");
        }
    }

    fn hello(name: Option<&str>, encrypted: bool) -> ClientHello {
        ClientHello {
            server_name: name.map(str::to_owned),
            encrypted,
        }
    }

    #[test]
    fn tunnels_carry_the_approved_server_name_only() {
        assert!(refusal("a.test", &hello(Some("a.test"), false)).is_none());
        assert!(refusal("a.test", &hello(Some("A.TEST."), false)).is_none());
        assert!(refusal("a.test.", &hello(Some("a.test"), false)).is_none());
        assert!(refusal("203.0.113.7", &hello(None, false)).is_none());
        assert!(refusal("2001:db8::7", &hello(None, false)).is_none());
        let (why, alert) = refusal("a.test", &hello(Some("b.test"), false)).unwrap();
        assert!(
            why.contains("\"b.test\"") && why.contains("\"a.test\""),
            "{why}"
        );
        assert_eq!(alert, ALERT_UNRECOGNIZED_NAME);
        for (approved, h) in [
            ("a.test", hello(None, false)),
            ("a.test", hello(Some("a.test"), true)),
            ("203.0.113.7", hello(Some("b.test"), false)),
            ("x.a.test", hello(Some("a.test"), false)),
        ] {
            assert!(refusal(approved, &h).is_some(), "{approved} {h:?}");
        }
    }
}
