"""Shell commands for API v1's commands endpoint (`POST /v1/sessions/{id}/commands`).

The gateway runs a command by executing one silent line in the session's kernel,
`__import__("cellgate_command").run(...)`, so the command runs in exactly the kernel's
sandbox (its namespaces or VM, its user, its cgroup limits, its egress through the proxy) on
every backend, with no channel into the sandbox beyond the kernel's own. The command is
`bash -c CMD` (`sh` where there is no bash) in its own session and process group, stdin from
/dev/null, in the workspace (or a directory below it), with the kernel's environment plus
the request's variables.

Its stdout and stderr come back as the cell's stream output, as they arrive (read here, in
the kernel's main thread, so ipykernel attributes them to the command's request). When it
ends, one display_data of EXIT_MIME reports how: the exit code, or the signal, and whether
the timeout or an interrupt ended it. The gateway takes that bundle out of the outputs (it is
never an artifact) and builds the typed result from it.

At the timeout, or on an interrupt of the kernel, the command's whole process group is
killed. After the command's own process exits, output still arriving from processes it left
in the background is read for at most LINGER seconds; those processes are left running (a
server started with `&` keeps serving).

`./dev setup` copies this file into each kernel venv's site-packages, beside the launcher.
"""

import codecs
import os
import selectors
import signal
import subprocess
import sys
import time

EXIT_MIME = "application/vnd.cellgate.command-exit+json"
# Seconds of output read from background processes once the command itself exited.
LINGER = 0.5
CHUNK = 64 << 10


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


def _report(exit_code, sig, timed_out, interrupted, error=None):
    from IPython.display import publish_display_data

    publish_display_data(
        {
            EXIT_MIME: {
                "exit_code": exit_code,
                "signal": sig,
                "timed_out": timed_out,
                "interrupted": interrupted,
                "error": error,
            }
        }
    )


def run(cmd, cwd=None, env=None, timeout=60.0):
    """Runs `cmd` and reports how it ended (see the module's doc)."""
    home = os.environ.get("HOME") or os.getcwd()
    where = os.path.join(home, cwd) if cwd else home
    full_env = dict(os.environ)
    full_env.update(env or {})
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
        _report(None, None, False, False, f"{type(err).__name__}: {err}")
        return
    outputs = {
        proc.stdout.fileno(): (sys.stdout, codecs.getincrementaldecoder("utf-8")("replace")),
        proc.stderr.fileno(): (sys.stderr, codecs.getincrementaldecoder("utf-8")("replace")),
    }
    selector = selectors.DefaultSelector()
    for pipe in (proc.stdout, proc.stderr):
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    linger_until = None
    timed_out = interrupted = False
    try:
        while selector.get_map():
            now = time.monotonic()
            if proc.poll() is not None and linger_until is None:
                linger_until = now + LINGER
            if linger_until is not None and now >= linger_until:
                break
            if now >= deadline:
                timed_out = True
                _kill_group(proc)
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
                    stream.write(decoder.decode(b"", final=True))
                    continue
                stream.write(decoder.decode(data))
                stream.flush()
    except KeyboardInterrupt:
        interrupted = True
        _kill_group(proc)
    finally:
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        code = proc.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        _report(None, name, timed_out, interrupted)
    else:
        _report(code, None, timed_out, interrupted)
