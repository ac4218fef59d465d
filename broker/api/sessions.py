"""Live provider sessions, in memory: who is connected and how to reach them.

Where several brokers share one PostgreSQL store, a provider's session is on one of them:
the others see its offer as the store has it (``remote``, refreshed by broker/state.py) and
reach it through a ``RemoteSession``, whose messages are relayed to the broker that holds the
session (broker/store/notices.py). Code that asks ``get(provider_id)`` and sends need not
know which broker the provider is connected to."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gpumarket.broker.api.auth import RateLimiter

from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb


OUTBOX_MAX = 1000            # messages waiting for a provider that does not read them
MESSAGES_PER_S = 200.0       # what a provider may send, sustained (bursts of 10 s worth)
CHUNKS_PER_S = 20_000.0      # inference chunks (endpoint answers) a provider may send
LOG_LINES_PER_S = 1.0        # broker log lines about one session (bursts of 20)


@dataclass(eq=False)
class ProviderSession:
    provider_id: str
    outbox: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(OUTBOX_MAX))
    offer: pb.Offer | None = None                     # None until offered, or while draining
    offer_envelope: pb.Envelope | None = None         # the signed offer, as it came
    closed: bool = False
    row_id: int = 0                                   # provider_sessions row
    ended_why: str = ""                               # why the broker ended it, if it did
    messages: RateLimiter = field(
        default_factory=lambda: RateLimiter(MESSAGES_PER_S, MESSAGES_PER_S * 10))
    chunks: RateLimiter = field(
        default_factory=lambda: RateLimiter(CHUNKS_PER_S, CHUNKS_PER_S * 10))
    log_lines: RateLimiter = field(default_factory=lambda: RateLimiter(LOG_LINES_PER_S, 20))
    unlogged: int = 0
    leases_sent: set[str] = field(default_factory=set)   # lease ids sent on this session

    def send(self, message: gw.BrokerMessage) -> None:
        """Queue a message for the provider; a provider that leaves a full outbox unread
        loses its session (the broker keeps no unbounded backlog for anyone)."""
        if self.closed:
            return
        if message.HasField("lease"):
            self.leases_sent.add(pb.Lease.FromString(message.lease.payload).lease_id)
        try:
            self.outbox.put_nowait(message)
        except asyncio.QueueFull:
            self.end(f"the provider left {OUTBOX_MAX} messages unread")

    def end(self, why: str = "") -> None:
        self.ended_why = self.ended_why or why
        self.offer = None
        self.closed = True
        try:
            self.outbox.put_nowait(None)  # wakes its writer, which then ends
        except asyncio.QueueFull:
            pass                          # the handler sees ``closed`` and cancels it

    def log(self, logger: logging.Logger, level: int, msg: str, *args) -> None:
        """Log about this session at most LOG_LINES_PER_S (what a provider sends must not
        flood the broker's log); the lines left out are counted in the next one."""
        if not self.log_lines.allow(""):
            self.unlogged += 1
            return
        if self.unlogged:
            msg += f" ({self.unlogged} similar lines left out)"
            self.unlogged = 0
        logger.log(level, msg, *args)


# What a broker relays to the broker holding a provider's session: the lease-making and
# lease-ending messages. Endpoint traffic (infer, infer_cancel) is not relayed here: a
# request reaches the broker its replica's provider is connected to as a whole HTTP request
# (broker/serving/relay.py), and that broker's router sends it on the provider's session.
RELAYED = frozenset({"lease", "cancel", "yield_lease", "preempt_lease"})


@dataclass(eq=False)
class RemoteSession:
    """A provider connected to another broker of the same store: what is sent to it is
    relayed there (``relay(provider_id, message)``), the relayed sorts only."""

    provider_id: str
    offer: pb.Offer | None
    offer_envelope: pb.Envelope | None
    relay: Callable[[str, gw.BrokerMessage], None]
    closed: bool = False

    def send(self, message: gw.BrokerMessage) -> None:
        if message.WhichOneof("msg") in RELAYED:
            self.relay(self.provider_id, message)

    def end(self, why: str = "") -> None:
        """Its session is another broker's to end."""

    def log(self, logger: logging.Logger, level: int, msg: str, *args) -> None:
        logger.log(level, msg, *args)


class Sessions:
    def __init__(self) -> None:
        self._by_provider: dict[str, ProviderSession] = {}
        # Offers of providers connected to other brokers of the store: provider ->
        # (offer, envelope); set by BrokerState.refresh_offers where the store is shared.
        self.remote: dict[str, tuple[pb.Offer, pb.Envelope]] = {}
        self.remote_at: dict[str, int] = {}     # provider -> when its remote offer was made
        self.relay: Callable[[str, gw.BrokerMessage], None] | None = None

    def open(self, provider_id: str, messages_per_s: float = MESSAGES_PER_S) -> ProviderSession:
        """Register a new session; an older one of the same provider is closed."""
        old = self._by_provider.get(provider_id)
        if old is not None:
            old.end()
        session = ProviderSession(provider_id, messages=RateLimiter(messages_per_s,
                                                                    messages_per_s * 10))
        self._by_provider[provider_id] = session
        return session

    def close(self, session: ProviderSession) -> bool:
        """Forget ``session``; return True if it was the provider's current one."""
        session.closed = True
        if self._by_provider.get(session.provider_id) is session:
            del self._by_provider[session.provider_id]
            return True
        return False

    def ask_to_yield(self, provider_id: str, job_id: str, epoch: int, reason: str,
                     min_left_s: float = 0.0, split: bool = False) -> None:
        """Ask the provider to stop its lease ``job_id`` (of ``epoch``) after its current
        task, wherever its session is (an array's lease yielding to another client's job, or
        to an idle lane of its array: broker/jobs/arrays.py ``yield_lease``); with
        ``split``, to go on and give the later part of its tasks not started to another
        lease instead (a steal); with ``min_left_s``, only if what it has not run yet would
        take it that long (a steal: the provider knows how far it ran, the broker only what
        it reported)."""
        session = self.get(provider_id)
        if session is not None:
            session.send(gw.BrokerMessage(yield_lease=gw.YieldLease(
                job_id=job_id, epoch=epoch, reason=reason, min_left_s=min_left_s,
                split=split)))

    def end(self, provider_id: str) -> None:
        """End the provider's session (its handler then cleans up as after a disconnect)."""
        session = self._by_provider.get(provider_id)
        if session is not None:
            session.end()

    def get(self, provider_id: str) -> ProviderSession | RemoteSession | None:
        """The provider's session on this broker; else, where the store is shared and the
        provider has a live offer through another broker, a RemoteSession; else None."""
        session = self._by_provider.get(provider_id)
        if session is not None or self.relay is None:
            return session
        remote = self.remote.get(provider_id)
        if remote is None:
            return None
        return RemoteSession(provider_id, remote[0], remote[1], self.relay)

    def here(self, provider_id: str) -> ProviderSession | None:
        """The provider's session on this broker, or None."""
        return self._by_provider.get(provider_id)

    def local(self) -> list[str]:
        """The providers whose session is on this broker."""
        return list(self._by_provider)

    def offers(self) -> list[pb.Offer]:
        found = [s.offer for s in self._by_provider.values() if s.offer is not None]
        if self.remote:
            found += [offer for pid, (offer, _) in self.remote.items()
                      if pid not in self._by_provider]
        return found

    def listings(self) -> list[tuple[pb.Offer, pb.Envelope]]:
        """The current offers with their signed envelopes, cheapest first (then by provider
        id): what SearchOffers pages through, from memory."""
        found = [(s.offer, s.offer_envelope) for s in self._by_provider.values()
                 if s.offer is not None and s.offer_envelope is not None]
        if self.remote:
            found += [pair for pid, pair in self.remote.items() if pid not in self._by_provider]
        found.sort(key=lambda x: (x[0].price_per_gpu_hour, x[0].provider_id))
        return found

    def __len__(self) -> int:
        return len(self._by_provider)
