//! The first flight of a `CONNECT` tunnel: the client's TLS ClientHello, read for the server
//! name it asks for.
//!
//! Allowing `CONNECT cdn-hosted.example:443` must not open every other site the same CDN
//! serves: the CDN routes on the TLS server name (SNI), which the client chooses after the
//! proxy said yes. So the proxy reads the ClientHello before it forwards a single byte and
//! compares its server name with the host it approved ([`super::proxy`] decides; this module
//! only reads).
//!
//! Hand-written rather than a TLS library: all we need is the `server_name` extension and
//! whether `encrypted_client_hello` is present, from bytes that must then go upstream
//! untouched. A TLS library parses a ClientHello only as the server end of a handshake it
//! means to finish (certificates, keys), which would end TLS at the proxy instead of at the
//! destination. The parser is strict where a lenient one would be a bypass: anything a
//! server could read differently from us (two `server_name` extensions, two host names,
//! bytes after the message, other records in the middle of it) is refused, not guessed at.
//! Records are reassembled across reads, bounded to [`MAX_HELLO_LEN`] (32 KiB) and
//! [`READ_TIMEOUT`] (5 s).

use std::collections::HashSet;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

/// Largest ClientHello handshake message accepted. Real ones are 0.5–2 KiB (a post-quantum
/// key share and GREASE included); 32 KiB leaves room for anything legitimate.
pub const MAX_HELLO_LEN: usize = 32 * 1024;
/// Largest number of bytes buffered while waiting for the whole ClientHello: the message plus
/// the headers of the records it is cut into. A client that fragments it more finely than
/// this allows is refused rather than buffered.
pub const MAX_BUFFERED: usize = 2 * MAX_HELLO_LEN;
/// How long a client may take to send its whole ClientHello once the tunnel is open; clients
/// send it at once, and a tunnel that stays silent is not carrying TLS.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// TLS record content type of handshake messages.
const RECORD_HANDSHAKE: u8 = 22;
/// Largest TLS plaintext record fragment (RFC 8446, 5.1).
const MAX_RECORD_LEN: usize = 1 << 14;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
/// `encrypted_client_hello` (RFC 9849 / draft-ietf-tls-esni): the real server name is in the
/// encrypted inner hello, the outer one names the CDN's public name.
const EXT_ECH: u16 = 0xfe0d;
/// The older encrypted SNI draft's extension, which hides the name the same way.
const EXT_ESNI_DRAFT: u16 = 0xffce;
const NAME_TYPE_HOST_NAME: u8 = 0;

/// Why the first bytes of a tunnel are not an acceptable ClientHello.
#[derive(Debug, thiserror::Error)]
pub enum ClientHelloError {
    #[error("the tunnel does not start with a TLS handshake (first byte {0:#04x}); tunnels carry TLS only")]
    NotTls(u8),
    #[error("the tunnel's first TLS handshake message is of type {0}, not a ClientHello")]
    NotClientHello(u8),
    #[error("malformed TLS ClientHello: {0}")]
    Malformed(&'static str),
    #[error("the TLS ClientHello is larger than {MAX_HELLO_LEN} bytes")]
    TooLarge,
    #[error(
        "the client closed the tunnel after {0} bytes, before its TLS ClientHello was complete"
    )]
    Truncated(usize),
    #[error("no complete TLS ClientHello within {} s; tunnels carry TLS only", READ_TIMEOUT.as_secs())]
    Timeout,
    #[error("reading the TLS ClientHello: {0}")]
    Io(#[from] std::io::Error),
}

/// What the proxy needs to know of a ClientHello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// The `host_name` of the `server_name` extension, if the client sent one (ASCII, as
    /// sent: case and a trailing dot are the caller's to normalise).
    pub server_name: Option<String>,
    /// Whether the client offers Encrypted Client Hello (or the older encrypted SNI), which
    /// hides the name it really wants behind `server_name`.
    pub encrypted: bool,
}

/// Parses the start of a TLS stream: `Ok(None)` while more bytes are needed.
pub fn parse(buf: &[u8]) -> Result<Option<ClientHello>, ClientHelloError> {
    Assembler::default().feed(buf)
}

/// Reads from `stream` until a whole ClientHello has arrived (it may span several records and
/// several reads) and returns it with every byte read, which the caller forwards as is.
pub async fn read<R: AsyncRead + Unpin>(
    stream: &mut R,
) -> Result<(ClientHello, Vec<u8>), ClientHelloError> {
    read_within(stream, READ_TIMEOUT).await
}

/// [`read`] with another time limit (tests).
async fn read_within<R: AsyncRead + Unpin>(
    stream: &mut R,
    limit: Duration,
) -> Result<(ClientHello, Vec<u8>), ClientHelloError> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut assembler = Assembler::default();
    let mut buf = Vec::with_capacity(4096);
    loop {
        if let Some(hello) = assembler.feed(&buf)? {
            return Ok((hello, buf));
        }
        if buf.len() >= MAX_BUFFERED {
            return Err(ClientHelloError::TooLarge);
        }
        let mut chunk = [0u8; 4096];
        let room = (MAX_BUFFERED - buf.len()).min(chunk.len());
        let n = tokio::time::timeout_at(deadline, stream.read(&mut chunk[..room]))
            .await
            .map_err(|_| ClientHelloError::Timeout)??;
        if n == 0 {
            return Err(ClientHelloError::Truncated(buf.len()));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Reassembles the handshake message from records as they arrive; each byte is looked at
/// once, so a client trickling tiny records costs no more than one sending a single record.
#[derive(Default)]
struct Assembler {
    /// Bytes of the stream consumed as whole records.
    consumed: usize,
    /// The handshake bytes those records carried.
    handshake: Vec<u8>,
}

impl Assembler {
    /// `buf` is the whole stream so far (it only grows between calls).
    fn feed(&mut self, buf: &[u8]) -> Result<Option<ClientHello>, ClientHelloError> {
        use ClientHelloError::*;
        if let Some(&first) = buf.first() {
            if first != RECORD_HANDSHAKE {
                return Err(NotTls(first));
            }
        }
        loop {
            if let Some(hello) = self.complete()? {
                return Ok(Some(hello));
            }
            let rest = &buf[self.consumed..];
            let Some(&content_type) = rest.first() else {
                return Ok(None);
            };
            if content_type != RECORD_HANDSHAKE {
                return Err(Malformed("another record inside the ClientHello"));
            }
            // legacy_record_version: 0x0301 to 0x0303 in practice; SSL 2 and non-TLS differ.
            if rest.len() >= 2 && rest[1] != 3 {
                return Err(Malformed("not a TLS record version"));
            }
            if rest.len() < 5 {
                return Ok(None);
            }
            let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
            if len == 0 {
                return Err(Malformed("an empty handshake record"));
            }
            if len > MAX_RECORD_LEN {
                return Err(Malformed("a record longer than 2^14 bytes"));
            }
            if rest.len() < 5 + len {
                return Ok(None);
            }
            self.handshake.extend_from_slice(&rest[5..5 + len]);
            self.consumed += 5 + len;
        }
    }

    /// The ClientHello, once the records so far hold all of it.
    fn complete(&self) -> Result<Option<ClientHello>, ClientHelloError> {
        let h = &self.handshake;
        let Some(&msg_type) = h.first() else {
            return Ok(None);
        };
        if msg_type != HANDSHAKE_CLIENT_HELLO {
            return Err(ClientHelloError::NotClientHello(msg_type));
        }
        if h.len() < 4 {
            return Ok(None);
        }
        let len = (usize::from(h[1]) << 16) | (usize::from(h[2]) << 8) | usize::from(h[3]);
        if len > MAX_HELLO_LEN {
            return Err(ClientHelloError::TooLarge);
        }
        if h.len() < 4 + len {
            return Ok(None);
        }
        if h.len() > 4 + len {
            // A client sends nothing else before the server's first flight; a message glued
            // behind the hello is something a server might read and we would not.
            return Err(ClientHelloError::Malformed(
                "more handshake data after the ClientHello",
            ));
        }
        client_hello_body(&h[4..]).map(Some)
    }
}

/// A bounds-checked cursor over a complete message: running short is malformed.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ClientHelloError> {
        if self.0.len() < n {
            return Err(ClientHelloError::Malformed("a field overruns its length"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, ClientHelloError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, ClientHelloError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    /// A vector with a `u8` or `u16` length prefix.
    fn vec8(&mut self) -> Result<&'a [u8], ClientHelloError> {
        let n = self.u8()?;
        self.take(usize::from(n))
    }

    fn vec16(&mut self) -> Result<&'a [u8], ClientHelloError> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// RFC 8446, 4.1.2 (the same layout as TLS 1.2's, which 1.3 keeps for compatibility).
fn client_hello_body(body: &[u8]) -> Result<ClientHello, ClientHelloError> {
    use ClientHelloError::Malformed;
    let mut c = Cursor(body);
    let legacy_version = c.u16()?;
    if legacy_version >> 8 != 3 {
        return Err(Malformed("not a TLS client version"));
    }
    c.take(32)?; // random
    if c.vec8()?.len() > 32 {
        return Err(Malformed("a session id longer than 32 bytes"));
    }
    let suites = c.vec16()?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err(Malformed("bad cipher suite list"));
    }
    if c.vec8()?.is_empty() {
        return Err(Malformed("no compression methods"));
    }
    let mut hello = ClientHello {
        server_name: None,
        encrypted: false,
    };
    if c.is_empty() {
        // A hello without extensions (pre-TLS 1.2 style) names no server.
        return Ok(hello);
    }
    let mut extensions = Cursor(c.vec16()?);
    if !c.is_empty() {
        return Err(Malformed("bytes after the extensions"));
    }
    let mut seen = HashSet::new();
    while !extensions.is_empty() {
        let kind = extensions.u16()?;
        let data = extensions.vec16()?;
        if !seen.insert(kind) {
            return Err(Malformed("the same extension twice"));
        }
        match kind {
            EXT_SERVER_NAME => hello.server_name = Some(host_name(data)?),
            EXT_ECH | EXT_ESNI_DRAFT => hello.encrypted = true,
            _ => {}
        }
    }
    Ok(hello)
}

/// The one `host_name` of a `server_name` extension (RFC 6066, 3).
fn host_name(data: &[u8]) -> Result<String, ClientHelloError> {
    use ClientHelloError::Malformed;
    let mut c = Cursor(data);
    let mut list = Cursor(c.vec16()?);
    if !c.is_empty() {
        return Err(Malformed("bytes after the server name list"));
    }
    if list.is_empty() {
        return Err(Malformed("an empty server name list"));
    }
    let mut found = None;
    while !list.is_empty() {
        let name_type = list.u8()?;
        let name = list.vec16()?;
        if name_type != NAME_TYPE_HOST_NAME {
            return Err(Malformed("a server name that is not a host name"));
        }
        if found.is_some() {
            return Err(Malformed("two host names in server_name"));
        }
        let valid = !name.is_empty()
            && name.len() <= 255
            && name
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
        if !valid {
            return Err(Malformed("a server name that is not a DNS host name"));
        }
        found = Some(String::from_utf8_lossy(name).into_owned());
    }
    found.ok_or(Malformed("an empty server name list"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a ClientHello handshake message (header included) with these extensions.
    fn hello_message(extensions: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([7u8; 32]); // random
        body.push(32);
        body.extend([9u8; 32]); // session id
        body.extend([0, 4, 0x13, 0x01, 0x13, 0x02]); // two cipher suites
        body.extend([1, 0]); // null compression
        let mut ext = vec![];
        for (kind, data) in extensions {
            ext.extend(kind.to_be_bytes());
            ext.extend((data.len() as u16).to_be_bytes());
            ext.extend(data);
        }
        body.extend((ext.len() as u16).to_be_bytes());
        body.extend(ext);
        let mut msg = vec![HANDSHAKE_CLIENT_HELLO];
        msg.extend(&(body.len() as u32).to_be_bytes()[1..]);
        msg.extend(body);
        msg
    }

    fn sni(names: &[(u8, &str)]) -> (u16, Vec<u8>) {
        let mut list = vec![];
        for (kind, name) in names {
            list.push(*kind);
            list.extend((name.len() as u16).to_be_bytes());
            list.extend(name.as_bytes());
        }
        let mut data = (list.len() as u16).to_be_bytes().to_vec();
        data.extend(list);
        (EXT_SERVER_NAME, data)
    }

    /// Supported versions and a key share, so the hello looks like a TLS 1.3 one.
    fn common() -> Vec<(u16, Vec<u8>)> {
        vec![(43, vec![2, 3, 4]), (51, vec![0, 6, 0, 29, 0, 2, 1, 2])]
    }

    /// Cuts a handshake message into records of at most `size` bytes.
    fn records(msg: &[u8], size: usize) -> Vec<u8> {
        let mut out = vec![];
        for part in msg.chunks(size) {
            out.extend([RECORD_HANDSHAKE, 3, 1]);
            out.extend((part.len() as u16).to_be_bytes());
            out.extend(part);
        }
        out
    }

    fn with_sni(name: &str) -> Vec<u8> {
        let mut ext = common();
        ext.insert(1, sni(&[(0, name)]));
        records(&hello_message(&ext), MAX_RECORD_LEN)
    }

    #[test]
    fn a_hello_with_a_server_name() {
        let hello = parse(&with_sni("Allowed.Example.")).unwrap().unwrap();
        assert_eq!(hello.server_name.as_deref(), Some("Allowed.Example."));
        assert!(!hello.encrypted);
    }

    #[test]
    fn every_prefix_asks_for_more_and_the_whole_parses() {
        let bytes = with_sni("a.example");
        for end in 0..bytes.len() {
            assert!(parse(&bytes[..end]).unwrap().is_none(), "prefix of {end}");
        }
        assert!(parse(&bytes).unwrap().is_some());
    }

    #[test]
    fn a_hello_split_across_records_and_bytes_after_it() {
        let mut ext = common();
        ext.push(sni(&[(0, "split.example")]));
        let msg = hello_message(&ext);
        for size in [1, 3, 4, 5, 50] {
            let mut bytes = records(&msg, size);
            // Whatever follows the hello (a change_cipher_spec, early data) is not looked at.
            bytes.extend([20, 3, 3, 0, 1, 1]);
            let hello = parse(&bytes).unwrap().unwrap();
            assert_eq!(
                hello.server_name.as_deref(),
                Some("split.example"),
                "{size}"
            );
        }
    }

    #[tokio::test]
    async fn read_assembles_a_hello_from_several_reads() {
        let bytes = records(&hello_message(&[sni(&[(0, "slow.example")])]), 7);
        let (mut client, mut server) = tokio::io::duplex(64);
        let sent = bytes.clone();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for part in sent.chunks(5) {
                client.write_all(part).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            client
        });
        let (hello, raw) = read(&mut server).await.unwrap();
        assert_eq!(hello.server_name.as_deref(), Some("slow.example"));
        assert_eq!(raw, bytes);
        drop(writer.await.unwrap());
    }

    #[tokio::test]
    async fn read_reports_truncation_and_silence() {
        let bytes = with_sni("cut.example");
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        {
            use tokio::io::AsyncWriteExt;
            client.write_all(&bytes[..bytes.len() - 1]).await.unwrap();
        }
        drop(client);
        assert!(matches!(
            read(&mut server).await,
            Err(ClientHelloError::Truncated(n)) if n == bytes.len() - 1
        ));

        let (_client, mut server) = tokio::io::duplex(64);
        assert!(matches!(
            read_within(&mut server, Duration::from_millis(50)).await,
            Err(ClientHelloError::Timeout)
        ));
    }

    #[test]
    fn no_server_name() {
        let hello = parse(&records(&hello_message(&common()), 1000))
            .unwrap()
            .unwrap();
        assert_eq!(hello.server_name, None);
        // No extensions at all.
        let mut msg = hello_message(&[]);
        msg.truncate(msg.len() - 2);
        msg[3] -= 2;
        assert_eq!(
            parse(&records(&msg, 1000)).unwrap().unwrap().server_name,
            None
        );
    }

    #[test]
    fn encrypted_client_hello_is_flagged() {
        for kind in [EXT_ECH, EXT_ESNI_DRAFT] {
            let mut ext = common();
            ext.push(sni(&[(0, "public.cdn.example")]));
            ext.push((kind, vec![0, 1, 2, 3]));
            let hello = parse(&records(&hello_message(&ext), 1000))
                .unwrap()
                .unwrap();
            assert!(hello.encrypted);
            assert_eq!(hello.server_name.as_deref(), Some("public.cdn.example"));
        }
    }

    #[test]
    fn not_tls_is_refused_at_the_first_byte() {
        for bytes in [
            &b"GET / HTTP/1.1\r\n"[..],
            b"G",
            b"\x80\x2e\x01",
            b"SSH-2.0-x",
        ] {
            assert!(
                matches!(parse(bytes), Err(ClientHelloError::NotTls(b)) if b == bytes[0]),
                "{bytes:?}"
            );
        }
        // A TLS handshake record holding another message (a ServerHello).
        let mut msg = hello_message(&[]);
        msg[0] = 2;
        assert!(matches!(
            parse(&records(&msg, 1000)),
            Err(ClientHelloError::NotClientHello(2))
        ));
    }

    #[test]
    fn ambiguous_or_malformed_hellos_are_refused() {
        let two_snis = {
            let mut ext = common();
            ext.push(sni(&[(0, "allowed.example")]));
            ext.push(sni(&[(0, "other.example")]));
            hello_message(&ext)
        };
        let two_names = hello_message(&[sni(&[(0, "allowed.example"), (0, "other.example")])]);
        let other_type = hello_message(&[sni(&[(1, "allowed.example")])]);
        let bad_chars = hello_message(&[sni(&[(0, "allowed.example\0.other")])]);
        let empty_name = hello_message(&[sni(&[(0, "")])]);
        let empty_list = hello_message(&[(EXT_SERVER_NAME, vec![0, 0])]);
        let overrun = hello_message(&[(EXT_SERVER_NAME, vec![0, 9, 0, 0, 1, b'a'])]);
        let mut trailing = hello_message(&[sni(&[(0, "a.example")])]);
        trailing.push(0);
        trailing[3] += 1;
        let mut glued = hello_message(&[sni(&[(0, "a.example")])]);
        glued.extend([HANDSHAKE_CLIENT_HELLO, 0, 0, 0]);
        for (what, msg) in [
            ("two server_name extensions", two_snis),
            ("two host names", two_names),
            ("another name type", other_type),
            ("bad characters", bad_chars),
            ("an empty name", empty_name),
            ("an empty list", empty_list),
            ("an overrun", overrun),
            ("trailing bytes", trailing),
            ("a message glued behind", glued),
        ] {
            assert!(
                matches!(
                    parse(&records(&msg, 1000)),
                    Err(ClientHelloError::Malformed(_))
                ),
                "{what}"
            );
        }
        // Another record type between fragments, an empty record, a non-TLS version.
        let msg = hello_message(&[sni(&[(0, "a.example")])]);
        let mut interleaved = records(&msg[..10], 10);
        interleaved.extend([21, 3, 3, 0, 2, 1, 0]);
        interleaved.extend(records(&msg[10..], 1000));
        let mut empty = vec![RECORD_HANDSHAKE, 3, 1, 0, 0];
        empty.extend(records(&msg, 1000));
        let mut version = records(&msg, 1000);
        version[1] = 2;
        for (what, bytes) in [
            ("interleaved", interleaved),
            ("empty", empty),
            ("version", version),
        ] {
            assert!(
                matches!(parse(&bytes), Err(ClientHelloError::Malformed(_))),
                "{what}"
            );
        }
    }

    #[test]
    fn truncated_messages_wait_for_more() {
        // A hello whose header promises more than the records hold is incomplete, not
        // parsed from what is there.
        let msg = hello_message(&[sni(&[(0, "a.example")])]);
        let mut bytes = records(&msg, 1000);
        bytes[3..5].copy_from_slice(&((msg.len() + 10) as u16).to_be_bytes());
        assert!(parse(&bytes).unwrap().is_none());
    }

    #[test]
    fn oversize_hellos_are_refused() {
        // The header alone says too large: refused before the body arrives.
        let header = [HANDSHAKE_CLIENT_HELLO, 0x01, 0, 0];
        assert!(matches!(
            parse(&records(&header, 1000)),
            Err(ClientHelloError::TooLarge)
        ));
        // A record longer than TLS allows.
        assert!(matches!(
            parse(&[RECORD_HANDSHAKE, 3, 1, 0x40, 0x01]),
            Err(ClientHelloError::Malformed(_))
        ));
    }

    #[tokio::test]
    async fn read_stops_buffering_at_the_bound() {
        // A hello within MAX_HELLO_LEN but cut into one-byte records needs more than
        // MAX_BUFFERED bytes: refused, not buffered without end.
        let padding = (21, vec![0u8; MAX_HELLO_LEN - 200]);
        let msg = hello_message(&[sni(&[(0, "a.example")]), padding]);
        assert!(msg.len() <= MAX_HELLO_LEN + 4);
        let bytes = records(&msg, 1);
        let (mut client, mut server) = tokio::io::duplex(1 << 20);
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let _ = client.write_all(&bytes).await;
            client
        });
        assert!(matches!(
            read(&mut server).await,
            Err(ClientHelloError::TooLarge)
        ));
        drop(writer.await.unwrap());
        // The same hello in whole records is fine.
        assert!(parse(&records(&msg, MAX_RECORD_LEN)).unwrap().is_some());
    }

    #[test]
    fn mutated_hellos_never_panic() {
        // Sent by the sandbox, so anything goes: flip, cut and extend a valid hello.
        let valid = records(
            &hello_message(&[sni(&[(0, "m.example")]), (EXT_ECH, vec![1])]),
            40,
        );
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let mut bytes = valid.clone();
            for _ in 0..(next() % 4 + 1) {
                let at = (next() as usize) % bytes.len();
                bytes[at] = next() as u8;
            }
            bytes.truncate((next() as usize) % (bytes.len() + 1));
            let _ = parse(&bytes);
        }
    }

    #[tokio::test]
    async fn a_real_tls_client_hello() {
        // What a real TLS library sends (rustls, offering 1.3 and 1.2), read as the proxy reads it.
        use tokio_rustls::rustls;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let name = rustls::pki_types::ServerName::try_from("Real.Example").unwrap();
        let handshake = tokio::spawn(async move { connector.connect(name, client).await });
        let (hello, raw) = read(&mut server).await.unwrap();
        assert_eq!(hello.server_name.as_deref(), Some("Real.Example"));
        assert!(!hello.encrypted);
        assert_eq!(raw[0], RECORD_HANDSHAKE);
        drop(server);
        assert!(handshake.await.unwrap().is_err());
    }
}
