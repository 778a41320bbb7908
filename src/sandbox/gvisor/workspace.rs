//! The size-limited workspace: a host tmpfs that only `runsc run` and its children see.
//!
//! The gofer must serve the kernel's files from the host (a tmpfs of the Sentry would keep
//! them out of the gateway's reach), yet a host directory with no limit let an attack test
//! write 45 GB. So `runsc run` starts in a mount namespace of its own, made in its child
//! before exec, with a tmpfs of the policy's size mounted over the workspace directory: the
//! host's directory stays empty, nothing shows in the host's mount table, and the mount
//! lives exactly as long as the sandbox's processes. The gateway reaches the files through
//! `/proc/<runsc pid>/root` (see [`super::handle`]).

use std::io;
use std::path::Path;

use super::error::setup;
use crate::sandbox::sys;
use crate::sandbox::SandboxError;

/// The size-limited workspace of one sandbox: a tmpfs mounted over the workspace directory
/// in a mount namespace made for `runsc run` alone, in its child before exec.
pub(super) struct WorkspaceMount {
    target: std::ffi::CString,
    options: std::ffi::CString,
}

impl WorkspaceMount {
    pub(super) fn new(
        workspace: &Path,
        bytes: u64,
        uid: u32,
        gid: u32,
    ) -> Result<WorkspaceMount, SandboxError> {
        use std::os::unix::ffi::OsStrExt;
        let target = std::ffi::CString::new(workspace.as_os_str().as_bytes()).map_err(|_| {
            setup(format!(
                "the workspace path {} has a NUL",
                workspace.display()
            ))
        })?;
        let options = std::ffi::CString::new(format!("size={bytes},mode=0700,uid={uid},gid={gid}"))
            .map_err(|_| setup("tmpfs options with a NUL"))?;
        Ok(WorkspaceMount { target, options })
    }

    /// Runs in the forked child: only system calls, no allocation.
    pub(super) fn apply(&self) -> io::Result<()> {
        sys::unshare(libc::CLONE_NEWNS)?;
        // Nothing mounted from here on may propagate back to the host's namespace.
        sys::mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)?;
        sys::mount(
            Some(c"cellgate-workspace"),
            &self.target,
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV,
            Some(&self.options),
        )
    }
}
