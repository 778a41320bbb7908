//! Timestamps as the gateway writes them on every surface: the Kernel Gateway API's
//! `last_activity`, the execution times in a kernel's history (and so in exported
//! notebooks), and API v1's sessions, executions and artifacts. One format, so a client
//! parses all of them the same way: six fractional digits and `Z`, as GatewayClient parses
//! it.
//!
//! Depends on nothing else in the crate.

use time::OffsetDateTime;

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ`, always six digits: GatewayClient parses `last_activity` with
/// `strptime("%Y-%m-%dT%H:%M:%S.%fZ")`.
pub fn format_timestamp(at: OffsetDateTime) -> String {
    // The fields are read in UTC whatever offset `at` carries (an RFC 3339 instant a
    // client sent with `+02:00` names the same instant as its UTC spelling).
    let at = at.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.microsecond()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_always_have_six_digits_and_z() {
        let at = OffsetDateTime::from_unix_timestamp(1_700_000_000).unwrap();
        assert_eq!(format_timestamp(at), "2023-11-14T22:13:20.000000Z");
        let at = at + time::Duration::microseconds(42);
        assert_eq!(format_timestamp(at), "2023-11-14T22:13:20.000042Z");
        // Another offset: the same instant, written in UTC.
        let east = at.to_offset(time::UtcOffset::from_hms(2, 0, 0).unwrap());
        assert_eq!(format_timestamp(east), "2023-11-14T22:13:20.000042Z");
    }
}
