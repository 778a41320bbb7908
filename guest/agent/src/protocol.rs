//! The agent protocol: how the gateway's microvm backend and the guest agent talk.
//!
//! One byte stream joins them: a hybrid-vsock connection or a virtio-serial port, and the
//! protocol is the same over both. It opens with a one-line handshake each way ([`hello`],
//! [`ready`]), then carries a yamux session in which the host is the client. yamux gives many
//! independent streams, each with its own flow control, so a flood on iopub never holds up an
//! interrupt on the control channel, and one pip download never stalls another.
//!
//! Every yamux stream starts with one JSON line, an [`Open`], that says what it carries:
//! - `control` (host-opened, one per session): JSON lines, [`Request`]s one way and
//!   [`GuestMessage`]s (replies and events) the other;
//! - `channel` (host-opened, one per ZMQ connection): raw ZMTP bytes between a gateway socket
//!   and the kernel's ipc socket of that channel in the guest; the agent parses none of it;
//! - `egress` (guest-opened, one per TCP connection to the guest's proxy port): raw bytes to
//!   the gateway's egress proxy, which applies the policy as it does for every backend;
//! - `files` (host-opened, one per workspace operation, [`FileOp`]): the agent answers with
//!   [`FileReply`] lines; a read's bytes follow its `size` line, a write's bytes follow the
//!   open line in frames.
//!
//! Why a handshake before yamux: a guest restored from a snapshot meets a new gateway process
//! on a virtio-serial port that never closed, and may still be ending the session it had when
//! it was saved (which can eat a first `HELLO`). So the handshake is built to start clean
//! whatever either side left in the pipe:
//! 1. the host says [`hello`] (again every few seconds until answered);
//! 2. the guest drops everything up to a `HELLO` and answers each one with [`ready`];
//! 3. once the host has read a `READY` with its nonce it says [`begin`], once, and nothing
//!    more until step 4;
//! 4. the guest drops everything up to that `BEGIN` (more `HELLO`s queued while it booted)
//!    and answers [`go`];
//! 5. the host drops everything up to `GO` (more `READY`s), and yamux starts on both sides
//!    right after these lines, on a pipe that holds nothing else.
//!
//! The host treats all of this as hostile input: every line is read with a length cap, and
//! anything malformed ends the session.
//!
//! Over TCP (a Kubernetes pod's agent, reachable on the cluster network) the handshake is
//! preceded by a mutual proof of the kernel's key, which only the gateway and the pod (from
//! its Secret) hold, with a fresh nonce from each side so that nothing can be replayed:
//! 1. the host says [`auth`] with its nonce;
//! 2. the guest answers [`guest_proof`]: its own nonce and an HMAC-SHA256 of both nonces;
//! 3. the host checks it (a pod that cannot prove the key is not this kernel's: a reused pod
//!    IP, say) and answers [`host_proof`], over the nonces in the other order and with
//!    another label, so the guest's proof is never a valid host proof;
//! 4. the guest checks it, and only then do the lines above follow.
//!
//! This authenticates the two ends; it does not encrypt what follows (see SCALING.md: the
//! cluster network between gateway and kernel pods is trusted to be private, as for Jupyter
//! Enterprise Gateway's ZMQ ports; a service mesh's mTLS adds confidentiality).
//!
//! **A kernel outlives its session.** The host may end a session with [`Op::Detach`]: the
//! agent answers, then closes the session's streams (the kernel's channel bridges) and the
//! link; the kernel runs on, and the agent waits for the next host (a VM saved to disk and
//! restored later, a gateway that restarted). Once a kernel was started, a later session is
//! *unattached* until it proves the kernel's key on its control stream, the same mutual
//! HMAC-SHA256 over a nonce from each side as the TCP proof, with labels of its own:
//! 1. the host asks [`Op::Challenge`] with its nonce;
//! 2. the guest answers [`Reply::Challenge`]: its nonce and its proof ([`attach_guest_mac`]);
//! 3. the host checks it and sends [`Op::Attach`] with its own proof ([`attach_host_mac`]);
//! 4. the guest checks it: [`Reply::Done`], and the session may do everything; a wrong proof
//!    is answered [`Reply::Failed`] and ends the session.
//!
//! Until then the guest opens nothing but the control stream and answers nothing but these
//! two requests, so a restored VM serves only a gateway that holds its kernel's key. A
//! session over TCP proved the key already and starts attached; a VM whose kernel was never
//! started (a fresh boot, a warm-pool clone) has no key yet and starts attached too.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWrite, AsyncWriteExt};

/// The protocol's name and version, first on both handshake lines.
pub const MAGIC: &str = "CELLGATE-AGENT/3";

/// The longest JSON line either side accepts. Requests carry a kernel's environment and
/// argv; replies carry at most a log tail of [`LOG_TAIL_BYTES`].
pub const MAX_LINE: usize = 256 * 1024;

/// How much of the kernel's stdout and stderr an exit event carries.
pub const LOG_TAIL_BYTES: usize = 16 * 1024;

/// The host's vsock port the agent connects to (guest-initiated: hybrid vsock delivers it to
/// the host's unix socket `<uds>_1024`).
pub const VSOCK_PORT: u32 = 1024;

/// The virtio-serial port's name (`/sys/class/virtio-ports/*/name` in the guest).
pub const SERIAL_PORT_NAME: &str = "org.cellgate.agent";

/// The handshake line the host sends: the magic and a nonce the guest echoes.
pub fn hello(nonce: &str) -> String {
    format!("{MAGIC} HELLO {nonce}\n")
}

/// The guest's answer to [`hello`].
pub fn ready(nonce: &str) -> String {
    format!("{MAGIC} READY {nonce}\n")
}

/// The host's last handshake line: yamux follows the guest's [`go`].
pub fn begin(nonce: &str) -> String {
    format!("{MAGIC} BEGIN {nonce}\n")
}

/// The guest's last handshake line: yamux follows it.
pub fn go(nonce: &str) -> String {
    format!("{MAGIC} GO {nonce}\n")
}

/// The first line over TCP: the host asks the guest to prove the key (see the module's doc).
pub fn auth(nonce: &str) -> String {
    format!("{MAGIC} AUTH {nonce}\n")
}

/// The host's nonce of an `AUTH` line, if `line` is one.
pub fn parse_auth(line: &str) -> Option<&str> {
    let nonce = line.strip_prefix(&format!("{MAGIC} AUTH "))?.trim_end();
    valid_nonce(nonce).then_some(nonce)
}

/// The guest's answer to [`auth`]: its nonce and its proof.
pub fn guest_proof(key: &[u8], host_nonce: &str, guest_nonce: &str) -> String {
    let mac = proof_mac(key, "guest", host_nonce, guest_nonce);
    format!("{MAGIC} PROOF {guest_nonce} {mac}\n")
}

/// The guest's nonce of a `PROOF` line that proves `key` for `host_nonce`.
pub fn check_guest_proof<'a>(key: &[u8], host_nonce: &str, line: &'a str) -> Option<&'a str> {
    let rest = line.strip_prefix(&format!("{MAGIC} PROOF "))?.trim_end();
    let (guest_nonce, mac) = rest.split_once(' ')?;
    (valid_nonce(guest_nonce) && mac_matches(key, "guest", host_nonce, guest_nonce, mac))
        .then_some(guest_nonce)
}

/// The host's answer to the guest's proof.
pub fn host_proof(key: &[u8], host_nonce: &str, guest_nonce: &str) -> String {
    let mac = proof_mac(key, "host", guest_nonce, host_nonce);
    format!("{MAGIC} PROOF {mac}\n")
}

/// Whether `line` is the host's proof of `key` for these nonces.
pub fn check_host_proof(key: &[u8], host_nonce: &str, guest_nonce: &str, line: &str) -> bool {
    line.strip_prefix(&format!("{MAGIC} PROOF "))
        .map(str::trim_end)
        .is_some_and(|mac| mac_matches(key, "host", guest_nonce, host_nonce, mac))
}

/// The guest's proof of `key` when a host attaches (see the module's doc), in hex.
pub fn attach_guest_mac(key: &[u8], host_nonce: &str, guest_nonce: &str) -> String {
    proof_mac(key, "attach-guest", host_nonce, guest_nonce)
}

/// Whether `mac` is the guest's attach proof of `key` for these nonces.
pub fn check_attach_guest_mac(key: &[u8], host_nonce: &str, guest_nonce: &str, mac: &str) -> bool {
    valid_nonce(guest_nonce) && mac_matches(key, "attach-guest", host_nonce, guest_nonce, mac)
}

/// The host's proof of `key` when it attaches, over the nonces in the other order.
pub fn attach_host_mac(key: &[u8], host_nonce: &str, guest_nonce: &str) -> String {
    proof_mac(key, "attach-host", guest_nonce, host_nonce)
}

/// Whether `mac` is the host's attach proof of `key` for these nonces.
pub fn check_attach_host_mac(key: &[u8], host_nonce: &str, guest_nonce: &str, mac: &str) -> bool {
    mac_matches(key, "attach-host", guest_nonce, host_nonce, mac)
}

/// Whether `nonce` is one a proof may be made over: 8 to 64 letters and digits.
pub fn is_valid_nonce(nonce: &str) -> bool {
    valid_nonce(nonce)
}

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

fn proof_hmac(key: &[u8], label: &str, first: &str, second: &str) -> HmacSha256 {
    use hmac::Mac;
    // Any key length is valid for HMAC.
    let mut mac = HmacSha256::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    mac.update(format!("cellgate-agent {label} {first} {second}").as_bytes());
    mac
}

fn proof_mac(key: &[u8], label: &str, first: &str, second: &str) -> String {
    use hmac::Mac;
    encode_hex(
        &proof_hmac(key, label, first, second)
            .finalize()
            .into_bytes(),
    )
}

/// Compares in constant time (the HMAC crate's own comparison, which also refuses a MAC of
/// the wrong length).
fn mac_matches(key: &[u8], label: &str, first: &str, second: &str, hex: &str) -> bool {
    use hmac::Mac;
    let Some(bytes) = decode_hex(hex) else {
        return false;
    };
    proof_hmac(key, label, first, second)
        .verify_slice(&bytes)
        .is_ok()
}

/// `bytes` in lowercase hex.
pub fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a hex string (digits only, an even number of them).
pub fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).ok())
        .collect()
}

/// The guest's side of the proof (see the module's doc), on a fresh TCP connection. `Ok(false)`:
/// the peer is not the key's holder (or not a gateway at all); the connection is to be dropped.
pub async fn prove_to_host<S>(
    io: &mut tokio::io::BufReader<S>,
    key: &[u8],
    guest_nonce: &str,
) -> Result<bool, ProtocolError>
where
    S: tokio::io::AsyncRead + AsyncWrite + Unpin,
{
    let Some(line) = read_line(io, 512).await? else {
        return Ok(false);
    };
    let Some(host_nonce) = parse_auth(&line) else {
        return Ok(false);
    };
    io.get_mut()
        .write_all(guest_proof(key, host_nonce, guest_nonce).as_bytes())
        .await?;
    io.get_mut().flush().await?;
    let host_nonce = host_nonce.to_owned();
    let Some(line) = read_line(io, 512).await? else {
        return Ok(false);
    };
    Ok(check_host_proof(key, &host_nonce, guest_nonce, &line))
}

/// The nonce of a `HELLO` line, if `line` is one.
pub fn parse_hello(line: &str) -> Option<&str> {
    parse_word(line, "HELLO")
}

/// The nonce of a `READY` line, if `line` ends with one (what an old session left may
/// precede it on the same line).
pub fn parse_ready(line: &str) -> Option<&str> {
    parse_word(line, "READY")
}

/// The nonce of a `BEGIN` line, if `line` is one.
pub fn parse_begin(line: &str) -> Option<&str> {
    parse_word(line, "BEGIN")
}

/// The nonce of a `GO` line, if `line` ends with one.
pub fn parse_go(line: &str) -> Option<&str> {
    parse_word(line, "GO")
}

/// The nonce after the last `MAGIC WORD ` in `line`, if the line ends with a valid one.
fn parse_word<'a>(line: &'a str, word: &str) -> Option<&'a str> {
    let marker = format!("{MAGIC} {word} ");
    let at = line.rfind(&marker)?;
    let nonce = line[at + marker.len()..].trim_end();
    valid_nonce(nonce).then_some(nonce)
}

/// The guest's side of the handshake (see the module's doc): drops everything up to a
/// `HELLO`, answers each with `READY` and everything up to the host's `BEGIN` with its
/// nonce, then says `GO`; yamux follows. With `eof_is_idle` (a virtio-serial port whose
/// host side is closed), end of stream before the first `HELLO` means "no host yet": it waits.
pub async fn answer_handshake<S>(
    io: &mut tokio::io::BufReader<S>,
    eof_is_idle: bool,
) -> Result<(), ProtocolError>
where
    S: tokio::io::AsyncRead + AsyncWrite + Unpin,
{
    let mut nonce: Option<String> = None;
    loop {
        match read_line(io, 512).await {
            Ok(Some(line)) => {
                if let Some(hello) = parse_hello(&line) {
                    // The same host saying it again (our answer may have been lost), or a
                    // new one: answer the latest.
                    let hello = hello.to_owned();
                    io.get_mut().write_all(ready(&hello).as_bytes()).await?;
                    io.get_mut().flush().await?;
                    nonce = Some(hello);
                } else if nonce.is_some() && parse_begin(&line) == nonce.as_deref() {
                    let nonce = nonce.unwrap_or_default();
                    io.get_mut().write_all(go(&nonce).as_bytes()).await?;
                    io.get_mut().flush().await?;
                    return Ok(());
                }
            }
            // Junk longer than a handshake line: skip it.
            Err(ProtocolError::LineTooLong) => skip_buffered(io).await?,
            Ok(None) if eof_is_idle && nonce.is_none() => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Ok(None) => return Err(ProtocolError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            Err(error) => return Err(error),
        }
    }
}

/// Drops what `reader` holds buffered: after [`ProtocolError::LineTooLong`], which consumes
/// nothing of the line it refused, so that a handshake skipping junk moves on.
pub async fn skip_buffered<R: AsyncBufRead + Unpin>(reader: &mut R) -> std::io::Result<()> {
    let held = reader.fill_buf().await?.len();
    reader.consume(held);
    Ok(())
}

fn valid_nonce(nonce: &str) -> bool {
    (8..=64).contains(&nonce.len()) && nonce.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// The first line of every stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "open", rename_all = "snake_case")]
pub enum Open {
    Control,
    Channel { channel: Channel },
    Egress,
    Files { op: FileOp },
}

/// A workspace file operation, on the kernel's workspace in the guest, with the rules of
/// [`crate::workspace`] (paths checked, links never followed, files the kernel's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "file_op", rename_all = "snake_case")]
pub enum FileOp {
    /// The entries of `dir` (everything below it with `recursive`; dot names with
    /// `hidden`): [`FileReply::Entry`] lines, then [`FileReply::End`]. Both default to true,
    /// what a host that does not send them meant.
    List {
        dir: String,
        #[serde(default = "yes")]
        recursive: bool,
        #[serde(default = "yes")]
        hidden: bool,
    },
    /// [`FileReply::Size`], then exactly that many bytes.
    Read { path: String },
    /// The bytes follow in frames (a 4-byte big-endian length, then that many bytes, at
    /// most [`MAX_FILE_FRAME`]); an empty frame ends the file: [`FileReply::Written`], the
    /// file in place. A stream that ends without it, or more than `limit` bytes, leaves
    /// nothing ([`FileReply::Failed`] for the limit).
    Write { path: String, limit: u64 },
    /// What is at `path`: [`FileReply::Entry`].
    Stat { path: String },
    /// Creates the directory and its parents: [`FileReply::Entry`] of it.
    MakeDir { path: String },
    /// Removes a file, link or (empty, or with `recursive`) directory:
    /// [`FileReply::Removed`].
    Remove { path: String, recursive: bool },
    /// Moves `from` to `to`: [`FileReply::Entry`] of `to`.
    Rename {
        from: String,
        to: String,
        overwrite: bool,
    },
}

/// The largest frame of a file write.
pub const MAX_FILE_FRAME: u32 = 1 << 20;

/// The agent's lines on a file stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "file", rename_all = "snake_case")]
pub enum FileReply {
    Entry(WireEntry),
    End,
    Size { bytes: u64 },
    Written { bytes: u64 },
    Removed { entries: u64 },
    Failed(FileFailure),
}

/// One listed file, as it crosses the link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireEntry {
    pub path: String,
    pub kind: String,
    pub size: u64,
    pub mtime_s: i64,
    pub mtime_ns: i64,
}

/// Why a file operation failed, as the gateway reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileFailure {
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    BadPath,
    NotFound,
    Link,
    NotAFile,
    IsADirectory,
    TooLarge,
    NoSpace,
    Exists,
    NotEmpty,
    PermissionDenied,
    Unavailable,
    Io,
}

/// The five Jupyter channels, named as the connection file names their ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Channel {
    Shell,
    Iopub,
    Stdin,
    Control,
    Hb,
}

impl Channel {
    pub const ALL: [Channel; 5] = [
        Channel::Shell,
        Channel::Iopub,
        Channel::Stdin,
        Channel::Control,
        Channel::Hb,
    ];
}

/// A request on the control stream; the guest answers each with a [`Reply`] of the same id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    #[serde(flatten)]
    pub op: Op,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Starts the kernel. One kernel per VM: a second start is refused.
    Start(Start),
    /// Delivers a signal to the kernel process (interrupts are SIGINT).
    Signal { signal: i32 },
    /// Ends the kernel and every process it started.
    Kill,
    /// The kernel's resource use so far.
    Usage,
    /// Starts a zygote: the kernel's Python with ipykernel imported, waiting (for a later
    /// [`Op::Start`] whose command it can become) in the kernel's cgroup. Answered once the
    /// imports are done. A VM with a zygote is what the warm pool snapshots.
    Zygote(Zygote),
    /// Sent first to a VM restored from a snapshot: mixes host-made randomness into the
    /// guest's entropy pool and reseeds its generator at once (so two VMs restored from one
    /// snapshot never draw the same random numbers; hex, 32 bytes or more), and sets the
    /// guest's clock, which a restore leaves at the moment of the snapshot.
    Restored { seed: String, unix_time_ns: u64 },
    /// Powers the VM off.
    Poweroff,
    /// Ends this session, not the kernel: the agent answers [`Reply::Done`], then closes the
    /// session's streams and the link, and waits for the next host, which must attach (see
    /// the module's doc).
    Detach,
    /// The first step of attaching to a running kernel: the host's nonce; answered with
    /// [`Reply::Challenge`].
    Challenge { nonce: String },
    /// The second step: the host's proof over both nonces ([`attach_host_mac`]).
    Attach { proof: String },
}

/// How to start the kernel inside the guest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Start {
    /// The command, with guest paths.
    pub argv: Vec<String>,
    /// The kernel's whole environment.
    pub env: BTreeMap<String, String>,
    /// The working directory (the workspace, as the guest sees it).
    pub cwd: String,
    /// The kernel's connection file; `None` for a plain program (tools, probes).
    pub connection: Option<ConnectionFile>,
    pub uid: u32,
    pub gid: u32,
    /// The pids limit of the kernel's cgroup in the guest.
    pub pids: Option<u64>,
    /// The memory limit of the kernel's cgroup in the guest (the VM has some more RAM, so an
    /// out-of-memory kill is the kernel's and is seen as such).
    pub memory_bytes: Option<u64>,
    /// The kernel's environment among the root image's (see [`ENVIRONMENTS_DIR`]): the agent
    /// shows it at [`ENVIRONMENT_AT`] before the kernel starts. `None` (and absent from the
    /// JSON, as a gateway before environments sent it): the image's own layout is used as
    /// is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
}

/// A zygote to prepare (see [`Op::Zygote`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Zygote {
    /// The command of the kernels it can become: a later start's command must begin with
    /// this (the interpreter, `-m`, the launcher module); the zygote adds
    /// [`ZYGOTE_FLAG`].
    pub argv: Vec<String>,
    /// The environment the interpreter starts with: only variables that
    /// [`fixed_at_zygote_start`] names, which a later start's environment must have alike,
    /// or that start runs a fresh process instead.
    pub env: BTreeMap<String, String>,
    /// Its working directory while it waits (the kernel's, so `sys.path` is the same).
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// The environment the zygote runs in, as [`Start::environment`]: a later start must
    /// name the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
}

/// Where the root image holds each kernelspec's environment, one directory per kernelspec
/// name (`guest/build-image.py`).
pub const ENVIRONMENTS_DIR: &str = "/opt/cellgate/envs";

/// Where a kernel sees its environment, in the guest as in every sandbox
/// (`src/sandbox/relocate.rs`): its venv's scripts and compiled files name this path.
pub const ENVIRONMENT_AT: &str = "/opt/cellgate/venv";

/// Whether `name` can name an environment: a kernelspec's directory name, nothing that
/// could reach outside [`ENVIRONMENTS_DIR`].
pub fn is_environment_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The argument that makes the kernel launcher a zygote (`kernels/python3`).
pub const ZYGOTE_FLAG: &str = "--cellgate-zygote";

/// Whether the environment variable `key` is one a zygote starts with, so that a kernel it
/// becomes must have the same value: what the interpreter reads only when it starts
/// (`PYTHON*`, the locale), what modules the zygote imports read at their import (pydevd's
/// `PYDEVD_*`, matplotlib's `MPLBACKEND`), the preload list, and the program search path
/// and home. Nothing else of a kernel's environment
/// (its id, a client's variables) is ever in a zygote, which every clone shares.
pub fn fixed_at_zygote_start(key: &str) -> bool {
    key.starts_with("PYTHON")
        || key.starts_with("PYDEVD_")
        || key.starts_with("LC_")
        || matches!(
            key,
            "LANG" | "LANGUAGE" | "PATH" | "HOME" | PRELOAD_ENV | "MPLBACKEND"
        )
}

/// The kernelspec's preload list (`kernels/python3/kernel.json`): modules, comma-separated,
/// that a zygote imports before it waits (see the launcher's `_preload`), so the first cell
/// that uses them does not pay for the import. Fixed at a zygote's start, like the
/// matplotlib backend (`MPLBACKEND`), which matplotlib reads when it is imported.
pub const PRELOAD_ENV: &str = "CELLGATE_PRELOAD";

/// A connection file to write before the kernel starts. The kernel's ipc endpoints are guest
/// paths in it; the agent joins channel streams to them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConnectionFile {
    pub path: String,
    pub info: serde_json::Value,
}

/// What the guest sends on the control stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GuestMessage {
    Reply {
        id: u64,
        #[serde(flatten)]
        reply: Reply,
    },
    /// The kernel process ended; sent once.
    Exited(Exit),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    Started {
        pid: u32,
    },
    Done,
    Usage(Usage),
    Failed {
        message: String,
    },
    /// The guest's nonce and its proof of the kernel's key ([`attach_guest_mac`]).
    Challenge {
        nonce: String,
        proof: String,
    },
}

/// The kernel's resource use, as the guest measures it (its cgroup).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub cpu_time_us: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
    /// Process or thread creations refused for the pids limit.
    pub pids_limit_hits: Option<u64>,
}

/// How the kernel process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The guest's out-of-memory killer ended a process of the kernel's cgroup.
    pub oom: bool,
    pub pids_limit_hits: u64,
    /// The end of the kernel's stdout and stderr, at most [`LOG_TAIL_BYTES`].
    pub log_tail: String,
    /// For a kernel killed by a fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE): the guest kernel's
    /// record of it (see [`crate::fault`]), when the guest logged one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<String>,
}

/// Errors reading the protocol.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("the peer sent a line longer than {MAX_LINE} bytes")]
    LineTooLong,
    #[error("the peer sent a malformed line: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Reads one line of at most `max` bytes, without its newline; `None` at end of stream.
/// A longer line is an error, read no further than `max` bytes into.
pub async fn read_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    max: usize,
) -> Result<Option<String>, ProtocolError> {
    let mut line = Vec::new();
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok((!line.is_empty()).then(|| String::from_utf8_lossy(&line).into_owned()));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(at) => (at + 1, true),
            None => (buf.len(), false),
        };
        if line.len() + take > max + 1 {
            return Err(ProtocolError::LineTooLong);
        }
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if done {
            line.pop();
            return Ok(Some(String::from_utf8_lossy(&line).into_owned()));
        }
    }
}

/// Reads one JSON line of at most `max` bytes; `None` at end of stream.
pub async fn read_json_capped<T, R>(reader: &mut R, max: usize) -> Result<Option<T>, ProtocolError>
where
    T: for<'de> Deserialize<'de>,
    R: AsyncBufRead + Unpin,
{
    match read_line(reader, max).await? {
        Some(line) => Ok(Some(serde_json::from_str(&line)?)),
        None => Ok(None),
    }
}

/// The longest line of a file stream: a path of 4096 bytes, escaped, and the rest.
pub const MAX_FILE_LINE: usize = 16 * 1024;

/// Reads one JSON line of at most [`MAX_LINE`] bytes; `None` at end of stream.
pub async fn read_json<T, R>(reader: &mut R) -> Result<Option<T>, ProtocolError>
where
    T: for<'de> Deserialize<'de>,
    R: AsyncBufRead + Unpin,
{
    read_json_capped(reader, MAX_LINE).await
}

/// Writes `value` as one JSON line and flushes it.
pub async fn write_json<T: Serialize, W: AsyncWrite + Unpin>(
    writer: &mut W,
    value: &T,
) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value)?;
    line.push(b'\n');
    writer.write_all(&line).await?;
    writer.flush().await
}

/// The yamux settings both sides use. No keepalive pings: the transport is a local pipe whose
/// other end cannot vanish silently, and a VM paused for a snapshot must not time out.
pub fn yamux_config() -> tokio_yamux::Config {
    tokio_yamux::Config {
        enable_keepalive: false,
        // A kernel's five channels, a few reconnects and the egress connections: far below
        // yamux's default of 65535, so neither side can be made to track that many.
        max_stream_count: 128,
        // yamux's smallest window: what a peer can make the other side buffer is
        // streams x window, 32 MiB at most.
        max_stream_window_size: tokio_yamux::config::INITIAL_STREAM_WINDOW,
        ..tokio_yamux::Config::default()
    }
}

/// A field's default of true (serde takes a function).
fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_lines_round_trip_and_refuse_junk() {
        assert_eq!(parse_hello(&hello("abcdef123456")), Some("abcdef123456"));
        assert_eq!(parse_ready(&ready("abcdef123456")), Some("abcdef123456"));
        assert_eq!(parse_hello(&ready("abcdef123456")), None);
        assert_eq!(parse_hello("CELLGATE-AGENT/1 HELLO abcdef123456"), None);
        assert_eq!(parse_hello("CELLGATE-AGENT/2 HELLO abcdef123456"), None);
        // What an old session left may precede an answer on its line.
        let junk = format!("\u{1}\u{2}yamux{}", ready("abcdef123456"));
        assert_eq!(parse_ready(&junk), Some("abcdef123456"));
        assert_eq!(parse_go(&go("abcdef123456")), Some("abcdef123456"));
        assert_eq!(parse_begin(&begin("abcdef123456")), Some("abcdef123456"));
        assert_eq!(parse_begin(&go("abcdef123456")), None);
        assert_eq!(parse_hello(&hello("short")), None);
        assert_eq!(parse_hello(&hello("abc def 123456")), None);
    }

    #[test]
    fn a_start_without_an_environment_reads_as_before() {
        let before = r#"{"id":1,"op":"start","argv":["p"],"env":{},"cwd":"/home/user","connection":null,"uid":1000,"gid":1000,"pids":null,"memory_bytes":null}"#;
        let request: Request = serde_json::from_str(before).unwrap();
        let Op::Start(start) = &request.op else {
            panic!("{request:?}")
        };
        assert_eq!(start.environment, None);
        // Without an environment the request is the same bytes an older agent reads.
        assert!(!serde_json::to_string(&request)
            .unwrap()
            .contains("environment"));
        for good in ["python3", "python3-lean", "ir", "deno_2.x"] {
            assert!(is_environment_name(good), "{good}");
        }
        for bad in ["", ".", "..", "../x", "a/b", ".hidden", "a b", "a\0"] {
            assert!(!is_environment_name(bad), "{bad}");
        }
    }

    #[test]
    fn proofs_hold_for_the_key_and_the_nonces_only() {
        let key = b"0123456789abcdef0123456789abcdef";
        let (host, guest) = ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb");
        assert_eq!(parse_auth(&auth(host)), Some(host));
        let proof = guest_proof(key, host, guest);
        assert_eq!(check_guest_proof(key, host, &proof), Some(guest));
        assert_eq!(check_guest_proof(b"another key", host, &proof), None);
        assert_eq!(check_guest_proof(key, "cccccccccccccccc", &proof), None);
        let answer = host_proof(key, host, guest);
        assert!(check_host_proof(key, host, guest, &answer));
        assert!(!check_host_proof(b"another key", host, guest, &answer));
        assert!(!check_host_proof(key, host, "cccccccccccccccc", &answer));
        // The guest's proof, replayed as the host's, does not pass: the labels differ.
        let guest_mac = proof.trim_end().rsplit(' ').next().unwrap();
        assert!(!check_host_proof(
            key,
            host,
            guest,
            &format!("{MAGIC} PROOF {guest_mac}")
        ));
        assert!(!check_host_proof(
            key,
            host,
            guest,
            &format!("{MAGIC} PROOF zz")
        ));
    }

    #[test]
    fn attach_proofs_hold_for_the_key_and_the_nonces_only() {
        let key = b"0123456789abcdef0123456789abcdef";
        let (host, guest) = ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb");
        let guest_mac = attach_guest_mac(key, host, guest);
        assert!(check_attach_guest_mac(key, host, guest, &guest_mac));
        assert!(!check_attach_guest_mac(
            b"another key",
            host,
            guest,
            &guest_mac
        ));
        assert!(!check_attach_guest_mac(
            key,
            "cccccccccccccccc",
            guest,
            &guest_mac
        ));
        let host_mac = attach_host_mac(key, host, guest);
        assert!(check_attach_host_mac(key, host, guest, &host_mac));
        assert!(!check_attach_host_mac(
            b"another key",
            host,
            guest,
            &host_mac
        ));
        // Neither side's proof passes as the other's, nor as a TCP proof.
        assert!(!check_attach_host_mac(key, host, guest, &guest_mac));
        assert!(!check_attach_guest_mac(key, host, guest, &host_mac));
        assert!(!check_host_proof(
            key,
            host,
            guest,
            &format!("{MAGIC} PROOF {host_mac}")
        ));
        let wire = serde_json::to_string(&Request {
            id: 3,
            op: Op::Attach { proof: "00".into() },
        })
        .unwrap();
        assert_eq!(wire, r#"{"id":3,"op":"attach","proof":"00"}"#);
    }

    #[test]
    fn messages_have_their_wire_names() {
        let open = serde_json::to_string(&Open::Channel {
            channel: Channel::Iopub,
        })
        .unwrap();
        assert_eq!(open, r#"{"open":"channel","channel":"iopub"}"#);
        let request = serde_json::to_string(&Request {
            id: 7,
            op: Op::Signal { signal: 2 },
        })
        .unwrap();
        assert_eq!(request, r#"{"id":7,"op":"signal","signal":2}"#);
        let reply = serde_json::to_string(&GuestMessage::Reply {
            id: 7,
            reply: Reply::Started { pid: 42 },
        })
        .unwrap();
        assert_eq!(
            reply,
            r#"{"type":"reply","id":7,"reply":"started","pid":42}"#
        );
        let back: GuestMessage = serde_json::from_str(&reply).unwrap();
        assert_eq!(
            back,
            GuestMessage::Reply {
                id: 7,
                reply: Reply::Started { pid: 42 }
            }
        );
    }

    #[tokio::test]
    async fn a_line_longer_than_the_cap_is_refused() {
        let mut ok: &[u8] = b"12345\nrest";
        assert_eq!(
            read_line(&mut ok, 5).await.unwrap().as_deref(),
            Some("12345")
        );
        let mut long: &[u8] = b"123456\n";
        assert!(matches!(
            read_line(&mut long, 5).await,
            Err(ProtocolError::LineTooLong)
        ));
        let mut empty: &[u8] = b"";
        assert_eq!(read_line(&mut empty, 5).await.unwrap(), None);
    }
}
