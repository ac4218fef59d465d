"""A standard job's deadline is weighed as an interruptible job's is (docs/tiers.md,
Deadlines): placement leases it only where its calibrated time (x MARGIN + SLACK_S) fits
before the deadline, and admission refuses a deadline no offer could meet
(FAILED_PRECONDITION, one line, nothing written). Before, a standard job's deadline was
neither: it took the cheapest offer however slow, and a deadline no offer could meet was
admitted and missed."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.market import deadlines, placement
from gpumarket.broker.market.matcher import Book
from gpumarket.broker.money import ledger
from gpumarket.broker.store.store import Store
from gpumarket.proto.jobspec import now_ms

from tests.test_ledger import new_job
from tests.test_tiers_rules import offer


def test_a_standard_job_with_a_deadline_is_leased_only_where_it_meets_it(tmp_path):
    store = Store(tmp_path / "broker.db")
    store.open()
    # 1e13 FLOPs: about 30,000 s calibrated on p1 (1e9 FLOP/s, the cheaper), 300 s on p2;
    # 20,000 s to its deadline.
    slow = dataclasses.replace(offer("p1", 0.5, 0.2), claimed_flops=1e9, flops=1e9)
    fast = dataclasses.replace(offer("p2", 1.0, 0.4), claimed_flops=1e11, flops=1e11)

    def passes(busy_fast: bool):
        book = Book([slow, dataclasses.replace(fast, busy=frozenset({0}) if busy_fast
                                               else frozenset())])
        queued = asyncio.run(store.read(placement.read_queue, book, now_ms()))
        return queued, placement.plan(queued, book, {}, {"p1", "p2"}, 60_000)

    try:
        asyncio.run(store.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1))
        job = new_job("std", "ca", 20_000_000, True)
        asyncio.run(store.write(jobs.submit, dataclasses.replace(job, needs=dataclasses.replace(
            job.needs, tier="standard", deadline_s=20_000, work_flops=1e13)), now_ms()))
        queued, p = passes(busy_fast=True)
        assert queued[0].needs.tier == "standard"
        assert queued[0].needs.too_slow == frozenset({0})       # p1's view
        # It waits for p2 rather than take p1, the cheapest but late from the start.
        assert p.leases == [] and "not expected to finish before the deadline" \
            in p.reasons["std"]
        _, p = passes(busy_fast=False)
        assert [x.terms.provider_id for x in p.leases] == ["p2"]
        # Every offer that fits too slow: none left out, it runs where it can.
        assert asyncio.run(store.read(deadlines.too_slow, Book([slow]), queued[0].job,
                                      queued[0].needs)) == frozenset()
    finally:
        store.close()


def test_a_standard_deadline_no_offer_could_meet_is_refused_at_submission(tmp_path):
    from gpumarket.broker.market import providers
    from gpumarket.proto.envelope import open_envelope, seal
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import types_pb2 as pb

    from tests.helpers import signed_offer, training_job
    from tests.servicers import Refused, Servicers

    broker = Servicers(tmp_path / "broker")
    try:
        alice = Identity.generate()
        broker.credit(alice, 10_000)

        def spec(name: str, deadline: str):
            return broker.spec(alice, training_job(
                tmp_path / f"{name}.toml", steps=3000, extra=f'deadline = "{deadline}"'))

        provider = Identity.generate()
        offer_ = signed_offer(provider, flops=1e6)      # a very slow CPU: hours for it
        parsed, _ = open_envelope(offer_, pb.Offer)
        broker.write(providers.online, provider.id, provider.public_key, 1)
        broker.write(providers.store_offer, provider.id, offer_.SerializeToString(), parsed, 1)
        session = broker.state.sessions.open(provider.id)
        session.offer, session.offer_envelope = parsed, seal(provider, parsed)
        before = broker.counts()
        with pytest.raises(Refused) as caught:
            broker.submit(alice, spec("short", "60s"))       # standard: the default tier
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert caught.value.message.startswith("deadline: 60 s is too short: this job would"
                                               " take about ")
        assert "\n" not in caught.value.message
        assert broker.counts() == before                     # nothing written or held
        broker.submit(alice, spec("ample", "30d"))
        assert broker.counts()["jobs"] == before["jobs"] + 1
    finally:
        broker.close()
