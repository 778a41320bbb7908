#!/usr/bin/env python3
"""The sandbox backends side by side: what a session costs in each, in one run.

One `cellgate serve` (no warm pool, so every start is cold) with one policy per backend,
all with the same limits (512 MiB, 1 CPU). Round by round, interleaved so machine noise
hits every backend alike, for each backend:

  start    POST /v1/sessions until it answers (the gateway answers once the kernel
           replied to kernel_info and published a status: ready for code)
  1+1      POST /v1/sessions/{id}/execute, N times on one keep-alive connection: p50
  idle     after IDLE seconds without work, the memory the host pays for the session: the
           `resources.memory_bytes` of an execute of `0` (the sandbox's cgroup: the kernel's
           for namespaces, the sandbox's for gVisor, VMM plus guest RAM for microvm)

then DELETE. Prints a markdown table of medians (and min-max) over the rounds.

microVMs run under emulation (TCG) where the host has no usable KVM, as on this project's
machines: the gateway is started with --microvm-allow-emulation, and the table says which.
`microvm` boots every VM (the gateway runs with --microvm-snapshots false); `microvm-snapshot`
is the same policy on a second gateway with the warm pool's snapshots on (in a private
directory), warmed before the rounds (one session, then wait for the snapshot): each of its
sessions gets a VM restored from the snapshot.

Run with the tools venv, after ./dev setup (release binary, guest images):
  .venv-tools/bin/python bench/backends.py [--rounds 5] [--n 30] [--backends namespaces,gvisor,microvm,microvm-snapshot]
Listens and connects on 127.0.0.1 only.
"""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Api:
    def __init__(self, port, timeout):
        self.port = port
        self.timeout = timeout
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            self.conn.request(method, path, body=data, headers=headers)
            response = self.conn.getresponse()
            raw = response.read()
        except (http.client.HTTPException, OSError):
            # A dropped keep-alive connection: once more on a new one.
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            self.conn.request(method, path, body=data, headers=headers)
            response = self.conn.getresponse()
            raw = response.read()
        return response.status, (json.loads(raw) if raw else None)


def wait_ready(api, proc, deadline):
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"cellgate exited with {proc.returncode}")
        try:
            status, _ = api.call("GET", "/api")
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit("cellgate did not answer /api in time")


def warm(api, snapshot_dir, timeout):
    """One session of the microvm-snapshot policy, so the gateway makes its snapshot; waits
    until the snapshot is saved."""
    status, model = api.call("POST", "/v1/sessions", {"policy": "microvm-snapshot"})
    if status != 201:
        sys.exit(f"microvm-snapshot: create session: {status} {model}")
    t0 = time.monotonic()
    while not any(n.endswith(".vmstate") for n in os.listdir(snapshot_dir)):
        if time.monotonic() - t0 > timeout:
            sys.exit("microvm-snapshot: no snapshot was made")
        time.sleep(0.5)
    print(f"microvm-snapshot: snapshot saved {time.monotonic() - t0:.1f} s after the first session",
          file=sys.stderr, flush=True)
    api.call("DELETE", f"/v1/sessions/{model['id']}")


def mib(n):
    return f"{n / 2**20:.0f}"


def spread(values, fmt):
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="namespaces,gvisor,microvm,microvm-snapshot")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=30, help="1+1 round trips per session")
    p.add_argument("--idle", type=float, default=10.0, help="seconds idle before the memory reading")
    p.add_argument("--cellgate-bin", default=os.path.join(REPO, "target", "release", "cellgate"))
    p.add_argument("--kernels-dir", default=os.path.join(REPO, "kernels"))
    p.add_argument("--guest-dir", default=os.path.join(REPO, "target", "guest"))
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    backends = [b for b in args.backends.split(",") if b]

    with tempfile.TemporaryDirectory() as tmp:
        policies = os.path.join(tmp, "policies")
        os.mkdir(policies)
        open(os.path.join(policies, "default.toml"), "w").close()
        for b in backends:
            with open(os.path.join(policies, f"{b}.toml"), "w") as f:
                backend = "microvm" if b == "microvm-snapshot" else b
                f.write(f'[sandbox]\nbackend = "{backend}"\n[limits]\nmemory = "512MiB"\ncpus = 1\n')
        snapshot_dir = os.path.join(tmp, "snapshots")
        os.mkdir(snapshot_dir, 0o700)
        env = dict(os.environ, CELLGATE_GUEST_DIR=args.guest_dir, RUST_LOG="warn")
        procs, apis = [], {}

        def gateway(snapshots):
            port = free_port()
            log = open(os.path.join(tmp, f"cellgate-{len(procs)}.log"), "w")
            extra = ["--microvm-snapshot-dir", snapshot_dir] if snapshots else ["--microvm-snapshots", "false"]
            procs.append(subprocess.Popen(
                [args.cellgate_bin, "serve", "--ip", "127.0.0.1", "--port", str(port),
                 "--policies-dir", policies, "--kernels-dir", args.kernels_dir,
                 "--pool-size", "0", "--microvm-allow-emulation",
                 # A state directory per gateway: two never share one.
                 "--state-dir", os.path.join(tmp, f"state-{len(procs)}"),
                 "--kernels-outlive-gateway", "false", *extra],
                stdout=log, stderr=subprocess.STDOUT, env=env))
            api = Api(port, args.timeout)
            wait_ready(api, procs[-1], time.monotonic() + 60)
            return api

        try:
            plain = gateway(False)
            for b in backends:
                apis[b] = plain
            if "microvm-snapshot" in backends:
                apis["microvm-snapshot"] = gateway(True)
                warm(apis["microvm-snapshot"], snapshot_dir, args.timeout)
            results = {b: {"start": [], "p50": [], "idle": []} for b in backends}
            for r in range(args.rounds):
                for b in backends:
                    api = apis[b]
                    t0 = time.perf_counter()
                    status, model = api.call("POST", "/v1/sessions", {"policy": b})
                    started = time.perf_counter() - t0
                    if status != 201:
                        sys.exit(f"{b}: create session: {status} {model}")
                    sid = model["id"]
                    rtts = []
                    for _ in range(args.n):
                        t = time.perf_counter()
                        status, res = api.call("POST", f"/v1/sessions/{sid}/execute", {"code": "1+1"})
                        rtts.append(time.perf_counter() - t)
                        if status != 200 or res.get("result") != "2":
                            sys.exit(f"{b}: 1+1: {status} {res}")
                    time.sleep(args.idle)
                    status, res = api.call("POST", f"/v1/sessions/{sid}/execute", {"code": "0"})
                    memory = (res or {}).get("resources", {}).get("memory_bytes")
                    api.call("DELETE", f"/v1/sessions/{sid}")
                    results[b]["start"].append(started)
                    results[b]["p50"].append(statistics.median(rtts))
                    if memory:
                        results[b]["idle"].append(memory)
                    print(f"round {r + 1} {b}: start {started:.2f} s, 1+1 p50 "
                          f"{statistics.median(rtts) * 1000:.1f} ms, idle {mib(memory) if memory else '?'} MiB",
                          file=sys.stderr, flush=True)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)

    print(f"| backend | start (s) | `1+1` p50 (ms) | idle memory (MiB) |")
    print("|---|---|---|---|")
    for b in backends:
        res = results[b]
        idle = spread(res["idle"], mib) if res["idle"] else "n/a"
        print(f"| {b} | {spread(res['start'], lambda s: f'{s:.2f}')} | "
              f"{spread(res['p50'], lambda s: f'{s * 1000:.1f}')} | {idle} |")
    print(f"\n{args.rounds} rounds, N={args.n} per session, {args.idle:.0f} s idle; "
          f"median (min-max) over rounds; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
