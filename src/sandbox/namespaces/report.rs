//! How the sandbox's own processes tell the gateway what happened: events written to the
//! helper's stdout (the init and a zygote inherit it), and a failed step labelled with its
//! stage for [`Event::Failed`]. Shared by the helper, the init and the zygote, so none of
//! them reaches into another for it.

use std::io::{self, Write};

use super::plan::Event;

/// Writes one event to the gateway. Losing the channel means the gateway is gone, and the
/// parent-death signal is about to end us; nothing useful can be done about a failure.
pub fn report(event: &Event) {
    let mut out = io::stdout().lock();
    let _ = out.write_all(event.to_line().as_bytes());
    let _ = out.flush();
}

/// A failed step, for [`Event::Failed`].
pub struct Failure {
    pub stage: &'static str,
    pub error: String,
}

/// `map_err` helper: labels an error with the step that failed.
pub fn at<E: std::fmt::Display>(stage: &'static str) -> impl FnOnce(E) -> Failure {
    move |err| Failure {
        stage,
        error: err.to_string(),
    }
}
