//! The few header fields a relay reads, parsed without copying the header.

use serde::Deserialize;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::ProtocolError;

/// The routing-relevant fields of a message header. Everything else in the header stays in
/// the raw bytes and is forwarded untouched.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeaderFields {
    pub msg_id: String,
    pub msg_type: String,
    pub session: String,
}

#[derive(Deserialize)]
struct RawHeader<'a> {
    #[serde(borrow, default)]
    msg_id: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    msg_type: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    session: Option<std::borrow::Cow<'a, str>>,
}

impl HeaderFields {
    /// Reads a header. `msg_id` and `msg_type` are required; `session` may be absent.
    pub fn parse(bytes: &[u8], part: &'static str) -> Result<HeaderFields, ProtocolError> {
        let raw: RawHeader<'_> =
            serde_json::from_slice(bytes).map_err(|err| ProtocolError::BadJson {
                part,
                reason: err.to_string(),
            })?;
        let msg_id = raw
            .msg_id
            .ok_or(ProtocolError::MissingHeaderField { field: "msg_id" })?;
        let msg_type = raw
            .msg_type
            .ok_or(ProtocolError::MissingHeaderField { field: "msg_type" })?;
        Ok(HeaderFields {
            msg_id: msg_id.into_owned(),
            msg_type: msg_type.into_owned(),
            session: raw.session.map(|s| s.into_owned()).unwrap_or_default(),
        })
    }

    /// Reads a parent header, which is `{}` for unparented messages.
    pub fn parse_parent(bytes: &[u8]) -> Result<Option<HeaderFields>, ProtocolError> {
        let raw: RawHeader<'_> =
            serde_json::from_slice(bytes).map_err(|err| ProtocolError::BadJson {
                part: "parent_header",
                reason: err.to_string(),
            })?;
        Ok(match (raw.msg_id, raw.msg_type) {
            (Some(msg_id), msg_type) => Some(HeaderFields {
                msg_id: msg_id.into_owned(),
                msg_type: msg_type.map(|t| t.into_owned()).unwrap_or_default(),
                session: raw.session.map(|s| s.into_owned()).unwrap_or_default(),
            }),
            (None, _) => None,
        })
    }
}

/// A header for a message the gateway itself originates (nudges, interrupts, synthesised
/// statuses). Dates are ISO 8601 with microseconds and `Z`, as jupyter_client writes them.
pub fn new_header(msg_type: &str, session: &str) -> (String, Vec<u8>) {
    let msg_id = uuid::Uuid::new_v4().simple().to_string();
    let date = OffsetDateTime::now_utc()
        .format(&Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_owned());
    let header = serde_json::json!({
        "msg_id": msg_id,
        "msg_type": msg_type,
        "username": "cellgate",
        "session": session,
        "date": date,
        "version": "5.4",
    });
    (msg_id, header.to_string().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_required_fields_and_keeps_escapes_decoded() {
        let h = HeaderFields::parse(
            br#"{"msg_id":"a\u0062c","msg_type":"execute_request","session":"s","subshell_id":null}"#,
            "header",
        )
        .unwrap();
        assert_eq!(h.msg_id, "abc");
        assert_eq!(h.msg_type, "execute_request");
        assert_eq!(h.session, "s");
    }

    #[test]
    fn missing_fields_are_errors() {
        assert_eq!(
            HeaderFields::parse(br#"{"msg_type":"x"}"#, "header"),
            Err(ProtocolError::MissingHeaderField { field: "msg_id" })
        );
        assert!(matches!(
            HeaderFields::parse(b"[1,2]", "header"),
            Err(ProtocolError::BadJson { .. })
        ));
    }

    #[test]
    fn empty_parent_is_none() {
        assert_eq!(HeaderFields::parse_parent(b"{}").unwrap(), None);
        let p = HeaderFields::parse_parent(br#"{"msg_id":"m","msg_type":"t"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(p.msg_id, "m");
    }

    #[test]
    fn new_header_is_valid_json_with_a_date() {
        let (id, bytes) = new_header("kernel_info_request", "sess");
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["msg_id"], id);
        assert!(v["date"].as_str().unwrap().ends_with('Z'));
    }
}
