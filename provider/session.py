"""The provider's side of the broker session protocol (broker/api/gateway.py is the other):
connect over the pinned TLS channel, open the gateway session (hello, challenge, proof,
welcome), send the offer and what is still unsettled, heartbeat the leases it runs, and
hand leases, cancels and settlements to the daemon. The session is reopened with backoff
whenever it breaks; jobs keep running meanwhile. While the broker is unreachable it is probed
(a TCP connect, every 0.5 s doubling to ``probe_max_s``), and once it answers again the
session is reopened at once, on a new channel (docs/provider.md, Reconnecting). Given the
addresses of several brokers of one market (``broker = "a:7070,b:7070"``), it moves to the
next one whenever a session breaks or cannot be opened, on the same backoff."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from gpumarket.link.artifacts import ArtifactsClient
from gpumarket.link.channel import open_channel, split_brokers
from gpumarket.link.gateway import GatewaySession
from gpumarket.proto.errors import GpumarketError, Unavailable
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.tls import Untrusted
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.proto.wire import split_address
from gpumarket.provider.config import ProviderConfig

log = logging.getLogger(__name__)

JITTER = 0.2            # each wait is stretched by up to 20 %, so providers spread out
BACKOFF_FIRST_S = 0.5   # the first wait after a failed session try, doubling from there
PROBE_FIRST_S = 0.5     # the first wait between probes of an unreachable broker, doubling
CHANNEL_CLOSE_GRACE_S = 2.0  # calls still on a replaced channel get this long to end
LASTED_S = 30.0         # a session that lasted this long resets the backoff
LEASES_REMEMBERED = 4096  # leases received, remembered to drop one a broker sends again


def reconnect_within_ms(config: ProviderConfig) -> int:
    """What the hello tells the broker: the longest this provider takes to try again once
    the broker listens (its longest backoff, jitter included; the probe is usually far
    quicker, but a provider whose probes cannot reach the broker, behind a proxy say, still
    tries on its backoff)."""
    return int(config.backoff_max_s * (1 + JITTER) * 1000)


class Backoff:
    """The wait before the next session try: ``first_s``, doubling after every try up to
    ``max_s``, each stretched by up to JITTER at random."""

    def __init__(self, first_s: float, max_s: float,
                 rng: Callable[[], float] = random.random) -> None:
        self.first_s, self.max_s, self.rng = first_s, max_s, rng
        self.current = first_s

    def next(self) -> float:
        """The wait before this try; the next one waits twice as long (up to max_s)."""
        delay = self.current * (1 + JITTER * self.rng())
        self.current = min(self.current * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.current = self.first_s


async def reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether something at host:port accepts a TCP connection within ``timeout_s``; the
    connection is closed at once, before a byte is sent."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


async def _waited(stopping: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds``; True if ``stopping`` was set meanwhile."""
    try:
        await asyncio.wait_for(stopping.wait(), max(seconds, 0))
        return True
    except TimeoutError:
        return stopping.is_set()


async def wait_to_retry(delay: float, probe: Callable[[], Awaitable[bool]],
                        stopping: asyncio.Event, probe_max_s: float,
                        rng: Callable[[], float] = random.random,
                        probe_first_s: float = PROBE_FIRST_S) -> bool:
    """Wait ``delay`` seconds before the next session try, probing the broker meanwhile.
    Return True as soon as a probe answers after one failed (the broker is back: try now
    and reset the backoff); False when the delay ran out or ``stopping`` was set.

    An unreachable broker is probed every ``probe_first_s``, doubling to ``probe_max_s``
    (jitter included). A broker that answers the first probe is up but ended or refused
    the session: it is not probed again, and the whole delay is waited."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + delay
    interval = probe_first_s
    down = False
    while not stopping.is_set():
        started = loop.time()
        if await probe():
            if down:
                return True
            await _waited(stopping, deadline - loop.time())
            return False
        down = True
        wait = min(started + interval * (1 + JITTER * rng()), deadline) - loop.time()
        if loop.time() >= deadline or await _waited(stopping, wait):
            return False
        interval = min(interval * 2, probe_max_s)
    return False


class Peer(Protocol):
    """What the session asks of the daemon."""

    draining: bool

    def offer(self) -> pb.Envelope: ...
    def running(self) -> list[tuple[str, int]]: ...              # (job id, epoch)
    def pending(self) -> list[gw.ProviderMessage]: ...           # to re-send on reconnect
    async def on_lease(self, envelope: pb.Envelope) -> None: ...
    async def on_cancel(self, cancel: gw.CancelLease) -> None: ...
    def on_yield(self, request: gw.YieldLease) -> None: ...
    def on_preempt(self, request: gw.PreemptLease) -> None: ...
    async def on_settled(self, settled: gw.UpdateSettled) -> None: ...
    def on_tasks_settled(self, settled: gw.TaskResultsSettled) -> None: ...
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
        self.update_receipts = False               # ... and whether it takes one receipt for
                                                   # a task results update (else one a task)
        self.outbox: asyncio.Queue | None = None   # None while no session is open
        self.connected = asyncio.Event()           # set while a session is open
        self.sessions_opened = 0                   # counts them: did a call outlive its session?
        self._closing: set[asyncio.Task] = set()   # replaced channels being closed
        self.addresses = split_brokers(config.broker)
        self.at = 0                                # which of them this session tries
        self._leases: dict[tuple[str, int], None] = {}   # received, oldest first

    @property
    def address(self) -> str:
        """The broker address the session is on (or tries next)."""
        return self.addresses[self.at]

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
        backoff = Backoff(BACKOFF_FIRST_S, self.config.backoff_max_s)

        def probe() -> Awaitable[bool]:
            host, port, _ = split_address(self.address)
            return reachable(host, port, self.config.probe_max_s)

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
                    log.warning("broker %s: %s", self.address, exc)
                finally:
                    self.outbox = None
                    self.connected.clear()
                if stopping.is_set():
                    break
                self._drop_channel(moving=len(self.addresses) > 1)
                if len(self.addresses) > 1:
                    self.at = (self.at + 1) % len(self.addresses)
                    log.info("trying the next broker, %s", self.address)
                if time.monotonic() - began > LASTED_S:
                    backoff.reset()
                delay = backoff.next()
                log.info("reconnecting in %.1fs (at once if the broker is seen back)", delay)
                if await wait_to_retry(delay, probe, stopping, self.config.probe_max_s):
                    log.info("broker %s answers again; reconnecting", self.address)
                    backoff.reset()
        finally:
            if self.channel is not None:
                await self.channel.close()
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _drop_channel(self, moving: bool = False) -> None:
        """After a session ended: keep the channel only if it is still connected (and the
        next try is on the same broker, not ``moving`` to another). One that lost its
        connection would fail the next try with its last error until gRPC's own reconnect
        backoff runs out, however long the broker has been back; a new channel connects at
        once. Calls still on the old one get CHANNEL_CLOSE_GRACE_S to end."""
        channel = self.channel
        if channel is None or (not moving
                               and channel.get_state() == grpc.ChannelConnectivity.READY):
            return
        self.channel, self.artifacts = None, None
        closing = asyncio.create_task(channel.close(CHANNEL_CLOSE_GRACE_S))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def _connect(self) -> None:
        """Open the channel: TLS to the broker key this provider trusts (pinned by
        ``broker_key``, else remembered on first use in DATA_DIR/known_brokers)."""
        opened = await open_channel(self.address, self.identity, self.config.trust(),
                                    min(self.config.rpc_timeout_s, 10.0))
        self.channel = opened.channel
        self.artifacts = ArtifactsClient(self.channel, self.address, self.config.rpc_timeout_s)

    async def _serve(self, stopping: asyncio.Event) -> None:
        session = await GatewaySession.open(self.channel, self.identity, self.address,
                                            reconnect_within_ms(self.config))
        try:
            if self.broker_key and session.broker_public_key != self.broker_key:
                log.warning("the broker's key changed since the last session")
            self.broker_key = session.broker_public_key
            self.update_receipts = session.welcome.update_receipts
            log.info("connected to broker %s as provider %s", self.address,
                     session.welcome.provider_id)
            outbox: asyncio.Queue = asyncio.Queue()
            outbox.put_nowait(gw.ProviderMessage(offer=self.peer.offer()))
            for message in self.peer.pending():
                outbox.put_nowait(message)
            self.outbox = outbox
            self.sessions_opened += 1
            self.connected.set()
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
                if not self._again(message.lease):
                    await self.peer.on_lease(message.lease)
            elif which == "cancel":
                await self.peer.on_cancel(message.cancel)
            elif which == "yield_lease":
                self.peer.on_yield(message.yield_lease)
            elif which == "preempt_lease":
                self.peer.on_preempt(message.preempt_lease)
            elif which == "settled":
                await self.peer.on_settled(message.settled)
            elif which == "tasks_settled":
                self.peer.on_tasks_settled(message.tasks_settled)
            elif which == "infer":
                self.peer.on_infer(message.infer)
            elif which == "infer_cancel":
                self.peer.on_infer_cancel(message.infer_cancel)

    def _again(self, envelope: pb.Envelope) -> bool:
        """Whether this lease was received before (the brokers of one market may send a
        lease twice: once from the leader that made it, once from the broker this provider
        moved to): taken twice, the second would be refused, and its refusal end the
        first. Unsigned here: the daemon checks what it takes."""
        try:
            lease = pb.Lease.FromString(envelope.payload)
        except DecodeError:     # not a lease: the daemon refuses it
            return False
        key = (lease.job_id, lease.epoch)
        if key in self._leases or key in self.peer.running():
            log.info("lease %s.%d received again; dropped", *key)
            return True
        self._leases[key] = None
        if len(self._leases) > LEASES_REMEMBERED:
            del self._leases[next(iter(self._leases))]
        return False

    async def with_broker(self, call: Callable[[ArtifactsClient], Awaitable], stopping,
                          attempts: int = 10):
        """Run an artifact call once a session is open, and again where it fails with
        Unavailable: as soon as a session is open again where the one it ran under broke
        meanwhile (a broker outage, however long: not counted), else after a backoff, up to
        ``attempts`` tries in all. Raises the last Unavailable, or Unavailable if the daemon
        stops while no session is open."""
        failures = 0
        while True:
            while not self.connected.is_set():
                if stopping.is_set():
                    raise Unavailable(f"no session with the broker at {self.address}"
                                      " and the provider is stopping")
                waiter = asyncio.create_task(self.connected.wait())
                stopper = asyncio.create_task(stopping.wait())
                try:
                    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                    stopper.cancel()
            opened = self.sessions_opened
            try:
                return await call(self.artifacts)
            except Unavailable:
                if stopping.is_set():
                    raise
                # Give the session a moment to see an outage the call ran into.
                await _waited(stopping, min(0.5 * 2 ** failures, 8))
                if not self.connected.is_set() or self.sessions_opened != opened:
                    continue
                failures += 1
                if failures >= attempts:
                    raise
