"""The store's writes on PostgreSQL are pipelined (broker/store/store.py PgStore._commit_group):
a statement whose answer a write does not read is sent without waiting for it. What that must
not change: a write whose statement the database refuses fails alone, with the database's
error, however late the refusal arrives; a conditional UPDATE's rowcount is the real one (the
leader's fence reads it); a deposed leader's pass of several leases is refused whole."""

from __future__ import annotations

import asyncio

import pytest

from gpumarket.broker.jobs import arrays
from gpumarket.broker.market import scheduler
from gpumarket.broker.store import leadership
from gpumarket.broker.store.leadership import Deposed
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from tests.test_array_rules import array_job
from tests.test_ha import TTL, broker_state, connect, lease_rows


def setup(db) -> None:
    db.execute("CREATE TABLE probe (n BIGINT PRIMARY KEY, note TEXT NOT NULL DEFAULT '')")


def insert(db, n: int, twice: bool = False) -> int:
    db.execute("INSERT INTO probe (n) VALUES (?)", [n])
    if twice:       # refused by the primary key; the write reads no answer of it
        db.execute("INSERT INTO probe (n) VALUES (?)", [n])
    db.execute("UPDATE probe SET note = 'written' WHERE n = ?", [n])
    return n


def touch(db, n: int) -> int:
    return db.execute("UPDATE probe SET note = 'touched' WHERE n >= ?", [n]).rowcount


def test_a_statement_refused_after_the_write_returned_fails_that_write_alone(pg_store):
    import psycopg

    async def main():
        await pg_store.write(setup)
        results = await asyncio.gather(*(pg_store.write(insert, n, n % 5 == 2)
                                         for n in range(100)), return_exceptions=True)
        for n, result in enumerate(results):
            if n % 5 == 2:
                assert isinstance(result, psycopg.errors.UniqueViolation), (n, result)
            else:
                assert result == n
        rows = await pg_store.read(lambda db: db.execute(
            "SELECT n, note FROM probe ORDER BY n").fetchall())
        assert rows == [(n, "written") for n in range(100) if n % 5 != 2]
        # A rowcount read in the pipeline is the statement's, not "not yet known".
        counts = await asyncio.gather(*(pg_store.write(touch, n) for n in (90, 95, 200)))
        assert counts == [8, 4, 0]

    asyncio.run(main())


def test_a_deposed_leaders_pass_of_several_leases_is_refused_whole(pg_store, tmp_path):
    """Three jobs on three providers, planned by a leader deposed since: none is leased, no
    lease is sent; the new leader's pass leases all three, in one transaction."""
    broker, client = Identity.generate(), Identity.generate()
    keys = [Identity.generate() for _ in range(3)]
    state = broker_state(tmp_path, pg_store, broker, "a")

    async def scenario():
        for key in keys:
            await connect(state, key)
        await pg_store.write(arrays.submit, array_job(client, "j1", 3, 1), 1)
        old = await pg_store.write(leadership.take, "a", now_ms(), TTL)
        new = await pg_store.write(leadership.take, "b", now_ms() + TTL + 1, TTL)
        groups = pg_store.groups
        with pytest.raises(Deposed):
            await scheduler.place_queued(scheduler.as_leader(state, old))
        assert await pg_store.read(lease_rows) == []
        assert all(state.sessions.get(k.id).outbox.empty() for k in keys)
        assert await scheduler.place_queued(scheduler.as_leader(state, new)) == 3
        assert sorted(r[0] for r in await pg_store.read(lease_rows)) == ["j1-1", "j1-2", "j1-3"]
        assert sum(state.sessions.get(k.id).outbox.qsize() for k in keys) == 3
        assert pg_store.groups - groups <= 4       # refused pass, leases, queue reasons

    asyncio.run(scenario())


def test_a_replayed_submission_is_refused_by_its_one_read(store):
    """submit checks the nonce and the job id in one statement (one round trip on
    PostgreSQL): a reused nonce and a reused id are each still refused, on both stores."""
    import dataclasses

    from gpumarket.broker.jobs import transitions
    from gpumarket.proto.errors import Replay

    client = Identity.generate()
    job = array_job(client, "r1", 1, 1)

    async def main():
        await store.write(transitions.submit, job, 1)
        with pytest.raises(Replay, match="already submitted as job r1"):
            await store.write(transitions.submit, dataclasses.replace(job, id="r2"), 2)
        with pytest.raises(Replay, match="job r1 already exists"):
            await store.write(transitions.submit, dataclasses.replace(job, nonce="f" * 32), 3)
        assert await store.read(lambda db: db.execute("SELECT count(*) FROM jobs")
                                .fetchone()[0]) == 1

    asyncio.run(main())
