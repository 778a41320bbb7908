//! One proxy connection: HTTP/1.1 served by hyper, `CONNECT` tunnels and absolute-form
//! requests forwarded, index requests answered locally.

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

use super::{Egress, Session, INDEX_HOST};

/// Errors of a response body while it streams.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;
/// Response bodies of the proxy: streamed from upstream or from disk, or built here.
pub type Body = BoxBody<Bytes, BodyError>;

/// How long a dial may take; a black-holed destination must not hold the cell.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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
    let target = format!("{host}:{port}");
    let Some(rule) = session.policy.egress.allowing(&host, port) else {
        let reason = format!(
            "egress to {target} is not allowed by policy '{}'",
            session.policy.name
        );
        session.deny("egress", &target, reason.clone());
        return text(StatusCode::FORBIDDEN, format!("cellgate: {reason}"));
    };
    let rule = rule.clone();
    let addrs = match egress.config.resolver.resolve(&host, port, &rule).await {
        Ok(addrs) => addrs,
        Err(err) => {
            let reason = format!("egress to {target} refused: {err}");
            session.deny("egress", &target, reason.clone());
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
    session.allow(
        "egress",
        &target,
        if is_connect { "connect" } else { "http" },
    );
    if is_connect {
        let permit = slot.lock().take();
        tokio::spawn(async move {
            let _permit = permit;
            match hyper::upgrade::on(req).await {
                Ok(upgraded) => {
                    let mut client = TokioIo::new(upgraded);
                    let mut upstream = upstream;
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
                Err(err) => tracing::debug!(%err, "CONNECT upgrade failed"),
            }
        });
        return Response::new(http_body_util::Empty::new().map_err(|n| match n {}).boxed());
    }
    forward(req, upstream).await
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

/// Sends one absolute-form request on a fresh upstream connection, in origin form.
async fn forward(req: Request<Incoming>, upstream: TcpStream) -> Response<Body> {
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
}
