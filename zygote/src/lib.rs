//! `libcellgate_zygote.so`: what a kernel zygote's child calls to become a kernel in a
//! sandbox of its own (see `src/sandbox/namespaces/zygote.rs` in the gateway).
//!
//! A library rather than a program because the caller must stay the same process: the
//! kernel is the zygote's child, with the zygote's imported modules in its memory, and an
//! `execve` would throw them away. The code is the gateway's own helper, init and
//! confinement, linked in, so a forked kernel is confined by exactly what confines a cold one.

// `no_mangle` exports a symbol, which the crate-wide `unsafe_code` lint counts; nothing else
// here is unsafe.
#![allow(unsafe_code)]

use std::ffi::{c_char, CString};

/// Builds the sandbox from the plan on standard input (the child's stdio are the helper's
/// pipes). Returns only in the kernel process, confined: a NUL-terminated JSON string
/// `{"argv": [...], "env": {...}}`, owned by the library for the process's life. Every other
/// process (the helper, the init) ends inside, and so does a failure (reported to the
/// gateway first).
#[no_mangle]
pub extern "C" fn cellgate_become_kernel() -> *const c_char {
    // A panic must not unwind into Python's C frames.
    let start = match std::panic::catch_unwind(cellgate::sandbox::become_kernel) {
        Ok(start) => start,
        Err(_) => std::process::abort(),
    };
    match CString::new(start) {
        // Kept for the process's life: Python reads it once, right after the call.
        Ok(start) => start.into_raw(),
        Err(_) => std::process::abort(),
    }
}
