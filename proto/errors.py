"""One error hierarchy for every role.

Each error carries a ``code`` (a gRPC status name); the broker maps codes to
``grpc.StatusCode`` at its edge and the typed clients map status codes back.
Messages are written for users: one line that says what was wrong and where.
"""

from __future__ import annotations


class GpumarketError(Exception):
    """Base of every error gpumarket raises on purpose."""

    code = "INTERNAL"
    reason = ""     # the audit reason a refusal is counted under; default: the code

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.reason or self.code.lower()

    def __str__(self) -> str:
        return self.message


class InvalidArgument(GpumarketError):
    code = "INVALID_ARGUMENT"


class JobFileError(InvalidArgument):
    """A job file that cannot be turned into a JobSpec."""


class BadSignature(GpumarketError):
    """A signed payload whose signature, type or signer does not check out."""

    code = "UNAUTHENTICATED"


class Expired(GpumarketError):
    code = "FAILED_PRECONDITION"


class Replay(GpumarketError):
    """A nonce that has been used before."""

    code = "ALREADY_EXISTS"


class NotFound(GpumarketError):
    code = "NOT_FOUND"


class PermissionDenied(GpumarketError):
    code = "PERMISSION_DENIED"
    reason = "unauthorized"


class FailedPrecondition(GpumarketError):
    code = "FAILED_PRECONDITION"


class InsufficientFunds(FailedPrecondition):
    """A hold or a top-up the client's available balance cannot cover."""

    reason = "funds"


class ResourceExhausted(GpumarketError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(GpumarketError):
    """The other side cannot be reached."""

    code = "UNAVAILABLE"


class DeadlineExceeded(GpumarketError):
    code = "DEADLINE_EXCEEDED"


class Internal(GpumarketError):
    code = "INTERNAL"


BY_CODE: dict[str, type[GpumarketError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "UNAUTHENTICATED": BadSignature,
    "ALREADY_EXISTS": Replay,
    "NOT_FOUND": NotFound,
    "PERMISSION_DENIED": PermissionDenied,
    "FAILED_PRECONDITION": FailedPrecondition,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "INTERNAL": Internal,
}


def from_code(code: str, message: str) -> GpumarketError:
    """Return the error for a status code name (unknown codes become Internal)."""
    return BY_CODE.get(code, Internal)(message)
