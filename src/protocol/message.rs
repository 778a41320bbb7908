//! One Jupyter message in relay form: the channel, the routing fields, and the raw parts.

use bytes::Bytes;

use serde::de::IgnoredAny;

use super::{Channel, HeaderFields, ProtocolError};

/// Checks that a part is UTF-8 text holding exactly one JSON object.
pub(crate) fn check_object(part: &[u8], name: &'static str) -> Result<(), ProtocolError> {
    // serde_json does not check the UTF-8 of strings it skips, so check the whole part first.
    let text = std::str::from_utf8(part).map_err(|_| ProtocolError::NotUtf8)?;
    if !text.trim_start().starts_with('{') {
        return Err(ProtocolError::BadJson {
            part: name,
            reason: "expected an object".to_owned(),
        });
    }
    serde_json::from_str::<IgnoredAny>(text).map_err(|err| ProtocolError::BadJson {
        part: name,
        reason: err.to_string(),
    })?;
    Ok(())
}

/// A message between a client and a kernel. The four JSON parts are the sender's exact bytes;
/// `header` and `parent` are parsed copies of the fields routing needs.
#[derive(Debug, Clone)]
pub struct Message {
    pub channel: Channel,
    pub header: HeaderFields,
    pub parent: Option<HeaderFields>,
    pub header_bytes: Bytes,
    pub parent_header_bytes: Bytes,
    pub metadata: Bytes,
    pub content: Bytes,
    pub buffers: Vec<Bytes>,
}

impl Message {
    /// Builds a message from raw parts, parsing the header and parent header. Every one of the
    /// four parts must be a UTF-8 JSON object: a message that is not is refused here, at the
    /// edge, so no client is ever sent a part it cannot parse, and a broken reply never
    /// takes the routing entry of the valid one that may follow.
    pub fn from_parts(
        channel: Channel,
        header_bytes: Bytes,
        parent_header_bytes: Bytes,
        metadata: Bytes,
        content: Bytes,
        buffers: Vec<Bytes>,
    ) -> Result<Message, ProtocolError> {
        check_object(&header_bytes, "header")?;
        check_object(&parent_header_bytes, "parent_header")?;
        check_object(&metadata, "metadata")?;
        check_object(&content, "content")?;
        let header = HeaderFields::parse(&header_bytes, "header")?;
        let parent = HeaderFields::parse_parent(&parent_header_bytes)?;
        Ok(Message {
            channel,
            header,
            parent,
            header_bytes,
            parent_header_bytes,
            metadata,
            content,
            buffers,
        })
    }

    /// A message the gateway originates, with content given as JSON.
    pub fn new(
        channel: Channel,
        msg_type: &str,
        session: &str,
        parent: Option<&Message>,
        content: &serde_json::Value,
    ) -> Message {
        let (msg_id, header_bytes) = super::new_header(msg_type, session);
        let (parent_fields, parent_bytes) = match parent {
            Some(p) => (Some(p.header.clone()), p.header_bytes.clone()),
            None => (None, Bytes::from_static(b"{}")),
        };
        Message {
            channel,
            header: HeaderFields {
                msg_id,
                msg_type: msg_type.to_owned(),
                session: session.to_owned(),
            },
            parent: parent_fields,
            header_bytes: Bytes::from(header_bytes),
            parent_header_bytes: parent_bytes,
            metadata: Bytes::from_static(b"{}"),
            content: Bytes::from(content.to_string()),
            buffers: Vec::new(),
        }
    }

    /// A message of the same channel, type, session and parent with new content: how the
    /// gateway substitutes its own outcome for a kernel's (a timeout for a KeyboardInterrupt).
    pub fn with_content(
        &self,
        content: &serde_json::Value,
        metadata: &serde_json::Value,
    ) -> Message {
        let (msg_id, header_bytes) = super::new_header(self.msg_type(), &self.header.session);
        Message {
            channel: self.channel,
            header: HeaderFields {
                msg_id,
                msg_type: self.header.msg_type.clone(),
                session: self.header.session.clone(),
            },
            parent: self.parent.clone(),
            header_bytes: Bytes::from(header_bytes),
            parent_header_bytes: self.parent_header_bytes.clone(),
            metadata: Bytes::from(metadata.to_string()),
            content: Bytes::from(content.to_string()),
            buffers: Vec::new(),
        }
    }

    /// A message answering `request` (its header becomes the parent), made by the gateway.
    pub fn answering(
        request_header: &HeaderFields,
        request_header_bytes: &Bytes,
        channel: Channel,
        msg_type: &str,
        content: &serde_json::Value,
        metadata: &serde_json::Value,
    ) -> Message {
        let (msg_id, header_bytes) = super::new_header(msg_type, &request_header.session);
        Message {
            channel,
            header: HeaderFields {
                msg_id,
                msg_type: msg_type.to_owned(),
                session: request_header.session.clone(),
            },
            parent: Some(request_header.clone()),
            header_bytes: Bytes::from(header_bytes),
            parent_header_bytes: request_header_bytes.clone(),
            metadata: Bytes::from(metadata.to_string()),
            content: Bytes::from(content.to_string()),
            buffers: Vec::new(),
        }
    }

    pub fn msg_type(&self) -> &str {
        &self.header.msg_type
    }

    pub fn msg_id(&self) -> &str {
        &self.header.msg_id
    }

    pub fn parent_msg_id(&self) -> Option<&str> {
        self.parent.as_ref().map(|p| p.msg_id.as_str())
    }

    /// Size of the message's payload, for buffer accounting.
    pub fn byte_len(&self) -> usize {
        self.header_bytes.len()
            + self.parent_header_bytes.len()
            + self.metadata.len()
            + self.content.len()
            + self.buffers.iter().map(Bytes::len).sum::<usize>()
    }

    /// Parses the content as JSON, for the few places that interpret it.
    pub fn content_json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.content).ok()
    }
}
