"""Seed the fuzz corpora from the golden ipykernel capture (standard library only).

    python3 fuzz/seed_corpus.py

writes fuzz/corpus/multipart_decode/ (each captured multipart in the input layout of
fuzz_targets/checks.rs: a channel byte, then u16-LE-length-prefixed frames), re-signed with
the fuzz key so that the fuzzer starts past signature verification, and
fuzz/corpus/websocket_decode/ (each client-channel message as a v1 frame, a legacy text frame,
and a legacy binary frame when it has buffers).
"""

import base64
import hashlib
import hmac
import json
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent
FIXTURE = ROOT.parent / "tests" / "fixtures" / "ipykernel-7.4-multipart.json"
FUZZ_KEY = b"fuzz-key-5f0c1d2e"  # checks.rs KEY
CHANNELS = ["shell", "control", "stdin", "iopub", "hb"]  # checks.rs CHANNELS order
DELIM = b"<IDS|MSG>"


def join_frames(channel, frames):
    out = bytes([CHANNELS.index(channel)])
    for f in frames:
        f = f[:0xFFFF]
        out += struct.pack("<H", len(f)) + f
    return out


def v1(channel, parts):
    parts = [channel.encode()] + parts
    k = len(parts) + 1
    offsets, at = [], 8 * (k + 1)
    for p in parts:
        offsets.append(at)
        at += len(p)
    offsets.append(at)
    return struct.pack("<Q", k) + b"".join(struct.pack("<Q", o) for o in offsets) + b"".join(parts)


def legacy(channel, parts, buffers):
    msg = {
        "header": json.loads(parts[0]),
        "parent_header": json.loads(parts[1]),
        "metadata": json.loads(parts[2]),
        "content": json.loads(parts[3]),
        "channel": channel,
    }
    if not buffers:
        msg["buffers"] = []
        return json.dumps(msg).encode()
    body = json.dumps(msg).encode()
    n = 1 + len(buffers)
    offsets, at = [], 4 * (n + 1)
    for p in [body] + buffers:
        offsets.append(at)
        at += len(p)
    return struct.pack(">I", n) + b"".join(struct.pack(">I", o) for o in offsets) + body + b"".join(buffers)


def main():
    doc = json.loads(FIXTURE.read_text())
    mp = ROOT / "corpus" / "multipart_decode"
    ws = ROOT / "corpus" / "websocket_decode"
    mp.mkdir(parents=True, exist_ok=True)
    ws.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(doc["messages"]):
        frames = [base64.b64decode(f) for f in m["frames"]]
        at = frames.index(DELIM)
        parts = frames[at + 2 : at + 6]
        buffers = frames[at + 6 :]
        (mp / ("golden-%02d" % i)).write_bytes(join_frames(m["channel"], frames))
        sig = hmac.new(FUZZ_KEY, b"".join(parts), hashlib.sha256).hexdigest().encode()
        resigned = frames[:at] + [DELIM, sig] + parts + buffers
        (mp / ("resigned-%02d" % i)).write_bytes(join_frames(m["channel"], resigned))
        if m["channel"] in ("shell", "control", "stdin"):
            (ws / ("v1-%02d" % i)).write_bytes(v1(m["channel"], parts + buffers))
            (ws / ("legacy-%02d" % i)).write_bytes(legacy(m["channel"], parts, buffers))
    print("seeded %s and %s" % (mp, ws))


if __name__ == "__main__":
    main()
