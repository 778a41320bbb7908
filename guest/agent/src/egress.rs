//! The guest's only way out: a TCP port on the guest's loopback (the address the kernel's
//! `HTTP_PROXY` names) whose every connection becomes a yamux stream to the gateway, which
//! joins it to the egress proxy. The guest has no network interface but loopback, so what
//! the proxy and its policy refuse cannot be reached any other way.

#![expect(
    clippy::disallowed_types,
    reason = "the guest agent keeps its dependencies few (no parking_lot in the VM); its std locks are never held across an await (await_holding_lock checks)"
)]

use std::sync::{Arc, Mutex};

use cellgate_agent::protocol::{write_json, Open};

/// Where the port listens: the address every backend gives the kernel as its proxy.
pub const LISTEN: &str = "127.0.0.1:3128";
/// Connections carried at once; the proxy has its own, lower per-session cap.
const MAX_CONNECTIONS: usize = 64;

/// Opens streams to the gateway while a session is up.
#[derive(Default)]
pub struct Opener {
    control: Mutex<Option<tokio_yamux::Control>>,
}

impl Opener {
    pub fn set(&self, control: Option<tokio_yamux::Control>) {
        *self.control.lock().unwrap_or_else(|e| e.into_inner()) = control;
    }

    fn get(&self) -> Option<tokio_yamux::Control> {
        self.control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Listens on [`LISTEN`] and carries each connection to the gateway.
pub fn listen(opener: Arc<Opener>) -> std::io::Result<()> {
    let std_listener = std::net::TcpListener::bind(LISTEN)?;
    std_listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(std_listener)?;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue; // dropped: the client sees its connection closed
            };
            let Some(mut control) = opener.get() else {
                continue;
            };
            tokio::spawn(async move {
                let _slot = slot;
                let Ok(mut stream) = control.open_stream().await else {
                    return;
                };
                if write_json(&mut stream, &Open::Egress).await.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut tcp, &mut stream).await;
                }
            });
        }
    });
    Ok(())
}

/// Brings the loopback interface up: a fresh guest has it down, and ipykernel and the
/// egress port both need it.
#[allow(unsafe_code)]
pub fn loopback_up() -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
    // SAFETY: `ifreq` is plain data (all-zero is a valid value); the name fits with its NUL;
    // both ioctls read and write only the struct they are given, which outlives them.
    unsafe {
        let mut request: libc::ifreq = std::mem::zeroed();
        for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo\0") {
            *slot = *byte as libc::c_char;
        }
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        request.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &request) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
