//! What the gateway tells its operator: logs (`tracing` to stderr, human-readable or JSON
//! lines, colour only on a terminal, filtered by `RUST_LOG`; spans and events carry
//! `kernel_id`, `session_id`, `msg_id` and a request's `request_id` where they apply) and
//! Prometheus metrics ([`metrics`]).

pub mod metrics;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `json` selects JSON lines for log shippers.
pub fn init(json: bool) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,zeromq=error"));
    // Colours only for a person at a terminal: a file, a pipe or journald gets plain text
    // (and NO_COLOR is honoured, as https://no-color.org asks).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let result = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    // A subscriber installed earlier (tests) stays in place.
    let _ = result;
}
