//! The guest agent: pid 1 of a session's microVM.
//!
//! It makes the guest's file system ([`boot`]), waits for the gateway on the transport the
//! kernel command line names ([`transport`]), and serves one agent session at a time over it
//! ([`session`]): it starts ipykernel when asked ([`kernel`]), bridges the kernel's channels
//! and the guest's egress port ([`egress`]) to yamux streams, and reports how the kernel ended.
//!
//! With arguments it is not the guest's init, whatever its pid, and skips [`boot`]:
//! - `cellgate-agent --listen-unix PATH` serves on a unix socket: the gateway's tests drive
//!   the same session code against a real ipykernel without a VM;
//! - `cellgate-agent --listen-tcp ADDR --key-file PATH` is a Kubernetes kernel pod's
//!   entrypoint (often its pid 1): it serves gateways that prove the key on TCP, gives the
//!   kernel the egress port on the pod's loopback (the pod's only way out is the gateway's
//!   proxy, through the agent link), reads the container's cgroup for the kernel's usage and
//!   out-of-memory kills, and ends the kernel on SIGTERM (pod deletion).

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
    /// A kernel pod's agent (see the module's doc).
    pub pod: bool,
}

fn main() {
    // A VM's init has no arguments; a container's pid 1 (a kernel pod's agent) has some.
    let init = rustix::process::getpid().is_init() && std::env::args_os().len() == 1;
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
    let mut kernel = kernel::Kernel::new(settings.init);
    if settings.pod {
        kernel = kernel.observing_container_cgroup();
    }
    let kernel = Arc::new(kernel);
    kernel.clone().reap_children()?;
    if settings.pod {
        end_on_sigterm(kernel.clone())?;
    }
    let opener = Arc::new(egress::Opener::default());
    // Under --listen-unix the agent shares the host's loopback, where the port is not its to
    // take; a VM and a pod have loopbacks of their own.
    if settings.init || settings.pod {
        egress::listen(opener.clone())?;
    }
    let mut transport = transport::Transport::open(&settings.transport).await?;
    let mut next = transport.accept().await?;
    loop {
        let served = session::serve(next, kernel.clone(), opener.clone(), settings.init);
        let mut served = std::pin::pin!(served);
        let newer = tokio::select! {
            ended = &mut served => {
                if let Err(error) = ended {
                    eprintln!("cellgate-agent: session ended: {error}");
                }
                None
            }
            newer = transport.accept(), if transport.supersedes() => Some(newer?),
        };
        next = match newer {
            Some(newer) => {
                eprintln!("cellgate-agent: a newer gateway session replaces the current one");
                newer
            }
            None => transport.accept().await?,
        };
    }
}

/// A pod's agent ends its kernel and itself on SIGTERM (the pod is being deleted), rather
/// than leave the kernel to the container runtime's SIGKILL after the grace period.
fn end_on_sigterm(kernel: Arc<kernel::Kernel>) -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::spawn(async move {
        term.recv().await;
        let _ = kernel.kill();
        std::process::exit(0);
    });
    Ok(())
}

fn settings_from_args() -> Result<Settings, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, path] if flag == "--listen-unix" => Ok(Settings {
            transport: transport::Kind::Unix(path.into()),
            init: false,
            pod: false,
        }),
        [listen_flag, listen, key_flag, key_file]
            if listen_flag == "--listen-tcp" && key_flag == "--key-file" =>
        {
            let listen = listen
                .parse()
                .map_err(|e| format!("--listen-tcp {listen}: {e}"))?;
            Ok(Settings {
                transport: transport::Kind::Tcp {
                    listen,
                    key_file: key_file.into(),
                },
                init: false,
                pod: true,
            })
        }
        _ => Err(
            "usage: cellgate-agent --listen-unix PATH | --listen-tcp ADDR --key-file PATH \
             (as a VM's init it reads the kernel command line)"
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
