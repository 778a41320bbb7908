"""How the client talks HTTP, against stand-ins for the gateway: retries that honour
Retry-After, exists() as one HEAD, connections that break mid-answer (a tiny scripted server
on 127.0.0.1), and a gateway that cannot be reached (a closed port). No kernel is involved,
so these say exactly what went over the wire."""

import asyncio
import datetime
import email.utils
import io
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import cellgate
from cellgate import AsyncClient, AsyncSession, Client, Session

SESSION = {"id": "s1", "kernel_name": "python3", "policy": "default", "sandbox": "namespaces",
           "state": "idle", "state_generation": 1, "created": "", "last_activity": "",
           "executions": 0}
HANG_UP = object()


def answer(status, body=None, retry_after=None, content_type="application/json", code=None):
    """One scripted answer: ``status``, a JSON (or, as bytes, any) ``body``, a Retry-After,
    an ``X-Cellgate-Error-Code``."""
    headers = {"Content-Type": content_type}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if code is not None:
        headers["X-Cellgate-Error-Code"] = code
    if body is None and status >= 400:
        body = {"reason": "", "message": f"scripted {status}", "code": f"scripted_{status}"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return status, headers, data


def refused(status, retry_after=None):
    return answer(status, retry_after=retry_after)


class Cut:
    """A scripted answer whose body is cut off: its headers promise more than its bytes,
    and the connection closes after them."""

    def __init__(self, scripted):
        self.scripted = scripted


class FakeGateway:
    """A scripted HTTP server: each request gets the next answer (``HANG_UP`` closes the
    connection without one, a :class:`Cut` one breaks off mid-body), and is recorded as
    ``(method, path, body, headers)``."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def handle_one(self):
                fake.requests.append((self.command, self.path, self.read_body(), dict(self.headers)))
                scripted = fake.answers.pop(0) if fake.answers else answer(500, {"code": "script_ended"})
                if scripted is HANG_UP:
                    self.close_connection = True
                    return
                cut = isinstance(scripted, Cut)
                status, headers, data = scripted.scripted if cut else scripted
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data) + (1000 if cut else 0)))
                self.end_headers()
                if self.command != "HEAD":  # a HEAD answer has headers only
                    self.wfile.write(data)
                if cut:
                    self.wfile.flush()
                    time.sleep(0.05)
                    self.close_connection = True

            def read_body(self):
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                        if size == 0:
                            return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = handle_one

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    @property
    def paths(self):
        return [(method, path) for method, path, _, _ in self.requests]


def test_a_refusal_with_retry_after_is_sent_again_after_the_wait():
    with FakeGateway(refused(429, "0"), refused(429, "1"), answer(200, [])) as fake:
        with Client(fake.url, "t") as client:
            started = time.monotonic()
            assert client.sessions() == []
            waited = time.monotonic() - started
    assert fake.paths == [("GET", "/v1/sessions")] * 3
    assert all(headers["Authorization"] == "Bearer t" for _, _, _, headers in fake.requests)
    assert waited >= 0.9, waited


def test_a_wait_beyond_max_retry_wait_raises_at_once():
    with FakeGateway(refused(429, "120")) as fake:
        with Client(fake.url, "t", max_retry_wait=30) as client:
            started = time.monotonic()
            with pytest.raises(cellgate.RateLimitError) as error:
                client.sessions()
            assert time.monotonic() - started < 5
    assert error.value.retry_after == 120 and error.value.code == "scripted_429"
    assert len(fake.requests) == 1


def test_a_quota_refusal_is_a_typed_error_naming_the_quota_and_its_reset():
    cpu = {"reason": "Too Many Requests", "code": "quota_exceeded",
           "message": "tenant acme has used its quota cpu_seconds_per_day of 60 s",
           "quota": {"name": "cpu_seconds_per_day", "limit": 60, "used": 61.5,
                     "resets_at": "2026-03-05T00:00:00.000000Z",
                     "resets": "at 2026-03-05T00:00:00.000000Z (UTC midnight)"}}
    sessions = {"reason": "Too Many Requests", "code": "quota_exceeded",
                "message": "tenant acme runs 2 sessions, its quota concurrent_sessions of 2",
                "quota": {"name": "concurrent_sessions", "limit": 2, "used": 2.0,
                          "resets": "when one of the tenant's sessions ends"}}
    with FakeGateway(answer(429, cpu, retry_after="40000", code="quota_exceeded"),
                     answer(429, sessions, code="quota_exceeded")) as fake:
        with Client(fake.url, "t") as client:
            with pytest.raises(cellgate.QuotaExceededError) as error:
                client.sessions()
            assert isinstance(error.value, cellgate.RateLimitError)
            assert (error.value.quota, error.value.limit, error.value.used) == (
                "cpu_seconds_per_day", 60, 61.5)
            assert error.value.resets_at == datetime.datetime(2026, 3, 5,
                                                               tzinfo=datetime.timezone.utc)
            assert error.value.retry_after == 40000
            assert "UTC midnight" in error.value.resets
            with pytest.raises(cellgate.QuotaExceededError) as error:
                client.session()
            assert (error.value.quota, error.value.limit) == ("concurrent_sessions", 2)
            assert error.value.resets_at is None and error.value.retry_after is None
    # Neither was sent again: one waits past max_retry_wait, the other has no time to wait for.
    assert len(fake.requests) == 2


def test_without_retry_after_a_refusal_is_never_retried():
    with FakeGateway(refused(503), refused(500), refused(409)) as fake:
        with Client(fake.url, "t") as client:
            for kind in (cellgate.UnavailableError, cellgate.APIError, cellgate.ConflictError):
                with pytest.raises(kind) as error:
                    client.sessions()
                assert error.value.retry_after is None
    assert len(fake.requests) == 3


def test_retries_stop_after_max_retries():
    with FakeGateway(*[refused(503, "0")] * 4) as fake:
        with Client(fake.url, "t", max_retries=2) as client:
            with pytest.raises(cellgate.UnavailableError) as error:
                client.sessions()
            assert error.value.retry_after == 0 and len(fake.requests) == 3
        with Client(fake.url, "t", max_retries=0) as client:
            with pytest.raises(cellgate.UnavailableError):
                client.sessions()
    assert len(fake.requests) == 4


def test_retry_after_may_be_an_http_date():
    past = email.utils.formatdate(time.time() - 5, usegmt=True)
    far = email.utils.formatdate(time.time() + 3600, usegmt=True)
    with FakeGateway(refused(429, past), answer(200, []), refused(429, far)) as fake:
        with Client(fake.url, "t") as client:
            assert client.sessions() == []
            with pytest.raises(cellgate.RateLimitError) as error:
                client.sessions()
    assert 3000 < error.value.retry_after <= 3600
    assert len(fake.requests) == 3


def test_bodies_are_sent_again_but_never_a_consumed_file_object(tmp_path):
    local = tmp_path / "local.bin"
    local.write_bytes(b"from a path")
    uploaded = answer(201, {"path": "a", "bytes": 3})
    with FakeGateway(answer(200, SESSION),
                     refused(429, "0"), uploaded,
                     refused(503, "0"), uploaded,
                     refused(429, "0")) as fake:
        with Client(fake.url, "t") as client:
            session = client.attach("s1")
            session.upload("a", "abc")
            session.upload("a", local)
            with pytest.raises(cellgate.RateLimitError):
                session.upload("a", io.BytesIO(b"a stream"))
    assert [(m, p, body) for m, p, body, _ in fake.requests] == [
        ("GET", "/v1/sessions/s1", b""),
        ("PUT", "/v1/sessions/s1/files/a", b"abc"), ("PUT", "/v1/sessions/s1/files/a", b"abc"),
        ("PUT", "/v1/sessions/s1/files/a", b"from a path"),
        ("PUT", "/v1/sessions/s1/files/a", b"from a path"),
        ("PUT", "/v1/sessions/s1/files/a", b"a stream"),
    ]


def sse(*events):
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def test_the_async_client_retries_too_and_an_event_stream_as_well():
    result = {"command_id": "c1", "status": "ok", "exit_code": 0, "signal": None,
              "stdout": "hi\n", "stderr": "", "stdout_truncated": False,
              "stderr_truncated": False, "output_truncated": False, "error": None,
              "denials": [], "duration_ms": 5, "state_generation": 1}
    stream = sse({"type": "started", "command_id": "c1", "cmd": "echo hi"},
                 {"type": "stream", "command_id": "c1", "name": "stdout", "text": "hi\n"},
                 {"type": "done", "command_id": "c1", "result": result})

    async def main(url):
        chunks = []
        async with AsyncClient(url, "t") as client:
            assert await client.sessions() == []
            session = await client.attach("s1")
            done = await session.run_command("echo hi", on_stdout=chunks.append)
        return done, chunks

    with FakeGateway(refused(503, "0"), answer(200, []), answer(200, SESSION),
                     refused(429, "0"),
                     answer(200, stream, content_type="text/event-stream")) as fake:
        done, chunks = asyncio.run(main(fake.url))
    assert isinstance(done, cellgate.CommandResult) and done.ok and done.stdout == "hi\n"
    assert chunks == ["hi\n"]
    commands = [r for r in fake.requests if r[1] == "/v1/sessions/s1/commands"]
    assert len(commands) == 2 and commands[0][2] == commands[1][2]
    assert json.loads(commands[0][2]) == {"cmd": "echo hi"}
    assert commands[0][3]["Accept"] == "text/event-stream"
    assert len(fake.requests) == 5


def closed_port_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_an_unreachable_gateway_is_a_connection_error():
    url = closed_port_url()
    with Client(url, "t") as client:
        with pytest.raises(cellgate.CellgateConnectionError) as error:
            client.sessions()
    assert isinstance(error.value, ConnectionError) and isinstance(error.value, cellgate.CellgateError)
    assert error.value.url == url and url in str(error.value)
    assert str(error.value).startswith(f"cannot reach the gateway at {url}: ")
    assert error.value.request_may_have_run is False
    assert isinstance(error.value.__cause__, httpx.ConnectError)
    with pytest.raises(cellgate.CellgateConnectionError):
        Session(url, "t")

    async def main():
        async with AsyncSession(url, "t"):
            pass

    with pytest.raises(cellgate.CellgateConnectionError) as error:
        asyncio.run(main())
    assert url in str(error.value) and error.value.request_may_have_run is False


def test_a_gateway_that_hangs_up_without_answering_is_a_connection_error():
    with FakeGateway(HANG_UP, HANG_UP) as fake:
        with Client(fake.url, "t", max_retries=3) as client:
            with pytest.raises(cellgate.CellgateConnectionError) as error:
                client.sessions()
        assert fake.url in str(error.value)
        assert error.value.request_may_have_run is True
        assert "may have run" in str(error.value) and "cannot reach" not in str(error.value)
        assert isinstance(error.value.__cause__, httpx.RemoteProtocolError)

        async def main():
            async with AsyncClient(fake.url, "t") as client:
                await client.sessions()

        with pytest.raises(cellgate.CellgateConnectionError) as error:
            asyncio.run(main())
        assert error.value.request_may_have_run is True
    # Never retried: the gateway may have done the work before the connection broke.
    assert len(fake.requests) == 2


COMMAND = {"command_id": "c1", "status": "ok", "exit_code": 0, "signal": None,
           "stdout": "", "stderr": "", "stdout_truncated": False, "stderr_truncated": False,
           "output_truncated": False, "error": None, "denials": [], "duration_ms": 5,
           "state_generation": 1}


def test_an_answer_cut_off_mid_body_says_the_request_may_have_run():
    chunk = sse({"type": "stream", "command_id": "c1", "name": "stdout", "text": "first\n"})
    with FakeGateway(answer(200, SESSION), Cut(answer(201, b'{"path": "a", ')),
                     Cut(answer(200, chunk, content_type="text/event-stream")),
                     answer(200, SESSION),
                     Cut(answer(200, chunk, content_type="text/event-stream"))) as fake:
        with Client(fake.url, "t") as client:
            session = client.attach("s1")
            with pytest.raises(cellgate.CellgateConnectionError) as error:
                session.upload("a", "abc")
            assert error.value.request_may_have_run is True
            assert "may have run" in str(error.value) and "cannot reach" not in str(error.value)
            out = []
            with pytest.raises(cellgate.CellgateConnectionError) as error:
                session.run_command("echo first; sleep 600", on_stdout=out.append)
            assert error.value.request_may_have_run is True and out == ["first\n"]

        async def main():
            out = []
            async with AsyncClient(fake.url, "t") as client:
                session = await client.attach("s1")
                with pytest.raises(cellgate.CellgateConnectionError) as error:
                    await session.run_command("echo first; sleep 600", on_stdout=out.append)
            assert error.value.request_may_have_run is True and out == ["first\n"]

        asyncio.run(main())
    assert len(fake.requests) == 5, "nothing was sent again"


def test_an_event_stream_without_its_done_event_raises_saying_so():
    partial = sse({"type": "stream", "command_id": "c1", "name": "stdout", "text": "partial\n"})
    stream = answer(200, partial, content_type="text/event-stream")
    with FakeGateway(answer(200, SESSION), stream, stream) as fake:
        with Client(fake.url, "t") as client:
            session = client.attach("s1")
            with pytest.raises(cellgate.CellgateError, match="without the command's result"):
                session.run_command("echo partial")
            with pytest.raises(cellgate.CellgateError, match="without the execution's result"):
                session.run_code("print('partial')")


def test_exists_is_one_head_whose_error_code_says_what_is_missing():
    def script():
        return [answer(200, b""),
                answer(404, b"", code="no_such_file"),
                answer(404, b"", code="no_such_session"),
                answer(503, b"", code="kernel_busy")]

    def check(results):
        there, missing, gone, busy = results
        assert there is True and missing is False
        assert isinstance(gone, cellgate.NotFoundError) and gone.code == "no_such_session"
        assert isinstance(busy, cellgate.UnavailableError) and busy.code == "kernel_busy"

    def outcome(call):
        try:
            return call()
        except cellgate.APIError as error:
            return error

    with FakeGateway(answer(200, SESSION), *script()) as fake:
        with Client(fake.url, "t") as client:
            session = client.attach("s1")
            check([outcome(lambda p=p: session.exists(p)) for p in ("a", "b/c", "d", "e")])
    assert fake.paths[1:] == [("HEAD", "/v1/sessions/s1/files/a"),
                              ("HEAD", "/v1/sessions/s1/files/b/c"),
                              ("HEAD", "/v1/sessions/s1/files/d"),
                              ("HEAD", "/v1/sessions/s1/files/e")]

    async def main():
        results = []
        async with AsyncClient(fake.url, "t") as client:
            session = await client.attach("s1")
            for path in ("a", "b/c", "d", "e"):
                try:
                    results.append(await session.exists(path))
                except cellgate.APIError as error:
                    results.append(error)
        return results

    with FakeGateway(answer(200, SESSION), *script()) as fake:
        check(asyncio.run(main()))
    assert [method for method, _ in fake.paths[1:]] == ["HEAD"] * 4


EXECUTION = "e1"
RESULT = {"execution_id": EXECUTION, "status": "ok", "execution_count": 1, "stdout": "a\nb\n",
          "stderr": "", "result": None, "error": None, "artifacts": [], "denials": [],
          "omitted": [], "duration_ms": 1, "state_generation": 1, "resources": {}}


def numbered(id, kind, **fields):
    return {"id": id, "type": kind, "execution_id": EXECUTION, **fields}


def test_a_broken_execution_stream_is_resumed_from_its_last_event_each_event_once():
    cut = Cut(answer(200, sse(numbered(1, "started", code="…"),
                              numbered(2, "stream", name="stdout", text="a\n")),
                     content_type="text/event-stream"))
    # The resumed stream starts with an event already seen: it is dropped.
    rest = answer(200, sse(numbered(2, "stream", name="stdout", text="a\n"),
                           numbered(3, "stream", name="stdout", text="b\n"),
                           numbered(4, "done", result=RESULT)),
                  content_type="text/event-stream")
    resumed_path = f"/v1/sessions/s1/executions/{EXECUTION}"
    with FakeGateway(answer(200, SESSION), cut, rest) as fake:
        with Client(fake.url, "t") as client:
            out, ids = [], []
            execution = client.attach("s1").run_code(
                "print('a'); print('b')", on_stdout=out.append,
                on_event=lambda e: ids.append(e["id"]))
        assert execution.ok and execution.stdout == "a\nb\n"
        assert out == ["a\n", "b\n"] and ids == [1, 2, 3, 4]
        assert fake.paths[-1] == ("GET", resumed_path)
        headers = fake.requests[-1][3]
        assert headers["Last-Event-ID"] == "2" and headers["Accept"] == "text/event-stream"

    async def main(url):
        out = []
        async with AsyncClient(url, "t") as client:
            session = await client.attach("s1")
            execution = await session.run_code("…", on_stdout=out.append)
        return execution, out

    with FakeGateway(answer(200, SESSION), cut, rest) as fake:
        execution, out = asyncio.run(main(fake.url))
        assert execution.ok and out == ["a\n", "b\n"]
        assert fake.paths[-1] == ("GET", resumed_path)
        assert fake.requests[-1][3]["Last-Event-ID"] == "2"


def test_resuming_stops_after_max_resumes_with_a_typed_error_naming_the_execution():
    first = Cut(answer(200, sse(numbered(1, "started", code="…"),
                                numbered(2, "stream", name="stdout", text="a\n")),
                       content_type="text/event-stream"))
    # Each resume breaks again: no new event, so the attempts count on.
    again = Cut(answer(200, sse(numbered(2, "stream", name="stdout", text="a\n")),
                       content_type="text/event-stream"))
    with FakeGateway(answer(200, SESSION), first, again, again) as fake:
        with Client(fake.url, "t", max_resumes=2) as client:
            out = []
            with pytest.raises(cellgate.StreamInterrupted) as error:
                client.attach("s1").run_code("…", on_stdout=out.append)
        assert out == ["a\n"]
        assert error.value.execution_id == EXECUTION and error.value.last_event_id == 2
        assert error.value.request_may_have_run is True
        assert isinstance(error.value, cellgate.CellgateConnectionError)
        assert "Session.execution" in str(error.value)
        assert [p for p in fake.paths if p[0] == "GET"][1:] == \
            [("GET", f"/v1/sessions/s1/executions/{EXECUTION}")] * 2


def test_an_execution_is_fetched_by_id():
    record = {"execution_id": EXECUTION, "state": "done", "code": "1", "started": "t",
              "events": [numbered(1, "started", code="1"), numbered(2, "done", result=RESULT)],
              "result": RESULT}
    with FakeGateway(answer(200, SESSION), answer(200, record),
                     answer(404, code="no_such_execution")) as fake:
        with Client(fake.url, "t") as client:
            session = client.attach("s1")
            fetched = session.execution(EXECUTION)
            assert fetched.done and fetched.result.ok and fetched.result.stdout == "a\nb\n"
            assert [e["id"] for e in fetched.events] == [1, 2]
            with pytest.raises(cellgate.NotFoundError):
                session.execution("unknown")
        assert fake.paths[1] == ("GET", f"/v1/sessions/s1/executions/{EXECUTION}")
