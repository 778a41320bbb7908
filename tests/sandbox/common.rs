//! The tests every backend must pass, written once and run against each (`every_backend!`
//! makes one module of them per backend): a kernel round trip, an interrupt, the exit
//! status, and a network of loopback only. A new backend adds one line at the bottom.

use std::time::{Duration, Instant};

use cellgate::sandbox::Limits;
use serde_json::json;

use super::harness::{require_root, run_python, sandbox, start_kernel, Kind, PATIENCE};

async fn one_plus_one_round_trips(kind: Kind) {
    require_root("one_plus_one_round_trips");
    let mut kernel = start_kernel(kind, Limits::default()).await;
    let started = Instant::now();
    let out = kernel.execute("1+1").await;
    let rtt = started.elapsed();
    assert_eq!(out.status, "ok", "{out:?}");
    assert_eq!(out.result.as_deref(), Some("2"));
    let mut times = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let out = kernel.execute("1+1").await;
        assert_eq!(out.result.as_deref(), Some("2"));
        times.push(t.elapsed());
    }
    times.sort();
    println!("{kind:?}: 1+1 first {rtt:?}, median of 10 {:?}", times[5]);
    kernel.stop().await;
}

async fn interrupt_reaches_the_kernel(kind: Kind) {
    require_root("interrupt test");
    let mut kernel = start_kernel(kind, Limits::default()).await;
    let handle = kernel.launched.handle.clone();
    let started = Instant::now();
    // The interrupt goes once the cell runs: ipykernel ignores SIGINT between cells, and a
    // slow (emulated) kernel may take seconds to start one. The sleep is far past the wait
    // for the cell's end: only the interrupt ends it in time.
    let out = kernel
        .execute_watching(
            "import time\nprint('sleeping', flush=True)\ntime.sleep(600)",
            2 * PATIENCE,
            "sleeping",
            // Half a second on, the cell is in `time.sleep`, not in the print's flush
            // (ipykernel waits there for its IO thread). gVisor's signal waits for
            // `runsc exec`: off the async workers.
            || {
                tokio::task::block_in_place(|| {
                    std::thread::sleep(Duration::from_millis(500));
                    handle.signal(libc::SIGINT)
                })
                .expect("signal")
            },
        )
        .await;
    assert_eq!(out.status, "error", "{out:?}");
    assert_eq!(out.error.as_deref(), Some("KeyboardInterrupt"));
    println!(
        "{kind:?}: the interrupted cell ended {:?} after it was sent",
        started.elapsed()
    );
    let out = kernel.execute("1+1").await;
    assert_eq!(
        out.result.as_deref(),
        Some("2"),
        "the kernel survives the interrupt"
    );
    kernel.stop().await;
}

/// A process that exits by itself reports its code (no signal, no cause), and what it
/// printed reaches the kernel's log.
async fn exit_status_is_reported(kind: Kind) {
    require_root("exit status test");
    let sandbox = sandbox(kind);
    let (report, _dirs, log) = run_python(&*sandbox, "import sys; print('bye'); sys.exit(3)").await;
    assert_eq!(report.code, Some(3), "{report:?}; log:\n{log}");
    assert_eq!(report.signal, None, "{report:?}");
    assert!(log.contains("bye"), "kernel output reaches the log: {log}");
}

/// The sandbox has loopback only: the host's own 127.0.0.1 is another network, no name
/// resolves, and nothing reaches a listener of the host. (No address beyond this machine is
/// tried: the interface list already says there is no way out.)
async fn network_is_loopback_only(kind: Kind) {
    require_root("network test");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("host listener");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let mut kernel = start_kernel(kind, Limits::default()).await;
    let code = format!(
        r#"
import socket, json
r = {{'ifaces': [n for _, n in socket.if_nameindex()]}}
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=30); r['host_tcp'] = 'connected'
except OSError as e:
    r['host_tcp'] = type(e).__name__
try:
    socket.getaddrinfo('example.com', 443); r['dns'] = 'resolved'
except OSError as e:
    r['dns'] = type(e).__name__
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()
c = socket.create_connection(s.getsockname(), timeout=30)
r['loopback'] = 'ok'
print(json.dumps(r))
"#
    );
    let out = kernel.execute(&code).await;
    assert_eq!(out.status, "ok", "{out:?}");
    let r = out.json();
    println!("{kind:?}: {r}");
    assert_eq!(r["ifaces"], json!(["lo"]), "only lo");
    assert_eq!(
        r["host_tcp"], "ConnectionRefusedError",
        "the host's 127.0.0.1 is another network namespace"
    );
    assert_eq!(r["dns"], "gaierror");
    assert_eq!(r["loopback"], "ok", "loopback inside works");
    assert!(
        matches!(listener.accept(), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "nothing reached the host listener"
    );
    kernel.stop().await;
}

/// One test per function above, for one backend.
macro_rules! every_backend {
    ($($backend:ident => $kind:expr),* $(,)?) => {$(
        mod $backend {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_plus_one_round_trips() {
                super::one_plus_one_round_trips($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn interrupt_reaches_the_kernel() {
                super::interrupt_reaches_the_kernel($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn exit_status_is_reported() {
                super::exit_status_is_reported($kind).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn network_is_loopback_only() {
                super::network_is_loopback_only($kind).await
            }
        }
    )*};
}

every_backend! {
    namespaces => Kind::Namespaces,
    gvisor => Kind::Gvisor,
    microvm => Kind::Microvm,
}
