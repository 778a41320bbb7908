"""Client for cellgate's API v1: sandboxed Jupyter sessions for chat apps and agents.

    from cellgate import Session

    with Session("http://127.0.0.1:8888", token) as session:
        execution = session.run_code("1 + 1")
        print(execution.status, execution.result)   # ok 2
"""

from ._async import AsyncClient, AsyncSession
from ._client import Client, Session
from ._errors import (
    APIError,
    AuthenticationError,
    CellgateError,
    ConflictError,
    ExecutionFailed,
    NotFoundError,
    RateLimitError,
    UnavailableError,
)
from ._events import InputRequest
from ._models import Artifact, Denial, ExecError, Execution, FileEntry, Link, SessionInfo

__all__ = [
    "APIError", "Artifact", "AsyncClient", "AsyncSession", "AuthenticationError",
    "CellgateError", "Client", "ConflictError", "Denial", "ExecError", "Execution",
    "ExecutionFailed", "FileEntry", "InputRequest", "Link", "NotFoundError", "RateLimitError",
    "Session", "SessionInfo", "UnavailableError",
]
__version__ = "0.1.0"
