"""The asynchronous client: :class:`AsyncClient` and :class:`AsyncSession`, the same calls
as the synchronous ones, awaited (``async with AsyncSession(url, token) as s: await
s.run_code(...)``). Callbacks may be plain functions or coroutines."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any, AsyncGenerator, Callable, Dict, List, Mapping, Optional, Union
from urllib.parse import quote

import httpx

from ._client import (CONNECTION_ERRORS, DEFAULT_MAX_RESUMES, DEFAULT_MAX_RETRIES,
                      DEFAULT_MAX_RETRY_WAIT, DEFAULT_TIMEOUT, SSE_HEADERS, Content, _auth_headers, absolute_url,
                      command_body, connection_error, file_url, gateway_token, gateway_url,
                      list_params, move_body, remove_params, replayable, retry_wait,
                      session_body, stream_timeout)
from ._errors import CellgateConnectionError, CellgateError, NotFoundError, error_from
from ._events import (CommandCollector, Collector, InputRequest, Resumption, SseDecoder,
                      resume_wait)
from ._models import (Artifact, CommandResult, Execution, ExecutionRecord, FileEntry,
                      Kernelspecs, Link, SessionInfo)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class AsyncClient:
    """A cellgate gateway, for asyncio code (see :class:`cellgate.Client`: the same
    environment defaults and retries)."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *,
                 timeout: float = DEFAULT_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                 max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT,
                 max_resumes: int = DEFAULT_MAX_RESUMES,
                 http: Optional[httpx.AsyncClient] = None) -> None:
        self.url = gateway_url(url)
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_retry_wait = max_retry_wait
        self.max_resumes = max_resumes
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout)
        self._headers = _auth_headers(gateway_token(token))

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """See :meth:`cellgate.Client.request`."""
        return await self._send(method, path, **kwargs)

    async def _send(self, method: str, path: str, *, stream: bool = False, content: Any = None,
                    **kwargs: Any) -> httpx.Response:
        headers = {**self._headers, **kwargs.pop("headers", {})}
        retries = 0
        while True:
            # A local file is read afresh for each attempt (httpx's async client cannot
            # stream a blocking file).
            body = content.read_bytes() if isinstance(content, Path) else content
            try:
                request = self._http.build_request(method, self.url + path, headers=headers,
                                                   content=body, **kwargs)
                response = await self._http.send(request, stream=stream)
                if response.status_code < 400:
                    return response
                if stream:
                    try:
                        await response.aread()
                    finally:
                        await response.aclose()
            except CONNECTION_ERRORS as error:
                raise connection_error(self.url, error) from error
            wait = retry_wait(response, retries, self.max_retries, self.max_retry_wait,
                              replayable(content))
            if wait is None:
                raise error_from(response)
            retries += 1
            await asyncio.sleep(wait)

    async def _events(self, response: httpx.Response) -> AsyncGenerator[Dict[str, Any], None]:
        decoder = SseDecoder()
        try:
            async for line in response.aiter_lines():
                event = decoder.feed(line)
                if event is not None:
                    yield event
        except CONNECTION_ERRORS as error:
            raise connection_error(self.url, error) from error

    async def session(self, *, policy: Optional[str] = None, kernel_name: Optional[str] = None,
                      env: Optional[Mapping[str, str]] = None,
                      files: Optional[Mapping[str, Union[str, bytes]]] = None) -> "AsyncSession":
        session = AsyncSession(client=self, policy=policy, kernel_name=kernel_name, env=env,
                               files=files)
        await session.start()
        return session

    async def attach(self, session_id: str) -> "AsyncSession":
        session = AsyncSession(client=self, id=session_id)
        await session.start()
        return session

    async def sessions(self) -> List[SessionInfo]:
        answer = await self.request("GET", "/v1/sessions")
        return [SessionInfo.from_json(s) for s in answer.json()]

    async def kernelspecs(self) -> Kernelspecs:
        """See :meth:`cellgate.Client.kernelspecs`."""
        return Kernelspecs.from_json((await self.request("GET", "/v1/kernelspecs")).json())

    async def run_code(self, code: str, *, timeout: Optional[float] = None,
                       policy: Optional[str] = None, kernel_name: Optional[str] = None,
                       env: Optional[Mapping[str, str]] = None,
                       **callbacks: Any) -> Execution:
        async with await self.session(policy=policy, kernel_name=kernel_name,
                                      env=env) as session:
            return await session.run_code(code, timeout=timeout, **callbacks)

    async def fetch_artifact(self, artifact_id: str) -> bytes:
        answer = await self.request("GET", f"/v1/artifacts/{quote(artifact_id, safe='')}")
        return answer.content

    async def artifact_link(self, artifact_id: str, *, ttl: Optional[float] = None) -> Link:
        """A signed link to an artifact (see :meth:`cellgate.Client.artifact_link`)."""
        body = {} if ttl is None else {"ttl_s": int(ttl)}
        answer = await self.request("POST", f"/v1/artifacts/{quote(artifact_id, safe='')}/links",
                                    json=body)
        data = answer.json()
        return Link(url=self.absolute_url(data["url"]), expires=data["expires"])

    def absolute_url(self, path: str) -> str:
        """A URL the gateway gave relative to its origin, made absolute."""
        return absolute_url(self.url, path)

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncSession:
    """One sandboxed kernel, for asyncio code: ``async with AsyncSession(url, token) as s``
    creates it on entry and deletes it on exit (see :class:`cellgate.Session`)."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *,
                 policy: Optional[str] = None, kernel_name: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None,
                 files: Optional[Mapping[str, Union[str, bytes]]] = None,
                 client: Optional[AsyncClient] = None, id: Optional[str] = None,
                 keep: bool = False, timeout: float = DEFAULT_TIMEOUT,
                 max_retries: int = DEFAULT_MAX_RETRIES,
                 max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT) -> None:
        if client is None:
            client = AsyncClient(url, token, timeout=timeout, max_retries=max_retries,
                                 max_retry_wait=max_retry_wait)
            self._own_client = True
        else:
            self._own_client = False
        self.client = client
        self.keep = keep
        self._body = session_body(policy, kernel_name, env, files)
        self.id: str = id or ""
        self.info_at_start: Optional[SessionInfo] = None

    async def start(self) -> "AsyncSession":
        """Creates the session (or checks the one named by ``id``); `async with` calls it."""
        if self.info_at_start is not None:
            return self
        if self.id:
            answer = await self.client.request("GET", self._path)
        else:
            answer = await self.client.request("POST", "/v1/sessions", json=self._body)
        self.info_at_start = SessionInfo.from_json(answer.json())
        self.id = self.info_at_start.id
        return self

    @property
    def _path(self) -> str:
        return f"/v1/sessions/{quote(self.id, safe='')}"

    @property
    def kernel_name(self) -> str:
        """The kernelspec this session runs; ``""`` until it started."""
        return self.info_at_start.kernel_name if self.info_at_start else ""

    @property
    def language(self) -> str:
        """The language of its kernel (see :attr:`cellgate.Session.language`); ``""`` until
        it started."""
        return self.info_at_start.language if self.info_at_start else ""

    async def info(self) -> SessionInfo:
        return SessionInfo.from_json((await self.client.request("GET", self._path)).json())

    async def run_code(self, code: str, *, timeout: Optional[float] = None,
                       on_stdout: Optional[Callable[[str], Any]] = None,
                       on_stderr: Optional[Callable[[str], Any]] = None,
                       on_artifact: Optional[Callable[[Artifact], Any]] = None,
                       on_input: Optional[Callable[[str, bool], Any]] = None,
                       on_event: Optional[Callable[[Dict[str, Any]], Any]] = None) -> Execution:
        """See :meth:`cellgate.Session.run_code`; callbacks may be coroutines."""
        body: Dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout_s"] = timeout
        pending: List[Any] = []
        # The collector calls plain functions; a coroutine a callback returns is awaited
        # right after, in order.
        collect = lambda f: (lambda *a: pending.append(f(*a))) if f else None  # noqa: E731
        collector = Collector(self.client, collect(on_stdout), collect(on_stderr),
                              collect(on_artifact), collect(on_event))
        response = await self.client._send("POST", self._path + "/execute", stream=True,
                                           json=body, headers=SSE_HEADERS,
                                           timeout=stream_timeout(self.client.timeout))
        where = Resumption()
        failures = 0
        while True:
            cause: Optional[Exception] = None
            events = self.client._events(response)
            try:
                async for event in events:
                    if not where.accept(event):
                        continue
                    failures = 0
                    request = collector.handle(event)
                    while pending:
                        await _maybe_await(pending.pop(0))
                    if request is not None:
                        await self._answer(request, on_input)
                    if collector.result is not None:
                        return collector.result
            except CellgateConnectionError as error:
                cause = error
            finally:
                # Closed here, not whenever the garbage collector gets to it.
                await events.aclose()
                await response.aclose()
            # The stream broke (or ended early): resume it where it was.
            while True:
                if not where.resumable or failures >= self.client.max_resumes:
                    raise where.give_up(self.client.url, failures) from cause
                failures += 1
                await asyncio.sleep(resume_wait(failures))
                try:
                    response = await self.client._send(
                        "GET", where.path(self._path), stream=True, headers=where.headers(),
                        timeout=stream_timeout(self.client.timeout))
                    break
                except CellgateConnectionError as error:
                    cause = error

    async def executions(self, limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """See :meth:`cellgate.Session.executions`."""
        params = {} if limit is None else {"limit": str(limit)}
        answer = await self.client.request("GET", self._path + "/executions", params=params)
        return list(answer.json())

    async def execution(self, execution_id: str) -> ExecutionRecord:
        """See :meth:`cellgate.Session.execution`."""
        answer = await self.client.request(
            "GET", f"{self._path}/executions/{quote(execution_id, safe='')}")
        return ExecutionRecord.from_json(answer.json(), self.client)

    async def run_command(self, cmd: str, *, cwd: Optional[str] = None,
                          env: Optional[Mapping[str, str]] = None,
                          timeout: Optional[float] = None,
                          on_stdout: Optional[Callable[[str], Any]] = None,
                          on_stderr: Optional[Callable[[str], Any]] = None) -> CommandResult:
        """See :meth:`cellgate.Session.run_command`; callbacks may be coroutines."""
        pending: List[Any] = []
        collect = lambda f: (lambda *a: pending.append(f(*a))) if f else None  # noqa: E731
        collector = CommandCollector(collect(on_stdout), collect(on_stderr))
        response = await self.client._send("POST", self._path + "/commands", stream=True,
                                           json=command_body(cmd, cwd, env, timeout),
                                           headers=SSE_HEADERS,
                                           timeout=stream_timeout(self.client.timeout))
        events = self.client._events(response)
        try:
            async for event in events:
                collector.handle(event)
                while pending:
                    await _maybe_await(pending.pop(0))
                if collector.result is not None:
                    return collector.result
        finally:
            # Closed here, not whenever the garbage collector gets to it.
            await events.aclose()
            await response.aclose()
        raise CellgateError("the event stream ended without the command's result (no "
                            "`done` event); the command may have run")

    async def _answer(self, request: InputRequest, on_input: Optional[Callable[[str, bool], Any]]) -> None:
        if on_input is None:
            await self.interrupt()
            return
        value = await _maybe_await(on_input(request.prompt, request.password))
        await self.send_input(value, request.execution_id)

    async def send_input(self, value: str, execution_id: Optional[str] = None) -> None:
        body: Dict[str, Any] = {"value": value}
        if execution_id:
            body["execution_id"] = execution_id
        await self.client.request("POST", self._path + "/input", json=body)

    async def interrupt(self) -> None:
        await self.client.request("POST", self._path + "/interrupt")

    async def restart(self) -> SessionInfo:
        answer = await self.client.request("POST", self._path + "/restart")
        return SessionInfo.from_json(answer.json())

    async def upload(self, path: str, content: Content) -> Dict[str, Any]:
        if isinstance(content, Path):
            content = content.read_bytes()
        elif isinstance(content, str):
            content = content.encode()
        elif not isinstance(content, bytes):
            content = content.read()
        answer = await self.client.request("PUT", file_url(self.id, path), content=content)
        return answer.json()

    async def download(self, path: str) -> bytes:
        return (await self.client.request("GET", file_url(self.id, path))).content

    async def files(self, dir: str = "", *, recursive: bool = False,
                    hidden: bool = False) -> List[FileEntry]:
        answer = await self.client.request("GET", self._path + "/files",
                                           params=list_params(dir, recursive, hidden))
        return [FileEntry.from_json(f) for f in answer.json()]

    async def exists(self, path: str) -> bool:
        """See :meth:`cellgate.Session.exists`."""
        try:
            await self.client.request("HEAD", file_url(self.id, path))
        except NotFoundError as error:
            if error.code == "no_such_file":
                return False
            raise
        return True

    async def stat(self, path: str) -> FileEntry:
        """See :meth:`cellgate.Session.stat`."""
        answer = await self.client.request("POST", file_url(self.id, path), json={"op": "stat"})
        return FileEntry.from_json(answer.json())

    async def make_dir(self, path: str) -> FileEntry:
        """See :meth:`cellgate.Session.make_dir`."""
        answer = await self.client.request("POST", file_url(self.id, path), json={"op": "mkdir"})
        return FileEntry.from_json(answer.json())

    async def move(self, src: str, dst: str, *, overwrite: bool = False) -> FileEntry:
        """See :meth:`cellgate.Session.move`."""
        answer = await self.client.request("POST", file_url(self.id, src),
                                           json=move_body(dst, overwrite))
        return FileEntry.from_json(answer.json())

    rename = move

    async def remove(self, path: str, *, recursive: bool = False) -> int:
        """See :meth:`cellgate.Session.remove`."""
        answer = await self.client.request("DELETE", file_url(self.id, path),
                                           params=remove_params(recursive))
        return int(answer.json().get("removed", 0))

    async def artifacts(self) -> List[Artifact]:
        answer = await self.client.request("GET", self._path + "/artifacts")
        return [Artifact.from_json(a, self.client) for a in answer.json()]

    async def export_notebook(self) -> Dict[str, Any]:
        return (await self.client.request("GET", self._path + "/notebook")).json()

    async def delete(self) -> None:
        await self.client.request("DELETE", self._path)

    async def aclose(self) -> None:
        try:
            if not self.keep and self.id:
                try:
                    await self.delete()
                except NotFoundError:
                    pass
        finally:
            if self._own_client:
                await self.client.aclose()

    async def __aenter__(self) -> "AsyncSession":
        try:
            return await self.start()
        except BaseException:
            if self._own_client:
                await self.client.aclose()
            raise

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
