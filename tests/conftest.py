from __future__ import annotations

import re

import pytest

from tests.helpers import LEASE_ARGS, Marketplace


# grpcio logs this when the server stops while it is still finishing a stream whose client
# has just gone: a CancelledError inside grpc's own cython scheduler, not in gpumarket code.
GRPC_SHUTDOWN_NOISE = re.compile(
    r"(Traceback \(most recent call last\):\n"
    r"  File \"src/python/grpcio/grpc/_cython/_cygrpc/aio/server\.pyx\.pxi\", line \d+, "
    r"in grpc\._cython\.cygrpc\._schedule_rpc_coro\n"
    r"asyncio\.exceptions\.CancelledError\n)+")


def own_tracebacks(log: str) -> bool:
    return "Traceback" in GRPC_SHUTDOWN_NOISE.sub("", log)


@pytest.fixture
def market(tmp_path):
    """A running broker and a client key; tests start the providers they need."""
    m = Marketplace(tmp_path)
    m.start_broker(*LEASE_ARGS)
    r = m.cli("keys", "init")
    assert r.returncode == 0, r.stderr
    yield m
    m.close()
    for name, proc in m.providers.items():
        text = proc.text()
        assert "Traceback" not in text, f"{name} logged a traceback:\n{text}"
    if m.broker is not None:
        assert not own_tracebacks(m.broker.text()), m.broker.text()
