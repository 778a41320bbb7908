"""Errors: every failed request raises an :class:`APIError` carrying the gateway's answer."""

from __future__ import annotations

from typing import Optional

import httpx


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


class AuthenticationError(APIError):
    """401: no token, or a wrong one."""


class NotFoundError(APIError):
    """404: no such session, artifact or file (or not the caller's)."""


class ConflictError(APIError):
    """409: the request does not fit the session's state."""


class RateLimitError(APIError):
    """429: over the tenant's request rate; ``retry_after`` says when to try again."""


class UnavailableError(APIError):
    """503: the kernel is starting, restarting, busy or dead."""


_BY_STATUS = {401: AuthenticationError, 404: NotFoundError, 409: ConflictError,
              429: RateLimitError, 503: UnavailableError}


class ExecutionFailed(CellgateError):
    """Raised by :meth:`Execution.raise_for_status` for an execution that did not end ``ok``."""

    def __init__(self, execution):  # type: ignore[no-untyped-def]
        error = execution.error
        detail = f"{error.ename}: {error.evalue}" if error else execution.status
        super().__init__(f"execution {execution.status}: {detail}")
        self.execution = execution


def error_from(response: httpx.Response) -> APIError:
    """The :class:`APIError` for a failed ``response`` (its body already read)."""
    code, message = "error", response.reason_phrase
    try:
        body = response.json()
    except ValueError:
        body = None
        message = response.text or message
    if isinstance(body, dict):
        code = str(body.get("code") or code)
        message = str(body.get("message") or message)
    retry = response.headers.get("retry-after")
    retry_after = float(retry) if retry and retry.isdigit() else None
    kind = _BY_STATUS.get(response.status_code, APIError)
    return kind(response.status_code, code, message, retry_after)
