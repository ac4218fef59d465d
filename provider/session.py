"""The provider's side of the broker session protocol (broker/gateway.py is the other):
connect over the pinned TLS channel, open the gateway session (hello, challenge, proof,
welcome), send the offer and what is still unsettled, heartbeat the leases it runs, and
hand leases, cancels and settlements to the daemon. The session is reopened with backoff
whenever it breaks; jobs keep running meanwhile."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from gpumarket.link.artifacts import ArtifactsClient
from gpumarket.link.channel import open_channel
from gpumarket.link.gateway import GatewaySession
from gpumarket.proto.errors import GpumarketError, Unavailable
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.tls import Untrusted
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider.config import ProviderConfig

log = logging.getLogger(__name__)


class Peer(Protocol):
    """What the session asks of the daemon."""

    draining: bool

    def offer(self) -> pb.Envelope: ...
    def running(self) -> list[tuple[str, int]]: ...              # (job id, epoch)
    def pending(self) -> list[gw.ProviderMessage]: ...           # to re-send on reconnect
    async def on_lease(self, envelope: pb.Envelope) -> None: ...
    async def on_cancel(self, cancel: gw.CancelLease) -> None: ...
    async def on_settled(self, settled: gw.UpdateSettled) -> None: ...
    def on_infer(self, request: gw.InferenceRequest) -> None: ...
    def on_infer_cancel(self, cancel: gw.InferenceCancel) -> None: ...


class BrokerSession:
    def __init__(self, config: ProviderConfig, identity: Identity, peer: Peer) -> None:
        self.config = config
        self.identity = identity
        self.peer = peer
        self.channel: grpc.aio.Channel | None = None
        self.artifacts: ArtifactsClient | None = None
        self.broker_key: bytes | None = None       # the key of the broker it last talked to
        self.outbox: asyncio.Queue | None = None   # None while no session is open

    def send(self, message: gw.ProviderMessage) -> None:
        """Queue a message for the broker (dropped while no session is open: whatever must
        arrive is re-sent by ``peer.pending()`` on reconnect)."""
        if self.outbox is not None:
            self.outbox.put_nowait(message)

    def heartbeat(self) -> gw.ProviderMessage:
        return gw.ProviderMessage(heartbeat=gw.Heartbeat(
            at_ms=now_ms(), draining=self.peer.draining,
            running=[gw.RunningLease(job_id=j, epoch=e) for j, e in self.peer.running()]))

    async def run(self, stopping: asyncio.Event) -> None:
        """Keep a session open until ``stopping`` is set; raise Untrusted if the broker is
        not the one this provider trusts."""
        backoff = 0.5
        try:
            while not stopping.is_set():
                began = time.monotonic()
                try:
                    if self.channel is None:
                        await self._connect()
                    await self._serve(stopping)
                except Untrusted:
                    raise   # not the broker this provider trusts: stop, loudly
                except GpumarketError as exc:
                    log.warning("broker %s: %s", self.config.broker, exc)
                finally:
                    self.outbox = None
                if stopping.is_set():
                    break
                if time.monotonic() - began > 30:
                    backoff = 0.5
                delay = backoff * (1 + 0.2 * random.random())
                log.info("reconnecting in %.1fs", delay)
                try:
                    await asyncio.wait_for(stopping.wait(), delay)
                except TimeoutError:
                    pass
                backoff = min(backoff * 2, self.config.backoff_max_s)
        finally:
            if self.channel is not None:
                await self.channel.close()

    async def _connect(self) -> None:
        """Open the channel: TLS to the broker key this provider trusts (pinned by
        ``broker_key``, else remembered on first use in DATA_DIR/known_brokers)."""
        opened = await open_channel(self.config.broker, self.identity, self.config.trust(),
                                    min(self.config.rpc_timeout_s, 10.0))
        self.channel = opened.channel
        self.artifacts = ArtifactsClient(self.channel, self.config.broker,
                                         self.config.rpc_timeout_s)

    async def _serve(self, stopping: asyncio.Event) -> None:
        session = await GatewaySession.open(self.channel, self.identity, self.config.broker)
        try:
            if self.broker_key and session.broker_public_key != self.broker_key:
                log.warning("the broker's key changed since the last session")
            self.broker_key = session.broker_public_key
            log.info("connected to broker %s as provider %s", self.config.broker,
                     session.welcome.provider_id)
            outbox: asyncio.Queue = asyncio.Queue()
            outbox.put_nowait(gw.ProviderMessage(offer=self.peer.offer()))
            for message in self.peer.pending():
                outbox.put_nowait(message)
            self.outbox = outbox
            interval = max(session.welcome.heartbeat_interval_ms, 200) / 1000
            tasks = [asyncio.create_task(self._write(session, outbox)),
                     asyncio.create_task(self._beat(outbox, interval)),
                     asyncio.create_task(self._read(session)),
                     asyncio.create_task(stopping.wait())]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if not t.cancelled() and t.exception() is not None:
                        raise t.exception()
            finally:
                for t in tasks:
                    t.cancel()
        finally:
            session.close()

    async def _write(self, session: GatewaySession, outbox: asyncio.Queue) -> None:
        while True:
            await session.send(await outbox.get())

    async def _beat(self, outbox: asyncio.Queue, interval: float) -> None:
        while True:
            outbox.put_nowait(self.heartbeat())
            await asyncio.sleep(interval)

    async def _read(self, session: GatewaySession) -> None:
        while True:
            message = await session.receive()
            if message is None:
                raise Unavailable("broker ended the session")
            which = message.WhichOneof("msg")
            if which == "lease":
                await self.peer.on_lease(message.lease)
            elif which == "cancel":
                await self.peer.on_cancel(message.cancel)
            elif which == "settled":
                await self.peer.on_settled(message.settled)
            elif which == "infer":
                self.peer.on_infer(message.infer)
            elif which == "infer_cancel":
                self.peer.on_infer_cancel(message.infer_cancel)

    async def with_broker(self, call: Callable[[ArtifactsClient], Awaitable], stopping,
                          attempts: int = 10):
        """Run an artifact call, waiting out broker outages of up to a minute or so (and
        the first connection)."""
        while self.artifacts is None and not stopping.is_set():
            await asyncio.sleep(0.2)
        for i in range(attempts):
            try:
                return await call(self.artifacts)
            except Unavailable:
                if i == attempts - 1 or stopping.is_set():
                    raise
                await asyncio.sleep(min(0.5 * 2 ** i, 8))
