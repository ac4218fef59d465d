"""Live provider sessions, in memory: who is connected and how to reach them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb


@dataclass(eq=False)
class ProviderSession:
    provider_id: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    offer: pb.Offer | None = None                     # None until offered, or while draining
    closed: bool = False
    row_id: int = 0                                   # provider_sessions row

    def send(self, message: gw.BrokerMessage) -> None:
        if not self.closed:
            self.outbox.put_nowait(message)


class Sessions:
    def __init__(self) -> None:
        self._by_provider: dict[str, ProviderSession] = {}

    def open(self, provider_id: str) -> ProviderSession:
        """Register a new session; an older one of the same provider is closed."""
        old = self._by_provider.get(provider_id)
        if old is not None:
            old.closed = True
            old.outbox.put_nowait(None)  # wakes its writer, which then ends
        session = ProviderSession(provider_id)
        self._by_provider[provider_id] = session
        return session

    def close(self, session: ProviderSession) -> bool:
        """Forget ``session``; return True if it was the provider's current one."""
        session.closed = True
        if self._by_provider.get(session.provider_id) is session:
            del self._by_provider[session.provider_id]
            return True
        return False

    def end(self, provider_id: str) -> None:
        """End the provider's session (its handler then cleans up as after a disconnect)."""
        session = self._by_provider.get(provider_id)
        if session is not None:
            session.offer = None
            session.outbox.put_nowait(None)
            session.closed = True

    def get(self, provider_id: str) -> ProviderSession | None:
        return self._by_provider.get(provider_id)

    def offers(self) -> list[pb.Offer]:
        return [s.offer for s in self._by_provider.values() if s.offer is not None]

    def __len__(self) -> int:
        return len(self._by_provider)
