"""Errors: every failed request raises an :class:`APIError` carrying the gateway's answer,
and a gateway that cannot be reached a :class:`CellgateConnectionError`."""

from __future__ import annotations

import datetime
import email.utils
import math
import time
from typing import Optional

import httpx

#: The header in which the gateway sends an error answer's machine code (on every error
#: answer, a ``HEAD``'s too, which has no body).
ERROR_CODE_HEADER = "x-cellgate-error-code"


class CellgateError(Exception):
    """Base of every error this package raises."""


class APIError(CellgateError):
    """The gateway answered an error: its HTTP ``status``, its stable machine ``code``
    (``no_such_session``, ``invalid_json``, ``rate_limited``…), its ``message``, and
    ``retry_after`` (seconds) when waiting helps."""

    def __init__(self, status: int, code: str, message: str, retry_after: Optional[float] = None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class CellgateConnectionError(CellgateError, ConnectionError):
    """No (complete) answer from the gateway at ``url``. Also a built-in
    :class:`ConnectionError`, so code that already catches those catches it; the httpx
    exception it stands for is its ``__cause__``.

    ``request_may_have_run`` tells the two cases apart. ``False``: the gateway could not be
    reached (refused, unresolvable, timed out while connecting, TLS): the request never left,
    nothing ran, and the message says "cannot reach". ``True``: the request was sent and the
    connection broke before or while the answer came (the gateway hung up, reset it, cut an
    event stream short): the code, command or upload may have run, so check before repeating
    something that is not idempotent."""

    def __init__(self, message: str, url: str = "", request_may_have_run: bool = False):
        super().__init__(message)
        self.url = url
        self.request_may_have_run = request_may_have_run


class StreamInterrupted(CellgateConnectionError):
    """An execution's event stream broke and could not be resumed: it broke before anything
    to resume it from (the execution's id and an event id; a gateway older than resumable
    delivery sends no ids), or every one of the client's ``max_resumes`` attempts failed. The code may have run, and may still be
    running: ``execution_id`` (``None`` when unknown) fetches its result later with
    ``Session.execution(execution_id)``; ``last_event_id`` is the last event received."""

    def __init__(self, message: str, url: str = "", execution_id: Optional[str] = None,
                 last_event_id: int = 0):
        super().__init__(message, url, request_may_have_run=True)
        self.execution_id = execution_id
        self.last_event_id = last_event_id


class BadRequestError(APIError):
    """400: the request itself is wrong (``invalid_json``, ``unknown_policy``,
    ``env_not_allowed``…): sending it again will not help."""


class AuthenticationError(APIError):
    """401: no token, or a wrong one."""


class NotFoundError(APIError):
    """404: no such session, artifact or file (or not the caller's)."""


class ConflictError(APIError):
    """409: the request does not fit the session's state."""


class RateLimitError(APIError):
    """429: over the tenant's request rate; ``retry_after`` (seconds) says when to try again.
    The clients wait and retry by themselves first (``max_retries``, ``max_retry_wait``)."""


class QuotaExceededError(RateLimitError):
    """429 ``quota_exceeded``: the tenant is over one of its quotas. ``quota`` names it
    (``cpu_seconds_per_day``, ``concurrent_sessions``), ``limit`` and ``used`` are in its
    unit (CPU seconds; sessions), ``resets`` says when it frees for a person, and
    ``resets_at`` (an aware UTC :class:`~datetime.datetime`) when it resets at a time: the
    next UTC midnight for ``cpu_seconds_per_day`` (``retry_after`` counts down to it);
    ``None`` for ``concurrent_sessions``, which frees when one of the tenant's sessions ends.
    A :class:`RateLimitError`, so code that handles those handles this; the clients retry it
    by themselves only when ``Retry-After`` is within ``max_retry_wait``."""

    def __init__(self, status: int, code: str, message: str, retry_after: Optional[float] = None,
                 quota: Optional[dict] = None):
        super().__init__(status, code, message, retry_after)
        quota = quota if isinstance(quota, dict) else {}
        self.quota: Optional[str] = _text(quota.get("name"))
        self.limit: Optional[float] = _number(quota.get("limit"))
        self.used: Optional[float] = _number(quota.get("used"))
        self.resets: Optional[str] = _text(quota.get("resets"))
        self.resets_at: Optional[datetime.datetime] = _instant(quota.get("resets_at"))


def _text(value: object) -> Optional[str]:
    return value if isinstance(value, str) else None


def _number(value: object) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _instant(value: object) -> Optional[datetime.datetime]:
    """An RFC 3339 instant as an aware datetime (``Z`` read as UTC; Python before 3.11 does
    not read it); ``None`` when absent or unreadable."""
    if not isinstance(value, str):
        return None
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


class UnavailableError(APIError):
    """503: the kernel is starting, restarting, busy or dead; ``retry_after`` (seconds) when
    the gateway says waiting helps (the clients have already retried then, up to
    ``max_retries``)."""


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 404: NotFoundError, 409: ConflictError,
              429: RateLimitError, 503: UnavailableError}


class ExecutionFailed(CellgateError):
    """Raised by :meth:`Execution.raise_for_status` for an execution that did not end ``ok``."""

    def __init__(self, execution):  # type: ignore[no-untyped-def]
        error = execution.error
        detail = f"{error.ename}: {error.evalue}" if error else execution.status
        super().__init__(f"execution {execution.status}: {detail}")
        self.execution = execution


class CommandFailed(CellgateError):
    """Raised by :meth:`CommandResult.raise_for_status` for a command that did not end ``ok``
    (a non-zero exit, a signal, a timeout…)."""

    def __init__(self, result):  # type: ignore[no-untyped-def]
        if result.exit_code is not None:
            detail = f"exit code {result.exit_code}"
        else:
            detail = result.error or (f"signal {result.signal}" if result.signal else result.status)
        super().__init__(f"command {result.status}: {detail}")
        self.result = result


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds, or an HTTP-date (how
    long until then, 0 once past); ``None`` when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        return max(0.0, when.timestamp() - time.time())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def error_from(response: httpx.Response) -> APIError:
    """The :class:`APIError` for a failed ``response`` (its body already read). Its code
    comes from the ``X-Cellgate-Error-Code`` header, else from the JSON body."""
    header = response.headers.get(ERROR_CODE_HEADER, "").strip()
    code, message = header or "error", response.reason_phrase
    try:
        body = response.json()
    except ValueError:
        body = None
        message = response.text or message
    if isinstance(body, dict):
        if not header:
            code = str(body.get("code") or code)
        message = str(body.get("message") or message)
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    if response.status_code == 429 and code == "quota_exceeded":
        quota = body.get("quota") if isinstance(body, dict) else None
        return QuotaExceededError(response.status_code, code, message, retry_after, quota)
    kind = _BY_STATUS.get(response.status_code, APIError)
    return kind(response.status_code, code, message, retry_after)
