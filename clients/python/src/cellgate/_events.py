"""What the sync and async clients share: reading Server-Sent Events, and turning an
execution's (or a command's) events into callbacks and, at its ``done`` event, an
:class:`Execution` (a :class:`CommandResult`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional
from urllib.parse import quote

from ._errors import StreamInterrupted
from ._models import Artifact, CommandResult, Execution

StreamCallback = Callable[[str], Any]
ArtifactCallback = Callable[[Artifact], Any]
EventCallback = Callable[[Dict[str, Any]], Any]


class SseDecoder:
    """Server-Sent Events, line by line (the WHATWG format: ``data:`` lines joined, an
    empty line ends an event, ``:`` lines are comments such as keep-alives)."""

    def __init__(self) -> None:
        self._data: List[str] = []

    def feed(self, line: str) -> Optional[Dict[str, Any]]:
        """One line (without its end); an event's JSON when the line ends one."""
        if line == "":
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return json.loads(data)
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None


def decode_all(lines: Iterable[str]) -> Iterable[Dict[str, Any]]:
    decoder = SseDecoder()
    for line in lines:
        event = decoder.feed(line)
        if event is not None:
            yield event


class Resumption:
    """Where an execution's event stream is, to resume it after a dropped connection: the
    execution's id (from its ``started`` event) and the id of the last event received.
    Events come with their id in the session; one at or below the last is a repeat and is
    dropped, so each reaches the callbacks once."""

    def __init__(self) -> None:
        self.execution_id: Optional[str] = None
        self.last_event_id = 0

    def accept(self, event: Dict[str, Any]) -> bool:
        """Whether ``event`` is new (and to be handled); remembers where the stream is."""
        event_id = event.get("id")
        if isinstance(event_id, int):
            if event_id <= self.last_event_id:
                return False
            self.last_event_id = event_id
        if self.execution_id is None and event.get("execution_id"):
            self.execution_id = str(event["execution_id"])
        return True

    @property
    def resumable(self) -> bool:
        """Whether the stream can be resumed: its execution is known and its events carry
        ids (a gateway older than resumable delivery sends none)."""
        return self.execution_id is not None and self.last_event_id > 0

    def path(self, session_path: str) -> str:
        """The execution's URL below ``session_path``."""
        return f"{session_path}/executions/{quote(self.execution_id or '', safe='')}"

    def headers(self) -> Dict[str, str]:
        return {"Accept": "text/event-stream", "Last-Event-ID": str(self.last_event_id)}

    def give_up(self, url: str, attempts: int) -> "StreamInterrupted":
        """The error once the stream cannot be resumed (after ``attempts`` tries)."""
        if not self.resumable:
            return StreamInterrupted(
                "the event stream ended without the execution's result (no `done` event), "
                "before anything to resume it from (the execution's id and an event id); the "
                "code may have run", url)
        return StreamInterrupted(
            f"the event stream of execution {self.execution_id} broke without the execution's "
            f"result (no `done` event) and {attempts} attempts to resume it after event "
            f"{self.last_event_id} failed; the code may have run or still be running: "
            f"Session.execution({self.execution_id!r}) fetches its result", url,
            execution_id=self.execution_id, last_event_id=self.last_event_id)


def resume_wait(attempt: int) -> float:
    """Seconds before resume attempt ``attempt`` (1, 2, …): a dropped connection is often
    over at once, a restarting proxy takes longer."""
    return min(0.25 * 2 ** (attempt - 1), 4.0)


@dataclass
class InputRequest:
    """The cell called ``input()``: answer it with :meth:`Session.send_input`."""

    execution_id: str
    prompt: str
    password: bool


class Collector:
    """Turns one execution's events into callbacks; ``result`` is set at ``done``."""

    def __init__(self, client: Any, on_stdout: Optional[StreamCallback],
                 on_stderr: Optional[StreamCallback], on_artifact: Optional[ArtifactCallback],
                 on_event: Optional[EventCallback]) -> None:
        self.client = client
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.on_artifact = on_artifact
        self.on_event = on_event
        self.result: Optional[Execution] = None

    def handle(self, event: Dict[str, Any]) -> Optional[InputRequest]:
        """Calls the callbacks for ``event``; an :class:`InputRequest` when the cell waits
        for input (the caller answers it)."""
        if self.on_event is not None:
            self.on_event(event)
        kind = event.get("type")
        if kind == "stream":
            callback = self.on_stdout if event.get("name") == "stdout" else self.on_stderr
            if callback is not None:
                callback(event.get("text", ""))
        elif kind in ("display", "update_display", "result") and self.on_artifact is not None:
            for artifact in event.get("artifacts", []):
                self.on_artifact(Artifact.from_json(artifact, self.client))
        elif kind == "input_request":
            return InputRequest(event.get("execution_id", ""), event.get("prompt", ""),
                                bool(event.get("password", False)))
        elif kind == "done":
            self.result = Execution.from_json(event.get("result", {}), self.client)
        return None


class CommandCollector:
    """Turns one command's events (``started``, ``stream``, ``done``) into callbacks;
    ``result`` is set at ``done``."""

    def __init__(self, on_stdout: Optional[StreamCallback],
                 on_stderr: Optional[StreamCallback]) -> None:
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.result: Optional[CommandResult] = None

    def handle(self, event: Dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "stream":
            callback = self.on_stdout if event.get("name") == "stdout" else self.on_stderr
            if callback is not None:
                callback(event.get("text", ""))
        elif kind == "done":
            self.result = CommandResult.from_json(event.get("result", {}))
