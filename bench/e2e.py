#!/usr/bin/env python3
"""End-to-end benchmark: bare jupyter_client vs Jupyter Kernel Gateway 3.0.1 vs cellgate.

The same scenarios run against every target, interleaved (for each scenario and
round: every target once, the order rotating between rounds), and the report
gives each target's median over rounds plus the ratios cellgate/bare, kg/bare
and cellgate/kg.

Targets
  bare      the kernel driven directly through jupyter_client (AsyncKernelManager
            + AsyncKernelClient over ZMQ), no gateway at all.
  kg        `python -m kernel_gateway` (Jupyter Kernel Gateway 3.0.1) from the tools
            venv, default settings apart from ip/port/auth_token/list_kernels.
  cellgate  `target/release/cellgate serve --ip 127.0.0.1 --port P --token T
            --kernels-dir kernels` (override the binary with --cellgate-bin).

kg and cellgate are driven by the SAME client code: HTTP (POST/DELETE/GET
/api/kernels) plus the legacy JSON WebSocket protocol on
/api/kernels/{id}/channels (one JSON object per text frame).

Scenarios (see BENCHMARKS.md for what each one means and its target):
  1 `1+1` round trip p50/p90/p99     2 gateway CPU per execute
  3 50 MB stdout throughput          4 one 5 MB PNG display_data
  5 WS connect + kernel_info         6 gateway RSS idle and per idle connection
  7 K kernels started at once        8 single kernel start -> ready
  9 first chart (pandas+matplotlib)  10 first seaborn chart
 11 K first charts at once           12 PSS/USS per session after its chart
 13 first `import sklearn`

Run with the tools venv:  .venv-tools/bin/python bench/e2e.py [--quick] ...
(`./dev bench ...` does exactly that).  Everything listens on 127.0.0.1 only.
Every process started here (gateways, kernels) is killed at the end, also on
Ctrl-C / SIGTERM / exceptions.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as _dt
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO, "bench")
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
HOST = "127.0.0.1"  # never anything else
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Kernel runtime files (connection files) of this run go to a private temp dir.
_RUNTIME_DIR = tempfile.mkdtemp(prefix="cellgate-bench-runtime-")
os.environ["JUPYTER_RUNTIME_DIR"] = _RUNTIME_DIR

try:
    import tornado  # noqa: F401
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
    from tornado.websocket import websocket_connect
    import jupyter_client  # noqa: F401
    from jupyter_client import AsyncKernelManager
except ImportError as e:  # pragma: no cover
    sys.exit(
        f"bench/e2e.py: {e}. Run it with the tools venv: "
        f".venv-tools/bin/python bench/e2e.py (or ./dev bench)"
    )

AsyncHTTPClient.configure(
    "tornado.simple_httpclient.SimpleAsyncHTTPClient", max_clients=1000
)


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def loud(msg):
    bar = "!" * 78
    print(f"\n{bar}\n!!! {msg}\n{bar}\n", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# process bookkeeping: every process we start is registered and killed at exit
# ---------------------------------------------------------------------------


def _proc_stat(pid):
    """Fields of /proc/pid/stat after the comm field (index 0 = state)."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    return data[data.rindex(")") + 2:].split()


def proc_starttime(pid):
    try:
        return int(_proc_stat(pid)[19])
    except (OSError, ValueError, IndexError):
        return None


def proc_cpu_ticks(pid):
    """utime+stime of the whole process (all threads, live and exited), in ticks."""
    f = _proc_stat(pid)
    return int(f[11]) + int(f[12])


def proc_cpu_ns_schedstat(pid):
    """Sum of per-thread on-CPU ns (/proc/pid/task/*/schedstat; live threads only)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def system_cpu_times():
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    total = sum(v[:8])
    return total - idle, total


def proc_rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def descendants(pid):
    """All descendant pids of pid (from /proc, ppid links)."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(_proc_stat(d)[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        for c in children.get(p, ()):
            out.append(c)
            stack.append(c)
    return out


class Reaper:
    """Registry of (pid, starttime) we are responsible for; kills process groups."""

    def __init__(self):
        self.procs = {}  # pid -> starttime
        self.own_pgid = os.getpgid(0)

    def add(self, pid):
        st = proc_starttime(pid)
        if st is not None:
            self.procs[pid] = st

    def add_tree(self, root_pid):
        for p in descendants(root_pid):
            self.add(p)

    def _alive_same(self, pid, st):
        return proc_starttime(pid) == st

    def kill_all(self, sig=signal.SIGKILL):
        for pid, st in list(self.procs.items()):
            if not self._alive_same(pid, st):
                self.procs.pop(pid, None)
                continue
            try:
                pgid = os.getpgid(pid)
            except OSError:
                pgid = None
            try:
                if pgid is not None and pgid != self.own_pgid and pgid == pid:
                    os.killpg(pgid, sig)  # the kernel / gateway leads its own group
                else:
                    os.kill(pid, sig)
            except OSError:
                pass

    def alive(self):
        return [p for p, st in self.procs.items() if self._alive_same(p, st)]


REAPER = Reaper()


def _set_pdeathsig():  # preexec_fn: gateway gets SIGTERM if this harness dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------


def free_port():
    s = socket.socket()
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pct(values, p):
    """Percentile with linear interpolation (p in 0..100)."""
    v = sorted(values)
    if not v:
        return None
    if len(v) == 1:
        return v[0]
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def median(values):
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def now_iso():
    return _dt.datetime.now(_dt.timezone.utc).isoformat()


class TargetUnavailable(Exception):
    pass


class ScenarioError(Exception):
    pass


class KernelDied(Exception):
    """The kernel process exited (e.g. a port race at start-up: "Address already in use")."""


# ---------------------------------------------------------------------------
# connections: one interface, two implementations (ZMQ direct, WebSocket)
# ---------------------------------------------------------------------------


class Conn:
    """A client connection to one kernel: send() a request, recv() messages."""

    session_id: str

    def send(self, msg_type, content, channel="shell") -> str:
        raise NotImplementedError

    async def recv(self) -> dict:
        raise NotImplementedError

    async def close(self):
        raise NotImplementedError


EXEC_CONTENT = dict(
    silent=False, store_history=True, user_expressions={}, allow_stdin=False,
    stop_on_error=True,
)


class WSConn(Conn):
    """Legacy Jupyter WebSocket protocol (one JSON text frame per message)."""

    def __init__(self, ws, session_id):
        self.ws = ws
        self.session_id = session_id

    @classmethod
    async def open(cls, port, token, kernel_id, timeout=60):
        session_id = uuid.uuid4().hex
        url = f"ws://{HOST}:{port}/api/kernels/{kernel_id}/channels?session_id={session_id}"
        req = HTTPRequest(url, headers={"Authorization": f"token {token}"},
                          connect_timeout=timeout, request_timeout=timeout)
        ws = await websocket_connect(req, max_message_size=1 << 31)
        ws.protocol.set_nodelay(True)  # a well-behaved client; we measure the gateway
        return cls(ws, session_id)

    def send(self, msg_type, content, channel="shell"):
        msg_id = uuid.uuid4().hex
        msg = {
            "header": {"msg_id": msg_id, "username": "bench", "session": self.session_id,
                       "msg_type": msg_type, "version": "5.3", "date": now_iso()},
            "parent_header": {}, "metadata": {}, "content": content,
            "channel": channel, "buffers": [],
        }
        self.ws.write_message(json.dumps(msg))
        return msg_id

    async def recv(self):
        m = await self.ws.read_message()
        if m is None:
            raise ConnectionError(f"websocket closed (code={self.ws.close_code} reason={self.ws.close_reason})")
        if isinstance(m, bytes):
            raise ScenarioError("unexpected binary frame on legacy JSON protocol")
        return json.loads(m)

    async def close(self):
        self.ws.close()


class ZMQConn(Conn):
    """jupyter_client AsyncKernelClient: shell + iopub sockets, messages merged."""

    def __init__(self, km):
        self.km = km
        self.kc = km.client()
        self.kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
        self.session = self.kc.session
        self.session_id = self.session.session
        self.q = asyncio.Queue()
        self.tasks = [
            asyncio.ensure_future(self._pump(self.kc.shell_channel.socket, "shell")),
            asyncio.ensure_future(self._pump(self.kc.iopub_channel.socket, "iopub")),
            asyncio.ensure_future(self._watch()),
        ]

    async def _watch(self):
        """Fail fast when the kernel process is gone (a gateway would notice too)."""
        try:
            while await self.km.is_alive():
                await asyncio.sleep(0.25)
            self.q.put_nowait(KernelDied(f"bare kernel exited (pid {getattr(self.km.provisioner, 'pid', '?')})"))
        except asyncio.CancelledError:
            pass
        except Exception as e:
            self.q.put_nowait(e)

    async def _pump(self, sock, channel):
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                _idents, parts = self.session.feed_identities(frames, copy=True)
                msg = self.session.deserialize(parts, content=True, copy=True)
                msg["channel"] = channel
                self.q.put_nowait(msg)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # surface errors to recv()
            self.q.put_nowait(e)

    def send(self, msg_type, content, channel="shell"):
        assert channel == "shell"
        msg = self.session.msg(msg_type, content)
        self.session.send(self.kc.shell_channel.socket, msg)
        return msg["header"]["msg_id"]

    async def recv(self):
        m = await self.q.get()
        if isinstance(m, Exception):
            raise m
        return m

    async def close(self):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.kc.stop_channels()


# -- protocol helpers shared by every target ---------------------------------


async def wait_reply_idle(conn, msg_id, on_msg=None, need_idle=True):
    """Receive until the shell reply to msg_id (and the idle status with that
    parent, if need_idle) arrived. Returns the reply content."""
    reply = None
    idle = not need_idle
    while reply is None or not idle:
        m = await conn.recv()
        if m.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        mt = m["header"]["msg_type"]
        if m.get("channel") == "shell" and mt.endswith("_reply"):
            reply = m["content"]
        elif mt == "status" and m["content"].get("execution_state") == "idle":
            idle = True
        elif on_msg is not None:
            on_msg(m)
    return reply


async def execute(conn, code, on_msg=None):
    msg_id = conn.send("execute_request", dict(EXEC_CONTENT, code=code))
    reply = await wait_reply_idle(conn, msg_id, on_msg)
    if reply.get("status") != "ok":
        raise ScenarioError(f"execute failed: {reply.get('ename')}: {reply.get('evalue')}")
    return reply


async def kernel_info(conn):
    msg_id = conn.send("kernel_info_request", {})
    return await wait_reply_idle(conn, msg_id, need_idle=False)


async def ensure_iopub(conn, tries=40):
    """Make sure iopub is flowing (the idle status of a kernel_info round trip
    arrives), like jupyter_server's 'nudge'. Not timed."""
    for _ in range(tries):
        msg_id = conn.send("kernel_info_request", {})
        try:
            await asyncio.wait_for(wait_reply_idle(conn, msg_id), 1.0)
            return
        except asyncio.TimeoutError:
            continue
    raise ScenarioError("iopub never delivered the idle status of kernel_info")


# ---------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------


class BareLimits:
    """Bare kernels under the limits cellgate's sandbox gives its kernels (`--bare-cpus`,
    `--bare-memory-mb`): each kernel in a cgroup of its own with a CFS quota and a memory
    limit, so ratios compare like with like. cgroup v2 when /sys/fs/cgroup is one, else the
    v1 `cpu` and `memory` hierarchies (the memory one under this process's own cgroup)."""

    PERIOD_US = 100_000

    def __init__(self, cpus, memory_mb):
        self.cpus, self.memory_mb = cpus, memory_mb
        self.dirs = []
        self.v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")

    @property
    def on(self):
        return bool(self.cpus or self.memory_mb)

    def describe(self):
        if not self.on:
            return "bare kernels run without CPU or memory limits (not like with like)"
        parts = []
        if self.cpus:
            parts.append(f"{self.cpus:g} CPU")
        if self.memory_mb:
            parts.append(f"{self.memory_mb} MiB")
        return (f"bare kernels each run in a cgroup of their own ({'v2' if self.v2 else 'v1'}) "
                f"limited to {', '.join(parts)}, like cellgate's default policy")

    def _own_v1(self, controller):
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if controller in names.split(","):
                    return path
        return "/"

    def apply(self, pid, tag):
        """Moves `pid` (a kernel that has just started) into a new limited cgroup."""
        if not self.on:
            return
        quota = int(self.cpus * self.PERIOD_US) if self.cpus else None
        limit = self.memory_mb << 20 if self.memory_mb else None
        if self.v2:
            d = f"/sys/fs/cgroup/cellgate-bench-{os.getpid()}-{tag}"
            os.makedirs(d, exist_ok=True)
            self.dirs.append(d)
            if quota:
                open(f"{d}/cpu.max", "w").write(f"{quota} {self.PERIOD_US}")
            if limit:
                open(f"{d}/memory.max", "w").write(str(limit))
            open(f"{d}/cgroup.procs", "w").write(str(pid))
            return
        for controller, files in (("cpu", {"cpu.cfs_period_us": self.PERIOD_US,
                                           "cpu.cfs_quota_us": quota} if quota else None),
                                  ("memory", {"memory.limit_in_bytes": limit} if limit else None)):
            if not files:
                continue
            base = "/sys/fs/cgroup/" + controller + self._own_v1(controller)
            d = os.path.join(base, f"cellgate-bench-{os.getpid()}-{tag}")
            os.makedirs(d, exist_ok=True)
            self.dirs.append(d)
            for name, value in files.items():
                with open(os.path.join(d, name), "w") as f:
                    f.write(str(value))
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def cleanup(self):
        for d in reversed(self.dirs):
            try:
                os.rmdir(d)
            except OSError:
                pass
        self.dirs = []


class BareTarget:
    name = "bare"
    gateway_pid = None

    def __init__(self, args):
        self.args = args
        self.kms = {}
        self.logf = None
        self.limits = BareLimits(args.bare_cpus, args.bare_memory_mb)

    async def start(self):
        pass

    async def ensure_running(self):
        pass

    async def new_kernel(self):
        km = AsyncKernelManager(kernel_name=self.args.kernel)
        if self.logf is None:
            os.makedirs(os.path.join(RESULTS_DIR, "logs"), exist_ok=True)
            self.logf = open(os.path.join(RESULTS_DIR, "logs", f"bare-kernels-{os.getpid()}.log"), "ab")
        await km.start_kernel(stdout=self.logf, stderr=self.logf)
        pid = getattr(km.provisioner, "pid", None)
        kid = uuid.uuid4().hex
        if pid:
            REAPER.add(pid)
            self.limits.apply(pid, kid)
        elif self.limits.on:
            raise ScenarioError("bare: no kernel pid to put under the limits")
        self.kms[kid] = km
        return kid

    async def connect(self, kid):
        return ZMQConn(self.kms[kid])

    async def delete_kernel(self, kid):
        km = self.kms.pop(kid, None)
        if km is not None:
            try:
                await km.shutdown_kernel(now=True)
            except Exception as e:
                log(f"bare: shutdown_kernel failed: {e}")

    async def stop(self):
        await asyncio.gather(*(self.delete_kernel(k) for k in list(self.kms)),
                             return_exceptions=True)
        self.limits.cleanup()

    def fresh_instance(self):
        return None


class GatewayTarget:
    """A kernel gateway process speaking Kernel Gateway's HTTP + WS API."""

    started = 0  # gateway processes started in this run (names the log files)

    def __init__(self, name, cmd_fn, args, run_tag):
        self.name = name
        self.cmd_fn = cmd_fn  # (port, token) -> argv
        self.args = args
        self.run_tag = run_tag
        self.proc = None
        self.port = None
        self.token = None
        self.kernels = set()
        self.logfile = None
        self.dead = False
        self.instances = 0

    @property
    def gateway_pid(self):
        return self.proc.pid if self.proc else None

    def fresh_instance(self):
        return GatewayTarget(self.name, self.cmd_fn, self.args, self.run_tag)

    async def start(self):
        self.instances += 1
        self.port = free_port()
        self.token = secrets.token_hex(16)
        argv = self.cmd_fn(self.port, self.token)
        logdir = os.path.join(RESULTS_DIR, "logs")
        os.makedirs(logdir, exist_ok=True)
        GatewayTarget.started += 1
        self.logfile = os.path.join(logdir, f"{self.run_tag}-{self.name}-{GatewayTarget.started}.log")
        lf = open(self.logfile, "wb")
        shown = [("***" if argv[i - 1] == "--token" else a.split("=")[0] + "=***" if "token=" in a else a)
                 for i, a in enumerate(argv)]
        log(f"{self.name}: starting {' '.join(shown)}")
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT,
                cwd=REPO, start_new_session=True, preexec_fn=_set_pdeathsig,
            )
        except OSError as e:
            raise TargetUnavailable(f"{self.name}: cannot exec {argv[0]}: {e}")
        finally:
            lf.close()
        REAPER.add(self.proc.pid)
        deadline = time.monotonic() + self.args.start_timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TargetUnavailable(
                    f"{self.name}: exited with {self.proc.returncode} during start-up\n{self.log_tail()}")
            try:
                r = await self.http("GET", "/api/kernels", timeout=2)
                if r.code < 500:
                    log(f"{self.name}: ready on {HOST}:{self.port} (pid {self.proc.pid})"
                        + ("" if r.code == 200 else f" (GET /api/kernels -> {r.code})"))
                    return
                last = f"HTTP {r.code}"
            except Exception as e:  # not listening yet
                last = repr(e)
            await asyncio.sleep(0.05)
        await self.stop()
        raise TargetUnavailable(f"{self.name}: not ready after {self.args.start_timeout}s ({last})\n{self.log_tail()}")

    async def ensure_running(self):
        if self.dead:
            raise TargetUnavailable(f"{self.name}: gave up on this target earlier")
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                loud(f"{self.name} DIED (exit {self.proc.returncode}); restarting it\n{self.log_tail()}")
                self.kernels.clear()
            try:
                await self.start()
            except TargetUnavailable:
                self.dead = True
                raise

    def log_tail(self, n=12):
        try:
            with open(self.logfile, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
            if len(lines) > 2 * n:  # the first lines often hold the error, the last the end
                lines = lines[:n] + ["..."] + lines[-n:]
            return "    " + "\n    ".join(lines) + f"\n    (log: {self.logfile})"
        except OSError:
            return ""

    async def http(self, method, path, body=None, timeout=None, raise_error=False):
        req = HTTPRequest(
            f"http://{HOST}:{self.port}{path}", method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
            body=None if body is None else json.dumps(body),
            request_timeout=timeout or self.args.http_timeout,
            connect_timeout=timeout or self.args.http_timeout,
            allow_nonstandard_methods=True,
        )
        return await AsyncHTTPClient().fetch(req, raise_error=raise_error)

    async def new_kernel(self):
        r = await self.http("POST", "/api/kernels", {"name": self.args.kernel})
        if r.code != 201:
            raise ScenarioError(f"{self.name}: POST /api/kernels -> {r.code} {r.body[:300]!r}")
        kid = json.loads(r.body)["id"]
        self.kernels.add(kid)
        return kid

    def track_children(self):
        if self.proc is not None and self.proc.poll() is None:
            REAPER.add_tree(self.proc.pid)

    async def connect(self, kid):
        return await WSConn.open(self.port, self.token, kid, timeout=self.args.http_timeout)

    async def delete_kernel(self, kid):
        self.track_children()
        try:
            r = await self.http("DELETE", f"/api/kernels/{kid}")
            if r.code not in (204, 404):
                log(f"{self.name}: DELETE kernel -> {r.code}")
        except Exception as e:
            log(f"{self.name}: DELETE kernel failed: {e!r}")
        self.kernels.discard(kid)

    async def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.track_children()
            try:
                r = await self.http("GET", "/api/kernels", timeout=5)
                if r.code == 200:
                    self.kernels |= {k["id"] for k in json.loads(r.body)}
            except Exception:
                pass
            await asyncio.gather(*(self.delete_kernel(k) for k in list(self.kernels)),
                                 return_exceptions=True)
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except OSError:
                pass
            for _ in range(100):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            if self.proc.poll() is None:
                log(f"{self.name}: did not exit on SIGTERM; SIGKILL")
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.proc.wait()
        self.proc = None


def kg_cmd(args):
    def fn(port, token):
        return [args.python, "-m", "kernel_gateway",
                f"--KernelGatewayApp.ip={HOST}", f"--KernelGatewayApp.port={port}",
                f"--KernelGatewayApp.auth_token={token}",
                # KG 3.0.1 has list_kernels on the websocket personality
                # (`--KernelGatewayApp.list_kernels` is "not recognized" there).
                "--JupyterWebsocketPersonality.list_kernels=True", *args.kg_arg]
    return fn


def cellgate_cmd(args):
    def fn(port, token):
        # A fresh state directory per gateway (the store on, as in production; nothing
        # carried from one run to the next, never two gateways on one directory).
        state = tempfile.mkdtemp(prefix="cg-bench-state-")
        # Kernels end with the gateway: a killed run's kernels must not idle on, beside
        # the next run's, for an orphan's grace.
        return [args.cellgate_bin, "serve", "--ip", HOST, "--port", str(port),
                "--token", token, "--kernels-dir", args.kernels_dir,
                "--policies-dir", args.policies_dir, "--state-dir", state,
                "--kernels-outlive-gateway", "false", *args.cellgate_arg]
    return fn


# ---------------------------------------------------------------------------
# scenarios: each returns a dict of metrics for one (target, round)
# ---------------------------------------------------------------------------


async def close_quietly(conn):
    if conn is not None:
        try:
            await conn.close()
        except Exception:
            pass


async def ready_kernel(t, attempts=3):
    """Untimed set-up: start a kernel, connect, make iopub flow. A kernel that dies
    while starting (port race with other processes) is replaced."""
    for i in range(attempts):
        kid = await t.new_kernel()
        conn = None
        try:
            if hasattr(t, "track_children"):
                t.track_children()
            conn = await t.connect(kid)
            await ensure_iopub(conn)
            return kid, conn
        except KernelDied as e:
            log(f"{t.name}: kernel died during set-up ({e}); retrying")
            await close_quietly(conn)
            await t.delete_kernel(kid)
            if i == attempts - 1:
                raise
        except BaseException:
            await close_quietly(conn)
            await t.delete_kernel(kid)
            raise


async def with_kernel(t, fn):
    """Start a kernel, connect, make iopub flow, run fn(conn); always clean up."""
    kid, conn = await ready_kernel(t)
    try:
        return await fn(conn)
    finally:
        await close_quietly(conn)
        await t.delete_kernel(kid)


async def sc_roundtrip(t, a):
    """Scenarios 1+2: `1+1` round trips; gateway CPU during the measured ones."""
    async def run(conn):
        for _ in range(a.warmup):
            await execute(conn, a.one_plus_one)
        pid = t.gateway_pid
        my0 = time.process_time()
        if pid:
            c0, s0 = proc_cpu_ticks(pid), proc_cpu_ns_schedstat(pid)
        lat = []
        for _ in range(a.n):
            t0 = time.perf_counter()
            await execute(conn, a.one_plus_one)
            lat.append((time.perf_counter() - t0) * 1e3)
        res = {
            "rt_p50_ms": pct(lat, 50), "rt_p90_ms": pct(lat, 90), "rt_p99_ms": pct(lat, 99),
            "rt_mean_ms": statistics.fmean(lat), "rt_max_ms": max(lat), "n": a.n,
            "client_cpu_ms_per_exec": (time.process_time() - my0) * 1e3 / a.n,
        }
        if pid:
            c1, s1 = proc_cpu_ticks(pid), proc_cpu_ns_schedstat(pid)
            res["cpu_ms_per_exec"] = (c1 - c0) * 1e3 / CLK_TCK / a.n
            res["cpu_ms_per_exec_schedstat"] = (s1 - s0) / 1e6 / a.n if s0 is not None else None
        return res
    return await with_kernel(t, run)


OUTPUT_CODE = (
    "import sys\n"
    "_s = 'x' * 999 + '\\n'\n"
    "for _ in range({lines}):\n"
    "    sys.stdout.write(_s)\n"
)


async def sc_output(t, a):
    """Scenario 3: a cell writing `output_mb` MB to stdout; time until idle."""
    lines = int(a.output_mb * 1000)
    expected = lines * 1000

    async def one(conn, nlines):
        got = [0, 0]  # bytes, messages
        notes = []

        def on_msg(m):
            mt = m["header"]["msg_type"]
            if mt == "stream":
                if m["content"].get("name") == "stdout":
                    got[0] += len(m["content"]["text"])
                    got[1] += 1
                else:
                    notes.append(m["content"].get("text", "")[:200])
        t0 = time.perf_counter()
        await execute(conn, OUTPUT_CODE.format(lines=nlines), on_msg)
        return time.perf_counter() - t0, got[0], got[1], notes

    async def run(conn):
        await one(conn, 1000)  # warm-up: 1 MB
        times, received, msgs, notes = [], [], [], []
        for _ in range(a.reps):
            dt, nbytes, nmsg, nt = await one(conn, lines)
            times.append(dt)
            received.append(nbytes)
            msgs.append(nmsg)
            notes += nt
        dt = statistics.median(times)
        complete = min(received) == expected
        res = {"out_s": dt, "out_mb_s": expected / 1e6 / dt if complete else None,
               "out_mb_s_received": min(received) / 1e6 / dt,
               "out_delivered_pct": 100.0 * min(received) / expected, "out_bytes_expected": expected,
               "out_bytes_received_min": min(received), "out_stream_msgs": statistics.median(msgs),
               "out_complete": min(received) == expected}
        if min(received) != expected:
            res["out_note"] = (f"only {min(received)} of {expected} bytes received"
                               + (f"; stderr/other: {notes[0]!r}" if notes else ""))
            log(f"{t.name}: scenario 3: {res['out_note']}")
        return res
    return await with_kernel(t, run)


PNG_SETUP = r"""
import os, struct, zlib
def _chunk(tag, data):
    return struct.pack('>I', len(data)) + tag + data + struct.pack('>I', zlib.crc32(tag + data) & 0xffffffff)
_w = {side}
_raw = b''.join(b'\x00' + os.urandom(_w * 3) for _ in range(_w))
_png = (b'\x89PNG\r\n\x1a\n' + _chunk(b'IHDR', struct.pack('>IIBBBBB', _w, _w, 8, 2, 0, 0, 0))
        + _chunk(b'IDAT', zlib.compress(_raw, 1)) + _chunk(b'IEND', b''))
del _raw
from IPython.display import Image, display
"""
PNG_SHOW = "display(Image(data=_png))"


async def sc_png(t, a):
    """Scenario 4: one ~5 MB PNG display_data (base64 in the JSON); time until idle."""
    side = int((a.png_mb * 1e6 / 3) ** 0.5)

    async def one(conn):
        got = []

        def on_msg(m):
            if m["header"]["msg_type"] == "display_data":
                got.append(len(m["content"]["data"].get("image/png", "")))
        t0 = time.perf_counter()
        await execute(conn, PNG_SHOW, on_msg)
        return time.perf_counter() - t0, got

    async def run(conn):
        await execute(conn, PNG_SETUP.format(side=side))
        await one(conn)  # warm-up
        times, sizes = [], []
        for _ in range(a.reps):
            dt, got = await one(conn)
            if len(got) != 1 or got[0] < a.png_mb * 1e6 * 4 / 3 * 0.95:
                raise ScenarioError(f"PNG display_data not received intact: {got}")
            times.append(dt)
            sizes.append(got[0])
        return {"png_ms": statistics.median(times) * 1e3, "png_b64_bytes": sizes[0],
                "png_bytes": sizes[0] * 3 // 4}
    return await with_kernel(t, run)


def raw_upgrade_ms(port, token, kid):
    """The WebSocket upgrade alone, with a client that costs next to nothing: a blocking
    socket writes the upgrade request and reads until the end of the 101 response. The
    tornado client of the other measurements spends ~2 ms of its own per connection (a
    gateway's 0.2 ms upgrade reads as 2.3 ms there), so this is the gateway's share."""
    t0 = time.perf_counter()
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall((f"GET /api/kernels/{kid}/channels?session_id={uuid.uuid4().hex} HTTP/1.1\r\n"
                   f"Host: {HOST}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                   f"Authorization: token {token}\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        dt = (time.perf_counter() - t0) * 1e3
    if not head.startswith(b"HTTP/1.1 101"):
        raise ScenarioError(f"raw upgrade: {head[:120]!r}")
    return dt


async def sc_reconnect(t, a):
    """Scenario 5: connect (WS upgrade / ZMQ channels) + first kernel_info_reply."""
    kid, c = await ready_kernel(t)
    try:
        await c.close()
        conn_ms, ki_ms = [], []
        for i in range(a.n5 + 2):
            t0 = time.perf_counter()
            c = await t.connect(kid)
            t1 = time.perf_counter()
            await kernel_info(c)
            t2 = time.perf_counter()
            await c.close()
            if i >= 2:  # 2 warm-ups
                conn_ms.append((t1 - t0) * 1e3)
                ki_ms.append((t2 - t1) * 1e3)
            await asyncio.sleep(0.02)
        out = {"ws_connect_ms": statistics.median(conn_ms), "ws_kernel_info_ms": statistics.median(ki_ms),
               "ws_total_ms": statistics.median([x + y for x, y in zip(conn_ms, ki_ms)]),
               "ws_connect_p90_ms": pct(conn_ms, 90), "ws_kernel_info_p90_ms": pct(ki_ms, 90)}
        if getattr(t, "port", None):
            raw = [raw_upgrade_ms(t.port, t.token, kid) for _ in range(a.n5 + 2)][2:]
            out["ws_upgrade_raw_ms"] = statistics.median(raw)
        return out
    finally:
        await t.delete_kernel(kid)


async def sc_memory(t, a):
    """Scenario 6: RSS of a fresh gateway idle, and per idle WS connection."""
    g = t.fresh_instance()
    if g is None:
        return {"na": "no gateway process"}
    conns = []
    kid = None
    try:
        await g.start()
        await asyncio.sleep(2.0)
        idle = proc_rss_kb(g.gateway_pid)
        kid = await g.new_kernel()
        g.track_children()
        first = await g.connect(kid)
        await ensure_iopub(first)
        conns.append(first)
        await asyncio.sleep(1.0)
        base = proc_rss_kb(g.gateway_pid)
        for i in range(a.m):
            c = await g.connect(kid)
            await kernel_info(c)
            conns.append(c)
        await asyncio.sleep(2.0)
        after = proc_rss_kb(g.gateway_pid)
        return {"idle_rss_mb": idle / 1024, "rss_1conn_mb": base / 1024,
                "rss_mconn_mb": after / 1024, "m": a.m,
                "per_conn_kb": (after - base) / a.m}
    finally:
        for c in conns:
            try:
                await c.close()
            except Exception:
                pass
        await asyncio.sleep(0.2)
        await g.stop()


async def sc_many(t, a):
    """Scenario 7: K kernels started at once; all ready; one `1+1` each at once."""
    K = a.kernels
    t0 = time.perf_counter()
    kids, conns, ready = [], [], []
    errors, restarts = [], []

    async def one():
        for attempt in range(3):
            kid = await t.new_kernel()
            kids.append(kid)
            c = await t.connect(kid)
            conns.append(c)
            try:
                await kernel_info(c)
            except KernelDied as e:  # counted in the time; a gateway restarts it too
                restarts.append(repr(e))
                log(f"{t.name}: scenario 7: {e}; starting a replacement kernel")
                continue
            ready.append(time.perf_counter() - t0)
            return c
        raise KernelDied("3 kernels in a row died")

    try:
        res = await asyncio.gather(*(asyncio.wait_for(one(), a.many_timeout) for _ in range(K)),
                                   return_exceptions=True)
        errors = [repr(r) for r in res if isinstance(r, BaseException)]
        all_ready = time.perf_counter() - t0
        if hasattr(t, "track_children"):
            t.track_children()
        ok = [r for r in res if not isinstance(r, BaseException)]
        if errors:
            log(f"{t.name}: scenario 7: {len(errors)} of {K} kernels failed: {errors[:3]}")
        if not ok:
            raise ScenarioError(f"no kernel became ready: {errors[:3]}")
        # make sure iopub flows on each (not timed), then 1+1 on all at once
        await asyncio.gather(*(ensure_iopub(c) for c in ok))

        async def ex(c):
            s = time.perf_counter()
            await execute(c, a.one_plus_one)
            return (time.perf_counter() - s) * 1e3
        s = time.perf_counter()
        lat = await asyncio.gather(*(asyncio.wait_for(ex(c), a.many_timeout) for c in ok),
                                   return_exceptions=True)
        exec_all = time.perf_counter() - s
        bad = [repr(x) for x in lat if isinstance(x, BaseException)]
        lat = [x for x in lat if not isinstance(x, BaseException)]
        return {"many_k": K, "many_ready_n": len(ok), "many_all_ready_s": all_ready if not errors else None,
                "many_ready_p50_s": pct(ready, 50), "many_ready_max_s": max(ready),
                "many_exec_p50_ms": pct(lat, 50), "many_exec_p99_ms": pct(lat, 99),
                "many_exec_all_s": exec_all, "many_errors": errors + bad, "many_restarts": restarts}
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        if hasattr(t, "track_children"):
            t.track_children()
        await asyncio.gather(*(t.delete_kernel(k) for k in kids), return_exceptions=True)


async def sc_start(t, a):
    """Scenario 8: one kernel: start request -> first kernel_info_reply."""
    times, died = [], []
    for _ in range(a.n8):
        t0 = time.perf_counter()
        kid = await t.new_kernel()
        c = None
        try:
            c = await t.connect(kid)
            await kernel_info(c)
            times.append((time.perf_counter() - t0) * 1e3)
        except KernelDied as e:
            died.append(repr(e))
            log(f"{t.name}: scenario 8: {e}; sample discarded")
        finally:
            if c is not None:
                await c.close()
            if hasattr(t, "track_children"):
                t.track_children()
            await t.delete_kernel(kid)
        await asyncio.sleep(0.3)
    if not times:
        raise ScenarioError(f"every kernel died while starting: {died[:2]}")
    return {"start_ready_ms": statistics.median(times), "start_ready_max_ms": max(times),
            "start_died": died}


# The first question of a chat about data: a DataFrame and its chart (issue 28).
CHART_CELL = (
    "import pandas as pd\n"
    "import matplotlib.pyplot as plt\n"
    "df = pd.DataFrame({'month': range(1, 13), 'revenue': [3 + (i * 7) % 5 for i in range(12)]})\n"
    "df.plot(x='month', y='revenue', title='Revenue by month')\n"
    "plt.show()\n"
)
SEABORN_CELL = (
    "import seaborn as sns\n"
    "import pandas as pd\n"
    "import matplotlib.pyplot as plt\n"
    "df = pd.DataFrame({'x': range(50), 'y': [(i * 37) % 11 for i in range(50)], 'g': ['a', 'b'] * 25})\n"
    "sns.scatterplot(data=df, x='x', y='y', hue='g')\n"
    "plt.show()\n"
)


def png_watcher(pngs, t0):
    """An on_msg that records when (seconds since t0) each PNG display arrives."""
    def on_msg(m):
        if m["header"]["msg_type"] in ("display_data", "execute_result") and \
                "image/png" in m["content"].get("data", {}):
            pngs.append(time.perf_counter() - t0)
    return on_msg


async def first_chart(t, cell):
    """New kernel -> ready -> `cell` until its PNG display_data and idle; seconds.
    Returns (ready_s, chart_s, again_s): ready and the first chart from the start request,
    and the same cell run once more in the same kernel (from its execute request): what
    drawing the chart costs once everything is loaded, the floor a first chart can reach."""
    t0 = time.perf_counter()
    kid = await t.new_kernel()
    c = None
    try:
        c = await t.connect(kid)
        await kernel_info(c)
        ready = time.perf_counter() - t0
        pngs = []
        await execute(c, cell, png_watcher(pngs, t0))
        if not pngs:
            raise ScenarioError("the chart cell displayed no PNG")
        again = []
        t1 = time.perf_counter()
        await execute(c, cell, png_watcher(again, t1))
        if not again:
            raise ScenarioError("the chart cell run again displayed no PNG")
        return ready, pngs[0], again[0]
    finally:
        if c is not None:
            await c.close()
        if hasattr(t, "track_children"):
            t.track_children()
        await t.delete_kernel(kid)


async def sc_first_chart(t, a):
    """Scenarios 9 and 10: a new kernel's first chart, one after another: pandas +
    matplotlib (9), seaborn (10, when the kernel's environment has it)."""
    out = {}
    for key, cell in (("chart", CHART_CELL), ("seaborn", SEABORN_CELL)):
        ready, chart, again = [], [], []
        for _ in range(a.n9):
            try:
                r, c, g = await first_chart(t, cell)
            except ScenarioError as e:
                if key == "seaborn":
                    out["seaborn_na"] = str(e)
                    break
                raise
            ready.append(r * 1e3)
            chart.append(c * 1e3)
            again.append(g * 1e3)
            await asyncio.sleep(1.0)  # lets a warm pool refill, as between two users
        if chart:
            out[f"{key}_p50_ms"] = statistics.median(chart)
            out[f"{key}_max_ms"] = max(chart)
            out[f"{key}_ready_p50_ms"] = statistics.median(ready)
            out[f"{key}_again_p50_ms"] = statistics.median(again)
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pss_uss_kb(pid):
    fields = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    fields[parts[0].rstrip(":")] = int(parts[1])
    except OSError:
        return None
    return fields.get("Pss", 0), fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)


def session_memory_kb(root):
    """Mean PSS and USS (kB) per session among `root`'s descendants, and how many sessions.

    A session is everything started for one kernel: under cellgate, its sandbox's helper,
    init, egress bridge and the kernel (forked from a zygote or started cold); bare, the
    kernel process. A zygote is not a session's: its cost is shared by all of them (reported
    apart, as `zygote_pss_mb`). Each session's subtree is found from its kernel up to the
    process whose parent is `root` or a zygote."""
    pids = descendants(root)
    parent = {}
    for pid in pids:
        try:
            parent[pid] = int(_proc_stat(str(pid))[1])
        except (OSError, ValueError, IndexError):
            continue
    cmd = {pid: _cmdline(pid) for pid in pids}
    zygotes = {p for p in pids if b"--cellgate-ns-zygote" in cmd[p]
               and b"--cellgate-ns-zygote" not in cmd.get(parent.get(p), b"")}
    kernels = [p for p in pids if p not in zygotes
               and (b"ipykernel" in cmd[p] or b"cellgate_kernel_launcher" in cmd[p])
               and b"--cellgate-ns-zygote" not in cmd[p]]
    children = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    pss, uss = [], []
    for kernel in kernels:
        top = kernel
        while parent.get(top) not in (None, root) and parent.get(top) not in zygotes:
            top = parent[top]
        total_pss = total_uss = 0
        stack = [top]
        while stack:
            p = stack.pop()
            mem = _pss_uss_kb(p)
            if mem is not None:
                total_pss += mem[0]
                total_uss += mem[1]
            stack.extend(children.get(p, ()))
        pss.append(total_pss)
        uss.append(total_uss)
    if not pss:
        return None
    zygote_pss = sum((_pss_uss_kb(z) or (0, 0))[0] for z in zygotes)
    return statistics.mean(pss), statistics.mean(uss), len(pss), zygote_pss


async def sc_chart_burst(t, a):
    """Scenario 11: K new kernels at once, each making its first chart: until all charts
    are in, and the p50. Then (12) the kernels' mean PSS and USS, idle after the chart."""
    K = a.chart_burst
    t0 = time.perf_counter()
    kids, conns, done = [], [], []

    async def one():
        kid = await t.new_kernel()
        kids.append(kid)
        c = await t.connect(kid)
        conns.append(c)
        await kernel_info(c)
        pngs = []
        await execute(c, CHART_CELL, png_watcher(pngs, t0))
        if not pngs:
            raise ScenarioError("the chart cell displayed no PNG")
        done.append(time.perf_counter() - t0)

    try:
        res = await asyncio.gather(*(asyncio.wait_for(one(), a.many_timeout) for _ in range(K)),
                                   return_exceptions=True)
        errors = [repr(r) for r in res if isinstance(r, BaseException)]
        if not done:
            raise ScenarioError(f"no chart arrived: {errors[:3]}")
        out = {"burst_k": K, "burst_all_s": max(done) if not errors else None,
               "burst_p50_s": pct(done, 50), "burst_errors": errors}
        await asyncio.sleep(3.0)
        root = t.gateway_pid or os.getpid()
        mem = session_memory_kb(root)
        if mem is not None:
            out["session_pss_mb"] = mem[0] / 1024
            out["session_uss_mb"] = mem[1] / 1024
            out["sessions_measured"] = mem[2]
            out["zygote_pss_mb"] = mem[3] / 1024
        return out
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        if hasattr(t, "track_children"):
            t.track_children()
        await asyncio.gather(*(t.delete_kernel(k) for k in kids), return_exceptions=True)


async def sc_first_import(t, a):
    """Scenario 13: a ready kernel's first `import sklearn` (scikit-learn), when its
    environment has it."""
    async def run(conn):
        s = time.perf_counter()
        msg_id = conn.send("execute_request", dict(EXEC_CONTENT, code="import sklearn"))
        reply = await wait_reply_idle(conn, msg_id)
        if reply.get("status") != "ok":
            return {"sklearn_na": f"{reply.get('ename')}: {reply.get('evalue')}"}
        return {"sklearn_import_ms": (time.perf_counter() - s) * 1e3}
    return await with_kernel(t, run)


# scenario id -> (runner, ids of the scenarios whose metrics it produces)
RUNNERS = {
    "rt": (sc_roundtrip, (1, 2)),
    "out": (sc_output, (3,)),
    "png": (sc_png, (4,)),
    "ws": (sc_reconnect, (5,)),
    "mem": (sc_memory, (6,)),
    "start": (sc_start, (8,)),
    "chart": (sc_first_chart, (9, 10)),
    "sklearn": (sc_first_import, (13,)),
    "burst": (sc_chart_burst, (11, 12)),
    "many": (sc_many, (7,)),  # last: 50 kernels leave the load average high for a while
}

# (scenario, metric, label, unit, better, target) ; target: ("rel", x) = x * bare,
# ("abs", x) = absolute bound; ("min_rel", x) = >= x * bare; ("rel_kg", x) = < x * kg
METRICS = [
    (1, "rt_p50_ms", "`1+1` round trip p50", "ms", "lower", ("rel", 1.15)),
    (1, "rt_p90_ms", "`1+1` round trip p90", "ms", "lower", None),
    (1, "rt_p99_ms", "`1+1` round trip p99", "ms", "lower", ("rel", 2.0)),
    (2, "cpu_ms_per_exec", "gateway CPU per execute", "ms", "lower", ("abs", 0.1)),
    (2, "cpu_ms_per_exec_schedstat", "gateway CPU per execute (schedstat)", "ms", "lower", ("abs", 0.1)),
    (3, "out_mb_s", "stdout throughput", "MB/s", "higher", ("min_rel", 0.95)),
    (3, "out_s", "stdout: time until idle", "s", "lower", None),
    (3, "out_delivered_pct", "stdout: bytes delivered", "%", "higher", None),
    (4, "png_ms", "5 MB PNG display: time until idle", "ms", "lower", ("rel", 1.1)),
    (5, "ws_connect_ms", "connect (WS open, tornado client)", "ms", "lower", None),
    (5, "ws_upgrade_raw_ms", "connect (WS upgrade → 101, raw socket client)", "ms", "lower", ("abs", 1.0)),
    (5, "ws_kernel_info_ms", "open → kernel_info_reply", "ms", "lower", ("abs", 5.0)),
    (6, "idle_rss_mb", "gateway RSS idle", "MB", "lower", ("abs", 30.0)),
    (6, "per_conn_kb", "RSS per idle WS connection", "KB", "lower", ("abs", 50.0)),
    (7, "many_all_ready_s", "K kernels at once: all ready", "s", "lower", ("rel_kg", 1.0)),
    (7, "many_exec_p99_ms", "K kernels: concurrent `1+1` p99", "ms", "lower", ("abs", 100.0)),
    (8, "start_ready_ms", "kernel start → ready (median)", "ms", "lower", None),
    (9, "chart_p50_ms", "first chart (pandas + matplotlib) p50, from the start request", "ms", "lower", ("abs", 100.0)),
    (9, "chart_ready_p50_ms", "first chart: kernel ready p50", "ms", "lower", None),
    (9, "chart_again_p50_ms", "the same chart again in that kernel p50 (the floor)", "ms", "lower", None),
    (10, "seaborn_p50_ms", "first seaborn chart p50, from the start request", "ms", "lower", None),
    (10, "seaborn_again_p50_ms", "the same seaborn chart again in that kernel p50", "ms", "lower", None),
    (11, "burst_all_s", "K first charts at once: all done", "s", "lower", ("abs", 1.5)),
    (11, "burst_p50_s", "K first charts at once: p50", "s", "lower", None),
    (12, "session_pss_mb", "PSS per session after its chart", "MB", "lower", None),
    (12, "session_uss_mb", "USS per session after its chart", "MB", "lower", ("abs", 10.0)),
    (13, "sklearn_import_ms", "first `import sklearn`", "ms", "lower", None),
]


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------


def machine_info():
    info = {"cores": os.cpu_count(), "platform": platform.platform(),
            "python": sys.version.split()[0], "loadavg_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import importlib.metadata as md
        info["versions"] = {p: md.version(p) for p in
                            ("jupyter_client", "jupyter_kernel_gateway", "ipykernel", "tornado", "pyzmq")}
    except Exception:
        pass
    return info


async def sample_busy(seconds):
    b0, t0 = system_cpu_times()
    await asyncio.sleep(seconds)
    b1, t1 = system_cpu_times()
    return 100.0 * (b1 - b0) / max(1, t1 - t0)


async def background_busy(a):
    """Whole-machine CPU busy % while this harness and its targets sit idle (i.e. what
    other processes use), sampled for --pause seconds before every run. With
    --wait-quiet PCT, wait (up to --wait-quiet-max s) until it is below PCT."""
    bg = await sample_busy(a.pause)
    if a.wait_quiet is not None and bg > a.wait_quiet:
        deadline = time.monotonic() + a.wait_quiet_max
        log(f"background CPU {bg:.0f}% > {a.wait_quiet:g}%: waiting for a quieter machine")
        while bg > a.wait_quiet and time.monotonic() < deadline:
            bg = await sample_busy(max(a.pause, 1.0))
        if bg > a.wait_quiet:
            log(f"still {bg:.0f}% busy after {a.wait_quiet_max:g}s; running anyway")
    return bg


async def run_all(a, targets, scenario_ids):
    runners = [k for k, (_, ids) in RUNNERS.items() if set(ids) & scenario_ids]
    results = {}
    for key in runners:
        fn, ids = RUNNERS[key]
        results[key] = {t.name: {"rounds": [], "errors": []} for t in targets}
        for r in range(a.rounds):
            order = targets[r % len(targets):] + targets[:r % len(targets)]
            for t in order:
                if key == "mem" and t.gateway_pid is None and t.name == "bare":
                    continue
                cell = results[key][t.name]
                try:
                    await t.ensure_running()
                except TargetUnavailable as e:
                    cell["errors"].append(f"target unavailable: {str(e).splitlines()[0]}")
                    continue
                bg = await background_busy(a)
                log(f"scenario {'+'.join(map(str, ids))} ({key}) round {r + 1}/{a.rounds} target {t.name} "
                    f"(load {os.getloadavg()[0]:.2f}, background CPU {bg:.0f}%)")
                try:
                    b0, t0 = system_cpu_times()
                    m = await asyncio.wait_for(fn(t, a), a.scenario_timeout)
                    b1, t1 = system_cpu_times()
                    m["loadavg1"] = os.getloadavg()[0]
                    m["background_cpu_pct"] = bg
                    # whole-machine CPU busy during this run (harness + target + anything else)
                    m["machine_cpu_busy_pct"] = 100.0 * (b1 - b0) / max(1, t1 - t0)
                    cell["rounds"].append(m)
                    log(f"  {t.name}: " + ", ".join(
                        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in m.items() if k in {x[1] for x in METRICS}))
                except Exception as e:  # record and go on with the other targets
                    msg = f"{type(e).__name__}: {e}"
                    cell["errors"].append(msg)
                    loud(f"{t.name}: scenario {key} round {r + 1} FAILED: {msg}")
                    if a.verbose:
                        traceback.print_exc()
                    if isinstance(t, GatewayTarget) and t.proc is not None and t.proc.poll() is not None:
                        loud(f"{t.name} exited ({t.proc.returncode}):\n{t.log_tail()}")
    return results


def summarize(results, target_names, scenario_ids):
    rows = []
    for sid, metric, label, unit, better, tgt in METRICS:
        if sid not in scenario_ids:
            continue
        key = next(k for k, (_, ids) in RUNNERS.items() if sid in ids)
        vals = {}
        for tn in target_names:
            cell = results.get(key, {}).get(tn)
            if not cell:
                continue
            vs = [rd.get(metric) for rd in cell["rounds"] if rd.get(metric) is not None]
            vals[tn] = median(vs) if vs else None
        rows.append({"scenario": sid, "metric": metric, "label": label, "unit": unit,
                     "better": better, "target": tgt, "values": vals})
    return rows


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt(v):
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    av = abs(v)
    if av >= 100:
        return f"{v:.0f}"
    if av >= 10:
        return f"{v:.1f}"
    if av >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def target_text(tgt, unit):
    if tgt is None:
        return ""
    kind, x = tgt
    if kind == "rel":
        return f"≤ {x}× bare"
    if kind == "min_rel":
        return f"≥ {x}× bare"
    if kind == "rel_kg":
        return f"< {x}× kg"
    return f"≤ {x:g} {unit}"


def verdict(row):
    tgt = row["target"]
    v = row["values"].get("cellgate")
    if tgt is None or v is None:
        return ""
    kind, x = tgt
    bare = row["values"].get("bare")
    if kind == "abs":
        return "✅" if v <= x else "❌"
    if kind == "rel_kg":
        kg = row["values"].get("kg")
        return "" if kg is None else ("✅" if v < x * kg else "❌")
    if bare is None:
        return ""
    if kind == "rel":
        return "✅" if v <= x * bare else "❌"
    return "✅" if v >= x * bare else "❌"


def markdown(rows, meta, results, target_names):
    out = []
    la = meta["machine"]
    out.append(f"Machine: {la.get('cores')} cores ({la.get('cpu', '?')}), load average at start "
               f"{' '.join(f'{x:.2f}' for x in la['loadavg_start'])}, at end "
               f"{' '.join(f'{x:.2f}' for x in meta.get('loadavg_end', (0, 0, 0)))}; "
               f"rounds={meta['args']['rounds']}, N={meta['args']['n']}, {meta['started']}"
               + (f"; cellgate extra args: {' '.join(meta['args']['cellgate_arg'])}"
                  if meta['args'].get('cellgate_arg') and 'cellgate' in target_names else "")
               + (f"; cellgate binary built {meta['cellgate_bin']['mtime'][:19]}, sha256 "
                  f"{meta['cellgate_bin']['sha256'][:12]}" if 'cellgate_bin' in meta and 'cellgate' in target_names else ""))
    if meta.get("kernelspec") and {"bare", "kg"} & set(target_names):
        out.append(f"Kernel: {meta['kernelspec']}.")
    if meta.get("bare_limits") and "bare" in target_names:
        out.append(f"Limits: {meta['bare_limits']}.")
    bgs = [rd.get("background_cpu_pct") for per in results.values() for cell in per.values()
           for rd in cell["rounds"] if rd.get("background_cpu_pct") is not None]
    if bgs:
        out.append(f"Background CPU use by other processes, sampled before each run: median "
                   f"{statistics.median(bgs):.0f}%, max {max(bgs):.0f}% of {la.get('cores')} cores.")
    out.append("")
    cols = ["#", "metric", "unit"] + target_names
    have = set(target_names)
    ratio_cols = []
    if {"cellgate", "bare"} <= have:
        ratio_cols.append(("cellgate", "bare"))
    if {"kg", "bare"} <= have:
        ratio_cols.append(("kg", "bare"))
    if {"cellgate", "kg"} <= have:
        ratio_cols.append(("cellgate", "kg"))
    cols += [f"{x}/{y}" for x, y in ratio_cols] + ["target (cellgate)"]
    if "cellgate" in have:
        cols.append("ok")
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "|".join("---" for _ in cols) + "|")
    for row in rows:
        v = row["values"]
        line = [str(row["scenario"]), row["label"], row["unit"]]
        line += [_fmt(v.get(tn)) for tn in target_names]
        line += [(_fmt(_ratio(v.get(x), v.get(y))) + "×") if _ratio(v.get(x), v.get(y)) is not None else "–"
                 for x, y in ratio_cols]
        line.append(target_text(row["target"], row["unit"]))
        if "cellgate" in have:
            line.append(verdict(row))
        out.append("| " + " | ".join(line) + " |")
    # notes: errors, incomplete output
    notes = [f"- {tn}: SKIPPED ({why})" for tn, why in meta.get("skipped", {}).items()]
    for key, per in results.items():
        for tn, cell in per.items():
            for e in cell["errors"]:
                notes.append(f"- {tn} / {key}: {e.splitlines()[0][:300]}")
            for rd in cell["rounds"]:
                if rd.get("out_note"):
                    notes.append(f"- {tn} / out: {rd['out_note'][:300]}")
                    break
            restarts = sum(len(rd.get("many_restarts") or ()) for rd in cell["rounds"])
            died = sum(len(rd.get("start_died") or ()) for rd in cell["rounds"])
            if restarts or died:
                notes.append(f"- {tn} / {key}: {restarts + died} kernel(s) died while starting "
                             f"(port race?) and were replaced / discarded")
            for rd in cell["rounds"]:
                if rd.get("many_errors"):
                    notes.append(f"- {tn} / many: {len(rd['many_errors'])} failures, e.g. {rd['many_errors'][0][:200]}")
                    break
    if notes:
        out.append("")
        out.append("Notes:")
        out += notes
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--targets", default="bare,kg,cellgate")
    p.add_argument("--scenarios", default="1,2,3,4,5,6,7,8",  # 9-13: --scenarios 9,10,11,12,13
                   help="comma-separated scenario numbers (1 and 2 share one run)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per scenario (default 3, quick 1)")
    p.add_argument("--quick", action="store_true", help="small N everywhere (smoke run, ~2 min)")
    p.add_argument("-n", "--n", type=int, default=None, help="scenario 1 round trips (default 300)")
    p.add_argument("--warmup", type=int, default=None, help="scenario 1 warm-up round trips (default 20)")
    p.add_argument("--reps", type=int, default=None, help="scenario 3/4 timed repetitions per round (default 3)")
    p.add_argument("--output-mb", type=float, default=None, help="scenario 3 output size (default 50)")
    p.add_argument("--png-mb", type=float, default=5.0, help="scenario 4 PNG size (default 5)")
    p.add_argument("--n5", type=int, default=None, help="scenario 5 reconnects (default 30)")
    p.add_argument("--m", type=int, default=None, help="scenario 6 idle connections (default 100)")
    p.add_argument("--kernels", type=int, default=None, help="scenario 7 kernels (default 50)")
    p.add_argument("--n8", type=int, default=None, help="scenario 8 kernel starts (default 10)")
    p.add_argument("--n9", type=int, default=None, help="scenario 9/10 first charts (default 10)")
    p.add_argument("--chart-burst", type=int, default=None,
                   help="scenario 11 kernels charting at once (default 10; 50 is the issue's other burst)")
    p.add_argument("--bare-cpus", type=float, default=1.0,
                   help="CPU quota of each bare kernel, as cellgate's default policy (0: none)")
    p.add_argument("--bare-memory-mb", type=int, default=1024,
                   help="memory limit of each bare kernel, as cellgate's default policy (0: none)")
    p.add_argument("--cellgate-bin", default=os.path.join(REPO, "target", "release", "cellgate"))
    p.add_argument("--cellgate-arg", action="append", default=[], help="extra argument for cellgate serve")
    p.add_argument("--kernels-dir", default=os.path.join(REPO, "kernels"))
    p.add_argument("--kernel", default="python3",
                   help="the kernelspec every target runs (deno, ir, bash…: scenarios 1, 2, 5-8 "
                        "apply; `1+1` is `echo 2` for bash). bare runs the same kernel without "
                        "cellgate's parts (Deno without its TCP relay)")
    p.add_argument("--kernelspec", choices=("cellgate", "stock"), default="cellgate",
                   help="the python3 kernel bare and kg run: cellgate's own (kernels/python3: "
                        "its venv, launcher and flags, as cellgate runs it; default, so that "
                        "ratios measure the gateways alone) or stock (the tools venv's "
                        "`python -m ipykernel_launcher`, what a default Kernel Gateway runs)")
    # The default sandbox and limits, but room for the 50 MB output scenario (see the file).
    p.add_argument("--policies-dir", default=os.path.join(REPO, "bench", "policies"))
    p.add_argument("--python", default=sys.executable, help="python running kernel_gateway (tools venv)")
    p.add_argument("--kg-arg", action="append", default=[], help="extra argument for kernel_gateway")
    p.add_argument("--json", dest="json_out", default=None, help="also write the JSON results here")
    p.add_argument("--markdown", dest="md_out", default=None, help="also write the markdown table here")
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument("--http-timeout", type=float, default=120.0)
    p.add_argument("--scenario-timeout", type=float, default=900.0)
    p.add_argument("--many-timeout", type=float, default=300.0)
    p.add_argument("--pause", type=float, default=0.5,
                   help="seconds between runs, used to sample background CPU use")
    p.add_argument("--wait-quiet", type=float, default=None, metavar="PCT",
                   help="before each run wait until other processes use less than PCT%% of the CPUs")
    p.add_argument("--wait-quiet-max", type=float, default=120.0, metavar="S",
                   help="give up waiting for --wait-quiet after S seconds (default 120)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    q = a.quick
    defaults = dict(rounds=(1, 3), n=(30, 300), warmup=(5, 20), reps=(1, 3), output_mb=(10.0, 50.0),
                    n5=(5, 30), m=(10, 100), kernels=(5, 50), n8=(2, 10), n9=(2, 10),
                    chart_burst=(3, 10))
    for k, (qv, fv) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, qv if q else fv)
    a.one_plus_one = "echo 2" if a.kernel == "bash" else "1+1"
    return a


def use_kernelspec(a):
    """Points bare and kg (through JUPYTER_PATH, which comes first in Jupyter's search) at a
    python3 kernelspec made from cellgate's kernels/python3/kernel.json, with `python`
    resolved to that spec's venv: the same kernel process cellgate starts (in its sandbox).
    Returns a description for the report."""
    if a.kernel != "python3":
        return use_other_kernelspec(a)
    if a.kernelspec == "stock":
        return "bare and kg: the tools venv's stock python3 kernelspec"
    src = os.path.join(a.kernels_dir, "python3")
    with open(os.path.join(src, "kernel.json")) as f:
        spec = json.load(f)
    python = os.path.join(src, ".venv", "bin", "python")
    if spec["argv"] and spec["argv"][0] in ("python", "python3"):
        spec["argv"][0] = python
    root = os.path.join(_RUNTIME_DIR, "jupyter")
    os.makedirs(os.path.join(root, "kernels", "python3"), exist_ok=True)
    with open(os.path.join(root, "kernels", "python3", "kernel.json"), "w") as f:
        json.dump(spec, f)
    os.environ["JUPYTER_PATH"] = root
    return f"bare and kg: cellgate's python3 kernelspec ({' '.join(spec['argv'][1:3])} …, {python})"


def use_other_kernelspec(a):
    """bare and kg run kernelspec `a.kernel` from kernels/: its environment's programs, with
    Deno started directly (bare Deno binds TCP itself; cellgate's relay exists only to give
    it a sandbox's ipc endpoints)."""
    src = os.path.join(a.kernels_dir, a.kernel)
    with open(os.path.join(src, "kernel.json")) as f:
        spec = json.load(f)
    env_dir = os.path.join(src, ".venv")
    argv = [x.replace("{prefix}", env_dir) for x in spec["argv"]]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = os.path.join(env_dir, "bin", "python")
    if "--" in argv and "{tcp_connection_file}" in argv:
        argv = [x.replace("{tcp_connection_file}", "{connection_file}") for x in argv[argv.index("--") + 1:]]
    spec["argv"] = argv
    spec.pop("metadata", None)
    root = os.path.join(_RUNTIME_DIR, "jupyter")
    os.makedirs(os.path.join(root, "kernels", a.kernel), exist_ok=True)
    with open(os.path.join(root, "kernels", a.kernel, "kernel.json"), "w") as f:
        json.dump(spec, f)
    os.environ["JUPYTER_PATH"] = root
    return f"bare and kg: kernelspec {a.kernel} ({' '.join(argv)})"


async def amain(a):
    names = [x.strip() for x in a.targets.split(",") if x.strip()]
    scenario_ids = {int(x) for x in a.scenarios.split(",") if x.strip()}
    unknown = [n for n in names if n not in ("bare", "kg", "cellgate")]
    if unknown:
        sys.exit(f"unknown target(s): {unknown}")
    run_tag = time.strftime("%Y%m%d-%H%M%S")
    meta = {"started": now_iso(), "args": vars(a), "machine": machine_info(),
            "targets": names, "scenarios": sorted(scenario_ids),
            "kernelspec": use_kernelspec(a)}
    log(meta["kernelspec"])
    log(f"machine: {meta['machine'].get('cores')} cores, load {meta['machine']['loadavg_start']}")
    targets = []
    try:
        for n in names:
            if n == "bare":
                t = BareTarget(a)
                meta["bare_limits"] = t.limits.describe()
                log(meta["bare_limits"])
            elif n == "kg":
                t = GatewayTarget("kg", kg_cmd(a), a, run_tag)
            else:
                if not os.access(a.cellgate_bin, os.X_OK):
                    loud(f"cellgate: SKIPPED - binary {a.cellgate_bin} missing or not executable "
                         f"(build it with `cargo build --release`, or pass --cellgate-bin)")
                    meta.setdefault("skipped", {})[n] = f"binary {a.cellgate_bin} not found"
                    continue
                # Run a private copy: the binary may be rebuilt while we run, and every
                # cellgate process of this run (scenario 6 starts fresh ones) must be the same.
                import hashlib
                with open(a.cellgate_bin, "rb") as f:
                    data = f.read()
                st = os.stat(a.cellgate_bin)
                meta["cellgate_bin"] = {"path": a.cellgate_bin, "size": st.st_size,
                                        "mtime": _dt.datetime.fromtimestamp(st.st_mtime).isoformat(),
                                        "sha256": hashlib.sha256(data).hexdigest()}
                copy = os.path.join(_RUNTIME_DIR, "cellgate")
                with open(copy, "wb") as f:
                    f.write(data)
                os.chmod(copy, 0o755)
                del data
                # The kernel zygote's library goes with it (looked for beside the binary).
                library = os.path.join(os.path.dirname(a.cellgate_bin), "libcellgate_zygote.so")
                if os.path.exists(library):
                    shutil.copy(library, os.path.join(_RUNTIME_DIR, "libcellgate_zygote.so"))
                else:
                    loud(f"cellgate: no {library}: its namespaces kernels start without a zygote")
                log(f"cellgate: using a copy of {a.cellgate_bin} (built {meta['cellgate_bin']['mtime']}, "
                    f"sha256 {meta['cellgate_bin']['sha256'][:12]})")
                a_copy = argparse.Namespace(**vars(a))
                a_copy.cellgate_bin = copy
                t = GatewayTarget("cellgate", cellgate_cmd(a_copy), a, run_tag)
            try:
                await t.start()
            except TargetUnavailable as e:
                loud(f"{n}: SKIPPED - cannot start:\n{e}")
                meta.setdefault("skipped", {})[n] = str(e).splitlines()[0]
                continue
            targets.append(t)
        if not targets:
            raise SystemExit("no target could be started")
        results = await run_all(a, targets, scenario_ids)
    finally:
        log("cleaning up")
        for t in targets:
            try:
                await asyncio.wait_for(t.stop(), 60)
            except BaseException as e:
                log(f"{t.name}: stop failed: {e!r}")
    meta["loadavg_end"] = os.getloadavg()
    tnames = [t.name for t in targets]
    rows = summarize(results, tnames, scenario_ids)
    md = markdown(rows, meta, results, tnames)
    doc = {"meta": meta, "summary": rows, "results": results}
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{run_tag}.json")
    for pth in filter(None, (path, a.json_out)):
        with open(pth, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    if a.md_out:
        with open(a.md_out, "w") as f:
            f.write(md + "\n")
    print(md)
    log(f"results: {path}")


def final_cleanup():
    """Synchronous last resort: kill whatever we registered that is still alive."""
    left = REAPER.alive()
    if left:
        log(f"killing {len(left)} leftover process(es): {left}")
        REAPER.kill_all(signal.SIGTERM)
        deadline = time.time() + 3
        while REAPER.alive() and time.time() < deadline:
            time.sleep(0.1)
        REAPER.kill_all(signal.SIGKILL)
    shutil.rmtree(_RUNTIME_DIR, ignore_errors=True)


def main():
    a = parse_args()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    try:
        asyncio.run(amain(a))
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
    finally:
        final_cleanup()


if __name__ == "__main__":
    main()
