"""A hostile fake Jupyter kernel for cellgate's tests (tests/it/hostile.rs).

It speaks just enough of the protocol to look ready (a signed kernel_info_reply with
busy/idle statuses parented to the request, heartbeat echoes, shutdown), and answers every
execute_request with malformed multiparts on iopub AND shell before one valid `stream`, a
valid `execute_reply` and `idle`. A gateway must drop every malformed message, relay the valid
ones, and keep serving its other kernels.

The code of the execute_request picks the garbage: `hostile:frame` (multipart-level damage:
no delimiter, too few frames, bad or missing signature, non-JSON or incomplete header, non-JSON
parent, huge junk frames), `hostile:json` (correctly signed messages whose metadata or content
is not a UTF-8 JSON object), `hostile:all` (both), or a comma list of kind names (see KINDS).
Every malformed message is parented to the execute_request and carries the text "LEAK:<kind>"
where it can, so a test can tell if one got through.

Usage (as a kernelspec argv): python hostile.py -f {connection_file}
Needs pyzmq (the kernel venv has it).
"""

import datetime
import hashlib
import hmac
import json
import os
import sys
import uuid

import zmq

DELIM = b"<IDS|MSG>"
HUGE = 16 * 1024 * 1024

FRAME_KINDS = [
    "no_delimiter",
    "too_few_frames",
    "bad_signature",
    "unsigned",
    "non_json_header",
    "header_without_msg_type",
    "non_json_parent",
    "huge_junk_frame",
    "huge_signature",
]
JSON_KINDS = [
    "invalid_utf8_content",
    "non_json_content",
    "non_object_content",
    "non_json_metadata",
]
KINDS = FRAME_KINDS + JSON_KINDS


def log(*args):
    print("hostile:", *args, file=sys.stderr, flush=True)


class Kernel:
    def __init__(self, info):
        self.key = info["key"].encode()
        self.session = uuid.uuid4().hex
        self.counter = 0
        self.execution_count = 0
        ctx = zmq.Context.instance()

        def endpoint(port):
            if info["transport"] == "ipc":
                return "ipc://%s-%s" % (info["ip"], port)
            return "tcp://%s:%s" % (info["ip"], port)

        self.shell = ctx.socket(zmq.ROUTER)
        self.control = ctx.socket(zmq.ROUTER)
        self.stdin = ctx.socket(zmq.ROUTER)
        self.iopub = ctx.socket(zmq.PUB)
        self.hb = ctx.socket(zmq.REP)
        for sock, port in [
            (self.shell, info["shell_port"]),
            (self.control, info["control_port"]),
            (self.stdin, info["stdin_port"]),
            (self.iopub, info["iopub_port"]),
            (self.hb, info["hb_port"]),
        ]:
            sock.linger = 0
            sock.bind(endpoint(port))
        self.poller = zmq.Poller()
        for sock in (self.shell, self.control, self.stdin, self.hb):
            self.poller.register(sock, zmq.POLLIN)

    # --- valid messages ---------------------------------------------------------------

    def sign(self, parts):
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.hexdigest().encode()

    def header(self, msg_type):
        self.counter += 1
        return {
            "msg_id": "%s_%d_%d" % (self.session, os.getpid(), self.counter),
            "msg_type": msg_type,
            "username": "hostile",
            "session": self.session,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z"),
            "version": "5.3",
        }

    def parts(self, msg_type, parent, content, metadata=None):
        """The four JSON parts as bytes; `parent` is the request's raw header bytes."""
        return [
            json.dumps(self.header(msg_type)).encode(),
            parent,
            json.dumps(metadata or {}).encode(),
            json.dumps(content).encode(),
        ]

    def send(self, sock, prefix, parts):
        sock.send_multipart(prefix + [DELIM, self.sign(parts)] + parts)

    def publish(self, msg_type, parent, content):
        self.send(self.iopub, [b"kernel.hostile." + msg_type.encode()], self.parts(msg_type, parent, content))

    def status(self, parent, state):
        self.publish("status", parent, {"execution_state": state})

    # --- garbage ----------------------------------------------------------------------

    def garbage(self, kind, sock, prefix, msg_type, parent):
        """One malformed multipart of `kind` on `sock`, looking like a `msg_type` for `parent`."""
        marker = "LEAK:%s" % kind
        if msg_type == "stream":
            content = {"name": "stdout", "text": marker + "\n"}
        else:
            content = {"status": "ok", "execution_count": 0, "user_expressions": {}, "payload": [], "leak": marker}
        h, p, m, c = self.parts(msg_type, parent, content)
        if kind == "no_delimiter":
            frames = prefix + [self.sign([h, p, m, c]), h, p, m, c]
        elif kind == "too_few_frames":
            frames = prefix + [DELIM, self.sign([h, p, m, c]), h, p]
        elif kind == "bad_signature":
            frames = prefix + [DELIM, self.sign([h, p, m, c + b" "]), h, p, m, c]
        elif kind == "unsigned":
            frames = prefix + [DELIM, b"", h, p, m, c]
        elif kind == "non_json_header":
            h = b'{"msg_type": "' + msg_type.encode() + b'", ' + marker.encode()
            frames = prefix + [DELIM, self.sign([h, p, m, c]), h, p, m, c]
        elif kind == "header_without_msg_type":
            header = json.loads(h)
            del header["msg_type"]
            header["leak"] = marker
            h = json.dumps(header).encode()
            frames = prefix + [DELIM, self.sign([h, p, m, c]), h, p, m, c]
        elif kind == "non_json_parent":
            p = p[: len(p) // 2] + marker.encode()
            frames = prefix + [DELIM, self.sign([h, p, m, c]), h, p, m, c]
        elif kind == "huge_junk_frame":
            frames = prefix + [os.urandom(HUGE)]
        elif kind == "huge_signature":
            frames = prefix + [DELIM, b"f" * HUGE, h, p, m, c]
        elif kind == "invalid_utf8_content":
            c = c[:-2] + b' \xff\xfe\xc0"}'
            frames = prefix + [DELIM, self.sign([h, p, m, c]), h, p, m, c]
        elif kind == "non_json_content":
            c = c[: len(c) // 2]
            frames = prefix + [DELIM, self.sign([h, p, m, c]), h, p, m, c]
        elif kind == "non_object_content":
            c = json.dumps([marker]).encode()
            frames = prefix + [DELIM, self.sign([h, p, m, c]), h, p, m, c]
        elif kind == "non_json_metadata":
            m = b"{" + marker.encode()
            frames = prefix + [DELIM, self.sign([h, p, m, c]), h, p, m, c]
        else:
            raise ValueError(kind)
        sock.send_multipart(frames)

    # --- requests ---------------------------------------------------------------------

    def reply(self, sock, idents, parent, msg_type, content):
        self.send(sock, idents, self.parts(msg_type, parent, content))

    def handle(self, sock, frames):
        try:
            at = frames.index(DELIM)
        except ValueError:
            log("request without a delimiter ignored")
            return
        idents = frames[:at]
        signature, h, p, m, c = frames[at + 1 : at + 6]
        if not hmac.compare_digest(signature, self.sign([h, p, m, c])):
            log("request with a bad signature ignored")
            return
        msg_type = json.loads(h)["msg_type"]
        content = json.loads(c)
        self.status(h, "busy")
        if msg_type == "kernel_info_request":
            self.reply(
                sock,
                idents,
                h,
                "kernel_info_reply",
                {
                    "status": "ok",
                    "protocol_version": "5.3",
                    "implementation": "hostile",
                    "implementation_version": "1.0",
                    "language_info": {"name": "python", "version": "3", "mimetype": "text/x-python", "file_extension": ".py"},
                    "banner": "a hostile test kernel",
                    "help_links": [],
                },
            )
        elif msg_type == "execute_request":
            self.execution_count += 1
            self.execute(sock, idents, h, content.get("code", ""))
        elif msg_type == "shutdown_request":
            self.reply(sock, idents, h, "shutdown_reply", {"status": "ok", "restart": content.get("restart", False)})
            self.status(h, "idle")
            log("shutting down")
            sys.exit(0)
        else:
            reply_type = msg_type.replace("_request", "_reply")
            self.reply(sock, idents, h, reply_type, {"status": "ok"})
        self.status(h, "idle")

    def execute(self, sock, idents, parent, code):
        spec = code.strip()
        if spec.startswith("hostile:"):
            spec = spec[len("hostile:") :]
        if spec == "all":
            kinds = KINDS
        elif spec == "frame":
            kinds = FRAME_KINDS
        elif spec == "json":
            kinds = JSON_KINDS
        else:
            kinds = [k for k in spec.split(",") if k]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            kinds = []
            text = "unknown kinds: %s\n" % ",".join(unknown)
        else:
            text = "valid output %d\n" % self.execution_count
        for kind in kinds:
            self.garbage(kind, self.iopub, [b"kernel.hostile.stream"], "stream", parent)
            self.garbage(kind, sock, idents, "execute_reply", parent)
        log("sent", len(kinds), "kinds of garbage on iopub and shell")
        self.publish("stream", parent, {"name": "stdout", "text": text})
        self.reply(
            sock,
            idents,
            parent,
            "execute_reply",
            {"status": "ok", "execution_count": self.execution_count, "user_expressions": {}, "payload": []},
        )

    def run(self):
        log("ready, pid", os.getpid())
        while True:
            for sock, _ in self.poller.poll():
                frames = sock.recv_multipart()
                if sock is self.hb:
                    self.hb.send_multipart(frames)
                elif sock is self.stdin:
                    log("ignoring a stdin message")
                else:
                    self.handle(sock, frames)


def main():
    args = sys.argv[1:]
    if "-f" not in args or args.index("-f") + 1 >= len(args):
        sys.exit("usage: hostile.py -f CONNECTION_FILE")
    with open(args[args.index("-f") + 1]) as f:
        info = json.load(f)
    Kernel(info).run()


if __name__ == "__main__":
    main()
