"""What a serving replica may take, one rule for the serving reserve and the preemption pass
(broker/market/preemption.replica_may_take), and a preemption not undone by either: devices
freed for a job go to that job or to the next replica, not back to an interruptible job
(bench/tiers.py ``preemptions_undone``)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from gpumarket.broker.jobs import preemption as rows
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs import views
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.market import preemption
from gpumarket.broker.market.matcher import Book
from gpumarket.broker.money import ledger
from gpumarket.broker.store.store import Store
from gpumarket.proto.jobspec import now_ms

from tests.test_ledger import new_job, sign
from tests.test_tiers_rules import needs, offer


class Session:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def test_a_replicas_second_set_goes_to_the_next_replica_not_back(tmp_path, monkeypatch):
    """A replica preempts two leases and is leased the first device freed; the other lease,
    still yielding, is then the next replica's (no new preemption), and the reserve counts
    it as a replica's while no queued job waits for it — a standard job does not take it."""
    monkeypatch.setattr(preemption, "SERVING_BACKUP", True)
    store = Store(tmp_path / "broker.db")
    store.open()
    session = Session()
    state = SimpleNamespace(store=store, config=SimpleNamespace(preempt_grace_s=30.0),
                            sessions=SimpleNamespace(get=lambda pid: session))

    async def leases() -> dict[str, rows.Interruptible]:
        return {x.job_id: x for x in await store.read(rows.interruptible_leases, now_ms())}

    async def scenario():
        await store.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1)
        for job_id, tier in (("i1", "interruptible"), ("i2", "interruptible"),
                             ("i3", "interruptible"), ("r1", "serving"), ("r2", "serving"),
                             ("s", "standard")):
            j = new_job(job_id, "ca", 10_000_000, True)
            await store.write(jobs.submit, dataclasses.replace(
                j, needs=dataclasses.replace(j.needs, tier=tier)), 1)
        for job_id, provider in (("i1", "p1"), ("i2", "p2"), ("i3", "p3")):
            await store.write(jobs.create_lease, LeaseTerms(job_id, provider, (0,), 0.4,
                                                            60_000, 10), 2, sign)
        book = Book([offer(p, busy=frozenset({0})) for p in ("p1", "p2", "p3")])
        held = list((await leases()).values())
        assert preemption.replica_may_take(held) == held
        assert await preemption.preempt_for_waiting(state, book, [needs("r1", "serving")]) == 2
        held = await leases()
        yielding = sorted(j for j, x in held.items() if x.preempt_for == "r1")
        assert len(yielding) == 2
        # While r1 waits, both are its: neither a replica's spare nor the reserve's.
        assert [x.job_id for x in preemption.replica_may_take(list(held.values()))] == \
            sorted(set(held) - set(yielding))
        # The first yields; r1 is leased its device. The other still yields, to nobody waiting.
        first, second = yielding
        assert await store.write(rows.end, held[first].lease_id, "preempted", now_ms())
        await store.write(jobs.create_lease, LeaseTerms("r1", held[first].provider_id, (0,),
                                                        1.0, 60_000, 10), 3, sign)
        held = await leases()
        assert not held[second].for_waiting
        assert {x.job_id for x in preemption.replica_may_take(list(held.values()))} == \
            set(held)
        # The next replica waits for it: nothing new preempted, nothing sent.
        sent = len(session.sent)
        assert await preemption.preempt_for_waiting(state, book, [needs("r2", "serving")]) == 0
        assert len(session.sent) == sent
        held = await leases()
        assert held[second].preempt_for == "r2" and held[second].for_waiting
        # A standard job takes no lease yielding to a replica: it preempts the third.
        (third,) = set(held) - {second}
        assert await preemption.preempt_for_waiting(state, book, [needs("s", "standard")]) == 1
        assert (await leases())[third].preempt_for == "s"

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_a_lease_left_yielding_by_a_standard_job_is_handed_on_not_preempted_anew(tmp_path):
    """A standard job preempts a lease, then is leased elsewhere first: that lease still
    yields, to nobody waiting. The next standard job waiting takes it (nothing new
    preempted, nothing sent) rather than preempt another lease while this one's devices
    go back to an interruptible job, most often the one just preempted from them
    (bench/tiers.py ``preemptions_undone_yielded_to_leased_first``)."""
    store = Store(tmp_path / "broker.db")
    store.open()
    session = Session()
    state = SimpleNamespace(store=store, sessions=SimpleNamespace(get=lambda pid: session),
                            config=SimpleNamespace(preempt_grace_s=30.0, lease_timeout_s=15.0))

    async def leases() -> dict[str, rows.Interruptible]:
        return {x.job_id: x for x in await store.read(rows.interruptible_leases, now_ms())}

    async def scenario():
        await store.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1)
        for job_id, tier in (("i1", "interruptible"), ("i2", "interruptible"),
                             ("s1", "standard"), ("s2", "standard")):
            j = new_job(job_id, "ca", 10_000_000, True)
            await store.write(jobs.submit, dataclasses.replace(
                j, needs=dataclasses.replace(j.needs, tier=tier)), 1)
        for job_id, provider in (("i1", "p1"), ("i2", "p2")):
            await store.write(jobs.create_lease, LeaseTerms(job_id, provider, (0,), 0.4,
                                                            60_000, 10), 2, sign)
        book = Book([offer(p, busy=frozenset({0})) for p in ("p1", "p2")])
        assert await preemption.preempt_for_waiting(state, book, [needs("s1")]) == 1
        (asked,) = [x for x in (await leases()).values() if x.preempt_for == "s1"]
        # s1 is leased on a device freed elsewhere before this lease yields.
        await store.write(jobs.create_lease, LeaseTerms("s1", "p3", (0,), 1.0, 60_000, 10), 3,
                          sign)
        assert not (await leases())[asked.job_id].for_waiting
        sent = len(session.sent)
        assert await preemption.preempt_for_waiting(state, book, [needs("s2")]) == 0
        assert len(session.sent) == sent
        held = await leases()
        assert (held[asked.job_id].preempt_for, held[asked.job_id].for_waiting) == ("s2", True)
        (other,) = set(held) - {asked.job_id}
        assert held[other].preempt_for == ""
        told = (await store.read(views.events_after, asked.job_id, 0))[-1]
        assert (told.type, told.message) == ("preempting", "its devices go to s2 (standard)"
                                             " instead: the job it was yielding to, s1, no"
                                             " longer waits for them")

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_a_job_preempts_only_where_it_would_be_placed_in_time():
    """A standard job whose deadline rules an offer out (``too_slow``, as the placement pass
    weighs it) preempts nothing there: the devices would go back to the interruptible job
    just preempted from them, and the job would preempt again at the next pass."""
    book = Book([offer("p1", busy=frozenset({0})), offer("p2", busy=frozenset({0}))])
    leases = [rows.Interruptible("a.1", "a", 1, "p1", (0,), 0, ""),
              rows.Interruptible("b.1", "b", 1, "p2", (0,), 5, "")]
    job = needs("s", "standard")
    assert preemption.choose(book, job, leases) == [leases[0]]      # the least unsaved work
    slow_p1 = dataclasses.replace(job, too_slow=frozenset({0}))
    assert preemption.placeable_views(book, slow_p1) == [1]
    assert preemption.choose(book, slow_p1, leases) == [leases[1]]
    neither = dataclasses.replace(job, too_slow=frozenset({0, 1}))
    assert preemption.choose(book, neither, leases) == []
    # The deadline objective's own test (expected time within the deadline) as well.
    hurried = dataclasses.replace(job, objective="deadline", deadline_s=1e-3)
    assert preemption.placeable_views(book, hurried) == []
    assert preemption.choose(book, hurried, leases) == []
