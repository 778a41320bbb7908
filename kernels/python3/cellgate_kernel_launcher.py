"""Starts an ipykernel as `python -m ipykernel_launcher` does, with the cyclic garbage
collector paused while the kernel imports and sets itself up.

Why: a kernel start allocates several hundred thousand long-lived objects (IPython,
jupyter_client, zmq, tornado, debugpy), and each allocation threshold crossed runs a
collection that walks all of them for nothing. On the 2-core machines cellgate is measured
on, those collections were ~20 % of a kernel's start CPU (perf: `gc_collect_main`,
`visit_decref`, `visit_reachable`), which is what bounds 50 kernels started at once.

`gc.freeze()` then moves every object of the start into the permanent generation, so the
user's own full collections no longer walk them either (without it the paused collections
only moved to the kernel's first messages: no gain). The collector is back on before the
kernel handles its first message: user code runs with Python's ordinary GC.

It also bounds each cell's output at the source (`CELLGATE_OUTPUT_LIMIT`, set by the gateway
from the policy's `output_per_execution`): see `_bound_output`, keeps IPython from holding
every cell's stdout and stderr in memory: see `_forget_stream_history`, and shows the figures
a cell left open under a non-interactive matplotlib backend: see `_show_figures_left_open`.

In a microVM's warm pool it first runs as a zygote (`--cellgate-zygote`, see `_zygote`):
imports done, no kernel yet, snapshotted with its VM and restored for each session.

`./dev setup` copies this file into the kernel venv's site-packages (the sandboxes mount the
venv, not the kernelspec directory); kernel.json runs it with `-m`.
"""

import collections
import gc
import json
import os
import sys
import threading

# Unsent stream text (characters) past which a writer waits for the IOPub thread to send
# what it holds: the kernel's buffer stays this small whatever the policy's output limit.
UNSENT_BOUND = 1 << 20
# Text a stream write may add past the limit, so the cell's output is surely over the
# gateway's limit (which counts whole messages, never fewer bytes than the text) once the
# kernel stops sending: the gateway then marks the cell `output_truncated`.
CROSSING_MARGIN = 4096
# Cells whose spending is remembered: outputs of older cells (a background thread still
# printing) start a fresh count, which only lets more through.
REMEMBERED_CELLS = 64


def main() -> None:
    gc.disable()
    # Only a zygote reads it (see `_preload`): a kernel started afresh imports on demand.
    os.environ.pop(PRELOAD_ENV, None)
    _say_preload_failures()
    # As ipykernel_launcher means to: the working directory (the user's workspace) is not on
    # the path while the kernel imports, so a `json.py` there cannot replace a module the
    # kernel needs. `python -m` puts it there as a full path, not the '' ipykernel_launcher
    # removes. IPython adds '' back for user code, so the user's own modules still import.
    # (Not `python -P`: IPython would then leave '' out for user code too.)
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    try:
        from ipykernel.kernelapp import IPKernelApp

        app = IPKernelApp.instance()
        app.initialize()
        _bound_output(app, os.environ.pop("CELLGATE_OUTPUT_LIMIT", None))
        _forget_stream_history()
        _hook_inline_backend(app)
        _show_figures_left_open(app)
    finally:
        gc.freeze()
        gc.enable()
    app.start()
    # ipykernel 7.4 races at exit: a `shutdown_request` stops the main loop from the control
    # thread, which then still flushes stdout through the IOPub thread; the exit handler
    # (`IPKernelApp.close`) stops the IOPub thread first and then joins the control thread,
    # which waits on that flush forever, until the gateway kills the kernel after its grace
    # period. The faster this process reaches its exit, the likelier that was: half the
    # shutdowns with this launcher. Letting the control thread finish first avoids it.
    control = getattr(app, "control_thread", None)
    if control is not None and control.is_alive():
        control.join(timeout=2)


class _Budget:
    """Output characters each cell (by its execute_request's msg_id) has sent."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._spent: collections.OrderedDict[str, int] = collections.OrderedDict()
        # Writers are the user's threads, the fd-capture threads and the shell's thread; a
        # signal handler or finalizer that prints may re-enter on the same thread.
        self._lock = threading.RLock()

    def take(self, parent: dict, wanted: int, *, whole: bool) -> int:
        """How much of `wanted` characters may go out. A cell over its limit sends nothing
        more; the write that crosses it goes out whole (a rich output, which cannot be cut)
        or cut at a little past the limit (stream text)."""
        msg_id = (parent or {}).get("msg_id", "")
        with self._lock:
            spent = self._spent.get(msg_id, 0)
            if spent > self.limit:
                return 0
            granted = wanted if whole else min(wanted, self.limit - spent + CROSSING_MARGIN)
            self._spent[msg_id] = spent + granted
            self._spent.move_to_end(msg_id)
            while len(self._spent) > REMEMBERED_CELLS:
                self._spent.popitem(last=False)
            return granted


def _rich_size(msg: dict) -> int:
    """A lower bound of a rich output's size on the wire, in characters."""
    size = 0
    for value in (msg.get("content") or {}).get("data", {}).values():
        if isinstance(value, (str, bytes)):
            size += len(value)
        else:
            try:
                size += len(json.dumps(value, default=str))
            except (TypeError, ValueError):
                pass
    return size


def _bound_output(app, limit_text) -> None:
    """Drops a cell's output in the kernel once it passes the gateway's limit.

    Why: ipykernel buffers stdout without bound when code prints faster than its IOPub thread
    sends (a print loop reaches gigabytes in seconds), so a flood ended in an OOM kill and lost
    the session's variables, although the gateway forwards nothing past the limit anyway. Here
    the cell's stream writes and rich outputs (display_data, update_display_data,
    execute_result) share one budget per cell; past it they are dropped before they are
    buffered, and the gateway, which has then seen more than its limit, ends the cell
    `output_truncated` with the head shown. Below the limit a writer that gets ahead of the
    IOPub thread by `UNSENT_BOUND` waits for it, so nothing is lost to speed either.
    """
    from ipykernel.iostream import OutStream

    budget = None
    if limit_text:
        try:
            budget = _Budget(int(limit_text))
        except ValueError:
            print(f"cellgate: ignoring CELLGATE_OUTPUT_LIMIT={limit_text!r}", file=sys.__stderr__)

    original_write = OutStream.write

    def write(self, string):
        if not isinstance(string, str):
            return original_write(self, string)  # raises ipykernel's own TypeError
        wanted = len(string)
        if budget is not None:
            granted = budget.take(self.parent_header, wanted, whole=False)
            if granted < wanted:
                if granted:
                    original_write(self, string[:granted])
                # The caller's text counts as written: a print loop must not fail for it.
                return wanted
        written = original_write(self, string)
        unsent = getattr(self, "_cellgate_unsent", 0) + wanted
        if unsent > UNSENT_BOUND:
            unsent = 0
            self.flush()  # blocks until the IOPub thread has sent it
        self._cellgate_unsent = unsent
        return written

    OutStream.write = write

    if budget is None:
        return

    # Class-level, not `register_hook`: ipykernel keeps those hooks per thread, so a display
    # from a user's thread would bypass them.
    from ipykernel.displayhook import ZMQShellDisplayHook
    from ipykernel.zmqshell import ZMQDisplayPublisher

    original_publish = ZMQDisplayPublisher.publish

    def publish(self, data, metadata=None, *args, **kwargs):
        size = _rich_size({"content": {"data": data if isinstance(data, dict) else {}}})
        if budget.take(self.parent_header or {}, size, whole=True) != size:
            return None
        return original_publish(self, data, metadata, *args, **kwargs)

    ZMQDisplayPublisher.publish = publish

    original_finish = ZMQShellDisplayHook.finish_displayhook

    def finish_displayhook(self):
        msg = getattr(self, "msg", None)
        if msg:
            size = _rich_size(msg)
            if budget.take(msg.get("parent_header") or {}, size, whole=True) != size:
                sys.stdout.flush()
                sys.stderr.flush()
                self.msg = None
                return None
        return original_finish(self)

    ZMQShellDisplayHook.finish_displayhook = finish_displayhook


def _forget_stream_history() -> None:
    """Stops IPython from keeping every write to stdout and stderr for the kernel's life.

    Why: IPython 9 wraps the streams' `write` for each cell and appends every piece written
    to `history_manager.outputs`, in memory, whether or not it is ever sent; the wrapper sits
    outside `_bound_output`'s, so it kept what the budget dropped too. A flood through file
    descriptor 1 (1 KiB pieces from ipykernel's capture thread) held ~470 MiB after 5 s with
    only 10 MiB sent. Nothing in a gateway kernel reads that record: the gateway keeps the
    session's outputs itself (history, export).
    """
    import contextlib

    from IPython.core.interactiveshell import InteractiveShell

    InteractiveShell._tee = lambda self, channel: contextlib.nullcontext()


def _hook_inline_backend(app) -> None:
    """Does for a kernel forked from a zygote what importing matplotlib's inline backend does
    in a kernel started afresh: registers its PNG formatter and post-execute flush with the
    kernel's shell. The zygote's warm-up chart (`_warm_charts`) imported that backend (pandas'
    plot resolves pyplot's backend), before there was a shell to hook into, so the import's own
    hook found none, and without this a cell's figures would never show."""
    backend = sys.modules.get("matplotlib_inline.backend_inline")
    shell = getattr(app, "shell", None)
    if backend is None or shell is None:
        return
    try:
        import matplotlib
        from IPython.core.pylabtools import activate_matplotlib

        name = matplotlib.get_backend()
        if name in ("inline", "module://matplotlib_inline.backend_inline"):
            activate_matplotlib(name)
            backend.configure_inline_support(shell, name)
    except Exception as error:  # the kernel still works, its figures then do not show: say so
        print(f"cellgate: the inline backend could not be hooked: {error!r}", file=sys.stderr)


# Matplotlib backends that draw to files only: with one of these, `plt.show()` shows nothing.
NON_INTERACTIVE_BACKENDS = {"agg", "cairo", "pdf", "pgf", "ps", "svg", "template"}


def _show_figures_left_open(app) -> None:
    """Displays, at the end of each cell, the figures it left open, whatever matplotlib
    backend it chose.

    Why: generated code very often starts with `matplotlib.use("Agg")` (made for scripts),
    and then `plt.show()` shows nothing at all, not even a warning a reader would notice: the
    chart a chat asked for never arrives. The inline backend (ipykernel's default) displays
    and closes a cell's figures itself; under a non-interactive one this does the same, as a
    PNG: each open figure is displayed once, then closed, as inline would. Interactive
    backends (widgets) are left alone. Matplotlib's "non-interactive, cannot be shown"
    warning goes too: the figure is shown.
    """
    import warnings

    shell = getattr(app, "shell", None)
    if shell is None:
        return
    warnings.filterwarnings("ignore", message=".*is non-interactive, and thus cannot be shown")

    def show_open_figures(*_):
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            backend = str(pyplot.get_backend()).lower()
            if backend not in NON_INTERACTIVE_BACKENDS or not pyplot.get_fignums():
                return
            import base64

            from IPython.core.pylabtools import print_figure
            from IPython.display import display

            for number in pyplot.get_fignums():
                figure = pyplot.figure(number)
                png = print_figure(figure, "png")
                if png:
                    display(
                        {"image/png": base64.b64encode(png).decode(), "text/plain": repr(figure)},
                        raw=True,
                    )
                pyplot.close(figure)
        except Exception as error:  # a figure that cannot be drawn must not fail the cell
            print(f"cellgate: could not display a figure: {error!r}", file=sys.stderr)

    shell.events.register("post_run_cell", show_open_figures)


ZYGOTE_FLAG = "--cellgate-zygote"
# The kernelspec's preload list (kernel.json's `env`): modules a zygote imports before it waits.
PRELOAD_ENV = "CELLGATE_PRELOAD"
# What the preload could not import, `(module, error)`: said in the log of every kernel the
# zygote becomes.
_PRELOAD_FAILED = []


def _say_preload_failures() -> None:
    for name, error in _PRELOAD_FAILED:
        print(f"cellgate: preload: {name} could not be imported: {error}", file=sys.stderr)


def _preload(names: str) -> None:
    """Imports the kernelspec's preload list, so the first cell that uses it does not wait.

    A module that fails to import is left out and said (`_PRELOAD_FAILED`): the kernels start
    without it, and a cell that imports it gets the error then, as without a preload. With
    matplotlib, the backend is ipykernel's inline one (what ipykernel would choose at start,
    read by matplotlib when it is imported), and `_warm_charts` then draws what a first chart
    draws.
    """
    import importlib

    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            importlib.import_module(name)
        except Exception as error:  # any failure of a third-party import: leave it out
            _PRELOAD_FAILED.append((name, f"{type(error).__name__}: {error}"))
    if "matplotlib.pyplot" in sys.modules:
        try:
            _warm_charts()
        except Exception as error:
            _PRELOAD_FAILED.append(("matplotlib (first figure)", repr(error)))


def _warm_charts() -> None:
    """Draws, once in the zygote, a chart like a user's first: after the imports, most of a
    first chart's extra cost over the next one is what its first drawing loads and caches
    (measured: ~80 ms of CPU on our 2-core machines): pandas' plotting backend (~16 modules), seaborn's first plot, the fonts found for each text size
    (title, labels, ticks, legend) and the text layouts, and PNG encoding with the inline
    backend's settings (`bbox_inches="tight"`, which draws twice). Drawn on a `Figure`, never
    through pyplot, so no figure is left open for a kernel's first cell to show.
    """
    import io

    from matplotlib.figure import Figure

    # pandas' plot resolves pyplot's backend, which imports the inline one here, where there
    # is no shell for it to hook into: each forked kernel does that (`_hook_inline_backend`).
    figure = Figure()  # the default size, as pyplot's first figure
    left, right = figure.subplots(1, 2)
    pandas = sys.modules.get("pandas")
    if pandas is not None:
        frame = pandas.DataFrame({"month": range(1, 13), "value": [(i * 7) % 5 for i in range(12)],
                                  "group": ["a", "b"] * 6})
        frame.plot(x="month", y="value", ax=left, title="Warm-up")
        seaborn = sys.modules.get("seaborn")
        if seaborn is not None:
            seaborn.scatterplot(data=frame, x="month", y="value", hue="group", ax=right)
            seaborn.barplot(data=frame, x="group", y="value", ax=right)
    else:
        left.plot([0, 1], [0, 1], label="x")
        left.set_title("Warm-up")
    left.legend()
    right.set_xlabel("x")
    right.set_ylabel("y")
    figure.suptitle("Warm-up")
    figure.savefig(io.BytesIO(), format="png", bbox_inches="tight")


# The longest start request a zygote reads (the kernel's argv and environment).
ZYGOTE_REQUEST_MAX = 1 << 20


def _import_kernel_modules() -> None:
    """What a kernel's start imports (measured: `IPKernelApp.initialize` adds ~170 modules to
    these three, debugpy's and pydevd's most of them); importing is most of a start."""
    import importlib

    import ipykernel.ipkernel  # noqa: F401  the kernel, its shell, IPython, zmq, tornado
    import ipykernel.kernelapp  # noqa: F401
    import ipykernel.zmqshell  # noqa: F401

    for name in (
        "faulthandler",
        "ipykernel.debugger",  # debugpy and pydevd
        "IPython.core.completerlib",
        "IPython.core.debugger",
        "IPython.core.oinspect",
        "IPython.extensions.storemagic",
        "tornado.platform.asyncio",
        "tornado.queues",
        "psutil",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an environment without it starts without it too


def _reseed() -> None:
    """Draws afresh what a zygote's clones (forked or restored) would otherwise share."""
    import random

    random.seed()
    if "numpy.random" in sys.modules:
        # numpy's global generator was seeded when the zygote imported it.
        sys.modules["numpy.random"].seed()
    if "ssl" in sys.modules:
        # OpenSSL's generator reseeds itself on fork, not on a VM's restore.
        sys.modules["ssl"].RAND_add(os.urandom(48), 48.0)


NS_ZYGOTE_FLAG = "--cellgate-ns-zygote"
# Where the library a namespaces zygote's children build their sandbox with is.
LIBRARY_ENV = "CELLGATE_ZYGOTE_LIB"
# The descriptor a forked helper has the egress proxy's socket at (the gateway's EGRESS_FD).
EGRESS_FD = 3


def _ns_zygote() -> None:
    """The namespaces backend's zygote (`src/sandbox/namespaces/zygote.rs`): imports what a
    kernel imports and the preload list once, then forks a child for each kernel.

    Standard input is the gateway's control socket. This writes `ready` on it, then reads
    requests: one byte with the new helper's three stdio pipes (and maybe the egress proxy's
    socket) attached, and answers each with the child's pid. Nothing else ever comes in: the
    kernel's plan, key and environment reach the child only, on its own pipe, so no kernel
    inherits another's. The child calls the library's `cellgate_become_kernel`, the gateway's
    own sandbox code: it returns, confined, only in the kernel process, which then runs
    `main()` as `python -m cellgate_kernel_launcher ARGS` would.
    """
    import ctypes
    import signal
    import socket

    gc.disable()
    _import_kernel_modules()
    _preload(os.environ.get(PRELOAD_ENV, ""))
    library = ctypes.CDLL(os.environ[LIBRARY_ENV])
    become = library.cellgate_become_kernel
    become.argtypes = []
    become.restype = ctypes.c_char_p
    threads = _thread_names()
    if len(threads) != 1:
        sys.exit(f"cellgate: the zygote has {len(threads)} threads ({', '.join(threads)}) "
                 "after importing its preload list; a process that forks must have one")
    gc.enable()
    # What the imports made is shared with every child; collections would write to all of it.
    gc.freeze()

    def reap(*_):
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    signal.signal(signal.SIGCHLD, reap)
    control = socket.socket(fileno=0)
    # What the preload could not import, said to the gateway (its log) with the ready line.
    failed = ",".join(name.replace(",", " ").replace("\n", " ") for name, _ in _PRELOAD_FAILED)
    control.sendall(f"ready {failed}".rstrip().encode() + b"\n")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1, 4)
        except OSError:
            break
        if not message:
            break
        if len(fds) not in (3, 4):
            for fd in fds:
                os.close(fd)
            control.sendall(b"error: 3 or 4 descriptors\n")
            continue
        try:
            pid = os.fork()
        except OSError as error:  # out of memory or pids: this kernel starts afresh
            for fd in fds:
                os.close(fd)
            control.sendall(f"error: {error}".replace("\n", " ").encode() + b"\n")
            continue
        if pid == 0:
            _forked_kernel(control, fds, become)
        for fd in fds:
            os.close(fd)
        control.sendall(f"{pid}\n".encode())
    sys.exit(0)


def _forked_kernel(control, fds, become) -> None:
    """A zygote's child: the helper's stdio, then the gateway's sandbox code; in the kernel
    process, the kernel. Never returns."""
    import signal

    try:
        control.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        # Above every target first, so no descriptor is overwritten before it is moved.
        high = [os.dup2(fd, 100 + i) for i, fd in enumerate(fds)]
        for fd in fds:
            os.close(fd)
        for target, fd in zip((0, 1, 2, EGRESS_FD), high):
            os.dup2(fd, target)
            os.close(fd)
        start = json.loads(become())
    except BaseException:
        os._exit(1)
    os.environ.clear()
    # The interpreter's first copy of the environment (the zygote's) goes too.
    import posix

    posix.environ.clear()
    os.environ.update(start["env"])
    sys.argv = [sys.argv[0], *start["argv"][3:]]
    _retitle(start["argv"], start["env"])
    # The confinement reset every signal to its default; these are what Python itself sets.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    import importlib

    importlib.invalidate_caches()
    _reseed()
    main()
    # The interpreter's own exit, as a kernel started afresh has (atexit handlers, buffers):
    # nothing between here and the top of the zygote catches SystemExit.
    sys.exit(0)


def _retitle(argv, env) -> None:
    """Makes /proc/PID/cmdline and /proc/PID/environ the kernel's, not the zygote's.

    Linux shows the memory where the process's first command line and environment were put
    at its `execve`: for a forked kernel, the zygote's (whose environment names a host path,
    the library's). This writes the kernel's own over them, as setproctitle does, in the room
    the zygote was started with (`CELLGATE_ZYGOTE_ROOM` and a padding argument), so `ps` and
    the kernel itself see what a kernel started afresh would show. libc no longer points into
    that memory: the environment was cleared (and set anew) before.
    """
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # Fields 48-51 of proc(5), counted after the command name (field 2).
        arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
        for start, end, strings in (
            (arg_start, arg_end, argv),
            (env_start, env_end, [f"{k}={v}" for k, v in env.items()]),
        ):
            room = end - start
            data = b"".join(s.encode() + b"\0" for s in strings)[: room - 1]
            ctypes.memmove(start, data.ljust(room, b"\0"), room)
    except (OSError, ValueError):
        pass  # only what `ps` shows would be the zygote's


def _zygote() -> None:
    """Imports what a kernel start imports, says so, and waits to become a kernel.

    The microVM backend's warm pool snapshots a VM whose agent has started this (agent in the
    guest: `Kernel::prepare_zygote`), and restores it for each session, so the imports (most of
    a kernel's start, ~50x slower under emulation) are paid once. Nothing secret is here yet:
    the connection file, with its key, comes with the start request, after the restore.

    Standard input is a unix socket to the agent: this writes `ready` on it once the imports
    are done, then reads one JSON line, `{"args": [...], "env": {...}, "cwd": "..."}`, takes
    that environment, directory and command line (the agent checked that the interpreter
    and what it read at its own start match), reseeds what a restore would otherwise share
    between clones, and runs `main()` as `python -m cellgate_kernel_launcher ARGS` would.
    """
    import importlib
    import socket

    gc.disable()
    _import_kernel_modules()
    _preload(os.environ.get(PRELOAD_ENV, ""))
    gc.enable()
    agent = socket.socket(fileno=os.dup(0))
    agent.sendall(b"ready\n")
    request = b""
    while not request.endswith(b"\n"):
        chunk = agent.recv(65536)
        if not chunk or len(request) + len(chunk) > ZYGOTE_REQUEST_MAX:
            sys.exit("cellgate: the agent closed the zygote's socket")
        request += chunk
    agent.close()
    start = json.loads(request)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(start["env"])
    # The workspace disk is mounted over the directory the zygote waited in: enter the mount,
    # and let the import system look at directories afresh.
    os.chdir(start["cwd"])
    importlib.invalidate_caches()
    sys.argv = [sys.argv[0], *start["args"]]
    # A restored VM's generators were seeded in the snapshot, the same in every clone; the
    # agent reseeded the guest kernel's before this request, and os.urandom reads that.
    _reseed()
    main()


CHECK_PRELOAD_FLAG = "--cellgate-check-preload"


def _check_preload() -> None:
    """`cellgate doctor`'s check of the preload list: imports it and draws the warm-up chart
    exactly as a zygote would (the caller gives the zygote's environment), and prints what
    failed and which threads are left, as one JSON line. A zygote with threads forks no
    kernel."""
    _import_kernel_modules()
    _preload(os.environ.get(PRELOAD_ENV, ""))
    print(json.dumps({"failed": [f"{name}: {error}" for name, error in _PRELOAD_FAILED],
                      "threads": _thread_names()}))


def _thread_names() -> list:
    """This process's threads, by name (their id where a name cannot be read), sorted."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            names.append(tid)
    return sorted(names)


if __name__ == "__main__":
    if sys.argv[1:2] == [ZYGOTE_FLAG]:
        _zygote()
    elif sys.argv[1:2] == [NS_ZYGOTE_FLAG]:
        _ns_zygote()
    elif sys.argv[1:2] == [CHECK_PRELOAD_FLAG]:
        _check_preload()
    else:
        main()
