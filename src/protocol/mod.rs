//! The Jupyter messaging protocol, as bytes: the ZMQ multipart codec with HMAC signing, the
//! connection file, and the two WebSocket framings clients use.
//!
//! This module is a relay's view of the protocol. Messages keep their four JSON parts as the
//! exact bytes the sender produced (`header`, `parent_header`, `metadata`, `content`), and
//! only the header fields routing needs are parsed. Content is never re-serialised, so unknown
//! fields, number formats and key order survive end to end, and what we sign is exactly what
//! we send. The runtimed crates (`jupyter-protocol`, `jupyter-zmq-client`) parse every message
//! into typed content and re-serialise it, which drops fields a proxy must keep
//! (`supported_features`, `subshell_id`) and rewrites `header.session`; see
//! ../shared/research/gateway-contract.md section 4.
//!
//! Must not depend on: kernels, sandboxes, sessions, HTTP.

mod channel;
mod connection_file;
mod error;
mod header;
pub(crate) mod message;
mod signing;
pub mod websocket;
mod wire;

pub use channel::Channel;
pub use connection_file::ConnectionInfo;
pub use error::ProtocolError;
pub use header::{new_header, HeaderFields};
pub use message::Message;
pub use signing::Signer;
pub use wire::{decode_multipart, encode_multipart, DELIMITER, PARALLEL_CHECK_BYTES};
