"""The broker's store commits writes queued together in one transaction (group commit):
each write still lands whole or not at all, in the order it was queued, and its caller is
answered only once it is committed. On SQLite and on PostgreSQL (the ``store`` fixture)."""

from __future__ import annotations

import asyncio

import pytest


def insert(db, n: int, fail: bool = False) -> int:
    db.execute("INSERT INTO probe (n) VALUES (?)", [n])
    if fail:
        raise ValueError(f"write {n} fails after its insert")
    return n


def setup(db) -> None:
    key = "BIGSERIAL" if getattr(db, "dialect", "") == "postgresql" else "INTEGER"
    db.execute(f"CREATE TABLE IF NOT EXISTS probe (seq {key} PRIMARY KEY, n INTEGER)")


def test_writes_queued_together_commit_together_and_each_is_whole(store):

    async def main():
        await store.write(setup)
        groups_before = store.groups
        results = await asyncio.gather(*(store.write(insert, n, n % 7 == 3) for n in range(300)),
                                       return_exceptions=True)
        for n, result in enumerate(results):
            if n % 7 == 3:
                assert isinstance(result, ValueError) and str(n) in str(result)
            else:
                assert result == n
        # Every caller was answered after its commit: a reader sees exactly the rows of the
        # writes that succeeded, none of those that failed.
        rows = await store.read(lambda db: [r[0] for r in db.execute(
            "SELECT n FROM probe ORDER BY seq").fetchall()])
        assert rows == [n for n in range(300) if n % 7 != 3]      # in queued order
        assert store.groups - groups_before < 300                  # fewer commits than writes
    asyncio.run(main())


def test_a_write_outside_a_transaction_still_runs_alone(store):

    async def main():
        await store.write(setup)
        vacuum = store.write(lambda db: db.execute("VACUUM"), transaction=False)
        writes = [store.write(insert, n) for n in range(5)]
        await asyncio.gather(vacuum, *writes)
        assert await store.read(lambda db: db.execute("SELECT count(*) FROM probe")
                                .fetchone()[0]) == 5
        with pytest.raises(ValueError):
            await store.write(insert, 9, True)
        assert await store.read(lambda db: db.execute("SELECT count(*) FROM probe")
                                .fetchone()[0]) == 5
    asyncio.run(main())


def test_a_strangers_string_with_a_nul_is_stored(store):
    """PostgreSQL's text cannot hold NUL (SQLite's can): a provider's log line or error with
    one must not fail the write that carries it (there it is kept as U+FFFD)."""
    from gpumarket.broker.market import providers

    async def main():
        await store.write(providers.revoke, "k" * 26, "bad\x00reason", 1)
        (reason,) = await store.read(lambda db: db.execute(
            "SELECT reason FROM revoked_keys").fetchone())
        assert reason.replace("\ufffd", "\x00") == "bad\x00reason"
    asyncio.run(main())
