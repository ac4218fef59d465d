"""Jobs with a deadline (tests/test_tiers_rules.py, continued): an interruptible one promoted
to standard once its slack is short and timed on the provider running it; an interruptible or
a standard one leased only where it meets its deadline, and a deadline no offer could meet
refused at submission."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from gpumarket.broker.jobs import preemption as rows
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.jobs import views
from gpumarket.broker.market.matcher import Book
from gpumarket.broker.money import ledger
from gpumarket.broker.store.store import Store
from gpumarket.proto.v1 import types_pb2 as pb

from tests.test_ledger import new_job, sign
from tests.test_tiers_rules import offer


# -- deadlines ---------------------------------------------------------------------------------

def test_a_deadline_promotes_an_interruptible_job_only_once_its_slack_is_short():
    from gpumarket.broker.market import deadlines

    assert deadlines.remaining_s(1000, 250, 1000) == 750
    assert deadlines.remaining_s(1000, 0, 0) == 1000        # steps unknown: all of it
    assert not deadlines.due(2000, 1000)                    # 1000 x 1.5 + 60 < 2000
    assert deadlines.due(1500, 1000)


def test_the_scheduler_promotes_an_interruptible_job_near_its_deadline(tmp_path):
    from gpumarket.broker.market import deadlines

    store = Store(tmp_path / "broker.db")
    store.open()
    state = SimpleNamespace(store=store)

    async def scenario():
        from gpumarket.proto.jobspec import now_ms
        await store.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1)
        # Work of 1e12 FLOPs at 1e9 FLOP/s claimed: 1000 s raw, ~3006 s calibrated (the CPU
        # prior: 6 s + 3x): a day of slack is plenty, ten minutes is not.
        for job_id, deadline in (("late", 600), ("easy", 86_400), ("none", 0)):
            job = new_job(job_id, "ca", 20_000_000, True)
            await store.write(jobs.submit, dataclasses.replace(job, needs=dataclasses.replace(
                job.needs, tier="interruptible", deadline_s=deadline, work_flops=1e12)),
                now_ms())
        await store.write(jobs.create_lease, LeaseTerms("late", "p1", (0,),
                          0.4, 60_000, 10), now_ms(), sign)
        book = Book([dataclasses.replace(offer("p1"), claimed_flops=1e9, flops=1e9)])
        assert await deadlines.promote_due(state, book) == 1
        assert await deadlines.promote_due(state, book) == 0      # once
        late = await store.read(jobs.job_row, "late")
        assert '"tier": "standard"' in late["needs"]
        # Protected from now on, it pays for it: its running lease at p1's standard price
        # (a deadline does not buy standard protection at the interruptible price).
        lease = await store.read(jobs.lease_row, late["lease_id"])
        assert lease["price_per_gpu_hour"] == 1.0
        # Running, it is no longer a lease a standard job may take.
        assert await store.read(rows.interruptible_leases, now_ms()) == []
        events = await store.read(views.events_after, "late", 0)
        assert events[-1].type == "promoted" and "before its deadline" in events[-1].message
        for job_id in ("easy", "none"):
            assert '"tier": "interruptible"' in (await store.read(jobs.job_row, job_id))["needs"]

        # A job whose max_price is below every standard price stays interruptible (it could
        # not run as standard anywhere): a late deadline does not make it cheaper.
        job = new_job("capped", "ca", 20_000_000, True)
        await store.write(jobs.submit, dataclasses.replace(job, needs=dataclasses.replace(
            job.needs, tier="interruptible", deadline_s=600, work_flops=1e12,
            max_price_per_gpu_hour=0.5)), now_ms())
        assert await deadlines.promote_due(state, book) == 0
        assert '"tier": "interruptible"' in (await store.read(jobs.job_row, "capped"))["needs"]

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_a_leased_job_is_timed_on_the_provider_running_it(tmp_path):
    """Fixed (bench/tiers.py found it: jobs placed on a slow free device missed their
    deadlines): a leased job's time left was estimated on the best offer for it, not on the
    device it runs on, so a job on a slow device stayed interruptible (preemptible) until
    even the fast device's estimate ran out."""
    from gpumarket.broker.market import deadlines

    store = Store(tmp_path / "broker.db")
    store.open()
    state = SimpleNamespace(store=store)

    async def scenario():
        from gpumarket.proto.jobspec import now_ms
        await store.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1)
        job = new_job("slow", "ca", 20_000_000, True)
        # 1e13 FLOPs: about 30,000 s calibrated on p1 (1e9 FLOP/s), 300 s on p2 (1e11);
        # 20,000 s to its deadline.
        await store.write(jobs.submit, dataclasses.replace(job, needs=dataclasses.replace(
            job.needs, tier="interruptible", deadline_s=20_000, work_flops=1e13)), now_ms())
        book = Book([dataclasses.replace(offer("p1", busy=frozenset({0})), claimed_flops=1e9,
                                         flops=1e9),
                     dataclasses.replace(offer("p2"), claimed_flops=1e11, flops=1e11)])
        assert await deadlines.promote_due(state, book) == 0     # queued: p2 has the time
        await store.write(jobs.create_lease, LeaseTerms("slow", "p1", (0,),
                          0.4, 60_000, 10), now_ms(), sign)
        assert await deadlines.promote_due(state, book) == 1     # leased to p1: it has not
        assert '"tier": "standard"' in (await store.read(jobs.job_row, "slow"))["needs"]

    try:
        asyncio.run(scenario())
    finally:
        store.close()


# A standard job's deadline is weighed as an interruptible one's (docs/tiers.md, Deadlines):
# before, it took the cheapest offer however slow, and a deadline no offer could meet was
# admitted and missed. Each test below runs for both tiers.
TIERS = pytest.mark.parametrize("tier", ["interruptible", "standard"])


@TIERS
def test_a_job_is_leased_only_where_it_meets_its_deadline(tmp_path, tier):
    """Fixed (bench/tiers.py: jobs waited for devices, then got a slow provider whose run time
    was already past the deadline): an interruptible job's deadline was weighed only when
    its objective was ``deadline``, a standard job's never; now, whatever its objective,
    placement leaves out the offers on which its calibrated time (x MARGIN + SLACK_S: the
    rule that promotes an interruptible job) does not fit before the deadline."""
    from gpumarket.broker.market import deadlines, placement
    from gpumarket.proto.jobspec import now_ms

    store = Store(tmp_path / "broker.db")
    store.open()
    # 1e13 FLOPs: about 30,000 s calibrated on p1 (1e9 FLOP/s, the cheaper), 300 s on p2.
    slow = dataclasses.replace(offer("p1", 0.5, 0.2), claimed_flops=1e9, flops=1e9)
    fast = dataclasses.replace(offer("p2", 1.0, 0.4), claimed_flops=1e11, flops=1e11)

    def book(busy_fast: bool) -> Book:
        return Book([slow, dataclasses.replace(fast, busy=frozenset({0}) if busy_fast
                                               else frozenset())])

    def passes(busy_fast: bool):
        b = book(busy_fast)
        queued = asyncio.run(store.read(placement.read_queue, b, now_ms()))
        return queued, placement.plan(queued, b, {}, {"p1", "p2"}, 60_000)

    try:
        asyncio.run(store.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1))
        job = new_job("late", "ca", 20_000_000, True)
        asyncio.run(store.write(jobs.submit, dataclasses.replace(job, needs=dataclasses.replace(
            job.needs, tier=tier, deadline_s=20_000, work_flops=1e13)), now_ms()))
        queued, p = passes(busy_fast=True)
        assert queued[0].needs.tier == tier
        assert queued[0].needs.too_slow == frozenset({0})       # p1's view
        # It waits for p2 (busy) rather than take p1, the cheapest but late from the start.
        assert p.leases == [] and "not expected to finish before the deadline" \
            in p.reasons["late"]
        assert [job.id for job, _ in p.blocked] == ["late"]
        _, p = passes(busy_fast=False)
        assert [x.terms.provider_id for x in p.leases] == ["p2"]
        # Promoted to standard, it is weighed the same (bench/tiers.py: promoted jobs went to
        # the cheapest offer, however slow, and missed).
        standard = dataclasses.replace(queued[0].needs, tier="standard")
        assert asyncio.run(store.read(deadlines.too_slow, book(True), queued[0].job,
                                      standard)) == frozenset({0})
        # Every offer that fits too slow: none left out, it runs where it can.
        assert asyncio.run(store.read(deadlines.too_slow, Book([slow]), queued[0].job,
                                      queued[0].needs)) == frozenset()
        # Nothing to weigh for a job without a deadline, or a replica (serving).
        assert deadlines.too_slow(None, book(True), None, dataclasses.replace(
            queued[0].needs, deadline_s=0)) == frozenset()
        assert deadlines.too_slow(None, book(True), None, dataclasses.replace(
            queued[0].needs, tier="serving")) == frozenset()
    finally:
        store.close()


@TIERS
def test_a_deadline_no_offer_could_meet_is_refused_at_submission(tmp_path, tier):
    """A job whose deadline is shorter than its calibrated time on the fastest offer that
    fits it is refused (FailedPrecondition, one line, nothing written); a deadline some offer
    can meet is admitted, and so is any deadline while no offer fits (it waits, as any
    job). Standard is the default tier: its job file names none."""
    import grpc

    from gpumarket.broker.market import providers
    from gpumarket.proto.envelope import open_envelope, seal
    from gpumarket.proto.identity import Identity

    from tests.helpers import signed_offer, training_job
    from tests.servicers import Refused, Servicers

    broker = Servicers(tmp_path / "broker")
    try:
        alice = Identity.generate()
        broker.credit(alice, 10_000)
        named = f'tier = "{tier}"\n' if tier != "standard" else ""

        def spec(name: str, deadline: str):
            return broker.spec(alice, training_job(
                tmp_path / f"{name}.toml", steps=3000, extra=f'{named}deadline = "{deadline}"'))

        broker.submit(alice, spec("alone", "1s"))      # no offer yet: queued, it waits
        provider = Identity.generate()
        offer = signed_offer(provider, flops=1e6)       # a very slow CPU: hours for it
        parsed, _ = open_envelope(offer, pb.Offer)
        broker.write(providers.online, provider.id, provider.public_key, 1)
        broker.write(providers.store_offer, provider.id, offer.SerializeToString(), parsed, 1)
        session = broker.state.sessions.open(provider.id)
        session.offer, session.offer_envelope = parsed, seal(provider, parsed)
        before = broker.counts()
        with pytest.raises(Refused) as caught:
            broker.submit(alice, spec("short", "60s"))
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert caught.value.message.startswith("deadline: 60 s is too short: this job would"
                                               " take about ")
        assert "on the fastest offer that fits it" in caught.value.message
        assert "\n" not in caught.value.message
        assert broker.counts() == before                     # nothing written or held
        broker.submit(alice, spec("ample", "30d"))
        assert broker.counts()["jobs"] == before["jobs"] + 1
    finally:
        broker.close()
