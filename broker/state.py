"""What the servicers and the broker's loops share."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from gpumarket.broker.api.sessions import Sessions
from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.jobs import views
from gpumarket.broker.market.liveness import Liveness
from gpumarket.broker.metrics import BrokerMetrics
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.broker.store.store import Store
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw


class Changes:
    """Wakes watchers and the scheduler after a write: wait() returns at the next notify().
    A waiter takes ``seen()`` before it reads what it watches and passes it to wait(), which
    then returns at once if a notify() came in between: a change written while the waiter
    was reading (or placing) is not left for the timeout to find."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._count = 0

    def notify(self) -> None:
        self._count += 1
        self._event.set()
        self._event = asyncio.Event()

    def seen(self) -> int:
        return self._count

    async def wait(self, timeout: float, since: int | None = None) -> None:
        if since is not None and since != self._count:
            return
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass


@dataclass
class BrokerState:
    config: BrokerConfig
    identity: Identity
    store: Store
    artifacts: ArtifactStore
    sessions: Sessions = field(default_factory=Sessions)
    events: Changes = field(default_factory=Changes)      # job events were written
    placement: Changes = field(default_factory=Changes)   # something a placement depends on
    logs: Changes = field(default_factory=Changes)        # job log lines were written
    metrics: BrokerMetrics = field(default_factory=BrokerMetrics)
    revoked: set[str] = field(default_factory=set)        # key ids refused everywhere
    liveness: Liveness = field(default_factory=Liveness)  # heartbeats not yet written
    serving: Any = None                                   # broker/serving/router.py's Serving
    api_base: str = ""                                    # where the endpoints' API listens

    async def busy_devices(self) -> dict[str, set[int]]:
        """By provider, the devices not free to lease: those of active leases, and those of
        ended leases the provider may still run (its heartbeats still list them)."""
        busy = await self.store.read(views.busy_devices)
        if pending := self.liveness.still_running(now_ms()):
            for provider_id, devices in (await self.store.read(views.held_devices,
                                                                pending)).items():
                busy.setdefault(provider_id, set()).update(devices)
        return busy

    def stop_lease(self, job_id: str, epoch: int, provider_id: str, reason: str) -> None:
        """A lease the broker ended (cancelled, paused, lost, taken back, ended by a check):
        tell its provider, if connected, to stop it. Its devices are not leased again until
        a heartbeat of that provider no longer lists it (stopping a job takes its grace
        period; a lease sent meanwhile would be refused, or read late and lost)."""
        self.liveness.ended(provider_id, job_id, epoch, now_ms())
        session = self.sessions.get(provider_id)
        if session is not None:
            session.send(gw.BrokerMessage(cancel=gw.CancelLease(job_id=job_id, epoch=epoch,
                                                                reason=reason)))

    @property
    def operators(self) -> set[str]:
        """Key ids allowed the Admin calls: the configured ones and the broker's own."""
        return {*self.config.operators, self.identity.id}
