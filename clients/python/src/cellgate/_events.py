"""What the sync and async clients share: reading Server-Sent Events, and turning an
execution's (or a command's) events into callbacks and, at its ``done`` event, an
:class:`Execution` (a :class:`CommandResult`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional

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
