//! `ErrorCode`: every machine `code` an error response can carry (the body's `code` and the
//! `X-Cellgate-Error-Code` header), as one enum. Clients branch on these strings, so they are
//! part of the API: a variant's wire name never changes, and the OpenAPI document lists them
//! all as the `ErrorCode` schema's `enum`, derived from this same list.

/// Declares [`ErrorCode`] from one list of `Variant = "wire_name"`, so that the variants,
/// their names on the wire (serde's and [`ErrorCode::as_str`]'s) and [`ErrorCode::ALL`]
/// cannot disagree.
macro_rules! error_codes {
    ($($variant:ident = $wire:literal,)*) => {
        /// A stable machine code of an error response (what clients branch on).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        pub enum ErrorCode {
            $(
                #[serde(rename = $wire)]
                $variant,
            )*
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as it goes on the wire.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $wire,)*
                }
            }
        }
    };
}

error_codes! {
    // The default of each status, when no more specific code applies.
    BadRequest = "bad_request",
    Unauthorized = "unauthorized",
    Forbidden = "forbidden",
    NotFound = "not_found",
    MethodNotAllowed = "method_not_allowed",
    NotAcceptable = "not_acceptable",
    Conflict = "conflict",
    TooLarge = "too_large",
    UnsupportedMediaType = "unsupported_media_type",
    Invalid = "invalid",
    RateLimited = "rate_limited",
    QuotaExceeded = "quota_exceeded",
    Unavailable = "unavailable",
    Timeout = "timeout",
    Internal = "internal",
    Error = "error",
    // Credentials and the edge.
    MissingToken = "missing_token",
    InvalidToken = "invalid_token",
    HostRefused = "host_refused",
    OriginRefused = "origin_refused",
    CrossOrigin = "cross_origin",
    BadHost = "bad_host",
    NotJson = "not_json",
    InvalidJson = "invalid_json",
    NotAWebsocket = "not_a_websocket",
    NoSuchRoute = "no_such_route",
    // Kernels.
    NoSuchKernel = "no_such_kernel",
    NoSuchKernelspec = "no_such_kernelspec",
    BadEnv = "bad_env",
    BackendUnavailable = "backend_unavailable",
    UnknownPolicy = "unknown_policy",
    KernelLimit = "kernel_limit",
    TenantKernelLimit = "tenant_kernel_limit",
    KernelNotReady = "kernel_not_ready",
    RestoreDeferred = "restore_deferred",
    KernelDead = "kernel_dead",
    KernelBusy = "kernel_busy",
    SandboxStartFailed = "sandbox_start_failed",
    KernelUnsupported = "kernel_unsupported",
    PodPending = "pod_pending",
    PodFailed = "pod_failed",
    // Gateway replicas.
    KernelMoving = "kernel_moving",
    KubernetesUnavailable = "kubernetes_unavailable",
    ReplicaUnreachable = "replica_unreachable",
    // Sessions and executions.
    NoSuchSession = "no_such_session",
    NoSuchExecution = "no_such_execution",
    PolicyNotAllowed = "policy_not_allowed",
    EnvNotAllowed = "env_not_allowed",
    InvalidEnv = "invalid_env",
    CommandsUnsupported = "commands_unsupported",
    NoInputAwaited = "no_input_awaited",
    NoResult = "no_result",
    // Workspace files.
    BadPath = "bad_path",
    NoSuchFile = "no_such_file",
    NotAFile = "not_a_file",
    IsADirectory = "is_a_directory",
    WorkspaceFull = "workspace_full",
    Exists = "exists",
    PermissionDenied = "permission_denied",
    NotEmpty = "not_empty",
    WorkspaceUnavailable = "workspace_unavailable",
    // Artifacts and their signed links.
    NoSuchArtifact = "no_such_artifact",
    MalformedLink = "malformed_link",
    LinkExpired = "link_expired",
    LinkTooLong = "link_too_long",
    BadTtl = "bad_ttl",
    LinksOff = "links_off",
    // MCP.
    NoSuchMcpSession = "no_such_mcp_session",
    TenantMcpSessionLimit = "tenant_mcp_session_limit",
    McpSessionLimit = "mcp_session_limit",
}

impl ErrorCode {
    /// The code whose wire name is `wire`, if there is one.
    pub fn from_wire(wire: &str) -> Option<ErrorCode> {
        ErrorCode::ALL
            .iter()
            .copied()
            .find(|code| code.as_str() == wire)
    }
}

// By hand, from `ALL`: utoipa's derive does not see a variant's `rename` written through
// the macro above, and would list the Rust names.
impl utoipa::PartialSchema for ErrorCode {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .description(Some(
                "What went wrong, for a program: stable across releases (also in the \
                 `X-Cellgate-Error-Code` header).",
            ))
            .enum_values(Some(ErrorCode::ALL.iter().map(|code| code.as_str())))
            .into()
    }
}

impl utoipa::ToSchema for ErrorCode {}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorCode;

    #[test]
    fn every_code_round_trips_through_serde_under_its_wire_name() {
        for &code in ErrorCode::ALL {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, serde_json::json!(code.as_str()), "{code:?}");
            let back: ErrorCode = serde_json::from_value(json).unwrap();
            assert_eq!(back, code);
            assert_eq!(ErrorCode::from_wire(code.as_str()), Some(code));
        }
        assert_eq!(ErrorCode::from_wire("no_such_thing"), None);
    }

    #[test]
    fn wire_names_are_distinct_snake_case_header_values() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            let wire = code.as_str();
            assert!(seen.insert(wire), "{wire} twice");
            assert!(
                !wire.is_empty()
                    && wire
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{wire}"
            );
            // `HeaderValue::from_static` panics on a value that is not a valid header.
            axum::http::HeaderValue::from_static(wire);
        }
    }
}
