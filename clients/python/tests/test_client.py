"""The Python client against a live gateway (started by tests/it/sdk.rs, which sets
CELLGATE_URL and CELLGATE_TOKEN): real kernels in the gateway's default sandbox."""

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import pytest

import cellgate
from cellgate import (AsyncClient, AsyncSession, BadRequestError, Client, ConflictError,
                      NotFoundError, Session)

URL = os.environ.get("CELLGATE_URL", "")
TOKEN = os.environ.get("CELLGATE_TOKEN", "")
if not URL or not TOKEN:  # never a silent skip: run through `cargo nextest run sdk::`
    raise RuntimeError("CELLGATE_URL and CELLGATE_TOKEN must name a running gateway")


@pytest.fixture
def session():
    with Session(URL, TOKEN) as s:
        yield s


def test_run_code_streams_and_returns_a_typed_execution(session):
    out, err = [], []
    execution = session.run_code(
        "import sys\nprint('hello')\nprint('oops', file=sys.stderr)\n6 * 7",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert execution.ok and execution.status == "ok", execution
    assert execution.stdout == "hello\n" and "".join(out) == "hello\n"
    assert execution.stderr == "oops\n" and "".join(err) == "oops\n"
    assert execution.result == "42"
    assert execution.error is None
    assert execution.execution_count == 1
    assert execution.state_generation >= 1
    assert execution.raise_for_status() is execution


def test_state_lasts_across_calls_and_restart_says_it_is_gone(session):
    first = session.run_code("x = 41")
    assert session.run_code("x + 1").result == "42"
    info = session.restart()
    assert info.state_generation != first.state_generation
    after = session.run_code("x")
    assert after.status == "error" and after.error.ename == "NameError"
    assert after.state_generation == info.state_generation


def test_errors_carry_the_traceback_and_raise_on_request(session):
    execution = session.run_code("def f():\n    1 / 0\nf()")
    assert execution.status == "error"
    assert execution.error.ename == "ZeroDivisionError"
    assert any("1 / 0" in line for line in execution.error.traceback)
    assert "\x1b[" not in str(execution.error)
    with pytest.raises(cellgate.ExecutionFailed) as failed:
        execution.raise_for_status()
    assert failed.value.execution is execution


def test_a_timeout_is_its_own_status_and_keeps_the_variables(session):
    session.run_code("kept = 'yes'")
    execution = session.run_code("import time\ntime.sleep(30)", timeout=1)
    assert execution.status == "timeout", execution
    assert session.run_code("kept").result == "'yes'"


def test_a_chart_is_an_artifact_to_fetch_and_save(session, tmp_path):
    seen = []
    execution = session.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()",
        on_artifact=seen.append,
    )
    assert execution.ok, execution
    pngs = [a for a in execution.artifacts if a.mime == "image/png"]
    assert len(pngs) == 1, execution.artifacts
    assert [a.id for a in seen] == [pngs[0].id]
    png = pngs[0]
    assert png.width and png.height and png.summary.startswith("PNG image")
    data = png.fetch()
    assert data.startswith(b"\x89PNG") and len(data) == png.bytes
    saved = png.save(tmp_path)
    assert saved.read_bytes() == data and saved.suffix == ".png"
    assert [a.id for a in session.artifacts()] == [png.id]
    # The signed link is absolute and needs no credential; link() makes another.
    assert png.signed_url.startswith(URL + "/v1/artifacts/" + png.id + "/signed?"), png.signed_url
    assert httpx.get(png.signed_url).content == data
    assert httpx.get(URL + png.url).status_code == 401
    link = png.link(ttl=60)
    assert link.url != png.signed_url and link.expires
    assert httpx.get(link.url).content == data
    with pytest.raises(cellgate.APIError) as refused:
        png.link(ttl=10 ** 9)
    assert refused.value.code == "bad_ttl"


def test_input_is_answered_by_the_callback(session):
    prompts = []

    def answer(prompt, password):
        prompts.append((prompt, password))
        return "Ada"

    execution = session.run_code("name = input('who? ')\nprint('hi', name)", on_input=answer)
    assert execution.ok, execution
    assert prompts == [("who? ", False)]
    assert execution.stdout == "hi Ada\n"


def test_input_without_a_callback_interrupts_the_cell(session):
    execution = session.run_code("input('nobody answers ')")
    assert execution.status == "error"
    assert execution.error.ename == "KeyboardInterrupt"


def test_files_go_up_and_come_down(session, tmp_path):
    assert session.upload("data/in.csv", "a,b\n1,2\n") == {"path": "data/in.csv", "bytes": 8}
    local = tmp_path / "blob.bin"
    local.write_bytes(bytes(range(256)) * 64)
    session.upload("blob.bin", local)
    execution = session.run_code(
        "import pandas as pd\ndf = pd.read_csv('data/in.csv')\n"
        "df.assign(c=df.a + df.b).to_csv('out.csv', index=False)\n"
        "len(open('blob.bin', 'rb').read())"
    )
    assert execution.result == "16384", execution
    assert session.download("out.csv") == b"a,b,c\n1,2,3\n"
    assert session.download("blob.bin") == local.read_bytes()
    paths = {f.path for f in session.files()}
    assert {"data", "out.csv", "blob.bin"} <= paths, paths
    assert "data/in.csv" not in paths and not any(p.startswith(".") for p in paths), paths
    assert [f.path for f in session.files("data")] == ["data/in.csv"]
    everything = {f.path for f in session.files(recursive=True, hidden=True)}
    assert "data/in.csv" in everything and any(p.startswith(".") for p in everything)


def test_interrupt_stops_a_running_cell(session):
    # Interrupted every 2 s until the run returns: on a slow machine the first interrupt may
    # come before the cell runs, and a kernel between cells ignores it. Should no interrupt
    # work, the cell's own timeout ends it, as `timeout` and not KeyboardInterrupt.
    done = threading.Event()

    def stop():
        while not done.wait(2.0):
            session.interrupt()

    stopper = threading.Thread(target=stop)
    stopper.start()
    started = time.monotonic()
    try:
        execution = session.run_code("import time\nwhile True:\n    time.sleep(0.1)", timeout=120)
    finally:
        done.set()
        stopper.join()
    print(f"interrupted after {time.monotonic() - started:.1f} s")
    assert execution.status == "error" and execution.error.ename == "KeyboardInterrupt", execution


def test_the_notebook_exports_every_cell(session):
    session.run_code("a = 1")
    session.run_code("print(a + 1)")
    notebook = session.export_notebook()
    assert notebook["nbformat"] == 4
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
               for c in notebook["cells"]]
    assert sources == ["a = 1", "print(a + 1)"]
    json.dumps(notebook)


def test_api_errors_are_exceptions_with_the_servers_code():
    with pytest.raises(cellgate.AuthenticationError) as error:
        Session(URL, "not-the-token")
    assert error.value.status == 401 and error.value.code == "invalid_token"
    with pytest.raises(cellgate.APIError) as error:
        Session(URL, TOKEN, policy="no-such-policy")
    assert error.value.status == 400 and error.value.code == "unknown_policy"
    assert "no-such-policy" in error.value.message
    with Client(URL, TOKEN) as client:
        with pytest.raises(cellgate.NotFoundError) as error:
            client.attach("no-such-session")
        assert error.value.code == "no_such_session"
        with pytest.raises(cellgate.ConflictError) as error:
            with client.session() as s:
                s.send_input("x")
        assert error.value.code == "no_input_awaited"


def test_a_session_is_attached_again_by_id_and_deleted_on_exit():
    with Client(URL, TOKEN) as client:
        with client.session() as first:
            first.keep = True
            first.run_code("turn = 1")
        again = client.attach(first.id)
        assert again.run_code("turn + 1").result == "2"
        again.close()
        assert first.id not in {s.id for s in client.sessions()}


def test_one_shot_run_code_leaves_no_session():
    with Client(URL, TOKEN) as client:
        before = {s.id for s in client.sessions()}
        assert client.run_code("2 ** 10").result == "1024"
        assert {s.id for s in client.sessions()} == before


def test_kernelspecs_name_their_language_and_a_session_runs_the_one_it_names(session):
    with Client(URL, TOKEN) as client:
        specs = client.kernelspecs()
        assert specs.default == "python3", specs
        assert specs.get("python3").language == "python", specs
        assert specs.get("deno").language == "typescript", specs
        assert specs.get("cobol") is None
        assert "bash" in specs.names() and all(k.display_name for k in specs.kernelspecs)
        with client.session(kernel_name="deno") as deno:
            assert (deno.kernel_name, deno.language) == ("deno", "typescript")
            assert deno.info().language == "typescript"
            assert deno.id in {s.id for s in client.sessions() if s.language == "typescript"}
            # TypeScript that Python refuses: the session runs the kernel it named. (The
            # status is the kernel's reply; Deno's outputs are not asserted, see
            # tests/it/api_v1.rs.)
            assert deno.run_code("const answer: number = 6 * 7;").ok
        with pytest.raises(NotFoundError):
            client.session(kernel_name="cobol")
    assert (session.kernel_name, session.language) == ("python3", "python")
    assert session.run_code("const answer: number = 6 * 7;").status == "error"


def test_the_async_client_does_the_same():
    async def main():
        chunks = []

        async def on_stdout(text):
            chunks.append(text)

        async with AsyncSession(URL, TOKEN) as s:
            first = await s.run_code("for i in range(3):\n    print(i)", on_stdout=on_stdout)
            assert first.ok and "".join(chunks) == "0\n1\n2\n"
            answered = await s.run_code("input('? ')", on_input=lambda p, pw: "async")
            assert answered.result == "'async'", answered
            await s.upload("a.txt", b"bytes")
            assert await s.download("a.txt") == b"bytes"
            shown = await s.run_code(
                "from IPython.display import HTML, display\ndisplay(HTML('<i>x</i>'))")
            assert await shown.artifacts[0].afetch() == b"<i>x</i>"
            link = await shown.artifacts[0].alink()
            assert httpx.get(link.url).content == b"<i>x</i>"
            with pytest.raises(TypeError):
                shown.artifacts[0].fetch()
            session_id = s.id
        async with cellgate.AsyncClient(URL, TOKEN) as client:
            assert session_id not in {s.id for s in await client.sessions()}
            specs = await client.kernelspecs()
            assert specs.get("deno").language == "typescript", specs
            async with AsyncSession(client=client, kernel_name="deno") as deno:
                assert (deno.kernel_name, deno.language) == ("deno", "typescript")
                assert (await deno.info()).language == "typescript"
                assert (await deno.run_code("const answer: number = 6 * 7;")).ok

    asyncio.run(main())


def test_a_command_reports_its_exit_code_and_both_streams(session):
    result = session.run_command("echo out; echo err >&2; exit 3")
    assert isinstance(result, cellgate.CommandResult)
    assert result.status == "error" and not result.ok, result
    assert result.exit_code == 3 and result.signal is None and result.error is None
    assert result.stdout == "out\n" and result.stderr == "err\n"
    assert not (result.stdout_truncated or result.stderr_truncated or result.output_truncated)
    assert result.command_id and result.state_generation >= 1
    with pytest.raises(cellgate.CommandFailed) as failed:
        result.raise_for_status()
    assert failed.value.result is result and "exit code 3" in str(failed.value)
    fine = session.run_command("true")
    assert fine.ok and fine.exit_code == 0 and fine.raise_for_status() is fine


def test_a_command_runs_in_cwd_with_env_and_leaves_the_variables_alone(session):
    session.run_code("x = 1")
    session.make_dir("work/sub")
    result = session.run_command('pwd; echo "$GREETING"; x=2', cwd="work/sub",
                                 env={"GREETING": "hello there"})
    assert result.ok, result
    where, greeting = result.stdout.splitlines()
    assert where.endswith("/work/sub") and greeting == "hello there"
    assert session.run_code("x").result == "1"
    # Without cwd it runs in the workspace, where the file API looks.
    assert session.run_command("echo made > work/made.txt").ok
    assert session.download("work/made.txt") == b"made\n"


def test_a_command_past_its_timeout_is_killed(session):
    result = session.run_command("sleep 30", timeout=1)
    assert result.status == "timeout", result
    assert result.signal == "SIGKILL" and result.exit_code is None
    assert result.duration_ms < 20_000
    assert session.run_command("echo still here").stdout == "still here\n"


def test_command_output_streams_before_the_command_ends(session):
    # The command prints, then waits for a file that only the callback uploads, on seeing
    # that first line: it can only end if its output came while it was still running.
    seen = []

    def on_stdout(text):
        seen.append(text)
        if "waiting" in text and not session.exists("go"):
            session.upload("go", b"")

    result = session.run_command(
        "echo waiting; while [ ! -e go ]; do sleep 0.05; done; echo released",
        timeout=30, on_stdout=on_stdout)
    assert result.ok, result
    assert "".join(seen) == "waiting\nreleased\n" == result.stdout


def test_workspace_files_are_made_stated_moved_and_removed(session):
    assert not session.exists("d")
    made = session.make_dir("d/e")
    assert isinstance(made, cellgate.FileEntry) and (made.path, made.kind) == ("d/e", "dir")
    assert session.make_dir("d/e").kind == "dir"  # it exists already: fine
    assert session.exists("d") and session.exists("d/e")
    session.upload("d/e/a.txt", "hello")
    entry = session.stat("d/e/a.txt")
    assert (entry.path, entry.kind, entry.size) == ("d/e/a.txt", "file", 5)
    assert entry.mtime and entry.mtime.endswith("Z"), entry.mtime
    moved = session.move("d/e/a.txt", "f/b.txt")
    assert (moved.path, moved.kind, moved.size) == ("f/b.txt", "file", 5)
    assert not session.exists("d/e/a.txt") and session.download("f/b.txt") == b"hello"
    session.upload("c.txt", "other")
    with pytest.raises(ConflictError) as conflict:
        session.move("c.txt", "f/b.txt")
    assert conflict.value.code == "exists"
    assert session.download("f/b.txt") == b"hello"
    assert session.rename("c.txt", "f/b.txt", overwrite=True).path == "f/b.txt"
    assert session.download("f/b.txt") == b"other" and not session.exists("c.txt")
    with pytest.raises(ConflictError) as conflict:
        session.remove("d")
    assert conflict.value.code == "not_empty"
    assert session.remove("f/b.txt") == 1
    assert session.remove("d", recursive=True) == 2
    assert not session.exists("d")
    with pytest.raises(NotFoundError) as missing:
        session.stat("d")
    assert missing.value.code == "no_such_file"
    with pytest.raises(NotFoundError):
        session.remove("d")


def test_exists_on_a_session_that_is_gone_raises_instead_of_saying_no():
    with Client(URL, TOKEN) as client:
        gone = client.session()
        gone.delete()
        with pytest.raises(NotFoundError) as error:
            gone.exists("anything")
        assert error.value.code == "no_such_session"


def test_a_session_gets_the_variables_its_policy_allows():
    with Session(URL, TOKEN, env={"CLIENT_TEST_X": "from the client"}) as s:
        assert s.run_code("import os\nos.environ['CLIENT_TEST_X']").result == "'from the client'"
        assert s.run_command('echo "$CLIENT_TEST_X"').stdout == "from the client\n"
    with pytest.raises(BadRequestError) as refused:
        Session(URL, TOKEN, env={"CLIENT_OTHER_X": "1"})
    assert refused.value.status == 400 and refused.value.code == "env_not_allowed"
    assert "CLIENT_OTHER_X" in refused.value.message and "default" in refused.value.message
    with Client(URL, TOKEN) as client:
        before = {s.id for s in client.sessions()}
        with pytest.raises(BadRequestError):
            client.session(env={"CLIENT_OTHER_X": "1"})
        one_shot = client.run_code("import os\nos.environ['CLIENT_TEST_ONE']",
                                   env={"CLIENT_TEST_ONE": "1"})
        assert one_shot.result == "'1'", one_shot
        assert {s.id for s in client.sessions()} == before


def test_the_gateway_and_token_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("CELLGATE_URL", URL)
    monkeypatch.setenv("CELLGATE_TOKEN", TOKEN)
    with Session() as s:
        assert s.run_code("6 * 7").result == "42"
    with Client() as client:
        assert client.url == URL.rstrip("/")
        client.sessions()
    # What is passed beats the environment.
    with Client(token="not-the-token") as client, pytest.raises(cellgate.AuthenticationError):
        client.sessions()

    async def sessions():
        async with AsyncClient() as client:
            return await client.sessions()

    asyncio.run(sessions())
    monkeypatch.delenv("CELLGATE_TOKEN")
    with Client() as client, pytest.raises(cellgate.AuthenticationError):
        client.sessions()
    with pytest.raises(cellgate.AuthenticationError):
        asyncio.run(sessions())
    monkeypatch.delenv("CELLGATE_URL")
    for make in (Client, Session, AsyncClient, AsyncSession):
        with pytest.raises(cellgate.CellgateError, match="CELLGATE_URL"):
            make()


def test_the_async_client_runs_commands_and_file_operations():
    async def main():
        out, err = [], []

        async def on_stdout(text):
            out.append(text)

        async with AsyncSession(URL, TOKEN, env={"CLIENT_TEST_ASYNC": "yes"}) as s:
            result = await s.run_command('echo "$CLIENT_TEST_ASYNC"; echo oops >&2; exit 4',
                                         on_stdout=on_stdout, on_stderr=err.append)
            assert result.status == "error" and result.exit_code == 4, result
            assert "".join(out) == "yes\n" and "".join(err) == "oops\n"
            timed_out = await s.run_command("sleep 30", timeout=1)
            assert timed_out.status == "timeout" and timed_out.signal == "SIGKILL"
            assert (await s.make_dir("d")).kind == "dir"
            await s.upload("d/a.txt", "x")
            assert await s.exists("d/a.txt") and (await s.stat("d/a.txt")).size == 1
            assert (await s.move("d/a.txt", "e/b.txt")).path == "e/b.txt"
            await s.upload("c.txt", "y")
            with pytest.raises(ConflictError) as conflict:
                await s.rename("c.txt", "e/b.txt")
            assert conflict.value.code == "exists"
            with pytest.raises(ConflictError) as conflict:
                await s.remove("e")
            assert conflict.value.code == "not_empty"
            assert await s.remove("e", recursive=True) == 2
            assert not await s.exists("e") and await s.exists("d")
        with pytest.raises(BadRequestError) as refused:
            async with AsyncSession(URL, TOKEN, env={"NOT_ALLOWED": "1"}):
                pass
        assert refused.value.code == "env_not_allowed"
        async with AsyncClient(URL, TOKEN) as client:
            one_shot = await client.run_code("import os\nos.environ['CLIENT_TEST_ONE']",
                                             env={"CLIENT_TEST_ONE": "async"})
            assert one_shot.result == "'async'", one_shot

    asyncio.run(main())


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of the gateway that, once, ends the connection
    whose answer carries ``marker`` right after passing that bytes on (a FIN mid-answer, as
    a load balancer that drops a connection sends). ``requests`` keeps the first line of
    every request that went through it."""

    def __init__(self, target: str, marker: bytes) -> None:
        host, port = target.split("://", 1)[1].rsplit(":", 1)
        self.target = (host, int(port))
        self.marker = marker
        self.cuts = 0
        self.requests: list = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()

    def _requests(self, client, upstream) -> None:
        try:
            while chunk := client.recv(65536):
                for line in chunk.split(b"\r\n"):
                    if line.startswith((b"GET ", b"POST ", b"PUT ", b"DELETE ")):
                        self.requests.append(line.decode())
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            upstream.close()

    def _answers(self, upstream, client) -> None:
        seen = b""
        try:
            while chunk := upstream.recv(65536):
                client.sendall(chunk)
                seen = (seen + chunk)[-4096:]
                with self.lock:
                    cut = self.cuts == 0 and self.marker in seen
                    if cut:
                        self.cuts += 1
                if cut:
                    client.shutdown(socket.SHUT_WR)
                    break
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    def __enter__(self) -> "CuttingProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.listener.close()


#: Lines 1–3, then (once the test has seen line 3) lines 4–6.
CUT_CELL = ("import os, time\n"
            "for i in range(1, 4):\n    print(f'line {i}', flush=True)\n"
            "t0 = time.monotonic()\n"
            "while not os.path.exists('go'):\n"
            "    if time.monotonic() - t0 > 60: raise RuntimeError('never went on')\n"
            "    time.sleep(0.02)\n"
            "for i in range(4, 7):\n    print(f'line {i}', flush=True)\n")
CUT_LINES = "".join(f"line {i}\n" for i in range(1, 7))


def test_a_stream_dropped_mid_cell_is_resumed_by_the_client_itself():
    # The cut comes as line 3 passes the proxy, while the cell waits for `go`, which the
    # test uploads only once it has line 3 (from the first stream or the resumed one).
    with CuttingProxy(URL, b"line 3") as proxy, Session(proxy.url, TOKEN) as session:
        out, events = [], []

        def on_stdout(text):
            out.append(text)
            if "line 3" in text:
                session.upload("go", "")

        execution = session.run_code(CUT_CELL, on_stdout=on_stdout, on_event=events.append)
        assert proxy.cuts == 1
        resumed = [r for r in proxy.requests if "/executions/" in r]
        assert resumed and resumed[0].startswith("GET "), proxy.requests
        assert execution.ok and execution.stdout == CUT_LINES, execution
        assert "".join(out) == CUT_LINES
        ids = [e["id"] for e in events]
        assert ids == sorted(set(ids)), ids
        # What reached the callbacks is what the gateway recorded: every event, once.
        record = session.execution(execution.execution_id)
        assert record.done and record.events == events
        assert record.result == execution
        listed = session.executions()
        assert [e["execution_id"] for e in listed][-1] == execution.execution_id
        assert listed[-1]["state"] == "done" and listed[-1]["status"] == "ok"


def test_the_async_client_resumes_a_dropped_stream_too():
    async def main(proxy_url):
        async with AsyncSession(proxy_url, TOKEN) as session:
            out, events = [], []

            async def on_stdout(text):
                out.append(text)
                if "line 3" in text:
                    await session.upload("go", "")

            execution = await session.run_code(CUT_CELL, on_stdout=on_stdout,
                                               on_event=events.append)
            record = await session.execution(execution.execution_id)
            return execution, out, events, record

    with CuttingProxy(URL, b"line 3") as proxy:
        execution, out, events, record = asyncio.run(main(proxy.url))
        assert proxy.cuts == 1 and any("/executions/" in r for r in proxy.requests)
    assert execution.ok and "".join(out) == CUT_LINES
    assert record.done and record.events == events


def test_an_unknown_execution_is_not_found(session):
    with pytest.raises(NotFoundError) as missing:
        session.execution("0123456789abcdef0123456789abcdef")
    assert missing.value.code == "no_such_execution"
