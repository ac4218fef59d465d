"""What the servicers and the broker's loops share in memory — the changes they wake each
other with (``Changes``), the heartbeats heard but not yet written and the leases ended that
their providers may still run (``Liveness``), and the whole as ``BrokerState`` — and, where
several brokers share one PostgreSQL store, what they tell each other (``share``)."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumarket.broker.api.sessions import ProviderSession, Sessions
from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.jobs import views
from gpumarket.broker.metrics import BrokerMetrics
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.broker.store.store import Store
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)


class Changes:
    """Wakes watchers and the scheduler after a write: wait() returns at the next notify().
    A waiter takes ``seen()`` before it reads what it watches and passes it to wait(), which
    then returns at once if a notify() came in between: a change written while the waiter
    was reading (or placing) is not left for the timeout to find."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._count = 0
        self.relay: Callable[[], None] | None = None   # tells the other brokers (shared store)

    def notify(self) -> None:
        self.notify_here()
        if self.relay is not None:
            self.relay()

    def notify_here(self) -> None:
        """Wake this broker's waiters only (a change another broker told of)."""
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


UNCONFIRMED_FOR_MS = 3_600_000     # a provider that never says again is forgotten after this


class Liveness:
    """Heartbeats noted in memory and written together: a provider's last heartbeat and the
    leases it said it runs are kept here and written in one transaction per scheduler pass
    (``market/providers.heartbeats``), not one transaction per heartbeat. At 10,000 providers on 5 s
    heartbeats that is 2,000 writes a second fewer in front of the one writer, where signed
    calls' nonces, handshakes and job updates wait.

    None of it needs to survive the broker: after a restart every provider is offline until it
    reconnects, and every active lease waits for its provider from the restart as long as that
    provider said it takes to reconnect, plus a margin, and at least a lease timeout
    (``market/providers.renew_all_leases``). The expiry of leases reads the database only after
    what was noted here is written (``market/scheduler.expire``). The gateway notes a
    heartbeat (``heard``), the leases loop takes what to write (``take``), placement asks
    which devices are still busy (``BrokerState.busy_devices``)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}                          # provider -> when, ms
        self.running: dict[str, list[tuple[str, int]]] = {}     # provider -> (job, epoch)
        # Leases the broker ended itself (lost to missed heartbeats, run past their
        # max_runtime) that their provider may still run: their devices are not leased
        # again until a heartbeat of that provider no longer lists them (only such leases:
        # what a heartbeat lists that is not the provider's costs the broker nothing here).
        # provider -> {(job, epoch): since, ms}
        self.unconfirmed: dict[str, dict[tuple[str, int], int]] = {}

    def heard(self, provider_id: str, running: list[tuple[str, int]], now: int) -> None:
        """A heartbeat: the provider is alive at ``now`` and runs ``running``."""
        self.seen[provider_id] = now
        self.running[provider_id] = running
        if (ended := self.unconfirmed.get(provider_id)) is not None:
            listed = set(running)
            for pair in [p for p in ended if p not in listed]:
                del ended[pair]
            if not ended:
                del self.unconfirmed[provider_id]

    def ended(self, provider_id: str, job_id: str, epoch: int, now: int) -> None:
        """The broker ended this lease without its provider saying it stopped."""
        self.unconfirmed.setdefault(provider_id, {})[(job_id, epoch)] = now

    def still_running(self, now: int) -> dict[str, list[tuple[str, int]]]:
        """The ended leases their providers may still run, by provider."""
        for provider_id in list(self.unconfirmed):
            ended = self.unconfirmed[provider_id]
            for pair in [p for p, since in ended.items() if now - since > UNCONFIRMED_FOR_MS]:
                del ended[pair]
            if not ended:
                del self.unconfirmed[provider_id]
        return {p: list(ended) for p, ended in self.unconfirmed.items()}

    def take(self) -> tuple[dict[str, int], dict[str, list[tuple[str, int]]]]:
        """What was heard since the last take, to write."""
        taken = self.seen, self.running
        self.seen, self.running = {}, {}
        return taken

    def put_back(self, seen: dict[str, int], running: dict[str, list[tuple[str, int]]]) -> None:
        """A take whose write failed: heard again, unless a newer heartbeat came meanwhile."""
        for provider_id, when in seen.items():
            if provider_id not in self.seen:
                self.heard(provider_id, running.get(provider_id, []), when)


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
    holder: str = ""                                      # this process, in the leadership table
    epoch: int | None = None                              # the scheduler role's, while leading
    notices: Any = None                                   # store/notices.Notices (shared store)

    @property
    def shared(self) -> bool:
        """Whether other brokers may share this broker's store (PostgreSQL)."""
        return self.store.dialect == "postgresql"

    async def busy_devices(self) -> dict[str, set[int]]:
        """By provider, the devices not free to lease: those of active leases, and those of
        ended leases the provider may still run (its heartbeats still list them)."""
        busy = await self.store.read(views.busy_devices)
        now = now_ms()
        if pending := self.liveness.still_running(now):
            if self.shared:
                pending = self._still_running_here(pending, now)
            for provider_id, devices in (await self.store.read(views.held_devices,
                                                                pending)).items():
                busy.setdefault(provider_id, set()).update(devices)
        return busy

    def _still_running_here(self, pending: dict[str, list[tuple[str, int]]], now: int
                            ) -> dict[str, list[tuple[str, int]]]:
        """Of the ended leases providers may still run, those this broker can know about:
        a provider connected to another broker is heard there, not here, so its ended
        leases hold their devices here for a lease timeout only (its cancel was relayed)."""
        local = set(self.sessions.local())
        held = int(self.config.lease_timeout_s * 1000)
        out = {}
        for provider_id, pairs in pending.items():
            if provider_id not in local:
                since = self.liveness.unconfirmed.get(provider_id, {})
                pairs = [p for p in pairs if now - since.get(p, now) < held]
            if pairs:
                out[provider_id] = pairs
        return out

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


# -- brokers sharing one store ------------------------------------------------------------

CHANGES = ("events", "placement", "logs")
RELAY_DELAY_S = 0.02       # changes told to the other brokers together, at most this late


def share(state: BrokerState, url: str) -> None:
    """Where the store is shared (PostgreSQL): relay what this broker's providers and
    watchers need to the other brokers and back (broker/store/notices.py): leases and
    cancels for a provider connected elsewhere (``Sessions.get`` gives a RemoteSession),
    and that events, logs or what placement depends on changed. Call ``state.notices.run()``
    to start it."""
    from gpumarket.broker.store.notices import Notices

    state.notices = notices = Notices(url, state.holder, lambda n: on_notice(state, n))
    state.sessions.relay = lambda provider_id, message: relay(notices, provider_id, message)
    changed: set[str] = set()

    def flush() -> None:
        notices.publish({"changed": sorted(changed)})
        changed.clear()

    for name in CHANGES:
        def told(name: str = name) -> None:
            if not changed:
                asyncio.get_running_loop().call_later(RELAY_DELAY_S, flush)
            changed.add(name)
        getattr(state, name).relay = told


def relay(notices: Any, provider_id: str, message: gw.BrokerMessage) -> None:
    """Send ``message`` to the provider's session on another broker: a lease by its id (the
    broker there reads its envelope from the store), anything else as it is."""
    if message.HasField("lease"):
        lease = pb.Lease.FromString(message.lease.payload)
        notices.publish({"to": provider_id, "lease": lease.lease_id})
    else:
        notices.publish({"to": provider_id,
                         "msg": base64.b64encode(message.SerializeToString()).decode()})


def on_notice(state: BrokerState, notice: dict[str, Any]) -> None:
    """What another broker told: a change to wake this broker's waiters for, or a message
    for a provider whose session may be here."""
    for name in notice.get("changed") or ():
        if name in CHANGES:
            getattr(state, name).notify_here()
    provider_id = notice.get("to")
    if not isinstance(provider_id, str):
        return
    session = state.sessions.here(provider_id)
    if session is None:
        return          # not connected here
    if isinstance(lease_id := notice.get("lease"), str):
        task = asyncio.get_running_loop().create_task(send_lease(state, session, lease_id))
        _PENDING.add(task)
        task.add_done_callback(_PENDING.discard)
    elif isinstance(raw := notice.get("msg"), str):
        message = gw.BrokerMessage.FromString(base64.b64decode(raw))
        if message.HasField("cancel"):     # this broker hears its heartbeats
            state.liveness.ended(provider_id, message.cancel.job_id, message.cancel.epoch,
                                 now_ms())
        session.send(message)


_PENDING: set[asyncio.Task] = set()


async def send_lease(state: BrokerState, session: ProviderSession, lease_id: str) -> None:
    """Send the session's provider its lease ``lease_id``, read from the store, if it is
    still active and was not sent on this session yet."""
    if lease_id in session.leases_sent:
        return
    envelope = await state.store.read(active_lease_envelope, lease_id)
    if envelope is not None and lease_id not in session.leases_sent:
        session.send(gw.BrokerMessage(lease=pb.Envelope.FromString(envelope)))


async def deliver_leases(state: BrokerState) -> int:
    """Send this broker's providers their active leases not yet started that were not sent
    on their current session (made by a leader elsewhere whose notice was lost, or while the
    provider was moving to this broker). Returns how many were sent."""
    local = state.sessions.local()
    if not local:
        return 0
    sent = 0
    for lease_id, provider_id, envelope in await state.store.read(unstarted_leases, local):
        session = state.sessions.here(provider_id)
        if session is not None and lease_id not in session.leases_sent:
            session.send(gw.BrokerMessage(lease=pb.Envelope.FromString(envelope)))
            sent += 1
    return sent


async def refresh_offers(state: BrokerState) -> None:
    """Read the live offers of providers connected to other brokers (an offer whose
    provider's heartbeats were written within a lease timeout), and the revoked keys."""
    fresh = now_ms() - int(state.config.lease_timeout_s * 1000)
    rows = await state.store.read(live_offers, fresh)
    cache, made_at = state.sessions.remote, state.sessions.remote_at
    here = set(state.sessions.local())
    wanted = {pid: at for pid, at in rows if pid not in here}
    stale = [pid for pid, at in wanted.items()
             if made_at.get(pid) != at or pid not in cache]
    fetched = await state.store.read(offer_envelopes, stale) if stale else {}
    remote = {}
    for pid, at in wanted.items():
        if pid in fetched:
            env = pb.Envelope.FromString(fetched[pid])
            remote[pid] = (pb.Offer.FromString(env.payload), env)
            made_at[pid] = at
        elif pid in cache:
            remote[pid] = cache[pid]
    for pid in [p for p in made_at if p not in remote]:
        del made_at[pid]
    state.sessions.remote = remote
    revoked = set(await state.store.read(revoked_keys))
    state.revoked.intersection_update(revoked)
    state.revoked.update(revoked)


def live_offers(db: Any, fresh_since_ms: int) -> list[tuple[str, int]]:
    return [(r[0], r[1]) for r in db.execute(
        "SELECT o.provider_id, o.created_at_ms FROM offers o JOIN providers p"
        " ON p.id = o.provider_id WHERE p.online = 1 AND p.banned = 0"
        " AND p.last_seen_ms >= ?", [fresh_since_ms])]


def offer_envelopes(db: Any, provider_ids: list[str]) -> dict[str, bytes]:
    import json

    return {r[0]: bytes(r[1]) for r in db.execute(
        "SELECT provider_id, envelope FROM offers WHERE provider_id IN"
        " (SELECT value FROM json_each(?))", [json.dumps(provider_ids)])}


def revoked_keys(db: Any) -> list[str]:
    return [r[0] for r in db.execute("SELECT key_id FROM revoked_keys")]


def active_lease_envelope(db: Any, lease_id: str) -> bytes | None:
    row = db.execute("SELECT envelope FROM leases WHERE id = ? AND state = 'active'",
                     [lease_id]).fetchone()
    return None if row is None else bytes(row[0])


def unstarted_leases(db: Any, provider_ids: list[str]) -> list[tuple[str, str, bytes]]:
    import json

    return [(r[0], r[1], bytes(r[2])) for r in db.execute(
        "SELECT id, provider_id, envelope FROM leases WHERE state = 'active'"
        " AND started_at_ms IS NULL AND provider_id IN (SELECT value FROM json_each(?))",
        [json.dumps(provider_ids)])]
