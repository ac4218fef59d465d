"""Several brokers on one store, without processes: the leader's writes fenced by its epoch (a
deposed leader's placement is refused whole), a follower runs no loops and takes over when
the leader's lease runs out, a leader steps down when its role is taken, a lease made by the
leader reaches a provider whose session is on another broker (PostgreSQL LISTEN/NOTIFY), and
the client's and provider's lists of broker addresses."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.jobs import arrays
from gpumarket.broker.market import providers, scheduler
from gpumarket.broker.state import BrokerState, share
from gpumarket.broker.store import leadership
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.broker.store.leadership import Deposed
from gpumarket.proto.envelope import open_envelope, seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb
from tests.helpers import signed_offer
from tests.test_array_rules import array_job

TTL = 10_000


def broker_state(tmp_path, store, broker: Identity, name: str, **settings) -> BrokerState:
    cfg = BrokerConfig(data_dir=tmp_path / name, **settings)
    state = BrokerState(cfg, broker, store, ArtifactStore(tmp_path / "artifacts", 1 << 20))
    state.holder = name
    return state


async def connect(state: BrokerState, key: Identity) -> None:
    """A provider's session on ``state``'s broker, with its offer (as the gateway makes it)."""
    offer = signed_offer(key, kinds=(pb.JOB_KIND_SCRIPT,))
    parsed, _ = open_envelope(offer, pb.Offer)
    await state.store.write(providers.online, key.id, key.public_key, now_ms())
    await state.store.write(providers.store_offer, key.id, offer.SerializeToString(), parsed,
                            now_ms())
    session = state.sessions.open(key.id)
    session.offer, session.offer_envelope = parsed, offer


def lease_rows(db) -> list[tuple]:
    return db.execute("SELECT job_id, epoch, provider_id FROM leases ORDER BY job_id").fetchall()


def test_a_deposed_leaders_placement_is_refused_whole(store, tmp_path):
    """Broker a led at epoch 1 and was deposed (b took the role when a's lease ran out): a's
    placement pass, however late it runs, writes no lease and sends none; b's places the
    job. Both brokers' loops see the same sessions here: only the epoch differs."""
    broker, client, provider = Identity.generate(), Identity.generate(), Identity.generate()
    state = broker_state(tmp_path, store, broker, "a")

    async def scenario():
        await connect(state, provider)
        await store.write(arrays.submit, array_job(client, "j1", 1, 1), 1)
        old = await store.write(leadership.take, "a", now_ms(), TTL)
        new = await store.write(leadership.take, "b", now_ms() + TTL + 1, TTL)
        assert (old, new) == (1, 2)
        with pytest.raises(Deposed):
            await scheduler.place_queued(scheduler.as_leader(state, old))
        assert await store.read(lease_rows) == []
        assert state.sessions.get(provider.id).outbox.empty()
        assert await scheduler.place_queued(scheduler.as_leader(state, new)) == 1
        assert await store.read(lease_rows) == [("j1-1", 1, provider.id)]
        lease, _ = open_envelope(state.sessions.get(provider.id).outbox.get_nowait().lease,
                                 pb.Lease)
        assert lease.job_id == "j1-1"

    asyncio.run(scenario())


def test_a_broker_on_sqlite_always_leads(store, tmp_path, monkeypatch):
    """One process, one file: no leadership row is taken, and the loops run unfenced."""
    if store.dialect != "sqlite":
        pytest.skip("the SQLite broker's case")
    state = broker_state(tmp_path, store, Identity.generate(), "only")
    ran = asyncio.Event()

    async def scenario():
        task = asyncio.create_task(scheduler.lead(state))
        await asyncio.wait_for(ran.wait(), 30)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await store.read(leadership.leader) is None
        assert state.epoch == 0

    async def probe(st):
        assert st.store is store      # not a FencedStore: as cheap as before
        ran.set()

    monkeypatch.setattr(scheduler, "LOOPS", (scheduler.Loop("probe", probe, lambda c: 0.05),))
    asyncio.run(scenario())


def test_a_follower_runs_no_loop_until_it_takes_over_and_steps_down_when_deposed(
        pg_store, tmp_path, monkeypatch):
    """Another broker holds the scheduler role: this one runs no pass of the loops while
    that lease runs; once it runs out this broker takes the role (a new epoch) and runs them,
    its writes fenced; when a rival takes the role from it, it stops them (steps down) within
    the ttl."""
    passes: list[tuple[float, int | None]] = []
    state = broker_state(tmp_path, pg_store, Identity.generate(), "follower",
                         leader_ttl_s=0.6, schedule_interval_s=0.05)

    async def probe(st):
        assert isinstance(st.store, scheduler.FencedStore)
        await st.store.write(lambda db: None)       # a fenced write: refused once deposed
        passes.append((time.monotonic(), state.epoch))

    monkeypatch.setattr(scheduler, "LOOPS", (scheduler.Loop("probe", probe, lambda c: 0.05),))

    async def until(predicate, bound_s=30.0):
        deadline = time.monotonic() + bound_s
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)

    async def scenario():
        # The rival leads for 1.5 s from now and never renews (it died).
        rival_until = now_ms() + 1_500
        rival_gone = time.monotonic() + 1.5     # the same moment on the passes' clock
        assert await pg_store.write(leadership.take, "rival", rival_until - 1_500, 1_500) == 1
        task = asyncio.create_task(scheduler.lead(state))
        try:
            await until(lambda: state.epoch is not None)
            assert now_ms() >= rival_until
            assert state.epoch == 2
            assert (await pg_store.read(leadership.leader))[:2] == ("follower", 2)
            await until(lambda: len(passes) >= 3)
            # None while the rival's lease ran (not "none before this test looked": a pass
            # may end between the takeover and a loaded loop's next look at it).
            assert all(epoch == 2 and at >= rival_gone - 0.05 for at, epoch in passes), passes
            # A rival takes the role from under it (as a broker whose clock ran ahead would).
            await pg_store.write(lambda db: db.execute(
                "UPDATE leadership SET holder = 'rival', epoch = epoch + 1,"
                " expires_at_ms = ? WHERE role = 'scheduler'", [now_ms() + 60_000]))
            await until(lambda: state.epoch is None, 0.6 * 2 + 10)
            stopped = len(passes)
            await asyncio.sleep(0.3)       # no pass runs after stepping down (a window)
            assert len(passes) == stopped
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_a_leader_that_stops_hands_the_role_on_at_once(pg_store, tmp_path, monkeypatch):
    """A broker stopping (its lead task cancelled, as on SIGTERM) ends its lease on the role:
    another broker takes it at once, with the next epoch, rather than a ttl later."""
    state = broker_state(tmp_path, pg_store, Identity.generate(), "stopping", leader_ttl_s=60)

    async def nothing(st):
        pass

    monkeypatch.setattr(scheduler, "LOOPS", (scheduler.Loop("probe", nothing, lambda c: 1),))

    async def scenario():
        task = asyncio.create_task(scheduler.lead(state))
        deadline = time.monotonic() + 30
        while state.epoch is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert await pg_store.write(leadership.take, "next", now_ms(), TTL) is None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await pg_store.write(leadership.take, "next", now_ms(), TTL) == 2

    asyncio.run(scenario())


def test_a_lease_reaches_a_provider_connected_to_another_broker(pg_cluster, tmp_path):
    """Brokers a (leader) and b on one PostgreSQL store, a provider connected to b only: a
    sees its offer (from the store), places a job on it, and the lease reaches the
    provider's session on b through a notice; a job event written on a wakes b's watchers."""
    from gpumarket.broker.state import refresh_offers
    from gpumarket.broker.store.store import open_store

    url = pg_cluster.database(template=pg_cluster.template)
    stores = [open_store(url, None), open_store(url, None)]
    for s in stores:
        s.open()
    broker, client, provider = Identity.generate(), Identity.generate(), Identity.generate()
    a = broker_state(tmp_path, stores[0], broker, "a")
    b = broker_state(tmp_path, stores[1], broker, "b")

    async def scenario():
        share(a, url)
        share(b, url)
        runs = [asyncio.create_task(a.notices.run()), asyncio.create_task(b.notices.run())]
        try:
            await asyncio.wait_for(asyncio.gather(a.notices.listening.wait(),
                                                  b.notices.listening.wait()), 30)
            await connect(b, provider)
            await stores[1].write(providers.heartbeats, {provider.id: now_ms()}, {})
            await refresh_offers(a)
            assert [o.provider_id for o in a.sessions.offers()] == [provider.id]
            assert a.sessions.here(provider.id) is None
            await stores[0].write(arrays.submit, array_job(client, "j2", 1, 1), 1)
            epoch = await stores[0].write(leadership.take, "a", now_ms(), TTL)
            seen = b.events.seen()
            sent = time.monotonic()
            assert await scheduler.place_queued(scheduler.as_leader(a, epoch)) == 1
            outbox = b.sessions.here(provider.id).outbox
            message = await asyncio.wait_for(outbox.get(), 30)
            delay = time.monotonic() - sent
            lease, _ = open_envelope(message.lease, pb.Lease)
            assert (lease.job_id, lease.provider_id) == ("j2-1", provider.id)
            # b's watchers are woken by the events a wrote (placement notifies them).
            await asyncio.wait_for(b.events.wait(30, since=seen), 31)
            assert b.events.seen() != seen
            # The lease is sent once: the poll that finds leases not yet sent skips it.
            from gpumarket.broker.state import deliver_leases
            assert await deliver_leases(b) == 0
            print(f"lease relayed to the other broker in {delay * 1000:.0f} ms")
        finally:
            for task in runs:
                task.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        for s in stores:
            s.close()


def test_a_lease_whose_notice_was_lost_is_delivered_by_the_poll(pg_store, tmp_path):
    """A lease made while its provider was moving to this broker (or whose notice this broker
    missed) is sent by ``deliver_leases``, once per session."""
    from gpumarket.broker.state import deliver_leases

    broker, client, provider = Identity.generate(), Identity.generate(), Identity.generate()
    state = broker_state(tmp_path, pg_store, broker, "b")

    async def scenario():
        await connect(state, provider)
        await pg_store.write(arrays.submit, array_job(client, "j3", 1, 1), 1)
        epoch = await pg_store.write(leadership.take, "leader", now_ms(), TTL)
        assert await scheduler.place_queued(scheduler.as_leader(state, epoch)) == 1
        state.sessions.here(provider.id).outbox.get_nowait()
        assert await deliver_leases(state) == 0         # sent on this session already
        state.sessions.open(provider.id)                 # it reconnected: a new session
        assert await deliver_leases(state) == 1
        assert await deliver_leases(state) == 0

    asyncio.run(scenario())


def test_broker_lists_are_checked():
    from gpumarket.link.channel import split_brokers
    from gpumarket.proto.errors import InvalidArgument

    assert split_brokers("a:1, plaintext://127.0.0.1:2") == ["a:1", "plaintext://127.0.0.1:2"]
    for bad in ("", " , ", "a:1,b", "plaintext://10.0.0.1:7070", ",".join(["a:1"] * 17)):
        with pytest.raises(InvalidArgument):
            split_brokers(bad)


def test_a_provider_drops_a_lease_it_was_sent_twice(tmp_path):
    """The brokers of one market may send a lease twice (the leader's notice and the broker
    the provider moved to): the second must not reach the daemon, whose refusal (its devices
    are taken, by that very lease) would end the first."""
    from gpumarket.provider.config import ProviderConfig
    from gpumarket.provider.session import BrokerSession

    broker = Identity.generate()

    class Peer:
        draining = False
        got: list[str] = []

        def running(self):
            return []

    def lease(job_id: str, epoch: int) -> pb.Envelope:
        return seal(broker, pb.Lease(lease_id=f"{job_id}.{epoch}", job_id=job_id, epoch=epoch))

    session = BrokerSession(ProviderConfig(broker="a:1,b:2", data_dir=tmp_path),
                            Identity.generate(), Peer())
    assert session.addresses == ["a:1", "b:2"] and session.address == "a:1"
    assert not session._again(lease("j", 1))
    assert session._again(lease("j", 1))
    assert not session._again(lease("j", 2))          # a new epoch is a new lease


async def open_session(state: BrokerState, key: Identity):
    """What the gateway writes as a provider's session on ``state``'s broker opens: online
    (the handshake), the session's row, then its offer."""
    offer = signed_offer(key, kinds=(pb.JOB_KIND_SCRIPT,))
    parsed, _ = open_envelope(offer, pb.Offer)
    await state.store.write(providers.online, key.id, key.public_key, now_ms())
    session = state.sessions.open(key.id)
    session.row_id = await state.store.write(providers.session_started, key.id, now_ms())
    await state.store.write(providers.store_offer, key.id, offer.SerializeToString(), parsed,
                            now_ms())
    session.offer, session.offer_envelope = parsed, offer
    return session


def test_a_broker_ending_an_old_session_leaves_a_moved_provider_to_its_new_broker(
        pg_cluster, tmp_path):
    """Brokers a, b and c on one PostgreSQL store. A provider moved from a to b; a ends its
    old session late (a stopping cleanly, or a session it lost late): the provider stays
    online with its offer, and c (the leader, say) still sees it. The same where a ends it
    between b's handshake and b's session row. A provider whose latest session ends goes
    offline, its offer withdrawn."""
    from gpumarket.broker.api.gateway import ProviderGatewayServicer
    from gpumarket.broker.state import live_offers, refresh_offers
    from gpumarket.broker.store.store import open_store

    url = pg_cluster.database(template=pg_cluster.template)
    stores = [open_store(url, None) for _ in range(3)]
    for s in stores:
        s.open()
    broker = Identity.generate()
    a, b, c = (broker_state(tmp_path, s, broker, n) for s, n in zip(stores, "abc"))
    moved, racing = Identity.generate(), Identity.generate()

    async def offered(state: BrokerState) -> set[str]:
        await state.store.write(providers.heartbeats, {moved.id: now_ms(),
                                                       racing.id: now_ms()}, {})
        await refresh_offers(state)
        return {o.provider_id for o in state.sessions.offers()}

    async def scenario():
        for s in (a, b, c):
            share(s, url)
        old = await open_session(a, moved)
        await open_session(b, moved)
        await ProviderGatewayServicer(a)._closed(old)
        assert await offered(c) == {moved.id}
        assert await stores[2].read(live_offers, 0) == [(moved.id, ANY_INT)]

        # a's old session ends between b's handshake (online) and b's session row.
        old = await open_session(a, racing)
        await stores[1].write(providers.online, racing.id, racing.public_key, now_ms())
        await ProviderGatewayServicer(a)._closed(old)
        session = b.sessions.open(racing.id)
        session.row_id = await stores[1].write(providers.session_started, racing.id, now_ms())
        offer = signed_offer(racing, kinds=(pb.JOB_KIND_SCRIPT,))
        await stores[1].write(providers.store_offer, racing.id, offer.SerializeToString(),
                              open_envelope(offer, pb.Offer)[0], now_ms())
        assert await offered(c) == {moved.id, racing.id}

        # Its latest session ending takes the provider off the market.
        await ProviderGatewayServicer(b)._closed(b.sessions.here(moved.id))
        assert await offered(c) == {racing.id}

    try:
        asyncio.run(scenario())
    finally:
        for s in stores:
            s.close()


class _AnyInt:
    def __eq__(self, other) -> bool:
        return isinstance(other, int)


ANY_INT = _AnyInt()
