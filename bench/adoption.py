#!/usr/bin/env python3
"""Adoption benchmark: how long a session is gone when its gateway is killed and started again.

Issue 31's target "adoption time per session after a restart". One state directory; per
round and per size N:

  1 start `cellgate serve` on it, create N API v1 sessions, run `x = <token>` in each
    (plus `--setup CODE`, e.g. an import, so the kernels hold some state);
  2 SIGKILL the gateway process alone (a crash: no shutdown path runs), start a new one on
    the same state directory and, as soon as it listens, ask every session for `x` at once;
  3 report, per session: `adoption_ms` from the new gateway's log (the adoption pass:
    record, pids, the key exchange, the ZMQ sockets, `kernel_info`), and what a client sees:
    the time from the new process's start to its answer, with the process's own start-up
    (until it listens) apart.

Modes (`--modes`):
  survive   `--kernels-outlive-gateway true`: the sandboxes outlive the gateway; the answer
            must be the old `x` (checked: a mismatch fails the run).
  restart   `--kernels-outlive-gateway false`, today's other choice: every kernel ends with
            the gateway and a session's next execute starts a new one (`x` is gone: the
            benchmark checks that NameError, so the two modes cannot be mixed up).
The ratio restart/survive is how much sooner a user gets an answer, and with state.

Backend: the policy's (`--policy`, default the gateway's default policy: namespaces kernels
forked from the zygote; `--sandbox gvisor` writes a policy for gVisor kernels under their
keepers). Both modes run on the same machine, build and policy, interleaved per round.

Run with the tools venv:  .venv-tools/bin/python bench/adoption.py [--sizes 1,10] [--rounds 3]
Default binary: target/release/cellgate (debug numbers are not representative). Listens on
127.0.0.1 only; every gateway and kernel is ended at the end, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (the end-to-end harness: targets, reaper, stats)
from e2e import HOST, REPO, ScenarioError, log, pct  # noqa: E402
from api_v1 import KeepAlive  # noqa: E402

ADOPTED = re.compile(r"session_id=(\S+).*adoption_ms=(\d+)|adoption_ms=(\d+).*session_id=(\S+)")


def gateway_cmd(a, state, outlive):
    def fn(port, token):
        return [a.cellgate_bin, "serve", "--ip", HOST, "--port", str(port), "--token", token,
                "--kernels-dir", a.kernels_dir, "--policies-dir", a.policies_dir,
                "--state-dir", state, "--kernels-outlive-gateway", "true" if outlive else "false",
                # An orphan of a run this harness could not clean up ends soon.
                "--orphan-grace", "60",
                # No warm pool: its kernels belong to no session, so after the SIGKILL nothing
                # adopts them and they would idle on until the grace (ARCHITECTURE.md, "left").
                "--pool-size", "0", *a.cellgate_arg]
    return fn


async def new_session(http, a):
    body = {"policy": a.policy} if a.policy else {}
    status, text = await http.request("POST", "/v1/sessions", body)
    if status != 201:
        raise ScenarioError(f"POST /v1/sessions: {status} {text[:300]!r}")
    return json.loads(text)["id"]


async def execute(http, session, code):
    status, body = await http.request("POST", f"/v1/sessions/{session}/execute", {"code": code})
    if status != 200:
        raise ScenarioError(f"execute in {session}: HTTP {status} {body[:300]!r}")
    return json.loads(body)


def text_of(result):
    """The `text/plain` of an execute result's value, if any."""
    return result.get("result")


def adoption_times(logfile):
    """session id -> adoption_ms, from a gateway's log."""
    found = {}
    with open(logfile, "rb") as f:
        for line in f.read().decode(errors="replace").splitlines():
            if "adoption_ms" not in line:
                continue
            m = ADOPTED.search(line)
            if m:
                sid, ms = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
                found[sid.strip('"')] = int(ms)
    return found


async def one_round(a, size, outlive):
    state = tempfile.mkdtemp(prefix="cg-bench-adopt-")
    tag = time.strftime("%Y%m%dT%H%M%S")
    first = e2e.GatewayTarget("cellgate", gateway_cmd(a, state, outlive), a, f"{tag}-adoption")
    second = None
    try:
        await first.start()
        http = KeepAlive(first.port, first.token)
        sessions = [await new_session(http, a) for _ in range(size)]
        tokens = {s: secrets.randbelow(1 << 40) for s in sessions}
        for s in sessions:
            for code in ([a.setup] if a.setup else []) + [f"x = {tokens[s]}"]:
                result = await execute(http, s, code)
                if result["status"] != "ok":
                    raise ScenarioError(f"set-up cell in {s}: {result['status']} {result.get('error')}")
        http.close()
        first.track_children()  # the reaper ends them if the run fails half-way
        os.kill(first.gateway_pid, signal.SIGKILL)
        first.proc.wait()
        first.proc = None

        second = first.fresh_instance()
        second.cmd_fn = gateway_cmd(a, state, outlive)
        spawned = time.monotonic()
        await second.start()
        listening = time.monotonic() - spawned

        async def ask(s):
            conn = KeepAlive(second.port, second.token)
            try:
                result = await execute(conn, s, "x")
            finally:
                conn.close()
            return s, time.monotonic() - spawned, result

        answers = await asyncio.gather(*(ask(s) for s in sessions))
        second.track_children()
        for s, _, result in answers:
            if outlive:
                if result["status"] != "ok" or text_of(result) != str(tokens[s]):
                    raise ScenarioError(f"survive: {s} answered {result['status']} "
                                        f"{text_of(result)!r}, not its x = {tokens[s]}")
            elif result["status"] != "error" or (result.get("error") or {}).get("ename") != "NameError":
                raise ScenarioError(f"restart: {s} should have lost x, answered {result['status']} "
                                    f"{text_of(result)!r}")
        adopted = adoption_times(second.logfile) if outlive else {}
        if outlive and set(adopted) != set(sessions):
            raise ScenarioError(f"survive: {len(adopted)} of {size} sessions adopted in the "
                                f"background pass (log: {second.logfile})")
        answered = [t for _, t, _ in answers]
        return {
            "sessions": size,
            "listening_s": listening,
            "answer_p50_s": pct(answered, 50),
            "answer_max_s": max(answered),
            "adoption_ms": sorted(adopted.values()),
        }
    finally:
        for target in (second, first):
            if target is not None:
                await target.stop()
        shutil.rmtree(state, ignore_errors=True)


async def amain(a):
    results = []
    for r in range(a.rounds):
        for size in [int(s) for s in a.sizes.split(",")]:
            for mode in a.modes.split(","):
                log(f"round {r + 1}/{a.rounds}: {size} sessions, {mode}")
                res = await one_round(a, size, mode == "survive")
                res.update(mode=mode, round=r + 1)
                print(json.dumps(res), flush=True)
                results.append(res)

    print("\nsessions  mode      listening s  answer p50 s  answer max s  adoption_ms p50 / max")
    for size in sorted({r["sessions"] for r in results}):
        for mode in a.modes.split(","):
            rows = [r for r in results if r["sessions"] == size and r["mode"] == mode]
            if not rows:
                continue
            adopt = [ms for r in rows for ms in r["adoption_ms"]]
            adopt_s = f"{pct(adopt, 50):.0f} / {max(adopt)}" if adopt else "-"
            print(f"{size:8d}  {mode:8s}  {pct([r['listening_s'] for r in rows], 50):11.3f}  "
                  f"{pct([r['answer_p50_s'] for r in rows], 50):12.3f}  "
                  f"{pct([r['answer_max_s'] for r in rows], 50):12.3f}  {adopt_s}")
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"binary": a.cellgate_bin, "args": vars(a), "rounds": results}, out, indent=2)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cellgate-bin", default=os.path.join(REPO, "target/release/cellgate"))
    p.add_argument("--cellgate-arg", action="append", default=[])
    p.add_argument("--kernels-dir", default=os.path.join(REPO, "kernels"))
    p.add_argument("--policies-dir", default=os.path.join(REPO, "policies"))
    p.add_argument("--sizes", default="1,10", help="sessions per round, comma-separated")
    p.add_argument("--modes", default="survive,restart")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policy", help="the sessions' policy (default: the gateway's default)")
    p.add_argument("--sandbox", choices=["gvisor"],
                   help="write a policies directory whose default policy runs this backend")
    p.add_argument("--setup", default="import numpy, pandas",
                   help="a cell run in every session before x (state worth keeping)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--start-timeout", type=float, default=60)
    p.add_argument("--http-timeout", type=float, default=300)
    a = p.parse_args()
    if a.sandbox:
        # The shipped default policy with another backend, in a scratch directory (removed
        # at the end, in main).
        a.policies_dir = tempfile.mkdtemp(prefix="cg-bench-adopt-policies-")
        with open(os.path.join(REPO, "policies", "default.toml")) as f:
            text = f.read()
        if 'backend = "namespaces"' not in text:
            raise SystemExit("policies/default.toml no longer names backend = \"namespaces\"")
        with open(os.path.join(a.policies_dir, "default.toml"), "w") as f:
            f.write(text.replace('backend = "namespaces"', f'backend = "{a.sandbox}"'))
    return a


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
        if a.sandbox:
            shutil.rmtree(a.policies_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
