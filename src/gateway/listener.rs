//! The gateway's own accept loop (in place of `axum::serve`), so that no client can hold
//! connections, each a file descriptor, for nothing:
//!
//! - Header-read timeout: a request's head must arrive whole within `header_read_timeout` of
//!   its first byte (of the connection's opening, for a connection's first request), or the
//!   connection is closed. Slowloris clients, which trickle a head that never ends, are cut.
//! - Idle timeout: a keep-alive connection with no request in flight is closed when no new
//!   request starts within `idle_timeout` of the last response.
//! - Body-read timeout: while a handler waits for more of a request's body, the next bytes
//!   must come within `body_read_timeout`, or the connection is closed (and the handler's
//!   read fails). A client that sends a head promising a large body and then trickles it, or
//!   stops, is cut; a body that keeps coming, however large or slow the handler, is not: the
//!   clock runs only while the handler is waiting for bytes that do not arrive.
//! - Caps: at most `max_connections` connections open at once, and at most `max_per_peer`
//!   from one IP address. Past either, the new connection gets `503` with `Retry-After: 1`
//!   and `Connection: close`, written straight on the socket without hyper, and is closed.
//!   Refusals are counted, and logged at most once every `REPORT_EVERY`, not once each.
//!   A trusted proxy (`--trusted-proxy`) is held to the total cap only: it carries many
//!   clients, and the caps are taken when a connection is accepted, before any request
//!   (and its `X-Forwarded-For`) is read, so its clients cannot be told apart here.
//!
//! Every request gets a [`ClientAddr`] extension, the address of its client
//! (`client_addr.rs`: the peer, or the client a trusted proxy forwarded for), beside axum's
//! `ConnectInfo` with the peer's socket address.
//!
//! A connection keeps its place under the caps until its socket closes, WebSockets included:
//! the place lives in the socket's wrapper, which an upgraded connection keeps. Neither
//! timeout runs while a request is in flight (a long execution, an SSE stream, an upload) or
//! after a WebSocket upgrade: they bound only the wait for a request's head. Only the
//! body-read timeout runs in flight, and only while the body stalls.
//!
//! Why not hyper's `header_read_timeout`: hyper arms it whenever a connection waits for a
//! head, idle keep-alive included, so a header timeout of a few seconds would also close
//! every keep-alive connection after a few idle seconds. Here the two are separate settings.
//!
//! HTTP/1.1 only, as before: axum's server was built without HTTP/2. TCP_NODELAY on every
//! accepted socket; a graceful shutdown lets requests in flight finish for at most 10 s.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::Router;
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::client_addr::{ClientAddr, TrustedProxies};
use crate::config::GatewayConfig;

/// How long requests in flight may take to finish once shutdown begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Once shutdown begins, how long a connection without a request in flight may still take
/// (to flush an answer's tail), instead of the rest of its header or idle timeout.
const SHUTDOWN_IDLE_GRACE: Duration = Duration::from_secs(1);
/// The longest a refused connection is kept to deliver its 503.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// Refusals being delivered at once. Past it a refused connection is closed without an
/// answer: a flood must not hold descriptors through its own refusals.
const MAX_REFUSALS_IN_FLIGHT: usize = 64;
/// What a refused client may have sent that is read (and dropped) before closing.
const REFUSAL_DRAIN_BYTES: usize = 64 << 10;
/// The shortest time between two log lines about refusals, or about accept errors.
const REPORT_EVERY: Duration = Duration::from_secs(10);
/// The pause after an accept error that is not one connection's (out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The limits on client connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub body_read_timeout: Duration,
    pub max_connections: usize,
    pub max_per_peer: usize,
}

impl ConnectionLimits {
    /// The configured limits; an unset total cap is [`default_max_connections`].
    pub fn from_config(config: &GatewayConfig) -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: config.header_read_timeout,
            idle_timeout: config.idle_connection_timeout,
            body_read_timeout: config.body_read_timeout,
            max_connections: config
                .max_connections
                .unwrap_or_else(default_max_connections),
            max_per_peer: config.max_connections_per_peer,
        }
    }
}

/// Half the open-file limit (read after `main` raised it to the hard limit), between 64 and
/// 65536: the other half is for kernels' sockets and pipes, proxied connections and files.
pub fn default_max_connections() -> usize {
    use rustix::process::{getrlimit, Resource};
    let soft = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    usize::try_from(soft / 2)
        .unwrap_or(usize::MAX)
        .clamp(64, 65_536)
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets requests
/// in flight finish for up to `SHUTDOWN_GRACE` and returns. WebSockets already upgraded
/// are not waited for. Connections from `trusted` proxies are exempt from the per-peer cap,
/// and their requests' clients are read from `X-Forwarded-For`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    trusted: TrustedProxies,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Slots {
        limits,
        trusted: trusted.clone(),
        open: Mutex::new(Open::default()),
    });
    let refusing = Arc::new(AtomicUsize::new(0));
    // Every connection task holds a receiver: the sender learns both that shutdown began
    // (to them) and when the last of them ended (from them).
    let (closing, closing_rx) = watch::channel(false);
    let mut refusals = RefusalReport::default();
    let mut accept_errors = Throttle::default();
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
            // Refusals counted after the last line are logged when due, even if none follow.
            () = sleep_until(refusals.pending_until()) => {
                refusals.flush(&limits);
                continue;
            }
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                accept_errors.count += 1;
                if accept_errors.due() {
                    let errors = accept_errors.take();
                    tracing::warn!(%err, errors, "cannot accept connections (errors since the last such line)");
                }
                // One connection's failure (reset before it was accepted) says nothing about
                // the next; anything else (EMFILE, ENFILE, ENOBUFS) would fail again at once.
                if !matches!(
                    err.kind(),
                    io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionRefused
                ) {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
                continue;
            }
        };
        // Nagle's algorithm costs Kernel Gateway ~40 ms per round trip.
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(%err, "cannot set TCP_NODELAY");
        }
        // An IPv4 client of a dual-stack listener counts as its IPv4 address.
        let peer_ip = peer.ip().to_canonical();
        match slots.admit(peer_ip) {
            Ok(slot) => {
                tokio::spawn(serve_connection(
                    stream,
                    peer,
                    slot,
                    app.clone(),
                    limits,
                    trusted.clone(),
                    closing_rx.clone(),
                ));
            }
            Err(refusal) => {
                refusals.count(refusal, peer_ip, &limits);
                refuse(stream, refusal, peer_ip, &limits, &refusing);
            }
        }
    }
    drop(listener);
    refusals.flush(&limits);
    drop(closing_rx);
    closing.send_replace(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, closing.closed())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = closing.receiver_count(),
            "shutting down with requests still in flight"
        );
    }
}

/// Connections open now: in total, and per peer address (trusted proxies' not counted).
struct Slots {
    limits: ConnectionLimits,
    trusted: TrustedProxies,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// Which cap a refused connection was over.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    Total,
    Peer,
}

/// A connection's place under the caps, given back when it is dropped with the socket.
struct Slot {
    slots: Arc<Slots>,
    /// The peer it counts for under the per-peer cap; `None` for a trusted proxy.
    peer: Option<IpAddr>,
    /// Counted in `cellgate_connections_open` while it lives.
    _open: crate::telemetry::metrics::OpenGuard,
}

impl Slots {
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Slot, Refusal> {
        // Outside the lock: a walk over the trusted networks.
        let counted = (!self.trusted.contains(peer)).then_some(peer);
        let mut guard = self.open.lock();
        let open = &mut *guard;
        let from_peer = counted.map(|peer| open.per_peer.get(&peer).copied().unwrap_or(0));
        if from_peer.is_some_and(|n| n >= self.limits.max_per_peer) {
            return Err(Refusal::Peer);
        }
        if open.total >= self.limits.max_connections {
            return Err(Refusal::Total);
        }
        if let (Some(peer), Some(n)) = (counted, from_peer) {
            open.per_peer.insert(peer, n + 1);
        }
        open.total += 1;
        Ok(Slot {
            slots: self.clone(),
            peer: counted,
            _open: crate::telemetry::metrics::metrics().connection_opened(),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.slots.open.lock();
        open.total = open.total.saturating_sub(1);
        let Some(peer) = self.peer else {
            return;
        };
        if let Entry::Occupied(mut entry) = open.per_peer.entry(peer) {
            *entry.get_mut() -= 1;
            if *entry.get() == 0 {
                entry.remove();
            }
        }
    }
}

/// Allows one log line per [`REPORT_EVERY`], counting what happened in between.
#[derive(Default)]
struct Throttle {
    last: Option<Instant>,
    count: u64,
}

impl Throttle {
    fn due(&mut self) -> bool {
        let now = Instant::now();
        if self.last.is_some_and(|last| now - last < REPORT_EVERY) {
            return false;
        }
        self.last = Some(now);
        true
    }

    fn take(&mut self) -> u64 {
        std::mem::take(&mut self.count)
    }
}

#[derive(Default)]
struct RefusalReport {
    throttle: Throttle,
    over_peer_cap: u64,
    last_peer: Option<IpAddr>,
}

impl RefusalReport {
    fn count(&mut self, refusal: Refusal, peer: IpAddr, limits: &ConnectionLimits) {
        self.throttle.count += 1;
        if matches!(refusal, Refusal::Peer) {
            self.over_peer_cap += 1;
        }
        self.last_peer = Some(peer);
        if self.throttle.due() {
            self.log(limits);
        }
    }

    /// When refusals counted since the last line are due to be logged, if any are.
    fn pending_until(&self) -> Option<Instant> {
        match (self.throttle.count, self.throttle.last) {
            (0, _) | (_, None) => None,
            (_, Some(last)) => Some(last + REPORT_EVERY),
        }
    }

    /// Logs the refusals counted since the last line, if any, without waiting.
    fn flush(&mut self, limits: &ConnectionLimits) {
        if self.throttle.count > 0 {
            self.throttle.last = Some(Instant::now());
            self.log(limits);
        }
    }

    fn log(&mut self, limits: &ConnectionLimits) {
        // Taken before the macro, which skips its fields when the level is filtered out.
        let over_peer_cap = std::mem::take(&mut self.over_peer_cap);
        let refused = self.throttle.take();
        tracing::warn!(
            refused,
            over_peer_cap,
            last_peer = ?self.last_peer,
            max_connections = limits.max_connections,
            max_connections_per_peer = limits.max_per_peer,
            "connections refused with 503: over the connection caps (counts since the last such line)"
        );
    }
}

/// Answers a refused connection with a 503 and closes it, in a task of its own.
fn refuse(
    stream: TcpStream,
    refusal: Refusal,
    peer: IpAddr,
    limits: &ConnectionLimits,
    refusing: &Arc<AtomicUsize>,
) {
    if refusing.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSALS_IN_FLIGHT {
        refusing.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let message = match refusal {
        Refusal::Peer => format!(
            "too many connections from {peer}: at most {} at once; close some or retry shortly",
            limits.max_per_peer
        ),
        Refusal::Total => format!(
            "the gateway has its most connections open ({}); retry shortly",
            limits.max_connections
        ),
    };
    let refusing = refusing.clone();
    tokio::spawn(async move {
        // Whatever happens, the socket closes when the task ends.
        let _ = tokio::time::timeout(REFUSAL_LINGER, answer_refusal(stream, &message)).await;
        refusing.fetch_sub(1, Ordering::SeqCst);
    });
}

async fn answer_refusal(mut stream: TcpStream, message: &str) -> io::Result<()> {
    let body = serde_json::json!({"reason": "Service Unavailable", "message": message}).to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(answer.as_bytes()).await?;
    stream.shutdown().await?;
    // Closing a socket with unread bytes resets the connection, and the reset can destroy
    // the answer before the client reads it: read what the client sent until it closes.
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < REFUSAL_DRAIN_BYTES {
        match stream.read(&mut sink).await? {
            0 => break,
            n => drained += n,
        }
    }
    Ok(())
}

/// What a connection waits for while no request is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// The rest of a request's head: the header-read timeout runs.
    Head,
    /// The first byte of the next request: the idle timeout runs.
    Idle,
    /// More of the body of the request in flight, which its handler is waiting for: the
    /// body-read timeout runs.
    Body,
}

/// A connection's requests in flight and, between requests, its deadline; watched by the
/// connection's task, told by the socket wrapper and the service.
struct Activity {
    header_read_timeout: Duration,
    idle_timeout: Duration,
    body_read_timeout: Duration,
    state: Mutex<ActivityState>,
    changed: Notify,
    /// False once the connection is no longer hyper's (upgraded or closed): reads then skip
    /// the bookkeeping.
    watched: AtomicBool,
}

struct ActivityState {
    in_flight: usize,
    waiting: Waiting,
    /// When the wait ends; `None` while a request is in flight.
    deadline: Option<Instant>,
    /// When the wait for the request's body ends; `None` unless its handler is waiting for
    /// bytes that have not come.
    body_deadline: Option<Instant>,
}

impl Activity {
    fn new(limits: &ConnectionLimits, now: Instant) -> Activity {
        Activity {
            header_read_timeout: limits.header_read_timeout,
            idle_timeout: limits.idle_timeout,
            body_read_timeout: limits.body_read_timeout,
            // A new connection owes its first head from the start: opening connections and
            // sending nothing is the simplest way to hold them.
            state: Mutex::new(ActivityState {
                in_flight: 0,
                waiting: Waiting::Head,
                deadline: Some(now + limits.header_read_timeout),
                body_deadline: None,
            }),
            changed: Notify::new(),
            watched: AtomicBool::new(true),
        }
    }

    /// Bytes arrived from the client.
    fn read(&self, now: Instant) {
        if !self.watched.load(Ordering::Relaxed) {
            return;
        }
        let mut state = self.state.lock();
        if state.in_flight == 0 && state.waiting == Waiting::Idle {
            state.waiting = Waiting::Head;
            state.deadline = Some(now + self.header_read_timeout);
            self.changed.notify_one();
        }
    }

    /// hyper parsed a request head and called the service.
    fn request_started(self: &Arc<Self>) -> InFlight {
        let mut state = self.state.lock();
        state.in_flight += 1;
        state.deadline = None;
        self.changed.notify_one();
        InFlight {
            activity: self.clone(),
        }
    }

    /// The handler asked for more of the request's body and none was there: the clock
    /// starts, unless it runs already.
    fn body_waiting(&self, now: Instant) {
        let mut state = self.state.lock();
        if state.body_deadline.is_none() {
            state.body_deadline = Some(now + self.body_read_timeout);
            self.changed.notify_one();
        }
    }

    /// Body bytes came (or the body ended): the clock stops.
    fn body_progress(&self) {
        let mut state = self.state.lock();
        if state.body_deadline.take().is_some() {
            self.changed.notify_one();
        }
    }

    fn request_ended(&self, now: Instant) {
        let mut state = self.state.lock();
        state.body_deadline = None;
        state.in_flight = state.in_flight.saturating_sub(1);
        if state.in_flight == 0 {
            state.waiting = Waiting::Idle;
            state.deadline = Some(now + self.idle_timeout);
            self.changed.notify_one();
        }
    }

    /// Shutdown began: a connection waiting for a head (hyper closes only idle ones at once)
    /// gets a short deadline.
    fn shutting_down(&self, now: Instant) {
        let mut state = self.state.lock();
        if state.in_flight == 0 {
            let grace = now + SHUTDOWN_IDLE_GRACE;
            state.deadline = Some(state.deadline.map_or(grace, |d| d.min(grace)));
        }
    }

    fn deadline(&self) -> Option<Instant> {
        let state = self.state.lock();
        match (state.deadline, state.body_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// What the connection waited for, if its deadline has passed.
    fn expired(&self, now: Instant) -> Option<Waiting> {
        let state = self.state.lock();
        if state.body_deadline.is_some_and(|d| d <= now) {
            return Some(Waiting::Body);
        }
        let passed = state.deadline.is_some_and(|d| d <= now);
        (passed && state.in_flight == 0).then_some(state.waiting)
    }
}

/// A request in flight, from its parsed head until hyper is done with its response body.
struct InFlight {
    activity: Arc<Activity>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.activity.request_ended(Instant::now());
    }
}

/// A response body that keeps its request in flight until hyper drops it: once the body is
/// sent whole, or with the connection.
struct TrackedBody {
    body: Body,
    _in_flight: InFlight,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request's body as the handler reads it: tells [`Activity`] when the handler waits for
/// bytes that are not there, and when they come.
struct WatchedBody {
    body: Incoming,
    activity: Arc<Activity>,
}

impl HttpBody for WatchedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let poll = Pin::new(&mut self.body).poll_frame(cx);
        match poll {
            Poll::Pending => self.activity.body_waiting(Instant::now()),
            Poll::Ready(_) => self.activity.body_progress(),
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The client's socket: tells [`Activity`] when bytes arrive, and holds the connection's
/// place under the caps until the socket closes (an upgraded WebSocket keeps it too).
struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
    _slot: Slot,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.stream).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read(Instant::now());
        }
        poll
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Serves one connection with hyper, closing it when its deadline passes and shutting it
/// down gracefully when `closing` says so.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    slot: Slot,
    app: Router,
    limits: ConnectionLimits,
    trusted: TrustedProxies,
    mut closing: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new(&limits, Instant::now()));
    let socket = TokioIo::new(Watched {
        stream,
        activity: activity.clone(),
        _slot: slot,
    });
    let app = TowerToHyperService::new(app);
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            // Per request: a proxy's keep-alive connection carries many clients' requests.
            let client: ClientAddr = trusted.client(peer.ip(), request.headers());
            request.extensions_mut().insert(client);
            let in_flight = activity.request_started();
            let request = request.map(|body| WatchedBody {
                body,
                activity: activity.clone(),
            });
            let response = hyper::service::Service::call(&app, request);
            async move {
                let response = response.await?;
                Ok::<_, Infallible>(response.map(|body| TrackedBody {
                    body,
                    _in_flight: in_flight,
                }))
            }
        })
    };
    let connection = hyper::server::conn::http1::Builder::new()
        // The timeouts are this task's, below (see the module doc for why not hyper's).
        .header_read_timeout(None)
        .serve_connection(socket, service)
        .with_upgrades();
    tokio::pin!(connection);
    let mut shutting_down = false;
    loop {
        let deadline = activity.deadline();
        let changed = activity.changed.notified();
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(err) = result {
                    tracing::debug!(%peer, %err, "connection ended with an error");
                }
                break;
            }
            () = sleep_until(deadline) => {
                if let Some(waiting) = activity.expired(Instant::now()) {
                    tracing::debug!(%peer, ?waiting, "connection closed: past its timeout");
                    break;
                }
            }
            () = changed => {}
            _ = closing.changed(), if !shutting_down => {
                shutting_down = true;
                connection.as_mut().graceful_shutdown();
                activity.shutting_down(Instant::now());
            }
        }
    }
    activity.watched.store(false, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_connections: usize, max_per_peer: usize) -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            body_read_timeout: Duration::from_secs(1),
            max_connections,
            max_per_peer,
        }
    }

    #[test]
    fn slots_count_per_peer_and_in_total_and_come_back_on_drop() {
        let slots = Arc::new(Slots {
            limits: limits(3, 2),
            trusted: TrustedProxies::default(),
            open: Mutex::new(Open::default()),
        });
        let a: IpAddr = [127, 0, 0, 1].into();
        let b: IpAddr = [127, 0, 0, 2].into();
        let a1 = slots.admit(a).unwrap();
        let _a2 = slots.admit(a).unwrap();
        assert!(matches!(slots.admit(a), Err(Refusal::Peer)));
        let _b1 = slots.admit(b).unwrap();
        assert!(matches!(slots.admit(b), Err(Refusal::Total)));
        drop(a1);
        let _b2 = slots.admit(b).unwrap();
        drop(_b1);
        drop(_b2);
        drop(_a2);
        let open = slots.open.lock();
        assert_eq!(open.total, 0);
        assert!(open.per_peer.is_empty(), "no entry left for a peer gone");
    }

    #[test]
    fn trusted_proxies_are_held_to_the_total_cap_only() {
        let networks = ["10.0.0.0/8".parse().unwrap()];
        let slots = Arc::new(Slots {
            limits: limits(4, 1),
            trusted: TrustedProxies::new(&networks),
            open: Mutex::new(Open::default()),
        });
        let proxy: IpAddr = [10, 0, 0, 1].into();
        let client: IpAddr = [192, 0, 2, 1].into();
        let proxied: Vec<Slot> = (0..3).map(|_| slots.admit(proxy).unwrap()).collect();
        // A mapped address of a dual-stack listener is the same proxy.
        let mapped = slots
            .admit(IpAddr::V6(
                std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped(),
            ))
            .unwrap();
        assert!(matches!(slots.admit(proxy), Err(Refusal::Total)));
        assert!(matches!(slots.admit(client), Err(Refusal::Total)));
        drop(mapped);
        let _direct = slots.admit(client).unwrap();
        drop(proxied);
        assert!(
            matches!(slots.admit(client), Err(Refusal::Peer)),
            "an untrusted peer keeps its cap"
        );
        let open = slots.open.lock();
        assert_eq!(open.total, 1);
        assert_eq!(open.per_peer.len(), 1, "proxies are not counted per peer");
    }

    #[test]
    fn deadlines_follow_the_requests() {
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        let activity = Arc::new(Activity::new(
            &ConnectionLimits {
                header_read_timeout: Duration::from_secs(2),
                idle_timeout: Duration::from_secs(10),
                body_read_timeout: Duration::from_secs(3),
                max_connections: 1,
                max_per_peer: 1,
            },
            start,
        ));
        // A new connection owes its head within the header timeout, bytes or not.
        activity.read(at(1));
        assert_eq!(activity.expired(at(1)), None);
        assert_eq!(activity.expired(at(2)), Some(Waiting::Head));
        // In flight: no deadline, however long.
        let in_flight = activity.request_started();
        assert_eq!(activity.deadline(), None);
        assert_eq!(activity.expired(at(600)), None);
        // Idle: the idle timeout runs from the response, until the next request's first byte.
        let before = Instant::now();
        drop(in_flight);
        let idle_until = activity.deadline().expect("a deadline once idle");
        assert!(idle_until >= before + Duration::from_secs(10));
        assert!(idle_until <= Instant::now() + Duration::from_secs(10));
        let second = Duration::from_secs(1);
        assert_eq!(activity.expired(idle_until - second), None);
        assert_eq!(activity.expired(idle_until), Some(Waiting::Idle));
        activity.read(idle_until - second);
        assert_eq!(
            activity.expired(idle_until),
            None,
            "the header timeout runs now"
        );
        assert_eq!(activity.expired(idle_until + second), Some(Waiting::Head));
        // Bytes during a request (a body, a pipelined head) change nothing.
        let next = activity.request_started();
        activity.read(idle_until + second);
        assert_eq!(activity.deadline(), None);
        // A handler waiting for body bytes that do not come: the body timeout runs from the
        // first wait, and stops when bytes come.
        let waits = idle_until + second * 2;
        activity.body_waiting(waits);
        activity.body_waiting(waits + second);
        assert_eq!(activity.deadline(), Some(waits + second * 3));
        assert_eq!(activity.expired(waits + second * 2), None);
        assert_eq!(activity.expired(waits + second * 3), Some(Waiting::Body));
        activity.body_progress();
        assert_eq!(activity.deadline(), None);
        assert_eq!(activity.expired(waits + second * 60), None);
        // A request that ends leaves no body clock behind.
        activity.body_waiting(waits);
        drop(next);
        assert_eq!(activity.state.lock().body_deadline, None);
        assert_ne!(activity.expired(waits + second * 3), Some(Waiting::Body));
    }

    #[test]
    fn shutdown_shortens_only_waits_without_a_request() {
        let start = Instant::now();
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 1,
            max_per_peer: 1,
        };
        let waiting = Activity::new(&limits, start);
        waiting.shutting_down(start);
        assert_eq!(waiting.deadline(), Some(start + SHUTDOWN_IDLE_GRACE));
        let busy = Arc::new(Activity::new(&limits, start));
        let _in_flight = busy.request_started();
        busy.shutting_down(start);
        assert_eq!(busy.deadline(), None, "a request in flight finishes");
    }

    #[test]
    fn refusals_are_logged_at_once_then_counted_until_due() {
        let limits = limits(1, 1);
        let peer: IpAddr = [127, 0, 0, 1].into();
        let mut report = RefusalReport::default();
        report.count(Refusal::Peer, peer, &limits);
        assert_eq!(
            report.pending_until(),
            None,
            "the first refusal is logged at once"
        );
        report.count(Refusal::Total, peer, &limits);
        report.count(Refusal::Peer, peer, &limits);
        let due = report
            .pending_until()
            .expect("two refusals wait for their line");
        assert!(due > Instant::now() + REPORT_EVERY - Duration::from_secs(1));
        assert_eq!((report.throttle.count, report.over_peer_cap), (2, 1));
        report.flush(&limits);
        assert_eq!(report.pending_until(), None);
        assert_eq!((report.throttle.count, report.over_peer_cap), (0, 0));
    }
}
