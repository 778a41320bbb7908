"""cellgate's bash kernel: bash_kernel with results a client can tell apart.

bash_kernel reports a command's non-zero exit as an error with an empty `ename` and the
status as `evalue`, and an interrupted command as the non-standard reply status `abort`.
Clients of cellgate read `ename` to say what went wrong and treat an interrupt like
Python's KeyboardInterrupt, so both are named here: `ExitStatus` (evalue: the status) and
`Interrupted`. Nothing else of bash_kernel changes.
"""

from bash_kernel.kernel import BashKernel
from ipykernel.kernelapp import IPKernelApp


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


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=CellgateBashKernel)
