"""The synchronous client: :class:`Client` (a gateway) and :class:`Session` (one sandboxed
kernel whose state lasts across calls)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterator, List, Mapping, Optional, Union
from urllib.parse import quote, urlsplit

import httpx

from ._errors import (CellgateConnectionError, CellgateError, NotFoundError, error_from,
                      parse_retry_after)
from ._events import (ArtifactCallback, CommandCollector, Collector, EventCallback, InputRequest,
                      Resumption, SseDecoder, StreamCallback, resume_wait)
from ._models import (Artifact, CommandResult, Execution, ExecutionRecord, FileEntry,
                      Kernelspecs, Link, SessionInfo)

InputCallback = Callable[[str, bool], str]
Content = Union[bytes, str, Path, IO[bytes]]

#: Seconds to wait for an answer; an execution's event stream waits longer (the gateway
#: sends a keep-alive every 15 s, so a silent stream this long is a lost one).
DEFAULT_TIMEOUT = 60.0
#: How many times a request the gateway refused with ``Retry-After`` (429, 503) is sent
#: again, and the longest wait before one: a longer ``Retry-After`` raises at once, since
#: a caller would rather know than block that long.
DEFAULT_MAX_RETRIES = 3
DEFAULT_MAX_RETRY_WAIT = 30.0
#: How many times in a row an execution's event stream that broke is resumed (from the last
#: event received) before :class:`~cellgate.StreamInterrupted` is raised.
DEFAULT_MAX_RESUMES = 5

#: What httpx raises when the gateway cannot be reached, or drops the connection without a
#: complete answer: raised as :class:`~cellgate.CellgateConnectionError` instead. Timeouts
#: waiting for an answer (``httpx.ReadTimeout``) are not among them: the gateway was there.
#: Of these, only ``ConnectError`` and ``ConnectTimeout`` mean the request never left.
CONNECTION_ERRORS = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)


def gateway_url(url: Optional[str]) -> str:
    """``url``, else ``CELLGATE_URL``: an app configured by its environment passes neither."""
    url = url or os.environ.get("CELLGATE_URL")
    if not url:
        raise CellgateError("no gateway URL: pass url=... or set CELLGATE_URL")
    return url.rstrip("/")


def gateway_token(token: Optional[str]) -> Optional[str]:
    """``token``, else ``CELLGATE_TOKEN`` (``""`` sends none, whatever the environment)."""
    return token if token is not None else os.environ.get("CELLGATE_TOKEN")


def connection_error(url: str, error: Exception) -> CellgateConnectionError:
    """The :class:`~cellgate.CellgateConnectionError` for an httpx ``error`` talking to the
    gateway at ``url``: "cannot reach" when the connection was never made (the request did
    not leave), else a broken connection after the request was sent, which may have run."""
    detail = str(error) or type(error).__name__
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
        return CellgateConnectionError(f"cannot reach the gateway at {url}: {detail}", url,
                                       request_may_have_run=False)
    return CellgateConnectionError(
        f"the connection to the gateway at {url} broke after the request was sent, before "
        f"its whole answer came; the request may have run: {detail}", url,
        request_may_have_run=True)


def replayable(content: Any) -> bool:
    """Whether a request body can be sent again: none, bytes, text, or a local file (opened
    afresh each time); a file object or an iterator is consumed by the first attempt."""
    return content is None or isinstance(content, (bytes, str, Path))


def retry_wait(response: httpx.Response, retries: int, max_retries: int,
               max_retry_wait: float, can_replay: bool) -> Optional[float]:
    """Seconds to wait before sending the request of ``response`` again, or ``None`` to raise
    its error now. Only a 429 or 503 with ``Retry-After`` is retried: the gateway sends that
    header only for a request it refused before doing anything, so sending it again is safe
    (whatever its method); without the header, it may have done part of the work."""
    if response.status_code not in (429, 503) or not can_replay or retries >= max_retries:
        return None
    wait = parse_retry_after(response.headers.get("retry-after"))
    if wait is None or wait > max_retry_wait:
        return None
    return wait


def _auth_headers(token: Optional[str]) -> Dict[str, str]:
    # `Bearer` carries both the gateway's static token and a tenant's JWT.
    return {"Authorization": f"Bearer {token}"} if token else {}


def session_body(policy: Optional[str], kernel_name: Optional[str],
                 env: Optional[Mapping[str, str]],
                 files: Optional[Mapping[str, Union[str, bytes]]]) -> Dict[str, Any]:
    """The JSON of a new session (shared with the async client)."""
    import base64

    body: Dict[str, Any] = {}
    if policy is not None:
        body["policy"] = policy
    if kernel_name is not None:
        body["kernel_name"] = kernel_name
    if env:
        body["env"] = dict(env)
    if files:
        body["files"] = [
            {"path": path, "content": base64.b64encode(content).decode(), "encoding": "base64"}
            if isinstance(content, bytes) else {"path": path, "content": content}
            for path, content in files.items()
        ]
    return body


def list_params(dir: str, recursive: bool, hidden: bool) -> Dict[str, str]:
    params = {"dir": dir} if dir else {}
    if recursive:
        params["recursive"] = "true"
    if hidden:
        params["hidden"] = "true"
    return params


def absolute_url(base: str, path: str) -> str:
    """``path`` (absolute on the gateway's origin, as its URLs are) on ``base``'s origin."""
    if "://" in path:
        return path
    parts = urlsplit(base)
    return f"{parts.scheme}://{parts.netloc}{path}"


def file_url(session_id: str, path: str) -> str:
    return f"/v1/sessions/{quote(session_id, safe='')}/files/{quote(path.lstrip('/'), safe='/')}"


def command_body(cmd: str, cwd: Optional[str], env: Optional[Mapping[str, str]],
                 timeout: Optional[float]) -> Dict[str, Any]:
    """The JSON of a command (shared with the async client)."""
    body: Dict[str, Any] = {"cmd": cmd}
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = dict(env)
    if timeout is not None:
        body["timeout_s"] = timeout
    return body


def move_body(dst: str, overwrite: bool) -> Dict[str, Any]:
    return {"op": "move", "to": dst.lstrip("/"), "overwrite": overwrite}


def remove_params(recursive: bool) -> Dict[str, str]:
    return {"recursive": "true"} if recursive else {}


#: An event stream's headers, and its timeouts: reads wait at least a minute, four times the
#: gateway's keep-alive interval.
SSE_HEADERS = {"Accept": "text/event-stream"}


def stream_timeout(timeout: float) -> httpx.Timeout:
    return httpx.Timeout(timeout, read=max(timeout, 60.0))


class Client:
    """A cellgate gateway: ``Client("http://127.0.0.1:8888", token)``, or ``Client()`` with
    ``CELLGATE_URL`` and ``CELLGATE_TOKEN`` in the environment.

    ``token`` is the gateway's static token or a tenant's JWT. Use :meth:`session` for a
    kernel that keeps its state across calls, :meth:`run_code` for a one-shot execution.
    A request the gateway refuses with ``Retry-After`` (429, 503) is sent again after that
    wait, up to ``max_retries`` times and for waits up to ``max_retry_wait`` seconds. An
    execution's event stream that breaks is resumed where it broke, up to ``max_resumes``
    times in a row (see :meth:`Session.run_code`).
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *,
                 timeout: float = DEFAULT_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                 max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT,
                 max_resumes: int = DEFAULT_MAX_RESUMES,
                 http: Optional[httpx.Client] = None) -> None:
        self.url = gateway_url(url)
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_retry_wait = max_retry_wait
        self.max_resumes = max_resumes
        self._own_http = http is None
        self._http = http or httpx.Client(base_url=self.url, timeout=timeout)
        self._headers = _auth_headers(gateway_token(token))

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; raises :class:`~cellgate.APIError` for an error answer (after the
        retries ``Retry-After`` allows) and :class:`~cellgate.CellgateConnectionError` when
        the gateway cannot be reached or the connection breaks (never retried: see its
        ``request_may_have_run``). ``content`` may be a :class:`~pathlib.Path`, sent
        from the file (again on a retry)."""
        return self._send(method, path, **kwargs)

    def _send(self, method: str, path: str, *, stream: bool = False, content: Any = None,
              **kwargs: Any) -> httpx.Response:
        """:meth:`request`; with ``stream``, the response's body is left to read (and the
        response to close) for the caller."""
        headers = {**self._headers, **kwargs.pop("headers", {})}
        retries = 0
        while True:
            try:
                with contextlib.ExitStack() as files:
                    body = files.enter_context(content.open("rb")) \
                        if isinstance(content, Path) else content
                    request = self._http.build_request(method, self.url + path, headers=headers,
                                                       content=body, **kwargs)
                    response = self._http.send(request, stream=stream)
                if response.status_code < 400:
                    return response
                if stream:
                    try:
                        response.read()
                    finally:
                        response.close()
            except CONNECTION_ERRORS as error:
                raise connection_error(self.url, error) from error
            wait = retry_wait(response, retries, self.max_retries, self.max_retry_wait,
                              replayable(content))
            if wait is None:
                raise error_from(response)
            retries += 1
            time.sleep(wait)

    def _events(self, response: httpx.Response) -> Iterator[Dict[str, Any]]:
        """The events of a ``text/event-stream`` response, as they come."""
        decoder = SseDecoder()
        try:
            for line in response.iter_lines():
                event = decoder.feed(line)
                if event is not None:
                    yield event
        except CONNECTION_ERRORS as error:
            raise connection_error(self.url, error) from error

    def session(self, *, policy: Optional[str] = None, kernel_name: Optional[str] = None,
                env: Optional[Mapping[str, str]] = None,
                files: Optional[Mapping[str, Union[str, bytes]]] = None) -> "Session":
        """A new session: a kernel in its own sandbox, ready when this returns."""
        return Session(client=self, policy=policy, kernel_name=kernel_name, env=env, files=files)

    def attach(self, session_id: str) -> "Session":
        """The existing session ``session_id`` (a chat app keeps it across turns)."""
        return Session(client=self, id=session_id)

    def sessions(self) -> List[SessionInfo]:
        """The caller's sessions."""
        return [SessionInfo.from_json(s) for s in self.request("GET", "/v1/sessions").json()]

    def kernelspecs(self) -> Kernelspecs:
        """The kernels a session may run (each one's ``name``, ``display_name`` and
        ``language``) and the ``default``."""
        return Kernelspecs.from_json(self.request("GET", "/v1/kernelspecs").json())

    def run_code(self, code: str, *, timeout: Optional[float] = None,
                 policy: Optional[str] = None, kernel_name: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None, **callbacks: Any) -> Execution:
        """Runs ``code`` once in a fresh session (with ``policy``, ``kernel_name`` and
        ``env``) that is deleted afterwards."""
        with self.session(policy=policy, kernel_name=kernel_name, env=env) as session:
            return session.run_code(code, timeout=timeout, **callbacks)

    def fetch_artifact(self, artifact_id: str) -> bytes:
        """An artifact's bytes."""
        return self.request("GET", f"/v1/artifacts/{quote(artifact_id, safe='')}").content

    def artifact_link(self, artifact_id: str, *, ttl: Optional[float] = None) -> Link:
        """A signed link to an artifact, for a page's ``<img src>`` with no credential:
        it works for ``ttl`` seconds (the gateway's default when ``None``, at most its
        maximum) and until the session is deleted."""
        body = {} if ttl is None else {"ttl_s": int(ttl)}
        data = self.request("POST", f"/v1/artifacts/{quote(artifact_id, safe='')}/links",
                            json=body).json()
        return Link(url=self.absolute_url(data["url"]), expires=data["expires"])

    def absolute_url(self, path: str) -> str:
        """A URL the gateway gave relative to its origin, made absolute."""
        return absolute_url(self.url, path)

    def close(self) -> None:
        if self._own_http:
            self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Session:
    """One sandboxed kernel whose variables and files last across calls.

    ``Session(url, token, policy="data-science")`` creates it (``url`` and ``token``
    default to ``CELLGATE_URL`` and ``CELLGATE_TOKEN``); as a context manager it is deleted
    on exit (``keep=True`` keeps it, for a later :meth:`Client.attach`). ``env`` sets the
    kernel's environment variables: ``KERNEL_*``, and the names the policy's
    ``[environment] allow`` lists (others are refused, ``env_not_allowed``).
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *,
                 policy: Optional[str] = None, kernel_name: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None,
                 files: Optional[Mapping[str, Union[str, bytes]]] = None,
                 client: Optional[Client] = None, id: Optional[str] = None,
                 keep: bool = False, timeout: float = DEFAULT_TIMEOUT,
                 max_retries: int = DEFAULT_MAX_RETRIES,
                 max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT) -> None:
        if client is None:
            client = Client(url, token, timeout=timeout, max_retries=max_retries,
                            max_retry_wait=max_retry_wait)
            self._own_client = True
        else:
            self._own_client = False
        self.client = client
        self.keep = keep
        try:
            if id is None:
                answer = client.request("POST", "/v1/sessions",
                                        json=session_body(policy, kernel_name, env, files))
            else:
                answer = client.request("GET", f"/v1/sessions/{quote(id, safe='')}")
        except BaseException:
            if self._own_client:
                client.close()
            raise
        self.info_at_start = SessionInfo.from_json(answer.json())
        self.id = self.info_at_start.id

    @property
    def _path(self) -> str:
        return f"/v1/sessions/{quote(self.id, safe='')}"

    @property
    def kernel_name(self) -> str:
        """The kernelspec this session runs (it never changes)."""
        return self.info_at_start.kernel_name

    @property
    def language(self) -> str:
        """The language of its kernel: ``python``, ``typescript``, ``bash``, ``R``…"""
        return self.info_at_start.language

    def info(self) -> SessionInfo:
        """The session now (its state, state_generation, executions…)."""
        return SessionInfo.from_json(self.client.request("GET", self._path).json())

    def run_code(self, code: str, *, timeout: Optional[float] = None,
                 on_stdout: Optional[StreamCallback] = None,
                 on_stderr: Optional[StreamCallback] = None,
                 on_artifact: Optional[ArtifactCallback] = None,
                 on_input: Optional[InputCallback] = None,
                 on_event: Optional[EventCallback] = None) -> Execution:
        """Runs ``code``, streaming its output to the callbacks as it comes, and returns its
        :class:`~cellgate.Execution` (whatever its status: check ``.ok`` or call
        ``.raise_for_status()``).

        ``timeout`` (seconds) interrupts the cell and reports ``timeout``. ``on_input(prompt,
        password)`` answers the code's ``input()``; without it, a cell that asks for input
        is interrupted, since nobody could answer.

        If the connection drops mid-stream, the stream is resumed from the last event
        received (``GET …/executions/{id}`` with ``Last-Event-ID``), so each event reaches
        the callbacks once; after the client's ``max_resumes`` failed attempts in a row,
        :class:`~cellgate.StreamInterrupted` says which execution to fetch later.
        """
        body: Dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout_s"] = timeout
        collector = Collector(self.client, on_stdout, on_stderr, on_artifact, on_event)
        response = self.client._send("POST", self._path + "/execute", stream=True, json=body,
                                     headers=SSE_HEADERS,
                                     timeout=stream_timeout(self.client.timeout))
        where = Resumption()
        failures = 0
        while True:
            cause: Optional[Exception] = None
            try:
                for event in self.client._events(response):
                    if not where.accept(event):
                        continue
                    failures = 0
                    request = collector.handle(event)
                    if request is not None:
                        self._answer(request, on_input)
                    if collector.result is not None:
                        return collector.result
            except CellgateConnectionError as error:
                cause = error
            finally:
                response.close()
            # The stream broke (or ended early): resume it where it was.
            while True:
                if not where.resumable or failures >= self.client.max_resumes:
                    raise where.give_up(self.client.url, failures) from cause
                failures += 1
                time.sleep(resume_wait(failures))
                try:
                    response = self.client._send("GET", where.path(self._path), stream=True,
                                                 headers=where.headers(),
                                                 timeout=stream_timeout(self.client.timeout))
                    break
                except CellgateConnectionError as error:
                    cause = error

    def executions(self, limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """The session's newest executions (``limit``: the gateway's default is 100), oldest
        first, the running one last: each ``execution_id``, ``state``, ``code``, ``started``
        and ``status`` (``None`` while running). For an id that was lost."""
        params = {} if limit is None else {"limit": str(limit)}
        return list(self.client.request("GET", self._path + "/executions", params=params).json())

    def execution(self, execution_id: str) -> ExecutionRecord:
        """An execution of this session, running or done: its events so far and, once done,
        its result (for a result whose stream was lost, or that a page never saw).
        :class:`~cellgate.NotFoundError` (``no_such_execution``) for one the session does
        not have (or no longer keeps)."""
        answer = self.client.request(
            "GET", f"{self._path}/executions/{quote(execution_id, safe='')}")
        return ExecutionRecord.from_json(answer.json(), self.client)

    def run_command(self, cmd: str, *, cwd: Optional[str] = None,
                    env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
                    on_stdout: Optional[StreamCallback] = None,
                    on_stderr: Optional[StreamCallback] = None) -> CommandResult:
        """Runs the shell command ``cmd`` (``bash -c``) in the session's sandbox, with the
        kernel's user, limits and network policy, and returns its
        :class:`~cellgate.CommandResult` whatever its status (check ``.ok``, or call
        ``.raise_for_status()``). For ``pip install``, ``git clone``, ``ls``: it leaves the
        kernel's variables alone and is not part of the notebook history.

        It runs in the workspace, or ``cwd`` below it, with ``env`` added to the kernel's
        variables, after any cell that is running. ``timeout`` (seconds; the gateway's
        default is 60) kills it and everything it started: status ``timeout``. Output goes
        to ``on_stdout``/``on_stderr`` as it comes. The answer is always an event stream,
        whose keep-alives let a long command (or a long wait behind a cell) outlast the
        client's read timeout.
        """
        collector = CommandCollector(on_stdout, on_stderr)
        response = self.client._send("POST", self._path + "/commands", stream=True,
                                     json=command_body(cmd, cwd, env, timeout),
                                     headers=SSE_HEADERS,
                                     timeout=stream_timeout(self.client.timeout))
        try:
            for event in self.client._events(response):
                collector.handle(event)
                if collector.result is not None:
                    return collector.result
        finally:
            response.close()
        raise CellgateError("the event stream ended without the command's result (no "
                            "`done` event); the command may have run")

    def _answer(self, request: InputRequest, on_input: Optional[InputCallback]) -> None:
        if on_input is None:
            self.interrupt()
            return
        self.send_input(on_input(request.prompt, request.password), request.execution_id)

    def send_input(self, value: str, execution_id: Optional[str] = None) -> None:
        """Answers the ``input()`` a running cell waits for."""
        body: Dict[str, Any] = {"value": value}
        if execution_id:
            body["execution_id"] = execution_id
        self.client.request("POST", self._path + "/input", json=body)

    def interrupt(self) -> None:
        """Interrupts the running cell (its result says ``KeyboardInterrupt``)."""
        self.client.request("POST", self._path + "/interrupt")

    def restart(self) -> SessionInfo:
        """Restarts the kernel: variables and workspace files are lost, and
        ``state_generation`` changes."""
        return SessionInfo.from_json(self.client.request("POST", self._path + "/restart").json())

    def upload(self, path: str, content: Content) -> Dict[str, Any]:
        """Writes ``content`` (bytes, text, a local file's :class:`~pathlib.Path`, or a
        binary file object, streamed) to ``path`` in the workspace. A file object is read
        once: its upload is not retried."""
        if isinstance(content, str):
            content = content.encode()
        return self.client.request("PUT", file_url(self.id, path), content=content).json()

    def download(self, path: str) -> bytes:
        """A workspace file's bytes."""
        return self.client.request("GET", file_url(self.id, path)).content

    def files(self, dir: str = "", *, recursive: bool = False,
              hidden: bool = False) -> List[FileEntry]:
        """The workspace's files: the entries of ``dir`` (default: the top), everything
        below it with ``recursive``, names starting with a dot only with ``hidden``."""
        answer = self.client.request("GET", self._path + "/files",
                                     params=list_params(dir, recursive, hidden))
        return [FileEntry.from_json(f) for f in answer.json()]

    def exists(self, path: str) -> bool:
        """Whether anything (a file, a directory, a link) is at ``path`` in the workspace:
        one ``HEAD`` request, whose 404 names what is missing in its
        ``X-Cellgate-Error-Code`` header. Nothing there (``no_such_file``) is ``False``; any
        other error raises, so a session that is gone is a :class:`~cellgate.NotFoundError`
        (``no_such_session``), not ``False``."""
        try:
            self.client.request("HEAD", file_url(self.id, path))
        except NotFoundError as error:
            if error.code == "no_such_file":
                return False
            raise
        return True

    def stat(self, path: str) -> FileEntry:
        """What is at ``path`` (a link is described, never followed);
        :class:`~cellgate.NotFoundError` (``no_such_file``) when nothing is."""
        answer = self.client.request("POST", file_url(self.id, path), json={"op": "stat"})
        return FileEntry.from_json(answer.json())

    def make_dir(self, path: str) -> FileEntry:
        """Creates the directory ``path`` and any missing parent; one that exists is fine."""
        answer = self.client.request("POST", file_url(self.id, path), json={"op": "mkdir"})
        return FileEntry.from_json(answer.json())

    def move(self, src: str, dst: str, *, overwrite: bool = False) -> FileEntry:
        """Moves (renames) the file or directory ``src`` to ``dst``, creating ``dst``'s
        missing parents, and returns the entry at ``dst``. Anything already at ``dst`` is a
        :class:`~cellgate.ConflictError` (``exists``) unless ``overwrite``."""
        answer = self.client.request("POST", file_url(self.id, src),
                                     json=move_body(dst, overwrite))
        return FileEntry.from_json(answer.json())

    rename = move

    def remove(self, path: str, *, recursive: bool = False) -> int:
        """Removes a file, a link (not what it points at) or an empty directory; with
        ``recursive``, a directory and everything in it (without it, a directory that is
        not empty is a :class:`~cellgate.ConflictError`, ``not_empty``). Returns how many
        entries went."""
        answer = self.client.request("DELETE", file_url(self.id, path),
                                     params=remove_params(recursive))
        return int(answer.json().get("removed", 0))

    def artifacts(self) -> List[Artifact]:
        """Every artifact the session made, oldest first."""
        answer = self.client.request("GET", self._path + "/artifacts")
        return [Artifact.from_json(a, self.client) for a in answer.json()]

    def export_notebook(self) -> Dict[str, Any]:
        """The session's history as an nbformat 4 notebook (a dict; ``json.dump`` it to
        get an ``.ipynb``)."""
        return self.client.request("GET", self._path + "/notebook").json()

    def delete(self) -> None:
        """Shuts the kernel down (its artifacts stay fetchable for a while)."""
        self.client.request("DELETE", self._path)

    def close(self) -> None:
        """Deletes the session (unless ``keep``) and closes a client it made itself."""
        try:
            if not self.keep:
                try:
                    self.delete()
                except NotFoundError:
                    pass  # already gone: deleted, or culled by the gateway
        finally:
            if self._own_client:
                self.client.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
