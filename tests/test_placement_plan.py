"""Placement's plan (broker/market/placement.plan) as a plain function: queued jobs in their
placement context and a Book of offers in, the leases to make (their LeaseTerms), why the
rest waits and which wait for a busy device out — no store, no clock, no network."""

from __future__ import annotations

import dataclasses

from gpumarket.broker.jobs.job import COLUMNS, Job, LeaseTerms
from gpumarket.broker.market import placement, reliability
from gpumarket.broker.market.admission import Needs
from gpumarket.broker.market.matcher import Book, OfferView, Policy
from gpumarket.broker.money import credit_holds
from gpumarket.proto.v1 import types_pb2 as pb

TRAIN, CUDA = pb.JOB_KIND_TRAINING, pb.ACCELERATOR_CUDA
ACCEPT_MS = 60_000


def job(job_id: str, client: str = "alice", created: int = 1, **values) -> Job:
    row = {c: 0 for c in COLUMNS}
    row.update(id=job_id, client_id=client, name=job_id, kind=TRAIN, state=pb.JOB_STATE_QUEUED,
               spec=b"", spec_sha256="0" * 64, expires_at_ms=10**13, attempt=1, max_attempts=3,
               provider_id=None, lease_id=None, progress_metrics="{}", error="",
               queue_reason="", receipt=None, resume_from=None, created_at_ms=created,
               updated_at_ms=created, parent_id=None, needs="{}", hold_basis="",
               settled_to_ms=None, check_of=None, pays_from=None)
    row.update(values)
    return Job.from_row(row)


def queued(j: Job, hold_left: int | None = None, **needs) -> placement.Queued:
    stored = Needs(kind=TRAIN, gpus=1, min_memory_bytes=0, accelerator=CUDA,
                   max_price_per_gpu_hour=10.0, **needs)
    return placement.Queued(j, stored, stored.view(j.id, j.client_id,
                                                   checkpoint_cost_s=j.checkpoint_seconds),
                            hold_left)


def offer(pid: str, price: float = 1.0, n: int = 1, busy=(), mtbf: float = 86400.0):
    return OfferView(pid, price, frozenset({TRAIN}), tuple(range(n)), CUDA, 80 << 30, 9.0,
                     "NVIDIA H100", 1e14, 0.9, mtbf, Policy(), frozenset(busy), 0)


def plan(jobs, offers, online=None, running=None, **reserve):
    book = Book(offers)
    online = {o.provider_id for o in offers} if online is None else online
    return placement.plan(jobs, book, running or {}, online, ACCEPT_MS, **reserve)


def test_a_planned_lease_carries_its_terms():
    j = job("j", checkpoint_seconds=30.0)
    cheap = offer("cheap", 1.0, n=2, mtbf=7200.0)
    p = plan([queued(j, checkpoint_every=50, work_flops=2e18)], [offer("dear", 3.0), cheap])
    [lease] = p.leases
    assert lease.job is j and not p.reasons and not p.blocked
    assert lease.terms == LeaseTerms(
        job_id="j", provider_id="cheap", device_indices=(0,), price_per_gpu_hour=1.0,
        accept_within_ms=ACCEPT_MS, checkpoint_every=50, provider_mtbf_s=7200.0,
        checkpoint_interval_s=reliability.checkpoint_interval_s(30.0, 7200.0),
        raw_runtime_s=credit_holds.raw_seconds(2e18, cheap, 1), accelerator=CUDA)
    assert lease.terms.raw_runtime_s > 0


def test_the_parts_of_a_split_job_go_to_different_providers_in_one_pass():
    """A sibling planned earlier in the same pass is avoided as one leased before is (the
    read saw neither as busy)."""
    parts = [job(f"s-{i}", parent_id="s", part=i, parts=2) for i in (1, 2)]
    p = plan([queued(x) for x in parts], [offer("a", 1.0, n=2), offer("b", 2.0, n=2)])
    assert [(x.job.id, x.terms.provider_id) for x in p.leases] == [("s-1", "a"), ("s-2", "b")]


def test_higher_tiers_first_then_one_job_per_client_in_turn():
    jobs = [queued(job("i", "carol", created=1), tier="interruptible"),
            queued(job("a1", "alice", created=2)), queued(job("a2", "alice", created=3)),
            queued(job("b1", "bob", created=4))]
    p = plan(jobs, [offer("p", n=3)], running={"alice": 1})
    assert [x.job.id for x in p.leases] == ["b1", "a1", "a2"]
    assert p.reasons["i"].startswith("waiting: of 1 offers") and p.blocked[0][0].id == "i"


def test_a_hold_that_cannot_pay_leaves_the_device_to_the_next_job():
    floor = credit_holds.floor_units(1.0, 1)
    poor = job("poor", "alice", created=1, enforce_funds=1)
    rich = job("rich", "bob", created=2, enforce_funds=1)
    p = plan([queued(poor, hold_left=floor - 1), queued(rich, hold_left=floor)],
             [offer("p", 1.0)])
    assert [x.job.id for x in p.leases] == ["rich"]
    assert p.reasons == {"poor": "waiting for funds: its hold covers less than"
                         f" {credit_holds.RESUME_FLOOR_S} s of the best offer"
                         " (gpumarket topup poor AMOUNT)"}


def test_a_reason_is_written_only_when_it_changed_and_an_offline_provider_gets_nothing():
    busy = [offer("p", busy={0})]
    first = plan([queued(job("j"))], busy)
    reason = first.reasons["j"]
    assert "busy" in reason and [b[0].id for b in first.blocked] == ["j"]
    again = plan([queued(job("j", queue_reason=reason))], busy)
    assert again.reasons == {} and len(again.blocked) == 1
    gone = plan([queued(job("j"))], [offer("p")], online=set())
    assert gone.leases == [] and gone.reasons == {}


def test_the_plan_only_reads_what_it_is_given():
    """The same input, the same plan (a check's draw is made when the queue is read)."""
    jobs = [queued(job(f"j{i}", f"c{i % 3}", created=i)) for i in range(6)]
    offers = [offer(f"p{i}", 1.0 + i / 10, n=2) for i in range(4)]
    once, twice = plan(jobs, offers), plan(jobs, offers)
    assert [dataclasses.astuple(x.terms) for x in once.leases] == \
        [dataclasses.astuple(x.terms) for x in twice.leases]
    assert len(once.leases) == 6


def test_standard_jobs_leave_the_serving_reserve_free_or_interruptible():
    """config serving_reserve: a standard job is leased (or preempts) only while that many
    devices stay free or held by interruptible leases, for an endpoint's replicas under a
    spike; a replica and an interruptible job take them."""
    def jobs():
        return [queued(job("s1", created=1)), queued(job("s2", created=2)),
                queued(job("r", created=3), tier="serving"),
                queued(job("i", created=4), tier="interruptible")]

    # Four free: the replica takes one, s1 one (two left), s2 would leave one: it waits.
    p = plan(jobs(), [offer("p", n=4)], reserve=2)
    assert sorted(x.job.id for x in p.leases) == ["i", "r", "s1"]
    assert p.reasons["s2"] == ("waiting: 2 devices are kept free or interruptible for"
                               " endpoint replicas (2 are)")
    assert not p.blocked
    # Two devices held by interruptible leases count as spare: s2 is leased too.
    p = plan(jobs(), [offer("p", n=4)], reserve=2, interruptible=2)
    assert sorted(x.job.id for x in p.leases) == ["i", "r", "s1", "s2"]
    # A job its deadline promoted to standard is not held back: it is standard to be on time.
    promoted = jobs()
    promoted[1] = queued(job("s2", created=2), promoted=True)
    p = plan(promoted, [offer("p", n=4)], reserve=2)
    assert sorted(x.job.id for x in p.leases) == ["i", "r", "s1", "s2"]
    assert "s2" not in p.reasons
    # No reserve (the default): first come, first served, as before.
    p = plan(jobs(), [offer("p", n=4)])
    assert sorted(x.job.id for x in p.leases) == ["i", "r", "s1", "s2"]
