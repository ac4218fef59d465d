"""The one table from gpumarket errors to gRPC status codes, applied at the edge.

A GpumarketError becomes its status code and its message. Anything else is a bug:
it is logged with its traceback and answered INTERNAL with a generic message,
so no internals travel over the wire.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gpumarket.proto.errors import GpumarketError

log = logging.getLogger(__name__)

STATUS: dict[str, grpc.StatusCode] = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}


async def abort_for(exc: BaseException, context: grpc.aio.ServicerContext, rpc: str,
                    servicer: Any = None) -> None:
    if isinstance(exc, GpumarketError):
        reason = exc.reason
        log.info("%s rejected: %s (%s)", rpc, exc.message, reason)
        state = getattr(servicer, "state", None)
        if state is not None:
            state.metrics.rejected.labels(reason=reason).inc()
        await context.abort(STATUS.get(exc.code, grpc.StatusCode.INTERNAL), exc.message)
    log.error("%s failed unexpectedly", rpc, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error (see the broker's log)")


def unary(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Wrap a unary (or stream-in) handler with the error table."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_for(exc, context, handler.__name__, self)

    return wrapper


def streaming(handler: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Wrap a server-streaming handler with the error table."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
        try:
            async for item in handler(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_for(exc, context, handler.__name__, self)

    return wrapper
