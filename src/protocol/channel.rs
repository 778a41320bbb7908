//! The five Jupyter channels.

use std::fmt;

use super::ProtocolError;

/// Which kernel socket a message travels on. Names are the protocol's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    Shell,
    Control,
    Stdin,
    Iopub,
    Heartbeat,
}

impl Channel {
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Shell => "shell",
            Channel::Control => "control",
            Channel::Stdin => "stdin",
            Channel::Iopub => "iopub",
            Channel::Heartbeat => "hb",
        }
    }

    pub fn parse(name: &str) -> Result<Channel, ProtocolError> {
        match name {
            "shell" => Ok(Channel::Shell),
            "control" => Ok(Channel::Control),
            "stdin" => Ok(Channel::Stdin),
            "iopub" => Ok(Channel::Iopub),
            "hb" => Ok(Channel::Heartbeat),
            other => Err(ProtocolError::UnknownChannel(
                other.chars().take(32).collect(),
            )),
        }
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
