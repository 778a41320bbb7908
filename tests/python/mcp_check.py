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
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

URL = os.environ["CELLGATE_URL"].rstrip("/") + "/mcp"
TOKEN = os.environ["CELLGATE_TOKEN"]
TENANT_A = os.environ.get("CELLGATE_TENANT_A")
TENANT_B = os.environ.get("CELLGATE_TENANT_B")

TOOLS = {"run_python", "new_session", "list_files", "read_file", "write_file", "get_artifact",
         "interrupt", "restart", "export_notebook"}


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def text_of(result):
    return "\n".join(c.text for c in result.content if c.type == "text")


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
    result = await session.call_tool("run_python", {"code": code, **arguments})
    return result, text_of(result)


async def main():
    async with connect(TOKEN) as mcp:
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
        check(set(tools) == TOOLS, f"tools: {sorted(tools)}")
        check("code" in tools["run_python"].input_schema["properties"],
              tools["run_python"].input_schema)
        print("ok: the tools are listed with their schemas")

        result, text = await run(mcp, "x = 21\nprint('hello')\nx * 2")
        check(not result.is_error and "status: ok" in text, text)
        check("stdout:\nhello" in text and "result: 42" in text, text)
        check("a new session" in text, text)
        first = session_of(text)
        result, text = await run(mcp, "x + 1")
        check("result: 22" in text and session_of(text) == first, text)
        check("a new session" not in text, text)
        print("ok: state lasts across calls in the caller's session")

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

        result = await mcp.call_tool("write_file", {"path": "data/in.csv", "content": "a,b\n1,2\n"})
        check(not result.is_error and "8 bytes" in text_of(result), text_of(result))
        blob = base64.b64encode(bytes(range(256))).decode()
        result = await mcp.call_tool("write_file",
                                     {"path": "blob.bin", "content": blob, "encoding": "base64"})
        check(not result.is_error, text_of(result))
        result, text = await run(mcp, "import pandas as pd\ndf = pd.read_csv('data/in.csv')\n"
                                 "df.to_csv('out.csv', index=False)\nlen(open('blob.bin','rb').read())")
        check("result: 256" in text, text)
        files = text_of(await mcp.call_tool("list_files", {}))
        check("out.csv (file" in files and "data (dir" in files, files)
        check(text_of(await mcp.call_tool("read_file", {"path": "out.csv"})) == "a,b\n1,2\n", "read")
        binary = text_of(await mcp.call_tool("read_file", {"path": "blob.bin"}))
        check("binary" in binary and "256 bytes" in binary, binary)
        missing = await mcp.call_tool("read_file", {"path": "nope.txt"})
        check(missing.is_error and "no_such_file" in text_of(missing), text_of(missing))
        escape = await mcp.call_tool("read_file", {"path": "../../etc/passwd"})
        check(escape.is_error and "bad_path" in text_of(escape), text_of(escape))
        print("ok: files are written, listed and read; bad paths are refused")

        result, text = await run(mcp, "from IPython.display import HTML, display\n"
                                 "display(HTML('<table><tr><td>7</td></tr></table>'))")
        artifact = re.search(r"- ([0-9a-f]{32}) \(text/html", text)
        check(artifact, text)
        html = text_of(await mcp.call_tool("get_artifact", {"artifact_id": artifact.group(1)}))
        check(html == "<table><tr><td>7</td></tr></table>", html)
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
            stopped = await mcp.call_tool("interrupt", {})
        result, text = running.result()
        check("KeyboardInterrupt" in text, text)
        check(stopped is not None and "interrupted session" in text_of(stopped),
              stopped and text_of(stopped))
        _, text = await run(mcp, "x")
        check("result: 21" in text, f"variables lost by an interrupt: {text}")
        print("ok: interrupt stops a running cell and keeps the variables")

        restarted = text_of(await mcp.call_tool("restart", {}))
        check("variables and files are gone" in restarted, restarted)
        _, text = await run(mcp, "x")
        check("NameError" in text and session_of(text) == first, text)
        print("ok: restart loses the variables")

        fresh = text_of(await mcp.call_tool("new_session", {}))
        second = re.search(r"New session ([0-9a-f-]{36})", fresh).group(1)
        check(second != first, fresh)
        _, text = await run(mcp, "1")
        check(session_of(text) == second, text)
        _, text = await run(mcp, "x", session_id=first)
        check("failed" in text and "no_such_session" in text, f"the old session survived: {text}")
        print("ok: new_session starts over and shuts the old one down")

        async with connect(TOKEN) as other:
            _, text = await run(other, "1")
            check(session_of(text) not in (first, second), "two conversations share a kernel")
        print("ok: another MCP session gets another kernel")

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

    print("all checks passed")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except AssertionError as failure:
        print(f"FAILED: {failure}")
        sys.exit(1)
