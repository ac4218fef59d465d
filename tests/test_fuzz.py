"""Hypothesis-driven fuzzing of the broker's message handling, over the wire, bounded in
time: random request bytes to every method (with no token, a garbage token, or a valid
token for exactly those bytes), and random provider messages inside a real session. The
broker must answer each with a status, never INTERNAL or UNKNOWN, never log a traceback,
and stay healthy. (The conftest fixture fails the test on any traceback in the log.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumarket.link.channel import call_token
from gpumarket.proto.wire import TOKEN_METADATA
from gpumarket.proto.envelope import seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from tests.helpers import open_session

pytestmark = pytest.mark.e2e

UNARY = [
    "/gpumarket.v1.Marketplace/SubmitJob", "/gpumarket.v1.Marketplace/GetJob",
    "/gpumarket.v1.Marketplace/ListJobs", "/gpumarket.v1.Marketplace/CancelJob",
    "/gpumarket.v1.Marketplace/SearchOffers", "/gpumarket.v1.Marketplace/Quote",
    "/gpumarket.v1.Marketplace/GetProvider", "/gpumarket.v1.Artifacts/StatArtifact",
    "/gpumarket.v1.Admin/Ban", "/gpumarket.v1.Admin/Revoke", "/gpumarket.v1.Admin/ListAllJobs",
]
SERVER_STREAMING = [
    "/gpumarket.v1.Marketplace/WatchJob", "/gpumarket.v1.Marketplace/StreamLogs",
    "/gpumarket.v1.Artifacts/Download", "/gpumarket.v1.Admin/Backup",
]
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(max_examples=400, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


class Loop:
    """One event loop for all examples (a channel is bound to the loop that opened it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.close()


@pytest.fixture
def wire(market):
    loop = Loop()
    me = market.identity()
    channel = loop.run(market.channel(False))
    yield loop, channel, me
    loop.run(channel.close())
    loop.close()


def _healthy(loop: Loop, channel) -> bool:
    async def check():
        return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=10)

    return loop.run(check()).status == health_pb2.HealthCheckResponse.SERVING


def test_random_requests_get_a_status_never_a_crash(market, wire):
    loop, channel, me = wire
    seen: set[grpc.StatusCode] = set()

    @FUZZ
    @given(method=st.sampled_from(UNARY + SERVER_STREAMING), body=st.binary(max_size=2048),
           token=st.sampled_from(["none", "garbage", "valid"]), garbage=st.binary(max_size=200))
    def one(method, body, token, garbage):
        metadata = ()
        if token == "valid":
            metadata = ((TOKEN_METADATA, call_token(me, method, market.broker_id, body)),)
        elif token == "garbage":
            metadata = ((TOKEN_METADATA, garbage),)

        async def send():
            try:
                if method in UNARY:
                    await channel.unary_unary(method)(body, metadata=metadata, timeout=15)
                else:
                    async for _ in channel.unary_stream(method)(body, metadata=metadata,
                                                                timeout=3):
                        pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        code = loop.run(send())
        seen.add(code)
        # a server stream may end by its deadline (a valid WatchJob of a live job, say)
        assert code not in BAD, (method, body, token, code)

    one()
    assert _healthy(loop, channel)
    assert grpc.StatusCode.UNAUTHENTICATED in seen and len(seen) >= 3, seen
    assert market.broker.alive()


def _update(job_id: str, epoch: int, which: str, blob: bytes) -> gw.JobUpdate:
    update = gw.JobUpdate(job_id=job_id, epoch=epoch)
    if which == "receipt":
        update.receipt.CopyFrom(seal(Identity.generate(), pb.Receipt(job_id=job_id)))
        update.receipt.payload += blob      # tampered, unless blob is empty
    elif which == "log":
        update.log.lines.extend([blob.decode("latin-1")] * 3)
    elif which == "progress":
        update.progress.step, update.progress.total = len(blob), len(blob) // 2
    elif which == "checkpoint":
        update.checkpoint.step = len(blob)
        update.checkpoint.artifact.sha256 = blob.hex()[:64]
        update.checkpoint.artifact.name = blob.decode("latin-1")[:40]
    else:
        getattr(update, which).SetInParent()
    return update


def test_random_provider_messages_in_a_session_never_crash_it(market, wire):
    loop, channel, _ = wire
    provider = Identity.generate()
    session_channel = loop.run(market.channel(provider))
    stream = loop.run(open_session(session_channel, provider))
    kinds = ["started", "progress", "failed", "receipt", "rejected", "checkpoint", "released",
             "log"]

    @FUZZ
    @given(choice=st.sampled_from(["raw", "update", "offer", "heartbeat"]),
           raw=st.binary(max_size=512), job_id=st.sampled_from(["", "j", "x" * 300, "../j"]),
           epoch=st.integers(0, 2**64 - 1), which=st.sampled_from(kinds),
           blob=st.binary(max_size=300))
    def one(choice, raw, job_id, epoch, which, blob):
        if choice == "raw":
            try:
                message = gw.ProviderMessage.FromString(raw)
            except Exception:
                return
        elif choice == "update":
            message = gw.ProviderMessage(job_update=_update(job_id, epoch, which, blob))
        elif choice == "offer":
            message = gw.ProviderMessage(offer=pb.Envelope(payload_type="gpumarket.v1.Offer",
                                                           payload=raw,
                                                           signer_public_key=blob[:32]))
        else:
            message = gw.ProviderMessage(heartbeat=gw.Heartbeat(at_ms=epoch % 2**62, running=[
                gw.RunningLease(job_id=job_id, epoch=epoch)], draining=bool(raw[:1])))
        loop.run(stream.write(message))

    one()
    # The session is still served: a heartbeat goes up, and the broker stays healthy.
    loop.run(stream.write(gw.ProviderMessage(heartbeat=gw.Heartbeat(at_ms=now_ms()))))
    assert _healthy(loop, channel)
    stream.cancel()
    loop.run(session_channel.close())
    log = market.broker.text()
    assert "failed unexpectedly" not in log and "session failed" not in log
    assert market.broker.alive()

