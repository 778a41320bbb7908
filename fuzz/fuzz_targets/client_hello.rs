//! A CONNECT tunnel's first bytes: `egress::client_hello::parse`, and that every prefix of an
//! accepted hello decides the same. Properties: checks.rs.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "checks.rs"]
mod checks;

fuzz_target!(|data: &[u8]| {
    checks::client_hello(data);
});
