"""Drives cellgate's /mcp server with the official MCP Python SDK (streamable HTTP), as an
agent host would. Run by tests/it/mcp.rs against a real gateway:

    CELLGATE_URL=http://127.0.0.1:PORT CELLGATE_TOKEN=T [CELLGATE_TENANT_A=jwt CELLGATE_TENANT_B=jwt] \
        python tests/python/mcp_check.py

Prints one line per check and "all checks passed"; exits non-zero at the first failure.
"""

import asyncio
import base64
import contextlib
import json
import os
import re
import sys

import httpx2
from jsonschema.validators import validator_for
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

URL = os.environ["CELLGATE_URL"].rstrip("/") + "/mcp"
TOKEN = os.environ["CELLGATE_TOKEN"]
TENANT_A = os.environ.get("CELLGATE_TENANT_A")
TENANT_B = os.environ.get("CELLGATE_TENANT_B")
# Tenant "t" with subject "u:x" and tenant "t:u" with subject "x": one string if joined by ":".
COLLIDING = (os.environ.get("CELLGATE_TENANT_T_UX"), os.environ.get("CELLGATE_TENANT_TU_X"))
# A tenant whose MCP sessions are capped at MCP_CAP (the gateway's --tenant-max-mcp-sessions).
CAPPED = os.environ.get("CELLGATE_TENANT_CAPPED")
MCP_CAP = int(os.environ.get("CELLGATE_MCP_CAP", "0"))
ACCEPT = {"Accept": "application/json, text/event-stream"}
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-03-26", "capabilities": {},
    "clientInfo": {"name": "check", "version": "1"}}}
LISTING = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}

TOOLS = {"run_python", "run_code", "run_command", "new_session", "list_files", "read_file", "write_file",
         "get_artifact", "interrupt", "restart", "export_notebook"}
# Each tool's hints as the host reads them (None: not said). The test gateway's policies
# allow no egress and no packages, so nothing reaches an open world.
READ_ONLY = {"readOnlyHint": True, "destructiveHint": None, "idempotentHint": None,
             "openWorldHint": False}
HINTS = {
    "run_python": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False,
                   "openWorldHint": False},
    "run_command": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False,
                    "openWorldHint": False},
    "run_code": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False,
                 "openWorldHint": False},
    "new_session": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False,
                    "openWorldHint": False},
    "restart": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False,
                "openWorldHint": False},
    "write_file": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": True,
                   "openWorldHint": False},
    "interrupt": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": True,
                  "openWorldHint": False},
    "list_files": READ_ONLY, "read_file": READ_ONLY, "get_artifact": READ_ONLY,
    "export_notebook": READ_ONLY,
}
# The tools whose results carry structuredContent (the others return a file, an artifact or
# a notebook as it is).
STRUCTURED = {"run_python", "run_code", "run_command", "new_session", "list_files", "write_file", "interrupt", "restart"}
# Each tool's outputSchema, from the listing.
SCHEMAS = {}


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def text_of(result):
    return "\n".join(c.text for c in result.content if c.type == "text")


def structured(name, result):
    """A successful result's structuredContent, checked against the tool's outputSchema
    (independently of the SDK, which checks too) and against its text, which must say the
    same: field by field."""
    check(not result.is_error, f"{name} failed: {text_of(result)}")
    data = result.structured_content
    check(isinstance(data, dict), f"{name}: no structuredContent: {result}")
    schema = SCHEMAS[name]
    errors = [e.message for e in validator_for(schema)(schema).iter_errors(data)]
    check(not errors, f"{name}: structuredContent against its outputSchema: {errors}\n{data}")
    texts = [c for c in result.content if c.type == "text"]
    check(len(texts) == 1, f"{name}: one text block expected: {result.content}")
    text = texts[0].text
    if name in ("run_python", "run_code"):
        check(text == execution_text(data),
              f"run_python's text and structuredContent differ:\n{text}\n---\n{execution_text(data)}")
        expected = []
    elif name == "run_command":
        check(text == command_text(data),
              f"run_command's text and structuredContent differ:\n{text}\n---\n{command_text(data)}")
        expected = []
    elif name == "list_files":
        lines = text.split("\n")
        check(lines[0].startswith(f"session {data['session_id']}"), text)
        check(lines[1:] == [f"{f['path']} ({f['kind']}, {f['size']} bytes)" for f in data["files"]],
              f"the listing's text and data differ: {text}\n{data}")
        expected = []
    elif name == "new_session":
        expected = [f"New session {data['session_id']}: policy {data['policy']}, "
                    f"sandbox {data['sandbox']}, state_generation {data['state_generation']}."]
        check((data["replaced"] is not None) == ("was shut down" in text), f"{text} {data}")
    elif name == "write_file":
        check(text == f"wrote {data['path']} ({data['bytes']} bytes) in session {data['session_id']}",
              f"{text} {data}")
        expected = []
    elif name in ("interrupt", "restart"):
        check(data["action"] == {"interrupt": "interrupted", "restart": "restarted"}[name], data)
        check(text.startswith(f"{data['action']} session {data['session_id']}"), f"{text} {data}")
        if data["state_generation"] is not None:
            expected = [f"(state_generation {data['state_generation']})"]
        else:
            expected = []
    for part in expected:
        check(part in text, f"{name}: {part!r} (from structuredContent) is not in the text:\n{text}")
    return data


def execution_text(d):
    """What run_python's text must be, given its structuredContent: every field, nothing
    else."""
    new = "; a new session: variables from earlier calls are not here" if d["new_session"] else ""
    out = f"status: {d['status']}\nsession: {d['session_id']} (state_generation {d['state_generation']}{new})\n"
    for stream in ("stdout", "stderr"):
        if d[stream]:
            out += f"{stream}:\n{d[stream]}\n"
        if d[f"{stream}_truncated"]:
            out += f"[{stream} was cut: more was printed than is shown]\n"
    if d["result"] is not None:
        out += f"result: {d['result']}\n"
    if d["error"] is not None:
        out += f"error: {d['error']['ename']}: {d['error']['evalue']}\n"
        if d["error"]["traceback"]:
            out += "traceback:\n" + "\n".join(d["error"]["traceback"]) + "\n"
    if d["artifacts"]:
        out += "artifacts:\n"
        for a in d["artifacts"]:
            file = f", file {a['path']}" if a["path"] else ""
            out += f"- {a['id']} ({a['mime']}, {a['bytes']} bytes{file}): {a['summary']}\n"
    if d["denials"]:
        out += "denied by the policy:\n"
        for x in d["denials"]:
            out += f"- {x['kind']} {x['target']} (policy {x['policy']}): {x['reason']}\n"
    if d["omitted"]:
        out += f"{d['omitted']} outputs were not stored (quotas)\n"
    return out


def command_text(d):
    """What run_command's text must be, given its structuredContent."""
    if d["exit_code"] is not None:
        how = f" (exit code {d['exit_code']})"
    elif d["signal"] is not None:
        how = f" (killed by {d['signal']})"
    else:
        how = ""
    out = f"status: {d['status']}{how}\nsession: {d['session_id']}\n"
    for stream in ("stdout", "stderr"):
        if d[stream]:
            out += f"{stream}:\n{d[stream]}\n"
        if d[f"{stream}_truncated"]:
            out += f"[{stream} was cut: more was printed than is shown]\n"
    if d["error"] is not None:
        out += f"error: {d['error']}\n"
    for x in d["denials"]:
        out += f"denied by the policy: {x['kind']} {x['target']} (policy {x['policy']}): {x['reason']}\n"
    return out


async def tool_call(session, name, arguments):
    """A tool call; a successful result of a structured tool is checked by `structured`."""
    result = await session.call_tool(name, arguments)
    if name in STRUCTURED and not result.is_error:
        structured(name, result)
    return result


def session_of(text):
    found = re.search(r"session: ([0-9a-f-]{36})", text)
    check(found, f"no session id in: {text}")
    return found.group(1)


@contextlib.asynccontextmanager
async def connect(token):
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120)
    async with http:
        async with streamable_http_client(URL, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


async def run(session, code, **arguments):
    result = await tool_call(session, "run_python", {"code": code, **arguments})
    return result, text_of(result)


async def session_gone(session_id):
    """Waits (up to a minute) for API v1 to answer 404 for the session: ending an MCP
    session deletes its kernel in the background."""
    api = os.environ["CELLGATE_URL"].rstrip("/") + f"/v1/sessions/{session_id}"
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for _ in range(120):
            answer = await http.get(api)
            if answer.status_code == 404:
                return True
            await asyncio.sleep(0.5)
    return False


async def open_raw(http, token):
    """An MCP session opened by hand (initialize, then initialized): the answer and its id."""
    opened = await http.post(URL, json=INIT, headers={**ACCEPT, "Authorization": f"Bearer {token}"})
    mcp_id = opened.headers.get("mcp-session-id")
    if opened.status_code == 200 and mcp_id:
        await http.post(URL, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                        headers={**ACCEPT, "Authorization": f"Bearer {token}",
                                 "Mcp-Session-Id": mcp_id})
    return opened, mcp_id


async def main():
    async with connect(TOKEN) as mcp:
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
        check(set(tools) == TOOLS, f"tools: {sorted(tools)}")
        check("code" in tools["run_python"].input_schema["properties"],
              tools["run_python"].input_schema)
        print("ok: the tools are listed with their schemas")

        for name, tool in tools.items():
            hints = tool.annotations
            check(hints is not None, f"{name}: no annotations")
            said = {hint: getattr(hints, {"readOnlyHint": "read_only_hint",
                                          "destructiveHint": "destructive_hint",
                                          "idempotentHint": "idempotent_hint",
                                          "openWorldHint": "open_world_hint"}[hint])
                    for hint in HINTS[name]}
            check(said == HINTS[name], f"{name}: hints {said}, expected {HINTS[name]}")
            check(tool.title and hints.title == tool.title, f"{name}: titles {tool.title!r} {hints.title!r}")
        print("ok: every tool says what it may do, and has a title")

        for name, tool in tools.items():
            schema = tool.output_schema
            if name not in STRUCTURED:
                check(schema is None, f"{name} declares an outputSchema but returns none: {schema}")
                continue
            check(schema and schema.get("type") == "object", f"{name}: outputSchema {schema}")
            validator_for(schema).check_schema(schema)
            SCHEMAS[name] = schema
        check(set(SCHEMAS["run_python"]["properties"]) >= {
            "status", "session_id", "new_session", "stdout", "stderr", "result", "error",
            "artifacts", "denials", "state_generation"}, SCHEMAS["run_python"])
        # A check that could never fail proves nothing: a result missing a required field, or
        # with a status the schema does not know, must be refused.
        run_schema = SCHEMAS["run_python"]
        bad = {"status": "fine", "session_id": "s"}
        check(list(validator_for(run_schema)(run_schema).iter_errors(bad)),
              "the run_python schema accepts a result without its fields")
        print("ok: the structured tools declare output schemas")

        result, text = await run(mcp, "x = 21\nprint('hello')\nx * 2")
        check(not result.is_error and "status: ok" in text, text)
        check("stdout:\nhello" in text and "result: 42" in text, text)
        check("a new session" in text, text)
        first = session_of(text)
        result, text = await run(mcp, "x + 1")
        check("result: 22" in text and session_of(text) == first, text)
        check("a new session" not in text, text)
        print("ok: state lasts across calls in the caller's session")

        # run_code: one session per language for the caller, each keeping its state; the
        # Python one is run_python's.
        result = await tool_call(mcp, "run_code", {"code": "const y: number = 41; y + 1", "language": "TypeScript"})
        text = text_of(result)
        check("result: 42" in text and session_of(text) != first, text)
        deno = session_of(text)
        text = text_of(await tool_call(mcp, "run_code", {"code": "y * 2", "language": "javascript"}))
        check("result: 82" in text and session_of(text) == deno, text)
        text = text_of(await tool_call(mcp, "run_code", {"code": "z <- 6 * 7; z", "language": "r"}))
        check("[1] 42" in text and session_of(text) not in (first, deno), text)
        text = text_of(await tool_call(mcp, "run_code", {"code": "echo $((x + 1))", "language": "bash"}))
        check("status: ok" in text and session_of(text) not in (first, deno), text)
        text = text_of(await tool_call(mcp, "run_code", {"code": "x", "language": "python"}))
        check("result: 21" in text and session_of(text) == first, text)
        result = await tool_call(mcp, "run_code", {"code": "x", "language": "cobol"})
        check(result.is_error and "this gateway runs:" in text_of(result)
              and "typescript" in text_of(result), text_of(result))
        result = await tool_call(mcp, "run_code", {"code": "1", "language": "r", "session_id": first})
        check(result.is_error and "runs python" in text_of(result), text_of(result))
        print("ok: run_code runs each language in the caller's session for it")

        result, text = await run(mcp, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
        images = [c for c in result.content if c.type == "image"]
        check(len(images) == 1 and images[0].mime_type == "image/png", result.content)
        check(base64.b64decode(images[0].data).startswith(b"\x89PNG"), "not a PNG")
        check(re.search(r"image/png, \d+ bytes\): PNG image \d+×\d+", text), text)
        print("ok: a chart comes back as image content")

        result, text = await run(mcp, "def f():\n    return 1 / 0\nf()")
        check("status: error" in text and "ZeroDivisionError: division by zero" in text, text)
        check("traceback:" in text and "1 / 0" in text and "\x1b[" not in text, text)
        print("ok: an error comes with its traceback")

        result = await tool_call(mcp, "write_file", {"path": "data/in.csv", "content": "a,b\n1,2\n"})
        check(not result.is_error and "8 bytes" in text_of(result), text_of(result))
        blob = base64.b64encode(bytes(range(256))).decode()
        result = await tool_call(mcp, "write_file",
                                     {"path": "blob.bin", "content": blob, "encoding": "base64"})
        check(not result.is_error, text_of(result))
        result, text = await run(mcp, "import pandas as pd\ndf = pd.read_csv('data/in.csv')\n"
                                 "df.to_csv('out.csv', index=False)\nlen(open('blob.bin','rb').read())")
        check("result: 256" in text, text)
        files = text_of(await tool_call(mcp, "list_files", {}))
        check("out.csv (file" in files and "data (dir" in files, files)
        check(text_of(await mcp.call_tool("read_file", {"path": "out.csv"})) == "a,b\n1,2\n", "read")
        binary = text_of(await mcp.call_tool("read_file", {"path": "blob.bin"}))
        check("binary" in binary and "256 bytes" in binary, binary)
        missing = await mcp.call_tool("read_file", {"path": "nope.txt"})
        check(missing.is_error and "no_such_file" in text_of(missing), text_of(missing))
        escape = await mcp.call_tool("read_file", {"path": "../../etc/passwd"})
        check(escape.is_error and "bad_path" in text_of(escape), text_of(escape))
        print("ok: files are written, listed and read; bad paths are refused")

        result = await tool_call(mcp, "run_command", {"cmd": "wc -l < in.csv; echo oops >&2; exit 4",
                                                      "cwd": "data"})
        text = text_of(result)
        check(not result.is_error and "status: error (exit code 4)" in text, text)
        check("stdout:\n2\n" in text and "stderr:\noops" in text, text)
        data = result.structured_content
        check(data["exit_code"] == 4 and data["stdout"] == "2\n" and data["session_id"] == first,
              data)
        _, text = await run(mcp, "x")
        check("result: 21" in text, f"a command touched the variables: {text}")
        print("ok: a shell command runs in the caller's session, with its exit code")

        result, text = await run(mcp, "from IPython.display import HTML, display\n"
                                 "display(HTML('<table><tr><td>7</td></tr></table>'))")
        artifact = re.search(r"- ([0-9a-f]{32}) \(text/html", text)
        check(artifact, text)
        html = text_of(await mcp.call_tool("get_artifact", {"artifact_id": artifact.group(1)}))
        check(html == "<table><tr><td>7</td></tr></table>", html)
        for bad in ["nope", artifact.group(1).upper()]:
            missing = await mcp.call_tool("get_artifact", {"artifact_id": bad})
            check(missing.is_error and f"no artifact {bad} (404 no_such_artifact)" in text_of(missing),
                  text_of(missing))
        print("ok: an artifact is read by its id")

        big = await run(mcp, "open('big.txt', 'w').write('x' * (2 << 20))")
        check("result: 2097152" in big[1], big[1])
        result = await mcp.call_tool("read_file", {"path": "big.txt"})
        check(result.is_error and "more than a tool returns" in text_of(result), text_of(result))
        print("ok: a file too large to return says so")

        notebook = json.loads(text_of(await mcp.call_tool("export_notebook", {})))
        check(notebook["nbformat"] == 4 and len(notebook["cells"]) >= 6, notebook.keys())
        print("ok: the notebook exports")

        # Interrupted every 2 s until the run returns: on a slow machine the first interrupt
        # may come before the cell runs, and a kernel between cells ignores it. Should no
        # interrupt work, the cell's own timeout ends it, with no KeyboardInterrupt.
        running = asyncio.ensure_future(
            run(mcp, "import time\nwhile True:\n    time.sleep(0.1)", timeout_s=120))
        stopped = None
        while True:
            await asyncio.wait([running], timeout=2)
            if running.done():
                break
            stopped = await tool_call(mcp, "interrupt", {})
        result, text = running.result()
        check("KeyboardInterrupt" in text, text)
        check(stopped is not None and "interrupted session" in text_of(stopped),
              stopped and text_of(stopped))
        _, text = await run(mcp, "x")
        check("result: 21" in text, f"variables lost by an interrupt: {text}")
        print("ok: interrupt stops a running cell and keeps the variables")

        restarted = text_of(await tool_call(mcp, "restart", {}))
        check("variables and files are gone" in restarted, restarted)
        _, text = await run(mcp, "x")
        check("NameError" in text and session_of(text) == first, text)
        print("ok: restart loses the variables")

        fresh = text_of(await tool_call(mcp, "new_session", {}))
        second = re.search(r"New session ([0-9a-f-]{36})", fresh).group(1)
        check(second != first, fresh)
        _, text = await run(mcp, "1")
        check(session_of(text) == second, text)
        _, text = await run(mcp, "x", session_id=first)
        check("failed" in text and "no_such_session" in text, f"the old session survived: {text}")
        # The conversation's Deno session started over with it.
        text = text_of(await tool_call(mcp, "run_code", {"code": "typeof y", "language": "typescript"}))
        check("undefined" in text and session_of(text) != deno, f"the old Deno session survived: {text}")
        # An id of another shape is answered as API v1 answers it: an unknown session.
        for bad in ["not-a-session", first.upper()]:
            _, text = await run(mcp, "1", session_id=bad)
            check(f"running the code failed: no session {bad} (404 no_such_session)" in text, text)
        print("ok: new_session starts over and shuts the old one down")

        async with connect(TOKEN) as other:
            _, text = await run(other, "1")
            check(session_of(text) not in (first, second), "two conversations share a kernel")
            others = session_of(text)
        print("ok: another MCP session gets another kernel")
        check(await session_gone(others), f"the ended conversation's session {others} lives on")
        _, text = await run(mcp, "1")
        check(session_of(text) == second, f"ending another conversation ended this one's: {text}")
        print("ok: ending an MCP session ends its kernel, and only its own")
    check(await session_gone(second), f"the ended conversation's session {second} lives on")

    async with httpx2.AsyncClient() as http:
        answer = await http.post(URL, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                                 headers={"Accept": "application/json, text/event-stream"})
        check(answer.status_code == 401 and answer.json()["code"] == "missing_token", answer.text)
        answer = await http.post(URL, json={}, headers={"Authorization": "Bearer wrong"})
        check(answer.status_code == 401 and answer.json()["code"] == "invalid_token", answer.text)
    print("ok: /mcp needs the token")

    if TENANT_A and TENANT_B:
        async with connect(TENANT_A) as a, connect(TENANT_B) as b:
            _, text = await run(a, "secret = 'acme only'")
            owned = session_of(text)
            result, text = await run(b, "secret", session_id=owned)
            check(result.is_error and "no_such_session" in text, f"tenant B reached A's: {text}")
            result = await b.call_tool("read_file", {"path": "x", "session_id": owned})
            check(result.is_error and "no_such_session" in text_of(result), text_of(result))
            _, text = await run(b, "1")
            check(session_of(text) != owned, text)
        print("ok: a tenant cannot use another tenant's session")
        check(await session_gone(owned), f"tenant A's ended conversation's session {owned} lives on")

        # Nor its MCP session: naming A's Mcp-Session-Id with B's token reaches nothing.
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-03-26", "capabilities": {},
            "clientInfo": {"name": "check", "version": "1"}}}
        accept = {"Accept": "application/json, text/event-stream"}
        async with httpx2.AsyncClient(timeout=60) as http:
            opened = await http.post(URL, json=init,
                                     headers={**accept, "Authorization": f"Bearer {TENANT_A}"})
            check(opened.status_code == 200, opened.text)
            mcp_id = opened.headers["mcp-session-id"]
            listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
            as_b = await http.post(URL, json=listing, headers={
                **accept, "Authorization": f"Bearer {TENANT_B}", "Mcp-Session-Id": mcp_id})
            check(as_b.status_code == 404 and as_b.json()["code"] == "no_such_mcp_session",
                  f"tenant B used A's MCP session: {as_b.status_code} {as_b.text}")
            # Ending it: answered as for a session that does not exist, and it goes on.
            ended = await http.delete(URL, headers={
                "Authorization": f"Bearer {TENANT_B}", "Mcp-Session-Id": mcp_id})
            nothing = await http.delete(URL, headers={
                "Authorization": f"Bearer {TENANT_B}",
                "Mcp-Session-Id": "22222222-2222-2222-2222-222222222222"})
            check(ended.status_code == nothing.status_code,
                  f"B's ending A's session and an unknown one differ: {ended.status_code} {nothing.status_code}")
            await http.post(URL, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                            headers={**accept, "Authorization": f"Bearer {TENANT_A}",
                                     "Mcp-Session-Id": mcp_id})
            alive = await http.post(URL, json=listing, headers={
                **accept, "Authorization": f"Bearer {TENANT_A}", "Mcp-Session-Id": mcp_id})
            check(alive.status_code == 200 and "run_python" in alive.text,
                  f"tenant B ended A's MCP session: {alive.status_code} {alive.text[:200]}")
            unknown = await http.post(URL, json=listing, headers={
                **accept, "Authorization": f"Bearer {TENANT_A}",
                "Mcp-Session-Id": "11111111-1111-1111-1111-111111111111"})
            check(unknown.status_code == as_b.status_code and unknown.json() == as_b.json(),
                  f"someone else's session and an unknown one answer differently: {unknown.text}")
            mine = await http.delete(URL, headers={
                "Authorization": f"Bearer {TENANT_A}", "Mcp-Session-Id": mcp_id})
            check(mine.status_code == 204, f"A could not end its own MCP session: {mine.status_code}")
        print("ok: an MCP session is its opener's alone")

    if all(COLLIDING):
        victim, other = COLLIDING
        async with connect(victim) as mine, httpx2.AsyncClient(timeout=120) as http:
            _, text = await run(mine, "secret = 'the victim'")
            owned = session_of(text)
            opened, mcp_id = await open_raw(http, victim)
            check(opened.status_code == 200 and mcp_id, opened.text)
            call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                    "params": {"name": "run_python", "arguments": {"code": "secret = 'replaced'"}}}
            for body in (LISTING, call):
                as_other = await http.post(URL, json=body, headers={
                    **ACCEPT, "Authorization": f"Bearer {other}", "Mcp-Session-Id": mcp_id})
                check(as_other.status_code == 404
                      and as_other.json()["code"] == "no_such_mcp_session",
                      f"t:u/x used t/u:x's MCP session: {as_other.status_code} {as_other.text}")
            # Ending it is answered as ending an unknown session is (rmcp: success), and
            # ends nothing, as the victim's next call shows.
            ended = await http.delete(URL, headers={
                "Authorization": f"Bearer {other}", "Mcp-Session-Id": mcp_id})
            nothing = await http.delete(URL, headers={
                "Authorization": f"Bearer {other}",
                "Mcp-Session-Id": "33333333-3333-3333-3333-333333333333"})
            check(ended.status_code == nothing.status_code,
                  f"ending t/u:x's session and an unknown one differ: {ended.status_code} {nothing.status_code}")
            alive = await http.post(URL, json=LISTING, headers={
                **ACCEPT, "Authorization": f"Bearer {victim}", "Mcp-Session-Id": mcp_id})
            check(alive.status_code == 200 and "run_python" in alive.text,
                  f"the victim's MCP session is gone: {alive.status_code} {alive.text[:200]}")
            _, text = await run(mine, "secret")
            check("the victim" in text and session_of(text) == owned,
                  f"the victim's default session was replaced: {text}")
            await http.delete(URL, headers={"Authorization": f"Bearer {victim}",
                                            "Mcp-Session-Id": mcp_id})
        print("ok: tenants whose names join into one string stay apart")

    if CAPPED and MCP_CAP:
        async with httpx2.AsyncClient(timeout=120) as http:
            held = []
            for _ in range(MCP_CAP):
                opened, mcp_id = await open_raw(http, CAPPED)
                check(opened.status_code == 200 and mcp_id, opened.text)
                held.append(mcp_id)
            refused, _ = await open_raw(http, CAPPED)
            check(refused.status_code == 403
                  and refused.json()["code"] == "tenant_mcp_session_limit"
                  and f"{MCP_CAP} open MCP sessions" in refused.json()["message"],
                  f"past the cap: {refused.status_code} {refused.text}")
            # Another tenant ending one of them ends nothing and frees no slot.
            if TENANT_A:
                await http.delete(URL, headers={"Authorization": f"Bearer {TENANT_A}",
                                                "Mcp-Session-Id": held[0]})
                still, _ = await open_raw(http, CAPPED)
                check(still.status_code == 403,
                      f"another tenant's DELETE freed a slot: {still.status_code} {still.text}")
            # Other tenants are not counted against it.
            if TENANT_A:
                opened, mcp_id = await open_raw(http, TENANT_A)
                check(opened.status_code == 200, f"another tenant was capped: {opened.text}")
                await http.delete(URL, headers={"Authorization": f"Bearer {TENANT_A}",
                                                "Mcp-Session-Id": mcp_id})
            ended = await http.delete(URL, headers={"Authorization": f"Bearer {CAPPED}",
                                                    "Mcp-Session-Id": held.pop()})
            check(ended.status_code == 204, f"ending one: {ended.status_code}")
            opened, mcp_id = await open_raw(http, CAPPED)
            check(opened.status_code == 200 and mcp_id,
                  f"an ended session did not give its slot back: {opened.text}")
            held.append(mcp_id)
            for mcp_id in held:
                await http.delete(URL, headers={"Authorization": f"Bearer {CAPPED}",
                                                "Mcp-Session-Id": mcp_id})
        print(f"ok: a tenant's MCP sessions are capped at {MCP_CAP}")

    print("all checks passed")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except AssertionError as failure:
        print(f"FAILED: {failure}")
        sys.exit(1)
