//! cellgate's guest agent, as a library: the protocol the gateway's microvm backend speaks
//! with the agent, and the workspace file operations both sides use. The agent itself is the
//! `cellgate-agent` binary (src/main.rs).

pub mod fault;
pub mod protocol;
pub mod workspace;
