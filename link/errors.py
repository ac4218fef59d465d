"""grpc's errors as the project's own: one mapping for every client of the broker."""

from __future__ import annotations

import grpc

from gpumarket.proto.errors import GpumarketError, Unavailable, from_code


def error_of(exc: grpc.aio.AioRpcError, where: str) -> GpumarketError:
    """The GpumarketError for a failed call to the broker at (or about) ``where``: the
    status code's own error, with the broker's words; UNAVAILABLE and DEADLINE_EXCEEDED
    say which broker did not answer."""
    code = exc.code()
    details = (exc.details() or "").splitlines()
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"cannot reach the broker at {where}"
                           f" ({details[0] if details else 'no answer'})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return from_code("DEADLINE_EXCEEDED", f"the broker at {where} did not answer in time")
    return from_code(code.name, "\n".join(details) or code.name)
