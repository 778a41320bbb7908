//! Human-readable quantities in policy files and settings: sizes (`512MiB`, `1GiB`,
//! `1500000B`) and durations (`300s`, `30m`, `12h`, `1h30m`).
//!
//! Written here rather than taken from a crate so that policies accept exactly one spelling
//! per unit (binary sizes only: a policy saying `1GB` is ambiguous and refused) and errors
//! name the unit that was wrong.

use std::time::Duration;

/// Parses a size: a whole number followed by `B`, `KiB`, `MiB`, `GiB` or `TiB`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit; write e.g. \"512MiB\" or \"1GiB\""))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} does not start with a whole number"))?;
    let factor: u64 = match unit.trim() {
        "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {text:?}; use B, KiB, MiB, GiB or TiB"
            ))
        }
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Parses a duration: one or more `<number><unit>` groups with units `ms`, `s`, `m`, `h`, `d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration; write e.g. \"300s\" or \"30m\"".to_owned());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| format!("{text:?} ends without a unit; write e.g. \"300s\""))?;
        if digits == 0 {
            return Err(format!(
                "{text:?} is not a duration like \"300s\" or \"1h30m\""
            ));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("{text:?} has a number that is too large"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let part = match unit {
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => Duration::from_secs(number.saturating_mul(60)),
            "h" => Duration::from_secs(number.saturating_mul(3600)),
            "d" => Duration::from_secs(number.saturating_mul(86_400)),
            other => {
                return Err(format!(
                    "unknown duration unit {other:?} in {text:?}; use ms, s, m, h or d"
                ))
            }
        };
        total = total.saturating_add(part);
    }
    Ok(total)
}

/// Serde adapter (`#[serde(with = …)]`) for an optional size written as text, read by
/// [`parse_size`].
pub mod serde_size {
    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|t| super::parse_size(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// Parses a size as [`parse_size`] does, or a plain whole number of bytes: for settings that
/// took bytes before they took units (a tenant's `hibernated_storage`). Policies keep
/// refusing a bare number.
pub fn parse_size_or_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().map_err(|_| format!("{text:?} is too large"));
    }
    parse_size(text)
}

/// Serde adapter (`#[serde(with = …)]`) for an optional size written as text or as a whole
/// number of bytes, read by [`parse_size_or_bytes`].
pub mod serde_size_or_bytes {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Bytes(u64),
        Text(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Ok(match Option::<Written>::deserialize(d)? {
            None => None,
            Some(Written::Bytes(bytes)) => Some(bytes),
            Some(Written::Text(text)) => {
                Some(super::parse_size_or_bytes(&text).map_err(serde::de::Error::custom)?)
            }
        })
    }
}

/// Serde adapter (`#[serde(with = …)]`) for an optional duration written as text, read by
/// [`parse_duration`].
pub mod serde_duration {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|t| super::parse_duration(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_or_bytes() {
        assert_eq!(parse_size_or_bytes("1024"), Ok(1024));
        assert_eq!(parse_size_or_bytes(" 2GiB "), Ok(2 << 30));
        assert!(parse_size_or_bytes("1GB").unwrap_err().contains("GiB"));
        assert!(parse_size_or_bytes("").is_err());
        assert!(parse_size_or_bytes("99999999999999999999")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("10B"), Ok(10));
        assert!(parse_size("1GB").unwrap_err().contains("GiB"));
        assert!(parse_size("1024").unwrap_err().contains("no unit"));
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("99999999999TiB")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("300s"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("12h"), Ok(Duration::from_secs(43_200)));
        assert!(parse_duration("5 minutes").is_err());
        assert!(parse_duration("10").unwrap_err().contains("unit"));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("s").is_err());
    }
}
