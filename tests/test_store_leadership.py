"""The leadership lease (broker/store/leadership.py), on SQLite and on PostgreSQL: one holder
at a time, a takeover only once the lease has run out, a new epoch at each; and a deposed
leader's late write refused whole."""

from __future__ import annotations

import asyncio

import pytest

from gpumarket.broker.money import ledger
from gpumarket.broker.store import leadership
from gpumarket.broker.store.leadership import Deposed, fenced

TTL = 10_000


def test_one_leader_at_a_time_and_a_new_epoch_at_each_takeover(store):
    async def main():
        w = store.write
        assert await store.read(leadership.leader) is None
        assert await w(leadership.take, "a", 0, TTL) == 1
        assert await w(leadership.take, "b", 5_000, TTL) is None      # a's lease runs
        assert await w(leadership.take, "a", 6_000, TTL) == 1         # a renews by taking
        assert await w(leadership.renew, "a", 1, 8_000, TTL)
        assert await w(leadership.take, "b", 17_000, TTL) is None     # renewed to 18 s
        assert await w(leadership.take, "b", 18_000, TTL) == 2        # ran out: b's now
        assert await store.read(leadership.leader) == ("b", 2, 28_000)
        assert not await w(leadership.renew, "a", 1, 18_500, TTL)     # a must step down
        assert await w(leadership.take, "a", 19_000, TTL) is None
        # A lease its own holder let run out is taken again with a new epoch all the same.
        assert await w(leadership.take, "b", 40_000, TTL) == 3
    asyncio.run(main())


def test_a_deposed_leaders_late_write_is_refused_whole(store):
    async def main():
        w = store.write
        old = await w(leadership.take, "a", 0, TTL)
        await w(fenced, old, 1_000, ledger.credit, "ca", 100, "client", "", "op", "k1", 1_000)
        # a stalls past its lease (a long pause, a partition); b takes over.
        new = await w(leadership.take, "b", TTL + 1, TTL)
        assert new == old + 1
        # a wakes up and writes as the leader it was: refused, nothing of it written.
        with pytest.raises(Deposed, match="superseded"):
            await w(fenced, old, TTL + 2, ledger.credit, "ca", 500, "client", "", "op", "k2",
                    TTL + 2)
        assert await store.read(ledger.balance, ledger.client("ca")) == 100
        # The new leader's writes go through; the books stay balanced.
        await w(fenced, new, TTL + 3, ledger.credit, "ca", 50, "client", "", "op", "k3",
                TTL + 3)
        assert await store.read(ledger.balance, ledger.client("ca")) == 150
        assert await store.read(ledger.audit) == []
    asyncio.run(main())


def test_two_brokers_on_one_postgresql_database_one_deposed(pg_cluster):
    """Two brokers' stores on one database (each its own connections): the one deposed while
    it stalled cannot write as the leader, and its stalled write cannot land after the
    takeover either (it either committed first, or is refused)."""
    from gpumarket.broker.store.store import PgStore

    url = pg_cluster.database(template=pg_cluster.template)
    a, b = PgStore(url), PgStore(url)
    a.open()
    b.open()

    async def main():
        old = await a.write(leadership.take, "a", 0, TTL)
        assert await b.write(leadership.take, "b", 1, TTL) is None
        new = await b.write(leadership.take, "b", TTL, TTL)
        assert new == old + 1
        writes = [a.write(fenced, old, TTL + 1, ledger.credit, "ca", 7, "client", "", "op",
                          f"a{n}", TTL + 1) for n in range(20)]
        writes += [b.write(fenced, new, TTL + 1, ledger.credit, "ca", 1, "client", "", "op",
                           f"b{n}", TTL + 1) for n in range(20)]
        results = await asyncio.gather(*writes, return_exceptions=True)
        assert all(isinstance(r, Deposed) for r in results[:20]), results[:20]
        assert not any(isinstance(r, BaseException) for r in results[20:]), results[20:]
        assert await a.read(ledger.balance, ledger.client("ca")) == 20
        assert await a.read(ledger.audit) == []
    try:
        asyncio.run(main())
    finally:
        a.close()
        b.close()
