"""What the gateway answers, as typed objects: sessions, executions, commands, artifacts,
files."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

@dataclass
class SessionInfo:
    """A session as the gateway describes it (``GET /v1/sessions/{id}``)."""

    id: str
    kernel_name: str
    policy: str
    sandbox: str
    state: str
    state_generation: int
    created: str
    last_activity: str
    executions: int
    tenant: Optional[str] = None
    reason: Optional[str] = None
    #: The kernel's language (``python``, ``typescript``, ``bash``, ``R``…); ``""`` from a
    #: gateway too old to say.
    language: str = ""

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "SessionInfo":
        return cls(
            id=data["id"],
            kernel_name=data.get("kernel_name", ""),
            policy=data.get("policy", ""),
            sandbox=data.get("sandbox", ""),
            state=data.get("state", ""),
            state_generation=int(data.get("state_generation", 0)),
            created=data.get("created", ""),
            last_activity=data.get("last_activity", ""),
            executions=int(data.get("executions", 0)),
            tenant=data.get("tenant"),
            reason=data.get("reason"),
            language=data.get("language", ""),
        )


@dataclass
class Kernelspec:
    """A kernel a session may run (``GET /v1/kernelspecs``): ``name`` is what
    ``kernel_name=`` takes."""

    name: str
    display_name: str
    language: str

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Kernelspec":
        return cls(name=data["name"], display_name=data.get("display_name", data["name"]),
                   language=data.get("language", ""))


@dataclass
class Kernelspecs:
    """The kernels a session may run, by name, and ``default``, the one a session gets when
    it names none."""

    default: str
    kernelspecs: List[Kernelspec]

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Kernelspecs":
        return cls(default=data["default"],
                   kernelspecs=[Kernelspec.from_json(k) for k in data.get("kernelspecs", [])])

    def names(self) -> List[str]:
        return [k.name for k in self.kernelspecs]

    def get(self, name: str) -> Optional[Kernelspec]:
        """The kernelspec ``name``, or ``None``."""
        return next((k for k in self.kernelspecs if k.name == name), None)


@dataclass
class Link:
    """A signed artifact link: an absolute URL that needs no credential, until ``expires``
    (RFC 3339) and until the artifact's session is deleted."""

    url: str
    expires: str


@dataclass
class Artifact:
    """A rich output (chart, table, HTML, JSON…) or a file the code wrote under
    ``outputs/``, stored once on the gateway. ``fetch()`` gets its bytes, ``save()`` writes
    them to a file."""

    id: str
    url: str
    mime: str
    bytes: int
    summary: str = ""
    width: Optional[int] = None
    height: Optional[int] = None
    display_id: Optional[str] = None
    version: int = 1
    previous: Optional[str] = None
    path: Optional[str] = None
    #: The same bytes with no credential, for a page's ``<img src>``: an absolute URL signed
    #: for this artifact, working until ``signed_url_expires`` and until the session is deleted
    #: (``None`` when the gateway signs no links). :meth:`link` makes a longer-lived one.
    signed_url: Optional[str] = None
    signed_url_expires: Optional[str] = None
    _client: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Dict[str, Any], client: Any = None) -> "Artifact":
        signed = data.get("signed_url")
        absolute = getattr(client, "absolute_url", None)
        if signed and absolute is not None:
            signed = absolute(signed)
        return cls(
            id=data["id"],
            url=data.get("url", f"/v1/artifacts/{data['id']}"),
            mime=data.get("mime", "application/octet-stream"),
            bytes=int(data.get("bytes", 0)),
            summary=data.get("summary", ""),
            width=data.get("width"),
            height=data.get("height"),
            display_id=data.get("display_id"),
            version=int(data.get("version", 1)),
            previous=data.get("previous"),
            path=data.get("path"),
            signed_url=signed,
            signed_url_expires=data.get("signed_url_expires"),
            _client=client,
        )

    def link(self, ttl: Optional[float] = None) -> "Link":
        """A signed link to the artifact that works for ``ttl`` seconds (the gateway's
        default when ``None``, at most its maximum), with a synchronous client."""
        make = getattr(self._client, "artifact_link", None)
        if make is None or inspect.iscoroutinefunction(make):
            raise TypeError("this artifact came from an AsyncClient: use `await artifact.alink()`")
        return make(self.id, ttl=ttl)

    async def alink(self, ttl: Optional[float] = None) -> "Link":
        """:meth:`link`, with an asynchronous client."""
        return await self._client.artifact_link(self.id, ttl=ttl)

    def fetch(self) -> bytes:
        """The artifact's bytes (with a synchronous client)."""
        fetch = getattr(self._client, "fetch_artifact", None)
        if fetch is None or inspect.iscoroutinefunction(fetch):
            raise TypeError("this artifact came from an AsyncClient: use `await artifact.afetch()`")
        return fetch(self.id)

    async def afetch(self) -> bytes:
        """The artifact's bytes (with an asynchronous client)."""
        return await self._client.fetch_artifact(self.id)

    def save(self, path: Union[str, Path]) -> Path:
        """Writes the artifact's bytes to ``path`` (a directory: under its own name)."""
        target = Path(path)
        if target.is_dir():
            target = target / self.filename
        target.write_bytes(self.fetch())
        return target

    @property
    def filename(self) -> str:
        """A file name for it: its own under ``outputs/``, else its id and an extension."""
        if self.path:
            return Path(self.path).name
        return self.id + _EXTENSIONS.get(self.mime, ".bin")


_EXTENSIONS = {
    "image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif", "image/webp": ".webp",
    "image/svg+xml": ".svg", "application/pdf": ".pdf", "text/html": ".html",
    "text/markdown": ".md", "text/latex": ".tex", "application/json": ".json",
    "application/geo+json": ".geojson",
}


@dataclass
class ExecError:
    """The exception a cell raised: ``ename``, ``evalue`` and the traceback's lines."""

    ename: str
    evalue: str
    traceback: List[str]

    def __str__(self) -> str:
        return "\n".join(self.traceback) or f"{self.ename}: {self.evalue}"


@dataclass
class Denial:
    """Something the session's policy refused: a connection (``egress``) or a package."""

    kind: str
    target: str
    policy: str
    reason: str


def _denial(data: Dict[str, Any]) -> Denial:
    return Denial(data.get("kind", ""), data.get("target", ""), data.get("policy", ""),
                  data.get("reason", ""))


@dataclass
class Execution:
    """The typed result of running code.

    ``status`` is ``ok``, ``error``, ``timeout``, ``oom``, ``denied``, ``output_truncated``
    or ``sandbox_lost``. ``state_generation`` changes whenever the kernel's variables were
    lost (restart, crash, out of memory): compare it with the previous execution's.
    """

    execution_id: str
    status: str
    execution_count: Optional[int]
    stdout: str
    stderr: str
    result: Optional[str]
    error: Optional[ExecError]
    artifacts: List[Artifact]
    denials: List[Denial]
    omitted: List[Dict[str, Any]]
    duration_ms: int
    state_generation: int
    resources: Dict[str, Any]
    output_truncated: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    #: True on the first result after the session was restored from hibernation (saved to
    #: disk while idle): its variables are intact and ``state_generation`` is unchanged.
    restored: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def raise_for_status(self) -> "Execution":
        """Raises :class:`ExecutionFailed` unless the execution ended ``ok``."""
        from ._errors import ExecutionFailed

        if not self.ok and self.status != "output_truncated":
            raise ExecutionFailed(self)
        return self

    @classmethod
    def from_json(cls, data: Dict[str, Any], client: Any = None) -> "Execution":
        error = data.get("error")
        return cls(
            execution_id=data.get("execution_id", ""),
            status=data.get("status", ""),
            execution_count=data.get("execution_count"),
            stdout=data.get("stdout", ""),
            stderr=data.get("stderr", ""),
            result=data.get("result"),
            error=ExecError(error.get("ename", ""), error.get("evalue", ""),
                            list(error.get("traceback", []))) if error else None,
            artifacts=[Artifact.from_json(a, client) for a in data.get("artifacts", [])],
            denials=[_denial(d) for d in data.get("denials", [])],
            omitted=list(data.get("omitted", [])),
            duration_ms=int(data.get("duration_ms", 0)),
            state_generation=int(data.get("state_generation", 0)),
            resources=dict(data.get("resources") or {}),
            output_truncated=bool(data.get("output_truncated", False)),
            stdout_truncated=bool(data.get("stdout_truncated", False)),
            stderr_truncated=bool(data.get("stderr_truncated", False)),
            restored=bool(data.get("restored", False)),
        )


@dataclass
class ExecutionRecord:
    """An execution as the gateway keeps it (``Session.execution(id)``): ``state`` is
    ``running`` or ``done``; ``events`` are every event so far (dicts, each with its ``id``
    in the session), the last one ``done`` once it is done; ``result`` is set once done."""

    execution_id: str
    state: str
    code: str
    started: str
    events: List[Dict[str, Any]]
    result: Optional[Execution]

    @property
    def done(self) -> bool:
        return self.state == "done"

    @classmethod
    def from_json(cls, data: Dict[str, Any], client: Any = None) -> "ExecutionRecord":
        result = data.get("result")
        return cls(
            execution_id=data.get("execution_id", ""),
            state=data.get("state", ""),
            code=data.get("code", ""),
            started=data.get("started", ""),
            events=list(data.get("events", [])),
            result=Execution.from_json(result, client) if result else None,
        )


@dataclass
class FileEntry:
    """A file or directory of the session's workspace: ``path`` relative to the workspace
    (``/``-separated), ``kind`` (``file``, ``dir``, ``symlink`` (never followed) or
    ``other``), ``size`` in bytes and ``mtime``, the last modification (RFC 3339, UTC)."""

    path: str
    kind: str
    size: int
    mtime: Optional[str]

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "FileEntry":
        return cls(data["path"], data.get("kind", "file"), int(data.get("size", 0)),
                   data.get("mtime"))


@dataclass
class CommandResult:
    """The typed result of a shell command (:meth:`Session.run_command`).

    ``status`` is ``ok`` (exit code 0), ``error`` (another exit code, a signal, or it could
    not start: ``error`` says why), ``timeout`` (its timeout killed it: ``signal`` is
    ``SIGKILL``), ``oom``, ``denied`` or ``sandbox_lost``. ``stdout`` and ``stderr`` are
    capped (the ``*_truncated`` flags say so); the callbacks saw everything.
    """

    command_id: str
    status: str
    exit_code: Optional[int]
    signal: Optional[str]
    stdout: str
    stderr: str
    error: Optional[str]
    denials: List[Denial]
    duration_ms: int
    state_generation: int
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def raise_for_status(self) -> "CommandResult":
        """Raises :class:`CommandFailed` unless the command ended ``ok``."""
        from ._errors import CommandFailed

        if not self.ok:
            raise CommandFailed(self)
        return self

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "CommandResult":
        return cls(
            command_id=data.get("command_id", ""),
            status=data.get("status", ""),
            exit_code=data.get("exit_code"),
            signal=data.get("signal"),
            stdout=data.get("stdout", ""),
            stderr=data.get("stderr", ""),
            error=data.get("error"),
            denials=[_denial(d) for d in data.get("denials", [])],
            duration_ms=int(data.get("duration_ms", 0)),
            state_generation=int(data.get("state_generation", 0)),
            stdout_truncated=bool(data.get("stdout_truncated", False)),
            stderr_truncated=bool(data.get("stderr_truncated", False)),
            output_truncated=bool(data.get("output_truncated", False)),
        )
