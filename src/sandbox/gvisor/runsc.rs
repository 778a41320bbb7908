//! runsc's command line for one container, as the gateway uses it after the launch.
//!
//! `kill`, `exec` (the signalling program) and `delete` are short commands that the handle
//! and the exit watcher run to completion: blocking, with the environment cleared, and
//! bounded by the configured timeout so a stuck runsc cannot hold a kernel's shutdown
//! forever. A failure carries runsc's stderr, which is the only account of what went wrong.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// How to reach one container through runsc's command line.
#[derive(Clone)]
pub(super) struct Runsc {
    pub(super) program: PathBuf,
    pub(super) global: Vec<String>,
    pub(super) id: String,
    pub(super) timeout: Duration,
}

impl Runsc {
    /// Runs `runsc <global> <args…> <id> [tail…]` to completion (blocking, bounded).
    pub(super) fn run(&self, args: &[&str], tail: &[&str]) -> io::Result<()> {
        let mut child = std::process::Command::new(&self.program)
            .args(&self.global)
            .args(args)
            .arg(&self.id)
            .args(tail)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                if status.success() {
                    return Ok(());
                }
                let mut stderr = String::new();
                if let Some(mut pipe) = child.stderr.take() {
                    use std::io::Read;
                    let _ = pipe.read_to_string(&mut stderr);
                }
                return Err(io::Error::other(format!(
                    "runsc {} failed ({status}): {}",
                    args.join(" "),
                    stderr.trim()
                )));
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other(format!(
                    "runsc {} did not finish within {:?}",
                    args.join(" "),
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
