"""The synchronous client: :class:`Client` (a gateway) and :class:`Session` (one sandboxed
kernel whose state lasts across calls)."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Union
from urllib.parse import quote, urlsplit

import httpx

from ._errors import CellgateError, NotFoundError, error_from
from ._events import ArtifactCallback, Collector, EventCallback, InputRequest, SseDecoder, StreamCallback
from ._models import Artifact, Execution, FileEntry, Link, SessionInfo

InputCallback = Callable[[str, bool], str]
Content = Union[bytes, str, Path, IO[bytes]]

#: Seconds to wait for an answer; an execution's event stream waits longer (the gateway
#: sends a keep-alive every 15 s, so a silent stream this long is a lost one).
DEFAULT_TIMEOUT = 60.0


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


class Client:
    """A cellgate gateway: ``Client("http://127.0.0.1:8888", token)``.

    ``token`` is the gateway's static token or a tenant's JWT. Use :meth:`session` for a
    kernel that keeps its state across calls, :meth:`run_code` for a one-shot execution.
    """

    def __init__(self, url: str, token: Optional[str] = None, *,
                 timeout: float = DEFAULT_TIMEOUT, http: Optional[httpx.Client] = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._own_http = http is None
        self._http = http or httpx.Client(base_url=self.url, timeout=timeout)
        self._headers = _auth_headers(token)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; raises :class:`~cellgate.APIError` for an error answer."""
        headers = {**self._headers, **kwargs.pop("headers", {})}
        response = self._http.request(method, self.url + path, headers=headers, **kwargs)
        if response.status_code >= 400:
            raise error_from(response)
        return response

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

    def run_code(self, code: str, *, timeout: Optional[float] = None,
                 policy: Optional[str] = None, **callbacks: Any) -> Execution:
        """Runs ``code`` once in a fresh session that is deleted afterwards."""
        with self.session(policy=policy) as session:
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

    ``Session(url, token, policy="data-science")`` creates it; as a context manager it is
    deleted on exit (``keep=True`` keeps it, for a later :meth:`Client.attach`).
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *,
                 policy: Optional[str] = None, kernel_name: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None,
                 files: Optional[Mapping[str, Union[str, bytes]]] = None,
                 client: Optional[Client] = None, id: Optional[str] = None,
                 keep: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
        if client is None:
            if url is None:
                raise TypeError("Session needs a url (or a client)")
            client = Client(url, token, timeout=timeout)
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
        """
        body: Dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout_s"] = timeout
        collector = Collector(self.client, on_stdout, on_stderr, on_artifact, on_event)
        headers = {**self.client._headers, "Accept": "text/event-stream"}
        stream_timeout = httpx.Timeout(self.client.timeout, read=max(self.client.timeout, 60.0))
        with self.client._http.stream("POST", self.client.url + self._path + "/execute",
                                      json=body, headers=headers,
                                      timeout=stream_timeout) as response:
            if response.status_code >= 400:
                response.read()
                raise error_from(response)
            decoder = SseDecoder()
            for line in response.iter_lines():
                event = decoder.feed(line)
                if event is None:
                    continue
                request = collector.handle(event)
                if request is not None:
                    self._answer(request, on_input)
                if collector.result is not None:
                    return collector.result
        raise CellgateError("the event stream ended before the execution's result")

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
        binary file object, streamed) to ``path`` in the workspace."""
        if isinstance(content, Path):
            with content.open("rb") as file:
                return self.client.request("PUT", file_url(self.id, path), content=file).json()
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
