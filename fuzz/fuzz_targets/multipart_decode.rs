//! ZMQ multiparts from a kernel: `decode_multipart` with a fixed key and with signing
//! disabled, then the re-encodings. Input layout and properties: checks.rs.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "checks.rs"]
mod checks;

fuzz_target!(|data: &[u8]| {
    checks::multipart(data);
});
