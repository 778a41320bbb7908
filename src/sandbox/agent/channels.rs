//! The gateway's side of the kernel's five channels: a unix socket at each ipc path of the
//! kernel's connection info, whose every connection becomes a channel stream to the agent.
//! The gateway's kernel client connects here exactly as it connects to a kernel's own
//! sockets under the other backends; the bytes (ZMTP) pass through unread.

use std::sync::Arc;

use cellgate_agent::protocol::Channel;

use super::session::Agent;
use crate::protocol::ConnectionInfo;

/// Binds the five sockets and serves them until the agent session ends.
pub fn serve(connection: &ConnectionInfo, agent: Arc<Agent>) -> std::io::Result<()> {
    if connection.transport != "ipc" {
        return Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            format!(
                "transport {:?}: agent kernels use ipc",
                connection.transport
            ),
        ));
    }
    let ports = [
        (Channel::Shell, connection.shell_port),
        (Channel::Iopub, connection.iopub_port),
        (Channel::Stdin, connection.stdin_port),
        (Channel::Control, connection.control_port),
        (Channel::Hb, connection.hb_port),
    ];
    let mut listeners = Vec::with_capacity(ports.len());
    for (channel, port) in ports {
        let path = format!("{}-{port}", connection.ip);
        let _ = std::fs::remove_file(&path);
        listeners.push((channel, tokio::net::UnixListener::bind(&path)?));
    }
    for (channel, listener) in listeners {
        let agent = agent.clone();
        let mut closed = agent.closed();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    _ = closed.wait_for(Option::is_some) => return,
                };
                let Ok((mut socket, _)) = accepted else {
                    continue;
                };
                let agent = agent.clone();
                tokio::spawn(async move {
                    match agent.open_channel(channel).await {
                        Ok(mut stream) => {
                            let _ = tokio::io::copy_bidirectional(&mut socket, &mut stream).await;
                        }
                        Err(error) => tracing::debug!(%error, ?channel, "agent: channel stream"),
                    }
                });
            }
        });
    }
    Ok(())
}
