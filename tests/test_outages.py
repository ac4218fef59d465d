"""A broker outage loses no running lease: a restarted broker keeps each lease as long as its
provider said it takes to come back. The broker's restart wait on a real SQLite store."""

from __future__ import annotations

import asyncio

import pytest

from gpumarket.broker import jobs, providers, views
from gpumarket.broker.store import Store
from gpumarket.proto.envelope import seal
from gpumarket.proto.identity import Identity
from tests.test_broker_domain import new_job

# -- the broker's wait after a restart ---------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "broker.db")
    s.open()
    yield s
    s.close()


def test_a_restarted_broker_waits_for_each_provider_as_long_as_it_said(store):
    broker, client = Identity.generate(), Identity.generate()
    timeout = 15_000
    said = {"p1": 36_000, "p2": 0, "p3": 10**9, "p4": 1_000}   # p2: an older provider

    async def scenario():
        w = store.write
        for n, (pid, ms) in enumerate(said.items(), 1):
            await w(providers.online, pid, b"key", 1, ms)
            await w(jobs.submit, new_job(client, f"j{n}", nonce=f"{n:032x}"), 1)
            await w(jobs.create_lease, f"j{n}", pid, [0], 1.0, 2, 60_000, 10,
                    lambda lease: seal(broker, lease))
        stored = await store.read(lambda db: dict(db.execute(
            "SELECT id, reconnect_within_ms FROM providers").fetchall()))
        await w(providers.after_restart)
        now = 10**12
        kept = await w(providers.renew_all_leases, now, timeout)

        async def lost_by(ms: int) -> set[str]:
            overdue = await store.read(views.overdue_leases, now + ms - timeout)
            return {lease_id.split(".")[0] for lease_id in overdue}

        return stored, kept, {ms: await lost_by(ms) for ms in
                              (14_999, 15_001, 45_999, 46_001, 309_999, 310_001)}

    stored, kept, lost = asyncio.run(scenario())
    assert stored == {"p1": 36_000, "p2": 0, "p3": providers.MAX_RECONNECT_MS, "p4": 1_000}
    assert kept == 4
    assert lost[14_999] == set()
    assert lost[15_001] == {"j4"}                  # said 1 s: the lease timeout still holds
    assert lost[45_999] == {"j4"}
    assert lost[46_001] == {"j1", "j2", "j4"}      # 36 s (said, or unsaid) + 10 s margin
    assert lost[309_999] == {"j1", "j2", "j4"}
    assert lost[310_001] == {"j1", "j2", "j3", "j4"}   # bounded: 5 min + 10 s


def test_the_first_heartbeat_after_a_restart_brings_a_lease_back_to_the_usual_timeout(store):
    broker, client = Identity.generate(), Identity.generate()

    async def scenario():
        w = store.write
        await w(providers.online, "p1", b"key", 1, 36_000)
        await w(jobs.submit, new_job(client), 1)
        await w(jobs.create_lease, "j1", "p1", [0], 1.0, 2, 60_000, 10,
                lambda lease: seal(broker, lease))
        await w(providers.renew_all_leases, 10**12, 15_000)
        await w(providers.heartbeats, {"p1": 10**12 + 2_000}, {"p1": [("j1", 1)]})
        return await store.read(views.overdue_leases, 10**12 + 2_000 + 1)

    assert asyncio.run(scenario()) == ["j1.1"]
