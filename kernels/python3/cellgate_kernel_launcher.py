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

`./dev setup` copies this file into the kernel venv's site-packages (the sandboxes mount the
venv, not the kernelspec directory); kernel.json runs it with `-m`.
"""

import gc
import os
import sys


def main() -> None:
    gc.disable()
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


if __name__ == "__main__":
    main()
