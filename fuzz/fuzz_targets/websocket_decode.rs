//! WebSocket frames from a client: `decode_v1`, `decode_legacy_binary`, `decode_legacy_text`,
//! and both encodings of whatever decodes. Properties: checks.rs.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "checks.rs"]
mod checks;

fuzz_target!(|data: &[u8]| {
    checks::websocket(data);
});
