"""A placement pass writes its leases together (jobs/transitions.create_leases: three
statements for the pass's plain jobs, each run for all their rows at once, where one
``create_lease`` each is three statements a lease). What that must not change: the rows.
The same jobs leased on the same terms, one ``create_lease`` each in one store and
``create_leases`` in another, leave the same rows in ``leases``, ``jobs`` and ``events``
(the signed envelopes included: Ed25519 signs deterministically), on SQLite and on
PostgreSQL; a job no longer queued is left out, as ``create_lease`` refuses it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gpumarket.broker.jobs import job as rows
from gpumarket.broker.jobs import transitions
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.market import placement
from gpumarket.broker.market.admission import Needs, NewJob
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import FailedPrecondition
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import types_pb2 as pb

NOW = 1_700_000_000_000
BROKER = Identity.generate()
CLIENT = Identity.generate()


@pytest.fixture(params=["sqlite", "postgresql"])
def two_stores(request, tmp_path):
    """Two fresh stores of one kind: SQLite files, or databases on the session's cluster."""
    from gpumarket.broker.store.store import Store, open_store

    def fresh(name: str):
        if request.param == "sqlite":
            return Store(Path(tmp_path / f"{name}.db"))
        cluster = request.getfixturevalue("pg_cluster")
        return open_store(cluster.database(template=cluster.template), None)

    stores = [fresh("serial"), fresh("bulk")]
    for s in stores:
        s.open()
    yield stores
    for s in stores:
        s.close()


def new_job(i: int, parts: tuple[int, ...] = ()) -> NewJob:
    spec = seal(CLIENT, pb.JobSpec(name=f"j{i}", kind=pb.JOB_KIND_TRAINING)).SerializeToString()
    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=10.0)
    return NewJob(id=f"job{i:03d}", client_id=CLIENT.id, name=f"j{i}", spec=spec,
                  spec_sha256="0" * 64, needs=needs, expires_at_ms=NOW + 3_600_000,
                  max_attempts=3, nonce=f"{i:032x}", part_sizes=parts)


def queue(db) -> None:
    """Plain jobs, one resuming from a checkpoint on its second attempt, one cancelled, and
    a split job's two parts (leased one by one: their parent follows them)."""
    for i in range(7):
        transitions.submit(db, new_job(i), NOW)
    transitions.submit(db, new_job(7, parts=(10, 20)), NOW)
    rows.update_job(db, "job002", NOW, attempt=2, epoch=1, checkpoint_step=40,
                    resume_from=json.dumps({"name": "ckpt", "sha256": "ab" * 32,
                                            "size_bytes": 9}))
    rows.update_job(db, "job004", NOW, state=pb.JOB_STATE_CANCELLED)


def terms(job_id: str, n: int) -> LeaseTerms:
    return LeaseTerms(job_id=job_id, provider_id=f"prov{n % 3}", device_indices=(n % 2,),
                      price_per_gpu_hour=1.25 + n / 8, accept_within_ms=30_000,
                      checkpoint_every=n, provider_mtbf_s=3600.0 + n,
                      checkpoint_interval_s=60.0 + n, raw_runtime_s=10.0 * n,
                      accelerator=pb.ACCELERATOR_UNSPECIFIED)


IDS = ["job000", "job001", "job002", "job003", "job004", "job005", "job006", "job007-1",
       "job007-2"]


def sign(lease: pb.Lease) -> pb.Envelope:
    return seal(BROKER, lease)


def one_by_one(db) -> list[bytes | None]:
    out = []
    for n, job_id in enumerate(IDS):
        try:
            out.append(transitions.create_lease(db, terms(job_id, n), NOW + 5, sign)
                       .SerializeToString())
        except FailedPrecondition:
            out.append(None)
    return out


def together(db) -> list[bytes | None]:
    current = placement.jobs_by_id(db, IDS)
    made = transitions.create_leases(
        db, [(terms(job_id, n), current[job_id]) for n, job_id in enumerate(IDS)], NOW + 5,
        sign)
    return [None if e is None else e.SerializeToString() for e in made]


def table(db, name: str, order: str) -> list[tuple]:
    return [tuple(r) for r in db.execute(f"SELECT * FROM {name} ORDER BY {order}").fetchall()]


def test_leases_written_together_are_the_rows_written_one_by_one(two_stores):
    serial, bulk = two_stores

    async def scenario():
        for s in two_stores:
            await s.write(queue)
        envelopes = await serial.write(one_by_one), await bulk.write(together)
        seen = [await s.read(lambda db: (table(db, "leases", "id"),
                                        table(db, "jobs", "id"),
                                        table(db, "events", "job_id, seq")))
                for s in two_stores]
        leased = await bulk.read(lambda db: db.execute(
            "SELECT id FROM jobs WHERE state = ?", [pb.JOB_STATE_LEASED]).fetchall())
        return envelopes, seen, {r[0] for r in leased}

    (by_one, by_all), (one, all_), leased = asyncio.run(scenario())
    assert by_all == by_one
    assert [e is None for e in by_all] == [i == 4 for i in range(len(IDS))]
    leases_one, jobs_one, events_one = one
    leases_all, jobs_all, events_all = all_
    assert len(leases_one) == 8
    assert leases_all == leases_one
    assert jobs_all == jobs_one
    # Each job's events, in order (their numbers, ``seq``, differ: the plain jobs' events
    # are written after the parts' here, between them one by one).
    assert [e[1:] for e in events_all] == [e[1:] for e in events_one]
    assert leased == set(IDS) - {"job004"} | {"job007"}     # the parts' parent follows them


def test_update_jobs_sets_a_column_of_nulls_and_varying_values(two_stores):
    """``update_jobs`` sets each job's own values, a NULL among numbers and a column NULL on
    every row included, as ``update_job`` would, and leaves the jobs it was not given."""
    store = two_stores[0]

    def change(db):
        for i in range(3):
            transitions.submit(db, new_job(i), NOW)
        rows.update_jobs(db, {"job000": {"settled_to_ms": 3, "hold_needed": 5},
                              "job001": {"settled_to_ms": None, "hold_needed": 6},
                              "job002": {"settled_to_ms": 4, "hold_needed": 7}}, NOW + 1)
        first = db.execute("SELECT id, settled_to_ms, hold_needed, updated_at_ms FROM jobs"
                           " ORDER BY id").fetchall()
        rows.update_jobs(db, {"job000": {"settled_to_ms": None, "hold_needed": 8},
                              "job002": {"settled_to_ms": None, "hold_needed": 9}}, NOW + 2)
        return first, db.execute("SELECT id, settled_to_ms, hold_needed, updated_at_ms"
                                 " FROM jobs ORDER BY id").fetchall()

    first, then = asyncio.run(store.write(change))
    assert [tuple(r) for r in first] == [("job000", 3, 5, NOW + 1), ("job001", None, 6, NOW + 1),
                                         ("job002", 4, 7, NOW + 1)]
    assert [tuple(r) for r in then] == [("job000", None, 8, NOW + 2),
                                        ("job001", None, 6, NOW + 1),
                                        ("job002", None, 9, NOW + 2)]
