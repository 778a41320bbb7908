//! The guest agent: pid 1 of a session's microVM.
//!
//! It makes the guest's file system ([`boot`]), waits for the gateway on the transport the
//! kernel command line names ([`transport`]), and serves one agent session at a time over it
//! ([`session`]): it starts ipykernel when asked ([`kernel`]), bridges the kernel's channels
//! and the guest's egress port ([`egress`]) to yamux streams, and reports how the kernel ended.
//!
//! Off pid 1 (`cellgate-agent --listen-unix PATH`), it skips [`boot`] and serves on a unix
//! socket instead: the gateway's tests drive the same session code against a real ipykernel
//! without a VM.

mod boot;
mod egress;
mod files;
mod kernel;
mod session;
mod transport;

use std::sync::Arc;

/// The agent's settings, from the kernel command line (`cellgate.*=`) on pid 1, from
/// arguments otherwise.
#[derive(Debug, Clone)]
pub struct Settings {
    pub transport: transport::Kind,
    /// Whether the agent is the guest's init (and so mounts, reaps and powers off).
    pub init: bool,
}

fn main() {
    let init = rustix::process::getpid().is_init();
    let settings = match if init {
        boot::settings_from_cmdline()
    } else {
        settings_from_args()
    } {
        Ok(settings) => settings,
        Err(message) => fatal(init, &message),
    };
    if init {
        if let Err(error) = boot::boot() {
            fatal(init, &format!("boot failed: {error}"));
        }
    }
    // Two workers: the guest has one or two vCPUs, and a blocked worker (a slow serial write
    // under emulation) must not stall the control stream.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => fatal(init, &format!("no async runtime: {error}")),
    };
    let result = runtime.block_on(serve(settings.clone()));
    if let Err(error) = result {
        fatal(init, &format!("{error}"));
    }
}

async fn serve(settings: Settings) -> std::io::Result<()> {
    let kernel = Arc::new(kernel::Kernel::new(settings.init));
    kernel.clone().reap_children()?;
    let opener = Arc::new(egress::Opener::default());
    // Off pid 1 the agent shares the host's loopback, where the port is not its to take.
    if settings.init {
        egress::listen(opener.clone())?;
    }
    let mut transport = transport::Transport::open(&settings.transport).await?;
    loop {
        let stream = transport.accept().await?;
        let served = session::serve(stream, kernel.clone(), opener.clone(), settings.init);
        if let Err(error) = served.await {
            eprintln!("cellgate-agent: session ended: {error}");
        }
    }
}

fn settings_from_args() -> Result<Settings, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, path] if flag == "--listen-unix" => Ok(Settings {
            transport: transport::Kind::Unix(path.into()),
            init: false,
        }),
        _ => Err(
            "usage: cellgate-agent --listen-unix PATH (as pid 1 it reads the kernel command line)"
                .to_owned(),
        ),
    }
}

/// Reports a fatal error and ends: on pid 1 by powering the VM off (an init that exits
/// panics the guest kernel, which says less), elsewhere by exiting.
fn fatal(init: bool, message: &str) -> ! {
    eprintln!("cellgate-agent: fatal: {message}");
    if init {
        boot::poweroff();
    }
    std::process::exit(1);
}
