#!/usr/bin/env python3
"""Benchmark: `pip install` of a cached wheel through cellgate's package index vs a local
`pip install` of the same file.

One cellgate gateway (namespaces sandbox) serves a wheelhouse with one pure-Python wheel
(written here) under a policy that allows it; one kernel runs every measurement, timed
inside the kernel around `python -m pip` so the WebSocket round trip is not counted:

  index   pip install --force-reinstall --no-deps cgbench   (proxy + index + bridge)
  local   pip install --force-reinstall --no-deps --no-index <the same .whl in the workspace>
  host    the same local install on the host, outside any sandbox, same interpreter

Rounds interleave the variants; the report gives medians and index/local.
Target (issue 4): index <= 1.2 x local.

Run with the tools venv:  .venv-tools/bin/python bench/pip_install.py [--rounds N]
Everything listens on 127.0.0.1 only; the gateway is killed at the end.
"""
import argparse
import asyncio
import base64
import hashlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (the WebSocket client and helpers)

REPO = e2e.REPO


def write_wheel(directory, name="cgbench", version="1.0"):
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n" + "# padding\n" * 2000,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    path = os.path.join(directory, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


CELL = """
import subprocess, sys, time, json
t = time.perf_counter()
p = subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--force-reinstall', '--no-deps', *{args!r}], capture_output=True, text=True)
print(json.dumps({{'s': time.perf_counter() - t, 'rc': p.returncode, 'err': p.stderr[-2000:]}}))
"""


async def run_cell(conn, code):
    out = []

    def on_msg(m):
        if m["header"]["msg_type"] == "stream" and m["content"]["name"] == "stdout":
            out.append(m["content"]["text"])

    await e2e.execute(conn, code, on_msg)
    return "".join(out)


async def measure(conn, args):
    result = json.loads((await run_cell(conn, CELL.format(args=args))).strip().splitlines()[-1])
    if result["rc"] != 0:
        raise SystemExit(f"pip failed: {result['err']}")
    return result["s"]


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    default_bin = os.path.join(REPO, "target/release/cellgate")
    ap.add_argument("--cellgate-bin", default=default_bin)
    a = ap.parse_args()
    if not os.path.exists(a.cellgate_bin):
        a.cellgate_bin = os.path.join(REPO, "target/debug/cellgate")
        e2e.loud(f"no release build: using {a.cellgate_bin} (a debug build; numbers are pessimistic)")
    tmp = tempfile.mkdtemp(prefix="cellgate-pipbench-")
    wheels = os.path.join(tmp, "wheels")
    policies = os.path.join(tmp, "policies")
    os.makedirs(wheels)
    os.makedirs(policies)
    wheel = write_wheel(wheels)
    with open(os.path.join(policies, "default.toml"), "w") as f:
        f.write('description = "pip benchmark"\n[packages]\nallow = ["cgbench"]\n')
    port, token = e2e.free_port(), secrets.token_hex(16)
    argv = [a.cellgate_bin, "serve", "--ip", e2e.HOST, "--port", str(port), "--token", token,
            "--kernels-dir", os.path.join(REPO, "kernels"), "--policies-dir", policies,
            "--wheelhouse", wheels, "--package-cache-dir", os.path.join(tmp, "cache"),
            "--pool-size", "0", "--state-dir", os.path.join(tmp, "state"),
            "--kernels-outlive-gateway", "false"]
    log = open(os.path.join(tmp, "cellgate.log"), "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        from tornado.httpclient import AsyncHTTPClient, HTTPRequest
        http = AsyncHTTPClient()
        base = f"http://{e2e.HOST}:{port}"
        for _ in range(200):
            try:
                await http.fetch(HTTPRequest(base + "/api", headers={"Authorization": f"token {token}"}))
                break
            except Exception:
                await asyncio.sleep(0.05)
        r = await http.fetch(HTTPRequest(base + "/api/kernels", method="POST",
                                         headers={"Authorization": f"token {token}"},
                                         body=json.dumps({"name": "python3"})))
        kid = json.loads(r.body)["id"]
        conn = await e2e.WSConn.open(port, token, kid)
        await e2e.ensure_iopub(conn)
        # The same file inside the sandbox, fetched once through the index.
        await run_cell(conn, "import urllib.request, json, os\n"
                             "idx = json.loads(urllib.request.urlopen(urllib.request.Request('http://packages.cellgate.internal/simple/cgbench/', headers={'Accept': 'application/vnd.pypi.simple.v1+json'})).read())\n"
                             "f = idx['files'][0]\n"
                             "open(f['filename'], 'wb').write(urllib.request.urlopen('http://packages.cellgate.internal' + f['url']).read())\n")
        local_file = os.path.basename(wheel)
        # Warm-up: one of each, not counted.
        await measure(conn, ["cgbench"])
        await measure(conn, ["--no-index", local_file])
        host_python = os.path.join(REPO, "kernels/python3/.venv/bin/python")
        host_prefix = os.path.join(tmp, "host-prefix")
        results = {"index": [], "local": [], "host": []}
        for i in range(a.rounds):
            order = ["index", "local", "host"]
            order = order[i % 3:] + order[:i % 3]
            for variant in order:
                if variant == "index":
                    results["index"].append(await measure(conn, ["cgbench"]))
                elif variant == "local":
                    results["local"].append(await measure(conn, ["--no-index", local_file]))
                else:
                    t = time.perf_counter()
                    subprocess.run([host_python, "-m", "pip", "install", "-q", "--force-reinstall",
                                    "--no-deps", "--no-index", "--prefix", host_prefix, wheel],
                                   check=True, capture_output=True,
                                   env={"PATH": "/usr/bin:/bin", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
                    results["host"].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in results.items()}
        print(json.dumps({"rounds": a.rounds, "median_s": med,
                          "index_over_local": med["index"] / med["local"],
                          "index_over_host": med["index"] / med["host"]}, indent=2))
        await conn.close()
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    asyncio.run(main())
