"""cellgate's bash kernel: bash_kernel with results a client can tell apart.

bash_kernel reports a command's non-zero exit as an error with an empty `ename` and the
status as `evalue`, and an interrupted command as the non-standard reply status `abort`.
Clients of cellgate read `ename` to say what went wrong and treat an interrupt like
Python's KeyboardInterrupt, so both are named here: `ExitStatus` (evalue: the status) and
`Interrupted`.

It also takes API v1's commands (`POST /v1/sessions/{id}/commands`), which the gateway
sends every kernel as the one Python line that calls cellgate_command's runner: this
kernel's process is Python, in the same sandbox as its bash, so that line (and only that
line, checked by its exact shape) runs here as it would in the python3 kernel, and the
runner's report comes back in the reply's `user_expressions`. Nothing else of bash_kernel
changes: any other code goes to bash.
"""

import ast

from bash_kernel.kernel import BashKernel
from ipykernel.kernelapp import IPKernelApp

# The gateway's line for a command (src/sessions/commands.rs): the runner called with one
# string literal, and the expression that reads its report.
RUNNER = '__import__("cellgate_command").run_json('
REPORT = '__import__("cellgate_command").last'


def command_request(code):
    """The request of a runner line, or None for any other code."""
    if not (code.startswith(RUNNER) and code.endswith(")")):
        return None
    try:
        text = ast.literal_eval(code[len(RUNNER):-1])
    except (ValueError, SyntaxError):
        return None
    return text if isinstance(text, str) else None


class CellgateBashKernel(BashKernel):
    implementation = "cellgate_bash_kernel"

    def send_response(self, stream, msg_or_type, content=None, *args, **kwargs):
        if msg_or_type == "error" and isinstance(content, dict) and not content.get("ename"):
            # The same dict becomes the execute_reply's content: both say the same.
            evalue = str(content.get("evalue", ""))
            if evalue.isdigit():
                content["ename"] = "ExitStatus"
                content["traceback"] = [f"the command exited with status {evalue}"]
            else:
                content["ename"] = "BashError"
                content["traceback"] = [evalue]
        return super().send_response(stream, msg_or_type, content, *args, **kwargs)

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False):
        request = command_request(code)
        if request is not None:
            return self.run_command(request, user_expressions or {})
        reply = super().do_execute(code, silent, store_history, user_expressions, allow_stdin)
        if reply.get("status") == "abort":
            error = {
                "ename": "Interrupted",
                "evalue": "the command was interrupted",
                "traceback": ["the command was interrupted"],
            }
            self.send_response(self.iopub_socket, "error", dict(error))
            reply = dict(error, status="error", execution_count=self.execution_count)
        return reply

    def run_command(self, request, user_expressions):
        import sys

        import cellgate_command

        # The runner prints to sys.stdout and sys.stderr; an IPython kernel tells them which
        # request they answer, this one must (otherwise their stream messages name none, and
        # the gateway cannot give them to the command).
        streams = [s for s in (sys.stdout, sys.stderr) if hasattr(s, "set_parent")]
        before = [s.parent_header for s in streams]
        for stream in streams:
            stream.set_parent(self.get_parent("shell"))
        try:
            cellgate_command.run_json(request)
        finally:
            for stream in streams:
                stream.flush()
            for stream, header in zip(streams, before):
                stream.parent_header = header
        report = cellgate_command.last
        expressions = {
            name: (
                {"status": "ok", "data": {"application/json": report._repr_json_(),
                                          "text/plain": repr(report)}, "metadata": {}}
                if expression == REPORT
                else {"status": "error", "ename": "NotSupported",
                      "evalue": "this kernel evaluates no other expression", "traceback": []}
            )
            for name, expression in user_expressions.items()
        }
        return {"status": "ok", "execution_count": self.execution_count, "payload": [],
                "user_expressions": expressions}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=CellgateBashKernel)
