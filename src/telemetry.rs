//! Logging: `tracing` to stderr, human-readable or JSON lines, filtered by `RUST_LOG`.
//! Spans and events carry `kernel_id`, `session_id` and `msg_id` fields where they apply.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `json` selects JSON lines for log shippers.
pub fn init(json: bool) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,zeromq=error"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    // A subscriber installed earlier (tests) stays in place.
    let _ = result;
}
