"""Shell commands for API v1's commands endpoint (`POST /v1/sessions/{id}/commands`).

The gateway runs a command by executing one silent line in the session's kernel,
`__import__("cellgate_command").run_json("...")` (the request as JSON in an ASCII-only
literal), so the command runs in exactly the kernel's sandbox (its namespaces or VM, its
user, its cgroup limits, its egress through the proxy) on every backend, with no channel
into the sandbox beyond the kernel's own. The command is `bash -c CMD` (`sh` where there is
no bash) in its own session and process group, stdin from /dev/null, in the workspace (or a
directory below it), with the kernel's environment plus the request's variables.

Its stdout and stderr come back as the cell's stream output as they arrive (read here, in
the kernel's main thread, so ipykernel attributes them to the command's request). How it
ended (the exit code, or the signal, and whether the timeout or an interrupt ended it) is
left in `last`, which the gateway reads through the execute request's `user_expressions`:
the reply carries it even when the policy's output limit dropped the rest of the output.

At the timeout, or on an interrupt of the kernel, the command's whole process group is
killed. When the command's own process has exited, output still arriving from processes it
left in the background is shown for at most LINGER seconds; after that a daemon thread
reads and discards it, so those processes keep running (a server started with `&` keeps
serving) without dying of a broken pipe.

`./dev setup` copies this file into each kernel venv's site-packages, beside the launcher.
"""

import codecs
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

# Seconds of output shown from background processes once the command itself exited.
LINGER = 0.5
CHUNK = 64 << 10


class Exit:
    """How the last command ended; its `_repr_json_` is what the gateway reads."""

    def __init__(self, exit_code=None, signal_name=None, timed_out=False, interrupted=False,
                 error=None):
        self.report = {
            "exit_code": exit_code,
            "signal": signal_name,
            "timed_out": timed_out,
            "interrupted": interrupted,
            "error": error,
        }

    def _repr_json_(self):
        return self.report

    def __repr__(self):
        return f"Exit({self.report!r})"


last = Exit(error="no command ran")


def _shell():
    for shell in ("/bin/bash", "/usr/bin/bash", "/bin/sh"):
        if os.access(shell, os.X_OK):
            return shell
    raise FileNotFoundError("no shell in the sandbox (/bin/bash or /bin/sh)")


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _discard(files):
    """Reads what background processes still write, so they never meet a closed pipe."""
    def drain(f):
        try:
            while f.read(CHUNK):
                pass
        except (OSError, ValueError):
            pass
        finally:
            f.close()

    for f in files:
        os.set_blocking(f.fileno(), True)
        threading.Thread(target=drain, args=(f,), daemon=True, name="cellgate-command-drain").start()


def run_json(text):
    """Runs the request the gateway wrote (`{"cmd", "cwd", "env", "timeout"}`)."""
    request = json.loads(text)
    run(request["cmd"], cwd=request.get("cwd"), env=request.get("env"),
        timeout=request.get("timeout", 60.0))


def run(cmd, cwd=None, env=None, timeout=60.0):
    """Runs `cmd` and leaves how it ended in `last` (see the module's doc)."""
    global last
    last = Exit(error="the command did not finish")
    home = os.environ.get("HOME") or os.getcwd()
    where = os.path.join(home, cwd) if cwd else home
    full_env = dict(os.environ)
    full_env.update(env or {})
    deadline = time.monotonic() + max(float(timeout), 0.001)
    timed_out = interrupted = False
    proc = None
    open_pipes = []
    try:
        try:
            proc = subprocess.Popen(
                [_shell(), "-c", cmd],
                cwd=where,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as err:
            # A missing directory, or the pids limit: the command never ran.
            last = Exit(error=f"{type(err).__name__}: {err}")
            return
        open_pipes = [proc.stdout, proc.stderr]
        outputs = {
            proc.stdout.fileno(): (sys.stdout, codecs.getincrementaldecoder("utf-8")("replace")),
            proc.stderr.fileno(): (sys.stderr, codecs.getincrementaldecoder("utf-8")("replace")),
        }
        selector = selectors.DefaultSelector()
        for pipe in open_pipes:
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ)
        linger_until = None
        try:
            # The output, until both pipes close, or the command exited and LINGER passed.
            while selector.get_map():
                now = time.monotonic()
                if proc.poll() is not None and linger_until is None:
                    linger_until = now + LINGER
                if linger_until is not None and now >= linger_until:
                    break
                if now >= deadline:
                    timed_out = True
                    break
                wait = min(deadline, linger_until or deadline) - now
                for key, _ in selector.select(timeout=min(wait, 0.1)):
                    try:
                        data = os.read(key.fd, CHUNK)
                    except BlockingIOError:
                        continue
                    stream, decoder = outputs[key.fd]
                    if not data:
                        selector.unregister(key.fileobj)
                        open_pipes.remove(key.fileobj)
                        key.fileobj.close()
                        stream.write(decoder.decode(b"", final=True))
                        continue
                    stream.write(decoder.decode(data))
                    stream.flush()
        finally:
            selector.close()
        # A command that closed or redirected its output runs on: wait for it, to the
        # deadline.
        while not timed_out and proc.poll() is None:
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if proc is not None:
            if timed_out or interrupted or proc.poll() is None:
                _kill_group(proc)
            code = proc.wait()
            if open_pipes:
                _discard(open_pipes)
            sys.stdout.flush()
            sys.stderr.flush()
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = str(-code)
                last = Exit(None, name, timed_out, interrupted)
            else:
                last = Exit(code, None, timed_out, interrupted)
