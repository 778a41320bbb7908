//! The kernel connection file: where the kernel binds its five sockets, and its signing key.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The fields of a Jupyter connection file. For `ipc` transport, `ip` is a path prefix and
/// each port is a file-name suffix: the endpoint is `ipc://{ip}-{port}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConnectionInfo {
    pub transport: String,
    pub ip: String,
    pub shell_port: u16,
    pub iopub_port: u16,
    pub stdin_port: u16,
    pub control_port: u16,
    pub hb_port: u16,
    pub key: String,
    pub signature_scheme: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_name: Option<String>,
}

impl ConnectionInfo {
    /// Connection info for ipc sockets named `{prefix}-1` … `{prefix}-5`.
    pub fn ipc(prefix: &Path, key: String, kernel_name: &str) -> ConnectionInfo {
        ConnectionInfo {
            transport: "ipc".to_owned(),
            ip: prefix.display().to_string(),
            shell_port: 1,
            iopub_port: 2,
            stdin_port: 3,
            control_port: 4,
            hb_port: 5,
            key,
            signature_scheme: "hmac-sha256".to_owned(),
            kernel_name: Some(kernel_name.to_owned()),
        }
    }

    fn endpoint(&self, port: u16) -> String {
        match self.transport.as_str() {
            "ipc" => format!("ipc://{}-{}", self.ip, port),
            _ => format!("tcp://{}:{}", self.ip, port),
        }
    }

    pub fn shell_endpoint(&self) -> String {
        self.endpoint(self.shell_port)
    }
    pub fn iopub_endpoint(&self) -> String {
        self.endpoint(self.iopub_port)
    }
    pub fn stdin_endpoint(&self) -> String {
        self.endpoint(self.stdin_port)
    }
    pub fn control_endpoint(&self) -> String {
        self.endpoint(self.control_port)
    }
    pub fn hb_endpoint(&self) -> String {
        self.endpoint(self.hb_port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_endpoints_follow_jupyter_client_naming() {
        let info = ConnectionInfo::ipc(Path::new("/run/k/g1"), "k".into(), "python3");
        assert_eq!(info.shell_endpoint(), "ipc:///run/k/g1-1");
        assert_eq!(info.hb_endpoint(), "ipc:///run/k/g1-5");
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["transport"], "ipc");
        assert_eq!(json["signature_scheme"], "hmac-sha256");
    }
}
