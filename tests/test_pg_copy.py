"""`gpumarket-broker copy-store`: a market that began on one SQLite broker moves, whole, to
a PostgreSQL store that several brokers can share (docs/deploy.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import subprocess

import pytest

from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs import views
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.money import ledger
from gpumarket.broker.store.copy import copy_to_postgres
from gpumarket.broker.store.store import Store, open_store
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import FailedPrecondition, InvalidArgument, NotFound
from gpumarket.proto.identity import Identity
from gpumarket.proto.money import UNIT
from tests.helpers import BIN
from tests.test_broker_domain import new_job


def test_a_sqlite_market_is_copied_whole_and_once(tmp_path, pg_cluster):
    broker, client, operator = Identity.generate(), Identity.generate(), Identity.generate()
    path = tmp_path / "broker.db"
    source = Store(path)
    source.open()

    async def market():
        w = source.write
        await w(ledger.credit, client.id, 50 * UNIT, "client", "funds", operator.id, "o1", 1)
        await w(jobs.submit, dataclasses.replace(new_job(client), part_sizes=(3, 3)), 2)
        await w(jobs.create_lease, LeaseTerms("j1-1", "p1", (0,), 1.0, 60_000, 10), 3,
                lambda lease: seal(broker, lease))
        await w(jobs.mark_started, "j1-1", 1, "p1", 4)
        return await source.read(views.get_job, "j1"), await source.read(ledger.audit_report)
    job, books = asyncio.run(market())
    source.close()

    url = pg_cluster.database()             # a new, empty database
    copied = copy_to_postgres(path, url)
    assert copied["jobs"] == 3 and copied["leases"] == 1 and copied["ledger_postings"] >= 1
    target = open_store(url, None)
    target.open()
    try:
        async def read_back():
            # New rows go on after the copied ones (identities restarted past them).
            await target.write(lambda db: db.execute(
                "INSERT INTO events (job_id, at_ms, type, state, attempt) VALUES"
                " ('j1', 9, 'after the copy', 1, 0)"))
            return (await target.read(views.get_job, "j1"),
                    await target.read(ledger.audit_report),
                    await target.read(jobs.job_row, "j1-2"))
        again, books_there, part = asyncio.run(read_back())
    finally:
        target.close()
    assert again.parts == job.parts and again.state == job.state   # the parent and its parts
    assert books_there == books and books_there[0] == []
    assert part.parent_id == "j1"             # a row naming its own table's row, kept

    # Once only: a database that already holds a market is refused, with nothing written.
    with pytest.raises(FailedPrecondition, match="already holds a market"):
        copy_to_postgres(path, url)
    # A source being written meanwhile would lose what came after the snapshot: refused.
    busy = pg_cluster.database()
    db = sqlite3.connect(path)

    def said(line: str) -> None:
        if line.startswith("jobs:"):
            db.execute("INSERT INTO events (job_id, at_ms, type, state, attempt) VALUES"
                       " ('j1', 9, 'meanwhile', 1, 0)")
            db.commit()
    with pytest.raises(FailedPrecondition, match="changed while it was copied"):
        copy_to_postgres(path, busy, said=said)
    db.close()
    with pytest.raises(InvalidArgument, match="no such database"):
        copy_to_postgres(tmp_path / "nothing.db", busy)
    (tmp_path / "text.db").write_text("not a database at all, " * 100)
    with pytest.raises(InvalidArgument, match="not a broker database"):
        copy_to_postgres(tmp_path / "text.db", busy)
    # ... and nothing of either was written.
    empty = open_store(busy, None)
    empty.open()
    try:
        with pytest.raises(NotFound):
            asyncio.run(empty.read(views.get_job, "j1"))
    finally:
        empty.close()


def test_copy_store_says_what_is_wrong_in_one_line(tmp_path):
    r = subprocess.run([str(BIN / "gpumarket-broker"), "copy-store", str(tmp_path / "x.db"),
                        "postgresql://nobody@/none?host=/nonexistent"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no such database" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([str(BIN / "gpumarket-broker"), "copy-store", str(tmp_path / "x.db"),
                        "mysql://x"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "give a postgresql://" in r.stderr, r.stderr
