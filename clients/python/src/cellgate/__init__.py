"""Client for cellgate's API v1: sandboxed Jupyter sessions for chat apps and agents.

    from cellgate import Session

    with Session("http://127.0.0.1:8888", token) as session:
        execution = session.run_code("1 + 1")
        print(execution.status, execution.result)   # ok 2

``Session()`` alone reads the gateway's address and token from ``CELLGATE_URL`` and
``CELLGATE_TOKEN``.
"""

from ._async import AsyncClient, AsyncSession
from ._client import Client, Session
from ._errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    CellgateConnectionError,
    CellgateError,
    CommandFailed,
    ConflictError,
    ExecutionFailed,
    NotFoundError,
    QuotaExceededError,
    RateLimitError,
    StreamInterrupted,
    UnavailableError,
)
from ._events import InputRequest
from ._models import (Artifact, CommandResult, Denial, ExecError, Execution, ExecutionRecord,
                      FileEntry, Kernelspec, Kernelspecs, Link, SessionInfo)

__all__ = [
    "APIError", "Artifact", "AsyncClient", "AsyncSession", "AuthenticationError",
    "BadRequestError", "CellgateConnectionError", "CellgateError", "Client", "CommandFailed",
    "CommandResult", "ConflictError", "Denial", "ExecError", "Execution", "ExecutionFailed",
    "ExecutionRecord", "FileEntry", "InputRequest", "Kernelspec", "Kernelspecs", "Link",
    "NotFoundError", "QuotaExceededError", "RateLimitError", "Session", "SessionInfo", "StreamInterrupted",
    "UnavailableError",
]
__version__ = "0.1.0"
