#!/usr/bin/env python3
"""API v1 benchmark: what the chat/agent surface costs on top of the Kernel Gateway path.

One `cellgate serve` process; every measurement runs against the SAME kernel (a v1 session
is a kernel of the Kernel Gateway API too), the paths interleaved round by round so kernel
and machine noise hit them alike:

  1 `1+1` round trip, p50/p90/p99:
      kg      Kernel Gateway WebSocket (/api/kernels/{id}/channels, legacy JSON frames):
              execute_request -> execute_reply + idle
      v1      POST /v1/sessions/{id}/execute (one keep-alive HTTP/1.1 connection) -> result JSON
      v1ws    the session WebSocket (/v1/sessions/{id}/ws): {"type":"execute"} -> done
    and the gateway's CPU per execute on each path.
  2 one ~5 MB PNG display_data:
      kg      the base64 PNG delivered to the WebSocket client
      v1      stored as an artifact (sha256, written to disk), result carries a reference
      v1-fetch v1, then GET the artifact's bytes on the same connection: until the client
              holds the PNG (the store runs off the result's path, so a fetch may wait
              for it)
      v1-none the same cell without the display (the floor of a v1 execute)
    Every rep displays a NEW random PNG (made by an untimed cell first), so content
    addressing never gets to skip a write. v1 - v1-none is the cost of getting 5 MB out of
    the kernel and storing it.
  3 C WebSocket clients on S sessions (default 200 on 50): every session runs a cell that
    prints L numbered lines; every client must see every line of its session, in order,
    and the done event. Reports lost/out-of-order lines (must be 0) and the wall time.

Run with the tools venv:  .venv-tools/bin/python bench/api_v1.py [--quick] ...
Default binary: target/release/cellgate (`--cellgate-bin target/debug/cellgate` for a smoke
run; debug numbers are not representative). Listens and connects on 127.0.0.1 only; the
gateway and its kernels are killed at the end, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (the end-to-end harness: targets, reaper, WS client, stats)
from e2e import (  # noqa: E402
    HOST, REPO, ScenarioError, WSConn, log, pct, proc_cpu_ticks, CLK_TCK,
)
from tornado.httpclient import HTTPRequest  # noqa: E402
from tornado.websocket import websocket_connect  # noqa: E402


class KeepAlive:
    """A minimal HTTP/1.1 client on one persistent connection (tornado's simple client
    opens a connection per request, which would bill a TCP handshake to API v1)."""

    def __init__(self, port, token):
        self.port, self.token = port, token
        self.reader = self.writer = None

    async def connect(self):
        # A large buffer: the default 64 KiB limit makes a 5 MB body crawl in through
        # pause/resume cycles, billing the harness to the gateway.
        self.reader, self.writer = await asyncio.open_connection(HOST, self.port, limit=16 << 20)

    async def request(self, method, path, body=None):
        if self.writer is None:
            await self.connect()
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{self.port}\r\n"
                f"Authorization: token {self.token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        self.writer.write(head + data)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length, chunked = None, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "transfer-encoding" and "chunked" in value:
                chunked = True
        if chunked:
            body = b""
            while True:
                size = int((await self.reader.readline()).strip(), 16)
                body += await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            body = await self.reader.readexactly(length or 0)
        return status, body

    def close(self):
        if self.writer is not None:
            self.writer.close()


class SessionWS:
    """The API v1 session WebSocket."""

    @classmethod
    async def open(cls, port, token, session):
        req = HTTPRequest(f"ws://{HOST}:{port}/v1/sessions/{session}/ws",
                          headers={"Authorization": f"token {token}"},
                          connect_timeout=60, request_timeout=60)
        self = cls()
        self.ws = await websocket_connect(req, max_message_size=1 << 31)
        self.ws.protocol.set_nodelay(True)
        hello = json.loads(await self.ws.read_message())
        if hello.get("type") != "session":
            raise ScenarioError(f"session WebSocket greeting: {hello}")
        return self

    async def next(self):
        m = await self.ws.read_message()
        if m is None:
            raise ScenarioError("session WebSocket closed")
        return json.loads(m)

    async def execute(self, code):
        """Runs `code` (unique per call) and waits for its own done event."""
        self.ws.write_message(json.dumps({"type": "execute", "code": code}))
        mine = None
        while True:
            event = await self.next()
            if event.get("type") == "started" and event.get("code") == code:
                mine = event["execution_id"]
            elif event.get("type") == "done" and mine and event.get("execution_id") == mine:
                return event["result"]


async def v1_execute(http, session, code):
    status, body = await http.request("POST", f"/v1/sessions/{session}/execute", {"code": code})
    if status != 200:
        raise ScenarioError(f"v1 execute: {status} {body[:300]!r}")
    result = json.loads(body)
    if result["status"] != "ok":
        raise ScenarioError(f"v1 execute: {result['status']}: {result.get('error')}")
    return result, len(body)


async def new_session(http):
    status, body = await http.request("POST", "/v1/sessions", {})
    if status != 201:
        raise ScenarioError(f"POST /v1/sessions: {status} {body[:300]!r}")
    return json.loads(body)["id"]


def gateway_cpu_ms(pid):
    return proc_cpu_ticks(pid) * 1e3 / CLK_TCK


async def sc_roundtrip(gw, a):
    http = KeepAlive(gw.port, gw.token)
    session = await new_session(http)
    tag = iter(range(1 << 62))

    # Each path gets its own fresh connection per block: the session WebSocket and the
    # Kernel Gateway socket see every execution of the kernel, and parsing the other
    # paths' leftovers must not be billed to them.
    async def kg_block(n):
        conn = await WSConn.open(gw.port, gw.token, session)
        await e2e.ensure_iopub(conn)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await e2e.execute(conn, "1+1")
            out.append((time.perf_counter() - t0) * 1e3)
        await conn.close()
        return out

    async def v1_block(n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await v1_execute(http, session, "1+1")
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    async def v1ws_block(n):
        sock = await SessionWS.open(gw.port, gw.token, session)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await sock.execute(f"1+1  # {next(tag)}")
            out.append((time.perf_counter() - t0) * 1e3)
        sock.ws.close()
        return out

    paths = {"kg": kg_block, "v1": v1_block, "v1ws": v1ws_block}
    for block in paths.values():
        await block(a.warmup)
    lat = {name: [] for name in paths}
    cpu = {name: 0.0 for name in paths}
    names = list(paths)
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            c0 = gateway_cpu_ms(gw.gateway_pid)
            lat[name] += await paths[name](a.n)
            cpu[name] += gateway_cpu_ms(gw.gateway_pid) - c0
    http.close()
    out = {}
    for name, values in lat.items():
        out[name] = {"p50_ms": pct(values, 50), "p90_ms": pct(values, 90),
                     "p99_ms": pct(values, 99), "n": len(values),
                     "gateway_cpu_ms_per_exec": cpu[name] / len(values)}
    return out


PNG_NEW = e2e.PNG_SETUP  # defines _png (fresh random pixels) and imports display/Image


async def sc_png(gw, a):
    side = int((a.png_mb * 1e6 / 3) ** 0.5)
    http = KeepAlive(gw.port, gw.token)
    session = await new_session(http)
    times = {"kg": [], "v1": [], "v1-fetch": [], "v1-none": []}
    result_bytes, png_bytes = [], []

    async def kg_png():
        got = []

        def on_msg(m):
            if m["header"]["msg_type"] == "display_data":
                got.append(len(m["content"]["data"].get("image/png", "")))
        # A fresh connection: an open one would also receive the v1 path's PNGs.
        kg = await WSConn.open(gw.port, gw.token, session)
        await e2e.ensure_iopub(kg)
        t0 = time.perf_counter()
        await e2e.execute(kg, e2e.PNG_SHOW, on_msg)
        dt = time.perf_counter() - t0
        await kg.close()
        if len(got) != 1 or got[0] < a.png_mb * 1e6 * 4 / 3 * 0.95:
            raise ScenarioError(f"kg: PNG not received intact: {got}")
        return dt

    async def v1_png():
        t0 = time.perf_counter()
        result, size = await v1_execute(http, session, e2e.PNG_SHOW)
        dt = time.perf_counter() - t0
        pngs = [x for x in result["artifacts"] if x["mime"] == "image/png"]
        if len(pngs) != 1 or pngs[0]["bytes"] < a.png_mb * 1e6 * 0.95:
            raise ScenarioError(f"v1: PNG artifact missing or short: {result['artifacts']}")
        result_bytes.append(size)
        png_bytes.append(pngs[0]["bytes"])
        return dt

    async def v1_fetch():
        t0 = time.perf_counter()
        result, _ = await v1_execute(http, session, e2e.PNG_SHOW)
        pngs = [x for x in result["artifacts"] if x["mime"] == "image/png"]
        if len(pngs) != 1:
            raise ScenarioError(f"v1-fetch: no PNG artifact: {result['artifacts']}")
        status, body = await http.request("GET", f"/v1/artifacts/{pngs[0]['id']}")
        dt = time.perf_counter() - t0
        if status != 200 or len(body) != pngs[0]["bytes"] or not body.startswith(b"\x89PNG"):
            raise ScenarioError(f"v1-fetch: artifact not served intact: {status}, {len(body)} bytes")
        return dt

    async def v1_none():
        t0 = time.perf_counter()
        await v1_execute(http, session, "None")
        return time.perf_counter() - t0

    runs = {"kg": kg_png, "v1": v1_png, "v1-fetch": v1_fetch, "v1-none": v1_none}
    names = list(runs)
    for r in range(a.rounds * a.reps + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            await v1_execute(http, session, PNG_NEW.format(side=side))  # a new PNG, untimed
            dt = await runs[name]()
            if r > 0:  # round 0 warms up
                times[name].append(dt * 1e3)
    http.close()
    out = {name: {"median_ms": statistics.median(v), "n": len(v)} for name, v in times.items()}
    out["png_bytes"] = png_bytes[0]
    out["v1_result_json_bytes"] = max(result_bytes)
    out["store_cost_ms"] = out["v1"]["median_ms"] - out["v1-none"]["median_ms"]
    out["v1_minus_kg_ms"] = out["v1"]["median_ms"] - out["kg"]["median_ms"]
    out["v1_fetch_minus_kg_ms"] = out["v1-fetch"]["median_ms"] - out["kg"]["median_ms"]
    return out


async def sc_fanout(gw, a):
    http = KeepAlive(gw.port, gw.token)
    t0 = time.perf_counter()
    sessions = []
    for _ in range(a.sessions):  # one at a time: 50 kernel starts at once swamp 2 cores
        sessions.append(await new_session(http))
    log(f"fan-out: {a.sessions} sessions ready in {time.perf_counter() - t0:.1f}s")
    clients = []
    for i in range(a.clients):
        clients.append((sessions[i % len(sessions)],
                        await SessionWS.open(gw.port, gw.token, sessions[i % len(sessions)])))
    code = (f"for i in range({a.lines}):\n"
            f"    print(f'line {{i}}', flush=(i % 50 == 0))\n")

    async def watch(ws):
        # Stream events split the output anywhere (ipykernel flushes on its own clock),
        # even inside a line: join them, then compare lines.
        text, bad = [], 0
        while True:
            event = await ws.next()
            if event.get("type") == "stream" and event.get("name") == "stdout":
                text.append(event["text"])
            elif event.get("type") == "lagged":
                bad += 1
            elif event.get("type") == "done":
                break
        seen = "".join(text).splitlines()
        expected = [f"line {i}" for i in range(a.lines)]
        lost = sum(1 for x, y in zip(seen, expected) if x != y) + abs(len(seen) - len(expected))
        return lost, bad

    t0 = time.perf_counter()
    watchers = [asyncio.create_task(watch(ws)) for _, ws in clients]
    runners = []
    for s in sessions:
        sock = await SessionWS.open(gw.port, gw.token, s)
        sock.ws.write_message(json.dumps({"type": "execute", "code": code}))
        runners.append(sock)
    results = await asyncio.wait_for(asyncio.gather(*watchers), a.fanout_timeout)
    wall = time.perf_counter() - t0
    for _, ws in clients:
        ws.ws.close()
    for sock in runners:
        sock.ws.close()
    http.close()
    return {"sessions": a.sessions, "clients": a.clients, "lines_per_session": a.lines,
            "lost_or_out_of_order_lines": sum(r[0] for r in results),
            "lagged_notices": sum(r[1] for r in results),
            "wall_s": wall}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cellgate-bin", default=os.path.join(REPO, "target/release/cellgate"))
    p.add_argument("--cellgate-arg", action="append", default=[])
    p.add_argument("--kernels-dir", default=os.path.join(REPO, "kernels"))
    p.add_argument("--policies-dir", default=os.path.join(REPO, "policies"))
    p.add_argument("--scenarios", default="1,2,3")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-n", type=int, default=200, help="executes per path per round (scenario 1)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--reps", type=int, default=2, help="PNGs per path per round (scenario 2)")
    p.add_argument("--png-mb", type=float, default=5)
    p.add_argument("--sessions", type=int, default=50)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--fanout-timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="small N: a smoke run")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--start-timeout", type=float, default=60)
    p.add_argument("--http-timeout", type=float, default=120)
    a = p.parse_args()
    if a.quick:
        a.rounds, a.n, a.warmup, a.reps = 2, 30, 5, 1
        a.sessions, a.clients, a.lines = 5, 20, 500
    return a


async def amain(a):
    cmd = e2e.cellgate_cmd(a)
    gw = e2e.GatewayTarget("cellgate", cmd, a, time.strftime("%Y%m%dT%H%M%S") + "-api_v1")
    await gw.start()
    results = {"binary": a.cellgate_bin, "args": vars(a)}
    try:
        wanted = {int(s) for s in a.scenarios.split(",")}
        for number, name, fn in [(1, "roundtrip", sc_roundtrip), (2, "png", sc_png),
                                 (3, "fanout", sc_fanout)]:
            if number in wanted:
                log(f"scenario {number}: {name}")
                results[name] = await fn(gw, a)
                print(json.dumps({name: results[name]}, indent=2), flush=True)
    finally:
        await gw.stop()
    if "roundtrip" in results:
        rt = results["roundtrip"]
        print(f"\nround trip p50: kg {rt['kg']['p50_ms']:.3f} ms, v1 {rt['v1']['p50_ms']:.3f} ms "
              f"(+{rt['v1']['p50_ms'] - rt['kg']['p50_ms']:.3f}), v1ws {rt['v1ws']['p50_ms']:.3f} ms "
              f"(+{rt['v1ws']['p50_ms'] - rt['kg']['p50_ms']:.3f})")
    if "png" in results:
        png = results["png"]
        print(f"5 MB PNG: kg {png['kg']['median_ms']:.1f} ms, v1 {png['v1']['median_ms']:.1f} ms, "
              f"v1 without the PNG {png['v1-none']['median_ms']:.1f} ms -> getting it out and storing "
              f"it: {png['store_cost_ms']:.1f} ms; v1 - kg {png['v1_minus_kg_ms']:+.1f} ms; v1 then fetching "
              f"the bytes {png['v1-fetch']['median_ms']:.1f} ms ({png['v1_fetch_minus_kg_ms']:+.1f} vs kg); "
              f"v1 result JSON {png['v1_result_json_bytes']} bytes")
    if "fanout" in results:
        f = results["fanout"]
        print(f"fan-out: {f['clients']} clients on {f['sessions']} sessions, "
              f"{f['lost_or_out_of_order_lines']} lines lost or out of order, "
              f"{f['lagged_notices']} lag notices, {f['wall_s']:.1f} s")
    if a.json:
        with open(a.json, "w") as out:
            json.dump(results, out, indent=2)


def main():
    a = parse_args()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    try:
        asyncio.run(amain(a))
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
    finally:
        e2e.final_cleanup()


if __name__ == "__main__":
    main()
